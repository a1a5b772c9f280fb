//! Commands through sandboxd's gRPC `process.v1.ProcessService`: `Start` streams the init
//! event, stdout and stderr chunks and the exit event; stdin goes in with `WriteStdin` (then
//! its end); a timeout or a dropped call sends `SendSignal(SIGKILL)` and then kills the rest
//! of the command's tree by its marker variable (core's `posix::KILL_SCRIPT`), so daemons
//! that left the process group die too. A command is never sent twice: only the connection
//! is retried.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use bytes::Bytes;
use futures::StreamExt;
use sandbox_core::posix::{KILL_SCRIPT, MARKER_VAR};
use sandbox_core::stream::ByteStream;
use sandbox_core::{CappedBuffer, CapturedOutput, Error, ExecResult, OutputLimits, Result};
use sandboxd_proto::start_response::Event;
use sandboxd_proto::write_stdin_request::Payload;
use sandboxd_proto::{
    ProcessConfig, ProcessServiceClient, SendSignalRequest, Signal, StartRequest, WriteStdinRequest,
};
use tonic::metadata::{Ascii, MetadataKey, MetadataValue};
use tonic::service::Interceptor;
use tonic::service::interceptor::InterceptedService;
use tonic::transport::{Channel, Endpoint};

use crate::BACKEND;
use crate::control::backoff;

/// Largest stdin chunk per `WriteStdin` (gRPC's default message limit is 4 MiB).
const STDIN_CHUNK: usize = 1 << 20;

/// How long output is still read after a kill.
const DRAIN_AFTER_KILL: Duration = Duration::from_secs(3);

/// A connection to sandboxd's process service: the channel, and the headers every call
/// carries (the X-Sandbox-* routing headers and the router's token when it goes through the
/// sandbox router or a Gateway; none when it goes straight to the pod).
pub(crate) type Grpc = InterceptedService<Channel, CallHeaders>;

/// The headers added to every gRPC call (as metadata). `Debug` shows their names only: the
/// router's bearer token is a secret.
#[derive(Clone, Default)]
pub(crate) struct CallHeaders(Vec<(MetadataKey<Ascii>, MetadataValue<Ascii>)>);

impl std::fmt::Debug for CallHeaders {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_list()
            .entries(self.0.iter().map(|(k, _)| k.as_str()))
            .finish()
    }
}

impl CallHeaders {
    /// The metadata form of HTTP headers (names are lower-case ASCII already).
    pub(crate) fn from_http(headers: &reqwest::header::HeaderMap) -> Result<Self> {
        let mut out = Vec::with_capacity(headers.len());
        for (name, value) in headers {
            let key = MetadataKey::from_bytes(name.as_str().as_bytes())
                .map_err(|_| Error::invalid("router header", "not a gRPC metadata name"))?;
            let mut value = value
                .to_str()
                .ok()
                .and_then(|v| MetadataValue::try_from(v).ok())
                .ok_or_else(|| Error::invalid("router header", "not a gRPC metadata value"))?;
            if name == reqwest::header::AUTHORIZATION {
                value.set_sensitive(true);
            }
            out.push((key, value));
        }
        Ok(CallHeaders(out))
    }
}

impl Interceptor for CallHeaders {
    fn call(
        &mut self,
        mut request: tonic::Request<()>,
    ) -> std::result::Result<tonic::Request<()>, tonic::Status> {
        for (key, value) in &self.0 {
            request.metadata_mut().insert(key.clone(), value.clone());
        }
        Ok(request)
    }
}

