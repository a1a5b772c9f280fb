#![doc = include_str!("../README.md")]
// Handlers return ready HTTP answers as their error values.
#![allow(clippy::result_large_err)]

mod api;
mod connect;
mod envd;
mod faults;
mod json;
mod sandbox;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use tokio::net::TcpListener;
use tokio::sync::watch;

pub use faults::Faults;

/// Label namespace of every container, network and image a server creates (value: the
/// server id; `<namespace>.pid`: the owner pid).
pub const LABEL: &str = "sandbox-harness.e2b-testserver";

/// Errors of the test server's own operations.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A `docker` command failed or could not run.
    #[error("docker: {0}")]
    Docker(String),
    /// Binding a port or writing a file failed.
    #[error("{what}: {source}")]
    Io {
        /// What was being done.
        what: String,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// A bad option.
    #[error("invalid option: {0}")]
    Invalid(String),
    /// No such sandbox.
    #[error("sandbox {0} not found")]
    NotFound(String),
}

impl From<test_docker::Error> for Error {
    fn from(e: test_docker::Error) -> Self {
        Self::Docker(e.0)
    }
}

/// Options of [`E2bTestServer::start`]. Every field has a documented default.
#[derive(Clone)]
#[non_exhaustive]
pub struct E2bTestServerOptions {
    /// Image of template `base` (Debian with sandboxd as PID 1). Default: env
    /// `SANDBOX_K8S_POD_IMAGE`, else `sandbox-harness-test/k8s-pod:latest`.
    pub image: String,
    /// The API key; `None` makes a random `e2b_…` one. Default `None`.
    pub api_key: Option<String>,
    /// The sandbox domain answered in `domain`. Default `e2b.test`.
    pub domain: String,
    /// `envdVersion` answered for every sandbox. Default `0.5.7` (octet-stream upload,
    /// default user).
    pub envd_version: String,
    /// How often expired sandboxes are looked for. Default 200 ms.
    pub reap_interval: Duration,
}

impl std::fmt::Debug for E2bTestServerOptions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("E2bTestServerOptions")
            .field("image", &self.image)
            .field("api_key", &self.api_key.as_ref().map(|_| "***"))
            .field("domain", &self.domain)
            .field("envd_version", &self.envd_version)
            .field("reap_interval", &self.reap_interval)
            .finish()
    }
}

impl Default for E2bTestServerOptions {
    fn default() -> Self {
        Self {
            image: std::env::var("SANDBOX_K8S_POD_IMAGE")
                .ok()
                .filter(|s| !s.is_empty())
                .unwrap_or_else(|| "sandbox-harness-test/k8s-pod:latest".to_owned()),
            api_key: None,
            domain: "e2b.test".to_owned(),
            envd_version: "0.5.7".to_owned(),
            reap_interval: Duration::from_millis(200),
        }
    }
}

impl E2bTestServerOptions {
    /// Set the image of template `base`.
    pub fn image(mut self, image: impl Into<String>) -> Self {
        self.image = image.into();
        self
    }

    /// Set the API key.
    pub fn api_key(mut self, key: impl Into<String>) -> Self {
        self.api_key = Some(key.into());
        self
    }

    /// Set the answered `envdVersion`.
    pub fn envd_version(mut self, v: impl Into<String>) -> Self {
        self.envd_version = v.into();
        self
    }
}

/// A running E2B test server: control plane and envd on two loopback ports, sandboxes as
/// Docker containers on a bridge network of its own. Dropping it removes its containers,
/// snapshot images and network.
pub struct E2bTestServer {
    api_addr: SocketAddr,
    envd_addr: SocketAddr,
    shared: Arc<sandbox::Shared>,
    stop: watch::Sender<bool>,
    cleaned: bool,
}

impl std::fmt::Debug for E2bTestServer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("E2bTestServer")
            .field("api", &self.api_addr)
            .field("envd", &self.envd_addr)
            .field("id", &self.shared.owner.id())
            .finish_non_exhaustive()
    }
}

async fn bind() -> Result<TcpListener, Error> {
    TcpListener::bind("127.0.0.1:0")
        .await
        .map_err(|source| Error::Io {
            what: "binding 127.0.0.1".into(),
            source,
        })
}

pub(crate) fn random_string(n: usize) -> String {
    (0..n).map(|_| fastrand::alphanumeric()).collect()
}

pub(crate) fn random_lower(n: usize) -> String {
    (0..n)
        .map(|_| {
            if fastrand::bool() {
                fastrand::lowercase()
            } else {
                fastrand::digit(10)
            }
        })
        .collect()
}

fn serve(listener: TcpListener, router: axum::Router, mut stop: watch::Receiver<bool>) {
    tokio::spawn(async move {
        let shutdown = async move {
            let _ = stop.wait_for(|s| *s).await;
        };
        // No Nagle: a command's small request and answer frames must not wait for delayed
        // ACKs (40 ms a round trip otherwise), as on the real services' proxies.
        let listener = axum::serve::ListenerExt::tap_io(listener, |tcp| {
            let _ = tcp.set_nodelay(true);
        });
        if let Err(e) = axum::serve(listener, router)
            .with_graceful_shutdown(shutdown)
            .await
        {
            tracing::warn!(error = %e, "server stopped");
        }
    });
}

