//! [`DockerClient`]: makes, finds, removes and collects containers.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::{Component, Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{SystemTime, UNIX_EPOCH};

use bollard::Docker;
use bollard::models::{
    ContainerCreateBody, ContainerInspectResponse, ContainerSummary, HostConfig, Mount, MountType,
    PortBinding, ResourcesUlimits,
};
use bollard::query_parameters::{
    CreateContainerOptionsBuilder, CreateImageOptionsBuilder, ListContainersOptionsBuilder,
    RemoveContainerOptionsBuilder,
};
use futures::StreamExt;
use sandbox_core::{
    Capabilities, CommonState, CreateRequest, Error, ExecFeatures, IsolationKey, OwnedBox,
    Persistence, Result, SandboxClient, SandboxState, WorkspaceSpec, async_trait,
};

use crate::BACKEND;
use crate::boxed::{BoxConfig, DockerBox};
use crate::engine::{Engine, status};
use crate::options::{DockerOptions, PullPolicy, check_env_name, check_root};
use crate::state::{DockerState, ResolvedMount};

/// Label keys every container of this library carries.
pub mod labels {
    /// Owner: the deployment prefix. `gc` only removes containers with its own owner.
    pub const OWNER: &str = "io.sandbox-harness.owner";
    /// The isolation key string (absent for boxes without a key).
    pub const KEY: &str = "io.sandbox-harness.key";
    /// The isolation scope of the key.
    pub const SCOPE: &str = "io.sandbox-harness.scope";
    /// Creation time, seconds since the epoch.
    pub const CREATED_AT: &str = "io.sandbox-harness.created-at";
    /// Expiry time, seconds since the epoch.
    pub const EXPIRES_AT: &str = "io.sandbox-harness.expires-at";
    /// Workspace root inside the container.
    pub const ROOT: &str = "io.sandbox-harness.workspace-root";
}

/// State shared by a client and its boxes.
#[derive(Debug)]
pub(crate) struct Shared {
    pub options: DockerOptions,
    pub engine: Engine,
    /// Images known to be on the engine (checked once per client).
    images: Mutex<HashSet<String>>,
}

impl Shared {
    pub(crate) async fn docker(&self) -> Result<Docker> {
        self.engine.get().await
    }

    /// Make sure the image is on the engine, according to the pull policy.
    pub(crate) async fn ensure_image(&self, image: &str) -> Result<()> {
        let policy = self.options.pull_policy;
        if policy != PullPolicy::Always && self.images.lock().expect("images").contains(image) {
            return Ok(());
        }
        let docker = self.docker().await?;
        let present = match docker.inspect_image(image).await {
            Ok(_) => true,
            Err(e) if status(&e) == Some(404) => false,
            Err(e) => return Err(self.engine.err("inspect image", "docker image", image, e)),
        };
        match (policy, present) {
            (PullPolicy::Never, false) => {
                return Err(Error::NotFound {
                    what: "docker image (pull policy `Never`)",
                    key: image.to_owned(),
                });
            }
            (PullPolicy::IfMissing, false) | (PullPolicy::Always, _) => {
                self.pull(&docker, image, present).await?;
            }
            _ => {}
        }
        self.images.lock().expect("images").insert(image.to_owned());
        Ok(())
    }

    async fn pull(&self, docker: &Docker, image: &str, present: bool) -> Result<()> {
        let (name, tag) = split_tag(image);
        let options = CreateImageOptionsBuilder::default()
            .from_image(name)
            .tag(tag)
            .build();
        let mut progress = docker.create_image(Some(options), None, None);
        let mut failure = None;
        while let Some(item) = progress.next().await {
            match item {
                Ok(info) => {
                    if let Some(e) = info.error_detail.and_then(|d| d.message) {
                        failure = Some(e);
                    }
                }
                Err(e) => {
                    failure = Some(match self.engine.err("pull", "docker image", image, e) {
                        e @ Error::Unavailable { .. } => return Err(e),
                        e => e.to_string(),
                    });
                    break;
                }
            }
        }
        match failure {
            None => Ok(()),
            // `Always` with a local copy: a registry that cannot be reached is not fatal.
            Some(reason) if present => {
                tracing::warn!(image, %reason, "pull failed; using the local image");
                Ok(())
            }
            Some(reason) => Err(Error::Backend {
                backend: BACKEND,
                operation: "pull image",
                message: format!(
                    "image `{image}` is not on the engine and cannot be pulled: {reason}"
                ),
                source: None,
            }),
        }
    }

