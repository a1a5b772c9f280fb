//! The sandboxes, their lifecycle (containers started, stopped, removed) and their JSON.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde_json::{Value, json};

use crate::faults::{FailState, Faults};
use crate::{Error, docker};

/// One command of a session.
#[derive(Debug, Clone, Default)]
pub(crate) struct SessionCommand {
    pub id: String,
    pub command: String,
    pub exit_code: Option<i32>,
    pub stdout: String,
    pub stderr: String,
    pub output: String,
}

/// A sandbox record.
#[derive(Debug, Clone)]
pub(crate) struct Sandbox {
    pub id: String,
    pub name: String,
    pub seq: u64,
    pub user: String,
    pub snapshot: Option<String>,
    pub env: BTreeMap<String, String>,
    pub labels: BTreeMap<String, String>,
    pub public: bool,
    pub cpu: i64,
    pub gpu: i64,
    pub memory: i64,
    pub disk: i64,
    pub auto_stop: i64,
    pub auto_archive: i64,
    pub auto_delete: i64,
    pub state: &'static str,
    pub desired: &'static str,
    pub error_reason: Option<String>,
    pub created_at: String,
    pub updated_at: String,
    pub last_activity: Instant,
    pub container: Option<String>,
    pub ip: Option<String>,
    /// Bumped by every start/stop, so a late readiness task of an earlier run does nothing.
    pub generation: u64,
    pub sessions: BTreeMap<String, Vec<SessionCommand>>,
}

fn now() -> String {
    chrono::Utc::now().to_rfc3339_opts(chrono::SecondsFormat::Millis, true)
}

impl Sandbox {
    /// The `Sandbox` DTO (`list` = the `SandboxListItem` subset).
    pub fn to_json(&self, org: &str, toolbox_url: &str, list: bool) -> Value {
        let mut v = json!({
            "id": self.id,
            "organizationId": org,
            "name": self.name,
            "user": self.user,
            "labels": self.labels,
            "public": self.public,
            "networkBlockAll": false,
            "target": "local",
            "cpu": self.cpu,
            "gpu": self.gpu,
            "memory": self.memory,
            "disk": self.disk,
            "state": self.state,
            "desiredState": self.desired,
            "autoStopInterval": self.auto_stop,
            "autoArchiveInterval": self.auto_archive,
            "autoDeleteInterval": self.auto_delete,
            "createdAt": self.created_at,
            "updatedAt": self.updated_at,
            "daemonVersion": "0.0.0-testserver",
            "backupState": "None",
            "toolboxProxyUrl": toolbox_url,
        });
        if let Some(s) = &self.snapshot {
            v["snapshot"] = json!(s);
        }
        if let Some(r) = &self.error_reason {
            v["errorReason"] = json!(r);
            v["recoverable"] = json!(false);
        }
        if !list {
            v["env"] = json!(self.env);
            v["kvm"] = json!(false);
            v["volumes"] = json!([]);
        }
        v
    }
}

/// Shared state of the API and toolbox servers.
pub(crate) struct Inner {
    pub api_key: String,
    pub org_id: String,
    pub image: String,
    pub network: Option<String>,
    pub server_id: String,
    pub toolbox_url: Mutex<String>,
    pub sandboxes: Mutex<BTreeMap<String, Sandbox>>,
    pub seq: AtomicU64,
    pub in_flight: AtomicUsize,
    pub faults: Faults,
    pub http: reqwest::Client,
    pub autostop_unit: Duration,
    pub ready_timeout: Duration,
}

/// What a lookup by id or name finds.
pub(crate) type Lookup = Result<Sandbox, String>;

