//! Resource limits of a box: its own cgroups (v2, or v1's `pids`, `memory`, `cpu`
//! controllers) when this process can create them, rlimits of the init otherwise.
//!
//! The layout is read from `/proc/self/mountinfo` and `/proc/self/cgroup`. A box's cgroups
//! are `<controller mount>/<this process's cgroup>/sandbox-confine-<pid>-<n>`; the init's
//! outer process joins them before it unshares anything, so every process of the box is in
//! them; they are removed when the box is shut down.

use std::fs;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use crate::{ConfineError, Limits, Need};

/// The cgroup hierarchies this process sees.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum CgroupLayout {
    /// cgroup2 at this path (this process's own cgroup directory).
    V2(PathBuf),
    /// cgroup v1: this process's directory in the `pids`, `memory` and `cpu` hierarchies
    /// that are mounted.
    V1 {
        /// `pids` controller directory.
        pids: Option<PathBuf>,
        /// `memory` controller directory.
        memory: Option<PathBuf>,
        /// `cpu` controller directory.
        cpu: Option<PathBuf>,
    },
    /// No cgroup file system.
    None,
}

/// Detect the layout.
pub fn cgroup_layout() -> CgroupLayout {
    let mountinfo = fs::read_to_string("/proc/self/mountinfo").unwrap_or_default();
    let own = fs::read_to_string("/proc/self/cgroup").unwrap_or_default();
    // hierarchy-id:controllers:path
    let own_path = |want: &str| -> Option<String> {
        own.lines().find_map(|l| {
            let mut parts = l.splitn(3, ':');
            let (_, controllers, path) = (parts.next()?, parts.next()?, parts.next()?);
            let hit = if want.is_empty() {
                controllers.is_empty()
            } else {
                controllers.split(',').any(|c| c == want)
            };
            hit.then(|| path.to_owned())
        })
    };
    let mut v1: [(String, Option<PathBuf>); 3] = [
        ("pids".into(), None),
        ("memory".into(), None),
        ("cpu".into(), None),
    ];
    let mut v2: Option<PathBuf> = None;
    for line in mountinfo.lines() {
        let Some((left, right)) = line.split_once(" - ") else {
            continue;
        };
        let fields: Vec<&str> = left.split(' ').collect();
        let rfields: Vec<&str> = right.split(' ').collect();
        let (Some(mount_point), Some(root), Some(fstype)) =
            (fields.get(4), fields.get(3), rfields.first())
        else {
            continue;
        };
        if *root != "/" {
            continue;
        }
        match *fstype {
            "cgroup2" => {
                if let Some(path) = own_path("") {
                    v2.get_or_insert_with(|| join(mount_point, &path));
                }
            }
            "cgroup" => {
                let options = rfields.get(2).copied().unwrap_or("");
                for (name, slot) in &mut v1 {
                    if options.split(',').any(|o| o == name)
                        && slot.is_none()
                        && let Some(path) = own_path(name)
                    {
                        *slot = Some(join(mount_point, &path));
                    }
                }
            }
            _ => {}
        }
    }
    let [(_, pids), (_, memory), (_, cpu)] = v1;
    if pids.is_some() || memory.is_some() || cpu.is_some() {
        CgroupLayout::V1 { pids, memory, cpu }
    } else if let Some(v2) = v2 {
        CgroupLayout::V2(v2)
    } else {
        CgroupLayout::None
    }
}

fn join(mount_point: &str, path: &str) -> PathBuf {
    Path::new(mount_point).join(path.trim_start_matches('/'))
}

/// A box's cgroup directories.
#[derive(Debug, Clone)]
pub(crate) struct BoxCgroups {
    dirs: Vec<PathBuf>,
}

impl BoxCgroups {
    pub(crate) fn procs_files(&self) -> Vec<PathBuf> {
        self.dirs.iter().map(|d| d.join("cgroup.procs")).collect()
    }

    /// Remove the directories (the box is dead: they are empty).
    pub(crate) fn remove(&self) {
        for d in &self.dirs {
            for _ in 0..50 {
                match fs::remove_dir(d) {
                    Ok(()) => break,
                    Err(e) if e.kind() == std::io::ErrorKind::NotFound => break,
                    // Members still exiting.
                    Err(_) => std::thread::sleep(std::time::Duration::from_millis(2)),
                }
            }
        }
    }
}

/// How a box's limits are enforced.
#[derive(Debug, Default)]
pub(crate) struct Plan {
    pub cgroups: Option<BoxCgroups>,
    pub rlimits: Vec<(u32, u64)>,
    pub described: Vec<String>,
}

