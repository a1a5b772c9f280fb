//! The chunked format: files cut into content-defined chunks (FastCDC), each stored once under
//! its BLAKE3 in `chunks/<aa>/<hash>`; the manifest lists every file's chunks.
//!
//! Taking: only files whose metadata changed since the parent are exported from the box; their
//! chunks not already in the parent are uploaded (several at once), then the manifest.
//! Chunks the parent has are referenced, never re-sent. A chunk not in the parent is always
//! (re)written even if the store has it, which refreshes its age: a concurrent [`super::gc`]
//! only sweeps chunks older than its grace period, so a chunk this snapshot relies on is never
//! swept under it.
//!
//! Restoring: chunks are fetched (several at once, in manifest order), each checked against its
//! hash, each file against its hash, and assembled into a tar stream that then passes the
//! archive validator before the box imports it.

use std::collections::{HashMap, HashSet};
use std::io::{self, Read};
use std::sync::Arc;

use bytes::Bytes;
use futures::StreamExt;
use tokio::sync::mpsc;

use super::manifest::{ChunkRef, Manifest};
use super::{Plan, SnapshotSpec, TakeContext, chunk_key};
use crate::archive::{self, ArchivePolicy, Checked};
use crate::backend::{BoxHandle, EntryType};
use crate::error::{Error, Result};
use crate::path::RelPath;
use crate::stream::{self, ByteStream};

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
    if let Some(p) = parent {
        for e in &p.entries {
            known.extend(e.chunks.iter().map(|c| c.0.clone()));
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
            chunk_archive(&mut reader, policy, cdc, known, &tx)
        });
        let store = spec.store.clone();
        let uploads = tokio_stream(rx)
            .map(|(hash, data)| {
                let store = store.clone();
                async move {
                    let len = data.len() as u64;
                    store.put(&chunk_key(&hash)?, stream::once(data)).await?;
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

/// Cut every file of an exported archive into chunks; send chunks nobody has yet.
fn chunk_archive<R: Read>(
    reader: &mut R,
    policy: ArchivePolicy,
    cdc: super::Chunking,
    mut known: HashSet<String>,
    tx: &mpsc::Sender<(String, Bytes)>,
) -> Result<HashMap<RelPath, FileChunks>> {
    let mut out = HashMap::new();
    let mut validator = archive::Validator::new(policy);
    let mut archive = tar::Archive::new(&mut *reader);
    for entry in archive.entries().map_err(|e| Error::io("export", e))? {
        let mut entry = entry.map_err(|e| Error::io("export", e))?;
        let Some(Checked::File { path, size }) = validator.check(&entry)? else {
            continue;
        };
        let mut file_hasher = blake3::Hasher::new();
        let mut chunks = Vec::new();
        let mut total = 0u64;
        for chunk in fastcdc::v2020::StreamCDC::new(&mut entry, cdc.min, cdc.avg, cdc.max) {
            let chunk =
                chunk.map_err(|e| Error::io(path.as_str(), io::Error::other(e.to_string())))?;
            file_hasher.update(&chunk.data);
            let hash = blake3::hash(&chunk.data).to_hex().to_string();
            total += chunk.length as u64;
            chunks.push(ChunkRef(hash.clone(), chunk.length as u64));
            if known.insert(hash.clone())
                && tx.blocking_send((hash, Bytes::from(chunk.data))).is_err()
            {
                // The uploader stopped (a failed put); its error is reported by the caller.
                return Err(Error::backend("core", "snapshot", "chunk upload stopped"));
            }
        }
        if total != size {
            return Err(Error::unsafe_archive(
                path.as_str(),
                format!("exported {total} of {size} bytes"),
            ));
        }
        out.insert(
            path,
            FileChunks {
                hash: file_hasher.finalize().to_hex().to_string(),
                size,
                chunks,
            },
        );
    }
    std::io::copy(reader, &mut std::io::sink()).map_err(|e| Error::io("export", e))?;
    Ok(out)
}

/// Assemble a tar stream from the manifest and verified chunks, validated like any archive.
pub(super) fn restore_stream(spec: &SnapshotSpec, manifest: Arc<Manifest>) -> ByteStream {
    let store = spec.store.clone();
    let concurrency = spec.concurrency.max(1);
    let refs: Vec<ChunkRef> = manifest
        .entries
        .iter()
        .flat_map(|e| e.chunks.iter().cloned())
        .collect();
    let (tx, mut rx) = mpsc::channel::<Result<Bytes>>(concurrency * 2);
    tokio::spawn(async move {
        let fetches = futures::stream::iter(refs)
            .map(|ChunkRef(hash, len)| {
                let store = store.clone();
                async move {
                    let key = chunk_key(&hash)?;
                    let limit = usize::try_from(len).unwrap_or(usize::MAX);
                    let data = stream::collect(store.get(&key).await?, limit).await?;
                    if data.len() as u64 != len || blake3::hash(&data).to_hex().as_str() != hash {
                        return Err(Error::unsafe_archive(
                            key.as_str(),
                            "chunk content differs from its hash",
                        ));
                    }
                    Ok(data)
                }
            })
            .buffered(concurrency);
        let mut fetches = std::pin::pin!(fetches);
        while let Some(r) = fetches.next().await {
            let stop = r.is_err();
            if tx.send(r).await.is_err() || stop {
                break;
            }
        }
    });
    let assembled = stream::spawn_writer(8, move |w| {
        let mut tar = tar::Builder::new(w);
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
                    let mut reader = ChunkReader {
                        rx: &mut rx,
                        left: e.chunks.len(),
                        current: Bytes::new(),
                        hasher: blake3::Hasher::new(),
                        error: None,
                    };
                    let r = tar.append_data(&mut h, e.path.as_str(), &mut reader);
                    if let Some(err) = reader.error.take() {
                        return Err(err);
                    }
                    if r.is_ok()
                        && Some(reader.hasher.finalize().to_hex().as_str()) != e.hash.as_deref()
                    {
                        return Err(Error::unsafe_archive(
                            e.path.as_str(),
                            "content hash differs from the manifest",
                        ));
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

/// Reads one file's chunks off the fetch channel.
struct ChunkReader<'a> {
    rx: &'a mut mpsc::Receiver<Result<Bytes>>,
    left: usize,
    current: Bytes,
    hasher: blake3::Hasher,
    error: Option<Error>,
}

impl Read for ChunkReader<'_> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        while self.current.is_empty() {
            if self.left == 0 {
                return Ok(0);
            }
            match self.rx.blocking_recv() {
                Some(Ok(data)) => {
                    self.left -= 1;
                    self.hasher.update(&data);
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

fn tokio_stream<T: Send + 'static>(
    mut rx: mpsc::Receiver<T>,
) -> impl futures::Stream<Item = T> + Send {
    futures::stream::poll_fn(move |cx| rx.poll_recv(cx))
}
