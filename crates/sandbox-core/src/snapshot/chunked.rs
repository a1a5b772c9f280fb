//! The chunked format: files cut into content-defined chunks (FastCDC), each stored once and
//! addressed by its BLAKE3; the manifest lists every file's chunks and where they are.
//!
//! Writing (manifest version 2): chunks the parent does not have — small files are one chunk
//! each — are appended to *packs* (see [`super::pack`]): one streamed `put` per pack of about
//! [`SnapshotSpec::pack_size`] bytes, two in flight at once as far as what the store holds of
//! them stays within [`SnapshotSpec::upload_buffer`] (see [`PackWriter`]). Each byte of the export is read
//! once; a chunk is hashed once, and a file's own hash is that chunk's when the file is a
//! single chunk. A file of several chunks is hashed a second time as a whole (the manifest pins
//! whole-file BLAKE3s, which change detection and live-file reuse compare with), on a thread of
//! its own fed the same buffers, beside the chunk hashes. Chunks the parent has are
//! referenced at their existing location, never re-sent. A chunk the parent did not reference
//! always goes into a new pack, even if the store has it somewhere: a concurrent [`super::gc`]
//! only touches packs older than its grace period, so what this snapshot relies on is either
//! referenced by its parent or young.
//!
//! Restoring: pieces are fetched in manifest order with ranged reads, neighbours in one pack
//! coalesced into one read (bounded gap and size, see [`super::pack::Coalesce`]), a few reads
//! ahead; every chunk is checked against its hash, every file against its hash, and the
//! assembled tar stream passes the archive validator before the box imports it. A pack that is
//! gone is looked up in its redirect (left by a repack). Snapshots written before packs (chunk
//! blobs `chunks/<aa>/<hash>`, small files in *bundles* referenced as `[bundle, len, offset]`)
//! restore the same way, blob by blob.

use std::collections::{HashMap, HashSet};
use std::future::Future;
use std::io::{self, Read};
use std::pin::Pin;
use std::sync::Arc;

use bytes::Bytes;
use futures::StreamExt;
use tokio::sync::{Mutex, OwnedSemaphorePermit, Semaphore, mpsc};

use super::BlobKey;
use super::manifest::{ChunkLocation, ChunkRef, Manifest};
use super::pack::{
    Coalesce, MAX_PACK_CHUNKS, MAX_REDIRECT_DEPTH, PackId, Piece, RangeRead, Redirect,
};
use super::{Plan, SnapshotSpec, SnapshotStore, TakeContext, chunk_key};
use crate::archive::{self, ArchivePolicy, Checked};
use crate::backend::{BoxHandle, EntryType};
use crate::error::{Error, Result};
use crate::path::RelPath;
use crate::stream::{self, ByteStream};

/// Largest bundle accepted on restore (bundles were written up to the maximum chunk size).
const MAX_BUNDLE: usize = super::manifest::MAX_BUNDLE_LEN as usize;

/// Packs whose bytes are being streamed to the store at once, at most: one finishing while the
/// next fills. A pack whose stream has ended but whose put has not returned yet (the store
/// making it durable: an fsync, a `PUT`'s answer) no longer counts here; such puts are bounded
/// by [`SnapshotSpec::concurrency`], and what the store holds of them by
/// [`SnapshotSpec::upload_buffer`] (see [`PackWriter`]).
const MAX_PACKS_STREAMING: usize = 2;

/// Files up to this size are read whole and cut in place ([`Chunker::whole_file`]); larger
/// ones are cut as they stream, holding at most a chunk.
const WHOLE_READ_MAX: u64 = 4 << 20;

/// What the chunker learned about one exported file.
#[derive(Clone)]
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
) -> Result<(Manifest, u64, u64, Vec<BlobKey>)> {
    let spec = ctx.spec;
    // Every location the parent knows, by content: a chunk's or pack piece's hash, and for an
    // old bundle slice holding a whole small file, that file's hash.
    let mut known: HashMap<String, ChunkRef> = HashMap::new();
    if let Some(p) = parent {
        for e in &p.entries {
            for c in &e.chunks {
                if !matches!(c.location, ChunkLocation::Bundle { .. }) {
                    known.entry(c.hash.clone()).or_insert_with(|| c.clone());
                }
            }
            if let ([one], Some(h)) = (&e.chunks[..], &e.hash)
                && matches!(one.location, ChunkLocation::Bundle { .. })
            {
                known.entry(h.clone()).or_insert_with(|| one.clone());
            }
        }
    }
    let mut chunked: HashMap<RelPath, FileChunks> = HashMap::new();
    let mut uploaded = 0u64;
    let mut written: Vec<BlobKey> = Vec::new();
    if !plan.changed.is_empty() {
        // Every file to be read (a first snapshot): the whole tree, one plain export, rather
        // than a list of every path (which a backend driven by commands would pass as
        // arguments).
        let files = plan
            .entries
            .iter()
            .filter(|e| e.kind == EntryType::File)
            .count();
        let paths = (plan.changed.len() < files).then(|| plan.changed.clone());
        let exported = handle.export(&ctx.export_request(paths)).await?;
        let policy = spec.policy;
        let cdc = spec.chunking;
        let packs = PackWriter::new(
            spec.store.clone(),
            spec.pack_size,
            spec.upload_buffer,
            spec.concurrency,
        );
        let chunker = tokio::task::spawn_blocking(move || {
            let mut reader = stream::blocking_reader(exported);
            Chunker { cdc, known, packs }.run(&mut reader, policy)
        });
        let (chunk_result, puts) = chunker
            .await
            .map_err(|e| Error::backend("core", "chunking", e.to_string()))?;
        // A failed upload is the cause when the chunker saw its channel close: report it first.
        let mut put_error = None;
        for put in puts {
            match put.await {
                Ok((id, Ok(n))) => {
                    uploaded += n;
                    written.push(id.key());
                }
                // A failed put may still have stored its pack (an answer lost on the way):
                // deleted with the others.
                Ok((id, Err(e))) => {
                    written.push(id.key());
                    put_error.get_or_insert(e);
                }
                Err(e) => {
                    put_error.get_or_insert(Error::backend("core", "pack upload", e.to_string()));
                }
            }
        }
        let failed = match (put_error, chunk_result) {
            (Some(e), _) | (None, Err(e)) => Some(e),
            (None, Ok(files)) => {
                chunked = files;
                None
            }
        };
        if let Some(e) = failed {
            // Nothing references the packs this snapshot wrote: they go now, not at a gc an
            // hour later (on a full disk they would fail every call until then).
            super::discard(&*spec.store, &written).await;
            return Err(e);
        }
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
        written,
    ))
}

