//! [`RedisGuard`]: the guard, its leases and their renewal.

use std::fmt;
use std::future::Future;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use async_trait::async_trait;
use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use redis::{FromRedisValue, IntoConnectionInfo, RedisResult, Script};
use sandbox_core::{Error, IsolationKey, Lease, LeaseHandle, Reach, Result, SandboxExecutionGuard};
use tokio_util::sync::CancellationToken;

use crate::error::{self, BACKEND};
use crate::options::RedisGuardOptions;
use crate::scripts::{GRANT, RELEASE, RENEW};

/// Leases per isolation key in Redis, shared by every process that reaches the server: the
/// distributed [`SandboxExecutionGuard`] (see the crate docs for keys, scripts and failure
/// behaviour). Cheap to clone; clones share the connection.
#[derive(Clone)]
pub struct RedisGuard {
    inner: Arc<Inner>,
}

struct Inner {
    conn: ConnectionManager,
    /// The server by address ("redis at 10.0.0.5:6379/0"), never with the password.
    service: String,
    options: RedisGuardOptions,
}

impl fmt::Debug for RedisGuard {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RedisGuard")
            .field("service", &self.inner.service)
            .field("options", &self.inner.options)
            .finish_non_exhaustive()
    }
}

/// The label of a connection the caller made (its address is not known here).
const CALLER_CONNECTION: &str = "redis (caller's connection)";

impl RedisGuard {
    /// Connect to the server at `url` (`redis://[[user]:password@]host[:port][/db]`) and check
    /// that it answers. The URL is not kept; errors and `Debug` name the server by address.
    ///
    /// Fails with [`Error::InvalidInput`] for a malformed URL or key prefix, with
    /// [`Error::Unavailable`] or [`Error::Timeout`] if the server cannot be reached, and with
    /// [`Error::Backend`] if it refuses the credentials.
    pub async fn connect(url: &str, options: RedisGuardOptions) -> Result<RedisGuard> {
        let guard = RedisGuard::open(url, options)?;
        guard.ping().await?;
        Ok(guard)
    }

    /// Like [`connect`](Self::connect), without contacting the server: the connection is made
    /// on first use (and remade after a failure), so a server that is down shows as
    /// [`Error::Unavailable`] on the first `enter`. Must be called within a Tokio runtime.
    pub fn open(url: &str, options: RedisGuardOptions) -> Result<RedisGuard> {
        check_prefix(&options.key_prefix)?;
        // The parser's messages may quote the URL: say what is expected instead.
        let info = url.into_connection_info().map_err(|_| {
            Error::invalid(
                "redis URL",
                "expected redis://[[user]:password@]host[:port][/db] (no TLS)",
            )
        })?;
        let service = format!("redis at {}/{}", info.addr(), info.redis_settings().db());
        if tokio::runtime::Handle::try_current().is_err() {
            return Err(Error::backend(
                BACKEND,
                "connect",
                format!("{service}: a Redis connection needs a Tokio runtime"),
            ));
        }
        let client = redis::Client::open(info)
            .map_err(|e| error::from_redis(&service, "connect", options.connect_timeout, e))?;
        // One connection attempt per command: the guard's callers decide when to retry, and
        // `enter` on a server that is down must fail fast, not wait out reconnection backoff.
        let config = ConnectionManagerConfig::new()
            .set_connection_timeout(Some(options.connect_timeout))
            .set_response_timeout(Some(options.command_timeout))
            .set_number_of_retries(0);
        let conn = ConnectionManager::new_lazy_with_config(client, config)
            .map_err(|e| error::from_redis(&service, "connect", options.connect_timeout, e))?;
        Ok(RedisGuard::build(conn, service, options))
    }

    /// A guard on a connection the caller made (e.g. shared with a Redis state store). Its
    /// reconnection and timeout settings stay the caller's; the guard still bounds every
    /// command by [`RedisGuardOptions::command_timeout`].
    pub fn with_connection(
        conn: ConnectionManager,
        options: RedisGuardOptions,
    ) -> Result<RedisGuard> {
        check_prefix(&options.key_prefix)?;
        Ok(RedisGuard::build(
            conn,
            CALLER_CONNECTION.to_owned(),
            options,
        ))
    }

    fn build(conn: ConnectionManager, service: String, options: RedisGuardOptions) -> Self {
        RedisGuard {
            inner: Arc::new(Inner {
                conn,
                service,
                options,
            }),
        }
    }

    /// The options in use.
    pub fn options(&self) -> &RedisGuardOptions {
        &self.inner.options
    }

