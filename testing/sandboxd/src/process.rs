//! The `process.v1.ProcessService` gRPC service.
//!
//! - Every process runs in its own process group (pgid = its pid): `SendSignal` and every
//!   kill reach the whole tree, grandchildren included.
//! - `Start` streams `init{process_id}`, then stdout and stderr chunks as they are read, then
//!   `exit{exit_code}`. When the stream's client goes away (cancel, deadline, disconnect)
//!   the group is SIGKILLed. Stdin is a pipe fed by `WriteStdin`.
//! - `Execute` collects the output; its stdin is `/dev/null`. Dropping the call (client
//!   cancel or gRPC deadline) SIGKILLs the group.
//! - Exit codes: the process's own, or `128 + n` when signal `n` killed it.
//! - Output is read until both pipes close. A background process that keeps them open after
//!   the main process exited gets [`Limits::drain_after_exit`] more; then the rest is dropped
//!   and the exit is reported.
//! - `process_id`s come from a counter (never reused while the server runs); the table is
//!   bounded by [`Limits::max_processes`] (`RESOURCE_EXHAUSTED` beyond it) and an entry is
//!   removed when its process exits.
//! - `env_vars` are added to the server's environment (keys must be non-empty without `=`
//!   or NUL); `cwd` is resolved beneath the base directory like a REST path (absolute paths
//!   are read relative to it) and defaults to it.
//! - Not implemented: PTYs (`StartRequest.pty` set, and `ResizeTTY`) answer `UNIMPLEMENTED`.

use std::collections::HashMap;
use std::os::fd::{AsFd as _, AsRawFd as _};
use std::os::unix::process::ExitStatusExt as _;
use std::pin::Pin;
use std::process::{ExitStatus, Stdio};
use std::sync::atomic::{AtomicI32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::Stream;
use nix::sys::signal::{Signal as NixSignal, killpg};
use nix::unistd::Pid;
use sandbox_core::beneath::{Dir, Follow};
use sandboxd_proto::{
    ExecuteRequest, ExecuteResponse, ExitEvent, InitEvent, ProcessConfig, ProcessService,
    ResizeTtyRequest, ResizeTtyResponse, SendSignalRequest, SendSignalResponse, Signal,
    StartRequest, StartResponse, WriteStdinRequest, WriteStdinResponse, start_response::Event,
    write_stdin_request::Payload,
};
use tokio::io::{AsyncRead, AsyncReadExt as _, AsyncWriteExt as _};
use tokio::process::{Child, ChildStdin, Command};
use tokio::sync::{OwnedSemaphorePermit, Semaphore, mpsc};
use tonic::{Request, Response, Status};
use tracing::{debug, instrument};

use crate::files::{Base, CHUNK};
use crate::paths::{self, Absolute, Target};

/// Bounds of the process service.
#[derive(Debug, Clone, Copy)]
#[non_exhaustive]
pub struct Limits {
    /// Most processes running at once (`Start` and `Execute` together). Default 256.
    pub max_processes: usize,
    /// How long output is still read after the main process exited, while something else
    /// (a background child) holds the pipes open. Default 10 s.
    pub drain_after_exit: Duration,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            max_processes: 256,
            drain_after_exit: Duration::from_secs(10),
        }
    }
}

impl Limits {
    /// Set [`Limits::max_processes`].
    pub fn with_max_processes(mut self, n: usize) -> Self {
        self.max_processes = n;
        self
    }

    /// Set [`Limits::drain_after_exit`].
    pub fn with_drain_after_exit(mut self, d: Duration) -> Self {
        self.drain_after_exit = d;
        self
    }
}

/// A running process started by `Start`, as the other calls find it.
#[derive(Debug)]
struct Running {
    pgid: Pid,
    stdin: tokio::sync::Mutex<Option<ChildStdin>>,
}

/// The service: base directory, process table, limits.
#[derive(Debug, Clone)]
pub struct Processes {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    base: Arc<Base>,
    table: Mutex<HashMap<i32, Arc<Running>>>,
    next_id: AtomicI32,
    slots: Arc<Semaphore>,
    limits: Limits,
}

