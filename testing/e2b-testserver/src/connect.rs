//! The Connect protocol: codecs, unary answers, error codes, server-stream framing.

use axum::body::Body;
use axum::response::{IntoResponse, Response};
use bytes::Bytes;
use e2b_envd_proto::envelope;
use http::{HeaderValue, StatusCode, header};
use serde_json::{Value, json};

/// The message codec of a call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Codec {
    Json,
    Proto,
}

/// Unary (`application/json`, `application/proto`) or streaming
/// (`application/connect+json`, `application/connect+proto`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Kind {
    pub codec: Codec,
    pub streaming: bool,
}

impl Kind {
    pub(crate) fn from_content_type(ct: &str) -> Option<Kind> {
        let base = ct
            .split(';')
            .next()
            .unwrap_or("")
            .trim()
            .to_ascii_lowercase();
        let (codec, streaming) = match base.as_str() {
            "application/json" => (Codec::Json, false),
            "application/proto" => (Codec::Proto, false),
            "application/connect+json" => (Codec::Json, true),
            "application/connect+proto" => (Codec::Proto, true),
            _ => return None,
        };
        Some(Kind { codec, streaming })
    }

    pub(crate) fn content_type(self) -> &'static str {
        match (self.streaming, self.codec) {
            (false, Codec::Json) => "application/json",
            (false, Codec::Proto) => "application/proto",
            (true, Codec::Json) => "application/connect+json",
            (true, Codec::Proto) => "application/connect+proto",
        }
    }
}

/// A Connect error code.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[allow(dead_code)]
pub(crate) enum Code {
    Canceled,
    Unknown,
    InvalidArgument,
    DeadlineExceeded,
    NotFound,
    AlreadyExists,
    PermissionDenied,
    ResourceExhausted,
    FailedPrecondition,
    Unimplemented,
    Internal,
    Unavailable,
    Unauthenticated,
}

impl Code {
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            Code::Canceled => "canceled",
            Code::Unknown => "unknown",
            Code::InvalidArgument => "invalid_argument",
            Code::DeadlineExceeded => "deadline_exceeded",
            Code::NotFound => "not_found",
            Code::AlreadyExists => "already_exists",
            Code::PermissionDenied => "permission_denied",
            Code::ResourceExhausted => "resource_exhausted",
            Code::FailedPrecondition => "failed_precondition",
            Code::Unimplemented => "unimplemented",
            Code::Internal => "internal",
            Code::Unavailable => "unavailable",
            Code::Unauthenticated => "unauthenticated",
        }
    }

    pub(crate) fn http_status(self) -> StatusCode {
        let s = match self {
            Code::Canceled => 499,
            Code::Unknown | Code::Internal => 500,
            Code::InvalidArgument | Code::FailedPrecondition => 400,
            Code::DeadlineExceeded => 504,
            Code::NotFound => 404,
            Code::AlreadyExists => 409,
            Code::PermissionDenied => 403,
            Code::ResourceExhausted => 429,
            Code::Unimplemented => 501,
            Code::Unavailable => 503,
            Code::Unauthenticated => 401,
        };
        StatusCode::from_u16(s).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR)
    }

    pub(crate) fn from_tonic(c: tonic::Code) -> Code {
        use tonic::Code as T;
        match c {
            T::Cancelled => Code::Canceled,
            T::InvalidArgument | T::OutOfRange => Code::InvalidArgument,
            T::DeadlineExceeded => Code::DeadlineExceeded,
            T::NotFound => Code::NotFound,
            T::AlreadyExists => Code::AlreadyExists,
            T::PermissionDenied => Code::PermissionDenied,
            T::ResourceExhausted => Code::ResourceExhausted,
            T::FailedPrecondition => Code::FailedPrecondition,
            T::Unimplemented => Code::Unimplemented,
            T::Unavailable => Code::Unavailable,
            T::Unauthenticated => Code::Unauthenticated,
            T::Internal | T::DataLoss => Code::Internal,
            _ => Code::Unknown,
        }
    }
}

/// A Connect error.
#[derive(Debug, Clone)]
pub(crate) struct ConnectError {
    pub code: Code,
    pub message: String,
}

impl ConnectError {
    pub(crate) fn new(code: Code, message: impl Into<String>) -> Self {
        Self {
            code,
            message: message.into(),
        }
    }

    pub(crate) fn from_status(s: &tonic::Status) -> Self {
        Self::new(Code::from_tonic(s.code()), s.message())
    }

    pub(crate) fn json(&self) -> Value {
        json!({"code": self.code.as_str(), "message": self.message})
    }

    /// A unary error answer.
    pub(crate) fn unary(&self) -> Response {
        (self.code.http_status(), axum::Json(self.json())).into_response()
    }
}

/// A unary success answer.
pub(crate) fn unary_ok<M: prost::Message>(kind: Kind, msg: &M, json: Value) -> Response {
    let body = match kind.codec {
        Codec::Json => Bytes::from(json.to_string()),
        Codec::Proto => Bytes::from(msg.encode_to_vec()),
    };
    let mut resp = Response::new(Body::from(body));
    resp.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static(kind.content_type()),
    );
    resp
}

/// The request message of a streaming call: its one envelope.
pub(crate) fn stream_request(body: &[u8]) -> Result<Bytes, ConnectError> {
    let mut d = envelope::Decoder::new();
    d.push(body);
    match d.next_envelope() {
        Some((flags, payload)) if flags & envelope::COMPRESSED == 0 => Ok(payload),
        Some(_) => Err(ConnectError::new(
            Code::Unimplemented,
            "compressed messages are not supported",
        )),
        None => Err(ConnectError::new(
            Code::InvalidArgument,
            "the request body is not one Connect envelope",
        )),
    }
}

/// A message envelope of a stream.
pub(crate) fn message_envelope<M: prost::Message>(codec: Codec, msg: &M, json: Value) -> Bytes {
    match codec {
        Codec::Json => envelope::encode(envelope::MESSAGE, json.to_string().as_bytes()),
        Codec::Proto => envelope::encode(envelope::MESSAGE, &msg.encode_to_vec()),
    }
}

/// The end-stream envelope: `{}` or `{"error":…}` (JSON in every codec).
pub(crate) fn end_envelope(error: Option<&ConnectError>) -> Bytes {
    let v = match error {
        None => json!({}),
        Some(e) => json!({"error": e.json()}),
    };
    envelope::encode(envelope::END_STREAM, v.to_string().as_bytes())
}

/// A streaming answer whose body is `body` (HTTP 200).
pub(crate) fn stream_response(kind: Kind, body: Body) -> Response {
    let mut resp = Response::new(body);
    resp.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static(kind.content_type()),
    );
    resp
}

/// A streaming call that fails before any message: 200 and one end-stream envelope.
pub(crate) fn stream_error(kind: Kind, e: &ConnectError) -> Response {
    stream_response(kind, Body::from(end_envelope(Some(e))))
}

/// The `Connect-Timeout-Ms` header, if any.
pub(crate) fn timeout(headers: &http::HeaderMap) -> Option<std::time::Duration> {
    headers
        .get("connect-timeout-ms")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim().parse::<u64>().ok())
        .map(std::time::Duration::from_millis)
}
