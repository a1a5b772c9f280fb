//! Mode 2: every operation goes to one call's sandbox through the box primitives (native file
//! read/write/remove, the metadata listing, tar export/import) and commands run inside it.
//!
//! A [`SandboxFs`] is made per call from that call's sandbox
//! (`SandboxFs::new(call.sandbox().clone())`) and owns the binding: nothing about "the current
//! sandbox" lives on a shared object, so concurrent calls can never cross into each other's
//! boxes. Symlinks are the backend's business: sandbox-local resolves `read_file`,
//! `write_file` and `remove` beneath a handle on the workspace (race-free against a command
//! swapping links), and a box with a kernel boundary confines them anyway.

use std::collections::BTreeMap;
use std::fmt;
use std::io::{self, Read as _};
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use bytes::Bytes;
use sandbox_core::archive::{self, ArchivePolicy, Checked, Validator};
use sandbox_core::stream::{self, ByteStream};
use sandbox_core::{
    EntryType, Error, ErrorKind, ExecRequest, ExecResult, ExportRequest, ImportMode, OutputLimits,
    RelPath, Result, Sandbox,
};

use crate::filesystem::{Filesystem, Shell, UpdateFn};
use crate::local::{is_dir, not_a_dir, not_found};
use crate::types::{FileInfo, FileKind, WriteOutcome};
use crate::work::{self, MAX_TEXT_BYTES};

/// Options of the sandbox mode.
///
/// | option | default |
/// | --- | --- |
/// | `timeout` | `None`: the backend's default |
/// | `max_output_bytes` | 100,000 (per stream) |
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct SandboxFsOptions {
    /// Default command timeout.
    pub timeout: Option<Duration>,
    /// Most bytes of stdout (and, separately, stderr) kept per command.
    pub max_output_bytes: usize,
}

impl Default for SandboxFsOptions {
    fn default() -> Self {
        SandboxFsOptions {
            timeout: None,
            max_output_bytes: 100_000,
        }
    }
}

impl SandboxFsOptions {
    /// Set the default command timeout.
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.timeout = Some(timeout);
        self
    }

    /// Set the per-stream output cap.
    pub fn max_output_bytes(mut self, max: usize) -> Self {
        self.max_output_bytes = max;
        self
    }
}

/// Mode 2 for one call: the call's sandbox seen as a [`Filesystem`] with a [`Shell`].
#[derive(Clone)]
pub struct SandboxFs {
    sandbox: Arc<Sandbox>,
    options: SandboxFsOptions,
    locks: Arc<crate::local::PathLocks>,
    shell: SandboxShell,
}

impl fmt::Debug for SandboxFs {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SandboxFs")
            .field("backend", &self.sandbox.backend())
            .field("key", &self.sandbox.key())
            .field("root", &self.sandbox.handle().workspace_root())
            .finish_non_exhaustive()
    }
}

/// The shell of a [`SandboxFs`]: commands run in the box, cwd = its workspace root.
#[derive(Clone)]
struct SandboxShell {
    sandbox: Arc<Sandbox>,
    options: SandboxFsOptions,
}

impl fmt::Debug for SandboxShell {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SandboxShell")
            .field("backend", &self.sandbox.backend())
            .finish_non_exhaustive()
    }
}

#[async_trait]
impl Shell for SandboxShell {
    async fn execute(&self, command: &str, timeout: Option<Duration>) -> Result<ExecResult> {
        let mut request =
            ExecRequest::shell(command).limits(OutputLimits::both(self.options.max_output_bytes));
        if let Some(t) = timeout.or(self.options.timeout) {
            request = request.timeout(t);
        }
        self.sandbox.exec(request).await
    }
}

impl SandboxFs {
    /// The filesystem of the call that owns `sandbox`, with default options.
    pub fn new(sandbox: Arc<Sandbox>) -> Self {
        Self::with_options(sandbox, SandboxFsOptions::default())
    }

    /// The filesystem of the call that owns `sandbox`.
    pub fn with_options(sandbox: Arc<Sandbox>, options: SandboxFsOptions) -> Self {
        SandboxFs {
            shell: SandboxShell {
                sandbox: sandbox.clone(),
                options,
            },
            sandbox,
            options,
            locks: Arc::new(crate::local::PathLocks::new()),
        }
    }

    /// The sandbox.
    pub fn sandbox(&self) -> &Arc<Sandbox> {
        &self.sandbox
    }

