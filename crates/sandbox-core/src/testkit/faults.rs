//! The `faults` group: the call lifecycle under cancellation, failures, concurrency and stale
//! lease holders, checked against the invariants of ARCHITECTURE.md:
//!
//! - **I1** the stored state points at a complete, restorable snapshot holding every write of
//!   every call that returned success;
//! - **I2** a call never touches another call's box;
//! - **I3** nothing outside the box that the host owns is deleted or written;
//! - **I4** a stale lease holder can neither save state nor delete snapshots;
//! - **I5** once the post-call steps begin, they run to completion, even if every caller
//!   future is dropped;
//! - **I6** a call cancelled while its closure runs is a failed call: by default nothing of
//!   it becomes current and the next call is told; kept partial work is marked partial with
//!   its possibly torn files listed.
//!
//! Every scenario is a plain `async fn(&dyn Fixture)`; [`crate::conformance_tests!`] runs
//! them (the two that start OS processes take their test's name, to re-run it as the child).

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use bytes::Bytes;

use super::faulty::{
    Fault, FaultyClient, FaultyGuard, FaultySnapshotStore, FaultyStateStore, Script,
};
use super::{Env, Fixture, read, sh, snapshot_of, spec};
use crate::backend::Persistence;
use crate::error::{Error, Result};
use crate::exec::ExecRequest;
use crate::guard::{FileGuard, FileGuardOptions, InProcessGuard, SandboxExecutionGuard};
use crate::isolation::{CallContext, IsolationKey, IsolationScope};
use crate::manager::{Acquire, CallError, Called, SandboxManager};
use crate::path::RelPath;
use crate::reach::Reach;
use crate::sandbox::{Sandbox, SandboxConfig, StartBranch};
use crate::snapshot::{SnapshotFormat, SnapshotSpec, SnapshotStoreExt as _};
use crate::state::state_from_json;
use crate::state_store::{FileStateStore, StateStore};

/// What a call's closure managed to write.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
struct Wrote {
    /// `v.txt` through a command.
    exec: bool,
    /// `w.txt` through the file primitive.
    file: bool,
}

/// Write `v.txt` = `v<n>` (by a command) and `w.txt` = `w<n>` (by the file primitive),
/// reporting what worked.
async fn work(sb: Arc<Sandbox>, n: u32) -> Wrote {
    let exec = sb
        .exec(ExecRequest::shell(format!("echo v{n} > v.txt")).timeout(Duration::from_secs(60)))
        .await
        .is_ok_and(|r| r.success());
    let file = sb
        .handle()
        .write_file(&rel("w.txt"), Bytes::from(format!("w{n}\n")), 0o644)
        .await
        .is_ok();
    Wrote { exec, file }
}

fn rel(p: &str) -> RelPath {
    RelPath::new(p).expect("path")
}

/// Both files, as the box has them.
async fn seen(sb: &Sandbox) -> (Option<String>, Option<String>) {
    (read(sb, "v.txt").await, read(sb, "w.txt").await)
}

fn tagged(tag: &str) -> Option<String> {
    Some(format!("{tag}\n"))
}

/// A manager whose client, stores and guard all step one script, beside a clean manager on
/// the same stores and the same underlying guard (so its calls wait for the faulty ones).
struct Rig {
    env: Env,
    script: Arc<Script>,
    guard: Arc<InProcessGuard>,
    faulty: SandboxManager,
    clean: SandboxManager,
    ctx: CallContext,
    key: IsolationKey,
    canary: PathBuf,
}

impl Rig {
    async fn new(fx: &dyn Fixture, persistence: Persistence, format: SnapshotFormat) -> Rig {
        let env = Env::of(fx).await;
        let script = Script::new();
        let guard = Arc::new(InProcessGuard::new());
        // A host directory mounted into the box: no restore, replace or release may touch it.
        let canary = env.dir.path().join("canary");
        std::fs::create_dir_all(&canary).expect("canary");
        std::fs::write(canary.join("keep.txt"), "host data\n").expect("canary");
        let client = fx.client(persistence).await;
        let spec = if client.capabilities().bind_mounts {
            let mut b = crate::spec::WorkspaceSpec::builder()
                .file("README.md", "from the spec\n")
                .ephemeral_file("run/token", "token-v1\n");
            b = b.bind_mount("mnt", &canary, false);
            b.build().expect("spec")
        } else {
            spec()
        };
        let snapshots = |store: Arc<dyn crate::snapshot::SnapshotStore>| {
            SandboxConfig::new(spec.clone()).snapshots(SnapshotSpec::new(store).format(format))
        };
        let faulty =
            SandboxManager::builder(Arc::new(FaultyClient::new(client.clone(), script.clone())))
                .state_store(Arc::new(FaultyStateStore::new(
                    env.states.clone(),
                    script.clone(),
                )))
                .guard(Arc::new(FaultyGuard::new(guard.clone(), script.clone())))
                .config(snapshots(Arc::new(FaultySnapshotStore::new(
                    env.snapshots.clone(),
                    script.clone(),
                ))))
                .build()
                .expect("manager");
        let clean = SandboxManager::builder(fx.client(persistence).await)
            .state_store(env.states.clone())
            .guard(guard.clone())
            .config(snapshots(env.snapshots.clone()))
            .build()
            .expect("manager");
        let ctx = env.ctx().session("faults");
        let key = IsolationKey::resolve(IsolationScope::Session, &ctx).expect("key");
        Rig {
            env,
            script,
            guard,
            faulty,
            clean,
            ctx,
            key,
            canary,
        }
    }

    /// The first call: `v1`/`w1`, persisted. Returns its snapshot id.
    async fn seed(&self) -> String {
        let r = self
            .clean
            .call(&self.ctx, |sb| work(sb, 1))
            .await
            .expect("seed call");
        assert_eq!(
            r.value,
            Wrote {
                exec: true,
                file: true
            }
        );
        self.stored_snapshot().await.expect("seeded")
    }

    /// The id of the snapshot the stored state points at.
    async fn stored_snapshot(&self) -> Option<String> {
        let stored = self.env.states.load(&self.key).await.expect("load");
        snapshot_of(stored.as_deref()).map(|s| s.id)
    }

    /// The call under test, through the faulty manager.
    async fn call_b(&self) -> std::result::Result<Called<Wrote>, CallError<Wrote>> {
        self.faulty.call(&self.ctx, |sb| work(sb, 2)).await
    }

