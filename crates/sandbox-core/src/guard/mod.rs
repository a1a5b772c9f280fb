//! Mutual exclusion per isolation key across a call: [`SandboxExecutionGuard`] and its
//! [`Lease`], with no-op, in-process ([`InProcessGuard`]) and one-host ([`FileGuard`])
//! editions.
//!
//! A lease carries a **fencing token** that increases per key at every grant, and a **lost
//! signal** that fires when the guard learns the lease is gone (expired without renewal, taken
//! over). The manager registers the token with the state store before it reads the state
//! ([`crate::StateStore::fence`]), and the store refuses every later save with a lower token:
//! a holder that lost its lease cannot overwrite its successor, whatever the timing. A guard
//! that issues no tokens (no-op, in-process: their leases never expire) lets the store number
//! the holders at registration.

mod file;

use std::collections::HashMap;
use std::fmt;
use std::sync::{Arc, Mutex, OnceLock};

use async_trait::async_trait;
use tokio_util::sync::CancellationToken;

use crate::error::Result;
use crate::isolation::IsolationKey;
use crate::reach::Reach;

pub use file::{FileGuard, FileGuardOptions};

/// Serializes calls on one isolation key. `enter` waits until the key is free.
#[async_trait]
pub trait SandboxExecutionGuard: Send + Sync + fmt::Debug + 'static {
    /// Wait for exclusive use of `key`. A guard with a bounded wait fails with
    /// [`crate::Error::Timeout`].
    async fn enter(&self, key: &IsolationKey) -> Result<Lease>;

    /// Take `key` only if it is free right now; `Ok(None)` when someone holds it. (`gc` uses
    /// this to leave boxes in use alone.)
    async fn try_enter(&self, key: &IsolationKey) -> Result<Option<Lease>>;

    /// How far the exclusion reaches: [`Reach::None`] (no-op), [`Reach::Process`],
    /// [`Reach::Host`] or [`Reach::Cluster`].
    fn reach(&self) -> Reach;
}

/// The guard-specific part of a lease.
#[async_trait]
pub trait LeaseHandle: Send + Sync + fmt::Debug {
    /// Whether the holder itself can tell the lease is gone (e.g. it is past its expiry and no
    /// renewal succeeded). Guards also cancel the lease's lost signal when they find out.
    fn is_lost(&self) -> bool {
        false
    }

    /// Give the key back, waiting for the guard to confirm.
    async fn release(&mut self) -> Result<()>;

    /// Give the key back from `Drop`, without waiting: must not block for long or panic; a
    /// guard that needs network I/O spawns it.
    fn release_detached(&mut self);
}

/// Held exclusive use of a key. Released by [`Lease::release`], or on drop (also when the call
/// is cancelled).
pub struct Lease {
    key: IsolationKey,
    token: Option<u64>,
    lost: CancellationToken,
    handle: Option<Box<dyn LeaseHandle>>,
}

impl fmt::Debug for Lease {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Lease")
            .field("key", &self.key)
            .field("token", &self.token)
            .field("lost", &self.is_lost())
            .field("handle", &self.handle)
            .finish()
    }
}

impl Lease {
    /// A lease on `key` with fencing `token` (if the guard issues them), backed by `handle`.
    pub fn new(key: IsolationKey, token: Option<u64>, handle: Box<dyn LeaseHandle>) -> Self {
        Lease {
            key,
            token,
            lost: CancellationToken::new(),
            handle: Some(handle),
        }
    }

    /// Use `lost` as the lost signal (the guard keeps a clone and cancels it).
    pub fn with_lost_signal(mut self, lost: CancellationToken) -> Self {
        self.lost = lost;
        self
    }

    /// The leased key.
    pub fn key(&self) -> &IsolationKey {
        &self.key
    }

    /// The fencing token that the holder's saves carry.
    pub fn token(&self) -> Option<u64> {
        self.token
    }

    /// Adopt the token the state store issued at registration (guards without tokens).
    pub(crate) fn set_token(&mut self, token: u64) {
        self.token = Some(token);
    }

    /// Whether the lease is known to be lost: the holder must not write anything any more.
    pub fn is_lost(&self) -> bool {
        self.lost.is_cancelled() || self.handle.as_ref().is_some_and(|h| h.is_lost())
    }

    /// A signal that is cancelled when the guard learns the lease is lost.
    pub fn lost_signal(&self) -> CancellationToken {
        self.lost.clone()
    }

    /// Mark the lease lost (e.g. the state store reported a newer holder).
    pub(crate) fn mark_lost(&self) {
        self.lost.cancel();
    }

    /// Release now and wait for the guard to confirm. Idempotent through `Drop`.
    pub async fn release(mut self) -> Result<()> {
        match self.handle.take() {
            Some(mut h) => h.release().await,
            None => Ok(()),
        }
    }
}

impl Drop for Lease {
    fn drop(&mut self) {
        if let Some(mut h) = self.handle.take() {
            h.release_detached();
        }
    }
}

