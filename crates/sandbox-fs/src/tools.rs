//! The agent's tools over a [`Filesystem`]: `read_file`, `write_file`, `edit_file`,
//! `grep_files`, `glob_files`, `list_files` and, where the mode has a shell, `execute`.
//!
//! Each tool has a JSON Schema for its arguments ([`Tools::definitions`]); [`Tools::call`]
//! dispatches by name and always returns a [`ToolOutput`]: text for the model and whether it
//! is an error. Error texts name the wrong argument or the failed condition and say what to do
//! next.

use std::fmt::Write as _;
use std::sync::Arc;
use std::time::Duration;

use sandbox_core::{Error, ExecResult};
use serde::Serialize;
use serde_json::{Map, Value, json};
use tracing::Instrument as _;

use crate::filesystem::{Filesystem, FilesystemExt as _};
use crate::types::{EditRequest, FileKind, GlobOptions, GrepOptions, ReadOptions};
use crate::work::{MAX_LIST_ENTRIES, MAX_PATTERN_BYTES, MAX_TEXT_BYTES};

/// Longest `execute` timeout a model may ask for.
pub const MAX_EXECUTE_TIMEOUT: Duration = Duration::from_secs(3600);

/// One tool as offered to a model.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[non_exhaustive]
pub struct ToolDefinition {
    /// Tool name.
    pub name: &'static str,
    /// What it does and when to use it.
    pub description: &'static str,
    /// JSON Schema of the arguments object.
    pub parameters: Value,
}

/// The result of a tool call, for the model.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[non_exhaustive]
pub struct ToolOutput {
    /// What the model reads.
    pub text: String,
    /// The call failed (bad arguments, missing file, refused path, timeout).
    pub is_error: bool,
}

impl ToolOutput {
    fn ok(text: impl Into<String>) -> Self {
        ToolOutput {
            text: text.into(),
            is_error: false,
        }
    }

    fn error(text: impl Into<String>) -> Self {
        ToolOutput {
            text: text.into(),
            is_error: true,
        }
    }
}

/// The tools over one filesystem.
#[derive(Debug, Clone)]
pub struct Tools {
    fs: Arc<dyn Filesystem>,
}

const FILE_TOOLS: [&str; 6] = [
    "read_file",
    "write_file",
    "edit_file",
    "grep_files",
    "glob_files",
    "list_files",
];

impl Tools {
    /// Tools over `fs`.
    pub fn new(fs: Arc<dyn Filesystem>) -> Self {
        Tools { fs }
    }

    /// The filesystem.
    pub fn filesystem(&self) -> &Arc<dyn Filesystem> {
        &self.fs
    }

