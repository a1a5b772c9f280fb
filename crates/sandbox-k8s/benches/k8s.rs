//! `cargo xtask bench k8s`: the Kubernetes backend against the k8s test cluster, next to the
//! Docker backend on the same engine and the same Debian userland (the pod image is built FROM
//! the Debian test image), in one run. Phases: a cold claim (no warm pool: the controller
//! starts the pod) to the first exec, a warm-pool claim to the first exec, and the exec round
//! trip of `true`. Writes `target/bench/k8s.json`. Medians; nothing is asserted about time.

use std::time::{Duration, Instant};

use k8s_testcluster::{DEFAULT_POOL, TestCluster, TestClusterOptions};
use sandbox_core::{BoxHandle, CreateRequest, ExecRequest, SandboxClient, WorkspaceSpec};
use sandbox_docker::{DockerClient, DockerOptions, PullPolicy};
use sandbox_k8s::{ClusterAccess, K8sClient, K8sOptions};

const DEBIAN: &str = "sandbox-harness-test/debian:latest";
const ROUNDS: usize = 5;
const EXECS: usize = 200;

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

struct Row {
    phase: &'static str,
    k8s_ms: f64,
    docker_ms: f64,
}

async fn first_exec(client: &dyn SandboxClient) -> (f64, Box<dyn BoxHandle>) {
    let t = Instant::now();
    let h = client
        .create(CreateRequest::new(&WorkspaceSpec::default(), None))
        .await
        .expect("create");
    h.boot().await.expect("boot");
    let r = h.exec(ExecRequest::argv(["true"])).await.expect("exec");
    assert!(r.success(), "{r:?}");
    (ms(t.elapsed()), h)
}

async fn exec_median(h: &dyn BoxHandle) -> f64 {
    let mut v = Vec::with_capacity(EXECS);
    for _ in 0..EXECS {
        let t = Instant::now();
        let r = h.exec(ExecRequest::argv(["true"])).await.expect("exec");
        v.push(ms(t.elapsed()));
        assert!(r.success(), "{r:?}");
    }
    median(v)
}

/// A cluster serving the pod image, `warm` pods kept ready per pool; its kubeconfig in `dir`.
async fn cluster(warm: u32, dir: &std::path::Path) -> (TestCluster, K8sOptions) {
    let image = std::env::var("SANDBOX_K8S_POD_IMAGE")
        .unwrap_or_else(|_| "sandbox-harness-test/k8s-pod:latest".to_owned());
    let cluster = TestCluster::start(TestClusterOptions {
        pod_image: Some(image),
        warm_pool_replicas: warm,
        ..TestClusterOptions::default()
    })
    .await
    .expect("test cluster");
    let kubeconfig = dir.join(format!("kubeconfig-{warm}"));
    cluster.write_kubeconfig(&kubeconfig).expect("kubeconfig");
    let options = K8sOptions::new(DEFAULT_POOL)
        .namespace(cluster.namespace())
        .workspace_root("/app")
        .file_api_base_dir(Some("/app".into()))
        .cluster(ClusterAccess::Kubeconfig(kubeconfig))
        .name_prefix(format!("b{warm}"))
        .ready_timeout(Duration::from_secs(120));
    (cluster, options)
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let dir = tempfile::tempdir().expect("tmp");
    let docker = DockerClient::new(
        DockerOptions::new(DEBIAN)
            .name_prefix(format!(
                "sbxk8sbench{}",
                &uuid::Uuid::new_v4().simple().to_string()[..6]
            ))
            .pull_policy(PullPolicy::Never),
    )
    .expect("docker client");
    docker
        .ensure_image()
        .await
        .expect("image (run `cargo xtask images`)");
    let mut rows = Vec::new();

    // Cold: no warm pool, so every claim waits for the controller to start its pod.
    let (cold_cluster, cold) = cluster(0, dir.path()).await;
    let k8s = K8sClient::new(cold).expect("k8s client");
    let (mut k, mut d) = (vec![], vec![]);
    for _ in 0..ROUNDS {
        let (t, h) = first_exec(&k8s).await;
        k.push(t);
        h.destroy().await.expect("destroy");
        let (t, h) = first_exec(&docker).await;
        d.push(t);
        h.destroy().await.expect("destroy");
    }
    rows.push(Row {
        phase: "cold claim / create to first exec",
        k8s_ms: median(k),
        docker_ms: median(d),
    });
    drop(cold_cluster);

    // Warm: a pod of the pool is adopted; the pool refills between rounds (not timed).
    let (warm_cluster, warm) = cluster(1, dir.path()).await;
    let k8s = K8sClient::new(warm).expect("k8s client");
    let mut k = vec![];
    let mut kept = None;
    for _ in 0..ROUNDS {
        tokio::time::sleep(Duration::from_secs(3)).await;
        let (t, h) = first_exec(&k8s).await;
        k.push(t);
        if let Some(old) = kept.replace(h) {
            old.destroy().await.expect("destroy");
        }
    }
    let k8s_box = kept.expect("a box");
    let (_, docker_box) = first_exec(&docker).await;
    rows.push(Row {
        phase: "warm-pool claim to first exec (Docker: create to first exec)",
        k8s_ms: median(k),
        docker_ms: rows[0].docker_ms,
    });
    rows.push(Row {
        phase: "exec round trip `true` x200",
        k8s_ms: exec_median(&*k8s_box).await,
        docker_ms: exec_median(&*docker_box).await,
    });
    k8s_box.destroy().await.expect("destroy");
    docker_box.destroy().await.expect("destroy");
    drop(warm_cluster);

    let out: Vec<_> = rows
        .iter()
        .map(|r| {
            serde_json::json!({
                "phase": r.phase,
                "k8s_ms": (r.k8s_ms * 10.0).round() / 10.0,
                "docker_ms": (r.docker_ms * 10.0).round() / 10.0,
                "ratio": ((r.k8s_ms / r.docker_ms) * 100.0).round() / 100.0,
            })
        })
        .collect();
    let target = std::env::var_os("SANDBOX_BENCH_OUT")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|| {
            std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../target/bench")
        });
    std::fs::create_dir_all(&target).expect("mkdir");
    let path = target.join("k8s.json");
    std::fs::write(&path, serde_json::to_string_pretty(&out).expect("json")).expect("write");
    println!("| phase | k8s (test cluster) ms | Docker backend ms | ratio |");
    println!("| --- | ---: | ---: | ---: |");
    for r in &rows {
        println!(
            "| {} | {:.1} | {:.1} | {:.2} |",
            r.phase,
            r.k8s_ms,
            r.docker_ms,
            r.k8s_ms / r.docker_ms
        );
    }
    println!("wrote {}", path.display());
}
