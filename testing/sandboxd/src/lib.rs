#![doc = include_str!("../README.md")]

pub mod deadline;
pub mod files;
pub mod legacy;
pub mod paths;
pub mod process;
pub mod rest;

use std::io;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use axum::serve::ListenerExt as _;
use sandboxd_proto::ProcessServiceServer;
use tokio::net::TcpListener;
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn};

pub use process::Limits;

/// Environment variable naming the base directory (as agent-sandbox's runtimes read it).
pub const BASE_DIR_ENV: &str = "SANDBOX_BASE_DIR";

/// Base directory when neither `--base-dir` nor [`BASE_DIR_ENV`] is given.
pub const DEFAULT_BASE_DIR: &str = "/app";

/// Where sandboxd listens and what it serves.
///
/// The real sandboxd binds loopback only and is reached by port-forward. This server's
/// defaults bind all interfaces (`0.0.0.0`), because the test cluster runs it as a "pod" in a
/// Docker container and the host reaches it on the container's address on a Docker network.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct Config {
    /// REST file API (`/v1/...`). Default `0.0.0.0:8080`.
    pub rest_addr: SocketAddr,
    /// gRPC `process.v1.ProcessService`. Default `0.0.0.0:9090`.
    pub grpc_addr: SocketAddr,
    /// Legacy python-runtime API. Default `0.0.0.0:8888`.
    pub legacy_addr: SocketAddr,
    /// Directory every file path and process `cwd` is confined to (created if missing).
    /// Default [`DEFAULT_BASE_DIR`].
    pub base_dir: PathBuf,
    /// Bounds of the process service.
    pub limits: Limits,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            rest_addr: SocketAddr::from(([0, 0, 0, 0], sandboxd_proto::DEFAULT_REST_PORT)),
            grpc_addr: SocketAddr::from(([0, 0, 0, 0], sandboxd_proto::DEFAULT_GRPC_PORT)),
            legacy_addr: SocketAddr::from(([0, 0, 0, 0], sandboxd_proto::DEFAULT_LEGACY_PORT)),
            base_dir: PathBuf::from(DEFAULT_BASE_DIR),
            limits: Limits::default(),
        }
    }
}

impl Config {
    /// All three listeners on `127.0.0.1` with ports chosen by the OS, serving `base_dir`
    /// (for tests).
    pub fn loopback(base_dir: impl Into<PathBuf>) -> Config {
        let any = SocketAddr::from(([127, 0, 0, 1], 0));
        Config {
            rest_addr: any,
            grpc_addr: any,
            legacy_addr: any,
            base_dir: base_dir.into(),
            limits: Limits::default(),
        }
    }

    /// Set [`Config::limits`].
    pub fn with_limits(mut self, limits: Limits) -> Config {
        self.limits = limits;
        self
    }
}

/// Failure to start.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum StartError {
    /// The base directory could not be created or opened.
    #[error("cannot open the base directory {path}: {source}")]
    BaseDir {
        /// The directory.
        path: PathBuf,
        /// Why.
        source: io::Error,
    },
    /// A listener could not bind.
    #[error("cannot listen on {addr} ({what}): {source}")]
    Bind {
        /// Which API.
        what: &'static str,
        /// The address.
        addr: SocketAddr,
        /// Why.
        source: io::Error,
    },
}

/// A running server: its bound addresses, and a handle to stop it.
#[derive(Debug)]
pub struct Server {
    rest_addr: SocketAddr,
    grpc_addr: SocketAddr,
    legacy_addr: SocketAddr,
    stop: CancellationToken,
    tasks: JoinSet<Result<(), String>>,
}

async fn bind(what: &'static str, addr: SocketAddr) -> Result<TcpListener, StartError> {
    TcpListener::bind(addr)
        .await
        .map_err(|source| StartError::Bind { what, addr, source })
}

/// Small replies (a stream's events, a short response) go out at once: without it Nagle's
/// algorithm holds them for the peer's delayed ACK, about 40 ms per exec round trip.
fn no_delay(stream: &tokio::net::TcpStream) {
    if let Err(e) = stream.set_nodelay(true) {
        debug!("TCP_NODELAY not set: {e}");
    }
}

