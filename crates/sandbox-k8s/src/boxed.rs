//! [`K8sBox`]: one claim's primitives.

use std::collections::{BTreeMap, HashMap};
use std::fmt;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use sandbox_core::posix;
use sandbox_core::scripted::{self, ScriptRunner};
use sandbox_core::stream::ByteStream;
use sandbox_core::{
    BoxHandle, CommonState, Error, ExecRequest, ExecResult, ExportRequest, ImportMode,
    IsolationKey, OutputLimits, Persistence, RelPath, Result, SandboxState, TreeEntry, async_trait,
};

use crate::BACKEND;
use crate::client::Shared;
use crate::crd::SandboxInfo;
use crate::dataplane::{Http, Route, encode_segment, in_dir};
use crate::legacy;
use crate::options::{Connection, Runtime};
use crate::sandboxd::{self, Command};
use crate::state::{ConnectionKind, K8sState};

/// Timeout of the backend's own helper commands.
const HELPER_TIMEOUT: Duration = Duration::from_secs(300);

/// Largest file `read_file` returns.
const READ_LIMIT: usize = scripted::READ_LIMIT;

/// How long a dead pod's claim may take to go away before it is made again.
const RECREATE_TIMEOUT: Duration = Duration::from_secs(60);

/// Everything that describes a box apart from its live pod.
#[derive(Clone)]
pub(crate) struct BoxConfig {
    pub claim: String,
    pub root: String,
    pub key: Option<IsolationKey>,
    pub persistence: Persistence,
    pub spec_env: BTreeMap<String, String>,
}

/// The spec's environment values are not printed: they may hold secrets.
impl fmt::Debug for BoxConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("BoxConfig")
            .field("claim", &self.claim)
            .field("root", &self.root)
            .field("key", &self.key)
            .field("persistence", &self.persistence)
            .field("spec_env", &self.spec_env.keys().collect::<Vec<_>>())
            .finish()
    }
}

#[derive(Debug, Default)]
struct Live {
    /// The claim uid the state knew, or the one `create` made.
    expected_uid: Option<String>,
    /// The workspace cannot be trusted: the claim (pod) is not the one the state knew.
    lost: bool,
    /// The claim was just made by this handle.
    fresh: bool,
    sandbox: Option<SandboxInfo>,
    route: Option<Route>,
    channel: Option<sandboxd::Grpc>,
}

/// One claim. Made by [`crate::K8sClient`].
pub struct K8sBox {
    shared: Arc<Shared>,
    config: BoxConfig,
    live: Mutex<Live>,
}

impl fmt::Debug for K8sBox {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("K8sBox")
            .field("claim", &self.config.claim)
            .field("root", &self.config.root)
            .field("persistence", &self.config.persistence)
            .finish_non_exhaustive()
    }
}

impl K8sBox {
    pub(crate) fn new(
        shared: Arc<Shared>,
        config: BoxConfig,
        expected_uid: Option<String>,
        fresh: bool,
    ) -> Self {
        K8sBox {
            shared,
            config,
            live: Mutex::new(Live {
                expected_uid,
                fresh,
                ..Live::default()
            }),
        }
    }

    /// The claim's name.
    pub fn claim_name(&self) -> &str {
        &self.config.claim
    }

