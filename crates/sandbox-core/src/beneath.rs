//! Race-free file operations beneath a directory handle.
//!
//! A [`Dir`] is an open directory. Every path given to it is resolved by the kernel relative
//! to that handle, never by re-reading a path string from `/`: a concurrent process that swaps
//! a name (or a parent directory) for a symlink to elsewhere cannot redirect an operation that
//! was already checked, because there is no separate check — the resolution *is* the check.
//!
//! Two resolution rules ([`Follow`]):
//! - [`Follow::Never`]: no symlink anywhere on the way is followed (the archive extractor:
//!   it must never write through a link, inside or outside).
//! - [`Follow::Beneath`]: symlinks are followed only while the resolution stays beneath the
//!   handle (relative targets; `..` never climbs above it; absolute targets are refused). The
//!   agent's file tools use this, so a venv's `lib -> lib64` works but `leak -> /etc` does not.
//!
//! On Linux ≥ 5.6 one `openat2(2)` with `RESOLVE_BENEATH` (and `RESOLVE_NO_SYMLINKS` for
//! `Never`) does the walk in the kernel. Elsewhere, and where `openat2` is filtered (some
//! seccomp profiles answer `ENOSYS` or `EPERM`), the same rules are applied one component at
//! a time with `openat(O_NOFOLLOW)` on handles this module holds.
//!
//! Operations on a single name (create, rename, unlink, link, stat without following) take a
//! parent handle from [`Dir::parent_of`] and a plain name: they never follow a symlink at the
//! name itself.
//!
//! Reads that must also follow absolute symlinks into a few other known directories (the
//! agent's view spans a workspace, a project and extra roots; a box's bind mounts are links to
//! host directories) use the `*_anchored` variants: an absolute target at or under an
//! [`Anchor`]'s path goes on beneath that anchor's handle, and every other absolute target is
//! still refused.
//!
//! Refusals come back as [`std::io::Error`]s with `ELOOP` (a symlink where none may be
//! followed) or `EXDEV` (the resolution would leave the handle); [`refusal`] tells them apart
//! from ordinary I/O errors.

use std::ffi::{OsStr, OsString};
use std::fmt;
use std::fs;
use std::io::{self, Write as _};
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::os::unix::ffi::{OsStrExt as _, OsStringExt as _};
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use rustix::fs::{AtFlags, Mode, OFlags, RenameFlags};
use rustix::io::Errno;

use crate::path::RelPath;

/// How symlinks met while resolving a path are treated.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Follow {
    /// Refuse any symlink on the way, the last component included (`ELOOP`).
    Never,
    /// Follow symlinks whose resolution stays beneath the handle; refuse absolute targets and
    /// `..` above the handle (`EXDEV`).
    Beneath,
}

/// Most symlinks followed in one resolution (Linux's own limit).
const MAX_HOPS: usize = 40;

/// Prefix of the temporary names [`Dir::write_atomic`] creates (listings may hide them).
pub const TMP_PREFIX: &str = ".sbx-tmp-";

/// Another directory that absolute symlink targets may lead into (see the `*_anchored`
/// methods of [`Dir`]).
#[derive(Debug, Clone, Copy)]
pub struct Anchor<'a> {
    /// The absolute path targets are compared with, by components. A target naming it through
    /// another spelling (a symlink in its parents) is refused.
    pub path: &'a Path,
    /// The handle the rest of such a target is resolved beneath.
    pub dir: &'a Dir,
}

/// Environment variable that, when set, makes every resolution use the portable walk instead
/// of `openat2` (to run the race tests over the walk, or where `openat2` misbehaves).
pub const FORCE_WALK_ENV: &str = "SANDBOX_BENEATH_WALK";

/// Whether `openat2` with `RESOLVE_BENEATH` works here (not on kernels before 5.6, nor under
/// seccomp filters that refuse it) and is not turned off by [`FORCE_WALK_ENV`]. Probed once.
fn openat2_works() -> bool {
    static WORKS: OnceLock<bool> = OnceLock::new();
    *WORKS.get_or_init(|| {
        if std::env::var_os(FORCE_WALK_ENV).is_some() {
            tracing::debug!("{FORCE_WALK_ENV} set: resolving paths component by component");
            return false;
        }
        #[cfg(target_os = "linux")]
        {
            let works = rustix::fs::openat2(
                rustix::fs::CWD,
                ".",
                OFlags::PATH | OFlags::CLOEXEC,
                Mode::empty(),
                rustix::fs::ResolveFlags::BENEATH,
            )
            .is_ok();
            if !works {
                tracing::debug!("openat2 unavailable: resolving paths component by component");
            }
            works
        }
        #[cfg(not(target_os = "linux"))]
        false
    })
}

