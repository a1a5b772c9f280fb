//! The official Python SDK (k8s-agent-sandbox 1.0.8, `[grpc]` extra) against this server:
//! `official_sdk.py` writes, reads, lists, deletes and runs commands in sandboxd mode
//! (REST + gRPC) and in legacy mode. Needs a Python with the SDK installed, named by
//! `SANDBOXD_TEST_SDK_PYTHON` (`cargo xtask test` sets it to its pinned venv,
//! `testing/k8s-testcluster/fidelity/requirements.txt`); without it the test is ignored, and run
//! with `--ignored` it fails, never skips.

mod common;

use common::Harness;

#[tokio::test]
#[cfg_attr(
    not(sdk_tests),
    ignore = "needs the official SDK: SANDBOXD_TEST_SDK_PYTHON=<python with k8s-agent-sandbox[grpc]==1.0.8>; run by cargo xtask test"
)]
async fn the_official_python_sdk_works_against_sandboxd() {
    let python = std::env::var("SANDBOXD_TEST_SDK_PYTHON")
        .expect("SANDBOXD_TEST_SDK_PYTHON names a Python with k8s-agent-sandbox[grpc]==1.0.8");
    let h = Harness::start().await;
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/official_sdk.py");
    let out = tokio::process::Command::new(python)
        .arg(script)
        .arg(h.server.rest_addr().port().to_string())
        .arg(h.server.grpc_addr().port().to_string())
        .arg(h.server.legacy_addr().port().to_string())
        .arg(h.base())
        .output()
        .await
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{}\n{stdout}\n{stderr}", out.status);
    assert!(stdout.contains("official SDK checks passed"), "{stdout}");
    h.assert_outside_untouched();
}
