//! Where snapshot bytes live: the [`SnapshotStore`] blob-store contract, [`BlobKey`], and the
//! no-op and local-directory stores.

use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use async_trait::async_trait;
use futures::StreamExt;
use futures::stream::BoxStream;
use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};
use crate::leftover::{LeftoverReport, LeftoverSweep};
use crate::reach::Reach;
use crate::stream::{self, ByteStream};

/// What [`SnapshotStore::list`] yields: the blobs under a prefix, fetched a page at a time.
pub type BlobStream = BoxStream<'static, Result<BlobMeta>>;

/// The name of a blob in a [`SnapshotStore`].
///
/// Segments separated by `/`, each of `[A-Za-z0-9._-]`, not starting with `.`; at most 512
/// bytes. A key therefore can never name something outside the store's namespace, whatever
/// the store maps it to (a file path, an object key, a Redis key).
#[derive(Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub struct BlobKey(String);

impl BlobKey {
    /// Validate `key`.
    pub fn new(key: impl Into<String>) -> Result<Self> {
        let key = key.into();
        let ok = !key.is_empty()
            && key.len() <= 512
            && key.split('/').all(|seg| {
                !seg.is_empty()
                    && !seg.starts_with('.')
                    && seg
                        .bytes()
                        .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'))
            });
        if ok {
            Ok(BlobKey(key))
        } else {
            Err(Error::invalid(
                "blob key",
                format!(
                    "`{key}` must be `/`-separated segments of [A-Za-z0-9._-] not starting with `.`"
                ),
            ))
        }
    }

    /// The key as a string.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl TryFrom<String> for BlobKey {
    type Error = Error;
    fn try_from(value: String) -> Result<Self> {
        BlobKey::new(value)
    }
}

impl From<BlobKey> for String {
    fn from(value: BlobKey) -> Self {
        value.0
    }
}

impl fmt::Display for BlobKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl fmt::Debug for BlobKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "BlobKey({})", self.0)
    }
}

/// What a store knows about one blob.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct BlobMeta {
    /// The blob's key.
    pub key: BlobKey,
    /// Its size in bytes.
    pub size: u64,
    /// Last modification, as seconds since the epoch (for GC grace periods).
    pub modified_unix: Option<i64>,
}

impl BlobMeta {
    /// What a store reports about the blob `key` (for stores outside this crate: the struct is
    /// `#[non_exhaustive]`).
    pub fn new(key: BlobKey, size: u64, modified_unix: Option<i64>) -> Self {
        BlobMeta {
            key,
            size,
            modified_unix,
        }
    }
}

/// How a store's `put` holds its input in memory: what a writer keeping several puts running
/// at once (the chunked format's packs) needs to bound the memory they hold together.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub struct WriteHints {
    /// The most bytes of one `put`'s input the store holds in memory at once, beyond the few
    /// buffers of the stream it is reading: a store that sends a blob up to some size in one
    /// request holds such a blob whole until it is sent (S3: `single_put_max`), one that
    /// pipelines parts holds the parts in flight; a store that writes what it reads holds
    /// next to nothing (0, the default).
    pub buffered_per_put: u64,
}

impl WriteHints {
    /// A store that writes its input as it reads it.
    pub const STREAMING: WriteHints = WriteHints {
        buffered_per_put: 0,
    };

    /// A store whose `put` holds up to `bytes` of its input in memory.
    pub fn buffering(bytes: u64) -> Self {
        WriteHints {
            buffered_per_put: bytes,
        }
    }
}

