//! The inside: the re-executed binary becomes the box's init.
//!
//! Three processes, all running this code:
//!
//! - the **outer** process (host PID namespace, single-threaded because it runs before
//!   `main`): reads the configuration, joins the box's cgroups, sets rlimits, unshares the
//!   user, mount, PID, network, IPC, UTS and cgroup namespaces, writes its uid/gid maps,
//!   forks, and waits for its child;
//! - the **box init**, PID 1 of the box's PID namespace: builds the root file system, brings
//!   loopback up, `pivot_root`s, applies no_new_privs, Landlock and seccomp to itself (so to
//!   everything it starts), reports, then serves exec requests until the control socket closes;
//! - one **exec init** per command, PID 1 of a nested PID namespace (`clone(CLONE_NEWPID)`):
//!   drops every capability, forks the command, reports its exit status and exits, which makes
//!   the kernel kill everything the command left behind. It also exits (the same kill) as soon
//!   as the host closes or writes to the command's control stream (timeout, cancel).

use std::ffi::{CStr, CString};
use std::fs;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::ffi::OsStrExt as _;
use std::os::unix::fs::{MetadataExt as _, PermissionsExt as _};
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::{Bind, Report};

/// Set (to `1`) in the environment of the re-executed binary.
pub(crate) const INIT_ENV: &str = "SANDBOX_CONFINE_INIT";
/// The control socket's descriptor in the init.
pub(crate) const CTRL_FD: RawFd = 3;
/// Largest frame accepted on a control socket or stream (hostile sizes are refused before
/// they size a buffer).
pub(crate) const MAX_FRAME: usize = 16 << 20;

/// What the host sends the init first.
#[derive(Debug, Serialize, Deserialize)]
pub(crate) struct InitConfig {
    pub uid: u32,
    pub gid: u32,
    /// An empty directory the new root is mounted on (outside the box's view afterwards).
    pub new_root: PathBuf,
    /// Host directories shown read-only at the same path (symlinks are recreated as links).
    pub system_dirs: Vec<PathBuf>,
    pub binds: Vec<Bind>,
    pub mask_secrets: bool,
    pub tmp_size: u64,
    pub hostname: String,
    /// `cgroup.procs` files the outer process writes `0` to before anything else.
    pub cgroup_procs: Vec<PathBuf>,
    /// `(resource, limit)` set with `setrlimit` (soft and hard).
    pub rlimits: Vec<(u32, u64)>,
    pub landlock: bool,
    pub seccomp: bool,
}

/// What the init answers to the configuration.
#[derive(Debug, Serialize, Deserialize)]
pub(crate) enum InitReply {
    Ready(Report),
    Failed {
        step: String,
        message: String,
        errno: i32,
    },
}

/// One command, sent on its own control stream.
#[derive(Debug, Serialize, Deserialize)]
pub(crate) struct ExecFrame {
    pub argv: Vec<String>,
    pub env: Vec<String>,
    pub cwd: PathBuf,
}

/// How a command ended (or why it did not start), the last frame on its control stream.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[non_exhaustive]
pub struct ExecStatus {
    /// Exit code if it exited.
    pub code: Option<i32>,
    /// Signal number if a signal killed it.
    pub signal: Option<i32>,
    /// Why it could not start (`None` when it ran).
    pub error: Option<String>,
}

pub(crate) struct Fail {
    step: String,
    message: String,
    errno: i32,
}

impl Fail {
    fn os(step: impl Into<String>, e: io::Error) -> Fail {
        Fail {
            step: step.into(),
            errno: e.raw_os_error().unwrap_or(0),
            message: e.to_string(),
        }
    }
    fn msg(step: impl Into<String>, message: impl Into<String>) -> Fail {
        Fail {
            step: step.into(),
            message: message.into(),
            errno: 0,
        }
    }
}

type R<T> = Result<T, Fail>;

fn cvt(step: &str, ret: libc::c_int) -> R<libc::c_int> {
    if ret < 0 {
        Err(Fail::os(step, io::Error::last_os_error()))
    } else {
        Ok(ret)
    }
}

fn cstr(p: &Path) -> CString {
    CString::new(p.as_os_str().as_bytes()).unwrap_or_else(|_| c"/nonexistent".to_owned())
}

// ---------------------------------------------------------------------------------------------
// Frames on sockets.

pub(crate) fn write_frame(fd: RawFd, body: &[u8]) -> io::Result<()> {
    let mut buf = Vec::with_capacity(4 + body.len());
    buf.extend_from_slice(&(body.len() as u32).to_le_bytes());
    buf.extend_from_slice(body);
    let mut off = 0;
    while off < buf.len() {
        // SAFETY: the pointer and length describe the live `buf`.
        let n = unsafe {
            libc::send(
                fd,
                buf[off..].as_ptr().cast(),
                buf.len() - off,
                libc::MSG_NOSIGNAL,
            )
        };
        if n < 0 {
            let e = io::Error::last_os_error();
            if e.kind() == io::ErrorKind::Interrupted {
                continue;
            }
            return Err(e);
        }
        off += n as usize;
    }
    Ok(())
}

