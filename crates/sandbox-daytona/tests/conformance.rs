//! The core conformance kit (with its `faults` group) against the Daytona test server:
//! sandboxes as real Docker containers running sandboxd (`SANDBOX_TEST_DOCKER=1` and the pod
//! image, as `cargo xtask test` provides).

mod common;

sandbox_core::conformance_tests!(
    common::fixture().await,
    #[cfg_attr(not(docker_tests), ignore = "needs Docker and the pod image; run by cargo xtask test")]
);
