//! The blob-store suite: what every [`SnapshotStore`] must do, run by each edition (local
//! directory, S3, Redis) against its own instances. Give each scenario an empty store (a fresh
//! directory, bucket prefix or key prefix); [`blob_store_tests!`](crate::blob_store_tests)
//! generates one test per scenario from an expression that makes one.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use futures::StreamExt;

use crate::error::Error;
use crate::snapshot::{BlobKey, SnapshotStore, SnapshotStoreExt as _};
use crate::stream::{self, ByteStream};

fn key(s: &str) -> BlobKey {
    BlobKey::new(s).expect("a valid key")
}

/// `len` bytes that differ from those of any other `seed` (xorshift).
pub fn pattern(seed: u64, len: usize) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let mut out = Vec::with_capacity(len + 8);
    while out.len() < len {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        out.extend_from_slice(&x.to_le_bytes());
    }
    out.truncate(len);
    out
}

/// `data` as a stream of `piece`-byte chunks, of no announced length.
pub fn pieces(data: &[u8], piece: usize) -> ByteStream {
    let chunks: Vec<crate::Result<Bytes>> = data
        .chunks(piece.max(1))
        .map(|c| Ok(Bytes::copy_from_slice(c)))
        .collect();
    futures::stream::iter(chunks).boxed()
}

async fn read(store: &dyn SnapshotStore, k: &BlobKey) -> Vec<u8> {
    stream::collect(store.get(k).await.expect("get"), 1 << 30)
        .await
        .expect("read")
        .to_vec()
}

async fn read_range(store: &dyn SnapshotStore, k: &BlobKey, offset: u64, len: u64) -> Vec<u8> {
    let s = store.get_range(k, offset, len).await.expect("get_range");
    stream::collect(s, 1 << 30)
        .await
        .expect("read range")
        .to_vec()
}

/// Put, get, exists, replace, delete; a missing key is `NotFound` for `get` and `get_range`,
/// `false` for `exists`, and deleting it is no error; an empty blob is a blob.
pub async fn round_trip(store: Arc<dyn SnapshotStore>) {
    let k = key("snapshots/ns/one.tar");
    assert!(!store.exists(&k).await.unwrap());
    assert!(matches!(
        store.get(&k).await.err(),
        Some(Error::NotFound { .. })
    ));
    assert!(matches!(
        store.get_range(&k, 0, 1).await.err(),
        Some(Error::NotFound { .. })
    ));
    store.delete(&k).await.expect("deleting a missing key");

    assert_eq!(
        store
            .put_bytes(&k, Bytes::from_static(b"hello"))
            .await
            .unwrap(),
        5
    );
    assert!(store.exists(&k).await.unwrap());
    assert_eq!(read(&*store, &k).await, b"hello");
    // Replacing.
    assert_eq!(
        store
            .put(&k, pieces(b"goodbye world", 3), None)
            .await
            .unwrap(),
        13
    );
    assert_eq!(read(&*store, &k).await, b"goodbye world");

    let empty = key("snapshots/ns/empty");
    assert_eq!(store.put_bytes(&empty, Bytes::new()).await.unwrap(), 0);
    assert!(store.exists(&empty).await.unwrap());
    assert_eq!(read(&*store, &empty).await, b"");

    store.delete(&k).await.unwrap();
    assert!(!store.exists(&k).await.unwrap());
    assert!(matches!(
        store.get(&k).await.err(),
        Some(Error::NotFound { .. })
    ));
    store.delete(&empty).await.unwrap();
    assert!(store.list_all("snapshots/").await.unwrap().is_empty());
}