/// Connect to sandboxd's gRPC port (`uri`: the pod, or the router that adds `headers`' routing
/// to it), retrying refused connects.
pub(crate) async fn connect(
    uri: &str,
    headers: CallHeaders,
    retries: u32,
    who: &str,
) -> Result<Grpc> {
    let endpoint = Endpoint::from_shared(uri.to_owned())
        .map_err(|e| Error::invalid("sandboxd address", format!("`{uri}`: {e}")))?
        .connect_timeout(Duration::from_secs(5))
        .tcp_nodelay(true)
        .http2_keep_alive_interval(Duration::from_secs(30));
    let mut attempt = 0;
    loop {
        match endpoint.connect().await {
            Ok(c) => return Ok(InterceptedService::new(c, headers)),
            Err(e) if attempt + 1 < retries => {
                tracing::debug!(%uri, error = %e, attempt, "sandboxd connect failed; retrying");
                tokio::time::sleep(backoff(attempt)).await;
                attempt += 1;
            }
            Err(e) => {
                return Err(Error::Unavailable {
                    service: format!("sandboxd of {who} at {uri}"),
                    reason: e.to_string(),
                    source: Some(Box::new(e)),
                });
            }
        }
    }
}

fn status_err(who: &str, operation: &'static str, s: tonic::Status) -> Error {
    use tonic::Code;
    match s.code() {
        Code::Unavailable | Code::Cancelled | Code::DeadlineExceeded | Code::Unknown => {
            Error::Unavailable {
                service: format!("sandboxd of {who}"),
                reason: format!("{operation}: {}", s.message()),
                source: Some(Box::new(s)),
            }
        }
        Code::InvalidArgument | Code::NotFound | Code::FailedPrecondition => Error::InvalidInput {
            what: "command",
            reason: format!("{operation}: {}", s.message()),
        },
        _ => Error::Backend {
            backend: BACKEND,
            operation,
            message: s.message().to_owned(),
            source: Some(Box::new(s)),
        },
    }
}

/// One command.
pub(crate) struct Command {
    pub argv: Vec<String>,
    pub env: HashMap<String, String>,
    pub cwd: Option<String>,
}

/// Kills a started command's tree when dropped while armed (a cancelled call, a timeout).
struct Reaper {
    channel: Grpc,
    pid: i32,
    marker: String,
    armed: bool,
}

impl Reaper {
    /// Kill now (and disarm).
    async fn kill(&mut self) {
        self.armed = false;
        kill_tree(self.channel.clone(), self.pid, self.marker.clone()).await;
    }
}

impl Drop for Reaper {
    fn drop(&mut self) {
        if !self.armed {
            return;
        }
        if let Ok(rt) = tokio::runtime::Handle::try_current() {
            let (channel, pid, marker) = (self.channel.clone(), self.pid, self.marker.clone());
            rt.spawn(kill_tree(channel, pid, marker));
        }
    }
}

/// `SendSignal(SIGKILL)` to the process, then every process carrying its marker.
async fn kill_tree(channel: Grpc, pid: i32, marker: String) {
    let mut client = ProcessServiceClient::new(channel.clone());
    if let Err(e) = client
        .send_signal(SendSignalRequest {
            process_id: pid,
            signal: Signal::Sigkill as i32,
        })
        .await
    {
        tracing::debug!(pid, error = %e, "SendSignal(SIGKILL) failed");
    }
    reap(channel, &marker).await;
}

/// Kill whatever still carries `marker` (a finished command's leftovers, a killed tree).
async fn reap(channel: Grpc, marker: &str) {
    let mut client = ProcessServiceClient::new(channel);
    let config = ProcessConfig::new(["sh", "-c", KILL_SCRIPT, "reap", marker]);
    let run = async {
        let mut s = client
            .start(StartRequest {
                config: Some(config),
                pty: None,
            })
            .await?
            .into_inner();
        while s.message().await?.is_some() {}
        Ok::<_, tonic::Status>(())
    };
    if let Err(e) = tokio::time::timeout(Duration::from_secs(30), run).await {
        tracing::debug!(error = %e, "reaping a command's tree timed out");
    }
}

/// A started command: its event stream, its reaper and its stdin feeder.
struct Started {
    events: tonic::Streaming<sandboxd_proto::StartResponse>,
    reaper: Reaper,
    stdin: tokio::task::JoinHandle<Result<()>>,
}

