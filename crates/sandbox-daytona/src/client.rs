//! [`DaytonaClient`]: makes, finds, removes and collects Daytona sandboxes.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use sandbox_cloud::owner;
use sandbox_core::posix::{check_env_name, check_root};
use sandbox_core::{
    Capabilities, CreateRequest, Error, ExecFeatures, IsolationKey, OwnedBox, Persistence, Result,
    SandboxClient, SandboxState, WorkspaceSpec, async_trait,
};
use serde_json::{Value, json};

use crate::BACKEND;
use crate::api::{Api, SandboxDto};
use crate::boxed::{BoxConfig, DaytonaBox};
use crate::options::{DaytonaOptions, Source};
use crate::state::DaytonaState;

/// State shared by a client and its boxes.
#[derive(Debug)]
pub(crate) struct Shared {
    pub options: DaytonaOptions,
    pub api: Api,
}

/// Whether a sandbox state is one it does not leave by itself.
fn failed(state: &str) -> bool {
    matches!(state, "error" | "build_failed")
}

impl Shared {
    /// Whether the sandbox's labels say this deployment owns it.
    pub(crate) fn owns(&self, s: &SandboxDto) -> bool {
        s.labels.get(owner::OWNER).map(String::as_str) == Some(self.options.name_prefix.as_str())
    }

    /// Refuse a sandbox of this name that we do not own.
    pub(crate) fn check_owner(&self, s: &SandboxDto) -> Result<()> {
        if self.owns(s) {
            return Ok(());
        }
        Err(Error::Conflict {
            key: s.name.clone(),
            reason: format!(
                "a Daytona sandbox of this name exists that this deployment (`{}`) does not own",
                self.options.name_prefix
            ),
        })
    }

    /// The `CreateSandbox` body of a box.
    pub(crate) fn create_body(&self, config: &BoxConfig) -> Value {
        let o = &self.options;
        let now = SystemTime::now();
        let mut labels: BTreeMap<String, String> = o.labels.clone();
        labels.extend(owner::tags(
            &o.name_prefix,
            config.key.as_ref(),
            now,
            Some(now + o.max_age),
        ));
        let mut body = json!({
            "name": config.name,
            "labels": labels,
            "env": o.env,
            "autoStopInterval": o.auto_stop_minutes,
        });
        match &o.source {
            Source::Default => {}
            Source::Snapshot(s) => body["snapshot"] = json!(s),
            Source::Image(image) => {
                body["buildInfo"] = json!({"dockerfileContent": format!("FROM {image}\n")});
                for (field, v) in [("cpu", o.cpu), ("memory", o.memory_gb), ("disk", o.disk_gb)] {
                    if let Some(v) = v {
                        body[field] = json!(v);
                    }
                }
            }
        }
        body
    }

    /// Create the box's sandbox. `POST /sandbox` is not retried blindly: after a failure
    /// that may have happened (5xx, timeout, lost connection) the name is looked up, and a
    /// sandbox of ours under it is the one that was made.
    pub(crate) async fn create_sandbox(&self, config: &BoxConfig) -> Result<SandboxDto> {
        let body = self.create_body(config);
        match self.api.create(&body).await {
            Ok(s) => {
                tracing::info!(sandbox = %s.id, name = %s.name, state = s.state(), "sandbox created");
                Ok(s)
            }
            Err(
                e @ (Error::Backend { .. } | Error::Timeout { .. } | Error::Unavailable { .. }),
            ) => match self.api.get(&config.name).await {
                Ok(Some(s)) if self.owns(&s) => {
                    tracing::warn!(name = %config.name, error = %e, "create failed but the sandbox exists: adopting it");
                    Ok(s)
                }
                _ => Err(e),
            },
            Err(Error::Conflict { .. }) => {
                // The name is taken: ours (a concurrent create) is adopted, anyone else's is
                // refused.
                let s = self
                    .api
                    .get(&config.name)
                    .await?
                    .ok_or_else(|| Error::Conflict {
                        key: config.name.clone(),
                        reason: "the name is taken".into(),
                    })?;
                self.check_owner(&s)?;
                Ok(s)
            }
            Err(e) => Err(e),
        }
    }