fn read_exact(fd: RawFd, buf: &mut [u8]) -> io::Result<()> {
    let mut off = 0;
    while off < buf.len() {
        // SAFETY: the pointer and length describe the live `buf`.
        let n = unsafe { libc::read(fd, buf[off..].as_mut_ptr().cast(), buf.len() - off) };
        if n < 0 {
            let e = io::Error::last_os_error();
            if e.kind() == io::ErrorKind::Interrupted {
                continue;
            }
            return Err(e);
        }
        if n == 0 {
            return Err(io::ErrorKind::UnexpectedEof.into());
        }
        off += n as usize;
    }
    Ok(())
}

pub(crate) fn read_frame(fd: RawFd) -> io::Result<Vec<u8>> {
    let mut len = [0u8; 4];
    read_exact(fd, &mut len)?;
    let len = u32::from_le_bytes(len) as usize;
    if len > MAX_FRAME {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!("a frame of {len} bytes is larger than {MAX_FRAME}"),
        ));
    }
    let mut body = vec![0u8; len];
    read_exact(fd, &mut body)?;
    Ok(body)
}

/// A datagram on the (SOCK_SEQPACKET) control socket, with up to 4 descriptors.
pub(crate) fn send_with_fds(fd: RawFd, data: &[u8], fds: &[RawFd]) -> io::Result<()> {
    let mut iov = libc::iovec {
        iov_base: data.as_ptr() as *mut libc::c_void,
        iov_len: data.len(),
    };
    let mut cmsg_buf = [0u64; 8];
    // SAFETY: msghdr is plain data; every pointer set below points into live locals, and the
    // control buffer is large enough for 4 descriptors (CMSG_SPACE(16) = 32 bytes ≤ 64).
    unsafe {
        let mut msg: libc::msghdr = std::mem::zeroed();
        msg.msg_iov = &mut iov;
        msg.msg_iovlen = 1;
        if !fds.is_empty() {
            let size = std::mem::size_of_val(fds) as u32;
            msg.msg_control = cmsg_buf.as_mut_ptr().cast();
            msg.msg_controllen = libc::CMSG_SPACE(size) as usize;
            let cmsg = libc::CMSG_FIRSTHDR(&msg);
            (*cmsg).cmsg_level = libc::SOL_SOCKET;
            (*cmsg).cmsg_type = libc::SCM_RIGHTS;
            (*cmsg).cmsg_len = libc::CMSG_LEN(size) as usize;
            std::ptr::copy_nonoverlapping(
                fds.as_ptr().cast::<u8>(),
                libc::CMSG_DATA(cmsg),
                size as usize,
            );
        }
        loop {
            let n = libc::sendmsg(fd, &msg, libc::MSG_NOSIGNAL);
            if n >= 0 {
                return Ok(());
            }
            let e = io::Error::last_os_error();
            if e.kind() != io::ErrorKind::Interrupted {
                return Err(e);
            }
        }
    }
}

/// Receive one datagram and its descriptors (close-on-exec). `Ok(None)` at end of stream.
pub(crate) fn recv_with_fds(
    fd: RawFd,
    buf: &mut [u8],
) -> io::Result<Option<(usize, Vec<OwnedFd>)>> {
    let mut iov = libc::iovec {
        iov_base: buf.as_mut_ptr().cast(),
        iov_len: buf.len(),
    };
    let mut cmsg_buf = [0u64; 16];
    // SAFETY: as in `send_with_fds`; descriptors are taken only from SCM_RIGHTS messages the
    // kernel filled in, each once.
    unsafe {
        let mut msg: libc::msghdr = std::mem::zeroed();
        msg.msg_iov = &mut iov;
        msg.msg_iovlen = 1;
        msg.msg_control = cmsg_buf.as_mut_ptr().cast();
        msg.msg_controllen = std::mem::size_of_val(&cmsg_buf);
        let n = loop {
            let n = libc::recvmsg(fd, &mut msg, libc::MSG_CMSG_CLOEXEC);
            if n >= 0 {
                break n as usize;
            }
            let e = io::Error::last_os_error();
            if e.kind() != io::ErrorKind::Interrupted {
                return Err(e);
            }
        };
        let mut fds = Vec::new();
        let mut cmsg = libc::CMSG_FIRSTHDR(&msg);
        while !cmsg.is_null() {
            if (*cmsg).cmsg_level == libc::SOL_SOCKET && (*cmsg).cmsg_type == libc::SCM_RIGHTS {
                let data = libc::CMSG_DATA(cmsg);
                let count = ((*cmsg).cmsg_len - libc::CMSG_LEN(0) as usize) / 4;
                for i in 0..count {
                    let raw = std::ptr::read_unaligned(data.cast::<RawFd>().add(i));
                    fds.push(OwnedFd::from_raw_fd(raw));
                }
            }
            cmsg = libc::CMSG_NXTHDR(&msg, cmsg);
        }
        if n == 0 && fds.is_empty() {
            return Ok(None);
        }
        Ok(Some((n, fds)))
    }
}

fn reply(reply: &InitReply) {
    let body = serde_json::to_vec(reply).unwrap_or_default();
    let _ = send_with_fds(CTRL_FD, &body, &[]);
}

// ---------------------------------------------------------------------------------------------
// Entry.