/// A keyed blob store that snapshots (archives, manifests, chunks) are written to.
///
/// Contract: `put` is atomic (a reader sees the whole blob or nothing, never a prefix, also
/// when the input stream fails mid-way); `get` of a missing key is [`Error::NotFound`].
#[async_trait]
pub trait SnapshotStore: Send + Sync + fmt::Debug + 'static {
    /// Short name for logs and errors ("local", "redis", "s3").
    fn name(&self) -> &'static str;

    /// Who can read what is written: [`Reach::None`] for [`NoopSnapshotStore`] (callers skip
    /// snapshotting altogether), [`Reach::Host`] for a local directory, [`Reach::Cluster`]
    /// for a shared service.
    fn reach(&self) -> Reach;

    /// How `put` holds its input in memory (the chunked format sizes its uploads in flight by
    /// it: [`SnapshotSpec::upload_buffer`](super::SnapshotSpec::upload_buffer)). The default
    /// says the store streams; a store that buffers must say how much, and a wrapper must
    /// forward it.
    fn write_hints(&self) -> WriteHints {
        WriteHints::STREAMING
    }

    /// Store `data` under `key`, replacing any previous blob. `size` is the exact length when
    /// the caller knows it (a store may then send a small blob in one request instead of a
    /// multipart upload). Returns the bytes written.
    async fn put(&self, key: &BlobKey, data: ByteStream, size: Option<u64>) -> Result<u64>;

    /// Stream the blob under `key`.
    async fn get(&self, key: &BlobKey) -> Result<ByteStream>;

    /// Stream `len` bytes of the blob under `key` from `offset` (a ranged `GET`). A blob that
    /// ends before `offset + len` ends the stream early: callers check lengths and hashes.
    /// The default reads the blob from its start and skips; stores that can seek override it.
    async fn get_range(&self, key: &BlobKey, offset: u64, len: u64) -> Result<ByteStream> {
        let whole = self.get(key).await?;
        Ok(stream::slice(whole, offset, len))
    }

    /// Whether `key` exists.
    async fn exists(&self, key: &BlobKey) -> Result<bool>;

    /// Remove `key`; removing a missing key is not an error.
    async fn delete(&self, key: &BlobKey) -> Result<()>;

    /// The blobs whose key starts with `prefix`, in no particular order, fetched page by page
    /// as the stream is read (a store with millions of chunks is never listed into memory at
    /// once). A blob written or deleted while the stream runs may or may not appear.
    fn list(&self, prefix: &str) -> BlobStream;

    /// Remove what writers killed mid-`put` left behind that no key names (temporary files,
    /// unfinished uploads), older than `sweep.grace` and never one a `put` of this process is
    /// still writing; at most `sweep.max_removals` of them. Snapshot [`gc`](super::gc) runs it.
    ///
    /// The default is [`Error::NotSupported`]: a store that cannot know its leftovers says so
    /// (gc then reports none swept). A store whose unfinished writes cannot outlive a crash
    /// (they expire, or are never visible) returns an empty report; a wrapper must forward it.
    async fn sweep_leftovers(&self, sweep: LeftoverSweep) -> Result<LeftoverReport> {
        let _ = sweep;
        Err(Error::NotSupported {
            backend: self.name(),
            operation: "sweeping crash leftovers (sweep_leftovers)",
        })
    }
}

/// Conveniences over [`SnapshotStore`].
#[async_trait]
pub trait SnapshotStoreExt: SnapshotStore {
    /// Every blob under `prefix`, sorted by key.
    async fn list_all(&self, prefix: &str) -> Result<Vec<BlobMeta>> {
        let mut out: Vec<BlobMeta> = Vec::new();
        let mut listed = self.list(prefix);
        while let Some(meta) = listed.next().await {
            out.push(meta?);
        }
        out.sort_by(|a, b| a.key.cmp(&b.key));
        Ok(out)
    }

    /// Store a blob held in memory (one request where the store can).
    async fn put_bytes(&self, key: &BlobKey, data: bytes::Bytes) -> Result<u64> {
        let size = data.len() as u64;
        self.put(key, stream::once(data), Some(size)).await
    }
}

impl<S: SnapshotStore + ?Sized> SnapshotStoreExt for S {}

/// Keeps nothing: the default, matching the spec's `NoopSnapshotSpec`.
#[derive(Debug, Default, Clone, Copy)]
pub struct NoopSnapshotStore;

#[async_trait]
impl SnapshotStore for NoopSnapshotStore {
    fn name(&self) -> &'static str {
        "noop"
    }

    fn reach(&self) -> Reach {
        Reach::None
    }

    async fn put(&self, _key: &BlobKey, mut data: ByteStream, _size: Option<u64>) -> Result<u64> {
        let mut n = 0;
        while let Some(chunk) = data.next().await {
            n += chunk?.len() as u64;
        }
        Ok(n)
    }

    async fn get(&self, key: &BlobKey) -> Result<ByteStream> {
        Err(Error::NotFound {
            what: "snapshot blob (the no-op store keeps nothing)",
            key: key.to_string(),
        })
    }

    async fn exists(&self, _key: &BlobKey) -> Result<bool> {
        Ok(false)
    }

    async fn delete(&self, _key: &BlobKey) -> Result<()> {
        Ok(())
    }

    fn list(&self, _prefix: &str) -> BlobStream {
        futures::stream::empty().boxed()
    }

    async fn sweep_leftovers(&self, _sweep: LeftoverSweep) -> Result<LeftoverReport> {
        Ok(LeftoverReport::default()) // it writes nothing
    }
}

