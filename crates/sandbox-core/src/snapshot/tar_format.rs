//! The tar format: one canonical tar per snapshot, hashed per file into the manifest on the
//! way to the store, and checked against the manifest on the way back.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use futures::StreamExt;

use super::manifest::{ArchiveInfo, Manifest, ManifestEntry};
use super::{SnapshotSpec, TakeContext, archive_key};
use crate::archive::{self, Checked, EmitMeta, RewriteHooks};
use crate::backend::{BoxHandle, EntryType, ExportRequest, TreeEntry};
use crate::error::{Error, Result};
use crate::path::RelPath;
use crate::snapshot::BlobKey;
use crate::stream::ByteStream;

/// Export the whole workspace, re-emit it canonically while hashing each file, and store it.
pub(super) async fn take(
    handle: &dyn BoxHandle,
    ctx: &TakeContext<'_>,
    live: &[TreeEntry],
) -> Result<(Manifest, u64, u64)> {
    let request = ctx.export_request(None);
    let exported = handle.export(&request).await?;
    let listed: HashMap<RelPath, TreeEntry> =
        live.iter().map(|e| (e.path.clone(), e.clone())).collect();
    let collected = Arc::new(Mutex::new((Vec::new(), 0u64)));
    let hooks = Collect {
        listed,
        excludes: ctx.excludes.clone(),
        entries: collected.clone(),
        files: 0,
    };
    let canonical = archive::rewrite_stream(exported, ctx.spec.policy, hooks);
    let hasher = Arc::new(Mutex::new(blake3::Hasher::new()));
    let h = hasher.clone();
    let hashed = canonical
        .inspect(move |chunk| {
            if let Ok(c) = chunk {
                h.lock().expect("hasher").update(c);
            }
        })
        .boxed();
    let key = archive_key(ctx.namespace, ctx.id)?;
    let size = ctx.spec.store.put(&key, hashed).await?;
    let blake3 = hasher
        .lock()
        .expect("hasher")
        .finalize()
        .to_hex()
        .to_string();
    let (mut entries, files) = std::mem::take(&mut *collected.lock().expect("entries"));
    entries.sort_by(|a, b| a.path.cmp(&b.path));
    let info = ArchiveInfo {
        key: key.to_string(),
        size,
        blake3,
    };
    Ok((
        Manifest {
            header: ctx.header(entries.len() as u64, Some(info)),
            entries,
        },
        size,
        files,
    ))
}

/// Builds manifest entries from the exported headers (and the listing's precise metadata).
struct Collect {
    listed: HashMap<RelPath, TreeEntry>,
    excludes: archive::Excludes,
    entries: Arc<Mutex<(Vec<ManifestEntry>, u64)>>,
    files: u64,
}

impl RewriteHooks for Collect {
    fn before(&mut self, entry: &Checked, header: &tar::Header) -> Result<EmitMeta> {
        if self.excludes.covers(entry.path()) {
            // A backend that cannot filter on export must not smuggle excluded paths in.
            return Err(Error::backend(
                "core",
                "snapshot",
                format!("export contained the excluded path `{}`", entry.path()),
            ));
        }
        Ok(EmitMeta::of(header))
    }

    fn after(&mut self, entry: &Checked, content: Option<(blake3::Hash, u64)>) -> Result<()> {
        let (kind, size, hash, link) = match entry {
            Checked::File { size, .. } => (
                EntryType::File,
                *size,
                content.map(|(h, _)| h.to_hex().to_string()),
                None,
            ),
            Checked::Dir { .. } => (EntryType::Dir, 0, None, None),
            Checked::Symlink { target, .. } => (EntryType::Symlink, 0, None, Some(target.clone())),
            Checked::HardLink { .. } => {
                return Err(Error::backend(
                    "core",
                    "snapshot",
                    "export produced a hard link",
                ));
            }
        };
        if kind == EntryType::File {
            self.files += 1;
        }
        let listed = self.listed.get(entry.path());
        // If the file changed between the listing and the export, its listed metadata is not
        // what was archived: record no mtime so the next snapshot re-reads it.
        let precise =
            listed.filter(|l| l.kind == kind && (kind != EntryType::File || l.size == size));
        let mut guard = self.entries.lock().expect("entries");
        guard.0.push(ManifestEntry {
            path: entry.path().clone(),
            kind,
            mode: precise.map_or(0o644, |l| l.mode),
            size,
            mtime_ns: precise.map_or(0, |l| l.mtime_ns),
            inode: precise.and_then(|l| l.inode),
            hash,
            link_target: link,
            chunks: Vec::new(),
        });
        guard.1 = self.files;
        Ok(())
    }

    fn hash_files(&self) -> bool {
        true
    }
}

/// The archive of a tar-format snapshot, checked against its digest and its manifest.
pub(super) async fn restore_stream(
    spec: &SnapshotSpec,
    manifest: &Arc<Manifest>,
) -> Result<ByteStream> {
    let info =
        manifest.header.archive.as_ref().ok_or_else(|| {
            Error::unsafe_archive("manifest", "a tar snapshot without an archive")
        })?;
    let key = BlobKey::new(info.key.clone())?;
    let blob = spec.store.get(&key).await?;
    let verified = verify_digest(blob, info.blake3.clone(), info.size);
    let hooks = Check {
        expected: manifest.clone(),
        index: None,
        seen: 0,
    };
    Ok(archive::rewrite_stream(verified, spec.policy, hooks))
}

