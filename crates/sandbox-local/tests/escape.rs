//! The escape suite of a confined box (`Isolation::Confined`): each check tries one way out,
//! asserts it failed and prints what it tried and what stopped it. Bounded in time (every
//! command has a timeout); network traffic only to the host's and the box's loopback.
//!
//! Runs where the kernel allows unprivileged confinement; elsewhere the first test fails with
//! the typed error naming what is missing (set `SANDBOX_SKIP_CONFINED=1` to skip there).
//!
//! `SANDBOX_ESCAPE_HOST_SHELL=1` runs the same checks on the unconfined host shell, to see
//! them fail (every check but the file tools' and the kill-on-exit ones escapes there).

mod common;

use std::collections::BTreeSet;
use std::io::Read as _;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use common::TestBox;
use futures::future::join_all;
use sandbox_core::testkit::escapes::{ESCAPES, End, script};
use sandbox_core::{ExecRequest, ExecResult, RelPath, WorkspaceSpec};
use sandbox_local::{Isolation, LocalOptions};

fn skip() -> bool {
    std::env::var_os("SANDBOX_SKIP_CONFINED").is_some()
}

async fn confined(spec: WorkspaceSpec) -> TestBox {
    let isolation = if std::env::var_os("SANDBOX_ESCAPE_HOST_SHELL").is_some() {
        Isolation::HostShell
    } else {
        Isolation::confined()
    };
    TestBox::new(LocalOptions::default().isolation(isolation), spec).await
}

async fn sh(b: &TestBox, script: &str) -> ExecResult {
    b.sandbox
        .exec(ExecRequest::shell(script).timeout(Duration::from_secs(20)))
        .await
        .unwrap_or_else(|e| panic!("{script}: {e}"))
}

fn report(check: &str, tried: &str, stopped_by: &str) {
    eprintln!("escape check `{check}`: tried {tried}; stopped by {stopped_by}");
}

/// A file planted on the host, removed on drop.
struct Planted(PathBuf);

