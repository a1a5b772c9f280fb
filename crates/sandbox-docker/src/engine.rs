//! The connection to the engine (lazy, with API version negotiation) and the mapping of
//! bollard's errors onto core's [`Error`] at the crate edge.

use std::path::PathBuf;
use std::time::Duration;

use bollard::Docker;
use bollard::errors::Error as BollardError;
use sandbox_core::Error;
use tokio::sync::OnceCell;

use crate::BACKEND;

/// The engine behind one client: connected and version-negotiated on first use, so building
/// a client never fails and an engine that is down surfaces as [`Error::Unavailable`] on the
/// first call that needs it (and is retried on the next one).
#[derive(Debug, Clone)]
pub(crate) struct Engine {
    socket: PathBuf,
    timeout: Duration,
    docker: OnceCell<Docker>,
}

impl Engine {
    pub(crate) fn new(socket: PathBuf, timeout: Duration) -> Self {
        Engine {
            socket,
            timeout,
            docker: OnceCell::new(),
        }
    }

    /// The connected engine.
    pub(crate) async fn get(&self) -> Result<Docker, Error> {
        self.docker
            .get_or_try_init(|| async {
                let path = self.socket.to_string_lossy().into_owned();
                let docker = Docker::connect_with_unix(
                    &path,
                    self.timeout.as_secs().max(1),
                    bollard::API_DEFAULT_VERSION,
                )
                .map_err(|e| self.unavailable(e))?;
                // This engine may be older than bollard's default API version (e.g. 1.41):
                // ask it, and speak its version.
                let docker = docker
                    .negotiate_version()
                    .await
                    .map_err(|e| self.unavailable(e))?;
                tracing::debug!(version = ?docker.client_version(), socket = %path, "connected to the docker engine");
                Ok(docker)
            })
            .await
            .cloned()
    }

    fn service(&self) -> String {
        format!("docker engine at {}", self.socket.display())
    }

    fn unavailable(&self, e: BollardError) -> Error {
        Error::Unavailable {
            service: self.service(),
            reason: e.to_string(),
            source: Some(Box::new(e)),
        }
    }

    /// Map an engine error: unreachable engine → `Unavailable`, 404 → `NotFound` of `what`
    /// named `key`, 409 → `Conflict`, anything else → `Backend` naming `operation`.
    pub(crate) fn err(
        &self,
        operation: &'static str,
        what: &'static str,
        key: &str,
        e: BollardError,
    ) -> Error {
        match status(&e) {
            Some(404) => Error::NotFound {
                what,
                key: key.to_owned(),
            },
            Some(409) => Error::Conflict {
                key: key.to_owned(),
                reason: server_message(&e),
            },
            Some(_) => Error::Backend {
                backend: BACKEND,
                operation,
                message: format!("{key}: {}", server_message(&e)),
                source: Some(Box::new(e)),
            },
            None if is_unreachable(&e) => self.unavailable(e),
            None => Error::Backend {
                backend: BACKEND,
                operation,
                message: format!("{key}: {e}"),
                source: Some(Box::new(e)),
            },
        }
    }
}

/// The HTTP status of an engine reply, if the error is one.
pub(crate) fn status(e: &BollardError) -> Option<u16> {
    match e {
        BollardError::DockerResponseServerError { status_code, .. } => Some(*status_code),
        _ => None,
    }
}

fn server_message(e: &BollardError) -> String {
    match e {
        BollardError::DockerResponseServerError { message, .. } => message.trim().to_owned(),
        other => other.to_string(),
    }
}

/// Errors that mean "the engine could not be reached" rather than "the engine said no".
fn is_unreachable(e: &BollardError) -> bool {
    matches!(
        e,
        BollardError::SocketNotFoundError(_)
            | BollardError::HyperLegacyError { .. }
            | BollardError::RequestTimeoutError
            | BollardError::IOError { .. }
            | BollardError::APIVersionParseError {}
    )
}
