//! The conformance kit: scenarios every backend runs, written once against the contracts.
//!
//! A backend provides a [`Fixture`] (how to make a client, how to destroy a box behind the
//! library's back) and expands [`conformance_tests!`](crate::conformance_tests) in a test file,
//! which generates one `#[tokio::test]` per scenario:
//!
//! ```text
//! sandbox_core::conformance_tests!(crate::fixture());
//! ```
//!
//! Scenarios only use POSIX `sh` utilities (`cat`, `echo`, `printf`, `test`, `sleep`, `kill`)
//! inside the box, so they run on minimal images too.

pub mod blobs;
pub mod escapes;
pub mod faults;
pub mod faulty;
pub mod fs_state;
pub mod guards;
mod hostile;
pub mod logs;
pub mod native;
pub mod race;
pub mod raw_tar;
pub mod states;
mod stores;

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;

pub use stores::{
    CountingStore, FailingStore, GetHook, HookedStore, PutHook, StoreCounts, holds_whole_puts,
};

use crate::backend::{Persistence, SandboxClient};
use crate::error::{Error, ErrorKind};
use crate::exec::ExecRequest;
use crate::guard::InProcessGuard;
use crate::isolation::{CallContext, IsolationKey, IsolationScope};
use crate::manager::{Acquire, AcquiredFrom, CallReport, SandboxManager};
use crate::path::RelPath;
use crate::projection::{Projection, ProjectionOutcome};
use crate::sandbox::{Sandbox, SandboxConfig, StartBranch};
use crate::snapshot::{
    BlobKey, LocalDirSnapshotStore, SnapshotFormat, SnapshotSpec, SnapshotStore,
    SnapshotStoreExt as _,
};
use crate::spec::WorkspaceSpec;
use crate::state::{SandboxState, state_from_json, state_to_json};
use crate::state_store::{FileStateStore, StateStore};
use crate::stream;

/// What a backend provides to run the kit.
#[async_trait]
pub trait Fixture: Send + Sync + 'static {
    /// A fresh client with `persistence`. Two calls give two independent client instances
    /// over the same backend (as two replicas would have).
    async fn client(&self, persistence: Persistence) -> Arc<dyn SandboxClient>;

    /// Destroy the box `state` describes without going through the library (a container
    /// killed by an operator, a directory wiped).
    async fn lose_box(&self, state: &dyn SandboxState);

    /// A client whose boxes live at `shared` (a directory another OS process of the same
    /// test also uses), for the cross-process scenarios. Backends whose boxes live in a
    /// shared service (a container engine) ignore `shared`.
    async fn client_at(
        &self,
        persistence: Persistence,
        shared: &std::path::Path,
    ) -> Arc<dyn SandboxClient> {
        let _ = shared;
        self.client(persistence).await
    }

    /// The snapshot store of a scenario whose temporary directory is `dir`: empty, and the
    /// scenario's alone. The default is a local directory in `dir`; [`OnStore`] runs a
    /// backend's scenarios on another store.
    async fn snapshot_store(&self, dir: &std::path::Path) -> Arc<dyn SnapshotStore> {
        Arc::new(LocalDirSnapshotStore::new(dir.join("snapshots")))
    }
}

/// A store for each scenario: `make()` gives an empty one (a fresh key prefix, a new bucket
/// directory).
pub type MakeStore =
    Arc<dyn Fn() -> futures::future::BoxFuture<'static, Arc<dyn SnapshotStore>> + Send + Sync>;

/// `inner`'s backend with the snapshots of every scenario kept in a store that `make` gives:
/// how a snapshot store runs the kit's snapshot scenarios
/// ([`conformance_tests!`](crate::conformance_tests)`(snapshots: …)`).
pub struct OnStore<F> {
    /// The backend.
    pub inner: F,
    /// An empty store per scenario.
    pub make: MakeStore,
}

#[async_trait]
impl<F: Fixture> Fixture for OnStore<F> {
    async fn client(&self, persistence: Persistence) -> Arc<dyn SandboxClient> {
        self.inner.client(persistence).await
    }

    async fn lose_box(&self, state: &dyn SandboxState) {
        self.inner.lose_box(state).await
    }

    async fn client_at(
        &self,
        persistence: Persistence,
        shared: &std::path::Path,
    ) -> Arc<dyn SandboxClient> {
        self.inner.client_at(persistence, shared).await
    }

    async fn snapshot_store(&self, _dir: &std::path::Path) -> Arc<dyn SnapshotStore> {
        (self.make)().await
    }
}

/// Per-scenario environment: temporary stores and unique names.
pub struct Env {
    /// Temporary directory holding the stores and the host projection root.
    pub dir: tempfile::TempDir,
    /// Snapshot store (a local directory in `dir`, or the fixture's: [`Env::of`]).
    pub snapshots: Arc<dyn SnapshotStore>,
    /// State store (files), shared by every manager of the scenario.
    pub states: Arc<FileStateStore>,
    /// A unique agent name.
    pub agent: String,
}

impl Env {
    /// Fresh stores under a new temporary directory; snapshots in a local directory.
    pub fn new() -> Env {
        let dir = tempfile::tempdir().expect("tempdir");
        let snapshots: Arc<dyn SnapshotStore> =
            Arc::new(LocalDirSnapshotStore::new(dir.path().join("snapshots")));
        Env::with(dir, snapshots)
    }

    /// Fresh stores under a new temporary directory; snapshots in the fixture's store.
    pub async fn of(fx: &dyn Fixture) -> Env {
        let dir = tempfile::tempdir().expect("tempdir");
        let snapshots = fx.snapshot_store(dir.path()).await;
        Env::with(dir, snapshots)
    }

    fn with(dir: tempfile::TempDir, snapshots: Arc<dyn SnapshotStore>) -> Env {
        let states = Arc::new(FileStateStore::new(dir.path().join("states")));
        let agent = format!("agent-{}", &uuid::Uuid::new_v4().simple().to_string()[..8]);
        Env {
            dir,
            snapshots,
            states,
            agent,
        }
    }

    /// A call context for this scenario's agent.
    pub fn ctx(&self) -> CallContext {
        CallContext::new(&self.agent)
    }

    /// The host projection root.
    pub fn host_root(&self) -> std::path::PathBuf {
        let p = self.dir.path().join("host");
        std::fs::create_dir_all(&p).expect("host root");
        p
    }

    /// A snapshot spec over this scenario's store.
    pub fn snapshot_spec(&self) -> SnapshotSpec {
        SnapshotSpec::new(self.snapshots.clone())
    }

    /// A manager over a new client of `fx` with the kit's spec and this scenario's snapshot
    /// store (the default format).
    pub async fn snapshotting(
        &self,
        fx: &dyn Fixture,
        persistence: Persistence,
        scope: IsolationScope,
    ) -> SandboxManager {
        self.manager(fx.client(persistence).await, scope, snap_config(self))
    }

    /// A manager with file state, in-process guard, `scope` and `config`.
    pub fn manager(
        &self,
        client: Arc<dyn SandboxClient>,
        scope: IsolationScope,
        config: SandboxConfig,
    ) -> SandboxManager {
        SandboxManager::builder(client)
            .state_store(self.states.clone())
            .guard(Arc::new(InProcessGuard::new()))
            .scope(scope)
            .config(config)
            .build()
            .expect("manager")
    }
}

impl Default for Env {
    fn default() -> Self {
        Env::new()
    }
}

fn spec() -> WorkspaceSpec {
    WorkspaceSpec::builder()
        .file("README.md", "from the spec\n")
        .dir("data")
        .executable("bin/hello", "#!/bin/sh\necho hello from the box\n")
        .ephemeral_file("run/token", "token-v1\n")
        .env("SPEC_VAR", "spec-value")
        .build()
        .expect("valid spec")
}

fn snap_config(env: &Env) -> SandboxConfig {
    SandboxConfig::new(spec()).snapshots(env.snapshot_spec())
}

/// Run a shell line and return stdout; panics with the output on a non-zero exit.
pub async fn sh(sandbox: &Sandbox, line: &str) -> String {
    let r = sandbox
        .exec(ExecRequest::shell(line).timeout(Duration::from_secs(60)))
        .await
        .expect("exec");
    assert!(r.success(), "`{line}` failed: {r:?}");
    r.stdout_str().into_owned()
}

/// Read a workspace file through the primitive, `None` if missing.
pub async fn read(sandbox: &Sandbox, path: &str) -> Option<String> {
    match sandbox
        .handle()
        .read_file(&RelPath::new(path).expect("path"))
        .await
    {
        Ok(b) => Some(String::from_utf8_lossy(&b).into_owned()),
        Err(Error::NotFound { .. }) => None,
        Err(e) => panic!("read {path}: {e}"),
    }
}

async fn call<F, Fut>(m: &SandboxManager, ctx: &CallContext, f: F) -> CallReport
where
    F: FnOnce(Arc<Sandbox>) -> Fut,
    Fut: std::future::Future<Output = ()>,
{
    m.call(ctx, f).await.expect("call").report
}

/// Resume the checkpoint `state_json` (priority 2) and check that `path` holds `expected`.
async fn checkpoint_holds(
    m: &SandboxManager,
    ctx: &CallContext,
    state_json: Option<&str>,
    path: &'static str,
    expected: &'static str,
) {
    let checkpoint = state_from_json(state_json.expect("state")).expect("state");
    m.call_with(ctx, Acquire::State(checkpoint), |sb| async move {
        assert_eq!(
            read(&sb, path).await.as_deref(),
            Some(expected),
            "{path} in the checkpoint"
        );
    })
    .await
    .expect("the checkpoint restores");
}

