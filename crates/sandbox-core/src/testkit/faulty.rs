//! Fault injection for the `faults` scenarios: wrappers around a client (and its boxes), a
//! state store, a snapshot store and a guard that count every call they forward as a *step*
//! of one shared [`Script`], and at one chosen step either fail once or pause until released.
//!
//! A sweep first runs a call with nothing armed to learn its steps, then re-runs it once per
//! step: failing there (the fault sweep) or pausing there and dropping the caller (the
//! cancellation sweep).

use std::fmt;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use bytes::Bytes;
use futures::StreamExt as _;
use tokio::sync::watch;

use crate::backend::{
    BoxHandle, Capabilities, CreateRequest, ExportRequest, ImportMode, OwnedBox, SandboxClient,
    TreeEntry,
};
use crate::error::{Error, Result};
use crate::exec::{ExecRequest, ExecResult};
use crate::guard::{Lease, LeaseHandle, SandboxExecutionGuard};
use crate::isolation::IsolationKey;
use crate::path::RelPath;
use crate::reach::Reach;
use crate::snapshot::{BlobKey, BlobStream, SnapshotStore, WriteHints};
use crate::spec::WorkspaceSpec;
use crate::state::SandboxState;
use crate::state_store::StateStore;
use crate::stream::ByteStream;

/// What happens at the armed step.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fault {
    /// The step fails once with [`Error::Unavailable`] (a service that went away: what a
    /// real store or engine does).
    Fail,
    /// The step waits until [`Script::release`].
    Pause,
}

#[derive(Debug, Default)]
struct State {
    log: Vec<&'static str>,
    armed: Option<(usize, Fault)>,
}

/// The steps seen by every wrapper sharing it, and the one fault armed.
pub struct Script {
    state: Mutex<State>,
    hit: watch::Sender<Option<&'static str>>,
    released: watch::Sender<bool>,
}

impl fmt::Debug for Script {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Script").finish_non_exhaustive()
    }
}

impl Script {
    /// A script with nothing armed.
    pub fn new() -> Arc<Script> {
        Arc::new(Script {
            state: Mutex::new(State::default()),
            hit: watch::channel(None).0,
            released: watch::channel(false).0,
        })
    }

    /// Forget the steps seen so far and arm nothing: count a fresh run.
    pub fn record(&self) {
        let mut s = self.state.lock().expect("script");
        s.log.clear();
        s.armed = None;
        self.hit.send_replace(None);
        self.released.send_replace(false);
    }

    /// Forget the steps seen so far and arm `fault` at step `at` (0-based) of the next run.
    pub fn arm(&self, at: usize, fault: Fault) {
        self.record();
        self.state.lock().expect("script").armed = Some((at, fault));
    }

    /// The steps of the run so far.
    pub fn steps(&self) -> Vec<&'static str> {
        self.state.lock().expect("script").log.clone()
    }

    /// Wait until the armed pause is reached; its step, or `None` after `within`.
    pub async fn paused(&self, within: Duration) -> Option<&'static str> {
        let mut rx = self.hit.subscribe();
        let reached = tokio::time::timeout(within, rx.wait_for(Option::is_some)).await;
        reached.ok().and_then(|r| r.ok().and_then(|v| *v))
    }

    /// Let a paused step go on.
    pub fn release(&self) {
        self.released.send_replace(true);
    }

    /// Count a step; fail or pause there if armed.
    pub async fn step(&self, label: &'static str) -> Result<()> {
        let fault = {
            let mut s = self.state.lock().expect("script");
            let index = s.log.len();
            s.log.push(label);
            match s.armed {
                Some((at, fault)) if at == index => Some(fault),
                _ => None,
            }
        };
        match fault {
            None => Ok(()),
            Some(Fault::Fail) => Err(Error::Unavailable {
                service: format!("injected fault at `{label}`"),
                reason: "failed once on purpose".into(),
                source: None,
            }),
            Some(Fault::Pause) => {
                let mut rx = self.released.subscribe();
                self.hit.send_replace(Some(label));
                let _ = rx.wait_for(|r| *r).await;
                Ok(())
            }
        }
    }
}

