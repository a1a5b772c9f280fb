//! envd, the daemon in every sandbox (port 49983): commands through the Connect protocol's
//! `process.Process` service over HTTP/1.1 with the binary codec (`application/connect+proto`
//! streams: envelopes `[flags u8][len u32 BE][payload]`, the last one flagged end-stream and
//! holding JSON `{}` or `{"error":{..}}`), files through `GET`/`POST /files`.
//!
//! A command is never sent twice: only a call refused before it ran (401, a connect error) is
//! made again. A timeout or a dropped call sends `SendSignal(SIGKILL)` to the command's pid and
//! then kills the rest of its tree by its marker variable (core's `posix::KILL_SCRIPT`), as
//! sandbox-k8s does with sandboxd.

use std::collections::HashMap;
use std::fmt;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use futures::StreamExt;
use prost::Message;
use sandbox_cloud::{Idempotency, Secret};
use sandbox_core::posix::{KILL_SCRIPT, MARKER_VAR};
use sandbox_core::stream::ByteStream;
use sandbox_core::{CappedBuffer, CapturedOutput, Error, ExecResult, OutputLimits, Result};

use crate::BACKEND;
use e2b_envd_proto::ENVD_PORT;
use e2b_envd_proto::envelope::{self, Decoder};
use e2b_envd_proto::process::process_event::{EndEvent, Event, Output};
use e2b_envd_proto::process::{
    CloseStdinRequest, ProcessConfig, ProcessInput, ProcessSelector, SendInputRequest,
    SendSignalRequest, Signal, StartRequest, StartResponse, process_input,
};

/// Largest stdin chunk per `SendInput`.
const STDIN_CHUNK: usize = 256 << 10;

/// Largest envelope accepted from envd.
const MAX_ENVELOPE: usize = 64 << 20;

/// How long output is still read after a kill.
const DRAIN_AFTER_KILL: Duration = Duration::from_secs(3);

/// Timeout of envd's unary calls and file reads' start.
const UNARY_TIMEOUT: Duration = Duration::from_secs(30);

/// One sandbox's envd: where it is and its access token. `Debug` hides the token.
pub(crate) struct Envd {
    client: reqwest::Client,
    /// Without user info (sent as basic auth: [`sandbox_cloud::BaseUrl`]).
    base: sandbox_cloud::BaseUrl,
    sandbox_id: String,
    token: Option<Secret>,
}

impl fmt::Debug for Envd {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Envd")
            .field("base", &self.base)
            .field("sandbox_id", &self.sandbox_id)
            .field("token", &self.token.as_ref().map(|_| "***"))
            .finish()
    }
}

/// The HTTP client of envd calls: no overall timeout (a command's stream lasts as long as the
/// command), a connect timeout, HTTP/1.1.
pub(crate) fn http_client() -> Result<reqwest::Client> {
    reqwest::Client::builder()
        .connect_timeout(Duration::from_secs(10))
        .http1_only()
        .tcp_nodelay(true)
        .build()
        .map_err(|e| Error::backend(BACKEND, "http client", e.to_string()))
}

impl Envd {
    /// envd of `sandbox_id`: at `sandbox_url` when set (one base for every sandbox, named by
    /// headers), else `https://49983-<id>.<domain>`.
    pub(crate) fn new(
        client: reqwest::Client,
        sandbox_url: Option<&str>,
        domain: &str,
        sandbox_id: &str,
        token: Option<Secret>,
    ) -> Self {
        let base = sandbox_cloud::BaseUrl::new(&match sandbox_url {
            Some(u) => u.to_owned(),
            None => format!("https://{ENVD_PORT}-{sandbox_id}.{domain}"),
        });
        Envd {
            client,
            base,
            sandbox_id: sandbox_id.to_owned(),
            token,
        }
    }

    #[cfg(test)]
    pub(crate) fn base(&self) -> &str {
        self.base.as_str()
    }

    fn who(&self) -> String {
        format!("envd of e2b sandbox {}", self.sandbox_id)
    }