fn branch(r: &CallReport) -> StartBranch {
    r.start.as_ref().expect("started").branch
}

/// State JSON survives `state → json → state` unchanged, and the resumed box works.
pub async fn state_round_trip(fx: &dyn Fixture) {
    let env = Env::of(fx).await;
    let client = fx.client(Persistence::Keep).await;
    let key =
        IsolationKey::resolve(IsolationScope::Session, &env.ctx().session("rt")).expect("key");
    let sandbox = Sandbox::create(&*client, snap_config(&env), Some(&key))
        .await
        .expect("create");
    sandbox.start().await.expect("start");
    sh(&sandbox, "echo kept > kept.txt").await;
    sandbox.stop().await.expect("stop");
    let json = state_to_json(&*sandbox.state()).expect("json");
    let back = state_from_json(&json).expect("parse");
    assert_eq!(
        state_to_json(&*back).expect("json"),
        json,
        "lossless round trip"
    );
    assert_eq!(
        back.typetag_name(),
        client.backend(),
        "state tag equals the backend tag"
    );
    let resumed = Sandbox::resume(&*client, snap_config(&env), &*back, Some(&key))
        .await
        .expect("resume");
    let r = resumed.start().await.expect("start");
    assert_eq!(r.branch, StartBranch::Warm);
    assert_eq!(read(&resumed, "kept.txt").await.as_deref(), Some("kept\n"));
    resumed.destroy().await.expect("destroy");
}

/// D: a new box is initialized from the spec: files, directories, executables, env.
pub async fn cold_start_applies_spec(fx: &dyn Fixture) {
    let env = Env::of(fx).await;
    let m = env
        .snapshotting(fx, Persistence::Ephemeral, IsolationScope::Session)
        .await;
    let report = call(&m, &env.ctx().session("cold"), |sb| async move {
        assert_eq!(
            read(&sb, "README.md").await.as_deref(),
            Some("from the spec\n")
        );
        assert_eq!(read(&sb, "run/token").await.as_deref(), Some("token-v1\n"));
        assert_eq!(
            sh(
                &sb,
                "test -d data && ./bin/hello && printf %s \"$SPEC_VAR\""
            )
            .await,
            "hello from the box\nspec-value"
        );
    })
    .await;
    assert_eq!(branch(&report), StartBranch::Cold);
    assert_eq!(report.acquired_from, AcquiredFrom::New);
    assert!(report.persisted);
}

/// A: a kept box warm-starts; only ephemeral entries are re-applied.
pub async fn warm_start_reapplies_only_ephemeral(fx: &dyn Fixture) {
    let env = Env::of(fx).await;
    let m = env
        .snapshotting(fx, Persistence::Keep, IsolationScope::Session)
        .await;
    let ctx = env.ctx().session("warm");
    call(&m, &ctx, |sb| async move {
        sh(
            &sb,
            "echo mine > notes.txt; echo edited > README.md; echo tampered > run/token",
        )
        .await;
    })
    .await;
    let r = call(&m, &ctx, |sb| async move {
        assert_eq!(read(&sb, "notes.txt").await.as_deref(), Some("mine\n"));
        assert_eq!(
            read(&sb, "README.md").await.as_deref(),
            Some("edited\n"),
            "non-ephemeral entries are not re-applied"
        );
        assert_eq!(
            read(&sb, "run/token").await.as_deref(),
            Some("token-v1\n"),
            "ephemeral entries are re-applied"
        );
    })
    .await;
    assert_eq!(branch(&r), StartBranch::Warm);
    assert_eq!(r.acquired_from, AcquiredFrom::StateStore);
    cleanup(&m, &ctx).await;
}

/// B: an ephemeral box is gone after release; the next call restores it from the snapshot.
pub async fn restore_after_release(fx: &dyn Fixture) {
    let env = Env::of(fx).await;
    let m = env
        .snapshotting(fx, Persistence::Ephemeral, IsolationScope::Session)
        .await;
    let ctx = env.ctx().session("restore");
    call(&m, &ctx, |sb| async move {
        sh(&sb, "mkdir -p deep/dir && echo v1 > deep/dir/f.txt && echo edited > README.md && ln -s deep/dir/f.txt link && echo tampered > run/token").await;
    })
    .await;
    let r = call(&m, &ctx, |sb| async move {
        assert_eq!(read(&sb, "deep/dir/f.txt").await.as_deref(), Some("v1\n"));
        assert_eq!(read(&sb, "README.md").await.as_deref(), Some("edited\n"));
        assert_eq!(sh(&sb, "cat link").await, "v1\n", "symlinks survive");
        assert_eq!(read(&sb, "run/token").await.as_deref(), Some("token-v1\n"));
    })
    .await;
    assert_eq!(branch(&r), StartBranch::RestoreEphemeral);
    assert!(r.start.as_ref().and_then(|s| s.restored.as_ref()).is_some());
}

/// B: a kept box destroyed behind the library's back is restored from the snapshot, and the
/// report says so.
pub async fn restore_after_external_loss(fx: &dyn Fixture) {
    let env = Env::of(fx).await;
    let m = env
        .snapshotting(fx, Persistence::Keep, IsolationScope::Session)
        .await;
    let ctx = env.ctx().session("lost");
    let r1 = call(&m, &ctx, |sb| async move {
        sh(&sb, "echo survived > s.txt").await;
    })
    .await;
    let state = state_from_json(r1.state_json.as_deref().expect("state")).expect("state");
    fx.lose_box(&*state).await;
    let r2 = call(&m, &ctx, |sb| async move {
        assert_eq!(read(&sb, "s.txt").await.as_deref(), Some("survived\n"));
    })
    .await;
    assert_eq!(branch(&r2), StartBranch::RestoreEphemeral);
    cleanup(&m, &ctx).await;
}

/// C: a state whose workspace was never ready but has a snapshot restores it and re-applies
/// every entry; D with `ready` but no snapshot says why it started cold.
pub async fn restore_all_and_cold_note(fx: &dyn Fixture) {
    let env = Env::of(fx).await;
    let client = fx.client(Persistence::Ephemeral).await;
    let m = env.manager(client.clone(), IsolationScope::Session, snap_config(&env));
    let ctx = env.ctx().session("c");
    let r1 = call(&m, &ctx, |sb| async move {
        sh(&sb, "echo edited > README.md; echo mine > mine.txt").await;
    })
    .await;
    let mut state = state_from_json(r1.state_json.as_deref().expect("state")).expect("state");
    state.common_mut().workspace_root_ready = false;
    let r = m
        .call_with(&ctx, Acquire::State(state), |sb| async move {
            assert_eq!(read(&sb, "mine.txt").await.as_deref(), Some("mine\n"));
            assert_eq!(
                read(&sb, "README.md").await.as_deref(),
                Some("from the spec\n"),
                "all entries re-applied"
            );
        })
        .await
        .expect("call")
        .report;
    assert_eq!(branch(&r), StartBranch::RestoreAll);
    assert!(!r.persisted, "priority 2 does not write the state store");

    // Ready, box gone, no snapshot (snapshots off): cold start with a note.
    let m2 = env.manager(client, IsolationScope::Session, SandboxConfig::new(spec()));
    let ctx2 = env.ctx().session("d");
    call(&m2, &ctx2, |sb| async move {
        sh(&sb, "echo lost > gone.txt").await;
    })
    .await;
    let r = call(&m2, &ctx2, |sb| async move {
        assert_eq!(read(&sb, "gone.txt").await, None);
    })
    .await;
    assert_eq!(branch(&r), StartBranch::Cold);
    assert!(
        r.start.as_ref().and_then(|s| s.note.as_ref()).is_some(),
        "cold start after loss is explained"
    );
}

/// Two managers (two replicas) with their own clients share only the stores: the second
/// finds what the first left.
pub async fn second_replica_restores(fx: &dyn Fixture) {
    let env = Env::of(fx).await;
    let ctx = env.ctx().user("alice").session("s1");
    let m1 = env
        .snapshotting(fx, Persistence::Ephemeral, IsolationScope::User)
        .await;
    call(&m1, &ctx, |sb| async move {
        sh(&sb, "echo from-replica-1 > shared.txt").await;
    })
    .await;
    let m2 = env
        .snapshotting(fx, Persistence::Ephemeral, IsolationScope::User)
        .await;
    let r = call(
        &m2,
        &env.ctx().user("alice").session("s2"),
        |sb| async move {
            assert_eq!(
                read(&sb, "shared.txt").await.as_deref(),
                Some("from-replica-1\n")
            );
        },
    )
    .await;
    assert_eq!(r.acquired_from, AcquiredFrom::StateStore);
    assert_eq!(branch(&r), StartBranch::RestoreEphemeral);
}

