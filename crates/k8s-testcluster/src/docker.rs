//! Pods are Docker containers, driven through the `docker` CLI.

use std::process::Stdio;

use crate::Error;

/// Label on every container and network a cluster creates: the cluster id.
pub(crate) const LABEL: &str = "sandbox-harness.k8s-testcluster";
/// Label holding the pid of the process that owns the cluster (stale-run cleanup).
pub(crate) const PID_LABEL: &str = "sandbox-harness.k8s-testcluster.pid";

/// What to run in a pod.
#[derive(Debug, Clone, Default)]
pub(crate) struct ContainerSpec {
    pub name: String,
    pub image: String,
    pub command: Vec<String>,
    pub args: Vec<String>,
    pub env: Vec<(String, String)>,
    pub labels: Vec<(String, String)>,
}

async fn docker(args: &[String]) -> Result<String, Error> {
    let out = tokio::process::Command::new("docker")
        .args(args)
        .stdin(Stdio::null())
        .output()
        .await
        .map_err(|e| Error::Docker(format!("cannot run docker: {e}")))?;
    if !out.status.success() {
        return Err(Error::Docker(format!(
            "docker {}: {}",
            args.first().map(String::as_str).unwrap_or(""),
            String::from_utf8_lossy(&out.stderr).trim()
        )));
    }
    Ok(String::from_utf8_lossy(&out.stdout).trim().to_owned())
}

fn docker_blocking(args: &[&str]) -> Result<String, Error> {
    let out = std::process::Command::new("docker")
        .args(args)
        .stdin(Stdio::null())
        .output()
        .map_err(|e| Error::Docker(format!("cannot run docker: {e}")))?;
    if !out.status.success() {
        return Err(Error::Docker(format!(
            "docker {}: {}",
            args.first().copied().unwrap_or(""),
            String::from_utf8_lossy(&out.stderr).trim()
        )));
    }
    Ok(String::from_utf8_lossy(&out.stdout).trim().to_owned())
}

fn s(v: &str) -> String {
    v.to_owned()
}

/// Create the cluster's bridge network.
pub(crate) async fn create_network(name: &str, cluster_id: &str) -> Result<(), Error> {
    let pid = std::process::id().to_string();
    docker(&[
        s("network"),
        s("create"),
        s("--driver"),
        s("bridge"),
        s("--label"),
        format!("{LABEL}={cluster_id}"),
        s("--label"),
        format!("{PID_LABEL}={pid}"),
        s(name),
    ])
    .await
    .map(drop)
}

/// Start a container on `network`; returns its id and IP address there.
pub(crate) async fn run(
    spec: &ContainerSpec,
    network: &str,
    cluster_id: &str,
) -> Result<(String, String), Error> {
    let mut args = vec![
        s("run"),
        s("-d"),
        s("--network"),
        s(network),
        s("--name"),
        spec.name.clone(),
    ];
    args.extend([s("--label"), format!("{LABEL}={cluster_id}")]);
    args.extend([s("--label"), format!("{PID_LABEL}={}", std::process::id())]);
    for (k, v) in &spec.labels {
        args.extend([s("--label"), format!("{k}={v}")]);
    }
    for (k, v) in &spec.env {
        args.extend([s("-e"), format!("{k}={v}")]);
    }
    // Kubernetes `command` replaces the entrypoint, `args` the image's CMD.
    let mut positional = Vec::new();
    if let Some((first, rest)) = spec.command.split_first() {
        args.extend([s("--entrypoint"), first.clone()]);
        positional.extend(rest.iter().cloned());
    }
    positional.extend(spec.args.iter().cloned());
    args.push(spec.image.clone());
    args.extend(positional);
    let id = docker(&args).await?;
    let format = format!("{{{{(index .NetworkSettings.Networks \"{network}\").IPAddress}}}}");
    let ip = docker(&[s("inspect"), s("-f"), format, id.clone()]).await?;
    if ip.is_empty() {
        return Err(Error::Docker(format!(
            "container {id} has no address on {network}"
        )));
    }
    Ok((id, ip))
}

