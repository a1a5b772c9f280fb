//! envd: `/health`, `/files` and the Connect services `process.Process` and
//! `filesystem.Filesystem`, routed by the `E2b-Sandbox-Id` header (what the SDK sends with
//! `E2B_SANDBOX_URL`) or the Host `49983-<id>.<domain>`.

use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::extract::{FromRequest, Multipart, Request, State};
use axum::response::{IntoResponse, Response};
use base64::Engine as _;
use bytes::Bytes;
use e2b_envd_proto::filesystem as fs;
use e2b_envd_proto::process::{self as ep, process_event};
use http::{HeaderMap, HeaderValue, Method, StatusCode, header};
use prost::Message as _;
use serde_json::{Value, json};
use sha2::Digest as _;
use tokio::sync::{broadcast, mpsc};

use crate::connect::{self, Code, Codec, ConnectError, Kind};
use crate::json;
use crate::sandbox::{self, Sandbox, Shared, State as SbState, lock};

pub(crate) fn router(shared: Arc<Shared>) -> axum::Router {
    axum::Router::new().fallback(handle).with_state(shared)
}

/// envd's plain HTTP errors: `{"message","code"}`.
fn plain_error(status: u16, message: &str) -> Response {
    let code = StatusCode::from_u16(status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    (
        code,
        axum::Json(json!({"message": message, "code": status})),
    )
        .into_response()
}

fn not_found_502(id: &str) -> Response {
    plain_error(502, &format!("The sandbox {id} was not found"))
}

/// The sandbox a request is for.
fn sandbox_id(headers: &HeaderMap, domain: &str) -> Option<String> {
    if let Some(id) = headers.get("e2b-sandbox-id").and_then(|v| v.to_str().ok()) {
        return Some(id.to_owned());
    }
    let host = headers.get(header::HOST)?.to_str().ok()?;
    let host = host.split(':').next()?;
    let first = host.strip_suffix(&format!(".{domain}")).unwrap_or(host);
    let first = first.split('.').next()?;
    let (port, id) = first.split_once('-')?;
    (port == e2b_envd_proto::ENVD_PORT.to_string()).then(|| id.to_owned())
}

/// The user a request names (`username` query, else `Authorization: Basic user:`); `None` =
/// the default user.
fn user_of(query: &[(String, String)], headers: &HeaderMap) -> Option<String> {
    if let Some((_, u)) = query.iter().find(|(k, _)| k == "username")
        && !u.is_empty()
    {
        return Some(u.clone());
    }
    let auth = headers.get(header::AUTHORIZATION)?.to_str().ok()?;
    let b = auth.strip_prefix("Basic ")?;
    let raw = base64::engine::general_purpose::STANDARD
        .decode(b.trim())
        .ok()?;
    let s = String::from_utf8(raw).ok()?;
    let user = s.split(':').next().unwrap_or("");
    (!user.is_empty()).then(|| user.to_owned())
}

fn home_of(user: Option<&str>) -> &'static str {
    match user {
        Some("root") => "/root",
        _ => "/home/user",
    }
}

fn check_user(user: Option<&str>) -> Result<(), Response> {
    match user {
        None | Some("user") | Some("root") => Ok(()),
        Some(u) => Err(plain_error(
            401,
            &format!("invalid user: user '{u}' does not exist"),
        )),
    }
}

/// An absolute path: relative ones are under the user's home.
fn resolve(path: &str, user: Option<&str>) -> String {
    if path.starts_with('/') {
        path.to_owned()
    } else if let Some(rest) = path.strip_prefix("~/") {
        format!("{}/{rest}", home_of(user))
    } else if path.is_empty() || path == "~" {
        home_of(user).to_owned()
    } else {
        format!("{}/{path}", home_of(user))
    }
}

/// The file URL signature the SDK computes: `v1_` + unpadded base64 of
/// sha256(`path:operation:user:token[:expiration]`).
pub(crate) fn signature(
    path: &str,
    operation: &str,
    user: &str,
    token: &str,
    expiration: Option<i64>,
) -> String {
    let raw = match expiration {
        None => format!("{path}:{operation}:{user}:{token}"),
        Some(e) => format!("{path}:{operation}:{user}:{token}:{e}"),
    };
    let digest = sha2::Sha256::digest(raw.as_bytes());
    format!(
        "v1_{}",
        base64::engine::general_purpose::STANDARD_NO_PAD.encode(digest)
    )
}

