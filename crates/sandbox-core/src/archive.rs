//! The tar codec: packing host trees and in-memory sources into streams, validating untrusted
//! archives, and extracting them without ever following a symlink.
//!
//! Safety rules applied to every archive read ([`Validator`]; limits in [`ArchivePolicy`]):
//! - a name is what its header says: relative, UTF-8, without NUL and without `..` (a leading
//!   `./` is accepted); a name, prefix or link name field with bytes after its terminating NUL
//!   is refused, never read as the part before the NUL;
//! - the validator models the tree the archive builds, including the directories it creates
//!   implicitly (an entry `a/b/c` creates `a` and `a/b`), and no entry replaces or passes
//!   through anything of that tree as another kind: no symlink, file or hard link where the
//!   archive made a directory, nothing under a symlink or a file of the archive (so nothing is
//!   written through a link the archive planted). A directory entry for a directory made
//!   implicitly is fine; any other path appears once;
//! - hard links point to a regular file earlier in the same archive (which, by the rule above,
//!   is still there when the link is made);
//! - device nodes, fifos and unknown entry types are refused;
//! - entry count (implicit directories included) and total size are bounded;
//! - symlinks are kept as links whatever they point at (a venv's `python -> /usr/bin/python3`
//!   must survive), unless [`ArchivePolicy::strict_symlinks`] is set, which refuses links
//!   that lead outside the root.
//!
//! Extraction works through directory handles ([`crate::beneath`]) and never resolves a path
//! from `/` again. Each entry's parent is opened (or created) beneath the destination without
//! following any symlink, so a link already there, or swapped in meanwhile, is refused rather
//! than passed through. A file, link or directory at an entry's own path is replaced, never
//! written through (a directory entry keeps an existing directory). A hard link's source is
//! found the same way and linked by handle. Directory modes and mtimes come last, with owner
//! access (`| 0o700`) kept, each directory re-opened beneath the destination without following
//! links and changed through its handle.
//!
//! Packing host trees ([`pack_dir`], [`list_dir`], [`PackSource::HostTree`]) walks them the
//! same way: every entry is opened beneath its parent's handle without following a link and
//! described from what was opened, so a file swapped for a symlink meanwhile is never read
//! through.

use std::collections::{HashMap, HashSet};
use std::fs;
use std::io::{self, Read, Write};
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use globset::{Glob, GlobSet, GlobSetBuilder};
use rustix::fs::{AtFlags, Mode, OFlags};
use rustix::io::Errno;
use serde::{Deserialize, Serialize};

use crate::backend::{EntryType, TreeEntry};
use crate::beneath::{self, Dir, Follow, Kind};
use crate::error::{Error, Result};
use crate::path::RelPath;
use crate::stream::{self, ByteStream};

/// Chunks kept in flight between a tar producer thread and its consumer.
const DEPTH: usize = 8;

/// Limits and options for reading untrusted archives.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[non_exhaustive]
pub struct ArchivePolicy {
    /// Refuse symlinks whose target is absolute or climbs out of the root. Default `false`:
    /// links are restored whatever they point at (reads through them are the file layer's
    /// resolved-path check).
    pub strict_symlinks: bool,
    /// Most entries accepted, counting the directories an archive creates implicitly (the
    /// parents of its entries that it has no entries for). Default 1,000,000.
    pub max_entries: u64,
    /// Most file bytes accepted in total. Default 64 GiB.
    pub max_total_bytes: u64,
}

impl Default for ArchivePolicy {
    fn default() -> Self {
        ArchivePolicy {
            strict_symlinks: false,
            max_entries: 1_000_000,
            max_total_bytes: 64 << 30,
        }
    }
}

impl ArchivePolicy {
    /// Refuse outward symlinks.
    pub fn strict(mut self) -> Self {
        self.strict_symlinks = true;
        self
    }
}

/// The paths an export asked for: an entry is kept when it is one of them or lies under one
/// (used by backends that export more than was asked and filter on the way).
#[derive(Debug, Clone, Default)]
pub struct Wanted(HashSet<RelPath>);

impl Wanted {
    /// The set of `paths`.
    pub fn new(paths: impl IntoIterator<Item = RelPath>) -> Self {
        Wanted(paths.into_iter().collect())
    }

    /// Whether `path` is asked for (itself or through an ancestor).
    pub fn covers(&self, path: &RelPath) -> bool {
        let mut cur = Some(path.clone());
        while let Some(p) = cur {
            if self.0.contains(&p) {
                return true;
            }
            cur = p.parent();
        }
        false
    }
}

/// Paths and globs left out of packs and snapshots.
#[derive(Debug, Clone, Default)]
pub struct Excludes {
    paths: Vec<RelPath>,
    globs: Option<GlobSet>,
}

impl Excludes {
    /// Exclude `paths` (with everything under them) and paths matching `globs`.
    pub fn new(paths: Vec<RelPath>, globs: &[String]) -> Result<Self> {
        let globs = if globs.is_empty() {
            None
        } else {
            let mut b = GlobSetBuilder::new();
            for g in globs {
                let glob = Glob::new(g)
                    .map_err(|e| Error::invalid("exclude glob", format!("`{g}`: {e}")))?;
                b.add(glob);
            }
            Some(
                b.build()
                    .map_err(|e| Error::invalid("exclude glob", e.to_string()))?,
            )
        };
        Ok(Excludes { paths, globs })
    }

    /// Whether `path` itself is excluded (callers skip its subtree too).
    pub fn matches(&self, path: &RelPath) -> bool {
        self.paths.iter().any(|p| path.starts_with(p))
            || self
                .globs
                .as_ref()
                .is_some_and(|g| g.is_match(path.as_str()))
    }

    /// Whether `path` or any of its ancestors is excluded.
    pub fn covers(&self, path: &RelPath) -> bool {
        let mut cur = Some(path.clone());
        while let Some(p) = cur {
            if self.matches(&p) {
                return true;
            }
            cur = p.parent();
        }
        false
    }
}

/// One item for [`pack`].
#[derive(Debug, Clone)]
pub enum PackSource {
    /// A file with these bytes.
    Bytes {
        /// Content.
        data: Bytes,
        /// Permission bits.
        mode: u32,
    },
    /// A directory.
    Dir {
        /// Permission bits.
        mode: u32,
    },
    /// A host file (regular files only, a symlink at the path itself is refused; its mode is
    /// kept).
    HostFile(PathBuf),
    /// A host file or directory tree, walked without following symlinks.
    HostTree(PathBuf),
}

