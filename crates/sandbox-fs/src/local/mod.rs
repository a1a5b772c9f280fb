//! Mode 3, the default: local files and a host shell.
//!
//! The view an agent sees is an overlay: the workspace (upper, writable) over the project
//! (lower, read-only unless `project_writable`). Reads try the layers top-down; writes go to one
//! layer chosen by path; list, glob and grep merge the layers with the upper one winning. With a
//! user bound ([`LocalFs::for_user`]) a third layer, `workspace/<user>/`, sits on top for
//! user-level paths (`MEMORY.md`, `memory/`, `agents/`, `plans/`, `skills/`), and a user's
//! `skills/<name>/` hides the shared skill of that name entirely.
//!
//! Every layer is a directory *handle*: the roots are opened once, in [`LocalFs::new`], and a
//! path's text is checked first (`..`, NUL, absolute roots, other users), then resolved by the
//! kernel beneath the handle of the layer it belongs to (`sandbox_core::beneath`). Nothing is
//! checked on a path and then used by re-reading that path, so a shell swapping names or parent
//! directories for symlinks to elsewhere cannot redirect an operation. Only the `Unrestricted`
//! policy, which has no root, uses plain paths.

mod options;
mod shell;

use std::collections::BTreeMap;
use std::fmt;
use std::fs;
use std::hash::{Hash, Hasher};
use std::io::{self, Read as _, Write as _};
use std::os::fd::{AsFd, AsRawFd as _};
use std::os::unix::fs::{MetadataExt as _, PermissionsExt as _};
use std::path::{Component, Path, PathBuf};
use std::rc::Rc;
use std::sync::Arc;

use async_trait::async_trait;
use bytes::Bytes;
use sandbox_core::beneath::{self, Anchor, Dir, Follow, Kind};
use sandbox_core::{Error, RelPath, Result};

pub use options::{DEFAULT_WORKSPACE_DIR, LocalOptions, PathPolicy};
use shell::LocalShell;

use crate::filesystem::{Filesystem, Shell, UpdateFn};
use crate::types::{FileInfo, FileKind, WriteOutcome};
use crate::work::{self, Cancel, MAX_TEXT_BYTES};

/// Workspace metadata: with `project_writable`, paths under these stay in the workspace.
pub const METADATA_PREFIXES: &[&str] = &[
    "AGENTS.md",
    "MEMORY.md",
    "KNOWLEDGE.md",
    "tools.json",
    "memory",
    "agents",
    "skills",
    "knowledge",
    "plans",
    "subagents",
    "rules",
    ".skills-cache",
];

/// Per-user paths: with a user bound, these live in `workspace/<user>/`.
pub const USER_LEVEL_PREFIXES: &[&str] = &["MEMORY.md", "memory", "agents", "plans", "skills"];

/// The directory of [`DEFAULT_WORKSPACE_DIR`] inside the project.
const WORKSPACE_PARENT: &str = ".sandbox-harness";
/// Marks a workspace subdirectory as a user's; other users' calls cannot reach into it.
const USER_MARKER: &str = ".sandbox-fs-user";
/// Infix of temporary files of atomic writes.
const TMP_TAG: &str = ".sandbox-fs-tmp-";
/// Most entries one walk collects.
const WALK_LIMIT: usize = 200_000;
/// Largest buffer reserved up front for a read (more grows as it is read).
const READ_HINT_MAX: u64 = 64 << 20;

/// The layer a view write lands in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum WriteLayer {
    /// The bound user's directory (user-level metadata).
    User,
    /// The project (`project_writable`, non-metadata paths).
    Project,
    /// The workspace.
    Workspace,
}

fn first_component(rel: &RelPath) -> &str {
    rel.components().next().unwrap_or("")
}

/// Whether `rel` is workspace metadata (stays in the workspace under `project_writable`).
pub fn is_metadata(rel: &RelPath) -> bool {
    METADATA_PREFIXES.contains(&first_component(rel))
}

fn is_user_level(rel: &RelPath) -> bool {
    USER_LEVEL_PREFIXES.contains(&first_component(rel))
}

/// A user id as a directory name: [`sandbox_core::encode_component`] (percent-encoded outside
/// `[A-Za-z0-9._@-]`, a leading `.` too), and a name that would collide with workspace metadata
/// gets its first byte encoded as well.
fn user_dir_name(user: &str) -> String {
    let mut out = sandbox_core::encode_component(user);
    if METADATA_PREFIXES.contains(&out.as_str()) {
        let first = out.as_bytes().first().copied().unwrap_or(0);
        out = format!("%{first:02X}{}", out.get(1..).unwrap_or(""));
    }
    out
}

/// A root directory: where the view's layers live, or a directory reachable by absolute path.
#[derive(Debug)]
struct Root {
    /// As configured (made absolute, lexically normalized).
    given: PathBuf,
    /// Canonical.
    real: PathBuf,
    /// Held open from construction: every path under this root is resolved by the kernel
    /// beneath this handle, never by re-reading `real` (whose parents the shell may swap).
    dir: Arc<Dir>,
}

impl Root {
    fn new(path: &Path, create: bool) -> Result<Root> {
        if create {
            fs::create_dir_all(path).map_err(|e| Error::io(path, e))?;
        }
        let abs = if path.is_absolute() {
            path.to_path_buf()
        } else {
            std::env::current_dir()
                .map_err(|e| Error::io(".", e))?
                .join(path)
        };
        let given = lexical(&abs);
        let real = fs::canonicalize(&given).map_err(|e| Error::io(&given, e))?;
        let dir = Arc::new(Dir::open(&real).map_err(|e| Error::io(&real, e))?);
        Ok(Root { given, real, dir })
    }

    /// `abs` relative to this root, if it lies at or under it (compared by components).
    fn strip<'a>(&self, abs: &'a Path) -> Option<&'a Path> {
        abs.strip_prefix(&self.given)
            .or_else(|_| abs.strip_prefix(&self.real))
            .ok()
    }

    fn layer(&self, writable: bool) -> Layer {
        Layer {
            dir: self.dir.clone(),
            path: self.real.clone(),
            writable,
        }
    }
}

/// Drop `.` components; `..` pops (only used where `..` is allowed or already refused).
fn lexical(path: &Path) -> PathBuf {
    let mut out = PathBuf::new();
    for c in path.components() {
        match c {
            Component::CurDir => {}
            Component::ParentDir => {
                out.pop();
            }
            other => out.push(other),
        }
    }
    out
}

