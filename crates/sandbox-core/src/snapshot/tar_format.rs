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
) -> Result<(Manifest, u64, u64, Vec<BlobKey>)> {
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
        positions: None,
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
        vec![key],
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
    /// Where each entry so far stands in `entries`, built at the first hard link (a hard
    /// link's content is its target's) and kept up to date after.
    positions: Option<HashMap<RelPath, usize>>,
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
            // A second name of an earlier file (an export of the whole tree keeps hard links):
            // a file with that content. The archive keeps the link; restore checks it.
            Checked::HardLink { target, .. } => {
                let guard = self.entries.lock().expect("entries");
                let positions = self.positions.get_or_insert_with(|| {
                    (guard.0.iter().enumerate())
                        .map(|(i, e)| (e.path.clone(), i))
                        .collect()
                });
                let linked = positions
                    .get(target)
                    .map(|&i| &guard.0[i])
                    .filter(|t| t.kind == EntryType::File);
                let Some(linked) = linked else {
                    return Err(Error::backend(
                        "core",
                        "snapshot",
                        format!("export produced a hard link to `{target}`, not an earlier file"),
                    ));
                };
                (EntryType::File, linked.size, linked.hash.clone(), None)
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
        if let Some(positions) = &mut self.positions {
            positions.insert(entry.path().clone(), guard.0.len());
        }
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
    /// The position of `path`'s entry in the manifest.
    fn position(&mut self, path: &RelPath) -> Result<usize> {
        let manifest = &self.expected;
        let index = self.index.get_or_insert_with(|| {
            manifest
                .entries
                .iter()
                .enumerate()
                .map(|(i, e)| (e.path.clone(), i))
                .collect()
        });
        index
            .get(path)
            .copied()
            .ok_or_else(|| Error::unsafe_archive(path.as_str(), "not in the snapshot's manifest"))
    }

    fn lookup(&mut self, path: &RelPath) -> Result<&ManifestEntry> {
        let i = self.position(path)?;
        Ok(&self.expected.entries[i])
    }
}

impl RewriteHooks for Check {
    fn before(&mut self, entry: &Checked, header: &tar::Header) -> Result<EmitMeta> {
        let at = self.position(entry.path())?;
        // The target's position first: a hard link needs both entries.
        let target_at = match entry {
            Checked::HardLink { target, .. } => Some(self.position(target)?),
            _ => None,
        };
        let expected = &self.expected.entries[at];
        let ok = match entry {
            Checked::File { size, .. } => {
                expected.kind == EntryType::File && expected.size == *size
            }
            Checked::Dir { .. } => expected.kind == EntryType::Dir,
            Checked::Symlink { target, .. } => {
                expected.kind == EntryType::Symlink && expected.link_target.as_ref() == Some(target)
            }
            // The link's content is its target's, checked when the target went by: the two
            // must have the same size and hash in the manifest.
            Checked::HardLink { .. } => {
                let t = &self.expected.entries[target_at.expect("set for hard links")];
                expected.kind == EntryType::File
                    && t.kind == EntryType::File
                    && t.size == expected.size
                    && t.hash == expected.hash
            }
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

    /// A hard link restores when the manifest gives it its target's content, and is refused
    /// when it claims other content (a tampered manifest or archive).
    #[tokio::test]
    async fn a_hard_link_restores_only_as_its_targets_content() {
        use crate::snapshot::manifest::Header;
        let mut b = tar::Builder::new(Vec::new());
        let mut h = tar::Header::new_gnu();
        h.set_entry_type(tar::EntryType::Regular);
        h.set_size(3);
        h.set_mode(0o644);
        b.append_data(&mut h, "a", &b"abc"[..]).unwrap();
        let mut h = tar::Header::new_gnu();
        h.set_entry_type(tar::EntryType::Link);
        h.set_size(0);
        h.set_mode(0o644);
        b.append_link(&mut h, "b", "a").unwrap();
        let archive = b.into_inner().unwrap();
        let file = |path: &str, content: &[u8]| ManifestEntry {
            path: RelPath::new(path).unwrap(),
            kind: EntryType::File,
            mode: 0o644,
            size: content.len() as u64,
            mtime_ns: 1,
            inode: None,
            hash: Some(blake3::hash(content).to_hex().to_string()),
            link_target: None,
            chunks: Vec::new(),
        };
        let restore = |b_content: &'static [u8]| {
            let entries = vec![file("a", b"abc"), file("b", b_content)];
            let manifest = Manifest {
                header: Header {
                    version: 1,
                    id: "x".into(),
                    parent: None,
                    format: crate::snapshot::SnapshotFormat::Tar,
                    started_ns: 0,
                    entries: 2,
                    archive: None,
                    native: None,
                },
                entries,
            };
            let hooks = Check {
                expected: Arc::new(manifest),
                index: None,
                seen: 0,
            };
            let out = archive::rewrite_stream(
                stream::once(archive.clone()),
                archive::ArchivePolicy::default(),
                hooks,
            );
            stream::collect(out, 1 << 20)
        };
        let ok = restore(b"abc").await.expect("the link restores");
        let mut names = Vec::new();
        for e in tar::Archive::new(&ok[..]).entries().unwrap() {
            let e = e.unwrap();
            names.push((
                e.path().unwrap().display().to_string(),
                e.header().entry_type(),
            ));
        }
        assert_eq!(
            names,
            [
                ("a".to_owned(), tar::EntryType::Regular),
                ("b".to_owned(), tar::EntryType::Link)
            ]
        );
        let err = restore(b"xyz").await.expect_err("other content");
        assert!(err.to_string().contains("differs"), "{err}");
    }
}
