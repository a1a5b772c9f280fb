//! [`DaytonaOptions`]: where the Daytona API is, what a sandbox runs, and how long to wait.

use std::collections::BTreeMap;
use std::fmt;
use std::time::Duration;

use sandbox_cloud::{HttpOptions, Secret};
use sandbox_core::posix::{check_env_name, check_root};
use sandbox_core::{Error, Persistence, Result};

/// The public Daytona API (`DAYTONA_API_URL` overrides it).
pub const DEFAULT_API_URL: &str = "https://app.daytona.io/api";
/// Environment variable holding the API key.
pub const API_KEY_VAR: &str = "DAYTONA_API_KEY";
/// Environment variable holding the API URL.
pub const API_URL_VAR: &str = "DAYTONA_API_URL";

/// What a new sandbox runs.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
#[non_exhaustive]
pub enum Source {
    /// The organisation's default snapshot.
    #[default]
    Default,
    /// A snapshot, by id or name (`snapshot`).
    Snapshot(String),
    /// An image, built by Daytona from the Dockerfile `FROM <image>` (`buildInfo`); the only
    /// form the API takes resources (cpu, memory, disk) with.
    Image(String),
}

/// Options of [`DaytonaClient`](crate::DaytonaClient). Built with [`DaytonaOptions::new`] (or
/// [`from_env`](DaytonaOptions::from_env)) and the setters; every field has a documented
/// default.
#[derive(Clone)]
#[non_exhaustive]
pub struct DaytonaOptions {
    /// API base URL. Default [`DEFAULT_API_URL`].
    pub api_url: String,
    /// API key (`Authorization: Bearer`); required. Never printed.
    pub api_key: Option<Secret>,
    /// What a new sandbox runs. Default [`Source::Default`].
    pub source: Source,
    /// CPU cores (only sent with [`Source::Image`]). Default none (Daytona's).
    pub cpu: Option<u32>,
    /// Memory in GB (only sent with [`Source::Image`]). Default none.
    pub memory_gb: Option<u32>,
    /// Disk in GB (only sent with [`Source::Image`]). Default none.
    pub disk_gb: Option<u32>,
    /// Environment of the sandbox (set at creation, and on every command). Default empty.
    pub env: BTreeMap<String, String>,
    /// Extra labels on every sandbox (the owner labels are always added). Default empty.
    pub labels: BTreeMap<String, String>,
    /// Minutes of inactivity after which Daytona stops the sandbox (0 = never). Default 15
    /// (Daytona's).
    pub auto_stop_minutes: u32,
    /// Longest wait for a sandbox to reach `started`. Default 120 s.
    pub start_timeout: Duration,
    /// HTTP timeouts, attempts and backoff. Default [`HttpOptions::default`].
    pub http: HttpOptions,
    /// Prefix of sandbox names and owner tag of this deployment (`gc` removes only its own).
    /// Default `sbx`.
    pub name_prefix: String,
    /// What `release` does: stop ([`Persistence::Keep`]) or delete. Default ephemeral.
    pub persistence: Persistence,
    /// Workspace root in the sandbox. Default `/home/daytona/workspace` (the default
    /// snapshot's user is `daytona`).
    pub workspace_root: String,
    /// Time limit of a command without its own. Default 10 min.
    pub default_timeout: Duration,
    /// Expiry written into the owner labels (`gc` may remove older boxes). Default 24 h.
    pub max_age: Duration,
}

/// The key is never printed; the environment only by name.
impl fmt::Debug for DaytonaOptions {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DaytonaOptions")
            .field("api_url", &sandbox_core::RedactedUrl(&self.api_url))
            .field("api_key", &self.api_key.as_ref().map(|_| "***"))
            .field("source", &self.source)
            .field("cpu", &self.cpu)
            .field("memory_gb", &self.memory_gb)
            .field("disk_gb", &self.disk_gb)
            .field("env", &self.env.keys().collect::<Vec<_>>())
            .field("labels", &self.labels)
            .field("auto_stop_minutes", &self.auto_stop_minutes)
            .field("start_timeout", &self.start_timeout)
            .field("http", &self.http)
            .field("name_prefix", &self.name_prefix)
            .field("persistence", &self.persistence)
            .field("workspace_root", &self.workspace_root)
            .field("default_timeout", &self.default_timeout)
            .field("max_age", &self.max_age)
            .finish()
    }
}

impl Default for DaytonaOptions {
    fn default() -> Self {
        DaytonaOptions {
            api_url: DEFAULT_API_URL.to_owned(),
            api_key: None,
            source: Source::Default,
            cpu: None,
            memory_gb: None,
            disk_gb: None,
            env: BTreeMap::new(),
            labels: BTreeMap::new(),
            auto_stop_minutes: 15,
            start_timeout: Duration::from_secs(120),
            http: HttpOptions::default(),
            name_prefix: "sbx".to_owned(),
            persistence: Persistence::Ephemeral,
            workspace_root: "/home/daytona/workspace".to_owned(),
            default_timeout: Duration::from_secs(600),
            max_age: Duration::from_secs(24 * 3600),
        }
    }
}

impl DaytonaOptions {
    /// Options for the API at `api_url` with `api_key`.
    pub fn new(api_url: impl Into<String>, api_key: Secret) -> Self {
        DaytonaOptions {
            api_url: api_url.into(),
            api_key: Some(api_key),
            ..DaytonaOptions::default()
        }
    }

