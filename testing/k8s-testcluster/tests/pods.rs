//! The controller with real pods (Docker containers): binding, readiness, the router,
//! warm-pool adoption, pod death, expiry, cascade delete and cleanup.

mod common;

use std::process::Command;

use common::{CLAIMS, Client, SANDBOXES, eventually, ready};
use k8s_testcluster::{PoolSpec, TestCluster, TestClusterOptions};
use serde_json::{Value, json};

const IMAGE: &str = "sandbox-harness-test/busybox:latest";

/// A pool whose pods serve `hello` over HTTP on port 8888 (busybox httpd).
fn http_pool(name: &str, replicas: u32) -> PoolSpec {
    PoolSpec {
        name: name.to_owned(),
        image: IMAGE.to_owned(),
        command: vec!["sh".into(), "-c".into()],
        args: vec!["echo hello > /tmp/index.html && exec httpd -f -p 8888 -h /tmp".into()],
        replicas,
        ..PoolSpec::default()
    }
}

/// A cluster's start removes what killed runs left (by owner label). The test that plants
/// such leftovers holds this for writing from planting to its own start, so another test's
/// start (which holds it for reading) cannot remove them first.
static PLANTING: tokio::sync::RwLock<()> = tokio::sync::RwLock::const_new(());

async fn cluster() -> TestCluster {
    let _planting = PLANTING.read().await;
    start_cluster().await
}

async fn start_cluster() -> TestCluster {
    let _ = tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .with_test_writer()
        .try_init();
    TestCluster::start(TestClusterOptions::default())
        .await
        .expect("cluster starts (Docker must answer)")
}

fn claim(name: &str, pool: &str) -> Value {
    json!({"metadata": {"name": name}, "spec": {"warmPoolRef": {"name": pool}}})
}

fn containers(cluster_id: &str) -> Vec<String> {
    let out = Command::new("docker")
        .args([
            "ps",
            "-q",
            "--filter",
            &format!("label=sandbox-harness.k8s-testcluster={cluster_id}"),
        ])
        .output()
        .expect("docker ps");
    String::from_utf8_lossy(&out.stdout)
        .split_whitespace()
        .map(str::to_owned)
        .collect()
}

async fn wait_ready(api: &Client, path: &str) -> Value {
    eventually(60, path, || async {
        let (code, o) = api.get(path).await;
        (code == 200 && ready(&o).is_some_and(|(s, _)| s == "True")).then_some(o)
    })
    .await
}

