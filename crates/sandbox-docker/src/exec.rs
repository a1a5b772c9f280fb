//! Commands through the exec API: create, start attached (stdout and stderr demultiplexed and
//! capped, stdin fed then closed), exit code from the exec inspect, and a timeout that kills
//! the command's whole process tree inside the container.
//!
//! How the tree is found: every command runs with a unique marker variable in its environment
//! (`SANDBOX_EXEC_ID=<uuid>`), which every descendant inherits whatever it does with process
//! groups, sessions or its parent (a daemonized grandchild keeps it). On timeout a second exec
//! freezes every process carrying the marker, adds their descendants (for the rare child that
//! cleared its environment), kills them all, and repeats until none is left. Only POSIX `sh`
//! builtins and `/proc` are needed, so busybox and Debian images both work; and the script
//! never forks, so it works when the command filled the box's process limit (a fork bomb):
//! the engine places the kill exec's own process in the box even then, but any fork inside
//! would fail.
//!
//! The same kill runs when the command's future is dropped (a cancelled call: a [`Reaper`]
//! spawns it) and, in the background, after the command exited (whatever it left running).
//!
//! What runs is never in the exec's configuration: the engine keeps that (exec inspect,
//! `docker events`) and bollard logs request bodies at `debug`, and a command line or an
//! environment value may be a secret. The exec runs a fixed launcher ([`LAUNCHER`]) that reads
//! the command's script (working directory, environment, argv, all quoted; the agent's
//! format) from stdin up to a random end line, then `exec`s it with the rest of stdin as the
//! command's own.

use std::time::{Duration, Instant};

use bollard::Docker;
use bollard::container::LogOutput;
use bollard::exec::{CreateExecOptions, StartExecOptions, StartExecResults};
use bytes::Bytes;
use futures::StreamExt;
use sandbox_core::{
    CappedBuffer, CapturedOutput, Error, ExecResult, Inflight, InflightGuard, OutputLimits, Result,
};
use tokio::io::AsyncWriteExt;

use crate::BACKEND;
use crate::engine::Engine;

pub(crate) use sandbox_core::posix::MARKER_VAR;

/// How long output is still drained after the tree was killed.
const DRAIN_AFTER_KILL: Duration = Duration::from_secs(5);

/// One exec.
#[derive(Clone)]
pub(crate) struct ExecSpec {
    pub argv: Vec<String>,
    /// `KEY=value` pairs (values are never logged).
    pub env: Vec<String>,
    pub cwd: Option<String>,
    pub user: Option<String>,
    pub stdin: Option<Bytes>,
    pub limits: OutputLimits,
    pub timeout: Duration,
    /// Counts the command until its tree is dead, also past a drop (the box's `settle`).
    pub counted_by: Option<Inflight>,
}

/// Reads a script from stdin up to the line `$1` and runs it; the rest of stdin is the
/// command's. `read` takes one byte at a time from a pipe (dash, bash and busybox alike), so
/// nothing of the command's stdin is consumed. A script cut off before its end line is not
/// run.
const LAUNCHER: &str = r#"
s=; ok=
while IFS= read -r l; do
  if [ "$l" = "$1" ]; then ok=1; break; fi
  s="$s$l
"
done
[ -n "$ok" ] || { echo "sandbox: the command did not arrive" >&2; exit 125; }
eval "$s"
"#;

