//! Kernel confinement of sandbox-harness's local boxes.
//!
//! A [`Confined`] box is one long-lived init process (this very binary, re-executed through
//! `/proc/self/exe`) in its own user, mount, PID, network, IPC, UTS and cgroup namespaces,
//! started with the box and killed with it. Each command is a request to that init, which
//! runs it in a nested PID namespace, so every command costs a fork, not a namespace build.
//!
//! Inside a box:
//!
//! - the root is a read-only tmpfs holding read-only binds of the host's system directories
//!   ([`ConfineOptions::system_dirs`], `/usr`, `/bin`, `/lib*`, `/etc`...), `/etc`'s
//!   secrets masked (every file or directory under it not readable by everyone: shadow,
//!   gshadow, sudoers, SSH host keys); nothing of `/root`, `/home`, `/run`, `/var` or the
//!   host's `/tmp`, so no host Unix socket (docker.sock, SSH agent, D-Bus);
//! - the [`Bind`]s (the workspace, read-write, at its host path; the spec's bind mounts,
//!   `read_only` honoured) are the only writable places besides a private `/tmp` and
//!   `/dev/shm`;
//! - a fresh `/proc` (its `sys`, `sysrq-trigger` and other kernel knobs read-only), a minimal
//!   `/dev` (null, zero, full, random, urandom, tty, a private pts instance, shm), no `/sys`;
//! - a network namespace with only its own loopback (up), no route anywhere else;
//! - root of the box is the calling user (uid and gid mapped 1:1, `setgroups` denied); every
//!   command runs with no capabilities (bounding set empty, securebits locked, so `exec` of a
//!   set-uid binary or as root gains none), no_new_privs, a Landlock domain (writes only to
//!   the writable places; signals and abstract sockets scoped to the box, when the ABI has
//!   them) and a seccomp denylist ([`seccomp`]).
//!
//! # Embedding
//!
//! The init is this binary run again with a marker variable. A constructor of this crate
//! (in `.init_array`) dispatches it before `main` runs, so it works in any binary that links
//! this crate, test harnesses included. A program that prefers an explicit call (or whose
//! linker drops constructors) calls [`init_if_child`] first thing in `main`; the call returns
//! at once in a normal run.

use std::fmt;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::process::CommandExt as _;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

mod cgroup;
mod init;
pub mod seccomp;

pub use cgroup::{CgroupLayout, cgroup_layout};
pub use init::ExecStatus;

/// `PATH` used to look a program up when a command's environment has none.
pub const DEFAULT_PATH: &str = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";

/// How long [`Confined::start`] waits for the init to report.
const START_TIMEOUT: Duration = Duration::from_secs(10);

/// Dispatch the box init if this process was started as one (it then never returns);
/// return at once otherwise. Also runs automatically before `main` (see the crate docs).
pub fn init_if_child() {
    init::run_if_init();
}

/// The constructor that makes every binary linking this crate able to serve as a box init.
#[used]
#[unsafe(link_section = ".init_array")]
static INIT_HOOK: extern "C" fn() = {
    extern "C" fn hook() {
        init::run_if_init();
    }
    hook
};

/// One host path shown inside the box.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Bind {
    /// The host path (a directory or a file).
    pub source: PathBuf,
    /// Where it appears inside the box (absolute).
    pub target: PathBuf,
    /// Mounted read-only.
    pub read_only: bool,
}

impl Bind {
    /// `source` at the same path inside the box.
    pub fn same(source: impl Into<PathBuf>, read_only: bool) -> Bind {
        let source = source.into();
        Bind {
            target: source.clone(),
            source,
            read_only,
        }
    }
}

/// Whether a protection is demanded, taken if the kernel has it, or not applied.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[non_exhaustive]
pub enum Need {
    /// Starting a box fails ([`ConfineError::Unavailable`]) if it cannot be had.
    #[default]
    Required,
    /// Used if the kernel allows it; [`Report`] says whether it was.
    IfAvailable,
    /// Not applied.
    Off,
}