/// Run as the init if this process was started as one; never returns then.
pub(crate) fn run_if_init() {
    if std::env::var_os(INIT_ENV).is_none() {
        return;
    }
    // SAFETY: single-threaded at this point (before main or first thing in it); the variable
    // is ours.
    unsafe { std::env::remove_var(INIT_ENV) };
    let code = match outer() {
        Ok(code) => code,
        Err(f) => {
            reply(&InitReply::Failed {
                step: f.step,
                message: f.message,
                errno: f.errno,
            });
            1
        }
    };
    // SAFETY: _exit ends the process without running atexit handlers of a program whose main
    // never ran.
    unsafe { libc::_exit(code) }
}

fn outer() -> R<i32> {
    // SAFETY: plain fcntl on our descriptor.
    cvt("control socket", unsafe {
        libc::fcntl(CTRL_FD, libc::F_SETFD, libc::FD_CLOEXEC)
    })?;
    let mut buf = vec![0u8; MAX_FRAME.min(1 << 20)];
    let (n, _) = recv_with_fds(CTRL_FD, &mut buf)
        .map_err(|e| Fail::os("read the configuration", e))?
        .ok_or_else(|| Fail::msg("read the configuration", "the host closed the socket"))?;
    let config: InitConfig = serde_json::from_slice(&buf[..n])
        .map_err(|e| Fail::msg("read the configuration", e.to_string()))?;
    drop(buf);
    for procs in &config.cgroup_procs {
        fs::write(procs, "0").map_err(|e| Fail::os(format!("join {}", procs.display()), e))?;
    }
    for &(resource, limit) in &config.rlimits {
        let rl = libc::rlimit {
            rlim_cur: limit,
            rlim_max: limit,
        };
        // SAFETY: setrlimit reads the struct.
        cvt("setrlimit", unsafe {
            libc::setrlimit(resource as libc::__rlimit_resource_t, &rl)
        })?;
    }
    let flags = libc::CLONE_NEWUSER
        | libc::CLONE_NEWNS
        | libc::CLONE_NEWPID
        | libc::CLONE_NEWNET
        | libc::CLONE_NEWIPC
        | libc::CLONE_NEWUTS
        | libc::CLONE_NEWCGROUP;
    // SAFETY: this process is single-threaded (a requirement of CLONE_NEWUSER, checked by
    // the kernel).
    cvt("unshare", unsafe { libc::unshare(flags) })?;
    fs::write("/proc/self/setgroups", "deny").map_err(|e| Fail::os("uid map", e))?;
    fs::write("/proc/self/uid_map", format!("0 {} 1\n", config.uid))
        .map_err(|e| Fail::os("uid map", e))?;
    fs::write("/proc/self/gid_map", format!("0 {} 1\n", config.gid))
        .map_err(|e| Fail::os("gid map", e))?;
    // SAFETY: single-threaded, so the child may run arbitrary code.
    let pid = cvt("fork", unsafe { libc::fork() })?;
    if pid == 0 {
        let code = match box_init(&config) {
            Ok(()) => 0,
            Err(f) => {
                reply(&InitReply::Failed {
                    step: f.step,
                    message: f.message,
                    errno: f.errno,
                });
                1
            }
        };
        // SAFETY: see run_if_init.
        unsafe { libc::_exit(code) }
    }
    // SAFETY: the child holds its own copy.
    unsafe { libc::close(CTRL_FD) };
    let mut status = 0;
    loop {
        // SAFETY: waits for our child.
        let r = unsafe { libc::waitpid(pid, &mut status, 0) };
        if r == pid {
            break;
        }
        if r < 0 && io::Error::last_os_error().kind() != io::ErrorKind::Interrupted {
            return Ok(1);
        }
    }
    Ok(if libc::WIFEXITED(status) {
        libc::WEXITSTATUS(status)
    } else {
        128 + libc::WTERMSIG(status)
    })
}

// ---------------------------------------------------------------------------------------------
// The box's init.

fn box_init(config: &InitConfig) -> R<()> {
    // SAFETY: prctl with integer arguments.
    cvt("pdeathsig", unsafe {
        libc::prctl(
            libc::PR_SET_PDEATHSIG,
            libc::SIGKILL as libc::c_ulong,
            0,
            0,
            0,
        )
    })?;
    // Not dumpable: a command of the same uid cannot open its /proc/<pid>/mem, nor its
    // exec inits' (they inherit it and exec nothing).
    // SAFETY: prctl with integer arguments.
    cvt("dumpable", unsafe {
        libc::prctl(libc::PR_SET_DUMPABLE, 0, 0, 0, 0)
    })?;
    let host = config.hostname.as_bytes();
    // SAFETY: pointer and length of a live slice.
    cvt("sethostname", unsafe {
        libc::sethostname(host.as_ptr().cast(), host.len())
    })?;
    build_root(config)?;
    loopback_up()?;
    pivot(&config.new_root)?;
    let mut report = Report {
        namespaces: ["user", "mount", "pid", "net", "ipc", "uts", "cgroup"]
            .into_iter()
            .map(str::to_owned)
            .collect(),
        landlock_abi: crate::landlock_abi(),
        ..Report::default()
    };
    if config.landlock {
        report.landlock = apply_landlock(config)?;
    } else {
        report.landlock = "off".to_owned();
    }
    // SAFETY: prctl with integer arguments.
    cvt("no_new_privs", unsafe {
        libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)
    })?;
    report.no_new_privs = true;
    if config.seccomp {
        let programs = crate::seccomp::denylist().map_err(|e| Fail::msg("seccomp", e))?;
        crate::seccomp::apply(&programs).map_err(|e| Fail::msg("seccomp", e))?;
        report.seccomp = true;
    }
    report.capabilities_dropped = true;
    // Exec inits are reaped by the kernel.
    // SAFETY: setting a signal disposition to SIG_IGN.
    unsafe { libc::signal(libc::SIGCHLD, libc::SIG_IGN) };
    reply(&InitReply::Ready(report));
    serve()
}