async fn start(
    channel: &Grpc,
    who: &str,
    command: Command,
    stdin: Option<ByteStream>,
) -> Result<Started> {
    let marker = uuid::Uuid::new_v4().simple().to_string();
    let mut env = command.env;
    env.insert(MARKER_VAR.to_owned(), marker.clone());
    let config = ProcessConfig {
        command: command.argv,
        env_vars: env,
        cwd: command.cwd,
    };
    let mut client = ProcessServiceClient::new(channel.clone());
    let mut events = client
        .start(StartRequest {
            config: Some(config),
            pty: None,
        })
        .await
        .map_err(|s| status_err(who, "start", s))?
        .into_inner();
    let pid = match events
        .message()
        .await
        .map_err(|s| status_err(who, "start", s))?
    {
        Some(sandboxd_proto::StartResponse {
            event: Some(Event::Init(init)),
        }) => init.process_id,
        other => {
            return Err(Error::backend(
                BACKEND,
                "start",
                format!("sandboxd's first event was not `init`: {other:?}"),
            ));
        }
    };
    let reaper = Reaper {
        channel: channel.clone(),
        pid,
        marker,
        armed: true,
    };
    let stdin = tokio::spawn(feed_stdin(client, pid, stdin));
    Ok(Started {
        events,
        reaper,
        stdin,
    })
}

/// Write `input` to the process's stdin in chunks, then close it.
async fn feed_stdin(
    mut client: ProcessServiceClient<Grpc>,
    pid: i32,
    input: Option<ByteStream>,
) -> Result<()> {
    let send = |payload| WriteStdinRequest {
        process_id: pid,
        payload: Some(payload),
    };
    if let Some(mut input) = input {
        while let Some(chunk) = input.next().await {
            let chunk = chunk?;
            for piece in chunk.chunks(STDIN_CHUNK) {
                if let Err(s) = client
                    .write_stdin(send(Payload::Input(piece.to_vec())))
                    .await
                {
                    // The process ended early (it did not want more): not our failure.
                    tracing::debug!(pid, error = %s, "stdin write refused");
                    return Ok(());
                }
            }
        }
    }
    if let Err(s) = client.write_stdin(send(Payload::Eof(()))).await {
        tracing::debug!(pid, error = %s, "stdin close refused");
    }
    Ok(())
}

/// Run a command to its end (or its timeout), capturing its output within `limits`.
pub(crate) async fn run(
    channel: &Grpc,
    who: &str,
    command: Command,
    stdin: Option<Bytes>,
    limits: OutputLimits,
    timeout: Duration,
) -> Result<ExecResult> {
    let began = Instant::now();
    let stdin = stdin.map(sandbox_core::stream::once);
    let mut started = start(channel, who, command, stdin).await?;
    let mut out = CappedBuffer::new(limits.stdout);
    let mut err = CappedBuffer::new(limits.stderr);
    let deadline = tokio::time::Instant::from_std(began + timeout);
    let mut exit = None;
    let mut timed_out = false;
    let mut drain_until = None;
    loop {
        let until = drain_until.unwrap_or(deadline);
        tokio::select! {
            msg = started.events.message() => match msg {
                Ok(Some(m)) => match m.event {
                    Some(Event::Stdout(b)) => out.push(&b),
                    Some(Event::Stderr(b)) => err.push(&b),
                    Some(Event::Exit(e)) => {
                        exit = Some(e.exit_code);
                        break;
                    }
                    Some(Event::Init(_)) | None => {}
                },
                Ok(None) => break,
                Err(s) if timed_out => {
                    tracing::debug!(error = %s, "stream ended after the kill");
                    break;
                }
                Err(s) => return Err(status_err(who, "exec", s)),
            },
            _ = tokio::time::sleep_until(until) => {
                if timed_out {
                    break;
                }
                timed_out = true;
                started.reaper.kill().await;
                drain_until = Some(tokio::time::Instant::now() + DRAIN_AFTER_KILL);
            }
        }
    }
    if !timed_out && exit.is_none() {
        return Err(Error::Unavailable {
            service: format!("sandboxd of {who}"),
            reason: "the command's event stream ended without an exit event".into(),
            source: None,
        });
    }
    if !timed_out {
        // Whatever the command left running (a daemonized grandchild) goes too.
        started.reaper.armed = false;
        let (channel, marker) = (channel.clone(), started.reaper.marker.clone());
        tokio::spawn(async move { reap(channel, &marker).await });
    }
    started.stdin.abort();
    let output = CapturedOutput {
        stdout: out.finish(),
        stderr: err.finish(),
    };
    Ok(ExecResult::new(
        if timed_out { None } else { exit },
        output,
        timed_out,
        began.elapsed(),
    ))
}