/// Pack `items` (in order) into a tar stream. Parent directories are not added implicitly.
pub fn pack(items: Vec<(RelPath, PackSource)>) -> ByteStream {
    stream::spawn_writer(DEPTH, move |w| {
        let mut tar = new_builder(w);
        let now = unix_now();
        for (path, source) in items {
            match source {
                PackSource::Bytes { data, mode } => {
                    let mut h = header(tar::EntryType::Regular, mode, now, data.len() as u64);
                    tar.append_data(&mut h, path.as_str(), &data[..])
                        .map_err(|e| Error::io(path.as_str(), e))?;
                }
                PackSource::Dir { mode } => {
                    let mut h = header(tar::EntryType::Directory, mode, now, 0);
                    tar.append_data(&mut h, path.as_str(), io::empty())
                        .map_err(|e| Error::io(path.as_str(), e))?;
                }
                PackSource::HostFile(host) => {
                    let mut node = open_host_file(&host)?;
                    append_host(&mut tar, &path, &mut node, &host)?;
                }
                PackSource::HostTree(host) => {
                    let mut node = open_host_top(&host)?;
                    append_host(&mut tar, &path, &mut node, &host)?;
                    if let HostNode::Dir { dir, .. } = node {
                        let root = dir.try_clone().map_err(|e| Error::io(&host, e))?;
                        let mut add = |rel: &RelPath, node: &mut HostNode| {
                            // Named by the host path in errors, not by the name in the archive.
                            let below = rel.as_str().strip_prefix(path.as_str()).unwrap_or("");
                            let shown = host.join(below.trim_start_matches('/'));
                            append_host(&mut tar, rel, node, &shown)
                        };
                        Walker {
                            root: &root,
                            excludes: &Excludes::default(),
                            read_files: true,
                            visit: &mut add,
                        }
                        .children(dir, None, Some(&path))?;
                    }
                }
            }
        }
        tar.finish().map_err(|e| Error::io("tar", e))?;
        Ok(())
    })
}

/// Pack the tree under `root` (not `root` itself) with workspace-relative names, skipping
/// `excludes`, sockets and devices. Symlinks are packed as links.
///
/// Everything below `root` is opened beneath a handle on it without following any symlink,
/// and each entry's header comes from the handle that is read, so a file swapped for a link
/// while the tree is packed is never read through. A path of `only` that passes through a
/// symlink is [`Error::PathEscape`].
pub fn pack_dir(root: PathBuf, only: Option<Vec<RelPath>>, excludes: Excludes) -> ByteStream {
    stream::spawn_writer(DEPTH, move |w| {
        let mut tar = new_builder(w);
        let dir = Dir::open(&root).map_err(|e| Error::io(&root, e))?;
        let mut add = |rel: &RelPath, node: &mut HostNode| {
            append_host(&mut tar, rel, node, &root.join(rel.as_str()))
        };
        let mut walker = Walker {
            root: &dir,
            excludes: &excludes,
            read_files: true,
            visit: &mut add,
        };
        match only {
            None => {
                let top = dir.try_clone().map_err(|e| Error::io(&root, e))?;
                walker.children(top, None, None)?;
            }
            Some(paths) => {
                for p in paths {
                    if excludes.covers(&p) {
                        continue;
                    }
                    if let Some(node) = open_path(&dir, &p, true)? {
                        walker.node(&p, &p, node)?;
                    }
                }
            }
        }
        tar.finish().map_err(|e| Error::io("tar", e))?;
        Ok(())
    })
}

/// List the tree under `root` like [`crate::BoxHandle::list`] (sorted, excluding `root`),
/// beneath a handle on `root` without following symlinks.
pub fn list_dir(root: &Path) -> Result<Vec<TreeEntry>> {
    let dir = Dir::open(root).map_err(|e| Error::io(root, e))?;
    let mut out = Vec::new();
    let mut add = |rel: &RelPath, node: &mut HostNode| {
        let meta = node.meta();
        let (kind, size, link_target) = match node {
            HostNode::File { .. } => (EntryType::File, meta.size, None),
            HostNode::Dir { .. } => (EntryType::Dir, 0, None),
            HostNode::Symlink { target, .. } => (
                EntryType::Symlink,
                0,
                Some(target.to_string_lossy().into_owned()),
            ),
        };
        out.push(TreeEntry {
            path: rel.clone(),
            kind,
            size,
            mtime_ns: meta.mtime * 1_000_000_000 + meta.mtime_nsec,
            mode: meta.mode & 0o7777,
            inode: Some(meta.ino),
            link_target,
        });
        Ok(())
    };
    let mut walker = Walker {
        root: &dir,
        excludes: &Excludes::default(),
        read_files: false,
        visit: &mut add,
    };
    let top = dir.try_clone().map_err(|e| Error::io(root, e))?;
    walker.children(top, None, None)?;
    Ok(out)
}

/// What a walk records about an entry, read from the entry's own handle or with `fstatat`
/// relative to its parent's handle (not following a link).
#[derive(Debug, Clone, Copy)]
struct Meta {
    mode: u32,
    size: u64,
    mtime: i64,
    mtime_nsec: i64,
    ino: u64,
    uid: u32,
    gid: u32,
}

impl Meta {
    fn of(m: &fs::Metadata) -> Meta {
        Meta {
            mode: m.mode(),
            size: m.len(),
            mtime: m.mtime(),
            mtime_nsec: m.mtime_nsec(),
            ino: m.ino(),
            uid: m.uid(),
            gid: m.gid(),
        }
    }

    // `struct stat` field types differ between targets: some of these casts are no-ops here.
    #[allow(clippy::unnecessary_cast, clippy::useless_conversion)]
    fn of_stat(st: &rustix::fs::Stat) -> Meta {
        Meta {
            mode: st.st_mode as u32,
            size: st.st_size.max(0) as u64,
            mtime: st.st_mtime as i64,
            mtime_nsec: st.st_mtime_nsec as i64,
            ino: st.st_ino as u64,
            uid: st.st_uid as u32,
            gid: st.st_gid as u32,
        }
    }
}