    fn live(&self) -> std::sync::MutexGuard<'_, Live> {
        self.live.lock().expect("live lock")
    }

    fn who(&self) -> String {
        format!(
            "claim {}/{}",
            self.shared.options.namespace, self.config.claim
        )
    }

    fn http(&self) -> Http {
        Http::new(
            self.shared.http.clone(),
            self.shared.options.retries,
            self.who(),
        )
    }

    fn route(&self) -> Result<Route> {
        self.live().route.clone().ok_or_else(|| {
            Error::backend(
                BACKEND,
                "data plane",
                "the box is not booted (no pod address)",
            )
        })
    }

    /// The gRPC channel to sandboxd, connecting on first use.
    async fn channel(&self) -> Result<sandboxd::Grpc> {
        if let Some(c) = self.live().channel.clone() {
            return Ok(c);
        }
        let Runtime::Sandboxd { grpc_port, .. } = self.shared.options.runtime else {
            return Err(sandbox_core::not_supported(
                BACKEND,
                "commands through the legacy runtime",
            ));
        };
        let route = self.route()?;
        let headers = sandboxd::CallHeaders::from_http(&route.headers(grpc_port)?)?;
        let channel = sandboxd::connect(
            &route.grpc_uri(grpc_port),
            headers,
            self.shared.options.retries,
            &self.who(),
        )
        .await?;
        self.live().channel = Some(channel.clone());
        Ok(channel)
    }

    /// Base environment of every command: options, then spec.
    fn base_env(&self) -> HashMap<String, String> {
        let mut env: HashMap<String, String> =
            self.shared.options.env.clone().into_iter().collect();
        env.extend(self.config.spec_env.clone());
        env
    }

    /// Run one of the backend's own scripts with `sh -c`, capturing its output.
    async fn script(
        &self,
        what: &'static str,
        script: &str,
        args: Vec<String>,
    ) -> Result<ExecResult> {
        self.run_script(what, script, args, 256 << 20, scripted::no_errors)
            .await
    }

    async fn run_script(
        &self,
        what: &'static str,
        script: &str,
        args: Vec<String>,
        limit: usize,
        errors: scripted::ExitErrors,
    ) -> Result<ExecResult> {
        let mut argv = vec!["sh".into(), "-c".into(), script.into(), "sandbox".into()];
        argv.extend(args);
        let limits = OutputLimits::both(limit);
        let r = if self.shared.options.runtime == Runtime::Legacy {
            let port = self.shared.options.server_port;
            legacy::run(
                &self.http(),
                &self.route()?,
                port,
                "/",
                &argv,
                limits,
                HELPER_TIMEOUT,
            )
            .await?
        } else {
            let command = Command {
                argv,
                env: HashMap::new(),
                cwd: None,
            };
            let channel = self.channel().await?;
            sandboxd::run(&channel, &self.who(), command, None, limits, HELPER_TIMEOUT).await?
        };
        if r.success() {
            Ok(r)
        } else if let Some(e) = r.exit_code.and_then(|c| errors(c, r.stderr_str().trim())) {
            Err(e)
        } else {
            Err(Error::backend(
                BACKEND,
                what,
                format!(
                    "helper exited with {:?}: {}",
                    r.exit_code,
                    r.stderr_str().trim()
                ),
            ))
        }
    }

    /// Run a script whose stdin is `input` and whose stdout is the returned stream.
    async fn stream_script(
        &self,
        script: &str,
        args: Vec<String>,
        input: Option<ByteStream>,
        errors: fn(i32, &str) -> Option<Error>,
    ) -> Result<ByteStream> {
        if self.shared.options.runtime == Runtime::Legacy {
            // No stdin and no streamed output through `/execute`.
            return Err(sandbox_core::not_supported(
                BACKEND,
                "tar streams (export, import, writes outside the file API) through the legacy runtime",
            ));
        }
        let mut argv = vec!["sh".into(), "-c".into(), script.into(), "sandbox".into()];
        argv.extend(args);
        let command = Command {
            argv,
            env: HashMap::new(),
            cwd: None,
        };
        sandboxd::run_streaming(&self.channel().await?, &self.who(), command, input, errors).await
    }

    /// A workspace file's path relative to the file API's base directory, when that holds
    /// the root.
    fn base_relative(&self, path: &RelPath) -> Option<String> {
        let base = self.shared.options.file_api_base_dir.as_deref()?;
        let base = base.trim_end_matches('/');
        let root = self.config.root.trim_end_matches('/');
        let below = if root == base {
            ""
        } else {
            root.strip_prefix(base)?.strip_prefix('/')?
        };
        Some(if below.is_empty() {
            path.as_str().to_owned()
        } else {
            format!("{below}/{}", path.as_str())
        })
    }

    /// The REST path of a workspace file (segments encoded, joined by `%2F` as the official
    /// SDK sends them).
    fn rest_path(&self, path: &RelPath) -> Option<String> {
        Some(format!(
            "/v1/files/{}",
            encode_segment(&self.base_relative(path)?)
        ))
    }

    /// A file's path for the legacy runtime's file API, and the runtime's port.
    fn legacy_file(&self, path: &RelPath) -> Result<(String, u16)> {
        let rel = self.base_relative(path).ok_or(Error::NotSupported {
            backend: BACKEND,
            operation: "files outside the file API base directory through the legacy runtime",
        })?;
        Ok((rel, self.shared.options.server_port))
    }

    fn rest_port(&self) -> Option<u16> {
        match self.shared.options.runtime {
            Runtime::Sandboxd { rest_port, .. } => Some(rest_port),
            Runtime::Legacy => None,
        }
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

    /// Find or make the claim, wait for it to be Ready, and read its Sandbox. A claim whose
    /// pod died is deleted and made again (its workspace is then lost).
    async fn bind(&self) -> Result<SandboxInfo> {
        let shared = &self.shared;
        let control = shared.control().await?;
        let timeout = shared.options.ready_timeout;
        for round in 0..2 {
            let claim = match control.get_claim(&self.config.claim).await? {
                Some(c) => {
                    shared.check_owner(&c)?;
                    c
                }
                None => {
                    tracing::warn!(claim = %self.config.claim, "claim is gone: making a new one (its workspace must be restored)");
                    let (c, created) = control
                        .create_claim(&shared.claim_object(&self.config))
                        .await?;
                    if !created {
                        shared.check_owner(&c)?;
                    }
                    self.live().fresh = true;
                    c
                }
            };
            {
                // Only the claim `create` made or the state knew holds the workspace; any
                // other (made here, or a new one under the same name) starts empty.
                let mut live = self.live();
                if live.expected_uid.is_none() || live.expected_uid != claim.metadata.uid {
                    if live.expected_uid.is_some() {
                        tracing::warn!(claim = %self.config.claim, "the claim is not the one the state knew: its workspace is lost");
                    }
                    live.lost = true;
                }
                live.expected_uid = claim.metadata.uid.clone();
            }
            let dead = match control.wait_ready(&self.config.claim, timeout).await {
                Ok((sandbox, _)) => match control.get_sandbox(&sandbox).await? {
                    Some(info) if info.failed.is_none() => return Ok(info),
                    Some(info) => info.failed.map(|(r, _)| r),
                    None => Some("SandboxMissing".to_owned()),
                },
                Err(Error::NotFound { key, .. }) if round == 0 => Some(key),
                Err(e) => return Err(e),
            };
            if round == 1 {
                break;
            }
            tracing::warn!(claim = %self.config.claim, reason = ?dead, "the claim's pod is gone: making the claim again (its workspace must be restored)");
            control.delete_claim(&self.config.claim).await?;
            control
                .wait_gone(&self.config.claim, RECREATE_TIMEOUT)
                .await?;
            self.live().lost = true;
        }
        Err(Error::Unavailable {
            service: self.who(),
            reason: "the claim's pod died again right after it was made".into(),
            source: None,
        })
    }

    async fn resolve_route(&self, info: &SandboxInfo) -> Result<Route> {
        let o = &self.shared.options;
        let missing = |what: &str| Error::Unavailable {
            service: self.who(),
            reason: format!("the Sandbox `{}` has no {what} yet", info.name),
            source: None,
        };
        Ok(match &o.connection {
            Connection::PodIp => Route::Direct {
                host: info.pod_ip.clone().ok_or_else(|| missing("pod IP"))?,
            },
            Connection::ServiceDns => Route::Direct {
                host: info
                    .service_fqdn
                    .clone()
                    .ok_or_else(|| missing("service FQDN"))?,
            },
            Connection::Router { url, token } => Route::Router {
                base: url.clone(),
                token: token.clone(),
                sandbox: info.name.clone(),
                namespace: o.namespace.clone(),
            },
            Connection::Gateway {
                name,
                namespace,
                scheme,
                token,
            } => {
                let control = self.shared.control().await?;
                let addr = control.gateway_address(name, namespace).await?;
                let host = gateway_host(addr);
                Route::Router {
                    base: format!("{scheme}://{host}"),
                    token: token.clone(),
                    sandbox: info.name.clone(),
                    namespace: o.namespace.clone(),
                }
            }
        })
    }
}

