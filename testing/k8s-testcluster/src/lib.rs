#![doc = include_str!("../README.md")]

mod api;
mod controller;
mod docker;
mod error;
mod faults;
mod http_util;
mod router;
mod selector;
mod store;

use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use serde_json::{Value, json};
use tokio::net::TcpListener;
use tokio::sync::{Notify, watch};

pub use controller::{
    CLAIM_UID_LABEL, DEFAULT_PORT, LAUNCH_TYPE, POD_NAME_ANNOTATION, SANDBOX_NAME_ANNOTATION,
    TEMPLATE_REF, WARM_POOL_LABEL,
};
pub use error::ApiError;
pub use faults::Faults;
pub use selector::{FieldSelector, LabelSelector, Selectors};
pub use store::{CLAIM, GATEWAY, RESOURCES, ResourceDef, SANDBOX, TEMPLATE, WARM_POOL};

/// Errors of the test cluster's own operations.
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
    /// The cluster's own API call failed.
    #[error("api: {0}")]
    Api(String),
}

impl From<ApiError> for Error {
    fn from(e: ApiError) -> Self {
        Self::Api(e.to_string())
    }
}

/// The name of the template and warm pool [`TestCluster::start`] creates for
/// [`TestClusterOptions::pod_image`].
pub const DEFAULT_POOL: &str = "default";

/// Options of [`TestCluster::start`]. Every field has a documented default.
#[derive(Debug, Clone)]
pub struct TestClusterOptions {
    /// When set, `start` creates the SandboxTemplate and SandboxWarmPool [`DEFAULT_POOL`]
    /// running this image (ports 8888, 8080, 9090: sandboxd's legacy API, REST and gRPC).
    /// Default: none.
    pub pod_image: Option<String>,
    /// Warm sandboxes kept in the default pool. Default 0 (every claim cold-starts).
    pub warm_pool_replicas: u32,
    /// The namespace written into the kubeconfig (and of the default pool and the
    /// Gateway). Default `default`.
    pub namespace: String,
    /// The API server's bearer token; `None` makes a random one. Default `None`.
    pub token: Option<String>,
    /// Turn off bearer-token checks on the API server. Default `false`.
    pub anonymous: bool,
    /// The router's bearer token (`ROUTER_AUTH_TOKEN`); `None` = no auth. Default `None`.
    pub router_token: Option<String>,
    /// Run the controller (needs Docker). `false` serves only the API, for tests of its
    /// semantics on machines without Docker. Default `true`.
    pub controller: bool,
    /// How many events the API server keeps for watches and list continuations; older
    /// resourceVersions get 410 Gone. Default 1000.
    pub event_window: usize,
    /// Interval of BOOKMARK events on watches that allow them. Default 5 s.
    pub bookmark_interval: Duration,
    /// Name of the Gateway object pointing at the router. Default `sandbox-gateway`.
    pub gateway_name: String,
}

impl Default for TestClusterOptions {
    fn default() -> Self {
        Self {
            pod_image: None,
            warm_pool_replicas: 0,
            namespace: "default".to_owned(),
            token: None,
            anonymous: false,
            router_token: None,
            controller: true,
            event_window: 1000,
            bookmark_interval: Duration::from_secs(5),
            gateway_name: "sandbox-gateway".to_owned(),
        }
    }
}

/// What a pool's template runs: [`TestCluster::create_pool`].
#[derive(Debug, Clone, Default)]
pub struct PoolSpec {
    /// Name of both the SandboxTemplate and the SandboxWarmPool.
    pub name: String,
    /// Namespace; empty = the cluster's.
    pub namespace: String,
    /// Container image.
    pub image: String,
    /// Container `command` (replaces the entrypoint); empty = the image's.
    pub command: Vec<String>,
    /// Container `args`; empty = the image's CMD.
    pub args: Vec<String>,
    /// Container environment.
    pub env: Vec<(String, String)>,
    /// The first container port. 0 = 8888.
    pub port: u16,
    /// More container ports. The pod is Ready once every declared port accepts a TCP
    /// connection.
    pub extra_ports: Vec<u16>,
    /// Warm sandboxes to keep.
    pub replicas: u32,
}

/// A running test cluster: API server, controller and router in this process, pods as
/// Docker containers on a bridge network of its own. Dropping it removes its containers and
/// network.
pub struct TestCluster {
    api_addr: SocketAddr,
    router_addr: SocketAddr,
    token: String,
    router_token: Option<String>,
    namespace: String,
    gateway_name: String,
    cluster_id: String,
    network: Option<String>,
    store: Arc<store::Store>,
    pods: Arc<controller::Pods>,
    faults: Faults,
    stop: watch::Sender<bool>,
}