/// Striped locks serializing read-modify-write on the same target file.
pub(crate) struct PathLocks(Vec<tokio::sync::Mutex<()>>);

impl PathLocks {
    pub(crate) fn new() -> Self {
        PathLocks((0..64).map(|_| tokio::sync::Mutex::new(())).collect())
    }

    pub(crate) async fn lock(&self, path: &Path) -> tokio::sync::MutexGuard<'_, ()> {
        let mut h = std::collections::hash_map::DefaultHasher::new();
        path.hash(&mut h);
        self.0[(h.finish() % self.0.len() as u64) as usize]
            .lock()
            .await
    }
}

struct Inner {
    workspace: Root,
    project: Root,
    extra: Vec<Root>,
    policy: PathPolicy,
    project_writable: bool,
    shell: Option<LocalShell>,
    locks: PathLocks,
}

/// Mode 3: a local overlay filesystem with an optional host shell.
///
/// Cheap to clone; clones share the roots, the shell and the edit locks.
#[derive(Clone)]
pub struct LocalFs {
    inner: Arc<Inner>,
    /// The bound user's directory name, if any.
    user: Option<String>,
}

impl fmt::Debug for LocalFs {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LocalFs")
            .field("workspace", &self.inner.workspace.given)
            .field("project", &self.inner.project.given)
            .field("policy", &self.inner.policy)
            .field("project_writable", &self.inner.project_writable)
            .field("user", &self.user)
            .field("shell", &self.inner.shell.is_some())
            .finish_non_exhaustive()
    }
}

/// Where a path leads.
#[derive(Debug, Clone)]
enum Target {
    /// The overlay view; `None` is its root.
    View(Option<RelPath>),
    /// One host directory reached by an absolute path.
    Direct {
        root: RootId,
        display: PathBuf,
        rel: Option<RelPath>,
        writable: bool,
    },
}

/// Which root a [`Target::Direct`] lies under.
#[derive(Debug, Clone, Copy)]
enum RootId {
    Workspace,
    Project,
    Extra(usize),
    /// No root: an absolute path the `Unrestricted` policy passes through.
    Host,
}

/// A layer of the view: a directory handle and the host path it is shown by.
#[derive(Debug, Clone)]
struct Layer {
    dir: Arc<Dir>,
    /// Where the handle was opened (messages, listings' hiding rules, the no-`/proc` fallback).
    path: PathBuf,
    writable: bool,
}

/// Where one operation looks.
#[derive(Debug, Clone)]
enum Place {
    /// `rel` (`None`: the directory itself) resolved by the kernel beneath `dir`.
    Beneath {
        dir: Arc<Dir>,
        path: PathBuf,
        rel: Option<RelPath>,
    },
    /// A path of the `Unrestricted` policy: resolved as the process would, nothing checked.
    Host(PathBuf),
}

/// One place a path may be found.
#[derive(Debug, Clone)]
struct Candidate {
    place: Place,
    writable: bool,
    /// 0 = top layer.
    layer: usize,
}

impl Place {
    /// The host path this place is shown by.
    fn abs(&self) -> PathBuf {
        match self {
            Place::Beneath { path, rel, .. } => {
                rel.as_ref().map_or(path.clone(), |r| r.to_host(path))
            }
            Place::Host(path) => path.clone(),
        }
    }