/// USER keys separate alice from bob; SESSION keys separate sessions; the fallbacks hold.
pub async fn scope_isolation(fx: &dyn Fixture) {
    let env = Env::of(fx).await;
    let client = fx.client(Persistence::Ephemeral).await;
    let user = env.manager(client.clone(), IsolationScope::User, snap_config(&env));
    call(&user, &env.ctx().user("alice"), |sb| async move {
        sh(&sb, "echo alice > who.txt").await;
    })
    .await;
    call(&user, &env.ctx().user("bob"), |sb| async move {
        assert_eq!(
            read(&sb, "who.txt").await,
            None,
            "bob must not see alice's files"
        );
        sh(&sb, "echo bob > who.txt").await;
    })
    .await;
    call(
        &user,
        &env.ctx().user("alice").session("other"),
        |sb| async move {
            assert_eq!(read(&sb, "who.txt").await.as_deref(), Some("alice\n"));
        },
    )
    .await;
    // USER without a user id falls back to the session.
    let r = call(&user, &env.ctx().session("s9"), |sb| async move {
        sh(&sb, "echo s9 > who.txt").await;
    })
    .await;
    assert_eq!(
        r.key.as_deref(),
        Some(format!("agents/{}/sessions/s9", env.agent).as_str())
    );

    let session = env.manager(client, IsolationScope::Session, snap_config(&env));
    call(&session, &env.ctx().session("s9"), |sb| async move {
        assert_eq!(
            read(&sb, "who.txt").await.as_deref(),
            Some("s9\n"),
            "same slot as the USER fallback"
        );
    })
    .await;
    call(&session, &env.ctx().session("s10"), |sb| async move {
        assert_eq!(read(&sb, "who.txt").await, None);
    })
    .await;
    // SESSION without a session id: a fresh box every time, nothing persisted.
    for _ in 0..2 {
        let r = call(&session, &env.ctx(), |sb| async move {
            assert_eq!(read(&sb, "anon.txt").await, None);
            sh(&sb, "echo x > anon.txt").await;
        })
        .await;
        assert!(r.key.is_none() && !r.persisted);
        assert_eq!(branch(&r), StartBranch::Cold);
    }
}

/// Projection: applied on first start, skipped when unchanged, updated and pruned when the
/// host changes (files the agent made are kept), and re-applied to a recreated box.
pub async fn projection_lifecycle(fx: &dyn Fixture) {
    let env = Env::of(fx).await;
    let host = env.host_root();
    std::fs::write(host.join("AGENTS.md"), "be helpful\n").expect("write");
    std::fs::create_dir_all(host.join("skills/pytest")).expect("mkdir");
    std::fs::write(host.join("skills/pytest/SKILL.md"), "run pytest\n").expect("write");
    std::fs::write(host.join("skills/pytest/old.sh"), "echo old\n").expect("write");
    std::fs::write(host.join("private.txt"), "not projected\n").expect("write");
    let config = snap_config(&env).projection(Projection::new(&host));
    let m = env.manager(
        fx.client(Persistence::Keep).await,
        IsolationScope::Session,
        config,
    );
    let ctx = env.ctx().session("proj");
    let r = call(&m, &ctx, |sb| async move {
        assert_eq!(
            read(&sb, "AGENTS.md").await.as_deref(),
            Some("be helpful\n")
        );
        assert_eq!(
            read(&sb, "skills/pytest/SKILL.md").await.as_deref(),
            Some("run pytest\n")
        );
        assert_eq!(read(&sb, "private.txt").await, None);
        sh(&sb, "echo agent > skills/mine.md").await;
    })
    .await;
    assert!(matches!(
        r.start.as_ref().expect("start").projection,
        ProjectionOutcome::Applied {
            written: 3,
            removed: 0
        }
    ));
    let r = call(&m, &ctx, |_| async {}).await;
    assert_eq!(
        r.start.as_ref().expect("start").projection,
        ProjectionOutcome::Skipped
    );

    std::fs::write(host.join("AGENTS.md"), "be brief\n").expect("write");
    std::fs::remove_file(host.join("skills/pytest/old.sh")).expect("rm");
    let r = call(&m, &ctx, |sb| async move {
        assert_eq!(read(&sb, "AGENTS.md").await.as_deref(), Some("be brief\n"));
        assert_eq!(
            read(&sb, "skills/pytest/old.sh").await,
            None,
            "deleted on the host, deleted in the box"
        );
        assert_eq!(
            read(&sb, "skills/mine.md").await.as_deref(),
            Some("agent\n"),
            "agent files are kept"
        );
    })
    .await;
    assert!(matches!(
        r.start.as_ref().expect("start").projection,
        ProjectionOutcome::Applied {
            written: 2,
            removed: 1
        }
    ));
    cleanup(&m, &ctx).await;

    // No snapshots and an ephemeral box: every box is new, so projection runs every time.
    let m = env.manager(
        fx.client(Persistence::Ephemeral).await,
        IsolationScope::Session,
        SandboxConfig::new(spec()).projection(Projection::new(&host)),
    );
    let ctx = env.ctx().session("proj-noop");
    for _ in 0..2 {
        let r = call(&m, &ctx, |sb| async move {
            assert_eq!(read(&sb, "AGENTS.md").await.as_deref(), Some("be brief\n"));
        })
        .await;
        assert!(matches!(
            r.start.as_ref().expect("start").projection,
            ProjectionOutcome::Applied { .. }
        ));
    }
}

/// A timeout kills the whole process tree in the box, grandchildren included, and returns the
/// output so far.
pub async fn timeout_kills_grandchildren(fx: &dyn Fixture) {
    let env = Env::of(fx).await;
    let m = env.manager(
        fx.client(Persistence::Ephemeral).await,
        IsolationScope::Session,
        SandboxConfig::new(spec()),
    );
    call(&m, &env.ctx(), |sb| async move {
        let r = sb
            .exec(ExecRequest::shell("echo started; sleep 300 & echo $! > gc.pid; wait").timeout(Duration::from_millis(800)))
            .await
            .expect("exec");
        assert!(r.timed_out, "{r:?}");
        assert_eq!(r.stdout_str(), "started\n", "partial output is returned");
        let pid = read(&sb, "gc.pid").await.expect("pid file");
        let probe = format!(
            "p={}; i=0; while [ $i -lt 50 ]; do if [ ! -e /proc/$p ] || grep -q '^State:.*Z' /proc/$p/status 2>/dev/null; then echo dead; exit 0; fi; i=$((i+1)); sleep 0.1; done; echo alive",
            pid.trim()
        );
        assert_eq!(sh(&sb, &probe).await, "dead\n", "the backgrounded grandchild must be killed");
    })
    .await;
}

/// Exec basics: exit codes, separate streams, stdin, cwd, env, output caps.
pub async fn exec_basics(fx: &dyn Fixture) {
    let env = Env::of(fx).await;
    let m = env.manager(
        fx.client(Persistence::Ephemeral).await,
        IsolationScope::Session,
        SandboxConfig::new(spec()),
    );
    call(&m, &env.ctx(), |sb| async move {
        let r = sb
            .exec(ExecRequest::shell("echo out; echo err >&2; exit 3"))
            .await
            .expect("exec");
        assert_eq!(
            (
                r.exit_code,
                r.stdout_str().as_ref(),
                r.stderr_str().as_ref()
            ),
            (Some(3), "out\n", "err\n")
        );
        let r = sb
            .exec(ExecRequest::shell("cat").stdin("piped in"))
            .await
            .expect("exec");
        assert_eq!(r.stdout_str(), "piped in");
        let r = sb
            .exec(ExecRequest::argv(["sh", "-c", "pwd"]).cwd("data"))
            .await
            .expect("exec");
        assert!(r.stdout_str().trim_end().ends_with("/data"), "{r:?}");
        let r = sb
            .exec(ExecRequest::shell("printf %s \"$A-$SPEC_VAR\"").env("A", "call"))
            .await
            .expect("exec");
        assert_eq!(r.stdout_str(), "call-spec-value");
        let r = sb
            .exec(
                ExecRequest::shell(
                    "i=0; while [ $i -lt 3000 ]; do echo 0123456789abcdef; i=$((i+1)); done",
                )
                .limits(crate::OutputLimits::both(1000)),
            )
            .await
            .expect("exec");
        assert!(
            r.stdout_truncated && r.stdout.len() == 1000 && r.success(),
            "{r:?}"
        );
        assert!(
            sb.exec(ExecRequest::shell("true").cwd("../.."))
                .await
                .is_err(),
            "cwd may not escape"
        );
    })
    .await;
}

/// A corrupted or hostile snapshot fails loudly with `RestoreIncomplete` (never a silent fresh
/// start, never an abort), the stored state is left alone, and the previous snapshot still
/// restores: a tar archive replaced, and chunked manifests whose references carry lengths and
/// offsets of 2^36 and beyond over tiny objects ([`hostile`]).
pub async fn hostile_snapshot_rejected(fx: &dyn Fixture) {
    let env = Env::of(fx).await;
    // A tar-format snapshot's archive replaced by hostile ones (the chunked format's tampered
    // chunks: `chunked_incremental_across_replicas`).
    let m = env.manager(
        fx.client(Persistence::Ephemeral).await,
        IsolationScope::Session,
        SandboxConfig::new(spec()).snapshots(
            env.snapshot_spec()
                .format(crate::snapshot::SnapshotFormat::Tar),
        ),
    );
    let ctx = env.ctx().session("hostile");
    let r1 = call(&m, &ctx, |sb| async move {
        sh(&sb, "echo v1 > v.txt").await;
    })
    .await;
    let r2 = call(&m, &ctx, |sb| async move {
        sh(&sb, "echo v2 > v.txt").await;
    })
    .await;
    let key = IsolationKey::resolve(IsolationScope::Session, &ctx).expect("key");
    let snap2 = state_from_json(r2.state_json.as_deref().expect("state"))
        .expect("state")
        .common()
        .snapshot
        .clone()
        .expect("snapshot");
    let stored_before = env.states.load(&key).await.expect("load");

    let hostile = raw_tar::RawTar::new()
        .file("v.txt", b"v3")
        .file("../escape.txt", b"pwned")
        .finish();
    for (name, bytes) in [("hostile entry", hostile), ("garbage", vec![0x42; 4096])] {
        env.snapshots
            .put(&archive_of(&env, &snap2).await, stream::once(bytes), None)
            .await
            .expect("tamper");
        let err = m.call(&ctx, |_| async {}).await.expect_err(name).error;
        assert!(
            matches!(err, Error::RestoreIncomplete { .. }),
            "{name}: {err}"
        );
        assert_eq!(
            env.states.load(&key).await.expect("load"),
            stored_before,
            "{name}: state untouched"
        );
    }
    assert!(!env.dir.path().join("escape.txt").exists());

    // The earlier snapshot (a checkpoint kept from call 1) still restores.
    checkpoint_holds(&m, &ctx, r1.state_json.as_deref(), "v.txt", "v1\n").await;

    // Chunked snapshots whose references carry hostile lengths and offsets.
    hostile::hostile_chunked_snapshots(fx, &env).await;
}

