//! The backend contract: [`SandboxClient`] makes and finds boxes, [`BoxHandle`] is one box's
//! primitives. Everything else (the 4-branch start, snapshots, projection, the call lifecycle)
//! is core's, built on these primitives once.

use std::fmt;

use async_trait::async_trait;
use bytes::Bytes;
use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};
use crate::exec::{ExecRequest, ExecResult};
use crate::isolation::IsolationKey;
use crate::path::RelPath;
use crate::spec::WorkspaceSpec;
use crate::state::SandboxState;
use crate::stream::ByteStream;

/// What a backend can do; an operation it cannot do returns [`Error::NotSupported`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub struct Capabilities {
    /// Bind-mount entries are honoured.
    pub bind_mounts: bool,
    /// Read-only bind mounts are enforced.
    pub read_only_bind_mounts: bool,
    /// The box can be kept between calls ([`Persistence::Keep`]).
    pub keep: bool,
    /// Commands are isolated from the host by a kernel boundary (container, VM, namespaces).
    pub isolated: bool,
    /// `export` may run while an `import` is still streaming into the same box. Lets a
    /// restore read unchanged files from the live workspace instead of fetching them (an
    /// engine that locks the box during an upload cannot).
    pub concurrent_transfers: bool,
    /// The platform can snapshot the whole box and start a box from that snapshot
    /// ([`BoxHandle::native_snapshot`], [`BoxHandle::restore_native`]): what
    /// [`SnapshotFormat::Native`](crate::snapshot::SnapshotFormat::Native) needs.
    pub native_snapshots: bool,
    /// What `exec` honours. A request that needs a missing feature is refused with
    /// [`Error::NotSupported`] by core before it reaches the backend, never half-run.
    pub exec: ExecFeatures,
}

/// The parts of an [`ExecRequest`] a backend honours, and what it guarantees.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub struct ExecFeatures {
    /// Per-request environment variables ([`ExecRequest::env`]).
    pub env: bool,
    /// A per-request working directory ([`ExecRequest::cwd`]).
    pub cwd: bool,
    /// Bytes fed to stdin ([`ExecRequest::stdin`]).
    pub stdin: bool,
    /// A timeout, a finished command or a cancelled call kills *every* process the command
    /// started, including ones that left its process group (`setsid`, daemons). When `false`,
    /// only the command's process group is killed.
    pub tree_kill: bool,
}

impl ExecFeatures {
    /// Every feature.
    pub fn all() -> Self {
        ExecFeatures {
            env: true,
            cwd: true,
            stdin: true,
            tree_kill: true,
        }
    }

    /// Refuse `request` if it needs something missing here.
    pub fn check(&self, backend: &'static str, request: &ExecRequest) -> Result<()> {
        if !request.env.is_empty() && !self.env {
            return Err(Error::NotSupported {
                backend,
                operation: "exec with environment variables",
            });
        }
        if request.cwd.is_some() && !self.cwd {
            return Err(Error::NotSupported {
                backend,
                operation: "exec with a working directory",
            });
        }
        if request.stdin.is_some() && !self.stdin {
            return Err(Error::NotSupported {
                backend,
                operation: "exec with stdin",
            });
        }
        Ok(())
    }
}

/// A box found by [`SandboxClient::list_owned`]: carries this deployment's owner mark.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct OwnedBox {
    /// The backend's id or name of the box (what [`SandboxClient::remove_owned`] takes).
    pub id: String,
    /// The isolation key string it was created for, if any.
    pub key: Option<String>,
    /// When it was created, ms since the epoch, if the backend records it.
    pub created_unix_ms: Option<i64>,
    /// When it expires (the backend's maximum box age), ms since the epoch, if it has one.
    pub expires_unix_ms: Option<i64>,
}

impl OwnedBox {
    /// A listed box.
    pub fn new(id: impl Into<String>, key: Option<String>, created_unix_ms: Option<i64>) -> Self {
        OwnedBox {
            id: id.into(),
            key,
            created_unix_ms,
            expires_unix_ms: None,
        }
    }

    /// With an expiry.
    pub fn expires(mut self, unix_ms: Option<i64>) -> Self {
        self.expires_unix_ms = unix_ms;
        self
    }
}

/// What happens to a self-managed box when a call releases it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Persistence {
    /// Remove the box; the next call restores the workspace from its snapshot (branch B/C),
    /// or starts cold if there is none. The spec's "workspace" persistence.
    #[default]
    Ephemeral,
    /// Stop but keep the box; the next call on the same isolation key finds it and warm-starts
    /// (branch A). The spec's "sandbox" persistence.
    Keep,
}

/// Arguments of [`SandboxClient::create`].
#[derive(Debug, Clone, Copy)]
#[non_exhaustive]
pub struct CreateRequest<'a> {
    /// The workspace layout (root, env, bind mounts are needed at creation).
    pub spec: &'a WorkspaceSpec,
    /// The isolation key, when the box belongs to a slot: backends derive deterministic box
    /// names from it so the same key finds the same box.
    pub key: Option<&'a IsolationKey>,
}

