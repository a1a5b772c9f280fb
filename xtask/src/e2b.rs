//! `cargo xtask e2b-fidelity`: the official E2B Python SDK (pinned) against the E2B test
//! server (`testing/e2b-testserver`), whose sandboxes are containers of the k8s pod image.

/// `cargo xtask e2b-fidelity`: start the test server (bin), run the fidelity script with
/// the pinned SDK, always stop the server.
pub(crate) fn fidelity() -> Result<(), String> {
    crate::fidelity::run_check(crate::fidelity::Check {
        name: "e2b test server",
        package: "e2b-testserver",
        args: vec!["--image".into(), crate::k8s_pod_image_tag()],
        requirements: "testing/e2b-testserver/fidelity/requirements.txt",
        venv: "py-venv-e2b",
        script: "testing/e2b-testserver/fidelity/fidelity.py",
        env: Vec::new(),
    })
}
