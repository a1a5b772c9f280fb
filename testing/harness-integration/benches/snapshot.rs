//! `cargo xtask bench snapshot [--store local|s3|redis]... [W]`: the snapshot engine on each
//! store against a same-run floor.
//!
//! Workloads: A) 1,000 files × 1 KiB; B) 100 files × 1 MiB random; C) B after changing 3 bytes
//! in one of its files; D) B with no change; E) 1 GiB of mixed files (a few large, many small).
//! Phases: `snapshot` (workspace → store) and `restore` (store → an empty box), per format.
//!
//! Stores: `SANDBOX_BENCH_STORES` (comma list of `local`, `s3`, `redis`; default `local`).
//! `cargo xtask bench snapshot` starts the servers and sets `SANDBOX_BENCH_S3_ENDPOINT`,
//! `SANDBOX_BENCH_S3_BUCKET`, `SANDBOX_BENCH_S3_ACCESS_KEY`, `SANDBOX_BENCH_S3_SECRET_KEY` and
//! `SANDBOX_BENCH_REDIS_URL`. Floors, per store:
//! - local: `tar -cf`, `tar -xf`, and `tar -c | sha256sum` (archiving while hashing);
//! - s3: `tar -c` of the tree streamed into one `object_store` upload (parts of the store's part
//!   size, as many in flight), and that object downloaded and piped into `tar -x`;
//! - redis: `tar -c` cut into parts of the store's part size written with pipelined `SET`s (as
//!   many in flight as the store), and read back with pipelined `GET`s into `tar -x`.
//!
//! The local store runs both formats; S3 and Redis the chunked one (`SANDBOX_BENCH_FORMAT`
//! picks one format everywhere).
//!
//! Each of our measurements runs in a child process of this binary so its peak RSS
//! (`VmHWM`) is its own. Results: a table on stdout and `target/bench/snapshot.json`, every row
//! with the store it ran on and the store requests of the phase (PUT/GET/LIST/DELETE, bytes),
//! counted by `testkit::CountingStore` around the store that [`make_store`] builds.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;
use std::time::{Duration, Instant};

#[cfg(any(feature = "s3", feature = "redis"))]
use futures::{StreamExt as _, TryStreamExt as _};
#[cfg(any(feature = "s3", feature = "redis"))]
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};

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
    /// The snapshot store (`local`, `s3`, `redis`; see [`make_store`]).
    store: String,
    workload: String,
    phase: String,
    format: String,
    ours_ms: f64,
    baseline: String,
    baseline_ms: f64,
    ratio: f64,
    bytes_written: u64,
    /// Bytes of the manifest among `bytes_written`.
    manifest_bytes: u64,
    /// Bytes of chunks new since the parent snapshot (C: the changed chunk).
    new_chunk_bytes: u64,
    peak_rss_kib: u64,
    /// Store requests and bytes of the phase.
    requests: StoreCounts,
    /// On S3: the HTTP requests the store sent in the phase (a multipart upload is several).
    #[serde(skip_serializing_if = "Option::is_none")]
    http_requests: Option<HttpRequests>,
    note: String,
}

/// HTTP requests of an S3 store (from `OssSnapshotStore::requests`).
#[derive(Debug, Clone, Copy, Default, serde::Serialize, serde::Deserialize)]
struct HttpRequests {
    /// Single `PUT`s.
    put: u64,
    /// Multipart uploads started, parts uploaded, uploads completed.
    multipart_start: u64,
    part: u64,
    complete: u64,
    /// `GET`s (ranged ones included) and, of those, ranged ones.
    get: u64,
    ranged_get: u64,
    head: u64,
    delete: u64,
    list: u64,
}

impl std::fmt::Display for HttpRequests {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "PUT {} MPU {}+{}p+{} GET {} ({} ranged) HEAD {} LIST {} DEL {}",
            self.put,
            self.multipart_start,
            self.part,
            self.complete,
            self.get,
            self.ranged_get,
            self.head,
            self.list,
            self.delete
        )
    }
}

/// The S3 store a child built, to read its HTTP request counts after the phase.
#[cfg(feature = "s3")]
static S3_STORE: std::sync::OnceLock<sandbox_harness::s3::OssSnapshotStore> =
    std::sync::OnceLock::new();

