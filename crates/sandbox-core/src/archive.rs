//! The tar codec: packing host trees and in-memory sources into streams, validating untrusted
//! archives, and extracting them without ever following a symlink.
//!
//! Safety rules applied to every archive read ([`ArchivePolicy`]):
//! - paths are relative, UTF-8, without NUL and without `..` (a leading `./` is accepted);
//! - no entry lies under a symlink or a regular file of the same archive (so nothing is written
//!   through a link the archive planted);
//! - hard links point to a regular file earlier in the same archive;
//! - device nodes, fifos and unknown entry types are refused;
//! - each path appears once; entry count and total size are bounded;
//! - symlinks are kept as links whatever they point at (a venv's `python -> /usr/bin/python3`
//!   must survive), unless [`ArchivePolicy::strict_symlinks`] is set, which refuses links
//!   that lead outside the root.
//!
//! Extraction additionally refuses to pass through any symlink already present in the
//! destination (checked with `lstat` on every component).

use std::collections::{HashMap, HashSet};
use std::fs;
use std::hash::{Hash, Hasher};
use std::io::{self, Read, Write};
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use globset::{Glob, GlobSet, GlobSetBuilder};
use serde::{Deserialize, Serialize};

use crate::backend::{EntryType, TreeEntry};
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
    /// Most entries accepted. Default 1,000,000.
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
    /// A host file (regular files only; its mode is kept).
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
                    let meta = fs::metadata(&host).map_err(|e| Error::io(&host, e))?;
                    append_host(&mut tar, &path, &host, &meta)?;
                }
                PackSource::HostTree(host) => {
                    walk(&host, &path, &Excludes::default(), &mut |rel, abs, meta| {
                        append_host(&mut tar, rel, abs, meta)
                    })?;
                }
            }
        }
        tar.finish().map_err(|e| Error::io("tar", e))?;
        Ok(())
    })
}

/// Pack the tree under `root` (not `root` itself) with workspace-relative names, skipping
/// `excludes`, sockets and devices. Symlinks are packed as links.
pub fn pack_dir(root: PathBuf, only: Option<Vec<RelPath>>, excludes: Excludes) -> ByteStream {
    stream::spawn_writer(DEPTH, move |w| {
        let mut tar = new_builder(w);
        let mut add =
            |rel: &RelPath, abs: &Path, meta: &fs::Metadata| append_host(&mut tar, rel, abs, meta);
        match only {
            None => walk_children(&root, None, &excludes, &mut add)?,
            Some(paths) => {
                for p in paths {
                    let abs = p.to_host(&root);
                    match fs::symlink_metadata(&abs) {
                        Ok(meta) if !excludes.covers(&p) => {
                            add(&p, &abs, &meta)?;
                            if meta.is_dir() {
                                walk_children(&abs, Some(&p), &excludes, &mut add)?;
                            }
                        }
                        Ok(_) => {}
                        Err(e) if e.kind() == io::ErrorKind::NotFound => {}
                        Err(e) => return Err(Error::io(&abs, e)),
                    }
                }
            }
        }
        tar.finish().map_err(|e| Error::io("tar", e))?;
        Ok(())
    })
}

/// List the tree under `root` like [`crate::BoxHandle::list`] (sorted, excluding `root`).
pub fn list_dir(root: &Path) -> Result<Vec<TreeEntry>> {
    let mut out = Vec::new();
    walk_children(root, None, &Excludes::default(), &mut |rel, abs, meta| {
        let kind = entry_type(meta);
        let link_target = if kind == EntryType::Symlink {
            Some(
                fs::read_link(abs)
                    .map_err(|e| Error::io(abs, e))?
                    .to_string_lossy()
                    .into_owned(),
            )
        } else {
            None
        };
        out.push(TreeEntry {
            path: rel.clone(),
            kind,
            size: if kind == EntryType::File {
                meta.len()
            } else {
                0
            },
            mtime_ns: meta.mtime() * 1_000_000_000 + meta.mtime_nsec(),
            mode: meta.mode() & 0o7777,
            inode: Some(meta.ino()),
            link_target,
        });
        Ok(())
    })?;
    Ok(out)
}

fn entry_type(meta: &fs::Metadata) -> EntryType {
    let ft = meta.file_type();
    if ft.is_file() {
        EntryType::File
    } else if ft.is_dir() {
        EntryType::Dir
    } else if ft.is_symlink() {
        EntryType::Symlink
    } else {
        EntryType::Other
    }
}

type Visit<'a> = dyn FnMut(&RelPath, &Path, &fs::Metadata) -> Result<()> + 'a;

/// Visit `host` itself as `rel`, then its subtree.
fn walk(host: &Path, rel: &RelPath, excludes: &Excludes, visit: &mut Visit<'_>) -> Result<()> {
    let meta = fs::symlink_metadata(host).map_err(|e| Error::io(host, e))?;
    visit(rel, host, &meta)?;
    if meta.is_dir() {
        walk_children(host, Some(rel), excludes, visit)?;
    }
    Ok(())
}

