#![doc = include_str!("../README.md")]

mod facade;
mod filesystem;
pub mod kv;
pub mod local;
pub mod sandbox;
pub mod shared;
mod text;
pub mod tools;
mod types;
mod work;

pub use facade::{AgentFs, FilesystemSpec, filesystem};
pub use filesystem::{Filesystem, FilesystemExt, Shell, UpdateFn, no_shell};
pub use kv::{KvEntry, KvStore, MemoryKvStore, Precondition, Version, Versioned};
pub use local::{LocalFs, LocalOptions, PathPolicy};
pub use sandbox::{SandboxFs, SandboxFsOptions};
pub use shared::{SharedStore, SharedStoreFs, SharedStoreOptions};
pub use tools::{ToolDefinition, ToolOutput, Tools};
pub use types::{
    EditOutcome, EditRequest, FileInfo, FileKind, GlobOptions, GlobResult, GrepMatch, GrepOptions,
    GrepResult, ListResult, ReadOptions, TextWindow, WriteOutcome,
};
pub use work::{
    MAX_COUNTED_MATCHES, MAX_EDIT_LINES, MAX_LIST_ENTRIES, MAX_PATTERN_BYTES, MAX_TEXT_BYTES,
    REGEX_DFA_SIZE_LIMIT, REGEX_SIZE_LIMIT,
};
