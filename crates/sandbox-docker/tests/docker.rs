//! Docker-specific behaviour on the real engine (`SANDBOX_TEST_DOCKER=1`, set by
//! `cargo xtask test`).

mod common;

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use bollard::models::ContainerCreateBody;
use bollard::query_parameters::CreateContainerOptionsBuilder;
use common::{BUSYBOX, DEBIAN, Sweep, docker, options, remove};
use sandbox_core::testkit::{Env, read, sh};
use sandbox_core::{
    BoxGcOptions, CallContext, EntryType, Error, ExecRequest, ImportMode, IsolationKey,
    IsolationScope, MemoryStateStore, Persistence, RelPath, Sandbox, SandboxClient, SandboxConfig,
    SandboxManager, StateStore, WorkspaceSpec, state_from_json,
};
use sandbox_docker::{DockerClient, DockerOptions, DockerState, ExtraMount, PullPolicy, labels};

fn key(session: &str) -> IsolationKey {
    IsolationKey::resolve(
        IsolationScope::Session,
        &CallContext::new("docker-tests").session(session),
    )
    .expect("key")
}

fn client(o: DockerOptions) -> (Arc<DockerClient>, Sweep) {
    let sweep = Sweep(o.name_prefix.clone());
    (Arc::new(DockerClient::new(o).expect("client")), sweep)
}

async fn started(client: &DockerClient, spec: WorkspaceSpec, k: Option<&IsolationKey>) -> Sandbox {
    let sb = Sandbox::create(client, SandboxConfig::new(spec), k)
        .await
        .expect("create");
    sb.start().await.expect("start");
    sb
}

/// A foreign container (not made by this library) under `name`.
async fn foreign(name: &str, labels: HashMap<String, String>) {
    let body = ContainerCreateBody {
        image: Some(BUSYBOX.into()),
        cmd: Some(vec!["sleep".into(), "600".into()]),
        labels: Some(labels),
        host_config: Some(bollard::models::HostConfig {
            network_mode: Some("none".into()),
            ..Default::default()
        }),
        ..Default::default()
    };
    docker()
        .create_container(
            Some(CreateContainerOptionsBuilder::default().name(name).build()),
            body,
        )
        .await
        .expect("foreign container");
}

#[tokio::test]
#[cfg_attr(not(docker_tests), ignore = "needs Docker; run by cargo xtask test")]
async fn engine_down_is_unavailable_and_persists_nothing() {
    let env = Env::new();
    let c: Arc<dyn SandboxClient> = Arc::new(
        DockerClient::new(options(BUSYBOX).socket("/nonexistent/docker.sock")).expect("client"),
    );
    let m = env.manager(
        c,
        IsolationScope::Session,
        SandboxConfig::new(WorkspaceSpec::default()),
    );
    let ctx = env.ctx().session("down");
    let err = m
        .call(&ctx, |_| async {})
        .await
        .expect_err("engine is down")
        .error;
    assert!(matches!(err, Error::Unavailable { .. }), "{err}");
    assert!(err.is_retryable());
    let k = IsolationKey::resolve(IsolationScope::Session, &ctx).expect("key");
    assert_eq!(
        env.states.load(&k).await.expect("load"),
        None,
        "nothing persisted"
    );
}

#[tokio::test]
#[cfg_attr(not(docker_tests), ignore = "needs Docker; run by cargo xtask test")]
async fn foreign_container_name_is_a_conflict() {
    // A kept box has the key's name (an ephemeral one a name of its own per call).
    let (c, _sweep) = client(options(BUSYBOX).persistence(Persistence::Keep));
    let k = key("taken");
    let name = c.container_name(&k);
    foreign(&name, HashMap::new()).await;
    let err = c
        .create(sandbox_core::CreateRequest::new(
            &WorkspaceSpec::default(),
            Some(&k),
        ))
        .await
        .expect_err("name taken");
    remove(&docker(), &name).await;
    assert!(matches!(err, Error::Conflict { .. }), "{err}");
}