/// No mutual exclusion: every `enter` succeeds at once (the spec's `SandboxExecutionGuard.noop()`).
/// Two calls on one key then share one box: only for callers that serialize calls themselves.
#[derive(Debug, Default, Clone, Copy)]
pub struct NoopGuard;

#[derive(Debug)]
struct NoopLease;

#[async_trait]
impl LeaseHandle for NoopLease {
    async fn release(&mut self) -> Result<()> {
        Ok(())
    }
    fn release_detached(&mut self) {}
}

#[async_trait]
impl SandboxExecutionGuard for NoopGuard {
    async fn enter(&self, key: &IsolationKey) -> Result<Lease> {
        Ok(Lease::new(key.clone(), None, Box::new(NoopLease)))
    }

    async fn try_enter(&self, key: &IsolationKey) -> Result<Option<Lease>> {
        self.enter(key).await.map(Some)
    }

    fn reach(&self) -> Reach {
        Reach::None
    }
}

type Slots = Arc<Mutex<HashMap<IsolationKey, Arc<tokio::sync::Mutex<()>>>>>;

/// Per-key mutual exclusion within one process: the default guard. Waiters are served in
/// arrival order; entries for idle keys are dropped.
///
/// It issues no fencing tokens (its leases never expire, so grant order is registration
/// order): the state store numbers the holders. Managers that share
/// [`InProcessGuard::global`] (the builder's default) exclude each other.
#[derive(Debug, Default, Clone)]
pub struct InProcessGuard {
    slots: Slots,
}

impl InProcessGuard {
    /// A guard with no keys held, independent of every other.
    pub fn new() -> Self {
        Self::default()
    }

    /// The process-wide guard every manager uses unless told otherwise.
    pub fn global() -> InProcessGuard {
        static GLOBAL: OnceLock<InProcessGuard> = OnceLock::new();
        GLOBAL.get_or_init(InProcessGuard::new).clone()
    }

    /// Number of keys currently held or waited for.
    pub fn active_keys(&self) -> usize {
        self.slots.lock().expect("guard lock").len()
    }

    fn slot(&self, key: &IsolationKey) -> Arc<tokio::sync::Mutex<()>> {
        self.slots
            .lock()
            .expect("guard lock")
            .entry(key.clone())
            .or_default()
            .clone()
    }

    fn lease(&self, key: &IsolationKey, guard: tokio::sync::OwnedMutexGuard<()>) -> Lease {
        Lease::new(
            key.clone(),
            None,
            Box::new(InProcessLease {
                guard: Some(guard),
                key: key.clone(),
                slots: self.slots.clone(),
            }),
        )
    }

    fn forget_if_idle(slots: &Slots, key: &IsolationKey) {
        let mut slots = slots.lock().expect("guard lock");
        // The map holds one reference; any other is a holder or a waiter.
        if slots
            .get(key)
            .is_some_and(|slot| Arc::strong_count(slot) == 1)
        {
            slots.remove(key);
        }
    }
}

struct InProcessLease {
    guard: Option<tokio::sync::OwnedMutexGuard<()>>,
    key: IsolationKey,
    slots: Slots,
}

impl fmt::Debug for InProcessLease {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("InProcessLease")
            .field("key", &self.key)
            .finish()
    }
}

#[async_trait]
impl LeaseHandle for InProcessLease {
    async fn release(&mut self) -> Result<()> {
        self.release_detached();
        Ok(())
    }

    fn release_detached(&mut self) {
        let Some(guard) = self.guard.take() else {
            return;
        };
        drop(guard);
        InProcessGuard::forget_if_idle(&self.slots, &self.key);
    }
}

#[async_trait]
impl SandboxExecutionGuard for InProcessGuard {
    async fn enter(&self, key: &IsolationKey) -> Result<Lease> {
        let slot = self.slot(key);
        let guard = slot.lock_owned().await;
        Ok(self.lease(key, guard))
    }

    async fn try_enter(&self, key: &IsolationKey) -> Result<Option<Lease>> {
        let slot = self.slot(key);
        let lease = slot.try_lock_owned().ok().map(|g| self.lease(key, g));
        if lease.is_none() {
            InProcessGuard::forget_if_idle(&self.slots, key);
        }
        Ok(lease)
    }

    fn reach(&self) -> Reach {
        Reach::Process
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testkit::guards;

    #[tokio::test]
    async fn in_process_guard_passes_the_guard_suite() {
        // Instances of one guard are its clones (they share the slots).
        let guard = InProcessGuard::new();
        guards::suite(&move || Arc::new(guard.clone()) as Arc<dyn SandboxExecutionGuard>).await;
    }

    #[tokio::test]
    async fn the_global_guard_is_shared() {
        let k = guards::key("global-shared");
        let a = InProcessGuard::global().enter(&k).await.unwrap();
        assert!(
            InProcessGuard::global()
                .try_enter(&k)
                .await
                .unwrap()
                .is_none()
        );
        a.release().await.unwrap();
        assert!(
            InProcessGuard::global()
                .try_enter(&k)
                .await
                .unwrap()
                .is_some()
        );
    }
}
