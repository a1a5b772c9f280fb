//! `cargo xtask bench replicas`: what sharing leases and states through Redis costs a call.
//!
//! Workload: one process, the local backend (ephemeral boxes under a temporary base directory,
//! tar snapshots in a temporary directory), 1,000 calls started at once over 200 USER keys (one
//! user per key, so 5 calls contend for each key). Each call appends a line to a file and counts
//! the file's lines: it restores the key's workspace (but the first call of a key), changes it,
//! and snapshots it. The counts a key's calls see must be 1..=5, each once: no call lost
//! another's line.
//!
//! Two configurations, in the same run, each in a child process of this binary (so its peak RSS,
//! `VmHWM`, is its own):
//! - `redis`: `SandboxManagerBuilder::distributed(redis_distributed(url)?.snapshots(..))` — a
//!   `RedisGuard` and a `RedisStateStore` with their default options, snapshots in a
//!   `LocalDirSnapshotStore::shared_by_all_hosts` directory — on a `redis-server` this bench
//!   starts (a free loopback port, a temporary directory, AOF `everysec`, `noeviction`, as
//!   store-redis's README asks of a deployment) and stops at the end, also on failure;
//! - `baseline`: the in-process guard and a `FileStateStore` (no Redis), same snapshots.
//!
//! Measured per configuration: calls/s (calls over the wall time of all of them), the lease
//! wait (time in `guard.enter`, taken by [`TimedGuard`], a forwarding wrapper: the call
//! report's `acquire` also covers the fence, the state read and the box's resume, and is
//! reported beside it), the call time (`manager.call`, lease wait included) and peak RSS.
//! For Redis: `INFO commandstats` deltas around the run (every command the server executed,
//! those run by the scripts included) and, from a `MONITOR` connection, the requests clients
//! sent (round trips) apart from the commands scripts ran.
//!
//! Results: a table on stdout and `replicas.json` in `SANDBOX_BENCH_OUT` (`cargo xtask bench`
//! sets it to `<workspace>/target/bench`). `SANDBOX_BENCH_CALLS` and `SANDBOX_BENCH_KEYS`
//! change the workload's size.

