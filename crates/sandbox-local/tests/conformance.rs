//! The core conformance kit, run against the local backend.

use std::sync::Arc;

use sandbox_core::testkit::Fixture;
use sandbox_core::{Persistence, SandboxClient, SandboxState, async_trait};
use sandbox_local::{LocalClient, LocalOptions, LocalState};

/// Clients share one temporary base directory, as two replicas on one host would.
struct LocalFixture {
    base: tempfile::TempDir,
}

fn fixture() -> LocalFixture {
    LocalFixture {
        base: tempfile::tempdir().expect("tempdir"),
    }
}

#[async_trait]
impl Fixture for LocalFixture {
    async fn client(&self, persistence: Persistence) -> Arc<dyn SandboxClient> {
        Arc::new(LocalClient::new(
            LocalOptions::default()
                .base_dir(self.base.path())
                .persistence(persistence),
        ))
    }

    async fn client_at(
        &self,
        persistence: Persistence,
        shared: &std::path::Path,
    ) -> Arc<dyn SandboxClient> {
        Arc::new(LocalClient::new(
            LocalOptions::default()
                .base_dir(shared.join("boxes"))
                .persistence(persistence),
        ))
    }

    async fn lose_box(&self, state: &dyn SandboxState) {
        let state = state.downcast::<LocalState>("local").expect("local state");
        match std::fs::remove_dir_all(&state.box_dir) {
            Ok(()) => {}
            // An ephemeral box is already gone.
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => panic!("remove the box dir: {e}"),
        }
    }
}

sandbox_core::conformance_tests!(fixture());
