//! [`DockerOptions`]: everything the Docker backend is configured with, with documented
//! defaults and a `Debug` that never shows environment values.

use std::collections::BTreeMap;
use std::fmt;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use sandbox_core::{Error, IsolationKey, Persistence, Result};
use serde::{Deserialize, Serialize};

/// Default Docker engine socket.
pub const DEFAULT_SOCKET: &str = "/var/run/docker.sock";

/// The capabilities a box keeps by default; every other one is dropped. Why each is kept (and
/// why the engine's other defaults are not) is in the crate README's "Hardening" section.
/// [`HostSettings::cap_add`] adds to this set, [`HostSettings::cap_drop`] removes from it.
pub const DEFAULT_CAPABILITIES: &[&str] = &[
    "CHOWN",
    "DAC_OVERRIDE",
    "FOWNER",
    "FSETID",
    "KILL",
    "SETGID",
    "SETUID",
];

/// The default most processes (threads included) in one box: room for builds, package
/// managers and dev servers, while a fork bomb stops here instead of at the host's limit.
pub const DEFAULT_PIDS_LIMIT: i64 = 512;

/// When the image is pulled from a registry.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum PullPolicy {
    /// Never pull: the image must already be on the engine, or creation fails with an error
    /// naming it.
    Never,
    /// Pull only when the engine does not have the image (the default).
    #[default]
    IfMissing,
    /// Pull before every container creation.
    Always,
}

/// One resource limit for processes in the container (`ulimit`).
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Ulimit {
    /// Name (`nofile`, `nproc`, ...).
    pub name: String,
    /// Soft limit.
    pub soft: i64,
    /// Hard limit.
    pub hard: i64,
}

impl Ulimit {
    /// A ulimit.
    pub fn new(name: impl Into<String>, soft: i64, hard: i64) -> Self {
        Ulimit {
            name: name.into(),
            soft,
            hard,
        }
    }
}

/// Typed host-config settings beyond the common options, in place of the spec's raw
/// `additionalRunArgs` strings. Capabilities are relative to the box's kept set
/// ([`DEFAULT_CAPABILITIES`]); every other field defaults to the engine's default.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct HostSettings {
    /// Capabilities to add to the kept set (`NET_BIND_SERVICE`, `NET_RAW`, ...; `ALL` for
    /// every capability). Names with or without `CAP_`, any case.
    pub cap_add: Vec<String>,
    /// Capabilities to remove from the kept set (`ALL`: keep none but those in `cap_add`).
    pub cap_drop: Vec<String>,
    /// Extra security options (`seccomp=...`, `apparmor=...`). `no-new-privileges` is
    /// [`DockerOptions::no_new_privileges`], and is refused here.
    pub security_opt: Vec<String>,
    /// tmpfs mounts: in-box path → mount options (`size=64m`).
    pub tmpfs: BTreeMap<String, String>,
    /// Size of `/dev/shm` in bytes.
    pub shm_size: Option<i64>,
    /// Extra `/etc/hosts` lines (`name:ip`).
    pub extra_hosts: Vec<String>,
    /// Kernel parameters (`net.ipv4.ip_forward` → `1`).
    pub sysctls: BTreeMap<String, String>,
    /// Resource limits.
    pub ulimits: Vec<Ulimit>,
    /// OCI runtime (`runc`, `runsc`, ...).
    pub runtime: Option<String>,
}

impl HostSettings {
    /// Add a capability to the kept set.
    pub fn cap_add(mut self, cap: impl Into<String>) -> Self {
        self.cap_add.push(cap.into());
        self
    }

    /// Remove a capability from the kept set.
    pub fn cap_drop(mut self, cap: impl Into<String>) -> Self {
        self.cap_drop.push(cap.into());
        self
    }

    /// Add a security option.
    pub fn security_opt(mut self, opt: impl Into<String>) -> Self {
        self.security_opt.push(opt.into());
        self
    }

    /// Mount a tmpfs at `path` with `options`.
    pub fn tmpfs(mut self, path: impl Into<String>, options: impl Into<String>) -> Self {
        self.tmpfs.insert(path.into(), options.into());
        self
    }