#[tokio::test]
#[cfg_attr(not(docker_tests), ignore = "needs Docker; run by cargo xtask test")]
async fn gc_removes_only_what_it_owns_and_never_a_box_in_use() {
    let o = options(BUSYBOX).persistence(Persistence::Keep);
    let prefix = o.name_prefix.clone();
    let (c, _sweep) = client(o.clone());
    // Foreign: no labels, and another owner's labels.
    let foreign_plain = format!("{prefix}-foreign-plain");
    let foreign_other = format!("{prefix}-foreign-other");
    foreign(&foreign_plain, HashMap::new()).await;
    foreign(
        &foreign_other,
        [
            (labels::OWNER.to_owned(), "someone-else".to_owned()),
            (labels::EXPIRES_AT.to_owned(), "1".to_owned()),
        ]
        .into(),
    )
    .await;
    let states = Arc::new(MemoryStateStore::new());
    // Ours, stopped, with stored state: kept. Ours, stopped, without state: removed.
    let with_state = key("with-state");
    let orphan = key("orphan");
    for k in [&with_state, &orphan] {
        let sb = started(&c, WorkspaceSpec::default(), Some(k)).await;
        sb.shutdown().await.expect("stop");
    }
    sandbox_core::testkit::seed_state(&*states, &with_state, "{}").await;
    // Ours, expired (max age 0), running, no call on it: removed.
    let (expired_client, _s2) = client(o.clone().max_age(Duration::ZERO));
    let expired = started(
        &expired_client,
        WorkspaceSpec::default(),
        Some(&key("expired")),
    )
    .await;
    // Ours, expired, with a call running in it: never removed.
    let guard = Arc::new(sandbox_core::InProcessGuard::new());
    let busy_manager = SandboxManager::builder(expired_client.clone())
        .state_store(states.clone())
        .guard(guard.clone())
        .build()
        .expect("manager");
    let busy_ctx = CallContext::new("docker-tests").session("busy");
    let busy = busy_manager
        .begin(&busy_ctx, sandbox_core::Acquire::Auto)
        .await
        .expect("a call in progress");
    let gc = SandboxManager::builder(c.clone())
        .state_store(states.clone())
        .guard(guard)
        .build()
        .expect("manager");
    let report = gc
        .gc(BoxGcOptions::default().older_than(Duration::ZERO))
        .await
        .expect("gc");
    let mut removed = report.boxes_removed.clone();
    removed.sort();
    let mut expected = vec![c.container_name(&orphan), c.container_name(&key("expired"))];
    expected.sort();
    assert_eq!(removed, expected, "{report:?}");
    assert_eq!(
        (report.boxes_kept, report.boxes_in_use),
        (1, 1),
        "{report:?}"
    );
    let d = docker();
    for name in [
        &foreign_plain,
        &foreign_other,
        &c.container_name(&with_state),
        &c.container_name(&key("busy")),
    ] {
        assert!(
            d.inspect_container(name, None).await.is_ok(),
            "{name} must survive gc"
        );
    }
    // The call in the box gc left alone still works and finishes.
    sh(busy.sandbox(), "echo still-here > s.txt").await;
    busy.finish().await.expect("finish");
    remove(&d, &foreign_plain).await;
    remove(&d, &foreign_other).await;
    drop(expired);
}

#[tokio::test]
#[cfg_attr(not(docker_tests), ignore = "needs Docker; run by cargo xtask test")]
async fn read_only_bind_mount_is_enforced() {
    let host = tempfile::tempdir().expect("tmp");
    std::fs::write(host.path().join("in.txt"), "from host\n").expect("write");
    let spec = WorkspaceSpec::builder()
        .bind_mount("ro", host.path(), true)
        .build()
        .expect("spec");
    let (c, _sweep) = client(options(BUSYBOX));
    let sb = started(&c, spec, None).await;
    assert_eq!(sh(&sb, "cat ro/in.txt").await, "from host\n");
    let r = sb
        .exec(ExecRequest::shell("echo x > ro/new.txt"))
        .await
        .expect("exec");
    assert!(!r.success(), "writing a read-only mount must fail: {r:?}");
    assert!(!host.path().join("new.txt").exists());
    sb.destroy().await.expect("destroy");
}

#[tokio::test]
#[cfg_attr(not(docker_tests), ignore = "needs Docker; run by cargo xtask test")]
async fn missing_image_errors_name_it() {
    let image = "sandbox-harness-test/does-not-exist:1";
    let (c, _sweep) = client(options(image));
    let err = c.ensure_image().await.expect_err("missing");
    assert!(
        matches!(err, Error::NotFound { ref key, .. } if key == image),
        "{err}"
    );
    // A registry that cannot be reached (loopback, closed port): the error names the image.
    let image = "127.0.0.1:9/sandbox-harness/nope:1";
    let (c, _sweep) = client(options(image).pull_policy(PullPolicy::IfMissing));
    let err = c
        .create(sandbox_core::CreateRequest::new(
            &WorkspaceSpec::default(),
            None,
        ))
        .await
        .expect_err("cannot pull");
    assert!(err.to_string().contains(image), "{err}");
}

