//! Mode 3, the default: local files and a host shell.
//!
//! The view an agent sees is an overlay: the workspace (upper, writable) over the project
//! (lower, read-only unless `project_writable`). Reads try the layers top-down; writes go to one
//! layer chosen by path; list, glob and grep merge the layers with the upper one winning. With a
//! user bound ([`LocalFs::for_user`]) a third layer, `workspace/<user>/`, sits on top for
//! user-level paths (`MEMORY.md`, `memory/`, `agents/`, `plans/`, `skills/`), and a user's
//! `skills/<name>/` hides the shared skill of that name entirely.

mod options;
mod shell;

use std::collections::BTreeMap;
use std::fmt;
use std::fs;
use std::hash::{Hash, Hasher};
use std::io::{self, Write as _};
use std::os::unix::fs::PermissionsExt as _;
use std::path::{Component, Path, PathBuf};
use std::sync::Arc;

use async_trait::async_trait;
use bytes::Bytes;
use sandbox_core::{Error, RelPath, Result};

pub use options::{DEFAULT_WORKSPACE_DIR, LocalOptions, PathPolicy};
use shell::LocalShell;

use crate::filesystem::{Filesystem, Shell, UpdateFn};
use crate::types::{FileInfo, FileKind, WriteOutcome};

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

#[derive(Debug, Clone)]
struct Root {
    /// As configured (made absolute, lexically normalized).
    given: PathBuf,
    /// Canonical.
    real: PathBuf,
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
        Ok(Root { given, real })
    }

    /// `abs` relative to this root, if it lies at or under it (compared by components).
    fn strip<'a>(&self, abs: &'a Path) -> Option<&'a Path> {
        abs.strip_prefix(&self.given)
            .or_else(|_| abs.strip_prefix(&self.real))
            .ok()
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
        root: PathBuf,
        display: PathBuf,
        rel: Option<RelPath>,
        writable: bool,
    },
}

/// One place a path may be found.
#[derive(Debug, Clone)]
struct Candidate {
    abs: PathBuf,
    writable: bool,
    /// 0 = top layer.
    layer: usize,
}

impl LocalFs {
    /// Open (creating the workspace directory) with `options`.
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

