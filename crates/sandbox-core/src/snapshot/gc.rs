//! Retention and garbage collection.
//!
//! Retention ([`retain`], run by the manager after a state save succeeded) keeps the newest
//! `keep_last` manifests of one namespace and the one the saved state references, and deletes
//! older manifests with their tar archives. It never touches chunks. Because it runs only after
//! the save, a snapshot is retired only once its successor's manifest exists and a state points
//! at it.
//!
//! [`gc`] is mark-and-sweep over the whole store with a grace period, safe while other keys
//! are being snapshotted:
//! 1. list every chunk (with its age) *first*;
//! 2. apply retention to every namespace — never to a snapshot a stored state references
//!    (states are listed) — then read every remaining manifest and mark the chunks they
//!    reference;
//! 3. list the manifests again, and again, marking every one not seen before, until none is
//!    new: a snapshot that reused an old chunk of its parent, whose parent was then retired
//!    before step 2 read it, is found this way (retirement follows the successor's manifest);
//! 4. delete chunks that are unmarked *and* older than the grace period.
//!
//! A snapshot in progress has uploaded chunks but not yet its manifest; its new chunks are
//! younger than the grace period (the chunked format re-writes every chunk its parent did not
//! have, refreshing its age), so they survive; the old chunks it reuses are marked through its
//! parent or, once that is retired, through itself (step 3). The grace period must exceed the
//! longest snapshot. Reference counting was rejected: it needs an atomic read-modify-write per
//! chunk on every store (Redis, S3, a directory), turning one upload into several round trips,
//! and a crash between the count and the write leaks or, worse, frees a live chunk.

use std::collections::{BTreeMap, HashSet};
use std::time::Duration;

use super::manifest::Manifest;
use super::{BlobKey, SnapshotStore, SnapshotStoreExt as _};
use crate::archive::ArchivePolicy;
use crate::error::{Error, Result};
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
}

impl Default for GcOptions {
    fn default() -> Self {
        GcOptions {
            keep_last: 5,
            grace: super::DEFAULT_GC_GRACE,
            dry_run: false,
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

async fn delete_snapshot(store: &dyn SnapshotStore, manifest: &BlobKey) -> Result<()> {
    let archive = manifest.as_str().trim_end_matches(".manifest").to_owned() + ".tar";
    store.delete(&BlobKey::new(archive)?).await?;
    store.delete(manifest).await
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
) -> Result<usize> {
    let all = manifests(store).await?;
    let Some(keys) = all.get(ns) else {
        return Ok(0);
    };
    let doomed = excess(keys, keep_last, pinned);
    for key in &doomed {
        delete_snapshot(store, key).await?;
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

/// Read `key` and mark its chunks live. `false` if it is gone (retired meanwhile).
async fn mark(
    store: &dyn SnapshotStore,
    policy: &ArchivePolicy,
    key: &BlobKey,
    live: &mut HashSet<String>,
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
    for entry in &manifest.entries {
        live.extend(entry.chunks.iter().map(|c| c.hash.clone()));
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
    let mut report = GcReport::default();
    // 1. Chunks first: anything uploaded after this listing is not a candidate.
    let chunks = store.list_all("chunks/").await?;
    // 2. Retention, then mark.
    let (pinned, pinned_namespaces) = state_pins(states).await?;
    let mut live: HashSet<String> = HashSet::new();
    let mut seen: HashSet<BlobKey> = HashSet::new();
    for (ns, keys) in &manifests(store).await? {
        let doomed: HashSet<&BlobKey> = if pinned_namespaces.contains(ns) {
            HashSet::new()
        } else {
            excess(keys, options.keep_last, &pinned)
                .into_iter()
                .collect()
        };
        for key in keys {
            seen.insert(key.clone());
            if doomed.contains(key) {
                if !options.dry_run {
                    delete_snapshot(store, key).await?;
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
        if live.contains(hash) {
            report.chunks_live += 1;
        } else if chunk.modified_unix.is_none_or(|m| m > cutoff) {
            report.chunks_in_grace += 1;
        } else {
            if !options.dry_run {
                store.delete(&chunk.key).await?;
            }
            report.chunks_deleted += 1;
            report.chunk_bytes_freed += chunk.size;
        }
    }
    Ok(report)
}