/// A snapshot that fails mid-way (a store that dies after some bytes) fails the call, leaves
/// the stored state pointing at the previous snapshot, which still restores.
pub async fn failed_snapshot_keeps_previous(fx: &dyn Fixture) {
    let env = Env::of(fx).await;
    let failing = FailingStore::new(env.snapshots.clone());
    let config = SandboxConfig::new(spec()).snapshots(SnapshotSpec::new(failing.store()));
    let m = env.manager(
        fx.client(Persistence::Ephemeral).await,
        IsolationScope::Session,
        config,
    );
    let ctx = env.ctx().session("midway");
    let first = call(&m, &ctx, |sb| async move {
        sh(&sb, "echo good > g.txt").await;
    })
    .await;
    failing.fail_after(512);
    let err = m
        .call(&ctx, |sb| async move {
            // An archive of several stream chunks: the store fails on the first, so the
            // side parser meets a truncated archive; the store's error must win.
            sh(
                &sb,
                "echo lost > g.txt; head -c 2000000 /dev/zero > big.bin",
            )
            .await;
        })
        .await
        .expect_err("the snapshot fails");
    assert!(matches!(err.error, Error::Unavailable { .. }), "{err}");
    let report = err.report.expect("the report comes with the error");
    assert!(
        report.parked && report.stop.is_none() && !report.persisted,
        "{report:?}"
    );
    assert!(report.state_json.is_some(), "the state JSON is not lost");
    // The stored state still points at the first, complete snapshot...
    let key = key_of(&m, &ctx);
    let stored = env.states.load(&key).await.expect("load");
    assert_eq!(
        snapshot_of(stored.as_deref()),
        snapshot_of(first.state_json.as_deref())
    );
    // ...and the failed call's box is kept aside (its work is in it), out of the next call's
    // way: that one restores the stored snapshot.
    let parked = state_from_json(report.state_json.as_deref().expect("state")).expect("state");
    let parked_id = m.client().box_id(&*parked).expect("box id");
    let owned = m.client().list_owned().await.expect("list");
    assert!(owned.iter().any(|b| b.id == parked_id), "{owned:?}");
    failing.heal();
    let r = call(&m, &ctx, |sb| async move {
        assert_eq!(read(&sb, "g.txt").await.as_deref(), Some("good\n"));
        assert_eq!(read(&sb, "big.bin").await, None);
    })
    .await;
    assert_eq!(branch(&r), StartBranch::RestoreEphemeral);
    // gc removes the parked box (once old enough; here at once), never the current one.
    let gc = m
        .gc(crate::manager::BoxGcOptions::default().older_than(Duration::ZERO))
        .await
        .expect("gc");
    assert!(gc.boxes_removed.contains(&parked_id), "{gc:?}");
    assert!(
        !m.client()
            .list_owned()
            .await
            .expect("list")
            .iter()
            .any(|b| b.id == parked_id),
        "the parked box is gone"
    );
    let leftovers: Vec<_> = env
        .snapshots
        .list_all("")
        .await
        .expect("list")
        .into_iter()
        .filter(|b| b.size == 0)
        .collect();
    assert!(leftovers.is_empty(), "no partial blobs: {leftovers:?}");
}

/// A stop whose data fits the store but whose manifest does not (the disk fills at the
/// manifest's write: `ENOSPC`) fails the call, and deletes the packs (or archive) it wrote
/// before the error is returned: the store holds exactly what it held before, so the next
/// call succeeds without waiting for a gc. Both formats that write data blobs.
pub async fn failed_manifest_write_leaves_nothing(fx: &dyn Fixture) {
    for format in [SnapshotFormat::Chunked, SnapshotFormat::Tar] {
        let env = Env::of(fx).await;
        let full = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let store = HookedStore::new(env.snapshots.clone()).on_put({
            let full = full.clone();
            move |key, data| {
                if !key.as_str().ends_with(".manifest")
                    || !full.load(std::sync::atomic::Ordering::SeqCst)
                {
                    return data;
                }
                let path = key.to_string();
                futures::StreamExt::boxed(futures::StreamExt::map(data, move |_| {
                    Err(Error::io(
                        path.clone(),
                        std::io::Error::from(std::io::ErrorKind::StorageFull),
                    ))
                }))
            }
        });
        let config =
            SandboxConfig::new(spec()).snapshots(SnapshotSpec::new(Arc::new(store)).format(format));
        let m = env.manager(
            fx.client(Persistence::Ephemeral).await,
            IsolationScope::Session,
            config,
        );
        let ctx = env.ctx().session("manifest-full");
        call(&m, &ctx, |sb| async move {
            sh(&sb, "echo one > a.txt").await;
        })
        .await;
        let before = env.snapshots.list_all("").await.expect("list");
        full.store(true, std::sync::atomic::Ordering::SeqCst);
        let err = m
            .call(&ctx, |sb| async move {
                sh(
                    &sb,
                    "head -c 300000 /dev/urandom > big.bin; echo two > a.txt",
                )
                .await;
            })
            .await
            .expect_err("the manifest cannot be written");
        assert_eq!(err.error.kind(), ErrorKind::Io, "{format:?}: {err}");
        let after = env.snapshots.list_all("").await.expect("list");
        let keys = |blobs: &[crate::snapshot::BlobMeta]| {
            blobs.iter().map(|b| b.key.to_string()).collect::<Vec<_>>()
        };
        assert_eq!(
            keys(&after),
            keys(&before),
            "{format:?}: the failed stop's blobs are gone when its error is returned"
        );
        full.store(false, std::sync::atomic::Ordering::SeqCst);
        call(&m, &ctx, |sb| async move {
            assert_eq!(read(&sb, "a.txt").await.as_deref(), Some("one\n"));
            sh(&sb, "echo three > a.txt").await;
        })
        .await;
    }
    failed_pack_upload_leaves_nothing(fx).await;
}

/// A chunked stop whose third pack upload fails after two packs were stored: the call fails
/// and the packs it stored are deleted before its error is returned.
async fn failed_pack_upload_leaves_nothing(fx: &dyn Fixture) {
    use std::sync::atomic::{AtomicUsize, Ordering};
    let env = Env::of(fx).await;
    // Pack puts let through before one fails (`usize::MAX`: never).
    let let_through = Arc::new(AtomicUsize::new(usize::MAX));
    let store = HookedStore::new(env.snapshots.clone()).on_put({
        let let_through = let_through.clone();
        move |key, data| {
            if !key.as_str().starts_with("packs/") {
                return data;
            }
            let left = let_through.load(Ordering::SeqCst);
            if left == usize::MAX {
                return data;
            }
            let_through.store(left.saturating_sub(1), Ordering::SeqCst);
            if left > 0 {
                return data;
            }
            let path = key.to_string();
            futures::StreamExt::boxed(futures::StreamExt::map(data, move |_| {
                Err(Error::io(
                    path.clone(),
                    std::io::Error::from(std::io::ErrorKind::StorageFull),
                ))
            }))
        }
    });
    // Packs of one chunk each (every chunk is larger than the target): a 3 MB file is many.
    let config = SandboxConfig::new(spec()).snapshots(
        SnapshotSpec::new(Arc::new(store))
            .format(SnapshotFormat::Chunked)
            .pack_size(1),
    );
    let m = env.manager(
        fx.client(Persistence::Ephemeral).await,
        IsolationScope::Session,
        config,
    );
    let ctx = env.ctx().session("pack-full");
    call(&m, &ctx, |sb| async move {
        sh(&sb, "echo one > a.txt").await;
    })
    .await;
    let before = env.snapshots.list_all("").await.expect("list");
    let_through.store(2, Ordering::SeqCst);
    let err = m
        .call(&ctx, |sb| async move {
            sh(&sb, "head -c 3000000 /dev/urandom > big.bin").await;
        })
        .await
        .expect_err("the third pack cannot be written");
    assert_eq!(err.error.kind(), ErrorKind::Io, "{err}");
    let after = env.snapshots.list_all("").await.expect("list");
    let keys = |blobs: &[crate::snapshot::BlobMeta]| {
        blobs.iter().map(|b| b.key.to_string()).collect::<Vec<_>>()
    };
    assert_eq!(
        keys(&after),
        keys(&before),
        "the packs the failed stop stored are gone when its error is returned"
    );
    let_through.store(usize::MAX, Ordering::SeqCst);
    call(&m, &ctx, |sb| async move {
        assert_eq!(read(&sb, "a.txt").await.as_deref(), Some("one\n"));
        assert_eq!(read(&sb, "big.bin").await, None);
    })
    .await;
}