impl Processes {
    /// A service running processes beneath `base`.
    pub fn new(base: Arc<Base>, limits: Limits) -> Processes {
        Processes {
            inner: Arc::new(Inner {
                base,
                table: Mutex::new(HashMap::new()),
                next_id: AtomicI32::new(1),
                slots: Arc::new(Semaphore::new(limits.max_processes)),
                limits,
            }),
        }
    }

    fn slot(&self) -> Result<OwnedSemaphorePermit, Status> {
        self.inner.slots.clone().try_acquire_owned().map_err(|_| {
            Status::resource_exhausted(format!(
                "too many processes (at most {} at once)",
                self.inner.limits.max_processes
            ))
        })
    }

    fn lookup(&self, id: i32) -> Result<Arc<Running>, Status> {
        self.inner
            .table
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(&id)
            .cloned()
            .ok_or_else(|| Status::not_found(format!("process {id} not found")))
    }

    /// Build and spawn `config` in its own process group.
    fn spawn(
        &self,
        config: Option<ProcessConfig>,
        stdin: Stdio,
    ) -> Result<(Child, GroupKill), Status> {
        let config = config.ok_or_else(|| Status::invalid_argument("config is required"))?;
        let (program, args) = config
            .command
            .split_first()
            .ok_or_else(|| Status::invalid_argument("command is required"))?;
        for key in config.env_vars.keys() {
            if key.is_empty() || key.contains('=') || key.contains('\0') {
                return Err(Status::invalid_argument(format!(
                    "invalid env key {key:?}: must be non-empty without '=' or NUL"
                )));
            }
        }
        // The working directory is opened beneath the base handle, and the child changes
        // into that very directory through /proc/self/fd: no path is resolved twice.
        let cwd: Dir = match config.cwd.as_deref().filter(|c| !c.is_empty()) {
            None => self.inner.base.dir.try_clone(),
            Some(raw) => match paths::resolve(raw, Absolute::Rebase)
                .map_err(|e| Status::permission_denied(format!("cwd: {e}")))?
            {
                Target::Root => self.inner.base.dir.try_clone(),
                Target::Rel(rel) => self.inner.base.dir.open_dir(&rel, Follow::Beneath),
            },
        }
        .map_err(|e| cwd_status(&e))?;
        let cwd_path = format!("/proc/self/fd/{}", cwd.as_fd().as_raw_fd());
        let mut command = Command::new(program);
        command
            .args(args)
            .envs(&config.env_vars)
            .current_dir(&cwd_path)
            .stdin(stdin)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .process_group(0);
        let child = command
            .spawn()
            .map_err(|e| Status::internal(format!("failed to start command: {e}")))?;
        drop(cwd);
        let pid = child
            .id()
            .and_then(|p| i32::try_from(p).ok())
            .ok_or_else(|| Status::internal("the started process has no pid"))?;
        Ok((child, GroupKill::new(Pid::from_raw(pid))))
    }
}

fn cwd_status(e: &std::io::Error) -> Status {
    if sandbox_core::beneath::refusal(e).is_some() {
        Status::permission_denied("cwd: path escapes the sandbox root")
    } else if e.kind() == std::io::ErrorKind::NotFound {
        Status::not_found(format!("cwd: {e}"))
    } else {
        Status::failed_precondition(format!("cwd: {e}"))
    }
}

/// SIGKILLs a process group when dropped, unless disarmed (the process exited on its own).
#[derive(Debug)]
pub(crate) struct GroupKill {
    pgid: Pid,
    armed: bool,
}

impl GroupKill {
    pub(crate) fn new(pgid: Pid) -> GroupKill {
        GroupKill { pgid, armed: true }
    }

    pub(crate) fn disarm(mut self) {
        self.armed = false;
    }
}

impl Drop for GroupKill {
    fn drop(&mut self) {
        if self.armed {
            debug!(pgid = self.pgid.as_raw(), "killing process group");
            let _ = killpg(self.pgid, NixSignal::SIGKILL);
        }
    }
}

/// Removes a process from the table when dropped.
struct Registered {
    inner: Arc<Inner>,
    id: i32,
}

impl Drop for Registered {
    fn drop(&mut self) {
        self.inner
            .table
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(&self.id);
    }
}

