//! `cargo xtask k8s-up` and `cargo xtask k8s-fidelity`: the Kubernetes test cluster
//! (`testing/k8s-testcluster`) in the foreground, and the official-client fidelity check
//! against it.

use crate::{run, run_env};

/// The pod image (`cargo xtask images`): sandboxd serving REST, gRPC and the legacy
/// python-runtime API, by the content tag this run built.
fn pod_image() -> String {
    crate::k8s_pod_image_tag()
}
/// The Python environment of the fidelity check (every package pinned).
const REQUIREMENTS: &str = "testing/k8s-testcluster/fidelity/requirements.txt";
const SCRIPT: &str = "testing/k8s-testcluster/fidelity/fidelity.py";
const VENV: &str = "py-venv";

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
    let out = crate::target_dir().join("bench");
    run_env(
        "cargo",
        &["bench", "-p", "sandbox-k8s", "--bench", "k8s"],
        &[
            ("SANDBOX_TEST_DOCKER", "1"),
            ("SANDBOX_K8S_POD_IMAGE", image.as_str()),
            ("SANDBOX_BENCH_OUT", out.to_str().expect("UTF-8 path")),
        ],
    )
}

/// `cargo xtask k8s-fidelity`: start the cluster (bin), run the fidelity script with the
/// pinned official clients, always stop the cluster.
pub(crate) fn fidelity() -> Result<(), String> {
    let kubeconfig = crate::target_dir().join("k8s-testcluster/fidelity.kubeconfig");
    crate::fidelity::run_check(crate::fidelity::Check {
        name: "k8s test cluster",
        package: "k8s-testcluster",
        args: vec![
            "--pod-image".into(),
            pod_image(),
            "--warm".into(),
            "1".into(),
            // A small event window, so the script can push a version out of it (410 Gone).
            "--event-window".into(),
            "64".into(),
            "--kubeconfig".into(),
            kubeconfig.display().to_string(),
        ],
        requirements: REQUIREMENTS,
        venv: VENV,
        script: SCRIPT,
        env: vec![("WARM_POOL", "default")],
    })
}

/// `py-venv` (under the target directory) with the pinned packages; its python.
pub(crate) fn venv() -> Result<String, String> {
    crate::fidelity::venv(VENV, REQUIREMENTS)
}