    fn request(&self, method: reqwest::Method, path: &str) -> reqwest::RequestBuilder {
        let mut r = self
            .base
            .apply(self.client.request(method, self.base.join(path)))
            .header("E2b-Sandbox-Id", &self.sandbox_id)
            .header("E2b-Sandbox-Port", ENVD_PORT.to_string());
        if let Some(t) = &self.token {
            r = r.header("X-Access-Token", t.expose());
        }
        r
    }

    fn unreachable(&self, operation: &str, e: reqwest::Error) -> Error {
        if e.is_timeout() {
            return Error::Timeout {
                operation: format!("{operation} on {}", self.who()),
                after: UNARY_TIMEOUT,
            };
        }
        Error::Unavailable {
            service: self.who(),
            reason: format!("{operation}: {e}"),
            source: Some(Box::new(e)),
        }
    }

    /// A non-2xx answer as a typed error (401 → `Unauthorized`, 404 → `NotFound`, 5xx →
    /// `Unavailable`, as sandbox-cloud maps statuses).
    async fn check(
        &self,
        operation: &'static str,
        r: reqwest::Response,
        idempotency: Idempotency,
    ) -> Result<reqwest::Response> {
        if r.status().is_success() {
            return Ok(r);
        }
        let status = r.status();
        let retry_after = sandbox_cloud::retry_after(r.headers());
        let body = r.bytes().await.unwrap_or_default();
        Err(sandbox_cloud::status_error(
            BACKEND,
            &self.who(),
            operation,
            status,
            retry_after,
            &body,
            idempotency,
        ))
    }

    /// Whether envd answers `GET /health`.
    pub(crate) async fn healthy(&self) -> bool {
        match self
            .request(reqwest::Method::GET, "/health")
            .timeout(Duration::from_secs(5))
            .send()
            .await
        {
            Ok(r) => r.status().is_success(),
            Err(_) => false,
        }
    }

    /// A unary `process.Process` call with the binary codec.
    async fn unary(&self, method: &'static str, body: Vec<u8>) -> Result<()> {
        let r = self
            .request(reqwest::Method::POST, &format!("/process.Process/{method}"))
            .header(reqwest::header::CONTENT_TYPE, "application/proto")
            .header("Connect-Protocol-Version", "1")
            .timeout(UNARY_TIMEOUT)
            .body(body)
            .send()
            .await
            .map_err(|e| self.unreachable(method, e))?;
        self.check(method_op(method), r, Idempotency::NotIdempotent)
            .await
            .map(|_| ())
    }

    /// `process.Process/Start`: the answer's event stream (the request is refused with a
    /// typed error before anything ran on a non-200 status).
    async fn start_stream(&self, request: &StartRequest) -> Result<Events> {
        let body = envelope::encode(envelope::MESSAGE, &request.encode_to_vec());
        let r = self
            .request(reqwest::Method::POST, "/process.Process/Start")
            .header(reqwest::header::CONTENT_TYPE, "application/connect+proto")
            .header("Connect-Protocol-Version", "1")
            .header("Keepalive-Ping-Interval", "50")
            .body(body)
            .send()
            .await
            .map_err(|e| self.unreachable("start a command", e))?;
        let r = self.check("exec", r, Idempotency::NotIdempotent).await?;
        Ok(Events {
            body: r.bytes_stream().boxed(),
            decoder: Decoder::new(),
            who: self.who(),
            done: false,
        })
    }

    /// `GET /files?path=`: a file's bytes.
    pub(crate) async fn read_file(&self, path: &str) -> Result<Bytes> {
        let mut url = reqwest::Url::parse(&format!("{}/files", self.base))
            .map_err(|e| Error::invalid("envd url", e.to_string()))?;
        url.query_pairs_mut().append_pair("path", path);
        let r = self
            .request(
                reqwest::Method::GET,
                &format!("/files?{}", url.query().unwrap_or("")),
            )
            .send()
            .await
            .map_err(|e| self.unreachable("read a file", e))?;
        let r = match self.check("read file", r, Idempotency::Idempotent).await {
            Err(Error::NotFound { .. }) => {
                return Err(Error::NotFound {
                    what: "file",
                    key: path.to_owned(),
                });
            }
            other => other?,
        };
        r.bytes()
            .await
            .map_err(|e| self.unreachable("read a file", e))
    }

