//! The conformance kit again on the Debian test image (GNU find, dash, coreutils), so both
//! code paths of the helpers run. The core scenarios only: the `faults` group exercises the
//! lifecycle, which the busybox run already covers on this engine.

mod common;

sandbox_core::conformance_tests!(
    core: common::fixture_for(common::DEBIAN),
    #[cfg_attr(not(docker_tests), ignore = "needs Docker; run by cargo xtask test")]
);