/// One entry of a host tree, opened without following a symlink. Its metadata is read from
/// the handle itself, so what is described is what is read.
enum HostNode {
    /// A regular file; opened for reading when the walk reads files.
    File { meta: Meta, file: Option<fs::File> },
    /// A directory, with the handle its entries are listed from.
    Dir { meta: Meta, dir: Dir },
    /// A symlink and its target, never followed.
    Symlink { meta: Meta, target: PathBuf },
}

impl HostNode {
    fn meta(&self) -> Meta {
        match self {
            HostNode::File { meta, .. }
            | HostNode::Dir { meta, .. }
            | HostNode::Symlink { meta, .. } => *meta,
        }
    }
}

/// Whether an error while opening a walked entry means that it changed kind or went away since
/// it was listed (or looked at): the walk skips it, as a tree changing while it is read can
/// only be captured as of some moment per entry.
fn changed_under_us(e: &io::Error) -> bool {
    matches!(
        e.kind(),
        io::ErrorKind::NotFound | io::ErrorKind::NotADirectory | io::ErrorKind::InvalidInput
    ) || e.raw_os_error() == Some(Errno::LOOP.raw_os_error())
}

/// Open the entry `name` of `parent` (of kind `hint` as listed, or looked up now) without
/// following a symlink. `Ok(None)`: nothing to pack there (a fifo, socket or device), or the
/// entry changed kind since it was listed.
fn open_child(
    parent: &Dir,
    name: &str,
    hint: Option<Kind>,
    read_files: bool,
) -> io::Result<Option<HostNode>> {
    let kind = match hint {
        Some(k) => k,
        None => Kind::of_metadata(&parent.entry_metadata(name)?),
    };
    // One `fstatat` of the name, relative to the parent's handle and not following a link.
    let stat = || -> io::Result<(Kind, Meta)> {
        let st = rustix::fs::statat(parent, name, AtFlags::SYMLINK_NOFOLLOW)?;
        let kind = match rustix::fs::FileType::from_raw_mode(st.st_mode) {
            rustix::fs::FileType::RegularFile => Kind::File,
            rustix::fs::FileType::Symlink => Kind::Symlink,
            _ => Kind::Other,
        };
        Ok((kind, Meta::of_stat(&st)))
    };
    let node = match kind {
        Kind::Dir => {
            let dir = parent.open_subdir(name)?;
            HostNode::Dir {
                meta: Meta::of(&dir.stat()?),
                dir,
            }
        }
        Kind::File if read_files => {
            let file = parent.open_entry(name)?;
            let meta = file.metadata()?;
            if !meta.is_file() {
                return Ok(None);
            }
            HostNode::File {
                meta: Meta::of(&meta),
                file: Some(file),
            }
        }
        Kind::File => match stat()? {
            (Kind::File, meta) => HostNode::File { meta, file: None },
            _ => return Ok(None),
        },
        Kind::Symlink => match stat()? {
            (Kind::Symlink, meta) => HostNode::Symlink {
                meta,
                target: parent.read_link(name)?,
            },
            _ => return Ok(None),
        },
        Kind::Other => return Ok(None),
    };
    Ok(Some(node))
}

/// [`open_child`] for a path below `root`: its parents are resolved beneath `root` without
/// following a symlink (one on the way is [`Error::PathEscape`]); a missing path is `None`.
fn open_path(root: &Dir, path: &RelPath, read_files: bool) -> Result<Option<HostNode>> {
    let opened = root
        .parent_of(path, Follow::Never, false)
        .and_then(|(parent, name)| open_child(&parent, name, None, read_files));
    match opened {
        Ok(node) => Ok(node),
        Err(e) if beneath::refusal(&e).is_some() => Err(Error::path_escape(
            path.as_str(),
            "passes through a symlink (not followed when packing)",
        )),
        Err(e) if changed_under_us(&e) => Ok(None),
        Err(e) => Err(Error::io(root.shown().join(path.as_str()), e)),
    }
}

/// Open a caller-given host path for [`PackSource::HostTree`]: the path up to its last
/// component is the caller's and resolved normally; the last component is not followed (a
/// link there is packed as a link).
fn open_host_top(host: &Path) -> Result<HostNode> {
    let ctx = |e| Error::io(host, e);
    let fd = rustix::fs::open(
        host,
        OFlags::PATH | OFlags::NOFOLLOW | OFlags::CLOEXEC,
        Mode::empty(),
    )
    .map_err(|e| ctx(e.into()))?;
    let meta = fs::File::from(fd).metadata().map_err(ctx)?;
    let node = match Kind::of_metadata(&meta) {
        Kind::Dir => {
            let dir = Dir::open(host).map_err(ctx)?;
            HostNode::Dir {
                meta: Meta::of(&dir.stat().map_err(ctx)?),
                dir,
            }
        }
        Kind::File => open_host_file(host)?,
        Kind::Symlink => HostNode::Symlink {
            meta: Meta::of(&meta),
            target: fs::read_link(host).map_err(ctx)?,
        },
        Kind::Other => {
            return Err(Error::invalid(
                "host path",
                format!("`{}` is not a file, directory or symlink", host.display()),
            ));
        }
    };
    Ok(node)
}

/// Open a caller-given host file for reading, not following a symlink at its last component
/// (projection packs plain files only), with its metadata from the opened handle.
fn open_host_file(host: &Path) -> Result<HostNode> {
    let ctx = |e| Error::io(host, e);
    let fd = rustix::fs::open(
        host,
        OFlags::RDONLY | OFlags::NOFOLLOW | OFlags::NONBLOCK | OFlags::NOCTTY | OFlags::CLOEXEC,
        Mode::empty(),
    )
    .map_err(|e| ctx(e.into()))?;
    let file = fs::File::from(fd);
    let meta = file.metadata().map_err(ctx)?;
    if !meta.is_file() {
        return Err(Error::invalid(
            "host file",
            format!("`{}` is not a regular file", host.display()),
        ));
    }
    Ok(HostNode::File {
        meta: Meta::of(&meta),
        file: Some(file),
    })
}

type Visit<'a> = dyn FnMut(&RelPath, &mut HostNode) -> Result<()> + 'a;

