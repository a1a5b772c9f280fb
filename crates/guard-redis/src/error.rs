//! The crate edge for errors: `redis` errors become [`sandbox_core::Error`] here and nowhere
//! else, naming the service by address only (never the URL, which may hold a password).

use std::time::Duration;

use redis::{ErrorKind, RedisError, ServerErrorKind};
use sandbox_core::Error;

/// The backend tag in [`Error::Backend`].
pub(crate) const BACKEND: &str = "redis";

/// Map a `redis` error of operation `op` on `service`:
///
/// - an I/O timeout → [`Error::Timeout`] (`after` is the budget the operation had);
/// - the server unreachable, the connection dropped, a server loading, failing over or
///   read-only → [`Error::Unavailable`] (retryable);
/// - anything else (refused credentials, a script error, a wrong type) → [`Error::Backend`].
pub(crate) fn from_redis(service: &str, op: &'static str, after: Duration, e: RedisError) -> Error {
    if e.is_timeout() {
        return timeout(service, op, after);
    }
    let unavailable = e.is_io_error()
        || e.is_connection_refusal()
        || e.is_connection_dropped()
        || matches!(
            e.kind(),
            ErrorKind::ClusterConnectionNotFound
                | ErrorKind::Server(
                    ServerErrorKind::BusyLoading
                        | ServerErrorKind::TryAgain
                        | ServerErrorKind::ClusterDown
                        | ServerErrorKind::MasterDown
                        | ServerErrorKind::ReadOnly
                )
        );
    if unavailable {
        Error::Unavailable {
            service: service.to_owned(),
            reason: format!("{op}: {e}"),
            source: Some(Box::new(e)),
        }
    } else {
        Error::Backend {
            backend: BACKEND,
            operation: op,
            message: format!("{service}: {e}"),
            source: Some(Box::new(e)),
        }
    }
}

/// An operation on `service` that got no reply within `after`.
pub(crate) fn timeout(service: &str, op: &'static str, after: Duration) -> Error {
    Error::Timeout {
        operation: format!("{op} on {service}"),
        after,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use sandbox_core::ErrorKind as Kind;

    fn io(kind: std::io::ErrorKind) -> RedisError {
        std::io::Error::from(kind).into()
    }

    #[test]
    fn errors_are_classified() {
        let s = "redis at 127.0.0.1:1/0";
        let d = Duration::from_secs(1);
        let refused = from_redis(s, "grant", d, io(std::io::ErrorKind::ConnectionRefused));
        assert_eq!(refused.kind(), Kind::Unavailable, "{refused}");
        assert!(refused.is_retryable());
        assert!(refused.to_string().contains(s), "{refused}");
        let reset = from_redis(s, "renew", d, io(std::io::ErrorKind::ConnectionReset));
        assert_eq!(reset.kind(), Kind::Unavailable);
        let slow = from_redis(s, "grant", d, io(std::io::ErrorKind::TimedOut));
        assert!(
            matches!(slow, Error::Timeout { after, .. } if after == d),
            "{slow}"
        );
        assert!(slow.is_retryable());
        let loading = from_redis(
            s,
            "grant",
            d,
            (ErrorKind::Server(ServerErrorKind::BusyLoading), "loading").into(),
        );
        assert_eq!(loading.kind(), Kind::Unavailable);
        let auth = from_redis(
            s,
            "grant",
            d,
            (ErrorKind::AuthenticationFailed, "WRONGPASS").into(),
        );
        assert_eq!(
            auth.kind(),
            Kind::Backend,
            "refused credentials are not passing"
        );
        assert!(!auth.is_retryable());
    }
}