impl std::fmt::Debug for TestCluster {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TestCluster")
            .field("api", &self.api_addr)
            .field("router", &self.router_addr)
            .field("cluster_id", &self.cluster_id)
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

fn random_token() -> String {
    (0..32).map(|_| fastrand::alphanumeric()).collect()
}

impl TestCluster {
    /// Start the API server, router and (unless turned off) controller; with
    /// `pod_image`, create the default template and warm pool.
    pub async fn start(opts: TestClusterOptions) -> Result<Self, Error> {
        let cluster_id: String = (0..8).map(|_| fastrand::lowercase()).collect();
        let store = Arc::new(store::Store::new(opts.event_window));
        let pods = Arc::new(controller::Pods::default());
        let faults = Faults::new(store.clone(), pods.clone());
        let (stop, stop_rx) = watch::channel(false);
        let token = opts.token.clone().unwrap_or_else(random_token);

        let mut network = None;
        if opts.controller {
            if let Err(e) = docker::remove_stale().await {
                tracing::warn!(error = %e, "removing stale test clusters");
            }
            let name = format!("k8stc-{cluster_id}");
            docker::owner(&cluster_id).create_network(&name).await?;
            network = Some(name);
        }

        let api_listener = bind().await?;
        let router_listener = bind().await?;
        let api_addr = api_listener.local_addr().map_err(|source| Error::Io {
            what: "local address".into(),
            source,
        })?;
        let router_addr = router_listener.local_addr().map_err(|source| Error::Io {
            what: "local address".into(),
            source,
        })?;

        let api_state = Arc::new(api::ApiState {
            store: store.clone(),
            faults: faults.clone(),
            token: (!opts.anonymous).then(|| token.clone()),
            bookmark_interval: opts.bookmark_interval,
        });
        http_util::serve(
            api_listener,
            move |req, _| api::handle(api_state.clone(), req),
            stop_rx.clone(),
        );
        let router_state = Arc::new(router::RouterState {
            store: store.clone(),
            faults: faults.clone(),
            token: opts.router_token.clone(),
        });
        http_util::serve(
            router_listener,
            move |req, _| router::handle(router_state.clone(), req),
            stop_rx.clone(),
        );

        if let Some(net) = &network {
            let ctl = Arc::new(controller::Controller {
                store: store.clone(),
                pods: pods.clone(),
                network: net.clone(),
                cluster_id: cluster_id.clone(),
                kick: Arc::new(Notify::new()),
            });
            tokio::spawn(ctl.run(stop_rx.clone()));
        }

        let cluster = Self {
            api_addr,
            router_addr,
            token,
            router_token: opts.router_token.clone(),
            namespace: opts.namespace.clone(),
            gateway_name: opts.gateway_name.clone(),
            cluster_id,
            network,
            store,
            pods,
            faults,
            stop,
        };
        cluster.create_gateway()?;
        if let Some(image) = &opts.pod_image {
            cluster.create_pool(&PoolSpec {
                name: DEFAULT_POOL.to_owned(),
                image: image.clone(),
                replicas: opts.warm_pool_replicas,
                // sandboxd: the legacy API (first), REST and gRPC.
                extra_ports: vec![8080, 9090],
                ..PoolSpec::default()
            })?;
        }
        tracing::info!(api = %cluster.api_url(), router = %cluster.router_url(), "test cluster started");
        Ok(cluster)
    }

    fn create_gateway(&self) -> Result<(), Error> {
        let gw = self.store.create(
            &GATEWAY,
            &self.namespace,
            json!({"metadata": {"name": self.gateway_name}, "spec": {"gatewayClassName": "k8s-testcluster",
                   "listeners": [{"name": "http", "protocol": "HTTP", "port": self.router_addr.port()}]}}),
        )?;
        let mut gw = gw;
        gw["status"] = json!({"addresses": [{"type": "Hostname", "value": self.router_addr.to_string()}],
            "conditions": [{"type": "Programmed", "status": "True", "reason": "Programmed", "message": ""}]});
        self.store.replace(
            &GATEWAY,
            &self.namespace,
            &self.gateway_name,
            gw,
            store::Part::Status,
        )?;
        Ok(())
    }

