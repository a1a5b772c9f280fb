//! `cargo xtask bench local`: the local backend's per-call costs against same-run floors.
//!
//! Rows (every round measures ours and its floor back to back, so a loaded machine slows both;
//! the ratio is per round, and the summary gives the median ratio over rounds):
//!
//! - `create_start`: `manager.begin` of an empty call on a new key (the README's durable set-up:
//!   `FileGuard`, `FileStateStore`, local-dir snapshots, ephemeral boxes), then `finish`. Floor:
//!   the file operations the call's durability needs, done directly with `std::fs` (see
//!   [`floor_call`]). Each round runs in a fresh child process (the cost of a process's first
//!   calls is part of what a user sees, and a per-process mode shows as a spread between rounds).
//! - `exec_true`: `sandbox.exec(ExecRequest::shell("true"))` inside a call (bash, the default
//!   shell, with this machine's tree kill). Floors: `sh -c true` and `bash -c true` spawned with
//!   `std::process::Command` and waited for.
//! - `rehash_after_one_change`: a call writes 20 files and stops (the snapshot's listing in the
//!   same second as the writes), the next call rewrites one file and stops: the files that stop
//!   re-read (`StopReport::files_hashed`), on a kept box (warm start: 1) and on an ephemeral
//!   one (the second call restores first; restored files get whole-second mtimes from the
//!   archive headers, so a restore within a second of the writes leaves them racy).
//! - syscalls per call (with `strace` on the machine): fsyncs, fdatasyncs and directory
//!   creations (`mkdir`/`mkdirat`, failed ones counted apart) of `create_start` calls, and of the
//!   floor, counted by `strace -f -c` around a child running N calls minus one running none.
//!
//! Output: a table on stdout and `local.json` in `SANDBOX_BENCH_OUT` (`cargo xtask bench local`
//! sets it to `<workspace>/target/bench`). `SANDBOX_BENCH_ROUNDS` (default 5) sets the rounds.

use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;
use std::time::{Duration, Instant};

use sandbox_core::{
    Acquire, CallContext, ExecRequest, FileGuard, FileStateStore, IsolationScope, Persistence,
    RelPath, SandboxConfig, SandboxManager, SnapshotSpec, WorkspaceSpec,
};
use sandbox_local::{LocalClient, LocalOptions};
use serde_json::{Value, json};

/// Calls per `create_start` round (each on a new key).
const CALLS: usize = 30;
/// Commands per `exec_true` round.
const EXECS: usize = 100;
/// Files the re-hash workload writes.
const FILES: usize = 20;

fn main() {
    let args: Vec<String> = std::env::args()
        .skip(1)
        .filter(|a| a != "--bench")
        .collect();
    match args.first().map(String::as_str) {
        Some("child-create") => {
            let calls: usize = args[1].parse().expect("calls");
            let floor = args.get(2).map(String::as_str) == Some("floor");
            println!("{}", child_create(calls, floor));
        }
        _ => driver(),
    }
}