#[tokio::test]
#[cfg_attr(
    not(docker_tests),
    ignore = "needs Docker: set SANDBOX_TEST_DOCKER=1 (cargo xtask test does)"
)]
async fn a_claim_cold_starts_a_pod_whose_port_answers_through_the_router() {
    let c = cluster().await;
    let api = Client::new(&c);
    c.create_pool(&http_pool("web", 0)).unwrap();
    let (code, _) = api.post(CLAIMS, &claim("c1", "web")).await;
    assert_eq!(code, 201);
    let cl = wait_ready(&api, &format!("{CLAIMS}/c1")).await;
    assert_eq!(
        ready(&cl).unwrap(),
        ("True".to_owned(), "DependenciesReady".to_owned())
    );
    assert_eq!(
        cl["status"]["sandbox"]["name"], "c1",
        "cold start: the sandbox is named like the claim"
    );
    let ip = cl["status"]["sandbox"]["podIPs"][0]
        .as_str()
        .unwrap()
        .to_owned();

    let (_, sb) = api.get(&format!("{SANDBOXES}/c1")).await;
    assert_eq!(sb["status"]["podIPs"][0], ip.as_str());
    assert_eq!(sb["status"]["serviceFQDN"], "c1.default.svc.cluster.local");
    assert_eq!(
        sb["metadata"]["annotations"]["agents.x-k8s.io/pod-name"],
        "c1"
    );
    assert_eq!(
        sb["metadata"]["ownerReferences"][0]["uid"],
        cl["metadata"]["uid"]
    );

    // The controller has converged: passes over unchanged objects write nothing.
    let version = |l: Value| {
        l["metadata"]["resourceVersion"]
            .as_str()
            .unwrap()
            .to_owned()
    };
    let before = version(api.get(CLAIMS).await.1);
    tokio::time::sleep(std::time::Duration::from_millis(1500)).await; // three controller passes
    assert_eq!(
        version(api.get(CLAIMS).await.1),
        before,
        "no writes while nothing changes"
    );

    // The pod answers directly and through the router.
    let direct = reqwest::get(format!("http://{ip}:8888/"))
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert_eq!(direct, "hello\n");
    let http = reqwest::Client::new();
    let r = http
        .get(format!("{}/index.html", c.router_url()))
        .header("X-Sandbox-ID", "c1")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    assert_eq!(r.text().await.unwrap(), "hello\n");
    // Router contract errors.
    let r = http
        .get(format!("{}/", c.router_url()))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 400);
    assert_eq!(
        r.json::<Value>().await.unwrap()["detail"],
        "X-Sandbox-ID header is required."
    );
    let r = http
        .get(format!("{}/", c.router_url()))
        .header("X-Sandbox-ID", "Bad_Id")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 400);
    let r = http
        .get(format!("{}/", c.router_url()))
        .header("X-Sandbox-ID", "c1")
        .header("X-Sandbox-Port", "9")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 502, "nothing listens on port 9");
    let r = http
        .get(format!("{}/healthz", c.router_url()))
        .send()
        .await
        .unwrap();
    assert_eq!(r.json::<Value>().await.unwrap(), json!({"status": "ok"}));

    // Router faults.
    c.faults().fail_next("GET", "/index.html", 503, 1);
    let r = http
        .get(format!("{}/index.html", c.router_url()))
        .header("X-Sandbox-ID", "c1")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 503);

    // Deleting the claim deletes its sandbox and the container.
    assert_eq!(containers(c.cluster_id()).len(), 1);
    assert_eq!(api.delete(&format!("{CLAIMS}/c1")).await.0, 200);
    assert_eq!(api.get(&format!("{SANDBOXES}/c1")).await.0, 404);
    let id = c.cluster_id().to_owned();
    eventually(30, "the pod's container to go", || async {
        containers(&id).is_empty().then_some(())
    })
    .await;
}

#[tokio::test]
#[cfg_attr(
    not(docker_tests),
    ignore = "needs Docker: set SANDBOX_TEST_DOCKER=1 (cargo xtask test does)"
)]
async fn a_claim_adopts_a_warm_sandbox_and_the_pool_refills() {
    let c = cluster().await;
    let api = Client::new(&c);
    c.create_pool(&http_pool("warm", 1)).unwrap();
    let pool_path =
        "/apis/extensions.agents.x-k8s.io/v1beta1/namespaces/default/sandboxwarmpools/warm";
    eventually(60, "a ready warm sandbox", || async {
        let (_, p) = api.get(pool_path).await;
        (p["status"]["readyReplicas"] == 1).then_some(())
    })
    .await;
    let (_, warm) = api
        .get(&format!(
            "{SANDBOXES}?labelSelector=agents.x-k8s.io/warm-pool-sandbox%3Dwarm"
        ))
        .await;
    let warm_name = warm["items"][0]["metadata"]["name"]
        .as_str()
        .unwrap()
        .to_owned();
    assert!(warm_name.starts_with("warm-"));

    api.post(CLAIMS, &claim("c2", "warm")).await;
    let cl = wait_ready(&api, &format!("{CLAIMS}/c2")).await;
    assert_eq!(
        cl["status"]["sandbox"]["name"],
        warm_name.as_str(),
        "adopted"
    );
    let (_, cl) = api.get(&format!("{CLAIMS}/c2")).await;
    assert_eq!(
        cl["metadata"]["annotations"]["agents.x-k8s.io/sandbox-name"],
        warm_name.as_str()
    );
    let (_, sb) = api.get(&format!("{SANDBOXES}/{warm_name}")).await;
    assert_eq!(
        sb["metadata"]["ownerReferences"][0]["uid"],
        cl["metadata"]["uid"]
    );
    assert!(sb["metadata"]["labels"]["agents.x-k8s.io/warm-pool-sandbox"].is_null());

    // The pool makes a new warm sandbox.
    eventually(60, "the pool to refill", || async {
        let (_, l) = api
            .get(&format!(
                "{SANDBOXES}?labelSelector=agents.x-k8s.io/warm-pool-sandbox%3Dwarm"
            ))
            .await;
        let items = l["items"].as_array().cloned().unwrap_or_default();
        (items.len() == 1 && items[0]["metadata"]["name"] != warm_name.as_str()).then_some(())
    })
    .await;

    // Dropping the cluster removes its containers and network.
    let id = c.cluster_id().to_owned();
    eventually(60, "two running pods", || async {
        (containers(&id).len() == 2).then_some(())
    })
    .await;
    drop(c);
    assert!(containers(&id).is_empty());
    let nets = Command::new("docker")
        .args([
            "network",
            "ls",
            "-q",
            "--filter",
            &format!("name=k8stc-{id}"),
        ])
        .output()
        .unwrap();
    assert!(nets.stdout.is_empty(), "the network is removed");
}