fn serve() -> R<()> {
    let mut buf = [0u8; 16];
    loop {
        let (n, mut fds) = match recv_with_fds(CTRL_FD, &mut buf) {
            Ok(Some(got)) => got,
            // The host closed the box (or died): everything in it dies with this process.
            Ok(None) => return Ok(()),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(_) => return Ok(()),
        };
        let has_stdin = n >= 1 && buf[0] == b'I';
        let want = if has_stdin { 4 } else { 3 };
        if n < 1 || fds.len() != want {
            continue;
        }
        // SAFETY: a raw clone without CLONE_VM behaves as fork (the child gets a copy of
        // the address space and continues here); this process is single-threaded. The
        // child is PID 1 of a new PID namespace.
        let pid = unsafe {
            libc::syscall(
                libc::SYS_clone,
                (libc::CLONE_NEWPID | libc::SIGCHLD) as libc::c_ulong,
                0usize,
                0usize,
                0usize,
                0usize,
            )
        };
        if pid == 0 {
            // SAFETY: the control socket is the box init's, not the command's.
            unsafe { libc::close(CTRL_FD) };
            let stdin = if has_stdin { fds.pop() } else { None };
            let stderr = fds.pop().expect("three descriptors");
            let stdout = fds.pop().expect("three descriptors");
            let stream = fds.pop().expect("three descriptors");
            exec_init(stream, stdout, stderr, stdin);
        }
        // The descriptors are the exec init's now (or the clone failed: dropping them closes
        // the stream, which the host reads as a failed start).
        drop(fds);
    }
}

// ---------------------------------------------------------------------------------------------
// One command.

fn send_status(stream: RawFd, status: &ExecStatus) {
    let body = serde_json::to_vec(status).unwrap_or_default();
    let _ = write_frame(stream, &body);
}

fn start_error(stream: RawFd, message: String) -> ! {
    send_status(
        stream,
        &ExecStatus {
            code: None,
            signal: None,
            error: Some(message),
        },
    );
    // SAFETY: ends the exec init, and with it its PID namespace.
    unsafe { libc::_exit(0) }
}

fn drop_capabilities() -> io::Result<()> {
    let last: u32 = fs::read_to_string("/proc/sys/kernel/cap_last_cap")
        .ok()
        .and_then(|s| s.trim().parse().ok())
        .unwrap_or(40);
    // SAFETY: prctl and capset with integer arguments and live structs.
    unsafe {
        // Root inside the box keeps no capabilities across exec either.
        let bits = 0x1 | 0x2 | 0x4 | 0x8 | 0x40 | 0x80; // NOROOT(+LOCKED), NO_SETUID_FIXUP(+LOCKED), NO_CAP_AMBIENT_RAISE(+LOCKED)
        if libc::prctl(libc::PR_SET_SECUREBITS, bits as libc::c_ulong, 0, 0, 0) < 0 {
            return Err(io::Error::last_os_error());
        }
        for cap in 0..=last {
            if libc::prctl(libc::PR_CAPBSET_DROP, cap as libc::c_ulong, 0, 0, 0) < 0
                && io::Error::last_os_error().raw_os_error() != Some(libc::EINVAL)
            {
                return Err(io::Error::last_os_error());
            }
        }
        libc::prctl(
            libc::PR_CAP_AMBIENT,
            libc::PR_CAP_AMBIENT_CLEAR_ALL as libc::c_ulong,
            0,
            0,
            0,
        );
        #[repr(C)]
        struct Header {
            version: u32,
            pid: i32,
        }
        #[repr(C)]
        struct Data {
            effective: u32,
            permitted: u32,
            inheritable: u32,
        }
        let mut header = Header {
            version: 0x2008_0522,
            pid: 0,
        };
        let data = [
            Data {
                effective: 0,
                permitted: 0,
                inheritable: 0,
            },
            Data {
                effective: 0,
                permitted: 0,
                inheritable: 0,
            },
        ];
        if libc::syscall(libc::SYS_capset, &mut header, data.as_ptr()) < 0 {
            return Err(io::Error::last_os_error());
        }
    }
    Ok(())
}

/// The program to exec: `argv[0]` if it has a `/`, else the first executable match in
/// `PATH` (as execvp).
fn resolve_program(program: &str, env: &[String]) -> Option<PathBuf> {
    if program.contains('/') {
        return Some(PathBuf::from(program));
    }
    let path = env
        .iter()
        .find_map(|kv| kv.strip_prefix("PATH="))
        .unwrap_or(crate::DEFAULT_PATH);
    path.split(':').filter(|d| !d.is_empty()).find_map(|dir| {
        let candidate = Path::new(dir).join(program);
        let meta = fs::metadata(&candidate).ok()?;
        (meta.is_file() && meta.permissions().mode() & 0o111 != 0).then_some(candidate)
    })
}

