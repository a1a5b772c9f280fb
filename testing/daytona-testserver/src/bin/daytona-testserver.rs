//! `daytona-testserver`: run the Daytona test server in the foreground until SIGINT/SIGTERM.
//!
//! Usage: `daytona-testserver [--image IMAGE] [--api-key KEY] [--ready-file PATH]`. Prints
//! `DAYTONA_API_URL`, `DAYTONA_API_KEY` and `DAYTONA_TOOLBOX_URL` as `KEY=value` lines; with
//! `--ready-file`, writes them there once serving.

use std::path::PathBuf;
use std::process::ExitCode;

use daytona_testserver::{DaytonaTestServer, TestServerOptions};

fn usage() -> &'static str {
    "usage: daytona-testserver [--image IMAGE] [--api-key KEY] [--ready-file PATH]"
}

#[tokio::main]
async fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()),
        )
        .with_writer(std::io::stderr)
        .init();
    let mut opts = TestServerOptions::default();
    let mut ready_file = None;
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        let mut value = || args.next().ok_or_else(|| format!("{a} needs a value"));
        let r: Result<(), String> = (|| {
            match a.as_str() {
                "--image" => opts.image = value()?,
                "--api-key" => opts.api_key = Some(value()?),
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
    let mut server = match DaytonaTestServer::start(opts).await {
        Ok(s) => s,
        Err(e) => {
            eprintln!("daytona-testserver: {e}");
            return ExitCode::FAILURE;
        }
    };
    let info = format!(
        "DAYTONA_API_URL={}\nDAYTONA_API_KEY={}\nDAYTONA_TOOLBOX_URL={}\n",
        server.api_url(),
        server.api_key(),
        server.toolbox_url(),
    );
    print!("{info}");
    if let Some(path) = ready_file {
        use std::io::Write as _;
        use std::os::unix::fs::OpenOptionsExt as _;
        // The file holds the API key: owner-only.
        let written = std::fs::OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .mode(0o600)
            .open(&path)
            .and_then(|mut f| f.write_all(info.as_bytes()));
        if let Err(e) = written {
            eprintln!("daytona-testserver: writing {}: {e}", path.display());
            return ExitCode::FAILURE;
        }
    }
    let mut term = match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
        Ok(s) => s,
        Err(e) => {
            eprintln!("daytona-testserver: {e}");
            return ExitCode::FAILURE;
        }
    };
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        _ = term.recv() => {}
    }
    eprintln!("daytona-testserver: stopping");
    server.shutdown();
    ExitCode::SUCCESS
}
