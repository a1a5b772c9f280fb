//! Workspace operations for boxes driven by `sh` scripts (Kubernetes, E2B, Daytona): a
//! backend provides a [`ScriptRunner`] (run `sh -c <script> sandbox <args…>`, captured or
//! streamed) and gets `list`, `export`, `import` (Merge and staged Replace), `remove` and
//! files through commands, all written once here on top of the [`posix`](crate::posix)
//! scripts. The box's own `tar` makes and unpacks archives; what it produces is filtered and
//! re-emitted canonically by core's sanitizer, what it unpacks comes from core already
//! validated.

use std::collections::{BTreeSet, HashSet};
use std::io::Read;

use async_trait::async_trait;
use bytes::Bytes;
use futures::StreamExt as _;

use crate::archive::{self, ArchivePolicy, Excludes, Wanted};
use crate::backend::{ExportRequest, ImportMode, TreeEntry};
use crate::error::{Error, Result};
use crate::exec::ExecResult;
use crate::path::RelPath;
use crate::posix;
use crate::stream::{self, ByteStream};

/// Names of the staging directories a `Replace` import makes in the workspace root.
pub const STAGE_PREFIX: &str = ".sandbox-stage-";

/// Largest archive a `Merge` import holds in memory (merges carry entries and projection, not
/// whole workspaces).
pub const MERGE_LIMIT: usize = 256 << 20;

/// Largest file [`read_file`] returns.
pub const READ_LIMIT: usize = 1 << 30;

/// Maps a script's non-zero exit code and stderr to a typed error (`None`: a generic one).
pub type ExitErrors = fn(i32, &str) -> Option<Error>;

/// How a backend runs scripts in its box.
#[async_trait]
pub trait ScriptRunner: Send + Sync {
    /// The backend's tag (errors carry it).
    fn backend(&self) -> &'static str;

    /// The workspace root inside the box.
    fn root(&self) -> &str;

    /// Run `sh -c <script> sandbox <args…>` to its end with each output captured up to
    /// `limit` bytes (`stdout_truncated` tells), and fail with a typed error unless it exited
    /// 0 (`errors` first, then [`Error::Backend`] naming `operation` and stderr).
    async fn script(
        &self,
        operation: &'static str,
        script: &str,
        args: Vec<String>,
        limit: usize,
        errors: ExitErrors,
    ) -> Result<ExecResult>;

    /// Run it with `input` on stdin (closed at its end; none: empty) and return its stdout as
    /// a stream. A non-zero exit is an error item at the end of the stream (`errors` first).
    async fn stream_script(
        &self,
        operation: &'static str,
        script: &str,
        args: Vec<String>,
        input: Option<ByteStream>,
        errors: ExitErrors,
    ) -> Result<ByteStream>;

    /// Whether [`upload`](Self::upload) works: the box has a file API that takes archives and
    /// files faster than a command's stdin (then imports and writes go through it).
    fn can_upload(&self) -> bool {
        false
    }

    /// Store `data` as the file `path` (absolute, in the box), replacing it.
    async fn upload(&self, path: &str, data: ByteStream) -> Result<()> {
        let _ = (path, data);
        Err(Error::NotSupported {
            backend: self.backend(),
            operation: "uploads",
        })
    }
}

/// No exit code has a meaning of its own.
pub fn no_errors(_: i32, _: &str) -> Option<Error> {
    None
}

/// Export: `$1` root, `$2` `all` or `some`, then the paths (missing ones are skipped).
pub const EXPORT_SCRIPT: &str = r#"
cd "$1" 2>/dev/null || exit 3
mode=$2; shift 2
[ "$mode" = all ] && exec tar -cf - .
for p do
  shift
  if [ -e "$p" ] || [ -L "$p" ]; then set -- "$@" "$p"; fi
