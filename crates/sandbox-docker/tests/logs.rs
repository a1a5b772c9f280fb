//! No secret reaches the logs: whole calls at `TRACE` on the real engine
//! (`SANDBOX_TEST_DOCKER=1`), with the marker secret in the options' environment (core's
//! `testkit::logs` check), through the exec agent and through engine execs. The capture takes
//! every `log` record too, so bollard's request and response bodies are checked as well. A
//! binary of its own, because the capture is the process's global subscriber.

mod common;

use std::sync::Arc;

use common::{BUSYBOX, DEBIAN, Sweep, options};
use sandbox_core::testkit::logs::{SECRET, secrets_stay_out_of_logs};
use sandbox_docker::DockerClient;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[cfg_attr(not(docker_tests), ignore = "needs Docker; run by cargo xtask test")]
async fn secrets_stay_out_of_logs_docker() {
    for (image, agent) in [(BUSYBOX, true), (DEBIAN, false)] {
        let o = options(image)
            .exec_agent(agent)
            .env("OPTIONS_TOKEN", SECRET);
        let _sweep = Sweep(o.name_prefix.clone());
        let client = Arc::new(DockerClient::new(o).expect("client"));
        let logs = secrets_stay_out_of_logs(client, Some("OPTIONS_TOKEN")).await;
        // The engine's own traffic was captured (bollard logs through `log`).
        assert!(logs.contains("bollard"), "bollard's records are captured");
        assert!(logs.contains("container created"), "{image}");
    }
}
