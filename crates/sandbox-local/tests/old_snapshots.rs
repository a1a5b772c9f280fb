//! Snapshots written before packs (manifest version 1: chunk blobs, small-file bundles; and the
//! tar format) still restore, and a new snapshot on top of one carries its old references.
//! The fixture in `tests/fixtures/old-snapshots` was written by the writer of commit 7281789
//! (see its README).

use std::path::{Path, PathBuf};
use std::sync::Arc;

use sandbox_core::snapshot::{self, GcOptions, SnapshotFormat, SnapshotRef, TakeRequest};
use sandbox_core::{
    CallContext, CreateRequest, IsolationKey, IsolationScope, LocalDirSnapshotStore,
    MemoryStateStore, Persistence, SandboxClient, SnapshotSpec, WorkspaceSpec,
};
use sandbox_local::{LocalClient, LocalOptions};

fn fixture() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/old-snapshots")
}

/// The generator's pseudo-random bytes (xorshift).
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

fn copy_tree(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for e in std::fs::read_dir(from).unwrap() {
        let e = e.unwrap();
        let target = to.join(e.file_name());
        if e.file_type().unwrap().is_dir() {
            copy_tree(&e.path(), &target);
        } else {
            std::fs::copy(e.path(), target).unwrap();
        }
    }
}

fn reference(name: &str) -> SnapshotRef {
    serde_json::from_slice(&std::fs::read(fixture().join(format!("{name}.json"))).unwrap()).unwrap()
}

struct Setup {
    _dir: tempfile::TempDir,
    client: LocalClient,
    store: Arc<LocalDirSnapshotStore>,
}

fn setup() -> Setup {
    let dir = tempfile::tempdir().unwrap();
    // The fixture is never written to: every test works on a copy.
    copy_tree(&fixture().join("store"), &dir.path().join("store"));
    Setup {
        client: LocalClient::new(
            LocalOptions::default()
                .base_dir(dir.path().join("boxes"))
                .persistence(Persistence::Keep),
        ),
        store: Arc::new(LocalDirSnapshotStore::new(dir.path().join("store"))),
        _dir: dir,
    }
}

async fn fresh_box(s: &Setup, name: &str) -> Box<dyn sandbox_core::BoxHandle> {
    let key = IsolationKey::resolve(
        IsolationScope::Session,
        &CallContext::new("old").session(name),
    )
    .unwrap();
    let h = s
        .client
        .create(CreateRequest::new(&WorkspaceSpec::default(), Some(&key)))
        .await
        .unwrap();
    h.boot().await.unwrap();
    h
}

fn check_tree(ws: &Path, second: bool) {
    let read = |p: &str| std::fs::read(ws.join(p)).unwrap();
    assert_eq!(read("README.md"), b"old snapshot fixture\n");
    assert_eq!(
        read("src/a.txt"),
        if second {
            &b"alpha changed\n"[..]
        } else {
            b"alpha\n"
        }
    );
    assert_eq!(read("src/deep/b.txt"), b"bravo bravo\n");
    assert_eq!(read("empty"), b"");
    assert_eq!(read("big.bin"), fill(90_000, 7));
    assert_eq!(
        std::fs::read_link(ws.join("link")).unwrap(),
        Path::new("src/a.txt")
    );
    assert_eq!(ws.join("src/c.txt").exists(), second);
    if second {
        assert_eq!(read("src/c.txt"), b"charlie\n");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn version_1_chunked_and_tar_snapshots_restore() {
    let s = setup();
    for (name, format, second) in [
        ("chunked-1", SnapshotFormat::Chunked, false),
        ("chunked-2", SnapshotFormat::Chunked, true),
        ("tar", SnapshotFormat::Tar, true),
    ] {
        let r = reference(name);
        assert_eq!(r.format, format);
        let h = fresh_box(&s, name).await;
        let spec = SnapshotSpec::new(s.store.clone()).format(format);
        let m = snapshot::restore(&*h, &spec, &r, Vec::new(), false)
            .await
            .unwrap_or_else(|e| panic!("{name}: {e}"));
        assert_eq!(m.header.version, 1, "{name} is a version 1 manifest");
        check_tree(Path::new(h.workspace_root()), second);
    }
}

/// A new snapshot whose parent is an old one keeps the old chunk and bundle references for
/// what did not change, writes packs for the rest, and restores; GC keeps the old blobs it
/// still references.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn new_snapshots_on_an_old_parent_mix_both_and_survive_gc() {
    let s = setup();
    let parent = reference("chunked-2");
    let h = fresh_box(&s, "mixed").await;
    let spec = SnapshotSpec::new(s.store.clone())
        .format(SnapshotFormat::Chunked)
        .keep_last(0);
    let restored = snapshot::restore(&*h, &spec, &parent, Vec::new(), false)
        .await
        .unwrap();
    let baseline = snapshot::baseline_after_restore(&*h, &restored)
        .await
        .unwrap();
    let ws = PathBuf::from(h.workspace_root());
    std::fs::write(ws.join("src/deep/b.txt"), "bravo changed\n").unwrap();
    let took = snapshot::take(
        &*h,
        &spec,
        TakeRequest::new("mixed").parent(Some((parent.clone(), baseline))),
    )
    .await
    .unwrap();
    assert!(!took.unchanged);
    assert_eq!(took.files_hashed, 1, "only the changed file is read");
    let m = &took.manifest;
    assert_eq!(m.header.version, snapshot::MANIFEST_VERSION);
    let locations: Vec<_> = m
        .entries
        .iter()
        .flat_map(|e| &e.chunks)
        .map(|c| c.location)
        .collect();
    assert!(
        locations
            .iter()
            .any(|l| matches!(l, snapshot::ChunkLocation::Pack { .. }))
    );
    assert!(
        locations
            .iter()
            .any(|l| matches!(l, snapshot::ChunkLocation::Blob))
    );
    assert!(
        locations
            .iter()
            .any(|l| matches!(l, snapshot::ChunkLocation::Bundle { .. }))
    );

    // GC with no grace, keeping one snapshot per namespace: the old snapshots go, the old
    // blobs the new snapshot references stay.
    let report = snapshot::gc(
        &*s.store,
        &sandbox_core::archive::ArchivePolicy::default(),
        GcOptions::default()
            .keep_last(1)
            .grace(std::time::Duration::ZERO),
        &MemoryStateStore::new(),
    )
    .await
    .unwrap();
    assert_eq!(report.locations_missing, 0, "{report:?}");
    let h2 = fresh_box(&s, "mixed-restore").await;
    snapshot::restore(&*h2, &spec, &took.snapshot, Vec::new(), false)
        .await
        .unwrap();
    let ws2 = Path::new(h2.workspace_root());
    assert_eq!(
        std::fs::read(ws2.join("src/deep/b.txt")).unwrap(),
        b"bravo changed\n"
    );
    assert_eq!(std::fs::read(ws2.join("big.bin")).unwrap(), fill(90_000, 7));
    assert_eq!(std::fs::read(ws2.join("src/c.txt")).unwrap(), b"charlie\n");
}
