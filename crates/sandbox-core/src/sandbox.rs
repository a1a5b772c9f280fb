//! [`Sandbox`]: one box with its lifecycle — the 4-branch `start`, the snapshotting `stop`,
//! `shutdown` — implemented once on top of a backend's [`BoxHandle`].

use std::collections::BTreeSet;
use std::fmt;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tracing::Instrument as _;

use crate::archive::{self, PackSource};
use crate::backend::{BoxHandle, Capabilities, CreateRequest, ImportMode, SandboxClient};
use crate::error::Result;
use crate::exec::Inflight;
use crate::exec::{ExecRequest, ExecResult};
use crate::isolation::IsolationKey;
use crate::path::RelPath;
use crate::projection::{self, Projection, ProjectionOutcome};
use crate::snapshot::{self, Manifest, SnapshotRef, SnapshotSpec, TakeRequest};
use crate::spec::{EntryKind, WorkspaceSpec};
use crate::state::{CancelledCall, CommonState, SandboxState};

/// Everything about a box that is not the backend's: its workspace layout, its snapshots and
/// its projection.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct SandboxConfig {
    /// Initial workspace layout.
    pub spec: WorkspaceSpec,
    /// Where snapshots go (default: nowhere).
    pub snapshots: SnapshotSpec,
    /// Host files mirrored in at every start (default: disabled).
    pub projection: Projection,
}

impl Default for SandboxConfig {
    fn default() -> Self {
        SandboxConfig {
            spec: WorkspaceSpec::default(),
            snapshots: SnapshotSpec::default(),
            projection: Projection::disabled(),
        }
    }
}

impl SandboxConfig {
    /// A config with `spec`, no snapshots and no projection.
    pub fn new(spec: WorkspaceSpec) -> Self {
        SandboxConfig {
            spec,
            ..SandboxConfig::default()
        }
    }

    /// Set the snapshot spec.
    pub fn snapshots(mut self, snapshots: SnapshotSpec) -> Self {
        self.snapshots = snapshots;
        self
    }

    /// Set the projection.
    pub fn projection(mut self, projection: Projection) -> Self {
        self.projection = projection;
        self
    }
}

/// How `start` initialized the workspace.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub enum StartBranch {
    /// A: the box's workspace is still there; only ephemeral entries were re-applied.
    Warm,
    /// B: the box lost its workspace; restored from the snapshot, ephemeral entries re-applied.
    RestoreEphemeral,
    /// C: never-ready workspace with a snapshot; restored, all entries re-applied.
    RestoreAll,
    /// D: no workspace and no snapshot; initialized from the spec.
    Cold,
}

impl StartBranch {
    /// The spec's letter.
    pub fn letter(self) -> char {
        match self {
            StartBranch::Warm => 'A',
            StartBranch::RestoreEphemeral => 'B',
            StartBranch::RestoreAll => 'C',
            StartBranch::Cold => 'D',
        }
    }
}

impl fmt::Display for StartBranch {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let what = match self {
            StartBranch::Warm => "warm start",
            StartBranch::RestoreEphemeral => "restore + ephemeral entries",
            StartBranch::RestoreAll => "restore + all entries",
            StartBranch::Cold => "cold start",
        };
        write!(f, "{} ({what})", self.letter())
    }
}

/// What `start` did.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct StartReport {
    /// The branch taken.
    pub branch: StartBranch,
    /// The snapshot restored (B, C).
    pub restored: Option<String>,
    /// Why the branch differs from what the state promised (e.g. "workspace lost and no
    /// snapshot to restore", or a kept box restored because the previous call was cancelled).
    pub note: Option<String>,
    /// The previous call on this key was cancelled while its closure ran (what its state
    /// recorded): by default its work was not kept — a kept box holding it was restored from
    /// the last saved snapshot (branch B instead of A) — and with
    /// [`OnCancel::KeepPartial`](crate::OnCancel::KeepPartial) the workspace is its partial
    /// work, with the files that may be torn listed.
    pub previous_cancelled: Option<CancelledCall>,
    /// What projection did.
    pub projection: ProjectionOutcome,
    /// Wall time.
    pub duration: Duration,
}

