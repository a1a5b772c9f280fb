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