#[cfg(test)]
thread_local! {
    /// For tests: resolve with the portable walk on this thread even where `openat2` works.
    static FORCE_WALK: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// For tests in this crate: run `test` through `openat2` (where it works), then again with the
/// portable walk forced on this thread.
#[cfg(test)]
pub(crate) fn both_resolutions(test: impl Fn()) {
    test();
    FORCE_WALK.with(|f| f.set(true));
    test();
    FORCE_WALK.with(|f| f.set(false));
}

/// Why an error is a refusal by the resolution rules, if it is one.
pub fn refusal(e: &io::Error) -> Option<&'static str> {
    match e.raw_os_error().map(Errno::from_raw_os_error) {
        Some(Errno::LOOP) => Some("a symlink on the way may not be followed"),
        Some(Errno::XDEV) => Some("resolves outside its root (through a symlink or `..`)"),
        _ => None,
    }
}

/// The kind of a directory entry, read without following it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Kind {
    /// Regular file.
    File,
    /// Directory.
    Dir,
    /// Symbolic link.
    Symlink,
    /// Anything else (fifo, socket, device).
    Other,
}

impl Kind {
    fn of(ft: fs::FileType) -> Kind {
        if ft.is_file() {
            Kind::File
        } else if ft.is_dir() {
            Kind::Dir
        } else if ft.is_symlink() {
            Kind::Symlink
        } else {
            Kind::Other
        }
    }
}

/// An open directory that paths are resolved beneath.
pub struct Dir {
    fd: OwnedFd,
    /// Where the handle was opened, for messages only: never resolved again.
    shown: PathBuf,
}

impl fmt::Debug for Dir {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_tuple("Dir").field(&self.shown).finish()
    }
}

impl AsFd for Dir {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }
}

impl Dir {
    /// Open the directory at `path` as a root. `path` itself is resolved normally (it is the
    /// caller's, trusted); everything below it is resolved by this module's rules.
    pub fn open(path: impl AsRef<Path>) -> io::Result<Dir> {
        let path = path.as_ref();
        let fd = rustix::fs::open(path, dir_flags(), Mode::empty())?;
        Ok(Dir {
            fd,
            shown: path.to_path_buf(),
        })
    }

    /// Create the directory at `path` (and its parents, normally) if missing, then open it.
    pub fn create_and_open(path: impl AsRef<Path>) -> io::Result<Dir> {
        let path = path.as_ref();
        fs::create_dir_all(path)?;
        Dir::open(path)
    }

    /// Where this handle was opened (for messages; never resolved again).
    pub fn shown(&self) -> &Path {
        &self.shown
    }

    /// A second handle on the same directory.
    pub fn try_clone(&self) -> io::Result<Dir> {
        Ok(Dir {
            fd: self.fd.try_clone()?,
            shown: self.shown.clone(),
        })
    }

    fn child(&self, fd: OwnedFd, rel: &str) -> Dir {
        Dir {
            fd,
            shown: self.shown.join(rel),
        }
    }

    /// Open the directory `rel` beneath this one.
    pub fn open_dir(&self, rel: &RelPath, follow: Follow) -> io::Result<Dir> {
        let flags = OFlags::RDONLY | OFlags::DIRECTORY;
        let fd = resolve(self.as_fd(), rel.as_str(), follow, flags)?;
        Ok(self.child(fd, rel.as_str()))
    }

    /// Open the file `rel` beneath this one with `options` (`O_CLOEXEC` is always added; a
    /// final symlink is refused under [`Follow::Never`] and followed under [`Follow::Beneath`]
    /// whatever `O_NOFOLLOW` says). To create a file, use [`Dir::parent_of`] and
    /// [`Dir::create_new`].
    pub fn open_file(
        &self,
        rel: &RelPath,
        follow: Follow,
        options: OFlags,
    ) -> io::Result<fs::File> {
        let fd = resolve(
            self.as_fd(),
            rel.as_str(),
            follow,
            options | OFlags::CLOEXEC,
        )?;
        Ok(fs::File::from(fd))
    }

