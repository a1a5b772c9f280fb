//! Picking the mode declaratively: [`FilesystemSpec`] → [`filesystem`] → [`AgentFs`], whose
//! [`call`](AgentFs::call) hands each call the [`Filesystem`] bound to it (its user, its
//! namespace, its sandbox). Agent code only ever sees `Arc<dyn Filesystem>`.

use std::fmt;
use std::future::Future;
use std::sync::Arc;

use sandbox_core::{CallContext, Result, SandboxManager};

use crate::filesystem::Filesystem;
use crate::kv::KvStore;
use crate::local::{LocalFs, LocalOptions};
use crate::sandbox::{SandboxFs, SandboxFsOptions};
use crate::shared::{SharedStore, SharedStoreOptions};

/// Which mode, with its options (the spec's `filesystem(...)` argument). The default is local
/// files with a host shell.
#[non_exhaustive]
pub enum FilesystemSpec {
    /// Mode 3: local files and a host shell.
    Local(LocalOptions),
    /// Mode 1: routed paths in a shared [`KvStore`], no shell.
    SharedStore {
        /// The store.
        store: Arc<dyn KvStore>,
        /// Routing, scope and local options.
        options: SharedStoreOptions,
    },
    /// Mode 2: each call's files and commands in the sandbox the manager acquires for it.
    Sandbox {
        /// The lifecycle manager (backend, scope, snapshots, guard).
        manager: SandboxManager,
        /// Command defaults.
        options: SandboxFsOptions,
    },
    /// The escape hatch: a filesystem of your own, used as is for every call.
    Custom(Arc<dyn Filesystem>),
}

impl Default for FilesystemSpec {
    fn default() -> Self {
        FilesystemSpec::Local(LocalOptions::default())
    }
}

impl fmt::Debug for FilesystemSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            FilesystemSpec::Local(o) => f.debug_tuple("Local").field(o).finish(),
            FilesystemSpec::SharedStore { store, options } => f
                .debug_struct("SharedStore")
                .field("store", store)
                .field("options", options)
                .finish(),
            FilesystemSpec::Sandbox { manager, options } => f
                .debug_struct("Sandbox")
                .field("manager", manager)
                .field("options", options)
                .finish(),
            FilesystemSpec::Custom(fs) => f.debug_tuple("Custom").field(fs).finish(),
        }
    }
}

impl FilesystemSpec {
    /// Mode 3 with `options`.
    pub fn local(options: LocalOptions) -> Self {
        FilesystemSpec::Local(options)
    }

    /// Mode 1 over `store`.
    pub fn shared_store(store: Arc<dyn KvStore>, options: SharedStoreOptions) -> Self {
        FilesystemSpec::SharedStore { store, options }
    }

    /// Mode 2 with `manager`.
    pub fn sandbox(manager: SandboxManager) -> Self {
        FilesystemSpec::Sandbox {
            manager,
            options: SandboxFsOptions::default(),
        }
    }

    /// Your own filesystem.
    pub fn custom(fs: Arc<dyn Filesystem>) -> Self {
        FilesystemSpec::Custom(fs)
    }
}

enum Mode {
    Local(LocalFs),
    Shared(SharedStore),
    Sandbox {
        manager: SandboxManager,
        options: SandboxFsOptions,
    },
    Custom(Arc<dyn Filesystem>),
}

/// A configured mode; [`call`](Self::call) runs one call with its filesystem.
pub struct AgentFs {
    mode: Mode,
}

impl fmt::Debug for AgentFs {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let inner: &dyn fmt::Debug = match &self.mode {
            Mode::Local(l) => l,
            Mode::Shared(s) => s,
            Mode::Sandbox { manager, .. } => manager,
            Mode::Custom(c) => c,
        };
        f.debug_tuple("AgentFs").field(inner).finish()
    }
}

/// Build the mode `spec` describes (creating the local workspace directory where there is
/// one).
pub fn filesystem(spec: FilesystemSpec) -> Result<AgentFs> {
    let mode = match spec {
        FilesystemSpec::Local(options) => Mode::Local(LocalFs::new(options)?),
        FilesystemSpec::SharedStore { store, options } => {
            Mode::Shared(SharedStore::new(store, options)?)
        }
        FilesystemSpec::Sandbox { manager, options } => Mode::Sandbox { manager, options },
        FilesystemSpec::Custom(fs) => Mode::Custom(fs),
    };
    Ok(AgentFs { mode })
}

impl AgentFs {
    /// The mode's name: `local`, `shared_store`, `sandbox`, or the custom filesystem's.
    pub fn mode(&self) -> &'static str {
        match &self.mode {
            Mode::Local(_) => "local",
            Mode::Shared(_) => "shared_store",
            Mode::Sandbox { .. } => "sandbox",
            Mode::Custom(fs) => fs.mode(),
        }
    }

    /// Whether calls get a shell (and so the `execute` tool).
    pub fn has_shell(&self) -> bool {
        match &self.mode {
            Mode::Local(l) => l.shell().is_some(),
            Mode::Shared(_) => false,
            Mode::Sandbox { .. } => true,
            Mode::Custom(fs) => fs.shell().is_some(),
        }
    }

    /// The filesystem of a call that needs no sandbox lifecycle (local, shared store,
    /// custom); `None` for the sandbox mode, whose filesystem exists only inside
    /// [`call`](Self::call).
    pub fn bind(&self, ctx: &CallContext) -> Option<Arc<dyn Filesystem>> {
        match &self.mode {
            Mode::Local(l) => Some(match &ctx.user_id {
                Some(user) => Arc::new(l.for_user(user)),
                None => Arc::new(l.clone()),
            }),
            Mode::Shared(s) => Some(Arc::new(s.for_call(ctx))),
            Mode::Sandbox { .. } => None,
            Mode::Custom(fs) => Some(fs.clone()),
        }
    }

    /// Run one call: `f` gets the filesystem bound to `ctx` (in sandbox mode, to the sandbox
    /// acquired, started, and afterwards stopped and persisted for this call).
    pub async fn call<F, Fut, T>(&self, ctx: &CallContext, f: F) -> Result<T>
    where
        F: FnOnce(Arc<dyn Filesystem>) -> Fut,
        Fut: Future<Output = T>,
    {
        match &self.mode {
            Mode::Sandbox { manager, options } => {
                let options = *options;
                let called = manager
                    .call(ctx, move |sandbox| {
                        f(Arc::new(SandboxFs::with_options(sandbox, options)))
                    })
                    .await?;
                Ok(called.value)
            }
            _ => {
                let fs = self.bind(ctx).expect("non-sandbox modes bind directly");
                Ok(f(fs).await)
            }
        }
    }
}
