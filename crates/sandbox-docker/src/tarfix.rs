//! Tar stream rewriting on a blocking thread: the engine's archives renamed to
//! workspace-relative paths and filtered (export), and core's archives filtered and checked
//! entry by entry before the engine extracts them (import).

use std::io::{self, Read, Write};

use sandbox_core::archive::Excludes;
pub(crate) use sandbox_core::archive::Wanted;
use sandbox_core::stream::{self, ByteStream};
use sandbox_core::{Error, RelPath, Result};

/// Chunks kept in flight between a rewriting thread and its consumer.
const DEPTH: usize = 8;

/// Top-level names starting with this are the backend's staging directories: never listed,
/// exported or kept.
pub(crate) use sandbox_core::scripted::STAGE_PREFIX;

/// One engine download and where its entries go.
pub(crate) struct Download {
    /// The stream of the engine's tar (entries named `<basename>/...`).
    pub stream: ByteStream,
    /// Workspace-relative name of the downloaded item itself; `None` for the root, which is
    /// not emitted itself.
    pub prefix: Option<RelPath>,
}

/// Fetches one more engine download for a workspace path (an item of its own: the engine names
/// the requested item by its base name).
pub(crate) type Refetch = Box<dyn Fn(&RelPath) -> ByteStream + Send>;

/// Which entries of the downloads go into the export.
pub(crate) struct Filter {
    pub excludes: Excludes,
    /// Only these (and what is under them); `None`: everything.
    pub wanted: Option<Wanted>,
    /// A download that does not exist (`NotFound`) contributes nothing.
    pub missing_ok: bool,
    /// With `wanted`: a wanted hard link is fetched again on its own (a download of a single
    /// file carries its content as a regular file), so no wanted file is lost.
    pub refetch: Option<Refetch>,
}

/// Re-emit `downloads` as one tar with workspace-relative names, leaving out the excluded and
/// unwanted paths, the staging directories and anything that is not a file, directory or
/// link.
pub(crate) fn export(downloads: Vec<Download>, filter: Filter) -> ByteStream {
    stream::spawn_writer(DEPTH, move |w| {
        let mut out = builder(w);
        let mut orphans: Vec<RelPath> = Vec::new();
        for d in downloads {
            // The engine's body comes in small frames: batched, this thread wakes per batch.
            let reader = stream::blocking_reader(stream::batched(d.stream, stream::CHUNK));
            let mut sink = Sink {
                out: &mut out,
                orphans: &mut orphans,
            };
            match rename_into(reader, d.prefix.as_ref(), &filter, &mut sink) {
                Err(Error::NotFound { .. }) if filter.missing_ok => continue,
                other => other?,
            }
        }
        if let Some(refetch) = &filter.refetch {
            // Hard links to files the filter left out: their own downloads hold the content.
            let only = Filter {
                excludes: filter.excludes.clone(),
                wanted: None,
                missing_ok: true,
                refetch: None,
            };
            for path in std::mem::take(&mut orphans) {
                let reader = stream::blocking_reader(refetch(&path));
                let mut sink = Sink {
                    out: &mut out,
                    orphans: &mut Vec::new(),
                };
                match rename_into(reader, Some(&path), &only, &mut sink) {
                    Err(Error::NotFound { .. }) => continue,
                    other => other?,
                }
            }
        }
        out.finish().map_err(|e| Error::io("tar", e))?;
        Ok(())
    })
}

/// Where [`rename_into`] writes, and what it has written.
struct Sink<'a, W: Write> {
    out: &'a mut tar::Builder<W>,
    /// Wanted hard links, to fetch again as regular files.
    orphans: &'a mut Vec<RelPath>,
}

