//! The toolbox (daemon) API at `{toolboxProxyUrl}/{sandboxId}/...`, translated to sandboxd's
#![allow(clippy::result_large_err)] // handlers return finished `Response`s as their errors
//! gRPC process service and REST file API in the sandbox's container.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::extract::{DefaultBodyLimit, Multipart, Path, Query, State};
use axum::http::{Method, StatusCode, Uri, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use serde::Deserialize;
use serde_json::{Value, json};

use crate::http::daemon_error;
use crate::pod::{self, PodError};
use crate::state::{Inner, SessionCommand};

/// The directory relative paths and the default `cwd` are resolved against.
pub const WORK_DIR: &str = "/app";
/// The shell commands run by (`sh`, as the image has no zsh or bash guarantee).
const SHELL: &str = "/bin/sh";
/// The longest a command may run when the request names no timeout.
const MAX_COMMAND: Duration = Duration::from_secs(600);

type S = State<Arc<Inner>>;

pub(crate) fn router(inner: Arc<Inner>) -> Router {
    Router::new()
        .route("/{sid}/process/execute", post(execute))
        .route(
            "/{sid}/process/session",
            post(session_create).get(session_list),
        )
        .route(
            "/{sid}/process/session/{session}",
            get(session_get).delete(session_delete),
        )
        .route("/{sid}/process/session/{session}/exec", post(session_exec))
        .route(
            "/{sid}/process/session/{session}/command/{cmd}",
            get(command_get),
        )
        .route(
            "/{sid}/process/session/{session}/command/{cmd}/logs",
            get(command_logs),
        )
        .route("/{sid}/files", get(files_list).delete(files_delete))
        .route("/{sid}/files/download", get(files_download))
        .route("/{sid}/files/upload", post(files_upload))
        .route("/{sid}/files/bulk-upload", post(files_bulk_upload))
        .route("/{sid}/files/bulk-download", post(files_bulk_download))
        .route("/{sid}/files/info", get(files_info))
        .route("/{sid}/files/folder", post(files_folder))
        .route("/{sid}/files/move", post(files_move))
        .fallback(|m: Method, u: Uri| async move {
            daemon_error(404, "BAD_REQUEST", "not found", u.path(), m.as_str())
        })
        .layer(DefaultBodyLimit::max(1 << 30))
        .layer(axum::middleware::from_fn_with_state(
            inner.clone(),
            crate::http::toolbox_guard,
        ))
        .with_state(inner)
}

/// The request's identity for error bodies.
struct Ctx {
    path: String,
    method: String,
}

impl Ctx {
    fn new(m: &Method, u: &Uri) -> Self {
        Self {
            path: u.path().to_owned(),
            method: m.to_string(),
        }
    }

    fn err(&self, code: u16, error_code: &str, message: impl Into<String>) -> Response {
        daemon_error(code, error_code, message, &self.path, &self.method)
    }

    fn pod(&self, e: PodError) -> Response {
        match e {
            PodError::Http(404, m) => self.err(404, "FILE_NOT_FOUND", m),
            PodError::Http(403, m) => self.err(403, "FILE_ACCESS_DENIED", m),
            PodError::Http(400, m) => self.err(400, "INVALID_FILE_PATH", m),
            PodError::Http(409, m) => self.err(409, "BAD_REQUEST", m),
            PodError::Grpc(s) if s.code() == tonic::Code::NotFound => {
                self.err(404, "FILE_NOT_FOUND", s.message().to_owned())
            }
            PodError::Grpc(s) if s.code() == tonic::Code::PermissionDenied => {
                self.err(403, "FILE_ACCESS_DENIED", s.message().to_owned())
            }
            other => self.err(500, "BAD_REQUEST", other.to_string()),
        }
    }
}

/// The started sandbox's container address, or the error to answer.
fn running(inner: &Inner, sid: &str, ctx: &Ctx) -> Result<String, Response> {
    let mut map = inner.lock();
    let Some(s) = map.get_mut(sid) else {
        return Err(ctx.err(404, "BAD_REQUEST", format!("sandbox {sid} not found")));
    };
    match (&s.ip, s.state) {
        (Some(ip), "started") => {
            s.last_activity = std::time::Instant::now();
            Ok(ip.clone())
        }
        (_, state) => Err(ctx.err(
            409,
            "BAD_REQUEST",
            format!("sandbox {sid} is not started (state {state})"),
        )),
    }
}

/// A request path made absolute (relative ones are under [`WORK_DIR`]).
fn absolute(p: &str) -> String {
    if p.starts_with('/') {
        p.to_owned()
    } else if p.is_empty() || p == "." {
        WORK_DIR.to_owned()
    } else {
        format!("{WORK_DIR}/{}", p.trim_start_matches("./"))
    }
}

#[derive(Deserialize)]
struct ExecuteBody {
    command: String,
    cwd: Option<String>,
    envs: Option<HashMap<String, String>>,
    timeout: Option<i64>,
}

async fn execute(
    State(inner): S,
    Path(sid): Path<String>,
    m: Method,
    u: Uri,
    body: axum::body::Bytes,
) -> Response {
    let ctx = Ctx::new(&m, &u);
    let ip = match running(&inner, &sid, &ctx) {
        Ok(ip) => ip,
        Err(r) => return r,
    };
    let b: ExecuteBody = match serde_json::from_slice(&body) {
        Ok(b) => b,
        Err(e) => return ctx.err(400, "BAD_REQUEST", format!("invalid request body: {e}")),
    };
    if b.command.trim().is_empty() {
        return ctx.err(400, "BAD_REQUEST", "command is required");
    }
    let timeout = match b.timeout {
        Some(t) if t < 0 => return ctx.err(400, "BAD_REQUEST", "timeout must not be negative"),
        Some(t) if t > 0 => Duration::from_secs(t.unsigned_abs()),
        _ => MAX_COMMAND,
    };
    let cwd = absolute(b.cwd.as_deref().unwrap_or(""));
    let mut script = b.command.into_bytes();
    if script.last() != Some(&b'\n') {
        script.push(b'\n');
    }
    let env = b.envs.unwrap_or_default();
    match pod::run_script(&ip, SHELL, &script, Some(cwd), env, Some(timeout)).await {
        Ok(o) if o.timed_out => ctx.err(
            408,
            "PROCESS_EXECUTION_TIMEOUT",
            "request timeout: command execution timeout",
        ),
        Ok(o) => axum::Json(json!({
            "exitCode": o.exit_code,
            "result": String::from_utf8_lossy(&o.combined),
        }))
        .into_response(),
        // The process could not start (missing cwd, bad env): 200 with exit code -1.
        Err(PodError::Grpc(s))
            if matches!(
                s.code(),
                tonic::Code::NotFound
                    | tonic::Code::PermissionDenied
                    | tonic::Code::InvalidArgument
            ) =>
        {
            axum::Json(json!({"exitCode": -1, "result": s.message()})).into_response()
        }
        Err(e) => ctx.pod(e),
    }
}

// ---- sessions ---------------------------------------------------------------------------

fn session_json(id: &str, cmds: &[SessionCommand]) -> Value {
    let commands: Vec<Value> = cmds.iter().map(command_json).collect();
    json!({"sessionId": id, "commands": commands})
}

fn command_json(c: &SessionCommand) -> Value {
    let mut v = json!({"id": c.id, "command": c.command});
    if let Some(code) = c.exit_code {
        v["exitCode"] = json!(code);
    }
    v
}

async fn session_create(
    State(inner): S,
    Path(sid): Path<String>,
    m: Method,
    u: Uri,
    body: axum::body::Bytes,
) -> Response {
    let ctx = Ctx::new(&m, &u);
    if let Err(r) = running(&inner, &sid, &ctx) {
        return r;
    }
    let v: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
    let Some(session) = v["sessionId"].as_str().filter(|s| !s.is_empty()) else {
        return ctx.err(400, "BAD_REQUEST", "sessionId is required");
    };
    let created = inner.update(&sid, |s| {
        if s.sessions.contains_key(session) {
            false
        } else {
            s.sessions.insert(session.to_owned(), Vec::new());
            true
        }
    });
    match created {
        Some(true) => StatusCode::CREATED.into_response(),
        Some(false) => ctx.err(
            409,
            "BAD_REQUEST",
            format!("session {session} already exists"),
        ),
        None => ctx.err(404, "BAD_REQUEST", "sandbox not found"),
    }
}

async fn session_list(State(inner): S, Path(sid): Path<String>, m: Method, u: Uri) -> Response {
    let ctx = Ctx::new(&m, &u);
    if let Err(r) = running(&inner, &sid, &ctx) {
        return r;
    }
    let list: Vec<Value> = inner
        .lock()
        .get(&sid)
        .map(|s| s.sessions.iter().map(|(k, c)| session_json(k, c)).collect())
        .unwrap_or_default();
    axum::Json(list).into_response()
}

async fn session_get(
    State(inner): S,
    Path((sid, session)): Path<(String, String)>,
    m: Method,
    u: Uri,
) -> Response {
    let ctx = Ctx::new(&m, &u);
    if let Err(r) = running(&inner, &sid, &ctx) {
        return r;
    }
    let found = inner
        .lock()
        .get(&sid)
        .and_then(|s| s.sessions.get(&session).map(|c| session_json(&session, c)));
    match found {
        Some(v) => axum::Json(v).into_response(),
        None => ctx.err(
            404,
            "PROCESS_NOT_FOUND",
            format!("session {session} not found"),
        ),
    }
}

async fn session_delete(
    State(inner): S,
    Path((sid, session)): Path<(String, String)>,
    m: Method,
    u: Uri,
) -> Response {
    let ctx = Ctx::new(&m, &u);
    let ip = match running(&inner, &sid, &ctx) {
        Ok(ip) => ip,
        Err(r) => return r,
    };
    match inner
        .update(&sid, |s| s.sessions.remove(&session))
        .flatten()
    {
        Some(_) => {
            let state = session_state(&session);
            let (cwd, env) = (format!("{state}.cwd"), format!("{state}.env"));
            let _ = pod::execute(&ip, &["rm", "-f", &cwd, &env]).await;
            StatusCode::NO_CONTENT.into_response()
        }
        None => ctx.err(
            404,
            "PROCESS_NOT_FOUND",
            format!("session {session} not found"),
        ),
    }
}

fn store_command(inner: &Inner, sid: &str, session: &str, cmd: SessionCommand) {
    inner.update(sid, |s| {
        if let Some(list) = s.sessions.get_mut(session)
            && let Some(slot) = list.iter_mut().find(|c| c.id == cmd.id)
        {
            *slot = cmd;
        }
    });
}

/// Where a session's directory and variables are kept in the sandbox.
fn session_state(session: &str) -> String {
    let safe: String = session
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '-' || c == '_' {
                c
            } else {
                '_'
            }
        })
        .collect();
    format!("/tmp/.daytona-session-{safe}")
}

