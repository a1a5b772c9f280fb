//! Project tasks: `cargo xtask test`, `cargo xtask redis-test`, `cargo xtask s3-test`,
//! `cargo xtask bench <name>`.
//!
//! `test` runs everything CI runs: formatting, lints, every test (the confined local backend's
//! escape suite and kit also as an unprivileged user), and the quickstart. Services
//! that tests need are started here (and stopped by a drop guard, also on failure); a service
//! that cannot start is a failure, never a skip.

use std::process::{Command, ExitCode};
use std::time::Instant;

mod daytona;
mod e2b;
mod fidelity;
mod k8s;
#[cfg(test)]
mod tidy;
mod unprivileged;

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let result = match args.first().map(String::as_str) {
        Some("test") => test(&args[1..]),
        Some("images") => docker_images(),
        Some("redis-test") => redis_test(&args[1..]),
        Some("s3-test") => s3_test(&args[1..]),
        Some("bench") => bench(&args[1..]),
        Some("unprivileged-test") => unprivileged::run(),
        Some("k8s-up") => k8s::up(&args[1..]),
        Some("k8s-fidelity") => k8s::fidelity(),
        Some("e2b-fidelity") => e2b::fidelity(),
        Some("daytona-fidelity") => daytona::fidelity(),
        Some("help") | None => {
            println!(
                "usage: cargo xtask <task>\n\ntasks:\n  test [--only GROUP,...]  fmt check, clippy -D warnings, all tests (Docker and Redis ones included), the quickstart; --only runs the named groups (lint, tests, local, unprivileged, docker, k8s, e2b, daytona, redis, s3, fidelity, quickstart)\n  redis-test [ARGS]  start the test Redis and run `cargo test ARGS` against it (e.g. -p guard-redis)\n  s3-test [ARGS]  install s3s-fs if missing and run `cargo test ARGS` with SANDBOX_TEST_S3FS set (e.g. -p snapshot-oss)\n  images        build the Docker test images locally (no registry), cached; also the k8s test pod image (static sandboxd)\n  k8s-up [ARGS]  build the images and run the Kubernetes test cluster in the foreground (prints kubeconfig, API and router URLs)\n  k8s-fidelity  start the k8s test cluster and run the official Python clients (pinned, target/py-venv) against it\n  e2b-fidelity  start the E2B test server and run the official E2B Python SDK (pinned, target/py-venv-e2b) against it\n  daytona-fidelity  start the Daytona test server and run the official Daytona Python SDK (pinned, target/py-venv-daytona) against it\n  bench snapshot [--store local|s3|redis]... [W]  snapshot engine on each store (default all three; servers started here) vs same-run floors (workloads A-E, or those in W) -> target/bench/snapshot.json\n  bench docker  Docker backend benchmark -> target/bench/docker.json\n  bench k8s     k8s backend on the test cluster vs the Docker backend, same engine -> target/bench/k8s.json\n  bench cloud   E2B and Daytona backends on their test servers vs the Docker backend, same engine -> target/bench/cloud.json\n  bench host    host::run of `true` with and without a cgroup per command -> target/bench/host.json\n  bench tools   the agent tools (sandbox-fs, local mode) on 64 MiB adversarial inputs vs same-run floors -> target/bench/tools.json\n  bench local   local backend: empty keyed call vs its durability floor (fsyncs, mkdirs), exec vs bare spawn, files re-hashed -> target/bench/local.json\n  bench replicas  1,000 concurrent calls on 200 keys: RedisGuard + RedisStateStore vs in-process guard + file store -> target/bench/replicas.json\n  bench local-isolation  exec of `true` in a local box unconfined vs confined, vs a bare spawn and bwrap; box create + first exec; idle box RSS -> target/bench/local-isolation.json\n  unprivileged-test  the confined local backend's escape suite and conformance kit as uid 65534 (also part of `test`)"
            );
            Ok(())
        }
        Some(other) => Err(format!("unknown task `{other}` (try `cargo xtask help`)")),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("xtask: {e}");
            ExitCode::FAILURE
        }
    }
}

/// The groups `cargo xtask test --only` selects; with no `--only`, all of them run.
/// `lint`: fmt --check, clippy, cargo-deny. `tests`: every crate's tests with every service.
/// `local`: core, local, fs and facade tests (no service). `unprivileged`: the confined local
/// backend's escape suite and kit as an unprivileged user. `docker`, `k8s`, `e2b`, `daytona`,
/// `redis`, `s3`: those crates' tests (and for k8s, e2b, daytona their fidelity check).
/// `fidelity`: the official Python SDKs against the three test servers. `quickstart`.
const TEST_GROUPS: [&str; 12] = [
    "lint",
    "tests",
    "local",
    "unprivileged",
    "docker",
    "k8s",
    "e2b",
    "daytona",
    "redis",
    "s3",
    "fidelity",
    "quickstart",
];

/// The packages whose tests a group runs (`tests` runs the whole workspace).
fn group_packages(group: &str) -> &'static [&'static str] {
    match group {
        "local" => &[
            "sandbox-core",
            "sandbox-local",
            "sandbox-fs",
            "sandbox-harness",
        ],
        "docker" => &["sandbox-docker", "test-docker"],
        "k8s" => &[
            "sandbox-k8s",
            "sandboxd",
            "sandboxd-proto",
            "k8s-testcluster",
        ],
        "e2b" => &[
            "sandbox-e2b",
            "e2b-testserver",
            "e2b-envd-proto",
            "sandbox-cloud",
        ],
        "daytona" => &["sandbox-daytona", "daytona-testserver", "sandbox-cloud"],
        "redis" => &[
            "guard-redis",
            "store-redis",
            "snapshot-redis",
            "harness-integration",
        ],
        "s3" => &["snapshot-oss"],
        _ => &[],
    }
}