    /// `POST /files?path=` with an octet-stream body (envd ≥ 0.5.7): writes `path`, making
    /// its parents.
    pub(crate) async fn upload(&self, path: &str, body: reqwest::Body) -> Result<()> {
        let mut url = reqwest::Url::parse(&format!("{}/files", self.base))
            .map_err(|e| Error::invalid("envd url", e.to_string()))?;
        url.query_pairs_mut().append_pair("path", path);
        let r = self
            .request(
                reqwest::Method::POST,
                &format!("/files?{}", url.query().unwrap_or("")),
            )
            .header(reqwest::header::CONTENT_TYPE, "application/octet-stream")
            .body(body)
            .send()
            .await
            .map_err(|e| self.unreachable("upload a file", e))?;
        self.check("write file", r, Idempotency::NotIdempotent)
            .await
            .map(|_| ())
    }
}

/// A box's way to its envd: the current [`Envd`] and how to get a fresh token. A call that
/// envd refuses with 401 (the token changed: a resumed sandbox, a rotated token) is made once
/// more with the token read again from the API; it never ran, so that is safe.
pub(crate) struct Conn {
    api: crate::api::Api,
    client: reqwest::Client,
    sandbox_url: Option<String>,
    domain: String,
    sandbox_id: String,
    current: std::sync::Mutex<Arc<Envd>>,
}

impl fmt::Debug for Conn {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Conn")
            .field("envd", &*self.current.lock().expect("envd lock"))
            .finish_non_exhaustive()
    }
}

impl Conn {
    pub(crate) fn new(
        api: crate::api::Api,
        client: reqwest::Client,
        sandbox_url: Option<String>,
        domain: String,
        sandbox_id: String,
        token: Option<Secret>,
    ) -> Self {
        let envd = Envd::new(
            client.clone(),
            sandbox_url.as_deref(),
            &domain,
            &sandbox_id,
            token,
        );
        Conn {
            api,
            client,
            sandbox_url,
            domain,
            sandbox_id,
            current: std::sync::Mutex::new(Arc::new(envd)),
        }
    }

    pub(crate) fn envd(&self) -> Arc<Envd> {
        self.current.lock().expect("envd lock").clone()
    }

    pub(crate) fn who(&self) -> String {
        self.envd().who()
    }

    /// Read the sandbox's envd token again.
    pub(crate) async fn refresh(&self) -> Result<Arc<Envd>> {
        tracing::info!(sandbox = %self.sandbox_id, "envd refused the token: reading it again");
        let Some(s) = self.api.get(&self.sandbox_id).await? else {
            return Err(Error::Unavailable {
                service: self.who(),
                reason: "the sandbox is gone".into(),
                source: None,
            });
        };
        let envd = Arc::new(Envd::new(
            self.client.clone(),
            self.sandbox_url.as_deref(),
            s.domain.as_deref().unwrap_or(&self.domain),
            &self.sandbox_id,
            s.token,
        ));
        *self.current.lock().expect("envd lock") = envd.clone();
        Ok(envd)
    }

    /// Whether envd answers: `GET /health`, then a command (`true`) run to its end (a health
    /// answer alone may come from a proxy in front of a VM that is gone).
    pub(crate) async fn healthy(&self) -> bool {
        if !self.envd().healthy().await {
            return false;
        }
        let request = StartRequest {
            process: Some(ProcessConfig {
                cmd: "true".into(),
                args: Vec::new(),
                envs: HashMap::new(),
                cwd: None,
            }),
            pty: None,
            tag: None,
            stdin: Some(false),
        };
        let run = async {
            let mut events = self.start_stream(&request).await?;
            let mut ended = false;
            while let Some(e) = events.next().await? {
                ended |= matches!(e, Event::End(_));
            }
            Ok::<_, Error>(ended)
        };
        match tokio::time::timeout(UNARY_TIMEOUT, run).await {
            Ok(Ok(true)) => true,
            Ok(Ok(false)) => false,
            Ok(Err(e)) => {
                tracing::debug!(sandbox = %self.sandbox_id, error = %e, "envd cannot run commands");
                false
            }
            Err(_) => false,
        }
    }