impl Drop for Planted {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn plant(dir: &Path) -> Option<(Planted, PathBuf)> {
    let d = dir.join(format!("sandbox-escape-{}", uuid_like()));
    std::fs::create_dir_all(&d).ok()?;
    let secret = d.join("secret");
    std::fs::write(&secret, "TOP-SECRET-HOST-VALUE").ok()?;
    Some((Planted(d), secret))
}

fn uuid_like() -> String {
    format!(
        "{}-{}",
        std::process::id(),
        Instant::now().elapsed().as_nanos() ^ (std::ptr::from_ref(&0u8) as usize as u128)
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn host_secrets_are_not_readable() {
    if skip() {
        return;
    }
    let b = confined(WorkspaceSpec::default()).await;
    let mut planted = Vec::new();
    for dir in ["/root", "/home"] {
        if let Some((guard, secret)) = plant(Path::new(dir)) {
            let r = sh(&b, &format!("cat {} 2>&1; ls {dir} 2>&1", secret.display())).await;
            assert!(
                !r.stdout_str().contains("TOP-SECRET"),
                "{dir}: {}",
                r.stdout_str()
            );
            report(
                "read a planted host secret",
                &format!("cat {}", secret.display()),
                &format!(
                    "{dir} is not in the box's mount namespace ({})",
                    r.stdout_str().lines().next().unwrap_or("").trim()
                ),
            );
            planted.push(guard);
        } else {
            eprintln!("escape check: cannot plant under {dir} as this user; not checked there");
        }
    }
    let host_shadow = std::fs::read_to_string("/etc/shadow").unwrap_or_default();
    let r = sh(&b, "cat /etc/shadow /etc/gshadow 2>&1; echo end").await;
    assert!(!r.stdout_str().contains("root:"), "{}", r.stdout_str());
    if !host_shadow.is_empty() {
        assert!(!r.stdout_str().contains(host_shadow.lines().next().unwrap()));
    }
    report(
        "read /etc/shadow",
        "cat /etc/shadow /etc/gshadow",
        "masked with an empty read-only file (every non-world-readable file under /etc is)",
    );
    for gone in ["/run", "/var/run", "/root", "/home", "/sys", "/var"] {
        let r = sh(
            &b,
            &format!("ls -A {gone} 2>&1 | head -3; test -e {gone}; echo $?"),
        )
        .await;
        let out = r.stdout_str();
        assert!(
            out.trim_end().ends_with('1') || out.lines().count() <= 1,
            "{gone} visible: {out}"
        );
    }
    report(
        "see /run, /var/run, /root, /home, /sys, /var",
        "ls -A",
        "absent from the box's root (no host Unix sockets: docker.sock, SSH agent, D-Bus)",
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn writes_outside_the_workspace_fail() {
    if skip() {
        return;
    }
    let a = confined(WorkspaceSpec::default()).await;
    let other = confined(WorkspaceSpec::default()).await;
    let mark = format!("escape-{}", uuid_like());
    let host_tmp = PathBuf::from("/tmp").join(&mark);
    let r = sh(
        &a,
        &format!(
            "echo x > /tmp/{mark} && echo tmp-written; echo x > /etc/{mark} 2>&1; \
             echo x > /usr/{mark} 2>&1; echo x > {}/{mark} 2>&1; echo x > /{mark} 2>&1; true",
            other.root().display()
        ),
    )
    .await;
    let out = r.stdout_str();
    eprintln!("{out}");
    assert!(!host_tmp.exists(), "host /tmp got the file");
    assert!(!Path::new("/etc").join(&mark).exists());
    assert!(!Path::new("/usr").join(&mark).exists());
    assert!(!Path::new("/").join(&mark).exists());
    assert!(!other.root().join(&mark).exists(), "wrote into another box");
    assert!(
        out.contains("tmp-written"),
        "the private /tmp is writable: {out}"
    );
    report(
        "write outside the workspace",
        "host /tmp, /etc, /usr, /, another box's workspace",
        "/tmp is the box's own tmpfs; /etc and /usr read-only binds; / a read-only tmpfs; \
         another box's directory is not mounted (and Landlock allows writes only to the \
         workspace, /tmp and /dev)",
    );
    let _ = std::fs::remove_file(&host_tmp);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn host_sockets_and_network_are_unreachable() {
    if skip() {
        return;
    }
    let b = confined(WorkspaceSpec::default()).await;
    // Unix sockets served on the host under /tmp and /run.
    let mut paths = vec![PathBuf::from(format!("/tmp/escape-{}.sock", uuid_like()))];
    if Path::new("/run").is_dir() {
        paths.push(PathBuf::from(format!("/run/escape-{}.sock", uuid_like())));
    }
    let mut listeners = Vec::new();
    for p in &paths {
        if let Ok(l) = std::os::unix::net::UnixListener::bind(p) {
            l.set_nonblocking(true).unwrap();
            listeners.push((p.clone(), l));
        }
    }
    assert!(!listeners.is_empty(), "no host socket could be served");
    let tcp = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    tcp.set_nonblocking(true).unwrap();
    let port = tcp.local_addr().unwrap().port();
    let socks: Vec<String> = listeners
        .iter()
        .map(|(p, _)| format!("'{}'", p.display()))
        .collect();
    let py = format!(
        r#"
import socket, errno
for p in [{socks}]:
    s = socket.socket(socket.AF_UNIX)
    try:
        s.connect(p); print("unix-connected", p)
    except OSError as e:
        print("unix", p, errno.errorcode.get(e.errno, e.errno))
s = socket.socket()
s.settimeout(3)
try:
    s.connect(("127.0.0.1", {port})); print("tcp-connected")
except OSError as e:
    print("tcp", errno.errorcode.get(e.errno, e.errno))
"#,
        socks = socks.join(",")
    );
    let r = b
        .sandbox
        .exec(ExecRequest::argv(["python3", "-c", &py]).timeout(Duration::from_secs(20)))
        .await
        .unwrap();
    let out = r.stdout_str();
    eprintln!("{out}{}", r.stderr_str());
    assert!(!out.contains("connected"), "{out}");
    assert!(out.contains("tcp ECONNREFUSED"), "{out}");
    for (p, l) in &listeners {
        assert!(l.accept().is_err(), "{} got a connection", p.display());
        let _ = std::fs::remove_file(p);
    }
    assert!(
        tcp.accept().is_err(),
        "the host's loopback server got a connection"
    );
    report(
        "connect to host Unix sockets under /tmp and /run",
        &socks.join(", "),
        "the paths do not exist in the box (ENOENT): host /tmp and /run are not mounted",
    );
    report(
        "reach a TCP server on the host's loopback",
        &format!("connect 127.0.0.1:{port}"),
        "ECONNREFUSED: 127.0.0.1 in the box is the box's own loopback (network namespace)",
    );
    // Interfaces and routes, listed from inside (no traffic sent anywhere).
    let r = sh(&b, "cat /proc/net/dev; echo ---; cat /proc/net/route; echo ---; cat /proc/net/ipv6_route 2>/dev/null; echo ---; ip -o link 2>&1; ip route 2>&1; ip -6 route 2>&1").await;
    let out = r.stdout_str();
    eprintln!("{out}");
    let mut sections = out.split("---\n");
    let dev = sections.next().unwrap();
    let ifaces: BTreeSet<&str> = dev
        .lines()
        .skip(2)
        .filter_map(|l| l.split(':').next())
        .map(str::trim)
        .collect();
    assert_eq!(ifaces, BTreeSet::from(["lo"]), "{dev}");
    let routes = sections.next().unwrap();
    assert_eq!(
        routes.lines().count(),
        1,
        "IPv4 routes besides the header: {routes}"
    );
    let v6 = sections.next().unwrap_or("");
    assert!(
        v6.lines().all(|l| l.contains(" lo")),
        "IPv6 routes off loopback: {v6}"
    );
    report(
        "find a way out of the network namespace",
        "list interfaces (/proc/net/dev, ip link) and routes (/proc/net/route, ip route)",
        "only `lo` exists and no IPv4 route: the host, its loopback services and the cloud \
         metadata address have no route",
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn host_processes_are_invisible_and_unsignalable() {
    if skip() {
        return;
    }
    let b = confined(WorkspaceSpec::default()).await;
    let mut victim = std::process::Command::new("sleep")
        .arg("60")
        .spawn()
        .unwrap();
    let pid = victim.id();
    let me = std::process::id();
    let r = sh(
        &b,
        &format!(
            "ls /proc | grep -c '^[0-9]'; ps -e -o pid=,comm= 2>&1; \
             test -e /proc/{pid} && echo victim-visible; test -e /proc/{me} && echo harness-visible; \
             kill -9 {pid} 2>&1; kill -9 {me} 2>&1; kill -9 1 2>&1; echo done"
        ),
    )
    .await;
    let out = r.stdout_str();
    eprintln!("{out}{}", r.stderr_str());
    assert!(!out.contains("victim-visible"), "{out}");
    assert!(!out.contains("harness-visible"), "{out}");
    assert!(
        victim.try_wait().unwrap().is_none(),
        "the host process was killed"
    );
    let count: usize = out.lines().next().unwrap().trim().parse().unwrap();
    assert!(count < 10, "{count} processes visible: {out}");
    victim.kill().unwrap();
    victim.wait().unwrap();
    // The box still answers: killing its pid 1 from inside did nothing.
    assert_eq!(sh(&b, "echo alive").await.stdout_str(), "alive\n");
    // The box's init (pid 1 of the box's /proc) and the command's own init keep their
    // environment and descriptors (control sockets, pipes) to themselves: none reopens.
    let r = sh(
        &b,
        // The command's init by its pid in the box's /proc (the shell's parent, read by the
        // shell itself).
        "while read k v; do [ \"$k\" = PPid: ] && P=$v; done < /proc/self/status; \
         [ -n \"$P\" ] && [ \"$P\" != 0 ] || echo no-parent; \
         for p in 1 $P; do cat /proc/$p/environ >/dev/null 2>&1 && echo env-$p; \
         for f in /proc/$p/fd/*; do (: < \"$f\") 2>/dev/null && echo open-$f; done; \
         done; echo checked",
    )
    .await;
    assert_eq!(r.stdout_str(), "checked\n", "{}", r.stdout_str());
    report(
        "see and signal host processes",
        &format!(
            "ls /proc, ps -e, kill -9 {pid} (a host sleep), kill -9 {me} (the harness), kill -9 1"
        ),
        "the box's PID namespace holds only its own processes (the pids do not exist there); \
         its init ignores signals from inside; Landlock scopes signals to the box",
    );
}

/// One probe per syscall, through python's ctypes: the errno each returned.
const SYSCALLS: &str = r#"
import ctypes, os, errno, json
libc = ctypes.CDLL(None, use_errno=True)
def call(nr, *args):
    r = libc.syscall(nr, *[ctypes.c_long(a) for a in args])
    return "ok" if r >= 0 else errno.errorcode.get(ctypes.get_errno(), str(ctypes.get_errno()))
buf = ctypes.create_string_buffer(64)
iov = (ctypes.c_long * 2)(ctypes.addressof(buf), 64)
out = {
  "mount": call(165, 0, ctypes.addressof(ctypes.create_string_buffer(b"/tmp")), ctypes.addressof(ctypes.create_string_buffer(b"tmpfs")), 0, 0),
  "umount2": call(166, ctypes.addressof(ctypes.create_string_buffer(b"/proc")), 2),
  "unshare(CLONE_NEWUSER)": call(272, 0x10000000),
  "unshare(CLONE_NEWNS)": call(272, 0x00020000),
  "ptrace(ATTACH, 1)": call(101, 16, 1, 0, 0),
  "process_vm_readv(1)": call(310, 1, ctypes.addressof(iov), 1, ctypes.addressof(iov), 1, 0),
  "io_uring_setup": call(425, 8, ctypes.addressof(ctypes.create_string_buffer(120))),
  "bpf": call(321, 0, ctypes.addressof(ctypes.create_string_buffer(128)), 128),
  "keyctl": call(250, 0, -3, 0),
  "add_key": call(248, ctypes.addressof(ctypes.create_string_buffer(b"user")), ctypes.addressof(ctypes.create_string_buffer(b"k")), ctypes.addressof(buf), 1, -3),
  "perf_event_open": call(298, ctypes.addressof(ctypes.create_string_buffer(128)), 0, -1, -1, 0),
  "mknod(/tmp/null, c 1 3)": call(133, ctypes.addressof(ctypes.create_string_buffer(b"/tmp/null")), 0o20666, (1 << 8) | 3),
  "socket(AF_VSOCK)": call(41, 40, 1, 0),
  "socket(AF_PACKET)": call(41, 17, 3, 0),
  "socket(SOCK_RAW)": call(41, 2, 3, 1),
  "pivot_root": call(155, ctypes.addressof(ctypes.create_string_buffer(b"/tmp")), ctypes.addressof(ctypes.create_string_buffer(b"/tmp"))),
  "open_by_handle_at": call(304, -100, ctypes.addressof(buf), 0),
  "kexec_load": call(246, 0, 0, 0, 0),
  "init_module": call(175, 0, 0, ctypes.addressof(ctypes.create_string_buffer(b""))),
  "setns": call(308, 0, 0),
}
print(json.dumps(out))
"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dangerous_syscalls_fail() {
    if skip() {
        return;
    }
    let b = confined(WorkspaceSpec::default()).await;
    let r = b
        .sandbox
        .exec(ExecRequest::argv(["python3", "-c", SYSCALLS]).timeout(Duration::from_secs(20)))
        .await
        .unwrap();
    let out = r.stdout_str();
    assert_eq!(r.exit_code, Some(0), "{out}{}", r.stderr_str());
    let results: serde_json::Map<String, serde_json::Value> =
        serde_json::from_str(out.trim()).unwrap();
    for (call, errno) in &results {
        assert_ne!(errno, "ok", "{call} succeeded in the box");
        report(
            call,
            "the raw syscall from python ctypes",
            &format!(
                "{} (seccomp denylist or no capabilities)",
                errno.as_str().unwrap_or("?")
            ),
        );
    }
    // The shell tools too.
    let r = sh(&b, "mount -t tmpfs x /tmp 2>&1; echo $?; unshare -U true 2>&1; echo $?; mknod /tmp/n c 1 3 2>&1; echo $?").await;
    let out = r.stdout_str();
    let codes: Vec<&str> = out.lines().filter(|l| l.len() <= 3).collect();
    assert!(codes.iter().all(|c| *c != "0"), "{out}");
    report(
        "mount, unshare -U, mknod",
        "the util-linux and coreutils commands",
        "EPERM",
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_privileges_to_gain() {
    if skip() {
        return;
    }
    let b = confined(WorkspaceSpec::default()).await;
    let r = sh(
        &b,
        "grep -E '^(CapInh|CapPrm|CapEff|CapBnd|CapAmb|NoNewPrivs|Seccomp):' /proc/self/status",
    )
    .await;
    let out = r.stdout_str();
    eprintln!("{out}");
    for cap in ["CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb"] {
        assert!(
            out.lines()
                .any(|l| l.starts_with(cap) && l.trim_end().ends_with("0000000000000000")),
            "{cap}: {out}"
        );
    }
    assert!(out.contains("NoNewPrivs:\t1"), "{out}");
    assert!(out.contains("Seccomp:\t2"), "{out}");
    // A set-uid binary of the host gains nothing either.
    let setuid = [
        "/usr/bin/su",
        "/bin/su",
        "/usr/bin/passwd",
        "/usr/bin/mount",
    ]
    .into_iter()
    .find(|p| {
        use std::os::unix::fs::PermissionsExt as _;
        std::fs::metadata(p).is_ok_and(|m| m.permissions().mode() & 0o4000 != 0)
    });
    if let Some(bin) = setuid {
        let r = sh(
            &b,
            &format!("{bin} --version >/dev/null 2>&1; cat /proc/self/status | grep CapEff"),
        )
        .await;
        assert!(
            r.stdout_str().contains("0000000000000000"),
            "{}",
            r.stdout_str()
        );
    }
    // Kernel knobs.
    let r = sh(
        &b,
        "echo 10 > /proc/sys/vm/swappiness 2>&1; echo $?; echo h > /proc/sysrq-trigger 2>&1; echo $?; \
         echo x > /sys/kernel/uevent_helper 2>&1; echo $?",
    )
    .await;
    let out = r.stdout_str();
    let codes: Vec<&str> = out.lines().filter(|l| l.len() <= 3).collect();
    assert_eq!(codes.len(), 3, "{out}");
    assert!(codes.iter().all(|c| *c != "0"), "{out}");
    report(
        "gain privileges (set-uid binary), write /proc/sys, /proc/sysrq-trigger, /sys",
        setuid.unwrap_or("(no set-uid binary found)"),
        "no capabilities in any set, bounding set empty, no_new_privs (set-uid bits ignored), \
         seccomp mode 2; /proc/sys and sysrq-trigger bound read-only; no /sys",
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn links_lead_nowhere() {
    if skip() {
        return;
    }
    let b = confined(WorkspaceSpec::default()).await;
    let Some((_guard, secret)) = plant(&b.outside()) else {
        panic!("cannot plant a file outside the box");
    };
    // A hard link to a host file.
    let r = sh(
        &b,
        &format!(
            "ln /etc/hostname hl 2>&1; echo $?; ln {} hl2 2>&1; echo $?",
            secret.display()
        ),
    )
    .await;
    let out = r.stdout_str();
    eprintln!("{out}");
    assert!(
        !b.root().join("hl2").exists(),
        "hard link to the planted secret made"
    );
    if b.root().join("hl").exists() {
        use std::os::unix::fs::MetadataExt as _;
        let linked = std::fs::metadata(b.root().join("hl")).unwrap().ino()
            == std::fs::metadata("/etc/hostname").unwrap().ino();
        assert!(!linked, "hard link into /etc");
    }
    report(
        "hard link from the workspace to a host file",
        "ln /etc/hostname, ln <planted secret>",
        "EXDEV: /etc is another mount; the planted file does not exist in the box",
    );
    // A symlink planted between calls, pointing outside.
    sh(
        &b,
        &format!("ln -s {} out", secret.parent().unwrap().display()),
    )
    .await;
    let read = b
        .handle()
        .read_file(&RelPath::new("out/secret").unwrap())
        .await;
    assert!(read.is_err(), "read_file followed the link out: {read:?}");
    let write = b
        .handle()
        .write_file(&RelPath::new("out/planted").unwrap(), "x".into(), 0o644)
        .await;
    assert!(write.is_err(), "write_file followed the link out");
    assert!(!secret.parent().unwrap().join("planted").exists());
    let r = sh(&b, "cat out/secret 2>&1; true").await;
    assert!(!r.stdout_str().contains("TOP-SECRET"), "{}", r.stdout_str());
    report(
        "a symlink planted in the workspace pointing outside",
        "read_file/write_file through it; cat through it in the box",
        "the file tools resolve beneath the workspace handle (PathEscape); in the box the \
         target does not exist",
    );
}

/// Host pids of the processes whose environment carries `mark` (every process a command
/// starts inherits it; the box's pids mean nothing on the host).
fn marked(mark: &str) -> Vec<u32> {
    let needle = format!("SANDBOX_ESCAPE_MARK={mark}");
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    entries
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
        .filter(|pid| {
            let mut env = Vec::new();
            let zombie = std::fs::read_to_string(format!("/proc/{pid}/stat"))
                .map(|s| {
                    s.rsplit(')')
                        .next()
                        .unwrap_or("")
                        .trim_start()
                        .starts_with('Z')
                })
                .unwrap_or(true);
            !zombie
                && std::fs::File::open(format!("/proc/{pid}/environ"))
                    .and_then(|mut f| f.read_to_end(&mut env))
                    .is_ok()
                && env.split(|b| *b == 0).any(|kv| kv == needle.as_bytes())
        })
        .collect()
}

async fn wait_none(mark: &str, within: Duration) -> Vec<u32> {
    let deadline = Instant::now() + within;
    loop {
        let left = marked(mark);
        if left.is_empty() || Instant::now() >= deadline {
            return left;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

async fn escapes_die(end: End) {
    let b = confined(WorkspaceSpec::default()).await;
    let mark = format!("{}-{end:?}", uuid_like());
    let root = b.root();
    let runs = ESCAPES.iter().map(|escape| {
        let exec = b.sandbox.exec(
            ExecRequest::shell(script(escape, end))
                .env("SANDBOX_ESCAPE_MARK", &mark)
                .timeout(sandbox_core::testkit::escapes::TIMEOUT),
        );
        let ready = root.join(format!("{}.ready", escape.name));
        async move {
            match end {
                End::Exit => assert_eq!(exec.await.unwrap().exit_code, Some(0), "{}", escape.name),
                End::Timeout => assert!(exec.await.unwrap().timed_out, "{}", escape.name),
                End::Cancel => {
                    let deadline = Instant::now() + Duration::from_secs(10);
                    tokio::select! {
                        r = exec => panic!("{}: ended before the cancel: {r:?}", escape.name),
                        () = async {
                            while !ready.exists() && Instant::now() < deadline {
                                tokio::time::sleep(Duration::from_millis(20)).await;
                            }
                        } => {}
                    }
                }
            }
            let proof = std::fs::read_to_string(&ready).unwrap_or_default();
            assert_eq!(proof, "running\n", "{}: never ran", escape.name);
        }
    });
    join_all(runs).await;
    let left = wait_none(&mark, Duration::from_secs(5)).await;
    for pid in &left {
        let _ = std::process::Command::new("kill")
            .args(["-9", &pid.to_string()])
            .status();
    }
    assert!(left.is_empty(), "{end:?}: survivors {left:?}");
    report(
        &format!("leave a process running ({end:?})"),
        "background, nohup, double and triple fork, setsid, setsid -f, a python daemon, setpgid",
        "each command is PID 1's child of its own PID namespace: its end kills the namespace",
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn everything_dies_on_exit() {
    if !skip() {
        escapes_die(End::Exit).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn everything_dies_on_timeout() {
    if !skip() {
        escapes_die(End::Timeout).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn everything_dies_on_cancel() {
    if !skip() {
        escapes_die(End::Cancel).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nothing_survives_the_release() {
    if skip() {
        return;
    }
    let b = confined(WorkspaceSpec::default()).await;
    let mark = format!("{}-release", uuid_like());
    // A daemon started by a command that exited... is already dead; so start one in a
    // command that is still running when the box is released.
    let handle = b.sandbox.handle();
    let running = handle.exec(
        ExecRequest::shell("setsid -f sleep 300; (sleep 300 &); echo started > started; sleep 300")
            .env("SANDBOX_ESCAPE_MARK", &mark)
            .timeout(Duration::from_secs(60)),
    );
    let started = b.root().join("started");
    tokio::pin!(running);
    tokio::select! {
        r = &mut running => panic!("ended early: {r:?}"),
        () = async {
            while !started.exists() {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        } => {}
    }
    // The command still runs (its future is kept, not cancelled): release the box under it.
    assert!(!marked(&mark).is_empty(), "nothing ran");
    handle.release().await.unwrap();
    let ended = tokio::time::timeout(Duration::from_secs(10), running).await;
    assert!(ended.is_ok(), "the exec did not end with its box");
    let left = wait_none(&mark, Duration::from_secs(5)).await;
    assert!(left.is_empty(), "survived the release: {left:?}");
    report(
        "a process left running after the box is released",
        "setsid -f, a subshell's background job, a running command",
        "release shuts the box's init down: the kernel kills its PID namespace",
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn read_only_bind_mounts_are_read_only() {
    if skip() {
        return;
    }
    let host = tempfile::tempdir().unwrap();
    std::fs::write(host.path().join("data"), "shared").unwrap();
    let spec = WorkspaceSpec::builder()
        .bind_mount("ro", host.path(), true)
        .build()
        .unwrap();
    let b = confined(spec).await;
    let r = sh(
        &b,
        "cat ro/data; echo x > ro/new 2>&1; echo $?; echo y >> ro/data 2>&1; echo $?",
    )
    .await;
    let out = r.stdout_str();
    eprintln!("{out}");
    assert!(out.starts_with("shared"), "{out}");
    assert!(!host.path().join("new").exists());
    assert_eq!(
        std::fs::read_to_string(host.path().join("data")).unwrap(),
        "shared"
    );
    let w = b
        .handle()
        .write_file(&RelPath::new("ro/new").unwrap(), "x".into(), 0o644)
        .await;
    assert!(w.is_err(), "write_file wrote into a read-only bind");
    report(
        "write into a read-only bind mount",
        "echo > ro/new, >> ro/data in the box; write_file(ro/new)",
        "the bind is mounted read-only (EROFS); the file tools refuse it",
    );
}
