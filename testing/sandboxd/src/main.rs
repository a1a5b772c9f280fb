//! `sandboxd`: serves the REST file API, the gRPC process service and the legacy
//! python-runtime API from one process. See the crate README for flags and environment.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use sandboxd::{BASE_DIR_ENV, Config, Server};

mod init;

const USAGE: &str = "\
usage: sandboxd [--rest-addr ADDR] [--grpc-addr ADDR] [--legacy-addr ADDR] [--base-dir DIR]

  --rest-addr ADDR    REST file API (/v1/...)        [env SANDBOXD_REST_ADDR, default 0.0.0.0:8080]
  --grpc-addr ADDR    gRPC process.v1.ProcessService  [env SANDBOXD_GRPC_ADDR, default 0.0.0.0:9090]
  --legacy-addr ADDR  legacy python-runtime API       [env SANDBOXD_LEGACY_ADDR, default 0.0.0.0:8888]
  --base-dir DIR      directory files and processes are confined to
                                                      [env SANDBOX_BASE_DIR, default /app]

The real sandboxd binds loopback; this one binds all interfaces by default so a test pod
(a Docker container) is reachable on its network address. As PID 1 it runs the server as
its child and reaps orphans (set SANDBOXD_NO_INIT to turn that off).
";

/// How long open connections may hold a SIGTERM shutdown (Docker's `stop` waits 10 s, a
/// pod's default grace period is 30 s).
const SHUTDOWN_GRACE: Duration = Duration::from_secs(3);

fn parse(args: impl IntoIterator<Item = String>) -> Result<Config, String> {
    let mut config = Config::default();
    let addr = |name: &str, value: &str| -> Result<SocketAddr, String> {
        value
            .parse()
            .map_err(|e| format!("{name}: {value:?} is not an address like 0.0.0.0:8080 ({e})"))
    };
    for (var, slot) in [
        ("SANDBOXD_REST_ADDR", &mut config.rest_addr),
        ("SANDBOXD_GRPC_ADDR", &mut config.grpc_addr),
        ("SANDBOXD_LEGACY_ADDR", &mut config.legacy_addr),
    ] {
        if let Ok(value) = std::env::var(var) {
            *slot = addr(var, &value)?;
        }
    }
    if let Ok(dir) = std::env::var(BASE_DIR_ENV)
        && !dir.is_empty()
    {
        config.base_dir = PathBuf::from(dir);
    }
    let mut args = args.into_iter();
    while let Some(flag) = args.next() {
        if flag == "-h" || flag == "--help" {
            return Err(String::new());
        }
        let (name, inline) = match flag.split_once('=') {
            Some((n, v)) => (n.to_owned(), Some(v.to_owned())),
            None => (flag.clone(), None),
        };
        let mut value = || {
            inline
                .clone()
                .or_else(|| args.next())
                .ok_or_else(|| format!("{name} needs a value"))
        };
        match name.as_str() {
            "--rest-addr" => config.rest_addr = addr(&name, &value()?)?,
            "--grpc-addr" => config.grpc_addr = addr(&name, &value()?)?,
            "--legacy-addr" => config.legacy_addr = addr(&name, &value()?)?,
            "--base-dir" => config.base_dir = PathBuf::from(value()?),
            other => return Err(format!("unknown argument {other:?}")),
        }
    }
    Ok(config)
}

fn main() -> ExitCode {
    if init::wanted() {
        return init::run();
    }
    // Under the init the mask it blocks for `sigwait` is inherited: start from none blocked
    // (before any thread exists), so the runtime's handlers and our children see signals.
    if let Err(e) = nix::sys::signal::SigSet::empty().thread_set_mask() {
        eprintln!("sandboxd: cannot reset the signal mask: {e}");
        return ExitCode::FAILURE;
    }
    match tokio::runtime::Runtime::new() {
        Ok(runtime) => runtime.block_on(serve()),
        Err(e) => {
            eprintln!("sandboxd: cannot start the runtime: {e}");
            ExitCode::FAILURE
        }
    }
}

async fn serve() -> ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .init();
    let config = match parse(std::env::args().skip(1)) {
        Ok(config) => config,
        Err(e) if e.is_empty() => {
            print!("{USAGE}");
            return ExitCode::SUCCESS;
        }
        Err(e) => {
            eprintln!("sandboxd: {e}\n\n{USAGE}");
            return ExitCode::from(2);
        }
    };
    let mut server = match Server::start(config).await {
        Ok(server) => server,
        Err(e) => {
            eprintln!("sandboxd: {e}");
            return ExitCode::FAILURE;
        }
    };
    // As PID 1 in a container SIGTERM has no default action: handle it.
    let mut term = match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
        Ok(s) => s,
        Err(e) => {
            eprintln!("sandboxd: cannot handle SIGTERM: {e}");
            return ExitCode::FAILURE;
        }
    };
    let result = tokio::select! {
        r = server.wait() => r,
        _ = term.recv() => server.shutdown_within(SHUTDOWN_GRACE).await.map(drop),
        _ = tokio::signal::ctrl_c() => server.shutdown_within(SHUTDOWN_GRACE).await.map(drop),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("sandboxd: {e}");
            ExitCode::FAILURE
        }
    }
}