    /// Wait (bounded) until no call holds the key: the post-call steps of a dropped call
    /// finished (I5).
    async fn idle(&self) {
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            if let Some(lease) = self.guard.try_enter(&self.key).await.expect("try_enter") {
                lease.release().await.expect("release");
                return;
            }
            assert!(Instant::now() < deadline, "the key was never released (I5)");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    /// A clean call that reads both files and writes `v3`/`w3`. Also returns how it started
    /// and the snapshot the stored state pointed at when it got the key.
    async fn call_c(&self) -> NextCall {
        let r = self
            .clean
            .call(&self.ctx, |sb| async move {
                let before = seen(&sb).await;
                let stored = self.stored_snapshot().await;
                assert_eq!(
                    work(sb, 3).await,
                    Wrote {
                        exec: true,
                        file: true
                    }
                );
                (before, stored)
            })
            .await
            .unwrap_or_else(|e| panic!("the next call fails: {e} ({:?})", e.report));
        assert!(r.report.persisted);
        NextCall {
            seen: r.value.0,
            stored: r.value.1,
            branch: r.report.start.map(|s| s.branch),
            previous_cancelled: r.report.previous_cancelled.is_some(),
        }
    }

    /// I1 and I3 after the last clean call: the stored state's snapshot is complete and
    /// restores `v3`/`w3` into a box that lost its workspace; the host canary is untouched.
    async fn check_restorable(&self, fx: &dyn Fixture) {
        let stored = self.env.states.load(&self.key).await.expect("load");
        let snap = snapshot_of(stored.as_deref()).expect("the stored state has a snapshot");
        crate::snapshot::load_manifest(&self.env.snapshot_spec(), &snap)
            .await
            .expect("the stored snapshot is complete (I1)");
        let state =
            crate::state::state_from_json(stored.as_deref().expect("state")).expect("state");
        fx.lose_box(&*state).await;
        let r = self
            .clean
            .call(&self.ctx, |sb| async move { seen(&sb).await })
            .await
            .expect("restore");
        assert_eq!(r.value, (tagged("v3"), tagged("w3")), "restored (I1)");
        assert!(matches!(
            r.report.start.as_ref().map(|s| s.branch),
            Some(StartBranch::RestoreEphemeral | StartBranch::RestoreAll)
        ));
        assert_eq!(
            std::fs::read_to_string(self.canary.join("keep.txt")).expect("canary (I3)"),
            "host data\n"
        );
    }
}

/// What the call after the one under test found.
struct NextCall {
    /// `v.txt` and `w.txt`.
    seen: (Option<String>, Option<String>),
    /// The stored state's snapshot when it got the key.
    stored: Option<String>,
    /// How it started.
    branch: Option<StartBranch>,
    /// Its report said the previous call was cancelled.
    previous_cancelled: bool,
}

/// The steps of one call of the faulty manager, after a seed call.
async fn learn_steps(
    fx: &dyn Fixture,
    persistence: Persistence,
    format: SnapshotFormat,
) -> Vec<&'static str> {
    let rig = Rig::new(fx, persistence, format).await;
    rig.seed().await;
    rig.script.record();
    let r = rig.call_b().await.expect("an unarmed call succeeds");
    assert!(r.report.persisted);
    rig.script.steps()
}

/// Where a step falls in the call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    Begin,
    Closure,
    PostCall,
}

fn phase(steps: &[&str], cut: usize) -> Phase {
    let first = steps
        .iter()
        .position(|s| *s == "box.exec")
        .expect("the closure execs");
    let last = steps
        .iter()
        .position(|s| *s == "box.write_file")
        .expect("and writes");
    if cut < first {
        Phase::Begin
    } else if cut <= last {
        Phase::Closure
    } else {
        Phase::PostCall
    }
}

/// Drop the call at every step it takes, in two set-ups; check I1, I2, I3, I5 and I6 after
/// each.
/// Returns the number of cut points covered.
pub async fn faults_cancellation_sweep(fx: &dyn Fixture) -> usize {
    let mut cuts = 0;
    for (persistence, format) in [
        (Persistence::Ephemeral, SnapshotFormat::Tar),
        (Persistence::Keep, SnapshotFormat::Chunked),
    ] {
        let steps = learn_steps(fx, persistence, format).await;
        println!(
            "cancellation sweep, {persistence:?} + {format:?}: {} cut points: {}",
            steps.len(),
            steps.join(" ")
        );
        for cut in 0..steps.len() {
            let rig = Rig::new(fx, persistence, format).await;
            let seeded = rig.seed().await;
            rig.script.arm(cut, Fault::Pause);
            let m = rig.faulty.clone();
            let ctx = rig.ctx.clone();
            let b = tokio::spawn(async move { m.call(&ctx, |sb| work(sb, 2)).await });
            let at = rig.script.paused(Duration::from_secs(60)).await;
            assert!(at.is_some(), "cut {cut} was never reached: {steps:?}");
            // The caller goes away at this step...
            b.abort();
            let _ = b.await;
            // ...and the step goes on (if it runs on a task of its own).
            rig.script.release();
            // I2: the next call waits until the dropped call gave the key back, and finds a
            // whole workspace, never another call's half-made one.
            let next = rig.call_c().await;
            let (v, w) = next.seen.clone();
            let at = at.expect("reached");
            let what = format!("cut {cut} at {at} ({persistence:?}, {format:?})");
            match phase(&steps, cut) {
                Phase::Begin => {
                    assert_eq!(
                        (v, w),
                        (tagged("v1"), tagged("w1")),
                        "{what}: a call cancelled while starting changes nothing"
                    );
                    assert_eq!(
                        next.stored.as_ref(),
                        Some(&seeded),
                        "{what}: and saves nothing"
                    );
                }
                Phase::Closure => {
                    // A call cut while its closure runs is a failed call: none of its work
                    // becomes current, in a kept box neither, and its state is not advanced.
                    assert_eq!(
                        (v, w),
                        (tagged("v1"), tagged("w1")),
                        "{what}: a call cancelled in its closure changes nothing"
                    );
                    assert_eq!(
                        next.stored.as_ref(),
                        Some(&seeded),
                        "{what}: and its state is not advanced"
                    );
                    assert!(next.previous_cancelled, "{what}: the next call is told");
                }
                Phase::PostCall => {
                    // I5: the dropped call's post-call steps ran to their end: its state was
                    // saved, and (ephemeral) its box released, before the next call began.
                    assert_eq!((v, w), (tagged("v2"), tagged("w2")), "{what}");
                    assert_ne!(
                        next.stored.as_ref(),
                        Some(&seeded),
                        "{what}: B's state was saved"
                    );
                    if persistence == Persistence::Ephemeral {
                        assert_eq!(
                            next.branch,
                            Some(StartBranch::RestoreEphemeral),
                            "{what}: B's box was released"
                        );
                    }
                }
            }
            rig.idle().await;
            rig.check_restorable(fx).await;
            cuts += 1;
        }
    }
    tracing::info!(cuts, "cancellation sweep done");
    println!("cancellation sweep: {cuts} cut points");
    cuts
}

