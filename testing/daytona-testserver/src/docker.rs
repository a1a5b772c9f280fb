//! Sandboxes are Docker containers, driven through `test-docker` (the `docker` CLI) and
//! labelled as this server's.

use std::time::Duration;

use test_docker::{ContainerSpec, Owner};

use crate::Error;

/// Label namespace of every container and network a server creates (value: the server id).
pub(crate) const LABEL: &str = "sandbox-harness.daytona-testserver";

fn err(e: test_docker::Error) -> Error {
    Error::Docker(e.to_string())
}

pub(crate) fn owner(server_id: &str) -> Owner {
    Owner::new(LABEL, server_id)
}

/// Create the server's bridge network (after removing what killed servers left).
pub(crate) async fn create_network(name: &str, server_id: &str) -> Result<(), Error> {
    if let Err(e) = test_docker::remove_stale(LABEL).await {
        tracing::warn!(error = %e, "removing stale test servers");
    }
    owner(server_id).create_network(name).await.map_err(err)
}

/// `docker run -d` `image` on `network` with `env`; the container id.
pub(crate) async fn run(
    name: &str,
    image: &str,
    env: &[(String, String)],
    network: &str,
    server_id: &str,
) -> Result<String, Error> {
    let spec = ContainerSpec {
        name: name.to_owned(),
        image: image.to_owned(),
        env: env.to_vec(),
        ..ContainerSpec::default()
    };
    owner(server_id)
        .run(&spec, network)
        .await
        .map(|s| s.id)
        .map_err(err)
}

/// The container's IPv4 address on `network` (empty when it is not running).
pub(crate) async fn ip(container: &str, network: &str) -> Result<String, Error> {
    test_docker::ip_address(container, network)
        .await
        .map_err(err)
}

/// Whether the image exists locally.
pub(crate) async fn image_exists(image: &str) -> Result<bool, Error> {
    test_docker::image_exists(image).await.map_err(err)
}

/// `docker start`.
pub(crate) async fn start(container: &str) -> Result<(), Error> {
    test_docker::start(container).await.map_err(err)
}

/// `docker stop -t 2` (SIGTERM, SIGKILL after 2 s).
pub(crate) async fn stop(container: &str) -> Result<(), Error> {
    test_docker::stop(container, Duration::from_secs(2))
        .await
        .map_err(err)
}

/// `docker rm -f`.
pub(crate) async fn remove(container: &str) -> Result<(), Error> {
    test_docker::remove(container).await.map_err(err)
}

/// Remove every container and the network of one server (blocking: runs from `Drop`).
pub(crate) fn cleanup_blocking(server_id: &str, network: &str, in_flight: bool) {
    owner(server_id).cleanup_blocking(Some(network), in_flight);
}
