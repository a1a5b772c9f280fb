//! The host shell of the local mode.
//!
//! sandbox-local has the same machinery for its boxes but keeps it crate-private; this is the
//! minimum the local mode needs, with the same semantics: `sh -c` in its own process group,
//! output read concurrently with a cap, the whole group killed when the command ends or times
//! out (and when the call is dropped), a minimal environment unless told to inherit.

use std::collections::BTreeMap;
use std::fmt;
use std::path::PathBuf;
use std::process::Stdio;
use std::time::{Duration, Instant};

use async_trait::async_trait;
use nix::sys::signal::{Signal, killpg};
use nix::unistd::Pid;
use sandbox_core::{CapturedOutput, Error, ExecResult, Result, read_capped};
use tracing::Instrument as _;

use crate::filesystem::Shell;

/// `PATH` given to commands that do not inherit the environment.
const DEFAULT_PATH: &str = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";
/// How long output pipes may stay open after the process group is gone.
const READER_GRACE: Duration = Duration::from_secs(1);

/// `sh -c` on the host.
#[derive(Clone)]
pub(crate) struct LocalShell {
    pub(crate) cwd: PathBuf,
    pub(crate) home: PathBuf,
    pub(crate) timeout: Duration,
    pub(crate) max_output: usize,
    pub(crate) env: BTreeMap<String, String>,
    pub(crate) inherit_env: bool,
}

impl fmt::Debug for LocalShell {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LocalShell")
            .field("cwd", &self.cwd)
            .field("timeout", &self.timeout)
            .field("max_output", &self.max_output)
            .field("env", &self.env.keys().collect::<Vec<_>>())
            .field("inherit_env", &self.inherit_env)
            .finish()
    }
}

/// Kills the process group when dropped, unless disarmed: a cancelled call leaves nothing
/// running.
struct GroupGuard(Option<Pid>);

impl GroupGuard {
    fn kill(&mut self) {
        if let Some(pgid) = self.0.take() {
            // ESRCH (already gone) is fine.
            let _ = killpg(pgid, Signal::SIGKILL);
        }
    }
}

impl Drop for GroupGuard {
    fn drop(&mut self) {
        self.kill();
    }
}

#[async_trait]
impl Shell for LocalShell {
    async fn execute(&self, command: &str, timeout: Option<Duration>) -> Result<ExecResult> {
        let timeout = timeout.unwrap_or(self.timeout);
        let span = tracing::info_span!(
            "execute",
            mode = "local",
            timeout_ms = timeout.as_millis() as u64
        );
        self.run(command, timeout).instrument(span).await
    }
}

impl LocalShell {
    async fn run(&self, command: &str, timeout: Duration) -> Result<ExecResult> {
        if command.contains('\0') {
            return Err(Error::invalid("command", "contains a NUL byte"));
        }
        let mut cmd = tokio::process::Command::new("sh");
        cmd.arg("-c")
            .arg(command)
            .current_dir(&self.cwd)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .process_group(0)
            .kill_on_drop(true);
        if !self.inherit_env {
            cmd.env_clear()
                .env("PATH", DEFAULT_PATH)
                .env("HOME", &self.home)
                .env("LANG", "C.UTF-8");
        }
        cmd.envs(&self.env);
        let started = Instant::now();
        let mut child = cmd.spawn().map_err(|e| Error::io(&self.cwd, e))?;
        let mut group = GroupGuard(child.id().map(|id| Pid::from_raw(id as i32)));
        let stdout = child.stdout.take().expect("piped");
        let stderr = child.stderr.take().expect("piped");
        let cap = self.max_output;
        let out_task = tokio::spawn(read_capped(stdout, cap));
        let err_task = tokio::spawn(read_capped(stderr, cap));
        // Wait for the shell itself; its output is read concurrently all along.
        let (status, timed_out) = match tokio::time::timeout(timeout, child.wait()).await {
            Ok(status) => (Some(status.map_err(|e| Error::io(&self.cwd, e))?), false),
            Err(_) => (None, true),
        };
        // As in sandbox-local: whatever the command left in its group (background jobs,
        // grandchildren) dies with it, after a normal exit as after a timeout.
        group.kill();
        if timed_out {
            let _ = child.wait().await;
            tracing::warn!("command timed out; process group killed");
        }
        // Only a process that left the group (setsid) can keep the pipes open now: bound the
        // wait for the rest of the output.
        let (out, err) = tokio::join!(
            tokio::time::timeout(READER_GRACE, out_task),
            tokio::time::timeout(READER_GRACE, err_task)
        );
        let output = CapturedOutput {
            stdout: out.ok().map(joined).transpose()?.unwrap_or_default(),
            stderr: err.ok().map(joined).transpose()?.unwrap_or_default(),
        };
        let code = status.and_then(|s| s.code());
        let result = ExecResult::new(code, output, timed_out, started.elapsed());
        tracing::info!(exit_code = ?result.exit_code, timed_out, truncated = result.truncated(), "executed");
        Ok(result)
    }
}

fn joined(
    r: std::result::Result<std::io::Result<sandbox_core::Captured>, tokio::task::JoinError>,
) -> Result<sandbox_core::Captured> {
    match r {
        Ok(Ok(c)) => Ok(c),
        Ok(Err(e)) => Err(Error::from(e)),
        Err(e) => Err(Error::backend(
            "local",
            "execute",
            format!("output reader failed: {e}"),
        )),
    }
}