    async fn start_stream(&self, request: &StartRequest) -> Result<Events> {
        match self.envd().start_stream(request).await {
            Err(Error::Unauthorized { .. }) => self.refresh().await?.start_stream(request).await,
            r => r,
        }
    }

    async fn unary(&self, method: &'static str, body: Vec<u8>) -> Result<()> {
        match self.envd().unary(method, body.clone()).await {
            Err(Error::Unauthorized { .. }) => self.refresh().await?.unary(method, body).await,
            r => r,
        }
    }

    pub(crate) async fn send_signal(&self, pid: u32, signal: Signal) -> Result<()> {
        let m = SendSignalRequest {
            process: Some(ProcessSelector::pid(pid)),
            signal: signal as i32,
        };
        self.unary("SendSignal", m.encode_to_vec()).await
    }

    async fn send_input(&self, pid: u32, data: &[u8]) -> Result<()> {
        let m = SendInputRequest {
            process: Some(ProcessSelector::pid(pid)),
            input: Some(ProcessInput {
                input: Some(process_input::Input::Stdin(data.to_vec())),
            }),
        };
        self.unary("SendInput", m.encode_to_vec()).await
    }

    async fn close_stdin(&self, pid: u32) -> Result<()> {
        let m = CloseStdinRequest {
            process: Some(ProcessSelector::pid(pid)),
        };
        self.unary("CloseStdin", m.encode_to_vec()).await
    }

    pub(crate) async fn read_file(&self, path: &str) -> Result<Bytes> {
        match self.envd().read_file(path).await {
            Err(Error::Unauthorized { .. }) => self.refresh().await?.read_file(path).await,
            r => r,
        }
    }

    /// Upload a stream to `path`. The stream is consumed by the first attempt, so the token
    /// is checked first by a cheap authenticated call.
    pub(crate) async fn upload_stream(&self, path: &str, data: ByteStream) -> Result<()> {
        let envd = match self.envd().unary("List", Vec::new()).await {
            Err(Error::Unauthorized { .. }) => self.refresh().await?,
            _ => self.envd(),
        };
        envd.upload(path, reqwest::Body::wrap_stream(data)).await
    }

    pub(crate) fn api(&self) -> &crate::api::Api {
        &self.api
    }

    pub(crate) fn sandbox_id(&self) -> &str {
        &self.sandbox_id
    }
}

