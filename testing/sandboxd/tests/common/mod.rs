//! A sandboxd on loopback ports over a fresh temporary base directory.

#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::time::Duration;

use sandboxd::{Config, Server};

pub struct Harness {
    pub server: Server,
    /// Holds the base directory and, beside it, an "outside" directory escape attempts aim at.
    pub tmp: tempfile::TempDir,
    pub http: reqwest::Client,
}

impl Harness {
    pub async fn start() -> Harness {
        Self::start_with(|c| c).await
    }

    pub async fn start_with(tune: impl FnOnce(Config) -> Config) -> Harness {
        let tmp = tempfile::tempdir().unwrap();
        std::fs::create_dir(tmp.path().join("base")).unwrap();
        std::fs::create_dir(tmp.path().join("outside")).unwrap();
        std::fs::write(tmp.path().join("outside/secret"), b"outside secret").unwrap();
        let server = Server::start(tune(Config::loopback(tmp.path().join("base"))))
            .await
            .unwrap();
        Harness {
            server,
            tmp,
            http: reqwest::Client::new(),
        }
    }

    pub fn base(&self) -> PathBuf {
        self.tmp.path().join("base")
    }

    pub fn outside(&self) -> PathBuf {
        self.tmp.path().join("outside")
    }

    pub fn rest(&self, path: &str) -> String {
        format!("http://{}{path}", self.server.rest_addr())
    }

    pub fn legacy(&self, path: &str) -> String {
        format!("http://{}{path}", self.server.legacy_addr())
    }

    pub fn grpc(&self) -> String {
        format!("http://{}", self.server.grpc_addr())
    }

    /// The outside directory is exactly as the harness made it.
    pub fn assert_outside_untouched(&self) {
        let mut names: Vec<_> = std::fs::read_dir(self.outside())
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        names.sort();
        assert_eq!(names, vec!["secret"]);
        assert_eq!(
            std::fs::read(self.outside().join("secret")).unwrap(),
            b"outside secret"
        );
    }
}

/// Percent-encode every byte outside `[A-Za-z0-9_.~-]` (as the SDK's `quote(safe='')`).
pub fn quote(path: &str) -> String {
    let mut out = String::new();
    for b in path.bytes() {
        if b.is_ascii_alphanumeric() || b"_.~-".contains(&b) {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

/// The SDK's sandboxd file endpoint: segments quoted, `.`/`..` spelled `%2E`/`%2E%2E`,
/// joined by `%2F`.
pub fn sdk_files_endpoint(path: &str) -> String {
    let segments: Vec<String> = path
        .split('/')
        .map(|s| match s {
            "." => "%2E".to_owned(),
            ".." => "%2E%2E".to_owned(),
            s => quote(s),
        })
        .collect();
    format!("/v1/files/{}", segments.join("%2F"))
}

pub fn read(path: impl AsRef<Path>) -> Vec<u8> {
    std::fs::read(path).unwrap()
}

/// Whether `pid` is gone (or a zombie waiting for a reaper that is not us).
pub fn pid_gone(pid: i32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Err(_) => true,
        Ok(stat) => stat
            .rsplit_once(')')
            .is_some_and(|(_, rest)| rest.trim_start().starts_with('Z')),
    }
}

pub async fn eventually_gone(pid: i32) {
    for _ in 0..500 {
        if pid_gone(pid) {
            return;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    panic!("process {pid} is still running");
}
