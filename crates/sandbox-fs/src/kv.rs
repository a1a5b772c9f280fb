//! The shared store of mode 1: [`KvStore`] (namespaced keys, integer versions,
//! compare-and-set) and its in-memory implementation.
//!
//! The shape maps directly onto Redis (crate `store-redis`, `RedisKvStore`): a namespace is a
//! hash tag, a version is an `INCR`-ed per-namespace counter stored beside the value, a
//! compare-and-set is one Lua script, and `list` is a `ZRANGEBYLEX` over the namespace's
//! sorted-set index that never leaves the namespace.

use std::collections::BTreeMap;
use std::fmt;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};

use async_trait::async_trait;
use bytes::Bytes;
use sandbox_core::{Error, Result};

/// A value's version: a positive integer that changes on every write of the key and is never
/// reused for that key (also across delete and re-create).
pub type Version = u64;

/// The condition a write is made under.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Precondition {
    /// Write whatever is there.
    Any,
    /// Only if the key does not exist.
    Absent,
    /// Only if the key exists at exactly this version.
    Version(Version),
}

/// A stored value and its version.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Versioned {
    /// The bytes.
    pub value: Bytes,
    /// Its version.
    pub version: Version,
}

impl Versioned {
    /// A value at `version` (for [`KvStore`] implementations).
    pub fn new(value: Bytes, version: Version) -> Self {
        Versioned { value, version }
    }
}

/// One key found by [`KvStore::list`].
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct KvEntry {
    /// The key within its namespace.
    pub key: String,
    /// Its version.
    pub version: Version,
    /// Size of the value in bytes.
    pub size: u64,
}

impl KvEntry {
    /// A listed key (for [`KvStore`] implementations).
    pub fn new(key: impl Into<String>, version: Version, size: u64) -> Self {
        KvEntry {
            key: key.into(),
            version,
            size,
        }
    }
}

/// A versioned key-value store with namespaces (the spec's `BaseStore`).
///
/// A failed precondition is [`Error::Conflict`]; callers retry by reading again.
#[async_trait]
pub trait KvStore: Send + Sync + fmt::Debug + 'static {
    /// The value at `key` in `namespace`.
    async fn get(&self, namespace: &str, key: &str) -> Result<Option<Versioned>>;

    /// Store `value` at `key` if `expected` holds; returns the new version.
    async fn put(
        &self,
        namespace: &str,
        key: &str,
        value: Bytes,
        expected: Precondition,
    ) -> Result<Version>;

    /// Remove `key` if `expected` holds ([`Precondition::Absent`] is refused). Returns whether
    /// something was removed.
    async fn delete(&self, namespace: &str, key: &str, expected: Precondition) -> Result<bool>;

    /// The keys of `namespace` starting with `prefix`, sorted. Scans only that namespace.
    async fn list(&self, namespace: &str, prefix: &str) -> Result<Vec<KvEntry>>;
}

/// [`KvStore`] in process memory, for tests and single-process use.
#[derive(Default)]
pub struct MemoryKvStore {
    namespaces: Mutex<BTreeMap<String, BTreeMap<String, Versioned>>>,
    next_version: AtomicU64,
    scanned: AtomicU64,
}

impl fmt::Debug for MemoryKvStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let ns = self.namespaces.lock().expect("kv lock").len();
        f.debug_struct("MemoryKvStore")
            .field("namespaces", &ns)
            .finish_non_exhaustive()
    }
}

impl MemoryKvStore {
    /// An empty store.
    pub fn new() -> Self {
        Self::default()
    }

    /// Keys visited by `list` calls so far (to check that listings are prefix scans).
    pub fn keys_scanned(&self) -> u64 {
        self.scanned.load(Ordering::Relaxed)
    }

    /// Every key in every namespace (for tests and debugging).
    pub fn dump(&self) -> Vec<(String, String)> {
        let map = self.namespaces.lock().expect("kv lock");
        map.iter()
            .flat_map(|(ns, keys)| keys.keys().map(move |k| (ns.clone(), k.clone())))
            .collect()
    }

    fn check(
        expected: Precondition,
        current: Option<&Versioned>,
        ns: &str,
        key: &str,
    ) -> Result<()> {
        let ok = match (expected, current) {
            (Precondition::Any, _) => true,
            (Precondition::Absent, None) => true,
            (Precondition::Version(v), Some(cur)) => cur.version == v,
            _ => false,
        };
        if ok {
            return Ok(());
        }
        Err(Error::Conflict {
            key: format!("{ns}/{key}"),
            reason: format!(
                "expected {expected:?}, found {}",
                current.map_or("no value".to_owned(), |c| format!("version {}", c.version))
            ),
        })
    }
}