    /// A handle for metadata and whereabouts (`None` for a root itself, which needs no
    /// whereabouts check) and the metadata, a final symlink followed.
    fn stat(&self, anchors: &[Anchor<'_>]) -> io::Result<(Option<fs::File>, fs::Metadata)> {
        match self {
            Place::Beneath { dir, rel: None, .. } => Ok((None, dir.stat()?)),
            Place::Beneath {
                dir,
                rel: Some(rel),
                ..
            } => {
                let file = dir.open_path_anchored(rel, anchors)?;
                let meta = file.metadata()?;
                Ok((Some(file), meta))
            }
            Place::Host(path) => Ok((None, fs::metadata(path)?)),
        }
    }

    /// Open for reading (a directory opens too; the caller looks at the metadata).
    fn open_read(&self, anchors: &[Anchor<'_>]) -> io::Result<Option<fs::File>> {
        match self {
            Place::Beneath { rel: None, .. } => Ok(None),
            Place::Beneath {
                dir,
                rel: Some(rel),
                ..
            } => dir.read_file_anchored(rel, anchors).map(Some),
            Place::Host(path) => fs::File::open(path).map(Some),
        }
    }

    /// Open as a directory.
    fn open_dir(&self, anchors: &[Anchor<'_>]) -> io::Result<Dir> {
        match self {
            Place::Beneath { dir, rel: None, .. } => dir.try_clone(),
            Place::Beneath {
                dir,
                rel: Some(rel),
                ..
            } => dir.open_dir_anchored(rel, anchors),
            Place::Host(path) => Dir::open(fs::canonicalize(path)?),
        }
    }

    /// The directory holding this place (created with its parents when `create`), and the
    /// name in it. Beneath a root the parents are resolved beneath its handle (symlinks that
    /// stay beneath it followed); the name itself is never followed by what is done with it.
    fn parent(&self, create: bool) -> io::Result<(Dir, String)> {
        match self {
            Place::Beneath { rel: None, .. } => Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                "a root directory has no parent here",
            )),
            Place::Beneath {
                dir,
                rel: Some(rel),
                ..
            } => {
                let (parent, name) = dir.parent_of(rel, Follow::Beneath, create)?;
                Ok((parent, name.to_owned()))
            }
            Place::Host(path) => {
                let (Some(parent), Some(name)) =
                    (path.parent(), path.file_name().and_then(|n| n.to_str()))
                else {
                    return Err(io::Error::new(
                        io::ErrorKind::InvalidInput,
                        "no parent directory",
                    ));
                };
                if create {
                    fs::create_dir_all(parent)?;
                }
                Ok((Dir::open(fs::canonicalize(parent)?)?, name.to_owned()))
            }
        }
    }
}

/// Whether `e` means "nothing there" (a missing component, or a file where a directory was
/// expected).
fn is_missing(e: &io::Error) -> bool {
    matches!(
        e.kind(),
        io::ErrorKind::NotFound | io::ErrorKind::NotADirectory
    )
}

/// The typed error of a failed host operation on `raw` (shown on the host as `abs`): a
/// resolution that would leave its root (`EXDEV`) is a path escape. (`ELOOP` from a resolution
/// that follows links beneath its root is a loop of links, an I/O error as before.)
fn fs_error(raw: &str, abs: &Path, e: io::Error) -> Error {
    if e.kind() == io::ErrorKind::CrossesDevices {
        return Error::path_escape(
            raw,
            "resolves (through a symlink) to a place outside the allowed roots",
        );
    }
    Error::io(abs, e)
}

/// Where the kernel says an open handle is now (Linux's `/proc/self/fd`).
fn whereabouts(handle: &impl AsFd) -> Option<PathBuf> {
    fs::read_link(format!("/proc/self/fd/{}", handle.as_fd().as_raw_fd())).ok()
}

/// A directory's identity (device, inode).
fn dir_id(dir: &Dir) -> Option<(u64, u64)> {
    dir.stat().ok().map(|m| (m.dev(), m.ino()))
}

/// Whether the entry `name` of `dir` is a marked user directory (looked at through the handle,
/// a symlink there is not followed).
fn is_user_dir(dir: &Dir, name: &str) -> bool {
    dir.open_subdir(name)
        .and_then(|d| d.entry_metadata(USER_MARKER))
        .is_ok()
}

/// An atomic replace of `name` in `parent`: a temporary file beside it, then `renameat` over
/// it (a symlink at `name` is replaced, never written through). Keeps the permission bits of a
/// file it replaces; a new file gets `0o666` less the umask, as `open(2)` gives.
fn write_atomic(parent: &Dir, name: &str, data: &[u8]) -> io::Result<()> {
    let mode = parent
        .entry_metadata(name)
        .ok()
        .filter(fs::Metadata::is_file)
        .map(|m| m.permissions().mode());
    // A fixed-length name: `.<name>.tmp` could exceed NAME_MAX for a long name.
    let tmp = format!("{TMP_TAG}{}", uuid::Uuid::new_v4().simple());
    let result = (|| {
        let mut file = parent.create_new(&tmp, 0o666)?;
        file.write_all(data)?;
        if let Some(mode) = mode {
            file.set_permissions(fs::Permissions::from_mode(mode))?;
        }
        file.sync_data()?;
        parent.rename(&tmp, parent, name)
    })();
    if result.is_err() {
        let _ = parent.remove_file(&tmp);
    }
    result
}

impl LocalFs {
    /// Open (creating the workspace directory) with `options`. The workspace, project and
    /// extra roots are opened here and held: later operations resolve beneath these handles.
    pub fn new(options: LocalOptions) -> Result<LocalFs> {
        let project_path = match &options.project {
            Some(p) => p.clone(),
            None => std::env::current_dir().map_err(|e| Error::io(".", e))?,
        };
        let project = Root::new(&project_path, false)?;
        let ws_path = options
            .workspace
            .clone()
            .unwrap_or_else(|| project.given.join(DEFAULT_WORKSPACE_DIR));
        let workspace = Root::new(&ws_path, true)?;
        let extra = options
            .extra_roots
            .iter()
            .map(|p| Root::new(p, false))
            .collect::<Result<Vec<_>>>()?;
        let shell = options.shell.then(|| LocalShell {
            cwd: project.real.clone(),
            home: workspace.real.clone(),
            timeout: options.timeout,
            max_output: options.max_output_bytes,
            env: options.env.clone(),
            inherit_env: options.inherit_env,
        });
        Ok(LocalFs {
            inner: Arc::new(Inner {
                workspace,
                project,
                extra,
                policy: options.policy,
                project_writable: options.project_writable,
                shell,
                locks: PathLocks::new(),
            }),
            user: None,
        })
    }

    /// The same filesystem seen by `user`: user-level files land in `workspace/<user>/`.
    /// The binding lives in the returned value, never in shared state.
    pub fn for_user(&self, user: &str) -> LocalFs {
        LocalFs {
            inner: self.inner.clone(),
            user: Some(user_dir_name(user)),
        }
    }

    /// The workspace root (canonical).
    pub fn workspace_dir(&self) -> &Path {
        &self.inner.workspace.real
    }

    /// The project root (canonical).
    pub fn project_dir(&self) -> &Path {
        &self.inner.project.real
    }

    /// The path policy.
    pub fn policy(&self) -> PathPolicy {
        self.inner.policy
    }

    /// The bound user's directory as a layer: opened beneath the workspace handle without
    /// following a symlink at its name, and created (and marked) when `create` is set.
    /// `Ok(None)`: no user is bound, or the directory does not exist yet.
    fn user_layer(&self, create: bool) -> Result<Option<Layer>> {
        let Some(user) = &self.user else {
            return Ok(None);
        };
        let ws = &self.inner.workspace;
        let path = ws.real.join(user);
        if create {
            match ws.dir.create_subdir(user, 0o755) {
                Ok(()) => {}
                Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {}
                Err(e) => return Err(Error::io(&path, e)),
            }
        }
        let dir = match ws.dir.open_subdir(user) {
            Ok(dir) => dir,
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
            // A symlink (or a file) where the user's directory belongs.
            Err(e)
                if e.kind() == io::ErrorKind::NotADirectory || beneath::refusal(&e).is_some() =>
            {
                return Err(Error::path_escape(
                    user,
                    "the user's directory is not a real directory (a symlink or a file is in its place)",
                ));
            }
            Err(e) => return Err(Error::io(&path, e)),
        };
        if create {
            match dir.create_new(USER_MARKER, 0o644) {
                Ok(_) => {}
                Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {}
                Err(e) => return Err(Error::io(path.join(USER_MARKER), e)),
            }
        }
        Ok(Some(Layer {
            dir: Arc::new(dir),
            path,
            writable: true,
        }))
    }

    /// Directories an absolute symlink met on the way may lead into: the allowed roots
    /// (extra roots only under `Rooted`), by both their spellings.
    fn anchors(&self) -> Vec<Anchor<'_>> {
        let inner = &self.inner;
        let mut roots = vec![&inner.workspace, &inner.project];
        if inner.policy == PathPolicy::Rooted {
            roots.extend(inner.extra.iter());
        }
        let mut out = Vec::new();
        for root in roots {
            out.push(Anchor {
                path: &root.real,
                dir: &root.dir,
            });
            if root.given != root.real {
                out.push(Anchor {
                    path: &root.given,
                    dir: &root.dir,
                });
            }
        }
        out
    }