fn rename_into<R: Read, W: Write>(
    reader: R,
    prefix: Option<&RelPath>,
    filter: &Filter,
    sink: &mut Sink<'_, W>,
) -> Result<()> {
    let excludes = &filter.excludes;
    let out = &mut *sink.out;
    let mut archive = tar::Archive::new(reader);
    let entries = archive.entries().map_err(read_err)?;
    for entry in entries {
        let mut entry = entry.map_err(read_err)?;
        let raw = entry.path_bytes().into_owned();
        let Ok(raw) = String::from_utf8(raw) else {
            tracing::warn!("skipping a non-UTF-8 name in the container's archive");
            continue;
        };
        let Some(path) = rename(&raw, prefix)? else {
            continue;
        };
        if sandbox_core::scripted::in_stage(&path)
            || excludes.covers(&path)
            || filter.wanted.as_ref().is_some_and(|w| !w.covers(&path))
        {
            continue;
        }
        let h0 = entry.header();
        let kind = h0.entry_type();
        let mode = h0.mode().unwrap_or(0o644) & 0o7777;
        let mtime = h0.mtime().unwrap_or(0);
        let (uid, gid) = (h0.uid().unwrap_or(0), h0.gid().unwrap_or(0));
        let mut h = tar::Header::new_gnu();
        h.set_mode(mode);
        h.set_mtime(mtime);
        h.set_uid(uid);
        h.set_gid(gid);
        let res = match kind {
            tar::EntryType::Regular | tar::EntryType::Continuous => {
                h.set_entry_type(tar::EntryType::Regular);
                h.set_size(entry.size());
                out.append_data(&mut h, path.as_str(), &mut entry)
            }
            tar::EntryType::Directory => {
                h.set_entry_type(tar::EntryType::Directory);
                h.set_size(0);
                out.append_data(&mut h, path.as_str(), io::empty())
            }
            tar::EntryType::Symlink => {
                let Some(target) = entry.link_name_bytes() else {
                    continue;
                };
                let target = String::from_utf8_lossy(&target).into_owned();
                h.set_entry_type(tar::EntryType::Symlink);
                h.set_mode(0o777);
                h.set_size(0);
                out.append_link(&mut h, path.as_str(), target)
            }
            tar::EntryType::Link => {
                let Some(target) = entry.link_name_bytes() else {
                    continue;
                };
                let target = String::from_utf8_lossy(&target).into_owned();
                let Some(target) = rename(&target, prefix)? else {
                    continue;
                };
                if filter.wanted.is_some() {
                    // A path list asks for content: the snapshot engine reads regular files
                    // only, so a hard link is fetched again on its own (as a regular file).
                    if filter.refetch.is_some() {
                        sink.orphans.push(path);
                    } else {
                        tracing::warn!(path = %path, "skipping a hard link in a path-list export");
                    }
                    continue;
                }
                if excludes.covers(&target) {
                    tracing::warn!(path = %path, target = %target, "skipping a hard link to an excluded file");
                    continue;
                }
                h.set_entry_type(tar::EntryType::Link);
                h.set_size(0);
                out.append_link(&mut h, path.as_str(), target.as_str())
            }
            _ => continue, // devices, fifos, sockets: never archived
        };
        res.map_err(|e| Error::io(path.as_str(), e))?;
    }
    Ok(())
}

/// The engine names entries `<basename of the requested path>/rest`: drop the first component
/// and put `prefix` in its place. `None` for the requested item itself when it is the root.
fn rename(raw: &str, prefix: Option<&RelPath>) -> Result<Option<RelPath>> {
    let trimmed = raw.trim_start_matches("./").trim_end_matches('/');
    let rest = trimmed.split_once('/').map(|(_, rest)| rest);
    let path = match (prefix, rest) {
        (None, None) => return Ok(None),
        (None, Some(rest)) => RelPath::new(rest),
        (Some(p), None) => Ok(p.clone()),
        (Some(p), Some(rest)) => p.join(rest),
    };
    match path {
        Ok(p) => Ok(Some(p)),
        Err(e) => Err(Error::unsafe_archive(raw, e.to_string())),
    }
}

