//! The Redis guard under the manager (feature `redis`): two replicas — managers with clients
//! and guards (connections) of their own — share a state store and snapshots, and their
//! concurrent calls on one key run one at a time, each seeing the work of the one before.

#![cfg(all(feature = "redis", feature = "local"))]

use std::sync::Arc;
use std::time::Duration;

use sandbox_harness::local::{LocalClient, LocalOptions};
use sandbox_harness::redis_guard::{RedisGuard, RedisGuardOptions};
use sandbox_harness::{
    CallContext, ExecRequest, FileStateStore, Persistence, Reach, SandboxConfig,
    SandboxExecutionGuard as _, SandboxManager, SnapshotSpec, WorkspaceSpec,
};

async fn replica(dir: &std::path::Path, prefix: &str) -> SandboxManager {
    let url = std::env::var("SANDBOX_TEST_REDIS_URL").expect("SANDBOX_TEST_REDIS_URL");
    let guard = RedisGuard::connect(
        &url,
        RedisGuardOptions::new()
            .lease_ttl(Duration::from_secs(5))
            .retry_interval(Duration::from_millis(5))
            .max_retry_interval(Duration::from_millis(50))
            .key_prefix(prefix),
    )
    .await
    .expect("the test Redis");
    assert_eq!(guard.reach(), Reach::Cluster);
    let client = LocalClient::new(
        LocalOptions::default()
            // The local backend's states name a box under its base directory: shared here.
            .base_dir(dir.join("boxes"))
            .persistence(Persistence::Ephemeral),
    );
    SandboxManager::builder(Arc::new(client))
        .state_store(Arc::new(FileStateStore::new(dir.join("states"))))
        .guard(Arc::new(guard))
        .config(
            SandboxConfig::new(WorkspaceSpec::default())
                .snapshots(SnapshotSpec::local_dir(dir.join("snapshots"))),
        )
        .require_durable()
        .build()
        .expect("a durable set-up")
}

async fn sh(sb: &sandbox_harness::Sandbox, line: &str) -> String {
    let r = sb
        .exec(ExecRequest::shell(line).timeout(Duration::from_secs(30)))
        .await
        .expect("exec");
    assert!(r.success(), "`{line}`: {r:?}");
    r.stdout_str().into_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[cfg_attr(not(redis_tests), ignore = "needs Redis; run by cargo xtask test")]
async fn replicas_serialize_calls_on_one_key() {
    const CALLS: usize = 6;
    let dir = tempfile::tempdir().unwrap();
    let prefix = format!("test:{}:", uuid::Uuid::new_v4().simple());
    let sweep = Sweep(prefix.clone());
    let replicas = [
        replica(dir.path(), &prefix).await,
        replica(dir.path(), &prefix).await,
    ];
    let ctx = CallContext::new("counter").session("one-key");
    let mut calls = Vec::new();
    for i in 0..CALLS {
        let (m, ctx) = (replicas[i % 2].clone(), ctx.clone());
        calls.push(tokio::spawn(async move {
            m.call(&ctx, |sb| async move {
                // A read-modify-write with a pause: only the guard keeps it whole.
                let n: usize = sh(&sb, "cat n.txt 2>/dev/null || echo 0")
                    .await
                    .trim()
                    .parse()
                    .expect("a number");
                tokio::time::sleep(Duration::from_millis(30)).await;
                sh(&sb, &format!("echo {} > n.txt", n + 1)).await;
            })
            .await
            .expect("call")
        }));
    }
    for c in calls {
        c.await.expect("join");
    }
    let n = replicas[0]
        .call(&ctx, |sb| async move { sh(&sb, "cat n.txt").await })
        .await
        .expect("call")
        .value;
    assert_eq!(n.trim(), CALLS.to_string(), "an increment was lost");

    // The guard's keys: the lease is gone (released), the fence counter stays.
    let keys = sweep.keys();
    assert_eq!(keys.len(), 1, "one key was used: {keys:?}");
    assert!(keys[0].ends_with(":fence"), "{keys:?}");
}

/// Deletes the keys under a test's prefix when the test ends, passed or failed.
struct Sweep(String);

impl Sweep {
    fn con() -> redis::Connection {
        let url = std::env::var("SANDBOX_TEST_REDIS_URL").expect("SANDBOX_TEST_REDIS_URL");
        redis::Client::open(url)
            .and_then(|c| c.get_connection_with_timeout(Duration::from_secs(2)))
            .expect("the test Redis")
    }

    fn keys(&self) -> Vec<String> {
        redis::cmd("KEYS")
            .arg(format!("{}*", self.0))
            .query(&mut Sweep::con())
            .expect("KEYS")
    }
}

impl Drop for Sweep {
    fn drop(&mut self) {
        let keys = self.keys();
        if !keys.is_empty() {
            let _ = redis::cmd("DEL").arg(&keys).exec(&mut Sweep::con());
        }
    }
}
