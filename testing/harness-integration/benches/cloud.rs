//! `cargo xtask bench cloud`: the E2B and Daytona backends against their test servers, next
//! to the Docker backend on the same engine and the same Debian userland (each test sandbox is
//! a container of the pod image `SANDBOX_K8S_POD_IMAGE`, built FROM the Debian test image), in
//! one run. Phases: create
//! to the first exec (cold start), and the exec round trip of `true`. Writes
//! `target/bench/cloud.json`. Medians; nothing is asserted about time.
//!
//! What the figures include: the test servers run on loopback and forward envd's and the
//! toolbox's calls to `sandboxd` in the container, one hop a real cloud also has (its proxy);
//! a real cloud adds the WAN round trip, which nothing here measures.

use std::time::{Duration, Instant};

use daytona_testserver::{DaytonaTestServer, TestServerOptions};
use e2b_testserver::{E2bTestServer, E2bTestServerOptions};
use sandbox_core::{BoxHandle, CreateRequest, ExecRequest, SandboxClient, WorkspaceSpec};
use sandbox_daytona::{DaytonaClient, DaytonaOptions};
use sandbox_docker::{DockerClient, DockerOptions, PullPolicy};
use sandbox_e2b::{E2bClient, E2bOptions, Secret};

const DEBIAN: &str = "sandbox-harness-test/debian:latest";
const ROUNDS: usize = 5;
const EXECS: usize = 100;

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
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

/// Cold starts (each box destroyed after), then the exec median on one more box.
async fn measure(client: &dyn SandboxClient) -> (f64, f64) {
    let mut cold = Vec::new();
    for _ in 0..ROUNDS {
        let (t, h) = first_exec(client).await;
        cold.push(t);
        h.destroy().await.expect("destroy");
    }
    let (_, h) = first_exec(client).await;
    let exec = exec_median(&*h).await;
    h.destroy().await.expect("destroy");
    (median(cold), exec)
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let tag = uuid::Uuid::new_v4().simple().to_string()[..6].to_owned();

    let docker = DockerClient::new(
        DockerOptions::new(DEBIAN)
            .name_prefix(format!("sbxcloudbench{tag}"))
            .pull_policy(PullPolicy::Never),
    )
    .expect("docker client");
    docker
        .ensure_image()
        .await
        .expect("image (run `cargo xtask images`)");

    let e2b_server = E2bTestServer::start(E2bTestServerOptions::default())
        .await
        .expect("e2b test server");
    let e2b = E2bClient::new(
        E2bOptions::new(Secret::new(e2b_server.api_key()))
            .domain(e2b_server.domain())
            .api_url(e2b_server.api_url())
            .sandbox_url(Some(e2b_server.envd_url()))
            .owner(format!("be{tag}"))
            .workspace_root("/workspace"),
    )
    .expect("e2b client");

    let daytona_server = DaytonaTestServer::start(TestServerOptions::default())
        .await
        .expect("daytona test server");
    let daytona = DaytonaClient::new(
        DaytonaOptions::new(
            daytona_server.api_url(),
            Secret::new(daytona_server.api_key()),
        )
        .name_prefix(format!("bd{tag}"))
        .workspace_root("/workspace")
        .auto_stop_minutes(0),
    )
    .expect("daytona client");

    let (docker_cold, docker_exec) = measure(&docker).await;
    let (e2b_cold, e2b_exec) = measure(&e2b).await;
    let (daytona_cold, daytona_exec) = measure(&daytona).await;
    drop(e2b_server);
    drop(daytona_server);

    let rows = [
        (
            "create to first exec (cold start)",
            e2b_cold,
            daytona_cold,
            docker_cold,
        ),
        (
            "exec round trip `true` (median of 100)",
            e2b_exec,
            daytona_exec,
            docker_exec,
        ),
    ];
    let round = |x: f64| (x * 10.0).round() / 10.0;
    let ratio = |x: f64, d: f64| ((x / d) * 100.0).round() / 100.0;
    let out: Vec<_> = rows
        .iter()
        .map(|(phase, e, y, d)| {
            serde_json::json!({
                "phase": phase,
                "e2b_ms": round(*e),
                "daytona_ms": round(*y),
                "docker_ms": round(*d),
                "e2b_ratio": ratio(*e, *d),
                "daytona_ratio": ratio(*y, *d),
            })
        })
        .collect();
    let target = std::env::var_os("SANDBOX_BENCH_OUT")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|| {
            std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../target/bench")
        });
    std::fs::create_dir_all(&target).expect("mkdir");
    let path = target.join("cloud.json");
    std::fs::write(&path, serde_json::to_string_pretty(&out).expect("json")).expect("write");
    println!(
        "| phase | E2B (test server) ms | Daytona (test server) ms | Docker backend ms | E2B / Docker | Daytona / Docker |"
    );
    println!("| --- | ---: | ---: | ---: | ---: | ---: |");
    for (phase, e, y, d) in rows {
        println!(
            "| {phase} | {e:.1} | {y:.1} | {d:.1} | {:.2} | {:.2} |",
            e / d,
            y / d
        );
    }
    println!("wrote {}", path.display());
}
