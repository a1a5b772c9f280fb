//! [`DaytonaBox`]: one sandbox's primitives, through the toolbox's `process/execute` and file
//! endpoints.

use std::collections::{BTreeMap, HashMap};
use std::fmt;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use base64::Engine as _;
use bytes::Bytes;
use futures::{StreamExt, TryStreamExt};
use sandbox_core::posix;
use sandbox_core::scripted::{self, ScriptRunner};
use sandbox_core::stream::{self, ByteStream};
use sandbox_core::{
    BoxHandle, Captured, CapturedOutput, CommonState, Error, ExecRequest, ExecResult,
    ExportRequest, ImportMode, IsolationKey, OutputLimits, Persistence, RelPath, Result,
    SandboxState, TreeEntry, async_trait,
};

use crate::BACKEND;
use crate::api::Executed;
use crate::client::Shared;
use crate::state::DaytonaState;

/// Timeout of the backend's own helper commands.
const HELPER_TIMEOUT: Duration = Duration::from_secs(300);
/// Largest file `read_file` returns.
const READ_LIMIT: usize = scripted::READ_LIMIT;
/// Largest input a streamed script holds in memory (it is uploaded as one file).
const IMPORT_LIMIT: usize = 4 << 30;
/// Most output bytes a command may return per stream (they travel base64 in a JSON string).
const OUTPUT_CAP: usize = 256 << 20;

/// Everything that describes a box apart from its live sandbox.
#[derive(Clone)]
pub(crate) struct BoxConfig {
    pub name: String,
    pub root: String,
    pub key: Option<IsolationKey>,
    pub persistence: Persistence,
    pub spec_env: BTreeMap<String, String>,
}

/// The spec's environment values are not printed: they may hold secrets.
impl fmt::Debug for BoxConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("BoxConfig")
            .field("name", &self.name)
            .field("root", &self.root)
            .field("key", &self.key)
            .field("persistence", &self.persistence)
            .field("spec_env", &self.spec_env.keys().collect::<Vec<_>>())
            .finish()
    }
}

#[derive(Debug, Default)]
struct Live {
    /// The sandbox id the state knew, or the one `create` made.
    expected_id: Option<String>,
    /// The workspace cannot be trusted: the sandbox is not the one the state knew.
    lost: bool,
    /// The sandbox was just made by this handle.
    fresh: bool,
    /// `{toolboxProxyUrl}/{sandboxId}` once booted.
    toolbox: Option<String>,
}

/// One Daytona sandbox. Made by [`crate::DaytonaClient`].
pub struct DaytonaBox {
    shared: Arc<Shared>,
    config: BoxConfig,
    live: Mutex<Live>,
}

impl fmt::Debug for DaytonaBox {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DaytonaBox")
            .field("name", &self.config.name)
            .field("root", &self.config.root)
            .field("persistence", &self.config.persistence)
            .finish_non_exhaustive()
    }
}

/// Run `sh -c <script> sandbox <args…>` (from `$2` on) with its stdout in the file `$1`;
/// print `data` when it exited 0 having written something, else remove the file. Exits
/// with the script's status.
const TO_FILE_SCRIPT: &str = r#"o=$1; shift; "$@" > "$o"; c=$?
if [ "$c" -eq 0 ] && [ -s "$o" ]; then echo data; else rm -f -- "$o"; fi
exit "$c""#;

/// Single-quote `s` for `sh`.
pub(crate) fn quote(s: &str) -> String {
    format!("'{}'", s.replace('\'', r"'\''"))
}

/// Where a command's stdin comes from.
enum Stdin {
    None,
    /// Uploaded to a temporary file first (removed after the run).
    Bytes(Bytes),
}

/// The wrapper `execute` runs: the command's stdout, stderr and status go to files in `$d`,
/// which [`dump_script`] prints (base64, capped) and removes. The daemon's own output carries
/// only text, and it mixes the two streams.
fn exec_script(dir: &str, cwd: &str, argv: &[String], stdin: &str) -> String {
    let argv: Vec<String> = argv.iter().map(|a| quote(a)).collect();
    format!(
        "d={dir}\nmkdir -p \"$d\" || exit 125\n( cd -- {cwd} 2>/dev/null || {{ : > \"$d/nocwd\"; exit 127; }}; exec {argv} ) >\"$d/o\" 2>\"$d/e\" <{stdin}\necho \"$?\" > \"$d/c\"\n",
        dir = quote(dir),
        cwd = quote(cwd),
        argv = argv.join(" "),
        stdin = quote(stdin),
    )
}

