//! The hardened defaults of a box, observed from inside it on the real engine
//! (`SANDBOX_TEST_DOCKER=1`, set by `cargo xtask test`): no privilege gain through set-uid
//! binaries, a process limit that contains a fork bomb (and a timeout that still kills it),
//! and the documented capability set.

mod common;

use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::Duration;

use common::{BUSYBOX, DEBIAN, Sweep, docker, options};
use sandbox_core::testkit::sh;
use sandbox_core::{ExecRequest, Sandbox, SandboxConfig, WorkspaceSpec};
use sandbox_docker::{DEFAULT_CAPABILITIES, DockerClient, DockerOptions, HostSettings};

/// The capabilities the README's "Hardening" table marks `kept`.
fn documented_kept_set() -> BTreeSet<String> {
    let readme = include_str!("../README.md");
    let table = readme
        .split("## Hardening")
        .nth(1)
        .expect("a Hardening section")
        .split("\n## ")
        .next()
        .unwrap();
    let kept: BTreeSet<String> = table
        .lines()
        .filter_map(|l| {
            let cells: Vec<&str> = l.split('|').map(str::trim).collect();
            match cells.as_slice() {
                ["", name, "kept", ..] => Some(name.trim_matches('`').to_owned()),
                _ => None,
            }
        })
        .collect();
    assert!(
        kept.len() >= 3,
        "the README table lists the kept set: {kept:?}"
    );
    kept
}

fn client(o: DockerOptions) -> (Arc<DockerClient>, Sweep) {
    common::init_tracing();
    let sweep = Sweep(o.name_prefix.clone());
    (Arc::new(DockerClient::new(o).expect("client")), sweep)
}

async fn started(client: &DockerClient, spec: WorkspaceSpec) -> Sandbox {
    let sb = Sandbox::create(client, SandboxConfig::new(spec), None)
        .await
        .expect("create");
    sb.start().await.expect("start");
    sb
}

/// Linux capability numbers (`linux/capability.h`), by the engine's names.
const CAP_BITS: &[(&str, u32)] = &[
    ("CHOWN", 0),
    ("DAC_OVERRIDE", 1),
    ("DAC_READ_SEARCH", 2),
    ("FOWNER", 3),
    ("FSETID", 4),
    ("KILL", 5),
    ("SETGID", 6),
    ("SETUID", 7),
    ("SETPCAP", 8),
    ("LINUX_IMMUTABLE", 9),
    ("NET_BIND_SERVICE", 10),
    ("NET_BROADCAST", 11),
    ("NET_ADMIN", 12),
    ("NET_RAW", 13),
    ("IPC_LOCK", 14),
    ("IPC_OWNER", 15),
    ("SYS_MODULE", 16),
    ("SYS_RAWIO", 17),
    ("SYS_CHROOT", 18),
    ("SYS_PTRACE", 19),
    ("SYS_PACCT", 20),
    ("SYS_ADMIN", 21),
    ("SYS_BOOT", 22),
    ("SYS_NICE", 23),
    ("SYS_RESOURCE", 24),
    ("SYS_TIME", 25),
    ("SYS_TTY_CONFIG", 26),
    ("MKNOD", 27),
    ("LEASE", 28),
    ("AUDIT_WRITE", 29),
    ("AUDIT_CONTROL", 30),
    ("SETFCAP", 31),
    ("MAC_OVERRIDE", 32),
    ("MAC_ADMIN", 33),
    ("SYSLOG", 34),
    ("WAKE_ALARM", 35),
    ("BLOCK_SUSPEND", 36),
    ("AUDIT_READ", 37),
    ("PERFMON", 38),
    ("BPF", 39),
    ("CHECKPOINT_RESTORE", 40),
];

/// The names of the capabilities in a `/proc/<pid>/status` mask.
fn cap_names(mask: u64) -> BTreeSet<String> {
    let mut names: BTreeSet<String> = CAP_BITS
        .iter()
        .filter(|(_, bit)| mask & (1 << bit) != 0)
        .map(|(name, _)| (*name).to_owned())
        .collect();
    let known = CAP_BITS.iter().fold(0u64, |m, (_, bit)| m | 1 << bit);
    if mask & !known != 0 {
        names.insert(format!("unknown bits {:#x}", mask & !known));
    }
    names
}

