//! [`K8sOptions`]: the spec's Kubernetes option table, as a builder.

use std::collections::BTreeMap;
use std::fmt;
use std::path::PathBuf;
use std::time::Duration;

use sandbox_core::posix::check_root;
use sandbox_core::{Error, Persistence, Result};

/// How the client reaches the Kubernetes API.
#[derive(Clone, Default)]
#[non_exhaustive]
pub enum ClusterAccess {
    /// `KUBECONFIG` / `~/.kube/config`, else the in-cluster service account (kube's inference).
    #[default]
    Infer,
    /// This kubeconfig file (its current context).
    Kubeconfig(PathBuf),
    /// The pod's service account (`KUBERNETES_SERVICE_HOST`, the mounted token).
    InCluster,
    /// A client the caller built (the spec's custom client).
    Client(kube::Client),
}

impl fmt::Debug for ClusterAccess {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ClusterAccess::Infer => f.write_str("Infer"),
            ClusterAccess::Kubeconfig(p) => f.debug_tuple("Kubeconfig").field(p).finish(),
            ClusterAccess::InCluster => f.write_str("InCluster"),
            ClusterAccess::Client(_) => f.write_str("Client(..)"),
        }
    }
}

/// Which server runs in the sandbox pod.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Runtime {
    /// sandboxd (KEP-539.2): gRPC `process.v1.ProcessService` and the REST file API. Every
    /// exec feature (env, cwd, stdin, tree kill).
    Sandboxd {
        /// REST file API port.
        rest_port: u16,
        /// gRPC process service port.
        grpc_port: u16,
    },
    /// The legacy python runtime (`/execute`, `/upload`, `/download`, `/list`, `/exists`) on
    /// the server port: no env, cwd, stdin or tree kill.
    Legacy,
}

impl Default for Runtime {
    fn default() -> Self {
        Runtime::Sandboxd {
            rest_port: sandboxd_proto::DEFAULT_REST_PORT,
            grpc_port: sandboxd_proto::DEFAULT_GRPC_PORT,
        }
    }
}

/// How the data plane reaches the pod.
#[derive(Clone, Default, PartialEq, Eq)]
#[non_exhaustive]
pub enum Connection {
    /// The pod IP from `Sandbox.status.podIPs` (the client runs in the cluster network).
    #[default]
    PodIp,
    /// The Sandbox's Service, `Sandbox.status.serviceFQDN` (needs `service: true` in the
    /// template).
    ServiceDns,
    /// The sandbox router at `url` (the spec's `apiUrl`), with `X-Sandbox-ID`,
    /// `X-Sandbox-Namespace`, `X-Sandbox-Port` and an optional bearer token.
    Router {
        /// The router's base URL.
        url: String,
        /// `Authorization: Bearer` token (never logged).
        token: Option<String>,
    },
    /// A Gateway API `Gateway` whose `status.addresses[0]` fronts the router.
    Gateway {
        /// Gateway name.
        name: String,
        /// Gateway namespace.
        namespace: String,
        /// `http` or `https`.
        scheme: String,
        /// `Authorization: Bearer` token (never logged).
        token: Option<String>,
    },
}

impl fmt::Debug for Connection {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Connection::PodIp => f.write_str("PodIp"),
            Connection::ServiceDns => f.write_str("ServiceDns"),
            Connection::Router { url, token } => f
                .debug_struct("Router")
                .field("url", &sandbox_core::RedactedUrl(url))
                .field("token", &token.as_ref().map(|_| "<redacted>"))
                .finish(),
            Connection::Gateway {
                name,
                namespace,
                scheme,
                token,
            } => f
                .debug_struct("Gateway")
                .field("name", name)
                .field("namespace", namespace)
                .field("scheme", scheme)
                .field("token", &token.as_ref().map(|_| "<redacted>"))
                .finish(),
        }
    }
}