/// What a session command runs first: the session's saved directory and exported variables
/// come back, and are saved again when the shell exits (however it exits), so `cd` and
/// `export` carry over to the session's next command as in the daemon's long-lived shell.
fn session_prelude(session: &str) -> String {
    let state = session_state(session);
    format!(
        "__s='{state}'; [ -f \"$__s.env\" ] && . \"$__s.env\"; [ -f \"$__s.cwd\" ] && cd \"$(cat \"$__s.cwd\")\"\ntrap '__rc=$?; pwd > \"$__s.cwd\"; export -p > \"$__s.env\"; exit $__rc' EXIT\n"
    )
}

async fn run_session_command(
    inner: Arc<Inner>,
    ip: String,
    sid: String,
    session: String,
    mut cmd: SessionCommand,
) -> SessionCommand {
    let mut script = session_prelude(&session).into_bytes();
    script.extend_from_slice(cmd.command.as_bytes());
    script.push(b'\n');
    let r = pod::run_script(
        &ip,
        SHELL,
        &script,
        Some(WORK_DIR.to_owned()),
        HashMap::new(),
        Some(MAX_COMMAND),
    )
    .await;
    match r {
        Ok(o) => {
            cmd.exit_code = Some(if o.timed_out { -1 } else { o.exit_code });
            cmd.stdout = String::from_utf8_lossy(&o.stdout).into_owned();
            cmd.stderr = String::from_utf8_lossy(&o.stderr).into_owned();
            cmd.output = String::from_utf8_lossy(&o.combined).into_owned();
        }
        Err(e) => {
            cmd.exit_code = Some(-1);
            cmd.stderr = e.to_string();
            cmd.output = cmd.stderr.clone();
        }
    }
    store_command(&inner, &sid, &session, cmd.clone());
    cmd
}