/// Wait for the container to exit; its exit code.
pub(crate) async fn wait(container: &str) -> Result<i64, Error> {
    let out = docker(&[s("wait"), s(container)]).await?;
    out.parse().map_err(|_| {
        Error::Docker(format!(
            "docker wait {container}: unexpected output `{out}`"
        ))
    })
}

/// `docker kill` (SIGKILL).
pub(crate) async fn kill(container: &str) -> Result<(), Error> {
    docker(&[s("kill"), s(container)]).await.map(drop)
}

/// `docker rm -f`.
pub(crate) async fn remove(container: &str) -> Result<(), Error> {
    docker(&[s("rm"), s("-f"), s(container)]).await.map(drop)
}

/// Remove the containers labelled with `cluster_id`; how many there were.
fn sweep(cluster_id: &str) -> usize {
    let filter = format!("label={LABEL}={cluster_id}");
    let Ok(ids) = docker_blocking(&["ps", "-aq", "--filter", &filter]) else {
        return 0;
    };
    let ids: Vec<&str> = ids.split_whitespace().collect();
    let n = ids.len();
    if n > 0 {
        let mut args = vec!["rm", "-f"];
        args.extend(ids);
        if let Err(e) = docker_blocking(&args) {
            tracing::warn!(error = %e, "removing the cluster's containers");
        }
    }
    n
}

/// Remove every container and the network of one cluster (blocking: runs from `Drop`).
/// With `in_flight` (a `docker run` was running), sweep again until two sweeps in a row find
/// nothing, for up to 5 s: that run creates its container after the first sweep.
pub(crate) fn cleanup_blocking(cluster_id: &str, network: &str, in_flight: bool) {
    sweep(cluster_id);
    if in_flight {
        let started = std::time::Instant::now();
        let mut empty = 0;
        while empty < 2 && started.elapsed() < std::time::Duration::from_secs(5) {
            std::thread::sleep(std::time::Duration::from_millis(300));
            empty = if sweep(cluster_id) == 0 { empty + 1 } else { 0 };
        }
    }
    if let Err(e) = docker_blocking(&["network", "rm", network])
        && !e.to_string().contains("not found")
    {
        tracing::warn!(error = %e, "removing the cluster's network");
    }
}

fn pid_alive(pid: &str) -> bool {
    pid.parse::<u32>()
        .is_ok_and(|p| std::path::Path::new(&format!("/proc/{p}")).exists())
}

/// Remove containers and networks of earlier clusters whose owner process is gone.
pub(crate) async fn remove_stale() -> Result<(), Error> {
    let fmt = format!("{{{{.ID}}}} {{{{.Label \"{PID_LABEL}\"}}}}");
    let rows = docker(&[
        s("ps"),
        s("-a"),
        s("--filter"),
        format!("label={LABEL}"),
        s("--format"),
        fmt,
    ])
    .await?;
    let stale: Vec<String> = rows
        .lines()
        .filter_map(|l| l.split_once(' '))
        .filter(|(_, pid)| !pid_alive(pid))
        .map(|(id, _)| id.to_owned())
        .collect();
    if !stale.is_empty() {
        tracing::info!(
            count = stale.len(),
            "removing containers of killed test clusters"
        );
        let mut args = vec![s("rm"), s("-f")];
        args.extend(stale);
        docker(&args).await?;
    }
    let nets = docker(&[
        s("network"),
        s("ls"),
        s("-q"),
        s("--filter"),
        format!("label={LABEL}"),
    ])
    .await?;
    for id in nets.split_whitespace() {
        let pid = docker(&[
            s("network"),
            s("inspect"),
            s("-f"),
            format!("{{{{index .Labels \"{PID_LABEL}\"}}}}"),
            s(id),
        ])
        .await?;
        if !pid_alive(&pid) {
            docker(&[s("network"), s("rm"), s(id)]).await?;
        }
    }
    Ok(())
}
