//! Shared test support: a fixture over the k8s test cluster (real Docker containers as pods,
//! running sandboxd from the pod image built by `cargo xtask images`).
#![allow(dead_code)]

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use k8s_testcluster::{DEFAULT_POOL, TestCluster, TestClusterOptions};
use sandbox_core::testkit::Fixture;
use sandbox_core::{Persistence, SandboxClient, SandboxState, async_trait};
use sandbox_k8s::{ClusterAccess, K8sClient, K8sOptions, K8sState};

/// The pod image: `SANDBOX_K8S_POD_IMAGE`, else the one `cargo xtask images` builds.
pub fn pod_image() -> String {
    std::env::var("SANDBOX_K8S_POD_IMAGE")
        .unwrap_or_else(|_| "sandbox-harness-test/k8s-pod:latest".to_owned())
}

/// Where sandboxd keeps files in the pod image (`SANDBOX_BASE_DIR`), used as the workspace.
pub const ROOT: &str = "/app";

/// A unique deployment prefix per test.
pub fn prefix() -> String {
    format!("t{}", &uuid::Uuid::new_v4().simple().to_string()[..10])
}

/// A started cluster with the pod image's pool and its kubeconfig on disk.
pub struct Cluster {
    pub cluster: TestCluster,
    pub kubeconfig: PathBuf,
    _dir: tempfile::TempDir,
}

pub async fn cluster_with(opts: TestClusterOptions) -> Cluster {
    init_tracing();
    let cluster = TestCluster::start(TestClusterOptions {
        pod_image: Some(pod_image()),
        ..opts
    })
    .await
    .expect("test cluster");
    let dir = tempfile::tempdir().expect("tmp");
    let kubeconfig = dir.path().join("kubeconfig");
    cluster.write_kubeconfig(&kubeconfig).expect("kubeconfig");
    Cluster {
        cluster,
        kubeconfig,
        _dir: dir,
    }
}

pub async fn cluster() -> Cluster {
    cluster_with(TestClusterOptions {
        warm_pool_replicas: 1,
        ..TestClusterOptions::default()
    })
    .await
}

impl Cluster {
    /// Wait until the Sandbox `name` is no longer Ready (or gone).
    pub async fn wait_not_ready(&self, namespace: &str, name: &str) {
        use kube::api::{Api, DynamicObject};
        use kube::core::{ApiResource, GroupVersionKind};
        let kc = kube::config::Kubeconfig::read_from(&self.kubeconfig).expect("kubeconfig");
        let config = kube::Config::from_custom_kubeconfig(kc, &Default::default())
            .await
            .expect("config");
        let client = kube::Client::try_from(config).expect("client");
        let ar = ApiResource::from_gvk_with_plural(
            &GroupVersionKind::gvk("agents.x-k8s.io", "v1beta1", "Sandbox"),
            "sandboxes",
        );
        let api: Api<DynamicObject> = Api::namespaced_with(client, namespace, &ar);
        for _ in 0..300 {
            let Some(sb) = api.get_opt(name).await.expect("get sandbox") else {
                return;
            };
            let ready = sb.data["status"]["conditions"]
                .as_array()
                .into_iter()
                .flatten()
                .any(|c| c["type"] == "Ready" && c["status"] == "True");
            if !ready {
                return;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        panic!("the Sandbox {namespace}/{name} still reports Ready after its pod was killed");
    }

    /// Options for this cluster's default pool under `prefix`.
    pub fn options(&self, prefix: &str) -> K8sOptions {
        K8sOptions::new(DEFAULT_POOL)
            .namespace(self.cluster.namespace())
            .workspace_root(ROOT)
            .file_api_base_dir(Some(ROOT.into()))
            .cluster(ClusterAccess::Kubeconfig(self.kubeconfig.clone()))
            .name_prefix(prefix)
            .ready_timeout(Duration::from_secs(120))
    }
}

/// The conformance fixture: one cluster and one deployment prefix per scenario.
pub struct K8sFixture {
    pub cluster: Cluster,
    pub prefix: String,
}

pub async fn fixture() -> K8sFixture {
    K8sFixture {
        cluster: cluster().await,
        prefix: prefix(),
    }
}

#[async_trait]
impl Fixture for K8sFixture {
    async fn client(&self, persistence: Persistence) -> Arc<dyn SandboxClient> {
        Arc::new(
            K8sClient::new(self.cluster.options(&self.prefix).persistence(persistence))
                .expect("client"),
        )
    }

    async fn lose_box(&self, state: &dyn SandboxState) {
        // The pod dies (`docker kill`); a claim without a live Sandbox is deleted instead, as
        // an operator would.
        let state = state
            .downcast::<K8sState>(sandbox_k8s::BACKEND)
            .expect("k8s state");
        if let Some(sandbox) = &state.sandbox_name
            && self
                .cluster
                .cluster
                .faults()
                .kill_pod(&state.namespace, sandbox)
                .await
                .is_ok()
        {
            // Lost as the cluster sees it: the controller reports the dead pod.
            self.cluster.wait_not_ready(&state.namespace, sandbox).await;
            return;
        }
        let client = K8sClient::new(self.cluster.options(&self.prefix)).expect("client");
        client
            .remove_owned(&state.claim_name)
            .await
            .expect("delete claim");
    }
}

/// Log to the test output when `RUST_LOG` is set.
pub fn init_tracing() {
    if std::env::var_os("RUST_LOG").is_some() {
        let _ = tracing_subscriber::fmt()
            .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
            .with_test_writer()
            .try_init();
    }
}