    /// Inspect a container by name or id; `None` if there is none.
    pub(crate) async fn inspect(&self, name: &str) -> Result<Option<ContainerInspectResponse>> {
        let docker = self.docker().await?;
        match docker.inspect_container(name, None).await {
            Ok(c) => Ok(Some(c)),
            Err(e) if status(&e) == Some(404) => Ok(None),
            Err(e) => Err(self.engine.err("inspect", "container", name, e)),
        }
    }

    /// Whether a container's labels say this deployment owns it.
    pub(crate) fn owns(&self, labels: Option<&HashMap<String, String>>) -> bool {
        labels
            .and_then(|l| l.get(labels::OWNER))
            .is_some_and(|o| *o == self.options.name_prefix)
    }

    /// Refuse a container of this name that we do not own.
    pub(crate) fn check_owner(&self, name: &str, c: &ContainerInspectResponse) -> Result<()> {
        let labels = c.config.as_ref().and_then(|c| c.labels.as_ref());
        if self.owns(labels) {
            return Ok(());
        }
        let owner = labels
            .and_then(|l| l.get(labels::OWNER))
            .map_or_else(|| "no owner label".to_owned(), |o| format!("owner `{o}`"));
        Err(Error::Conflict {
            key: name.to_owned(),
            reason: format!(
                "a container of this name exists that this deployment (`{}`) does not own ({owner})",
                self.options.name_prefix
            ),
        })
    }

    /// Create the container a box describes (not started). Returns its id.
    pub(crate) async fn create_container(&self, config: &BoxConfig) -> Result<String> {
        self.ensure_image(&config.image).await?;
        let body = self.container_body(config)?;
        let docker = self.docker().await?;
        let options = CreateContainerOptionsBuilder::default()
            .name(&config.name)
            .build();
        match docker.create_container(Some(options), body).await {
            Ok(r) => {
                tracing::info!(container = %config.name, id = %r.id, image = %config.image, "container created");
                Ok(r.id)
            }
            Err(e) if status(&e) == Some(409) => {
                // Someone made it in the meantime: adopt it if it is ours.
                match self.inspect(&config.name).await? {
                    Some(c) => {
                        self.check_owner(&config.name, &c)?;
                        Ok(c.id.unwrap_or_default())
                    }
                    None => Err(self.engine.err("create", "container", &config.name, e)),
                }
            }
            Err(e) => Err(self.engine.err("create", "container", &config.name, e)),
        }
    }

