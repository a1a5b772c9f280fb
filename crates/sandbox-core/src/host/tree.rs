//! Tracking everything a command starts so that all of it can be killed: each command gets its
//! own cgroup when this process can create one, and only its process group otherwise.
//!
//! Why cgroups: membership is kept by the kernel and inherited on fork, so `setsid`, `setpgid`,
//! a double fork or an emptied environment do not leave it (a process group is left by the
//! first two).
//!
//! Joining: a pre-exec hook would need `unsafe` and a supervisor binary cannot ship in a
//! library, so the command is moved into its cgroup by a small `/bin/sh` wrapper that then
//! `exec`s it: it cannot fork before it is tracked. A shell does not pass every environment
//! on unchanged, though: it sets `PWD`, resets `IFS`, `OPTIND` or `PPID`, drops names that are
//! not identifiers (`spring.profiles.active`); bash adds `SHLVL`. So the wrapper gets saved
//! copies of the shell's own variables and restores them before the `exec`, and a canary
//! proves once that `/bin/sh` then passes an environment on exactly (dash does, bash does
//! not). A command whose environment still cannot pass (a name that is not an identifier, no
//! `PATH` to look the program up in as `execvp` would, or a shell that failed the canary) is
//! started directly and moved from outside right after the start: exact, but a process it
//! forks before the move (a window of microseconds, more on a loaded machine) escapes.
//!
//! The layout (pure cgroup2, hybrid, pure v1, none writable) is detected once per process from
//! `/proc/self/mountinfo` and `/proc/self/cgroup`; each candidate is proven by a real probe
//! (create a cgroup, move a shell into it, kill, remove) before it is used.
//!
//! Per-command cgroups live under `<hierarchy>/<this process's cgroup>/sandbox-harness-<pid>/`
//! as `cmd-<uuid>`. Nothing else is ever created, written or removed, except cgroups a command
//! created below its own (they die with it).

use std::collections::{BTreeMap, BTreeSet};
use std::ffi::{OsStr, OsString};
use std::fs;
use std::io::{self, Write as _};
use std::os::fd::{AsRawFd as _, OwnedFd};
use std::os::unix::ffi::{OsStrExt as _, OsStringExt as _};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, OnceLock, PoisonError};
use std::time::{Duration, Instant};

use rustix::process::{Pid, PidfdFlags, Signal, kill_process, pidfd_open, pidfd_send_signal};

/// How [`run`](super::run) makes sure that everything a command started dies with it (when it
/// exits, times out, or the call is dropped). Chosen once per process: [`tree_kill`].
///
/// In the cgroup modes the command joins its cgroup before it runs (through `/bin/sh`, which
/// then `exec`s it), so nothing it starts can leave: not `setsid`, `setpgid`, double forks or
/// daemons. Two limits: a command whose environment `/bin/sh` cannot pass on exactly (a
/// variable name that is not a shell identifier, no `PATH`, or a `/bin/sh` that failed the
/// probe, such as bash) is moved in from outside right after it starts, so a process it forks
/// in that first instant escapes; and a command privileged enough to write to `cgroup.procs`
/// elsewhere can move itself out.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum TreeKill {
    /// Each command runs in its own cgroup2 cgroup, killed at once with `cgroup.kill`
    /// (Linux ≥ 5.14): no process can fork its way out of the kill.
    Cgroup2,
    /// Each command runs in its own cgroup of a freezer (cgroup v1 `freezer`, or cgroup2's
    /// `cgroup.freeze` before Linux 5.14): frozen, every member killed, thawed. Frozen
    /// processes cannot fork, so none is missed.
    CgroupFreezer,
    /// Each command runs in its own cgroup of a hierarchy without a freezer or kill file
    /// (cgroup v1 `pids` or a named hierarchy): every member is killed, repeatedly, until none
    /// is left. A process forking faster than the sweeps could outlast them (they are bounded).
    CgroupSweep,
    /// No writable cgroup: only the command's process group is killed. A process that leaves
    /// it (`setsid`, `setpgid`, a daemon) survives.
    ProcessGroup,
}

impl TreeKill {
    /// Whether processes that left the command's process group (`setsid`, `setpgid`, daemons)
    /// are killed too.
    pub fn kills_escaped(self) -> bool {
        !matches!(self, TreeKill::ProcessGroup)
    }

    /// A short stable name: `cgroup2`, `cgroup-freezer`, `cgroup-sweep`, `process-group`.
    pub fn as_str(self) -> &'static str {
        match self {
            TreeKill::Cgroup2 => "cgroup2",
            TreeKill::CgroupFreezer => "cgroup-freezer",
            TreeKill::CgroupSweep => "cgroup-sweep",
            TreeKill::ProcessGroup => "process-group",
        }
    }
}

/// How this process kills everything a command run by [`run`](super::run) started. Detected
/// on first use (a few file reads and one short probe command), then fixed for the process;
/// [`TREE_KILL_VAR`] pins it.
pub fn tree_kill() -> TreeKill {
    Tracking::global().mode()
}

/// Start detecting [`tree_kill`] on a background thread, if not done yet, so that the first
/// command (or a client's first `capabilities`) does not wait for the probe: a backend calls
/// this when it is constructed, usually well before its first call.
pub fn detect_tree_kill_in_background() {
    static STARTED: std::sync::Once = std::sync::Once::new();
    if GLOBAL.get().is_some() {
        return;
    }
    STARTED.call_once(|| {
        let spawned = std::thread::Builder::new()
            .name("sandbox-tree-kill-probe".into())
            .spawn(|| {
                Tracking::global();
            });
        if let Err(e) = spawned {
            tracing::debug!(error = %e, "tree-kill detection runs on first use instead");
        }
    });
}

/// The environment variable that pins the mode: `process-group` (no cgroups), or one of the
/// cgroup modes ([`TreeKill::as_str`]), used only if it works here.
pub const TREE_KILL_VAR: &str = "SANDBOX_HARNESS_TREE_KILL";

const MODES: [TreeKill; 3] = [
    TreeKill::Cgroup2,
    TreeKill::CgroupFreezer,
    TreeKill::CgroupSweep,
];

/// The shell that moves a command into its cgroup. An absolute path: the command's `PATH` is
/// not trusted to find it.
pub(crate) const WRAPPER_SHELL: &str = "/bin/sh";

/// The wrapper's exit status when the command could not be moved into its cgroup (the
/// command did not run).
pub(crate) const JOIN_FAILED_STATUS: i32 = 125;

/// The start of the wrapper's last stderr line when the move failed; the cgroup directory
/// follows, so a command cannot print it by accident.
macro_rules! join_failed {
    () => {
        "sandbox-harness: cannot move the command into its cgroup"
    };
}