    /// The options.
    pub fn options(&self) -> SandboxFsOptions {
        self.options
    }

    /// Resolve a model's path: relative to the workspace root, or absolute under it.
    /// `None` is the root.
    fn resolve(&self, raw: &str) -> Result<Option<RelPath>> {
        if raw.contains('\0') {
            return Err(Error::path_escape(raw, "contains a NUL byte"));
        }
        if raw.is_empty() || raw == "." || raw == "./" {
            return Ok(None);
        }
        if let Some(abs) = raw.strip_prefix('/') {
            let root = self.sandbox.handle().workspace_root().trim_matches('/');
            let inside = Path::new(abs)
                .strip_prefix(root)
                .ok()
                .and_then(|rest| rest.to_str());
            return match inside {
                Some("") => Ok(None),
                Some(rest) if !rest.split('/').any(|c| c == "..") => RelPath::new(rest).map(Some),
                Some(_) => Err(Error::path_escape(raw, "`..` components are not allowed")),
                None => Err(Error::path_escape(
                    raw,
                    format!(
                        "absolute paths must lie under the workspace root /{root}; or use a relative path"
                    ),
                )),
            };
        }
        RelPath::new(raw).map(Some)
    }

    fn require_file(raw: &str, rel: Option<RelPath>) -> Result<RelPath> {
        rel.ok_or_else(|| {
            Error::invalid(
                "path",
                format!("`{raw}` is the workspace root; give a file path"),
            )
        })
    }

    /// What is at `rel`: the first entry of a one-path export (a header, no listing of the
    /// whole tree).
    async fn probe(&self, rel: &RelPath) -> Result<Option<FileInfo>> {
        let request = export_one(rel);
        let stream = match self.sandbox.handle().export(&request).await {
            Ok(s) => s,
            Err(e) if e.kind() == ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(e),
        };
        let shown = rel.to_string();
        tokio::task::spawn_blocking(move || -> Result<Option<FileInfo>> {
            let mut tar = tar::Archive::new(stream::blocking_reader(stream));
            let mut entries = tar.entries().map_err(|e| Error::io("export", e))?;
            let Some(entry) = entries.next() else {
                return Ok(None);
            };
            let entry = entry.map_err(Error::from)?;
            let h = entry.header();
            let kind = match h.entry_type() {
                tar::EntryType::Regular | tar::EntryType::Continuous => FileKind::File,
                tar::EntryType::Directory => FileKind::Dir,
                tar::EntryType::Symlink => FileKind::Symlink,
                _ => FileKind::Other,
            };
            let size = if kind == FileKind::File {
                h.size().unwrap_or(0)
            } else {
                0
            };
            let mtime = h
                .mtime()
                .ok()
                .map(|s| std::time::UNIX_EPOCH + Duration::from_secs(s));
            Ok(Some(FileInfo::new(shown, kind, size).modified(mtime)))
        })
        .await
        .map_err(|e| Error::backend("sandbox-fs", "stat", e.to_string()))?
    }

    async fn tree(&self) -> Result<Vec<sandbox_core::TreeEntry>> {
        self.sandbox.handle().list().await
    }

    async fn read_opt(&self, rel: &RelPath) -> Result<Option<Bytes>> {
        match self.sandbox.handle().read_file(rel).await {
            Ok(d) => Ok(Some(d)),
            Err(e) if e.kind() == ErrorKind::NotFound => Ok(None),
            Err(e) => Err(e),
        }
    }

    async fn put(
        &self,
        raw: &str,
        rel: &RelPath,
        data: Bytes,
        existing: Option<&FileInfo>,
    ) -> Result<()> {
        if existing.is_some_and(|i| i.kind == FileKind::Dir) {
            return Err(is_dir(raw));
        }
        self.sandbox.handle().write_file(rel, data, 0o644).await
    }
}

/// An export of one path (fields set on a default value: the request is non-exhaustive).
fn export_one(rel: &RelPath) -> ExportRequest {
    let mut request = ExportRequest::default();
    request.paths = Some(vec![rel.clone()]);
    request
}

fn kind_of(t: EntryType) -> FileKind {
    match t {
        EntryType::File => FileKind::File,
        EntryType::Dir => FileKind::Dir,
        EntryType::Symlink => FileKind::Symlink,
        EntryType::Other => FileKind::Other,
    }
}