/// `cargo xtask test [--only GROUP[,GROUP]...]`: everything CI runs, or the chosen groups.
fn test(args: &[String]) -> Result<(), String> {
    let started = Instant::now();
    let mut only: Vec<String> = Vec::new();
    let mut it = args.iter();
    while let Some(arg) = it.next() {
        let list = match arg.strip_prefix("--only=") {
            Some(v) => v.to_owned(),
            None if arg == "--only" => it
                .next()
                .ok_or("--only needs a group (cargo xtask help)")?
                .clone(),
            None => return Err(format!("unknown argument `{arg}` of `cargo xtask test`")),
        };
        for g in list.split(',').map(str::trim).filter(|g| !g.is_empty()) {
            if !TEST_GROUPS.contains(&g) {
                return Err(format!(
                    "unknown group `{g}` (have: {})",
                    TEST_GROUPS.join(", ")
                ));
            }
            only.push(g.to_owned());
        }
    }
    let all = only.is_empty();
    let wants = |g: &str| all || only.iter().any(|o| o == g);
    let mut steps = Steps::default();
    if wants("lint") {
        steps.time("fmt --check", || {
            run("cargo", &["fmt", "--all", "--", "--check"])
        })?;
        steps.time("clippy", || {
            run(
                "cargo",
                &[
                    "clippy",
                    "--workspace",
                    "--all-targets",
                    "--all-features",
                    "--",
                    "-D",
                    "warnings",
                ],
            )
        })?;
        steps.time("cargo-deny", cargo_deny)?;
    }
    // Which packages' tests run: all (`tests`, or no `--only`), or the union of the groups'.
    let mut packages: Vec<&str> = Vec::new();
    if !wants("tests") {
        for g in &only {
            for p in group_packages(g) {
                if !packages.contains(p) {
                    packages.push(p);
                }
            }
        }
    }
    let run_tests = wants("tests") || !packages.is_empty();
    let needs_services = run_tests
        && (wants("tests")
            || packages
                .iter()
                .any(|p| !group_packages("local").contains(p) && *p != "snapshot-oss"));
    let fidelity: Vec<&str> = ["k8s", "e2b", "daytona"]
        .into_iter()
        .filter(|g| all || wants("fidelity") || only.iter().any(|o| o == g))
        .collect();
    if needs_services || !fidelity.is_empty() {
        steps.time("docker images", docker_test_preflight)?;
    }
    // Every failing test binary is reported, not only the first.
    let mut cmd = vec!["test", "--all-features", "--no-fail-fast"];
    if packages.is_empty() {
        cmd.push("--workspace");
    }
    for p in &packages {
        cmd.extend(["-p", p]);
    }
    if needs_services {
        // Installed (a few minutes of compiling the first time) before any service starts.
        let s3fs = steps.time("s3s-fs", s3s_fs)?;
        // The official Python SDKs, pinned (sandboxd's official-SDK test, the fidelity check).
        let sdk_python = steps.time("python venv", k8s::venv)?;
        // Stopped when it goes out of scope: after the tests, or at the first failure.
        let redis = RedisService::start()?;
        let mut env = docker_test_env();
        env.extend(redis.test_env());
        env.push((S3FS_VAR, s3fs));
        env.push(("SANDBOXD_TEST_SDK_PYTHON", sdk_python));
        let env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (*k, v.as_str())).collect();
        steps.time("cargo test", || run_env("cargo", &cmd, &env))?;
        drop(redis);
    } else if run_tests {
        // `local` (or `s3`) alone: no Docker, Redis or venv.
        let s3fs = if packages.contains(&"snapshot-oss") {
            Some(steps.time("s3s-fs", s3s_fs)?)
        } else {
            None
        };
        let env: Vec<(&str, &str)> = s3fs.iter().map(|b| (S3FS_VAR, b.as_str())).collect();
        steps.time("cargo test", || run_env("cargo", &cmd, &env))?;
    }
    if all || wants("unprivileged") {
        // The confined local backend again, as an unprivileged user.
        steps.time("unprivileged", unprivileged::run)?;
    }
    for g in fidelity {
        match g {
            "k8s" => steps.time("k8s fidelity", k8s::fidelity)?,
            "e2b" => steps.time("e2b fidelity", e2b::fidelity)?,
            _ => steps.time("daytona fidelity", daytona::fidelity)?,
        }
    }
    if wants("quickstart") {
        steps.time("quickstart", || {
            run("cargo", &["run", "--quiet", "--example", "quickstart"])
        })?;
    }
    steps.print();
    println!("xtask test: all passed in {:.0?}", started.elapsed());
    Ok(())
}