    // ---- path resolution -------------------------------------------------------------

    fn locate(&self, raw: &str) -> Result<Target> {
        if raw.contains('\0') {
            return Err(Error::path_escape(raw, "contains a NUL byte"));
        }
        if raw.is_empty() || raw == "." || raw == "./" {
            return Ok(Target::View(None));
        }
        if !raw.starts_with('/') {
            let rel = RelPath::new(raw)?;
            self.check_user_component(raw, &rel)?;
            return Ok(Target::View(Some(rel)));
        }
        let path = Path::new(raw);
        let climbs = path.components().any(|c| c == Component::ParentDir);
        match self.inner.policy {
            PathPolicy::Sandboxed => {
                return Err(Error::path_escape(
                    raw,
                    "absolute paths are not allowed in this mode; use a path relative to the workspace, e.g. `notes/todo.md`",
                ));
            }
            PathPolicy::Rooted if climbs => {
                return Err(Error::path_escape(
                    raw,
                    "`..` components are not allowed; give the path without climbing",
                ));
            }
            _ => {}
        }
        let path = lexical(path);
        let inner = &self.inner;
        let mut roots: Vec<(&Root, RootId, bool)> = vec![
            (&inner.workspace, RootId::Workspace, true),
            (&inner.project, RootId::Project, inner.project_writable),
        ];
        roots.extend(
            inner
                .extra
                .iter()
                .enumerate()
                .map(|(i, r)| (r, RootId::Extra(i), true)),
        );
        // Longest root first: the workspace usually lies inside the project.
        roots.sort_by_key(|(r, _, _)| std::cmp::Reverse(r.given.components().count()));
        for (root, id, writable) in roots {
            if let Some(rest) = root.strip(&path) {
                let rel = if rest.as_os_str().is_empty() {
                    None
                } else {
                    Some(RelPath::from_path(rest)?)
                };
                if matches!(id, RootId::Workspace)
                    && let Some(rel) = &rel
                {
                    self.check_user_component(raw, rel)?;
                }
                return Ok(Target::Direct {
                    root: id,
                    display: root.given.clone(),
                    rel,
                    writable,
                });
            }
        }
        if self.inner.policy == PathPolicy::Unrestricted {
            let rest = path.strip_prefix("/").unwrap_or(&path);
            let rel = if rest.as_os_str().is_empty() {
                None
            } else {
                Some(RelPath::from_path(rest)?)
            };
            return Ok(Target::Direct {
                root: RootId::Host,
                display: PathBuf::from("/"),
                rel,
                writable: true,
            });
        }
        let mut allowed = vec![
            inner.workspace.given.display().to_string(),
            inner.project.given.display().to_string(),
        ];
        allowed.extend(inner.extra.iter().map(|r| r.given.display().to_string()));
        Err(Error::path_escape(
            raw,
            format!(
                "outside the allowed roots; use a relative path, or an absolute one under {}",
                allowed.join(", ")
            ),
        ))
    }

    /// Refuse a workspace path whose first component is another user's directory (the text
    /// check; where a path really leads is checked on the opened handle).
    fn check_user_component(&self, raw: &str, rel: &RelPath) -> Result<()> {
        let first = first_component(rel);
        if self.user.as_deref() == Some(first) {
            return Ok(());
        }
        if is_user_dir(&self.inner.workspace.dir, first) {
            return Err(Error::path_escape(
                raw,
                "this directory belongs to another user",
            ));
        }
        Ok(())
    }

    /// Refuse a handle the kernel opened (beneath an allowed root) that lies in another user's
    /// directory, reached through a symlink. Looked up on the handle itself; where `/proc` is
    /// missing, on `fallback`, the path it was opened by, with symlinks resolved.
    fn check_whereabouts(&self, handle: &impl AsFd, fallback: &Path, raw: &str) -> Result<()> {
        if self.inner.policy == PathPolicy::Unrestricted {
            return Ok(());
        }
        let Some(real) = whereabouts(handle).or_else(|| fs::canonicalize(fallback).ok()) else {
            return Ok(());
        };
        let ws = &self.inner.workspace;
        if let Ok(rest) = real.strip_prefix(&ws.real)
            && let Some(Component::Normal(first)) = rest.components().next()
            && let Some(first) = first.to_str()
            && self.user.as_deref() != Some(first)
            && is_user_dir(&ws.dir, first)
        {
            return Err(Error::path_escape(
                raw,
                "resolves into another user's directory",
            ));
        }
        Ok(())
    }

    /// The layers of the view for `rel`, top first.
    fn layers(&self, rel: Option<&RelPath>) -> Result<Vec<Layer>> {
        let inner = &self.inner;
        let mut out = Vec::new();
        let user_level = rel.is_none_or(is_user_level);
        if user_level && let Some(user) = self.user_layer(false)? {
            // A user's skills/<name>/ replaces the shared skill of that name.
            if let Some(rel) = rel {
                let parts: Vec<&str> = rel.components().collect();
                if parts.len() >= 2
                    && parts[0] == "skills"
                    && RelPath::new(format!("skills/{}", parts[1]))
                        .ok()
                        .and_then(|skill| user.dir.metadata(&skill, Follow::Beneath).ok())
                        .is_some_and(|m| m.is_dir())
                {
                    return Ok(vec![user]);
                }
            }
            out.push(user);
        }
        out.push(inner.workspace.layer(true));
        let project_writable = inner.project_writable && rel.is_some_and(|r| !is_metadata(r));
        out.push(inner.project.layer(project_writable));
        Ok(out)
    }

    /// `rel` in `layer`, beneath its handle; under the `Unrestricted` policy, a plain path.
    fn place_in(&self, layer: &Layer, rel: Option<&RelPath>) -> Place {
        if self.inner.policy == PathPolicy::Unrestricted {
            return Place::Host(rel.map_or(layer.path.clone(), |r| r.to_host(&layer.path)));
        }
        Place::Beneath {
            dir: layer.dir.clone(),
            path: layer.path.clone(),
            rel: rel.cloned(),
        }
    }

    fn root(&self, id: RootId) -> Option<&Root> {
        match id {
            RootId::Workspace => Some(&self.inner.workspace),
            RootId::Project => Some(&self.inner.project),
            RootId::Extra(i) => self.inner.extra.get(i),
            RootId::Host => None,
        }
    }

