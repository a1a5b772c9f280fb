//! No secret reaches the logs: whole calls at `TRACE` against the E2B test server, with the
//! marker secret as the E2B API key (sent in `X-API-Key` on every API call) and in the
//! options' environment (core's `testkit::logs` check). The capture takes reqwest's and
//! hyper's records too. A binary of its own: the capture is the process's global subscriber.

mod common;

use std::sync::Arc;

use e2b_testserver::E2bTestServerOptions;
use sandbox_core::testkit::logs::{SECRET, secrets_stay_out_of_logs};
use sandbox_e2b::E2bClient;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[cfg_attr(
    not(docker_tests),
    ignore = "needs Docker and the k8s pod image; run by cargo xtask test"
)]
async fn secrets_stay_out_of_logs_e2b() {
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
