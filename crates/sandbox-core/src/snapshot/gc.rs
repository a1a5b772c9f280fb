//! Retention and garbage collection.
//!
//! Retention ([`retain`], run by the manager after a state save succeeded) keeps the newest
//! `keep_last` manifests of one namespace and the one the saved state references, and deletes
//! older manifests with their tar archives. It never touches chunks or packs. Because it runs
//! only after the save, a snapshot is retired only once its successor's manifest exists and a
//! state points at it.
//!
//! [`gc`] is mark-and-sweep over the whole store with a grace period, safe while other keys
//! are being snapshotted:
//! 1. list every chunk blob and every pack and redirect (with their ages) *first*;
//! 2. apply retention to every namespace — never to a snapshot a stored state references
//!    (states are listed) — then read every remaining manifest and mark what it references;
//! 3. list the manifests again, and again, marking every one not seen before, until none is
//!    new: a snapshot that reused an old chunk of its parent, whose parent was then retired
//!    before step 2 read it, is found this way (retirement follows the successor's manifest);
//! 4. delete chunk blobs that are unmarked *and* older than the grace period;
//! 5. resolve every marked pack location (through the redirect of a pack that is gone) and sum
//!    each pack's live bytes; a pack older than the grace period with nothing live is deleted,
//!    one whose live share is below [`GcOptions::repack_below`] is *repacked*: its live chunks
//!    are copied (each checked against its hash) into a new pack, the redirects that pointed
//!    into it are rewritten, its own redirect `packs/<aa>/<id>.moved` is written, and only then
//!    is it deleted;
//! 6. delete redirects that no marked location passes through and that are older than the
//!    grace period.
//!
//! A snapshot in progress has uploaded packs but not yet its manifest; its packs are younger
//! than the grace period (the chunked format writes every chunk its parent did not reference
//! into a new pack), so they survive; the old chunks it reuses are marked through its parent
//! or, once that is retired, through itself (step 3) — and if their pack is repacked meanwhile,
//! the location it carries forward is found again through the redirect, which lives as long as
//! a retained manifest names the old pack. The grace period must exceed the longest snapshot.
//! Reference counting was rejected: it needs an atomic read-modify-write per chunk on every
//! store (Redis, S3, a directory), turning one upload into several round trips, and a crash
//! between the count and the write leaks or, worse, frees a live chunk. Runs of `gc` itself
//! must not overlap (one collector per store).

use std::collections::{BTreeMap, HashMap, HashSet};
use std::time::Duration;

use bytes::Bytes;
use futures::StreamExt as _;

use super::manifest::{ChunkLocation, Header, Manifest, NativeRef};
use super::pack::{
    Coalesce, MAX_REDIRECT_DEPTH, PackBlob, PackId, Piece, RangeRead, Redirect, RedirectEntry,
};
use super::{BlobKey, BlobMeta, SnapshotStore, SnapshotStoreExt as _};
use crate::archive::ArchivePolicy;
use crate::backend::SandboxClient;
use crate::error::{Error, Result};
use crate::leftover::{LeftoverReport, LeftoverSweep};
use crate::state_store::StateStore;
use crate::stream;

/// Options of [`gc`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct GcOptions {
    /// Manifests kept per namespace (0 keeps all).
    pub keep_last: usize,
    /// Chunks younger than this are never deleted.
    pub grace: Duration,
    /// Report what would be deleted without deleting.
    pub dry_run: bool,
    /// A pack older than the grace period whose live bytes are below this percentage of its
    /// size is repacked. `0` never repacks. Default 50.
    pub repack_below: u8,
    /// At most this many deletions per run — leftovers swept, snapshots retired, chunks,
    /// packs (a repack counts as one) and redirects deleted; the rest wait for the next run
    /// ([`GcReport::deferred`]). A snapshot whose retirement is deferred is kept, and so is
    /// everything it references. Default: no bound.
    pub max_deletions: usize,
}