fn exec_init(stream: OwnedFd, stdout: OwnedFd, stderr: OwnedFd, stdin: Option<OwnedFd>) -> ! {
    let sock = stream.as_raw_fd();
    // SAFETY: restoring default dispositions in this single-threaded process.
    unsafe {
        libc::signal(libc::SIGCHLD, libc::SIG_DFL);
    }
    let frame = match read_frame(sock).and_then(|b| {
        serde_json::from_slice::<ExecFrame>(&b)
            .map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e))
    }) {
        Ok(f) => f,
        // The host gave up before sending: nothing to run.
        // SAFETY: see start_error.
        Err(_) => unsafe { libc::_exit(0) },
    };
    if let Err(e) = drop_capabilities() {
        start_error(sock, format!("cannot drop capabilities: {e}"));
    }
    if frame.argv.is_empty() {
        start_error(sock, "the argument vector is empty".into());
    }
    let Some(program) = resolve_program(&frame.argv[0], &frame.env) else {
        start_error(sock, "No such file or directory (os error 2)".into());
    };
    let to_c = |s: &str| CString::new(s).ok();
    let argv: Option<Vec<CString>> = frame.argv.iter().map(|a| to_c(a)).collect();
    let envp: Option<Vec<CString>> = frame.env.iter().map(|a| to_c(a)).collect();
    let (Some(argv), Some(envp)) = (argv, envp) else {
        start_error(sock, "an argument or variable contains NUL".into());
    };
    let prog = cstr(&program);
    let cwd = cstr(&frame.cwd);
    let mut argv_p: Vec<*const libc::c_char> = argv.iter().map(|c| c.as_ptr()).collect();
    argv_p.push(std::ptr::null());
    let mut envp_p: Vec<*const libc::c_char> = envp.iter().map(|c| c.as_ptr()).collect();
    envp_p.push(std::ptr::null());
    let null_in;
    let stdin_fd = match &stdin {
        Some(fd) => fd.as_raw_fd(),
        None => {
            // SAFETY: open of a constant path.
            null_in =
                unsafe { libc::open(c"/dev/null".as_ptr(), libc::O_RDONLY | libc::O_CLOEXEC) };
            null_in
        }
    };
    let mut errpipe = [0 as RawFd; 2];
    // SAFETY: pipe2 fills the array.
    if unsafe { libc::pipe2(errpipe.as_mut_ptr(), libc::O_CLOEXEC) } < 0 {
        start_error(sock, format!("pipe: {}", io::Error::last_os_error()));
    }
    let (out_fd, err_fd) = (stdout.as_raw_fd(), stderr.as_raw_fd());
    // SAFETY: single-threaded; the child only makes async-signal-safe calls on data built
    // before the fork.
    let pid = unsafe { libc::fork() };
    if pid < 0 {
        start_error(sock, format!("fork: {}", io::Error::last_os_error()));
    }
    if pid == 0 {
        // SAFETY: as above.
        unsafe {
            let fail = |step: i32| -> ! {
                let err = [step, *libc::__errno_location()];
                libc::write(errpipe[1], err.as_ptr().cast(), 8);
                libc::_exit(127)
            };
            libc::setsid();
            let mut set: libc::sigset_t = std::mem::zeroed();
            libc::sigemptyset(&mut set);
            libc::sigprocmask(libc::SIG_SETMASK, &set, std::ptr::null_mut());
            libc::signal(libc::SIGPIPE, libc::SIG_DFL);
            if stdin_fd < 0
                || libc::dup2(stdin_fd, 0) < 0
                || libc::dup2(out_fd, 1) < 0
                || libc::dup2(err_fd, 2) < 0
            {
                fail(1);
            }
            // Nothing else of the init reaches the command.
            libc::syscall(
                libc::SYS_close_range,
                3u32,
                u32::MAX,
                libc::CLOSE_RANGE_CLOEXEC,
            );
            if libc::chdir(cwd.as_ptr()) < 0 {
                fail(2);
            }
            libc::execve(prog.as_ptr(), argv_p.as_ptr(), envp_p.as_ptr());
            fail(3)
        }
    }
    // SAFETY: closing our copies.
    unsafe { libc::close(errpipe[1]) };
    drop(stdout);
    drop(stderr);
    drop(stdin);
    let mut err = [0i32; 2];
    // SAFETY: reads at most 8 bytes into `err`.
    let n = unsafe { libc::read(errpipe[0], err.as_mut_ptr().cast(), 8) };
    if n == 8 {
        let e = io::Error::from_raw_os_error(err[1]);
        let what = match err[0] {
            1 => "cannot set up its standard streams".to_owned(),
            2 => format!("cannot enter {}: {e}", frame.cwd.display()),
            _ => e.to_string(),
        };
        start_error(sock, what);
    }
    // SAFETY: pidfd_open of our child.
    let pidfd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid, 0) } as RawFd;
    loop {
        let mut fds = [
            libc::pollfd {
                fd: sock,
                events: libc::POLLIN,
                revents: 0,
            },
            libc::pollfd {
                fd: pidfd,
                events: libc::POLLIN,
                revents: 0,
            },
        ];
        // SAFETY: poll on a live array.
        let r = unsafe { libc::poll(fds.as_mut_ptr(), 2, if pidfd < 0 { 50 } else { -1 }) };
        if r < 0 {
            continue;
        }
        if fds[0].revents != 0 {
            // The host hung up or asked for the kill: exiting kills everything here.
            // SAFETY: _exit.
            unsafe { libc::_exit(0) }
        }
        let mut status = 0;
        // SAFETY: waits for our child without blocking.
        let r = unsafe { libc::waitpid(pid, &mut status, libc::WNOHANG) };
        if r == pid {
            let st = if libc::WIFEXITED(status) {
                ExecStatus {
                    code: Some(libc::WEXITSTATUS(status)),
                    signal: None,
                    error: None,
                }
            } else {
                ExecStatus {
                    code: None,
                    signal: Some(libc::WTERMSIG(status)),
                    error: None,
                }
            };
            send_status(sock, &st);
            // SAFETY: _exit; the kernel kills what the command left in this namespace.
            unsafe { libc::_exit(0) }
        }
        // Orphans reparented here are reaped as they come.
        // SAFETY: non-blocking wait for any child.
        while unsafe { libc::waitpid(-1, std::ptr::null_mut(), libc::WNOHANG) } > 0 {}
    }
}

