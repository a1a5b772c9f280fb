//! Calls into a sandbox's container: sandboxd's gRPC `ProcessService` (:9090) and its REST
//! file API (:8080).

use std::collections::HashMap;
use std::time::Duration;

use sandboxd_proto::{
    DEFAULT_GRPC_PORT, DEFAULT_REST_PORT, ExecuteRequest, ProcessConfig, ProcessServiceClient,
    SendSignalRequest, Signal, StartRequest, WriteStdinRequest, start_response,
    write_stdin_request,
};

/// What went wrong talking to sandboxd.
#[derive(Debug)]
pub(crate) enum PodError {
    /// A gRPC status from sandboxd.
    Grpc(tonic::Status),
    /// An HTTP error from sandboxd's REST API: status and body.
    Http(u16, String),
    /// sandboxd could not be reached.
    Connect(String),
}

impl std::fmt::Display for PodError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            PodError::Grpc(s) => write!(f, "{}: {}", s.code(), s.message()),
            PodError::Http(c, b) => write!(f, "HTTP {c}: {b}"),
            PodError::Connect(m) => write!(f, "{m}"),
        }
    }
}

/// The result of a command.
#[derive(Debug, Default)]
pub(crate) struct Outcome {
    pub exit_code: i32,
    pub stdout: Vec<u8>,
    pub stderr: Vec<u8>,
    /// Stdout and stderr in the order they arrived.
    pub combined: Vec<u8>,
    pub timed_out: bool,
}

async fn client(ip: &str) -> Result<ProcessServiceClient<tonic::transport::Channel>, PodError> {
    ProcessServiceClient::connect(format!("http://{ip}:{DEFAULT_GRPC_PORT}"))
        .await
        .map_err(|e| PodError::Connect(format!("sandboxd at {ip}: {e}")))
}

/// Run `shell` with `script` on its stdin (as the Daytona daemon does), in `cwd` with `env`
/// added; over `timeout` the process group is SIGKILLed and `timed_out` set.
pub(crate) async fn run_script(
    ip: &str,
    shell: &str,
    script: &[u8],
    cwd: Option<String>,
    env: HashMap<String, String>,
    timeout: Option<Duration>,
) -> Result<Outcome, PodError> {
    let mut c = client(ip).await?;
    let config = ProcessConfig {
        command: vec![shell.to_owned()],
        env_vars: env,
        cwd,
    };
    let mut stream = c
        .start(StartRequest {
            config: Some(config),
            pty: None,
        })
        .await
        .map_err(PodError::Grpc)?
        .into_inner();
    let pid = match stream.message().await.map_err(PodError::Grpc)? {
        Some(sandboxd_proto::StartResponse {
            event: Some(start_response::Event::Init(i)),
        }) => i.process_id,
        other => {
            return Err(PodError::Connect(format!(
                "sandboxd: expected init, got {other:?}"
            )));
        }
    };
    let deadline = timeout.map(|t| tokio::time::Instant::now() + t);
    let work = async {
        if !script.is_empty() {
            c.write_stdin(WriteStdinRequest {
                process_id: pid,
                payload: Some(write_stdin_request::Payload::Input(script.to_vec())),
            })
            .await
            .map_err(PodError::Grpc)?;
        }
        // The shell may have exited already (`exit` in the script): NOT_FOUND is fine.
        let _ = c
            .clone()
            .write_stdin(WriteStdinRequest {
                process_id: pid,
                payload: Some(write_stdin_request::Payload::Eof(())),
            })
            .await;
        let mut out = Outcome::default();
        while let Some(ev) = stream.message().await.map_err(PodError::Grpc)? {
            match ev.event {
                Some(start_response::Event::Stdout(b)) => {
                    out.combined.extend_from_slice(&b);
                    out.stdout.extend(b);
                }
                Some(start_response::Event::Stderr(b)) => {
                    out.combined.extend_from_slice(&b);
                    out.stderr.extend(b);
                }
                Some(start_response::Event::Exit(e)) => {
                    out.exit_code = e.exit_code;
                    return Ok(out);
                }
                _ => {}
            }
        }
        Err(PodError::Connect(
            "sandboxd ended the stream without an exit".into(),
        ))
    };
    match deadline {
        Some(d) => match tokio::time::timeout_at(d, work).await {
            Ok(r) => r,
            Err(_) => {
                let _ = c
                    .send_signal(SendSignalRequest {
                        process_id: pid,
                        signal: Signal::Sigkill as i32,
                    })
                    .await;
                Ok(Outcome {
                    timed_out: true,
                    exit_code: -1,
                    ..Outcome::default()
                })
            }
        },
        None => work.await,
    }
}

/// Run `argv` (stdin `/dev/null`) and collect its output.
pub(crate) async fn execute(ip: &str, argv: &[&str]) -> Result<Outcome, PodError> {
    let mut c = client(ip).await?;
    let r = c
        .execute(ExecuteRequest {
            config: Some(ProcessConfig::new(argv.iter().copied())),
        })
        .await
        .map_err(PodError::Grpc)?
        .into_inner();
    Ok(Outcome {
        exit_code: r.exit_code,
        combined: [r.stdout.as_slice(), r.stderr.as_slice()].concat(),
        stdout: r.stdout,
        stderr: r.stderr,
        timed_out: false,
    })
}

/// `/v1/files/<path>` of sandboxd's REST API, each segment percent-encoded.
fn file_url(ip: &str, path: &str) -> String {
    let mut enc = String::new();
    for (i, seg) in path.trim_start_matches('/').split('/').enumerate() {
        if i > 0 {
            enc.push('/');
        }
        for b in seg.bytes() {
            if b.is_ascii_alphanumeric() || b"-_.~".contains(&b) {
                enc.push(char::from(b));
            } else {
                enc.push_str(&format!("%{b:02X}"));
            }
        }
    }
    format!("http://{ip}:{DEFAULT_REST_PORT}/v1/files/{enc}")
}

async fn check(r: reqwest::Result<reqwest::Response>) -> Result<reqwest::Response, PodError> {
    let r = r.map_err(|e| PodError::Connect(format!("sandboxd REST: {e}")))?;
    if r.status().is_success() {
        return Ok(r);
    }
    let code = r.status().as_u16();
    let body = r.text().await.unwrap_or_default();
    let message = serde_json::from_str::<serde_json::Value>(&body)
        .ok()
        .and_then(|v| v["message"].as_str().map(str::to_owned))
        .unwrap_or(body);
    Err(PodError::Http(code, message))
}

/// A file's bytes (a response to stream).
pub(crate) async fn read(
    http: &reqwest::Client,
    ip: &str,
    path: &str,
) -> Result<reqwest::Response, PodError> {
    check(http.get(file_url(ip, path)).send().await).await
}

/// Write a file atomically (parents created).
pub(crate) async fn write(
    http: &reqwest::Client,
    ip: &str,
    path: &str,
    data: bytes::Bytes,
) -> Result<(), PodError> {
    check(http.put(file_url(ip, path)).body(data).send().await)
        .await
        .map(drop)
}

/// Delete a file or (with `recursive`) a directory tree.
pub(crate) async fn delete(
    http: &reqwest::Client,
    ip: &str,
    path: &str,
    recursive: bool,
) -> Result<(), PodError> {
    let mut url = file_url(ip, path);
    if recursive {
        url.push_str("?recursive=true");
    }
    check(http.delete(url).send().await).await.map(drop)
}
