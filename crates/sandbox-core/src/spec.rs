//! What a box's workspace starts with: [`WorkspaceSpec`] and its entries.

use std::collections::BTreeMap;
use std::fmt;
use std::path::PathBuf;

use bytes::Bytes;
use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};
use crate::path::RelPath;

/// One entry of a [`WorkspaceSpec`], placed at its key (a workspace-relative path).
#[derive(Clone, PartialEq, Eq, Serialize, Deserialize)]
#[non_exhaustive]
pub struct WorkspaceEntry {
    /// What to put there.
    #[serde(flatten)]
    pub kind: EntryKind,
    /// Re-written on every start and left out of snapshots (`true`), or written once on a cold
    /// start and then kept by snapshots (`false`, the default).
    #[serde(default)]
    pub ephemeral: bool,
}

/// The kinds of workspace entry.
#[derive(Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
#[non_exhaustive]
pub enum EntryKind {
    /// A regular file with inline content.
    File {
        /// The file's bytes.
        #[serde(with = "content_serde")]
        content: Bytes,
        /// Unix permission bits; default `0o644`.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        mode: Option<u32>,
    },
    /// An empty directory (parents are created as needed).
    Dir,
    /// A copy of a host file or directory (recursively), read when the entry is applied.
    Copy {
        /// Absolute host path.
        host_path: PathBuf,
    },
    /// A host path mounted into the box. Never copied and never archived in snapshots.
    BindMount {
        /// Absolute host path.
        host_path: PathBuf,
        /// Mount read-only.
        #[serde(default)]
        read_only: bool,
    },
}

impl EntryKind {
    /// Short name of the kind, as used in the JSON `type` field.
    pub fn name(&self) -> &'static str {
        match self {
            EntryKind::File { .. } => "file",
            EntryKind::Dir => "dir",
            EntryKind::Copy { .. } => "copy",
            EntryKind::BindMount { .. } => "bind_mount",
        }
    }
}

impl fmt::Debug for EntryKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            EntryKind::File { content, mode } => f
                .debug_struct("File")
                .field("len", &content.len())
                .field("mode", mode)
                .finish(),
            EntryKind::Dir => f.write_str("Dir"),
            EntryKind::Copy { host_path } => f
                .debug_struct("Copy")
                .field("host_path", host_path)
                .finish(),
            EntryKind::BindMount {
                host_path,
                read_only,
            } => f
                .debug_struct("BindMount")
                .field("host_path", host_path)
                .field("read_only", read_only)
                .finish(),
        }
    }
}

impl fmt::Debug for WorkspaceEntry {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{:?}{}",
            self.kind,
            if self.ephemeral { " (ephemeral)" } else { "" }
        )
    }
}

/// File contents in JSON: UTF-8 text as a string, anything else as `{"base64": "..."}`.
mod content_serde {
    use base64::Engine as _;
    use bytes::Bytes;
    use serde::{Deserialize, Deserializer, Serialize, Serializer};

    #[derive(Serialize, Deserialize)]
    #[serde(untagged)]
    enum Repr {
        Text(String),
        Binary { base64: String },
    }

    pub fn serialize<S: Serializer>(content: &Bytes, s: S) -> Result<S::Ok, S::Error> {
        match std::str::from_utf8(content) {
            Ok(text) => Repr::Text(text.to_owned()).serialize(s),
            Err(_) => Repr::Binary {
                base64: base64::engine::general_purpose::STANDARD.encode(content),
            }
            .serialize(s),
        }
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Bytes, D::Error> {
        match Repr::deserialize(d)? {
            Repr::Text(text) => Ok(Bytes::from(text)),
            Repr::Binary { base64 } => base64::engine::general_purpose::STANDARD
                .decode(base64)
                .map(Bytes::from)
                .map_err(serde::de::Error::custom),
        }
    }
}

/// The initial layout of a workspace.
///
/// Build with [`WorkspaceSpec::builder`]; keys are validated when the spec is built (absolute
/// keys and keys with `..` are refused), and again when a spec is deserialized.
///
/// ```
/// use sandbox_core::WorkspaceSpec;
/// let spec = WorkspaceSpec::builder()
///     .file("README.md", "hello\n")
///     .dir("data")
///     .ephemeral_file("run/token", "t-123")
///     .env("LANG", "C.UTF-8")
///     .build()
///     .unwrap();
/// assert_eq!(spec.entries().len(), 3);
/// assert!(WorkspaceSpec::builder().file("../evil", "x").build().is_err());
/// ```
#[derive(Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(try_from = "Unchecked")]
#[non_exhaustive]
pub struct WorkspaceSpec {
    /// Workspace root inside the box; `None` uses the backend's default (`/workspace` in
    /// containers, the box directory locally).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub root: Option<String>,
    /// Environment applied to every command in the box.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub env: BTreeMap<String, String>,
    /// Entries keyed by workspace-relative path.
    #[serde(default)]
    entries: BTreeMap<RelPath, WorkspaceEntry>,
    /// Extra glob patterns (workspace-relative, `*` within a component, `**` across) left out
    /// of snapshots, e.g. `node_modules/.cache`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub snapshot_excludes: Vec<String>,
}

impl fmt::Debug for WorkspaceSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("WorkspaceSpec")
            .field("root", &self.root)
            .field("env", &self.env.keys().collect::<Vec<_>>())
            .field("entries", &self.entries)
            .field("snapshot_excludes", &self.snapshot_excludes)
            .finish()
    }
}

