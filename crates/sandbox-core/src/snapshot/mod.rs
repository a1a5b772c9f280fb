//! Snapshots: what a box's workspace is archived to at `stop` and restored from at `start`.
//!
//! A snapshot is written through the box's `export` primitive straight into a
//! [`SnapshotStore`] blob, hashed on the way; restoring streams the blob back through a digest
//! check and the archive validator into the box's `import` primitive in `Replace` mode, so a
//! corrupt, truncated or hostile snapshot fails with [`Error::RestoreIncomplete`] before the
//! live workspace is touched.

mod store;

use std::sync::{Arc, Mutex};
use std::task::Poll;

use futures::StreamExt;
use serde::{Deserialize, Serialize};
use sha2::Digest as _;

pub use store::{BlobKey, BlobMeta, LocalDirSnapshotStore, NoopSnapshotStore, SnapshotStore};

use crate::archive::{self, ArchivePolicy};
use crate::backend::{BoxHandle, ExportRequest, ImportMode};
use crate::error::{Error, Result};
use crate::path::RelPath;
use crate::stream::ByteStream;

/// The archive format of a snapshot.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
#[non_exhaustive]
pub enum SnapshotFormat {
    /// One tar archive per snapshot: what the spec describes, and what a human can open
    /// with `tar -tf`.
    #[default]
    Tar,
}

/// A pointer to one stored snapshot, kept in the box's state.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[non_exhaustive]
pub struct SnapshotRef {
    /// Snapshot id (a UUIDv7: sortable by creation time).
    pub id: String,
    /// Archive format.
    pub format: SnapshotFormat,
    /// Where the archive lives in the store.
    pub key: BlobKey,
    /// Archive size in bytes.
    pub size: u64,
    /// SHA-256 of the archive (hex); checked on restore.
    pub sha256: String,
    /// Creation time, milliseconds since the epoch.
    pub created_unix_ms: i64,
    /// The projection hash of the workspace this snapshot captured.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub projection_hash: Option<String>,
}

/// How snapshots are taken and where they go. The default keeps nothing.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct SnapshotSpec {
    /// Where snapshot blobs go.
    pub store: Arc<dyn SnapshotStore>,
    /// Archive format.
    pub format: SnapshotFormat,
    /// Rules for reading archives back.
    pub policy: ArchivePolicy,
}

impl Default for SnapshotSpec {
    fn default() -> Self {
        SnapshotSpec::new(Arc::new(NoopSnapshotStore))
    }
}

impl SnapshotSpec {
    /// Snapshots in `store`, tar format, default policy.
    pub fn new(store: Arc<dyn SnapshotStore>) -> Self {
        SnapshotSpec {
            store,
            format: SnapshotFormat::Tar,
            policy: ArchivePolicy::default(),
        }
    }

    /// Snapshots as files under `dir`.
    pub fn local_dir(dir: impl Into<std::path::PathBuf>) -> Self {
        SnapshotSpec::new(Arc::new(LocalDirSnapshotStore::new(dir)))
    }

    /// Set the archive policy (e.g. strict symlinks).
    pub fn policy(mut self, policy: ArchivePolicy) -> Self {
        self.policy = policy;
        self
    }

    /// Whether snapshots are kept at all.
    pub fn enabled(&self) -> bool {
        self.store.persists()
    }
}

/// Archive the workspace of `handle` (minus `exclude` and `exclude_globs`) into the store.
pub async fn take(
    handle: &dyn BoxHandle,
    spec: &SnapshotSpec,
    exclude: Vec<RelPath>,
    exclude_globs: Vec<String>,
    projection_hash: Option<String>,
) -> Result<SnapshotRef> {
    let id = uuid::Uuid::now_v7().to_string();
    let key = BlobKey::new(format!("snapshots/{id}.tar"))?;
    let request = ExportRequest {
        paths: None,
        exclude,
        exclude_globs,
    };
    let archive = handle.export(&request).await?;
    let digest = Arc::new(Mutex::new((sha2::Sha256::new(), 0u64)));
    let size = spec
        .store
        .put(&key, hashing(archive, digest.clone()))
        .await?;
    let (hasher, hashed) = std::mem::take(&mut *digest.lock().expect("digest lock"));
    debug_assert_eq!(size, hashed);
    Ok(SnapshotRef {
        id,
        format: SnapshotFormat::Tar,
        key,
        size,
        sha256: hex::encode(hasher.finalize()),
        created_unix_ms: unix_ms(),
        projection_hash,
    })
}

