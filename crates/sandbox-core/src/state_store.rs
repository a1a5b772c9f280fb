//! Where box state JSON lives between calls, keyed by [`IsolationKey`]: the [`StateStore`]
//! contract with in-memory and file-backed editions.
//!
//! **Fencing.** Each key has a fence: the highest fencing token registered for it. A new
//! holder registers its lease's token with [`StateStore::fence`] *before* it reads the state
//! (a guard without tokens lets the store number the holder instead); from then on every save
//! or delete with a lower token, or with none, is refused with [`Error::StaleLease`]. So a
//! holder whose lease expired can never overwrite what its successor reads or writes, even if
//! the successor has not saved yet.

use std::collections::HashMap;
use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use async_trait::async_trait;
use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};
use crate::isolation::IsolationKey;
use crate::reach::Reach;

/// Persists box state JSON per isolation key, fenced (see the module docs).
#[async_trait]
pub trait StateStore: Send + Sync + fmt::Debug + 'static {
    /// The state JSON saved under `key`, if any.
    async fn load(&self, key: &IsolationKey) -> Result<Option<String>>;

    /// Register a new holder of `key` and return the token its writes must carry. With
    /// `granted` (the token its guard issued), raise the key's fence to it — refused with
    /// [`Error::StaleLease`] if the fence is already higher (a newer holder registered
    /// first). Without, issue the next token (one above the fence) and raise the fence to it.
    async fn fence(&self, key: &IsolationKey, granted: Option<u64>) -> Result<u64>;

    /// Save `state_json` under `key`. Refused ([`Error::StaleLease`]) when `fence` is below the
    /// key's fence, or absent while the key has one.
    async fn save(&self, key: &IsolationKey, state_json: &str, fence: Option<u64>) -> Result<()>;

    /// Remove the state under `key` (its fence stays), under the same fencing rule as
    /// [`save`](Self::save); a missing state is not an error.
    async fn delete(&self, key: &IsolationKey, fence: Option<u64>) -> Result<()>;

    /// The keys holding a state whose key string starts with `prefix` (`""` for all), in no
    /// particular order.
    async fn list(&self, prefix: &str) -> Result<Vec<IsolationKey>>;

    /// Who can see the same states: [`Reach::Process`] (memory), [`Reach::Host`] (files),
    /// [`Reach::Cluster`] (a shared service).
    fn reach(&self) -> Reach;
}

#[derive(Debug, Clone, Default, Serialize, Deserialize)]
struct Slot {
    #[serde(default)]
    fence: Option<u64>,
    state: Option<String>,
}

impl Slot {
    fn check(&self, key: &IsolationKey, fence: Option<u64>) -> Result<()> {
        match (self.fence, fence) {
            (Some(current), token) if token.is_none_or(|t| t < current) => Err(Error::StaleLease {
                key: key.to_string(),
                token: token.unwrap_or(0),
                current,
            }),
            _ => Ok(()),
        }
    }

    fn register(&mut self, key: &IsolationKey, granted: Option<u64>) -> Result<u64> {
        let current = self.fence.unwrap_or(0);
        let token = match granted {
            Some(t) if t < current => {
                return Err(Error::StaleLease {
                    key: key.to_string(),
                    token: t,
                    current,
                });
            }
            Some(t) => t,
            None => current + 1,
        };
        self.fence = Some(token);
        Ok(token)
    }
}

/// State in process memory: for tests and single-process use.
#[derive(Debug, Default)]
pub struct MemoryStateStore {
    slots: Mutex<HashMap<IsolationKey, Slot>>,
}

impl MemoryStateStore {
    /// An empty store.
    pub fn new() -> Self {
        Self::default()
    }
}

#[async_trait]
impl StateStore for MemoryStateStore {
    async fn load(&self, key: &IsolationKey) -> Result<Option<String>> {
        Ok(self
            .slots
            .lock()
            .expect("state lock")
            .get(key)
            .and_then(|s| s.state.clone()))
    }

    async fn fence(&self, key: &IsolationKey, granted: Option<u64>) -> Result<u64> {
        let mut slots = self.slots.lock().expect("state lock");
        slots.entry(key.clone()).or_default().register(key, granted)
    }

    async fn save(&self, key: &IsolationKey, state_json: &str, fence: Option<u64>) -> Result<()> {
        let mut slots = self.slots.lock().expect("state lock");
        let slot = slots.entry(key.clone()).or_default();
        slot.check(key, fence)?;
        slot.state = Some(state_json.to_owned());
        Ok(())
    }

    async fn delete(&self, key: &IsolationKey, fence: Option<u64>) -> Result<()> {
        if let Some(slot) = self.slots.lock().expect("state lock").get_mut(key) {
            slot.check(key, fence)?;
            slot.state = None; // the fence survives deletion
        }
        Ok(())
    }

    async fn list(&self, prefix: &str) -> Result<Vec<IsolationKey>> {
        Ok(self
            .slots
            .lock()
            .expect("state lock")
            .iter()
            .filter(|(k, slot)| slot.state.is_some() && k.as_str().starts_with(prefix))
            .map(|(k, _)| k.clone())
            .collect())
    }