/// A client whose every call, and every call of its boxes, is a step of `script`.
#[derive(Debug)]
pub struct FaultyClient {
    inner: Arc<dyn SandboxClient>,
    script: Arc<Script>,
    capabilities: Option<Capabilities>,
    poison: bool,
}

impl FaultyClient {
    /// Wrap `inner`.
    pub fn new(inner: Arc<dyn SandboxClient>, script: Arc<Script>) -> Self {
        FaultyClient {
            inner,
            script,
            capabilities: None,
            poison: false,
        }
    }

    /// Make the boxes' states refuse to be serialized (a backend with a broken state type).
    pub fn poison_state(mut self) -> Self {
        self.poison = true;
        self
    }

    /// Report `capabilities` instead of the inner client's (to play a lesser backend).
    pub fn capabilities(mut self, capabilities: Capabilities) -> Self {
        self.capabilities = Some(capabilities);
        self
    }

    fn wrap(&self, inner: Box<dyn BoxHandle>) -> Box<dyn BoxHandle> {
        Box::new(FaultyBox {
            inner,
            script: self.script.clone(),
            poison: self.poison,
        })
    }
}

#[async_trait]
impl SandboxClient for FaultyClient {
    fn backend(&self) -> &'static str {
        self.inner.backend()
    }

    fn capabilities(&self) -> Capabilities {
        self.capabilities
            .unwrap_or_else(|| self.inner.capabilities())
    }

    async fn create(&self, request: CreateRequest<'_>) -> Result<Box<dyn BoxHandle>> {
        self.script.step("client.create").await?;
        Ok(self.wrap(self.inner.create(request).await?))
    }

    async fn resume(
        &self,
        state: &dyn SandboxState,
        spec: &WorkspaceSpec,
    ) -> Result<Box<dyn BoxHandle>> {
        self.script.step("client.resume").await?;
        Ok(self.wrap(self.inner.resume(state, spec).await?))
    }

    async fn delete(&self, state: &dyn SandboxState) -> Result<()> {
        self.script.step("client.delete").await?;
        self.inner.delete(state).await
    }

    async fn list_owned(&self) -> Result<Vec<OwnedBox>> {
        self.script.step("client.list_owned").await?;
        self.inner.list_owned().await
    }

    fn box_id(&self, state: &dyn SandboxState) -> Result<String> {
        self.inner.box_id(state)
    }

    async fn remove_owned(&self, id: &str) -> Result<()> {
        self.script.step("client.remove_owned").await?;
        self.inner.remove_owned(id).await
    }

    async fn delete_native_snapshot(&self, reference: &str) -> Result<()> {
        self.script.step("client.delete_native_snapshot").await?;
        self.inner.delete_native_snapshot(reference).await
    }
    async fn sweep_leftovers(
        &self,
        sweep: crate::leftover::LeftoverSweep,
    ) -> Result<crate::leftover::LeftoverReport> {
        self.script.step("client.sweep_leftovers").await?;
        self.inner.sweep_leftovers(sweep).await
    }
}

#[derive(Debug)]
struct FaultyBox {
    inner: Box<dyn BoxHandle>,
    script: Arc<Script>,
    poison: bool,
}

/// A state that cannot be serialized.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct PoisonState {
    common: crate::state::CommonState,
    #[serde(serialize_with = "refuse", default)]
    poison: (),
}

fn refuse<S: serde::Serializer>(_: &(), _: S) -> std::result::Result<S::Ok, S::Error> {
    Err(serde::ser::Error::custom(
        "this state refuses to be serialized (injected)",
    ))
}

crate::sandbox_state!(PoisonState, "testkit-poison");

