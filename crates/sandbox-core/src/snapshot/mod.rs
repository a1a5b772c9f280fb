//! The snapshot engine: what a box's workspace is archived to at `stop` and restored from at
//! `start`.
//!
//! Every snapshot has a [`Manifest`] (each entry's path, kind, mode, size, mtime and BLAKE3
//! content hash, plus the snapshot's id and parent), stored beside its data. Two formats:
//!
//! - [`SnapshotFormat::Tar`]: one tar archive per snapshot — what the spec describes and what a
//!   human can open with `tar -tf`. Every change re-archives the whole workspace.
//! - [`SnapshotFormat::Chunked`]: files split into content-defined chunks (FastCDC), appended to
//!   pack objects (`packs/<aa>/<id>`, one streamed upload each, see [`pack`]); the manifest lists
//!   each file's chunks with their hash and location. A stop exports only files whose metadata
//!   changed and uploads only chunks the parent snapshot does not have. The default: it meets
//!   `cargo xtask bench snapshot`'s targets on the local store (full snapshot within 1.5×
//!   `tar -cf`, three changed bytes in one chunk, bounded memory). Packs are freed by [`gc`],
//!   not by retention.
//!
//! Both formats skip unchanged workspaces: `stop` lists the box (size, mtime, mode, inode) and
//! compares with the parent manifest; nothing is written and the reference stays the same when
//! nothing changed. Files whose metadata changed are re-read and hashed.
//!
//! Restore is verified: the manifest is checked against the digest in the state, then every
//! archive entry (or chunk) against the manifest and the archive safety rules, and the result
//! goes to the box's `import` in `Replace` mode, which stages it and swaps only when the whole
//! stream arrived intact. Any failure is [`Error::RestoreIncomplete`] with the live workspace
//! untouched.
//!
//! Blob layout in a [`SnapshotStore`]: `snapshots/<namespace>/<id>.manifest`,
//! `snapshots/<namespace>/<id>.tar` (tar format), `packs/<aa>/<id>` and `packs/<aa>/<id>.moved`
//! (chunked format), `chunks/<aa>/<hash>` (chunked snapshots written before packs). The
//! namespace is the isolation key's digest (a call without a key takes no snapshot: nothing
//! could find it again); retention keeps the newest [`SnapshotSpec::keep_last`] manifests per
//! namespace and the one the stored state references, and [`gc`] deletes unreferenced packs
//! and chunks and repacks mostly dead packs.

mod chunked;
mod gc;
mod manifest;
pub mod pack;
mod store;
mod tar_format;

use std::sync::Arc;
use std::time::Duration;

use serde::{Deserialize, Serialize};

pub(crate) use gc::retain;
pub use gc::{GcOptions, GcReport, NativeDeleter, gc, gc_with};
pub use manifest::{
    ArchiveInfo, ChunkLocation, ChunkRef, Header, MANIFEST_VERSION, Manifest, ManifestEntry,
    NativeRef,
};
pub use pack::PackId;
pub use store::{
    BlobKey, BlobMeta, BlobStream, LocalDirSnapshotStore, NoopSnapshotStore, SnapshotStore,
    SnapshotStoreExt, WriteHints,
};

use crate::archive::{ArchivePolicy, Excludes};
use crate::backend::{BoxHandle, EntryType, TreeEntry};
use crate::error::{Error, Result};
use crate::path::RelPath;
use crate::stream;

/// The archive format of a snapshot.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
#[non_exhaustive]
pub enum SnapshotFormat {
    /// One tar archive per snapshot.
    Tar,
    /// Content-defined chunks stored once each, in packs; incremental. The default.
    #[default]
    Chunked,
    /// The backend's platform snapshots the whole box ([`BoxHandle::native_snapshot`]); the
    /// store keeps only a manifest naming the platform's reference, and restore starts the box
    /// from it ([`BoxHandle::restore_native`]). Needs [`crate::Capabilities::native_snapshots`].
    /// Every stop takes a platform snapshot (there is no per-file change detection).
    Native,
}

/// Chunk size bounds for [`SnapshotFormat::Chunked`] (FastCDC).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct Chunking {
    /// Smallest chunk (except a file's last). Default 64 KiB.
    pub min: u32,
    /// Target average. Default 256 KiB.
    pub avg: u32,
    /// Largest chunk. Default 1 MiB.
    pub max: u32,
}

impl Default for Chunking {
    fn default() -> Self {
        Chunking {
            min: 64 * 1024,
            avg: 256 * 1024,
            max: 1024 * 1024,
        }
    }
}