impl Default for GcOptions {
    fn default() -> Self {
        GcOptions {
            keep_last: 5,
            grace: super::DEFAULT_GC_GRACE,
            dry_run: false,
            repack_below: 50,
            max_deletions: usize::MAX,
        }
    }
}

impl GcOptions {
    /// Set the retention.
    pub fn keep_last(mut self, n: usize) -> Self {
        self.keep_last = n;
        self
    }

    /// Set the grace period.
    pub fn grace(mut self, grace: Duration) -> Self {
        self.grace = grace;
        self
    }

    /// Only report.
    pub fn dry_run(mut self, dry_run: bool) -> Self {
        self.dry_run = dry_run;
        self
    }

    /// Repack packs whose live share is below `percent` (0 never repacks; at most 100).
    pub fn repack_below(mut self, percent: u8) -> Self {
        self.repack_below = percent.min(100);
        self
    }

    /// Bound the deletions of one run.
    pub fn max_deletions(mut self, n: usize) -> Self {
        self.max_deletions = n;
        self
    }
}

/// What [`gc`] did (or would do, in a dry run).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct GcReport {
    /// Snapshots (manifest + archive) deleted by retention.
    pub snapshots_deleted: usize,
    /// Chunks deleted.
    pub chunks_deleted: usize,
    /// Bytes of deleted chunks.
    pub chunk_bytes_freed: u64,
    /// Chunks still referenced.
    pub chunks_live: usize,
    /// Unreferenced chunks kept because they are younger than the grace period.
    pub chunks_in_grace: usize,
    /// Packs with live chunks, kept as they are.
    pub packs_live: usize,
    /// Packs kept because they are younger than the grace period.
    pub packs_in_grace: usize,
    /// Packs deleted with nothing live in them.
    pub packs_deleted: usize,
    /// Packs whose live chunks were copied to a new pack before they were deleted.
    pub packs_repacked: usize,
    /// Bytes of deleted and repacked packs, less what the repacks wrote.
    pub pack_bytes_freed: u64,
    /// Redirects some retained manifest still needs.
    pub redirects_live: usize,
    /// Redirects deleted.
    pub redirects_deleted: usize,
    /// Referenced pack locations found nowhere (neither the pack nor a redirect holds them):
    /// snapshots that will not restore. Logged at warn.
    pub locations_missing: usize,
    /// Deletions left for the next run by [`GcOptions::max_deletions`] (leftovers deferred
    /// are counted in [`leftovers`](Self::leftovers) as well).
    pub deferred: usize,
    /// What the store's sweep of crash leftovers did
    /// ([`SnapshotStore::sweep_leftovers`]); `None` where the store cannot sweep them.
    pub leftovers: Option<LeftoverReport>,
}

/// What one run may still delete ([`GcOptions::max_deletions`]).
struct Budget(usize);

impl Budget {
    /// Take one deletion, or count it deferred.
    fn take(&mut self, report: &mut GcReport) -> bool {
        if self.0 == 0 {
            report.deferred += 1;
            false
        } else {
            self.0 -= 1;
            true
        }
    }
}

/// Manifest keys by namespace, oldest first (ids are UUIDv7, so key order is time order).
async fn manifests(store: &dyn SnapshotStore) -> Result<BTreeMap<String, Vec<BlobKey>>> {
    let mut by_ns: BTreeMap<String, Vec<BlobKey>> = BTreeMap::new();
    for blob in store.list_all("snapshots/").await? {
        let key = blob.key.as_str();
        let Some(rest) = key.strip_prefix("snapshots/") else {
            continue;
        };
        let Some((ns, file)) = rest.split_once('/') else {
            continue;
        };
        if file.ends_with(".manifest") {
            by_ns
                .entry(ns.to_owned())
                .or_default()
                .push(blob.key.clone());
        }
    }
    for keys in by_ns.values_mut() {
        keys.sort();
    }
    Ok(by_ns)
}

