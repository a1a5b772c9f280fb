//! Every enabled backend is linked: its state tag is registered, unique, and round-trips.

use std::collections::BTreeSet;

use sandbox_harness::{
    CreateRequest, SandboxClient, WorkspaceSpec, known_state_tags, state_from_json, state_to_json,
};

#[test]
fn enabled_backends_are_registered_and_unique() {
    let enabled = sandbox_harness::enabled_backends();
    assert!(
        !enabled.is_empty(),
        "the default build enables the local backend"
    );
    let known: BTreeSet<&str> = known_state_tags().iter().map(String::as_str).collect();
    assert_eq!(
        known.len(),
        known_state_tags().len(),
        "state tags are unique"
    );
    for tag in &enabled {
        assert!(
            known.contains(tag),
            "backend `{tag}` is enabled but its state type is not linked"
        );
    }
}

#[cfg(feature = "local")]
#[tokio::test]
async fn local_state_round_trips_through_the_facade() {
    let dir = tempfile::tempdir().unwrap();
    let client = sandbox_harness::local::LocalClient::new(
        sandbox_harness::local::LocalOptions::default().base_dir(dir.path()),
    );
    let spec = WorkspaceSpec::default();
    let handle = client
        .create(CreateRequest::new(&spec, None))
        .await
        .unwrap();
    let json = state_to_json(&*handle.state()).unwrap();
    let back = state_from_json(&json).unwrap();
    assert_eq!(back.typetag_name(), sandbox_harness::local::BACKEND);
    assert_eq!(state_to_json(&*back).unwrap(), json);
}

#[cfg(feature = "redis")]
#[test]
fn the_redis_state_store_reaches_many_hosts() {
    use sandbox_harness::redis_store::{RedisOptions, RedisStateStore};
    use sandbox_harness::{Reach, StateStore};
    // No server is needed to build it: it connects on first use.
    let store = RedisStateStore::new(RedisOptions::new("redis://127.0.0.1:6379")).unwrap();
    assert_eq!(store.reach(), Reach::Cluster);
}

#[cfg(all(feature = "s3", feature = "redis", feature = "local"))]
#[tokio::test]
async fn an_s3_snapshot_store_completes_a_distributed_set_up() {
    use std::sync::Arc;

    use sandbox_harness::s3::S3Config;
    use sandbox_harness::{Reach, SandboxManager, SnapshotStore, redis_distributed};
    // Neither needs a server to be built: both connect on first use.
    let s3 = S3Config::new("snapshots")
        .endpoint("http://127.0.0.1:9000")
        .region("us-east-1")
        .credentials("id", "secret")
        .allow_http(true)
        .build()
        .unwrap();
    assert_eq!(s3.reach(), Reach::Cluster);
    assert_eq!(s3.name(), "s3");
    let shared = redis_distributed("redis://127.0.0.1:6379")
        .unwrap()
        .snapshots(Arc::new(s3));
    let client = Arc::new(sandbox_harness::local::LocalClient::new(
        sandbox_harness::local::LocalOptions::default()
            .base_dir(tempfile::tempdir().unwrap().path()),
    ));
    // `distributed` implies `require_distributed`: build refuses a part that not every host
    // shares, so this proves the S3 store counts as shared.
    SandboxManager::builder(client)
        .distributed(shared)
        .build()
        .expect("an S3 snapshot store is shared by every host");
}
