//! HTTP plumbing shared by the cloud backends (`sandbox-e2b`, `sandbox-daytona`).
//!
//! - [`Http`]: one `reqwest` client (rustls) with request and connect timeouts, the retry rule
//!   (idempotent calls retry connect errors, timeouts, 429 and 5xx; other calls only 429 and
//!   requests that never left), full-jitter backoff and `Retry-After`, and non-2xx answers
//!   mapped to typed [`Error`]s by [`status_error`].
//! - [`Secret`]: an API key or token that never prints.
//! - [`owner`]: the owner tags every remote box carries (metadata, labels), and reading them
//!   back for `gc`.

mod base_url;
pub mod owner;
mod secret;

use std::fmt;
use std::time::Duration;

use reqwest::StatusCode;
use reqwest::header::{HeaderMap, RETRY_AFTER};
use sandbox_core::{Error, Result};
use serde::de::DeserializeOwned;

pub use base_url::BaseUrl;
pub use secret::Secret;

/// Timeouts and the retry budget of an [`Http`].
///
/// | option | default |
/// | --- | --- |
/// | [`request_timeout`](Self::request_timeout) | 30 s per attempt (streams: until headers) |
/// | [`connect_timeout`](Self::connect_timeout) | 10 s |
/// | [`max_attempts`](Self::max_attempts) | 4 (1 = no retries) |
/// | [`backoff`](Self::backoff) | 200 ms, doubling, full jitter |
/// | [`max_backoff`](Self::max_backoff) | 5 s |
/// | [`max_retry_after`](Self::max_retry_after) | 30 s (a longer `Retry-After` is not waited for) |
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct HttpOptions {
    /// Limit of one attempt, from sending to the end of the response headers.
    pub request_timeout: Duration,
    /// Limit of establishing a connection.
    pub connect_timeout: Duration,
    /// Attempts per call, the first included.
    pub max_attempts: u32,
    /// First backoff ceiling (doubles per attempt; the pause is drawn below it).
    pub backoff: Duration,
    /// Largest backoff ceiling.
    pub max_backoff: Duration,
    /// Longest `Retry-After` honoured; a 429 asking for more fails with
    /// [`Error::RateLimited`] at once.
    pub max_retry_after: Duration,
}

impl Default for HttpOptions {
    fn default() -> Self {
        HttpOptions {
            request_timeout: Duration::from_secs(30),
            connect_timeout: Duration::from_secs(10),
            max_attempts: 4,
            backoff: Duration::from_millis(200),
            max_backoff: Duration::from_secs(5),
            max_retry_after: Duration::from_secs(30),
        }
    }
}

impl HttpOptions {
    /// Per-attempt request limit.
    pub fn request_timeout(mut self, d: Duration) -> Self {
        self.request_timeout = d;
        self
    }

    /// Connect limit.
    pub fn connect_timeout(mut self, d: Duration) -> Self {
        self.connect_timeout = d;
        self
    }

    /// Attempts per call (at least 1).
    pub fn max_attempts(mut self, n: u32) -> Self {
        self.max_attempts = n.max(1);
        self
    }

    /// First and largest backoff ceilings.
    pub fn backoff(mut self, first: Duration, max: Duration) -> Self {
        self.backoff = first;
        self.max_backoff = max.max(first);
        self
    }

    /// Longest honoured `Retry-After`.
    pub fn max_retry_after(mut self, d: Duration) -> Self {
        self.max_retry_after = d;
        self
    }

    /// The pause before retry `attempt` (0-based): drawn uniformly below
    /// `min(backoff · 2^attempt, max_backoff)` (full jitter), so clients never retry in step.
    pub fn pause(&self, attempt: u32) -> Duration {
        let ceiling = self
            .backoff
            .saturating_mul(1u32 << attempt.min(16))
            .min(self.max_backoff);
        ceiling.mul_f64(fastrand::f64())
    }
}

/// Whether repeating a request is harmless. Decides which failures [`Http::send`] retries.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Idempotency {
    /// GET, DELETE, PUT-like calls: retried on connect errors, timeouts, 429 and 5xx.
    Idempotent,
    /// Creates, command runs: retried only on 429 and when the request never left (connect
    /// errors). A 5xx or a timeout is the caller's to resolve (it may have happened).
    NotIdempotent,
}

/// A `reqwest` client with the retry rule and typed errors of one backend's service.
#[derive(Clone)]
pub struct Http {
    client: reqwest::Client,
    backend: &'static str,
    service: String,
    options: HttpOptions,
}

