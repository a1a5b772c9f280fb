//! Redis tests run when `SANDBOX_TEST_REDIS_URL` is set (as `cargo xtask test` does): the
//! variable turns on the `redis_tests` cfg, without which they are `#[ignore]`d.
fn main() {
    println!("cargo::rustc-check-cfg=cfg(redis_tests)");
    println!("cargo::rerun-if-env-changed=SANDBOX_TEST_REDIS_URL");
    if std::env::var("SANDBOX_TEST_REDIS_URL").is_ok_and(|v| !v.is_empty()) {
        println!("cargo::rustc-cfg=redis_tests");
    }
}
