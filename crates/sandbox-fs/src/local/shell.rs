//! The host shell of the local mode.
//!
//! sandbox-local has the same machinery for its boxes but keeps it crate-private; this is the
//! minimum the local mode needs: `sh -c` in its own process group, output read concurrently
//! with a cap, the whole group killed on timeout (and when the call is dropped), a minimal
//! environment unless told to inherit.

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
    fn disarm(&mut self) {
        self.0 = None;
    }

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
        let mut out_task = tokio::spawn(read_capped(stdout, cap));
        let mut err_task = tokio::spawn(read_capped(stderr, cap));
        // Wait for the shell and for both pipes: a backgrounded grandchild holding a pipe keeps
        // the command running until the timeout kills its group.
        let finished = tokio::time::timeout(timeout, async {
            let status = child.wait().await;
            let out = (&mut out_task).await;
            let err = (&mut err_task).await;
            (status, out, err)
        })
        .await;
        match finished {
            Ok((status, out, err)) => {
                let status = status.map_err(|e| Error::io(&self.cwd, e))?;
                // Finished normally: what it started in the background with its output sent
                // elsewhere (a dev server) is left running, on purpose.
                group.disarm();
                let output = CapturedOutput {
                    stdout: joined(out)?,
                    stderr: joined(err)?,
                };
                let result = ExecResult::new(status.code(), output, false, started.elapsed());
                tracing::info!(exit_code = ?result.exit_code, truncated = result.truncated(), "executed");
                Ok(result)
            }
            Err(_) => {
                group.kill();
                let _ = child.wait().await;
                tracing::warn!("command timed out; process group killed");
                // The readers end once every holder of the pipes is dead; output so far is kept.
                // A process that left the group (setsid) could hold them: bound the wait.
                let grace = Duration::from_secs(2);
                let (out, err) = tokio::join!(
                    tokio::time::timeout(grace, out_task),
                    tokio::time::timeout(grace, err_task)
                );
                let output = CapturedOutput {
                    stdout: out.ok().map(joined).transpose()?.unwrap_or_default(),
                    stderr: err.ok().map(joined).transpose()?.unwrap_or_default(),
                };
                Ok(ExecResult::new(None, output, true, started.elapsed()))
            }
        }
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