    /// Set the size of `/dev/shm`.
    pub fn shm_size(mut self, bytes: i64) -> Self {
        self.shm_size = Some(bytes);
        self
    }

    /// Add an `/etc/hosts` line.
    pub fn extra_host(mut self, host: impl Into<String>) -> Self {
        self.extra_hosts.push(host.into());
        self
    }

    /// Set a kernel parameter.
    pub fn sysctl(mut self, key: impl Into<String>, value: impl Into<String>) -> Self {
        self.sysctls.insert(key.into(), value.into());
        self
    }

    /// Add a resource limit.
    pub fn ulimit(mut self, ulimit: Ulimit) -> Self {
        self.ulimits.push(ulimit);
        self
    }

    /// Use an OCI runtime.
    pub fn runtime(mut self, runtime: impl Into<String>) -> Self {
        self.runtime = Some(runtime.into());
        self
    }
}

/// A per-session mount: a host directory chosen from the isolation key (uploaded files of one
/// session, say), mounted outside the workspace and announced to every command through an
/// environment variable. The TypeScript seed's `extraWorkspaces`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[non_exhaustive]
pub struct ExtraMount {
    /// Host directory. Relative paths are resolved under
    /// [`DockerOptions::extra_mount_base`] and may not contain `..`; absolute paths are trusted
    /// host configuration. The directory is created if missing.
    pub host_path: PathBuf,
    /// Mount read-only.
    pub read_only: bool,
    /// The variable every command receives, holding the in-box path.
    pub env_name: String,
    /// In-box mount point; default `/mnt/<env_name in lower case>`.
    pub target: Option<String>,
}

impl ExtraMount {
    /// A mount of `host_path` announced as `env_name`.
    pub fn new(host_path: impl Into<PathBuf>, env_name: impl Into<String>) -> Self {
        ExtraMount {
            host_path: host_path.into(),
            read_only: false,
            env_name: env_name.into(),
            target: None,
        }
    }

    /// Mount read-only.
    pub fn read_only(mut self, read_only: bool) -> Self {
        self.read_only = read_only;
        self
    }

    /// Mount at `target` inside the box.
    pub fn target(mut self, target: impl Into<String>) -> Self {
        self.target = Some(target.into());
        self
    }
}

/// Computes the per-session mounts of a box from its isolation key (`None` for a box without
/// one).
pub type ExtraMounts = Arc<dyn Fn(Option<&IsolationKey>) -> Vec<ExtraMount> + Send + Sync>;

