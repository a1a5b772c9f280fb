//! Shared test support: the fixture over the real engine and helpers.
#![allow(dead_code)]

use std::sync::Arc;

use bollard::Docker;
use bollard::query_parameters::RemoveContainerOptionsBuilder;
use sandbox_core::testkit::Fixture;
use sandbox_core::{Persistence, SandboxClient, SandboxState, async_trait};
use sandbox_docker::{DockerClient, DockerOptions, DockerState, PullPolicy};

/// The image the kit runs on (built by `cargo xtask images`).
pub const BUSYBOX: &str = "sandbox-harness-test/busybox:latest";
/// The Debian test image (bash, coreutils, GNU find, tar, python3).
pub const DEBIAN: &str = "sandbox-harness-test/debian:latest";

/// Image of the kit run: `SANDBOX_DOCKER_TEST_IMAGE`, else the busybox image.
pub fn kit_image() -> String {
    std::env::var("SANDBOX_DOCKER_TEST_IMAGE").unwrap_or_else(|_| BUSYBOX.to_owned())
}

/// A unique deployment prefix per test, so tests never see each other's containers.
pub fn prefix() -> String {
    format!("sbxt{}", &uuid::Uuid::new_v4().simple().to_string()[..10])
}

/// Options for `image` under a fresh prefix, never pulling.
pub fn options(image: &str) -> DockerOptions {
    DockerOptions::new(image)
        .name_prefix(prefix())
        .pull_policy(PullPolicy::Never)
}

/// The raw engine, for doing things behind the library's back.
pub fn docker() -> Docker {
    Docker::connect_with_unix(
        sandbox_docker::DEFAULT_SOCKET,
        120,
        bollard::API_DEFAULT_VERSION,
    )
    .expect("docker socket")
}

/// Remove a container by name through the API (ignoring "not found").
pub async fn remove(docker: &Docker, name: &str) {
    let _ = docker
        .remove_container(
            name,
            Some(
                RemoveContainerOptionsBuilder::default()
                    .force(true)
                    .v(true)
                    .build(),
            ),
        )
        .await;
}

/// Removes every container of a prefix when dropped (tests clean up after themselves even
/// when they fail).
pub struct Sweep(pub String);

impl Drop for Sweep {
    fn drop(&mut self) {
        let prefix = self.0.clone();
        let _ = std::process::Command::new("sh")
            .arg("-c")
            .arg(format!(
                "docker ps -aq --filter label=io.sandbox-harness.owner={prefix} | xargs -r docker rm -fv >/dev/null 2>&1"
            ))
            .status();
    }
}

/// The conformance fixture: one deployment prefix per scenario, the image from
/// `kit_image()`.
pub struct DockerFixture {
    pub image: String,
    pub prefix: String,
    _sweep: Sweep,
    /// Sweeps of the shared prefixes of the cross-process scenarios (parent process only).
    shared_sweeps: std::sync::Mutex<Vec<Sweep>>,
}

pub fn fixture() -> DockerFixture {
    fixture_for(&kit_image())
}

/// The fixture on a given image.
pub fn fixture_for(image: &str) -> DockerFixture {
    init_tracing();
    let prefix = prefix();
    DockerFixture {
        image: image.to_owned(),
        prefix: prefix.clone(),
        _sweep: Sweep(prefix),
        shared_sweeps: std::sync::Mutex::new(Vec::new()),
    }
}

#[async_trait]
impl Fixture for DockerFixture {
    async fn client(&self, persistence: Persistence) -> Arc<dyn SandboxClient> {
        Arc::new(
            DockerClient::new(
                DockerOptions::new(&self.image)
                    .name_prefix(&self.prefix)
                    .pull_policy(PullPolicy::Never)
                    .persistence(persistence),
            )
            .expect("client"),
        )
    }

    async fn client_at(
        &self,
        persistence: Persistence,
        shared: &std::path::Path,
    ) -> Arc<dyn SandboxClient> {
        // Every process of a cross-process scenario must name the key's container alike: the
        // prefix comes from the shared directory.
        use std::hash::{Hash as _, Hasher as _};
        let mut h = std::collections::hash_map::DefaultHasher::new();
        shared.hash(&mut h);
        let prefix = format!("sbxx{:010x}", h.finish() & 0xff_ffff_ffff);
        if std::env::var_os("SANDBOX_TESTKIT_ROLE").is_none() {
            self.shared_sweeps
                .lock()
                .expect("sweeps")
                .push(Sweep(prefix.clone()));
        }
        Arc::new(
            DockerClient::new(
                DockerOptions::new(&self.image)
                    .name_prefix(prefix)
                    .pull_policy(PullPolicy::Never)
                    .persistence(persistence),
            )
            .expect("client"),
        )
    }

    async fn lose_box(&self, state: &dyn SandboxState) {
        let state = state
            .downcast::<DockerState>(sandbox_docker::BACKEND)
            .expect("docker state");
        remove(&docker(), &state.container_name).await;
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