// ---------------------------------------------------------------------------------------------
// The root file system.

fn mount(
    src: Option<&Path>,
    dst: &Path,
    fstype: Option<&CStr>,
    flags: libc::c_ulong,
    data: Option<&str>,
) -> R<()> {
    let src_c = src.map(cstr);
    let dst_c = cstr(dst);
    let data_c = data.map(|d| CString::new(d).expect("mount options without NUL"));
    // SAFETY: every pointer is a live NUL-terminated string or null.
    let r = unsafe {
        libc::mount(
            src_c.as_ref().map_or(std::ptr::null(), |c| c.as_ptr()),
            dst_c.as_ptr(),
            fstype.map_or(std::ptr::null(), CStr::as_ptr),
            flags,
            data_c
                .as_ref()
                .map_or(std::ptr::null(), |c| c.as_ptr().cast()),
        )
    };
    if r < 0 {
        let e = io::Error::last_os_error();
        return Err(Fail::os(
            format!(
                "mount {} on {}",
                src.map_or("-".into(), |p| p.display().to_string()),
                dst.display()
            ),
            e,
        ));
    }
    Ok(())
}

/// The flags of the mount holding `path` that an unprivileged remount must keep (they are
/// locked when a mount is shared into a user namespace).
fn locked_flags(path: &Path) -> libc::c_ulong {
    let p = cstr(path);
    // SAFETY: statvfs fills the struct.
    let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
    if unsafe { libc::statvfs(p.as_ptr(), &mut st) } < 0 {
        return 0;
    }
    let f = st.f_flag;
    let mut out = 0;
    for (st_flag, ms) in [
        (libc::ST_NOSUID, libc::MS_NOSUID),
        (libc::ST_NODEV, libc::MS_NODEV),
        (libc::ST_NOEXEC, libc::MS_NOEXEC),
        (libc::ST_NOATIME, libc::MS_NOATIME),
        (libc::ST_NODIRATIME, libc::MS_NODIRATIME),
        (libc::ST_RELATIME, libc::MS_RELATIME),
    ] {
        if f & st_flag != 0 {
            out |= ms;
        }
    }
    out
}

fn bind(src: &Path, dst: &Path, read_only: bool, extra: libc::c_ulong) -> R<()> {
    mount(Some(src), dst, None, libc::MS_BIND | libc::MS_REC, None)?;
    let mut flags = libc::MS_REMOUNT | libc::MS_BIND | libc::MS_NOSUID | locked_flags(dst) | extra;
    if read_only {
        flags |= libc::MS_RDONLY;
    }
    mount(None, dst, None, flags, None)
}

fn inside(root: &Path, path: &Path) -> PathBuf {
    root.join(path.strip_prefix("/").unwrap_or(path))
}

fn mkdir_p(path: &Path) -> R<()> {
    fs::create_dir_all(path).map_err(|e| Fail::os(format!("mkdir {}", path.display()), e))
}

fn touch(path: &Path) -> R<()> {
    if let Some(parent) = path.parent() {
        mkdir_p(parent)?;
    }
    fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(path)
        .map(drop)
        .map_err(|e| Fail::os(format!("create {}", path.display()), e))
}

fn symlink(target: &Path, at: &Path) -> R<()> {
    if let Some(parent) = at.parent() {
        mkdir_p(parent)?;
    }
    std::os::unix::fs::symlink(target, at)
        .map_err(|e| Fail::os(format!("symlink {}", at.display()), e))
}