/// Replace the workspace of `handle` with `snapshot`, keeping the live paths in `keep`.
///
/// Any failure (missing blob, digest mismatch, truncation, unsafe entry, backend error) is
/// [`Error::RestoreIncomplete`] and leaves the live workspace as it was.
pub async fn restore(
    handle: &dyn BoxHandle,
    spec: &SnapshotSpec,
    snapshot: &SnapshotRef,
    keep: Vec<RelPath>,
) -> Result<()> {
    let incomplete = |reason: &str, source: Error| Error::RestoreIncomplete {
        snapshot: snapshot.id.clone(),
        reason: format!("{reason}: {source}"),
        source: Some(Box::new(source)),
    };
    let blob = spec
        .store
        .get(&snapshot.key)
        .await
        .map_err(|e| incomplete("cannot read the archive", e))?;
    let verified = verify(blob, snapshot.sha256.clone(), snapshot.size);
    let clean = archive::sanitize(verified, spec.policy);
    handle
        .import(clean, ImportMode::Replace { keep })
        .await
        .map_err(|e| incomplete("the archive was rejected", e))
}

/// Pass `stream` through, feeding a SHA-256 and a byte count.
fn hashing(stream: ByteStream, digest: Arc<Mutex<(sha2::Sha256, u64)>>) -> ByteStream {
    stream
        .inspect(move |chunk| {
            if let Ok(chunk) = chunk {
                let mut d = digest.lock().expect("digest lock");
                d.0.update(chunk);
                d.1 += chunk.len() as u64;
            }
        })
        .boxed()
}

/// Pass `stream` through; at its end, fail if its SHA-256 or size differ from the expected ones.
fn verify(mut stream: ByteStream, sha256: String, size: u64) -> ByteStream {
    let mut hasher = Some(sha2::Sha256::new());
    let mut seen = 0u64;
    futures::stream::poll_fn(move |cx| {
        let Some(h) = hasher.as_mut() else {
            return Poll::Ready(None);
        };
        match stream.poll_next_unpin(cx) {
            Poll::Ready(Some(Ok(chunk))) => {
                h.update(&chunk);
                seen += chunk.len() as u64;
                if seen > size {
                    hasher = None;
                    return Poll::Ready(Some(Err(Error::unsafe_archive(
                        "",
                        format!("archive is longer than the recorded {size} bytes"),
                    ))));
                }
                Poll::Ready(Some(Ok(chunk)))
            }
            Poll::Ready(Some(Err(e))) => {
                hasher = None;
                Poll::Ready(Some(Err(e)))
            }
            Poll::Ready(None) => {
                let got = hex::encode(hasher.take().expect("checked above").finalize());
                if seen != size {
                    Poll::Ready(Some(Err(Error::unsafe_archive(
                        "",
                        format!("archive is truncated: {seen} of {size} bytes"),
                    ))))
                } else if got != sha256 {
                    Poll::Ready(Some(Err(Error::unsafe_archive(
                        "",
                        format!("archive digest {got} differs from the recorded {sha256}"),
                    ))))
                } else {
                    Poll::Ready(None)
                }
            }
            Poll::Pending => Poll::Pending,
        }
    })
    .boxed()
}

fn unix_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as i64)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::stream;

    #[tokio::test]
    async fn verify_catches_tampering() {
        let data = bytes::Bytes::from_static(b"archive bytes");
        let sha = hex::encode(sha2::Sha256::digest(&data));
        let ok = stream::collect(verify(stream::once(data.clone()), sha.clone(), 13), 100).await;
        assert!(ok.is_ok());
        let bad =
            stream::collect(verify(stream::once("archive bytez"), sha.clone(), 13), 100).await;
        assert!(bad.unwrap_err().to_string().contains("digest"));
        let short = stream::collect(verify(stream::once("archive"), sha, 13), 100).await;
        assert!(short.unwrap_err().to_string().contains("truncated"));
    }
}
