//! Text handling shared by every mode: line windows, exact-string edits, glob matching, grep.

use std::fmt::Write as _;

use bytes::Bytes;
use sandbox_core::{Error, Result};

use crate::types::{
    EditOutcome, EditRequest, GrepMatch, GrepOptions, GrepResult, ReadOptions, TextWindow,
};
use crate::work::{
    Cancel, MAX_COUNTED_MATCHES, MAX_EDIT_LINES, MAX_PATTERN_BYTES, MAX_TEXT_BYTES,
    REGEX_DFA_SIZE_LIMIT, REGEX_SIZE_LIMIT, count_newlines,
};

/// Longest line kept in a grep match.
const GREP_LINE_CHARS: usize = 500;

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

/// The number of lines of `text` as [`lines`] counts them, in one pass over its bytes.
fn count_lines(text: &str, cancel: &Cancel) -> Result<usize> {
    let newlines = count_newlines(text.as_bytes(), cancel)?;
    Ok(newlines + usize::from(!text.is_empty() && !text.ends_with('\n')))
}

/// A line-numbered window of `data`. One pass over the text to count its lines, one to the
/// end of the window; a long line is cut after `max_line_chars` without being scanned further.
pub(crate) fn window(
    path: &str,
    data: &[u8],
    options: ReadOptions,
    cancel: &Cancel,
) -> Result<TextWindow> {
    let text = as_text(path, data)?;
    let total = count_lines(text, cancel)?;
    let mut out = String::new();
    let mut shown = 0;
    let mut cut_line = false;
    let mut cut_bytes = false;
    let skipped = lines(text).skip(options.offset.min(total));
    for (i, line) in (options.offset..).zip(skipped) {
        if shown == options.limit {
            break;
        }
        cancel.check()?;
        let original = line;
        let mut line = line;
        if let Some((end, _)) = line.char_indices().nth(options.max_line_chars) {
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

/// Whether `text` uses CRLF line endings: it has a `\r\n` and every `\n` follows a `\r`.
fn is_crlf(text: &str, cancel: &Cancel) -> Result<bool> {
    let bytes = text.as_bytes();
    let mut any = false;
    for (n, (at, _)) in text.match_indices('\n').enumerate() {
        if n.is_multiple_of(65_536) {
            cancel.check()?;
        }
        if at == 0 || bytes[at - 1] != b'\r' {
            return Ok(false);
        }
        any = true;
    }
    Ok(any)
}

/// Where `old` occurs in `text`, found left to right without overlaps (as `str::replace`
/// replaces).
#[derive(Debug, Default)]
struct Occurrences {
    /// Occurrences counted (all of them, or up to the cap the scan stopped at).
    count: usize,
    /// The scan stopped at its cap: there may be more.
    capped: bool,
    /// Byte offset of the first occurrence.
    first: Option<usize>,
    /// 1-based lines of the first [`MAX_EDIT_LINES`] occurrences.
    lines: Vec<usize>,
}

/// Count the occurrences of `old` in `text`, up to `cap`. Line numbers are counted on the way
/// (the newlines between one occurrence and the next), so the whole scan is one pass.
fn occurrences(text: &str, old: &str, cap: usize, cancel: &Cancel) -> Result<Occurrences> {
    let bytes = text.as_bytes();
    let mut found = Occurrences::default();
    let (mut line, mut counted_to) = (1, 0);
    for (at, _) in text.match_indices(old) {
        if found.count == cap {
            found.capped = true;
            break;
        }
        if found.count.is_multiple_of(4096) {
            cancel.check()?;
        }
        found.first.get_or_insert(at);
        found.count += 1;
        if found.lines.len() < MAX_EDIT_LINES {
            line += count_newlines(&bytes[counted_to..at], cancel)?;
            counted_to = at;
            found.lines.push(line);
        }
    }
    Ok(found)
}

/// `text` with every occurrence of `old` replaced by `new`, built in one pass into a buffer of
/// the final size.
fn replace_all(text: &str, old: &str, new: &str, size: usize, cancel: &Cancel) -> Result<String> {
    let mut out = String::with_capacity(size);
    let mut last = 0;
    for (n, (at, _)) in text.match_indices(old).enumerate() {
        if n.is_multiple_of(4096) {
            cancel.check()?;
        }
        out.push_str(&text[last..at]);
        out.push_str(new);
        last = at + old.len();
    }
    out.push_str(&text[last..]);
    Ok(out)
}

/// `line 4` or `lines 4, 10, 22`: distinct line numbers, at most 20 of them, for a message.
fn shown_lines(lines: &[usize]) -> String {
    let mut shown: Vec<usize> = Vec::new();
    for &l in lines {
        if shown.last() != Some(&l) {
            shown.push(l);
        }
        if shown.len() == 20 {
            break;
        }
    }
    let mut text = shown
        .iter()
        .map(ToString::to_string)
        .collect::<Vec<_>>()
        .join(", ");
    if shown.len() == 20 {
        text.push_str(", …");
    }
    let noun = if shown.len() == 1 { "line" } else { "lines" };
    format!("{noun} {text}")
}

/// Apply an exact-string edit, returning the new bytes. Linear in the file: a CRLF check,
/// at most two searches (the second only when a CRLF-adjusted `old_string` was not found), and,
/// when it applies, one pass that builds the result. A non-unique `old_string` is counted only
/// up to [`MAX_COUNTED_MATCHES`]; a result over [`MAX_TEXT_BYTES`] is refused before it is
/// built.
pub(crate) fn apply_edit(
    path: &str,
    data: &[u8],
    request: &EditRequest,
    cancel: &Cancel,
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
    let crlf = is_crlf(text, cancel)?;
    let (mut old, mut new) = (request.old.clone(), request.new.clone());
    if crlf && !old.contains("\r\n") {
        old = old.replace('\n', "\r\n");
        if !new.contains("\r\n") {
            new = new.replace('\n', "\r\n");
        }
    }
    let cap = if request.replace_all {
        usize::MAX
    } else {
        MAX_COUNTED_MATCHES
    };
    let mut found = occurrences(text, &old, cap, cancel)?;
    if found.count == 0 && old != request.old {
        // The model may have copied the CRLF text exactly.
        old = request.old.clone();
        new = request.new.clone();
        found = occurrences(text, &old, cap, cancel)?;
    }
    let Some(first) = found.first else {
        return Err(Error::NotFound {
            what: "old_string in file",
            key: format!(
                "`{path}` does not contain old_string (0 matches); read the file and copy the text exactly, including whitespace and indentation"
            ),
        });
    };
    match found.count {
        1 => {}
        n if !request.replace_all => {
            let times = if found.capped {
                format!("more than {n} times")
            } else {
                format!("{n} times")
            };
            return Err(Error::Conflict {
                key: path.to_owned(),
                reason: format!(
                    "old_string occurs {times} ({}); add surrounding lines to make it unique, or set replace_all to replace every occurrence",
                    shown_lines(&found.lines)
                ),
            });
        }
        _ => {}
    }
    let size =
        (text.len() - found.count * old.len()) as u128 + found.count as u128 * new.len() as u128;
    if size > u128::from(MAX_TEXT_BYTES) {
        return Err(Error::LimitExceeded {
            what: "edit result",
            limit: MAX_TEXT_BYTES,
            reason: format!(
                "replacing {} occurrences would make `{path}` {size} bytes, more than the {MAX_TEXT_BYTES} bytes the file tools handle; replace fewer occurrences",
                found.count
            ),
        });
    }
    let size = size as usize;
    let replaced = if found.count == 1 {
        let mut out = String::with_capacity(size);
        out.push_str(&text[..first]);
        out.push_str(&new);
        out.push_str(&text[first + old.len()..]);
        out
    } else {
        replace_all(text, &old, &new, size, cancel)?
    };
    Ok((
        Bytes::from(replaced),
        EditOutcome {
            path: path.to_owned(),
            replacements: found.count,
            lines: found.lines,
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

/// A compiled grep pattern.
#[derive(Debug, Clone)]
pub(crate) struct GrepPattern {
    regex: regex::Regex,
    /// The longest match in bytes, where the pattern bounds it.
    max_len: Option<usize>,
}

/// Lines longer than this are searched window by window (when the pattern's matches have a
/// bounded length), so the flag and the deadline are looked at inside a long line too.
const LINE_WINDOW: usize = 64 << 10;

impl GrepPattern {
    /// Whether `line` holds a match; `None` when the deadline passed first. A line longer
    /// than [`LINE_WINDOW`] with a pattern whose matches are at most `max_len` bytes (below
    /// the window) is searched in windows overlapping by more than `max_len`, each within the
    /// whole line (so anchors and word boundaries see their real neighbours): a match found
    /// that ends before its window's cut is a match of the line, and every match of the line
    /// lies whole inside the window its start falls in.
    fn line_matches(
        &self,
        line: &str,
        deadline: std::time::Instant,
        cancel: &Cancel,
    ) -> Result<Option<bool>> {
        let Some(max_len) = self
            .max_len
            .filter(|&l| l < LINE_WINDOW && line.len() > LINE_WINDOW)
        else {
            return Ok(Some(self.regex.is_match(line)));
        };
        let overlap = max_len + 4;
        let mut start = 0;
        while start < line.len() {
            cancel.check()?;
            if start > 0 && std::time::Instant::now() >= deadline {
                return Ok(None);
            }
            let mut cut = (start + LINE_WINDOW + overlap).min(line.len());
            while !line.is_char_boundary(cut) {
                cut += 1;
            }
            if let Some(m) = self.regex.find_at(&line[..cut], start)
                && (m.end() < cut || cut == line.len())
            {
                return Ok(Some(true));
            }
            start += LINE_WINDOW;
            while start < line.len() && !line.is_char_boundary(start) {
                start += 1;
            }
        }
        Ok(Some(false))
    }
}

/// The compiled grep pattern: at most [`MAX_PATTERN_BYTES`] long, compiled within
/// [`REGEX_SIZE_LIMIT`] (and a lazy DFA within [`REGEX_DFA_SIZE_LIMIT`]), so matching is linear
/// in the text with a bounded factor (the regex crate's guarantee).
pub(crate) fn grep_regex(options: &GrepOptions) -> Result<GrepPattern> {
    if options.pattern.is_empty() {
        return Err(Error::invalid("grep pattern", "empty pattern"));
    }
    if options.pattern.len() > MAX_PATTERN_BYTES {
        return Err(Error::LimitExceeded {
            what: "grep pattern",
            limit: MAX_PATTERN_BYTES as u64,
            reason: format!(
                "the pattern has {} bytes, more than {MAX_PATTERN_BYTES}; search for a shorter, distinctive part",
                options.pattern.len()
            ),
        });
    }
    let source = if options.literal {
        regex::escape(&options.pattern)
    } else {
        options.pattern.clone()
    };
    let regex = regex::RegexBuilder::new(&source)
        .case_insensitive(options.case_insensitive)
        .size_limit(REGEX_SIZE_LIMIT)
        .dfa_size_limit(REGEX_DFA_SIZE_LIMIT)
        .build()
        .map_err(|e| match e {
            regex::Error::CompiledTooBig(limit) => Error::LimitExceeded {
                what: "grep pattern",
                limit: limit as u64,
                reason: "the compiled pattern would be larger than the limit (counted repetitions like `{1000}` and case-insensitive Unicode classes grow it); simplify it or set literal=true".to_owned(),
            },
            e => Error::invalid(
                "grep pattern",
                format!(
                    "`{}` is not a valid regular expression ({}); escape special characters or set literal=true",
                    options.pattern,
                    first_line(&e.to_string())
                ),
            ),
        })?;
    // The regex compiled, so the same syntax parses.
    let max_len = regex_syntax::ParserBuilder::new()
        .case_insensitive(options.case_insensitive)
        .build()
        .parse(&source)
        .ok()
        .and_then(|hir| hir.properties().maximum_len());
    Ok(GrepPattern { regex, max_len })
}

fn first_line(s: &str) -> String {
    s.lines().last().unwrap_or(s).trim().to_owned()
}

/// The text grep searches in `data`, or `None` for a binary file (a NUL byte in the first
/// 8 KiB, or not UTF-8).
pub(crate) fn searchable(data: &[u8]) -> Option<&str> {
    if data[..data.len().min(8192)].contains(&0) {
        return None;
    }
    std::str::from_utf8(data).ok()
}

/// Why a search of one text stopped before its end.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum GrepStop {
    /// A match past the result cap was found.
    Cap,
    /// The search's time bound ran out.
    Deadline,
}

/// The matching lines of `text` (at most `room`), and why the search stopped early, if it
/// did. One pass over the lines; the flag and the deadline are looked at every 256 lines.
pub(crate) fn grep_text(
    pattern: &GrepPattern,
    path: &str,
    text: &str,
    room: usize,
    deadline: std::time::Instant,
    cancel: &Cancel,
) -> Result<(Vec<GrepMatch>, Option<GrepStop>)> {
    let mut matches = Vec::new();
    for (i, line) in lines(text).enumerate() {
        if i.is_multiple_of(256) {
            cancel.check()?;
            if i > 0 && std::time::Instant::now() >= deadline {
                return Ok((matches, Some(GrepStop::Deadline)));
            }
        }
        let Some(found) = pattern.line_matches(line, deadline, cancel)? else {
            return Ok((matches, Some(GrepStop::Deadline)));
        };
        if found {
            if matches.len() == room {
                return Ok((matches, Some(GrepStop::Cap)));
            }
            let mut shown = String::new();
            for (n, c) in line.chars().enumerate() {
                if n == GREP_LINE_CHARS {
                    let _ = write!(shown, " [line cut]");
                    break;
                }
                shown.push(c);
            }
            matches.push(GrepMatch {
                path: path.to_owned(),
                line_number: i + 1,
                line: shown,
            });
        }
    }
    Ok((matches, None))
}

/// Add `found` to `result`; whether the search is over.
pub(crate) fn grep_merge(
    result: &mut GrepResult,
    found: (Vec<GrepMatch>, Option<GrepStop>),
) -> bool {
    result.matches.extend(found.0);
    match found.1 {
        Some(GrepStop::Cap) => result.truncated = true,
        Some(GrepStop::Deadline) => result.timed_out = true,
        None => return false,
    }
    true
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn window_numbers_and_cuts() {
        let text = (1..=10).map(|i| format!("line {i}\n")).collect::<String>();
        let c = &Cancel::new();
        let w = window(
            "f",
            text.as_bytes(),
            ReadOptions::default().offset(2).limit(3),
            c,
        )
        .unwrap();
        assert_eq!(w.text, "     3\tline 3\n     4\tline 4\n     5\tline 5\n");
        assert_eq!((w.first_line, w.lines, w.total_lines), (3, 3, 10));
        assert!(w.truncated);
        assert!(w.notice.unwrap().contains("offset=5"));
        let w = window(
            "f",
            text.as_bytes(),
            ReadOptions::default().max_bytes(30),
            c,
        )
        .unwrap();
        assert_eq!(w.lines, 2);
        assert!(w.notice.unwrap().contains("cut at 30 bytes"));
        let w = window("f", b"a\r\nb", ReadOptions::default(), c).unwrap();
        assert_eq!(w.text, "     1\ta\n     2\tb\n");
        assert!(!w.truncated);
    }

    #[test]
    fn window_refuses_binary() {
        assert!(window("f", b"\0\x01", ReadOptions::default(), &Cancel::new()).is_err());
        assert!(window("f", b"\xff\xfe", ReadOptions::default(), &Cancel::new()).is_err());
    }

    #[test]
    fn edit_counts_and_keeps_crlf() {
        let c = &Cancel::new();
        let text = b"a\r\nb\r\na\r\n";
        let err = apply_edit("f", text, &EditRequest::new("a", "c"), c).unwrap_err();
        assert!(err.to_string().contains("2 times (lines 1, 3)"), "{err}");
        let (out, e) = apply_edit("f", text, &EditRequest::new("a\nb", "x\ny"), c).unwrap();
        assert_eq!(&out[..], b"x\r\ny\r\na\r\n");
        assert_eq!(e.lines, vec![1]);
        let (out, e) =
            apply_edit("f", text, &EditRequest::new("a", "z").replace_all(true), c).unwrap();
        assert_eq!(&out[..], b"z\r\nb\r\nz\r\n");
        assert_eq!(e.replacements, 2);
        let err = apply_edit("f", text, &EditRequest::new("q", "z"), c).unwrap_err();
        assert!(err.to_string().contains("0 matches"), "{err}");
    }

    #[test]
    fn edits_stop_counting_at_the_cap_and_bound_the_result() {
        let c = &Cancel::new();
        let text = "y".repeat(5000);
        let err = apply_edit("f", text.as_bytes(), &EditRequest::new("y", "z"), c).unwrap_err();
        assert!(
            err.to_string().contains("more than 1000 times (line 1)"),
            "{err}"
        );
        let text = "a\n".repeat(1500);
        let err = apply_edit("f", text.as_bytes(), &EditRequest::new("a", "b"), c).unwrap_err();
        assert!(err.to_string().contains("(lines 1, 2, 3,"), "{err}");
        let (out, e) = apply_edit(
            "f",
            text.as_bytes(),
            &EditRequest::new("a", "b").replace_all(true),
            c,
        )
        .unwrap();
        assert_eq!(out, "b\n".repeat(1500));
        assert_eq!(e.replacements, 1500);
        assert_eq!(e.lines.len(), MAX_EDIT_LINES);
        assert_eq!(e.lines[999], 1000);
        // The result's size is worked out before it is built.
        let big = "y".repeat(1 << 20);
        let err = apply_edit(
            "f",
            big.as_bytes(),
            &EditRequest::new("y", "y".repeat(65)).replace_all(true),
            c,
        )
        .unwrap_err();
        assert_eq!(err.kind(), sandbox_core::ErrorKind::LimitExceeded, "{err}");
    }

    #[test]
    fn long_lines_are_searched_in_windows_exactly() {
        let c = &Cancel::new();
        let far = std::time::Instant::now() + std::time::Duration::from_secs(3600);
        let long = 3 * LINE_WINDOW + 123;
        // A match straddling each window boundary, at the very end, anchored, or nowhere.
        for (at, needle) in [
            (LINE_WINDOW - 2, "abcd"),
            (2 * LINE_WINDOW - 1, "abcd"),
            (long - 4, "abcd"),
            (0, "abcd"),
        ] {
            let mut line = "y".repeat(long);
            line.replace_range(at..at + 4, needle);
            for (pattern, expected) in [
                ("abcd", true),
                (r"\babcd", at == 0),
                ("abcd$", at == long - 4),
                ("^abcd", at == 0),
                ("ab[a-z]d", true),
                ("abce", false),
            ] {
                let p = grep_regex(&GrepOptions::new(pattern)).unwrap();
                assert!(
                    p.max_len.is_some_and(|l| l < 16),
                    "{pattern}: {:?}",
                    p.max_len
                );
                let got = p.line_matches(&line, far, c).unwrap();
                assert_eq!(got, Some(expected), "{pattern} at {at}");
                assert_eq!(p.regex.is_match(&line), expected, "{pattern} at {at}");
            }
        }
        // A spurious `$` at a window's cut is not a match.
        // (The first window's cut is `LINE_WINDOW + 8`: it ends in `zyyy`.)
        let line = format!(
            "{}z{}",
            "y".repeat(LINE_WINDOW + 4),
            "y".repeat(LINE_WINDOW)
        );
        let p = grep_regex(&GrepOptions::new("yz?$")).unwrap();
        assert_eq!(p.line_matches(&line, far, c).unwrap(), Some(true));
        let p = grep_regex(&GrepOptions::new("zy{3}$")).unwrap();
        assert_eq!(p.line_matches(&line, far, c).unwrap(), Some(false));
        // Unbounded patterns search the line in one call.
        assert_eq!(grep_regex(&GrepOptions::new("a.*b")).unwrap().max_len, None);
    }

    #[test]
    fn crlf_needs_every_newline_after_a_return() {
        let c = &Cancel::new();
        assert!(is_crlf("a\r\nb\r\n", c).unwrap());
        assert!(!is_crlf("a\r\nb\n", c).unwrap());
        assert!(!is_crlf("\nb\r\n", c).unwrap());
        assert!(!is_crlf("ab", c).unwrap());
    }

    #[test]
    fn a_raised_flag_stops_the_text_work() {
        let c = Cancel::new();
        let raise = crate::work::tests::raised();
        let text = "y\n".repeat(1 << 20);
        assert!(window("f", text.as_bytes(), ReadOptions::default(), &raise).is_err());
        assert!(
            apply_edit(
                "f",
                text.as_bytes(),
                &EditRequest::new("y", "z").replace_all(true),
                &raise
            )
            .is_err()
        );
        let regex = grep_regex(&GrepOptions::new("y")).unwrap();
        let far = std::time::Instant::now() + std::time::Duration::from_secs(3600);
        assert!(grep_text(&regex, "f", &text, 10, far, &raise).is_err());
        let (found, stop) = grep_text(&regex, "f", &text, 10, far, &c).unwrap();
        assert_eq!((found.len(), stop), (10, Some(GrepStop::Cap)));
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