/// A pack's upload: its id (to delete it if the snapshot fails) and the put's answer.
type PutHandle = tokio::task::JoinHandle<(PackId, Result<u64>)>;

/// Appends chunks to packs, each one streamed `put` (run on the runtime) fed through a short
/// channel: the chunker never holds more than a few chunks per open pack.
///
/// At most [`MAX_PACKS_STREAMING`] packs are being fed at once; a pack's slot is free as soon
/// as the store has read its whole stream, so the chunker goes on while the store makes that
/// pack durable (on a local disk the fsyncs of several packs overlap the chunking instead of
/// stalling it). Puts not yet returned are at most `concurrency`.
///
/// Memory bound: a store may hold up to [`WriteHints::buffered_per_put`] bytes of each put
/// (S3 holds a pack whole for its one `PUT`). Before a chunk goes to its pack's put, the bytes
/// the store may newly hold because of it are reserved from a budget of `upload_buffer` bytes,
/// and given back only when that put returns; the chunker waits for them. So what the store
/// holds of all packs in flight never passes the budget, and where one pack alone would (the
/// store holds more than the budget and packs are larger), packs are cut at the budget.
///
/// [`WriteHints::buffered_per_put`]: super::WriteHints::buffered_per_put
struct PackWriter {
    rt: tokio::runtime::Handle,
    store: Arc<dyn SnapshotStore>,
    target: u64,
    /// What the store holds of one put at most, as reserved (never more than the budget).
    held_per_put: u64,
    /// Packs being streamed ([`MAX_PACKS_STREAMING`]).
    slots: Arc<Semaphore>,
    /// Puts not yet returned (`SnapshotSpec::concurrency`).
    pending: Arc<Semaphore>,
    /// The upload budget, one permit per byte.
    memory: Arc<Semaphore>,
    open: Option<OpenPack>,
    puts: Vec<PutHandle>,
}

struct OpenPack {
    id: PackId,
    tx: mpsc::Sender<Result<Bytes>>,
    len: u64,
    chunks: usize,
    /// The budget this pack's bytes hold; shared with its upload task, so it is given back
    /// once the pack is sealed and its put has returned.
    reserved: Arc<std::sync::Mutex<Option<OwnedSemaphorePermit>>>,
}

impl PackWriter {
    fn new(
        store: Arc<dyn SnapshotStore>,
        pack_size: u64,
        upload_buffer: u64,
        concurrency: usize,
    ) -> Self {
        let budget = upload_buffer.clamp(1, Semaphore::MAX_PERMITS as u64);
        let held = store.write_hints().buffered_per_put;
        let pack_size = pack_size.max(1);
        // A pack the store would hold whole past the budget: smaller packs instead.
        let target = if pack_size.min(held) > budget {
            budget
        } else {
            pack_size
        };
        PackWriter {
            rt: tokio::runtime::Handle::current(),
            store,
            target,
            held_per_put: held.min(budget),
            slots: Arc::new(Semaphore::new(MAX_PACKS_STREAMING)),
            pending: Arc::new(Semaphore::new(
                concurrency.clamp(MAX_PACKS_STREAMING, Semaphore::MAX_PERMITS),
            )),
            memory: Arc::new(Semaphore::new(budget as usize)),
            open: None,
            puts: Vec::new(),
        }
    }

    /// Append one chunk; returns where it will be. Blocks while the pack's upload is behind,
    /// and while the uploads in flight hold the budget this chunk needs.
    /// A pack never grows past its target (unless one chunk alone does): a chunk that would
    /// take it over starts the next one, so a store that sends blobs up to a limit in one
    /// request (S3: 16 MiB) sends each full pack in one.
    fn append(&mut self, data: Bytes) -> Result<(PackId, u64)> {
        if self
            .open
            .as_ref()
            .is_some_and(|open| open.len > 0 && open.len + data.len() as u64 > self.target)
        {
            self.open = None; // sealed: the closed channel ends that pack's stream
        }
        if self.open.is_none() {
            self.open = Some(self.start());
        }
        let open = self.open.as_mut().expect("opened above");
        let at = (open.id, open.len);
        // The bytes of this chunk the store may hold beyond what the pack holds already.
        let cap = self.held_per_put;
        let need = (open.len + data.len() as u64).min(cap) - open.len.min(cap);
        if need > 0 {
            let permit = self
                .rt
                .block_on(
                    self.memory
                        .clone()
                        .acquire_many_owned(u32::try_from(need).unwrap_or(u32::MAX)),
                )
                .expect("the semaphore is never closed");
            let mut reserved = open.reserved.lock().expect("not poisoned");
            match reserved.as_mut() {
                Some(held) => held.merge(permit),
                None => *reserved = Some(permit),
            }
        }
        open.len += data.len() as u64;
        open.chunks += 1;
        if open.tx.blocking_send(Ok(data)).is_err() {
            // The upload stopped (a failed put); its error is reported by the caller.
            return Err(Error::backend("core", "snapshot", "pack upload stopped"));
        }
        if open.len >= self.target || open.chunks >= MAX_PACK_CHUNKS {
            self.open = None; // the closed channel ends the pack's stream: the put completes
        }
        Ok(at)
    }