/// Options of [`crate::K8sClient`], after the spec's `KubernetesFilesystemSpec` table.
///
/// Defaults: namespace `default`, workspace root and file API base directory `/workspace`,
/// server port 8888, sandboxd runtime on 8080/9090 reached by pod IP, ephemeral persistence,
/// owner prefix `sbx`, claims expire after 24 h, Ready within 180 s, commands time out
/// after 300 s. The warm pool has no default: [`K8sOptions::new`] takes it.
#[derive(Clone)]
#[non_exhaustive]
pub struct K8sOptions {
    /// Namespace of the claims.
    pub namespace: String,
    /// `SandboxWarmPool` the claims name in `warmPoolRef` (required).
    pub warm_pool: String,
    /// Workspace root inside the pod (must be on the template's volume to survive a pod).
    pub workspace_root: String,
    /// The runtime's file API base directory; `None` moves files through commands.
    pub file_api_base_dir: Option<String>,
    /// The runtime's HTTP port (legacy runtime, router `X-Sandbox-Port`).
    pub server_port: u16,
    /// Which server runs in the pod.
    pub runtime: Runtime,
    /// How the data plane reaches the pod.
    pub connection: Connection,
    /// How the Kubernetes API is reached.
    pub cluster: ClusterAccess,
    /// What `release` does: delete the claim, or keep it for the next call on the key.
    pub persistence: Persistence,
    /// Owner mark and name prefix of every claim (lowercase DNS label, at most 20 chars).
    pub name_prefix: String,
    /// Claims get `lifecycle.shutdownTime` this far ahead (and `gc` may remove them then).
    pub max_age: Duration,
    /// How long a claim may take to become Ready.
    pub ready_timeout: Duration,
    /// Timeout of commands that set none.
    pub default_timeout: Duration,
    /// Environment of every command.
    pub env: BTreeMap<String, String>,
    /// Extra labels on every claim.
    pub labels: BTreeMap<String, String>,
    /// Attempts of an idempotent call (connect errors, 502/503, API 5xx) before giving up.
    pub retries: u32,
}

/// Environment values are not printed (they may hold secrets), nor tokens (see
/// [`Connection`]).
impl fmt::Debug for K8sOptions {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("K8sOptions")
            .field("namespace", &self.namespace)
            .field("warm_pool", &self.warm_pool)
            .field("workspace_root", &self.workspace_root)
            .field("file_api_base_dir", &self.file_api_base_dir)
            .field("server_port", &self.server_port)
            .field("runtime", &self.runtime)
            .field("connection", &self.connection)
            .field("cluster", &self.cluster)
            .field("persistence", &self.persistence)
            .field("name_prefix", &self.name_prefix)
            .field("max_age", &self.max_age)
            .field("ready_timeout", &self.ready_timeout)
            .field("default_timeout", &self.default_timeout)
            .field("env", &self.env.keys().collect::<Vec<_>>())
            .field("labels", &self.labels)
            .field("retries", &self.retries)
            .finish()
    }
}

impl K8sOptions {
    /// Defaults with the warm pool `warm_pool`.
    pub fn new(warm_pool: impl Into<String>) -> Self {
        K8sOptions {
            namespace: "default".into(),
            warm_pool: warm_pool.into(),
            workspace_root: "/workspace".into(),
            file_api_base_dir: Some("/workspace".into()),
            server_port: sandboxd_proto::DEFAULT_LEGACY_PORT,
            runtime: Runtime::default(),
            connection: Connection::default(),
            cluster: ClusterAccess::default(),
            persistence: Persistence::Ephemeral,
            name_prefix: "sbx".into(),
            max_age: Duration::from_secs(24 * 3600),
            ready_timeout: Duration::from_secs(180),
            default_timeout: Duration::from_secs(300),
            env: BTreeMap::new(),
            labels: BTreeMap::new(),
            retries: 5,
        }
    }

    /// Namespace of the claims.
    pub fn namespace(mut self, ns: impl Into<String>) -> Self {
        self.namespace = ns.into();
        self
    }

    /// Workspace root inside the pod.
    pub fn workspace_root(mut self, root: impl Into<String>) -> Self {
        self.workspace_root = root.into();
        self
    }

    /// The runtime's file API base directory (`None`: files through commands).
    pub fn file_api_base_dir(mut self, dir: Option<String>) -> Self {
        self.file_api_base_dir = dir;
        self
    }

    /// Reach the pod through the router at `url` (the spec's `apiUrl`).
    pub fn api_url(mut self, url: impl Into<String>, token: Option<String>) -> Self {
        self.connection = Connection::Router {
            url: url.into(),
            token,
        };
        self
    }

