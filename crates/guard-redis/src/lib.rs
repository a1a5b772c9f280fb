#![doc = include_str!("../README.md")]

mod error;
mod guard;
mod options;
mod scripts;

pub use guard::RedisGuard;
pub use options::{DEFAULT_KEY_PREFIX, MIN_LEASE_TTL, RedisGuardOptions};
/// The `redis` crate's reconnecting connection, for [`RedisGuard::with_connection`].
pub use redis::aio::ConnectionManager;
