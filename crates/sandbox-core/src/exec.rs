//! Running commands in a box: the request, the result, and a capped output collector every
//! backend shares.

use std::collections::BTreeMap;
use std::fmt;
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use tokio::io::{AsyncRead, AsyncReadExt};

/// What to run.
#[derive(Clone, PartialEq, Eq)]
pub enum Command {
    /// A shell command line, run with the backend's shell (`bash -c` locally, `sh -c` in
    /// containers that have no bash). Not a login shell: no profile is read.
    Shell(String),
    /// An argument vector, run without a shell.
    Argv(Vec<String>),
}

impl Command {
    /// The argv that runs this command with `shell` (e.g. `["bash", "-c"]`).
    pub fn to_argv(&self, shell: &[&str]) -> Vec<String> {
        match self {
            Command::Shell(line) => shell
                .iter()
                .map(|s| (*s).to_owned())
                .chain(std::iter::once(line.clone()))
                .collect(),
            Command::Argv(argv) => argv.clone(),
        }
    }
}

impl Command {
    /// `"shell"` or `"argv"`, for logs.
    pub fn kind(&self) -> &'static str {
        match self {
            Command::Shell(_) => "shell",
            Command::Argv(_) => "argv",
        }
    }

    /// The program of an argument vector (its first element), for logs. `None` for a shell
    /// line: its first word may be an assignment (`TOKEN=… cmd`).
    pub fn program(&self) -> Option<&str> {
        match self {
            Command::Shell(_) => None,
            Command::Argv(argv) => argv.first().map(String::as_str),
        }
    }
}

/// Only the program and the size of the command: command lines and arguments may embed
/// secrets (`curl -H "Authorization: Bearer …"`), and any `?request` in a log prints this.
impl fmt::Debug for Command {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Command::Shell(line) => f.debug_struct("Shell").field("len", &line.len()).finish(),
            Command::Argv(argv) => f
                .debug_struct("Argv")
                .field("program", &argv.first())
                .field("args", &argv.len().saturating_sub(1))
                .finish(),
        }
    }
}

/// Per-stream caps on captured output. Output beyond a cap is read and discarded (so the
/// command never blocks on a full pipe) and the result is flagged truncated.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct OutputLimits {
    /// Most stdout bytes kept. Default 1 MiB.
    pub stdout: usize,
    /// Most stderr bytes kept. Default 1 MiB.
    pub stderr: usize,
}

impl OutputLimits {
    /// The same cap for both streams.
    pub fn both(max: usize) -> Self {
        OutputLimits {
            stdout: max,
            stderr: max,
        }
    }
}

impl Default for OutputLimits {
    fn default() -> Self {
        OutputLimits::both(1024 * 1024)
    }
}

/// A command to run in a box.
///
/// ```
/// use std::time::Duration;
/// use sandbox_core::ExecRequest;
/// let req = ExecRequest::shell("echo hi > out.txt")
///     .cwd("sub")
///     .env("GREETING", "hi")
///     .timeout(Duration::from_secs(5));
/// assert_eq!(req.timeout, Some(Duration::from_secs(5)));
/// ```
#[derive(Clone)]
#[non_exhaustive]
pub struct ExecRequest {
    /// What to run.
    pub command: Command,
    /// Working directory: relative to the workspace root, or absolute inside the box.
    /// `None` is the workspace root.
    pub cwd: Option<String>,
    /// Variables added to the backend's base environment for this command.
    pub env: BTreeMap<String, String>,
    /// Kill the whole process tree after this long. `None` uses the backend's default.
    pub timeout: Option<Duration>,
    /// Bytes fed to the command's stdin, which is then closed. `None` gives an empty stdin.
    pub stdin: Option<Bytes>,
    /// Output caps.
    pub limits: OutputLimits,
}

impl ExecRequest {
    /// Run `line` with the backend's shell.
    pub fn shell(line: impl Into<String>) -> Self {
        Self::new(Command::Shell(line.into()))
    }

    /// Run an argument vector without a shell.
    pub fn argv<I, S>(argv: I) -> Self
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
    {
        Self::new(Command::Argv(argv.into_iter().map(Into::into).collect()))
    }

    fn new(command: Command) -> Self {
        ExecRequest {
            command,
            cwd: None,
            env: BTreeMap::new(),
            timeout: None,
            stdin: None,
            limits: OutputLimits::default(),
        }
    }

    /// Set the working directory.
    pub fn cwd(mut self, cwd: impl Into<String>) -> Self {
        self.cwd = Some(cwd.into());
        self
    }

    /// Add an environment variable.
    pub fn env(mut self, key: impl Into<String>, value: impl Into<String>) -> Self {
        self.env.insert(key.into(), value.into());
        self
    }

