//! The seccomp denylist every process of a box runs under (installed once by the box's init,
//! inherited by everything it starts; a filter can only be added to, never removed).
//!
//! Built with `seccompiler` (Firecracker's): pure Rust, no libseccomp C library to link or
//! ship, it compiles rules with argument conditions to classic BPF and checks the
//! architecture (a syscall made through another ABI, `int 0x80` on x86-64, kills the process).
//! x32 numbers (`nr | 0x4000_0000`) of every denied call are denied too, so the 64-bit ABI's
//! numbers cannot be reached around the list.
//!
//! Denied calls return `EPERM` (`clone3` returns `ENOSYS` so that libc falls back to `clone`,
//! whose flags a filter can see). What is denied and why:
//!
//! | calls | why |
//! | --- | --- |
//! | `mount`, `umount2`, `pivot_root`, `chroot`, `move_mount`, `open_tree`, `fsopen`, `fsconfig`, `fsmount`, `fspick`, `mount_setattr` | remounting or unmounting the box's read-only root or masks would undo the file-system confinement |
//! | `unshare`, `clone` with `CLONE_NEWUSER`; `clone3`; `setns` | a new user namespace gives a full capability set again, the base of most namespace escapes and kernel exploits |
//! | `ptrace`, `process_vm_readv`, `process_vm_writev`, `pidfd_getfd`, `kcmp` | reading or steering another process (the box's init holds capabilities in the box's namespace) |
//! | `kexec_load`, `kexec_file_load`, `reboot`, `init_module`, `finit_module`, `delete_module`, `swapon`, `swapoff`, `acct`, `syslog`, `iopl`, `ioperm`, `quotactl` | host administration; refused by the kernel without host capabilities anyway, denied so that a kernel bug behind them is out of reach |
//! | `bpf`, `perf_event_open`, `userfaultfd` | large kernel attack surface, side channels, the usual exploit primitives |
//! | `io_uring_setup`, `io_uring_enter`, `io_uring_register` | io_uring performs operations (open, connect, sockets) without the syscalls this filter sees |
//! | `keyctl`, `add_key`, `request_key` | the kernel keyring is not namespaced: keys of other users and boxes |
//! | `open_by_handle_at`, `name_to_handle_at` | opens files by handle, bypassing the mount tree (the classic container breakout) |
//! | `socket` with `AF_VSOCK`, `AF_PACKET`, or type `SOCK_RAW` | the hypervisor's vsock reaches the host without any route; packet and raw sockets forge traffic |
//! | `mknod`, `mknodat` of a character or block device | device nodes give raw access to hardware; FIFOs and sockets stay allowed |
//! | `ioctl` `TIOCSTI`, `TIOCLINUX` | typing into a terminal outside the box |

use std::collections::BTreeMap;

use seccompiler::{
    BpfProgram, SeccompAction, SeccompCmpArgLen, SeccompCmpOp, SeccompCondition, SeccompFilter,
    SeccompRule,
};

const X32_BIT: i64 = 0x4000_0000;

/// Calls denied whatever their arguments.
const DENIED: &[i64] = &[
    libc::SYS_mount,
    libc::SYS_umount2,
    libc::SYS_pivot_root,
    libc::SYS_chroot,
    libc::SYS_move_mount,
    libc::SYS_open_tree,
    libc::SYS_fsopen,
    libc::SYS_fsconfig,
    libc::SYS_fsmount,
    libc::SYS_fspick,
    libc::SYS_mount_setattr,
    libc::SYS_setns,
    libc::SYS_ptrace,
    libc::SYS_process_vm_readv,
    libc::SYS_process_vm_writev,
    libc::SYS_pidfd_getfd,
    libc::SYS_kcmp,
    libc::SYS_kexec_load,
    libc::SYS_kexec_file_load,
    libc::SYS_reboot,
    libc::SYS_init_module,
    libc::SYS_finit_module,
    libc::SYS_delete_module,
    libc::SYS_swapon,
    libc::SYS_swapoff,
    libc::SYS_acct,
    libc::SYS_syslog,
    libc::SYS_iopl,
    libc::SYS_ioperm,
    libc::SYS_quotactl,
    libc::SYS_bpf,
    libc::SYS_perf_event_open,
    libc::SYS_userfaultfd,
    libc::SYS_io_uring_setup,
    libc::SYS_io_uring_enter,
    libc::SYS_io_uring_register,
    libc::SYS_keyctl,
    libc::SYS_add_key,
    libc::SYS_request_key,
    libc::SYS_open_by_handle_at,
    libc::SYS_name_to_handle_at,
];

