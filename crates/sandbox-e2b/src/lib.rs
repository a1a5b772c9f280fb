#![doc = include_str!("../README.md")]

mod api;
mod boxed;
mod client;
mod envd;
mod options;
mod state;

pub use api::CREATION_TAG;
pub use boxed::E2bBox;
pub use client::E2bClient;
pub use options::{E2bOptions, E2bPersistence, ENVD_PORT};
pub use sandbox_cloud::{HttpOptions, Secret};
pub use sandbox_core::Persistence;
pub use state::E2bState;

/// The backend's tag, equal to its state's `type` tag.
pub const BACKEND: &str = "e2b";