/// A pointer to one stored snapshot, kept in the box's state.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[non_exhaustive]
pub struct SnapshotRef {
    /// Snapshot id (a UUIDv7: sortable by creation time).
    pub id: String,
    /// Archive format.
    pub format: SnapshotFormat,
    /// The manifest's blob key.
    pub manifest: BlobKey,
    /// The manifest's size in bytes.
    pub manifest_size: u64,
    /// BLAKE3 of the manifest (hex); checked on restore, and the manifest pins every byte
    /// below it.
    pub manifest_blake3: String,
    /// Bytes this snapshot wrote to the store (archive or new chunks, plus the manifest).
    pub size: u64,
    /// Creation time, milliseconds since the epoch.
    pub created_unix_ms: i64,
    /// The snapshot this one was derived from.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub parent: Option<String>,
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
    /// Archive format. Default tar.
    pub format: SnapshotFormat,
    /// Rules for reading archives and manifests back.
    pub policy: ArchivePolicy,
    /// Manifests kept per namespace (older ones, and their archives, are deleted after each
    /// new snapshot; chunks are left to [`gc`]). `0` keeps everything. Default 5.
    pub keep_last: usize,
    /// Chunk sizes for the chunked format.
    pub chunking: Chunking,
    /// Pack uploads (chunked format) not yet returned, at most: a pack whose bytes the store
    /// has all read may still be waiting to be made durable (a local fsync) or for the
    /// store's answer while the next packs fill. At least 2. Default 8.
    pub concurrency: usize,
    /// Chunks fetched ahead while restoring. Each costs up to a chunk of memory (and, with
    /// glibc's per-thread arenas, about as much again): the default 2 keeps a restore of a
    /// 1 GiB workspace near 50 MiB RSS; raise it for stores with high latency. Default 2.
    pub restore_prefetch: usize,
    /// Target size of a pack in the chunked format: a pack holds at most this many bytes (a
    /// chunk that would take it over starts the next pack; a single larger chunk is a pack of
    /// its own) and at most [`pack::MAX_PACK_CHUNKS`] chunks. Default [`DEFAULT_PACK_SIZE`].
    pub pack_size: u64,
    /// The most bytes of pack uploads the store may hold in memory at once, over all packs in
    /// flight (what one put holds is the store's [`WriteHints::buffered_per_put`]). Packs
    /// upload while the next ones fill only as far as this allows, and when one pack alone
    /// would pass it (a store that holds a whole pack before it sends it), packs are cut at
    /// this size. Nothing is held for a store that streams. Default
    /// [`DEFAULT_UPLOAD_BUFFER`].
    pub upload_buffer: u64,
}

/// Default [`SnapshotSpec::pack_size`]: 16 MiB — a full snapshot is a few uploads, and the last
/// pack's flush (the part of the upload no chunking overlaps) stays short.
pub const DEFAULT_PACK_SIZE: u64 = 16 << 20;

/// Default [`SnapshotSpec::upload_buffer`]: 16 MiB — one full pack held by a store that sends
/// it in one request (S3), so a snapshot of any size stays within 64 MiB RSS.
pub const DEFAULT_UPLOAD_BUFFER: u64 = 16 << 20;

impl Default for SnapshotSpec {
    fn default() -> Self {
        SnapshotSpec::new(Arc::new(NoopSnapshotStore))
    }
}

impl SnapshotSpec {
    /// Snapshots in `store`, the default format ([`SnapshotFormat::Chunked`]), default
    /// policy, retention 5.
    pub fn new(store: Arc<dyn SnapshotStore>) -> Self {
        SnapshotSpec {
            store,
            format: SnapshotFormat::default(),
            policy: ArchivePolicy::default(),
            keep_last: 5,
            chunking: Chunking::default(),
            concurrency: 8,
            restore_prefetch: 2,
            pack_size: DEFAULT_PACK_SIZE,
            upload_buffer: DEFAULT_UPLOAD_BUFFER,
        }
    }

    /// Snapshots as files under `dir`.
    pub fn local_dir(dir: impl Into<std::path::PathBuf>) -> Self {
        SnapshotSpec::new(Arc::new(LocalDirSnapshotStore::new(dir)))
    }

    /// Set the format.
    pub fn format(mut self, format: SnapshotFormat) -> Self {
        self.format = format;
        self
    }

    /// Set the archive policy (e.g. strict symlinks).
    pub fn policy(mut self, policy: ArchivePolicy) -> Self {
        self.policy = policy;
        self
    }

    /// Set the retention (manifests kept per namespace; 0 keeps all).
    pub fn keep_last(mut self, n: usize) -> Self {
        self.keep_last = n;
        self
    }

    /// Set how many pack uploads may be unanswered at once (see [`SnapshotSpec::concurrency`]).
    pub fn concurrency(mut self, n: usize) -> Self {
        self.concurrency = n.max(2);
        self
    }

