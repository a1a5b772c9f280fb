//! [`RedisOptions`]: where the stores connect, how long they wait, how they name keys.

use std::fmt;
use std::time::Duration;

/// Options of [`RedisStateStore`](crate::RedisStateStore) and
/// [`RedisKvStore`](crate::RedisKvStore).
///
/// | option | default | what |
/// | --- | --- | --- |
/// | `url` | `redis://127.0.0.1:6379` | `redis://[user][:password@]host[:port][/db]` or `redis+unix:///path`; no TLS in this build |
/// | `key_prefix` | `sandbox-harness:` | prepended to every key; no `{` or `}` |
/// | `connect_timeout` | 2 s | one connection attempt (TCP and handshake) |
/// | `response_timeout` | 5 s | one command or script, after which it is [`Error::Timeout`](sandbox_core::Error::Timeout) |
/// | `state_ttl` | none | states expire this long after their last save; fences never expire |
/// | `scan_count` | 1000 | `SCAN … COUNT` hint of a state listing's pages |
/// | `page_size` | 500 | keys per page of a `KvStore` listing |
///
/// `Debug` shows the URL with its password replaced by `***`.
#[derive(Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct RedisOptions {
    /// The server's URL. Its password is never logged nor shown in errors.
    pub url: String,
    /// Prefix of every key the stores write.
    pub key_prefix: String,
    /// Limit of one connection attempt.
    pub connect_timeout: Duration,
    /// Limit of one command or script.
    pub response_timeout: Duration,
    /// Expiry of saved states (restarted by every save). Fences never expire.
    pub state_ttl: Option<Duration>,
    /// `COUNT` hint of each `SCAN` page of a state listing.
    pub scan_count: usize,
    /// Keys per page of a `KvStore` listing.
    pub page_size: usize,
}

impl Default for RedisOptions {
    fn default() -> Self {
        RedisOptions {
            url: "redis://127.0.0.1:6379".to_owned(),
            key_prefix: "sandbox-harness:".to_owned(),
            connect_timeout: Duration::from_secs(2),
            response_timeout: Duration::from_secs(5),
            state_ttl: None,
            scan_count: 1000,
            page_size: 500,
        }
    }
}

impl RedisOptions {
    /// Defaults with `url`.
    pub fn new(url: impl Into<String>) -> Self {
        RedisOptions::default().url(url)
    }

    /// Set the server's URL.
    pub fn url(mut self, url: impl Into<String>) -> Self {
        self.url = url.into();
        self
    }

    /// Set the key prefix (e.g. one per deployment sharing a server).
    pub fn key_prefix(mut self, prefix: impl Into<String>) -> Self {
        self.key_prefix = prefix.into();
        self
    }

    /// Set the limit of one connection attempt.
    pub fn connect_timeout(mut self, timeout: Duration) -> Self {
        self.connect_timeout = timeout;
        self
    }

    /// Set the limit of one command or script.
    pub fn response_timeout(mut self, timeout: Duration) -> Self {
        self.response_timeout = timeout;
        self
    }

    /// Let saved states expire `ttl` after their last save (`None`: never).
    pub fn state_ttl(mut self, ttl: impl Into<Option<Duration>>) -> Self {
        self.state_ttl = ttl.into();
        self
    }

    /// Set the `COUNT` hint of a state listing's `SCAN` pages.
    pub fn scan_count(mut self, count: usize) -> Self {
        self.scan_count = count;
        self
    }

    /// Set the page size of a `KvStore` listing.
    pub fn page_size(mut self, size: usize) -> Self {
        self.page_size = size;
        self
    }

    /// The URL with its user info (if any) replaced by `***` ([`sandbox_core::redact_url`]:
    /// everything between `://` and the last `@`, whatever the password holds).
    pub fn redacted_url(&self) -> String {
        sandbox_core::redact_url(&self.url)
    }
}

impl fmt::Debug for RedisOptions {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RedisOptions")
            .field("url", &self.redacted_url())
            .field("key_prefix", &self.key_prefix)
            .field("connect_timeout", &self.connect_timeout)
            .field("response_timeout", &self.response_timeout)
            .field("state_ttl", &self.state_ttl)
            .field("scan_count", &self.scan_count)
            .field("page_size", &self.page_size)
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Passwords holding raw `/`, `#`, `?`, `@` or percent-encoding never show in `Debug`
    /// (the old cut at the first `/`, `?` or `#` showed the rest of the password).
    #[test]
    fn redaction() {
        let marker = sandbox_core::testkit::logs::SECRET;
        for url in sandbox_core::testkit::logs::secret_urls("redis", "h:6379/0") {
            let o = RedisOptions::new(url.clone());
            for shown in [format!("{o:?}"), o.redacted_url()] {
                assert!(!shown.contains(marker), "{url} -> {shown}");
                assert!(shown.contains("***@h:6379/0"), "{url} -> {shown}");
            }
        }
        let o = RedisOptions::new("redis+unix:///run/r.sock?db=1&pass=pw");
        assert!(format!("{o:?}").contains("pass=***"));
    }
}