    /// The Redis key of `key`'s lease: `<prefix>{<scope>:<key>}`. Its value is the holder's
    /// random owner id.
    pub fn lease_key(&self, key: &IsolationKey) -> String {
        format!(
            "{}{{{}:{}}}",
            self.inner.options.key_prefix,
            key.scope().as_str(),
            key.as_str()
        )
    }

    /// The Redis key of `key`'s fencing counter: the lease key with `:fence` appended (same
    /// hash tag, so the same cluster slot). It holds the last token granted and never expires.
    pub fn fence_key(&self, key: &IsolationKey) -> String {
        format!("{}:fence", self.lease_key(key))
    }

    /// Check that the server answers (`PING`).
    pub async fn ping(&self) -> Result<()> {
        let budget = self.inner.options.connect_timeout + self.inner.options.command_timeout;
        self.inner
            .call::<String, _, _>("ping", budget, |mut c| async move {
                redis::cmd("PING").query_async(&mut c).await
            })
            .await
            .map(drop)
    }

    /// One attempt: take the key if no one holds it.
    async fn attempt(&self, key: &IsolationKey) -> Result<Option<Lease>> {
        let options = &self.inner.options;
        let lease_key = self.lease_key(key);
        let fence_key = self.fence_key(key);
        let owner = uuid::Uuid::new_v4().simple().to_string();
        let ttl_ms = millis(options.lease_ttl).to_string();
        let floor = now_micros().to_string();
        let valid = validity(options.lease_ttl);
        // Counted from before the grant was sent: never later than Redis's own expiry.
        let started = Instant::now();
        // A reply later than the lease's validity would bring a lease already lost.
        let budget = options.command_timeout.min(valid);
        let granted = self
            .inner
            .eval::<Option<u64>>(
                "grant",
                &GRANT,
                &[&lease_key, &fence_key],
                &[&owner, &ttl_ms, &floor],
                budget,
            )
            .await;
        let token = match granted {
            Ok(Some(token)) => token,
            Ok(None) => return Ok(None),
            Err(e) => {
                // The grant may have been applied and only its reply lost: give it back.
                Held::spawn_release(self.inner.clone(), lease_key, owner);
                return Err(e);
            }
        };
        tracing::debug!(key = %key, token, "lease granted");
        let lost = CancellationToken::new();
        let held = Arc::new(Held {
            guard: self.inner.clone(),
            lease_key,
            owner,
            token,
            deadline: Mutex::new(started + valid),
            lost: lost.clone(),
        });
        let renewal = tokio::spawn(renew(held.clone(), started));
        Ok(Some(
            Lease::new(
                key.clone(),
                Some(token),
                Box::new(RedisLease {
                    held,
                    renewal: Some(renewal),
                }),
            )
            .with_lost_signal(lost),
        ))
    }
}

fn check_prefix(prefix: &str) -> Result<()> {
    if prefix.contains(['{', '}']) {
        return Err(Error::invalid(
            "redis key prefix",
            "may not contain `{` or `}` (the key's hash tag follows the prefix)",
        ));
    }
    Ok(())
}

impl Inner {
    /// Run `script` with `keys` and `args`, bounded by `budget`.
    async fn eval<T: FromRedisValue>(
        &self,
        op: &'static str,
        script: &'static Script,
        keys: &[&str],
        args: &[&str],
        budget: Duration,
    ) -> Result<T> {
        let mut invocation = script.prepare_invoke();
        for k in keys {
            invocation.key(*k);
        }
        for a in args {
            invocation.arg(*a);
        }
        let invocation = &invocation;
        self.call(op, budget, move |mut c| async move {
            invocation.invoke_async(&mut c).await
        })
        .await
    }