#[tokio::test]
#[cfg_attr(
    not(docker_tests),
    ignore = "needs Docker: set SANDBOX_TEST_DOCKER=1 (cargo xtask test does)"
)]
async fn a_killed_pod_fails_the_sandbox_and_the_claim() {
    let c = cluster().await;
    let api = Client::new(&c);
    c.create_pool(&http_pool("web", 0)).unwrap();
    api.post(CLAIMS, &claim("c3", "web")).await;
    wait_ready(&api, &format!("{CLAIMS}/c3")).await;
    c.faults().kill_pod("default", "c3").await.unwrap();
    let cl = eventually(30, "PodFailed on the claim", || async {
        let (_, o) = api.get(&format!("{CLAIMS}/c3")).await;
        ready(&o)
            .is_some_and(|(s, r)| s == "False" && r == "PodFailed")
            .then_some(o)
    })
    .await;
    assert_eq!(cl["status"]["sandbox"]["name"], "c3");
    let (_, sb) = api.get(&format!("{SANDBOXES}/c3")).await;
    assert_eq!(
        ready(&sb).unwrap(),
        ("False".to_owned(), "PodFailed".to_owned())
    );
}

#[tokio::test]
#[cfg_attr(
    not(docker_tests),
    ignore = "needs Docker: set SANDBOX_TEST_DOCKER=1 (cargo xtask test does)"
)]
async fn missing_pools_and_templates_and_expiry_are_reported() {
    let c = cluster().await;
    let api = Client::new(&c);
    let reason = |name: &'static str| {
        let api = &api;
        async move {
            eventually(30, name, || async {
                let (_, o) = api.get(&format!("{CLAIMS}/{name}")).await;
                ready(&o).map(|(_, r)| r)
            })
            .await
        }
    };
    api.post(CLAIMS, &claim("nopool", "missing")).await;
    assert_eq!(reason("nopool").await, "WarmPoolNotFound");

    let pool = json!({"metadata": {"name": "orphan"}, "spec": {"replicas": 0, "sandboxTemplateRef": {"name": "gone"}}});
    api.post(
        "/apis/extensions.agents.x-k8s.io/v1beta1/namespaces/default/sandboxwarmpools",
        &pool,
    )
    .await;
    api.post(CLAIMS, &claim("notemplate", "orphan")).await;
    assert_eq!(reason("notemplate").await, "TemplateNotFound");

    // An expired claim with shutdownPolicy Delete is reported and deleted.
    c.create_pool(&http_pool("web", 0)).unwrap();
    let mut w = api
        .watch(&format!(
            "{CLAIMS}?watch=1&fieldSelector=metadata.name%3Dexpired"
        ))
        .await;
    let mut expired = claim("expired", "web");
    expired["spec"]["lifecycle"] =
        json!({"shutdownTime": "2020-01-01T00:00:00Z", "shutdownPolicy": "Delete"});
    api.post(CLAIMS, &expired).await;
    let mut seen = Vec::new();
    while let Some(e) = w.next_change().await {
        let r = ready(&e["object"]).map(|(_, r)| r);
        seen.push((e["type"].as_str().unwrap().to_owned(), r));
        if e["type"] == "DELETED" {
            break;
        }
    }
    assert!(
        seen.iter()
            .any(|(_, r)| r.as_deref() == Some("ClaimExpired")),
        "{seen:?}"
    );
    assert_eq!(api.get(&format!("{CLAIMS}/expired")).await.0, 404);
}