fn exit_code(status: ExitStatus) -> i32 {
    match (status.code(), status.signal()) {
        (Some(code), _) => code,
        (None, Some(sig)) => 128 + sig,
        (None, None) => -1,
    }
}

/// Send the chunks read from `pipe` to `tx` as `wrap`ped events until EOF or until the
/// receiver is gone.
async fn pump<R: AsyncRead + Unpin>(
    pipe: Option<R>,
    tx: mpsc::Sender<Result<StartResponse, Status>>,
    wrap: fn(Vec<u8>) -> Event,
) {
    let Some(mut pipe) = pipe else { return };
    let mut buf = vec![0u8; CHUNK];
    loop {
        match pipe.read(&mut buf).await {
            Ok(0) | Err(_) => return,
            Ok(n) => {
                if tx.send(event(wrap(buf[..n].to_vec()))).await.is_err() {
                    return;
                }
            }
        }
    }
}

/// Read all of `pipe` into `into`.
async fn collect<R: AsyncRead + Unpin>(pipe: Option<R>, into: &mut Vec<u8>) {
    if let Some(mut pipe) = pipe {
        let _ = pipe.read_to_end(into).await;
    }
}

/// Wait for `child` and for `output` (the pipe readers); once the child has exited, give the
/// readers at most `drain` more.
async fn wait_all(
    child: &mut Child,
    output: impl Future<Output = ()>,
    drain: Duration,
) -> std::io::Result<ExitStatus> {
    let mut output = std::pin::pin!(output);
    let mut output_done = false;
    let status = tokio::select! {
        status = child.wait() => status?,
        () = &mut output => {
            output_done = true;
            child.wait().await?
        }
    };
    if !output_done {
        let _ = tokio::time::timeout(drain, output).await;
    }
    Ok(status)
}

type StartStream = Pin<Box<dyn Stream<Item = Result<StartResponse, Status>> + Send>>;

fn event(e: Event) -> Result<StartResponse, Status> {
    Ok(StartResponse { event: Some(e) })
}

#[tonic::async_trait]
impl ProcessService for Processes {
    type StartStream = StartStream;

    #[instrument(skip_all, fields(argv0 = request.get_ref().config.as_ref().and_then(|c| c.command.first()).map(String::as_str)))]
    async fn start(&self, request: Request<StartRequest>) -> Result<Response<StartStream>, Status> {
        let request = request.into_inner();
        if request.pty.is_some() {
            return Err(Status::unimplemented(
                "PTY processes are not supported by this sandboxd",
            ));
        }
        let slot = self.slot()?;
        let (mut child, kill) = self.spawn(request.config, Stdio::piped())?;
        let id = self.inner.next_id.fetch_add(1, Ordering::Relaxed);
        let running = Arc::new(Running {
            pgid: kill.pgid,
            stdin: tokio::sync::Mutex::new(child.stdin.take()),
        });
        self.inner
            .table
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(id, running);
        let registered = Registered {
            inner: self.inner.clone(),
            id,
        };
        debug!(id, pgid = kill.pgid.as_raw(), "started");
        let (tx, rx) = mpsc::channel(32);
        // Capacity is free: the init event always goes first.
        let _ = tx.try_send(event(Event::Init(InitEvent { process_id: id })));
        let drain = self.inner.limits.drain_after_exit;
        tokio::spawn(async move {
            let _slot = slot;
            let stdout = child.stdout.take();
            let stderr = child.stderr.take();
            let output = async {
                tokio::join!(
                    pump(stdout, tx.clone(), Event::Stdout),
                    pump(stderr, tx.clone(), Event::Stderr),
                );
            };
            let finished = tokio::select! {
                // The client went away: `kill` (dropped armed) SIGKILLs the group, and
                // tokio reaps the child in the background.
                () = tx.closed() => None,
                status = wait_all(&mut child, output, drain) => Some(status),
            };
            match finished {
                Some(Ok(status)) => {
                    kill.disarm();
                    drop(registered);
                    let _ = tx
                        .send(event(Event::Exit(ExitEvent {
                            exit_code: exit_code(status),
                        })))
                        .await;
                }
                Some(Err(e)) => {
                    drop(registered);
                    let _ = tx
                        .send(Err(Status::internal(format!(
                            "waiting for the process: {e}"
                        ))))
                        .await;
                }
                None => debug!(id, "client gone; process group killed"),
            }
        });
        Ok(Response::new(Box::pin(
            tokio_stream::wrappers::ReceiverStream::new(rx),
        )))
    }

