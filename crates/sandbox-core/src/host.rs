//! Running one command on the host: a new process group, an environment built from nothing,
//! output read concurrently with the wait, and SIGKILL to the whole group when the command
//! ends, times out or the call is dropped.
//!
//! Backends and modes that run host processes (sandbox-local's boxes, sandbox-fs's local
//! shell) decide the argv, the working directory and the environment, then hand a
//! [`HostCommand`] to [`run`].
//!
//! ```no_run
//! # async fn demo() -> sandbox_core::Result<()> {
//! use std::time::Duration;
//! use sandbox_core::host::{self, HostCommand};
//! let home = std::path::Path::new("/tmp/ws");
//! let command = HostCommand::new(["sh", "-c", "echo $GREETING"], home)
//!     .envs(host::minimal_env(home))
//!     .env("GREETING", "hi")
//!     .timeout(Duration::from_secs(5));
//! let result = host::run(command, "local").await?;
//! assert_eq!(result.stdout_str(), "hi\n");
//! # Ok(())
//! # }
//! ```

use std::collections::BTreeMap;
use std::ffi::{OsStr, OsString};
use std::fmt;
use std::future::Future;
use std::io;
use std::os::unix::ffi::OsStrExt as _;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::process::Stdio;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use bytes::Bytes;
use nix::errno::Errno;
use nix::sys::signal::{Signal, killpg};
use nix::unistd::Pid;
use tokio::io::{AsyncRead, AsyncWriteExt, ReadBuf};
use tokio::sync::oneshot;
use tracing::Instrument as _;

use crate::{Captured, CapturedOutput, Error, ExecResult, OutputLimits, Result, read_capped};

/// `PATH` of a minimal environment ([`minimal_env`]).
pub const MINIMAL_PATH: &str = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";

/// `LANG` of a minimal environment ([`minimal_env`]).
pub const MINIMAL_LANG: &str = "C.UTF-8";

/// How long output pipes may stay open after the command's process group is gone. Only a
/// process that left the group (`setsid`, `setpgid`) can hold them that long; its later output
/// is not waited for.
const READER_GRACE: Duration = Duration::from_secs(1);

/// A command to run on the host in its own process group.
///
/// | field | default |
/// | --- | --- |
/// | [`env`](Self::env) | empty |
/// | [`inherit_env`](Self::inherit_env) | `false` |
/// | [`stdin`](Self::stdin) | `None` (an empty stdin) |
/// | [`timeout`](Self::timeout) | 120 s |
/// | [`limits`](Self::limits) | [`OutputLimits::default`] |
#[derive(Clone)]
#[non_exhaustive]
pub struct HostCommand {
    /// The program and its arguments; the program is looked up in `env`'s `PATH` when it has
    /// no `/`.
    pub argv: Vec<String>,
    /// Working directory. Used as given: the caller decides whether it is acceptable.
    pub cwd: PathBuf,
    /// The command's complete environment: nothing of this process's is passed on unless
    /// [`inherit_env`](Self::inherit_env) is set.
    pub env: BTreeMap<OsString, OsString>,
    /// Start from this process's whole environment and lay `env` over it.
    pub inherit_env: bool,
    /// Bytes fed to stdin, which is then closed. `None` gives an empty stdin.
    pub stdin: Option<Bytes>,
    /// Kill the whole process group after this long.
    pub timeout: Duration,
    /// Output caps.
    pub limits: OutputLimits,
}

impl HostCommand {
    /// Run `argv` in `cwd`, with the defaults of the table above.
    pub fn new<I, S>(argv: I, cwd: impl Into<PathBuf>) -> Self
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
    {
        HostCommand {
            argv: argv.into_iter().map(Into::into).collect(),
            cwd: cwd.into(),
            env: BTreeMap::new(),
            inherit_env: false,
            stdin: None,
            timeout: Duration::from_secs(120),
            limits: OutputLimits::default(),
        }
    }

    /// Set one environment variable (replacing an earlier value).
    pub fn env(mut self, key: impl Into<OsString>, value: impl Into<OsString>) -> Self {
        self.env.insert(key.into(), value.into());
        self
    }