/// What `stop` did.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct StopReport {
    /// The snapshot describing the workspace now, if snapshots are on.
    pub snapshot: Option<SnapshotRef>,
    /// Nothing changed since the last snapshot: nothing was written.
    pub unchanged: bool,
    /// Files read and hashed (each counted once).
    pub files_hashed: u64,
    /// Of those, files modified within a clock tick of the listing, read only after that tick
    /// so that the next stop can trust their metadata ([`crate::snapshot::take`]).
    pub files_settled: u64,
    /// Bytes written to the snapshot store.
    pub bytes_written: u64,
    /// Wall time.
    pub duration: Duration,
}

/// One box and its lifecycle.
///
/// Shareable (`Arc<Sandbox>`): a started, user-managed sandbox can be handed to several calls
/// in turn. `start`/`stop` are serialized; `exec` and file primitives may run concurrently.
pub struct Sandbox {
    handle: Box<dyn BoxHandle>,
    common: Mutex<CommonState>,
    config: Arc<SandboxConfig>,
    key: Option<IsolationKey>,
    lifecycle: tokio::sync::Mutex<()>,
    /// The manifest the next snapshot compares against: the last one taken, or the restored
    /// tree's metadata with the restored hashes. Empty until the first stop or restore of this
    /// process; then the state's snapshot manifest is fetched.
    baseline: Mutex<Option<(SnapshotRef, Arc<Manifest>)>>,
    /// What the backend can do.
    capabilities: Capabilities,
    /// Cancelled when a cancelled call settles the box: every command still running through
    /// [`Sandbox::exec`] (also on a task the closure spawned) is dropped, so it is killed.
    cut: tokio_util::sync::CancellationToken,
    /// Commands running through [`Sandbox::exec`].
    execs: Inflight,
}

impl fmt::Debug for Sandbox {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Sandbox")
            .field("backend", &self.handle.backend())
            .field("key", &self.key)
            .field("handle", &self.handle)
            .finish_non_exhaustive()
    }
}

impl Sandbox {
    /// Create a new box (not started) with `client`.
    pub async fn create(
        client: &dyn SandboxClient,
        config: SandboxConfig,
        key: Option<&IsolationKey>,
    ) -> Result<Sandbox> {
        let handle = client.create(CreateRequest::new(&config.spec, key)).await?;
        let common = CommonState::new(handle.workspace_root());
        Ok(Sandbox::from_parts(
            handle,
            common,
            Arc::new(config),
            key.cloned(),
            client.capabilities(),
        ))
    }

    /// Reattach to the box `state` describes (not started).
    pub async fn resume(
        client: &dyn SandboxClient,
        config: SandboxConfig,
        state: &dyn SandboxState,
        key: Option<&IsolationKey>,
    ) -> Result<Sandbox> {
        let handle = client.resume(state, &config.spec).await?;
        Ok(Sandbox::from_parts(
            handle,
            state.common().clone(),
            Arc::new(config),
            key.cloned(),
            client.capabilities(),
        ))
    }

    fn from_parts(
        handle: Box<dyn BoxHandle>,
        common: CommonState,
        config: Arc<SandboxConfig>,
        key: Option<IsolationKey>,
        capabilities: Capabilities,
    ) -> Sandbox {
        Sandbox {
            handle,
            common: Mutex::new(common),
            config,
            key,
            lifecycle: tokio::sync::Mutex::new(()),
            baseline: Mutex::new(None),
            capabilities,
            cut: tokio_util::sync::CancellationToken::new(),
            execs: Inflight::new(),
        }
    }

