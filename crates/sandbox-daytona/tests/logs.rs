//! No secret reaches the logs: whole calls at `TRACE` against the Daytona test server, with
//! the marker secret as the API key and in the options' environment (core's `testkit::logs`
//! check). A binary of its own: the capture is the process's global subscriber.

mod common;

use std::sync::Arc;

use daytona_testserver::{DaytonaTestServer, TestServerOptions};
use sandbox_core::testkit::logs::{SECRET, secrets_stay_out_of_logs};
use sandbox_daytona::DaytonaClient;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[cfg_attr(
    not(docker_tests),
    ignore = "needs Docker and the pod image; run by cargo xtask test"
)]
async fn secrets_stay_out_of_logs_daytona() {
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
