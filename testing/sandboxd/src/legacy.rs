//! The legacy python-runtime API (agent-sandbox's `python-runtime-sandbox`, port 8888).
//!
//! - `GET /` → `{"status":"ok","message":...}`.
//! - `POST /execute {"command", "timeout_seconds"?}` → 200 `{"stdout","stderr","exit_code",
//!   "timed_out"}`. The command is split like Python's `shlex.split` and run without a shell
//!   in the base directory, in its own process group, with stdin `/dev/null`. The time limit
//!   is `timeout_seconds` (SDK 1.0.8 sends it when the caller sets `command_timeout`) or
//!   300 s; a command over it has its group SIGKILLed and answers `exit_code` 124 with
//!   `timed_out: true`. A command that cannot be split or started still answers 200, with
//!   `exit_code` 1 and the reason on stderr.
//! - `POST /upload`: multipart field `file`; its filename is the destination, relative to the
//!   base directory (an absolute one must lie under it); parents are created; the write is
//!   atomic. 200 `{"message"}`, 403 `{"message":"Access denied"}` for a path leaving the base
//!   directory, 422 without a `file` part, 500 `{"message"}` on I/O errors.
//! - `GET /download/{path}` → the bytes (`application/octet-stream`), or 404
//!   `{"message":"File not found"}`.
//! - `GET /list/{path}` → `[{"name","size","type":"file|directory","mod_time"}]`, or 404.
//! - `GET /exists/{path}` → `{"path","exists"}`.
//!
//! Paths arrive percent-encoded (`%2F` for `/`); an escape attempt answers 403
//! `{"message":"Access denied"}` everywhere.

use std::io;
use std::os::unix::process::ExitStatusExt as _;
use std::process::Stdio;
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::extract::{Multipart, Path, State};
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use nix::unistd::Pid;
use serde::{Deserialize, Serialize};
use serde_json::json;
use tokio::io::AsyncReadExt as _;

use crate::files::{self, Base, Opened};
use crate::paths::{self, Absolute, Target};
use crate::process::GroupKill;

/// Default time limit of `/execute`.
pub const EXECUTE_TIMEOUT: Duration = Duration::from_secs(300);

/// Exit code reported for a command killed at its time limit (as `timeout(1)` does).
pub const TIMED_OUT_EXIT_CODE: i32 = 124;

/// The legacy router over `base`.
pub fn router(base: Arc<Base>) -> Router {
    Router::new()
        .route("/", get(root))
        .route("/execute", post(execute))
        .route("/upload", post(upload))
        .route("/download/{*path}", get(download))
        .route("/list/", get(list_root))
        .route("/list/{*path}", get(list))
        .route("/exists/{*path}", get(exists))
        .fallback(|| async { message(StatusCode::NOT_FOUND, "Not Found") })
        .with_state(base)
}

fn message(status: StatusCode, text: &str) -> Response {
    (status, axum::Json(json!({ "message": text }))).into_response()
}

fn access_denied() -> Response {
    message(StatusCode::FORBIDDEN, "Access denied")
}

/// Where `raw` leads beneath the base directory, or `None` when it would leave it.
fn resolve(base: &Base, raw: &str) -> Option<Target> {
    paths::resolve(raw, Absolute::WithinBase(&base.path)).ok()
}

fn is_refusal(e: &io::Error) -> bool {
    sandbox_core::beneath::refusal(e).is_some()
}

async fn root() -> Response {
    axum::Json(json!({"status": "ok", "message": "Sandbox Runtime is active."})).into_response()
}

#[derive(Deserialize)]
struct ExecuteRequest {
    command: String,
    #[serde(default)]
    timeout_seconds: Option<f64>,
}

#[derive(Serialize)]
struct ExecuteResponse {
    stdout: String,
    stderr: String,
    exit_code: i32,
    timed_out: bool,
}

impl ExecuteResponse {
    fn failed(reason: impl std::fmt::Display) -> ExecuteResponse {
        ExecuteResponse {
            stdout: String::new(),
            stderr: format!("Failed to execute command: {reason}"),
            exit_code: 1,
            timed_out: false,
        }
    }
}

async fn execute(
    State(base): State<Arc<Base>>,
    axum::Json(request): axum::Json<ExecuteRequest>,
) -> axum::Json<ExecuteResponse> {
    let limit = match request.timeout_seconds {
        Some(s) if s.is_finite() && s > 0.0 => {
            Duration::try_from_secs_f64(s).unwrap_or(EXECUTE_TIMEOUT)
        }
        _ => EXECUTE_TIMEOUT,
    };
    axum::Json(run(&base, &request.command, limit).await)
}