    /// Names of the tools offered (`execute` only where there is a shell).
    pub fn names(&self) -> Vec<&'static str> {
        let mut names = FILE_TOOLS.to_vec();
        if self.fs.shell().is_some() {
            names.push("execute");
        }
        names
    }

    /// The tools offered, with their argument schemas.
    pub fn definitions(&self) -> Vec<ToolDefinition> {
        self.names().into_iter().map(definition).collect()
    }

    /// Run the tool `name` with `args` (a JSON object).
    pub async fn call(&self, name: &str, args: Value) -> ToolOutput {
        let span = tracing::info_span!("tool", name, mode = self.fs.mode());
        self.dispatch(name, args).instrument(span).await
    }

    async fn dispatch(&self, name: &str, args: Value) -> ToolOutput {
        let result = match name {
            "read_file" => self.read_file(args).await,
            "write_file" => self.write_file(args).await,
            "edit_file" => self.edit_file(args).await,
            "grep_files" => self.grep_files(args).await,
            "glob_files" => self.glob_files(args).await,
            "list_files" => self.list_files(args).await,
            "execute" if self.fs.shell().is_some() => self.execute(args).await,
            "execute" => Err(format!(
                "execute is not available: the {} mode has no shell. Use the file tools ({}) instead.",
                self.fs.mode(),
                FILE_TOOLS.join(", ")
            )),
            other => Err(format!(
                "unknown tool `{other}`; available tools: {}",
                self.names().join(", ")
            )),
        };
        match result {
            Ok(out) => out,
            Err(text) => {
                tracing::debug!(tool = name, "tool call failed");
                ToolOutput::error(text)
            }
        }
    }

    async fn read_file(&self, args: Value) -> Result<ToolOutput, String> {
        let a = Args::parse("read_file", &args, &["path", "offset", "limit"])?;
        let path = a.string("path")?;
        let mut options = ReadOptions::default();
        if let Some(offset) = a.uint("offset", 0, u32::MAX as u64)? {
            options.offset = offset as usize;
        }
        if let Some(limit) = a.uint("limit", 1, 100_000)? {
            options.limit = limit as usize;
        }
        let w = self
            .fs
            .read_text(&path, options)
            .await
            .map_err(|e| explain("read_file", &e))?;
        let mut text = w.text;
        if let Some(notice) = w.notice {
            let _ = write!(text, "[{notice}]");
        }
        Ok(ToolOutput::ok(text))
    }

    async fn write_file(&self, args: Value) -> Result<ToolOutput, String> {
        let a = Args::parse("write_file", &args, &["path", "content"])?;
        let path = a.string("path")?;
        let content = a.string_allow_empty("content")?;
        if content.len() as u64 > MAX_TEXT_BYTES {
            return Err(explain(
                "write_file",
                &Error::LimitExceeded {
                    what: "file",
                    limit: MAX_TEXT_BYTES,
                    reason: format!(
                        "the content has {} bytes, more than the {MAX_TEXT_BYTES} bytes the file tools handle; write it in parts with a shell command where there is one",
                        content.len()
                    ),
                },
            ));
        }
        let out = self
            .fs
            .write(&path, content.into())
            .await
            .map_err(|e| explain("write_file", &e))?;
        let verb = if out.created { "Created" } else { "Overwrote" };
        Ok(ToolOutput::ok(format!(
            "{verb} `{}` ({} bytes).",
            out.path, out.bytes
        )))
    }

    async fn edit_file(&self, args: Value) -> Result<ToolOutput, String> {
        let a = Args::parse(
            "edit_file",
            &args,
            &["path", "old_string", "new_string", "replace_all"],
        )?;
        let path = a.string("path")?;
        let old = a.string("old_string")?;
        let new = a.string_allow_empty("new_string")?;
        let all = a.bool("replace_all")?.unwrap_or(false);
        let out = self
            .fs
            .edit(&path, EditRequest::new(old, new).replace_all(all))
            .await
            .map_err(|e| explain("edit_file", &e))?;
        let mut lines: Vec<usize> = out.lines.clone();
        lines.dedup();
        let mut shown: Vec<String> = lines.iter().take(20).map(ToString::to_string).collect();
        if lines.len() > 20 || out.lines.len() < out.replacements {
            shown.push("…".to_owned());
        }
        let (noun, line_noun) = match (out.replacements, lines.len()) {
            (1, _) => ("occurrence", "line"),
            (_, 1) => ("occurrences", "line"),
            _ => ("occurrences", "lines"),
        };
        Ok(ToolOutput::ok(format!(
            "Edited `{}`: replaced {} {noun} ({line_noun} {}).",
            out.path,
            out.replacements,
            shown.join(", ")
        )))
    }

    async fn grep_files(&self, args: Value) -> Result<ToolOutput, String> {
        let a = Args::parse(
            "grep_files",
            &args,
            &[
                "pattern",
                "path",
                "include",
                "literal",
                "case_insensitive",
                "max_results",
            ],
        )?;
        let mut options = GrepOptions::new(a.string("pattern")?)
            .path(a.opt_string("path")?.unwrap_or_default())
            .literal(a.bool("literal")?.unwrap_or(false))
            .case_insensitive(a.bool("case_insensitive")?.unwrap_or(false));
        if let Some(include) = a.opt_string("include")? {
            options = options.include(include);
        }
        if let Some(max) = a.uint("max_results", 1, 10_000)? {
            options = options.max_results(max as usize);
        }
        let r = self
            .fs
            .grep(options.clone())
            .await
            .map_err(|e| explain("grep_files", &e))?;
        let mut text = String::new();
        for m in &r.matches {
            let _ = writeln!(text, "{}:{}: {}", m.path, m.line_number, m.line);
        }
        if r.matches.is_empty() {
            let _ = writeln!(
                text,
                "No matches for `{}` ({} files searched).",
                options.pattern, r.files_searched
            );
        }
        if r.truncated {
            let _ = writeln!(
                text,
                "[stopped at {} matches; narrow the pattern, path or include to see the rest]",
                options.max_results
            );
        }
        if r.timed_out {
            let _ = writeln!(
                text,
                "[search stopped after {:?}; results are partial: narrow the path or include]",
                options.timeout
            );
        }
        if r.files_skipped > 0 {
            let _ = writeln!(
                text,
                "[{} binary or oversized files skipped]",
                r.files_skipped
            );
        }
        Ok(ToolOutput::ok(text))
    }

    async fn glob_files(&self, args: Value) -> Result<ToolOutput, String> {
        let a = Args::parse("glob_files", &args, &["pattern", "path", "max_results"])?;
        let pattern = a.string("pattern")?;
        let mut options = GlobOptions::default().base(a.opt_string("path")?.unwrap_or_default());
        if let Some(max) = a.uint("max_results", 1, 100_000)? {
            options = options.max_results(max as usize);
        }
        let r = self
            .fs
            .glob(&pattern, options.clone())
            .await
            .map_err(|e| explain("glob_files", &e))?;
        let mut text = String::new();
        for f in &r.files {
            let _ = writeln!(text, "{}", f.path);
        }
        if r.files.is_empty() {
            let under = if options.base.is_empty() {
                "the workspace"
            } else {
                &options.base
            };
            let _ = writeln!(text, "No files match `{pattern}` under {under}.");
        }
        if r.truncated {
            let _ = writeln!(
                text,
                "[stopped at {} paths; use a narrower pattern or path]",
                options.max_results
            );
        }
        Ok(ToolOutput::ok(text))
    }

    async fn list_files(&self, args: Value) -> Result<ToolOutput, String> {
        let a = Args::parse("list_files", &args, &["path"])?;
        let path = a.opt_string("path")?.unwrap_or_default();
        let listed = self
            .fs
            .list_max(&path, MAX_LIST_ENTRIES)
            .await
            .map_err(|e| explain("list_files", &e))?;
        let entries = &listed.entries;
        let mut text = String::new();
        for e in entries {
            let _ = match e.kind {
                FileKind::Dir => writeln!(text, "{}/", e.name()),
                FileKind::File => writeln!(text, "{}  ({} bytes)", e.name(), e.size),
                other => writeln!(text, "{}  ({})", e.name(), other.as_str()),
            };
        }
        if entries.is_empty() {
            text.push_str("(empty directory)\n");
        }
        if listed.truncated {
            let _ = writeln!(
                text,
                "[showing the first {} of {} entries (by name); use glob_files with a pattern to find the rest]",
                entries.len(),
                listed.total
            );
        }
        Ok(ToolOutput::ok(text))
    }

    async fn execute(&self, args: Value) -> Result<ToolOutput, String> {
        let a = Args::parse("execute", &args, &["command", "timeout_seconds"])?;
        let command = a.string("command")?;
        let timeout = a
            .uint("timeout_seconds", 1, MAX_EXECUTE_TIMEOUT.as_secs())?
            .map(Duration::from_secs);
        let r = self
            .fs
            .execute(&command, timeout)
            .await
            .map_err(|e| explain("execute", &e))?;
        Ok(render_exec(&r))
    }
}