    /// Set how many chunks a restore fetches ahead.
    pub fn restore_prefetch(mut self, n: usize) -> Self {
        self.restore_prefetch = n.max(1);
        self
    }

    /// Set the pack target size (chunked format).
    pub fn pack_size(mut self, bytes: u64) -> Self {
        self.pack_size = bytes.max(1);
        self
    }

    /// Set the memory bound of pack uploads held by the store (chunked format).
    pub fn upload_buffer(mut self, bytes: u64) -> Self {
        self.upload_buffer = bytes.max(1);
        self
    }

    /// Set the chunk sizes.
    pub fn chunking(mut self, chunking: Chunking) -> Self {
        self.chunking = chunking;
        self
    }

    /// Whether snapshots are kept at all.
    pub fn enabled(&self) -> bool {
        self.store.reach() != crate::reach::Reach::None
    }
}

/// What to snapshot.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct TakeRequest {
    /// Namespace for retention (the isolation key's digest, or `unkeyed`).
    pub namespace: String,
    /// Paths never archived (bind mounts, ephemeral entries).
    pub exclude: Vec<RelPath>,
    /// Globs never archived.
    pub exclude_globs: Vec<String>,
    /// The workspace's projection hash, recorded in the reference.
    pub projection_hash: Option<String>,
    /// The previous snapshot and its manifest (or the post-restore baseline), for change
    /// detection and chunk reuse.
    pub parent: Option<(SnapshotRef, Arc<Manifest>)>,
}

impl TakeRequest {
    /// A request for namespace `namespace` with no excludes, no projection and no parent.
    pub fn new(namespace: impl Into<String>) -> Self {
        TakeRequest {
            namespace: namespace.into(),
            exclude: Vec::new(),
            exclude_globs: Vec::new(),
            projection_hash: None,
            parent: None,
        }
    }

    /// Leave out `paths` and paths matching `globs`.
    pub fn exclude(mut self, paths: Vec<RelPath>, globs: Vec<String>) -> Self {
        self.exclude = paths;
        self.exclude_globs = globs;
        self
    }

    /// Record a projection hash.
    pub fn projection_hash(mut self, hash: Option<String>) -> Self {
        self.projection_hash = hash;
        self
    }

    /// Compare against (and share chunks with) `parent`.
    pub fn parent(mut self, parent: Option<(SnapshotRef, Arc<Manifest>)>) -> Self {
        self.parent = parent;
        self
    }
}

/// What [`take`] did.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct TakeOutcome {
    /// The snapshot now describing the workspace (the parent's, when unchanged).
    pub snapshot: SnapshotRef,
    /// Its manifest, to keep as the next parent.
    pub manifest: Arc<Manifest>,
    /// Nothing changed: nothing was written.
    pub unchanged: bool,
    /// Files whose content was read and hashed (each counted once).
    pub files_hashed: u64,
    /// Of the files this snapshot read, those modified so close to its listing that the next
    /// stop could not trust their metadata: read only once the clock had moved past them, so
    /// it can (see [`take`]).
    pub files_settled: u64,
    /// Bytes written to the store.
    pub bytes_written: u64,
}