    /// Set several environment variables, in order: a later value of a name wins.
    pub fn envs<I, K, V>(mut self, vars: I) -> Self
    where
        I: IntoIterator<Item = (K, V)>,
        K: Into<OsString>,
        V: Into<OsString>,
    {
        self.env
            .extend(vars.into_iter().map(|(k, v)| (k.into(), v.into())));
        self
    }

    /// Start from this process's environment or not.
    pub fn inherit_env(mut self, yes: bool) -> Self {
        self.inherit_env = yes;
        self
    }

    /// Feed `stdin` to the command.
    pub fn stdin(mut self, stdin: impl Into<Bytes>) -> Self {
        self.stdin = Some(stdin.into());
        self
    }

    /// Set the timeout.
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// Set the output caps.
    pub fn limits(mut self, limits: OutputLimits) -> Self {
        self.limits = limits;
        self
    }
}

/// Environment values are not printed: they may hold secrets. Neither are the arguments
/// after the program, which may embed them.
impl fmt::Debug for HostCommand {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("HostCommand")
            .field("program", &self.argv.first())
            .field("args", &self.argv.len().saturating_sub(1))
            .field("cwd", &self.cwd)
            .field("env", &self.env.keys().collect::<Vec<_>>())
            .field("inherit_env", &self.inherit_env)
            .field("stdin", &self.stdin.as_ref().map(Bytes::len))
            .field("timeout", &self.timeout)
            .field("limits", &self.limits)
            .finish()
    }
}

/// The minimal base environment: `PATH` ([`MINIMAL_PATH`]), `HOME` (`home`) and `LANG`
/// ([`MINIMAL_LANG`]). Nothing of this process leaks in (tokens, cloud credentials).
pub fn minimal_env(home: &Path) -> BTreeMap<OsString, OsString> {
    BTreeMap::from([
        ("PATH".into(), MINIMAL_PATH.into()),
        ("HOME".into(), home.as_os_str().to_owned()),
        ("LANG".into(), MINIMAL_LANG.into()),
    ])
}

/// Check that the OS can carry `vars`: names non-empty without `=` or NUL, values without NUL.
/// The error ([`Error::InvalidInput`]) names the variable, never its value.
pub fn check_env<I, K, V>(vars: I) -> Result<()>
where
    I: IntoIterator<Item = (K, V)>,
    K: AsRef<OsStr>,
    V: AsRef<OsStr>,
{
    for (key, value) in vars {
        let (key, value) = (key.as_ref(), value.as_ref());
        let name = key.as_bytes();
        if name.is_empty() || name.contains(&b'=') || name.contains(&0) {
            return Err(Error::invalid(
                "environment variable",
                format!("name {key:?} is empty or contains `=` or NUL"),
            ));
        }
        if value.as_bytes().contains(&0) {
            return Err(Error::invalid(
                "environment variable",
                format!("the value of `{}` contains NUL", key.display()),
            ));
        }
    }
    Ok(())
}

/// Run `command` and collect its result.
///
/// The command gets a new process group. Stdout and stderr are read concurrently with the wait,
/// each up to its cap (the rest is drained and dropped). When the command exits, or its
/// timeout fires (`timed_out`, no exit code, the output so far), or the returned future is
/// dropped, the whole group is killed with SIGKILL, so background jobs and grandchildren never
/// outlive the call. A process that left the group (`setsid`) and keeps the output pipes open
/// delays the result by at most one second; its later output is dropped.
///
/// `backend` names the caller in [`Error::Backend`] (operation `exec`): a program that cannot
/// be started, a failed wait or a failed read. An empty argv or an environment the OS cannot
/// carry ([`check_env`]) is [`Error::InvalidInput`].
pub async fn run(command: HostCommand, backend: &'static str) -> Result<ExecResult> {
    if command.argv.is_empty() {
        return Err(Error::invalid("command", "the argument vector is empty"));
    }
    check_env(&command.env)?;
    // Env values and arguments may be secrets: callers log the program and where it runs.
    let span = tracing::info_span!("host_run", backend, pgid = tracing::field::Empty);
    spawn_and_collect(command, backend).instrument(span).await
}

