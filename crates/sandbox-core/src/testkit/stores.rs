//! Store wrappers for failure scenarios, counting and test hooks.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use async_trait::async_trait;
use futures::StreamExt;

use crate::error::{Error, Result};
use crate::reach::Reach;
use crate::snapshot::{BlobKey, BlobStream, SnapshotStore, WriteHints};
use crate::stream::ByteStream;

/// Chunk data: a chunk or bundle blob, or a pack (not a redirect).
fn is_chunk_data(key: &BlobKey) -> bool {
    let k = key.as_str();
    k.starts_with("chunks/") || (k.starts_with("packs/") && !k.ends_with(".moved"))
}

/// A store (a [`HookedStore`] around another) whose puts, after
/// [`fail_after`](Self::fail_after), read that many bytes of their input and then fail as if
/// the service went away mid-upload; counts chunk reads. Hand [`store`](Self::store) to the
/// code under test and keep this to steer it.
#[derive(Debug, Clone)]
pub struct FailingStore {
    store: Arc<HookedStore>,
    budget: Arc<AtomicU64>,
    chunk_gets: Arc<AtomicU64>,
}

impl FailingStore {
    /// A healthy wrapper around `inner`.
    pub fn new(inner: Arc<dyn SnapshotStore>) -> Self {
        let budget = Arc::new(AtomicU64::new(u64::MAX));
        let chunk_gets = Arc::new(AtomicU64::new(0));
        let store = HookedStore::new(inner)
            .on_put({
                let budget = budget.clone();
                move |_, data| {
                    let budget = budget.load(Ordering::SeqCst);
                    let mut seen = 0u64;
                    data.map(move |chunk| {
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
                    .boxed()
                }
            })
            .on_get({
                let chunk_gets = chunk_gets.clone();
                move |key| {
                    if is_chunk_data(key) {
                        chunk_gets.fetch_add(1, Ordering::SeqCst);
                    }
                }
            });
        FailingStore {
            store: Arc::new(store),
            budget,
            chunk_gets,
        }
    }

    /// The store to hand to the code under test.
    pub fn store(&self) -> Arc<dyn SnapshotStore> {
        self.store.clone()
    }

    /// Fail every upload after `bytes` bytes.
    pub fn fail_after(&self, bytes: u64) {
        self.budget.store(bytes, Ordering::SeqCst);
    }

    /// How many reads of chunk data (chunk blobs, ranged reads of packs) so far.
    pub fn chunk_gets(&self) -> u64 {
        self.chunk_gets.load(Ordering::SeqCst)
    }

    /// Stop failing.
    pub fn heal(&self) {
        self.budget.store(u64::MAX, Ordering::SeqCst);
    }
}

/// Requests and bytes a [`CountingStore`] saw, per kind.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[non_exhaustive]
pub struct StoreCounts {
    /// `put` calls.
    pub puts: u64,
    /// `get` and `get_range` calls.
    pub gets: u64,
    /// `list` calls (one per listing, whatever its pages).
    pub lists: u64,
    /// `delete` calls.
    pub deletes: u64,
    /// `exists` calls.
    pub exists: u64,
    /// Bytes the store accepted in `put`s.
    pub bytes_written: u64,
    /// Bytes read back through `get`/`get_range` streams.
    pub bytes_read: u64,
    /// The most bytes that `put`s had read from their inputs and not yet returned from, at
    /// any moment: what puts in flight held together, at most (exactly, for a store that
    /// holds its input until it is sent). Not a sum: [`since`](Self::since) keeps the later
    /// value.
    #[serde(default)]
    pub max_put_bytes_in_flight: u64,
}

impl StoreCounts {
    /// The counts accumulated since `earlier`.
    pub fn since(&self, earlier: &StoreCounts) -> StoreCounts {
        StoreCounts {
            puts: self.puts - earlier.puts,
            gets: self.gets - earlier.gets,
            lists: self.lists - earlier.lists,
            deletes: self.deletes - earlier.deletes,
            exists: self.exists - earlier.exists,
            bytes_written: self.bytes_written - earlier.bytes_written,
            bytes_read: self.bytes_read - earlier.bytes_read,
            max_put_bytes_in_flight: self.max_put_bytes_in_flight,
        }
    }
}

/// Forwards every call to a store and counts requests and bytes (for benches and tests on any
/// store: local, S3, Redis).
#[derive(Debug)]
pub struct CountingStore {
    inner: Arc<dyn SnapshotStore>,
    counts: Arc<Counters>,
}

#[derive(Debug, Default)]
struct Counters {
    puts: AtomicU64,
    gets: AtomicU64,
    lists: AtomicU64,
    deletes: AtomicU64,
    exists: AtomicU64,
    bytes_written: AtomicU64,
    bytes_read: AtomicU64,
    put_bytes_in_flight: AtomicU64,
    max_put_bytes_in_flight: AtomicU64,
}

impl CountingStore {
    /// Count the calls to `inner`.
    pub fn new(inner: Arc<dyn SnapshotStore>) -> Self {
        CountingStore {
            inner,
            counts: Arc::default(),
        }
    }

    /// The counts so far.
    pub fn counts(&self) -> StoreCounts {
        let c = &self.counts;
        StoreCounts {
            puts: c.puts.load(Ordering::SeqCst),
            gets: c.gets.load(Ordering::SeqCst),
            lists: c.lists.load(Ordering::SeqCst),
            deletes: c.deletes.load(Ordering::SeqCst),
            exists: c.exists.load(Ordering::SeqCst),
            bytes_written: c.bytes_written.load(Ordering::SeqCst),
            bytes_read: c.bytes_read.load(Ordering::SeqCst),
            max_put_bytes_in_flight: c.max_put_bytes_in_flight.load(Ordering::SeqCst),
        }
    }

    fn counted(&self, stream: ByteStream) -> ByteStream {
        let counts = self.counts.clone();
        stream
            .inspect(move |chunk| {
                if let Ok(b) = chunk {
                    counts
                        .bytes_read
                        .fetch_add(b.len() as u64, Ordering::SeqCst);
                }
            })
            .boxed()
    }
}

/// The bytes one counted put has read; off the in-flight total when the put is over.
struct InFlight {
    counts: Arc<Counters>,
    bytes: Arc<AtomicU64>,
}

impl Drop for InFlight {
    fn drop(&mut self) {
        let n = self.bytes.load(Ordering::SeqCst);
        self.counts
            .put_bytes_in_flight
            .fetch_sub(n, Ordering::SeqCst);
    }
}

#[async_trait]
#[deny(clippy::missing_trait_methods)]
impl SnapshotStore for CountingStore {
    fn name(&self) -> &'static str {
        self.inner.name()
    }

    fn reach(&self) -> Reach {
        self.inner.reach()
    }

    fn write_hints(&self) -> WriteHints {
        self.inner.write_hints()
    }

    async fn put(&self, key: &BlobKey, data: ByteStream, size: Option<u64>) -> Result<u64> {
        self.counts.puts.fetch_add(1, Ordering::SeqCst);
        // What this put has read, added to the puts' total as it is read and taken off when
        // the put returns (also when it fails or is dropped).
        let read = InFlight {
            counts: self.counts.clone(),
            bytes: Arc::new(AtomicU64::new(0)),
        };
        let (counts, bytes) = (self.counts.clone(), read.bytes.clone());
        let data = data
            .inspect(move |chunk| {
                if let Ok(b) = chunk {
                    let n = b.len() as u64;
                    bytes.fetch_add(n, Ordering::SeqCst);
                    let now = counts.put_bytes_in_flight.fetch_add(n, Ordering::SeqCst) + n;
                    counts
                        .max_put_bytes_in_flight
                        .fetch_max(now, Ordering::SeqCst);
                }
            })
            .boxed();
        let n = self.inner.put(key, data, size).await;
        drop(read);
        let n = n?;
        self.counts.bytes_written.fetch_add(n, Ordering::SeqCst);
        Ok(n)
    }

    async fn get(&self, key: &BlobKey) -> Result<ByteStream> {
        self.counts.gets.fetch_add(1, Ordering::SeqCst);
        Ok(self.counted(self.inner.get(key).await?))
    }

    async fn get_range(&self, key: &BlobKey, offset: u64, len: u64) -> Result<ByteStream> {
        self.counts.gets.fetch_add(1, Ordering::SeqCst);
        Ok(self.counted(self.inner.get_range(key, offset, len).await?))
    }

    async fn exists(&self, key: &BlobKey) -> Result<bool> {
        self.counts.exists.fetch_add(1, Ordering::SeqCst);
        self.inner.exists(key).await
    }

    async fn delete(&self, key: &BlobKey) -> Result<()> {
        self.counts.deletes.fetch_add(1, Ordering::SeqCst);
        self.inner.delete(key).await
    }

    fn list(&self, prefix: &str) -> BlobStream {
        self.counts.lists.fetch_add(1, Ordering::SeqCst);
        self.inner.list(prefix)
    }
    async fn sweep_leftovers(
        &self,
        sweep: crate::leftover::LeftoverSweep,
    ) -> Result<crate::leftover::LeftoverReport> {
        self.inner.sweep_leftovers(sweep).await
    }
}

/// What [`HookedStore`] runs at each `put`: it sees the key and the input, and returns the
/// input to pass on (as it is, or wrapped to act as bytes go through).
pub type PutHook = dyn Fn(&BlobKey, ByteStream) -> ByteStream + Send + Sync;

/// What [`HookedStore`] runs at each `get` and `get_range`: it sees the key.
pub type GetHook = dyn Fn(&BlobKey) + Send + Sync;

/// Forwards every call to a store; runs a hook at each `put` before passing it on (take a
/// server away, cut or watch the input) and one at each `get` and ranged `get` (count
/// reads), and keeps a value alive as long as the store (a clean-up guard whose `Drop`
/// purges what the tests wrote).
pub struct HookedStore {
    inner: Arc<dyn SnapshotStore>,
    on_put: Option<Box<PutHook>>,
    on_get: Option<Box<GetHook>>,
    hints: Option<WriteHints>,
    _keep: Option<Box<dyn std::any::Any + Send + Sync>>,
}

impl std::fmt::Debug for HookedStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HookedStore")
            .field("inner", &self.inner)
            .field("on_put", &self.on_put.is_some())
            .field("on_get", &self.on_get.is_some())
            .finish_non_exhaustive()
    }
}

