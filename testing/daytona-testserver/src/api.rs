//! The control-plane API (`{api_url}/sandbox...`).
#![allow(clippy::result_large_err)] // handlers return finished `Response`s as their errors

use std::collections::BTreeMap;
use std::sync::Arc;

use axum::Router;
use axum::extract::{Path, Query, State};
use axum::http::Method;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post, put};
use serde_json::{Value, json};

use crate::http::api_error;
use crate::state::Inner;

type S = State<Arc<Inner>>;

pub(crate) fn router(inner: Arc<Inner>) -> Router {
    let api = Router::new()
        .route("/sandbox", post(create).get(list))
        .route("/sandbox/{id}", get(get_one).delete(delete))
        .route("/sandbox/{id}/start", post(start))
        .route("/sandbox/{id}/stop", post(stop))
        .route("/sandbox/{id}/labels", put(labels))
        .route("/sandbox/{id}/autostop/{minutes}", post(autostop))
        .route("/sandbox/{id}/toolbox-proxy-url", get(proxy_url))
        .fallback(not_found)
        .layer(axum::middleware::from_fn_with_state(
            inner.clone(),
            crate::http::api_guard,
        ))
        .with_state(inner);
    Router::new().nest("/api", api).fallback(not_found)
}

async fn not_found(method: Method, uri: axum::http::Uri) -> Response {
    api_error(404, format!("Cannot {method} {}", uri.path()))
}

fn missing(key: &str) -> Response {
    api_error(404, format!("Sandbox with ID or name {key} not found"))
}

fn string_map(v: &Value, field: &str) -> Result<BTreeMap<String, String>, Response> {
    match v.get(field) {
        None | Some(Value::Null) => Ok(BTreeMap::new()),
        Some(Value::Object(m)) => m
            .iter()
            .map(|(k, v)| match v {
                Value::String(s) => Ok((k.clone(), s.clone())),
                _ => Err(api_error(400, format!("{field}.{k} must be a string"))),
            })
            .collect(),
        Some(_) => Err(api_error(400, format!("{field} must be an object"))),
    }
}

fn int(v: &Value, field: &str) -> Result<Option<i64>, Response> {
    match v.get(field) {
        None | Some(Value::Null) => Ok(None),
        Some(n) => n
            .as_i64()
            .map(Some)
            .ok_or_else(|| api_error(400, format!("{field} must be an integer number"))),
    }
}

async fn create(State(inner): S, body: axum::body::Bytes) -> Response {
    let v: Value = match serde_json::from_slice(&body) {
        Ok(v @ Value::Object(_)) => v,
        _ => return api_error(400, "the body must be a JSON object"),
    };
    let id = uuid::Uuid::new_v4().to_string();
    let mut sb = inner.blank(id.clone());
    let r: Result<(), Response> = (|| {
        sb.labels = string_map(&v, "labels")?;
        sb.env = string_map(&v, "env")?;
        if let Some(name) = v.get("name").and_then(Value::as_str) {
            if name.is_empty() {
                return Err(api_error(400, "name must not be empty"));
            }
            sb.name = name.to_owned();
        }
        if let Some(u) = v.get("user").and_then(Value::as_str) {
            sb.user = u.to_owned();
        }
        sb.snapshot = v.get("snapshot").and_then(Value::as_str).map(str::to_owned);
        if sb.snapshot.is_none() && v.get("buildInfo").is_none() {
            sb.snapshot = Some("daytonaio/sandbox:testserver".into());
        }
        sb.public = v.get("public").and_then(Value::as_bool).unwrap_or(false);
        for (field, slot) in [
            ("cpu", &mut sb.cpu),
            ("gpu", &mut sb.gpu),
            ("memory", &mut sb.memory),
            ("disk", &mut sb.disk),
            ("autoStopInterval", &mut sb.auto_stop),
            ("autoArchiveInterval", &mut sb.auto_archive),
            ("autoDeleteInterval", &mut sb.auto_delete),
        ] {
            if let Some(n) = int(&v, field)? {
                *slot = n;
            }
        }
        if sb.cpu < 0 || sb.memory < 0 || sb.disk < 0 || sb.auto_stop < 0 {
            return Err(api_error(
                400,
                "resources and autoStopInterval must not be negative",
            ));
        }
        Ok(())
    })();
    if let Err(e) = r {
        return e;
    }
    if inner.resolve(&sb.name).is_some() {
        return api_error(409, format!("Sandbox with name {} already exists", sb.name));
    }
    let sb = inner.create(sb);
    axum::Json(inner.json(&sb)).into_response()
}

async fn get_one(State(inner): S, Path(id): Path<String>) -> Response {
    match inner.get(&id) {
        Ok(sb) => axum::Json(inner.json(&sb)).into_response(),
        Err(k) => missing(&k),
    }
}