/// Blobs as files under a directory: written to a temporary name, fsynced, then renamed into
/// place (and the directory fsynced), so a crash or a failed stream never leaves a partial blob
/// under a real key.
#[derive(Debug, Clone)]
pub struct LocalDirSnapshotStore {
    dir: Arc<PathBuf>,
    reach: Reach,
}

static TMP_SEQ: AtomicU64 = AtomicU64::new(0);

/// How many bytes a local `put` writes between asking the kernel to start writing back.
const WRITEBACK_EVERY: u64 = 4 << 20;

/// Ask the kernel to start writing `len` bytes of `file` from `offset` to disk now, without
/// waiting. On Linux `POSIX_FADV_DONTNEED` starts write-back of the range's dirty pages (and
/// drops only pages already clean); it is a hint, so its failure is ignored: the fsync that
/// follows is what makes the data durable.
fn start_writeback(file: &std::fs::File, offset: u64, len: u64) {
    let _ = rustix::fs::fadvise(
        file,
        offset,
        std::num::NonZeroU64::new(len),
        rustix::fs::Advice::DontNeed,
    );
}

/// Prefix of a local put's temporary file: `.tmp-<pid>-<seq>-<name>` beside its blob.
const TMP_PREFIX: &str = ".tmp-";

/// The temporary files puts of this process are writing (full paths): never swept, whatever
/// their age (a put whose input stalls keeps an old mtime).
static IN_FLIGHT: std::sync::Mutex<std::collections::BTreeSet<PathBuf>> =
    std::sync::Mutex::new(std::collections::BTreeSet::new());

fn in_flight() -> std::sync::MutexGuard<'static, std::collections::BTreeSet<PathBuf>> {
    IN_FLIGHT.lock().unwrap_or_else(|e| e.into_inner())
}

/// A temporary file, registered as in flight from before it exists until it is gone: removed
/// when dropped, unless disarmed (`armed = false`) after its rename.
struct TmpGuard {
    path: PathBuf,
    armed: bool,
}

impl TmpGuard {
    fn new(path: PathBuf) -> Self {
        in_flight().insert(path.clone());
        TmpGuard { path, armed: true }
    }
}

impl Drop for TmpGuard {
    fn drop(&mut self) {
        if self.armed {
            let _ = std::fs::remove_file(&self.path);
        }
        in_flight().remove(&self.path);
    }
}

impl LocalDirSnapshotStore {
    /// A store rooted at `dir` (created on first write).
    pub fn new(dir: impl Into<PathBuf>) -> Self {
        LocalDirSnapshotStore {
            dir: Arc::new(dir.into()),
            reach: Reach::Host,
        }
    }

    /// A store at `dir` on a filesystem that every host of the deployment mounts (NFS, EFS,
    /// a cluster filesystem): its [`Reach`] is [`Reach::Cluster`], so it passes
    /// `require_distributed`. The filesystem must give `rename` its POSIX atomicity.
    pub fn shared_by_all_hosts(dir: impl Into<PathBuf>) -> Self {
        LocalDirSnapshotStore {
            reach: Reach::Cluster,
            ..LocalDirSnapshotStore::new(dir)
        }
    }

    /// The root directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    fn path_of(&self, key: &BlobKey) -> PathBuf {
        self.dir.join(key.as_str())
    }
}

