//! [`DockerBox`]: one container's primitives.

use std::collections::{BTreeMap, BTreeSet, HashSet};
use std::fmt;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bollard::query_parameters::{
    ContainerArchiveInfoOptionsBuilder, DownloadFromContainerOptionsBuilder,
    StopContainerOptionsBuilder, UploadToContainerOptionsBuilder,
};
use bytes::Bytes;
use futures::{StreamExt, TryStreamExt};
use sandbox_core::archive::Excludes;
use sandbox_core::posix::{self, LIST_SCRIPT, REMOVE_SCRIPT, SWAP_SCRIPT};
use sandbox_core::stream::{self, ByteStream};
use sandbox_core::{
    BoxHandle, Error, ExecRequest, ExecResult, ExportRequest, ImportMode, Inflight, IsolationKey,
    OutputLimits, Persistence, RelPath, Result, SandboxState, TreeEntry, async_trait,
};

use crate::BACKEND;
use crate::agent::{Agent, AgentError, MAX_AGENT_STDIN};
use crate::client::{Shared, state_of};
use crate::exec::{self, ExecSpec};
use crate::state::ResolvedMount;
use crate::tarfix::{self, Download, STAGE_PREFIX, Single};

/// Go's `os.ModeDir` and `os.ModeSymlink` bits in the engine's path stat.
const GO_MODE_DIR: u32 = 1 << 31;
const GO_MODE_SYMLINK: u32 = 1 << 27;

/// Timeout of the backend's own helper commands.
const HELPER_TIMEOUT: Duration = Duration::from_secs(300);

/// How long `settle` waits for a cancelled call's commands to be killed.
const SETTLE_WITHIN: Duration = Duration::from_secs(60);

/// Path lists up to this long are exported with one engine download per path; longer ones with
/// one download of their deepest common directory, filtered to the list, unless the box's last
/// listing shows that directory holds much more than the list (see [`plan_export`]).
const PER_PATH_DOWNLOADS: usize = 4;

/// What one more engine archive call costs, in bytes moved: the engine sets up the container's
/// filesystem for each call (about 45 ms here), in which time a download moves roughly this
/// much. [`plan_export`] downloads a common directory only when the unlisted bytes it would
/// carry cost less than the calls it saves.
const ARCHIVE_CALL_BYTES: u64 = 16 << 20;

/// Largest file `read_file` returns.
const READ_LIMIT: u64 = 1 << 30;

/// Everything that describes a box apart from its live container.
#[derive(Clone)]
pub(crate) struct BoxConfig {
    pub name: String,
    pub image: String,
    pub root: String,
    pub key: Option<IsolationKey>,
    pub persistence: Persistence,
    /// Bind mounts from the workspace spec: workspace path, host path, read-only.
    pub binds: Vec<(RelPath, PathBuf, bool)>,
    pub spec_env: BTreeMap<String, String>,
    pub extra: Vec<ResolvedMount>,
}

/// The spec's environment values are not printed: they may hold secrets.
impl fmt::Debug for BoxConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("BoxConfig")
            .field("name", &self.name)
            .field("image", &self.image)
            .field("root", &self.root)
            .field("key", &self.key)
            .field("persistence", &self.persistence)
            .field("binds", &self.binds)
            .field("spec_env", &self.spec_env.keys().collect::<Vec<_>>())
            .field("extra", &self.extra)
            .finish()
    }
}

#[derive(Debug, Default)]
struct Live {
    /// The container id the state knew, or the one `create` made.
    expected_id: Option<String>,
    /// The container id seen at the last boot.
    id: Option<String>,
    /// The workspace cannot be trusted: the container is not the one the state knew.
    lost: bool,
    /// The workspace is brand new and empty (a container this handle just created), so a
    /// `Replace` import may extract straight into it.
    fresh: bool,
    host_ports: BTreeMap<String, u16>,
    /// File sizes from the last listing (a stop lists, then exports what changed): what the
    /// next export of a path list weighs in choosing its downloads, then dropped (a box does not
    /// hold its workspace's listing between calls). Only a cost estimate, never trusted for
    /// content.
    sizes: Option<Arc<BTreeMap<RelPath, u64>>>,
}

/// One container. Made by [`crate::DockerClient`].
pub struct DockerBox {
    shared: Arc<Shared>,
    config: BoxConfig,
    live: Mutex<Live>,
    agent: Arc<tokio::sync::Mutex<AgentSlot>>,
    /// A background start of the agent (at boot) holds the slot: commands wait for it
    /// instead of falling back to an engine exec.
    agent_starting: Arc<AtomicBool>,
    /// Commands until their tree is dead, also past a drop (a cancelled call's kill runs on
    /// a task of its own): what `settle` waits for.
    inflight: Inflight,
}