    fn candidates(&self, target: &Target) -> Result<Vec<Candidate>> {
        Ok(match target {
            Target::View(rel) => self
                .layers(rel.as_ref())?
                .iter()
                .enumerate()
                .map(|(layer, l)| Candidate {
                    place: self.place_in(l, rel.as_ref()),
                    writable: l.writable,
                    layer,
                })
                .collect(),
            Target::Direct {
                root,
                rel,
                writable,
                ..
            } => {
                let place = match self.root(*root) {
                    Some(r) => self.place_in(&r.layer(*writable), rel.as_ref()),
                    None => Place::Host(
                        rel.as_ref()
                            .map_or(PathBuf::from("/"), |r| r.to_host(Path::new("/"))),
                    ),
                };
                vec![Candidate {
                    place,
                    writable: *writable,
                    layer: 0,
                }]
            }
        })
    }

    /// Which layer a write to the view path `rel` goes to: one decision for the write itself
    /// and for the key its edits are serialized by.
    fn write_layer(&self, rel: &RelPath) -> WriteLayer {
        if self.user.is_some() && is_user_level(rel) {
            WriteLayer::User
        } else if self.inner.project_writable && !is_metadata(rel) {
            WriteLayer::Project
        } else {
            WriteLayer::Workspace
        }
    }

    /// Where a write to `target` goes (the bound user's directory is created on the way).
    fn write_target(&self, target: &Target, raw: &str) -> Result<Place> {
        match target {
            Target::View(None) | Target::Direct { rel: None, .. } => Err(Error::invalid(
                "path",
                format!("`{raw}` is a root directory; give a file path"),
            )),
            Target::View(Some(rel)) => {
                let layer = match self.write_layer(rel) {
                    WriteLayer::User => self
                        .user_layer(true)?
                        .expect("the user's directory was just created"),
                    WriteLayer::Project => self.inner.project.layer(true),
                    WriteLayer::Workspace => self.inner.workspace.layer(true),
                };
                Ok(self.place_in(&layer, Some(rel)))
            }
            Target::Direct {
                root,
                rel: Some(rel),
                writable,
                ..
            } => {
                if !writable {
                    return Err(read_only(raw));
                }
                Ok(match self.root(*root) {
                    Some(r) => self.place_in(&r.layer(true), Some(rel)),
                    None => Place::Host(rel.to_host(Path::new("/"))),
                })
            }
        }
    }

    fn display(target: &Target) -> String {
        match target {
            Target::View(None) => String::new(),
            Target::View(Some(rel)) => rel.to_string(),
            Target::Direct { display, rel, .. } => rel
                .as_ref()
                .map_or(display.clone(), |r| r.to_host(display))
                .display()
                .to_string(),
        }
    }

    fn display_child(target: &Target, child: &str) -> String {
        match target {
            Target::View(None) => child.to_owned(),
            _ => format!("{}/{child}", Self::display(target).trim_end_matches('/')),
        }
    }

    /// Whether the entry `name` (of kind `kind`) of the directory `dir`, shown at `dir_path`,
    /// is hidden from listings. `dir_is_ws`: `dir` is the workspace root.
    fn hidden(&self, dir: &Dir, dir_is_ws: bool, dir_path: &Path, name: &str, kind: Kind) -> bool {
        if name.contains(TMP_TAG) || name.starts_with(beneath::TMP_PREFIX) || name == USER_MARKER {
            return true;
        }
        let abs = dir_path.join(name);
        let ws = &self.inner.workspace.real;
        // The workspace (and the default layout's own directory around it) is not project
        // content.
        if &abs == ws || (name == WORKSPACE_PARENT && ws.starts_with(&abs)) {
            return true;
        }
        dir_is_ws && kind == Kind::Dir && is_user_dir(dir, name)
    }

    /// The workspace root's identity (device, inode), to recognise it whatever path reached it.
    fn workspace_id(&self) -> Option<(u64, u64)> {
        dir_id(&self.inner.workspace.dir)
    }

    // ---- blocking operations ------------------------------------------------------

    fn first_existing(
        &self,
        target: &Target,
        raw: &str,
    ) -> Result<Option<(Candidate, fs::Metadata)>> {
        let anchors = self.anchors();
        for cand in self.candidates(target)? {
            match cand.place.stat(&anchors) {
                Ok((handle, meta)) => {
                    if let Some(handle) = &handle {
                        self.check_whereabouts(handle, &cand.place.abs(), raw)?;
                    }
                    return Ok(Some((cand, meta)));
                }
                Err(e) if is_missing(&e) => {}
                Err(e) => return Err(fs_error(raw, &cand.place.abs(), e)),
            }
        }
        Ok(None)
    }

    /// The bytes of the first layer that has `raw`: opened once, checked on the handle, read
    /// from the handle. With `max`, a file larger than that is [`Error::LimitExceeded`]: by
    /// its size before anything is read, or after `max + 1` bytes if it grew meanwhile.
    fn read_blocking(&self, raw: &str, max: Option<u64>) -> Result<Option<Bytes>> {
        let target = self.locate(raw)?;
        let anchors = self.anchors();
        for cand in self.candidates(&target)? {
            let abs = cand.place.abs();
            let mut file = match cand.place.open_read(&anchors) {
                Ok(Some(file)) => file,
                Ok(None) => return Err(is_dir(raw)),
                Err(e) if is_missing(&e) => continue,
                Err(e) => return Err(fs_error(raw, &abs, e)),
            };
            self.check_whereabouts(&file, &abs, raw)?;
            let meta = file.metadata().map_err(|e| Error::io(&abs, e))?;
            if meta.is_dir() {
                return Err(is_dir(raw));
            }
            if let Some(max) = max {
                work::check_file_size(raw, meta.len(), max)?;
            }
            // The size only hints the buffer (a sparse or growing file may say anything).
            let limit = max.map_or(u64::MAX, |m| m.saturating_add(1));
            let hint = meta.len().min(limit).min(READ_HINT_MAX);
            let mut data = Vec::with_capacity(hint as usize);
            (&mut file)
                .take(limit)
                .read_to_end(&mut data)
                .map_err(|e| Error::io(&abs, e))?;
            if let Some(max) = max {
                work::check_file_size(raw, data.len() as u64, max)?;
            }
            return Ok(Some(Bytes::from(data)));
        }
        Ok(None)
    }

