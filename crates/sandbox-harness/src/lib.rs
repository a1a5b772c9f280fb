#![doc = include_str!("../../../README.md")]

pub use sandbox_core::*;

/// The host process backend (feature `local`, on by default).
#[cfg(feature = "local")]
pub use sandbox_local as local;

/// The Docker engine backend (feature `docker`).
#[cfg(feature = "docker")]
pub use sandbox_docker as docker;

/// The agent filesystem: one interface, agent tools and three modes (feature `fs`, on by
/// default).
#[cfg(feature = "fs")]
pub use sandbox_fs as fs;

/// The distributed execution guard: leases per isolation key in Redis, with fencing tokens
/// (feature `redis`).
#[cfg(feature = "redis")]
pub use guard_redis as redis_guard;
/// Redis stores (feature `redis`): [`RedisStateStore`](redis_store::RedisStateStore), the
/// fenced state store every replica shares, and [`RedisKvStore`](redis_store::RedisKvStore),
/// the shared-store filesystem's versioned key-value store.
#[cfg(feature = "redis")]
pub use store_redis as redis_store;

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
    ];
    tags.sort_unstable();
    tags
}