async fn handle(State(shared): State<Arc<Shared>>, req: Request) -> Response {
    let method = req.method().clone();
    let path = req.uri().path().to_owned();
    let pq = req
        .uri()
        .path_and_query()
        .map(|p| p.as_str().to_owned())
        .unwrap_or_default();
    let query = crate::api::parse_form(req.uri().query().unwrap_or(""));
    let Some(id) = sandbox_id(req.headers(), &shared.domain) else {
        return plain_error(
            400,
            "no sandbox: send E2b-Sandbox-Id or Host 49983-<id>.<domain>",
        );
    };
    let Some(sb) = shared.get(&id) else {
        return not_found_502(&id);
    };
    if sb.state() == SbState::Paused {
        return plain_error(
            502,
            &format!("The sandbox {id} is paused and was not found running"),
        );
    }
    let token = lock(&sb.inner).envd_token.clone();
    let given = req
        .headers()
        .get("x-access-token")
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned);
    let token_ok = match &token {
        None => true,
        Some(t) => given.as_deref() == Some(t.as_str()),
    };
    let is_health = method == Method::GET && path == "/health";
    let is_files = path == "/files";
    if !token_ok && !is_health {
        let signed = is_files
            && token
                .as_deref()
                .is_some_and(|t| signed_ok(&method, &query, req.headers(), t));
        if !signed {
            return plain_error(
                401,
                "unauthorized access, please provide a valid access token or method signing if supported",
            );
        }
    }
    if let Some(resp) = crate::faults::apply(&shared.faults, method.as_str(), &pq).await {
        return resp;
    }
    let resp = match (&method, path.as_str()) {
        (&Method::GET, "/health") => StatusCode::NO_CONTENT.into_response(),
        (&Method::GET, "/files") => read_file(&sb, &query, req.headers()).await,
        (&Method::POST, "/files") => write_file(&sb, &query, req).await,
        (&Method::POST, p) if p.starts_with("/process.Process/") => {
            rpc(
                &shared,
                &sb,
                p.trim_start_matches("/process.Process/"),
                true,
                req,
            )
            .await
        }
        (&Method::POST, p) if p.starts_with("/filesystem.Filesystem/") => {
            rpc(
                &shared,
                &sb,
                p.trim_start_matches("/filesystem.Filesystem/"),
                false,
                req,
            )
            .await
        }
        _ => plain_error(404, &format!("no route for {method} {path}")),
    };
    // A sandboxd that cannot be reached because the container is gone: the proxy's 502.
    if (resp.status() == StatusCode::SERVICE_UNAVAILABLE
        || resp.status() == StatusCode::BAD_GATEWAY)
        && let Ok(None) = test_docker::inspect(&sb.container).await
    {
        return not_found_502(&id);
    }
    resp
}

fn signed_ok(
    method: &Method,
    query: &[(String, String)],
    headers: &HeaderMap,
    token: &str,
) -> bool {
    let get = |k: &str| query.iter().find(|(q, _)| q == k).map(|(_, v)| v.clone());
    let (Some(path), Some(sig)) = (get("path"), get("signature")) else {
        return false;
    };
    let op = if method == Method::GET {
        "read"
    } else {
        "write"
    };
    let user = user_of(query, headers).unwrap_or_default();
    let exp = match get("signature_expiration") {
        None => None,
        Some(e) => match e.parse::<i64>() {
            Ok(e) if e >= chrono::Utc::now().timestamp() => Some(e),
            _ => return false,
        },
    };
    signature(&path, op, &user, token, exp) == sig
}

