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
use crate::stream::{self, ByteStream};

/// Export the whole workspace and store the archive as it comes, while a parser on the side
/// validates it and hashes each file into the manifest. If the parser refuses the archive, the
/// stored blob is deleted and the snapshot fails.
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
    let mut hooks = Collect {
        listed,
        excludes: ctx.excludes.clone(),
        entries: collected.clone(),
        files: 0,
    };
    let (tx, mut rx) = tokio::sync::mpsc::channel::<bytes::Bytes>(32);
    let policy = ctx.spec.policy;
    let parser = tokio::task::spawn_blocking(move || {
        let side: ByteStream = futures::stream::poll_fn(move |cx| rx.poll_recv(cx))
            .map(Ok)
            .boxed();
        let mut reader = stream::blocking_reader(side);
        let mut counted = CountingRead {
            inner: &mut reader,
            n: 0,
        };
        archive::inspect(&mut counted, policy, &mut hooks)?;
        Ok::<_, Error>(counted.n)
    });
    let teed = exported
        .then(move |chunk| {
            let tx = tx.clone();
            async move {
                if let Ok(c) = &chunk {
                    // A parser that stopped has its error reported below.
                    let _ = tx.send(c.clone()).await;
                }
                chunk
            }
        })
        .boxed();
    let key = archive_key(ctx.namespace, ctx.id)?;
    let stored = ctx.spec.store.put(&key, teed, None).await;
    let parsed = parser
        .await
        .map_err(|e| Error::backend("core", "snapshot", e.to_string()))?;
    let (size, parsed_size) = match (stored, parsed) {
        (Ok(size), Ok(parsed_size)) => (size, parsed_size),
        (stored, parsed) => {
            let _ = ctx.spec.store.delete(&key).await;
            // A store that failed stopped reading the export, so the parser then met a
            // truncated archive: the store's error (often retryable: an outage) is the cause.
            // With the store done, a parser error is the archive's own.
            return Err(stored.err().or(parsed.err()).expect("one side failed"));
        }
    };
    debug_assert_eq!(size, parsed_size);
    let (mut entries, files) = std::mem::take(&mut *collected.lock().expect("entries"));
    entries.sort_by(|a, b| a.path.cmp(&b.path));
    let info = ArchiveInfo {
        key: key.to_string(),
        size,
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

/// A reader that counts what it reads.
struct CountingRead<'a, R> {
    inner: &'a mut R,
    n: u64,
}

impl<R: std::io::Read> std::io::Read for CountingRead<'_, R> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let n = self.inner.read(buf)?;
        self.n += n as u64;
        Ok(n)
    }
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

/// The archive of a tar-format snapshot, checked against its size and, entry by entry,
/// against its manifest (which pins every file's content hash).
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
    let verified = verify_size(blob, info.size);
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

/// Pass `stream` through; fail if it is longer or shorter than `size`.
pub(super) fn verify_size(stream: ByteStream, size: u64) -> ByteStream {
    let mut seen = 0u64;
    let mut done = false;
    let mut inner = stream;
    futures::stream::poll_fn(move |cx| {
        use std::task::Poll;
        if done {
            return Poll::Ready(None);
        }
        match inner.poll_next_unpin(cx) {
            Poll::Ready(Some(Ok(chunk))) => {
                seen += chunk.len() as u64;
                if seen > size {
                    done = true;
                    return Poll::Ready(Some(Err(Error::unsafe_archive(
                        "",
                        format!("archive is longer than the recorded {size} bytes"),
                    ))));
                }
                Poll::Ready(Some(Ok(chunk)))
            }
            Poll::Ready(Some(Err(e))) => {
                done = true;
                Poll::Ready(Some(Err(e)))
            }
            Poll::Ready(None) => {
                done = true;
                if seen == size {
                    Poll::Ready(None)
                } else {
                    Poll::Ready(Some(Err(Error::unsafe_archive(
                        "",
                        format!("archive is truncated: {seen} of {size} bytes"),
                    ))))
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
    async fn verify_size_catches_truncation_and_extension() {
        let ok = stream::collect(verify_size(stream::once("archive bytes"), 13), 100).await;
        assert!(ok.is_ok());
        let short = stream::collect(verify_size(stream::once("archive"), 13), 100).await;
        assert!(short.unwrap_err().to_string().contains("truncated"));
        let long = stream::collect(verify_size(stream::once("archive bytes!"), 13), 100).await;
        assert!(long.unwrap_err().to_string().contains("longer"));
    }
}
