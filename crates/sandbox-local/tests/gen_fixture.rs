//! One-off generator of tests/fixtures/old-snapshots (run with the writer of commit 7281789).

use std::path::Path;
use std::sync::Arc;

use sandbox_core::snapshot::{self, Chunking, SnapshotFormat, TakeRequest};
use sandbox_core::{
    CallContext, CreateRequest, IsolationKey, IsolationScope, LocalDirSnapshotStore, Persistence,
    SandboxClient, SnapshotSpec, WorkspaceSpec,
};
use sandbox_local::{LocalClient, LocalOptions};

fn fill(n: usize, seed: u64) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let mut out = Vec::with_capacity(n + 8);
    while out.len() < n {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        out.extend_from_slice(&x.to_le_bytes());
    }
    out.truncate(n);
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore]
async fn generate() {
    let out = Path::new(&std::env::var("FIXTURE_OUT").unwrap()).to_owned();
    let work = tempfile::tempdir().unwrap();
    let client = LocalClient::new(
        LocalOptions::default()
            .base_dir(work.path().join("boxes"))
            .persistence(Persistence::Keep),
    );
    let key = IsolationKey::resolve(
        IsolationScope::Session,
        &CallContext::new("fixture").session("old"),
    )
    .unwrap();
    let handle = client
        .create(CreateRequest::new(&WorkspaceSpec::default(), Some(&key)))
        .await
        .unwrap();
    handle.boot().await.unwrap();
    let ws = Path::new(handle.workspace_root()).to_owned();
    std::fs::create_dir_all(ws.join("src/deep")).unwrap();
    std::fs::write(ws.join("README.md"), "old snapshot fixture\n").unwrap();
    std::fs::write(ws.join("src/a.txt"), "alpha\n").unwrap();
    std::fs::write(ws.join("src/deep/b.txt"), "bravo bravo\n").unwrap();
    std::fs::write(ws.join("empty"), "").unwrap();
    std::fs::write(ws.join("big.bin"), fill(90_000, 7)).unwrap();
    std::os::unix::fs::symlink("src/a.txt", ws.join("link")).unwrap();
    let mut chunking = Chunking::default();
    chunking.min = 2048;
    chunking.avg = 8192;
    chunking.max = 16384;
    let store = Arc::new(LocalDirSnapshotStore::new(out.join("store")));
    let chunked = SnapshotSpec::new(store.clone())
        .format(SnapshotFormat::Chunked)
        .chunking(chunking)
        .keep_last(0);
    let first = snapshot::take(&*handle, &chunked, TakeRequest::new(key.digest()))
        .await
        .unwrap();
    // An incremental child: one small file changed, one added, the rest referenced.
    std::fs::write(ws.join("src/a.txt"), "alpha changed\n").unwrap();
    std::fs::write(ws.join("src/c.txt"), "charlie\n").unwrap();
    let second = snapshot::take(
        &*handle,
        &chunked,
        TakeRequest::new(key.digest())
            .parent(Some((first.snapshot.clone(), first.manifest.clone()))),
    )
    .await
    .unwrap();
    assert!(!second.unchanged);
    let tar = SnapshotSpec::new(store.clone()).format(SnapshotFormat::Tar).keep_last(0);
    let tarred = snapshot::take(&*handle, &tar, TakeRequest::new(key.digest()))
        .await
        .unwrap();
    for (name, r) in [
        ("chunked-1", &first.snapshot),
        ("chunked-2", &second.snapshot),
        ("tar", &tarred.snapshot),
    ] {
        std::fs::write(
            out.join(format!("{name}.json")),
            serde_json::to_vec_pretty(r).unwrap(),
        )
        .unwrap();
    }
}