/// Ranged reads: at the start, across the blob's middle, to the end, past the end (short),
/// and of zero bytes.
pub async fn ranges(store: Arc<dyn SnapshotStore>) {
    let data = pattern(1, 3 * 1024 * 1024 + 17);
    let k = key("packs/ab/range-test");
    store.put(&k, pieces(&data, 100_000), None).await.unwrap();
    let n = data.len() as u64;
    for (offset, len) in [
        (0, 1),
        (0, 4096),
        (1, 1_000_000),
        (1_048_575, 2),
        (2_000_000, 1_048_593),
        (n - 1, 1),
        (n / 2, 0),
    ] {
        let got = read_range(&*store, &k, offset, len).await;
        assert_eq!(got.len() as u64, len, "{offset}+{len}");
        assert!(
            got[..] == data[offset as usize..(offset + len) as usize],
            "{offset}+{len}: other bytes"
        );
    }
    let tail = read_range(&*store, &k, n - 10, 100).await;
    assert_eq!(
        tail[..],
        data[data.len() - 10..],
        "a range past the end ends early"
    );
}

/// A blob far larger than any one buffer, of unknown and of announced length, streams both
/// ways intact.
pub async fn large_blobs_stream(store: Arc<dyn SnapshotStore>) {
    for (i, announced) in [(0u64, false), (1, true)] {
        let data = pattern(10 + i, 24 * 1024 * 1024 + 3);
        let k = key(&format!("packs/cd/large-{i}"));
        let size = announced.then_some(data.len() as u64);
        let written = store.put(&k, pieces(&data, 64 * 1024), size).await.unwrap();
        assert_eq!(written, data.len() as u64);
        let mut got = store.get(&k).await.unwrap();
        let mut hasher = blake3::Hasher::new();
        let mut n = 0usize;
        while let Some(chunk) = got.next().await {
            let chunk = chunk.unwrap();
            n += chunk.len();
            hasher.update(&chunk);
        }
        assert_eq!(n, data.len());
        assert_eq!(
            hasher.finalize(),
            blake3::hash(&data),
            "announced {announced}"
        );
    }
}

/// An upload whose input fails mid-way, or that is dropped mid-way, leaves the previous blob
/// whole and no other blob behind.
pub async fn failed_and_cancelled_puts_keep_the_old_blob(store: Arc<dyn SnapshotStore>) {
    let k = key("snapshots/ns/keep.manifest");
    let old = pattern(2, 100_000);
    store.put_bytes(&k, Bytes::from(old.clone())).await.unwrap();

    // The input fails after 6 MiB (past a multipart store's first part).
    let big = pattern(3, 6 * 1024 * 1024);
    let failing = pieces(&big, 256 * 1024)
        .chain(futures::stream::iter([Err(Error::Timeout {
            operation: "export".into(),
            after: Duration::from_secs(1),
        })]))
        .boxed();
    assert!(store.put(&k, failing, None).await.is_err());
    assert_eq!(read(&*store, &k).await, old, "after a failed upload");

    // The upload is dropped while its input stalls after 6 MiB.
    let stalling = pieces(&big, 256 * 1024)
        .chain(futures::stream::pending())
        .boxed();
    let put = store.put(&k, stalling, None);
    assert!(
        tokio::time::timeout(Duration::from_secs(2), put)
            .await
            .is_err(),
        "a stalled upload cannot finish"
    );
    assert_eq!(read(&*store, &k).await, old, "after a dropped upload");

    let listed = store.list_all("snapshots/").await.unwrap();
    assert_eq!(listed.len(), 1, "nothing else was left: {listed:?}");
    assert_eq!(listed[0].size, old.len() as u64);
}

