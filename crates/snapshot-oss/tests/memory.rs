//! The store over `object_store`'s in-memory and local-directory backends (no service needed):
//! the blob-store suite, and the shape of uploads (one PUT or parts, how many at once, what is
//! aborted) seen through a counting wrapper.

mod common;

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use common::{Counting, Counts};
use futures::StreamExt as _;
use object_store::memory::InMemory;
use sandbox_core::snapshot::{BlobKey, SnapshotStore, SnapshotStoreExt as _};
use sandbox_core::testkit::blobs::{pattern, pieces};
use sandbox_core::{Error, Reach};
use snapshot_oss::{MIB, OssOptions, OssSnapshotStore};

async fn memory() -> (Arc<dyn SnapshotStore>, ()) {
    let store = OssSnapshotStore::from_object_store(Arc::new(InMemory::new()), "tenant/snaps")
        .unwrap()
        .with_reach(Reach::Process)
        .with_name("memory");
    (Arc::new(store), ())
}

mod in_memory {
    sandbox_core::blob_store_tests!(super::memory(), listing_blobs = 2_500);
}

mod local_directory {
    use super::*;

    async fn local() -> (Arc<dyn SnapshotStore>, tempfile::TempDir) {
        let dir = tempfile::tempdir().unwrap();
        let fs = object_store::local::LocalFileSystem::new_with_prefix(dir.path()).unwrap();
        let store = OssSnapshotStore::from_object_store(Arc::new(fs), "")
            .unwrap()
            .with_reach(Reach::Host);
        (Arc::new(store), dir)
    }

    sandbox_core::blob_store_tests!(local(), listing_blobs = 1_100);
}

