#![doc = include_str!("../README.md")]

mod client;
mod exec;
mod fsutil;
mod handle;
mod options;
mod state;
#[cfg(feature = "testkit")]
pub mod testkit;

pub use client::LocalClient;
pub use options::{EnvPolicy, LocalOptions, MINIMAL_LANG, MINIMAL_PATH};
pub use state::LocalState;

/// The backend's tag, equal to its state's `type` tag.
pub const BACKEND: &str = "local";