#[async_trait]
impl BoxHandle for K8sBox {
    fn backend(&self) -> &'static str {
        BACKEND
    }

    fn workspace_root(&self) -> &str {
        &self.config.root
    }

    fn state(&self) -> Box<dyn SandboxState> {
        let live = self.live();
        let connection = match self.shared.options.connection {
            Connection::PodIp => ConnectionKind::PodIp,
            Connection::ServiceDns => ConnectionKind::ServiceDns,
            Connection::Router { .. } => ConnectionKind::Router,
            Connection::Gateway { .. } => ConnectionKind::Gateway,
        };
        Box::new(K8sState {
            common: CommonState::new(self.config.root.clone()),
            claim_name: self.config.claim.clone(),
            namespace: self.shared.options.namespace.clone(),
            sandbox_name: live.sandbox.as_ref().map(|s| s.name.clone()),
            pod_name: live.sandbox.as_ref().map(|s| s.pod_name.clone()),
            claim_uid: live.expected_uid.clone(),
            connection,
            persistence: self.config.persistence,
            key: self.config.key.clone(),
        })
    }

    #[tracing::instrument(skip(self), fields(backend = BACKEND, claim = %self.config.claim))]
    async fn boot(&self) -> Result<()> {
        let info = self.bind().await?;
        let route = self.resolve_route(&info).await?;
        tracing::info!(sandbox = %info.name, pod = %info.pod_name, route = ?route, "claim bound");
        {
            let mut live = self.live();
            let moved = live.sandbox.as_ref() != Some(&info);
            live.sandbox = Some(info);
            live.route = Some(route);
            if moved {
                live.channel = None;
            }
        }
        if self.live().fresh {
            self.script("boot", "mkdir -p -- \"$1\"", vec![self.config.root.clone()])
                .await?;
        }
        Ok(())
    }

    #[tracing::instrument(skip(self), fields(backend = BACKEND, claim = %self.config.claim))]
    async fn release(&self) -> Result<()> {
        self.live().channel = None;
        match self.config.persistence {
            Persistence::Ephemeral => {
                self.shared
                    .control()
                    .await?
                    .delete_claim(&self.config.claim)
                    .await
            }
            // The claim (and its pod and volume) stays for the next call on the key.
            Persistence::Keep => Ok(()),
        }
    }

    async fn park(&self) -> Result<()> {
        // Nothing to stop: the claim keeps its pod until it is deleted or expires.
        self.live().channel = None;
        Ok(())
    }

    #[tracing::instrument(skip(self), fields(backend = BACKEND, claim = %self.config.claim))]
    async fn destroy(&self) -> Result<()> {
        self.live().channel = None;
        self.shared.remove_claim(&self.config.claim).await
    }

    async fn workspace_exists(&self) -> Result<bool> {
        if self.live().lost {
            return Ok(false);
        }
        scripted::root_exists(self).await
    }

    #[tracing::instrument(skip_all, fields(backend = BACKEND, claim = %self.config.claim, program = request.command.program()))]
    async fn exec(&self, request: ExecRequest) -> Result<ExecResult> {
        if self.shared.options.runtime == Runtime::Legacy {
            sandbox_core::ExecFeatures::default().check(BACKEND, &request)?;
            let port = self.shared.options.server_port;
            return legacy::run(
                &self.http(),
                &self.route()?,
                port,
                &self.config.root,
                &request.command.to_argv(&["sh", "-c"]),
                request.limits,
                request
                    .timeout
                    .unwrap_or(self.shared.options.default_timeout),
            )
            .await;
        }
        let cwd = self.resolve_cwd(request.cwd.as_deref())?;
        let mut env = self.base_env();
        for k in request.env.keys() {
            posix::check_env_name(k)?;
        }
        env.extend(request.env);
        sandboxd::run(
            &self.channel().await?,
            &self.who(),
            Command {
                argv: in_dir(&cwd, request.command.to_argv(&["sh", "-c"])),
                env,
                cwd: None,
            },
            request.stdin,
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
        if self.shared.options.runtime == Runtime::Legacy {
            let (rel, port) = self.legacy_file(path)?;
            return legacy::download(&self.http(), &self.route()?, port, &rel).await;
        }
        let (Some(rest), Some(port)) = (self.rest_path(path), self.rest_port()) else {
            return scripted::read_file(self, path).await;
        };
        let route = self.route()?;
        let http = self.http();
        let url = route.url(port, &rest);
        let headers = route.headers(port)?;
        let r = http
            .send(true, || http.client().get(&url).headers(headers.clone()))
            .await?;
        let shown = path.to_box(&self.config.root);
        let r = http.check("read", &shown, r).await?;
        let json = r
            .headers()
            .get(reqwest::header::CONTENT_TYPE)
            .and_then(|v| v.to_str().ok())
            .is_some_and(|v| v.starts_with("application/json"));
        let body = r.bytes().await.map_err(|e| http_read_err(&shown, e))?;
        if json
            && serde_json::from_slice::<serde_json::Value>(&body)
                .ok()
                .is_some_and(|v| v.get("entries").is_some_and(|e| e.is_array()))
        {
            return Err(Error::invalid("file", format!("`{path}` is a directory")));
        }
        if body.len() > READ_LIMIT {
            return Err(Error::invalid(
                "file",
                format!("`{path}` is larger than 1 GiB"),
            ));
        }
        Ok(body)
    }

    async fn write_file(&self, path: &RelPath, data: Bytes, mode: u32) -> Result<()> {
        let bits = mode;
        let mode = format!("{:04o}", mode & 0o7777);
        if self.shared.options.runtime == Runtime::Legacy {
            let (rel, port) = self.legacy_file(path)?;
            legacy::upload(&self.http(), &self.route()?, port, &rel, data).await?;
            return self
                .script(
                    "write",
                    "chmod \"$2\" \"$1\"",
                    vec![path.to_box(&self.config.root), mode],
                )
                .await
                .map(|_| ());
        }
        let (Some(rest), Some(port)) = (self.rest_path(path), self.rest_port()) else {
            return scripted::write_file(self, path, data, bits).await;
        };
        let route = self.route()?;
        let http = self.http();
        let url = format!("{}?mode={mode}", route.url(port, &rest));
        let headers = route.headers(port)?;
        // A PUT of the whole body is idempotent: retried like a read.
        let r = http
            .send(true, || {
                http.client()
                    .put(&url)
                    .headers(headers.clone())
                    .header(reqwest::header::CONTENT_TYPE, "application/octet-stream")
                    .body(data.clone())
            })
            .await?;
        http.check("write", &path.to_box(&self.config.root), r)
            .await
            .map(|_| ())
    }

    async fn remove(&self, paths: &[RelPath]) -> Result<()> {
        scripted::remove(self, paths).await
    }
}

