//! [`LocalOptions`]: how the local backend lays out boxes and runs commands.

use std::collections::BTreeMap;
use std::fmt;
use std::path::PathBuf;
use std::time::Duration;

use sandbox_confine::ConfineOptions;
use sandbox_core::Persistence;

/// `PATH` and `LANG` of the [`EnvPolicy::Minimal`] environment (`sandbox_core::host`'s
/// minimal environment).
pub use sandbox_core::host::{MINIMAL_LANG, MINIMAL_PATH};

/// The base environment of every command, before the spec's, the options' and the request's
/// variables are added.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum EnvPolicy {
    /// Only `PATH` ([`MINIMAL_PATH`]), `HOME` (the workspace root) and `LANG`
    /// ([`MINIMAL_LANG`]). Nothing of the parent process leaks in (tokens, cloud credentials).
    #[default]
    Minimal,
    /// The parent process's whole environment.
    Inherit,
}

/// How a box's commands are kept from the host.
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub enum Isolation {
    /// Confined by the kernel (`sandbox_confine`): one init per box in its own user, mount,
    /// PID, network, IPC, UTS and cgroup namespaces; a read-only view of the host's system
    /// directories, the box directory the only writable place besides a private `/tmp`;
    /// loopback only; no capabilities, no_new_privs, Landlock, a seccomp denylist; resource
    /// limits. Starting a box fails with [`sandbox_core::Error::IsolationUnavailable`] when the
    /// kernel refuses a required piece (weaker levels are asked for in [`ConfineOptions`]).
    Confined(ConfineOptions),
    /// The explicit opt-out: commands run as host processes in the workspace directory, with
    /// the caller's rights. Not a security boundary.
    HostShell,
}

impl Isolation {
    /// Confined with the default [`ConfineOptions`].
    pub fn confined() -> Isolation {
        Isolation::Confined(ConfineOptions::default())
    }

    /// Whether commands are confined.
    pub fn is_confined(&self) -> bool {
        matches!(self, Isolation::Confined(_))
    }
}

impl Default for Isolation {
    /// [`Isolation::Confined`] with the default [`ConfineOptions`]: a box starts only where
    /// the kernel confines it (or fails with the missing piece named); the host shell is the
    /// explicit opt-out.
    fn default() -> Self {
        Isolation::confined()
    }
}

/// Options of [`crate::LocalClient`].
///
/// | option | default |
/// | --- | --- |
/// | [`base_dir`](Self::base_dir) | `./.sandbox/boxes` (relative to the process's cwd when a box is created) |
/// | [`persistence`](Self::persistence) | [`Persistence::Ephemeral`] |
/// | [`env`](Self::env) | [`EnvPolicy::Minimal`] |
/// | [`extra_env`](Self::extra_env) | empty |
/// | [`default_timeout`](Self::default_timeout) | 120 s |
/// | [`shell`](Self::shell) | `["bash", "-c"]` (not a login shell: no profile is read) |
/// | [`isolation`](Self::isolation) | [`Isolation::default`] |
///
/// ```
/// use std::time::Duration;
/// use sandbox_core::Persistence;
/// use sandbox_local::{EnvPolicy, LocalOptions};
/// let options = LocalOptions::default()
///     .base_dir("/var/lib/agent/boxes")
///     .persistence(Persistence::Keep)
///     .env(EnvPolicy::Minimal)
///     .extra_env("CI", "1")
///     .default_timeout(Duration::from_secs(30));
/// assert_eq!(options.shell, ["bash", "-c"]);
/// ```
#[derive(Clone)]
#[non_exhaustive]
pub struct LocalOptions {
    /// Directory holding one subdirectory per box. Created when the first box is.
    pub base_dir: PathBuf,
    /// What [`sandbox_core::BoxHandle::release`] does with a box.
    pub persistence: Persistence,
    /// The base environment of commands.
    pub env: EnvPolicy,
    /// Variables added to every command's environment, after the base environment and the
    /// workspace spec's variables, before the request's.
    pub extra_env: BTreeMap<String, String>,
    /// Timeout of commands whose request sets none.
    pub default_timeout: Duration,
    /// The program and leading arguments that run a shell command line.
    pub shell: Vec<String>,
    /// How commands are kept from the host.
    pub isolation: Isolation,
}

impl Default for LocalOptions {
    fn default() -> Self {
        LocalOptions {
            base_dir: PathBuf::from("./.sandbox/boxes"),
            persistence: Persistence::Ephemeral,
            env: EnvPolicy::Minimal,
            extra_env: BTreeMap::new(),
            default_timeout: Duration::from_secs(120),
            shell: vec!["bash".to_owned(), "-c".to_owned()],
            isolation: Isolation::default(),
        }
    }
}

impl LocalOptions {
    /// Set the directory holding the boxes.
    pub fn base_dir(mut self, dir: impl Into<PathBuf>) -> Self {
        self.base_dir = dir.into();
        self
    }

    /// Keep boxes between calls or remove them on release.
    pub fn persistence(mut self, persistence: Persistence) -> Self {
        self.persistence = persistence;
        self
    }

    /// Set the base environment policy.
    pub fn env(mut self, policy: EnvPolicy) -> Self {
        self.env = policy;
        self
    }

    /// Add one variable to every command's environment.
    pub fn extra_env(mut self, key: impl Into<String>, value: impl Into<String>) -> Self {
        self.extra_env.insert(key.into(), value.into());
        self
    }

    /// Set the timeout used when a request has none.
    pub fn default_timeout(mut self, timeout: Duration) -> Self {
        self.default_timeout = timeout;
        self
    }

    /// Set the isolation.
    pub fn isolation(mut self, isolation: Isolation) -> Self {
        self.isolation = isolation;
        self
    }

    /// Set the shell prefix, e.g. `["sh", "-c"]`.
    pub fn shell<I, S>(mut self, shell: I) -> Self
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
    {
        self.shell = shell.into_iter().map(Into::into).collect();
        self
    }
}

/// Environment values are not printed: they may hold secrets.
impl fmt::Debug for LocalOptions {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LocalOptions")
            .field("base_dir", &self.base_dir)
            .field("persistence", &self.persistence)
            .field("env", &self.env)
            .field("extra_env", &self.extra_env.keys().collect::<Vec<_>>())
            .field("default_timeout", &self.default_timeout)
            .field("shell", &self.shell)
            .field("isolation", &self.isolation)
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_are_documented_ones() {
        let o = LocalOptions::default();
        assert_eq!(o.base_dir, PathBuf::from("./.sandbox/boxes"));
        assert_eq!(o.persistence, Persistence::Ephemeral);
        assert_eq!(o.env, EnvPolicy::Minimal);
        assert!(o.extra_env.is_empty());
        assert_eq!(o.default_timeout, Duration::from_secs(120));
        assert_eq!(o.shell, ["bash", "-c"]);
    }

    #[test]
    fn debug_hides_env_values() {
        let o = LocalOptions::default().extra_env("API_TOKEN", "s3cret-value");
        let shown = format!("{o:?}");
        assert!(shown.contains("API_TOKEN"), "{shown}");
        assert!(!shown.contains("s3cret-value"), "{shown}");
    }
}
