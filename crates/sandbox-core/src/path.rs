//! Workspace-relative paths that cannot escape their root.

use std::fmt;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};

/// A normalized, workspace-relative POSIX path.
///
/// Invariants, checked on construction: not empty, not absolute, no `..` component, no NUL byte,
/// no empty or `.` component (so `a//b` and `./a` are normalized to `a/b` and `a`), at most
/// [`RelPath::MAX_LEN`] bytes. A `RelPath` joined onto a root therefore always names something
/// at or under that root, textually. (Whether a symlink on the way leads elsewhere is checked
/// where the path is used.)
#[derive(Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub struct RelPath(String);

impl RelPath {
    /// Longest accepted path, in bytes.
    pub const MAX_LEN: usize = 4096;

    /// Validate and normalize `raw`.
    pub fn new(raw: impl AsRef<str>) -> Result<Self> {
        let raw = raw.as_ref();
        let refuse = |reason: &str| Err(Error::path_escape(raw, reason));
        if raw.contains('\0') {
            return refuse("contains a NUL byte");
        }
        if raw.starts_with('/') {
            return refuse("absolute paths are not allowed here");
        }
        if raw.len() > Self::MAX_LEN {
            return refuse("longer than 4096 bytes");
        }
        let mut parts = Vec::new();
        for part in raw.split('/') {
            match part {
                "" | "." => {}
                ".." => return refuse("`..` components are not allowed"),
                p => parts.push(p),
            }
        }
        if parts.is_empty() {
            return refuse("empty path");
        }
        Ok(RelPath(parts.join("/")))
    }

    /// Build from a host path relative to some root (e.g. a walked directory).
    pub fn from_path(path: &Path) -> Result<Self> {
        match path.to_str() {
            Some(s) => RelPath::new(s),
            None => Err(Error::path_escape(
                path.to_string_lossy(),
                "not valid UTF-8",
            )),
        }
    }

    /// The path as a string, without leading or trailing slash.
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// The components of the path.
    pub fn components(&self) -> impl Iterator<Item = &str> {
        self.0.split('/')
    }

    /// The parent path, or `None` for a top-level name.
    pub fn parent(&self) -> Option<RelPath> {
        self.0.rsplit_once('/').map(|(p, _)| RelPath(p.to_owned()))
    }

    /// The last component.
    pub fn file_name(&self) -> &str {
        self.0.rsplit_once('/').map_or(&self.0, |(_, n)| n)
    }

    /// `self/child`, validating `child`.
    pub fn join(&self, child: impl AsRef<str>) -> Result<RelPath> {
        let child = RelPath::new(child)?;
        Ok(RelPath(format!("{}/{}", self.0, child.0)))
    }

    /// Whether `self` equals `other` or lies under it, compared by components
    /// (so `user10` is not under `user1`).
    pub fn starts_with(&self, other: &RelPath) -> bool {
        self.0 == other.0
            || (self.0.len() > other.0.len()
                && self.0.starts_with(&other.0)
                && self.0.as_bytes()[other.0.len()] == b'/')
    }

    /// Join onto a host directory.
    pub fn to_host(&self, root: &Path) -> PathBuf {
        root.join(&self.0)
    }

    /// Join onto an in-box POSIX root such as `/workspace`.
    pub fn to_box(&self, root: &str) -> String {
        format!("{}/{}", root.trim_end_matches('/'), self.0)
    }
}

impl TryFrom<String> for RelPath {
    type Error = Error;
    fn try_from(value: String) -> Result<Self> {
        RelPath::new(value)
    }
}

impl TryFrom<&str> for RelPath {
    type Error = Error;
    fn try_from(value: &str) -> Result<Self> {
        RelPath::new(value)
    }
}

impl From<RelPath> for String {
    fn from(value: RelPath) -> Self {
        value.0
    }
}

impl AsRef<str> for RelPath {
    fn as_ref(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for RelPath {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl fmt::Debug for RelPath {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:?}", self.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn normalizes() {
        assert_eq!(RelPath::new("a//b/./c/").unwrap().as_str(), "a/b/c");
        assert_eq!(RelPath::new("./x").unwrap().as_str(), "x");
    }

    #[test]
    fn rejects_escapes() {
        for bad in [
            "",
            "/etc/passwd",
            "../x",
            "a/../../b",
            "a/..",
            ".",
            "a\0b",
            "//",
        ] {
            let err = RelPath::new(bad).unwrap_err();
            assert!(
                matches!(err, Error::PathEscape { .. }),
                "{bad:?} gave {err}"
            );
        }
    }

    #[test]
    fn starts_with_is_by_component() {
        let u1 = RelPath::new("ws/user1").unwrap();
        assert!(RelPath::new("ws/user1/a").unwrap().starts_with(&u1));
        assert!(RelPath::new("ws/user1").unwrap().starts_with(&u1));
        assert!(!RelPath::new("ws/user10").unwrap().starts_with(&u1));
    }

    #[test]
    fn serde_validates() {
        assert!(serde_json::from_str::<RelPath>("\"../up\"").is_err());
        let p: RelPath = serde_json::from_str("\"a/b\"").unwrap();
        assert_eq!(serde_json::to_string(&p).unwrap(), "\"a/b\"");
    }
}