/// sandboxd's REST path for an absolute path: one percent-encoded segment.
fn rest_path(abs: &str) -> String {
    let mut out = String::with_capacity(abs.len() * 3);
    for b in abs.bytes() {
        if b.is_ascii_alphanumeric() || b"-_~".contains(&b) {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

fn transport_error(e: &reqwest::Error) -> Response {
    plain_error(502, &format!("the sandbox could not be reached: {e}"))
}

async fn read_file(sb: &Sandbox, query: &[(String, String)], headers: &HeaderMap) -> Response {
    let user = user_of(query, headers);
    if let Err(r) = check_user(user.as_deref()) {
        return r;
    }
    let Some((_, p)) = query.iter().find(|(k, _)| k == "path") else {
        return plain_error(400, "path is required");
    };
    let abs = resolve(p, user.as_deref());
    let url = format!("{}/v1/files/{}", sb.rest_url(), rest_path(&abs));
    let r = match sb.http.get(&url).send().await {
        Ok(r) => r,
        Err(e) => return transport_error(&e),
    };
    let status = r.status();
    let is_json = r
        .headers()
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|c| c.starts_with("application/json"));
    if status == StatusCode::NOT_FOUND {
        return plain_error(404, &format!("path '{abs}' does not exist"));
    }
    if status == StatusCode::FORBIDDEN {
        return plain_error(401, &format!("permission denied for '{abs}'"));
    }
    if !status.is_success() {
        return plain_error(500, &format!("reading '{abs}': sandboxd answered {status}"));
    }
    if is_json {
        return plain_error(400, &format!("path '{abs}' is a directory"));
    }
    let bytes = match r.bytes().await {
        Ok(b) => b,
        Err(e) => return transport_error(&e),
    };
    let mut resp = Response::new(Body::from(bytes));
    resp.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/octet-stream"),
    );
    resp
}

async fn put_file(sb: &Sandbox, abs: &str, data: Bytes) -> Result<(), Response> {
    let url = format!("{}/v1/files/{}", sb.rest_url(), rest_path(abs));
    let r = sb
        .http
        .put(&url)
        .body(data)
        .send()
        .await
        .map_err(|e| transport_error(&e))?;
    match r.status() {
        s if s.is_success() => Ok(()),
        StatusCode::BAD_REQUEST => Err(plain_error(400, &format!("path '{abs}' is a directory"))),
        StatusCode::FORBIDDEN => Err(plain_error(401, &format!("permission denied for '{abs}'"))),
        s => Err(plain_error(
            500,
            &format!("writing '{abs}': sandboxd answered {s}"),
        )),
    }
}

fn write_info(abs: &str) -> Value {
    let name = abs.rsplit('/').next().unwrap_or(abs);
    json!({"path": abs, "name": name, "type": "file"})
}

async fn write_file(sb: &Sandbox, query: &[(String, String)], req: Request) -> Response {
    let user = user_of(query, req.headers());
    if let Err(r) = check_user(user.as_deref()) {
        return r;
    }
    let qpath = query
        .iter()
        .find(|(k, _)| k == "path")
        .map(|(_, v)| v.clone());
    let ct = req
        .headers()
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("")
        .to_ascii_lowercase();
    if req
        .headers()
        .get(header::CONTENT_ENCODING)
        .is_some_and(|v| v.as_bytes() != b"identity")
    {
        return plain_error(400, "Content-Encoding is not supported by the test server");
    }
    if ct.starts_with("application/octet-stream") {
        let Some(p) = qpath else {
            return plain_error(
                400,
                "path is required for an application/octet-stream upload",
            );
        };
        let abs = resolve(&p, user.as_deref());
        let data = match axum::body::to_bytes(req.into_body(), 1 << 30).await {
            Ok(b) => b,
            Err(e) => return plain_error(400, &format!("reading the body: {e}")),
        };
        if let Err(r) = put_file(sb, &abs, data).await {
            return r;
        }
        return axum::Json(json!([write_info(&abs)])).into_response();
    }
    if !ct.starts_with("multipart/form-data") {
        return plain_error(
            400,
            "expected multipart/form-data or application/octet-stream",
        );
    }
    let mut mp = match Multipart::from_request(req, &()).await {
        Ok(m) => m,
        Err(e) => return plain_error(400, &format!("invalid multipart body: {e}")),
    };
    let mut files: Vec<(Option<String>, Bytes)> = Vec::new();
    loop {
        match mp.next_field().await {
            Ok(Some(f)) => {
                if f.name() != Some("file") {
                    continue;
                }
                let name = f.file_name().map(str::to_owned);
                match f.bytes().await {
                    Ok(b) => files.push((name, b)),
                    Err(e) => return plain_error(400, &format!("invalid multipart body: {e}")),
                }
            }
            Ok(None) => break,
            Err(e) => return plain_error(400, &format!("invalid multipart body: {e}")),
        }
    }
    if files.is_empty() {
        return plain_error(400, "no `file` part in the body");
    }
    let single = files.len() == 1;
    let mut out = Vec::new();
    for (name, data) in files {
        let dest = match (&qpath, name) {
            (Some(p), _) if single => p.clone(),
            (_, Some(n)) if !n.is_empty() => n,
            (Some(p), _) => p.clone(),
            _ => return plain_error(400, "a file part has no filename and there is no path"),
        };
        let abs = resolve(&dest, user.as_deref());
        if let Err(r) = put_file(sb, &abs, data).await {
            return r;
        }
        out.push(write_info(&abs));
    }
    axum::Json(Value::Array(out)).into_response()
}

fn decode<M: prost::Message + Default>(
    codec: Codec,
    payload: &[u8],
    from_json: fn(&[u8]) -> Result<M, String>,
) -> Result<M, ConnectError> {
    match codec {
        Codec::Json => from_json(payload).map_err(|e| ConnectError::new(Code::InvalidArgument, e)),
        Codec::Proto => M::decode(payload)
            .map_err(|e| ConnectError::new(Code::InvalidArgument, format!("invalid message: {e}"))),
    }
}

async fn rpc(
    shared: &Arc<Shared>,
    sb: &Arc<Sandbox>,
    method: &str,
    process: bool,
    req: Request,
) -> Response {
    let ct = req
        .headers()
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("")
        .to_owned();
    let Some(kind) = connect::Kind::from_content_type(&ct) else {
        return (
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
            format!("unsupported content type `{ct}`"),
        )
            .into_response();
    };
    let headers = req.headers().clone();
    let body = match axum::body::to_bytes(req.into_body(), 16 << 20).await {
        Ok(b) => b,
        Err(e) => {
            return ConnectError::new(Code::InvalidArgument, format!("reading the body: {e}"))
                .unary();
        }
    };
    let streaming_method = process && matches!(method, "Start" | "Connect");
    if streaming_method != kind.streaming {
        let e = ConnectError::new(
            Code::InvalidArgument,
            format!(
                "{method} takes content type {}",
                if streaming_method {
                    "application/connect+json or +proto"
                } else {
                    "application/json or application/proto"
                }
            ),
        );
        return if kind.streaming {
            connect::stream_error(kind, &e)
        } else {
            e.unary()
        };
    }
    let user = user_of(&[], &headers);
    if let Some(u) = &user
        && !matches!(u.as_str(), "user" | "root")
    {
        let e = ConnectError::new(
            Code::Unauthenticated,
            format!("invalid user: user '{u}' does not exist"),
        );
        return if kind.streaming {
            connect::stream_error(kind, &e)
        } else {
            e.unary()
        };
    }
    if kind.streaming {
        let payload = match connect::stream_request(&body) {
            Ok(p) => p,
            Err(e) => return connect::stream_error(kind, &e),
        };
        let result = match method {
            "Start" => start(shared, sb, kind, &payload, &headers).await,
            _ => connect_proc(sb, kind, &payload, &headers).await,
        };
        return match result {
            Ok(r) => r,
            Err(e) if container_gone(sb, &e).await => not_found_502(&sb.id),
            Err(e) => connect::stream_error(kind, &e),
        };
    }
    let r = if process {
        process_unary(sb, kind, method, &body).await
    } else {
        fs_unary(sb, kind, method, &body, user.as_deref()).await
    };
    match r {
        Ok(r) => r,
        Err(e) if container_gone(sb, &e).await => not_found_502(&sb.id),
        Err(e) => e.unary(),
    }
}

/// sandboxd could not be reached because the container is gone (removed behind the API's
/// back): the proxy's 502 "… was not found" is the answer then.
async fn container_gone(sb: &Sandbox, e: &ConnectError) -> bool {
    matches!(e.code, Code::Unavailable | Code::Unknown | Code::Internal)
        && matches!(test_docker::inspect(&sb.container).await, Ok(None))
}

/// Feed a process's events to a stream body, with keep-alives, the call's deadline and the
/// cut-stream fault.
struct StreamOpts {
    kind: Kind,
    first: Option<ep::ProcessEvent>,
    deadline: Option<Duration>,
    keepalive: Duration,
    cut_after: Option<usize>,
    connect_response: bool,
}

fn event_stream(
    sb: Arc<Sandbox>,
    proc: Arc<sandbox::Proc>,
    mut rx: broadcast::Receiver<ep::ProcessEvent>,
    o: StreamOpts,
) -> Response {
    let StreamOpts {
        kind,
        first,
        deadline,
        keepalive,
        cut_after,
        connect_response,
    } = o;
    let (tx, out) = mpsc::channel::<Result<Bytes, std::io::Error>>(64);
    let envelope = move |ev: &ep::ProcessEvent| {
        let json = json::process_event(ev);
        if connect_response {
            connect::message_envelope(
                kind.codec,
                &ep::ConnectResponse {
                    event: Some(ev.clone()),
                },
                json,
            )
        } else {
            connect::message_envelope(
                kind.codec,
                &ep::StartResponse {
                    event: Some(ev.clone()),
                },
                json,
            )
        }
    };
    tokio::spawn(async move {
        let until = deadline.map(|d| tokio::time::Instant::now() + d);
        let mut outputs = 0usize;
        if let Some(ev) = first
            && tx.send(Ok(envelope(&ev))).await.is_err()
        {
            return;
        }
        loop {
            let sleep_deadline = async {
                match until {
                    Some(u) => tokio::time::sleep_until(u).await,
                    None => std::future::pending().await,
                }
            };
            tokio::select! {
                ev = rx.recv() => match ev {
                    Ok(ev) => {
                        let is_end = matches!(ev.event, Some(process_event::Event::End(_)));
                        let is_data = matches!(ev.event, Some(process_event::Event::Data(_)));
                        if tx.send(Ok(envelope(&ev))).await.is_err() {
                            return;
                        }
                        if is_data {
                            outputs += 1;
                            if cut_after.is_some_and(|n| outputs >= n) {
                                // Let the last output reach the client, then break off.
                                tokio::time::sleep(Duration::from_millis(200)).await;
                                let _ = tx.send(Err(std::io::Error::other("connection cut (injected fault)"))).await;
                                return;
                            }
                        }
                        if is_end {
                            let _ = tx.send(Ok(connect::end_envelope(None))).await;
                            return;
                        }
                    }
                    Err(broadcast::error::RecvError::Lagged(_)) => {}
                    Err(broadcast::error::RecvError::Closed) => {
                        let e = ConnectError::new(Code::Unavailable, "the process's event stream ended");
                        let _ = tx.send(Ok(connect::end_envelope(Some(&e)))).await;
                        return;
                    }
                },
                _ = tokio::time::sleep(keepalive) => {
                    let ka = ep::ProcessEvent { event: Some(process_event::Event::Keepalive(process_event::KeepAlive {})) };
                    if tx.send(Ok(envelope(&ka))).await.is_err() {
                        return;
                    }
                }
                _ = sleep_deadline => {
                    // The call's deadline: like envd, the process is killed with its stream.
                    let _ = sandbox::signal_process(&sb, &proc, ep::Signal::Sigkill).await;
                    let e = ConnectError::new(Code::DeadlineExceeded, "the operation timed out");
                    let _ = tx.send(Ok(connect::end_envelope(Some(&e)))).await;
                    return;
                }
            }
        }
    });
    let body = Body::from_stream(tokio_stream::wrappers::ReceiverStream::new(out));
    connect::stream_response(kind, body)
}

fn keepalive_of(headers: &HeaderMap) -> Duration {
    headers
        .get("keepalive-ping-interval")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok())
        .filter(|s| *s > 0)
        .map(Duration::from_secs)
        .unwrap_or(Duration::from_secs(50))
}