/// Archive the workspace of `handle` into the store, or find that nothing changed. Retention
/// is not applied here: the manager retires older snapshots only after a state pointing at the
/// new one was saved.
pub async fn take(
    handle: &dyn BoxHandle,
    spec: &SnapshotSpec,
    request: TakeRequest,
) -> Result<TakeOutcome> {
    let started_ns = now_ns();
    if spec.format == SnapshotFormat::Native {
        return take_native(handle, spec, request, started_ns).await;
    }
    let excludes = Excludes::new(request.exclude.clone(), &request.exclude_globs)?;
    let live: Vec<TreeEntry> = handle
        .list()
        .await?
        .into_iter()
        .filter(|e| e.kind != EntryType::Other && !excludes.covers(&e.path))
        .collect();
    let parent = request
        .parent
        .as_ref()
        .filter(|(r, _)| r.format == spec.format);
    let mut plan = Plan::new(&live, parent.map(|(_, m)| &**m));
    // Before any file is read (suspects' hashes, the snapshot's export).
    let (read_from_ns, settled, coarse) = settle_before_read(&live, started_ns).await;
    let coarse: std::collections::HashSet<RelPath> = coarse.into_iter().collect();
    let unsettled = |entries: &mut Vec<ManifestEntry>| {
        for e in entries.iter_mut() {
            if coarse.contains(&e.path) {
                e.mtime_ns = 0; // whole seconds, racy: the next stop reads it
            }
        }
    };
    // Suspects read and found to hold the parent's content (their chunks are reused, not read
    // again).
    let mut suspects_same = 0u64;
    if let Some((parent_ref, parent_manifest)) = parent
        && !plan.structural
    {
        // Only suspects (if any) stand between us and "unchanged": their content decides.
        let hashes = if plan.suspects.is_empty() {
            Default::default()
        } else {
            let request = crate::backend::ExportRequest {
                paths: Some(plan.suspects.clone()),
                exclude: request.exclude.clone(),
                exclude_globs: request.exclude_globs.clone(),
            };
            hash_files(handle, request, spec.policy).await?
        };
        let index = parent_manifest.index();
        let confirmed = plan.suspects.iter().all(|p| {
            hashes.get(p).is_some_and(|(h, size)| {
                index
                    .get(p)
                    .is_some_and(|e| e.hash.as_ref() == Some(h) && e.size == *size)
            })
        });
        if confirmed {
            let mut same = parent_ref.clone();
            same.projection_hash.clone_from(&request.projection_hash);
            // The baseline for the next stop: the parent's content with today's metadata.
            let mut entries = plan.entries;
            for e in &mut entries {
                if e.hash.is_none() && e.kind == EntryType::File {
                    let p = index.get(&e.path).expect("suspects are in the parent");
                    e.hash.clone_from(&p.hash);
                    e.chunks.clone_from(&p.chunks);
                }
            }
            unsettled(&mut entries);
            let mut header = parent_manifest.header.clone();
            header.started_ns = read_from_ns;
            return Ok(TakeOutcome {
                snapshot: same,
                manifest: Arc::new(Manifest { header, entries }),
                unchanged: true,
                files_hashed: plan.suspects.len() as u64,
                files_settled: settled.len() as u64,
                bytes_written: 0,
            });
        }
        if spec.format == SnapshotFormat::Chunked {
            // Some suspect changed. Those that did not keep the parent's hash and chunks: only
            // the changed ones are read again (they were read once to hash them).
            let same: std::collections::HashSet<&RelPath> = plan
                .suspects
                .iter()
                .filter(|p| {
                    hashes.get(*p).is_some_and(|(h, size)| {
                        index
                            .get(*p)
                            .is_some_and(|e| e.hash.as_ref() == Some(h) && e.size == *size)
                    })
                })
                .collect();
            for e in &mut plan.entries {
                if e.hash.is_none() && same.contains(&e.path) {
                    let p = index.get(&e.path).expect("suspects are in the parent");
                    e.hash.clone_from(&p.hash);
                    e.chunks.clone_from(&p.chunks);
                }
            }
            suspects_same = same.len() as u64;
            let same: std::collections::HashSet<RelPath> = same.into_iter().cloned().collect();
            plan.changed.retain(|p| !same.contains(p));
        }
    }
    let id = uuid::Uuid::now_v7().to_string();
    let ns = &request.namespace;
    let ctx = TakeContext {
        spec,
        id: &id,
        namespace: ns,
        started_ns: read_from_ns,
        excludes: &excludes,
        exclude: request.exclude.clone(),
        exclude_globs: request.exclude_globs.clone(),
        parent_id: parent.map(|(r, _)| r.id.clone()),
    };
    let (manifest, data_bytes, files_hashed, written) = match spec.format {
        SnapshotFormat::Tar => tar_format::take(handle, &ctx, &live).await?,
        SnapshotFormat::Chunked => {
            chunked::take(handle, &ctx, plan, parent.map(|(_, m)| &**m)).await?
        }
        SnapshotFormat::Native => unreachable!("native snapshots return above"),
    };
    let mut manifest = manifest;
    unsettled(&mut manifest.entries);
    let files_settled = settled.len() as u64;
    let manifest_key = manifest_key(ns, &manifest.header.id)?;
    let finished = finish_take(
        spec,
        ns,
        manifest,
        data_bytes,
        files_hashed + suspects_same,
        request.projection_hash,
    )
    .await;
    if finished.is_err() {
        // No state references this snapshot yet: what it wrote (its packs or archive, and a
        // manifest a failed put may still have stored) goes at once, so a store the snapshot
        // filled is not left full until the next gc.
        let mut doomed = written;
        doomed.push(manifest_key);
        discard(&*spec.store, &doomed).await;
    }
    let mut outcome = finished?;
    outcome.files_settled = files_settled;
    Ok(outcome)
}

/// Delete `keys`, written by a snapshot that failed before anything referenced them. Best
/// effort: what cannot be deleted now is unreferenced, so the next gc deletes it.
async fn discard(store: &dyn SnapshotStore, keys: &[BlobKey]) {
    let mut failed = 0usize;
    for key in keys {
        if let Err(e) = store.delete(key).await {
            failed += 1;
            tracing::warn!(key = %key, error = %e, "cannot delete a blob of a failed snapshot; the next gc will");
        }
    }
    tracing::debug!(
        deleted = keys.len() - failed,
        failed,
        "deleted the blobs of a failed snapshot"
    );
}

