//! Stores on the test Redis (`SANDBOX_TEST_REDIS_URL`) under a fresh key prefix each, purged
//! when they go; the keys a prefix holds.
#![allow(dead_code)] // each test binary uses a part

use std::sync::Arc;

use sandbox_core::snapshot::{BlobMeta, SnapshotStore};
use sandbox_core::testkit::{HookedStore, OnStore};
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

/// The local backend with every scenario's snapshots in a Redis store of its own.
pub fn on_redis(options: fn() -> RedisSnapshotOptions) -> OnStore<LocalFixture> {
    OnStore {
        inner: LocalFixture::new(),
        make: Arc::new(move || {
            Box::pin(async move {
                // The kit's scenarios keep only the store: it purges its prefix when the last
                // handle goes.
                let (store, purge) = store_with(options()).await;
                Arc::new(HookedStore::new(store).keep(purge)) as Arc<dyn SnapshotStore>
            })
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