    #[instrument(skip_all, fields(argv0 = request.get_ref().config.as_ref().and_then(|c| c.command.first()).map(String::as_str)))]
    async fn execute(
        &self,
        request: Request<ExecuteRequest>,
    ) -> Result<Response<ExecuteResponse>, Status> {
        let _slot = self.slot()?;
        // If this future is dropped (client cancel, deadline), `kill` SIGKILLs the group.
        let (mut child, kill) = self.spawn(request.into_inner().config, Stdio::null())?;
        let stdout = child.stdout.take();
        let stderr = child.stderr.take();
        let mut out = Vec::new();
        let mut err = Vec::new();
        let output = async {
            tokio::join!(collect(stdout, &mut out), collect(stderr, &mut err));
        };
        let status = wait_all(&mut child, output, self.inner.limits.drain_after_exit)
            .await
            .map_err(|e| Status::internal(format!("waiting for the process: {e}")))?;
        kill.disarm();
        Ok(Response::new(ExecuteResponse {
            exit_code: exit_code(status),
            stdout: out,
            stderr: err,
        }))
    }

    #[instrument(skip_all, fields(id = request.get_ref().process_id))]
    async fn write_stdin(
        &self,
        request: Request<WriteStdinRequest>,
    ) -> Result<Response<WriteStdinResponse>, Status> {
        let request = request.into_inner();
        let running = self.lookup(request.process_id)?;
        let mut stdin = running.stdin.lock().await;
        match request.payload {
            None => {
                return Err(Status::invalid_argument(
                    "payload (input or eof) is required",
                ));
            }
            Some(Payload::Eof(())) => {
                if let Some(mut pipe) = stdin.take() {
                    let _ = pipe.shutdown().await;
                }
            }
            Some(Payload::Input(bytes)) => {
                let pipe = stdin.as_mut().ok_or_else(|| {
                    Status::failed_precondition(format!(
                        "stdin of process {} is closed",
                        request.process_id
                    ))
                })?;
                pipe.write_all(&bytes)
                    .await
                    .map_err(|e| Status::failed_precondition(format!("writing to stdin: {e}")))?;
                pipe.flush()
                    .await
                    .map_err(|e| Status::failed_precondition(format!("writing to stdin: {e}")))?;
            }
        }
        Ok(Response::new(WriteStdinResponse {}))
    }

    #[instrument(skip_all, fields(id = request.get_ref().process_id, signal = request.get_ref().signal))]
    async fn send_signal(
        &self,
        request: Request<SendSignalRequest>,
    ) -> Result<Response<SendSignalResponse>, Status> {
        let request = request.into_inner();
        let signal = match Signal::try_from(request.signal) {
            Ok(Signal::Sigint) => NixSignal::SIGINT,
            Ok(Signal::Sigterm) => NixSignal::SIGTERM,
            Ok(Signal::Sigkill) => NixSignal::SIGKILL,
            Ok(Signal::Unspecified) | Err(_) => {
                return Err(Status::invalid_argument(format!(
                    "unsupported or unspecified signal: {}",
                    request.signal
                )));
            }
        };
        let running = self.lookup(request.process_id)?;
        match killpg(running.pgid, signal) {
            Ok(()) => Ok(Response::new(SendSignalResponse {})),
            Err(nix::errno::Errno::ESRCH) => Err(Status::not_found(format!(
                "process {} has exited",
                request.process_id
            ))),
            Err(e) => Err(Status::internal(format!("failed to send signal: {e}"))),
        }
    }

    async fn resize_tty(
        &self,
        _request: Request<ResizeTtyRequest>,
    ) -> Result<Response<ResizeTtyResponse>, Status> {
        Err(Status::unimplemented(
            "PTY processes are not supported by this sandboxd",
        ))
    }
}
