//! No secret reaches the logs: whole calls at `TRACE` through the local backend, with the
//! marker secret in its options' environment (core's `testkit::logs` check). A binary of its
//! own, because the capture is the process's global subscriber.

use std::sync::Arc;

use sandbox_core::testkit::logs::{SECRET, secrets_stay_out_of_logs};
use sandbox_local::{LocalClient, LocalOptions};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn secrets_stay_out_of_logs_local() {
    let dir = tempfile::tempdir().expect("tempdir");
    let client = LocalClient::new(
        LocalOptions::default()
            .base_dir(dir.path().join("boxes"))
            .extra_env("OPTIONS_TOKEN", SECRET),
    );
    let logs = secrets_stay_out_of_logs(Arc::new(client), Some("OPTIONS_TOKEN")).await;
    assert!(
        logs.contains("local_exec{"),
        "the backend's own spans are captured"
    );
}
