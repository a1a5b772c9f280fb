//! No secret reaches the logs: whole calls at `TRACE` against the E2B test server, with the
//! marker secret as the E2B API key (sent in `X-API-Key` on every API call) and in the
//! options' environment (core's `testkit::logs` check). The capture takes reqwest's and
//! hyper's records too. A binary of its own: the capture is the process's global subscriber.

mod common;

use std::sync::Arc;

use e2b_testserver::E2bTestServerOptions;
use sandbox_core::SandboxClient as _;
use sandbox_core::testkit::logs::{
    LogCapture, RefusingServer, SECRET, assert_secret_hidden, secret_urls, secrets_stay_out_of_logs,
};
use sandbox_e2b::{E2bClient, E2bOptions, HttpOptions, Secret};

/// The tests of this binary share the process's log capture: one at a time.
static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[cfg_attr(
    not(docker_tests),
    ignore = "needs Docker and the k8s pod image; run by cargo xtask test"
)]
async fn secrets_stay_out_of_logs_e2b() {
    let _serial = SERIAL.lock().await;
    LogCapture::global();
    let server = common::server_with(E2bTestServerOptions::default().api_key(SECRET)).await;
    let o = common::options(&server, &common::owner()).env("OPTIONS_TOKEN", SECRET);
    let client = Arc::new(E2bClient::new(o).expect("client"));
    let logs = secrets_stay_out_of_logs(client, Some("OPTIONS_TOKEN")).await;
    assert!(
        logs.contains("sandbox created"),
        "the backend's records are captured"
    );
    assert!(logs.contains("sandbox ready"), "{logs}");
}

/// User info in the API and envd URLs (the marker with raw `/`, `#`, `?`, `@` and
/// percent-encoding, [`secret_urls`]) shows in no `Debug`, no error and no log line at `TRACE`
/// (reqwest's and hyper's records included), and still reaches the server, as basic auth.
/// Needs no service: a loopback server that refuses every request.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn url_credentials_stay_out_of_debug_errors_and_logs() {
    let _serial = SERIAL.lock().await;
    let capture = LogCapture::global();
    let server = RefusingServer::start();
    capture.take();
    let mut shown = Vec::new();
    let mut refused = 0;
    for url in secret_urls("http", &format!("127.0.0.1:{}", server.port)) {
        let o = E2bOptions::new(Secret::new("key"))
            .api_url(url.clone())
            .sandbox_url(Some(format!("{url}/envd")))
            .http(HttpOptions::default().max_attempts(2).backoff(
                std::time::Duration::from_millis(1),
                std::time::Duration::from_millis(2),
            ));
        shown.push(format!("{o:?}"));
        let client = match E2bClient::new(o) {
            Ok(c) => c,
            Err(e) => panic!("{url}: {}", e.to_string().replace(SECRET, "<SECRET>")),
        };
        shown.push(format!("{client:?}"));
        let err = client.list_owned().await.expect_err("the server refuses");
        shown.push(format!("{err} {err:?}"));
        refused += 1;
    }
    let logs = capture.take();
    assert_secret_hidden(&shown, &logs);
    assert!(refused > 0 && logs.contains("127.0.0.1"), "{logs}");
    // The credentials reached the server as basic auth, not in the request line.
    let heads = server.heads();
    assert!(heads.len() >= refused, "{heads:?}");
    for head in &heads {
        assert!(!head.contains(SECRET), "{head}");
        assert!(
            head.to_ascii_lowercase().contains("authorization: basic "),
            "{head}"
        );
    }
}