    /// Run one request on a clone of the connection, bounded by `budget`, mapping errors at
    /// the crate edge. A request that failed because the connection had dropped is sent once
    /// more (the connection manager reconnects meanwhile): every script of a lease can be
    /// repeated with the same owner id.
    async fn call<T, F, Fut>(&self, op: &'static str, budget: Duration, mut request: F) -> Result<T>
    where
        F: FnMut(ConnectionManager) -> Fut,
        Fut: Future<Output = RedisResult<T>>,
    {
        let deadline = tokio::time::Instant::now() + budget;
        let mut resent = false;
        loop {
            match tokio::time::timeout_at(deadline, request(self.conn.clone())).await {
                Err(_) => return Err(error::timeout(&self.service, op, budget)),
                Ok(Ok(value)) => return Ok(value),
                Ok(Err(e)) if !resent && e.is_connection_dropped() => {
                    tracing::debug!(service = %self.service, op, error = %e, "connection lost; sending once more");
                    resent = true;
                }
                Ok(Err(e)) => return Err(error::from_redis(&self.service, op, budget, e)),
            }
        }
    }
}

/// The lease's validity as the holder counts it: the TTL less an allowance for the two clocks
/// (ours and the server's) running at slightly different rates.
fn validity(ttl: Duration) -> Duration {
    ttl.saturating_sub(ttl / 100 + Duration::from_millis(1))
}

fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

/// The lowest token a grant issues: the clock in microseconds. Tokens then start above any
/// counter a state store issued before this guard was used, and stay above the last one even
/// if a failover lost the counter's latest increments.
fn now_micros() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_micros()).unwrap_or(u64::MAX))
}

/// What a holder knows of its lease; shared by the lease and its renewal task.
struct Held {
    guard: Arc<Inner>,
    lease_key: String,
    /// The random id stored as the lease's value; compared by renewal and release.
    owner: String,
    token: u64,
    /// Until when the lease is certainly ours: the start of the last successful grant or
    /// renewal plus the validity.
    deadline: Mutex<Instant>,
    lost: CancellationToken,
}

impl Held {
    fn deadline(&self) -> Instant {
        *self.deadline.lock().expect("deadline lock")
    }

    /// Whether the lease is lost; past the deadline that is certain, and the signal fires.
    fn check_lost(&self) -> bool {
        if self.lost.is_cancelled() {
            return true;
        }
        if Instant::now() >= self.deadline() {
            self.lost.cancel();
            return true;
        }
        false
    }

    async fn release(&self) -> Result<()> {
        release(&self.guard, &self.lease_key, &self.owner).await
    }

    /// Compare-and-delete in the background, if there is a runtime (else the TTL frees it).
    fn spawn_release(guard: Arc<Inner>, lease_key: String, owner: String) {
        let Ok(rt) = tokio::runtime::Handle::try_current() else {
            return;
        };
        rt.spawn(async move {
            if let Err(e) = release(&guard, &lease_key, &owner).await {
                tracing::debug!(key = %lease_key, error = %e, "releasing in the background failed; the lease expires by itself");
            }
        });
    }
}

async fn release(guard: &Inner, lease_key: &str, owner: &str) -> Result<()> {
    let budget = guard.options.command_timeout;
    let deleted: i64 = guard
        .eval("release", &RELEASE, &[lease_key], &[owner], budget)
        .await?;
    if deleted == 0 {
        tracing::debug!(key = %lease_key, "the lease was no longer ours; left to its holder");
    }
    Ok(())
}

/// Renew every third of the TTL while the lease is held. A renewal refused (the lease is
/// someone else's, or gone) or not done by the deadline cancels the lost signal; a failed one
/// is retried until the deadline.
async fn renew(held: Arc<Held>, granted: Instant) {
    let options = &held.guard.options;
    let every = options.lease_ttl / 3;
    let ttl_ms = millis(options.lease_ttl).to_string();
    let valid = validity(options.lease_ttl);
    let mut next = granted + every;
    loop {
        // Wake at the deadline at the latest: the signal then fires on time.
        let wake = next.min(held.deadline());
        tokio::select! {
            () = held.lost.cancelled() => return,
            () = tokio::time::sleep_until(wake.into()) => {}
        }
        let started = Instant::now();
        let deadline = held.deadline();
        if started >= deadline {
            tracing::warn!(key = %held.lease_key, token = held.token, "lease expired before it could be renewed");
            held.lost.cancel();
            return;
        }
        let budget = options.command_timeout.min(deadline - started);
        let renewed = held
            .guard
            .eval::<i64>(
                "renew",
                &RENEW,
                &[&held.lease_key],
                &[&held.owner, &ttl_ms],
                budget,
            )
            .await;
        match renewed {
            Ok(1) => {
                *held.deadline.lock().expect("deadline lock") = started + valid;
                next = started + every;
            }
            Ok(_) => {
                tracing::warn!(key = %held.lease_key, token = held.token, "lease taken over or expired in Redis");
                held.lost.cancel();
                return;
            }
            Err(e) => {
                tracing::warn!(key = %held.lease_key, token = held.token, error = %e, "lease renewal failed; retrying until its deadline");
                next = Instant::now() + every / 3;
            }
        }
    }
}