/// Print what [`exec_script`] left in `dir` between markers, then remove it (and `extra`).
fn dump_script(dir: &str, limits: OutputLimits, extra: &str) -> String {
    let cap = |n: usize| n.min(OUTPUT_CAP) + 1;
    format!(
        "d={dir}\nprintf '\\001C\\n'; cat \"$d/c\" 2>/dev/null; [ -e \"$d/nocwd\" ] && printf 'nocwd\\n'\nprintf '\\001O\\n'; head -c {o} \"$d/o\" 2>/dev/null | base64\nprintf '\\001E\\n'; head -c {e} \"$d/e\" 2>/dev/null | base64\nprintf '\\001Z\\n'\nrm -rf -- \"$d\" {extra}\n",
        dir = quote(dir),
        o = cap(limits.stdout),
        e = cap(limits.stderr),
        extra = if extra.is_empty() {
            String::new()
        } else {
            quote(extra)
        },
    )
}

/// What [`dump_script`] printed.
#[derive(Debug, PartialEq, Eq)]
struct Dumped {
    code: Option<i32>,
    no_cwd: bool,
    stdout: Vec<u8>,
    stderr: Vec<u8>,
}

fn section<'a>(text: &'a str, start: &str, end: &str) -> Option<&'a str> {
    let from = text.find(start)? + start.len();
    let to = from + text[from..].find(end)?;
    Some(&text[from..to])
}

fn parse_dump(text: &str) -> Result<Dumped> {
    let bad = || {
        Error::backend(
            BACKEND,
            "exec",
            format!(
                "unexpected output of the exec wrapper: {}",
                text.chars().take(200).collect::<String>()
            ),
        )
    };
    let code_part = section(text, "\u{1}C\n", "\u{1}O\n").ok_or_else(bad)?;
    let out = section(text, "\u{1}O\n", "\u{1}E\n").ok_or_else(bad)?;
    let err = section(text, "\u{1}E\n", "\u{1}Z\n").ok_or_else(bad)?;
    let decode = |s: &str| {
        let clean: String = s.chars().filter(|c| !c.is_whitespace()).collect();
        base64::engine::general_purpose::STANDARD
            .decode(clean)
            .map_err(|_| bad())
    };
    Ok(Dumped {
        code: code_part.lines().next().and_then(|l| l.trim().parse().ok()),
        no_cwd: code_part.lines().any(|l| l.trim() == "nocwd"),
        stdout: decode(out)?,
        stderr: decode(err)?,
    })
}

fn capped(mut data: Vec<u8>, limit: usize) -> Captured {
    let limit = limit.min(OUTPUT_CAP);
    let truncated = data.len() > limit;
    data.truncate(limit);
    Captured {
        bytes: Bytes::from(data),
        truncated,
    }
}

impl DaytonaBox {
    pub(crate) fn new(
        shared: Arc<Shared>,
        config: BoxConfig,
        expected_id: Option<String>,
        fresh: bool,
    ) -> Self {
        DaytonaBox {
            shared,
            config,
            live: Mutex::new(Live {
                expected_id,
                fresh,
                ..Live::default()
            }),
        }
    }

    /// The sandbox's name.
    pub fn sandbox_name(&self) -> &str {
        &self.config.name
    }

    /// The sandbox's id, once known.
    pub fn sandbox_id(&self) -> Option<String> {
        self.live().expected_id.clone()
    }

