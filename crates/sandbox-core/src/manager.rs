//! The call lifecycle, once: [`SandboxManager`].
//!
//! ```text
//! resolve key → guard.enter(key) → acquire (1 external box · 2 external state · 3 stored state · 4 new)
//!   → start (A/B/C/D + projection) → [the call] → stop (snapshot) → save state (fenced)
//!   → shutdown (self-managed only) → lease released
//! ```
//!
//! Priorities 1 and 2 bypass the guard and the state store: the caller manages concurrency and
//! keeps the resulting state (returned in [`CallReport::state_json`]).

use std::fmt;
use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::FutureExt as _;
use tracing::Instrument as _;

use crate::backend::SandboxClient;
use crate::error::{Error, Result};
use crate::guard::{Lease, NoopGuard, SandboxExecutionGuard};
use crate::isolation::{CallContext, IsolationKey, IsolationScope};
use crate::sandbox::{Sandbox, SandboxConfig, StartReport, StopReport};
use crate::state::{SandboxState, state_from_json, state_to_json};
use crate::state_store::{MemoryStateStore, StateStore};

/// Where a call's sandbox comes from.
#[derive(Debug, Default)]
pub enum Acquire {
    /// Look the key up in the state store; create a new box when there is nothing (priorities
    /// 3 and 4).
    #[default]
    Auto,
    /// Use this started sandbox as is (priority 1). User-managed: the call stops it (snapshot)
    /// but never shuts it down, and does not persist its state.
    External(Arc<Sandbox>),
    /// Resume exactly this state, e.g. a checkpoint from an earlier call (priority 2).
    /// Self-managed, but the state store is neither read nor written.
    State(Box<dyn SandboxState>),
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
    /// What `stop` did.
    pub stop: Option<StopReport>,
    /// Whether the state was saved to the state store.
    pub persisted: bool,
    /// The box's final state JSON (what a caller keeps as a checkpoint).
    pub state_json: Option<String>,
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

/// Builder for [`SandboxManager`].
#[derive(Debug)]
pub struct SandboxManagerBuilder {
    client: Arc<dyn SandboxClient>,
    states: Arc<dyn StateStore>,
    guard: Arc<dyn SandboxExecutionGuard>,
    scope: IsolationScope,
    config: SandboxConfig,
}

impl SandboxManagerBuilder {
    /// The state store (default: in memory).
    pub fn state_store(mut self, states: Arc<dyn StateStore>) -> Self {
        self.states = states;
        self
    }

    /// The execution guard (default: none).
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