struct RedisLease {
    held: Arc<Held>,
    renewal: Option<tokio::task::JoinHandle<()>>,
}

impl fmt::Debug for RedisLease {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RedisLease")
            .field("key", &self.held.lease_key)
            .field("token", &self.held.token)
            .finish_non_exhaustive()
    }
}

impl RedisLease {
    fn stop_renewal(&mut self) {
        if let Some(task) = self.renewal.take() {
            task.abort();
        }
    }
}

impl Drop for RedisLease {
    fn drop(&mut self) {
        self.stop_renewal();
    }
}

#[async_trait]
impl LeaseHandle for RedisLease {
    fn is_lost(&self) -> bool {
        self.held.check_lost()
    }

    async fn release(&mut self) -> Result<()> {
        self.stop_renewal();
        self.held.release().await
    }

    fn release_detached(&mut self) {
        self.stop_renewal();
        Held::spawn_release(
            self.held.guard.clone(),
            self.held.lease_key.clone(),
            self.held.owner.clone(),
        );
    }
}

/// The pauses of a waiter: exponential ceilings with full jitter (each pause drawn uniformly
/// below the ceiling), at least [`Backoff::MIN`] so that a waiter never spins.
#[derive(Debug)]
pub(crate) struct Backoff {
    ceiling: Duration,
    max: Duration,
}

impl Backoff {
    pub(crate) const MIN: Duration = Duration::from_millis(1);

    pub(crate) fn new(first: Duration, max: Duration) -> Self {
        Backoff {
            ceiling: first,
            max: max.max(first),
        }
    }

    pub(crate) fn next_pause(&mut self) -> Duration {
        let pause = self.ceiling.mul_f64(fastrand::f64()).max(Self::MIN);
        self.ceiling = self.ceiling.saturating_mul(2).min(self.max);
        pause
    }
}

#[async_trait]
impl SandboxExecutionGuard for RedisGuard {
    #[tracing::instrument(level = "debug", skip_all, fields(key = %key))]
    async fn enter(&self, key: &IsolationKey) -> Result<Lease> {
        let options = &self.inner.options;
        let started = Instant::now();
        let mut backoff = Backoff::new(options.retry_interval, options.max_retry_interval);
        loop {
            if let Some(lease) = self.attempt(key).await? {
                return Ok(lease);
            }
            let waited = started.elapsed();
            if waited >= options.max_wait {
                return Err(Error::Timeout {
                    operation: format!("waiting for the lease on {key}"),
                    after: waited,
                });
            }
            let pause = backoff.next_pause().min(options.max_wait - waited);
            tokio::time::sleep(pause).await;
        }
    }

    #[tracing::instrument(level = "debug", skip_all, fields(key = %key))]
    async fn try_enter(&self, key: &IsolationKey) -> Result<Option<Lease>> {
        self.attempt(key).await
    }

    fn reach(&self) -> Reach {
        Reach::Cluster
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_grows_to_its_cap_with_full_jitter() {
        let (first, max) = (Duration::from_millis(10), Duration::from_millis(80));
        let mut b = Backoff::new(first, max);
        let mut ceilings = Vec::new();
        let mut pauses = Vec::new();
        for _ in 0..200 {
            ceilings.push(b.ceiling);
            let p = b.next_pause();
            assert!(
                p >= Backoff::MIN && p <= ceilings.last().copied().unwrap(),
                "{p:?}"
            );
            pauses.push(p);
        }
        assert_eq!(
            &ceilings[..5],
            &[10, 20, 40, 80, 80].map(Duration::from_millis),
            "doubling up to the cap"
        );
        // Full jitter: pauses at the cap spread over most of [0, cap], not one value.
        let capped = &pauses[10..];
        let lo = capped.iter().min().unwrap();
        let hi = capped.iter().max().unwrap();
        assert!(
            *lo < Duration::from_millis(20) && *hi > Duration::from_millis(60),
            "{lo:?}..{hi:?}"
        );
        // Two waiters do not pause alike.
        let mut other = Backoff::new(first, max);
        let theirs: Vec<_> = (0..200).map(|_| other.next_pause()).collect();
        assert_ne!(pauses, theirs);
    }

    #[test]
    fn validity_leaves_room_for_clock_drift() {
        assert_eq!(
            validity(Duration::from_secs(30)),
            Duration::from_millis(29_699)
        );
        assert_eq!(
            validity(Duration::from_millis(600)),
            Duration::from_millis(593)
        );
        assert!(validity(Duration::from_millis(30)) < Duration::from_millis(30));
    }
}
