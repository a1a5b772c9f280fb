//! The contract every mode implements: [`Filesystem`] (the file primitives), [`Shell`] (the
//! optional command capability), and [`FilesystemExt`] (line-window reads, edits, glob, grep
//! and `execute`, written once over the primitives).

use std::fmt;
use std::time::{Duration, Instant};

use async_trait::async_trait;
use bytes::Bytes;
use sandbox_core::{Error, ExecResult, Result};

use crate::text;
use crate::types::{
    EditOutcome, EditRequest, FileInfo, FileKind, GlobOptions, GlobResult, GrepOptions, GrepResult,
    ReadOptions, TextWindow, WriteOutcome,
};

/// A read-modify-write step: gets the current bytes (`None` when the file does not exist) and
/// returns the new bytes. It may be called more than once (the shared store retries it after
/// losing a compare-and-set race), so it must not have side effects.
pub type UpdateFn<'a> = dyn FnMut(Option<Bytes>) -> Result<Bytes> + Send + 'a;

/// The agent's workspace, whatever holds it.
///
/// Paths are strings as a model writes them; each mode resolves them by its policy and refuses
/// what it must with [`Error::PathEscape`] (a `..` component, an absolute path outside the
/// allowed roots, a NUL byte, a symlink resolving outside). The empty string and `.` name the
/// root of the workspace view. Contents are bytes: nothing is re-encoded on the way.
#[async_trait]
pub trait Filesystem: Send + Sync + fmt::Debug + 'static {
    /// The mode's name: `local`, `shared_store`, `sandbox` or a custom one.
    fn mode(&self) -> &'static str;

    /// The shell of this mode, if it has one.
    fn shell(&self) -> Option<&dyn Shell>;

    /// A file's bytes. Directories are [`Error::InvalidInput`], missing files
    /// [`Error::NotFound`].
    async fn read(&self, path: &str) -> Result<Bytes>;

    /// Replace (or create) a file atomically, creating parent directories.
    async fn write(&self, path: &str, data: Bytes) -> Result<WriteOutcome>;

    /// Read-modify-write one file without losing a concurrent update: the mode serializes or
    /// compare-and-sets, retrying `update` as needed.
    async fn update(&self, path: &str, update: &mut UpdateFn<'_>) -> Result<WriteOutcome>;

    /// Remove a file, or a directory and everything under it. Layered modes remove the
    /// writable copy only; a read-only lower copy (project, local template) stays visible.
    async fn delete(&self, path: &str) -> Result<()>;

    /// Move a file or directory. The destination must not exist.
    async fn rename(&self, from: &str, to: &str) -> Result<()>;

    /// What is at `path`, or `None`.
    async fn stat(&self, path: &str) -> Result<Option<FileInfo>>;

    /// The entries directly in the directory `path`, sorted by name.
    async fn list(&self, path: &str) -> Result<Vec<FileInfo>>;

    /// Every file under `path` (recursively; `path` itself if it is a file), sorted by path.
    /// Directories are not included. Version-control metadata (`.git/`) is skipped.
    async fn walk(&self, path: &str) -> Result<Vec<FileInfo>>;
}

/// Running commands where the workspace is.
#[async_trait]
pub trait Shell: Send + Sync + fmt::Debug {
    /// Run `command` with the mode's shell. `timeout` `None` uses the mode's default. A timeout
    /// kills the command's whole process tree and returns the output so far with
    /// `timed_out = true`; a non-zero exit is a result, not an error.
    async fn execute(&self, command: &str, timeout: Option<Duration>) -> Result<ExecResult>;
}

/// The typed "no shell in this mode" error.
pub fn no_shell(mode: &'static str) -> Error {
    Error::NotSupported {
        backend: mode,
        operation: "execute (this mode has no shell)",
    }
}

/// Operations built once on top of the [`Filesystem`] primitives.
#[async_trait]
pub trait FilesystemExt: Filesystem {
    /// Whether something exists at `path`.
    async fn exists(&self, path: &str) -> Result<bool> {
        Ok(self.stat(path).await?.is_some())
    }