async fn spawn_and_collect(command: HostCommand, backend: &'static str) -> Result<ExecResult> {
    let HostCommand {
        argv,
        cwd,
        env,
        inherit_env,
        stdin,
        timeout,
        limits,
    } = command;
    let mut cmd = tokio::process::Command::new(&argv[0]);
    cmd.args(&argv[1..])
        .current_dir(&cwd)
        // Its own process group, so that a timeout can kill everything the command started.
        .process_group(0)
        .stdin(if stdin.is_some() {
            Stdio::piped()
        } else {
            Stdio::null()
        })
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true);
    if !inherit_env {
        cmd.env_clear();
    }
    cmd.envs(&env);

    let started = Instant::now();
    let mut child = cmd.spawn().map_err(|e| Error::Backend {
        backend,
        operation: "exec",
        message: format!("cannot start `{}`: {e}", argv[0]),
        source: Some(Box::new(e)),
    })?;
    // The group id is the leader's pid (process_group(0)).
    let pgid = child.id().map(|id| Pid::from_raw(id as i32));
    if let Some(pgid) = pgid {
        tracing::Span::current().record("pgid", pgid.as_raw());
    }
    let mut group = GroupKiller(pgid);

    let stdin_task = match (stdin, child.stdin.take()) {
        (Some(data), Some(mut pipe)) => Some(tokio::spawn(async move {
            // A command that exits without reading its input closes the pipe: not an error.
            let _ = pipe.write_all(&data).await;
            let _ = pipe.shutdown().await;
        })),
        _ => None,
    };
    let (stop_out, out_task) = spawn_reader(child.stdout.take(), limits.stdout);
    let (stop_err, err_task) = spawn_reader(child.stderr.take(), limits.stderr);

    let (exit_code, timed_out) = match tokio::time::timeout(timeout, child.wait()).await {
        Ok(Ok(status)) => {
            // Background jobs (`cmd &` without setsid) are still in the group: they die with
            // the command, so none keeps writing after the call returns.
            group.kill();
            (status.code(), false)
        }
        Ok(Err(e)) => {
            group.kill();
            return Err(Error::Backend {
                backend,
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
        stdout: reader_result(out, backend)?,
        stderr: reader_result(err, backend)?,
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
    backend: &'static str,
) -> Result<Captured> {
    match r {
        Ok(Ok(captured)) => Ok(captured),
        Ok(Err(e)) => Err(Error::Backend {
            backend,
            operation: "exec",
            message: format!("reading the command's output failed: {e}"),
            source: Some(Box::new(e)),
        }),
        Err(e) => Err(Error::backend(
            backend,
            "exec",
            format!("output reader task failed: {e}"),
        )),
    }
}

/// Kills a process group with SIGKILL once, at the latest when dropped (a cancelled call must
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

#[cfg(test)]
mod tests {
    use super::*;

    /// Gone, or a zombie nobody reaps (in a container the init may not).
    fn gone_or_zombie(pid: i32) -> bool {
        match std::fs::read_to_string(format!("/proc/{pid}/status")) {
            Err(_) => true,
            Ok(status) => status
                .lines()
                .find_map(|l| l.strip_prefix("State:"))
                .is_some_and(|s| s.trim_start().starts_with('Z')),
        }
    }

    async fn wait_gone(pid: i32, within: Duration) -> bool {
        let deadline = Instant::now() + within;
        while !gone_or_zombie(pid) {
            if Instant::now() >= deadline {
                return false;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        true
    }

    /// A pid the command wrote to `file`.
    fn read_pid(file: &Path) -> i32 {
        std::fs::read_to_string(file)
            .unwrap()
            .trim()
            .parse()
            .unwrap()
    }

    fn sh(line: &str, cwd: &Path) -> HostCommand {
        HostCommand::new(["sh", "-c", line], cwd).envs(minimal_env(cwd))
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn timeout_kills_a_backgrounded_grandchild() {
        let dir = tempfile::tempdir().unwrap();
        let command = sh(
            "echo before; sleep 300 & echo $! > gc.pid; wait",
            dir.path(),
        )
        .timeout(Duration::from_millis(500));
        let r = run(command, "test").await.unwrap();
        assert!(r.timed_out, "{r:?}");
        assert_eq!(r.exit_code, None);
        assert_eq!(r.stdout_str(), "before\n");
        // Killing the group closed the pipes at once: no wait for the reader grace period.
        assert!(r.duration < Duration::from_millis(1400), "{r:?}");
        let pid = read_pid(&dir.path().join("gc.pid"));
        assert!(
            wait_gone(pid, Duration::from_secs(3)).await,
            "grandchild {pid} still runs"
        );
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn large_output_is_capped_without_deadlock() {
        let dir = tempfile::tempdir().unwrap();
        // stderr first: reading stdout to its end before stderr would block on a full pipe.
        let command = sh(
            "head -c 8388608 /dev/zero >&2; head -c 8388608 /dev/zero; echo end >&2",
            dir.path(),
        )
        .limits(OutputLimits {
            stdout: 4096,
            stderr: 100,
        })
        .timeout(Duration::from_secs(60));
        let r = run(command, "test").await.unwrap();
        assert!(!r.timed_out, "{r:?}");
        assert_eq!(r.exit_code, Some(0));
        assert_eq!((r.stdout.len(), r.stderr.len()), (4096, 100));
        assert!(r.stdout_truncated && r.stderr_truncated);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn setsid_process_holding_stdout_costs_only_the_grace_and_keeps_the_output() {
        let dir = tempfile::tempdir().unwrap();
        let started = Instant::now();
        let command = sh(
            "setsid sh -c 'echo $$ > sid.pid; exec sleep 60' & sleep 0.3; echo main-done",
            dir.path(),
        );
        let r = run(command, "test").await.unwrap();
        assert!(!r.timed_out && r.exit_code == Some(0), "{r:?}");
        // What came before the grace ran out is kept.
        assert_eq!(r.stdout_str(), "main-done\n");
        assert!(r.duration >= READER_GRACE, "{r:?}");
        assert!(started.elapsed() < Duration::from_secs(10), "{r:?}");
        let pid = read_pid(&dir.path().join("sid.pid"));
        // It left the group, so it survived; clean it up.
        assert!(
            !gone_or_zombie(pid),
            "the setsid process should have survived"
        );
        nix::sys::signal::kill(Pid::from_raw(pid), Signal::SIGKILL).unwrap();
        assert!(wait_gone(pid, Duration::from_secs(3)).await);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn env_is_exactly_what_was_given_and_stdin_is_fed() {
        let dir = tempfile::tempdir().unwrap();
        let command = HostCommand::new(["/usr/bin/env"], dir.path())
            .env("ONE", "1")
            .env("SPACED", "a b=c");
        let r = run(command, "test").await.unwrap();
        assert_eq!(r.stdout_str(), "ONE=1\nSPACED=a b=c\n");

        let command = sh("cat; pwd", dir.path()).stdin("fed\n");
        let r = run(command, "test").await.unwrap();
        let cwd = dir.path().canonicalize().unwrap();
        assert_eq!(r.stdout_str(), format!("fed\n{}\n", cwd.display()));
    }

    #[tokio::test]
    async fn refusals_name_the_variable_or_the_program_never_a_value() {
        let dir = tempfile::tempdir().unwrap();
        let bad = HostCommand::new(["true"], dir.path()).env("BAD=NAME", "secret-value");
        let err = run(bad, "test").await.unwrap_err();
        assert!(matches!(err, Error::InvalidInput { .. }), "{err}");
        assert!(!err.to_string().contains("secret-value"), "{err}");
        let bad = HostCommand::new(["true"], dir.path()).env("NUL", "a\0secret");
        let err = run(bad, "test").await.unwrap_err();
        assert!(err.to_string().contains("NUL") && !err.to_string().contains("secret"));

        let empty = HostCommand::new(Vec::<String>::new(), dir.path());
        assert!(matches!(
            run(empty, "test").await,
            Err(Error::InvalidInput { .. })
        ));
        let missing = HostCommand::new(["no-such-program-5f3a"], dir.path());
        match run(missing, "test").await.unwrap_err() {
            Error::Backend {
                backend, message, ..
            } => {
                assert_eq!(backend, "test");
                assert!(message.contains("no-such-program-5f3a"), "{message}");
            }
            err => panic!("{err}"),
        }
    }

    #[test]
    fn debug_hides_env_values_and_arguments() {
        let command =
            HostCommand::new(["sh", "-c", "curl -H 'token: t0ken'"], "/").env("TOKEN", "s3cret");
        let shown = format!("{command:?}");
        assert!(
            shown.contains("TOKEN") && shown.contains("\"sh\""),
            "{shown}"
        );
        assert!(
            !shown.contains("s3cret") && !shown.contains("t0ken"),
            "{shown}"
        );
    }
}