/// The longest a snapshot waits for the clock to move past its racy files' mtimes (precise
/// mtimes need two coarse-clock ticks; whole-second ones would need up to a second: those are
/// not waited for).
const SETTLE_MAX_WAIT_NS: i64 = 50_000_000;

/// Files a snapshot reads whose mtime is racy against its listing (modified within a clock
/// tick of it, or in its second for whole-second mtimes) would all be read again by the next
/// stop, changed or not: a rewrite in that tick would show the same metadata. Unless the
/// snapshot *settles* them: it waits, before reading, until the clock is past every such mtime
/// by the racy window, so a write from then on gets a later mtime; what it reads is then the
/// content of that metadata, and the instant the read starts becomes the manifest's listing
/// time (a later instant only makes fewer files racy, and every file racy against the
/// listing is read after it). Whole-second mtimes would need up to a second: those files
/// record no mtime instead (the next stop reads them, as it would have), and so do all when
/// the wait would be longer than [`SETTLE_MAX_WAIT_NS`] (an mtime in the future).
///
/// Returns the listing time to record and the racy files: `(settled, coarse)`, by path.
async fn settle_before_read(live: &[TreeEntry], listed: i64) -> (i64, Vec<RelPath>, Vec<RelPath>) {
    let racy: Vec<&TreeEntry> = live
        .iter()
        .filter(|e| e.kind == EntryType::File && is_racy(e.mtime_ns, listed))
        .collect();
    if racy.is_empty() {
        return (listed, Vec::new(), Vec::new());
    }
    let (coarse, precise): (Vec<&TreeEntry>, Vec<&TreeEntry>) = racy
        .into_iter()
        .partition(|e| granularity_ns(e.mtime_ns) != 0);
    let coarse: Vec<RelPath> = coarse.into_iter().map(|e| e.path.clone()).collect();
    let window = racy_window_ns();
    let until = precise
        .iter()
        .map(|e| e.mtime_ns.saturating_add(window))
        .max()
        .unwrap_or(0);
    let wait = until.saturating_sub(now_ns());
    if wait > SETTLE_MAX_WAIT_NS {
        let mut all = coarse;
        all.extend(precise.into_iter().map(|e| e.path.clone()));
        return (listed, Vec::new(), all);
    }
    if wait > 0 {
        // One more millisecond: the timer may fire a little early on the coarse clock.
        tokio::time::sleep(std::time::Duration::from_nanos(wait as u64 + 1_000_000)).await;
    }
    let settled = precise.into_iter().map(|e| e.path.clone()).collect();
    (now_ns(), settled, coarse)
}

/// Store `manifest` and describe the new snapshot.
async fn finish_take(
    spec: &SnapshotSpec,
    ns: &str,
    manifest: Manifest,
    data_bytes: u64,
    files_hashed: u64,
    projection_hash: Option<String>,
) -> Result<TakeOutcome> {
    let id = manifest.header.id.clone();
    let bytes = manifest.to_bytes();
    let manifest_key = manifest_key(ns, &id)?;
    let manifest_blake3 = blake3::hash(&bytes).to_hex().to_string();
    let manifest_size = bytes.len() as u64;
    spec.store.put_bytes(&manifest_key, bytes.into()).await?;
    let snapshot = SnapshotRef {
        id,
        format: spec.format,
        manifest: manifest_key,
        manifest_size,
        manifest_blake3,
        size: data_bytes + manifest_size,
        created_unix_ms: manifest.header.started_ns / 1_000_000,
        parent: manifest.header.parent.clone(),
        projection_hash,
    };
    Ok(TakeOutcome {
        bytes_written: snapshot.size,
        snapshot,
        manifest: Arc::new(manifest),
        unchanged: false,
        files_hashed,
        files_settled: 0,
    })
}

/// [`SnapshotFormat::Native`]: the platform snapshots the box; the manifest records its
/// reference.
async fn take_native(
    handle: &dyn BoxHandle,
    spec: &SnapshotSpec,
    request: TakeRequest,
    started_ns: i64,
) -> Result<TakeOutcome> {
    let reference = handle.native_snapshot().await?;
    if !NativeRef::valid_reference(&reference) {
        return Err(Error::backend(
            handle.backend(),
            "native snapshot",
            "the platform returned an unusable snapshot reference",
        ));
    }
    let header = Header {
        version: MANIFEST_VERSION,
        id: uuid::Uuid::now_v7().to_string(),
        parent: request.parent.as_ref().map(|(r, _)| r.id.clone()),
        format: SnapshotFormat::Native,
        started_ns,
        entries: 0,
        archive: None,
        native: Some(NativeRef {
            backend: handle.backend().to_owned(),
            reference,
        }),
    };
    let manifest = Manifest {
        header,
        entries: Vec::new(),
    };
    finish_take(
        spec,
        &request.namespace,
        manifest,
        0,
        0,
        request.projection_hash,
    )
    .await
}

