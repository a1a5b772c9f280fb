//! Running one command on the host: a new process group (and its own cgroup where this process
//! can create one, see [`tree_kill`]), an environment built from nothing, output read
//! concurrently with the wait, and SIGKILL to everything the command started when it ends,
//! times out or the call is dropped.
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

use crate::{
    Captured, CapturedOutput, Error, ExecResult, Inflight, InflightGuard, OutputLimits, Result,
    read_capped,
};

mod tree;

use tree::{CommandCgroup, JOIN_FAILED_STATUS, Tracking, WRAPPER_SHELL};
pub use tree::{TREE_KILL_VAR, TreeKill, detect_tree_kill_in_background, tree_kill};

/// `PATH` of a minimal environment ([`minimal_env`]).
pub const MINIMAL_PATH: &str = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";

/// `LANG` of a minimal environment ([`minimal_env`]).
pub const MINIMAL_LANG: &str = "C.UTF-8";

/// How long output pipes may stay open after everything the command started was killed. Only
/// a process that escaped the kill can hold them that long (one that left the process group
/// when there is no cgroup to track it: [`TreeKill::ProcessGroup`]); its later output is not
/// waited for.
const READER_GRACE: Duration = Duration::from_secs(1);

/// A command to run on the host in its own process group (and cgroup, see [`tree_kill`]).
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
    /// [`inherit_env`](Self::inherit_env) is set. The set of variables is exact; their order
    /// is not promised.
    pub env: BTreeMap<OsString, OsString>,
    /// Start from this process's whole environment and lay `env` over it.
    pub inherit_env: bool,
    /// Bytes fed to stdin, which is then closed. `None` gives an empty stdin.
    pub stdin: Option<Bytes>,
    /// Kill everything the command started after this long.
    pub timeout: Duration,
    /// Output caps.
    pub limits: OutputLimits,
    /// Counts the command as under way until it and everything it started is dead — also
    /// after its future was dropped, when the kill finishes on a thread — so that a box can
    /// wait for a cancelled call's commands to die ([`crate::BoxHandle::settle`]).
    pub counted_by: Option<Inflight>,
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
            counted_by: None,
        }
    }

    /// Count the command in `inflight` until it and everything it started is dead.
    pub fn counted_by(mut self, inflight: &Inflight) -> Self {
        self.counted_by = Some(inflight.clone());
        self
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
/// The command gets a new process group and, where this process can create cgroups, its own
/// cgroup, joined before the command runs (by `/bin/sh`, which then `exec`s it: same pid,
/// group, descriptors and environment). Stdout and stderr are read concurrently with the
/// wait, each up to its cap (the rest is drained and dropped). When the command exits, or its
/// timeout fires (`timed_out`, no exit code, the output so far), or the returned future is
/// dropped, everything it started is killed with SIGKILL: the process group, and every member
/// of the cgroup (so `setsid`, `setpgid` and daemons too). [`tree_kill`] says which of the two
/// this process has. Without a cgroup, a process that left the group survives, and if it
/// keeps the output pipes open it delays the result by at most one second; its later output
/// is dropped.
///
/// `backend` names the caller in [`Error::Backend`] (operation `exec`): a program that cannot
/// be started, a command that could not be moved into its cgroup, a failed wait or a failed
/// read. An empty argv or an environment the OS cannot carry ([`check_env`]) is
/// [`Error::InvalidInput`].
pub async fn run(command: HostCommand, backend: &'static str) -> Result<ExecResult> {
    run_tracked(command, backend, Tracking::global_async().await).await
}

/// [`run`] with the given tracking (tests run every tracking the machine offers).
async fn run_tracked(
    command: HostCommand,
    backend: &'static str,
    tracking: &Tracking,
) -> Result<ExecResult> {
    if command.argv.is_empty() {
        return Err(Error::invalid("command", "the argument vector is empty"));
    }
    check_env(&command.env)?;
    let cgroup = tracking
        .start_for(
            &command.argv,
            &command.cwd,
            &command.env,
            command.inherit_env,
        )
        .map_err(|e| Error::Backend {
            backend,
            operation: "exec",
            message: format!("cannot create the command's cgroup: {e}"),
            source: Some(Box::new(e)),
        })?;
    // Env values and arguments may be secrets: callers log the program and where it runs.
    let span = tracing::info_span!(
        "host_run",
        backend,
        tree_kill = tracking.mode().as_str(),
        pgid = tracing::field::Empty
    );
    spawn_and_collect(command, backend, cgroup)
        .instrument(span)
        .await
}

async fn spawn_and_collect(
    command: HostCommand,
    backend: &'static str,
    cgroup: Option<CommandCgroup>,
) -> Result<ExecResult> {
    let HostCommand {
        argv,
        cwd,
        env,
        inherit_env,
        stdin,
        timeout,
        limits,
        counted_by,
    } = command;
    let counted = counted_by.as_ref().map(Inflight::enter);
    let wrapper = cgroup.as_ref().filter(|cg| cg.by_wrapper());
    let bash_env = cgroup.as_ref().and_then(CommandCgroup::bash_env);
    let join_failed_check = cgroup
        .as_ref()
        .filter(|cg| cg.joins_itself())
        .map(CommandCgroup::join_failed_line);
    let cannot_start = |e: io::Error| Error::Backend {
        backend,
        operation: "exec",
        message: format!("cannot start `{}`: {e}", argv[0]),
        source: Some(Box::new(e)),
    };
    let mut cmd = process(&argv, &cwd, &env, inherit_env, wrapper).map_err(cannot_start)?;
    if let Some(vars) = bash_env {
        cmd.envs(vars);
    }
    cmd.stdin(if stdin.is_some() {
        Stdio::piped()
    } else {
        Stdio::null()
    });

    let started = Instant::now();
    let mut child = cmd.spawn().map_err(cannot_start)?;
    // The group id is the leader's pid (process_group(0)).
    let pgid = child.id().map(|id| Pid::from_raw(id as i32));
    if let Some(pgid) = pgid {
        tracing::Span::current().record("pgid", pgid.as_raw());
    }
    let mut reaper = Reaper {
        pgid,
        cgroup,
        counted,
    };
    if let Err(e) = reaper.join_from_outside(child.id()) {
        reaper.finish().await;
        let _ = child.start_kill();
        let _ = child.wait().await;
        return Err(Error::Backend {
            backend,
            operation: "exec",
            message: format!("cannot move `{}` into its cgroup: {e}", argv[0]),
            source: Some(Box::new(e)),
        });
    }

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
            // Background jobs and daemons are still in the group or the cgroup: they die with
            // the command, so none keeps writing after the call returns.
            reaper.finish().await;
            (status.code(), false)
        }
        Ok(Err(e)) => {
            reaper.finish().await;
            return Err(Error::Backend {
                backend,
                operation: "exec",
                message: format!("waiting for `{}` failed: {e}", argv[0]),
                source: Some(Box::new(e)),
            });
        }
        Err(_) => {
            reaper.kill();
            // The leader too, in case it moved itself to another group.
            let _ = child.start_kill();
            // Before waiting for it: in a frozen cgroup the leader dies only once thawed.
            reaper.finish().await;
            let _ = child.wait().await;
            tracing::info!("timed out: everything the command started was killed");
            (None, true)
        }
    };

    // Normally the pipes close as soon as everything is dead. A process that escaped (it left
    // the group and there is no cgroup) can hold them open for ever: after a grace period,
    // stop reading and return what came.
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
    if let Some(line) = join_failed_check
        && exit_code == Some(JOIN_FAILED_STATUS)
        && output
            .stderr
            .bytes
            .split(|b| *b == b'\n')
            .any(|l| l == line)
    {
        // Never a silently untracked command: it did not run at all.
        return Err(Error::backend(
            backend,
            "exec",
            format!(
                "`{}` did not run: {}",
                argv[0],
                String::from_utf8_lossy(&output.stderr.bytes).trim_end()
            ),
        ));
    }
    Ok(ExecResult::new(exit_code, output, timed_out, duration))
}