/// Directory handles a walk holds at once. Deeper down, a directory's handle is closed while
/// its subdirectories are walked and re-opened beneath the walk's root afterwards, so a very
/// deep tree cannot exhaust file descriptors.
const HELD_DIRS: usize = 64;

/// A walk of a host tree beneath `root`, in sorted order (parents before children), not
/// following symlinks, skipping excluded paths with their subtrees and non-UTF-8 names.
struct Walker<'w, 'v> {
    root: &'w Dir,
    excludes: &'w Excludes,
    read_files: bool,
    visit: &'w mut Visit<'v>,
}

impl Walker<'_, '_> {
    /// Visit `node`, named `rel` in the output and found at `at` beneath the root, and its
    /// subtree.
    fn node(&mut self, rel: &RelPath, at: &RelPath, mut node: HostNode) -> Result<()> {
        (self.visit)(rel, &mut node)?;
        if let HostNode::Dir { dir, .. } = node {
            self.children(dir, Some(at), Some(rel))?;
        }
        Ok(())
    }

    /// Visit the entries of `dir` (at `at` beneath the root, `None` for the root itself; named
    /// `rel` in the output, `None` for the top) and their subtrees.
    fn children(&mut self, dir: Dir, at: Option<&RelPath>, rel: Option<&RelPath>) -> Result<()> {
        let depth = at.map_or(0, |a| a.components().count());
        let mut entries = dir.entries().map_err(|e| Error::io(dir.shown(), e))?;
        entries.sort_by(|a, b| a.name.cmp(&b.name));
        let mut held = Some(dir);
        for entry in entries {
            let Some(name) = entry.name.to_str() else {
                tracing::warn!(dir = ?at, "skipping a non-UTF-8 file name");
                continue;
            };
            let child_rel = match rel {
                Some(r) => r.join(name)?,
                None => RelPath::new(name)?,
            };
            if self.excludes.matches(&child_rel) {
                continue;
            }
            let child_at = match at {
                Some(a) => a.join(name)?,
                None => RelPath::new(name)?,
            };
            let parent = match held {
                Some(ref d) => d,
                None => {
                    let at = at.expect("only directories below the root are closed");
                    match self.root.open_dir(at, Follow::Never) {
                        Ok(d) => &*held.insert(d),
                        // The directory went away (or became a link) while walking below it.
                        Err(e) if changed_under_us(&e) || beneath::refusal(&e).is_some() => {
                            return Ok(());
                        }
                        Err(e) => return Err(Error::io(self.root.shown().join(at.as_str()), e)),
                    }
                }
            };
            let node = match open_child(parent, name, Some(entry.kind), self.read_files) {
                Ok(Some(node)) => node,
                Ok(None) => continue,
                Err(e) if changed_under_us(&e) => continue,
                Err(e) => return Err(Error::io(parent.shown().join(name), e)),
            };
            if matches!(node, HostNode::Dir { .. }) && depth >= HELD_DIRS {
                held = None;
            }
            self.node(&child_rel, &child_at, node)?;
        }
        Ok(())
    }
}

fn new_builder<W: Write>(w: W) -> tar::Builder<W> {
    let mut tar = tar::Builder::new(w);
    tar.follow_symlinks(false);
    tar
}

fn header(kind: tar::EntryType, mode: u32, mtime: u64, size: u64) -> tar::Header {
    let mut h = tar::Header::new_gnu();
    h.set_entry_type(kind);
    h.set_mode(mode & 0o7777);
    h.set_mtime(mtime);
    h.set_size(size);
    h.set_uid(0);
    h.set_gid(0);
    h
}

/// Append one walked entry; `shown` is its host path, for error messages.
fn append_host<W: Write>(
    tar: &mut tar::Builder<W>,
    rel: &RelPath,
    node: &mut HostNode,
    shown: &Path,
) -> Result<()> {
    let ctx = |e| Error::io(shown, e);
    let meta = node.meta();
    let mtime = meta.mtime.max(0) as u64;
    let owned = |kind, mode, size| {
        let mut h = header(kind, mode, mtime, size);
        h.set_uid(meta.uid.into());
        h.set_gid(meta.gid.into());
        h
    };
    match node {
        HostNode::File { file, .. } => {
            let file = file.as_mut().expect("files are opened when packing");
            let mut h = owned(tar::EntryType::Regular, meta.mode, meta.size);
            // A file that shrinks while being read would corrupt the archive: read exactly
            // the size in the header, padding with zeros if it shrank.
            let reader = file.take(meta.size).chain(io::repeat(0)).take(meta.size);
            tar.append_data(&mut h, rel.as_str(), reader).map_err(ctx)
        }
        HostNode::Dir { .. } => {
            let mut h = owned(tar::EntryType::Directory, meta.mode, 0);
            tar.append_data(&mut h, rel.as_str(), io::empty())
                .map_err(ctx)
        }
        HostNode::Symlink { target, .. } => {
            let mut h = owned(tar::EntryType::Symlink, 0o777, 0);
            tar.append_link(&mut h, rel.as_str(), &*target).map_err(ctx)
        }
    }
}

fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// A validated archive entry.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Checked {
    /// Regular file of `size` bytes.
    File {
        /// Path.
        path: RelPath,
        /// Size.
        size: u64,
    },
    /// Directory.
    Dir {
        /// Path.
        path: RelPath,
    },
    /// Symbolic link.
    Symlink {
        /// Path.
        path: RelPath,
        /// Target, verbatim.
        target: String,
    },
    /// Hard link to an earlier file of the archive.
    HardLink {
        /// Path.
        path: RelPath,
        /// The earlier file.
        target: RelPath,
    },
}

impl Checked {
    /// The entry's path.
    pub fn path(&self) -> &RelPath {
        match self {
            Checked::File { path, .. }
            | Checked::Dir { path }
            | Checked::Symlink { path, .. }
            | Checked::HardLink { path, .. } => path,
        }
    }
}

/// What the archive has created at a path so far, as far as the [`Validator`] knows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Node {
    /// A directory created only because entries lie under it (`a` for an entry `a/b`).
    ImplicitDir,
    /// A directory entry.
    Dir,
    /// A regular file or a hard link to one.
    File,
    /// A symbolic link.
    Symlink,
}