/// The HTTP requests of the S3 store this process built, if it built one.
fn http_requests() -> Option<HttpRequests> {
    #[cfg(feature = "s3")]
    if let Some(store) = S3_STORE.get() {
        let r = store.requests();
        return Some(HttpRequests {
            put: r.put,
            multipart_start: r.multipart_start,
            part: r.part,
            complete: r.complete,
            get: r.get,
            ranged_get: r.ranged_get,
            head: r.head,
            delete: r.delete,
            list: r.list,
        });
    }
    None
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
    /// Bytes of the chunks this snapshot references that its parent did not (C: the changed
    /// chunk).
    #[serde(default)]
    new_chunk_bytes: u64,
    snapshot: Option<String>,
    #[serde(default)]
    requests: StoreCounts,
    #[serde(default)]
    http_requests: Option<HttpRequests>,
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
            new_chunk_bytes: 0,
            snapshot: None,
            requests: StoreCounts::default(),
            http_requests: None,
        }
    }
}

struct Bench {
    root: PathBuf,
    exe: PathBuf,
    rows: Vec<Row>,
    /// The store being measured.
    store: String,
}

fn driver(only: Option<&str>) {
    // `cargo xtask bench` points this at <workspace>/target/bench.
    let out =
        PathBuf::from(std::env::var("SANDBOX_BENCH_OUT").unwrap_or_else(|_| "target/bench".into()));
    let root = out.join("snapshot-work");
    let _ = std::fs::remove_dir_all(&root);
    std::fs::create_dir_all(&root).expect("bench dir");
    let stores = stores();
    let mut b = Bench {
        root: root.canonicalize().expect("root"),
        exe: std::env::current_exe().expect("exe"),
        rows: Vec::new(),
        store: stores[0].clone(),
    };
    println!(
        "snapshot benchmark on {} (work dir {})\n",
        stores.join(", "),
        b.root.display()
    );

    let want = |w: &str| only.is_none_or(|o| o.contains(w));
    if want("A") {
        let ws = b.workspace("a");
        write_files(&ws, 1000, 1024, 1);
        for store in &stores {
            b.store = store.clone();
            for format in formats(store) {
                b.full_cycle("A", "a", format);
            }
        }
    }
    if want("B") || want("C") || want("D") {
        let ws = b.workspace("b");
        write_files(&ws, 100, MIB, 2);
        for store in &stores {
            b.store = store.clone();
            for format in formats(store) {
                b.bcd(&ws, format);
            }
        }
    }
    if want("E") {
        let ws = b.workspace("e");
        write_mixed(&ws);
        for store in &stores {
            b.store = store.clone();
            for format in formats(store) {
                b.full_cycle("E", "e", format);
            }
        }
    }
    if only.is_none() {
        for store in &stores {
            b.store = store.clone();
            b.gc();
        }
    }
    b.report();
    b.summary();
    let _ = std::fs::remove_dir_all(&b.root);
}

impl Bench {
    /// B (full cycle), then D (no change) and C (three bytes changed) against B's snapshot.
    fn bcd(&mut self, ws: &Path, format: SnapshotFormat) {
        let snap = self.full_cycle("B", "b", format);
        // D: no change since the snapshot.
        let d = self.child_take("b", format, Some(&snap));
        let target_d = ("target", Targets::D_MS);
        let note = if d.unchanged {
            "unchanged: nothing written"
        } else {
            "CHANGED?"
        };
        self.push("D", "snapshot (no change)", format, &d, target_d, note);
        // C: three bytes changed in one file.
        poke(&ws.join("f0042.bin"), 500_000, b"abc");
        let c = self.child_take("b", format, Some(&snap));
        let note = format!(
            "{} file(s) re-read; data {} B (new chunks {} B) + manifest {} B",
            c.files_hashed,
            c.bytes_written - c.manifest_bytes,
            c.new_chunk_bytes,
            c.manifest_bytes
        );
        let c_ms = Targets::of(&self.store).map_or(Targets::REMOTE_C_MS, |t| t.c_ms);
        let target_c = ("target", c_ms);
        self.push(
            "C",
            "snapshot (3 bytes changed)",
            format,
            &c,
            target_c,
            &note,
        );
        // Put the byte back for the next run.
        self.reset_b(ws);
    }

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

