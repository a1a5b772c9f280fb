//! The conformance kit again on the Debian test image (GNU find, dash, coreutils), so both
//! code paths of the helpers run.

mod common;

sandbox_core::conformance_tests!(
    common::fixture_for(common::DEBIAN),
    #[cfg_attr(not(docker_tests), ignore = "needs Docker; run by cargo xtask test")]
);