impl WorkspaceSpec {
    /// Start building a spec.
    pub fn builder() -> WorkspaceSpecBuilder {
        WorkspaceSpecBuilder::default()
    }

    /// All entries, ordered by path (parents before children).
    pub fn entries(&self) -> &BTreeMap<RelPath, WorkspaceEntry> {
        &self.entries
    }

    /// Paths that must never be archived: bind mounts and ephemeral entries.
    pub fn unarchived_paths(&self) -> Vec<RelPath> {
        self.entries
            .iter()
            .filter(|(_, e)| e.ephemeral || matches!(e.kind, EntryKind::BindMount { .. }))
            .map(|(p, _)| p.clone())
            .collect()
    }

    /// Bind-mount entries.
    pub fn bind_mounts(&self) -> impl Iterator<Item = (&RelPath, &PathBuf, bool)> {
        self.entries.iter().filter_map(|(p, e)| match &e.kind {
            EntryKind::BindMount {
                host_path,
                read_only,
            } => Some((p, host_path, *read_only)),
            _ => None,
        })
    }

    /// The paths of the bind-mount entries (kept as they are when a workspace is replaced).
    pub fn bind_mount_paths(&self) -> Vec<RelPath> {
        self.bind_mounts().map(|(p, _, _)| p.clone()).collect()
    }

    /// Check the invariants a deserialized spec must also hold.
    pub fn validate(&self) -> Result<()> {
        if let Some(root) = &self.root
            && (!root.starts_with('/') || root.split('/').any(|c| c == "..") || root.contains('\0'))
        {
            return Err(Error::invalid(
                "workspace root",
                format!("`{root}` must be an absolute path without `..`"),
            ));
        }
        for (path, entry) in &self.entries {
            match &entry.kind {
                EntryKind::Copy { host_path } | EntryKind::BindMount { host_path, .. }
                    if !host_path.is_absolute() =>
                {
                    return Err(Error::invalid(
                        "workspace entry",
                        format!(
                            "`{path}`: host path {} must be absolute",
                            host_path.display()
                        ),
                    ));
                }
                EntryKind::File {
                    mode: Some(mode), ..
                } if *mode > 0o7777 => {
                    return Err(Error::invalid(
                        "workspace entry",
                        format!("`{path}`: mode {mode:o} is not a permission mode"),
                    ));
                }
                _ => {}
            }
            // An entry nested inside a bind mount or a file would be written through it.
            let mut parent = path.parent();
            while let Some(p) = parent {
                if let Some(outer) = self.entries.get(&p)
                    && !matches!(outer.kind, EntryKind::Dir | EntryKind::Copy { .. })
                {
                    return Err(Error::invalid(
                        "workspace entry",
                        format!("`{path}` lies inside the {} entry `{p}`", outer.kind.name()),
                    ));
                }
                parent = p.parent();
            }
        }
        Ok(())
    }
}

/// The same fields, before [`WorkspaceSpec::validate`] has run.
#[derive(Deserialize)]
struct Unchecked {
    #[serde(default)]
    root: Option<String>,
    #[serde(default)]
    env: BTreeMap<String, String>,
    #[serde(default)]
    entries: BTreeMap<RelPath, WorkspaceEntry>,
    #[serde(default)]
    snapshot_excludes: Vec<String>,
}

impl TryFrom<Unchecked> for WorkspaceSpec {
    type Error = Error;
    fn try_from(u: Unchecked) -> Result<Self> {
        let spec = WorkspaceSpec {
            root: u.root,
            env: u.env,
            entries: u.entries,
            snapshot_excludes: u.snapshot_excludes,
        };
        spec.validate()?;
        Ok(spec)
    }
}