fn render_exec(r: &ExecResult) -> ToolOutput {
    let mut text = String::new();
    match r.exit_code {
        Some(code) => {
            let _ = writeln!(text, "exit code: {code}");
        }
        None if r.timed_out => {
            let _ = writeln!(
                text,
                "timed out after {:.1?}; the command and everything it started were killed",
                r.duration
            );
        }
        None => {
            let _ = writeln!(text, "killed by a signal");
        }
    }
    if !r.stdout.is_empty() || r.stdout_truncated {
        let _ = writeln!(text, "stdout:\n{}", r.stdout_str().trim_end_matches('\n'));
        if r.stdout_truncated {
            let _ = writeln!(
                text,
                "[stdout cut at {} bytes; redirect to a file and read it in parts]",
                r.stdout.len()
            );
        }
    }
    if !r.stderr.is_empty() || r.stderr_truncated {
        let _ = writeln!(text, "stderr:\n{}", r.stderr_str().trim_end_matches('\n'));
        if r.stderr_truncated {
            let _ = writeln!(text, "[stderr cut at {} bytes]", r.stderr.len());
        }
    }
    ToolOutput {
        text,
        is_error: r.timed_out,
    }
}

/// A model-readable explanation of `err`, with what to do next.
fn explain(tool: &str, err: &Error) -> String {
    match err {
        Error::PathEscape { path, reason } => {
            format!("{tool}: path `{path}` is not allowed: {reason}.")
        }
        Error::NotFound {
            what: "old_string in file",
            key,
        } => format!("{tool}: {key}."),
        Error::NotFound { key, .. } => format!(
            "{tool}: `{key}` does not exist. Use list_files or glob_files to find the right path."
        ),
        Error::Conflict { key, reason } => format!("{tool}: `{key}`: {reason}."),
        Error::InvalidInput { reason, .. } => format!("{tool}: {reason}."),
        Error::NotSupported { backend, operation } => {
            format!("{tool}: {operation} is not available in the {backend} mode.")
        }
        Error::Timeout { after, .. } => {
            format!("{tool}: timed out after {after:?}; try a smaller request.")
        }
        Error::LimitExceeded { reason, .. } => format!("{tool}: {reason}."),
        other => format!("{tool} failed: {other}"),
    }
}

