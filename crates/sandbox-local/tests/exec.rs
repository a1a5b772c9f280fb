//! exec against real processes: streams, stdin, cwd, env, caps, timeouts, killing what a
//! command started (more in `escapes.rs`). Boxes have the default (confined) isolation, but
//! the kill checks, which follow processes by host pid, run on the host shell; a confined
//! box's kills are checked in `escape.rs`.

mod common;

use std::time::{Duration, Instant};

use common::{TestBox, read_pid, rel, wait_gone};
use sandbox_core::host::tree_kill;
use sandbox_core::{Error, ExecRequest, OutputLimits, WorkspaceSpec};
use sandbox_local::{EnvPolicy, LocalOptions, MINIMAL_PATH};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn exit_code_and_separate_streams() {
    let b = TestBox::default().await;
    let r = b
        .sandbox
        .exec(ExecRequest::shell("echo out; echo err >&2; exit 3"))
        .await
        .unwrap();
    assert_eq!(r.exit_code, Some(3));
    assert_eq!(r.stdout_str(), "out\n");
    assert_eq!(r.stderr_str(), "err\n");
    assert!(!r.timed_out && !r.truncated());
    assert!(!r.success());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stdin_is_fed_then_closed_and_absent_stdin_is_empty() {
    let b = TestBox::default().await;
    let r = b
        .sandbox
        .exec(ExecRequest::shell("cat").stdin("hello\n"))
        .await
        .unwrap();
    assert_eq!(r.stdout_str(), "hello\n");
    // Larger than a pipe buffer: written concurrently with the reads.
    let big = vec![b'x'; 5 << 20];
    let r = b
        .sandbox
        .exec(ExecRequest::shell("wc -c").stdin(big))
        .await
        .unwrap();
    assert_eq!(r.stdout_str().trim(), (5u64 << 20).to_string());
    // No stdin: `cat` sees end-of-file at once instead of hanging.
    let r = b
        .sandbox
        .exec(ExecRequest::shell("cat").timeout(Duration::from_secs(10)))
        .await
        .unwrap();
    assert!(r.success(), "{r:?}");
    assert!(r.stdout.is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn argv_runs_without_a_shell() {
    let b = TestBox::default().await;
    let r = b
        .sandbox
        .exec(ExecRequest::argv(["printf", "%s|", "a b", "$HOME"]))
        .await
        .unwrap();
    assert_eq!(r.stdout_str(), "a b|$HOME|");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cwd_relative_and_absolute_inside() {
    let b = TestBox::default().await;
    let root = b.root();
    b.handle()
        .write_file(&rel("sub/dir/f.txt"), "x".into(), 0o644)
        .await
        .unwrap();
    let pwd = |cwd: Option<String>| {
        let sandbox = &b.sandbox;
        async move {
            let mut req = ExecRequest::argv(["pwd"]);
            if let Some(c) = cwd {
                req = req.cwd(c);
            }
            sandbox
                .exec(req)
                .await
                .unwrap()
                .stdout_str()
                .trim()
                .to_owned()
        }
    };
    let root_s = root.display().to_string();
    assert_eq!(pwd(None).await, root_s);
    assert_eq!(pwd(Some(".".into())).await, root_s);
    assert_eq!(
        pwd(Some("sub/dir".into())).await,
        format!("{root_s}/sub/dir")
    );
    assert_eq!(pwd(Some("./sub".into())).await, format!("{root_s}/sub"));
    assert_eq!(
        pwd(Some(format!("{root_s}/sub"))).await,
        format!("{root_s}/sub")
    );
    assert_eq!(pwd(Some(root_s.clone())).await, root_s);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cwd_escapes_are_refused() {
    let b = TestBox::default().await;
    let root = b.root().display().to_string();
    let outside = b.outside();
    std::os::unix::fs::symlink(&outside, b.root().join("out")).unwrap();
    // A sibling whose name extends the root's: equal by string prefix, not by components.
    std::fs::create_dir_all(format!("{root}2")).unwrap();
    for cwd in [
        "/tmp".to_owned(),
        "..".to_owned(),
        "sub/../..".to_owned(),
        format!("{root}/.."),
        format!("{root}/../workspace"),
        format!("{root}2"),
        "out".to_owned(),
        format!("{root}/out"),
    ] {
        let err = b
            .sandbox
            .exec(ExecRequest::argv(["pwd"]).cwd(cwd.clone()))
            .await
            .unwrap_err();
        assert!(matches!(err, Error::PathEscape { .. }), "{cwd}: {err}");
    }
    let err = b
        .sandbox
        .exec(ExecRequest::argv(["pwd"]).cwd("missing"))
        .await
        .unwrap_err();
    assert!(matches!(err, Error::NotFound { .. }), "{err}");
}

/// A variable of the test process other than the three the minimal environment sets. (The
/// workspace forbids `unsafe`, so the test cannot call `std::env::set_var`; cargo sets
/// `CARGO_MANIFEST_DIR` when it runs tests.)
fn parent_var() -> (String, String) {
    if let Ok(v) = std::env::var("CARGO_MANIFEST_DIR") {
        return ("CARGO_MANIFEST_DIR".into(), v);
    }
    std::env::vars()
        .find(|(k, _)| !["PATH", "HOME", "LANG"].contains(&k.as_str()))
        .expect("the test process has some environment variable")
}

fn env_lines(stdout: &str) -> std::collections::BTreeMap<String, String> {
    stdout
        .lines()
        .filter_map(|l| l.split_once('='))
        .map(|(k, v)| (k.to_owned(), v.to_owned()))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn minimal_env_has_nothing_of_the_parent_and_inherit_has_it() {
    let (name, value) = parent_var();

    let b = TestBox::default().await;
    let r = b.sandbox.exec(ExecRequest::argv(["env"])).await.unwrap();
    let env = env_lines(&r.stdout_str());
    let keys: Vec<&str> = env.keys().map(String::as_str).collect();
    assert_eq!(keys, ["HOME", "LANG", "PATH"], "{env:?}");
    assert_eq!(env["PATH"], MINIMAL_PATH);
    assert_eq!(env["HOME"], b.root().display().to_string());
    assert_eq!(env["LANG"], "C.UTF-8");
    assert!(!env.contains_key(&name));

    let b = TestBox::new(
        LocalOptions::default().env(EnvPolicy::Inherit),
        WorkspaceSpec::default(),
    )
    .await;
    let r = b.sandbox.exec(ExecRequest::argv(["env"])).await.unwrap();
    let env = env_lines(&r.stdout_str());
    assert_eq!(env.get(&name), Some(&value), "{name} missing under Inherit");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn spec_extra_and_request_env_layer_in_order() {
    let spec = WorkspaceSpec::builder()
        .env("LAYER", "spec")
        .env("SPEC_ONLY", "s")
        .build()
        .unwrap();
    let options = LocalOptions::default()
        .extra_env("LAYER", "extra")
        .extra_env("EXTRA_ONLY", "e");
    let b = TestBox::new(options, spec).await;
    let line = "echo $LAYER $SPEC_ONLY $EXTRA_ONLY";
    let r = b.sandbox.exec(ExecRequest::shell(line)).await.unwrap();
    assert_eq!(r.stdout_str(), "extra s e\n");
    let r = b
        .sandbox
        .exec(ExecRequest::shell(line).env("LAYER", "req"))
        .await
        .unwrap();
    assert_eq!(r.stdout_str(), "req s e\n");
    let err = b
        .sandbox
        .exec(ExecRequest::shell("true").env("BAD=NAME", "secret-value"))
        .await
        .unwrap_err();
    assert!(matches!(err, Error::InvalidInput { .. }), "{err}");
    assert!(!err.to_string().contains("secret-value"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn spawn_failure_is_a_backend_error_naming_the_program() {
    let b = TestBox::new(
        LocalOptions::default().shell(["no-such-shell-5f3a", "-c"]),
        WorkspaceSpec::default(),
    )
    .await;
    let err = b
        .sandbox
        .exec(ExecRequest::shell("true"))
        .await
        .unwrap_err();
    match &err {
        Error::Backend { message, .. } => assert!(message.contains("no-such-shell-5f3a"), "{err}"),
        _ => panic!("{err}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn large_output_is_capped_without_deadlock() {
    let b = TestBox::default().await;
    // stderr first: a collector that read stdout to its end before touching stderr would
    // block for ever on the full stderr pipe.
    let r = b
        .sandbox
        .exec(
            ExecRequest::shell(
                "head -c 20971520 /dev/zero >&2; head -c 20971520 /dev/zero; echo end >&2",
            )
            .limits(OutputLimits::both(4096))
            .timeout(Duration::from_secs(120)),
        )
        .await
        .unwrap();
    assert!(!r.timed_out, "{r:?}");
    assert_eq!(r.exit_code, Some(0));
    assert_eq!(r.stdout.len(), 4096);
    assert_eq!(r.stderr.len(), 4096);
    assert!(r.stdout_truncated && r.stderr_truncated);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn timeout_kills_a_backgrounded_grandchild_and_keeps_partial_output() {
    let b = TestBox::host_shell().await;
    let started = Instant::now();
    let r = b
        .sandbox
        .exec(
            ExecRequest::shell("echo before; sleep 300 & echo $! > gc.pid; wait")
                .timeout(Duration::from_millis(500)),
        )
        .await
        .unwrap();
    assert!(r.timed_out, "{r:?}");
    assert_eq!(r.exit_code, None);
    assert_eq!(r.stdout_str(), "before\n");
    assert!(started.elapsed() < Duration::from_secs(10), "{r:?}");
    // Killing the group closed the pipes at once: no wait for the 1 s reader grace period.
    assert!(r.duration < Duration::from_millis(1400), "{r:?}");
    let pid = read_pid(b.handle(), "gc.pid").await;
    assert!(
        wait_gone(pid, Duration::from_secs(3)).await,
        "grandchild {pid} still runs"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn default_timeout_applies_when_the_request_has_none() {
    let b = TestBox::new(
        LocalOptions::default().default_timeout(Duration::from_millis(300)),
        WorkspaceSpec::default(),
    )
    .await;
    let r = b
        .sandbox
        .exec(ExecRequest::shell("sleep 30"))
        .await
        .unwrap();
    assert!(r.timed_out);
    assert!(r.duration < Duration::from_secs(10), "{r:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn background_job_left_after_normal_exit_is_killed() {
    let b = TestBox::host_shell().await;
    let r = b
        .sandbox
        .exec(ExecRequest::shell(
            "sleep 300 & echo $! > bg.pid; echo done",
        ))
        .await
        .unwrap();
    assert_eq!(r.exit_code, Some(0));
    assert_eq!(r.stdout_str(), "done\n");
    assert!(!r.timed_out);
    // The job held the output pipes; killing the group closed them right away.
    // (Under the 1 s grace period: the pipes closed, exec did not have to give up on them.)
    assert!(r.duration < Duration::from_millis(900), "{r:?}");
    let pid = read_pid(b.handle(), "bg.pid").await;
    assert!(
        wait_gone(pid, Duration::from_secs(3)).await,
        "background job {pid} still runs"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn setsid_grandchild_holding_stdout_is_killed_and_does_not_hang_exec() {
    let b = TestBox::host_shell().await;
    let started = Instant::now();
    let r = b
        .sandbox
        .exec(
            ExecRequest::shell(
                "setsid sh -c 'echo $$ > sid.pid; exec sleep 60' & sleep 0.3; echo main-done",
            )
            .timeout(Duration::from_secs(120)),
        )
        .await
        .unwrap();
    let elapsed = started.elapsed();
    assert!(!r.timed_out, "{r:?}");
    assert_eq!(r.exit_code, Some(0));
    assert_eq!(r.stdout_str(), "main-done\n");
    assert!(elapsed < Duration::from_secs(10), "took {elapsed:?}");
    let pid = read_pid(b.handle(), "sid.pid").await;
    if tree_kill().kills_escaped() {
        // Killed with the command (its cgroup), which closed the pipes at once.
        assert!(r.duration < Duration::from_secs(1), "{r:?}");
        assert!(
            wait_gone(pid, Duration::from_secs(3)).await,
            "the setsid process {pid} survived"
        );
    } else {
        // Process groups only: it left the group and survived; exec returned after the 1 s
        // grace instead of the escaped process's 60 s.
        eprintln!("no cgroups: checking process-group semantics only");
        assert!(r.duration >= Duration::from_secs(1), "{r:?}");
        assert!(
            !common::gone_or_zombie(pid),
            "the setsid process should have survived"
        );
        nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(pid),
            nix::sys::signal::Signal::SIGKILL,
        )
        .unwrap();
        assert!(wait_gone(pid, Duration::from_secs(3)).await);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn exec_without_workspace_is_not_found() {
    let b = TestBox::default().await;
    std::fs::remove_dir_all(b.root()).unwrap();
    let err = b
        .sandbox
        .exec(ExecRequest::shell("true"))
        .await
        .unwrap_err();
    assert!(
        matches!(
            err,
            Error::NotFound {
                what: "workspace",
                ..
            }
        ),
        "{err}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancelled_exec_kills_its_process_group() {
    let b = TestBox::host_shell().await;
    let exec = b.sandbox.exec(
        ExecRequest::shell("echo $$ > main.pid; sleep 300 & echo $! > c.pid; wait")
            .timeout(Duration::from_secs(120)),
    );
    // Dropping the exec future (here by an outer timeout) is a cancellation.
    assert!(
        tokio::time::timeout(Duration::from_millis(700), exec)
            .await
            .is_err()
    );
    for file in ["main.pid", "c.pid"] {
        let pid = read_pid(b.handle(), file).await;
        assert!(
            wait_gone(pid, Duration::from_secs(3)).await,
            "{file}: {pid} still runs after the exec was cancelled"
        );
    }
}