    fn reach(&self) -> Reach {
        Reach::Process
    }
}

/// State as one JSON file per key under a directory, written atomically (temporary file,
/// rename) under an exclusive `flock`, so several processes on one host can share it. A save
/// is durable when it returns (file and directory fsynced); a save of the state already
/// stored writes nothing; a fence registration fsyncs only over a slot holding a state.
#[derive(Debug, Clone)]
pub struct FileStateStore {
    dir: PathBuf,
}

impl FileStateStore {
    /// A store under `dir` (created on first save).
    pub fn new(dir: impl Into<PathBuf>) -> Self {
        FileStateStore { dir: dir.into() }
    }

    fn path_of(&self, key: &IsolationKey) -> PathBuf {
        // Key components are percent-encoded and never start with `.`, so this stays under dir.
        self.dir.join(format!("{}.json", key.as_str()))
    }

    fn blocking<T: Send + 'static>(
        &self,
        key: &IsolationKey,
        f: impl FnOnce(&Path, &IsolationKey) -> Result<T> + Send + 'static,
    ) -> impl std::future::Future<Output = Result<T>> {
        let path = self.path_of(key);
        let key = key.clone();
        async move {
            tokio::task::spawn_blocking(move || f(&path, &key))
                .await
                .map_err(|e| Error::backend("file-state", "state store", e.to_string()))?
        }
    }
}

/// The slot at `path`. An empty file is an empty slot: only a write that was not fsynced can
/// leave one after a crash, and such writes are only made over slots holding no state (see
/// [`FileStateStore::fence`]).
fn read_slot(path: &Path) -> Result<Slot> {
    match std::fs::read(path) {
        Ok(bytes) if bytes.is_empty() => Ok(Slot::default()),
        Ok(bytes) => serde_json::from_slice(&bytes).map_err(|e| Error::MalformedState {
            reason: format!("state file {}: {e}", path.display()),
        }),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(Slot::default()),
        Err(e) => Err(Error::io(path, e)),
    }
}

/// Run `f` under the key's exclusive `flock`. The key's directory is created (durably: a saved
/// state must be found after a crash) only when the lock file cannot be opened for its absence.
fn with_lock<T>(path: &Path, f: impl FnOnce() -> Result<T>) -> Result<T> {
    let parent = path.parent().expect("state paths have a parent");
    let lock_path = path.with_extension("json.lock");
    let file = crate::durable::in_dir(parent, true, || {
        std::fs::OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(&lock_path)
    })
    .map_err(|e| Error::io(&lock_path, e))?;
    let _lock = nix::fcntl::Flock::lock(file, nix::fcntl::FlockArg::LockExclusive)
        .map_err(|(_, e)| Error::io(&lock_path, e.into()))?;
    f()
}

fn write_slot(path: &Path, slot: &Slot, sync: crate::durable::Sync) -> Result<()> {
    let bytes = serde_json::to_vec(slot).expect("slot serializes");
    crate::durable::replace(path, &bytes, sync).map_err(|e| Error::io(path, e))
}

#[async_trait]
impl StateStore for FileStateStore {
    async fn load(&self, key: &IsolationKey) -> Result<Option<String>> {
        self.blocking(key, |path, _| Ok(read_slot(path)?.state))
            .await
    }

    async fn fence(&self, key: &IsolationKey, granted: Option<u64>) -> Result<u64> {
        self.blocking(key, move |path, key| {
            with_lock(path, || {
                let mut slot = read_slot(path)?;
                let token = slot.register(key, granted)?;
                // The fence only matters while its holder lives (a crash ends every holder of
                // this host, and the next token exceeds it anyway), so its rename need not be
                // durable. But over a slot holding a state the data is fsynced first: the
                // rename must never put an empty file in place of a saved state.
                let sync = match slot.state {
                    Some(_) => crate::durable::Sync::File,
                    None => crate::durable::Sync::Nothing,
                };
                write_slot(path, &slot, sync)?;
                Ok(token)
            })
        })
        .await
    }

    async fn save(&self, key: &IsolationKey, state_json: &str, fence: Option<u64>) -> Result<()> {
        let state_json = state_json.to_owned();
        self.blocking(key, move |path, key| {
            with_lock(path, || {
                let mut slot = read_slot(path)?;
                slot.check(key, fence)?;
                if slot.state.as_deref() == Some(state_json.as_str()) {
                    // Already there, and durable: the write that put it there was fsynced
                    // (file and directory), and a later fence write kept it, fsynced too.
                    return Ok(());
                }
                slot.state = Some(state_json);
                write_slot(path, &slot, crate::durable::Sync::FileAndDir)
            })
        })
        .await
    }

    async fn delete(&self, key: &IsolationKey, fence: Option<u64>) -> Result<()> {
        self.blocking(key, move |path, key| {
            if !path.exists() {
                return Ok(());
            }
            with_lock(path, || {
                let mut slot = read_slot(path)?;
                slot.check(key, fence)?;
                slot.state = None;
                write_slot(path, &slot, crate::durable::Sync::FileAndDir)
            })
        })
        .await
    }

