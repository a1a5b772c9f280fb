//! [`E2bOptions`]: where the E2B API and the sandboxes' envd are, and how boxes are made.

use std::collections::BTreeMap;
use std::fmt;
use std::time::Duration;

use sandbox_cloud::{HttpOptions, Secret};
use sandbox_core::posix::{check_env_name, check_root};
use sandbox_core::{Error, Persistence, Result};

pub use e2b_envd_proto::ENVD_PORT;

/// How a box's work survives between calls.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub enum E2bPersistence {
    /// Core's tar snapshots (exported through a command in the sandbox, kept in the
    /// snapshot store). Capabilities say `native_snapshots = false`.
    #[default]
    Tar,
    /// E2B's own snapshots (`POST /sandboxes/{id}/snapshots`, the whole VM's filesystem and
    /// memory): use it with core's `SnapshotFormat::Native`; the store then keeps only the
    /// snapshot's id. Capabilities say `native_snapshots = true`.
    NativeSnapshot,
}

/// Options of [`crate::E2bClient`]. [`E2bOptions::from_env`] reads the same variables as
/// E2B's SDKs; the setters override them.
///
/// `Debug` shows the API key as `***` and the environment's names only.
#[derive(Clone)]
#[non_exhaustive]
pub struct E2bOptions {
    /// `X-API-Key` of every API call (`E2B_API_KEY`).
    pub api_key: Option<Secret>,
    /// The control plane (`E2B_API_URL`, else `https://api.<domain>`).
    pub api_url: String,
    /// The sandboxes' domain (`E2B_DOMAIN`, default `e2b.app`); envd of sandbox `id` is
    /// `https://49983-<id>.<domain>` (the domain a sandbox reports wins).
    pub domain: String,
    /// One base URL for every envd call (`E2B_SANDBOX_URL`): the sandbox is then named by the
    /// `E2b-Sandbox-Id` and `E2b-Sandbox-Port` headers, as E2B's SDKs send them.
    pub sandbox_url: Option<String>,
    /// Template of new sandboxes (default `base`).
    pub template: String,
    /// The sandbox's life after the last API call that set it (`timeout` of create,
    /// `/timeout`, `/connect`); default 300 s, E2B's maximum is 24 h (Pro) or 1 h.
    pub sandbox_timeout: Duration,
    /// Extra metadata on every sandbox (the owner tags are added).
    pub metadata: BTreeMap<String, String>,
    /// Environment of every command (the spec's environment is added on top).
    pub env: BTreeMap<String, String>,
    /// Ask for a secured envd (an access token per sandbox). Default `true`.
    pub secure: bool,
    /// Tar snapshots or E2B's own.
    pub snapshots: E2bPersistence,
    /// What `release` does: remove the sandbox, or pause it for the next call on the key.
    pub persistence: Persistence,
    /// The owner mark (`io.sandbox-harness.owner` metadata) of every sandbox this client
    /// makes: `gc` only removes sandboxes with its own owner. Default `sandbox-harness`.
    pub owner: String,
    /// Workspace root inside the sandbox when the spec names none (default
    /// `/home/user/workspace`, in the `base` template's user home).
    pub workspace_root: String,
    /// Timeout of commands whose request sets none (default 10 min).
    pub default_timeout: Duration,
    /// The longest a box lives before `gc` may remove it (the `expires-at` tag): 24 h.
    pub max_age: Duration,
    /// How long a new or resumed sandbox may take to answer on envd (default 60 s).
    pub ready_timeout: Duration,
    /// While one command runs longer than this, the sandbox's timeout is extended every
    /// such period (default: a third of `sandbox_timeout`).
    pub keepalive_every: Option<Duration>,
    /// Timeouts and retries of API calls.
    pub http: HttpOptions,
}

impl fmt::Debug for E2bOptions {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("E2bOptions")
            .field("api_key", &self.api_key.as_ref().map(|_| "***"))
            .field("api_url", &sandbox_core::RedactedUrl(&self.api_url))
            .field("domain", &self.domain)
            .field(
                "sandbox_url",
                &self.sandbox_url.as_deref().map(sandbox_core::RedactedUrl),
            )
            .field("template", &self.template)
            .field("sandbox_timeout", &self.sandbox_timeout)
            .field("metadata", &self.metadata.keys().collect::<Vec<_>>())
            .field("env", &self.env.keys().collect::<Vec<_>>())
            .field("secure", &self.secure)
            .field("snapshots", &self.snapshots)
            .field("persistence", &self.persistence)
            .field("owner", &self.owner)
            .field("workspace_root", &self.workspace_root)
            .field("default_timeout", &self.default_timeout)
            .field("http", &self.http)
            .finish_non_exhaustive()
    }
}