/// Fail every step of a call once, in two set-ups; check that the error comes with the report
/// and the closure's value, that a failed stop or save keeps the box, that no write of the
/// closure is lost, and I1/I3. Returns the number of faults injected.
pub async fn faults_fault_sweep(fx: &dyn Fixture) -> usize {
    let mut faults = 0;
    for (persistence, format) in [
        (Persistence::Ephemeral, SnapshotFormat::Tar),
        (Persistence::Keep, SnapshotFormat::Chunked),
    ] {
        let steps = learn_steps(fx, persistence, format).await;
        println!(
            "fault sweep, {persistence:?} + {format:?}: {} faults: {}",
            steps.len(),
            steps.join(" ")
        );
        for at in 0..steps.len() {
            let rig = Rig::new(fx, persistence, format).await;
            rig.seed().await;
            rig.script.arm(at, Fault::Fail);
            let label = steps[at];
            let what = format!("fault {at} at {label} ({persistence:?}, {format:?})");
            let (wrote, report, error) = match rig.call_b().await {
                Ok(c) => (Some(c.value), Some(c.report), None),
                Err(e) => (e.value, e.report, Some(e.error)),
            };
            if let Some(e) = &error {
                assert!(
                    format!("{e} {:?}", e).contains("injected fault"),
                    "{what}: the error is the injected one: {e}"
                );
            }
            if phase(&steps, at) != Phase::Begin {
                assert!(wrote.is_some(), "{what}: the closure's value comes back");
                let report = report.as_ref().expect("the report comes back");
                if report.stop.is_some() {
                    assert!(
                        report.state_json.is_some(),
                        "{what}: the state JSON is not lost"
                    );
                }
                if report.stop.is_none() || !report.persisted {
                    assert!(
                        report.parked,
                        "{what}: a call whose work was not saved keeps its box"
                    );
                }
            }
            // What the closure wrote is current if its state was saved — or, for a kept box,
            // always (the box itself goes on); an ephemeral call whose work could not be
            // saved never becomes current: the next call continues from the previous state.
            let current =
                persistence == Persistence::Keep || report.as_ref().is_some_and(|r| r.persisted);
            let wrote = if current {
                wrote.unwrap_or_default()
            } else {
                Wrote::default()
            };
            let expect = (
                tagged(if wrote.exec { "v2" } else { "v1" }),
                tagged(if wrote.file { "w2" } else { "w1" }),
            );
            assert_eq!(rig.call_c().await.seen, expect, "{what}");
            rig.check_restorable(fx).await;
            faults += 1;
        }
    }
    println!("fault sweep: {faults} faults injected");
    faults
}

/// Two concurrent calls on one key with the builder's default guard run one after the other,
/// and the second sees the first's work.
pub async fn faults_same_key_concurrency(fx: &dyn Fixture) {
    let env = Env::of(fx).await;
    let m = SandboxManager::builder(fx.client(Persistence::Ephemeral).await)
        .state_store(env.states.clone())
        .config(SandboxConfig::new(spec()).snapshots(env.snapshot_spec()))
        .build()
        .expect("manager");
    let ctx = env.ctx().session("same-key");
    let run = |tag: &'static str| {
        let (m, ctx) = (m.clone(), ctx.clone());
        async move {
            m.call(&ctx, |sb| async move {
                let started = Instant::now();
                sh(&sb, &format!("echo {tag} > {tag}.txt")).await;
                tokio::time::sleep(Duration::from_millis(300)).await;
                let files = sh(&sb, "ls").await;
                (started, Instant::now(), files)
            })
            .await
            .expect("call")
            .value
        }
    };
    let (a, b) = tokio::join!(tokio::spawn(run("a")), tokio::spawn(run("b")));
    let (a, b) = (a.expect("join"), b.expect("join"));
    let (first, second) = if a.0 <= b.0 { (a, b) } else { (b, a) };
    assert!(
        first.1 <= second.0,
        "calls on one key overlapped: the default guard must serialize them"
    );
    // The second saw the first's file: it got the first's box (or its snapshot), not a fresh one.
    assert!(
        second.2.contains("a.txt") && second.2.contains("b.txt"),
        "{}",
        second.2
    );
    let r = m
        .call(&ctx, |sb| async move { sh(&sb, "cat a.txt b.txt").await })
        .await
        .expect("call");
    assert_eq!(r.value, "a\nb\n");
}

/// A closure that never cancels: a state whose serialization fails is reported with the report,
/// never hidden.
pub async fn faults_unserializable_state_is_reported(fx: &dyn Fixture) {
    let env = Env::of(fx).await;
    let script = Script::new();
    let client =
        Arc::new(FaultyClient::new(fx.client(Persistence::Ephemeral).await, script).poison_state());
    let m = env.manager(
        client,
        IsolationScope::Session,
        SandboxConfig::new(spec()).snapshots(env.snapshot_spec()),
    );
    let ctx = env.ctx().session("poison");
    let err = m
        .call(&ctx, |sb| async move {
            sh(&sb, "echo kept > k.txt").await;
            7
        })
        .await
        .expect_err("the state cannot be saved");
    assert!(
        matches!(err.error, Error::MalformedState { .. }),
        "{}",
        err.error
    );
    assert_eq!(err.value, Some(7), "the closure's value comes back");
    let report = err.report.expect("the report comes back");
    assert!(
        !report.persisted && report.parked && report.stop.is_some(),
        "{report:?}"
    );
}

/// Stops whose state saves failed never retire the snapshot the stored state points at.
pub async fn faults_retention_after_failed_saves(fx: &dyn Fixture) {
    let env = Env::of(fx).await;
    let failing = Arc::new(FailingSaves::new(env.states.clone()));
    let m = SandboxManager::builder(fx.client(Persistence::Ephemeral).await)
        .state_store(failing.clone())
        .guard(Arc::new(InProcessGuard::new()))
        .config(SandboxConfig::new(spec()).snapshots(env.snapshot_spec().keep_last(2)))
        .build()
        .expect("manager");
    let ctx = env.ctx().session("retention");
    let key = IsolationKey::resolve(IsolationScope::Session, &ctx).expect("key");
    m.call(&ctx, |sb| work(sb, 1)).await.expect("call");
    failing.fail(true);
    for n in 2..5 {
        let err = m
            .call(&ctx, |sb| async move { work(sb, n).await })
            .await
            .expect_err("the save fails");
        assert!(
            matches!(err.error, Error::Unavailable { .. }),
            "{}",
            err.error
        );
    }
    failing.fail(false);
    // The box that held the unsaved work is lost too: only the stored snapshot remains.
    let stored = env.states.load(&key).await.expect("load").expect("state");
    let state = crate::state::state_from_json(&stored).expect("state");
    fx.lose_box(&*state).await;
    let r = m
        .call(&ctx, |sb| async move { seen(&sb).await })
        .await
        .expect("the stored state still restores");
    assert_eq!(r.value, (tagged("v1"), tagged("w1")));
}

