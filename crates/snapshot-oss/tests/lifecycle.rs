//! The conformance kit's snapshot scenarios with every snapshot in S3 (`s3s-fs`, a bucket per
//! scenario) on the local backend, and the store going down in the middle of a stop: a typed
//! retryable error, and the previous snapshot still current and restorable.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use futures::FutureExt as _;
use sandbox_core::snapshot::{BlobKey, BlobStream, SnapshotStore};
use sandbox_core::stream::ByteStream;
use sandbox_core::testkit::{Fixture, OnStore};
use sandbox_core::{
    ExecRequest, FileStateStore, InProcessGuard, IsolationScope, Persistence, Reach, Result,
    SandboxConfig, SandboxManager, SnapshotSpec, WorkspaceSpec,
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

/// Forwards to an S3 store; once armed, takes the server away at the next `put`, before
/// passing it on: the stop has started (it may have read the parent's manifest) and its upload
/// meets a store that is gone or silent.
#[derive(Debug)]
struct KillAtPut {
    inner: Arc<dyn SnapshotStore>,
    server: Arc<Mutex<S3fs>>,
    armed: std::sync::atomic::AtomicBool,
    outage: Outage,
    puts_after_kill: std::sync::atomic::AtomicUsize,
}

#[async_trait]
impl SnapshotStore for KillAtPut {
    fn name(&self) -> &'static str {
        self.inner.name()
    }
    fn reach(&self) -> Reach {
        self.inner.reach()
    }
    async fn put(&self, key: &BlobKey, data: ByteStream, size: Option<u64>) -> Result<u64> {
        if self.armed.swap(false, std::sync::atomic::Ordering::SeqCst) {
            match self.outage {
                Outage::Down => self.server.lock().unwrap().kill(),
                Outage::Slow => self.server.lock().unwrap().pause(),
            }
            self.puts_after_kill
                .fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        }
        self.inner.put(key, data, size).await
    }
    async fn get(&self, key: &BlobKey) -> Result<ByteStream> {
        self.inner.get(key).await
    }
    async fn get_range(&self, key: &BlobKey, offset: u64, len: u64) -> Result<ByteStream> {
        self.inner.get_range(key, offset, len).await
    }
    async fn exists(&self, key: &BlobKey) -> Result<bool> {
        self.inner.exists(key).await
    }
    async fn delete(&self, key: &BlobKey) -> Result<()> {
        self.inner.delete(key).await
    }
    fn list(&self, prefix: &str) -> BlobStream {
        self.inner.list(prefix)
    }
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
    let store = Arc::new(KillAtPut {
        inner: s3,
        server: server.clone(),
        armed: false.into(),
        outage,
        puts_after_kill: 0.into(),
    });
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

    store.armed.store(true, std::sync::atomic::Ordering::SeqCst);
    let err = manager
        .call(&ctx, sh("echo v2 > v.txt"))
        .await
        .expect_err("the snapshot cannot be written");
    assert_eq!(
        store
            .puts_after_kill
            .load(std::sync::atomic::Ordering::SeqCst),
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
