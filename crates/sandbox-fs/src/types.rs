//! Values the [`Filesystem`](crate::Filesystem) operations take and return.

use std::time::{Duration, SystemTime};

use serde::Serialize;

/// Kind of a directory entry.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum FileKind {
    /// Regular file.
    File,
    /// Directory.
    Dir,
    /// Symbolic link (reported by `list`; reads follow it after the resolved-path check).
    Symlink,
    /// Anything else (fifo, socket, device).
    Other,
}

impl FileKind {
    /// `file`, `dir`, `symlink` or `other`.
    pub fn as_str(self) -> &'static str {
        match self {
            FileKind::File => "file",
            FileKind::Dir => "dir",
            FileKind::Symlink => "symlink",
            FileKind::Other => "other",
        }
    }
}

/// One entry of `list`, `glob` or `stat`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[non_exhaustive]
pub struct FileInfo {
    /// The path as the caller should pass it back: workspace-relative for paths in the
    /// workspace view, absolute for paths reached through an absolute root.
    pub path: String,
    /// Kind.
    pub kind: FileKind,
    /// Size in bytes (files), 0 otherwise.
    pub size: u64,
    /// Modification time, where the mode knows it (the shared store does not).
    #[serde(skip)]
    pub modified: Option<SystemTime>,
}

impl FileInfo {
    /// An entry with no modification time.
    pub fn new(path: impl Into<String>, kind: FileKind, size: u64) -> Self {
        FileInfo {
            path: path.into(),
            kind,
            size,
            modified: None,
        }
    }

    /// Set the modification time.
    pub fn modified(mut self, at: Option<SystemTime>) -> Self {
        self.modified = at;
        self
    }

    /// The last path component.
    pub fn name(&self) -> &str {
        self.path.rsplit('/').next().unwrap_or(&self.path)
    }
}

/// A directory listing cut to a most number of entries (`list_max`).
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct ListResult {
    /// The first entries, sorted by name.
    pub entries: Vec<FileInfo>,
    /// Entries in the directory.
    pub total: usize,
    /// More entries exist than `entries` holds.
    pub truncated: bool,
}

/// What a write did.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[non_exhaustive]
pub struct WriteOutcome {
    /// The path written, as given back to the caller.
    pub path: String,
    /// The file did not exist before (in any layer the caller can see).
    pub created: bool,
    /// Bytes written.
    pub bytes: u64,
}

/// Line-window read options.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct ReadOptions {
    /// Lines to skip from the start of the file. Default 0.
    pub offset: usize,
    /// Most lines returned. Default 2000.
    pub limit: usize,
    /// Most bytes of text returned (line numbers included); the window is cut at a line
    /// boundary before this and a notice says where to continue. Default 100,000.
    pub max_bytes: usize,
    /// Longer lines are cut to this many characters, with a marker. Default 2000.
    pub max_line_chars: usize,
}

impl Default for ReadOptions {
    fn default() -> Self {
        ReadOptions {
            offset: 0,
            limit: 2000,
            max_bytes: 100_000,
            max_line_chars: 2000,
        }
    }
}

impl ReadOptions {
    /// Set the offset (lines skipped).
    pub fn offset(mut self, offset: usize) -> Self {
        self.offset = offset;
        self
    }

    /// Set the line limit.
    pub fn limit(mut self, limit: usize) -> Self {
        self.limit = limit;
        self
    }

    /// Set the byte cap.
    pub fn max_bytes(mut self, max_bytes: usize) -> Self {
        self.max_bytes = max_bytes;
        self
    }
}

/// A window of a text file.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct TextWindow {
    /// The path read.
    pub path: String,
    /// The lines, each as `<number>\t<text>` (1-based, right-aligned to 6 columns).
    pub text: String,
    /// 1-based number of the first line shown (0 when nothing is shown).
    pub first_line: usize,
    /// Lines shown.
    pub lines: usize,
    /// Lines in the whole file.
    pub total_lines: usize,
    /// The window stopped before the end of the file (line limit or byte cap) or a long line
    /// was cut.
    pub truncated: bool,
    /// What was cut and how to read on, for the model.
    pub notice: Option<String>,
}

/// An exact-string edit.
#[derive(Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct EditRequest {
    /// Text to find; must occur exactly once unless `replace_all`.
    pub old: String,
    /// Replacement.
    pub new: String,
    /// Replace every occurrence (at least one must exist).
    pub replace_all: bool,
}

impl EditRequest {
    /// Replace the single occurrence of `old` with `new`.
    pub fn new(old: impl Into<String>, new: impl Into<String>) -> Self {
        EditRequest {
            old: old.into(),
            new: new.into(),
            replace_all: false,
        }
    }