    /// Set the timeout.
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.timeout = Some(timeout);
        self
    }

    /// Feed `stdin` to the command.
    pub fn stdin(mut self, stdin: impl Into<Bytes>) -> Self {
        self.stdin = Some(stdin.into());
        self
    }

    /// Set the output caps.
    pub fn limits(mut self, limits: OutputLimits) -> Self {
        self.limits = limits;
        self
    }
}

/// Neither the command line (see [`Command`]'s `Debug`), environment values nor stdin are
/// printed: they may hold secrets.
impl fmt::Debug for ExecRequest {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ExecRequest")
            .field("command", &self.command)
            .field("cwd", &self.cwd)
            .field("env", &self.env.keys().collect::<Vec<_>>())
            .field("timeout", &self.timeout)
            .field("stdin", &self.stdin.as_ref().map(Bytes::len))
            .field("limits", &self.limits)
            .finish()
    }
}

/// What a command did.
#[derive(Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct ExecResult {
    /// Exit code; `None` when the process was killed by a signal (including our timeout).
    pub exit_code: Option<i32>,
    /// Captured stdout, at most the configured cap.
    pub stdout: Bytes,
    /// Captured stderr, at most the configured cap.
    pub stderr: Bytes,
    /// Stdout exceeded its cap.
    pub stdout_truncated: bool,
    /// Stderr exceeded its cap.
    pub stderr_truncated: bool,
    /// The timeout fired and the process tree was killed; output is what came before.
    pub timed_out: bool,
    /// Wall time from spawn to the end of output.
    pub duration: Duration,
}

impl ExecResult {
    /// Build a result; backends use this with [`CapturedOutput`].
    pub fn new(
        exit_code: Option<i32>,
        output: CapturedOutput,
        timed_out: bool,
        duration: Duration,
    ) -> Self {
        ExecResult {
            exit_code,
            stdout: output.stdout.bytes,
            stderr: output.stderr.bytes,
            stdout_truncated: output.stdout.truncated,
            stderr_truncated: output.stderr.truncated,
            timed_out,
            duration,
        }
    }

    /// Exited with code 0 and did not time out.
    pub fn success(&self) -> bool {
        self.exit_code == Some(0) && !self.timed_out
    }

    /// Either stream was truncated.
    pub fn truncated(&self) -> bool {
        self.stdout_truncated || self.stderr_truncated
    }

    /// Stdout as (lossy) UTF-8.
    pub fn stdout_str(&self) -> std::borrow::Cow<'_, str> {
        String::from_utf8_lossy(&self.stdout)
    }

    /// Stderr as (lossy) UTF-8.
    pub fn stderr_str(&self) -> std::borrow::Cow<'_, str> {
        String::from_utf8_lossy(&self.stderr)
    }
}

impl fmt::Debug for ExecResult {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ExecResult")
            .field("exit_code", &self.exit_code)
            .field("stdout", &self.stdout_str())
            .field("stderr", &self.stderr_str())
            .field("truncated", &(self.stdout_truncated, self.stderr_truncated))
            .field("timed_out", &self.timed_out)
            .field("duration", &self.duration)
            .finish()
    }
}

/// One stream's capture.
#[derive(Debug, Default, Clone)]
pub struct Captured {
    /// Kept bytes.
    pub bytes: Bytes,
    /// More bytes arrived than the cap allowed.
    pub truncated: bool,
}

/// Both streams' captures.
#[derive(Debug, Default, Clone)]
pub struct CapturedOutput {
    /// Stdout.
    pub stdout: Captured,
    /// Stderr.
    pub stderr: Captured,
}

/// Accumulates one stream up to a cap; everything after the cap is counted, not kept.
#[derive(Debug)]
pub struct CappedBuffer {
    buf: BytesMut,
    cap: usize,
    truncated: bool,
}

impl CappedBuffer {
    /// A buffer keeping at most `cap` bytes.
    pub fn new(cap: usize) -> Self {
        CappedBuffer {
            buf: BytesMut::with_capacity(cap.min(64 * 1024)),
            cap,
            truncated: false,
        }
    }

    /// Append a chunk.
    pub fn push(&mut self, chunk: &[u8]) {
        let room = self.cap.saturating_sub(self.buf.len());
        if chunk.len() > room {
            self.truncated = true;
        }
        self.buf.extend_from_slice(&chunk[..chunk.len().min(room)]);
    }

    /// Finish.
    pub fn finish(self) -> Captured {
        Captured {
            bytes: self.buf.freeze(),
            truncated: self.truncated,
        }
    }
}