/// Malformed state and unknown backend tags are typed errors; the stored state is not
/// overwritten.
pub async fn bad_state_is_a_typed_error(fx: &dyn Fixture) {
    let env = Env::of(fx).await;
    let m = env
        .snapshotting(fx, Persistence::Ephemeral, IsolationScope::Session)
        .await;
    let ctx = env.ctx().session("bad");
    let key = IsolationKey::resolve(IsolationScope::Session, &ctx).expect("key");
    for (json, check) in [
        (
            "{garbage",
            (|e: &Error| matches!(e, Error::MalformedState { .. })) as fn(&Error) -> bool,
        ),
        (
            r#"{"type":"martian","common":{}}"#,
            |e: &Error| matches!(e, Error::UnknownStateType { known, .. } if !known.is_empty()),
        ),
    ] {
        seed_state(&*env.states, &key, json).await;
        let err = m
            .call(&ctx, |_| async {})
            .await
            .expect_err("bad state")
            .error;
        assert!(check(&err), "{json}: {err}");
        assert_eq!(
            env.states.load(&key).await.expect("load").as_deref(),
            Some(json),
            "not overwritten"
        );
    }
}

/// A started, user-managed sandbox is handed to several agents' calls in turn: each call stops
/// (snapshots) it, none shuts it down or writes the state store.
pub async fn user_managed_sandbox_is_shared(fx: &dyn Fixture) {
    let env = Env::of(fx).await;
    let client = fx.client(Persistence::Ephemeral).await;
    let parent = env.manager(client.clone(), IsolationScope::Session, snap_config(&env));
    let child = env.manager(client, IsolationScope::Session, snap_config(&env));
    // Its snapshots live under the key it was made for.
    let box_key = IsolationKey::resolve(IsolationScope::Agent, &env.ctx()).expect("key");
    let shared = parent
        .create_external(Some(&box_key))
        .await
        .expect("create");
    let r = parent
        .call_with(
            &CallContext::new("parent").session("p"),
            Acquire::External(shared.clone()),
            |sb| async move {
                sh(&sb, "echo from-parent > handoff.txt").await;
            },
        )
        .await
        .expect("call")
        .report;
    assert!(
        r.start.is_none() && r.stop.as_ref().is_some_and(|s| s.snapshot.is_some()) && !r.persisted
    );
    child
        .call_with(
            &CallContext::new("child").session("c"),
            Acquire::External(shared.clone()),
            |sb| async move {
                assert_eq!(
                    read(&sb, "handoff.txt").await.as_deref(),
                    Some("from-parent\n")
                );
            },
        )
        .await
        .expect("call");
    assert_eq!(
        sh(&shared, "cat handoff.txt").await,
        "from-parent\n",
        "still running after the calls"
    );
    let key = IsolationKey::resolve(
        IsolationScope::Session,
        &CallContext::new("parent").session("p"),
    )
    .expect("key");
    assert_eq!(env.states.load(&key).await.expect("load"), None);
    shared.destroy().await.expect("destroy");
}