/// `$0` is the cgroup directory, `$@` the command. Writing `0` to `cgroup.procs` moves the
/// writing process (v1 and v2). Then the shell's own variables are put back as the command
/// had them (`PWD`, which the shell sets, is dropped unless the command had it), from the
/// copies named in `SANDBOX_HARNESS_SAVED` ([`saved_shell_variables`]; the names are ours,
/// so the `eval` sees no foreign text). `exec` keeps the pid, the process group and the file
/// descriptors, and looks the program up in the command's `PATH`.
const WRAPPER: &str = concat!(
    r#"echo 0 > "$0/cgroup.procs" || { echo ""#,
    join_failed!(),
    r#" $0" >&2; exit 125; }
unset PWD
for SANDBOX_HARNESS_SAVED_NAME in $SANDBOX_HARNESS_SAVED; do
  eval "$SANDBOX_HARNESS_SAVED_NAME=\$SANDBOX_HARNESS_SAVED_$SANDBOX_HARNESS_SAVED_NAME; export $SANDBOX_HARNESS_SAVED_NAME; unset SANDBOX_HARNESS_SAVED_$SANDBOX_HARNESS_SAVED_NAME"
done
unset SANDBOX_HARNESS_SAVED SANDBOX_HARNESS_SAVED_NAME
exec "$@""#
);

/// The wrapper's list of saved variables; each copy is this, `_` and the name. Every name the
/// wrapper uses starts with it, and commands with such a name are not wrapped.
const SAVED: &str = "SANDBOX_HARNESS_SAVED";

/// The startup file (`BASH_ENV`) that moves a `bash -c` command into its cgroup before bash
/// runs a word of the command, in the command's own process: no wrapper, no extra `exec`.
/// bash reads it when it starts non-interactively; it writes `0` to the cgroup named in
/// [`CGROUP_VAR`], then removes both variables and itself, and leaves `$_` as bash set it (the
/// last argument of the function call is the value `$_` had), so the command sees the shell
/// it would have seen without it.
const BASH_JOIN: &str = concat!(
    "__sandbox_harness_join() { echo 0 > \"$SANDBOX_HARNESS_CGROUP/cgroup.procs\" || { echo \"",
    join_failed!(),
    " $SANDBOX_HARNESS_CGROUP\" >&2; exit 125; }; unset BASH_ENV SANDBOX_HARNESS_CGROUP; \
     unset -f __sandbox_harness_join; : \"$1\"; }; __sandbox_harness_join \"$_\"\n"
);

/// The variable naming the cgroup directory for [`BASH_JOIN`].
const CGROUP_VAR: &str = "SANDBOX_HARNESS_CGROUP";

/// Variables that make bash skip `BASH_ENV` or change how it reads it (POSIX mode, options
/// set from the environment), or that are [`BASH_JOIN`]'s own: a command with one of them
/// goes through the `/bin/sh` wrapper instead.
const BASH_ENV_BLOCKERS: &[&str] = &["BASH_ENV", CGROUP_VAR, "SHELLOPTS", "POSIXLY_CORRECT"];

/// Names a POSIX shell sets, resets or drops on its own (dash, bash, busybox ash): the
/// wrapper gets saved copies of them.
const SHELL_VARIABLES: &[&str] = &[
    "PWD",
    "OLDPWD",
    "IFS",
    "OPTIND",
    "OPTARG",
    "PPID",
    "LINENO",
    "SHLVL",
    "_",
    "ENV",
    "PS1",
    "PS2",
    "PS4",
    "SHELLOPTS",
    "BASHOPTS",
    "HISTFILE",
    "MAIL",
    "MAILCHECK",
    "MAILPATH",
];

/// Waiting for a freezer to report frozen before killing anyway (a process in uninterruptible
/// sleep can hold it up; the sweeps that follow catch what it forks meanwhile).
const FREEZE_WAIT: Duration = Duration::from_millis(500);

/// How long the end of a command waits for its cgroup to empty before leaving the rest to a
/// background thread (processes in uninterruptible sleep die late).
const FINISH_WAIT: Duration = Duration::from_secs(2);

/// How long the background thread keeps trying before it gives up on a cgroup.
const LINGER: Duration = Duration::from_secs(60);

/// The longest pause between two checks of a dying cgroup.
const MAX_PAUSE: Duration = Duration::from_millis(50);

/// How the members of a command's cgroup are killed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Method {
    /// `cgroup.kill` (cgroup2).
    Kill,
    /// Freeze, kill the members, thaw.
    Freeze(Freezer),
    /// Kill the members until none is left.
    Sweep,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Freezer {
    /// cgroup2's `cgroup.freeze` / `cgroup.events`.
    V2,
    /// cgroup v1's `freezer.state`.
    V1,
}

impl Method {
    fn mode(self) -> TreeKill {
        match self {
            Method::Kill => TreeKill::Cgroup2,
            Method::Freeze(_) => TreeKill::CgroupFreezer,
            Method::Sweep => TreeKill::CgroupSweep,
        }
    }

    /// A file the method needs in every cgroup (its absence rules the method out).
    fn needs(self) -> &'static str {
        match self {
            Method::Kill => "cgroup.kill",
            Method::Freeze(Freezer::V2) => "cgroup.freeze",
            Method::Freeze(Freezer::V1) => "freezer.state",
            Method::Sweep => "cgroup.procs",
        }
    }
}

static GLOBAL: OnceLock<Tracking> = OnceLock::new();

/// Where and how commands are tracked: a method and the parent directory of the per-command
/// cgroups, or nothing (process group only).
#[derive(Clone, Debug)]
pub(crate) struct Tracking {
    site: Option<Site>,
    /// Whether `/bin/sh` passes an environment of identifier names on exactly (its own
    /// variables restored from the saved copies), so that the wrapper may be used.
    wrapper_exact: bool,
    /// `bash -c` commands join through [`BASH_JOIN`] (proven by a probe).
    bash: Option<BashJoin>,
}

/// A proven [`BASH_JOIN`]: the bash it works with and where bash reads the file.
#[derive(Clone, Debug)]
struct BashJoin {
    /// Device and inode of the bash binary the probe ran: only that program is trusted to
    /// read the file.
    program: (u64, u64),
    /// `/proc/<pid>/fd/<n>` of a sealed memfd holding [`BASH_JOIN`]: nothing on disk to leave
    /// behind or to tamper with, gone with this process.
    script: PathBuf,
    _memfd: Arc<OwnedFd>,
}

#[derive(Clone, Debug, PartialEq, Eq)]
struct Site {
    method: Method,
    /// `<hierarchy>/<own cgroup>/sandbox-harness-<pid>`.
    parent: PathBuf,
}

