//! The agent-sandbox controller: warm pools, claim binding (adopt or cold-create), pods as
//! Docker containers, readiness, expiry, and the status of every object.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde_json::{Value, json};
use tokio::sync::{Notify, watch};

use crate::docker::{self, ContainerSpec};
use crate::error::ApiError;
use crate::store::{CLAIM, Part, ResourceDef, SANDBOX, Store, TEMPLATE, WARM_POOL};

/// Claim annotation naming the adopted Sandbox.
pub const SANDBOX_NAME_ANNOTATION: &str = "agents.x-k8s.io/sandbox-name";
/// Sandbox annotation naming its pod.
pub const POD_NAME_ANNOTATION: &str = "agents.x-k8s.io/pod-name";
/// Label of warm-pool Sandboxes (value: the pool's name); removed on adoption.
pub const WARM_POOL_LABEL: &str = "agents.x-k8s.io/warm-pool-sandbox";
/// Label/annotation naming the template a Sandbox was made from.
pub const TEMPLATE_REF: &str = "agents.x-k8s.io/sandbox-template-ref";
/// Annotation: `cold` or `warm`.
pub const LAUNCH_TYPE: &str = "agents.x-k8s.io/launch-type";
/// Label carrying the uid of the claim a Sandbox serves.
pub const CLAIM_UID_LABEL: &str = "agents.x-k8s.io/claim-uid";
/// The port probed for readiness when the template declares none.
pub const DEFAULT_PORT: u16 = 8888;

/// The state of one pod (keyed by Sandbox uid).
#[derive(Debug, Clone)]
enum PodState {
    Starting,
    Running {
        container: String,
        ip: String,
        ready: bool,
        exited: Option<i64>,
    },
    Failed(String),
}

/// The pods of a cluster, by Sandbox uid.
#[derive(Debug, Default)]
pub struct Pods {
    map: Mutex<HashMap<String, PodState>>,
}

impl Pods {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, PodState>> {
        self.map.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// How many pods are being started (a `docker run` in flight).
    pub fn starting(&self) -> usize {
        self.lock()
            .values()
            .filter(|s| matches!(s, PodState::Starting))
            .count()
    }

    /// The container id of a Sandbox's pod.
    pub fn container_of(&self, uid: &str) -> Option<String> {
        match self.lock().get(uid) {
            Some(PodState::Running { container, .. }) => Some(container.clone()),
            _ => None,
        }
    }
}

pub(crate) struct Controller {
    pub store: Arc<Store>,
    pub pods: Arc<Pods>,
    pub network: String,
    pub cluster_id: String,
    pub kick: Arc<Notify>,
}

fn meta<'a>(o: &'a Value, f: &str) -> &'a str {
    o["metadata"][f].as_str().unwrap_or("")
}

fn now() -> String {
    chrono::Utc::now().to_rfc3339_opts(chrono::SecondsFormat::Secs, true)
}

fn in_past(ts: &Value) -> bool {
    ts.as_str()
        .and_then(|t| chrono::DateTime::parse_from_rfc3339(t).ok())
        .is_some_and(|t| t <= chrono::Utc::now())
}

fn controller_ref(res: &ResourceDef, owner: &Value) -> Value {
    json!({
        "apiVersion": res.api_version(), "kind": res.kind, "name": meta(owner, "name"),
        "uid": meta(owner, "uid"), "controller": true, "blockOwnerDeletion": true,
    })
}

fn controlled_by(o: &Value, uid: &str) -> bool {
    o["metadata"]["ownerReferences"]
        .as_array()
        .is_some_and(|refs| {
            refs.iter()
                .any(|r| r["uid"] == uid && r["controller"] == true)
        })
}

/// A Ready condition, keeping the transition time when nothing changed.
fn ready_condition(
    old: Option<&Value>,
    status: &str,
    reason: &str,
    message: &str,
    generation: &Value,
) -> Value {
    let same = old.is_some_and(|c| c["status"] == status && c["reason"] == reason);
    let since = match old {
        Some(c) if same => c["lastTransitionTime"].clone(),
        _ => json!(now()),
    };
    json!({"type": "Ready", "status": status, "reason": reason, "message": message,
           "lastTransitionTime": since, "observedGeneration": generation})
}

