//! The store on a real S3-compatible server (`s3s-fs`, one per test, on loopback): the
//! blob-store suite, no orphaned multipart uploads (failed input, failed part, dropped
//! future), conditional writes, and typed errors for a closed port, a silent server and wrong
//! credentials. Run by `cargo xtask test` / `cargo xtask s3-test` (`SANDBOX_TEST_S3FS`).

mod common;

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use futures::StreamExt as _;
use sandbox_core::Error;
use sandbox_core::snapshot::{BlobKey, SnapshotStore, SnapshotStoreExt as _};
use sandbox_core::testkit::blobs::{pattern, pieces};
use snapshot_oss::testkit::{S3fs, free_port, test_options};
use snapshot_oss::{MIB, OssSnapshotStore, S3Config};

async fn s3() -> (Arc<dyn SnapshotStore>, S3fs) {
    let server = S3fs::start();
    let store = server.store("snapshots", "deployment/eu");
    (Arc::new(store), server)
}

mod blobs {
    sandbox_core::blob_store_tests!(
        super::s3(),
        listing_blobs = 2_100,
        #[cfg_attr(not(s3_tests), ignore = "needs s3s-fs; run by cargo xtask test")]
    );
}

/// Every non-empty blob as a multipart upload (no single PUT), parts one at a time.
async fn s3_multipart_only() -> (Arc<dyn SnapshotStore>, S3fs) {
    let server = S3fs::start();
    server.create_bucket("snapshots");
    let store = server
        .config("snapshots")
        .prefix("mp")
        .options(test_options().single_put_max(0).max_parts_in_flight(1))
        .build()
        .unwrap();
    (Arc::new(store), server)
}

mod blobs_multipart_only {
    sandbox_core::blob_store_tests!(
        super::s3_multipart_only(),
        listing_blobs = 300,
        #[cfg_attr(not(s3_tests), ignore = "needs s3s-fs; run by cargo xtask test")]
    );
}

fn key(s: &str) -> BlobKey {
    BlobKey::new(s).unwrap()
}

async fn read(store: &OssSnapshotStore, k: &BlobKey) -> Vec<u8> {
    sandbox_core::stream::collect(store.get(k).await.unwrap(), 1 << 30)
        .await
        .unwrap()
        .to_vec()
}

