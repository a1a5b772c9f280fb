//! Shared test support: a fixture over the Daytona test server (real Docker containers
//! running sandboxd from the pod image built by `cargo xtask images`).
#![allow(dead_code)]

use std::sync::Arc;
use std::time::Duration;

use daytona_testserver::{DaytonaTestServer, TestServerOptions};
use sandbox_core::testkit::Fixture;
use sandbox_core::{Persistence, SandboxClient, SandboxState, async_trait};
use sandbox_daytona::{DaytonaClient, DaytonaOptions, DaytonaState, HttpOptions, Secret};

/// The workspace root in the pod image (the user is root there).
pub const ROOT: &str = "/workspace";

/// A unique deployment prefix per test.
pub fn prefix() -> String {
    format!("t{}", &uuid::Uuid::new_v4().simple().to_string()[..10])
}

pub async fn server() -> DaytonaTestServer {
    init_tracing();
    DaytonaTestServer::start(TestServerOptions::default())
        .await
        .expect("daytona test server")
}

/// Options for `server` under `prefix`: quick retries, the pod image's root.
pub fn options(server: &DaytonaTestServer, prefix: &str) -> DaytonaOptions {
    DaytonaOptions::new(server.api_url(), Secret::new(server.api_key()))
        .name_prefix(prefix)
        .workspace_root(ROOT)
        .auto_stop_minutes(0)
        .start_timeout(Duration::from_secs(120))
        .http(HttpOptions::default().backoff(Duration::from_millis(50), Duration::from_millis(500)))
}

/// The conformance fixture: one server and one deployment prefix per scenario.
pub struct DaytonaFixture {
    pub server: DaytonaTestServer,
    pub prefix: String,
}

pub async fn fixture() -> DaytonaFixture {
    DaytonaFixture {
        server: server().await,
        prefix: prefix(),
    }
}

#[async_trait]
impl Fixture for DaytonaFixture {
    async fn client(&self, persistence: Persistence) -> Arc<dyn SandboxClient> {
        Arc::new(
            DaytonaClient::new(options(&self.server, &self.prefix).persistence(persistence))
                .expect("client"),
        )
    }

    async fn lose_box(&self, state: &dyn SandboxState) {
        // The sandbox disappears behind the library's back (its container removed).
        let state = state
            .downcast::<DaytonaState>(sandbox_daytona::BACKEND)
            .expect("daytona state");
        let id = state
            .sandbox_id
            .clone()
            .unwrap_or_else(|| state.name.clone());
        // Already gone (an ephemeral box deleted at release) is lost enough.
        match self.server.faults().vanish(&id).await {
            Ok(()) | Err(daytona_testserver::Error::Api(_)) => {}
            Err(e) => panic!("vanish {id}: {e}"),
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