    /// Build.
    pub fn build(self) -> SandboxManager {
        SandboxManager {
            inner: Arc::new(Inner {
                client: self.client,
                states: self.states,
                guard: self.guard,
                scope: self.scope,
                config: self.config,
            }),
        }
    }
}

impl SandboxManager {
    /// Start building a manager for `client`.
    pub fn builder(client: Arc<dyn SandboxClient>) -> SandboxManagerBuilder {
        SandboxManagerBuilder {
            client,
            states: Arc::new(MemoryStateStore::new()),
            guard: Arc::new(NoopGuard),
            scope: IsolationScope::default(),
            config: SandboxConfig::default(),
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
    /// whatever `f` does: return, fail, panic (re-raised afterwards) or get cancelled (the steps
    /// then run on a spawned task).
    pub async fn call<F, Fut, T>(&self, ctx: &CallContext, f: F) -> Result<Called<T>>
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
    ) -> Result<Called<T>>
    where
        F: FnOnce(Arc<Sandbox>) -> Fut,
        Fut: Future<Output = T>,
    {
        let call = self.begin(ctx, source).await?;
        let outcome = AssertUnwindSafe(f(call.sandbox().clone()))
            .catch_unwind()
            .await;
        let report = call.finish().await;
        match outcome {
            Ok(value) => Ok(Called {
                value,
                report: report?,
            }),
            Err(panic) => std::panic::resume_unwind(panic),
        }
    }

    /// Acquire and start a sandbox for a call; finish it with [`ActiveCall::finish`]. Dropping
    /// an unfinished `ActiveCall` runs the post-call steps on a spawned task.
    pub async fn begin(&self, ctx: &CallContext, source: Acquire) -> Result<ActiveCall> {
        let key = IsolationKey::resolve(self.inner.scope, ctx);
        let span = tracing::info_span!("call", agent = %ctx.agent, key = key.as_ref().map_or("-", |k| k.as_str()), backend = self.inner.client.backend());
        let started = Instant::now();
        let (sandbox, from, lease) = self
            .acquire(key.as_ref(), source)
            .instrument(span.clone())
            .await?;
        let acquire = started.elapsed();
        let mut call = ActiveCall {
            inner: Some(CallInner {
                manager: self.inner.clone(),
                sandbox,
                from,
                key,
                lease,
                started,
                acquire,
                start: None,
            }),
            span: span.clone(),
        };
        if !from.user_managed() {
            let inner = call.inner.as_mut().expect("fresh call");
            match inner.sandbox.start().instrument(span).await {
                Ok(report) => inner.start = Some(report),
                Err(e) => {
                    // Nothing happened in the box: release it without snapshotting or saving.
                    let inner = call.inner.take().expect("fresh call");
                    inner.abandon().await;
                    return Err(e);
                }
            }
        }
        Ok(call)
    }

    async fn acquire(
        &self,
        key: Option<&IsolationKey>,
        source: Acquire,
    ) -> Result<(Arc<Sandbox>, AcquiredFrom, Option<Lease>)> {
        let inner = &self.inner;
        let started = Instant::now();
        let result = match source {
            Acquire::External(sandbox) => Ok((sandbox, AcquiredFrom::External, None)),
            Acquire::State(state) => {
                let sandbox =
                    Sandbox::resume(&*inner.client, inner.config.clone(), &*state, key).await?;
                Ok((Arc::new(sandbox), AcquiredFrom::ExternalState, None))
            }
            Acquire::Auto => {
                let lease = match key {
                    Some(k) => Some(inner.guard.enter(k).await?),
                    None => None,
                };
                let stored = match key {
                    Some(k) => inner.states.load(k).await?,
                    None => None,
                };
                let (sandbox, from) = match stored {
                    Some(json) => {
                        // Malformed or unknown state is an error, never a silent fresh start.
                        let state = state_from_json(&json)?;
                        (
                            Sandbox::resume(&*inner.client, inner.config.clone(), &*state, key)
                                .await?,
                            AcquiredFrom::StateStore,
                        )
                    }
                    None => (
                        Sandbox::create(&*inner.client, inner.config.clone(), key).await?,
                        AcquiredFrom::New,
                    ),
                };
                Ok((Arc::new(sandbox), from, lease))
            }
        };
        if let Ok((_, from, _)) = &result {
            tracing::info!(from = ?from, ms = started.elapsed().as_millis() as u64, "acquired");
        }
        result
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

    /// Stop (snapshot), persist the state, shut a self-managed box down, release the lease.
    /// Every step that can run does run; the first error is returned.
    pub async fn finish(mut self) -> Result<CallReport> {
        let inner = self.inner.take().expect("finish runs once");
        inner.finish().instrument(self.span.clone()).await
    }
}

impl Drop for ActiveCall {
    fn drop(&mut self) {
        let Some(inner) = self.inner.take() else {
            return;
        };
        tracing::warn!(key = ?inner.key, "call dropped before finishing: running the post-call steps in the background");
        match tokio::runtime::Handle::try_current() {
            Ok(rt) => {
                let span = self.span.clone();
                rt.spawn(async move {
                    if let Err(e) = inner.finish().instrument(span).await {
                        tracing::error!(error = %e, "post-call steps of a dropped call failed");
                    }
                });
            }
            Err(_) => {
                tracing::error!("no runtime to finish a dropped call: its state was not persisted")
            }
        }
    }
}

impl CallInner {
    async fn finish(mut self) -> Result<CallReport> {
        let mut first_error: Option<Error> = None;
        let mut keep = |r: Result<()>| {
            if let Err(e) = r {
                tracing::warn!(error = %e, "post-call step failed");
                first_error.get_or_insert(e);
            }
        };
        // 1. stop: snapshot.
        let stop = match self.sandbox.stop().await {
            Ok(r) => Some(r),
            Err(e) => {
                keep(Err(e));
                None
            }
        };
        let state_json = state_to_json(&*self.sandbox.state()).ok();
        // 2. persist, only after a successful stop, so the stored state always points at a
        //    complete snapshot (the previous one, if this stop failed).
        let mut persisted = false;
        if stop.is_some()
            && !self.from.bypasses_store()
            && let (Some(key), Some(json)) = (&self.key, &state_json)
        {
            let lost = self.lease.as_ref().is_some_and(Lease::is_lost);
            let r = if lost {
                Err(Error::Conflict {
                    key: key.to_string(),
                    reason: "the execution lease was lost during the call; state not saved".into(),
                })
            } else {
                let token = self.lease.as_ref().and_then(Lease::token);
                self.manager.states.save(key, json, token).await
            };
            persisted = r.is_ok();
            if persisted {
                tracing::info!(key = %key, "state persisted");
            }
            keep(r);
        }
        // 3. shutdown: self-managed boxes only; a box without a key can never be found again.
        if !self.from.user_managed() {
            let started = Instant::now();
            let r = if self.key.is_none() {
                self.sandbox.destroy().await
            } else {
                self.sandbox.shutdown().await
            };
            if r.is_ok() {
                tracing::info!(ms = started.elapsed().as_millis() as u64, "box released");
            }
            keep(r);
        }
        // 4. release the lease.
        if let Some(mut lease) = self.lease.take() {
            lease.release();
            tracing::debug!("lease released");
        }
        let report = CallReport {
            key: self.key.as_ref().map(|k| k.to_string()),
            acquired_from: self.from,
            acquire: self.acquire,
            start: self.start.take(),
            stop,
            persisted,
            state_json,
            total: self.started.elapsed(),
        };
        tracing::info!(
            persisted,
            ms = report.total.as_millis() as u64,
            "call finished"
        );
        match first_error {
            Some(e) => Err(e),
            None => Ok(report),
        }
    }

    /// Start failed: release the box and the lease without touching state.
    async fn abandon(mut self) {
        if !self.from.user_managed() {
            let r = if self.key.is_none() {
                self.sandbox.destroy().await
            } else {
                self.sandbox.shutdown().await
            };
            if let Err(e) = r {
                tracing::warn!(error = %e, "releasing a box whose start failed");
            }
        }
        if let Some(mut lease) = self.lease.take() {
            lease.release();
        }
    }
}
