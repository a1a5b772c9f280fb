//! The official-client fidelity checks (`k8s-fidelity`, `e2b-fidelity`, `daytona-fidelity`):
//! a venv with the pinned SDK, the test server's bin started (its ready file polled), the
//! check script run against it, the server always stopped.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use crate::{run, run_env, workspace_root};

/// One fidelity check.
pub(crate) struct Check {
    /// What the server is called in messages ("e2b test server").
    pub name: &'static str,
    /// The package and bin of the server.
    pub package: &'static str,
    /// Arguments of the bin before `--ready-file`.
    pub args: Vec<String>,
    /// Pinned requirements (workspace-relative).
    pub requirements: &'static str,
    /// The venv (relative to the target directory).
    pub venv: &'static str,
    /// The check script (workspace-relative).
    pub script: &'static str,
    /// Extra environment for the script (beyond the server's ready-file values).
    pub env: Vec<(&'static str, &'static str)>,
}

/// Run `check`: image present, venv, bin built, server up, script, server stopped.
pub(crate) fn run_check(check: Check) -> Result<(), String> {
    crate::docker_images()?;
    let image = crate::k8s_pod_image_tag();
    let have = Command::new("docker")
        .args(["image", "inspect", "--format", "{{.Id}}", &image])
        .output()
        .map_err(|e| format!("cannot run docker: {e}"))?;
    if !have.status.success() {
        return Err(format!(
            "the sandbox image {image} is missing after `cargo xtask images`"
        ));
    }
    let python = venv(check.venv, check.requirements)?;
    run(
        "cargo",
        &[
            "build",
            "--quiet",
            "-p",
            check.package,
            "--bin",
            check.package,
        ],
    )?;
    let server = Server::start(&check)?;
    let mut env: Vec<(&str, &str)> = server
        .info
        .iter()
        .map(|(k, v)| (k.as_str(), v.as_str()))
        .collect();
    env.extend(check.env.iter().copied());
    let script = workspace_root().join(check.script).display().to_string();
    let result = run_env(&python, &[&script], &env);
    drop(server);
    result.map_err(|e| {
        format!(
            "the official-client check of the {} failed: {e}",
            check.name
        )
    })
}

/// The venv at `dir` (relative to the target directory) with the pinned `requirements`; its python.
pub(crate) fn venv(dir: &str, requirements: &str) -> Result<String, String> {
    let root = workspace_root();
    let venv = crate::target_dir().join(dir);
    let python = venv.join("bin/python");
    if !python.exists() {
        run("python3", &["-m", "venv", &venv.display().to_string()])?;
    }
    let python = python.display().to_string();
    let requirements = root.join(requirements).display().to_string();
    run(
        &python,
        &[
            "-m",
            "pip",
            "install",
            "--quiet",
            "--disable-pip-version-check",
            "-r",
            &requirements,
        ],
    )?;
    Ok(python)
}

/// Where cargo put a debug bin (`CARGO_TARGET_DIR` or `target`).
fn bin_path(name: &str) -> PathBuf {
    crate::target_dir().join("debug").join(name)
}

/// A test server's process; stopped (SIGTERM, so it removes its containers) on drop.
struct Server {
    name: &'static str,
    child: Child,
    info: Vec<(String, String)>,
}

impl Server {
    fn start(check: &Check) -> Result<Server, String> {
        let dir = crate::target_dir().join(check.package);
        std::fs::create_dir_all(&dir).map_err(|e| format!("creating {}: {e}", dir.display()))?;
        let ready = dir.join("fidelity.ready");
        let _ = std::fs::remove_file(&ready);
        let bin = bin_path(check.package);
        let child = Command::new(&bin)
            .args(&check.args)
            .arg("--ready-file")
            .arg(&ready)
            .stdin(Stdio::null())
            // Its stdout repeats the ready file, keys included: not for the log.
            .stdout(Stdio::null())
            .spawn()
            .map_err(|e| format!("cannot run {}: {e}", bin.display()))?;
        let mut server = Server {
            name: check.name,
            child,
            info: Vec::new(),
        };
        server.info = server.wait_ready(&ready)?;
        println!("xtask: {} (pid {}) ready", check.name, server.child.id());
        Ok(server)
    }

    /// Poll for the ready file (written once the server serves) for up to 60 s.
    fn wait_ready(&mut self, ready: &Path) -> Result<Vec<(String, String)>, String> {
        let started = Instant::now();
        loop {
            if let Ok(Some(status)) = self.child.try_wait() {
                return Err(format!("the {} exited: {status}", self.name));
            }
            if let Ok(text) = std::fs::read_to_string(ready)
                && text.ends_with('\n')
            {
                return Ok(text
                    .lines()
                    .filter_map(|l| l.split_once('='))
                    .map(|(k, v)| (k.to_owned(), v.to_owned()))
                    .collect());
            }
            if started.elapsed() > Duration::from_secs(60) {
                return Err(format!("the {} did not get ready in 60 s", self.name));
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        // SIGTERM lets it remove its containers, images and network; SIGKILL if it hangs.
        let pid = self.child.id().to_string();
        let _ = Command::new("kill").args(["-TERM", &pid]).status();
        let started = Instant::now();
        while started.elapsed() < Duration::from_secs(20) {
            if let Ok(Some(_)) = self.child.try_wait() {
                println!("xtask: {} stopped", self.name);
                return;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