use std::collections::{BTreeMap, HashMap};
use std::io::{BufRead as _, BufReader, Read as _, Write as _};
use std::net::{SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use sandbox_harness::local::{LocalClient, LocalOptions};
use sandbox_harness::{
    CallContext, Distributed, ExecRequest, FileStateStore, InProcessGuard, IsolationKey,
    IsolationScope, Lease, LocalDirSnapshotStore, Persistence, Reach, SandboxConfig,
    SandboxExecutionGuard, SandboxManager, SnapshotSpec, StartBranch, WorkspaceSpec,
    redis_distributed,
};
use serde::{Deserialize, Serialize};

const CALLS: usize = 1000;
const KEYS: usize = 200;
/// The command each call runs in its box.
const EXEC: &str = "echo line >> log.txt && wc -l < log.txt";
/// Sent by the driver after a run: the MONITOR reader stops when it sees it.
const END_MARKER: &str = "sandbox-bench-end";

fn main() {
    let args: Vec<String> = std::env::args()
        .skip(1)
        .filter(|a| a != "--bench")
        .collect();
    if args.first().map(String::as_str) == Some("child") {
        child(&args[1..]);
        return;
    }
    if let Err(e) = driver() {
        eprintln!("replicas benchmark failed: {e}");
        std::process::exit(1);
    }
}

fn env_usize(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

// ---------------------------------------------------------------------------------------------
// The driver: runs both configurations, owns the Redis server, reports.

fn driver() -> Result<(), String> {
    let calls = env_usize("SANDBOX_BENCH_CALLS", CALLS);
    let keys = env_usize("SANDBOX_BENCH_KEYS", KEYS).clamp(1, calls.max(1));
    let out =
        PathBuf::from(std::env::var("SANDBOX_BENCH_OUT").unwrap_or_else(|_| "target/bench".into()));
    let work = tempfile::tempdir().map_err(|e| format!("temporary directory: {e}"))?;
    let exe = std::env::current_exe().map_err(|e| format!("own path: {e}"))?;
    println!(
        "replicas benchmark: {calls} concurrent calls over {keys} USER keys, local backend, \
         ephemeral boxes, tar snapshots (work dir {})\n",
        work.path().display()
    );

    println!("baseline: in-process guard + file state store ...");
    let baseline = run_child(
        &exe,
        "baseline",
        &work.path().join("baseline"),
        None,
        calls,
        keys,
    )?;

    // Stopped by its drop: at the end, or at the first failure below.
    let server = RedisServer::start()?;
    println!(
        "redis: redis-server {} (pid {}) on 127.0.0.1:{} ...",
        server.version,
        server.child.id(),
        server.port
    );
    let mut stats = Resp::connect(server.port)?;
    let monitor = Monitor::start(server.port, stats.local_addr)?;
    let before = stats.commandstats()?;
    let redis = run_child(
        &exe,
        "redis",
        &work.path().join("redis"),
        Some(&server.url()),
        calls,
        keys,
    );
    let after = stats.commandstats()?;
    stats.echo(END_MARKER)?;
    let seen = monitor.finish()?;
    let server_rss = peak_rss_kib_of(&format!("/proc/{}/status", server.child.id()));
    let version = server.version.clone();
    drop(server);
    let redis = redis?;

    let commands = command_table(&before, &after, &seen.commands, redis.calls);
    let mut scripts: Vec<ScriptRow> = seen
        .scripts
        .into_iter()
        .map(|(script, invoked)| ScriptRow {
            per_call: invoked as f64 / redis.calls as f64,
            script,
            invoked,
        })
        .collect();
    scripts.sort_by(|a, b| b.invoked.cmp(&a.invoked).then(a.script.cmp(&b.script)));
    let report = Report {
        workload: Workload {
            calls,
            keys,
            calls_per_key: calls as f64 / keys as f64,
            scope: "user (one user per key)",
            backend: "local, ephemeral boxes",
            snapshots: "tar, local directory",
            exec: EXEC,
        },
        redis_server: ServerInfo {
            version,
            config: "--save '' --appendonly yes --appendfsync everysec --maxmemory-policy noeviction",
            peak_rss_kib: server_rss,
        },
        ratio: Ratios {
            calls_per_s: redis.calls_per_s / baseline.calls_per_s,
            call_p50: redis.call_ms.p50 / baseline.call_ms.p50,
            call_p99: redis.call_ms.p99 / baseline.call_ms.p99,
            lease_wait_p99: redis.lease_wait_ms.p99 / baseline.lease_wait_ms.p99,
            peak_rss: redis.peak_rss_kib as f64 / baseline.peak_rss_kib as f64,
        },
        commandstats_per_call: commands.iter().map(|c| c.executed).sum::<u64>() as f64
            / redis.calls as f64,
        round_trips_per_call: commands.iter().map(|c| c.from_clients).sum::<u64>() as f64
            / redis.calls as f64,
        round_trips_per_call_scripts_loaded: commands
            .iter()
            .map(|c| match c.command.as_str() {
                "script" => 0,
                "evalsha" => c.from_clients - c.failed,
                _ => c.from_clients,
            })
            .sum::<u64>() as f64
            / redis.calls as f64,
        commands,
        scripts,
        baseline,
        redis,
    };
    print_report(&report);
    std::fs::create_dir_all(&out).map_err(|e| format!("creating {}: {e}", out.display()))?;
    let path = out.join("replicas.json");
    let json = serde_json::to_vec_pretty(&report).map_err(|e| e.to_string())?;
    std::fs::write(&path, json).map_err(|e| format!("writing {}: {e}", path.display()))?;
    println!("\nwrote {}", path.display());

    for (name, r) in [("baseline", &report.baseline), ("redis", &report.redis)] {
        if r.errors > 0 || !r.serialized {
            return Err(format!(
                "{name}: {} failed call(s), serialized: {} (first error: {})",
                r.errors,
                r.serialized,
                r.first_error.as_deref().unwrap_or("-")
            ));
        }
    }
    Ok(())
}

fn run_child(
    exe: &Path,
    config: &str,
    dir: &Path,
    url: Option<&str>,
    calls: usize,
    keys: usize,
) -> Result<ChildResult, String> {
    let out = Command::new(exe)
        .args(["child", config])
        .arg(dir)
        .args(url)
        .env("SANDBOX_BENCH_CALLS", calls.to_string())
        .env("SANDBOX_BENCH_KEYS", keys.to_string())
        .stderr(Stdio::inherit())
        .output()
        .map_err(|e| format!("spawning the {config} run: {e}"))?;
    if !out.status.success() {
        return Err(format!("the {config} run failed ({})", out.status));
    }
    serde_json::from_slice(&out.stdout).map_err(|e| {
        format!(
            "the {config} run's output: {e}: {}",
            String::from_utf8_lossy(&out.stdout)
        )
    })
}

#[derive(Debug, Serialize)]
struct Report {
    workload: Workload,
    redis_server: ServerInfo,
    baseline: ChildResult,
    redis: ChildResult,
    /// redis / baseline.
    ratio: Ratios,
    /// Commands the server executed per call, those run inside scripts included.
    commandstats_per_call: f64,
    /// Requests clients sent per call (round trips).
    round_trips_per_call: f64,
    /// The same without the first use of each script by each connection (the `EVALSHA` refused
    /// with `NOSCRIPT`, the `SCRIPT LOAD`): what a call costs once the scripts are loaded.
    round_trips_per_call_scripts_loaded: f64,
    commands: Vec<CommandRow>,
    /// Scripts clients invoked, per script.
    scripts: Vec<ScriptRow>,
}

#[derive(Debug, Serialize)]
struct ScriptRow {
    /// The script's SHA-1 (8 digits) and its keys, the hash tag's content shown as `K`.
    script: String,
    invoked: u64,
    per_call: f64,
}

#[derive(Debug, Serialize)]
struct Workload {
    calls: usize,
    keys: usize,
    calls_per_key: f64,
    scope: &'static str,
    backend: &'static str,
    snapshots: &'static str,
    exec: &'static str,
}

#[derive(Debug, Serialize)]
struct ServerInfo {
    version: String,
    config: &'static str,
    peak_rss_kib: u64,
}

#[derive(Debug, Serialize)]
struct Ratios {
    calls_per_s: f64,
    call_p50: f64,
    call_p99: f64,
    lease_wait_p99: f64,
    peak_rss: f64,
}

/// One command name (subcommands summed: `script|load` counts as `script`).
#[derive(Debug, Serialize)]
struct CommandRow {
    command: String,
    /// `INFO commandstats` delta: executed by the server, from clients and scripts.
    executed: u64,
    executed_per_call: f64,
    /// `INFO commandstats` delta of `failed_calls` + `rejected_calls` (e.g. `EVALSHA` of a
    /// script the server has not loaded yet: `NOSCRIPT`; the client then loads it).
    failed: u64,
    /// Seen by MONITOR as sent by a client.
    from_clients: u64,
    /// Seen by MONITOR as run by a script.
    in_scripts: u64,
}

fn command_table(
    before: &HashMap<String, (u64, u64)>,
    after: &HashMap<String, (u64, u64)>,
    requests: &HashMap<(String, bool), u64>,
    calls: usize,
) -> Vec<CommandRow> {
    let base = |name: &str| name.split('|').next().unwrap_or(name).to_lowercase();
    let mut rows: BTreeMap<String, CommandRow> = BTreeMap::new();
    for (name, (n, failed)) in after {
        let (n0, failed0) = before.get(name).copied().unwrap_or((0, 0));
        // The driver's own INFO calls are not the workload's.
        if n + failed > n0 + failed0 && base(name) != "info" {
            let r = entry(&mut rows, base(name));
            r.executed += n - n0;
            r.failed += failed - failed0;
        }
    }
    for ((name, in_script), n) in requests {
        let r = entry(&mut rows, base(name));
        if *in_script {
            r.in_scripts += n;
        } else {
            r.from_clients += n;
        }
    }
    let mut rows: Vec<CommandRow> = rows.into_values().collect();
    for r in &mut rows {
        r.executed_per_call = r.executed as f64 / calls as f64;
    }
    rows.sort_by(|a, b| b.executed.cmp(&a.executed).then(a.command.cmp(&b.command)));
    rows
}

fn entry(rows: &mut BTreeMap<String, CommandRow>, name: String) -> &mut CommandRow {
    rows.entry(name.clone()).or_insert_with(|| CommandRow {
        command: name,
        executed: 0,
        executed_per_call: 0.0,
        failed: 0,
        from_clients: 0,
        in_scripts: 0,
    })
}

fn print_report(r: &Report) {
    let (b, x) = (&r.baseline, &r.redis);
    println!(
        "\n{} calls over {} USER keys ({} per key), each `{}`\n",
        r.workload.calls, r.workload.keys, r.workload.calls_per_key, r.workload.exec
    );
    println!(
        "{:<30} {:>12} {:>12} {:>9}",
        "", "baseline", "redis", "ratio"
    );
    let line = |what: &str, b: f64, x: f64| {
        println!("{what:<30} {b:>12.1} {x:>12.1} {:>9.2}", x / b);
    };
    line("calls/s", b.calls_per_s, x.calls_per_s);
    line("wall time s", b.wall_s, x.wall_s);
    line(
        "lease wait p50 ms",
        b.lease_wait_ms.p50,
        x.lease_wait_ms.p50,
    );
    line(
        "lease wait p99 ms",
        b.lease_wait_ms.p99,
        x.lease_wait_ms.p99,
    );
    line(
        "lease wait max ms",
        b.lease_wait_ms.max,
        x.lease_wait_ms.max,
    );
    line("report.acquire p50 ms", b.acquire_ms.p50, x.acquire_ms.p50);
    line("report.acquire p99 ms", b.acquire_ms.p99, x.acquire_ms.p99);
    line("call p50 ms", b.call_ms.p50, x.call_ms.p50);
    line("call p99 ms", b.call_ms.p99, x.call_ms.p99);
    line("call max ms", b.call_ms.max, x.call_ms.max);
    line(
        "peak RSS KiB (VmHWM)",
        b.peak_rss_kib as f64,
        x.peak_rss_kib as f64,
    );
    println!(
        "{:<30} {:>12} {:>12}",
        "cold / restored starts",
        format!("{} / {}", b.cold_starts, b.restored_starts),
        format!("{} / {}", x.cold_starts, x.restored_starts)
    );
    println!("{:<30} {:>12} {:>12}", "failed calls", b.errors, x.errors);
    println!(
        "{:<30} {:>12} {:>12}",
        "each key saw 1..=n once", b.serialized, x.serialized
    );
    println!(
        "\nredis-server {} ({}), peak RSS {} KiB",
        r.redis_server.version, r.redis_server.config, r.redis_server.peak_rss_kib
    );
    println!(
        "Redis per call: {:.2} round trips (client requests, MONITOR), {:.2} without loading \
         the scripts (NOSCRIPT + SCRIPT LOAD); {:.2} commands executed (INFO commandstats, \
         script-run commands included)\n",
        r.round_trips_per_call, r.round_trips_per_call_scripts_loaded, r.commandstats_per_call
    );
    println!(
        "{:<14} {:>10} {:>9} {:>8} {:>13} {:>11}",
        "command", "executed", "per call", "failed", "from clients", "in scripts"
    );
    for c in &r.commands {
        println!(
            "{:<14} {:>10} {:>9.2} {:>8} {:>13} {:>11}",
            c.command, c.executed, c.executed_per_call, c.failed, c.from_clients, c.in_scripts
        );
    }
    println!(
        "\n{:>10} {:>9}  script invoked (sha, keys)",
        "invoked", "per call"
    );
    for s in &r.scripts {
        println!("{:>10} {:>9.2}  {}", s.invoked, s.per_call, s.script);
    }
}

// ---------------------------------------------------------------------------------------------
// A child: one configuration's run, printed as one JSON line.

#[derive(Debug, Serialize, Deserialize)]
struct ChildResult {
    config: String,
    calls: usize,
    errors: usize,
    first_error: Option<String>,
    /// Every key's calls saw the line counts 1..=n, each once.
    serialized: bool,
    cold_starts: usize,
    restored_starts: usize,
    wall_s: f64,
    calls_per_s: f64,
    /// Time in `guard.enter`.
    lease_wait_ms: Percentiles,
    /// `CallReport::acquire`: guard, fence, state read, resume or create.
    acquire_ms: Percentiles,
    /// `manager.call`, start to end.
    call_ms: Percentiles,
    peak_rss_kib: u64,
}

#[derive(Debug, Default, Serialize, Deserialize)]
struct Percentiles {
    p50: f64,
    p99: f64,
    max: f64,
}

impl Percentiles {
    fn of(mut values: Vec<Duration>) -> Self {
        if values.is_empty() {
            return Percentiles::default();
        }
        values.sort_unstable();
        // Nearest rank.
        let at = |p: f64| {
            let rank = ((p * values.len() as f64).ceil() as usize).clamp(1, values.len());
            values[rank - 1].as_secs_f64() * 1000.0
        };
        Percentiles {
            p50: at(0.50),
            p99: at(0.99),
            max: at(1.0),
        }
    }
}

/// Forwards to a guard, recording how long each `enter` took.
#[derive(Debug)]
struct TimedGuard {
    inner: Arc<dyn SandboxExecutionGuard>,
    waits: Mutex<Vec<Duration>>,
}

impl TimedGuard {
    fn new(inner: Arc<dyn SandboxExecutionGuard>) -> Arc<Self> {
        Arc::new(TimedGuard {
            inner,
            waits: Mutex::new(Vec::new()),
        })
    }

    fn waits(&self) -> Vec<Duration> {
        self.waits.lock().expect("waits").clone()
    }
}

#[deny(clippy::missing_trait_methods)]
#[sandbox_harness::async_trait]
impl SandboxExecutionGuard for TimedGuard {
    async fn enter(&self, key: &IsolationKey) -> sandbox_harness::Result<Lease> {
        let started = Instant::now();
        let lease = self.inner.enter(key).await;
        self.waits.lock().expect("waits").push(started.elapsed());
        lease
    }

    async fn try_enter(&self, key: &IsolationKey) -> sandbox_harness::Result<Option<Lease>> {
        self.inner.try_enter(key).await
    }

    fn reach(&self) -> Reach {
        self.inner.reach()
    }
}

fn child(args: &[String]) {
    let (config, dir) = (args[0].as_str(), PathBuf::from(&args[1]));
    let calls = env_usize("SANDBOX_BENCH_CALLS", CALLS);
    let keys = env_usize("SANDBOX_BENCH_KEYS", KEYS);
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .expect("runtime");
    let result = runtime.block_on(async {
        let (manager, timed) = match config {
            "baseline" => baseline(&dir),
            "redis" => with_redis(&dir, args.get(2).expect("the Redis URL")),
            other => panic!("unknown configuration {other}"),
        };
        workload(config, manager, &timed, calls, keys).await
    });
    println!("{}", serde_json::to_string(&result).expect("json"));
}

fn client(dir: &Path) -> Arc<LocalClient> {
    Arc::new(LocalClient::new(
        LocalOptions::default()
            .base_dir(dir.join("boxes"))
            .persistence(Persistence::Ephemeral),
    ))
}

fn config(snapshots: SnapshotSpec) -> SandboxConfig {
    SandboxConfig::new(WorkspaceSpec::default()).snapshots(snapshots)
}

fn baseline(dir: &Path) -> (SandboxManager, Arc<TimedGuard>) {
    let timed = TimedGuard::new(Arc::new(InProcessGuard::new()));
    let manager = SandboxManager::builder(client(dir))
        .scope(IsolationScope::User)
        .guard(timed.clone())
        .state_store(Arc::new(FileStateStore::new(dir.join("states"))))
        .config(config(SnapshotSpec::local_dir(dir.join("snapshots"))))
        .build()
        .expect("baseline set-up");
    (manager, timed)
}

fn with_redis(dir: &Path, url: &str) -> (SandboxManager, Arc<TimedGuard>) {
    let parts = redis_distributed(url).expect("redis_distributed");
    let timed = TimedGuard::new(parts.guard.clone());
    let shared = Distributed::new(timed.clone(), parts.states.clone()).snapshots(Arc::new(
        LocalDirSnapshotStore::shared_by_all_hosts(dir.join("snapshots")),
    ));
    let manager = SandboxManager::builder(client(dir))
        .scope(IsolationScope::User)
        .config(SandboxConfig::new(WorkspaceSpec::default()))
        .distributed(shared)
        .build()
        .expect("distributed set-up");
    (manager, timed)
}

async fn workload(
    config: &str,
    manager: SandboxManager,
    timed: &TimedGuard,
    calls: usize,
    keys: usize,
) -> ChildResult {
    let started = Instant::now();
    let tasks: Vec<_> = (0..calls)
        .map(|i| {
            let manager = manager.clone();
            let key = i % keys;
            tokio::spawn(async move {
                let ctx = CallContext::new("bench").user(format!("user{key:04}"));
                let t = Instant::now();
                let called = manager
                    .call(&ctx, |sandbox| async move {
                        sandbox
                            .exec(ExecRequest::shell(EXEC).timeout(Duration::from_secs(300)))
                            .await
                    })
                    .await;
                (key, t.elapsed(), called)
            })
        })
        .collect();
    let mut result = ChildResult {
        config: config.to_owned(),
        calls,
        errors: 0,
        first_error: None,
        serialized: true,
        cold_starts: 0,
        restored_starts: 0,
        wall_s: 0.0,
        calls_per_s: 0.0,
        lease_wait_ms: Percentiles::default(),
        acquire_ms: Percentiles::default(),
        call_ms: Percentiles::default(),
        peak_rss_kib: 0,
    };
    let mut call_times = Vec::with_capacity(calls);
    let mut acquires = Vec::with_capacity(calls);
    let mut seen: Vec<Vec<usize>> = vec![Vec::new(); keys];
    let fail = |result: &mut ChildResult, e: String| {
        result.errors += 1;
        result.first_error.get_or_insert(e);
    };
    for task in tasks {
        let (key, elapsed, called) = task.await.expect("a call panicked");
        call_times.push(elapsed);
        let called = match called {
            Ok(c) => c,
            Err(e) => {
                fail(&mut result, e.to_string());
                continue;
            }
        };
        acquires.push(called.report.acquire);
        match called.report.start.as_ref().map(|s| s.branch) {
            Some(StartBranch::Cold) => result.cold_starts += 1,
            Some(_) => result.restored_starts += 1,
            None => {}
        }
        match called.value {
            Ok(r) if r.success() => match r.stdout_str().trim().parse() {
                Ok(n) => seen[key].push(n),
                Err(_) => fail(&mut result, format!("not a count: {:?}", r.stdout_str())),
            },
            Ok(r) => fail(&mut result, format!("exec failed: {r:?}")),
            Err(e) => fail(&mut result, e.to_string()),
        }
    }
    let wall = started.elapsed();
    result.peak_rss_kib = peak_rss_kib_of("/proc/self/status");
    result.wall_s = wall.as_secs_f64();
    result.calls_per_s = calls as f64 / wall.as_secs_f64();
    result.lease_wait_ms = Percentiles::of(timed.waits());
    result.acquire_ms = Percentiles::of(acquires);
    result.call_ms = Percentiles::of(call_times);
    result.serialized = seen.iter_mut().all(|counts| {
        counts.sort_unstable();
        counts.iter().copied().eq(1..=counts.len())
    });
    result
}

fn peak_rss_kib_of(status: &str) -> u64 {
    std::fs::read_to_string(status)
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmHWM:"))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|v| v.parse().ok())
        })
        .unwrap_or(0)
}

