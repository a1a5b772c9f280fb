//! No secret reaches the logs: whole calls at `TRACE` against the k8s test cluster, with the
//! marker secret as the Kubernetes API's bearer token (in the kubeconfig kube reads) and in
//! the options' environment (core's `testkit::logs` check). The capture takes kube's,
//! hyper's and tonic's records too. A binary of its own: the capture is the process's global
//! subscriber.

mod common;

use std::sync::Arc;

use k8s_testcluster::TestClusterOptions;
use sandbox_core::testkit::logs::{SECRET, secrets_stay_out_of_logs};
use sandbox_k8s::K8sClient;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[cfg_attr(
    not(docker_tests),
    ignore = "needs Docker and the k8s pod image; run by cargo xtask test"
)]
async fn secrets_stay_out_of_logs_k8s() {
    let c = common::cluster_with(TestClusterOptions {
        warm_pool_replicas: 1,
        token: Some(SECRET.to_owned()),
        ..TestClusterOptions::default()
    })
    .await;
    let o = c.options(&common::prefix()).env("OPTIONS_TOKEN", SECRET);
    let client = Arc::new(K8sClient::new(o).expect("client"));
    let logs = secrets_stay_out_of_logs(client, Some("OPTIONS_TOKEN")).await;
    assert!(
        logs.contains("claim created"),
        "the backend's records are captured"
    );
    assert!(logs.contains("claim bound"), "{logs}");
}