/// Builder for [`WorkspaceSpec`]; invalid keys are reported by [`build`](Self::build).
#[derive(Default)]
pub struct WorkspaceSpecBuilder {
    spec: WorkspaceSpec,
    errors: Vec<Error>,
}

impl WorkspaceSpecBuilder {
    /// Workspace root inside the box.
    pub fn root(mut self, root: impl Into<String>) -> Self {
        self.spec.root = Some(root.into());
        self
    }

    /// Environment variable for every command.
    pub fn env(mut self, key: impl Into<String>, value: impl Into<String>) -> Self {
        self.spec.env.insert(key.into(), value.into());
        self
    }

    /// Add an entry of any kind.
    pub fn entry(mut self, path: impl AsRef<str>, kind: EntryKind, ephemeral: bool) -> Self {
        match RelPath::new(path) {
            Ok(path) => {
                self.spec
                    .entries
                    .insert(path, WorkspaceEntry { kind, ephemeral });
            }
            Err(e) => self.errors.push(e),
        }
        self
    }

    /// A file with inline content.
    pub fn file(self, path: impl AsRef<str>, content: impl Into<Bytes>) -> Self {
        self.entry(
            path,
            EntryKind::File {
                content: content.into(),
                mode: None,
            },
            false,
        )
    }

    /// An executable file (mode 0755).
    pub fn executable(self, path: impl AsRef<str>, content: impl Into<Bytes>) -> Self {
        self.entry(
            path,
            EntryKind::File {
                content: content.into(),
                mode: Some(0o755),
            },
            false,
        )
    }

    /// A file re-written on every start and never archived.
    pub fn ephemeral_file(self, path: impl AsRef<str>, content: impl Into<Bytes>) -> Self {
        self.entry(
            path,
            EntryKind::File {
                content: content.into(),
                mode: None,
            },
            true,
        )
    }

    /// An empty directory.
    pub fn dir(self, path: impl AsRef<str>) -> Self {
        self.entry(path, EntryKind::Dir, false)
    }

    /// A copy of a host file or directory.
    pub fn copy(self, path: impl AsRef<str>, host_path: impl Into<PathBuf>) -> Self {
        self.entry(
            path,
            EntryKind::Copy {
                host_path: host_path.into(),
            },
            false,
        )
    }

    /// A bind mount of a host path.
    pub fn bind_mount(
        self,
        path: impl AsRef<str>,
        host_path: impl Into<PathBuf>,
        read_only: bool,
    ) -> Self {
        self.entry(
            path,
            EntryKind::BindMount {
                host_path: host_path.into(),
                read_only,
            },
            false,
        )
    }

    /// A snapshot exclude glob.
    pub fn snapshot_exclude(mut self, glob: impl Into<String>) -> Self {
        self.spec.snapshot_excludes.push(glob.into());
        self
    }

    /// Validate and build.
    pub fn build(mut self) -> Result<WorkspaceSpec> {
        if !self.errors.is_empty() {
            return Err(self.errors.swap_remove(0));
        }
        self.spec.validate()?;
        Ok(self.spec)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rejects_bad_keys() {
        for bad in ["/abs", "a/../../b", ".."] {
            let err = WorkspaceSpec::builder().file(bad, "x").build().unwrap_err();
            assert!(matches!(err, Error::PathEscape { .. }), "{bad}");
        }
    }

    #[test]
    fn rejects_relative_host_paths_and_nesting() {
        assert!(
            WorkspaceSpec::builder()
                .copy("a", "rel/path")
                .build()
                .is_err()
        );
        assert!(
            WorkspaceSpec::builder()
                .bind_mount("data", "/tmp", true)
                .file("data/x", "y")
                .build()
                .is_err()
        );
        assert!(
            WorkspaceSpec::builder()
                .dir("d")
                .file("d/x", "y")
                .build()
                .is_ok()
        );
    }

    #[test]
    fn json_round_trip_and_validation() {
        let spec = WorkspaceSpec::builder()
            .file("a.txt", "hello")
            .entry(
                "bin.dat",
                EntryKind::File {
                    content: Bytes::from_static(&[0, 159, 146, 150]),
                    mode: Some(0o600),
                },
                false,
            )
            .bind_mount("data", "/srv/data", true)
            .ephemeral_file("tok", "t")
            .build()
            .unwrap();
        let json = serde_json::to_string(&spec).unwrap();
        let back: WorkspaceSpec = serde_json::from_str(&json).unwrap();
        assert_eq!(back, spec);
        let hostile = r#"{"entries":{"../x":{"type":"dir"}}}"#;
        assert!(serde_json::from_str::<WorkspaceSpec>(hostile).is_err());
        assert_eq!(spec.unarchived_paths().len(), 2);
    }
}
