//! Crash leftovers are reclaimed: a process SIGKILLed at many points of a snapshot upload and
//! of a box removal leaves temporaries and half-removed boxes, and one `gc` (with a grace of
//! zero) leaves no temporary file, no unreferenced pack and no directory without its owner
//! marker.
//!
//! The killed process is this test binary again, run with `SANDBOX_LEFTOVERS_CHILD` naming
//! its role: it works in a loop until it is killed.

use std::io::{BufRead as _, BufReader, Write as _};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::Duration;

use sandbox_core::snapshot::{GcOptions, SnapshotFormat, SnapshotStore};
use sandbox_core::testkit::HookedStore;
use sandbox_core::{
    BoxGcOptions, CallContext, CreateRequest, ExecRequest, FileStateStore, IsolationScope,
    LocalDirSnapshotStore, Persistence, SandboxClient, SandboxConfig, SandboxManager, SnapshotSpec,
    WorkspaceSpec,
};
use sandbox_local::{LocalClient, LocalOptions};

const CHILD: &str = "SANDBOX_LEFTOVERS_CHILD";
const CHILD_DIR: &str = "SANDBOX_LEFTOVERS_DIR";
/// What a child prints (alone on a line) when it reaches the point the parent aims after.
const MARK: &str = "leftovers-child-mark";

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap()
}

fn client(dir: &Path) -> LocalClient {
    LocalClient::new(
        LocalOptions::default()
            .base_dir(dir.join("boxes"))
            .persistence(Persistence::Ephemeral),
    )
}

fn manager(dir: &Path) -> SandboxManager {
    manager_on(
        dir,
        Arc::new(LocalDirSnapshotStore::new(dir.join("snapshots"))),
    )
}

fn manager_on(dir: &Path, store: Arc<dyn SnapshotStore>) -> SandboxManager {
    SandboxManager::builder(Arc::new(client(dir)))
        .state_store(Arc::new(FileStateStore::new(dir.join("states"))))
        .scope(IsolationScope::Session)
        .config(
            SandboxConfig::new(WorkspaceSpec::default()).snapshots(
                SnapshotSpec::new(store)
                    .format(SnapshotFormat::Chunked)
                    // Small packs: an upload is many puts, so kills land in them.
                    .pack_size(256 * 1024),
            ),
        )
        .build()
        .unwrap()
}

fn mark() {
    let mut out = std::io::stdout().lock();
    writeln!(out, "\n{MARK}").unwrap();
    out.flush().unwrap();
}

/// The child's side, selected by the environment: never returns (killed by the parent).
fn child_role() {
    let Ok(role) = std::env::var(CHILD) else {
        return;
    };
    let dir = PathBuf::from(std::env::var(CHILD_DIR).unwrap());
    runtime().block_on(async move {
        match role.as_str() {
            "upload" => {
                // A mark as each pack's put starts: the parent aims its kill after one.
                let local = Arc::new(LocalDirSnapshotStore::new(dir.join("snapshots")));
                let store = HookedStore::new(local).on_put(|key, data| {
                    if key.as_str().starts_with("packs/") {
                        mark();
                    }
                    data
                });
                let m = manager_on(&dir, Arc::new(store));
                for i in 0u64.. {
                    let ctx = CallContext::new("crash").session(format!("s{}", i % 3));
                    m.call(&ctx, |sb| async move {
                        let r = sb
                            .exec(ExecRequest::shell(
                                "head -c 3000000 /dev/urandom > big.bin; echo x > small.txt",
                            ))
                            .await
                            .unwrap();
                        assert!(r.success());
                    })
                    .await
                    .unwrap();
                }
            }
            "remove" => {
                let client = client(&dir);
                let spec = WorkspaceSpec::default();
                loop {
                    let handle = client
                        .create(CreateRequest::new(&spec, None))
                        .await
                        .unwrap();
                    handle.boot().await.unwrap();
                    let root = PathBuf::from(handle.workspace_root());
                    for d in 0..20 {
                        let sub = root.join(format!("d{d}"));
                        std::fs::create_dir_all(&sub).unwrap();
                        for f in 0..100 {
                            std::fs::write(sub.join(format!("f{f}")), b"x").unwrap();
                        }
                    }
                    mark();
                    handle.destroy().await.unwrap();
                }
            }
            other => panic!("unknown child role {other}"),
        }
    });
    unreachable!("the child works until it is killed");
}

