//! Running one command in a box: a new process group, a rebuilt environment, output read
//! concurrently with the wait, and a timeout that kills the whole group.

use std::future::Future;
use std::io;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::process::Stdio;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use nix::errno::Errno;
use nix::sys::signal::{Signal, killpg};
use nix::unistd::Pid;
use sandbox_core::{
    Captured, CapturedOutput, Command, Error, ExecRequest, ExecResult, RelPath, Result, read_capped,
};
use tokio::io::{AsyncRead, AsyncWriteExt, ReadBuf};
use tokio::sync::oneshot;
use tracing::Instrument as _;

use crate::BACKEND;
use crate::fsutil::{self, BindLink};
use crate::options::{EnvPolicy, LocalOptions, MINIMAL_LANG, MINIMAL_PATH};

/// How long output pipes may stay open after the command's process group is gone. Only a
/// process that left the group (`setsid`, `setpgid`) can hold them that long; its later output
/// is not waited for.
const READER_GRACE: Duration = Duration::from_secs(1);

/// What a box contributes to every exec.
pub(crate) struct ExecContext<'a> {
    pub options: &'a LocalOptions,
    pub workspace: &'a Path,
    pub spec_env: &'a std::collections::BTreeMap<String, String>,
    pub links: &'a [BindLink],
}

/// Run `request` in the box described by `cx`.
pub(crate) async fn run(cx: ExecContext<'_>, request: ExecRequest) -> Result<ExecResult> {
    let timeout = request.timeout.unwrap_or(cx.options.default_timeout);
    let (kind, argv) = match &request.command {
        Command::Shell(_) => {
            if cx.options.shell.is_empty() {
                return Err(Error::invalid(
                    "local options",
                    "the shell prefix is empty; set LocalOptions::shell",
                ));
            }
            let shell: Vec<&str> = cx.options.shell.iter().map(String::as_str).collect();
            ("shell", request.command.to_argv(&shell))
        }
        Command::Argv(_) => ("argv", request.command.to_argv(&[])),
    };
    if argv.is_empty() {
        return Err(Error::invalid("command", "the argument vector is empty"));
    }
    check_env(&request.env)?;
    check_env(cx.spec_env)?;
    check_env(&cx.options.extra_env)?;
    let cwd = resolve_cwd(&cx, request.cwd.as_deref()).await?;
    // Env values may be secrets and command lines may embed them: only the kind, the program
    // and where it runs are logged.
    let span = tracing::info_span!(
        "local_exec",
        kind,
        program = %argv[0],
        cwd = %cwd.display(),
        timeout_ms = timeout.as_millis() as u64,
    );
    spawn_and_collect(&cx, request, argv, cwd, timeout)
        .instrument(span)
        .await
}

