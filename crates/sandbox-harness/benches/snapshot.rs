//! `cargo xtask bench snapshot`: the snapshot engine against GNU tar, in the same run.
//!
//! Workloads: A) 1,000 files × 1 KiB; B) 100 files × 1 MiB random; C) B after changing 3 bytes
//! in one of its files; D) B with no change; E) 1 GiB of mixed files (a few large, many small).
//! Phases: `snapshot` (workspace → store) and `restore` (store → an empty box), per format.
//! Baselines: `tar -cf`, `tar -xf`, and `tar -c | sha256sum` (archiving while hashing).
//!
//! Each of our measurements runs in a child process of this binary so its peak RSS
//! (`VmHWM`) is its own. Results: a table on stdout and `target/bench/snapshot.json`, every row
//! with the store it ran on and the store requests of the phase (PUT/GET/LIST/DELETE, bytes),
//! counted by `testkit::CountingStore` around the store that [`make_store`] builds.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;
use std::time::{Duration, Instant};

use sandbox_core::testkit::{CountingStore, StoreCounts};
use sandbox_harness::local::{LocalClient, LocalOptions};
use sandbox_harness::snapshot::{self, SnapshotFormat, SnapshotRef, TakeRequest};
use sandbox_harness::{
    CallContext, CreateRequest, IsolationKey, IsolationScope, LocalDirSnapshotStore, Persistence,
    SandboxClient, SnapshotSpec, SnapshotStore, WorkspaceSpec,
};

const MIB: usize = 1024 * 1024;
/// Each measurement (ours and the baselines) is the fastest of this many runs.
const RUNS: usize = 3;

fn main() {
    let args: Vec<String> = std::env::args()
        .skip(1)
        .filter(|a| a != "--bench")
        .collect();
    if args.first().map(String::as_str) == Some("child") {
        child(&args[1..]);
        return;
    }
    let only: Option<String> = args.first().cloned();
    driver(only.as_deref());
}

#[derive(Debug, Clone, serde::Serialize)]
struct Row {
    /// The snapshot store (`local`; see [`make_store`]).
    store: String,
    workload: String,
    phase: String,
    format: String,
    ours_ms: f64,
    baseline: String,
    baseline_ms: f64,
    ratio: f64,
    bytes_written: u64,
    peak_rss_kib: u64,
    /// Store requests and bytes of the phase.
    requests: StoreCounts,
    note: String,
}

/// What a child reports.
#[derive(Debug, serde::Serialize, serde::Deserialize)]
struct ChildResult {
    ms: f64,
    bytes_written: u64,
    peak_rss_kib: u64,
    unchanged: bool,
    files_hashed: u64,
    /// Bytes of the manifest among `bytes_written`.
    manifest_bytes: u64,
    snapshot: Option<String>,
    #[serde(default)]
    requests: StoreCounts,
}

impl ChildResult {
    /// A measurement that wrote nothing.
    fn timed(ms: f64) -> Self {
        ChildResult {
            ms,
            bytes_written: 0,
            peak_rss_kib: 0,
            unchanged: false,
            files_hashed: 0,
            manifest_bytes: 0,
            snapshot: None,
            requests: StoreCounts::default(),
        }
    }
}

struct Bench {
    root: PathBuf,
    exe: PathBuf,
    rows: Vec<Row>,
}

