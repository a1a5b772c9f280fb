#![doc = include_str!("../README.md")]

mod client;
mod confined;
mod exec;
mod fsutil;
mod handle;
mod options;
mod state;
#[cfg(feature = "testkit")]
pub mod testkit;

pub use client::LocalClient;
pub use options::{EnvPolicy, Isolation, LocalOptions, MINIMAL_LANG, MINIMAL_PATH};
/// The confinement's options and report, re-exported.
pub use sandbox_confine::{ConfineOptions, Limits, Need, Report};
pub use state::LocalState;

/// The backend's tag, equal to its state's `type` tag.
pub const BACKEND: &str = "local";