/// Deletes the platform snapshots of [`SnapshotFormat::Native`](super::SnapshotFormat::Native)
/// manifests that retention or GC removes.
pub type NativeDeleter<'a> = Option<&'a dyn SandboxClient>;

async fn delete_snapshot(
    store: &dyn SnapshotStore,
    manifest: &BlobKey,
    native: NativeDeleter<'_>,
) -> Result<()> {
    if let Some(client) = native
        && let Some(reference) = native_reference(store, manifest).await?
    {
        // The platform snapshot goes first: a manifest whose platform snapshot could not be
        // deleted stays, so a later retention tries again.
        match client.delete_native_snapshot(&reference.reference).await {
            Ok(()) => {}
            Err(Error::NotFound { .. }) => {}
            Err(e) => return Err(e),
        }
    }
    let archive = manifest.as_str().trim_end_matches(".manifest").to_owned() + ".tar";
    store.delete(&BlobKey::new(archive)?).await?;
    store.delete(manifest).await
}

/// The platform reference a manifest records, reading only its first line. `None` for other
/// formats, for a manifest already gone, and for a different backend's.
async fn native_reference(store: &dyn SnapshotStore, key: &BlobKey) -> Result<Option<NativeRef>> {
    let stream = match store.get(key).await {
        Ok(s) => s,
        Err(Error::NotFound { .. }) => return Ok(None),
        Err(e) => return Err(e),
    };
    let head = stream::collect_prefix(stream, 64 * 1024).await?;
    let line = head.split(|b| *b == b'\n').next().unwrap_or_default();
    Ok(serde_json::from_slice::<Header>(line)
        .ok()
        .and_then(|h| h.native)
        .filter(|n| NativeRef::valid_reference(&n.reference)))
}

/// Which manifests of one namespace retention removes: all but the newest `keep_last` and the
/// pinned ones (`keep_last == 0` keeps all).
fn excess<'a>(keys: &'a [BlobKey], keep_last: usize, pinned: &HashSet<String>) -> Vec<&'a BlobKey> {
    if keep_last == 0 {
        return Vec::new();
    }
    let cut = keys.len().saturating_sub(keep_last);
    keys[..cut]
        .iter()
        .filter(|k| !pinned.contains(k.as_str()))
        .collect()
}

/// Keep the newest `keep_last` snapshots of namespace `ns` and those whose manifest key is in
/// `pinned` (what stored states reference); delete the rest. Returns how many were deleted.
pub(crate) async fn retain(
    store: &dyn SnapshotStore,
    ns: &str,
    keep_last: usize,
    pinned: &HashSet<String>,
    native: NativeDeleter<'_>,
) -> Result<usize> {
    let all = manifests(store).await?;
    let Some(keys) = all.get(ns) else {
        return Ok(0);
    };
    let doomed = excess(keys, keep_last, pinned);
    for key in &doomed {
        delete_snapshot(store, key, native).await?;
    }
    Ok(doomed.len())
}

/// What the stored states pin: the manifest key each references, and the namespaces of
/// states that cannot be read (pinned whole: an unreadable state may reference anything).
async fn state_pins(states: &dyn StateStore) -> Result<(HashSet<String>, HashSet<String>)> {
    let mut manifests = HashSet::new();
    let mut namespaces = HashSet::new();
    for key in states.list("").await? {
        let Some(json) = states.load(&key).await? else {
            continue;
        };
        let snapshot = serde_json::from_str::<serde_json::Value>(&json)
            .ok()
            .map(|v| v.pointer("/common/snapshot/manifest").cloned());
        match snapshot {
            Some(Some(serde_json::Value::String(m))) => {
                manifests.insert(m);
            }
            Some(None | Some(serde_json::Value::Null)) => {} // no snapshot yet
            _ => {
                tracing::warn!(key = %key, "unreadable state: keeping every snapshot of its namespace");
                namespaces.insert(key.digest());
            }
        }
    }
    Ok((manifests, namespaces))
}