impl fmt::Debug for Http {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Http")
            .field("backend", &self.backend)
            .field("service", &self.service)
            .field("options", &self.options)
            .finish_non_exhaustive()
    }
}

impl Http {
    /// A client for `service` ("e2b api at https://api.e2b.app"), whose errors carry the
    /// backend tag `backend`.
    pub fn new(
        backend: &'static str,
        service: impl Into<String>,
        options: HttpOptions,
    ) -> Result<Http> {
        let client = reqwest::Client::builder()
            .connect_timeout(options.connect_timeout)
            .user_agent(concat!("sandbox-harness/", env!("CARGO_PKG_VERSION")))
            .build()
            .map_err(|e| Error::Backend {
                backend,
                operation: "http client",
                message: e.to_string(),
                source: Some(Box::new(e)),
            })?;
        Ok(Http {
            client,
            backend,
            service: service.into(),
            options,
        })
    }

    /// The underlying client (for streaming calls that manage their own body).
    pub fn client(&self) -> &reqwest::Client {
        &self.client
    }

    /// The options.
    pub fn options(&self) -> &HttpOptions {
        &self.options
    }

    /// The service name errors carry.
    pub fn service(&self) -> &str {
        &self.service
    }

    /// Send the request `build` makes (called again for every attempt) and return the first
    /// 2xx response, retrying by `idempotency` (see [`Idempotency`]). A non-2xx answer becomes
    /// [`status_error`]'s error; a transport failure [`Error::Unavailable`] or
    /// [`Error::Timeout`].
    pub async fn send(
        &self,
        operation: &'static str,
        idempotency: Idempotency,
        build: impl Fn(&reqwest::Client) -> reqwest::RequestBuilder,
    ) -> Result<reqwest::Response> {
        let mut attempt = 0u32;
        loop {
            let last = attempt + 1 >= self.options.max_attempts;
            let sent = build(&self.client)
                .timeout(self.options.request_timeout)
                .send()
                .await;
            let (error, wait) = match sent {
                Ok(response) if response.status().is_success() => return Ok(response),
                Ok(response) => {
                    let status = response.status();
                    let retry_after = retry_after(response.headers());
                    // Error bodies are small; a large one is cut (only the message matters).
                    let body = read_capped(response, 64 * 1024).await;
                    let error = status_error(
                        self.backend,
                        &self.service,
                        operation,
                        status,
                        retry_after,
                        &body,
                        idempotency,
                    );
                    let retry = match status {
                        StatusCode::TOO_MANY_REQUESTS => {
                            retry_after.is_none_or(|d| d <= self.options.max_retry_after)
                        }
                        StatusCode::INTERNAL_SERVER_ERROR
                        | StatusCode::BAD_GATEWAY
                        | StatusCode::SERVICE_UNAVAILABLE
                        | StatusCode::GATEWAY_TIMEOUT => idempotency == Idempotency::Idempotent,
                        _ => false,
                    };
                    if !retry {
                        return Err(error);
                    }
                    (
                        error,
                        retry_after.unwrap_or_else(|| self.options.pause(attempt)),
                    )
                }
                Err(e) => {
                    let never_sent = e.is_connect();
                    let retry = never_sent || idempotency == Idempotency::Idempotent;
                    let error = self.transport_error(operation, e);
                    if !retry {
                        return Err(error);
                    }
                    (error, self.options.pause(attempt))
                }
            };
            if last {
                return Err(error);
            }
            tracing::debug!(
                backend = self.backend,
                operation,
                attempt,
                pause_ms = wait.as_millis() as u64,
                error = %error,
                "retrying"
            );
            tokio::time::sleep(wait).await;
            attempt += 1;
        }
    }

    /// [`send`](Self::send) and parse the JSON body. A body that is not the expected JSON is
    /// [`Error::Backend`].
    pub async fn json<T: DeserializeOwned>(
        &self,
        operation: &'static str,
        idempotency: Idempotency,
        build: impl Fn(&reqwest::Client) -> reqwest::RequestBuilder,
    ) -> Result<T> {
        let response = self.send(operation, idempotency, build).await?;
        let bytes = response
            .bytes()
            .await
            .map_err(|e| self.transport_error(operation, e))?;
        serde_json::from_slice(&bytes).map_err(|e| Error::Backend {
            backend: self.backend,
            operation,
            message: format!("unexpected answer from {}: {e}", self.service),
            source: Some(Box::new(e)),
        })
    }