/// The process to spawn for `argv` (stdin still to be set): in its own process group, with
/// exactly `env` (over this process's environment when `inherit_env`), stdout and stderr
/// piped, killed if dropped; through `wrapper`, the shell that moves it into its cgroup, if
/// given.
fn process(
    argv: &[String],
    cwd: &Path,
    env: &BTreeMap<OsString, OsString>,
    inherit_env: bool,
    wrapper: Option<&CommandCgroup>,
) -> io::Result<tokio::process::Command> {
    let mut cmd = match wrapper {
        Some(cgroup) => {
            // The wrapper would report a missing program as the shell's exit status 127:
            // look first, so that it stays an error naming the program.
            check_program(&argv[0], cwd, program_path(env, inherit_env).as_deref())?;
            let mut cmd = tokio::process::Command::new(WRAPPER_SHELL);
            cmd.args(cgroup.wrapper_args(argv));
            cmd
        }
        None => {
            let mut cmd = tokio::process::Command::new(&argv[0]);
            cmd.args(&argv[1..]);
            cmd
        }
    };
    cmd.current_dir(cwd)
        // Its own process group, so that a timeout can kill everything the command started.
        .process_group(0)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true);
    if !inherit_env {
        cmd.env_clear();
    }
    cmd.envs(env);
    if wrapper.is_some() {
        // For the wrapper to restore what the shell changes (after env_clear, which drops
        // everything set before it).
        cmd.envs(tree::saved_shell_variables(env, inherit_env));
    }
    Ok(cmd)
}