impl Tracking {
    /// The tracking of this process, detected on first use.
    pub(crate) fn global() -> &'static Tracking {
        GLOBAL.get_or_init(Tracking::detect)
    }

    /// [`global`](Self::global), detected off the async workers on first use (the probe
    /// runs a process and waits for it).
    pub(crate) async fn global_async() -> &'static Tracking {
        if let Some(tracking) = GLOBAL.get() {
            return tracking;
        }
        tokio::task::spawn_blocking(Tracking::global)
            .await
            .unwrap_or_else(|_| Tracking::global())
    }

    /// The process group only.
    pub(crate) fn process_group() -> Tracking {
        Tracking {
            site: None,
            wrapper_exact: false,
            bash: None,
        }
    }

    pub(crate) fn mode(&self) -> TreeKill {
        self.site
            .as_ref()
            .map_or(TreeKill::ProcessGroup, |s| s.method.mode())
    }

    /// The first candidate that passes its probe, best first.
    fn detect() -> Tracking {
        let pinned = std::env::var(TREE_KILL_VAR).ok().filter(|v| !v.is_empty());
        let pinned = match pinned.as_deref() {
            None => None,
            Some("process-group") => {
                tracing::info!(
                    "{TREE_KILL_VAR}=process-group: commands are not tracked in cgroups"
                );
                return Tracking::process_group();
            }
            Some(name) => match MODES.iter().find(|m| m.as_str() == name) {
                Some(mode) => Some(*mode),
                None => {
                    tracing::warn!("{TREE_KILL_VAR}={name:?} is not a mode; ignored");
                    None
                }
            },
        };
        let sites = candidates()
            .into_iter()
            .filter(|s| pinned.is_none_or(|mode| s.method.mode() == mode));
        for site in sites {
            match probe(&site) {
                Ok(wrapper_exact) => {
                    tracing::debug!(
                        mode = site.method.mode().as_str(),
                        parent = %site.parent.display(),
                        wrapper_exact,
                        "commands are tracked in their own cgroups"
                    );
                    if !wrapper_exact {
                        tracing::warn!(
                            "/bin/sh changes the environment it passes on: commands join their \
                             cgroup from outside, right after they start"
                        );
                    }
                    let bash = match probe_bash(&site) {
                        Ok(bash) => Some(bash),
                        Err(e) => {
                            tracing::debug!(error = %e, "bash -c commands join through the /bin/sh wrapper");
                            None
                        }
                    };
                    return Tracking {
                        site: Some(site),
                        wrapper_exact,
                        bash,
                    };
                }
                Err(e) => tracing::debug!(
                    method = ?site.method,
                    parent = %site.parent.display(),
                    error = %e,
                    "cgroup candidate unusable"
                ),
            }
        }
        tracing::warn!(
            "no usable cgroup (none writable, or no /bin/sh to join one): commands are killed by \
             process group only, and processes that leave it (setsid, setpgid, daemons) \
             survive them"
        );
        Tracking::process_group()
    }

    /// One tracking per method that works on this machine, best first, the process group
    /// last (tests run each).
    #[cfg(test)]
    pub(crate) fn available() -> Vec<Tracking> {
        let mut out: Vec<Tracking> = Vec::new();
        for site in candidates() {
            let known = out
                .iter()
                .any(|t| t.site.as_ref().is_some_and(|s| s.method == site.method));
            if !known && let Ok(wrapper_exact) = probe(&site) {
                let bash = probe_bash(&site).ok();
                out.push(Tracking {
                    site: Some(site),
                    wrapper_exact,
                    bash,
                });
            }
        }
        out.push(Tracking::process_group());
        out
    }

    /// The parent directory of the per-command cgroups (tests).
    #[cfg(test)]
    pub(crate) fn parent(&self) -> Option<&Path> {
        self.site.as_ref().map(|s| s.parent.as_path())
    }

    /// Whether plain environments go through the wrapper (tests).
    #[cfg(test)]
    pub(crate) fn wrapper_exact(&self) -> bool {
        self.wrapper_exact
    }

    /// What the tests print.
    #[cfg(test)]
    pub(crate) fn describe(&self) -> String {
        match &self.site {
            Some(site) => format!("{:?} in {}", site.method, site.parent.display()),
            None => "process group".to_owned(),
        }
    }

    /// This tracking, made to join every command from outside (tests of that path).
    #[cfg(test)]
    pub(crate) fn joining_from_outside(&self) -> Tracking {
        Tracking {
            site: self.site.clone(),
            wrapper_exact: false,
            bash: None,
        }
    }

    /// Whether `bash -c` commands join through `BASH_ENV` (tests).
    #[cfg(test)]
    pub(crate) fn joins_bash_itself(&self) -> bool {
        self.bash.is_some()
    }

    /// A cgroup for the command `argv` run in `cwd` with the complete environment `env` (this
    /// process's under it when `inherit_env`), or `None` when tracking by process group only.
    /// A `bash -c` command of the proven bash joins through `BASH_ENV`; any other as
    /// [`start`](Self::start) decides.
    pub(crate) fn start_for(
        &self,
        argv: &[String],
        cwd: &Path,
        env: &BTreeMap<OsString, OsString>,
        inherit_env: bool,
    ) -> io::Result<Option<CommandCgroup>> {
        if let (Some(site), Some(bash)) = (&self.site, &self.bash)
            && bash_carries(bash, argv, cwd, env, inherit_env)
        {
            return Cgroup::create(site).map(|cg| {
                Some(CommandCgroup {
                    cgroup: Some(cg),
                    join: Join::BashEnv(bash.script.clone()),
                })
            });
        }
        match argv.first() {
            Some(program) => self.start(program, env, inherit_env),
            None => Ok(None),
        }
    }

    /// A cgroup for `program` with the complete environment `env` (this process's under it
    /// when `inherit_env`), or `None` when tracking by process group only.
    pub(crate) fn start(
        &self,
        program: &str,
        env: &BTreeMap<OsString, OsString>,
        inherit_env: bool,
    ) -> io::Result<Option<CommandCgroup>> {
        let Some(site) = &self.site else {
            return Ok(None);
        };
        let join = match self.wrapper_exact && wrapper_carries(program, env, inherit_env) {
            true => Join::Wrapper,
            false => Join::Outside,
        };
        Cgroup::create(site).map(|cg| {
            Some(CommandCgroup {
                cgroup: Some(cg),
                join,
            })
        })
    }
}