/// Options of the Docker backend. Build with [`DockerOptions::new`] and the setters.
///
/// | option | default |
/// | --- | --- |
/// | `image` | required |
/// | `socket` | `$DOCKER_HOST` if it is `unix://…`, else `/var/run/docker.sock` |
/// | `pull_policy` | `IfMissing` |
/// | `persistence` | `Ephemeral` |
/// | `name_prefix` | `sbx` (owner label and container names) |
/// | `memory_bytes`, `cpus` | engine default (unlimited) |
/// | `pids_limit` | [`DEFAULT_PIDS_LIMIT`] (512); `None` lifts it |
/// | `no_new_privileges` | `true` (set-uid binaries and file capabilities grant nothing) |
/// | `network` | `none` |
/// | `exposed_ports` | none; published on `127.0.0.1` on a free host port |
/// | `env` | none (applied to every exec, never logged) |
/// | `workspace_root` | `/workspace` (a `WorkspaceSpec` root wins) |
/// | `read_only_rootfs` | `false` (when on, the workspace and `/tmp` stay writable) |
/// | `user` | the image's user |
/// | `init` | `true` (an init process reaps orphans and forwards signals) |
/// | `host` | no extra host settings: capabilities are [`DEFAULT_CAPABILITIES`] |
/// | `extra_mounts` | none |
/// | `default_timeout` | 10 minutes per exec |
/// | `max_age` | 7 days (the `expires-at` label read by `gc`) |
/// | `stop_timeout` | 2 seconds before a stopping container is killed |
/// | `api_timeout` | 10 minutes per engine request |
#[derive(Clone)]
#[non_exhaustive]
pub struct DockerOptions {
    /// Image to run.
    pub image: String,
    /// Engine socket path.
    pub socket: PathBuf,
    /// When to pull the image.
    pub pull_policy: PullPolicy,
    /// What `release` does with the container.
    pub persistence: Persistence,
    /// Deployment prefix: container names are `<prefix>-<key digest>`, and the owner label
    /// holds it. `gc` only ever removes containers carrying this owner.
    pub name_prefix: String,
    /// Memory limit in bytes.
    pub memory_bytes: Option<i64>,
    /// CPU limit in CPUs (fractions allowed).
    pub cpus: Option<f64>,
    /// Most processes (threads included) in the container; `None` for no limit.
    pub pids_limit: Option<i64>,
    /// Run every process with `no_new_privs`: executing a set-uid binary or one with file
    /// capabilities never raises privileges.
    pub no_new_privileges: bool,
    /// Network mode (`none`, `bridge`, `host`, a network name).
    pub network: String,
    /// Container TCP ports to publish; their host ports are recorded in the state.
    pub exposed_ports: Vec<u16>,
    /// Host address exposed ports are published on.
    pub port_host_ip: String,
    /// Variables for every command. Values are never logged or shown by `Debug`.
    pub env: BTreeMap<String, String>,
    /// Workspace root inside the container, unless the `WorkspaceSpec` names one.
    pub workspace_root: String,
    /// Mount the image's root filesystem read-only.
    pub read_only_rootfs: bool,
    /// User (`name`, `uid`, `uid:gid`) for the container and every exec.
    pub user: Option<String>,
    /// Run an init process as PID 1.
    pub init: bool,
    /// Extra typed host-config settings.
    pub host: HostSettings,
    /// Extra labels on every container (the library's own labels cannot be overridden).
    pub labels: BTreeMap<String, String>,
    /// Per-session mounts computed from the isolation key.
    pub extra_mounts: Option<ExtraMounts>,
    /// Base directory for relative [`ExtraMount::host_path`]s.
    pub extra_mount_base: Option<PathBuf>,
    /// Exec timeout when a request names none.
    pub default_timeout: Duration,
    /// Run commands through a long-lived in-container agent (a `sh` loop) instead of one
    /// engine exec each: a few milliseconds per command instead of tens. Images without
    /// `base64`, `head`, `wc`, `mkfifo` or a writable `$TMPDIR` fall back to engine execs.
    pub exec_agent: bool,
    /// Containers expire this long after creation (read by `gc`).
    pub max_age: Duration,
    /// Grace period before a stopping container is killed.
    pub stop_timeout: Duration,
    /// Timeout of one engine request (uploads and downloads included).
    pub api_timeout: Duration,
}

impl DockerOptions {
    /// Options for `image`, every other field at its default.
    pub fn new(image: impl Into<String>) -> Self {
        DockerOptions {
            image: image.into(),
            socket: default_socket(),
            pull_policy: PullPolicy::default(),
            persistence: Persistence::Ephemeral,
            name_prefix: "sbx".into(),
            memory_bytes: None,
            cpus: None,
            pids_limit: Some(DEFAULT_PIDS_LIMIT),
            no_new_privileges: true,
            network: "none".into(),
            exposed_ports: Vec::new(),
            port_host_ip: "127.0.0.1".into(),
            env: BTreeMap::new(),
            workspace_root: "/workspace".into(),
            read_only_rootfs: false,
            user: None,
            init: true,
            host: HostSettings::default(),
            labels: BTreeMap::new(),
            extra_mounts: None,
            extra_mount_base: None,
            default_timeout: Duration::from_secs(600),
            exec_agent: true,
            max_age: Duration::from_secs(7 * 24 * 3600),
            stop_timeout: Duration::from_secs(2),
            api_timeout: Duration::from_secs(600),
        }
    }

    /// Set the engine socket.
    pub fn socket(mut self, socket: impl Into<PathBuf>) -> Self {
        self.socket = socket.into();
        self
    }

