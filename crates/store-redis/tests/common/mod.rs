//! A `redis-server` of a test's own (for restarts, pauses and passwords), and small helpers.
#![allow(dead_code)] // each test binary uses a part

use std::time::{Duration, Instant};

pub use store_redis::testkit::{Server, free_port};

/// Retry `f` until it succeeds or `within` passes (a store reconnecting after a restart).
pub async fn eventually<T, E: std::fmt::Display, F, Fut>(within: Duration, mut f: F) -> T
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<T, E>>,
{
    let deadline = Instant::now() + within;
    loop {
        match f().await {
            Ok(v) => return v,
            Err(e) if Instant::now() < deadline => {
                eprintln!("not yet: {e}");
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            Err(e) => panic!("still failing after {within:?}: {e}"),
        }
    }
}

#[allow(unused_imports)] // not every test binary uses both
pub use store_redis::testkit::{keys_under, raw};