async fn session_exec(
    State(inner): S,
    Path((sid, session)): Path<(String, String)>,
    m: Method,
    u: Uri,
    body: axum::body::Bytes,
) -> Response {
    let ctx = Ctx::new(&m, &u);
    let ip = match running(&inner, &sid, &ctx) {
        Ok(ip) => ip,
        Err(r) => return r,
    };
    let v: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
    let Some(command) = v["command"].as_str().filter(|c| !c.trim().is_empty()) else {
        return ctx.err(400, "BAD_REQUEST", "command is required");
    };
    let run_async = v["runAsync"]
        .as_bool()
        .or(v["async"].as_bool())
        .unwrap_or(false);
    let cmd = SessionCommand {
        id: uuid::Uuid::new_v4().to_string(),
        command: command.to_owned(),
        ..SessionCommand::default()
    };
    let added = inner.update(&sid, |s| match s.sessions.get_mut(&session) {
        Some(list) => {
            list.push(cmd.clone());
            true
        }
        None => false,
    });
    if added != Some(true) {
        return ctx.err(
            404,
            "PROCESS_NOT_FOUND",
            format!("session {session} not found"),
        );
    }
    if run_async {
        let id = cmd.id.clone();
        tokio::spawn(run_session_command(inner.clone(), ip, sid, session, cmd));
        return (StatusCode::ACCEPTED, axum::Json(json!({"cmdId": id}))).into_response();
    }
    let done = run_session_command(inner.clone(), ip, sid, session, cmd).await;
    axum::Json(json!({
        "cmdId": done.id,
        "output": done.output,
        "stdout": done.stdout,
        "stderr": done.stderr,
        "exitCode": done.exit_code,
    }))
    .into_response()
}