#[async_trait]
impl BoxHandle for FaultyBox {
    fn backend(&self) -> &'static str {
        self.inner.backend()
    }
    fn workspace_root(&self) -> &str {
        self.inner.workspace_root()
    }
    fn state(&self) -> Box<dyn SandboxState> {
        let inner = self.inner.state();
        if self.poison {
            return Box::new(PoisonState {
                common: inner.common().clone(),
                poison: (),
            });
        }
        inner
    }
    async fn boot(&self) -> Result<()> {
        self.script.step("box.boot").await?;
        self.inner.boot().await
    }
    async fn release(&self) -> Result<()> {
        self.script.step("box.release").await?;
        self.inner.release().await
    }
    async fn park(&self) -> Result<()> {
        self.script.step("box.park").await?;
        self.inner.park().await
    }
    async fn settle(&self) -> Result<()> {
        self.inner.settle().await
    }
    async fn destroy(&self) -> Result<()> {
        self.script.step("box.destroy").await?;
        self.inner.destroy().await
    }
    async fn workspace_exists(&self) -> Result<bool> {
        self.script.step("box.workspace_exists").await?;
        self.inner.workspace_exists().await
    }
    async fn exec(&self, request: ExecRequest) -> Result<ExecResult> {
        self.script.step("box.exec").await?;
        self.inner.exec(request).await
    }
    async fn list(&self) -> Result<Vec<TreeEntry>> {
        self.script.step("box.list").await?;
        self.inner.list().await
    }
    async fn export(&self, request: &ExportRequest) -> Result<ByteStream> {
        self.script.step("box.export").await?;
        self.inner.export(request).await
    }
    async fn import(&self, archive: ByteStream, mode: ImportMode) -> Result<()> {
        self.script.step("box.import").await?;
        self.inner.import(archive, mode).await
    }
    async fn read_file(&self, path: &RelPath) -> Result<Bytes> {
        self.script.step("box.read_file").await?;
        self.inner.read_file(path).await
    }
    async fn write_file(&self, path: &RelPath, data: Bytes, mode: u32) -> Result<()> {
        self.script.step("box.write_file").await?;
        self.inner.write_file(path, data, mode).await
    }
    async fn remove(&self, paths: &[RelPath]) -> Result<()> {
        self.script.step("box.remove").await?;
        self.inner.remove(paths).await
    }
    async fn native_snapshot(&self) -> Result<String> {
        self.script.step("box.native_snapshot").await?;
        self.inner.native_snapshot().await
    }
    async fn restore_native(&self, reference: &str) -> Result<()> {
        self.script.step("box.restore_native").await?;
        self.inner.restore_native(reference).await
    }
}

/// A state store whose every call is a step of `script`.
#[derive(Debug)]
pub struct FaultyStateStore {
    inner: Arc<dyn StateStore>,
    script: Arc<Script>,
}

impl FaultyStateStore {
    /// Wrap `inner`.
    pub fn new(inner: Arc<dyn StateStore>, script: Arc<Script>) -> Self {
        FaultyStateStore { inner, script }
    }
}

#[async_trait]
impl StateStore for FaultyStateStore {
    async fn load(&self, key: &IsolationKey) -> Result<Option<String>> {
        self.script.step("state.load").await?;
        self.inner.load(key).await
    }
    async fn fence(&self, key: &IsolationKey, granted: Option<u64>) -> Result<u64> {
        self.script.step("state.fence").await?;
        self.inner.fence(key, granted).await
    }
    async fn save(&self, key: &IsolationKey, state_json: &str, fence: Option<u64>) -> Result<()> {
        self.script.step("state.save").await?;
        self.inner.save(key, state_json, fence).await
    }
    async fn delete(&self, key: &IsolationKey, fence: Option<u64>) -> Result<()> {
        self.script.step("state.delete").await?;
        self.inner.delete(key, fence).await
    }
    async fn list(&self, prefix: &str) -> Result<Vec<IsolationKey>> {
        self.script.step("state.list").await?;
        self.inner.list(prefix).await
    }
    fn reach(&self) -> Reach {
        self.inner.reach()
    }
}

/// A snapshot store whose every call is a step of `script` (a listing: when it is first
/// read). Manifest puts are told apart from data puts.
#[derive(Debug)]
pub struct FaultySnapshotStore {
    inner: Arc<dyn SnapshotStore>,
    script: Arc<Script>,
}

