//! Request paths to locations beneath the base directory.
//!
//! Textual rules only: `.` and empty components vanish, `..` removes the previous component
//! and may not climb above the base directory. Symlinks are dealt with later, by the kernel,
//! when the result is opened beneath the base-directory handle ([`sandbox_core::beneath`]).

use std::path::{Component, Path};

use sandbox_core::RelPath;

/// Where a request path leads, relative to the base directory.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Target {
    /// The base directory itself.
    Root,
    /// Something beneath it.
    Rel(RelPath),
}

impl Target {
    /// The path as shown in listings: `/` for the root, `/a/b` beneath it.
    pub fn shown(&self) -> String {
        match self {
            Target::Root => "/".to_owned(),
            Target::Rel(rel) => format!("/{rel}"),
        }
    }
}

/// How an absolute request path is read.
#[derive(Debug, Clone, Copy)]
pub enum Absolute<'a> {
    /// As relative to the base directory (`/etc/x` is `<base>/etc/x`): sandboxd's REST API
    /// and process `cwd` join the request path onto the root.
    Rebase,
    /// As a host path that must lie at or under `base` (the legacy python runtime joins
    /// with `os.path.join`, where an absolute path replaces the base, then checks the result).
    WithinBase(&'a Path),
}

/// A request path that would leave the base directory.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("path {path:?} escapes the sandbox root: {reason}")]
pub struct Escape {
    /// The path as requested.
    pub path: String,
    /// Why it was refused.
    pub reason: &'static str,
}

/// Resolve `raw` textually to a [`Target`].
pub fn resolve(raw: &str, absolute: Absolute<'_>) -> Result<Target, Escape> {
    let refuse = |reason| Escape {
        path: raw.to_owned(),
        reason,
    };
    if raw.contains('\0') {
        return Err(refuse("contains a NUL byte"));
    }
    let mut rest = raw;
    let mut stack: Vec<&str> = Vec::new();
    if let (Absolute::WithinBase(base), true) = (absolute, raw.starts_with('/')) {
        // Clean the absolute path as a whole (`..` at `/` stays at `/`), then strip the base.
        let mut abs: Vec<&str> = Vec::new();
        for part in raw.split('/') {
            match part {
                "" | "." => {}
                ".." => {
                    abs.pop();
                }
                p => abs.push(p),
            }
        }
        let base: Vec<&str> = base
            .components()
            .filter_map(|c| match c {
                Component::Normal(s) => s.to_str(),
                _ => None,
            })
            .collect();
        if abs.len() < base.len() || abs[..base.len()] != base[..] {
            return Err(refuse("an absolute path outside the base directory"));
        }
        stack.extend_from_slice(&abs[base.len()..]);
        rest = "";
    }
    for part in rest.split('/') {
        match part {
            "" | "." => {}
            ".." => {
                if stack.pop().is_none() {
                    return Err(refuse("`..` climbs above the base directory"));
                }
            }
            p => stack.push(p),
        }
    }
    if stack.is_empty() {
        return Ok(Target::Root);
    }
    RelPath::new(stack.join("/"))
        .map(Target::Rel)
        .map_err(|_| refuse("not a valid relative path"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rel(s: &str) -> Target {
        Target::Rel(RelPath::new(s).unwrap())
    }

    #[test]
    fn relative_paths_are_cleaned() {
        let r = |s| resolve(s, Absolute::Rebase);
        assert_eq!(r("a/b").unwrap(), rel("a/b"));
        assert_eq!(r("./a//b/").unwrap(), rel("a/b"));
        assert_eq!(r("a/../b").unwrap(), rel("b"));
        assert_eq!(r("").unwrap(), Target::Root);
        assert_eq!(r(".").unwrap(), Target::Root);
        assert!(r("..").is_err());
        assert!(r("a/../../etc").is_err());
        assert!(r("a\0b").is_err());
    }

    #[test]
    fn absolute_paths_rebase_or_must_be_within_the_base() {
        assert_eq!(
            resolve("/etc/passwd", Absolute::Rebase).unwrap(),
            rel("etc/passwd")
        );
        assert!(resolve("/../etc", Absolute::Rebase).is_err());
        let base = Absolute::WithinBase(Path::new("/app"));
        assert_eq!(resolve("/app/x/y", base).unwrap(), rel("x/y"));
        assert_eq!(resolve("/app", base).unwrap(), Target::Root);
        assert_eq!(resolve("/app/../app/z", base).unwrap(), rel("z"));
        assert!(resolve("/etc/passwd", base).is_err());
        assert!(resolve("/application", base).is_err());
        assert!(resolve("/app/../etc", base).is_err());
        assert_eq!(resolve("x/y", base).unwrap(), rel("x/y"));
    }
}