fn find_ready(status: &Value) -> Option<&Value> {
    status["conditions"]
        .as_array()?
        .iter()
        .find(|c| c["type"] == "Ready")
}

/// Write `status` through the status subresource if it changed (409s wait for the next pass).
fn write_status(store: &Store, res: &'static ResourceDef, obj: &Value, status: Value) {
    if obj.get("status") == Some(&status) {
        return;
    }
    let mut body = obj.clone();
    body["status"] = status;
    if let Err(e) = store.replace(
        res,
        meta(obj, "namespace"),
        meta(obj, "name"),
        body,
        Part::Status,
    ) && e.code != 409
        && e.code != 404
    {
        tracing::warn!(error = %e, "status update failed");
    }
}

fn ignore_gone(r: Result<Value, ApiError>) {
    if let Err(e) = r
        && e.code != 404
        && e.code != 409
    {
        tracing::warn!(error = %e, "controller write failed");
    }
}

/// The container spec of a Sandbox: `spec.podTemplate.spec.containers[0]`.
fn container_spec(sb: &Value) -> Result<(ContainerSpec, Vec<u16>), String> {
    let c = &sb["spec"]["podTemplate"]["spec"]["containers"][0];
    let image = c["image"]
        .as_str()
        .ok_or("spec.podTemplate.spec.containers[0].image is required")?;
    let strings = |v: &Value| -> Vec<String> {
        v.as_array()
            .map(|a| {
                a.iter()
                    .filter_map(|x| x.as_str().map(str::to_owned))
                    .collect()
            })
            .unwrap_or_default()
    };
    let env = c["env"]
        .as_array()
        .map(|a| {
            a.iter()
                .filter_map(|e| {
                    Some((
                        e["name"].as_str()?.to_owned(),
                        e["value"].as_str().unwrap_or("").to_owned(),
                    ))
                })
                .collect()
        })
        .unwrap_or_default();
    let mut ports: Vec<u16> = c["ports"]
        .as_array()
        .map(|a| {
            a.iter()
                .filter_map(|p| {
                    p["containerPort"]
                        .as_u64()
                        .and_then(|p| u16::try_from(p).ok())
                })
                .collect()
        })
        .unwrap_or_default();
    if ports.is_empty() {
        ports.push(DEFAULT_PORT);
    }
    Ok((
        ContainerSpec {
            name: String::new(),
            image: image.to_owned(),
            command: strings(&c["command"]),
            args: strings(&c["args"]),
            env,
            labels: vec![
                (
                    "io.kubernetes.pod.namespace".into(),
                    meta(sb, "namespace").into(),
                ),
                ("io.kubernetes.pod.name".into(), meta(sb, "name").into()),
            ],
        },
        ports,
    ))
}

impl Controller {
    /// Reconcile on every store change, on kicks from pod tasks, and every 500 ms.
    pub(crate) async fn run(self: Arc<Self>, mut stop: watch::Receiver<bool>) {
        let mut feed = self.store.subscribe();
        loop {
            self.reconcile_all();
            tokio::select! {
                _ = feed.recv() => {
                    // Coalesce a burst of changes into one pass.
                    while feed.try_recv().is_ok() {}
                }
                _ = self.kick.notified() => {}
                _ = tokio::time::sleep(Duration::from_millis(500)) => {}
                _ = stop.changed() => return,
            }
        }
    }

    fn reconcile_all(self: &Arc<Self>) {
        for pool in self.store.all(&WARM_POOL) {
            self.reconcile_pool(&pool);
        }
        for claim in self.store.all(&CLAIM) {
            self.reconcile_claim(&claim);
        }
        let sandboxes = self.store.all(&SANDBOX);
        for sb in &sandboxes {
            self.reconcile_sandbox(sb);
        }
        self.remove_orphan_pods(&sandboxes);
    }

