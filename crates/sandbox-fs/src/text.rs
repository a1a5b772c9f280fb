//! Text handling shared by every mode: line windows, exact-string edits, glob matching, grep.

use std::fmt::Write as _;

use bytes::Bytes;
use sandbox_core::{Error, Result};

use crate::types::{
    EditOutcome, EditRequest, GrepMatch, GrepOptions, GrepResult, ReadOptions, TextWindow,
};

/// Longest line kept in a grep match.
const GREP_LINE_CHARS: usize = 500;

/// Whether `data` looks binary: a NUL byte in the first 8 KiB, or not UTF-8.
pub(crate) fn is_binary(data: &[u8]) -> bool {
    data[..data.len().min(8192)].contains(&0) || std::str::from_utf8(data).is_err()
}

fn as_text<'a>(path: &str, data: &'a [u8]) -> Result<&'a str> {
    if data[..data.len().min(8192)].contains(&0) {
        return Err(binary(path, data.len()));
    }
    std::str::from_utf8(data).map_err(|_| binary(path, data.len()))
}

fn binary(path: &str, len: usize) -> Error {
    Error::invalid(
        "file content",
        format!("`{path}` is a binary file ({len} bytes), not UTF-8 text"),
    )
}

/// Lines without their terminators (`\n` or `\r\n`); a final terminator does not start a line.
fn lines(text: &str) -> impl Iterator<Item = &str> {
    text.split_inclusive('\n').map(|l| {
        l.strip_suffix('\n')
            .map_or(l, |l| l.strip_suffix('\r').unwrap_or(l))
    })
}

/// A line-numbered window of `data`.
pub(crate) fn window(path: &str, data: &[u8], options: ReadOptions) -> Result<TextWindow> {
    let text = as_text(path, data)?;
    let total = lines(text).count();
    let mut out = String::new();
    let mut shown = 0;
    let mut cut_line = false;
    let mut cut_bytes = false;
    for (i, line) in lines(text).enumerate().skip(options.offset) {
        if shown == options.limit {
            break;
        }
        let original = line;
        let mut line = line;
        if line.chars().count() > options.max_line_chars {
            let end = line
                .char_indices()
                .nth(options.max_line_chars)
                .map_or(line.len(), |(at, _)| at);
            line = &line[..end];
            cut_line = true;
        }
        let mut entry = format!("{:>6}\t{line}", i + 1);
        if line.len() < original.len() {
            entry.push_str(" [line cut]");
        }
        entry.push('\n');
        if out.len() + entry.len() > options.max_bytes && shown > 0 {
            cut_bytes = true;
            break;
        }
        out.push_str(&entry);
        shown += 1;
    }
    let first_line = if shown > 0 { options.offset + 1 } else { 0 };
    let next = options.offset + shown;
    let mut notice = None;
    if options.offset >= total && total > 0 {
        notice = Some(format!(
            "offset {} is past the end of the file ({total} lines); use an offset below {total}",
            options.offset
        ));
    } else if total == 0 {
        notice = Some("the file is empty".to_owned());
    } else if next < total {
        let why = if cut_bytes {
            format!("cut at {} bytes", options.max_bytes)
        } else {
            format!("limit of {} lines", options.limit)
        };
        notice = Some(format!(
            "showing lines {first_line}-{next} of {total} ({why}); read on with offset={next}"
        ));
    }
    if cut_line {
        let extra = format!(
            "lines longer than {} characters were cut",
            options.max_line_chars
        );
        notice = Some(match notice {
            Some(n) => format!("{n}; {extra}"),
            None => extra,
        });
    }
    Ok(TextWindow {
        path: path.to_owned(),
        text: out,
        first_line,
        lines: shown,
        total_lines: total,
        truncated: next < total || cut_line,
        notice,
    })
}

/// 1-based line numbers at which each byte offset lies.
fn line_numbers(text: &str, offsets: &[usize]) -> Vec<usize> {
    offsets
        .iter()
        .map(|&at| {
            text.as_bytes()[..at]
                .iter()
                .filter(|&&b| b == b'\n')
                .count()
                + 1
        })
        .collect()
}