    async fn list(&self, prefix: &str) -> Result<Vec<IsolationKey>> {
        let dir = self.dir.clone();
        let prefix = prefix.to_owned();
        tokio::task::spawn_blocking(move || {
            let mut out = Vec::new();
            list_dir(&dir, &dir, &prefix, &mut out)?;
            Ok(out)
        })
        .await
        .map_err(|e| Error::backend("file-state", "state store", e.to_string()))?
    }

    fn reach(&self) -> Reach {
        Reach::Host
    }
}

/// Collect the keys of state files under `dir` that hold a state.
fn list_dir(root: &Path, dir: &Path, prefix: &str, out: &mut Vec<IsolationKey>) -> Result<()> {
    let entries = match std::fs::read_dir(dir) {
        Ok(e) => e,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(Error::io(dir, e)),
    };
    for entry in entries {
        let entry = entry.map_err(|e| Error::io(dir, e))?;
        let path = entry.path();
        let ft = entry.file_type().map_err(|e| Error::io(&path, e))?;
        if ft.is_dir() {
            list_dir(root, &path, prefix, out)?;
            continue;
        }
        let Some(rel) = path
            .strip_prefix(root)
            .ok()
            .and_then(|r| r.to_str())
            .and_then(|r| r.strip_suffix(".json"))
        else {
            continue;
        };
        if !rel.starts_with(prefix) {
            continue;
        }
        let Ok(key) = IsolationKey::parse(rel) else {
            continue; // not a state file of ours
        };
        if read_slot(&path)?.state.is_some() {
            out.push(key);
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;
    use crate::testkit::states::{self, key};

    #[tokio::test]
    async fn memory_store() {
        let store = MemoryStateStore::new();
        states::contract(&store).await;
        states::shared_between(&store, &store).await;
        let store: Arc<dyn StateStore> = Arc::new(store);
        states::concurrent_registrations(&[store]).await;
    }

    #[tokio::test]
    async fn file_store() {
        let dir = tempfile::tempdir().unwrap();
        states::contract(&FileStateStore::new(dir.path())).await;
        // A second instance sees the same data (another process, another replica on the host).
        let other = FileStateStore::new(dir.path());
        assert_eq!(
            other.load(&key("bob")).await.unwrap().as_deref(),
            Some("{\"v\":9}")
        );
        states::shared_between(&FileStateStore::new(dir.path()), &other).await;
        let instances: Vec<Arc<dyn StateStore>> = (0..3)
            .map(|_| Arc::new(FileStateStore::new(dir.path())) as Arc<dyn StateStore>)
            .collect();
        states::concurrent_registrations(&instances).await;
    }

    /// A save of the state already stored writes nothing (the file keeps its inode: a write
    /// would rename a new file over it), and a changed one is written.
    #[tokio::test]
    async fn file_store_skips_saving_an_unchanged_state() {
        use std::os::unix::fs::MetadataExt as _;
        let dir = tempfile::tempdir().unwrap();
        let store = FileStateStore::new(dir.path());
        let k = key("dave");
        let token = store.fence(&k, Some(7)).await.unwrap();
        store.save(&k, "{\"a\":1}", Some(token)).await.unwrap();
        let inode = || std::fs::metadata(store.path_of(&k)).unwrap().ino();
        let before = inode();
        store.save(&k, "{\"a\":1}", Some(token)).await.unwrap();
        assert_eq!(inode(), before, "an unchanged state was written again");
        // Still fenced: a stale holder is refused even when its state is the stored one.
        assert!(matches!(
            store.save(&k, "{\"a\":1}", Some(6)).await,
            Err(Error::StaleLease { .. })
        ));
        store.save(&k, "{\"a\":2}", Some(token)).await.unwrap();
        assert_ne!(inode(), before);
        assert_eq!(store.load(&k).await.unwrap().as_deref(), Some("{\"a\":2}"));
    }

    /// Fence writes over a slot without a state are not fsynced, so a crash may leave the file
    /// empty: that is an empty slot, not damage.
    #[tokio::test]
    async fn file_store_reads_an_empty_file_as_an_empty_slot() {
        let dir = tempfile::tempdir().unwrap();
        let store = FileStateStore::new(dir.path());
        let k = key("erin");
        store.fence(&k, Some(3)).await.unwrap();
        std::fs::write(store.path_of(&k), "").unwrap();
        assert_eq!(store.load(&k).await.unwrap(), None);
        assert_eq!(store.fence(&k, Some(4)).await.unwrap(), 4);
    }

    #[tokio::test]
    async fn file_store_reports_damage() {
        let dir = tempfile::tempdir().unwrap();
        let store = FileStateStore::new(dir.path());
        let k = key("carol");
        store.save(&k, "{}", None).await.unwrap();
        std::fs::write(store.path_of(&k), "{not json").unwrap();
        assert!(matches!(
            store.load(&k).await.unwrap_err(),
            Error::MalformedState { .. }
        ));
    }
}