    fn live(&self) -> std::sync::MutexGuard<'_, Live> {
        self.live.lock().expect("live lock")
    }

    fn toolbox(&self) -> Result<String> {
        self.live()
            .toolbox
            .clone()
            .ok_or_else(|| Error::backend(BACKEND, "toolbox", "the box is not booted (no sandbox)"))
    }

    /// Base environment of every command: options, then spec.
    fn base_env(&self) -> HashMap<String, String> {
        let mut env: HashMap<String, String> =
            self.shared.options.env.clone().into_iter().collect();
        env.extend(self.config.spec_env.clone());
        env
    }

    fn resolve_cwd(&self, cwd: Option<&str>) -> Result<String> {
        match cwd {
            None => Ok(self.config.root.clone()),
            Some(c) if c.starts_with('/') => {
                if c.contains('\0') {
                    return Err(Error::invalid("cwd", "contains a NUL byte"));
                }
                Ok(c.to_owned())
            }
            Some(c) => Ok(RelPath::new(c)?.to_box(&self.config.root)),
        }
    }

    /// Run `argv` through the exec wrapper.
    async fn run(
        &self,
        argv: Vec<String>,
        cwd: String,
        env: HashMap<String, String>,
        stdin: Stdin,
        limits: OutputLimits,
        timeout: Duration,
    ) -> Result<ExecResult> {
        let toolbox = self.toolbox()?;
        let api = &self.shared.api;
        let id = uuid::Uuid::new_v4().simple().to_string();
        let dir = format!("/tmp/.sandbox-exec-{id}");
        let (stdin_path, uploaded) = match stdin {
            Stdin::None => ("/dev/null".to_owned(), String::new()),
            Stdin::Bytes(data) => {
                let p = format!("/tmp/.sandbox-stdin-{id}");
                api.upload(&toolbox, &p, data).await?;
                (p.clone(), p)
            }
        };
        let started = Instant::now();
        let script = format!(
            "{}{}",
            exec_script(&dir, &cwd, &argv, &stdin_path),
            dump_script(&dir, limits, &uploaded)
        );
        let (text, wrapper_code, timed_out) =
            match api.execute(&toolbox, &script, &env, timeout).await? {
                Executed::Done(r) => (r.result, r.exit_code.or(r.code), false),
                Executed::TimedOut => {
                    // The daemon killed the command's process group: collect what it wrote.
                    let dump = dump_script(&dir, limits, &uploaded);
                    match api
                        .execute(&toolbox, &dump, &HashMap::new(), HELPER_TIMEOUT)
                        .await?
                    {
                        Executed::Done(r) => (r.result, r.exit_code.or(r.code), true),
                        Executed::TimedOut => {
                            return Err(Error::backend(
                                BACKEND,
                                "exec",
                                "collecting a timed-out command's output timed out",
                            ));
                        }
                    }
                }
            };
        let duration = started.elapsed();
        let d = parse_dump(&text).map_err(|e| match wrapper_code {
            // The wrapper itself failed (no `/tmp`, no `base64`): say how.
            Some(code) if code != 0 => Error::backend(
                BACKEND,
                "exec",
                format!(
                    "the exec wrapper exited with {code}: {}",
                    text.chars().take(300).collect::<String>()
                ),
            ),
            _ => e,
        })?;
        if d.no_cwd {
            return Err(Error::NotFound {
                what: "working directory",
                key: cwd,
            });
        }
        let output = CapturedOutput {
            stdout: capped(d.stdout, limits.stdout),
            stderr: capped(d.stderr, limits.stderr),
        };
        let code = if timed_out { None } else { d.code };
        Ok(ExecResult::new(code, output, timed_out, duration))
    }

    /// Run one of the backend's own scripts with `sh -c`; fails unless it exited 0 (`errors`
    /// turns known exit codes into typed errors).
    async fn script_with(
        &self,
        what: &'static str,
        script: &str,
        args: Vec<String>,
        stdin: Stdin,
        limits: OutputLimits,
        errors: scripted::ExitErrors,
    ) -> Result<ExecResult> {
        let mut argv = vec!["sh".into(), "-c".into(), script.into(), "sandbox".into()];
        argv.extend(args);
        let r = self
            .run(
                argv,
                "/".into(),
                HashMap::new(),
                stdin,
                limits,
                HELPER_TIMEOUT,
            )
            .await?;
        if r.success() {
            return Ok(r);
        }
        if let Some(code) = r.exit_code
            && let Some(e) = errors(code, &r.stderr_str())
        {
            return Err(e);
        }
        Err(Error::backend(
            BACKEND,
            what,
            format!(
                "helper exited with {:?}{}: {}",
                r.exit_code,
                if r.timed_out { " (timed out)" } else { "" },
                r.stderr_str().trim()
            ),
        ))
    }

    /// Find (or, when gone, make again) the sandbox and wait until it is started.
    async fn bind(&self) -> Result<()> {
        let shared = &self.shared;
        let expected = self.live().expected_id.clone();
        let found = match &expected {
            Some(id) => shared.api.get(id).await?,
            None => shared.api.get(&self.config.name).await?,
        };
        let sandbox = match found {
            Some(s) => {
                shared.check_owner(&s)?;
                s
            }
            None => {
                if expected.is_some() {
                    tracing::warn!(name = %self.config.name, "the sandbox is gone: making a new one (its workspace must be restored)");
                }
                let s = shared.create_sandbox(&self.config_for_create()).await?;
                self.live().fresh = true;
                s
            }
        };
        {
            // Only the sandbox `create` made or the state knew holds the workspace.
            let mut live = self.live();
            if live.expected_id.as_deref() != Some(sandbox.id.as_str()) {
                if live.expected_id.is_some() {
                    tracing::warn!(name = %self.config.name, "the sandbox is not the one the state knew: its workspace is lost");
                }
                live.lost = true;
            }
            live.expected_id = Some(sandbox.id.clone());
        }
        let ready = match shared.wait_started(&sandbox.id).await {
            Ok(s) => s,
            Err(Error::NotFound { .. }) => {
                // It vanished while starting: once more from nothing.
                tracing::warn!(name = %self.config.name, "the sandbox vanished while starting: making a new one");
                let s = shared.create_sandbox(&self.config_for_create()).await?;
                {
                    let mut live = self.live();
                    live.fresh = true;
                    live.lost = true;
                    live.expected_id = Some(s.id.clone());
                }
                shared.wait_started(&s.id).await?
            }
            Err(e) => return Err(e),
        };
        let base = match ready.toolbox_proxy_url.clone().filter(|u| !u.is_empty()) {
            Some(u) => u,
            None => shared.api.toolbox_url(&ready.id).await?,
        };
        let toolbox = format!("{}/{}", base.trim_end_matches('/'), ready.id);
        tracing::info!(sandbox = %ready.id, name = %ready.name, "sandbox started");
        self.live().toolbox = Some(toolbox);
        Ok(())
    }

    fn config_for_create(&self) -> BoxConfig {
        self.config.clone()
    }
}

