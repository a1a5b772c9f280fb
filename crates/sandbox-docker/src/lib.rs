#![doc = include_str!("../README.md")]

mod agent;
mod boxed;
mod client;
mod engine;
mod exec;
mod options;
mod state;
mod tarfix;

pub use boxed::DockerBox;
pub use client::{DockerClient, labels};
pub use options::{
    DEFAULT_CAPABILITIES, DEFAULT_PIDS_LIMIT, DEFAULT_SOCKET, DockerOptions, ExtraMount,
    ExtraMounts, HostSettings, PullPolicy, Ulimit,
};
pub use sandbox_core::Persistence;
pub use state::{DockerState, ResolvedMount};

/// The backend's tag, equal to its state's `type` tag.
pub const BACKEND: &str = "docker";
