#![doc = include_str!("../README.md")]

pub mod archive;
mod backend;
pub mod beneath;
mod durable;
mod error;
mod exec;
mod guard;
pub mod host;
pub mod housekeeping;
mod isolation;
pub mod leftover;
mod manager;
mod path;
pub mod posix;
pub mod projection;
mod reach;
mod redact;
mod sandbox;
pub mod scripted;
pub mod snapshot;
mod spec;
mod state;
mod state_store;
pub mod stream;
#[cfg(any(test, feature = "testkit"))]
pub mod testkit;

pub use backend::{
    BoxHandle, Capabilities, CreateRequest, EntryType, ExecFeatures, ExportRequest, ImportMode,
    OwnedBox, Persistence, SandboxClient, TreeEntry, not_supported,
};
pub use error::{BoxError, Error, ErrorKind, Result};
pub use exec::{
    CappedBuffer, Captured, CapturedOutput, Command, ExecRequest, ExecResult, Inflight,
    InflightGuard, OutputLimits, read_capped,
};
pub use guard::{
    FileGuard, FileGuardOptions, InProcessGuard, Lease, LeaseHandle, NoopGuard,
    SandboxExecutionGuard,
};
pub use housekeeping::{HousekeepingOptions, HousekeepingOutcome, HousekeepingRun};
pub use isolation::{CallContext, GLOBAL_KEY, IsolationKey, IsolationScope, encode_component};
pub use leftover::{LeftoverReport, LeftoverSweep};
pub use manager::{
    Acquire, AcquiredFrom, ActiveCall, BoxGcOptions, BoxGcReport, CallError, CallOptions,
    CallReport, Called, DeleteReport, Distributed, OnCancel, SandboxManager, SandboxManagerBuilder,
};
pub use path::RelPath;
pub use projection::{Projection, ProjectionOutcome};
pub use reach::Reach;
pub use redact::{RedactedUrl, UserInfo, raw_userinfo, redact_url, split_userinfo};
pub use sandbox::{Sandbox, SandboxConfig, StartBranch, StartReport, StopReport};
pub use snapshot::{
    BlobKey, LocalDirSnapshotStore, NoopSnapshotStore, SnapshotRef, SnapshotSpec, SnapshotStore,
};
pub use spec::{EntryKind, WorkspaceEntry, WorkspaceSpec, WorkspaceSpecBuilder};
pub use state::{
    CancelledCall, CommonState, ProjectionRecord, STATE_SCHEMA_VERSION, SandboxState,
    known_state_tags, state_from_json, state_to_json,
};
pub use state_store::{FileStateStore, MemoryStateStore, StateStore};

/// Re-exported for backends implementing the async traits.
pub use async_trait::async_trait;
/// Re-exported so backends register state types with the same `typetag` as core.
pub use typetag;