fn definition(name: &'static str) -> ToolDefinition {
    let (description, parameters) = match name {
        "read_file" => (
            "Read a text file. Returns numbered lines (`<line>\\t<text>`); long files come in windows: pass offset to read on from where the previous window stopped.",
            json!({
                "type": "object",
                "properties": {
                    "path": {"type": "string", "description": "File path, relative to the workspace (e.g. `src/main.rs`)."},
                    "offset": {"type": "integer", "minimum": 0, "description": "Lines to skip from the start (0 = first line). Default 0."},
                    "limit": {"type": "integer", "minimum": 1, "maximum": 100000, "description": "Most lines to return. Default 2000."}
                },
                "required": ["path"],
                "additionalProperties": false
            }),
        ),
        "write_file" => (
            "Create or overwrite a whole text file (parent directories are created). Prefer edit_file to change part of an existing file.",
            json!({
                "type": "object",
                "properties": {
                    "path": {"type": "string", "description": "File path, relative to the workspace."},
                    "content": {"type": "string", "description": "The complete new content."}
                },
                "required": ["path", "content"],
                "additionalProperties": false
            }),
        ),
        "edit_file" => (
            "Replace an exact piece of text in a file. old_string must occur exactly once (include surrounding lines to make it unique) unless replace_all is true. Line endings of the file are kept.",
            json!({
                "type": "object",
                "properties": {
                    "path": {"type": "string", "description": "File path, relative to the workspace."},
                    "old_string": {"type": "string", "minLength": 1, "description": "The exact text to replace, including whitespace and indentation."},
                    "new_string": {"type": "string", "description": "The replacement text."},
                    "replace_all": {"type": "boolean", "description": "Replace every occurrence. Default false."}
                },
                "required": ["path", "old_string", "new_string"],
                "additionalProperties": false
            }),
        ),
        "grep_files" => (
            "Search file contents for a regular expression (or a literal string). Returns `path:line: text` lines.",
            json!({
                "type": "object",
                "properties": {
                    "pattern": {"type": "string", "minLength": 1, "maxLength": MAX_PATTERN_BYTES, "description": "Regular expression (Rust regex syntax), or literal text with literal=true."},
                    "path": {"type": "string", "description": "File or directory to search. Default: the whole workspace."},
                    "include": {"type": "string", "description": "Only files matching this glob, e.g. `*.rs` or `src/**/*.md`."},
                    "literal": {"type": "boolean", "description": "Treat pattern as plain text. Default false."},
                    "case_insensitive": {"type": "boolean", "description": "Ignore case. Default false."},
                    "max_results": {"type": "integer", "minimum": 1, "maximum": 10000, "description": "Most matching lines returned. Default 200."}
                },
                "required": ["pattern"],
                "additionalProperties": false
            }),
        ),
        "glob_files" => (
            "Find files by gitignore-style pattern: `*.md` matches at any depth, `src/**/*.rs` is anchored at the search path, `docs/` matches everything under docs.",
            json!({
                "type": "object",
                "properties": {
                    "pattern": {"type": "string", "minLength": 1, "description": "The pattern."},
                    "path": {"type": "string", "description": "Directory to search under. Default: the whole workspace."},
                    "max_results": {"type": "integer", "minimum": 1, "maximum": 100000, "description": "Most paths returned. Default 1000."}
                },
                "required": ["pattern"],
                "additionalProperties": false
            }),
        ),
        "list_files" => (
            "List a directory: names, kinds (a trailing `/` marks a directory) and sizes.",
            json!({
                "type": "object",
                "properties": {
                    "path": {"type": "string", "description": "Directory, relative to the workspace. Default: the workspace root."}
                },
                "additionalProperties": false
            }),
        ),
        "execute" => (
            "Run a shell command (`sh -c`). Returns the exit code, stdout and stderr (each capped). On timeout the command and everything it started are killed.",
            json!({
                "type": "object",
                "properties": {
                    "command": {"type": "string", "minLength": 1, "description": "The command line."},
                    "timeout_seconds": {"type": "integer", "minimum": 1, "maximum": MAX_EXECUTE_TIMEOUT.as_secs(), "description": "Kill the command after this many seconds. Default: the mode's timeout."}
                },
                "required": ["command"],
                "additionalProperties": false
            }),
        ),
        other => unreachable!("no tool named {other}"),
    };
    ToolDefinition {
        name,
        description,
        parameters,
    }
}