#[async_trait]
impl ScriptRunner for K8sBox {
    fn backend(&self) -> &'static str {
        BACKEND
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
        self.run_script(operation, script, args, limit, errors)
            .await
    }

    async fn stream_script(
        &self,
        _operation: &'static str,
        script: &str,
        args: Vec<String>,
        input: Option<ByteStream>,
        errors: scripted::ExitErrors,
    ) -> Result<ByteStream> {
        K8sBox::stream_script(self, script, args, input, errors).await
    }
}

fn http_read_err(what: &str, e: reqwest::Error) -> Error {
    Error::Unavailable {
        service: "sandbox runtime".into(),
        reason: format!("reading {what}: {e}"),
        source: Some(Box::new(e)),
    }
}

/// A Gateway address as a URL authority: an IPv6 address in brackets; an IPv4 address, a
/// host name or a `host:port` as it is.
fn gateway_host(addr: String) -> String {
    if addr.parse::<std::net::Ipv6Addr>().is_ok() {
        format!("[{addr}]")
    } else {
        addr
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{K8sClient, K8sOptions};

    #[test]
    fn gateway_addresses_become_authorities() {
        assert_eq!(gateway_host("10.0.0.7".into()), "10.0.0.7");
        assert_eq!(gateway_host("gw.example.com".into()), "gw.example.com");
        assert_eq!(gateway_host("127.0.0.1:8080".into()), "127.0.0.1:8080");
        assert_eq!(gateway_host("fd00::1".into()), "[fd00::1]");
    }

    fn boxed(options: K8sOptions, root: &str) -> K8sBox {
        let client = K8sClient::new(options).unwrap();
        let shared = client.shared_for_tests();
        K8sBox::new(
            shared,
            BoxConfig {
                claim: "c".into(),
                root: root.into(),
                key: None,
                persistence: Persistence::Ephemeral,
                spec_env: BTreeMap::from([("TOKEN".to_owned(), "s3cret".to_owned())]),
            },
            None,
            true,
        )
    }

    #[test]
    fn rest_paths_follow_the_file_api_base() {
        let p = RelPath::new("dir/a b.txt").unwrap();
        let b = boxed(K8sOptions::new("pool"), "/workspace");
        assert_eq!(
            b.rest_path(&p).as_deref(),
            Some("/v1/files/dir%2Fa%20b.txt")
        );
        let b = boxed(
            K8sOptions::new("pool").file_api_base_dir(Some("/app".into())),
            "/app/ws",
        );
        assert_eq!(
            b.rest_path(&p).as_deref(),
            Some("/v1/files/ws%2Fdir%2Fa%20b.txt")
        );
        // A root outside the base directory (or no base): files go through commands.
        let b = boxed(
            K8sOptions::new("pool").file_api_base_dir(Some("/app".into())),
            "/application",
        );
        assert_eq!(b.rest_path(&p), None);
        let b = boxed(
            K8sOptions::new("pool").file_api_base_dir(None),
            "/workspace",
        );
        assert_eq!(b.rest_path(&p), None);
    }

    #[test]
    fn config_debug_hides_env_values() {
        let b = boxed(K8sOptions::new("pool"), "/workspace");
        let shown = format!("{:?}", b.config);
        assert!(
            shown.contains("TOKEN") && !shown.contains("s3cret"),
            "{shown}"
        );
    }
}