/// Checks each archive entry against the manifest: present, same kind, size, link target and
/// content hash; and at the end, that nothing in the manifest was missing.
struct Check {
    expected: Arc<Manifest>,
    index: Option<HashMap<RelPath, usize>>,
    seen: usize,
}

impl Check {
    fn lookup(&mut self, path: &RelPath) -> Result<&ManifestEntry> {
        let manifest = &self.expected;
        let index = self.index.get_or_insert_with(|| {
            manifest
                .entries
                .iter()
                .enumerate()
                .map(|(i, e)| (e.path.clone(), i))
                .collect()
        });
        match index.get(path) {
            Some(&i) => Ok(&self.expected.entries[i]),
            None => Err(Error::unsafe_archive(
                path.as_str(),
                "not in the snapshot's manifest",
            )),
        }
    }
}

impl RewriteHooks for Check {
    fn before(&mut self, entry: &Checked, header: &tar::Header) -> Result<EmitMeta> {
        let expected = self.lookup(entry.path())?;
        let ok = match entry {
            Checked::File { size, .. } => {
                expected.kind == EntryType::File && expected.size == *size
            }
            Checked::Dir { .. } => expected.kind == EntryType::Dir,
            Checked::Symlink { target, .. } => {
                expected.kind == EntryType::Symlink && expected.link_target.as_ref() == Some(target)
            }
            Checked::HardLink { .. } => false,
        };
        if !ok {
            return Err(Error::unsafe_archive(
                entry.path().as_str(),
                "differs from the snapshot's manifest",
            ));
        }
        Ok(EmitMeta {
            mode: expected.mode,
            mtime: (expected.mtime_ns.max(0) / 1_000_000_000) as u64,
            ..EmitMeta::of(header)
        })
    }

    fn after(&mut self, entry: &Checked, content: Option<(blake3::Hash, u64)>) -> Result<()> {
        self.seen += 1;
        if let Some((hash, _)) = content {
            let expected = self.lookup(entry.path())?;
            if expected.hash.as_deref() != Some(hash.to_hex().as_str()) {
                return Err(Error::unsafe_archive(
                    entry.path().as_str(),
                    "content hash differs from the snapshot's manifest",
                ));
            }
        }
        Ok(())
    }

    fn finish(&mut self) -> Result<()> {
        let missing = self.expected.entries.len().saturating_sub(self.seen);
        if missing > 0 {
            return Err(Error::unsafe_archive(
                "",
                format!("the archive lacks {missing} entries of the snapshot's manifest"),
            ));
        }
        Ok(())
    }

    fn hash_files(&self) -> bool {
        true
    }
}

/// Pass `stream` through; at its end, fail if its BLAKE3 or size differ from the expected ones.
pub(super) fn verify_digest(stream: ByteStream, blake3_hex: String, size: u64) -> ByteStream {
    let mut hasher = Some(blake3::Hasher::new());
    let mut seen = 0u64;
    let mut inner = stream;
    futures::stream::poll_fn(move |cx| {
        use std::task::Poll;
        let Some(h) = hasher.as_mut() else {
            return Poll::Ready(None);
        };
        match inner.poll_next_unpin(cx) {
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
                let got = hasher
                    .take()
                    .expect("checked above")
                    .finalize()
                    .to_hex()
                    .to_string();
                if seen != size {
                    Poll::Ready(Some(Err(Error::unsafe_archive(
                        "",
                        format!("archive is truncated: {seen} of {size} bytes"),
                    ))))
                } else if got != blake3_hex {
                    Poll::Ready(Some(Err(Error::unsafe_archive(
                        "",
                        format!("archive digest {got} differs from the recorded {blake3_hex}"),
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

impl TakeContext<'_> {
    /// The export request for `paths` (all when `None`) with this snapshot's excludes.
    pub(super) fn export_request(&self, paths: Option<Vec<RelPath>>) -> ExportRequest {
        ExportRequest {
            paths,
            exclude: self.exclude.clone(),
            exclude_globs: self.exclude_globs.clone(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::stream;

    #[tokio::test]
    async fn verify_digest_catches_tampering() {
        let data = bytes::Bytes::from_static(b"archive bytes");
        let digest = blake3::hash(&data).to_hex().to_string();
        let ok = stream::collect(
            verify_digest(stream::once(data.clone()), digest.clone(), 13),
            100,
        )
        .await;
        assert!(ok.is_ok());
        let bad = stream::collect(
            verify_digest(stream::once("archive bytez"), digest.clone(), 13),
            100,
        )
        .await;
        assert!(bad.unwrap_err().to_string().contains("digest"));
        let short = stream::collect(
            verify_digest(stream::once("archive"), digest.clone(), 13),
            100,
        )
        .await;
        assert!(short.unwrap_err().to_string().contains("truncated"));
        let long = stream::collect(
            verify_digest(stream::once("archive bytes!"), digest, 13),
            100,
        )
        .await;
        assert!(long.unwrap_err().to_string().contains("longer"));
    }
}