/// Run `test` of this binary as a child in `role`, and kill it `after` its `nth` mark.
fn kill_child(test: &str, role: &str, dir: &Path, nth: usize, after: Duration) {
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args(["--exact", test, "--nocapture", "--test-threads=1"])
        .env(CHILD, role)
        .env(CHILD_DIR, dir)
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let mut seen = 0;
    while seen < nth {
        match lines.next() {
            Some(Ok(line)) if line == MARK => seen += 1,
            Some(Ok(_)) => {}
            _ => panic!("the child ended before its mark: {:?}", child.wait()),
        }
    }
    std::thread::sleep(after);
    child.kill().unwrap(); // SIGKILL
    child.wait().unwrap();
}

/// Every file under `dir` whose name starts with `prefix`.
fn files_named(dir: &Path, prefix: &str) -> Vec<PathBuf> {
    let mut found = Vec::new();
    let Ok(entries) = std::fs::read_dir(dir) else {
        return found;
    };
    for entry in entries {
        let entry = entry.unwrap();
        let path = entry.path();
        if entry.file_type().unwrap().is_dir() {
            found.extend(files_named(&path, prefix));
        } else if entry.file_name().to_string_lossy().starts_with(prefix) {
            found.push(path);
        }
    }
    found
}

/// The entries of the boxes' base directory that are not a whole box (a directory with its
/// owner marker).
fn not_whole_boxes(dir: &Path) -> Vec<String> {
    let Ok(entries) = std::fs::read_dir(dir.join("boxes")) else {
        return Vec::new();
    };
    entries
        .map(|e| e.unwrap().path())
        .filter(|p| !p.join(".sandbox-box.json").is_file())
        .map(|p| p.display().to_string())
        .collect()
}

fn gc_everything(dir: &Path) -> sandbox_core::BoxGcReport {
    runtime().block_on(async {
        manager(dir)
            .gc(BoxGcOptions::default()
                .older_than(Duration::ZERO)
                .snapshots(GcOptions::default().grace(Duration::ZERO)))
            .await
            .unwrap()
    })
}

#[test]
fn killed_uploads_leave_nothing_after_gc() {
    child_role();
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    for k in 0..16u64 {
        // Kill points spread over the pack uploads of the first two snapshots (each a 3 MB
        // file in packs of 256 KiB, about a dozen): after the 1st to the 31st pack's put
        // started, 0 to 3 ms later. The later ones let a first snapshot complete.
        kill_child(
            "killed_uploads_leave_nothing_after_gc",
            "upload",
            dir,
            1 + 2 * k as usize,
            Duration::from_millis(k % 4),
        );
    }
    let left = files_named(&dir.join("snapshots"), ".tmp-");
    assert!(
        !left.is_empty(),
        "no kill landed inside an upload: the test proved nothing"
    );
    let report = gc_everything(dir);
    let snapshots = report.snapshots.clone().expect("snapshots collected");
    let after = files_named(&dir.join("snapshots"), ".tmp-");
    assert!(after.is_empty(), "temporaries left after gc: {after:?}");
    assert!(
        snapshots
            .leftovers
            .as_ref()
            .is_some_and(|l| l.removed >= left.len()),
        "{report:?}"
    );
    // Nothing unreferenced is left: a second collection finds nothing to delete.
    let again = gc_everything(dir);
    let s = again.snapshots.expect("snapshots collected");
    assert_eq!(
        (
            s.packs_deleted,
            s.packs_repacked,
            s.chunks_deleted,
            s.redirects_deleted
        ),
        (0, 0, 0, 0),
        "{s:?}"
    );
    assert!(
        s.packs_live > 0,
        "the completed snapshots' packs stay: {s:?}"
    );
    let boxes = not_whole_boxes(dir);
    assert!(boxes.is_empty(), "{boxes:?}");
}