    fn container_body(&self, config: &BoxConfig) -> Result<ContainerCreateBody> {
        let o = &self.options;
        let now = unix_now();
        let mut labels: HashMap<String, String> = o.labels.clone().into_iter().collect();
        labels.insert(labels::OWNER.into(), o.name_prefix.clone());
        labels.insert(labels::CREATED_AT.into(), now.to_string());
        labels.insert(
            labels::EXPIRES_AT.into(),
            (now + o.max_age.as_secs()).to_string(),
        );
        labels.insert(labels::ROOT.into(), config.root.clone());
        if let Some(key) = &config.key {
            labels.insert(labels::KEY.into(), key.as_str().to_owned());
            labels.insert(labels::SCOPE.into(), key.scope().as_str().to_owned());
        }
        let mut mounts = Vec::new();
        for (rel, host, read_only) in &config.binds {
            mounts.push(bind(
                &host.to_string_lossy(),
                &rel.to_box(&config.root),
                *read_only,
            ));
        }
        for m in &config.extra {
            mounts.push(bind(&m.host_path, &m.target, m.read_only));
        }
        let mut tmpfs: HashMap<String, String> = o.host.tmpfs.clone().into_iter().collect();
        let mut volumes = None;
        if o.read_only_rootfs {
            // The workspace and /tmp stay writable on a read-only root.
            volumes = Some(vec![config.root.clone()]);
            tmpfs
                .entry("/tmp".into())
                .or_insert_with(|| "rw,nosuid,nodev".into());
        }
        let (exposed, bindings) = if o.exposed_ports.is_empty() {
            (None, None)
        } else {
            let mut bindings = HashMap::new();
            let mut exposed = Vec::new();
            for port in &o.exposed_ports {
                let key = format!("{port}/tcp");
                exposed.push(key.clone());
                bindings.insert(
                    key,
                    Some(vec![PortBinding {
                        host_ip: Some(o.port_host_ip.clone()),
                        host_port: Some(String::new()),
                    }]),
                );
            }
            (Some(exposed), Some(bindings))
        };
        let h = &o.host;
        let kept = o.kept_capabilities();
        let security = o.security_options();
        let host_config = HostConfig {
            memory: o.memory_bytes,
            nano_cpus: o.cpus.map(|c| (c * 1e9) as i64),
            pids_limit: o.pids_limit,
            network_mode: Some(o.network.clone()),
            port_bindings: bindings,
            mounts: (!mounts.is_empty()).then_some(mounts),
            readonly_rootfs: Some(o.read_only_rootfs),
            init: Some(o.init),
            tmpfs: (!tmpfs.is_empty()).then_some(tmpfs),
            // Hardened by default: every capability dropped but the kept set, and
            // no-new-privileges (see `DockerOptions`).
            cap_drop: Some(vec!["ALL".to_owned()]),
            cap_add: (!kept.is_empty()).then_some(kept),
            security_opt: (!security.is_empty()).then_some(security),
            shm_size: h.shm_size,
            extra_hosts: (!h.extra_hosts.is_empty()).then(|| h.extra_hosts.clone()),
            sysctls: (!h.sysctls.is_empty()).then(|| h.sysctls.clone().into_iter().collect()),
            ulimits: (!h.ulimits.is_empty()).then(|| {
                h.ulimits
                    .iter()
                    .map(|u| ResourcesUlimits {
                        name: Some(u.name.clone()),
                        soft: Some(u.soft),
                        hard: Some(u.hard),
                    })
                    .collect()
            }),
            runtime: h.runtime.clone(),
            ..Default::default()
        };
        Ok(ContainerCreateBody {
            image: Some(config.image.clone()),
            // The container only idles; commands arrive through the exec API.
            entrypoint: Some(vec!["sleep".into()]),
            cmd: Some(vec!["2147483647".into()]),
            working_dir: Some(config.root.clone()),
            user: o.user.clone(),
            labels: Some(labels),
            exposed_ports: exposed,
            volumes,
            network_disabled: Some(o.network == "none"),
            host_config: Some(host_config),
            ..Default::default()
        })
    }

    /// Remove a container we own (force; anonymous volumes too). Gone already is fine.
    pub(crate) async fn remove(&self, name: &str) -> Result<()> {
        let docker = self.docker().await?;
        let options = RemoveContainerOptionsBuilder::default()
            .force(true)
            .v(true)
            .build();
        match docker.remove_container(name, Some(options)).await {
            Ok(()) => {
                tracing::info!(container = name, "container removed");
                Ok(())
            }
            Err(e) if status(&e) == Some(404) => Ok(()),
            // Removal already in progress (a concurrent remove): fine.
            Err(e) if status(&e) == Some(409) => Ok(()),
            Err(e) => Err(self.engine.err("remove", "container", name, e)),
        }
    }
}

fn bind(source: &str, target: &str, read_only: bool) -> Mount {
    Mount {
        target: Some(target.to_owned()),
        source: Some(source.to_owned()),
        typ: Some(MountType::BIND),
        read_only: Some(read_only),
        ..Default::default()
    }
}

fn split_tag(image: &str) -> (&str, &str) {
    // `registry:5000/name:tag` — the tag is after the last `:` that follows the last `/`.
    let slash = image.rfind('/').map_or(0, |i| i + 1);
    match image[slash..].rfind(':') {
        Some(i) if !image[slash..].contains('@') => (&image[..slash + i], &image[slash + i + 1..]),
        _ => (image, "latest"),
    }
}

pub(crate) fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// The Docker backend's client. Cheap to clone; clones share one engine connection.
///
/// ```no_run
/// # async fn demo() -> sandbox_core::Result<()> {
/// use sandbox_docker::{DockerClient, DockerOptions};
/// let client = DockerClient::new(DockerOptions::new("debian:bookworm"))?;
/// client.ping().await?;
/// # Ok(()) }
/// ```
#[derive(Debug, Clone)]
pub struct DockerClient {
    shared: Arc<Shared>,
}

impl DockerClient {
    /// A client with `options`. Does not contact the engine: the first call that needs it
    /// connects (and reports an engine that is down as [`Error::Unavailable`]).
    pub fn new(options: DockerOptions) -> Result<Self> {
        options.validate()?;
        let engine = Engine::new(options.socket.clone(), options.api_timeout);
        Ok(DockerClient {
            shared: Arc::new(Shared {
                options,
                engine,
                images: Mutex::new(HashSet::new()),
            }),
        })
    }