    fn start(&mut self) -> OpenPack {
        // A put slot first, then a stream slot: never hold a stream slot while waiting.
        let pending = self
            .rt
            .block_on(self.pending.clone().acquire_owned())
            .expect("the semaphore is never closed");
        let mut streaming = Some(
            self.rt
                .block_on(self.slots.clone().acquire_owned())
                .expect("the semaphore is never closed"),
        );
        let (tx, mut rx) = mpsc::channel::<Result<Bytes>>(4);
        let id = PackId::generate();
        let store = self.store.clone();
        let reserved = Arc::new(std::sync::Mutex::new(None));
        let held = reserved.clone();
        self.puts.push(self.rt.spawn(async move {
            let _pending = pending;
            // The stream slot goes when the store has read the whole pack (or drops the
            // stream); the put may go on (durability, the answer) without it.
            let data = futures::stream::poll_fn(move |cx| {
                let next = rx.poll_recv(cx);
                if let std::task::Poll::Ready(None) = next {
                    drop(streaming.take());
                }
                next
            })
            .boxed();
            let put = store.put(&id.key(), data, None).await;
            drop(held); // the store holds none of the pack any more
            (id, put)
        }));
        OpenPack {
            id,
            tx,
            len: 0,
            chunks: 0,
            reserved,
        }
    }

    /// Finish: seal the open pack (`ok`), or make its upload fail so nothing partial is
    /// stored. Returns the uploads to await.
    fn finish(mut self, ok: bool) -> Vec<PutHandle> {
        if let Some(open) = self.open.take()
            && !ok
        {
            let _ = open.tx.blocking_send(Err(Error::backend(
                "core",
                "snapshot",
                "snapshot abandoned",
            )));
        }
        self.puts
    }
}

struct Chunker {
    cdc: super::Chunking,
    known: HashMap<String, ChunkRef>,
    packs: PackWriter,
}

impl Chunker {
    /// Cut every file of an exported archive into chunks; append the ones nobody has yet to
    /// packs. Returns the files and the pack uploads (to await even on failure).
    fn run<R: Read>(
        mut self,
        reader: &mut R,
        policy: ArchivePolicy,
    ) -> (Result<HashMap<RelPath, FileChunks>>, Vec<PutHandle>) {
        let result = self.files(reader, policy);
        let puts = self.packs.finish(result.is_ok());
        (result, puts)
    }

    fn files<R: Read>(
        &mut self,
        reader: &mut R,
        policy: ArchivePolicy,
    ) -> Result<HashMap<RelPath, FileChunks>> {
        let mut out = HashMap::new();
        let mut validator = archive::Validator::new(policy);
        {
            let mut archive = tar::Archive::new(&mut *reader);
            for entry in archive.entries().map_err(|e| Error::io("export", e))? {
                let mut entry = entry.map_err(|e| Error::io("export", e))?;
                let (path, size) = match validator.check(&entry)? {
                    Some(Checked::File { path, size }) => (path, size),
                    // A hard link (an export of the whole tree keeps them) has its target's
                    // content, which the validator made sure is an earlier file here.
                    Some(Checked::HardLink { path, target }) => {
                        if let Some(file) = out.get(&target).cloned() {
                            out.insert(path, file);
                        }
                        continue;
                    }
                    _ => continue,
                };
                let file = if size < u64::from(self.cdc.min) {
                    self.small_file(&mut entry, &path, size)?
                } else if size <= WHOLE_READ_MAX {
                    self.whole_file(&mut entry, &path, size)?
                } else {
                    self.large_file(&mut entry, &path, size)?
                };
                out.insert(path, file);
            }
        }
        std::io::copy(reader, &mut std::io::sink()).map_err(|e| Error::io("export", e))?;
        Ok(out)
    }

    /// The reference for a chunk: where the parent (or this snapshot) already has it, else
    /// appended to a pack.
    fn place(&mut self, hash: String, data: Bytes) -> Result<ChunkRef> {
        if let Some(known) = self.known.get(&hash) {
            return Ok(known.clone());
        }
        let len = data.len() as u64;
        let (pack, offset) = self.packs.append(data)?;
        let r = ChunkRef::packed(hash.clone(), len, pack, offset);
        self.known.insert(hash, r.clone());
        Ok(r)
    }

    /// A file read whole into one buffer (at most [`WHOLE_READ_MAX`]): cut in place, chunks
    /// passed on as slices of it (no copy), the whole-file hash on a thread of its own while
    /// the chunks are hashed here. Slices are passed on only when every chunk of the file is
    /// new, so a buffer is never kept alive for a small new chunk of a file whose other chunks
    /// the parent has: what the packs in flight hold stays what their chunks weigh.
    fn whole_file<R: Read>(
        &mut self,
        entry: &mut R,
        path: &RelPath,
        size: u64,
    ) -> Result<FileChunks> {
        let mut content = vec![0u8; size as usize];
        entry.read_exact(&mut content).map_err(|e| {
            if e.kind() == io::ErrorKind::UnexpectedEof {
                Error::unsafe_archive(path.as_str(), format!("exported less than {size} bytes"))
            } else {
                Error::io(path.as_str(), e)
            }
        })?;
        let data = Bytes::from(content);
        let cuts: Vec<(usize, usize)> =
            fastcdc::v2020::FastCDC::new(&data, self.cdc.min, self.cdc.avg, self.cdc.max)
                .map(|c| (c.offset, c.length))
                .collect();
        if let [(0, len)] = cuts[..]
            && len == data.len()
        {
            let hash = blake3::hash(&data).to_hex().to_string();
            let chunks = vec![self.place(hash.clone(), data)?];
            return Ok(FileChunks { hash, size, chunks });
        }
        let (hash, hashes) = std::thread::scope(|scope| {
            let whole = scope.spawn(|| blake3::hash(&data).to_hex().to_string());
            let hashes: Vec<String> = cuts
                .iter()
                .map(|&(at, len)| blake3::hash(&data[at..at + len]).to_hex().to_string())
                .collect();
            whole
                .join()
                .map(|h| (h, hashes))
                .map_err(|_| Error::backend("core", "chunking", "the file hasher panicked"))
        })?;
        let all_new = hashes.iter().all(|h| !self.known.contains_key(h));
        let mut chunks = Vec::with_capacity(cuts.len());
        for ((at, len), chunk_hash) in cuts.into_iter().zip(hashes) {
            let piece = if all_new {
                data.slice(at..at + len)
            } else {
                Bytes::copy_from_slice(&data[at..at + len])
            };
            chunks.push(self.place(chunk_hash, piece)?);
        }
        Ok(FileChunks { hash, size, chunks })
    }