impl E2bTestServer {
    /// Create the Docker network and start serving the API and envd.
    pub async fn start(opts: E2bTestServerOptions) -> Result<Self, Error> {
        if opts.image.is_empty() {
            return Err(Error::Invalid("image is empty".into()));
        }
        semver_ok(&opts.envd_version)?;
        let id: String = (0..8).map(|_| fastrand::lowercase()).collect();
        let owner = test_docker::Owner::new(LABEL, id.clone());
        if let Err(e) = test_docker::remove_stale(LABEL).await {
            tracing::warn!(error = %e, "removing what killed e2b test servers left");
        }
        let network = format!("e2bts-{id}");
        owner.create_network(&network).await?;
        let api_listener = bind().await?;
        let envd_listener = bind().await?;
        let local = |l: &TcpListener| {
            l.local_addr().map_err(|source| Error::Io {
                what: "local address".into(),
                source,
            })
        };
        let api_addr = local(&api_listener)?;
        let envd_addr = local(&envd_listener)?;
        let api_key = opts
            .api_key
            .clone()
            .unwrap_or_else(|| format!("e2b_{}", random_string(40)));
        let shared = Arc::new(sandbox::Shared::new(
            api_key,
            opts.domain.clone(),
            opts.envd_version.clone(),
            opts.image.clone(),
            owner,
            network,
        ));
        let (stop, stop_rx) = watch::channel(false);
        serve(api_listener, api::router(shared.clone()), stop_rx.clone());
        serve(envd_listener, envd::router(shared.clone()), stop_rx.clone());
        tokio::spawn(sandbox::reaper(
            shared.clone(),
            opts.reap_interval,
            stop_rx.clone(),
        ));
        tracing::info!(api = %format!("http://{api_addr}"), envd = %format!("http://{envd_addr}"), "e2b test server started");
        Ok(Self {
            api_addr,
            envd_addr,
            shared,
            stop,
            cleaned: false,
        })
    }

    /// The control plane's base URL (`E2B_API_URL`), `http://127.0.0.1:<port>`.
    pub fn api_url(&self) -> String {
        format!("http://{}", self.api_addr)
    }

    /// envd's base URL (`E2B_SANDBOX_URL`), `http://127.0.0.1:<port>`; requests name the
    /// sandbox in the `E2b-Sandbox-Id` header or the Host `49983-<id>.<domain>`.
    pub fn envd_url(&self) -> String {
        format!("http://{}", self.envd_addr)
    }

    /// The API key (`X-API-Key`).
    pub fn api_key(&self) -> &str {
        &self.shared.api_key
    }

    /// The sandbox domain answered by the API (`E2B_DOMAIN`).
    pub fn domain(&self) -> &str {
        &self.shared.domain
    }

    /// The id labelling this server's containers, images and network.
    pub fn server_id(&self) -> &str {
        self.shared.owner.id()
    }

    /// The fault-injection handle.
    pub fn faults(&self) -> &Faults {
        &self.shared.faults
    }

    /// The Docker container id of a sandbox (for tests that look behind the API).
    pub fn container_of(&self, sandbox_id: &str) -> Option<String> {
        self.shared.get(sandbox_id).map(|s| s.container.clone())
    }

    /// Remove a sandbox's container behind the API's back: the API keeps listing it, envd
    /// answers 502 "… was not found" for it.
    pub async fn disappear(&self, sandbox_id: &str) -> Result<(), Error> {
        self.shared.disappear(sandbox_id).await
    }

    /// Replace a sandbox's envd access token (the old one is then refused with 401); returns
    /// the new one.
    pub fn rotate_envd_token(&self, sandbox_id: &str) -> Result<String, Error> {
        self.shared.rotate_envd_token(sandbox_id)
    }

    /// Stop serving and remove the containers, images and network (also done on drop).
    pub fn shutdown(&mut self) {
        if self.cleaned {
            return;
        }
        self.cleaned = true;
        let _ = self.stop.send(true);
        let in_flight = self
            .shared
            .starting
            .load(std::sync::atomic::Ordering::SeqCst)
            > 0;
        self.shared
            .owner
            .cleanup_blocking(Some(&self.shared.network), in_flight);
    }
}

impl Drop for E2bTestServer {
    fn drop(&mut self) {
        self.shutdown();
    }
}

fn semver_ok(v: &str) -> Result<(), Error> {
    let parts: Vec<&str> = v.split('.').collect();
    if parts.len() == 3 && parts.iter().all(|p| p.parse::<u32>().is_ok()) {
        Ok(())
    } else {
        Err(Error::Invalid(format!(
            "envd_version `{v}` is not MAJOR.MINOR.PATCH"
        )))
    }
}
