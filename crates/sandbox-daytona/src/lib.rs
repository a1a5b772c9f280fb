#![doc = include_str!("../README.md")]

mod api;
mod boxed;
mod client;
mod options;
mod state;

pub use boxed::DaytonaBox;
pub use client::DaytonaClient;
pub use options::{API_KEY_VAR, API_URL_VAR, DEFAULT_API_URL, DaytonaOptions, Source};
pub use sandbox_cloud::{HttpOptions, Secret};
pub use sandbox_core::Persistence;
pub use state::DaytonaState;

/// The backend's tag, equal to its state's `type` tag.
pub const BACKEND: &str = "daytona";
