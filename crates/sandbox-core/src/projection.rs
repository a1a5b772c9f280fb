//! Workspace projection: host-owned files (`AGENTS.md`, `skills/`, ...) mirrored into the box
//! at every start, skipped when unchanged.
//!
//! The hash is SHA-256 over the sorted projected files, each contributing its path, a NUL, its
//! executable bit, its length (8 bytes little-endian) and its content. It is recorded in the
//! box's state together with the list of projected files; when the hash changes, the new files
//! are written and the files projected last time but gone from the host are deleted in the box
//! (the reference implementation only ever adds). Files the agent created itself are left alone.

use std::collections::{BTreeMap, BTreeSet};
use std::io::Read;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};

use sha2::Digest as _;

use crate::archive::{self, PackSource};
use crate::backend::{BoxHandle, ImportMode};
use crate::error::{Error, Result};
use crate::path::RelPath;
use crate::state::ProjectionRecord;

/// The default projection roots.
pub const DEFAULT_ROOTS: [&str; 5] = [
    "AGENTS.md",
    "skills",
    "subagents",
    "knowledge",
    ".skills-cache",
];

/// Which host paths are projected into every box.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Projection {
    /// The host workspace the roots are relative to.
    pub host_root: PathBuf,
    /// Projected roots: files or directories, relative to `host_root`.
    pub roots: Vec<RelPath>,
    /// Projection on or off.
    pub enabled: bool,
}

impl Projection {
    /// The default roots under `host_root`.
    pub fn new(host_root: impl Into<PathBuf>) -> Self {
        Projection {
            host_root: host_root.into(),
            roots: DEFAULT_ROOTS
                .iter()
                .map(|r| RelPath::new(r).expect("valid default root"))
                .collect(),
            enabled: true,
        }
    }

    /// No projection.
    pub fn disabled() -> Self {
        Projection {
            host_root: PathBuf::new(),
            roots: Vec::new(),
            enabled: false,
        }
    }

    /// Replace the roots.
    pub fn roots<I, S>(mut self, roots: I) -> Result<Self>
    where
        I: IntoIterator<Item = S>,
        S: AsRef<str>,
    {
        self.roots = roots.into_iter().map(RelPath::new).collect::<Result<_>>()?;
        Ok(self)
    }

    /// Collect the projected host files and their hash.
    pub fn scan(&self) -> Result<ProjectionScan> {
        let mut files = BTreeMap::new();
        if self.enabled {
            for root in &self.roots {
                collect(
                    &self.host_root,
                    root,
                    &root.to_host(&self.host_root),
                    &mut files,
                )?;
            }
        }
        let mut hasher = sha2::Sha256::new();
        let mut buf = vec![0u8; 64 * 1024];
        for (rel, file) in &files {
            hasher.update(rel.as_str().as_bytes());
            hasher.update([0, u8::from(file.executable)]);
            hasher.update(file.len.to_le_bytes());
            let mut f = std::fs::File::open(&file.host).map_err(|e| Error::io(&file.host, e))?;
            let mut remaining = file.len;
            while remaining > 0 {
                let n = f.read(&mut buf).map_err(|e| Error::io(&file.host, e))?;
                if n == 0 {
                    return Err(Error::io(
                        &file.host,
                        std::io::Error::new(
                            std::io::ErrorKind::UnexpectedEof,
                            "file shrank while hashing",
                        ),
                    ));
                }
                let n = n.min(remaining as usize);
                hasher.update(&buf[..n]);
                remaining -= n as u64;
            }
        }
        Ok(ProjectionScan {
            hash: hex::encode(hasher.finalize()),
            files,
        })
    }
}

/// A host file to project.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HostFile {
    /// Where it is on the host.
    pub host: PathBuf,
    /// Its length when scanned.
    pub len: u64,
    /// Whether any execute bit is set.
    pub executable: bool,
}

/// The result of [`Projection::scan`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProjectionScan {
    /// Content hash (hex).
    pub hash: String,
    /// Files by workspace-relative path.
    pub files: BTreeMap<RelPath, HostFile>,
}

