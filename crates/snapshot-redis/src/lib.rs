#![doc = include_str!("../README.md")]

mod options;
mod scripts;
mod store;

pub use options::{MAX_PART_SIZE, MIN_PART_SIZE, RedisSnapshotOptions};
pub use store::RedisSnapshotStore;
/// The connection options (URL, key prefix, timeouts, listing page size), shared with
/// store-redis.
pub use store_redis::RedisOptions;
