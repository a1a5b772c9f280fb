//! The one error type of the workspace.
//!
//! Backends keep private error enums and convert at their crate edge; callers only ever see
//! [`Error`], classified by [`ErrorKind`]. Every variant carries what a user needs to act on it.

use std::path::PathBuf;
use std::time::Duration;

/// A boxed source error.
pub type BoxError = Box<dyn std::error::Error + Send + Sync + 'static>;

/// Result alias used throughout the workspace.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Broad classification of an [`Error`], for callers that branch on what went wrong.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum ErrorKind {
    /// The thing asked for does not exist.
    NotFound,
    /// Something else holds the name, the slot or a newer version.
    Conflict,
    /// The call's lease on its key was lost or superseded (it expired, or a newer holder
    /// took the key over): [`Error::LeaseLost`] and [`Error::StaleLease`]. The message says
    /// what was written before the loss was found out; the state was not advanced.
    LeaseLost,
    /// An operation ran out of time.
    Timeout,
    /// The caller passed something unacceptable (bad path, bad spec, bad archive).
    InvalidInput,
    /// An input is larger than a documented limit; nothing was changed.
    LimitExceeded,
    /// A service the operation needs could not be reached.
    Unavailable,
    /// The backend does not implement the operation.
    NotSupported,
    /// Stored data (state JSON, a snapshot) is damaged or of an unknown kind.
    Corrupt,
    /// A backend reported a failure of its own.
    Backend,
    /// A local I/O operation failed.
    Io,
    /// A service refused the credentials (wrong, expired or lacking permission).
    Unauthorized,
}