fn local(listener: &TcpListener) -> SocketAddr {
    listener
        .local_addr()
        .expect("a bound TCP listener has an address")
}

impl Server {
    /// Bind the three listeners and serve them on the current tokio runtime.
    pub async fn start(config: Config) -> Result<Server, StartError> {
        let base = files::Base::open(&config.base_dir).map_err(|source| StartError::BaseDir {
            path: config.base_dir.clone(),
            source,
        })?;
        let base = Arc::new(base);
        let rest = bind("REST", config.rest_addr).await?;
        let grpc = bind("gRPC", config.grpc_addr).await?;
        let legacy = bind("legacy", config.legacy_addr).await?;
        let (rest_addr, grpc_addr, legacy_addr) = (local(&rest), local(&grpc), local(&legacy));
        let stop = CancellationToken::new();
        let mut tasks = JoinSet::new();

        let stopped = stop.clone().cancelled_owned();
        let router = rest::router(base.clone());
        tasks.spawn(async move {
            axum::serve(rest.tap_io(|tcp| no_delay(tcp)), router)
                .with_graceful_shutdown(stopped)
                .await
                .map_err(|e| format!("REST server: {e}"))
        });
        let stopped = stop.clone().cancelled_owned();
        let router = legacy::router(base.clone());
        tasks.spawn(async move {
            axum::serve(legacy.tap_io(|tcp| no_delay(tcp)), router)
                .with_graceful_shutdown(stopped)
                .await
                .map_err(|e| format!("legacy server: {e}"))
        });
        let stopped = stop.clone().cancelled_owned();
        let service = ProcessServiceServer::new(process::Processes::new(base, config.limits));
        // Through axum rather than tonic's server, whose built-in deadline answers CANCELLED
        // (see `deadline`).
        let router = tonic::service::Routes::new(service)
            .prepare()
            .into_axum_router()
            .layer(axum::middleware::from_fn(deadline::grpc_deadline));
        tasks.spawn(async move {
            axum::serve(grpc.tap_io(|tcp| no_delay(tcp)), router)
                .with_graceful_shutdown(stopped)
                .await
                .map_err(|e| format!("gRPC server: {e}"))
        });
        info!(%rest_addr, %grpc_addr, %legacy_addr, base_dir = %config.base_dir.display(), "sandboxd listening");
        Ok(Server {
            rest_addr,
            grpc_addr,
            legacy_addr,
            stop,
            tasks,
        })
    }

    /// Address of the REST API.
    pub fn rest_addr(&self) -> SocketAddr {
        self.rest_addr
    }

    /// Address of the gRPC process service.
    pub fn grpc_addr(&self) -> SocketAddr {
        self.grpc_addr
    }

    /// Address of the legacy python-runtime API.
    pub fn legacy_addr(&self) -> SocketAddr {
        self.legacy_addr
    }

    /// Wait until a listener fails (its error) or the server is stopped.
    pub async fn wait(&mut self) -> Result<(), String> {
        while let Some(done) = self.tasks.join_next().await {
            done.map_err(|e| e.to_string())??;
        }
        Ok(())
    }

    /// Stop accepting, let open requests finish, and wait for the listeners to close.
    pub async fn shutdown(mut self) -> Result<(), String> {
        self.stop.cancel();
        self.wait().await
    }

    /// Like [`Server::shutdown`], but gives open connections at most `grace`: a client that
    /// keeps a connection (or a stream) open does not hold the shutdown beyond it. Returns
    /// whether everything closed in time.
    pub async fn shutdown_within(mut self, grace: Duration) -> Result<bool, String> {
        self.stop.cancel();
        match tokio::time::timeout(grace, self.wait()).await {
            Ok(done) => done.map(|()| true),
            Err(_) => {
                warn!(
                    ?grace,
                    "connections still open after the grace period: closing"
                );
                self.tasks.shutdown().await;
                Ok(false)
            }
        }
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}
