//! Test infrastructure, not shipped: the facade's integration tests and benchmarks that need
//! services (Redis, S3, the E2B and Daytona test servers, a Docker engine). They live here, not
//! in `sandbox-harness`'s dev-dependencies, so that building the facade's examples (the
//! quickstart) compiles none of those stacks. Run them with `cargo xtask test` and
//! `cargo xtask bench …`.
