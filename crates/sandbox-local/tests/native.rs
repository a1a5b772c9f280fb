//! Core's native snapshot format on a real box: the local backend wrapped by the testkit's
//! `NativePlatform` (whose "platform" holds whole-workspace tars). The manifest in the store
//! records only the platform's reference; restore asks the platform; retention deletes the
//! platform snapshots it retires, and keeps a manifest whose platform snapshot could not be
//! deleted.

use std::sync::Arc;

use sandbox_core::archive::ArchivePolicy;
use sandbox_core::snapshot::{
    self, Manifest, SnapshotFormat, SnapshotStore as _, SnapshotStoreExt as _,
};
use sandbox_core::testkit::native::NativePlatform;
use sandbox_core::{
    CallContext, Error, ExecRequest, LocalDirSnapshotStore, Persistence, SandboxConfig,
    SandboxManager, SnapshotSpec, StartBranch, WorkspaceSpec,
};
use sandbox_local::{LocalClient, LocalOptions};

fn local(dir: &std::path::Path) -> Arc<LocalClient> {
    Arc::new(LocalClient::new(
        LocalOptions::default()
            .base_dir(dir.join("boxes"))
            .persistence(Persistence::Ephemeral),
    ))
}

async fn call(manager: &SandboxManager, line: &str) -> (StartBranch, String) {
    let ctx = CallContext::new("agent").session("s1");
    let line = line.to_owned();
    let called = manager
        .call(&ctx, |sb| async move {
            sb.exec(ExecRequest::shell(line)).await.unwrap()
        })
        .await
        .unwrap();
    (
        called.report.start.unwrap().branch,
        called.value.stdout_str().into_owned(),
    )
}

async fn manifests(store: &LocalDirSnapshotStore) -> Vec<Manifest> {
    let mut out = Vec::new();
    for blob in store.list_all("snapshots/").await.unwrap() {
        let bytes = sandbox_core::stream::collect(store.get(&blob.key).await.unwrap(), 1 << 20)
            .await
            .unwrap();
        out.push(Manifest::read_from(&bytes[..], &ArchivePolicy::default()).unwrap());
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn native_snapshots_restore_through_the_platform_and_retention_deletes_them() {
    let dir = tempfile::tempdir().unwrap();
    let client = Arc::new(NativePlatform::new(local(dir.path())));
    let platform = client.platform();
    let store = Arc::new(LocalDirSnapshotStore::new(dir.path().join("snapshots")));
    let config = SandboxConfig::new(WorkspaceSpec::default()).snapshots(
        SnapshotSpec::new(store.clone())
            .format(SnapshotFormat::Native)
            .keep_last(1),
    );
    let manager = SandboxManager::builder(client.clone())
        .config(config)
        .build()
        .unwrap();

    let (branch, _) = call(&manager, "echo one > data.txt").await;
    assert_eq!(branch, StartBranch::Cold);
    let first = platform.references();
    assert_eq!(first.len(), 1, "one platform snapshot per stop");
    let m = manifests(&store).await;
    assert_eq!(m.len(), 1);
    let native = m[0].header.native.as_ref().expect("a native manifest");
    assert_eq!(native.reference, first[0]);
    assert_eq!(native.backend, "local");
    assert!(
        m[0].entries.is_empty(),
        "the platform holds the files, not the store"
    );

    // Ephemeral: the box is gone; the next call restores through the platform.
    let (branch, out) = call(&manager, "cat data.txt; echo two > data.txt").await;
    assert_eq!(branch, StartBranch::RestoreEphemeral);
    assert_eq!(out, "one\n");
    assert_eq!(platform.restores(), first);
    // keep_last(1): the first snapshot's manifest and its platform snapshot are gone.
    let now = platform.references();
    assert_eq!(now.len(), 1);
    assert_ne!(now, first);
    assert_eq!(manifests(&store).await.len(), 1);

    // The platform cannot delete: retention keeps the manifest that names the undeleted
    // snapshot (a later retention retries), and the call still succeeds.
    platform.fail_deletes(true);
    let (_, out) = call(&manager, "cat data.txt; echo three > data.txt").await;
    assert_eq!(out, "two\n");
    assert_eq!(platform.references().len(), 2);
    assert_eq!(
        manifests(&store).await.len(),
        2,
        "the manifest stays while its platform snapshot does"
    );
    platform.fail_deletes(false);
    let (_, out) = call(&manager, "cat data.txt").await;
    assert_eq!(out, "three\n");
    assert_eq!(platform.references().len(), 1, "retried and deleted");
    assert_eq!(manifests(&store).await.len(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn native_format_needs_a_backend_that_has_it() {
    let dir = tempfile::tempdir().unwrap();
    let config = SandboxConfig::new(WorkspaceSpec::default()).snapshots(
        SnapshotSpec::local_dir(dir.path().join("snapshots")).format(SnapshotFormat::Native),
    );
    let err = SandboxManager::builder(local(dir.path()))
        .config(config)
        .build()
        .expect_err("a backend without native snapshots is refused");
    assert!(
        matches!(
            err,
            Error::NotSupported {
                backend: "local",
                ..
            }
        ),
        "{err}"
    );
}

#[test]
fn native_manifests_are_checked_like_any_other() {
    let policy = ArchivePolicy::default();
    let header = |format: &str, entries: u64, native: &str| {
        format!(
            r#"{{"version":2,"id":"x","format":"{format}","started_ns":0,"entries":{entries}{native}}}"#
        )
    };
    let good = header(
        "native",
        0,
        r#","native":{"backend":"e2b","reference":"snap-1"}"#,
    );
    let m = Manifest::read_from(good.as_bytes(), &policy).unwrap();
    assert_eq!(m.header.native.unwrap().reference, "snap-1");
    for bad in [
        header("native", 0, ""), // no reference
        header("native", 0, r#","native":{"backend":"e2b","reference":""}"#), // empty
        header(
            "native",
            0,
            r#","native":{"backend":"e2b","reference":"a b"}"#,
        ), // not printable
        header(
            "tar",
            0,
            r#","native":{"backend":"e2b","reference":"snap-1"}"#,
        ), // not native
        header("native", 1, r#","native":{"backend":"e2b","reference":"snap-1"}"#) // entries
            + "\n{\"p\":\"f\",\"k\":\"dir\",\"m\":493}",
        header(
            "native",
            0,
            &format!(
                r#","native":{{"backend":"e2b","reference":"{}"}}"#,
                "x".repeat(2000)
            ),
        ),
    ] {
        let err = Manifest::read_from(bad.as_bytes(), &policy).unwrap_err();
        assert!(matches!(err, Error::UnsafeArchive { .. }), "{bad}: {err}");
    }
    let _ = snapshot::MANIFEST_VERSION;
}