    /// The options.
    pub fn options(&self) -> &DockerOptions {
        &self.shared.options
    }

    /// Check that the engine answers (connecting and negotiating the API version).
    pub async fn ping(&self) -> Result<String> {
        let docker = self.shared.docker().await?;
        docker
            .ping()
            .await
            .map_err(|e| self.shared.engine.err("ping", "docker engine", "ping", e))?;
        Ok(docker.client_version().to_string())
    }

    /// Make sure the configured image is on the engine (per the pull policy).
    pub async fn ensure_image(&self) -> Result<()> {
        self.shared.ensure_image(&self.shared.options.image).await
    }

    /// A container name of its own for one call's ephemeral box of `key`.
    fn ephemeral_name(&self, key: &IsolationKey) -> String {
        format!(
            "{}-{}",
            self.container_name(key),
            &uuid::Uuid::new_v4().simple().to_string()[..8]
        )
    }

    /// The deterministic container name for `key` (of its kept box).
    pub fn container_name(&self, key: &IsolationKey) -> String {
        format!("{}-{}", self.shared.options.name_prefix, key.digest())
    }

    fn config_for(
        &self,
        spec: &WorkspaceSpec,
        name: String,
        key: Option<IsolationKey>,
        extra: Option<Vec<ResolvedMount>>,
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
        let extra = match extra {
            Some(e) => e,
            None => self.resolve_extra(key.as_ref())?,
        };
        check_mounts_outside(&root, &extra)?;
        Ok(BoxConfig {
            name,
            image: o.image.clone(),
            root,
            key,
            persistence: o.persistence,
            binds: spec
                .bind_mounts()
                .map(|(p, h, ro)| (p.clone(), h.clone(), ro))
                .collect(),
            spec_env: spec.env.clone(),
            extra,
        })
    }

    /// Compute and prepare the per-session mounts of a box.
    fn resolve_extra(&self, key: Option<&IsolationKey>) -> Result<Vec<ResolvedMount>> {
        let o = &self.shared.options;
        let Some(f) = &o.extra_mounts else {
            return Ok(Vec::new());
        };
        let mut out: Vec<ResolvedMount> = Vec::new();
        for m in f(key) {
            check_env_name(&m.env_name)?;
            let host = resolve_host_path(&m.host_path, o.extra_mount_base.as_deref())?;
            std::fs::create_dir_all(&host).map_err(|e| Error::io(&host, e))?;
            let target = m
                .target
                .clone()
                .unwrap_or_else(|| format!("/mnt/{}", m.env_name.to_ascii_lowercase()));
            check_root(&target)?;
            if out
                .iter()
                .any(|o| o.target == target || o.env_name == m.env_name)
            {
                return Err(Error::invalid(
                    "extra mount",
                    format!("`{}` is mounted or announced twice", m.env_name),
                ));
            }
            out.push(ResolvedMount {
                host_path: host.to_string_lossy().into_owned(),
                target,
                read_only: m.read_only,
                env_name: m.env_name.clone(),
            });
        }
        Ok(out)
    }

    /// The containers carrying this deployment's owner label (the engine filters by label;
    /// each is checked again).
    async fn owned_containers(&self) -> Result<Vec<ContainerSummary>> {
        let shared = &self.shared;
        let docker = shared.docker().await?;
        let filters: HashMap<String, Vec<String>> = [(
            "label".to_owned(),
            vec![format!("{}={}", labels::OWNER, shared.options.name_prefix)],
        )]
        .into();
        let options = ListContainersOptionsBuilder::default()
            .all(true)
            .filters(&filters)
            .build();
        let list = docker
            .list_containers(Some(options))
            .await
            .map_err(|e| shared.engine.err("list", "containers", "owned", e))?;
        Ok(list
            .into_iter()
            .filter(|c| shared.owns(c.labels.as_ref()))
            .collect())
    }
}

fn container_name_of(c: &ContainerSummary) -> String {
    c.names
        .as_ref()
        .and_then(|n| n.first())
        .map(|n| n.trim_start_matches('/').to_owned())
        .or_else(|| c.id.clone())
        .unwrap_or_default()
}

