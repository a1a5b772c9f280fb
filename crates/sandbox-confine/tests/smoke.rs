//! A box starts, runs a command and reports how it ended.

use std::io::Read as _;
use std::os::fd::OwnedFd;

use sandbox_confine::{Bind, ConfineOptions, Confined, ExecSpec};

fn read_all(fd: OwnedFd) -> String {
    let mut s = String::new();
    std::fs::File::from(fd).read_to_string(&mut s).unwrap();
    s
}

#[test]
fn a_command_runs_inside_and_reports_its_exit() {
    let dir = tempfile::tempdir().unwrap();
    let ws = dir.path().join("ws");
    std::fs::create_dir(&ws).unwrap();
    let b = Confined::start(&ConfineOptions::default(), &[Bind::same(&ws, false)])
        .unwrap_or_else(|e| panic!("start: {e}"));
    eprintln!("report: {}", b.report());
    let spawned = b
        .spawn(&ExecSpec::new(
            vec![
                "sh".into(),
                "-c".into(),
                "echo hi > out; cat out; id -u; echo $$; hostname; exit 3".into(),
            ],
            vec!["PATH=/usr/bin:/bin".into()],
            &ws,
        ))
        .unwrap();
    let out = read_all(spawned.stdout);
    let err = read_all(spawned.stderr);
    let status = sandbox_confine::read_status(&spawned.control).unwrap();
    eprintln!("out={out:?} err={err:?} status={status:?}");
    assert_eq!(status.code, Some(3), "{err}");
    assert_eq!(out, "hi\n0\n2\nsandbox\n");
    assert_eq!(std::fs::read_to_string(ws.join("out")).unwrap(), "hi\n");
}

fn run(
    b: &Confined,
    ws: &std::path::Path,
    script: &str,
) -> (String, String, sandbox_confine::ExecStatus) {
    let spawned = b
        .spawn(&ExecSpec::new(
            vec!["sh".into(), "-c".into(), script.into()],
            vec!["PATH=/usr/bin:/bin".into()],
            ws,
        ))
        .unwrap();
    let out = read_all(spawned.stdout);
    let err = read_all(spawned.stderr);
    let status = sandbox_confine::read_status(&spawned.control).unwrap();
    (out, err, status)
}

fn start(options: ConfineOptions) -> (tempfile::TempDir, Confined) {
    let dir = tempfile::tempdir().unwrap();
    let b = Confined::start(&options, &[Bind::same(dir.path(), false)])
        .unwrap_or_else(|e| panic!("start: {e}"));
    (dir, b)
}

/// The filter, not the missing capabilities, is what refuses a new user namespace: without
/// it the same command succeeds.
#[test]
fn the_seccomp_filter_refuses_a_new_user_namespace() {
    let (dir, without) = start(ConfineOptions::default().seccomp(sandbox_confine::Need::Off));
    let (_, err, st) = run(&without, dir.path(), "unshare -U true");
    assert_eq!(st.code, Some(0), "without seccomp: {err}");
    let (dir, with) = start(ConfineOptions::default());
    let (_, err, st) = run(&with, dir.path(), "unshare -U true");
    assert_ne!(st.code, Some(0), "with seccomp");
    assert!(err.contains("Operation not permitted"), "{err}");
    assert!(with.report().seccomp);
}

const FORKS: &str = r#"python3 -c '
import os, time
n = 0
for i in range(200):
    try:
        pid = os.fork()
    except OSError:
        break
    if pid == 0:
        time.sleep(3)
        os._exit(0)
    n += 1
print(n)
'"#;

#[test]
fn a_fork_bomb_stops_at_the_pids_limit() {
    let (dir, b) =
        start(ConfineOptions::default().limits(sandbox_confine::Limits::default().pids(32)));
    eprintln!("{}", b.report());
    let (out, err, _) = run(&b, dir.path(), FORKS);
    let n: usize = out.trim().parse().unwrap_or_else(|_| panic!("{out} {err}"));
    assert!(n < 32, "{n} forks");
    // Without the limit the same loop makes all 200.
    let (dir, free) = start(ConfineOptions::default().limits(sandbox_confine::Limits::none()));
    let (out, _, _) = run(&free, dir.path(), FORKS);
    assert_eq!(out.trim(), "200");
}

#[test]
fn a_memory_hog_dies_at_the_memory_limit() {
    let (dir, b) = start(
        ConfineOptions::default().limits(sandbox_confine::Limits::default().memory(64 << 20)),
    );
    eprintln!("{}", b.report());
    let (out, err, st) = run(
        &b,
        dir.path(),
        "python3 -c 'b = bytearray(256 << 20); b[::4096] = b\"x\" * len(b[::4096]); print(\"allocated\")'",
    );
    assert!(!out.contains("allocated"), "{out} {err} {st:?}");
    assert_ne!(st.code, Some(0));
}