fn counted(options: OssOptions) -> (OssSnapshotStore, Arc<Counts>, Arc<InMemory>) {
    let memory = Arc::new(InMemory::new());
    let counting = Counting::new(memory.clone());
    let counts = counting.counts.clone();
    let store = OssSnapshotStore::from_object_store(Arc::new(counting), "p")
        .unwrap()
        .with_options(options)
        .unwrap();
    (store, counts, memory)
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

#[tokio::test]
async fn small_blobs_are_one_put_known_length_or_not() {
    let (store, counts, _) = counted(OssOptions::default());
    let data = pattern(1, 3 * MIB);
    store
        .put(&key("a"), pieces(&data, 64 * 1024), Some(data.len() as u64))
        .await
        .unwrap();
    store
        .put(&key("b"), pieces(&data, 64 * 1024), None)
        .await
        .unwrap();
    assert_eq!(Counts::get(&counts.puts), 2);
    assert_eq!(Counts::get(&counts.multipart_starts), 0);
    let r = store.requests();
    assert_eq!((r.put, r.multipart_start, r.part), (2, 0, 0), "{r:?}");
    assert_eq!(read(&store, &key("b")).await, data);
}

#[tokio::test]
async fn large_blobs_stream_in_parts_with_bounded_concurrency() {
    let options = OssOptions::default().max_parts_in_flight(2);
    let (store, counts, _) = counted(options);
    let data = pattern(2, 40 * MIB + 123);
    let n = store
        .put(&key("big"), pieces(&data, 100_000), None)
        .await
        .unwrap();
    assert_eq!(n, data.len() as u64);
    assert_eq!(Counts::get(&counts.puts), 0);
    assert_eq!(Counts::get(&counts.multipart_starts), 1);
    assert_eq!(Counts::get(&counts.completes), 1);
    assert_eq!(Counts::get(&counts.aborts), 0);
    let sizes = counts.part_sizes.lock().unwrap().clone();
    assert_eq!(sizes.iter().sum::<usize>(), data.len());
    assert!(
        sizes[..sizes.len() - 1].iter().all(|&s| s == 5 * MIB),
        "5 MiB parts, the last one shorter: {sizes:?}"
    );
    assert!(Counts::get(&counts.max_in_flight) <= 2);
    let r = store.requests();
    assert_eq!(
        (
            r.put,
            r.multipart_start,
            r.part as usize,
            r.complete,
            r.abort
        ),
        (0, 1, sizes.len(), 1, 0),
        "the store's own request counts: {r:?}"
    );
    assert_eq!(read(&store, &key("big")).await, data);

    // A known length picks one part size for the whole blob.
    let n = store
        .put(
            &key("known"),
            pieces(&data, 100_000),
            Some(data.len() as u64),
        )
        .await
        .unwrap();
    assert_eq!(n, data.len() as u64);
    assert_eq!(read(&store, &key("known")).await, data);
}

#[tokio::test]
async fn a_wrong_announced_size_writes_nothing() {
    let (store, counts, _) = counted(OssOptions::default());
    let k = key("sized");
    for (len, announced) in [(100usize, 99u64), (100, 101), (20 * MIB, 19 * MIB as u64)] {
        let data = pattern(3, len);
        let err = store
            .put(&k, pieces(&data, 64 * 1024), Some(announced))
            .await
            .unwrap_err();
        assert!(matches!(err, Error::InvalidInput { .. }), "{err}");
    }
    assert!(!store.exists(&k).await.unwrap());
    assert_eq!(
        Counts::get(&counts.aborts),
        Counts::get(&counts.multipart_starts),
        "every started upload was aborted"
    );
}

#[tokio::test]
async fn failed_input_store_error_and_cancellation_abort_the_upload() {
    let (store, counts, _) = counted(OssOptions::default());
    let k = key("aborted");
    let big = pattern(4, 30 * MIB);

    // The input fails after 25 MiB: the upload started (16 MiB buffered, then parts).
    let failing = pieces(&big[..25 * MIB], 256 * 1024)
        .chain(futures::stream::iter([Err(Error::Timeout {
            operation: "export".into(),
            after: Duration::from_secs(1),
        })]))
        .boxed();
    let err = store.put(&k, failing, None).await.unwrap_err();
    assert!(
        matches!(err, Error::Timeout { .. }),
        "the input's error: {err}"
    );
    assert_eq!(Counts::get(&counts.multipart_starts), 1);
    assert_eq!(
        Counts::get(&counts.aborts),
        1,
        "aborted before put returned"
    );

    // A part fails on the store's side.
    counts.fail_part.store(
        Counts::get(&counts.parts) + 2,
        std::sync::atomic::Ordering::SeqCst,
    );
    let err = store
        .put(&k, pieces(&big, 256 * 1024), None)
        .await
        .unwrap_err();
    assert!(
        matches!(err, Error::Unavailable { .. }),
        "a 503 is retryable: {err}"
    );
    assert_eq!(Counts::get(&counts.aborts), 2);
    assert_eq!(Counts::get(&counts.completes), 0);

    // The put future is dropped while its input stalls.
    let stalling = pieces(&big, 256 * 1024)
        .chain(futures::stream::pending())
        .boxed();
    let dropped = tokio::time::timeout(Duration::from_millis(500), store.put(&k, stalling, None));
    assert!(dropped.await.is_err(), "a stalled upload cannot finish");
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while Counts::get(&counts.aborts) < 3 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the dropped upload was never aborted"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(Counts::get(&counts.multipart_starts), 3);
    assert!(!store.exists(&k).await.unwrap(), "nothing was written");
    let r = store.requests();
    assert_eq!((r.multipart_start, r.abort, r.complete), (3, 3, 0), "{r:?}");
}

#[tokio::test]
async fn ranged_reads_are_one_ranged_request() {
    let (store, counts, _) = counted(OssOptions::default());
    let data = pattern(5, MIB);
    store
        .put_bytes(&key("r"), Bytes::from(data.clone()))
        .await
        .unwrap();
    let got = sandbox_core::stream::collect(
        store.get_range(&key("r"), 1000, 5000).await.unwrap(),
        1 << 20,
    )
    .await
    .unwrap();
    assert_eq!(&got[..], &data[1000..6000]);
    assert_eq!(Counts::get(&counts.ranged_gets), 1);
    assert_eq!(Counts::get(&counts.gets), 0, "no whole-blob read");
    let r = store.requests();
    assert_eq!((r.get, r.ranged_get, r.head), (1, 1, 0), "{r:?}");
    // Past the end: empty, not an error.
    let past = store
        .get_range(&key("r"), MIB as u64 + 10, 5)
        .await
        .unwrap();
    assert!(
        sandbox_core::stream::collect(past, 10)
            .await
            .unwrap()
            .is_empty()
    );
}

#[tokio::test]
async fn put_if_absent_writes_once() {
    let (store, _, _) = counted(OssOptions::default());
    let k = key("chunks/ab/once");
    assert!(store.put_if_absent(&k, "first".into()).await.unwrap());
    assert!(!store.put_if_absent(&k, "second".into()).await.unwrap());
    assert_eq!(read(&store, &k).await, b"first");
}

#[tokio::test]
async fn listing_reads_pages_lazily_and_strips_the_prefix() {
    let (store, _, memory) = counted(OssOptions::default());
    // An object under the prefix that is no blob key is skipped; one outside is not seen.
    use object_store::ObjectStoreExt as _;
    memory
        .put(&"p/chunks/.odd".into(), "x".into())
        .await
        .unwrap();
    memory
        .put(&"other/chunks/a".into(), "x".into())
        .await
        .unwrap();
    store.put_bytes(&key("chunks/a"), "1".into()).await.unwrap();
    let listed = store.list_all("chunks/").await.unwrap();
    let names: Vec<&str> = listed.iter().map(|m| m.key.as_str()).collect();
    assert_eq!(names, ["chunks/a"]);
}

/// The store cannot list the multipart uploads a killed process left: its sweep is a typed
/// `NotSupported` naming the lifecycle rule, and snapshot gc goes on without it.
#[tokio::test]
async fn leftover_sweep_is_not_supported_and_gc_goes_on() {
    let (store, ()) = memory().await;
    let err = store
        .sweep_leftovers(sandbox_core::LeftoverSweep::default())
        .await
        .expect_err("not supported");
    assert!(
        matches!(&err, Error::NotSupported { operation, .. } if operation.contains("AbortIncompleteMultipartUpload")),
        "{err}"
    );
    let report = sandbox_core::snapshot::gc(
        &*store,
        &sandbox_core::archive::ArchivePolicy::default(),
        sandbox_core::snapshot::GcOptions::default(),
        &sandbox_core::MemoryStateStore::new(),
    )
    .await
    .expect("gc");
    assert_eq!(report.leftovers, None);
}
