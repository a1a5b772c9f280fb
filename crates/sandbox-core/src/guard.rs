//! Mutual exclusion per isolation key across a call: [`SandboxExecutionGuard`] and its
//! [`Lease`], with a no-op and an in-process edition.

use std::collections::HashMap;
use std::fmt;
use std::sync::{Arc, Mutex};

use async_trait::async_trait;

use crate::error::Result;
use crate::isolation::IsolationKey;

/// Serializes calls on one isolation key. `enter` waits until the key is free.
#[async_trait]
pub trait SandboxExecutionGuard: Send + Sync + fmt::Debug + 'static {
    /// Wait for exclusive use of `key`; the lease releases it when dropped.
    async fn enter(&self, key: &IsolationKey) -> Result<Lease>;
}

/// The guard-specific part of a lease.
pub trait LeaseHandle: Send + Sync + fmt::Debug {
    /// The fencing token: strictly increasing per key across grants.
    fn token(&self) -> Option<u64>;
    /// Whether the lease was lost (expired or taken over) while held.
    fn is_lost(&self) -> bool {
        false
    }
    /// Give the key back. Must not block or panic; a guard that needs I/O spawns it.
    fn release(&mut self);
}

/// Held exclusive use of a key. Released on drop (also when the call is cancelled).
#[derive(Debug)]
pub struct Lease {
    key: IsolationKey,
    handle: Option<Box<dyn LeaseHandle>>,
}

impl Lease {
    /// A lease on `key` backed by `handle`.
    pub fn new(key: IsolationKey, handle: Box<dyn LeaseHandle>) -> Self {
        Lease {
            key,
            handle: Some(handle),
        }
    }

    /// The leased key.
    pub fn key(&self) -> &IsolationKey {
        &self.key
    }

    /// The fencing token, to be passed to [`crate::StateStore::save`].
    pub fn token(&self) -> Option<u64> {
        self.handle.as_ref().and_then(|h| h.token())
    }

    /// Whether the lease was lost while held: the holder must not write state.
    pub fn is_lost(&self) -> bool {
        self.handle.as_ref().is_some_and(|h| h.is_lost())
    }

    /// Release now (same as dropping). Idempotent.
    pub fn release(&mut self) {
        if let Some(mut h) = self.handle.take() {
            h.release();
        }
    }
}

impl Drop for Lease {
    fn drop(&mut self) {
        self.release();
    }
}

/// No mutual exclusion: every `enter` succeeds at once (the spec's `SandboxExecutionGuard.noop()`).
#[derive(Debug, Default, Clone, Copy)]
pub struct NoopGuard;

#[derive(Debug)]
struct NoopLease;

impl LeaseHandle for NoopLease {
    fn token(&self) -> Option<u64> {
        None
    }
    fn release(&mut self) {}
}

#[async_trait]
impl SandboxExecutionGuard for NoopGuard {
    async fn enter(&self, key: &IsolationKey) -> Result<Lease> {
        Ok(Lease::new(key.clone(), Box::new(NoopLease)))
    }
}

/// Per-key mutual exclusion within one process. Waiters are served in arrival order; entries
/// for idle keys are dropped.
///
/// It issues no fencing tokens: it cannot fence writers in other processes. Use a distributed
/// guard (Redis) when several replicas share a state store.
#[derive(Debug, Default, Clone)]
pub struct InProcessGuard {
    slots: Arc<Mutex<HashMap<IsolationKey, Arc<tokio::sync::Mutex<()>>>>>,
}

impl InProcessGuard {
    /// A guard with no keys held.
    pub fn new() -> Self {
        Self::default()
    }

    /// Number of keys currently held or waited for.
    pub fn active_keys(&self) -> usize {
        self.slots.lock().expect("guard lock").len()
    }
}

struct InProcessLease {
    guard: Option<tokio::sync::OwnedMutexGuard<()>>,
    key: IsolationKey,
    slots: Arc<Mutex<HashMap<IsolationKey, Arc<tokio::sync::Mutex<()>>>>>,
}

impl fmt::Debug for InProcessLease {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("InProcessLease")
            .field("key", &self.key)
            .finish()
    }
}

impl LeaseHandle for InProcessLease {
    fn token(&self) -> Option<u64> {
        None
    }

    fn release(&mut self) {
        let Some(guard) = self.guard.take() else {
            return;
        };
        let mut slots = self.slots.lock().expect("guard lock");
        drop(guard);
        // The map holds one reference; any other is a waiter (or a lease being granted).
        if slots
            .get(&self.key)
            .is_some_and(|slot| Arc::strong_count(slot) == 1)
        {
            slots.remove(&self.key);
        }
    }
}

#[async_trait]
impl SandboxExecutionGuard for InProcessGuard {
    async fn enter(&self, key: &IsolationKey) -> Result<Lease> {
        let slot = self
            .slots
            .lock()
            .expect("guard lock")
            .entry(key.clone())
            .or_default()
            .clone();
        let guard = slot.lock_owned().await;
        Ok(Lease::new(
            key.clone(),
            Box::new(InProcessLease {
                guard: Some(guard),
                key: key.clone(),
                slots: self.slots.clone(),
            }),
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::isolation::{CallContext, IsolationScope};
    use std::time::Duration;

    #[tokio::test]
    async fn serializes_per_key_and_forgets_idle_keys() {
        let guard = InProcessGuard::new();
        let k = IsolationKey::resolve(IsolationScope::Agent, &CallContext::new("a")).unwrap();
        let other = IsolationKey::resolve(IsolationScope::Agent, &CallContext::new("b")).unwrap();
        let first = guard.enter(&k).await.unwrap();
        // Another key is not blocked.
        let _o = tokio::time::timeout(Duration::from_secs(1), guard.enter(&other))
            .await
            .unwrap()
            .unwrap();
        // The same key waits.
        let g2 = guard.clone();
        let k2 = k.clone();
        let waiter = tokio::spawn(async move { g2.enter(&k2).await.unwrap() });
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert!(!waiter.is_finished());
        drop(first);
        let second = tokio::time::timeout(Duration::from_secs(1), waiter)
            .await
            .unwrap()
            .unwrap();
        drop(second);
        drop(_o);
        assert_eq!(guard.active_keys(), 0);
    }
}
