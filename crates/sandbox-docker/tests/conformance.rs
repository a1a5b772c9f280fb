//! The core conformance kit against the real Docker engine (`SANDBOX_TEST_DOCKER=1`, set by
//! `cargo xtask test`, which also builds the test images).

mod common;

sandbox_core::conformance_tests!(
    common::fixture(),
    #[cfg_attr(not(docker_tests), ignore = "needs Docker; run by cargo xtask test")]
);

/// A stop after a one-file change reads that file only, also after files were written right
/// before the previous stop (core's kit scenario; not in the kit's lists because a backend
/// whose listing gives whole-second mtimes cannot promise it).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[cfg_attr(not(docker_tests), ignore = "needs Docker; run by cargo xtask test")]
async fn one_change_rehashes_one_file() {
    let fixture = common::fixture();
    sandbox_core::testkit::one_change_rehashes_one_file(&fixture).await;
}