    /// Snapshot `name` in `format`, restore it into an empty box; with the store's floors.
    fn full_cycle(&mut self, workload: &str, name: &str, format: SnapshotFormat) -> String {
        let ws = self.workspace(name);
        let took = self.child_take(name, format, None);
        let snap = took.snapshot.clone().expect("snapshot id");
        let restored = self.child_restore(name, format, &snap);
        if self.store == "local" {
            self.local_floors(workload, name, &ws, format, &took, &restored);
        } else {
            self.remote_floors(workload, name, &ws, format, &took, &restored);
        }
        snap
    }

    /// The floors of a remote store ([`Floor`]), in the same run.
    #[cfg(any(feature = "s3", feature = "redis"))]
    fn remote_floors(
        &mut self,
        workload: &str,
        name: &str,
        ws: &Path,
        format: SnapshotFormat,
        took: &ChildResult,
        restored: &ChildResult,
    ) {
        let empty = self.root.join(format!("{name}-floor-x"));
        let rt = runtime();
        let _enter = rt.enter();
        let floor = Floor::new(&self.store);
        let (up, down) = rt.block_on(async {
            let mut up = f64::MAX;
            let mut down = f64::MAX;
            for _ in 0..RUNS {
                settle();
                up = up.min(floor.upload(ws, name).await);
                let _ = std::fs::remove_dir_all(&empty);
                std::fs::create_dir_all(&empty).expect("dir");
                settle();
                down = down.min(floor.download(name, &empty).await);
            }
            floor.clear(name).await;
            (up, down)
        });
        let _ = std::fs::remove_dir_all(&empty);
        let (up_name, down_name) = floor.names();
        self.push(workload, "snapshot", format, took, (up_name, up), "");
        self.push(
            workload,
            "restore",
            format,
            restored,
            (down_name, down),
            "into an empty box",
        );
    }

    #[cfg(not(any(feature = "s3", feature = "redis")))]
    fn remote_floors(
        &mut self,
        _: &str,
        _: &str,
        _: &Path,
        _: SnapshotFormat,
        _: &ChildResult,
        _: &ChildResult,
    ) {
        panic!("store `{}` needs the features s3 / redis", self.store);
    }

