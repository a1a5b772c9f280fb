//! Retention and garbage collection.
//!
//! Retention ([`retain`], after every snapshot) keeps the newest `keep_last` manifests of one
//! namespace and deletes older manifests with their tar archives. It never touches chunks.
//!
//! [`gc`] is mark-and-sweep over the whole store with a grace period, safe while other keys
//! are being snapshotted:
//! 1. list every chunk (with its age) *first*;
//! 2. apply retention to every namespace, then read every remaining manifest and mark the
//!    chunks they reference;
//! 3. delete chunks that are unmarked *and* older than the grace period.
//!
//! A snapshot in progress has uploaded chunks but not yet its manifest; its chunks are younger
//! than the grace period (the chunked format re-writes every chunk it uses that its parent did
//! not have, refreshing its age), so they survive. The grace period must exceed the longest
//! snapshot. Reference counting was rejected: it needs an atomic read-modify-write per chunk on
//! every store (Redis, S3, a directory), turning one upload into several round trips, and a
//! crash between the count and the write leaks or, worse, frees a live chunk.

use std::collections::{BTreeMap, HashSet};
use std::time::Duration;

use super::manifest::Manifest;
use super::{BlobKey, SnapshotStore};
use crate::archive::ArchivePolicy;
use crate::error::{Error, Result};
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
    for blob in store.list("snapshots/").await? {
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

/// Keep the newest `keep_last` snapshots of namespace `ns`; delete the rest.
pub(crate) async fn retain(store: &dyn SnapshotStore, ns: &str, keep_last: usize) -> Result<usize> {
    let all = manifests(store).await?;
    let Some(keys) = all.get(ns) else {
        return Ok(0);
    };
    let excess = keys.len().saturating_sub(keep_last);
    for key in &keys[..excess] {
        delete_snapshot(store, key).await?;
    }
    Ok(excess)
}

/// Retention for every namespace, then sweep unreferenced chunks older than the grace period.
pub async fn gc(
    store: &dyn SnapshotStore,
    policy: &ArchivePolicy,
    options: GcOptions,
) -> Result<GcReport> {
    let mut report = GcReport::default();
    // 1. Chunks first: anything uploaded after this listing is not a candidate.
    let chunks = store.list("chunks/").await?;
    // 2. Retention, then mark.
    let mut live: HashSet<String> = HashSet::new();
    for keys in manifests(store).await?.values() {
        let excess = if options.keep_last == 0 {
            0
        } else {
            keys.len().saturating_sub(options.keep_last)
        };
        for key in &keys[..excess] {
            if !options.dry_run {
                delete_snapshot(store, key).await?;
            }
            report.snapshots_deleted += 1;
        }
        for key in &keys[excess..] {
            let bytes = match store.get(key).await {
                Ok(s) => stream::collect(s, 1 << 30).await?,
                Err(Error::NotFound { .. }) => continue, // deleted meanwhile by its own retention
                Err(e) => return Err(e),
            };
            // A manifest we cannot read may reference anything: refuse to sweep.
            let manifest =
                Manifest::read_from(&bytes[..], policy).map_err(|e| Error::Conflict {
                    key: key.to_string(),
                    reason: format!("unreadable manifest, not sweeping chunks: {e}"),
                })?;
            for entry in &manifest.entries {
                live.extend(entry.chunks.iter().map(|c| c.hash.clone()));
            }
        }
    }
    // 3. Sweep.
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
