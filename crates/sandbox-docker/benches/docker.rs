//! `cargo xtask bench docker`: the Docker backend against the docker CLI on the same engine.
//!
//! Phases: cold create+start to first exec (baseline `docker run -d` + `docker exec`), warm
//! start of a kept container (baseline `docker start` + `docker exec`), 200 exec round trips
//! of `true` (baseline 200 × `docker exec`), and snapshot/restore of workloads A (1,000 files
//! × 1 KiB) and B (100 files × 1 MiB random) (baseline `docker cp` out and in). Then the
//! chunked format on busybox and Debian: B's first full snapshot (a fresh store each round;
//! baseline `docker cp` out of the same tree in the same run) and a stop with nothing changed
//! (baseline one `docker exec … true`); and the exec latency a user sees on Debian: `true`
//! through `manager.call` → `sandbox.exec` against the handle's exec on the same image and
//! against `docker exec`. Writes `target/bench/docker.json`: one object per workload and
//! phase.

use std::process::Command;
use std::time::{Duration, Instant};

use std::sync::Arc;

use sandbox_core::snapshot::{self, SnapshotFormat, SnapshotSpec};
use sandbox_core::{
    BoxHandle, CallContext, CreateRequest, ExecRequest, IsolationScope, MemoryStateStore,
    Persistence, SandboxClient, SandboxConfig, SandboxManager, WorkspaceSpec,
};
use sandbox_docker::{DockerClient, DockerOptions, PullPolicy};
use serde_json::json;

const IMAGE: &str = "sandbox-harness-test/busybox:latest";
const DEBIAN: &str = "sandbox-harness-test/debian:latest";

/// Workload B's generator: 100 files of 1 MiB random bytes.
const B_SCRIPT: &str = "mkdir -p b && i=0; while [ $i -lt 100 ]; do head -c 1048576 /dev/urandom > b/f$i; i=$((i+1)); done";

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    v[v.len() / 2]
}

/// Reset this process's peak RSS (Linux `clear_refs` 5) and read it back later.
fn reset_peak() {
    let _ = std::fs::write("/proc/self/clear_refs", "5");
}

fn peak_kib() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmHWM:"))
                .and_then(|l| l.split_whitespace().nth(1).and_then(|v| v.parse().ok()))
        })
        .unwrap_or(0)
}

/// Run a shell line (the CLI baseline), returning wall time and the peak RSS of the command
/// (GNU time's `%M`, in KiB).
fn cli(line: &str) -> (Duration, u64) {
    let rss_file = std::env::temp_dir().join(format!("sbx-bench-rss-{}", std::process::id()));
    let t = Instant::now();
    let status = Command::new("/usr/bin/time")
        .args(["-f", "%M", "-o"])
        .arg(&rss_file)
        .args(["sh", "-c", line])
        .status()
        .expect("run");
    let elapsed = t.elapsed();
    assert!(status.success(), "`{line}` failed");
    let rss = std::fs::read_to_string(&rss_file)
        .ok()
        .and_then(|s| s.trim().parse().ok())
        .unwrap_or(0);
    (elapsed, rss)
}

/// Before a measured snapshot and its `docker cp` baseline: write back what earlier runs left
/// dirty, so neither pays for the other's writeback (an fsync on ext4 can wait for other
/// files' dirty data).
fn settle() {
    quiet("sync");
}

fn quiet(line: &str) {
    let _ = Command::new("sh").args(["-c", line]).output();
}

struct Row {
    workload: &'static str,
    phase: String,
    ours_ms: f64,
    baseline_ms: f64,
    bytes_written: u64,
    ours_rss: u64,
    baseline_rss: u64,
    baseline: &'static str,
}

fn client(prefix: &str, persistence: Persistence) -> DockerClient {
    client_on(IMAGE, prefix, persistence)
}

fn client_on(image: &str, prefix: &str, persistence: Persistence) -> DockerClient {
    DockerClient::new(
        DockerOptions::new(image)
            .name_prefix(prefix)
            .pull_policy(PullPolicy::Never)
            .persistence(persistence),
    )
    .expect("client")
}

