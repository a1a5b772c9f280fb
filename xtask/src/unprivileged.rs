//! `cargo xtask unprivileged-test`: the confined local backend's escape suite, hostile
//! workloads and the conformance kit (confined, the default) run again as an unprivileged
//! user.
//!
//! The test binaries are built as the invoking user, then run as uid/gid 65534 (`nobody`,
//! through util-linux's `setpriv`, groups cleared) with `HOME` and `TMPDIR` in a fresh
//! world-writable directory: no cgroup is writable there, so the limits fall back to rlimits,
//! and user namespaces must be allowed to unprivileged users (the suite fails naming what is
//! missing otherwise). Run as a non-root user, the binaries simply run as that user.

use std::process::Command;

const UID: &str = "65534";

pub(crate) fn run() -> Result<(), String> {
    let out = Command::new("cargo")
        .args([
            "test",
            "-p",
            "sandbox-local",
            "--test",
            "escape",
            "--test",
            "conformance",
            "--test",
            "hostile",
            "--no-run",
            "--message-format=json",
        ])
        .output()
        .map_err(|e| format!("cannot run cargo: {e}"))?;
    if !out.status.success() {
        return Err(format!(
            "building the test binaries failed: {}",
            String::from_utf8_lossy(&out.stderr)
        ));
    }
    let stdout = String::from_utf8_lossy(&out.stdout);
    let executables: Vec<String> = stdout
        .lines()
        .filter_map(|l| {
            let at = l.find("\"executable\":\"")? + "\"executable\":\"".len();
            let rest = &l[at..];
            Some(rest[..rest.find('"')?].to_owned())
        })
        .collect();
    if executables.len() != 3 {
        return Err(format!("expected 3 test binaries, found {executables:?}"));
    }
    let root = Command::new("id")
        .arg("-u")
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim() == "0")
        .unwrap_or(false);
    let tmp = std::env::temp_dir().join(format!("xtask-unprivileged-{}", std::process::id()));
    std::fs::create_dir_all(&tmp).map_err(|e| format!("{}: {e}", tmp.display()))?;
    let chmod = Command::new("chmod").arg("1777").arg(&tmp).status();
    if !chmod.is_ok_and(|s| s.success()) {
        return Err(format!("cannot open {} to every user", tmp.display()));
    }
    let tmp_s = tmp.to_str().expect("UTF-8 temp dir").to_owned();
    let mut result = Ok(());
    for exe in &executables {
        let mut args: Vec<&str> = Vec::new();
        if root {
            args.extend(["--reuid", UID, "--regid", UID, "--clear-groups", "env"]);
        } else {
            args.push("env");
        }
        let home = format!("HOME={tmp_s}");
        let tmpdir = format!("TMPDIR={tmp_s}");
        args.extend([home.as_str(), tmpdir.as_str(), exe.as_str()]);
        let program = if root { "setpriv" } else { args.remove(0) };
        let status = Command::new(program)
            .args(&args)
            .current_dir(&tmp)
            .status()
            .map_err(|e| format!("cannot run {program}: {e}"));
        println!("xtask: {exe} as an unprivileged user: {status:?}");
        match status {
            Ok(s) if s.success() => {}
            Ok(s) => {
                result = Err(format!("{exe} failed as an unprivileged user ({s})"));
                break;
            }
            Err(e) => {
                result = Err(e);
                break;
            }
        }
    }
    let _ = std::fs::remove_dir_all(&tmp);
    result
}