fn method_op(method: &'static str) -> &'static str {
    match method {
        "SendSignal" => "signal a command",
        "SendInput" => "write a command's stdin",
        "CloseStdin" => "close a command's stdin",
        "List" => "list commands",
        _ => "envd call",
    }
}

/// The events of one `Start` stream.
struct Events {
    body: futures::stream::BoxStream<'static, reqwest::Result<Bytes>>,
    decoder: Decoder,
    who: String,
    done: bool,
}

/// An end-stream envelope's JSON.
#[derive(serde::Deserialize, Default)]
struct EndStream {
    #[serde(default)]
    error: Option<ConnectError>,
}

#[derive(serde::Deserialize)]
struct ConnectError {
    #[serde(default)]
    code: String,
    #[serde(default)]
    message: String,
}

impl Events {
    /// The next event; `None` after a clean end-stream. Cancel-safe: bytes read are kept in
    /// `buf` before the next await.
    async fn next(&mut self) -> Result<Option<Event>> {
        loop {
            if self.done {
                return Ok(None);
            }
            if let Some((flags, payload)) = self.decoder.next_envelope() {
                if flags & envelope::COMPRESSED != 0 {
                    return Err(Error::backend(
                        BACKEND,
                        "exec",
                        "envd sent a compressed message that was not asked for",
                    ));
                }
                if flags & envelope::END_STREAM != 0 {
                    self.done = true;
                    let end: EndStream = if payload.is_empty() {
                        EndStream::default()
                    } else {
                        serde_json::from_slice(&payload).map_err(|e| {
                            Error::backend(BACKEND, "exec", format!("bad end-stream JSON: {e}"))
                        })?
                    };
                    return match end.error {
                        None => Ok(None),
                        Some(e) => Err(connect_error(&self.who, e)),
                    };
                }
                let m = StartResponse::decode(payload).map_err(|e| {
                    Error::backend(BACKEND, "exec", format!("bad StartResponse: {e}"))
                })?;
                match m.event.and_then(|e| e.event) {
                    Some(Event::Keepalive(_)) | None => continue,
                    Some(e) => return Ok(Some(e)),
                }
            }
            if self.decoder.pending() > MAX_ENVELOPE + 5 {
                return Err(self.cut("an envelope larger than 64 MiB".into()));
            }
            match self.body.next().await {
                Some(Ok(chunk)) => self.decoder.push(&chunk),
                Some(Err(e)) => return Err(self.cut(e.to_string())),
                None => return Err(self.cut("the connection closed".into())),
            }
        }
    }

    fn cut(&self, reason: String) -> Error {
        Error::Unavailable {
            service: self.who.clone(),
            reason: format!("the command's event stream was cut before its end ({reason})"),
            source: None,
        }
    }
}

fn connect_error(who: &str, e: ConnectError) -> Error {
    let reason = format!("{}: {}", e.code, e.message);
    match e.code.as_str() {
        "unauthenticated" | "permission_denied" => Error::Unauthorized {
            service: who.to_owned(),
            reason,
        },
        "invalid_argument" | "not_found" | "failed_precondition" | "out_of_range" => {
            Error::InvalidInput {
                what: "command",
                reason,
            }
        }
        "resource_exhausted" => Error::RateLimited {
            service: who.to_owned(),
            retry_after: None,
        },
        "unimplemented" => Error::Backend {
            backend: BACKEND,
            operation: "exec",
            message: reason,
            source: None,
        },
        _ => Error::Unavailable {
            service: who.to_owned(),
            reason,
            source: None,
        },
    }
}

/// A command's exit code as a shell reports it: envd says `-1` and `signal: <name>` (Go's
/// `ProcessState`) for a process a signal ended, which is `128 + n` here, as in the other
/// backends.
fn exit_code(end: &EndEvent) -> i32 {
    if end.exited || end.exit_code != -1 {
        return end.exit_code;
    }
    let Some(name) = end.status.strip_prefix("signal: ") else {
        return end.exit_code;
    };
    let n = match name.trim() {
        "hangup" => 1,
        "interrupt" => 2,
        "quit" => 3,
        "illegal instruction" => 4,
        "trace/breakpoint trap" => 5,
        "aborted" => 6,
        "bus error" => 7,
        "floating point exception" => 8,
        "killed" => 9,
        "user defined signal 1" => 10,
        "segmentation fault" => 11,
        "user defined signal 2" => 12,
        "broken pipe" => 13,
        "alarm clock" => 14,
        "terminated" => 15,
        _ => return end.exit_code,
    };
    128 + n
}

/// One command.
pub(crate) struct Command {
    pub argv: Vec<String>,
    pub env: HashMap<String, String>,
}

/// Kills a started command's tree when dropped while armed (a cancelled call, a timeout).
struct Reaper {
    envd: Arc<Conn>,
    pid: u32,
    marker: String,
    armed: bool,
}

impl Reaper {
    async fn kill(&mut self) {
        self.armed = false;
        kill_tree(self.envd.clone(), self.pid, self.marker.clone()).await;
    }
}

impl Drop for Reaper {
    fn drop(&mut self) {
        if !self.armed {
            return;
        }
        if let Ok(rt) = tokio::runtime::Handle::try_current() {
            rt.spawn(kill_tree(self.envd.clone(), self.pid, self.marker.clone()));
        }
    }
}

async fn kill_tree(envd: Arc<Conn>, pid: u32, marker: String) {
    if let Err(e) = envd.send_signal(pid, Signal::Sigkill).await {
        tracing::debug!(pid, error = %e, "SendSignal(SIGKILL) failed");
    }
    reap(&envd, &marker).await;
}

/// Kill whatever still carries `marker`.
async fn reap(envd: &Conn, marker: &str) {
    let request = StartRequest {
        process: Some(ProcessConfig {
            cmd: "sh".into(),
            args: vec![
                "-c".into(),
                KILL_SCRIPT.into(),
                "reap".into(),
                marker.into(),
            ],
            envs: HashMap::new(),
            cwd: None,
        }),
        pty: None,
        tag: None,
        stdin: Some(false),
    };
    let run = async {
        let mut events = envd.start_stream(&request).await?;
        while events.next().await?.is_some() {}
        Ok::<_, Error>(())
    };
    match tokio::time::timeout(Duration::from_secs(30), run).await {
        Ok(Ok(())) => {}
        Ok(Err(e)) => tracing::debug!(error = %e, "reaping a command's tree failed"),
        Err(_) => tracing::debug!("reaping a command's tree timed out"),
    }
}

/// Extends the sandbox's life while a command runs; stops when dropped.
pub(crate) struct KeepAlive(Option<tokio::task::JoinHandle<()>>);

impl KeepAlive {
    pub(crate) fn new(
        api: crate::api::Api,
        sandbox: String,
        every: Duration,
        timeout: Duration,
    ) -> Self {
        KeepAlive(Some(tokio::spawn(async move {
            loop {
                tokio::time::sleep(every).await;
                match api.set_timeout(&sandbox, timeout).await {
                    Ok(()) => {
                        tracing::debug!(%sandbox, "sandbox timeout extended for a long command")
                    }
                    Err(e) => {
                        tracing::warn!(%sandbox, error = %e, "extending the sandbox timeout failed")
                    }
                }
            }
        })))
    }
}

impl Drop for KeepAlive {
    fn drop(&mut self) {
        if let Some(h) = self.0.take() {
            h.abort();
        }
    }
}

/// A started command.
struct Started {
    events: Events,
    reaper: Reaper,
    stdin: tokio::task::JoinHandle<Result<()>>,
}

async fn start(envd: &Arc<Conn>, command: Command, stdin: Option<ByteStream>) -> Result<Started> {
    let marker = uuid::Uuid::new_v4().simple().to_string();
    let mut env = command.env;
    env.insert(MARKER_VAR.to_owned(), marker.clone());
    let mut argv = command.argv.into_iter();
    let cmd = argv
        .next()
        .ok_or_else(|| Error::invalid("command", "empty argv"))?;
    let request = StartRequest {
        process: Some(ProcessConfig {
            cmd,
            args: argv.collect(),
            envs: env,
            cwd: None,
        }),
        pty: None,
        tag: None,
        stdin: Some(stdin.is_some()),
    };
    let mut events = envd.start_stream(&request).await?;
    let pid = match events.next().await? {
        Some(Event::Start(s)) => s.pid,
        other => {
            return Err(Error::backend(
                BACKEND,
                "exec",
                format!(
                    "envd's first event was not `start`: {}",
                    match other {
                        None => "the stream ended",
                        Some(Event::Data(_)) => "data",
                        Some(Event::End(_)) => "end",
                        Some(_) => "another event",
                    }
                ),
            ));
        }
    };
    let reaper = Reaper {
        envd: envd.clone(),
        pid,
        marker,
        armed: true,
    };
    let stdin = tokio::spawn(feed_stdin(envd.clone(), pid, stdin));
    Ok(Started {
        events,
        reaper,
        stdin,
    })
}

/// Write `input` to the process's stdin in chunks, then close it.
async fn feed_stdin(envd: Arc<Conn>, pid: u32, input: Option<ByteStream>) -> Result<()> {
    let Some(mut input) = input else {
        return Ok(());
    };
    while let Some(chunk) = input.next().await {
        let chunk = chunk?;
        for piece in chunk.chunks(STDIN_CHUNK) {
            if let Err(e) = envd.send_input(pid, piece).await {
                // The process ended early (it did not want more): not our failure.
                tracing::debug!(pid, error = %e, "stdin write refused");
                return Ok(());
            }
        }
    }
    if let Err(e) = envd.close_stdin(pid).await {
        tracing::debug!(pid, error = %e, "stdin close refused");
    }
    Ok(())
}

/// Run a command to its end (or its timeout), capturing its output within `limits`.
pub(crate) async fn run(
    envd: &Arc<Conn>,
    command: Command,
    stdin: Option<Bytes>,
    limits: OutputLimits,
    timeout: Duration,
) -> Result<ExecResult> {
    let began = Instant::now();
    let stdin = stdin.map(sandbox_core::stream::once);
    let mut started = start(envd, command, stdin).await?;
    let mut out = CappedBuffer::new(limits.stdout);
    let mut err = CappedBuffer::new(limits.stderr);
    let deadline = tokio::time::Instant::from_std(began + timeout);
    let mut exit = None;
    let mut timed_out = false;
    let mut drain_until = None;
    loop {
        let until = drain_until.unwrap_or(deadline);
        tokio::select! {
            ev = started.events.next() => match ev {
                Ok(Some(Event::Data(d))) => match d.output {
                    Some(Output::Stdout(b)) => out.push(&b),
                    Some(Output::Stderr(b)) => err.push(&b),
                    Some(Output::Pty(_)) | None => {}
                },
                Ok(Some(Event::End(e))) => {
                    exit = Some(exit_code(&e));
                    if timed_out {
                        break;
                    }
                }
                Ok(Some(_)) => {}
                Ok(None) => break,
                Err(e) if timed_out => {
                    tracing::debug!(error = %e, "stream ended after the kill");
                    break;
                }
                Err(e) => return Err(e),
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
            service: envd.who(),
            reason: "the command's event stream ended without an end event".into(),
            source: None,
        });
    }
    if !timed_out {
        // Whatever the command left running (a daemonized grandchild) goes too.
        started.reaper.armed = false;
        let (envd, marker) = (envd.clone(), started.reaper.marker.clone());
        tokio::spawn(async move { reap(&envd, &marker).await });
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
    envd: &Arc<Conn>,
    command: Command,
    stdin: Option<ByteStream>,
    exit_errors: fn(i32, &str) -> Option<Error>,
    keepalive: KeepAlive,
) -> Result<ByteStream> {
    let started = start(envd, command, stdin).await?;
    let (tx, mut rx) = tokio::sync::mpsc::channel::<Result<Bytes>>(8);
    let stream: ByteStream = futures::stream::poll_fn(move |cx| rx.poll_recv(cx)).boxed();
    tokio::spawn(async move {
        let _keepalive = keepalive;
        let Started {
            mut events,
            mut reaper,
            mut stdin,
        } = started;
        let mut stdin_done = false;
        let mut err = CappedBuffer::new(64 << 10);
        let outcome: Result<()> = async {
            let mut exit = None;
            loop {
                let ev = tokio::select! {
                    ev = events.next() => ev?,
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
                match ev {
                    Some(Event::Data(d)) => match d.output {
                        Some(Output::Stdout(b)) => {
                            let sent = tx.send(Ok(Bytes::from(b))).await;
                            if sent.is_err() {
                                return Err(Error::backend(BACKEND, "exec", "reader went away"));
                            }
                        }
                        Some(Output::Stderr(b)) => err.push(&b),
                        _ => {}
                    },
                    Some(Event::End(e)) => {
                        reaper.armed = false;
                        exit = Some(exit_code(&e));
                    }
                    Some(_) => {}
                    None => break,
                }
            }
            let Some(code) = exit else {
                return Err(events.cut("no end event".into()));
            };
            // A failed stdin (a bad archive) is the real cause.
            if !stdin_done && let Ok(Err(e)) = (&mut stdin).await {
                return Err(e);
            }
            if code == 0 {
                return Ok(());
            }
            let stderr = err.finish();
            let stderr = String::from_utf8_lossy(&stderr.bytes);
            Err(exit_errors(code, &stderr).unwrap_or_else(|| {
                Error::backend(
                    BACKEND,
                    "exec",
                    format!("helper exited with {code}: {}", stderr.trim()),
                )
            }))
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

#[cfg(test)]
mod tests {
    use super::*;

    fn envelope(flags: u8, payload: &[u8]) -> Vec<u8> {
        envelope::encode(flags, payload).to_vec()
    }

    fn events_of(chunks: Vec<Vec<u8>>) -> Events {
        Events {
            body: futures::stream::iter(chunks.into_iter().map(|c| Ok(Bytes::from(c)))).boxed(),
            decoder: Decoder::new(),
            who: "envd of e2b sandbox t".into(),
            done: false,
        }
    }

    fn event(e: Event) -> Vec<u8> {
        StartResponse {
            event: Some(e2b_envd_proto::process::ProcessEvent { event: Some(e) }),
        }
        .encode_to_vec()
    }

    #[tokio::test]
    async fn envelopes_split_across_chunks_decode() {
        use e2b_envd_proto::process::process_event::{DataEvent, StartEvent};
        let mut all = envelope(0, &event(Event::Start(StartEvent { pid: 7 })));
        all.extend(envelope(
            0,
            &event(Event::Data(DataEvent {
                output: Some(Output::Stdout(b"hi".to_vec())),
            })),
        ));
        all.extend(envelope(
            0,
            &event(Event::End(EndEvent {
                exit_code: 3,
                exited: true,
                status: "exit status 3".into(),
                error: None,
            })),
        ));
        all.extend(envelope(2, b"{}"));
        // One byte at a time: every split point.
        let mut ev = events_of(all.iter().map(|b| vec![*b]).collect());
        assert!(matches!(ev.next().await.unwrap(), Some(Event::Start(s)) if s.pid == 7));
        assert!(
            matches!(ev.next().await.unwrap(), Some(Event::Data(d)) if d.output == Some(Output::Stdout(b"hi".to_vec())))
        );
        assert!(matches!(ev.next().await.unwrap(), Some(Event::End(e)) if e.exit_code == 3));
        assert!(ev.next().await.unwrap().is_none());
    }

    #[test]
    fn signal_deaths_become_shell_exit_codes() {
        let end = |code, exited, status: &str| EndEvent {
            exit_code: code,
            exited,
            status: status.into(),
            error: None,
        };
        assert_eq!(exit_code(&end(3, true, "exit status 3")), 3);
        assert_eq!(exit_code(&end(-1, false, "signal: killed")), 137);
        assert_eq!(exit_code(&end(-1, false, "signal: terminated")), 143);
        assert_eq!(exit_code(&end(-1, false, "signal: something new")), -1);
    }

    #[tokio::test]
    async fn end_stream_errors_and_cut_streams_are_typed() {
        let mut ev = events_of(vec![envelope(
            2,
            br#"{"error":{"code":"unauthenticated","message":"bad token"}}"#,
        )]);
        assert!(matches!(ev.next().await, Err(Error::Unauthorized { .. })));
        let mut ev = events_of(vec![envelope(
            2,
            br#"{"error":{"code":"unavailable","message":"gone"}}"#,
        )]);
        assert!(matches!(ev.next().await, Err(Error::Unavailable { .. })));
        // Half an envelope, then the connection ends.
        let whole = envelope(0, &[1, 2, 3, 4]);
        let mut ev = events_of(vec![whole[..6].to_vec()]);
        let e = ev.next().await.unwrap_err();
        assert!(
            matches!(&e, Error::Unavailable { reason, .. } if reason.contains("cut")),
            "{e}"
        );
    }

    #[test]
    fn envd_base_follows_the_override() {
        let c = reqwest::Client::new();
        let e = Envd::new(c.clone(), None, "e2b.app", "abc", Some(Secret::new("tok")));
        assert_eq!(e.base(), "https://49983-abc.e2b.app");
        assert!(!format!("{e:?}").contains("tok\""));
        let e = Envd::new(c, Some("http://127.0.0.1:9/"), "e2b.app", "abc", None);
        assert_eq!(e.base(), "http://127.0.0.1:9");
    }
}