async fn new_box(c: &DockerClient) -> Box<dyn BoxHandle> {
    let h = c
        .create(CreateRequest::new(&WorkspaceSpec::default(), None))
        .await
        .expect("create");
    h.boot().await.expect("boot");
    h
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let prefix = format!(
        "sbxbench{}",
        &uuid::Uuid::new_v4().simple().to_string()[..6]
    );
    let c = client(&prefix, Persistence::Ephemeral);
    c.ensure_image()
        .await
        .expect("image (run `cargo xtask images`)");
    let run_d = format!(
        "docker run -d --network none --init --entrypoint sleep --label io.sandbox-harness.owner={prefix}"
    );
    let mut rows = Vec::new();

    // Cold create + start to the first exec.
    let (mut ours, mut base, mut ours_rss, mut base_rss) = (vec![], vec![], 0, 0);
    for i in 0..5 {
        reset_peak();
        let t = Instant::now();
        let h = new_box(&c).await;
        let r = h.exec(ExecRequest::argv(["true"])).await.expect("exec");
        ours.push(ms(t.elapsed()));
        ours_rss = ours_rss.max(peak_kib());
        assert!(r.success());
        h.destroy().await.expect("destroy");
        let name = format!("{prefix}-cli-cold-{i}");
        let (d, rss) = cli(&format!(
            "{run_d} --name {name} {IMAGE} 2147483647 >/dev/null && docker exec {name} true"
        ));
        base.push(ms(d));
        base_rss = base_rss.max(rss);
        quiet(&format!("docker rm -f {name}"));
    }
    rows.push(Row {
        workload: "-",
        phase: "cold start to first exec".into(),
        ours_ms: median(ours),
        baseline_ms: median(base),
        bytes_written: 0,
        ours_rss,
        baseline_rss: base_rss,
        baseline: "docker run -d + docker exec",
    });

    // Warm start of a kept (stopped) container.
    let keep = client(&prefix, Persistence::Keep);
    let h = new_box(&keep).await;
    let state = h.state();
    let cli_name = format!("{prefix}-cli-warm");
    quiet(&format!("{run_d} --name {cli_name} {IMAGE} 2147483647"));
    let (mut ours, mut base, mut ours_rss, mut base_rss) = (vec![], vec![], 0, 0);
    for _ in 0..5 {
        h.release().await.expect("stop");
        quiet(&format!("docker stop -t 2 {cli_name}"));
        reset_peak();
        let t = Instant::now();
        let h2 = keep
            .resume(&*state, &WorkspaceSpec::default())
            .await
            .expect("resume");
        h2.boot().await.expect("boot");
        let r = h2.exec(ExecRequest::argv(["true"])).await.expect("exec");
        ours.push(ms(t.elapsed()));
        ours_rss = ours_rss.max(peak_kib());
        assert!(r.success());
        let (d, rss) = cli(&format!(
            "docker start {cli_name} >/dev/null && docker exec {cli_name} true"
        ));
        base.push(ms(d));
        base_rss = base_rss.max(rss);
    }
    rows.push(Row {
        workload: "-",
        phase: "warm start (keep) to first exec".into(),
        ours_ms: median(ours),
        baseline_ms: median(base),
        bytes_written: 0,
        ours_rss,
        baseline_rss: base_rss,
        baseline: "docker start + docker exec",
    });

    // 200 exec round trips of `true`.
    h.boot().await.expect("boot");
    quiet(&format!("docker start {cli_name}"));
    reset_peak();
    let t = Instant::now();
    for _ in 0..200 {
        let r = h.exec(ExecRequest::argv(["true"])).await.expect("exec");
        assert!(r.success());
    }
    let ours = ms(t.elapsed());
    let ours_rss = peak_kib();
    let (d, rss) = cli(&format!(
        "i=0; while [ $i -lt 200 ]; do docker exec {cli_name} true || exit 1; i=$((i+1)); done"
    ));
    rows.push(Row {
        workload: "-",
        phase: "exec round trip `true` x200".into(),
        ours_ms: ours,
        baseline_ms: ms(d),
        bytes_written: 0,
        ours_rss,
        baseline_rss: rss,
        baseline: "200 x docker exec",
    });
    h.destroy().await.expect("destroy");
    quiet(&format!("docker rm -f {cli_name}"));

    // Snapshot / restore workloads.
    let dir = tempfile::tempdir().expect("tmp");
    let spec = SnapshotSpec::local_dir(dir.path().join("snapshots"));
    for (workload, script) in [
        (
            "A: 1,000 files x 1 KiB",
            "mkdir -p a && i=0; while [ $i -lt 1000 ]; do head -c 1024 /dev/urandom > a/f$i; i=$((i+1)); done",
        ),
        ("B: 100 files x 1 MiB random", B_SCRIPT),
    ] {
        let src = new_box(&c).await;
        let r = src
            .exec(ExecRequest::shell(script).timeout(Duration::from_secs(300)))
            .await
            .expect("generate");
        assert!(r.success(), "{r:?}");
        let src_name = {
            let s = src.state();
            s.downcast::<sandbox_docker::DockerState>("docker")
                .expect("state")
                .container_name
                .clone()
        };
        let tar = dir.path().join("cli.tar");
        let (mut so, mut sb, mut ro, mut rb) = (vec![], vec![], vec![], vec![]);
        let (mut bytes, mut cli_bytes, mut s_rss, mut sb_rss, mut r_rss, mut rb_rss) =
            (0, 0, 0, 0, 0, 0);
        for i in 0..3 {
            settle();
            reset_peak();
            let t = Instant::now();
            // No parent: a full snapshot each round, as the CLI copies everything.
            let snap = snapshot::take(&*src, &spec, snapshot::TakeRequest::new("bench"))
                .await
                .expect("snapshot")
                .snapshot;
            so.push(ms(t.elapsed()));
            s_rss = s_rss.max(peak_kib());
            bytes = snap.size;
            settle();
            let (d, rss) = cli(&format!(
                "docker cp {src_name}:/workspace - > {}",
                tar.display()
            ));
            sb.push(ms(d));
            sb_rss = sb_rss.max(rss);
            cli_bytes = std::fs::metadata(&tar).map(|m| m.len()).unwrap_or(0);

            let dst = new_box(&c).await;
            reset_peak();
            let t = Instant::now();
            snapshot::restore(&*dst, &spec, &snap, vec![], false)
                .await
                .expect("restore");
            ro.push(ms(t.elapsed()));
            r_rss = r_rss.max(peak_kib());
            if i == 0 {
                let n = dst.list().await.expect("list").len();
                assert!(n > 100, "restored {n} entries");
            }
            dst.destroy().await.expect("destroy");
            let name = format!("{prefix}-cli-restore");
            quiet(&format!("{run_d} --name {name} {IMAGE} 2147483647"));
            let (d, rss) = cli(&format!("docker cp - {name}:/ < {}", tar.display()));
            rb.push(ms(d));
            rb_rss = rb_rss.max(rss);
            quiet(&format!("docker rm -f {name}"));
        }
        src.destroy().await.expect("destroy");
        rows.push(Row {
            workload,
            phase: "snapshot".into(),
            ours_ms: median(so),
            baseline_ms: median(sb),
            bytes_written: bytes,
            ours_rss: s_rss,
            baseline_rss: sb_rss,
            baseline: "docker cp out",
        });
        rows.push(Row {
            workload,
            phase: "restore".into(),
            ours_ms: median(ro),
            baseline_ms: median(rb),
            bytes_written: bytes,
            ours_rss: r_rss,
            baseline_rss: rb_rss,
            baseline: "docker cp in",
        });
        let _ = cli_bytes;
    }
    for (image, label) in [(IMAGE, "busybox"), (DEBIAN, "debian")] {
        chunked_rows(&mut rows, image, label, &prefix).await;
    }
    exec_rows(&mut rows, &prefix, &run_d).await;
    quiet(&format!(
        "docker ps -aq --filter label=io.sandbox-harness.owner={prefix} | xargs -r docker rm -fv"
    ));

    let out: Vec<_> = rows
        .iter()
        .map(|r| {
            json!({
                "workload": r.workload,
                "phase": r.phase,
                "ours_ms": (r.ours_ms * 10.0).round() / 10.0,
                "baseline_ms": (r.baseline_ms * 10.0).round() / 10.0,
                "ratio": ((r.ours_ms / r.baseline_ms) * 100.0).round() / 100.0,
                "bytes_written": r.bytes_written,
                "peak_rss_kib": r.ours_rss,
                "baseline_peak_rss_kib": r.baseline_rss,
                "baseline": r.baseline,
            })
        })
        .collect();
    let target = std::env::var_os("SANDBOX_BENCH_OUT")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|| {
            std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../target/bench")
        });
    std::fs::create_dir_all(&target).expect("mkdir");
    let path = target.join("docker.json");
    std::fs::write(&path, serde_json::to_string_pretty(&out).expect("json")).expect("write");
    println!(
        "| workload | phase | ours ms | baseline | baseline ms | ratio | bytes | peak RSS KiB (ours / CLI) |"
    );
    println!("| --- | --- | ---: | --- | ---: | ---: | ---: | ---: |");
    for r in &rows {
        println!(
            "| {} | {} | {:.1} | {} | {:.1} | {:.2} | {} | {} / {} |",
            r.workload,
            r.phase,
            r.ours_ms,
            r.baseline,
            r.baseline_ms,
            r.ours_ms / r.baseline_ms,
            r.bytes_written,
            r.ours_rss,
            r.baseline_rss
        );
    }
    println!("wrote {}", path.display());
}