/// The post-call steps run when the closure panics (its work is saved); a cancelled call's
/// work is not kept (the state records the cancellation only) and the next call is told.
pub async fn panic_and_cancel_still_persist(fx: &dyn Fixture) {
    let env = Env::of(fx).await;
    let m = env
        .snapshotting(fx, Persistence::Ephemeral, IsolationScope::Session)
        .await;
    let ctx = env.ctx().session("panic");
    let m2 = m.clone();
    let ctx2 = ctx.clone();
    let joined = tokio::spawn(async move {
        m2.call(&ctx2, |sb| async move {
            sh(&sb, "echo before-panic > p.txt").await;
            panic!("agent blew up");
        })
        .await
    })
    .await;
    assert!(
        joined.is_err_and(|e| e.is_panic()),
        "the panic is re-raised"
    );
    call(&m, &ctx, |sb| async move {
        assert_eq!(read(&sb, "p.txt").await.as_deref(), Some("before-panic\n"));
    })
    .await;

    let cctx = env.ctx().session("cancel");
    let key = IsolationKey::resolve(IsolationScope::Session, &cctx).expect("key");
    let (tx, rx) = tokio::sync::oneshot::channel();
    let m3 = m.clone();
    let cctx2 = cctx.clone();
    let task = tokio::spawn(async move {
        m3.call(&cctx2, |sb| async move {
            sh(&sb, "echo before-cancel > c.txt").await;
            let _ = tx.send(());
            std::future::pending::<()>().await;
        })
        .await
    });
    rx.await.expect("closure ran");
    task.abort();
    let mut recorded = None;
    for _ in 0..300 {
        if let Some(json) = env.states.load(&key).await.expect("load") {
            recorded = Some(json);
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // A cancelled call is a failed call: its state records only that it was cancelled (a new
    // box's fresh state, no snapshot), never its work.
    let recorded = recorded.expect("the cancellation is recorded in the key's state");
    let state = state_from_json(&recorded).expect("state");
    assert!(state.common().snapshot.is_none(), "no snapshot of its work");
    assert!(
        state
            .common()
            .cancelled
            .as_ref()
            .is_some_and(|c| !c.partial)
    );
    // The background steps also release the box; wait for the guard to be free by calling.
    let r = call(&m, &cctx, |sb| async move {
        assert_eq!(
            read(&sb, "c.txt").await,
            None,
            "the cancelled call's work is gone"
        );
    })
    .await;
    assert!(r.previous_cancelled.is_some(), "the next call is told");
    let r = call(&m, &cctx, |_| async {}).await;
    assert!(r.previous_cancelled.is_none(), "once");
}

/// Bind-mounted paths are never archived, and survive a restore untouched.
pub async fn bind_mounts_are_not_archived(fx: &dyn Fixture) {
    let env = Env::of(fx).await;
    let client = fx.client(Persistence::Ephemeral).await;
    if !client.capabilities().bind_mounts {
        return;
    }
    let host = env.dir.path().join("mounted");
    std::fs::create_dir_all(&host).expect("mkdir");
    std::fs::write(host.join("host.txt"), "on the host\n").expect("write");
    let spec = WorkspaceSpec::builder()
        .bind_mount("mnt", &host, false)
        .file("a.txt", "a\n")
        .build()
        .expect("spec");
    let m = env.manager(
        client,
        IsolationScope::Session,
        SandboxConfig::new(spec).snapshots(env.snapshot_spec()),
    );
    let ctx = env.ctx().session("bind");
    let r = call(&m, &ctx, |sb| async move {
        assert_eq!(sh(&sb, "cat mnt/host.txt").await, "on the host\n");
        sh(&sb, "echo from-box > mnt/box.txt").await;
    })
    .await;
    assert_eq!(
        std::fs::read_to_string(host.join("box.txt")).expect("written through the mount"),
        "from-box\n"
    );
    let snap = state_from_json(r.state_json.as_deref().expect("state"))
        .expect("state")
        .common()
        .snapshot
        .clone()
        .expect("snapshot");
    let names = snapshot_names(&env, &snap).await;
    assert!(
        names.iter().all(|n| !n.starts_with("mnt")),
        "bind mount archived: {names:?}"
    );
    assert!(names.iter().any(|n| n == "a.txt"));
    call(&m, &ctx, |sb| async move {
        assert_eq!(
            sh(&sb, "cat mnt/host.txt mnt/box.txt").await,
            "on the host\nfrom-box\n"
        );
    })
    .await;
}

/// The tar archive blob of a tar-format snapshot.
async fn archive_of(env: &Env, snap: &crate::snapshot::SnapshotRef) -> BlobKey {
    let manifest = crate::snapshot::load_manifest(&env.snapshot_spec(), snap)
        .await
        .expect("manifest");
    BlobKey::new(
        manifest
            .header
            .archive
            .as_ref()
            .expect("tar snapshot")
            .key
            .clone(),
    )
    .expect("key")
}

/// The paths a snapshot holds (its manifest's entries, in any format).
async fn snapshot_names(env: &Env, snap: &crate::snapshot::SnapshotRef) -> Vec<String> {
    crate::snapshot::load_manifest(&env.snapshot_spec(), snap)
        .await
        .expect("manifest")
        .entries
        .iter()
        .map(|e| e.path.as_str().to_owned())
        .collect()
}

async fn cleanup(m: &SandboxManager, ctx: &CallContext) {
    m.delete(ctx).await.expect("delete");
}

/// The snapshot a state JSON points at.
pub fn snapshot_of(state_json: Option<&str>) -> Option<crate::snapshot::SnapshotRef> {
    state_from_json(state_json?)
        .expect("state")
        .common()
        .snapshot
        .clone()
}

/// Store `json` as `key`'s state the way a holder would: registered, then saved.
pub async fn seed_state(states: &dyn StateStore, key: &IsolationKey, json: &str) {
    let token = states.fence(key, None).await.expect("fence");
    states.save(key, json, Some(token)).await.expect("seed");
}

/// The key `m` resolves `ctx` to.
pub fn key_of(m: &SandboxManager, ctx: &CallContext) -> IsolationKey {
    IsolationKey::resolve(m.scope(), ctx).expect("a key")
}

/// A stop with nothing changed writes nothing and keeps the snapshot reference, both on a
/// warm box and right after a restore; a change is picked up again.
pub async fn skip_unchanged(fx: &dyn Fixture) {
    for format in [SnapshotFormat::Tar, SnapshotFormat::Chunked] {
        let env = Env::of(fx).await;
        let config = SandboxConfig::new(spec()).snapshots(env.snapshot_spec().format(format));
        let keep = env.manager(
            fx.client(Persistence::Keep).await,
            IsolationScope::Session,
            config.clone(),
        );
        let ctx = env.ctx().session("skip");
        let first = call(&keep, &ctx, |sb| async move {
            sh(&sb, "mkdir -p d && echo one > d/one.txt").await;
        })
        .await;
        let id = |r: &CallReport| {
            r.stop
                .as_ref()
                .and_then(|s| s.snapshot.as_ref())
                .map(|s| s.id.clone())
        };
        let second = call(&keep, &ctx, |_| async {}).await;
        let stop = second.stop.as_ref().expect("stop");
        assert!(
            stop.unchanged && stop.bytes_written == 0,
            "{format:?} warm: {stop:?}"
        );
        assert_eq!(id(&second), id(&first), "{format:?}: same reference");
        let third = call(&keep, &ctx, |sb| async move {
            sh(&sb, "echo two > d/two.txt").await;
        })
        .await;
        let stop = third.stop.as_ref().expect("stop");
        assert!(
            !stop.unchanged && stop.bytes_written > 0,
            "{format:?}: a change is snapshotted: {stop:?}"
        );
        assert_ne!(id(&third), id(&first));
        cleanup(&keep, &ctx).await;

        // Ephemeral: every call restores; an untouched restored workspace is not re-snapshotted.
        let eph = env.manager(
            fx.client(Persistence::Ephemeral).await,
            IsolationScope::Session,
            config,
        );
        let ctx = env.ctx().session("skip-eph");
        let first = call(&eph, &ctx, |sb| async move {
            sh(&sb, "echo one > one.txt && ln -s one.txt link").await;
        })
        .await;
        let second = call(&eph, &ctx, |_| async {}).await;
        assert_eq!(branch(&second), StartBranch::RestoreEphemeral);
        let stop = second.stop.as_ref().expect("stop");
        assert!(
            stop.unchanged && stop.bytes_written == 0,
            "{format:?} after restore: {stop:?}"
        );
        assert_eq!(id(&second), id(&first));
    }
}

/// Chunked snapshots are incremental: after one small change only new chunks and the manifest
/// are written, and two replicas restore each other's incremental snapshots, verified.
pub async fn chunked_incremental_across_replicas(fx: &dyn Fixture) {
    let env = Env::of(fx).await;
    let config =
        SandboxConfig::new(spec()).snapshots(env.snapshot_spec().format(SnapshotFormat::Chunked));
    let r1 = env.manager(
        fx.client(Persistence::Ephemeral).await,
        IsolationScope::User,
        config.clone(),
    );
    let r2 = env.manager(
        fx.client(Persistence::Ephemeral).await,
        IsolationScope::User,
        config,
    );
    let ctx = env.ctx().user("carol");
    let first = call(&r1, &ctx, |sb| async move {
        // ~2 MiB of incompressible-enough data in several files, plus a small one.
        sh(&sb, "i=0; while [ $i -lt 4 ]; do head -c 524288 /dev/urandom > big$i.bin; i=$((i+1)); done; echo small > small.txt").await;
        // Written long before the next call, as in real use: files restored with whole-second
        // mtimes in the second they were written in are re-hashed (they may hide a rewrite),
        // which would blur what this scenario counts.
        sh(&sb, "touch -t 202001010000 big0.bin big1.bin big2.bin big3.bin small.txt README.md bin/hello").await;
    })
    .await;
    let full = first.stop.as_ref().expect("stop").bytes_written;
    assert!(
        full > 2 * 1024 * 1024,
        "first snapshot holds everything: {full}"
    );
    let second = call(&r2, &ctx, |sb| async move {
        assert_eq!(read(&sb, "small.txt").await.as_deref(), Some("small\n"));
        sh(&sb, "echo changed > small.txt").await;
    })
    .await;
    assert_eq!(branch(&second), StartBranch::RestoreEphemeral);
    let stop = second.stop.as_ref().expect("stop");
    assert_eq!(
        stop.files_hashed, 1,
        "only the changed file is read: {stop:?}"
    );
    assert!(
        stop.bytes_written < 64 * 1024,
        "only the changed chunk and the manifest are written: {stop:?}"
    );
    let sums = call(&r1, &ctx, |sb| async move {
        assert_eq!(read(&sb, "small.txt").await.as_deref(), Some("changed\n"));
        sh(&sb, "cat big0.bin big1.bin big2.bin big3.bin | md5sum").await;
    })
    .await;
    assert_eq!(branch(&sums), StartBranch::RestoreEphemeral);

    // A tampered chunk fails the restore loudly; the earlier snapshot still restores.
    let snap = state_from_json(second.state_json.as_deref().expect("state"))
        .expect("state")
        .common()
        .snapshot
        .clone()
        .expect("snap");
    let manifest = crate::snapshot::load_manifest(&env.snapshot_spec(), &snap)
        .await
        .expect("manifest");
    let small = manifest
        .entries
        .iter()
        .find(|e| e.path.as_str() == "small.txt")
        .expect("entry");
    tamper_chunk(&*env.snapshots, &small.chunks[0]).await;
    let err = r2
        .call(&ctx, |_| async {})
        .await
        .expect_err("tampered chunk");
    assert!(
        matches!(err.error, Error::RestoreIncomplete { .. }),
        "{err}"
    );
    checkpoint_holds(
        &r2,
        &ctx,
        first.state_json.as_deref(),
        "small.txt",
        "small\n",
    )
    .await;
}

/// Flip one byte of the stored chunk `chunk` refers to, wherever it is (inside a pack, or a
/// chunk blob of an older snapshot).
pub async fn tamper_chunk(store: &dyn SnapshotStore, chunk: &crate::snapshot::ChunkRef) {
    let (key, at) = match chunk.location {
        crate::snapshot::ChunkLocation::Pack { pack, offset } => (pack.key(), offset),
        crate::snapshot::ChunkLocation::Bundle { offset } => (
            crate::snapshot::chunk_key(&chunk.hash).expect("key"),
            offset,
        ),
        crate::snapshot::ChunkLocation::Blob => {
            (crate::snapshot::chunk_key(&chunk.hash).expect("key"), 0)
        }
    };
    let mut bytes = stream::collect(store.get(&key).await.expect("get"), 1 << 30)
        .await
        .expect("read")
        .to_vec();
    bytes[at as usize] ^= 0x20;
    store
        .put(&key, stream::once(bytes), None)
        .await
        .expect("tamper");
}

/// Restoring a chunked snapshot into a box whose workspace still holds some of its files reads
/// those from the box (verified by hash) and fetches only the other chunks. Measured in bytes
/// read from the store: restore coalesces neighbouring chunks into one ranged read, so the
/// number of requests says nothing about how many chunks came from the store.
pub async fn chunked_restore_reuses_live_files(fx: &dyn Fixture) {
    let env = Env::of(fx).await;
    let counting: Arc<CountingStore> = Arc::new(CountingStore::new(env.snapshots.clone()));
    let store: Arc<dyn SnapshotStore> = counting.clone();
    let config = SandboxConfig::new(spec())
        .snapshots(SnapshotSpec::new(store.clone()).format(SnapshotFormat::Chunked));
    let m = env.manager(
        fx.client(Persistence::Keep).await,
        IsolationScope::Session,
        config,
    );
    let ctx = env.ctx().session("reuse");
    let first = m
        .call(&ctx, |sb| async move {
            sh(&sb, "i=0; while [ $i -lt 4 ]; do head -c 524288 /dev/urandom > big$i.bin; i=$((i+1)); done; md5sum big0.bin").await
        })
        .await
        .expect("call");
    let original = first.value;
    call(&m, &ctx, |sb| async move {
        sh(&sb, "head -c 524288 /dev/urandom > big0.bin").await;
    })
    .await;
    let mut checkpoint =
        state_from_json(first.report.state_json.as_deref().expect("state")).expect("state");
    let snap = checkpoint.common().snapshot.clone().expect("snapshot");
    let manifest = crate::snapshot::load_manifest(&SnapshotSpec::new(store.clone()), &snap)
        .await
        .expect("manifest");
    let bytes_of =
        |e: &crate::snapshot::ManifestEntry| -> u64 { e.chunks.iter().map(|c| c.len).sum() };
    // Each distinct chunk once: that is what a restore fetching everything reads.
    let total_bytes: u64 = manifest
        .entries
        .iter()
        .flat_map(|e| e.chunks.iter().map(|c| (c.hash.as_str(), c.len)))
        .collect::<std::collections::BTreeMap<_, _>>()
        .values()
        .sum();
    let big0_bytes = bytes_of(
        manifest
            .entries
            .iter()
            .find(|e| e.path.as_str() == "big0.bin")
            .expect("big0"),
    );
    // Never ready: branch C restores the checkpoint into the kept box, whose big1..3 are unchanged.
    checkpoint.common_mut().workspace_root_ready = false;
    let before = counting.counts();
    let r = m
        .call_with(&ctx, Acquire::State(checkpoint), |sb| async move {
            sh(&sb, "md5sum big0.bin").await
        })
        .await
        .expect("restore");
    assert_eq!(
        r.value, original,
        "big0.bin is back to the checkpoint's content"
    );
    assert_eq!(branch(&r.report), StartBranch::RestoreAll);
    // Everything read during the restore: the manifest and the chunk ranges.
    let fetched = counting.counts().since(&before).bytes_read;
    if m.client().capabilities().concurrent_transfers {
        // big0 (512 KiB) and a little more (the manifest, coalescing gaps, small files), not
        // big1..3 (1.5 MiB more) as well.
        assert!(
            fetched >= big0_bytes && fetched < big0_bytes + (256 << 10),
            "read {fetched} B from the store; big0 is {big0_bytes} B of {total_bytes} B"
        );
    } else {
        // The backend cannot read the live workspace during the upload: everything is fetched.
        assert!(
            fetched >= total_bytes,
            "read {fetched} B from the store; the snapshot holds {total_bytes} B"
        );
    }
    cleanup(&m, &ctx).await;
}

/// Retention keeps the newest snapshots per key; GC deletes packs only old snapshots used,
/// repacks a pack that is mostly dead (its live chunks then restore through its redirect),
/// never touches one a kept snapshot needs whole or one younger than the grace period, and
/// every kept snapshot still restores afterwards; redirect chains stay one step long, and a
/// redirect goes once no location passes through it.
pub async fn retention_and_gc(fx: &dyn Fixture) {
    let env = Env::of(fx).await;
    let spec_of = |env: &Env| {
        env.snapshot_spec()
            .format(SnapshotFormat::Chunked)
            .keep_last(2)
    };
    let config = SandboxConfig::new(spec()).snapshots(spec_of(&env));
    let m = env.manager(
        fx.client(Persistence::Ephemeral).await,
        IsolationScope::User,
        config,
    );
    let (dave, erin) = (env.ctx().user("dave"), env.ctx().user("erin"));
    let mut states = Vec::new();
    let mut keep_sum = String::new();
    for v in 0..4 {
        let r = m
            .call(&dave, |sb| async move {
                // keep.bin is written once and carried by every later snapshot: a quarter of
                // the first pack, which is otherwise dead once the first snapshot is retired.
                let keep = if v == 0 {
                    "head -c 100000 /dev/urandom > keep.bin; "
                } else {
                    ""
                };
                sh(
                    &sb,
                    &format!(
                        "{keep}head -c 300000 /dev/urandom > data.bin; echo v{v} > v.txt; md5sum keep.bin"
                    ),
                )
                .await
            })
            .await
            .expect("call");
        keep_sum = r.value;
        states.push(r.report.state_json.expect("state"));
    }
    call(&m, &erin, |sb| async move {
        sh(&sb, "head -c 200000 /dev/urandom > erin.bin").await;
    })
    .await;
    let manifests = env.snapshots.list_all("snapshots/").await.expect("list");
    assert_eq!(
        manifests
            .iter()
            .filter(|b| b.key.as_str().ends_with(".manifest"))
            .count(),
        3,
        "dave keeps 2, erin 1"
    );

    let policy = crate::archive::ArchivePolicy::default();
    let gc = |options: crate::snapshot::GcOptions| {
        let (store, states) = (env.snapshots.clone(), env.states.clone());
        async move {
            crate::snapshot::gc(&*store, &policy, options, &*states)
                .await
                .expect("gc")
        }
    };
    let kept = gc(crate::snapshot::GcOptions::default()).await;
    assert_eq!(
        (kept.packs_deleted, kept.packs_repacked, kept.chunks_deleted),
        (0, 0, 0),
        "everything is inside the default grace period: {kept:?}"
    );
    let now = crate::snapshot::GcOptions::default().grace(Duration::ZERO);
    let dry = gc(now.dry_run(true)).await;
    assert_eq!(
        (dry.packs_deleted, dry.packs_repacked),
        (1, 1),
        "the second snapshot's pack is dead, the first one's mostly: {dry:?}"
    );
    let packs_before = env.snapshots.list_all("packs/").await.expect("list");
    let swept = gc(now.keep_last(2)).await;
    assert_eq!(
        (swept.packs_deleted, swept.packs_repacked),
        (dry.packs_deleted, dry.packs_repacked),
        "the dry run predicted the sweep"
    );
    assert_eq!(swept.locations_missing, 0, "{swept:?}");
    let packs_after = env.snapshots.list_all("packs/").await.expect("list");
    let redirects = |blobs: &[crate::snapshot::BlobMeta]| {
        blobs
            .iter()
            .filter(|b| b.key.as_str().ends_with(".moved"))
            .count()
    };
    assert_eq!(
        (packs_after.len(), redirects(&packs_after)),
        (packs_before.len() - 2 + 2, 1),
        "two packs gone, the repacked one's copy and redirect added"
    );
    assert!(swept.packs_live > 0);

    // Every kept snapshot still restores, verified: keep.bin through the redirect.
    let latest = m
        .call(&dave, |sb| async move {
            (read(&sb, "v.txt").await, sh(&sb, "md5sum keep.bin").await)
        })
        .await
        .expect("restore");
    assert_eq!(latest.value, (Some("v3\n".to_owned()), keep_sum.clone()));
    checkpoint_holds(&m, &dave, Some(&states[2]), "v.txt", "v2\n").await;
    call(&m, &erin, |sb| async move {
        assert!(read(&sb, "erin.bin").await.is_some());
    })
    .await;
    // The first was retired: restoring it fails loudly.
    let first = state_from_json(&states[0]).expect("state");
    let err = m
        .call_with(&dave, Acquire::State(first), |_| async {})
        .await
        .expect_err("retired");
    assert!(
        matches!(err.error, Error::RestoreIncomplete { .. }),
        "{err}"
    );
    // A damaged redirect fails the restore loudly, and nothing is lost once it is back.
    let moved = packs_after
        .iter()
        .find(|b| b.key.as_str().ends_with(".moved"))
        .expect("redirect")
        .key
        .clone();
    let good = stream::collect(env.snapshots.get(&moved).await.expect("get"), 1 << 20)
        .await
        .expect("read");
    let mut bad = good.to_vec();
    let last = bad.len() - 40;
    bad[last] ^= 1;
    env.snapshots
        .put(&moved, stream::once(bad), None)
        .await
        .expect("tamper");
    let err = m
        .call(&dave, |_| async {})
        .await
        .expect_err("damaged redirect");
    assert!(
        matches!(err.error, Error::RestoreIncomplete { .. }),
        "{err}"
    );
    env.snapshots
        .put(&moved, stream::once(good), None)
        .await
        .expect("repair");
    // The redirect lives while a kept snapshot names the repacked pack, and goes after.
    let again = gc(now.keep_last(2)).await;
    assert_eq!(
        (again.redirects_live, again.redirects_deleted),
        (1, 0),
        "{again:?}"
    );
    for v in 4..6 {
        call(&m, &dave, |sb| async move {
            sh(&sb, &format!("rm -f keep.bin; echo v{v} > v.txt")).await;
        })
        .await;
    }
    // Without keep.bin, the repacked copy is mostly dead too (the workspace's small spec
    // files are still carried from the first snapshot): repacked again. The first pack's
    // redirect is rewritten to the newest copy, so the copy's own redirect is needed by nobody
    // and goes in the next run.
    let last = gc(now.keep_last(2)).await;
    assert_eq!(
        (last.packs_repacked, last.locations_missing),
        (1, 0),
        "{last:?}"
    );
    let listed = env.snapshots.list_all("packs/").await.expect("list");
    assert_eq!(redirects(&listed), 2);
    let after = gc(now.keep_last(2)).await;
    assert_eq!(
        (after.redirects_live, after.redirects_deleted),
        (1, 1),
        "{after:?}"
    );
    let left = env.snapshots.list_all("packs/").await.expect("list");
    assert_eq!(redirects(&left), 1);
    call(&m, &dave, |sb| async move {
        assert_eq!(read(&sb, "v.txt").await.as_deref(), Some("v5\n"));
        assert!(read(&sb, "README.md").await.is_some());
    })
    .await;
}

/// Hard-linked files survive a snapshot in both formats: a whole-tree export holds the second
/// path as a link to the first (the engine's archives, `tar` in a box), and the restored
/// workspace has both paths with their content — small files and files of several chunks,
/// on the first snapshot and on one with a parent.
pub async fn hard_links_survive_snapshots(fx: &dyn Fixture) {
    let env = Env::of(fx).await;
    for format in [SnapshotFormat::Chunked, SnapshotFormat::Tar] {
        let m = env.manager(
            fx.client(Persistence::Ephemeral).await,
            IsolationScope::Session,
            SandboxConfig::new(spec()).snapshots(env.snapshot_spec().format(format)),
        );
        let ctx = env.ctx().session(format!("hardlinks-{format:?}"));
        call(&m, &ctx, |sb| async move {
            sh(
                &sb,
                "echo small > h1 && ln h1 h2 && head -c 600000 /dev/zero > b1 && ln b1 b2",
            )
            .await;
        })
        .await;
        let check = "cat h1 h2 && wc -c < b1 && wc -c < b2";
        let r = m
            .call(&ctx, |sb| async move {
                let out = sh(&sb, check).await;
                sh(&sb, "echo more > h3 && ln h3 h4").await;
                out
            })
            .await
            .expect("call");
        assert_eq!(
            branch(&r.report),
            StartBranch::RestoreEphemeral,
            "{format:?}"
        );
        let want = "small\nsmall\n600000\n600000\n";
        assert_eq!(squeeze(&r.value), want, "{format:?}: first snapshot");
        // A snapshot with a parent (only the new pair changed), restored again.
        let r = m
            .call(&ctx, |sb| async move {
                sh(&sb, &format!("{check} && cat h3 h4")).await
            })
            .await
            .expect("call");
        assert_eq!(
            squeeze(&r.value),
            format!("{want}more\nmore\n"),
            "{format:?}: second snapshot"
        );
        cleanup(&m, &ctx).await;
    }
}

/// `wc -c` pads its count with spaces on some systems.
fn squeeze(out: &str) -> String {
    out.lines().map(|l| format!("{}\n", l.trim())).collect()
}

/// A file rewritten through the file primitive to the same size, call after call, is
/// snapshotted every time — also where the backend stores whole-second mtimes (an archive
/// upload stamps its tar header's), so a rewrite in the second of the last listing keeps the
/// mtime.
pub async fn same_size_rewrites_are_snapshotted(fx: &dyn Fixture) {
    let env = Env::of(fx).await;
    let m = env
        .snapshotting(fx, Persistence::Keep, IsolationScope::Session)
        .await;
    let ctx = env.ctx().session("rewrites");
    for i in 0..6 {
        let r = call(&m, &ctx, |sb| async move {
            sb.handle()
                .write_file(
                    &RelPath::new("w.txt").expect("path"),
                    format!("w{i}\n").into(),
                    0o644,
                )
                .await
                .expect("write");
        })
        .await;
        let stop = r.stop.expect("stop");
        assert!(
            i == 0 || !stop.unchanged,
            "rewrite {i} was taken for no change"
        );
    }
    let stored = env
        .states
        .load(&key_of(&m, &ctx))
        .await
        .expect("load")
        .expect("state");
    fx.lose_box(&*state_from_json(&stored).expect("state"))
        .await;
    call(&m, &ctx, |sb| async move {
        assert_eq!(read(&sb, "w.txt").await.as_deref(), Some("w5\n"));
    })
    .await;
}

/// A stop after a one-file change reads exactly that file, also when every other file was
/// written just before the previous stop's listing (in the same clock tick and second): that
/// stop settles them ([`crate::snapshot::TakeOutcome::files_settled`]). Same-size rewrites
/// (suspects) and a size change alike. Files are written by commands in the box (the
/// backend's own filesystem timestamps).
pub async fn one_change_rehashes_one_file(fx: &dyn Fixture) {
    let env = Env::of(fx).await;
    // No spec entries: an ephemeral one is rewritten (and so read) by every call.
    let m = env.manager(
        fx.client(Persistence::Keep).await,
        IsolationScope::Session,
        SandboxConfig::new(WorkspaceSpec::default()).snapshots(env.snapshot_spec()),
    );
    let ctx = env.ctx().session("rehash");
    let first = call(&m, &ctx, |sb| async move {
        sh(
            &sb,
            "mkdir -p src && i=0; while [ $i -lt 20 ]; do echo content-$i > src/f$i; i=$((i+1)); done",
        )
        .await;
    })
    .await;
    let stop = first.stop.expect("stop");
    assert!(stop.files_hashed >= 20, "first snapshot: {stop:?}");
    for (what, line) in [
        ("same-size rewrite", "echo CONTENT-7 > src/f7"),
        ("size change", "echo changed-content-7 > src/f7"),
        (
            "same-size rewrite of another file",
            "echo CONTENT-3 > src/f3",
        ),
    ] {
        let r = call(&m, &ctx, |sb| async move {
            sh(&sb, line).await;
        })
        .await;
        let stop = r.stop.expect("stop");
        assert!(!stop.unchanged, "{what}: the change was missed: {stop:?}");
        assert_eq!(stop.files_hashed, 1, "{what}: {stop:?}");
    }
    let r = call(&m, &ctx, |sb| async move {
        assert_eq!(
            read(&sb, "src/f7").await.as_deref(),
            Some("changed-content-7\n")
        );
        assert_eq!(read(&sb, "src/f3").await.as_deref(), Some("CONTENT-3\n"));
    })
    .await;
    let stop = r.stop.expect("stop");
    assert!(
        stop.unchanged && stop.files_hashed == 0,
        "nothing changed: {stop:?}"
    );
    cleanup(&m, &ctx).await;
}

/// Generate one `#[tokio::test]` per conformance scenario for a fixture expression, with
/// optional extra attributes on each test (e.g. an `#[ignore = "..."]` for tests that need a
/// service and are run by `cargo xtask test`).
#[macro_export]
macro_rules! conformance_tests {
    // The core scenarios only, without the `faults` group: for a second run of a backend on
    // another image or configuration, where the lifecycle sweeps would only repeat themselves.
    (core: $fixture:expr $(, #[$attr:meta])* $(,)?) => {
        $crate::conformance_tests!(@core [$fixture] [$(#[$attr])*]);
    };
    // The scenarios that write, read, tamper with, retain and collect snapshots, with the
    // lifecycle sweeps: how a snapshot store runs the kit (`$fixture` is usually a
    // `testkit::OnStore` over sandbox-local's fixture).
    (snapshots: $fixture:expr $(, #[$attr:meta])* $(,)?) => {
        $crate::conformance_tests!(@each [$fixture] [$(#[$attr])*]
            restore_after_release restore_after_external_loss second_replica_restores
            failed_manifest_write_leaves_nothing
            hostile_snapshot_rejected failed_snapshot_keeps_previous panic_and_cancel_still_persist
            skip_unchanged chunked_incremental_across_replicas retention_and_gc
            chunked_restore_reuses_live_files same_size_rewrites_are_snapshotted);
        $crate::conformance_tests!(@faults [$fixture] [$(#[$attr])*]
            faults_cancellation_sweep faults_cancellation_inside_closure faults_fault_sweep
            faults_retention_after_failed_saves faults_gc_interleaving
            faults_unkeyed_calls_leave_no_snapshots);
    };
    ($fixture:expr $(, #[$attr:meta])* $(,)?) => {
        $crate::conformance_tests!(@core [$fixture] [$(#[$attr])*]);
        $crate::conformance_tests!(@faults [$fixture] [$(#[$attr])*]
            faults_cancellation_sweep faults_cancellation_inside_closure faults_fault_sweep
            faults_same_key_concurrency
            faults_unserializable_state_is_reported faults_retention_after_failed_saves
            faults_gc_interleaving faults_unkeyed_calls_leave_no_snapshots
            faults_missing_exec_features_are_refused faults_unsafe_setups_fail_at_build
            faults_lost_lease_is_typed_and_truthful);
        $crate::conformance_tests!(@processes [$fixture] [$(#[$attr])*]
            faults_two_processes_one_key faults_stale_holder_fencing);
    };
    (@core [$fixture:expr] $attrs:tt) => {
        $crate::conformance_tests!(@each [$fixture] $attrs
            state_round_trip cold_start_applies_spec warm_start_reapplies_only_ephemeral
            restore_after_release restore_after_external_loss restore_all_and_cold_note
            second_replica_restores scope_isolation projection_lifecycle timeout_kills_grandchildren
            exec_basics hostile_snapshot_rejected failed_snapshot_keeps_previous
            failed_manifest_write_leaves_nothing
            bad_state_is_a_typed_error user_managed_sandbox_is_shared panic_and_cancel_still_persist
            bind_mounts_are_not_archived skip_unchanged chunked_incremental_across_replicas retention_and_gc chunked_restore_reuses_live_files
            same_size_rewrites_are_snapshotted hard_links_survive_snapshots);
    };
    (@faults [$fixture:expr] $attrs:tt $($name:ident)*) => {
        $( $crate::conformance_tests!(@fault [$fixture] $attrs $name); )*
    };
    (@fault [$fixture:expr] [$(#[$attr:meta])*] $name:ident) => {
        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        $(#[$attr])*
        async fn $name() {
            let fixture = $fixture;
            $crate::testkit::faults::$name(&fixture).await;
        }
    };
    (@processes [$fixture:expr] $attrs:tt $($name:ident)*) => {
        $( $crate::conformance_tests!(@process [$fixture] $attrs $name); )*
    };
    (@process [$fixture:expr] [$(#[$attr:meta])*] $name:ident) => {
        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        $(#[$attr])*
        async fn $name() {
            let fixture = $fixture;
            $crate::testkit::faults::$name(&fixture, stringify!($name)).await;
        }
    };
    // The attribute list travels as one token tree: expanding `$attr` (one repetition level)
    // inside the repetition over `$name` is refused by macro_rules ("`attr` repeats 0 times,
    // but `name` repeats 17 times"), so each test is expanded by `@one`.
    (@each [$fixture:expr] $attrs:tt $($name:ident)*) => {
        $( $crate::conformance_tests!(@one [$fixture] $attrs $name); )*
    };
    (@one [$fixture:expr] [$(#[$attr:meta])*] $name:ident) => {
        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        $(#[$attr])*
        async fn $name() {
            let fixture = $fixture;
            $crate::testkit::$name(&fixture).await;
        }
    };
}