impl HookedStore {
    /// Forward to `inner`, with no hook yet.
    pub fn new(inner: Arc<dyn SnapshotStore>) -> Self {
        HookedStore {
            inner,
            on_put: None,
            on_get: None,
            hints: None,
            _keep: None,
        }
    }

    /// Run `hook` at every `put` (it returns the input to pass on).
    pub fn on_put(
        mut self,
        hook: impl Fn(&BlobKey, ByteStream) -> ByteStream + Send + Sync + 'static,
    ) -> Self {
        self.on_put = Some(Box::new(hook));
        self
    }

    /// Run `hook` at every `get` and `get_range`, before passing it on.
    pub fn on_get(mut self, hook: impl Fn(&BlobKey) + Send + Sync + 'static) -> Self {
        self.on_get = Some(Box::new(hook));
        self
    }

    /// Report `hints` instead of the inner store's (for a hook that holds its input, say).
    pub fn hints(mut self, hints: WriteHints) -> Self {
        self.hints = Some(hints);
        self
    }

    /// Keep `value` until the store is dropped.
    pub fn keep(mut self, value: impl Send + Sync + 'static) -> Self {
        self._keep = Some(Box::new(value));
        self
    }
}

/// `inner` with puts that hold their input whole until it ends, then send it (after a short
/// pause, as a request would take, so the writer's next puts fill meanwhile): the way S3
/// sends a blob up to `single_put_max` in one `PUT`. Its [`WriteHints`] say it holds `holds`
/// bytes per put (true for blobs up to that size).
pub fn holds_whole_puts(inner: Arc<dyn SnapshotStore>, holds: u64) -> HookedStore {
    HookedStore::new(inner)
        .on_put(|_, data| {
            futures::stream::once(async move {
                let held = crate::stream::collect(data, usize::MAX).await?;
                tokio::time::sleep(std::time::Duration::from_millis(5)).await;
                Ok(held)
            })
            .boxed()
        })
        .hints(WriteHints::buffering(holds))
}

#[async_trait]
#[deny(clippy::missing_trait_methods)]
impl SnapshotStore for HookedStore {
    fn name(&self) -> &'static str {
        self.inner.name()
    }

    fn reach(&self) -> Reach {
        self.inner.reach()
    }

    fn write_hints(&self) -> WriteHints {
        self.hints.unwrap_or_else(|| self.inner.write_hints())
    }

    async fn put(&self, key: &BlobKey, data: ByteStream, size: Option<u64>) -> Result<u64> {
        let data = match &self.on_put {
            Some(hook) => hook(key, data),
            None => data,
        };
        self.inner.put(key, data, size).await
    }

    async fn get(&self, key: &BlobKey) -> Result<ByteStream> {
        if let Some(hook) = &self.on_get {
            hook(key);
        }
        self.inner.get(key).await
    }

    async fn get_range(&self, key: &BlobKey, offset: u64, len: u64) -> Result<ByteStream> {
        if let Some(hook) = &self.on_get {
            hook(key);
        }
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
    async fn sweep_leftovers(
        &self,
        sweep: crate::leftover::LeftoverSweep,
    ) -> Result<crate::leftover::LeftoverReport> {
        self.inner.sweep_leftovers(sweep).await
    }
}