    /// Set the pull policy.
    pub fn pull_policy(mut self, policy: PullPolicy) -> Self {
        self.pull_policy = policy;
        self
    }

    /// Set the persistence.
    pub fn persistence(mut self, persistence: Persistence) -> Self {
        self.persistence = persistence;
        self
    }

    /// Set the deployment prefix (`[A-Za-z0-9][A-Za-z0-9_.-]*`, at most 40 bytes).
    pub fn name_prefix(mut self, prefix: impl Into<String>) -> Self {
        self.name_prefix = prefix.into();
        self
    }

    /// Limit memory.
    pub fn memory_bytes(mut self, bytes: i64) -> Self {
        self.memory_bytes = Some(bytes);
        self
    }

    /// Limit CPUs.
    pub fn cpus(mut self, cpus: f64) -> Self {
        self.cpus = Some(cpus);
        self
    }

    /// Limit the number of processes (`pids_limit(256)`), or lift the limit
    /// (`pids_limit(None)`).
    pub fn pids_limit(mut self, limit: impl Into<Option<i64>>) -> Self {
        self.pids_limit = limit.into();
        self
    }

    /// Keep (the default) or turn off `no_new_privs` for the box's processes.
    pub fn no_new_privileges(mut self, on: bool) -> Self {
        self.no_new_privileges = on;
        self
    }

    /// Set the network mode.
    pub fn network(mut self, network: impl Into<String>) -> Self {
        self.network = network.into();
        self
    }

    /// Publish a container TCP port on a free host port.
    pub fn expose(mut self, port: u16) -> Self {
        self.exposed_ports.push(port);
        self
    }

    /// Add an environment variable for every command.
    pub fn env(mut self, key: impl Into<String>, value: impl Into<String>) -> Self {
        self.env.insert(key.into(), value.into());
        self
    }

    /// Set the default workspace root.
    pub fn workspace_root(mut self, root: impl Into<String>) -> Self {
        self.workspace_root = root.into();
        self
    }

    /// Mount the root filesystem read-only.
    pub fn read_only_rootfs(mut self, read_only: bool) -> Self {
        self.read_only_rootfs = read_only;
        self
    }

    /// Run as `user`.
    pub fn user(mut self, user: impl Into<String>) -> Self {
        self.user = Some(user.into());
        self
    }

    /// Run an init process as PID 1 (default on).
    pub fn init(mut self, init: bool) -> Self {
        self.init = init;
        self
    }

    /// Set extra host settings.
    pub fn host(mut self, host: HostSettings) -> Self {
        self.host = host;
        self
    }

    /// Add a label to every container.
    pub fn label(mut self, key: impl Into<String>, value: impl Into<String>) -> Self {
        self.labels.insert(key.into(), value.into());
        self
    }

    /// Compute per-session mounts from the isolation key.
    pub fn extra_mounts<F>(mut self, f: F) -> Self
    where
        F: Fn(Option<&IsolationKey>) -> Vec<ExtraMount> + Send + Sync + 'static,
    {
        self.extra_mounts = Some(Arc::new(f));
        self
    }

    /// Base directory of relative extra-mount host paths.
    pub fn extra_mount_base(mut self, base: impl Into<PathBuf>) -> Self {
        self.extra_mount_base = Some(base.into());
        self
    }

    /// Set the default exec timeout.
    pub fn default_timeout(mut self, timeout: Duration) -> Self {
        self.default_timeout = timeout;
        self
    }

    /// Turn the exec agent on or off.
    pub fn exec_agent(mut self, on: bool) -> Self {
        self.exec_agent = on;
        self
    }

    /// Set the container lifetime read by `gc`.
    pub fn max_age(mut self, max_age: Duration) -> Self {
        self.max_age = max_age;
        self
    }

    /// Set the grace period of a stop.
    pub fn stop_timeout(mut self, timeout: Duration) -> Self {
        self.stop_timeout = timeout;
        self
    }

    /// Set the timeout of one engine request.
    pub fn api_timeout(mut self, timeout: Duration) -> Self {
        self.api_timeout = timeout;
        self
    }

