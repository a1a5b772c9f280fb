//! Blocking filesystem helpers of the box layout. None of them follows a symlink it did not
//! resolve on purpose.

use std::fs;
use std::io;
use std::path::{Path, PathBuf};
use std::time::{SystemTime, UNIX_EPOCH};

use sandbox_core::archive::ensure_parents;
use sandbox_core::beneath::{self, Anchor, Dir};
use sandbox_core::{Error, LeftoverReport, LeftoverSweep, RelPath, Result};
use serde::{Deserialize, Serialize};

/// Name of the owner marker file inside a box directory.
pub(crate) const MARKER: &str = ".sandbox-box.json";
/// Name of the workspace directory inside a box directory.
pub(crate) const WORKSPACE: &str = "workspace";
/// Prefix of staging directories (inside the box directory, beside the workspace).
pub(crate) const STAGING_PREFIX: &str = ".staging-";
/// Prefix of replaced workspaces awaiting removal.
pub(crate) const OLD_PREFIX: &str = ".old-";
/// Prefix of a box directory being made (beside the boxes, in the base directory): it gets
/// its marker there and is renamed into place, so a box name never shows without its marker.
pub(crate) const CREATING_PREFIX: &str = ".creating-";
/// Prefix of a box directory being removed: renamed out of its name first, so a removal cut
/// short leaves a name `sweep_leftovers` recognises, never a box name without its marker.
pub(crate) const TRASH_PREFIX: &str = ".trash-";

/// A bind mount, realized as a symlink at `path` pointing to `host` (in a confined box,
/// `host` is also bind-mounted at its own path, read-only if `read_only`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct BindLink {
    pub path: RelPath,
    pub host: PathBuf,
    pub read_only: bool,
}

/// Refuse a write or removal at `path` beneath a read-only bind mount (the file tools work on
/// the host, so the box's read-only mount does not stop them).
pub(crate) fn check_writable(links: &[BindLink], path: &RelPath) -> Result<()> {
    match links
        .iter()
        .find(|l| l.read_only && path != &l.path && path.starts_with(&l.path))
    {
        Some(link) => Err(Error::invalid(
            "file",
            format!("`{path}` lies in the read-only bind mount `{}`", link.path),
        )),
        None => Ok(()),
    }
}

/// What makes a box directory recognisably ours.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct Marker {
    pub backend: String,
    #[serde(default)]
    pub key: Option<String>,
    pub created_unix_ms: u64,
}

impl Marker {
    pub fn new(key: Option<&str>) -> Self {
        Marker {
            backend: crate::BACKEND.to_owned(),
            key: key.map(str::to_owned),
            created_unix_ms: SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map_or(0, |d| d.as_millis() as u64),
        }
    }
}

/// Whether `name` is a box name this backend generates: `k-<16 hex>` or `b-<uuid>`.
pub(crate) fn is_box_name(name: &str) -> bool {
    if let Some(digest) = name.strip_prefix("k-") {
        digest.len() == 16 && digest.bytes().all(|b| b.is_ascii_hexdigit())
    } else if let Some(id) = name.strip_prefix("b-") {
        uuid::Uuid::try_parse(id).is_ok()
    } else {
        false
    }
}

/// Check that `box_dir` is free or ours for `key`:
/// missing or empty → free; carrying our marker with the same key → ours; else
/// [`Error::Conflict`]. An empty directory is accepted because a crash between creating the
/// directory and writing its marker leaves one.
pub(crate) fn check_owner(box_dir: &Path, key: Option<&str>) -> Result<()> {
    let conflict = |reason: String| Error::Conflict {
        key: box_dir.display().to_string(),
        reason,
    };
    match fs::symlink_metadata(box_dir) {
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(Error::io(box_dir, e)),
        Ok(m) if !m.is_dir() => {
            return Err(conflict("exists and is not a directory".into()));
        }
        Ok(_) => {}
    }
    let marker_path = box_dir.join(MARKER);
    match fs::read(&marker_path) {
        Ok(bytes) => {
            let marker: Marker = serde_json::from_slice(&bytes)
                .map_err(|e| conflict(format!("unreadable owner marker {MARKER}: {e}")))?;
            if marker.backend != crate::BACKEND {
                return Err(conflict(format!(
                    "owned by the `{}` backend, not `{}`",
                    marker.backend,
                    crate::BACKEND
                )));
            }
            if marker.key.as_deref() != key {
                return Err(conflict(
                    "the box belongs to another isolation key (digest collision or reused \
                     directory)"
                        .into(),
                ));
            }
            Ok(())
        }
        Err(e) if e.kind() == io::ErrorKind::NotFound => {
            let empty = fs::read_dir(box_dir)
                .map_err(|e| Error::io(box_dir, e))?
                .next()
                .is_none();
            if empty {
                Ok(())
            } else {
                Err(conflict(format!(
                    "the directory has no {MARKER} owner marker, so it is not a box of this \
                     backend"
                )))
            }
        }
        Err(e) => Err(Error::io(marker_path, e)),
    }
}