/// Resource limits of one box (all its processes together).
///
/// | limit | default |
/// | --- | --- |
/// | [`pids`](Self::pids) | 512 (Docker's `--pids-limit` habit) |
/// | [`memory`](Self::memory) | 2 GiB |
/// | [`cpu`](Self::cpu) | none |
/// | [`enforce`](Self::enforce) | [`Need::IfAvailable`] for the defaults; a limit set with a setter is [`Need::Required`] |
///
/// Enforced by the box's own cgroups (v2, or v1's `pids`, `memory` and `cpu` controllers)
/// where this process can create them. Without writable cgroups, `pids` falls back to
/// `RLIMIT_NPROC` (counted per user namespace, so per box) and `memory` to `RLIMIT_AS` per
/// process (weaker: a box may hold that much in each process); a CPU limit has no fallback.
/// A limit that cannot be enforced is a [`ConfineError::Unavailable`] when `enforce` is
/// [`Need::Required`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[non_exhaustive]
pub struct Limits {
    /// Most processes and threads at once.
    pub pids: Option<u64>,
    /// Most memory in bytes.
    pub memory: Option<u64>,
    /// Most CPU time, in CPUs (1.5 = one and a half cores).
    pub cpu: Option<f64>,
    /// What happens when a limit cannot be enforced.
    pub enforce: Need,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            pids: Some(512),
            memory: Some(2 << 30),
            cpu: None,
            enforce: Need::IfAvailable,
        }
    }
}

impl Limits {
    /// No limits.
    pub fn none() -> Limits {
        Limits {
            pids: None,
            memory: None,
            cpu: None,
            enforce: Need::Off,
        }
    }
    /// Set the pids limit (and require enforcement).
    pub fn pids(mut self, n: u64) -> Self {
        self.pids = Some(n);
        self.enforce = Need::Required;
        self
    }
    /// Set the memory limit in bytes (and require enforcement).
    pub fn memory(mut self, bytes: u64) -> Self {
        self.memory = Some(bytes);
        self.enforce = Need::Required;
        self
    }
    /// Set the CPU limit in CPUs (and require enforcement).
    pub fn cpu(mut self, cpus: f64) -> Self {
        self.cpu = Some(cpus);
        self.enforce = Need::Required;
        self
    }
}

/// How boxes are confined.
///
/// | option | default |
/// | --- | --- |
/// | [`system_dirs`](Self::system_dirs) | `/usr`, `/bin`, `/sbin`, `/lib`, `/lib32`, `/lib64`, `/libx32`, `/etc` (those that exist) |
/// | [`mask_secrets`](Self::mask_secrets) | `true` |
/// | [`tmp_size`](Self::tmp_size) | 256 MiB (each of `/tmp` and `/dev/shm`) |
/// | [`landlock`](Self::landlock) | [`Need::Required`] |
/// | [`seccomp`](Self::seccomp) | [`Need::Required`] |
/// | [`limits`](Self::limits) | [`Limits::default`] |
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[non_exhaustive]
pub struct ConfineOptions {
    /// Host directories shown read-only at their own path.
    pub system_dirs: Vec<PathBuf>,
    /// Mask every file and directory under `/etc` that is not readable by everyone.
    pub mask_secrets: bool,
    /// Size of the private `/tmp` (and `/dev/shm`) in bytes.
    pub tmp_size: u64,
    /// Landlock as a second wall.
    pub landlock: Need,
    /// The seccomp denylist.
    pub seccomp: Need,
    /// Resource limits.
    pub limits: Limits,
}

impl Default for ConfineOptions {
    fn default() -> Self {
        ConfineOptions {
            system_dirs: [
                "/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/etc",
            ]
            .into_iter()
            .map(PathBuf::from)
            .collect(),
            mask_secrets: true,
            tmp_size: 256 << 20,
            landlock: Need::Required,
            seccomp: Need::Required,
            limits: Limits::default(),
        }
    }
}