/// How long each step of `cargo xtask test` took, printed slowest first at the end.
#[derive(Default)]
struct Steps(Vec<(&'static str, std::time::Duration)>);

impl Steps {
    fn time<T>(
        &mut self,
        name: &'static str,
        step: impl FnOnce() -> Result<T, String>,
    ) -> Result<T, String> {
        let started = Instant::now();
        let out = step();
        self.0.push((name, started.elapsed()));
        if out.is_err() {
            self.print();
        }
        out
    }

    fn print(&self) {
        let mut steps = self.0.clone();
        steps.sort_by_key(|s| std::cmp::Reverse(s.1));
        println!("xtask test: steps, slowest first:");
        for (name, took) in steps {
            println!("  {:>8.1}s  {name}", took.as_secs_f64());
        }
    }
}

/// The version of cargo-deny the checks run with (installed from crates.io when missing).
const CARGO_DENY: &str = "0.20.2";

/// `deny.toml`: licences, banned crates (OpenSSL), sources. The advisory database is not
/// checked: it is fetched from GitHub, which this environment cannot reach.
fn cargo_deny() -> Result<(), String> {
    let have = Command::new("cargo")
        .args(["deny", "--version"])
        .output()
        .is_ok_and(|o| {
            o.status.success() && String::from_utf8_lossy(&o.stdout).contains(CARGO_DENY)
        });
    if !have {
        run(
            "cargo",
            &["install", "--locked", &format!("cargo-deny@{CARGO_DENY}")],
        )?;
    }
    run(
        "cargo",
        &[
            "deny",
            "--log-level",
            "error",
            "check",
            "bans",
            "licenses",
            "sources",
        ],
    )
}

/// `cargo xtask bench cloud`: the E2B and Daytona backends on their test servers next to the
/// Docker backend, same engine, with the pod image of this run.
fn bench_cloud() -> Result<(), String> {
    docker_images()?;
    let image = k8s_pod_image_tag();
    let out = target_dir().join("bench");
    run_env(
        "cargo",
        &[
            "bench",
            "-p",
            "harness-integration",
            "--features",
            "docker,e2b,daytona",
            "--bench",
            "cloud",
        ],
        &[
            ("SANDBOX_TEST_DOCKER", "1"),
            ("SANDBOX_K8S_POD_IMAGE", image.as_str()),
            ("SANDBOX_BENCH_OUT", out.to_str().expect("UTF-8 path")),
        ],
    )
}

fn bench(args: &[String]) -> Result<(), String> {
    match args.first().map(String::as_str) {
        Some("snapshot") => bench_snapshot(&args[1..]),
        Some("docker") => bench_docker(),
        Some("k8s") => k8s::bench(),
        Some("cloud") => bench_cloud(),
        Some("replicas") => bench_replicas(),
        Some("local-isolation") => bench_local_isolation(),
        Some("host") => {
            let out = target_dir().join("bench");
            run_env(
                "cargo",
                &["bench", "--package", "sandbox-core", "--bench", "host"],
                &[("SANDBOX_BENCH_OUT", out.to_str().expect("UTF-8 path"))],
            )
        }
        Some("tools") => {
            let out = target_dir().join("bench");
            run_env(
                "cargo",
                &["bench", "--package", "sandbox-fs", "--bench", "tools"],
                &[("SANDBOX_BENCH_OUT", out.to_str().expect("UTF-8 path"))],
            )
        }
        Some("local") => {
            let out = target_dir().join("bench");
            run_env(
                "cargo",
                &["bench", "--package", "sandbox-local", "--bench", "local"],
                &[("SANDBOX_BENCH_OUT", out.to_str().expect("UTF-8 path"))],
            )
        }
        other => Err(format!(
            "unknown benchmark {other:?} (have: snapshot, docker, k8s, cloud, host, local, tools, replicas, local-isolation)"
        )),
    }
}

/// `cargo xtask bench local-isolation`: the local backend confined vs unconfined, against a bare spawn
/// and bubblewrap in the same run (`crates/sandbox-local/benches/isolation.rs`; bubblewrap is
/// installed with apt when missing, and its row skipped if that fails).
/// Writes `target/bench/local-isolation.json`.
fn bench_local_isolation() -> Result<(), String> {
    if Command::new("bwrap").arg("--version").output().is_err() {
        let _ = run_env(
            "apt-get",
            &["install", "-y", "bubblewrap"],
            &[("DEBIAN_FRONTEND", "noninteractive")],
        );
    }
    let out = target_dir().join("bench");
    run_env(
        "cargo",
        &["bench", "-p", "sandbox-local", "--bench", "isolation"],
        &[("SANDBOX_BENCH_OUT", out.to_str().expect("UTF-8 path"))],
    )
}

fn workspace_root() -> std::path::PathBuf {
    std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("xtask lives in the workspace")
        .to_path_buf()
}

/// Cargo's build output directory: `CARGO_TARGET_DIR` when set (a relative value is relative
/// to the current directory, as cargo reads it), else the workspace's `target/`. Every path
/// to build output or to xtask's own scratch files (images, venvs, bench reports) starts here.
fn target_dir() -> std::path::PathBuf {
    match std::env::var_os("CARGO_TARGET_DIR").filter(|v| !v.is_empty()) {
        Some(dir) => {
            let dir = std::path::PathBuf::from(dir);
            if dir.is_relative() {
                std::env::current_dir()
                    .map(|cwd| cwd.join(&dir))
                    .unwrap_or(dir)
            } else {
                dir
            }
        }
        None => workspace_root().join("target"),
    }
}

fn run(program: &str, args: &[&str]) -> Result<(), String> {
    run_env(program, args, &[])
}

fn run_env(program: &str, args: &[&str], env: &[(&str, &str)]) -> Result<(), String> {
    println!("xtask: $ {program} {}", args.join(" "));
    let status = Command::new(program)
        .args(args)
        .envs(env.iter().copied())
        .status()
        .map_err(|e| format!("cannot run {program}: {e}"))?;
    if status.success() {
        Ok(())
    } else {
        Err(format!("`{program} {}` failed ({status})", args.join(" ")))
    }
}

/// The stores `cargo xtask bench snapshot` knows.
const SNAPSHOT_STORES: [&str; 3] = ["local", "s3", "redis"];

/// `cargo xtask bench snapshot [--store local|s3|redis]... [W]`: the snapshot benchmark on
/// the chosen stores (repeat `--store` or give a comma list; default all three). The servers
/// the stores need are started here on loopback (`s3s-fs` with a temporary data directory,
/// `redis-server`) and stopped after, also on failure (drop guards kill the pids we started);
/// their addresses reach the bench through `SANDBOX_BENCH_*` variables.
fn bench_snapshot(args: &[String]) -> Result<(), String> {
    let mut stores: Vec<String> = Vec::new();
    let mut rest: Vec<&str> = Vec::new();
    let mut it = args.iter();
    while let Some(arg) = it.next() {
        let list = if arg == "--store" {
            it.next()
                .ok_or("--store needs a value: local, s3 or redis")?
                .as_str()
        } else if let Some(v) = arg.strip_prefix("--store=") {
            v
        } else {
            rest.push(arg);
            continue;
        };
        for s in list.split(',').map(str::trim).filter(|s| !s.is_empty()) {
            if !SNAPSHOT_STORES.contains(&s) {
                return Err(format!("unknown store `{s}` (have: local, s3, redis)"));
            }
            if !stores.iter().any(|have| have == s) {
                stores.push(s.to_owned());
            }
        }
    }
    if stores.is_empty() {
        stores = SNAPSHOT_STORES.iter().map(|s| (*s).to_owned()).collect();
    }
    let out = target_dir().join("bench");
    let mut env: Vec<(&str, String)> = vec![
        (
            "SANDBOX_BENCH_OUT",
            out.to_str().expect("UTF-8 path").to_owned(),
        ),
        ("SANDBOX_BENCH_STORES", stores.join(",")),
    ];
    let mut features = vec!["local"];
    // Both guards live until the end of this function: after the bench, or at its failure.
    let _s3 = if stores.iter().any(|s| s == "s3") {
        features.push("s3");
        let server = S3fsService::start(&s3s_fs()?)?;
        env.extend(server.bench_env());
        Some(server)
    } else {
        None
    };
    let _redis = if stores.iter().any(|s| s == "redis") {
        features.push("redis");
        let server = RedisService::start()?;
        env.push((
            "SANDBOX_BENCH_REDIS_URL",
            format!("redis://127.0.0.1:{}", server.port),
        ));
        Some(server)
    } else {
        None
    };
    let features = features.join(",");
    let mut cmd = vec![
        "bench",
        "--package",
        "harness-integration",
        "--features",
        &features,
        "--bench",
        "snapshot",
        "--",
    ];
    cmd.extend(rest);
    let env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (*k, v.as_str())).collect();
    run_env("cargo", &cmd, &env)
}

/// `cargo xtask bench replicas`: the Redis guard and state store under load, against the
/// in-process guard and the file state store in the same run. The benchmark starts and stops
/// its own `redis-server` (installed with apt when missing).
fn bench_replicas() -> Result<(), String> {
    let redis_server = ensure_tool("redis-server", "redis-server")?;
    let out = target_dir().join("bench");
    run_env(
        "cargo",
        &[
            "bench",
            "--package",
            "harness-integration",
            "--features",
            "redis",
            "--bench",
            "replicas",
        ],
        &[
            ("SANDBOX_BENCH_OUT", out.to_str().expect("UTF-8 path")),
            ("SANDBOX_TEST_REDIS_SERVER", &redis_server),
        ],
    )
}

// ---------------------------------------------------------------------------------------------
// Docker: test images, test environment, benchmark (sandbox-docker).

/// The test images: busybox (static, tiny) and Debian (bash, coreutils, GNU find, tar,
/// python3). Each is built from Debian packages and imported with `docker import`: no
/// container registry is involved.
const DOCKER_BUSYBOX_IMAGE: &str = "sandbox-harness-test/busybox";
const DOCKER_DEBIAN_IMAGE: &str = "sandbox-harness-test/debian";
/// Bump when a recipe changes: the tag `r<N>` marks an image built by this recipe.
const DOCKER_RECIPE: &str = "r1";
const DEBIAN_SUITE: &str = "bookworm";
const DEBIAN_PACKAGES: &str = "python3,procps";

/// Environment of the test run: the Docker tests are selected by `SANDBOX_TEST_DOCKER=1`;
/// the k8s test cluster's pod image is named by `SANDBOX_K8S_POD_IMAGE`: the content tag
/// built by this run (`:latest` may be moved by a build from another checkout).
fn docker_test_env() -> Vec<(&'static str, String)> {
    vec![
        ("SANDBOX_TEST_DOCKER", "1".to_owned()),
        (K8S_POD_IMAGE_VAR, k8s_pod_image_tag()),
    ]
}

/// The k8s pod image of this run: the content tag `cargo xtask images` built (or found) in
/// this process, `:latest` before that.
fn k8s_pod_image_tag() -> String {
    K8S_POD_TAG
        .get()
        .cloned()
        .unwrap_or_else(|| format!("{K8S_POD_IMAGE}:latest"))
}

/// Under `cargo xtask test` the Docker tests always run: the engine must answer and the
/// images must exist (they are built here), or the task fails.
fn docker_test_preflight() -> Result<(), String> {
    docker_images()?;
    let out = Command::new("docker")
        .args(["version", "--format", "{{.Server.APIVersion}}"])
        .output()
        .map_err(|e| format!("cannot run docker: {e}"))?;
    if !out.status.success() {
        return Err(format!(
            "the Docker engine does not answer (the Docker tests cannot be skipped): {}",
            String::from_utf8_lossy(&out.stderr).trim()
        ));
    }
    Ok(())
}

/// `cargo xtask images`: build the test images if this recipe's are not on the engine yet.
fn docker_images() -> Result<(), String> {
    let started = Instant::now();
    docker_image(DOCKER_BUSYBOX_IMAGE, build_busybox_rootfs)?;
    docker_image(DOCKER_DEBIAN_IMAGE, build_debian_rootfs)?;
    k8s_pod_image()?;
    println!(
        "xtask: docker test images ready in {:.0?}",
        started.elapsed()
    );
    Ok(())
}

fn docker_image(
    name: &str,
    build: fn(&std::path::Path) -> Result<(), String>,
) -> Result<(), String> {
    let recipe_tag = format!("{name}:{DOCKER_RECIPE}");
    let have = Command::new("docker")
        .args(["image", "inspect", "--format", "{{.Id}}", &recipe_tag])
        .output()
        .map_err(|e| format!("cannot run docker: {e}"))?;
    if have.status.success() {
        run("docker", &["tag", &recipe_tag, &format!("{name}:latest")])?;
        println!("xtask: {recipe_tag} is cached");
        return Ok(());
    }
    let dir = target_dir()
        .join("xtask-images")
        .join(name.rsplit('/').next().unwrap_or(name));
    if dir.exists() {
        std::fs::remove_dir_all(&dir).map_err(|e| format!("clearing {}: {e}", dir.display()))?;
    }
    std::fs::create_dir_all(&dir).map_err(|e| format!("creating {}: {e}", dir.display()))?;
    build(&dir)?;
    let script = format!(
        "tar --sort=name --numeric-owner -C '{}' -c . | docker import \
         -c 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
         -c 'ENV LANG=C.UTF-8' - '{recipe_tag}'",
        dir.display()
    );
    run("sh", &["-c", &script])?;
    run("docker", &["tag", &recipe_tag, &format!("{name}:latest")])?;
    std::fs::remove_dir_all(&dir).map_err(|e| format!("clearing {}: {e}", dir.display()))?;
    Ok(())
}

/// Install a Debian package providing `tool` if it is missing (CI and fresh machines).
fn ensure_tool(tool: &str, package: &str) -> Result<String, String> {
    let find = |t: &str| {
        ["/usr/bin", "/bin", "/usr/sbin", "/sbin"]
            .iter()
            .map(|d| format!("{d}/{t}"))
            .find(|p| std::path::Path::new(p).exists())
    };
    if let Some(p) = find(tool) {
        return Ok(p);
    }
    println!("xtask: {tool} is missing: installing the Debian package {package}");
    let _ = run("apt-get", &["update", "-qq"]);
    run_env(
        "apt-get",
        &["install", "-y", "-qq", package],
        &[("DEBIAN_FRONTEND", "noninteractive")],
    )?;
    find(tool).ok_or_else(|| format!("{tool} still missing after installing {package}"))
}

/// A root filesystem of static busybox with its applets, `/etc/passwd` and `/tmp`.
fn build_busybox_rootfs(dir: &std::path::Path) -> Result<(), String> {
    let busybox = ensure_tool("busybox", "busybox-static")?;
    let script = format!(
        r#"set -e
cd '{dir}'
mkdir -p bin etc tmp proc sys dev root usr
cp '{busybox}' bin/busybox
file_out=$(head -c 4096 bin/busybox | tr -dc 'a-z/.' | grep -c 'ld-linux' || true)
if [ "$file_out" != 0 ]; then echo "{busybox} is not static: install busybox-static" >&2; exit 1; fi
for a in $(bin/busybox --list); do [ "$a" = busybox ] || ln -s busybox "bin/$a"; done
ln -s ../bin usr/bin
ln -s bin sbin
printf 'root:x:0:0:root:/root:/bin/sh\nnobody:x:65534:65534:nobody:/nonexistent:/bin/false\n' > etc/passwd
printf 'root:x:0:\nnogroup:x:65534:\n' > etc/group
chmod 1777 tmp
"#,
        dir = dir.display()
    );
    run("sh", &["-c", &script])
}

/// A minimal Debian made by debootstrap from Debian's package archive.
fn build_debian_rootfs(dir: &std::path::Path) -> Result<(), String> {
    let debootstrap = ensure_tool("debootstrap", "debootstrap")?;
    let mirror = std::env::var("SANDBOX_DEBIAN_MIRROR")
        .unwrap_or_else(|_| "http://deb.debian.org/debian".to_owned());
    let include = format!("--include={DEBIAN_PACKAGES}");
    let target = dir.display().to_string();
    run(
        &debootstrap,
        &[
            "--variant=minbase",
            &include,
            DEBIAN_SUITE,
            &target,
            &mirror,
        ],
    )?;
    run(
        "sh",
        &[
            "-c",
            &format!("cd '{target}' && rm -rf var/cache/apt/archives/*.deb var/lib/apt/lists/*"),
        ],
    )
}

/// The "pod" image of the k8s test cluster: the Debian test image plus a static `sandboxd`.
const K8S_POD_IMAGE: &str = "sandbox-harness-test/k8s-pod";
/// Names the pod image for the tests (default `sandbox-harness-test/k8s-pod:latest`).
const K8S_POD_IMAGE_VAR: &str = "SANDBOX_K8S_POD_IMAGE";
const K8S_POD_TARGET: &str = "x86_64-unknown-linux-gnu";
/// The pod image's content tag, once [`k8s_pod_image`] has built or found it.
static K8S_POD_TAG: std::sync::OnceLock<String> = std::sync::OnceLock::new();
const K8S_POD_DOCKERFILE: &str = "\
FROM sandbox-harness-test/debian:r1
COPY sandboxd /usr/local/bin/sandboxd
WORKDIR /app
ENV SANDBOX_BASE_DIR=/app
EXPOSE 8080 9090 8888
CMD [\"/usr/local/bin/sandboxd\"]
";

/// Build `sandboxd` as a static binary (its own `--target` subdirectory of `target/`, so the
/// `crt-static` flags never touch the normal build's artifacts) and the pod image around it,
/// tagged by the content hash of the build context (binary + Dockerfile) and `:latest`. An
/// existing tag is reused.
fn k8s_pod_image() -> Result<(), String> {
    run_env(
        "cargo",
        &[
            "build",
            "--release",
            "-p",
            "sandboxd",
            "--target",
            K8S_POD_TARGET,
        ],
        &[("RUSTFLAGS", "-C target-feature=+crt-static")],
    )?;
    let binary = target_dir().join(format!("{K8S_POD_TARGET}/release/sandboxd"));
    let context = target_dir().join("xtask-images/k8s-pod");
    if context.exists() {
        std::fs::remove_dir_all(&context)
            .map_err(|e| format!("clearing {}: {e}", context.display()))?;
    }
    std::fs::create_dir_all(&context)
        .map_err(|e| format!("creating {}: {e}", context.display()))?;
    std::fs::copy(&binary, context.join("sandboxd"))
        .map_err(|e| format!("copying {}: {e}", binary.display()))?;
    // The release profile keeps line tables; the image does not need them (42 MB -> ~10 MB).
    run(
        "strip",
        &[
            "--strip-debug",
            &context.join("sandboxd").display().to_string(),
        ],
    )?;
    std::fs::write(context.join("Dockerfile"), K8S_POD_DOCKERFILE)
        .map_err(|e| format!("writing the Dockerfile: {e}"))?;
    let hash = Command::new("sh")
        .arg("-c")
        .arg("cat sandboxd Dockerfile | sha256sum")
        .current_dir(&context)
        .output()
        .map_err(|e| format!("cannot run sha256sum: {e}"))?;
    let hash = String::from_utf8_lossy(&hash.stdout);
    let hash = hash.get(..12).ok_or("sha256sum printed nothing")?;
    let tag = format!("{K8S_POD_IMAGE}:{hash}");
    let have = Command::new("docker")
        .args(["image", "inspect", "--format", "{{.Id}}", &tag])
        .output()
        .map_err(|e| format!("cannot run docker: {e}"))?;
    if have.status.success() {
        println!("xtask: {tag} is cached");
    } else {
        let context = context.display().to_string();
        run("docker", &["build", "-q", "-t", &tag, &context])?;
    }
    run("docker", &["tag", &tag, &format!("{K8S_POD_IMAGE}:latest")])?;
    println!("xtask: {K8S_POD_IMAGE_VAR}={tag}");
    let _ = K8S_POD_TAG.set(tag);
    let _ = std::fs::remove_dir_all(&context);
    Ok(())
}

/// `cargo xtask bench docker`: build the images, then run the benchmark binary (release).
fn bench_docker() -> Result<(), String> {
    docker_images()?;
    let out = target_dir().join("bench");
    run_env(
        "cargo",
        &["bench", "-p", "sandbox-docker", "--bench", "docker"],
        &[
            ("SANDBOX_TEST_DOCKER", "1"),
            ("SANDBOX_BENCH_OUT", out.to_str().expect("UTF-8 path")),
        ],
    )
}

// ---------------------------------------------------------------------------------------------
// S3: the tests start `s3s-fs` servers of their own; this only provides the binary.

/// The version of `s3s-fs` the S3 tests run against (installed from crates.io when missing).
const S3FS: &str = "0.14.1";

/// The variable that names the `s3s-fs` binary for the tests (and turns them on).
const S3FS_VAR: &str = "SANDBOX_TEST_S3FS";

/// `cargo xtask s3-test ARGS`: `cargo test ARGS` with `SANDBOX_TEST_S3FS` set.
fn s3_test(args: &[String]) -> Result<(), String> {
    let binary = s3s_fs()?;
    let mut cmd = vec!["test"];
    cmd.extend(args.iter().map(String::as_str));
    run_env("cargo", &cmd, &[(S3FS_VAR, binary.as_str())])
}

/// The path of `s3s-fs` at the pinned version: the one on the `PATH` or in cargo's bin
/// directory if it reports that version, else installed with `cargo install`. A binary that
/// still does not run fails the task (the S3 tests are never skipped).
fn s3s_fs() -> Result<String, String> {
    let bin_dir = std::env::var_os("CARGO_HOME")
        .map(std::path::PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| std::path::Path::new(&h).join(".cargo")))
        .map(|home| home.join("bin"));
    let candidates = || {
        let mut dirs: Vec<std::path::PathBuf> = std::env::var_os("PATH")
            .map(|p| std::env::split_paths(&p).collect())
            .unwrap_or_default();
        dirs.extend(bin_dir.clone());
        dirs.into_iter().map(|d| d.join("s3s-fs"))
    };
    let pinned = |path: &std::path::Path| {
        Command::new(path)
            .arg("--version")
            .output()
            .is_ok_and(|o| o.status.success() && String::from_utf8_lossy(&o.stdout).contains(S3FS))
    };
    if let Some(found) = candidates().find(|p| pinned(p)) {
        return Ok(found.to_string_lossy().into_owned());
    }
    println!("xtask: s3s-fs {S3FS} is missing: installing it from crates.io");
    run(
        "cargo",
        &[
            "install",
            "--locked",
            "--features",
            "binary",
            &format!("s3s-fs@{S3FS}"),
        ],
    )?;
    candidates()
        .find(|p| pinned(p))
        .map(|p| p.to_string_lossy().into_owned())
        .ok_or_else(|| {
            format!(
                "s3s-fs {S3FS} still missing after `cargo install` (the S3 tests cannot be skipped)"
            )
        })
}

/// An `s3s-fs` for the snapshot benchmark: a free loopback port, a temporary data directory
/// holding the bucket `bench`. Killed (by the pid we started) and reaped on drop, and its data
/// directory removed.
struct S3fsService {
    child: std::process::Child,
    port: u16,
    dir: std::path::PathBuf,
}

impl S3fsService {
    const BUCKET: &'static str = "bench";
    const ACCESS_KEY: &'static str = "sandbox-bench";
    const SECRET_KEY: &'static str = "sandbox-bench-secret";

    /// Start `binary` and wait until it accepts connections; a port taken meanwhile is retried
    /// on another. A server that cannot start fails the task.
    fn start(binary: &str) -> Result<S3fsService, String> {
        let mut last = String::new();
        for _ in 0..5 {
            match S3fsService::try_start(binary) {
                Ok(service) => {
                    println!(
                        "xtask: s3s-fs (pid {}) ready on 127.0.0.1:{}",
                        service.child.id(),
                        service.port
                    );
                    return Ok(service);
                }
                Err(e) => last = e,
            }
        }
        Err(format!("s3s-fs did not start: {last}"))
    }

    fn try_start(binary: &str) -> Result<S3fsService, String> {
        let port = free_port()?;
        let dir = std::env::temp_dir().join(format!("xtask-s3fs-{}-{port}", std::process::id()));
        let data = dir.join("data");
        // s3s-fs keeps a bucket as a directory of its data directory.
        std::fs::create_dir_all(data.join(S3fsService::BUCKET))
            .map_err(|e| format!("creating {}: {e}", data.display()))?;
        let log = std::fs::File::create(dir.join("s3s-fs.log"))
            .map_err(|e| format!("creating the s3s-fs log: {e}"))?;
        let child = Command::new(binary)
            .args(["--host", "127.0.0.1", "--port", &port.to_string()])
            .args(["--access-key", S3fsService::ACCESS_KEY])
            .args(["--secret-key", S3fsService::SECRET_KEY])
            .arg(&data)
            .env("RUST_LOG", "s3s_fs=info")
            .stdin(std::process::Stdio::null())
            .stdout(
                log.try_clone()
                    .map_err(|e| format!("the s3s-fs log: {e}"))?,
            )
            .stderr(log)
            .spawn()
            .map_err(|e| format!("cannot run {binary}: {e}"))?;
        // From here on the guard owns the process: an early return kills it.
        let mut service = S3fsService { child, port, dir };
        service.wait_ready().map_err(|e| {
            let log = std::fs::read_to_string(service.dir.join("s3s-fs.log")).unwrap_or_default();
            format!("{e}\n{log}")
        })?;
        Ok(service)
    }

    /// Poll a TCP connect every 20 ms for up to 20 s, while our child runs.
    fn wait_ready(&mut self) -> Result<(), String> {
        let started = Instant::now();
        let addr = std::net::SocketAddr::from(([127, 0, 0, 1], self.port));
        loop {
            if let Ok(Some(status)) = self.child.try_wait() {
                return Err(format!("s3s-fs on port {} exited: {status}", self.port));
            }
            if std::net::TcpStream::connect_timeout(&addr, std::time::Duration::from_millis(200))
                .is_ok()
            {
                return Ok(());
            }
            if started.elapsed() > std::time::Duration::from_secs(20) {
                return Err(format!("s3s-fs on port {} never listened", self.port));
            }
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
    }

    /// The variables that point the snapshot bench at this server.
    fn bench_env(&self) -> Vec<(&'static str, String)> {
        vec![
            (
                "SANDBOX_BENCH_S3_ENDPOINT",
                format!("http://127.0.0.1:{}", self.port),
            ),
            ("SANDBOX_BENCH_S3_BUCKET", S3fsService::BUCKET.to_owned()),
            (
                "SANDBOX_BENCH_S3_ACCESS_KEY",
                S3fsService::ACCESS_KEY.to_owned(),
            ),
            (
                "SANDBOX_BENCH_S3_SECRET_KEY",
                S3fsService::SECRET_KEY.to_owned(),
            ),
        ]
    }
}

impl Drop for S3fsService {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
        println!("xtask: s3s-fs on port {} stopped", self.port);
    }
}

// ---------------------------------------------------------------------------------------------
// Redis: a server of our own for the tests (guard-redis, and the Redis stores).

/// `cargo xtask redis-test ARGS`: `cargo test ARGS` with the test Redis running.
fn redis_test(args: &[String]) -> Result<(), String> {
    let redis = RedisService::start()?;
    let env = redis.test_env();
    let env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (*k, v.as_str())).collect();
    let mut cmd = vec!["test"];
    cmd.extend(args.iter().map(String::as_str));
    run_env("cargo", &cmd, &env)
}

