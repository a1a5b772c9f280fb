//! A `redis-server` of a test's own (for restarts, pauses and passwords), and small helpers.
#![allow(dead_code)] // each test binary uses a part

use std::io::{Read as _, Write as _};
use std::net::{TcpListener, TcpStream};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use store_redis::testkit;

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
        let child = Command::new(testkit::server_binary())
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
