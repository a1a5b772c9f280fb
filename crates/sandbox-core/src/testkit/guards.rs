//! The guard suite: what every [`SandboxExecutionGuard`] must do, run by each edition (in
//! process, one host, Redis) against its own instances.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use crate::guard::SandboxExecutionGuard;
use crate::isolation::{CallContext, IsolationKey, IsolationScope};

/// A key no other test uses.
pub fn key(name: &str) -> IsolationKey {
    let session = format!("{name}-{}", uuid::Uuid::new_v4().simple());
    IsolationKey::resolve(
        IsolationScope::Session,
        &CallContext::new("guard-suite").session(session),
    )
    .expect("a session key")
}

/// Run every scenario. `make` returns another instance of the guard under test, as another
/// process (or replica) would have it: instances must exclude each other.
pub async fn suite(make: &(dyn Fn() -> Arc<dyn SandboxExecutionGuard> + Sync)) {
    excludes_across_instances(make).await;
    keys_are_independent(make).await;
    tokens_increase_per_key(make).await;
    dropping_a_lease_frees_the_key(make).await;
    a_held_lease_stays_valid(make).await;
    contended_updates_lose_nothing(make).await;
}

async fn excludes_across_instances(make: &(dyn Fn() -> Arc<dyn SandboxExecutionGuard> + Sync)) {
    let (a, b) = (make(), make());
    let k = key("exclusion");
    let held = a.enter(&k).await.expect("enter");
    assert!(
        b.try_enter(&k).await.expect("try_enter").is_none(),
        "a held key is not free"
    );
    let k2 = k.clone();
    let waiter = tokio::spawn(async move { b.enter(&k2).await.expect("enter") });
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert!(
        !waiter.is_finished(),
        "a waiter waits while the key is held"
    );
    held.release().await.expect("release");
    let next = tokio::time::timeout(Duration::from_secs(10), waiter)
        .await
        .expect("the waiter gets the key after the release")
        .expect("join");
    next.release().await.expect("release");
}

async fn keys_are_independent(make: &(dyn Fn() -> Arc<dyn SandboxExecutionGuard> + Sync)) {
    let (a, b) = (make(), make());
    let one = a.enter(&key("one")).await.expect("enter");
    let two = tokio::time::timeout(Duration::from_secs(2), b.enter(&key("two")))
        .await
        .expect("another key is not blocked")
        .expect("enter");
    one.release().await.expect("release");
    two.release().await.expect("release");
}

async fn tokens_increase_per_key(make: &(dyn Fn() -> Arc<dyn SandboxExecutionGuard> + Sync)) {
    let k = key("tokens");
    let mut last = None;
    for _ in 0..4 {
        let lease = make().enter(&k).await.expect("enter");
        if let (Some(prev), Some(now)) = (last, lease.token()) {
            assert!(now > prev, "token {now} after {prev}");
        }
        last = lease.token();
        lease.release().await.expect("release");
    }
}

async fn dropping_a_lease_frees_the_key(
    make: &(dyn Fn() -> Arc<dyn SandboxExecutionGuard> + Sync),
) {
    let k = key("drop");
    drop(make().enter(&k).await.expect("enter"));
    // A guard may release a dropped lease in the background.
    let other = make();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        if let Some(lease) = other.try_enter(&k).await.expect("try_enter") {
            lease.release().await.expect("release");
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "a dropped lease was never freed"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

async fn a_held_lease_stays_valid(make: &(dyn Fn() -> Arc<dyn SandboxExecutionGuard> + Sync)) {
    let k = key("held");
    let lease = make().enter(&k).await.expect("enter");
    // Longer than the short TTLs the suite's callers configure: renewal must keep it.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert!(!lease.is_lost(), "a renewed lease is not lost");
    assert!(
        make().try_enter(&k).await.expect("try_enter").is_none(),
        "still held"
    );
    lease.release().await.expect("release");
}

async fn contended_updates_lose_nothing(
    make: &(dyn Fn() -> Arc<dyn SandboxExecutionGuard> + Sync),
) {
    let k = key("contended");
    let counter = Arc::new(AtomicU64::new(0));
    let mut tasks = Vec::new();
    for _ in 0..8 {
        let (guard, k, counter) = (make(), k.clone(), counter.clone());
        tasks.push(tokio::spawn(async move {
            let lease = guard.enter(&k).await.expect("enter");
            // A read-modify-write with a pause in the middle: only exclusion keeps it whole.
            let seen = counter.load(Ordering::SeqCst);
            tokio::time::sleep(Duration::from_millis(10)).await;
            counter.store(seen + 1, Ordering::SeqCst);
            lease.release().await.expect("release");
        }));
    }
    for t in tasks {
        tokio::time::timeout(Duration::from_secs(30), t)
            .await
            .expect("no waiter starves")
            .expect("join");
    }
    assert_eq!(counter.load(Ordering::SeqCst), 8);
}
