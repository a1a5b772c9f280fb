//! Crash leftovers: what a process killed mid-way leaves behind where only it would have
//! removed it — a local store's temporary blob files, a backend's half-created or
//! half-removed box directories — and the bounded sweep that reclaims them
//! ([`SnapshotStore::sweep_leftovers`](crate::SnapshotStore::sweep_leftovers),
//! [`SandboxClient::sweep_leftovers`](crate::SandboxClient::sweep_leftovers)).
//!
//! A leftover is reclaimed only once it is older than the sweep's grace period: another
//! process (a replica on this host, or on another host sharing the directory) may still be at
//! work on it, and only its age says it is not. Leftovers this process is still writing are
//! never reclaimed, whatever their age.

use std::time::{Duration, SystemTime};

/// What a sweep of crash leftovers may remove.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct LeftoverSweep {
    /// Leftovers younger than this (by their last modification) are kept: a writer in another
    /// process may still be using them. It must exceed the longest stall of a write (an
    /// upload whose input stops for a while). Default [`DEFAULT_GC_GRACE`](crate::snapshot::DEFAULT_GC_GRACE).
    pub grace: Duration,
    /// At most this many leftovers are removed by one sweep; the rest are counted in
    /// [`LeftoverReport::deferred`] and left for the next. Default 10 000.
    pub max_removals: usize,
    /// Report what would be removed without removing anything.
    pub dry_run: bool,
}

impl Default for LeftoverSweep {
    fn default() -> Self {
        LeftoverSweep {
            grace: crate::snapshot::DEFAULT_GC_GRACE,
            max_removals: 10_000,
            dry_run: false,
        }
    }
}

impl LeftoverSweep {
    /// Set the grace period.
    pub fn grace(mut self, grace: Duration) -> Self {
        self.grace = grace;
        self
    }

    /// Set the bound on removals per sweep.
    pub fn max_removals(mut self, n: usize) -> Self {
        self.max_removals = n;
        self
    }

    /// Only report.
    pub fn dry_run(mut self, dry_run: bool) -> Self {
        self.dry_run = dry_run;
        self
    }

    /// Whether something last modified at `modified` is past the grace period (`None`, an
    /// unknown time, never is; a time in the future neither).
    pub fn is_past_grace(&self, modified: Option<SystemTime>) -> bool {
        modified
            .and_then(|m| SystemTime::now().duration_since(m).ok())
            .is_some_and(|age| age >= self.grace)
    }
}

/// What a sweep removed (or would, in a dry run) and what it left.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct LeftoverReport {
    /// Leftovers removed.
    pub removed: usize,
    /// Bytes they held (as far as the store or backend knows).
    pub bytes_freed: u64,
    /// Leftovers kept because they are younger than the grace period.
    pub in_grace: usize,
    /// Leftovers kept because this process is still writing them.
    pub in_use: usize,
    /// Leftovers past the grace period left for a later sweep ([`LeftoverSweep::max_removals`]).
    pub deferred: usize,
    /// Leftovers that could not be removed (logged at warn); a later sweep tries again.
    pub failed: usize,
}

impl LeftoverReport {
    /// Add `other`'s counts to this one.
    pub fn add(&mut self, other: &LeftoverReport) {
        self.removed += other.removed;
        self.bytes_freed += other.bytes_freed;
        self.in_grace += other.in_grace;
        self.in_use += other.in_use;
        self.deferred += other.deferred;
        self.failed += other.failed;
    }

    /// Whether the sweep found nothing at all.
    pub fn is_empty(&self) -> bool {
        *self == LeftoverReport::default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn grace_is_by_age_and_unknown_times_are_kept() {
        let sweep = LeftoverSweep::default().grace(Duration::from_secs(60));
        let now = SystemTime::now();
        assert!(!sweep.is_past_grace(None));
        assert!(!sweep.is_past_grace(Some(now)));
        assert!(!sweep.is_past_grace(Some(now + Duration::from_secs(3600))));
        assert!(sweep.is_past_grace(Some(now - Duration::from_secs(61))));
        assert!(
            LeftoverSweep::default()
                .grace(Duration::ZERO)
                .is_past_grace(Some(now))
        );
    }
}