impl Inner {
    pub fn lock(&self) -> std::sync::MutexGuard<'_, BTreeMap<String, Sandbox>> {
        self.sandboxes.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub fn toolbox_url(&self) -> String {
        self.toolbox_url
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// The id of the sandbox whose id or name is `key`.
    pub fn resolve(&self, key: &str) -> Option<String> {
        let map = self.lock();
        if map.contains_key(key) {
            return Some(key.to_owned());
        }
        map.values().find(|s| s.name == key).map(|s| s.id.clone())
    }

    pub fn get(&self, key: &str) -> Lookup {
        let id = self.resolve(key).ok_or_else(|| key.to_owned())?;
        self.lock().get(&id).cloned().ok_or_else(|| key.to_owned())
    }

    pub fn json(&self, s: &Sandbox) -> Value {
        s.to_json(&self.org_id, &self.toolbox_url(), false)
    }

    /// Change a record, if it still exists; the closure's value.
    pub fn update<T>(&self, id: &str, f: impl FnOnce(&mut Sandbox) -> T) -> Option<T> {
        let mut map = self.lock();
        let s = map.get_mut(id)?;
        let r = f(s);
        s.updated_at = now();
        Some(r)
    }

    /// Record a new sandbox and (unless a fault says otherwise) start its container.
    pub fn create(self: &Arc<Self>, mut sb: Sandbox) -> Sandbox {
        sb.seq = self.seq.fetch_add(1, Ordering::SeqCst);
        sb.created_at = now();
        sb.updated_at = sb.created_at.clone();
        if let Some((state, reason)) = self.faults.take_create_failure() {
            sb.state = state.as_str();
            sb.error_reason = Some(reason);
            self.lock().insert(sb.id.clone(), sb.clone());
            return sb;
        }
        sb.state = "creating";
        self.lock().insert(sb.id.clone(), sb.clone());
        let this = self.clone();
        let id = sb.id.clone();
        let env: Vec<(String, String)> = sb.env.clone().into_iter().collect();
        tokio::spawn(async move { this.boot(id, env, sb.generation).await });
        sb
    }

    fn fail(&self, id: &str, reason: String) {
        tracing::warn!(%id, %reason, "sandbox failed");
        self.update(id, |s| {
            s.state = "error";
            s.error_reason = Some(reason);
        });
    }

    /// Run the container of a new sandbox and wait until sandboxd answers.
    async fn boot(self: Arc<Self>, id: String, env: Vec<(String, String)>, generation: u64) {
        let Some(network) = self.network.clone() else {
            self.fail(&id, "the server runs without Docker".into());
            return;
        };
        let short: String = id.chars().take(12).collect();
        let name = format!("dtts-{}-{short}", self.server_id);
        let mut env = env;
        env.push(("SANDBOX_BASE_DIR".into(), "/".into()));
        // Never `docker run` a missing image: the engine would try a registry.
        match docker::image_exists(&self.image).await {
            Ok(true) => {}
            Ok(false) => return self.fail(&id, format!("image {} not found", self.image)),
            Err(e) => return self.fail(&id, e.to_string()),
        }
        self.in_flight.fetch_add(1, Ordering::SeqCst);
        let run = docker::run(&name, &self.image, &env, &network, &self.server_id).await;
        self.in_flight.fetch_sub(1, Ordering::SeqCst);
        let container = match run {
            Ok(c) => c,
            Err(e) => return self.fail(&id, e.to_string()),
        };
        let still = self.update(&id, |s| s.container = Some(container.clone()));
        if still.is_none() {
            // Deleted while starting.
            let _ = docker::remove(&container).await;
            return;
        }
        self.wait_ready(&id, &container, generation).await;
    }

    /// Find the container's address and wait for sandboxd's REST and gRPC ports; then
    /// `started`.
    async fn wait_ready(&self, id: &str, container: &str, generation: u64) {
        let network = self.network.clone().unwrap_or_default();
        let deadline = Instant::now() + self.ready_timeout;
        loop {
            if Instant::now() > deadline {
                return self.fail(id, "sandboxd did not answer in time".into());
            }
            let current = self.lock().get(id).map(|s| s.generation);
            if current != Some(generation) {
                return;
            }
            let ip = docker::ip(container, &network).await.unwrap_or_default();
            if !ip.is_empty() {
                let mut ok = true;
                for port in [
                    sandboxd_proto::DEFAULT_GRPC_PORT,
                    sandboxd_proto::DEFAULT_REST_PORT,
                ] {
                    let connect = tokio::net::TcpStream::connect((ip.as_str(), port));
                    ok &= matches!(
                        tokio::time::timeout(Duration::from_millis(500), connect).await,
                        Ok(Ok(_))
                    );
                }
                if ok {
                    self.update(id, |s| {
                        if s.generation == generation {
                            s.ip = Some(ip.clone());
                            s.state = "started";
                            s.last_activity = Instant::now();
                        }
                    });
                    return;
                }
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// `POST /sandbox/{id}/start`: from `stopped`, `docker start` and wait for readiness.
    pub fn start(self: &Arc<Self>, id: &str) -> Result<Sandbox, (u16, String)> {
        let (container, generation, sb) = {
            let mut map = self.lock();
            let s = map
                .get_mut(id)
                .ok_or((404, format!("Sandbox with ID or name {id} not found")))?;
            match s.state {
                "started" | "starting" | "creating" => return Ok(s.clone()),
                "stopped" => {}
                other => {
                    return Err((
                        400,
                        format!("Sandbox is in state {other} and cannot be started"),
                    ));
                }
            }
            s.state = "starting";
            s.desired = "started";
            s.generation += 1;
            s.updated_at = now();
            (s.container.clone(), s.generation, s.clone())
        };
        let this = self.clone();
        let id = id.to_owned();
        tokio::spawn(async move {
            let Some(container) = container else {
                return this.fail(&id, "the sandbox has no container".into());
            };
            if let Err(e) = docker::start(&container).await {
                return this.fail(&id, e.to_string());
            }
            this.wait_ready(&id, &container, generation).await;
        });
        Ok(sb)
    }

    /// `POST /sandbox/{id}/stop`: `docker stop`, `stopping` → `stopped`.
    pub fn stop(self: &Arc<Self>, id: &str) -> Result<Sandbox, (u16, String)> {
        let (container, generation, sb) = {
            let mut map = self.lock();
            let s = map
                .get_mut(id)
                .ok_or((404, format!("Sandbox with ID or name {id} not found")))?;
            match s.state {
                "stopped" | "stopping" => return Ok(s.clone()),
                "started" => {}
                other => {
                    return Err((
                        400,
                        format!("Sandbox is in state {other} and cannot be stopped"),
                    ));
                }
            }
            s.state = "stopping";
            s.desired = "stopped";
            s.generation += 1;
            s.ip = None;
            s.sessions.clear();
            s.updated_at = now();
            (s.container.clone(), s.generation, s.clone())
        };
        let this = self.clone();
        let id = id.to_owned();
        tokio::spawn(async move {
            if let Some(c) = container
                && let Err(e) = docker::stop(&c).await
            {
                return this.fail(&id, e.to_string());
            }
            this.update(&id, |s| {
                if s.generation == generation {
                    s.state = "stopped";
                }
            });
        });
        Ok(sb)
    }

    /// `DELETE /sandbox/{id}`: forget it, remove its container in the background.
    pub fn delete(&self, id: &str) -> Option<Sandbox> {
        let mut sb = self.lock().remove(id)?;
        sb.state = "destroying";
        sb.desired = "destroyed";
        if let Some(c) = sb.container.clone() {
            tokio::spawn(async move {
                if let Err(e) = docker::remove(&c).await {
                    tracing::warn!(error = %e, "removing a deleted sandbox's container");
                }
            });
        }
        Some(sb)
    }

    pub async fn vanish(&self, key: &str) -> Result<(), Error> {
        let id = self
            .resolve(key)
            .ok_or_else(|| Error::Api(format!("no sandbox {key}")))?;
        let sb = self.lock().remove(&id);
        if let Some(c) = sb.and_then(|s| s.container) {
            docker::remove(&c).await?;
        }
        Ok(())
    }

    pub async fn break_sandbox(
        &self,
        key: &str,
        state: FailState,
        reason: &str,
    ) -> Result<(), Error> {
        let id = self
            .resolve(key)
            .ok_or_else(|| Error::Api(format!("no sandbox {key}")))?;
        let container = self
            .update(&id, |s| {
                s.state = state.as_str();
                s.error_reason = Some(reason.to_owned());
                s.generation += 1;
                s.ip = None;
                s.container.clone()
            })
            .flatten();
        if let Some(c) = container {
            docker::stop(&c).await?;
        }
        Ok(())
    }

    /// Stop sandboxes idle for longer than their auto-stop interval.
    pub async fn autostop_loop(self: Arc<Self>, mut stop: tokio::sync::watch::Receiver<bool>) {
        loop {
            tokio::select! {
                _ = tokio::time::sleep(Duration::from_millis(250)) => {}
                _ = stop.changed() => return,
            }
            let idle: Vec<String> = self
                .lock()
                .values()
                .filter(|s| {
                    s.state == "started"
                        && s.auto_stop > 0
                        && s.last_activity.elapsed()
                            > self.autostop_unit * u32::try_from(s.auto_stop).unwrap_or(u32::MAX)
                })
                .map(|s| s.id.clone())
                .collect();
            for id in idle {
                tracing::info!(%id, "auto-stopping an idle sandbox");
                let _ = self.stop(&id);
            }
        }
    }

    /// A fresh record with the platform defaults.
    pub fn blank(&self, id: String) -> Sandbox {
        Sandbox {
            name: id.clone(),
            id,
            seq: 0,
            user: "root".into(),
            snapshot: None,
            env: BTreeMap::new(),
            labels: BTreeMap::new(),
            public: false,
            cpu: 1,
            gpu: 0,
            memory: 1,
            disk: 3,
            auto_stop: 15,
            auto_archive: 10080,
            auto_delete: -1,
            state: "creating",
            desired: "started",
            error_reason: None,
            created_at: String::new(),
            updated_at: String::new(),
            last_activity: Instant::now(),
            container: None,
            ip: None,
            generation: 0,
            sessions: BTreeMap::new(),
        }
    }
}
