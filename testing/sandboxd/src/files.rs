//! File operations beneath the base directory, shared by the REST and legacy APIs.
//!
//! Every path is opened relative to one directory handle with
//! [`Follow::Beneath`](sandbox_core::beneath::Follow): a symlink may lead elsewhere inside the
//! base directory, never out of it (`EXDEV`/`ELOOP`, reported as permission denied).
//! Blocking calls run on tokio's blocking pool; file bodies are streamed in chunks.

use std::fs;
use std::io;
use std::os::unix::fs::MetadataExt as _;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use futures::{Stream, StreamExt as _};
use sandbox_core::RelPath;
use sandbox_core::beneath::{Dir, Follow, Kind};
use tokio::io::AsyncWriteExt as _;

use crate::paths::Target;

/// Prefix of the temporary files an atomic write creates next to its destination.
pub const TMP_PREFIX: &str = ".sandboxd-tmp-";

/// Size of the chunks file bodies are read in.
pub const CHUNK: usize = 64 * 1024;

/// The base directory: an open handle plus the path it was opened at.
#[derive(Debug)]
pub struct Base {
    /// The handle every path is resolved beneath.
    pub dir: Dir,
    /// The path it was opened at (for the legacy API's absolute paths and process `cwd`).
    pub path: PathBuf,
}

impl Base {
    /// Open `path` (creating it when missing).
    pub fn open(path: impl Into<PathBuf>) -> io::Result<Base> {
        let path = path.into();
        Ok(Base {
            dir: Dir::create_and_open(&path)?,
            path,
        })
    }
}

/// Run a blocking closure on tokio's blocking pool.
pub async fn blocking<T: Send + 'static>(
    f: impl FnOnce() -> io::Result<T> + Send + 'static,
) -> io::Result<T> {
    tokio::task::spawn_blocking(f)
        .await
        .unwrap_or_else(|e| Err(io::Error::other(e)))
}

/// What a path names.
#[derive(Debug)]
pub enum Opened {
    /// A regular file, open for reading, and its length.
    File(fs::File, u64),
    /// A directory.
    Dir(Dir),
}

/// Open `target` for reading: a regular file or a directory (anything else is `NotFound`).
pub fn open(base: &Base, target: &Target) -> io::Result<Opened> {
    let rel = match target {
        Target::Root => return Ok(Opened::Dir(base.dir.try_clone()?)),
        Target::Rel(rel) => rel,
    };
    let meta = base.dir.metadata(rel, Follow::Beneath)?;
    if meta.is_dir() {
        Ok(Opened::Dir(base.dir.open_dir(rel, Follow::Beneath)?))
    } else if meta.is_file() {
        let file = base.dir.read_file(rel, Follow::Beneath)?;
        // The handle, not the earlier stat, is what will be read.
        let meta = file.metadata()?;
        if !meta.is_file() {
            return Err(io::ErrorKind::NotFound.into());
        }
        Ok(Opened::File(file, meta.len()))
    } else {
        Err(io::Error::new(
            io::ErrorKind::NotFound,
            "not a regular file or directory",
        ))
    }
}

/// One directory entry with its metadata (a symlink is described by what it leads to).
#[derive(Debug, Clone)]
pub struct Entry {
    /// File name.
    pub name: String,
    /// Whether it is (or leads to) a directory.
    pub is_dir: bool,
    /// Size in bytes.
    pub size: u64,
    /// Permission bits (`mode & 0o7777`).
    pub mode: u32,
    /// Modification time.
    pub modified: SystemTime,
}

