//! The password of a Redis URL shows nowhere: not in what is logged (a global `TRACE`
//! capture, core's `testkit::logs`), not in `Debug` of options, guards and leases, not in
//! errors — through a grant, renewals, a server that dies mid-hold, refused credentials and
//! malformed URLs. A binary of its own, because the capture is the process's global
//! subscriber.

mod common;

use std::time::Duration;

use common::{OwnServer, Prefix, free_port, options};
use guard_redis::{RedisGuard, RedisGuardOptions};
use sandbox_core::testkit::guards;
use sandbox_core::testkit::logs::{LogCapture, SECRET};
use sandbox_core::{ErrorKind, SandboxExecutionGuard};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[cfg_attr(not(redis_tests), ignore = "needs Redis; run by cargo xtask test")]
async fn the_password_stays_out_of_logs_debug_and_errors() {
    let capture = LogCapture::global();
    capture.take();
    let mut shown = Vec::new();
    let mut server = OwnServer::start(&["--requirepass", SECRET]);
    let prefix = Prefix::new();
    let o = options(&prefix).command_timeout(Duration::from_millis(300));
    shown.push(format!("{o:?}"));

    // The right password: the guard works (so the password did reach the server).
    let guard = RedisGuard::connect(&server.url(Some(SECRET)), o.clone())
        .await
        .expect("connect with the password");
    shown.push(format!("{guard:?}"));
    let key = guards::key("secrets");
    let lease = guard.enter(&key).await.unwrap();
    shown.push(format!("{lease:?}"));
    tokio::time::sleep(Duration::from_millis(450)).await; // renewed at least once
    assert!(!lease.is_lost());

    // Without it, the server refuses.
    let err = RedisGuard::connect(&server.url(None), o.clone())
        .await
        .expect_err("no password");
    shown.push(format!("{err}"));
    shown.push(format!("{err:?}"));

    // A wrong password that is the marker, against a server whose password is another one.
    let mut other = OwnServer::start(&["--requirepass", "another-password"]);
    let err = RedisGuard::connect(&other.url(Some(SECRET)), o.clone())
        .await
        .expect_err("wrong password");
    assert_eq!(err.kind(), ErrorKind::Backend, "{err}");
    shown.push(format!("{err}"));
    shown.push(format!("{err:?}"));
    other.stop();

    // The server dies mid-hold: failed renewals are logged, the lease is lost, enter fails.
    server.stop();
    let signal = lease.lost_signal();
    tokio::time::timeout(Duration::from_secs(3), signal.cancelled())
        .await
        .expect("lost");
    let err = guard.enter(&key).await.unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Unavailable, "{err}");
    shown.push(format!("{err}"));
    shown.push(format!("{err:?}"));
    let err = lease.release().await.unwrap_err();
    shown.push(format!("{err}"));
    shown.push(format!("{err:?}"));

    // Malformed URLs holding the marker, and a closed port.
    for url in [
        format!("redis://:{SECRET}@127.0.0.1:notaport"),
        format!("rediss://:{SECRET}@127.0.0.1:1/0"),
        format!("http://:{SECRET}@127.0.0.1:1"),
    ] {
        let err = RedisGuard::open(&url, RedisGuardOptions::new()).unwrap_err();
        assert_eq!(err.kind(), ErrorKind::InvalidInput, "{err}");
        shown.push(format!("{err}"));
        shown.push(format!("{err:?}"));
    }
    let closed = RedisGuard::open(
        &format!("redis://:{SECRET}@127.0.0.1:{}", free_port()),
        o.clone(),
    )
    .unwrap();
    shown.push(format!("{closed:?}"));
    let err = closed.enter(&key).await.unwrap_err();
    shown.push(format!("{err}"));
    shown.push(format!("{err:?}"));
    tokio::time::sleep(Duration::from_millis(100)).await; // background releases log too

    let logs = capture.take();
    let leaks: Vec<&str> = logs.lines().filter(|l| l.contains(SECRET)).collect();
    assert!(
        leaks.is_empty(),
        "the password was logged:\n{}",
        leaks.join("\n")
    );
    for s in &shown {
        assert!(!s.contains(SECRET), "shows the password: {s}");
    }
    // Not vacuous: the grant, the failed renewals and the loss were logged, naming the key.
    for expected in [
        "lease granted",
        "lease renewal failed",
        "lease expired before it could be renewed",
        "redis at 127.0.0.1:",
    ] {
        assert!(
            logs.contains(expected) || shown.iter().any(|s| s.contains(expected)),
            "no `{expected}` in:\n{logs}"
        );
    }
    assert!(logs.contains("lease renewal failed"), "{logs}");
}