    fn write_blocking(&self, raw: &str, data: &[u8]) -> Result<()> {
        let target = self.locate(raw)?;
        let place = self.write_target(&target, raw)?;
        let abs = place.abs();
        let (parent, name) = place.parent(true).map_err(|e| fs_error(raw, &abs, e))?;
        self.check_whereabouts(&parent, abs.parent().unwrap_or(&abs), raw)?;
        write_atomic(&parent, &name, data).map_err(|e| Error::io(&abs, e))
    }

    fn stat_blocking(&self, raw: &str) -> Result<Option<FileInfo>> {
        let target = self.locate(raw)?;
        Ok(self.first_existing(&target, raw)?.map(|(_, meta)| {
            FileInfo::new(Self::display(&target), kind_of(&meta), size_of(&meta))
                .modified(meta.modified().ok())
        }))
    }

    /// The directory holding `cand` and the name in it, if the name exists there (not
    /// following a symlink at the name).
    fn existing_entry(&self, cand: &Candidate, raw: &str) -> Result<Option<(Dir, String)>> {
        let abs = cand.place.abs();
        let (parent, name) = match cand.place.parent(false) {
            Ok(found) => found,
            Err(e) if is_missing(&e) => return Ok(None),
            Err(e) => return Err(fs_error(raw, &abs, e)),
        };
        self.check_whereabouts(&parent, abs.parent().unwrap_or(&abs), raw)?;
        match parent.entry_metadata(&name) {
            Ok(_) => Ok(Some((parent, name))),
            Err(e) if is_missing(&e) => Ok(None),
            Err(e) => Err(Error::io(&abs, e)),
        }
    }

    fn delete_blocking(&self, raw: &str) -> Result<()> {
        let target = self.locate(raw)?;
        if matches!(
            target,
            Target::View(None) | Target::Direct { rel: None, .. }
        ) {
            return Err(Error::invalid(
                "path",
                format!("`{raw}` is a root directory; it cannot be deleted"),
            ));
        }
        for cand in self.candidates(&target)? {
            // The link itself is removed, never what it points to; its parents are resolved
            // beneath the layer's handle.
            let Some((parent, name)) = self.existing_entry(&cand, raw)? else {
                continue;
            };
            if !cand.writable {
                return Err(read_only(raw));
            }
            return parent
                .remove_all(&name)
                .map_err(|e| Error::io(cand.place.abs(), e));
        }
        Err(not_found(raw))
    }

    fn rename_blocking(&self, from: &str, to: &str) -> Result<()> {
        let src_target = self.locate(from)?;
        let dst_target = self.locate(to)?;
        let mut src = None;
        for cand in self.candidates(&src_target)? {
            if let Some(entry) = self.existing_entry(&cand, from)? {
                src = Some((cand, entry));
                break;
            }
        }
        let (src, (src_parent, src_name)) = src.ok_or_else(|| not_found(from))?;
        if !src.writable {
            return Err(read_only(from));
        }
        if self.first_existing(&dst_target, to)?.is_some() {
            return Err(conflict(to));
        }
        let dst = self.write_target(&dst_target, to)?;
        let (src_abs, dst_abs) = (src.place.abs(), dst.abs());
        if dst_abs.starts_with(&src_abs) {
            return Err(into_itself(from, to));
        }
        let (dst_parent, dst_name) = dst.parent(true).map_err(|e| fs_error(to, &dst_abs, e))?;
        self.check_whereabouts(&dst_parent, dst_abs.parent().unwrap_or(&dst_abs), to)?;
        match src_parent.rename_noreplace(&src_name, &dst_parent, &dst_name) {
            Ok(()) => Ok(()),
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists => Err(conflict(to)),
            // From a rename (no resolution), EXDEV means another filesystem.
            Err(e) if e.kind() == io::ErrorKind::CrossesDevices => {
                // Another filesystem: copy (following no link), then remove the original.
                src_parent
                    .copy_all(&src_name, &dst_parent, &dst_name)
                    .map_err(|e| Error::io(&dst_abs, e))?;
                src_parent
                    .remove_all(&src_name)
                    .map_err(|e| Error::io(&src_abs, e))
            }
            Err(e) if e.kind() == io::ErrorKind::InvalidInput => {
                // Filesystems without RENAME_NOREPLACE say EINVAL; the destination was checked
                // above. A move into itself is EINVAL again.
                match src_parent.rename(&src_name, &dst_parent, &dst_name) {
                    Err(e) if e.kind() == io::ErrorKind::InvalidInput => Err(into_itself(from, to)),
                    r => r.map_err(|e| Error::io(&src_abs, e)),
                }
            }
            Err(e) => Err(Error::io(&src_abs, e)),
        }
    }

    fn list_blocking(&self, raw: &str, cancel: &Cancel) -> Result<Vec<FileInfo>> {
        let target = self.locate(raw)?;
        let anchors = self.anchors();
        let mut merged: BTreeMap<String, FileInfo> = BTreeMap::new();
        let mut any_dir = false;
        let mut any_file = false;
        for cand in self.candidates(&target)? {
            let abs = cand.place.abs();
            let dir = match cand.place.open_dir(&anchors) {
                Ok(dir) => dir,
                Err(e) if e.kind() == io::ErrorKind::NotADirectory => {
                    // A file here, or a file on the way.
                    if cand.place.stat(&anchors).is_ok_and(|(_, m)| !m.is_dir()) {
                        any_file = true;
                    }
                    continue;
                }
                Err(e) if is_missing(&e) => continue,
                Err(e) => return Err(fs_error(raw, &abs, e)),
            };
            self.check_whereabouts(&dir, &abs, raw)?;
            any_dir = true;
            let dir_is_ws = dir_id(&dir).is_some_and(|id| Some(id) == self.workspace_id());
            for (n, entry) in dir
                .entries()
                .map_err(|e| Error::io(&abs, e))?
                .into_iter()
                .enumerate()
            {
                if n.is_multiple_of(256) {
                    cancel.check()?;
                }
                let Some(name) = entry.name.to_str() else {
                    continue;
                };
                if merged.contains_key(name) || self.hidden(&dir, dir_is_ws, &abs, name, entry.kind)
                {
                    continue;
                }
                // Not following a link; an entry removed meanwhile is skipped.
                let Ok(meta) = dir.entry_metadata(name) else {
                    continue;
                };
                let info = FileInfo::new(
                    Self::display_child(&target, name),
                    kind_of(&meta),
                    size_of(&meta),
                )
                .modified(meta.modified().ok());
                merged.insert(name.to_owned(), info);
            }
        }
        if !any_dir {
            return Err(if any_file {
                not_a_dir(raw)
            } else {
                not_found(raw)
            });
        }
        Ok(merged.into_values().collect())
    }

