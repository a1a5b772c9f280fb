//! The chunked format: files cut into content-defined chunks (FastCDC), each stored once under
//! its BLAKE3 in `chunks/<aa>/<hash>`; the manifest lists every file's chunks.
//!
//! Small files (under the minimum chunk size) are packed into *bundles*: blobs of up to the
//! maximum chunk size holding several files back to back, stored like chunks and referenced as
//! `[bundle, len, offset]`. A tree of 100,000 tiny files thus becomes a few hundred blobs, not
//! 100,000, and small files with identical content share one slice.
//!
//! Taking: only files whose metadata changed since the parent are exported from the box; their
//! chunks not already in the parent are uploaded (several at once), then the manifest.
//! Chunks the parent has are referenced, never re-sent. A chunk not in the parent is always
//! (re)written even if the store has it, which refreshes its age: a concurrent [`super::gc`]
//! only sweeps chunks older than its grace period, so a chunk this snapshot relies on is never
//! swept under it.
//!
//! Restoring: blobs are fetched (several at once, in manifest order, a bundle once for the run
//! of files it holds), each checked against its hash, each file against its hash, and assembled
//! into a tar stream that then passes the archive validator before the box imports it.

use std::collections::{HashMap, HashSet};
use std::io::{self, Read};
use std::sync::Arc;

use bytes::{Bytes, BytesMut};
use futures::StreamExt;
use tokio::sync::mpsc;

use super::manifest::{ChunkRef, Manifest};
use super::{Plan, SnapshotSpec, SnapshotStoreExt as _, TakeContext, chunk_key};
use crate::archive::{self, ArchivePolicy, Checked};
use crate::backend::{BoxHandle, EntryType};
use crate::error::{Error, Result};
use crate::path::RelPath;
use crate::stream::{self, ByteStream};

/// Largest bundle accepted on restore (bundles are written up to the maximum chunk size).
const MAX_BUNDLE: usize = 64 << 20;

/// What the chunker learned about one exported file.
struct FileChunks {
    hash: String,
    size: u64,
    chunks: Vec<ChunkRef>,
}

pub(super) async fn take(
    handle: &dyn BoxHandle,
    ctx: &TakeContext<'_>,
    plan: Plan,
    parent: Option<&Manifest>,
) -> Result<(Manifest, u64, u64)> {
    let spec = ctx.spec;
    let mut known: HashSet<String> = HashSet::new();
    // Small files of the parent by content: an unchanged small file (touched, or copied)
    // points at its old slice instead of going into a new bundle.
    let mut small: HashMap<String, ChunkRef> = HashMap::new();
    if let Some(p) = parent {
        for e in &p.entries {
            known.extend(e.chunks.iter().map(|c| c.hash.clone()));
            if let ([one], Some(h)) = (&e.chunks[..], &e.hash)
                && one.offset.is_some()
            {
                small.insert(h.clone(), one.clone());
            }
        }
    }
    let mut chunked: HashMap<RelPath, FileChunks> = HashMap::new();
    let mut uploaded = 0u64;
    if !plan.changed.is_empty() {
        let exported = handle
            .export(&ctx.export_request(Some(plan.changed.clone())))
            .await?;
        let (tx, rx) = mpsc::channel::<(String, Bytes)>(spec.concurrency.max(1) * 2);
        let policy = spec.policy;
        let cdc = spec.chunking;
        let chunker = tokio::task::spawn_blocking(move || {
            let mut reader = stream::blocking_reader(exported);
            Chunker {
                cdc,
                known,
                small,
                tx,
                bundle: Bundle::default(),
            }
            .run(&mut reader, policy)
        });
        let store = spec.store.clone();
        let uploads = futures::stream::poll_fn({
            let mut rx = rx;
            move |cx| rx.poll_recv(cx)
        })
        .map(|(hash, data)| {
            let store = store.clone();
            async move {
                let len = data.len() as u64;
                store.put_bytes(&chunk_key(&hash)?, data).await?;
                Ok::<u64, Error>(len)
            }
        })
        .buffer_unordered(spec.concurrency.max(1));
        let mut uploads = Box::pin(uploads);
        let mut upload_error = None;
        while let Some(r) = uploads.next().await {
            match r {
                Ok(n) => uploaded += n,
                Err(e) => {
                    upload_error = Some(e);
                    break;
                }
            }
        }
        // Dropping the uploads closes the channel, which stops the chunker.
        drop(uploads);
        let chunk_result = chunker
            .await
            .map_err(|e| Error::backend("core", "chunking", e.to_string()))?;
        if let Some(e) = upload_error {
            return Err(e);
        }
        chunked = chunk_result?;
    }
    let files_hashed = chunked.len() as u64;
    let mut entries = Vec::with_capacity(plan.entries.len());
    for mut entry in plan.entries {
        if entry.kind == EntryType::File && entry.hash.is_none() {
            let Some(found) = chunked.remove(&entry.path) else {
                continue; // removed between the listing and the export
            };
            if found.size != entry.size {
                entry.mtime_ns = 0; // changed after the listing: re-read next time
            }
            entry.size = found.size;
            entry.hash = Some(found.hash);
            entry.chunks = found.chunks;
        }
        entries.push(entry);
    }
    Ok((
        Manifest {
            header: ctx.header(entries.len() as u64, None),
            entries,
        },
        uploaded,
        files_hashed,
    ))
}