// ---------------------------------------------------------------------------------------------
// The Redis server of the run, and the two plain RESP connections that observe it.

/// A `redis-server` of this run: a free loopback port, a temporary directory, AOF as a
/// deployment would have it. Killed (by the pid started here) and waited for on drop.
struct RedisServer {
    child: Child,
    port: u16,
    version: String,
    dir: tempfile::TempDir,
}

impl RedisServer {
    /// `SANDBOX_TEST_REDIS_SERVER` (as `cargo xtask` sets it), else `redis-server` on the
    /// `PATH`. A port taken between the probe and the server's bind is retried on another.
    fn start() -> Result<RedisServer, String> {
        let program =
            std::env::var("SANDBOX_TEST_REDIS_SERVER").unwrap_or_else(|_| "redis-server".into());
        let mut last = String::new();
        for _ in 0..5 {
            match RedisServer::try_start(&program) {
                Ok(server) => return Ok(server),
                Err(e) => last = e,
            }
        }
        Err(format!("redis-server did not start: {last}"))
    }

    fn try_start(program: &str) -> Result<RedisServer, String> {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .map_err(|e| format!("no free loopback port: {e}"))?
            .port();
        let dir = tempfile::tempdir().map_err(|e| format!("temporary directory: {e}"))?;
        let child = Command::new(program)
            .args(["--port", &port.to_string(), "--bind", "127.0.0.1"])
            .args([
                "--save",
                "",
                "--appendonly",
                "yes",
                "--appendfsync",
                "everysec",
            ])
            .args(["--maxmemory-policy", "noeviction", "--daemonize", "no"])
            .arg("--dir")
            .arg(dir.path())
            .arg("--logfile")
            .arg(dir.path().join("redis.log"))
            .stdin(Stdio::null())
            .spawn()
            .map_err(|e| format!("cannot run {program}: {e}"))?;
        // From here on the drop kills it.
        let mut server = RedisServer {
            child,
            port,
            version: String::new(),
            dir,
        };
        let started = Instant::now();
        loop {
            if let Ok(Some(status)) = server.child.try_wait() {
                let log = std::fs::read_to_string(server.dir.path().join("redis.log"))
                    .unwrap_or_default();
                return Err(format!("redis-server exited ({status}): {log}"));
            }
            if let Ok(mut c) = Resp::connect(port)
                && c.command(&["PING"]).is_ok_and(|r| r == "PONG")
            {
                server.version = c
                    .command(&["INFO", "server"])?
                    .lines()
                    .find_map(|l| l.strip_prefix("redis_version:"))
                    .unwrap_or("?")
                    .trim()
                    .to_owned();
                return Ok(server);
            }
            if started.elapsed() > Duration::from_secs(10) {
                return Err(format!("redis-server on port {port} never answered PING"));
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        println!("redis-server on port {} stopped", self.port);
    }
}

/// A plain RESP connection for `PING`, `INFO` and `ECHO` (its own address is known, so the
/// MONITOR reader can leave its commands out).
struct Resp {
    stream: BufReader<TcpStream>,
    local_addr: SocketAddr,
}

impl Resp {
    fn connect(port: u16) -> Result<Resp, String> {
        let addr = SocketAddr::from(([127, 0, 0, 1], port));
        let stream = TcpStream::connect_timeout(&addr, Duration::from_millis(500))
            .map_err(|e| format!("connecting to {addr}: {e}"))?;
        stream
            .set_read_timeout(Some(Duration::from_secs(10)))
            .map_err(|e| e.to_string())?;
        let local_addr = stream.local_addr().map_err(|e| e.to_string())?;
        Ok(Resp {
            stream: BufReader::new(stream),
            local_addr,
        })
    }

    /// Send a command, read a simple-string, integer or bulk reply.
    fn command(&mut self, args: &[&str]) -> Result<String, String> {
        let mut request = format!("*{}\r\n", args.len());
        for a in args {
            request.push_str(&format!("${}\r\n{a}\r\n", a.len()));
        }
        let io = |e: std::io::Error| format!("redis: {e}");
        self.stream
            .get_mut()
            .write_all(request.as_bytes())
            .map_err(io)?;
        let mut line = String::new();
        self.stream.read_line(&mut line).map_err(io)?;
        let line = line.trim_end();
        match line.split_at_checked(1) {
            Some(("+" | ":", rest)) => Ok(rest.to_owned()),
            Some(("$", len)) => {
                let len: usize = len.parse().map_err(|_| format!("bad reply {line:?}"))?;
                let mut body = vec![0; len + 2];
                self.stream.read_exact(&mut body).map_err(io)?;
                body.truncate(len);
                String::from_utf8(body).map_err(|e| e.to_string())
            }
            _ => Err(format!("redis replied {line:?}")),
        }
    }

    /// `INFO commandstats` as command name → (`calls`, `failed_calls` + `rejected_calls`).
    fn commandstats(&mut self) -> Result<HashMap<String, (u64, u64)>, String> {
        let info = self.command(&["INFO", "commandstats"])?;
        Ok(info
            .lines()
            .filter_map(|l| {
                let (name, fields) = l.strip_prefix("cmdstat_")?.split_once(':')?;
                let field = |key: &str| -> Option<u64> {
                    fields
                        .split(',')
                        .find_map(|f| f.strip_prefix(key))?
                        .parse()
                        .ok()
                };
                let failed =
                    field("failed_calls=").unwrap_or(0) + field("rejected_calls=").unwrap_or(0);
                Some((name.to_owned(), (field("calls=")?, failed)))
            })
            .collect())
    }

    fn echo(&mut self, text: &str) -> Result<(), String> {
        self.command(&["ECHO", text]).map(drop)
    }
}

/// What the MONITOR connection saw during a run.
#[derive(Debug, Default)]
struct Seen {
    /// Per (command name, run by a script): how many.
    commands: HashMap<(String, bool), u64>,
    /// Scripts invoked by clients (`EVALSHA`/`EVAL`), per script hash and key pattern.
    scripts: HashMap<String, u64>,
}

/// A MONITOR connection counting commands, leaving out those of the driver's own connection.
struct Monitor {
    thread: std::thread::JoinHandle<Result<Seen, String>>,
}

impl Monitor {
    fn start(port: u16, driver: SocketAddr) -> Result<Monitor, String> {
        let mut conn = Resp::connect(port)?;
        conn.stream
            .get_mut()
            .set_read_timeout(None)
            .map_err(|e| e.to_string())?;
        if conn.command(&["MONITOR"])? != "OK" {
            return Err("MONITOR refused".into());
        }
        let driver = driver.to_string();
        let thread = std::thread::spawn(move || {
            let mut seen = Seen::default();
            let mut line = String::new();
            loop {
                line.clear();
                if conn
                    .stream
                    .read_line(&mut line)
                    .map_err(|e| e.to_string())?
                    == 0
                {
                    return Err("MONITOR connection closed".into());
                }
                // +1700000000.000000 [0 127.0.0.1:5555] "evalsha" "<sha>" "2" "<key>" …
                // (`[0 lua]` for a command a script ran)
                let Some((source, args)) = line
                    .split_once('[')
                    .and_then(|(_, rest)| rest.split_once("] \""))
                    .and_then(|(inside, rest)| Some((inside.split_once(' ')?.1, rest)))
                else {
                    continue;
                };
                if source == driver {
                    if line.contains(END_MARKER) {
                        return Ok(seen);
                    }
                    continue;
                }
                // Keys and hashes hold no quote; later arguments are not looked at.
                let args = args.trim_end();
                let args: Vec<&str> = args
                    .strip_suffix('"')
                    .unwrap_or(args)
                    .split("\" \"")
                    .collect();
                let command = args[0].to_lowercase();
                if source != "lua" && (command == "evalsha" || command == "eval") {
                    *seen.scripts.entry(script_label(&args)).or_default() += 1;
                }
                *seen.commands.entry((command, source == "lua")).or_default() += 1;
            }
        });
        Ok(Monitor { thread })
    }

    fn finish(self) -> Result<Seen, String> {
        self.thread
            .join()
            .map_err(|_| "the MONITOR reader panicked".to_owned())?
    }
}

/// `<sha, 8 digits> <keys, the hash tag's content as K>` of an `EVALSHA` (or `EVAL`)
/// request: which script, on which kind of keys (`sandbox:lock:{K} sandbox:lock:{K}:fence` is
/// the guard's grant).
fn script_label(args: &[&str]) -> String {
    let sha: String = args.get(1).map_or("", |s| s).chars().take(8).collect();
    let count: usize = args.get(2).and_then(|n| n.parse().ok()).unwrap_or(0);
    let keys: Vec<String> = args
        .iter()
        .skip(3)
        .take(count)
        .map(|k| match (k.find('{'), k.find('}')) {
            (Some(open), Some(close)) if open < close => {
                format!("{}{{K}}{}", &k[..open], &k[close + 1..])
            }
            _ => (*k).to_owned(),
        })
        .collect();
    format!("{sha} {}", keys.join(" "))
}
