//! The call lifecycle, once: [`SandboxManager`].
//!
//! ```text
//! resolve key → guard.enter(key) → store.fence(key, token) → acquire (1 external box ·
//!   2 external state · 3 stored state · 4 new) → start (A/B/C/D + projection)
//!   → [the call] → stop (snapshot) → save state (fenced) → retention → release box → lease
//! ```
//!
//! What holds whatever happens (the invariants, also in ARCHITECTURE.md):
//! - **I1** the stored state always points at a complete, restorable snapshot holding every
//!   write of every call that returned success: a state is saved only after its snapshot is
//!   complete, and older snapshots are retired only after that save (never the one it pins);
//! - **I2** a call never touches another call's box: calls on one key are serialized by the
//!   guard (the default, [`InProcessGuard::global`], serializes the process), and a call
//!   whose lease is lost leaves the box alone;
//! - **I4** a stale lease holder can neither save state nor delete snapshots: its token is
//!   below the fence its successor registered, and it checks its lost signal before it writes;
//! - **I5** once begun, the post-call steps run to completion even if every caller future is
//!   dropped: acquire + start and the post-call steps each run on their own task, so a
//!   cancelled caller never interrupts them half-way. A start whose caller is gone gives the
//!   box and the lease back without saving anything.
//! - **I6** a call cancelled while its closure runs (its future or its [`ActiveCall`] dropped)
//!   is a failed call: its commands are killed and waited for before the box is touched
//!   (`Sandbox::settle`), and by default ([`OnCancel::Discard`]) its work never becomes
//!   current — the key's state stays the previous one, recording the cancellation for the
//!   next call's report; with [`OnCancel::KeepPartial`] the settled box is saved marked
//!   partial, every changed file listed as possibly torn.
//!
//! Priority 1 (a caller-provided box) bypasses the guard; priorities 1 and 2 never write the
//! state store: the caller manages them and keeps the resulting state
//! ([`CallReport::state_json`]).

use std::fmt;
use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::FutureExt as _;
use tokio_util::sync::CancellationToken;
use tracing::Instrument as _;

use crate::backend::SandboxClient;
use crate::error::{Error, Result};
use crate::guard::{InProcessGuard, Lease, SandboxExecutionGuard};
use crate::isolation::{CallContext, IsolationKey, IsolationScope};
use crate::reach::Reach;
use crate::sandbox::{Sandbox, SandboxConfig, StartReport, StopReport};
use crate::snapshot::{self, SnapshotStoreExt as _};
use crate::state::{CancelledCall, CommonState, SandboxState, state_from_json, state_to_json};
use crate::state_store::{MemoryStateStore, StateStore};

/// Where a call's sandbox comes from.
#[derive(Debug, Default)]
pub enum Acquire {
    /// Look the key up in the state store; create a new box when there is nothing (priorities
    /// 3 and 4).
    #[default]
    Auto,
    /// Use this started sandbox as is (priority 1). User-managed: the call stops it (snapshot)
    /// but never shuts it down, does not take the guard and does not persist its state.
    External(Arc<Sandbox>),
    /// Resume exactly this state, e.g. a checkpoint from an earlier call (priority 2).
    /// Self-managed (the key's guard is taken: the box is the key's), but the state store is
    /// neither read nor written.
    State(Box<dyn SandboxState>),
}

/// What becomes of a call's work when its caller leaves while the closure runs (its future,
/// or its [`ActiveCall`], is dropped unfinished).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum OnCancel {
    /// The cancelled call is a failed call: its work never becomes current. Every command it
    /// started is killed first; the key's state stays the one before the call (recording
    /// only that the call was cancelled, for the next call's report), an ephemeral box is
    /// released and a kept box is restored from that state's snapshot at the next start.
    #[default]
    Discard,
    /// Keep what the box holds once every command of the call is dead: it is snapshotted and
    /// saved as the key's state, marked partial ([`CancelledCall::partial`]) with every file
    /// the call changed listed as possibly torn; the next call's report says so.
    KeepPartial,
}

/// Per-call options of [`SandboxManager::call_with_options`] and
/// [`SandboxManager::begin_with`].
#[derive(Debug, Default)]
#[non_exhaustive]
pub struct CallOptions {
    /// Where the sandbox comes from (default: [`Acquire::Auto`]).
    pub acquire: Acquire,
    /// What a cancellation does with the call's work (default: [`OnCancel::Discard`]).
    pub on_cancel: OnCancel,
}

impl CallOptions {
    /// The defaults.
    pub fn new() -> Self {
        CallOptions::default()
    }

    /// Take the sandbox from `source`.
    pub fn acquire(mut self, source: Acquire) -> Self {
        self.acquire = source;
        self
    }

    /// Keep the partial work of this call if its caller leaves ([`OnCancel::KeepPartial`]).
    pub fn keep_partial_work(mut self) -> Self {
        self.on_cancel = OnCancel::KeepPartial;
        self
    }

    /// What a cancellation does with the call's work.
    pub fn on_cancel(mut self, on_cancel: OnCancel) -> Self {
        self.on_cancel = on_cancel;
        self
    }
}

/// Which acquire priority served a call.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum AcquiredFrom {
    /// 1: a caller-provided sandbox.
    External,
    /// 2: a caller-provided state.
    ExternalState,
    /// 3: the state store.
    StateStore,
    /// 4: a new box.
    New,
}

impl AcquiredFrom {
    fn user_managed(self) -> bool {
        self == AcquiredFrom::External
    }

    fn bypasses_store(self) -> bool {
        matches!(self, AcquiredFrom::External | AcquiredFrom::ExternalState)
    }
}

/// What happened during one call.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct CallReport {
    /// The isolation key, if the call had one.
    pub key: Option<String>,
    /// Where the sandbox came from.
    pub acquired_from: AcquiredFrom,
    /// Time to enter the guard and acquire (resume or create) the box.
    pub acquire: Duration,
    /// What `start` did (none for an external sandbox, which is already started).
    pub start: Option<StartReport>,
    /// What `stop` did (none if it failed or was skipped).
    pub stop: Option<StopReport>,
    /// Whether the state was saved to the state store.
    pub persisted: bool,
    /// The box was kept although its persistence would remove it, because its work could
    /// not be saved: the next call on the key finds it (warm start), or `gc` removes it.
    pub parked: bool,
    /// The box's final state JSON (what a caller keeps as a checkpoint). Present even when a
    /// later step failed.
    pub state_json: Option<String>,
    /// The previous call on the key was cancelled while its closure ran (also in
    /// [`StartReport::previous_cancelled`]): by default none of its work is in this call's
    /// workspace; if it opted into keeping partial work
    /// ([`OnCancel::KeepPartial`]), this call started from that work, and the files that may
    /// be torn are listed.
    pub previous_cancelled: Option<CancelledCall>,
    /// Wall time of the whole call.
    pub total: Duration,
}

