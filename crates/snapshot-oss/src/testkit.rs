//! Helpers for tests against a real S3-compatible server (feature `testkit`): an `s3s-fs`
//! child process of the test's own, on a free loopback port with a temporary data directory.
//!
//! The binary comes from `SANDBOX_TEST_S3FS` (`cargo xtask test` and `cargo xtask s3-test`
//! install `s3s-fs` and set it). Tests that use it are
//! `#[cfg_attr(not(s3_tests), ignore = "…")]`, with a `build.rs` that turns `s3_tests` on when
//! the variable is set, so plain `cargo test` needs no server.
//!
//! `s3s-fs` keeps a bucket as a directory of its data directory and an object as a file in
//! it; a multipart upload in progress is `.upload-<id>.json` plus `.upload_id-<id>.part-<n>`
//! files at the data directory's top ([`S3fs::pending_uploads`]). It implements no
//! `ListMultipartUploads`, so those files are how a test sees orphaned uploads.

use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use crate::{OssOptions, OssSnapshotStore, S3Config};

/// The variable naming the `s3s-fs` binary.
pub const BINARY_VAR: &str = "SANDBOX_TEST_S3FS";

/// The access key id every test server accepts.
pub const ACCESS_KEY: &str = "sandbox-test";

/// The secret key of test servers started with [`S3fs::start`].
pub const SECRET_KEY: &str = "sandbox-test-secret";

/// The `s3s-fs` binary named by [`BINARY_VAR`]. Panics when it is unset: a test that needs the
/// server fails rather than skips when it runs.
pub fn binary() -> PathBuf {
    std::env::var_os(BINARY_VAR)
        .filter(|v| !v.is_empty())
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            panic!("{BINARY_VAR} is not set: run the S3 tests with cargo xtask test (or s3-test)")
        })
}

/// An `s3s-fs` child; killed (by its pid) and reaped on drop.
#[derive(Debug)]
pub struct S3fs {
    child: Option<Child>,
    port: u16,
    dir: tempfile::TempDir,
    secret_key: String,
}

impl S3fs {
    /// A server with the test credentials ([`ACCESS_KEY`], [`SECRET_KEY`]).
    pub fn start() -> S3fs {
        S3fs::start_with_secret(SECRET_KEY)
    }

    /// A server whose secret key is `secret_key`.
    pub fn start_with_secret(secret_key: &str) -> S3fs {
        let mut server = S3fs {
            child: None,
            port: 0,
            dir: tempfile::tempdir().expect("a data directory"),
            secret_key: secret_key.to_owned(),
        };
        let mut last = String::new();
        for _ in 0..5 {
            server.port = free_port();
            match server.spawn() {
                Ok(()) => return server,
                Err(e) => last = e,
            }
        }
        panic!("s3s-fs did not start: {last}");
    }

