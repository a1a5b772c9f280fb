//! Stores on the test Redis (`SANDBOX_TEST_REDIS_URL`) under a fresh key prefix each, purged
//! when they go; the keys a prefix holds.
#![allow(dead_code)] // each test binary uses a part

use std::sync::Arc;

use sandbox_core::snapshot::{BlobKey, BlobMeta, BlobStream, SnapshotStore};
use sandbox_core::stream::ByteStream;
use sandbox_core::testkit::OnStore;
use sandbox_core::{Reach, Result, async_trait};
use sandbox_local::testkit::LocalFixture;
use snapshot_redis::{RedisSnapshotOptions, RedisSnapshotStore};
use store_redis::testkit;

/// Options on the test server under a prefix of their own.
pub fn options() -> RedisSnapshotOptions {
    RedisSnapshotOptions::with_connection(testkit::options())
}

/// Removes every key under its prefix when dropped (also when the test panics).
pub struct Purge(pub RedisSnapshotOptions);

impl Drop for Purge {
    fn drop(&mut self) {
        let connection = self.0.connection.clone();
        // `Drop` may run on a runtime's thread: purge on a runtime of its own.
        let purged = std::thread::spawn(move || {
            tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .expect("runtime")
                .block_on(testkit::purge(&connection))
        })
        .join();
        if !matches!(purged, Ok(Ok(_))) {
            eprintln!("purging {} failed", self.0.connection.key_prefix);
        }
    }
}

/// A store over `options`, and the guard that purges its keys.
pub async fn store_with(options: RedisSnapshotOptions) -> (Arc<dyn SnapshotStore>, Purge) {
    let store = RedisSnapshotStore::new(options.clone()).expect("store");
    (Arc::new(store), Purge(options))
}

/// A store that purges its prefix when the last handle goes: for the conformance kit, whose
/// scenarios keep only the store.
#[derive(Debug)]
pub struct Purging {
    inner: RedisSnapshotStore,
    purge: PurgeOnDrop,
}

pub struct PurgeOnDrop(Purge);

impl std::fmt::Debug for PurgeOnDrop {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("PurgeOnDrop")
    }
}

impl Purging {
    pub fn new(options: RedisSnapshotOptions) -> Purging {
        Purging {
            inner: RedisSnapshotStore::new(options.clone()).expect("store"),
            purge: PurgeOnDrop(Purge(options)),
        }
    }
}

#[async_trait]
#[deny(clippy::missing_trait_methods)]
impl SnapshotStore for Purging {
    fn name(&self) -> &'static str {
        self.inner.name()
    }
    fn reach(&self) -> Reach {
        self.inner.reach()
    }
    async fn put(&self, key: &BlobKey, data: ByteStream, size: Option<u64>) -> Result<u64> {
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

/// The local backend with every scenario's snapshots in a Redis store of its own.
pub fn on_redis(options: fn() -> RedisSnapshotOptions) -> OnStore<LocalFixture> {
    OnStore {
        inner: LocalFixture::new(),
        make: Arc::new(move || {
            Box::pin(async move { Arc::new(Purging::new(options())) as Arc<dyn SnapshotStore> })
        }),
    }
}

#[allow(unused_imports)] // not every test binary uses both
pub use store_redis::testkit::{keys_under as keys, raw};

/// The metadata listing's view of a blob, for tests that compare.
pub fn sizes(listed: &[BlobMeta]) -> Vec<(String, u64)> {
    listed
        .iter()
        .map(|m| (m.key.as_str().to_owned(), m.size))
        .collect()
}