/// A chunked snapshot taken while GC runs reuses chunks of a parent that its retention retires
/// before GC reads it: GC must still not sweep them — and when it repacks their pack (most of it
/// died with the parent), the location the snapshot carried forward still restores, through
/// the pack's redirect.
pub async fn faults_gc_interleaving(fx: &dyn Fixture) {
    let env = Env::of(fx).await;
    let m = env.manager(
        fx.client(Persistence::Ephemeral).await,
        IsolationScope::Session,
        SandboxConfig::new(spec()).snapshots(
            env.snapshot_spec()
                .format(SnapshotFormat::Chunked)
                .keep_last(1),
        ),
    );
    let ctx = env.ctx().session("gc");
    let key = IsolationKey::resolve(IsolationScope::Session, &ctx).expect("key");
    m.call(&ctx, |sb| async move {
        sh(
            &sb,
            "head -c 2000000 /dev/urandom > data.bin; head -c 3000000 /dev/urandom > w.bin; echo v1 > v.txt",
        )
        .await;
    })
    .await
    .expect("call");
    let data = m
        .call(&ctx, |sb| async move { sh(&sb, "md5sum data.bin").await })
        .await
        .expect("call")
        .value;
    // GC over a store that pauses when it reads its first manifest.
    let script = Script::new();
    let store = FaultySnapshotStore::new(env.snapshots.clone(), script.clone());
    let options = crate::snapshot::GcOptions::default()
        .grace(Duration::ZERO)
        .keep_last(1);
    let policy = crate::archive::ArchivePolicy::default();
    script.record();
    crate::snapshot::gc(&store, &policy, options.dry_run(true), &*env.states)
        .await
        .expect("dry run");
    let first_read = script
        .steps()
        .iter()
        .position(|s| *s == "snap.get")
        .expect("gc reads manifests");
    script.arm(first_read, Fault::Pause);
    let states = env.states.clone();
    let gc =
        tokio::spawn(async move { crate::snapshot::gc(&store, &policy, options, &*states).await });
    script
        .paused(Duration::from_secs(60))
        .await
        .expect("gc paused");
    // Meanwhile: a snapshot reusing data.bin's chunks; its retention retires the parent.
    m.call(&ctx, |sb| async move {
        sh(&sb, "head -c 3000000 /dev/urandom > w.bin; echo v2 > v.txt").await
    })
    .await
    .expect("call");
    script.release();
    let report = gc.await.expect("join").expect("gc");
    assert_eq!(report.locations_missing, 0, "{report:?}");
    assert_eq!(
        report.packs_repacked, 1,
        "data.bin is 40 % of the first pack: {report:?}"
    );
    let stored = env.states.load(&key).await.expect("load").expect("state");
    fx.lose_box(&*crate::state::state_from_json(&stored).expect("state"))
        .await;
    let r = m
        .call(&ctx, |sb| async move {
            (sh(&sb, "md5sum data.bin").await, sh(&sb, "cat v.txt").await)
        })
        .await
        .unwrap_or_else(|e| panic!("the snapshot lost chunks to gc: {e}"));
    assert_eq!(r.value, (data, "v2\n".to_owned()));
}

/// Calls without an isolation key leave no snapshot behind: nothing could ever find it.
pub async fn faults_unkeyed_calls_leave_no_snapshots(fx: &dyn Fixture) {
    let env = Env::of(fx).await;
    let m = env
        .snapshotting(fx, Persistence::Ephemeral, IsolationScope::Session)
        .await;
    // Session scope without a session: no key.
    let r = m
        .call(&env.ctx(), |sb| async move {
            sh(&sb, "echo x > x.txt").await;
        })
        .await
        .expect("call");
    assert!(r.report.key.is_none());
    let shared = m.create_external(None).await.expect("external box");
    m.call_with(
        &env.ctx(),
        Acquire::External(shared.clone()),
        |sb| async move {
            sh(&sb, "echo y > y.txt").await;
        },
    )
    .await
    .expect("call");
    shared.destroy().await.expect("destroy");
    let left = env.snapshots.list_all("").await.expect("list");
    assert!(left.is_empty(), "unreachable snapshots: {left:?}");
}

/// A request that needs an exec feature the backend lacks is refused, never half-run.
pub async fn faults_missing_exec_features_are_refused(fx: &dyn Fixture) {
    let env = Env::of(fx).await;
    let inner = fx.client(Persistence::Ephemeral).await;
    let mut caps = inner.capabilities();
    caps.exec.env = false;
    caps.exec.stdin = false;
    let client = Arc::new(FaultyClient::new(inner, Script::new()).capabilities(caps));
    let m = env.manager(client, IsolationScope::Session, SandboxConfig::new(spec()));
    let r = m
        .call(&env.ctx().session("features"), |sb| async move {
            let env = sb
                .exec(ExecRequest::shell("echo $A > a.txt").env("A", "1"))
                .await;
            let stdin = sb.exec(ExecRequest::shell("cat > b.txt").stdin("x")).await;
            let plain = sb.exec(ExecRequest::shell("ls")).await.expect("plain exec");
            (
                env.map(|_| ()),
                stdin.map(|_| ()),
                plain.stdout_str().into_owned(),
            )
        })
        .await
        .expect("call")
        .value;
    assert!(matches!(r.0, Err(Error::NotSupported { .. })), "{:?}", r.0);
    assert!(matches!(r.1, Err(Error::NotSupported { .. })), "{:?}", r.1);
    assert!(
        !r.2.contains("a.txt") && !r.2.contains("b.txt"),
        "nothing ran: {}",
        r.2
    );
}