#[async_trait]
impl BoxHandle for DaytonaBox {
    fn backend(&self) -> &'static str {
        BACKEND
    }

    fn workspace_root(&self) -> &str {
        &self.config.root
    }

    fn state(&self) -> Box<dyn SandboxState> {
        let live = self.live();
        Box::new(DaytonaState {
            common: CommonState::new(self.config.root.clone()),
            name: self.config.name.clone(),
            sandbox_id: live.expected_id.clone(),
            persistence: self.config.persistence,
            key: self.config.key.clone(),
        })
    }

    #[tracing::instrument(skip(self), fields(backend = BACKEND, name = %self.config.name))]
    async fn boot(&self) -> Result<()> {
        self.bind().await?;
        if self.live().fresh {
            ScriptRunner::script(
                self,
                "boot",
                "mkdir -p -- \"$1\"",
                vec![self.config.root.clone()],
                4096,
                scripted::no_errors,
            )
            .await?;
        }
        Ok(())
    }

    #[tracing::instrument(skip(self), fields(backend = BACKEND, name = %self.config.name))]
    async fn release(&self) -> Result<()> {
        match self.config.persistence {
            Persistence::Ephemeral => self.destroy().await,
            Persistence::Keep => self.park().await,
        }
    }

    #[tracing::instrument(skip(self), fields(backend = BACKEND, name = %self.config.name))]
    async fn park(&self) -> Result<()> {
        let id = self.live().expected_id.clone();
        self.live().toolbox = None;
        let Some(id) = id else { return Ok(()) };
        match self.shared.api.lifecycle(&id, "stop").await {
            Ok(_) | Err(Error::NotFound { .. }) => Ok(()),
            Err(e) => Err(e),
        }
    }

    #[tracing::instrument(skip(self), fields(backend = BACKEND, name = %self.config.name))]
    async fn destroy(&self) -> Result<()> {
        let id = self.live().expected_id.clone();
        self.live().toolbox = None;
        self.shared
            .remove(id.as_deref().unwrap_or(&self.config.name))
            .await
    }

    async fn workspace_exists(&self) -> Result<bool> {
        if self.live().lost {
            return Ok(false);
        }
        scripted::root_exists(self).await
    }

    #[tracing::instrument(skip_all, fields(backend = BACKEND, name = %self.config.name, program = request.command.program()))]
    async fn exec(&self, request: ExecRequest) -> Result<ExecResult> {
        let cwd = self.resolve_cwd(request.cwd.as_deref())?;
        let mut env = self.base_env();
        for k in request.env.keys() {
            posix::check_env_name(k)?;
        }
        env.extend(request.env);
        let stdin = match request.stdin {
            Some(b) => Stdin::Bytes(b),
            None => Stdin::None,
        };
        self.run(
            request.command.to_argv(&["sh", "-c"]),
            cwd,
            env,
            stdin,
            request.limits,
            request
                .timeout
                .unwrap_or(self.shared.options.default_timeout),
        )
        .await
    }

    async fn list(&self) -> Result<Vec<TreeEntry>> {
        scripted::list(self).await
    }

    async fn export(&self, request: &ExportRequest) -> Result<ByteStream> {
        scripted::export(self, request).await
    }

    async fn import(&self, archive: ByteStream, mode: ImportMode) -> Result<()> {
        scripted::import(self, archive, mode).await
    }

    async fn read_file(&self, path: &RelPath) -> Result<Bytes> {
        let toolbox = self.toolbox()?;
        let shown = path.to_box(&self.config.root);
        let r = match self.shared.api.download(&toolbox, &shown).await {
            Ok(r) => r,
            Err(Error::NotFound { .. }) => {
                return Err(Error::NotFound {
                    what: "file",
                    key: shown,
                });
            }
            Err(Error::InvalidInput { .. }) => {
                return Err(Error::invalid("file", format!("`{path}` is not a file")));
            }
            Err(e) => return Err(e),
        };
        let mut body = Vec::new();
        let mut chunks = r.bytes_stream();
        while let Some(chunk) = chunks.next().await {
            let chunk = chunk.map_err(|e| Error::Unavailable {
                service: "daytona toolbox".into(),
                reason: format!("reading {shown}: {e}"),
                source: Some(Box::new(e)),
            })?;
            body.extend_from_slice(&chunk);
            if body.len() > READ_LIMIT {
                return Err(Error::invalid(
                    "file",
                    format!("`{path}` is larger than 1 GiB"),
                ));
            }
        }
        Ok(Bytes::from(body))
    }

    async fn write_file(&self, path: &RelPath, data: Bytes, mode: u32) -> Result<()> {
        scripted::write_file(self, path, data, mode).await
    }

    async fn remove(&self, paths: &[RelPath]) -> Result<()> {
        scripted::remove(self, paths).await
    }
}