    fn remove_orphan_pods(&self, sandboxes: &[Value]) {
        let live: HashSet<&str> = sandboxes.iter().map(|s| meta(s, "uid")).collect();
        let orphans: Vec<(String, Option<String>)> = {
            let mut pods = self.pods.lock();
            let gone: Vec<String> = pods
                .iter()
                .filter(|(uid, st)| {
                    !live.contains(uid.as_str()) && !matches!(st, PodState::Starting)
                })
                .map(|(uid, _)| uid.clone())
                .collect();
            gone.into_iter()
                .map(|uid| {
                    let c = match pods.remove(&uid) {
                        Some(PodState::Running { container, .. }) => Some(container),
                        _ => None,
                    };
                    (uid, c)
                })
                .collect()
        };
        for (uid, container) in orphans {
            if let Some(c) = container {
                tracing::debug!(%uid, container = %c, "removing the pod of a deleted sandbox");
                tokio::spawn(async move {
                    if let Err(e) = docker::remove(&c).await {
                        tracing::warn!(error = %e, "removing a pod");
                    }
                });
            }
        }
    }

    fn reconcile_pool(&self, pool: &Value) {
        let ns = meta(pool, "namespace");
        let name = meta(pool, "name");
        let uid = meta(pool, "uid");
        let replicas = pool["spec"]["replicas"].as_u64().unwrap_or(1) as usize;
        let tname = pool["spec"]["sandboxTemplateRef"]["name"]
            .as_str()
            .unwrap_or("");
        let members: Vec<Value> = self
            .store
            .all(&SANDBOX)
            .into_iter()
            .filter(|s| {
                meta(s, "namespace") == ns
                    && controlled_by(s, uid)
                    && s["metadata"]["labels"][WARM_POOL_LABEL] == name
            })
            .collect();
        let ready = members
            .iter()
            .filter(|s| find_ready(&s["status"]).is_some_and(|c| c["status"] == "True"))
            .count();
        if let Ok(template) = self.store.get(&TEMPLATE, ns, tname) {
            for _ in members.len()..replicas {
                let sb = json!({
                    "metadata": {
                        "generateName": format!("{name}-"),
                        "labels": {WARM_POOL_LABEL: name, TEMPLATE_REF: tname},
                        "annotations": {TEMPLATE_REF: tname},
                        "ownerReferences": [controller_ref(&WARM_POOL, pool)],
                    },
                    "spec": sandbox_spec_from(&template, &Value::Null),
                });
                ignore_gone(self.store.create(&SANDBOX, ns, sb));
            }
        }
        for extra in members.iter().skip(replicas) {
            ignore_gone(
                self.store
                    .delete(&SANDBOX, ns, meta(extra, "name"), &Default::default()),
            );
        }
        let status = json!({
            "replicas": members.len().min(replicas), "readyReplicas": ready,
            "selector": format!("{WARM_POOL_LABEL}={name}"),
            "observedGeneration": pool["metadata"]["generation"],
        });
        write_status(&self.store, &WARM_POOL, pool, status);
    }

    fn claim_status(
        &self,
        claim: &Value,
        sandbox: Option<&Value>,
        status: &str,
        reason: &str,
        message: &str,
    ) -> Value {
        let old = find_ready(&claim["status"]);
        let mut st = json!({"conditions": [ready_condition(old, status, reason, message, &claim["metadata"]["generation"])]});
        if let Some(sb) = sandbox {
            st["sandbox"] = json!({"name": meta(sb, "name"), "podIPs": sb["status"]["podIPs"].as_array().cloned().unwrap_or_default()});
        }
        st
    }