    /// Wait until the sandbox `id` is `started`, starting it when it is stopped. `error` and
    /// `build_failed` are a typed [`Error::Backend`]; a sandbox that disappears is
    /// [`Error::NotFound`]; past `start_timeout` [`Error::Timeout`].
    pub(crate) async fn wait_started(&self, id: &str) -> Result<SandboxDto> {
        let started = Instant::now();
        let timeout = self.options.start_timeout;
        let mut pause = Duration::from_millis(100);
        let mut start_sent = false;
        loop {
            let Some(s) = self.api.get(id).await? else {
                return Err(Error::NotFound {
                    what: "daytona sandbox",
                    key: id.to_owned(),
                });
            };
            match s.state() {
                "started" => return Ok(s),
                st if failed(st) => {
                    return Err(Error::backend(
                        BACKEND,
                        "start sandbox",
                        format!(
                            "sandbox {} is in state `{st}`: {}",
                            s.id,
                            s.error_reason.as_deref().unwrap_or("no reason given")
                        ),
                    ));
                }
                "destroyed" | "destroying" => {
                    return Err(Error::NotFound {
                        what: "daytona sandbox",
                        key: id.to_owned(),
                    });
                }
                "stopped" | "archived" | "paused" if !start_sent => {
                    tracing::info!(sandbox = %s.id, state = s.state(), "starting the sandbox");
                    self.api.lifecycle(&s.id, "start").await?;
                    start_sent = true;
                }
                _ => {}
            }
            if started.elapsed() >= timeout {
                return Err(Error::Timeout {
                    operation: format!("daytona sandbox {id} reaching `started`"),
                    after: timeout,
                });
            }
            tokio::time::sleep(pause).await;
            pause = (pause * 3 / 2).min(Duration::from_secs(1));
        }
    }

    /// Remove the sandbox `id_or_name` if it is ours; gone already is fine.
    pub(crate) async fn remove(&self, id_or_name: &str) -> Result<()> {
        match self.api.get(id_or_name).await? {
            None => Ok(()),
            Some(s) => {
                self.check_owner(&s)?;
                self.api.delete(&s.id).await
            }
        }
    }
}

/// The Daytona backend's client: one box is one Daytona sandbox.
///
/// ```no_run
/// # async fn demo() -> sandbox_core::Result<()> {
/// use sandbox_daytona::{DaytonaClient, DaytonaOptions};
/// let client = DaytonaClient::new(DaytonaOptions::from_env()?)?;
/// # let _ = client; Ok(()) }
/// ```
#[derive(Debug, Clone)]
pub struct DaytonaClient {
    shared: Arc<Shared>,
}

impl DaytonaClient {
    /// A client with `options` (checked). Does not contact Daytona.
    pub fn new(options: DaytonaOptions) -> Result<Self> {
        options.validate()?;
        let key = options
            .api_key
            .clone()
            .ok_or_else(|| Error::invalid("api key", "missing"))?;
        let api = Api::new(&options.api_url, key, &options.http)?;
        Ok(DaytonaClient {
            shared: Arc::new(Shared { options, api }),
        })
    }

    /// The options.
    pub fn options(&self) -> &DaytonaOptions {
        &self.shared.options
    }

    /// The deterministic sandbox name for `key` (of its kept box).
    pub fn sandbox_name(&self, key: &IsolationKey) -> String {
        format!("{}-{}", self.shared.options.name_prefix, key.digest())
    }

    fn ephemeral_name(&self, key: &IsolationKey) -> String {
        format!(
            "{}-{}",
            self.sandbox_name(key),
            &uuid::Uuid::new_v4().simple().to_string()[..8]
        )
    }

    fn config_for(
        &self,
        spec: &WorkspaceSpec,
        name: String,
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
            // A remote sandbox cannot mount a path of this host.
            tracing::warn!(
                warning = "bind_mount_ignored",
                backend = BACKEND,
                path = %path,
                host = %host.display(),
                "bind-mount entries cannot be mounted into a Daytona sandbox: ignored (and left out of snapshots)"
            );
        }
        Ok(BoxConfig {
            name,
            root,
            key,
            persistence: o.persistence,
            spec_env: spec.env.clone(),
        })
    }
}