/// The box's exec agent, if one runs.
#[derive(Default)]
struct AgentSlot {
    agent: Option<Agent>,
    /// The agent could not start in this container: use engine execs.
    disabled: bool,
}

impl fmt::Debug for DockerBox {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DockerBox")
            .field("name", &self.config.name)
            .field("image", &self.config.image)
            .field("root", &self.config.root)
            .field("persistence", &self.config.persistence)
            .finish_non_exhaustive()
    }
}

impl DockerBox {
    pub(crate) fn new(
        shared: Arc<Shared>,
        config: BoxConfig,
        expected_id: Option<String>,
        fresh: bool,
    ) -> Self {
        DockerBox {
            shared,
            config,
            live: Mutex::new(Live {
                expected_id,
                fresh,
                ..Live::default()
            }),
            agent: Arc::new(tokio::sync::Mutex::new(AgentSlot::default())),
            agent_starting: Arc::new(AtomicBool::new(false)),
            inflight: Inflight::new(),
        }
    }

    /// The container name.
    pub fn container_name(&self) -> &str {
        &self.config.name
    }

    fn live(&self) -> std::sync::MutexGuard<'_, Live> {
        self.live.lock().expect("live lock")
    }

    /// The container to address: the id seen at boot, else the name.
    fn target(&self) -> String {
        self.live()
            .id
            .clone()
            .unwrap_or_else(|| self.config.name.clone())
    }

    fn user(&self) -> Option<String> {
        self.shared.options.user.clone()
    }

    /// Base environment of every command: options, spec, extra mounts.
    fn base_env(&self) -> BTreeMap<String, String> {
        let mut env = self.shared.options.env.clone();
        env.extend(self.config.spec_env.clone());
        for m in &self.config.extra {
            env.insert(m.env_name.clone(), m.target.clone());
        }
        env
    }

    /// Run one of the backend's own scripts with `sh -c`.
    async fn script(
        &self,
        script: &str,
        args: Vec<String>,
        user: Option<String>,
    ) -> Result<ExecResult> {
        let mut argv = vec![
            "sh".to_owned(),
            "-c".to_owned(),
            script.to_owned(),
            "sandbox".to_owned(),
        ];
        argv.extend(args);
        self.run(ExecSpec {
            argv,
            env: Vec::new(),
            cwd: None,
            user,
            stdin: None,
            limits: OutputLimits::both(256 << 20),
            timeout: HELPER_TIMEOUT,
            counted_by: Some(self.inflight.clone()),
        })
        .await
    }

    /// Run a command: through the box's agent when it is free and can take it, else through
    /// an engine exec.
    async fn run(&self, spec: ExecSpec) -> Result<ExecResult> {
        let docker = self.shared.docker().await?;
        let target = self.target();
        let engine = &self.shared.engine;
        let agent_can = self.shared.options.exec_agent
            && spec.user == self.user()
            && spec
                .stdin
                .as_ref()
                .is_none_or(|s| s.len() <= MAX_AGENT_STDIN);
        let slot = if !agent_can {
            None
        } else if self.agent_starting.load(Ordering::SeqCst) {
            Some(self.agent.lock().await)
        } else {
            self.agent.try_lock().ok()
        };
        if let Some(mut slot) = slot {
            if slot.agent.as_ref().is_some_and(|a| !a.usable()) {
                slot.agent = None; // a cancelled call left it out of step
            }
            if slot.agent.is_none() && !slot.disabled {
                match Agent::start(engine, &docker, &target, self.user()).await {
                    Ok(agent) => slot.agent = Some(agent),
                    Err(e) => {
                        tracing::info!(container = %self.config.name, error = %e, "no exec agent in this container: using engine execs");
                        slot.disabled = true;
                    }
                }
            }
            if let Some(agent) = slot.agent.as_mut() {
                match agent.run(engine, &docker, &target, &spec).await {
                    Ok(result) => return Ok(result),
                    Err(AgentError::NotSent(e)) => {
                        tracing::info!(container = %self.config.name, error = %e, "exec agent gone: using an engine exec");
                        slot.agent = None;
                    }
                    Err(AgentError::Lost(e)) => {
                        slot.agent = None;
                        return Err(e);
                    }
                }
            }
        }
        exec::run(engine, &docker, &target, spec).await
    }

    /// Stop the container and keep it. Stopped or gone already is fine.
    async fn stop_container(&self) -> Result<()> {
        let docker = self.shared.docker().await?;
        let t = self.shared.options.stop_timeout.as_secs() as i32;
        let options = StopContainerOptionsBuilder::default().t(t).build();
        match docker.stop_container(&self.target(), Some(options)).await {
            Ok(()) => {
                tracing::info!(container = %self.config.name, "container stopped (kept)");
                Ok(())
            }
            Err(e) if matches!(crate::engine::status(&e), Some(304) | Some(404)) => Ok(()),
            Err(e) => Err(self
                .shared
                .engine
                .err("stop", "container", &self.config.name, e)),
        }
    }

    /// Forget the agent (the container stopped, restarted or is gone).
    async fn drop_agent(&self) {
        *self.agent.lock().await = AgentSlot::default();
    }

    /// Start the agent in the background, so that the call's first command (or the stop's
    /// listing, when the call ran none) finds it running instead of paying for its start.
    fn prestart_agent(&self) {
        if !self.shared.options.exec_agent {
            return;
        }
        let Ok(rt) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let (slot, starting, shared) = (
            self.agent.clone(),
            self.agent_starting.clone(),
            self.shared.clone(),
        );
        let (target, user, name) = (self.target(), self.user(), self.config.name.clone());
        starting.store(true, Ordering::SeqCst);
        rt.spawn(async move {
            let mut slot = slot.lock().await;
            if slot.agent.is_none() && !slot.disabled {
                match shared.docker().await {
                    Ok(docker) => {
                        // A failure here is not final: the first command tries again.
                        match Agent::start(&shared.engine, &docker, &target, user).await {
                            Ok(agent) => slot.agent = Some(agent),
                            Err(e) => {
                                tracing::debug!(container = %name, error = %e, "the agent did not start in the background")
                            }
                        }
                    }
                    Err(e) => tracing::debug!(error = %e, "agent not started"),
                }
            }
            starting.store(false, Ordering::SeqCst);
        });
    }

    async fn script_ok(
        &self,
        what: &'static str,
        script: &str,
        args: Vec<String>,
    ) -> Result<ExecResult> {
        let r = self.script(script, args, self.user()).await?;
        if r.success() {
            Ok(r)
        } else {
            Err(Error::backend(
                BACKEND,
                what,
                format!(
                    "helper exited with {:?}: {}",
                    r.exit_code,
                    r.stderr_str().trim()
                ),
            ))
        }
    }

    /// The engine's stat of an in-box path: `None` if missing, else its Go file mode.
    async fn stat(&self, path: &str) -> Result<Option<u32>> {
        let docker = self.shared.docker().await?;
        let options = ContainerArchiveInfoOptionsBuilder::default()
            .path(path)
            .build();
        match docker
            .get_container_archive_info(&self.target(), Some(options))
            .await
        {
            Ok(s) => Ok(Some(s.file_mode)),
            Err(e) if crate::engine::status(&e) == Some(404) => Ok(None),
            Err(e) => Err(self.shared.engine.err("stat", "path", path, e)),
        }
    }

    /// Stream an archive into `dir` (which must exist). Fails unless the stream ended cleanly.
    async fn upload(&self, dir: &str, archive: ByteStream) -> Result<()> {
        let docker = self.shared.docker().await?;
        let mut options = UploadToContainerOptionsBuilder::default().path(dir);
        if self.shared.options.user.is_some() {
            // Files belong to the container's user, not to whoever packed them.
            options = options.copy_uidgid("1");
        }
        let (watched, clean) = tarfix::watch_end(archive);
        let (tx, rx) = tokio::sync::oneshot::channel::<Error>();
        let tx = Arc::new(Mutex::new(Some(tx)));
        // Keep our error (the engine only sees a cut-off body).
        let body = watched.map(move |chunk| {
            chunk.map_err(|e| {
                let shown = std::io::Error::other(e.to_string());
                if let Some(tx) = tx.lock().expect("tx").take() {
                    let _ = tx.send(e);
                }
                shown
            })
        });
        let res = docker
            .upload_to_container(
                &self.target(),
                Some(options.build()),
                bollard::body_try_stream(body),
            )
            .await;
        let ours = rx.await.ok();
        if let Some(e) = ours {
            return Err(e);
        }
        res.map_err(|e| self.shared.engine.err("upload", "path", dir, e))?;
        if !clean.load(std::sync::atomic::Ordering::SeqCst) {
            return Err(Error::backend(
                BACKEND,
                "upload",
                "the engine accepted an archive that was not read to its end",
            ));
        }
        Ok(())
    }

    /// Create the workspace root (and its parents) if it is missing.
    async fn ensure_root(&self) -> Result<()> {
        if self.stat(&self.config.root).await?.is_some() {
            return Ok(());
        }
        let parts: Vec<&str> = self
            .config
            .root
            .split('/')
            .filter(|p| !p.is_empty())
            .collect();
        let dirs: Vec<String> = (1..=parts.len()).map(|i| parts[..i].join("/")).collect();
        let tar = tarfix::dirs_tar(&dirs, 0o755)?;
        self.upload("/", stream::once(tar)).await
    }

    fn keep_paths(&self) -> Vec<RelPath> {
        self.config
            .binds
            .iter()
            .map(|(p, _, _)| p.clone())
            .collect()
    }

    /// Refuse to write through a symlink that is already in the live workspace: the engine's
    /// extraction would follow it. `ancestors` are the directories entries go into that the
    /// archive does not create itself first; each is checked with the engine's path stat
    /// (no exec). The checks run before the upload starts: the engine holds the container's
    /// lock while it extracts, so a stat during the upload would wait for the upload.
    async fn check_ancestors(&self, ancestors: &BTreeSet<RelPath>) -> Result<()> {
        let mut missing: Vec<RelPath> = Vec::new();
        for a in ancestors {
            if missing.iter().any(|m| a.starts_with(m)) {
                continue; // the engine creates it as a real directory
            }
            match self.stat(&a.to_box(&self.config.root)).await? {
                None => missing.push(a.clone()),
                Some(m) if m & GO_MODE_SYMLINK != 0 => {
                    return Err(Error::unsafe_archive(
                        a.as_str(),
                        format!("would write through the symlink `{a}` in the workspace"),
                    ));
                }
                Some(m) if m & GO_MODE_DIR == 0 => {
                    return Err(Error::unsafe_archive(
                        a.as_str(),
                        format!("`{a}` is not a directory"),
                    ));
                }
                Some(_) => {}
            }
        }
        Ok(())
    }

    async fn merge(&self, archive: ByteStream) -> Result<()> {
        self.ensure_root().await?;
        // Spool the archive (to an anonymous temporary file, not memory) while noting which
        // live directories its entries go through, check those, then upload.
        let pending = Arc::new(Mutex::new(BTreeSet::new()));
        let check: tarfix::EntryCheck = {
            let pending = pending.clone();
            let mut dirs: HashSet<RelPath> = HashSet::new();
            Box::new(move |path: &RelPath, is_dir: bool| {
                let mut p = path.parent();
                while let Some(a) = p {
                    p = a.parent();
                    if !dirs.contains(&a) {
                        pending.lock().expect("pending").insert(a);
                    }
                }
                if is_dir {
                    dirs.insert(path.clone());
                }
                Ok(())
            })
        };
        let filtered = tarfix::filter_import(archive, Vec::new(), Some(check));
        let spooled = tarfix::spool(filtered).await?;
        let ancestors = std::mem::take(&mut *pending.lock().expect("pending"));
        self.check_ancestors(&ancestors).await?;
        self.upload(&self.config.root, spooled).await
    }

    async fn replace(&self, archive: ByteStream, keep: Vec<RelPath>) -> Result<()> {
        let mut keep = keep;
        keep.extend(self.keep_paths());
        for k in &keep {
            if k.as_str().contains('\n') {
                return Err(Error::invalid(
                    "keep path",
                    format!("`{k}` contains a newline"),
                ));
            }
        }
        self.ensure_root().await?;
        let fresh = std::mem::take(&mut self.live().fresh);
        if fresh {
            // Nothing lives here yet but mount points: extract in place, and on failure
            // empty the workspace again.
            let filtered = if keep.is_empty() {
                archive
            } else {
                tarfix::filter_import(archive, keep.clone(), None)
            };
            if let Err(e) = self.upload(&self.config.root, filtered).await {
                let cleanup = self.swap(None, &keep).await;
                if let Err(c) = cleanup {
                    tracing::warn!(error = %c, "emptying a workspace after a failed import");
                }
                return Err(e);
            }
            return Ok(());
        }
        let stage = format!("{STAGE_PREFIX}{}", uuid::Uuid::new_v4().simple());
        let stage_dir = format!("{}/{stage}", self.config.root.trim_end_matches('/'));
        self.upload(
            &self.config.root,
            stream::once(tarfix::dirs_tar(std::slice::from_ref(&stage), 0o700)?),
        )
        .await?;
        if let Err(e) = self.upload(&stage_dir, archive).await {
            if let Err(c) = self
                .script_ok("import", "rm -rf -- \"$1\"", vec![stage_dir.clone()])
                .await
            {
                tracing::warn!(error = %c, "removing a staging directory");
            }
            return Err(e);
        }
        self.swap(Some(&stage), &keep).await
    }

    /// Empty the workspace except `keep` (and the directories leading to them), then move the
    /// staged tree in (without overwriting kept paths), then remove the staging directory.
    async fn swap(&self, stage: Option<&str>, keep: &[RelPath]) -> Result<()> {
        let mut k = String::from("\n");
        for p in keep {
            k.push_str(p.as_str());
            k.push('\n');
        }
        self.script_ok(
            "import",
            SWAP_SCRIPT,
            vec![self.config.root.clone(), stage.unwrap_or("").to_owned(), k],
        )
        .await
        .map(|_| ())
    }

    fn resolve_cwd(&self, cwd: Option<&str>) -> Result<String> {
        match cwd {
            None => Ok(self.config.root.clone()),
            Some(c) if c.starts_with('/') => {
                if c.contains('\0') {
                    return Err(Error::invalid("cwd", "contains a NUL byte"));
                }
                Ok(c.to_owned())
            }
            Some(c) => Ok(RelPath::new(c)?.to_box(&self.config.root)),
        }
    }

    async fn record_ports(&self) -> Result<()> {
        if self.shared.options.exposed_ports.is_empty() {
            return Ok(());
        }
        let Some(c) = self.shared.inspect(&self.config.name).await? else {
            return Ok(());
        };
        let mut ports = BTreeMap::new();
        if let Some(map) = c.network_settings.and_then(|n| n.ports) {
            for (port, bindings) in map {
                let host = bindings
                    .unwrap_or_default()
                    .into_iter()
                    .find_map(|b| b.host_port.and_then(|p| p.parse::<u16>().ok()));
                if let Some(h) = host {
                    ports.insert(port, h);
                }
            }
        }
        self.live().host_ports = ports;
        Ok(())
    }

    /// Follow a symlink met by `read_file`, inside the box.
    fn link_target(from: &str, target: &str) -> String {
        if target.starts_with('/') {
            target.to_owned()
        } else {
            let dir = from.rsplit_once('/').map_or("", |(d, _)| d);
            format!("{dir}/{target}")
        }
    }
}

