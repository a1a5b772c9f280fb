use std::collections::BTreeMap;
use std::fmt;
use std::path::PathBuf;
use std::time::Duration;

/// Directory under the project that holds the default workspace.
pub const DEFAULT_WORKSPACE_DIR: &str = ".sandbox-harness/workspace";

/// How a local filesystem accepts paths (the spec's `LocalFsMode`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum PathPolicy {
    /// Relative paths name the workspace view (workspace over project); absolute paths are
    /// accepted only under the workspace, the project and the extra roots. `..` is refused.
    #[default]
    Rooted,
    /// Everything is anchored at the workspace view; absolute paths and `..` are refused.
    Sandboxed,
    /// Absolute paths pass through unchecked (relative ones still name the workspace view
    /// and may not climb with `..`). Only for tests and fully trusted environments.
    Unrestricted,
}

/// Options of the local mode (the spec's `LocalFilesystemSpec`).
///
/// | option | default |
/// | --- | --- |
/// | `project` | the process's current directory |
/// | `workspace` | `<project>/.sandbox-harness/workspace` |
/// | `policy` | [`PathPolicy::Rooted`] |
/// | `extra_roots` | none |
/// | `project_writable` | `false` |
/// | `shell` | `true` |
/// | `timeout` | 120 s |
/// | `max_output_bytes` | 100,000 (per stream) |
/// | `env` | none added |
/// | `inherit_env` | `false` (commands see `PATH`, `HOME`, `LANG` and `env` only) |
#[derive(Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct LocalOptions {
    /// Project root: overlay lower layer and the shell's working directory.
    pub project: Option<PathBuf>,
    /// Workspace root: overlay upper layer, where writes go.
    pub workspace: Option<PathBuf>,
    /// Path policy.
    pub policy: PathPolicy,
    /// Extra host directories reachable by absolute path under [`PathPolicy::Rooted`].
    pub extra_roots: Vec<PathBuf>,
    /// Route writes of non-metadata paths to the project instead of the workspace.
    pub project_writable: bool,
    /// Offer a shell (`sh -c` on the host, cwd = project).
    pub shell: bool,
    /// Default command timeout.
    pub timeout: Duration,
    /// Most bytes of stdout (and, separately, stderr) kept per command.
    pub max_output_bytes: usize,
    /// Variables added to every command's environment.
    pub env: BTreeMap<String, String>,
    /// Commands inherit this process's whole environment.
    pub inherit_env: bool,
}

impl Default for LocalOptions {
    fn default() -> Self {
        LocalOptions {
            project: None,
            workspace: None,
            policy: PathPolicy::Rooted,
            extra_roots: Vec::new(),
            project_writable: false,
            shell: true,
            timeout: Duration::from_secs(120),
            max_output_bytes: 100_000,
            env: BTreeMap::new(),
            inherit_env: false,
        }
    }
}

impl LocalOptions {
    /// Set the project root.
    pub fn project(mut self, dir: impl Into<PathBuf>) -> Self {
        self.project = Some(dir.into());
        self
    }

    /// Set the workspace root.
    pub fn workspace(mut self, dir: impl Into<PathBuf>) -> Self {
        self.workspace = Some(dir.into());
        self
    }

    /// Set the path policy.
    pub fn policy(mut self, policy: PathPolicy) -> Self {
        self.policy = policy;
        self
    }

    /// Allow another host directory (by absolute path, under [`PathPolicy::Rooted`]).
    pub fn add_root(mut self, dir: impl Into<PathBuf>) -> Self {
        self.extra_roots.push(dir.into());
        self
    }

    /// Route non-metadata writes to the project.
    pub fn project_writable(mut self, yes: bool) -> Self {
        self.project_writable = yes;
        self
    }

    /// Offer a shell or not.
    pub fn shell(mut self, yes: bool) -> Self {
        self.shell = yes;
        self
    }

    /// Set the default command timeout.
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// Set the per-stream output cap.
    pub fn max_output_bytes(mut self, max: usize) -> Self {
        self.max_output_bytes = max;
        self
    }

    /// Add an environment variable for commands.
    pub fn env(mut self, key: impl Into<String>, value: impl Into<String>) -> Self {
        self.env.insert(key.into(), value.into());
        self
    }

    /// Inherit this process's environment.
    pub fn inherit_env(mut self, yes: bool) -> Self {
        self.inherit_env = yes;
        self
    }
}

/// Environment values are not printed: they may hold secrets.
impl fmt::Debug for LocalOptions {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LocalOptions")
            .field("project", &self.project)
            .field("workspace", &self.workspace)
            .field("policy", &self.policy)
            .field("extra_roots", &self.extra_roots)
            .field("project_writable", &self.project_writable)
            .field("shell", &self.shell)
            .field("timeout", &self.timeout)
            .field("max_output_bytes", &self.max_output_bytes)
            .field("env", &self.env.keys().collect::<Vec<_>>())
            .field("inherit_env", &self.inherit_env)
            .finish()
    }
}