fn find_command(inner: &Inner, sid: &str, session: &str, cmd: &str) -> Option<SessionCommand> {
    inner
        .lock()
        .get(sid)?
        .sessions
        .get(session)?
        .iter()
        .find(|c| c.id == cmd)
        .cloned()
}

async fn command_get(
    State(inner): S,
    Path((sid, session, cmd)): Path<(String, String, String)>,
    m: Method,
    u: Uri,
) -> Response {
    let ctx = Ctx::new(&m, &u);
    if let Err(r) = running(&inner, &sid, &ctx) {
        return r;
    }
    match find_command(&inner, &sid, &session, &cmd) {
        Some(c) => axum::Json(command_json(&c)).into_response(),
        None => ctx.err(404, "PROCESS_NOT_FOUND", format!("command {cmd} not found")),
    }
}

async fn command_logs(
    State(inner): S,
    Path((sid, session, cmd)): Path<(String, String, String)>,
    m: Method,
    u: Uri,
) -> Response {
    let ctx = Ctx::new(&m, &u);
    if let Err(r) = running(&inner, &sid, &ctx) {
        return r;
    }
    match find_command(&inner, &sid, &session, &cmd) {
        Some(c) => axum::Json(json!({"output": c.output, "stdout": c.stdout, "stderr": c.stderr}))
            .into_response(),
        None => ctx.err(404, "PROCESS_NOT_FOUND", format!("command {cmd} not found")),
    }
}

// ---- files ------------------------------------------------------------------------------

#[derive(Deserialize)]
struct PathQuery {
    path: Option<String>,
    recursive: Option<bool>,
    mode: Option<String>,
}

/// `stat` of every entry of a directory (or of one path): size, raw mode, owner, group,
/// mtime, symbolic mode, name.
const STAT_FORMAT: &str = "%s/%f/%U/%G/%Y/%A/%n";
const LIST_SCRIPT: &str = "cd -- \"$1\" || exit 3; for f in * .[!.]* ..?*; do if [ -e \"$f\" ] || [ -L \"$f\" ]; then stat -c \"$2\" -- \"$f\"; fi; done";

fn file_info(line: &str, dir: Option<&str>) -> Option<Value> {
    let mut parts = line.splitn(7, '/');
    let size: i64 = parts.next()?.parse().ok()?;
    let raw = u32::from_str_radix(parts.next()?, 16).ok()?;
    let owner = parts.next()?;
    let group = parts.next()?;
    let mtime: i64 = parts.next()?.parse().ok()?;
    let symbolic = parts.next()?;
    let name = parts.next()?;
    let name = name.rsplit('/').next().unwrap_or(name);
    let is_dir = raw & 0o170000 == 0o040000;
    let t = chrono::DateTime::from_timestamp(mtime, 0)?;
    let mut v = json!({
        "name": name,
        "size": size,
        "isDir": is_dir,
        "mode": symbolic,
        "permissions": format!("{:04o}", raw & 0o777),
        "owner": owner,
        "group": group,
        "modTime": t.format("%Y-%m-%d %H:%M:%S +0000 UTC").to_string(),
        "modifiedAt": t.to_rfc3339(),
    });
    if let Some(d) = dir {
        v["path"] = json!(format!("{}/{name}", d.trim_end_matches('/')));
    }
    Some(v)
}