async fn start(
    shared: &Arc<Shared>,
    sb: &Arc<Sandbox>,
    kind: Kind,
    payload: &[u8],
    headers: &HeaderMap,
) -> Result<Response, ConnectError> {
    let req: ep::StartRequest = decode(kind.codec, payload, json::start_request)?;
    if req.pty.is_some() {
        return Err(ConnectError::new(
            Code::Unimplemented,
            "PTYs are not supported by the test server",
        ));
    }
    match &req.process {
        Some(p) if !p.cmd.is_empty() => {}
        _ => {
            return Err(ConnectError::new(
                Code::InvalidArgument,
                "process.cmd is required",
            ));
        }
    }
    let (proc, rx) = sandbox::start_process(sb, req)
        .await
        .map_err(|sandbox::StartError::Status(s)| ConnectError::from_status(&s))?;
    let cut = shared.faults.take_cut();
    Ok(event_stream(
        sb.clone(),
        proc,
        rx,
        StreamOpts {
            kind,
            first: None,
            deadline: connect::timeout(headers),
            keepalive: keepalive_of(headers),
            cut_after: cut,
            connect_response: false,
        },
    ))
}

fn proc_not_found(sel: Option<&ep::ProcessSelector>) -> ConnectError {
    use ep::process_selector::Selector;
    let what = match sel.and_then(|s| s.selector.as_ref()) {
        Some(Selector::Pid(p)) => format!("process with pid {p} not found"),
        Some(Selector::Tag(t)) => format!("process with tag {t} not found"),
        None => return ConnectError::new(Code::InvalidArgument, "process selector is required"),
    };
    ConnectError::new(Code::NotFound, what)
}