/// The names of the calls the filter denies (some only with certain arguments), for reports.
pub const DENIED_NAMES: &[&str] = &[
    "mount",
    "umount2",
    "pivot_root",
    "chroot",
    "move_mount",
    "open_tree",
    "fsopen",
    "fsconfig",
    "fsmount",
    "fspick",
    "mount_setattr",
    "setns",
    "unshare(CLONE_NEWUSER)",
    "clone(CLONE_NEWUSER)",
    "clone3",
    "ptrace",
    "process_vm_readv",
    "process_vm_writev",
    "pidfd_getfd",
    "kcmp",
    "kexec_load",
    "kexec_file_load",
    "reboot",
    "init_module",
    "finit_module",
    "delete_module",
    "swapon",
    "swapoff",
    "acct",
    "syslog",
    "iopl",
    "ioperm",
    "quotactl",
    "bpf",
    "perf_event_open",
    "userfaultfd",
    "io_uring_setup",
    "io_uring_enter",
    "io_uring_register",
    "keyctl",
    "add_key",
    "request_key",
    "open_by_handle_at",
    "name_to_handle_at",
    "socket(AF_VSOCK|AF_PACKET|SOCK_RAW)",
    "mknod(S_IFCHR|S_IFBLK)",
    "ioctl(TIOCSTI|TIOCLINUX)",
];

fn cond(arg: u8, len: SeccompCmpArgLen, op: SeccompCmpOp, value: u64) -> SeccompCondition {
    SeccompCondition::new(arg, len, op, value).expect("a valid seccomp condition")
}

fn rule(conditions: Vec<SeccompCondition>) -> SeccompRule {
    SeccompRule::new(conditions).expect("a valid seccomp rule")
}

fn masked(arg: u8, mask: u64, value: u64) -> SeccompRule {
    rule(vec![cond(
        arg,
        SeccompCmpArgLen::Qword,
        SeccompCmpOp::MaskedEq(mask),
        value,
    )])
}

fn eq(arg: u8, value: u64) -> SeccompRule {
    rule(vec![cond(
        arg,
        SeccompCmpArgLen::Dword,
        SeccompCmpOp::Eq,
        value,
    )])
}

/// The compiled denylist for this machine's architecture.
pub fn denylist() -> Result<Vec<BpfProgram>, String> {
    let mut rules: BTreeMap<i64, Vec<SeccompRule>> = BTreeMap::new();
    for nr in DENIED {
        rules.insert(*nr, Vec::new());
    }
    let newuser = libc::CLONE_NEWUSER as u64;
    rules.insert(libc::SYS_unshare, vec![masked(0, newuser, newuser)]);
    rules.insert(libc::SYS_clone, vec![masked(0, newuser, newuser)]);
    rules.insert(
        libc::SYS_socket,
        vec![
            eq(0, libc::AF_VSOCK as u64),
            eq(0, libc::AF_PACKET as u64),
            masked(1, 0xf, libc::SOCK_RAW as u64),
        ],
    );
    let fmt = libc::S_IFMT as u64;
    rules.insert(
        libc::SYS_mknod,
        vec![
            masked(1, fmt, libc::S_IFCHR as u64),
            masked(1, fmt, libc::S_IFBLK as u64),
        ],
    );
    rules.insert(
        libc::SYS_mknodat,
        vec![
            masked(2, fmt, libc::S_IFCHR as u64),
            masked(2, fmt, libc::S_IFBLK as u64),
        ],
    );
    rules.insert(
        libc::SYS_ioctl,
        vec![eq(1, libc::TIOCSTI), eq(1, libc::TIOCLINUX)],
    );
    // The same calls by their x32 numbers.
    let native: Vec<(i64, Vec<SeccompRule>)> = rules.iter().map(|(k, v)| (*k, v.clone())).collect();
    for (nr, r) in native {
        rules.insert(nr | X32_BIT, r);
    }
    let arch = std::env::consts::ARCH
        .try_into()
        .map_err(|e| format!("seccomp: unsupported architecture: {e:?}"))?;
    let deny = SeccompFilter::new(
        rules,
        SeccompAction::Allow,
        SeccompAction::Errno(libc::EPERM as u32),
        arch,
    )
    .map_err(|e| format!("seccomp filter: {e}"))?;
    let mut program: BpfProgram = deny
        .try_into()
        .map_err(|e| format!("seccomp filter: {e:?}"))?;
    // clone3 passes its flags in memory a filter cannot read: ENOSYS makes libc use clone.
    let clone3 = SeccompFilter::new(
        [
            (libc::SYS_clone3, Vec::new()),
            (libc::SYS_clone3 | X32_BIT, Vec::new()),
        ]
        .into_iter()
        .collect(),
        SeccompAction::Allow,
        SeccompAction::Errno(libc::ENOSYS as u32),
        std::env::consts::ARCH
            .try_into()
            .map_err(|e| format!("{e:?}"))?,
    )
    .map_err(|e| format!("seccomp filter: {e}"))?;
    let clone3: BpfProgram = clone3.try_into().map_err(|e| format!("{e:?}"))?;
    // Two programs: the kernel runs both and the strictest answer wins.
    program.shrink_to_fit();
    Ok(vec![program, clone3])
}

/// Install [`denylist`]'s programs on the calling thread (no_new_privs must be set).
pub fn apply(programs: &[BpfProgram]) -> Result<(), String> {
    for program in programs {
        seccompiler::apply_filter(program).map_err(|e| format!("seccomp: {e}"))?;
    }
    Ok(())
}