#[async_trait]
impl ScriptRunner for DaytonaBox {
    fn backend(&self) -> &'static str {
        BACKEND
    }

    /// Archives and files go through the toolbox's `POST /files/upload` (binary-safe, unlike
    /// a command's text output).
    fn can_upload(&self) -> bool {
        true
    }

    async fn upload(&self, path: &str, data: ByteStream) -> Result<()> {
        let data = stream::collect(data, IMPORT_LIMIT).await?;
        self.shared.api.upload(&self.toolbox()?, path, data).await
    }

    fn root(&self) -> &str {
        &self.config.root
    }

    async fn script(
        &self,
        operation: &'static str,
        script: &str,
        args: Vec<String>,
        limit: usize,
        errors: scripted::ExitErrors,
    ) -> Result<ExecResult> {
        self.script_with(
            operation,
            script,
            args,
            Stdin::None,
            OutputLimits::both(limit.min(OUTPUT_CAP)),
            errors,
        )
        .await
    }

    /// The input is uploaded as a file and fed as stdin; the script's stdout goes to a file
    /// in `/tmp` that travels back through the file API (binary-safe), removed once read.
    async fn stream_script(
        &self,
        operation: &'static str,
        script: &str,
        args: Vec<String>,
        input: Option<ByteStream>,
        errors: scripted::ExitErrors,
    ) -> Result<ByteStream> {
        let stdin = match input {
            Some(input) => Stdin::Bytes(stream::collect(input, IMPORT_LIMIT).await?),
            None => Stdin::None,
        };
        let toolbox = self.toolbox()?;
        let out = format!("/tmp/.sandbox-out-{}", uuid::Uuid::new_v4().simple());
        let mut wrapped = vec![
            out.clone(),
            "sh".into(),
            "-c".into(),
            script.into(),
            "sandbox".into(),
        ];
        wrapped.extend(args);
        let mut limits = OutputLimits::both(1 << 20);
        limits.stdout = 4096;
        let r = match self
            .script_with(operation, TO_FILE_SCRIPT, wrapped, stdin, limits, errors)
            .await
        {
            Ok(r) => r,
            Err(e) => {
                // The wrapper removes it, unless it was cut off (a timeout).
                if let Err(c) = self.shared.api.delete_file(&toolbox, &out).await {
                    tracing::warn!(error = %c, "removing a script's output file");
                }
                return Err(e);
            }
        };
        if r.stdout_str().trim() != "data" {
            return Ok(Box::pin(futures::stream::empty()));
        }
        let response = match self.shared.api.download(&toolbox, &out).await {
            Ok(r) => r,
            Err(e) => {
                let _ = self.shared.api.delete_file(&toolbox, &out).await;
                return Err(e);
            }
        };
        let body = response
            .bytes_stream()
            .map_err(move |e| Error::Unavailable {
                service: "daytona toolbox".into(),
                reason: format!("reading the output of {operation}: {e}"),
                source: Some(Box::new(e)),
            });
        let api = self.shared.api.clone();
        let cleanup = futures::stream::once(async move {
            if let Err(e) = api.delete_file(&toolbox, &out).await {
                tracing::warn!(error = %e, "removing a script's output file");
            }
            None
        })
        .filter_map(|x: Option<Result<Bytes>>| async move { x });
        Ok(Box::pin(body.chain(cleanup)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quoting_survives_single_quotes() {
        assert_eq!(quote("a'b"), r"'a'\''b'");
        assert_eq!(quote(""), "''");
    }

    #[test]
    fn dump_output_is_parsed_and_capped() {
        let b64 = |s: &[u8]| base64::engine::general_purpose::STANDARD.encode(s);
        let text = format!(
            "\u{1}C\n3\n\u{1}O\n{}\n\u{1}E\n{}\n\u{1}Z\n",
            b64(b"out\n\x00\xff"),
            b64(b"err\n")
        );
        let d = parse_dump(&text).unwrap();
        assert_eq!(
            d,
            Dumped {
                code: Some(3),
                no_cwd: false,
                stdout: b"out\n\x00\xff".to_vec(),
                stderr: b"err\n".to_vec()
            }
        );
        let c = capped(b"abcdef".to_vec(), 4);
        assert_eq!((c.bytes.as_ref(), c.truncated), (&b"abcd"[..], true));
        // A timed-out command has no status file; a missing cwd is reported.
        let text = "\u{1}C\nnocwd\n\u{1}O\n\n\u{1}E\n\n\u{1}Z\n";
        let d = parse_dump(text).unwrap();
        assert_eq!((d.code, d.no_cwd), (None, true));
        assert!(parse_dump("garbage").is_err());
    }

    #[test]
    fn wrapper_quotes_every_argument() {
        let s = exec_script(
            "/tmp/d",
            "/w s",
            &["sh".into(), "-c".into(), "echo 'x'".into()],
            "/dev/null",
        );
        assert!(s.contains(r#"exec 'sh' '-c' 'echo '\''x'\''' )"#), "{s}");
        assert!(s.contains("cd -- '/w s'"), "{s}");
    }
}