    /// GNU tar on the local disk, in the same run.
    fn local_floors(
        &mut self,
        workload: &str,
        name: &str,
        ws: &Path,
        format: SnapshotFormat,
        took: &ChildResult,
        restored: &ChildResult,
    ) {
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
        self.push(workload, "snapshot", format, took, ("tar -cf", tar_c), "");
        self.push(
            workload,
            "snapshot",
            format,
            took,
            ("tar -cf && sync", tar_c_sync),
            "",
        );
        self.push(
            workload,
            "snapshot",
            format,
            took,
            ("tar -c | sha256sum", tar_sha),
            "",
        );
        // Into an empty directory each run, as ours restores into an empty box.
        let empty = self.root.join(format!("{name}-tar-x"));
        let tar_x = time_cmd_after(
            &format!("rm -rf {0} && mkdir {0}", empty.display()),
            &format!("tar -xf {} -C {}", tar_file.display(), empty.display()),
        );
        let _ = std::fs::remove_dir_all(&empty);
        let _ = std::fs::remove_file(&tar_file);
        self.push(
            workload,
            "restore",
            format,
            restored,
            ("tar -xf", tar_x),
            "into an empty box",
        );
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
            store: self.store.clone(),
            workload: workload.into(),
            phase: phase.into(),
            format: format_name(format).into(),
            ours_ms: r.ms,
            baseline: baseline.into(),
            baseline_ms,
            ratio: r.ms / baseline_ms,
            bytes_written: r.bytes_written,
            manifest_bytes: r.manifest_bytes,
            new_chunk_bytes: r.new_chunk_bytes,
            peak_rss_kib: r.peak_rss_kib,
            requests: r.requests,
            http_requests: r.http_requests,
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
            settle();
            let out = Command::new(&self.exe)
                .args(args)
                .env("SANDBOX_BENCH_STORE", &self.store)
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
        let rt = runtime();
        let _enter = rt.enter();
        let store =
            CountingStore::new(make_store(&self.root, &self.store, SnapshotFormat::Chunked));
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
            // The S3 store is built once in this process: by this GC.
            http_requests: if self.store == "s3" {
                http_requests()
            } else {
                None
            },
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

    /// Per store: one row per workload and phase against the store's floor, then the issue's
    /// targets (reported, never asserted) for the chunked format.
    fn summary(&self) {
        println!(
            "\nsummary: ratio to the store's floor (local: tar -cf / tar -xf; s3: one streamed \
             object_store upload of tar -c / its download into tar -x; redis: tar -c in pipelined \
             SETs / GETs into tar -x); C and D: to the target ms"
        );
        let mut seen: Vec<&str> = Vec::new();
        for r in &self.rows {
            if !seen.contains(&r.store.as_str()) {
                seen.push(&r.store);
            }
        }
        for store in seen {
            println!("\n[{store}]");
            println!(
                "{:<3} {:<27} {:<8} {:>10} {:<20} {:>7} {:>12} {:>12} {:>18} {:>8}  {}",
                "wl",
                "phase",
                "format",
                "ms",
                "floor",
                "ratio",
                "bytes put",
                "bytes got",
                "PUT/GET/LIST/DEL",
                "RSS MiB",
                if store == "s3" { "HTTP requests" } else { "" }
            );
            for r in self.rows.iter().filter(|r| r.store == store && primary(r)) {
                let q = &r.requests;
                println!(
                    "{:<3} {:<27} {:<8} {:>10.2} {:<20} {:>7.2} {:>12} {:>12} {:>18} {:>8.1}  {}",
                    r.workload,
                    r.phase,
                    r.format,
                    r.ours_ms,
                    r.baseline,
                    r.ratio,
                    q.bytes_written,
                    q.bytes_read,
                    format!("{}/{}/{}/{}", q.puts, q.gets, q.lists, q.deletes),
                    r.peak_rss_kib as f64 / 1024.0,
                    r.http_requests.map(|h| h.to_string()).unwrap_or_default()
                );
            }
        }
        println!("\ntargets of issue 11 (chunked format; reported, not asserted):");
        for (store, what, verdict) in self.targets() {
            println!("  {store:<6} {what:<58} {verdict}");
        }
    }

    /// The chunked-format row of `store`, `workload`, `phase` against its primary baseline.
    fn row(&self, store: &str, workload: &str, phase: &str) -> Option<&Row> {
        self.rows.iter().find(|r| {
            r.store == store
                && r.workload == workload
                && r.phase.starts_with(phase)
                && r.format == "chunked"
                && primary(r)
        })
    }

    /// (store, target, verdict) for every target the issue sets on a store measured here.
    fn targets(&self) -> Vec<(String, String, String)> {
        let mut out = Vec::new();
        for store in stores() {
            match Targets::of(&store) {
                Some(t) => self.check_targets(&store, &t, &mut out),
                None => out.push((
                    store,
                    "(the issue sets no targets on this store: see the ratios above)".into(),
                    String::new(),
                )),
            }
        }
        out
    }

    /// The targets on one store: B's ratio to the floor, C's time and bytes, on S3 D
    /// (time, no writes) and A's restore ratio, and E's peak RSS.
    fn check_targets(&self, store: &str, t: &Targets, out: &mut Vec<(String, String, String)>) {
        let mut check = |what: String, value: Option<(bool, String)>| {
            let verdict = match value {
                Some((true, v)) => format!("met ({v})"),
                Some((false, v)) => format!("NOT met ({v})"),
                None => "not measured".to_owned(),
            };
            out.push((store.to_owned(), what, verdict));
        };
        let ratio = |r: &Row, limit: f64| (r.ratio <= limit, format!("{:.2}x", r.ratio));
        check(
            format!("B snapshot <= {}x {}", t.b_ratio, t.b_floor),
            self.row(store, "B", "snapshot")
                .map(|r| ratio(r, t.b_ratio)),
        );
        let c = self.row(store, "C", "snapshot");
        check(
            format!("C <= {} ms", t.c_ms),
            c.map(|r| (r.ours_ms <= t.c_ms, format!("{:.1} ms", r.ours_ms))),
        );
        check(
            "C bytes <= 2x (changed chunk + manifest)".into(),
            c.map(|r| {
                let limit = 2 * (r.new_chunk_bytes + r.manifest_bytes);
                (
                    r.requests.bytes_written <= limit,
                    format!(
                        "{} B uploaded, limit 2 × ({} + {}) = {limit} B",
                        r.requests.bytes_written, r.new_chunk_bytes, r.manifest_bytes
                    ),
                )
            }),
        );
        if let Some(a_ratio) = t.remote {
            check(
                format!("D <= {} ms with zero write requests", Targets::D_MS),
                self.row(store, "D", "snapshot").map(|r| {
                    let writes = r.requests.puts + r.requests.deletes;
                    (
                        r.ours_ms <= Targets::D_MS && writes == 0,
                        format!("{:.1} ms, {writes} writes", r.ours_ms),
                    )
                }),
            );
            check(
                format!("A restore <= {a_ratio}x floor"),
                self.row(store, "A", "restore").map(|r| ratio(r, a_ratio)),
            );
        }
        // The E row: the peak RSS of the 1 GiB chunked snapshot (restore's is in the
        // table).
        check(
            format!("E snapshot peak RSS <= {} MiB", Targets::E_RSS_MIB),
            self.row(store, "E", "snapshot").map(|r| {
                let mib = r.peak_rss_kib as f64 / 1024.0;
                (mib <= Targets::E_RSS_MIB, format!("{mib:.1} MiB"))
            }),
        );
    }
}

/// The targets issue 11 sets on a store.
struct Targets {
    /// B snapshot: at most this ratio to `b_floor`.
    b_ratio: f64,
    b_floor: &'static str,
    /// C: at most this many ms.
    c_ms: f64,
    /// On a remote store, A restore's ratio limit (D's targets apply too).
    remote: Option<f64>,
}

impl Targets {
    const D_MS: f64 = 10.0;
    const E_RSS_MIB: f64 = 64.0;
    /// C's time target on remote stores (also shown for Redis, which has no targets).
    const REMOTE_C_MS: f64 = 50.0;