    /// Skills the bound user overrides (`skills/<name>/`): lower layers' copies are hidden.
    fn overridden_skills(&self) -> Result<Vec<String>> {
        let Some(user) = self.user_layer(false)? else {
            return Ok(Vec::new());
        };
        let skills = RelPath::new("skills").expect("a valid path");
        let Ok(dir) = user.dir.open_dir(&skills, Follow::Beneath) else {
            return Ok(Vec::new());
        };
        Ok(dir
            .entries()
            .unwrap_or_default()
            .into_iter()
            .filter(|e| {
                e.kind == Kind::Dir
                    || (e.kind == Kind::Symlink
                        && RelPath::from_path(Path::new(&e.name))
                            .ok()
                            .and_then(|r| dir.metadata(&r, Follow::Beneath).ok())
                            .is_some_and(|m| m.is_dir()))
            })
            .filter_map(|e| e.name.to_str().map(|n| format!("skills/{n}/")))
            .collect())
    }

    fn walk_blocking(&self, raw: &str, cancel: &Cancel) -> Result<Vec<FileInfo>> {
        let target = self.locate(raw)?;
        let anchors = self.anchors();
        let mut merged: BTreeMap<String, FileInfo> = BTreeMap::new();
        let mut found = false;
        let overridden = match target {
            Target::View(_) => self.overridden_skills()?,
            Target::Direct { .. } => Vec::new(),
        };
        for cand in self.candidates(&target)? {
            let abs = cand.place.abs();
            let (handle, meta) = match cand.place.stat(&anchors) {
                Ok(found) => found,
                Err(e) if is_missing(&e) => continue,
                Err(e) => return Err(fs_error(raw, &abs, e)),
            };
            if let Some(handle) = &handle {
                self.check_whereabouts(handle, &abs, raw)?;
            }
            found = true;
            let base = Self::display(&target);
            if !meta.is_dir() {
                merged.entry(base.clone()).or_insert_with(|| {
                    FileInfo::new(base, kind_of(&meta), size_of(&meta))
                        .modified(meta.modified().ok())
                });
                continue;
            }
            // Swapped for something else since the stat: nothing to walk in this layer.
            let Ok(top) = cand.place.open_dir(&anchors) else {
                continue;
            };
            let skipped = |path: &str| {
                cand.layer > 0 && overridden.iter().any(|o| path.starts_with(o.as_str()))
            };
            if self.walk_tree(top, abs, base, &skipped, &mut merged, cancel)? {
                tracing::warn!(limit = WALK_LIMIT, "walk stopped at its entry limit");
                return Ok(merged.into_values().collect());
            }
        }
        if !found {
            return Err(not_found(raw));
        }
        Ok(merged.into_values().collect())
    }

    /// Add the files under `top` (shown at `top_path` on the host, as `base` in the view) to
    /// `merged`, where not there yet and not `skipped`. Subdirectories are opened from their
    /// parent's handle without following a symlink, so the walk never leaves `top`; pending
    /// ones keep their parent's handle (shared: at most one open handle per level). Returns
    /// whether [`WALK_LIMIT`] stopped it; `Err` when `cancel` did.
    fn walk_tree(
        &self,
        top: Dir,
        top_path: PathBuf,
        base: String,
        skipped: &dyn Fn(&str) -> bool,
        merged: &mut BTreeMap<String, FileInfo>,
        cancel: &Cancel,
    ) -> Result<bool> {
        type Pending = (Option<(Rc<Dir>, String)>, PathBuf, String);
        let ws_id = self.workspace_id();
        let mut top = Some(top);
        let mut stack: Vec<Pending> = vec![(None, top_path, base)];
        let mut seen = 0usize;
        while let Some((from, dir_path, shown)) = stack.pop() {
            cancel.check()?;
            let opened = match from {
                None => top.take().ok_or(()),
                Some((parent, name)) => parent.open_subdir(&name).map_err(drop),
            };
            // Swapped for a link or removed since it was listed: skipped.
            let Ok(dir) = opened else { continue };
            let Ok(entries) = dir.entries() else { continue };
            let dir = Rc::new(dir);
            let dir_is_ws = dir_id(&dir).is_some_and(|id| Some(id) == ws_id);
            for entry in entries {
                seen += 1;
                if seen.is_multiple_of(256) {
                    cancel.check()?;
                }
                let Some(name) = entry.name.to_str() else {
                    continue;
                };
                if name == ".git" || self.hidden(&dir, dir_is_ws, &dir_path, name, entry.kind) {
                    continue;
                }
                let path = if shown.is_empty() {
                    name.to_owned()
                } else {
                    format!("{}/{name}", shown.trim_end_matches('/'))
                };
                if skipped(&path) || (entry.kind != Kind::Dir && merged.contains_key(&path)) {
                    continue;
                }
                // Not following a link; an entry removed meanwhile is skipped.
                let meta = match entry.kind {
                    Kind::Dir => None,
                    _ => match dir.entry_metadata(name) {
                        Ok(meta) => Some(meta),
                        Err(_) => continue,
                    },
                };
                match meta {
                    Some(meta) if !meta.is_dir() => {
                        if merged.len() >= WALK_LIMIT {
                            return Ok(true);
                        }
                        let info = FileInfo::new(path.clone(), kind_of(&meta), size_of(&meta))
                            .modified(meta.modified().ok());
                        merged.insert(path, info);
                    }
                    // A directory (perhaps one that replaced a file since the listing).
                    _ => stack.push((
                        Some((dir.clone(), name.to_owned())),
                        dir_path.join(name),
                        path,
                    )),
                }
            }
        }
        Ok(false)
    }

    /// Run `f` on a blocking thread; dropping the future raises the flag it gets (walks and
    /// listings stop at it).
    async fn blocking<T, F>(&self, f: F) -> Result<T>
    where
        T: Send + 'static,
        F: FnOnce(LocalFs, &Cancel) -> Result<T> + Send + 'static,
    {
        let this = self.clone();
        work::off_worker("local file operation", move |cancel| f(this, cancel)).await
    }