/// Read `reader` to its end, keeping at most `cap` bytes. Never stops reading early, so the
/// writer cannot block on a full pipe.
pub async fn read_capped<R: AsyncRead + Unpin>(
    mut reader: R,
    cap: usize,
) -> std::io::Result<Captured> {
    let mut out = CappedBuffer::new(cap);
    let mut chunk = vec![0u8; 64 * 1024];
    loop {
        let n = reader.read(&mut chunk).await?;
        if n == 0 {
            return Ok(out.finish());
        }
        out.push(&chunk[..n]);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn capped_buffer_truncates() {
        let mut b = CappedBuffer::new(4);
        b.push(b"ab");
        b.push(b"cdef");
        let c = b.finish();
        assert_eq!(&c.bytes[..], b"abcd");
        assert!(c.truncated);
    }

    #[test]
    fn debug_hides_env_values() {
        let req = ExecRequest::shell("true").env("TOKEN", "s3cret");
        let shown = format!("{req:?}");
        assert!(shown.contains("TOKEN"));
        assert!(!shown.contains("s3cret"));
    }

    #[test]
    fn debug_hides_command_lines_and_arguments() {
        let line = "TOKEN=s3cret curl -H 'Authorization: Bearer s3cret' x";
        let req = ExecRequest::shell(line).stdin("s3cret");
        let shown = format!("{req:?}");
        assert!(
            !shown.contains("s3cret") && !shown.contains("TOKEN"),
            "{shown}"
        );
        assert!(
            shown.contains(&format!("Shell {{ len: {} }}", line.len())),
            "{shown}"
        );
        let req = ExecRequest::argv(["curl", "-u", "me:s3cret", "https://x"]);
        let shown = format!("{req:?}");
        assert!(!shown.contains("s3cret"), "{shown}");
        assert!(
            shown.contains(r#"Argv { program: Some("curl"), args: 3 }"#),
            "{shown}"
        );
        assert_eq!(req.command.program(), Some("curl"));
        assert_eq!(ExecRequest::shell("x").command.program(), None);
    }

    #[tokio::test]
    async fn read_capped_drains_everything() {
        let data = vec![7u8; 300_000];
        let c = read_capped(&data[..], 10).await.unwrap();
        assert_eq!(c.bytes.len(), 10);
        assert!(c.truncated);
    }
}

/// Counts work a box still has under way — a command (until it and everything it started
/// is dead, also after its future was dropped: a backend's kill may run on a task of its own)
/// or a blocking file operation — so that a cancelled call can wait until nothing it started
/// still writes to the box ([`BoxHandle::settle`](crate::BoxHandle::settle)) before the box is
/// snapshotted, parked or removed. Clones share the count.
#[derive(Debug, Clone, Default)]
pub struct Inflight {
    count: std::sync::Arc<tokio::sync::watch::Sender<usize>>,
}

/// One unit of work counted by an [`Inflight`], until dropped. Move it into whatever ends
/// last (the task that kills a dropped command's tree, the blocking closure).
#[derive(Debug)]
#[must_use = "the work counts only while the guard lives"]
pub struct InflightGuard {
    count: std::sync::Arc<tokio::sync::watch::Sender<usize>>,
}

impl Inflight {
    /// A counter at zero.
    pub fn new() -> Self {
        Inflight::default()
    }

    /// Count one unit of work until the guard is dropped.
    pub fn enter(&self) -> InflightGuard {
        self.count.send_modify(|n| *n += 1);
        InflightGuard {
            count: self.count.clone(),
        }
    }

    /// Units under way now.
    pub fn count(&self) -> usize {
        *self.count.borrow()
    }

    /// Wait until nothing is under way, at most `within`; `false` if something still was.
    pub async fn idle(&self, within: Duration) -> bool {
        let mut rx = self.count.subscribe();
        tokio::time::timeout(within, rx.wait_for(|n| *n == 0))
            .await
            .is_ok_and(|r| r.is_ok())
    }
}

impl Drop for InflightGuard {
    fn drop(&mut self) {
        self.count.send_modify(|n| *n = n.saturating_sub(1));
    }
}

#[cfg(test)]
mod inflight_tests {
    use super::*;

    #[tokio::test]
    async fn idle_waits_for_every_guard() {
        let inflight = Inflight::new();
        assert!(inflight.idle(Duration::ZERO).await, "idle at first");
        let a = inflight.enter();
        let b = inflight.enter();
        assert_eq!(inflight.count(), 2);
        assert!(!inflight.idle(Duration::from_millis(20)).await);
        drop(a);
        assert!(
            !inflight.idle(Duration::from_millis(20)).await,
            "b is still under way"
        );
        let waiter = {
            let inflight = inflight.clone();
            tokio::spawn(async move { inflight.idle(Duration::from_secs(30)).await })
        };
        tokio::time::sleep(Duration::from_millis(20)).await;
        drop(b);
        assert!(
            waiter.await.expect("waiter"),
            "idle once the last guard is gone"
        );
    }
}