    /// Options from `DAYTONA_API_KEY` (required) and `DAYTONA_API_URL` (default
    /// [`DEFAULT_API_URL`]).
    pub fn from_env() -> Result<Self> {
        let key = Secret::from_env(API_KEY_VAR)
            .ok_or_else(|| Error::invalid("api key", format!("{API_KEY_VAR} is not set")))?;
        let url = std::env::var(API_URL_VAR)
            .ok()
            .filter(|u| !u.is_empty())
            .unwrap_or_else(|| DEFAULT_API_URL.to_owned());
        Ok(DaytonaOptions::new(url, key))
    }

    /// Run a snapshot (id or name).
    pub fn snapshot(mut self, snapshot: impl Into<String>) -> Self {
        self.source = Source::Snapshot(snapshot.into());
        self
    }

    /// Run an image (built by Daytona).
    pub fn image(mut self, image: impl Into<String>) -> Self {
        self.source = Source::Image(image.into());
        self
    }

    /// CPU cores, memory and disk in GB (sent with an image only).
    pub fn resources(mut self, cpu: u32, memory_gb: u32, disk_gb: u32) -> Self {
        self.cpu = Some(cpu);
        self.memory_gb = Some(memory_gb);
        self.disk_gb = Some(disk_gb);
        self
    }

    /// Add an environment variable.
    pub fn env(mut self, key: impl Into<String>, value: impl Into<String>) -> Self {
        self.env.insert(key.into(), value.into());
        self
    }

    /// Add a label.
    pub fn label(mut self, key: impl Into<String>, value: impl Into<String>) -> Self {
        self.labels.insert(key.into(), value.into());
        self
    }

    /// Auto-stop interval in minutes (0 = never).
    pub fn auto_stop_minutes(mut self, minutes: u32) -> Self {
        self.auto_stop_minutes = minutes;
        self
    }

    /// Longest wait for `started`.
    pub fn start_timeout(mut self, t: Duration) -> Self {
        self.start_timeout = t;
        self
    }

    /// HTTP timeouts and retries.
    pub fn http(mut self, http: HttpOptions) -> Self {
        self.http = http;
        self
    }

    /// Name prefix and owner tag.
    pub fn name_prefix(mut self, prefix: impl Into<String>) -> Self {
        self.name_prefix = prefix.into();
        self
    }

    /// Keep (stop) or delete at release.
    pub fn persistence(mut self, p: Persistence) -> Self {
        self.persistence = p;
        self
    }

    /// Workspace root.
    pub fn workspace_root(mut self, root: impl Into<String>) -> Self {
        self.workspace_root = root.into();
        self
    }

    /// Default command time limit.
    pub fn default_timeout(mut self, t: Duration) -> Self {
        self.default_timeout = t;
        self
    }

    /// Expiry written into the owner labels.
    pub fn max_age(mut self, t: Duration) -> Self {
        self.max_age = t;
        self
    }

    /// Check the options (a clear [`Error::InvalidInput`] for each mistake).
    pub fn validate(&self) -> Result<()> {
        let shown = sandbox_core::redact_url(&self.api_url);
        if !(self.api_url.starts_with("http://") || self.api_url.starts_with("https://")) {
            return Err(Error::invalid(
                "api url",
                format!("`{shown}` is not an http(s) URL"),
            ));
        }
        // The API key goes in `Authorization: Bearer`; user info in the URL would be a second
        // `Authorization` (reqwest sends it as basic auth), and shows wherever the URL does.
        if sandbox_core::raw_userinfo(&self.api_url).is_some() {
            return Err(Error::invalid(
                "api url",
                format!("`{shown}` carries user info; Daytona authenticates with the API key only"),
            ));
        }
        match &self.api_key {
            Some(k) if !k.expose().is_empty() => {}
            _ => {
                return Err(Error::invalid(
                    "api key",
                    format!("no Daytona API key (set {API_KEY_VAR} or pass one)"),
                ));
            }
        }
        let p = &self.name_prefix;
        if p.is_empty()
            || p.len() > 20
            || !p
                .bytes()
                .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
            || !p.as_bytes()[0].is_ascii_lowercase()
        {
            return Err(Error::invalid(
                "name prefix",
                format!("`{p}` must be 1-20 of [a-z0-9-], starting with a letter"),
            ));
        }
        check_root(&self.workspace_root)?;
        for k in self.env.keys() {
            check_env_name(k)?;
        }
        if matches!(&self.source, Source::Snapshot(s) | Source::Image(s) if s.trim().is_empty()) {
            return Err(Error::invalid("source", "an empty snapshot or image name"));
        }
        if self.start_timeout.is_zero() || self.default_timeout.is_zero() {
            return Err(Error::invalid("timeouts", "must be above zero"));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn debug_hides_the_key_and_env_values() {
        let o =
            DaytonaOptions::new("https://x/api", Secret::new("dtn_s3cret")).env("TOKEN", "hunter2");
        let shown = format!("{o:?}");
        assert!(
            !shown.contains("dtn_s3cret") && !shown.contains("hunter2"),
            "{shown}"
        );
        assert!(shown.contains("TOKEN"), "{shown}");
    }

    #[test]
    fn validation_names_the_mistake() {
        let ok = DaytonaOptions::new("https://x/api", Secret::new("k"));
        ok.validate().unwrap();
        let bad = |o: DaytonaOptions, what: &str| match o.validate() {
            Err(Error::InvalidInput { what: w, .. }) => assert_eq!(w, what),
            other => panic!("{what}: {other:?}"),
        };
        bad(ok.clone().name_prefix("Bad_Prefix"), "name prefix");
        bad(DaytonaOptions::default(), "api key");
        bad(DaytonaOptions::new("ftp://x", Secret::new("k")), "api url");
        bad(ok.clone().snapshot(" "), "source");
        assert!(ok.clone().workspace_root("relative").validate().is_err());
    }
}
