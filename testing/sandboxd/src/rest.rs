//! sandboxd's REST API under `/v1`: files, health, metadata.
//!
//! - `GET /v1/files/{path}`: the file's bytes (streamed, `application/octet-stream`), or for a
//!   directory `{"path","entries":[{"name","size","type","modified_at","mode"}]}`.
//! - `HEAD /v1/files/{path}`: 200 or 404, no body.
//! - `PUT /v1/files/{path}?mode=0644`: atomic write of the raw body (or of the `file` part of
//!   a `multipart/form-data` body), parents created, 204.
//! - `DELETE /v1/files/{path}?recursive=true`: 204; 409 `CONFLICT` for a non-empty directory
//!   without `recursive`.
//! - `GET /v1/health` → `{"status":"ok","uptime_seconds"}`; `GET /v1/metadata` →
//!   `{"env":{...}}` (the server's `SANDBOX_*` variables, minus credential-looking names).
//!
//! Paths: the SDK sends one percent-encoded segment (`a%2Fb`, `.` as `%2E`); plain slashes
//! work too. An absolute path is read relative to the base directory. Errors are
//! `{"code","message"}` with `NOT_FOUND` 404, `PERMISSION_DENIED` 403 (escape attempts,
//! symlinks leading out), `INVALID_ARGUMENT` 400, `CONFLICT` 409, `INTERNAL` 500.

use std::collections::BTreeMap;
use std::io;
use std::sync::Arc;
use std::time::Instant;

use axum::Router;
use axum::body::Body;
use axum::extract::{FromRequest as _, Multipart, Path, Query, Request, State};
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use futures::TryStreamExt as _;
use serde::{Deserialize, Serialize};

use crate::files::{self, Base, DeleteError, Opened};
use crate::paths::{self, Absolute, Target};

#[derive(Debug)]
struct Rest {
    base: Arc<Base>,
    started: Instant,
}

/// The REST router over `base`.
pub fn router(base: Arc<Base>) -> Router {
    let state = Arc::new(Rest {
        base,
        started: Instant::now(),
    });
    Router::new()
        .route("/v1/files", get(get_root).put(put_root).delete(delete_root))
        .route(
            "/v1/files/",
            get(get_root).put(put_root).delete(delete_root),
        )
        .route(
            "/v1/files/{*path}",
            get(get_file).put(put_file).delete(delete_file),
        )
        .route("/v1/health", get(health))
        .route("/v1/metadata", get(metadata))
        .fallback(|| async {
            ApiError::new(StatusCode::NOT_FOUND, "NOT_FOUND", "no such endpoint")
        })
        .with_state(state)
}

/// An error answer: `{"code","message"}` with an HTTP status.
#[derive(Debug)]
pub struct ApiError {
    status: StatusCode,
    code: &'static str,
    message: String,
}

#[derive(Serialize)]
struct ErrorBody<'a> {
    code: &'a str,
    message: &'a str,
}

impl ApiError {
    fn new(status: StatusCode, code: &'static str, message: impl Into<String>) -> ApiError {
        ApiError {
            status,
            code,
            message: message.into(),
        }
    }

    fn invalid(message: impl Into<String>) -> ApiError {
        ApiError::new(StatusCode::BAD_REQUEST, "INVALID_ARGUMENT", message)
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let body = ErrorBody {
            code: self.code,
            message: &self.message,
        };
        (self.status, axum::Json(body)).into_response()
    }
}

impl From<paths::Escape> for ApiError {
    fn from(e: paths::Escape) -> ApiError {
        ApiError::new(StatusCode::FORBIDDEN, "PERMISSION_DENIED", e.to_string())
    }
}