/// A finished call: the closure's value and the report.
#[derive(Debug)]
#[non_exhaustive]
pub struct Called<T> {
    /// What the closure returned.
    pub value: T,
    /// What the lifecycle did.
    pub report: CallReport,
}

/// A call that failed somewhere in its lifecycle, with everything it still produced: the
/// error, the report (with the state JSON, if the box's state could be serialized) and the
/// closure's value (if the closure ran to its end).
#[non_exhaustive]
pub struct CallError<T = ()> {
    /// The first error.
    pub error: Error,
    /// What the lifecycle did, when it got as far as the post-call steps.
    pub report: Option<CallReport>,
    /// What the closure returned, when it returned.
    pub value: Option<T>,
}

impl<T> CallError<T> {
    fn before_start(error: Error) -> Self {
        CallError {
            error,
            report: None,
            value: None,
        }
    }

    fn with_value<U>(self, value: Option<U>) -> CallError<U> {
        CallError {
            error: self.error,
            report: self.report,
            value,
        }
    }
}

impl<T> fmt::Debug for CallError<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CallError")
            .field("error", &self.error)
            .field("report", &self.report)
            .field("value", &self.value.as_ref().map(|_| ".."))
            .finish()
    }
}

impl<T> fmt::Display for CallError<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(&self.error, f)
    }
}

impl<T> std::error::Error for CallError<T> {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        Some(&self.error)
    }
}

impl<T> From<CallError<T>> for Error {
    fn from(e: CallError<T>) -> Error {
        e.error
    }
}

/// Runs calls against sandboxes of one client, with one config, scope, state store and guard.
#[derive(Clone)]
pub struct SandboxManager {
    inner: Arc<Inner>,
}

struct Inner {
    client: Arc<dyn SandboxClient>,
    states: Arc<dyn StateStore>,
    guard: Arc<dyn SandboxExecutionGuard>,
    scope: IsolationScope,
    config: SandboxConfig,
    /// The housekeeping task, stopped when this is dropped.
    housekeeping: Option<crate::housekeeping::Running>,
}

/// A manager that does not keep it alive (the housekeeping task's).
pub(crate) struct WeakManager(std::sync::Weak<Inner>);

impl WeakManager {
    pub(crate) fn upgrade(&self) -> Option<SandboxManager> {
        self.0.upgrade().map(|inner| SandboxManager { inner })
    }
}

impl fmt::Debug for SandboxManager {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SandboxManager")
            .field("backend", &self.inner.client.backend())
            .field("scope", &self.inner.scope)
            .field("states", &self.inner.states)
            .field("guard", &self.inner.guard)
            .finish_non_exhaustive()
    }
}

/// What a set-up must be good for, checked by [`SandboxManagerBuilder::build`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Requirement {
    /// Nothing checked.
    None,
    /// Survives a restart of this process, and is safe for every process of one host.
    Durable,
    /// Safe for many replicas on many hosts.
    Distributed,
}

/// The parts replicas on several hosts must share, set together by
/// [`SandboxManagerBuilder::distributed`] (the spec's `sandboxDistributed`): a guard whose
/// leases every replica sees, a state store every replica reads, and (optionally) the snapshot
/// store they restore from. Backends with a shared service offer helpers that build one
/// (e.g. from one Redis connection).
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct Distributed {
    /// The execution guard.
    pub guard: Arc<dyn SandboxExecutionGuard>,
    /// The state store.
    pub states: Arc<dyn StateStore>,
    /// Where snapshots go, replacing the config's store; `None` keeps the config's.
    pub snapshots: Option<Arc<dyn crate::snapshot::SnapshotStore>>,
}

impl Distributed {
    /// The guard and the state store; snapshots as configured.
    pub fn new(guard: Arc<dyn SandboxExecutionGuard>, states: Arc<dyn StateStore>) -> Self {
        Distributed {
            guard,
            states,
            snapshots: None,
        }
    }

    /// Snapshots in `store` too.
    pub fn snapshots(mut self, store: Arc<dyn crate::snapshot::SnapshotStore>) -> Self {
        self.snapshots = Some(store);
        self
    }
}

/// Builder for [`SandboxManager`].
#[derive(Debug)]
pub struct SandboxManagerBuilder {
    client: Arc<dyn SandboxClient>,
    states: Arc<dyn StateStore>,
    guard: Arc<dyn SandboxExecutionGuard>,
    scope: IsolationScope,
    config: SandboxConfig,
    require: Requirement,
    /// [`require_isolation`](Self::require_isolation) was called.
    require_isolation: bool,
    /// The snapshot store [`distributed`](Self::distributed) set, applied at build over the
    /// config's (whenever the config is set).
    distributed_snapshots: Option<Arc<dyn crate::snapshot::SnapshotStore>>,
    housekeeping: Option<crate::housekeeping::HousekeepingOptions>,
}

impl SandboxManagerBuilder {
    /// The state store (default: in memory).
    pub fn state_store(mut self, states: Arc<dyn StateStore>) -> Self {
        self.states = states;
        self
    }

    /// Run housekeeping in the background ([`crate::housekeeping`]): `gc` of boxes, box
    /// leftovers and (optionally) snapshots every `options.every`, with bounded work per run,
    /// one replica at a time (through the guard). Off by default. [`build`](Self::build) must
    /// then run inside a Tokio runtime, which the task runs on until the manager is dropped.
    pub fn housekeeping(mut self, options: crate::housekeeping::HousekeepingOptions) -> Self {
        self.housekeeping = Some(options);
        self
    }

    /// The execution guard (default: [`InProcessGuard::global`], which serializes calls on
    /// one key within this process).
    pub fn guard(mut self, guard: Arc<dyn SandboxExecutionGuard>) -> Self {
        self.guard = guard;
        self
    }

    /// The isolation scope (default: session).
    pub fn scope(mut self, scope: IsolationScope) -> Self {
        self.scope = scope;
        self
    }

    /// Workspace spec, snapshots and projection (default: empty spec, no snapshots, no
    /// projection).
    pub fn config(mut self, config: SandboxConfig) -> Self {
        self.config = config;
        self
    }

    /// Set up for replicas on several hosts in one call: the guard, the state store and (if
    /// given) the snapshot store of `parts`, and [`require_distributed`](Self::require_distributed),
    /// so that `build` refuses the set-up if any of them — or the snapshot store of a config
    /// set later — is not shared by every host.
    pub fn distributed(mut self, parts: Distributed) -> Self {
        self.guard = parts.guard;
        self.states = parts.states;
        self.distributed_snapshots = parts.snapshots;
        self.require_distributed()
    }