fn driver(only: Option<&str>) {
    // `cargo xtask bench` points this at <workspace>/target/bench.
    let out =
        PathBuf::from(std::env::var("SANDBOX_BENCH_OUT").unwrap_or_else(|_| "target/bench".into()));
    let root = out.join("snapshot-work");
    let _ = std::fs::remove_dir_all(&root);
    std::fs::create_dir_all(&root).expect("bench dir");
    let mut b = Bench {
        root: root.canonicalize().expect("root"),
        exe: std::env::current_exe().expect("exe"),
        rows: Vec::new(),
    };
    println!("snapshot benchmark (work dir {})\n", b.root.display());

    let want = |w: &str| only.is_none_or(|o| o.contains(w));
    if want("A") {
        let ws = b.workspace("a");
        write_files(&ws, 1000, 1024, 1);
        for format in formats() {
            b.full_cycle("A", "a", format);
        }
    }
    if want("B") || want("C") || want("D") {
        let ws = b.workspace("b");
        write_files(&ws, 100, MIB, 2);
        for format in formats() {
            let snap = b.full_cycle("B", "b", format);
            // D: no change since the snapshot.
            let d = b.child_take("b", format, Some(&snap));
            b.push(
                "D",
                "snapshot (no change)",
                format,
                &d,
                ("target", 10.0),
                if d.unchanged {
                    "unchanged: nothing written"
                } else {
                    "CHANGED?"
                },
            );
            // C: three bytes changed in one file.
            poke(&ws.join("f0042.bin"), 500_000, b"abc");
            let c = b.child_take("b", format, Some(&snap));
            let note = format!(
                "{} file(s) re-read; data {} B + manifest {} B",
                c.files_hashed,
                c.bytes_written - c.manifest_bytes,
                c.manifest_bytes
            );
            b.push(
                "C",
                "snapshot (3 bytes changed)",
                format,
                &c,
                ("target", 30.0),
                &note,
            );
            // Put the byte back for the other format's run.
            b.reset_b(&ws);
        }
    }
    if want("E") {
        let ws = b.workspace("e");
        write_mixed(&ws);
        for format in formats() {
            b.full_cycle("E", "e", format);
        }
    }
    if only.is_none() {
        b.gc();
    }
    b.report();
    let _ = std::fs::remove_dir_all(&b.root);
}

impl Bench {
    fn workspace(&self, name: &str) -> PathBuf {
        // The box for `name` lives at boxes/k-<digest>/workspace; create it through the backend.
        let rt = runtime();
        rt.block_on(async {
            let (client, key) = self.client_and_key(name);
            let spec = WorkspaceSpec::default();
            let handle = client
                .create(CreateRequest::new(&spec, Some(&key)))
                .await
                .expect("create");
            handle.boot().await.expect("boot");
            let ws = PathBuf::from(handle.workspace_root());
            std::fs::create_dir_all(&ws).expect("workspace");
            ws
        })
    }

    fn client_and_key(&self, name: &str) -> (LocalClient, IsolationKey) {
        client_and_key(&self.root, name)
    }

    fn reset_b(&self, ws: &Path) {
        write_one(&ws.join("f0042.bin"), MIB, 2, 42);
    }

    /// Snapshot `name` in `format`, restore it into an empty box; with the tar baselines.
    fn full_cycle(&mut self, workload: &str, name: &str, format: SnapshotFormat) -> String {
        let ws = self.workspace(name);
        let took = self.child_take(name, format, None);
        let snap = took.snapshot.clone().expect("snapshot id");
        let tar_file = self.root.join(format!("{name}.tar"));
        let tar_c = time_cmd(&format!(
            "tar -cf {} -C {} .",
            tar_file.display(),
            ws.display()
        ));
        let tar_sha = time_cmd(&format!(
            "tar -cf - -C {} . | sha256sum > /dev/null",
            ws.display()
        ));
        // Our store makes every blob durable (fsync) before it counts as written; so does this.
        let tar_c_sync = time_cmd(&format!(
            "tar -cf {f} -C {} . && sync {f}",
            ws.display(),
            f = tar_file.display()
        ));
        self.push(workload, "snapshot", format, &took, ("tar -cf", tar_c), "");
        self.push(
            workload,
            "snapshot",
            format,
            &took,
            ("tar -cf && sync", tar_c_sync),
            "",
        );
        self.push(
            workload,
            "snapshot",
            format,
            &took,
            ("tar -c | sha256sum", tar_sha),
            "",
        );
        let restored = self.child_restore(name, format, &snap);
        let empty = self.root.join(format!("{name}-tar-x"));
        let _ = std::fs::remove_dir_all(&empty);
        std::fs::create_dir_all(&empty).expect("dir");
        let tar_x = time_cmd(&format!(
            "tar -xf {} -C {}",
            tar_file.display(),
            empty.display()
        ));
        let _ = std::fs::remove_dir_all(&empty);
        let _ = std::fs::remove_file(&tar_file);
        self.push(
            workload,
            "restore",
            format,
            &restored,
            ("tar -xf", tar_x),
            "into an empty box",
        );
        snap
    }

    fn push(
        &mut self,
        workload: &str,
        phase: &str,
        format: SnapshotFormat,
        r: &ChildResult,
        (baseline, baseline_ms): (&str, f64),
        note: &str,
    ) {
        self.rows.push(Row {
            store: store_kind(),
            workload: workload.into(),
            phase: phase.into(),
            format: format_name(format).into(),
            ours_ms: r.ms,
            baseline: baseline.into(),
            baseline_ms,
            ratio: r.ms / baseline_ms,
            bytes_written: r.bytes_written,
            peak_rss_kib: r.peak_rss_kib,
            requests: r.requests,
            note: note.into(),
        });
    }

