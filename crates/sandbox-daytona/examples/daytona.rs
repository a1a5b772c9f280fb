//! One persisted call through the Daytona backend.
//!
//! With `DAYTONA_API_KEY` (and optionally `DAYTONA_API_URL`) set, against that Daytona
//! account: `cargo run -p sandbox-daytona --example daytona`. Without them it starts the
//! Daytona test server itself (Docker and the pod image of `cargo xtask images` needed) and
//! runs against that. Run it twice: the second call restores the first call's workspace from
//! the local snapshot (the sandbox itself is deleted after each call).

use std::sync::Arc;

use daytona_testserver::{DaytonaTestServer, TestServerOptions};
use sandbox_core::{
    CallContext, ExecRequest, IsolationScope, Persistence, SandboxConfig, SandboxManager,
    SnapshotSpec, WorkspaceSpec,
};
use sandbox_daytona::{DaytonaClient, DaytonaOptions, Secret};

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    // A real account when configured; else a test server of our own (kept alive to the end).
    let (options, _server) = match DaytonaOptions::from_env() {
        Ok(o) => {
            println!("using the Daytona API at {}", o.api_url);
            (o, None)
        }
        Err(_) => {
            let server = DaytonaTestServer::start(TestServerOptions::default()).await?;
            println!(
                "DAYTONA_API_KEY is not set: using a local test server at {}",
                server.api_url()
            );
            let o = DaytonaOptions::new(server.api_url(), Secret::new(server.api_key()))
                .workspace_root("/workspace");
            (o, Some(server))
        }
    };
    let client = DaytonaClient::new(
        options
            .persistence(Persistence::Ephemeral)
            .auto_stop_minutes(15),
    )?;
    let dir = std::env::temp_dir().join("sandbox-daytona-example");
    let spec = WorkspaceSpec::builder()
        .file("hello.txt", "hello from the spec\n")
        .build()?;
    let manager = SandboxManager::builder(Arc::new(client))
        .state_store(Arc::new(sandbox_core::FileStateStore::new(
            dir.join("states"),
        )))
        .config(SandboxConfig::new(spec).snapshots(SnapshotSpec::local_dir(dir.join("snapshots"))))
        .scope(IsolationScope::Session)
        .build()?;
    let ctx = CallContext::new("daytona-example").session("demo");
    let out = manager
        .call(&ctx, |sb| async move {
            let r = sb
                .exec(ExecRequest::shell(
                    "cat hello.txt; n=$(cat count 2>/dev/null || echo 0); echo $((n+1)) > count; echo call $((n+1)); uname -sr",
                ))
                .await
                .expect("exec");
            print!("{}", r.stdout_str());
        })
        .await?;
    println!(
        "started: {:?}; state saved: {}",
        out.report.start,
        out.report.state_json.is_some()
    );
    Ok(())
}