async fn run(base: &Base, command: &str, limit: Duration) -> ExecuteResponse {
    let Some(argv) = shlex::split(command) else {
        return ExecuteResponse::failed("No closing quotation");
    };
    let Some((program, args)) = argv.split_first() else {
        return ExecuteResponse::failed("empty command");
    };
    let mut child = match tokio::process::Command::new(program)
        .args(args)
        .current_dir(&base.path)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .process_group(0)
        .kill_on_drop(true)
        .spawn()
    {
        Ok(child) => child,
        Err(e) => return ExecuteResponse::failed(e),
    };
    // Dropped with this future (the client hung up) or at the time limit: the group dies.
    let Some(kill) = child
        .id()
        .and_then(|p| i32::try_from(p).ok())
        .map(|p| GroupKill::new(Pid::from_raw(p)))
    else {
        return ExecuteResponse::failed("the started process has no pid");
    };
    let (mut out, mut err) = (Vec::new(), Vec::new());
    let mut stdout = child.stdout.take();
    let mut stderr = child.stderr.take();
    let collect = async {
        let read_out = async {
            if let Some(pipe) = stdout.as_mut() {
                let _ = pipe.read_to_end(&mut out).await;
            }
        };
        let read_err = async {
            if let Some(pipe) = stderr.as_mut() {
                let _ = pipe.read_to_end(&mut err).await;
            }
        };
        let ((), (), status) = tokio::join!(read_out, read_err, child.wait());
        status
    };
    let result = tokio::time::timeout(limit, collect).await;
    let timed_out = result.is_err();
    if timed_out {
        drop(kill);
    } else {
        kill.disarm();
    }
    let exit_code = match result {
        // As Python's `returncode`: the exit status, or `-n` for a kill by signal `n`.
        Ok(Ok(status)) => status
            .code()
            .unwrap_or_else(|| -status.signal().unwrap_or(1)),
        Ok(Err(e)) => return ExecuteResponse::failed(e),
        Err(_) => TIMED_OUT_EXIT_CODE,
    };
    let mut stderr = String::from_utf8_lossy(&err).into_owned();
    if timed_out {
        stderr.push_str(&format!(
            "Command timed out after {} seconds",
            limit.as_secs_f64()
        ));
    }
    ExecuteResponse {
        stdout: String::from_utf8_lossy(&out).into_owned(),
        stderr,
        exit_code,
        timed_out,
    }
}

async fn upload(State(base): State<Arc<Base>>, mut form: Multipart) -> Response {
    loop {
        let field = match form.next_field().await {
            Ok(Some(field)) => field,
            Ok(None) => {
                return (
                    StatusCode::UNPROCESSABLE_ENTITY,
                    axum::Json(json!({"detail": "field `file` is required"})),
                )
                    .into_response();
            }
            Err(e) => {
                return message(
                    StatusCode::BAD_REQUEST,
                    &format!("invalid multipart body: {e}"),
                );
            }
        };
        if field.name() != Some("file") {
            continue;
        }
        let filename = field.file_name().unwrap_or_default().to_owned();
        let rel = match resolve(&base, &filename) {
            Some(Target::Rel(rel)) => rel,
            Some(Target::Root) => {
                return message(
                    StatusCode::INTERNAL_SERVER_ERROR,
                    "File upload failed: the destination is a directory",
                );
            }
            None => return access_denied(),
        };
        return match files::write_atomic(base.clone(), rel, 0o644, field).await {
            Ok(_) => message(
                StatusCode::OK,
                &format!("File '{filename}' uploaded successfully."),
            ),
            Err(e) if is_refusal(&e) => access_denied(),
            Err(e) => message(
                StatusCode::INTERNAL_SERVER_ERROR,
                &format!("File upload failed: {e}"),
            ),
        };
    }
}

async fn download(State(base): State<Arc<Base>>, Path(path): Path<String>) -> Response {
    let Some(target) = resolve(&base, &path) else {
        return access_denied();
    };
    let opened = files::blocking({
        let base = base.clone();
        move || files::open(&base, &target)
    })
    .await;
    match opened {
        Ok(Opened::File(file, len)) => (
            [
                (
                    header::CONTENT_TYPE,
                    HeaderValue::from_static("application/octet-stream"),
                ),
                (header::CONTENT_LENGTH, HeaderValue::from(len)),
            ],
            Body::from_stream(files::file_stream(file)),
        )
            .into_response(),
        Err(e) if is_refusal(&e) => access_denied(),
        Ok(Opened::Dir(_)) | Err(_) => message(StatusCode::NOT_FOUND, "File not found"),
    }
}

async fn list_root(state: State<Arc<Base>>) -> Response {
    list(state, Path(String::new())).await
}

async fn list(State(base): State<Arc<Base>>, Path(path): Path<String>) -> Response {
    let Some(target) = resolve(&base, &path) else {
        return access_denied();
    };
    let listed = files::blocking({
        let base = base.clone();
        move || match files::open(&base, &target)? {
            Opened::Dir(dir) => files::list(&base, &dir, &target),
            Opened::File(..) => Err(io::ErrorKind::NotFound.into()),
        }
    })
    .await;
    match listed {
        Ok(entries) => {
            let entries: Vec<_> = entries
                .into_iter()
                .map(|e| {
                    json!({
                        "name": e.name,
                        "size": e.size,
                        "type": if e.is_dir { "directory" } else { "file" },
                        "mod_time": files::epoch_seconds(e.modified),
                    })
                })
                .collect();
            axum::Json(entries).into_response()
        }
        Err(e) if is_refusal(&e) => access_denied(),
        Err(_) => message(StatusCode::NOT_FOUND, "Directory not found"),
    }
}

async fn exists(State(base): State<Arc<Base>>, Path(path): Path<String>) -> Response {
    let Some(target) = resolve(&base, &path) else {
        return access_denied();
    };
    let found = files::blocking({
        let base = base.clone();
        move || files::exists(&base, &target)
    })
    .await;
    match found {
        Ok(exists) => axum::Json(json!({"path": path, "exists": exists})).into_response(),
        Err(e) if is_refusal(&e) => access_denied(),
        Err(e) => message(StatusCode::INTERNAL_SERVER_ERROR, &e.to_string()),
    }
}