async fn connect_proc(
    sb: &Arc<Sandbox>,
    kind: Kind,
    payload: &[u8],
    headers: &HeaderMap,
) -> Result<Response, ConnectError> {
    let req: ep::ConnectRequest = decode(kind.codec, payload, json::connect_request)?;
    let proc = sandbox::find_proc(sb, req.process.as_ref())
        .ok_or_else(|| proc_not_found(req.process.as_ref()))?;
    let rx = proc.events.subscribe();
    let first = ep::ProcessEvent {
        event: Some(process_event::Event::Start(process_event::StartEvent {
            pid: proc.pid,
        })),
    };
    Ok(event_stream(
        sb.clone(),
        proc,
        rx,
        StreamOpts {
            kind,
            first: Some(first),
            deadline: connect::timeout(headers),
            keepalive: keepalive_of(headers),
            cut_after: None,
            connect_response: true,
        },
    ))
}

async fn process_unary(
    sb: &Arc<Sandbox>,
    kind: Kind,
    method: &str,
    body: &[u8],
) -> Result<Response, ConnectError> {
    match method {
        "List" => {
            let procs: Vec<ep::ProcessInfo> = {
                let mut v: Vec<ep::ProcessInfo> = lock(&sb.procs)
                    .values()
                    .map(|p| ep::ProcessInfo {
                        config: Some(p.config.clone()),
                        pid: p.pid,
                        tag: p.tag.clone(),
                    })
                    .collect();
                v.sort_by_key(|p| p.pid);
                v
            };
            let msg = ep::ListResponse { processes: procs };
            let j = json::list_response(&msg);
            Ok(connect::unary_ok(kind, &msg, j))
        }
        "SendSignal" => {
            let req: ep::SendSignalRequest = decode(kind.codec, body, json::send_signal_request)?;
            let sig = ep::Signal::try_from(req.signal)
                .ok()
                .filter(|s| *s != ep::Signal::Unspecified)
                .ok_or_else(|| ConnectError::new(Code::InvalidArgument, "unsupported signal"))?;
            let proc = sandbox::find_proc(sb, req.process.as_ref())
                .ok_or_else(|| proc_not_found(req.process.as_ref()))?;
            sandbox::signal_process(sb, &proc, sig)
                .await
                .map_err(|s| ConnectError::from_status(&s))?;
            Ok(connect::unary_ok(
                kind,
                &ep::SendSignalResponse {},
                json!({}),
            ))
        }
        "SendInput" => {
            let req: ep::SendInputRequest = decode(kind.codec, body, json::send_input_request)?;
            let proc = sandbox::find_proc(sb, req.process.as_ref())
                .ok_or_else(|| proc_not_found(req.process.as_ref()))?;
            let data = match req.input.and_then(|i| i.input) {
                Some(ep::process_input::Input::Stdin(b)) => b,
                Some(ep::process_input::Input::Pty(_)) => {
                    return Err(ConnectError::new(
                        Code::Unimplemented,
                        "PTYs are not supported by the test server",
                    ));
                }
                None => {
                    return Err(ConnectError::new(
                        Code::InvalidArgument,
                        "input is required",
                    ));
                }
            };
            write_stdin(
                sb,
                proc.pid,
                sandboxd_proto::write_stdin_request::Payload::Input(data),
            )
            .await?;
            Ok(connect::unary_ok(
                kind,
                &ep::SendInputResponse {},
                json!({}),
            ))
        }
        "CloseStdin" => {
            let req: ep::CloseStdinRequest = decode(kind.codec, body, json::close_stdin_request)?;
            let proc = sandbox::find_proc(sb, req.process.as_ref())
                .ok_or_else(|| proc_not_found(req.process.as_ref()))?;
            write_stdin(
                sb,
                proc.pid,
                sandboxd_proto::write_stdin_request::Payload::Eof(()),
            )
            .await?;
            Ok(connect::unary_ok(
                kind,
                &ep::CloseStdinResponse {},
                json!({}),
            ))
        }
        other => Err(ConnectError::new(
            Code::Unimplemented,
            format!("process.Process/{other} is not implemented by the test server"),
        )),
    }
}