fn names(list: &[&str]) -> BTreeSet<String> {
    list.iter().map(|s| (*s).to_owned()).collect()
}

/// A field of `/proc/self/status` as seen by a command in the box.
fn status_field<'a>(status: &'a str, field: &str) -> &'a str {
    status
        .lines()
        .find_map(|l| l.strip_prefix(field)?.strip_prefix(':'))
        .unwrap_or_else(|| panic!("no {field} in {status}"))
        .trim()
}

fn cap_field(status: &str, field: &str) -> BTreeSet<String> {
    cap_names(u64::from_str_radix(status_field(status, field), 16).expect("hex mask"))
}

#[tokio::test]
#[cfg_attr(not(docker_tests), ignore = "needs Docker; run by cargo xtask test")]
async fn kept_capabilities_are_the_documented_ones() {
    let kept = documented_kept_set();
    assert_eq!(names(DEFAULT_CAPABILITIES), kept, "README and code agree");
    let (c, _sweep) = client(options(BUSYBOX));
    let sb = started(&c, WorkspaceSpec::default()).await;
    let status = sh(&sb, "cat /proc/self/status").await;
    // Root in the box: the effective set is the whole kept set, and the bounding set (what
    // any process in the box could ever get back) is no larger.
    assert_eq!(cap_field(&status, "CapEff"), kept, "{status}");
    assert_eq!(cap_field(&status, "CapBnd"), kept, "{status}");
    assert_eq!(status_field(&status, "NoNewPrivs"), "1", "{status}");
    // Another user in the same box has none of them.
    let status = sh(
        &sb,
        "su -s /bin/sh nobody -c 'cat /proc/self/status' 2>/dev/null || \
         setpriv --reuid=65534 --regid=65534 --clear-groups cat /proc/self/status",
    )
    .await;
    assert_eq!(cap_field(&status, "CapEff"), BTreeSet::new(), "{status}");
    sb.destroy().await.expect("destroy");
}

/// Options add capabilities back, remove kept ones, and turn no-new-privileges off, each
/// explicitly.
#[tokio::test]
#[cfg_attr(not(docker_tests), ignore = "needs Docker; run by cargo xtask test")]
async fn hardening_is_loosened_only_explicitly() {
    let o = options(BUSYBOX)
        .host(
            HostSettings::default()
                .cap_add("cap_net_bind_service")
                .cap_drop("FSETID"),
        )
        .no_new_privileges(false);
    let mut expected = documented_kept_set();
    expected.insert("NET_BIND_SERVICE".to_owned());
    expected.remove("FSETID");
    assert_eq!(names_of(&o.kept_capabilities()), expected);
    let (c, _sweep) = client(o);
    let sb = started(&c, WorkspaceSpec::default()).await;
    let status = sh(&sb, "cat /proc/self/status").await;
    assert_eq!(cap_field(&status, "CapBnd"), expected, "{status}");
    assert_eq!(status_field(&status, "NoNewPrivs"), "0", "{status}");
    sb.destroy().await.expect("destroy");
}

fn names_of(list: &[String]) -> BTreeSet<String> {
    list.iter().cloned().collect()
}

/// A set-uid-root copy of bash, run by an unprivileged user, keeps the user's effective uid.
#[tokio::test]
#[cfg_attr(not(docker_tests), ignore = "needs Docker; run by cargo xtask test")]
async fn setuid_binaries_cannot_raise_privileges() {
    let (c, _sweep) = client(options(DEBIAN));
    let sb = started(&c, WorkspaceSpec::default()).await;
    // As root: a set-uid-root shell (`-p` keeps bash from dropping the euid itself).
    assert_eq!(
        sh(
            &sb,
            "cp /bin/bash /tmp/sb && chmod u+s /tmp/sb && stat -c '%u %a' /tmp/sb"
        )
        .await,
        "0 4755\n"
    );
    // As `nobody` (dropped with setpriv, which the kept SETUID/SETGID allow): real and
    // effective uid as the set-uid shell sees them.
    let seen = sh(
        &sb,
        "setpriv --reuid=65534 --regid=65534 --clear-groups /tmp/sb -p -c 'echo $(id -ru) $(id -u)'",
    )
    .await;
    assert_eq!(seen, "65534 65534\n", "the set-uid bit gave root back");
    sb.destroy().await.expect("destroy");
}

