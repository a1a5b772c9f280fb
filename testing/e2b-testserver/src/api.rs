//! The control plane: `/sandboxes`, `/v2/sandboxes`, `/snapshots`, `/templates/{id}`.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use axum::extract::{Request, State};
use axum::response::{IntoResponse, Response};
use base64::Engine as _;
use chrono::{SecondsFormat, Utc};
use http::{HeaderValue, Method, StatusCode};
use serde_json::{Value, json};

use crate::sandbox::{NewSandbox, Sandbox, Shared, Snapshot, State as SbState, lock};

/// E2B's default sandbox timeout (seconds) when the body has none.
const DEFAULT_TIMEOUT_SECS: u64 = 15;
/// E2B's longest timeout (the Pro tier's 24 h).
const MAX_TIMEOUT_SECS: u64 = 86_400;

pub(crate) fn router(shared: Arc<Shared>) -> axum::Router {
    axum::Router::new().fallback(handle).with_state(shared)
}

/// An error answer `{"code","message"}`.
pub(crate) fn error(status: u16, message: &str) -> Response {
    let code = StatusCode::from_u16(status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    (
        code,
        axum::Json(json!({"code": status, "message": message})),
    )
        .into_response()
}

fn ok_json(status: StatusCode, v: Value) -> Response {
    (status, axum::Json(v)).into_response()
}

fn no_content() -> Response {
    StatusCode::NO_CONTENT.into_response()
}

fn ts(t: chrono::DateTime<Utc>) -> String {
    t.to_rfc3339_opts(SecondsFormat::Millis, true)
}

async fn handle(State(shared): State<Arc<Shared>>, req: Request) -> Response {
    let method = req.method().clone();
    let pq = req
        .uri()
        .path_and_query()
        .map(|p| p.as_str().to_owned())
        .unwrap_or_default();
    // Auth first, as the real API does.
    let key_ok = req
        .headers()
        .get("x-api-key")
        .and_then(|v| v.to_str().ok())
        .is_some_and(|k| k == shared.api_key);
    if !key_ok {
        return error(
            401,
            "Invalid API key, please visit https://e2b.dev/docs/quickstart/api-key to get your API key.",
        );
    }
    if !pq.starts_with("/e2b-testserver/")
        && let Some(resp) = crate::faults::apply(&shared.faults, method.as_str(), &pq).await
    {
        return resp;
    }
    let path = req.uri().path().to_owned();
    let query = req.uri().query().unwrap_or("").to_owned();
    let body = match axum::body::to_bytes(req.into_body(), 16 << 20).await {
        Ok(b) => b,
        Err(e) => return error(400, &format!("reading the body: {e}")),
    };
    let parts: Vec<&str> = path.trim_matches('/').split('/').collect();
    let body_json = || -> Result<Value, Response> {
        if body.is_empty() {
            return Ok(json!({}));
        }
        serde_json::from_slice(&body).map_err(|e| error(400, &format!("invalid JSON body: {e}")))
    };
    macro_rules! body {
        () => {
            match body_json() {
                Ok(v) => v,
                Err(r) => return r,
            }
        };
    }
    match (&method, parts.as_slice()) {
        (&Method::POST, ["sandboxes"]) => create(&shared, body!(), false).await,
        (&Method::POST, ["v2", "sandboxes"]) => create(&shared, body!(), true).await,
        (&Method::GET, ["sandboxes"]) => list_v1(&shared, &query),
        (&Method::GET, ["v2", "sandboxes"]) => list_v2(&shared, &query),
        (&Method::GET, ["sandboxes", id]) => match shared.get(id) {
            Some(sb) => ok_json(StatusCode::OK, detail(&shared, &sb)),
            None => not_found(id),
        },
        (&Method::DELETE, ["sandboxes", id]) => {
            if shared.kill(id).await {
                no_content()
            } else {
                not_found(id)
            }
        }
        (&Method::POST, ["sandboxes", id, "timeout"]) => {
            let b = body!();
            let Some(t) = b["timeout"].as_u64() else {
                return error(400, "timeout is required and must be an integer >= 0");
            };
            let Some(sb) = shared.get(id) else {
                return not_found(id);
            };
            let mut inner = lock(&sb.inner);
            inner.timeout = Duration::from_secs(t.min(MAX_TIMEOUT_SECS));
            inner.end_at = Utc::now() + inner.timeout;
            no_content()
        }
        (&Method::POST, ["sandboxes", id, "refreshes"]) => {
            let b = body!();
            let d = b["duration"].as_u64().unwrap_or(DEFAULT_TIMEOUT_SECS);
            if d > 3600 {
                return error(400, "duration must be between 0 and 3600 seconds");
            }
            let Some(sb) = shared.get(id) else {
                return not_found(id);
            };
            let mut inner = lock(&sb.inner);
            let new_end = Utc::now() + Duration::from_secs(d);
            if new_end > inner.end_at {
                inner.end_at = new_end;
            }
            no_content()
        }
        (&Method::POST, ["sandboxes", id, "pause"]) => pause(&shared, id).await,
        (&Method::POST, ["sandboxes", id, "connect"])
        | (&Method::POST, ["v2", "sandboxes", id, "connect"]) => {
            connect(&shared, id, body!(), false).await
        }
        (&Method::POST, ["sandboxes", id, "resume"]) => connect(&shared, id, body!(), true).await,
        (&Method::POST, ["sandboxes", id, "snapshots"]) => snapshot(&shared, id, body!()).await,
        (&Method::GET, ["snapshots"]) => list_snapshots(&shared, &query),
        (&Method::DELETE, ["templates", id]) => delete_snapshot(&shared, id).await,
        (&Method::POST, ["e2b-testserver", "v1", "faults"]) => {
            faults_endpoint(&shared, body!()).await
        }
        _ => error(404, &format!("no route for {method} {path}")),
    }
}

/// The test-only fault endpoint (same auth as the API), for clients outside the process.
async fn faults_endpoint(shared: &Arc<Shared>, b: Value) -> Response {
    let s = |k: &str| b[k].as_str().unwrap_or("").to_owned();
    let n = |k: &str, d: u64| b[k].as_u64().unwrap_or(d);
    let f = &shared.faults;
    match b["action"].as_str().unwrap_or("") {
        "fail_next" => {
            let status = n("status", 503);
            if !(400..=599).contains(&status) {
                return error(400, "status must be 400..599");
            }
            f.fail_next(
                &s("method"),
                &s("path"),
                status as u16,
                n("count", 1) as usize,
            );
        }
        "rate_limit_next" => f.rate_limit_next(
            &s("method"),
            &s("path"),
            Duration::from_millis(n("retry_after_ms", 1000)),
            n("count", 1) as usize,
        ),
        "delay" => f.delay(
            &s("method"),
            &s("path"),
            Duration::from_millis(n("millis", 0)),
        ),
        "cut_next_start_stream" => f.cut_next_start_stream(n("after_outputs", 1) as usize),
        "clear" => f.clear(),
        "disappear" => {
            if let Err(e) = shared.disappear(&s("sandboxID")).await {
                return error(404, &e.to_string());
            }
        }
        "rotate_envd_token" => {
            return match shared.rotate_envd_token(&s("sandboxID")) {
                Ok(t) => ok_json(StatusCode::OK, json!({"envdAccessToken": t})),
                Err(e) => error(404, &e.to_string()),
            };
        }
        other => return error(400, &format!("unknown fault action `{other}`")),
    }
    no_content()
}

fn not_found(id: &str) -> Response {
    error(
        404,
        &format!("sandbox \"{id}\" doesn't exist or you don't have access to it"),
    )
}

fn string_map(v: &Value) -> Result<BTreeMap<String, String>, String> {
    match v {
        Value::Null => Ok(BTreeMap::new()),
        Value::Object(m) => m
            .iter()
            .map(|(k, v)| match v {
                Value::String(s) => Ok((k.clone(), s.clone())),
                _ => Err(format!("value of `{k}` must be a string")),
            })
            .collect(),
        _ => Err("must be an object of strings".into()),
    }
}

/// The `Sandbox` answer of create/connect.
fn sandbox_json(shared: &Shared, sb: &Sandbox) -> Value {
    let inner = lock(&sb.inner);
    let mut v = json!({
        "templateID": sb.template_id,
        "sandboxID": sb.id,
        "clientID": sb.client_id,
        "envdVersion": shared.envd_version,
        "domain": shared.domain,
        "trafficAccessToken": null,
    });
    if let Some(a) = &sb.alias {
        v["alias"] = json!(a);
    }
    if let Some(t) = &inner.envd_token {
        v["envdAccessToken"] = json!(t);
    }
    v
}

/// `ListedSandbox`.
fn listed_json(shared: &Shared, sb: &Sandbox) -> Value {
    let inner = lock(&sb.inner);
    let mut v = json!({
        "templateID": sb.template_id,
        "sandboxID": sb.id,
        "clientID": sb.client_id,
        "startedAt": ts(sb.started_at),
        "endAt": ts(inner.end_at),
        "cpuCount": 2,
        "memoryMB": 512,
        "diskSizeMB": 1024,
        "state": inner.state.as_str(),
        "envdVersion": shared.envd_version,
        "metadata": sb.metadata,
    });
    if let Some(a) = &sb.alias {
        v["alias"] = json!(a);
    }
    v
}

/// `SandboxDetail`.
fn detail(shared: &Shared, sb: &Sandbox) -> Value {
    let mut v = listed_json(shared, sb);
    let inner = lock(&sb.inner);
    v["domain"] = json!(shared.domain);
    if let Some(t) = &inner.envd_token {
        v["envdAccessToken"] = json!(t);
    }
    v["lifecycle"] = json!({
        "autoResume": false,
        "onTimeout": if inner.auto_pause { "pause" } else { "kill" },
    });
    v
}

async fn create(shared: &Arc<Shared>, b: Value, v2: bool) -> Response {
    let Some(template) = b["templateID"].as_str() else {
        return error(400, "templateID is required");
    };
    let Some(resolved) = shared.resolve_template(template) else {
        return error(404, &format!("template '{template}' not found"));
    };
    let timeout = match &b["timeout"] {
        Value::Null => DEFAULT_TIMEOUT_SECS,
        v => match v.as_u64() {
            Some(t) => t.min(MAX_TIMEOUT_SECS),
            None => return error(400, "timeout must be an integer >= 0"),
        },
    };
    let metadata = match string_map(&b["metadata"]) {
        Ok(m) => m,
        Err(e) => return error(400, &format!("metadata: {e}")),
    };
    let env_vars = match string_map(&b["envVars"]) {
        Ok(m) => m,
        Err(e) => return error(400, &format!("envVars: {e}")),
    };
    // v2: "all system communication with the sandbox is always secured".
    let secure = v2 || b["secure"].as_bool().unwrap_or(false);
    let auto_pause = b["autoPause"].as_bool().unwrap_or(false);
    match shared
        .create(NewSandbox {
            resolved,
            timeout: Duration::from_secs(timeout),
            metadata,
            env_vars,
            secure,
            auto_pause,
        })
        .await
    {
        Ok(sb) => ok_json(StatusCode::CREATED, sandbox_json(shared, &sb)),
        Err(e) => error(500, &e.to_string()),
    }
}

async fn pause(shared: &Arc<Shared>, id: &str) -> Response {
    let Some(sb) = shared.get(id) else {
        return not_found(id);
    };
    if sb.state() == SbState::Paused {
        return error(409, &format!("sandbox \"{id}\" is already paused"));
    }
    match test_docker::pause(&sb.container).await {
        Ok(()) => {
            lock(&sb.inner).state = SbState::Paused;
            no_content()
        }
        Err(e) => error(500, &format!("pausing the sandbox: {e}")),
    }
}

async fn connect(shared: &Arc<Shared>, id: &str, b: Value, resume_only: bool) -> Response {
    let Some(sb) = shared.get(id) else {
        return error(
            404,
            &format!("sandbox \"{id}\" doesn't exist or you don't have access to it"),
        );
    };
    // No timeout: a running sandbox keeps its end time, a resumed one gets its last
    // timeout again.
    let timeout = match &b["timeout"] {
        Value::Null => None,
        v => match v.as_u64() {
            Some(t) => Some(Duration::from_secs(t.min(MAX_TIMEOUT_SECS))),
            None => return error(400, "timeout must be an integer >= 0"),
        },
    };
    let resumed = match sb.state() {
        SbState::Running if resume_only => {
            return error(409, &format!("sandbox \"{id}\" is already running"));
        }
        SbState::Running => false,
        SbState::Paused => {
            if let Err(e) = test_docker::unpause(&sb.container).await {
                return error(500, &format!("resuming the sandbox: {e}"));
            }
            lock(&sb.inner).state = SbState::Running;
            true
        }
    };
    {
        let mut inner = lock(&sb.inner);
        let now = Utc::now();
        match timeout {
            // Running: the timeout only ever extends.
            Some(t) if !resumed && now + t > inner.end_at => inner.end_at = now + t,
            Some(_) if !resumed => {}
            Some(t) => inner.end_at = now + t,
            None if resumed => inner.end_at = now + inner.timeout,
            None => {}
        }
    }
    let status = if resumed {
        StatusCode::CREATED
    } else {
        StatusCode::OK
    };
    ok_json(status, sandbox_json(shared, &sb))
}

async fn snapshot(shared: &Arc<Shared>, id: &str, b: Value) -> Response {
    let Some(sb) = shared.get(id) else {
        return not_found(id);
    };
    let snap_id = format!("snap-{}", crate::random_lower(16));
    let image = format!(
        "sandbox-harness-test/e2b-snapshot:{}-{snap_id}",
        shared.owner.id()
    );
    if let Err(e) = shared.owner.commit(&sb.container, &image).await {
        return error(500, &format!("snapshotting the sandbox: {e}"));
    }
    let names: Vec<String> = b["name"]
        .as_str()
        .map(|n| vec![n.to_owned()])
        .unwrap_or_default();
    let snap = Snapshot {
        id: snap_id.clone(),
        image,
        names: names.clone(),
        sandbox_id: sb.id.clone(),
        created: Utc::now(),
    };
    lock(&shared.snapshots).insert(snap_id.clone(), snap);
    ok_json(
        StatusCode::CREATED,
        json!({"snapshotID": snap_id, "names": names}),
    )
}

async fn delete_snapshot(shared: &Arc<Shared>, id: &str) -> Response {
    let snap = {
        let mut snaps = lock(&shared.snapshots);
        let key = snaps
            .values()
            .find(|s| s.id == id || s.names.iter().any(|n| n == id))
            .map(|s| s.id.clone());
        key.and_then(|k| snaps.remove(&k))
    };
    let Some(snap) = snap else {
        return error(404, &format!("template '{id}' not found"));
    };
    if let Err(e) = test_docker::remove_image(&snap.image).await
        && !e.is_not_found()
    {
        tracing::warn!(error = %e, "removing a snapshot image");
    }
    no_content()
}

/// Decode `%XX` and `+` (form encoding).
pub(crate) fn percent_decode(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        match b[i] {
            b'+' => out.push(b' '),
            b'%' if i + 2 < b.len() => {
                let hex = |c: u8| (c as char).to_digit(16);
                match (hex(b[i + 1]), hex(b[i + 2])) {
                    (Some(h), Some(l)) => {
                        out.push((h * 16 + l) as u8);
                        i += 2;
                    }
                    _ => out.push(b'%'),
                }
            }
            c => out.push(c),
        }
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// `a=b&c=d` → pairs, each decoded once.
pub(crate) fn parse_form(q: &str) -> Vec<(String, String)> {
    q.split('&')
        .filter(|p| !p.is_empty())
        .map(|p| {
            let (k, v) = p.split_once('=').unwrap_or((p, ""));
            (percent_decode(k), percent_decode(v))
        })
        .collect()
}

fn query_get(q: &[(String, String)], key: &str) -> Option<String> {
    q.iter().find(|(k, _)| k == key).map(|(_, v)| v.clone())
}

fn list_v1(shared: &Arc<Shared>, query: &str) -> Response {
    let q = parse_form(query);
    let filter = match metadata_filter(&q) {
        Ok(f) => f,
        Err(r) => return r,
    };
    let items: Vec<Value> = lock(&shared.sandboxes)
        .values()
        .filter(|sb| sb.state() == SbState::Running && matches_metadata(sb, &filter))
        .map(|sb| listed_json(shared, sb))
        .collect();
    ok_json(StatusCode::OK, Value::Array(items))
}

fn metadata_filter(q: &[(String, String)]) -> Result<Vec<(String, String)>, Response> {
    let Some(m) = query_get(q, "metadata") else {
        return Ok(Vec::new());
    };
    let pairs = parse_form(&m);
    if pairs.iter().any(|(k, _)| k.is_empty()) {
        return Err(error(400, "invalid metadata filter"));
    }
    Ok(pairs)
}

fn matches_metadata(sb: &Sandbox, filter: &[(String, String)]) -> bool {
    filter
        .iter()
        .all(|(k, v)| sb.metadata.get(k).is_some_and(|x| x == v))
}

fn list_v2(shared: &Arc<Shared>, query: &str) -> Response {
    let q = parse_form(query);
    let filter = match metadata_filter(&q) {
        Ok(f) => f,
        Err(r) => return r,
    };
    let states: Vec<SbState> = match query_get(&q, "state") {
        None => vec![SbState::Running, SbState::Paused],
        Some(s) => {
            let mut v = Vec::new();
            for part in s.split(',').filter(|p| !p.is_empty()) {
                match part {
                    "running" => v.push(SbState::Running),
                    "paused" => v.push(SbState::Paused),
                    other => return error(400, &format!("invalid state `{other}`")),
                }
            }
            v
        }
    };
    let limit = match query_get(&q, "limit") {
        None => 100,
        Some(l) => match l.parse::<usize>() {
            Ok(n) if (1..=100).contains(&n) => n,
            _ => return error(400, "limit must be between 1 and 100"),
        },
    };
    let desc = match query_get(&q, "order").as_deref() {
        None | Some("desc") => true,
        Some("asc") => false,
        Some(o) => return error(400, &format!("invalid order `{o}`")),
    };
    let template = query_get(&q, "template");
    let offset = match query_get(&q, "nextToken") {
        None => 0,
        Some(t) => match decode_token(&t) {
            Some(o) => o,
            None => return error(400, "invalid nextToken"),
        },
    };
    let (mut all, running): (Vec<Arc<Sandbox>>, usize) = {
        let map = lock(&shared.sandboxes);
        let running = map
            .values()
            .filter(|s| s.state() == SbState::Running)
            .count();
        (map.values().cloned().collect(), running)
    };
    all.retain(|sb| {
        states.contains(&sb.state())
            && matches_metadata(sb, &filter)
            && template.as_ref().is_none_or(|t| &sb.template_id == t)
    });
    all.sort_by(|a, b| a.started_at.cmp(&b.started_at).then(a.id.cmp(&b.id)));
    if desc {
        all.reverse();
    }
    let page: Vec<Value> = all
        .iter()
        .skip(offset)
        .take(limit)
        .map(|sb| listed_json(shared, sb))
        .collect();
    let mut resp = ok_json(StatusCode::OK, Value::Array(page));
    if offset + limit < all.len() {
        let tok = encode_token(offset + limit);
        if let Ok(v) = HeaderValue::from_str(&tok) {
            resp.headers_mut().insert("x-next-token", v);
        }
    }
    resp.headers_mut()
        .insert("x-total-running", HeaderValue::from(running));
    resp
}

fn encode_token(offset: usize) -> String {
    base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(format!("offset:{offset}"))
}

fn decode_token(t: &str) -> Option<usize> {
    let raw = base64::engine::general_purpose::URL_SAFE_NO_PAD
        .decode(t)
        .ok()?;
    String::from_utf8(raw)
        .ok()?
        .strip_prefix("offset:")?
        .parse()
        .ok()
}

fn list_snapshots(shared: &Arc<Shared>, query: &str) -> Response {
    let q = parse_form(query);
    let sandbox = query_get(&q, "sandboxID");
    let name = query_get(&q, "name");
    let limit = match query_get(&q, "limit") {
        None => 100,
        Some(l) => match l.parse::<usize>() {
            Ok(n) if (1..=100).contains(&n) => n,
            _ => return error(400, "limit must be between 1 and 100"),
        },
    };
    let offset = match query_get(&q, "nextToken") {
        None => 0,
        Some(t) => match decode_token(&t) {
            Some(o) => o,
            None => return error(400, "invalid nextToken"),
        },
    };
    let mut snaps: Vec<Snapshot> = lock(&shared.snapshots)
        .values()
        .filter(|s| sandbox.as_ref().is_none_or(|id| &s.sandbox_id == id))
        .filter(|s| name.as_ref().is_none_or(|n| s.names.contains(n)))
        .cloned()
        .collect();
    snaps.sort_by(|a, b| a.created.cmp(&b.created).then(a.id.cmp(&b.id)));
    let page: Vec<Value> = snaps
        .iter()
        .skip(offset)
        .take(limit)
        .map(|s| json!({"snapshotID": s.id, "names": s.names}))
        .collect();
    let mut resp = ok_json(StatusCode::OK, Value::Array(page));
    if offset + limit < snaps.len()
        && let Ok(v) = HeaderValue::from_str(&encode_token(offset + limit))
    {
        resp.headers_mut().insert("x-next-token", v);
    }
    resp
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn metadata_query_is_decoded_twice() {
        // The SDK quotes keys and values, url-encodes `k=v&k2=v2`, and the HTTP client
        // encodes that once more as the value of `metadata`.
        let q = parse_form("metadata=team%3Da%2526b%26env%3Dprod&limit=2");
        let f = metadata_filter(&q).unwrap();
        assert_eq!(
            f,
            vec![
                ("team".to_owned(), "a&b".to_owned()),
                ("env".to_owned(), "prod".to_owned())
            ]
        );
    }

    #[test]
    fn tokens_round_trip_and_reject_garbage() {
        assert_eq!(decode_token(&encode_token(7)), Some(7));
        assert_eq!(decode_token("nope"), None);
    }
}