    fn user_dir(&self) -> Option<PathBuf> {
        self.user
            .as_ref()
            .map(|u| self.inner.workspace.real.join(u))
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
        let mut roots: Vec<(&Root, bool, bool)> = vec![
            (&inner.workspace, true, true),
            (&inner.project, inner.project_writable, false),
        ];
        roots.extend(inner.extra.iter().map(|r| (r, true, false)));
        // Longest root first: the workspace usually lies inside the project.
        roots.sort_by_key(|(r, _, _)| std::cmp::Reverse(r.given.components().count()));
        for (root, writable, is_ws) in roots {
            if let Some(rest) = root.strip(&path) {
                let rel = if rest.as_os_str().is_empty() {
                    None
                } else {
                    Some(RelPath::from_path(rest)?)
                };
                if is_ws && let Some(rel) = &rel {
                    self.check_user_component(raw, rel)?;
                }
                return Ok(Target::Direct {
                    root: root.real.clone(),
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
                root: PathBuf::from("/"),
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

    /// Refuse a workspace path whose first component is another user's directory.
    fn check_user_component(&self, raw: &str, rel: &RelPath) -> Result<()> {
        let first = first_component(rel);
        if self.user.as_deref() == Some(first) {
            return Ok(());
        }
        if self
            .inner
            .workspace
            .real
            .join(first)
            .join(USER_MARKER)
            .exists()
        {
            return Err(Error::path_escape(
                raw,
                "this directory belongs to another user",
            ));
        }
        Ok(())
    }

    /// Check where `abs` really leads (symlinks resolved): inside an allowed root and not in
    /// another user's directory.
    fn check_resolved(&self, abs: &Path, raw: &str) -> Result<()> {
        if self.inner.policy == PathPolicy::Unrestricted {
            return Ok(());
        }
        let mut probe = abs;
        let real = loop {
            match fs::canonicalize(probe) {
                Ok(real) => break real,
                Err(e)
                    if matches!(
                        e.kind(),
                        io::ErrorKind::NotFound | io::ErrorKind::NotADirectory
                    ) =>
                {
                    match probe.parent() {
                        Some(parent) => probe = parent,
                        None => return Ok(()),
                    }
                }
                Err(e) => return Err(Error::io(probe, e)),
            }
        };
        let inner = &self.inner;
        let mut allowed = vec![&inner.workspace.real, &inner.project.real];
        if inner.policy == PathPolicy::Rooted {
            allowed.extend(inner.extra.iter().map(|r| &r.real));
        }
        if !allowed.iter().any(|root| real.starts_with(root)) {
            return Err(Error::path_escape(
                raw,
                "resolves (through a symlink) to a place outside the allowed roots",
            ));
        }
        if let Ok(rest) = real.strip_prefix(&inner.workspace.real)
            && let Some(Component::Normal(first)) = rest.components().next()
            && self.user.as_deref().map(std::ffi::OsStr::new) != Some(first)
            && inner.workspace.real.join(first).join(USER_MARKER).exists()
        {
            return Err(Error::path_escape(
                raw,
                "resolves into another user's directory",
            ));
        }
        Ok(())
    }

    /// The layers of the view for `rel`, top first.
    fn layers(&self, rel: Option<&RelPath>) -> Vec<(PathBuf, bool)> {
        let inner = &self.inner;
        let mut out = Vec::new();
        let user_level = rel.is_none_or(is_user_level);
        if let Some(user_dir) = self.user_dir()
            && user_level
        {
            // A user's skills/<name>/ replaces the shared skill of that name.
            if let Some(rel) = rel {
                let parts: Vec<&str> = rel.components().collect();
                if parts.len() >= 2
                    && parts[0] == "skills"
                    && user_dir.join("skills").join(parts[1]).is_dir()
                {
                    return vec![(user_dir, true)];
                }
            }
            out.push((user_dir, true));
        }
        out.push((inner.workspace.real.clone(), true));
        let project_writable = inner.project_writable && rel.is_some_and(|r| !is_metadata(r));
        out.push((inner.project.real.clone(), project_writable));
        out
    }

    fn candidates(&self, target: &Target) -> Vec<Candidate> {
        match target {
            Target::View(rel) => self
                .layers(rel.as_ref())
                .into_iter()
                .enumerate()
                .map(|(layer, (dir, writable))| Candidate {
                    abs: rel.as_ref().map_or(dir.clone(), |r| r.to_host(&dir)),
                    writable,
                    layer,
                })
                .collect(),
            Target::Direct {
                root,
                rel,
                writable,
                ..
            } => vec![Candidate {
                abs: rel.as_ref().map_or(root.clone(), |r| r.to_host(root)),
                writable: *writable,
                layer: 0,
            }],
        }
    }

    /// Where a write to `target` goes.
    fn write_target(&self, target: &Target, raw: &str) -> Result<PathBuf> {
        match target {
            Target::View(None) | Target::Direct { rel: None, .. } => Err(Error::invalid(
                "path",
                format!("`{raw}` is a root directory; give a file path"),
            )),
            Target::View(Some(rel)) => {
                let dir = if let (Some(user_dir), true) = (self.user_dir(), is_user_level(rel)) {
                    user_dir
                } else if self.inner.project_writable && !is_metadata(rel) {
                    self.inner.project.real.clone()
                } else {
                    self.inner.workspace.real.clone()
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
                Ok(rel.to_host(root))
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

    /// Make sure the bound user's directory exists and is marked.
    fn ensure_user_dir(&self, abs: &Path) -> Result<()> {
        if let Some(user_dir) = self.user_dir()
            && abs.starts_with(&user_dir)
        {
            fs::create_dir_all(&user_dir).map_err(|e| Error::io(&user_dir, e))?;
            let marker = user_dir.join(USER_MARKER);
            if !marker.exists() {
                fs::write(&marker, b"").map_err(|e| Error::io(&marker, e))?;
            }
        }
        Ok(())
    }

    /// Whether `name` in directory `dir` is hidden from listings.
    fn hidden(&self, dir: &Path, name: &str) -> bool {
        if name.contains(TMP_TAG) || name == USER_MARKER {
            return true;
        }
        let abs = dir.join(name);
        let ws = &self.inner.workspace.real;
        // The workspace (and the default layout's own directory around it) is not project
        // content.
        if &abs == ws || (name == WORKSPACE_PARENT && ws.starts_with(&abs)) {
            return true;
        }
        dir == self.inner.workspace.real && abs.join(USER_MARKER).exists()
    }

    // ---- blocking operations ------------------------------------------------------

    fn first_existing(
        &self,
        target: &Target,
        raw: &str,
    ) -> Result<Option<(Candidate, fs::Metadata)>> {
        for cand in self.candidates(target) {
            self.check_resolved(&cand.abs, raw)?;
            match fs::metadata(&cand.abs) {
                Ok(meta) => return Ok(Some((cand, meta))),
                Err(e)
                    if matches!(
                        e.kind(),
                        io::ErrorKind::NotFound | io::ErrorKind::NotADirectory
                    ) => {}
                Err(e) => return Err(Error::io(&cand.abs, e)),
            }
        }
        Ok(None)
    }

    fn read_blocking(&self, raw: &str) -> Result<Option<Bytes>> {
        let target = self.locate(raw)?;
        match self.first_existing(&target, raw)? {
            None => Ok(None),
            Some((_, meta)) if meta.is_dir() => Err(is_dir(raw)),
            Some((cand, _)) => fs::read(&cand.abs)
                .map(|d| Some(Bytes::from(d)))
                .map_err(|e| Error::io(&cand.abs, e)),
        }
    }

    fn write_blocking(&self, raw: &str, abs: &Path, data: &[u8]) -> Result<()> {
        self.check_resolved(abs, raw)?;
        self.ensure_user_dir(abs)?;
        write_atomic(abs, data)
    }

    fn stat_blocking(&self, raw: &str) -> Result<Option<FileInfo>> {
        let target = self.locate(raw)?;
        Ok(self.first_existing(&target, raw)?.map(|(_, meta)| {
            FileInfo::new(Self::display(&target), kind_of(&meta), size_of(&meta))
                .modified(meta.modified().ok())
        }))
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
        for cand in self.candidates(&target) {
            // The link itself is removed, never what it points to; the check still applies to
            // where it lies.
            if let Some(parent) = cand.abs.parent() {
                self.check_resolved(parent, raw)?;
            }
            let meta = match fs::symlink_metadata(&cand.abs) {
                Ok(m) => m,
                Err(e)
                    if matches!(
                        e.kind(),
                        io::ErrorKind::NotFound | io::ErrorKind::NotADirectory
                    ) =>
                {
                    continue;
                }
                Err(e) => return Err(Error::io(&cand.abs, e)),
            };
            if !cand.writable {
                return Err(read_only(raw));
            }
            let r = if meta.is_dir() {
                fs::remove_dir_all(&cand.abs)
            } else {
                fs::remove_file(&cand.abs)
            };
            return r.map_err(|e| Error::io(&cand.abs, e));
        }
        Err(not_found(raw))
    }

    fn rename_blocking(&self, from: &str, to: &str) -> Result<()> {
        let src_target = self.locate(from)?;
        let dst_target = self.locate(to)?;
        let (src, _) = self
            .first_existing(&src_target, from)?
            .ok_or_else(|| not_found(from))?;
        if !src.writable {
            return Err(read_only(from));
        }
        if self.first_existing(&dst_target, to)?.is_some() {
            return Err(Error::Conflict {
                key: to.to_owned(),
                reason: "the destination already exists; delete it first or choose another name"
                    .into(),
            });
        }
        let dst = self.write_target(&dst_target, to)?;
        if dst.starts_with(&src.abs) {
            return Err(Error::invalid(
                "path",
                format!("cannot move `{from}` into itself (`{to}`)"),
            ));
        }
        self.check_resolved(&dst, to)?;
        self.ensure_user_dir(&dst)?;
        if let Some(parent) = dst.parent() {
            fs::create_dir_all(parent).map_err(|e| Error::io(parent, e))?;
        }
        match fs::rename(&src.abs, &dst) {
            Ok(()) => Ok(()),
            Err(e) if e.kind() == io::ErrorKind::CrossesDevices => {
                copy_tree(&src.abs, &dst)?;
                let meta = fs::symlink_metadata(&src.abs).map_err(|e| Error::io(&src.abs, e))?;
                if meta.is_dir() {
                    fs::remove_dir_all(&src.abs)
                } else {
                    fs::remove_file(&src.abs)
                }
                .map_err(|e| Error::io(&src.abs, e))
            }
            Err(e) => Err(Error::io(&src.abs, e)),
        }
    }

    fn list_blocking(&self, raw: &str) -> Result<Vec<FileInfo>> {
        let target = self.locate(raw)?;
        let mut merged: BTreeMap<String, FileInfo> = BTreeMap::new();
        let mut any_dir = false;
        let mut any_file = false;
        for cand in self.candidates(&target) {
            self.check_resolved(&cand.abs, raw)?;
            match fs::metadata(&cand.abs) {
                Ok(m) if m.is_dir() => any_dir = true,
                Ok(_) => {
                    any_file = true;
                    continue;
                }
                Err(_) => continue,
            }
            let entries = fs::read_dir(&cand.abs).map_err(|e| Error::io(&cand.abs, e))?;
            for entry in entries {
                let entry = entry.map_err(|e| Error::io(&cand.abs, e))?;
                let Some(name) = entry.file_name().to_str().map(str::to_owned) else {
                    continue;
                };
                if self.hidden(&cand.abs, &name) || merged.contains_key(&name) {
                    continue;
                }
                let meta = entry.metadata().map_err(|e| Error::io(entry.path(), e))?;
                let info = FileInfo::new(
                    Self::display_child(&target, &name),
                    kind_of(&meta),
                    size_of(&meta),
                )
                .modified(meta.modified().ok());
                merged.insert(name, info);
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

    fn walk_blocking(&self, raw: &str) -> Result<Vec<FileInfo>> {
        let target = self.locate(raw)?;
        let mut merged: BTreeMap<String, FileInfo> = BTreeMap::new();
        let mut found = false;
        // Skills the bound user overrides: lower layers' copies are hidden.
        let overridden: Vec<String> = match (&target, self.user_dir()) {
            (Target::View(_), Some(user_dir)) => fs::read_dir(user_dir.join("skills"))
                .map(|rd| {
                    rd.filter_map(|e| e.ok())
                        .filter(|e| e.path().is_dir())
                        .filter_map(|e| e.file_name().to_str().map(|n| format!("skills/{n}/")))
                        .collect()
                })
                .unwrap_or_default(),
            _ => Vec::new(),
        };
        for cand in self.candidates(&target) {
            self.check_resolved(&cand.abs, raw)?;
            let Ok(meta) = fs::metadata(&cand.abs) else {
                continue;
            };
            found = true;
            let base = Self::display(&target);
            if !meta.is_dir() {
                merged.entry(base.clone()).or_insert_with(|| {
                    FileInfo::new(base, kind_of(&meta), size_of(&meta))
                        .modified(meta.modified().ok())
                });
                continue;
            }
            let mut stack = vec![(cand.abs.clone(), base)];
            while let Some((dir, shown)) = stack.pop() {
                let Ok(entries) = fs::read_dir(&dir) else {
                    continue;
                };
                for entry in entries.flatten() {
                    let Some(name) = entry.file_name().to_str().map(str::to_owned) else {
                        continue;
                    };
                    if name == ".git" || self.hidden(&dir, &name) {
                        continue;
                    }
                    let path = if shown.is_empty() {
                        name.clone()
                    } else {
                        format!("{}/{name}", shown.trim_end_matches('/'))
                    };
                    if cand.layer > 0 && overridden.iter().any(|o| path.starts_with(o.as_str())) {
                        continue;
                    }
                    let Ok(meta) = entry.metadata() else {
                        continue;
                    };
                    if meta.is_dir() {
                        stack.push((entry.path(), path));
                    } else if !merged.contains_key(&path) {
                        if merged.len() >= WALK_LIMIT {
                            tracing::warn!(limit = WALK_LIMIT, "walk stopped at its entry limit");
                            return Ok(merged.into_values().collect());
                        }
                        let info = FileInfo::new(path.clone(), kind_of(&meta), size_of(&meta))
                            .modified(meta.modified().ok());
                        merged.insert(path, info);
                    }
                }
            }
        }
        if !found {
            return Err(not_found(raw));
        }
        Ok(merged.into_values().collect())
    }

    async fn blocking<T, F>(&self, f: F) -> Result<T>
    where
        T: Send + 'static,
        F: FnOnce(LocalFs) -> Result<T> + Send + 'static,
    {
        let this = self.clone();
        tokio::task::spawn_blocking(move || f(this))
            .await
            .map_err(|e| Error::backend("local", "file operation", format!("worker failed: {e}")))?
    }

    /// Resolve `raw` for a write: (display path, write target, whether it existed).
    async fn prepare_write(&self, raw: &str) -> Result<(String, PathBuf, bool)> {
        let raw_owned = raw.to_owned();
        self.blocking(move |this| {
            let target = this.locate(&raw_owned)?;
            let dst = this.write_target(&target, &raw_owned)?;
            this.check_resolved(&dst, &raw_owned)?;
            let existed = match this.first_existing(&target, &raw_owned)? {
                Some((_, meta)) if meta.is_dir() => return Err(is_dir(&raw_owned)),
                Some(_) => true,
                None => false,
            };
            Ok((Self::display(&target), dst, existed))
        })
        .await
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
        self.blocking(move |this| this.read_blocking(&raw)?.ok_or_else(|| not_found(&raw)))
            .await
    }

    async fn write(&self, path: &str, data: Bytes) -> Result<WriteOutcome> {
        let (display, dst, _) = self.prepare_write(path).await?;
        let _lock = self.inner.locks.lock(&dst).await;
        // Existence is decided under the lock, so two creators cannot both report `created`.
        let (_, _, existed) = self.prepare_write(path).await?;
        let raw = path.to_owned();
        let len = data.len() as u64;
        self.blocking(move |this| this.write_blocking(&raw, &dst, &data))
            .await?;
        Ok(WriteOutcome {
            path: display,
            created: !existed,
            bytes: len,
        })
    }

    async fn update(&self, path: &str, update: &mut UpdateFn<'_>) -> Result<WriteOutcome> {
        let (display, dst, _) = self.prepare_write(path).await?;
        let _lock = self.inner.locks.lock(&dst).await;
        let raw = path.to_owned();
        let current = self.blocking(move |this| this.read_blocking(&raw)).await?;
        let existed = current.is_some();
        let new = update(current)?;
        let len = new.len() as u64;
        let raw = path.to_owned();
        self.blocking(move |this| this.write_blocking(&raw, &dst, &new))
            .await?;
        Ok(WriteOutcome {
            path: display,
            created: !existed,
            bytes: len,
        })
    }

    async fn delete(&self, path: &str) -> Result<()> {
        let raw = path.to_owned();
        self.blocking(move |this| this.delete_blocking(&raw)).await
    }

    async fn rename(&self, from: &str, to: &str) -> Result<()> {
        let (from, to) = (from.to_owned(), to.to_owned());
        self.blocking(move |this| this.rename_blocking(&from, &to))
            .await
    }

    async fn stat(&self, path: &str) -> Result<Option<FileInfo>> {
        let raw = path.to_owned();
        self.blocking(move |this| this.stat_blocking(&raw)).await
    }

    async fn list(&self, path: &str) -> Result<Vec<FileInfo>> {
        let raw = path.to_owned();
        self.blocking(move |this| this.list_blocking(&raw)).await
    }

    async fn walk(&self, path: &str) -> Result<Vec<FileInfo>> {
        let raw = path.to_owned();
        self.blocking(move |this| this.walk_blocking(&raw)).await
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

/// Replace `abs` atomically: write a temporary file beside it, then rename it over. Keeps the
/// permission bits of a file it replaces. A symlink at `abs` is replaced, never written through.
fn write_atomic(abs: &Path, data: &[u8]) -> Result<()> {
    let parent = abs
        .parent()
        .ok_or_else(|| Error::invalid("path", "no parent directory"))?;
    fs::create_dir_all(parent).map_err(|e| Error::io(parent, e))?;
    let name = abs
        .file_name()
        .and_then(|n| n.to_str())
        .ok_or_else(|| Error::invalid("path", "no file name"))?;
    let tmp = parent.join(format!(".{name}{TMP_TAG}{}", uuid::Uuid::new_v4().simple()));
    let mode = fs::symlink_metadata(abs)
        .ok()
        .filter(|m| m.is_file())
        .map(|m| m.permissions().mode());
    let result = (|| {
        let mut file = fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .open(&tmp)?;
        file.write_all(data)?;
        if let Some(mode) = mode {
            file.set_permissions(fs::Permissions::from_mode(mode))?;
        }
        file.sync_data()?;
        fs::rename(&tmp, abs)
    })();
    if let Err(e) = result {
        let _ = fs::remove_file(&tmp);
        return Err(Error::io(abs, e));
    }
    Ok(())
}

/// Copy a file or directory tree (symlinks copied as links).
fn copy_tree(src: &Path, dst: &Path) -> Result<()> {
    let meta = fs::symlink_metadata(src).map_err(|e| Error::io(src, e))?;
    if meta.file_type().is_symlink() {
        let target = fs::read_link(src).map_err(|e| Error::io(src, e))?;
        std::os::unix::fs::symlink(target, dst).map_err(|e| Error::io(dst, e))
    } else if meta.is_dir() {
        fs::create_dir_all(dst).map_err(|e| Error::io(dst, e))?;
        for entry in fs::read_dir(src).map_err(|e| Error::io(src, e))? {
            let entry = entry.map_err(|e| Error::io(src, e))?;
            copy_tree(&entry.path(), &dst.join(entry.file_name()))?;
        }
        Ok(())
    } else {
        fs::copy(src, dst)
            .map(|_| ())
            .map_err(|e| Error::io(dst, e))
    }
}

#[cfg(test)]
mod tests;