#[async_trait]
impl SnapshotStore for LocalDirSnapshotStore {
    fn name(&self) -> &'static str {
        "local"
    }

    fn reach(&self) -> Reach {
        self.reach
    }

    async fn put(&self, key: &BlobKey, mut data: ByteStream, _size: Option<u64>) -> Result<u64> {
        let path = self.path_of(key);
        let parent = path.parent().expect("keys are non-empty").to_owned();
        let tmp = parent.join(format!(
            "{TMP_PREFIX}{}-{}-{}",
            std::process::id(),
            TMP_SEQ.fetch_add(1, Ordering::Relaxed),
            path.file_name().and_then(|n| n.to_str()).unwrap_or("blob")
        ));
        // Removes the temporary file on every way out but success, a dropped put included.
        let mut guard = TmpGuard::new(tmp.clone());
        // The file is written by a blocking task fed the stream's buffers as they are (no copy
        // into an async file's buffer, no task per write), so the disk works while the stream
        // produces; every `WRITEBACK_EVERY` bytes it asks the kernel to start writing back
        // what it has so far, so the final fsync has little left to wait for.
        let (tx, mut rx) = tokio::sync::mpsc::channel::<bytes::Bytes>(8);
        // Created here, not in the writer, so a put dropped at any point leaves no file the
        // guard has already missed.
        // The directory is created only when missing (a new namespace, a new pack prefix):
        // each directory created has its parent fsynced, so the blob's path survives a crash
        // (the fsync of `parent` below covers only the blob's own entry).
        let (create_at, dir) = (tmp.clone(), parent.clone());
        let mut file = tokio::task::spawn_blocking(move || {
            crate::durable::in_dir(&dir, true, || std::fs::File::create(&create_at))
        })
        .await
        .map_err(|e| Error::backend("local", "blob write", e.to_string()))?
        .map_err(|e| Error::io(&tmp, e))?;
        let file_path = tmp.clone();
        let writer = tokio::task::spawn_blocking(move || -> Result<(std::fs::File, u64)> {
            use std::io::Write as _;
            let io = |e| Error::io(&file_path, e);
            let (mut n, mut started) = (0u64, 0u64);
            while let Some(chunk) = rx.blocking_recv() {
                file.write_all(&chunk).map_err(io)?;
                n += chunk.len() as u64;
                if n - started >= WRITEBACK_EVERY {
                    start_writeback(&file, started, n - started);
                    started = n;
                }
            }
            Ok((file, n))
        });
        let mut failed = None;
        while let Some(chunk) = data.next().await {
            match chunk {
                // A closed channel: the writer failed; its error is awaited below.
                Ok(chunk) => {
                    if tx.send(chunk).await.is_err() {
                        break;
                    }
                }
                Err(e) => {
                    failed = Some(e);
                    break;
                }
            }
        }
        drop(tx);
        let written = writer
            .await
            .map_err(|e| Error::backend("local", "blob write", e.to_string()))?;
        if let Some(e) = failed {
            return Err(e);
        }
        let (file, n) = written?;
        tokio::task::spawn_blocking(move || -> Result<()> {
            file.sync_all().map_err(|e| Error::io(&tmp, e))?;
            drop(file);
            std::fs::rename(&tmp, &path).map_err(|e| Error::io(&path, e))?;
            // Make the rename itself durable.
            if let Ok(d) = std::fs::File::open(&parent) {
                let _ = d.sync_all();
            }
            Ok(())
        })
        .await
        .map_err(|e| Error::backend("local", "blob write", e.to_string()))??;
        guard.armed = false;
        Ok(n)
    }

    async fn get(&self, key: &BlobKey) -> Result<ByteStream> {
        let path = self.path_of(key);
        match tokio::fs::File::open(&path).await {
            Ok(file) => Ok(stream::from_reader(file)),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Err(Error::NotFound {
                what: "snapshot blob",
                key: key.to_string(),
            }),
            Err(e) => Err(Error::io(path, e)),
        }
    }

    async fn get_range(&self, key: &BlobKey, offset: u64, len: u64) -> Result<ByteStream> {
        use tokio::io::{AsyncReadExt as _, AsyncSeekExt as _};
        let path = self.path_of(key);
        let mut file = match tokio::fs::File::open(&path).await {
            Ok(file) => file,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                return Err(Error::NotFound {
                    what: "snapshot blob",
                    key: key.to_string(),
                });
            }
            Err(e) => return Err(Error::io(path, e)),
        };
        file.seek(std::io::SeekFrom::Start(offset))
            .await
            .map_err(|e| Error::io(&path, e))?;
        Ok(stream::from_reader(file.take(len)))
    }

    async fn exists(&self, key: &BlobKey) -> Result<bool> {
        let path = self.path_of(key);
        match tokio::fs::metadata(&path).await {
            Ok(m) => Ok(m.is_file()),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(false),
            Err(e) => Err(Error::io(path, e)),
        }
    }

    async fn delete(&self, key: &BlobKey) -> Result<()> {
        let path = self.path_of(key);
        match tokio::fs::remove_file(&path).await {
            Ok(()) => Ok(()),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
            Err(e) => Err(Error::io(path, e)),
        }
    }

    fn list(&self, prefix: &str) -> BlobStream {
        // A walker thread sends pages through a short queue: memory stays bounded by the page
        // size whatever the store holds, and a dropped stream stops the walk.
        let (tx, rx) = tokio::sync::mpsc::channel::<Result<Vec<BlobMeta>>>(2);
        let (dir, prefix) = (self.dir.clone(), prefix.to_owned());
        tokio::task::spawn_blocking(move || {
            let mut page = Vec::with_capacity(LIST_PAGE);
            let walked = walk_blobs(&dir, &prefix, &mut |meta| {
                page.push(meta);
                if page.len() == LIST_PAGE {
                    let full = std::mem::replace(&mut page, Vec::with_capacity(LIST_PAGE));
                    return tx.blocking_send(Ok(full)).is_ok();
                }
                true
            });
            let last = walked.map(|()| page);
            let _ = tx.blocking_send(last);
        });
        tokio_stream_of_pages(rx)
    }

    /// Temporary files (`.tmp-*`, anywhere under the directory) older than the grace period
    /// that no put of this process is writing: what puts killed mid-way left.
    async fn sweep_leftovers(&self, sweep: LeftoverSweep) -> Result<LeftoverReport> {
        let dir = self.dir.clone();
        tokio::task::spawn_blocking(move || sweep_temporaries(&dir, sweep))
            .await
            .map_err(|e| Error::backend("local", "sweep leftovers", e.to_string()))?
    }
}

