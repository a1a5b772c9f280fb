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
    ListResult, ReadOptions, TextWindow, WriteOutcome,
};
use crate::work::{self, INLINE_BYTES, MAX_TEXT_BYTES, off_worker};

/// Attempts of an [`edit`](FilesystemExt::edit) whose file keeps changing between its read
/// and its write.
const EDIT_ATTEMPTS: usize = 16;

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
    /// [`Error::NotFound`]. The whole file is read: use [`read_max`](Self::read_max) where its
    /// size is not yours to choose.
    async fn read(&self, path: &str) -> Result<Bytes>;

    /// A file's bytes if it has at most `max` of them, else [`Error::LimitExceeded`]. The
    /// built-in modes look at the size before reading and never hold more than `max + 1`
    /// bytes (sandbox mode: the backend's `read_file` reads a file that grew since); this
    /// default reads the whole file, then checks.
    async fn read_max(&self, path: &str, max: u64) -> Result<Bytes> {
        let data = self.read(path).await?;
        work::check_file_size(path, data.len() as u64, max)?;
        Ok(data)
    }

    /// Replace (or create) a file atomically, creating parent directories.
    async fn write(&self, path: &str, data: Bytes) -> Result<WriteOutcome>;

    /// Read-modify-write one file without losing a concurrent update: the mode serializes or
    /// compare-and-sets, retrying `update` as needed. `update` runs on the caller's task: keep
    /// it cheap (an [`edit`](FilesystemExt::edit) does its work beforehand, off the async
    /// workers, and only compares and hands over the result in `update`). The built-in modes
    /// refuse a current file over [`MAX_TEXT_BYTES`](crate::MAX_TEXT_BYTES) with
    /// [`Error::LimitExceeded`] (sandbox mode: by the size it finds first).
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
    /// [`Error::InvalidInput`] (read them with [`Filesystem::read`]); files over
    /// [`MAX_TEXT_BYTES`] are [`Error::LimitExceeded`]. The text is scanned off the async
    /// workers; dropping the future stops the scan.
    async fn read_text(&self, path: &str, options: ReadOptions) -> Result<TextWindow> {
        let data = self.read_max(path, MAX_TEXT_BYTES).await?;
        let path = path.to_owned();
        off_worker("read_text", move |cancel| {
            text::window(&path, &data, options, cancel)
        })
        .await
    }

    /// Replace `old` with `new` in a text file; see [`EditRequest`]. Keeps the file's line
    /// endings: with a CRLF file, `\n` in `old` and `new` stand for `\r\n`.
    ///
    /// Linear in the file: the edit is worked out off the async workers on the bytes read
    /// (dropping the future stops it), then handed to [`Filesystem::update`], which only
    /// checks that the file is still those bytes. A file changed meanwhile is edited again:
    /// in `update` itself when it is at most 64 KiB, else from a new read, up to 16 times.
    /// Files over [`MAX_TEXT_BYTES`], and edits whose result would be larger, are
    /// [`Error::LimitExceeded`].
    async fn edit(&self, path: &str, request: EditRequest) -> Result<EditOutcome> {
        for _ in 0..EDIT_ATTEMPTS {
            let read = match self.read_max(path, MAX_TEXT_BYTES).await {
                Err(e) if e.kind() == sandbox_core::ErrorKind::NotFound => {
                    return Err(Error::NotFound {
                        what: "file",
                        key: path.to_owned(),
                    });
                }
                other => other?,
            };
            let (input, owned_path, owned_request) =
                (read.clone(), path.to_owned(), request.clone());
            let (new, outcome) = off_worker("edit", move |cancel| {
                text::apply_edit(&owned_path, &input, &owned_request, cancel)
            })
            .await?;
            let mut changed = false;
            let mut redone = None;
            let mut step = |current: Option<Bytes>| -> Result<Bytes> {
                changed = false;
                match current {
                    Some(current) if current == read => Ok(new.clone()),
                    // Changed meanwhile, and small: edited right here (bounded work), so
                    // writers contending on a small file never starve.
                    Some(current) if current.len() <= INLINE_BYTES => {
                        let (new, outcome) =
                            text::apply_edit(path, &current, &request, &work::Cancel::new())?;
                        redone = Some(outcome);
                        Ok(new)
                    }
                    Some(_) => {
                        changed = true;
                        Err(Error::Conflict {
                            key: path.to_owned(),
                            reason: "the file changed while the edit was worked out".to_owned(),
                        })
                    }
                    None => Err(Error::NotFound {
                        what: "file",
                        key: path.to_owned(),
                    }),
                }
            };
            match self.update(path, &mut step).await {
                Ok(_) => return Ok(redone.unwrap_or(outcome)),
                Err(_) if changed => continue,
                Err(e) => return Err(e),
            }
        }
        Err(Error::Conflict {
            key: path.to_owned(),
            reason: format!(
                "the file changed between reading and writing {EDIT_ATTEMPTS} times in a row; try again when it is not being written"
            ),
        })
    }

    /// Files matching a gitignore-style `pattern` under `options.base`: a pattern without a
    /// `/` matches a name at any depth (`*.md`), one with a `/` is anchored at the base
    /// (`src/**/*.rs`), `dir/` matches everything under `dir`. The paths are matched off the
    /// async workers, stopping at `max_results` (dropping the future stops it).
    async fn glob(&self, pattern: &str, options: GlobOptions) -> Result<GlobResult> {
        let matcher = text::GlobMatcher::new(pattern)?;
        let base = options.base.trim_end_matches('/').to_owned();
        let walked = self.walk(&base).await?;
        off_worker("glob", move |cancel| {
            let mut files = Vec::new();
            let mut truncated = false;
            for (n, info) in walked.into_iter().enumerate() {
                if n.is_multiple_of(1024) {
                    cancel.check()?;
                }
                let rel = text::relative_to(&base, &info.path);
                if matcher.is_match(rel) {
                    if files.len() == options.max_results {
                        truncated = true;
                        break;
                    }
                    files.push(info);
                }
            }
            Ok(GlobResult { files, truncated })
        })
        .await
    }

    /// Lines matching a pattern; see [`GrepOptions`]. Binary and oversized files (over
    /// `max_file_bytes`, at most [`MAX_TEXT_BYTES`]) are skipped and counted. Each file is
    /// searched in one pass over its lines; files over 64 KiB are searched off the async
    /// workers, where the time bound and a dropped future stop the search inside the file.
    async fn grep(&self, options: GrepOptions) -> Result<GrepResult> {
        let deadline = Instant::now() + options.timeout;
        let compile = options.clone();
        let pattern = off_worker("grep", move |_| text::grep_regex(&compile)).await?;
        let include = options
            .include
            .as_deref()
            .map(text::GlobMatcher::new)
            .transpose()?;
        let max_file_bytes = options.max_file_bytes.min(MAX_TEXT_BYTES);
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
            if info.kind != FileKind::File || info.size > max_file_bytes {
                result.files_skipped += 1;
                continue;
            }
            let read = self.read_max(&info.path, max_file_bytes);
            let data = match tokio::time::timeout_at(deadline.into(), read).await {
                Ok(Ok(data)) => data,
                // A file removed between walk and read is not an error of the search; one
                // that grew past the limit is skipped like one that was that large.
                Ok(Err(e)) if e.kind() == sandbox_core::ErrorKind::NotFound => continue,
                Ok(Err(e)) if e.kind() == sandbox_core::ErrorKind::LimitExceeded => {
                    result.files_skipped += 1;
                    continue;
                }
                Ok(Err(e)) => return Err(e),
                Err(_) => {
                    result.timed_out = true;
                    break;
                }
            };
            if text::searchable(&data).is_none() {
                result.files_skipped += 1;
                continue;
            }
            result.files_searched += 1;
            let room = options.max_results - result.matches.len().min(options.max_results);
            let found = if data.len() <= INLINE_BYTES {
                let text = text::searchable(&data).expect("checked above");
                text::grep_text(
                    &pattern,
                    &info.path,
                    text,
                    room,
                    deadline,
                    &work::Cancel::new(),
                )?
            } else {
                let (pattern, path) = (pattern.clone(), info.path.clone());
                off_worker("grep", move |cancel| {
                    let text = text::searchable(&data).expect("checked above");
                    text::grep_text(&pattern, &path, text, room, deadline, cancel)
                })
                .await?
            };
            if text::grep_merge(&mut result, found) {
                break;
            }
            if Instant::now() >= deadline {
                result.timed_out = true;
                break;
            }
        }
        Ok(result)
    }

    /// The entries of the directory `path`, sorted by name, at most `max` of them; the
    /// result says how many there are and whether it was cut.
    async fn list_max(&self, path: &str, max: usize) -> Result<ListResult> {
        let mut entries = self.list(path).await?;
        let total = entries.len();
        entries.truncate(max);
        Ok(ListResult {
            truncated: total > entries.len(),
            entries,
            total,
        })
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
