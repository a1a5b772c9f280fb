//! `RedisStateStore` under the real call lifecycle: two replicas (two managers and clients
//! with guards of their own, one snapshot directory, one Redis) hand a user's workspace over
//! through the stored state; a holder fenced out by the other replica can no longer save.

use std::path::Path;
use std::sync::Arc;

use sandbox_core::{
    CallContext, Error, ExecRequest, InProcessGuard, IsolationKey, IsolationScope, Persistence,
    SandboxConfig, SandboxManager, SnapshotSpec, StartBranch, StateStore, WorkspaceSpec,
};
use sandbox_local::{LocalClient, LocalOptions};
use store_redis::{RedisOptions, RedisStateStore, testkit};

fn replica(root: &Path, states: Arc<RedisStateStore>) -> SandboxManager {
    let client = Arc::new(LocalClient::new(
        LocalOptions::default()
            // Ephemeral boxes are removed after each call: the next one restores.
            .base_dir(root.join("boxes"))
            .persistence(Persistence::Ephemeral),
    ));
    SandboxManager::builder(client)
        .state_store(states)
        // One guard per replica, as two processes would have.
        .guard(Arc::new(InProcessGuard::new()))
        .scope(IsolationScope::User)
        .config(
            SandboxConfig::new(WorkspaceSpec::default())
                .snapshots(SnapshotSpec::local_dir(root.join("snapshots"))),
        )
        .build()
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[cfg_attr(not(redis_tests), ignore = "needs Redis; run by cargo xtask test")]
async fn a_workspace_moves_between_replicas_through_redis() {
    let root = tempfile::tempdir().unwrap();
    let options: RedisOptions = testkit::options();
    let one = replica(
        root.path(),
        Arc::new(RedisStateStore::new(options.clone()).unwrap()),
    );
    let two = replica(
        root.path(),
        Arc::new(RedisStateStore::new(options.clone()).unwrap()),
    );
    let alice = CallContext::new("lifecycle").user("alice");

    let first = one
        .call(&alice, |sb| async move {
            sb.exec(ExecRequest::shell("echo tea > notes.txt")).await
        })
        .await
        .unwrap();
    assert!(first.value.unwrap().success());
    assert!(first.report.persisted);
    assert_eq!(first.report.start.unwrap().branch, StartBranch::Cold);

    let second = two
        .call(&alice, |sb| async move {
            sb.exec(ExecRequest::shell("cat notes.txt")).await
        })
        .await
        .unwrap();
    assert_eq!(second.value.unwrap().stdout_str(), "tea\n");
    assert_eq!(
        second.report.start.unwrap().branch,
        StartBranch::RestoreEphemeral,
        "the other replica restored the snapshot the stored state points at"
    );

    // Each call registered a holder: the first replica's token (1) is stale now.
    let states = RedisStateStore::new(options.clone()).unwrap();
    let key = IsolationKey::resolve(IsolationScope::User, &alice).unwrap();
    assert!(matches!(
        states.save(&key, "{}", Some(1)).await,
        Err(Error::StaleLease {
            token: 1,
            current: 2,
            ..
        })
    ));
    assert_eq!(states.list("").await.unwrap(), vec![key.clone()]);

    let deleted = one.delete(&alice).await.unwrap();
    assert!(deleted.state);
    assert_eq!(states.load(&key).await.unwrap(), None);
    testkit::purge(&options).await.unwrap();
}