async fn files_list(
    State(inner): S,
    Path(sid): Path<String>,
    Query(q): Query<PathQuery>,
    m: Method,
    u: Uri,
) -> Response {
    let ctx = Ctx::new(&m, &u);
    let ip = match running(&inner, &sid, &ctx) {
        Ok(ip) => ip,
        Err(r) => return r,
    };
    let dir = absolute(q.path.as_deref().unwrap_or(""));
    let out = match pod::execute(
        &ip,
        &["/bin/sh", "-c", LIST_SCRIPT, "sh", &dir, STAT_FORMAT],
    )
    .await
    {
        Ok(o) => o,
        Err(e) => return ctx.pod(e),
    };
    if out.exit_code == 3 {
        return ctx.err(404, "FILE_NOT_FOUND", format!("directory {dir} not found"));
    }
    let list: Vec<Value> = String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| file_info(l, Some(&dir)))
        .collect();
    axum::Json(list).into_response()
}

async fn stat(ip: &str, path: &str) -> Result<Option<Value>, PodError> {
    let out = pod::execute(ip, &["stat", "-c", STAT_FORMAT, "--", path]).await?;
    if out.exit_code != 0 {
        return Ok(None);
    }
    Ok(String::from_utf8_lossy(&out.stdout)
        .lines()
        .next()
        .and_then(|l| file_info(l, None)))
}

async fn files_info(
    State(inner): S,
    Path(sid): Path<String>,
    Query(q): Query<PathQuery>,
    m: Method,
    u: Uri,
) -> Response {
    let ctx = Ctx::new(&m, &u);
    let ip = match running(&inner, &sid, &ctx) {
        Ok(ip) => ip,
        Err(r) => return r,
    };
    let Some(path) = q.path.filter(|p| !p.is_empty()) else {
        return ctx.err(400, "INVALID_FILE_PATH", "path is required");
    };
    let path = absolute(&path);
    match stat(&ip, &path).await {
        Ok(Some(mut v)) => {
            v["path"] = json!(path);
            axum::Json(v).into_response()
        }
        Ok(None) => ctx.err(404, "FILE_NOT_FOUND", format!("file {path} not found")),
        Err(e) => ctx.pod(e),
    }
}

/// A regular file's bytes, or the error to answer (a directory is 400).
async fn read_file(
    inner: &Inner,
    ip: &str,
    path: &str,
    ctx: &Ctx,
) -> Result<bytes::Bytes, Response> {
    let r = pod::read(&inner.http, ip, path)
        .await
        .map_err(|e| ctx.pod(e))?;
    let is_listing = r
        .headers()
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.starts_with("application/json"));
    if is_listing {
        return Err(ctx.err(400, "INVALID_FILE_PATH", format!("{path} is a directory")));
    }
    r.bytes()
        .await
        .map_err(|e| ctx.err(500, "FILE_READ_FAILED", e.to_string()))
}

async fn files_download(
    State(inner): S,
    Path(sid): Path<String>,
    Query(q): Query<PathQuery>,
    m: Method,
    u: Uri,
) -> Response {
    let ctx = Ctx::new(&m, &u);
    let ip = match running(&inner, &sid, &ctx) {
        Ok(ip) => ip,
        Err(r) => return r,
    };
    let Some(path) = q.path.filter(|p| !p.is_empty()) else {
        return ctx.err(400, "INVALID_FILE_PATH", "path is required");
    };
    match read_file(&inner, &ip, &absolute(&path), &ctx).await {
        Ok(b) => ([(header::CONTENT_TYPE, "application/octet-stream")], b).into_response(),
        Err(r) => r,
    }
}

