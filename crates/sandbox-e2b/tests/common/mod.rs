//! Shared test support: a fixture over the E2B test server (the API and envd on loopback,
//! every sandbox a real Docker container running sandboxd from the pod image built by
//! `cargo xtask images`).
#![allow(dead_code)]

use std::sync::Arc;
use std::time::Duration;

use e2b_testserver::{E2bTestServer, E2bTestServerOptions};
use sandbox_core::testkit::Fixture;
use sandbox_core::{Persistence, SandboxClient, SandboxState, async_trait};
use sandbox_e2b::{E2bClient, E2bOptions, E2bState, HttpOptions, Secret};

/// The workspace root in the test image.
pub const ROOT: &str = "/workspace";

/// A unique owner per test.
pub fn owner() -> String {
    format!("t{}", &uuid::Uuid::new_v4().simple().to_string()[..10])
}

pub async fn server_with(opts: E2bTestServerOptions) -> E2bTestServer {
    init_tracing();
    E2bTestServer::start(opts).await.expect("e2b test server")
}

pub async fn server() -> E2bTestServer {
    server_with(E2bTestServerOptions::default()).await
}

/// Options for `server` under `owner`: envd through the one override URL (headers name the
/// sandbox), short backoffs.
pub fn options(server: &E2bTestServer, owner: &str) -> E2bOptions {
    E2bOptions::new(Secret::new(server.api_key()))
        .domain(server.domain())
        .api_url(server.api_url())
        .sandbox_url(Some(server.envd_url()))
        .owner(owner)
        .workspace_root(ROOT)
        .ready_timeout(Duration::from_secs(60))
        .http(HttpOptions::default().backoff(Duration::from_millis(50), Duration::from_millis(500)))
}

/// Kill a sandbox through the API, as an operator (or E2B's timeout) would.
pub async fn kill_sandbox(server: &E2bTestServer, id: &str) {
    let r = reqwest::Client::new()
        .delete(format!("{}/sandboxes/{id}", server.api_url()))
        .header("X-API-Key", server.api_key())
        .send()
        .await
        .expect("delete sandbox");
    assert!(
        r.status().is_success() || r.status() == 404,
        "delete: {}",
        r.status()
    );
}

/// Every sandbox the server knows, with its metadata.
pub async fn all_sandboxes(server: &E2bTestServer) -> Vec<serde_json::Value> {
    let r = reqwest::Client::new()
        .get(format!(
            "{}/v2/sandboxes?state=running,paused&limit=100",
            server.api_url()
        ))
        .header("X-API-Key", server.api_key())
        .send()
        .await
        .expect("list sandboxes");
    assert!(r.status().is_success(), "list: {}", r.status());
    r.json().await.expect("sandbox list")
}

/// The sandboxes carrying `owner`'s mark.
pub async fn owned_sandboxes(server: &E2bTestServer, owner: &str) -> Vec<serde_json::Value> {
    all_sandboxes(server)
        .await
        .into_iter()
        .filter(|s| s["metadata"]["io.sandbox-harness.owner"] == owner)
        .collect()
}

/// The conformance fixture: one test server and one owner per scenario.
pub struct E2bFixture {
    pub server: E2bTestServer,
    pub owner: String,
}

pub async fn fixture() -> E2bFixture {
    E2bFixture {
        server: server().await,
        owner: owner(),
    }
}

#[async_trait]
impl Fixture for E2bFixture {
    async fn client(&self, persistence: Persistence) -> Arc<dyn SandboxClient> {
        Arc::new(
            E2bClient::new(options(&self.server, &self.owner).persistence(persistence))
                .expect("client"),
        )
    }

    async fn lose_box(&self, state: &dyn SandboxState) {
        let state = state
            .downcast::<E2bState>(sandbox_e2b::BACKEND)
            .expect("e2b state");
        if let Some(id) = &state.sandbox_id {
            kill_sandbox(&self.server, id).await;
        }
    }
}

/// Log to the test output when `RUST_LOG` is set.
pub fn init_tracing() {
    if std::env::var_os("RUST_LOG").is_some() {
        let _ = tracing_subscriber::fmt()
            .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
            .with_test_writer()
            .try_init();
    }
}