    /// The backend's tag.
    pub fn backend(&self) -> &'static str {
        self.handle.backend()
    }

    /// The box's primitives (files, tar import/export, list).
    pub fn handle(&self) -> &dyn BoxHandle {
        &*self.handle
    }

    /// The isolation key this box belongs to, if any.
    pub fn key(&self) -> Option<&IsolationKey> {
        self.key.as_ref()
    }

    /// The box's configuration.
    pub fn config(&self) -> &SandboxConfig {
        &self.config
    }

    /// A copy of the common state.
    pub fn common(&self) -> CommonState {
        self.common.lock().expect("common state lock").clone()
    }

    fn update(&self, f: impl FnOnce(&mut CommonState)) {
        f(&mut self.common.lock().expect("common state lock"));
    }

    /// The full state to persist: the backend's part with core's common part.
    pub fn state(&self) -> Box<dyn SandboxState> {
        let mut state = self.handle.state();
        *state.common_mut() = self.common();
        state
    }

    /// Run a command in the box. A request that needs something the backend does not honour
    /// ([`crate::ExecFeatures`]) is refused with [`crate::Error::NotSupported`], never run
    /// without it.
    pub async fn exec(&self, request: ExecRequest) -> Result<ExecResult> {
        self.capabilities.exec.check(self.backend(), &request)?;
        // The program and the size of the command only: command lines and arguments may
        // embed secrets (a bearer token, `TOKEN=… cmd`).
        let span = tracing::info_span!(
            "exec",
            backend = self.backend(),
            key = self.key_str(),
            kind = request.command.kind(),
            program = tracing::field::Empty,
            args = tracing::field::Empty,
            line_len = tracing::field::Empty,
        );
        match &request.command {
            crate::exec::Command::Shell(line) => {
                span.record("line_len", line.len());
            }
            crate::exec::Command::Argv(argv) => {
                span.record("program", argv.first().map_or("", String::as_str));
                span.record("args", argv.len().saturating_sub(1));
            }
        }
        async {
            let started = Instant::now();
            let _running = self.execs.enter();
            let result = tokio::select! {
                biased;
                () = self.cut.cancelled() => Err(crate::Error::backend(
                    self.backend(),
                    "exec",
                    "the call was cancelled: the command was killed",
                )),
                result = self.handle.exec(request) => result,
            };
            match &result {
                Ok(r) => tracing::info!(exit_code = ?r.exit_code, timed_out = r.timed_out, truncated = r.truncated(), ms = started.elapsed().as_millis() as u64, "exec done"),
                Err(e) => tracing::warn!(error = %e, "exec failed"),
            }
            result
        }
        .instrument(span)
        .await
    }

    fn key_str(&self) -> &str {
        self.key.as_ref().map_or("-", IsolationKey::as_str)
    }

    /// Boot the box and initialize its workspace by one of the four branches, then project.
    pub async fn start(&self) -> Result<StartReport> {
        let _serial = self.lifecycle.lock().await;
        let span = tracing::info_span!(
            "start",
            backend = self.backend(),
            key = self.key_str(),
            branch = tracing::field::Empty
        );
        async {
            let started = Instant::now();
            self.handle.boot().await?;
            let common = self.common();
            let exists = common.workspace_root_ready && self.handle.workspace_exists().await?;
            let mut note = None;
            let mut restored = None;
            // A cancelled call's work in a kept box is not current: go back to the snapshot.
            let discard = common.cancelled.as_ref().is_some_and(|c| !c.partial);
            if discard && exists && common.snapshot.is_none() {
                let why = "the previous call was cancelled and there is no snapshot to go back to: its work stayed in the box";
                tracing::warn!("{why}");
                note = Some(why.to_owned());
            }
            let warm = exists && !(discard && common.snapshot.is_some());
            if exists && !warm {
                note = Some("the previous call was cancelled: the box's unsaved work was discarded and the workspace restored from the last saved snapshot".to_owned());
            }
            let branch = match (common.workspace_root_ready, warm, &common.snapshot) {
                (true, true, _) => {
                    self.apply_entries(true).await?;
                    StartBranch::Warm
                }
                (ready, _, Some(snap)) => {
                    self.restore(snap).await?;
                    restored = Some(snap.id.clone());
                    self.apply_entries(ready).await?;
                    if ready { StartBranch::RestoreEphemeral } else { StartBranch::RestoreAll }
                }
                (ready, _, None) => {
                    if ready {
                        let why = if self.config.snapshots.enabled() {
                            "workspace lost and no snapshot was ever taken: starting cold"
                        } else {
                            "workspace lost and snapshots are off: starting cold"
                        };
                        tracing::warn!("{why}");
                        note = Some(why.to_owned());
                    }
                    self.cold_init().await?;
                    StartBranch::Cold
                }
            };
            tracing::Span::current().record("branch", tracing::field::display(branch.letter()));
            self.update(|c| {
                c.workspace_root_ready = true;
                c.cancelled = None;
            });
            let current = self.common().projection;
            let (record, projection) = projection::apply(&self.config.projection, &*self.handle, current.as_ref()).await?;
            self.update(|c| c.projection = record);
            let previous_cancelled = common.cancelled.clone();
            if let Some(c) = &previous_cancelled {
                tracing::warn!(partial = c.partial, possibly_torn = c.possibly_torn.as_ref().map(Vec::len), "the previous call on this key was cancelled");
            }
            let report = StartReport { branch, restored, note, previous_cancelled, projection, duration: started.elapsed() };
            tracing::info!(branch = %report.branch, projection = ?report.projection, ms = report.duration.as_millis() as u64, "started");
            Ok(report)
        }
        .instrument(span)
        .await
    }

    /// Snapshot the workspace (if snapshots are on) and record it in the state.
    pub async fn stop(&self) -> Result<StopReport> {
        Ok(self.stop_listing(false).await?.0)
    }

    /// [`stop`](Self::stop), and with `changes`, the files the snapshot holds that its parent
    /// did not hold as they are (every file when there is no parent), sorted; `None` when no
    /// snapshot was taken.
    pub(crate) async fn stop_listing(
        &self,
        changes: bool,
    ) -> Result<(StopReport, Option<Vec<RelPath>>)> {
        let _serial = self.lifecycle.lock().await;
        let span = tracing::info_span!("stop", backend = self.backend(), key = self.key_str());
        async {
            let started = Instant::now();
            let mut report = StopReport {
                snapshot: None,
                unchanged: false,
                files_hashed: 0,
                files_settled: 0,
                bytes_written: 0,
                duration: Duration::ZERO,
            };
            let mut changed = None;
            let common = self.common();
            let namespace = self.namespace(&common);
            if self.config.snapshots.enabled() && namespace.is_none() {
                tracing::debug!("no isolation key and no earlier snapshot: nothing could find a snapshot, none taken");
            }
            if let (true, Some(namespace)) = (self.config.snapshots.enabled(), namespace) {
                let request = TakeRequest {
                    namespace,
                    exclude: self.config.spec.unarchived_paths(),
                    exclude_globs: self.config.spec.snapshot_excludes.clone(),
                    projection_hash: common.projection_hash().map(str::to_owned),
                    parent: self.parent(&common).await,
                };
                let parent = request.parent.as_ref().map(|(_, m)| m.clone());
                let outcome =
                    snapshot::take(&*self.handle, &self.config.snapshots, request).await?;
                if changes {
                    changed = Some(changed_files(parent.as_deref(), &outcome.manifest));
                }
                tracing::info!(
                    snapshot = %outcome.snapshot.id,
                    unchanged = outcome.unchanged,
                    files_hashed = outcome.files_hashed,
                    bytes = outcome.bytes_written,
                    "snapshot taken"
                );
                self.update(|c| c.snapshot = Some(outcome.snapshot.clone()));
                *self.baseline.lock().expect("baseline lock") =
                    Some((outcome.snapshot.clone(), outcome.manifest.clone()));
                report.unchanged = outcome.unchanged;
                report.files_hashed = outcome.files_hashed;
                report.files_settled = outcome.files_settled;
                report.bytes_written = outcome.bytes_written;
                report.snapshot = Some(outcome.snapshot);
            }
            self.update(|c| c.workspace_root_ready = true);
            report.duration = started.elapsed();
            tracing::info!(ms = report.duration.as_millis() as u64, "stopped");
            Ok((report, changed))
        }
        .instrument(span)
        .await
    }

    /// A cancelled call's first step: kill every command still running through
    /// [`exec`](Self::exec) (also ones a task of the closure runs) and wait, at most `within`,
    /// until they and whatever the backend still runs for this box ended
    /// ([`BoxHandle::settle`]). Afterwards no command runs through this sandbox any more.
    pub(crate) async fn settle(&self, within: Duration) -> Result<()> {
        self.cut.cancel();
        let deadline = tokio::time::Instant::now() + within;
        if !self.execs.idle(within).await {
            return Err(crate::Error::Timeout {
                operation: format!("{} commands of a cancelled call ending", self.execs.count()),
                after: within,
            });
        }
        match tokio::time::timeout_at(deadline, self.handle.settle()).await {
            Ok(r) => r,
            Err(_) => Err(crate::Error::Timeout {
                operation: "the backend settling a cancelled call's box".to_owned(),
                after: within,
            }),
        }
    }

    /// Record in the state that this call was cancelled (what the state saved next says).
    pub(crate) fn set_cancelled(&self, cancelled: Option<CancelledCall>) {
        self.update(|c| c.cancelled = cancelled);
    }

    /// End of a self-managed call: keep or remove the box per the backend's persistence.
    pub async fn shutdown(&self) -> Result<()> {
        let _serial = self.lifecycle.lock().await;
        self.handle.release().await
    }

    /// Stop the box but keep it whatever the persistence (its work was not saved: the next
    /// call on the key, or `gc`, finds it).
    pub async fn park(&self) -> Result<()> {
        let _serial = self.lifecycle.lock().await;
        self.handle.park().await
    }

    /// Remove the box whatever the persistence.
    pub async fn destroy(&self) -> Result<()> {
        let _serial = self.lifecycle.lock().await;
        self.handle.destroy().await
    }

    /// Snapshot namespace: the isolation key's digest, else the one the box's snapshots already
    /// use (a resumed checkpoint's). `None` for a box nothing could find again: it takes no
    /// snapshot, so none is left unreachable.
    fn namespace(&self, common: &CommonState) -> Option<String> {
        if let Some(key) = &self.key {
            return Some(key.digest());
        }
        common
            .snapshot
            .as_ref()
            .and_then(SnapshotRef::namespace)
            .map(str::to_owned)
    }

    /// The parent for change detection: the in-memory baseline if it describes the state's
    /// snapshot, else the state's snapshot manifest from the store.
    async fn parent(&self, common: &CommonState) -> Option<(SnapshotRef, Arc<Manifest>)> {
        let current = common.snapshot.as_ref()?;
        if let Some((r, m)) = self.baseline.lock().expect("baseline lock").clone()
            && r.id == current.id
        {
            return Some((r, m));
        }
        match snapshot::load_manifest(&self.config.snapshots, current).await {
            Ok(m) => Some((current.clone(), m)),
            Err(e) => {
                tracing::warn!(error = %e, snapshot = %current.id, "parent manifest unavailable: taking a full snapshot");
                None
            }
        }
    }

    async fn restore(&self, snap: &SnapshotRef) -> Result<()> {
        let keep = self.config.spec.bind_mount_paths();
        let manifest = snapshot::restore(
            &*self.handle,
            &self.config.snapshots,
            snap,
            keep,
            self.capabilities.concurrent_transfers,
        )
        .await?;
        let baseline = match snapshot::baseline_after_restore(&*self.handle, &manifest).await {
            Ok(b) => Some((snap.clone(), b)),
            Err(e) => {
                tracing::warn!(error = %e, "no change-detection baseline after restore: the next snapshot re-reads everything");
                None
            }
        };
        *self.baseline.lock().expect("baseline lock") = baseline;
        // The projection record describes the workspace only if the snapshot captured it.
        self.update(|c| {
            if c.projection_hash() != snap.projection_hash.as_deref() {
                c.projection = None;
            }
        });
        Ok(())
    }

    async fn cold_init(&self) -> Result<()> {
        let keep = self.config.spec.bind_mount_paths();
        let items = entry_items(&self.config.spec, false);
        self.handle
            .import(archive::pack(items), ImportMode::Replace { keep })
            .await?;
        self.update(|c| {
            c.projection = None;
            c.snapshot = None;
        });
        *self.baseline.lock().expect("baseline lock") = None;
        Ok(())
    }

    async fn apply_entries(&self, ephemeral_only: bool) -> Result<()> {
        let items = entry_items(&self.config.spec, ephemeral_only);
        if items.is_empty() {
            return Ok(());
        }
        self.handle
            .import(archive::pack(items), ImportMode::Merge)
            .await
    }
}

