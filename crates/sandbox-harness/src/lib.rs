//! sandbox-harness facade (work in progress).
pub use sandbox_core as core;