#[test]
fn killed_box_removals_leave_nothing_after_gc() {
    child_role();
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    for k in 0..16u64 {
        // Kill points spread over the removal of a box of 2000 files, from its start.
        kill_child(
            "killed_box_removals_leave_nothing_after_gc",
            "remove",
            dir,
            1 + (k as usize % 2),
            Duration::from_micros(500 * k),
        );
    }
    assert!(
        !not_whole_boxes(dir).is_empty(),
        "no kill landed inside a removal: the test proved nothing"
    );
    let report = gc_everything(dir);
    let boxes = not_whole_boxes(dir);
    assert!(boxes.is_empty(), "left after gc: {boxes:?} ({report:?})");
    assert!(report.leftovers.removed > 0, "{report:?}");
    // What was whole (boxes the kills left with their marker) is gone too, as any old box.
    let entries: Vec<_> = std::fs::read_dir(dir.join("boxes")).unwrap().collect();
    assert!(entries.is_empty(), "{entries:?}");
}

/// Housekeeping without an operator: the background task collects leftovers on its own,
/// skips a run while another replica holds its key, and stops when the manager is dropped.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn housekeeping_collects_leftovers_one_replica_at_a_time() {
    use sandbox_core::SandboxExecutionGuard as _;
    use sandbox_core::housekeeping::housekeeping_key;
    use sandbox_core::{HousekeepingOptions, HousekeepingOutcome, InProcessGuard};

    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    // What killed processes leave: a temporary pack, and three kinds of box leftovers.
    let packs = dir.join("snapshots/packs/ab");
    std::fs::create_dir_all(&packs).unwrap();
    std::fs::write(packs.join(".tmp-4242-0-01ab.pack"), b"partial").unwrap();
    let boxes = dir.join("boxes");
    for name in [
        ".creating-0123456789abcdef",
        ".trash-0123456789abcdef",
        "b-6b3e2a3c-3c1e-4b8e-9d6f-1f2a3b4c5d6e",
    ] {
        std::fs::create_dir_all(boxes.join(name).join("workspace")).unwrap();
    }
    let guard = Arc::new(InProcessGuard::new());
    let m = SandboxManager::builder(Arc::new(client(dir)))
        .state_store(Arc::new(FileStateStore::new(dir.join("states"))))
        .guard(guard.clone())
        .config(
            SandboxConfig::new(WorkspaceSpec::default())
                .snapshots(SnapshotSpec::local_dir(dir.join("snapshots"))),
        )
        .housekeeping(
            HousekeepingOptions::default()
                .every(Duration::from_millis(50))
                .box_gc(BoxGcOptions::default().older_than(Duration::ZERO))
                .snapshots(Some(GcOptions::default().grace(Duration::ZERO))),
        )
        .build()
        .unwrap();
    let mut runs = m.housekeeping().expect("housekeeping is on");
    // Another replica holds the key: runs are skipped, nothing is removed.
    let held = guard
        .try_enter(&housekeeping_key("local"))
        .await
        .unwrap()
        .expect("free");
    let busy = next_run(&mut runs).await;
    assert_eq!(busy.outcome, HousekeepingOutcome::Busy, "{busy:?}");
    assert!(packs.join(".tmp-4242-0-01ab.pack").exists());
    drop(held);
    let done = loop {
        let run = next_run(&mut runs).await;
        if run.outcome != HousekeepingOutcome::Busy {
            break run;
        }
    };
    let HousekeepingOutcome::Done(report) = &done.outcome else {
        panic!("{done:?}");
    };
    assert_eq!(report.leftovers.removed, 3, "{report:?}");
    let store = report.snapshots.as_ref().and_then(|s| s.leftovers.clone());
    assert_eq!(store.map(|l| l.removed), Some(1), "{report:?}");
    assert!(!packs.join(".tmp-4242-0-01ab.pack").exists());
    assert_eq!(std::fs::read_dir(&boxes).unwrap().count(), 0);

    // The last handle dropped, the task stops: its channel closes.
    drop(m);
    tokio::time::timeout(Duration::from_secs(60), async {
        while runs.changed().await.is_ok() {}
    })
    .await
    .expect("the task stops once the manager is dropped");
}

async fn next_run(
    runs: &mut tokio::sync::watch::Receiver<Option<sandbox_core::HousekeepingRun>>,
) -> sandbox_core::HousekeepingRun {
    tokio::time::timeout(Duration::from_secs(60), runs.changed())
        .await
        .expect("a run within a minute")
        .expect("the task runs");
    runs.borrow_and_update().clone().expect("a run")
}