/// Files of `now` that `parent` does not hold with the same content (all of `now`'s files
/// without a parent), in `now`'s (path) order.
fn changed_files(parent: Option<&Manifest>, now: &Manifest) -> Vec<RelPath> {
    use crate::backend::EntryType;
    let before: std::collections::HashMap<&RelPath, &snapshot::ManifestEntry> = parent
        .map(|p| p.entries.iter().map(|e| (&e.path, e)).collect())
        .unwrap_or_default();
    now.entries
        .iter()
        .filter(|e| e.kind == EntryType::File)
        .filter(|e| {
            before.get(&e.path).is_none_or(|b| {
                b.kind != e.kind
                    || b.size != e.size
                    || b.hash != e.hash
                    || (e.hash.is_none() && b.mtime_ns != e.mtime_ns)
            })
        })
        .map(|e| e.path.clone())
        .collect()
}

/// The spec's entries (all, or only ephemeral ones) as pack items, with parent directories.
fn entry_items(spec: &WorkspaceSpec, ephemeral_only: bool) -> Vec<(RelPath, PackSource)> {
    let items = spec
        .entries()
        .iter()
        .filter(|(_, e)| e.ephemeral || !ephemeral_only)
        .filter_map(|(path, e)| {
            let source = match &e.kind {
                EntryKind::File { content, mode } => PackSource::Bytes {
                    data: content.clone(),
                    mode: mode.unwrap_or(0o644),
                },
                EntryKind::Dir => PackSource::Dir { mode: 0o755 },
                EntryKind::Copy { host_path } => PackSource::HostTree(host_path.clone()),
                EntryKind::BindMount { .. } => return None,
            };
            Some((path.clone(), source))
        })
        .collect();
    with_parents(items)
}

/// Add a directory item for every missing parent and sort parents before children.
pub(crate) fn with_parents(mut items: Vec<(RelPath, PackSource)>) -> Vec<(RelPath, PackSource)> {
    let present: BTreeSet<RelPath> = items.iter().map(|(p, _)| p.clone()).collect();
    let mut missing = BTreeSet::new();
    for (path, _) in &items {
        let mut parent = path.parent();
        while let Some(p) = parent {
            parent = p.parent();
            if !present.contains(&p) {
                missing.insert(p);
            }
        }
    }
    items.extend(
        missing
            .into_iter()
            .map(|p| (p, PackSource::Dir { mode: 0o755 })),
    );
    items.sort_by(|a, b| a.0.cmp(&b.0));
    items
}