#[async_trait]
impl BoxHandle for DockerBox {
    fn backend(&self) -> &'static str {
        BACKEND
    }

    fn workspace_root(&self) -> &str {
        &self.config.root
    }

    fn state(&self) -> Box<dyn SandboxState> {
        let live = self.live();
        let id = live.id.clone().or_else(|| live.expected_id.clone());
        Box::new(state_of(&self.config, id, live.host_ports.clone()))
    }

    #[tracing::instrument(skip(self), fields(backend = BACKEND, container = %self.config.name))]
    async fn boot(&self) -> Result<()> {
        // A container that was stopped or replaced took its agent with it.
        self.drop_agent().await;
        let shared = &self.shared;
        let docker = shared.docker().await?;
        let name = &self.config.name;
        let (id, running, paused, created) = match shared.inspect(name).await? {
            Some(c) => {
                shared.check_owner(name, &c)?;
                let state = c.state.clone().unwrap_or_default();
                (
                    c.id.clone().unwrap_or_default(),
                    state.running == Some(true),
                    state.paused == Some(true),
                    false,
                )
            }
            None => {
                tracing::warn!(container = %name, "container is gone: creating a new one (its workspace must be restored)");
                (
                    shared.create_container(&self.config).await?,
                    false,
                    false,
                    true,
                )
            }
        };
        {
            let mut live = self.live();
            let same = live.expected_id.as_deref() == Some(id.as_str());
            if !same {
                if live.expected_id.is_some() {
                    tracing::warn!(container = %name, "the container is not the one the state knew: its workspace is lost");
                }
                live.lost = true;
            }
            if created {
                live.fresh = true;
            }
            live.id = Some(id.clone());
            live.expected_id = Some(id.clone());
        }
        if paused {
            docker
                .unpause_container(&id)
                .await
                .map_err(|e| shared.engine.err("unpause", "container", name, e))?;
        } else if !running {
            match docker.start_container(&id, None).await {
                Ok(()) => {}
                // Started concurrently: fine.
                Err(e) if crate::engine::status(&e) == Some(304) => {}
                Err(e) => return Err(shared.engine.err("start", "container", name, e)),
            }
            tracing::info!(container = %name, "container started");
        }
        let fresh = created || self.live().fresh;
        if fresh && let Some(user) = &shared.options.user {
            // The engine makes the working directory as root: give it to the user.
            let r = self
                .script(
                    "chown -- \"$1\" \"$2\"",
                    vec![user.clone(), self.config.root.clone()],
                    Some("0".into()),
                )
                .await?;
            if !r.success() {
                tracing::warn!(stderr = %r.stderr_str(), "cannot hand the workspace root to the user");
            }
        }
        self.record_ports().await?;
        self.prestart_agent();
        Ok(())
    }

    #[tracing::instrument(skip(self), fields(backend = BACKEND, container = %self.config.name))]
    async fn release(&self) -> Result<()> {
        self.drop_agent().await;
        match self.config.persistence {
            Persistence::Ephemeral => self.shared.remove(&self.config.name).await,
            Persistence::Keep => self.stop_container().await,
        }
    }

    async fn park(&self) -> Result<()> {
        self.drop_agent().await;
        self.stop_container().await
    }

    #[tracing::instrument(skip(self), fields(backend = BACKEND, container = %self.config.name))]
    async fn destroy(&self) -> Result<()> {
        self.drop_agent().await;
        match self.shared.inspect(&self.config.name).await? {
            None => Ok(()),
            Some(c) => {
                self.shared.check_owner(&self.config.name, &c)?;
                self.shared.remove(&self.config.name).await
            }
        }
    }

    async fn settle(&self) -> Result<()> {
        if self.inflight.idle(SETTLE_WITHIN).await {
            Ok(())
        } else {
            Err(Error::Timeout {
                operation: format!(
                    "killing {} commands of a cancelled call in container {}",
                    self.inflight.count(),
                    self.config.name
                ),
                after: SETTLE_WITHIN,
            })
        }
    }

    async fn workspace_exists(&self) -> Result<bool> {
        if self.live().lost {
            return Ok(false);
        }
        Ok(self
            .stat(&self.config.root)
            .await?
            .is_some_and(|m| m & GO_MODE_DIR != 0))
    }

    async fn exec(&self, request: ExecRequest) -> Result<ExecResult> {
        let cwd = self.resolve_cwd(request.cwd.as_deref())?;
        let mut env = self.base_env();
        for k in request.env.keys() {
            crate::options::check_env_name(k)?;
        }
        env.extend(request.env);
        self.run(ExecSpec {
            argv: request.command.to_argv(&["sh", "-c"]),
            env: env.into_iter().map(|(k, v)| format!("{k}={v}")).collect(),
            cwd: Some(cwd),
            user: self.user(),
            stdin: request.stdin,
            limits: request.limits,
            timeout: request
                .timeout
                .unwrap_or(self.shared.options.default_timeout),
            counted_by: Some(self.inflight.clone()),
        })
        .await
    }

    async fn list(&self) -> Result<Vec<TreeEntry>> {
        let token = format!("\u{1}{}\u{1}", uuid::Uuid::new_v4().simple());
        let r = self
            .script_ok(
                "list",
                LIST_SCRIPT,
                vec![self.config.root.clone(), token.clone()],
            )
            .await?;
        if r.stdout_truncated {
            return Err(Error::backend(
                BACKEND,
                "list",
                "listing larger than 256 MiB",
            ));
        }
        let mut entries = posix::parse_listing(BACKEND, &r.stdout, &token)?;
        entries.retain(|e| !sandbox_core::scripted::in_stage(&e.path));
        entries.sort_by(|a, b| a.path.cmp(&b.path));
        let sizes: BTreeMap<RelPath, u64> = entries
            .iter()
            .filter(|e| e.size > 0)
            .map(|e| (e.path.clone(), e.size))
            .collect();
        self.live().sizes = Some(Arc::new(sizes));
        Ok(entries)
    }

    async fn export(&self, request: &ExportRequest) -> Result<ByteStream> {
        let excludes = Excludes::new(request.exclude.clone(), &request.exclude_globs)?;
        let docker = self.shared.docker().await?;
        let download = {
            let (shared, target, root) =
                (self.shared.clone(), self.target(), self.config.root.clone());
            move |path: Option<&RelPath>| -> ByteStream {
                let boxed = path.map_or_else(|| root.clone(), |p| p.to_box(&root));
                let options = DownloadFromContainerOptionsBuilder::default()
                    .path(&boxed)
                    .build();
                let shared = shared.clone();
                docker
                    .download_from_container(&target, Some(options))
                    .map_err(move |e| shared.engine.err("download", "path", &boxed, e))
                    .boxed()
            }
        };
        let Some(paths) = &request.paths else {
            if self.stat(&self.config.root).await?.is_none() {
                return Err(Error::NotFound {
                    what: "workspace root",
                    key: self.config.root.clone(),
                });
            }
            let downloads = vec![Download {
                stream: download(None),
                prefix: None,
            }];
            let filter = tarfix::Filter {
                excludes,
                wanted: None,
                missing_ok: false,
                refetch: None,
            };
            return Ok(tarfix::export(downloads, filter));
        };
        let paths: Vec<RelPath> = paths
            .iter()
            .filter(|p| !excludes.covers(p))
            .cloned()
            .collect();
        // A few paths: one download each. More: one download of the deepest directory
        // holding them all, filtered here to the list (one engine archive call however many
        // files; the engine sets up the container's filesystem for every archive call, about
        // 45 ms, so a download per file is what made a first snapshot slow).
        // Taken, not kept: the listing is only held between a stop's listing and its export.
        let sizes = self.live().sizes.take();
        let downloads = match plan_export(&paths, sizes.as_deref()) {
            ExportPlan::EachPath => paths
                .iter()
                .map(|p| Download {
                    stream: download(Some(p)),
                    prefix: Some(p.clone()),
                })
                .collect(),
            ExportPlan::Common(common) => vec![Download {
                stream: download(common.as_ref()),
                prefix: common,
            }],
        };
        let filter = tarfix::Filter {
            excludes,
            wanted: Some(tarfix::Wanted::new(paths)),
            missing_ok: true,
            refetch: Some(Box::new(move |p: &RelPath| download(Some(p)))),
        };
        Ok(tarfix::export(downloads, filter))
    }

    async fn import(&self, archive: ByteStream, mode: ImportMode) -> Result<()> {
        match mode {
            ImportMode::Merge => self.merge(archive).await,
            ImportMode::Replace { keep } => self.replace(archive, keep).await,
            other => Err(Error::invalid(
                "import mode",
                format!("{other:?} is not supported"),
            )),
        }
    }

    async fn read_file(&self, path: &RelPath) -> Result<Bytes> {
        let docker = self.shared.docker().await?;
        let target = self.target();
        let mut boxed = path.to_box(&self.config.root);
        for _ in 0..16 {
            let options = DownloadFromContainerOptionsBuilder::default()
                .path(&boxed)
                .build();
            let shared = self.shared.clone();
            let shown = boxed.clone();
            let body: ByteStream = docker
                .download_from_container(&target, Some(options))
                .map_err(
                    move |e| match shared.engine.err("read", "file", &shown, e) {
                        Error::NotFound { .. } => Error::NotFound {
                            what: "file",
                            key: shown.clone(),
                        },
                        other => other,
                    },
                )
                .boxed();
            let single = tokio::task::spawn_blocking(move || {
                tarfix::read_single(stream::blocking_reader(body), READ_LIMIT)
            })
            .await
            .map_err(|e| Error::backend(BACKEND, "read", e.to_string()))??;
            match single {
                Single::File(data) => return Ok(Bytes::from(data)),
                Single::Symlink(to) => boxed = Self::link_target(&boxed, &to),
                Single::Dir => {
                    return Err(Error::invalid("file", format!("`{path}` is a directory")));
                }
                Single::Other => {
                    return Err(Error::invalid(
                        "file",
                        format!("`{path}` is not a regular file"),
                    ));
                }
            }
        }
        Err(Error::invalid(
            "file",
            format!("`{path}`: too many levels of symbolic links"),
        ))
    }

    async fn write_file(&self, path: &RelPath, data: Bytes, mode: u32) -> Result<()> {
        let tar = tarfix::file_tar(path, &data, mode)?;
        self.ensure_root().await?;
        let mut ancestors = BTreeSet::new();
        let mut p = path.parent();
        while let Some(a) = p {
            p = a.parent();
            ancestors.insert(a);
        }
        self.check_ancestors(&ancestors).await?;
        self.upload(&self.config.root, stream::once(tar)).await
    }

    async fn remove(&self, paths: &[RelPath]) -> Result<()> {
        if paths.is_empty() {
            return Ok(());
        }
        let mut args = vec![self.config.root.clone()];
        args.extend(paths.iter().map(|p| p.as_str().to_owned()));
        self.script_ok("remove", REMOVE_SCRIPT, args)
            .await
            .map(|_| ())
    }
}

