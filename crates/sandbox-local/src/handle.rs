//! [`LocalBox`]: one box's primitives on the host filesystem.

use std::collections::BTreeMap;
use std::fmt;
use std::fs;
use std::io::{self, Read as _};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use async_trait::async_trait;
use bytes::Bytes;
use sandbox_core::archive::{self, ArchivePolicy, Excludes};
use sandbox_core::beneath::{Anchor, Dir, Follow};
use sandbox_core::stream::ByteStream;
use sandbox_core::{
    BoxHandle, CommonState, Error, ExecRequest, ExecResult, ExportRequest, ImportMode, Inflight,
    Persistence, RelPath, Result, SandboxState, TreeEntry,
};

use crate::BACKEND;
use crate::confined::Slot;
use crate::exec::{self, ExecContext};
use crate::fsutil::{self, BindLink, OLD_PREFIX, STAGING_PREFIX};
use crate::options::LocalOptions;
use crate::state::LocalState;

/// A box of the local backend: the directory `<base_dir>/<name>` with the workspace in its
/// `workspace` subdirectory.
pub(crate) struct LocalBox {
    inner: Arc<Inner>,
}

struct Inner {
    box_dir: PathBuf,
    workspace: PathBuf,
    workspace_str: String,
    key: Option<String>,
    persistence: Persistence,
    options: Arc<LocalOptions>,
    spec_env: BTreeMap<String, String>,
    links: Vec<BindLink>,
    /// Commands (until everything they started is dead) and blocking file operations still
    /// under way, also ones whose futures were dropped: what `settle` waits for.
    inflight: Inflight,
    /// The confined box's init (`None`: host shell).
    confined: Option<Slot>,
}

/// How long `settle` waits for a cancelled call's commands and file operations.
const SETTLE_WITHIN: std::time::Duration = std::time::Duration::from_secs(60);

/// Everything a box needs, gathered by the client.
pub(crate) struct BoxParts {
    pub box_dir: PathBuf,
    pub key: Option<String>,
    pub options: Arc<LocalOptions>,
    pub spec_env: BTreeMap<String, String>,
    pub links: Vec<BindLink>,
    pub confined: Option<Slot>,
}

impl LocalBox {
    /// A handle on `parts.box_dir`, whose path must be valid UTF-8 (the workspace root is a
    /// string in the state).
    pub(crate) fn new(parts: BoxParts) -> Result<LocalBox> {
        let workspace = parts.box_dir.join(fsutil::WORKSPACE);
        let workspace_str = workspace
            .to_str()
            .ok_or_else(|| {
                Error::invalid(
                    "local base directory",
                    format!("{} is not valid UTF-8", workspace.display()),
                )
            })?
            .to_owned();
        Ok(LocalBox {
            inner: Arc::new(Inner {
                box_dir: parts.box_dir,
                workspace,
                workspace_str,
                key: parts.key,
                persistence: parts.options.persistence,
                options: parts.options,
                spec_env: parts.spec_env,
                links: parts.links,
                inflight: Inflight::new(),
                confined: parts.confined,
            }),
        })
    }

    /// Shut the confined box's init down (everything running in the box dies).
    async fn stop_confined(&self) -> Result<()> {
        match &self.inner.confined {
            Some(slot) => slot.shutdown().await,
            None => Ok(()),
        }
    }

    /// Run blocking filesystem work on a blocking thread.
    async fn blocking<T, F>(&self, operation: &'static str, f: F) -> Result<T>
    where
        T: Send + 'static,
        F: FnOnce(&Inner) -> Result<T> + Send + 'static,
    {
        let inner = self.inner.clone();
        // Counted until the closure returns, also when this future is dropped before.
        let counted = inner.inflight.enter();
        tokio::task::spawn_blocking(move || {
            let _counted = counted;
            f(&inner)
        })
        .await
        .map_err(|e| Error::backend(BACKEND, operation, e.to_string()))?
    }
}

/// Env values are not printed: they may hold secrets.
impl fmt::Debug for LocalBox {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let i = &self.inner;
        f.debug_struct("LocalBox")
            .field("box_dir", &i.box_dir)
            .field("key", &i.key)
            .field("persistence", &i.persistence)
            .field("spec_env", &i.spec_env.keys().collect::<Vec<_>>())
            .field("bind_links", &i.links)
            .finish_non_exhaustive()
    }
}

impl Inner {
    fn require_workspace(&self) -> Result<()> {
        if fsutil::is_real_dir(&self.workspace)? {
            Ok(())
        } else {
            Err(Error::NotFound {
                what: "workspace",
                key: self.workspace_str.clone(),
            })
        }
    }

    fn remove_box(&self) -> Result<()> {
        fsutil::remove_box_dir(&self.box_dir).map_err(|e| Error::io(&self.box_dir, e))
    }