#[tokio::test]
#[cfg_attr(
    not(docker_tests),
    ignore = "needs Docker: set SANDBOX_TEST_DOCKER=1 (cargo xtask test does)"
)]
async fn a_new_cluster_removes_the_leftovers_of_killed_ones() {
    // A "killed run": a container and a network labelled with an owner pid that cannot be
    // alive (above the kernel's pid_max limit).
    let planting = PLANTING.write().await;
    let stale_id = format!("stale{}", std::process::id());
    let labels = [
        "--label".to_owned(),
        format!("sandbox-harness.k8s-testcluster={stale_id}"),
        "--label".to_owned(),
        "sandbox-harness.k8s-testcluster.pid=4194305".to_owned(),
    ];
    let net = format!("k8stc-{stale_id}");
    let ok = Command::new("docker")
        .args(["network", "create"])
        .args(&labels)
        .arg(&net)
        .status()
        .unwrap();
    assert!(ok.success());
    let ok = Command::new("docker")
        .args(["run", "-d", "--network", &net])
        .args(&labels)
        .args([IMAGE, "sleep", "300"])
        .status()
        .unwrap();
    assert!(ok.success());
    assert_eq!(containers(&stale_id).len(), 1);

    let c = start_cluster().await;
    drop(planting);
    assert!(
        containers(&stale_id).is_empty(),
        "the stale container is removed"
    );
    let nets = Command::new("docker")
        .args(["network", "ls", "-q", "--filter", &format!("name={net}")])
        .output()
        .unwrap();
    assert!(nets.stdout.is_empty(), "the stale network is removed");
    // The new cluster's own network stays.
    let own = Command::new("docker")
        .args([
            "network",
            "ls",
            "-q",
            "--filter",
            &format!("name=k8stc-{}", c.cluster_id()),
        ])
        .output()
        .unwrap();
    assert!(!own.stdout.is_empty());
}

#[tokio::test]
#[cfg_attr(
    not(docker_tests),
    ignore = "needs Docker: set SANDBOX_TEST_DOCKER=1 (cargo xtask test does)"
)]
async fn dropping_a_cluster_while_pods_start_leaves_nothing() {
    let c = cluster().await;
    let api = Client::new(&c);
    c.create_pool(&http_pool("web", 3)).unwrap();
    // Drop as soon as the warm sandboxes exist: their `docker run`s are in flight.
    eventually(30, "the warm sandboxes", || async {
        let (_, l) = api.get(SANDBOXES).await;
        (l["items"].as_array().is_some_and(|a| a.len() == 3)).then_some(())
    })
    .await;
    let id = c.cluster_id().to_owned();
    drop(c);
    let all = Command::new("docker")
        .args([
            "ps",
            "-aq",
            "--filter",
            &format!("label=sandbox-harness.k8s-testcluster={id}"),
        ])
        .output()
        .unwrap();
    assert!(
        all.stdout.is_empty(),
        "left: {}",
        String::from_utf8_lossy(&all.stdout)
    );
}
