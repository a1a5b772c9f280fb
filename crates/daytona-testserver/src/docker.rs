//! Sandboxes are Docker containers, driven through the `docker` CLI.

use std::process::Stdio;

use crate::Error;

/// Label on every container and network a server creates: the server id.
pub(crate) const LABEL: &str = "sandbox-harness.daytona-testserver";
/// Label holding the pid of the process that owns the server (stale-run cleanup).
pub(crate) const PID_LABEL: &str = "sandbox-harness.daytona-testserver.pid";

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

/// Create the server's bridge network.
pub(crate) async fn create_network(name: &str, server_id: &str) -> Result<(), Error> {
    docker(&[
        s("network"),
        s("create"),
        s("--driver"),
        s("bridge"),
        s("--label"),
        format!("{LABEL}={server_id}"),
        s("--label"),
        format!("{PID_LABEL}={}", std::process::id()),
        s(name),
    ])
    .await
    .map(drop)
}

/// `docker run -d` `image` on `network` with `env`; the container id.
pub(crate) async fn run(
    name: &str,
    image: &str,
    env: &[(String, String)],
    network: &str,
    server_id: &str,
) -> Result<String, Error> {
    let mut args = vec![
        s("run"),
        s("-d"),
        s("--network"),
        s(network),
        s("--name"),
        s(name),
        s("--label"),
        format!("{LABEL}={server_id}"),
        s("--label"),
        format!("{PID_LABEL}={}", std::process::id()),
    ];
    for (k, v) in env {
        args.extend([s("-e"), format!("{k}={v}")]);
    }
    args.push(s(image));
    docker(&args).await
}

/// The container's IPv4 address on `network` (empty when it is not running).
pub(crate) async fn ip(container: &str, network: &str) -> Result<String, Error> {
    let format = format!("{{{{(index .NetworkSettings.Networks \"{network}\").IPAddress}}}}");
    docker(&[s("inspect"), s("-f"), format, s(container)]).await
}

/// `docker start`.
pub(crate) async fn start(container: &str) -> Result<(), Error> {
    docker(&[s("start"), s(container)]).await.map(drop)
}

/// `docker stop -t 2` (SIGTERM, SIGKILL after 2 s).
pub(crate) async fn stop(container: &str) -> Result<(), Error> {
    docker(&[s("stop"), s("-t"), s("2"), s(container)])
        .await
        .map(drop)
}

/// `docker rm -f`.
pub(crate) async fn remove(container: &str) -> Result<(), Error> {
    docker(&[s("rm"), s("-f"), s(container)]).await.map(drop)
}

/// Remove the containers labelled with `server_id`; how many there were.
fn sweep(server_id: &str) -> usize {
    let filter = format!("label={LABEL}={server_id}");
    let Ok(ids) = docker_blocking(&["ps", "-aq", "--filter", &filter]) else {
        return 0;
    };
    let ids: Vec<&str> = ids.split_whitespace().collect();
    let n = ids.len();
    if n > 0 {
        let mut args = vec!["rm", "-f"];
        args.extend(ids);
        if let Err(e) = docker_blocking(&args) {
            tracing::warn!(error = %e, "removing the server's containers");
        }
    }
    n
}

/// Remove every container and the network of one server (blocking: runs from `Drop`).
/// With `in_flight` (a `docker run` was running), sweep again until two sweeps in a row find
/// nothing, for up to 5 s.
pub(crate) fn cleanup_blocking(server_id: &str, network: &str, in_flight: bool) {
    sweep(server_id);
    if in_flight {
        let started = std::time::Instant::now();
        let mut empty = 0;
        while empty < 2 && started.elapsed() < std::time::Duration::from_secs(5) {
            std::thread::sleep(std::time::Duration::from_millis(300));
            empty = if sweep(server_id) == 0 { empty + 1 } else { 0 };
        }
    }
    if let Err(e) = docker_blocking(&["network", "rm", network])
        && !e.to_string().contains("not found")
    {
        tracing::warn!(error = %e, "removing the server's network");
    }
}

fn pid_alive(pid: &str) -> bool {
    pid.parse::<u32>()
        .is_ok_and(|p| std::path::Path::new(&format!("/proc/{p}")).exists())
}

/// Remove containers and networks of earlier servers whose owner process is gone.
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