/// Argument access with model-readable errors.
struct Args<'a> {
    tool: &'static str,
    map: &'a Map<String, Value>,
}

impl<'a> Args<'a> {
    fn parse(tool: &'static str, args: &'a Value, allowed: &[&str]) -> Result<Self, String> {
        let map = match args {
            Value::Object(map) => map,
            other => {
                return Err(format!(
                    "{tool}: arguments must be a JSON object with {}; got {}",
                    allowed.join(", "),
                    kind(other)
                ));
            }
        };
        if let Some(bad) = map.keys().find(|k| !allowed.contains(&k.as_str())) {
            return Err(format!(
                "{tool}: unknown argument `{bad}`; accepted arguments: {}",
                allowed.join(", ")
            ));
        }
        Ok(Args { tool, map })
    }

    fn opt_string(&self, name: &str) -> Result<Option<String>, String> {
        match self.map.get(name) {
            None | Some(Value::Null) => Ok(None),
            Some(Value::String(s)) => Ok(Some(s.clone())),
            Some(other) => Err(format!(
                "{}: argument `{name}` must be a string, got {}",
                self.tool,
                kind(other)
            )),
        }
    }

    fn string_allow_empty(&self, name: &str) -> Result<String, String> {
        self.opt_string(name)?.ok_or_else(|| {
            format!(
                "{}: missing required argument `{name}` (a string)",
                self.tool
            )
        })
    }

    fn string(&self, name: &str) -> Result<String, String> {
        let s = self.string_allow_empty(name)?;
        if s.is_empty() {
            return Err(format!(
                "{}: argument `{name}` must not be empty",
                self.tool
            ));
        }
        Ok(s)
    }

    fn uint(&self, name: &str, min: u64, max: u64) -> Result<Option<u64>, String> {
        let bad = |got: &Value| {
            format!(
                "{}: argument `{name}` must be an integer from {min} to {max}, got {}",
                self.tool,
                kind(got)
            )
        };
        match self.map.get(name) {
            None | Some(Value::Null) => Ok(None),
            Some(v @ Value::Number(n)) => match n.as_u64() {
                Some(x) if (min..=max).contains(&x) => Ok(Some(x)),
                _ => match n.as_f64() {
                    Some(f) if f.fract() == 0.0 && f >= min as f64 && f <= max as f64 => {
                        Ok(Some(f as u64))
                    }
                    _ => Err(bad(v)),
                },
            },
            // Models sometimes quote numbers.
            Some(v @ Value::String(s)) => match s.trim().parse::<u64>() {
                Ok(x) if (min..=max).contains(&x) => Ok(Some(x)),
                _ => Err(bad(v)),
            },
            Some(other) => Err(bad(other)),
        }
    }

    fn bool(&self, name: &str) -> Result<Option<bool>, String> {
        match self.map.get(name) {
            None | Some(Value::Null) => Ok(None),
            Some(Value::Bool(b)) => Ok(Some(*b)),
            Some(Value::String(s)) if s == "true" || s == "false" => Ok(Some(s == "true")),
            Some(other) => Err(format!(
                "{}: argument `{name}` must be true or false, got {}",
                self.tool,
                kind(other)
            )),
        }
    }
}

fn kind(v: &Value) -> String {
    let shown = v.to_string();
    let shown = if shown.len() > 40 {
        format!(
            "{}…",
            &shown[..shown.char_indices().nth(40).map_or(shown.len(), |(i, _)| i)]
        )
    } else {
        shown
    };
    let t = match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    };
    format!("{t} ({shown})")
}