/// Errors of sandbox-harness.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The named thing does not exist.
    #[error("{what} not found: {key}")]
    NotFound {
        /// What kind of thing was looked up ("snapshot", "box", "file").
        what: &'static str,
        /// The key, path or id that was looked up.
        key: String,
    },

    /// A name, slot or version is held by someone else.
    #[error("conflict on {key}: {reason}")]
    Conflict {
        /// The contended key or name.
        key: String,
        /// What holds it.
        reason: String,
    },

    /// The lease used to save state was superseded by a newer holder.
    #[error("stale lease on {key}: fencing token {token} is older than {current}")]
    StaleLease {
        /// The isolation key whose slot was written.
        key: String,
        /// The token the writer held.
        token: u64,
        /// The newest token the store has seen.
        current: u64,
    },

    /// The call's lease on its key was lost (it expired, or another holder took the key over)
    /// while the call ran: the call did not save its state (the key's stored state is the one
    /// before the call) and left the box to the new holder. `reason` says when it was found
    /// out and what had been written by then (e.g. a snapshot that no state references).
    #[error("the lease on {key} was lost: {reason}")]
    LeaseLost {
        /// The isolation key.
        key: String,
        /// How it was found out.
        reason: String,
    },

    /// An operation ran out of time.
    #[error("{operation} timed out after {after:?}")]
    Timeout {
        /// What was being done.
        operation: String,
        /// The limit that was hit.
        after: Duration,
    },

    /// The caller passed something unacceptable.
    #[error("invalid {what}: {reason}")]
    InvalidInput {
        /// Which input ("workspace path", "spec", "blob key").
        what: &'static str,
        /// Why it was refused.
        reason: String,
    },

    /// An input is larger than a documented limit (a file too big to load, a pattern too big
    /// to compile, an edit whose result would be too big); nothing was changed.
    #[error("{what} is over its limit of {limit}: {reason}")]
    LimitExceeded {
        /// What is too big ("file", "grep pattern", "edit result").
        what: &'static str,
        /// The limit, in the unit `reason` names (bytes unless it says otherwise).
        limit: u64,
        /// What was found and what to do instead.
        reason: String,
    },

    /// A path tried to leave the directory it must stay in.
    #[error("path `{path}` is not allowed: {reason}")]
    PathEscape {
        /// The offending path as given.
        path: String,
        /// Which rule it broke.
        reason: String,
    },

    /// An archive entry broke a safety rule; nothing was written to the live workspace.
    #[error("unsafe archive entry `{path}`: {reason}")]
    UnsafeArchive {
        /// The entry's path as stored in the archive.
        path: String,
        /// Which rule it broke.
        reason: String,
    },

    /// A snapshot could not be restored completely; the live workspace was left as it was.
    #[error("snapshot `{snapshot}` could not be restored: {reason}")]
    RestoreIncomplete {
        /// The snapshot id.
        snapshot: String,
        /// What went wrong.
        reason: String,
        /// The underlying error, if any.
        #[source]
        source: Option<BoxError>,
    },

    /// Stored state JSON names a `type` this binary has no backend for.
    #[error("unknown sandbox state type `{tag}`; this binary knows: {}", known.join(", "))]
    UnknownStateType {
        /// The tag found in the JSON.
        tag: String,
        /// The tags of all linked backends.
        known: Vec<String>,
    },

    /// Stored state JSON could not be parsed.
    #[error("malformed sandbox state: {reason}")]
    MalformedState {
        /// What is wrong with it.
        reason: String,
    },

    /// The backend does not implement the operation.
    #[error("{operation} is not supported by the {backend} backend")]
    NotSupported {
        /// The backend's tag.
        backend: &'static str,
        /// The operation that was asked for.
        operation: &'static str,
    },

    /// The isolation asked for cannot be had here (a kernel feature is missing or refused):
    /// nothing ran. Never retryable as is; `how_to_enable` says what would make it work.
    #[error("the {backend} backend cannot isolate: {missing} is unavailable ({how_to_enable})")]
    IsolationUnavailable {
        /// The backend's tag.
        backend: &'static str,
        /// What is missing ("user namespaces", "Landlock", "a memory cgroup").
        missing: String,
        /// How to enable it, or the weaker level to ask for explicitly.
        how_to_enable: String,
    },

    /// A service the operation needs could not be reached.
    #[error("{service} is unavailable: {reason}")]
    Unavailable {
        /// The service ("docker engine", "redis at 127.0.0.1:6379").
        service: String,
        /// What happened.
        reason: String,
        /// The underlying error, if any.
        #[source]
        source: Option<BoxError>,
    },

    /// A service asked the caller to slow down (HTTP 429). Retryable, after `retry_after` when
    /// the service said how long.
    #[error("{service} is rate-limiting requests{}", retry_after.map(|d| format!(" (retry after {d:?})")).unwrap_or_default())]
    RateLimited {
        /// The service ("e2b api at https://api.e2b.app").
        service: String,
        /// How long the service asked to wait, if it said.
        retry_after: Option<Duration>,
    },

    /// A service refused the credentials (HTTP 401/403, a rejected token). Not retryable: the
    /// key, token or permission must change first.
    #[error("{service} refused the credentials: {reason}")]
    Unauthorized {
        /// The service.
        service: String,
        /// What the service said (never the credential itself).
        reason: String,
    },

    /// A backend reported a failure of its own.
    #[error("{backend} backend failed during {operation}: {message}")]
    Backend {
        /// The backend's tag.
        backend: &'static str,
        /// What was being done.
        operation: &'static str,
        /// What the backend said.
        message: String,
        /// The underlying error, if any.
        #[source]
        source: Option<BoxError>,
    },

    /// A local I/O operation failed.
    #[error("I/O error on {}: {source}", path.display())]
    Io {
        /// The path being worked on.
        path: PathBuf,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
}

impl Error {
    /// The broad class of this error.
    pub fn kind(&self) -> ErrorKind {
        match self {
            Error::NotFound { .. } => ErrorKind::NotFound,
            Error::Conflict { .. } => ErrorKind::Conflict,
            Error::StaleLease { .. } | Error::LeaseLost { .. } => ErrorKind::LeaseLost,
            Error::Timeout { .. } => ErrorKind::Timeout,
            Error::InvalidInput { .. } | Error::PathEscape { .. } | Error::UnsafeArchive { .. } => {
                ErrorKind::InvalidInput
            }
            Error::LimitExceeded { .. } => ErrorKind::LimitExceeded,
            Error::RestoreIncomplete { .. }
            | Error::UnknownStateType { .. }
            | Error::MalformedState { .. } => ErrorKind::Corrupt,
            Error::NotSupported { .. } | Error::IsolationUnavailable { .. } => {
                ErrorKind::NotSupported
            }
            Error::Unavailable { .. } | Error::RateLimited { .. } => ErrorKind::Unavailable,
            Error::Unauthorized { .. } => ErrorKind::Unauthorized,
            Error::Backend { .. } => ErrorKind::Backend,
            Error::Io { .. } => ErrorKind::Io,
        }
    }

