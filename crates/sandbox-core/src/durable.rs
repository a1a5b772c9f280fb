//! Small files replaced atomically, with exactly the fsyncs a caller's durability needs.
//!
//! A replacement is a temporary file beside the target, then `rename` over it. Two fsyncs can
//! follow from what must survive a crash (power loss, kernel panic; a killed process loses
//! nothing either way, the page cache is shared):
//!
//! - the **file** before the rename ([`Sync::File`]): without it the rename may reach the disk
//!   before the data, and a crash leaves an empty file in place of the previous one. Needed
//!   whenever the previous content must not be lost (it holds a saved state), or the new
//!   content must survive;
//! - the **directory** after the rename ([`Sync::FileAndDir`]): without it the rename itself
//!   may be lost, and the previous content comes back. Needed when the new content must
//!   survive (a saved state, a manifest a saved state will point at).
//!
//! Directories a write creates are made durable too: each new directory's parent is fsynced
//! once, when it is created ([`create_dirs`]); an existing directory costs one `open` that
//! finds it, no `mkdir`.

use std::fs;
use std::io::{self, Write as _};
use std::path::Path;

/// What a [`replace`] makes durable.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Sync {
    /// Nothing: a crash may lose the write or leave an empty file (readers must accept one).
    Nothing,
    /// The file's data before the rename: after a crash the target holds the old content or
    /// the new one, never an empty file.
    File,
    /// The data and the rename: once this returns, the new content survives a crash.
    FileAndDir,
}

/// Create `dir` and its missing ancestors; each directory created has its parent fsynced
/// (when `durable`), so the new path survives a crash. Whether anything was created.
pub(crate) fn create_dirs(dir: &Path, durable: bool) -> io::Result<bool> {
    match fs::create_dir(dir) {
        Ok(()) => {}
        Err(e) if e.kind() == io::ErrorKind::AlreadyExists => return Ok(false),
        Err(e) if e.kind() == io::ErrorKind::NotFound => {
            let parent = dir.parent().ok_or(e)?;
            create_dirs(parent, durable)?;
            match fs::create_dir(dir) {
                Ok(()) => {}
                Err(e) if e.kind() == io::ErrorKind::AlreadyExists => return Ok(true),
                Err(e) => return Err(e),
            }
        }
        Err(e) => return Err(e),
    }
    if durable && let Some(parent) = dir.parent() {
        sync_dir(parent)?;
    }
    Ok(true)
}

/// fsync a directory (its entries).
pub(crate) fn sync_dir(dir: &Path) -> io::Result<()> {
    let dir = if dir.as_os_str().is_empty() {
        Path::new(".")
    } else {
        dir
    };
    fs::File::open(dir)?.sync_all()
}

/// Replace `path` with `bytes` (temporary file beside it, then `rename`), with the fsyncs
/// `sync` asks for. The parent directory must exist.
pub(crate) fn replace(path: &Path, bytes: &[u8], sync: Sync) -> io::Result<()> {
    let parent = path.parent().unwrap_or(Path::new("."));
    let mut tmp = tempfile::NamedTempFile::new_in(parent)?;
    tmp.write_all(bytes)?;
    if sync != Sync::Nothing {
        tmp.as_file().sync_all()?;
    }
    tmp.persist(path).map_err(|e| e.error)?;
    if sync == Sync::FileAndDir {
        sync_dir(parent)?;
    }
    Ok(())
}

/// Run `f`; if it fails because a directory on the way is missing, create `dir` (durably when
/// asked) and run it once more. The common case (the directory exists) costs no `mkdir`.
pub(crate) fn in_dir<T>(
    dir: &Path,
    durable: bool,
    mut f: impl FnMut() -> io::Result<T>,
) -> io::Result<T> {
    match f() {
        Err(e) if e.kind() == io::ErrorKind::NotFound => {
            create_dirs(dir, durable)?;
            f()
        }
        other => other,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn creates_missing_ancestors_once() {
        let dir = tempfile::tempdir().unwrap();
        let deep = dir.path().join("a/b/c");
        assert!(create_dirs(&deep, true).unwrap());
        assert!(deep.is_dir());
        assert!(!create_dirs(&deep, true).unwrap());
        // A file in the way is an error, not a silent success.
        std::fs::write(dir.path().join("f"), "x").unwrap();
        assert!(create_dirs(&dir.path().join("f/g"), true).is_err());
    }

    #[test]
    fn replace_writes_whole_content_every_way() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("x.json");
        for (i, sync) in [Sync::Nothing, Sync::File, Sync::FileAndDir]
            .into_iter()
            .enumerate()
        {
            replace(&path, format!("v{i}").as_bytes(), sync).unwrap();
            assert_eq!(std::fs::read_to_string(&path).unwrap(), format!("v{i}"));
        }
        // Nothing left beside it.
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 1);
    }

    #[test]
    fn in_dir_creates_the_directory_only_when_missing() {
        let dir = tempfile::tempdir().unwrap();
        let sub = dir.path().join("s/t");
        let file = sub.join("f");
        let mut attempts = 0;
        in_dir(&sub, true, || {
            attempts += 1;
            std::fs::write(&file, "1")
        })
        .unwrap();
        assert_eq!(attempts, 2);
        attempts = 0;
        in_dir(&sub, true, || {
            attempts += 1;
            std::fs::write(&file, "2")
        })
        .unwrap();
        assert_eq!(attempts, 1);
    }
}