/// The `PATH` the command will see: its own, or this process's when it inherits and sets none.
fn program_path(env: &BTreeMap<OsString, OsString>, inherit_env: bool) -> Option<OsString> {
    match env.get(OsStr::new("PATH")) {
        Some(path) => Some(path.clone()),
        None if inherit_env => std::env::var_os("PATH"),
        None => None,
    }
}

/// Whether `program` can be executed as `execvp` would find it: relative to `cwd` when it has a
/// `/`, else in `path` (an empty entry is `cwd`). Without a `PATH` the shell's default search
/// decides, so nothing is checked.
fn check_program(program: &str, cwd: &Path, path: Option<&OsStr>) -> io::Result<()> {
    let executable = |candidate: &Path| {
        candidate.is_file() && rustix::fs::access(candidate, rustix::fs::Access::EXEC_OK).is_ok()
    };
    if program.contains('/') {
        let candidate = cwd.join(program);
        if executable(&candidate) {
            return Ok(());
        }
        return Err(match candidate.exists() {
            true => io::Error::from_raw_os_error(Errno::EACCES as i32),
            false => io::Error::from_raw_os_error(Errno::ENOENT as i32),
        });
    }
    let Some(path) = path else { return Ok(()) };
    let found = path
        .as_bytes()
        .split(|b| *b == b':')
        .any(|dir| executable(&cwd.join(OsStr::from_bytes(dir)).join(program)));
    match found {
        true => Ok(()),
        false => Err(io::Error::from_raw_os_error(Errno::ENOENT as i32)),
    }
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

/// Kills everything a command started: its process group (SIGKILL, once) and its cgroup, at
/// the latest when dropped (a cancelled call must not leave its processes running). From
/// `Drop` the kill itself is synchronous; waiting for the cgroup to empty and removing it is
/// left to a background thread.
struct Reaper {
    pgid: Option<Pid>,
    cgroup: Option<CommandCgroup>,
    /// Held until everything is dead (past a drop, on the thread that waits for it).
    counted: Option<InflightGuard>,
}

impl Reaper {
    /// Kill now: quick, synchronous.
    fn kill(&mut self) {
        // Once only: after the group is gone its id may eventually name another group. Right
        // after the leader is reaped it cannot, unless pids wrap around in between.
        if let Some(pgid) = self.pgid.take() {
            match killpg(pgid, Signal::SIGKILL) {
                Ok(()) | Err(Errno::ESRCH) => {}
                Err(e) => {
                    tracing::warn!(pgid = pgid.as_raw(), error = %e, "cannot kill the process group")
                }
            }
        }
        if let Some(cgroup) = &mut self.cgroup {
            cgroup.kill();
        }
    }

    /// Move the just started leader `pid` into the cgroup when the wrapper did not: at once,
    /// since until then a fork would escape. (Not reaped yet, the pid is still its own.)
    fn join_from_outside(&self, pid: Option<u32>) -> io::Result<()> {
        match (&self.cgroup, pid) {
            (Some(cgroup), Some(pid)) if !cgroup.joins_itself() => cgroup.join(pid),
            _ => Ok(()),
        }
    }

    /// Kill, then wait (bounded) until the cgroup is empty and remove it.
    async fn finish(&mut self) {
        self.kill();
        if let Some(cgroup) = self.cgroup.take() {
            cgroup.finish().await;
        }
    }
}

impl Drop for Reaper {
    fn drop(&mut self) {
        let pgid = self.pgid;
        // The cgroup, if still here, finishes itself in the background when dropped.
        self.kill();
        // Dropped before the command ended (a cancelled call): whoever counts it waits until
        // every process is gone, which the kill only starts (a process in the middle of a
        // write finishes that write first).
        let (Some(counted), Some(pgid)) = (self.counted.take(), pgid) else {
            return;
        };
        let cgroup = self.cgroup.take();
        let waited = std::thread::Builder::new()
            .name("sandbox-settle".into())
            .spawn(move || {
                let emptied = cgroup.is_none_or(|cg| cg.finish_blocking(SETTLE_WAIT));
                let gone = wait_group_gone(pgid, SETTLE_WAIT);
                if !(emptied && gone) {
                    tracing::warn!(
                        pgid = pgid.as_raw(),
                        "a dropped command's processes are not all gone after {SETTLE_WAIT:?}"
                    );
                }
                drop(counted);
            });
        if let Err(e) = waited {
            tracing::warn!(error = %e, "cannot start a thread to wait for a dropped command");
        }
    }
}

/// How long the thread of a dropped command waits for its processes to die.
const SETTLE_WAIT: Duration = Duration::from_secs(10);

/// Wait (blocking, at most `within`) until no live process is in group `pgid` (zombies are
/// dead: they write nothing); whether none is.
fn wait_group_gone(pgid: Pid, within: Duration) -> bool {
    let deadline = Instant::now() + within;
    let mut pause = Duration::from_millis(1);
    loop {
        if !group_has_live_member(pgid) {
            return true;
        }
        if Instant::now() >= deadline {
            return false;
        }
        std::thread::sleep(pause);
        pause = (pause * 2).min(Duration::from_millis(20));
    }
}

/// Whether some process in group `pgid` is not a zombie (`/proc/<pid>/stat`: state is the
/// third field, the group the fifth, after the parenthesized name). Without `/proc`, whether
/// the group exists at all.
fn group_has_live_member(pgid: Pid) -> bool {
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return killpg(pgid, None).is_ok();
    };
    dir.filter_map(|e| e.ok())
        .filter(|e| e.file_name().as_bytes().iter().all(u8::is_ascii_digit))
        .filter_map(|e| std::fs::read(e.path().join("stat")).ok())
        .any(|stat| {
            let Some(close) = stat.iter().rposition(|b| *b == b')') else {
                return false;
            };
            let mut fields = stat[close + 1..]
                .split(|b| *b == b' ')
                .filter(|f| !f.is_empty());
            let state = fields.next();
            let group = fields.nth(1);
            state != Some(b"Z")
                && group.and_then(|g| std::str::from_utf8(g).ok()?.parse::<i32>().ok())
                    == Some(pgid.as_raw())
        })
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
    use futures::future::join_all;

    use super::*;
    use crate::testkit::escapes::{ESCAPES, End, gone_or_zombie, survivors, wait_gone};

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
    async fn setsid_process_holding_stdout_is_killed_and_the_output_kept() {
        let dir = tempfile::tempdir().unwrap();
        let started = Instant::now();
        let command = sh(
            "setsid sh -c 'echo $$ > sid.pid; exec sleep 60' & sleep 0.3; echo main-done",
            dir.path(),
        );
        let r = run(command, "test").await.unwrap();
        assert!(!r.timed_out && r.exit_code == Some(0), "{r:?}");
        assert_eq!(r.stdout_str(), "main-done\n");
        assert!(started.elapsed() < Duration::from_secs(10), "{r:?}");
        let pid = read_pid(&dir.path().join("sid.pid"));
        if tree_kill().kills_escaped() {
            // Killed with the command, which closed the pipes: no reader grace was needed.
            assert!(r.duration < READER_GRACE, "{r:?}");
            assert!(
                wait_gone(pid, Duration::from_secs(3)).await,
                "{pid} survived"
            );
        } else {
            // Process groups only: it left the group and survived; the grace bounded the wait.
            eprintln!("no cgroups: checking process-group semantics only");
            assert!(r.duration >= READER_GRACE, "{r:?}");
            assert!(
                !gone_or_zombie(pid),
                "the setsid process should have survived"
            );
            nix::sys::signal::kill(Pid::from_raw(pid), Signal::SIGKILL).unwrap();
            assert!(wait_gone(pid, Duration::from_secs(3)).await);
        }
    }

    /// Every tracking this machine offers, against every escape, ended as `end`: the cgroup
    /// ones kill all, the process group what stayed in it.
    async fn every_tracking_against_every_escape(end: End) {
        let trackings = Tracking::available();
        let runs = trackings.iter().map(|tracking| async move {
            let dir = tempfile::tempdir().unwrap();
            let cwd = dir.path().to_path_buf();
            let survived = survivors(dir.path(), end, |script, timeout| {
                run_tracked(sh(&script, &cwd).timeout(timeout), "test", tracking)
            })
            .await;
            (tracking, survived)
        });
        for (tracking, survived) in join_all(runs).await {
            let what = tracking.describe();
            eprintln!("{what}: {end:?}: survived {survived:?}");
            if tracking.mode().kills_escaped() {
                assert!(
                    survived.is_empty(),
                    "{what}: {end:?}: survived {survived:?}"
                );
            } else {
                for name in &survived {
                    let escape = ESCAPES.iter().find(|e| e.name == *name).unwrap();
                    assert!(escape.leaves_group, "{what}: {end:?}: {name} survived");
                }
            }
        }
        if tree_kill().kills_escaped() {
            // This machine has cgroups: every method must have been exercised.
            assert!(trackings.len() > 1, "no cgroup tracking was available");
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn every_tracking_kills_escapes_on_timeout() {
        every_tracking_against_every_escape(End::Timeout).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn every_tracking_kills_escapes_on_exit() {
        every_tracking_against_every_escape(End::Exit).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn every_tracking_kills_escapes_on_cancel() {
        every_tracking_against_every_escape(End::Cancel).await;
    }

    /// The `cmd-…` cgroup a command ran in, from its `/proc/self/cgroup`.
    fn own_cgroup(stdout: &str, parent: &Path) -> PathBuf {
        let name = parent.file_name().unwrap().to_str().unwrap();
        let line = stdout
            .lines()
            .find(|l| l.contains(&format!("/{name}/cmd-")))
            .unwrap_or_else(|| panic!("not in a cgroup under {}: {stdout}", parent.display()));
        let cmd = line.rsplit('/').next().unwrap();
        assert_eq!(cmd.len(), "cmd-".len() + 32, "{line}");
        parent.join(cmd)
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn each_command_gets_a_cgroup_removed_when_it_ends_or_is_cancelled() {
        let dir = tempfile::tempdir().unwrap();
        for tracking in Tracking::available() {
            let Some(parent) = tracking.parent() else {
                continue;
            };
            let what = tracking.describe();
            let r = run_tracked(sh("cat /proc/self/cgroup", dir.path()), "test", &tracking)
                .await
                .unwrap();
            assert_eq!(r.exit_code, Some(0), "{what}: {r:?}");
            let cgroup = own_cgroup(&r.stdout_str(), parent);
            assert!(!cgroup.exists(), "{what}: {} left behind", cgroup.display());

            // Cancelled: removed in the background once its members are dead.
            let line = "cat /proc/self/cgroup > cg.txt; exec sleep 300";
            let file = dir.path().join("cg.txt");
            let _ = std::fs::remove_file(&file);
            let exec = run_tracked(sh(line, dir.path()), "test", &tracking);
            tokio::select! {
                r = exec => panic!("{what}: ended: {r:?}"),
                () = async {
                    while std::fs::metadata(&file).map_or(true, |m| m.len() == 0) {
                        tokio::time::sleep(Duration::from_millis(10)).await;
                    }
                } => {}
            }
            let cgroup = own_cgroup(&std::fs::read_to_string(&file).unwrap(), parent);
            let deadline = Instant::now() + Duration::from_secs(5);
            while cgroup.exists() {
                assert!(
                    Instant::now() < deadline,
                    "{what}: {} left",
                    cgroup.display()
                );
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_command_that_cannot_join_its_cgroup_is_an_error_and_does_not_run() {
        let dir = tempfile::tempdir().unwrap();
        // A directory without `cgroup.procs` to write: the wrapper's move fails.
        let cgroup = CommandCgroup::unmanaged(dir.path().join("no-such-cgroup"), true);
        let command = sh("echo ran > ran.txt", dir.path());
        let err = spawn_and_collect(command, "test", Some(cgroup))
            .await
            .unwrap_err();
        match &err {
            Error::Backend {
                backend, message, ..
            } => {
                assert_eq!(*backend, "test");
                assert!(message.contains("`sh` did not run"), "{message}");
                assert!(message.contains("no-such-cgroup"), "{message}");
            }
            _ => panic!("{err}"),
        }
        assert!(!dir.path().join("ran.txt").exists());
    }

    #[test]
    fn programs_are_checked_as_execvp_would_find_them() {
        let dir = tempfile::tempdir().unwrap();
        let path = Some(OsStr::new("/nonexistent:/usr/bin:/bin"));
        assert!(check_program("sh", dir.path(), path).is_ok());
        let err = check_program("no-such-program-5f3a", dir.path(), path).unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::NotFound);
        // Without a PATH the shell's default search decides.
        assert!(check_program("anything", dir.path(), None).is_ok());
        // With a slash: relative to the working directory; a file must be executable.
        std::fs::write(dir.path().join("script"), "#!/bin/sh\n").unwrap();
        let err = check_program("./script", dir.path(), path).unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::PermissionDenied);
        use std::os::unix::fs::PermissionsExt as _;
        let exec = std::fs::Permissions::from_mode(0o755);
        std::fs::set_permissions(dir.path().join("script"), exec).unwrap();
        assert!(check_program("./script", dir.path(), path).is_ok());
        // An empty PATH entry is the working directory.
        assert!(check_program("script", dir.path(), Some(OsStr::new("/x::/y"))).is_ok());
        assert!(check_program("script", dir.path(), Some(OsStr::new("/x:/y"))).is_err());
        // A directory is not a program.
        assert!(check_program("/tmp", dir.path(), path).is_err());
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn env_is_exactly_what_was_given_and_stdin_is_fed() {
        let dir = tempfile::tempdir().unwrap();
        let command = HostCommand::new(["/usr/bin/env"], dir.path())
            .env("ONE", "1")
            .env("SPACED", "a b=c");
        let r = run(command, "test").await.unwrap();
        // The set of variables is exact; their order is not promised (a shell reorders).
        assert_eq!(sorted_lines(&r.stdout_str()), ["ONE=1", "SPACED=a b=c"]);

        let command = sh("cat; pwd", dir.path()).stdin("fed\n");
        let r = run(command, "test").await.unwrap();
        let cwd = dir.path().canonicalize().unwrap();
        assert_eq!(r.stdout_str(), format!("fed\n{}\n", cwd.display()));
    }

    fn sorted_lines(text: &str) -> Vec<&str> {
        let mut lines: Vec<&str> = text.lines().collect();
        lines.sort();
        lines
    }

    /// Variables a shell sets or resets itself: the wrapper restores them.
    const SHELL_VARS: &[(&str, &str)] = &[
        ("PATH", MINIMAL_PATH),
        ("PWD", "/nowhere"),
        ("OLDPWD", "/before"),
        ("IFS", "x"),
        ("OPTIND", "9"),
        ("PPID", "1"),
        ("SHLVL", "5"),
        ("_", "u"),
        ("BASH_ENV", "/nothing"),
    ];

    /// Spins on shell builtins (no fork) until the shell is in a `cmd-…` cgroup of ours:
    /// for commands joined from outside, which may run a moment before the move.
    const UNTIL_JOINED: &str = "j=; until [ -n \"$j\" ]; do while read -r l; do \
        case $l in */sandbox-harness-*/cmd-*) j=1;; esac; done < /proc/self/cgroup; done\n";

    fn env_lines(vars: &[(&str, &str)]) -> Vec<String> {
        let mut lines: Vec<String> = vars.iter().map(|(k, v)| format!("{k}={v}")).collect();
        lines.sort();
        lines
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn shell_variables_pass_the_wrapper_exactly() {
        let dir = tempfile::tempdir().unwrap();
        for tracking in Tracking::available() {
            let command = HostCommand::new(["env"], dir.path()).envs(SHELL_VARS.iter().copied());
            let r = run_tracked(command, "test", &tracking).await.unwrap();
            let what = tracking.describe();
            assert_eq!(
                sorted_lines(&r.stdout_str()),
                env_lines(SHELL_VARS),
                "{what}"
            );
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_name_a_shell_would_drop_is_passed_exactly_and_joined_from_outside() {
        let dir = tempfile::tempdir().unwrap();
        let mut vars = SHELL_VARS.to_vec();
        vars.push(("spring.profiles.active", "dev"));
        for tracking in Tracking::available() {
            let what = tracking.describe();
            let command = HostCommand::new(["env"], dir.path()).envs(vars.iter().copied());
            let r = run_tracked(command, "test", &tracking).await.unwrap();
            assert_eq!(sorted_lines(&r.stdout_str()), env_lines(&vars), "{what}");
            let Some(parent) = tracking.parent() else {
                continue;
            };
            // What it starts once moved dies with it.
            let line = format!(
                "{UNTIL_JOINED}cat /proc/self/cgroup; \
                 setsid sh -c 'echo $$ > sid.pid; exec sleep 300' & \
                 while [ ! -s sid.pid ]; do sleep 0.01; done"
            );
            let command = sh(&line, dir.path()).envs(vars.iter().copied());
            let r = run_tracked(command, "test", &tracking).await.unwrap();
            assert_eq!(r.exit_code, Some(0), "{what}: {r:?}");
            let _ = own_cgroup(&r.stdout_str(), parent);
            let pid = read_pid(&dir.path().join("sid.pid"));
            assert!(
                wait_gone(pid, Duration::from_secs(5)).await,
                "{what}: the setsid process {pid} survived"
            );
            std::fs::remove_file(dir.path().join("sid.pid")).unwrap();
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn joining_from_outside_copes_with_commands_that_exit_at_once() {
        let dir = tempfile::tempdir().unwrap();
        let Some(tracking) = Tracking::available()
            .into_iter()
            .find(|t| t.parent().is_some())
        else {
            eprintln!("no cgroups: nothing to join");
            return;
        };
        let tracking = tracking.joining_from_outside();
        for _ in 0..50 {
            let command = HostCommand::new(["/bin/true"], dir.path());
            let r = run_tracked(command, "test", &tracking).await.unwrap();
            assert_eq!(r.exit_code, Some(0), "{r:?}");
        }
        // Every escape, started once the command was moved.
        let cwd = dir.path().to_path_buf();
        let survived = survivors(dir.path(), End::Exit, |script, timeout| {
            let script = format!("{UNTIL_JOINED}{script}");
            run_tracked(sh(&script, &cwd).timeout(timeout), "test", &tracking)
        })
        .await;
        assert!(survived.is_empty(), "survived {survived:?}");
    }

    fn bash(line: &str, cwd: &Path) -> HostCommand {
        HostCommand::new(["bash", "-c", line], cwd).envs(minimal_env(cwd))
    }

    /// `bash -c` commands (the local backend's default shell) join their cgroup through
    /// `BASH_ENV`, in their own process: they land in their cgroup, see exactly the
    /// environment and shell state an untracked bash sees, and nothing they start survives.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn bash_commands_join_through_bash_env_exactly_and_nothing_escapes() {
        let dir = tempfile::tempdir().unwrap();
        let line = "echo \"[$_] $0 $LINENO $?\"; declare -F; cat /proc/self/cgroup >&2; exec env";
        let untracked = run_tracked(bash(line, dir.path()), "test", &Tracking::process_group())
            .await
            .unwrap();
        let mut joined_any = false;
        for tracking in Tracking::available() {
            let (Some(parent), true) = (tracking.parent(), tracking.joins_bash_itself()) else {
                continue;
            };
            joined_any = true;
            let what = tracking.describe();
            let r = run_tracked(bash(line, dir.path()), "test", &tracking)
                .await
                .unwrap();
            assert_eq!(r.exit_code, Some(0), "{what}: {r:?}");
            let _ = own_cgroup(&r.stderr_str(), parent);
            assert_eq!(
                sorted_lines(&r.stdout_str()),
                sorted_lines(&untracked.stdout_str()),
                "{what}"
            );
            for end in [End::Exit, End::Timeout, End::Cancel] {
                // A directory per round: a round's files must not answer for the next one's.
                let round = tempfile::tempdir().unwrap();
                let cwd = round.path().to_path_buf();
                let survived = survivors(round.path(), end, |script, timeout| {
                    run_tracked(bash(&script, &cwd).timeout(timeout), "test", &tracking)
                })
                .await;
                assert!(
                    survived.is_empty(),
                    "{what}: {end:?}: survived {survived:?}"
                );
            }
        }
        if tree_kill().kills_escaped() {
            assert!(
                joined_any,
                "cgroups here, but no tracking joins bash itself"
            );
        }
    }

    #[test]
    fn bash_env_is_used_only_when_bash_reads_it_as_probed() {
        let Some(tracking) = Tracking::available()
            .into_iter()
            .find(|t| t.joins_bash_itself())
        else {
            return;
        };
        let dir = tempfile::tempdir().unwrap();
        let uses = |argv: &[&str], vars: &[(&str, &str)]| {
            let argv: Vec<String> = argv.iter().map(|a| (*a).to_owned()).collect();
            let env: BTreeMap<OsString, OsString> = vars
                .iter()
                .map(|(k, v)| ((*k).into(), (*v).into()))
                .collect();
            let cg = tracking
                .start_for(&argv, dir.path(), &env, false)
                .unwrap()
                .unwrap();
            cg.bash_env().is_some()
        };
        let path = ("PATH", MINIMAL_PATH);
        assert!(uses(&["bash", "-c", "true"], &[path]));
        assert!(uses(&["bash", "-c", "true", "name", "arg"], &[path]));
        // Not bash -c, not the probed bash, or an environment that changes how bash starts.
        assert!(!uses(&["bash", "-lc", "true"], &[path]));
        assert!(!uses(&["bash", "script.sh"], &[path]));
        assert!(!uses(&["sh", "-c", "true"], &[path]));
        assert!(!uses(&["bash", "-c", "true"], &[("PATH", "/nonexistent")]));
        assert!(!uses(&["bash", "-c", "true"], &[]));
        for blocker in [
            "BASH_ENV",
            "SHELLOPTS",
            "POSIXLY_CORRECT",
            "SANDBOX_HARNESS_CGROUP",
        ] {
            assert!(
                !uses(&["bash", "-c", "true"], &[path, (blocker, "x")]),
                "{blocker}"
            );
        }
    }

    #[test]
    fn the_wrapper_is_used_when_it_carries_the_command_exactly() {
        let Some(tracking) = Tracking::available()
            .into_iter()
            .find(|t| t.parent().is_some())
        else {
            return;
        };
        let by_wrapper = |program: &str, vars: &[(&str, &str)]| {
            let env: BTreeMap<OsString, OsString> = vars
                .iter()
                .map(|(k, v)| ((*k).into(), (*v).into()))
                .collect();
            let cg = tracking.start(program, &env, false).unwrap().unwrap();
            cg.by_wrapper()
        };
        // When /bin/sh passed the canary (dash does, bash does not).
        let exact = tracking.wrapper_exact();
        assert_eq!(by_wrapper("env", SHELL_VARS), exact);
        assert_eq!(by_wrapper("env", &[("PATH", "/bin"), ("_X1", "")]), exact);
        // A program without a slash needs a PATH; with one it does not.
        assert!(!by_wrapper("env", &[("HOME", "/h")]));
        assert_eq!(by_wrapper("/usr/bin/env", &[("HOME", "/h")]), exact);
        // Names a shell drops, and ours.
        for name in [
            "spring.profiles.active",
            "1X",
            "BASH_FUNC_f%%",
            "SANDBOX_HARNESS_SAVED",
        ] {
            assert!(
                !by_wrapper("env", &[("PATH", "/bin"), (name, "v")]),
                "{name}"
            );
        }
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
