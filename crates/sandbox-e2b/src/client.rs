//! [`E2bClient`]: makes, finds, removes and collects E2B sandboxes.

use std::collections::BTreeMap;
use std::sync::Arc;

use sandbox_core::posix::{check_env_name, check_root};
use sandbox_core::{
    Capabilities, CreateRequest, Error, ExecFeatures, IsolationKey, OwnedBox, Persistence, Result,
    SandboxClient, SandboxState, WorkspaceSpec, async_trait,
};

use crate::BACKEND;
use crate::api::Api;
use crate::boxed::{BoxConfig, E2bBox};
use crate::options::{E2bOptions, E2bPersistence};
use crate::state::E2bState;

/// State shared by a client and its boxes.
#[derive(Debug)]
pub(crate) struct Shared {
    pub options: E2bOptions,
    pub api: Api,
    pub envd_http: reqwest::Client,
}

impl Shared {
    pub(crate) fn check_native(&self) -> Result<()> {
        if self.options.snapshots == E2bPersistence::NativeSnapshot {
            Ok(())
        } else {
            Err(Error::NotSupported {
                backend: BACKEND,
                operation: "native snapshots with E2bPersistence::Tar (choose NativeSnapshot)",
            })
        }
    }

    fn owner_filter(&self) -> BTreeMap<String, String> {
        BTreeMap::from([(
            sandbox_cloud::owner::OWNER.to_owned(),
            self.options.owner.clone(),
        )])
    }

    /// Remove sandbox `id` if it carries our owner mark; gone already is fine.
    async fn remove_if_ours(&self, id: &str) -> Result<()> {
        let Some(s) = self.api.get(id).await? else {
            return Ok(());
        };
        if sandbox_cloud::owner::owned_box(id, &self.options.owner, &s.metadata).is_none() {
            return Err(Error::Conflict {
                key: id.to_owned(),
                reason: format!(
                    "the e2b sandbox does not carry this deployment's owner mark (`{}`)",
                    self.options.owner
                ),
            });
        }
        self.api.delete(id).await.map(|_| ())
    }
}

/// The E2B backend's client: one box is one E2B sandbox.
///
/// ```no_run
/// # async fn demo() -> sandbox_core::Result<()> {
/// use sandbox_e2b::{E2bClient, E2bOptions};
/// // E2B_API_KEY (and optionally E2B_DOMAIN / E2B_API_URL) from the environment.
/// let client = E2bClient::new(E2bOptions::from_env().template("base"))?;
/// # let _ = client; Ok(()) }
/// ```
#[derive(Debug, Clone)]
pub struct E2bClient {
    shared: Arc<Shared>,
}

impl E2bClient {
    /// A client with `options`. Does not contact E2B: the first call that needs it does.
    pub fn new(options: E2bOptions) -> Result<Self> {
        options.validate()?;
        let key = options.api_key.clone().expect("validated");
        let api = Api::new(&options.api_url, key, options.http.clone())?;
        Ok(E2bClient {
            shared: Arc::new(Shared {
                options,
                api,
                envd_http: crate::envd::http_client()?,
            }),
        })
    }

    /// The options.
    pub fn options(&self) -> &E2bOptions {
        &self.shared.options
    }

    fn config_for(&self, spec: &WorkspaceSpec, key: Option<IsolationKey>) -> Result<BoxConfig> {
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
            // A host path cannot reach a remote microVM.
            tracing::warn!(
                warning = "bind_mount_ignored",
                backend = BACKEND,
                path = %path,
                host = %host.display(),
                "bind-mount entries cannot be mounted into an E2B sandbox: ignored (and left out of snapshots)"
            );
        }
        Ok(BoxConfig {
            root,
            key,
            persistence: o.persistence,
            spec_env: spec.env.clone(),
        })
    }
}

#[async_trait]
impl SandboxClient for E2bClient {
    fn backend(&self) -> &'static str {
        BACKEND
    }

    fn capabilities(&self) -> Capabilities {
        let mut c = Capabilities::default();
        c.keep = true;
        c.isolated = true;
        c.native_snapshots = self.shared.options.snapshots == E2bPersistence::NativeSnapshot;
        // envd takes stdin (SendInput/CloseStdin); tree kill by the command's marker.
        c.exec = ExecFeatures::all();
        c
    }

    #[tracing::instrument(skip_all, fields(backend = BACKEND, key = request.key.map(|k| k.as_str())))]
    async fn create(&self, request: CreateRequest<'_>) -> Result<Box<dyn sandbox_core::BoxHandle>> {
        let config = self.config_for(request.spec, request.key.cloned())?;
        Ok(Box::new(E2bBox::new(
            self.shared.clone(),
            config,
            None,
            self.shared.options.template.clone(),
            None,
            false,
        )))
    }

    #[tracing::instrument(skip_all, fields(backend = BACKEND))]
    async fn resume(
        &self,
        state: &dyn SandboxState,
        spec: &WorkspaceSpec,
    ) -> Result<Box<dyn sandbox_core::BoxHandle>> {
        let s = state.downcast::<E2bState>(BACKEND)?;
        let mut config = self.config_for(spec, s.key.clone())?;
        config.root = s.common.workspace_root.clone();
        check_root(&config.root)?;
        // An ephemeral box did not outlive its call: a sandbox of its own, and the workspace
        // comes back from the snapshot.
        let ephemeral = self.shared.options.persistence == Persistence::Ephemeral;
        let (id, template) = if ephemeral {
            (None, self.shared.options.template.clone())
        } else {
            (s.sandbox_id.clone(), s.template.clone())
        };
        Ok(Box::new(E2bBox::new(
            self.shared.clone(),
            config,
            id,
            template,
            s.domain.clone(),
            ephemeral,
        )))
    }

    #[tracing::instrument(skip_all, fields(backend = BACKEND))]
    async fn delete(&self, state: &dyn SandboxState) -> Result<()> {
        let s = state.downcast::<E2bState>(BACKEND)?;
        match &s.sandbox_id {
            Some(id) => self.shared.remove_if_ours(id).await,
            None => Ok(()),
        }
    }

    async fn list_owned(&self) -> Result<Vec<OwnedBox>> {
        let owner = &self.shared.options.owner;
        Ok(self
            .shared
            .api
            .list(&self.shared.owner_filter())
            .await?
            .iter()
            .filter_map(|s| sandbox_cloud::owner::owned_box(&s.id, owner, &s.metadata))
            .collect())
    }

    fn box_id(&self, state: &dyn SandboxState) -> Result<String> {
        Ok(state
            .downcast::<E2bState>(BACKEND)?
            .sandbox_id
            .clone()
            .unwrap_or_default())
    }

    async fn remove_owned(&self, id: &str) -> Result<()> {
        self.shared.remove_if_ours(id).await
    }

    async fn delete_native_snapshot(&self, reference: &str) -> Result<()> {
        if self.shared.api.delete_snapshot(reference).await? {
            tracing::info!(snapshot = %reference, "native snapshot deleted");
        }
        Ok(())
    }
}