/// Walk `root` (never following a symlink) and remove the temporaries `sweep` allows.
fn sweep_temporaries(root: &Path, sweep: LeftoverSweep) -> Result<LeftoverReport> {
    let mut report = LeftoverReport::default();
    let mut stack = vec![root.to_path_buf()];
    while let Some(dir) = stack.pop() {
        let entries = match std::fs::read_dir(&dir) {
            Ok(e) => e,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
            Err(e) => return Err(Error::io(&dir, e)),
        };
        for entry in entries {
            let entry = entry.map_err(|e| Error::io(&dir, e))?;
            let path = entry.path();
            let meta = match std::fs::symlink_metadata(&path) {
                Ok(m) => m,
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
                Err(e) => return Err(Error::io(&path, e)),
            };
            let temporary = entry
                .file_name()
                .to_str()
                .is_some_and(|n| n.starts_with(TMP_PREFIX));
            if meta.is_dir() {
                if !temporary {
                    stack.push(path);
                }
                continue;
            }
            if !temporary {
                continue;
            }
            if in_flight().contains(&path) {
                report.in_use += 1;
            } else if !sweep.is_past_grace(meta.modified().ok()) {
                report.in_grace += 1;
            } else if report.removed >= sweep.max_removals {
                report.deferred += 1;
            } else if sweep.dry_run {
                report.removed += 1;
                report.bytes_freed += meta.len();
            } else {
                match std::fs::remove_file(&path) {
                    Ok(()) => {
                        report.removed += 1;
                        report.bytes_freed += meta.len();
                    }
                    Err(e) if e.kind() == std::io::ErrorKind::NotFound => {} // finished meanwhile
                    Err(e) => {
                        tracing::warn!(path = %path.display(), error = %e, "cannot remove a leftover temporary file");
                        report.failed += 1;
                    }
                }
            }
        }
    }
    Ok(report)
}

/// Blobs per page of a local listing.
const LIST_PAGE: usize = 1000;

fn tokio_stream_of_pages(rx: tokio::sync::mpsc::Receiver<Result<Vec<BlobMeta>>>) -> BlobStream {
    futures::stream::unfold(rx, |mut rx| async move {
        rx.recv().await.map(|page| (page, rx))
    })
    .flat_map(|page| match page {
        Ok(items) => futures::stream::iter(items.into_iter().map(Ok)).left_stream(),
        Err(e) => futures::stream::iter([Err(e)]).right_stream(),
    })
    .boxed()
}

