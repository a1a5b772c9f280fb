#![doc = include_str!("../README.md")]

use std::process::Stdio;
use std::time::{Duration, Instant};

/// A `docker` command failed or could not run. The message names the subcommand and carries
/// the CLI's stderr.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Error(pub String);

impl std::fmt::Display for Error {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for Error {}

impl Error {
    /// The engine said the object does not exist.
    pub fn is_not_found(&self) -> bool {
        let m = self.0.to_ascii_lowercase();
        m.contains("no such") || m.contains("not found")
    }
}

/// The result type of this crate.
pub type Result<T> = std::result::Result<T, Error>;

/// What to run.
#[derive(Debug, Clone, Default)]
pub struct ContainerSpec {
    /// Container name (`--name`); empty = Docker picks one.
    pub name: String,
    /// Image.
    pub image: String,
    /// Replaces the entrypoint: the first item is `--entrypoint`, the rest go before `args`.
    pub command: Vec<String>,
    /// Replaces the image's CMD.
    pub args: Vec<String>,
    /// Environment.
    pub env: Vec<(String, String)>,
    /// More labels (the owner's are always added).
    pub labels: Vec<(String, String)>,
}

/// A started container: its id and its IP address on the network it was started on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Started {
    /// Container id.
    pub id: String,
    /// IPv4 address on the network.
    pub ip: String,
}

/// A container's state (`docker inspect .State`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ContainerState {
    /// `created`, `running`, `paused`, `restarting`, `removing`, `exited` or `dead`.
    pub status: String,
    /// Running (also true while paused).
    pub running: bool,
    /// Paused.
    pub paused: bool,
    /// Exit code (0 while running).
    pub exit_code: i64,
}

/// Who owns containers, networks and images: a label namespace and an id.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Owner {
    namespace: String,
    id: String,
}

async fn docker(args: &[String]) -> Result<String> {
    let out = tokio::process::Command::new("docker")
        .args(args)
        .stdin(Stdio::null())
        .output()
        .await
        .map_err(|e| Error(format!("cannot run docker: {e}")))?;
    if !out.status.success() {
        return Err(Error(format!(
            "docker {}: {}",
            args.first().map(String::as_str).unwrap_or(""),
            String::from_utf8_lossy(&out.stderr).trim()
        )));
    }
    Ok(String::from_utf8_lossy(&out.stdout).trim().to_owned())
}