static NEXT: AtomicU64 = AtomicU64::new(0);

fn make(parent: &Path, files: &[(&str, String)], made: &mut Vec<PathBuf>) -> std::io::Result<()> {
    let dir = parent.join(format!(
        "sandbox-confine-{}-{}",
        std::process::id(),
        NEXT.fetch_add(1, Ordering::Relaxed)
    ));
    fs::create_dir(&dir)?;
    made.push(dir.clone());
    for (file, value) in files {
        fs::write(dir.join(file), value)?;
    }
    Ok(())
}

/// Create the cgroups for `limits`, or plan rlimits where that is not possible.
pub(crate) fn plan(limits: &Limits) -> Result<Plan, ConfineError> {
    let mut plan = Plan::default();
    if limits.enforce == Need::Off
        || (limits.pids.is_none() && limits.memory.is_none() && limits.cpu.is_none())
    {
        return Ok(plan);
    }
    let layout = cgroup_layout();
    let mut made = Vec::new();
    let mut missing: Vec<&str> = Vec::new();
    let cpu_value = |cpus: f64| ((cpus * 100_000.0).round() as u64).max(1000);
    // A cgroup that cannot be made or configured falls back like a missing controller.
    let by_cgroup = |_what: &str, result: std::io::Result<()>| result.is_ok();
    let (mut pids_done, mut mem_done, mut cpu_done) = (false, false, false);
    let kind = match &layout {
        CgroupLayout::V2(dir) => {
            let mut files = Vec::new();
            if let Some(p) = limits.pids {
                files.push(("pids.max", p.to_string()));
            }
            if let Some(m) = limits.memory {
                files.push(("memory.max", m.to_string()));
                files.push(("memory.swap.max", "0".to_owned()));
            }
            if let Some(c) = limits.cpu {
                files.push(("cpu.max", format!("{} 100000", cpu_value(c))));
            }
            if by_cgroup("cgroup2", make(dir, &files, &mut made)) {
                (pids_done, mem_done, cpu_done) = (true, true, true);
            }
            "cgroup v2"
        }
        CgroupLayout::V1 { pids, memory, cpu } => {
            if let (Some(p), Some(dir)) = (limits.pids, pids) {
                pids_done = by_cgroup("pids", make(dir, &[("pids.max", p.to_string())], &mut made));
            }
            if let (Some(m), Some(dir)) = (limits.memory, memory) {
                mem_done = by_cgroup(
                    "memory",
                    make(dir, &[("memory.limit_in_bytes", m.to_string())], &mut made),
                );
            }
            if let (Some(c), Some(dir)) = (limits.cpu, cpu) {
                cpu_done = by_cgroup(
                    "cpu",
                    make(
                        dir,
                        &[
                            ("cpu.cfs_period_us", "100000".to_owned()),
                            ("cpu.cfs_quota_us", cpu_value(c).to_string()),
                        ],
                        &mut made,
                    ),
                );
            }
            "cgroup v1"
        }
        CgroupLayout::None => "none",
    };
    if let Some(p) = limits.pids {
        if pids_done {
            plan.described.push(format!("pids={p} ({kind})"));
        } else {
            // Counted per user (and since Linux 5.14 per user namespace, so per box).
            plan.rlimits.push((libc::RLIMIT_NPROC, p));
            plan.described.push(format!("pids={p} (RLIMIT_NPROC)"));
        }
    }
    if let Some(m) = limits.memory {
        if mem_done {
            plan.described.push(format!("memory={m} ({kind})"));
        } else {
            plan.rlimits.push((libc::RLIMIT_AS, m));
            plan.described
                .push(format!("memory={m} (RLIMIT_AS, per process)"));
            missing.push("a memory cgroup (only RLIMIT_AS per process is in force)");
        }
    }
    if let Some(c) = limits.cpu {
        if cpu_done {
            plan.described.push(format!("cpu={c} ({kind})"));
        } else {
            missing.push("a cpu cgroup (no fallback for a CPU limit)");
        }
    }
    let cgroups = (!made.is_empty()).then_some(BoxCgroups { dirs: made });
    if limits.enforce == Need::Required && !missing.is_empty() {
        if let Some(cg) = &cgroups {
            cg.remove();
        }
        return Err(ConfineError::Unavailable {
            missing: format!("resource limits: {}", missing.join("; ")),
            how_to_enable: format!(
                "run with a writable cgroup (root, or a delegated cgroup2 subtree with the \
                 pids, memory and cpu controllers enabled; layout here: {layout:?}), or \
                 leave the limit at its default / Limits::none()"
            ),
        });
    }
    plan.cgroups = cgroups;
    Ok(plan)
}