/// The builder refuses set-ups that would lose work, naming the part at fault.
pub async fn faults_unsafe_setups_fail_at_build(fx: &dyn Fixture) {
    let env = Env::of(fx).await;
    let client = fx.client(Persistence::Ephemeral).await;
    let build = |states: Arc<dyn StateStore>,
                 guard: Arc<dyn SandboxExecutionGuard>,
                 snaps: SnapshotSpec| {
        SandboxManager::builder(client.clone())
            .state_store(states)
            .guard(guard)
            .config(SandboxConfig::new(spec()).snapshots(snaps))
            .require_durable()
            .build()
    };
    let file_guard = Arc::new(FileGuard::new(env.dir.path().join("leases")));
    let culprit = |r: Result<SandboxManager>| match r {
        Err(Error::InvalidInput { reason, .. }) => reason,
        other => panic!("accepted an unsafe set-up: {other:?}"),
    };
    let memory = culprit(build(
        Arc::new(crate::state_store::MemoryStateStore::new()),
        file_guard.clone(),
        env.snapshot_spec(),
    ));
    assert!(memory.contains("MemoryStateStore"), "{memory}");
    let noop = culprit(build(
        env.states.clone(),
        file_guard.clone(),
        SnapshotSpec::default(),
    ));
    assert!(noop.contains("noop"), "{noop}");
    let guard = culprit(build(
        env.states.clone(),
        Arc::new(InProcessGuard::new()),
        env.snapshot_spec(),
    ));
    assert!(guard.contains("InProcessGuard"), "{guard}");
    build(env.states.clone(), file_guard.clone(), env.snapshot_spec()).expect("a durable set-up");
    let distributed = SandboxManager::builder(client.clone())
        .state_store(env.states.clone())
        .require_distributed()
        .build();
    assert!(matches!(distributed, Err(Error::InvalidInput { .. })));
    // One call sets the shared parts; each must be shared by every host.
    let shared_dir = Arc::new(crate::snapshot::LocalDirSnapshotStore::shared_by_all_hosts(
        env.dir.path().join("nfs"),
    ));
    let one_host = culprit(
        SandboxManager::builder(client)
            .distributed(
                crate::manager::Distributed::new(file_guard, env.states.clone())
                    .snapshots(shared_dir),
            )
            .config(SandboxConfig::new(spec()))
            .build(),
    );
    assert!(one_host.contains("FileStateStore"), "{one_host}");
    assert_eq!(env.states.reach(), Reach::Host);
}

// ---- across OS processes ----

const ROLE: &str = "SANDBOX_TESTKIT_ROLE";
const DIR: &str = "SANDBOX_TESTKIT_DIR";

/// A one-host set-up in `dir` that several OS processes share.
async fn host_manager(fx: &dyn Fixture, dir: &Path, ttl: Duration) -> SandboxManager {
    SandboxManager::builder(fx.client_at(Persistence::Ephemeral, dir).await)
        .state_store(Arc::new(FileStateStore::new(dir.join("states"))))
        .guard(Arc::new(
            FileGuard::new(dir.join("leases")).options(
                FileGuardOptions::default()
                    .ttl(ttl)
                    .retry(Duration::from_millis(5), Duration::from_millis(50)),
            ),
        ))
        .config(
            SandboxConfig::new(spec()).snapshots(SnapshotSpec::local_dir(dir.join("snapshots"))),
        )
        .require_durable()
        .build()
        .expect("a durable set-up")
}

fn child(test: &str, role: &str, dir: &Path) -> std::process::Command {
    let mut cmd = std::process::Command::new(std::env::current_exe().expect("test binary"));
    cmd.args([test, "--exact", "--nocapture", "--test-threads=1"])
        .env(ROLE, role)
        .env(DIR, dir)
        .stdin(std::process::Stdio::null());
    cmd
}

fn shared_ctx() -> CallContext {
    CallContext::new("cross-process").session("one-key")
}

/// Two OS processes share one key on one host (file state, file guard): their calls are
/// serialized and every increment survives. `test` is the name of the calling test, re-run
/// as the children.
pub async fn faults_two_processes_one_key(fx: &dyn Fixture, test: &str) {
    const ROUNDS: u32 = 3;
    if let Ok(role) = std::env::var(ROLE) {
        if role == "counter" {
            let dir = PathBuf::from(std::env::var(DIR).expect("dir"));
            let m = host_manager(fx, &dir, Duration::from_secs(10)).await;
            for _ in 0..ROUNDS {
                m.call(&shared_ctx(), |sb| async move {
                    let n: u32 = sh(&sb, "cat n.txt 2>/dev/null || echo 0")
                        .await
                        .trim()
                        .parse()
                        .expect("n");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    sh(&sb, &format!("echo {} > n.txt", n + 1)).await;
                })
                .await
                .expect("child call");
            }
        }
        return;
    }
    let dir = tempfile::tempdir().expect("tmp");
    let children: Vec<_> = (0..2)
        .map(|_| child(test, "counter", dir.path()).spawn().expect("spawn"))
        .collect();
    for mut c in children {
        let status = tokio::task::spawn_blocking(move || c.wait())
            .await
            .expect("join")
            .expect("wait");
        assert!(status.success(), "a child failed: {status}");
    }
    let m = host_manager(fx, dir.path(), Duration::from_secs(10)).await;
    let n = m
        .call(
            &shared_ctx(),
            |sb| async move { sh(&sb, "cat n.txt").await },
        )
        .await
        .expect("call")
        .value;
    assert_eq!(n.trim(), (2 * ROUNDS).to_string(), "an increment was lost");
}

/// Holder A (an OS process) is stopped past its lease; B takes the key over; A resumes while
/// B still works, before B saved anything: A's finish and a direct save with its old token
/// are refused, A touches neither B's box nor the state, and B's save goes through.
pub async fn faults_stale_holder_fencing(fx: &dyn Fixture, test: &str) {
    let ttl = Duration::from_millis(600);
    if let Ok(role) = std::env::var(ROLE) {
        if role == "stale" {
            let dir = PathBuf::from(std::env::var(DIR).expect("dir"));
            stale_holder(fx, &dir, ttl).await;
        }
        return;
    }
    let dir = tempfile::tempdir().expect("tmp");
    let mut a = child(test, "stale", dir.path()).spawn().expect("spawn");
    let pid = nix::unistd::Pid::from_raw(a.id() as i32);
    // A writes `holding` once it holds the key mid-call (files, not stdout: the test harness
    // may capture a child's output).
    let holding = dir.path().join("holding");
    let deadline = Instant::now() + Duration::from_secs(120);
    while !holding.exists() {
        if let Ok(Some(status)) = a.try_wait() {
            panic!("A exited before holding the key: {status}");
        }
        assert!(Instant::now() < deadline, "A never held the key");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    // Stop A mid-call, as a long pause or a frozen VM would.
    nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGSTOP).expect("stop A");
    tokio::time::sleep(ttl * 3).await;
    let m = host_manager(fx, dir.path(), ttl).await;
    // B takes the key over and works in the box, but has not saved yet when A comes back.
    let b = tokio::time::timeout(
        Duration::from_secs(60),
        m.begin(&shared_ctx(), Acquire::Auto),
    )
    .await;
    if !matches!(b, Ok(Ok(_))) {
        std::fs::write(dir.path().join("go"), "").expect("go");
        let _ = nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGCONT);
    }
    let b = b
        .expect("B waited too long for a stopped holder")
        .expect("B takes the key over once A's lease expired");
    sh(b.sandbox(), "echo B > who.txt").await;
    std::fs::write(dir.path().join("go"), "").expect("go");
    nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGCONT).expect("resume A");
    let status = tokio::task::spawn_blocking(move || a.wait())
        .await
        .expect("join")
        .expect("wait");
    let verdict = std::fs::read_to_string(dir.path().join("verdict")).unwrap_or_default();
    assert!(status.success(), "A: {status} {verdict}");
    // A resumed while B held the key: it wrote nothing, touched nothing...
    assert!(verdict.contains("REFUSED finish"), "{verdict}");
    assert!(verdict.contains("REFUSED save"), "{verdict}");
    assert_eq!(
        sh(b.sandbox(), "cat who.txt").await,
        "B\n",
        "A left B's box alone (I2)"
    );
    // ...and B's save goes through.
    let report = b.finish().await.expect("B finishes");
    assert!(report.persisted);
    let key = IsolationKey::resolve(IsolationScope::Session, &shared_ctx()).expect("key");
    let states = FileStateStore::new(dir.path().join("states"));
    assert_eq!(
        states.load(&key).await.expect("load").as_deref(),
        report.state_json.as_deref(),
        "B's state is the stored one"
    );
    let who = m
        .call(
            &shared_ctx(),
            |sb| async move { sh(&sb, "cat who.txt").await },
        )
        .await
        .expect("call")
        .value;
    assert_eq!(who, "B\n");
}

