//! Housekeeping without an operator: an opt-in background task
//! ([`SandboxManagerBuilder::housekeeping`](crate::SandboxManagerBuilder::housekeeping)) that
//! runs [`SandboxManager::gc`](crate::SandboxManager::gc) — parked and crashed boxes, box
//! leftovers, and (optionally) the snapshot store with its leftovers — every
//! [`HousekeepingOptions::every`], with bounded work per run.
//!
//! Each run logs one line at info (what it removed, what it left for the next run) and
//! publishes its [`HousekeepingRun`] to [`SandboxManager::housekeeping`](crate::SandboxManager::housekeeping).
//! Replicas sharing a guard take turns: a run first takes the reserved key
//! [`housekeeping_key`] through the configured guard without waiting, and a replica that finds
//! it held skips that run ([`HousekeepingOutcome::Busy`]). The task ends when the last handle
//! of its manager is dropped.

use std::time::Duration;

use tokio::sync::watch;
use tokio_util::sync::{CancellationToken, DropGuard};

use crate::isolation::IsolationKey;
use crate::manager::{BoxGcOptions, BoxGcReport, SandboxManager, WeakManager};
use crate::snapshot::GcOptions;

/// Options of the housekeeping task.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct HousekeepingOptions {
    /// Time between runs (the first run comes one period after the manager is built).
    /// Default 10 min.
    pub every: Duration,
    /// What a run passes to [`SandboxManager::gc`] for boxes (`older_than`: the boxes' and box
    /// leftovers' grace). Its `snapshots` and `max_removals` are set from the fields below.
    /// Default [`BoxGcOptions::default`].
    pub box_gc: BoxGcOptions,
    /// Also collect the snapshot store (and its leftovers) with these options; `keep_last`
    /// is always the snapshot spec's, so housekeeping retains what calls retain. Skipped when
    /// snapshots are off. Default `Some(GcOptions::default())`; `None` leaves snapshots alone.
    pub snapshots: Option<GcOptions>,
    /// At most this many removals of each kind per run — boxes with box leftovers, and the
    /// snapshot collection's deletions; the rest wait for the next run. Default 1000.
    pub max_removals_per_run: usize,
}

impl Default for HousekeepingOptions {
    fn default() -> Self {
        HousekeepingOptions {
            every: Duration::from_secs(600),
            box_gc: BoxGcOptions::default(),
            snapshots: Some(GcOptions::default()),
            max_removals_per_run: 1000,
        }
    }
}

impl HousekeepingOptions {
    /// Set the period.
    pub fn every(mut self, every: Duration) -> Self {
        self.every = every;
        self
    }

    /// Set the box collection's options.
    pub fn box_gc(mut self, options: BoxGcOptions) -> Self {
        self.box_gc = options;
        self
    }

    /// Set (or, with `None`, turn off) the snapshot collection.
    pub fn snapshots(mut self, options: Option<GcOptions>) -> Self {
        self.snapshots = options;
        self
    }

    /// Bound the removals per run.
    pub fn max_removals_per_run(mut self, n: usize) -> Self {
        self.max_removals_per_run = n;
        self
    }
}

/// One run of the housekeeping task.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct HousekeepingRun {
    /// Runs of this task so far, this one included (from 1).
    pub run: u64,
    /// When the run ended, ms since the epoch.
    pub finished_unix_ms: i64,
    /// What it did.
    pub outcome: HousekeepingOutcome,
}

/// What one housekeeping run did.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum HousekeepingOutcome {
    /// It collected: what [`SandboxManager::gc`] reported.
    Done(Box<BoxGcReport>),
    /// Another replica (or process) held [`housekeeping_key`]: nothing was done.
    Busy,
    /// The collection failed (the message; the next run tries again).
    Failed(String),
}

/// The reserved key housekeeping runs of `backend` hold through the guard while they run. No
/// call resolves to it.
pub fn housekeeping_key(backend: &str) -> IsolationKey {
    IsolationKey::reserved(&format!("housekeeping-{backend}"))
}

/// A running task, owned by the manager: dropping it stops the task.
pub(crate) struct Running {
    _stop: DropGuard,
    runs: watch::Receiver<Option<HousekeepingRun>>,
}

impl Running {
    pub(crate) fn runs(&self) -> watch::Receiver<Option<HousekeepingRun>> {
        self.runs.clone()
    }
}

/// Start the task for the manager `weak` points at (on the current runtime).
pub(crate) fn spawn(
    weak: WeakManager,
    options: HousekeepingOptions,
    runtime: &tokio::runtime::Handle,
) -> Running {
    let stop = CancellationToken::new();
    let (tx, runs) = watch::channel(None);
    let stopped = stop.clone();
    runtime.spawn(async move {
        for run in 1u64.. {
            tokio::select! {
                () = stopped.cancelled() => return,
                () = tokio::time::sleep(options.every) => {}
            }
            let Some(manager) = weak.upgrade() else {
                return;
            };
            let outcome = run_once(&manager, &options).await;
            drop(manager);
            log(run, &outcome);
            let finished_unix_ms = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_millis() as i64);
            tx.send_replace(Some(HousekeepingRun {
                run,
                finished_unix_ms,
                outcome,
            }));
        }
    });
    Running {
        _stop: stop.drop_guard(),
        runs,
    }
}

async fn run_once(manager: &SandboxManager, options: &HousekeepingOptions) -> HousekeepingOutcome {
    let key = housekeeping_key(manager.client().backend());
    let lease = match manager.guard().try_enter(&key).await {
        Ok(Some(lease)) => lease,
        Ok(None) => return HousekeepingOutcome::Busy,
        Err(e) => return HousekeepingOutcome::Failed(e.to_string()),
    };
    let spec = &manager.config().snapshots;
    let mut gc = options.box_gc.max_removals(options.max_removals_per_run);
    gc.snapshots = options.snapshots.filter(|_| spec.enabled()).map(|s| {
        s.keep_last(spec.keep_last)
            .max_deletions(options.max_removals_per_run)
    });
    let outcome = match manager.gc(gc).await {
        Ok(report) => HousekeepingOutcome::Done(Box::new(report)),
        Err(e) => HousekeepingOutcome::Failed(e.to_string()),
    };
    drop(lease);
    outcome
}

fn log(run: u64, outcome: &HousekeepingOutcome) {
    match outcome {
        HousekeepingOutcome::Done(r) => {
            let s = r.snapshots.clone().unwrap_or_default();
            let store_leftovers = s.leftovers.clone().unwrap_or_default();
            tracing::info!(
                run,
                boxes_removed = r.boxes_removed.len(),
                boxes_in_use = r.boxes_in_use,
                boxes_deferred = r.deferred,
                box_leftovers_removed = r.leftovers.removed,
                snapshots_deleted = s.snapshots_deleted,
                chunks_deleted = s.chunks_deleted,
                packs_deleted = s.packs_deleted,
                packs_repacked = s.packs_repacked,
                bytes_freed =
                    s.chunk_bytes_freed + s.pack_bytes_freed + store_leftovers.bytes_freed,
                store_leftovers_removed = store_leftovers.removed,
                snapshot_deletions_deferred = s.deferred,
                "housekeeping: run done"
            );
        }
        HousekeepingOutcome::Busy => {
            tracing::info!(run, "housekeeping: another replica is running it; skipped");
        }
        HousekeepingOutcome::Failed(error) => {
            tracing::warn!(run, %error, "housekeeping: run failed");
        }
    }
}
