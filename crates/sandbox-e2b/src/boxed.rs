//! [`E2bBox`]: one sandbox's primitives.

use std::collections::{BTreeMap, HashMap};
use std::fmt;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use sandbox_core::posix;
use sandbox_core::scripted::{self, ExitErrors, READ_LIMIT, ScriptRunner, no_errors};
use sandbox_core::stream::ByteStream;
use sandbox_core::{
    BoxHandle, CommonState, Error, ExecRequest, ExecResult, ExportRequest, ImportMode,
    IsolationKey, OutputLimits, Persistence, RelPath, Result, SandboxState, TreeEntry, async_trait,
};

use crate::BACKEND;
use crate::api::{CreateSpec, Sandbox};
use crate::client::Shared;
use crate::envd::{self, Command, Conn, KeepAlive};
use crate::state::E2bState;

/// Timeout of the backend's own helper commands.
const HELPER_TIMEOUT: Duration = Duration::from_secs(300);

/// Everything that describes a box apart from its live sandbox.
#[derive(Clone)]
pub(crate) struct BoxConfig {
    pub root: String,
    pub key: Option<IsolationKey>,
    pub persistence: Persistence,
    pub spec_env: BTreeMap<String, String>,
}

/// The spec's environment values are not printed: they may hold secrets.
impl fmt::Debug for BoxConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("BoxConfig")
            .field("root", &self.root)
            .field("key", &self.key)
            .field("persistence", &self.persistence)
            .field("spec_env", &self.spec_env.keys().collect::<Vec<_>>())
            .finish()
    }
}

#[derive(Debug, Default)]
struct Live {
    /// The sandbox the state knew, or the one this handle made.
    sandbox_id: Option<String>,
    /// What it was made from (a template, or a native snapshot's id).
    template: String,
    domain: Option<String>,
    /// The workspace cannot be trusted: the sandbox is not the one the state knew.
    lost: bool,
    /// The sandbox was made by this handle.
    fresh: bool,
    conn: Option<Arc<Conn>>,
}

/// One E2B sandbox. Made by [`crate::E2bClient`].
pub struct E2bBox {
    shared: Arc<Shared>,
    config: BoxConfig,
    live: Mutex<Live>,
}

impl fmt::Debug for E2bBox {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let live = self.live();
        f.debug_struct("E2bBox")
            .field("sandbox_id", &live.sandbox_id)
            .field("root", &self.config.root)
            .field("persistence", &self.config.persistence)
            .finish_non_exhaustive()
    }
}

/// Run `argv` in `dir` (a missing directory fails the command, as elsewhere).
fn in_dir(dir: &str, argv: Vec<String>) -> Vec<String> {
    let mut out = vec![
        "sh".to_owned(),
        "-c".to_owned(),
        "cd -- \"$1\" && shift && exec \"$@\"".to_owned(),
        "sh".to_owned(),
        dir.to_owned(),
    ];
    out.extend(argv);
    out
}

impl E2bBox {
    pub(crate) fn new(
        shared: Arc<Shared>,
        config: BoxConfig,
        sandbox_id: Option<String>,
        template: String,
        domain: Option<String>,
        lost: bool,
    ) -> Self {
        E2bBox {
            shared,
            config,
            live: Mutex::new(Live {
                sandbox_id,
                template,
                domain,
                lost,
                ..Live::default()
            }),
        }
    }

    /// The sandbox's id, once made.
    pub fn sandbox_id(&self) -> Option<String> {
        self.live().sandbox_id.clone()
    }