/// A `redis-server` started for the test run on a free loopback port, in a temporary
/// directory, persisting nothing. Killed (by the pid we started) and waited for on drop, so it
/// stops after the tests and on every failure path.
struct RedisService {
    child: std::process::Child,
    port: u16,
    program: String,
    dir: std::path::PathBuf,
}

impl RedisService {
    /// Install the Debian package if `redis-server` is missing, start it and wait until it
    /// answers `PING`. A port taken between our probe and the server's bind is retried on
    /// another; a server that cannot start fails the task (the Redis tests are never skipped).
    fn start() -> Result<RedisService, String> {
        let program = ensure_tool("redis-server", "redis-server")?;
        let mut last = String::new();
        for _ in 0..5 {
            match RedisService::try_start(&program) {
                Ok(service) => {
                    println!(
                        "xtask: redis-server (pid {}) ready on 127.0.0.1:{}",
                        service.child.id(),
                        service.port
                    );
                    return Ok(service);
                }
                Err(e) => last = e,
            }
        }
        Err(format!(
            "the test Redis did not start (the Redis tests cannot be skipped): {last}"
        ))
    }

    fn try_start(program: &str) -> Result<RedisService, String> {
        let port = free_port()?;
        let dir = std::env::temp_dir().join(format!("xtask-redis-{}-{port}", std::process::id()));
        std::fs::create_dir_all(&dir).map_err(|e| format!("creating {}: {e}", dir.display()))?;
        let log = dir.join("redis.log");
        let child = Command::new(program)
            .args(["--port", &port.to_string(), "--bind", "127.0.0.1"])
            .args(["--save", "", "--appendonly", "no", "--daemonize", "no"])
            .arg("--dir")
            .arg(&dir)
            .arg("--logfile")
            .arg(&log)
            .stdin(std::process::Stdio::null())
            .spawn()
            .map_err(|e| format!("cannot run {program}: {e}"))?;
        // From here on the guard owns the process: an early return kills it.
        let mut service = RedisService {
            child,
            port,
            program: program.to_owned(),
            dir,
        };
        service.wait_ready().map_err(|e| {
            let log = std::fs::read_to_string(&log).unwrap_or_default();
            format!("{e}\n{log}")
        })?;
        Ok(service)
    }