    /// Make [`build`](Self::build) refuse a set-up that loses work on a restart or when
    /// several processes of this host share it: state kept in memory, snapshots kept nowhere,
    /// or stores shared beyond what the guard serializes.
    pub fn require_durable(mut self) -> Self {
        self.require = self.require.max_with(Requirement::Durable);
        self
    }

    /// Make [`build`](Self::build) refuse a backend whose commands are not isolated from the
    /// host by a kernel boundary ([`Capabilities::isolated`](crate::Capabilities::isolated)
    /// false: the local backend's host shell), with [`Error::IsolationUnavailable`].
    pub fn require_isolation(mut self) -> Self {
        self.require_isolation = true;
        self
    }

    /// Make [`build`](Self::build) refuse a set-up that is unsafe for replicas on several
    /// hosts (the spec's `requireDistributed`): a guard, a state store and a snapshot store
    /// that are not shared by every host.
    pub fn require_distributed(mut self) -> Self {
        self.require = Requirement::Distributed;
        self
    }

    /// Build, checking the requirement set with [`require_durable`](Self::require_durable)
    /// or [`require_distributed`](Self::require_distributed). The error
    /// ([`Error::InvalidInput`]) names the part at fault.
    pub fn build(mut self) -> Result<SandboxManager> {
        if let Some(store) = self.distributed_snapshots.take() {
            self.config.snapshots.store = store;
        }
        if self.config.snapshots.format == crate::snapshot::SnapshotFormat::Native
            && !self.client.capabilities().native_snapshots
        {
            return Err(Error::NotSupported {
                backend: self.client.backend(),
                operation: "native snapshots (SnapshotFormat::Native)",
            });
        }
        if self.require_isolation && !self.client.capabilities().isolated {
            return Err(Error::IsolationUnavailable {
                backend: self.client.backend(),
                missing: "a kernel isolation boundary (its commands run as host processes)".into(),
                how_to_enable: "use a backend that isolates: docker, k8s, a cloud backend, or \
                                the local backend with its confined isolation"
                    .into(),
            });
        }
        self.check()?;
        let runtime = match self.housekeeping {
            Some(options) if options.every.is_zero() => {
                return Err(Error::invalid(
                    "housekeeping",
                    "the period between runs must not be zero",
                ));
            }
            Some(_) => Some(tokio::runtime::Handle::try_current().map_err(|_| {
                Error::invalid(
                    "housekeeping",
                    "needs a Tokio runtime to run on: build the manager inside one",
                )
            })?),
            None => None,
        };
        let housekeeping = self.housekeeping;
        let inner = Arc::new_cyclic(|weak| Inner {
            client: self.client,
            states: self.states,
            guard: self.guard,
            scope: self.scope,
            config: self.config,
            housekeeping: housekeeping.zip(runtime).map(|(options, runtime)| {
                crate::housekeeping::spawn(WeakManager(weak.clone()), options, &runtime)
            }),
        });
        Ok(SandboxManager { inner })
    }

    fn check(&self) -> Result<()> {
        let need = match self.require {
            Requirement::None => return Ok(()),
            Requirement::Durable => Reach::Host,
            Requirement::Distributed => Reach::Cluster,
        };
        let what = if self.require == Requirement::Distributed {
            "distributed set-up"
        } else {
            "durable set-up"
        };
        let refuse = |reason: String| Err(Error::invalid(what, reason));
        let states = self.states.reach();
        if states < need {
            return refuse(format!(
                "the state store {} is shared by {states} only; it must be shared by {need}",
                type_name(&self.states)
            ));
        }
        let snapshots = self.config.snapshots.store.reach();
        if snapshots < need {
            return refuse(format!(
                "the snapshot store `{}` is shared by {snapshots}; it must be shared by {need}",
                self.config.snapshots.store.name()
            ));
        }
        let guard = self.guard.reach();
        if guard < need.max(states) {
            return refuse(format!(
                "the guard {} serializes {guard} only, but the state store is shared by \
                 {states}: calls on one key from other processes would share a box",
                type_name(&self.guard)
            ));
        }
        Ok(())
    }
}

impl Requirement {
    fn max_with(self, other: Requirement) -> Requirement {
        match (self, other) {
            (Requirement::Distributed, _) | (_, Requirement::Distributed) => {
                Requirement::Distributed
            }
            (Requirement::Durable, _) | (_, Requirement::Durable) => Requirement::Durable,
            _ => Requirement::None,
        }
    }
}

/// The type's name as its `Debug` starts (a trait object hides its type from `type_name`).
fn type_name(value: &dyn fmt::Debug) -> String {
    let shown = format!("{value:?}");
    shown
        .split(|c: char| !(c.is_alphanumeric() || c == '_'))
        .next()
        .unwrap_or_default()
        .to_owned()
}

/// Options of [`SandboxManager::gc`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct BoxGcOptions {
    /// Boxes younger than this are never removed (also bounds how long a box without a key,
    /// which has no lease to tell it is in use, is left alone). Default 1 h.
    pub older_than: Duration,
    /// Also collect the snapshot store ([`snapshot::gc`]) with these options.
    pub snapshots: Option<snapshot::GcOptions>,
    /// Report what would be removed without removing anything.
    pub dry_run: bool,
    /// At most this many boxes and box leftovers removed per run (the rest wait for the next:
    /// [`BoxGcReport::deferred`]). Default: no bound.
    pub max_removals: usize,
}

impl Default for BoxGcOptions {
    fn default() -> Self {
        BoxGcOptions {
            older_than: Duration::from_secs(3600),
            snapshots: None,
            dry_run: false,
            max_removals: usize::MAX,
        }
    }
}

impl BoxGcOptions {
    /// Set the minimum age of a removed box.
    pub fn older_than(mut self, age: Duration) -> Self {
        self.older_than = age;
        self
    }

    /// Collect the snapshot store too.
    pub fn snapshots(mut self, options: snapshot::GcOptions) -> Self {
        self.snapshots = Some(options);
        self
    }

    /// Only report.
    pub fn dry_run(mut self, dry_run: bool) -> Self {
        self.dry_run = dry_run;
        self
    }

    /// Bound the boxes and box leftovers removed per run.
    pub fn max_removals(mut self, n: usize) -> Self {
        self.max_removals = n;
        self
    }
}

/// What [`SandboxManager::gc`] did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct BoxGcReport {
    /// Boxes removed (or that would be, in a dry run).
    pub boxes_removed: Vec<String>,
    /// Boxes left alone because a call holds their key.
    pub boxes_in_use: usize,
    /// Boxes left alone because a stored state describes their key, or they are too young.
    pub boxes_kept: usize,
    /// Boxes past their age left for the next run ([`BoxGcOptions::max_removals`]).
    pub deferred: usize,
    /// What the backend's sweep of half-created and half-removed boxes did
    /// ([`SandboxClient::sweep_leftovers`]).
    pub leftovers: crate::leftover::LeftoverReport,
    /// What the snapshot collection did, if asked.
    pub snapshots: Option<snapshot::GcReport>,
}