    fn live(&self) -> std::sync::MutexGuard<'_, Live> {
        self.live.lock().expect("live lock")
    }

    fn conn(&self) -> Result<Arc<Conn>> {
        self.live()
            .conn
            .clone()
            .ok_or_else(|| Error::backend(BACKEND, "envd", "the box is not booted (no sandbox)"))
    }

    /// Base environment of every command: options, then spec.
    fn base_env(&self) -> HashMap<String, String> {
        let mut env: HashMap<String, String> =
            self.shared.options.env.clone().into_iter().collect();
        env.extend(self.config.spec_env.clone());
        env
    }

    fn keepalive(&self, conn: &Conn) -> KeepAlive {
        let o = &self.shared.options;
        KeepAlive::new(
            conn.api().clone(),
            conn.sandbox_id().to_owned(),
            o.keepalive_period(),
            o.sandbox_timeout,
        )
    }

    /// Run `argv` to its end within `timeout`, extending the sandbox's life while it runs.
    async fn run(
        &self,
        argv: Vec<String>,
        env: HashMap<String, String>,
        stdin: Option<Bytes>,
        limits: OutputLimits,
        timeout: Duration,
    ) -> Result<ExecResult> {
        let conn = self.conn()?;
        let _keepalive = self.keepalive(&conn);
        envd::run(&conn, Command { argv, env }, stdin, limits, timeout).await
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

    /// Make a sandbox from `template` (the configured one, or a native snapshot id).
    async fn make(&self, template: &str) -> Result<Sandbox> {
        let o = &self.shared.options;
        let now = std::time::SystemTime::now();
        let mut metadata = o.metadata.clone();
        metadata.extend(sandbox_cloud::owner::tags(
            &o.owner,
            self.config.key.as_ref(),
            now,
            Some(now + o.max_age),
        ));
        let empty = BTreeMap::new();
        self.shared
            .api
            .create(CreateSpec {
                template,
                timeout: o.sandbox_timeout,
                metadata,
                env: &empty,
                secure: o.secure,
            })
            .await
    }

    /// Use `sandbox` from now on: its envd, once it answers.
    async fn attach(&self, mut sandbox: Sandbox) -> Result<()> {
        let o = &self.shared.options;
        if sandbox.token.is_none() && o.secure {
            // `connect` may answer without the token: the detail has it.
            if let Some(d) = self.shared.api.get(&sandbox.id).await? {
                sandbox.token = d.token;
                sandbox.domain = sandbox.domain.or(d.domain);
            }
        }
        let domain = sandbox.domain.clone().unwrap_or_else(|| o.domain.clone());
        let conn = Arc::new(Conn::new(
            self.shared.api.clone(),
            self.shared.envd_http.clone(),
            o.sandbox_url.clone(),
            domain,
            sandbox.id.clone(),
            sandbox.token.clone(),
        ));
        let began = Instant::now();
        let mut wait = Duration::from_millis(50);
        while !conn.healthy().await {
            if began.elapsed() > o.ready_timeout {
                return Err(Error::Timeout {
                    operation: format!("waiting for envd of e2b sandbox {}", sandbox.id),
                    after: o.ready_timeout,
                });
            }
            tokio::time::sleep(wait).await;
            wait = (wait * 2).min(Duration::from_secs(1));
        }
        let mut live = self.live();
        live.sandbox_id = Some(sandbox.id.clone());
        live.domain = sandbox.domain;
        live.conn = Some(conn);
        Ok(())
    }

    async fn kill_current(&self) -> Result<()> {
        let id = {
            let mut live = self.live();
            live.conn = None;
            live.sandbox_id.take()
        };
        if let Some(id) = id {
            self.shared.api.delete(&id).await?;
        }
        Ok(())
    }
}

/// The box runs core's workspace scripts through envd.
#[async_trait]
impl ScriptRunner for E2bBox {
    fn backend(&self) -> &'static str {
        BACKEND
    }

    /// Archives and files go through envd's `POST /files` (a streamed octet-stream body).
    fn can_upload(&self) -> bool {
        true
    }

    async fn upload(&self, path: &str, data: ByteStream) -> Result<()> {
        self.conn()?.upload_stream(path, data).await
    }

    fn root(&self) -> &str {
        &self.config.root
    }

    async fn script(
        &self,
        operation: &'static str,
        script: &str,
        args: Vec<String>,
        limit: usize,
        errors: ExitErrors,
    ) -> Result<ExecResult> {
        let mut argv = vec!["sh".into(), "-c".into(), script.into(), "sandbox".into()];
        argv.extend(args);
        let r = self
            .run(
                argv,
                HashMap::new(),
                None,
                OutputLimits::both(limit),
                HELPER_TIMEOUT,
            )
            .await?;
        if r.success() {
            return Ok(r);
        }
        let stderr = r.stderr_str();
        if let Some(e) = r.exit_code.and_then(|c| errors(c, stderr.trim())) {
            return Err(e);
        }
        Err(Error::backend(
            BACKEND,
            operation,
            format!("helper exited with {:?}: {}", r.exit_code, stderr.trim()),
        ))
    }

    async fn stream_script(
        &self,
        _operation: &'static str,
        script: &str,
        args: Vec<String>,
        input: Option<ByteStream>,
        errors: ExitErrors,
    ) -> Result<ByteStream> {
        let mut argv = vec!["sh".into(), "-c".into(), script.into(), "sandbox".into()];
        argv.extend(args);
        let conn = self.conn()?;
        let keepalive = self.keepalive(&conn);
        envd::run_streaming(
            &conn,
            Command {
                argv,
                env: HashMap::new(),
            },
            input,
            errors,
            keepalive,
        )
        .await
    }
}

