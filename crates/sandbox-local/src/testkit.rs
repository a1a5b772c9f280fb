//! This backend as a fixture of the conformance kit (`sandbox_core::testkit`), for this
//! crate's tests and for crates that run the kit's scenarios on it (the snapshot stores, with
//! `sandbox_core::testkit::OnStore`).

use std::path::Path;
use std::sync::Arc;

use sandbox_core::testkit::Fixture;
use sandbox_core::{Persistence, SandboxClient, SandboxState, async_trait};

use crate::{Isolation, LocalClient, LocalOptions, LocalState};

/// Clients share one temporary base directory, as two replicas on one host would.
pub struct LocalFixture {
    base: tempfile::TempDir,
    isolation: Isolation,
}

impl LocalFixture {
    /// A fixture over a new temporary base directory, with the default isolation.
    pub fn new() -> LocalFixture {
        LocalFixture::with_isolation(Isolation::default())
    }

    /// A fixture whose clients use `isolation`.
    pub fn with_isolation(isolation: Isolation) -> LocalFixture {
        LocalFixture {
            base: tempfile::tempdir().expect("tempdir"),
            isolation,
        }
    }

    fn options(&self) -> LocalOptions {
        LocalOptions::default().isolation(self.isolation.clone())
    }
}

impl Default for LocalFixture {
    fn default() -> Self {
        LocalFixture::new()
    }
}

#[async_trait]
impl Fixture for LocalFixture {
    async fn client(&self, persistence: Persistence) -> Arc<dyn SandboxClient> {
        Arc::new(LocalClient::new(
            self.options()
                .base_dir(self.base.path())
                .persistence(persistence),
        ))
    }

    async fn client_at(&self, persistence: Persistence, shared: &Path) -> Arc<dyn SandboxClient> {
        Arc::new(LocalClient::new(
            self.options()
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