/// Run `spec` in `container` and collect its result.
pub(crate) async fn run(
    engine: &Engine,
    docker: &Docker,
    container: &str,
    spec: ExecSpec,
) -> Result<ExecResult> {
    let started = Instant::now();
    let marker = uuid::Uuid::new_v4().simple().to_string();
    // From here on, however this future ends, the command's tree dies with it.
    let mut reaper = Reaper::new(engine, docker, container, &marker, &spec);
    let end = uuid::Uuid::new_v4().simple().to_string();
    let mut header = crate::agent::script(&spec);
    header.push_str(&end);
    header.push('\n');
    let config = CreateExecOptions {
        attach_stdin: Some(true),
        attach_stdout: Some(true),
        attach_stderr: Some(true),
        tty: Some(false),
        // The marker only: the launcher must carry it too, to be killed on a timeout.
        env: Some(vec![format!("{MARKER_VAR}={marker}")]),
        cmd: Some(vec![
            "sh".to_owned(),
            "-c".to_owned(),
            LAUNCHER.to_owned(),
            "sandbox-exec".to_owned(),
            end,
        ]),
        user: spec.user.clone(),
        ..Default::default()
    };
    let id = docker
        .create_exec(container, config)
        .await
        .map_err(|e| engine.err("exec", "container", container, e))?
        .id;
    let start = StartExecOptions {
        detach: false,
        tty: false,
        output_capacity: Some(64 * 1024),
    };
    let (mut output, input) = match docker
        .start_exec(&id, Some(start))
        .await
        .map_err(|e| engine.err("exec", "container", container, e))?
    {
        StartExecResults::Attached { output, input } => (output, input),
        StartExecResults::Detached => {
            return Err(Error::backend(
                BACKEND,
                "exec",
                "the engine detached the exec",
            ));
        }
    };
    // Feed the launcher and then stdin concurrently with reading output (a command may fill
    // its stdout before it has read all of stdin), then half-close so the command sees
    // end-of-file.
    let stdin = spec.stdin;
    let feeder = tokio::spawn(async move {
        let mut input = input;
        if input.write_all(header.as_bytes()).await.is_ok()
            && let Some(data) = stdin
        {
            let _ = input.write_all(&data).await;
        }
        let _ = input.shutdown().await;
    });

    let mut stdout = CappedBuffer::new(spec.limits.stdout);
    let mut stderr = CappedBuffer::new(spec.limits.stderr);
    let deadline = tokio::time::Instant::now() + spec.timeout;
    let mut timed_out = false;
    let mut drain_until = None;
    loop {
        let wake = drain_until.unwrap_or(deadline);
        tokio::select! {
            item = output.next() => match item {
                Some(Ok(LogOutput::StdOut { message })) | Some(Ok(LogOutput::Console { message })) => stdout.push(&message),
                Some(Ok(LogOutput::StdErr { message })) => stderr.push(&message),
                Some(Ok(LogOutput::StdIn { .. })) => {}
                Some(Err(e)) => {
                    if timed_out {
                        break;
                    }
                    return Err(engine.err("exec output", "container", container, e));
                }
                None => break,
            },
            _ = tokio::time::sleep_until(wake) => {
                if timed_out {
                    tracing::warn!(container, "output still open after killing a timed-out command; giving up on it");
                    break;
                }
                timed_out = true;
                tracing::info!(container, timeout = ?spec.timeout, "exec timed out: killing its process tree");
                if let Err(e) = kill_tree(engine, docker, container, &marker, spec.user.clone()).await {
                    tracing::warn!(container, error = %e, "killing a timed-out command failed");
                }
                drain_until = Some(tokio::time::Instant::now() + DRAIN_AFTER_KILL);
            }
        }
    }
    drop(output);
    feeder.abort();
    let exit_code = exit_code(engine, docker, container, &id).await?;
    let output = CapturedOutput {
        stdout: stdout.finish(),
        stderr: stderr.finish(),
    };
    if timed_out {
        reaper.disarm(); // killed above
    }
    // Otherwise the reaper kills, in the background, whatever the command left running.
    drop(reaper);
    let exit_code = if timed_out { None } else { exit_code };
    Ok(ExecResult::new(
        exit_code,
        output,
        timed_out,
        started.elapsed(),
    ))
}

/// The exit code from the exec inspect; the attach stream can end a moment before the engine
/// records the exit, so a still-running exec is polled briefly.
async fn exit_code(
    engine: &Engine,
    docker: &Docker,
    container: &str,
    id: &str,
) -> Result<Option<i32>> {
    let mut delay = Duration::from_millis(1);
    for _ in 0..40 {
        let inspect = docker
            .inspect_exec(id)
            .await
            .map_err(|e| engine.err("exec inspect", "exec", id, e))?;
        if inspect.running != Some(true) {
            return Ok(inspect.exit_code.map(|c| c as i32));
        }
        tokio::time::sleep(delay).await;
        delay = (delay * 2).min(Duration::from_millis(50));
    }
    tracing::warn!(
        container,
        exec = id,
        "exec still running after its output ended"
    );
    Ok(None)
}

pub(crate) use sandbox_core::posix_reap_fn as reap_fn;

use sandbox_core::posix::KILL_SCRIPT;

