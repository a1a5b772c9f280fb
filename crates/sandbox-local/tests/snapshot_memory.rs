//! The chunked format's upload memory bound through a whole snapshot of a real box: on a store
//! that holds each put whole until it is sent (as S3 does for one `PUT`), the packs in flight
//! never hold more than `SnapshotSpec::upload_buffer` together, and the snapshot restores.

use std::sync::Arc;

use sandbox_core::snapshot::{self, SnapshotFormat, SnapshotStoreExt as _, TakeRequest};
use sandbox_core::testkit::blobs::pattern;
use sandbox_core::testkit::{CountingStore, holds_whole_puts};
use sandbox_core::{
    CallContext, CreateRequest, IsolationKey, IsolationScope, LocalDirSnapshotStore, Persistence,
    SandboxClient, SnapshotSpec, SnapshotStore, WorkspaceSpec,
};
use sandbox_local::{LocalClient, LocalOptions};

const MIB: u64 = 1024 * 1024;

async fn booted(client: &LocalClient, name: &str) -> Box<dyn sandbox_core::BoxHandle> {
    let key = IsolationKey::resolve(
        IsolationScope::Session,
        &CallContext::new("memory").session(name),
    )
    .unwrap();
    let h = client
        .create(CreateRequest::new(&WorkspaceSpec::default(), Some(&key)))
        .await
        .unwrap();
    h.boot().await.unwrap();
    h
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_large_snapshot_holds_at_most_the_upload_buffer() {
    let dir = tempfile::tempdir().unwrap();
    let client = LocalClient::new(
        LocalOptions::default()
            .base_dir(dir.path().join("boxes"))
            .persistence(Persistence::Keep),
    );
    let local: Arc<dyn SnapshotStore> =
        Arc::new(LocalDirSnapshotStore::new(dir.path().join("store")));
    // The store would hold up to 16 MiB of a put: packs of 2 MiB are held whole.
    let counting = Arc::new(CountingStore::new(Arc::new(holds_whole_puts(
        local.clone(),
        16 * MIB,
    ))));
    let (pack_size, budget) = (2 * MIB, 3 * MIB);
    let spec = SnapshotSpec::new(counting.clone())
        .format(SnapshotFormat::Chunked)
        .pack_size(pack_size)
        .upload_buffer(budget)
        .keep_last(0);

    let h = booted(&client, "source").await;
    let ws = std::path::PathBuf::from(h.workspace_root());
    std::fs::create_dir_all(&ws).unwrap();
    // 24 MiB: a dozen packs, of files large and small.
    for i in 0..5u64 {
        std::fs::write(ws.join(format!("large-{i}.bin")), pattern(i + 1, 4 << 20)).unwrap();
    }
    for i in 0..256u64 {
        std::fs::write(
            ws.join(format!("small-{i}.bin")),
            pattern(i + 100, 16 << 10),
        )
        .unwrap();
    }
    let took = snapshot::take(&*h, &spec, TakeRequest::new("memory"))
        .await
        .unwrap();

    let held = counting.counts().max_put_bytes_in_flight;
    assert!(
        held <= budget,
        "the puts in flight held {held} B at once, over the {budget} B budget"
    );
    assert!(
        held >= MIB,
        "a whole pack was held ({held} B): the store buffers"
    );
    let packs = local.list_all("packs/").await.unwrap();
    assert!(packs.len() >= 12, "{} packs", packs.len());
    assert!(packs.iter().all(|p| p.size <= pack_size), "{packs:?}");

    // What was written restores whole.
    let other = booted(&client, "restored").await;
    snapshot::restore(&*other, &spec, &took.snapshot, Vec::new(), false)
        .await
        .unwrap();
    let restored = std::path::PathBuf::from(other.workspace_root());
    for i in [0u64, 4] {
        let name = format!("large-{i}.bin");
        assert_eq!(
            std::fs::read(restored.join(&name)).unwrap(),
            pattern(i + 1, 4 << 20),
            "{name}"
        );
    }
    assert_eq!(
        std::fs::read(restored.join("small-255.bin")).unwrap(),
        pattern(355, 16 << 10)
    );
}