/// What retained manifests reference.
#[derive(Default)]
struct Marks {
    /// Chunk and bundle blobs (manifest version 1), by hash.
    blobs: HashSet<String>,
    /// Pack pieces: per pack named by a manifest, (offset, len, hash).
    pieces: HashMap<PackId, HashSet<(u64, u64, String)>>,
}

/// Read `key` and mark what it references. `false` if it is gone (retired meanwhile).
async fn mark(
    store: &dyn SnapshotStore,
    policy: &ArchivePolicy,
    key: &BlobKey,
    live: &mut Marks,
) -> Result<bool> {
    let bytes = match store.get(key).await {
        Ok(s) => stream::collect(s, 1 << 30).await?,
        Err(Error::NotFound { .. }) => return Ok(false),
        Err(e) => return Err(e),
    };
    // A manifest we cannot read may reference anything: refuse to sweep.
    let manifest = Manifest::read_from(&bytes[..], policy).map_err(|e| Error::Conflict {
        key: key.to_string(),
        reason: format!("unreadable manifest, not sweeping chunks: {e}"),
    })?;
    for c in manifest.entries.iter().flat_map(|e| e.chunks.iter()) {
        match c.location {
            ChunkLocation::Blob | ChunkLocation::Bundle { .. } => {
                live.blobs.insert(c.hash.clone());
            }
            ChunkLocation::Pack { pack, offset } => {
                live.pieces
                    .entry(pack)
                    .or_default()
                    .insert((offset, c.len, c.hash.clone()));
            }
        }
    }
    Ok(true)
}

/// Retention for every namespace (never deleting what a stored state in `states` references),
/// then sweep unreferenced chunks older than the grace period.
pub async fn gc(
    store: &dyn SnapshotStore,
    policy: &ArchivePolicy,
    options: GcOptions,
    states: &dyn StateStore,
) -> Result<GcReport> {
    gc_with(store, policy, options, states, None).await
}

/// [`gc`], also deleting the platform snapshots of the native-format snapshots it removes
/// (through `native`, the backend's client).
pub async fn gc_with(
    store: &dyn SnapshotStore,
    policy: &ArchivePolicy,
    options: GcOptions,
    states: &dyn StateStore,
    native: NativeDeleter<'_>,
) -> Result<GcReport> {
    let mut report = GcReport::default();
    let mut budget = Budget(options.max_deletions);
    // 0. What killed writers left: referenced by nothing, whatever the manifests say.
    let sweep = LeftoverSweep::default()
        .grace(options.grace)
        .max_removals(budget.0)
        .dry_run(options.dry_run);
    match store.sweep_leftovers(sweep).await {
        Ok(swept) => {
            budget.0 -= swept.removed.min(budget.0);
            report.deferred += swept.deferred;
            report.leftovers = Some(swept);
        }
        Err(Error::NotSupported { .. }) => {
            tracing::debug!(
                store = store.name(),
                "the store cannot sweep crash leftovers"
            );
        }
        Err(e) => return Err(e),
    }
    // 1. Chunks and packs first: anything uploaded after this listing is not a candidate.
    let chunks = store.list_all("chunks/").await?;
    let packed = store.list_all("packs/").await?;
    // 2. Retention, then mark.
    let (pinned, pinned_namespaces) = state_pins(states).await?;
    let mut live = Marks::default();
    let mut seen: HashSet<BlobKey> = HashSet::new();
    for (ns, keys) in &manifests(store).await? {
        let mut doomed: HashSet<&BlobKey> = if pinned_namespaces.contains(ns) {
            HashSet::new()
        } else {
            excess(keys, options.keep_last, &pinned)
                .into_iter()
                .collect()
        };
        // Past the bound, the oldest go first; the others are kept (and marked) this run.
        for key in keys {
            if doomed.contains(key) && !budget.take(&mut report) {
                doomed.remove(key);
            }
        }
        for key in keys {
            seen.insert(key.clone());
            if doomed.contains(key) {
                if !options.dry_run {
                    delete_snapshot(store, key, native).await?;
                }
                report.snapshots_deleted += 1;
            } else {
                mark(store, policy, key, &mut live).await?;
            }
        }
    }
    // 3. A snapshot taken while we marked may reuse chunks of a parent that its own retention
    //    retired before we read it. Every retirement happens after its successor's manifest
    //    is written, so listing again until no new manifest appears finds that successor.
    loop {
        let fresh: Vec<BlobKey> = manifests(store)
            .await?
            .into_values()
            .flatten()
            .filter(|k| !seen.contains(k))
            .collect();
        if fresh.is_empty() {
            break;
        }
        for key in fresh {
            mark(store, policy, &key, &mut live).await?;
            seen.insert(key);
        }
    }
    // 4. Sweep.
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs() as i64);
    let cutoff = now - options.grace.as_secs() as i64;
    for chunk in chunks {
        let hash = chunk.key.as_str().rsplit('/').next().unwrap_or_default();
        if live.blobs.contains(hash) {
            report.chunks_live += 1;
        } else if chunk.modified_unix.is_none_or(|m| m > cutoff) {
            report.chunks_in_grace += 1;
        } else if budget.take(&mut report) {
            if !options.dry_run {
                store.delete(&chunk.key).await?;
            }
            report.chunks_deleted += 1;
            report.chunk_bytes_freed = report.chunk_bytes_freed.saturating_add(chunk.size);
        }
    }
    // 5 and 6. Packs and redirects.
    let old = |m: &BlobMeta| m.modified_unix.is_some_and(|t| t <= cutoff);
    // Packs written since the first listing (by snapshots taken meanwhile) hold pieces too:
    // listed again to resolve locations, never candidates.
    let now_listed = store.list_all("packs/").await?;
    sweep_packs(
        store,
        packed,
        now_listed,
        live.pieces,
        &old,
        options,
        &mut report,
        &mut budget,
    )
    .await?;
    Ok(report)
}

