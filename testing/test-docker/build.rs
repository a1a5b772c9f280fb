//! Docker tests run when `SANDBOX_TEST_DOCKER=1` (as `cargo xtask test` sets): the variable
//! turns on the `docker_tests` cfg, without which they are `#[ignore]`d.
fn main() {
    println!("cargo::rustc-check-cfg=cfg(docker_tests)");
    println!("cargo::rerun-if-env-changed=SANDBOX_TEST_DOCKER");
    if std::env::var("SANDBOX_TEST_DOCKER").is_ok_and(|v| v == "1") {
        println!("cargo::rustc-cfg=docker_tests");
    }
}