#[async_trait]
impl SandboxClient for DaytonaClient {
    fn backend(&self) -> &'static str {
        BACKEND
    }

    fn capabilities(&self) -> Capabilities {
        let mut c = Capabilities::default();
        c.keep = true;
        c.isolated = true;
        // Env and cwd by the wrapper, stdin through an uploaded file, tree kill by the
        // daemon's process-group kill at the timeout.
        c.exec = ExecFeatures::all();
        c
    }

    #[tracing::instrument(skip_all, fields(backend = BACKEND, key = request.key.map(|k| k.as_str())))]
    async fn create(&self, request: CreateRequest<'_>) -> Result<Box<dyn sandbox_core::BoxHandle>> {
        let shared = &self.shared;
        let key = request.key.cloned();
        let name = match &key {
            Some(k) if shared.options.persistence == Persistence::Keep => self.sandbox_name(k),
            Some(k) => self.ephemeral_name(k),
            None => format!(
                "{}-anon-{}",
                shared.options.name_prefix,
                &uuid::Uuid::new_v4().simple().to_string()[..12]
            ),
        };
        let config = self.config_for(request.spec, name, key)?;
        let (sandbox, fresh) = match shared.api.get(&config.name).await? {
            Some(existing) => {
                shared.check_owner(&existing)?;
                tracing::info!(name = %config.name, "adopting the existing sandbox of this key");
                (existing, false)
            }
            None => (shared.create_sandbox(&config).await?, true),
        };
        Ok(Box::new(DaytonaBox::new(
            shared.clone(),
            config,
            Some(sandbox.id),
            fresh,
        )))
    }

    #[tracing::instrument(skip_all, fields(backend = BACKEND))]
    async fn resume(
        &self,
        state: &dyn SandboxState,
        spec: &WorkspaceSpec,
    ) -> Result<Box<dyn sandbox_core::BoxHandle>> {
        let s = state.downcast::<DaytonaState>(BACKEND)?;
        // An ephemeral box did not outlive its call: a sandbox of its own, and the workspace
        // comes back from the snapshot.
        let ephemeral = self.shared.options.persistence == Persistence::Ephemeral;
        let name = match (&s.key, ephemeral) {
            (Some(k), true) => self.ephemeral_name(k),
            _ => s.name.clone(),
        };
        let mut config = self.config_for(spec, name, s.key.clone())?;
        config.root = s.common.workspace_root.clone();
        check_root(&config.root)?;
        let known = if ephemeral {
            None
        } else {
            s.sandbox_id.clone()
        };
        Ok(Box::new(DaytonaBox::new(
            self.shared.clone(),
            config,
            known,
            false,
        )))
    }

    #[tracing::instrument(skip_all, fields(backend = BACKEND))]
    async fn delete(&self, state: &dyn SandboxState) -> Result<()> {
        let s = state.downcast::<DaytonaState>(BACKEND)?;
        match &s.sandbox_id {
            Some(id) => self.shared.remove(id).await,
            None => self.shared.remove(&s.name).await,
        }
    }

    async fn list_owned(&self) -> Result<Vec<OwnedBox>> {
        let prefix = &self.shared.options.name_prefix;
        let filter = BTreeMap::from([(owner::OWNER.to_owned(), prefix.clone())]);
        Ok(self
            .shared
            .api
            .list(&filter)
            .await?
            .iter()
            .filter_map(|s| owner::owned_box(&s.name, prefix, &s.labels))
            .collect())
    }

    fn box_id(&self, state: &dyn SandboxState) -> Result<String> {
        Ok(state.downcast::<DaytonaState>(BACKEND)?.name.clone())
    }

    async fn remove_owned(&self, id: &str) -> Result<()> {
        self.shared.remove(id).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use sandbox_cloud::Secret;
    use sandbox_core::{CallContext, IsolationScope};

    fn client(o: DaytonaOptions) -> DaytonaClient {
        DaytonaClient::new(o).unwrap()
    }

    #[test]
    fn create_body_carries_owner_labels_and_source() {
        let c = client(
            DaytonaOptions::new("http://x/api", Secret::new("k"))
                .name_prefix("dep1")
                .label("team", "a")
                .env("A", "1")
                .auto_stop_minutes(5),
        );
        let key =
            IsolationKey::resolve(IsolationScope::User, &CallContext::new("a").user("u")).unwrap();
        let config = c
            .config_for(
                &WorkspaceSpec::default(),
                c.sandbox_name(&key),
                Some(key.clone()),
            )
            .unwrap();
        let body = c.shared.create_body(&config);
        assert_eq!(body["labels"][owner::OWNER], "dep1");
        assert_eq!(body["labels"][owner::KEY], key.as_str());
        assert_eq!(body["labels"]["team"], "a");
        assert_eq!(body["env"]["A"], "1");
        assert_eq!(body["autoStopInterval"], 5);
        assert!(body.get("snapshot").is_none() && body.get("cpu").is_none());
        // An image travels as a Dockerfile, with the resources.
        let c = client(
            DaytonaOptions::new("http://x/api", Secret::new("k"))
                .image("debian:12")
                .resources(2, 4, 10),
        );
        let body = c.shared.create_body(&config);
        assert_eq!(body["buildInfo"]["dockerfileContent"], "FROM debian:12\n");
        assert_eq!(
            (body["cpu"].as_u64(), body["memory"].as_u64()),
            (Some(2), Some(4))
        );
        let c = client(DaytonaOptions::new("http://x/api", Secret::new("k")).snapshot("snap"));
        assert_eq!(c.shared.create_body(&config)["snapshot"], "snap");
    }

    #[test]
    fn capabilities_say_no_bind_mounts() {
        let c = client(DaytonaOptions::new("http://x/api", Secret::new("k")));
        let caps = c.capabilities();
        assert!(!caps.bind_mounts && caps.keep && caps.isolated);
        assert_eq!(caps.exec, ExecFeatures::all());
    }
}
