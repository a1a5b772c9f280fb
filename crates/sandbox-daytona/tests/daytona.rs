//! The backend against the Daytona test server: exec and files through the toolbox, Keep
//! resume by name, and the API's faults (429 with Retry-After, 5xx on create, sandboxes in
//! `error`/`build_failed`, a sandbox that vanishes between calls). `SANDBOX_TEST_DOCKER=1` and
//! the pod image.

mod common;

use std::time::{Duration, Instant};

use bytes::Bytes;
use daytona_testserver::FailState;
use sandbox_core::{
    CallContext, CreateRequest, Error, ExecRequest, ImportMode, IsolationKey, IsolationScope,
    OutputLimits, Persistence, RelPath, SandboxClient, WorkspaceSpec, stream,
};
use sandbox_daytona::{DaytonaClient, DaytonaState};

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
    ignore = "needs Docker and the pod image; run by cargo xtask test"
)]
async fn exec_files_and_archives() {
    let s = common::server().await;
    let client = DaytonaClient::new(common::options(&s, &common::prefix())).expect("client");
    let spec = WorkspaceSpec::default();
    let b = client
        .create(CreateRequest::new(&spec, Some(&key("exec"))))
        .await
        .expect("create");
    b.boot().await.expect("boot");
    let r = b
        .exec(ExecRequest::shell("echo out; echo err >&2; exit 3"))
        .await
        .expect("exec");
    assert_eq!(
        (
            r.exit_code,
            r.stdout_str().as_ref(),
            r.stderr_str().as_ref()
        ),
        (Some(3), "out\n", "err\n")
    );
    // Binary output and stdin survive (they travel base64 and as an uploaded file).
    let r = b
        .exec(ExecRequest::shell("cat; printf '\\000\\377'").stdin(&b"in\x00put"[..]))
        .await
        .expect("stdin");
    assert_eq!(r.stdout.as_ref(), b"in\x00put\x00\xff");
    let r = b
        .exec(
            ExecRequest::argv(["sh", "-c", "pwd; echo \"$A\""])
                .cwd("/tmp")
                .env("A", "it's"),
        )
        .await
        .expect("cwd env");
    assert_eq!(r.stdout_str(), "/tmp\nit's\n");
    let err = b
        .exec(ExecRequest::shell("true").cwd("/no/such/dir"))
        .await
        .expect_err("missing cwd");
    assert!(matches!(err, Error::NotFound { .. }), "{err}");
    let r = b
        .exec(ExecRequest::shell("head -c 5000 /dev/zero").limits(OutputLimits::both(100)))
        .await
        .expect("capped");
    assert!(r.stdout_truncated && r.stdout.len() == 100, "{r:?}");
    let t = Instant::now();
    let r = b
        .exec(ExecRequest::shell("echo started; sleep 30").timeout(Duration::from_millis(500)))
        .await
        .expect("timeout");
    assert!(r.timed_out && r.exit_code.is_none(), "{r:?}");
    assert_eq!(r.stdout_str(), "started\n", "partial output is returned");
    assert!(t.elapsed() < Duration::from_secs(15));
    // Files.
    let p = RelPath::new("dir/data.bin").unwrap();
    let data: Vec<u8> = (0..=255u8).cycle().take(100_000).collect();
    b.write_file(&p, Bytes::from(data.clone()), 0o640)
        .await
        .expect("write");
    assert_eq!(
        b.read_file(&p).await.expect("read").as_ref(),
        data.as_slice()
    );
    let r = b
        .exec(ExecRequest::shell("stat -c %a dir/data.bin"))
        .await
        .unwrap();
    assert_eq!(r.stdout_str(), "640\n");
    let missing = b.read_file(&RelPath::new("nope").unwrap()).await;
    assert!(
        matches!(missing, Err(Error::NotFound { .. })),
        "{missing:?}"
    );
    let names: Vec<String> = b
        .list()
        .await
        .expect("list")
        .iter()
        .map(|e| e.path.as_str().to_owned())
        .collect();
    assert_eq!(
        names,
        ["dir", "dir/data.bin"],
        "staging names are not listed"
    );
    // Export and a Replace import through the file API (binary archives).
    let archive = stream::collect(
        b.export(&sandbox_core::ExportRequest::default())
            .await
            .expect("export"),
        1 << 30,
    )
    .await
    .expect("archive");
    b.exec(ExecRequest::shell("rm -rf dir; echo x > other"))
        .await
        .unwrap();
    b.import(stream::once(archive), ImportMode::Replace { keep: vec![] })
        .await
        .expect("import");
    assert_eq!(
        b.read_file(&p).await.expect("restored").as_ref(),
        data.as_slice()
    );
    let r = b
        .exec(ExecRequest::shell("test -e other || echo gone"))
        .await
        .unwrap();
    assert_eq!(r.stdout_str(), "gone\n");
    // Only this command's own wrapper directory is there: no stdin, archive or output files
    // of earlier commands (the timed-out one included) are left behind.
    let r = b
        .exec(ExecRequest::shell("ls -A /tmp | grep sandbox- || true"))
        .await
        .unwrap();
    let listing = r.stdout_str();
    let left: Vec<&str> = listing.lines().collect();
    assert!(
        left.len() == 1 && left[0].starts_with(".sandbox-exec-"),
        "{left:?}"
    );
    b.destroy().await.expect("destroy");
    assert_eq!(s.sandbox_count(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[cfg_attr(
    not(docker_tests),
    ignore = "needs Docker and the pod image; run by cargo xtask test"
)]
async fn keep_resumes_by_name_and_a_vanished_sandbox_is_replaced() {
    let s = common::server().await;
    let prefix = common::prefix();
    let client = DaytonaClient::new(common::options(&s, &prefix).persistence(Persistence::Keep))
        .expect("client");
    let spec = WorkspaceSpec::default();
    let k = key("keep");
    let b = client
        .create(CreateRequest::new(&spec, Some(&k)))
        .await
        .expect("create");
    b.boot().await.expect("boot");
    b.exec(ExecRequest::shell("echo kept > f")).await.unwrap();
    let state = b.state();
    b.release().await.expect("release (stop)");
    // The next call on the key finds the stopped sandbox by name and starts it.
    let again = client
        .create(CreateRequest::new(&spec, Some(&k)))
        .await
        .expect("create again");
    again.boot().await.expect("boot again");
    let r = again.exec(ExecRequest::shell("cat f")).await.expect("cat");
    assert_eq!(r.stdout_str(), "kept\n");
    assert_eq!(s.sandbox_count(), 1);
    let owned = client.list_owned().await.expect("list owned");
    assert_eq!(owned.len(), 1);
    assert_eq!(owned[0].id, client.sandbox_name(&k));
    assert_eq!(owned[0].key.as_deref(), Some(k.as_str()));
    // It vanishes between calls: the handle fails with a typed error; a resume makes a new
    // sandbox and reports the workspace lost (so core restores it from the snapshot).
    let st = state
        .downcast::<DaytonaState>(sandbox_daytona::BACKEND)
        .unwrap();
    s.faults()
        .vanish(st.sandbox_id.as_deref().unwrap())
        .await
        .expect("vanish");
    let err = again
        .exec(ExecRequest::shell("true"))
        .await
        .expect_err("vanished");
    assert!(matches!(err, Error::NotFound { .. }), "{err}");
    let resumed = client.resume(&*state, &spec).await.expect("resume");
    resumed.boot().await.expect("boot after it vanished");
    assert!(!resumed.workspace_exists().await.expect("exists"));
    let r = resumed
        .exec(ExecRequest::shell("test -e f || echo gone"))
        .await
        .unwrap();
    assert_eq!(r.stdout_str(), "gone\n");
    // Someone else's sandbox is never removed by gc.
    let other = DaytonaClient::new(common::options(&s, &common::prefix())).unwrap();
    let err = other
        .remove_owned(&client.sandbox_name(&k))
        .await
        .expect_err("not ours");
    assert!(matches!(err, Error::Conflict { .. }), "{err}");
    client
        .remove_owned(&client.sandbox_name(&k))
        .await
        .expect("remove ours");
    assert_eq!(s.sandbox_count(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[cfg_attr(
    not(docker_tests),
    ignore = "needs Docker and the pod image; run by cargo xtask test"
)]
async fn api_faults_rate_limits_5xx_and_failed_states() {
    let s = common::server().await;
    let client = DaytonaClient::new(common::options(&s, &common::prefix())).expect("client");
    let spec = WorkspaceSpec::default();
    let faults = s.faults();
    // 429 with Retry-After: waited for and retried (also on the non-idempotent create).
    faults.rate_limit_next("POST", "/sandbox", 1, Duration::from_secs(1));
    faults.rate_limit_next("GET", "/sandbox/", 1, Duration::from_secs(1));
    let t = Instant::now();
    let b = client
        .create(CreateRequest::new(&spec, Some(&key("429"))))
        .await
        .expect("create through 429s");
    assert!(
        t.elapsed() >= Duration::from_secs(2),
        "Retry-After was honoured twice"
    );
    b.boot().await.expect("boot");
    b.destroy().await.expect("destroy");
    // A 5xx on create is not retried blindly: the name is looked up, nothing was made, the
    // error is returned (a retry would have succeeded).
    faults.fail_next("POST", "/sandbox", 503, 1);
    let err = client
        .create(CreateRequest::new(&spec, Some(&key("5xx"))))
        .await
        .expect_err("5xx on create");
    assert!(matches!(err, Error::Backend { .. }), "{err}");
    assert_eq!(s.sandbox_count(), 0);
    // 5xx on reads are retried.
    faults.fail_next("GET", "/sandbox/", 500, 2);
    let b = client
        .create(CreateRequest::new(&spec, Some(&key("5xx"))))
        .await
        .expect("create after");
    b.boot().await.expect("boot through 5xx on GET");
    b.destroy().await.unwrap();
    // A sandbox that ends in `build_failed` (or `error`): a typed error naming the reason.
    faults.fail_next_create(FailState::BuildFailed, "no such image: nope");
    let b = client
        .create(CreateRequest::new(&spec, Some(&key("bf"))))
        .await
        .expect("create");
    let err = b.boot().await.expect_err("build_failed");
    match &err {
        Error::Backend { message, .. } => {
            assert!(
                message.contains("build_failed") && message.contains("no such image"),
                "{err}"
            )
        }
        other => panic!("{other}"),
    }
    b.destroy().await.unwrap();
    let b = client
        .create(CreateRequest::new(&spec, Some(&key("err"))))
        .await
        .expect("create");
    b.boot().await.expect("boot");
    let st = b.state();
    let st = st
        .downcast::<DaytonaState>(sandbox_daytona::BACKEND)
        .unwrap();
    faults
        .break_sandbox(
            st.sandbox_id.as_deref().unwrap(),
            FailState::Error,
            "runner lost",
        )
        .await
        .unwrap();
    let err = b.boot().await.expect_err("error state");
    assert!(err.to_string().contains("runner lost"), "{err}");
    // Slow answers within the request timeout are just slow.
    faults.delay("GET", "/sandbox/", Duration::from_millis(300));
    b.destroy().await.expect("destroy while slow");
    faults.clear();
    assert_eq!(s.sandbox_count(), 0);
}

#[tokio::test]
async fn a_wrong_key_is_unauthorized() {
    let s = daytona_testserver::DaytonaTestServer::start(daytona_testserver::TestServerOptions {
        docker: false,
        ..Default::default()
    })
    .await
    .unwrap();
    let o =
        sandbox_daytona::DaytonaOptions::new(s.api_url(), sandbox_daytona::Secret::new("wrong"));
    let client = DaytonaClient::new(o).unwrap();
    let err = client.list_owned().await.expect_err("401");
    assert!(matches!(err, Error::Unauthorized { .. }), "{err}");
    assert!(
        !err.to_string().contains("wrong"),
        "the key is not in the error: {err}"
    );
}
