//! Everything a command starts dies with it: eight ways of leaving the command behind
//! (background jobs, daemons, new sessions and process groups), each after a timeout, a normal
//! exit and a cancelled exec.

mod common;

use std::path::Path;
use std::time::{Duration, Instant};

use common::{TestBox, gone_or_zombie, wait_gone};
use futures::future::join_all;
use sandbox_core::ExecRequest;

/// One way of starting a process that outlives the shell: a snippet that starts it and makes
/// it write its own pid to the file named by `$P`.
struct Style {
    name: &'static str,
    /// Whether the process stays in the command's process group (so even a process-group kill
    /// reaches it).
    in_group: bool,
    start: &'static str,
}

/// `sh -c` that records its pid in `$0` (the file `$P`) and becomes `sleep 300`.
macro_rules! escapee {
    () => {
        r#"sh -c 'echo $$ > "$0"; exec sleep 300' "$P""#
    };
}

const STYLES: &[Style] = &[
    Style {
        name: "background",
        in_group: true,
        start: r#"sleep 300 & echo $! > "$P""#,
    },
    Style {
        name: "nohup",
        in_group: true,
        start: concat!("nohup ", escapee!(), " >/dev/null 2>&1 &"),
    },
    Style {
        name: "double-fork",
        in_group: true,
        start: concat!("( ( ", escapee!(), " & ) & )"),
    },
    Style {
        name: "triple-fork",
        in_group: true,
        start: concat!("( ( ( ", escapee!(), " & ) & ) & )"),
    },
    Style {
        name: "setsid",
        in_group: false,
        start: concat!("setsid ", escapee!(), " &"),
    },
    Style {
        name: "setsid-f",
        in_group: false,
        start: concat!("setsid -f ", escapee!()),
    },
    Style {
        name: "python-daemon",
        in_group: false,
        // The classic daemon: fork, setsid, fork again, stdio away from the pipes.
        start: r#"python3 -c '
import os, sys
if os.fork(): os._exit(0)
os.setsid()
if os.fork(): os._exit(0)
null = os.open("/dev/null", os.O_RDWR)
for fd in (0, 1, 2): os.dup2(null, fd)
with open(sys.argv[1], "w") as f: f.write("%d\n" % os.getpid())
os.execvp("sleep", ["sleep", "300"])
' "$P""#,
    },
    Style {
        name: "setpgid",
        in_group: false,
        start: r#"python3 -c '
import os, sys
os.setpgid(0, 0)
with open(sys.argv[1], "w") as f: f.write("%d\n" % os.getpid())
os.execvp("sleep", ["sleep", "300"])
' "$P" &"#,
    },
];

#[derive(Clone, Copy, Debug)]
enum End {
    /// The exec's timeout fires while the shell sleeps.
    Timeout,
    /// The shell exits 0 right after the process started.
    Exit,
    /// The exec future is dropped while the shell sleeps.
    Cancel,
}

/// The shell line of `style`: start the process, wait until it wrote its pid and prove it
/// runs (the `.ready` file: without it the test would pass vacuously), then end as `end` says.
fn script(style: &Style, end: End) -> String {
    let name = style.name;
    let tail = match end {
        End::Exit => "exit 0",
        End::Timeout | End::Cancel => "sleep 300",
    };
    format!(
        "P={name}.pid\n{start}\n\
         while [ ! -s \"$P\" ]; do sleep 0.02; done\n\
         kill -0 \"$(cat \"$P\")\" && echo running > {name}.ready\n\
         {tail}\n",
        start = style.start,
    )
}

/// Whether `file` exists within `within`.
async fn wait_file(file: &Path, within: Duration) -> bool {
    let deadline = Instant::now() + within;
    while !file.exists() {
        if Instant::now() >= deadline {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    true
}

/// Run every style in `b` (concurrently), end each as `end` says, and return the styles whose
/// process survived (after killing those, which this test started).
async fn survivors(b: &TestBox, end: End) -> Vec<&'static str> {
    let root = b.root();
    let runs = STYLES.iter().map(|style| {
        let root = root.clone();
        async move {
            let request = ExecRequest::shell(script(style, end));
            match end {
                End::Exit => {
                    let r = b.sandbox.exec(request.timeout(Duration::from_secs(60))).await;
                    let r = r.unwrap();
                    assert_eq!(r.exit_code, Some(0), "{}: {r:?}", style.name);
                }
                End::Timeout => {
                    let r = b.sandbox.exec(request.timeout(Duration::from_secs(5))).await;
                    let r = r.unwrap();
                    assert!(r.timed_out, "{}: {r:?}", style.name);
                }
                End::Cancel => {
                    let ready = root.join(format!("{}.ready", style.name));
                    let exec = b.sandbox.exec(request.timeout(Duration::from_secs(60)));
                    tokio::select! {
                        r = exec => panic!("{}: ended before the cancellation: {r:?}", style.name),
                        ok = wait_file(&ready, Duration::from_secs(30)) => {
                            assert!(ok, "{}: never got ready", style.name)
                        }
                    }
                    // Leaving the select dropped the exec future: that is the cancellation.
                }
            }
            let ready = std::fs::read_to_string(root.join(format!("{}.ready", style.name)))
                .unwrap_or_default();
            assert_eq!(ready, "running\n", "{}: the process never ran", style.name);
            let pid: i32 = std::fs::read_to_string(root.join(format!("{}.pid", style.name)))
                .unwrap()
                .trim()
                .parse()
                .unwrap();
            let gone = wait_gone(pid, Duration::from_secs(5)).await;
            if !gone {
                // Ours (the command started it): clean up before failing.
                let _ = nix::sys::signal::kill(
                    nix::unistd::Pid::from_raw(pid),
                    nix::sys::signal::Signal::SIGKILL,
                );
                assert!(wait_gone(pid, Duration::from_secs(5)).await);
            }
            (style.name, gone)
        }
    });
    let outcome = join_all(runs).await;
    for (name, gone) in &outcome {
        eprintln!("{end:?} {name}: {}", if *gone { "killed" } else { "SURVIVED" });
    }
    outcome
        .into_iter()
        .filter(|(_, gone)| !gone)
        .map(|(name, _)| name)
        .collect()
}

async fn check(end: End) {
    let b = TestBox::default().await;
    let survived = survivors(&b, end).await;
    assert!(survived.is_empty(), "{end:?}: survived: {survived:?}");
    let _ = gone_or_zombie;
    let _ = STYLES.iter().map(|s| s.in_group);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn everything_dies_on_timeout() {
    check(End::Timeout).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn everything_dies_on_exit() {
    check(End::Exit).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn everything_dies_on_cancel() {
    check(End::Cancel).await;
}