/// Small files waiting to be sealed into one bundle.
#[derive(Default)]
struct Bundle {
    data: BytesMut,
    /// Files in it: path, offset, length.
    members: Vec<(RelPath, u64, u64)>,
}

struct Chunker {
    cdc: super::Chunking,
    known: HashSet<String>,
    small: HashMap<String, ChunkRef>,
    tx: mpsc::Sender<(String, Bytes)>,
    bundle: Bundle,
}

impl Chunker {
    /// Cut every file of an exported archive into chunks or bundle slices; send blobs nobody
    /// has yet.
    fn run<R: Read>(
        mut self,
        reader: &mut R,
        policy: ArchivePolicy,
    ) -> Result<HashMap<RelPath, FileChunks>> {
        let mut out = HashMap::new();
        let mut validator = archive::Validator::new(policy);
        {
            let mut archive = tar::Archive::new(&mut *reader);
            for entry in archive.entries().map_err(|e| Error::io("export", e))? {
                let mut entry = entry.map_err(|e| Error::io("export", e))?;
                let Some(Checked::File { path, size }) = validator.check(&entry)? else {
                    continue;
                };
                let file = if size < u64::from(self.cdc.min) {
                    self.small_file(&mut entry, &path, size)?
                } else {
                    self.large_file(&mut entry, &path, size)?
                };
                out.insert(path, file);
                if self.bundle.data.len() >= self.cdc.max as usize {
                    self.seal(&mut out)?;
                }
            }
        }
        self.seal(&mut out)?;
        std::io::copy(reader, &mut std::io::sink()).map_err(|e| Error::io("export", e))?;
        Ok(out)
    }

    fn send(&mut self, hash: String, data: Bytes) -> Result<()> {
        if self.known.insert(hash.clone()) && self.tx.blocking_send((hash, data)).is_err() {
            // The uploader stopped (a failed put); its error is reported by the caller.
            return Err(Error::backend("core", "snapshot", "chunk upload stopped"));
        }
        Ok(())
    }

    fn large_file<R: Read>(
        &mut self,
        entry: &mut R,
        path: &RelPath,
        size: u64,
    ) -> Result<FileChunks> {
        let mut file_hasher = blake3::Hasher::new();
        let mut chunks = Vec::new();
        let mut total = 0u64;
        for chunk in fastcdc::v2020::StreamCDC::new(entry, self.cdc.min, self.cdc.avg, self.cdc.max)
        {
            let chunk =
                chunk.map_err(|e| Error::io(path.as_str(), io::Error::other(e.to_string())))?;
            file_hasher.update(&chunk.data);
            let hash = blake3::hash(&chunk.data).to_hex().to_string();
            total += chunk.length as u64;
            chunks.push(ChunkRef::whole(hash.clone(), chunk.length as u64));
            self.send(hash, Bytes::from(chunk.data))?;
        }
        if total != size {
            return Err(Error::unsafe_archive(
                path.as_str(),
                format!("exported {total} of {size} bytes"),
            ));
        }
        Ok(FileChunks {
            hash: file_hasher.finalize().to_hex().to_string(),
            size,
            chunks,
        })
    }

