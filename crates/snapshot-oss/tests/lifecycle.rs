//! The conformance kit's snapshot scenarios with every snapshot in S3 (`s3s-fs`, a bucket per
//! scenario) on the local backend, and the store going down in the middle of a stop: a typed
//! retryable error, and the previous snapshot still current and restorable.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::FutureExt as _;
use sandbox_core::snapshot::SnapshotStore;
use sandbox_core::testkit::{Fixture, HookedStore, OnStore};
use sandbox_core::{
    ExecRequest, FileStateStore, InProcessGuard, IsolationScope, Persistence, SandboxConfig,
    SandboxManager, SnapshotSpec, WorkspaceSpec,
};
use sandbox_local::testkit::LocalFixture;
use snapshot_oss::testkit::{S3fs, unique_bucket};

fn fixture() -> OnStore<LocalFixture> {
    let server = Arc::new(S3fs::start());
    OnStore {
        inner: LocalFixture::new(),
        make: Arc::new(move || {
            let server = server.clone();
            async move {
                let store: Arc<dyn SnapshotStore> =
                    Arc::new(server.store(&unique_bucket(), "snapshots"));
                store
            }
            .boxed()
        }),
    }
}

sandbox_core::conformance_tests!(
    snapshots: fixture(),
    #[cfg_attr(not(s3_tests), ignore = "needs s3s-fs; run by cargo xtask test")]
);

/// What happens to the server at the armed `put`.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Outage {
    /// Killed: connections are refused.
    Down,
    /// Stopped (`SIGSTOP`): connections are accepted and nothing answers.
    Slow,
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[cfg_attr(not(s3_tests), ignore = "needs s3s-fs; run by cargo xtask test")]
async fn store_down_mid_stop_is_retryable_and_keeps_the_previous_snapshot() {
    outage_mid_stop(Outage::Down).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[cfg_attr(not(s3_tests), ignore = "needs s3s-fs; run by cargo xtask test")]
async fn store_slow_mid_stop_is_retryable_and_keeps_the_previous_snapshot() {
    outage_mid_stop(Outage::Slow).await;
}

async fn outage_mid_stop(outage: Outage) {
    let server = S3fs::start();
    server.create_bucket("outage");
    // Short limits: a silent store is given up on after about a second per attempt.
    let options = snapshot_oss::testkit::test_options()
        .read_timeout(Duration::from_secs(1))
        .request_timeout(Duration::from_secs(3))
        .operation_timeout(Duration::from_secs(8));
    let s3: Arc<dyn SnapshotStore> = Arc::new(
        server
            .config("outage")
            .prefix("snapshots")
            .options(options)
            .build()
            .unwrap(),
    );
    let server = Arc::new(Mutex::new(server));
    // Once armed, the next `put` takes the server away before it is passed on: the stop has
    // started (it may have read the parent's manifest) and its upload meets a store that is
    // gone or silent.
    let armed = Arc::new(AtomicBool::new(false));
    let puts_after_kill = Arc::new(AtomicUsize::new(0));
    let store: Arc<dyn SnapshotStore> = Arc::new(HookedStore::new(s3).on_put({
        let (server, armed, puts_after_kill) =
            (server.clone(), armed.clone(), puts_after_kill.clone());
        move |_, data| {
            if armed.swap(false, Ordering::SeqCst) {
                match outage {
                    Outage::Down => server.lock().unwrap().kill(),
                    Outage::Slow => server.lock().unwrap().pause(),
                }
                puts_after_kill.fetch_add(1, Ordering::SeqCst);
            }
            data
        }
    }));
    let fx = LocalFixture::new();
    let dir = tempfile::tempdir().unwrap();
    let states = Arc::new(FileStateStore::new(dir.path().join("states")));
    let spec = WorkspaceSpec::builder()
        .file("README.md", "hello\n")
        .build()
        .unwrap();
    let manager = SandboxManager::builder(fx.client(Persistence::Ephemeral).await)
        .state_store(states)
        .guard(Arc::new(InProcessGuard::new()))
        .scope(IsolationScope::Session)
        .config(SandboxConfig::new(spec).snapshots(SnapshotSpec::new(store.clone())))
        .build()
        .unwrap();
    let ctx = sandbox_core::CallContext::new("agent").session("outage");
    let sh = |line: &'static str| {
        move |sb: Arc<sandbox_core::Sandbox>| async move {
            let r = sb
                .exec(ExecRequest::shell(line).timeout(Duration::from_secs(30)))
                .await
                .expect("exec");
            assert!(r.success(), "{line}: {r:?}");
            r.stdout_str().into_owned()
        }
    };

    manager
        .call(
            &ctx,
            sh("echo v1 > v.txt; head -c 300000 /dev/urandom > blob.bin"),
        )
        .await
        .expect("the first call");

    armed.store(true, Ordering::SeqCst);
    let err = manager
        .call(&ctx, sh("echo v2 > v.txt"))
        .await
        .expect_err("the snapshot cannot be written");
    assert_eq!(
        puts_after_kill.load(Ordering::SeqCst),
        1,
        "the server went away during the stop"
    );
    assert!(
        err.error.is_retryable(),
        "typed and retryable: {}",
        err.error
    );
    match outage {
        Outage::Down => assert!(
            matches!(err.error, sandbox_core::Error::Unavailable { .. }),
            "{}",
            err.error
        ),
        Outage::Slow => assert!(
            matches!(err.error, sandbox_core::Error::Timeout { .. }),
            "{}",
            err.error
        ),
    }
    let report = err.report.expect("a report");
    assert!(!report.persisted, "{report:?}");

    // The store comes back: the next call restores the first call's snapshot.
    match outage {
        Outage::Down => server.lock().unwrap().restart(),
        Outage::Slow => server.lock().unwrap().resume(),
    }
    let seen = manager
        .call(&ctx, sh("cat v.txt; wc -c < blob.bin"))
        .await
        .expect("the store is back")
        .value;
    assert_eq!(
        seen.split_whitespace().collect::<Vec<_>>(),
        ["v1", "300000"]
    );
}