/// Checks an import entry may be written: called with each entry's workspace-relative path
/// (and whether it is a directory) before the entry is passed on.
pub(crate) type EntryCheck = Box<dyn FnMut(&RelPath, bool) -> Result<()> + Send>;

/// Re-emit core's (already validated) archive, dropping entries at or under `drop` and
/// running `check` on each kept entry first. The output ends with the first error.
pub(crate) fn filter_import(
    input: ByteStream,
    drop: Vec<RelPath>,
    mut check: Option<EntryCheck>,
) -> ByteStream {
    stream::spawn_writer(DEPTH, move |w| {
        let reader = stream::blocking_reader(input);
        let mut out = builder(w);
        let mut archive = tar::Archive::new(reader);
        let entries = archive.entries().map_err(read_err)?;
        for entry in entries {
            let mut entry = entry.map_err(read_err)?;
            let raw = entry.path_bytes().into_owned();
            let raw = String::from_utf8_lossy(&raw).into_owned();
            let trimmed = raw.trim_start_matches("./");
            if trimmed.is_empty() || trimmed == "." {
                continue;
            }
            let path = RelPath::new(trimmed)?;
            if drop.iter().any(|d| path.starts_with(d)) {
                continue;
            }
            let kind = entry.header().entry_type();
            if let Some(check) = check.as_mut() {
                check(&path, kind.is_dir())?;
            }
            let mut h = entry.header().clone();
            match kind {
                tar::EntryType::Symlink | tar::EntryType::Link => {
                    let target = entry
                        .link_name_bytes()
                        .map(|t| String::from_utf8_lossy(&t).into_owned())
                        .unwrap_or_default();
                    out.append_link(&mut h, path.as_str(), target)
                }
                _ => out.append_data(&mut h, path.as_str(), &mut entry),
            }
            .map_err(|e| Error::io(path.as_str(), e))?;
        }
        io::copy(&mut archive.into_inner(), &mut io::sink()).map_err(read_err)?;
        out.finish().map_err(|e| Error::io("tar", e))?;
        Ok(())
    })
}

/// A tar holding only directory entries for `dirs` (in order).
pub(crate) fn dirs_tar(dirs: &[String], mode: u32) -> Result<Vec<u8>> {
    let mut out = builder(Vec::new());
    for d in dirs {
        let mut h = tar::Header::new_gnu();
        h.set_entry_type(tar::EntryType::Directory);
        h.set_mode(mode);
        h.set_size(0);
        h.set_mtime(now());
        out.append_data(&mut h, format!("{d}/"), io::empty())
            .map_err(|e| Error::io(d, e))?;
    }
    out.into_inner().map_err(|e| Error::io("tar", e))
}

/// A tar holding one file.
pub(crate) fn file_tar(path: &RelPath, data: &[u8], mode: u32) -> Result<Vec<u8>> {
    let mut out = builder(Vec::new());
    let mut h = tar::Header::new_gnu();
    h.set_entry_type(tar::EntryType::Regular);
    h.set_mode(mode & 0o7777);
    h.set_size(data.len() as u64);
    h.set_mtime(now());
    out.append_data(&mut h, path.as_str(), data)
        .map_err(|e| Error::io(path.as_str(), e))?;
    out.into_inner().map_err(|e| Error::io("tar", e))
}

/// The first entry of a tar of one item: `Ok(File(bytes))`, or the link target of a symlink.
pub(crate) enum Single {
    File(Vec<u8>),
    Symlink(String),
    Dir,
    Other,
}