/// Whether the wrapper passes this command on as it would start without it: every name a
/// shell identifier (a shell drops the others) and none of ours, and a `PATH` when the
/// program is looked up (without one, the shell's default search is not `execvp`'s).
fn wrapper_carries(program: &str, env: &BTreeMap<OsString, OsString>, inherit_env: bool) -> bool {
    let carried = |name: &OsStr| {
        let name = name.as_bytes();
        name.first()
            .is_some_and(|b| b.is_ascii_alphabetic() || *b == b'_')
            && name.iter().all(|b| b.is_ascii_alphanumeric() || *b == b'_')
            && !name.starts_with(SAVED.as_bytes())
    };
    let inherited = || std::env::vars_os().map(|(k, _)| k);
    let has_path =
        env.contains_key(OsStr::new("PATH")) || (inherit_env && std::env::var_os("PATH").is_some());
    env.keys().all(|k| carried(k))
        && (!inherit_env || inherited().all(|k| carried(&k)))
        && (program.contains('/') || has_path)
}

/// Whether `argv` is `bash -c …` of the proven bash, with an environment under which bash
/// reads `BASH_ENV` as the probe saw it.
fn bash_carries(
    bash: &BashJoin,
    argv: &[String],
    cwd: &Path,
    env: &BTreeMap<OsString, OsString>,
    inherit_env: bool,
) -> bool {
    use std::os::unix::fs::MetadataExt as _;
    if argv.len() < 3
        || argv[1] != "-c"
        || Path::new(&argv[0]).file_name() != Some(OsStr::new("bash"))
    {
        return false;
    }
    let blocked = |name: &&str| {
        env.contains_key(OsStr::new(name)) || (inherit_env && std::env::var_os(name).is_some())
    };
    if BASH_ENV_BLOCKERS.iter().any(blocked) {
        return false;
    }
    let path = match env.get(OsStr::new("PATH")) {
        Some(path) => Some(path.clone()),
        None if inherit_env => std::env::var_os("PATH"),
        None => None,
    };
    let found = if argv[0].contains('/') {
        Some(cwd.join(&argv[0]))
    } else {
        path.and_then(|path| {
            path.as_bytes()
                .split(|b| *b == b':')
                .map(|dir| cwd.join(OsStr::from_bytes(dir)).join(&argv[0]))
                .find(|candidate| candidate.is_file())
        })
    };
    found
        .and_then(|p| fs::metadata(p).ok())
        .is_some_and(|m| (m.dev(), m.ino()) == bash.program)
}