impl ConfineOptions {
    /// Set the Landlock requirement.
    pub fn landlock(mut self, need: Need) -> Self {
        self.landlock = need;
        self
    }
    /// Set the seccomp requirement.
    pub fn seccomp(mut self, need: Need) -> Self {
        self.seccomp = need;
        self
    }
    /// Set the resource limits.
    pub fn limits(mut self, limits: Limits) -> Self {
        self.limits = limits;
        self
    }
    /// Set the system directories.
    pub fn system_dirs<I, P>(mut self, dirs: I) -> Self
    where
        I: IntoIterator<Item = P>,
        P: Into<PathBuf>,
    {
        self.system_dirs = dirs.into_iter().map(Into::into).collect();
        self
    }
}

/// What a box got.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[non_exhaustive]
pub struct Report {
    /// The namespaces the box has of its own.
    pub namespaces: Vec<String>,
    /// The kernel's Landlock ABI (0: none).
    pub landlock_abi: i32,
    /// `fully enforced`, `partially enforced`, `not enforced` or `off`.
    pub landlock: String,
    /// The seccomp denylist is installed.
    pub seccomp: bool,
    /// no_new_privs is set.
    pub no_new_privs: bool,
    /// Commands run with no capabilities.
    pub capabilities_dropped: bool,
    /// How each limit is enforced, e.g. `pids=512 (cgroup v1)`, `memory=2147483648 (RLIMIT_AS)`.
    pub limits: Vec<String>,
}

impl fmt::Display for Report {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "namespaces {}; seccomp {}; Landlock ABI {} {}; no_new_privs {}; capabilities {}; limits {}",
            self.namespaces.join(","),
            if self.seccomp { "on" } else { "off" },
            self.landlock_abi,
            self.landlock,
            self.no_new_privs,
            if self.capabilities_dropped {
                "none"
            } else {
                "kept"
            },
            if self.limits.is_empty() {
                "none".to_owned()
            } else {
                self.limits.join(", ")
            }
        )
    }
}

/// Why a box could not be confined.
#[derive(Debug)]
#[non_exhaustive]
pub enum ConfineError {
    /// A required protection is not available here.
    Unavailable {
        /// What is missing.
        missing: String,
        /// How to make it available.
        how_to_enable: String,
    },
    /// Setting the box up failed.
    Failed {
        /// The step that failed.
        step: String,
        /// What happened.
        message: String,
    },
}

impl fmt::Display for ConfineError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ConfineError::Unavailable {
                missing,
                how_to_enable,
            } => write!(f, "{missing} unavailable: {how_to_enable}"),
            ConfineError::Failed { step, message } => write!(f, "{step}: {message}"),
        }
    }
}

impl std::error::Error for ConfineError {}

fn failed(step: &str, e: impl fmt::Display) -> ConfineError {
    ConfineError::Failed {
        step: step.to_owned(),
        message: e.to_string(),
    }
}

/// The kernel's Landlock ABI version (0 if it has none).
pub fn landlock_abi() -> i32 {
    // SAFETY: landlock_create_ruleset(NULL, 0, LANDLOCK_CREATE_RULESET_VERSION) only returns
    // a number.
    let v = unsafe {
        libc::syscall(
            libc::SYS_landlock_create_ruleset,
            std::ptr::null::<u8>(),
            0usize,
            1u32,
        )
    };
    v.max(0) as i32
}

/// What unprivileged namespaces need here and is missing, from sysctls (the authoritative
/// answer is [`Confined::start`]'s).
fn userns_hint() -> String {
    let read = |p: &str| std::fs::read_to_string(p).ok().map(|s| s.trim().to_owned());
    let mut hints = Vec::new();
    if read("/proc/sys/user/max_user_namespaces").as_deref() == Some("0") {
        hints.push("sysctl -w user.max_user_namespaces=15000");
    }
    if read("/proc/sys/kernel/unprivileged_userns_clone").as_deref() == Some("0") {
        hints.push("sysctl -w kernel.unprivileged_userns_clone=1");
    }
    if read("/proc/sys/kernel/apparmor_restrict_unprivileged_userns").as_deref() == Some("1") {
        hints.push(
            "sysctl -w kernel.apparmor_restrict_unprivileged_userns=0 (or an AppArmor profile granting `userns`)",
        );
    }
    if hints.is_empty() {
        "allow user namespaces: inside a container run it with --security-opt seccomp=unconfined \
         --security-opt apparmor=unconfined (Docker's default profiles refuse unshare), or use \
         the Docker backend"
            .to_owned()
    } else {
        hints.join("; ")
    }
}