#[async_trait]
impl Filesystem for SandboxFs {
    fn mode(&self) -> &'static str {
        "sandbox"
    }

    fn shell(&self) -> Option<&dyn Shell> {
        Some(&self.shell)
    }

    async fn read(&self, path: &str) -> Result<Bytes> {
        let rel = Self::require_file(path, self.resolve(path)?)?;
        match self.sandbox.handle().read_file(&rel).await {
            Err(e) if e.kind() == ErrorKind::NotFound => Err(not_found(path)),
            Err(Error::InvalidInput { reason, .. }) if reason.contains("directory") => {
                Err(is_dir(path))
            }
            other => other,
        }
    }

    async fn read_max(&self, path: &str, max: u64) -> Result<Bytes> {
        let rel = Self::require_file(path, self.resolve(path)?)?;
        // The size from a one-path export's header first: a file over the limit is not read.
        match self.probe(&rel).await? {
            None => return Err(not_found(path)),
            Some(info) if info.kind == FileKind::Dir => return Err(is_dir(path)),
            Some(info) => work::check_file_size(path, info.size, max)?,
        }
        let data = self.read(path).await?;
        work::check_file_size(path, data.len() as u64, max)?;
        Ok(data)
    }

    async fn write(&self, path: &str, data: Bytes) -> Result<WriteOutcome> {
        let rel = Self::require_file(path, self.resolve(path)?)?;
        let _lock = self.locks.lock(Path::new(rel.as_str())).await;
        let existing = self.probe(&rel).await?;
        let len = data.len() as u64;
        self.put(path, &rel, data, existing.as_ref()).await?;
        Ok(WriteOutcome {
            path: rel.to_string(),
            created: existing.is_none(),
            bytes: len,
        })
    }

    async fn update(&self, path: &str, update: &mut UpdateFn<'_>) -> Result<WriteOutcome> {
        let rel = Self::require_file(path, self.resolve(path)?)?;
        let _lock = self.locks.lock(Path::new(rel.as_str())).await;
        let existing = self.probe(&rel).await?;
        if existing.as_ref().is_some_and(|i| i.kind == FileKind::Dir) {
            return Err(is_dir(path));
        }
        if let Some(info) = &existing {
            work::check_file_size(path, info.size, MAX_TEXT_BYTES)?;
        }
        let current = self.read_opt(&rel).await?;
        if let Some(current) = &current {
            work::check_file_size(path, current.len() as u64, MAX_TEXT_BYTES)?;
        }
        let created = current.is_none();
        let new = update(current)?;
        let len = new.len() as u64;
        self.put(path, &rel, new, existing.as_ref()).await?;
        Ok(WriteOutcome {
            path: rel.to_string(),
            created,
            bytes: len,
        })
    }

    async fn delete(&self, path: &str) -> Result<()> {
        let rel = self
            .resolve(path)?
            .ok_or_else(|| Error::invalid("path", "the workspace root cannot be deleted"))?;
        if self.probe(&rel).await?.is_none() {
            return Err(not_found(path));
        }
        self.sandbox.handle().remove(&[rel]).await
    }

    async fn rename(&self, from: &str, to: &str) -> Result<()> {
        let src = Self::require_file(from, self.resolve(from)?)?;
        let dst = Self::require_file(to, self.resolve(to)?)?;
        let info = self.probe(&src).await?.ok_or_else(|| not_found(from))?;
        if self.probe(&dst).await?.is_some() {
            return Err(Error::Conflict {
                key: to.to_owned(),
                reason: "the destination already exists; delete it first or choose another name"
                    .into(),
            });
        }
        if dst.starts_with(&src) {
            return Err(Error::invalid(
                "path",
                format!("cannot move `{from}` into itself (`{to}`)"),
            ));
        }
        if info.kind == FileKind::File {
            let data = self.sandbox.handle().read_file(&src).await?;
            self.sandbox.handle().write_file(&dst, data, 0o644).await?;
        } else {
            // A tree (or a link) moves as a tar stream: exported, renamed entry by entry,
            // validated, imported beside the original.
            let request = export_one(&src);
            let exported = self.sandbox.handle().export(&request).await?;
            let renamed = rename_entries(exported, src.clone(), dst.clone());
            let checked = archive::sanitize(renamed, ArchivePolicy::default());
            self.sandbox
                .handle()
                .import(checked, ImportMode::Merge)
                .await?;
        }
        self.sandbox.handle().remove(&[src]).await
    }

    async fn stat(&self, path: &str) -> Result<Option<FileInfo>> {
        match self.resolve(path)? {
            None => Ok(Some(FileInfo::new("", FileKind::Dir, 0))),
            Some(rel) => self.probe(&rel).await,
        }
    }

    async fn list(&self, path: &str) -> Result<Vec<FileInfo>> {
        let dir = self.resolve(path)?;
        if let Some(rel) = &dir {
            match self.probe(rel).await? {
                None => return Err(not_found(path)),
                Some(i) if i.kind != FileKind::Dir => return Err(not_a_dir(path)),
                Some(_) => {}
            }
        }
        let mut out = BTreeMap::new();
        for e in self.tree().await? {
            let parent = e.path.parent();
            if parent.as_ref() == dir.as_ref() {
                let size = if e.kind == EntryType::File { e.size } else { 0 };
                out.insert(
                    e.path.to_string(),
                    FileInfo::new(e.path.to_string(), kind_of(e.kind), size),
                );
            }
        }
        Ok(out.into_values().collect())
    }

    async fn walk(&self, path: &str) -> Result<Vec<FileInfo>> {
        let dir = self.resolve(path)?;
        if let Some(rel) = &dir {
            match self.probe(rel).await? {
                None => return Err(not_found(path)),
                Some(i) if i.kind != FileKind::Dir => return Ok(vec![i]),
                Some(_) => {}
            }
        }
        let mut out = Vec::new();
        for e in self.tree().await? {
            if e.kind == EntryType::Dir {
                continue;
            }
            if let Some(d) = &dir
                && !e.path.starts_with(d)
            {
                continue;
            }
            if e.path.components().any(|c| c == ".git") {
                continue;
            }
            let size = if e.kind == EntryType::File { e.size } else { 0 };
            out.push(FileInfo::new(e.path.to_string(), kind_of(e.kind), size));
        }
        out.sort_by(|a, b| a.path.cmp(&b.path));
        Ok(out)
    }
}