    /// Whether retrying the same idempotent call later may succeed.
    ///
    /// Never retry a non-idempotent call (create, exec) on this alone.
    pub fn is_retryable(&self) -> bool {
        matches!(self.kind(), ErrorKind::Timeout | ErrorKind::Unavailable)
            // A call whose lease was lost wrote nothing: run it again later.
            || matches!(self, Error::LeaseLost { .. })
    }

    /// An I/O error on `path`.
    pub fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        Error::Io {
            path: path.into(),
            source,
        }
    }

    /// An invalid-input error.
    pub fn invalid(what: &'static str, reason: impl Into<String>) -> Self {
        Error::InvalidInput {
            what,
            reason: reason.into(),
        }
    }

    /// A backend failure without a source error.
    pub fn backend(
        backend: &'static str,
        operation: &'static str,
        message: impl Into<String>,
    ) -> Self {
        Error::Backend {
            backend,
            operation,
            message: message.into(),
            source: None,
        }
    }

    /// An unsafe-archive error.
    pub fn unsafe_archive(path: impl Into<String>, reason: impl Into<String>) -> Self {
        Error::UnsafeArchive {
            path: path.into(),
            reason: reason.into(),
        }
    }

    /// A path-escape error.
    pub fn path_escape(path: impl Into<String>, reason: impl Into<String>) -> Self {
        Error::PathEscape {
            path: path.into(),
            reason: reason.into(),
        }
    }
}

/// Convert a bare `std::io::Error` whose path is unknown (stream plumbing).
impl From<std::io::Error> for Error {
    fn from(source: std::io::Error) -> Self {
        // An io::Error that wraps one of ours (passed through a stream adapter) is unwrapped.
        if source.get_ref().is_some_and(|inner| inner.is::<Error>()) {
            if let Ok(inner) = source
                .into_inner()
                .expect("checked above")
                .downcast::<Error>()
            {
                return *inner;
            }
            unreachable!("checked the type above");
        }
        Error::Io {
            path: PathBuf::new(),
            source,
        }
    }
}

impl From<Error> for std::io::Error {
    fn from(err: Error) -> Self {
        let kind = match err.kind() {
            ErrorKind::NotFound => std::io::ErrorKind::NotFound,
            ErrorKind::InvalidInput => std::io::ErrorKind::InvalidData,
            ErrorKind::LimitExceeded => std::io::ErrorKind::FileTooLarge,
            ErrorKind::Timeout => std::io::ErrorKind::TimedOut,
            _ => std::io::ErrorKind::Other,
        };
        std::io::Error::new(kind, err)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn io_roundtrip_keeps_our_error() {
        let ours = Error::unsafe_archive("../x", "climbs out");
        let io: std::io::Error = ours.into();
        let back: Error = io.into();
        assert!(matches!(back, Error::UnsafeArchive { ref path, .. } if path == "../x"));
    }

    #[test]
    fn kinds_and_retry() {
        assert_eq!(
            Error::NotSupported {
                backend: "local",
                operation: "pause"
            }
            .kind(),
            ErrorKind::NotSupported
        );
        assert!(
            Error::Unavailable {
                service: "x".into(),
                reason: "down".into(),
                source: None
            }
            .is_retryable()
        );
        assert!(!Error::invalid("spec", "bad").is_retryable());
        let big = Error::LimitExceeded {
            what: "file",
            limit: 64 << 20,
            reason: "`a.log` has 80 MiB".into(),
        };
        assert_eq!(big.kind(), ErrorKind::LimitExceeded);
        assert!(!big.is_retryable());
    }

    #[test]
    fn a_lost_lease_has_its_own_kind() {
        let lost = Error::LeaseLost {
            key: "k".into(),
            reason: "found out".into(),
        };
        assert_eq!(lost.kind(), ErrorKind::LeaseLost);
        assert!(
            lost.is_retryable(),
            "a call whose lease was lost may run again"
        );
        let stale = Error::StaleLease {
            key: "k".into(),
            token: 1,
            current: 2,
        };
        assert_eq!(stale.kind(), ErrorKind::LeaseLost);
        assert!(!stale.is_retryable(), "a stale holder must not write again");
        let conflict = Error::Conflict {
            key: "k".into(),
            reason: "taken".into(),
        };
        assert_eq!(conflict.kind(), ErrorKind::Conflict);
    }
}
