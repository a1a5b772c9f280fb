//! `e2b-testserver`: run the E2B test server in the foreground until SIGINT/SIGTERM.
//!
//! Usage: `e2b-testserver [--image IMAGE] [--api-key KEY] [--envd-version V] [--ready-file PATH]`.
//! Prints `E2B_API_URL=`, `E2B_SANDBOX_URL=`, `E2B_DOMAIN=` and `E2B_API_KEY=` lines; with
//! `--ready-file`, writes them there (mode 0600: the key is a secret) once serving.

use std::path::PathBuf;
use std::process::ExitCode;

use e2b_testserver::{E2bTestServer, E2bTestServerOptions};

fn usage() -> &'static str {
    "usage: e2b-testserver [--image IMAGE] [--api-key KEY] [--envd-version V] [--ready-file PATH]"
}

fn write_private(path: &std::path::Path, text: &str) -> std::io::Result<()> {
    use std::io::Write as _;
    use std::os::unix::fs::OpenOptionsExt as _;
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .open(path)?;
    f.write_all(text.as_bytes())
}

#[tokio::main]
async fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()),
        )
        .with_writer(std::io::stderr)
        .init();
    let mut opts = E2bTestServerOptions::default();
    let mut ready_file = None;
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        let mut value = || args.next().ok_or_else(|| format!("{a} needs a value"));
        let r: Result<(), String> = (|| {
            match a.as_str() {
                "--image" => opts.image = value()?,
                "--api-key" => opts.api_key = Some(value()?),
                "--envd-version" => opts.envd_version = value()?,
                "--ready-file" => ready_file = Some(PathBuf::from(value()?)),
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
    let mut server = match E2bTestServer::start(opts).await {
        Ok(s) => s,
        Err(e) => {
            eprintln!("e2b-testserver: {e}");
            return ExitCode::FAILURE;
        }
    };
    let info = format!(
        "E2B_API_URL={}\nE2B_SANDBOX_URL={}\nE2B_DOMAIN={}\nE2B_API_KEY={}\n",
        server.api_url(),
        server.envd_url(),
        server.domain(),
        server.api_key(),
    );
    // The key goes to stdout (for a person running it by hand) and the ready file, never
    // to the log.
    print!("{info}");
    if let Some(path) = ready_file
        && let Err(e) = write_private(&path, &info)
    {
        eprintln!("e2b-testserver: writing {}: {e}", path.display());
        return ExitCode::FAILURE;
    }
    let mut term = match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
        Ok(s) => s,
        Err(e) => {
            eprintln!("e2b-testserver: {e}");
            return ExitCode::FAILURE;
        }
    };
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        _ = term.recv() => {}
    }
    eprintln!("e2b-testserver: stopping");
    server.shutdown();
    ExitCode::SUCCESS
}