    fn large_file<R: Read>(
        &mut self,
        entry: &mut R,
        path: &RelPath,
        size: u64,
    ) -> Result<FileChunks> {
        let mut chunks = Vec::new();
        let mut total = 0u64;
        let mut single = None;
        // A file of several chunks is hashed as a whole too, on a thread of its own fed the
        // same buffers (no copy), so that the two hashes of each byte run side by side.
        let hashed = std::thread::scope(|scope| -> Result<Option<String>> {
            let mut whole: Option<(std::sync::mpsc::SyncSender<Bytes>, _)> = None;
            for chunk in
                fastcdc::v2020::StreamCDC::new(entry, self.cdc.min, self.cdc.avg, self.cdc.max)
            {
                let chunk =
                    chunk.map_err(|e| Error::io(path.as_str(), io::Error::other(e.to_string())))?;
                let data = Bytes::from(chunk.data);
                let hash = blake3::hash(&data).to_hex().to_string();
                if chunk.length as u64 == size {
                    // The whole file is this chunk: its hash is the file's.
                    single = Some(hash.clone());
                } else {
                    let (tx, _) = whole.get_or_insert_with(|| {
                        let (tx, rx) = std::sync::mpsc::sync_channel::<Bytes>(4);
                        let worker = scope.spawn(move || {
                            let mut hasher = blake3::Hasher::new();
                            for b in rx {
                                hasher.update(&b);
                            }
                            hasher.finalize().to_hex().to_string()
                        });
                        (tx, worker)
                    });
                    // The worker only stops when the sender is dropped.
                    let _ = tx.send(data.clone());
                }
                total += chunk.length as u64;
                chunks.push(self.place(hash, data)?);
            }
            Ok(match whole {
                Some((tx, worker)) => {
                    drop(tx);
                    Some(worker.join().map_err(|_| {
                        Error::backend("core", "chunking", "the file hasher panicked")
                    })?)
                }
                None => None,
            })
        })?;
        if total != size {
            return Err(Error::unsafe_archive(
                path.as_str(),
                format!("exported {total} of {size} bytes"),
            ));
        }
        let hash = match (single, hashed) {
            (Some(h), None) => h,
            (None, Some(h)) => h,
            _ => {
                return Err(Error::unsafe_archive(
                    path.as_str(),
                    "chunking disagreed with the file size",
                ));
            }
        };
        Ok(FileChunks { hash, size, chunks })
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
        let chunks = if size == 0 {
            Vec::new()
        } else {
            vec![self.place(hash.clone(), Bytes::from(content))?]
        };
        Ok(FileChunks { hash, size, chunks })
    }
}

/// One read and the pieces of it the assembler wants, in order.
enum Fetch {
    /// A whole chunk blob (version 1).
    Blob { hash: String, len: u64 },
    /// Slices of one bundle blob (version 1).
    Bundle {
        hash: String,
        slices: Vec<(u64, u64)>,
    },
    /// A ranged read of a pack.
    Range(RangeRead),
}

/// Group the manifest's pieces into reads, in order: neighbouring pieces of one pack share a
/// ranged read, consecutive slices of one bundle a fetch. Files in `reuse` are read from the
/// box instead.
fn plan_fetches(manifest: &Manifest, reuse: &HashSet<RelPath>, coalesce: Coalesce) -> Vec<Fetch> {
    let mut fetches: Vec<Fetch> = Vec::new();
    let pieces = manifest
        .entries
        .iter()
        .filter(|e| !reuse.contains(&e.path))
        .flat_map(|e| e.chunks.iter());
    for c in pieces {
        match c.location {
            ChunkLocation::Blob => fetches.push(Fetch::Blob {
                hash: c.hash.clone(),
                len: c.len,
            }),
            ChunkLocation::Bundle { offset } => match fetches.last_mut() {
                Some(Fetch::Bundle { hash, slices }) if *hash == c.hash => {
                    slices.push((offset, c.len))
                }
                _ => fetches.push(Fetch::Bundle {
                    hash: c.hash.clone(),
                    slices: vec![(offset, c.len)],
                }),
            },
            ChunkLocation::Pack { pack, offset } => {
                let piece = Piece {
                    hash: c.hash.clone(),
                    offset,
                    len: c.len,
                };
                match fetches.last_mut() {
                    Some(Fetch::Range(read)) if coalesce.extends(read, pack, &piece) => {
                        read.extend(piece)
                    }
                    _ => fetches.push(Fetch::Range(RangeRead {
                        pack,
                        offset,
                        len: c.len,
                        pieces: vec![piece],
                    })),
                }
            }
        }
    }
    fetches
}

/// Reads packs for one restore: ranged reads, verified pieces, redirects of repacked packs
/// (each read once).
struct PackReader {
    store: Arc<dyn SnapshotStore>,
    coalesce: Coalesce,
    redirects: Mutex<HashMap<PackId, Arc<Redirect>>>,
}