fn classify(step: &str, message: String, errno: i32) -> ConfineError {
    let denied = matches!(
        errno,
        libc::EPERM | libc::EACCES | libc::EINVAL | libc::ENOSPC
    );
    if step == "unshare" || step.ends_with("map") {
        if denied {
            return ConfineError::Unavailable {
                missing: "user namespaces".into(),
                how_to_enable: userns_hint(),
            };
        }
    } else if step.contains(" on ") && step.ends_with("/proc") && denied {
        return ConfineError::Unavailable {
            missing: "a fresh /proc (the host's /proc has paths mounted over, as in a container)"
                .into(),
            how_to_enable: "run the container with --security-opt systempaths=unconfined, or use \
                            the Docker backend"
                .into(),
        };
    } else if step == "landlock" {
        return ConfineError::Unavailable {
            missing: format!("Landlock ({message})"),
            how_to_enable: "Linux >= 5.13 with `landlock` in the `lsm=` boot parameter, or \
                            ConfineOptions::landlock(Need::IfAvailable)"
                .into(),
        };
    } else if step == "seccomp" {
        return ConfineError::Unavailable {
            missing: format!("seccomp ({message})"),
            how_to_enable:
                "a kernel with CONFIG_SECCOMP_FILTER, or ConfineOptions::seccomp(Need::Off)".into(),
        };
    } else if step.starts_with("join ") {
        return ConfineError::Unavailable {
            missing: format!("the box's cgroups ({step}: {message})"),
            how_to_enable: "delegate a writable cgroup to this user, or Limits::none()".into(),
        };
    }
    ConfineError::Failed {
        step: step.to_owned(),
        message,
    }
}

/// One command for [`Confined::spawn`].
#[derive(Clone)]
#[non_exhaustive]
pub struct ExecSpec {
    /// Program and arguments; the program is looked up in the environment's `PATH` when it
    /// has no `/`.
    pub argv: Vec<String>,
    /// The complete environment, `KEY=value` each.
    pub env: Vec<String>,
    /// Working directory (a path inside the box).
    pub cwd: PathBuf,
    /// Whether the command gets a stdin pipe ([`Spawned::stdin`]); else `/dev/null`.
    pub stdin: bool,
}

impl ExecSpec {
    /// `argv` in `cwd` with `env`.
    pub fn new(argv: Vec<String>, env: Vec<String>, cwd: impl Into<PathBuf>) -> ExecSpec {
        ExecSpec {
            argv,
            env,
            cwd: cwd.into(),
            stdin: false,
        }
    }
}

/// Env values are not printed: they may hold secrets.
impl fmt::Debug for ExecSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ExecSpec")
            .field("program", &self.argv.first())
            .field("cwd", &self.cwd)
            .finish_non_exhaustive()
    }
}

/// A started command: its control stream and its pipes. Dropping (or [`kill`](Self::kill)ing)
/// the control stream kills everything the command started.
#[derive(Debug)]
pub struct Spawned {
    /// The command's control stream (a Unix stream socket): its [`ExecStatus`] arrives as
    /// one frame (`u32` little-endian length, then JSON; [`read_status`]).
    pub control: OwnedFd,
    /// Write end of the command's stdin, if asked for.
    pub stdin: Option<OwnedFd>,
    /// Read end of its stdout.
    pub stdout: OwnedFd,
    /// Read end of its stderr.
    pub stderr: OwnedFd,
}

/// Decode the status frame body read from [`Spawned::control`].
pub fn decode_status(body: &[u8]) -> io::Result<ExecStatus> {
    serde_json::from_slice(body).map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e))
}