    fn child_take(&self, name: &str, format: SnapshotFormat, parent: Option<&str>) -> ChildResult {
        let mut args = vec![
            "child".to_owned(),
            "take".into(),
            self.root.display().to_string(),
            name.into(),
            format_name(format).into(),
        ];
        args.extend(parent.map(str::to_owned));
        self.run_child(&args)
    }

    fn child_restore(&self, name: &str, format: SnapshotFormat, snap: &str) -> ChildResult {
        let args = vec![
            "child".to_owned(),
            "restore".into(),
            self.root.display().to_string(),
            name.into(),
            format_name(format).into(),
            snap.into(),
        ];
        self.run_child(&args)
    }

    /// The fastest of [`RUNS`] runs (each a fresh process), with the highest peak RSS seen.
    fn run_child(&self, args: &[String]) -> ChildResult {
        let mut best: Option<ChildResult> = None;
        let mut rss = 0;
        for _ in 0..RUNS {
            let out = Command::new(&self.exe)
                .args(args)
                .output()
                .expect("spawn child");
            assert!(
                out.status.success(),
                "child {args:?} failed: {}",
                String::from_utf8_lossy(&out.stderr)
            );
            let r: ChildResult = serde_json::from_slice(&out.stdout).unwrap_or_else(|e| {
                panic!("child output {e}: {}", String::from_utf8_lossy(&out.stdout))
            });
            rss = rss.max(r.peak_rss_kib);
            if best.as_ref().is_none_or(|b| r.ms < b.ms) {
                best = Some(r);
            }
        }
        ChildResult {
            peak_rss_kib: rss,
            ..best.expect("ran")
        }
    }

    /// Mark-and-sweep over the chunked store all workloads wrote: retention down to one
    /// snapshot per namespace, then every unreferenced chunk swept (grace 0).
    fn gc(&mut self) {
        let store = CountingStore::new(make_store(&self.root, SnapshotFormat::Chunked));
        let rt = runtime();
        let started = Instant::now();
        let report = rt
            .block_on(snapshot::gc(
                &store,
                &sandbox_harness::archive::ArchivePolicy::default(),
                snapshot::GcOptions::default()
                    .keep_last(1)
                    .grace(Duration::ZERO),
                // No states: the bench's snapshots are taken directly, none is pinned.
                &sandbox_harness::MemoryStateStore::new(),
            ))
            .expect("gc");
        let gc_ms = ms(started.elapsed());
        let note = format!(
            "{} snapshots retired; packs: {} deleted, {} repacked, {} live, {} B freed; {} old chunk blobs swept",
            report.snapshots_deleted,
            report.packs_deleted,
            report.packs_repacked,
            report.packs_live,
            report.pack_bytes_freed,
            report.chunks_deleted,
        );
        let r = ChildResult {
            requests: store.counts(),
            ..ChildResult::timed(gc_ms)
        };
        self.push(
            "*",
            "gc (mark + sweep)",
            SnapshotFormat::Chunked,
            &r,
            ("-", f64::NAN),
            &note,
        );
    }

    fn report(&self) {
        println!(
            "{:<6} {:<3} {:<27} {:<8} {:>10} {:<20} {:>10} {:>7} {:>12} {:>9} {:>18}  note",
            "store",
            "wl",
            "phase",
            "format",
            "ours ms",
            "baseline",
            "base ms",
            "ratio",
            "bytes",
            "rss KiB",
            "PUT/GET/LIST/DEL"
        );
        for r in &self.rows {
            let q = &r.requests;
            println!(
                "{:<6} {:<3} {:<27} {:<8} {:>10.2} {:<20} {:>10.2} {:>7.2} {:>12} {:>9} {:>18}  {}",
                r.store,
                r.workload,
                r.phase,
                r.format,
                r.ours_ms,
                r.baseline,
                r.baseline_ms,
                r.ratio,
                r.bytes_written,
                r.peak_rss_kib,
                format!("{}/{}/{}/{}", q.puts, q.gets, q.lists, q.deletes),
                r.note
            );
        }
        let dir = self.root.parent().expect("bench dir");
        let path = dir.join("snapshot.json");
        std::fs::write(&path, serde_json::to_vec_pretty(&self.rows).expect("json"))
            .expect("write json");
        println!("\nwrote {}", path.display());
    }
}

