//! [`RedisGuardOptions`]: lease timing, waiting, key prefix and Redis timeouts.

use std::time::Duration;

/// Options of [`RedisGuard`](crate::RedisGuard). Every field has a builder setter; the
/// defaults:
///
/// | option | default | meaning |
/// | --- | --- | --- |
/// | [`lease_ttl`](Self::lease_ttl) | 30 s | a lease's life without renewal (renewed every third of it) |
/// | [`retry_interval`](Self::retry_interval) | 50 ms | first pause of a waiter (then doubling, full jitter) |
/// | [`max_retry_interval`](Self::max_retry_interval) | 1 s | longest pause of a waiter |
/// | [`max_wait`](Self::max_wait) | 10 min | longest `enter` on a held key before `Error::Timeout` |
/// | [`key_prefix`](Self::key_prefix) | `sandbox:lock:` | prepended to every Redis key |
/// | [`command_timeout`](Self::command_timeout) | 2 s | longest wait for one Redis reply |
/// | [`connect_timeout`](Self::connect_timeout) | 2 s | longest wait for a connection (URL connections) |
///
/// The connection's URL, with its password, is not part of the options: it is given to
/// [`RedisGuard::connect`](crate::RedisGuard::connect) and never kept, logged or shown.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct RedisGuardOptions {
    /// How long a lease lives in Redis without renewal (the spec's `leaseTtl`). The holder
    /// renews it every third of this; a holder that dies delays the next one by at most this.
    pub lease_ttl: Duration,
    /// The first pause of a waiter on a held key (the spec's `retryInterval`); each further
    /// pause has twice the ceiling, up to [`max_retry_interval`](Self::max_retry_interval),
    /// and is drawn at random below it (full jitter), so waiters never poll in lockstep.
    pub retry_interval: Duration,
    /// The longest pause between two attempts of a waiter.
    pub max_retry_interval: Duration,
    /// The longest [`enter`](sandbox_core::SandboxExecutionGuard::enter) on a held key, then
    /// [`Error::Timeout`](sandbox_core::Error::Timeout).
    pub max_wait: Duration,
    /// Prepended to every key the guard writes (the spec's `keyPrefix`); may not contain `{`
    /// or `}` (the key's hash tag follows it).
    pub key_prefix: String,
    /// The longest wait for one Redis reply, then [`Error::Timeout`](sandbox_core::Error::Timeout).
    /// A renewal waits at most until the lease's deadline.
    pub command_timeout: Duration,
    /// The longest wait for a connection to be set up, then
    /// [`Error::Unavailable`](sandbox_core::Error::Unavailable). Applies to connections the
    /// guard makes from a URL; a caller-provided connection keeps its own settings.
    pub connect_timeout: Duration,
}

impl Default for RedisGuardOptions {
    fn default() -> Self {
        RedisGuardOptions {
            lease_ttl: Duration::from_secs(30),
            retry_interval: Duration::from_millis(50),
            max_retry_interval: Duration::from_secs(1),
            max_wait: Duration::from_secs(600),
            key_prefix: DEFAULT_KEY_PREFIX.to_owned(),
            command_timeout: Duration::from_secs(2),
            connect_timeout: Duration::from_secs(2),
        }
    }
}

/// The default [`RedisGuardOptions::key_prefix`].
pub const DEFAULT_KEY_PREFIX: &str = "sandbox:lock:";

/// The shortest lease TTL: Redis expires keys in milliseconds, and the renewal needs a few
/// round trips per TTL.
pub const MIN_LEASE_TTL: Duration = Duration::from_millis(30);

impl RedisGuardOptions {
    /// The defaults (see the table above).
    pub fn new() -> Self {
        Self::default()
    }

    /// Set the lease time to live (at least [`MIN_LEASE_TTL`]).
    pub fn lease_ttl(mut self, ttl: Duration) -> Self {
        self.lease_ttl = ttl.max(MIN_LEASE_TTL);
        self
    }

    /// Set the first pause of a waiter (at least 1 ms); the longest pause is raised to it if
    /// lower.
    pub fn retry_interval(mut self, first: Duration) -> Self {
        self.retry_interval = first.max(Duration::from_millis(1));
        self.max_retry_interval = self.max_retry_interval.max(self.retry_interval);
        self
    }

    /// Set the longest pause of a waiter (never below the first one).
    pub fn max_retry_interval(mut self, max: Duration) -> Self {
        self.max_retry_interval = max.max(self.retry_interval);
        self
    }

    /// Set the longest wait for a held key.
    pub fn max_wait(mut self, wait: Duration) -> Self {
        self.max_wait = wait;
        self
    }

    /// Set the key prefix (checked when the guard is made: no `{` or `}`).
    pub fn key_prefix(mut self, prefix: impl Into<String>) -> Self {
        self.key_prefix = prefix.into();
        self
    }

    /// Set the longest wait for one Redis reply (at least 1 ms).
    pub fn command_timeout(mut self, timeout: Duration) -> Self {
        self.command_timeout = timeout.max(Duration::from_millis(1));
        self
    }

    /// Set the longest wait for a connection (at least 1 ms).
    pub fn connect_timeout(mut self, timeout: Duration) -> Self {
        self.connect_timeout = timeout.max(Duration::from_millis(1));
        self
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn setters_keep_the_options_sane() {
        let o = RedisGuardOptions::new()
            .lease_ttl(Duration::from_millis(1))
            .retry_interval(Duration::from_millis(40))
            .max_retry_interval(Duration::from_millis(10))
            .command_timeout(Duration::ZERO);
        assert_eq!(o.lease_ttl, MIN_LEASE_TTL);
        assert_eq!(o.retry_interval, Duration::from_millis(40));
        assert_eq!(
            o.max_retry_interval,
            Duration::from_millis(40),
            "never below the first"
        );
        assert_eq!(o.command_timeout, Duration::from_millis(1));
        let o = o.retry_interval(Duration::from_secs(3));
        assert_eq!(
            o.max_retry_interval,
            Duration::from_secs(3),
            "raised to the first"
        );
    }
}