/// The deepest path (by components) that is, or is an ancestor of, every path; `None` for the
/// workspace root.
/// How an export of a path list downloads from the engine.
#[derive(Debug, PartialEq, Eq)]
enum ExportPlan {
    /// One archive call per path.
    EachPath,
    /// One archive call for this directory (`None`: the workspace root), filtered to the list.
    Common(Option<RelPath>),
}

/// Choose the downloads for `paths`: a few paths one call each; more, one call for their
/// deepest common directory, unless the last listing (`sizes`: file sizes by path) shows the
/// bytes under it that are not asked for cost more than the calls it saves
/// ([`ARCHIVE_CALL_BYTES`] per call) — a few files changed across a large workspace are then
/// fetched one by one instead of downloading the whole workspace.
fn plan_export(paths: &[RelPath], sizes: Option<&BTreeMap<RelPath, u64>>) -> ExportPlan {
    if paths.len() <= PER_PATH_DOWNLOADS {
        return ExportPlan::EachPath;
    }
    let common = common_ancestor(paths);
    let Some(sizes) = sizes else {
        return ExportPlan::Common(common);
    };
    let under = |dir: &RelPath| -> u64 {
        sizes
            .range(dir.clone()..)
            .take_while(|(p, _)| p.as_str().starts_with(dir.as_str()))
            .filter(|(p, _)| p.starts_with(dir))
            .map(|(_, n)| n)
            .sum()
    };
    let whole: u64 = match &common {
        Some(dir) => under(dir),
        None => sizes.values().sum(),
    };
    let wanted = tarfix::Wanted::new(paths.to_vec());
    let asked: u64 = sizes
        .iter()
        .filter(|(p, _)| wanted.covers(p))
        .map(|(_, n)| n)
        .sum();
    let extra = whole.saturating_sub(asked);
    let saved = (paths.len() as u64 - 1).saturating_mul(ARCHIVE_CALL_BYTES);
    if extra <= saved {
        ExportPlan::Common(common)
    } else {
        ExportPlan::EachPath
    }
}