    /// The API server's base URL, `http://127.0.0.1:<port>`.
    pub fn api_url(&self) -> String {
        format!("http://{}", self.api_addr)
    }

    /// The router's base URL, `http://127.0.0.1:<port>` (also the Gateway's address).
    pub fn router_url(&self) -> String {
        format!("http://{}", self.router_addr)
    }

    /// The API server's bearer token.
    pub fn token(&self) -> &str {
        &self.token
    }

    /// The router's bearer token, if it requires one.
    pub fn router_token(&self) -> Option<&str> {
        self.router_token.as_deref()
    }

    /// The cluster's namespace (kubeconfig context, default pool, Gateway).
    pub fn namespace(&self) -> &str {
        &self.namespace
    }

    /// The name of the Gateway whose `status.addresses[0].value` is the router.
    pub fn gateway_name(&self) -> &str {
        &self.gateway_name
    }

    /// The id labelling this cluster's containers and network.
    pub fn cluster_id(&self) -> &str {
        &self.cluster_id
    }

    /// The fault-injection handle.
    pub fn faults(&self) -> &Faults {
        &self.faults
    }

    /// The kubeconfig text (server, token, namespace) for kube-rs and the Python client.
    pub fn kubeconfig(&self) -> String {
        format!(
            "apiVersion: v1\nkind: Config\nclusters:\n- name: k8s-testcluster\n  cluster:\n    server: {server}\nusers:\n- name: k8s-testcluster\n  user:\n    token: {token}\ncontexts:\n- name: k8s-testcluster\n  context:\n    cluster: k8s-testcluster\n    user: k8s-testcluster\n    namespace: {ns}\ncurrent-context: k8s-testcluster\npreferences: {{}}\n",
            server = self.api_url(),
            token = self.token,
            ns = self.namespace,
        )
    }

    /// Write [`kubeconfig`](Self::kubeconfig) to `path` (mode 0600).
    pub fn write_kubeconfig(&self, path: &Path) -> Result<(), Error> {
        use std::io::Write as _;
        use std::os::unix::fs::OpenOptionsExt as _;
        let io = |source| Error::Io {
            what: format!("writing {}", path.display()),
            source,
        };
        let mut f = std::fs::OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .mode(0o600)
            .open(path)
            .map_err(io)?;
        f.write_all(self.kubeconfig().as_bytes()).map_err(io)
    }

    /// Create a SandboxTemplate and a SandboxWarmPool, both named `spec.name`.
    pub fn create_pool(&self, spec: &PoolSpec) -> Result<(), Error> {
        let ns = if spec.namespace.is_empty() {
            &self.namespace
        } else {
            &spec.namespace
        };
        let port = if spec.port == 0 {
            DEFAULT_PORT
        } else {
            spec.port
        };
        let ports: Vec<Value> = std::iter::once(port)
            .chain(spec.extra_ports.iter().copied())
            .map(|p| json!({"containerPort": p, "protocol": "TCP"}))
            .collect();
        let mut container = json!({"name": "sandbox", "image": spec.image, "ports": ports});
        if !spec.command.is_empty() {
            container["command"] = json!(spec.command);
        }
        if !spec.args.is_empty() {
            container["args"] = json!(spec.args);
        }
        if !spec.env.is_empty() {
            let env: Vec<Value> = spec
                .env
                .iter()
                .map(|(k, v)| json!({"name": k, "value": v}))
                .collect();
            container["env"] = json!(env);
        }
        self.store.create(
            &TEMPLATE,
            ns,
            json!({"metadata": {"name": spec.name}, "spec": {"podTemplate": {"metadata": {}, "spec": {"containers": [container]}}}}),
        )?;
        self.store.create(
            &WARM_POOL,
            ns,
            json!({"metadata": {"name": spec.name}, "spec": {"replicas": spec.replicas, "sandboxTemplateRef": {"name": spec.name}}}),
        )?;
        Ok(())
    }

    /// Stop serving and remove the cluster's containers and network (also done on drop).
    pub fn shutdown(&mut self) {
        let _ = self.stop.send(true);
        if let Some(net) = self.network.take() {
            // A `docker run` in flight may create its container after the first sweep.
            let in_flight = self.pods.starting() > 0;
            docker::owner(&self.cluster_id).cleanup_blocking(Some(&net), in_flight);
        }
    }
}

impl Drop for TestCluster {
    fn drop(&mut self) {
        self.shutdown();
    }
}