impl Default for E2bOptions {
    /// E2B's cloud (`https://api.e2b.app`), no key, template `base`.
    fn default() -> Self {
        E2bOptions {
            api_key: None,
            api_url: "https://api.e2b.app".into(),
            domain: "e2b.app".into(),
            sandbox_url: None,
            template: "base".into(),
            sandbox_timeout: Duration::from_secs(300),
            metadata: BTreeMap::new(),
            env: BTreeMap::new(),
            secure: true,
            snapshots: E2bPersistence::Tar,
            persistence: Persistence::Ephemeral,
            owner: "sandbox-harness".into(),
            workspace_root: "/home/user/workspace".into(),
            default_timeout: Duration::from_secs(600),
            max_age: Duration::from_secs(24 * 3600),
            ready_timeout: Duration::from_secs(60),
            keepalive_every: None,
            http: HttpOptions::default(),
        }
    }
}

impl E2bOptions {
    /// Defaults with `api_key`.
    pub fn new(api_key: Secret) -> Self {
        E2bOptions {
            api_key: Some(api_key),
            ..E2bOptions::default()
        }
    }

    /// From the environment: `E2B_API_KEY`, `E2B_DOMAIN`, `E2B_API_URL`, `E2B_SANDBOX_URL`.
    /// E2B's Alibaba-compatible endpoint is `E2B_API_URL=https://api.<region>.sandbox.aliyuncs.com`
    /// with `E2B_DOMAIN=<region>.sandbox.aliyuncs.com`.
    pub fn from_env() -> Self {
        let var = |k: &str| std::env::var(k).ok().filter(|v| !v.is_empty());
        let domain = var("E2B_DOMAIN").unwrap_or_else(|| "e2b.app".into());
        E2bOptions {
            api_key: Secret::from_env("E2B_API_KEY"),
            api_url: var("E2B_API_URL").unwrap_or_else(|| format!("https://api.{domain}")),
            sandbox_url: var("E2B_SANDBOX_URL"),
            domain,
            ..E2bOptions::default()
        }
    }

    /// The API key.
    pub fn api_key(mut self, key: Secret) -> Self {
        self.api_key = Some(key);
        self
    }

    /// The control plane's URL.
    pub fn api_url(mut self, url: impl Into<String>) -> Self {
        self.api_url = url.into();
        self
    }

    /// The sandboxes' domain (and the API at `https://api.<domain>`).
    pub fn domain(mut self, domain: impl Into<String>) -> Self {
        let domain = domain.into();
        self.api_url = format!("https://api.{domain}");
        self.domain = domain;
        self
    }

    /// One base URL for every envd call (see [`E2bOptions::sandbox_url`]).
    pub fn sandbox_url(mut self, url: Option<String>) -> Self {
        self.sandbox_url = url;
        self
    }

    /// The template of new sandboxes.
    pub fn template(mut self, template: impl Into<String>) -> Self {
        self.template = template.into();
        self
    }

    /// The sandbox's timeout after each API call.
    pub fn sandbox_timeout(mut self, timeout: Duration) -> Self {
        self.sandbox_timeout = timeout;
        self
    }

    /// One metadata entry on every sandbox.
    pub fn metadata(mut self, key: impl Into<String>, value: impl Into<String>) -> Self {
        self.metadata.insert(key.into(), value.into());
        self
    }

    /// One environment variable of every command.
    pub fn env(mut self, key: impl Into<String>, value: impl Into<String>) -> Self {
        self.env.insert(key.into(), value.into());
        self
    }

    /// Secured envd (access token) or not.
    pub fn secure(mut self, secure: bool) -> Self {
        self.secure = secure;
        self
    }

    /// Tar or native snapshots.
    pub fn snapshots(mut self, snapshots: E2bPersistence) -> Self {
        self.snapshots = snapshots;
        self
    }

    /// What `release` does.
    pub fn persistence(mut self, persistence: Persistence) -> Self {
        self.persistence = persistence;
        self
    }