async fn files_upload(
    State(inner): S,
    Path(sid): Path<String>,
    Query(q): Query<PathQuery>,
    m: Method,
    u: Uri,
    mut mp: Multipart,
) -> Response {
    let ctx = Ctx::new(&m, &u);
    let ip = match running(&inner, &sid, &ctx) {
        Ok(ip) => ip,
        Err(r) => return r,
    };
    let Some(path) = q.path.filter(|p| !p.is_empty()) else {
        return ctx.err(400, "INVALID_FILE_PATH", "path is required");
    };
    loop {
        match mp.next_field().await {
            Ok(Some(f)) if f.name() == Some("file") => {
                let data = match f.bytes().await {
                    Ok(d) => d,
                    Err(e) => return ctx.err(400, "BAD_REQUEST", e.to_string()),
                };
                return match pod::write(&inner.http, &ip, &absolute(&path), data).await {
                    Ok(()) => StatusCode::OK.into_response(),
                    Err(e) => ctx.pod(e),
                };
            }
            Ok(Some(_)) => {}
            Ok(None) => {
                return ctx.err(400, "BAD_REQUEST", "the multipart field `file` is missing");
            }
            Err(e) => return ctx.err(400, "BAD_REQUEST", e.to_string()),
        }
    }
}

async fn files_bulk_upload(
    State(inner): S,
    Path(sid): Path<String>,
    m: Method,
    u: Uri,
    mut mp: Multipart,
) -> Response {
    let ctx = Ctx::new(&m, &u);
    let ip = match running(&inner, &sid, &ctx) {
        Ok(ip) => ip,
        Err(r) => return r,
    };
    // `files[i].path` and `files[i].file`, in any order.
    let mut paths: HashMap<String, String> = HashMap::new();
    let mut datas: HashMap<String, bytes::Bytes> = HashMap::new();
    loop {
        match mp.next_field().await {
            Ok(Some(f)) => {
                let name = f.name().unwrap_or("").to_owned();
                let Some(rest) = name.strip_prefix("files[") else {
                    continue;
                };
                let Some((idx, field)) = rest.split_once("].") else {
                    return ctx.err(400, "BAD_REQUEST", format!("bad field {name}"));
                };
                let data = match f.bytes().await {
                    Ok(d) => d,
                    Err(e) => return ctx.err(400, "BAD_REQUEST", e.to_string()),
                };
                match field {
                    "path" => {
                        paths.insert(idx.to_owned(), String::from_utf8_lossy(&data).into_owned());
                    }
                    "file" => {
                        datas.insert(idx.to_owned(), data);
                    }
                    _ => return ctx.err(400, "BAD_REQUEST", format!("bad field {name}")),
                }
            }
            Ok(None) => break,
            Err(e) => return ctx.err(400, "BAD_REQUEST", e.to_string()),
        }
    }
    if paths.is_empty() {
        return ctx.err(400, "BAD_REQUEST", "no files");
    }
    let mut files = Vec::new();
    let mut errors = Vec::new();
    let mut keys: Vec<_> = paths.keys().cloned().collect();
    keys.sort();
    for k in keys {
        let path = absolute(&paths[&k]);
        let Some(data) = datas.remove(&k) else {
            errors.push(format!("{path}: no file part"));
            continue;
        };
        let n = data.len();
        match pod::write(&inner.http, &ip, &path, data).await {
            Ok(()) => files.push(json!({"path": path, "bytes": n})),
            Err(e) => errors.push(format!("{path}: {e}")),
        }
    }
    if !errors.is_empty() {
        return (
            StatusCode::BAD_REQUEST,
            axum::Json(json!({"files": files, "errors": errors})),
        )
            .into_response();
    }
    axum::Json(json!({"files": files})).into_response()
}

async fn files_bulk_download(
    State(inner): S,
    Path(sid): Path<String>,
    m: Method,
    u: Uri,
    body: axum::body::Bytes,
) -> Response {
    let ctx = Ctx::new(&m, &u);
    let ip = match running(&inner, &sid, &ctx) {
        Ok(ip) => ip,
        Err(r) => return r,
    };
    let v: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
    let Some(paths) = v["paths"].as_array() else {
        return ctx.err(400, "BAD_REQUEST", "paths is required");
    };
    let boundary = format!("daytona-testserver-{}", uuid::Uuid::new_v4().simple());
    let mut out = Vec::new();
    for p in paths {
        let Some(src) = p.as_str() else {
            return ctx.err(400, "BAD_REQUEST", "paths must be strings");
        };
        let escaped = src.replace('"', "%22");
        match read_file(&inner, &ip, &absolute(src), &ctx).await {
            Ok(data) => {
                out.extend_from_slice(
                    format!("--{boundary}\r\nContent-Disposition: form-data; name=\"file\"; filename=\"{escaped}\"\r\nContent-Type: application/octet-stream\r\n\r\n").as_bytes(),
                );
                out.extend_from_slice(&data);
                out.extend_from_slice(b"\r\n");
            }
            Err(r) => {
                let code = r.status().as_u16();
                let body = axum::body::to_bytes(r.into_body(), 1 << 20)
                    .await
                    .unwrap_or_default();
                let message = serde_json::from_slice::<Value>(&body)
                    .ok()
                    .and_then(|v| v["message"].as_str().map(str::to_owned))
                    .unwrap_or_default();
                let err = json!({"message": message, "statusCode": code, "code": if code == 404 {"FILE_NOT_FOUND"} else {"FILE_READ_FAILED"}});
                out.extend_from_slice(
                    format!("--{boundary}\r\nContent-Disposition: form-data; name=\"error\"; filename=\"{escaped}\"\r\nContent-Type: application/json\r\n\r\n{err}\r\n").as_bytes(),
                );
            }
        }
    }
    out.extend_from_slice(format!("--{boundary}--\r\n").as_bytes());
    (
        [(
            header::CONTENT_TYPE,
            format!("multipart/form-data; boundary={boundary}"),
        )],
        out,
    )
        .into_response()
}