/// Holder A, in the child process.
async fn stale_holder(fx: &dyn Fixture, dir: &Path, ttl: Duration) {
    let m = host_manager(fx, dir, ttl).await;
    let call = m
        .begin(&shared_ctx(), Acquire::Auto)
        .await
        .expect("A begins");
    let token = call.fencing_token();
    sh(call.sandbox(), "echo A > who.txt").await;
    std::fs::write(dir.join("holding"), format!("{token:?}")).expect("holding");
    // Stopped here by the parent; resumed after B saved.
    while !dir.join("go").exists() {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let key = IsolationKey::resolve(IsolationScope::Session, &shared_ctx()).expect("key");
    let mut verdict = String::new();
    match call.finish().await {
        Err(e) if matches!(e.error, Error::LeaseLost { .. } | Error::StaleLease { .. }) => {
            verdict.push_str("REFUSED finish\n");
        }
        other => verdict.push_str(&format!("ACCEPTED finish {other:?}\n")),
    }
    // Even a holder that ignored its lost signal cannot write over B.
    let states = FileStateStore::new(dir.join("states"));
    match states.save(&key, "{\"stale\":true}", token).await {
        Err(Error::StaleLease { .. }) => verdict.push_str("REFUSED save\n"),
        other => verdict.push_str(&format!("ACCEPTED save {other:?}\n")),
    }
    std::fs::write(dir.join("verdict"), verdict).expect("verdict");
}

/// A state store whose saves fail while told to (a store that is down).
#[derive(Debug)]
struct FailingSaves {
    inner: Arc<dyn StateStore>,
    failing: AtomicBool,
}

impl FailingSaves {
    fn new(inner: Arc<dyn StateStore>) -> Self {
        FailingSaves {
            inner,
            failing: AtomicBool::new(false),
        }
    }

    fn fail(&self, yes: bool) {
        self.failing.store(yes, Ordering::SeqCst);
    }
}

#[async_trait]
impl StateStore for FailingSaves {
    async fn load(&self, key: &IsolationKey) -> Result<Option<String>> {
        self.inner.load(key).await
    }
    async fn fence(&self, key: &IsolationKey, granted: Option<u64>) -> Result<u64> {
        self.inner.fence(key, granted).await
    }
    async fn save(&self, key: &IsolationKey, state_json: &str, fence: Option<u64>) -> Result<()> {
        if self.failing.load(Ordering::SeqCst) {
            return Err(Error::Unavailable {
                service: "state store".into(),
                reason: "down (injected)".into(),
                source: None,
            });
        }
        self.inner.save(key, state_json, fence).await
    }
    async fn delete(&self, key: &IsolationKey, fence: Option<u64>) -> Result<()> {
        self.inner.delete(key, fence).await
    }
    async fn list(&self, prefix: &str) -> Result<Vec<IsolationKey>> {
        self.inner.list(prefix).await
    }
    fn reach(&self) -> Reach {
        self.inner.reach()
    }
}

/// A guard over an in-process one whose leases the test can lose at will (as an expiry or a
/// takeover would be found out by a real guard).
#[derive(Debug, Default)]
struct LosingGuard {
    inner: InProcessGuard,
    current: std::sync::Mutex<Option<tokio_util::sync::CancellationToken>>,
}

impl LosingGuard {
    /// Lose the lease held now (if any).
    fn lose(&self) {
        if let Some(lost) = self.current.lock().expect("lock").as_ref() {
            lost.cancel();
        }
    }

    fn wrap(&self, lease: crate::guard::Lease) -> crate::guard::Lease {
        let lost = tokio_util::sync::CancellationToken::new();
        *self.current.lock().expect("lock") = Some(lost.clone());
        crate::guard::Lease::new(
            lease.key().clone(),
            lease.token(),
            Box::new(WrappedLease(Some(lease))),
        )
        .with_lost_signal(lost)
    }
}

#[derive(Debug)]
struct WrappedLease(Option<crate::guard::Lease>);

#[async_trait]
impl crate::guard::LeaseHandle for WrappedLease {
    async fn release(&mut self) -> Result<()> {
        match self.0.take() {
            Some(lease) => lease.release().await,
            None => Ok(()),
        }
    }
    fn release_detached(&mut self) {
        drop(self.0.take());
    }
}

#[async_trait]
impl SandboxExecutionGuard for LosingGuard {
    async fn enter(&self, key: &IsolationKey) -> Result<crate::guard::Lease> {
        Ok(self.wrap(self.inner.enter(key).await?))
    }
    async fn try_enter(&self, key: &IsolationKey) -> Result<Option<crate::guard::Lease>> {
        Ok(self.inner.try_enter(key).await?.map(|l| self.wrap(l)))
    }
    fn reach(&self) -> Reach {
        self.inner.reach()
    }
}

/// A lost lease is its own kind of error ([`crate::ErrorKind::LeaseLost`]), and its message
/// says what was written: lost while the closure ran, no snapshot was taken; lost once the
/// snapshot was written (found out before saving the state), the snapshot is named as written
/// and the state as not saved. Either way the stored state stays the previous call's.
pub async fn faults_lost_lease_is_typed_and_truthful(fx: &dyn Fixture) {
    let env = Env::of(fx).await;
    let guard = Arc::new(LosingGuard::default());
    let lose_at_manifest = Arc::new(AtomicBool::new(false));
    let store = {
        let (guard, armed) = (guard.clone(), lose_at_manifest.clone());
        Arc::new(
            super::HookedStore::new(env.snapshots.clone()).on_put(move |key, input| {
                if key.as_str().ends_with(".manifest") && armed.load(Ordering::SeqCst) {
                    // The manifest is written; the loss is found out right after.
                    guard.lose();
                }
                input
            }),
        )
    };
    let config = SandboxConfig::new(spec()).snapshots(SnapshotSpec::new(store));
    let m = SandboxManager::builder(fx.client(Persistence::Ephemeral).await)
        .state_store(env.states.clone())
        .guard(guard.clone())
        .config(config)
        .build()
        .expect("manager");
    let ctx = env.ctx().session("lost");
    let key = IsolationKey::resolve(IsolationScope::Session, &ctx).expect("key");
    m.call(&ctx, |sb| work(sb, 1)).await.expect("seed call");
    let seeded = env.states.load(&key).await.expect("load");
    let manifests = || async {
        env.snapshots
            .list_all("")
            .await
            .expect("list")
            .into_iter()
            .filter(|b| b.key.as_str().ends_with(".manifest"))
            .count()
    };
    let before = manifests().await;

    // Lost while the closure runs.
    let g = guard.clone();
    let e = m
        .call(&ctx, |sb| async move {
            sh(&sb, "echo v2 > v.txt").await;
            g.lose();
            std::future::pending::<()>().await;
        })
        .await
        .expect_err("a call whose lease was lost fails");
    assert_eq!(e.error.kind(), crate::ErrorKind::LeaseLost, "{}", e.error);
    let shown = e.error.to_string();
    assert!(
        shown.contains("no snapshot was taken") && shown.contains("the state was not saved"),
        "{shown}"
    );
    assert_eq!(env.states.load(&key).await.expect("load"), seeded);
    assert_eq!(manifests().await, before, "nothing was written");

    // Lost once the snapshot is written.
    lose_at_manifest.store(true, Ordering::SeqCst);
    let e = m
        .call(&ctx, |sb| work(sb, 3))
        .await
        .expect_err("a call whose lease was lost fails");
    lose_at_manifest.store(false, Ordering::SeqCst);
    assert_eq!(e.error.kind(), crate::ErrorKind::LeaseLost, "{}", e.error);
    let report = e.report.expect("the report comes back");
    let written = report
        .stop
        .as_ref()
        .and_then(|s| s.snapshot.as_ref())
        .expect("the snapshot was taken");
    let shown = e.error.to_string();
    assert!(
        shown.contains(&format!("snapshot `{}` was written", written.id))
            && shown.contains("the state was not saved")
            && !shown.contains("nothing was written"),
        "{shown}"
    );
    assert!(!report.persisted);
    assert_eq!(env.states.load(&key).await.expect("load"), seeded);
    assert_eq!(manifests().await, before + 1, "the snapshot named is there");
}

/// Lines of `big.txt` the cut call appends (4 KiB each, a pause between lines).
const BIG_LINES: usize = 24;
/// Files the cut call writes through the file primitive after `big.txt`.
const SMALL_FILES: usize = 4;

/// The `i`-th line of `big.txt`: 4095 digits (zero-padded `i`) and a newline.
fn big_line(i: usize) -> String {
    format!("{i:04095}\n")
}

fn small_file(i: usize) -> (String, String) {
    (format!("f{i}.txt"), format!("small {i}\n").repeat(64))
}

/// The work of a call that is cut inside: a command appending `big.txt` slowly (a pause
/// between 4 KiB lines), files written through the primitive, and a final `done.txt`.
/// Sets `started` first and `done` at its very end.
async fn slow_work(sb: Arc<Sandbox>, started: Arc<tokio::sync::Notify>, done: Arc<AtomicBool>) {
    started.notify_one();
    let line = format!(
        "i=0; while [ $i -lt {BIG_LINES} ]; do printf '%04095d\\n' $i >> big.txt; \
         i=$((i+1)); sleep 0.01; done"
    );
    let r = sb
        .exec(ExecRequest::shell(line).timeout(Duration::from_secs(120)))
        .await
        .expect("exec");
    assert!(r.success(), "big.txt: {r:?}");
    for i in 0..SMALL_FILES {
        let (path, content) = small_file(i);
        sb.handle()
            .write_file(&rel(&path), Bytes::from(content), 0o644)
            .await
            .expect("write");
    }
    sh(&sb, "echo done > done.txt").await;
    done.store(true, Ordering::SeqCst);
}

/// What the call after a cut found of the cut call's files.
#[derive(Debug, Default)]
struct CutSeen {
    /// `big.txt`: its size and whether it is whole (every line, each as written).
    big: Option<(usize, bool)>,
    /// The small files present, and whether each is whole.
    small: Vec<(String, bool)>,
    done: bool,
    /// The seed's file.
    seed: Option<String>,
}

impl CutSeen {
    fn nothing_of_the_cut_call(&self) -> bool {
        self.big.is_none() && self.small.is_empty() && !self.done
    }

    fn whole_and_complete(&self) -> bool {
        self.big == Some((BIG_LINES * 4096, true))
            && self.small.len() == SMALL_FILES
            && self.small.iter().all(|(_, whole)| *whole)
            && self.done
    }
}

/// Read what the cut call may have left, then remove it (the next round starts from the seed).
async fn look_and_clean(sb: &Sandbox) -> CutSeen {
    let mut seen = CutSeen {
        seed: read(sb, "seed.txt").await,
        ..CutSeen::default()
    };
    if let Some(big) = read(sb, "big.txt").await {
        let whole = big.len() % 4096 == 0
            && big
                .as_bytes()
                .chunks(4096)
                .enumerate()
                .all(|(i, l)| l == big_line(i).as_bytes());
        let whole = whole && big.len() == BIG_LINES * 4096;
        seen.big = Some((big.len(), whole));
    }
    for i in 0..SMALL_FILES {
        let (path, content) = small_file(i);
        if let Some(got) = read(sb, &path).await {
            seen.small.push((path, got == content));
        }
    }
    seen.done = read(sb, "done.txt").await.is_some();
    sh(sb, "rm -f big.txt f*.txt done.txt").await;
    seen
}

/// Wait (bounded) until no call holds `key`.
async fn key_free(m: &SandboxManager, key: &IsolationKey) {
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        if let Some(lease) = m.guard().try_enter(key).await.expect("try_enter") {
            lease.release().await.expect("release");
            return;
        }
        assert!(Instant::now() < deadline, "the key was never released");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// Cut calls *inside* their closure — while a command appends a file slowly, while files
/// are written, before the final marker — at many delays after the closure started, in two
/// set-ups (ephemeral + tar, keep + chunked), and check the cancellation rule:
///
/// - by default a cut call is a failed call: the next call sees exactly the state before it
///   (no file of the cut call, not even in a kept box), the stored state still points at the
///   previous snapshot, and the next call's report says the previous call was cancelled;
/// - with [`CallOptions::keep_partial_work`](crate::CallOptions::keep_partial_work), the state
///   is saved marked partial, the next call's report says so, and every file of the cut call
///   that is not whole is listed as possibly torn;
/// - a call cut after its closure ended is not cancelled: its work is current and whole (I5).
///
/// Returns the number of cuts.
pub async fn faults_cancellation_inside_closure(fx: &dyn Fixture) -> usize {
    let mut cuts = 0;
    let mut broken = Vec::new();
    for (persistence, format) in [
        (Persistence::Ephemeral, SnapshotFormat::Tar),
        (Persistence::Keep, SnapshotFormat::Chunked),
    ] {
        let env = Env::of(fx).await;
        let config = SandboxConfig::new(spec())
            .snapshots(SnapshotSpec::new(env.snapshots.clone()).format(format));
        let m = env.manager(
            fx.client(persistence).await,
            IsolationScope::Session,
            config,
        );
        let ctx = env.ctx().session("cut-inside");
        let key = IsolationKey::resolve(IsolationScope::Session, &ctx).expect("key");
        m.call(&ctx, |sb| async move {
            sh(&sb, "echo seed > seed.txt").await;
        })
        .await
        .expect("seed call");
        // How long the closure takes here, uncut: the shorter of two runs (the first may
        // start the box's exec agent). Each run's work is whole.
        let mut span = Duration::MAX;
        for _ in 0..2 {
            let (started, done) = (
                Arc::new(tokio::sync::Notify::new()),
                Arc::new(AtomicBool::new(false)),
            );
            let took = m
                .call(&ctx, |sb| async move {
                    let t0 = Instant::now();
                    slow_work(sb, started, done).await;
                    t0.elapsed()
                })
                .await
                .expect("uncut call")
                .value;
            span = span.min(took);
            let whole = m
                .call(&ctx, |sb| async move { look_and_clean(&sb).await })
                .await
                .expect("look");
            assert!(
                whole.value.whole_and_complete(),
                "the uncut call: {:?}",
                whole.value
            );
        }
        let rounds = [(false, 10u32), (true, 6u32)];
        for (keep_partial, n) in rounds {
            let mut seen_torn = 0;
            let mut seen_cut = 0;
            for k in 0..n {
                // Delays spread over the closure (its first 90%), from its first step on.
                let delay = span.mul_f64(0.9 * f64::from(k) / f64::from(n));
                let what = format!(
                    "cut at {delay:?} of {span:?} ({persistence:?}, {format:?}, keep_partial: {keep_partial})"
                );
                let stored_before = env.states.load(&key).await.expect("load");
                let (started, done) = (
                    Arc::new(tokio::sync::Notify::new()),
                    Arc::new(AtomicBool::new(false)),
                );
                let options = if keep_partial {
                    crate::CallOptions::new().keep_partial_work()
                } else {
                    crate::CallOptions::new()
                };
                let task = {
                    let (m, ctx, s, d) = (m.clone(), ctx.clone(), started.clone(), done.clone());
                    tokio::spawn(async move {
                        m.call_with_options(&ctx, options, |sb| slow_work(sb, s, d))
                            .await
                    })
                };
                started.notified().await;
                tokio::time::sleep(delay).await;
                task.abort();
                let _ = task.await;
                key_free(&m, &key).await;
                let finished = done.load(Ordering::SeqCst);
                let stored = env.states.load(&key).await.expect("load");
                let marker = stored
                    .as_deref()
                    .map(|j| {
                        state_from_json(j)
                            .expect("state")
                            .common()
                            .cancelled
                            .clone()
                    })
                    .expect("a stored state");
                let next = m
                    .call(&ctx, |sb| async move { look_and_clean(&sb).await })
                    .await
                    .unwrap_or_else(|e| panic!("{what}: the next call fails: {e}"));
                let seen = next.value;
                let mut check = |holds: bool, why: String| {
                    if !holds {
                        println!("BROKEN {what}: {why}");
                        broken.push(format!("{what}: {why}"));
                    }
                };
                check(
                    seen.seed.as_deref() == Some("seed\n"),
                    "the seed is lost".into(),
                );
                if finished {
                    // The closure ended before the cut: the post-call steps ran (I5).
                    check(
                        seen.whole_and_complete(),
                        format!("the finished call's work: {seen:?}"),
                    );
                    check(
                        marker.is_none(),
                        format!("a finished call is not cancelled: {marker:?}"),
                    );
                    continue;
                }
                seen_cut += 1;
                cuts += 1;
                let previous = next.report.previous_cancelled.as_ref();
                check(
                    previous.is_some(),
                    "the next call's report does not say the call was cancelled".into(),
                );
                check(
                    marker.as_ref() == previous,
                    format!("the state recorded {marker:?}, the report {previous:?}"),
                );
                check(
                    previous.is_none_or(|p| p.partial == keep_partial),
                    format!("partial is not {keep_partial}: {previous:?}"),
                );
                if !keep_partial {
                    check(
                        seen.nothing_of_the_cut_call(),
                        format!("files of the cancelled call became current: {seen:?}"),
                    );
                    check(
                        snapshot_of(stored.as_deref()).map(|s| s.id)
                            == snapshot_of(stored_before.as_deref()).map(|s| s.id),
                        "the state was advanced".into(),
                    );
                    continue;
                }
                check(
                    !seen.done,
                    format!("the final marker was never written: {seen:?}"),
                );
                let listed = previous
                    .and_then(|p| p.possibly_torn.clone())
                    .unwrap_or_default();
                let mut torn: Vec<String> = seen
                    .small
                    .iter()
                    .filter(|(_, whole)| !whole)
                    .map(|(p, _)| p.clone())
                    .collect();
                if seen.big.is_some_and(|(_, whole)| !whole) {
                    torn.push("big.txt".to_owned());
                }
                seen_torn += torn.len();
                for path in &torn {
                    check(
                        listed.contains(path),
                        format!("the torn {path} is not reported: {listed:?}"),
                    );
                }
            }
            println!(
                "cancellation inside the closure, {persistence:?} + {format:?}, keep_partial: \
                 {keep_partial}: {seen_cut} of {n} cuts inside the closure, {seen_torn} torn files seen"
            );
            assert!(seen_cut > 0, "no cut fell inside the closure");
        }
    }
    assert!(
        broken.is_empty(),
        "{} violations of the cancellation rule in {cuts} cuts:\n{}",
        broken.len(),
        broken.join("\n")
    );
    println!("cancellation inside the closure: {cuts} cuts");
    cuts
}