/// The entries of `dir`, sorted by name. Symlinks are followed beneath the base directory
/// (`dir_rel` is where `dir` lies); links that are broken or lead out are left out, as are
/// names that are not UTF-8 and entries that vanish while listing.
pub fn list(base: &Base, dir: &Dir, dir_rel: &Target) -> io::Result<Vec<Entry>> {
    let mut out = Vec::new();
    for entry in dir.entries()? {
        let Some(name) = entry.name.to_str() else {
            continue;
        };
        let meta = if entry.kind == Kind::Symlink {
            let rel = match dir_rel {
                Target::Root => RelPath::new(name),
                Target::Rel(r) => r.join(name),
            };
            match rel {
                Ok(rel) => base.dir.metadata(&rel, Follow::Beneath),
                Err(_) => continue,
            }
        } else {
            dir.entry_metadata(name)
        };
        let Ok(meta) = meta else { continue };
        out.push(Entry {
            name: name.to_owned(),
            is_dir: meta.is_dir(),
            size: meta.len(),
            mode: meta.mode() & 0o7777,
            modified: meta.modified().unwrap_or(UNIX_EPOCH),
        });
    }
    out.sort_by(|a, b| a.name.cmp(&b.name));
    Ok(out)
}

/// Whether `target` exists (following symlinks beneath the base directory).
pub fn exists(base: &Base, target: &Target) -> io::Result<bool> {
    match target {
        Target::Root => Ok(true),
        Target::Rel(rel) => match base.dir.metadata(rel, Follow::Beneath) {
            Ok(_) => Ok(true),
            Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(false),
            Err(e) => Err(e),
        },
    }
}

/// Where an atomic write lands: the parent directory, the final name and the temporary file.
struct Pending {
    parent: Arc<Dir>,
    name: String,
    tmp: String,
}

impl Pending {
    fn discard(&self) {
        let _ = self.parent.remove_file(&self.tmp);
    }
}

/// Write the chunks of `body` to `rel` atomically: parents are created, the data goes to a
/// temporary file beside the destination, which gets permission bits `mode`, is synced and
/// renamed over the destination (a symlink there is replaced, never followed). A failed
/// write, or a body that ends in an error, leaves the destination as it was.
///
/// Writing over a directory fails with `EISDIR`.
pub async fn write_atomic<S, E>(
    base: Arc<Base>,
    rel: RelPath,
    mode: u32,
    body: S,
) -> io::Result<u64>
where
    S: Stream<Item = Result<Bytes, E>>,
    E: std::error::Error + Send + Sync + 'static,
{
    let pending = blocking(move || {
        let (parent, name) = base.dir.parent_of(&rel, Follow::Beneath, true)?;
        match parent.entry_metadata(name) {
            Ok(meta) if meta.is_dir() => {
                return Err(io::Error::from_raw_os_error(
                    rustix::io::Errno::ISDIR.raw_os_error(),
                ));
            }
            _ => {}
        }
        let tmp = format!("{TMP_PREFIX}{:016x}", fastrand::u64(..));
        let file = parent.create_new(&tmp, 0o600)?;
        Ok((
            Pending {
                parent: Arc::new(parent),
                name: name.to_owned(),
                tmp,
            },
            file,
        ))
    })
    .await?;
    let (pending, file) = pending;
    let mut file = tokio::fs::File::from_std(file);
    let copied = async {
        let mut total = 0u64;
        let mut body = std::pin::pin!(body);
        while let Some(chunk) = body.next().await {
            let chunk = chunk.map_err(io::Error::other)?;
            total += chunk.len() as u64;
            file.write_all(&chunk).await?;
        }
        file.flush().await?;
        Ok::<_, io::Error>(total)
    }
    .await;
    let total = match copied {
        Ok(total) => total,
        Err(e) => {
            let parent = pending.parent.clone();
            let tmp = pending.tmp.clone();
            let _ = blocking(move || {
                let _ = parent.remove_file(&tmp);
                Ok(())
            })
            .await;
            return Err(e);
        }
    };
    let file = file.into_std().await;
    blocking(move || {
        let done = (|| {
            rustix::fs::fchmod(&file, rustix::fs::Mode::from_raw_mode(mode))?;
            file.sync_all()?;
            drop(file);
            pending
                .parent
                .rename(&pending.tmp, &pending.parent, &pending.name)
        })();
        if done.is_err() {
            pending.discard();
        }
        done?;
        let _ = pending.parent.sync();
        Ok(total)
    })
    .await
}