    /// The workspace directory, opened (a symlink in its place is refused, as a workspace
    /// that is not a directory).
    fn workspace_dir(&self) -> Result<Dir> {
        Dir::open(&self.workspace).map_err(|e| match e.kind() {
            io::ErrorKind::NotFound | io::ErrorKind::NotADirectory => Error::NotFound {
                what: "workspace",
                key: self.workspace_str.clone(),
            },
            _ => Error::io(&self.workspace, e),
        })
    }

    /// Read beneath the workspace handle (or a bind mount's): symlinks are followed while they
    /// stay beneath it, and absolute ones into a declared bind mount's host directory; the
    /// file is opened once, then checked and read through that handle.
    fn read_file(&self, path: &RelPath) -> Result<Bytes> {
        let abs = path.to_host(&self.workspace);
        let workspace = self.workspace_dir()?;
        let (root, rel) = fsutil::route(
            workspace
                .try_clone()
                .map_err(|e| Error::io(&self.workspace, e))?,
            &self.links,
            path,
        )
        .map_err(|e| Error::io(&abs, e))?;
        let binds = fsutil::open_bind_roots(&self.links);
        // An absolute link back into the workspace is followed too.
        let mut anchors = fsutil::anchors(&binds);
        anchors.push(Anchor {
            path: &self.workspace,
            dir: &workspace,
        });
        let mut file = root
            .read_file_anchored(&rel, &anchors)
            .map_err(|e| match e.kind() {
                io::ErrorKind::NotFound => Error::NotFound {
                    what: "file",
                    key: path.to_string(),
                },
                _ => fsutil::resolution_error(path, &abs, e),
            })?;
        let meta = file.metadata().map_err(|e| Error::io(&abs, e))?;
        if meta.is_dir() {
            return Err(Error::invalid("file", format!("`{path}` is a directory")));
        }
        // The size is only a hint (a sparse file may claim terabytes).
        let mut data = Vec::with_capacity(sandbox_core::stream::capacity_for(meta.len()));
        file.read_to_end(&mut data)
            .map_err(|e| Error::io(&abs, e))?;
        Ok(Bytes::from(data))
    }

    /// Write atomically in the parent's handle: parents are created, never passed through a
    /// symlink; a temporary file beside the name, then `renameat` over it (a symlink there is
    /// replaced, never followed).
    fn write_file(&self, path: &RelPath, data: &[u8], mode: u32) -> Result<()> {
        fsutil::check_writable(&self.links, path)?;
        let abs = path.to_host(&self.workspace);
        let (root, rel) = fsutil::route(self.workspace_dir()?, &self.links, path)
            .map_err(|e| Error::io(&abs, e))?;
        let (parent, name) = root
            .parent_of(&rel, Follow::Never, true)
            .map_err(|e| fsutil::resolution_error(path, &abs, e))?;
        // Set-id bits are dropped, as for archive entries.
        parent
            .write_atomic(name, data, mode & 0o1777)
            .map_err(|e| Error::io(&abs, e))
    }

    /// Remove in the parent's handle, never passing through a symlink; a link is removed as
    /// a link. A path whose parents are missing (or not directories) has nothing to remove.
    fn remove(&self, paths: &[RelPath]) -> Result<()> {
        let workspace = match self.workspace_dir() {
            Ok(dir) => dir,
            Err(Error::NotFound { .. }) => return Ok(()),
            Err(e) => return Err(e),
        };
        for path in paths {
            fsutil::check_writable(&self.links, path)?;
            let abs = path.to_host(&self.workspace);
            let workspace = workspace
                .try_clone()
                .map_err(|e| Error::io(&self.workspace, e))?;
            let (root, rel) =
                fsutil::route(workspace, &self.links, path).map_err(|e| Error::io(&abs, e))?;
            let (parent, name) = match root.parent_of(&rel, Follow::Never, false) {
                Ok(found) => found,
                Err(e)
                    if matches!(
                        e.kind(),
                        io::ErrorKind::NotFound | io::ErrorKind::NotADirectory
                    ) =>
                {
                    continue;
                }
                Err(e) => return Err(fsutil::resolution_error(path, &abs, e)),
            };
            parent.remove_all(name).map_err(|e| Error::io(&abs, e))?;
        }
        Ok(())
    }

    /// The part of a Replace import after the archive was staged completely: carry `keep`
    /// over, add the bind links, swap. Any failure puts the kept paths back and leaves the live
    /// workspace as it was.
    fn swap_in(&self, staging: &Path, keep: &[RelPath]) -> Result<()> {
        let mut moved: Vec<(PathBuf, PathBuf)> = Vec::new();
        let result = self
            .carry_over(staging, keep, &mut moved)
            .and_then(|()| fsutil::install_bind_links(staging, &self.links))
            .and_then(|()| self.swap(staging));
        if result.is_err() {
            for (live, staged) in moved.iter().rev() {
                if let Err(e) = fs::rename(staged, live) {
                    tracing::error!(path = %live.display(), error = %e, "cannot put a kept path back into the workspace");
                }
            }
        }
        result
    }