    /// Open `rel` for reading.
    pub fn read_file(&self, rel: &RelPath, follow: Follow) -> io::Result<fs::File> {
        self.open_file(rel, follow, OFlags::RDONLY)
    }

    /// Metadata of `rel`. Under [`Follow::Never`] a symlink at `rel` itself is described, not
    /// followed (it is not refused); under [`Follow::Beneath`] it is followed if it stays
    /// beneath.
    pub fn metadata(&self, rel: &RelPath, follow: Follow) -> io::Result<fs::Metadata> {
        match follow {
            Follow::Beneath => {
                let fd = resolve(self.as_fd(), rel.as_str(), follow, OFlags::PATH)?;
                fs::File::from(fd).metadata()
            }
            Follow::Never => {
                let (parent, name) = self.parent_of(rel, Follow::Never, false)?;
                parent.entry_metadata(name)
            }
        }
    }

    /// Open the file `rel` for reading under [`Follow::Beneath`], except that an absolute
    /// symlink target at or under one of `anchors` goes on beneath that anchor's handle (see
    /// [`Anchor`]).
    pub fn read_file_anchored(
        &self,
        rel: &RelPath,
        anchors: &[Anchor<'_>],
    ) -> io::Result<fs::File> {
        let fd = self.resolve_anchored(rel, OFlags::RDONLY, anchors)?;
        Ok(fs::File::from(fd))
    }

    /// Open the directory `rel` as [`Dir::read_file_anchored`] resolves it.
    pub fn open_dir_anchored(&self, rel: &RelPath, anchors: &[Anchor<'_>]) -> io::Result<Dir> {
        let fd = self.resolve_anchored(rel, OFlags::RDONLY | OFlags::DIRECTORY, anchors)?;
        Ok(self.child(fd, rel.as_str()))
    }

    /// A handle on `rel` as [`Dir::read_file_anchored`] resolves it (a final symlink followed),
    /// opened with `O_PATH`: for its metadata and whereabouts, not its content (so opening a
    /// fifo does not block).
    pub fn open_path_anchored(
        &self,
        rel: &RelPath,
        anchors: &[Anchor<'_>],
    ) -> io::Result<fs::File> {
        let fd = self.resolve_anchored(rel, OFlags::PATH, anchors)?;
        Ok(fs::File::from(fd))
    }

    /// The kernel's resolution first (it refuses every absolute target); only a refusal is
    /// retried with the walk, which may re-anchor. Both are race-free, so a swap between the
    /// two only changes which one answers.
    fn resolve_anchored(
        &self,
        rel: &RelPath,
        flags: OFlags,
        anchors: &[Anchor<'_>],
    ) -> io::Result<OwnedFd> {
        match resolve(self.as_fd(), rel.as_str(), Follow::Beneath, flags) {
            Err(e)
                if !anchors.is_empty() && e.raw_os_error() == Some(Errno::XDEV.raw_os_error()) =>
            {
                let flags = (flags - OFlags::NOFOLLOW) | OFlags::CLOEXEC;
                resolve_walk(self.as_fd(), rel.as_str(), Follow::Beneath, flags, anchors)
            }
            other => other,
        }
    }

    /// The directory holding `rel` (created, with its parents, when `create` is set) and the
    /// last component of `rel`, for the single-name operations below.
    pub fn parent_of<'p>(
        &self,
        rel: &'p RelPath,
        follow: Follow,
        create: bool,
    ) -> io::Result<(Dir, &'p str)> {
        let name = rel.file_name();
        let parent = match rel.parent() {
            None => self.try_clone()?,
            Some(p) if create => self.create_dir_all(&p, follow)?,
            Some(p) => self.open_dir(&p, follow)?,
        };
        Ok((parent, name))
    }

    /// Create `rel` and its missing parents as directories (mode 0755 before umask), refusing
    /// to pass through a symlink (under [`Follow::Never`]) or out of the handle, and open it.
    pub fn create_dir_all(&self, rel: &RelPath, follow: Follow) -> io::Result<Dir> {
        match self.open_dir(rel, follow) {
            Ok(dir) => return Ok(dir),
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            Err(e) => return Err(e),
        }
        let mut cur = self.try_clone()?;
        let mut done = String::new();
        for part in rel.components() {
            if !done.is_empty() {
                done.push('/');
            }
            done.push_str(part);
            match rustix::fs::mkdirat(cur.as_fd(), part, Mode::from_raw_mode(0o755)) {
                Ok(()) | Err(Errno::EXIST) => {}
                Err(e) => return Err(e.into()),
            }
            let name = RelPath::new(part).map_err(|_| Errno::INVAL)?;
            let next = cur.open_dir(&name, follow)?;
            cur = Dir {
                fd: next.fd,
                shown: self.shown.join(&done),
            };
        }
        Ok(cur)
    }

    // ---- single names in this directory; never follows a symlink at the name ----

    /// Metadata of the entry `name` of this directory, not following a symlink.
    pub fn entry_metadata(&self, name: &str) -> io::Result<fs::Metadata> {
        let fd = rustix::fs::openat(
            self.as_fd(),
            name,
            OFlags::PATH | OFlags::NOFOLLOW | OFlags::CLOEXEC,
            Mode::empty(),
        )?;
        fs::File::from(fd).metadata()
    }

    /// Open the subdirectory `name`, refusing a symlink.
    pub fn open_subdir(&self, name: &str) -> io::Result<Dir> {
        let fd = rustix::fs::openat(self.as_fd(), name, dir_flags(), Mode::empty())?;
        Ok(self.child(fd, name))
    }

    /// Open the entry `name` of this directory for reading, refusing a symlink (`ELOOP`).
    /// Whatever the name turned out to be, opening it neither blocks (a fifo) nor makes it
    /// the controlling terminal; callers check the kind on the returned handle.
    pub fn open_entry(&self, name: &str) -> io::Result<fs::File> {
        let fd = rustix::fs::openat(
            self.as_fd(),
            name,
            OFlags::RDONLY | OFlags::NOFOLLOW | OFlags::NONBLOCK | OFlags::NOCTTY | OFlags::CLOEXEC,
            Mode::empty(),
        )?;
        Ok(fs::File::from(fd))
    }

    /// Create the file `name` (it must not exist; a symlink there is not followed) for
    /// writing, with permission bits `mode` (before umask).
    pub fn create_new(&self, name: &str, mode: u32) -> io::Result<fs::File> {
        let fd = rustix::fs::openat(
            self.as_fd(),
            name,
            OFlags::WRONLY | OFlags::CREATE | OFlags::EXCL | OFlags::NOFOLLOW | OFlags::CLOEXEC,
            Mode::from_raw_mode(mode),
        )?;
        Ok(fs::File::from(fd))
    }

    /// Create the directory `name`.
    pub fn create_subdir(&self, name: &str, mode: u32) -> io::Result<()> {
        Ok(rustix::fs::mkdirat(
            self.as_fd(),
            name,
            Mode::from_raw_mode(mode),
        )?)
    }

    /// Remove the file or symlink `name` (a symlink itself, never its target).
    pub fn remove_file(&self, name: &str) -> io::Result<()> {
        Ok(rustix::fs::unlinkat(self.as_fd(), name, AtFlags::empty())?)
    }

    /// Remove the empty directory `name`.
    pub fn remove_dir(&self, name: &str) -> io::Result<()> {
        Ok(rustix::fs::unlinkat(
            self.as_fd(),
            name,
            AtFlags::REMOVEDIR,
        )?)
    }

    /// Remove `name` whatever it is, recursively for a directory, without following any
    /// symlink (links are removed as links). A missing name is not an error.
    pub fn remove_all(&self, name: &str) -> io::Result<()> {
        let meta = match self.entry_metadata(name) {
            Ok(m) => m,
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(()),
            Err(e) => return Err(e),
        };
        if !meta.is_dir() {
            return ignore_missing(self.remove_file(name));
        }
        {
            let sub = self.open_subdir(name)?;
            for entry in sub.entries()? {
                sub.remove_all_os(&entry.name)?;
            }
        }
        ignore_missing(self.remove_dir(name))
    }

    fn remove_all_os(&self, name: &OsStr) -> io::Result<()> {
        match name.to_str() {
            Some(n) => self.remove_all(n),
            // Non-UTF-8 names: same walk through the raw bytes.
            None => {
                let meta = rustix::fs::statat(self.as_fd(), name, AtFlags::SYMLINK_NOFOLLOW)?;
                if rustix::fs::FileType::from_raw_mode(meta.st_mode)
                    == rustix::fs::FileType::Directory
                {
                    let fd = rustix::fs::openat(self.as_fd(), name, dir_flags(), Mode::empty())?;
                    let sub = self.child(fd, &name.to_string_lossy());
                    for entry in sub.entries()? {
                        sub.remove_all_os(&entry.name)?;
                    }
                    Ok(rustix::fs::unlinkat(
                        self.as_fd(),
                        name,
                        AtFlags::REMOVEDIR,
                    )?)
                } else {
                    Ok(rustix::fs::unlinkat(self.as_fd(), name, AtFlags::empty())?)
                }
            }
        }
    }

    /// Rename `from` in this directory to `to` in `to_dir`, replacing a file or symlink there
    /// (never following it).
    pub fn rename(&self, from: &str, to_dir: &Dir, to: &str) -> io::Result<()> {
        Ok(rustix::fs::renameat(
            self.as_fd(),
            from,
            to_dir.as_fd(),
            to,
        )?)
    }

    /// Rename without replacing: `EEXIST` if `to` exists.
    pub fn rename_noreplace(&self, from: &str, to_dir: &Dir, to: &str) -> io::Result<()> {
        Ok(rustix::fs::renameat_with(
            self.as_fd(),
            from,
            to_dir.as_fd(),
            to,
            RenameFlags::NOREPLACE,
        )?)
    }

    /// Copy the entry `name` of this directory to `to_name` in `to_dir` (which must not
    /// exist): files with their permission bits, directories recursively, symlinks as links
    /// with their target kept verbatim. No symlink is followed, here or below; an entry swapped
    /// for a symlink while being copied fails the copy (`ELOOP` or `ENOTDIR`) instead.
    pub fn copy_all(&self, name: &str, to_dir: &Dir, to_name: &str) -> io::Result<()> {
        self.copy_all_os(OsStr::new(name), to_dir, OsStr::new(to_name))
    }

    fn copy_all_os(&self, name: &OsStr, to_dir: &Dir, to_name: &OsStr) -> io::Result<()> {
        let st = rustix::fs::statat(self.as_fd(), name, AtFlags::SYMLINK_NOFOLLOW)?;
        let mode = Mode::from_raw_mode(st.st_mode & 0o7777);
        match kind_of_mode(st.st_mode) {
            Kind::Symlink => {
                let target = rustix::fs::readlinkat(self.as_fd(), name, Vec::new())?;
                Ok(rustix::fs::symlinkat(
                    target.as_c_str(),
                    to_dir.as_fd(),
                    to_name,
                )?)
            }
            Kind::File => {
                let src = rustix::fs::openat(
                    self.as_fd(),
                    name,
                    OFlags::RDONLY | OFlags::NOFOLLOW | OFlags::CLOEXEC,
                    Mode::empty(),
                )?;
                let dst = rustix::fs::openat(
                    to_dir.as_fd(),
                    to_name,
                    OFlags::WRONLY
                        | OFlags::CREATE
                        | OFlags::EXCL
                        | OFlags::NOFOLLOW
                        | OFlags::CLOEXEC,
                    Mode::from_raw_mode(0o600),
                )?;
                let (mut src, mut dst) = (fs::File::from(src), fs::File::from(dst));
                io::copy(&mut src, &mut dst)?;
                rustix::fs::fchmod(&dst, mode)?;
                Ok(())
            }
            Kind::Dir => {
                rustix::fs::mkdirat(to_dir.as_fd(), to_name, Mode::from_raw_mode(0o700))?;
                let open = |at: &Dir, n: &OsStr| {
                    let fd = rustix::fs::openat(at.as_fd(), n, dir_flags(), Mode::empty())?;
                    io::Result::Ok(at.child(fd, &n.to_string_lossy()))
                };
                let (src, dst) = (open(self, name)?, open(to_dir, to_name)?);
                for entry in src.entries()? {
                    src.copy_all_os(&entry.name, &dst, &entry.name)?;
                }
                Ok(rustix::fs::fchmod(dst.as_fd(), mode)?)
            }
            Kind::Other => Err(io::Error::new(
                io::ErrorKind::Unsupported,
                format!(
                    "`{}` is not a file, directory or symlink",
                    name.to_string_lossy()
                ),
            )),
        }
    }

    /// Create the symlink `name` pointing to `target` (kept verbatim).
    pub fn symlink(&self, target: &str, name: &str) -> io::Result<()> {
        Ok(rustix::fs::symlinkat(target, self.as_fd(), name)?)
    }

    /// The target of the symlink `name`.
    pub fn read_link(&self, name: &str) -> io::Result<PathBuf> {
        let target = rustix::fs::readlinkat(self.as_fd(), name, Vec::new())?;
        Ok(PathBuf::from(OsString::from_vec(target.into_bytes())))
    }

    /// Hard-link the entry `from` of this directory as `to` in `to_dir`. A symlink at `from`
    /// is linked as the link itself, never followed.
    pub fn hard_link(&self, from: &str, to_dir: &Dir, to: &str) -> io::Result<()> {
        Ok(rustix::fs::linkat(
            self.as_fd(),
            from,
            to_dir.as_fd(),
            to,
            AtFlags::empty(),
        )?)
    }

    /// The entries of this directory (without `.` and `..`), unsorted.
    pub fn entries(&self) -> io::Result<Vec<DirEntry>> {
        let fd = rustix::fs::openat(self.as_fd(), ".", dir_flags(), Mode::empty())?;
        let mut dir = rustix::fs::Dir::new(fd)?;
        let mut out = Vec::new();
        while let Some(entry) = dir.read() {
            let entry = entry?;
            let name = entry.file_name().to_bytes();
            if name == b"." || name == b".." {
                continue;
            }
            let name = OsStr::from_bytes(name).to_owned();
            let kind = match entry.file_type() {
                rustix::fs::FileType::RegularFile => Kind::File,
                rustix::fs::FileType::Directory => Kind::Dir,
                rustix::fs::FileType::Symlink => Kind::Symlink,
                rustix::fs::FileType::Unknown => {
                    match rustix::fs::statat(
                        self.as_fd(),
                        name.as_os_str(),
                        AtFlags::SYMLINK_NOFOLLOW,
                    ) {
                        Ok(st) => kind_of_mode(st.st_mode),
                        Err(Errno::NOENT) => continue, // removed while listing
                        Err(e) => return Err(e.into()),
                    }
                }
                _ => Kind::Other,
            };
            out.push(DirEntry { name, kind });
        }
        Ok(out)
    }

    /// Metadata of this directory itself (of the handle: whatever its path names by now).
    pub fn stat(&self) -> io::Result<fs::Metadata> {
        fs::File::from(self.fd.try_clone()?).metadata()
    }

    /// Set permission bits and the modification time of this directory itself.
    pub fn set_mode_and_mtime(
        &self,
        mode: u32,
        mtime: Option<std::time::SystemTime>,
    ) -> io::Result<()> {
        rustix::fs::fchmod(self.as_fd(), Mode::from_raw_mode(mode))?;
        if let Some(t) = mtime {
            let file = fs::File::from(self.fd.try_clone()?);
            file.set_modified(t)?;
        }
        Ok(())
    }

    /// Make the directory's entries durable (fsync of the directory).
    pub fn sync(&self) -> io::Result<()> {
        Ok(rustix::fs::fsync(self.as_fd())?)
    }

    /// Write `data` to `name` atomically: a temporary file in this directory (fixed-length
    /// name, `O_EXCL`), fsync, permission bits `mode`, `renameat` over `name` (a symlink there
    /// is replaced, never followed), fsync of the directory.
    pub fn write_atomic(&self, name: &str, data: &[u8], mode: u32) -> io::Result<()> {
        let tmp = format!("{TMP_PREFIX}{}", uuid::Uuid::new_v4().simple());
        let written = (|| {
            let mut file = self.create_new(&tmp, 0o600)?;
            file.write_all(data)?;
            rustix::fs::fchmod(&file, Mode::from_raw_mode(mode))?;
            file.sync_all()?;
            self.rename(&tmp, self, name)
        })();
        if let Err(e) = written {
            let _ = self.remove_file(&tmp);
            return Err(e);
        }
        let _ = self.sync();
        Ok(())
    }
}

/// One entry of [`Dir::entries`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DirEntry {
    /// The name (any bytes but `/` and NUL).
    pub name: OsString,
    /// What it is, not following a symlink.
    pub kind: Kind,
}

fn kind_of_mode(mode: u32) -> Kind {
    match rustix::fs::FileType::from_raw_mode(mode) {
        rustix::fs::FileType::RegularFile => Kind::File,
        rustix::fs::FileType::Directory => Kind::Dir,
        rustix::fs::FileType::Symlink => Kind::Symlink,
        _ => Kind::Other,
    }
}

impl Kind {
    /// The kind of `meta` (which was read without following a symlink).
    pub fn of_metadata(meta: &fs::Metadata) -> Kind {
        Kind::of(meta.file_type())
    }
}

fn dir_flags() -> OFlags {
    OFlags::RDONLY | OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC
}

fn ignore_missing(r: io::Result<()>) -> io::Result<()> {
    match r {
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
        r => r,
    }
}

/// Open `rel` beneath `root` with `flags` under the rules of `follow`.
fn resolve(root: BorrowedFd<'_>, rel: &str, follow: Follow, flags: OFlags) -> io::Result<OwnedFd> {
    let flags = (flags - OFlags::NOFOLLOW) | OFlags::CLOEXEC;
    #[cfg(test)]
    let forced = FORCE_WALK.with(std::cell::Cell::get);
    #[cfg(not(test))]
    let forced = false;
    #[cfg(target_os = "linux")]
    if !forced && openat2_works() {
        return Ok(resolve_openat2(root, rel, follow, flags)?);
    }
    resolve_walk(root, rel, follow, flags, &[])
}

#[cfg(target_os = "linux")]
fn resolve_openat2(
    root: BorrowedFd<'_>,
    rel: &str,
    follow: Follow,
    flags: OFlags,
) -> rustix::io::Result<OwnedFd> {
    use rustix::fs::ResolveFlags;
    let mut how = ResolveFlags::BENEATH | ResolveFlags::NO_MAGICLINKS;
    if follow == Follow::Never {
        // Also refuses a final symlink (ELOOP), where O_NOFOLLOW would open it (O_PATH) or
        // answer ENOTDIR (O_DIRECTORY).
        how |= ResolveFlags::NO_SYMLINKS;
    }
    let mode = if flags.contains(OFlags::CREATE) {
        Mode::from_raw_mode(0o644)
    } else {
        Mode::empty()
    };
    // EAGAIN: a concurrent rename raced a `..` lookup; the kernel asks for a retry.
    let mut tries = 0;
    loop {
        match rustix::fs::openat2(root, rel, flags, mode, how) {
            Err(Errno::AGAIN) if tries < 64 => tries += 1,
            r => return r,
        }
    }
}

/// The portable resolution: one component at a time, each opened with `O_NOFOLLOW` relative
/// to a handle held here; symlinks (under [`Follow::Beneath`]) are read and their components
/// spliced in front of the rest, with `..` popping held handles and never the root.
///
/// An absolute target at or under one of `anchors` goes on beneath that anchor's handle (the
/// held handles are dropped: `..` cannot climb back); any other absolute target is refused.
fn resolve_walk<'a>(
    mut root: BorrowedFd<'a>,
    rel: &str,
    follow: Follow,
    flags: OFlags,
    anchors: &[Anchor<'a>],
) -> io::Result<OwnedFd> {
    let mut pending: Vec<String> = rel
        .split('/')
        .filter(|p| !p.is_empty() && *p != ".")
        .map(str::to_owned)
        .rev()
        .collect();
    // Handles of the directories walked so far; empty means "at the root".
    let mut stack: Vec<OwnedFd> = Vec::new();
    let mut hops = 0;
    while let Some(part) = pending.pop() {
        let last = pending.is_empty();
        if part == ".." {
            if stack.pop().is_none() {
                return Err(Errno::XDEV.into());
            }
            if last {
                let at = stack.last().map_or(root, |fd| fd.as_fd());
                return Ok(rustix::fs::openat(
                    at,
                    ".",
                    flags | OFlags::CLOEXEC,
                    Mode::empty(),
                )?);
            }
            continue;
        }
        let at = stack.last().map_or(root, |fd| fd.as_fd());
        let opened = if last {
            rustix::fs::openat(
                at,
                part.as_str(),
                flags | OFlags::NOFOLLOW | OFlags::CLOEXEC,
                Mode::from_raw_mode(0o644),
            )
        } else {
            rustix::fs::openat(at, part.as_str(), dir_flags(), Mode::empty())
        };
        // `O_PATH | O_NOFOLLOW` opens a final symlink itself instead of failing: look.
        let opened = match opened {
            Ok(fd) if last && flags.contains(OFlags::PATH) && is_symlink_fd(&fd)? => {
                Err(Errno::LOOP)
            }
            other => other,
        };
        match opened {
            Ok(fd) => {
                if last {
                    return Ok(fd);
                }
                stack.push(fd);
            }
            // ELOOP (a final symlink with O_NOFOLLOW) or ENOTDIR (a symlink opened with
            // O_DIRECTORY|O_NOFOLLOW): is it a symlink?
            Err(e @ (Errno::LOOP | Errno::NOTDIR)) => {
                let is_link = rustix::fs::statat(at, part.as_str(), AtFlags::SYMLINK_NOFOLLOW)
                    .is_ok_and(|st| kind_of_mode(st.st_mode) == Kind::Symlink);
                if !is_link {
                    return Err(e.into());
                }
                if follow == Follow::Never {
                    return Err(Errno::LOOP.into());
                }
                hops += 1;
                if hops > MAX_HOPS {
                    return Err(Errno::LOOP.into());
                }
                let target = rustix::fs::readlinkat(at, part.as_str(), Vec::new())?;
                let target = target.to_string_lossy().into_owned();
                if target.starts_with('/') {
                    let (dir, rest) = anchor_of(&target, anchors).ok_or(Errno::XDEV)?;
                    let was_last = pending.is_empty();
                    pending.extend(
                        rest.split('/')
                            .filter(|p| !p.is_empty() && *p != ".")
                            .map(str::to_owned)
                            .rev(),
                    );
                    stack.clear();
                    root = dir.as_fd();
                    if was_last && pending.is_empty() {
                        // A link to the anchor itself.
                        return Ok(rustix::fs::openat(
                            root,
                            ".",
                            flags | OFlags::CLOEXEC,
                            Mode::empty(),
                        )?);
                    }
                    continue;
                }
                pending.extend(
                    target
                        .split('/')
                        .filter(|p| !p.is_empty() && *p != ".")
                        .map(str::to_owned)
                        .rev(),
                );
                if pending.is_empty() {
                    // A link to "." or "": the directory it sits in.
                    return Ok(rustix::fs::openat(
                        at,
                        ".",
                        flags | OFlags::CLOEXEC,
                        Mode::empty(),
                    )?);
                }
            }
            Err(e) => return Err(e.into()),
        }
    }
    // An empty path: the root itself.
    Ok(rustix::fs::openat(
        root,
        ".",
        flags | OFlags::CLOEXEC,
        Mode::empty(),
    )?)
}

/// The anchor an absolute symlink target lies at or under (the longest such path), and the rest
/// of the target below it.
fn anchor_of<'a>(target: &str, anchors: &[Anchor<'a>]) -> Option<(&'a Dir, String)> {
    anchors
        .iter()
        .filter_map(|a| {
            let rest = Path::new(target).strip_prefix(a.path).ok()?;
            Some((
                a.path.components().count(),
                a.dir,
                rest.to_str()?.to_owned(),
            ))
        })
        .max_by_key(|(depth, _, _)| *depth)
        .map(|(_, dir, rest)| (dir, rest))
}

fn is_symlink_fd(fd: &OwnedFd) -> io::Result<bool> {
    Ok(kind_of_mode(rustix::fs::fstat(fd)?.st_mode) == Kind::Symlink)
}

#[cfg(test)]
mod tests;