    fn reconcile_claim(&self, claim: &Value) {
        let ns = meta(claim, "namespace");
        let name = meta(claim, "name");
        let uid = meta(claim, "uid");
        let sandboxes: Vec<Value> = self
            .store
            .all(&SANDBOX)
            .into_iter()
            .filter(|s| meta(s, "namespace") == ns)
            .collect();
        let bound = sandboxes.iter().find(|s| controlled_by(s, uid)).cloned();
        let lifecycle = &claim["spec"]["lifecycle"];
        if in_past(&lifecycle["shutdownTime"]) {
            let st = self.claim_status(
                claim,
                None,
                "False",
                "ClaimExpired",
                "the claim's shutdownTime has passed",
            );
            write_status(&self.store, &CLAIM, claim, st);
            match lifecycle["shutdownPolicy"].as_str() {
                Some("Delete" | "DeleteForeground") => {
                    ignore_gone(self.store.delete(&CLAIM, ns, name, &Default::default()));
                }
                _ => {
                    if let Some(sb) = &bound {
                        ignore_gone(self.store.delete(
                            &SANDBOX,
                            ns,
                            meta(sb, "name"),
                            &Default::default(),
                        ));
                    }
                }
            }
            return;
        }
        let sandbox = match bound {
            Some(sb) => sb,
            None => match self.bind(claim, &sandboxes) {
                Ok(Some(sb)) => sb,
                Ok(None) => return,
                Err((reason, message)) => {
                    let st = self.claim_status(claim, None, "False", reason, &message);
                    write_status(&self.store, &CLAIM, claim, st);
                    return;
                }
            },
        };
        // Record an adoption on the claim (optimistic: a 409 retries on the next pass).
        let sb_name = meta(&sandbox, "name");
        if sb_name != name && claim["metadata"]["annotations"][SANDBOX_NAME_ANNOTATION] != sb_name {
            let mut c = claim.clone();
            c["metadata"]["annotations"][SANDBOX_NAME_ANNOTATION] = json!(sb_name);
            ignore_gone(self.store.replace(&CLAIM, ns, name, c, Part::Main));
            return;
        }
        let st = match find_ready(&sandbox["status"]) {
            Some(c) => self.claim_status(
                claim,
                Some(&sandbox),
                c["status"].as_str().unwrap_or("Unknown"),
                c["reason"].as_str().unwrap_or("SandboxNotReady"),
                c["message"].as_str().unwrap_or(""),
            ),
            None => self.claim_status(
                claim,
                Some(&sandbox),
                "False",
                "SandboxNotReady",
                "the sandbox has no status yet",
            ),
        };
        write_status(&self.store, &CLAIM, claim, st);
    }

    /// Adopt a ready warm-pool Sandbox or cold-create one. `Ok(None)`: try again next pass.
    fn bind(
        &self,
        claim: &Value,
        sandboxes: &[Value],
    ) -> Result<Option<Value>, (&'static str, String)> {
        let ns = meta(claim, "namespace");
        let name = meta(claim, "name");
        let pool_name = claim["spec"]["warmPoolRef"]["name"].as_str().unwrap_or("");
        let pool = self.store.get(&WARM_POOL, ns, pool_name).map_err(|_| {
            (
                "WarmPoolNotFound",
                format!("SandboxWarmPool \"{pool_name}\" not found in namespace \"{ns}\""),
            )
        })?;
        let tname = pool["spec"]["sandboxTemplateRef"]["name"]
            .as_str()
            .unwrap_or("");
        let template = self.store.get(&TEMPLATE, ns, tname).map_err(|_| {
            (
                "TemplateNotFound",
                format!("SandboxTemplate \"{tname}\" not found in namespace \"{ns}\""),
            )
        })?;
        let env = claim["spec"]["env"].as_array().filter(|a| !a.is_empty());
        if env.is_some() && template["spec"]["envVarsInjectionPolicy"] != "Allowed" {
            return Err((
                "EnvVarsInjectionRejected",
                format!(
                    "SandboxTemplate \"{tname}\" does not allow environment variable injection"
                ),
            ));
        }
        let vcts = claim["spec"]["volumeClaimTemplates"]
            .as_array()
            .filter(|a| !a.is_empty());
        if vcts.is_some() && template["spec"]["volumeClaimTemplatesPolicy"] != "Allowed" {
            return Err((
                "VolumeClaimTemplatesError",
                format!("SandboxTemplate \"{tname}\" does not allow volumeClaimTemplates"),
            ));
        }
        if env.is_none() && vcts.is_none() {
            let pool_uid = meta(&pool, "uid");
            let mut candidates: Vec<&Value> = sandboxes
                .iter()
                .filter(|s| {
                    controlled_by(s, pool_uid)
                        && s["metadata"]["labels"][WARM_POOL_LABEL] == pool_name
                        && find_ready(&s["status"]).is_some_and(|c| c["status"] == "True")
                })
                .collect();
            candidates
                .sort_by(|a, b| meta(a, "creationTimestamp").cmp(meta(b, "creationTimestamp")));
            for cand in candidates {
                let mut sb = cand.clone();
                if let Some(l) = sb["metadata"]["labels"].as_object_mut() {
                    l.remove(WARM_POOL_LABEL);
                }
                sb["metadata"]["labels"][CLAIM_UID_LABEL] = json!(meta(claim, "uid"));
                sb["metadata"]["annotations"][LAUNCH_TYPE] = json!("warm");
                sb["metadata"]["ownerReferences"] = json!([controller_ref(&CLAIM, claim)]);
                match self
                    .store
                    .replace(&SANDBOX, ns, meta(cand, "name"), sb, Part::Main)
                {
                    Ok(adopted) => return Ok(Some(adopted)),
                    Err(e) if e.code == 409 || e.code == 404 => continue,
                    Err(e) => return Err(("ReconcilerError", e.message)),
                }
            }
        }
        let sb = json!({
            "metadata": {
                "name": name,
                "labels": {CLAIM_UID_LABEL: meta(claim, "uid"), TEMPLATE_REF: tname},
                "annotations": {TEMPLATE_REF: tname, LAUNCH_TYPE: "cold"},
                "ownerReferences": [controller_ref(&CLAIM, claim)],
            },
            "spec": sandbox_spec_from(&template, &claim["spec"]),
        });
        match self.store.create(&SANDBOX, ns, sb) {
            Ok(sb) => Ok(Some(sb)),
            Err(e) if e.code == 409 => Err((
                "ReconcilerError",
                format!("a Sandbox named \"{name}\" exists and is not owned by this claim"),
            )),
            Err(e) => Err(("ReconcilerError", e.message)),
        }
    }