/// Largest status frame a caller should accept.
pub const MAX_STATUS_FRAME: usize = 64 << 10;

/// Read the status from a blocking control stream.
pub fn read_status(control: &OwnedFd) -> io::Result<ExecStatus> {
    decode_status(&init::read_frame(control.as_raw_fd())?)
}

fn pipe() -> io::Result<(OwnedFd, OwnedFd)> {
    let mut fds = [0 as RawFd; 2];
    // SAFETY: pipe2 fills the array with two new descriptors we then own.
    if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) } < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: fresh descriptors.
    Ok(unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) })
}

fn socketpair(kind: libc::c_int) -> io::Result<(OwnedFd, OwnedFd)> {
    let mut fds = [0 as RawFd; 2];
    // SAFETY: socketpair fills the array with two new descriptors we then own.
    if unsafe {
        libc::socketpair(
            libc::AF_UNIX,
            kind | libc::SOCK_CLOEXEC,
            0,
            fds.as_mut_ptr(),
        )
    } < 0
    {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: fresh descriptors.
    Ok(unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) })
}

/// A confined box: its init runs until [`shutdown`](Self::shutdown) or drop, which kill
/// everything in the box.
pub struct Confined {
    control: Mutex<Option<OwnedFd>>,
    outer: Mutex<Option<Child>>,
    outer_pid: u32,
    report: Report,
    cgroups: Option<cgroup::BoxCgroups>,
    scratch: PathBuf,
}

impl fmt::Debug for Confined {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Confined")
            .field("init_pid", &self.outer_pid)
            .field("report", &self.report.to_string())
            .finish()
    }
}

impl Confined {
    /// Start a box with `binds` (the workspace) shown inside. Blocks until the init reports
    /// (at most 10 s). The new root is mounted on an empty directory of the box's own under
    /// the host's temporary directory (it stays empty on the host and is removed with the
    /// box).
    pub fn start(options: &ConfineOptions, binds: &[Bind]) -> Result<Confined, ConfineError> {
        static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        let scratch = std::env::temp_dir().join(format!(
            "sandbox-confine-{}-{}",
            std::process::id(),
            NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
        ));
        let scratch = &scratch;
        for b in binds {
            if !b.target.is_absolute() || !b.source.is_absolute() {
                return Err(failed(
                    "bind",
                    format!(
                        "{} -> {} is not absolute",
                        b.source.display(),
                        b.target.display()
                    ),
                ));
            }
            if options.system_dirs.iter().any(|d| b.target.starts_with(d)) {
                return Err(failed(
                    "bind",
                    format!(
                        "{} lies in a read-only system directory",
                        b.target.display()
                    ),
                ));
            }
        }
        std::fs::create_dir_all(scratch).map_err(|e| failed("scratch directory", e))?;
        let limits = cgroup::plan(&options.limits)?;
        let result = Self::start_with(options, binds, scratch, &limits);
        if result.is_err() {
            // A failed start dropped its half-made box (which removed the cgroups) or made
            // none.
            if let Some(cg) = &limits.cgroups {
                cg.remove();
            }
            let _ = std::fs::remove_dir(scratch);
        }
        result
    }

