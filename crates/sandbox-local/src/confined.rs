//! Confined boxes ([`crate::Isolation::Confined`]): the box's init (`sandbox_confine`),
//! started when the box boots (or at its first command), shut down when it is released,
//! parked, destroyed or dropped; and the async side of one command in it.
//!
//! A command's end is its control stream's: the status frame when it exits, the stream
//! dropped on timeout or when the exec future is dropped (cancel). Either way the command's
//! init exits and the kernel kills everything left in its PID namespace, so its output pipes
//! close once everything it started is dead.

use std::os::fd::OwnedFd;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use sandbox_confine::{Bind, ConfineError, ConfineOptions, Confined, ExecSpec, Spawned};
use sandbox_core::{CapturedOutput, Error, ExecResult, OutputLimits, Result, read_capped};
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};

use crate::BACKEND;
use crate::fsutil::BindLink;

/// How long output pipes may stay open after the command's status came (its namespace is
/// being torn down; nothing in it can outlive that).
const READER_GRACE: Duration = Duration::from_secs(2);

/// A box's init, started on demand.
pub(crate) struct Slot {
    options: ConfineOptions,
    binds: Vec<Bind>,
    current: tokio::sync::Mutex<Option<Arc<Confined>>>,
}

pub(crate) fn to_error(e: ConfineError) -> Error {
    match e {
        ConfineError::Unavailable {
            missing,
            how_to_enable,
        } => Error::IsolationUnavailable {
            backend: BACKEND,
            missing,
            how_to_enable,
        },
        other => Error::backend(BACKEND, "start the box", other.to_string()),
    }
}

impl Slot {
    /// The box directory (the workspace's parent: an import swaps the workspace directory,
    /// so the box must see it by name) read-write at its own path, each bind link's host
    /// directory at its own path (read-only if declared so); the links in the workspace
    /// point there.
    pub(crate) fn new(options: ConfineOptions, box_dir: PathBuf, links: &[BindLink]) -> Slot {
        let mut binds = vec![Bind::same(box_dir, false)];
        binds.extend(
            links
                .iter()
                .map(|l| Bind::same(l.host.clone(), l.read_only)),
        );
        Slot {
            options,
            binds,
            current: tokio::sync::Mutex::new(None),
        }
    }

    /// The running init, started if there is none (or it died).
    pub(crate) async fn get(&self) -> Result<Arc<Confined>> {
        let mut current = self.current.lock().await;
        if let Some(c) = current.as_ref()
            && c.is_alive()
        {
            return Ok(c.clone());
        }
        let (options, binds) = (self.options.clone(), self.binds.clone());
        let started = tokio::task::spawn_blocking(move || Confined::start(&options, &binds))
            .await
            .map_err(|e| Error::backend(BACKEND, "start the box", e.to_string()))?
            .map_err(to_error)?;
        tracing::debug!(report = %started.report(), "confined box started");
        let started = Arc::new(started);
        *current = Some(started.clone());
        Ok(started)
    }

    /// Kill everything in the box (the next command starts a new init).
    pub(crate) async fn shutdown(&self) -> Result<()> {
        let taken = self.current.lock().await.take();
        if let Some(c) = taken {
            tokio::task::spawn_blocking(move || c.shutdown())
                .await
                .map_err(|e| Error::backend(BACKEND, "release", e.to_string()))?;
        }
        Ok(())
    }
}

fn cannot(argv0: &str, e: impl std::fmt::Display) -> Error {
    Error::backend(BACKEND, "exec", format!("cannot start `{argv0}`: {e}"))
}

fn receiver(fd: OwnedFd) -> std::io::Result<tokio::net::unix::pipe::Receiver> {
    tokio::net::unix::pipe::Receiver::from_owned_fd(fd)
}

