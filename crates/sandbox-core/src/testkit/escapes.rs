//! Eight ways for a command to leave a process behind, and a driver that checks each one is
//! killed when the command times out, exits or is cancelled.
//!
//! The host needs `sh`, `sleep`, `nohup`, `setsid` (util-linux) and `python3`. Each escaped
//! process writes its own pid; the shell proves it runs (`kill -0`) before it ends, so a check
//! cannot pass because nothing was started.

use std::future::Future;
use std::path::Path;
use std::time::{Duration, Instant};

use futures::future::join_all;

use crate::error::Result;
use crate::exec::ExecResult;

/// One way of starting a process that outlives the shell.
#[derive(Clone, Copy, Debug)]
pub struct Escape {
    /// Short name, also the stem of the files the command writes.
    pub name: &'static str,
    /// Whether the process leaves the command's process group (a process-group kill misses
    /// it).
    pub leaves_group: bool,
    /// A shell snippet that starts the process, which writes its pid to the file `$P`.
    pub start: &'static str,
}

/// `sh -c` that records its pid in `$0` (the file `$P`) and becomes `sleep 300`.
macro_rules! escapee {
    () => {
        r#"sh -c 'echo $$ > "$0"; exec sleep 300' "$P""#
    };
}

/// The eight escapes: four stay in the process group, four leave it.
pub const ESCAPES: &[Escape] = &[
    Escape {
        name: "background",
        leaves_group: false,
        start: r#"sleep 300 & echo $! > "$P""#,
    },
    Escape {
        name: "nohup",
        leaves_group: false,
        start: concat!("nohup ", escapee!(), " >/dev/null 2>&1 &"),
    },
    Escape {
        name: "double-fork",
        leaves_group: false,
        start: concat!("( ( ", escapee!(), " & ) & )"),
    },
    Escape {
        name: "triple-fork",
        leaves_group: false,
        start: concat!("( ( ( ", escapee!(), " & ) & ) & )"),
    },
    Escape {
        name: "setsid",
        leaves_group: true,
        start: concat!("setsid ", escapee!(), " &"),
    },
    Escape {
        name: "setsid-f",
        leaves_group: true,
        start: concat!("setsid -f ", escapee!()),
    },
    Escape {
        name: "python-daemon",
        leaves_group: true,
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
    Escape {
        name: "setpgid",
        leaves_group: true,
        start: r#"python3 -c '
import os, sys
os.setpgid(0, 0)
with open(sys.argv[1], "w") as f: f.write("%d\n" % os.getpid())
os.execvp("sleep", ["sleep", "300"])
' "$P" &"#,
    },
];

/// How the command ends.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum End {
    /// Its timeout fires while the shell sleeps.
    Timeout,
    /// The shell exits 0 once the process runs.
    Exit,
    /// The exec future is dropped while the shell sleeps.
    Cancel,
}

/// The shell line for `escape`: start the process, wait until it wrote its pid, prove it runs
/// (the file `<name>.ready`), then end as `end` says. Files go to the working directory.
pub fn script(escape: &Escape, end: End) -> String {
    let name = escape.name;
    let tail = match end {
        End::Exit => "exit 0",
        End::Timeout | End::Cancel => "sleep 300",
    };
    format!(
        "P={name}.pid\n{start}\n\
         while [ ! -s \"$P\" ]; do sleep 0.02; done\n\
         kill -0 \"$(cat \"$P\")\" && echo running > {name}.ready\n\
         {tail}\n",
        start = escape.start,
    )
}

/// Whether process `pid` no longer runs: gone, or a zombie nobody reaps (in a container the
/// init may not).
pub fn gone_or_zombie(pid: i32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/status")) {
        Err(_) => true,
        Ok(status) => status
            .lines()
            .find_map(|l| l.strip_prefix("State:"))
            .is_some_and(|s| s.trim_start().starts_with('Z')),
    }
}

/// Poll [`gone_or_zombie`] for up to `within`.
pub async fn wait_gone(pid: i32, within: Duration) -> bool {
    let deadline = Instant::now() + within;
    while !gone_or_zombie(pid) {
        if Instant::now() >= deadline {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    true
}

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

/// How long a [`End::Timeout`] command runs: long enough for `python3` to start on a busy
/// machine.
pub const TIMEOUT: Duration = Duration::from_secs(8);

/// Run every escape concurrently through `exec(script, timeout)`, whose working directory is
/// `dir` (a directory of its own: the files are named after the escapes), end each as `end`
/// says, and return the names of the escapes whose process survived. Survivors are killed
/// (by pid: the command started them) before this returns. Panics if a command fails, ends
/// otherwise than `end` says, or never proved its process ran.
pub async fn survivors<F, Fut>(dir: &Path, end: End, exec: F) -> Vec<&'static str>
where
    F: Fn(String, Duration) -> Fut,
    Fut: Future<Output = Result<ExecResult>>,
{
    let runs = ESCAPES.iter().map(|escape| {
        let name = escape.name;
        let ready = dir.join(format!("{name}.ready"));
        // A caller may run several rounds in one directory: the last round's files would
        // prove this round's process ran before it wrote anything.
        let _ = std::fs::remove_file(&ready);
        let _ = std::fs::remove_file(dir.join(format!("{name}.pid")));
        let exec = exec(script(escape, end), TIMEOUT);
        async move {
            match end {
                End::Exit => {
                    let r = exec.await.unwrap_or_else(|e| panic!("{name}: {e}"));
                    assert_eq!(r.exit_code, Some(0), "{name}: {r:?}");
                }
                End::Timeout => {
                    let r = exec.await.unwrap_or_else(|e| panic!("{name}: {e}"));
                    assert!(r.timed_out, "{name}: {r:?}");
                }
                End::Cancel => {
                    tokio::select! {
                        r = exec => panic!("{name}: ended before it was cancelled: {r:?}"),
                        ok = wait_file(&ready, TIMEOUT) => assert!(ok, "{name}: never ready"),
                    }
                    // Leaving the select dropped the exec future: the cancellation.
                }
            }
            let proof = std::fs::read_to_string(&ready).unwrap_or_default();
            assert_eq!(proof, "running\n", "{name}: its process never ran");
            let pid: i32 = std::fs::read_to_string(dir.join(format!("{name}.pid")))
                .ok()
                .and_then(|p| p.trim().parse().ok())
                .unwrap_or_else(|| panic!("{name}: no pid"));
            let gone = wait_gone(pid, Duration::from_secs(5)).await;
            if !gone {
                let _ = nix::sys::signal::kill(
                    nix::unistd::Pid::from_raw(pid),
                    nix::sys::signal::Signal::SIGKILL,
                );
                assert!(
                    wait_gone(pid, Duration::from_secs(5)).await,
                    "{name}: {pid}"
                );
            }
            (name, gone)
        }
    });
    join_all(runs)
        .await
        .into_iter()
        .filter(|(_, gone)| !gone)
        .map(|(name, _)| name)
        .collect()
}
