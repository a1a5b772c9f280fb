//! No secret reaches the logs: whole calls at `TRACE` against the Daytona test server, with
//! the marker secret as the API key and in the options' environment (core's `testkit::logs`
//! check). A binary of its own: the capture is the process's global subscriber.

mod common;

use std::sync::Arc;

use daytona_testserver::{DaytonaTestServer, TestServerOptions};
use sandbox_core::testkit::logs::{
    LogCapture, SECRET, assert_secret_hidden, secret_urls, secrets_stay_out_of_logs,
};
use sandbox_daytona::{DaytonaClient, DaytonaOptions, Secret};

/// The tests of this binary share the process's log capture: one at a time.
static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[cfg_attr(
    not(docker_tests),
    ignore = "needs Docker and the pod image; run by cargo xtask test"
)]
async fn secrets_stay_out_of_logs_daytona() {
    let _serial = SERIAL.lock().await;
    LogCapture::global();
    let server = DaytonaTestServer::start(TestServerOptions {
        api_key: Some(SECRET.to_owned()),
        ..TestServerOptions::default()
    })
    .await
    .expect("server");
    let o = common::options(&server, &common::prefix()).env("OPTIONS_TOKEN", SECRET);
    let client = Arc::new(DaytonaClient::new(o).expect("client"));
    let logs = secrets_stay_out_of_logs(client, Some("OPTIONS_TOKEN")).await;
    assert!(
        logs.contains("sandbox created"),
        "the backend's records are captured"
    );
    assert!(logs.contains("sandbox started"), "{logs}");
}

/// User info in the API URL (the marker with raw `/`, `#`, `?`, `@` and percent-encoding,
/// [`secret_urls`]) shows in no `Debug`, no error and no log line: such a URL is refused
/// (Daytona authenticates with the API key only), with the URL redacted. Needs no service.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn url_credentials_stay_out_of_debug_errors_and_logs() {
    let _serial = SERIAL.lock().await;
    let capture = LogCapture::global();
    capture.take();
    let mut shown = Vec::new();
    for url in secret_urls("https", "daytona.example:443/api") {
        let o = DaytonaOptions::new(url.clone(), Secret::new("key"));
        shown.push(format!("{o:?}"));
        let err = DaytonaClient::new(o).expect_err("user info is refused");
        assert_eq!(err.kind(), sandbox_core::ErrorKind::InvalidInput, "{err}");
        assert!(err.to_string().contains("***@daytona.example"), "{err}");
        shown.push(format!("{err} {err:?}"));
    }
    assert_secret_hidden(&shown, &capture.take());
}