/// Replace the workspace of `handle` with `snapshot`, keeping the live paths in `keep`.
/// Returns the verified manifest.
///
/// With `reuse_live` (for backends whose `export` can run while an `import` streams, see
/// [`crate::Capabilities::concurrent_transfers`]), a chunked snapshot's files that the live
/// workspace already holds are read from the box instead of fetched.
///
/// Any failure (missing blob, digest mismatch, truncation, a manifest mismatch, an unsafe
/// entry, a backend error) is [`Error::RestoreIncomplete`] and leaves the live workspace as
/// it was.
pub async fn restore(
    handle: &dyn BoxHandle,
    spec: &SnapshotSpec,
    snapshot: &SnapshotRef,
    keep: Vec<RelPath>,
    reuse_live: bool,
) -> Result<Arc<Manifest>> {
    let incomplete = |reason: &str, source: Error| Error::RestoreIncomplete {
        snapshot: snapshot.id.clone(),
        reason: format!("{reason}: {source}"),
        source: Some(Box::new(source)),
    };
    let manifest = load_manifest(spec, snapshot)
        .await
        .map_err(|e| incomplete("cannot read the manifest", e))?;
    if let Some(native) = &manifest.header.native {
        if native.backend != handle.backend() {
            return Err(incomplete(
                "a native snapshot restores only on its own platform",
                Error::invalid(
                    "snapshot",
                    format!(
                        "taken on `{}`, restoring on `{}`",
                        native.backend,
                        handle.backend()
                    ),
                ),
            ));
        }
        handle
            .restore_native(&native.reference)
            .await
            .map_err(|e| incomplete("the platform could not restore its snapshot", e))?;
        return Ok(manifest);
    }
    if reuse_live && snapshot.format == SnapshotFormat::Chunked {
        // Files the live workspace already has are read from the box, not fetched.
        let reuse = chunked::reusable(handle, &manifest).await;
        if !reuse.is_empty() {
            let request = crate::backend::ExportRequest {
                paths: Some(reuse.clone()),
                ..Default::default()
            };
            let attempt = match handle.export(&request).await {
                Ok(live) => {
                    let archive = chunked::restore_stream(
                        spec,
                        manifest.clone(),
                        reuse.iter().cloned().collect(),
                        Some(live),
                    );
                    handle
                        .import(
                            archive,
                            crate::backend::ImportMode::Replace { keep: keep.clone() },
                        )
                        .await
                }
                Err(e) => Err(e),
            };
            match attempt {
                Ok(()) => {
                    tracing::info!(
                        reused = reuse.len(),
                        "restored, reading unchanged files from the live workspace"
                    );
                    return Ok(manifest);
                }
                Err(e) => {
                    tracing::warn!(error = %e, "restore reusing live files failed; fetching everything")
                }
            }
        }
    }
    let archive = match snapshot.format {
        SnapshotFormat::Tar => tar_format::restore_stream(spec, &manifest).await,
        SnapshotFormat::Chunked => Ok(chunked::restore_stream(
            spec,
            manifest.clone(),
            Default::default(),
            None,
        )),
        SnapshotFormat::Native => Err(Error::unsafe_archive(
            "manifest",
            "a native snapshot without a platform reference",
        )),
    }
    .map_err(|e| incomplete("cannot read the archive", e))?;
    handle
        .import(archive, crate::backend::ImportMode::Replace { keep })
        .await
        .map_err(|e| incomplete("the archive was rejected", e))?;
    Ok(manifest)
}

/// Fetch and verify a snapshot's manifest.
pub async fn load_manifest(spec: &SnapshotSpec, snapshot: &SnapshotRef) -> Result<Arc<Manifest>> {
    let limit = usize::try_from(snapshot.manifest_size)
        .unwrap_or(usize::MAX)
        .min(1 << 30);
    let bytes = stream::collect(spec.store.get(&snapshot.manifest).await?, limit).await?;
    let got = blake3::hash(&bytes).to_hex().to_string();
    if bytes.len() as u64 != snapshot.manifest_size || got != snapshot.manifest_blake3 {
        return Err(Error::unsafe_archive(
            "manifest",
            format!(
                "digest {got} ({} bytes) differs from the recorded one",
                bytes.len()
            ),
        ));
    }
    let policy = spec.policy;
    let manifest = tokio::task::spawn_blocking(move || Manifest::read_from(&bytes[..], &policy))
        .await
        .map_err(|e| Error::backend("core", "manifest", e.to_string()))??;
    if manifest.header.id != snapshot.id || manifest.header.format != snapshot.format {
        return Err(Error::unsafe_archive(
            "manifest",
            "belongs to another snapshot",
        ));
    }
    Ok(Arc::new(manifest))
}