impl<'a> CreateRequest<'a> {
    /// A request for `spec` under `key`.
    pub fn new(spec: &'a WorkspaceSpec, key: Option<&'a IsolationKey>) -> Self {
        CreateRequest { spec, key }
    }
}

/// Makes and finds boxes of one backend.
#[async_trait]
pub trait SandboxClient: Send + Sync + fmt::Debug + 'static {
    /// The backend's tag, equal to its state's `type` tag.
    fn backend(&self) -> &'static str;

    /// What this backend supports.
    fn capabilities(&self) -> Capabilities;

    /// Make a new box (not yet booted). With a key and [`Persistence::Keep`], a backend with
    /// deterministic names may find and adopt an existing box of that name that it owns, and
    /// must refuse one it does not own with [`Error::Conflict`]. An [`Persistence::Ephemeral`]
    /// box is the call's alone: it gets an identity of its own, so a box left behind by a call
    /// that died or whose work could not be saved is never picked up by a later call (that
    /// one restores the stored snapshot), and `gc` removes it.
    async fn create(&self, request: CreateRequest<'_>) -> Result<Box<dyn BoxHandle>>;

    /// Reattach to the box `state` describes. The box may be gone; [`BoxHandle::boot`] then
    /// recreates it and [`BoxHandle::workspace_exists`] reports the loss.
    async fn resume(
        &self,
        state: &dyn SandboxState,
        spec: &WorkspaceSpec,
    ) -> Result<Box<dyn BoxHandle>>;

    /// Remove every resource `state` describes. Removing what is already gone is not an error.
    async fn delete(&self, state: &dyn SandboxState) -> Result<()>;

    /// Every box that carries this client's owner mark (labels, a marker file), whatever its
    /// state: what one backend-independent `gc` walks ([`crate::SandboxManager::gc`]).
    async fn list_owned(&self) -> Result<Vec<OwnedBox>>;

    /// The id, as [`list_owned`](Self::list_owned) reports it, of the box `state` describes
    /// (so `gc` keeps the box a stored state points at, and only that one).
    fn box_id(&self, state: &dyn SandboxState) -> Result<String>;

    /// Remove the owned box `id` (from [`list_owned`](Self::list_owned)), checking the owner
    /// mark again first. Removing what is already gone is not an error.
    async fn remove_owned(&self, id: &str) -> Result<()>;

    /// Delete the platform snapshot `reference` (from [`BoxHandle::native_snapshot`]) once no
    /// retained snapshot record names it. Deleting what is already gone is not an error.
    async fn delete_native_snapshot(&self, reference: &str) -> Result<()> {
        let _ = reference;
        Err(not_supported(self.backend(), "native snapshots"))
    }

    /// Remove what a process killed while it created or removed a box left behind that
    /// [`list_owned`](Self::list_owned) cannot see (a directory without its owner mark, half
    /// deleted), older than `sweep.grace`; at most `sweep.max_removals` of them.
    /// [`SandboxManager::gc`](crate::SandboxManager::gc) runs it. The default finds nothing:
    /// right for a backend whose boxes appear with their owner mark and vanish whole (a
    /// container created with its labels, removed by the engine).
    async fn sweep_leftovers(
        &self,
        sweep: crate::leftover::LeftoverSweep,
    ) -> Result<crate::leftover::LeftoverReport> {
        let _ = sweep;
        Ok(crate::leftover::LeftoverReport::default())
    }
}

/// Kind of a tree entry.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum EntryType {
    /// Regular file.
    File,
    /// Directory.
    Dir,
    /// Symbolic link.
    Symlink,
    /// Anything else (fifo, socket, device): never archived.
    Other,
}

/// One entry of [`BoxHandle::list`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[non_exhaustive]
pub struct TreeEntry {
    /// Workspace-relative path.
    pub path: RelPath,
    /// Kind.
    pub kind: EntryType,
    /// Size in bytes (files), 0 otherwise.
    pub size: u64,
    /// Modification time, nanoseconds since the epoch.
    pub mtime_ns: i64,
    /// Permission bits.
    pub mode: u32,
    /// Inode number where the backend knows it (change detection).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub inode: Option<u64>,
    /// Link target, for symlinks.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub link_target: Option<String>,
}

impl TreeEntry {
    /// An entry with the given fields and no inode or link target.
    pub fn new(path: RelPath, kind: EntryType, size: u64, mtime_ns: i64, mode: u32) -> Self {
        TreeEntry {
            path,
            kind,
            size,
            mtime_ns,
            mode,
            inode: None,
            link_target: None,
        }
    }
}

