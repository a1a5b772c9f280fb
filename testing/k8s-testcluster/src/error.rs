//! API errors, answered as Kubernetes `Status` objects.

use serde_json::{Value, json};

/// An API error: the HTTP code, the `Status.reason` and a message.
#[derive(Debug, Clone, thiserror::Error)]
#[error("{code} {reason}: {message}")]
pub struct ApiError {
    /// HTTP status code (also `Status.code`).
    pub code: u16,
    /// `Status.reason`, e.g. `NotFound`, `AlreadyExists`, `Conflict`, `Expired`.
    pub reason: &'static str,
    /// Human-readable message.
    pub message: String,
    /// `Status.details` (name, group, kind), when the error is about one object.
    pub details: Option<Value>,
}

impl ApiError {
    fn new(code: u16, reason: &'static str, message: impl Into<String>) -> Self {
        Self {
            code,
            reason,
            message: message.into(),
            details: None,
        }
    }

    fn with_details(mut self, group: &str, plural: &str, name: &str) -> Self {
        self.details = Some(json!({"name": name, "group": group, "kind": plural}));
        self
    }

    /// 404: no such object.
    pub fn not_found(group: &str, plural: &str, name: &str) -> Self {
        Self::new(
            404,
            "NotFound",
            format!("{plural}.{group} \"{name}\" not found"),
        )
        .with_details(group, plural, name)
    }

    /// 404 for a path the server does not serve.
    pub fn no_route(path: &str) -> Self {
        Self::new(
            404,
            "NotFound",
            format!("the server could not find the requested resource ({path})"),
        )
    }

    /// 409: the name is taken.
    pub fn already_exists(group: &str, plural: &str, name: &str) -> Self {
        Self::new(
            409,
            "AlreadyExists",
            format!("{plural}.{group} \"{name}\" already exists"),
        )
        .with_details(group, plural, name)
    }

    /// 409: optimistic concurrency failed (resourceVersion or precondition mismatch).
    pub fn conflict(group: &str, plural: &str, name: &str, why: &str) -> Self {
        Self::new(
            409,
            "Conflict",
            format!("Operation cannot be fulfilled on {plural}.{group} \"{name}\": {why}"),
        )
        .with_details(group, plural, name)
    }

    /// 422: the object is invalid.
    pub fn invalid(group: &str, plural: &str, name: &str, why: impl Into<String>) -> Self {
        let why = why.into();
        Self::new(
            422,
            "Invalid",
            format!("{plural}.{group} \"{name}\" is invalid: {why}"),
        )
        .with_details(group, plural, name)
    }

    /// 400: the request is malformed.
    pub fn bad_request(message: impl Into<String>) -> Self {
        Self::new(400, "BadRequest", message)
    }

    /// 410: the resourceVersion or continue token is older than the kept event window.
    pub fn expired(message: impl Into<String>) -> Self {
        Self::new(410, "Expired", message)
    }

    /// 401: missing or wrong bearer token.
    pub fn unauthorized() -> Self {
        Self::new(401, "Unauthorized", "Unauthorized")
    }

    /// 405: the verb is not served on this path.
    pub fn method_not_allowed(method: &str) -> Self {
        Self::new(
            405,
            "MethodNotAllowed",
            format!("the server does not allow this method on the requested resource ({method})"),
        )
    }

    /// 415: an unsupported patch or body content type.
    pub fn unsupported_media_type(ct: &str) -> Self {
        Self::new(
            415,
            "UnsupportedMediaType",
            format!(
                "the body of the request was in an unknown format - accepted media types include: application/json-patch+json, application/merge-patch+json, application/apply-patch+yaml (got {ct})"
            ),
        )
    }

    /// A 5xx injected by the fault plan.
    pub fn injected(code: u16) -> Self {
        let reason = match code {
            503 => "ServiceUnavailable",
            504 => "Timeout",
            _ => "InternalError",
        };
        Self::new(code, reason, format!("injected fault: HTTP {code}"))
    }

    /// 500: something broke inside the server.
    pub fn internal(message: impl Into<String>) -> Self {
        Self::new(500, "InternalError", message)
    }

    /// The `Status` object sent as the body (and inside an `ERROR` watch event).
    pub fn status(&self) -> Value {
        let mut s = json!({
            "kind": "Status",
            "apiVersion": "v1",
            "metadata": {},
            "status": "Failure",
            "message": self.message,
            "reason": self.reason,
            "code": self.code,
        });
        if let Some(d) = &self.details {
            s["details"] = d.clone();
        }
        s
    }
}