    fn small_file<R: Read>(
        &mut self,
        entry: &mut R,
        path: &RelPath,
        size: u64,
    ) -> Result<FileChunks> {
        let mut content = Vec::with_capacity(size as usize);
        entry
            .read_to_end(&mut content)
            .map_err(|e| Error::io(path.as_str(), e))?;
        if content.len() as u64 != size {
            return Err(Error::unsafe_archive(
                path.as_str(),
                format!("exported {} of {size} bytes", content.len()),
            ));
        }
        let hash = blake3::hash(&content).to_hex().to_string();
        if size == 0 {
            return Ok(FileChunks {
                hash,
                size,
                chunks: Vec::new(),
            });
        }
        if let Some(slice) = self.small.get(&hash) {
            return Ok(FileChunks {
                hash,
                size,
                chunks: vec![slice.clone()],
            });
        }
        let offset = self.bundle.data.len() as u64;
        self.bundle.data.extend_from_slice(&content);
        self.bundle.members.push((path.clone(), offset, size));
        // The slice is filled in when the bundle is sealed.
        Ok(FileChunks {
            hash,
            size,
            chunks: Vec::new(),
        })
    }

    /// Seal the open bundle when it is full (or at the end): upload it and point its members
    /// at it.
    fn seal(&mut self, out: &mut HashMap<RelPath, FileChunks>) -> Result<()> {
        if self.bundle.members.is_empty() {
            return Ok(());
        }
        let bundle = std::mem::take(&mut self.bundle);
        let data = bundle.data.freeze();
        let hash = blake3::hash(&data).to_hex().to_string();
        for (path, offset, len) in bundle.members {
            let slice = ChunkRef::slice(hash.clone(), len, offset);
            if let Some(f) = out.get_mut(&path) {
                self.small.insert(f.hash.clone(), slice.clone());
                f.chunks = vec![slice];
            }
        }
        self.send(hash, data)
    }
}

/// One blob to fetch and the pieces of it the assembler wants, in order.
struct Fetch {
    hash: String,
    /// Whole blobs: the expected length. Bundles: `None`.
    whole_len: Option<u64>,
    slices: Vec<(u64, u64)>,
}

/// Group the manifest's pieces into fetches: consecutive slices of one bundle share a fetch.
/// Files in `reuse` are read from the box instead.
fn plan_fetches(manifest: &Manifest, reuse: &HashSet<RelPath>) -> Vec<Fetch> {
    let mut fetches: Vec<Fetch> = Vec::new();
    let pieces = manifest
        .entries
        .iter()
        .filter(|e| !reuse.contains(&e.path))
        .flat_map(|e| e.chunks.iter());
    for c in pieces {
        match c.offset {
            None => fetches.push(Fetch {
                hash: c.hash.clone(),
                whole_len: Some(c.len),
                slices: vec![(0, c.len)],
            }),
            Some(off) => match fetches.last_mut() {
                Some(last) if last.whole_len.is_none() && last.hash == c.hash => {
                    last.slices.push((off, c.len))
                }
                _ => fetches.push(Fetch {
                    hash: c.hash.clone(),
                    whole_len: None,
                    slices: vec![(off, c.len)],
                }),
            },
        }
    }
    fetches
}

/// Files of the manifest that the box's live workspace already holds with the same kind,
/// size, mtime and mode: candidates to read from the box instead of fetching their chunks.
/// Empty when the workspace does not exist (the usual restore) or cannot be listed.
pub(super) async fn reusable(handle: &dyn BoxHandle, manifest: &Manifest) -> Vec<RelPath> {
    if !handle.workspace_exists().await.unwrap_or(false) {
        return Vec::new();
    }
    let Ok(live) = handle.list().await else {
        return Vec::new();
    };
    let live: HashMap<&RelPath, &crate::backend::TreeEntry> =
        live.iter().map(|e| (&e.path, e)).collect();
    manifest
        .entries
        .iter()
        .filter(|e| e.kind == EntryType::File && e.size > 0)
        .filter(|e| live.get(&e.path).is_some_and(|l| e.same_metadata(l)))
        .map(|e| e.path.clone())
        .collect()
}

