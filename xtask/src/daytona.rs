//! `cargo xtask daytona-fidelity`: the official Daytona Python SDK (pinned) against the
//! Daytona test server (`testing/daytona-testserver`), whose sandboxes are containers of the
//! k8s pod image.

/// `cargo xtask daytona-fidelity`: start the test server (bin), run the fidelity script with
/// the pinned SDK, always stop the server.
pub(crate) fn fidelity() -> Result<(), String> {
    crate::fidelity::run_check(crate::fidelity::Check {
        name: "daytona test server",
        package: "daytona-testserver",
        args: vec!["--image".into(), crate::k8s_pod_image_tag()],
        requirements: "testing/daytona-testserver/fidelity/requirements.txt",
        venv: "py-venv-daytona",
        script: "testing/daytona-testserver/fidelity/fidelity.py",
        env: Vec::new(),
    })
}
