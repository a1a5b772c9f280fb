//! [`K8sClient`]: makes, finds, removes and collects SandboxClaims.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use kube::core::{DynamicObject, ObjectMeta};
use sandbox_core::posix::{check_env_name, check_root};
use sandbox_core::{
    Capabilities, CreateRequest, Error, ExecFeatures, IsolationKey, OwnedBox, Persistence, Result,
    SandboxClient, SandboxState, WorkspaceSpec, async_trait,
};
use tokio::sync::OnceCell;

use crate::BACKEND;
use crate::boxed::{BoxConfig, K8sBox};
use crate::control::Control;
use crate::crd;
use crate::options::{ClusterAccess, K8sOptions, Runtime};
use crate::state::K8sState;

/// Label and annotation keys every claim of this library carries.
pub mod labels {
    /// Label: the owner (deployment prefix). `gc` only removes claims with its own owner.
    pub const OWNER: &str = "sandbox-harness.io/owner";
    /// Label: the isolation scope of the key.
    pub const SCOPE: &str = "sandbox-harness.io/scope";
    /// Annotation: the isolation key string (absent for boxes without a key).
    pub const KEY: &str = "sandbox-harness.io/key";
    /// Annotation: creation time, seconds since the epoch.
    pub const CREATED_AT: &str = "sandbox-harness.io/created-at";
    /// Annotation: expiry time, seconds since the epoch (also the claim's shutdown time).
    pub const EXPIRES_AT: &str = "sandbox-harness.io/expires-at";
    /// Annotation: workspace root inside the pod.
    pub const ROOT: &str = "sandbox-harness.io/workspace-root";
}

pub(crate) fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

/// State shared by a client and its boxes.
#[derive(Debug)]
pub(crate) struct Shared {
    pub options: K8sOptions,
    control: OnceCell<Control>,
    pub http: reqwest::Client,
}

impl Shared {
    /// The control plane, connecting on first use.
    pub(crate) async fn control(&self) -> Result<&Control> {
        self.control
            .get_or_try_init(|| async {
                let o = &self.options;
                let unavailable = |reason: String| Error::Unavailable {
                    service: "kubernetes API".into(),
                    reason,
                    source: None,
                };
                let config = match &o.cluster {
                    ClusterAccess::Client(c) => {
                        return Ok(Control::new(
                            c.clone(),
                            "(custom client)".into(),
                            &o.namespace,
                            o.retries,
                        ));
                    }
                    ClusterAccess::Infer => kube::Config::infer().await.map_err(|e| {
                        unavailable(format!("no kubeconfig or in-cluster config: {e}"))
                    })?,
                    ClusterAccess::InCluster => kube::Config::incluster()
                        .map_err(|e| unavailable(format!("not in a cluster: {e}")))?,
                    ClusterAccess::Kubeconfig(path) => {
                        let kc = kube::config::Kubeconfig::read_from(path).map_err(|e| {
                            Error::invalid("kubeconfig", format!("{}: {e}", path.display()))
                        })?;
                        kube::Config::from_custom_kubeconfig(kc, &Default::default())
                            .await
                            .map_err(|e| {
                                Error::invalid("kubeconfig", format!("{}: {e}", path.display()))
                            })?
                    }
                };
                let url = config.cluster_url.to_string();
                let client = kube::Client::try_from(config)
                    .map_err(|e| unavailable(format!("cannot build a client for {url}: {e}")))?;
                Ok(Control::new(client, url, &o.namespace, o.retries))
            })
            .await
    }

    /// Whether a claim's labels say this deployment owns it.
    pub(crate) fn owns(&self, claim: &DynamicObject) -> bool {
        claim
            .metadata
            .labels
            .as_ref()
            .and_then(|l| l.get(labels::OWNER))
            .is_some_and(|o| *o == self.options.name_prefix)
    }

    /// Refuse a claim of this name that we do not own.
    pub(crate) fn check_owner(&self, claim: &DynamicObject) -> Result<()> {
        if self.owns(claim) {
            return Ok(());
        }
        Err(Error::Conflict {
            key: claim.metadata.name.clone().unwrap_or_default(),
            reason: format!(
                "a claim of this name exists that this deployment (`{}`) does not own",
                self.options.name_prefix
            ),
        })
    }

    /// The claim object a box describes.
    pub(crate) fn claim_object(&self, config: &BoxConfig) -> DynamicObject {
        let o = &self.options;
        let now = unix_now();
        let expires = now + o.max_age.as_secs();
        let mut labels: BTreeMap<String, String> = o.labels.clone();
        labels.insert(labels::OWNER.into(), o.name_prefix.clone());
        let mut annotations = BTreeMap::new();
        annotations.insert(labels::CREATED_AT.into(), now.to_string());
        annotations.insert(labels::EXPIRES_AT.into(), expires.to_string());
        annotations.insert(labels::ROOT.into(), config.root.clone());
        if let Some(key) = &config.key {
            labels.insert(labels::SCOPE.into(), key.scope().as_str().to_owned());
            annotations.insert(labels::KEY.into(), key.as_str().to_owned());
        }
        let mut claim = DynamicObject::new(&config.claim, &crd::claim_resource());
        claim.metadata = ObjectMeta {
            name: Some(config.claim.clone()),
            namespace: Some(o.namespace.clone()),
            labels: Some(labels),
            annotations: Some(annotations),
            ..ObjectMeta::default()
        };
        claim.data = crd::claim_spec(&o.warm_pool, &crd::rfc3339(expires));
        claim
    }

