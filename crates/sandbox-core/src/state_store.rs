//! Where box state JSON lives between calls, keyed by [`IsolationKey`]: the [`StateStore`]
//! contract with in-memory and file-backed editions.
//!
//! Saves carry the writer's fencing token (from its guard lease). A store remembers the newest
//! token it has seen per key and refuses older ones with [`Error::StaleLease`], so a replica
//! whose lease expired can never overwrite what a newer holder wrote.

use std::collections::HashMap;
use std::fmt;
use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use async_trait::async_trait;
use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};
use crate::isolation::IsolationKey;

/// Persists box state JSON per isolation key.
#[async_trait]
pub trait StateStore: Send + Sync + fmt::Debug + 'static {
    /// The state JSON saved under `key`, if any.
    async fn load(&self, key: &IsolationKey) -> Result<Option<String>>;

    /// Save `state_json` under `key`. With `fence`, refuse ([`Error::StaleLease`]) when a save
    /// with a newer fencing token has already happened; record `fence` otherwise.
    async fn save(&self, key: &IsolationKey, state_json: &str, fence: Option<u64>) -> Result<()>;

    /// Remove the state under `key`; a missing key is not an error.
    async fn delete(&self, key: &IsolationKey) -> Result<()>;
}

#[derive(Debug, Clone, Default, Serialize, Deserialize)]
struct Slot {
    #[serde(default)]
    fence: Option<u64>,
    state: Option<String>,
}

fn check_fence(key: &IsolationKey, slot: &Slot, fence: Option<u64>) -> Result<()> {
    match (slot.fence, fence) {
        (Some(current), Some(token)) if token < current => Err(Error::StaleLease {
            key: key.to_string(),
            token,
            current,
        }),
        _ => Ok(()),
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

    async fn save(&self, key: &IsolationKey, state_json: &str, fence: Option<u64>) -> Result<()> {
        let mut slots = self.slots.lock().expect("state lock");
        let slot = slots.entry(key.clone()).or_default();
        check_fence(key, slot, fence)?;
        slot.fence = fence.or(slot.fence);
        slot.state = Some(state_json.to_owned());
        Ok(())
    }

    async fn delete(&self, key: &IsolationKey) -> Result<()> {
        if let Some(slot) = self.slots.lock().expect("state lock").get_mut(key) {
            slot.state = None; // the fence survives deletion
        }
        Ok(())
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

    async fn save(&self, key: &IsolationKey, state_json: &str, fence: Option<u64>) -> Result<()> {
        let state_json = state_json.to_owned();
        self.blocking(key, move |path, key| {
            with_lock(path, || {
                let mut slot = read_slot(path)?;
                check_fence(key, &slot, fence)?;
                slot.fence = fence.or(slot.fence);
                slot.state = Some(state_json);
                write_atomic(path, &serde_json::to_vec(&slot).expect("slot serializes"))
            })
        })
        .await
    }

    async fn delete(&self, key: &IsolationKey) -> Result<()> {
        self.blocking(key, |path, _| {
            if !path.exists() {
                return Ok(());
            }
            with_lock(path, || {
                let mut slot = read_slot(path)?;
                slot.state = None;
                write_atomic(path, &serde_json::to_vec(&slot).expect("slot serializes"))
            })
        })
        .await
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::isolation::{CallContext, IsolationScope};

    fn key(user: &str) -> IsolationKey {
        IsolationKey::resolve(IsolationScope::User, &CallContext::new("a").user(user)).unwrap()
    }

    async fn contract(store: &dyn StateStore) {
        let (alice, bob) = (key("alice"), key("bob"));
        assert_eq!(store.load(&alice).await.unwrap(), None);
        store.save(&alice, "{\"v\":1}", Some(5)).await.unwrap();
        store.save(&bob, "{\"v\":9}", None).await.unwrap();
        assert_eq!(
            store.load(&alice).await.unwrap().as_deref(),
            Some("{\"v\":1}")
        );
        let err = store.save(&alice, "{\"v\":0}", Some(4)).await.unwrap_err();
        assert!(
            matches!(
                err,
                Error::StaleLease {
                    token: 4,
                    current: 5,
                    ..
                }
            ),
            "{err}"
        );
        assert_eq!(
            store.load(&alice).await.unwrap().as_deref(),
            Some("{\"v\":1}"),
            "stale save lost nothing"
        );
        store.save(&alice, "{\"v\":2}", Some(6)).await.unwrap();
        store.delete(&alice).await.unwrap();
        assert_eq!(store.load(&alice).await.unwrap(), None);
        assert!(
            store.save(&alice, "{}", Some(5)).await.is_err(),
            "fence survives delete"
        );
        assert_eq!(
            store.load(&bob).await.unwrap().as_deref(),
            Some("{\"v\":9}")
        );
    }

    #[tokio::test]
    async fn memory_store() {
        contract(&MemoryStateStore::new()).await;
    }

    #[tokio::test]
    async fn file_store() {
        let dir = tempfile::tempdir().unwrap();
        contract(&FileStateStore::new(dir.path())).await;
        // A second instance sees the same data (another process, another replica on the host).
        let other = FileStateStore::new(dir.path());
        assert_eq!(
            other.load(&key("bob")).await.unwrap().as_deref(),
            Some("{\"v\":9}")
        );
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