done
[ $# -eq 0 ] && exit 0
exec tar -cf - -- "$@"
"#;

/// Merge import: `$1` root, then the directories entries go through that the archive does
/// not create: each must be a real directory or missing. Then extract stdin.
pub const MERGE_SCRIPT: &str = r#"
R=$1; shift
for a do
  if [ -L "$R/$a" ]; then echo "symlink:$a" >&2; exit 5; fi
  if [ -e "$R/$a" ] && [ ! -d "$R/$a" ]; then echo "notdir:$a" >&2; exit 6; fi
done
mkdir -p -- "$R" && cd "$R" && exec tar -xf -
"#;

/// Replace import, first step: extract stdin into the staging directory `$1/$2`.
pub const STAGE_SCRIPT: &str = r#"mkdir -p -- "$1/$2" && cd "$1/$2" && exec tar -xf -"#;

/// Write stdin to `$2` under root `$1` atomically with mode `$3`.
pub const WRITE_SCRIPT: &str = r#"
R=$1; p=$2; d=$R/$p; d=${d%/*}
mkdir -p -- "$d" || exit 1
[ -L "$d" ] && { echo "symlink parent" >&2; exit 5; }
t=$d/.sandbox-write.$$
cat > "$t" && chmod "$3" "$t" && mv -f -- "$t" "$R/$p" || { rm -f -- "$t"; exit 1; }
"#;

/// Move the uploaded file `$3` to `$2` under root `$1` with mode `$4`, refusing a symlinked
/// parent (exit 5); the uploaded file never stays behind.
pub const PLACE_SCRIPT: &str = r#"
R=$1; p=$2; u=$3; d=$R/$p; d=${d%/*}
mkdir -p -- "$d" || { rm -f -- "$u"; exit 1; }
[ -L "$d" ] && { rm -f -- "$u"; echo "symlink parent" >&2; exit 5; }
chmod "$4" "$u" && mv -f -- "$u" "$R/$p" || { rm -f -- "$u"; exit 1; }
"#;

/// `script` with its stdin read from the file named by an extra first argument, which is
/// removed once open (the script's own arguments follow it unchanged).
fn stdin_from_file(script: &str) -> String {
    format!("F=$1; shift\nexec < \"$F\" || exit 1\nrm -f -- \"$F\"\n{script}")
}

/// Read `$1`: exit 4 for a directory, 3 when missing.
pub const READ_SCRIPT: &str = r#"[ -d "$1" ] && exit 4; [ -e "$1" ] || exit 3; exec cat -- "$1""#;

/// Is the root a real directory: prints `yes` or `no`.
const ROOT_SCRIPT: &str = r#"if [ -d "$1" ] && [ ! -L "$1" ]; then echo yes; else echo no; fi"#;

fn export_errors(code: i32, stderr: &str) -> Option<Error> {
    (code == 3).then(|| Error::NotFound {
        what: "workspace root",
        key: stderr.trim().to_owned(),
    })
}

/// The archive and write scripts' exits: 5 a symlink in the way, 6 a parent that is not a
/// directory.
pub fn merge_errors(code: i32, stderr: &str) -> Option<Error> {
    let what = stderr.trim();
    match code {
        5 => Some(Error::unsafe_archive(
            what,
            format!("would write through a symlink in the workspace ({what})"),
        )),
        6 => Some(Error::unsafe_archive(
            what,
            format!("an entry's parent is not a directory ({what})"),
        )),
        _ => None,
    }
}

/// Whether `path` lies in a staging directory.
pub fn in_stage(path: &RelPath) -> bool {
    path.components()
        .next()
        .is_some_and(|c| c.starts_with(STAGE_PREFIX))
}

/// Run `script` fed with `input` to its end; fails unless it exited 0.
pub async fn feed(
    runner: &dyn ScriptRunner,
    operation: &'static str,
    script: &str,
    args: Vec<String>,
    input: ByteStream,
    errors: ExitErrors,
) -> Result<()> {
    let mut out = runner
        .stream_script(operation, script, args, Some(input), errors)
        .await?;
    while let Some(chunk) = out.next().await {
        chunk?;
    }
    Ok(())
}

/// Run `script` with `archive` on its stdin: through an uploaded file where the runner can
/// upload (removed whatever happens), else fed to the command.
async fn feed_archive(
    runner: &dyn ScriptRunner,
    operation: &'static str,
    script: &str,
    args: Vec<String>,
    archive: ByteStream,
    errors: ExitErrors,
) -> Result<()> {
    if !runner.can_upload() {
        return feed(runner, operation, script, args, archive, errors).await;
    }
    let file = format!("/tmp/.sandbox-in-{}", uuid::Uuid::new_v4().simple());
    let ran = async {
        runner.upload(&file, archive).await?;
        let mut with = vec![file.clone()];
        with.extend(args);
        runner
            .script(operation, &stdin_from_file(script), with, 1 << 20, errors)
            .await
    }
    .await;
    if ran.is_err()
        && let Err(e) = runner
            .script(operation, "rm -f -- \"$1\"", vec![file], 4096, no_errors)
            .await
    {
        tracing::warn!(error = %e, "removing an uploaded archive");
    }
    ran.map(|_| ())
}

/// Whether the workspace root is a real directory.
pub async fn root_exists(runner: &dyn ScriptRunner) -> Result<bool> {
    let r = runner
        .script(
            "workspace check",
            ROOT_SCRIPT,
            vec![runner.root().to_owned()],
            4096,
            no_errors,
        )
        .await?;
    Ok(r.stdout_str().trim() == "yes")
}

/// Every entry under the root (staging directories left out), sorted by path.
pub async fn list(runner: &dyn ScriptRunner) -> Result<Vec<TreeEntry>> {
    let token = format!("\u{1}{}\u{1}", uuid::Uuid::new_v4().simple());
    let r = runner
        .script(
            "list",
            posix::LIST_SCRIPT,
            vec![runner.root().to_owned(), token.clone()],
            256 << 20,
            no_errors,
        )
        .await?;
    if r.stdout_truncated {
        return Err(Error::backend(
            runner.backend(),
            "list",
            "listing larger than 256 MiB",
        ));
    }
    let mut entries = posix::parse_listing(runner.backend(), &r.stdout, &token)?;
    entries.retain(|e| !in_stage(&e.path));
    entries.sort_by(|a, b| a.path.cmp(&b.path));
    Ok(entries)
}

/// Bytes of paths an export passes as command arguments, at most. A longer list (a snapshot
/// of many changed files) exports the whole tree and keeps only the listed paths on the way:
/// Linux caps one argument at 128 KiB, and some runners pass the whole command as one.
pub const MAX_PATH_ARG_BYTES: usize = 32 << 10;

/// The workspace (or the requested part) as a sanitized tar stream.
pub async fn export(runner: &dyn ScriptRunner, request: &ExportRequest) -> Result<ByteStream> {
    let excludes = Excludes::new(request.exclude.clone(), &request.exclude_globs)?;
    let mut args = vec![runner.root().to_owned()];
    let mut keep = None;
    let listed: Option<Vec<&RelPath>> = request
        .paths
        .as_ref()
        .map(|paths| paths.iter().filter(|p| !excludes.covers(p)).collect());
    match listed {
        None => args.push("all".into()),
        Some(paths)
            if paths.iter().map(|p| p.as_str().len() + 1).sum::<usize>() > MAX_PATH_ARG_BYTES =>
        {
            args.push("all".into());
            keep = Some(Wanted::new(paths.into_iter().cloned()));
        }
        Some(paths) => {
            args.push("some".into());
            args.extend(paths.iter().map(|p| p.as_str().to_owned()));
        }
    }
    if args[1] == "all" && !root_exists(runner).await? {
        return Err(Error::NotFound {
            what: "workspace root",
            key: runner.root().to_owned(),
        });
    }
    let raw = runner
        .stream_script("export", EXPORT_SCRIPT, args, None, export_errors)
        .await?;
    Ok(filter_export(runner.backend(), raw, excludes, keep))
}

/// Apply a (validated) tar stream: `Merge` after checking the live parents it writes
/// through; `Replace` by extracting into a staging directory and swapping it in with
/// [`posix::SWAP_SCRIPT`] only once the whole stream arrived.
pub async fn import(
    runner: &dyn ScriptRunner,
    archive: ByteStream,
    mode: ImportMode,
) -> Result<()> {
    match mode {
        ImportMode::Merge => merge(runner, archive).await,
        ImportMode::Replace { keep } => replace(runner, archive, keep).await,
    }
}

async fn merge(runner: &dyn ScriptRunner, archive: ByteStream) -> Result<()> {
    let data = stream::collect(archive, MERGE_LIMIT).await?;
    let ancestors = merge_ancestors(&data)?;
    let mut args = vec![runner.root().to_owned()];
    args.extend(ancestors.iter().map(|a| a.as_str().to_owned()));
    feed(
        runner,
        "import",
        MERGE_SCRIPT,
        args,
        stream::once(data),
        merge_errors,
    )
    .await
}

async fn replace(runner: &dyn ScriptRunner, archive: ByteStream, keep: Vec<RelPath>) -> Result<()> {
    for k in &keep {
        if k.as_str().contains('\n') {
            return Err(Error::invalid(
                "keep path",
                format!("`{k}` contains a newline"),
            ));
        }
    }
    let stage = format!("{STAGE_PREFIX}{}", uuid::Uuid::new_v4().simple());
    let root = runner.root().to_owned();
    if let Err(e) = feed_archive(
        runner,
        "import",
        STAGE_SCRIPT,
        vec![root.clone(), stage.clone()],
        archive,
        no_errors,
    )
    .await
    {
        let dir = format!("{}/{stage}", root.trim_end_matches('/'));
        if let Err(c) = runner
            .script("import", "rm -rf -- \"$1\"", vec![dir], 4096, no_errors)
            .await
        {
            tracing::warn!(error = %c, "removing a staging directory");
        }
        return Err(e);
    }
    let mut k = String::from("\n");
    for p in &keep {
        k.push_str(p.as_str());
        k.push('\n');
    }
    runner
        .script(
            "import",
            posix::SWAP_SCRIPT,
            vec![root, stage, k],
            1 << 20,
            no_errors,
        )
        .await
        .map(|_| ())
}

/// Remove paths (recursively, never following symlinks); missing ones are not an error.
pub async fn remove(runner: &dyn ScriptRunner, paths: &[RelPath]) -> Result<()> {
    if paths.is_empty() {
        return Ok(());
    }
    let mut args = vec![runner.root().to_owned()];
    args.extend(paths.iter().map(|p| p.as_str().to_owned()));
    runner
        .script("remove", posix::REMOVE_SCRIPT, args, 1 << 20, no_errors)
        .await
        .map(|_| ())
}

/// Read one file through `cat` (at most [`READ_LIMIT`] bytes).
pub async fn read_file(runner: &dyn ScriptRunner, path: &RelPath) -> Result<Bytes> {
    let boxed = path.to_box(runner.root());
    let r = runner
        .script(
            "read",
            READ_SCRIPT,
            vec![boxed.clone()],
            READ_LIMIT,
            |code, _| match code {
                3 => Some(Error::NotFound {
                    what: "file",
                    key: String::new(),
                }),
                4 => Some(Error::invalid("file", "is a directory")),
                _ => None,
            },
        )
        .await
        .map_err(|e| match e {
            Error::NotFound { what, .. } => Error::NotFound {
                what,
                key: boxed.clone(),
            },
            Error::InvalidInput { what, .. } => {
                Error::invalid(what, format!("`{path}` is a directory"))
            }
            other => other,
        })?;
    if r.stdout_truncated {
        return Err(Error::invalid(
            "file",
            format!("`{path}` is larger than 1 GiB"),
        ));
    }
    Ok(r.stdout)
}

/// Write one file atomically (parents made; a symlinked parent is refused): uploaded beside
/// the workspace under a staging name (listings and exports skip it; the move is a rename)
/// and moved into place where the runner can upload, else through a command fed the data.
pub async fn write_file(
    runner: &dyn ScriptRunner,
    path: &RelPath,
    data: Bytes,
    mode: u32,
) -> Result<()> {
    let mode = format!("{:04o}", mode & 0o7777);
    if runner.can_upload() {
        let upload = format!(
            "{}/{STAGE_PREFIX}w{}",
            runner.root().trim_end_matches('/'),
            uuid::Uuid::new_v4().simple()
        );
        runner.upload(&upload, stream::once(data)).await?;
        let args = vec![
            runner.root().to_owned(),
            path.as_str().to_owned(),
            upload,
            mode,
        ];
        return runner
            .script("write", PLACE_SCRIPT, args, 4096, merge_errors)
            .await
            .map(|_| ());
    }
    let args = vec![runner.root().to_owned(), path.as_str().to_owned(), mode];
    feed(
        runner,
        "write",
        WRITE_SCRIPT,
        args,
        stream::once(data),
        merge_errors,
    )
    .await
}

/// The box's `tar` output (names like `./a/b`) without excluded paths and staging
/// directories — and, given `keep`, only the entries that are or lie under one of those paths
/// — validated and re-emitted canonically by core.
pub fn filter_export(
    backend: &'static str,
    raw: ByteStream,
    excludes: Excludes,
    keep: Option<Wanted>,
) -> ByteStream {
    let kept = move |path: &RelPath| keep.as_ref().is_none_or(|keep| keep.covers(path));
    // A command's output comes in small frames: batched, the parser wakes per batch.
    let raw = stream::batched(raw, stream::CHUNK);
    let filtered = stream::spawn_writer(8, move |w| {
        let mut archive = tar::Archive::new(stream::blocking_reader(raw));
        let mut out = tar::Builder::new(w);
        let corrupt = |e: std::io::Error| match Error::from(e) {
            Error::Io { source, .. } => Error::backend(
                backend,
                "export",
                format!("the box's tar stream is corrupt: {source}"),
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
            if in_stage(&path) || excludes.covers(&path) || !kept(&path) {
                continue;
            }
            // A fresh header: the box's carries its own name bytes, which a shorter name
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
pub fn merge_ancestors(archive: &Bytes) -> Result<BTreeSet<RelPath>> {
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
        let out: Vec<Bytes> = filter_export("test", stream::once(raw), excludes, None)
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
        let res: Result<Vec<Bytes>> =
            filter_export("test", stream::once(raw), Excludes::default(), None)
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

    /// Runs the scripts with the host's `sh` and `tar` in a directory; records the longest
    /// argument list it was given.
    struct HostRunner {
        root: String,
        most_arg_bytes: std::sync::atomic::AtomicUsize,
    }

    impl HostRunner {
        async fn run(&self, script: &str, args: &[String]) -> Result<std::process::Output> {
            let bytes = args.iter().map(|a| a.len() + 1).sum();
            self.most_arg_bytes
                .fetch_max(bytes, std::sync::atomic::Ordering::SeqCst);
            let out = tokio::process::Command::new("sh")
                .arg("-c")
                .arg(script)
                .arg("sandbox")
                .args(args)
                .stdin(std::process::Stdio::null())
                .output()
                .await
                .map_err(|e| Error::io("sh", e))?;
            assert!(
                out.status.success(),
                "{}",
                String::from_utf8_lossy(&out.stderr)
            );
            Ok(out)
        }
    }

    #[async_trait]
    impl ScriptRunner for HostRunner {
        fn backend(&self) -> &'static str {
            "host"
        }
        fn root(&self) -> &str {
            &self.root
        }
        async fn script(
            &self,
            _: &'static str,
            script: &str,
            args: Vec<String>,
            _: usize,
            _: ExitErrors,
        ) -> Result<ExecResult> {
            let out = self.run(script, &args).await?;
            Ok(ExecResult {
                exit_code: out.status.code(),
                stdout: out.stdout.into(),
                stderr: out.stderr.into(),
                stdout_truncated: false,
                stderr_truncated: false,
                timed_out: false,
                duration: std::time::Duration::ZERO,
            })
        }
        async fn stream_script(
            &self,
            _: &'static str,
            script: &str,
            args: Vec<String>,
            _: Option<ByteStream>,
            _: ExitErrors,
        ) -> Result<ByteStream> {
            Ok(stream::once(self.run(script, &args).await?.stdout))
        }
    }

    async fn exported_files(runner: &HostRunner, request: &ExportRequest) -> Vec<String> {
        let out: Vec<Bytes> = export(runner, request)
            .await
            .expect("export")
            .try_collect()
            .await
            .expect("stream");
        let out = out.concat();
        let mut a = tar::Archive::new(&out[..]);
        let mut files: Vec<String> = a
            .entries()
            .unwrap()
            .map(|e| e.unwrap())
            .filter(|e| e.header().entry_type().is_file())
            .map(|e| e.path().unwrap().to_string_lossy().into_owned())
            .collect();
        files.sort();
        files
    }

    /// A list of paths longer than a command line takes (a first snapshot of many files)
    /// exports the whole tree and keeps exactly the listed paths (and what lies under a listed
    /// directory), excludes still applied; a short list is passed as arguments.
    #[tokio::test]
    async fn a_long_path_list_exports_the_tree_and_keeps_the_listed_paths() {
        let dir = tempfile::tempdir().expect("tempdir");
        let root = dir.path().join("ws");
        let mut listed = Vec::new();
        let mut expected = Vec::new();
        for i in 0..2000 {
            let name = format!("d{}/{i:0>40}.txt", i % 3);
            let path = root.join(&name);
            std::fs::create_dir_all(path.parent().unwrap()).unwrap();
            std::fs::write(&path, i.to_string()).unwrap();
            if i % 4 != 0 {
                listed.push(RelPath::new(&name).unwrap());
                if i % 3 != 2 {
                    expected.push(name);
                }
            }
        }
        std::fs::create_dir_all(root.join("whole/sub")).unwrap();
        std::fs::write(root.join("whole/sub/x"), "x").unwrap();
        std::fs::write(root.join("wholesale"), "not under whole").unwrap();
        listed.push(RelPath::new("whole").unwrap());
        expected.push("whole/sub/x".into());
        expected.sort();
        let runner = HostRunner {
            root: root.to_str().unwrap().to_owned(),
            most_arg_bytes: Default::default(),
        };
        // Over the limit even without the excluded ones.
        let listed_bytes: usize = listed
            .iter()
            .filter(|p| !p.as_str().starts_with("d2/"))
            .map(|p| p.as_str().len() + 1)
            .sum();
        assert!(listed_bytes > MAX_PATH_ARG_BYTES, "{listed_bytes} bytes");
        let mut request = ExportRequest {
            paths: Some(listed),
            exclude: vec![RelPath::new("d2").unwrap()],
            ..Default::default()
        };
        assert_eq!(exported_files(&runner, &request).await, expected);
        let most = runner
            .most_arg_bytes
            .load(std::sync::atomic::Ordering::SeqCst);
        assert!(most < 1024, "{most} bytes of arguments");

        // A short list: the listed paths as arguments.
        runner
            .most_arg_bytes
            .store(0, std::sync::atomic::Ordering::SeqCst);
        let short = [
            "d0/".to_owned() + &format!("{:0>40}.txt", 3),
            "whole".into(),
        ];
        request.paths = Some(short.iter().map(|p| RelPath::new(p).unwrap()).collect());
        assert_eq!(
            exported_files(&runner, &request).await,
            [short[0].clone(), "whole/sub/x".into()]
        );
        let most = runner
            .most_arg_bytes
            .load(std::sync::atomic::Ordering::SeqCst);
        assert!(
            most > short[0].len() + short[1].len(),
            "the paths went as arguments ({most} bytes)"
        );
    }
}
