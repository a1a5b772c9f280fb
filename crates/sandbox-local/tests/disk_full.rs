//! A snapshot the local store cannot write — the disk refuses it: `RLIMIT_FSIZE` below the
//! pack's size, so a write past it fails with `EFBIG` in the store's blocking writer — fails
//! the stop with a typed I/O error, leaves no temporary file, saves nothing, and the previous
//! snapshot still restores. One test in a binary of its own: the limit is the process's.

use std::path::Path;
use std::sync::Arc;

use nix::sys::signal::{SigSet, Signal};
use rustix::process::{Resource, Rlimit, getrlimit, setrlimit};
use sandbox_core::snapshot::SnapshotFormat;
use sandbox_core::{
    Acquire, CallContext, Error, ExecRequest, FileStateStore, IsolationScope, Persistence,
    SandboxConfig, SandboxManager, SnapshotSpec, StartBranch, WorkspaceSpec,
};
use sandbox_local::{LocalClient, LocalOptions};

#[test]
fn a_write_the_disk_refuses_keeps_the_previous_snapshot() {
    // SIGXFSZ would kill the process at the refused write; blocked here, before the runtime's
    // threads exist (they inherit the mask), the write fails with EFBIG instead.
    let mut xfsz = SigSet::empty();
    xfsz.add(Signal::SIGXFSZ);
    xfsz.thread_block().unwrap();
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap()
        .block_on(disk_refuses_the_snapshot());
}

/// A replica with a box directory of its own, every snapshot in `dir/snapshots`.
fn replica(dir: &Path, host: &str) -> SandboxManager {
    SandboxManager::builder(Arc::new(LocalClient::new(
        LocalOptions::default()
            .base_dir(dir.join(host))
            .persistence(Persistence::Ephemeral),
    )))
    .state_store(Arc::new(FileStateStore::new(dir.join("states"))))
    .scope(IsolationScope::User)
    .config(
        SandboxConfig::new(WorkspaceSpec::default()).snapshots(
            SnapshotSpec::local_dir(dir.join("snapshots")).format(SnapshotFormat::Chunked),
        ),
    )
    .build()
    .unwrap()
}

fn temporaries(dir: &Path) -> Vec<String> {
    let mut found = Vec::new();
    for entry in std::fs::read_dir(dir).unwrap() {
        let entry = entry.unwrap();
        let name = entry.file_name().to_string_lossy().into_owned();
        if entry.file_type().unwrap().is_dir() {
            found.extend(temporaries(&entry.path()));
        } else if name.starts_with(".tmp-") {
            found.push(entry.path().display().to_string());
        }
    }
    found
}

async fn disk_refuses_the_snapshot() {
    let tmp = tempfile::tempdir().unwrap();
    let ctx = CallContext::new("disk-full").user("alice");
    let write = |v: &'static str| {
        ExecRequest::shell(format!(
            "echo {v} > v.txt && head -c 300000 /dev/urandom > big.bin"
        ))
    };
    let a = replica(tmp.path(), "host-a");
    a.call(&ctx, |sb| async move {
        assert!(sb.exec(write("v1")).await.unwrap().success());
    })
    .await
    .expect("the first call");

    let call = a.begin(&ctx, Acquire::Auto).await.unwrap();
    assert!(call.sandbox().exec(write("v2")).await.unwrap().success());
    // Only the stop runs under the limit (a command of the box would inherit it).
    let before = getrlimit(Resource::Fsize);
    setrlimit(
        Resource::Fsize,
        Rlimit {
            current: Some(64 * 1024),
            maximum: before.maximum,
        },
    )
    .unwrap();
    let stopped = call.finish().await;
    setrlimit(Resource::Fsize, before).unwrap();

    let err = stopped.expect_err("the disk refused the snapshot");
    match &err.error {
        Error::Io { source, .. } => assert_eq!(
            source.kind(),
            std::io::ErrorKind::FileTooLarge,
            "{}",
            err.error
        ),
        other => panic!("not a typed I/O error: {other}"),
    }
    assert!(!err.report.expect("a report").persisted);
    assert_eq!(
        temporaries(&tmp.path().join("snapshots")),
        Vec::<String>::new(),
        "no temporary left"
    );

    // Another replica restores the first call's snapshot.
    let b = replica(tmp.path(), "host-b");
    let seen = b
        .call(&ctx, |sb| async move {
            sb.exec(ExecRequest::shell("cat v.txt && wc -c < big.bin"))
                .await
                .unwrap()
                .stdout_str()
                .into_owned()
        })
        .await
        .expect("the previous snapshot restores");
    assert_eq!(seen.value, "v1\n300000\n");
    assert!(matches!(
        seen.report.start.map(|s| s.branch),
        Some(StartBranch::RestoreEphemeral)
    ));
}