/// Create the box directory and its owner marker if missing, after checking ownership. A box
/// that already has its marker costs no `mkdir`.
///
/// The directory is made as `.creating-<uuid>` beside it, given its marker, and renamed into
/// place (over an empty directory a crash of older code may have left): a process killed at
/// any point leaves either no box or a whole one with its marker, and at worst a
/// `.creating-*` directory that [`sweep_leftovers`] removes. Nothing here is fsynced: a box
/// directory holds the live workspace, which a crash may lose anyway (the snapshot is what is
/// durable).
pub(crate) fn ensure_box(box_dir: &Path, key: Option<&str>) -> Result<()> {
    check_owner(box_dir, key)?;
    let marker_path = box_dir.join(MARKER);
    if fs::symlink_metadata(&marker_path).is_ok() {
        return Ok(());
    }
    let base = box_dir.parent().expect("a box directory has a parent");
    let creating = base.join(format!(
        "{CREATING_PREFIX}{}",
        uuid::Uuid::new_v4().simple()
    ));
    match fs::create_dir(&creating) {
        Ok(()) => {}
        // The base directory itself is missing (the first box): made once, then retried.
        Err(e) if e.kind() == io::ErrorKind::NotFound => {
            fs::create_dir_all(base).map_err(|e| Error::io(base, e))?;
            fs::create_dir(&creating).map_err(|e| Error::io(&creating, e))?;
        }
        Err(e) => return Err(Error::io(&creating, e)),
    }
    let json = serde_json::to_vec_pretty(&Marker::new(key))
        .map_err(|e| Error::backend(crate::BACKEND, "boot", e.to_string()))?;
    let placed = fs::write(creating.join(MARKER), json)
        .map_err(|e| Error::io(creating.join(MARKER), e))
        .and_then(|()| fs::rename(&creating, box_dir).map_err(|e| Error::io(box_dir, e)));
    match placed {
        Ok(()) => Ok(()),
        Err(e) => {
            let _ = remove_any(&creating);
            // Made meanwhile by another process (the same key's box): fine if it is ours.
            if fs::symlink_metadata(&marker_path).is_ok() {
                check_owner(box_dir, key)
            } else {
                Err(e)
            }
        }
    }
}

/// Remove a box directory: renamed to `.trash-<uuid>` beside it first, then deleted, so a
/// process killed mid-way leaves a `.trash-*` directory (which [`sweep_leftovers`] removes)
/// and never a box name without its marker. Missing is fine.
pub(crate) fn remove_box_dir(box_dir: &Path) -> io::Result<()> {
    let base = box_dir.parent().expect("a box directory has a parent");
    let trash = base.join(format!("{TRASH_PREFIX}{}", uuid::Uuid::new_v4().simple()));
    match fs::rename(box_dir, &trash) {
        Ok(()) => remove_any(&trash),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
        // Not a directory we can move (a file in its place): removed where it is.
        Err(_) => remove_any(box_dir),
    }
}

/// What a box-creating or box-removing process killed mid-way leaves in the base directory
/// `base`: `.creating-*` and `.trash-*` directories, and box-named directories without an
/// owner marker (left by earlier versions, which made the directory before its marker and
/// deleted it in place). Each older than the grace period is removed, at most
/// `sweep.max_removals`.
pub(crate) fn sweep_leftovers(base: &Path, sweep: LeftoverSweep) -> Result<LeftoverReport> {
    let mut report = LeftoverReport::default();
    let entries = match fs::read_dir(base) {
        Ok(e) => e,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(report),
        Err(e) => return Err(Error::io(base, e)),
    };
    for entry in entries {
        let entry = entry.map_err(|e| Error::io(base, e))?;
        let Some(name) = entry.file_name().to_str().map(str::to_owned) else {
            continue;
        };
        let path = entry.path();
        let meta = match fs::symlink_metadata(&path) {
            Ok(m) if m.is_dir() => m,
            Ok(_) => continue,
            Err(e) if e.kind() == io::ErrorKind::NotFound => continue,
            Err(e) => return Err(Error::io(&path, e)),
        };
        let leftover = name.starts_with(CREATING_PREFIX)
            || name.starts_with(TRASH_PREFIX)
            || (is_box_name(&name)
                && matches!(fs::symlink_metadata(path.join(MARKER)), Err(e) if e.kind() == io::ErrorKind::NotFound));
        if !leftover {
            continue;
        }
        if !sweep.is_past_grace(meta.modified().ok()) {
            report.in_grace += 1;
        } else if report.removed >= sweep.max_removals {
            report.deferred += 1;
        } else if sweep.dry_run {
            report.removed += 1;
        } else {
            // A box-named one is moved out of its name first, like any box removal.
            let removed = if is_box_name(&name) {
                remove_box_dir(&path)
            } else {
                remove_any(&path)
            };
            match removed {
                Ok(()) => report.removed += 1,
                Err(e) => {
                    tracing::warn!(path = %path.display(), error = %e, "cannot remove a leftover box directory");
                    report.failed += 1;
                }
            }
        }
    }
    Ok(report)
}