/// Re-emit a tar stream with every path under `from` moved under `to`. Entries are validated
/// on the way in; the output is validated again by the caller before import.
fn rename_entries(input: ByteStream, from: RelPath, to: RelPath) -> ByteStream {
    stream::spawn_writer(8, move |w| {
        let mut reader = stream::blocking_reader(input);
        let mut tar = tar::Archive::new(&mut reader);
        let mut out = tar::Builder::new(w);
        let mut validator = Validator::new(ArchivePolicy::default());
        let moved = |p: &RelPath| -> Result<RelPath> {
            if p == &from {
                Ok(to.clone())
            } else {
                let rest = p.as_str().strip_prefix(from.as_str()).unwrap_or(p.as_str());
                RelPath::new(format!("{to}{rest}"))
            }
        };
        let bad = |e: io::Error| Error::unsafe_archive("export", e.to_string());
        for entry in tar.entries().map_err(bad)? {
            let mut entry = entry.map_err(bad)?;
            let Some(checked) = validator.check(&entry)? else {
                continue;
            };
            let mut h = tar::Header::new_gnu();
            h.set_mode(entry.header().mode().unwrap_or(0o644) & 0o1777);
            h.set_mtime(entry.header().mtime().unwrap_or(0));
            let r = match &checked {
                Checked::File { path, size } => {
                    h.set_entry_type(tar::EntryType::Regular);
                    h.set_size(*size);
                    let path = moved(path)?;
                    let mut data = Vec::with_capacity(stream::capacity_for(*size));
                    entry.read_to_end(&mut data).map_err(bad)?;
                    out.append_data(&mut h, path.as_str(), &data[..])
                }
                Checked::Dir { path } => {
                    h.set_entry_type(tar::EntryType::Directory);
                    h.set_size(0);
                    out.append_data(&mut h, moved(path)?.as_str(), io::empty())
                }
                Checked::Symlink { path, target } => {
                    h.set_entry_type(tar::EntryType::Symlink);
                    h.set_size(0);
                    out.append_link(&mut h, moved(path)?.as_str(), target)
                }
                Checked::HardLink { path, target } => {
                    h.set_entry_type(tar::EntryType::Link);
                    h.set_size(0);
                    out.append_link(&mut h, moved(path)?.as_str(), moved(target)?.as_str())
                }
            };
            r.map_err(|e| Error::io("tar", e))?;
        }
        out.finish().map_err(|e| Error::io("tar", e))?;
        Ok(())
    })
}
