//! Running one command in a box: the argv, the working directory and the environment a box
//! gives it; `sandbox_core::host::run` runs it (own process group and cgroup, output read
//! concurrently, everything it started killed on exit, timeout and cancellation).

use std::collections::BTreeMap;
use std::io;
use std::path::{Path, PathBuf};
use std::time::Duration;

use sandbox_core::host::{self, HostCommand};
use sandbox_core::{Command, Error, ExecRequest, ExecResult, Inflight, RelPath, Result};
use tracing::Instrument as _;

use crate::BACKEND;
use crate::confined::{self, Slot};
use crate::fsutil::{self, BindLink};
use crate::options::{EnvPolicy, LocalOptions};

/// What a box contributes to every exec.
pub(crate) struct ExecContext<'a> {
    pub options: &'a LocalOptions,
    pub workspace: &'a Path,
    pub spec_env: &'a BTreeMap<String, String>,
    pub links: &'a [BindLink],
    pub inflight: &'a Inflight,
    pub confined: Option<&'a Slot>,
}

/// Run `request` in the box described by `cx`.
pub(crate) async fn run(cx: ExecContext<'_>, request: ExecRequest) -> Result<ExecResult> {
    let timeout = request.timeout.unwrap_or(cx.options.default_timeout);
    let (kind, argv) = match &request.command {
        Command::Shell(_) => {
            if cx.options.shell.is_empty() {
                return Err(Error::invalid(
                    "local options",
                    "the shell prefix is empty; set LocalOptions::shell",
                ));
            }
            let shell: Vec<&str> = cx.options.shell.iter().map(String::as_str).collect();
            ("shell", request.command.to_argv(&shell))
        }
        Command::Argv(_) => ("argv", request.command.to_argv(&[])),
    };
    if argv.is_empty() {
        return Err(Error::invalid("command", "the argument vector is empty"));
    }
    host::check_env(&request.env)?;
    host::check_env(cx.spec_env)?;
    host::check_env(&cx.options.extra_env)?;
    let cwd = resolve_cwd(&cx, request.cwd.as_deref()).await?;
    // Env values may be secrets and command lines may embed them: only the kind, the program
    // and where it runs are logged.
    let span = tracing::info_span!(
        "local_exec",
        kind,
        program = %argv[0],
        cwd = %cwd.display(),
        timeout_ms = timeout.as_millis() as u64,
    );
    let command = host_command(&cx, request, argv, cwd, timeout);
    match cx.confined {
        None => host::run(command, BACKEND).instrument(span).await,
        Some(slot) => {
            let env = confined_env(&command)?;
            let HostCommand {
                argv,
                cwd,
                stdin,
                timeout,
                limits,
                ..
            } = command;
            let spec = sandbox_confine::ExecSpec::new(argv, env, cwd);
            async {
                let init = slot.get().await?;
                confined::run(init, spec, stdin, timeout, limits, cx.inflight).await
            }
            .instrument(span)
            .await
        }
    }
}

/// The command's whole environment as `KEY=value` strings (a confined command gets exactly
/// these; with `inherit_env`, this process's environment under them).
fn confined_env(command: &HostCommand) -> Result<Vec<String>> {
    let mut env: BTreeMap<std::ffi::OsString, std::ffi::OsString> = BTreeMap::new();
    if command.inherit_env {
        env.extend(std::env::vars_os());
    }
    env.extend(command.env.iter().map(|(k, v)| (k.clone(), v.clone())));
    env.into_iter()
        .map(|(k, v)| match (k.to_str(), v.to_str()) {
            (Some(k), Some(v)) => Ok(format!("{k}={v}")),
            _ => Err(Error::invalid(
                "environment variable",
                format!(
                    "`{}` is not valid UTF-8 (a confined box takes UTF-8 variables)",
                    k.to_string_lossy()
                ),
            )),
        })
        .collect()
}

/// The command for `sandbox_core::host::run`: argv and cwd as resolved, environment layered
/// lowest priority first: the policy's base, the spec's, the options' extra, the request's.
fn host_command(
    cx: &ExecContext<'_>,
    request: ExecRequest,
    argv: Vec<String>,
    cwd: PathBuf,
    timeout: Duration,
) -> HostCommand {
    let (base, inherit) = match cx.options.env {
        EnvPolicy::Minimal => (host::minimal_env(cx.workspace), false),
        EnvPolicy::Inherit => (BTreeMap::new(), true),
    };
    let mut command = HostCommand::new(argv, cwd)
        .envs(base)
        .envs(cx.spec_env)
        .envs(&cx.options.extra_env)
        .envs(&request.env)
        .inherit_env(inherit)
        .timeout(timeout)
        .limits(request.limits)
        .counted_by(cx.inflight);
    command.stdin = request.stdin;
    command
}

/// The working directory: the workspace root, a relative path under it, or an absolute path
/// inside it (compared by components). The resolved directory must also lie inside the
/// workspace or a read-write bind mount, so a symlink cannot move the command elsewhere.
async fn resolve_cwd(cx: &ExecContext<'_>, cwd: Option<&str>) -> Result<PathBuf> {
    let root = cx.workspace;
    let shown = cwd.unwrap_or(".").to_owned();
    let target = match cwd {
        None => root.to_path_buf(),
        Some(c) if c.starts_with('/') => {
            let rest = Path::new(c).strip_prefix(root).map_err(|_| {
                Error::path_escape(
                    c,
                    "an absolute working directory must lie inside the workspace root",
                )
            })?;
            if rest.as_os_str().is_empty() {
                root.to_path_buf()
            } else {
                RelPath::from_path(rest)?.to_host(root)
            }
        }
        Some(c) if c.split('/').all(|p| p.is_empty() || p == ".") => root.to_path_buf(),
        Some(c) => RelPath::new(c)?.to_host(root),
    };
    let (root_c, target_c, links) = (root.to_path_buf(), target.clone(), cx.links.to_vec());
    tokio::task::spawn_blocking(move || {
        if !fsutil::is_real_dir(&root_c)? {
            return Err(Error::NotFound {
                what: "workspace",
                key: root_c.display().to_string(),
            });
        }
        let resolved = std::fs::canonicalize(&target_c).map_err(|e| match e.kind() {
            io::ErrorKind::NotFound => Error::NotFound {
                what: "working directory",
                key: shown.clone(),
            },
            _ => Error::io(&target_c, e),
        })?;
        if !fsutil::is_within(&resolved, &fsutil::allowed_roots(&root_c, &links)) {
            return Err(Error::path_escape(
                shown,
                "resolves outside the workspace (through a symlink)",
            ));
        }
        if !resolved.is_dir() {
            return Err(Error::invalid(
                "working directory",
                format!("`{shown}` is not a directory"),
            ));
        }
        Ok(())
    })
    .await
    .map_err(|e| Error::backend(BACKEND, "exec", e.to_string()))??;
    Ok(target)
}