/// Remove staging and old-workspace directories a crashed import left in `box_dir`.
pub(crate) fn remove_leftovers(box_dir: &Path) {
    let Ok(entries) = fs::read_dir(box_dir) else {
        return;
    };
    for entry in entries.flatten() {
        let name = entry.file_name();
        let name = name.to_string_lossy();
        if name.starts_with(STAGING_PREFIX) || name.starts_with(OLD_PREFIX) {
            let path = entry.path();
            if let Err(e) = remove_any(&path) {
                tracing::warn!(path = %path.display(), error = %e, "cannot remove a leftover import directory");
            }
        }
    }
}

/// Remove a file, a symlink (never its target) or a directory tree. Missing is fine.
pub(crate) fn remove_any(path: &Path) -> io::Result<()> {
    match fs::symlink_metadata(path) {
        Ok(m) if m.is_dir() => fs::remove_dir_all(path),
        Ok(_) => fs::remove_file(path),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(e),
    }
}

/// Check the parent components of `rel` under `root` with `lstat`.
///
/// `Ok(true)`: every parent is a real directory. `Ok(false)`: a parent is missing or is not a
/// directory, so nothing can exist at `rel`. [`Error::PathEscape`]: a parent is a symlink.
pub(crate) fn parents_are_dirs(root: &Path, rel: &RelPath) -> Result<bool> {
    let mut cur = root.to_path_buf();
    let parts: Vec<&str> = rel.components().collect();
    for part in &parts[..parts.len() - 1] {
        cur.push(part);
        match fs::symlink_metadata(&cur) {
            Ok(m) if m.file_type().is_symlink() => {
                return Err(Error::path_escape(
                    rel.as_str(),
                    format!("passes through the symlink `{}`", cur.display()),
                ));
            }
            Ok(m) if m.is_dir() => {}
            Ok(_) => return Ok(false),
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(false),
            Err(e) => return Err(Error::io(&cur, e)),
        }
    }
    Ok(true)
}

/// Whether `root` exists as a real directory (a symlink in its place does not count).
pub(crate) fn is_real_dir(root: &Path) -> Result<bool> {
    match fs::symlink_metadata(root) {
        Ok(m) => Ok(m.is_dir()),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(false),
        Err(e) => Err(Error::io(root, e)),
    }
}

/// [`ensure_parents`] for single-file operations: its refusal is a path escape, not an archive
/// problem.
pub(crate) fn ensure_parents_of(root: &Path, rel: &RelPath) -> Result<PathBuf> {
    ensure_parents(root, rel).map_err(|e| match e {
        Error::UnsafeArchive { path, reason } => Error::PathEscape { path, reason },
        other => other,
    })
}

/// Make each bind link exist under `root` as a symlink to its host path. A missing link is
/// created and a link pointing elsewhere is replaced; a file or directory in the way is a
/// [`Error::Conflict`] (it may be the user's data, so it is never removed).
pub(crate) fn install_bind_links(root: &Path, links: &[BindLink]) -> Result<()> {
    for link in links {
        let abs = ensure_parents_of(root, &link.path)?;
        match fs::symlink_metadata(&abs) {
            Ok(m) if m.file_type().is_symlink() => {
                if fs::read_link(&abs).ok().as_deref() == Some(link.host.as_path()) {
                    continue;
                }
                fs::remove_file(&abs).map_err(|e| Error::io(&abs, e))?;
            }
            Ok(_) => {
                return Err(Error::Conflict {
                    key: link.path.to_string(),
                    reason: "a file or directory occupies the bind mount's path".into(),
                });
            }
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            Err(e) => return Err(Error::io(&abs, e)),
        }
        std::os::unix::fs::symlink(&link.host, &abs).map_err(|e| Error::io(&abs, e))?;
    }
    Ok(())
}