    fn reconcile_sandbox(self: &Arc<Self>, sb: &Value) {
        let ns = meta(sb, "namespace");
        let name = meta(sb, "name");
        let uid = meta(sb, "uid").to_owned();
        let generation = &sb["metadata"]["generation"];
        let old_ready = find_ready(&sb["status"]);
        if in_past(&sb["spec"]["shutdownTime"]) {
            self.stop_pod(&uid);
            if sb["spec"]["shutdownPolicy"] == "Delete" {
                ignore_gone(self.store.delete(&SANDBOX, ns, name, &Default::default()));
            } else {
                let st = json!({"conditions": [ready_condition(old_ready, "False", "SandboxExpired", "the sandbox's shutdownTime has passed", generation)]});
                write_status(&self.store, &SANDBOX, sb, st);
            }
            return;
        }
        let state = self.pods.lock().get(&uid).cloned();
        let Some(state) = state else {
            self.start_pod(sb);
            return;
        };
        let fqdn = format!("{name}.{ns}.svc.cluster.local");
        let (ips, cond) = match &state {
            PodState::Starting => (
                vec![],
                ready_condition(
                    old_ready,
                    "False",
                    "DependenciesNotReady",
                    "the pod is being created",
                    generation,
                ),
            ),
            PodState::Failed(m) => (
                vec![],
                ready_condition(old_ready, "False", "ReconcilerError", m, generation),
            ),
            PodState::Running {
                ip,
                exited: Some(code),
                ..
            } => {
                let reason = if *code == 0 {
                    "PodSucceeded"
                } else {
                    "PodFailed"
                };
                (
                    vec![ip.clone()],
                    ready_condition(
                        old_ready,
                        "False",
                        reason,
                        &format!("the pod's container exited with code {code}"),
                        generation,
                    ),
                )
            }
            PodState::Running {
                ip, ready: false, ..
            } => (
                vec![ip.clone()],
                ready_condition(
                    old_ready,
                    "False",
                    "DependenciesNotReady",
                    "the pod's port does not answer yet",
                    generation,
                ),
            ),
            PodState::Running {
                ip, ready: true, ..
            } => (
                vec![ip.clone()],
                ready_condition(
                    old_ready,
                    "True",
                    "DependenciesReady",
                    "the pod is ready",
                    generation,
                ),
            ),
        };
        if matches!(state, PodState::Running { .. })
            && sb["metadata"]["annotations"][POD_NAME_ANNOTATION] != name
        {
            let mut m = sb.clone();
            m["metadata"]["annotations"][POD_NAME_ANNOTATION] = json!(name);
            ignore_gone(self.store.replace(&SANDBOX, ns, name, m, Part::Main));
            return;
        }
        let mut st = json!({
            "conditions": [cond], "serviceFQDN": fqdn, "service": name, "nodeName": "k8s-testcluster",
            "selector": format!("agents.x-k8s.io/sandbox-name={name}"),
        });
        if !ips.is_empty() {
            st["podIPs"] = json!(ips);
        }
        write_status(&self.store, &SANDBOX, sb, st);
    }

