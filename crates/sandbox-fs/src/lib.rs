#![doc = include_str!("../README.md")]

mod filesystem;
pub mod local;
mod text;
mod types;

pub use filesystem::{Filesystem, FilesystemExt, Shell, UpdateFn, no_shell};
pub use local::{LocalFs, LocalOptions, PathPolicy};
pub use types::{
    EditOutcome, EditRequest, FileInfo, FileKind, GlobOptions, GlobResult, GrepMatch, GrepOptions,
    GrepResult, ReadOptions, TextWindow, WriteOutcome,
};