type Pieces<'a> = Pin<Box<dyn Future<Output = Result<Vec<Bytes>>> + Send + 'a>>;

impl PackReader {
    fn new(store: Arc<dyn SnapshotStore>, coalesce: Coalesce) -> Self {
        PackReader {
            store,
            coalesce,
            redirects: Mutex::new(HashMap::new()),
        }
    }

    async fn fetch(&self, fetch: Fetch) -> Result<Vec<Bytes>> {
        match fetch {
            Fetch::Blob { hash, len } => {
                let data = self.blob(&hash, Some(len)).await?;
                Ok(vec![data])
            }
            Fetch::Bundle { hash, slices } => {
                let data = self.blob(&hash, None).await?;
                slices
                    .into_iter()
                    .map(|(off, len)| {
                        let end = off.checked_add(len).filter(|e| *e <= data.len() as u64);
                        match end {
                            Some(end) => Ok(data.slice(off as usize..end as usize)),
                            None => Err(Error::unsafe_archive(
                                hash.as_str(),
                                "slice outside its bundle",
                            )),
                        }
                    })
                    .collect()
            }
            Fetch::Range(read) => self.range(read, 0).await,
        }
    }

    /// A version 1 blob, checked against its hash (and length, for whole chunks). The length
    /// comes from the manifest: it caps what is read (never more than [`MAX_BUNDLE`]) and is
    /// only a hint for the buffer, which grows with the bytes the store really has.
    async fn blob(&self, hash: &str, whole_len: Option<u64>) -> Result<Bytes> {
        let key = chunk_key(hash)?;
        let limit = whole_len.map_or(MAX_BUNDLE, |l| {
            usize::try_from(l).map_or(MAX_BUNDLE, |l| l.min(MAX_BUNDLE))
        });
        let data = stream::collect_sized(
            self.store.get(&key).await?,
            whole_len.map_or(1 << 20, |_| limit),
            limit,
        )
        .await
        .map_err(|e| match e {
            Error::InvalidInput { .. } => {
                Error::unsafe_archive(key.as_str(), "blob is longer than its reference")
            }
            e => e,
        })?;
        if whole_len.is_some_and(|l| data.len() as u64 != l)
            || blake3::hash(&data).to_hex().as_str() != hash
        {
            return Err(Error::unsafe_archive(
                key.as_str(),
                "blob content differs from its hash",
            ));
        }
        Ok(data)
    }

    /// One ranged read of a pack, split into its pieces, each checked against its hash; a
    /// pack that is gone is looked up in its redirect.
    fn range(&self, read: RangeRead, depth: usize) -> Pieces<'_> {
        Box::pin(async move {
            let key = read.pack.key();
            let len = usize::try_from(read.len).unwrap_or(usize::MAX);
            let got = match self.store.get_range(&key, read.offset, read.len).await {
                Ok(s) => stream::collect_sized(s, len, len).await,
                Err(e) => Err(e),
            };
            let data = match got {
                Ok(d) => d,
                Err(Error::NotFound { .. }) if depth < MAX_REDIRECT_DEPTH => {
                    return self.moved(read, depth).await;
                }
                Err(e) => return Err(e),
            };
            if data.len() != len {
                return Err(Error::unsafe_archive(
                    key.as_str(),
                    "the pack ends before the chunks it should hold",
                ));
            }
            read.pieces
                .iter()
                .map(|p| {
                    let start = (p.offset - read.offset) as usize;
                    let piece = data.slice(start..start + p.len as usize);
                    if blake3::hash(&piece).to_hex().as_str() != p.hash {
                        return Err(Error::unsafe_archive(
                            key.as_str(),
                            format!("chunk at {} differs from its hash", p.offset),
                        ));
                    }
                    Ok(piece)
                })
                .collect()
        })
    }

    /// The pieces of a read whose pack was repacked, from where its redirect says they are.
    async fn moved(&self, read: RangeRead, depth: usize) -> Result<Vec<Bytes>> {
        let redirect = self.redirect(read.pack).await?;
        let mut reads = Vec::new();
        for p in read.pieces {
            let found = redirect
                .find(&p.hash)
                .filter(|e| e.len == p.len)
                .ok_or_else(|| {
                    Error::unsafe_archive(
                        read.pack.redirect_key().as_str(),
                        format!("chunk {} is not in the repacked pack's redirect", p.hash),
                    )
                })?;
            let piece = Piece {
                offset: found.offset,
                ..p
            };
            self.coalesce.push(&mut reads, found.pack, piece);
        }
        let mut out = Vec::new();
        for r in reads {
            out.extend(self.range(r, depth + 1).await?);
        }
        Ok(out)
    }

    async fn redirect(&self, pack: PackId) -> Result<Arc<Redirect>> {
        let mut cache = self.redirects.lock().await;
        if let Some(r) = cache.get(&pack) {
            return Ok(r.clone());
        }
        let r = Arc::new(load_redirect(&*self.store, pack).await?);
        cache.insert(pack, r.clone());
        Ok(r)
    }
}