/// After a restore, the live tree's metadata (new inodes, restored mtimes) with the verified
/// hashes: the baseline the next `take` compares against, so an unchanged restored workspace
/// is not snapshotted again.
pub async fn baseline_after_restore(
    handle: &dyn BoxHandle,
    manifest: &Manifest,
) -> Result<Arc<Manifest>> {
    if manifest.header.native.is_some() {
        return Ok(Arc::new(manifest.clone())); // the next native snapshot compares nothing
    }
    let live = handle.list().await?;
    let index = manifest.index();
    let mut entries = Vec::with_capacity(manifest.entries.len());
    for e in &live {
        let Some(m) = index.get(&e.path) else {
            continue;
        };
        if m.kind != e.kind || (e.kind == EntryType::File && m.size != e.size) {
            continue; // not what was restored: leave it out so it counts as changed
        }
        let mut entry = (*m).clone();
        entry.mtime_ns = e.mtime_ns;
        entry.inode = e.inode;
        entry.mode = e.mode;
        entries.push(entry);
    }
    entries.sort_by(|a, b| a.path.cmp(&b.path));
    let mut header = manifest.header.clone();
    header.entries = entries.len() as u64;
    header.started_ns = now_ns();
    Ok(Arc::new(Manifest { header, entries }))
}

/// The comparison of a listing with the parent manifest.
pub(crate) struct Plan {
    /// Entries in path order; files to be read have `hash: None`.
    pub entries: Vec<ManifestEntry>,
    /// Files to read: new, changed, or suspect.
    pub changed: Vec<RelPath>,
    /// Of `changed`, the files that may well be unchanged: same kind, size and mode as in the
    /// parent, but another mtime or inode (touched, rewritten identically, or seen with a
    /// different timestamp precision after a box restart), or "racy" (modified too close to
    /// the parent's listing to trust an equal mtime). Their content decides.
    pub suspects: Vec<RelPath>,
    /// Something differs from the parent beyond suspects: a path added or removed, a kind,
    /// mode, size or link target changed.
    pub structural: bool,
}

impl Plan {
    fn new(live: &[TreeEntry], parent: Option<&Manifest>) -> Plan {
        let index = parent.map(Manifest::index).unwrap_or_default();
        let started = parent.map_or(i64::MAX, |m| m.header.started_ns);
        let racy = |mtime_ns: i64| is_racy(mtime_ns, started);
        let mut entries = Vec::with_capacity(live.len());
        let mut changed = Vec::new();
        let mut suspects = Vec::new();
        let mut structural = parent.is_none_or(|m| m.entries.len() != live.len());
        for e in live {
            let file = e.kind == EntryType::File;
            match index.get(&e.path) {
                Some(p) if p.same_metadata(e) && !(file && racy(e.mtime_ns)) => {
                    let mut reused = (*p).clone();
                    reused.inode = e.inode;
                    entries.push(reused);
                }
                Some(p)
                    if file
                        && p.kind == EntryType::File
                        && p.size == e.size
                        && p.mode == e.mode =>
                {
                    suspects.push(e.path.clone());
                    changed.push(e.path.clone());
                    entries.push(ManifestEntry::from_tree(e));
                }
                _ => {
                    structural = true;
                    if file {
                        changed.push(e.path.clone());
                    }
                    entries.push(ManifestEntry::from_tree(e));
                }
            }
        }
        entries.sort_by(|a, b| a.path.cmp(&b.path));
        Plan {
            entries,
            changed,
            suspects,
            structural,
        }
    }
}

/// Whether a file whose mtime is `mtime_ns` could have been rewritten, to the same size and
/// mtime, after a listing that started at `listed_ns`. An mtime in whole seconds comes from a
/// clock (or a writer: an archive upload sets it from a tar header) with one-second
/// granularity, so any write up to a second after it would show the same mtime.
fn is_racy(mtime_ns: i64, listed_ns: i64) -> bool {
    let window = racy_window_ns();
    mtime_ns + granularity_ns(mtime_ns) >= listed_ns.saturating_sub(window)
}

/// How far past `mtime_ns` a write could still show that same mtime: a second for an mtime in
/// whole seconds, else nothing beyond the coarse clock's tick (in the racy window).
fn granularity_ns(mtime_ns: i64) -> i64 {
    const SECOND: i64 = 1_000_000_000;
    if mtime_ns % SECOND == 0 { SECOND } else { 0 }
}