    /// Replace every occurrence.
    pub fn replace_all(mut self, yes: bool) -> Self {
        self.replace_all = yes;
        self
    }
}

/// The texts' sizes only: they are file contents (a `.env`, a key file) and a request may be
/// logged.
impl std::fmt::Debug for EditRequest {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EditRequest")
            .field("old_len", &self.old.len())
            .field("new_len", &self.new.len())
            .field("replace_all", &self.replace_all)
            .finish()
    }
}

/// What an edit did.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct EditOutcome {
    /// The path edited.
    pub path: String,
    /// Occurrences replaced.
    pub replacements: usize,
    /// 1-based lines where the replacements start (in the original text): the first
    /// [`MAX_EDIT_LINES`](crate::MAX_EDIT_LINES) of them.
    pub lines: Vec<usize>,
}

/// Options of `glob`.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct GlobOptions {
    /// Directory the pattern is matched under (`""` is the workspace view's root).
    pub base: String,
    /// Most paths returned. Default 1000.
    pub max_results: usize,
}

impl Default for GlobOptions {
    fn default() -> Self {
        GlobOptions {
            base: String::new(),
            max_results: 1000,
        }
    }
}

impl GlobOptions {
    /// Set the base directory.
    pub fn base(mut self, base: impl Into<String>) -> Self {
        self.base = base.into();
        self
    }

    /// Set the result cap.
    pub fn max_results(mut self, max: usize) -> Self {
        self.max_results = max;
        self
    }
}

/// Paths matched by `glob`.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct GlobResult {
    /// Matching files, sorted by path.
    pub files: Vec<FileInfo>,
    /// More matched than `max_results`.
    pub truncated: bool,
}

/// What `grep` searches for and how far it goes.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct GrepOptions {
    /// A regular expression (Rust `regex` syntax), or a literal string with `literal`.
    pub pattern: String,
    /// Treat `pattern` as a literal string.
    pub literal: bool,
    /// Match case-insensitively.
    pub case_insensitive: bool,
    /// File or directory searched (`""` is the workspace view's root).
    pub path: String,
    /// Only files matching this gitignore-style glob (e.g. `*.rs`, `src/**/*.md`).
    pub include: Option<String>,
    /// Most matching lines returned. Default 200.
    pub max_results: usize,
    /// Stop searching after this long and return what was found. Default 10 s.
    pub timeout: Duration,
    /// Files larger than this are skipped. Default 10 MiB; at most
    /// [`MAX_TEXT_BYTES`](crate::MAX_TEXT_BYTES) is searched whatever it says.
    pub max_file_bytes: u64,
}

impl GrepOptions {
    /// Search for the regular expression `pattern` everywhere.
    pub fn new(pattern: impl Into<String>) -> Self {
        GrepOptions {
            pattern: pattern.into(),
            literal: false,
            case_insensitive: false,
            path: String::new(),
            include: None,
            max_results: 200,
            timeout: Duration::from_secs(10),
            max_file_bytes: 10 << 20,
        }
    }

    /// Treat the pattern as a literal string.
    pub fn literal(mut self, yes: bool) -> Self {
        self.literal = yes;
        self
    }

    /// Match case-insensitively.
    pub fn case_insensitive(mut self, yes: bool) -> Self {
        self.case_insensitive = yes;
        self
    }

    /// Search under this file or directory.
    pub fn path(mut self, path: impl Into<String>) -> Self {
        self.path = path.into();
        self
    }

    /// Only search files matching this glob.
    pub fn include(mut self, glob: impl Into<String>) -> Self {
        self.include = Some(glob.into());
        self
    }

    /// Set the result cap.
    pub fn max_results(mut self, max: usize) -> Self {
        self.max_results = max;
        self
    }

    /// Set the time bound.
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }
}

/// One matching line.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[non_exhaustive]
pub struct GrepMatch {
    /// The file.
    pub path: String,
    /// 1-based line number.
    pub line_number: usize,
    /// The line (cut to 500 characters).
    pub line: String,
}

/// What `grep` found.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
#[non_exhaustive]
pub struct GrepResult {
    /// Matches, in path order then line order.
    pub matches: Vec<GrepMatch>,
    /// Files whose content was searched.
    pub files_searched: usize,
    /// Files skipped as binary or too large.
    pub files_skipped: usize,
    /// More matches existed than `max_results`.
    pub truncated: bool,
    /// The time bound ran out before every file was searched.
    pub timed_out: bool,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn edit_request_debug_hides_the_texts() {
        let shown = format!("{:?}", EditRequest::new("API_KEY=s3cret", "API_KEY=other"));
        assert!(
            !shown.contains("s3cret") && !shown.contains("API_KEY"),
            "{shown}"
        );
        assert!(shown.contains("old_len: 14"), "{shown}");
    }
}