/// Visit every blob under `prefix`; `visit` returns `false` to stop.
fn walk_blobs(root: &Path, prefix: &str, visit: &mut dyn FnMut(BlobMeta) -> bool) -> Result<()> {
    // Only descend into the directory the prefix names (prefix scan, not a full scan).
    let start = match prefix.rfind('/') {
        Some(i) => root.join(&prefix[..i]),
        None => root.to_path_buf(),
    };
    let mut stack = vec![start];
    while let Some(dir) = stack.pop() {
        let entries = match std::fs::read_dir(&dir) {
            Ok(e) => e,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
            Err(e) => return Err(Error::io(&dir, e)),
        };
        for entry in entries {
            let entry = entry.map_err(|e| Error::io(&dir, e))?;
            let name = entry.file_name();
            if name.to_string_lossy().starts_with('.') {
                continue; // temporaries
            }
            let meta = match entry.metadata() {
                Ok(m) => m,
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue, // deleted meanwhile
                Err(e) => return Err(Error::io(entry.path(), e)),
            };
            if meta.is_dir() {
                stack.push(entry.path());
                continue;
            }
            let rel = entry
                .path()
                .strip_prefix(root)
                .expect("walked under root")
                .to_string_lossy()
                .into_owned();
            if !rel.starts_with(prefix) {
                continue;
            }
            if let Ok(key) = BlobKey::new(rel) {
                let modified_unix = meta
                    .modified()
                    .ok()
                    .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok())
                    .map(|d| d.as_secs() as i64);
                let more = visit(BlobMeta {
                    key,
                    size: meta.len(),
                    modified_unix,
                });
                if !more {
                    return Ok(());
                }
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod suite {
    use std::sync::Arc;

    use super::{LIST_PAGE, LocalDirSnapshotStore, SnapshotStore};

    async fn local() -> (Arc<dyn SnapshotStore>, tempfile::TempDir) {
        let dir = tempfile::tempdir().expect("tempdir");
        (
            Arc::new(LocalDirSnapshotStore::new(dir.path().join("store"))),
            dir,
        )
    }

    crate::blob_store_tests!(local(), listing_blobs = LIST_PAGE * 2 + 7);

    /// The trait's default `get_range` (a store that cannot seek), through a wrapper that
    /// forwards everything else.
    mod default_range {
        use std::sync::Arc;

        use crate::snapshot::SnapshotStore;
        use crate::testkit::FailingStore;

        async fn wrapped() -> (Arc<dyn SnapshotStore>, tempfile::TempDir) {
            let (inner, dir) = super::local().await;
            (FailingStore::new(inner).store(), dir)
        }

        crate::blob_store_tests!(wrapped(), listing_blobs = 10);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn blob_keys() {
        assert!(BlobKey::new("snapshots/0190-abc.tar").is_ok());
        for bad in [
            "", "/abs", "a/../b", "../x", "a//b", ".hidden", "a/.tmp", "sp ace", "a\\b",
        ] {
            assert!(BlobKey::new(bad).is_err(), "{bad:?}");
        }
    }

    #[tokio::test]
    async fn local_put_get_list_delete() {
        let dir = tempfile::tempdir().unwrap();
        let store = LocalDirSnapshotStore::new(dir.path());
        let key = BlobKey::new("snapshots/a.tar").unwrap();
        assert_eq!(store.put_bytes(&key, "hello".into()).await.unwrap(), 5);
        assert!(store.exists(&key).await.unwrap());
        let got = stream::collect(store.get(&key).await.unwrap(), 100)
            .await
            .unwrap();
        assert_eq!(&got[..], b"hello");
        assert_eq!(store.list_all("snapshots/").await.unwrap().len(), 1);
        assert_eq!(store.list_all("other/").await.unwrap().len(), 0);
        store.delete(&key).await.unwrap();
        assert!(matches!(
            store.get(&key).await.err(),
            Some(Error::NotFound { .. })
        ));
    }

    #[tokio::test]
    async fn failed_stream_leaves_no_blob_and_keeps_old_one() {
        let dir = tempfile::tempdir().unwrap();
        let store = LocalDirSnapshotStore::new(dir.path());
        let key = BlobKey::new("k").unwrap();
        store.put_bytes(&key, "old".into()).await.unwrap();
        let failing: ByteStream = Box::pin(futures::stream::iter(vec![
            Ok(bytes::Bytes::from_static(b"new-partial")),
            Err(Error::Timeout {
                operation: "export".into(),
                after: std::time::Duration::from_secs(1),
            }),
        ]));
        assert!(store.put(&key, failing, None).await.is_err());
        let got = stream::collect(store.get(&key).await.unwrap(), 100)
            .await
            .unwrap();
        assert_eq!(&got[..], b"old");
        let names: Vec<_> = std::fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(names.len(), 1, "temporary left behind: {names:?}");
    }

    #[tokio::test]
    async fn dropped_put_leaves_no_temporary() {
        let dir = tempfile::tempdir().unwrap();
        let store = LocalDirSnapshotStore::new(dir.path());
        let key = BlobKey::new("k").unwrap();
        // 9 MiB (past two write-back requests), then the input stalls.
        let stalling: ByteStream = Box::pin(
            futures::stream::iter((0..9).map(|_| Ok(bytes::Bytes::from(vec![7u8; 1024 * 1024]))))
                .chain(futures::stream::pending()),
        );
        let put = store.put(&key, stalling, None);
        assert!(
            tokio::time::timeout(std::time::Duration::from_millis(500), put)
                .await
                .is_err(),
            "a stalled put cannot finish"
        );
        let names: Vec<_> = std::fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert!(names.is_empty(), "left behind: {names:?}");
        assert!(!store.exists(&key).await.unwrap());
    }

    /// A write that fails in the blocking writer — the disk is full: the temporary is made to
    /// be `/dev/full`, where every write fails with `ENOSPC` — is a typed I/O error; the
    /// temporary is removed and the blob the put would have replaced is still whole.
    #[tokio::test]
    async fn failing_write_leaves_no_temporary_and_keeps_old_blob() {
        const NAME: &str = "disk-full-victim";
        let dir = tempfile::tempdir().unwrap();
        let store = LocalDirSnapshotStore::new(dir.path());
        let key = BlobKey::new(NAME).unwrap();
        store.put_bytes(&key, "old".into()).await.unwrap();
        // A temporary is `.tmp-<pid>-<seq>-<name>`, `seq` from a counter that tests running
        // beside this one advance too: every name the put may take in a window is a link to
        // /dev/full, and a put that drew past the window is tried again.
        for _ in 0..10 {
            let first = TMP_SEQ.load(Ordering::SeqCst);
            let links: Vec<PathBuf> = (first..first + 64)
                .map(|seq| {
                    dir.path()
                        .join(format!(".tmp-{}-{seq}-{NAME}", std::process::id()))
                })
                .collect();
            for link in &links {
                std::os::unix::fs::symlink("/dev/full", link).unwrap();
            }
            let data: ByteStream = Box::pin(futures::stream::iter(
                (0..4).map(|_| Ok(bytes::Bytes::from(vec![7u8; 256 * 1024]))),
            ));
            let result = store.put(&key, data, None).await;
            let kept: Vec<&PathBuf> = links
                .iter()
                .filter(|l| l.symlink_metadata().is_ok())
                .collect();
            for link in &kept {
                std::fs::remove_file(link).unwrap();
            }
            let err = match result {
                Ok(_) => {
                    assert_eq!(kept.len(), links.len(), "a put through /dev/full succeeded");
                    store.put_bytes(&key, "old".into()).await.unwrap();
                    continue;
                }
                Err(e) => e,
            };
            match &err {
                Error::Io { source, .. } => {
                    assert_eq!(source.kind(), std::io::ErrorKind::StorageFull, "{err}")
                }
                other => panic!("not an I/O error: {other}"),
            }
            assert_eq!(
                kept.len(),
                links.len() - 1,
                "the temporary the put wrote to is removed"
            );
            let names: Vec<_> = std::fs::read_dir(dir.path())
                .unwrap()
                .map(|e| e.unwrap().file_name())
                .collect();
            assert_eq!(names, [NAME], "nothing else is left");
            let got = stream::collect(store.get(&key).await.unwrap(), 100)
                .await
                .unwrap();
            assert_eq!(&got[..], b"old");
            return;
        }
        panic!("the put never drew a name in the window");
    }

    /// Age a file by `secs` (its mtime is what the sweep's grace reads).
    fn age(path: &Path, secs: u64) {
        let file = std::fs::OpenOptions::new().write(true).open(path).unwrap();
        file.set_modified(std::time::SystemTime::now() - std::time::Duration::from_secs(secs))
            .unwrap();
    }

    /// Temporaries of killed puts (anywhere under the store) past the grace period are
    /// removed, young ones and blobs are kept, and so is the temporary of a put this process
    /// is still writing however old it looks; the bound defers the rest.
    #[tokio::test]
    async fn sweep_removes_old_temporaries_only() {
        let dir = tempfile::tempdir().unwrap();
        let store = Arc::new(LocalDirSnapshotStore::new(dir.path()));
        let blob = BlobKey::new("packs/ab/p1.pack").unwrap();
        store.put_bytes(&blob, "pack".into()).await.unwrap();
        let packs = dir.path().join("packs/ab");
        let old: Vec<PathBuf> = (0..3)
            .map(|i| packs.join(format!(".tmp-999999-{i}-p{i}.pack")))
            .collect();
        for p in &old {
            std::fs::write(p, "partial").unwrap();
            age(p, 7200);
        }
        let young = dir.path().join(".tmp-999999-9-manifest");
        std::fs::write(&young, "partial").unwrap();
        // A put in flight whose input stalls, its temporary made to look old.
        let stalled_key = BlobKey::new("packs/cd/p2.pack").unwrap();
        let stalling: ByteStream = Box::pin(
            futures::stream::iter([Ok(bytes::Bytes::from_static(b"first"))])
                .chain(futures::stream::pending()),
        );
        let put = {
            let store = store.clone();
            tokio::spawn(async move { store.put(&stalled_key, stalling, None).await })
        };
        let stalled = loop {
            let found = std::fs::read_dir(dir.path().join("packs/cd"))
                .ok()
                .and_then(|mut d| d.next())
                .map(|e| e.unwrap().path());
            if let Some(p) = found {
                break p;
            }
            tokio::time::sleep(std::time::Duration::from_millis(5)).await;
        };
        age(&stalled, 7200);
        let sweep = LeftoverSweep::default().grace(std::time::Duration::from_secs(3600));

        let dry = store.sweep_leftovers(sweep.dry_run(true)).await.unwrap();
        assert_eq!(
            (dry.removed, dry.in_grace, dry.in_use),
            (3, 1, 1),
            "{dry:?}"
        );
        assert!(old.iter().all(|p| p.exists()), "a dry run removes nothing");

        let bounded = store.sweep_leftovers(sweep.max_removals(2)).await.unwrap();
        assert_eq!((bounded.removed, bounded.deferred), (2, 1), "{bounded:?}");
        assert_eq!(bounded.bytes_freed, 2 * "partial".len() as u64);
        let rest = store.sweep_leftovers(sweep).await.unwrap();
        assert_eq!(
            (rest.removed, rest.deferred, rest.in_use),
            (1, 0, 1),
            "{rest:?}"
        );
        assert!(old.iter().all(|p| !p.exists()));
        assert!(
            young.exists(),
            "a young temporary may be another process's put"
        );
        assert!(
            stalled.exists(),
            "the temporary of a running put is never swept"
        );
        assert!(store.exists(&blob).await.unwrap());
        put.abort();
        let _ = put.await;
        assert!(!stalled.exists(), "the dropped put removed its own");
    }

    #[tokio::test]
    async fn listing_is_paged_and_complete() {
        let dir = tempfile::tempdir().unwrap();
        let store = LocalDirSnapshotStore::new(dir.path());
        let n = LIST_PAGE * 2 + 7;
        for i in 0..n {
            let key = BlobKey::new(format!("chunks/{:02x}/c{i}", i % 256)).unwrap();
            store.put_bytes(&key, "x".into()).await.unwrap();
        }
        let listed = store.list_all("chunks/").await.unwrap();
        assert_eq!(listed.len(), n);
        // A consumer that stops early stops the walk.
        let first: Vec<_> = store.list("chunks/").take(3).collect().await;
        assert_eq!(first.len(), 3);
    }
}