    /// Reach the pod through a Gateway (the spec's `gatewayName`/`Namespace`/`Scheme`).
    pub fn gateway(
        mut self,
        name: impl Into<String>,
        namespace: impl Into<String>,
        scheme: impl Into<String>,
    ) -> Self {
        self.connection = Connection::Gateway {
            name: name.into(),
            namespace: namespace.into(),
            scheme: scheme.into(),
            token: None,
        };
        self
    }

    /// The runtime's HTTP port.
    pub fn server_port(mut self, port: u16) -> Self {
        self.server_port = port;
        self
    }

    /// Which server runs in the pod.
    pub fn runtime(mut self, runtime: Runtime) -> Self {
        self.runtime = runtime;
        self
    }

    /// How the data plane reaches the pod.
    pub fn connection(mut self, connection: Connection) -> Self {
        self.connection = connection;
        self
    }

    /// How the Kubernetes API is reached (the spec's custom client).
    pub fn cluster(mut self, cluster: ClusterAccess) -> Self {
        self.cluster = cluster;
        self
    }

    /// What `release` does.
    pub fn persistence(mut self, p: Persistence) -> Self {
        self.persistence = p;
        self
    }

    /// Owner mark and name prefix.
    pub fn name_prefix(mut self, prefix: impl Into<String>) -> Self {
        self.name_prefix = prefix.into();
        self
    }

    /// Claim lifetime.
    pub fn max_age(mut self, age: Duration) -> Self {
        self.max_age = age;
        self
    }

    /// How long a claim may take to become Ready.
    pub fn ready_timeout(mut self, t: Duration) -> Self {
        self.ready_timeout = t;
        self
    }

    /// Timeout of commands that set none.
    pub fn default_timeout(mut self, t: Duration) -> Self {
        self.default_timeout = t;
        self
    }

    /// A variable of every command.
    pub fn env(mut self, key: impl Into<String>, value: impl Into<String>) -> Self {
        self.env.insert(key.into(), value.into());
        self
    }

    /// An extra label on every claim.
    pub fn label(mut self, key: impl Into<String>, value: impl Into<String>) -> Self {
        self.labels.insert(key.into(), value.into());
        self
    }

    /// Check everything that can be checked without a cluster.
    pub fn validate(&self) -> Result<()> {
        check_label("namespace", &self.namespace, 63)?;
        check_label("warm pool", &self.warm_pool, 253)?;
        check_label("name prefix", &self.name_prefix, 20)?;
        check_root(&self.workspace_root)?;
        if let Some(base) = &self.file_api_base_dir {
            check_root(base)?;
        }
        for k in self.env.keys() {
            sandbox_core::posix::check_env_name(k)?;
        }
        if let Runtime::Sandboxd {
            rest_port,
            grpc_port,
        } = self.runtime
        {
            if rest_port == grpc_port || rest_port == 0 || grpc_port == 0 {
                return Err(Error::invalid(
                    "sandboxd ports",
                    "REST and gRPC ports must be distinct and non-zero",
                ));
            }
            let tls = match &self.connection {
                Connection::Router { url, .. } => url.starts_with("https://"),
                Connection::Gateway { scheme, .. } => scheme == "https",
                _ => false,
            };
            if tls {
                // Through a router, sandboxd's process service is gRPC over h2c (the client
                // is built without TLS); REST alone over https would be half a box.
                return Err(Error::NotSupported {
                    backend: crate::BACKEND,
                    operation: "the sandboxd runtime through an https router or Gateway",
                });
            }
        }
        match &self.connection {
            Connection::Router { url, .. }
                if !(url.starts_with("http://") || url.starts_with("https://")) =>
            {
                return Err(Error::invalid(
                    "router URL",
                    format!("`{}` is not an http(s) URL", sandbox_core::redact_url(url)),
                ));
            }
            // The router's token goes in `Authorization: Bearer`; user info in the URL would
            // be a second `Authorization`, and shows wherever the URL does.
            Connection::Router { url, .. } if sandbox_core::raw_userinfo(url).is_some() => {
                return Err(Error::invalid(
                    "router URL",
                    format!(
                        "`{}` carries user info; pass the router's token instead",
                        sandbox_core::redact_url(url)
                    ),
                ));
            }
            Connection::Gateway {
                name,
                namespace,
                scheme,
                ..
            } => {
                check_label("gateway name", name, 253)?;
                check_label("gateway namespace", namespace, 63)?;
                if scheme != "http" && scheme != "https" {
                    return Err(Error::invalid(
                        "gateway scheme",
                        format!("`{scheme}` is not http or https"),
                    ));
                }
            }
            _ => {}
        }
        if self.ready_timeout.is_zero() || self.retries == 0 {
            return Err(Error::invalid(
                "options",
                "ready_timeout and retries must be positive",
            ));
        }
        Ok(())
    }
}

