#![doc = include_str!("../README.md")]

mod error;
mod options;
mod requests;
#[cfg(feature = "aws")]
mod s3;
mod store;
#[cfg(feature = "testkit")]
pub mod testkit;
mod upload;

pub use object_store;
pub use options::{MAX_PART, MAX_PARTS, MIB, MIN_PART, OssOptions};
pub use requests::RequestCounts;
#[cfg(feature = "aws")]
pub use s3::{BUCKET_VAR, PREFIX_VAR, S3Config};
pub use store::OssSnapshotStore;
