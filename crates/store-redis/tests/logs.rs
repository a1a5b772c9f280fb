//! No password reaches the logs, errors or `Debug` output: both stores against a server of
//! the test's own that requires the marker secret as its password, through successes,
//! refusals, a wrong password and a closed port, with every span and event captured at
//! `TRACE` (core's `testkit::logs` capture, `log` records included). A binary of its own,
//! because the capture is the process's global subscriber.

mod common;

use std::time::Duration;

use common::{Server, free_port};
use sandbox_core::testkit::logs::{LogCapture, SECRET};
use sandbox_core::testkit::states::key;
use sandbox_core::{Error, StateStore};
use sandbox_fs::{KvStore, Precondition};
use store_redis::{RedisKvStore, RedisOptions, RedisStateStore};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[cfg_attr(not(redis_tests), ignore = "needs Redis; run by cargo xtask test")]
async fn passwords_stay_out_of_logs_errors_and_debug() {
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
