#![doc = include_str!("../README.md")]

mod error;
mod options;
#[cfg(feature = "aws")]
mod s3;
mod store;
#[cfg(feature = "testkit")]
pub mod testkit;
mod upload;

pub use object_store;
pub use options::{MAX_PART, MAX_PARTS, MIB, MIN_PART, OssOptions};
#[cfg(feature = "aws")]
pub use s3::{BUCKET_VAR, PREFIX_VAR, S3Config};
pub use store::OssSnapshotStore;
