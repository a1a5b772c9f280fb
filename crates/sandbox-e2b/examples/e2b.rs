//! One persisted call through the E2B backend.
//!
//! With `E2B_API_KEY` set (and optionally `E2B_DOMAIN`, `E2B_API_URL`, `E2B_SANDBOX_URL`, and
//! `E2B_TEMPLATE`): against E2B (or Alibaba's E2B-compatible endpoint, see the README). Without
//! it: against an E2B test server the example starts itself (needs Docker and the pod image
//! `cargo xtask images` builds). Run it twice: the second call finds the first one's work
//! restored from the snapshot in the temporary directory.
//!
//! `cargo run -p sandbox-e2b --example e2b`

use std::sync::Arc;

use sandbox_core::{
    CallContext, ExecRequest, IsolationScope, Persistence, SandboxConfig, SandboxManager,
    SnapshotSpec, WorkspaceSpec,
};
use sandbox_e2b::{E2bClient, E2bOptions, Secret};

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut server = None;
    let options = if std::env::var_os("E2B_API_KEY").is_some() {
        let mut o = E2bOptions::from_env();
        if let Ok(t) = std::env::var("E2B_TEMPLATE") {
            o = o.template(t);
        }
        o
    } else {
        eprintln!("E2B_API_KEY is not set: starting an E2B test server (Docker)");
        let s = e2b_testserver::E2bTestServer::start(Default::default()).await?;
        let o = E2bOptions::new(Secret::new(s.api_key()))
            .domain(s.domain())
            .api_url(s.api_url())
            .sandbox_url(Some(s.envd_url()));
        server = Some(s);
        o
    };
    let client = E2bClient::new(options.persistence(Persistence::Ephemeral))?;
    let dir = std::env::temp_dir().join("sandbox-e2b-example");
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
    let ctx = CallContext::new("e2b-example").session("demo");
    let out = manager
        .call(&ctx, |sb| async move {
            let r = sb
                .exec(ExecRequest::shell(
                    "cat hello.txt; n=$(cat count 2>/dev/null || echo 0); echo $((n+1)) > count; echo call $((n+1)); uname -n",
                ))
                .await
                .expect("exec");
            print!("{}", r.stdout_str());
        })
        .await?;
    println!(
        "started: {:?}; state saved: {}",
        out.report.start.map(|s| s.branch),
        out.report.state_json.is_some()
    );
    drop(server);
    Ok(())
}