async fn write_stdin(
    sb: &Sandbox,
    pid: u32,
    payload: sandboxd_proto::write_stdin_request::Payload,
) -> Result<(), ConnectError> {
    sb.client()
        .write_stdin(sandboxd_proto::WriteStdinRequest {
            process_id: pid as i32,
            payload: Some(payload),
        })
        .await
        .map(drop)
        .map_err(|s| ConnectError::from_status(&s))
}

/// `find -printf` of one entry: type, target type, size, octal mode, `ls` mode, owner,
/// group, mtime, link target, path (NUL-terminated).
const ENTRY_FMT: &str = r"%y\t%Y\t%s\t%m\t%M\t%u\t%g\t%T@\t%l\t%p\0";

fn parse_entries(out: &[u8]) -> Vec<fs::EntryInfo> {
    out.split(|b| *b == 0)
        .filter(|r| !r.is_empty())
        .filter_map(|r| {
            let s = String::from_utf8_lossy(r);
            let f: Vec<&str> = s.splitn(10, '\t').collect();
            if f.len() != 10 {
                return None;
            }
            let is_symlink = f[0] == "l";
            let ty = match if is_symlink { f[1] } else { f[0] } {
                "d" => fs::FileType::Directory,
                "f" => fs::FileType::File,
                "l" | "N" | "L" => fs::FileType::Symlink,
                _ => fs::FileType::Unspecified,
            };
            let perm = u32::from_str_radix(f[3], 8).unwrap_or(0);
            let mode = if ty == fs::FileType::Directory {
                perm | (1 << 31)
            } else {
                perm
            };
            let (secs, frac) = f[7].split_once('.').unwrap_or((f[7], "0"));
            let nanos: String = frac.chars().chain(std::iter::repeat('0')).take(9).collect();
            let path = f[9].to_owned();
            let name = path.rsplit('/').next().unwrap_or(&path).to_owned();
            Some(fs::EntryInfo {
                name,
                r#type: ty as i32,
                path,
                size: f[2].parse().unwrap_or(0),
                mode,
                permissions: f[4].to_owned(),
                owner: f[5].to_owned(),
                group: f[6].to_owned(),
                modified_time: Some(fs::Timestamp {
                    seconds: secs.parse().unwrap_or(0),
                    nanos: nanos.parse().unwrap_or(0),
                }),
                symlink_target: is_symlink.then(|| f[8].to_owned()),
                metadata: Default::default(),
                is_symlink,
            })
        })
        .collect()
}