async fn delete(State(inner): S, Path(key): Path<String>) -> Response {
    let Some(id) = inner.resolve(&key) else {
        return missing(&key);
    };
    match inner.delete(&id) {
        Some(sb) => axum::Json(inner.json(&sb)).into_response(),
        None => missing(&key),
    }
}

async fn start(State(inner): S, Path(key): Path<String>) -> Response {
    let Some(id) = inner.resolve(&key) else {
        return missing(&key);
    };
    match inner.start(&id) {
        Ok(sb) => axum::Json(inner.json(&sb)).into_response(),
        Err((code, m)) => api_error(code, m),
    }
}

async fn stop(State(inner): S, Path(key): Path<String>) -> Response {
    let Some(id) = inner.resolve(&key) else {
        return missing(&key);
    };
    match inner.stop(&id) {
        Ok(sb) => axum::Json(inner.json(&sb)).into_response(),
        Err((code, m)) => api_error(code, m),
    }
}

async fn labels(State(inner): S, Path(key): Path<String>, body: axum::body::Bytes) -> Response {
    let Some(id) = inner.resolve(&key) else {
        return missing(&key);
    };
    let v: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
    let labels = match string_map(&v, "labels") {
        Ok(l) if v.get("labels").is_some_and(Value::is_object) => l,
        Ok(_) => return api_error(400, "labels must be an object"),
        Err(e) => return e,
    };
    match inner.update(&id, |s| {
        s.labels = labels;
        s.labels.clone()
    }) {
        Some(l) => axum::Json(json!({"labels": l})).into_response(),
        None => missing(&key),
    }
}

async fn autostop(State(inner): S, Path((key, minutes)): Path<(String, String)>) -> Response {
    let Some(id) = inner.resolve(&key) else {
        return missing(&key);
    };
    let Ok(m) = minutes.parse::<i64>() else {
        return api_error(400, "Validation failed (numeric string is expected)");
    };
    if m < 0 {
        return api_error(400, "Auto-stop interval must be a non-negative integer");
    }
    match inner.update(&id, |s| {
        s.auto_stop = m;
        s.last_activity = std::time::Instant::now();
        s.clone()
    }) {
        Some(sb) => axum::Json(inner.json(&sb)).into_response(),
        None => missing(&key),
    }
}

async fn proxy_url(State(inner): S, Path(key): Path<String>) -> Response {
    match inner.get(&key) {
        Ok(_) => axum::Json(json!({"url": inner.toolbox_url()})).into_response(),
        Err(k) => missing(&k),
    }
}

/// `GET /sandbox?cursor=&limit=&labels=<JSON>&states=`: newest first, `nextCursor` the
/// last item's position (null at the end).
async fn list(State(inner): S, Query(q): Query<Vec<(String, String)>>) -> Response {
    let mut limit = 100usize;
    let mut cursor: Option<u64> = None;
    let mut labels: BTreeMap<String, String> = BTreeMap::new();
    let mut states: Vec<String> = Vec::new();
    for (k, v) in &q {
        match k.as_str() {
            "limit" => match v.parse::<usize>() {
                Ok(n) if (1..=200).contains(&n) => limit = n,
                _ => {
                    return api_error(
                        400,
                        "limit must not be greater than 200 and not less than 1",
                    );
                }
            },
            "cursor" if !v.is_empty() => match v.parse::<u64>() {
                Ok(c) => cursor = Some(c),
                Err(_) => return api_error(400, "invalid cursor"),
            },
            "labels" if !v.is_empty() => match serde_json::from_str::<Value>(v) {
                Ok(obj @ Value::Object(_)) => match string_map(&json!({"labels": obj}), "labels") {
                    Ok(l) => labels = l,
                    Err(e) => return e,
                },
                _ => return api_error(400, "labels must be a JSON object string"),
            },
            "states" | "states[]" => states.extend(v.split(',').map(str::to_owned)),
            _ => {}
        }
    }
    let mut all: Vec<_> = inner
        .lock()
        .values()
        .filter(|s| cursor.is_none_or(|c| s.seq < c))
        .filter(|s| labels.iter().all(|(k, v)| s.labels.get(k) == Some(v)))
        .filter(|s| states.is_empty() || states.iter().any(|x| x == s.state))
        .cloned()
        .collect();
    all.sort_by_key(|s| std::cmp::Reverse(s.seq));
    let more = all.len() > limit;
    all.truncate(limit);
    let next = if more {
        all.last().map(|s| Value::String(s.seq.to_string()))
    } else {
        None
    };
    let url = inner.toolbox_url();
    let items: Vec<Value> = all
        .iter()
        .map(|s| s.to_json(&inner.org_id, &url, true))
        .collect();
    axum::Json(json!({"items": items, "nextCursor": next.unwrap_or(Value::Null)})).into_response()
}
