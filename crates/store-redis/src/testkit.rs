//! Helpers for tests against a real Redis (feature `testkit`): the server named by
//! `SANDBOX_TEST_REDIS_URL` (`cargo xtask test` starts one and sets it), a fresh key prefix per
//! test, the clean-up of that prefix, and [`Server`]: a `redis-server` of a test's own
//! (`SANDBOX_TEST_REDIS_SERVER`) to kill, pause and restart by its pid.
//!
//! Tests that use them are `#[cfg_attr(not(redis_tests), ignore = "…")]`, with a `build.rs`
//! that turns `redis_tests` on when the variable is set, so plain `cargo test` needs no server.

use std::io::{Read as _, Write as _};
use std::net::{TcpListener, TcpStream};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

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

/// A port nothing listens on right now.
pub fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// A `redis-server` child on a port and data directory of its own; killed on drop.
pub struct Server {
    child: Option<Child>,
    /// The loopback port it listens on.
    pub port: u16,
    dir: tempfile::TempDir,
    args: Vec<String>,
    paused: bool,
}

impl Server {
    /// Start one with `args` (e.g. `--appendonly yes`) beside the port, bind and directory.
    pub fn start(args: &[&str]) -> Server {
        let mut server = Server {
            child: None,
            port: free_port(),
            dir: tempfile::tempdir().unwrap(),
            args: args.iter().map(|a| a.to_string()).collect(),
            paused: false,
        };
        server.spawn();
        server
    }

    fn spawn(&mut self) {
        let child = Command::new(server_binary())
            .args(["--port", &self.port.to_string(), "--bind", "127.0.0.1"])
            .arg("--dir")
            .arg(self.dir.path())
            .args(&self.args)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("redis-server starts (set SANDBOX_TEST_REDIS_SERVER)");
        self.child = Some(child);
        self.wait_ready();
    }

    /// Poll until the server answers a `PING` (with `-NOAUTH` too) and has loaded its data.
    fn wait_ready(&self) {
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            if let Ok(mut s) = TcpStream::connect(("127.0.0.1", self.port)) {
                s.set_read_timeout(Some(Duration::from_secs(1))).unwrap();
                let mut buf = [0u8; 64];
                if s.write_all(b"PING\r\n").is_ok()
                    && let Ok(n) = s.read(&mut buf)
                {
                    let reply = String::from_utf8_lossy(&buf[..n]);
                    if reply.starts_with("+PONG") || reply.starts_with("-NOAUTH") {
                        return;
                    }
                }
            }
            assert!(Instant::now() < deadline, "redis-server did not come up");
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// `redis://[:password@]127.0.0.1:<port>`.
    pub fn url(&self, password: Option<&str>) -> String {
        match password {
            Some(pw) => format!("redis://:{pw}@127.0.0.1:{}", self.port),
            None => format!("redis://127.0.0.1:{}", self.port),
        }
    }

    /// The server's pid while it runs.
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    /// SIGKILL: a crash, nothing flushed beyond what the server's persistence already did.
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            self.signal(&child, "CONT");
            self.paused = false;
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Start again on the same port and directory with the same arguments.
    pub fn restart(&mut self) {
        self.kill();
        self.spawn();
    }

    /// SIGSTOP: the server keeps its connections and answers nothing.
    pub fn pause(&mut self) {
        let child = self.child.as_ref().expect("running");
        self.signal(child, "STOP");
        self.paused = true;
    }

    /// SIGCONT.
    pub fn resume(&mut self) {
        let child = self.child.as_ref().expect("running");
        self.signal(child, "CONT");
        self.paused = false;
    }

    fn signal(&self, child: &Child, sig: &str) {
        let status = Command::new("kill")
            .arg(format!("-{sig}"))
            .arg(child.id().to_string())
            .status()
            .unwrap();
        assert!(status.success(), "kill -{sig}");
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        self.kill();
    }
}

/// A raw connection, to plant or inspect keys behind a store's back. Panics when Redis does
/// not answer (a test helper).
pub async fn raw(url: &str) -> redis::aio::MultiplexedConnection {
    redis::Client::open(url)
        .expect("redis url")
        .get_multiplexed_async_connection()
        .await
        .expect("redis connection")
}

/// Every key under `prefix`, sorted (`SCAN`, as the stores do; never `KEYS`).
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
            .expect("SCAN");
        out.extend(names);
        if next == 0 {
            out.sort();
            out.dedup();
            return out;
        }
        cursor = next;
    }
}