/// Paths a resolved path may lie under: the workspace root and the host paths of the
/// read-write bind mounts (canonicalized; ones that do not exist are skipped).
pub(crate) fn allowed_roots(workspace: &Path, links: &[BindLink]) -> Vec<PathBuf> {
    let mut roots = vec![workspace.to_path_buf()];
    roots.extend(links.iter().filter_map(|l| fs::canonicalize(&l.host).ok()));
    roots
}

/// Whether the canonical path `resolved` lies at or under one of `roots`, by components.
pub(crate) fn is_within(resolved: &Path, roots: &[PathBuf]) -> bool {
    roots.iter().any(|r| resolved.starts_with(r))
}

/// A declared bind mount's host directory, opened.
pub(crate) struct BindRoot {
    /// The host path as declared.
    pub given: PathBuf,
    /// The same, canonical.
    pub real: PathBuf,
    pub dir: Dir,
}

/// Open the host directories of `links` (the caller's configuration, trusted: resolved
/// normally). One that cannot be opened is left out: nothing resolves beneath it then.
pub(crate) fn open_bind_roots(links: &[BindLink]) -> Vec<BindRoot> {
    links
        .iter()
        .filter_map(|l| {
            let real = fs::canonicalize(&l.host).ok()?;
            let dir = Dir::open(&real).ok()?;
            Some(BindRoot {
                given: l.host.clone(),
                real,
                dir,
            })
        })
        .collect()
}

/// The bind roots as anchors: an absolute symlink into a declared host directory (the bind
/// link itself, or another link to it) is followed beneath that directory's handle.
pub(crate) fn anchors(roots: &[BindRoot]) -> Vec<Anchor<'_>> {
    roots
        .iter()
        .flat_map(|r| {
            [
                Anchor {
                    path: &r.given,
                    dir: &r.dir,
                },
                Anchor {
                    path: &r.real,
                    dir: &r.dir,
                },
            ]
        })
        .collect()
}

/// Where `path` of the box is resolved: strictly under a declared bind mount, beneath a handle
/// on its host directory (opened from the declaration, whatever the link in the workspace now
/// points to); anywhere else, beneath `workspace`. The bind link's own path stays in the
/// workspace, so removing or replacing it touches the link, never the host directory.
pub(crate) fn route(
    workspace: Dir,
    links: &[BindLink],
    path: &RelPath,
) -> io::Result<(Dir, RelPath)> {
    for link in links {
        if path != &link.path && path.starts_with(&link.path) {
            let rest = &path.as_str()[link.path.as_str().len() + 1..];
            let rest = RelPath::new(rest)
                .map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e.to_string()))?;
            let host = Dir::open(fs::canonicalize(&link.host)?)?;
            return Ok((host, rest));
        }
    }
    Ok((workspace, path.clone()))
}

/// The typed error of a failed resolution of `path`: refusals by the resolution rules are
/// path escapes, a missing workspace or file is [`Error::NotFound`], the rest I/O errors.
pub(crate) fn resolution_error(path: &RelPath, abs: &Path, e: io::Error) -> Error {
    if let Some(reason) = beneath::refusal(&e) {
        return Error::path_escape(path.as_str(), reason);
    }
    Error::io(abs, e)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn box_names() {
        assert!(is_box_name("k-0123456789abcdef"));
        assert!(is_box_name("b-67e55044-10b1-426f-9247-bb680e5fe0c8"));
        assert!(!is_box_name("k-0123"));
        assert!(!is_box_name(".."));
        assert!(!is_box_name("b-not-a-uuid"));
        assert!(!is_box_name("home"));
    }

    #[test]
    fn within_is_by_component() {
        let roots = vec![PathBuf::from("/ws/user1")];
        assert!(is_within(Path::new("/ws/user1"), &roots));
        assert!(is_within(Path::new("/ws/user1/a"), &roots));
        assert!(!is_within(Path::new("/ws/user10"), &roots));
        assert!(!is_within(Path::new("/ws"), &roots));
    }

    #[test]
    fn owner_checks() {
        let dir = tempfile::tempdir().unwrap();
        let b = dir.path().join("k-0123456789abcdef");
        check_owner(&b, Some("k1")).unwrap();
        ensure_box(&b, Some("k1")).unwrap();
        check_owner(&b, Some("k1")).unwrap();
        assert!(matches!(
            check_owner(&b, Some("k2")),
            Err(Error::Conflict { .. })
        ));
        let foreign = dir.path().join("foreign");
        fs::create_dir(&foreign).unwrap();
        check_owner(&foreign, None).unwrap();
        fs::write(foreign.join("data"), "x").unwrap();
        assert!(matches!(
            check_owner(&foreign, None),
            Err(Error::Conflict { .. })
        ));
    }
}
