//! No password reaches the logs, errors or `Debug` output, and no blob content reaches the
//! logs: the store against a server of the test's own that requires the marker secret as its
//! password, through puts, reads, listings, a wrong password and a closed port, with every span
//! and event captured at `TRACE` (core's `testkit::logs`). A binary of its own, because the
//! capture is the process's global subscriber.

use std::time::Duration;

use bytes::Bytes;
use sandbox_core::snapshot::{BlobKey, SnapshotStore as _, SnapshotStoreExt as _};
use sandbox_core::stream;
use sandbox_core::testkit::logs::{LogCapture, SECRET, assert_secret_hidden, secret_urls};
use snapshot_redis::{RedisSnapshotOptions, RedisSnapshotStore};
use store_redis::testkit::{Server, free_port};

/// The tests of this binary share the process's log capture: one at a time.
static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// Passwords with raw `/`, `#`, `?`, `@` and percent-encoding ([`secret_urls`]) show in no
/// `Debug` of [`RedisSnapshotOptions`] or the store, no error and no log line at `TRACE`,
/// whether the URL is refused or the server (a closed port here) is not there. No server.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hard_passwords_stay_out_of_logs_errors_and_debug() {
    let _serial = SERIAL.lock().await;
    let capture = LogCapture::global();
    capture.take();
    let mut shown = Vec::new();
    let mut reached = 0;
    let k = BlobKey::new("snapshots/ns/a.tar").unwrap();
    for url in secret_urls("redis", &format!("127.0.0.1:{}/0", free_port())) {
        let options = RedisSnapshotOptions::new(url).connect_timeout(Duration::from_millis(300));
        shown.push(format!("{options:?}"));
        match RedisSnapshotStore::new(options) {
            Err(e) => shown.push(format!("{e} {e:?}")),
            Ok(store) => {
                let e = store.exists(&k).await.unwrap_err();
                shown.push(format!("{e} {e:?} {store:?}"));
                reached += 1;
            }
        }
    }
    assert!(reached > 0, "some URLs parse and are tried");
    assert_secret_hidden(&shown, &capture.take());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[cfg_attr(not(redis_tests), ignore = "needs Redis; run by cargo xtask test")]
async fn passwords_and_contents_stay_out_of_logs() {
    let _serial = SERIAL.lock().await;
    let capture = LogCapture::global();
    let server = Server::start(&["--save", "", "--appendonly", "no", "--requirepass", SECRET]);
    let options = RedisSnapshotOptions::new(server.url(Some(SECRET)))
        .key_prefix("logs:")
        .part_size(1024)
        .connect_timeout(Duration::from_millis(500));
    let mut shown = Vec::new();

    let store = RedisSnapshotStore::new(options.clone()).unwrap();
    let k = BlobKey::new("snapshots/ns/a.tar").unwrap();
    let content = "CONTENT-MARKER-".repeat(200);
    store
        .put_bytes(&k, Bytes::from(content.clone()))
        .await
        .unwrap();
    let got = stream::collect(store.get(&k).await.unwrap(), 1 << 20)
        .await
        .unwrap();
    assert_eq!(got, content.as_bytes());
    stream::collect(store.get_range(&k, 10, 2000).await.unwrap(), 1 << 20)
        .await
        .unwrap();
    assert_eq!(store.list_all("snapshots/").await.unwrap().len(), 1);
    store.delete(&k).await.unwrap();
    shown.push(format!("{options:?} {store:?}"));

    // A wrong password, and a server that is not there: the errors name the service only.
    let wrong = RedisSnapshotStore::new(RedisSnapshotOptions::new(format!(
        "redis://default:{SECRET}-not@127.0.0.1:{}",
        server.port
    )))
    .unwrap();
    let refused = wrong.exists(&k).await.unwrap_err();
    assert!(!refused.is_retryable(), "{refused}");
    shown.push(format!("{refused} {refused:?} {wrong:?}"));
    let gone = RedisSnapshotStore::new(
        RedisSnapshotOptions::new(format!("redis://:{SECRET}@127.0.0.1:{}/1", free_port()))
            .connect_timeout(Duration::from_millis(500)),
    )
    .unwrap();
    let unavailable = gone
        .put_bytes(&k, Bytes::from_static(b"x"))
        .await
        .unwrap_err();
    assert!(unavailable.is_retryable(), "{unavailable}");
    assert!(
        unavailable.to_string().contains("redis at 127.0.0.1:"),
        "{unavailable}"
    );
    shown.push(format!("{unavailable} {unavailable:?} {gone:?}"));

    let logs = capture.take();
    for span in [
        "redis_blob_put",
        "redis_blob_get",
        "redis_blob_get_range",
        "redis_blob_delete",
        "redis call failed",
    ] {
        assert!(logs.contains(span), "{span} missing from the logs:\n{logs}");
    }
    assert!(!logs.contains(SECRET), "the password was logged:\n{logs}");
    assert!(
        !logs.contains("CONTENT-MARKER"),
        "blob contents were logged"
    );
    for text in shown {
        assert!(!text.contains(SECRET), "the password was shown: {text}");
    }
}
