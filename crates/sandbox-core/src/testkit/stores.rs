//! Store wrappers for failure scenarios.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use async_trait::async_trait;
use futures::StreamExt;

use crate::error::{Error, Result};
use crate::reach::Reach;
use crate::snapshot::{BlobKey, BlobStream, SnapshotStore};
use crate::stream::ByteStream;

/// Wraps a store; after [`fail_after`](Self::fail_after), every `put` reads that many bytes of
/// its input and then fails as if the service went away mid-upload. Counts chunk reads.
#[derive(Debug)]
pub struct FailingStore {
    inner: Arc<dyn SnapshotStore>,
    budget: Arc<AtomicU64>,
    chunk_gets: AtomicU64,
}

impl FailingStore {
    /// A healthy wrapper around `inner`.
    pub fn new(inner: Arc<dyn SnapshotStore>) -> Self {
        FailingStore {
            inner,
            budget: Arc::new(AtomicU64::new(u64::MAX)),
            chunk_gets: AtomicU64::new(0),
        }
    }

    /// Fail every upload after `bytes` bytes.
    pub fn fail_after(&self, bytes: u64) {
        self.budget.store(bytes, Ordering::SeqCst);
    }

    /// How many chunk blobs were read so far.
    pub fn chunk_gets(&self) -> u64 {
        self.chunk_gets.load(Ordering::SeqCst)
    }

    /// Stop failing.
    pub fn heal(&self) {
        self.budget.store(u64::MAX, Ordering::SeqCst);
    }
}

#[async_trait]
impl SnapshotStore for FailingStore {
    fn name(&self) -> &'static str {
        "failing"
    }

    fn reach(&self) -> Reach {
        self.inner.reach()
    }

    async fn put(&self, key: &BlobKey, data: ByteStream, size: Option<u64>) -> Result<u64> {
        let budget = self.budget.load(Ordering::SeqCst);
        let mut seen = 0u64;
        let limited = data
            .map(move |chunk| {
                let chunk = chunk?;
                seen += chunk.len() as u64;
                if seen > budget {
                    return Err(Error::Unavailable {
                        service: "snapshot store (injected failure)".into(),
                        reason: format!("connection lost after {budget} bytes"),
                        source: None,
                    });
                }
                Ok(chunk)
            })
            .boxed();
        self.inner.put(key, limited, size).await
    }

    async fn get(&self, key: &BlobKey) -> Result<ByteStream> {
        if key.as_str().starts_with("chunks/") {
            self.chunk_gets.fetch_add(1, Ordering::SeqCst);
        }
        self.inner.get(key).await
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