    /// The owner mark.
    pub fn owner(mut self, owner: impl Into<String>) -> Self {
        self.owner = owner.into();
        self
    }

    /// The default workspace root.
    pub fn workspace_root(mut self, root: impl Into<String>) -> Self {
        self.workspace_root = root.into();
        self
    }

    /// The default command timeout.
    pub fn default_timeout(mut self, timeout: Duration) -> Self {
        self.default_timeout = timeout;
        self
    }

    /// How long a sandbox may take to answer.
    pub fn ready_timeout(mut self, timeout: Duration) -> Self {
        self.ready_timeout = timeout;
        self
    }

    /// How often a long command extends the sandbox's timeout.
    pub fn keepalive_every(mut self, every: Duration) -> Self {
        self.keepalive_every = Some(every);
        self
    }

    /// API timeouts and retries.
    pub fn http(mut self, http: HttpOptions) -> Self {
        self.http = http;
        self
    }

    /// The keep-alive period in effect.
    pub(crate) fn keepalive_period(&self) -> Duration {
        self.keepalive_every
            .unwrap_or(self.sandbox_timeout / 3)
            .max(Duration::from_secs(1))
    }

    pub(crate) fn validate(&self) -> Result<()> {
        if self.api_key.as_ref().is_none_or(|k| k.expose().is_empty()) {
            return Err(Error::invalid(
                "e2b options",
                "no API key (set E2B_API_KEY or E2bOptions::api_key)",
            ));
        }
        for (what, url) in [
            ("api url", Some(&self.api_url)),
            ("sandbox url", self.sandbox_url.as_ref()),
        ] {
            if let Some(url) = url {
                // User info is sent as basic auth, never as part of the URL (nor shown).
                let (bare, _) = sandbox_core::split_userinfo(url);
                let shown = sandbox_core::redact_url(url);
                let parsed = reqwest::Url::parse(&bare)
                    .map_err(|e| Error::invalid("e2b options", format!("{what} `{shown}`: {e}")))?;
                if !matches!(parsed.scheme(), "http" | "https") {
                    return Err(Error::invalid(
                        "e2b options",
                        format!("{what} `{shown}` is not http(s)"),
                    ));
                }
            }
        }
        if self.template.is_empty() || self.template.contains('/') {
            return Err(Error::invalid(
                "e2b options",
                format!("template `{}` is not a template id or alias", self.template),
            ));
        }
        if self.owner.is_empty() {
            return Err(Error::invalid("e2b options", "the owner mark is empty"));
        }
        if self.sandbox_timeout < Duration::from_secs(1) {
            return Err(Error::invalid(
                "e2b options",
                "the sandbox timeout is under one second",
            ));
        }
        check_root(&self.workspace_root)?;
        for k in self.env.keys() {
            check_env_name(k)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn debug_hides_the_key_and_env_values() {
        let o = E2bOptions::new(Secret::new("e2b_verysecret")).env("TOKEN", "hunter2");
        let shown = format!("{o:?}");
        assert!(
            !shown.contains("verysecret") && !shown.contains("hunter2"),
            "{shown}"
        );
        assert!(shown.contains("TOKEN"), "{shown}");
    }

    #[test]
    fn bad_options_are_typed_errors() {
        assert!(matches!(
            E2bOptions::default().validate(),
            Err(Error::InvalidInput { .. })
        ));
        let ok = E2bOptions::new(Secret::new("k"));
        ok.validate().unwrap();
        for bad in [
            ok.clone().api_url("ftp://x"),
            ok.clone().api_url("not a url"),
            ok.clone().template(""),
            ok.clone().owner(""),
            ok.clone().workspace_root("relative"),
            ok.clone().env("A=B", "x"),
            ok.clone().sandbox_timeout(Duration::ZERO),
        ] {
            assert!(
                matches!(bad.validate(), Err(Error::InvalidInput { .. })),
                "{bad:?}"
            );
        }
    }

    #[test]
    fn domain_sets_the_api_url() {
        let o = E2bOptions::new(Secret::new("k")).domain("cn-hangzhou.sandbox.aliyuncs.com");
        assert_eq!(o.api_url, "https://api.cn-hangzhou.sandbox.aliyuncs.com");
        assert_eq!(o.domain, "cn-hangzhou.sandbox.aliyuncs.com");
    }
}
