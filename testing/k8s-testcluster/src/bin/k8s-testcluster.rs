//! `k8s-testcluster`: run the test cluster in the foreground until SIGINT/SIGTERM.
//!
//! Usage: `k8s-testcluster [--pod-image IMAGE] [--warm N] [--namespace NS] [--kubeconfig PATH]
//! [--token T] [--router-token T] [--ready-file PATH] [--event-window N]`. Prints the kubeconfig path, API URL and
//! router URL; with `--ready-file`, writes them there as `KEY=value` lines once serving.

use std::path::PathBuf;
use std::process::ExitCode;

use k8s_testcluster::{TestCluster, TestClusterOptions};

fn usage() -> &'static str {
    "usage: k8s-testcluster [--pod-image IMAGE] [--warm N] [--namespace NS] [--kubeconfig PATH] [--token T] [--router-token T] [--ready-file PATH] [--event-window N]"
}

#[tokio::main]
async fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()),
        )
        .with_writer(std::io::stderr)
        .init();
    let mut opts = TestClusterOptions::default();
    let mut kubeconfig = PathBuf::from("target/k8s-testcluster/kubeconfig");
    let mut ready_file = None;
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        let mut value = || args.next().ok_or_else(|| format!("{a} needs a value"));
        let r: Result<(), String> = (|| {
            match a.as_str() {
                "--pod-image" => opts.pod_image = Some(value()?),
                "--warm" => {
                    opts.warm_pool_replicas =
                        value()?.parse().map_err(|e| format!("--warm: {e}"))?
                }
                "--namespace" => opts.namespace = value()?,
                "--kubeconfig" => kubeconfig = PathBuf::from(value()?),
                "--token" => opts.token = Some(value()?),
                "--router-token" => opts.router_token = Some(value()?),
                "--ready-file" => ready_file = Some(PathBuf::from(value()?)),
                "--event-window" => {
                    opts.event_window = value()?
                        .parse()
                        .map_err(|e| format!("--event-window: {e}"))?
                }
                "-h" | "--help" => return Err(usage().to_owned()),
                other => return Err(format!("unknown argument `{other}`\n{}", usage())),
            }
            Ok(())
        })();
        if let Err(e) = r {
            eprintln!("{e}");
            return ExitCode::FAILURE;
        }
    }
    let mut cluster = match TestCluster::start(opts).await {
        Ok(c) => c,
        Err(e) => {
            eprintln!("k8s-testcluster: {e}");
            return ExitCode::FAILURE;
        }
    };
    if let Some(dir) = kubeconfig.parent() {
        let _ = std::fs::create_dir_all(dir);
    }
    if let Err(e) = cluster.write_kubeconfig(&kubeconfig) {
        eprintln!("k8s-testcluster: {e}");
        return ExitCode::FAILURE;
    }
    let info = format!(
        "KUBECONFIG={}\nAPI_URL={}\nROUTER_URL={}\nNAMESPACE={}\nGATEWAY={}\n",
        kubeconfig
            .canonicalize()
            .unwrap_or(kubeconfig.clone())
            .display(),
        cluster.api_url(),
        cluster.router_url(),
        cluster.namespace(),
        cluster.gateway_name(),
    );
    print!("{info}");
    if let Some(path) = ready_file
        && let Err(e) = std::fs::write(&path, &info)
    {
        eprintln!("k8s-testcluster: writing {}: {e}", path.display());
        return ExitCode::FAILURE;
    }
    let mut term = match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
        Ok(s) => s,
        Err(e) => {
            eprintln!("k8s-testcluster: {e}");
            return ExitCode::FAILURE;
        }
    };
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        _ = term.recv() => {}
    }
    eprintln!("k8s-testcluster: stopping");
    cluster.shutdown();
    ExitCode::SUCCESS
}
