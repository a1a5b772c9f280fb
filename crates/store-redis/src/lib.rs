#![doc = include_str!("../README.md")]

pub mod conn;
mod kv;
mod options;
mod state;
#[cfg(feature = "testkit")]
pub mod testkit;

pub use kv::RedisKvStore;
pub use options::RedisOptions;
pub use state::RedisStateStore;
