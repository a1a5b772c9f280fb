//! The crate edge: `object_store` errors become [`sandbox_core::Error`]s. The dependency's
//! error never leaves the crate; its message, with every secret scrubbed, is kept as text.

use std::error::Error as StdError;
use std::time::Duration;

use object_store::client::{HttpError, HttpErrorKind};
use sandbox_core::Error;

/// What an error needs to be reported: which store, which secrets to scrub.
#[derive(Clone)]
pub(crate) struct Ctx {
    /// The store's tag ("s3").
    pub(crate) backend: &'static str,
    /// `s3 bucket `b` at http://127.0.0.1:9000`: names the service, never with credentials.
    pub(crate) service: String,
    /// Texts scrubbed from every message taken from `object_store`.
    pub(crate) secrets: Vec<String>,
    /// The limit reported when a request timed out.
    pub(crate) request_timeout: Duration,
}

impl Ctx {
    pub(crate) fn scrub(&self, text: &str) -> String {
        self.secrets
            .iter()
            .fold(text.to_owned(), |t, s| t.replace(s.as_str(), "***"))
    }

    /// Convert an `object_store` error of `operation` on blob `key`.
    pub(crate) fn convert(
        &self,
        operation: &'static str,
        key: &str,
        e: object_store::Error,
    ) -> Error {
        use object_store::Error as E;
        let message = self.scrub(&e.to_string());
        let err = match &e {
            E::NotFound { .. } => Error::NotFound {
                what: "snapshot blob",
                key: key.to_owned(),
            },
            E::AlreadyExists { .. } | E::Precondition { .. } => Error::Conflict {
                key: key.to_owned(),
                reason: format!("{operation}: {message}"),
            },
            E::NotSupported { .. } | E::NotImplemented { .. } => Error::NotSupported {
                backend: self.backend,
                operation,
            },
            E::InvalidPath { .. } | E::UnknownConfigurationKey { .. } => {
                Error::invalid("object store request", message)
            }
            _ => match transport(&e) {
                Transport::Timeout => Error::Timeout {
                    operation: format!("{operation} of `{key}` on {}", self.service),
                    after: self.request_timeout,
                },
                Transport::Down => Error::Unavailable {
                    service: self.service.clone(),
                    reason: format!("{operation} of `{key}`: {message}"),
                    source: None,
                },
                Transport::Refused => Error::Backend {
                    backend: self.backend,
                    operation,
                    message: format!("{} on `{key}`: {message}", self.service),
                    source: None,
                },
            },
        };
        tracing::debug!(operation, key, error = %err, "object store call failed");
        err
    }

    /// An operation that ran past [`OssOptions::operation_timeout`](crate::OssOptions).
    pub(crate) fn timeout(&self, operation: &'static str, key: &str, after: Duration) -> Error {
        tracing::debug!(operation, key, ?after, "object store call timed out");
        Error::Timeout {
            operation: format!("{operation} of `{key}` on {}", self.service),
            after,
        }
    }
}

enum Transport {
    /// No answer in time: retryable.
    Timeout,
    /// Unreachable, or a server-side failure (5xx, throttling): retryable.
    Down,
    /// The store answered and refused (credentials, permissions, a bad request).
    Refused,
}

/// Classify a failure that is not one of `object_store`'s typed variants, by the HTTP error in
/// its source chain (transport failures) or the status it reports.
fn transport(e: &object_store::Error) -> Transport {
    use object_store::Error as E;
    if matches!(e, E::PermissionDenied { .. } | E::Unauthenticated { .. }) {
        return Transport::Refused;
    }
    let mut source: Option<&(dyn StdError + 'static)> = Some(e);
    while let Some(err) = source {
        if let Some(http) = err.downcast_ref::<HttpError>() {
            return match http.kind() {
                HttpErrorKind::Timeout => Transport::Timeout,
                HttpErrorKind::Connect | HttpErrorKind::Request | HttpErrorKind::Interrupted => {
                    Transport::Down
                }
                HttpErrorKind::Decode | HttpErrorKind::Unknown => Transport::Refused,
                _ => Transport::Down,
            };
        }
        if let Some(io) = err.downcast_ref::<std::io::Error>() {
            use std::io::ErrorKind as K;
            return match io.kind() {
                K::TimedOut => Transport::Timeout,
                K::ConnectionRefused
                | K::ConnectionReset
                | K::ConnectionAborted
                | K::BrokenPipe
                | K::UnexpectedEof
                | K::NotConnected => Transport::Down,
                _ => Transport::Refused,
            };
        }
        source = err.source();
    }
    // `object_store` reports a status only in its message ("... status code: 503 ...").
    let text = e.to_string();
    let status = text
        .split("status code: ")
        .nth(1)
        .and_then(|rest| rest.get(..3))
        .and_then(|code| code.parse::<u16>().ok());
    match status {
        Some(500..=599 | 429 | 408) => Transport::Down,
        _ if text.contains("SlowDown") || text.contains("InternalError") => Transport::Down,
        _ => Transport::Refused,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ctx() -> Ctx {
        Ctx {
            backend: "s3",
            service: "s3 bucket `b` at test".into(),
            secrets: vec!["hunter2".into()],
            request_timeout: Duration::from_secs(1),
        }
    }

    #[test]
    fn typed_variants() {
        let c = ctx();
        let nf = object_store::Error::NotFound {
            path: "p".into(),
            source: "gone".into(),
        };
        assert!(matches!(c.convert("get", "k", nf), Error::NotFound { .. }));
        let exists = object_store::Error::AlreadyExists {
            path: "p".into(),
            source: "there".into(),
        };
        assert!(matches!(
            c.convert("put", "k", exists),
            Error::Conflict { .. }
        ));
        let ni = object_store::Error::NotImplemented {
            operation: "x".into(),
            implementer: "y".into(),
        };
        assert!(matches!(
            c.convert("put_if_absent", "k", ni),
            Error::NotSupported { .. }
        ));
    }

    #[test]
    fn server_errors_are_retryable_and_refusals_are_not_and_secrets_are_scrubbed() {
        let c = ctx();
        let generic = |msg: &str| object_store::Error::Generic {
            store: "S3",
            source: msg.to_owned().into(),
        };
        let e = c.convert(
            "put",
            "k",
            generic("Server returned non-2xx status code: 503 Service Unavailable: hunter2"),
        );
        assert!(e.is_retryable(), "{e}");
        assert!(!e.to_string().contains("hunter2"), "{e}");
        let e = c.convert(
            "put",
            "k",
            generic("Server returned non-2xx status code: 400 Bad Request"),
        );
        assert!(!e.is_retryable(), "{e}");
        let refused = std::io::Error::new(std::io::ErrorKind::ConnectionRefused, "refused");
        let e = c.convert(
            "get",
            "k",
            object_store::Error::Generic {
                store: "S3",
                source: Box::new(refused),
            },
        );
        assert!(matches!(e, Error::Unavailable { .. }), "{e}");
    }
}