fn common_ancestor(paths: &[RelPath]) -> Option<RelPath> {
    let first = paths.first()?;
    let mut common: Vec<&str> = first.components().collect();
    for p in &paths[1..] {
        let same = common
            .iter()
            .zip(p.components())
            .take_while(|(a, b)| **a == *b)
            .count();
        common.truncate(same);
    }
    if common.is_empty() {
        None
    } else {
        RelPath::new(common.join("/")).ok()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn export_plans_weigh_calls_against_unlisted_bytes() {
        let p = |s: &str| RelPath::new(s).unwrap();
        let many: Vec<RelPath> = (0..10).map(|i| p(&format!("src/f{i}"))).collect();
        // A few paths: one call each, whatever the sizes.
        assert_eq!(plan_export(&many[..4], None), ExportPlan::EachPath);
        // More, nothing known: one call for their common directory.
        assert_eq!(plan_export(&many, None), ExportPlan::Common(Some(p("src"))));
        // The listing says the directory holds little else: one call.
        let mut sizes: BTreeMap<RelPath, u64> = many.iter().map(|q| (q.clone(), 1 << 20)).collect();
        sizes.insert(p("src/big"), 100 << 20);
        sizes.insert(p("srcother/huge"), 10 << 30); // beside `src`, not under it
        assert_eq!(
            plan_export(&many, Some(&sizes)),
            ExportPlan::Common(Some(p("src")))
        );
        // Ten files spread over a workspace holding 10 GiB more: one call per file.
        let spread: Vec<RelPath> = (0..10).map(|i| p(&format!("d{i}/f"))).collect();
        let mut sizes: BTreeMap<RelPath, u64> = spread.iter().map(|q| (q.clone(), 1000)).collect();
        sizes.insert(p("data/blob"), 10 << 30);
        assert_eq!(plan_export(&spread, Some(&sizes)), ExportPlan::EachPath);
        // Many files spread the same way: the saved calls outweigh the extra bytes.
        let lots: Vec<RelPath> = (0..1000).map(|i| p(&format!("d{i}/f"))).collect();
        let mut sizes: BTreeMap<RelPath, u64> = lots.iter().map(|q| (q.clone(), 1000)).collect();
        sizes.insert(p("data/blob"), 10 << 30);
        assert_eq!(plan_export(&lots, Some(&sizes)), ExportPlan::Common(None));
    }

    #[test]
    fn common_ancestors() {
        let p = |s: &str| RelPath::new(s).unwrap();
        assert_eq!(common_ancestor(&[p("a/b/c"), p("a/b/d")]), Some(p("a/b")));
        assert_eq!(common_ancestor(&[p("a/b"), p("a/bc")]), Some(p("a")));
        assert_eq!(common_ancestor(&[p("a/b"), p("c")]), None);
        assert_eq!(common_ancestor(&[p("a/b")]), Some(p("a/b")));
        assert_eq!(common_ancestor(&[p("a"), p("a/b")]), Some(p("a")));
        assert_eq!(common_ancestor(&[]), None);
    }

    #[test]
    fn config_debug_hides_env_values() {
        let config = BoxConfig {
            name: "sbx-1".into(),
            image: "img".into(),
            root: "/workspace".into(),
            key: None,
            persistence: Persistence::Ephemeral,
            binds: Vec::new(),
            spec_env: BTreeMap::from([("TOKEN".to_owned(), "s3cret".to_owned())]),
            extra: Vec::new(),
        };
        let shown = format!("{config:?}");
        assert!(
            shown.contains("TOKEN") && !shown.contains("s3cret"),
            "{shown}"
        );
    }
}