/// Assemble a tar stream from the manifest and verified blobs, validated like any archive.
/// Files in `reuse` come from `live` (the box's own export of exactly those paths, in manifest
/// order) and are checked against their manifest hash; a mismatch fails the stream, and the
/// caller retries without reuse.
pub(super) fn restore_stream(
    spec: &SnapshotSpec,
    manifest: Arc<Manifest>,
    reuse: HashSet<RelPath>,
    live: Option<ByteStream>,
) -> ByteStream {
    let store = spec.store.clone();
    let concurrency = spec.restore_prefetch.max(1);
    let fetches = plan_fetches(&manifest, &reuse);
    // Fetches run ahead (up to `concurrency` at once); finished pieces wait in a short queue, so
    // at most about `concurrency + 2` blobs are in memory.
    let (tx, mut rx) = mpsc::channel::<Result<Bytes>>(2);
    tokio::spawn(async move {
        let fetched = futures::stream::iter(fetches)
            .map(|f| {
                let store = store.clone();
                async move {
                    let key = chunk_key(&f.hash)?;
                    let limit = f
                        .whole_len
                        .map_or(MAX_BUNDLE, |l| usize::try_from(l).unwrap_or(usize::MAX));
                    let data = stream::collect_sized(
                        store.get(&key).await?,
                        f.whole_len.map_or(1 << 20, |l| l as usize),
                        limit,
                    )
                    .await?;
                    if f.whole_len.is_some_and(|l| data.len() as u64 != l)
                        || blake3::hash(&data).to_hex().as_str() != f.hash
                    {
                        return Err(Error::unsafe_archive(
                            key.as_str(),
                            "blob content differs from its hash",
                        ));
                    }
                    f.slices
                        .into_iter()
                        .map(|(off, len)| {
                            let end = off.checked_add(len).filter(|e| *e <= data.len() as u64);
                            match end {
                                Some(end) => Ok(data.slice(off as usize..end as usize)),
                                None => Err(Error::unsafe_archive(
                                    key.as_str(),
                                    "slice outside its bundle",
                                )),
                            }
                        })
                        .collect::<Result<Vec<Bytes>>>()
                }
            })
            .buffered(concurrency);
        let mut fetched = std::pin::pin!(fetched);
        while let Some(r) = fetched.next().await {
            let pieces = match r {
                Ok(p) => p,
                Err(e) => {
                    let _ = tx.send(Err(e)).await;
                    return;
                }
            };
            for piece in pieces {
                if tx.send(Ok(piece)).await.is_err() {
                    return;
                }
            }
        }
    });
    let assembled = stream::spawn_writer(8, move |w| {
        let mut tar = tar::Builder::new(w);
        let mut live_archive = live.map(|s| tar::Archive::new(stream::blocking_reader(s)));
        let mut live_entries = match live_archive.as_mut() {
            Some(a) => Some(a.entries().map_err(|e| Error::io("live export", e))?),
            None => None,
        };
        for e in &manifest.entries {
            let mut h = tar::Header::new_gnu();
            h.set_mode(e.mode & 0o1777);
            h.set_mtime((e.mtime_ns.max(0) / 1_000_000_000) as u64);
            h.set_uid(0);
            h.set_gid(0);
            let res = match e.kind {
                EntryType::Dir => {
                    h.set_entry_type(tar::EntryType::Directory);
                    h.set_size(0);
                    tar.append_data(&mut h, e.path.as_str(), io::empty())
                }
                EntryType::Symlink => {
                    h.set_entry_type(tar::EntryType::Symlink);
                    h.set_size(0);
                    let target = e.link_target.as_deref().ok_or_else(|| {
                        Error::unsafe_archive(e.path.as_str(), "symlink without a target")
                    })?;
                    tar.append_link(&mut h, e.path.as_str(), target)
                }
                EntryType::File => {
                    if e.size > 0 && e.chunks.is_empty() {
                        return Err(Error::unsafe_archive(
                            e.path.as_str(),
                            "file without chunks",
                        ));
                    }
                    h.set_entry_type(tar::EntryType::Regular);
                    h.set_size(e.size);
                    if reuse.contains(&e.path) {
                        let entries = live_entries
                            .as_mut()
                            .ok_or_else(|| Error::backend("core", "restore", "no live export"))?;
                        let mut live_file = next_live_file(entries, &e.path, e.size)?;
                        let mut hashing = HashCheck {
                            inner: &mut live_file,
                            hasher: blake3::Hasher::new(),
                        };
                        tar.append_data(&mut h, e.path.as_str(), &mut hashing)
                            .map_err(|err| {
                                Error::unsafe_archive(e.path.as_str(), err.to_string())
                            })?;
                        if Some(hashing.hasher.finalize().to_hex().as_str()) != e.hash.as_deref() {
                            return Err(Error::unsafe_archive(
                                e.path.as_str(),
                                "the live file differs from the snapshot",
                            ));
                        }
                        continue;
                    }
                    let mut reader = PieceReader {
                        rx: &mut rx,
                        left: e.chunks.len(),
                        current: Bytes::new(),
                        error: None,
                    };
                    let r = tar.append_data(&mut h, e.path.as_str(), &mut reader);
                    if let Some(err) = reader.error.take() {
                        return Err(err);
                    }
                    r
                }
                EntryType::Other => continue,
            };
            res.map_err(|err| Error::unsafe_archive(e.path.as_str(), err.to_string()))?;
        }
        tar.into_inner().map_err(|e| Error::io("tar", e))?;
        Ok(())
    });
    archive::sanitize(assembled, spec.policy)
}