/// What [`SandboxManager::delete`] removed.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct DeleteReport {
    /// A stored state was removed.
    pub state: bool,
    /// Boxes removed.
    pub boxes: usize,
    /// Snapshots (manifests) removed; their chunks go at the next snapshot `gc`.
    pub snapshots: usize,
}

impl SandboxManager {
    /// The runs of the housekeeping task, the latest first seen (`None` until the first run
    /// ends); `None` without [`SandboxManagerBuilder::housekeeping`]. The receiver's
    /// `changed()` fails once the task has stopped.
    pub fn housekeeping(
        &self,
    ) -> Option<tokio::sync::watch::Receiver<Option<crate::housekeeping::HousekeepingRun>>> {
        self.inner.housekeeping.as_ref().map(|h| h.runs())
    }

    /// Start building a manager for `client`.
    pub fn builder(client: Arc<dyn SandboxClient>) -> SandboxManagerBuilder {
        SandboxManagerBuilder {
            client,
            states: Arc::new(MemoryStateStore::new()),
            guard: Arc::new(InProcessGuard::global()),
            scope: IsolationScope::default(),
            config: SandboxConfig::default(),
            require: Requirement::None,
            require_isolation: false,
            distributed_snapshots: None,
            housekeeping: None,
        }
    }

    /// The client.
    pub fn client(&self) -> &Arc<dyn SandboxClient> {
        &self.inner.client
    }

    /// The scope.
    pub fn scope(&self) -> IsolationScope {
        self.inner.scope
    }

    /// The state store.
    pub fn state_store(&self) -> &Arc<dyn StateStore> {
        &self.inner.states
    }

    /// The guard.
    pub fn guard(&self) -> &Arc<dyn SandboxExecutionGuard> {
        &self.inner.guard
    }

    /// The sandbox config.
    pub fn config(&self) -> &SandboxConfig {
        &self.inner.config
    }

    /// Create and start a sandbox for the caller to manage (to pass as [`Acquire::External`]).
    pub async fn create_external(&self, key: Option<&IsolationKey>) -> Result<Arc<Sandbox>> {
        let sandbox = Sandbox::create(&*self.inner.client, self.inner.config.clone(), key).await?;
        sandbox.start().await?;
        Ok(Arc::new(sandbox))
    }

    /// Run `f` as one call with an automatically acquired sandbox. The post-call steps run
    /// whatever `f` does: return, panic (re-raised afterwards) or get cancelled (the steps
    /// then run on a spawned task). If the call's lease is lost while `f` runs, `f` is
    /// dropped and the call fails with [`Error::LeaseLost`] without touching the box again.
    ///
    /// A failure anywhere comes back as one [`CallError`] holding the error, the report (with
    /// the state JSON) and `f`'s value, when there are any.
    pub async fn call<F, Fut, T>(&self, ctx: &CallContext, f: F) -> Result<Called<T>, CallError<T>>
    where
        F: FnOnce(Arc<Sandbox>) -> Fut,
        Fut: Future<Output = T>,
    {
        self.call_with(ctx, Acquire::Auto, f).await
    }

    /// [`call`](Self::call) with an explicit source for the sandbox.
    pub async fn call_with<F, Fut, T>(
        &self,
        ctx: &CallContext,
        source: Acquire,
        f: F,
    ) -> Result<Called<T>, CallError<T>>
    where
        F: FnOnce(Arc<Sandbox>) -> Fut,
        Fut: Future<Output = T>,
    {
        self.call_with_options(ctx, CallOptions::new().acquire(source), f)
            .await
    }

    /// [`call`](Self::call) with per-call options: where the sandbox comes from, and what a
    /// cancellation does with the call's work ([`OnCancel`]).
    pub async fn call_with_options<F, Fut, T>(
        &self,
        ctx: &CallContext,
        options: CallOptions,
        f: F,
    ) -> Result<Called<T>, CallError<T>>
    where
        F: FnOnce(Arc<Sandbox>) -> Fut,
        Fut: Future<Output = T>,
    {
        let call = self
            .begin_with(ctx, options)
            .await
            .map_err(CallError::before_start)?;
        let lost = call.lost_signal();
        let work = AssertUnwindSafe(f(call.sandbox().clone())).catch_unwind();
        let outcome = tokio::select! {
            biased;
            () = lost.cancelled() => None,
            outcome = work => Some(outcome),
        };
        let finished = call.finish().await;
        match outcome {
            Some(Ok(value)) => match finished {
                Ok(report) => Ok(Called { value, report }),
                Err(e) => Err(e.with_value(Some(value))),
            },
            Some(Err(panic)) => std::panic::resume_unwind(panic),
            None => Err(match finished {
                Err(e) => e.with_value(None),
                // Unreachable in practice: a lost lease makes `finish` fail.
                Ok(report) => CallError {
                    error: Error::LeaseLost {
                        key: report.key.clone().unwrap_or_default(),
                        reason: "found out while the call ran: the closure was dropped; the \
                                 report says what was written"
                            .into(),
                    },
                    report: Some(report),
                    value: None,
                },
            }),
        }
    }

    /// Acquire and start a sandbox for a call; finish it with [`ActiveCall::finish`]. Dropping
    /// an unfinished `ActiveCall` cancels the call ([`OnCancel::Discard`]): on a spawned task,
    /// its commands are killed and its work is not saved.
    ///
    /// Acquire and start run on their own task: if this future is dropped half-way, the step
    /// under way completes, then the box and the lease are given back without snapshotting or
    /// saving anything (a cancelled start never persists a half-made workspace).
    pub async fn begin(&self, ctx: &CallContext, source: Acquire) -> Result<ActiveCall> {
        self.begin_with(ctx, CallOptions::new().acquire(source))
            .await
    }

    /// [`begin`](Self::begin) with per-call options.
    pub async fn begin_with(&self, ctx: &CallContext, options: CallOptions) -> Result<ActiveCall> {
        let CallOptions {
            acquire: source,
            on_cancel,
        } = options;
        let key = IsolationKey::resolve(self.inner.scope, ctx);
        let span = tracing::info_span!("call", agent = %ctx.agent, key = key.as_ref().map_or("-", |k| k.as_str()), backend = self.inner.client.backend());
        let manager = self.inner.clone();
        let (tx, rx) = tokio::sync::oneshot::channel::<Result<Unclaimed>>();
        let task = tokio::spawn(
            async move {
                let begun = begin_call(manager, key, source, on_cancel)
                    .await
                    .map(Unclaimed::new);
                // The caller's `Unclaimed` guard gives the box back if it is dropped unclaimed;
                // so does this one if the caller is already gone.
                drop(tx.send(begun));
            }
            .instrument(span.clone()),
        );
        match rx.await {
            Ok(begun) => Ok(ActiveCall {
                inner: Some(begun?.claim()),
                span,
            }),
            Err(_) => match task.await {
                Err(e) if e.is_panic() => std::panic::resume_unwind(e.into_panic()),
                _ => Err(Error::backend(
                    "core",
                    "begin",
                    "the task starting the call was cancelled (runtime shutting down)",
                )),
            },
        }
    }

