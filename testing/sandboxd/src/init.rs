//! PID 1 duty: when `sandboxd` is the first process of a container, orphans are reparented
//! to it and must be reaped. A tokio runtime cannot reap "any child" without stealing the
//! exit statuses of the children it waits for, so PID 1 does only this: it starts the real
//! server as its child, reaps every child that ends (the server's orphans included) and
//! forwards SIGTERM, SIGINT, SIGHUP and SIGQUIT to the server, exiting as the server does.
//! Signals are taken synchronously with `sigwait` (no handlers, no `unsafe`); the blocked
//! mask is inherited by the server, which clears it first thing.

use std::process::ExitCode;

use nix::errno::Errno;
use nix::sys::signal::{SigSet, Signal, kill};
use nix::sys::wait::{WaitPidFlag, WaitStatus, waitpid};
use nix::unistd::Pid;

/// Set to any value to stay a plain server even as PID 1 (a reaper is in front already).
pub const NO_INIT_ENV: &str = "SANDBOXD_NO_INIT";

/// Whether this process should act as the reaping init.
pub fn wanted() -> bool {
    std::process::id() == 1 && std::env::var_os(NO_INIT_ENV).is_none()
}

/// Run the server as a child and reap until it exits; its exit status becomes ours.
pub fn run() -> ExitCode {
    match reap() {
        Ok(code) => code,
        Err(e) => {
            eprintln!("sandboxd (init): {e}");
            ExitCode::FAILURE
        }
    }
}

fn reap() -> Result<ExitCode, String> {
    let mut signals = SigSet::empty();
    for s in [
        Signal::SIGCHLD,
        Signal::SIGTERM,
        Signal::SIGINT,
        Signal::SIGHUP,
        Signal::SIGQUIT,
    ] {
        signals.add(s);
    }
    // Blocked before the child exists, so no SIGCHLD is missed.
    signals
        .thread_block()
        .map_err(|e| format!("blocking signals: {e}"))?;
    let exe = std::env::current_exe().map_err(|e| format!("finding my executable: {e}"))?;
    let child = std::process::Command::new(exe)
        .args(std::env::args_os().skip(1))
        .spawn()
        .map_err(|e| format!("starting the server: {e}"))?;
    let server = Pid::from_raw(i32::try_from(child.id()).map_err(|e| e.to_string())?);
    loop {
        match signals
            .wait()
            .map_err(|e| format!("waiting for signals: {e}"))?
        {
            Signal::SIGCHLD => loop {
                match waitpid(None, Some(WaitPidFlag::WNOHANG)) {
                    Ok(WaitStatus::Exited(pid, code)) if pid == server => {
                        return Ok(ExitCode::from(u8::try_from(code).unwrap_or(1)));
                    }
                    Ok(WaitStatus::Signaled(pid, sig, _)) if pid == server => {
                        return Ok(ExitCode::from(128u8.saturating_add(sig as u8)));
                    }
                    Ok(WaitStatus::StillAlive) | Err(Errno::ECHILD) => break,
                    Ok(_) | Err(Errno::EINTR) => {}
                    Err(e) => return Err(format!("reaping: {e}")),
                }
            },
            forwarded => {
                let _ = kill(server, forwarded);
            }
        }
    }
}
