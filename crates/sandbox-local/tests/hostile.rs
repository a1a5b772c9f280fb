//! Hostile workloads in a confined box: a fork bomb past the pids limit, a memory hog past the
//! memory limit, CPU spin, 100,000 small files. In each, a second box keeps answering (its
//! command has a timeout: a box starved by the first would fail it) and the hostile command
//! returns an `ExecResult` that says it failed, timed out or was killed. (Disk fill is left
//! out: the workspace is on the host's file system, which has no per-box quota here.)

mod common;

use std::time::Duration;

use common::TestBox;
use sandbox_core::{ExecRequest, WorkspaceSpec};
use sandbox_local::{ConfineOptions, Isolation, Limits, LocalOptions};

fn options(limits: Limits) -> LocalOptions {
    LocalOptions::default().isolation(Isolation::Confined(
        ConfineOptions::default().limits(limits),
    ))
}

async fn confined(limits: Limits) -> TestBox {
    TestBox::new(options(limits), WorkspaceSpec::default()).await
}

/// A box whose start may fail closed (a required limit this user cannot enforce).
async fn try_confined(limits: Limits) -> sandbox_core::Result<TestBox> {
    let dir = tempfile::tempdir().unwrap();
    let client =
        sandbox_local::LocalClient::new(options(limits).base_dir(dir.path().join("boxes")));
    let sandbox = sandbox_core::Sandbox::create(
        &client,
        sandbox_core::SandboxConfig::new(WorkspaceSpec::default()),
        None,
    )
    .await?;
    sandbox.start().await?;
    Ok(TestBox {
        dir,
        client,
        sandbox,
    })
}

/// The second box answers while `hostile` runs in the first; returns the hostile result.
async fn while_hostile(
    first: &TestBox,
    hostile: &str,
    timeout: Duration,
) -> sandbox_core::ExecResult {
    let second = confined(Limits::default()).await;
    let hostile = first
        .sandbox
        .exec(ExecRequest::shell(hostile).timeout(timeout));
    let probe = async {
        // Let the workload get going.
        tokio::time::sleep(Duration::from_millis(500)).await;
        second
            .sandbox
            .exec(ExecRequest::shell("echo answer").timeout(Duration::from_secs(20)))
            .await
            .unwrap()
    };
    let (hostile, answer) = tokio::join!(hostile, probe);
    assert!(
        !answer.timed_out,
        "the second box did not answer: {answer:?}"
    );
    assert_eq!(answer.stdout_str(), "answer\n");
    // The host still spawns processes.
    assert!(
        std::process::Command::new("true")
            .status()
            .unwrap()
            .success()
    );
    hostile.unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fork_bomb_stops_at_the_pids_limit() {
    // Only a pids limit: enforced by a cgroup, or by RLIMIT_NPROC where none is writable.
    let b = confined(Limits::none().pids(128)).await;
    let r = while_hostile(
        &b,
        "bomb() { bomb | bomb & }; bomb; sleep 3; echo survived",
        Duration::from_secs(6),
    )
    .await;
    eprintln!("fork bomb: {r:?}");
    assert!(
        r.timed_out || r.exit_code != Some(0) || r.stderr_str().contains("fork"),
        "{r:?}"
    );
    // The box works again once the bomb is dead.
    let again = b
        .sandbox
        .exec(ExecRequest::shell("echo again"))
        .await
        .unwrap();
    assert_eq!(again.stdout_str(), "again\n");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_memory_hog_dies_at_the_memory_limit() {
    let b = match try_confined(Limits::none().memory(128 << 20)).await {
        Ok(b) => b,
        // Without a writable memory cgroup (an unprivileged user here) the required limit
        // fails the box's start, naming what is missing: never a box without the limit.
        Err(sandbox_core::Error::IsolationUnavailable { missing, .. })
            if !rustix::process::geteuid().is_root() =>
        {
            assert!(missing.contains("memory"), "{missing}");
            eprintln!("memory hog: the box refused to start: {missing}");
            return;
        }
        Err(e) => panic!("{e}"),
    };
    let r = while_hostile(
        &b,
        "python3 -c 'b = bytearray(1 << 30); b[::4096] = b\"x\" * len(b[::4096]); print(\"allocated\")'",
        Duration::from_secs(30),
    )
    .await;
    eprintln!("memory hog: {r:?}");
    assert!(!r.stdout_str().contains("allocated"), "{r:?}");
    assert_ne!(r.exit_code, Some(0), "{r:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cpu_spin_leaves_the_other_box_answering() {
    let b = confined(Limits::default()).await;
    let r = while_hostile(
        &b,
        "for i in 1 2 3 4; do (while :; do :; done) & done; wait",
        Duration::from_secs(4),
    )
    .await;
    assert!(r.timed_out, "{r:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hundred_thousand_files() {
    let b = confined(Limits::default()).await;
    let r = while_hostile(
        &b,
        "python3 -c '
import os
os.makedirs(\"many\", exist_ok=True)
for i in range(100000):
    with open(\"many/%d\" % i, \"w\") as f: f.write(\"x\")
print(len(os.listdir(\"many\")))
'",
        Duration::from_secs(120),
    )
    .await;
    assert_eq!(r.stdout_str().trim(), "100000", "{r:?}");
    assert_eq!(
        std::fs::read_dir(b.root().join("many")).unwrap().count(),
        100_000
    );
}