/// Run one command in `confined` and collect its result (output caps, timeout, cancel as
/// `sandbox_core::host::run`).
///
/// The command counts in `inflight` (what `BoxHandle::settle` waits for) from before it is
/// spawned until both its output pipes reached their end — every process of its PID namespace
/// is dead — also when this future is dropped: the readers run on tasks of their own, and a
/// spawn whose caller left meanwhile is killed and drained on the spawning thread.
pub(crate) async fn run(
    confined: Arc<Confined>,
    mut spec: ExecSpec,
    stdin: Option<Bytes>,
    timeout: Duration,
    limits: OutputLimits,
    inflight: &sandbox_core::Inflight,
) -> Result<ExecResult> {
    let argv0 = spec.argv[0].clone();
    spec.stdin = stdin.is_some();
    let started = Instant::now();
    // Cleared when this future ends or is dropped: a spawn finishing after that is the
    // spawning thread's to kill and wait for.
    let caller = Arc::new(std::sync::atomic::AtomicBool::new(true));
    struct Leaving(Arc<std::sync::atomic::AtomicBool>);
    impl Drop for Leaving {
        fn drop(&mut self) {
            self.0.store(false, std::sync::atomic::Ordering::SeqCst);
        }
    }
    let leaving = Leaving(caller.clone());
    let spawning = inflight.enter();
    let spawned = tokio::task::spawn_blocking(move || {
        let spawned = confined.spawn(&spec)?;
        if !caller.load(std::sync::atomic::Ordering::SeqCst) {
            // Nobody reads it: closing the control stream kills its namespace; the pipes end
            // when its last process is dead, and only then is it no longer counted.
            let Spawned {
                control,
                stdin,
                stdout,
                stderr,
            } = spawned;
            drop((control, stdin));
            for fd in [stdout, stderr] {
                let mut f = std::fs::File::from(fd);
                let _ = std::io::copy(&mut f, &mut std::io::sink());
            }
            drop(spawning);
            return Err(std::io::Error::other(
                "the caller left before the command started",
            ));
        }
        Ok((spawned, spawning))
    })
    .await
    .map_err(|e| cannot(&argv0, e))?
    .map_err(|e| cannot(&argv0, e))?;
    drop(leaving);
    // Still counted by `spawning` until the readers' counts are taken below. (A drop in the
    // instant between the spawn's return and this point closes the control stream, which kills
    // the command, but is not waited for.)
    let (spawned, spawning) = spawned;
    let control = std::os::unix::net::UnixStream::from(spawned.control);
    control
        .set_nonblocking(true)
        .map_err(|e| cannot(&argv0, e))?;
    // Dropped (timeout, cancel) = everything the command started is killed.
    let mut control = tokio::net::UnixStream::from_std(control).map_err(|e| cannot(&argv0, e))?;
    let stdout = receiver(spawned.stdout).map_err(|e| cannot(&argv0, e))?;
    let stderr = receiver(spawned.stderr).map_err(|e| cannot(&argv0, e))?;
    let stdin_task = match (stdin, spawned.stdin) {
        (Some(data), Some(fd)) => {
            let mut pipe =
                tokio::net::unix::pipe::Sender::from_owned_fd(fd).map_err(|e| cannot(&argv0, e))?;
            Some(tokio::spawn(async move {
                // A command that exits without reading its input closes the pipe.
                let _ = pipe.write_all(&data).await;
            }))
        }
        _ => None,
    };
    // Each reader holds a count until its pipe ends (the command's namespace is dead), on its
    // own task, so a dropped exec stays counted until then.
    let (out_count, err_count) = (inflight.enter(), inflight.enter());
    drop(spawning);
    let out_task = tokio::spawn(async move {
        let r = read_capped(stdout, limits.stdout).await;
        drop(out_count);
        r
    });
    let err_task = tokio::spawn(async move {
        let r = read_capped(stderr, limits.stderr).await;
        drop(err_count);
        r
    });

    let status = tokio::time::timeout(timeout, async {
        let len = control.read_u32_le().await? as usize;
        if len > sandbox_confine::MAX_STATUS_FRAME {
            return Err(std::io::Error::new(
                std::io::ErrorKind::InvalidData,
                format!("a status frame of {len} bytes"),
            ));
        }
        let mut body = vec![0u8; len];
        control.read_exact(&mut body).await?;
        sandbox_confine::decode_status(&body)
    })
    .await;
    let (exit_code, timed_out) = match status {
        Ok(Ok(status)) => {
            if let Some(error) = status.error {
                return Err(cannot(&argv0, error));
            }
            (status.code, false)
        }
        Ok(Err(e)) => {
            return Err(Error::backend(
                BACKEND,
                "exec",
                format!("the box ended before `{argv0}` reported its exit: {e}"),
            ));
        }
        Err(_) => {
            drop(control);
            tracing::info!("timed out: everything the command started was killed");
            (None, true)
        }
    };
    let readers = async { (out_task.await, err_task.await) };
    let (out, err) = tokio::time::timeout(READER_GRACE, readers)
        .await
        .map_err(|_| {
            Error::backend(
                BACKEND,
                "exec",
                format!("the output of `{argv0}` stayed open after its box namespace ended"),
            )
        })?;
    if let Some(task) = stdin_task {
        task.abort();
    }
    let captured = |r: std::result::Result<std::io::Result<_>, tokio::task::JoinError>| match r {
        Ok(Ok(c)) => Ok(c),
        Ok(Err(e)) => Err(Error::backend(
            BACKEND,
            "exec",
            format!("reading the command's output failed: {e}"),
        )),
        Err(e) => Err(Error::backend(BACKEND, "exec", e.to_string())),
    };
    let output = CapturedOutput {
        stdout: captured(out)?,
        stderr: captured(err)?,
    };
    Ok(ExecResult::new(
        exit_code,
        output,
        timed_out,
        started.elapsed(),
    ))
}