impl FaultySnapshotStore {
    /// Wrap `inner`.
    pub fn new(inner: Arc<dyn SnapshotStore>, script: Arc<Script>) -> Self {
        FaultySnapshotStore { inner, script }
    }
}

#[async_trait]
impl SnapshotStore for FaultySnapshotStore {
    fn name(&self) -> &'static str {
        self.inner.name()
    }
    fn reach(&self) -> Reach {
        self.inner.reach()
    }
    fn write_hints(&self) -> WriteHints {
        self.inner.write_hints()
    }
    async fn put(&self, key: &BlobKey, data: ByteStream, size: Option<u64>) -> Result<u64> {
        let label = if key.as_str().ends_with(".manifest") {
            "snap.put_manifest"
        } else {
            "snap.put"
        };
        self.script.step(label).await?;
        self.inner.put(key, data, size).await
    }
    async fn get(&self, key: &BlobKey) -> Result<ByteStream> {
        self.script.step("snap.get").await?;
        self.inner.get(key).await
    }
    async fn exists(&self, key: &BlobKey) -> Result<bool> {
        self.script.step("snap.exists").await?;
        self.inner.exists(key).await
    }
    async fn delete(&self, key: &BlobKey) -> Result<()> {
        self.script.step("snap.delete").await?;
        self.inner.delete(key).await
    }
    fn list(&self, prefix: &str) -> BlobStream {
        let (script, inner, prefix) = (self.script.clone(), self.inner.clone(), prefix.to_owned());
        futures::stream::once(async move { script.step("snap.list").await })
            .flat_map(move |stepped| match stepped {
                Ok(()) => inner.list(&prefix),
                Err(e) => futures::stream::iter([Err(e)]).boxed(),
            })
            .boxed()
    }
    async fn sweep_leftovers(
        &self,
        sweep: crate::leftover::LeftoverSweep,
    ) -> Result<crate::leftover::LeftoverReport> {
        self.script.step("snap.sweep_leftovers").await?;
        self.inner.sweep_leftovers(sweep).await
    }
}

/// A guard whose `enter` and lease releases are steps of `script`.
#[derive(Debug)]
pub struct FaultyGuard {
    inner: Arc<dyn SandboxExecutionGuard>,
    script: Arc<Script>,
}

impl FaultyGuard {
    /// Wrap `inner`.
    pub fn new(inner: Arc<dyn SandboxExecutionGuard>, script: Arc<Script>) -> Self {
        FaultyGuard { inner, script }
    }

    fn wrap(&self, lease: Lease) -> Lease {
        let (key, token, lost) = (lease.key().clone(), lease.token(), lease.lost_signal());
        Lease::new(
            key,
            token,
            Box::new(FaultyLease {
                inner: Some(lease),
                script: self.script.clone(),
            }),
        )
        .with_lost_signal(lost)
    }
}

#[async_trait]
impl SandboxExecutionGuard for FaultyGuard {
    async fn enter(&self, key: &IsolationKey) -> Result<Lease> {
        self.script.step("guard.enter").await?;
        Ok(self.wrap(self.inner.enter(key).await?))
    }
    async fn try_enter(&self, key: &IsolationKey) -> Result<Option<Lease>> {
        self.script.step("guard.try_enter").await?;
        Ok(self.inner.try_enter(key).await?.map(|l| self.wrap(l)))
    }
    fn reach(&self) -> Reach {
        self.inner.reach()
    }
}

#[derive(Debug)]
struct FaultyLease {
    inner: Option<Lease>,
    script: Arc<Script>,
}

#[async_trait]
impl LeaseHandle for FaultyLease {
    fn is_lost(&self) -> bool {
        self.inner.as_ref().is_some_and(Lease::is_lost)
    }
    async fn release(&mut self) -> Result<()> {
        let stepped = self.script.step("lease.release").await;
        // The inner lease is released either way (a failed release is dropped, which frees
        // the key in the background), as a real guard's expiry would.
        let released = match self.inner.take() {
            Some(lease) => lease.release().await,
            None => Ok(()),
        };
        stepped.and(released)
    }
    fn release_detached(&mut self) {
        drop(self.inner.take());
    }
}
