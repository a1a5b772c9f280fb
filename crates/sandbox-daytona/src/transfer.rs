//! Tar archives to and from the sandbox's own `tar` (copied from sandbox-k8s's `transfer`, pending a home in core): the export filter (exclusions, staging
//! directories) and what a merge import must check in the live workspace first.

use std::collections::{BTreeSet, HashSet};
use std::io::Read;

use bytes::Bytes;
use sandbox_core::archive::{self, ArchivePolicy, Excludes};
use sandbox_core::stream::{self, ByteStream};
use sandbox_core::{Error, RelPath, Result};

/// Names of the staging directories a `Replace` import makes in the workspace root.
pub(crate) const STAGE_PREFIX: &str = ".sandbox-stage-";

/// Whether `path` lies in a staging directory.
pub(crate) fn in_stage(path: &RelPath) -> bool {
    path.components()
        .next()
        .is_some_and(|c| c.starts_with(STAGE_PREFIX))
}

/// The pod's `tar` output (names like `./a/b`) without excluded paths and staging
/// directories, validated and re-emitted canonically by core.
pub(crate) fn filter_export(raw: ByteStream, excludes: Excludes) -> ByteStream {
    let filtered = stream::spawn_writer(8, move |w| {
        let mut archive = tar::Archive::new(stream::blocking_reader(raw));
        let mut out = tar::Builder::new(w);
        let corrupt = |e: std::io::Error| match Error::from(e) {
            Error::Io { source, .. } => Error::backend(
                crate::BACKEND,
                "export",
                format!("the sandbox's tar archive is corrupt: {source}"),
            ),
            ours => ours,
        };
        for entry in archive.entries().map_err(corrupt)? {
            let mut entry = entry.map_err(corrupt)?;
            let raw_path = entry.path_bytes().into_owned();
            let name = String::from_utf8_lossy(&raw_path);
            let trimmed = name.trim_start_matches("./").trim_end_matches('/');
            if trimmed.is_empty() || trimmed == "." {
                continue;
            }
            let Ok(path) = RelPath::new(trimmed) else {
                continue;
            };
            if in_stage(&path) || excludes.covers(&path) {
                continue;
            }
            // A fresh header: the pod's carries its own name bytes, which a shorter name
            // would leave behind its NUL.
            let theirs = entry.header();
            let kind = theirs.entry_type();
            let mut header = tar::Header::new_gnu();
            header.set_entry_type(kind);
            header.set_mode(theirs.mode().unwrap_or(0o644));
            header.set_mtime(theirs.mtime().unwrap_or(0));
            header.set_uid(theirs.uid().unwrap_or(0));
            header.set_gid(theirs.gid().unwrap_or(0));
            header.set_size(if kind.is_file() { entry.size() } else { 0 });
            if kind.is_symlink() || kind.is_hard_link() {
                let target = entry
                    .link_name_bytes()
                    .map(|t| String::from_utf8_lossy(&t).into_owned())
                    .unwrap_or_default();
                let target = if kind.is_hard_link() {
                    target.trim_start_matches("./").to_owned()
                } else {
                    target
                };
                out.append_link(&mut header, path.as_str(), target)
                    .map_err(corrupt)?;
            } else {
                out.append_data(&mut header, path.as_str(), &mut entry)
                    .map_err(corrupt)?;
            }
        }
        out.finish().map_err(corrupt)?;
        // Read to the end, so the command's stream is not cut off.
        let mut rest = archive.into_inner();
        std::io::copy(&mut rest, &mut std::io::sink()).map_err(corrupt)?;
        Ok(())
    });
    archive::sanitize(filtered, ArchivePolicy::default())
}

/// The directories a merge writes into that the archive does not create itself: each must be
/// a real directory (not a symlink) in the live workspace, or missing.
pub(crate) fn merge_ancestors(archive: &Bytes) -> Result<BTreeSet<RelPath>> {
    let mut reader = archive.as_ref();
    let mut tar = tar::Archive::new(&mut reader as &mut dyn Read);
    let mut made: HashSet<RelPath> = HashSet::new();
    let mut needed = BTreeSet::new();
    for entry in tar
        .entries()
        .map_err(|e| Error::unsafe_archive("archive", e.to_string()))?
    {
        let entry = entry.map_err(|e| Error::unsafe_archive("archive", e.to_string()))?;
        let name = String::from_utf8_lossy(&entry.path_bytes()).into_owned();
        let trimmed = name.trim_start_matches("./").trim_end_matches('/');
        if trimmed.is_empty() || trimmed == "." {
            continue;
        }
        let path = RelPath::new(trimmed)?;
        let mut p = path.parent();
        while let Some(a) = p {
            p = a.parent();
            if !made.contains(&a) {
                needed.insert(a);
            }
        }
        if entry.header().entry_type().is_dir() {
            made.insert(path);
        }
    }
    Ok(needed)
}

#[cfg(test)]
mod tests {
    use super::*;
    use futures::TryStreamExt;

    fn tar_of(entries: &[(&str, Option<&str>)]) -> Vec<u8> {
        let mut b = tar::Builder::new(Vec::new());
        for (name, content) in entries {
            let mut h = tar::Header::new_gnu();
            match content {
                Some(c) => {
                    h.set_entry_type(tar::EntryType::Regular);
                    h.set_size(c.len() as u64);
                    h.set_mode(0o644);
                    b.append_data(&mut h, name, c.as_bytes()).unwrap();
                }
                None => {
                    h.set_entry_type(tar::EntryType::Directory);
                    h.set_size(0);
                    h.set_mode(0o755);
                    b.append_data(&mut h, name, std::io::empty()).unwrap();
                }
            }
        }
        b.into_inner().unwrap()
    }

    fn names(data: &[u8]) -> Vec<String> {
        let mut a = tar::Archive::new(data);
        a.entries()
            .unwrap()
            .map(|e| e.unwrap().path().unwrap().to_string_lossy().into_owned())
            .collect()
    }

    #[tokio::test]
    async fn export_filter_drops_excluded_and_staged() {
        let raw = tar_of(&[
            ("./", None),
            ("./a.txt", Some("a")),
            ("./skip/", None),
            ("./skip/x", Some("x")),
            ("./.sandbox-stage-1/", None),
            ("./.sandbox-stage-1/y", Some("y")),
            ("./keep/z.log", Some("z")),
            ("./keep/z.txt", Some("z")),
        ]);
        let excludes =
            Excludes::new(vec![RelPath::new("skip").unwrap()], &["**/*.log".into()]).unwrap();
        let out: Vec<Bytes> = filter_export(stream::once(raw), excludes)
            .try_collect()
            .await
            .unwrap();
        let out: Vec<u8> = out.concat();
        assert_eq!(names(&out), ["a.txt", "keep/z.txt"]);
    }

    #[tokio::test]
    async fn export_filter_reports_a_corrupt_stream() {
        let mut raw = tar_of(&[("./a.txt", Some("aaaa"))]);
        raw.truncate(600);
        let res: Result<Vec<Bytes>> = filter_export(stream::once(raw), Excludes::default())
            .try_collect()
            .await;
        assert!(res.is_err());
    }

    #[test]
    fn merge_checks_only_what_the_archive_does_not_make() {
        let data = Bytes::from(tar_of(&[
            ("new/", None),
            ("new/f", Some("1")),
            ("old/sub/f", Some("2")),
            ("top", Some("3")),
        ]));
        let needed: Vec<String> = merge_ancestors(&data)
            .unwrap()
            .into_iter()
            .map(|p| p.as_str().to_owned())
            .collect();
        assert_eq!(needed, ["old", "old/sub"]);
    }
}