fn container_name(h: &dyn BoxHandle) -> String {
    h.state()
        .downcast::<sandbox_docker::DockerState>("docker")
        .expect("state")
        .container_name
        .clone()
}

/// The chunked format on `image`: workload B's first full snapshot against `docker cp` out of
/// the same tree, and a stop with nothing changed.
async fn chunked_rows(rows: &mut Vec<Row>, image: &str, label: &str, prefix: &str) {
    let c = client_on(image, prefix, Persistence::Ephemeral);
    let src = new_box(&c).await;
    let r = src
        .exec(ExecRequest::shell(B_SCRIPT).timeout(Duration::from_secs(300)))
        .await
        .expect("generate");
    assert!(r.success(), "{r:?}");
    let name = container_name(&*src);
    let dir = tempfile::tempdir().expect("tmp");
    let tar = dir.path().join("cli.tar");
    let (mut ours, mut base, mut bytes, mut rss, mut base_rss) = (vec![], vec![], 0, 0, 0);
    let mut last = None;
    for round in 0..3 {
        // A fresh store each round: a first snapshot, every chunk written.
        let spec = SnapshotSpec::local_dir(dir.path().join(format!("store-{round}")))
            .format(SnapshotFormat::Chunked);
        settle();
        reset_peak();
        let t = Instant::now();
        let taken = snapshot::take(&*src, &spec, snapshot::TakeRequest::new("bench"))
            .await
            .expect("snapshot");
        ours.push(ms(t.elapsed()));
        rss = rss.max(peak_kib());
        bytes = taken.bytes_written;
        settle();
        let (d, r) = cli(&format!(
            "docker cp {name}:/workspace - > {}",
            tar.display()
        ));
        base.push(ms(d));
        base_rss = base_rss.max(r);
        last = Some((spec, taken));
    }
    // The backend's share of it: the export of the 100 listed files, drained.
    let paths: Vec<_> = (0..100)
        .map(|i| sandbox_core::RelPath::new(format!("b/f{i}")).expect("path"))
        .collect();
    let (mut export, mut export_base) = (vec![], vec![]);
    for _ in 0..3 {
        let mut request = sandbox_core::ExportRequest::default();
        request.paths = Some(paths.clone());
        let t = Instant::now();
        let mut stream = src.export(&request).await.expect("export");
        let mut n = 0;
        while let Some(chunk) = futures::StreamExt::next(&mut stream).await {
            n += chunk.expect("chunk").len();
        }
        export.push(ms(t.elapsed()));
        assert!(n > 100 << 20, "exported {n} bytes");
        let (d, _) = cli(&format!(
            "docker cp {name}:/workspace - > {}",
            tar.display()
        ));
        export_base.push(ms(d));
    }
    rows.push(Row {
        workload: "B: 100 files x 1 MiB random",
        phase: format!("export of the 100 listed files, drained ({label})"),
        ours_ms: median(export),
        baseline_ms: median(export_base),
        bytes_written: 0,
        ours_rss: 0,
        baseline_rss: 0,
        baseline: "docker cp out",
    });
    rows.push(Row {
        workload: "B: 100 files x 1 MiB random",
        phase: format!("chunked first full snapshot ({label})"),
        ours_ms: median(ours),
        baseline_ms: median(base),
        bytes_written: bytes,
        ours_rss: rss,
        baseline_rss: base_rss,
        baseline: "docker cp out",
    });

    // Nothing changed since the last snapshot: the stop only lists the box.
    let (spec, taken) = last.expect("a snapshot");
    let mut parent = (taken.snapshot.clone(), taken.manifest.clone());
    let (mut ours, mut base, mut rss) = (vec![], vec![], 0);
    // The listing's racy-entry rule re-reads files written within two clock ticks of the
    // parent's listing: let them age first.
    tokio::time::sleep(Duration::from_millis(50)).await;
    for _ in 0..10 {
        reset_peak();
        let t = Instant::now();
        let again = snapshot::take(
            &*src,
            &spec,
            snapshot::TakeRequest::new("bench").parent(Some(parent.clone())),
        )
        .await
        .expect("snapshot");
        ours.push(ms(t.elapsed()));
        rss = rss.max(peak_kib());
        assert!(again.unchanged, "nothing changed");
        parent = (again.snapshot, again.manifest);
        let (d, _) = cli(&format!("docker exec {name} true"));
        base.push(ms(d));
    }
    rows.push(Row {
        workload: "B: 100 files x 1 MiB random",
        phase: format!("chunked stop, nothing changed ({label})"),
        ours_ms: median(ours),
        baseline_ms: median(base),
        bytes_written: 0,
        ours_rss: rss,
        baseline_rss: 0,
        baseline: "docker exec true",
    });
    // The same on a fresh handle (a call that ran no command): right after boot, while the
    // agent boot started in the background is still starting, and after 200 ms of other work.
    for (idle_ms, what) in [
        (0, "right after boot (agent starting)"),
        (200, "200 ms after boot, no command ran"),
    ] {
        let mut times = Vec::new();
        for _ in 0..5 {
            let state = src.state();
            let fresh = c
                .resume(&*state, &WorkspaceSpec::default())
                .await
                .expect("resume");
            fresh.boot().await.expect("boot");
            tokio::time::sleep(Duration::from_millis(idle_ms)).await;
            let t = Instant::now();
            let again = snapshot::take(
                &*fresh,
                &spec,
                snapshot::TakeRequest::new("bench").parent(Some(parent.clone())),
            )
            .await
            .expect("snapshot");
            times.push(ms(t.elapsed()));
            assert!(again.unchanged, "nothing changed");
            parent = (again.snapshot, again.manifest);
        }
        let base: Vec<f64> = (0..5)
            .map(|_| ms(cli(&format!("docker exec {name} true")).0))
            .collect();
        rows.push(Row {
            workload: "B: 100 files x 1 MiB random",
            phase: format!("chunked stop, nothing changed, {what} ({label})"),
            ours_ms: median(times),
            baseline_ms: median(base),
            bytes_written: 0,
            ours_rss: 0,
            baseline_rss: 0,
            baseline: "docker exec true",
        });
    }
    src.destroy().await.expect("destroy");
}