/// Applies the safety rules to a sequence of entry headers. One per archive.
///
/// It keeps a model of the tree the archive builds, implicit parents included: an entry
/// `a/b/c` creates the directories `a` and `a/b` as surely as entries for them would. An entry
/// may add to that tree but never replace or pass through what is already in it as another
/// kind: no symlink, file or hard link where the archive made a directory (explicitly or
/// not), nothing under a symlink or file of the archive, each explicit path once. So every
/// path the archive uses later (a hard link's source, a directory whose mode is applied at
/// the end) still names what the archive put there.
#[derive(Debug)]
pub struct Validator {
    policy: ArchivePolicy,
    /// Every path the archive created, implicit parents included, keyed by a 128-bit BLAKE3
    /// prefix of the path (a crafted collision is out of reach, and memory stays a few dozen
    /// bytes per path).
    tree: HashMap<u128, Node>,
    /// Entries plus implicitly created directories, against [`ArchivePolicy::max_entries`].
    entries: u64,
    total: u64,
}

fn key(path: &str) -> u128 {
    let hash = blake3::hash(path.as_bytes());
    let mut k = [0u8; 16];
    k.copy_from_slice(&hash.as_bytes()[..16]);
    u128::from_le_bytes(k)
}

/// Refuse a header whose name, prefix or link name field carries bytes after its first NUL:
/// readers stop at the NUL, so the name would be something other than what the header holds
/// (`ok\0/../../x` reads as `ok`). Trailing NUL padding is fine.
fn check_name_fields(header: &tar::Header) -> std::result::Result<(), &'static str> {
    fn cut_short(field: &[u8]) -> bool {
        field
            .iter()
            .position(|&b| b == 0)
            .is_some_and(|nul| field[nul..].iter().any(|&b| b != 0))
    }
    let old = header.as_old();
    if cut_short(&old.name) {
        return Err("the header's name field holds bytes after a NUL byte");
    }
    if cut_short(&old.linkname) {
        return Err("the header's link name field holds bytes after a NUL byte");
    }
    // Only POSIX ustar has a prefix field; GNU headers keep other data at that offset.
    if let Some(ustar) = header.as_ustar()
        && cut_short(&ustar.prefix)
    {
        return Err("the header's name prefix field holds bytes after a NUL byte");
    }
    Ok(())
}

impl Validator {
    /// A validator for one archive.
    pub fn new(policy: ArchivePolicy) -> Self {
        Validator {
            policy,
            tree: HashMap::new(),
            entries: 0,
            total: 0,
        }
    }

    /// Check one entry. `Ok(None)` for entries that carry no file (the root `./`, pax global
    /// headers).
    pub fn check<R: Read>(&mut self, entry: &tar::Entry<'_, R>) -> Result<Option<Checked>> {
        let raw = entry.path_bytes();
        let shown = String::from_utf8_lossy(&raw).into_owned();
        let refuse = |reason: &str| Err(Error::unsafe_archive(shown.clone(), reason));
        let kind = entry.header().entry_type();
        if matches!(kind, tar::EntryType::XGlobalHeader) {
            return Ok(None);
        }
        self.entries += 1;
        if self.entries > self.policy.max_entries {
            return refuse(&format!("more than {} entries", self.policy.max_entries));
        }
        if let Err(reason) = check_name_fields(entry.header()) {
            return refuse(reason);
        }
        let Ok(text) = std::str::from_utf8(&raw) else {
            return refuse("path is not UTF-8");
        };
        if text.starts_with('/') {
            return refuse("absolute path");
        }
        let trimmed = text.trim_start_matches("./");
        if trimmed.is_empty() || trimmed == "." {
            return if kind.is_dir() {
                Ok(None)
            } else {
                refuse("entry names the root")
            };
        }
        let path = match RelPath::new(trimmed) {
            Ok(p) => p,
            Err(Error::PathEscape { reason, .. }) => return refuse(&reason),
            Err(e) => return Err(e),
        };
        // The parents: real directories of the archive, or new (implicit) ones. Walking up
        // stops at the first known directory, whose own parents are known directories too.
        let mut implicit = Vec::new();
        let mut rest = path.as_str();
        while let Some((parent, _)) = rest.rsplit_once('/') {
            let k = key(parent);
            match self.tree.get(&k) {
                Some(Node::Dir | Node::ImplicitDir) => break,
                Some(Node::Symlink) => {
                    return refuse(&format!(
                        "lies under the symlink `{parent}` of the same archive"
                    ));
                }
                Some(Node::File) => return refuse(&format!("lies under the file `{parent}`")),
                None => implicit.push(k),
            }
            rest = parent;
        }
        let checked = match kind {
            tar::EntryType::Regular | tar::EntryType::Continuous => {
                let size = entry.size();
                self.total = self.total.saturating_add(size);
                if self.total > self.policy.max_total_bytes {
                    return refuse(&format!(
                        "archive exceeds {} bytes",
                        self.policy.max_total_bytes
                    ));
                }
                Checked::File { path, size }
            }
            tar::EntryType::Directory => Checked::Dir { path },
            tar::EntryType::Symlink => {
                let Some(target) = entry.link_name_bytes() else {
                    return refuse("symlink without a target");
                };
                let Ok(target) = String::from_utf8(target.into_owned()) else {
                    return refuse("symlink target is not UTF-8");
                };
                if target.is_empty() {
                    return refuse("empty symlink target");
                }
                if target.contains('\0') {
                    return refuse("symlink target contains a NUL byte");
                }
                if self.policy.strict_symlinks && !link_stays_inside(&path, &target) {
                    return refuse(&format!(
                        "symlink to `{target}` leads outside the root (strict mode)"
                    ));
                }
                Checked::Symlink { path, target }
            }
            tar::EntryType::Link => {
                let Some(target) = entry.link_name_bytes() else {
                    return refuse("hard link without a target");
                };
                let target = String::from_utf8_lossy(&target).into_owned();
                let target = match RelPath::new(target.trim_start_matches("./")) {
                    Ok(t) if !target.starts_with('/') => t,
                    _ => {
                        return refuse(&format!(
                            "hard link to `{target}` outside the archive root"
                        ));
                    }
                };
                // A file of the model has only directories of the model above it, and those
                // are never replaced: the source path still leads to that file.
                if self.tree.get(&key(target.as_str())) != Some(&Node::File) {
                    return refuse(&format!(
                        "hard link to `{target}`, which is not an earlier file of the archive"
                    ));
                }
                Checked::HardLink { path, target }
            }
            tar::EntryType::Char | tar::EntryType::Block => return refuse("device node"),
            tar::EntryType::Fifo => return refuse("fifo"),
            other => return refuse(&format!("unsupported entry type {other:?}")),
        };
        let node = match &checked {
            Checked::File { .. } | Checked::HardLink { .. } => Node::File,
            Checked::Dir { .. } => Node::Dir,
            Checked::Symlink { .. } => Node::Symlink,
        };
        let k = key(checked.path().as_str());
        match (self.tree.get(&k), node) {
            (None, _) | (Some(Node::ImplicitDir), Node::Dir) => {}
            (Some(Node::ImplicitDir), _) => {
                return refuse(&format!(
                    "would replace the directory `{}` that earlier entries of the archive \
                     lie in",
                    checked.path()
                ));
            }
            (Some(_), _) => return refuse("duplicate entry"),
        }
        // Implicit directories are created like entries, so they count like entries.
        self.entries += implicit.len() as u64;
        if self.entries > self.policy.max_entries {
            return refuse(&format!(
                "more than {} entries (counting implicit parent directories)",
                self.policy.max_entries
            ));
        }
        self.tree
            .extend(implicit.into_iter().map(|k| (k, Node::ImplicitDir)));
        self.tree.insert(k, node);
        Ok(Some(checked))
    }
}