/// Apply an exact-string edit, returning the new bytes.
pub(crate) fn apply_edit(
    path: &str,
    data: &[u8],
    request: &EditRequest,
) -> Result<(Bytes, EditOutcome)> {
    let text = as_text(path, data)?;
    if request.old.is_empty() {
        return Err(Error::invalid(
            "edit",
            "old_string is empty; give the exact text to replace (use write_file to create or overwrite a whole file)",
        ));
    }
    if request.old == request.new {
        return Err(Error::invalid(
            "edit",
            "old_string and new_string are identical; nothing would change",
        ));
    }
    let crlf = text.contains("\r\n") && !text.replace("\r\n", "").contains('\n');
    let (mut old, mut new) = (request.old.clone(), request.new.clone());
    if crlf && !old.contains("\r\n") {
        old = old.replace('\n', "\r\n");
        if !new.contains("\r\n") {
            new = new.replace('\n', "\r\n");
        }
    }
    let mut offsets: Vec<usize> = text.match_indices(&old).map(|(i, _)| i).collect();
    if offsets.is_empty() && old != request.old {
        // The model may have copied the CRLF text exactly.
        old = request.old.clone();
        new = request.new.clone();
        offsets = text.match_indices(&old).map(|(i, _)| i).collect();
    }
    let lines = line_numbers(text, &offsets);
    match offsets.len() {
        0 => {
            return Err(Error::NotFound {
                what: "old_string in file",
                key: format!(
                    "`{path}` does not contain old_string (0 matches); read the file and copy the text exactly, including whitespace and indentation"
                ),
            });
        }
        1 => {}
        n if !request.replace_all => {
            let shown: Vec<String> = lines.iter().take(20).map(ToString::to_string).collect();
            return Err(Error::Conflict {
                key: path.to_owned(),
                reason: format!(
                    "old_string occurs {n} times (lines {}); add surrounding lines to make it unique, or set replace_all to replace every occurrence",
                    shown.join(", ")
                ),
            });
        }
        _ => {}
    }
    let replaced = text.replace(&old, &new);
    Ok((
        Bytes::from(replaced),
        EditOutcome {
            path: path.to_owned(),
            replacements: offsets.len(),
            lines,
        },
    ))
}

/// A gitignore-style glob.
#[derive(Debug)]
pub(crate) struct GlobMatcher {
    inner: ignore::gitignore::Gitignore,
}

impl GlobMatcher {
    pub(crate) fn new(pattern: &str) -> Result<Self> {
        let pattern = pattern.trim();
        if pattern.is_empty() {
            return Err(Error::invalid(
                "glob pattern",
                "empty pattern; try `**/*` or `*.md`",
            ));
        }
        if pattern.contains('\0') {
            return Err(Error::path_escape(pattern, "contains a NUL byte"));
        }
        if pattern.split('/').any(|c| c == "..") {
            return Err(Error::path_escape(
                pattern,
                "`..` is not allowed in patterns; set the base path instead",
            ));
        }
        if pattern.starts_with('!') {
            return Err(Error::invalid(
                "glob pattern",
                format!("`{pattern}` is a negation; give a pattern of what to match"),
            ));
        }
        let mut builder = ignore::gitignore::GitignoreBuilder::new("");
        builder
            .add_line(None, pattern)
            .map_err(|e| Error::invalid("glob pattern", format!("`{pattern}`: {e}")))?;
        let inner = builder
            .build()
            .map_err(|e| Error::invalid("glob pattern", format!("`{pattern}`: {e}")))?;
        Ok(GlobMatcher { inner })
    }

    /// Whether the relative file path `rel` (or a directory above it) matches.
    pub(crate) fn is_match(&self, rel: &str) -> bool {
        if rel.is_empty() {
            return false;
        }
        self.inner
            .matched_path_or_any_parents(rel, false)
            .is_ignore()
    }
}

/// `path` relative to `base` (both as displayed). A file searched directly is matched by its
/// name.
pub(crate) fn relative_to<'a>(base: &str, path: &'a str) -> &'a str {
    let base = base.trim_end_matches('/');
    if base.is_empty() || base == "." {
        return path;
    }
    match path.strip_prefix(base) {
        Some(rest) if rest.starts_with('/') => &rest[1..],
        Some("") => path.rsplit('/').next().unwrap_or(path),
        _ => path,
    }
}

pub(crate) fn grep_regex(options: &GrepOptions) -> Result<regex::Regex> {
    if options.pattern.is_empty() {
        return Err(Error::invalid("grep pattern", "empty pattern"));
    }
    let source = if options.literal {
        regex::escape(&options.pattern)
    } else {
        options.pattern.clone()
    };
    regex::RegexBuilder::new(&source)
        .case_insensitive(options.case_insensitive)
        .size_limit(1 << 20)
        .build()
        .map_err(|e| {
            Error::invalid(
                "grep pattern",
                format!(
                    "`{}` is not a valid regular expression ({}); escape special characters or set literal=true",
                    options.pattern,
                    first_line(&e.to_string())
                ),
            )
        })
}

