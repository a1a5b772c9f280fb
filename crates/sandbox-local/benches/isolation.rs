//! `cargo xtask bench local-isolation`: what confinement costs the local backend.
//!
//! Rows (200 calls each after 10 warm-up calls, medians and p90 in microseconds):
//! exec round trip of `true` through a box unconfined (`Isolation::HostShell`) and confined
//! (`Isolation::Confined`); baselines measured in the same run: a bare `sh -c true` spawn and
//! `bwrap --unshare-all --ro-bind / / true` (Debian's bubblewrap, skipped if not installed);
//! box create + boot + first exec + release, confined (50 runs); peak RSS of one idle
//! confined box (its init processes, mean of 10 boxes). Prints a table; with
//! `SANDBOX_BENCH_OUT` set, also writes `local-isolation.json` there.

use std::time::{Duration, Instant};

use sandbox_core::{BoxHandle, CreateRequest, ExecRequest, SandboxClient, WorkspaceSpec};
use sandbox_local::{Isolation, LocalClient, LocalOptions};
use serde_json::json;

const RUNS: usize = 200;
const WARM_UP: usize = 10;

fn us(d: Duration) -> f64 {
    d.as_secs_f64() * 1e6
}

fn stats(mut runs: Vec<f64>) -> serde_json::Value {
    runs.sort_by(|a, b| a.total_cmp(b));
    let mean = runs.iter().sum::<f64>() / runs.len() as f64;
    json!({
        "runs": runs.len(),
        "median_us": runs[runs.len() / 2].round(),
        "p90_us": runs[runs.len() * 9 / 10].round(),
        "mean_us": mean.round(),
    })
}

fn median(v: &serde_json::Value) -> f64 {
    v["median_us"].as_f64().unwrap_or(f64::NAN)
}

async fn boxed(client: &LocalClient) -> Box<dyn BoxHandle> {
    let spec = WorkspaceSpec::default();
    let handle = client
        .create(CreateRequest::new(&spec, None))
        .await
        .unwrap();
    handle.boot().await.unwrap();
    // Core creates the workspace when it applies the spec; the bench makes it directly.
    std::fs::create_dir_all(handle.workspace_root()).unwrap();
    handle
}

async fn exec_true(handle: &dyn BoxHandle) -> serde_json::Value {
    let mut runs = Vec::with_capacity(RUNS);
    for i in 0..WARM_UP + RUNS {
        let started = Instant::now();
        let r = handle.exec(ExecRequest::argv(["true"])).await.unwrap();
        let elapsed = started.elapsed();
        assert_eq!(r.exit_code, Some(0), "{r:?}");
        if i >= WARM_UP {
            runs.push(us(elapsed));
        }
    }
    stats(runs)
}

fn spawn_rows(program: &str, args: &[&str]) -> Option<serde_json::Value> {
    let mut runs = Vec::with_capacity(RUNS);
    for i in 0..WARM_UP + RUNS {
        let started = Instant::now();
        let status = std::process::Command::new(program)
            .args(args)
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .status()
            .ok()?;
        let elapsed = started.elapsed();
        if !status.success() {
            return None;
        }
        if i >= WARM_UP {
            runs.push(us(elapsed));
        }
    }
    Some(stats(runs))
}

fn rss_kib(pid: u32) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("VmHWM:"))
                .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        })
        .unwrap_or(0)
}

fn main() {
    sandbox_confine::init_if_child();
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    let base = tempfile::tempdir().expect("tempdir");
    let host = LocalClient::new(
        LocalOptions::default()
            .base_dir(base.path().join("host"))
            .isolation(Isolation::HostShell),
    );
    let confined = LocalClient::new(
        LocalOptions::default()
            .base_dir(base.path().join("confined"))
            .isolation(Isolation::confined()),
    );
    let (unconfined_row, confined_row, create_row) = runtime.block_on(async {
        let h = boxed(&host).await;
        let unconfined = exec_true(h.as_ref()).await;
        h.release().await.unwrap();
        let c = boxed(&confined).await;
        let isolated = exec_true(c.as_ref()).await;
        c.release().await.unwrap();
        let mut runs = Vec::new();
        let spec = WorkspaceSpec::default();
        for i in 0..60 {
            let started = Instant::now();
            let b = confined
                .create(CreateRequest::new(&spec, None))
                .await
                .unwrap();
            b.boot().await.unwrap();
            // The workspace directory exists once a box was imported into; `true` runs in
            // the box directory's workspace, so make it first.
            std::fs::create_dir_all(b.workspace_root()).unwrap();
            let r = b.exec(ExecRequest::argv(["true"])).await.unwrap();
            let elapsed = started.elapsed();
            assert_eq!(r.exit_code, Some(0));
            b.release().await.unwrap();
            if i >= 10 {
                runs.push(us(elapsed));
            }
        }
        (unconfined, isolated, stats(runs))
    });
    let bare = spawn_rows("sh", &["-c", "true"]).expect("sh -c true");
    let bwrap = spawn_rows("bwrap", &["--unshare-all", "--ro-bind", "/", "/", "true"]);

    // Peak RSS of idle confined boxes: the init's outer process and the box's pid 1.
    let dir = tempfile::tempdir().unwrap();
    let boxes: Vec<_> = (0..10)
        .map(|_| {
            sandbox_confine::Confined::start(
                &sandbox_confine::ConfineOptions::default(),
                &[sandbox_confine::Bind::same(dir.path(), false)],
            )
            .expect("confined box")
        })
        .collect();
    let per_box: Vec<u64> = boxes
        .iter()
        .map(|b| rss_kib(b.init_pid()) + b.processes().into_iter().map(rss_kib).sum::<u64>())
        .collect();
    let rss_mean = per_box.iter().sum::<u64>() as f64 / per_box.len() as f64;
    drop(boxes);

    let ratio = |a: f64, b: f64| (a / b * 100.0).round() / 100.0;
    let report = json!({
        "exec_true_unconfined": unconfined_row,
        "exec_true_isolated": confined_row,
        "bare_sh_c_true": bare,
        "bwrap_unshare_all_true": bwrap,
        "box_create_first_exec_isolated": create_row,
        "idle_box_peak_rss_kib": rss_mean.round(),
        "isolated_vs_bare": ratio(median(&confined_row), median(&bare)),
        "isolated_vs_bwrap": bwrap.as_ref().map(|b| ratio(median(&confined_row), median(b))),
    });
    println!("| row | median µs | p90 µs |");
    println!("| --- | ---: | ---: |");
    for (name, row) in [
        ("exec `true`, unconfined box", &unconfined_row),
        ("exec `true`, isolated box", &confined_row),
        ("bare `sh -c true` spawn", &bare),
        ("box create + first exec, isolated", &create_row),
    ] {
        println!("| {name} | {} | {} |", row["median_us"], row["p90_us"]);
    }
    match &bwrap {
        Some(b) => println!(
            "| `bwrap --unshare-all --ro-bind / / true` | {} | {} |",
            b["median_us"], b["p90_us"]
        ),
        None => println!("| bwrap | not installed or refused | |"),
    }
    println!("idle box peak RSS: {rss_mean:.0} KiB");
    println!(
        "isolated/bare {}; isolated/bwrap {}",
        report["isolated_vs_bare"], report["isolated_vs_bwrap"]
    );
    if let Ok(out) = std::env::var("SANDBOX_BENCH_OUT") {
        std::fs::create_dir_all(&out).unwrap();
        std::fs::write(
            std::path::Path::new(&out).join("local-isolation.json"),
            serde_json::to_vec_pretty(&report).unwrap(),
        )
        .unwrap();
    }
}