/// What [`BoxHandle::export`] puts in its tar stream.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct ExportRequest {
    /// Only these paths (and what is under them); `None` is the whole workspace.
    pub paths: Option<Vec<RelPath>>,
    /// Leave these paths (and what is under them) out.
    pub exclude: Vec<RelPath>,
    /// Leave out paths matching these globs (workspace-relative; `*`, `?`, `**`).
    pub exclude_globs: Vec<String>,
}

/// How [`BoxHandle::import`] applies a tar stream.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum ImportMode {
    /// Extract over the live workspace, replacing files of the same name (entries,
    /// projection). Never writes through a symlink that is already in the workspace.
    Merge,
    /// Make the workspace exactly the archive. The backend receives the whole stream into a
    /// staging area first and touches the live workspace only if the stream ended without an
    /// error; then it swaps the staged tree in. Paths in `keep` (bind mounts) are carried over
    /// from the live workspace untouched.
    Replace {
        /// Live paths to keep as they are.
        keep: Vec<RelPath>,
    },
}

/// One box's primitives. Implemented by each backend; used through [`crate::Sandbox`].
///
/// The tar streams exchanged hold workspace-relative paths (`a/b.txt`, no leading `/` or
/// `./`). Streams handed to `import` come from core and are already validated; backends still
/// must not follow symlinks in the live workspace when writing.
#[async_trait]
pub trait BoxHandle: Send + Sync + fmt::Debug + 'static {
    /// The backend's tag.
    fn backend(&self) -> &'static str;

    /// Absolute workspace root inside the box.
    fn workspace_root(&self) -> &str;

    /// The backend's state for this box. Its common part is filled in by core, so backends may
    /// return a default one.
    fn state(&self) -> Box<dyn SandboxState>;

    /// Make sure the box exists and runs (create or start it as needed). Idempotent.
    async fn boot(&self) -> Result<()>;

    /// End of a self-managed call: stop and keep ([`Persistence::Keep`]) or remove
    /// ([`Persistence::Ephemeral`]) according to the backend's configuration.
    async fn release(&self) -> Result<()>;

    /// Stop the box but keep it, whatever the persistence: a call whose snapshot or state save
    /// failed leaves its work here, for the next call on the key (or `gc`).
    async fn park(&self) -> Result<()>;

    /// Remove the box and everything it holds, whatever the persistence.
    async fn destroy(&self) -> Result<()>;

    /// Whether the workspace root exists in the box right now.
    async fn workspace_exists(&self) -> Result<bool>;

    /// Wait until nothing this handle started is still under way: every command whose future
    /// was dropped is dead with everything it started (its kill finished), and every dropped
    /// file operation has ended — so nothing writes to the workspace any more. Core calls it
    /// for a cancelled call before the box is snapshotted, parked or released. An error means
    /// something may still run (the backend could not confirm the kill). The default returns
    /// at once: for a backend whose operations end when their futures are dropped.
    async fn settle(&self) -> Result<()> {
        Ok(())
    }

    /// Run a command. A timeout kills the command's whole process tree inside the box and
    /// returns the output so far with `timed_out = true`.
    async fn exec(&self, request: ExecRequest) -> Result<ExecResult>;

    /// Every entry under the workspace root, excluding the root itself.
    async fn list(&self) -> Result<Vec<TreeEntry>>;

    /// The workspace (or part of it) as a tar stream.
    async fn export(&self, request: &ExportRequest) -> Result<ByteStream>;

    /// Apply a tar stream to the workspace.
    async fn import(&self, archive: ByteStream, mode: ImportMode) -> Result<()>;

    /// Read one file.
    async fn read_file(&self, path: &RelPath) -> Result<Bytes>;

    /// Write one file (parents created), replacing it atomically where the backend can.
    async fn write_file(&self, path: &RelPath, data: Bytes, mode: u32) -> Result<()>;

    /// Remove paths (recursively); missing paths are not an error.
    async fn remove(&self, paths: &[RelPath]) -> Result<()>;

    /// Take a platform snapshot of the whole box (its filesystem, and its memory where the
    /// platform keeps that) and return the platform's reference to it. Only for backends with
    /// [`Capabilities::native_snapshots`]; core records the reference as the snapshot.
    async fn native_snapshot(&self) -> Result<String> {
        Err(not_supported(self.backend(), "native snapshots"))
    }

    /// Make this box run from the platform snapshot `reference` (replacing what it ran before):
    /// afterwards its workspace is the snapshot's and [`state`](Self::state) describes the box
    /// now in use. On error the box is left as it was where the platform allows.
    async fn restore_native(&self, reference: &str) -> Result<()> {
        let _ = reference;
        Err(not_supported(self.backend(), "native snapshots"))
    }
}

/// The error a backend returns for an operation it does not implement.
pub fn not_supported(backend: &'static str, operation: &'static str) -> Error {
    Error::NotSupported { backend, operation }
}
