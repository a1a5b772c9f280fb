//! Test plumbing: the shared test Redis (`SANDBOX_TEST_REDIS_URL`), a key prefix per test that
//! is swept when the test ends, and servers of a test's own (`SANDBOX_TEST_REDIS_SERVER`) that
//! it can stop, pause and restart.

#![allow(dead_code)] // each test binary uses its part

use std::io::{BufRead as _, BufReader, Write as _};
use std::net::{TcpListener, TcpStream};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use guard_redis::RedisGuardOptions;

/// The shared test server (`cargo xtask test` starts it).
pub fn url() -> String {
    std::env::var("SANDBOX_TEST_REDIS_URL")
        .expect("SANDBOX_TEST_REDIS_URL is set (cargo xtask test starts a Redis and sets it)")
}

/// Options for tests: a TTL well below the suite's 1.5 s hold (renewal must keep the lease),
/// quick retries, this test's prefix.
pub fn options(prefix: &Prefix) -> RedisGuardOptions {
    RedisGuardOptions::new()
        .lease_ttl(Duration::from_millis(600))
        .retry_interval(Duration::from_millis(5))
        .max_retry_interval(Duration::from_millis(50))
        .key_prefix(prefix.0.clone())
}

/// A key prefix no other test uses; its keys on the shared server are deleted on drop.
pub struct Prefix(pub String);

impl Prefix {
    pub fn new() -> Self {
        Prefix(format!("test:{}:", uuid::Uuid::new_v4().simple()))
    }
}

impl Drop for Prefix {
    fn drop(&mut self) {
        let Ok(url) = std::env::var("SANDBOX_TEST_REDIS_URL") else {
            return;
        };
        let _ = sweep(&url, &self.0);
    }
}

/// Delete every key under `prefix` (`SCAN MATCH`, then `DEL`).
fn sweep(url: &str, prefix: &str) -> redis::RedisResult<()> {
    let client = redis::Client::open(url)?;
    let mut con = client.get_connection_with_timeout(Duration::from_secs(2))?;
    let mut cursor = 0u64;
    loop {
        let (next, keys): (u64, Vec<String>) = redis::cmd("SCAN")
            .arg(cursor)
            .arg("MATCH")
            .arg(format!("{prefix}*"))
            .arg("COUNT")
            .arg(1000)
            .query(&mut con)?;
        if !keys.is_empty() {
            redis::cmd("DEL").arg(&keys).exec(&mut con)?;
        }
        if next == 0 {
            return Ok(());
        }
        cursor = next;
    }
}

/// A plain connection to the shared server, for looking at and changing keys directly.
pub fn raw() -> redis::Connection {
    redis::Client::open(url())
        .expect("url")
        .get_connection_with_timeout(Duration::from_secs(2))
        .expect("connect to the test Redis")
}

/// A port nothing listens on right now.
pub fn free_port() -> u16 {
    let l = TcpListener::bind("127.0.0.1:0").expect("bind");
    l.local_addr().expect("addr").port()
}

/// A `redis-server` of the test's own, on a free loopback port, killed (by its pid) on drop.
pub struct OwnServer {
    child: Option<Child>,
    pub port: u16,
    dir: tempfile::TempDir,
    extra: Vec<String>,
    paused: bool,
}

impl OwnServer {
    /// Start one with `extra` arguments (e.g. `--requirepass x`), ready to answer.
    pub fn start(extra: &[&str]) -> OwnServer {
        let mut server = OwnServer {
            child: None,
            port: free_port(),
            dir: tempfile::tempdir().expect("tempdir"),
            extra: extra.iter().map(|s| s.to_string()).collect(),
            paused: false,
        };
        server.spawn();
        server
    }

    /// `redis://127.0.0.1:<port>`, with `password` if given.
    pub fn url(&self, password: Option<&str>) -> String {
        match password {
            Some(p) => format!("redis://:{p}@127.0.0.1:{}", self.port),
            None => format!("redis://127.0.0.1:{}", self.port),
        }
    }

    fn spawn(&mut self) {
        let program = std::env::var("SANDBOX_TEST_REDIS_SERVER")
            .unwrap_or_else(|_| "/usr/bin/redis-server".to_owned());
        let child = Command::new(&program)
            .args(["--port", &self.port.to_string(), "--bind", "127.0.0.1"])
            .args(["--save", "", "--appendonly", "no", "--daemonize", "no"])
            .arg("--dir")
            .arg(self.dir.path())
            .args(&self.extra)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap_or_else(|e| panic!("start {program}: {e}"));
        self.child = Some(child);
        self.wait_ready();
    }

    /// Poll until the server answers `PING` (a `NOAUTH` error is an answer too).
    fn wait_ready(&mut self) {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            if let Ok(Some(status)) = self.child.as_mut().expect("running").try_wait() {
                panic!("redis-server on port {} exited: {status}", self.port);
            }
            if answers(self.port) {
                return;
            }
            assert!(Instant::now() < deadline, "redis-server never answered");
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// Kill the server (SIGKILL) and wait for it: connections drop, the port is closed.
    pub fn stop(&mut self) {
        self.resume();
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Start it again on the same port (empty: nothing is persisted).
    pub fn restart(&mut self) {
        self.stop();
        self.spawn();
    }

    /// Stop the process (SIGSTOP): connections stay open, nothing answers.
    pub fn pause(&mut self) {
        self.signal(nix::sys::signal::Signal::SIGSTOP);
        self.paused = true;
    }

    /// Let a paused server go on (SIGCONT).
    pub fn resume(&mut self) {
        if self.paused {
            self.signal(nix::sys::signal::Signal::SIGCONT);
            self.paused = false;
        }
    }

    fn signal(&self, signal: nix::sys::signal::Signal) {
        let child = self.child.as_ref().expect("running");
        let pid = nix::unistd::Pid::from_raw(i32::try_from(child.id()).expect("pid"));
        nix::sys::signal::kill(pid, signal).expect("signal our redis-server");
    }
}

impl Drop for OwnServer {
    fn drop(&mut self) {
        self.stop();
    }
}

fn answers(port: u16) -> bool {
    let Ok(mut s) = TcpStream::connect(("127.0.0.1", port)) else {
        return false;
    };
    let _ = s.set_read_timeout(Some(Duration::from_millis(500)));
    if s.write_all(b"PING\r\n").is_err() {
        return false;
    }
    let mut line = String::new();
    BufReader::new(s).read_line(&mut line).is_ok()
        && (line.starts_with("+PONG") || line.starts_with("-NOAUTH"))
}