    fn start_with(
        options: &ConfineOptions,
        binds: &[Bind],
        scratch: &Path,
        limits: &cgroup::Plan,
    ) -> Result<Confined, ConfineError> {
        if options.seccomp == Need::Required {
            crate::seccomp::denylist().map_err(|e| classify("seccomp", e, 0))?;
        }
        let landlock = match options.landlock {
            Need::Required => true,
            Need::IfAvailable => landlock_abi() > 0,
            Need::Off => false,
        };
        let config = init::InitConfig {
            // SAFETY: getuid/getgid cannot fail.
            uid: unsafe { libc::geteuid() },
            gid: unsafe { libc::getegid() },
            new_root: scratch.to_path_buf(),
            system_dirs: options.system_dirs.clone(),
            binds: binds.to_vec(),
            mask_secrets: options.mask_secrets,
            tmp_size: options.tmp_size,
            hostname: "sandbox".into(),
            cgroup_procs: limits
                .cgroups
                .as_ref()
                .map(|c| c.procs_files())
                .unwrap_or_default(),
            rlimits: limits.rlimits.clone(),
            landlock,
            seccomp: options.seccomp != Need::Off,
        };
        let body = serde_json::to_vec(&config).map_err(|e| failed("configuration", e))?;
        let (host, child_end) =
            socketpair(libc::SOCK_SEQPACKET).map_err(|e| failed("control socket", e))?;
        let child_raw = child_end.as_raw_fd();
        let mut cmd = Command::new("/proc/self/exe");
        cmd.arg0("sandbox-confine-init")
            // A binary that did not dispatch the init (no constructor, no init_if_child) runs
            // its main: a test harness then runs no test.
            .args(["--exact", "sandbox-confine-init-not-dispatched"])
            .env_clear()
            .env(init::INIT_ENV, "1")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null());
        // SAFETY: only async-signal-safe calls (dup2, fcntl) between fork and exec.
        unsafe {
            cmd.pre_exec(move || {
                if child_raw == init::CTRL_FD {
                    if libc::fcntl(child_raw, libc::F_SETFD, 0) < 0 {
                        return Err(io::Error::last_os_error());
                    }
                } else if libc::dup2(child_raw, init::CTRL_FD) < 0 {
                    return Err(io::Error::last_os_error());
                }
                Ok(())
            });
        }
        let child = cmd.spawn().map_err(|e| failed("start the init", e))?;
        drop(child_end);
        let outer_pid = child.id();
        let mut boxed = Confined {
            control: Mutex::new(Some(host)),
            outer: Mutex::new(Some(child)),
            outer_pid,
            report: Report::default(),
            cgroups: limits.cgroups.clone(),
            scratch: scratch.to_path_buf(),
        };
        let reply = {
            let guard = boxed.control.lock().unwrap_or_else(|e| e.into_inner());
            let fd = guard.as_ref().expect("control socket").as_raw_fd();
            init::send_with_fds(fd, &body, &[]).map_err(|e| failed("send the configuration", e))?;
            wait_reply(fd)?
        };
        match reply {
            init::InitReply::Ready(mut report) => {
                report.limits = limits.described.clone();
                if options.landlock == Need::Required && report.landlock != "fully enforced" {
                    return Err(classify("landlock", report.landlock.clone(), 0));
                }
                boxed.report = report;
                Ok(boxed)
            }
            init::InitReply::Failed {
                step,
                message,
                errno,
            } => Err(classify(&step, message, errno)),
        }
    }

    /// What this box got.
    pub fn report(&self) -> &Report {
        &self.report
    }

    /// The host pid of the init's outer process.
    pub fn init_pid(&self) -> u32 {
        self.outer_pid
    }

    /// Start a command in the box.
    pub fn spawn(&self, spec: &ExecSpec) -> io::Result<Spawned> {
        let frame = init::ExecFrame {
            argv: spec.argv.clone(),
            env: spec.env.clone(),
            cwd: spec.cwd.clone(),
        };
        let body = serde_json::to_vec(&frame)?;
        let (control, remote) = socketpair(libc::SOCK_STREAM)?;
        let (out_r, out_w) = pipe()?;
        let (err_r, err_w) = pipe()?;
        let stdin = if spec.stdin { Some(pipe()?) } else { None };
        {
            let guard = self.control.lock().unwrap_or_else(|e| e.into_inner());
            let Some(fd) = guard.as_ref() else {
                return Err(io::Error::new(
                    io::ErrorKind::NotConnected,
                    "the box was shut down",
                ));
            };
            let mut fds = vec![remote.as_raw_fd(), out_w.as_raw_fd(), err_w.as_raw_fd()];
            if let Some((r, _)) = &stdin {
                fds.push(r.as_raw_fd());
            }
            let op: &[u8] = if spec.stdin { b"I" } else { b"N" };
            init::send_with_fds(fd.as_raw_fd(), op, &fds)?;
        }
        drop((remote, out_w, err_w));
        // The request is small next to the socket buffer in practice; a large one is read by
        // the exec init as it is written.
        init::write_frame(control.as_raw_fd(), &body)?;
        Ok(Spawned {
            control,
            stdin: stdin.map(|(_, w)| w),
            stdout: out_r,
            stderr: err_r,
        })
    }

    /// Host pids of every process in the box (those in its user namespace), the init's
    /// outer process excluded. For tests and diagnostics.
    pub fn processes(&self) -> Vec<u32> {
        use std::os::unix::fs::MetadataExt as _;
        let ns = |pid: &str| {
            std::fs::metadata(format!("/proc/{pid}/ns/user"))
                .ok()
                .map(|m| (m.dev(), m.ino()))
        };
        let Some(mine) = ns(&self.outer_pid.to_string()) else {
            return Vec::new();
        };
        let Ok(entries) = std::fs::read_dir("/proc") else {
            return Vec::new();
        };
        entries
            .flatten()
            .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
            .filter(|pid| *pid != self.outer_pid && ns(&pid.to_string()) == Some(mine))
            .filter(|pid| {
                // Zombies are dead already.
                std::fs::read_to_string(format!("/proc/{pid}/stat"))
                    .ok()
                    .and_then(|s| {
                        s.rsplit(')')
                            .next()
                            .map(|r| !r.trim_start().starts_with('Z'))
                    })
                    .unwrap_or(false)
            })
            .collect()
    }

    /// Kill everything in the box and wait until it is gone (bounded: the init is killed
    /// after 2 s if closing its socket did not end it).
    pub fn shutdown(&self) {
        // Closing the control socket ends the init; the kernel kills the rest of its PID
        // namespace before the init's exit is reported.
        drop(
            self.control
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .take(),
        );
        let Some(mut child) = self.outer.lock().unwrap_or_else(|e| e.into_inner()).take() else {
            return;
        };
        let deadline = Instant::now() + Duration::from_secs(2);
        loop {
            match child.try_wait() {
                Ok(Some(_)) | Err(_) => break,
                Ok(None) if Instant::now() >= deadline => {
                    // The init's parent-death signal kills the box with it.
                    let _ = child.kill();
                    let _ = child.wait();
                    break;
                }
                Ok(None) => std::thread::sleep(Duration::from_millis(1)),
            }
        }
        if let Some(cg) = &self.cgroups {
            cg.remove();
        }
        let _ = std::fs::remove_dir(&self.scratch);
    }

    /// Whether the init still runs.
    pub fn is_alive(&self) -> bool {
        match self
            .outer
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .as_mut()
        {
            Some(child) => matches!(child.try_wait(), Ok(None)),
            None => false,
        }
    }
}

impl Drop for Confined {
    fn drop(&mut self) {
        self.shutdown();
    }
}

fn wait_reply(fd: RawFd) -> Result<init::InitReply, ConfineError> {
    let mut pfd = libc::pollfd {
        fd,
        events: libc::POLLIN,
        revents: 0,
    };
    // SAFETY: poll on one live pollfd.
    let r = unsafe { libc::poll(&mut pfd, 1, START_TIMEOUT.as_millis() as i32) };
    if r == 0 {
        return Err(failed(
            "start the init",
            "no answer within 10 s (does this program dispatch sandbox_confine's init?)",
        ));
    }
    let mut buf = vec![0u8; 64 << 10];
    match init::recv_with_fds(fd, &mut buf) {
        Ok(Some((n, _))) if n > 0 => serde_json::from_slice(&buf[..n])
            .map_err(|e| failed("start the init", format!("bad answer: {e}"))),
        Ok(_) => Err(failed(
            "start the init",
            "the init exited without answering: this program does not dispatch \
             sandbox_confine's init (call sandbox_confine::init_if_child() first in main)",
        )),
        Err(e) => Err(failed("start the init", e)),
    }
}
