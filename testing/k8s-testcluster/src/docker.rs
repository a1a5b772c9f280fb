//! Pods are Docker containers, driven through the `docker` CLI (crate `test-docker`).

pub(crate) use test_docker::{ContainerSpec, kill, remove, wait};

use crate::Error;

/// Label on every container and network a cluster creates: the cluster id (its pid label is
/// `sandbox-harness.k8s-testcluster.pid`).
pub(crate) const LABEL: &str = "sandbox-harness.k8s-testcluster";

/// The owner of one cluster's containers and network.
pub(crate) fn owner(cluster_id: &str) -> test_docker::Owner {
    test_docker::Owner::new(LABEL, cluster_id)
}

impl From<test_docker::Error> for Error {
    fn from(e: test_docker::Error) -> Self {
        Self::Docker(e.0)
    }
}

/// Remove containers and networks of earlier clusters whose owner process is gone.
pub(crate) async fn remove_stale() -> Result<(), Error> {
    Ok(test_docker::remove_stale(LABEL).await?)
}