    fn carry_over(
        &self,
        staging: &Path,
        keep: &[RelPath],
        moved: &mut Vec<(PathBuf, PathBuf)>,
    ) -> Result<()> {
        for path in keep {
            if !fsutil::parents_are_dirs(&self.workspace, path)? {
                continue;
            }
            let live = path.to_host(&self.workspace);
            match fs::symlink_metadata(&live) {
                Ok(_) => {}
                Err(e) if e.kind() == io::ErrorKind::NotFound => continue,
                Err(e) => return Err(Error::io(&live, e)),
            }
            let staged = fsutil::ensure_parents_of(staging, path)?;
            fsutil::remove_any(&staged).map_err(|e| Error::io(&staged, e))?;
            fs::rename(&live, &staged).map_err(|e| Error::io(&live, e))?;
            moved.push((live, staged));
        }
        Ok(())
    }

    fn swap(&self, staging: &Path) -> Result<()> {
        let live = &self.workspace;
        match fs::symlink_metadata(live) {
            Err(e) if e.kind() == io::ErrorKind::NotFound => {
                return fs::rename(staging, live).map_err(|e| Error::io(live, e));
            }
            Err(e) => return Err(Error::io(live, e)),
            Ok(_) => {}
        }
        let old = self
            .box_dir
            .join(format!("{OLD_PREFIX}{}", uuid::Uuid::new_v4().simple()));
        fs::rename(live, &old).map_err(|e| Error::io(live, e))?;
        if let Err(e) = fs::rename(staging, live) {
            if let Err(back) = fs::rename(&old, live) {
                tracing::error!(old = %old.display(), error = %back, "cannot put the previous workspace back");
            }
            return Err(Error::io(live, e));
        }
        // The new workspace is live; a failure to delete the old one only costs disk space
        // (boot removes leftovers).
        if let Err(e) = fsutil::remove_any(&old) {
            tracing::warn!(old = %old.display(), error = %e, "cannot remove the replaced workspace");
        }
        Ok(())
    }
}