/// Whether a link at `path` pointing to `target` resolves (lexically) inside the root.
pub fn link_stays_inside(path: &RelPath, target: &str) -> bool {
    if target.starts_with('/') {
        return false;
    }
    let mut depth: i64 = path.components().count() as i64 - 1;
    for part in target.split('/') {
        match part {
            "" | "." => {}
            ".." => {
                depth -= 1;
                if depth < 0 {
                    return false;
                }
            }
            _ => depth += 1,
        }
    }
    true
}

/// Header fields of a re-emitted entry.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EmitMeta {
    /// Permission bits (set-id bits are dropped on emit).
    pub mode: u32,
    /// Modification time, seconds since the epoch.
    pub mtime: u64,
    /// Owner.
    pub uid: u64,
    /// Group.
    pub gid: u64,
}

impl EmitMeta {
    /// The fields as the input header has them.
    pub fn of(header: &tar::Header) -> Self {
        EmitMeta {
            mode: header.mode().unwrap_or(0o644),
            mtime: header.mtime().unwrap_or(0),
            uid: header.uid().unwrap_or(0),
            gid: header.gid().unwrap_or(0),
        }
    }
}

/// Callbacks of [`rewrite`].
pub trait RewriteHooks {
    /// A validated entry is about to be emitted; return its header fields (or refuse it).
    fn before(&mut self, entry: &Checked, header: &tar::Header) -> Result<EmitMeta> {
        let _ = entry;
        Ok(EmitMeta::of(header))
    }

    /// The entry was emitted; for files, with the BLAKE3 and length of the content (when
    /// [`hash_files`](Self::hash_files) is on).
    fn after(&mut self, entry: &Checked, content: Option<(blake3::Hash, u64)>) -> Result<()> {
        let _ = (entry, content);
        Ok(())
    }

    /// The whole input was read without error; a last chance to refuse it.
    fn finish(&mut self) -> Result<()> {
        Ok(())
    }

    /// Whether file contents are hashed on the way through.
    fn hash_files(&self) -> bool {
        false
    }
}

struct NoHooks;
impl RewriteHooks for NoHooks {}

/// A reader that feeds a BLAKE3 hasher and counts.
struct HashingReader<R> {
    inner: R,
    hasher: Option<blake3::Hasher>,
    n: u64,
}

impl<R: Read> Read for HashingReader<R> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let n = self.inner.read(buf)?;
        if let Some(h) = self.hasher.as_mut() {
            h.update(&buf[..n]);
        }
        self.n += n as u64;
        Ok(n)
    }
}

/// Read an untrusted tar from `input`, validate every entry ([`Validator`]) and write it
/// canonically to `out`: GNU headers, relative paths, permission bits only (set-id bits
/// dropped), no pax or global headers. `hooks` see (and may refuse) each entry. The input is
/// read to its end (so wrappers that verify a digest see all of it).
pub fn rewrite<R: Read, W: Write>(
    input: &mut R,
    out: W,
    policy: ArchivePolicy,
    hooks: &mut dyn RewriteHooks,
) -> Result<W> {
    let mut out = new_builder(out);
    walk_archive(input, Some(&mut out), policy, hooks)?;
    out.into_inner().map_err(|e| Error::io("tar", e))
}

/// Read a tar from `input` with the same validation and hooks as [`rewrite`], without
/// re-emitting it: for archives that are stored as they come and only need inspecting (and
/// hashing) on the side. Reads `input` to its end.
pub fn inspect<R: Read>(
    input: &mut R,
    policy: ArchivePolicy,
    hooks: &mut dyn RewriteHooks,
) -> Result<()> {
    walk_archive::<R, io::Sink>(input, None, policy, hooks)
}

/// The loop of [`rewrite`] and [`inspect`]: validate, call the hooks, emit when asked.
fn walk_archive<R: Read, W: Write>(
    input: &mut R,
    mut out: Option<&mut tar::Builder<W>>,
    policy: ArchivePolicy,
    hooks: &mut dyn RewriteHooks,
) -> Result<()> {
    for_each_entry(input, policy, |checked, entry| {
        let meta = hooks.before(&checked, entry.header())?;
        let hash = hooks.hash_files();
        let content = match out.as_deref_mut() {
            Some(out) => emit(out, &checked, meta, entry, hash)?,
            None if hash && matches!(checked, Checked::File { .. }) => {
                let mut hasher = blake3::Hasher::new();
                let n = io::copy(entry, &mut hasher)
                    .map_err(|e| corrupt(checked.path().as_str(), e))?;
                Some((hasher.finalize(), n))
            }
            None => None,
        };
        hooks.after(&checked, content)
    })?;
    hooks.finish()
}

