#![doc = include_str!("../README.md")]

mod boxed;
mod client;
mod control;
mod crd;
mod dataplane;
mod legacy;
mod options;
mod sandboxd;
mod state;

pub use boxed::K8sBox;
pub use client::{K8sClient, labels};
pub use options::{ClusterAccess, Connection, K8sOptions, Runtime};
pub use sandbox_core::Persistence;
pub use state::{ConnectionKind, K8sState};

/// The backend's tag, equal to its state's `type` tag.
pub const BACKEND: &str = "kubernetes";