impl From<io::Error> for ApiError {
    fn from(e: io::Error) -> ApiError {
        use rustix::io::Errno;
        if sandbox_core::beneath::refusal(&e).is_some() {
            return ApiError::new(
                StatusCode::FORBIDDEN,
                "PERMISSION_DENIED",
                "path traversal outside sandbox root is forbidden",
            );
        }
        let errno = e.raw_os_error().map(Errno::from_raw_os_error);
        match (e.kind(), errno) {
            (io::ErrorKind::NotFound, _) | (_, Some(Errno::NOTDIR)) => ApiError::new(
                StatusCode::NOT_FOUND,
                "NOT_FOUND",
                "path does not exist within the sandbox",
            ),
            (io::ErrorKind::PermissionDenied, _) => ApiError::new(
                StatusCode::FORBIDDEN,
                "PERMISSION_DENIED",
                "permission denied",
            ),
            (_, Some(Errno::ISDIR)) => ApiError::invalid("target path is a directory"),
            _ => ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, "INTERNAL", e.to_string()),
        }
    }
}

impl From<DeleteError> for ApiError {
    fn from(e: DeleteError) -> ApiError {
        match e {
            DeleteError::NotEmpty => ApiError::new(StatusCode::CONFLICT, "CONFLICT", e.to_string()),
            DeleteError::Io(e) => e.into(),
        }
    }
}

fn target(raw: &str) -> Result<Target, ApiError> {
    Ok(paths::resolve(raw, Absolute::Rebase)?)
}

#[derive(Serialize)]
struct Listing {
    path: String,
    entries: Vec<ListedEntry>,
}

#[derive(Serialize)]
struct ListedEntry {
    name: String,
    size: u64,
    #[serde(rename = "type")]
    kind: &'static str,
    modified_at: String,
    mode: String,
}

async fn get_root(state: State<Arc<Rest>>) -> Result<Response, ApiError> {
    read(state, Target::Root).await
}

async fn get_file(state: State<Arc<Rest>>, Path(path): Path<String>) -> Result<Response, ApiError> {
    read(state, target(&path)?).await
}

async fn read(State(state): State<Arc<Rest>>, target: Target) -> Result<Response, ApiError> {
    let base = state.base.clone();
    let shown = target.shown();
    let opened = files::blocking(move || {
        Ok(match files::open(&base, &target)? {
            Opened::File(file, len) => Ok((file, len)),
            Opened::Dir(dir) => Err(files::list(&base, &dir, &target)?),
        })
    })
    .await?;
    match opened {
        Ok((file, len)) => Ok((
            [
                (
                    header::CONTENT_TYPE,
                    HeaderValue::from_static("application/octet-stream"),
                ),
                (header::CONTENT_LENGTH, HeaderValue::from(len)),
            ],
            Body::from_stream(files::file_stream(file)),
        )
            .into_response()),
        Err(entries) => {
            let entries = entries
                .into_iter()
                .map(|e| ListedEntry {
                    name: e.name,
                    size: e.size,
                    kind: if e.is_dir { "directory" } else { "file" },
                    modified_at: files::rfc3339(e.modified),
                    mode: format!("{:04o}", e.mode & 0o777),
                })
                .collect();
            Ok(axum::Json(Listing {
                path: shown,
                entries,
            })
            .into_response())
        }
    }
}

#[derive(Deserialize)]
struct PutQuery {
    mode: Option<String>,
}

fn parse_mode(mode: Option<&str>) -> Result<u32, ApiError> {
    let Some(mode) = mode.filter(|m| !m.is_empty()) else {
        return Ok(0o644);
    };
    let valid = mode.len() == 4
        && mode.starts_with('0')
        && mode.bytes().skip(1).all(|b| (b'0'..=b'7').contains(&b));
    if !valid {
        return Err(ApiError::invalid(format!(
            "mode {mode:?} must match ^0[0-7]{{3}}$"
        )));
    }
    u32::from_str_radix(mode, 8).map_err(|e| ApiError::invalid(e.to_string()))
}

async fn put_root() -> ApiError {
    ApiError::invalid("target path is a directory")
}

