//! Path races in the local mode: while a separate process flips names and parent directories
//! between real entries and symlinks to an outside directory, the agent tools read, write,
//! edit, list, glob and grep (and the filesystem deletes, moves and stats) in a loop. Nothing
//! may come from outside and nothing outside may change.
//!
//! `SANDBOX_RACE_SECS` sets the duration (default 4 s); the counts are printed
//! (`cargo test -p sandbox-fs --test race -- --nocapture`).

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use sandbox_core::testkit::race::{self, OUTSIDE_ONLY, Outside, Swapper};
use sandbox_fs::{Filesystem, LocalFs, LocalOptions, Tools};
use serde_json::json;

#[derive(Default)]
struct Counts {
    operations: AtomicU64,
    outside_reads: AtomicU64,
}

impl Counts {
    /// One operation whose visible result is `text`.
    fn saw(&self, what: &str, text: &str) {
        self.operations.fetch_add(1, Ordering::Relaxed);
        if race::leaked(text.as_bytes()) || text.contains(OUTSIDE_ONLY) {
            self.outside_reads.fetch_add(1, Ordering::Relaxed);
            eprintln!(
                "outside read by {what}: {}",
                text.lines().next().unwrap_or("")
            );
        }
    }

    fn did(&self) {
        self.operations.fetch_add(1, Ordering::Relaxed);
    }
}

/// One loop of every operation over the arena at view path `a`.
async fn round(fs: &LocalFs, tools: &Tools, a: &str, n: u64, counts: &Counts) {
    for name in ["f", "g", "d/f"] {
        let out = tools
            .call("read_file", json!({"path": format!("{a}/{name}")}))
            .await;
        counts.saw("read_file", &out.text);
    }
    if let Ok(data) = fs.read(&format!("{a}/d/f")).await {
        counts.saw("read", &String::from_utf8_lossy(&data));
    } else {
        counts.did();
    }
    let _ = fs.stat(&format!("{a}/d/f")).await;
    counts.did();
    let out = tools
        .call("list_files", json!({"path": format!("{a}/d")}))
        .await;
    counts.saw("list_files", &out.text);
    let out = tools
        .call("glob_files", json!({"pattern": "**", "path": a}))
        .await;
    counts.saw("glob_files", &out.text);
    let out = tools
        .call("grep_files", json!({"pattern": "token", "path": a}))
        .await;
    counts.saw("grep_files", &out.text);

    let (old, new) = if n.is_multiple_of(2) {
        ("token", "t0ken")
    } else {
        ("t0ken", "token")
    };
    for name in ["f", "d/f"] {
        let out = tools
            .call(
                "edit_file",
                json!({"path": format!("{a}/{name}"), "old_string": old, "new_string": new}),
            )
            .await;
        counts.saw("edit_file", &out.text);
    }
    for name in ["f", "g", "d/new", "d/victim", "d/mv-src"] {
        let out = tools
            .call(
                "write_file",
                json!({"path": format!("{a}/{name}"), "content": race::INSIDE}),
            )
            .await;
        counts.saw("write_file", &out.text);
    }
    let _ = fs.delete(&format!("{a}/d/victim")).await;
    counts.did();
    let _ = fs
        .rename(&format!("{a}/d/mv-src"), &format!("{a}/d/mv-dst"))
        .await;
    counts.did();
    let _ = fs.delete(&format!("{a}/d/mv-dst")).await;
    counts.did();
}

/// Drive `round` over `arena` until `until`.
async fn drive(fs: LocalFs, arena: &'static str, until: Instant, counts: Arc<Counts>) {
    let tools = Tools::new(Arc::new(fs.clone()));
    let mut n = 0;
    while Instant::now() < until {
        round(&fs, &tools, arena, n, &counts).await;
        n += 1;
    }
}

fn canonical(p: &Path) -> PathBuf {
    std::fs::create_dir_all(p).unwrap();
    p.canonicalize().unwrap()
}

/// The local mode's tools against a swapper in the workspace layer, the project layer (reads
/// and copy-up edits) and a user's directory of the multi-user layout.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn local_fs_tools_never_reach_outside_while_paths_are_swapped() {
    race::run_swapper_if_child();
    let tmp = tempfile::tempdir().unwrap();
    let base = canonical(tmp.path());
    let project = canonical(&base.join("project"));
    let outside = Outside::create(&base.join("outside")).unwrap();
    let fs = LocalFs::new(LocalOptions::default().project(&project).shell(false)).unwrap();
    let ws = fs.workspace_dir().to_path_buf();
    let alice = fs.for_user("alice");
    // The user's directory exists (and is marked) once she wrote something.
    alice.write("memory/seed.md", "seed".into()).await.unwrap();
    let arenas = [
        ws.join("w"),
        project.join("p"),
        ws.join(sandbox_core::encode_component("alice"))
            .join("memory"),
    ];
    for arena in &arenas {
        race::make_arena(arena).unwrap();
    }
    let swapper = Swapper::spawn(
        "local_fs_tools_never_reach_outside_while_paths_are_swapped",
        &arenas,
        outside.dir(),
        &base,
    );
    let started = Instant::now();
    let until = started + race::duration();
    let counts = Arc::new(Counts::default());
    let tasks = [
        tokio::spawn(drive(fs.clone(), "w", until, counts.clone())),
        tokio::spawn(drive(fs.clone(), "p", until, counts.clone())),
        tokio::spawn(drive(alice, "memory", until, counts.clone())),
    ];
    for t in tasks {
        t.await.unwrap();
    }
    let swaps = swapper.stop();
    let changes = outside.changes().unwrap();
    race::assert_clean(
        "local_fs",
        started.elapsed(),
        swaps,
        counts.operations.load(Ordering::Relaxed),
        counts.outside_reads.load(Ordering::Relaxed),
        &changes,
    );
    // The layers still work after the storm.
    fs.write("w/after.txt", "ok".into()).await.unwrap();
    assert_eq!(&fs.read("w/after.txt").await.unwrap()[..], b"ok");
}