    /// Remove everything of `ctx`'s key: the box (whatever its persistence), its snapshots and
    /// its stored state. Takes the key's lease first, so it never pulls a box out from under a
    /// running call. Chunks shared with other keys stay until the next snapshot `gc`.
    pub async fn delete(&self, ctx: &CallContext) -> Result<DeleteReport> {
        let inner = &self.inner;
        let key = IsolationKey::resolve(inner.scope, ctx)
            .ok_or_else(|| Error::invalid("call context", "resolves to no isolation key"))?;
        let mut lease = inner.guard.enter(&key).await?;
        let token = inner.states.fence(&key, lease.token()).await?;
        lease.set_token(token);
        let mut report = DeleteReport::default();
        if let Some(json) = inner.states.load(&key).await? {
            // An unreadable state is an error, never a reason to delete around it.
            let state = state_from_json(&json)?;
            inner.client.delete(&*state).await?;
            report.state = true;
        }
        for owned in inner.client.list_owned().await? {
            if owned.key.as_deref() == Some(key.as_str()) {
                inner.client.remove_owned(&owned.id).await?;
                report.boxes += 1;
            }
        }
        let store = &inner.config.snapshots.store;
        let blobs = store
            .list_all(&format!("snapshots/{}/", key.digest()))
            .await?;
        for (deleted, blob) in blobs.into_iter().enumerate() {
            if lease.is_lost() {
                let state_box = if report.state {
                    "the box its stored state describes and "
                } else {
                    ""
                };
                return Err(lost(
                    &key,
                    &format!(
                        "found out while deleting: {state_box}{} other box(es) of the key and \
                         {deleted} snapshot blob(s) were removed; the other blobs and the \
                         stored state were left",
                        report.boxes
                    ),
                ));
            }
            if blob.key.as_str().ends_with(".manifest") {
                report.snapshots += 1;
            }
            store.delete(&blob.key).await?;
        }
        inner.states.delete(&key, lease.token()).await?;
        lease.release().await?;
        tracing::info!(key = %key, ?report, "deleted");
        Ok(report)
    }

    /// Whether `key`'s stored state points at the box `id` (an unreadable state counts as
    /// pointing at it: never remove what might be current).
    async fn stored_state_describes(&self, key: &IsolationKey, id: &str) -> Result<bool> {
        let Some(json) = self.inner.states.load(key).await? else {
            return Ok(false);
        };
        let described = state_from_json(&json).and_then(|s| self.inner.client.box_id(&*s));
        Ok(match described {
            Ok(described) => described == id,
            Err(e) => {
                tracing::warn!(key = %key, error = %e, "unreadable stored state: keeping its key's boxes");
                true
            }
        })
    }

    /// Remove leftover boxes of this client: every owned box ([`SandboxClient::list_owned`])
    /// older than [`BoxGcOptions::older_than`] whose key no call holds (the guard is tried, not
    /// waited for) and that its key's stored state does not point at — boxes whose call
    /// crashed, or whose work could not be saved (parked) — and every box past its expiry (the
    /// backend's maximum age) whose key no call holds, state or not (the next call restores
    /// it from its snapshot). Then what boxes whose creation or removal was cut short left
    /// ([`SandboxClient::sweep_leftovers`], with `older_than` as its grace). With
    /// [`BoxGcOptions::snapshots`], also collect the snapshot store, never retiring a snapshot
    /// a stored state references.
    pub async fn gc(&self, options: BoxGcOptions) -> Result<BoxGcReport> {
        let inner = &self.inner;
        let mut report = BoxGcReport::default();
        let mut removals = options.max_removals;
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_millis() as i64);
        let cutoff = now - options.older_than.as_millis() as i64;
        for owned in inner.client.list_owned().await? {
            let expired = owned.expires_unix_ms.is_some_and(|e| e <= now);
            if !expired && owned.created_unix_ms.is_none_or(|c| c > cutoff) {
                report.boxes_kept += 1;
                continue;
            }
            // Held while the box is removed, so no call can start on it meanwhile.
            let _lease = match owned.key.as_deref().map(IsolationKey::parse) {
                Some(Ok(key)) => match inner.guard.try_enter(&key).await? {
                    None => {
                        report.boxes_in_use += 1;
                        continue;
                    }
                    Some(lease)
                        if !expired && self.stored_state_describes(&key, &owned.id).await? =>
                    {
                        drop(lease);
                        report.boxes_kept += 1;
                        continue;
                    }
                    Some(lease) => Some(lease),
                },
                Some(Err(e)) => {
                    tracing::warn!(id = %owned.id, error = %e, "owned box with an unreadable key: left alone");
                    report.boxes_kept += 1;
                    continue;
                }
                None => None,
            };
            if removals == 0 {
                report.deferred += 1;
                continue;
            }
            removals -= 1;
            if !options.dry_run {
                inner.client.remove_owned(&owned.id).await?;
            }
            tracing::info!(id = %owned.id, key = ?owned.key, dry_run = options.dry_run, "gc: box removed");
            report.boxes_removed.push(owned.id);
        }
        report.leftovers = inner
            .client
            .sweep_leftovers(
                crate::leftover::LeftoverSweep::default()
                    .grace(options.older_than)
                    .max_removals(removals)
                    .dry_run(options.dry_run),
            )
            .await?;
        if let Some(snapshot_options) = options.snapshots {
            let spec = &inner.config.snapshots;
            let mut snapshot_options = snapshot_options;
            snapshot_options.dry_run |= options.dry_run;
            let client = &*inner.client;
            let native = client
                .capabilities()
                .native_snapshots
                .then_some(client as &dyn SandboxClient);
            report.snapshots = Some(
                snapshot::gc_with(
                    &*spec.store,
                    &spec.policy,
                    snapshot_options,
                    &*inner.states,
                    native,
                )
                .await?,
            );
        }
        Ok(report)
    }
}

/// What a call's stop wrote to the snapshot store, for an error that must say it.
fn snapshot_written(stop: Option<&StopReport>) -> String {
    match stop {
        None => "no snapshot was written (the stop failed or did not run)".to_owned(),
        Some(s) => match &s.snapshot {
            None => "no snapshot was written (snapshots are off)".to_owned(),
            Some(_) if s.unchanged => {
                "no snapshot was written (nothing changed since the last one)".to_owned()
            }
            Some(snap) => format!(
                "snapshot `{}` was written ({} bytes stored) but no state references it \
                 (snapshot gc collects it)",
                snap.id, s.bytes_written
            ),
        },
    }
}