/// Visit the subtree under `dir` in sorted order (parents before children), not following
/// symlinks, skipping excluded paths and their subtrees.
fn walk_children(
    dir: &Path,
    rel: Option<&RelPath>,
    excludes: &Excludes,
    visit: &mut Visit<'_>,
) -> Result<()> {
    let mut names: Vec<_> = fs::read_dir(dir)
        .map_err(|e| Error::io(dir, e))?
        .map(|e| e.map(|e| e.file_name()))
        .collect::<io::Result<_>>()
        .map_err(|e| Error::io(dir, e))?;
    names.sort();
    for name in names {
        let Some(name) = name.to_str() else {
            tracing::warn!(dir = %dir.display(), "skipping a non-UTF-8 file name");
            continue;
        };
        let child_rel = match rel {
            Some(r) => r.join(name)?,
            None => RelPath::new(name)?,
        };
        if excludes.matches(&child_rel) {
            continue;
        }
        let abs = dir.join(name);
        let meta = match fs::symlink_metadata(&abs) {
            Ok(m) => m,
            Err(e) if e.kind() == io::ErrorKind::NotFound => continue, // removed while walking
            Err(e) => return Err(Error::io(&abs, e)),
        };
        if entry_type(&meta) == EntryType::Other {
            continue;
        }
        visit(&child_rel, &abs, &meta)?;
        if meta.is_dir() {
            walk_children(&abs, Some(&child_rel), excludes, visit)?;
        }
    }
    Ok(())
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

fn append_host<W: Write>(
    tar: &mut tar::Builder<W>,
    rel: &RelPath,
    abs: &Path,
    meta: &fs::Metadata,
) -> Result<()> {
    let ctx = |e| Error::io(abs, e);
    let mtime = meta.mtime().max(0) as u64;
    match entry_type(meta) {
        EntryType::File => {
            let mut file = fs::File::open(abs).map_err(ctx)?;
            let mut h = header(tar::EntryType::Regular, meta.mode(), mtime, meta.len());
            h.set_uid(meta.uid().into());
            h.set_gid(meta.gid().into());
            // A file that shrinks while being read would corrupt the archive: read exactly
            // the size in the header, padding with zeros if it shrank.
            let reader = (&mut file)
                .take(meta.len())
                .chain(io::repeat(0))
                .take(meta.len());
            tar.append_data(&mut h, rel.as_str(), reader).map_err(ctx)
        }
        EntryType::Dir => {
            let mut h = header(tar::EntryType::Directory, meta.mode(), mtime, 0);
            h.set_uid(meta.uid().into());
            h.set_gid(meta.gid().into());
            tar.append_data(&mut h, rel.as_str(), io::empty())
                .map_err(ctx)
        }
        EntryType::Symlink => {
            let target = fs::read_link(abs).map_err(ctx)?;
            let mut h = header(tar::EntryType::Symlink, 0o777, mtime, 0);
            h.set_uid(meta.uid().into());
            h.set_gid(meta.gid().into());
            tar.append_link(&mut h, rel.as_str(), &target).map_err(ctx)
        }
        EntryType::Other => Ok(()),
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

/// Applies the safety rules to a sequence of entry headers. One per archive.
#[derive(Debug)]
pub struct Validator {
    policy: ArchivePolicy,
    /// Kind of every path seen (keyed by a 128-bit hash to bound memory).
    seen: HashMap<u128, EntryType>,
    /// Symlink paths seen, kept whole (they are few) for the "under a link" check.
    symlinks: HashSet<RelPath>,
    entries: u64,
    total: u64,
}

fn key(path: &str) -> u128 {
    let mut a = std::collections::hash_map::DefaultHasher::new();
    path.hash(&mut a);
    let mut b = std::collections::hash_map::DefaultHasher::new();
    (path, 0x9e37_79b9_u32).hash(&mut b);
    (u128::from(a.finish()) << 64) | u128::from(b.finish())
}

impl Validator {
    /// A validator for one archive.
    pub fn new(policy: ArchivePolicy) -> Self {
        Validator {
            policy,
            seen: HashMap::new(),
            symlinks: HashSet::new(),
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
        // Nothing may be placed under a link or a file of this archive.
        let mut parent = path.parent();
        while let Some(p) = parent {
            if self.symlinks.contains(&p) {
                return refuse(&format!("lies under the symlink `{p}` of the same archive"));
            }
            if self.seen.get(&key(p.as_str())) == Some(&EntryType::File) {
                return refuse(&format!("lies under the file `{p}`"));
            }
            parent = p.parent();
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
                if target.is_empty() || target.contains('\0') {
                    return refuse("empty symlink target");
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
                if self.seen.get(&key(target.as_str())) != Some(&EntryType::File) {
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
        let k = key(checked.path().as_str());
        let kind = match &checked {
            Checked::File { .. } | Checked::HardLink { .. } => EntryType::File,
            Checked::Dir { .. } => EntryType::Dir,
            Checked::Symlink { .. } => EntryType::Symlink,
        };
        if self.seen.insert(k, kind).is_some() {
            return refuse("duplicate entry");
        }
        if let Checked::Symlink { path, .. } = &checked {
            self.symlinks.insert(path.clone());
        }
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
/// (see the module docs) and never following a symlink: every parent component is checked with
/// `lstat`, and an existing file or link at an entry's path is replaced, not written through.
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
    let mut stats = ExtractStats::default();
    let mut dir_modes: Vec<(PathBuf, u32, u64)> = Vec::new();
    for_each_entry(&mut reader, policy, |checked, entry| {
        let mode = entry.header().mode().unwrap_or(0o644) & 0o1777;
        let mtime = entry.header().mtime().unwrap_or(0);
        let path = checked.path().clone();
        let abs = ensure_parents(dest, &path)?;
        match &checked {
            Checked::File { .. } => {
                let mut file = create_replacing(&abs)?;
                let n = io::copy(entry, &mut file).map_err(|e| corrupt(path.as_str(), e))?;
                file.set_permissions(fs::Permissions::from_mode(mode))
                    .map_err(|e| Error::io(&abs, e))?;
                let _ = file.set_modified(UNIX_EPOCH + Duration::from_secs(mtime));
                stats.bytes += n;
            }
            Checked::Dir { .. } => {
                match fs::symlink_metadata(&abs) {
                    Ok(m) if m.is_dir() => {}
                    Ok(_) => {
                        fs::remove_file(&abs).map_err(|e| Error::io(&abs, e))?;
                        fs::create_dir(&abs).map_err(|e| Error::io(&abs, e))?;
                    }
                    Err(_) => fs::create_dir(&abs).map_err(|e| Error::io(&abs, e))?,
                }
                dir_modes.push((abs, mode, mtime));
            }
            Checked::Symlink { target, .. } => {
                remove_non_dir(&abs)?;
                std::os::unix::fs::symlink(target, &abs).map_err(|e| Error::io(&abs, e))?;
            }
            Checked::HardLink { target, .. } => {
                let src = target.to_host(dest);
                match fs::symlink_metadata(&src) {
                    Ok(m) if m.is_file() => {}
                    _ => {
                        return Err(Error::unsafe_archive(
                            path.as_str(),
                            "hard link target is not a regular file",
                        ));
                    }
                }
                remove_non_dir(&abs)?;
                fs::hard_link(&src, &abs).map_err(|e| Error::io(&abs, e))?;
            }
        }
        stats.entries += 1;
        Ok(())
    })?;
    // Directory modes last (a read-only directory must not block its own children), deepest
    // first so that mtimes are not disturbed afterwards.
    for (abs, mode, mtime) in dir_modes.into_iter().rev() {
        let _ = fs::set_permissions(&abs, fs::Permissions::from_mode(mode | 0o700));
        if let Ok(d) = fs::File::open(&abs) {
            let _ = d.set_modified(UNIX_EPOCH + Duration::from_secs(mtime));
        }
    }
    Ok(stats)
}

/// Create the parents of `path` under `root` as real directories, refusing to pass through a
/// symlink or a file. Returns the absolute path of `path`.
pub fn ensure_parents(root: &Path, path: &RelPath) -> Result<PathBuf> {
    let mut cur = root.to_path_buf();
    let parts: Vec<&str> = path.components().collect();
    for part in &parts[..parts.len() - 1] {
        cur.push(part);
        match fs::symlink_metadata(&cur) {
            Ok(m) if m.is_dir() => {}
            Ok(m) if m.file_type().is_symlink() => {
                return Err(Error::unsafe_archive(
                    path.as_str(),
                    format!("would write through the symlink `{}`", cur.display()),
                ));
            }
            Ok(_) => {
                return Err(Error::unsafe_archive(
                    path.as_str(),
                    format!("`{}` is not a directory", cur.display()),
                ));
            }
            Err(e) if e.kind() == io::ErrorKind::NotFound => {
                fs::create_dir(&cur).map_err(|e| Error::io(&cur, e))?;
            }
            Err(e) => return Err(Error::io(&cur, e)),
        }
    }
    cur.push(parts[parts.len() - 1]);
    Ok(cur)
}

/// Open `abs` for writing as a new file; an existing file or link there is removed first (never
/// followed). `O_CREAT|O_EXCL` does not follow a final symlink.
pub fn create_replacing(abs: &Path) -> Result<fs::File> {
    let open = || {
        fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .open(abs)
    };
    match open() {
        Ok(f) => Ok(f),
        Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {
            remove_non_dir(abs)?;
            open().map_err(|e| Error::io(abs, e))
        }
        Err(e) => Err(Error::io(abs, e)),
    }
}

fn remove_non_dir(abs: &Path) -> Result<()> {
    match fs::symlink_metadata(abs) {
        Ok(m) if m.is_dir() => fs::remove_dir_all(abs).map_err(|e| Error::io(abs, e)),
        Ok(_) => fs::remove_file(abs).map_err(|e| Error::io(abs, e)),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(Error::io(abs, e)),
    }
}

#[cfg(test)]
mod tests;