    /// Resolve `raw` for a write: (display path, the key its edits are serialized by, whether
    /// it existed).
    async fn prepare_write(&self, raw: &str) -> Result<(String, PathBuf, bool)> {
        let raw_owned = raw.to_owned();
        self.blocking(move |this, _| {
            let target = this.locate(&raw_owned)?;
            let key = this.write_key(&target, &raw_owned)?;
            let existed = match this.first_existing(&target, &raw_owned)? {
                Some((_, meta)) if meta.is_dir() => return Err(is_dir(&raw_owned)),
                Some(_) => true,
                None => false,
            };
            Ok((Self::display(&target), key, existed))
        })
        .await
    }

    /// The host path a write to `target` lands at (as text: the lock key), without creating
    /// anything.
    fn write_key(&self, target: &Target, raw: &str) -> Result<PathBuf> {
        match target {
            Target::View(None) | Target::Direct { rel: None, .. } => Err(Error::invalid(
                "path",
                format!("`{raw}` is a root directory; give a file path"),
            )),
            Target::View(Some(rel)) => {
                let inner = &self.inner;
                let dir = match (self.write_layer(rel), &self.user) {
                    (WriteLayer::User, Some(user)) => inner.workspace.real.join(user),
                    (WriteLayer::Project, _) => inner.project.real.clone(),
                    _ => inner.workspace.real.clone(),
                };
                Ok(rel.to_host(&dir))
            }
            Target::Direct {
                root,
                rel: Some(rel),
                writable,
                ..
            } => {
                if !writable {
                    return Err(read_only(raw));
                }
                let dir = self.root(*root).map_or(Path::new("/"), |r| &r.real);
                Ok(rel.to_host(dir))
            }
        }
    }
}

#[async_trait]
impl Filesystem for LocalFs {
    fn mode(&self) -> &'static str {
        "local"
    }

    fn shell(&self) -> Option<&dyn Shell> {
        self.inner.shell.as_ref().map(|s| s as &dyn Shell)
    }

    async fn read(&self, path: &str) -> Result<Bytes> {
        let raw = path.to_owned();
        self.blocking(move |this, _| {
            this.read_blocking(&raw, None)?
                .ok_or_else(|| not_found(&raw))
        })
        .await
    }

    async fn read_max(&self, path: &str, max: u64) -> Result<Bytes> {
        let raw = path.to_owned();
        self.blocking(move |this, _| {
            this.read_blocking(&raw, Some(max))?
                .ok_or_else(|| not_found(&raw))
        })
        .await
    }

    async fn write(&self, path: &str, data: Bytes) -> Result<WriteOutcome> {
        let (display, key, _) = self.prepare_write(path).await?;
        let _lock = self.inner.locks.lock(&key).await;
        // Existence is decided under the lock, so two creators cannot both report `created`.
        let (_, _, existed) = self.prepare_write(path).await?;
        let raw = path.to_owned();
        let len = data.len() as u64;
        self.blocking(move |this, _| this.write_blocking(&raw, &data))
            .await?;
        Ok(WriteOutcome {
            path: display,
            created: !existed,
            bytes: len,
        })
    }

    async fn update(&self, path: &str, update: &mut UpdateFn<'_>) -> Result<WriteOutcome> {
        let (display, key, _) = self.prepare_write(path).await?;
        let _lock = self.inner.locks.lock(&key).await;
        let raw = path.to_owned();
        // Copy-up: the current bytes come from whichever layer has them (read through a
        // handle beneath that layer), the new bytes go to the write layer.
        let current = self
            .blocking(move |this, _| this.read_blocking(&raw, Some(MAX_TEXT_BYTES)))
            .await?;
        let existed = current.is_some();
        let new = update(current)?;
        let len = new.len() as u64;
        let raw = path.to_owned();
        self.blocking(move |this, _| this.write_blocking(&raw, &new))
            .await?;
        Ok(WriteOutcome {
            path: display,
            created: !existed,
            bytes: len,
        })
    }

    async fn delete(&self, path: &str) -> Result<()> {
        let raw = path.to_owned();
        self.blocking(move |this, _| this.delete_blocking(&raw))
            .await
    }

    async fn rename(&self, from: &str, to: &str) -> Result<()> {
        let (from, to) = (from.to_owned(), to.to_owned());
        self.blocking(move |this, _| this.rename_blocking(&from, &to))
            .await
    }

    async fn stat(&self, path: &str) -> Result<Option<FileInfo>> {
        let raw = path.to_owned();
        self.blocking(move |this, _| this.stat_blocking(&raw)).await
    }

    async fn list(&self, path: &str) -> Result<Vec<FileInfo>> {
        let raw = path.to_owned();
        self.blocking(move |this, cancel| this.list_blocking(&raw, cancel))
            .await
    }

    async fn walk(&self, path: &str) -> Result<Vec<FileInfo>> {
        let raw = path.to_owned();
        self.blocking(move |this, cancel| this.walk_blocking(&raw, cancel))
            .await
    }
}

fn kind_of(meta: &fs::Metadata) -> FileKind {
    let ft = meta.file_type();
    if ft.is_file() {
        FileKind::File
    } else if ft.is_dir() {
        FileKind::Dir
    } else if ft.is_symlink() {
        FileKind::Symlink
    } else {
        FileKind::Other
    }
}

fn size_of(meta: &fs::Metadata) -> u64 {
    if meta.is_file() { meta.len() } else { 0 }
}

pub(crate) fn not_found(raw: &str) -> Error {
    Error::NotFound {
        what: "file or directory",
        key: raw.to_owned(),
    }
}

pub(crate) fn is_dir(raw: &str) -> Error {
    Error::invalid(
        "path",
        format!(
            "`{raw}` is a directory, not a file; use list_files or glob_files to see what is in it"
        ),
    )
}

pub(crate) fn not_a_dir(raw: &str) -> Error {
    Error::invalid(
        "path",
        format!("`{raw}` is a file, not a directory; use read_file to read it"),
    )
}

fn read_only(raw: &str) -> Error {
    Error::invalid(
        "path",
        format!(
            "`{raw}` is in the read-only project directory; write a copy under the workspace instead (edits copy project files up automatically)"
        ),
    )
}

fn conflict(to: &str) -> Error {
    Error::Conflict {
        key: to.to_owned(),
        reason: "the destination already exists; delete it first or choose another name".into(),
    }
}

fn into_itself(from: &str, to: &str) -> Error {
    Error::invalid("path", format!("cannot move `{from}` into itself (`{to}`)"))
}

#[cfg(test)]
mod tests;