/// Call `f` with every validated entry of the tar in `input`, then read `input` to its end.
fn for_each_entry<R: Read>(
    input: &mut R,
    policy: ArchivePolicy,
    mut f: impl FnMut(Checked, &mut tar::Entry<'_, &mut R>) -> Result<()>,
) -> Result<()> {
    let mut validator = Validator::new(policy);
    {
        let mut archive = tar::Archive::new(&mut *input);
        let entries = archive
            .entries()
            .map_err(|e| corrupt("reading the archive", e))?;
        for entry in entries {
            let mut entry = entry.map_err(|e| corrupt("reading an entry", e))?;
            if let Some(checked) = validator.check(&entry)? {
                f(checked, &mut entry)?;
            }
        }
    }
    io::copy(input, &mut io::sink()).map_err(|e| corrupt("reading the archive's end", e))?;
    Ok(())
}

/// Write one validated entry canonically; for files, hash the content on the way if asked.
fn emit<W: Write, R: Read>(
    out: &mut tar::Builder<W>,
    checked: &Checked,
    meta: EmitMeta,
    content: &mut R,
    hash: bool,
) -> Result<Option<(blake3::Hash, u64)>> {
    let mode = meta.mode & 0o1777;
    let mut hashed = None;
    let owned = |kind, mode, size| {
        let mut h = header(kind, mode, meta.mtime, size);
        h.set_uid(meta.uid);
        h.set_gid(meta.gid);
        h
    };
    let res = match checked {
        Checked::File { path, size } => {
            let mut h = owned(tar::EntryType::Regular, mode, *size);
            let mut reader = HashingReader {
                inner: content,
                hasher: hash.then(blake3::Hasher::new),
                n: 0,
            };
            let r = out.append_data(&mut h, path.as_str(), &mut reader);
            if let Some(hasher) = reader.hasher.take() {
                hashed = Some((hasher.finalize(), reader.n));
            }
            r
        }
        Checked::Dir { path } => out.append_data(
            &mut owned(tar::EntryType::Directory, mode, 0),
            path.as_str(),
            io::empty(),
        ),
        Checked::Symlink { path, target } => out.append_link(
            &mut owned(tar::EntryType::Symlink, 0o777, 0),
            path.as_str(),
            target,
        ),
        Checked::HardLink { path, target } => out.append_link(
            &mut header(tar::EntryType::Link, mode, meta.mtime, 0),
            path.as_str(),
            target.as_str(),
        ),
    };
    res.map_err(|e| corrupt(checked.path().as_str(), e))?;
    Ok(hashed)
}

/// Validate an untrusted tar stream and re-emit it canonically (see [`rewrite`]). The output
/// ends with an error at the first violation, so a consumer that stages before swapping never
/// applies a bad archive.
pub fn sanitize(input: ByteStream, policy: ArchivePolicy) -> ByteStream {
    rewrite_stream(input, policy, NoHooks)
}

/// [`rewrite`] on a stream, on a blocking thread; `hooks` travel with it.
pub fn rewrite_stream<H: RewriteHooks + Send + 'static>(
    input: ByteStream,
    policy: ArchivePolicy,
    mut hooks: H,
) -> ByteStream {
    stream::spawn_writer(DEPTH, move |w| {
        let mut reader = stream::blocking_reader(input);
        rewrite(&mut reader, w, policy, &mut hooks)?;
        Ok(())
    })
}

fn corrupt(at: &str, e: io::Error) -> Error {
    // Errors of ours that travelled through the reader (a failed digest, a dropped connection)
    // come back as themselves.
    match Error::from(e) {
        Error::Io { source, .. } => {
            Error::unsafe_archive(at, format!("corrupt or truncated archive: {source}"))
        }
        ours => ours,
    }
}

/// What [`extract_to_dir`] wrote.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ExtractStats {
    /// Entries written.
    pub entries: u64,
    /// File bytes written.
    pub bytes: u64,
}

/// Extract an untrusted tar stream into the existing directory `dest`, validating every entry
/// (see the module docs) and never following a symlink: everything is created through
/// directory handles opened beneath `dest` without following links, and an existing file or
/// link at an entry's path is replaced, not written through.
///
/// On error, `dest` may hold a prefix of the archive: extract into a staging directory when
/// the live tree must stay intact.
pub async fn extract_to_dir(
    input: ByteStream,
    dest: PathBuf,
    policy: ArchivePolicy,
) -> Result<ExtractStats> {
    tokio::task::spawn_blocking(move || {
        let reader = stream::blocking_reader(input);
        extract_blocking(reader, &dest, policy)
    })
    .await
    .map_err(|e| Error::backend("local", "extract", e.to_string()))?
}

/// The blocking core of [`extract_to_dir`].
pub fn extract_blocking<R: Read>(
    mut reader: R,
    dest: &Path,
    policy: ArchivePolicy,
) -> Result<ExtractStats> {
    let root = Dir::open(dest).map_err(|e| Error::io(dest, e))?;
    let mut out = Extractor {
        root: &root,
        parent: None,
        dirs: Vec::new(),
        stats: ExtractStats::default(),
    };
    for_each_entry(&mut reader, policy, |checked, entry| {
        out.entry(&checked, entry)
    })?;
    out.apply_dir_modes();
    Ok(out.stats)
}

/// Writes validated entries beneath one destination handle. No path is ever resolved from
/// `/` again: parents are opened (or created) beneath the destination without following a
/// link, and everything else is relative to those handles.
struct Extractor<'a> {
    root: &'a Dir,
    /// The parent directory of the last entry and its path (`None`: the destination itself),
    /// kept because consecutive entries mostly share one.
    parent: Option<(Option<RelPath>, Dir)>,
    /// Directory entries with their modes and mtimes, applied at the end.
    dirs: Vec<(RelPath, u32, u64)>,
    stats: ExtractStats,
}