async fn put_file(
    State(state): State<Arc<Rest>>,
    Path(path): Path<String>,
    Query(query): Query<PutQuery>,
    request: Request,
) -> Result<StatusCode, ApiError> {
    let mode = parse_mode(query.mode.as_deref())?;
    let Target::Rel(rel) = target(&path)? else {
        return Err(ApiError::invalid("target path is a directory"));
    };
    let multipart = request
        .headers()
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| {
            v.trim_start()
                .to_ascii_lowercase()
                .starts_with("multipart/form-data")
        });
    if multipart {
        let mut form = Multipart::from_request(request, &())
            .await
            .map_err(|e| ApiError::invalid(format!("invalid multipart body: {e}")))?;
        loop {
            let field = form
                .next_field()
                .await
                .map_err(|e| ApiError::invalid(format!("invalid multipart body: {e}")))?;
            let Some(field) = field else {
                return Err(ApiError::invalid(
                    "multipart body is missing the required \"file\" part",
                ));
            };
            if field.name() == Some("file") {
                files::write_atomic(state.base.clone(), rel, mode, field).await?;
                return Ok(StatusCode::NO_CONTENT);
            }
        }
    }
    let body = request
        .into_body()
        .into_data_stream()
        .map_err(io::Error::other);
    files::write_atomic(state.base.clone(), rel, mode, body).await?;
    Ok(StatusCode::NO_CONTENT)
}

#[derive(Deserialize)]
struct DeleteQuery {
    recursive: Option<String>,
}

fn parse_bool(raw: Option<&str>) -> Result<bool, ApiError> {
    match raw.unwrap_or("") {
        "" | "0" | "f" | "F" | "false" | "FALSE" | "False" => Ok(false),
        "1" | "t" | "T" | "true" | "TRUE" | "True" => Ok(true),
        other => Err(ApiError::invalid(format!(
            "recursive {other:?} must be a boolean"
        ))),
    }
}

async fn delete_root(
    state: State<Arc<Rest>>,
    query: Query<DeleteQuery>,
) -> Result<StatusCode, ApiError> {
    remove(state, Target::Root, query).await
}

async fn delete_file(
    state: State<Arc<Rest>>,
    Path(path): Path<String>,
    query: Query<DeleteQuery>,
) -> Result<StatusCode, ApiError> {
    remove(state, target(&path)?, query).await
}

async fn remove(
    State(state): State<Arc<Rest>>,
    target: Target,
    Query(query): Query<DeleteQuery>,
) -> Result<StatusCode, ApiError> {
    let recursive = parse_bool(query.recursive.as_deref())?;
    let base = state.base.clone();
    tokio::task::spawn_blocking(move || files::delete(&base, &target, recursive))
        .await
        .map_err(|e| {
            ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, "INTERNAL", e.to_string())
        })??;
    Ok(StatusCode::NO_CONTENT)
}

#[derive(Serialize)]
struct Health {
    status: &'static str,
    uptime_seconds: u64,
}

async fn health(State(state): State<Arc<Rest>>) -> axum::Json<Health> {
    axum::Json(Health {
        status: "ok",
        uptime_seconds: state.started.elapsed().as_secs(),
    })
}

/// Prefix of the environment variables `/v1/metadata` shows.
pub const METADATA_ENV_PREFIX: &str = "SANDBOX_";

/// Name fragments that keep a variable out of `/v1/metadata` (credentials).
const SENSITIVE: [&str; 5] = ["TOKEN", "SECRET", "PASSWORD", "CREDENTIAL", "KEY"];

#[derive(Serialize)]
struct Metadata {
    env: BTreeMap<String, String>,
}

async fn metadata() -> axum::Json<Metadata> {
    let env = std::env::vars()
        .filter(|(k, _)| {
            k.starts_with(METADATA_ENV_PREFIX) && {
                let upper = k.to_ascii_uppercase();
                !SENSITIVE.iter().any(|s| upper.contains(s))
            }
        })
        .collect();
    axum::Json(Metadata { env })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn modes_are_four_octal_digits() {
        assert_eq!(parse_mode(None).unwrap(), 0o644);
        assert_eq!(parse_mode(Some("0755")).unwrap(), 0o755);
        assert!(parse_mode(Some("755")).is_err());
        assert!(parse_mode(Some("0855")).is_err());
        assert!(parse_mode(Some("01755")).is_err());
    }
}