/// The formats to measure: both, or the one named by `SANDBOX_BENCH_FORMAT` (`tar`, `chunked`).
fn formats() -> Vec<SnapshotFormat> {
    match std::env::var("SANDBOX_BENCH_FORMAT").as_deref() {
        Ok("tar") => vec![SnapshotFormat::Tar],
        Ok("chunked") => vec![SnapshotFormat::Chunked],
        _ => vec![SnapshotFormat::Tar, SnapshotFormat::Chunked],
    }
}

fn format_name(f: SnapshotFormat) -> &'static str {
    match f {
        SnapshotFormat::Tar => "tar",
        SnapshotFormat::Chunked => "chunked",
        _ => "other",
    }
}

fn parse_format(s: &str) -> SnapshotFormat {
    match s {
        "tar" => SnapshotFormat::Tar,
        _ => SnapshotFormat::Chunked,
    }
}

fn client_and_key(root: &Path, name: &str) -> (LocalClient, IsolationKey) {
    let client = LocalClient::new(
        LocalOptions::default()
            .base_dir(root.join("boxes"))
            .persistence(Persistence::Keep),
    );
    let key = IsolationKey::resolve(
        IsolationScope::Session,
        &CallContext::new("bench").session(name),
    )
    .expect("key");
    (client, key)
}

/// The store the bench runs on, from `SANDBOX_BENCH_STORE` (default `local`).
fn store_kind() -> String {
    std::env::var("SANDBOX_BENCH_STORE").unwrap_or_else(|_| "local".into())
}

/// The one place the bench builds its snapshot store (one per format, so each format's data
/// is measured apart); other stores (S3, Redis) plug in here.
fn make_store(root: &Path, format: SnapshotFormat) -> Arc<dyn SnapshotStore> {
    match store_kind().as_str() {
        "local" => Arc::new(LocalDirSnapshotStore::new(
            root.join(format!("store-{}", format_name(format))),
        )),
        other => panic!("snapshot bench: store `{other}` is not supported yet (local)"),
    }
}

fn spec_for(root: &Path, format: SnapshotFormat) -> (SnapshotSpec, Arc<CountingStore>) {
    let counting = Arc::new(CountingStore::new(make_store(root, format)));
    let mut spec = SnapshotSpec::new(counting.clone()).format(format);
    if let Some(bytes) = std::env::var("SANDBOX_BENCH_PACK_SIZE")
        .ok()
        .and_then(|v| v.parse().ok())
    {
        spec = spec.pack_size(bytes);
    }
    let spec = spec.keep_last(0).restore_prefetch(
        std::env::var("SANDBOX_BENCH_PREFETCH")
            .ok()
            .and_then(|c| c.parse().ok())
            .unwrap_or(2),
    );
    (spec, counting)
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime")
}

/// One measured phase in this (child) process; prints a [`ChildResult`].
fn child(args: &[String]) {
    let (op, root, name, format) = (
        &args[0],
        Path::new(&args[1]),
        &args[2],
        parse_format(&args[3]),
    );
    let rt = runtime();
    let (spec, counting) = spec_for(root, format);
    let result = rt.block_on(async {
        let (client, key) = client_and_key(root, name);
        let ws_spec = WorkspaceSpec::default();
        match op.as_str() {
            "take" => {
                let handle = client
                    .create(CreateRequest::new(&ws_spec, Some(&key)))
                    .await
                    .expect("create");
                let parent = args.get(4).map(|id| find_ref(root, &key, id));
                let started = Instant::now();
                let parent = match parent {
                    Some(r) => Some((
                        r.clone(),
                        snapshot::load_manifest(&spec, &r).await.expect("manifest"),
                    )),
                    None => None,
                };
                let request = TakeRequest::new(key.digest()).parent(parent);
                let out = snapshot::take(&*handle, &spec, request)
                    .await
                    .expect("take");
                let ms = ms(started.elapsed());
                let requests = counting.counts();
                save_ref(root, &key, &out.snapshot);
                ChildResult {
                    ms,
                    bytes_written: out.bytes_written,
                    peak_rss_kib: 0,
                    unchanged: out.unchanged,
                    files_hashed: out.files_hashed,
                    manifest_bytes: if out.unchanged {
                        0
                    } else {
                        out.snapshot.manifest_size
                    },
                    snapshot: Some(out.snapshot.id),
                    requests,
                }
            }
            "restore" => {
                let snap = find_ref(root, &key, &args[4]);
                let (client2, _) =
                    client_and_key(root, &format!("{name}-restore-{}", format_name(format)));
                let key2 = IsolationKey::resolve(
                    IsolationScope::Session,
                    &CallContext::new("bench").session(format!("{name}-r-{}", format_name(format))),
                )
                .expect("key");
                let handle = client2
                    .create(CreateRequest::new(&ws_spec, Some(&key2)))
                    .await
                    .expect("create");
                handle.boot().await.expect("boot");
                let started = Instant::now();
                snapshot::restore(&*handle, &spec, &snap, Vec::new(), false)
                    .await
                    .expect("restore");
                let ms = ms(started.elapsed());
                let requests = counting.counts();
                handle.destroy().await.expect("destroy");
                ChildResult {
                    requests,
                    ..ChildResult::timed(ms)
                }
            }
            other => panic!("unknown child op {other}"),
        }
    });
    let result = ChildResult {
        peak_rss_kib: peak_rss_kib(),
        ..result
    };
    println!("{}", serde_json::to_string(&result).expect("json"));
}