/// How long a cancelled call waits for the commands it started to die.
const SETTLE_WITHIN: Duration = Duration::from_secs(30);

fn now_unix_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as i64)
}

/// Attempts at saving a state when the store reports a passing failure.
const SAVE_ATTEMPTS: u32 = 3;

fn lost(key: &IsolationKey, reason: &str) -> Error {
    Error::LeaseLost {
        key: key.to_string(),
        reason: reason.into(),
    }
}

/// Acquire (with the lease registered as the key's fence) and start.
async fn begin_call(
    manager: Arc<Inner>,
    key: Option<IsolationKey>,
    source: Acquire,
    on_cancel: OnCancel,
) -> Result<CallInner> {
    let started = Instant::now();
    let (sandbox, from, lease, committed) = acquire(&manager, key.as_ref(), source).await?;
    let acquire = started.elapsed();
    tracing::info!(from = ?from, ms = acquire.as_millis() as u64, "acquired");
    let mut inner = CallInner {
        manager,
        sandbox,
        from,
        key,
        lease,
        started,
        acquire,
        start: None,
        on_cancel,
        committed,
    };
    if !from.user_managed() {
        match inner.sandbox.start().await {
            Ok(report) => inner.start = Some(report),
            Err(e) => {
                // Nothing of the call happened in the box: give it back without saving.
                inner.abandon().await;
                return Err(e);
            }
        }
    }
    Ok(inner)
}

/// The acquired box, where it came from, the lease, and the stored state it was resumed from
/// (what a cancelled call leaves the key at).
type Acquired = (
    Arc<Sandbox>,
    AcquiredFrom,
    Option<Lease>,
    Option<Box<dyn SandboxState>>,
);

async fn acquire(inner: &Inner, key: Option<&IsolationKey>, source: Acquire) -> Result<Acquired> {
    let config = || inner.config.clone();
    match source {
        Acquire::External(sandbox) => Ok((sandbox, AcquiredFrom::External, None, None)),
        Acquire::State(state) => {
            // The box is the key's: serialize with other calls on it, but leave the store be.
            let lease = match key {
                Some(k) => Some(inner.guard.enter(k).await?),
                None => None,
            };
            let sandbox = Sandbox::resume(&*inner.client, config(), &*state, key).await?;
            Ok((Arc::new(sandbox), AcquiredFrom::ExternalState, lease, None))
        }
        Acquire::Auto => {
            let Some(k) = key else {
                let sandbox = Sandbox::create(&*inner.client, config(), None).await?;
                return Ok((Arc::new(sandbox), AcquiredFrom::New, None, None));
            };
            let mut lease = inner.guard.enter(k).await?;
            // Registered before the state is read: from now on no earlier holder can save.
            let token = inner.states.fence(k, lease.token()).await?;
            lease.set_token(token);
            let (sandbox, from, committed) = match inner.states.load(k).await? {
                Some(json) => {
                    // Malformed or unknown state is an error, never a silent fresh start.
                    let state = state_from_json(&json)?;
                    let sandbox = Sandbox::resume(&*inner.client, config(), &*state, key).await?;
                    (sandbox, AcquiredFrom::StateStore, Some(state))
                }
                None => (
                    Sandbox::create(&*inner.client, config(), key).await?,
                    AcquiredFrom::New,
                    None,
                ),
            };
            Ok((Arc::new(sandbox), from, Some(lease), committed))
        }
    }
}

/// A begun call not yet handed to its caller: dropped unclaimed (the caller went away), it
/// gives the box and the lease back on a spawned task.
struct Unclaimed(Option<CallInner>);

impl Unclaimed {
    fn new(inner: CallInner) -> Self {
        Unclaimed(Some(inner))
    }

    fn claim(mut self) -> CallInner {
        self.0.take().expect("claimed once")
    }
}

impl Drop for Unclaimed {
    fn drop(&mut self) {
        let Some(inner) = self.0.take() else {
            return;
        };
        tracing::warn!(key = ?inner.key, "call cancelled while starting: giving the box back without saving");
        match tokio::runtime::Handle::try_current() {
            Ok(rt) => {
                rt.spawn(inner.abandon().in_current_span());
            }
            Err(_) => tracing::error!("no runtime to give back a cancelled call's box"),
        }
    }
}

/// A call in progress: owns its sandbox binding and its lease, so nothing per call lives on a
/// shared object.
pub struct ActiveCall {
    inner: Option<CallInner>,
    span: tracing::Span,
}

struct CallInner {
    manager: Arc<Inner>,
    sandbox: Arc<Sandbox>,
    from: AcquiredFrom,
    key: Option<IsolationKey>,
    lease: Option<Lease>,
    started: Instant,
    acquire: Duration,
    start: Option<StartReport>,
    on_cancel: OnCancel,
    /// The stored state the call resumed (priority 3): what a cancelled call leaves the key at.
    committed: Option<Box<dyn SandboxState>>,
}

impl fmt::Debug for ActiveCall {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.inner {
            Some(i) => f
                .debug_struct("ActiveCall")
                .field("key", &i.key)
                .field("from", &i.from)
                .finish_non_exhaustive(),
            None => f.write_str("ActiveCall(finished)"),
        }
    }
}

impl ActiveCall {
    /// The call's sandbox.
    pub fn sandbox(&self) -> &Arc<Sandbox> {
        &self.inner.as_ref().expect("call not finished").sandbox
    }

    /// What `start` did.
    pub fn start_report(&self) -> Option<&StartReport> {
        self.inner.as_ref().and_then(|i| i.start.as_ref())
    }

    /// The fencing token the call's writes carry (registered with the state store): a side
    /// effect of the caller's own can be fenced with it too.
    pub fn fencing_token(&self) -> Option<u64> {
        self.inner
            .as_ref()
            .and_then(|i| i.lease.as_ref())
            .and_then(Lease::token)
    }

    /// Cancelled when the call's lease is lost (never, for a call without a lease): work on
    /// the box must stop, it may already be another call's.
    pub fn lost_signal(&self) -> CancellationToken {
        self.inner
            .as_ref()
            .and_then(|i| i.lease.as_ref())
            .map_or_else(CancellationToken::new, Lease::lost_signal)
    }

