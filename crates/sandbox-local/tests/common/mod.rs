//! Helpers shared by the integration tests: real boxes in temporary directories.
#![allow(dead_code)]

use std::collections::BTreeMap;
use std::fs;
use std::os::unix::fs::MetadataExt as _;
use std::path::{Path, PathBuf};

use bytes::Bytes;
use sandbox_core::archive::{self, PackSource};
use sandbox_core::stream::{self, ByteStream};
use sandbox_core::{BoxHandle, RelPath, Sandbox, SandboxConfig, WorkspaceSpec};
use sandbox_local::{LocalClient, LocalOptions, LocalState};
use tempfile::TempDir;

/// A started box (cold start from `spec`) under a fresh temporary base directory.
pub struct TestBox {
    pub dir: TempDir,
    pub client: LocalClient,
    pub sandbox: Sandbox,
}

impl TestBox {
    pub async fn new(options: LocalOptions, spec: WorkspaceSpec) -> TestBox {
        let dir = tempfile::tempdir().unwrap();
        let client = LocalClient::new(options.base_dir(dir.path().join("boxes")));
        let sandbox = Sandbox::create(&client, SandboxConfig::new(spec), None)
            .await
            .unwrap();
        sandbox.start().await.unwrap();
        TestBox {
            dir,
            client,
            sandbox,
        }
    }

    pub async fn default() -> TestBox {
        TestBox::new(LocalOptions::default(), WorkspaceSpec::default()).await
    }

    /// A box of the unconfined host shell (`Isolation::HostShell`): for checks that look at
    /// the command's processes by their host pid (a confined box's pids are its own).
    pub async fn host_shell() -> TestBox {
        TestBox::new(
            LocalOptions::default().isolation(sandbox_local::Isolation::HostShell),
            WorkspaceSpec::default(),
        )
        .await
    }

    pub fn handle(&self) -> &dyn BoxHandle {
        self.sandbox.handle()
    }

    pub fn root(&self) -> PathBuf {
        PathBuf::from(self.handle().workspace_root())
    }

    pub fn box_dir(&self) -> PathBuf {
        local_state(self.handle()).box_dir
    }

    /// A directory outside the base directory, for symlinks that lead out.
    pub fn outside(&self) -> PathBuf {
        let p = self.dir.path().join("outside");
        fs::create_dir_all(&p).unwrap();
        p
    }
}

pub fn local_state(handle: &dyn BoxHandle) -> LocalState {
    handle
        .state()
        .downcast::<LocalState>("local")
        .unwrap()
        .clone()
}

pub fn rel(p: &str) -> RelPath {
    RelPath::new(p).unwrap()
}

/// A tar stream of files with these contents.
pub fn tar_of(files: &[(&str, &[u8])]) -> ByteStream {
    archive::pack(
        files
            .iter()
            .map(|(p, data)| {
                (
                    rel(p),
                    PackSource::Bytes {
                        data: Bytes::copy_from_slice(data),
                        mode: 0o644,
                    },
                )
            })
            .collect(),
    )
}

pub async fn tar_bytes(files: &[(&str, &[u8])]) -> Bytes {
    stream::collect(tar_of(files), 1 << 30).await.unwrap()
}

/// Everything under `root` (not following symlinks): kind, mode and content or link target.
pub fn tree(root: &Path) -> BTreeMap<String, (char, u32, Vec<u8>)> {
    fn walk(dir: &Path, prefix: &str, out: &mut BTreeMap<String, (char, u32, Vec<u8>)>) {
        for entry in fs::read_dir(dir).unwrap() {
            let entry = entry.unwrap();
            let name = format!("{prefix}{}", entry.file_name().to_string_lossy());
            let path = entry.path();
            let meta = fs::symlink_metadata(&path).unwrap();
            let mode = meta.mode() & 0o7777;
            if meta.file_type().is_symlink() {
                let target = fs::read_link(&path).unwrap();
                out.insert(name, ('l', 0, target.to_string_lossy().as_bytes().to_vec()));
            } else if meta.is_dir() {
                out.insert(name.clone(), ('d', mode, Vec::new()));
                walk(&path, &format!("{name}/"), out);
            } else {
                out.insert(name, ('f', mode, fs::read(&path).unwrap()));
            }
        }
    }
    let mut out = BTreeMap::new();
    walk(root, "", &mut out);
    out
}

/// Names in `dir` starting with `prefix`.
pub fn names_with_prefix(dir: &Path, prefix: &str) -> Vec<String> {
    fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with(prefix))
        .collect()
}

#[allow(unused_imports)]
pub use sandbox_core::testkit::escapes::{gone_or_zombie, wait_gone};

/// Read a pid a command wrote into the workspace.
pub async fn read_pid(handle: &dyn BoxHandle, path: &str) -> i32 {
    let text = handle.read_file(&rel(path)).await.unwrap();
    String::from_utf8_lossy(&text).trim().parse().unwrap()
}
