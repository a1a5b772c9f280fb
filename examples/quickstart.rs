//! Quickstart: three calls on the local backend, confined by the kernel (its default
//! isolation: namespaces, a read-only view of the host's system directories, no network,
//! seccomp, Landlock, limits), showing recovery across replicas, isolation between users, and
//! workspace projection. Everything lives under `./.sandbox/quickstart/`
//! (cleared at start). Exits 0 only if every check holds.
//!
//! ```text
//! cargo run --example quickstart
//! ```

use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use sandbox_harness::local::{LocalClient, LocalOptions};
use sandbox_harness::{
    CallContext, CallReport, ExecRequest, FileGuard, FileStateStore, IsolationScope, Persistence,
    Projection, ProjectionOutcome, SandboxClient, SandboxConfig, SandboxManager, SnapshotSpec,
    WorkspaceSpec,
};

struct Checks {
    passed: usize,
    failed: Vec<String>,
}

impl Checks {
    fn check(&mut self, ok: bool, what: &str) {
        if ok {
            self.passed += 1;
            println!("    ✓ {what}");
        } else {
            self.failed.push(what.to_owned());
            println!("    ✗ {what}");
        }
    }
}

/// One replica: its own client, manager and guard; only the stores under `root` are shared.
fn replica(root: &Path) -> SandboxManager {
    let client: Arc<dyn SandboxClient> = Arc::new(LocalClient::new(
        LocalOptions::default()
            .base_dir(root.join("boxes"))
            .persistence(Persistence::Ephemeral),
    ));
    let spec = WorkspaceSpec::builder()
        .file("README.md", "Workspace created by the quickstart.\n")
        .build()
        .expect("valid spec");
    let config = SandboxConfig::new(spec)
        .snapshots(SnapshotSpec::local_dir(root.join("snapshots")))
        .projection(Projection::new(root.join("host")));
    // Files for state, snapshots and leases: safe for every process of this host, and
    // checked to be so.
    SandboxManager::builder(client)
        .state_store(Arc::new(FileStateStore::new(root.join("state"))))
        .guard(Arc::new(FileGuard::new(root.join("leases"))))
        .scope(IsolationScope::User)
        .config(config)
        .require_durable()
        // Refuses a backend whose commands run as plain host processes.
        .require_isolation()
        .build()
        .expect("a durable, isolated set-up")
}

fn ms(d: Duration) -> String {
    format!("{:.1} ms", d.as_secs_f64() * 1000.0)
}

fn timings(report: &CallReport, exec: Duration) {
    let start = report.start.as_ref().map_or(Duration::ZERO, |s| s.duration);
    let (stop, snapshot) = match &report.stop {
        Some(s) if s.unchanged => (s.duration, "snapshot unchanged, nothing written".to_owned()),
        Some(s) => (
            s.duration,
            format!("snapshot wrote {:.1} KiB", s.bytes_written as f64 / 1024.0),
        ),
        None => (Duration::ZERO, "no snapshot".to_owned()),
    };
    println!(
        "    timings: acquire {} · start {} · exec {} · stop {} ({snapshot}) · total {}",
        ms(report.acquire),
        ms(start),
        ms(exec),
        ms(stop),
        ms(report.total)
    );
}

fn describe_start(report: &CallReport) {
    if let Some(start) = &report.start {
        println!(
            "    branch {} · projection {:?}",
            start.branch, start.projection
        );
    }
}