/// A process-tree bomb, bounded (a binary tree of depth 9: at most 1023 processes, so it stays
/// harmless where no limit applies), whose processes retry a failed fork every 0.2 s until
/// `deadline` seconds have passed, then sleep: it keeps the box's process table full.
const BOMB: &str = r#"
import os, sys, time
depth, deadline = int(sys.argv[1]), time.time() + float(sys.argv[2])
kids, said = 0, False
while depth > 0 and kids < 2 and time.time() < deadline:
    try:
        pid = os.fork()
    except BlockingIOError:
        if not said:
            print("fork: EAGAIN", file=sys.stderr, flush=True)
            said = True
        time.sleep(0.2)
        continue
    if pid == 0:
        depth, kids, said = depth - 1, 0, False
    else:
        kids += 1
time.sleep(600)
"#;

/// Processes in a container, as the engine sees them (from the host, no exec needed).
async fn process_count(container: &str) -> usize {
    let top = docker()
        .top_processes(container, None::<bollard::query_parameters::TopOptions>)
        .await
        .expect("top");
    top.processes.map_or(0, |p| p.len())
}

async fn fork_bomb_is_contained(agent: bool) {
    let (c1, _sweep1) = client(options(DEBIAN).exec_agent(agent));
    let (c2, _sweep2) = client(options(BUSYBOX));
    let spec = WorkspaceSpec::builder()
        .file("bomb.py", BOMB)
        .build()
        .unwrap();
    let bombed = started(&c1, spec).await;
    let bystander = started(&c2, WorkspaceSpec::default()).await;
    let container = bombed
        .state()
        .downcast::<sandbox_docker::DockerState>("docker")
        .expect("docker state")
        .container_name
        .clone();

    let bomb = bombed.exec(
        ExecRequest::argv(["python3", "bomb.py", "9", "60"]).timeout(Duration::from_secs(15)),
    );
    let meanwhile = async {
        tokio::time::sleep(Duration::from_secs(8)).await;
        let peak = process_count(&container).await;
        let other = sh(&bystander, "echo still here").await;
        let host = tokio::process::Command::new("true")
            .status()
            .await
            .expect("spawn on the host");
        (peak, other, host)
    };
    let (bomb, (peak, other, host)) = tokio::join!(bomb, meanwhile);

    // The limit held, and the other box and the host kept working.
    assert!(peak <= 512, "{peak} processes in the bombed box");
    assert_eq!(other, "still here\n");
    assert!(host.success());
    // The harness reports what happened: a timeout, with the bomb's own EAGAIN report.
    let bomb = bomb.expect("the bomb's exec returns a result");
    assert!(bomb.timed_out && bomb.exit_code.is_none(), "{bomb:?}");
    assert!(bomb.stderr_str().contains("fork: EAGAIN"), "{bomb:?}");
    // The timeout's tree kill worked despite the full process table: the box is usable
    // and the bomb is gone.
    let after = sh(&bombed, "echo alive; ls -d /proc/[0-9]* | wc -l").await;
    let mut lines = after.lines();
    assert_eq!(lines.next(), Some("alive"));
    let left: usize = lines.next().unwrap().trim().parse().unwrap();
    assert!(left < 20, "{left} processes left in the box");
    bombed.destroy().await.expect("destroy");
    bystander.destroy().await.expect("destroy");
}

#[tokio::test]
#[cfg_attr(not(docker_tests), ignore = "needs Docker; run by cargo xtask test")]
async fn fork_bomb_is_contained_through_the_agent() {
    fork_bomb_is_contained(true).await;
}

#[tokio::test]
#[cfg_attr(not(docker_tests), ignore = "needs Docker; run by cargo xtask test")]
async fn fork_bomb_is_contained_through_engine_execs() {
    fork_bomb_is_contained(false).await;
}
