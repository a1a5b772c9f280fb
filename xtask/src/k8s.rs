//! `cargo xtask k8s-up` and `cargo xtask k8s-fidelity`: the Kubernetes test cluster
//! (`crates/k8s-testcluster`) in the foreground, and the official-client fidelity check
//! against it.

use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use crate::{run, run_env, workspace_root};

/// The pod image (`cargo xtask images`): sandboxd serving REST, gRPC and the legacy
/// python-runtime API, by the content tag this run built.
fn pod_image() -> String {
    crate::k8s_pod_image_tag()
}
/// The Python environment of the fidelity check (every package pinned).
const REQUIREMENTS: &str = "crates/k8s-testcluster/fidelity/requirements.txt";
const SCRIPT: &str = "crates/k8s-testcluster/fidelity/fidelity.py";
const VENV: &str = "target/py-venv";

/// `cargo xtask k8s-up [ARGS]`: build the images, run the cluster in the foreground
/// (Ctrl-C stops it and removes its containers).
pub(crate) fn up(args: &[String]) -> Result<(), String> {
    crate::docker_images()?;
    let mut cmd = vec![
        "run",
        "--quiet",
        "-p",
        "k8s-testcluster",
        "--bin",
        "k8s-testcluster",
        "--",
    ];
    let has_image = args.iter().any(|a| a == "--pod-image");
    let image = pod_image();
    if !has_image {
        cmd.extend(["--pod-image", &image, "--warm", "1"]);
    }
    cmd.extend(args.iter().map(String::as_str));
    run("cargo", &cmd)
}

/// `cargo xtask bench k8s`: build the images, then run the benchmark (release) with the pod
/// image of this run.
pub(crate) fn bench() -> Result<(), String> {
    crate::docker_images()?;
    let image = pod_image();
    run_env(
        "cargo",
        &["bench", "-p", "sandbox-k8s", "--bench", "k8s"],
        &[
            ("SANDBOX_TEST_DOCKER", "1"),
            ("SANDBOX_K8S_POD_IMAGE", image.as_str()),
        ],
    )
}

/// `cargo xtask k8s-fidelity`: start the cluster (bin), run the fidelity script with the
/// pinned official clients, always stop the cluster.
pub(crate) fn fidelity() -> Result<(), String> {
    crate::docker_images()?;
    let have = Command::new("docker")
        .args(["image", "inspect", "--format", "{{.Id}}", &pod_image()])
        .output()
        .map_err(|e| format!("cannot run docker: {e}"))?;
    if !have.status.success() {
        return Err(format!(
            "the pod image {} is missing after `cargo xtask images`",
            pod_image()
        ));
    }
    let python = venv()?;
    run(
        "cargo",
        &[
            "build",
            "--quiet",
            "-p",
            "k8s-testcluster",
            "--bin",
            "k8s-testcluster",
        ],
    )?;
    let cluster = Cluster::start()?;
    let mut env: Vec<(&str, &str)> = cluster
        .info
        .iter()
        .map(|(k, v)| (k.as_str(), v.as_str()))
        .collect();
    env.push(("WARM_POOL", "default"));
    let script = workspace_root().join(SCRIPT).display().to_string();
    let result = run_env(&python, &[&script], &env);
    drop(cluster);
    result.map_err(|e| format!("the official-client fidelity check failed: {e}"))
}

/// `target/py-venv` with the pinned packages; its python.
pub(crate) fn venv() -> Result<String, String> {
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

/// The test cluster's process; stopped (SIGTERM, so it removes its containers) on drop.
struct Cluster {
    child: Child,
    info: Vec<(String, String)>,
}

impl Cluster {
    fn start() -> Result<Cluster, String> {
        let dir = workspace_root().join("target/k8s-testcluster");
        std::fs::create_dir_all(&dir).map_err(|e| format!("creating {}: {e}", dir.display()))?;
        let ready = dir.join("fidelity.ready");
        let _ = std::fs::remove_file(&ready);
        let bin = workspace_root().join("target/debug/k8s-testcluster");
        let child = Command::new(&bin)
            .args(["--pod-image", &pod_image(), "--warm", "1"])
            // A small event window, so the script can push a version out of it (410 Gone).
            .args(["--event-window", "64"])
            .arg("--kubeconfig")
            .arg(dir.join("fidelity.kubeconfig"))
            .arg("--ready-file")
            .arg(&ready)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .spawn()
            .map_err(|e| format!("cannot run {}: {e}", bin.display()))?;
        let mut cluster = Cluster {
            child,
            info: Vec::new(),
        };
        cluster.info = cluster.wait_ready(&ready)?;
        println!("xtask: k8s test cluster (pid {}) ready", cluster.child.id());
        Ok(cluster)
    }

    /// Poll for the ready file (written once the cluster serves) for up to 60 s.
    fn wait_ready(&mut self, ready: &Path) -> Result<Vec<(String, String)>, String> {
        let started = Instant::now();
        loop {
            if let Ok(Some(status)) = self.child.try_wait() {
                return Err(format!("the k8s test cluster exited: {status}"));
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
                return Err("the k8s test cluster did not get ready in 60 s".to_owned());
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        // SIGTERM lets it remove its containers and network; SIGKILL if it hangs.
        let pid = self.child.id().to_string();
        let _ = Command::new("kill").args(["-TERM", &pid]).status();
        let started = Instant::now();
        while started.elapsed() < Duration::from_secs(20) {
            if let Ok(Some(_)) = self.child.try_wait() {
                println!("xtask: k8s test cluster stopped");
                return;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