    fn spawn(&mut self) -> Result<(), String> {
        let mut child = Command::new(binary())
            .args(["--host", "127.0.0.1", "--port", &self.port.to_string()])
            .args(["--access-key", ACCESS_KEY, "--secret-key", &self.secret_key])
            .arg(self.dir.path())
            // Only its start-up line: "server is running at http://127.0.0.1:<port>".
            .env("RUST_LOG", "s3s_fs=info")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .map_err(|e| format!("cannot run {}: {e}", binary().display()))?;
        // Read (and keep draining, so the server never blocks on a full pipe) its output on a
        // thread that ends with the process.
        let stdout = child.stdout.take().expect("piped");
        let (tx, rx) = std::sync::mpsc::channel::<String>();
        std::thread::spawn(move || {
            use std::io::BufRead as _;
            for line in std::io::BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                if line.contains("server is running at") {
                    let _ = tx.send(line);
                }
            }
        });
        self.child = Some(child);
        self.wait_ready(&rx)
    }

    /// Wait until this server says it listens on its port. (A port probe alone could reach
    /// another test's server that took the port first while this one failed to bind.)
    fn wait_ready(&mut self, started: &std::sync::mpsc::Receiver<String>) -> Result<(), String> {
        let deadline = Instant::now() + Duration::from_secs(20);
        let expected = format!("127.0.0.1:{}", self.port);
        loop {
            let child = self.child.as_mut().expect("spawned");
            if let Ok(Some(status)) = child.try_wait() {
                self.child = None;
                return Err(format!("s3s-fs on port {} exited: {status}", self.port));
            }
            match started.recv_timeout(Duration::from_millis(20)) {
                Ok(line) if line.contains(&expected) => return Ok(()),
                Ok(line) => {
                    self.kill();
                    return Err(format!("s3s-fs did not listen on {expected}: {line}"));
                }
                Err(_) if Instant::now() > deadline => {
                    self.kill();
                    return Err(format!("s3s-fs on port {} never listened", self.port));
                }
                Err(_) => {}
            }
        }
    }

    /// `http://127.0.0.1:<port>`.
    pub fn endpoint(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    /// The loopback port.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// The server's pid, while it runs.
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    /// The data directory (a bucket is a directory in it).
    pub fn data_dir(&self) -> &Path {
        self.dir.path()
    }

    /// Create `bucket` (a directory of the data directory) if it is missing.
    pub fn create_bucket(&self, bucket: &str) {
        std::fs::create_dir_all(self.dir.path().join(bucket)).expect("create the bucket");
    }

    /// A configuration for `bucket` on this server: path-style requests over plain HTTP,
    /// the server's credentials, limits short enough for tests of outages.
    pub fn config(&self, bucket: &str) -> S3Config {
        S3Config::new(bucket)
            .endpoint(self.endpoint())
            .region("us-east-1")
            .credentials(ACCESS_KEY, &self.secret_key)
            .allow_http(true)
            .options(test_options())
    }

    /// A store over a new bucket `bucket` under `prefix`.
    pub fn store(&self, bucket: &str, prefix: &str) -> OssSnapshotStore {
        self.create_bucket(bucket);
        self.config(bucket)
            .prefix(prefix)
            .build()
            .expect("a store on the test server")
    }

    /// Multipart uploads in progress: the server's `.upload-<id>.json` and
    /// `.upload_id-<id>.part-<n>` files.
    pub fn pending_uploads(&self) -> Vec<String> {
        let mut out: Vec<String> = std::fs::read_dir(self.dir.path())
            .expect("read the data directory")
            .filter_map(|e| e.ok())
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .filter(|n| n.starts_with(".upload-") || n.starts_with(".upload_id-"))
            .collect();
        out.sort();
        out
    }

    /// Files of an interrupted write still in the data directory (`.tmp.*`).
    pub fn temporaries(&self) -> Vec<String> {
        std::fs::read_dir(self.dir.path())
            .expect("read the data directory")
            .filter_map(|e| e.ok())
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .filter(|n| n.starts_with(".tmp."))
            .collect()
    }

    /// Kill the server (SIGKILL to the pid this helper started) and reap it.
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Stop the server without closing its port (`SIGSTOP` to the pid this helper started): a
    /// store that accepts connections and answers nothing.
    pub fn pause(&self) {
        self.signal("-STOP");
    }

    /// Let a [`pause`](Self::pause)d server go on (`SIGCONT`).
    pub fn resume(&self) {
        self.signal("-CONT");
    }

    fn signal(&self, sig: &str) {
        let pid = self.pid().expect("the server runs");
        let status = Command::new("kill")
            .args([sig, &pid.to_string()])
            .status()
            .expect("run kill");
        assert!(status.success(), "kill {sig} {pid}: {status}");
    }

    /// Start the server again on the same port and data directory.
    pub fn restart(&mut self) {
        self.kill();
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            match self.spawn() {
                Ok(()) => return,
                // The port may linger a moment after the kill.
                Err(e) if Instant::now() < deadline => {
                    tracing::debug!(error = %e, "s3s-fs restart: retrying");
                    std::thread::sleep(Duration::from_millis(100));
                }
                Err(e) => panic!("s3s-fs did not restart: {e}"),
            }
        }
    }
}

impl Drop for S3fs {
    fn drop(&mut self) {
        // A paused server dies of SIGKILL all the same.
        self.kill();
    }
}

/// Limits for tests: outages are reported within seconds.
pub fn test_options() -> OssOptions {
    OssOptions::default()
        .connect_timeout(Duration::from_millis(500))
        .read_timeout(Duration::from_secs(5))
        .request_timeout(Duration::from_secs(30))
        .max_retries(1)
        .retry_timeout(Duration::from_secs(2))
        .operation_timeout(Duration::from_secs(20))
}

/// A loopback port nothing listens on right now.
pub fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("a free loopback port")
}

/// A unique bucket name (`test-<uuid>`; S3 bucket names are lower-case).
pub fn unique_bucket() -> String {
    format!("test-{}", &uuid_like())
}

fn uuid_like() -> String {
    use std::sync::atomic::{AtomicU64, Ordering};
    static SEQ: AtomicU64 = AtomicU64::new(0);
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos())
        .unwrap_or_default();
    format!(
        "{:x}-{}-{}",
        nanos,
        std::process::id(),
        SEQ.fetch_add(1, Ordering::Relaxed)
    )
}