#[async_trait]
impl KvStore for MemoryKvStore {
    async fn get(&self, namespace: &str, key: &str) -> Result<Option<Versioned>> {
        let map = self.namespaces.lock().expect("kv lock");
        Ok(map.get(namespace).and_then(|ns| ns.get(key)).cloned())
    }

    async fn put(
        &self,
        namespace: &str,
        key: &str,
        value: Bytes,
        expected: Precondition,
    ) -> Result<Version> {
        let mut map = self.namespaces.lock().expect("kv lock");
        let ns = map.entry(namespace.to_owned()).or_default();
        Self::check(expected, ns.get(key), namespace, key)?;
        let version = self.next_version.fetch_add(1, Ordering::Relaxed) + 1;
        ns.insert(key.to_owned(), Versioned { value, version });
        Ok(version)
    }

    async fn delete(&self, namespace: &str, key: &str, expected: Precondition) -> Result<bool> {
        if expected == Precondition::Absent {
            return Err(Error::invalid(
                "precondition",
                "delete cannot expect an absent key",
            ));
        }
        let mut map = self.namespaces.lock().expect("kv lock");
        let Some(ns) = map.get_mut(namespace) else {
            return Ok(false);
        };
        if expected != Precondition::Any {
            Self::check(expected, ns.get(key), namespace, key)?;
        }
        let removed = ns.remove(key).is_some();
        if ns.is_empty() {
            map.remove(namespace);
        }
        Ok(removed)
    }

    async fn list(&self, namespace: &str, prefix: &str) -> Result<Vec<KvEntry>> {
        let map = self.namespaces.lock().expect("kv lock");
        let Some(ns) = map.get(namespace) else {
            return Ok(Vec::new());
        };
        let mut out = Vec::new();
        for (key, v) in ns.range(prefix.to_owned()..) {
            self.scanned.fetch_add(1, Ordering::Relaxed);
            if !key.starts_with(prefix) {
                break;
            }
            out.push(KvEntry {
                key: key.clone(),
                version: v.version,
                size: v.value.len() as u64,
            });
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn compare_and_set() {
        let kv = MemoryKvStore::new();
        let v1 = kv
            .put("ns", "k", "a".into(), Precondition::Absent)
            .await
            .unwrap();
        assert!(
            kv.put("ns", "k", "b".into(), Precondition::Absent)
                .await
                .is_err()
        );
        let v2 = kv
            .put("ns", "k", "b".into(), Precondition::Version(v1))
            .await
            .unwrap();
        let err = kv
            .put("ns", "k", "c".into(), Precondition::Version(v1))
            .await
            .unwrap_err();
        assert_eq!(err.kind(), sandbox_core::ErrorKind::Conflict);
        assert!(v2 > v1);
        assert!(
            kv.delete("ns", "k", Precondition::Version(v1))
                .await
                .is_err()
        );
        assert!(
            kv.delete("ns", "k", Precondition::Version(v2))
                .await
                .unwrap()
        );
        let v3 = kv
            .put("ns", "k", "d".into(), Precondition::Absent)
            .await
            .unwrap();
        assert!(v3 > v2, "versions are never reused");
    }

    #[tokio::test]
    async fn list_is_a_prefix_scan_of_one_namespace() {
        let kv = MemoryKvStore::new();
        for i in 0..100 {
            kv.put("other", &format!("k{i}"), "x".into(), Precondition::Any)
                .await
                .unwrap();
            kv.put("ns", &format!("z{i}"), "x".into(), Precondition::Any)
                .await
                .unwrap();
        }
        kv.put("ns", "a/1", "x".into(), Precondition::Any)
            .await
            .unwrap();
        kv.put("ns", "a/2", "x".into(), Precondition::Any)
            .await
            .unwrap();
        let before = kv.keys_scanned();
        let keys: Vec<String> = kv
            .list("ns", "a/")
            .await
            .unwrap()
            .into_iter()
            .map(|e| e.key)
            .collect();
        assert_eq!(keys, ["a/1", "a/2"]);
        assert!(kv.keys_scanned() - before <= 3);
    }
}
