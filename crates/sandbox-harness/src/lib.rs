#![doc = include_str!("../../../README.md")]

pub use sandbox_core::*;

/// The host process backend (feature `local`, on by default).
#[cfg(feature = "local")]
pub use sandbox_local as local;

/// The Daytona backend (feature `daytona`).
#[cfg(feature = "daytona")]
pub use sandbox_daytona as daytona;
/// The Docker engine backend (feature `docker`).
#[cfg(feature = "docker")]
pub use sandbox_docker as docker;
/// The E2B backend, also for E2B-compatible clouds (feature `e2b`).
#[cfg(feature = "e2b")]
pub use sandbox_e2b as e2b;
/// The Kubernetes (agent-sandbox) backend (feature `k8s`).
#[cfg(feature = "k8s")]
pub use sandbox_k8s as k8s;

/// The agent filesystem: one interface, agent tools and three modes (feature `fs`, on by
/// default).
#[cfg(feature = "fs")]
pub use sandbox_fs as fs;

/// The distributed execution guard: leases per isolation key in Redis, with fencing tokens
/// (feature `redis`).
#[cfg(feature = "redis")]
pub use guard_redis as redis_guard;
/// The Redis snapshot store (feature `redis`):
/// [`RedisSnapshotStore`](redis_snapshots::RedisSnapshotStore), blobs cut into part keys and
/// published atomically, with an index that gives GC their ages.
#[cfg(feature = "redis")]
pub use snapshot_redis as redis_snapshots;
/// Redis stores (feature `redis`): [`RedisStateStore`](redis_store::RedisStateStore), the
/// fenced state store every replica shares, and [`RedisKvStore`](redis_store::RedisKvStore),
/// the shared-store filesystem's versioned key-value store.
#[cfg(feature = "redis")]
pub use store_redis as redis_store;

/// Snapshots in S3 and S3-compatible services (Alibaba OSS, MinIO, ...) and any `object_store`
/// backend (feature `s3`): [`OssSnapshotStore`](s3::OssSnapshotStore), configured from code
/// or the environment with [`S3Config`](s3::S3Config).
#[cfg(feature = "s3")]
pub use snapshot_oss as s3;

/// The parts many replicas share, on one Redis (feature `redis`): a
/// [`RedisGuard`](redis_guard::RedisGuard) and a
/// [`RedisStateStore`](redis_store::RedisStateStore) at `url`, with their default options, for
/// [`SandboxManagerBuilder::distributed`] (add the snapshot store with
/// [`Distributed::snapshots`]). Connects lazily: the first call that needs Redis reports it
/// unreachable as [`Error::Unavailable`]. Build [`Distributed`] yourself for other options.
///
/// ```no_run
/// # fn demo(client: std::sync::Arc<dyn sandbox_harness::SandboxClient>) -> sandbox_harness::Result<()> {
/// use std::sync::Arc;
/// use sandbox_harness::snapshot::LocalDirSnapshotStore;
/// use sandbox_harness::{SandboxManager, redis_distributed};
/// let shared = redis_distributed("redis://redis.internal:6379")?
///     .snapshots(Arc::new(LocalDirSnapshotStore::shared_by_all_hosts("/mnt/nfs/snapshots")));
/// let manager = SandboxManager::builder(client).distributed(shared).build()?;
/// # Ok(()) }
/// ```
#[cfg(feature = "redis")]
pub fn redis_distributed(url: &str) -> Result<Distributed> {
    let guard = redis_guard::RedisGuard::open(url, redis_guard::RedisGuardOptions::default())?;
    let states = redis_store::RedisStateStore::new(redis_store::RedisOptions::new(url))?;
    Ok(Distributed::new(
        std::sync::Arc::new(guard),
        std::sync::Arc::new(states),
    ))
}

/// The `type` tags of the backends this build of the facade links, sorted.
///
/// Naming each backend crate here also keeps its state type linked, so state JSON written by
/// any enabled backend can be read back (see [`state_from_json`]).
pub fn enabled_backends() -> Vec<&'static str> {
    let mut tags = vec![
        #[cfg(feature = "local")]
        sandbox_local::BACKEND,
        #[cfg(feature = "docker")]
        sandbox_docker::BACKEND,
        #[cfg(feature = "k8s")]
        sandbox_k8s::BACKEND,
        #[cfg(feature = "e2b")]
        sandbox_e2b::BACKEND,
        #[cfg(feature = "daytona")]
        sandbox_daytona::BACKEND,
    ];
    tags.sort_unstable();
    tags
}