/// Refuse per-session mounts at, inside or above the workspace root: the workspace is
/// replaced wholesale on restore (and emptied on failure), which would delete the host files
/// behind such a mount. (Mounts inside the workspace belong in the spec's bind-mount entries,
/// which every replace carries over untouched.)
fn check_mounts_outside(root: &str, extra: &[ResolvedMount]) -> Result<()> {
    let parts = |p: &str| -> Vec<String> {
        Path::new(p)
            .components()
            .filter_map(|c| match c {
                Component::Normal(n) => Some(n.to_string_lossy().into_owned()),
                _ => None,
            })
            .collect()
    };
    let root_parts = parts(root);
    for m in extra {
        let target = parts(&m.target);
        if target.starts_with(&root_parts) || root_parts.starts_with(&target) {
            return Err(Error::invalid(
                "extra mount",
                format!(
                    "`{}` (announced as `{}`) overlaps the workspace root `{root}`: mount it \
                     outside, or declare it as a bind-mount entry of the workspace spec",
                    m.target, m.env_name
                ),
            ));
        }
    }
    Ok(())
}

/// A relative path under `base` that cannot climb out of it, or a trusted absolute path.
fn resolve_host_path(path: &Path, base: Option<&Path>) -> Result<PathBuf> {
    if path.is_absolute() {
        return Ok(path.to_path_buf());
    }
    let shown = path.display().to_string();
    if path
        .components()
        .any(|c| !matches!(c, Component::Normal(_) | Component::CurDir))
    {
        return Err(Error::path_escape(
            shown,
            "a relative extra mount may not leave its base directory",
        ));
    }
    let Some(base) = base else {
        return Err(Error::invalid(
            "extra mount",
            format!("relative host path `{shown}` needs `extra_mount_base`"),
        ));
    };
    Ok(base.join(path))
}

#[async_trait]
impl SandboxClient for DockerClient {
    fn backend(&self) -> &'static str {
        BACKEND
    }

    fn capabilities(&self) -> Capabilities {
        let mut c = Capabilities::default();
        c.bind_mounts = true;
        c.read_only_bind_mounts = true;
        c.keep = true;
        c.isolated = true;
        // Timeouts, finished commands and cancelled calls kill the whole tree by its marker.
        c.exec = ExecFeatures::all();
        c
    }

    #[tracing::instrument(skip_all, fields(backend = BACKEND, key = request.key.map(|k| k.as_str())))]
    async fn create(&self, request: CreateRequest<'_>) -> Result<Box<dyn sandbox_core::BoxHandle>> {
        let shared = &self.shared;
        let key = request.key.cloned();
        // Only a kept container is found again by its key's name; an ephemeral one is the
        // call's alone (a container left by a call that died is never reused).
        let name = match &key {
            Some(k) if shared.options.persistence == Persistence::Keep => self.container_name(k),
            Some(k) => self.ephemeral_name(k),
            None => format!(
                "{}-anon-{}",
                shared.options.name_prefix,
                &uuid::Uuid::new_v4().simple().to_string()[..12]
            ),
        };
        let config = self.config_for(request.spec, name.clone(), key, None)?;
        let (id, adopted) = match shared.inspect(&name).await? {
            Some(existing) => {
                shared.check_owner(&name, &existing)?;
                tracing::info!(container = %name, "adopting an existing container of this key");
                (existing.id.unwrap_or_default(), true)
            }
            None => (shared.create_container(&config).await?, false),
        };
        Ok(Box::new(DockerBox::new(
            shared.clone(),
            config,
            Some(id),
            !adopted,
        )))
    }

    #[tracing::instrument(skip_all, fields(backend = BACKEND))]
    async fn resume(
        &self,
        state: &dyn SandboxState,
        spec: &WorkspaceSpec,
    ) -> Result<Box<dyn sandbox_core::BoxHandle>> {
        let s = state.downcast::<DockerState>(BACKEND)?;
        // An ephemeral box did not outlive its call (or holds a call's unsaved work, or was
        // left by a call that died): never continue in it. A container of its own; the
        // workspace comes back from the snapshot.
        let ephemeral = self.shared.options.persistence == Persistence::Ephemeral;
        let name = match (&s.key, ephemeral) {
            (Some(k), true) => self.ephemeral_name(k),
            _ => s.container_name.clone(),
        };
        let mut config =
            self.config_for(spec, name, s.key.clone(), Some(s.extra_mounts.clone()))?;
        // The box keeps the root and image it was made with.
        config.root = s.common.workspace_root.clone();
        check_root(&config.root)?;
        check_mounts_outside(&config.root, &config.extra)?;
        config.image = s.image.clone();
        config.persistence = self.shared.options.persistence;
        let known = if ephemeral {
            None
        } else {
            s.container_id.clone()
        };
        Ok(Box::new(DockerBox::new(
            self.shared.clone(),
            config,
            known,
            false,
        )))
    }

    async fn list_owned(&self) -> Result<Vec<OwnedBox>> {
        Ok(self
            .owned_containers()
            .await?
            .iter()
            .map(|c| {
                let labels = c.labels.clone().unwrap_or_default();
                let ms = |label| {
                    labels
                        .get(label)
                        .and_then(|t| t.parse::<i64>().ok())
                        .map(|s| s * 1000)
                };
                OwnedBox::new(
                    container_name_of(c),
                    labels.get(labels::KEY).cloned(),
                    ms(labels::CREATED_AT),
                )
                .expires(ms(labels::EXPIRES_AT))
            })
            .collect())
    }

    fn box_id(&self, state: &dyn SandboxState) -> Result<String> {
        Ok(state
            .downcast::<DockerState>(BACKEND)?
            .container_name
            .clone())
    }

    async fn remove_owned(&self, id: &str) -> Result<()> {
        match self.shared.inspect(id).await? {
            None => Ok(()),
            Some(c) => {
                self.shared.check_owner(id, &c)?;
                self.shared.remove(id).await
            }
        }
    }

    #[tracing::instrument(skip_all, fields(backend = BACKEND))]
    async fn delete(&self, state: &dyn SandboxState) -> Result<()> {
        let s = state.downcast::<DockerState>(BACKEND)?;
        match self.shared.inspect(&s.container_name).await? {
            None => Ok(()),
            Some(c) => {
                self.shared.check_owner(&s.container_name, &c)?;
                self.shared.remove(&s.container_name).await
            }
        }
    }
}