/// Read and check the redirect of `pack`.
pub(super) async fn load_redirect(store: &dyn SnapshotStore, pack: PackId) -> Result<Redirect> {
    let key = pack.redirect_key();
    let limit = super::pack::max_redirect_len();
    let bytes = match store.get(&key).await {
        Ok(s) => stream::collect(s, limit).await?,
        Err(Error::NotFound { .. }) => {
            return Err(Error::NotFound {
                what: "snapshot pack (neither the pack nor a redirect)",
                key: pack.key().to_string(),
            });
        }
        Err(e) => return Err(e),
    };
    Redirect::parse(&bytes, Some(pack)).map_err(|e| Error::from((key, e)))
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

/// Assemble a tar stream from the manifest and verified chunks, validated like any archive.
/// Files in `reuse` come from `live` (the box's own export of exactly those paths, in manifest
/// order) and are checked against their manifest hash; a mismatch fails the stream, and the
/// caller retries without reuse.
pub(super) fn restore_stream(
    spec: &SnapshotSpec,
    manifest: Arc<Manifest>,
    reuse: HashSet<RelPath>,
    live: Option<ByteStream>,
) -> ByteStream {
    let reader = Arc::new(PackReader::new(spec.store.clone(), Coalesce::default()));
    let concurrency = spec.restore_prefetch.max(1);
    let fetches = plan_fetches(&manifest, &reuse, reader.coalesce);
    // Reads run ahead (up to `concurrency` at once, each at most `Coalesce::max_read` bytes or
    // one piece); finished pieces wait in a short queue.
    let (tx, mut rx) = mpsc::channel::<Result<Bytes>>(2);
    tokio::spawn(async move {
        let fetched = futures::stream::iter(fetches)
            .map(|f| {
                let reader = reader.clone();
                async move { reader.fetch(f).await }
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

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::snapshot::BlobKey;
    use crate::snapshot::{LocalDirSnapshotStore, SnapshotStore};
    use crate::testkit::{CountingStore, holds_whole_puts};

    /// Writes `chunks` chunks of `chunk` bytes through a [`PackWriter`]; returns the sizes of
    /// the packs written and what the puts held at most at once.
    async fn write_packs(
        store: Arc<dyn SnapshotStore>,
        pack_size: u64,
        upload_buffer: u64,
        chunks: usize,
        chunk: usize,
    ) -> (Vec<u64>, u64) {
        let counting = Arc::new(CountingStore::new(store.clone()));
        let puts = tokio::task::spawn_blocking({
            let counting: Arc<dyn SnapshotStore> = counting.clone();
            move || {
                let mut packs = PackWriter::new(counting, pack_size, upload_buffer, 8);
                for i in 0..chunks {
                    packs
                        .append(Bytes::from(vec![i as u8; chunk]))
                        .expect("append");
                }
                packs.finish(true)
            }
        })
        .await
        .expect("writer");
        for put in puts {
            put.await.expect("join").1.expect("put");
        }
        let stored = crate::snapshot::SnapshotStoreExt::list_all(&*store, "packs/")
            .await
            .expect("list");
        let sizes = stored.iter().map(|m| m.size).collect();
        (sizes, counting.counts().max_put_bytes_in_flight)
    }

    /// The memory bound of the upload: a store that holds whole puts (S3) never holds more
    /// than `upload_buffer` of the packs in flight, however large the snapshot; packs are cut
    /// smaller only where one would pass the budget alone; a streaming store is not held back.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn uploads_hold_at_most_the_upload_buffer() {
        const KIB: u64 = 1024;
        let dir = tempfile::tempdir().expect("tempdir");
        let holding = |holds: u64, name: &str| -> Arc<dyn SnapshotStore> {
            let local = Arc::new(LocalDirSnapshotStore::new(dir.path().join(name)));
            Arc::new(holds_whole_puts(local, holds))
        };

        // Full packs of 256 KiB, a budget of one and a half: the next pack fills while one
        // uploads, but never a second whole pack (two in flight would hold 512 KiB).
        let (packs, held) =
            write_packs(holding(1 << 20, "a"), 256 * KIB, 384 * KIB, 96, 32 << 10).await;
        assert_eq!(packs, vec![256 * KIB; 12], "full packs");
        assert!(held <= 384 * KIB, "held {held} B at once");
        assert!(
            held >= 256 * KIB,
            "a whole pack was held ({held} B): the store buffers"
        );

        // The store holds more than the budget and packs are larger: packs cut at the budget.
        let (packs, held) =
            write_packs(holding(1 << 20, "b"), 256 * KIB, 128 * KIB, 48, 32 << 10).await;
        assert_eq!(packs, vec![128 * KIB; 12], "packs cut at the budget");
        assert!(held <= 128 * KIB, "held {held} B at once");

        // A store that streams: packs of the configured size, nothing reserved.
        let local: Arc<dyn SnapshotStore> =
            Arc::new(LocalDirSnapshotStore::new(dir.path().join("c")));
        let (packs, _) = write_packs(local, 256 * KIB, 128 * KIB, 48, 32 << 10).await;
        assert_eq!(
            packs,
            vec![256 * KIB; 6],
            "a streaming store keeps full packs"
        );
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn packs_stay_within_their_target() {
        let dir = tempfile::tempdir().expect("tempdir");
        let store: Arc<dyn SnapshotStore> = Arc::new(LocalDirSnapshotStore::new(dir.path()));
        let target = 1000u64;
        let lens = [300usize, 300, 300, 300, 1500, 10, 990, 5];
        let (puts, placed) = tokio::task::spawn_blocking({
            let store = store.clone();
            move || {
                let mut packs = PackWriter::new(store, target, target, 8);
                let placed: Vec<(PackId, u64)> = lens
                    .iter()
                    .map(|&n| packs.append(Bytes::from(vec![7u8; n])).expect("append"))
                    .collect();
                (packs.finish(true), placed)
            }
        })
        .await
        .expect("writer");
        for put in puts {
            put.await.expect("join").1.expect("put");
        }
        // Chunks by pack, in order, each starting where the previous one ended.
        let mut by_pack: Vec<(PackId, Vec<usize>)> = Vec::new();
        for (&(id, offset), &n) in placed.iter().zip(&lens) {
            match by_pack.last_mut() {
                Some((last, chunks)) if *last == id => {
                    assert_eq!(offset, chunks.iter().sum::<usize>() as u64);
                    chunks.push(n);
                }
                _ => {
                    assert_eq!(offset, 0, "a new pack starts at 0");
                    by_pack.push((id, vec![n]));
                }
            }
        }
        let sizes: Vec<Vec<usize>> = by_pack.iter().map(|(_, c)| c.clone()).collect();
        assert_eq!(
            sizes,
            [
                vec![300, 300, 300],
                vec![300],
                vec![1500],
                vec![10, 990],
                vec![5]
            ],
            "a chunk that would pass the target starts the next pack"
        );
        for (id, chunks) in &by_pack {
            let total: usize = chunks.iter().sum();
            assert!(total as u64 <= target || chunks.len() == 1, "{chunks:?}");
            let stored =
                crate::snapshot::SnapshotStoreExt::list_all(&*store, &id.key().to_string())
                    .await
                    .expect("list");
            assert_eq!(stored.len(), 1);
            assert_eq!(stored[0].size, total as u64);
        }
    }

    /// A manifest (parsed or not) whose references carry hostile lengths and offsets over
    /// tiny stored objects: restore fails with an error, never sizes a buffer from the length
    /// (64,424,509,440 and 2^36 bytes over a 6-byte blob aborted the process with
    /// `memory allocation of 64424509440 bytes failed`).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn hostile_lengths_fail_restore_without_allocating() {
        use crate::backend::EntryType;
        use crate::snapshot::manifest::{Header, ManifestEntry};
        use crate::snapshot::pack::MAX_PIECE_LEN;
        let dir = tempfile::tempdir().expect("tempdir");
        let store: Arc<dyn SnapshotStore> = Arc::new(LocalDirSnapshotStore::new(dir.path()));
        let small = b"hello\n";
        let hash = blake3::hash(small).to_hex().to_string();
        store
            .put(&chunk_key(&hash).unwrap(), stream::once(&small[..]), None)
            .await
            .expect("blob");
        let pack = PackId::generate();
        store
            .put(&pack.key(), stream::once(&small[..]), None)
            .await
            .expect("pack");
        let spec = SnapshotSpec::new(store);
        // (reference, whether reading the manifest refuses it already; the others are within
        // bounds and only the store's bytes show them wrong)
        let shapes = [
            (ChunkRef::whole(hash.clone(), 64_424_509_440), true),
            (ChunkRef::whole(hash.clone(), 1 << 36), true),
            (ChunkRef::whole(hash.clone(), u64::MAX), true),
            (ChunkRef::slice(hash.clone(), 1 << 36, 0), true),
            (ChunkRef::slice(hash.clone(), 6, 1 << 36), true),
            (ChunkRef::slice(hash.clone(), u64::MAX, u64::MAX), true),
            (ChunkRef::slice(hash.clone(), 6, 3), false),
            (ChunkRef::packed(hash.clone(), 1 << 36, pack, 0), true),
            (
                ChunkRef::packed(hash.clone(), u64::MAX, pack, u64::MAX),
                true,
            ),
            (
                ChunkRef::packed(hash.clone(), MAX_PIECE_LEN, pack, 0),
                false,
            ),
            (ChunkRef::packed(hash.clone(), 6, pack, 1 << 36), false),
        ];
        for (chunk, refused) in shapes {
            let entry = ManifestEntry {
                path: RelPath::new("f").unwrap(),
                kind: EntryType::File,
                mode: 0o644,
                size: chunk.len,
                mtime_ns: 0,
                inode: None,
                hash: Some(hash.clone()),
                link_target: None,
                chunks: vec![chunk.clone()],
            };
            let manifest = Manifest {
                header: Header {
                    version: 2,
                    id: "hostile".into(),
                    parent: None,
                    format: super::super::SnapshotFormat::Chunked,
                    started_ns: 0,
                    entries: 1,
                    archive: None,
                    native: None,
                },
                entries: vec![entry],
            };
            let bytes = manifest.to_bytes();
            // Restore from the unchecked manifest fails with an error (an abort ends the test
            // binary here).
            let out = tokio::time::timeout(
                Duration::from_secs(60),
                stream::collect(
                    restore_stream(&spec, Arc::new(manifest), HashSet::new(), None),
                    64 << 20,
                ),
            )
            .await
            .expect("restore ends");
            assert!(out.is_err(), "{chunk:?} restored");
            let parsed = Manifest::read_from(&bytes[..], &ArchivePolicy::default());
            assert_eq!(parsed.is_err(), refused, "{chunk:?} parsed: {parsed:?}");
        }
    }

    /// A store whose puts read their whole stream, then wait for `group` puts to be waiting
    /// together before they return (so a put that has read its pack but not returned is held
    /// open); it records the most puts unreturned at once.
    #[derive(Debug)]
    struct GatedStore {
        inner: LocalDirSnapshotStore,
        gate: tokio::sync::Barrier,
        unreturned: std::sync::atomic::AtomicUsize,
        most: std::sync::atomic::AtomicUsize,
    }

    #[async_trait::async_trait]
    impl SnapshotStore for GatedStore {
        fn name(&self) -> &'static str {
            "gated"
        }
        fn reach(&self) -> crate::reach::Reach {
            self.inner.reach()
        }
        async fn put(&self, key: &BlobKey, data: ByteStream, size: Option<u64>) -> Result<u64> {
            use std::sync::atomic::Ordering::SeqCst;
            let n = self.inner.put(key, data, size).await?;
            let now = self.unreturned.fetch_add(1, SeqCst) + 1;
            self.most.fetch_max(now, SeqCst);
            self.gate.wait().await;
            self.unreturned.fetch_sub(1, SeqCst);
            Ok(n)
        }
        async fn get(&self, key: &BlobKey) -> Result<ByteStream> {
            self.inner.get(key).await
        }
        async fn exists(&self, key: &BlobKey) -> Result<bool> {
            self.inner.exists(key).await
        }
        async fn delete(&self, key: &BlobKey) -> Result<()> {
            self.inner.delete(key).await
        }
        fn list(&self, prefix: &str) -> crate::snapshot::BlobStream {
            self.inner.list(prefix)
        }
        async fn sweep_leftovers(
            &self,
            sweep: crate::leftover::LeftoverSweep,
        ) -> Result<crate::leftover::LeftoverReport> {
            self.inner.sweep_leftovers(sweep).await
        }
    }

    /// A pack whose stream the store has read frees its streaming slot: the chunker goes on
    /// filling packs while earlier puts are still unanswered (an fsync, a `PUT`), up to
    /// `concurrency` puts, never more. With the slot held to the put's return (as before),
    /// at most two puts could be unanswered and the gate of three would never open.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn packs_keep_filling_while_earlier_puts_finish_up_to_concurrency() {
        use std::sync::atomic::Ordering::SeqCst;
        let dir = tempfile::tempdir().expect("tempdir");
        let concurrency = 3;
        let store = Arc::new(GatedStore {
            inner: LocalDirSnapshotStore::new(dir.path()),
            gate: tokio::sync::Barrier::new(concurrency),
            unreturned: Default::default(),
            most: Default::default(),
        });
        let puts = tokio::task::spawn_blocking({
            let store: Arc<dyn SnapshotStore> = store.clone();
            move || {
                // Six packs of one 1,000-byte chunk each.
                let mut packs = PackWriter::new(store, 1000, 1 << 20, concurrency);
                for i in 0..6u8 {
                    packs.append(Bytes::from(vec![i; 1000])).expect("append");
                }
                packs.finish(true)
            }
        });
        let puts = tokio::time::timeout(Duration::from_secs(20), puts)
            .await
            .expect("three puts were never unanswered at once")
            .expect("writer");
        assert_eq!(puts.len(), 6);
        for put in puts {
            tokio::time::timeout(Duration::from_secs(20), put)
                .await
                .expect("the last puts never met at the gate")
                .expect("join")
                .1
                .expect("put");
        }
        assert_eq!(
            store.most.load(SeqCst),
            concurrency,
            "puts unanswered at once"
        );
    }

    /// Files read whole and cut in place are cut and hashed exactly as streamed ones, so a
    /// file that grows past `WHOLE_READ_MAX` still shares its unchanged chunks.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn whole_and_streamed_files_cut_the_same() {
        let dir = tempfile::tempdir().expect("tempdir");
        let store: Arc<dyn SnapshotStore> = Arc::new(LocalDirSnapshotStore::new(dir.path()));
        let mut content = vec![0u8; 3 << 20];
        let mut x = 0x9E37_79B9_7F4A_7C15u64;
        for b in content.iter_mut() {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            *b = x as u8;
        }
        let (whole, streamed) = tokio::task::spawn_blocking(move || {
            let path = RelPath::new("f").expect("path");
            let size = content.len() as u64;
            let mut chunker = Chunker {
                cdc: super::super::Chunking::default(),
                known: HashMap::new(),
                packs: PackWriter::new(store, 16 << 20, 16 << 20, 8),
            };
            let whole = chunker
                .whole_file(&mut &content[..], &path, size)
                .expect("whole");
            chunker.known.clear();
            let streamed = chunker
                .large_file(&mut &content[..], &path, size)
                .expect("streamed");
            assert!(
                chunker
                    .whole_file(&mut &content[..100], &path, size)
                    .is_err(),
                "a short file is refused"
            );
            drop(chunker.packs.finish(true));
            (whole, streamed)
        })
        .await
        .expect("chunker");
        let cut = |f: &FileChunks| -> Vec<(String, u64)> {
            f.chunks.iter().map(|c| (c.hash.clone(), c.len)).collect()
        };
        assert!(whole.chunks.len() > 2, "{} chunks", whole.chunks.len());
        assert_eq!(cut(&whole), cut(&streamed));
        assert_eq!(whole.hash, streamed.hash);
        assert_eq!(whole.size, streamed.size);
    }

    /// An export of the whole tree may hold hard links (the engine's archives do): a linked
    /// path gets its target's content, so no file of the listing goes missing from the
    /// snapshot.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn hard_links_take_their_targets_content() {
        let dir = tempfile::tempdir().expect("tempdir");
        let store: Arc<dyn SnapshotStore> = Arc::new(LocalDirSnapshotStore::new(dir.path()));
        let mut b = tar::Builder::new(Vec::new());
        for (name, size) in [("small", 10usize), ("big", 300_000)] {
            let mut h = tar::Header::new_gnu();
            h.set_entry_type(tar::EntryType::Regular);
            h.set_size(size as u64);
            h.set_mode(0o644);
            b.append_data(&mut h, name, &vec![7u8; size][..]).unwrap();
            let mut h = tar::Header::new_gnu();
            h.set_entry_type(tar::EntryType::Link);
            h.set_size(0);
            h.set_mode(0o644);
            b.append_link(&mut h, format!("{name}-link"), name).unwrap();
        }
        let archive = b.into_inner().unwrap();
        let (files, puts) = tokio::task::spawn_blocking(move || {
            let chunker = Chunker {
                cdc: super::super::Chunking::default(),
                known: HashMap::new(),
                packs: PackWriter::new(store, 16 << 20, 16 << 20, 8),
            };
            chunker.run(&mut &archive[..], ArchivePolicy::default())
        })
        .await
        .expect("chunker");
        for put in puts {
            put.await.expect("join").1.expect("put");
        }
        let files = files.expect("chunked");
        assert_eq!(files.len(), 4);
        for name in ["small", "big"] {
            let file = &files[&RelPath::new(name).unwrap()];
            let link = &files[&RelPath::new(format!("{name}-link")).unwrap()];
            assert_eq!((&link.hash, link.size), (&file.hash, file.size), "{name}");
            assert_eq!(link.chunks, file.chunks, "{name}");
        }
    }
}
