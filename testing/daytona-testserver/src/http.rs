//! Error bodies (NestJS on the API, the daemon's on the toolbox), auth and the fault plan as
//! middleware.

use std::sync::Arc;

use axum::extract::{Request, State};
use axum::http::{HeaderValue, StatusCode, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use serde_json::json;

use crate::state::Inner;

fn reason(code: u16) -> &'static str {
    StatusCode::from_u16(code)
        .ok()
        .and_then(|s| s.canonical_reason())
        .unwrap_or("Error")
}

/// A NestJS-style API error: `{"statusCode","message","error"}`.
pub(crate) fn api_error(code: u16, message: impl Into<String>) -> Response {
    let status = StatusCode::from_u16(code).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    let body = json!({"statusCode": code, "message": message.into(), "error": reason(code)});
    (status, axum::Json(body)).into_response()
}

/// A daemon (toolbox) error: `{"statusCode","message","code","timestamp","path","method"}`.
pub(crate) fn daemon_error(
    code: u16,
    error_code: &str,
    message: impl Into<String>,
    path: &str,
    method: &str,
) -> Response {
    let status = StatusCode::from_u16(code).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    let body = json!({
        "statusCode": code,
        "message": message.into(),
        "code": error_code,
        "timestamp": chrono::Utc::now().to_rfc3339(),
        "path": path,
        "method": method,
    });
    (status, axum::Json(body)).into_response()
}

fn authorized(inner: &Inner, req: &Request) -> bool {
    req.headers()
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .is_some_and(|t| t == inner.api_key)
}

async fn faults_then(inner: &Inner, req: Request, next: Next, toolbox: bool) -> Response {
    let method = req.method().to_string();
    let pq = req
        .uri()
        .path_and_query()
        .map(|p| p.as_str().to_owned())
        .unwrap_or_default();
    let verdict = inner.faults.verdict(&method, &pq);
    if let Some(d) = verdict.delay {
        tokio::time::sleep(d).await;
    }
    if let Some((code, retry_after)) = verdict.fail {
        let mut r = if code == 429 {
            api_error(429, "ThrottlerException: Too Many Requests")
        } else if toolbox {
            daemon_error(
                code,
                "BAD_REQUEST",
                format!("injected fault: HTTP {code}"),
                req.uri().path(),
                &method,
            )
        } else {
            api_error(code, format!("injected fault: HTTP {code}"))
        };
        if let Some(s) = retry_after
            && let Ok(v) = HeaderValue::from_str(&s.to_string())
        {
            r.headers_mut().insert(header::RETRY_AFTER, v);
        }
        return r;
    }
    next.run(req).await
}

/// API middleware: bearer auth (401 NestJS body), then the fault plan.
pub(crate) async fn api_guard(
    State(inner): State<Arc<Inner>>,
    req: Request,
    next: Next,
) -> Response {
    if !authorized(&inner, &req) {
        return api_error(401, "Unauthorized");
    }
    faults_then(&inner, req, next, false).await
}

/// Toolbox middleware: bearer auth, then the fault plan.
pub(crate) async fn toolbox_guard(
    State(inner): State<Arc<Inner>>,
    req: Request,
    next: Next,
) -> Response {
    if !authorized(&inner, &req) {
        return api_error(401, "Unauthorized");
    }
    faults_then(&inner, req, next, true).await
}
