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

/// A raw connection to plant or inspect keys behind the stores' back.
pub async fn raw(url: &str) -> redis::aio::MultiplexedConnection {
    redis::Client::open(url)
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap()
}

/// Every key under `prefix` (`SCAN`, as the stores do; never `KEYS`).
pub async fn keys_under(url: &str, prefix: &str) -> Vec<String> {
    let mut c = raw(url).await;
    let mut cursor = 0u64;
    let mut out = Vec::new();
    loop {
        let (next, names): (u64, Vec<String>) = redis::cmd("SCAN")
            .arg(cursor)
            .arg("MATCH")
            .arg(format!("{prefix}*"))
            .arg("COUNT")
            .arg(1000)
            .query_async(&mut c)
            .await
            .unwrap();
        out.extend(names);
        if next == 0 {
            out.sort();
            out.dedup();
            return out;
        }
        cursor = next;
    }
}