/// Where a marked piece is now: its pack, or where redirects lead (recording each redirect
/// passed through). `None` if nothing holds it.
fn resolve(
    mut pack: PackId,
    mut offset: u64,
    len: u64,
    hash: &str,
    packs: &HashSet<PackId>,
    redirects: &HashMap<PackId, Redirect>,
    used: &mut HashSet<PackId>,
) -> Option<(PackId, u64)> {
    for _ in 0..=MAX_REDIRECT_DEPTH {
        if packs.contains(&pack) {
            return Some((pack, offset));
        }
        let entry = redirects.get(&pack)?.find(hash).filter(|e| e.len == len)?;
        used.insert(pack);
        pack = entry.pack;
        offset = entry.offset;
    }
    None
}

// Step 5 and 6 of one run, with the run's state (report, deletions left) passed in.
#[allow(clippy::too_many_arguments)]
async fn sweep_packs(
    store: &dyn SnapshotStore,
    listed: Vec<BlobMeta>,
    relisted: Vec<BlobMeta>,
    marked: HashMap<PackId, HashSet<(u64, u64, String)>>,
    old: &(dyn Fn(&BlobMeta) -> bool + Sync),
    options: GcOptions,
    report: &mut GcReport,
    budget: &mut Budget,
) -> Result<()> {
    let mut packs: HashMap<PackId, BlobMeta> = HashMap::new();
    let mut redirect_blobs: HashMap<PackId, BlobMeta> = HashMap::new();
    for blob in listed {
        match PackBlob::of_key(blob.key.as_str()) {
            Some(PackBlob::Pack(id)) => {
                packs.insert(id, blob);
            }
            Some(PackBlob::Redirect(id)) => {
                redirect_blobs.insert(id, blob);
            }
            None => {}
        }
    }
    let mut existing: HashSet<PackId> = packs.keys().copied().collect();
    existing.extend(
        relisted
            .iter()
            .filter_map(|b| match PackBlob::of_key(b.key.as_str()) {
                Some(PackBlob::Pack(id)) => Some(id),
                _ => None,
            }),
    );
    let mut redirects: HashMap<PackId, Redirect> = HashMap::new();
    for id in redirect_blobs.keys() {
        match super::chunked::load_redirect(store, *id).await {
            Ok(r) => {
                redirects.insert(*id, r);
            }
            Err(Error::NotFound { .. }) => {}
            // A redirect we cannot read may be what a snapshot needs: refuse to sweep packs.
            Err(e) => {
                return Err(Error::Conflict {
                    key: id.redirect_key().to_string(),
                    reason: format!("unreadable redirect, not sweeping packs: {e}"),
                });
            }
        }
    }
    // Live pieces per existing pack, by hash (one copy each), and the redirects in use.
    let mut live: HashMap<PackId, BTreeMap<(u64, u64), String>> = HashMap::new();
    let mut used: HashSet<PackId> = HashSet::new();
    for (pack, pieces) in marked {
        for (offset, len, hash) in pieces {
            match resolve(pack, offset, len, &hash, &existing, &redirects, &mut used) {
                Some((at, off)) => {
                    live.entry(at).or_default().insert((off, len), hash);
                }
                None => {
                    report.locations_missing += 1;
                    tracing::warn!(pack = %pack, offset, len, "a retained snapshot references a chunk no pack or redirect holds");
                }
            }
        }
    }
    let mut ids: Vec<PackId> = packs.keys().copied().collect();
    ids.sort();
    for id in ids {
        let meta = &packs[&id];
        let pieces = live.remove(&id).unwrap_or_default();
        let live_bytes = pieces
            .keys()
            .fold(0u64, |n, (_, len)| n.saturating_add(*len));
        if !old(meta) {
            report.packs_in_grace += 1;
        } else if pieces.is_empty() {
            if !budget.take(report) {
                continue;
            }
            if !options.dry_run {
                store.delete(&meta.key).await?;
            }
            report.packs_deleted += 1;
            report.pack_bytes_freed = report.pack_bytes_freed.saturating_add(meta.size);
        } else if u128::from(live_bytes) * 100
            < u128::from(meta.size) * u128::from(options.repack_below)
        {
            if !budget.take(report) {
                report.packs_live += 1;
                continue;
            }
            if !options.dry_run {
                match repack(store, id, &pieces, &mut redirects).await {
                    Ok(()) => {}
                    // A damaged pack is left as it is (its snapshots fail their restore loudly).
                    Err(e @ Error::UnsafeArchive { .. }) => {
                        tracing::warn!(pack = %id, error = %e, "not repacking a damaged pack");
                        report.packs_live += 1;
                        continue;
                    }
                    Err(e) => return Err(e),
                }
            }
            report.packs_repacked += 1;
            report.pack_bytes_freed = report
                .pack_bytes_freed
                .saturating_add(meta.size.saturating_sub(live_bytes));
        } else {
            report.packs_live += 1;
        }
    }
    for (id, meta) in redirect_blobs {
        if used.contains(&id) || !old(&meta) {
            report.redirects_live += 1;
        } else if budget.take(report) {
            if !options.dry_run {
                store.delete(&meta.key).await?;
            }
            report.redirects_deleted += 1;
        }
    }
    Ok(())
}