async fn spawn_and_collect(
    cx: &ExecContext<'_>,
    request: ExecRequest,
    argv: Vec<String>,
    cwd: PathBuf,
    timeout: Duration,
) -> Result<ExecResult> {
    let mut cmd = tokio::process::Command::new(&argv[0]);
    cmd.args(&argv[1..])
        .current_dir(&cwd)
        // Its own process group, so that a timeout can kill everything the command started.
        .process_group(0)
        .stdin(if request.stdin.is_some() {
            Stdio::piped()
        } else {
            Stdio::null()
        })
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true);
    apply_env(&mut cmd, cx, &request);

    let started = Instant::now();
    let mut child = cmd.spawn().map_err(|e| Error::Backend {
        backend: BACKEND,
        operation: "exec",
        message: format!("cannot start `{}`: {e}", argv[0]),
        source: Some(Box::new(e)),
    })?;
    // The group id is the leader's pid (process_group(0)).
    let mut group = GroupKiller(child.id().map(|id| Pid::from_raw(id as i32)));

    let stdin_task = match (request.stdin, child.stdin.take()) {
        (Some(data), Some(mut pipe)) => Some(tokio::spawn(async move {
            // A command that exits without reading its input closes the pipe: not an error.
            let _ = pipe.write_all(&data).await;
            let _ = pipe.shutdown().await;
        })),
        _ => None,
    };
    let (stop_out, out_task) = spawn_reader(child.stdout.take(), request.limits.stdout);
    let (stop_err, err_task) = spawn_reader(child.stderr.take(), request.limits.stderr);

    let (exit_code, timed_out) = match tokio::time::timeout(timeout, child.wait()).await {
        Ok(Ok(status)) => {
            // Background jobs (`cmd &` without setsid) are still in the group: they die with
            // the command, so none keeps writing to the workspace after exec returns.
            group.kill();
            (status.code(), false)
        }
        Ok(Err(e)) => {
            group.kill();
            return Err(Error::Backend {
                backend: BACKEND,
                operation: "exec",
                message: format!("waiting for `{}` failed: {e}", argv[0]),
                source: Some(Box::new(e)),
            });
        }
        Err(_) => {
            group.kill();
            // The leader too, in case it moved itself to another group.
            let _ = child.start_kill();
            let _ = child.wait().await;
            tracing::info!("timed out: process group killed");
            (None, true)
        }
    };

    // Normally the pipes close as soon as the group is dead. A process that escaped the group
    // can hold them open for ever: after a grace period, stop reading and return what came.
    let readers = async { (out_task.await, err_task.await) };
    tokio::pin!(readers);
    let (out, err) = match tokio::time::timeout(READER_GRACE, &mut readers).await {
        Ok(done) => done,
        Err(_) => {
            tracing::warn!(
                "output pipes still open after the command ended (a process left its group): \
                 returning the output read so far"
            );
            let _ = stop_out.send(());
            let _ = stop_err.send(());
            readers.await
        }
    };
    let duration = started.elapsed();
    if let Some(task) = stdin_task {
        task.abort();
    }
    let output = CapturedOutput {
        stdout: reader_result(out)?,
        stderr: reader_result(err)?,
    };
    Ok(ExecResult::new(exit_code, output, timed_out, duration))
}

type ReaderTask = tokio::task::JoinHandle<io::Result<Captured>>;

fn spawn_reader<R>(pipe: Option<R>, cap: usize) -> (oneshot::Sender<()>, ReaderTask)
where
    R: AsyncRead + Unpin + Send + 'static,
{
    let (stop, stopped) = oneshot::channel();
    let task = tokio::spawn(async move {
        match pipe {
            Some(pipe) => read_capped(Stoppable::new(pipe, stopped), cap).await,
            None => Ok(Captured::default()),
        }
    });
    (stop, task)
}

fn reader_result(
    r: std::result::Result<io::Result<Captured>, tokio::task::JoinError>,
) -> Result<Captured> {
    match r {
        Ok(Ok(captured)) => Ok(captured),
        Ok(Err(e)) => Err(Error::Backend {
            backend: BACKEND,
            operation: "exec",
            message: format!("reading the command's output failed: {e}"),
            source: Some(Box::new(e)),
        }),
        Err(e) => Err(Error::backend(
            BACKEND,
            "exec",
            format!("output reader task failed: {e}"),
        )),
    }
}

/// Kills a process group with SIGKILL once, at the latest when dropped (a cancelled exec must
/// not leave its processes running).
struct GroupKiller(Option<Pid>);

impl GroupKiller {
    fn kill(&mut self) {
        // Once only: after the group is gone its id may eventually name another group. Right
        // after the leader is reaped it cannot, unless pids wrap around in between.
        let Some(pgid) = self.0.take() else {
            return;
        };
        match killpg(pgid, Signal::SIGKILL) {
            Ok(()) | Err(Errno::ESRCH) => {}
            Err(e) => {
                tracing::warn!(pgid = pgid.as_raw(), error = %e, "cannot kill the process group")
            }
        }
    }
}

impl Drop for GroupKiller {
    fn drop(&mut self) {
        self.kill();
    }
}

/// A reader that reports end-of-file once `stop` fires (or its sender is dropped), so that
/// [`read_capped`] returns what it has without waiting for a writer that never closes.
struct Stoppable<R> {
    inner: R,
    stop: Option<oneshot::Receiver<()>>,
}

