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
use std::io::Write as _;
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
/// fsync, rename) under an exclusive `flock`, so several processes on one host can share it.
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

fn read_slot(path: &Path) -> Result<Slot> {
    match std::fs::read(path) {
        Ok(bytes) => serde_json::from_slice(&bytes).map_err(|e| Error::MalformedState {
            reason: format!("state file {}: {e}", path.display()),
        }),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(Slot::default()),
        Err(e) => Err(Error::io(path, e)),
    }
}

fn with_lock<T>(path: &Path, f: impl FnOnce() -> Result<T>) -> Result<T> {
    let parent = path.parent().expect("state paths have a parent");
    std::fs::create_dir_all(parent).map_err(|e| Error::io(parent, e))?;
    let lock_path = path.with_extension("json.lock");
    let file = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(&lock_path)
        .map_err(|e| Error::io(&lock_path, e))?;
    let _lock = nix::fcntl::Flock::lock(file, nix::fcntl::FlockArg::LockExclusive)
        .map_err(|(_, e)| Error::io(&lock_path, e.into()))?;
    f()
}

fn write_atomic(path: &Path, bytes: &[u8]) -> Result<()> {
    let parent = path.parent().expect("state paths have a parent");
    let mut tmp = tempfile::NamedTempFile::new_in(parent).map_err(|e| Error::io(parent, e))?;
    tmp.write_all(bytes).map_err(|e| Error::io(tmp.path(), e))?;
    tmp.as_file()
        .sync_all()
        .map_err(|e| Error::io(tmp.path(), e))?;
    tmp.persist(path).map_err(|e| Error::io(path, e.error))?;
    if let Ok(dir) = std::fs::File::open(parent) {
        let _ = dir.sync_all();
    }
    Ok(())
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
                write_atomic(path, &serde_json::to_vec(&slot).expect("slot serializes"))?;
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
                slot.state = Some(state_json);
                write_atomic(path, &serde_json::to_vec(&slot).expect("slot serializes"))
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
                write_atomic(path, &serde_json::to_vec(&slot).expect("slot serializes"))
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