/// The next regular file of the box's live export, which must be `path` with `size` bytes.
fn next_live_file<'a, R: Read>(
    entries: &mut tar::Entries<'a, R>,
    path: &RelPath,
    size: u64,
) -> Result<tar::Entry<'a, R>> {
    for entry in entries.by_ref() {
        let entry = entry.map_err(|e| Error::io("live export", e))?;
        if entry.header().entry_type() != tar::EntryType::Regular {
            continue;
        }
        let name = entry.path_bytes();
        let name = String::from_utf8_lossy(&name);
        if name.trim_start_matches("./") != path.as_str() || entry.size() != size {
            return Err(Error::unsafe_archive(
                path.as_str(),
                format!("the live export gave `{name}` instead"),
            ));
        }
        return Ok(entry);
    }
    Err(Error::unsafe_archive(
        path.as_str(),
        "missing from the live export",
    ))
}

/// Hashes what passes through.
struct HashCheck<'a, R> {
    inner: &'a mut R,
    hasher: blake3::Hasher,
}

impl<R: Read> Read for HashCheck<'_, R> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let n = self.inner.read(buf)?;
        self.hasher.update(&buf[..n]);
        Ok(n)
    }
}

/// Reads one file's pieces off the fetch channel. Every piece comes from a blob verified
/// against its hash, in the order the (digest-verified) manifest lists them, so the file is
/// what the manifest says without hashing it again.
struct PieceReader<'a> {
    rx: &'a mut mpsc::Receiver<Result<Bytes>>,
    left: usize,
    current: Bytes,
    error: Option<Error>,
}

impl Read for PieceReader<'_> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        while self.current.is_empty() {
            if self.left == 0 {
                return Ok(0);
            }
            match self.rx.blocking_recv() {
                Some(Ok(data)) => {
                    self.left -= 1;
                    self.current = data;
                }
                Some(Err(e)) => {
                    let msg = e.to_string();
                    self.error = Some(e);
                    return Err(io::Error::other(msg));
                }
                None => {
                    self.error = Some(Error::unsafe_archive("", "chunk stream ended early"));
                    return Err(io::Error::other("chunk stream ended early"));
                }
            }
        }
        let n = buf.len().min(self.current.len());
        buf[..n].copy_from_slice(&self.current[..n]);
        self.current = self.current.slice(n..);
        Ok(n)
    }
}
