//! The backend against the k8s test cluster: exec and files through sandboxd, Keep resume by
//! claim name, and the control-plane faults (5xx, slow answers, dropped and expired watches,
//! a pod that dies between calls). `SANDBOX_TEST_DOCKER=1` and the pod image.

mod common;

use std::time::{Duration, Instant};

use bytes::Bytes;
use sandbox_core::{
    CallContext, CreateRequest, Error, ExecRequest, ImportMode, IsolationKey, IsolationScope,
    Persistence, RelPath, SandboxClient, WorkspaceSpec, stream,
};
use sandbox_k8s::{K8sClient, K8sState};

fn key(s: &str) -> IsolationKey {
    IsolationKey::resolve(
        IsolationScope::Session,
        &CallContext::new("agent").session(s),
    )
    .expect("key")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[cfg_attr(
    not(docker_tests),
    ignore = "needs Docker and the k8s pod image; run by cargo xtask test"
)]
async fn exec_files_and_timings() {
    let c = common::cluster().await;
    let client = K8sClient::new(c.options(&common::prefix())).expect("client");
    let spec = WorkspaceSpec::default();
    let began = Instant::now();
    let b = client
        .create(CreateRequest::new(&spec, Some(&key("timings"))))
        .await
        .expect("create");
    b.boot().await.expect("boot");
    let r = b.exec(ExecRequest::shell("echo hi")).await.expect("exec");
    let first = began.elapsed();
    assert_eq!(r.stdout_str(), "hi\n");
    let mut rounds = Vec::new();
    for _ in 0..20 {
        let t = Instant::now();
        let r = b.exec(ExecRequest::shell("true")).await.expect("exec");
        assert!(r.success());
        rounds.push(t.elapsed());
    }
    rounds.sort();
    println!(
        "claim-to-first-exec {:?}; exec round trip median {:?} (20 runs, min {:?}, max {:?})",
        first, rounds[10], rounds[0], rounds[19]
    );
    // env, cwd, stdin, exit codes and separate streams.
    let r = b
        .exec(
            ExecRequest::shell("cat; echo \"$V\" >&2; pwd; exit 3")
                .env("V", "vee")
                .cwd("/tmp")
                .stdin("in\n"),
        )
        .await
        .expect("exec");
    assert_eq!(r.exit_code, Some(3));
    assert_eq!(r.stdout_str(), "in\n/tmp\n");
    assert_eq!(r.stderr_str(), "vee\n");
    // Files through the REST API.
    let p = RelPath::new("dir/a b.txt").unwrap();
    b.write_file(&p, Bytes::from_static(b"content\n"), 0o600)
        .await
        .expect("write");
    assert_eq!(&b.read_file(&p).await.expect("read")[..], b"content\n");
    let r = b
        .exec(ExecRequest::shell("stat -c %a 'dir/a b.txt'"))
        .await
        .expect("stat");
    assert_eq!(r.stdout_str(), "600\n");
    assert!(matches!(
        b.read_file(&RelPath::new("missing").unwrap()).await,
        Err(Error::NotFound { .. })
    ));
    assert!(matches!(
        b.read_file(&RelPath::new("dir").unwrap()).await,
        Err(Error::InvalidInput { .. })
    ));
    // Export, then Replace-import into a changed workspace.
    let tar = stream::collect(
        b.export(&Default::default()).await.expect("export"),
        1 << 20,
    )
    .await
    .expect("tar");
    b.exec(ExecRequest::shell("rm -rf dir; echo x > other"))
        .await
        .expect("change");
    b.import(stream::once(tar), ImportMode::Replace { keep: Vec::new() })
        .await
        .expect("import");
    let names: Vec<String> = b
        .list()
        .await
        .expect("list")
        .into_iter()
        .map(|e| e.path.as_str().to_owned())
        .collect();
    assert_eq!(names, ["dir", "dir/a b.txt"]);
    b.destroy().await.expect("destroy");
    assert!(client.list_owned().await.expect("list").is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[cfg_attr(
    not(docker_tests),
    ignore = "needs Docker and the k8s pod image; run by cargo xtask test"
)]
async fn keep_resumes_by_name_and_a_dead_pod_is_replaced() {
    let c = common::cluster().await;
    let prefix = common::prefix();
    let client = K8sClient::new(c.options(&prefix).persistence(Persistence::Keep)).expect("client");
    let spec = WorkspaceSpec::default();
    let k = key("keep");
    let b = client
        .create(CreateRequest::new(&spec, Some(&k)))
        .await
        .expect("create");
    b.boot().await.expect("boot");
    b.exec(ExecRequest::shell("echo kept > f"))
        .await
        .expect("exec");
    let state = b.state();
    b.release().await.expect("release");
    // The next call on the key finds the same claim by name: the file is still there.
    let again = client
        .create(CreateRequest::new(&spec, Some(&k)))
        .await
        .expect("create again");
    again.boot().await.expect("boot again");
    let r = again.exec(ExecRequest::shell("cat f")).await.expect("cat");
    assert_eq!(r.stdout_str(), "kept\n");
    // The pod dies between calls: the handle's data plane fails with a typed error, and a
    // resume makes a new pod and reports the workspace lost (so core restores it).
    let s = state.downcast::<K8sState>(sandbox_k8s::BACKEND).unwrap();
    c.cluster
        .faults()
        .kill_pod(&s.namespace, s.sandbox_name.as_deref().unwrap())
        .await
        .expect("kill pod");
    let err = again
        .exec(ExecRequest::shell("true"))
        .await
        .expect_err("dead pod");
    assert!(
        err.is_retryable() || matches!(err, Error::Unavailable { .. }),
        "{err}"
    );
    let resumed = client.resume(&*state, &spec).await.expect("resume");
    resumed.boot().await.expect("boot after the pod died");
    assert!(!resumed.workspace_exists().await.expect("exists"));
    let r = resumed
        .exec(ExecRequest::shell("test -e f || echo gone"))
        .await
        .expect("exec");
    assert_eq!(r.stdout_str(), "gone\n");
    resumed.destroy().await.expect("destroy");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[cfg_attr(
    not(docker_tests),
    ignore = "needs Docker and the k8s pod image; run by cargo xtask test"
)]
async fn control_plane_faults_are_survived() {
    let c = common::cluster().await;
    let client = K8sClient::new(c.options(&common::prefix())).expect("client");
    let spec = WorkspaceSpec::default();
    let faults = c.cluster.faults();
    // 5xx on create and get, slow answers, a dropped watch and a 410 mid-watch.
    faults.fail_next("POST", "sandboxclaims", 503, 2);
    faults.fail_next("GET", "sandboxclaims/", 500, 2);
    faults.delay("GET", "sandboxes/", Duration::from_millis(700));
    faults.expire_next_watch();
    let b = client
        .create(CreateRequest::new(&spec, Some(&key("faults"))))
        .await
        .expect("create through 5xx");
    let dropper = {
        let faults = faults.clone();
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(150)).await;
            faults.drop_watches();
        })
    };
    b.boot().await.expect("boot through watch faults");
    dropper.await.unwrap();
    faults.clear();
    let r = b.exec(ExecRequest::shell("echo ok")).await.expect("exec");
    assert_eq!(r.stdout_str(), "ok\n");
    // Persistent 5xx: a typed, retryable error, not a hang (kube itself retries 503s with
    // its own backoff; a 500 is ours to retry).
    faults.fail_next("GET", "sandboxclaims", 500, 1000);
    let err = b.destroy().await.expect_err("API down");
    assert!(matches!(err, Error::Unavailable { .. }), "{err}");
    faults.clear();
    b.destroy().await.expect("destroy");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[cfg_attr(
    not(docker_tests),
    ignore = "needs Docker and the k8s pod image; run by cargo xtask test"
)]
async fn missing_pool_times_out_with_the_reason() {
    let c = common::cluster().await;
    let mut o = c
        .options(&common::prefix())
        .ready_timeout(Duration::from_secs(3));
    o.warm_pool = "no-such-pool".into();
    let client = K8sClient::new(o).expect("client");
    let spec = WorkspaceSpec::default();
    let b = client
        .create(CreateRequest::new(&spec, None))
        .await
        .expect("create");
    match b.boot().await {
        Err(Error::Timeout { operation, .. }) => {
            assert!(operation.contains("WarmPoolNotFound"), "{operation}")
        }
        other => panic!("{other:?}"),
    }
    b.destroy().await.expect("destroy");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[cfg_attr(
    not(docker_tests),
    ignore = "needs Docker and the k8s pod image; run by cargo xtask test"
)]
async fn legacy_runtime_through_the_router_with_a_token() {
    use sandbox_k8s::Runtime;
    let c = common::cluster_with(k8s_testcluster::TestClusterOptions {
        warm_pool_replicas: 1,
        router_token: Some("router-secret".into()),
        ..k8s_testcluster::TestClusterOptions::default()
    })
    .await;
    let prefix = common::prefix();
    let o = c
        .options(&prefix)
        .runtime(Runtime::Legacy)
        .api_url(c.cluster.router_url(), Some("router-secret".into()));
    let client = K8sClient::new(o).expect("client");
    let caps = client.capabilities().exec;
    assert!(!caps.env && !caps.cwd && !caps.stdin && !caps.tree_kill);
    let spec = WorkspaceSpec::default();
    let b = client
        .create(CreateRequest::new(&spec, None))
        .await
        .expect("create");
    b.boot().await.expect("boot");
    let r = b
        .exec(ExecRequest::shell("echo \"it's\" here; pwd; exit 4"))
        .await
        .expect("exec");
    assert_eq!(
        (r.exit_code, r.stdout_str().as_ref()),
        (Some(4), "it's here\n/app\n")
    );
    // What the runtime cannot do is refused, never dropped.
    for req in [
        ExecRequest::shell("true").env("A", "b"),
        ExecRequest::shell("true").cwd("/tmp"),
        ExecRequest::shell("cat").stdin("x"),
    ] {
        assert!(matches!(b.exec(req).await, Err(Error::NotSupported { .. })));
    }
    let p = RelPath::new("d/f.txt").unwrap();
    b.write_file(&p, Bytes::from_static(b"legacy\n"), 0o640)
        .await
        .expect("upload");
    assert_eq!(&b.read_file(&p).await.expect("download")[..], b"legacy\n");
    let entries = b.list().await.expect("list");
    assert!(
        entries.iter().any(|e| e.path == p && e.mode == 0o640),
        "{entries:?}"
    );
    assert!(matches!(
        b.export(&Default::default()).await,
        Err(Error::NotSupported { .. })
    ));
    // A wrong router token is a typed error, not a retry loop.
    let bad = K8sClient::new(
        c.options(&prefix)
            .runtime(Runtime::Legacy)
            .api_url(c.cluster.router_url(), Some("wrong".into())),
    )
    .expect("client");
    let state = b.state();
    let other = bad.resume(&*state, &spec).await.expect("resume");
    other.boot().await.expect("boot");
    assert!(other.exec(ExecRequest::shell("true")).await.is_err());
    b.destroy().await.expect("destroy");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[cfg_attr(
    not(docker_tests),
    ignore = "needs Docker and the k8s pod image; run by cargo xtask test"
)]
async fn sandboxd_through_the_router_with_a_token() {
    let c = common::cluster_with(k8s_testcluster::TestClusterOptions {
        warm_pool_replicas: 1,
        router_token: Some("router-secret".into()),
        ..k8s_testcluster::TestClusterOptions::default()
    })
    .await;
    let prefix = common::prefix();
    let o = c
        .options(&prefix)
        .api_url(c.cluster.router_url(), Some("router-secret".into()));
    let client = K8sClient::new(o).expect("client");
    let caps = client.capabilities().exec;
    assert!(caps.env && caps.cwd && caps.stdin && caps.tree_kill);
    let spec = WorkspaceSpec::default();
    let b = client
        .create(CreateRequest::new(&spec, None))
        .await
        .expect("create");
    b.boot().await.expect("boot");
    // gRPC (h2c) through the router: streams, env, cwd, stdin and the exit code arrive.
    let r = b
        .exec(
            ExecRequest::shell("cat; echo \"$V\" >&2; pwd; exit 3")
                .env("V", "vee")
                .cwd("/tmp")
                .stdin("in\n"),
        )
        .await
        .expect("exec");
    assert_eq!(
        (
            r.exit_code,
            r.stdout_str().as_ref(),
            r.stderr_str().as_ref()
        ),
        (Some(3), "in\n/tmp\n", "vee\n")
    );
    // A timeout kills the tree through the router as well.
    let r = b
        .exec(ExecRequest::shell("sleep 100 & sleep 100").timeout(Duration::from_millis(500)))
        .await
        .expect("exec");
    assert!(r.timed_out, "{r:?}");
    let left = b
        .exec(ExecRequest::shell(
            "ps -eo args | grep -c '^sleep 100' || true",
        ))
        .await
        .expect("ps");
    assert_eq!(left.stdout_str().trim(), "0", "sleeps left running");
    // REST files and a tar round trip (export on stdout, import on stdin).
    let p = RelPath::new("d/f.txt").unwrap();
    b.write_file(&p, Bytes::from_static(b"routed\n"), 0o640)
        .await
        .expect("write");
    assert_eq!(&b.read_file(&p).await.expect("read")[..], b"routed\n");
    let archive = stream::collect(
        b.export(&Default::default()).await.expect("export"),
        1 << 20,
    )
    .await
    .expect("archive");
    b.remove(std::slice::from_ref(&p)).await.expect("remove");
    b.import(stream::once(archive), ImportMode::Merge)
        .await
        .expect("import");
    assert_eq!(&b.read_file(&p).await.expect("read")[..], b"routed\n");
    // A wrong router token is a typed error on the gRPC path too, not a retry loop.
    let bad = K8sClient::new(
        c.options(&prefix)
            .api_url(c.cluster.router_url(), Some("wrong".into())),
    )
    .expect("client");
    let state = b.state();
    let other = bad.resume(&*state, &spec).await.expect("resume");
    other.boot().await.expect("boot");
    let refused = other.exec(ExecRequest::shell("true")).await;
    assert!(
        matches!(&refused, Err(e) if e.to_string().contains("401") || e.to_string().to_lowercase().contains("unauth")),
        "{refused:?}"
    );
    b.destroy().await.expect("destroy");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[cfg_attr(
    not(docker_tests),
    ignore = "needs Docker and the k8s pod image; run by cargo xtask test"
)]
async fn sandboxd_through_the_gateway() {
    use sandbox_k8s::Connection;
    let c = common::cluster_with(k8s_testcluster::TestClusterOptions {
        warm_pool_replicas: 1,
        router_token: Some("gateway-secret".into()),
        ..k8s_testcluster::TestClusterOptions::default()
    })
    .await;
    let gateway = |token: &str| Connection::Gateway {
        name: c.cluster.gateway_name().to_owned(),
        namespace: c.cluster.namespace().to_owned(),
        scheme: "http".into(),
        token: Some(token.into()),
    };
    let prefix = common::prefix();
    // The address comes from the Gateway's status.addresses (the test cluster's router).
    let client =
        K8sClient::new(c.options(&prefix).connection(gateway("gateway-secret"))).expect("client");
    let spec = WorkspaceSpec::default();
    let b = client
        .create(CreateRequest::new(&spec, None))
        .await
        .expect("create");
    b.boot().await.expect("boot");
    let r = b
        .exec(
            ExecRequest::shell("cat; echo \"$V\"")
                .env("V", "vee")
                .stdin("in\n"),
        )
        .await
        .expect("exec");
    assert_eq!(
        (r.exit_code, r.stdout_str().as_ref()),
        (Some(0), "in\nvee\n")
    );
    let p = RelPath::new("g.txt").unwrap();
    b.write_file(&p, Bytes::from_static(b"gateway\n"), 0o644)
        .await
        .expect("write");
    assert_eq!(&b.read_file(&p).await.expect("read")[..], b"gateway\n");
    // The token reaches the router through the Gateway route: a wrong one is refused.
    let bad = K8sClient::new(c.options(&prefix).connection(gateway("wrong"))).expect("client");
    let state = b.state();
    let other = bad.resume(&*state, &spec).await.expect("resume");
    other.boot().await.expect("boot");
    assert!(other.exec(ExecRequest::shell("true")).await.is_err());
    assert!(other.read_file(&p).await.is_err());
    b.destroy().await.expect("destroy");
}
