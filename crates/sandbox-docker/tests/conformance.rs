//! The core conformance kit against the real Docker engine (`SANDBOX_TEST_DOCKER=1`, set by
//! `cargo xtask test`, which also builds the test images).

mod common;

sandbox_core::conformance_tests!(
    common::fixture(),
    #[cfg_attr(not(docker_tests), ignore = "needs Docker; run by cargo xtask test")]
);