    /// A line window of a text file, line-numbered. Binary files are
    /// [`Error::InvalidInput`] (read them with [`Filesystem::read`]).
    async fn read_text(&self, path: &str, options: ReadOptions) -> Result<TextWindow> {
        let data = self.read(path).await?;
        text::window(path, &data, options)
    }

    /// Replace `old` with `new` in a text file; see [`EditRequest`]. Keeps the file's line
    /// endings: with a CRLF file, `\n` in `old` and `new` stand for `\r\n`.
    async fn edit(&self, path: &str, request: EditRequest) -> Result<EditOutcome> {
        let mut outcome = None;
        let mut step = |current: Option<Bytes>| -> Result<Bytes> {
            let current = current.ok_or_else(|| Error::NotFound {
                what: "file",
                key: path.to_owned(),
            })?;
            let (new, edit) = text::apply_edit(path, &current, &request)?;
            outcome = Some(edit);
            Ok(new)
        };
        self.update(path, &mut step).await?;
        Ok(outcome.expect("update ran the edit"))
    }

    /// Files matching a gitignore-style `pattern` under `options.base`: a pattern without a
    /// `/` matches a name at any depth (`*.md`), one with a `/` is anchored at the base
    /// (`src/**/*.rs`), `dir/` matches everything under `dir`.
    async fn glob(&self, pattern: &str, options: GlobOptions) -> Result<GlobResult> {
        let matcher = text::GlobMatcher::new(pattern)?;
        let base = options.base.trim_end_matches('/');
        let mut files = Vec::new();
        let mut truncated = false;
        for info in self.walk(base).await? {
            let rel = text::relative_to(base, &info.path);
            if matcher.is_match(rel) {
                if files.len() == options.max_results {
                    truncated = true;
                    break;
                }
                files.push(info);
            }
        }
        Ok(GlobResult { files, truncated })
    }

    /// Lines matching a pattern; see [`GrepOptions`]. Binary and oversized files are skipped
    /// and counted.
    async fn grep(&self, options: GrepOptions) -> Result<GrepResult> {
        let regex = text::grep_regex(&options)?;
        let include = options
            .include
            .as_deref()
            .map(text::GlobMatcher::new)
            .transpose()?;
        let deadline = Instant::now() + options.timeout;
        let base = options.path.trim_end_matches('/');
        let mut result = GrepResult::default();
        let files = match tokio::time::timeout_at(deadline.into(), self.walk(base)).await {
            Ok(files) => files?,
            Err(_) => {
                result.timed_out = true;
                return Ok(result);
            }
        };
        for info in files {
            if let Some(include) = &include
                && !include.is_match(text::relative_to(base, &info.path))
            {
                continue;
            }
            if info.kind != FileKind::File || info.size > options.max_file_bytes {
                result.files_skipped += 1;
                continue;
            }
            let data = match tokio::time::timeout_at(deadline.into(), self.read(&info.path)).await {
                Ok(Ok(data)) => data,
                // A file removed between walk and read is not an error of the search.
                Ok(Err(e)) if e.kind() == sandbox_core::ErrorKind::NotFound => continue,
                Ok(Err(e)) => return Err(e),
                Err(_) => {
                    result.timed_out = true;
                    break;
                }
            };
            if text::is_binary(&data) {
                result.files_skipped += 1;
                continue;
            }
            result.files_searched += 1;
            if text::grep_into(&regex, &info.path, &data, options.max_results, &mut result) {
                result.truncated = true;
                break;
            }
            if Instant::now() >= deadline {
                result.timed_out = true;
                break;
            }
        }
        Ok(result)
    }

    /// Run a command with this mode's shell, or fail with [`no_shell`] where it has none.
    async fn execute(&self, command: &str, timeout: Option<Duration>) -> Result<ExecResult> {
        match self.shell() {
            Some(shell) => shell.execute(command, timeout).await,
            None => Err(no_shell(self.mode())),
        }
    }
}

impl<T: Filesystem + ?Sized> FilesystemExt for T {}