/// Snapshot references are kept as JSON files beside the store, as a state store would keep
/// them.
fn ref_path(root: &Path, key: &IsolationKey, id: &str) -> PathBuf {
    root.join(format!("refs/{}-{id}.json", key.digest()))
}

fn save_ref(root: &Path, key: &IsolationKey, r: &SnapshotRef) {
    let path = ref_path(root, key, &r.id);
    std::fs::create_dir_all(path.parent().expect("parent")).expect("refs dir");
    std::fs::write(path, serde_json::to_vec(r).expect("json")).expect("save ref");
}

fn find_ref(root: &Path, key: &IsolationKey, id: &str) -> SnapshotRef {
    serde_json::from_slice(&std::fs::read(ref_path(root, key, id)).expect("ref")).expect("ref json")
}

fn peak_rss_kib() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmHWM:"))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|v| v.parse().ok())
        })
        .unwrap_or(0)
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

fn time_cmd(cmd: &str) -> f64 {
    let mut best = f64::MAX;
    for _ in 0..RUNS {
        let started = Instant::now();
        let status = Command::new("sh").arg("-c").arg(cmd).status().expect("sh");
        assert!(status.success(), "`{cmd}` failed");
        best = best.min(ms(started.elapsed()));
    }
    best
}

/// Deterministic pseudo-random bytes (xorshift), incompressible enough for chunking.
fn fill(buf: &mut [u8], seed: u64) {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    for chunk in buf.chunks_mut(8) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        let bytes = x.to_le_bytes();
        chunk.copy_from_slice(&bytes[..chunk.len()]);
    }
}

fn write_one(path: &Path, size: usize, seed: u64, i: u64) {
    let mut buf = vec![0u8; size];
    fill(&mut buf, seed * 1_000_003 + i);
    std::fs::write(path, &buf).expect("write");
}

fn write_files(ws: &Path, n: usize, size: usize, seed: u64) {
    for i in 0..n {
        write_one(&ws.join(format!("f{i:04}.bin")), size, seed, i as u64);
    }
}

/// ~1 GiB: four 200 MiB files and 20,000 files of 1–19 KiB in 100 directories.
fn write_mixed(ws: &Path) {
    for i in 0..4 {
        write_one(&ws.join(format!("large{i}.bin")), 200 * MIB, 5, i);
    }
    for d in 0..100 {
        let dir = ws.join(format!("src/pkg{d:03}"));
        std::fs::create_dir_all(&dir).expect("dir");
        for f in 0..200u64 {
            let size = 1024 * (1 + ((d as u64 * 7 + f * 13) % 19) as usize);
            write_one(
                &dir.join(format!("m{f:03}.dat")),
                size,
                6,
                d as u64 * 1000 + f,
            );
        }
    }
}

/// Overwrite `data.len()` bytes at `offset`, keeping the size.
fn poke(path: &Path, offset: u64, data: &[u8]) {
    use std::io::{Seek, SeekFrom, Write};
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .open(path)
        .expect("open");
    f.seek(SeekFrom::Start(offset)).expect("seek");
    f.write_all(data).expect("write");
}