fn env_usize(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime")
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    if v.is_empty() {
        return f64::NAN;
    }
    v[v.len() / 2]
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

/// The README's durable single-host set-up under `root`.
fn manager(root: &Path) -> SandboxManager {
    manager_with(root, Persistence::Ephemeral)
}

fn manager_with(root: &Path, persistence: Persistence) -> SandboxManager {
    let client = Arc::new(LocalClient::new(
        LocalOptions::default()
            .base_dir(root.join("boxes"))
            .persistence(persistence),
    ));
    SandboxManager::builder(client)
        .scope(IsolationScope::User)
        .state_store(Arc::new(FileStateStore::new(root.join("state"))))
        .guard(Arc::new(FileGuard::new(root.join("leases"))))
        .config(
            SandboxConfig::new(WorkspaceSpec::default())
                .snapshots(SnapshotSpec::local_dir(root.join("snapshots"))),
        )
        .require_durable()
        .build()
        .expect("manager")
}

// ---------------------------------------------------------------------------------------------
// create_start

/// In a child process: `calls` empty calls on new keys (or the floor's file operations);
/// one JSON line with the per-call times in ms.
fn child_create(calls: usize, floor: bool) -> Value {
    let dir = tempfile::tempdir_in(bench_root()).expect("tempdir");
    if floor {
        let mut times = Vec::with_capacity(calls);
        for i in 0..calls {
            let started = Instant::now();
            floor_call(dir.path(), i).expect("floor call");
            times.push(ms(started.elapsed()));
        }
        return json!({ "call_ms": times });
    }
    let rt = runtime();
    rt.block_on(async {
        let manager = manager(dir.path());
        let (mut begin, mut total) = (Vec::new(), Vec::new());
        for i in 0..calls {
            let ctx = CallContext::new("bench").user(format!("u{i}"));
            let started = Instant::now();
            let call = manager.begin(&ctx, Acquire::Auto).await.expect("begin");
            begin.push(ms(started.elapsed()));
            call.finish().await.expect("finish");
            total.push(ms(started.elapsed()));
        }
        json!({ "begin_ms": begin, "call_ms": total })
    })
}

/// What an empty keyed call's durability needs, done directly: the lease record written
/// (tmp + rename, no fsync: a lost record after a crash costs nothing, tokens are seeded from
/// the clock), the fence registered (tmp + rename; no fsync on a new key: there is no state
/// a crash could empty), the box directory and its workspace created, the
/// empty snapshot's manifest stored (tmp + fsync + rename + fsync of its directory, and of
/// the new directory's parent), the state saved (tmp + fsync + rename + fsync of the
/// directory), the lease freed (tmp + rename).
fn floor_call(root: &Path, i: usize) -> std::io::Result<()> {
    let write = |path: &Path, data: &[u8], sync: bool| -> std::io::Result<()> {
        let tmp = path.with_extension("tmp");
        let mut f = std::fs::File::create(&tmp)?;
        f.write_all(data)?;
        if sync {
            f.sync_all()?;
        }
        std::fs::rename(&tmp, path)
    };
    let sync_dir = |dir: &Path| std::fs::File::open(dir)?.sync_all();
    let (leases, state, snaps, boxes) = (
        root.join("leases"),
        root.join("state"),
        root.join("snapshots"),
        root.join("boxes"),
    );
    if i == 0 {
        for d in [&leases, &state, &snaps, &boxes] {
            std::fs::create_dir_all(d)?;
        }
    }
    let record = br#"{"owner":"0123456789abcdef0123456789abcdef","token":1,"expires_unix_ms":1}"#;
    write(&leases.join(format!("u{i}.lease")), record, false)?;
    let slot = state.join(format!("u{i}.json"));
    write(&slot, br#"{"fence":1,"state":null}"#, false)?;
    let box_dir = boxes.join(format!("k-{i:016x}"));
    std::fs::create_dir(&box_dir)?;
    std::fs::create_dir(box_dir.join("workspace"))?;
    let ns = snaps.join(format!("{i:016x}"));
    std::fs::create_dir(&ns)?;
    write(&ns.join("m.manifest"), &[b'x'; 200], true)?;
    sync_dir(&ns)?;
    sync_dir(&snaps)?;
    write(&slot, &[b'y'; 600], true)?;
    sync_dir(&state)?;
    write(&leases.join(format!("u{i}.lease")), record, false)?;
    std::fs::remove_dir_all(&box_dir)
}

/// Where the benchmark's temporary directories go: the system's temporary directory unless
/// `SANDBOX_BENCH_DIR` says otherwise (fsync costs depend on the filesystem).
fn bench_root() -> PathBuf {
    std::env::var_os("SANDBOX_BENCH_DIR").map_or_else(std::env::temp_dir, PathBuf::from)
}

fn run_child(args: &[&str]) -> Value {
    let out = Command::new(std::env::current_exe().expect("own path"))
        .args(args)
        .output()
        .expect("child");
    assert!(
        out.status.success(),
        "child {args:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).expect("child json")
}

fn floats(v: &Value) -> Vec<f64> {
    v.as_array()
        .map(|a| a.iter().filter_map(Value::as_f64).collect())
        .unwrap_or_default()
}

/// Per-call syscall counts of `args` (a child running `calls` calls), from `strace -f -c`,
/// minus a child running none. `None` without strace.
fn syscalls_per_call(kind: &str, calls: usize) -> Option<Value> {
    let exe = std::env::current_exe().ok()?;
    let count = |n: usize| -> Option<std::collections::BTreeMap<String, (f64, f64)>> {
        let out = tempfile::NamedTempFile::new().ok()?;
        let mut args = vec![
            "-f".to_owned(),
            "-c".to_owned(),
            "-o".to_owned(),
            out.path().display().to_string(),
            "-e".to_owned(),
            "trace=fsync,fdatasync,mkdir,mkdirat,rmdir".to_owned(),
            exe.display().to_string(),
            "child-create".to_owned(),
            n.to_string(),
        ];
        if kind == "floor" {
            args.push("floor".to_owned());
        }
        let status = Command::new("strace")
            .args(&args)
            .stdout(std::process::Stdio::null())
            .status()
            .ok()?;
        if !status.success() {
            return None;
        }
        Some(parse_strace_summary(
            &std::fs::read_to_string(out.path()).ok()?,
        ))
    };
    let with = count(calls)?;
    let without = count(0)?;
    let per_call = |name: &str| {
        let (c1, e1) = with.get(name).copied().unwrap_or_default();
        let (c0, e0) = without.get(name).copied().unwrap_or_default();
        ((c1 - c0) / calls as f64, (e1 - e0) / calls as f64)
    };
    let (fsync, _) = per_call("fsync");
    let (fdatasync, _) = per_call("fdatasync");
    let (mkdir, mkdir_failed) = per_call("mkdir");
    let (mkdirat, mkdirat_failed) = per_call("mkdirat");
    let (rmdir, _) = per_call("rmdir");
    Some(json!({
        "fsync": fsync,
        "fdatasync": fdatasync,
        "mkdir": mkdir + mkdirat,
        "mkdir_failed": mkdir_failed + mkdirat_failed,
        "rmdir": rmdir,
    }))
}

/// `strace -c` table: syscall name → (calls, errors).
fn parse_strace_summary(text: &str) -> std::collections::BTreeMap<String, (f64, f64)> {
    let mut out = std::collections::BTreeMap::new();
    for line in text.lines() {
        let fields: Vec<&str> = line.split_whitespace().collect();
        // `% time  seconds  usecs/call  calls  [errors]  syscall`
        if fields.len() < 5 || fields[0].parse::<f64>().is_err() {
            continue;
        }
        let name = fields[fields.len() - 1];
        if name == "total" {
            continue;
        }
        let calls: f64 = fields[3].parse().unwrap_or(0.0);
        let errors: f64 = if fields.len() == 6 {
            fields[4].parse().unwrap_or(0.0)
        } else {
            0.0
        };
        out.insert(name.to_owned(), (calls, errors));
    }
    out
}

// ---------------------------------------------------------------------------------------------
// exec_true

async fn exec_round(manager: &SandboxManager) -> (f64, f64, f64) {
    let ctx = CallContext::new("bench").user("exec");
    let ours = manager
        .call(&ctx, |sandbox| async move {
            let mut times = Vec::with_capacity(EXECS);
            for _ in 0..EXECS {
                let started = Instant::now();
                let r = sandbox
                    .exec(ExecRequest::shell("true"))
                    .await
                    .expect("exec");
                times.push(ms(started.elapsed()));
                assert_eq!(r.exit_code, Some(0));
            }
            times
        })
        .await
        .expect("exec call")
        .value;
    let bare = |program: &str| {
        let mut times = Vec::with_capacity(EXECS);
        for _ in 0..EXECS {
            let started = Instant::now();
            let status = Command::new(program)
                .args(["-c", "true"])
                .status()
                .expect("spawn");
            times.push(ms(started.elapsed()));
            assert!(status.success());
        }
        median(times)
    };
    let sh = bare("sh");
    let bash = bare("bash");
    (median(ours), sh, bash)
}

// ---------------------------------------------------------------------------------------------
// rehash_after_one_change

async fn rehash_round(manager: &SandboxManager, round: usize) -> u64 {
    let ctx = CallContext::new("bench").user(format!("rehash{round}"));
    manager
        .call(&ctx, |sandbox| async move {
            for f in 0..FILES {
                let path = RelPath::new(format!("src/file{f}.txt")).expect("path");
                sandbox
                    .handle()
                    .write_file(&path, format!("content {f}\n").into(), 0o644)
                    .await
                    .expect("write");
            }
        })
        .await
        .expect("first call");
    let called = manager
        .call(&ctx, |sandbox| async move {
            let path = RelPath::new("src/file7.txt").expect("path");
            sandbox
                .handle()
                .write_file(&path, "changed!!!\n".into(), 0o644)
                .await
                .expect("write");
        })
        .await
        .expect("second call");
    called.report.stop.expect("stopped").files_hashed
}

// ---------------------------------------------------------------------------------------------
// The driver.

fn driver() {
    let rounds = env_usize("SANDBOX_BENCH_ROUNDS", 5);
    let mut create_rounds = Vec::new();
    let mut exec_rounds = Vec::new();
    let (mut rehash, mut rehash_keep) = (Vec::new(), Vec::new());
    let rt = runtime();
    let dir = tempfile::tempdir_in(bench_root()).expect("tempdir");
    let manager = manager(dir.path());
    let keep_dir = tempfile::tempdir_in(bench_root()).expect("tempdir");
    let keep = manager_with(keep_dir.path(), Persistence::Keep);
    for round in 0..rounds {
        let ours = run_child(&["child-create", &CALLS.to_string()]);
        let floor = run_child(&["child-create", &CALLS.to_string(), "floor"]);
        let begin = median(floats(&ours["begin_ms"]));
        let call = median(floats(&ours["call_ms"]));
        let floor_ms = median(floats(&floor["call_ms"]));
        create_rounds.push(json!({
            "begin_ms": begin,
            "call_ms": call,
            "floor_ms": floor_ms,
            "ratio": call / floor_ms,
            "begin_per_process_ms": floats(&ours["begin_ms"]),
        }));
        let (ours, sh, bash) = rt.block_on(exec_round(&manager));
        exec_rounds.push(json!({
            "ours_ms": ours,
            "sh_ms": sh,
            "bash_ms": bash,
            "ratio_sh": ours / sh,
            "ratio_bash": ours / bash,
        }));
        rehash.push(rt.block_on(rehash_round(&manager, round)));
        rehash_keep.push(rt.block_on(rehash_round(&keep, round)));
    }
    let syscalls = json!({
        "ours": syscalls_per_call("ours", 20),
        "floor": syscalls_per_call("floor", 20),
    });
    let col = |rows: &[Value], name: &str| -> Vec<f64> {
        rows.iter().filter_map(|r| r[name].as_f64()).collect()
    };
    let report = json!({
        "rounds": rounds,
        "tree_kill": sandbox_core::host::tree_kill().as_str(),
        "create_start": {
            "calls_per_round": CALLS,
            "median_begin_ms": median(col(&create_rounds, "begin_ms")),
            "median_call_ms": median(col(&create_rounds, "call_ms")),
            "median_floor_ms": median(col(&create_rounds, "floor_ms")),
            "median_ratio": median(col(&create_rounds, "ratio")),
            "rounds": create_rounds,
        },
        "exec_true": {
            "execs_per_round": EXECS,
            "median_ours_ms": median(col(&exec_rounds, "ours_ms")),
            "median_sh_ms": median(col(&exec_rounds, "sh_ms")),
            "median_bash_ms": median(col(&exec_rounds, "bash_ms")),
            "median_ratio_sh": median(col(&exec_rounds, "ratio_sh")),
            "median_ratio_bash": median(col(&exec_rounds, "ratio_bash")),
            "rounds": exec_rounds,
        },
        "rehash_after_one_change": {
            "files": FILES,
            "files_hashed": rehash,
            "files_hashed_kept_box": rehash_keep,
        },
        "syscalls_per_call": syscalls,
    });
    print_table(&report);
    if let Some(out) = std::env::var_os("SANDBOX_BENCH_OUT") {
        let out = Path::new(&out);
        std::fs::create_dir_all(out).expect("output dir");
        let text = serde_json::to_string_pretty(&report).expect("json");
        std::fs::write(out.join("local.json"), text).expect("write local.json");
    }
}

fn print_table(r: &Value) {
    let f = |v: &Value| v.as_f64().map_or("-".to_owned(), |x| format!("{x:.3}"));
    println!(
        "local backend, {} rounds (tree kill: {})",
        r["rounds"], r["tree_kill"]
    );
    let c = &r["create_start"];
    println!(
        "create + start of an empty keyed call: begin {} ms, whole call {} ms, floor {} ms, ratio {} (median of rounds)",
        f(&c["median_begin_ms"]),
        f(&c["median_call_ms"]),
        f(&c["median_floor_ms"]),
        f(&c["median_ratio"])
    );
    for (i, round) in c["rounds"].as_array().into_iter().flatten().enumerate() {
        println!(
            "  round {i}: call {} ms, floor {} ms, ratio {}",
            f(&round["call_ms"]),
            f(&round["floor_ms"]),
            f(&round["ratio"])
        );
    }
    let e = &r["exec_true"];
    println!(
        "exec of `true` (bash -c): ours {} ms, bare sh -c {} ms ({}x), bare bash -c {} ms ({}x)",
        f(&e["median_ours_ms"]),
        f(&e["median_sh_ms"]),
        f(&e["median_ratio_sh"]),
        f(&e["median_bash_ms"]),
        f(&e["median_ratio_bash"])
    );
    println!(
        "files re-hashed by a stop after a one-file change (of {}): kept box {}, ephemeral box (restored in between) {}",
        r["rehash_after_one_change"]["files"],
        r["rehash_after_one_change"]["files_hashed_kept_box"],
        r["rehash_after_one_change"]["files_hashed"]
    );
    println!("syscalls per call: {}", r["syscalls_per_call"]);
}