/// Prove [`BASH_JOIN`] on `site`: the `bash` of the minimal `PATH` reads it from a sealed
/// memfd through `/proc`, lands in a fresh cgroup before its command runs, and passes an
/// environment without the join's variables.
fn probe_bash(site: &Site) -> io::Result<BashJoin> {
    use std::os::unix::fs::MetadataExt as _;
    let program = super::MINIMAL_PATH
        .split(':')
        .map(|dir| Path::new(dir).join("bash"))
        .find(|p| p.is_file())
        .ok_or_else(|| io::Error::new(io::ErrorKind::NotFound, "no bash"))?;
    let meta = fs::metadata(&program)?;
    let memfd = rustix::fs::memfd_create(
        "sandbox-harness-join",
        rustix::fs::MemfdFlags::CLOEXEC | rustix::fs::MemfdFlags::ALLOW_SEALING,
    )?;
    let mut file = fs::File::from(memfd);
    file.write_all(BASH_JOIN.as_bytes())?;
    let memfd = OwnedFd::from(file);
    rustix::fs::fcntl_add_seals(
        &memfd,
        rustix::fs::SealFlags::WRITE
            | rustix::fs::SealFlags::SHRINK
            | rustix::fs::SealFlags::GROW
            | rustix::fs::SealFlags::SEAL,
    )?;
    let script = PathBuf::from(format!(
        "/proc/{}/fd/{}",
        std::process::id(),
        memfd.as_raw_fd()
    ));
    let mut cg = Cgroup::create(site)?;
    let result = (|| {
        let output = std::process::Command::new(&program)
            .arg("-c")
            .arg("while read -r p; do [ \"$p\" = \"$$\" ] && echo joined; done < \"$0/cgroup.procs\"; exec env")
            .arg(&cg.dir)
            .env_clear()
            .env("PATH", super::MINIMAL_PATH)
            .env("SANDBOX_HARNESS_CANARY", "a b")
            .env("BASH_ENV", &script)
            .env(CGROUP_VAR, &cg.dir)
            .current_dir("/")
            .stdin(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .output()?;
        let stdout = String::from_utf8_lossy(&output.stdout);
        let mut lines = stdout.lines();
        let joined = lines.next() == Some("joined");
        let rest: Vec<&str> = lines.collect();
        let clean = rest.contains(&"SANDBOX_HARNESS_CANARY=a b")
            && !rest
                .iter()
                .any(|l| l.starts_with("BASH_ENV=") || l.starts_with(CGROUP_VAR));
        match (output.status.success(), joined, clean) {
            (true, true, true) => Ok(()),
            _ => Err(io::Error::other(format!(
                "bash did not join through BASH_ENV or leaked its variables: {stdout:?}"
            ))),
        }
    })();
    cg.strike();
    if !cg.finish_blocking(Duration::from_secs(1)) {
        tracing::warn!(cgroup = %cg.dir.display(), "probe cgroup not removed");
    }
    result.map(|()| BashJoin {
        program: (meta.dev(), meta.ino()),
        script,
        _memfd: Arc::new(memfd),
    })
}

/// The saved copies of the shell's own variables for the wrapper to restore: for each of
/// [`SHELL_VARIABLES`] the command has, `SANDBOX_HARNESS_SAVED_<name>`, and the list of names
/// in `SANDBOX_HARNESS_SAVED`.
pub(crate) fn saved_shell_variables(
    env: &BTreeMap<OsString, OsString>,
    inherit_env: bool,
) -> Vec<(OsString, OsString)> {
    let mut saved = Vec::new();
    let mut names = Vec::new();
    for name in SHELL_VARIABLES {
        let value = match env.get(OsStr::new(name)) {
            Some(value) => Some(value.clone()),
            None if inherit_env => std::env::var_os(name),
            None => None,
        };
        if let Some(value) = value {
            saved.push((OsString::from(format!("{SAVED}_{name}")), value));
            names.push(*name);
        }
    }
    if !names.is_empty() {
        saved.push((SAVED.into(), names.join(" ").into()));
    }
    saved
}

/// The per-command cgroup candidates of this machine, best first.
fn candidates() -> Vec<Site> {
    match (
        fs::read_to_string("/proc/self/mountinfo"),
        fs::read_to_string("/proc/self/cgroup"),
    ) {
        (Ok(mountinfo), Ok(own)) => rank(
            hierarchies(&mountinfo, &own),
            &format!("sandbox-harness-{}", std::process::id()),
        ),
        _ => Vec::new(),
    }
}

/// The sites of `found`, best first: `cgroup.kill`, a freezer (v2, then v1), sweeps (v2, v1
/// `pids`, named v1). Only hierarchies whose controllers do not change how the command runs
/// are used: cgroup2 (we enable no controller below us, so the leaves may hold processes and
/// the limits above apply as they did), and v1 hierarchies of `freezer`, `pids` or no
/// controller (named). A new v1 `cpu` or `memory` cgroup would change scheduling or
/// accounting; a `cpuset` one starts empty and admits nobody.
fn rank(found: Vec<Hierarchy>, parent_name: &str) -> Vec<Site> {
    let mut ranked: Vec<(u8, Site)> = Vec::new();
    for h in found {
        let parent = h.own_dir.join(parent_name);
        let mut add = |rank: u8, method: Method| {
            ranked.push((
                rank,
                Site {
                    method,
                    parent: parent.clone(),
                },
            ))
        };
        match h.version {
            Version::V2 => {
                add(0, Method::Kill);
                add(1, Method::Freeze(Freezer::V2));
                add(3, Method::Sweep);
            }
            Version::V1 => {
                let allowed = h
                    .controllers
                    .iter()
                    .all(|c| c == "freezer" || c == "pids" || c.starts_with("name="));
                if !allowed {
                    continue;
                }
                if h.controllers.iter().any(|c| c == "freezer") {
                    add(2, Method::Freeze(Freezer::V1));
                }
                // pids before named hierarchies: a named one (name=systemd) belongs to an
                // init system more often.
                let named_only = h.controllers.iter().all(|c| c.starts_with("name="));
                add(if named_only { 5 } else { 4 }, Method::Sweep);
            }
        }
    }
    // Stable: equal ranks keep the mount order.
    ranked.sort_by_key(|(rank, _)| *rank);
    ranked.into_iter().map(|(_, site)| site).collect()
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Version {
    V1,
    V2,
}

/// A mounted cgroup hierarchy in which this process's own cgroup is visible.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Hierarchy {
    version: Version,
    /// v1 controllers (`name=…` for a named hierarchy); empty for cgroup2.
    controllers: Vec<String>,
    /// This process's cgroup directory in the mount.
    own_dir: PathBuf,
}

/// The cgroup hierarchies mounted in `mountinfo` (the text of `/proc/self/mountinfo`) that
/// show the cgroup `own` (the text of `/proc/self/cgroup`) places this process in.
fn hierarchies(mountinfo: &str, own: &str) -> Vec<Hierarchy> {
    // `id:controllers:path`; cgroup2 is `0::path`.
    let own: Vec<(&str, Vec<&str>, &str)> = own
        .lines()
        .filter_map(|l| {
            let mut parts = l.splitn(3, ':');
            let (id, ctrls, path) = (parts.next()?, parts.next()?, parts.next()?);
            let ctrls = ctrls.split(',').filter(|c| !c.is_empty()).collect();
            Some((id, ctrls, path))
        })
        .collect();
    let mut out = Vec::new();
    for line in mountinfo.lines() {
        // `id parent dev root mountpoint options [optional…] - fstype source superoptions`
        let fields: Vec<&str> = line.split(' ').collect();
        let Some(dash) = fields.iter().position(|f| *f == "-") else {
            continue;
        };
        if dash < 5 || fields.len() < dash + 4 {
            continue;
        }
        let (root, point) = (unescape(fields[3]), unescape(fields[4]));
        let (fstype, super_opts) = (fields[dash + 1], fields[dash + 3]);
        let (version, controllers, path) = match fstype {
            "cgroup2" => match own
                .iter()
                .find(|(id, ctrls, _)| *id == "0" && ctrls.is_empty())
            {
                Some((_, _, path)) => (Version::V2, Vec::new(), *path),
                None => continue,
            },
            "cgroup" => {
                let opts: BTreeSet<&str> = super_opts.split(',').collect();
                // The hierarchy whose every controller the mount carries.
                match own.iter().find(|(id, ctrls, _)| {
                    *id != "0" && !ctrls.is_empty() && ctrls.iter().all(|c| opts.contains(c))
                }) {
                    Some((_, ctrls, path)) => (
                        Version::V1,
                        ctrls.iter().map(|c| (*c).to_owned()).collect(),
                        *path,
                    ),
                    None => continue,
                }
            }
            _ => continue,
        };
        if let Some(rel) = below(path, &root) {
            out.push(Hierarchy {
                version,
                controllers,
                own_dir: PathBuf::from(OsString::from_vec(point)).join(rel),
            });
        }
    }
    out
}

/// `path` relative to the mount's `root`, when the mount shows it (a container may mount only
/// a subtree, or place us outside its namespace's root: `/../..`).
fn below(path: &str, root: &[u8]) -> Option<PathBuf> {
    let root = std::str::from_utf8(root).ok()?.trim_end_matches('/');
    let rest = path.strip_prefix(root)?;
    if !(rest.is_empty() || rest.starts_with('/')) {
        return None;
    }
    let rel = rest.trim_start_matches('/');
    if rel.split('/').any(|c| c == "..") {
        return None;
    }
    Some(PathBuf::from(rel))
}

/// A mountinfo field with its octal escapes (`\040` for a space) decoded.
fn unescape(field: &str) -> Vec<u8> {
    let bytes = field.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        // `\ooo`, three octal digits (the kernel escapes space, tab, newline and `\`).
        let octal = (bytes[i] == b'\\')
            .then(|| bytes.get(i + 1..i + 4))
            .flatten()
            .filter(|d| d.iter().all(|b| (b'0'..=b'7').contains(b)))
            .and_then(|d| {
                let value = d.iter().fold(0u32, |acc, b| acc * 8 + u32::from(b - b'0'));
                u8::try_from(value).ok()
            });
        match octal {
            Some(byte) => {
                out.push(byte);
                i += 4;
            }
            None => {
                out.push(bytes[i]);
                i += 1;
            }
        }
    }
    out
}

/// The canary environment of the probe: what `env` must print, in any order. Plain variables
/// and every kind of shell variable a shell sets, resets or drops.
const CANARY: &[(&str, &str)] = &[
    ("PATH", "/usr/bin:/bin"),
    ("SANDBOX_HARNESS_CANARY", "a b\n$c'"),
    ("PWD", "/nowhere"),
    ("OLDPWD", "/before"),
    ("IFS", "x"),
    ("OPTIND", "9"),
    ("PPID", "1"),
    ("LINENO", "77"),
    ("SHLVL", "5"),
    ("_", "u"),
];

