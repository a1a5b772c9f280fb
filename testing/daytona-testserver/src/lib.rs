#![doc = include_str!("../README.md")]

mod api;
mod docker;
mod faults;
mod http;
mod pod;
mod state;
mod toolbox;

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::net::TcpListener;
use tokio::sync::watch;

pub use faults::{FailState, Faults};
pub use toolbox::WORK_DIR;

/// Errors of the test server's own operations.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A `docker` command failed or could not run.
    #[error("docker: {0}")]
    Docker(String),
    /// Binding a port failed.
    #[error("{what}: {source}")]
    Io {
        /// What was being done.
        what: String,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// A fault or lookup named something the server does not have.
    #[error("api: {0}")]
    Api(String),
    /// The server has been dropped.
    #[error("the test server has stopped")]
    Stopped,
}

/// The pod image's default tag (`cargo xtask images`).
pub const DEFAULT_IMAGE: &str = "sandbox-harness-test/k8s-pod:latest";

/// Options of [`DaytonaTestServer::start`]. Every field has a documented default.
#[derive(Debug, Clone)]
pub struct TestServerOptions {
    /// The image every sandbox runs (Debian with a static `sandboxd` as PID 1). Default: env
    /// `SANDBOX_K8S_POD_IMAGE`, else [`DEFAULT_IMAGE`].
    pub image: String,
    /// The API key clients must send as `Authorization: Bearer`; `None` makes a random one.
    pub api_key: Option<String>,
    /// Run sandboxes (needs Docker). `false` serves the API only; sandboxes then end in
    /// `error`. Default `true`.
    pub docker: bool,
    /// How long one auto-stop "minute" lasts (tests shorten it). Default 60 s.
    pub autostop_unit: Duration,
    /// How long a container may take until sandboxd answers before the sandbox is `error`.
    /// Default 60 s.
    pub ready_timeout: Duration,
}

impl Default for TestServerOptions {
    fn default() -> Self {
        Self {
            image: std::env::var("SANDBOX_K8S_POD_IMAGE").unwrap_or_else(|_| DEFAULT_IMAGE.into()),
            api_key: None,
            docker: true,
            autostop_unit: Duration::from_secs(60),
            ready_timeout: Duration::from_secs(60),
        }
    }
}

/// A running Daytona test server: the API (`/api/sandbox...`) and the toolbox proxy on two
/// loopback ports of this process, sandboxes as Docker containers on a bridge network of its
/// own. Dropping it removes its containers and network.
pub struct DaytonaTestServer {
    api_addr: SocketAddr,
    toolbox_addr: SocketAddr,
    inner: Arc<state::Inner>,
    stop: watch::Sender<bool>,
    network: Option<String>,
}

impl std::fmt::Debug for DaytonaTestServer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DaytonaTestServer")
            .field("api", &self.api_addr)
            .field("toolbox", &self.toolbox_addr)
            .field("server_id", &self.inner.server_id)
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

fn serve(listener: TcpListener, app: axum::Router, mut stop: watch::Receiver<bool>) {
    tokio::spawn(async move {
        let shutdown = async move {
            let _ = stop.changed().await;
        };
        // No Nagle: a command's small request and answer frames must not wait for delayed
        // ACKs (40 ms a round trip otherwise), as on the real services' proxies.
        let listener = axum::serve::ListenerExt::tap_io(listener, |tcp| {
            let _ = tcp.set_nodelay(true);
        });
        if let Err(e) = axum::serve(listener, app)
            .with_graceful_shutdown(shutdown)
            .await
        {
            tracing::warn!(error = %e, "server ended");
        }
    });
}

impl DaytonaTestServer {
    /// Start the API and toolbox servers (and, with `docker`, the server's network).
    pub async fn start(opts: TestServerOptions) -> Result<Self, Error> {
        let server_id: String = (0..8).map(|_| fastrand::lowercase()).collect();
        let mut network = None;
        if opts.docker {
            let name = format!("dtts-{server_id}");
            docker::create_network(&name, &server_id).await?;
            network = Some(name);
        }
        let api_listener = bind().await?;
        let toolbox_listener = bind().await?;
        let addr = |l: &TcpListener| {
            l.local_addr().map_err(|source| Error::Io {
                what: "local address".into(),
                source,
            })
        };
        let api_addr = addr(&api_listener)?;
        let toolbox_addr = addr(&toolbox_listener)?;
        let http = reqwest::Client::builder()
            .timeout(Duration::from_secs(600))
            .build()
            .map_err(|e| Error::Api(format!("http client: {e}")))?;
        let inner = Arc::new_cyclic(|weak| state::Inner {
            api_key: opts
                .api_key
                .clone()
                .unwrap_or_else(|| (0..32).map(|_| fastrand::alphanumeric()).collect()),
            org_id: uuid::Uuid::new_v4().to_string(),
            image: opts.image.clone(),
            network: network.clone(),
            server_id: server_id.clone(),
            toolbox_url: Mutex::new(format!("http://{toolbox_addr}/toolbox")),
            sandboxes: Mutex::default(),
            seq: AtomicU64::new(1),
            in_flight: AtomicUsize::new(0),
            faults: Faults::new(weak.clone()),
            http,
            autostop_unit: opts.autostop_unit,
            ready_timeout: opts.ready_timeout,
        });
        let (stop, stop_rx) = watch::channel(false);
        serve(api_listener, api::router(inner.clone()), stop_rx.clone());
        let toolbox = axum::Router::new().nest("/toolbox", toolbox::router(inner.clone()));
        serve(toolbox_listener, toolbox, stop_rx.clone());
        tokio::spawn(inner.clone().autostop_loop(stop_rx));
        let server = Self {
            api_addr,
            toolbox_addr,
            inner,
            stop,
            network,
        };
        tracing::info!(api = %server.api_url(), toolbox = %server.toolbox_url(), "daytona test server started");
        Ok(server)
    }

    /// The API base URL (`DAYTONA_API_URL`), `http://127.0.0.1:<port>/api`.
    pub fn api_url(&self) -> String {
        format!("http://{}/api", self.api_addr)
    }

    /// The toolbox proxy URL every sandbox reports as `toolboxProxyUrl`.
    pub fn toolbox_url(&self) -> String {
        self.inner.toolbox_url()
    }

    /// The API key (`DAYTONA_API_KEY`).
    pub fn api_key(&self) -> &str {
        &self.inner.api_key
    }

    /// The id labelling this server's containers and network.
    pub fn server_id(&self) -> &str {
        &self.inner.server_id
    }

    /// The fault-injection handle.
    pub fn faults(&self) -> &Faults {
        &self.inner.faults
    }

    /// How many sandboxes the server knows (any state).
    pub fn sandbox_count(&self) -> usize {
        self.inner.lock().len()
    }

    /// The Docker container id of a sandbox, once it has one.
    pub fn container_of(&self, id_or_name: &str) -> Option<String> {
        self.inner.get(id_or_name).ok().and_then(|s| s.container)
    }

    /// Stop serving and remove the server's containers and network (also done on drop).
    pub fn shutdown(&mut self) {
        let _ = self.stop.send(true);
        if let Some(net) = self.network.take() {
            let in_flight = self.inner.in_flight.load(Ordering::SeqCst) > 0;
            docker::cleanup_blocking(&self.inner.server_id, &net, in_flight);
        }
    }
}

impl Drop for DaytonaTestServer {
    fn drop(&mut self) {
        self.shutdown();
    }
}
