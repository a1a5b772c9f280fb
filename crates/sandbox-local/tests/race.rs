//! Path races in the box file primitives: while a separate process flips names and parent
//! directories between real entries and symlinks to an outside directory — in the workspace
//! and in a bind-mounted host directory — `read_file`, `write_file` and `remove` run in a loop.
//! Nothing may come from outside and nothing outside may change; the declared bind mount keeps
//! working.
//!
//! `SANDBOX_RACE_SECS` sets the duration (default 4 s); the counts are printed
//! (`cargo test -p sandbox-local --test race -- --nocapture`).

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use bytes::Bytes;
use sandbox_core::testkit::race::{self, Outside, Swapper};
use sandbox_core::{RelPath, Sandbox, SandboxConfig, WorkspaceSpec};
use sandbox_local::{LocalClient, LocalOptions};

#[derive(Default)]
struct Counts {
    operations: AtomicU64,
    outside_reads: AtomicU64,
    bound_reads: AtomicU64,
}

fn rel(p: &str) -> RelPath {
    RelPath::new(p).unwrap()
}

/// Drive the primitives over the arena at box path `a` until `until`.
async fn drive(sandbox: Arc<Sandbox>, a: &'static str, until: Instant, counts: Arc<Counts>) {
    let h = sandbox.handle();
    let data = Bytes::from_static(race::INSIDE.as_bytes());
    while Instant::now() < until {
        for name in ["f", "g", "d/f"] {
            counts.operations.fetch_add(1, Ordering::Relaxed);
            if let Ok(got) = h.read_file(&rel(&format!("{a}/{name}"))).await
                && race::leaked(&got)
            {
                counts.outside_reads.fetch_add(1, Ordering::Relaxed);
            }
        }
        for name in ["f", "g", "d/new", "d/victim"] {
            counts.operations.fetch_add(1, Ordering::Relaxed);
            let _ = h
                .write_file(&rel(&format!("{a}/{name}")), data.clone(), 0o644)
                .await;
        }
        counts.operations.fetch_add(1, Ordering::Relaxed);
        let _ = h.remove(&[rel(&format!("{a}/d/victim"))]).await;
        // The bind mount itself (no swapping at its top) stays reachable.
        counts.operations.fetch_add(1, Ordering::Relaxed);
        if let Ok(got) = h.read_file(&rel("mnt/stable.txt")).await
            && &got[..] == b"bound"
        {
            counts.bound_reads.fetch_add(1, Ordering::Relaxed);
        }
    }
}

fn canonical(p: &Path) -> PathBuf {
    std::fs::create_dir_all(p).unwrap();
    p.canonicalize().unwrap()
}

/// `read_file`, `write_file` and `remove` against a swapper in the workspace and in a
/// bind-mounted host directory.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn box_file_primitives_never_reach_outside_while_paths_are_swapped() {
    race::run_swapper_if_child();
    let tmp = tempfile::tempdir().unwrap();
    let base = canonical(tmp.path());
    let bound = canonical(&base.join("bound"));
    std::fs::write(bound.join("stable.txt"), "bound").unwrap();
    let outside = Outside::create(&base.join("outside")).unwrap();
    let client = LocalClient::new(LocalOptions::default().base_dir(base.join("boxes")));
    let spec = WorkspaceSpec::builder()
        .bind_mount("mnt", &bound, false)
        .build()
        .unwrap();
    let sandbox = Sandbox::create(&client, SandboxConfig::new(spec), None)
        .await
        .unwrap();
    sandbox.start().await.unwrap();
    let sandbox = Arc::new(sandbox);
    let root = PathBuf::from(sandbox.handle().workspace_root());
    let arenas = [root.join("w"), bound.join("b")];
    for arena in &arenas {
        race::make_arena(arena).unwrap();
    }
    let swapper = Swapper::spawn(
        "box_file_primitives_never_reach_outside_while_paths_are_swapped",
        &arenas,
        outside.dir(),
        &base,
    );
    let started = Instant::now();
    let until = started + race::duration();
    let counts = Arc::new(Counts::default());
    let tasks = [
        tokio::spawn(drive(sandbox.clone(), "w", until, counts.clone())),
        tokio::spawn(drive(sandbox.clone(), "mnt/b", until, counts.clone())),
    ];
    for t in tasks {
        t.await.unwrap();
    }
    let swaps = swapper.stop();
    let changes = outside.changes().unwrap();
    let bound_reads = counts.bound_reads.load(Ordering::Relaxed);
    println!("race box primitives: bind_mount_reads={bound_reads}");
    race::assert_clean(
        "box primitives",
        started.elapsed(),
        swaps,
        counts.operations.load(Ordering::Relaxed),
        counts.outside_reads.load(Ordering::Relaxed),
        &changes,
    );
    assert!(bound_reads > 0, "the declared bind mount was not reachable");
}