/// Prove `site` works: create a cgroup, check the method's file, move a shell in with the
/// very wrapper commands get, kill and remove. `Ok(exact)`: whether the wrapper passed the
/// canary environment on exactly (to `env`, which prints it).
fn probe(site: &Site) -> io::Result<bool> {
    let mut cg = Cgroup::create(site)?;
    let result = (|| {
        let needed = cg.dir.join(site.method.needs());
        if !needed.exists() {
            return Err(io::Error::new(
                io::ErrorKind::Unsupported,
                format!("{} is missing", needed.display()),
            ));
        }
        let canary: BTreeMap<OsString, OsString> = CANARY
            .iter()
            .map(|(k, v)| ((*k).into(), (*v).into()))
            .collect();
        let output = std::process::Command::new(WRAPPER_SHELL)
            .arg("-c")
            .arg(WRAPPER)
            .arg(&cg.dir)
            .arg("env")
            .env_clear()
            .envs(&canary)
            .envs(saved_shell_variables(&canary, false))
            .current_dir("/")
            .stdin(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .output()?;
        if output.status.code() == Some(JOIN_FAILED_STATUS) {
            return Err(io::Error::other("the wrapper could not join the cgroup"));
        }
        // `env` prints `name=value\n` each (a value may hold newlines): compare sorted lines.
        let lines = |text: &str| {
            let mut lines: Vec<String> = text.split_inclusive('\n').map(str::to_owned).collect();
            lines.sort();
            lines
        };
        let expected: String = CANARY.iter().map(|(k, v)| format!("{k}={v}\n")).collect();
        Ok(output.status.success()
            && lines(&String::from_utf8_lossy(&output.stdout)) == lines(&expected))
    })();
    cg.strike();
    if !cg.finish_blocking(Duration::from_secs(1)) {
        tracing::warn!(cgroup = %cg.dir.display(), "probe cgroup not removed");
    }
    result
}

/// The per-command parent directories in use, with the number of live command cgroups under
/// each: the last one out removes the parent, so nothing is left when the process goes idle.
static PARENTS: Mutex<BTreeMap<PathBuf, usize>> = Mutex::new(BTreeMap::new());

fn hold_parent(parent: &Path) -> io::Result<()> {
    let mut held = PARENTS.lock().unwrap_or_else(PoisonError::into_inner);
    let count = held.entry(parent.to_owned()).or_insert(0);
    if *count == 0 {
        match fs::create_dir(parent) {
            Ok(()) => {}
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {}
            Err(e) => {
                held.remove(parent);
                return Err(e);
            }
        }
    }
    *count += 1;
    Ok(())
}

fn release_parent(parent: &Path) {
    let mut held = PARENTS.lock().unwrap_or_else(PoisonError::into_inner);
    if let Some(count) = held.get_mut(parent) {
        *count -= 1;
        if *count == 0 {
            held.remove(parent);
            // Best effort: a cgroup that would not empty may still be in it.
            let _ = fs::remove_dir(parent);
        }
    }
}

/// One command's cgroup, killed and removed when the command ends ([`finish`](Self::finish))
/// or, when dropped unfinished (a cancelled call), killed at once and removed by a background
/// thread.
#[derive(Debug)]
pub(crate) struct CommandCgroup {
    cgroup: Option<Cgroup>,
    join: Join,
}

/// How a command gets into its cgroup.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Join {
    /// Through the `/bin/sh` wrapper, which then `exec`s it.
    Wrapper,
    /// bash moves itself, reading this [`BASH_JOIN`] file at startup.
    BashEnv(PathBuf),
    /// Moved from outside right after the start.
    Outside,
}

impl CommandCgroup {
    /// A cgroup directory not created here, for tests of a wrapper that cannot join.
    #[cfg(test)]
    pub(crate) fn unmanaged(dir: PathBuf, by_wrapper: bool) -> CommandCgroup {
        CommandCgroup {
            cgroup: Some(Cgroup {
                dir,
                parent: None,
                method: Method::Sweep,
                stage: Stage::Running,
            }),
            join: match by_wrapper {
                true => Join::Wrapper,
                false => Join::Outside,
            },
        }
    }

    /// Whether the command joins through the wrapper ([`wrapper_args`](Self::wrapper_args)).
    pub(crate) fn by_wrapper(&self) -> bool {
        self.join == Join::Wrapper
    }

    /// Whether the command moves itself in before it runs (the wrapper or `BASH_ENV`), so a
    /// failed move shows as [`join_failed_line`](Self::join_failed_line); else it is moved
    /// from outside ([`join`](Self::join)).
    pub(crate) fn joins_itself(&self) -> bool {
        self.join != Join::Outside
    }

    /// The variables that make bash move itself in (`BASH_ENV` mode), set over the command's
    /// environment.
    pub(crate) fn bash_env(&self) -> Option<[(OsString, OsString); 2]> {
        match (&self.join, &self.cgroup) {
            (Join::BashEnv(script), Some(cg)) => Some([
                ("BASH_ENV".into(), script.as_os_str().to_owned()),
                (CGROUP_VAR.into(), cg.dir.as_os_str().to_owned()),
            ]),
            _ => None,
        }
    }

    /// Move the started process `pid` (not yet reaped, so its pid is still its own) into
    /// this cgroup, from outside.
    pub(crate) fn join(&self, pid: u32) -> io::Result<()> {
        let Some(cg) = &self.cgroup else {
            return Ok(());
        };
        fs::OpenOptions::new()
            .write(true)
            .open(cg.dir.join("cgroup.procs"))
            .and_then(|mut f| f.write_all(pid.to_string().as_bytes()))
    }

    /// The wrapper's arguments (after the shell) running `argv` inside this cgroup.
    pub(crate) fn wrapper_args(&self, argv: &[String]) -> Vec<OsString> {
        let dir = self.cgroup.as_ref().map(|cg| cg.dir.as_os_str().to_owned());
        let mut args = vec![OsString::from("-c"), OsString::from(WRAPPER)];
        args.extend(dir);
        args.extend(argv.iter().map(OsString::from));
        args
    }

    /// The stderr line of a wrapper that could not join this cgroup (the command did not run
    /// then, and the exit status is [`JOIN_FAILED_STATUS`]).
    pub(crate) fn join_failed_line(&self) -> Vec<u8> {
        let mut line = concat!(join_failed!(), " ").as_bytes().to_vec();
        if let Some(cg) = &self.cgroup {
            line.extend_from_slice(cg.dir.as_os_str().as_bytes());
        }
        line
    }

    /// Kill every member now. Quick and synchronous: usable from `Drop`.
    pub(crate) fn kill(&mut self) {
        if let Some(cg) = &mut self.cgroup {
            cg.strike();
        }
    }

    /// Kill every member, wait until the cgroup is empty and remove it. Waits at most
    /// [`FINISH_WAIT`]; the rest is left to a background thread.
    pub(crate) async fn finish(mut self) {
        let Some(mut cg) = self.cgroup.take() else {
            return;
        };
        cg.strike();
        let deadline = Instant::now() + FINISH_WAIT;
        let mut pause = Duration::from_millis(1);
        loop {
            if cg.step() {
                cg.release();
                return;
            }
            if Instant::now() >= deadline {
                cg.detach();
                return;
            }
            tokio::time::sleep(pause).await;
            pause = (pause * 2).min(MAX_PAUSE);
        }
    }
}

