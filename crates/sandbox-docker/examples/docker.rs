//! The README's example: one session on the Docker backend, kept between calls.
//!
//! ```text
//! cargo xtask images && cargo run -p sandbox-docker --example docker
//! ```

use std::sync::Arc;
use std::time::Duration;

use sandbox_core::{
    CallContext, ExecRequest, FileStateStore, InProcessGuard, IsolationScope, Persistence,
    SandboxConfig, SandboxManager, SnapshotSpec, WorkspaceSpec,
};
use sandbox_docker::{DockerClient, DockerOptions, PullPolicy};

#[tokio::main]
async fn main() -> sandbox_core::Result<()> {
    let client = DockerClient::new(
        DockerOptions::new("sandbox-harness-test/debian:latest") // `cargo xtask images`
            .pull_policy(PullPolicy::Never)
            .persistence(Persistence::Keep) // stop on release, warm-start next call
            .memory_bytes(512 << 20)
            .cpus(1.0)
            .pids_limit(256)
            .env("NODE_ENV", "development"),
    )?;
    let spec = WorkspaceSpec::builder()
        .file("README.md", "hello\n")
        .build()?;
    let manager = SandboxManager::builder(Arc::new(client))
        .state_store(Arc::new(FileStateStore::new(".sandbox/states")))
        .guard(Arc::new(InProcessGuard::new()))
        .scope(IsolationScope::Session)
        .config(SandboxConfig::new(spec).snapshots(SnapshotSpec::local_dir(".sandbox/snapshots")))
        .build()?;
    let ctx = CallContext::new("coder").session("s1");
    let called = manager
        .call(&ctx, |sandbox| async move {
            sandbox
                .exec(
                    ExecRequest::shell("cat README.md; uname -a").timeout(Duration::from_secs(30)),
                )
                .await
        })
        .await?;
    println!("{}", called.value?.stdout_str());
    Ok(())
}