/// Read `reads` of pack `from`, check every piece against its hash and send it on `tx` (the
/// new pack `to`'s upload); returns the pieces' new locations.
async fn copy_pieces(
    store: &dyn SnapshotStore,
    from: PackId,
    to: PackId,
    reads: Vec<RangeRead>,
    tx: &tokio::sync::mpsc::Sender<Result<Bytes>>,
) -> Result<Vec<RedirectEntry>> {
    let mut moved: Vec<RedirectEntry> = Vec::new();
    let mut at = 0u64;
    let source = from.key();
    for read in reads {
        let len = usize::try_from(read.len).unwrap_or(usize::MAX);
        let data = stream::collect_sized(
            store.get_range(&source, read.offset, read.len).await?,
            len,
            len,
        )
        .await?;
        if data.len() != len {
            return Err(Error::unsafe_archive(
                source.as_str(),
                "the pack ends before its live chunks",
            ));
        }
        for p in read.pieces {
            let start = (p.offset - read.offset) as usize;
            let bytes = data.slice(start..start + p.len as usize);
            let hash = blake3::hash(&bytes);
            if hash.to_hex().as_str() != p.hash {
                return Err(Error::unsafe_archive(
                    source.as_str(),
                    format!("chunk at {} differs from its hash: not repacking", p.offset),
                ));
            }
            moved.push(RedirectEntry {
                hash: *hash.as_bytes(),
                pack: to,
                offset: at,
                len: p.len,
            });
            at += p.len;
            if tx.send(Ok(bytes)).await.is_err() {
                return Err(Error::backend("core", "repack", "pack upload stopped"));
            }
        }
    }
    Ok(moved)
}

