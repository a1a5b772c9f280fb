//! Helpers for tests against a real Redis (feature `testkit`): the server named by
//! `SANDBOX_TEST_REDIS_URL` (`cargo xtask test` starts one and sets it), a fresh key prefix per
//! test, and the clean-up of that prefix.
//!
//! Tests that use them are `#[cfg_attr(not(redis_tests), ignore = "…")]`, with a `build.rs`
//! that turns `redis_tests` on when the variable is set, so plain `cargo test` needs no server.

use sandbox_core::{Error, Result};

use crate::conn::{Conn, Damage, glob_escape};
use crate::options::RedisOptions;

/// The variable naming the test server's URL.
pub const URL_VAR: &str = "SANDBOX_TEST_REDIS_URL";

/// The variable naming a `redis-server` binary tests may start servers of their own with.
pub const SERVER_VAR: &str = "SANDBOX_TEST_REDIS_SERVER";

/// The test server's URL. Panics when [`URL_VAR`] is unset: a test that needs Redis fails
/// rather than skips when it runs.
pub fn url() -> String {
    std::env::var(URL_VAR)
        .ok()
        .filter(|u| !u.is_empty())
        .unwrap_or_else(|| {
            panic!("{URL_VAR} is not set: run the Redis tests with cargo xtask test")
        })
}

/// The `redis-server` binary: [`SERVER_VAR`], else `redis-server` on the `PATH`.
pub fn server_binary() -> String {
    std::env::var(SERVER_VAR)
        .ok()
        .filter(|s| !s.is_empty())
        .unwrap_or_else(|| "redis-server".to_owned())
}

/// Options for the test server under a key prefix no other test uses.
pub fn options() -> RedisOptions {
    RedisOptions::new(url()).key_prefix(unique_prefix())
}

/// `test-<uuid>:`.
pub fn unique_prefix() -> String {
    format!("test-{}:", uuid::Uuid::new_v4().simple())
}

/// Remove every key under `options.key_prefix` (`SCAN` + `UNLINK`); returns how many went.
/// An empty prefix is refused (it would empty the server).
pub async fn purge(options: &RedisOptions) -> Result<u64> {
    if options.key_prefix.is_empty() {
        return Err(Error::invalid(
            "redis key prefix",
            "purging an empty prefix would remove every key",
        ));
    }
    let conn = Conn::new(options, Damage::Kv)?;
    let pattern = format!("{}*", glob_escape(&options.key_prefix));
    let mut cursor = "0".to_owned();
    let mut removed = 0;
    loop {
        let (at, pattern) = (&cursor, &pattern);
        let (next, names): (String, Vec<Vec<u8>>) = conn
            .run("purge", |mut c| async move {
                redis::cmd("SCAN")
                    .arg(at)
                    .arg("MATCH")
                    .arg(pattern)
                    .arg("COUNT")
                    .arg(1000)
                    .query_async(&mut c)
                    .await
            })
            .await?;
        if !names.is_empty() {
            let names = &names;
            removed += conn
                .run("purge", |mut c| async move {
                    redis::cmd("UNLINK")
                        .arg(names)
                        .query_async::<u64>(&mut c)
                        .await
                })
                .await?;
        }
        if next == "0" {
            return Ok(removed);
        }
        cursor = next;
    }
}