#[tokio::test]
#[cfg_attr(not(docker_tests), ignore = "needs Docker; run by cargo xtask test")]
async fn exposed_port_reports_its_host_port() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let (c, _sweep) = client(options(BUSYBOX).network("bridge").expose(8080));
    let sb = started(&c, WorkspaceSpec::default(), None).await;
    let state = sb.state();
    let state = state.downcast::<DockerState>("docker").expect("state");
    let port = state.host_port(8080).expect("8080 is published");
    assert!(port > 0);
    // A one-shot server in the box, reached on loopback through the published port.
    let server =
        sb.exec(ExecRequest::shell("echo pong | nc -l -p 8080").timeout(Duration::from_secs(20)));
    let client = async {
        for _ in 0..100 {
            if let Ok(mut s) = tokio::net::TcpStream::connect(("127.0.0.1", port)).await {
                let _ = s.write_all(b"ping\n").await;
                let mut buf = Vec::new();
                let _ = tokio::time::timeout(Duration::from_secs(5), s.read_to_end(&mut buf)).await;
                if buf.starts_with(b"pong") {
                    return true;
                }
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        false
    };
    let (r, reached) = tokio::join!(server, client);
    assert!(reached, "server output: {:?}", r);
    sb.destroy().await.expect("destroy");
}

#[tokio::test]
#[cfg_attr(not(docker_tests), ignore = "needs Docker; run by cargo xtask test")]
async fn extra_mounts_are_per_session_and_announced() {
    let base = tempfile::tempdir().expect("tmp");
    let o =
        options(BUSYBOX)
            .extra_mount_base(base.path())
            .extra_mounts(|k: Option<&IsolationKey>| {
                let seg = k.map_or_else(|| "anon".to_owned(), IsolationKey::digest);
                vec![
                    ExtraMount::new(format!("sessions/{seg}/files"), "HARNESS_FILES_DIR")
                        .read_only(true),
                    ExtraMount::new(format!("sessions/{seg}/out"), "HARNESS_OUT_DIR"),
                ]
            });
    let (c, _sweep) = client(o);
    let k = key("uploads");
    let files = base.path().join(format!("sessions/{}/files", k.digest()));
    std::fs::create_dir_all(&files).expect("mkdir");
    std::fs::write(files.join("doc.txt"), "uploaded\n").expect("write");
    let sb = started(&c, WorkspaceSpec::default(), Some(&k)).await;
    assert_eq!(
        sh(&sb, "cat \"$HARNESS_FILES_DIR/doc.txt\"").await,
        "uploaded\n"
    );
    assert!(
        !sb.exec(ExecRequest::shell("echo x > \"$HARNESS_FILES_DIR/x\""))
            .await
            .expect("exec")
            .success()
    );
    sh(&sb, "echo result > \"$HARNESS_OUT_DIR/r.txt\"").await;
    let out = base
        .path()
        .join(format!("sessions/{}/out/r.txt", k.digest()));
    assert_eq!(
        std::fs::read_to_string(out).expect("on the host"),
        "result\n"
    );
    sb.destroy().await.expect("destroy");

    // Relative paths cannot climb out of the base.
    let (c, _s) = client(
        options(BUSYBOX)
            .extra_mount_base(base.path())
            .extra_mounts(|_| vec![ExtraMount::new("../escape", "X_DIR")]),
    );
    let err = c
        .create(sandbox_core::CreateRequest::new(
            &WorkspaceSpec::default(),
            None,
        ))
        .await
        .expect_err("escape");
    assert!(matches!(err, Error::PathEscape { .. }), "{err}");
}

async fn list_matches_stat(image: &str) {
    let (c, _sweep) = client(options(image));
    let sb = started(&c, WorkspaceSpec::default(), None).await;
    sh(
        &sb,
        "mkdir -p 'd i r' && printf abc > 'd i r/f' && chmod 640 'd i r/f' && ln -s 'd i r/f' link && touch -d @1700000000 old",
    )
    .await;
    let entries = sb.handle().list().await.expect("list");
    let names: Vec<&str> = entries.iter().map(|e| e.path.as_str()).collect();
    assert_eq!(names, ["d i r", "d i r/f", "link", "old"], "{image}");
    let f = &entries[1];
    assert_eq!(
        (f.kind, f.size, f.mode),
        (EntryType::File, 3, 0o640),
        "{image}"
    );
    assert_eq!(entries[0].kind, EntryType::Dir);
    assert_eq!(entries[2].kind, EntryType::Symlink);
    assert_eq!(entries[2].link_target.as_deref(), Some("d i r/f"));
    assert_eq!(entries[3].mtime_ns, 1_700_000_000_000_000_000, "{image}");
    let secs = sh(&sb, "stat -c %Y 'd i r/f'").await;
    assert_eq!(
        f.mtime_ns / 1_000_000_000,
        secs.trim().parse::<i64>().expect("secs")
    );
    sb.destroy().await.expect("destroy");
}

#[tokio::test]
#[cfg_attr(not(docker_tests), ignore = "needs Docker; run by cargo xtask test")]
async fn list_busybox() {
    list_matches_stat(BUSYBOX).await;
}

#[tokio::test]
#[cfg_attr(not(docker_tests), ignore = "needs Docker; run by cargo xtask test")]
async fn list_debian() {
    list_matches_stat(DEBIAN).await;
}

#[tokio::test]
#[cfg_attr(not(docker_tests), ignore = "needs Docker; run by cargo xtask test")]
async fn timeout_kills_the_tree_on_debian() {
    let (c, _sweep) = client(options(DEBIAN));
    let sb = started(&c, WorkspaceSpec::default(), None).await;
    // A grandchild in its own session and process group, detached from the shell.
    let r = sb
        .exec(
            ExecRequest::shell("echo started; setsid sleep 300 & echo $! > gc.pid; sleep 300")
                .timeout(Duration::from_millis(800)),
        )
        .await
        .expect("exec");
    assert!(r.timed_out && r.exit_code.is_none(), "{r:?}");
    assert_eq!(r.stdout_str(), "started\n");
    let left = sh(&sb, "ps -eo args | grep -c '^sleep 300' || true").await;
    assert_eq!(left.trim(), "0", "no sleeper survives");
    sb.destroy().await.expect("destroy");
}

#[tokio::test]
#[cfg_attr(not(docker_tests), ignore = "needs Docker; run by cargo xtask test")]
async fn writes_never_pass_through_workspace_symlinks() {
    let (c, _sweep) = client(options(BUSYBOX));
    let sb = started(&c, WorkspaceSpec::default(), None).await;
    sh(&sb, "ln -s /etc etc-link && ln -s /etc/passwd pw").await;
    let h = sb.handle();
    let err = h
        .write_file(&RelPath::new("etc-link/pwned").unwrap(), "x".into(), 0o644)
        .await
        .expect_err("through a link");
    assert!(matches!(err, Error::UnsafeArchive { .. }), "{err}");
    let items = vec![(
        RelPath::new("etc-link/pwned2").unwrap(),
        sandbox_core::archive::PackSource::Bytes {
            data: "y".into(),
            mode: 0o644,
        },
    )];
    let err = h
        .import(sandbox_core::archive::pack(items), ImportMode::Merge)
        .await
        .expect_err("through a link");
    assert!(matches!(err, Error::UnsafeArchive { .. }), "{err}");
    // A file written at a link's own path replaces the link, not its target.
    h.write_file(&RelPath::new("pw").unwrap(), "mine\n".into(), 0o600)
        .await
        .expect("replace link");
    assert_eq!(
        sh(
            &sb,
            "ls /etc/pwned /etc/pwned2 2>&1; head -c 5 /etc/passwd; echo; cat pw"
        )
        .await,
        "ls: /etc/pwned: No such file or directory\nls: /etc/pwned2: No such file or directory\nroot:\nmine\n"
    );
    // Removing through a link leaves the target alone.
    h.remove(&[RelPath::new("etc-link/passwd").unwrap()])
        .await
        .expect("remove");
    assert_eq!(sh(&sb, "test -f /etc/passwd && echo kept").await, "kept\n");
    sb.destroy().await.expect("destroy");
}

#[tokio::test]
#[cfg_attr(not(docker_tests), ignore = "needs Docker; run by cargo xtask test")]
async fn failed_replace_leaves_the_workspace_alone() {
    let (c, _sweep) = client(options(BUSYBOX));
    let sb = started(
        &c,
        WorkspaceSpec::builder()
            .file("keep.txt", "live\n")
            .build()
            .unwrap(),
        None,
    )
    .await;
    let good = sandbox_core::archive::pack(vec![(
        RelPath::new("new.txt").unwrap(),
        sandbox_core::archive::PackSource::Bytes {
            data: vec![7u8; 300_000].into(),
            mode: 0o644,
        },
    )]);
    let broken: sandbox_core::stream::ByteStream =
        futures::StreamExt::boxed(futures::StreamExt::chain(
            futures::StreamExt::take(good, 1),
            futures::stream::once(async { Err(Error::backend("test", "stream", "cut off")) }),
        ));
    let err = sb
        .handle()
        .import(broken, ImportMode::Replace { keep: vec![] })
        .await
        .expect_err("broken stream");
    assert!(!matches!(err, Error::NotFound { .. }), "{err}");
    assert_eq!(read(&sb, "keep.txt").await.as_deref(), Some("live\n"));
    assert_eq!(
        sh(&sb, "ls -A").await,
        "keep.txt\n",
        "no staging left behind"
    );
    sb.destroy().await.expect("destroy");
}

#[tokio::test]
#[cfg_attr(not(docker_tests), ignore = "needs Docker; run by cargo xtask test")]
async fn keep_reuses_the_container_and_labels_it() {
    let env = Env::new();
    let (c, _sweep) = client(options(BUSYBOX).persistence(Persistence::Keep));
    let m = env.manager(
        c.clone(),
        IsolationScope::Session,
        SandboxConfig::new(WorkspaceSpec::default()),
    );
    let ctx = env.ctx().session("keep");
    let r1 = m.call(&ctx, |_| async {}).await.expect("call").report;
    let r2 = m.call(&ctx, |_| async {}).await.expect("call").report;
    let id = |r: &sandbox_core::CallReport| {
        state_from_json(r.state_json.as_deref().unwrap())
            .unwrap()
            .downcast::<DockerState>("docker")
            .unwrap()
            .container_id
            .clone()
    };
    assert_eq!(id(&r1), id(&r2), "the same container is warm-started");
    let k = IsolationKey::resolve(IsolationScope::Session, &ctx).unwrap();
    let name = c.container_name(&k);
    let info = docker().inspect_container(&name, None).await.expect("kept");
    assert_eq!(
        info.state.and_then(|s| s.running),
        Some(false),
        "stopped after the call"
    );
    let l = info.config.and_then(|c| c.labels).unwrap_or_default();
    assert_eq!(l.get(labels::OWNER), Some(&c.options().name_prefix));
    assert_eq!(l.get(labels::KEY).map(String::as_str), Some(k.as_str()));
    let created: u64 = l[labels::CREATED_AT].parse().unwrap();
    let expires: u64 = l[labels::EXPIRES_AT].parse().unwrap();
    assert_eq!(expires - created, c.options().max_age.as_secs());
}

/// Whether an exec agent process runs in the box.
async fn agent_running(sb: &Sandbox) -> bool {
    // The probe itself may be served by the agent: look for any process whose command line
    // carries the agent's directory name.
    sh(
        sb,
        "for f in /proc/[0-9]*/cmdline; do tr '\\0' ' ' < \"$f\" 2>/dev/null; echo; done",
    )
    .await
    .contains(".sandbox-agent")
}

#[tokio::test]
#[cfg_attr(not(docker_tests), ignore = "needs Docker; run by cargo xtask test")]
async fn exec_agent_serves_commands_like_engine_execs() {
    for image in [BUSYBOX, DEBIAN] {
        let mut results = Vec::new();
        for agent in [true, false] {
            let (c, _sweep) = client(options(image).exec_agent(agent));
            let sb = started(
                &c,
                WorkspaceSpec::builder().dir("a dir").build().expect("spec"),
                None,
            )
            .await;
            let mut out = Vec::new();
            // Exit codes and separate streams.
            let r = sb
                .exec(ExecRequest::shell("echo out; echo err >&2; exit 7"))
                .await
                .expect("exec");
            out.push(format!(
                "{:?} {:?} {:?}",
                r.exit_code,
                r.stdout_str(),
                r.stderr_str()
            ));
            // Quoting: cwd with a space, env values with quotes and substitutions, argv.
            let r = sb
                .exec(
                    ExecRequest::argv(["sh", "-c", "pwd; printf '%s|%s' \"$A\" \"$B\""])
                        .cwd("a dir")
                        .env("A", "it's")
                        .env("B", "$(echo nope)"),
                )
                .await
                .expect("exec");
            out.push(format!("{:?} {:?}", r.exit_code, r.stdout_str()));
            // Stdin, binary output, caps.
            let r = sb
                .exec(ExecRequest::shell("cat; printf '\\000\\377'").stdin(&b"in\x00put"[..]))
                .await
                .expect("exec");
            out.push(format!("{:?}", r.stdout));
            let r = sb
                .exec(
                    ExecRequest::shell("head -c 5000 /dev/zero; head -c 10 /dev/zero >&2")
                        .limits(sandbox_core::OutputLimits::both(100)),
                )
                .await
                .expect("exec");
            out.push(format!(
                "{} {} {} {}",
                r.stdout.len(),
                r.stdout_truncated,
                r.stderr.len(),
                r.stderr_truncated
            ));
            // Newlines in arguments and values; output larger than the agent keeps in
            // memory-backed files (4 MiB), spilled and read back whole.
            let r = sb
                .exec(
                    ExecRequest::argv([
                        "sh",
                        "-c",
                        "printf '%s|%s|' \"$1\" \"$V\"; head -c 5000000 /dev/zero | tr '\\0' x >&2",
                        "sh",
                        "a\nb",
                    ])
                    .env("V", "c\n'd")
                    .limits(sandbox_core::OutputLimits::both(6 << 20)),
                )
                .await
                .expect("exec");
            let all_x = r.stderr.iter().all(|b| *b == b'x');
            out.push(format!(
                "{:?} {:?} {} {all_x}",
                r.exit_code,
                r.stdout_str(),
                r.stderr.len()
            ));
            // A timeout returns the partial output.
            let r = sb
                .exec(
                    ExecRequest::shell("echo started; sleep 30")
                        .timeout(Duration::from_millis(700)),
                )
                .await
                .expect("exec");
            out.push(format!(
                "{} {:?} {:?}",
                r.timed_out,
                r.exit_code,
                r.stdout_str()
            ));
            // Concurrent commands all complete (one through the agent, the rest through the
            // engine).
            let runs = (0..3).map(|i| sb.exec(ExecRequest::shell(format!("sleep 0.3; echo {i}"))));
            let outs: Vec<String> = futures::future::join_all(runs)
                .await
                .into_iter()
                .map(|r| r.expect("exec").stdout_str().into_owned())
                .collect();
            out.push(outs.join(""));
            assert_eq!(agent_running(&sb).await, agent, "{image}: agent {agent}");
            results.push(out);
            sb.destroy().await.expect("destroy");
        }
        assert_eq!(
            results[0], results[1],
            "{image}: the agent behaves like engine execs"
        );
        assert_eq!(results[0][0], "Some(7) \"out\\n\" \"err\\n\"");
        assert_eq!(
            results[0][1],
            "Some(0) \"/workspace/a dir\\nit's|$(echo nope)\""
        );
        assert_eq!(results[0][3], "100 true 10 false");
        assert_eq!(results[0][4], "Some(0) \"a\\nb|c\\n'd|\" 5000000 true");
        assert_eq!(results[0][5], "true None \"started\\n\"");
        assert_eq!(results[0][6], "0\n1\n2\n");
    }
}

#[tokio::test]
#[cfg_attr(not(docker_tests), ignore = "needs Docker; run by cargo xtask test")]
async fn exec_agent_survives_container_restarts() {
    let (c, _sweep) = client(options(BUSYBOX).persistence(Persistence::Keep));
    let k = key("agent-restart");
    let sb = started(&c, WorkspaceSpec::default(), Some(&k)).await;
    assert_eq!(sh(&sb, "echo one").await, "one\n");
    sb.shutdown().await.expect("stop");
    let state = sb.state();
    let again = Sandbox::resume(
        &*c,
        SandboxConfig::new(WorkspaceSpec::default()),
        &*state,
        Some(&k),
    )
    .await
    .expect("resume");
    again.start().await.expect("start");
    assert_eq!(sh(&again, "echo two").await, "two\n");
    assert!(agent_running(&again).await);
    again.destroy().await.expect("destroy");
}