/// Copy the live `pieces` of pack `from` (offset, len → hash) into a new pack, checking each
/// against its hash; point every redirect that led into `from` at the copies; write `from`'s
/// redirect; then delete `from`. Any failure before the delete leaves `from` as it was.
async fn repack(
    store: &dyn SnapshotStore,
    from: PackId,
    pieces: &BTreeMap<(u64, u64), String>,
    redirects: &mut HashMap<PackId, Redirect>,
) -> Result<()> {
    let to = PackId::generate();
    let coalesce = Coalesce {
        max_gap: 1 << 20,
        max_read: 8 << 20,
    };
    let mut reads: Vec<RangeRead> = Vec::new();
    let mut seen = HashSet::new();
    for ((offset, len), hash) in pieces {
        if seen.insert(hash.clone()) {
            let piece = Piece {
                hash: hash.clone(),
                offset: *offset,
                len: *len,
            };
            coalesce.push(&mut reads, from, piece);
        }
    }
    let (tx, mut rx) = tokio::sync::mpsc::channel::<Result<Bytes>>(4);
    let key = to.key();
    let put = {
        let data = futures::stream::poll_fn(move |cx| rx.poll_recv(cx)).boxed();
        store.put(&key, data, None)
    };
    let copy = async move {
        let r = copy_pieces(store, from, to, reads, &tx).await;
        if let Err(e) = &r {
            // Fail the upload too: no partial pack is stored.
            let _ = tx
                .send(Err(Error::backend("core", "repack", e.to_string())))
                .await;
        }
        r
    };
    let (moved, put) = tokio::join!(copy, put);
    let moved = moved?;
    put?;
    let redirect = Redirect::new(from, moved).map_err(|e| Error::from((from.redirect_key(), e)))?;
    // Redirects that led into `from` now lead to the copy (chains stay one step long).
    for (id, r) in redirects.iter_mut() {
        if !r.entries().iter().any(|e| e.pack == from) {
            continue;
        }
        let entries: Vec<RedirectEntry> = r
            .entries()
            .iter()
            .filter_map(|e| {
                if e.pack != from {
                    return Some(*e);
                }
                redirect
                    .find(&hex::encode(e.hash))
                    .map(|n| RedirectEntry { hash: e.hash, ..*n })
            })
            .collect();
        let rewritten =
            Redirect::new(*id, entries).map_err(|e| Error::from((id.redirect_key(), e)))?;
        store
            .put_bytes(&id.redirect_key(), rewritten.to_bytes().into())
            .await?;
        *r = rewritten;
    }
    store
        .put_bytes(&from.redirect_key(), redirect.to_bytes().into())
        .await?;
    redirects.insert(from, redirect);
    store.delete(&from.key()).await?;
    tracing::info!(from = %from, to = %to, "repacked a pack");
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;
    use crate::snapshot::LocalDirSnapshotStore;
    use crate::state_store::MemoryStateStore;
    use crate::stream::ByteStream;

    /// A store whose listing reports every blob as `u64::MAX` bytes, written at the epoch (an
    /// S3-compatible service under an attacker's control, a corrupt index).
    #[derive(Debug)]
    struct HugeListing(LocalDirSnapshotStore);

    #[async_trait::async_trait]
    impl SnapshotStore for HugeListing {
        fn name(&self) -> &'static str {
            "huge-listing"
        }
        fn reach(&self) -> crate::reach::Reach {
            self.0.reach()
        }
        async fn put(&self, key: &BlobKey, data: ByteStream, size: Option<u64>) -> Result<u64> {
            self.0.put(key, data, size).await
        }
        async fn get(&self, key: &BlobKey) -> Result<ByteStream> {
            self.0.get(key).await
        }
        async fn exists(&self, key: &BlobKey) -> Result<bool> {
            self.0.exists(key).await
        }
        async fn delete(&self, key: &BlobKey) -> Result<()> {
            self.0.delete(key).await
        }
        fn list(&self, prefix: &str) -> crate::snapshot::BlobStream {
            self.0
                .list(prefix)
                .map(|m| m.map(|m| BlobMeta::new(m.key, u64::MAX, Some(0))))
                .boxed()
        }
    }

    /// Sizes from a listing are only added up, saturating: unreferenced chunks and packs of
    /// `u64::MAX` bytes each are swept and reported, never an overflow panic.
    #[tokio::test]
    async fn huge_listed_sizes_are_summed_saturating() {
        let dir = tempfile::tempdir().expect("tempdir");
        let store = Arc::new(HugeListing(LocalDirSnapshotStore::new(dir.path())));
        for n in 0..2u8 {
            let hash = blake3::hash(&[n]).to_hex().to_string();
            let chunk = crate::snapshot::chunk_key(&hash).expect("key");
            store
                .put_bytes(&chunk, vec![n].into())
                .await
                .expect("chunk");
            let pack = PackId::generate().key();
            store.put_bytes(&pack, vec![n].into()).await.expect("pack");
        }
        let options = GcOptions {
            grace: Duration::ZERO,
            ..GcOptions::default()
        };
        let report = gc(
            &*store,
            &ArchivePolicy::default(),
            options,
            &MemoryStateStore::new(),
        )
        .await
        .expect("gc");
        assert_eq!(report.chunk_bytes_freed, u64::MAX, "{report:?}");
        assert_eq!(report.pack_bytes_freed, u64::MAX, "{report:?}");
        assert!(store.list_all("").await.expect("list").is_empty());
    }

    /// `max_deletions` bounds one run — the leftover sweep first, then unreferenced chunks —
    /// and what it leaves is counted deferred and deleted by the next runs.
    #[tokio::test]
    async fn deletions_per_run_are_bounded() {
        let dir = tempfile::tempdir().unwrap();
        let store = LocalDirSnapshotStore::new(dir.path());
        for i in 0..5 {
            let key = BlobKey::new(format!("chunks/aa/{i:064x}")).unwrap();
            store.put_bytes(&key, "chunk".into()).await.unwrap();
        }
        std::fs::write(dir.path().join("chunks/aa/.tmp-1-1-x"), "t").unwrap();
        std::fs::write(dir.path().join(".tmp-1-2-y"), "t").unwrap();
        let states = MemoryStateStore::new();
        let policy = ArchivePolicy::default();
        let options = GcOptions::default().grace(Duration::ZERO).max_deletions(3);
        let first = gc(&store, &policy, options, &states).await.unwrap();
        assert_eq!(first.leftovers.as_ref().map(|l| l.removed), Some(2));
        assert_eq!((first.chunks_deleted, first.deferred), (1, 4), "{first:?}");
        let second = gc(&store, &policy, options, &states).await.unwrap();
        assert_eq!(
            (second.chunks_deleted, second.deferred),
            (3, 1),
            "{second:?}"
        );
        let third = gc(&store, &policy, options, &states).await.unwrap();
        assert_eq!((third.chunks_deleted, third.deferred), (1, 0), "{third:?}");
        assert!(store.list_all("").await.unwrap().is_empty());
    }
}