/// Files and directories under `/etc` that are not readable by everyone (shadow, gshadow,
/// sudoers, SSH host keys, TLS private keys...): the box's root may own them, so they are
/// masked rather than trusted to their mode. Bounded: depth 6, 50,000 entries.
fn etc_secrets() -> Vec<(PathBuf, bool)> {
    let mut out = Vec::new();
    let mut stack = vec![(PathBuf::from("/etc"), 0)];
    let mut seen = 0usize;
    while let Some((dir, depth)) = stack.pop() {
        let Ok(entries) = fs::read_dir(&dir) else {
            continue;
        };
        for entry in entries.flatten() {
            seen += 1;
            if seen > 50_000 {
                return out;
            }
            let Ok(meta) = entry.path().symlink_metadata() else {
                continue;
            };
            let world_readable = meta.mode() & 0o004 != 0;
            if meta.is_dir() {
                if !world_readable || meta.mode() & 0o001 == 0 {
                    out.push((entry.path(), true));
                } else if depth < 6 {
                    stack.push((entry.path(), depth + 1));
                }
            } else if meta.is_file() && !world_readable {
                out.push((entry.path(), false));
            }
        }
    }
    out
}

fn build_root(config: &InitConfig) -> R<()> {
    let root = &config.new_root;
    mount(
        None,
        Path::new("/"),
        None,
        libc::MS_REC | libc::MS_PRIVATE,
        None,
    )?;
    mount(
        Some(Path::new("tmpfs")),
        root,
        Some(c"tmpfs"),
        libc::MS_NOSUID | libc::MS_NODEV,
        Some("mode=0755,size=4m"),
    )?;
    // A private /tmp.
    let tmp = inside(root, Path::new("/tmp"));
    mkdir_p(&tmp)?;
    mount(
        Some(Path::new("tmpfs")),
        &tmp,
        Some(c"tmpfs"),
        libc::MS_NOSUID | libc::MS_NODEV,
        Some(&format!("mode=1777,size={}", config.tmp_size.max(4096))),
    )?;
    // A minimal /dev.
    let dev = inside(root, Path::new("/dev"));
    mkdir_p(&dev)?;
    mount(
        Some(Path::new("tmpfs")),
        &dev,
        Some(c"tmpfs"),
        libc::MS_NOSUID | libc::MS_NOEXEC,
        Some("mode=0755,size=64k"),
    )?;
    for name in ["null", "zero", "full", "random", "urandom", "tty"] {
        let host = Path::new("/dev").join(name);
        if host.exists() {
            let at = dev.join(name);
            touch(&at)?;
            mount(Some(&host), &at, None, libc::MS_BIND, None)?;
        }
    }
    let pts = dev.join("pts");
    mkdir_p(&pts)?;
    mount(
        Some(Path::new("devpts")),
        &pts,
        Some(c"devpts"),
        libc::MS_NOSUID | libc::MS_NOEXEC,
        Some("newinstance,ptmxmode=0666,mode=0620"),
    )?;
    symlink(Path::new("pts/ptmx"), &dev.join("ptmx"))?;
    let shm = dev.join("shm");
    mkdir_p(&shm)?;
    mount(
        Some(Path::new("tmpfs")),
        &shm,
        Some(c"tmpfs"),
        libc::MS_NOSUID | libc::MS_NODEV,
        Some(&format!("mode=1777,size={}", config.tmp_size.max(4096))),
    )?;
    for (name, target) in [
        ("fd", "/proc/self/fd"),
        ("stdin", "/proc/self/fd/0"),
        ("stdout", "/proc/self/fd/1"),
        ("stderr", "/proc/self/fd/2"),
    ] {
        symlink(Path::new(target), &dev.join(name))?;
    }
    // A fresh /proc of the box's PID namespace, its kernel knobs read-only.
    let proc_ = inside(root, Path::new("/proc"));
    mkdir_p(&proc_)?;
    mount(
        Some(Path::new("proc")),
        &proc_,
        Some(c"proc"),
        libc::MS_NOSUID | libc::MS_NODEV | libc::MS_NOEXEC,
        None,
    )?;
    for knob in [
        "sys",
        "sysrq-trigger",
        "irq",
        "bus",
        "fs",
        "kcore",
        "keys",
        "timer_list",
    ] {
        let p = proc_.join(knob);
        if p.exists() {
            bind(&p, &p, true, libc::MS_NODEV | libc::MS_NOEXEC)?;
        }
    }
    // The host's system directories, read-only.
    for dir in &config.system_dirs {
        let Ok(meta) = dir.symlink_metadata() else {
            continue;
        };
        let at = inside(root, dir);
        if meta.file_type().is_symlink() {
            let target = fs::read_link(dir).map_err(|e| Fail::os("readlink", e))?;
            symlink(&target, &at)?;
        } else if meta.is_dir() {
            mkdir_p(&at)?;
            bind(dir, &at, true, libc::MS_NODEV)?;
        }
    }
    if config.mask_secrets {
        for (path, is_dir) in etc_secrets() {
            let at = inside(root, &path);
            if is_dir {
                mount(
                    Some(Path::new("tmpfs")),
                    &at,
                    Some(c"tmpfs"),
                    libc::MS_RDONLY | libc::MS_NOSUID | libc::MS_NODEV | libc::MS_NOEXEC,
                    Some("size=4k,mode=0555"),
                )?;
            } else {
                bind(
                    Path::new("/dev/null"),
                    &at,
                    true,
                    libc::MS_NODEV | libc::MS_NOEXEC,
                )?;
            }
        }
    }
    // The workspace and the spec's bind mounts.
    for b in &config.binds {
        let at = inside(root, &b.target);
        let meta = b
            .source
            .metadata()
            .map_err(|e| Fail::os(format!("bind source {}", b.source.display()), e))?;
        if meta.is_dir() {
            mkdir_p(&at)?;
        } else {
            touch(&at)?;
        }
        bind(&b.source, &at, b.read_only, libc::MS_NODEV)?;
    }
    Ok(())
}