/// How a delete went wrong in a way the caller reports specially.
#[derive(Debug, thiserror::Error)]
pub enum DeleteError {
    /// A non-empty directory without `recursive`.
    #[error("directory is not empty; pass recursive=true to remove it")]
    NotEmpty,
    /// Anything else.
    #[error(transparent)]
    Io(#[from] io::Error),
}

/// Remove `target`. A symlink is removed as a link. The base directory itself is never
/// removed: with `recursive` its contents are.
pub fn delete(base: &Base, target: &Target, recursive: bool) -> Result<(), DeleteError> {
    let rel = match target {
        Target::Root => {
            if !recursive {
                return Err(DeleteError::NotEmpty);
            }
            for entry in base.dir.entries()? {
                let Some(name) = entry.name.to_str() else {
                    return Err(
                        io::Error::other("a name in the base directory is not UTF-8").into(),
                    );
                };
                base.dir.remove_all(name)?;
            }
            return Ok(());
        }
        Target::Rel(rel) => rel,
    };
    let (parent, name) = base.dir.parent_of(rel, Follow::Beneath, false)?;
    let meta = parent.entry_metadata(name)?;
    if !meta.is_dir() {
        return Ok(parent.remove_file(name)?);
    }
    if recursive {
        return Ok(parent.remove_all(name)?);
    }
    match parent.remove_dir(name) {
        Ok(()) => Ok(()),
        Err(e)
            if matches!(
                e.raw_os_error(),
                Some(code) if code == rustix::io::Errno::NOTEMPTY.raw_os_error()
                    || code == rustix::io::Errno::EXIST.raw_os_error()
            ) =>
        {
            Err(DeleteError::NotEmpty)
        }
        Err(e) => Err(e.into()),
    }
}

/// A readable file as a stream of chunks.
pub fn file_stream(file: fs::File) -> impl Stream<Item = io::Result<Bytes>> + Send + 'static {
    tokio_util::io::ReaderStream::with_capacity(tokio::fs::File::from_std(file), CHUNK)
}

/// Seconds since the epoch of `t`, as a float (the legacy API's `mod_time`).
pub fn epoch_seconds(t: SystemTime) -> f64 {
    match t.duration_since(UNIX_EPOCH) {
        Ok(d) => d.as_secs_f64(),
        Err(e) => -e.duration().as_secs_f64(),
    }
}

/// `t` as RFC 3339 in UTC with whole seconds (`2026-11-30T22:09:36Z`).
pub fn rfc3339(t: SystemTime) -> String {
    let secs = match t.duration_since(UNIX_EPOCH) {
        Ok(d) => d.as_secs() as i64,
        Err(e) => -(e.duration().as_secs_f64().ceil() as i64),
    };
    let days = secs.div_euclid(86_400);
    let rem = secs.rem_euclid(86_400);
    let (y, m, d) = civil_from_days(days);
    format!(
        "{y:04}-{m:02}-{d:02}T{:02}:{:02}:{:02}Z",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60
    )
}

/// Proleptic Gregorian date of a day count since 1970-01-01 (H. Hinnant's algorithm).
fn civil_from_days(z: i64) -> (i64, u32, u32) {
    let z = z + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let y = yoe + era * 400;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let m = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    (if m <= 2 { y + 1 } else { y }, m, d)
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    #[test]
    fn rfc3339_formats_utc_seconds() {
        assert_eq!(rfc3339(UNIX_EPOCH), "1970-01-01T00:00:00Z");
        let t = UNIX_EPOCH + Duration::from_secs(1_795_990_176);
        assert_eq!(rfc3339(t), "2026-11-29T22:09:36Z");
        let leap = UNIX_EPOCH + Duration::from_secs(951_782_400); // 2000-02-29
        assert_eq!(rfc3339(leap), "2000-02-29T00:00:00Z");
    }
}
