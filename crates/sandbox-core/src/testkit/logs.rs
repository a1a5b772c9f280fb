//! The "no secrets in logs" check every backend runs with its own options.
//!
//! [`LogCapture`] installs a global subscriber that records every span and event at `TRACE`
//! (and every `log` record of dependencies, through `tracing-log`) into a buffer.
//! [`secrets_stay_out_of_logs`] then runs whole calls whose spec, requests, stdin, files and
//! (through the backend's options, set up by the caller) base environment carry [`SECRET`],
//! through success, failure, timeout and refusal, and asserts that the marker appears nowhere
//! in what was logged, nor in the `Debug` output of the objects involved.
//!
//! The subscriber is process-global (the backend's tasks run on other threads), so a backend
//! runs the check in a test binary of its own, with one test:
//!
//! ```no_run
//! # async fn demo(client: std::sync::Arc<dyn sandbox_core::SandboxClient>) {
//! // The client's options put `SECRET` in a variable named `OPTIONS_TOKEN`.
//! sandbox_core::testkit::logs::secrets_stay_out_of_logs(client, Some("OPTIONS_TOKEN")).await;
//! # }
//! ```

use std::io;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use tracing_subscriber::Layer as _;
use tracing_subscriber::fmt::MakeWriter;
use tracing_subscriber::fmt::format::FmtSpan;
use tracing_subscriber::layer::SubscriberExt as _;
use tracing_subscriber::util::SubscriberInitExt as _;

use super::Env;
use crate::backend::SandboxClient;
use crate::exec::ExecRequest;
use crate::isolation::IsolationScope;
use crate::path::RelPath;
use crate::sandbox::{Sandbox, SandboxConfig};
use crate::spec::WorkspaceSpec;

/// The marker secret: a stand-in for a token, password or key.
pub const SECRET: &str = "s3cr3t-MARKER-7f1";

/// URLs `scheme://…@host_and_path` whose user info holds [`SECRET`] in every shape that
/// confuses a URL parser or a naive redaction: raw `/`, `#`, `?` and `@` in the password,
/// percent-encoding, the secret as the user name, a password without a user, a token as the
/// only user info. Every option type that takes a URL checks its `Debug`, its errors and its
/// logs with each of them.
pub fn secret_urls(scheme: &str, host_and_path: &str) -> Vec<String> {
    [
        format!("user:{SECRET}/{SECRET}"),
        format!("user:{SECRET}#{SECRET}"),
        format!("user:{SECRET}?{SECRET}"),
        format!("user:{SECRET}@{SECRET}"),
        format!("user:{SECRET}%2F%23%3F%40{SECRET}"),
        format!("user:a/b#c?d@{SECRET}%40e"),
        format!("{SECRET}:{SECRET}"),
        format!(":{SECRET}"),
        SECRET.to_owned(),
    ]
    .into_iter()
    .map(|info| format!("{scheme}://{info}@{host_and_path}"))
    .collect()
}

/// A loopback HTTP/1.1 server that answers every request with `503` (so clients log, retry
/// and fail) and keeps each request's head, to check what a client sent (basic auth taken
/// out of a URL, say). Runs on a thread of its own until the process ends.
#[derive(Debug, Clone)]
pub struct RefusingServer {
    /// Its port on 127.0.0.1.
    pub port: u16,
    heads: Arc<Mutex<Vec<String>>>,
}

impl RefusingServer {
    /// Listen on a free loopback port.
    pub fn start() -> RefusingServer {
        use std::io::{Read as _, Write as _};
        let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        let port = listener.local_addr().expect("addr").port();
        let heads: Arc<Mutex<Vec<String>>> = Arc::default();
        let seen = heads.clone();
        std::thread::spawn(move || {
            for conn in listener.incoming() {
                let Ok(mut conn) = conn else { continue };
                let _ = conn.set_read_timeout(Some(Duration::from_secs(5)));
                let mut head = Vec::new();
                let mut byte = [0u8; 1];
                while !head.ends_with(b"\r\n\r\n") && head.len() < 64 << 10 {
                    match conn.read(&mut byte) {
                        Ok(1) => head.push(byte[0]),
                        _ => break,
                    }
                }
                seen.lock()
                    .expect("heads lock")
                    .push(String::from_utf8_lossy(&head).into_owned());
                let _ = conn.write_all(
                    b"HTTP/1.1 503 Service Unavailable\r\ncontent-length: 0\r\nconnection: close\r\n\r\n",
                );
            }
        });
        RefusingServer { port, heads }
    }