fn collect(
    host_root: &Path,
    rel: &RelPath,
    abs: &Path,
    out: &mut BTreeMap<RelPath, HostFile>,
) -> Result<()> {
    let meta = match std::fs::symlink_metadata(abs) {
        Ok(m) => m,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(Error::io(abs, e)),
    };
    if meta.is_file() {
        out.insert(
            rel.clone(),
            HostFile {
                host: abs.to_owned(),
                len: meta.len(),
                executable: meta.permissions().mode() & 0o111 != 0,
            },
        );
    } else if meta.is_dir() {
        for entry in std::fs::read_dir(abs).map_err(|e| Error::io(abs, e))? {
            let entry = entry.map_err(|e| Error::io(abs, e))?;
            let Some(name) = entry.file_name().to_str().map(str::to_owned) else {
                continue;
            };
            collect(host_root, &rel.join(&name)?, &entry.path(), out)?;
        }
    } else if meta.file_type().is_symlink() {
        // A link could pull anything on the host into every box; only plain files are projected.
        tracing::warn!(path = %rel, root = %host_root.display(), "projection skips a symlink");
    }
    Ok(())
}

/// What [`apply`] did.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum ProjectionOutcome {
    /// Projection is turned off.
    Disabled,
    /// The hash equals the box's recorded one: nothing was transferred.
    Skipped,
    /// Files were written (and stale ones removed).
    Applied {
        /// Files written.
        written: usize,
        /// Files removed because they left the host.
        removed: usize,
    },
}

/// Bring the box's projected files in line with the host. `current` is the box's record;
/// returns the new record and what was done.
pub async fn apply(
    projection: &Projection,
    handle: &dyn BoxHandle,
    current: Option<&ProjectionRecord>,
) -> Result<(Option<ProjectionRecord>, ProjectionOutcome)> {
    if !projection.enabled {
        return Ok((current.cloned(), ProjectionOutcome::Disabled));
    }
    let p = projection.clone();
    let scan = tokio::task::spawn_blocking(move || p.scan())
        .await
        .map_err(|e| Error::backend("core", "projection scan", e.to_string()))??;
    if current.is_some_and(|c| c.hash == scan.hash) {
        return Ok((current.cloned(), ProjectionOutcome::Skipped));
    }
    let new_files: BTreeSet<RelPath> = scan.files.keys().cloned().collect();
    let stale: Vec<RelPath> = current
        .map(|c| c.files.difference(&new_files).cloned().collect())
        .unwrap_or_default();
    if !stale.is_empty() {
        handle.remove(&stale).await?;
    }
    let written = scan.files.len();
    let items = crate::sandbox::with_parents(
        scan.files
            .into_iter()
            .map(|(rel, f)| (rel, PackSource::HostFile(f.host)))
            .collect(),
    );
    if !items.is_empty() {
        handle
            .import(archive::pack(items), ImportMode::Merge)
            .await?;
    }
    Ok((
        Some(ProjectionRecord {
            hash: scan.hash,
            files: new_files,
        }),
        ProjectionOutcome::Applied {
            written,
            removed: stale.len(),
        },
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hash_tracks_content_names_and_modes() {
        let dir = tempfile::tempdir().unwrap();
        let p = Projection::new(dir.path());
        let empty = p.scan().unwrap();
        std::fs::write(dir.path().join("AGENTS.md"), "be nice").unwrap();
        std::fs::create_dir_all(dir.path().join("skills/a")).unwrap();
        std::fs::write(dir.path().join("skills/a/SKILL.md"), "skill").unwrap();
        std::fs::write(dir.path().join("unrelated.txt"), "not projected").unwrap();
        let one = p.scan().unwrap();
        assert_ne!(one.hash, empty.hash);
        assert_eq!(one.files.len(), 2);
        assert_eq!(p.scan().unwrap().hash, one.hash, "stable");
        std::fs::set_permissions(
            dir.path().join("skills/a/SKILL.md"),
            std::fs::Permissions::from_mode(0o755),
        )
        .unwrap();
        assert_ne!(p.scan().unwrap().hash, one.hash, "mode counts");
        std::fs::write(dir.path().join("unrelated.txt"), "changed").unwrap();
        let two = p.scan().unwrap();
        std::fs::rename(dir.path().join("skills/a"), dir.path().join("skills/b")).unwrap();
        assert_ne!(p.scan().unwrap().hash, two.hash, "names count");
    }
}
