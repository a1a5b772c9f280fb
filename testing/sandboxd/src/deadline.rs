//! gRPC deadlines, answered as the protocol says.
//!
//! A client's deadline reaches the server as the `grpc-timeout` header. When it passes before
//! the call has answered, the call is dropped (an `Execute` SIGKILLs its process group) and the
//! client gets `DEADLINE_EXCEEDED`, as from a Go or C++ server. tonic's own server answers
//! `CANCELLED "Timeout expired"` instead, and its timer starts when the request arrives, so it
//! raced the client's own timer: a client that, like the k8s-agent-sandbox SDK, turns
//! `DEADLINE_EXCEEDED` into a timed-out result saw an error whenever the server's answer came
//! first. That is why the gRPC routes are served here, through axum, with this middleware.

use std::time::Duration;

use axum::extract::Request;
use axum::middleware::Next;
use axum::response::Response;

/// Longest deadline honoured (the protocol's 8 digits of hours is far beyond any use).
const MAX: Duration = Duration::from_secs(100_000_000);

/// Parse a `grpc-timeout` value: 1 to 8 ASCII digits and a unit (`H`, `M`, `S`, `m`, `u`,
/// `n`). Anything else is `None` (and the call runs without a deadline, as the protocol's
/// reference servers do with a malformed value).
pub fn parse_grpc_timeout(value: &[u8]) -> Option<Duration> {
    let (unit, digits) = value.split_last()?;
    if digits.is_empty() || digits.len() > 8 || !digits.iter().all(u8::is_ascii_digit) {
        return None;
    }
    let n: u64 = std::str::from_utf8(digits).ok()?.parse().ok()?;
    let limit = match unit {
        b'H' => Duration::from_secs(n.checked_mul(3600)?),
        b'M' => Duration::from_secs(n.checked_mul(60)?),
        b'S' => Duration::from_secs(n),
        b'm' => Duration::from_millis(n),
        b'u' => Duration::from_micros(n),
        b'n' => Duration::from_nanos(n),
        _ => return None,
    };
    Some(limit.min(MAX))
}

/// axum middleware: run the call within its `grpc-timeout`; past it, drop the call and answer
/// `DEADLINE_EXCEEDED` (trailers-only). A server-streaming call's deadline covers the call up
/// to its response headers; after that the client ends the stream at its deadline (a reset),
/// which drops the stream and kills what it runs.
pub async fn grpc_deadline(request: Request, next: Next) -> Response {
    let limit = request
        .headers()
        .get("grpc-timeout")
        .and_then(|v| parse_grpc_timeout(v.as_bytes()));
    let Some(limit) = limit else {
        return next.run(request).await;
    };
    match tokio::time::timeout(limit, next.run(request)).await {
        Ok(response) => response,
        Err(_) => tonic::Status::deadline_exceeded("Deadline Exceeded").into_http(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn grpc_timeout_values() {
        let ok = [
            ("1S", Duration::from_secs(1)),
            ("200m", Duration::from_millis(200)),
            ("99999999u", Duration::from_micros(99_999_999)),
            ("5n", Duration::from_nanos(5)),
            ("2M", Duration::from_secs(120)),
            ("1H", Duration::from_secs(3600)),
            ("0m", Duration::ZERO),
            ("99999999H", MAX),
        ];
        for (v, want) in ok {
            assert_eq!(parse_grpc_timeout(v.as_bytes()), Some(want), "{v}");
        }
        for bad in [
            "",
            "S",
            "123456789S",
            "1s",
            "-1S",
            "1.5S",
            " 1S",
            "1",
            "１S",
        ] {
            assert_eq!(parse_grpc_timeout(bad.as_bytes()), None, "{bad:?}");
        }
    }
}
