//! [`LocalClient`]: makes and finds box directories.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use async_trait::async_trait;
use sandbox_core::{
    BoxHandle, Capabilities, CreateRequest, Error, ExecFeatures, LeftoverReport, LeftoverSweep,
    OwnedBox, Result, SandboxClient, SandboxState, WorkspaceSpec, not_supported,
};

use crate::BACKEND;
use crate::confined::Slot;
use crate::fsutil::{self, BindLink};
use crate::handle::{BoxParts, LocalBox};
use crate::options::{Isolation, LocalOptions};
use crate::state::LocalState;

/// The local backend's client: one box is a directory under
/// [`LocalOptions::base_dir`], commands run as host processes.
#[derive(Debug, Clone)]
pub struct LocalClient {
    options: Arc<LocalOptions>,
    /// The canonical base directory, once made.
    base: Arc<std::sync::OnceLock<PathBuf>>,
}

impl LocalClient {
    /// A client with `options`. Nothing is touched on disk until a box is created; how
    /// commands are tracked for their tree kill is detected in the background from here, so
    /// the first call does not wait for that probe.
    pub fn new(options: LocalOptions) -> Self {
        sandbox_core::host::detect_tree_kill_in_background();
        LocalClient {
            options: Arc::new(options),
            base: Arc::default(),
        }
    }

    /// The options.
    pub fn options(&self) -> &LocalOptions {
        &self.options
    }

    /// What a box of this client gets, found by starting (and stopping) one: `None` for
    /// [`Isolation::HostShell`]; [`Error::IsolationUnavailable`] naming the missing piece
    /// when the kernel refuses a required one.
    pub async fn probe(&self) -> Result<Option<sandbox_confine::Report>> {
        let Isolation::Confined(options) = &self.options.isolation else {
            return Ok(None);
        };
        let options = options.clone();
        let report = tokio::task::spawn_blocking(move || {
            sandbox_confine::Confined::start(&options, &[]).map(|c| c.report().clone())
        })
        .await
        .map_err(|e| Error::backend(BACKEND, "probe", e.to_string()))?
        .map_err(crate::confined::to_error)?;
        Ok(Some(report))
    }

    /// The base directory, created if missing, as a canonical path (so workspace roots are
    /// canonical and path checks compare like with like). Made and resolved on first use only:
    /// a box directory is created with its missing parents, so a base removed later comes
    /// back with the next box.
    async fn base_dir(&self) -> Result<PathBuf> {
        if let Some(base) = self.base.get() {
            return Ok(base.clone());
        }
        let base = self.options.base_dir.clone();
        let canonical = tokio::task::spawn_blocking(move || {
            std::fs::create_dir_all(&base).map_err(|e| Error::io(&base, e))?;
            let canonical = std::fs::canonicalize(&base).map_err(|e| Error::io(&base, e))?;
            if canonical.to_str().is_none() {
                return Err(Error::invalid(
                    "local base directory",
                    format!("{} is not valid UTF-8", canonical.display()),
                ));
            }
            Ok(canonical)
        })
        .await
        .map_err(|e| Error::backend(BACKEND, "create", e.to_string()))??;
        Ok(self.base.get_or_init(|| canonical).clone())
    }

    fn open(
        &self,
        box_dir: PathBuf,
        key: Option<String>,
        spec: &WorkspaceSpec,
    ) -> Result<LocalBox> {
        let links = bind_links(spec, &self.options.isolation)?;
        let confined = match &self.options.isolation {
            Isolation::Confined(o) => Some(Slot::new(o.clone(), box_dir.clone(), &links)),
            Isolation::HostShell => None,
        };
        LocalBox::new(BoxParts {
            box_dir,
            key,
            options: self.options.clone(),
            spec_env: spec.env.clone(),
            links,
            confined,
        })
    }
}

