//! `RedisGuard` against a real server: the shared guard suite, fencing tokens, lost leases,
//! compare-and-delete, bounded waits and a server that dies or hangs. Each test has a key
//! prefix of its own and deletes its keys.
//!
//! Tests that need a server run when `SANDBOX_TEST_REDIS_URL` is set (`cargo xtask test`);
//! those that need none (a closed port) always run.

mod common;

use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use common::{OwnServer, Prefix, free_port, options, raw, url};
use guard_redis::{RedisGuard, RedisGuardOptions};
use sandbox_core::testkit::guards;
use sandbox_core::{Error, ErrorKind, Reach, SandboxExecutionGuard};

fn now_micros() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_micros() as u64
}

fn get(key: &str) -> Option<String> {
    redis::cmd("GET").arg(key).query(&mut raw()).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[cfg_attr(not(redis_tests), ignore = "needs Redis; run by cargo xtask test")]
async fn redis_guard_passes_the_guard_suite() {
    let prefix = Prefix::new();
    let (url, o) = (url(), options(&prefix));
    // Each instance stands for another replica: a guard on a connection of its own.
    guards::suite(&move || {
        Arc::new(RedisGuard::open(&url, o.clone()).expect("open")) as Arc<dyn SandboxExecutionGuard>
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[cfg_attr(not(redis_tests), ignore = "needs Redis; run by cargo xtask test")]
async fn tokens_increase_across_instances_and_restarts() {
    let prefix = Prefix::new();
    let key = guards::key("tokens");
    let before = now_micros();
    let mut last = 0;
    for _ in 0..3 {
        // A guard made anew each time, as a replica restarted: the counter lives in Redis.
        let g = RedisGuard::connect(&url(), options(&prefix)).await.unwrap();
        assert_eq!(g.reach(), Reach::Cluster);
        let lease = g.enter(&key).await.unwrap();
        let token = lease.token().expect("a token");
        assert!(token > last, "token {token} after {last}");
        assert_eq!(
            get(&g.fence_key(&key)),
            Some(token.to_string()),
            "the counter in Redis is the token"
        );
        last = token;
        lease.release().await.unwrap();
    }
    let g = RedisGuard::connect(&url(), options(&prefix)).await.unwrap();
    let fence = g.fence_key(&key);
    assert!(
        last > before,
        "tokens start at the clock (µs): {last} vs {before}"
    );

    // A counter ahead of the clock is followed, one by one.
    let ahead = now_micros() + 1_000_000_000_000;
    redis::cmd("SET")
        .arg(&fence)
        .arg(ahead)
        .exec(&mut raw())
        .unwrap();
    let lease = g.enter(&key).await.unwrap();
    assert_eq!(lease.token(), Some(ahead + 1));
    lease.release().await.unwrap();

    // A counter that is gone (a failover lost it) starts again from the clock, never at 1.
    let before = now_micros();
    redis::cmd("DEL").arg(&fence).exec(&mut raw()).unwrap();
    let lease = g.enter(&key).await.unwrap();
    assert!(lease.token().unwrap() >= before);
    lease.release().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[cfg_attr(not(redis_tests), ignore = "needs Redis; run by cargo xtask test")]
async fn a_paused_holder_loses_its_lease_to_a_higher_token() {
    let prefix = Prefix::new();
    let key = guards::key("paused");
    let (o, k) = (options(&prefix), key.clone());
    // Holder A runs on its own runtime, which is then blocked: its renewal cannot run, as if
    // its process were stopped.
    let (token_tx, token_rx) = std::sync::mpsc::channel();
    let (resume_tx, resume_rx) = std::sync::mpsc::channel::<()>();
    let a = std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(async {
            let guard = RedisGuard::connect(&url(), o).await.unwrap();
            let lease = guard.enter(&k).await.unwrap();
            token_tx.send(lease.token().unwrap()).unwrap();
            resume_rx.recv().unwrap(); // blocks the runtime: no renewal
            // Resumed: the renewal task finds its deadline passed and fires the signal.
            let signal = lease.lost_signal();
            let signalled = tokio::time::timeout(Duration::from_secs(2), signal.cancelled())
                .await
                .is_ok();
            let lost = lease.is_lost();
            // A stale holder's release must leave the new holder's lease alone.
            let released = lease.release().await;
            (signalled, lost, released.map_err(|e| e.to_string()))
        })
    });
    let a_token = token_rx.recv().unwrap();
    let b_guard = RedisGuard::connect(&url(), options(&prefix)).await.unwrap();
    let started = Instant::now();
    let b = tokio::time::timeout(Duration::from_secs(5), b_guard.enter(&key))
        .await
        .expect("B takes the key once A's lease expired")
        .unwrap();
    assert!(
        started.elapsed() >= Duration::from_millis(400),
        "B waited for A's TTL: {:?}",
        started.elapsed()
    );
    assert!(b.token().unwrap() > a_token);
    let b_owner = get(&b_guard.lease_key(&key)).expect("B's lease is in Redis");

    resume_tx.send(()).unwrap();
    let (signalled, lost, released) = a.join().unwrap();
    assert!(signalled, "A's lost signal fires when it resumes");
    assert!(lost, "A knows it lost its lease");
    released.expect("a stale release is not an error");
    assert_eq!(
        get(&b_guard.lease_key(&key)),
        Some(b_owner),
        "A's release left B's lease alone"
    );
    let c = RedisGuard::connect(&url(), options(&prefix)).await.unwrap();
    assert!(c.try_enter(&key).await.unwrap().is_none(), "B still holds");
    assert!(!b.is_lost());
    b.release().await.unwrap();
    c.try_enter(&key)
        .await
        .unwrap()
        .expect("free after B's release");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[cfg_attr(not(redis_tests), ignore = "needs Redis; run by cargo xtask test")]
async fn a_lease_taken_over_is_refused_at_renewal_and_its_release_spares_the_successor() {
    let prefix = Prefix::new();
    let key = guards::key("takeover");
    // A TTL long enough that "at the first renewal" (1 s) and "at the deadline" (3 s) stay
    // apart on a loaded machine.
    let o = options(&prefix).lease_ttl(Duration::from_secs(3));
    let a_guard = RedisGuard::connect(&url(), o.clone()).await.unwrap();
    let b_guard = RedisGuard::connect(&url(), o).await.unwrap();
    let granted = Instant::now();
    let a = a_guard.enter(&key).await.unwrap();
    // Redis loses A's lease early (as after a failover), and B takes the key.
    redis::cmd("PEXPIRE")
        .arg(a_guard.lease_key(&key))
        .arg(1)
        .exec(&mut raw())
        .unwrap();
    tokio::time::sleep(Duration::from_millis(20)).await;
    let b = b_guard.try_enter(&key).await.unwrap().expect("B takes it");
    assert!(b.token().unwrap() > a.token().unwrap());
    // A's next renewal (a third of the TTL in) is refused: lost well before its deadline.
    let signal = a.lost_signal();
    tokio::time::timeout(Duration::from_secs(5), signal.cancelled())
        .await
        .expect("A's lost signal fires");
    assert!(
        granted.elapsed() < Duration::from_millis(2500),
        "refused at renewal, not at the deadline: {:?}",
        granted.elapsed()
    );
    assert!(a.is_lost());
    a.release().await.expect("stale release");
    assert!(
        a_guard.try_enter(&key).await.unwrap().is_none(),
        "B's lease survived A's release"
    );
    // And a lease dropped by a stale holder (background release) spares it too.
    let stale = {
        let lease = a_guard.enter(&guards::key("other")).await.unwrap();
        redis::cmd("SET")
            .arg(a_guard.lease_key(lease.key()))
            .arg("someone-else")
            .exec(&mut raw())
            .unwrap();
        a_guard.lease_key(lease.key())
    };
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert_eq!(get(&stale).as_deref(), Some("someone-else"));
    assert!(!b.is_lost());
    b.release().await.unwrap();
    a_guard
        .try_enter(&key)
        .await
        .unwrap()
        .expect("free after B's release");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[cfg_attr(not(redis_tests), ignore = "needs Redis; run by cargo xtask test")]
async fn a_bounded_wait_times_out_with_a_typed_error() {
    let prefix = Prefix::new();
    let key = guards::key("bounded");
    let holder = RedisGuard::connect(&url(), options(&prefix)).await.unwrap();
    let held = holder.enter(&key).await.unwrap();
    let waiter = RedisGuard::connect(
        &url(),
        options(&prefix).max_wait(Duration::from_millis(300)),
    )
    .await
    .unwrap();
    let started = Instant::now();
    let err = waiter.enter(&key).await.unwrap_err();
    let waited = started.elapsed();
    assert!(matches!(err, Error::Timeout { .. }), "{err}");
    assert!(err.is_retryable());
    assert!(
        waited >= Duration::from_millis(300) && waited < Duration::from_secs(2),
        "{waited:?}"
    );
    held.release().await.unwrap();
    waiter.enter(&key).await.unwrap().release().await.unwrap();
}

#[tokio::test]
async fn a_closed_port_is_unavailable_at_once() {
    let port = free_port();
    let url = format!("redis://127.0.0.1:{port}");
    let o = RedisGuardOptions::new().key_prefix("test:closed:");
    let guard = RedisGuard::open(&url, o.clone()).unwrap();
    let key = guards::key("closed");
    for attempt in 0..2 {
        let started = Instant::now();
        let err = guard.enter(&key).await.unwrap_err();
        assert_eq!(err.kind(), ErrorKind::Unavailable, "{err}");
        assert!(err.is_retryable());
        assert!(
            err.to_string()
                .contains(&format!("redis at 127.0.0.1:{port}")),
            "{err}"
        );
        assert!(
            started.elapsed() < Duration::from_secs(5),
            "attempt {attempt}: {:?}",
            started.elapsed()
        );
    }
    let err = guard.try_enter(&key).await.unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Unavailable, "{err}");
    let err = RedisGuard::connect(&url, o).await.unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Unavailable, "{err}");
}

#[tokio::test]
async fn bad_urls_and_prefixes_are_refused() {
    let o = RedisGuardOptions::new();
    let err = RedisGuard::open("http://example.invalid", o.clone()).unwrap_err();
    assert_eq!(err.kind(), ErrorKind::InvalidInput, "{err}");
    let err = RedisGuard::open("redis://127.0.0.1:1", o.key_prefix("app:{x}:")).unwrap_err();
    assert_eq!(err.kind(), ErrorKind::InvalidInput, "{err}");
}

#[test]
fn opening_outside_a_runtime_is_an_error_not_a_panic() {
    let err = RedisGuard::open("redis://127.0.0.1:1", RedisGuardOptions::new()).unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Backend, "{err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[cfg_attr(not(redis_tests), ignore = "needs Redis; run by cargo xtask test")]
async fn a_server_that_dies_mid_hold() {
    let mut server = OwnServer::start(&[]);
    let prefix = Prefix::new();
    let o = options(&prefix).command_timeout(Duration::from_millis(300));
    let guard = RedisGuard::connect(&server.url(None), o).await.unwrap();
    let key = guards::key("dies");
    let granted = Instant::now();
    let lease = guard.enter(&key).await.unwrap();
    server.stop();

    // Renewals fail from the first one on, and are retried; the lease is lost at its deadline.
    let signal = lease.lost_signal();
    tokio::time::timeout(Duration::from_secs(3), signal.cancelled())
        .await
        .expect("the lease is lost");
    let at = granted.elapsed();
    assert!(
        at >= Duration::from_millis(550) && at < Duration::from_secs(2),
        "lost at its deadline: {at:?}"
    );
    assert!(lease.is_lost());

    // Entering now fails at once with a retryable error; releasing fails without a panic.
    let started = Instant::now();
    let err = guard.enter(&guards::key("dies-2")).await.unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Unavailable, "{err}");
    assert!(err.is_retryable());
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "{:?}",
        started.elapsed()
    );
    let err = lease.release().await.unwrap_err();
    assert!(err.is_retryable(), "{err}");

    // The server is back (empty): the same guard reconnects by itself.
    server.restart();
    let lease = guard.enter(&key).await.expect("enter after the restart");
    assert!(!lease.is_lost());
    lease.release().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[cfg_attr(not(redis_tests), ignore = "needs Redis; run by cargo xtask test")]
async fn a_hung_server_times_out() {
    let mut server = OwnServer::start(&[]);
    let prefix = Prefix::new();
    let o = options(&prefix).command_timeout(Duration::from_millis(200));
    let guard = RedisGuard::connect(&server.url(None), o).await.unwrap();
    let key = guards::key("hung");
    let granted = Instant::now();
    let lease = guard.enter(&key).await.unwrap();
    server.pause();

    // Renewals get no reply: the lease is lost at its deadline.
    let signal = lease.lost_signal();
    tokio::time::timeout(Duration::from_secs(3), signal.cancelled())
        .await
        .expect("the lease is lost");
    let at = granted.elapsed();
    assert!(
        at >= Duration::from_millis(550) && at < Duration::from_secs(2),
        "lost at its deadline: {at:?}"
    );

    // Entering times out after the command timeout, with a typed retryable error.
    let started = Instant::now();
    let err = guard.enter(&key).await.unwrap_err();
    assert!(matches!(err, Error::Timeout { .. }), "{err}");
    assert!(err.is_retryable());
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "{:?}",
        started.elapsed()
    );
    drop(lease);

    // Resumed, the server has expired the lease by its own clock: the key is free.
    server.resume();
    let lease = tokio::time::timeout(Duration::from_secs(5), guard.enter(&key))
        .await
        .expect("the key is free again")
        .unwrap();
    lease.release().await.unwrap();
}
