//! A record of everything under a directory, to prove that an operation left a tree alone.
//!
//! Hostile-archive tests and the archive fuzz target record the neighbourhood of an
//! extraction's destination before and after; any difference (a file linked, chmodded,
//! touched or rewritten through a symlink) is an escape.

use std::collections::BTreeMap;
use std::fs;
use std::io;
use std::os::unix::fs::MetadataExt as _;
use std::path::Path;

/// What one path is, read without following a symlink.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NodeState {
    /// `'f'` file, `'d'` directory, `'l'` symlink, `'o'` anything else.
    pub kind: char,
    /// Permission bits.
    pub mode: u32,
    /// Modification time, nanoseconds since the epoch.
    pub mtime_ns: i128,
    /// Size in bytes (files and links only: a directory's size changes with its entries,
    /// which are recorded themselves).
    pub size: u64,
    /// Hard link count (files only, for the same reason).
    pub nlink: u64,
    /// BLAKE3 of a file's content, or a symlink's target.
    pub content: String,
}

/// Every path under `root` (not `root` itself) with its state, by path relative to `root`.
/// Symlinks are recorded, never followed. A missing `root` records as empty.
pub fn record(root: &Path) -> BTreeMap<String, NodeState> {
    let mut out = BTreeMap::new();
    walk(root, "", &mut out).unwrap_or_else(|e| panic!("recording {}: {e}", root.display()));
    out
}

/// [`record`] plus `root` itself under the name `.` (its mode and mtime are what a deferred
/// chmod through a link would change).
pub fn record_with_root(root: &Path) -> BTreeMap<String, NodeState> {
    let mut out = record(root);
    if let Ok(meta) = fs::symlink_metadata(root) {
        out.insert(".".to_owned(), state(root, &meta).expect("root state"));
    }
    out
}

fn walk(dir: &Path, prefix: &str, out: &mut BTreeMap<String, NodeState>) -> io::Result<()> {
    let entries = match fs::read_dir(dir) {
        Ok(e) => e,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(e),
    };
    for entry in entries {
        let entry = entry?;
        let name = format!("{prefix}{}", entry.file_name().to_string_lossy());
        let path = entry.path();
        let meta = fs::symlink_metadata(&path)?;
        out.insert(name.clone(), state(&path, &meta)?);
        if meta.is_dir() {
            walk(&path, &format!("{name}/"), out)?;
        }
    }
    Ok(())
}

fn state(path: &Path, meta: &fs::Metadata) -> io::Result<NodeState> {
    let ft = meta.file_type();
    let (kind, content) = if ft.is_symlink() {
        ('l', fs::read_link(path)?.to_string_lossy().into_owned())
    } else if ft.is_dir() {
        ('d', String::new())
    } else if ft.is_file() {
        ('f', blake3::hash(&fs::read(path)?).to_hex().to_string())
    } else {
        ('o', String::new())
    };
    let sized = kind != 'd';
    Ok(NodeState {
        kind,
        mode: meta.mode() & 0o7777,
        mtime_ns: i128::from(meta.mtime()) * 1_000_000_000 + i128::from(meta.mtime_nsec()),
        size: if sized { meta.len() } else { 0 },
        nlink: if sized { meta.nlink() } else { 0 },
        content,
    })
}