    /// The heads of the requests received so far.
    pub fn heads(&self) -> Vec<String> {
        self.heads.lock().expect("heads lock").clone()
    }
}

/// Assert that [`SECRET`] is in none of `shown` (`Debug` output, error messages) and on no
/// line of `logs`.
pub fn assert_secret_hidden(shown: &[String], logs: &str) {
    let leaks: Vec<&str> = logs.lines().filter(|l| l.contains(SECRET)).collect();
    assert!(
        leaks.is_empty(),
        "the secret was logged:\n{}",
        leaks.join("\n")
    );
    for s in shown {
        assert!(!s.contains(SECRET), "the secret is shown: {s}");
    }
}

/// Everything the process logs, kept in memory.
#[derive(Debug, Clone, Default)]
pub struct LogCapture {
    buf: Arc<Mutex<Vec<u8>>>,
}

impl LogCapture {
    /// The process's capture, installed as the global subscriber on first use: every level,
    /// every target, spans shown when they open and close, `log` records included.
    ///
    /// Panics if another global subscriber is already installed (run the check in a test
    /// binary of its own).
    pub fn global() -> &'static LogCapture {
        static CAPTURE: OnceLock<LogCapture> = OnceLock::new();
        CAPTURE.get_or_init(|| {
            let capture = LogCapture::default();
            let layer = tracing_subscriber::fmt::layer()
                .with_writer(capture.clone())
                .with_ansi(false)
                .with_span_events(FmtSpan::NEW | FmtSpan::CLOSE)
                .with_filter(tracing_subscriber::filter::LevelFilter::TRACE);
            tracing_subscriber::registry()
                .with(layer)
                .try_init()
                .expect("no other global subscriber: run this check in its own test binary");
            capture
        })
    }

    /// Everything logged since the last `take`.
    pub fn take(&self) -> String {
        let bytes = std::mem::take(&mut *self.buf.lock().expect("capture lock"));
        String::from_utf8_lossy(&bytes).into_owned()
    }
}

