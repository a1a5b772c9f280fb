//! Snapshots in an S3 bucket: two calls on one session key, each in a new box (ephemeral), the
//! second restoring the first's workspace from S3. Configured from the usual environment
//! variables; against a local S3-compatible server:
//!
//! ```text
//! cargo install s3s-fs@0.14.1 --features binary --locked
//! mkdir -p /tmp/s3-demo/snapshots
//! s3s-fs --host 127.0.0.1 --port 8014 --access-key demo --secret-key demo-secret /tmp/s3-demo &
//! AWS_ENDPOINT=http://127.0.0.1:8014 AWS_ALLOW_HTTP=true AWS_REGION=us-east-1 \
//! AWS_ACCESS_KEY_ID=demo AWS_SECRET_ACCESS_KEY=demo-secret SANDBOX_S3_BUCKET=snapshots \
//!   cargo run --example s3 --features s3
//! ```
//!
//! The objects land under `/tmp/s3-demo/snapshots/example/`. Exits 0 only if the second call
//! saw the first call's file; 2 if the store is not reachable or not configured.

use std::process::ExitCode;
use std::sync::Arc;

use sandbox_harness::local::{LocalClient, LocalOptions};
use sandbox_harness::s3::S3Config;
use sandbox_harness::snapshot::SnapshotStoreExt as _;
use sandbox_harness::{
    CallContext, ErrorKind, ExecRequest, IsolationScope, Persistence, SandboxConfig,
    SandboxManager, SnapshotSpec, WorkspaceSpec,
};

#[tokio::main]
async fn main() -> ExitCode {
    match run().await {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::FAILURE,
        Err(e)
            if matches!(
                e.kind(),
                ErrorKind::Unavailable | ErrorKind::Timeout | ErrorKind::InvalidInput
            ) =>
        {
            eprintln!(
                "s3 example: {e}\n(start a local server and set the variables: see the top of examples/s3.rs)"
            );
            ExitCode::from(2)
        }
        Err(e) => {
            eprintln!("s3 example: {e}");
            ExitCode::FAILURE
        }
    }
}

async fn run() -> sandbox_harness::Result<bool> {
    let mut config = S3Config::from_env();
    if config.key_prefix().is_empty() {
        config = config.prefix("example");
    }
    let store = Arc::new(config.build()?);
    println!("snapshots in {store:?}");
    let base = tempfile::tempdir().map_err(|e| sandbox_harness::Error::io("tempdir", e))?;
    let client = LocalClient::new(
        LocalOptions::default()
            .base_dir(base.path())
            .persistence(Persistence::Ephemeral),
    );
    let manager = SandboxManager::builder(Arc::new(client))
        .scope(IsolationScope::Session)
        .config(
            SandboxConfig::new(WorkspaceSpec::default())
                .snapshots(SnapshotSpec::new(store.clone())),
        )
        .build()?;
    let session = format!("s3-demo-{}", std::process::id());
    let ctx = CallContext::new("example").session(&session);

    let first = manager
        .call(&ctx, |sb| async move {
            sb.exec(ExecRequest::shell(
                "echo written in the first box > note.txt",
            ))
            .await
        })
        .await?;
    first.value?;
    println!(
        "call 1: branch {:?}, persisted {}",
        first.report.start.as_ref().map(|s| s.branch),
        first.report.persisted
    );
    let second = manager
        .call(&ctx, |sb| async move {
            sb.exec(ExecRequest::shell("cat note.txt")).await
        })
        .await?;
    let seen = second.value?.stdout_str().into_owned();
    println!(
        "call 2: branch {:?}, note.txt = {:?}",
        second.report.start.as_ref().map(|s| s.branch),
        seen.trim()
    );
    let objects = store.list_all("").await?;
    println!(
        "{} objects under prefix `{}`:",
        objects.len(),
        store.prefix()
    );
    for o in objects.iter().take(10) {
        println!("  {} ({} bytes)", o.key, o.size);
    }
    manager.delete(&ctx).await?;
    Ok(seen.trim() == "written in the first box")
}
