//! Lifecycle faults specific to the Docker backend (`SANDBOX_TEST_DOCKER=1`, set by
//! `cargo xtask test`): commands of cancelled calls, and host data behind mounts.

mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use common::{BUSYBOX, DEBIAN, Sweep, options};
use sandbox_core::testkit::{Env, sh};
use sandbox_core::{
    BoxGcOptions, CallContext, Error, ExecRequest, IsolationKey, IsolationScope, Persistence,
    Sandbox, SandboxConfig, SandboxManager, SnapshotSpec, StateStore, WorkspaceSpec,
    state_from_json,
};
use sandbox_docker::{DockerClient, DockerOptions, ExtraMount};

fn client(o: DockerOptions) -> (Arc<DockerClient>, Sweep) {
    let sweep = Sweep(o.name_prefix.clone());
    (Arc::new(DockerClient::new(o).expect("client")), sweep)
}

async fn started(client: &DockerClient) -> Sandbox {
    let sb = Sandbox::create(client, SandboxConfig::new(WorkspaceSpec::default()), None)
        .await
        .expect("create");
    sb.start().await.expect("start");
    sb
}

/// Whether any of the pids listed in `files` (in the workspace) still runs in the box.
async fn alive(sb: &Sandbox, files: &str) -> String {
    sh(
        sb,
        &format!(
            "for f in {files}; do p=$(cat $f 2>/dev/null) || continue; \
             [ -d /proc/$p ] && ! grep -q '^State:.*Z' /proc/$p/status && echo \"$f $p\"; done; true"
        ),
    )
    .await
}