#[tokio::main]
async fn main() -> std::process::ExitCode {
    let root = Path::new(".sandbox/quickstart");
    let _ = std::fs::remove_dir_all(root);
    let host = root.join("host");
    std::fs::create_dir_all(host.join("skills/greet")).expect("host dir");
    std::fs::write(host.join("AGENTS.md"), "You are a careful assistant.\n").expect("write");
    std::fs::write(
        host.join("skills/greet/SKILL.md"),
        "Run ./bin/greet to greet the user.\n",
    )
    .expect("write");
    let mut checks = Checks {
        passed: 0,
        failed: Vec::new(),
    };

    println!(
        "sandbox-harness quickstart: local backend, snapshots and state under {}/",
        root.display()
    );
    println!(
        "  host workspace {}: AGENTS.md, skills/greet/SKILL.md (projected into every box)",
        host.display()
    );
    // What a box gets here; a kernel that refuses a required piece is an error naming it.
    match LocalClient::new(LocalOptions::default()).probe().await {
        Ok(Some(report)) => {
            println!("  isolation: {report}\n");
        }
        Ok(None) => println!("  isolation: none (host shell)\n"),
        Err(e) => {
            println!("  isolation unavailable: {e}");
            return std::process::ExitCode::FAILURE;
        }
    }

    // Call 1: alice on replica 1 creates files and a small executable.
    println!("call 1 · user alice · replica 1");
    let alice = CallContext::new("quickstart")
        .user("alice")
        .session("morning");
    let replica1 = replica(root);
    let mut exec_time = Duration::ZERO;
    let call1 = replica1
        .call(&alice, |sb| async move {
            let t = Instant::now();
            let r = sb
                .exec(ExecRequest::shell(
                    "mkdir -p bin && printf '#!/bin/sh\\necho \"hello, $1\"\\n' > bin/greet && chmod +x bin/greet \
                     && echo 'remember: alice likes tea' > notes.txt && ./bin/greet alice",
                ))
                .await;
            (r, t.elapsed())
        })
        .await;
    let call1 = match call1 {
        Ok(c) => c,
        Err(e) => {
            println!("    call 1 failed: {e}");
            return std::process::ExitCode::FAILURE;
        }
    };
    let (out1, t1) = call1.value;
    exec_time += t1;
    let out1 = out1
        .map(|r| r.stdout_str().into_owned())
        .unwrap_or_else(|e| e.to_string());
    describe_start(&call1.report);
    println!("    ./bin/greet alice → {}", out1.trim());
    checks.check(
        out1 == "hello, alice\n",
        "alice's executable runs in her box",
    );
    checks.check(
        matches!(
            call1.report.start.as_ref().map(|s| &s.projection),
            Some(ProjectionOutcome::Applied { written: 2, .. })
        ),
        "projection applied AGENTS.md and the skill",
    );
    checks.check(call1.report.persisted, "state persisted after the call");
    timings(&call1.report, exec_time);

    // Call 2: alice again, through a new manager and client (a second replica).
    println!("\ncall 2 · user alice · replica 2 (new manager, same stores)");
    let replica2 = replica(root);
    let call2 = replica2
        .call(&alice.clone().session("afternoon"), |sb| async move {
            let t = Instant::now();
            let greet = sb.exec(ExecRequest::shell("./bin/greet alice")).await;
            let notes = sb
                .exec(ExecRequest::shell(
                    "cat notes.txt AGENTS.md skills/greet/SKILL.md",
                ))
                .await;
            (greet, notes, t.elapsed())
        })
        .await
        .expect("call 2");
    let (greet, notes, t2) = call2.value;
    let greet = greet
        .map(|r| r.stdout_str().into_owned())
        .unwrap_or_default();
    let notes = notes
        .map(|r| r.stdout_str().into_owned())
        .unwrap_or_default();
    describe_start(&call2.report);
    println!("    ./bin/greet alice → {}", greet.trim());
    checks.check(
        call2
            .report
            .start
            .as_ref()
            .is_some_and(|s| s.branch == sandbox_harness::StartBranch::RestoreEphemeral),
        "restored from alice's snapshot (branch B) on the other replica",
    );
    checks.check(
        greet == "hello, alice\n" && notes.contains("alice likes tea"),
        "alice's files and executable are back",
    );
    checks.check(
        notes.contains("careful assistant") && notes.contains("greet the user"),
        "projected AGENTS.md and skill are in the box",
    );
    checks.check(
        call2
            .report
            .start
            .as_ref()
            .is_some_and(|s| s.projection == ProjectionOutcome::Skipped),
        "projection skipped: host files unchanged",
    );
    timings(&call2.report, t2);

    // Call 3: bob sees none of alice's files.
    println!("\ncall 3 · user bob · replica 1");
    let bob = CallContext::new("quickstart")
        .user("bob")
        .session("morning");
    let call3 = replica1
        .call(&bob, |sb| async move {
            let t = Instant::now();
            let r = sb
                .exec(ExecRequest::shell(
                    "ls -A; test ! -e notes.txt && test ! -e bin/greet",
                ))
                .await;
            (r, t.elapsed())
        })
        .await
        .expect("call 3");
    let (listing, t3) = call3.value;
    describe_start(&call3.report);
    let listing = listing.expect("exec");
    println!(
        "    ls -A → {}",
        listing
            .stdout_str()
            .split_whitespace()
            .collect::<Vec<_>>()
            .join(" ")
    );
    checks.check(listing.success(), "bob sees none of alice's files");
    checks.check(
        call3
            .report
            .start
            .as_ref()
            .is_some_and(|s| s.branch == sandbox_harness::StartBranch::Cold),
        "bob's box started cold (branch D)",
    );
    timings(&call3.report, t3);

    println!();
    if checks.failed.is_empty() {
        println!("all {} checks passed", checks.passed);
        std::process::ExitCode::SUCCESS
    } else {
        println!(
            "{} of {} checks FAILED: {:?}",
            checks.failed.len(),
            checks.passed + checks.failed.len(),
            checks.failed
        );
        std::process::ExitCode::FAILURE
    }
}