/// A lowercase RFC 1123 name of at most `max` characters.
pub(crate) fn check_label(what: &'static str, value: &str, max: usize) -> Result<()> {
    let ok = !value.is_empty()
        && value.len() <= max
        && value
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-' || b == b'.')
        && value.as_bytes()[0].is_ascii_alphanumeric()
        && value.as_bytes()[value.len() - 1].is_ascii_alphanumeric();
    if ok {
        Ok(())
    } else {
        Err(Error::invalid(
            what,
            format!("`{value}` is not a lowercase DNS name of at most {max} characters"),
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// User info in the router URL (the marker with raw `/`, `#`, `?`, `@` and
    /// percent-encoding) shows in neither `Debug` nor the error refusing it.
    #[test]
    fn router_url_credentials_are_refused_and_never_shown() {
        use sandbox_core::testkit::logs::{assert_secret_hidden, secret_urls};
        let mut shown = Vec::new();
        for url in secret_urls("http", "router.example:8080") {
            for runtime in [Runtime::Legacy, Runtime::default()] {
                let o = K8sOptions::new("pool")
                    .runtime(runtime)
                    .api_url(url.clone(), Some("token".into()));
                shown.push(format!("{o:?}"));
                let err = o.validate().expect_err("user info is refused");
                assert_eq!(err.kind(), sandbox_core::ErrorKind::InvalidInput, "{err}");
                shown.push(format!("{err} {err:?}"));
            }
        }
        assert_secret_hidden(&shown, "");
    }

    #[test]
    fn defaults_are_valid() {
        K8sOptions::new("pool").validate().unwrap();
    }

    #[test]
    fn bad_options_are_typed_errors() {
        let bad = [
            K8sOptions::new("Pool"),
            K8sOptions::new("pool").namespace(""),
            K8sOptions::new("pool").name_prefix("a-very-long-prefix-of-claims"),
            K8sOptions::new("pool").workspace_root("relative"),
            K8sOptions::new("pool").workspace_root("/a/../b"),
            K8sOptions::new("pool").env("1BAD", "x"),
            K8sOptions::new("pool")
                .runtime(Runtime::Legacy)
                .api_url("ftp://x", None),
            K8sOptions::new("pool")
                .runtime(Runtime::Legacy)
                .gateway("gw", "ns", "gopher"),
            K8sOptions::new("pool").runtime(Runtime::Sandboxd {
                rest_port: 1,
                grpc_port: 1,
            }),
            K8sOptions::new("pool").ready_timeout(Duration::ZERO),
        ];
        for o in bad {
            assert!(
                matches!(o.validate(), Err(Error::InvalidInput { .. })),
                "{o:?}"
            );
        }
        // sandboxd's gRPC goes through an http router (h2c), not an https one: refused, not
        // half-working.
        K8sOptions::new("pool")
            .api_url("http://router:8080", None)
            .validate()
            .unwrap();
        assert!(matches!(
            K8sOptions::new("pool")
                .api_url("https://router:8443", None)
                .validate(),
            Err(Error::NotSupported { .. })
        ));
        K8sOptions::new("pool")
            .runtime(Runtime::Legacy)
            .api_url("http://router:8080", Some("t".into()))
            .validate()
            .unwrap();
    }

    #[test]
    fn debug_hides_tokens() {
        let o = K8sOptions::new("pool")
            .runtime(Runtime::Legacy)
            .api_url("http://router", Some("s3cret-token".into()))
            .env("TOKEN", "s3cret-env");
        let shown = format!("{o:?}");
        assert!(shown.contains("TOKEN"), "{shown}");
        assert!(!shown.contains("s3cret"), "{shown}");
        assert!(shown.contains("http://router"), "{shown}");
    }
}