async fn gone_within(sb: &Sandbox, files: &str, within: Duration) -> bool {
    let deadline = Instant::now() + within;
    loop {
        if alive(sb, files).await.trim().is_empty() {
            return true;
        }
        if Instant::now() > deadline {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

#[tokio::test]
#[cfg_attr(not(docker_tests), ignore = "needs Docker; run by cargo xtask test")]
async fn a_dropped_exec_kills_its_process_tree() {
    for (image, agent) in [(BUSYBOX, true), (DEBIAN, false)] {
        let (c, _sweep) = client(options(image).exec_agent(agent));
        let sb = started(&c).await;
        let long = sb.exec(
            ExecRequest::shell("sleep 300 & echo $! > bg.pid; echo $$ > main.pid; wait")
                .timeout(Duration::from_secs(600)),
        );
        // The caller gives up (a cancelled call): the future is dropped mid-command.
        assert!(
            tokio::time::timeout(Duration::from_secs(3), long)
                .await
                .is_err()
        );
        // It ran: both pids were written (whether the kill already came or not).
        assert_eq!(
            sh(&sb, "cat main.pid bg.pid | wc -l").await.trim(),
            "2",
            "the command ran"
        );
        assert!(
            gone_within(&sb, "main.pid bg.pid", Duration::from_secs(20)).await,
            "{image} (agent: {agent}): a dropped exec left {}",
            alive(&sb, "main.pid bg.pid").await
        );
        // What a finished command leaves behind dies too.
        sh(
            &sb,
            "nohup sleep 300 > /dev/null 2>&1 & echo $! > left.pid; \
             setsid sleep 300 > /dev/null 2>&1 < /dev/null & echo $! > sid.pid",
        )
        .await;
        assert!(
            gone_within(&sb, "left.pid sid.pid", Duration::from_secs(20)).await,
            "{image} (agent: {agent}): a finished command left {}",
            alive(&sb, "left.pid sid.pid").await
        );
        sb.destroy().await.expect("destroy");
    }
}

/// A canary tree on the host.
fn canary(dir: &std::path::Path) -> std::path::PathBuf {
    std::fs::create_dir_all(dir.join("sub")).expect("canary");
    std::fs::write(dir.join("keep.txt"), "host data\n").expect("canary");
    std::fs::write(dir.join("sub/deep.txt"), "deep\n").expect("canary");
    dir.to_path_buf()
}

fn canary_intact(dir: &std::path::Path, when: &str) {
    assert_eq!(
        std::fs::read_to_string(dir.join("keep.txt")).unwrap_or_default(),
        "host data\n",
        "{when}: {}",
        dir.display()
    );
    assert_eq!(
        std::fs::read_to_string(dir.join("sub/deep.txt")).unwrap_or_default(),
        "deep\n",
        "{when}: {}",
        dir.display()
    );
}

#[tokio::test]
#[cfg_attr(not(docker_tests), ignore = "needs Docker; run by cargo xtask test")]
async fn an_extra_mount_inside_the_workspace_is_refused() {
    let host = tempfile::tempdir().expect("tmp");
    let inside = canary(&host.path().join("inside"));
    for target in ["/workspace/data", "/workspace", "/"] {
        let t = target.to_owned();
        let i = inside.clone();
        let (c, _sweep) = client(
            options(BUSYBOX)
                .extra_mounts(move |_| vec![ExtraMount::new(&i, "INSIDE").target(t.clone())]),
        );
        let err = Sandbox::create(&*c, SandboxConfig::new(WorkspaceSpec::default()), None)
            .await
            .expect_err("refused");
        assert!(matches!(err, Error::InvalidInput { .. }), "{target}: {err}");
    }
    canary_intact(&inside, "after the refusals");
}

#[tokio::test]
#[cfg_attr(not(docker_tests), ignore = "needs Docker; run by cargo xtask test")]
async fn host_data_behind_mounts_survives_replace_restore_destroy_and_gc() {
    let host = tempfile::tempdir().expect("tmp");
    // Inside the workspace, the supported way: a bind-mount entry of the spec.
    let inside = canary(&host.path().join("inside"));
    // Beside the workspace: a per-session extra mount.
    let beside = canary(&host.path().join("beside"));
    let b = beside.clone();
    let (c, _sweep) = client(
        options(BUSYBOX)
            .persistence(Persistence::Ephemeral)
            .extra_mounts(move |_| vec![ExtraMount::new(&b, "BESIDE").target("/mnt/beside")]),
    );
    let env = Env::new();
    let spec = WorkspaceSpec::builder()
        .file("a.txt", "a\n")
        .bind_mount("data", &inside, false)
        .build()
        .expect("spec");
    let m = SandboxManager::builder(c.clone())
        .state_store(env.states.clone())
        .config(SandboxConfig::new(spec).snapshots(SnapshotSpec::new(env.snapshots.clone())))
        .build()
        .expect("manager");
    let ctx = CallContext::new("docker-canary").session("s");
    let key = IsolationKey::resolve(IsolationScope::Session, &ctx).expect("key");
    m.call(&ctx, |sb| async move {
        assert_eq!(
            sh(&sb, "cat data/keep.txt /mnt/beside/keep.txt").await,
            "host data\nhost data\n"
        );
        sh(&sb, "echo mine > b.txt").await;
    })
    .await
    .expect("call");
    canary_intact(&inside, "after a call");
    canary_intact(&beside, "after a call");
    // Restore (a Replace import) into a new container: twice, once after losing the box.
    for round in 0..2 {
        let r = m
            .call(&ctx, |sb| async move {
                sh(&sb, "cat b.txt data/keep.txt").await
            })
            .await
            .expect("restore");
        assert_eq!(r.value, "mine\nhost data\n", "round {round}");
        canary_intact(&inside, "after a restore");
        canary_intact(&beside, "after a restore");
    }
    // A failed restore (a tampered snapshot) empties nothing of the host's.
    let stored = env.states.load(&key).await.expect("load").expect("state");
    assert!(
        state_from_json(&stored)
            .expect("state")
            .common()
            .snapshot
            .is_some()
    );
    // Every archive (tar format) and pack (chunked, the default) replaced.
    for blob in sandbox_core::snapshot::SnapshotStoreExt::list_all(&*env.snapshots, "")
        .await
        .expect("list")
    {
        if blob.key.as_str().ends_with(".tar") || blob.key.as_str().starts_with("packs/") {
            sandbox_core::snapshot::SnapshotStoreExt::put_bytes(
                &*env.snapshots,
                &blob.key,
                "garbage".into(),
            )
            .await
            .expect("tamper");
        }
    }
    let err = m.call(&ctx, |_| async {}).await.expect_err("tampered");
    assert!(
        matches!(err.error, Error::RestoreIncomplete { .. }),
        "{}",
        err.error
    );
    canary_intact(&inside, "after a failed restore");
    canary_intact(&beside, "after a failed restore");
    // Destroy and gc.
    m.delete(&ctx).await.expect("delete");
    m.gc(BoxGcOptions::default().older_than(Duration::ZERO))
        .await
        .expect("gc");
    canary_intact(&inside, "after delete and gc");
    canary_intact(&beside, "after delete and gc");
}