fn docker_blocking(args: &[&str]) -> Result<String> {
    let out = std::process::Command::new("docker")
        .args(args)
        .stdin(Stdio::null())
        .output()
        .map_err(|e| Error(format!("cannot run docker: {e}")))?;
    if !out.status.success() {
        return Err(Error(format!(
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

impl Owner {
    /// An owner: `namespace` is the label key (e.g. `sandbox-harness.k8s-testcluster`), `id`
    /// its value for this owner.
    pub fn new(namespace: impl Into<String>, id: impl Into<String>) -> Self {
        Self {
            namespace: namespace.into(),
            id: id.into(),
        }
    }

    /// The label key.
    pub fn namespace(&self) -> &str {
        &self.namespace
    }

    /// The label value.
    pub fn id(&self) -> &str {
        &self.id
    }

    /// The label holding the owner pid: `<namespace>.pid`.
    pub fn pid_label(&self) -> String {
        pid_label(&self.namespace)
    }

    /// The owner's labels: `<namespace>=<id>` and `<namespace>.pid=<this process's pid>`.
    pub fn labels(&self) -> [(String, String); 2] {
        [
            (self.namespace.clone(), self.id.clone()),
            (self.pid_label(), std::process::id().to_string()),
        ]
    }

    fn label_args(&self) -> Vec<String> {
        self.labels()
            .into_iter()
            .flat_map(|(k, v)| [s("--label"), format!("{k}={v}")])
            .collect()
    }

    fn filter(&self) -> String {
        format!("label={}={}", self.namespace, self.id)
    }

    /// Create a bridge network carrying the owner's labels.
    pub async fn create_network(&self, name: &str) -> Result<()> {
        let mut args = vec![s("network"), s("create"), s("--driver"), s("bridge")];
        args.extend(self.label_args());
        args.push(s(name));
        docker(&args).await.map(drop)
    }

    /// Start a container on `network` (`docker run -d`); its id and IP address there.
    pub async fn run(&self, spec: &ContainerSpec, network: &str) -> Result<Started> {
        let mut args = vec![s("run"), s("-d"), s("--network"), s(network)];
        if !spec.name.is_empty() {
            args.extend([s("--name"), spec.name.clone()]);
        }
        args.extend(self.label_args());
        for (k, v) in &spec.labels {
            args.extend([s("--label"), format!("{k}={v}")]);
        }
        for (k, v) in &spec.env {
            args.extend([s("-e"), format!("{k}={v}")]);
        }
        let mut positional = Vec::new();
        if let Some((first, rest)) = spec.command.split_first() {
            args.extend([s("--entrypoint"), first.clone()]);
            positional.extend(rest.iter().cloned());
        }
        positional.extend(spec.args.iter().cloned());
        args.push(spec.image.clone());
        args.extend(positional);
        let id = docker(&args).await?;
        let ip = ip_on(&id, network).await?;
        if ip.is_empty() {
            return Err(Error(format!("container {id} has no address on {network}")));
        }
        Ok(Started { id, ip })
    }

    /// `docker commit` the container to the image `tag`, labelled as the owner's (a committed
    /// image also keeps the container's labels). Returns the image id.
    pub async fn commit(&self, container: &str, tag: &str) -> Result<String> {
        let mut args = vec![s("commit")];
        for (k, v) in self.labels() {
            args.extend([s("--change"), format!("LABEL {k}=\"{v}\"")]);
        }
        args.extend([s(container), s(tag)]);
        docker(&args).await
    }

    /// Remove the containers carrying the owner's id; how many there were.
    fn sweep(&self) -> usize {
        let filter = self.filter();
        let Ok(ids) = docker_blocking(&["ps", "-aq", "--filter", &filter]) else {
            return 0;
        };
        let ids: Vec<&str> = ids.split_whitespace().collect();
        let n = ids.len();
        if n > 0 {
            let mut args = vec!["rm", "-f"];
            args.extend(ids);
            if let Err(e) = docker_blocking(&args) {
                tracing::warn!(error = %e, "removing the owner's containers");
            }
        }
        n
    }

    /// Remove every container, `network` (when given) and every image carrying the owner's id
    /// (blocking: runs from `Drop`). With `in_flight` (a `docker run` was running), sweep
    /// containers again until two sweeps in a row find nothing, for up to 5 s: that run
    /// creates its container after the first sweep.
    pub fn cleanup_blocking(&self, network: Option<&str>, in_flight: bool) {
        self.sweep();
        if in_flight {
            let started = Instant::now();
            let mut empty = 0;
            while empty < 2 && started.elapsed() < Duration::from_secs(5) {
                std::thread::sleep(Duration::from_millis(300));
                empty = if self.sweep() == 0 { empty + 1 } else { 0 };
            }
        }
        if let Some(network) = network
            && let Err(e) = docker_blocking(&["network", "rm", network])
            && !e.is_not_found()
        {
            tracing::warn!(error = %e, "removing the owner's network");
        }
        let filter = self.filter();
        if let Ok(ids) = docker_blocking(&["images", "-q", "--no-trunc", "--filter", &filter]) {
            let mut ids: Vec<&str> = ids.split_whitespace().collect();
            ids.dedup();
            if !ids.is_empty() {
                let mut args = vec!["rmi", "-f"];
                args.extend(ids);
                if let Err(e) = docker_blocking(&args) {
                    tracing::warn!(error = %e, "removing the owner's images");
                }
            }
        }
    }
}

fn pid_label(namespace: &str) -> String {
    format!("{namespace}.pid")
}

async fn ip_on(container: &str, network: &str) -> Result<String> {
    let format = format!("{{{{(index .NetworkSettings.Networks \"{network}\").IPAddress}}}}");
    docker(&[s("inspect"), s("-f"), format, s(container)]).await
}

/// The state of `container`; `None` when it does not exist.
pub async fn inspect(container: &str) -> Result<Option<ContainerState>> {
    let out = match docker(&[
        s("inspect"),
        s("--type"),
        s("container"),
        s("-f"),
        s("{{json .State}}"),
        s(container),
    ])
    .await
    {
        Ok(out) => out,
        Err(e) if e.is_not_found() => return Ok(None),
        Err(e) => return Err(e),
    };
    let v: serde_json::Value = serde_json::from_str(&out)
        .map_err(|e| Error(format!("docker inspect {container}: {e}: `{out}`")))?;
    Ok(Some(ContainerState {
        status: v["Status"].as_str().unwrap_or("").to_owned(),
        running: v["Running"].as_bool().unwrap_or(false),
        paused: v["Paused"].as_bool().unwrap_or(false),
        exit_code: v["ExitCode"].as_i64().unwrap_or(0),
    }))
}

/// Wait for the container to exit; its exit code.
pub async fn wait(container: &str) -> Result<i64> {
    let out = docker(&[s("wait"), s(container)]).await?;
    out.parse().map_err(|_| {
        Error(format!(
            "docker wait {container}: unexpected output `{out}`"
        ))
    })
}

/// `docker kill` (SIGKILL).
pub async fn kill(container: &str) -> Result<()> {
    docker(&[s("kill"), s(container)]).await.map(drop)
}

/// `docker rm -f`.
pub async fn remove(container: &str) -> Result<()> {
    docker(&[s("rm"), s("-f"), s(container)]).await.map(drop)
}

/// `docker pause` (freeze every process of the container).
pub async fn pause(container: &str) -> Result<()> {
    docker(&[s("pause"), s(container)]).await.map(drop)
}

/// `docker unpause`.
pub async fn unpause(container: &str) -> Result<()> {
    docker(&[s("unpause"), s(container)]).await.map(drop)
}

/// `docker stop -t <grace seconds>`.
pub async fn stop(container: &str, grace: Duration) -> Result<()> {
    docker(&[
        s("stop"),
        s("-t"),
        grace.as_secs().to_string(),
        s(container),
    ])
    .await
    .map(drop)
}

/// `docker start`.
pub async fn start(container: &str) -> Result<()> {
    docker(&[s("start"), s(container)]).await.map(drop)
}

/// The container's IP address on `network` (it changes when a stopped container starts again).
pub async fn ip_address(container: &str, network: &str) -> Result<String> {
    ip_on(container, network).await
}

/// `docker rmi -f` of an image tag or id.
pub async fn remove_image(image: &str) -> Result<()> {
    docker(&[s("rmi"), s("-f"), s(image)]).await.map(drop)
}

/// Whether the image exists locally.
pub async fn image_exists(image: &str) -> Result<bool> {
    match docker(&[s("image"), s("inspect"), s("-f"), s("{{.Id}}"), s(image)]).await {
        Ok(_) => Ok(true),
        Err(e) if e.is_not_found() => Ok(false),
        Err(e) => Err(e),
    }
}

fn pid_alive(pid: &str) -> bool {
    pid.parse::<u32>()
        .is_ok_and(|p| std::path::Path::new(&format!("/proc/{p}")).exists())
}

/// Remove the containers, networks and images labelled with `namespace` whose owner process
/// (the `<namespace>.pid` label) is gone.
pub async fn remove_stale(namespace: &str) -> Result<()> {
    let pid_label = pid_label(namespace);
    let fmt = format!("{{{{.ID}}}} {{{{.Label \"{pid_label}\"}}}}");
    let rows = docker(&[
        s("ps"),
        s("-a"),
        s("--filter"),
        format!("label={namespace}"),
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
            namespace,
            "removing containers of killed test servers"
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
        format!("label={namespace}"),
    ])
    .await?;
    for id in nets.split_whitespace() {
        let pid = docker(&[
            s("network"),
            s("inspect"),
            s("-f"),
            format!("{{{{index .Labels \"{pid_label}\"}}}}"),
            s(id),
        ])
        .await?;
        // A network whose last container is still being torn down refuses removal: the next
        // sweep gets it; the images below are still looked at.
        if !pid_alive(&pid)
            && let Err(e) = docker(&[s("network"), s("rm"), s(id)]).await
        {
            tracing::warn!(error = %e, "removing a network of a killed test server");
        }
    }
    let images = docker(&[
        s("images"),
        s("-q"),
        s("--no-trunc"),
        s("--filter"),
        format!("label={namespace}"),
    ])
    .await?;
    let mut images: Vec<&str> = images.split_whitespace().collect();
    images.sort_unstable();
    images.dedup();
    for id in images {
        let pid = docker(&[
            s("image"),
            s("inspect"),
            s("-f"),
            format!("{{{{index .Config.Labels \"{pid_label}\"}}}}"),
            s(id),
        ])
        .await?;
        if !pid_alive(&pid)
            && let Err(e) = docker(&[s("rmi"), s("-f"), s(id)]).await
        {
            tracing::warn!(error = %e, "removing an image of a killed test server");
        }
    }
    Ok(())
}