    /// Check the options a client can be built from.
    pub fn validate(&self) -> Result<()> {
        if self.image.trim().is_empty() {
            return Err(Error::invalid("docker options", "`image` is required"));
        }
        let p = &self.name_prefix;
        let ok = !p.is_empty()
            && p.len() <= 40
            && p.as_bytes()[0].is_ascii_alphanumeric()
            && p.bytes()
                .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'.' | b'-'));
        if !ok {
            return Err(Error::invalid(
                "docker options",
                format!("name prefix `{p}` must match [A-Za-z0-9][A-Za-z0-9_.-]* (≤ 40 bytes)"),
            ));
        }
        check_root(&self.workspace_root)?;
        if let Some(cpus) = self.cpus
            && !(cpus > 0.0 && cpus.is_finite())
        {
            return Err(Error::invalid("docker options", "`cpus` must be positive"));
        }
        for key in self.env.keys() {
            check_env_name(key)?;
        }
        if let Some(limit) = self.pids_limit
            && limit <= 0
        {
            return Err(Error::invalid(
                "docker options",
                format!("`pids_limit` {limit} must be positive (`None` for no limit)"),
            ));
        }
        // One switch for no-new-privileges, so that the default cannot be half-overridden.
        if self
            .host
            .security_opt
            .iter()
            .any(|o| o.trim().starts_with("no-new-privileges"))
        {
            return Err(Error::invalid(
                "docker options",
                "set no-new-privileges with `DockerOptions::no_new_privileges`, not `security_opt`",
            ));
        }
        for cap in self.host.cap_add.iter().chain(&self.host.cap_drop) {
            let name = cap_name(cap);
            if name.is_empty() || !name.bytes().all(|b| b.is_ascii_uppercase() || b == b'_') {
                return Err(Error::invalid(
                    "docker options",
                    format!("`{cap}` is not a capability name"),
                ));
            }
        }
        Ok(())
    }

    /// The capabilities the box keeps: [`DEFAULT_CAPABILITIES`] without
    /// [`HostSettings::cap_drop`] (all of them for `ALL`), with [`HostSettings::cap_add`];
    /// sorted, without the `CAP_` prefix. Every other capability is dropped.
    pub fn kept_capabilities(&self) -> Vec<String> {
        let dropped: Vec<String> = self.host.cap_drop.iter().map(|c| cap_name(c)).collect();
        let mut kept: Vec<String> = if dropped.iter().any(|c| c == "ALL") {
            Vec::new()
        } else {
            DEFAULT_CAPABILITIES
                .iter()
                .map(|c| (*c).to_owned())
                .filter(|c| !dropped.contains(c))
                .collect()
        };
        kept.extend(self.host.cap_add.iter().map(|c| cap_name(c)));
        kept.sort();
        kept.dedup();
        kept
    }

    /// The security options of the box: `no-new-privileges:true` (unless turned off), then
    /// [`HostSettings::security_opt`].
    pub(crate) fn security_options(&self) -> Vec<String> {
        let mut opts = Vec::new();
        if self.no_new_privileges {
            opts.push("no-new-privileges:true".to_owned());
        }
        opts.extend(self.host.security_opt.iter().cloned());
        opts
    }
}

/// A capability's name as the kept set spells it: upper case, without `CAP_`.
fn cap_name(cap: &str) -> String {
    let upper = cap.trim().to_ascii_uppercase();
    match upper.strip_prefix("CAP_") {
        Some(rest) => rest.to_owned(),
        None => upper,
    }
}

