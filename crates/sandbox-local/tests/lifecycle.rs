//! Box lifecycle: names, ownership, state JSON, release/destroy/delete, resume, and the whole
//! call lifecycle of core's manager on top of this backend.

mod common;

use std::fs;
use std::path::Path;
use std::sync::Arc;

use common::{local_state, rel};
use sandbox_core::{
    CallContext, CreateRequest, Error, ExecRequest, ImportMode, IsolationKey, IsolationScope,
    Persistence, SandboxClient, SandboxConfig, SandboxManager, SnapshotSpec, StartBranch,
    WorkspaceSpec, known_state_tags, state_from_json, state_to_json,
};
use sandbox_local::{LocalClient, LocalOptions, LocalState};

fn client(base: &Path, persistence: Persistence) -> LocalClient {
    LocalClient::new(
        LocalOptions::default()
            .base_dir(base)
            .persistence(persistence),
    )
}

fn key(session: &str) -> IsolationKey {
    IsolationKey::resolve(
        IsolationScope::Session,
        &CallContext::new("agent").session(session),
    )
    .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn backend_and_capabilities() {
    let c = LocalClient::new(LocalOptions::default());
    assert_eq!(c.backend(), "local");
    let caps = c.capabilities();
    assert!(caps.keep && caps.bind_mounts);
    // Confined by default.
    assert!(caps.read_only_bind_mounts && caps.isolated && caps.exec.tree_kill);
    let host =
        LocalClient::new(LocalOptions::default().isolation(sandbox_local::Isolation::HostShell));
    let caps = host.capabilities();
    assert!(!caps.read_only_bind_mounts && !caps.isolated);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn state_json_round_trips_and_the_tag_is_registered() {
    assert!(
        known_state_tags().iter().any(|t| t == "local"),
        "{:?}",
        known_state_tags()
    );
    let dir = tempfile::tempdir().unwrap();
    let c = client(dir.path(), Persistence::Keep);
    let spec = WorkspaceSpec::default();
    let k = key("s1");
    let h = c.create(CreateRequest::new(&spec, Some(&k))).await.unwrap();
    let json = state_to_json(&*h.state()).unwrap();
    assert!(json.contains(r#""type":"local""#), "{json}");
    let back = state_from_json(&json).unwrap();
    assert_eq!(state_to_json(&*back).unwrap(), json);
    let st = back.downcast::<LocalState>("local").unwrap();
    assert_eq!(st, &local_state(&*h));
    assert_eq!(st.persistence, Persistence::Keep);
    assert_eq!(st.key.as_deref(), Some(k.as_str()));
    assert_eq!(st.common.workspace_root, h.workspace_root());
    // Canonical, absolute, `<base>/k-<digest>/workspace`.
    let base = fs::canonicalize(dir.path()).unwrap();
    assert_eq!(st.box_dir, base.join(format!("k-{}", k.digest())));
    assert_eq!(Path::new(h.workspace_root()), st.box_dir.join("workspace"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn boot_makes_the_box_dir_and_marker_but_not_the_workspace() {
    let dir = tempfile::tempdir().unwrap();
    let c = client(dir.path(), Persistence::Ephemeral);
    let h = c
        .create(CreateRequest::new(&WorkspaceSpec::default(), None))
        .await
        .unwrap();
    let box_dir = local_state(&*h).box_dir;
    assert!(
        !box_dir.exists(),
        "create must not touch the disk beyond the base dir"
    );
    h.boot().await.unwrap();
    h.boot().await.unwrap();
    let marker: serde_json::Value =
        serde_json::from_slice(&fs::read(box_dir.join(".sandbox-box.json")).unwrap()).unwrap();
    assert_eq!(marker["backend"], "local");
    assert!(!h.workspace_exists().await.unwrap());
    assert!(
        box_dir
            .file_name()
            .unwrap()
            .to_str()
            .unwrap()
            .starts_with("b-")
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn same_key_finds_the_same_box_and_foreign_dirs_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let c = client(dir.path(), Persistence::Keep);
    let spec = WorkspaceSpec::default();
    let k = key("s1");
    let h1 = c.create(CreateRequest::new(&spec, Some(&k))).await.unwrap();
    h1.boot().await.unwrap();
    h1.import(common::tar_of(&[("f", b"1")]), ImportMode::Merge)
        .await
        .unwrap();
    h1.release().await.unwrap();
    let h2 = c.create(CreateRequest::new(&spec, Some(&k))).await.unwrap();
    assert_eq!(h1.workspace_root(), h2.workspace_root());
    assert_eq!(&h2.read_file(&rel("f")).await.unwrap()[..], b"1");

    // A directory of that name that is not ours: refused, untouched.
    let k2 = key("s2");
    let foreign = fs::canonicalize(dir.path())
        .unwrap()
        .join(format!("k-{}", k2.digest()));
    fs::create_dir_all(&foreign).unwrap();
    fs::write(foreign.join("someone-elses.txt"), "data").unwrap();
    let err = c
        .create(CreateRequest::new(&spec, Some(&k2)))
        .await
        .unwrap_err();
    assert!(matches!(err, Error::Conflict { .. }), "{err}");
    assert!(foreign.join("someone-elses.txt").exists());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keep_release_keeps_and_ephemeral_release_removes() {
    for (persistence, survives) in [(Persistence::Keep, true), (Persistence::Ephemeral, false)] {
        let dir = tempfile::tempdir().unwrap();
        let c = client(dir.path(), persistence);
        let h = c
            .create(CreateRequest::new(
                &WorkspaceSpec::default(),
                Some(&key("s")),
            ))
            .await
            .unwrap();
        h.boot().await.unwrap();
        h.import(
            common::tar_of(&[("f", b"1")]),
            ImportMode::Replace { keep: vec![] },
        )
        .await
        .unwrap();
        let box_dir = local_state(&*h).box_dir;
        h.release().await.unwrap();
        assert_eq!(box_dir.exists(), survives, "{persistence:?}");
        assert_eq!(h.workspace_exists().await.unwrap(), survives);
        // destroy removes whatever the persistence, and is idempotent.
        h.destroy().await.unwrap();
        assert!(!box_dir.exists());
        h.destroy().await.unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn resume_after_the_box_dir_was_deleted_boots_without_a_workspace() {
    let dir = tempfile::tempdir().unwrap();
    let c = client(dir.path(), Persistence::Keep);
    let spec = WorkspaceSpec::default();
    let h = c
        .create(CreateRequest::new(&spec, Some(&key("s"))))
        .await
        .unwrap();
    h.boot().await.unwrap();
    h.import(
        common::tar_of(&[("f", b"1")]),
        ImportMode::Replace { keep: vec![] },
    )
    .await
    .unwrap();
    let state = h.state();
    let box_dir = local_state(&*h).box_dir;
    fs::remove_dir_all(&box_dir).unwrap();

    let json = state_to_json(&*state).unwrap();
    let state = state_from_json(&json).unwrap();
    let resumed = c.resume(&*state, &spec).await.unwrap();
    assert_eq!(resumed.workspace_root(), h.workspace_root());
    resumed.boot().await.unwrap();
    assert!(box_dir.join(".sandbox-box.json").exists());
    assert!(!resumed.workspace_exists().await.unwrap());
    // The recreated box carries the key, so the key still finds it.
    c.create(CreateRequest::new(&spec, Some(&key("s"))))
        .await
        .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn delete_removes_the_box_and_tampered_states_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let c = client(dir.path(), Persistence::Keep);
    let spec = WorkspaceSpec::default();
    let h = c.create(CreateRequest::new(&spec, None)).await.unwrap();
    h.boot().await.unwrap();
    let state = h.state();
    let box_dir = local_state(&*h).box_dir;
    c.delete(&*state).await.unwrap();
    assert!(!box_dir.exists());
    c.delete(&*state).await.unwrap();

    // A state pointing elsewhere (not a box under the base dir) must never be deleted.
    let victim = tempfile::tempdir().unwrap();
    fs::write(victim.path().join("important"), "x").unwrap();
    let mut value: serde_json::Value =
        serde_json::from_str(&state_to_json(&*state).unwrap()).unwrap();
    for forged in [
        victim.path().display().to_string(),
        format!(
            "{}/b-67e55044-10b1-426f-9247-bb680e5fe0c8",
            victim.path().display()
        ),
    ] {
        value["box_dir"] = forged.clone().into();
        let forged_state = state_from_json(&value.to_string()).unwrap();
        let err = c.delete(&*forged_state).await.unwrap_err();
        assert!(matches!(err, Error::InvalidInput { .. }), "{forged}: {err}");
        let err = c.resume(&*forged_state, &spec).await.unwrap_err();
        assert!(matches!(err, Error::InvalidInput { .. }), "{forged}: {err}");
    }
    assert!(victim.path().join("important").exists());

    // A box-named directory under the base dir that lacks our marker is not deleted either.
    fs::create_dir_all(&box_dir).unwrap();
    fs::write(box_dir.join("not-ours"), "x").unwrap();
    let err = c.delete(&*state).await.unwrap_err();
    assert!(matches!(err, Error::Conflict { .. }), "{err}");
    assert!(box_dir.join("not-ours").exists());
}

async fn run_call(manager: &SandboxManager, line: &str) -> (StartBranch, String) {
    let ctx = CallContext::new("agent").session("s1");
    let line = line.to_owned();
    let called = manager
        .call(&ctx, |sandbox| async move {
            sandbox.exec(ExecRequest::shell(line)).await.unwrap()
        })
        .await
        .unwrap();
    (
        called.report.start.unwrap().branch,
        called.value.stdout_str().into_owned(),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn manager_calls_restore_ephemeral_boxes_and_warm_start_kept_ones() {
    for (persistence, second) in [
        (Persistence::Ephemeral, StartBranch::RestoreEphemeral),
        (Persistence::Keep, StartBranch::Warm),
    ] {
        let dir = tempfile::tempdir().unwrap();
        let spec = WorkspaceSpec::builder()
            .file("README.md", "read me\n")
            .build()
            .unwrap();
        let config = SandboxConfig::new(spec)
            .snapshots(SnapshotSpec::local_dir(dir.path().join("snapshots")));
        let manager =
            SandboxManager::builder(Arc::new(client(&dir.path().join("boxes"), persistence)))
                .config(config)
                .build()
                .unwrap();
        let (branch, out) = run_call(&manager, "echo v1 > data.txt; cat README.md").await;
        assert_eq!(branch, StartBranch::Cold);
        assert_eq!(out, "read me\n");
        let boxes = fs::read_dir(dir.path().join("boxes")).unwrap().count();
        assert_eq!(boxes, usize::from(persistence == Persistence::Keep));

        let (branch, out) = run_call(&manager, "cat data.txt README.md").await;
        assert_eq!(branch, second, "{persistence:?}");
        assert_eq!(out, "v1\nread me\n");
    }
}

/// Replicas with box directories of their own (as on their own hosts) continue each other's
/// ephemeral boxes from snapshots, and either can delete the key.
#[tokio::test]
async fn ephemeral_states_move_between_hosts() {
    use sandbox_core::{
        CallContext, FileStateStore, IsolationScope, SandboxConfig, SandboxManager,
    };
    let dir = tempfile::tempdir().unwrap();
    let replica = |host: &str| {
        SandboxManager::builder(Arc::new(LocalClient::new(
            LocalOptions::default()
                .base_dir(dir.path().join(host))
                .persistence(Persistence::Ephemeral),
        )))
        .state_store(Arc::new(FileStateStore::new(dir.path().join("states"))))
        .scope(IsolationScope::User)
        .config(
            SandboxConfig::new(sandbox_core::WorkspaceSpec::default()).snapshots(
                sandbox_core::SnapshotSpec::local_dir(dir.path().join("snapshots")),
            ),
        )
        .build()
        .unwrap()
    };
    let (a, b) = (replica("host-a"), replica("host-b"));
    let ctx = CallContext::new("hosts").user("u");
    a.call(&ctx, |sb| async move {
        sb.handle()
            .write_file(&rel("f.txt"), "from a\n".into(), 0o644)
            .await
            .unwrap();
    })
    .await
    .unwrap();
    let seen = b
        .call(&ctx, |sb| async move {
            String::from_utf8(sb.handle().read_file(&rel("f.txt")).await.unwrap().to_vec()).unwrap()
        })
        .await
        .unwrap()
        .value;
    assert_eq!(seen, "from a\n");
    // The stored state names host b's box; host a deletes the key all the same.
    let report = a.delete(&ctx).await.unwrap();
    assert!(report.state && report.snapshots >= 1, "{report:?}");
}

/// `require_isolation` refuses the host shell by name and accepts the confined default.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn require_isolation_refuses_the_host_shell() {
    let host: Arc<dyn SandboxClient> = Arc::new(LocalClient::new(
        LocalOptions::default().isolation(sandbox_local::Isolation::HostShell),
    ));
    let Err(err) = sandbox_core::SandboxManager::builder(host)
        .require_isolation()
        .build()
    else {
        panic!("the host shell must be refused");
    };
    assert!(
        matches!(
            err,
            sandbox_core::Error::IsolationUnavailable {
                backend: "local",
                ..
            }
        ),
        "{err}"
    );
    let confined: Arc<dyn SandboxClient> = Arc::new(LocalClient::new(LocalOptions::default()));
    sandbox_core::SandboxManager::builder(confined)
        .require_isolation()
        .build()
        .unwrap();
}

/// The client says what a box gets.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn probe_reports_the_achieved_isolation() {
    let report = LocalClient::new(LocalOptions::default())
        .probe()
        .await
        .unwrap()
        .expect("confined by default");
    eprintln!("{report}");
    assert_eq!(report.namespaces.len(), 7, "{report}");
    assert!(report.seccomp && report.no_new_privs && report.capabilities_dropped);
    assert!(
        report.landlock_abi > 0 && report.landlock == "fully enforced",
        "{report}"
    );
    let none =
        LocalClient::new(LocalOptions::default().isolation(sandbox_local::Isolation::HostShell))
            .probe()
            .await
            .unwrap();
    assert!(none.is_none());
}

/// The stop after a one-file change reads one file, also right after files were written in
/// the previous stop's clock tick (core's kit scenario, on this backend's nanosecond mtimes).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_one_file_change_rehashes_one_file() {
    let fx = sandbox_local::testkit::LocalFixture::new();
    sandbox_core::testkit::one_change_rehashes_one_file(&fx).await;
}

/// Files written in the very tick of a stop's listing are settled by that stop, so the next
/// stop after a one-file change reads that file only (without settling it read all 21).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn files_written_in_the_listing_tick_are_settled_and_not_read_again() {
    let base = tempfile::tempdir().unwrap();
    let client = client(base.path(), Persistence::Keep);
    let store = tempfile::tempdir().unwrap();
    let config = SandboxConfig::new(WorkspaceSpec::default())
        .snapshots(SnapshotSpec::local_dir(store.path()));
    let sandbox = sandbox_core::Sandbox::create(&client, config, Some(&key("settle")))
        .await
        .unwrap();
    sandbox.start().await.unwrap();
    let root = Path::new(sandbox.handle().workspace_root()).to_path_buf();
    let write_all = |tag: &str| {
        for i in 0..20 {
            fs::write(root.join(format!("f{i:02}")), format!("{tag}-{i:02}\n")).unwrap();
        }
    };
    write_all("one");
    // Right after the writes: the files written within the racy window of this listing (all
    // of them on an idle machine; fewer when the writes themselves took longer) are settled.
    let first = sandbox.stop().await.unwrap();
    assert_eq!(first.files_hashed, 20, "{first:?}");
    assert!(
        (1..=20).contains(&first.files_settled),
        "no racy file was settled: {first:?}"
    );
    fs::write(root.join("f07"), "ONE-07\n").unwrap();
    let second = sandbox.stop().await.unwrap();
    assert!(!second.unchanged, "{second:?}");
    assert_eq!(second.files_hashed, 1, "{second:?}");
    // Every file rewritten: all of them read again.
    write_all("two");
    let third = sandbox.stop().await.unwrap();
    assert_eq!(third.files_hashed, 20, "{third:?}");
    let fourth = sandbox.stop().await.unwrap();
    assert!(fourth.unchanged && fourth.files_hashed == 0, "{fourth:?}");
    sandbox.destroy().await.unwrap();
}
