//! Where snapshot bytes live: the [`SnapshotStore`] blob-store contract, [`BlobKey`], and the
//! no-op and local-directory stores.

use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use async_trait::async_trait;
use futures::StreamExt;
use serde::{Deserialize, Serialize};
use tokio::io::AsyncWriteExt;

use crate::error::{Error, Result};
use crate::stream::{self, ByteStream};

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

/// A keyed blob store that snapshots (archives, manifests, chunks) are written to.
///
/// Contract: `put` is atomic (a reader sees the whole blob or nothing, never a prefix, also
/// when the input stream fails mid-way); `get` of a missing key is [`Error::NotFound`].
#[async_trait]
pub trait SnapshotStore: Send + Sync + fmt::Debug + 'static {
    /// Short name for logs and errors ("local", "redis", "s3").
    fn name(&self) -> &'static str;

    /// Whether anything written is kept. `false` for [`NoopSnapshotStore`]: callers skip
    /// snapshotting altogether.
    fn persists(&self) -> bool {
        true
    }

    /// Store `data` under `key`, replacing any previous blob. Returns the bytes written.
    async fn put(&self, key: &BlobKey, data: ByteStream) -> Result<u64>;

    /// Stream the blob under `key`.
    async fn get(&self, key: &BlobKey) -> Result<ByteStream>;

    /// Whether `key` exists.
    async fn exists(&self, key: &BlobKey) -> Result<bool>;

    /// Remove `key`; removing a missing key is not an error.
    async fn delete(&self, key: &BlobKey) -> Result<()>;

    /// All blobs whose key starts with `prefix`.
    async fn list(&self, prefix: &str) -> Result<Vec<BlobMeta>>;
}

/// Keeps nothing: the default, matching the spec's `NoopSnapshotSpec`.
#[derive(Debug, Default, Clone, Copy)]
pub struct NoopSnapshotStore;

#[async_trait]
impl SnapshotStore for NoopSnapshotStore {
    fn name(&self) -> &'static str {
        "noop"
    }

    fn persists(&self) -> bool {
        false
    }

    async fn put(&self, _key: &BlobKey, mut data: ByteStream) -> Result<u64> {
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

    async fn list(&self, _prefix: &str) -> Result<Vec<BlobMeta>> {
        Ok(Vec::new())
    }
}

/// Blobs as files under a directory: written to a temporary name, fsynced, then renamed into
/// place (and the directory fsynced), so a crash or a failed stream never leaves a partial blob
/// under a real key.
#[derive(Debug, Clone)]
pub struct LocalDirSnapshotStore {
    dir: Arc<PathBuf>,
}

static TMP_SEQ: AtomicU64 = AtomicU64::new(0);

impl LocalDirSnapshotStore {
    /// A store rooted at `dir` (created on first write).
    pub fn new(dir: impl Into<PathBuf>) -> Self {
        LocalDirSnapshotStore {
            dir: Arc::new(dir.into()),
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

    async fn put(&self, key: &BlobKey, mut data: ByteStream) -> Result<u64> {
        let path = self.path_of(key);
        let parent = path.parent().expect("keys are non-empty").to_owned();
        tokio::fs::create_dir_all(&parent)
            .await
            .map_err(|e| Error::io(&parent, e))?;
        let tmp = parent.join(format!(
            ".tmp-{}-{}-{}",
            std::process::id(),
            TMP_SEQ.fetch_add(1, Ordering::Relaxed),
            path.file_name().and_then(|n| n.to_str()).unwrap_or("blob")
        ));
        let result: Result<u64> = async {
            let mut file = tokio::fs::File::create(&tmp)
                .await
                .map_err(|e| Error::io(&tmp, e))?;
            let mut n = 0u64;
            while let Some(chunk) = data.next().await {
                let chunk = chunk?;
                file.write_all(&chunk)
                    .await
                    .map_err(|e| Error::io(&tmp, e))?;
                n += chunk.len() as u64;
            }
            file.sync_all().await.map_err(|e| Error::io(&tmp, e))?;
            drop(file);
            tokio::fs::rename(&tmp, &path)
                .await
                .map_err(|e| Error::io(&path, e))?;
            // Make the rename itself durable.
            if let Ok(d) = tokio::fs::File::open(&parent).await {
                let _ = d.sync_all().await;
            }
            Ok(n)
        }
        .await;
        if result.is_err() {
            let _ = tokio::fs::remove_file(&tmp).await;
        }
        result
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

    async fn list(&self, prefix: &str) -> Result<Vec<BlobMeta>> {
        let dir = self.dir.clone();
        let prefix = prefix.to_owned();
        tokio::task::spawn_blocking(move || list_dir(&dir, &prefix))
            .await
            .map_err(|e| Error::backend("local", "list blobs", e.to_string()))?
    }
}

fn list_dir(root: &Path, prefix: &str) -> Result<Vec<BlobMeta>> {
    let mut out = Vec::new();
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
            let meta = entry.metadata().map_err(|e| Error::io(entry.path(), e))?;
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
                out.push(BlobMeta {
                    key,
                    size: meta.len(),
                    modified_unix,
                });
            }
        }
    }
    out.sort_by(|a, b| a.key.cmp(&b.key));
    Ok(out)
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
        assert_eq!(store.put(&key, stream::once("hello")).await.unwrap(), 5);
        assert!(store.exists(&key).await.unwrap());
        let got = stream::collect(store.get(&key).await.unwrap(), 100)
            .await
            .unwrap();
        assert_eq!(&got[..], b"hello");
        assert_eq!(store.list("snapshots/").await.unwrap().len(), 1);
        assert_eq!(store.list("other/").await.unwrap().len(), 0);
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
        store.put(&key, stream::once("old")).await.unwrap();
        let failing: ByteStream = Box::pin(futures::stream::iter(vec![
            Ok(bytes::Bytes::from_static(b"new-partial")),
            Err(Error::Timeout {
                operation: "export".into(),
                after: std::time::Duration::from_secs(1),
            }),
        ]));
        assert!(store.put(&key, failing).await.is_err());
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
}