/// Run a command whose stdout is the returned stream (and whose stdin is `stdin`). The
/// stream ends with an error unless the command exited 0; its stderr is in that error.
/// `exit_errors` maps exit codes to typed errors first.
pub(crate) async fn run_streaming(
    channel: &Grpc,
    who: &str,
    command: Command,
    stdin: Option<ByteStream>,
    exit_errors: fn(i32, &str) -> Option<Error>,
) -> Result<ByteStream> {
    let started = start(channel, who, command, stdin).await?;
    let (tx, mut rx) = tokio::sync::mpsc::channel::<Result<Bytes>>(8);
    let stream: ByteStream = futures::stream::poll_fn(move |cx| rx.poll_recv(cx)).boxed();
    let who = who.to_owned();
    tokio::spawn(async move {
        let Started {
            mut events,
            mut reaper,
            mut stdin,
        } = started;
        let mut stdin_done = false;
        let mut err = CappedBuffer::new(64 << 10);
        let outcome: Result<()> = async {
            loop {
                let msg = tokio::select! {
                    m = events.message() => m,
                    // A failed input (a bad archive) fails the command at once: the process
                    // would wait for more stdin forever.
                    fed = &mut stdin, if !stdin_done => {
                        stdin_done = true;
                        if let Ok(Err(e)) = fed {
                            return Err(e);
                        }
                        continue;
                    }
                };
                match msg.map_err(|s| status_err(&who, "exec", s))? {
                    Some(m) => match m.event {
                        Some(Event::Stdout(b)) => {
                            if tx.send(Ok(Bytes::from(b))).await.is_err() {
                                return Err(Error::backend(BACKEND, "exec", "reader went away"));
                            }
                        }
                        Some(Event::Stderr(b)) => err.push(&b),
                        Some(Event::Exit(e)) => {
                            reaper.armed = false;
                            let stderr = err.finish();
                            let stderr = String::from_utf8_lossy(&stderr.bytes);
                            // A failed stdin (a bad archive) is the real cause.
                            if !stdin_done && let Ok(Err(e)) = (&mut stdin).await {
                                return Err(e);
                            }
                            if e.exit_code == 0 {
                                return Ok(());
                            }
                            return Err(exit_errors(e.exit_code, &stderr).unwrap_or_else(|| {
                                Error::backend(
                                    BACKEND,
                                    "exec",
                                    format!(
                                        "helper exited with {}: {}",
                                        e.exit_code,
                                        stderr.trim()
                                    ),
                                )
                            }));
                        }
                        Some(Event::Init(_)) | None => {}
                    },
                    None => {
                        return Err(Error::Unavailable {
                            service: format!("sandboxd of {who}"),
                            reason: "the event stream ended without an exit event".into(),
                            source: None,
                        });
                    }
                }
            }
        }
        .await;
        if let Err(e) = outcome {
            if reaper.armed {
                reaper.kill().await;
            }
            let _ = tx.send(Err(e)).await;
        }
    });
    Ok(stream)
}