impl Extractor<'_> {
    fn entry<R: Read>(&mut self, checked: &Checked, entry: &mut tar::Entry<'_, R>) -> Result<()> {
        let mode = entry.header().mode().unwrap_or(0o644) & 0o1777;
        let mtime = entry.header().mtime().unwrap_or(0);
        let path = checked.path();
        let root = self.root;
        let parent = parent_handle(root, &mut self.parent, path)?;
        let name = path.file_name();
        let on_disk = |e| disk_error(root, path, e);
        match checked {
            Checked::File { .. } => {
                let mut file = create_replacing_in(parent, name).map_err(on_disk)?;
                let n = io::copy(entry, &mut file).map_err(|e| corrupt(path.as_str(), e))?;
                file.set_permissions(fs::Permissions::from_mode(mode))
                    .map_err(on_disk)?;
                let _ = file.set_modified(UNIX_EPOCH + Duration::from_secs(mtime));
                self.stats.bytes += n;
            }
            Checked::Dir { .. } => {
                match parent.entry_metadata(name) {
                    Ok(m) if m.is_dir() => {}
                    Ok(_) => {
                        parent.remove_all(name).map_err(on_disk)?;
                        parent.create_subdir(name, 0o755).map_err(on_disk)?;
                    }
                    Err(e) if e.kind() == io::ErrorKind::NotFound => {
                        parent.create_subdir(name, 0o755).map_err(on_disk)?;
                    }
                    Err(e) => return Err(on_disk(e)),
                }
                self.dirs.push((path.clone(), mode, mtime));
            }
            Checked::Symlink { target, .. } => {
                parent.remove_all(name).map_err(on_disk)?;
                parent.symlink(target, name).map_err(on_disk)?;
            }
            Checked::HardLink { target, .. } => {
                // The source is found beneath the destination without following any link (the
                // validator guarantees the archive made it a file; this guards against the
                // destination changing meanwhile), then linked by handle and name.
                let not_a_file = || {
                    Error::unsafe_archive(path.as_str(), "hard link target is not a regular file")
                };
                let (src_dir, src_name) = match root.parent_of(target, Follow::Never, false) {
                    Ok(found) => found,
                    Err(e) if beneath::refusal(&e).is_some() => {
                        return Err(Error::unsafe_archive(
                            path.as_str(),
                            format!("hard link source `{target}` lies behind a symlink"),
                        ));
                    }
                    Err(e) if changed_under_us(&e) => return Err(not_a_file()),
                    Err(e) => return Err(on_disk(e)),
                };
                match src_dir.entry_metadata(src_name) {
                    Ok(m) if m.is_file() => {}
                    _ => return Err(not_a_file()),
                }
                parent.remove_all(name).map_err(on_disk)?;
                src_dir.hard_link(src_name, parent, name).map_err(on_disk)?;
            }
        }
        self.stats.entries += 1;
        Ok(())
    }

    /// Directory modes last (a read-only directory must not block its own children), deepest
    /// first so that mtimes are not disturbed afterwards. Each directory is re-opened beneath
    /// the destination without following links and changed through its handle: one replaced
    /// by a link meanwhile is skipped, never followed.
    fn apply_dir_modes(&self) {
        for (path, mode, mtime) in self.dirs.iter().rev() {
            match self.root.open_dir(path, Follow::Never) {
                Ok(dir) => {
                    let mtime = UNIX_EPOCH + Duration::from_secs(*mtime);
                    let _ = dir.set_mode_and_mtime(mode | 0o700, Some(mtime));
                }
                Err(e) => {
                    tracing::debug!(%path, error = %e, "directory gone before its mode was set")
                }
            }
        }
    }
}

/// The directory that `path` goes in, opened (and created with missing parents) beneath
/// `root` without following a symlink; reuses `cached` when it is that directory.
fn parent_handle<'c>(
    root: &Dir,
    cached: &'c mut Option<(Option<RelPath>, Dir)>,
    path: &RelPath,
) -> Result<&'c Dir> {
    let want = path.parent();
    if !matches!(cached, Some((have, _)) if *have == want) {
        let dir = match &want {
            None => root.try_clone(),
            Some(p) => root.create_dir_all(p, Follow::Never),
        }
        .map_err(|e| disk_error(root, path, e))?;
        *cached = Some((want, dir));
    }
    Ok(&cached.as_ref().expect("set above").1)
}

/// An I/O error while writing `path` beneath `root`: refusals by the resolution rules (a link
/// or a non-directory on the way) are [`Error::UnsafeArchive`].
fn disk_error(root: &Dir, path: &RelPath, e: io::Error) -> Error {
    if let Some(why) = beneath::refusal(&e) {
        Error::unsafe_archive(
            path.as_str(),
            format!("would write through the symlink on its way in the destination ({why})"),
        )
    } else if e.kind() == io::ErrorKind::NotADirectory {
        Error::unsafe_archive(
            path.as_str(),
            "a parent in the destination is not a directory",
        )
    } else {
        Error::io(root.shown().join(path.as_str()), e)
    }
}

/// Create the file `name` in `dir` for writing (mode 0600 until the caller sets its own); an
/// existing file, link or directory there is removed first, never followed.
fn create_replacing_in(dir: &Dir, name: &str) -> io::Result<fs::File> {
    match dir.create_new(name, 0o600) {
        Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {
            dir.remove_all(name)?;
            dir.create_new(name, 0o600)
        }
        r => r,
    }
}

/// Create the parents of `path` under `root` as real directories, refusing to pass through a
/// symlink or a file ([`Error::UnsafeArchive`]). Returns the absolute path of `path`.
///
/// The parents are created through handles beneath `root`, but the returned path is a path:
/// whoever opens it resolves it again. New code should keep the handle instead
/// ([`Dir::parent_of`] with [`Follow::Never`]).
pub fn ensure_parents(root: &Path, path: &RelPath) -> Result<PathBuf> {
    if let Some(parent) = path.parent() {
        let dir = Dir::open(root).map_err(|e| Error::io(root, e))?;
        dir.create_dir_all(&parent, Follow::Never)
            .map_err(|e| disk_error(&dir, path, e))?;
    }
    Ok(path.to_host(root))
}

/// Open `abs` for writing as a new file; an existing file, link or directory there is removed
/// first (never followed). The parent of `abs` is the caller's and resolved normally.
pub fn create_replacing(abs: &Path) -> Result<fs::File> {
    let (Some(parent), Some(name)) = (abs.parent(), abs.file_name().and_then(|n| n.to_str()))
    else {
        return Err(Error::invalid(
            "file path",
            format!("`{}` has no UTF-8 file name", abs.display()),
        ));
    };
    let parent = if parent.as_os_str().is_empty() {
        Path::new(".")
    } else {
        parent
    };
    let dir = Dir::open(parent).map_err(|e| Error::io(parent, e))?;
    create_replacing_in(&dir, name).map_err(|e| Error::io(abs, e))
}

#[cfg(test)]
mod tests;
