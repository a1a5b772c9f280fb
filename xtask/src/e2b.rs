//! `cargo xtask e2b-fidelity`: the official E2B Python SDK (pinned) against the E2B test
//! server (`crates/e2b-testserver`), whose sandboxes are containers of the k8s pod image.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use crate::{run, run_env, workspace_root};

/// The Python environment of the fidelity check (every package pinned).
const REQUIREMENTS: &str = "crates/e2b-testserver/fidelity/requirements.txt";
const SCRIPT: &str = "crates/e2b-testserver/fidelity/fidelity.py";
const VENV: &str = "target/py-venv-e2b";

/// `cargo xtask e2b-fidelity`: start the test server (bin), run the fidelity script with
/// the pinned SDK, always stop the server.
pub(crate) fn fidelity() -> Result<(), String> {
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
    let python = venv()?;
    run(
        "cargo",
        &[
            "build",
            "--quiet",
            "-p",
            "e2b-testserver",
            "--bin",
            "e2b-testserver",
        ],
    )?;
    let server = Server::start(&image)?;
    let env: Vec<(&str, &str)> = server
        .info
        .iter()
        .map(|(k, v)| (k.as_str(), v.as_str()))
        .collect();
    let script = workspace_root().join(SCRIPT).display().to_string();
    let result = run_env(&python, &[&script], &env);
    drop(server);
    result.map_err(|e| format!("the official E2B SDK fidelity check failed: {e}"))
}

/// `target/py-venv-e2b` with the pinned packages; its python.
fn venv() -> Result<String, String> {
    let root = workspace_root();
    let venv = root.join(VENV);
    let python = venv.join("bin/python");
    if !python.exists() {
        run("python3", &["-m", "venv", &venv.display().to_string()])?;
    }
    let python = python.display().to_string();
    let requirements = root.join(REQUIREMENTS).display().to_string();
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

/// Where cargo put the bin (`CARGO_TARGET_DIR` or `target`).
fn bin_path() -> PathBuf {
    let target = std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| workspace_root().join("target"));
    let target = if target.is_relative() {
        workspace_root().join(target)
    } else {
        target
    };
    target.join("debug/e2b-testserver")
}

/// The test server's process; stopped (SIGTERM, so it removes its containers) on drop.
struct Server {
    child: Child,
    info: Vec<(String, String)>,
}

impl Server {
    fn start(image: &str) -> Result<Server, String> {
        let dir = workspace_root().join("target/e2b-testserver");
        std::fs::create_dir_all(&dir).map_err(|e| format!("creating {}: {e}", dir.display()))?;
        let ready = dir.join("fidelity.ready");
        let _ = std::fs::remove_file(&ready);
        let bin = bin_path();
        let child = Command::new(&bin)
            .args(["--image", image])
            .arg("--ready-file")
            .arg(&ready)
            .stdin(Stdio::null())
            // Its stdout repeats the ready file, key included: not for the log.
            .stdout(Stdio::null())
            .spawn()
            .map_err(|e| format!("cannot run {}: {e}", bin.display()))?;
        let mut server = Server {
            child,
            info: Vec::new(),
        };
        server.info = server.wait_ready(&ready)?;
        println!("xtask: e2b test server (pid {}) ready", server.child.id());
        Ok(server)
    }

    /// Poll for the ready file (written once the server serves) for up to 60 s.
    fn wait_ready(&mut self, ready: &Path) -> Result<Vec<(String, String)>, String> {
        let started = Instant::now();
        loop {
            if let Ok(Some(status)) = self.child.try_wait() {
                return Err(format!("the e2b test server exited: {status}"));
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
                return Err("the e2b test server did not get ready in 60 s".to_owned());
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
                println!("xtask: e2b test server stopped");
                return;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