    /// Stop (snapshot), persist the state, retire older snapshots, release the box and the
    /// lease. Runs on its own task: dropping this future does not interrupt it. Every step
    /// that can run does run; the first error comes back with the report.
    pub async fn finish(mut self) -> Result<CallReport, CallError> {
        let inner = self.inner.take().expect("finish runs once");
        let task = tokio::spawn(inner.finish().instrument(self.span.clone()));
        match task.await {
            Ok((report, None)) => Ok(report),
            Ok((report, Some(error))) => Err(CallError {
                error,
                report: Some(report),
                value: None,
            }),
            Err(e) if e.is_panic() => std::panic::resume_unwind(e.into_panic()),
            Err(_) => Err(CallError::before_start(Error::backend(
                "core",
                "finish",
                "the post-call task was cancelled (runtime shutting down)",
            ))),
        }
    }
}

impl Drop for ActiveCall {
    fn drop(&mut self) {
        let Some(inner) = self.inner.take() else {
            return;
        };
        let at_unix_ms = now_unix_ms();
        tracing::warn!(key = ?inner.key, on_cancel = ?inner.on_cancel, "call cancelled (dropped before finishing): settling its box in the background");
        match tokio::runtime::Handle::try_current() {
            Ok(rt) => {
                let span = self.span.clone();
                rt.spawn(
                    async move {
                        if let (_, Some(e)) = inner.cancelled(at_unix_ms).await {
                            tracing::error!(error = %e, "the steps after a cancelled call failed");
                        }
                    }
                    .instrument(span),
                );
            }
            Err(_) => {
                tracing::error!(
                    "no runtime to settle a cancelled call: its box was left as it was and its state was not saved"
                )
            }
        }
    }
}

impl CallInner {
    fn lease_lost(&self) -> bool {
        self.lease.as_ref().is_some_and(Lease::is_lost)
    }

    /// The call's lease was lost: `when` it was found out and `written`, what the call had
    /// written by then (the state is never advanced after a loss).
    fn lost_error(&self, when: &str, written: &str) -> Error {
        Error::LeaseLost {
            key: self
                .key
                .as_ref()
                .map_or_else(String::new, ToString::to_string),
            reason: format!(
                "found out {when}: {written}; the state was not saved (the key's stored state is \
                 the one before this call) and the box was left alone"
            ),
        }
    }

    async fn finish(self) -> (CallReport, Option<Error>) {
        self.finish_with(None).await
    }

    /// The post-call steps; `cancelled` for a cancelled call that keeps its partial work
    /// (settled already): the saved state records it, with the files it changed.
    async fn finish_with(
        mut self,
        cancelled: Option<CancelledCall>,
    ) -> (CallReport, Option<Error>) {
        let mut first_error: Option<Error> = None;
        let mut keep = |e: Error| {
            tracing::warn!(error = %e, "post-call step failed");
            first_error.get_or_insert(e);
        };
        let mut report = CallReport {
            key: self.key.as_ref().map(ToString::to_string),
            acquired_from: self.from,
            acquire: self.acquire,
            start: self.start.take(),
            stop: None,
            persisted: false,
            parked: false,
            state_json: None,
            previous_cancelled: None,
            total: Duration::ZERO,
        };
        report.previous_cancelled = report
            .start
            .as_ref()
            .and_then(|s| s.previous_cancelled.clone());
        let should_persist = !self.from.bypasses_store() && self.key.is_some();
        if self.lease_lost() {
            // The key is someone else's now, and so may the box be: touch neither.
            keep(self.lost_error("before stopping", "no snapshot was taken"));
            self.release_lease().await;
            report.total = self.started.elapsed();
            return (report, first_error);
        }
        // 1. stop: snapshot.
        match self.sandbox.stop_listing(cancelled.is_some()).await {
            Ok((r, changed)) => {
                report.stop = Some(r);
                if let Some(mut c) = cancelled {
                    if let Some(changed) = changed {
                        c.unlisted = changed.len().saturating_sub(CancelledCall::MAX_LISTED) as u64;
                        c.possibly_torn = Some(
                            changed
                                .into_iter()
                                .take(CancelledCall::MAX_LISTED)
                                .map(|p| p.to_string())
                                .collect(),
                        );
                    }
                    self.sandbox.set_cancelled(Some(c));
                }
            }
            Err(e) => keep(e),
        }
        match state_to_json(&*self.sandbox.state()) {
            Ok(json) => report.state_json = Some(json),
            Err(e) => keep(e),
        }
        // 2. persist, only after a successful stop: the stored state always points at a
        //    complete snapshot, and a call whose snapshot failed never becomes current (the
        //    next call continues from the previous state).
        if let (true, Some(_), Some(json), Some(key)) =
            (should_persist, &report.stop, &report.state_json, &self.key)
        {
            match self
                .save_state(key, json, &snapshot_written(report.stop.as_ref()))
                .await
            {
                Ok(()) => {
                    report.persisted = true;
                    tracing::info!(key = %key, "state persisted");
                }
                Err(e) => {
                    if matches!(e, Error::StaleLease { .. })
                        && let Some(lease) = &self.lease
                    {
                        lease.mark_lost();
                    }
                    keep(e);
                }
            }
        }
        // 3. retention, only once a state pins the new snapshot and only while the lease holds.
        if report.persisted {
            self.retire_older_snapshots(report.stop.as_ref()).await;
        }
        // 4. the box: a call whose work was not saved keeps it.
        if !self.from.user_managed() {
            if self.lease_lost() {
                // The box may be the next holder's now: leave it (to `gc`). The call itself
                // failed only if its state was not saved before the loss.
                if report.persisted {
                    tracing::warn!(key = ?self.key, "the lease was lost after the state was saved: the box is left to gc");
                } else {
                    keep(self.lost_error(
                        "before releasing the box",
                        &snapshot_written(report.stop.as_ref()),
                    ));
                }
            } else {
                let unsaved = report.stop.is_none() || (should_persist && !report.persisted);
                let started = Instant::now();
                let r = if unsaved {
                    tracing::warn!(key = ?self.key, "the call's work was not saved: keeping its box for the next call on the key (or gc)");
                    report.parked = true;
                    self.sandbox.park().await
                } else if self.key.is_none() {
                    self.sandbox.destroy().await
                } else {
                    self.sandbox.shutdown().await
                };
                match r {
                    Ok(()) => {
                        tracing::info!(
                            ms = started.elapsed().as_millis() as u64,
                            parked = report.parked,
                            "box released"
                        )
                    }
                    Err(e) => keep(e),
                }
            }
        }
        // 5. the lease.
        self.release_lease().await;
        report.total = self.started.elapsed();
        if should_persist && !report.persisted {
            tracing::warn!(key = ?report.key, "the call's state was NOT persisted: the next call on this key starts from the previous state");
        }
        tracing::info!(
            persisted = report.persisted,
            ms = report.total.as_millis() as u64,
            "call finished"
        );
        (report, first_error)
    }