/// Read the single item of an engine download, keeping at most `limit` bytes of a file.
pub(crate) fn read_single<R: Read>(reader: R, limit: u64) -> Result<Single> {
    let mut archive = tar::Archive::new(reader);
    let mut entries = archive.entries().map_err(read_err)?;
    let Some(entry) = entries.next() else {
        return Ok(Single::Other);
    };
    let mut entry = entry.map_err(read_err)?;
    Ok(match entry.header().entry_type() {
        tar::EntryType::Regular | tar::EntryType::Continuous => {
            if entry.size() > limit {
                return Err(Error::invalid(
                    "file",
                    format!("larger than the {limit}-byte read limit"),
                ));
            }
            let mut buf = Vec::with_capacity(sandbox_core::stream::capacity_for(entry.size()));
            entry.read_to_end(&mut buf).map_err(read_err)?;
            Single::File(buf)
        }
        tar::EntryType::Symlink => Single::Symlink(
            entry
                .link_name_bytes()
                .map(|t| String::from_utf8_lossy(&t).into_owned())
                .unwrap_or_default(),
        ),
        tar::EntryType::Directory => Single::Dir,
        _ => Single::Other,
    })
}

fn builder<W: Write>(w: W) -> tar::Builder<W> {
    let mut b = tar::Builder::new(w);
    b.follow_symlinks(false);
    b.mode(tar::HeaderMode::Complete);
    b
}

/// Errors that travelled through a reader come back as themselves; others are a broken
/// archive from the engine.
fn read_err(e: io::Error) -> Error {
    match Error::from(e) {
        Error::Io { source, .. } => Error::Backend {
            backend: crate::BACKEND,
            operation: "archive",
            message: format!("reading the engine's archive: {source}"),
            source: Some(Box::new(source)),
        },
        ours => ours,
    }
}

fn now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// Wraps a stream to record whether it ended cleanly (no error, read to its end), so an
/// upload the engine acknowledged early is not mistaken for a complete one.
pub(crate) fn watch_end(
    input: ByteStream,
) -> (ByteStream, std::sync::Arc<std::sync::atomic::AtomicBool>) {
    use futures::StreamExt;
    use std::sync::atomic::{AtomicBool, Ordering};
    let clean = std::sync::Arc::new(AtomicBool::new(false));
    let flag = clean.clone();
    let mut failed = false;
    let mut input = input;
    let out = futures::stream::poll_fn(move |cx| {
        let r = input.poll_next_unpin(cx);
        match &r {
            std::task::Poll::Ready(Some(Err(_))) => failed = true,
            std::task::Poll::Ready(None) if !failed => flag.store(true, Ordering::SeqCst),
            _ => {}
        }
        r
    })
    .boxed();
    (out, clean)
}

/// Drain `input` into an anonymous temporary file and stream it back.
pub(crate) async fn spool(input: ByteStream) -> Result<ByteStream> {
    use futures::StreamExt;
    use tokio::io::{AsyncSeekExt, AsyncWriteExt};
    let file = tokio::task::spawn_blocking(tempfile::tempfile)
        .await
        .map_err(|e| Error::backend(crate::BACKEND, "spool", e.to_string()))?
        .map_err(|e| Error::io("temporary file", e))?;
    let mut file = tokio::fs::File::from_std(file);
    let mut input = input;
    while let Some(chunk) = input.next().await {
        file.write_all(&chunk?)
            .await
            .map_err(|e| Error::io("temporary file", e))?;
    }
    file.flush()
        .await
        .map_err(|e| Error::io("temporary file", e))?;
    file.seek(std::io::SeekFrom::Start(0))
        .await
        .map_err(|e| Error::io("temporary file", e))?;
    Ok(stream::from_reader(file))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rename_strips_the_engines_first_component() {
        let p = |s: &str| RelPath::new(s).unwrap();
        assert_eq!(rename("workspace/", None).unwrap(), None);
        assert_eq!(rename("workspace/a/b", None).unwrap(), Some(p("a/b")));
        assert_eq!(rename("./workspace/a", None).unwrap(), Some(p("a")));
        assert_eq!(rename("x", Some(&p("sub/x"))).unwrap(), Some(p("sub/x")));
        assert_eq!(
            rename("x/y/", Some(&p("sub/x"))).unwrap(),
            Some(p("sub/x/y"))
        );
        assert!(rename("workspace/../etc", None).is_err());
    }
}