/// Poll `server` until no multipart upload is in progress (an abort spawned by a dropped
/// future runs on its own task).
async fn no_pending_uploads(server: &S3fs, what: &str) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    loop {
        let pending = server.pending_uploads();
        if pending.is_empty() {
            return;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "{what}: multipart uploads left on the server: {pending:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[cfg_attr(not(s3_tests), ignore = "needs s3s-fs; run by cargo xtask test")]
async fn no_orphaned_multipart_uploads() {
    let server = S3fs::start();
    server.create_bucket("orphans");
    let s3: Arc<dyn object_store::ObjectStore> = Arc::new(
        object_store::aws::AmazonS3Builder::new()
            .with_bucket_name("orphans")
            .with_endpoint(server.endpoint())
            .with_region("us-east-1")
            .with_access_key_id(snapshot_oss::testkit::ACCESS_KEY)
            .with_secret_access_key(snapshot_oss::testkit::SECRET_KEY)
            .with_allow_http(true)
            .build()
            .unwrap(),
    );
    let counting = common::Counting::new(s3);
    let counts = counting.counts.clone();
    let store = OssSnapshotStore::from_object_store(Arc::new(counting), "p")
        .unwrap()
        .with_options(test_options())
        .unwrap();
    let k = key("packs/ab/pack-1");
    let old = pattern(1, 1000);
    store.put_bytes(&k, Bytes::from(old.clone())).await.unwrap();
    let big = pattern(2, 30 * MIB);

    // 1. The input fails after 26 MiB: 16 MiB buffered, then parts; aborted before `put`
    //    returns, so nothing is pending right away.
    let failing = pieces(&big[..26 * MIB], 256 * 1024)
        .chain(futures::stream::iter([Err(Error::Timeout {
            operation: "export".into(),
            after: Duration::from_secs(1),
        })]))
        .boxed();
    let err = store.put(&k, failing, None).await.unwrap_err();
    assert!(matches!(err, Error::Timeout { .. }), "{err}");
    assert!(
        Counts::get(&counts.parts) >= 3,
        "parts were sent before the failure"
    );
    assert_eq!(
        server.pending_uploads(),
        Vec::<String>::new(),
        "after a failed input"
    );
    assert_eq!(read(&store, &k).await, old);

    // 2. The store fails the second part of the next upload.
    counts.fail_part.store(
        Counts::get(&counts.parts) + 2,
        std::sync::atomic::Ordering::SeqCst,
    );
    let err = store
        .put(&k, pieces(&big, 256 * 1024), None)
        .await
        .unwrap_err();
    assert!(err.is_retryable(), "{err}");
    assert_eq!(
        server.pending_uploads(),
        Vec::<String>::new(),
        "after a failed part"
    );
    assert_eq!(read(&store, &k).await, old);

    // 3. The future is dropped mid-upload, while the server holds the upload and its parts.
    let (reached, stalled) = tokio::sync::oneshot::channel::<()>();
    let mut reached = Some(reached);
    let stalling = pieces(&big, 256 * 1024)
        .chain(futures::stream::poll_fn(move |_| {
            if let Some(tx) = reached.take() {
                let _ = tx.send(());
            }
            std::task::Poll::Pending
        }))
        .boxed();
    let task = tokio::spawn({
        let store = store.clone();
        let k = k.clone();
        async move { store.put(&k, stalling, None).await }
    });
    stalled.await.unwrap();
    // All of the input was read: the upload and its parts are on the server now.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    while !server
        .pending_uploads()
        .iter()
        .any(|n| n.contains(".part-"))
    {
        assert!(
            tokio::time::Instant::now() < deadline,
            "no part ever reached the server"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    task.abort();
    assert!(task.await.unwrap_err().is_cancelled());
    no_pending_uploads(&server, "after a dropped upload").await;
    assert_eq!(read(&store, &k).await, old);
    assert_eq!(Counts::get(&counts.aborts), 3);
    assert_eq!(Counts::get(&counts.completes), 0);
    assert!(
        server.temporaries().is_empty(),
        "{:?}",
        server.temporaries()
    );

    // A completed upload leaves nothing either.
    store.put(&k, pieces(&big, 256 * 1024), None).await.unwrap();
    assert_eq!(server.pending_uploads(), Vec::<String>::new());
    assert_eq!(read(&store, &k).await, big);
}

use common::Counts;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[cfg_attr(not(s3_tests), ignore = "needs s3s-fs; run by cargo xtask test")]
async fn conditional_put_creates_once() {
    let server = S3fs::start();
    let store = server.store("cond", "");
    let k = key("chunks/ab/abcdef");
    assert!(store.put_if_absent(&k, "first".into()).await.unwrap());
    assert!(!store.put_if_absent(&k, "second".into()).await.unwrap());
    assert_eq!(read(&store, &k).await, b"first");

    // Configured off (as for Alibaba OSS): a typed refusal, nothing written.
    server.create_bucket("cond-off");
    let off = server
        .config("cond-off")
        .conditional_put(false)
        .build()
        .unwrap();
    let err = off.put_if_absent(&k, "x".into()).await.unwrap_err();
    assert!(matches!(err, Error::NotSupported { .. }), "{err}");
    assert!(!off.exists(&k).await.unwrap());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[cfg_attr(not(s3_tests), ignore = "needs s3s-fs; run by cargo xtask test")]
async fn outages_are_typed_and_retryable() {
    // Nothing listens on the port.
    let closed = S3Config::new("b")
        .endpoint(format!("http://127.0.0.1:{}", free_port()))
        .region("us-east-1")
        .credentials("id", "secret")
        .allow_http(true)
        .options(test_options())
        .build()
        .unwrap();
    let k = key("snapshots/ns/a.manifest");
    for err in [
        closed.get(&k).await.err().unwrap(),
        closed.exists(&k).await.unwrap_err(),
        closed.put_bytes(&k, "x".into()).await.unwrap_err(),
        closed.list_all("snapshots/").await.unwrap_err(),
    ] {
        assert!(
            matches!(err, Error::Unavailable { .. }) && err.is_retryable(),
            "{err}"
        );
        assert!(
            err.to_string().contains("s3 bucket `b`"),
            "names the service: {err}"
        );
    }

    // A server that accepts connections and never answers.
    let silent = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = silent.local_addr().unwrap().port();
    let held = std::thread::spawn(move || {
        let mut conns = Vec::new();
        for c in silent.incoming().take(8) {
            conns.push(c);
        }
        std::thread::sleep(Duration::from_secs(30));
    });
    let stalled = S3Config::new("b")
        .endpoint(format!("http://127.0.0.1:{port}"))
        .region("us-east-1")
        .credentials("id", "secret")
        .allow_http(true)
        .options(
            test_options()
                .read_timeout(Duration::from_millis(300))
                .request_timeout(Duration::from_millis(600))
                .max_retries(0),
        )
        .build()
        .unwrap();
    let err = stalled.exists(&k).await.unwrap_err();
    assert!(
        matches!(err, Error::Timeout { .. } | Error::Unavailable { .. }) && err.is_retryable(),
        "{err}"
    );
    drop(held);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[cfg_attr(not(s3_tests), ignore = "needs s3s-fs; run by cargo xtask test")]
async fn refused_credentials_are_not_retryable() {
    let server = S3fs::start();
    server.create_bucket("creds");
    let wrong = S3Config::new("creds")
        .endpoint(server.endpoint())
        .region("us-east-1")
        .credentials(snapshot_oss::testkit::ACCESS_KEY, "not-the-secret")
        .allow_http(true)
        .options(test_options())
        .build()
        .unwrap();
    let err = wrong.put_bytes(&key("a"), "x".into()).await.unwrap_err();
    assert!(!err.is_retryable(), "{err}");
    assert!(!err.to_string().contains("not-the-secret"), "{err}");
    assert!(!format!("{err:?}").contains("not-the-secret"), "{err:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[cfg_attr(not(s3_tests), ignore = "needs s3s-fs; run by cargo xtask test")]
async fn prefixes_keep_deployments_apart() {
    let server = S3fs::start();
    let a = server.store("shared", "team-a");
    let b = server.store("shared", "team-b");
    a.put_bytes(&key("chunks/x"), "a".into()).await.unwrap();
    b.put_bytes(&key("chunks/x"), "b".into()).await.unwrap();
    assert_eq!(read(&a, &key("chunks/x")).await, b"a");
    assert_eq!(a.list_all("").await.unwrap().len(), 1);
    b.delete(&key("chunks/x")).await.unwrap();
    assert!(a.exists(&key("chunks/x")).await.unwrap());
    // The layout on the server: <bucket>/<prefix>/<key>.
    assert!(server.data_dir().join("shared/team-a/chunks/x").is_file());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[cfg_attr(not(s3_tests), ignore = "needs s3s-fs; run by cargo xtask test")]
async fn ranges_at_or_past_the_end_are_empty() {
    let server = S3fs::start();
    let store = server.store("ranges", "");
    let k = key("packs/x");
    store.put_bytes(&k, "0123456789".into()).await.unwrap();
    for offset in [10, 11, 1_000_000] {
        let s = store.get_range(&k, offset, 5).await.unwrap();
        assert!(
            sandbox_core::stream::collect(s, 100)
                .await
                .unwrap()
                .is_empty(),
            "offset {offset}"
        );
    }
    let s = store.get_range(&k, 8, 5).await.unwrap();
    assert_eq!(
        &sandbox_core::stream::collect(s, 100).await.unwrap()[..],
        b"89"
    );
    assert!(matches!(
        store.get_range(&key("packs/missing"), 0, 0).await.err(),
        Some(Error::NotFound { .. })
    ));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[cfg_attr(not(s3_tests), ignore = "needs s3s-fs; run by cargo xtask test")]
async fn listing_is_one_request_per_page_as_the_stream_is_read() {
    let server = S3fs::start();
    server.create_bucket("pages");
    let store = server
        .config("pages")
        .prefix("p")
        .options(test_options().list_page(7))
        .build()
        .unwrap();
    for i in 0..30 {
        store
            .put_bytes(&key(&format!("chunks/c{i:02}")), "x".into())
            .await
            .unwrap();
    }
    store.put_bytes(&key("other/x"), "x".into()).await.unwrap();
    let before = store.requests();
    let first: Vec<_> = store.list("chunks/").take(3).collect().await;
    assert_eq!(first.len(), 3);
    assert_eq!(store.requests().since(&before).list, 1, "one page read");
    let before = store.requests();
    let all = store.list_all("chunks/").await.unwrap();
    assert_eq!(all.len(), 30);
    assert_eq!(
        store.requests().since(&before).list,
        5,
        "30 keys in pages of 7"
    );
    let c = store.list_all("chunks/c1").await.unwrap();
    assert_eq!(c.len(), 10, "a string prefix, not a directory");
}