    /// The caller left while the closure ran. First the box is settled: every command the
    /// call started is killed and waited for (a user-managed box is the caller's: left as it
    /// is). Then, with [`OnCancel::KeepPartial`], the post-call steps run with the state marked
    /// partial; by default the call's work is discarded: the state the call started from is
    /// saved again with the cancellation recorded (the state is not advanced), the box is
    /// released (keyless: removed; ephemeral: removed; kept: kept, and its workspace restored
    /// from the snapshot at the next start) and the lease given back.
    async fn cancelled(mut self, at_unix_ms: i64) -> (CallReport, Option<Error>) {
        let user_managed = self.from.user_managed();
        if self.lease_lost() {
            // The key may be someone else's now, and so may the box be: touch neither.
            let report = self.cancelled_report();
            let e = self.lost_error("after the call was cancelled", "no snapshot was taken");
            self.release_lease().await;
            return (report, Some(e));
        }
        let settled = if user_managed {
            Ok(())
        } else {
            self.sandbox.settle(SETTLE_WITHIN).await
        };
        if let Err(e) = &settled {
            tracing::error!(error = %e, "a cancelled call's commands could not be confirmed dead: its work is not kept and its box is parked");
        }
        if self.on_cancel == OnCancel::KeepPartial && settled.is_ok() {
            let marker = (!user_managed).then(|| CancelledCall::new(at_unix_ms, true));
            return self.finish_with(marker).await;
        }
        let mut first_error: Option<Error> = None;
        let mut report = self.cancelled_report();
        let should_persist = !self.from.bypasses_store() && self.key.is_some();
        let mut recorded = false;
        if let (true, Some(key)) = (should_persist, self.key.clone()) {
            let saved = match self.committed_with(CancelledCall::new(at_unix_ms, false)) {
                Ok(json) => {
                    self.save_state(
                        &key,
                        &json,
                        "no snapshot was taken (the call was cancelled)",
                    )
                    .await
                }
                Err(e) => Err(e),
            };
            match saved {
                Ok(()) => {
                    recorded = true;
                    tracing::info!(key = %key, "cancelled call recorded in the key's state; the state was not advanced");
                }
                Err(e) => {
                    if matches!(e, Error::StaleLease { .. })
                        && let Some(lease) = &self.lease
                    {
                        lease.mark_lost();
                    }
                    first_error.get_or_insert(e);
                }
            }
        }
        if !user_managed && !self.lease_lost() {
            let restorable = self
                .committed
                .as_ref()
                .is_some_and(|s| s.common().snapshot.is_some());
            let r = if settled.is_err() {
                report.parked = true;
                self.sandbox.park().await
            } else if self.key.is_none() || (should_persist && !recorded && restorable) {
                // Unrecorded, a kept box would be continued as if its work were current:
                // remove it, so the next call restores the state's snapshot.
                self.sandbox.destroy().await
            } else {
                self.sandbox.shutdown().await
            };
            if let Err(e) = r {
                first_error.get_or_insert(e);
            }
        }
        self.release_lease().await;
        report.total = self.started.elapsed();
        tracing::info!(
            ms = report.total.as_millis() as u64,
            "cancelled call settled: its work was not kept"
        );
        (report, first_error)
    }

    /// The report of a cancelled call that discards its work (nothing stopped or saved).
    fn cancelled_report(&mut self) -> CallReport {
        let start = self.start.take();
        CallReport {
            key: self.key.as_ref().map(ToString::to_string),
            acquired_from: self.from,
            acquire: self.acquire,
            previous_cancelled: start.as_ref().and_then(|s| s.previous_cancelled.clone()),
            start,
            stop: None,
            persisted: false,
            parked: false,
            state_json: None,
            total: self.started.elapsed(),
        }
    }

    /// The state JSON the call started from (a fresh one for a new box) recording `cancelled`.
    fn committed_with(&self, cancelled: CancelledCall) -> Result<String> {
        let mut state = match &self.committed {
            Some(state) => state.clone(),
            None => {
                let mut state = self.sandbox.state();
                let root = state.common().workspace_root.clone();
                *state.common_mut() = CommonState::new(root);
                state
            }
        };
        state.common_mut().cancelled = Some(cancelled);
        state_to_json(&*state)
    }

    /// Save `json` under `key` with the lease's token; errors a retry may cure (a store that
    /// blinked) are retried a few times — a fenced save is idempotent.
    async fn save_state(&self, key: &IsolationKey, json: &str, written: &str) -> Result<()> {
        let token = self.lease.as_ref().and_then(Lease::token);
        let mut pause = Duration::from_millis(100);
        let mut attempt = 1;
        loop {
            if self.lease_lost() {
                return Err(self.lost_error("before saving the state", written));
            }
            match self.manager.states.save(key, json, token).await {
                Err(e) if e.is_retryable() && attempt < SAVE_ATTEMPTS => {
                    tracing::warn!(error = %e, attempt, "saving the state failed; retrying");
                    tokio::time::sleep(pause).await;
                    pause *= 4;
                    attempt += 1;
                }
                r => return r,
            }
        }
    }

    /// Delete the namespace's snapshots beyond the retention, never the one just saved.
    async fn retire_older_snapshots(&self, stop: Option<&StopReport>) {
        let spec = &self.manager.config.snapshots;
        let Some(snap) = stop
            .filter(|s| !s.unchanged)
            .and_then(|s| s.snapshot.as_ref())
        else {
            return;
        };
        let Some(ns) = snap.namespace() else {
            return;
        };
        if spec.keep_last == 0 || self.lease_lost() {
            return;
        }
        let pinned = std::collections::HashSet::from([snap.manifest.as_str().to_owned()]);
        let client = &*self.manager.client;
        let native = client
            .capabilities()
            .native_snapshots
            .then_some(client as &dyn SandboxClient);
        if let Err(e) = snapshot::retain(&*spec.store, ns, spec.keep_last, &pinned, native).await {
            // Housekeeping: the snapshot and the state are complete.
            tracing::warn!(error = %e, namespace = %ns, "snapshot retention failed");
        }
    }

    async fn release_lease(&mut self) {
        if let Some(lease) = self.lease.take()
            && let Err(e) = lease.release().await
        {
            tracing::warn!(error = %e, "releasing the lease failed; it expires by itself");
        }
    }

    /// Start failed, or the caller left before the call began: give the box and the lease
    /// back without snapshotting or saving. A box with a key is parked, not removed: it may
    /// hold an earlier call's unsaved work.
    async fn abandon(mut self) {
        if !self.from.user_managed() && !self.lease_lost() {
            let r = if self.key.is_none() {
                self.sandbox.destroy().await
            } else {
                self.sandbox.park().await
            };
            if let Err(e) = r {
                tracing::warn!(error = %e, "giving back a box whose call did not begin");
            }
        }
        self.release_lease().await;
    }
}
