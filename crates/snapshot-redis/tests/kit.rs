//! The conformance kit's snapshot scenarios (restores, replicas, tampering, retention and GC,
//! the lifecycle's fault and cancellation sweeps) on the local backend, with every scenario's
//! snapshots in Redis (`SANDBOX_TEST_REDIS_URL`): small parts, so archives span many.

mod common;

fn options() -> snapshot_redis::RedisSnapshotOptions {
    common::options().part_size(16 * 1024).page_size(50)
}

sandbox_core::conformance_tests!(
    snapshots: common::on_redis(options),
    #[cfg_attr(not(redis_tests), ignore = "needs Redis; run by cargo xtask test")]
);