    /// Remove the claim `name` if it is ours; gone already is fine.
    pub(crate) async fn remove_claim(&self, name: &str) -> Result<()> {
        let control = self.control().await?;
        match control.get_claim(name).await? {
            None => Ok(()),
            Some(c) => {
                self.check_owner(&c)?;
                control.delete_claim(name).await
            }
        }
    }
}

/// The Kubernetes backend's client: one box is one agent-sandbox `SandboxClaim` (and the pod
/// its warm pool binds to it).
///
/// ```no_run
/// # async fn demo() -> sandbox_core::Result<()> {
/// use sandbox_k8s::{K8sClient, K8sOptions};
/// let client = K8sClient::new(K8sOptions::new("agent-pool").namespace("agents"))?;
/// # let _ = client; Ok(()) }
/// ```
#[derive(Debug, Clone)]
pub struct K8sClient {
    shared: Arc<Shared>,
}

impl K8sClient {
    /// A client with `options`. Does not contact the cluster: the first call that needs it
    /// connects (and reports an API that cannot be reached as [`Error::Unavailable`]).
    pub fn new(options: K8sOptions) -> Result<Self> {
        options.validate()?;
        Ok(K8sClient {
            shared: Arc::new(Shared {
                options,
                control: OnceCell::new(),
                http: crate::dataplane::http_client()?,
            }),
        })
    }

    #[cfg(test)]
    pub(crate) fn shared_for_tests(&self) -> Arc<Shared> {
        self.shared.clone()
    }

    /// The options.
    pub fn options(&self) -> &K8sOptions {
        &self.shared.options
    }

    /// The deterministic claim name for `key` (of its kept box).
    pub fn claim_name(&self, key: &IsolationKey) -> String {
        format!("{}-{}", self.shared.options.name_prefix, key.digest())
    }

    fn ephemeral_name(&self, key: &IsolationKey) -> String {
        format!(
            "{}-{}",
            self.claim_name(key),
            &uuid::Uuid::new_v4().simple().to_string()[..8]
        )
    }

    fn config_for(
        &self,
        spec: &WorkspaceSpec,
        claim: String,
        key: Option<IsolationKey>,
    ) -> Result<BoxConfig> {
        let o = &self.shared.options;
        let root = spec
            .root
            .clone()
            .unwrap_or_else(|| o.workspace_root.clone());
        check_root(&root)?;
        for k in spec.env.keys() {
            check_env_name(k)?;
        }
        for (path, host, _) in spec.bind_mounts() {
            // A claim cannot mount a host path: the template owns the pod's volumes.
            tracing::warn!(
                warning = "bind_mount_ignored",
                backend = BACKEND,
                path = %path,
                host = %host.display(),
                "bind-mount entries cannot be mounted through a SandboxClaim: ignored (and left out of snapshots)"
            );
        }
        Ok(BoxConfig {
            claim,
            root,
            key,
            persistence: o.persistence,
            spec_env: spec.env.clone(),
        })
    }
}