    fn stop_pod(&self, uid: &str) {
        if let Some(PodState::Running {
            container,
            exited: None,
            ..
        }) = self.pods.lock().get(uid).cloned()
        {
            tokio::spawn(async move {
                let _ = docker::kill(&container).await;
            });
        }
    }

    fn start_pod(self: &Arc<Self>, sb: &Value) {
        let uid = meta(sb, "uid").to_owned();
        let (mut spec, ports) = match container_spec(sb) {
            Ok(x) => x,
            Err(m) => {
                self.pods.lock().insert(uid, PodState::Failed(m));
                self.kick.notify_one();
                return;
            }
        };
        let short: String = uid.chars().take(8).collect();
        spec.name = format!("k8stc-{}-{}-{short}", self.cluster_id, meta(sb, "name"));
        self.pods.lock().insert(uid.clone(), PodState::Starting);
        let this = self.clone();
        tokio::spawn(async move {
            let started = docker::owner(&this.cluster_id)
                .run(&spec, &this.network)
                .await;
            let (container, ip) = match started {
                Ok(s) => (s.id, s.ip),
                Err(e) => {
                    tracing::warn!(error = %e, "starting a pod");
                    this.pods
                        .lock()
                        .insert(uid, PodState::Failed(e.to_string()));
                    this.kick.notify_one();
                    return;
                }
            };
            tracing::debug!(%uid, %container, %ip, "pod started");
            this.pods.lock().insert(
                uid.clone(),
                PodState::Running {
                    container: container.clone(),
                    ip: ip.clone(),
                    ready: false,
                    exited: None,
                },
            );
            this.kick.notify_one();
            // The pod's lifetime: `docker wait` returns when the container exits.
            let waiter = this.clone();
            let (wuid, wcontainer) = (uid.clone(), container.clone());
            tokio::spawn(async move {
                let code = docker::wait(&wcontainer).await.unwrap_or(-1);
                if let Some(PodState::Running { exited, .. }) = waiter.pods.lock().get_mut(&wuid) {
                    *exited = Some(code);
                }
                waiter.kick.notify_one();
            });
            // Readiness: every declared container port (the first, 8888 by default, and any
            // others) accepts a TCP connection.
            let mut pending = ports;
            loop {
                let running = matches!(
                    this.pods.lock().get(&uid),
                    Some(PodState::Running { exited: None, .. })
                );
                if !running {
                    return;
                }
                let mut still = Vec::new();
                for port in pending {
                    let connect = tokio::net::TcpStream::connect((ip.as_str(), port));
                    if !matches!(
                        tokio::time::timeout(Duration::from_millis(500), connect).await,
                        Ok(Ok(_))
                    ) {
                        still.push(port);
                    }
                }
                pending = still;
                if pending.is_empty() {
                    if let Some(PodState::Running { ready, .. }) = this.pods.lock().get_mut(&uid) {
                        *ready = true;
                    }
                    this.kick.notify_one();
                    return;
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        });
    }
}

/// A Sandbox spec from a template's blueprint, with the claim's env and pod metadata.
fn sandbox_spec_from(template: &Value, claim_spec: &Value) -> Value {
    let mut pod_template = template["spec"]["podTemplate"].clone();
    if let Some(env) = claim_spec["env"].as_array()
        && let Some(c) = pod_template.pointer_mut("/spec/containers/0")
    {
        let mut all = c["env"].as_array().cloned().unwrap_or_default();
        all.extend(
            env.iter()
                .map(|e| json!({"name": e["name"], "value": e["value"]})),
        );
        c["env"] = json!(all);
    }
    for field in ["labels", "annotations"] {
        if let Some(m) = claim_spec["additionalPodMetadata"][field].as_object() {
            for (k, v) in m {
                pod_template["metadata"][field][k] = v.clone();
            }
        }
    }
    let mut spec = json!({"podTemplate": pod_template});
    if let Some(s) = template["spec"].get("service") {
        spec["service"] = s.clone();
    }
    spec
}