impl fmt::Debug for DockerOptions {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DockerOptions")
            .field("image", &self.image)
            .field("socket", &self.socket)
            .field("pull_policy", &self.pull_policy)
            .field("persistence", &self.persistence)
            .field("name_prefix", &self.name_prefix)
            .field("memory_bytes", &self.memory_bytes)
            .field("cpus", &self.cpus)
            .field("pids_limit", &self.pids_limit)
            .field("no_new_privileges", &self.no_new_privileges)
            .field("network", &self.network)
            .field("exposed_ports", &self.exposed_ports)
            .field("env", &self.env.keys().collect::<Vec<_>>())
            .field("workspace_root", &self.workspace_root)
            .field("read_only_rootfs", &self.read_only_rootfs)
            .field("user", &self.user)
            .field("init", &self.init)
            .field("host", &self.host)
            .field("labels", &self.labels)
            .field("extra_mounts", &self.extra_mounts.is_some())
            .field("default_timeout", &self.default_timeout)
            .field("max_age", &self.max_age)
            .finish_non_exhaustive()
    }
}

fn default_socket() -> PathBuf {
    match std::env::var("DOCKER_HOST") {
        Ok(host) if host.starts_with("unix://") => PathBuf::from(&host["unix://".len()..]),
        _ => PathBuf::from(DEFAULT_SOCKET),
    }
}

pub(crate) use sandbox_core::posix::{check_env_name, check_root};

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn debug_hides_env_values() {
        let o = DockerOptions::new("img").env("TOKEN", "s3cret");
        let shown = format!("{o:?}");
        assert!(
            shown.contains("TOKEN") && !shown.contains("s3cret"),
            "{shown}"
        );
    }

    #[test]
    fn validation() {
        assert!(DockerOptions::new("img").validate().is_ok());
        assert!(DockerOptions::new("").validate().is_err());
        assert!(
            DockerOptions::new("i")
                .name_prefix("-x")
                .validate()
                .is_err()
        );
        assert!(
            DockerOptions::new("i")
                .name_prefix("a/b")
                .validate()
                .is_err()
        );
        assert!(
            DockerOptions::new("i")
                .workspace_root("rel")
                .validate()
                .is_err()
        );
        assert!(
            DockerOptions::new("i")
                .workspace_root("/a/../b")
                .validate()
                .is_err()
        );
        assert!(DockerOptions::new("i").cpus(0.0).validate().is_err());
        assert!(DockerOptions::new("i").env("A=B", "x").validate().is_err());
        assert!(DockerOptions::new("i").pids_limit(0).validate().is_err());
        assert!(DockerOptions::new("i").pids_limit(-1).validate().is_err());
        assert!(DockerOptions::new("i").pids_limit(None).validate().is_ok());
        let nnp = HostSettings::default().security_opt("no-new-privileges:false");
        assert!(DockerOptions::new("i").host(nnp).validate().is_err());
        let bad = HostSettings::default().cap_add("NET RAW");
        assert!(DockerOptions::new("i").host(bad).validate().is_err());
    }

    #[test]
    fn hardened_by_default() {
        let o = DockerOptions::new("img");
        assert_eq!(o.pids_limit, Some(DEFAULT_PIDS_LIMIT));
        assert!(o.no_new_privileges);
        assert_eq!(o.kept_capabilities(), DEFAULT_CAPABILITIES);
        assert_eq!(o.security_options(), ["no-new-privileges:true"]);
        let o = o.pids_limit(None).no_new_privileges(false);
        assert_eq!(o.pids_limit, None);
        assert!(o.security_options().is_empty());
    }

    #[test]
    fn capabilities_are_relative_to_the_kept_set() {
        let with = |host: HostSettings| DockerOptions::new("img").host(host).kept_capabilities();
        let added = with(
            HostSettings::default()
                .cap_add("cap_net_raw")
                .cap_add("NET_BIND_SERVICE")
                .cap_drop("CAP_KILL")
                .cap_drop("fsetid"),
        );
        assert_eq!(
            added,
            [
                "CHOWN",
                "DAC_OVERRIDE",
                "FOWNER",
                "NET_BIND_SERVICE",
                "NET_RAW",
                "SETGID",
                "SETUID"
            ]
        );
        let none = with(HostSettings::default().cap_drop("ALL").cap_add("CHOWN"));
        assert_eq!(none, ["CHOWN"]);
        // A capability already kept is not listed twice.
        assert_eq!(
            with(HostSettings::default().cap_add("CHOWN")),
            DEFAULT_CAPABILITIES
        );
    }
}