#[async_trait]
impl BoxHandle for E2bBox {
    fn backend(&self) -> &'static str {
        BACKEND
    }

    fn workspace_root(&self) -> &str {
        &self.config.root
    }

    fn state(&self) -> Box<dyn SandboxState> {
        let live = self.live();
        Box::new(E2bState {
            common: CommonState::new(self.config.root.clone()),
            sandbox_id: live.sandbox_id.clone(),
            template: live.template.clone(),
            domain: live.domain.clone(),
            persistence: self.config.persistence,
            key: self.config.key.clone(),
        })
    }

    #[tracing::instrument(skip(self), fields(backend = BACKEND))]
    async fn boot(&self) -> Result<()> {
        let o = &self.shared.options;
        let known = {
            let live = self.live();
            if live.conn.is_some() {
                return Ok(());
            }
            live.sandbox_id.clone()
        };
        let sandbox = match known {
            Some(id) => match self.shared.api.connect(&id, o.sandbox_timeout).await? {
                Some(s) => {
                    tracing::info!(sandbox = %id, "sandbox reattached");
                    s
                }
                None => {
                    tracing::warn!(sandbox = %id, "the sandbox is gone: making a new one (its workspace must be restored)");
                    let template = o.template.clone();
                    let s = self.make(&template).await?;
                    let mut live = self.live();
                    live.lost = true;
                    live.fresh = true;
                    live.template = template;
                    s
                }
            },
            None => {
                let template = self.live().template.clone();
                let s = self.make(&template).await?;
                self.live().fresh = true;
                s
            }
        };
        let id = sandbox.id.clone();
        if let Err(e) = self.attach(sandbox).await {
            if self.live().fresh {
                // A sandbox that never answered is of no use to anyone.
                let _ = self.shared.api.delete(&id).await;
                self.live().sandbox_id = None;
                return Err(e);
            }
            // The API still lists it, but its envd never answers (its VM is gone): replace it.
            tracing::warn!(sandbox = %id, error = %e, "the sandbox does not answer: making a new one (its workspace must be restored)");
            if let Err(d) = self.shared.api.delete(&id).await {
                tracing::warn!(sandbox = %id, error = %d, "removing the silent sandbox");
            }
            let template = o.template.clone();
            let s = self.make(&template).await?;
            let new_id = s.id.clone();
            {
                let mut live = self.live();
                live.sandbox_id = None;
                live.lost = true;
                live.fresh = true;
                live.template = template;
            }
            if let Err(e) = self.attach(s).await {
                let _ = self.shared.api.delete(&new_id).await;
                return Err(e);
            }
        }
        tracing::info!(sandbox = ?self.live().sandbox_id, "sandbox ready");
        if self.live().fresh {
            self.script(
                "boot",
                "mkdir -p -- \"$1\"",
                vec![self.config.root.clone()],
                4096,
                no_errors,
            )
            .await?;
        }
        Ok(())
    }

    #[tracing::instrument(skip(self), fields(backend = BACKEND))]
    async fn release(&self) -> Result<()> {
        match self.config.persistence {
            Persistence::Ephemeral => self.kill_current().await,
            Persistence::Keep => self.park().await,
        }
    }

    #[tracing::instrument(skip(self), fields(backend = BACKEND))]
    async fn park(&self) -> Result<()> {
        let id = {
            let mut live = self.live();
            live.conn = None;
            live.sandbox_id.clone()
        };
        match id {
            // Paused, it keeps memory and disk until resumed by `connect`.
            Some(id) => self.shared.api.pause(&id).await,
            None => Ok(()),
        }
    }

    #[tracing::instrument(skip(self), fields(backend = BACKEND))]
    async fn destroy(&self) -> Result<()> {
        self.kill_current().await
    }

    async fn workspace_exists(&self) -> Result<bool> {
        if self.live().lost {
            return Ok(false);
        }
        scripted::root_exists(self).await
    }

    #[tracing::instrument(skip_all, fields(backend = BACKEND, program = request.command.program()))]
    async fn exec(&self, request: ExecRequest) -> Result<ExecResult> {
        let cwd = self.resolve_cwd(request.cwd.as_deref())?;
        let mut env = self.base_env();
        for k in request.env.keys() {
            posix::check_env_name(k)?;
        }
        env.extend(request.env);
        self.run(
            in_dir(&cwd, request.command.to_argv(&["sh", "-c"])),
            env,
            request.stdin,
            request.limits,
            request
                .timeout
                .unwrap_or(self.shared.options.default_timeout),
        )
        .await
    }

    async fn list(&self) -> Result<Vec<TreeEntry>> {
        scripted::list(self).await
    }

    async fn export(&self, request: &ExportRequest) -> Result<ByteStream> {
        scripted::export(self, request).await
    }

    async fn import(&self, archive: ByteStream, mode: ImportMode) -> Result<()> {
        scripted::import(self, archive, mode).await
    }

    async fn read_file(&self, path: &RelPath) -> Result<Bytes> {
        let boxed = path.to_box(&self.config.root);
        // Refuse what the file API would follow or misreport: a directory, a symlink out.
        let r = self
            .script(
                "read",
                "[ -d \"$1\" ] && { echo dir; exit 0; }; [ -e \"$1\" ] || { echo missing; exit 0; }; echo file",
                vec![boxed.clone()],
                4096,
                no_errors,
            )
            .await?;
        match r.stdout_str().trim() {
            "dir" => return Err(Error::invalid("file", format!("`{path}` is a directory"))),
            "missing" => {
                return Err(Error::NotFound {
                    what: "file",
                    key: boxed,
                });
            }
            _ => {}
        }
        let data = self.conn()?.read_file(&boxed).await?;
        if data.len() > READ_LIMIT {
            return Err(Error::invalid(
                "file",
                format!("`{path}` is larger than 1 GiB"),
            ));
        }
        Ok(data)
    }

    async fn write_file(&self, path: &RelPath, data: Bytes, mode: u32) -> Result<()> {
        scripted::write_file(self, path, data, mode).await
    }

    async fn remove(&self, paths: &[RelPath]) -> Result<()> {
        scripted::remove(self, paths).await
    }

    #[tracing::instrument(skip(self), fields(backend = BACKEND))]
    async fn native_snapshot(&self) -> Result<String> {
        self.shared.check_native()?;
        let id =
            self.live().sandbox_id.clone().ok_or_else(|| {
                Error::backend(BACKEND, "native snapshot", "the box has no sandbox")
            })?;
        let snapshot = self.shared.api.snapshot(&id).await?;
        tracing::info!(sandbox = %id, %snapshot, "native snapshot taken");
        Ok(snapshot)
    }

    #[tracing::instrument(skip(self), fields(backend = BACKEND))]
    async fn restore_native(&self, reference: &str) -> Result<()> {
        self.shared.check_native()?;
        if reference.is_empty() || reference.contains('/') {
            return Err(Error::invalid(
                "native snapshot",
                format!("`{reference}` is not an e2b snapshot id"),
            ));
        }
        self.kill_current().await?;
        let sandbox = match self.make(reference).await {
            Err(Error::NotFound { .. }) => {
                return Err(Error::NotFound {
                    what: "e2b snapshot",
                    key: reference.to_owned(),
                });
            }
            r => r?,
        };
        let id = sandbox.id.clone();
        {
            let mut live = self.live();
            live.template = reference.to_owned();
            live.fresh = true;
            live.lost = false;
        }
        if let Err(e) = self.attach(sandbox).await {
            let _ = self.shared.api.delete(&id).await;
            self.live().sandbox_id = None;
            return Err(e);
        }
        tracing::info!(sandbox = %id, snapshot = %reference, "sandbox restored from a native snapshot");
        Ok(())
    }
}