    /// Poll `PING` (RESP inline command) every 20 ms for up to 10 s.
    fn wait_ready(&mut self) -> Result<(), String> {
        let started = Instant::now();
        loop {
            if let Ok(Some(status)) = self.child.try_wait() {
                return Err(format!(
                    "redis-server on port {} exited: {status}",
                    self.port
                ));
            }
            if ping(self.port) {
                return Ok(());
            }
            if started.elapsed() > std::time::Duration::from_secs(10) {
                return Err(format!(
                    "redis-server on port {} never answered PING",
                    self.port
                ));
            }
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
    }

    /// The variables that select and configure the Redis tests.
    fn test_env(&self) -> Vec<(&'static str, String)> {
        vec![
            (
                "SANDBOX_TEST_REDIS_URL",
                format!("redis://127.0.0.1:{}", self.port),
            ),
            // For tests that stop and restart servers of their own.
            ("SANDBOX_TEST_REDIS_SERVER", self.program.clone()),
        ]
    }
}

impl Drop for RedisService {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
        println!("xtask: redis-server on port {} stopped", self.port);
    }
}

/// A loopback port free right now (bound to port 0, then released).
fn free_port() -> Result<u16, String> {
    let listener = std::net::TcpListener::bind("127.0.0.1:0")
        .map_err(|e| format!("cannot bind a loopback port: {e}"))?;
    listener
        .local_addr()
        .map(|a| a.port())
        .map_err(|e| format!("cannot read the bound port: {e}"))
}

/// Whether a Redis answers `PONG` on the loopback `port`.
fn ping(port: u16) -> bool {
    use std::io::{BufRead as _, Write as _};
    let timeout = std::time::Duration::from_millis(500);
    let addr = std::net::SocketAddr::from(([127, 0, 0, 1], port));
    let Ok(mut stream) = std::net::TcpStream::connect_timeout(&addr, timeout) else {
        return false;
    };
    let _ = stream.set_read_timeout(Some(timeout));
    if stream.write_all(b"PING\r\n").is_err() {
        return false;
    }
    let mut line = String::new();
    std::io::BufReader::new(stream).read_line(&mut line).is_ok() && line.starts_with("+PONG")
}
