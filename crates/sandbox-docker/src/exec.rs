//! Commands through the exec API: create, start attached (stdout and stderr demultiplexed and
//! capped, stdin fed then closed), exit code from the exec inspect, and a timeout that kills
//! the command's whole process tree inside the container.
//!
//! How the tree is found: every command runs with a unique marker variable in its environment
//! (`SANDBOX_EXEC_ID=<uuid>`), which every descendant inherits whatever it does with process
//! groups, sessions or its parent (a daemonized grandchild keeps it). On timeout a second exec
//! freezes every process carrying the marker, adds their descendants (for the rare child that
//! cleared its environment), kills them all, and repeats until none is left. Only POSIX `sh`,
//! `grep -z` and `/proc` are needed, so busybox and Debian images both work.
//!
//! The same kill runs when the command's future is dropped (a cancelled call: a [`Reaper`]
//! spawns it) and, in the background, after the command exited (whatever it left running).

use std::time::{Duration, Instant};

use bollard::Docker;
use bollard::container::LogOutput;
use bollard::exec::{CreateExecOptions, StartExecOptions, StartExecResults};
use bytes::Bytes;
use futures::StreamExt;
use sandbox_core::{CappedBuffer, CapturedOutput, Error, ExecResult, OutputLimits, Result};
use tokio::io::AsyncWriteExt;

use crate::BACKEND;
use crate::engine::Engine;

/// Name of the marker variable.
pub(crate) const MARKER_VAR: &str = "SANDBOX_EXEC_ID";

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
}

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
    let mut reaper = Reaper::new(docker, container, &marker, spec.user.clone());
    let mut env = spec.env;
    env.push(format!("{MARKER_VAR}={marker}"));
    let config = CreateExecOptions {
        attach_stdin: Some(spec.stdin.is_some()),
        attach_stdout: Some(true),
        attach_stderr: Some(true),
        tty: Some(false),
        env: Some(env),
        cmd: Some(spec.argv),
        user: spec.user.clone(),
        working_dir: spec.cwd,
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
    // Feed stdin concurrently with reading output (a command may fill its stdout before it
    // has read all of stdin), then half-close so the command sees end-of-file.
    let mut input = Some(input);
    let feeder = spec.stdin.map(|data| {
        let mut input = input.take().expect("input once");
        tokio::spawn(async move {
            let _ = input.write_all(&data).await;
            let _ = input.shutdown().await;
        })
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
                if let Err(e) = kill_tree(docker, container, &marker, spec.user.clone()).await {
                    tracing::warn!(container, error = %e, "killing a timed-out command failed");
                }
                drain_until = Some(tokio::time::Instant::now() + DRAIN_AFTER_KILL);
            }
        }
    }
    drop(output);
    drop(input);
    if let Some(f) = feeder {
        f.abort();
    }
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

/// A shell function `reap <marker>`: kill every process carrying the marker in its
/// environment, and their descendants. Shared by the kill exec and the exec agent.
macro_rules! reap_fn {
    () => {
        r#"
reap() {
  _rm="SANDBOX_EXEC_ID=$1"
  _rr=0
  while [ $_rr -lt 50 ]; do
    set --
    for _rf in $(grep -lzxF -- "$_rm" /proc/[0-9]*/environ 2>/dev/null); do
      _rp=${_rf#/proc/}; _rp=${_rp%/environ}
      set -- "$@" "$_rp"
    done
    [ $# -eq 0 ] && return 0
    kill -STOP "$@" 2>/dev/null
    _rg=1
    while [ -n "$_rg" ]; do
      _rg=
      for _rs in /proc/[0-9]*/status; do
        _rq=${_rs#/proc/}; _rq=${_rq%/status}
        case " $* " in *" $_rq "*) continue ;; esac
        _rpp=
        while read -r _rk _rv; do
          if [ "$_rk" = "PPid:" ]; then _rpp=$_rv; break; fi
        done < "$_rs" 2>/dev/null
        case " $* " in *" $_rpp "*) kill -STOP "$_rq" 2>/dev/null; set -- "$@" "$_rq"; _rg=1 ;; esac
      done
    done
    kill -KILL "$@" 2>/dev/null
    _rr=$((_rr + 1))
  done
  return 1
}
"#
    };
}
pub(crate) use reap_fn;

/// Kill every process carrying the marker `$1` in its environment, and their descendants.
const KILL_SCRIPT: &str = concat!(reap_fn!(), "reap \"$1\"\n");

/// Kills a command's process tree (by its marker) when dropped, on a spawned task: the command
/// of a cancelled call, or what a finished command left running. [`disarm`](Self::disarm)
/// when the tree was already killed.
pub(crate) struct Reaper {
    docker: Docker,
    container: String,
    marker: String,
    user: Option<String>,
    armed: bool,
}

impl Reaper {
    pub(crate) fn new(
        docker: &Docker,
        container: &str,
        marker: &str,
        user: Option<String>,
    ) -> Self {
        Reaper {
            docker: docker.clone(),
            container: container.to_owned(),
            marker: marker.to_owned(),
            user,
            armed: true,
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
        let (docker, container, marker, user) = (
            self.docker.clone(),
            std::mem::take(&mut self.container),
            std::mem::take(&mut self.marker),
            self.user.take(),
        );
        rt.spawn(async move {
            if let Err(e) = kill_tree(&docker, &container, &marker, user).await {
                tracing::warn!(container, error = %e, "killing a command's processes failed");
            }
        });
    }
}

fn kill_err(e: bollard::errors::Error) -> Error {
    Error::Backend {
        backend: BACKEND,
        operation: "kill",
        message: e.to_string(),
        source: Some(Box::new(e)),
    }
}

pub(crate) async fn kill_tree(
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
        .map_err(kill_err)?
        .id;
    if let StartExecResults::Attached { mut output, .. } =
        docker.start_exec(&id, None).await.map_err(kill_err)?
    {
        let drain = async { while output.next().await.is_some() {} };
        let _ = tokio::time::timeout(Duration::from_secs(30), drain).await;
    }
    let mut code = None;
    for _ in 0..40 {
        let inspect = docker.inspect_exec(&id).await.map_err(kill_err)?;
        if inspect.running != Some(true) {
            code = inspect.exit_code;
            break;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    match code {
        Some(0) => Ok(()),
        code => Err(Error::backend(
            BACKEND,
            "kill",
            format!("the kill script ended with {code:?}"),
        )),
    }
}