/// Kills a command's process tree (by its marker) when dropped, on a spawned task: the command
/// of a cancelled call, or what a finished command left running. [`disarm`](Self::disarm)
/// when the tree was already killed.
pub(crate) struct Reaper {
    engine: Engine,
    docker: Docker,
    container: String,
    marker: String,
    user: Option<String>,
    armed: bool,
    /// Held until the kill finished (on its task, when dropped armed).
    counted: Option<InflightGuard>,
}

impl Reaper {
    pub(crate) fn new(
        engine: &Engine,
        docker: &Docker,
        container: &str,
        marker: &str,
        spec: &ExecSpec,
    ) -> Self {
        Reaper {
            engine: engine.clone(),
            docker: docker.clone(),
            container: container.to_owned(),
            marker: marker.to_owned(),
            user: spec.user.clone(),
            armed: true,
            counted: spec.counted_by.as_ref().map(Inflight::enter),
        }
    }

    pub(crate) fn disarm(&mut self) {
        self.armed = false;
    }
}

impl Drop for Reaper {
    fn drop(&mut self) {
        if !self.armed {
            return;
        }
        let Ok(rt) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let (engine, docker, container, marker, user, counted) = (
            self.engine.clone(),
            self.docker.clone(),
            std::mem::take(&mut self.container),
            std::mem::take(&mut self.marker),
            self.user.take(),
            self.counted.take(),
        );
        rt.spawn(async move {
            if let Err(e) = kill_tree(&engine, &docker, &container, &marker, user).await {
                tracing::warn!(container, error = %e, "killing a command's processes failed");
            }
            // The tree is dead (or could not be killed: logged): the box may settle.
            drop(counted);
        });
    }
}

/// Kill attempts before giving up.
const KILL_ATTEMPTS: u32 = 5;

/// Kill the process tree of the command carrying `marker`. In a box whose process limit the
/// command filled, the runtime sometimes cannot start the kill exec ("read init-p: connection
/// reset by peer": the runtime's own setup needs a thread or two inside the box), so failed
/// attempts are retried after a short pause; killing is idempotent.
pub(crate) async fn kill_tree(
    engine: &Engine,
    docker: &Docker,
    container: &str,
    marker: &str,
    user: Option<String>,
) -> Result<()> {
    let mut attempt = 1;
    loop {
        match kill_once(engine, docker, container, marker, user.clone()).await {
            Ok(()) => return Ok(()),
            Err(e @ Error::Unavailable { .. }) => return Err(e),
            Err(e) if attempt == KILL_ATTEMPTS => return Err(e),
            Err(e) => {
                tracing::debug!(container, attempt, error = %e, "kill attempt failed; retrying");
                tokio::time::sleep(Duration::from_millis(100) * attempt).await;
                attempt += 1;
            }
        }
    }
}

async fn kill_once(
    engine: &Engine,
    docker: &Docker,
    container: &str,
    marker: &str,
    user: Option<String>,
) -> Result<()> {
    let config = CreateExecOptions {
        attach_stdout: Some(true),
        attach_stderr: Some(true),
        cmd: Some(vec![
            "sh".to_owned(),
            "-c".to_owned(),
            KILL_SCRIPT.to_owned(),
            "sandbox-kill".to_owned(),
            marker.to_owned(),
        ]),
        user,
        ..Default::default()
    };
    let id = docker
        .create_exec(container, config)
        .await
        .map_err(|e| engine.err("kill", "container", container, e))?
        .id;
    let started = Instant::now();
    // The script prints nothing itself; what the shell says about a failure is kept for the
    // error.
    let mut said = CappedBuffer::new(4096);
    if let StartExecResults::Attached { mut output, .. } = docker
        .start_exec(&id, None)
        .await
        .map_err(|e| engine.err("kill", "container", container, e))?
    {
        let drain = async {
            while let Some(Ok(frame)) = output.next().await {
                said.push(&frame.into_bytes());
            }
        };
        let _ = tokio::time::timeout(Duration::from_secs(30), drain).await;
    }
    let code = exit_code(engine, docker, container, &id).await?;
    tracing::debug!(
        container,
        ?code,
        ms = started.elapsed().as_millis() as u64,
        "kill script done"
    );
    match code {
        Some(0) => Ok(()),
        code => Err(Error::backend(
            BACKEND,
            "kill",
            format!(
                "the kill script ended with {code:?}: {}",
                String::from_utf8_lossy(&said.finish().bytes).trim()
            ),
        )),
    }
}
