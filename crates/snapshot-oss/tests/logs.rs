//! No secret key or session token reaches the logs, errors or `Debug` output: the store on a
//! server of the test's own whose secret key is the marker secret, through single and
//! multipart puts, an aborted upload, reads, listing, deletes, wrong credentials and a closed
//! port, with every span and event captured at `TRACE` (core's `testkit::logs` capture, `log`
//! records of the HTTP stack included). A binary of its own: the capture is the process's
//! global subscriber.

use std::time::Duration;

use futures::StreamExt as _;
use sandbox_core::Error;
use sandbox_core::snapshot::{BlobKey, SnapshotStore, SnapshotStoreExt as _};
use sandbox_core::testkit::blobs::{pattern, pieces};
use sandbox_core::testkit::logs::{LogCapture, SECRET, assert_secret_hidden, secret_urls};
use snapshot_oss::testkit::{ACCESS_KEY, S3fs, free_port, test_options};
use snapshot_oss::{MIB, S3Config};

/// The tests of this binary that capture logs share the process's capture: one at a time.
static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// User info in the endpoint (the marker with raw `/`, `#`, `?`, `@` and percent-encoding,
/// [`secret_urls`]) shows in no `Debug`, no error and no log line: such an endpoint is refused
/// (requests are signed with the access key), with the URL redacted. Needs no server.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn endpoint_credentials_stay_out_of_debug_errors_and_logs() {
    let _serial = SERIAL.lock().await;
    let capture = LogCapture::global();
    capture.take();
    let mut shown = Vec::new();
    for url in secret_urls("http", "127.0.0.1:1") {
        for virtual_hosted in [false, true] {
            let config = S3Config::new("b")
                .endpoint(url.clone())
                .region("us-east-1")
                .credentials("AKID", "key")
                .virtual_hosted_style(virtual_hosted)
                .allow_http(true);
            shown.push(format!("{config:?}"));
            let err = config.build().expect_err("user info is refused");
            assert_eq!(err.kind(), sandbox_core::ErrorKind::InvalidInput, "{err}");
            assert!(err.to_string().contains("***@"), "{err}");
            shown.push(format!("{err} {err:?}"));
        }
    }
    assert_secret_hidden(&shown, &capture.take());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn debug_output_hides_credentials() {
    // Needs no server: the configuration and the store as built.
    let config = S3Config::new("b")
        .endpoint("http://127.0.0.1:1")
        .credentials("AKIDVISIBLE", SECRET)
        .session_token(format!("token-{SECRET}"))
        .allow_http(true);
    let store = config.build().unwrap();
    for shown in [format!("{config:?}"), format!("{store:?}")] {
        assert!(!shown.contains(SECRET), "{shown}");
    }
    assert!(format!("{config:?}").contains("AKIDVISIBLE"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[cfg_attr(not(s3_tests), ignore = "needs s3s-fs; run by cargo xtask test")]
async fn secrets_stay_out_of_logs_errors_and_debug() {
    let _serial = SERIAL.lock().await;
    let capture = LogCapture::global();
    let server = S3fs::start_with_secret(SECRET);
    server.create_bucket("logs");
    let config = server.config("logs").prefix("p");
    let store = config.build().unwrap();
    let mut shown = vec![format!("{config:?}"), format!("{store:?}")];
    capture.take();

    let k = |s: &str| BlobKey::new(s).unwrap();
    store.put_bytes(&k("small"), "tiny".into()).await.unwrap();
    let big = pattern(1, 20 * MIB);
    store
        .put(&k("big"), pieces(&big, 256 * 1024), None)
        .await
        .unwrap();
    let failing = pieces(&big, 256 * 1024)
        .chain(futures::stream::iter([Err(Error::Timeout {
            operation: "export".into(),
            after: Duration::from_secs(1),
        })]))
        .boxed();
    let failed = store.put(&k("failed"), failing, None).await.unwrap_err();
    shown.push(format!("{failed} {failed:?}"));
    let got = sandbox_core::stream::collect(store.get_range(&k("big"), 7, 100).await.unwrap(), 200)
        .await
        .unwrap();
    assert_eq!(&got[..], &big[7..107]);
    assert_eq!(store.list_all("").await.unwrap().len(), 2);
    assert!(store.put_if_absent(&k("small"), "x".into()).await.is_ok());
    store.delete(&k("small")).await.unwrap();

    // Refused credentials, and a server that is not there: the errors name the service only.
    let wrong = S3Config::new("logs")
        .endpoint(server.endpoint())
        .region("us-east-1")
        .credentials(ACCESS_KEY, format!("{SECRET}-not"))
        .allow_http(true)
        .options(test_options())
        .build()
        .unwrap();
    let refused = wrong.get(&k("big")).await.err().unwrap();
    assert!(!refused.is_retryable(), "{refused}");
    shown.push(format!("{refused} {refused:?} {wrong:?}"));
    let gone = S3Config::new("logs")
        .endpoint(format!("http://127.0.0.1:{}", free_port()))
        .region("us-east-1")
        .credentials(ACCESS_KEY, SECRET)
        .session_token(SECRET)
        .allow_http(true)
        .options(test_options())
        .build()
        .unwrap();
    let unavailable = gone.exists(&k("big")).await.unwrap_err();
    assert!(unavailable.is_retryable(), "{unavailable}");
    shown.push(format!("{unavailable} {unavailable:?} {gone:?}"));

    let logs = capture.take();
    // Not vacuous: the store's spans and the failures were logged.
    for expected in [
        "oss_put",
        "single put",
        "multipart upload completed",
        "multipart upload aborted",
        "oss_get_range",
        "object store call failed",
    ] {
        assert!(
            logs.contains(expected),
            "`{expected}` missing from the logs:\n{logs}"
        );
    }
    let leaks: Vec<&str> = logs.lines().filter(|l| l.contains(SECRET)).collect();
    assert!(
        leaks.is_empty(),
        "the secret was logged:\n{}",
        leaks.join("\n")
    );
    for text in shown {
        assert!(!text.contains(SECRET), "the secret was shown: {text}");
    }
}