impl CommandCgroup {
    /// [`finish`](Self::finish) on a plain thread: kill every member and wait (blocking, at
    /// most `within`) until the cgroup is empty; whether it emptied.
    pub(crate) fn finish_blocking(mut self, within: Duration) -> bool {
        let Some(mut cg) = self.cgroup.take() else {
            return true;
        };
        cg.strike();
        let emptied = cg.finish_blocking(within);
        if !emptied {
            cg.detach();
        }
        emptied
    }
}

impl Drop for CommandCgroup {
    fn drop(&mut self) {
        let Some(mut cg) = self.cgroup.take() else {
            return;
        };
        cg.strike();
        // An empty cgroup (the command never started) goes at once; no thread for that.
        if cg.step() {
            cg.release();
        } else {
            cg.detach();
        }
    }
}

#[derive(Debug)]
struct Cgroup {
    dir: PathBuf,
    /// The parent held for this cgroup (`None` only in tests).
    parent: Option<PathBuf>,
    method: Method,
    stage: Stage,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Stage {
    /// Not killed yet.
    Running,
    /// Freeze requested at this instant.
    Freezing(Instant),
    /// Killed: sweep stragglers until empty, then remove.
    Draining,
}

impl Cgroup {
    fn create(site: &Site) -> io::Result<Cgroup> {
        hold_parent(&site.parent)?;
        let dir = site
            .parent
            .join(format!("cmd-{}", uuid::Uuid::new_v4().simple()));
        if let Err(e) = fs::create_dir(&dir) {
            release_parent(&site.parent);
            return Err(e);
        }
        Ok(Cgroup {
            dir,
            parent: Some(site.parent.clone()),
            method: site.method,
            stage: Stage::Running,
        })
    }

    /// The first, synchronous blow (once): `cgroup.kill`, a freeze request, or one sweep.
    fn strike(&mut self) {
        if self.stage != Stage::Running {
            return;
        }
        self.stage = match self.method {
            Method::Kill => {
                // Should it fail, the sweeps of the draining stage still kill every member.
                self.write("cgroup.kill", "1");
                Stage::Draining
            }
            Method::Freeze(freezer) => {
                match freezer {
                    Freezer::V2 => self.write("cgroup.freeze", "1"),
                    Freezer::V1 => self.write("freezer.state", "FROZEN"),
                }
                Stage::Freezing(Instant::now())
            }
            Method::Sweep => {
                kill_members(&self.dir);
                Stage::Draining
            }
        };
    }

    /// Advance the kill by one non-blocking step; `true` once the cgroup is removed.
    fn step(&mut self) -> bool {
        self.strike();
        if let Stage::Freezing(since) = self.stage {
            if !self.frozen() && since.elapsed() < FREEZE_WAIT {
                return false;
            }
            // Frozen members cannot fork; the SIGKILLs land when they thaw.
            kill_members(&self.dir);
            match self.method {
                Method::Freeze(Freezer::V2) => self.write("cgroup.freeze", "0"),
                _ => self.write("freezer.state", "THAWED"),
            }
            self.stage = Stage::Draining;
        }
        if kill_members(&self.dir) > 0 {
            return false;
        }
        remove_tree(&self.dir)
    }

    fn frozen(&self) -> bool {
        match self.method {
            Method::Freeze(Freezer::V2) => fs::read_to_string(self.dir.join("cgroup.events"))
                .is_ok_and(|events| events.lines().any(|l| l == "frozen 1")),
            _ => fs::read_to_string(self.dir.join("freezer.state"))
                .is_ok_and(|state| state.trim() == "FROZEN"),
        }
    }

    fn write(&self, file: &str, value: &str) {
        let path = self.dir.join(file);
        let written = fs::OpenOptions::new()
            .write(true)
            .open(&path)
            .and_then(|mut f| f.write_all(value.as_bytes()));
        if let Err(e) = written {
            tracing::warn!(file = %path.display(), error = %e, "cgroup write failed");
        }
    }

    /// Step until removed or `within` has passed (blocking); whether it was removed. The
    /// parent is released either way.
    fn finish_blocking(&mut self, within: Duration) -> bool {
        let deadline = Instant::now() + within;
        let mut pause = Duration::from_millis(1);
        let removed = loop {
            if self.step() {
                break true;
            }
            if Instant::now() >= deadline {
                break false;
            }
            std::thread::sleep(pause);
            pause = (pause * 2).min(MAX_PAUSE);
        };
        self.release();
        removed
    }

    fn release(&mut self) {
        if let Some(parent) = self.parent.take() {
            release_parent(&parent);
        }
    }