/// The spec's bind mounts as links; what the local backend cannot honour is refused.
fn bind_links(spec: &WorkspaceSpec, isolation: &Isolation) -> Result<Vec<BindLink>> {
    if spec.root.is_some() {
        // The workspace is always `<box dir>/workspace`; silently using another root than
        // the one asked for would put files where the caller does not expect them.
        return Err(not_supported(BACKEND, "custom workspace root"));
    }
    spec.bind_mounts()
        .map(|(path, host, read_only)| {
            if read_only && !isolation.is_confined() {
                // A symlink cannot make its target read-only; a confined box mounts it so.
                Err(not_supported(BACKEND, "read-only bind mount"))
            } else if !host.is_absolute() {
                Err(Error::invalid(
                    "bind mount",
                    format!("the host path {} is not absolute", host.display()),
                ))
            } else {
                Ok(BindLink {
                    path: path.clone(),
                    host: host.clone(),
                    read_only,
                })
            }
        })
        .collect()
}

/// A state's box directory must be a box name directly under this client's base directory:
/// state JSON is input, and `delete` removes that directory recursively.
fn check_box_dir(box_dir: &Path, base: &Path) -> Result<()> {
    let name_ok = box_dir
        .file_name()
        .and_then(|n| n.to_str())
        .is_some_and(fsutil::is_box_name);
    if name_ok && box_dir.parent() == Some(base) {
        Ok(())
    } else {
        Err(Error::invalid(
            "local state",
            format!(
                "box directory {} is not a box under this client's base directory {}",
                box_dir.display(),
                base.display()
            ),
        ))
    }
}

/// The owner marker of `box_dir`, `None` if there is none (or no directory).
fn read_marker(box_dir: &Path) -> Result<Option<fsutil::Marker>> {
    let path = box_dir.join(fsutil::MARKER);
    match std::fs::read(&path) {
        Ok(bytes) => Ok(serde_json::from_slice::<fsutil::Marker>(&bytes)
            .ok()
            .filter(|m| m.backend == BACKEND)),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(Error::io(path, e)),
    }
}

async fn check_owner(box_dir: PathBuf, key: Option<String>) -> Result<()> {
    tokio::task::spawn_blocking(move || fsutil::check_owner(&box_dir, key.as_deref()))
        .await
        .map_err(|e| Error::backend(BACKEND, "create", e.to_string()))?
}

