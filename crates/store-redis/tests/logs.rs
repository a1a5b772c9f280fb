//! No password reaches the logs, errors or `Debug` output: both stores against a server of
//! the test's own that requires the marker secret as its password, through successes,
//! refusals, a wrong password and a closed port, with every span and event captured at
//! `TRACE` (core's `testkit::logs` capture, `log` records included). A binary of its own,
//! because the capture is the process's global subscriber.

mod common;

use std::time::Duration;

use common::{Server, free_port};
use sandbox_core::testkit::logs::{LogCapture, SECRET, assert_secret_hidden, secret_urls};
use sandbox_core::testkit::states::key;
use sandbox_core::{Error, StateStore};
use sandbox_fs::{KvStore, Precondition};
use store_redis::{RedisKvStore, RedisOptions, RedisStateStore};

/// The tests of this binary share the process's log capture: one at a time.
static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// Passwords with raw `/`, `#`, `?`, `@` and percent-encoding ([`secret_urls`]) show in no
/// `Debug`, no error and no log line at `TRACE`, whether the URL is refused or the server
/// (a closed port here) is not there. Needs no server.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hard_passwords_stay_out_of_logs_errors_and_debug() {
    let _serial = SERIAL.lock().await;
    let capture = LogCapture::global();
    capture.take();
    let mut shown = Vec::new();
    let mut reached = 0;
    for url in secret_urls("redis", &format!("127.0.0.1:{}/0", free_port())) {
        let options = RedisOptions::new(url).connect_timeout(Duration::from_millis(300));
        shown.push(format!("{options:?}"));
        match RedisStateStore::new(options.clone()) {
            Err(e) => shown.push(format!("{e} {e:?}")),
            Ok(states) => {
                shown.push(format!("{states:?}"));
                let e = states.load(&key("hard")).await.unwrap_err();
                shown.push(format!("{e} {e:?}"));
                reached += 1;
            }
        }
        match RedisKvStore::new(options) {
            Err(e) => shown.push(format!("{e} {e:?}")),
            Ok(kv) => {
                let e = kv.get("ns", "k").await.unwrap_err();
                shown.push(format!("{e} {e:?} {kv:?}"));
            }
        }
    }
    assert!(reached > 0, "some URLs parse and are tried");
    assert_secret_hidden(&shown, &capture.take());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[cfg_attr(not(redis_tests), ignore = "needs Redis; run by cargo xtask test")]
async fn passwords_stay_out_of_logs_errors_and_debug() {
    let _serial = SERIAL.lock().await;
    let capture = LogCapture::global();
    let server = Server::start(&["--save", "", "--appendonly", "no", "--requirepass", SECRET]);
    let options = RedisOptions::new(server.url(Some(SECRET)))
        .key_prefix("logs:")
        .connect_timeout(Duration::from_millis(500));
    let mut shown = Vec::new();
    let mut note = |what: String| shown.push(what);

    let states = RedisStateStore::new(options.clone()).unwrap();
    let k = key("quinn");
    states.fence(&k, Some(2)).await.unwrap();
    states.save(&k, "{\"v\":1}", Some(2)).await.unwrap();
    assert!(states.load(&k).await.unwrap().is_some());
    assert_eq!(states.list("").await.unwrap(), vec![k.clone()]);
    let stale = states.save(&k, "{}", Some(1)).await.unwrap_err();
    assert!(matches!(stale, Error::StaleLease { .. }));
    note(format!("{stale} {stale:?}"));
    states.delete(&k, Some(2)).await.unwrap();

    let kv = RedisKvStore::new(options.clone()).unwrap();
    let v = kv
        .put("ns", "k", "value".into(), Precondition::Absent)
        .await
        .unwrap();
    let conflict = kv
        .put("ns", "k", "x".into(), Precondition::Absent)
        .await
        .unwrap_err();
    note(format!("{conflict} {conflict:?}"));
    assert_eq!(kv.list("ns", "").await.unwrap().len(), 1);
    assert!(kv.get("ns", "k").await.unwrap().is_some());
    assert!(
        kv.delete("ns", "k", Precondition::Version(v))
            .await
            .unwrap()
    );
    note(format!("{options:?} {states:?} {kv:?}"));

    // A wrong password, and a server that is not there: the errors name the service only.
    let wrong = RedisStateStore::new(options.clone().url(format!(
        "redis://default:{SECRET}-not@127.0.0.1:{}",
        server.port
    )))
    .unwrap();
    let refused = wrong.load(&k).await.unwrap_err();
    assert!(!refused.is_retryable(), "{refused}");
    note(format!("{refused} {refused:?} {wrong:?}"));
    let gone = RedisKvStore::new(
        options
            .clone()
            .url(format!("redis://:{SECRET}@127.0.0.1:{}/1", free_port())),
    )
    .unwrap();
    let unavailable = gone.get("ns", "k").await.unwrap_err();
    assert!(unavailable.is_retryable(), "{unavailable}");
    assert!(
        unavailable.to_string().contains("redis at 127.0.0.1:"),
        "{unavailable}"
    );
    note(format!("{unavailable} {unavailable:?} {gone:?}"));

    let logs = capture.take();
    // The capture saw the stores' spans and the failures' events.
    for span in [
        "redis_state_fence",
        "redis_state_save",
        "redis_state_list",
        "redis_kv_put",
        "redis_kv_list",
        "redis call failed",
    ] {
        assert!(logs.contains(span), "{span} missing from the logs:\n{logs}");
    }
    assert!(!logs.contains(SECRET), "the password was logged:\n{logs}");
    for text in shown {
        assert!(!text.contains(SECRET), "the password was shown: {text}");
    }
    assert!(!logs.contains("\"v\":1"), "state contents stay out of logs");
}
