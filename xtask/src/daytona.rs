//! `cargo xtask daytona-fidelity`: the official Daytona Python SDK (pinned) against the
//! Daytona test server (`crates/daytona-testserver`).

use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use crate::{run, run_env, workspace_root};

/// The Python environment of the fidelity check (every package pinned).
const REQUIREMENTS: &str = "crates/daytona-testserver/fidelity/requirements.txt";
const SCRIPT: &str = "crates/daytona-testserver/fidelity/fidelity.py";
const VENV: &str = "target/py-venv-daytona";

/// `cargo xtask daytona-fidelity`: build the images, start the server (bin), run the
/// fidelity script with the pinned SDK, always stop the server.
pub(crate) fn fidelity() -> Result<(), String> {
    crate::docker_images()?;
    let image = crate::k8s_pod_image_tag();
    let python = venv()?;
    run(
        "cargo",
        &[
            "build",
            "--quiet",
            "-p",
            "daytona-testserver",
            "--bin",
            "daytona-testserver",
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
    result.map_err(|e| format!("the Daytona SDK fidelity check failed: {e}"))
}

/// `target/py-venv-daytona` with the pinned packages; its python.
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

/// The test server's process; stopped (SIGTERM, so it removes its containers) on drop.
struct Server {
    child: Child,
    info: Vec<(String, String)>,
}

impl Server {
    fn start(image: &str) -> Result<Server, String> {
        let dir = workspace_root().join("target/daytona-testserver");
        std::fs::create_dir_all(&dir).map_err(|e| format!("creating {}: {e}", dir.display()))?;
        let ready = dir.join("fidelity.ready");
        let _ = std::fs::remove_file(&ready);
        let bin = workspace_root().join("target/debug/daytona-testserver");
        let child = Command::new(&bin)
            .args(["--image", image])
            .arg("--ready-file")
            .arg(&ready)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .spawn()
            .map_err(|e| format!("cannot run {}: {e}", bin.display()))?;
        let mut server = Server {
            child,
            info: Vec::new(),
        };
        server.info = server.wait_ready(&ready)?;
        println!(
            "xtask: daytona test server (pid {}) ready",
            server.child.id()
        );
        Ok(server)
    }

    /// Poll for the ready file (written once the server serves) for up to 60 s.
    fn wait_ready(&mut self, ready: &Path) -> Result<Vec<(String, String)>, String> {
        let started = Instant::now();
        loop {
            if let Ok(Some(status)) = self.child.try_wait() {
                return Err(format!("the daytona test server exited: {status}"));
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
                return Err("the daytona test server did not get ready in 60 s".to_owned());
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        // SIGTERM lets it remove its containers and network; SIGKILL if it hangs.
        let pid = self.child.id().to_string();
        let _ = Command::new("kill").args(["-TERM", &pid]).status();
        let started = Instant::now();
        while started.elapsed() < Duration::from_secs(20) {
            if let Ok(Some(_)) = self.child.try_wait() {
                println!("xtask: daytona test server stopped");
                return;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