#[async_trait]
impl BoxHandle for LocalBox {
    fn backend(&self) -> &'static str {
        BACKEND
    }

    fn workspace_root(&self) -> &str {
        &self.inner.workspace_str
    }

    fn state(&self) -> Box<dyn SandboxState> {
        Box::new(LocalState {
            common: CommonState::new(self.inner.workspace_str.clone()),
            box_dir: self.inner.box_dir.clone(),
            persistence: self.inner.persistence,
            key: self.inner.key.clone(),
        })
    }

    #[tracing::instrument(skip_all, fields(backend = BACKEND, box_dir = %self.inner.box_dir.display()))]
    async fn boot(&self) -> Result<()> {
        // The workspace itself is not created: its absence is how core notices a lost
        // workspace and restores it.
        self.blocking("boot", |i| {
            fsutil::ensure_box(&i.box_dir, i.key.as_deref())?;
            fsutil::remove_leftovers(&i.box_dir);
            if fsutil::is_real_dir(&i.workspace)? {
                fsutil::install_bind_links(&i.workspace, &i.links)?;
            }
            Ok(())
        })
        .await?;
        // A confined box starts its init with the box: a kernel that refuses a required
        // piece fails the boot, before any command runs.
        if let Some(slot) = &self.inner.confined {
            slot.get().await?;
        }
        Ok(())
    }

    #[tracing::instrument(skip_all, fields(backend = BACKEND, box_dir = %self.inner.box_dir.display(), persistence = ?self.inner.persistence))]
    async fn release(&self) -> Result<()> {
        self.stop_confined().await?;
        match self.inner.persistence {
            Persistence::Keep => Ok(()),
            _ => self.blocking("release", Inner::remove_box).await,
        }
    }

    async fn park(&self) -> Result<()> {
        // A box is a directory: kept is simply not removed. Nothing runs in a parked box.
        self.stop_confined().await
    }

    #[tracing::instrument(skip_all, fields(backend = BACKEND, box_dir = %self.inner.box_dir.display()))]
    async fn destroy(&self) -> Result<()> {
        self.stop_confined().await?;
        self.blocking("destroy", Inner::remove_box).await
    }

    async fn settle(&self) -> Result<()> {
        if self.inner.inflight.idle(SETTLE_WITHIN).await {
            Ok(())
        } else {
            Err(Error::Timeout {
                operation: format!(
                    "{} commands or file operations of a cancelled call ending",
                    self.inner.inflight.count()
                ),
                after: SETTLE_WITHIN,
            })
        }
    }

    async fn workspace_exists(&self) -> Result<bool> {
        self.blocking("workspace_exists", |i| fsutil::is_real_dir(&i.workspace))
            .await
    }

    async fn exec(&self, request: ExecRequest) -> Result<ExecResult> {
        let i = &self.inner;
        exec::run(
            ExecContext {
                options: &i.options,
                workspace: &i.workspace,
                spec_env: &i.spec_env,
                links: &i.links,
                inflight: &i.inflight,
                confined: i.confined.as_ref(),
            },
            request,
        )
        .await
    }

    async fn list(&self) -> Result<Vec<TreeEntry>> {
        self.blocking("list", |i| {
            i.require_workspace()?;
            archive::list_dir(&i.workspace)
        })
        .await
    }

    #[tracing::instrument(skip_all, fields(backend = BACKEND, box_dir = %self.inner.box_dir.display()))]
    async fn export(&self, request: &ExportRequest) -> Result<ByteStream> {
        let paths = request.paths.clone();
        self.blocking("export", move |i| {
            i.require_workspace()?;
            // `pack_dir` looks requested paths up with lstat, which still follows symlinks in
            // their parents: `outlink/secret` would pack a file from outside the workspace.
            for path in paths.iter().flatten() {
                fsutil::parents_are_dirs(&i.workspace, path)?;
            }
            Ok(())
        })
        .await?;
        let excludes = Excludes::new(request.exclude.clone(), &request.exclude_globs)?;
        Ok(archive::pack_dir(
            self.inner.workspace.clone(),
            request.paths.clone(),
            excludes,
        ))
    }

    #[tracing::instrument(skip_all, fields(backend = BACKEND, box_dir = %self.inner.box_dir.display(), mode = ?mode))]
    async fn import(&self, archive: ByteStream, mode: ImportMode) -> Result<()> {
        match mode {
            ImportMode::Replace { keep } => {
                let staging = self
                    .blocking("import", |i| {
                        fsutil::ensure_box(&i.box_dir, i.key.as_deref())?;
                        let staging = i
                            .box_dir
                            .join(format!("{STAGING_PREFIX}{}", uuid::Uuid::new_v4().simple()));
                        fs::create_dir(&staging).map_err(|e| Error::io(&staging, e))?;
                        Ok(staging)
                    })
                    .await?;
                let extracted =
                    archive::extract_to_dir(archive, staging.clone(), ArchivePolicy::default())
                        .await;
                self.blocking("import", move |i| {
                    let result = extracted.and_then(|_| i.swap_in(&staging, &keep));
                    // After a successful swap the staging path no longer exists.
                    if let Err(e) = fsutil::remove_any(&staging) {
                        tracing::warn!(staging = %staging.display(), error = %e, "cannot remove the staging directory");
                    }
                    result
                })
                .await
            }
            ImportMode::Merge => {
                let created = self
                    .blocking("import", |i| {
                        fsutil::ensure_box(&i.box_dir, i.key.as_deref())?;
                        match fs::symlink_metadata(&i.workspace) {
                            Ok(m) if m.is_dir() => Ok(false),
                            Ok(_) => Err(Error::path_escape(
                                &i.workspace_str,
                                "the workspace root is not a directory",
                            )),
                            Err(e) if e.kind() == io::ErrorKind::NotFound => {
                                fs::create_dir(&i.workspace)
                                    .map_err(|e| Error::io(&i.workspace, e))?;
                                Ok(true)
                            }
                            Err(e) => Err(Error::io(&i.workspace, e)),
                        }
                    })
                    .await?;
                archive::extract_to_dir(
                    archive,
                    self.inner.workspace.clone(),
                    ArchivePolicy::default(),
                )
                .await?;
                if created {
                    self.blocking("import", |i| {
                        fsutil::install_bind_links(&i.workspace, &i.links)
                    })
                    .await?;
                }
                Ok(())
            }
            _ => Err(sandbox_core::not_supported(BACKEND, "import mode")),
        }
    }

    async fn read_file(&self, path: &RelPath) -> Result<Bytes> {
        let path = path.clone();
        self.blocking("read_file", move |i| i.read_file(&path))
            .await
    }

    async fn write_file(&self, path: &RelPath, data: Bytes, mode: u32) -> Result<()> {
        let path = path.clone();
        self.blocking("write_file", move |i| i.write_file(&path, &data, mode))
            .await
    }

    async fn remove(&self, paths: &[RelPath]) -> Result<()> {
        let paths = paths.to_vec();
        self.blocking("remove", move |i| i.remove(&paths)).await
    }
}
