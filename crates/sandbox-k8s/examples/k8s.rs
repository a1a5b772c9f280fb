//! One persisted call through the Kubernetes backend.
//!
//! Against the test cluster: start it with `cargo xtask k8s-up` (it prints `KUBECONFIG=...`),
//! then `KUBECONFIG=<that path> cargo run -p sandbox-k8s --example k8s`. Against a real cluster
//! with agent-sandbox installed: point `KUBECONFIG` at it and set `SANDBOX_K8S_POOL` (the
//! `SandboxWarmPool`), `SANDBOX_K8S_NAMESPACE` and, if the runtime's base directory is not
//! `/app`, `SANDBOX_K8S_ROOT`. The example must run where pod IPs are reachable (the test
//! cluster's pods are containers on a local Docker network).

use std::sync::Arc;

use sandbox_core::{
    CallContext, ExecRequest, IsolationScope, Persistence, SandboxConfig, SandboxManager,
    SnapshotSpec, WorkspaceSpec,
};
use sandbox_k8s::{ClusterAccess, K8sClient, K8sOptions};

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let var = |k: &str, d: &str| std::env::var(k).unwrap_or_else(|_| d.to_owned());
    let root = var("SANDBOX_K8S_ROOT", "/app");
    let kubeconfig =
        std::env::var_os("KUBECONFIG").ok_or("set KUBECONFIG (cargo xtask k8s-up prints it)")?;
    let client = K8sClient::new(
        K8sOptions::new(var("SANDBOX_K8S_POOL", "default"))
            .namespace(var("SANDBOX_K8S_NAMESPACE", "default"))
            .workspace_root(&root)
            .file_api_base_dir(Some(root.clone()))
            .cluster(ClusterAccess::Kubeconfig(kubeconfig.into()))
            .persistence(Persistence::Ephemeral),
    )?;
    let dir = std::env::temp_dir().join("sandbox-k8s-example");
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
    let ctx = CallContext::new("k8s-example").session("demo");
    let out = manager
        .call(&ctx, |sb| async move {
            let r = sb
                .exec(ExecRequest::shell(
                    "cat hello.txt; n=$(cat count 2>/dev/null || echo 0); echo $((n+1)) > count; echo call $((n+1)); hostname",
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
