//! [`NativePlatform`]: gives any backend "platform" snapshots, to test core's
//! [`SnapshotFormat::Native`](crate::snapshot::SnapshotFormat::Native) path on a real box.
//! A platform snapshot is the box's whole workspace exported as tar and held in memory under
//! a fresh reference; restoring imports it in `Replace` mode. Deleting one removes it, or
//! fails while [`NativePlatform::fail_deletes`] is set.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use async_trait::async_trait;
use bytes::Bytes;

use crate::backend::{
    BoxHandle, Capabilities, CreateRequest, ExportRequest, ImportMode, OwnedBox, SandboxClient,
    TreeEntry,
};
use crate::error::{Error, Result};
use crate::exec::{ExecRequest, ExecResult};
use crate::path::RelPath;
use crate::spec::WorkspaceSpec;
use crate::state::SandboxState;
use crate::stream::{self, ByteStream};

/// The snapshots a [`NativePlatform`] holds, shared by its client and boxes.
#[derive(Debug, Default)]
pub struct Platform {
    snapshots: Mutex<HashMap<String, Bytes>>,
    fail_deletes: AtomicBool,
    restores: Mutex<Vec<String>>,
}

impl Platform {
    /// References of the snapshots held now.
    pub fn references(&self) -> Vec<String> {
        let mut r: Vec<String> = self
            .snapshots
            .lock()
            .expect("platform")
            .keys()
            .cloned()
            .collect();
        r.sort();
        r
    }

    /// References restored so far, in order.
    pub fn restores(&self) -> Vec<String> {
        self.restores.lock().expect("platform").clone()
    }

    /// Make deletes fail (an outage of the platform's API) or succeed again.
    pub fn fail_deletes(&self, fail: bool) {
        self.fail_deletes.store(fail, Ordering::SeqCst);
    }
}

/// A client wrapper whose boxes can be snapshotted by "the platform".
#[derive(Debug)]
pub struct NativePlatform {
    inner: Arc<dyn SandboxClient>,
    platform: Arc<Platform>,
}

impl NativePlatform {
    /// Wrap `inner`.
    pub fn new(inner: Arc<dyn SandboxClient>) -> Self {
        NativePlatform {
            inner,
            platform: Arc::default(),
        }
    }

    /// The platform's snapshots.
    pub fn platform(&self) -> Arc<Platform> {
        self.platform.clone()
    }

    fn wrap(&self, inner: Box<dyn BoxHandle>) -> Box<dyn BoxHandle> {
        Box::new(NativeBox {
            inner,
            platform: self.platform.clone(),
        })
    }
}

#[async_trait]
impl SandboxClient for NativePlatform {
    fn backend(&self) -> &'static str {
        self.inner.backend()
    }
    fn capabilities(&self) -> Capabilities {
        Capabilities {
            native_snapshots: true,
            ..self.inner.capabilities()
        }
    }
    async fn create(&self, request: CreateRequest<'_>) -> Result<Box<dyn BoxHandle>> {
        Ok(self.wrap(self.inner.create(request).await?))
    }
    async fn resume(
        &self,
        state: &dyn SandboxState,
        spec: &WorkspaceSpec,
    ) -> Result<Box<dyn BoxHandle>> {
        Ok(self.wrap(self.inner.resume(state, spec).await?))
    }
    async fn delete(&self, state: &dyn SandboxState) -> Result<()> {
        self.inner.delete(state).await
    }
    async fn list_owned(&self) -> Result<Vec<OwnedBox>> {
        self.inner.list_owned().await
    }
    fn box_id(&self, state: &dyn SandboxState) -> Result<String> {
        self.inner.box_id(state)
    }
    async fn remove_owned(&self, id: &str) -> Result<()> {
        self.inner.remove_owned(id).await
    }
    async fn delete_native_snapshot(&self, reference: &str) -> Result<()> {
        if self.platform.fail_deletes.load(Ordering::SeqCst) {
            return Err(Error::Unavailable {
                service: "test platform".into(),
                reason: "deletes fail (injected)".into(),
                source: None,
            });
        }
        match self
            .platform
            .snapshots
            .lock()
            .expect("platform")
            .remove(reference)
        {
            Some(_) => Ok(()),
            None => Err(Error::NotFound {
                what: "platform snapshot",
                key: reference.to_owned(),
            }),
        }
    }
}

#[derive(Debug)]
struct NativeBox {
    inner: Box<dyn BoxHandle>,
    platform: Arc<Platform>,
}

#[async_trait]
impl BoxHandle for NativeBox {
    fn backend(&self) -> &'static str {
        self.inner.backend()
    }
    fn workspace_root(&self) -> &str {
        self.inner.workspace_root()
    }
    fn state(&self) -> Box<dyn SandboxState> {
        self.inner.state()
    }
    async fn boot(&self) -> Result<()> {
        self.inner.boot().await
    }
    async fn release(&self) -> Result<()> {
        self.inner.release().await
    }
    async fn park(&self) -> Result<()> {
        self.inner.park().await
    }
    async fn settle(&self) -> Result<()> {
        self.inner.settle().await
    }
    async fn destroy(&self) -> Result<()> {
        self.inner.destroy().await
    }
    async fn workspace_exists(&self) -> Result<bool> {
        self.inner.workspace_exists().await
    }
    async fn exec(&self, request: ExecRequest) -> Result<ExecResult> {
        self.inner.exec(request).await
    }
    async fn list(&self) -> Result<Vec<TreeEntry>> {
        self.inner.list().await
    }
    async fn export(&self, request: &ExportRequest) -> Result<ByteStream> {
        self.inner.export(request).await
    }
    async fn import(&self, archive: ByteStream, mode: ImportMode) -> Result<()> {
        self.inner.import(archive, mode).await
    }
    async fn read_file(&self, path: &RelPath) -> Result<Bytes> {
        self.inner.read_file(path).await
    }
    async fn write_file(&self, path: &RelPath, data: Bytes, mode: u32) -> Result<()> {
        self.inner.write_file(path, data, mode).await
    }
    async fn remove(&self, paths: &[RelPath]) -> Result<()> {
        self.inner.remove(paths).await
    }
    async fn native_snapshot(&self) -> Result<String> {
        let tar =
            stream::collect(self.inner.export(&ExportRequest::default()).await?, 1 << 30).await?;
        let reference = format!("snap-{}", uuid::Uuid::new_v4());
        self.platform
            .snapshots
            .lock()
            .expect("platform")
            .insert(reference.clone(), tar);
        Ok(reference)
    }
    async fn restore_native(&self, reference: &str) -> Result<()> {
        let tar = self
            .platform
            .snapshots
            .lock()
            .expect("platform")
            .get(reference)
            .cloned()
            .ok_or_else(|| Error::NotFound {
                what: "platform snapshot",
                key: reference.to_owned(),
            })?;
        self.inner
            .import(stream::once(tar), ImportMode::Replace { keep: Vec::new() })
            .await?;
        self.platform
            .restores
            .lock()
            .expect("platform")
            .push(reference.to_owned());
        Ok(())
    }
}
