//! `cargo xtask bench host`: what tracking a command in its own cgroup costs `host::run`.
//!
//! Spawn-to-exit of `true`, 200 runs each (after 10 warm-up runs): with this machine's
//! tracking, the command joining through the `/bin/sh` wrapper (a minimal environment) and
//! joining from outside (an environment with a name a shell would drop), against a baseline
//! run of this binary with `SANDBOX_HARNESS_TREE_KILL=process-group` (no cgroup). Prints a
//! table; with `SANDBOX_BENCH_OUT` set, also writes `host.json` there.

use std::path::Path;
use std::time::{Duration, Instant};

use sandbox_core::host::{self, HostCommand, TREE_KILL_VAR};
use serde_json::json;

const RUNS: usize = 200;
const WARM_UP: usize = 10;

/// Microseconds.
fn us(d: Duration) -> f64 {
    d.as_secs_f64() * 1e6
}

/// Median, 90th percentile and mean of `runs`, in microseconds.
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

async fn measure(dir: &Path, extra: &[(&str, &str)]) -> serde_json::Value {
    let command = || {
        HostCommand::new(["true"], dir)
            .envs(host::minimal_env(dir))
            .envs(extra.iter().copied())
    };
    let mut runs = Vec::with_capacity(RUNS);
    for i in 0..WARM_UP + RUNS {
        let started = Instant::now();
        let r = host::run(command(), "bench").await.expect("run true");
        let elapsed = started.elapsed();
        assert_eq!(r.exit_code, Some(0), "{r:?}");
        if i >= WARM_UP {
            runs.push(us(elapsed));
        }
    }
    stats(runs)
}

fn main() {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    let dir = tempfile::tempdir().expect("tempdir");
    let mode = host::tree_kill();

    if std::env::var(TREE_KILL_VAR).as_deref() == Ok("process-group") {
        // The baseline run: one JSON line for the parent run.
        let plain = runtime.block_on(measure(dir.path(), &[]));
        println!("{plain}");
        return;
    }

    let wrapper = runtime.block_on(measure(dir.path(), &[]));
    let outside = runtime.block_on(measure(dir.path(), &[("spring.profiles.active", "dev")]));
    let baseline = std::process::Command::new(std::env::current_exe().expect("own path"))
        .env(TREE_KILL_VAR, "process-group")
        .output()
        .expect("baseline run");
    assert!(baseline.status.success(), "baseline run failed");
    let baseline: serde_json::Value = serde_json::from_slice(&baseline.stdout).expect("baseline");

    let report = json!({
        "tree_kill": mode.as_str(),
        "process_group": baseline,
        "cgroup_by_wrapper": wrapper,
        "cgroup_joined_from_outside": outside,
    });
    println!(
        "host::run of `true` ({RUNS} runs, microseconds), tree kill: {}",
        mode.as_str()
    );
    println!("{:<28} {:>8} {:>8} {:>8}", "", "median", "p90", "mean");
    for key in [
        "process_group",
        "cgroup_by_wrapper",
        "cgroup_joined_from_outside",
    ] {
        let field = |name: &str| report[key][name].as_f64().unwrap_or(f64::NAN);
        println!(
            "{key:<28} {:>8} {:>8} {:>8}",
            field("median_us"),
            field("p90_us"),
            field("mean_us")
        );
    }
    if let Some(out) = std::env::var_os("SANDBOX_BENCH_OUT") {
        let out = Path::new(&out);
        std::fs::create_dir_all(out).expect("output dir");
        let text = serde_json::to_string_pretty(&report).expect("json");
        std::fs::write(out.join("host.json"), text).expect("write host.json");
    }
}