impl<R> Stoppable<R> {
    fn new(inner: R, stop: oneshot::Receiver<()>) -> Self {
        Stoppable {
            inner,
            stop: Some(stop),
        }
    }
}

impl<R: AsyncRead + Unpin> AsyncRead for Stoppable<R> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        // Checked before reading, so a writer that never pauses cannot starve the stop.
        match self.stop.as_mut() {
            Some(stop) => {
                if Pin::new(stop).poll(cx).is_ready() {
                    self.stop = None;
                    return Poll::Ready(Ok(()));
                }
            }
            None => return Poll::Ready(Ok(())),
        }
        Pin::new(&mut self.inner).poll_read(cx, buf)
    }
}

/// Environment, lowest priority first: the policy's base, the spec's, the options' extra, the
/// request's.
fn apply_env(cmd: &mut tokio::process::Command, cx: &ExecContext<'_>, request: &ExecRequest) {
    match cx.options.env {
        EnvPolicy::Minimal => {
            cmd.env_clear()
                .env("PATH", MINIMAL_PATH)
                .env("HOME", cx.workspace)
                .env("LANG", MINIMAL_LANG);
        }
        EnvPolicy::Inherit => {}
    }
    cmd.envs(cx.spec_env)
        .envs(&cx.options.extra_env)
        .envs(&request.env);
}

/// Names must be non-empty without `=` or NUL, values without NUL (the OS cannot carry them).
/// Errors name the variable, never its value.
fn check_env(env: &std::collections::BTreeMap<String, String>) -> Result<()> {
    for (key, value) in env {
        if key.is_empty() || key.contains('=') || key.contains('\0') {
            return Err(Error::invalid(
                "environment variable",
                format!("name {key:?} is empty or contains `=` or NUL"),
            ));
        }
        if value.contains('\0') {
            return Err(Error::invalid(
                "environment variable",
                format!("the value of `{key}` contains NUL"),
            ));
        }
    }
    Ok(())
}

/// The working directory: the workspace root, a relative path under it, or an absolute path
/// inside it (compared by components). The resolved directory must also lie inside the
/// workspace or a read-write bind mount, so a symlink cannot move the command elsewhere.
async fn resolve_cwd(cx: &ExecContext<'_>, cwd: Option<&str>) -> Result<PathBuf> {
    let root = cx.workspace;
    let shown = cwd.unwrap_or(".").to_owned();
    let target = match cwd {
        None => root.to_path_buf(),
        Some(c) if c.starts_with('/') => {
            let rest = Path::new(c).strip_prefix(root).map_err(|_| {
                Error::path_escape(
                    c,
                    "an absolute working directory must lie inside the workspace root",
                )
            })?;
            if rest.as_os_str().is_empty() {
                root.to_path_buf()
            } else {
                RelPath::from_path(rest)?.to_host(root)
            }
        }
        Some(c) if c.split('/').all(|p| p.is_empty() || p == ".") => root.to_path_buf(),
        Some(c) => RelPath::new(c)?.to_host(root),
    };
    let (root_c, target_c, links) = (root.to_path_buf(), target.clone(), cx.links.to_vec());
    tokio::task::spawn_blocking(move || {
        if !fsutil::is_real_dir(&root_c)? {
            return Err(Error::NotFound {
                what: "workspace",
                key: root_c.display().to_string(),
            });
        }
        let resolved = std::fs::canonicalize(&target_c).map_err(|e| match e.kind() {
            io::ErrorKind::NotFound => Error::NotFound {
                what: "working directory",
                key: shown.clone(),
            },
            _ => Error::io(&target_c, e),
        })?;
        if !fsutil::is_within(&resolved, &fsutil::allowed_roots(&root_c, &links)) {
            return Err(Error::path_escape(
                shown,
                "resolves outside the workspace (through a symlink)",
            ));
        }
        if !resolved.is_dir() {
            return Err(Error::invalid(
                "working directory",
                format!("`{shown}` is not a directory"),
            ));
        }
        Ok(())
    })
    .await
    .map_err(|e| Error::backend(BACKEND, "exec", e.to_string()))??;
    Ok(target)
}