fn loopback_up() -> R<()> {
    // SAFETY: a datagram socket for the interface ioctls; ifreq is plain data, its name
    // NUL-terminated.
    unsafe {
        let s = libc::socket(libc::AF_INET, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, 0);
        cvt("loopback socket", s)?;
        let s = OwnedFd::from_raw_fd(s);
        let mut req: libc::ifreq = std::mem::zeroed();
        req.ifr_name[0] = b'l' as libc::c_char;
        req.ifr_name[1] = b'o' as libc::c_char;
        cvt(
            "loopback flags",
            libc::ioctl(s.as_raw_fd(), libc::SIOCGIFFLAGS, &mut req),
        )?;
        req.ifr_ifru.ifru_flags |= (libc::IFF_UP | libc::IFF_RUNNING) as libc::c_short;
        cvt(
            "loopback up",
            libc::ioctl(s.as_raw_fd(), libc::SIOCSIFFLAGS, &req),
        )?;
    }
    Ok(())
}

fn pivot(root: &Path) -> R<()> {
    let old = root.join(".oldroot");
    mkdir_p(&old)?;
    let root_c = cstr(root);
    // SAFETY: chdir and the pivot_root syscall on live strings.
    unsafe {
        cvt("chdir new root", libc::chdir(root_c.as_ptr()))?;
        cvt(
            "pivot_root",
            libc::syscall(libc::SYS_pivot_root, c".".as_ptr(), c".oldroot".as_ptr()) as i32,
        )?;
        cvt("chdir /", libc::chdir(c"/".as_ptr()))?;
        cvt(
            "detach old root",
            libc::umount2(c"/.oldroot".as_ptr(), libc::MNT_DETACH),
        )?;
    }
    fs::remove_dir("/.oldroot").map_err(|e| Fail::os("remove old root", e))?;
    mount(
        None,
        Path::new("/"),
        None,
        libc::MS_REMOUNT | libc::MS_RDONLY | libc::MS_NOSUID | libc::MS_NODEV,
        None,
    )?;
    mount(
        None,
        Path::new("/dev"),
        None,
        libc::MS_REMOUNT | libc::MS_RDONLY | libc::MS_NOSUID | libc::MS_NOEXEC,
        None,
    )?;
    Ok(())
}

fn apply_landlock(config: &InitConfig) -> R<String> {
    use landlock::{
        ABI, Access, AccessFs, Ruleset, RulesetAttr, RulesetCreatedAttr, RulesetStatus, Scope,
        path_beneath_rules,
    };
    let kernel = crate::landlock_abi();
    if kernel <= 0 {
        return Err(Fail::msg(
            "landlock",
            "Landlock is not available in this kernel",
        ));
    }
    // The highest ABI both the kernel and the crate know.
    let abi = ABI::from(kernel.min(7));
    let fail = |e: landlock::RulesetError| Fail::msg("landlock", e.to_string());
    let read = AccessFs::from_read(abi);
    let all = AccessFs::from_all(abi);
    let mut writable: Vec<PathBuf> = vec!["/tmp".into(), "/dev".into()];
    let mut read_only: Vec<PathBuf> = vec!["/".into()];
    for b in &config.binds {
        if b.read_only {
            read_only.push(b.target.clone());
        } else {
            writable.push(b.target.clone());
        }
    }
    let status = Ruleset::default()
        .handle_access(all)
        .map_err(fail)?
        .scope(Scope::from_all(abi))
        .map_err(fail)?
        .create()
        .map_err(fail)?
        .add_rules(path_beneath_rules(&read_only, read))
        .map_err(fail)?
        .add_rules(path_beneath_rules(&writable, all))
        .map_err(fail)?
        .restrict_self()
        .map_err(fail)?;
    Ok(match status.ruleset {
        RulesetStatus::FullyEnforced => "fully enforced",
        RulesetStatus::PartiallyEnforced => "partially enforced",
        RulesetStatus::NotEnforced => "not enforced",
    }
    .to_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_hostile_frame_length_is_refused_before_it_sizes_a_buffer() {
        let (a, b) = std::os::unix::net::UnixStream::pair().unwrap();
        use std::io::Write as _;
        (&a).write_all(&(u32::MAX).to_le_bytes()).unwrap();
        let e = read_frame(b.as_raw_fd()).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::InvalidData, "{e}");
    }

    #[test]
    fn frames_round_trip() {
        let (a, b) = std::os::unix::net::UnixStream::pair().unwrap();
        write_frame(a.as_raw_fd(), b"hello").unwrap();
        assert_eq!(read_frame(b.as_raw_fd()).unwrap(), b"hello");
    }
}