/// What a user sees per `sandbox.exec` of `true` on the Debian image: through
/// `manager.call` (one call; its closure alternates 200 `sandbox.exec` with 200 execs on the
/// same box's handle, so both see the same machine load), and `docker exec` (medians).
async fn exec_rows(rows: &mut Vec<Row>, prefix: &str, run_d: &str) {
    let client: Arc<dyn SandboxClient> =
        Arc::new(client_on(DEBIAN, prefix, Persistence::Ephemeral));
    let manager = SandboxManager::builder(client)
        .scope(IsolationScope::Session)
        .state_store(Arc::new(MemoryStateStore::new()))
        .config(SandboxConfig::new(WorkspaceSpec::default()))
        .build()
        .expect("manager");
    let ctx = CallContext::new("bench").session("exec");
    let called = manager
        .call(&ctx, |sandbox| async move {
            sandbox
                .exec(ExecRequest::argv(["true"]))
                .await
                .expect("exec");
            let (mut through, mut direct) = (Vec::new(), Vec::new());
            for _ in 0..200 {
                let t = Instant::now();
                let r = sandbox
                    .exec(ExecRequest::argv(["true"]))
                    .await
                    .expect("exec");
                through.push(ms(t.elapsed()));
                assert!(r.success());
                let t = Instant::now();
                let r = sandbox
                    .handle()
                    .exec(ExecRequest::argv(["true"]))
                    .await
                    .expect("exec");
                direct.push(ms(t.elapsed()));
                assert!(r.success());
            }
            (median(through), median(direct))
        })
        .await
        .expect("call");
    let (through, direct) = called.value;
    let cli_name = format!("{prefix}-cli-exec");
    quiet(&format!("{run_d} --name {cli_name} {DEBIAN} 2147483647"));
    let mut cli_times = Vec::new();
    for _ in 0..50 {
        let (d, _) = cli(&format!("docker exec {cli_name} true"));
        cli_times.push(ms(d));
    }
    quiet(&format!("docker rm -f {cli_name}"));
    rows.push(Row {
        workload: "-",
        phase: "exec `true` (debian), handle.exec, median".into(),
        ours_ms: direct,
        baseline_ms: median(cli_times),
        bytes_written: 0,
        ours_rss: 0,
        baseline_rss: 0,
        baseline: "docker exec",
    });
    rows.push(Row {
        workload: "-",
        phase: "exec `true` (debian), manager.call -> sandbox.exec, median".into(),
        ours_ms: through,
        baseline_ms: direct,
        bytes_written: 0,
        ours_rss: 0,
        baseline_rss: 0,
        baseline: "handle.exec, same box, interleaved",
    });
}