/// Files modified this close to (or after) the parent's listing are re-hashed even when their
/// metadata matches: a write in the same timestamp tick as the listing would be invisible
/// otherwise (git's "racy" entries). File timestamps come from the kernel's coarse clock, so
/// the window is twice its resolution, clamped to 2..50 ms.
fn racy_window_ns() -> i64 {
    static WINDOW: std::sync::OnceLock<i64> = std::sync::OnceLock::new();
    *WINDOW.get_or_init(|| {
        let res = nix::time::clock_getres(nix::time::ClockId::CLOCK_REALTIME_COARSE)
            .map(|t| t.tv_sec() * 1_000_000_000 + t.tv_nsec())
            .unwrap_or(25_000_000);
        (2 * res).clamp(2_000_000, 50_000_000)
    })
}

/// Hash the content of `paths` in the box (one export).
async fn hash_files(
    handle: &dyn BoxHandle,
    ctx_request: crate::backend::ExportRequest,
    policy: ArchivePolicy,
) -> Result<std::collections::HashMap<RelPath, (String, u64)>> {
    let exported = handle.export(&ctx_request).await?;
    tokio::task::spawn_blocking(move || {
        let mut reader = stream::blocking_reader(exported);
        let mut out = std::collections::HashMap::new();
        let mut validator = crate::archive::Validator::new(policy);
        let mut archive = tar::Archive::new(&mut reader);
        for entry in archive.entries().map_err(|e| Error::io("export", e))? {
            let mut entry = entry.map_err(|e| Error::io("export", e))?;
            if let Some(crate::archive::Checked::File { path, size }) = validator.check(&entry)? {
                let mut hasher = blake3::Hasher::new();
                let n = std::io::copy(&mut entry, &mut hasher)
                    .map_err(|e| Error::io(path.as_str(), e))?;
                if n == size {
                    out.insert(path, (hasher.finalize().to_hex().to_string(), size));
                }
            }
        }
        std::io::copy(&mut reader, &mut std::io::sink()).map_err(|e| Error::io("export", e))?;
        Ok(out)
    })
    .await
    .map_err(|e| Error::backend("core", "hashing", e.to_string()))?
}

/// Shared inputs of a format's `take`.
pub(crate) struct TakeContext<'a> {
    pub spec: &'a SnapshotSpec,
    pub id: &'a str,
    pub namespace: &'a str,
    pub started_ns: i64,
    pub excludes: &'a Excludes,
    pub exclude: Vec<RelPath>,
    pub exclude_globs: Vec<String>,
    pub parent_id: Option<String>,
}

impl TakeContext<'_> {
    fn header(&self, entries: u64, archive: Option<ArchiveInfo>) -> Header {
        Header {
            version: MANIFEST_VERSION,
            id: self.id.to_owned(),
            parent: self.parent_id.clone(),
            format: self.spec.format,
            started_ns: self.started_ns,
            entries,
            archive,
            native: None,
        }
    }
}

impl SnapshotRef {
    /// The namespace the snapshot lives in (`snapshots/<namespace>/<id>.manifest`).
    pub fn namespace(&self) -> Option<&str> {
        self.manifest.as_str().split('/').nth(1)
    }
}

/// The manifest blob key of snapshot `id` in namespace `ns`.
pub fn manifest_key(ns: &str, id: &str) -> Result<BlobKey> {
    BlobKey::new(format!("snapshots/{ns}/{id}.manifest"))
}

/// The archive blob key of tar-format snapshot `id` in namespace `ns`.
pub fn archive_key(ns: &str, id: &str) -> Result<BlobKey> {
    BlobKey::new(format!("snapshots/{ns}/{id}.tar"))
}

/// The blob key of a chunk.
pub fn chunk_key(hash: &str) -> Result<BlobKey> {
    BlobKey::new(format!("chunks/{}/{hash}", &hash[..2]))
}

fn now_ns() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_nanos()).unwrap_or(i64::MAX))
}

/// Default grace period for [`gc`]: chunks younger than this are never swept, so a snapshot in
/// progress (whose manifest is not written yet) keeps its chunks.
pub const DEFAULT_GC_GRACE: Duration = Duration::from_secs(3600);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn whole_second_mtimes_are_racy_for_a_second() {
        let listed = 1_700_000_000_500_000_000; // half a second into a second
        let window = racy_window_ns();
        // Precise mtimes: racy only within the coarse-clock window of the listing.
        assert!(!is_racy(listed - window - 1_000_000, listed));
        assert!(is_racy(listed - window + 1, listed));
        // Whole seconds: a rewrite in the listing's second shows the same mtime.
        assert!(is_racy(1_700_000_000_000_000_000, listed));
        assert!(!is_racy(1_699_999_998_000_000_000, listed));
    }
}