    fn of(store: &str) -> Option<Targets> {
        match store {
            "local" => Some(Targets {
                b_ratio: 1.5,
                b_floor: "tar -cf",
                c_ms: 30.0,
                remote: None,
            }),
            "s3" => Some(Targets {
                b_ratio: 1.3,
                b_floor: "floor",
                c_ms: Targets::REMOTE_C_MS,
                remote: Some(1.5),
            }),
            _ => None,
        }
    }
}

/// Whether `r` is measured against its store's primary floor (the extra local baselines,
/// `tar -cf && sync` and `tar -c | sha256sum`, are in the full table only).
fn primary(r: &Row) -> bool {
    r.baseline != "tar -cf && sync" && r.baseline != "tar -c | sha256sum"
}

/// The formats to measure on `store`: the one named by `SANDBOX_BENCH_FORMAT` (`tar`,
/// `chunked`), else both on the local store and the chunked one on S3 and Redis.
fn formats(store: &str) -> Vec<SnapshotFormat> {
    match std::env::var("SANDBOX_BENCH_FORMAT").as_deref() {
        Ok("tar") => vec![SnapshotFormat::Tar],
        Ok("chunked") => vec![SnapshotFormat::Chunked],
        _ if store == "local" => vec![SnapshotFormat::Tar, SnapshotFormat::Chunked],
        _ => vec![SnapshotFormat::Chunked],
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

/// The stores to measure, from `SANDBOX_BENCH_STORES` (comma list; default `local`).
fn stores() -> Vec<String> {
    let list = std::env::var("SANDBOX_BENCH_STORES").unwrap_or_else(|_| "local".into());
    let stores: Vec<String> = list
        .split(',')
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .map(str::to_owned)
        .collect();
    for s in &stores {
        assert!(
            ["local", "s3", "redis"].contains(&s.as_str()),
            "SANDBOX_BENCH_STORES: unknown store `{s}` (have local, s3, redis)"
        );
    }
    assert!(!stores.is_empty(), "SANDBOX_BENCH_STORES names no store");
    stores
}

/// The store a child measures: `SANDBOX_BENCH_STORE`, set by the driver.
fn store_kind() -> String {
    std::env::var("SANDBOX_BENCH_STORE").unwrap_or_else(|_| "local".into())
}

#[cfg(any(feature = "s3", feature = "redis"))]
fn env(name: &str) -> String {
    std::env::var(name).unwrap_or_else(|_| {
        panic!("{name} is not set: run the snapshot bench with `cargo xtask bench snapshot`")
    })
}

/// The one place the bench builds its snapshot store (one per store and format, so each
/// format's data is measured apart). Call inside a tokio runtime (Redis connects in one).
fn make_store(root: &Path, store: &str, format: SnapshotFormat) -> Arc<dyn SnapshotStore> {
    let fmt = format_name(format);
    match store {
        "local" => Arc::new(LocalDirSnapshotStore::new(
            root.join(format!("store-{fmt}")),
        )),
        #[cfg(feature = "s3")]
        "s3" => {
            let s = s3_config()
                .prefix(format!("bench-{fmt}"))
                .build()
                .expect("the S3 store");
            let _ = S3_STORE.set(s.clone());
            Arc::new(s)
        }
        #[cfg(feature = "redis")]
        "redis" => Arc::new(
            sandbox_harness::redis_snapshots::RedisSnapshotStore::new(
                sandbox_harness::redis_snapshots::RedisSnapshotOptions::new(env(
                    "SANDBOX_BENCH_REDIS_URL",
                ))
                .key_prefix(format!("bench:{fmt}:")),
            )
            .expect("the Redis store"),
        ),
        other => panic!(
            "snapshot bench: store `{other}` is not built in (features `s3`, `redis`; \
             `cargo xtask bench snapshot` enables them)"
        ),
    }
}

/// The S3 server `cargo xtask bench snapshot` started, with the store's default options.
#[cfg(feature = "s3")]
fn s3_config() -> sandbox_harness::s3::S3Config {
    sandbox_harness::s3::S3Config::new(env("SANDBOX_BENCH_S3_BUCKET"))
        .endpoint(env("SANDBOX_BENCH_S3_ENDPOINT"))
        .region("us-east-1")
        .credentials(
            env("SANDBOX_BENCH_S3_ACCESS_KEY"),
            env("SANDBOX_BENCH_S3_SECRET_KEY"),
        )
        .allow_http(true)
}

fn spec_for(root: &Path, format: SnapshotFormat) -> (SnapshotSpec, Arc<CountingStore>) {
    let counting = Arc::new(CountingStore::new(make_store(root, &store_kind(), format)));
    let mut spec = SnapshotSpec::new(counting.clone()).format(format);
    if let Some(bytes) = std::env::var("SANDBOX_BENCH_PACK_SIZE")
        .ok()
        .and_then(|v| v.parse().ok())
    {
        spec = spec.pack_size(bytes);
    }
    if let Some(bytes) = std::env::var("SANDBOX_BENCH_UPLOAD_BUFFER")
        .ok()
        .and_then(|v| v.parse().ok())
    {
        spec = spec.upload_buffer(bytes);
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
    let _enter = rt.enter();
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
                let parent_chunks: Option<std::collections::HashSet<String>> = parent
                    .as_ref()
                    .map(|(_, m)| chunk_hashes(m).into_keys().collect());
                let request = TakeRequest::new(key.digest()).parent(parent);
                let out = snapshot::take(&*handle, &spec, request)
                    .await
                    .expect("take");
                let ms = ms(started.elapsed());
                let requests = counting.counts();
                let http_requests = http_requests();
                save_ref(root, &key, &out.snapshot);
                // After the measurement: the chunks new since the parent.
                let new_chunk_bytes = match parent_chunks {
                    Some(old) if !out.unchanged => chunk_hashes(&out.manifest)
                        .into_iter()
                        .filter(|(h, _)| !old.contains(h))
                        .map(|(_, len)| len)
                        .sum(),
                    _ => 0,
                };
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
                    new_chunk_bytes,
                    snapshot: Some(out.snapshot.id),
                    requests,
                    http_requests,
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
                let http_requests = http_requests();
                handle.destroy().await.expect("destroy");
                ChildResult {
                    requests,
                    http_requests,
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

/// Every chunk a manifest references, with its length.
fn chunk_hashes(m: &snapshot::Manifest) -> std::collections::HashMap<String, u64> {
    m.entries
        .iter()
        .flat_map(|e| e.chunks.iter())
        .map(|c| (c.hash.clone(), c.len))
        .collect()
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
    time_cmd_after("true", cmd)
}

/// The fastest of [`RUNS`] runs of `cmd`, each after `prepare` (not timed) and [`settle`].
fn time_cmd_after(prepare: &str, cmd: &str) -> f64 {
    let mut best = f64::MAX;
    for _ in 0..RUNS {
        let status = Command::new("sh")
            .arg("-c")
            .arg(prepare)
            .status()
            .expect("sh");
        assert!(status.success(), "`{prepare}` failed");
        settle();
        let started = Instant::now();
        let status = Command::new("sh").arg("-c").arg(cmd).status().expect("sh");
        assert!(status.success(), "`{cmd}` failed");
        best = best.min(ms(started.elapsed()));
    }
    best
}

/// Before each measured run (ours and the baselines alike): write back what earlier runs left
/// dirty, so a run never pays for its predecessor's writeback (an fsync on ext4 can wait for
/// other files' dirty data), and every run starts from the same state.
fn settle() {
    let status = Command::new("sync").status().expect("sync");
    assert!(status.success(), "sync failed");
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

/// A same-run floor on a remote store: `tar -c` of the tree moved with the service's plain
/// operations, and moved back into `tar -x`.
#[cfg(any(feature = "s3", feature = "redis"))]
enum Floor {
    /// One streamed upload through `object_store` (parts of the store's part size, as many in
    /// flight as the store), one streamed download.
    #[cfg(feature = "s3")]
    S3 {
        store: Arc<dyn sandbox_harness::s3::object_store::ObjectStore>,
        part: usize,
        in_flight: usize,
    },
    /// Parts of the store's part size written with `SET`s, as many in flight as the store
    /// (pipelined on one multiplexed connection), read back with `GET`s the same way.
    #[cfg(feature = "redis")]
    Redis {
        client: redis::Client,
        part: usize,
        in_flight: usize,
        /// Parts written per workload.
        parts: std::sync::Mutex<std::collections::HashMap<String, usize>>,
    },
}

#[cfg(any(feature = "s3", feature = "redis"))]
impl Floor {
    /// Call inside a tokio runtime.
    fn new(store: &str) -> Floor {
        match store {
            #[cfg(feature = "s3")]
            "s3" => {
                let s = s3_config().build().expect("the S3 floor's store");
                Floor::S3 {
                    store: s.object_store().clone(),
                    part: s.options().part_size,
                    in_flight: s.options().max_parts_in_flight,
                }
            }
            #[cfg(feature = "redis")]
            "redis" => {
                let defaults = sandbox_harness::redis_snapshots::RedisSnapshotOptions::default();
                Floor::Redis {
                    client: redis::Client::open(env("SANDBOX_BENCH_REDIS_URL"))
                        .expect("the Redis URL"),
                    part: defaults.part_size,
                    in_flight: defaults.parts_in_flight,
                    parts: Default::default(),
                }
            }
            other => panic!("no floor for store `{other}` in this build"),
        }
    }

    /// The baselines' names: (snapshot, restore).
    fn names(&self) -> (&'static str, &'static str) {
        match self {
            #[cfg(feature = "s3")]
            Floor::S3 { .. } => ("tar -c | s3 upload", "s3 get | tar -x"),
            #[cfg(feature = "redis")]
            Floor::Redis { .. } => ("tar -c | redis SETs", "redis GETs | tar -x"),
        }
    }

    #[cfg(feature = "s3")]
    fn path(name: &str) -> sandbox_harness::s3::object_store::path::Path {
        sandbox_harness::s3::object_store::path::Path::from(format!("floor/{name}.tar"))
    }

    /// `tar -c` of `ws` into the store; milliseconds.
    async fn upload(&self, ws: &Path, name: &str) -> f64 {
        let started = Instant::now();
        let mut tar = tokio::process::Command::new("tar")
            .arg("-cf")
            .arg("-")
            .arg("-C")
            .arg(ws)
            .arg(".")
            .stdout(std::process::Stdio::piped())
            .spawn()
            .expect("run tar");
        let mut out = tar.stdout.take().expect("piped");
        match self {
            #[cfg(feature = "s3")]
            Floor::S3 {
                store,
                part,
                in_flight,
            } => {
                let mut w = sandbox_harness::s3::object_store::buffered::BufWriter::with_capacity(
                    store.clone(),
                    Floor::path(name),
                    *part,
                )
                .with_max_concurrency(*in_flight);
                loop {
                    let piece = read_piece(&mut out, *part).await;
                    if piece.is_empty() {
                        break;
                    }
                    w.put(piece).await.expect("s3 floor upload");
                }
                w.shutdown().await.expect("s3 floor: complete the upload");
            }
            #[cfg(feature = "redis")]
            Floor::Redis {
                client,
                part,
                in_flight,
                parts,
            } => {
                let conn = client
                    .get_multiplexed_async_connection()
                    .await
                    .expect("connect to Redis");
                let part = *part;
                let written = futures::stream::unfold(out, move |mut out| async move {
                    let piece = read_piece(&mut out, part).await;
                    (!piece.is_empty()).then_some((piece, out))
                })
                .enumerate()
                .map(|(n, piece)| {
                    let mut c = conn.clone();
                    let key = format!("floor:{name}:{n}");
                    async move {
                        redis::cmd("SET")
                            .arg(key)
                            .arg(&piece[..])
                            .query_async::<()>(&mut c)
                            .await
                    }
                })
                .buffer_unordered(*in_flight)
                .try_fold(0usize, |n, ()| async move { Ok(n + 1) })
                .await
                .expect("redis floor SET");
                parts
                    .lock()
                    .expect("parts")
                    .insert(name.to_owned(), written);
                let status = tar.wait().await.expect("tar");
                assert!(status.success(), "tar -c: {status}");
                return ms(started.elapsed());
            }
        }
        let status = tar.wait().await.expect("tar");
        assert!(status.success(), "tar -c: {status}");
        ms(started.elapsed())
    }

    /// What [`upload`](Self::upload) wrote for `name`, into `tar -x` in `dir`; milliseconds.
    async fn download(&self, name: &str, dir: &Path) -> f64 {
        let started = Instant::now();
        let mut tar = tokio::process::Command::new("tar")
            .arg("-xf")
            .arg("-")
            .arg("-C")
            .arg(dir)
            .stdin(std::process::Stdio::piped())
            .spawn()
            .expect("run tar");
        let mut stdin = tar.stdin.take().expect("piped");
        match self {
            #[cfg(feature = "s3")]
            Floor::S3 { store, .. } => {
                use sandbox_harness::s3::object_store::ObjectStoreExt as _;
                let mut body = store
                    .get(&Floor::path(name))
                    .await
                    .expect("s3 floor get")
                    .into_stream();
                while let Some(piece) = body.next().await {
                    stdin
                        .write_all(&piece.expect("s3 floor read"))
                        .await
                        .expect("feed tar");
                }
            }
            #[cfg(feature = "redis")]
            Floor::Redis {
                client,
                in_flight,
                parts,
                ..
            } => {
                let n = parts.lock().expect("parts")[name];
                let conn = client
                    .get_multiplexed_async_connection()
                    .await
                    .expect("connect to Redis");
                let mut pieces = futures::stream::iter(0..n)
                    .map(|i| {
                        let mut c = conn.clone();
                        async move {
                            redis::cmd("GET")
                                .arg(format!("floor:{name}:{i}"))
                                .query_async::<Vec<u8>>(&mut c)
                                .await
                        }
                    })
                    .buffered(*in_flight);
                while let Some(piece) = pieces.next().await {
                    stdin
                        .write_all(&piece.expect("redis floor GET"))
                        .await
                        .expect("feed tar");
                }
            }
        }
        drop(stdin);
        let status = tar.wait().await.expect("tar");
        assert!(status.success(), "tar -x: {status}");
        ms(started.elapsed())
    }

    /// Remove what [`upload`](Self::upload) wrote for `name`.
    async fn clear(&self, name: &str) {
        match self {
            #[cfg(feature = "s3")]
            Floor::S3 { store, .. } => {
                use sandbox_harness::s3::object_store::ObjectStoreExt as _;
                store
                    .delete(&Floor::path(name))
                    .await
                    .expect("s3 floor delete");
            }
            #[cfg(feature = "redis")]
            Floor::Redis { client, parts, .. } => {
                let n = parts.lock().expect("parts").remove(name).unwrap_or(0);
                let mut c = client
                    .get_multiplexed_async_connection()
                    .await
                    .expect("connect to Redis");
                for i in 0..n {
                    redis::cmd("DEL")
                        .arg(format!("floor:{name}:{i}"))
                        .query_async::<()>(&mut c)
                        .await
                        .expect("redis floor DEL");
                }
            }
        }
    }
}

/// Up to `n` bytes from `r` (fewer only at its end; empty at its end).
#[cfg(any(feature = "s3", feature = "redis"))]
async fn read_piece(r: &mut (impl tokio::io::AsyncRead + Unpin), n: usize) -> bytes::Bytes {
    let mut buf = bytes::BytesMut::with_capacity(n);
    while buf.len() < n {
        if r.read_buf(&mut buf).await.expect("read tar's output") == 0 {
            break;
        }
    }
    buf.freeze()
}
