//! The S3 tests run when `SANDBOX_TEST_S3FS` names an `s3s-fs` binary (as `cargo xtask test`
//! and `cargo xtask s3-test` do): the variable turns on the `s3_tests` cfg, without which they
//! are `#[ignore]`d, so plain `cargo test` needs no server.
fn main() {
    println!("cargo::rustc-check-cfg=cfg(s3_tests)");
    println!("cargo::rerun-if-env-changed=SANDBOX_TEST_S3FS");
    if std::env::var("SANDBOX_TEST_S3FS").is_ok_and(|v| !v.is_empty()) {
        println!("cargo::rustc-cfg=s3_tests");
    }
}