/// Build the state of a box (used by the handle).
pub(crate) fn state_of(
    config: &BoxConfig,
    container_id: Option<String>,
    host_ports: BTreeMap<String, u16>,
) -> DockerState {
    DockerState {
        common: CommonState::new(config.root.clone()),
        container_name: config.name.clone(),
        container_id,
        image: config.image.clone(),
        persistence: config.persistence,
        key: config.key.clone(),
        extra_mounts: config.extra.clone(),
        host_ports,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tags_split() {
        assert_eq!(split_tag("busybox"), ("busybox", "latest"));
        assert_eq!(split_tag("busybox:1.36"), ("busybox", "1.36"));
        assert_eq!(split_tag("reg:5000/a/b"), ("reg:5000/a/b", "latest"));
        assert_eq!(split_tag("reg:5000/a/b:x"), ("reg:5000/a/b", "x"));
    }

    #[test]
    fn extra_mounts_may_not_overlap_the_workspace() {
        let mount = |target: &str| ResolvedMount {
            host_path: "/srv/x".into(),
            target: target.into(),
            read_only: false,
            env_name: "X".into(),
        };
        for bad in [
            "/workspace",
            "/workspace/data",
            "/workspace/a/b/",
            "/",
            "//workspace/./c",
        ] {
            assert!(
                matches!(
                    check_mounts_outside("/workspace", &[mount(bad)]),
                    Err(Error::InvalidInput { .. })
                ),
                "{bad}"
            );
        }
        for good in ["/mnt/x", "/workspace2", "/work"] {
            check_mounts_outside("/workspace", &[mount(good)]).expect(good);
        }
    }

    #[test]
    fn extra_mount_paths_cannot_escape() {
        let base = Path::new("/srv/app");
        assert_eq!(
            resolve_host_path(Path::new("sessions/x/files"), Some(base)).unwrap(),
            PathBuf::from("/srv/app/sessions/x/files")
        );
        assert!(matches!(
            resolve_host_path(Path::new("../etc"), Some(base)),
            Err(Error::PathEscape { .. })
        ));
        assert!(matches!(
            resolve_host_path(Path::new("a/../../b"), Some(base)),
            Err(Error::PathEscape { .. })
        ));
        assert!(resolve_host_path(Path::new("rel"), None).is_err());
        assert_eq!(
            resolve_host_path(Path::new("/abs/ok"), None).unwrap(),
            PathBuf::from("/abs/ok")
        );
    }
}