#[async_trait]
impl SandboxClient for K8sClient {
    fn backend(&self) -> &'static str {
        BACKEND
    }

    fn capabilities(&self) -> Capabilities {
        let mut c = Capabilities::default();
        c.keep = true;
        c.isolated = true;
        c.exec = match self.shared.options.runtime {
            // Tree kill by the command's marker (see `sandboxd`).
            Runtime::Sandboxd { .. } => ExecFeatures::all(),
            // The legacy runtime takes a command string and nothing else.
            Runtime::Legacy => ExecFeatures::default(),
        };
        c
    }

    #[tracing::instrument(skip_all, fields(backend = BACKEND, key = request.key.map(|k| k.as_str())))]
    async fn create(&self, request: CreateRequest<'_>) -> Result<Box<dyn sandbox_core::BoxHandle>> {
        let shared = &self.shared;
        let key = request.key.cloned();
        let name = match &key {
            Some(k) if shared.options.persistence == Persistence::Keep => self.claim_name(k),
            Some(k) => self.ephemeral_name(k),
            None => format!(
                "{}-anon-{}",
                shared.options.name_prefix,
                &uuid::Uuid::new_v4().simple().to_string()[..12]
            ),
        };
        let config = self.config_for(request.spec, name, key)?;
        let control = shared.control().await?;
        let (claim, created) = match control.get_claim(&config.claim).await? {
            Some(existing) => (existing, false),
            None => control.create_claim(&shared.claim_object(&config)).await?,
        };
        if !created {
            shared.check_owner(&claim)?;
            tracing::info!(claim = %config.claim, "adopting an existing claim of this key");
        }
        Ok(Box::new(K8sBox::new(
            shared.clone(),
            config,
            claim.metadata.uid.clone(),
            created,
        )))
    }

    #[tracing::instrument(skip_all, fields(backend = BACKEND))]
    async fn resume(
        &self,
        state: &dyn SandboxState,
        spec: &WorkspaceSpec,
    ) -> Result<Box<dyn sandbox_core::BoxHandle>> {
        let s = state.downcast::<K8sState>(BACKEND)?;
        if s.namespace != self.shared.options.namespace {
            return Err(Error::invalid(
                "state",
                format!(
                    "the claim lives in namespace `{}`, this client works in `{}`",
                    s.namespace, self.shared.options.namespace
                ),
            ));
        }
        // An ephemeral box did not outlive its call: a claim of its own, and the workspace
        // comes back from the snapshot.
        let ephemeral = self.shared.options.persistence == Persistence::Ephemeral;
        let name = match (&s.key, ephemeral) {
            (Some(k), true) => self.ephemeral_name(k),
            _ => s.claim_name.clone(),
        };
        let mut config = self.config_for(spec, name, s.key.clone())?;
        config.root = s.common.workspace_root.clone();
        check_root(&config.root)?;
        let known = if ephemeral { None } else { s.claim_uid.clone() };
        Ok(Box::new(K8sBox::new(
            self.shared.clone(),
            config,
            known,
            false,
        )))
    }

    #[tracing::instrument(skip_all, fields(backend = BACKEND))]
    async fn delete(&self, state: &dyn SandboxState) -> Result<()> {
        let s = state.downcast::<K8sState>(BACKEND)?;
        self.shared.remove_claim(&s.claim_name).await
    }

    async fn list_owned(&self) -> Result<Vec<OwnedBox>> {
        let control = self.shared.control().await?;
        let selector = format!("{}={}", labels::OWNER, self.shared.options.name_prefix);
        Ok(control
            .list_claims(&selector)
            .await?
            .iter()
            .filter(|c| self.shared.owns(c))
            .map(|c| {
                let annotations = c.metadata.annotations.clone().unwrap_or_default();
                let ms = |key| {
                    annotations
                        .get(key)
                        .and_then(|t| t.parse::<i64>().ok())
                        .map(|s| s * 1000)
                };
                OwnedBox::new(
                    c.metadata.name.clone().unwrap_or_default(),
                    annotations.get(labels::KEY).cloned(),
                    ms(labels::CREATED_AT),
                )
                .expires(ms(labels::EXPIRES_AT))
            })
            .collect())
    }

    fn box_id(&self, state: &dyn SandboxState) -> Result<String> {
        Ok(state.downcast::<K8sState>(BACKEND)?.claim_name.clone())
    }

    async fn remove_owned(&self, id: &str) -> Result<()> {
        self.shared.remove_claim(id).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use sandbox_core::{CallContext, IsolationScope};

    #[test]
    fn claims_carry_owner_expiry_and_key() {
        let client = K8sClient::new(K8sOptions::new("pool").name_prefix("dep1")).unwrap();
        let key =
            IsolationKey::resolve(IsolationScope::User, &CallContext::new("a").user("u")).unwrap();
        let name = client.claim_name(&key);
        crate::options::check_label("claim name", &name, 63).unwrap();
        let config = client
            .config_for(&WorkspaceSpec::default(), name.clone(), Some(key.clone()))
            .unwrap();
        let claim = client.shared.claim_object(&config);
        assert!(client.shared.owns(&claim));
        let a = claim.metadata.annotations.as_ref().unwrap();
        assert_eq!(a[labels::KEY], key.as_str());
        let created: u64 = a[labels::CREATED_AT].parse().unwrap();
        let expires: u64 = a[labels::EXPIRES_AT].parse().unwrap();
        assert_eq!(expires - created, 24 * 3600);
        assert_eq!(claim.data["spec"]["warmPoolRef"]["name"], "pool");
        assert_eq!(
            claim.data["spec"]["lifecycle"]["shutdownTime"],
            crd::rfc3339(expires)
        );
        let mut theirs = claim.clone();
        theirs
            .metadata
            .labels
            .as_mut()
            .unwrap()
            .insert(labels::OWNER.into(), "other".into());
        assert!(matches!(
            client.shared.check_owner(&theirs),
            Err(Error::Conflict { .. })
        ));
    }

    #[test]
    fn legacy_runtime_capabilities_say_what_is_missing() {
        let client = K8sClient::new(
            K8sOptions::new("pool")
                .runtime(Runtime::Legacy)
                .api_url("http://router", None),
        )
        .unwrap();
        let exec = client.capabilities().exec;
        assert!(!exec.env && !exec.cwd && !exec.stdin && !exec.tree_kill);
        let full = K8sClient::new(K8sOptions::new("pool")).unwrap();
        assert_eq!(full.capabilities().exec, ExecFeatures::all());
        assert!(!full.capabilities().bind_mounts);
    }
}