#[async_trait]
impl SandboxClient for LocalClient {
    fn backend(&self) -> &'static str {
        BACKEND
    }

    fn capabilities(&self) -> Capabilities {
        let mut caps = Capabilities::default();
        caps.keep = true;
        caps.bind_mounts = true;
        let confined = self.options.isolation.is_confined();
        caps.read_only_bind_mounts = confined;
        caps.isolated = confined;
        // Export and import are plain file operations on the host: they never block each other.
        caps.concurrent_transfers = true;
        caps.exec = ExecFeatures::all();
        // Processes that leave the command's process group die too only where a cgroup
        // tracks them (detected once per process); in a confined box each command's PID
        // namespace makes the kill total.
        caps.exec.tree_kill = confined || sandbox_core::host::tree_kill().kills_escaped();
        caps
    }

    #[tracing::instrument(skip_all, fields(backend = BACKEND, key = request.key.map(|k| k.as_str())))]
    async fn create(&self, request: CreateRequest<'_>) -> Result<Box<dyn BoxHandle>> {
        bind_links(request.spec, &self.options.isolation)?;
        let base = self.base_dir().await?;
        // Only a kept box is found again by its key; an ephemeral one is the call's alone.
        let name = match request.key {
            Some(key) if self.options.persistence == sandbox_core::Persistence::Keep => {
                format!("k-{}", key.digest())
            }
            _ => format!("b-{}", uuid::Uuid::new_v4()),
        };
        let box_dir = base.join(name);
        let key = request.key.map(|k| k.as_str().to_owned());
        // The same key always names the same directory: adopt it if it is ours for this key,
        // refuse it otherwise.
        check_owner(box_dir.clone(), key.clone()).await?;
        let handle = self.open(box_dir, key, request.spec)?;
        tracing::debug!(?handle, "box created");
        Ok(Box::new(handle))
    }

    async fn resume(
        &self,
        state: &dyn SandboxState,
        spec: &WorkspaceSpec,
    ) -> Result<Box<dyn BoxHandle>> {
        let state = state.downcast::<LocalState>(BACKEND)?;
        bind_links(spec, &self.options.isolation)?;
        let base = self.base_dir().await?;
        if self.options.persistence == sandbox_core::Persistence::Ephemeral {
            // An ephemeral box did not outlive its call (or holds a call's unsaved work, or
            // was left by a call that died), and may have lived on another host: never
            // continue in it. A box of its own here; the workspace comes back from the
            // snapshot. (The state's directory is not touched, so it needs no check.)
            let box_dir = base.join(format!("b-{}", uuid::Uuid::new_v4()));
            return Ok(Box::new(self.open(box_dir, state.key.clone(), spec)?));
        }
        check_box_dir(&state.box_dir, &base)?;
        // The directory may be gone (boot recreates it); if it is there it must be ours.
        check_owner(state.box_dir.clone(), state.key.clone()).await?;
        Ok(Box::new(self.open(
            state.box_dir.clone(),
            state.key.clone(),
            spec,
        )?))
    }

    async fn list_owned(&self) -> Result<Vec<OwnedBox>> {
        let base = self.base_dir().await?;
        tokio::task::spawn_blocking(move || {
            let mut out = Vec::new();
            for entry in std::fs::read_dir(&base).map_err(|e| Error::io(&base, e))? {
                let entry = entry.map_err(|e| Error::io(&base, e))?;
                let Some(name) = entry.file_name().to_str().map(str::to_owned) else {
                    continue;
                };
                if !fsutil::is_box_name(&name) {
                    continue;
                }
                // Only directories with our marker are ours.
                if let Some(marker) = read_marker(&entry.path())? {
                    out.push(OwnedBox::new(
                        name,
                        marker.key,
                        Some(marker.created_unix_ms as i64),
                    ));
                }
            }
            Ok(out)
        })
        .await
        .map_err(|e| Error::backend(BACKEND, "list_owned", e.to_string()))?
    }

    fn box_id(&self, state: &dyn SandboxState) -> Result<String> {
        let state = state.downcast::<LocalState>(BACKEND)?;
        state
            .box_dir
            .file_name()
            .and_then(|n| n.to_str())
            .map(str::to_owned)
            .ok_or_else(|| Error::invalid("local state", "the box directory has no name"))
    }

    async fn remove_owned(&self, id: &str) -> Result<()> {
        let base = self.base_dir().await?;
        let box_dir = base.join(id);
        check_box_dir(&box_dir, &base)?;
        tokio::task::spawn_blocking(move || {
            let Some(marker) = read_marker(&box_dir)? else {
                return if box_dir.exists() {
                    Err(Error::Conflict {
                        key: box_dir.display().to_string(),
                        reason: "no owner marker: not a box of this backend".into(),
                    })
                } else {
                    Ok(())
                };
            };
            fsutil::check_owner(&box_dir, marker.key.as_deref())?;
            fsutil::remove_box_dir(&box_dir).map_err(|e| Error::io(&box_dir, e))
        })
        .await
        .map_err(|e| Error::backend(BACKEND, "remove_owned", e.to_string()))?
    }

    async fn delete(&self, state: &dyn SandboxState) -> Result<()> {
        let state = state.downcast::<LocalState>(BACKEND)?;
        let base = self.base_dir().await?;
        if state.persistence == sandbox_core::Persistence::Ephemeral
            && state.box_dir.parent() != Some(base.as_path())
        {
            // An ephemeral box of another host (replica): it was removed when its call ended,
            // or is that host's to collect. Nothing of it is here.
            return Ok(());
        }
        check_box_dir(&state.box_dir, &base)?;
        let (box_dir, key) = (state.box_dir.clone(), state.key.clone());
        tokio::task::spawn_blocking(move || {
            fsutil::check_owner(&box_dir, key.as_deref())?;
            fsutil::remove_box_dir(&box_dir).map_err(|e| Error::io(&box_dir, e))
        })
        .await
        .map_err(|e| Error::backend(BACKEND, "delete", e.to_string()))?
    }

    /// `.creating-*` and `.trash-*` directories of the base directory, and box-named
    /// directories without their marker, older than the grace period.
    async fn sweep_leftovers(&self, sweep: LeftoverSweep) -> Result<LeftoverReport> {
        let base = self.base_dir().await?;
        tokio::task::spawn_blocking(move || fsutil::sweep_leftovers(&base, sweep))
            .await
            .map_err(|e| Error::backend(BACKEND, "sweep_leftovers", e.to_string()))?
    }
}