    /// A transport failure as a typed error: a timeout, or the service unreachable.
    pub fn transport_error(&self, operation: &'static str, e: reqwest::Error) -> Error {
        if e.is_timeout() {
            return Error::Timeout {
                operation: format!("{operation} ({})", self.service),
                after: self.options.request_timeout,
            };
        }
        // reqwest's message names the URL but never headers, so no credential leaks here.
        Error::Unavailable {
            service: self.service.clone(),
            reason: format!("{operation}: {e}"),
            source: Some(Box::new(e)),
        }
    }
}

/// The body of an error answer, at most `limit` bytes (the rest is dropped unread).
async fn read_capped(mut response: reqwest::Response, limit: usize) -> Vec<u8> {
    let mut body = Vec::new();
    while body.len() < limit {
        match response.chunk().await {
            Ok(Some(chunk)) => {
                body.extend_from_slice(&chunk[..chunk.len().min(limit - body.len())])
            }
            _ => break,
        }
    }
    body
}

/// A non-2xx answer as a typed error:
///
/// | status | error |
/// | --- | --- |
/// | 400, 422 | [`Error::InvalidInput`] |
/// | 401, 403 | [`Error::Unauthorized`] |
/// | 404 | [`Error::NotFound`] (`what` = the operation) |
/// | 408 | [`Error::Timeout`] |
/// | 409 | [`Error::Conflict`] |
/// | 429 | [`Error::RateLimited`] (with `Retry-After`) |
/// | 5xx | [`Error::Unavailable`] for idempotent calls (retryable), else [`Error::Backend`] |
/// | other | [`Error::Backend`] |
///
/// The message comes from the body (`message`, `error` or `msg` of a JSON object, else the
/// text), cut to 512 bytes.
pub fn status_error(
    backend: &'static str,
    service: &str,
    operation: &'static str,
    status: StatusCode,
    retry_after: Option<Duration>,
    body: &[u8],
    idempotency: Idempotency,
) -> Error {
    let message = body_message(body);
    let said = if message.is_empty() {
        format!("HTTP {status}")
    } else {
        format!("HTTP {status}: {message}")
    };
    match status.as_u16() {
        400 | 422 => Error::InvalidInput {
            what: operation,
            reason: format!("{service} refused it: {said}"),
        },
        401 | 403 => Error::Unauthorized {
            service: service.to_owned(),
            reason: said,
        },
        404 => Error::NotFound {
            what: operation,
            key: said,
        },
        408 => Error::Timeout {
            operation: format!("{operation} ({service}: {said})"),
            after: Duration::ZERO,
        },
        409 => Error::Conflict {
            key: operation.to_owned(),
            reason: format!("{service}: {said}"),
        },
        429 => Error::RateLimited {
            service: service.to_owned(),
            retry_after,
        },
        500..=599 if idempotency == Idempotency::Idempotent => Error::Unavailable {
            service: service.to_owned(),
            reason: format!("{operation}: {said}"),
            source: None,
        },
        _ => Error::Backend {
            backend,
            operation,
            message: format!("{service}: {said}"),
            source: None,
        },
    }
}

/// `Retry-After` as a duration: delta-seconds or an HTTP date (a past date is zero).
pub fn retry_after(headers: &HeaderMap) -> Option<Duration> {
    let value = headers.get(RETRY_AFTER)?.to_str().ok()?.trim();
    if let Ok(secs) = value.parse::<u64>() {
        return Some(Duration::from_secs(secs));
    }
    let when = httpdate::parse_http_date(value).ok()?;
    Some(
        when.duration_since(std::time::SystemTime::now())
            .unwrap_or(Duration::ZERO),
    )
}

/// The human part of an error body.
fn body_message(body: &[u8]) -> String {
    const MAX: usize = 512;
    let text = match serde_json::from_slice::<serde_json::Value>(body) {
        Ok(serde_json::Value::Object(map)) => ["message", "error", "msg", "detail"]
            .iter()
            .find_map(|k| match map.get(*k) {
                Some(serde_json::Value::String(s)) => Some(s.clone()),
                Some(serde_json::Value::Array(items)) => Some(
                    items
                        .iter()
                        .map(|v| v.as_str().map_or_else(|| v.to_string(), str::to_owned))
                        .collect::<Vec<_>>()
                        .join("; "),
                ),
                Some(serde_json::Value::Object(inner)) => inner
                    .get("message")
                    .and_then(|m| m.as_str())
                    .map(str::to_owned),
                _ => None,
            })
            .unwrap_or_else(|| String::from_utf8_lossy(body).into_owned()),
        _ => String::from_utf8_lossy(body).into_owned(),
    };
    let text = text.trim();
    if text.len() <= MAX {
        return text.to_owned();
    }
    let mut end = MAX;
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}…", &text[..end])
}

#[cfg(test)]
mod tests;