async fn files_folder(
    State(inner): S,
    Path(sid): Path<String>,
    Query(q): Query<PathQuery>,
    m: Method,
    u: Uri,
) -> Response {
    let ctx = Ctx::new(&m, &u);
    let ip = match running(&inner, &sid, &ctx) {
        Ok(ip) => ip,
        Err(r) => return r,
    };
    let Some(path) = q.path.filter(|p| !p.is_empty()) else {
        return ctx.err(400, "INVALID_FILE_PATH", "path is required");
    };
    let mode = q.mode.unwrap_or_else(|| "0755".into());
    if mode.len() > 4 || !mode.bytes().all(|b| (b'0'..=b'7').contains(&b)) {
        return ctx.err(400, "BAD_REQUEST", format!("invalid mode {mode}"));
    }
    match pod::execute(&ip, &["mkdir", "-p", "-m", &mode, "--", &absolute(&path)]).await {
        Ok(o) if o.exit_code == 0 => StatusCode::CREATED.into_response(),
        Ok(o) => ctx.err(
            400,
            "BAD_REQUEST",
            String::from_utf8_lossy(&o.stderr).trim().to_owned(),
        ),
        Err(e) => ctx.pod(e),
    }
}

async fn files_delete(
    State(inner): S,
    Path(sid): Path<String>,
    Query(q): Query<PathQuery>,
    m: Method,
    u: Uri,
) -> Response {
    let ctx = Ctx::new(&m, &u);
    let ip = match running(&inner, &sid, &ctx) {
        Ok(ip) => ip,
        Err(r) => return r,
    };
    let Some(path) = q.path.filter(|p| !p.is_empty()) else {
        return ctx.err(400, "INVALID_FILE_PATH", "path is required");
    };
    match pod::delete(
        &inner.http,
        &ip,
        &absolute(&path),
        q.recursive.unwrap_or(false),
    )
    .await
    {
        Ok(()) => StatusCode::NO_CONTENT.into_response(),
        Err(e) => ctx.pod(e),
    }
}

#[derive(Deserialize)]
struct MoveQuery {
    source: Option<String>,
    destination: Option<String>,
}

async fn files_move(
    State(inner): S,
    Path(sid): Path<String>,
    Query(q): Query<MoveQuery>,
    m: Method,
    u: Uri,
) -> Response {
    let ctx = Ctx::new(&m, &u);
    let ip = match running(&inner, &sid, &ctx) {
        Ok(ip) => ip,
        Err(r) => return r,
    };
    let (Some(src), Some(dst)) = (
        q.source.filter(|s| !s.is_empty()),
        q.destination.filter(|s| !s.is_empty()),
    ) else {
        return ctx.err(
            400,
            "INVALID_FILE_PATH",
            "source and destination are required",
        );
    };
    let (src, dst) = (absolute(&src), absolute(&dst));
    match pod::execute(&ip, &["mv", "--", &src, &dst]).await {
        Ok(o) if o.exit_code == 0 => StatusCode::OK.into_response(),
        Ok(o) => {
            let msg = String::from_utf8_lossy(&o.stderr).trim().to_owned();
            if msg.contains("No such file") {
                ctx.err(404, "FILE_NOT_FOUND", msg)
            } else {
                ctx.err(400, "BAD_REQUEST", msg)
            }
        }
        Err(e) => ctx.pod(e),
    }
}