/// Listing: by prefix (a prefix is a string prefix, not a directory), across pages, with
/// sizes and modification times; a consumer may stop early.
pub async fn listing(store: Arc<dyn SnapshotStore>, blobs: usize) {
    let started = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs() as i64;
    let put = futures::stream::iter(0..blobs)
        .map(|i| {
            let store = store.clone();
            async move {
                let k = key(&format!("chunks/{:02x}/c{i:05}", i % 256));
                let data = Bytes::from(vec![b'x'; i % 7]);
                store.put_bytes(&k, data).await
            }
        })
        .buffer_unordered(16)
        .collect::<Vec<_>>()
        .await;
    assert!(put.iter().all(|r| r.is_ok()), "puts: {put:?}");
    // (A key is never also a "directory" of others: the engine does not make such keys, and
    // a file-backed store cannot hold them.)
    for k in ["p/x/c", "p/xy", "p/xz/d", "pq"] {
        store
            .put_bytes(&key(k), Bytes::from_static(b"1"))
            .await
            .unwrap();
    }

    let listed = store.list_all("chunks/").await.unwrap();
    let mut expected: Vec<(String, u64)> = (0..blobs)
        .map(|i| (format!("chunks/{:02x}/c{i:05}", i % 256), (i % 7) as u64))
        .collect();
    expected.sort();
    let got: Vec<(String, u64)> = listed
        .iter()
        .map(|m| (m.key.as_str().to_owned(), m.size))
        .collect();
    assert!(
        got == expected,
        "{} listed, {} put (or sizes differ)",
        got.len(),
        blobs
    );
    for meta in &listed {
        let modified = meta.modified_unix.expect("a modification time, for GC");
        assert!(
            (started - 60..started + 600).contains(&modified),
            "{}: modified {modified}, the test started at {started}",
            meta.key
        );
    }
    let names = |v: Vec<crate::snapshot::BlobMeta>| -> Vec<String> {
        v.into_iter().map(|m| m.key.as_str().to_owned()).collect()
    };
    assert_eq!(
        names(store.list_all("p/x").await.unwrap()),
        ["p/x/c", "p/xy", "p/xz/d"]
    );
    assert_eq!(names(store.list_all("p/x/").await.unwrap()), ["p/x/c"]);
    assert_eq!(names(store.list_all("pq").await.unwrap()), ["pq"]);
    assert_eq!(store.list_all("p").await.unwrap().len(), 4);
    assert!(store.list_all("zz").await.unwrap().is_empty());

    let first: Vec<_> = store.list("chunks/").take(3).collect().await;
    assert_eq!(first.len(), 3, "a consumer may stop early");
}

/// Concurrent uploads to one key: the result is one of them, whole.
pub async fn concurrent_puts_are_atomic(store: Arc<dyn SnapshotStore>) {
    let k = key("snapshots/ns/raced.manifest");
    let contents: Vec<Vec<u8>> = (0..8).map(|i| pattern(100 + i, 300_000)).collect();
    let puts = contents.iter().map(|c| {
        let store = store.clone();
        let k = k.clone();
        let c = c.clone();
        async move { store.put(&k, pieces(&c, 10_000), None).await }
    });
    for r in futures::future::join_all(puts).await {
        r.expect("put");
    }
    let got = read(&*store, &k).await;
    assert!(
        contents.contains(&got),
        "a torn or mixed blob ({} bytes)",
        got.len()
    );
}

/// One `#[tokio::test]` per blob-store scenario. `$make` is an expression of type
/// `impl Future<Output = (Arc<dyn SnapshotStore>, G)>` giving an empty store each time and
/// whatever must live as long as it (a `TempDir`, a prefix that is purged on drop, `()`);
/// `$blobs` how many blobs the listing scenario writes (more than a page of the store).
#[macro_export]
macro_rules! blob_store_tests {
    ($make:expr, listing_blobs = $blobs:expr $(, #[$attr:meta])* $(,)?) => {
        $crate::blob_store_tests!(@each [$make] [$(#[$attr])*]
            round_trip ranges large_blobs_stream failed_and_cancelled_puts_keep_the_old_blob
            concurrent_puts_are_atomic);
        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        $(#[$attr])*
        async fn blob_listing() {
            let (store, _keep) = $make.await;
            $crate::testkit::blobs::listing(store, $blobs).await;
        }
    };
    (@each [$make:expr] $attrs:tt $($name:ident)*) => {
        $( $crate::blob_store_tests!(@one [$make] $attrs $name); )*
    };
    (@one [$make:expr] [$(#[$attr:meta])*] $name:ident) => {
        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        $(#[$attr])*
        async fn $name() {
            let (store, _keep) = $make.await;
            $crate::testkit::blobs::$name(store).await;
        }
    };
}
