//! The E2B backend's own behaviour against the E2B test server (real Docker containers as
//! sandboxes), with the server's faults: rate limits, lost create answers, cut command
//! streams, sandboxes gone between calls, rotated envd tokens, native snapshots, keep-alive
//! of long commands, owner checks.

mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use sandbox_core::snapshot::SnapshotFormat;
use sandbox_core::{
    BoxHandle, CallContext, CreateRequest, Error, ExecRequest, IsolationScope, Persistence,
    RelPath, SandboxClient, SandboxConfig, SandboxManager, SnapshotSpec, StartBranch,
    WorkspaceSpec,
};
use sandbox_e2b::{E2bClient, E2bPersistence, E2bState};

async fn booted(client: &E2bClient) -> Box<dyn BoxHandle> {
    let spec = WorkspaceSpec::default();
    let handle = client
        .create(CreateRequest::new(&spec, None))
        .await
        .expect("create");
    handle.boot().await.expect("boot");
    handle
}

fn sandbox_id(handle: &dyn BoxHandle) -> String {
    let state = handle.state();
    state
        .downcast::<E2bState>(sandbox_e2b::BACKEND)
        .expect("e2b state")
        .sandbox_id
        .clone()
        .expect("a sandbox id")
}

async fn sh(handle: &dyn BoxHandle, line: &str) -> String {
    let r = handle.exec(ExecRequest::shell(line)).await.expect("exec");
    assert!(
        r.success(),
        "`{line}`: {:?} {}",
        r.exit_code,
        r.stderr_str()
    );
    r.stdout_str().into_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[cfg_attr(
    not(docker_tests),
    ignore = "needs Docker and the k8s pod image; run by cargo xtask test"
)]
async fn exec_streams_env_cwd_stdin_and_exit_codes() {
    let server = common::server().await;
    let owner = common::owner();
    let client =
        E2bClient::new(common::options(&server, &owner).env("FROM_OPTIONS", "o")).expect("client");
    let b = booted(&client).await;
    b.write_file(&RelPath::new("sub/f.txt").unwrap(), "hello".into(), 0o640)
        .await
        .unwrap();
    assert_eq!(
        b.read_file(&RelPath::new("sub/f.txt").unwrap())
            .await
            .unwrap(),
        "hello"
    );
    assert_eq!(sh(&*b, "stat -c %a sub/f.txt").await.trim(), "640");
    let r = b
        .exec(
            ExecRequest::shell("pwd; echo $FROM_OPTIONS $X; cat; echo err >&2; exit 7")
                .cwd("sub")
                .env("X", "x1")
                .stdin("piped in\n"),
        )
        .await
        .unwrap();
    assert_eq!(r.exit_code, Some(7));
    assert_eq!(
        r.stdout_str(),
        format!("{}/sub\no x1\npiped in\n", common::ROOT)
    );
    assert_eq!(r.stderr_str(), "err\n");
    // Binary output passes unchanged.
    let r = b
        .exec(ExecRequest::shell(
            "head -c 300000 /dev/urandom | od -An -v | wc -l",
        ))
        .await
        .unwrap();
    assert!(r.stdout_str().trim().parse::<u64>().unwrap() > 10_000);
    // A timeout kills the whole tree, daemonized children included.
    let started = Instant::now();
    let r = b
        .exec(
            ExecRequest::shell("setsid sh -c 'sleep 300' & sleep 300")
                .timeout(Duration::from_secs(1)),
        )
        .await
        .unwrap();
    assert!(r.timed_out && r.exit_code.is_none(), "{r:?}");
    assert!(started.elapsed() < Duration::from_secs(10));
    let mut left = String::new();
    for _ in 0..50 {
        left = sh(&*b, "ps -eo args | grep '^sleep 300' || true").await;
        if left.trim().is_empty() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(left.trim(), "", "processes survived the timeout");
    b.destroy().await.unwrap();
    assert!(common::owned_sandboxes(&server, &owner).await.is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[cfg_attr(
    not(docker_tests),
    ignore = "needs Docker and the k8s pod image; run by cargo xtask test"
)]
async fn rate_limited_create_waits_for_retry_after() {
    let server = common::server().await;
    let owner = common::owner();
    let client = E2bClient::new(common::options(&server, &owner)).expect("client");
    server
        .faults()
        .rate_limit_next("POST", "/sandboxes", Duration::from_secs(1), 2);
    let began = Instant::now();
    let b = booted(&client).await;
    assert!(
        began.elapsed() >= Duration::from_secs(2),
        "two 429s with Retry-After: 1 were waited out ({:?})",
        began.elapsed()
    );
    assert_eq!(common::owned_sandboxes(&server, &owner).await.len(), 1);
    b.destroy().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[cfg_attr(
    not(docker_tests),
    ignore = "needs Docker and the k8s pod image; run by cargo xtask test"
)]
async fn failed_create_makes_no_duplicate() {
    let server = common::server().await;
    let owner = common::owner();
    let client = E2bClient::new(common::options(&server, &owner)).expect("client");
    // A 503 (the create did not happen): found by tag? no; sent again.
    server.faults().fail_next("POST", "/sandboxes", 503, 1);
    let b = booted(&client).await;
    assert_eq!(common::owned_sandboxes(&server, &owner).await.len(), 1);
    b.destroy().await.unwrap();

    // An answer that never comes in time (the server may still make it): the lookup by
    // creation tag finds it, or a new create makes the only one.
    let slow = common::options(&server, &owner).http(
        sandbox_e2b::HttpOptions::default()
            .request_timeout(Duration::from_millis(2500))
            .backoff(Duration::from_millis(50), Duration::from_millis(200)),
    );
    let client = E2bClient::new(slow).expect("client");
    server
        .faults()
        .delay("POST", "/sandboxes", Duration::from_millis(3000));
    let faults = server.faults().clone();
    tokio::spawn(async move {
        tokio::time::sleep(Duration::from_millis(2700)).await;
        faults.clear();
    });
    let b = booted(&client).await;
    let mut owned = Vec::new();
    for _ in 0..30 {
        owned = common::owned_sandboxes(&server, &owner).await;
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(owned.len(), 1, "{owned:?}");
    assert_eq!(owned[0]["sandboxID"], sandbox_id(&*b));
    b.destroy().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[cfg_attr(
    not(docker_tests),
    ignore = "needs Docker and the k8s pod image; run by cargo xtask test"
)]
async fn cut_command_stream_is_a_typed_error() {
    let server = common::server().await;
    let client = E2bClient::new(common::options(&server, &common::owner())).expect("client");
    let b = booted(&client).await;
    // The boot's helper commands and their background reaps are over before the fault is
    // armed (it applies to the next command stream, whoever opens it).
    sh(&*b, "true").await;
    tokio::time::sleep(Duration::from_millis(1500)).await;
    server.faults().cut_next_start_stream(1);
    let e = b
        .exec(ExecRequest::shell("echo one; sleep 1; echo two"))
        .await
        .unwrap_err();
    assert!(
        matches!(&e, Error::Unavailable { reason, .. } if reason.contains("cut")),
        "{e}"
    );
    // The box works on.
    assert_eq!(sh(&*b, "echo again").await, "again\n");
    b.destroy().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[cfg_attr(
    not(docker_tests),
    ignore = "needs Docker and the k8s pod image; run by cargo xtask test"
)]
async fn rotated_envd_token_is_read_again() {
    let server = common::server().await;
    let client = E2bClient::new(common::options(&server, &common::owner())).expect("client");
    let b = booted(&client).await;
    let id = sandbox_id(&*b);
    b.write_file(&RelPath::new("a").unwrap(), "1".into(), 0o644)
        .await
        .unwrap();
    server.rotate_envd_token(&id).expect("rotate");
    assert_eq!(sh(&*b, "cat a").await, "1");
    server.rotate_envd_token(&id).expect("rotate");
    assert_eq!(b.read_file(&RelPath::new("a").unwrap()).await.unwrap(), "1");
    server.rotate_envd_token(&id).expect("rotate");
    b.write_file(&RelPath::new("b").unwrap(), "2".into(), 0o644)
        .await
        .unwrap();
    assert_eq!(sh(&*b, "cat b").await, "2");
    b.destroy().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[cfg_attr(
    not(docker_tests),
    ignore = "needs Docker and the k8s pod image; run by cargo xtask test"
)]
async fn long_command_keeps_its_sandbox_alive() {
    let server = common::server().await;
    let client = E2bClient::new(
        common::options(&server, &common::owner())
            .sandbox_timeout(Duration::from_secs(2))
            .keepalive_every(Duration::from_millis(500)),
    )
    .expect("client");
    let b = booted(&client).await;
    // Four times the sandbox's timeout: without keep-alive the server reaps it mid-command.
    let r = b
        .exec(ExecRequest::shell("sleep 8; echo done"))
        .await
        .expect("exec");
    assert_eq!(r.stdout_str(), "done\n");
    b.destroy().await.unwrap();
}

fn manager(client: E2bClient, dir: &std::path::Path, format: SnapshotFormat) -> SandboxManager {
    let spec = WorkspaceSpec::builder()
        .file("spec.txt", "from the spec\n")
        .build()
        .unwrap();
    SandboxManager::builder(Arc::new(client))
        .state_store(Arc::new(sandbox_core::FileStateStore::new(
            dir.join("states"),
        )))
        .config(
            SandboxConfig::new(spec)
                .snapshots(SnapshotSpec::local_dir(dir.join("snapshots")).format(format)),
        )
        .scope(IsolationScope::Session)
        .build()
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[cfg_attr(
    not(docker_tests),
    ignore = "needs Docker and the k8s pod image; run by cargo xtask test"
)]
async fn kept_sandbox_gone_between_calls_is_restored_from_the_snapshot() {
    let server = common::server().await;
    let owner = common::owner();
    let dir = tempfile::tempdir().unwrap();
    let client = E2bClient::new(common::options(&server, &owner).persistence(Persistence::Keep))
        .expect("client");
    let m = manager(client, dir.path(), SnapshotFormat::Tar);
    let ctx = CallContext::new("e2b-test").session("s1");
    let first = m
        .call(&ctx, |sb| async move {
            sb.exec(ExecRequest::shell("echo kept > work.txt"))
                .await
                .unwrap();
        })
        .await
        .expect("first call");
    let state: serde_json::Value =
        serde_json::from_str(first.report.state_json.as_deref().expect("state")).unwrap();
    let id = state["sandbox_id"].as_str().expect("sandbox id").to_owned();
    // Paused for the next call.
    let paused = common::owned_sandboxes(&server, &owner).await;
    assert_eq!(paused.len(), 1);
    assert_eq!(paused[0]["state"], "paused");
    // Gone behind the library's back (E2B's timeout, an operator).
    common::kill_sandbox(&server, &id).await;
    let second = m
        .call(&ctx, |sb| async move {
            let r = sb
                .exec(ExecRequest::shell("cat work.txt spec.txt"))
                .await
                .unwrap();
            r.stdout_str().into_owned()
        })
        .await
        .expect("second call");
    assert_eq!(second.value, "kept\nfrom the spec\n");
    let start = second.report.start.as_ref().expect("start report");
    assert!(start.restored.is_some(), "{start:?}");
    assert_ne!(start.branch, StartBranch::Warm, "{start:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[cfg_attr(
    not(docker_tests),
    ignore = "needs Docker and the k8s pod image; run by cargo xtask test"
)]
async fn native_snapshot_round_trip_on_a_new_sandbox() {
    let server = common::server().await;
    let owner = common::owner();
    let dir = tempfile::tempdir().unwrap();
    let client =
        E2bClient::new(common::options(&server, &owner).snapshots(E2bPersistence::NativeSnapshot))
            .expect("client");
    assert!(client.capabilities().native_snapshots);

    // Through the handles: snapshot, then a new box runs from it.
    let a = booted(&client).await;
    a.write_file(&RelPath::new("n.txt").unwrap(), "native".into(), 0o600)
        .await
        .unwrap();
    let reference = a.native_snapshot().await.expect("native snapshot");
    let first = sandbox_id(&*a);
    a.destroy().await.unwrap();
    let b = booted(&client).await;
    b.restore_native(&reference).await.expect("restore native");
    let second = sandbox_id(&*b);
    assert_ne!(first, second);
    assert_eq!(
        b.read_file(&RelPath::new("n.txt").unwrap()).await.unwrap(),
        "native"
    );
    assert_eq!(sh(&*b, "stat -c %a n.txt").await.trim(), "600");
    b.destroy().await.unwrap();
    client.delete_native_snapshot(&reference).await.unwrap();
    // Gone is not an error; a sandbox cannot be made from it any more.
    client.delete_native_snapshot(&reference).await.unwrap();
    let c = booted(&client).await;
    assert!(matches!(
        c.restore_native(&reference).await,
        Err(Error::NotFound { .. })
    ));
    c.destroy().await.unwrap();

    // Through the manager: the call ends (ephemeral: its sandbox is killed), the next call
    // restores from the platform snapshot on a new sandbox.
    let m = manager(client.clone(), dir.path(), SnapshotFormat::Native);
    let ctx = CallContext::new("e2b-test").session("native");
    m.call(&ctx, |sb| async move {
        sb.exec(ExecRequest::shell("echo one > call.txt"))
            .await
            .unwrap();
    })
    .await
    .expect("first call");
    assert!(common::owned_sandboxes(&server, &owner).await.is_empty());
    let second = m
        .call(&ctx, |sb| async move {
            sb.exec(ExecRequest::shell("cat call.txt spec.txt"))
                .await
                .unwrap()
                .stdout_str()
                .into_owned()
        })
        .await
        .expect("second call");
    assert_eq!(second.value, "one\nfrom the spec\n");
    assert!(second.report.start.as_ref().unwrap().restored.is_some());

    // Tar persistence refuses native snapshots with a typed error.
    let tar = E2bClient::new(common::options(&server, &owner)).expect("client");
    assert!(!tar.capabilities().native_snapshots);
    let t = booted(&tar).await;
    assert!(matches!(
        t.native_snapshot().await,
        Err(Error::NotSupported { .. })
    ));
    t.destroy().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[cfg_attr(
    not(docker_tests),
    ignore = "needs Docker and the k8s pod image; run by cargo xtask test"
)]
async fn owned_listing_and_removal_check_the_owner() {
    let server = common::server().await;
    let mine = E2bClient::new(common::options(&server, &common::owner())).expect("client");
    let theirs = E2bClient::new(common::options(&server, &common::owner())).expect("client");
    let a = booted(&mine).await;
    let b = booted(&theirs).await;
    let listed = mine.list_owned().await.unwrap();
    assert_eq!(listed.len(), 1);
    assert_eq!(listed[0].id, sandbox_id(&*a));
    assert!(listed[0].created_unix_ms.is_some());
    assert!(matches!(
        mine.remove_owned(&sandbox_id(&*b)).await,
        Err(Error::Conflict { .. })
    ));
    mine.remove_owned(&sandbox_id(&*a)).await.unwrap();
    mine.remove_owned(&sandbox_id(&*a)).await.unwrap();
    assert!(mine.list_owned().await.unwrap().is_empty());
    assert_eq!(theirs.list_owned().await.unwrap().len(), 1);
    b.destroy().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[cfg_attr(
    not(docker_tests),
    ignore = "needs Docker and the k8s pod image; run by cargo xtask test"
)]
async fn a_wrong_api_key_is_unauthorized() {
    let server = common::server().await;
    let client = E2bClient::new(
        common::options(&server, &common::owner()).api_key(sandbox_e2b::Secret::new("e2b_wrong")),
    )
    .expect("client");
    let spec = WorkspaceSpec::default();
    let h = client
        .create(CreateRequest::new(&spec, None))
        .await
        .unwrap();
    let e = h.boot().await.unwrap_err();
    assert!(matches!(e, Error::Unauthorized { .. }), "{e}");
    assert!(!e.to_string().contains("e2b_wrong"), "{e}");
    assert!(matches!(
        client.list_owned().await,
        Err(Error::Unauthorized { .. })
    ));
}

/// A proxy in front of the API that forwards everything, but closes the connection of the
/// first `POST /sandboxes` without its answer once the server has answered it: a create
/// that happened but whose answer was lost.
async fn lossy_proxy(upstream: std::net::SocketAddr) -> std::net::SocketAddr {
    use std::sync::atomic::{AtomicBool, Ordering};
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let dropped = Arc::new(AtomicBool::new(false));
    tokio::spawn(async move {
        while let Ok((mut client, _)) = listener.accept().await {
            let dropped = dropped.clone();
            tokio::spawn(async move {
                let mut buf = Vec::new();
                let mut chunk = [0u8; 8192];
                let head_end = loop {
                    if let Some(i) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
                        break i + 4;
                    }
                    match client.read(&mut chunk).await {
                        Ok(0) | Err(_) => return,
                        Ok(n) => buf.extend_from_slice(&chunk[..n]),
                    }
                };
                let head = String::from_utf8_lossy(&buf[..head_end]).into_owned();
                let len: usize = head
                    .lines()
                    .find_map(|l| {
                        let (k, v) = l.split_once(':')?;
                        k.eq_ignore_ascii_case("content-length")
                            .then(|| v.trim().parse().ok())?
                    })
                    .unwrap_or(0);
                while buf.len() < head_end + len {
                    match client.read(&mut chunk).await {
                        Ok(0) | Err(_) => return,
                        Ok(n) => buf.extend_from_slice(&chunk[..n]),
                    }
                }
                let mut lines: Vec<&str> = head
                    .trim_end()
                    .split("\r\n")
                    .filter(|l| !l.to_ascii_lowercase().starts_with("connection:"))
                    .collect();
                lines.push("Connection: close");
                let mut request = format!("{}\r\n\r\n", lines.join("\r\n")).into_bytes();
                request.extend_from_slice(&buf[head_end..head_end + len]);
                let mut up = tokio::net::TcpStream::connect(upstream).await.unwrap();
                up.write_all(&request).await.unwrap();
                let mut answer = Vec::new();
                let _ = up.read_to_end(&mut answer).await;
                if head.starts_with("POST /sandboxes ") && !dropped.swap(true, Ordering::SeqCst) {
                    return; // the answer is lost
                }
                let _ = client.write_all(&answer).await;
                let _ = client.shutdown().await;
            });
        }
    });
    addr
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[cfg_attr(
    not(docker_tests),
    ignore = "needs Docker and the k8s pod image; run by cargo xtask test"
)]
async fn lost_create_answer_adopts_the_sandbox_it_made() {
    let server = common::server().await;
    let owner = common::owner();
    let upstream = server
        .api_url()
        .trim_start_matches("http://")
        .parse()
        .unwrap();
    let proxy = lossy_proxy(upstream).await;
    let client =
        E2bClient::new(common::options(&server, &owner).api_url(format!("http://{proxy}")))
            .expect("client");
    let b = booted(&client).await;
    // The server made one sandbox for the lost create; it is the one in use, not a second.
    let owned = common::owned_sandboxes(&server, &owner).await;
    assert_eq!(owned.len(), 1, "{owned:?}");
    assert_eq!(owned[0]["sandboxID"], sandbox_id(&*b));
    assert_eq!(sh(&*b, "echo adopted").await, "adopted\n");
    b.destroy().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[cfg_attr(
    not(docker_tests),
    ignore = "needs Docker and the k8s pod image; run by cargo xtask test"
)]
async fn silent_sandbox_is_replaced_and_reported_lost() {
    let server = common::server().await;
    let owner = common::owner();
    let client = E2bClient::new(
        common::options(&server, &owner)
            .persistence(Persistence::Keep)
            .ready_timeout(Duration::from_secs(5)),
    )
    .expect("client");
    let a = booted(&client).await;
    sh(&*a, "echo x > here").await;
    assert!(a.workspace_exists().await.unwrap());
    let old = sandbox_id(&*a);
    let state = a.state();
    // Its container goes away behind the API's back: the API still knows the sandbox, envd
    // cannot run anything in it.
    server.disappear(&old).await.expect("disappear");
    let b = client
        .resume(&*state, &WorkspaceSpec::default())
        .await
        .unwrap();
    b.boot().await.expect("boot replaces the silent sandbox");
    let new = sandbox_id(&*b);
    assert_ne!(old, new);
    assert!(
        !b.workspace_exists().await.unwrap(),
        "the workspace is reported lost"
    );
    assert_eq!(sh(&*b, "echo fine").await, "fine\n");
    let owned = common::owned_sandboxes(&server, &owner).await;
    assert_eq!(owned.len(), 1, "the silent one was removed: {owned:?}");
    b.destroy().await.unwrap();
}
