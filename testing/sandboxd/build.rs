//! Docker tests run when `SANDBOX_TEST_DOCKER=1` (as `cargo xtask test` sets): the variable
//! turns on the `docker_tests` cfg, without which they are `#[ignore]`d. The official-SDK test
//! runs when `SANDBOXD_TEST_SDK_PYTHON` names a Python with the SDK (`cargo xtask test` sets it
//! to its pinned venv): the `sdk_tests` cfg.
fn main() {
    println!("cargo::rustc-check-cfg=cfg(docker_tests)");
    println!("cargo::rustc-check-cfg=cfg(sdk_tests)");
    println!("cargo::rerun-if-env-changed=SANDBOX_TEST_DOCKER");
    println!("cargo::rerun-if-env-changed=SANDBOXD_TEST_SDK_PYTHON");
    if std::env::var("SANDBOX_TEST_DOCKER").is_ok_and(|v| v == "1") {
        println!("cargo::rustc-cfg=docker_tests");
    }
    if std::env::var_os("SANDBOXD_TEST_SDK_PYTHON").is_some_and(|v| !v.is_empty()) {
        println!("cargo::rustc-cfg=sdk_tests");
    }
}