    /// Finish in a background thread (inline and shorter if no thread can be started).
    fn detach(mut self) {
        let spawned = std::thread::Builder::new()
            .name("sandbox-cgroup-reaper".into())
            .spawn(move || {
                if !self.finish_blocking(LINGER) {
                    tracing::warn!(
                        cgroup = %self.dir.display(),
                        "the command's cgroup did not empty within {LINGER:?}: left behind"
                    );
                }
            });
        if let Err(e) = spawned {
            tracing::warn!(error = %e, "cannot start a thread to finish a command's cgroup");
        }
    }
}

/// The pids in `dir`'s cgroup and in the cgroups below it (a command may create its own).
fn members(dir: &Path) -> Vec<i32> {
    let mut pids = Vec::new();
    if let Ok(procs) = fs::read_to_string(dir.join("cgroup.procs")) {
        pids.extend(procs.lines().filter_map(|l| l.trim().parse::<i32>().ok()));
    }
    for sub in subdirs(dir) {
        pids.extend(members(&sub));
    }
    pids
}

fn subdirs(dir: &Path) -> Vec<PathBuf> {
    fs::read_dir(dir)
        .map(|entries| {
            entries
                .filter_map(|e| e.ok())
                .filter(|e| e.file_type().is_ok_and(|t| t.is_dir()))
                .map(|e| e.path())
                .collect()
        })
        .unwrap_or_default()
}

/// SIGKILL every member of `dir`'s subtree; the number of members seen.
///
/// A pid read from `cgroup.procs` may be reused by an unrelated process before it is
/// signalled. So each member is pinned by a pidfd first and signalled only if its pid is still
/// listed afterwards: a listed pid names a process of this cgroup, and an open pidfd whose pid
/// is listed refers to that very process (or to a dead one, which ignores the signal).
fn kill_members(dir: &Path) -> usize {
    let seen = members(dir);
    if seen.is_empty() {
        return 0;
    }
    let pinned: Vec<(i32, Option<OwnedFd>)> = seen
        .iter()
        .filter_map(|&raw| {
            let pid = Pid::from_raw(raw)?;
            match pidfd_open(pid, PidfdFlags::empty()) {
                Ok(fd) => Some((raw, Some(fd))),
                // Kernels before 5.3: by pid, with the small reuse window pidfds close.
                Err(rustix::io::Errno::NOSYS) => Some((raw, None)),
                // Gone already, or out of descriptors: the next sweep tries again.
                Err(_) => None,
            }
        })
        .collect();
    let still: BTreeSet<i32> = members(dir).into_iter().collect();
    for (raw, fd) in pinned {
        if !still.contains(&raw) {
            continue;
        }
        let sent = match (&fd, Pid::from_raw(raw)) {
            (Some(fd), _) => pidfd_send_signal(fd, Signal::KILL),
            (None, Some(pid)) => kill_process(pid, Signal::KILL),
            (None, None) => continue,
        };
        if let Err(e) = sent
            && e != rustix::io::Errno::SRCH
        {
            tracing::warn!(pid = raw, error = %e, "cannot kill a member of the command's cgroup");
        }
    }
    seen.len()
}

/// Remove `dir` and the (empty) cgroups a command created below it; whether `dir` is gone.
fn remove_tree(dir: &Path) -> bool {
    for sub in subdirs(dir) {
        remove_tree(&sub);
    }
    match fs::remove_dir(dir) {
        Ok(()) => true,
        Err(e) if e.kind() == io::ErrorKind::NotFound => true,
        Err(_) => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const HYBRID_MOUNTS: &str = "\
31 23 0:28 / /sys/fs/cgroup rw,relatime - tmpfs tmpfs rw,mode=755
32 31 0:29 / /sys/fs/cgroup/cpu rw,relatime - cgroup cgroup rw,cpu
35 31 0:32 / /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory
37 31 0:34 / /sys/fs/cgroup/freezer rw,relatime - cgroup cgroup rw,freezer
39 31 0:36 / /sys/fs/cgroup/pids rw,relatime - cgroup cgroup rw,pids
40 31 0:37 / /sys/fs/cgroup/systemd rw,relatime - cgroup cgroup rw,xattr,name=systemd
41 31 0:38 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw
";
    const HYBRID_OWN: &str = "\
9:name=systemd:/
8:pids:/a
6:freezer:/
4:memory:/process_api/5c06
1:cpu:/
0::/
";

    #[test]
    fn hybrid_layout_offers_every_hierarchy_but_resource_controllers() {
        let found = hierarchies(HYBRID_MOUNTS, HYBRID_OWN);
        let dirs: Vec<(&Path, Version)> = found
            .iter()
            .map(|h| (h.own_dir.as_path(), h.version))
            .collect();
        assert_eq!(
            dirs,
            [
                (Path::new("/sys/fs/cgroup/cpu/"), Version::V1),
                (
                    Path::new("/sys/fs/cgroup/memory/process_api/5c06"),
                    Version::V1
                ),
                (Path::new("/sys/fs/cgroup/freezer/"), Version::V1),
                (Path::new("/sys/fs/cgroup/pids/a"), Version::V1),
                (Path::new("/sys/fs/cgroup/systemd/"), Version::V1),
                (Path::new("/sys/fs/cgroup/unified/"), Version::V2),
            ]
        );
        let sites: Vec<(Method, PathBuf)> = rank(found, "sandbox-harness-7")
            .into_iter()
            .map(|s| (s.method, s.parent))
            .collect();
        let at = |dir: &str| PathBuf::from(format!("/sys/fs/cgroup/{dir}sandbox-harness-7"));
        assert_eq!(
            sites,
            [
                (Method::Kill, at("unified/")),
                (Method::Freeze(Freezer::V2), at("unified/")),
                (Method::Freeze(Freezer::V1), at("freezer/")),
                (Method::Sweep, at("unified/")),
                (Method::Sweep, at("freezer/")),
                (Method::Sweep, at("pids/a/")),
                (Method::Sweep, at("systemd/")),
            ]
        );
    }

    #[test]
    fn pure_v2_in_a_namespace_and_a_subtree_mount() {
        let mounts = "30 25 0:26 / /sys/fs/cgroup rw,nosuid - cgroup2 cgroup2 rw,nsdelegate\n";
        let found = hierarchies(mounts, "0::/user.slice/session-2.scope\n");
        assert_eq!(found.len(), 1);
        assert_eq!(found[0].version, Version::V2);
        assert_eq!(
            found[0].own_dir,
            Path::new("/sys/fs/cgroup/user.slice/session-2.scope")
        );
        // A container that mounts only its own subtree (root `/docker/abc`).
        let mounts = "30 25 0:26 /docker/abc /sys/fs/cgroup rw - cgroup2 cgroup2 rw\n";
        let found = hierarchies(mounts, "0::/docker/abc/app\n");
        assert_eq!(found[0].own_dir, Path::new("/sys/fs/cgroup/app"));
        // Our cgroup is not inside the mounted subtree, or outside the namespace's root.
        assert!(hierarchies(mounts, "0::/docker/abcd\n").is_empty());
        assert!(hierarchies(mounts, "0::/other\n").is_empty());
        let mounts = "30 25 0:26 / /sys/fs/cgroup rw - cgroup2 cgroup2 rw\n";
        assert!(hierarchies(mounts, "0::/../../x\n").is_empty());
        // No cgroup mounted at all, or a v1-only process without a cgroup2 line.
        assert!(hierarchies("", "0::/\n").is_empty());
        assert!(hierarchies(mounts, "6:freezer:/\n").is_empty());
    }

    #[test]
    fn mount_points_with_escapes_and_optional_fields() {
        let mounts = "30 25 0:26 / /mnt/my\\040cgroups rw shared:9 master:2 - cgroup cgroup rw,freezer,pids\n";
        let found = hierarchies(mounts, "3:freezer,pids:/x\n");
        assert_eq!(
            found,
            [Hierarchy {
                version: Version::V1,
                controllers: vec!["freezer".into(), "pids".into()],
                own_dir: PathBuf::from("/mnt/my cgroups/x"),
            }]
        );
        assert_eq!(unescape(r"a\134b\011"), b"a\\b\t");
        assert_eq!(unescape(r"trailing\04"), b"trailing\\04");
    }

    #[test]
    fn tree_kill_names_are_stable() {
        assert_eq!(TreeKill::Cgroup2.as_str(), "cgroup2");
        assert!(TreeKill::CgroupSweep.kills_escaped());
        assert!(!TreeKill::ProcessGroup.kills_escaped());
        assert_eq!(Tracking::process_group().mode(), TreeKill::ProcessGroup);
    }
}