fn first_line(s: &str) -> String {
    s.lines().last().unwrap_or(s).trim().to_owned()
}

/// Add the matches of `data` to `result`. Returns `true` when the cap was hit.
pub(crate) fn grep_into(
    regex: &regex::Regex,
    path: &str,
    data: &[u8],
    cap: usize,
    result: &mut GrepResult,
) -> bool {
    let Ok(text) = std::str::from_utf8(data) else {
        return false;
    };
    for (i, line) in lines(text).enumerate() {
        if regex.is_match(line) {
            if result.matches.len() == cap {
                return true;
            }
            let mut shown = String::new();
            for (n, c) in line.chars().enumerate() {
                if n == GREP_LINE_CHARS {
                    let _ = write!(shown, " [line cut]");
                    break;
                }
                shown.push(c);
            }
            result.matches.push(GrepMatch {
                path: path.to_owned(),
                line_number: i + 1,
                line: shown,
            });
        }
    }
    false
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn window_numbers_and_cuts() {
        let text = (1..=10).map(|i| format!("line {i}\n")).collect::<String>();
        let w = window(
            "f",
            text.as_bytes(),
            ReadOptions::default().offset(2).limit(3),
        )
        .unwrap();
        assert_eq!(w.text, "     3\tline 3\n     4\tline 4\n     5\tline 5\n");
        assert_eq!((w.first_line, w.lines, w.total_lines), (3, 3, 10));
        assert!(w.truncated);
        assert!(w.notice.unwrap().contains("offset=5"));
        let w = window("f", text.as_bytes(), ReadOptions::default().max_bytes(30)).unwrap();
        assert_eq!(w.lines, 2);
        assert!(w.notice.unwrap().contains("cut at 30 bytes"));
        let w = window("f", b"a\r\nb", ReadOptions::default()).unwrap();
        assert_eq!(w.text, "     1\ta\n     2\tb\n");
        assert!(!w.truncated);
    }

    #[test]
    fn window_refuses_binary() {
        assert!(window("f", b"\0\x01", ReadOptions::default()).is_err());
        assert!(window("f", b"\xff\xfe", ReadOptions::default()).is_err());
    }

    #[test]
    fn edit_counts_and_keeps_crlf() {
        let text = b"a\r\nb\r\na\r\n";
        let err = apply_edit("f", text, &EditRequest::new("a", "c")).unwrap_err();
        assert!(err.to_string().contains("2 times (lines 1, 3)"), "{err}");
        let (out, e) = apply_edit("f", text, &EditRequest::new("a\nb", "x\ny")).unwrap();
        assert_eq!(&out[..], b"x\r\ny\r\na\r\n");
        assert_eq!(e.lines, vec![1]);
        let (out, e) =
            apply_edit("f", text, &EditRequest::new("a", "z").replace_all(true)).unwrap();
        assert_eq!(&out[..], b"z\r\nb\r\nz\r\n");
        assert_eq!(e.replacements, 2);
        let err = apply_edit("f", text, &EditRequest::new("q", "z")).unwrap_err();
        assert!(err.to_string().contains("0 matches"), "{err}");
    }

    #[test]
    fn globs_are_gitignore_style() {
        let g = GlobMatcher::new("*.md").unwrap();
        assert!(g.is_match("a.md") && g.is_match("x/y/a.md") && !g.is_match("a.rs"));
        let g = GlobMatcher::new("src/**/*.rs").unwrap();
        assert!(g.is_match("src/a.rs") && g.is_match("src/x/a.rs") && !g.is_match("b/src/a.rs"));
        let g = GlobMatcher::new("src/*.rs").unwrap();
        assert!(g.is_match("src/a.rs") && !g.is_match("src/x/a.rs"));
        let g = GlobMatcher::new("docs/").unwrap();
        assert!(g.is_match("docs/a/b.txt") && !g.is_match("docs.txt"));
        assert!(GlobMatcher::new("../x").is_err());
    }

    #[test]
    fn relative_paths() {
        assert_eq!(relative_to("", "a/b"), "a/b");
        assert_eq!(relative_to("a", "a/b"), "b");
        assert_eq!(relative_to("a/b", "a/b"), "b");
    }
}