impl io::Write for LogCapture {
    fn write(&mut self, data: &[u8]) -> io::Result<usize> {
        self.buf
            .lock()
            .expect("capture lock")
            .extend_from_slice(data);
        Ok(data.len())
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

impl<'a> MakeWriter<'a> for LogCapture {
    type Writer = LogCapture;

    fn make_writer(&'a self) -> Self::Writer {
        self.clone()
    }
}

/// Run two whole calls (create, cold start, execs, snapshot, release; then a restore) through
/// `client` with [`SECRET`] in the spec's environment and files, in command lines, argument
/// vectors, request environments, stdin and written files, through a success, a failure, a
/// timeout and a refused request; then assert that no log line and no `Debug` output of the
/// client, spec, requests, sandbox or state shows it.
///
/// `options_env` names the variable the caller's client options set to [`SECRET`] (its
/// backend-wide environment), checked to reach the commands; `None` if the options have none.
///
/// Returns the captured logs, for backend-specific checks.
pub async fn secrets_stay_out_of_logs(
    client: Arc<dyn SandboxClient>,
    options_env: Option<&str>,
) -> String {
    let capture = LogCapture::global();
    let env = Env::new();
    let spec = WorkspaceSpec::builder()
        .file("notes.txt", format!("token {SECRET}\n"))
        .env("SPEC_TOKEN", SECRET)
        .build()
        .expect("spec");
    let config = SandboxConfig::new(spec.clone()).snapshots(env.snapshot_spec());
    let mut shown = vec![
        format!("{client:?}"),
        format!("{spec:?}"),
        format!("{config:?}"),
    ];
    let manager = env.manager(client, IsolationScope::Session, config);
    let ctx = env.ctx().session("secrets");
    capture.take();
    // The first call starts cold, the second restores the snapshot of the first.
    for _ in 0..2 {
        let options_env = options_env.map(str::to_owned);
        let called = manager
            .call(&ctx, |sb| async move { exercise(&sb, options_env).await })
            .await
            .expect("call");
        shown.extend(called.value);
        shown.push(format!("{:?}", called.report));
    }
    let logs = capture.take();

    let leaks: Vec<&str> = logs.lines().filter(|l| l.contains(SECRET)).collect();
    assert!(
        leaks.is_empty(),
        "the secret was logged:\n{}",
        leaks.join("\n")
    );
    for s in &shown {
        assert!(!s.contains(SECRET), "a Debug output shows the secret: {s}");
    }
    // Not vacuous: the calls were logged, with their steps and what the commands did.
    for expected in [
        "call{",
        "start{",
        "stop{",
        "exec{",
        "exec done",
        "exit_code=Some(3)",
        "timed_out=true",
        "exec failed",
    ] {
        assert!(
            logs.contains(expected),
            "no `{expected}` in the captured logs:\n{logs}"
        );
    }
    logs
}

/// One call's commands; returns the `Debug` output of what it used.
async fn exercise(sb: &Sandbox, options_env: Option<String>) -> Vec<String> {
    let timeout = Duration::from_secs(60);
    let mut shown = Vec::new();

    // A command line that names the secret (as a bearer token would be) and reads it from
    // the spec's, the request's and the options' environment.
    let from_options = options_env.map(|v| format!(" ${v}")).unwrap_or_default();
    let request = ExecRequest::shell(format!(
        "echo \"$SPEC_TOKEN $REQUEST_TOKEN{from_options}\"; : 'Authorization: Bearer {SECRET}'"
    ))
    .env("REQUEST_TOKEN", SECRET)
    .timeout(timeout);
    shown.push(format!("{request:?}"));
    let r = sb.exec(request).await.expect("exec");
    assert!(r.success(), "{r:?}");
    let expected = 2 + usize::from(!from_options.is_empty());
    assert_eq!(
        r.stdout_str().matches(SECRET).count(),
        expected,
        "every environment reached the command: {r:?}"
    );

    // An argument vector and stdin that carry it.
    let request = ExecRequest::argv(["sh", "-c", "cat; printf '%s\\n' \"$1\"", "sh", SECRET])
        .stdin(format!("{SECRET}\n"))
        .timeout(timeout);
    shown.push(format!("{request:?}"));
    let r = sb.exec(request).await.expect("exec");
    assert_eq!(r.stdout_str(), format!("{SECRET}\n{SECRET}\n"), "{r:?}");

    // A failing command and a timed-out one.
    let request = ExecRequest::shell(format!("echo {SECRET} >&2; exit 3")).timeout(timeout);
    shown.push(format!("{request:?}"));
    let r = sb.exec(request).await.expect("exec");
    assert_eq!(r.exit_code, Some(3), "{r:?}");
    let request =
        ExecRequest::shell(format!("echo {SECRET}; sleep 30")).timeout(Duration::from_millis(1500));
    shown.push(format!("{request:?}"));
    let r = sb.exec(request).await.expect("exec");
    assert!(r.timed_out, "{r:?}");

    // A refused request (a variable name no backend accepts) whose value is the secret.
    let request = ExecRequest::shell("true").env("BAD=NAME", SECRET);
    shown.push(format!("{request:?}"));
    let err = sb
        .exec(request)
        .await
        .expect_err("an invalid variable name");
    shown.push(format!("{err}"));
    shown.push(format!("{err:?}"));

    // Files with it as content.
    let path = RelPath::new("secret.txt").expect("path");
    sb.handle()
        .write_file(&path, SECRET.into(), 0o600)
        .await
        .expect("write");
    let back = sb.handle().read_file(&path).await.expect("read");
    assert_eq!(&back[..], SECRET.as_bytes());

    shown.push(format!("{sb:?}"));
    shown.push(format!("{:?}", sb.state()));
    shown
}