/// Run a filesystem script; maps its exit codes 3 (missing), 4 (not a directory), 5
/// (exists) to Connect errors.
async fn fs_sh(
    sb: &Sandbox,
    script: &str,
    args: &[&str],
    what: &str,
) -> Result<Vec<fs::EntryInfo>, ConnectError> {
    let full = format!("st() {{ find \"$1\" -maxdepth 0 -printf '{ENTRY_FMT}'; }}\n{script}");
    let (code, out, err) = sandbox::sh(sb, &full, args)
        .await
        .map_err(|s| ConnectError::from_status(&s))?;
    match code {
        0 => Ok(parse_entries(&out)),
        3 => Err(ConnectError::new(
            Code::NotFound,
            format!("path '{what}' does not exist"),
        )),
        4 => Err(ConnectError::new(
            Code::InvalidArgument,
            format!("path '{what}' is not a directory"),
        )),
        5 => Err(ConnectError::new(
            Code::AlreadyExists,
            format!("path '{what}' already exists"),
        )),
        _ => Err(ConnectError::new(
            Code::Internal,
            format!("{what}: {}", String::from_utf8_lossy(&err).trim()),
        )),
    }
}

async fn fs_unary(
    sb: &Arc<Sandbox>,
    kind: Kind,
    method: &str,
    body: &[u8],
    user: Option<&str>,
) -> Result<Response, ConnectError> {
    let path_req = |body: &[u8]| -> Result<String, ConnectError> {
        match kind.codec {
            Codec::Json => {
                json::path_request(body).map_err(|e| ConnectError::new(Code::InvalidArgument, e))
            }
            Codec::Proto => {
                // Stat, MakeDir and Remove requests are all `string path = 1`.
                fs::StatRequest::decode(body).map(|r| r.path).map_err(|e| {
                    ConnectError::new(Code::InvalidArgument, format!("invalid message: {e}"))
                })
            }
        }
    };
    match method {
        "Stat" => {
            let p = resolve(&path_req(body)?, user);
            let e = fs_sh(
                sb,
                "[ -e \"$1\" ] || [ -L \"$1\" ] || exit 3; st \"$1\"",
                &[&p],
                &p,
            )
            .await?;
            let msg = fs::StatResponse {
                entry: e.into_iter().next(),
            };
            let j = json::entry_response(msg.entry.as_ref());
            Ok(connect::unary_ok(kind, &msg, j))
        }
        "MakeDir" => {
            let p = resolve(&path_req(body)?, user);
            let e = fs_sh(
                sb,
                "if [ -e \"$1\" ] || [ -L \"$1\" ]; then exit 5; fi; mkdir -p -- \"$1\" && st \"$1\"",
                &[&p],
                &p,
            )
            .await?;
            let msg = fs::MakeDirResponse {
                entry: e.into_iter().next(),
            };
            let j = json::entry_response(msg.entry.as_ref());
            Ok(connect::unary_ok(kind, &msg, j))
        }
        "Remove" => {
            let p = resolve(&path_req(body)?, user);
            fs_sh(
                sb,
                "[ -e \"$1\" ] || [ -L \"$1\" ] || exit 3; rm -rf -- \"$1\"",
                &[&p],
                &p,
            )
            .await?;
            Ok(connect::unary_ok(kind, &fs::RemoveResponse {}, json!({})))
        }
        "Move" => {
            let req: fs::MoveRequest = decode(kind.codec, body, json::move_request)?;
            let src = resolve(&req.source, user);
            let dst = resolve(&req.destination, user);
            let e = fs_sh(
                sb,
                "[ -e \"$1\" ] || [ -L \"$1\" ] || exit 3; mkdir -p -- \"$(dirname -- \"$2\")\" && mv -- \"$1\" \"$2\" && st \"$2\"",
                &[&src, &dst],
                &src,
            )
            .await?;
            let msg = fs::MoveResponse {
                entry: e.into_iter().next(),
            };
            let j = json::entry_response(msg.entry.as_ref());
            Ok(connect::unary_ok(kind, &msg, j))
        }
        "ListDir" => {
            let req: fs::ListDirRequest = decode(kind.codec, body, json::list_dir_request)?;
            let p = resolve(&req.path, user);
            let depth = req.depth.max(1).to_string();
            let entries = fs_sh(
                sb,
                &format!("[ -e \"$1\" ] || exit 3; [ -d \"$1\" ] || exit 4; find \"$1\" -mindepth 1 -maxdepth \"$2\" -printf '{ENTRY_FMT}'"),
                &[&p, &depth],
                &p,
            )
            .await?;
            let msg = fs::ListDirResponse { entries };
            let j = json::list_dir_response(&msg.entries);
            Ok(connect::unary_ok(kind, &msg, j))
        }
        other => Err(ConnectError::new(
            Code::Unimplemented,
            format!("filesystem.Filesystem/{other} is not implemented by the test server"),
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn signature_matches_the_sdk_rule() {
        // sha256("/a:read::tok") in unpadded base64, prefixed v1_.
        let s = signature("/a", "read", "", "tok", None);
        assert!(s.starts_with("v1_") && !s.ends_with('='));
        assert_ne!(s, signature("/a", "write", "", "tok", None));
        assert_ne!(s, signature("/a", "read", "", "tok", Some(1)));
    }

    #[test]
    fn routing_by_header_or_host() {
        let mut h = HeaderMap::new();
        h.insert(
            header::HOST,
            HeaderValue::from_static("49983-abc123.e2b.test"),
        );
        assert_eq!(sandbox_id(&h, "e2b.test").as_deref(), Some("abc123"));
        h.insert("e2b-sandbox-id", HeaderValue::from_static("xyz"));
        assert_eq!(sandbox_id(&h, "e2b.test").as_deref(), Some("xyz"));
        let mut h = HeaderMap::new();
        h.insert(header::HOST, HeaderValue::from_static("127.0.0.1:5000"));
        assert_eq!(sandbox_id(&h, "e2b.test"), None);
    }

    #[test]
    fn relative_paths_are_under_the_home() {
        assert_eq!(resolve("a/b", None), "/home/user/a/b");
        assert_eq!(resolve("/etc/x", None), "/etc/x");
        assert_eq!(resolve("x", Some("root")), "/root/x");
    }

    #[test]
    fn find_output_is_parsed() {
        let out = b"f\tf\t3\t644\t-rw-r--r--\troot\troot\t1700000000.5\t\t/home/user/a.txt\0d\td\t4096\t755\tdrwxr-xr-x\troot\troot\t1700000001.0000000000\t\t/home/user/d\0";
        let e = parse_entries(out);
        assert_eq!(e.len(), 2);
        assert_eq!(e[0].name, "a.txt");
        assert_eq!(e[0].size, 3);
        assert_eq!(e[0].r#type, fs::FileType::File as i32);
        assert_eq!(e[0].modified_time.unwrap().nanos, 500_000_000);
        assert_eq!(e[1].r#type, fs::FileType::Directory as i32);
        assert_eq!(e[1].mode & 0o777, 0o755);
    }
}
