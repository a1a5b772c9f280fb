//! Sandboxes (Docker containers running sandboxd), snapshots (committed images) and the
//! processes envd runs through sandboxd's gRPC `ProcessService`.

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use chrono::{DateTime, Utc};
use e2b_envd_proto::process::{self as ep, process_event};
use sandboxd_proto::{self as sp, ProcessServiceClient};
use tokio::sync::{broadcast, watch};
use tonic::transport::{Channel, Endpoint};

use crate::faults::Faults;

/// Lock a std mutex, ignoring poisoning (a panicked holder left consistent data).
pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// The E2B-visible state of a sandbox.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum State {
    Running,
    Paused,
}

impl State {
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            State::Running => "running",
            State::Paused => "paused",
        }
    }
}

/// Mutable part of a sandbox.
#[derive(Debug)]
pub(crate) struct Inner {
    pub state: State,
    pub end_at: DateTime<Utc>,
    /// The last timeout set (create or `/timeout`): what a resume without one gets.
    pub timeout: Duration,
    pub envd_token: Option<String>,
    pub auto_pause: bool,
}

/// One sandbox.
pub(crate) struct Sandbox {
    pub id: String,
    pub template_id: String,
    pub alias: Option<String>,
    pub client_id: String,
    pub container: String,
    pub ip: String,
    pub started_at: DateTime<Utc>,
    pub metadata: BTreeMap<String, String>,
    pub inner: Mutex<Inner>,
    pub procs: Mutex<HashMap<u32, Arc<Proc>>>,
    pub grpc: Channel,
    pub http: reqwest::Client,
}

impl Sandbox {
    pub(crate) fn rest_url(&self) -> String {
        format!("http://{}:{}", self.ip, sp::DEFAULT_REST_PORT)
    }

    pub(crate) fn client(&self) -> ProcessServiceClient<Channel> {
        ProcessServiceClient::new(self.grpc.clone())
    }

    pub(crate) fn state(&self) -> State {
        lock(&self.inner).state
    }
}

/// A snapshot: a committed image.
#[derive(Debug, Clone)]
pub(crate) struct Snapshot {
    pub id: String,
    pub image: String,
    pub names: Vec<String>,
    pub sandbox_id: String,
    pub created: DateTime<Utc>,
}

/// A process started through envd.
pub(crate) struct Proc {
    pub pid: u32,
    pub config: ep::ProcessConfig,
    pub tag: Option<String>,
    pub events: broadcast::Sender<ep::ProcessEvent>,
    /// The last signal envd sent it (reported as `signal: killed` when it dies of it).
    pub signalled: Mutex<Option<ep::Signal>>,
}

/// State shared by the API, envd and the reaper.
pub(crate) struct Shared {
    pub api_key: String,
    pub domain: String,
    pub envd_version: String,
    pub image: String,
    pub owner: test_docker::Owner,
    pub network: String,
    pub sandboxes: Mutex<BTreeMap<String, Arc<Sandbox>>>,
    pub snapshots: Mutex<BTreeMap<String, Snapshot>>,
    pub faults: Faults,
    /// `docker run`s in flight (the cleanup sweeps again for their containers).
    pub starting: AtomicUsize,
}

/// Where a template resolves to.
pub(crate) struct Resolved {
    pub image: String,
    pub template_id: String,
    pub alias: Option<String>,
}

/// Why a sandbox could not be created.
#[derive(Debug)]
pub(crate) enum CreateError {
    Docker(String),
    NotReady(String),
}

impl std::fmt::Display for CreateError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            CreateError::Docker(m) => write!(f, "starting the sandbox failed: {m}"),
            CreateError::NotReady(m) => write!(f, "the sandbox did not become ready: {m}"),
        }
    }
}

/// What a new sandbox gets.
pub(crate) struct NewSandbox {
    pub resolved: Resolved,
    pub timeout: Duration,
    pub metadata: BTreeMap<String, String>,
    pub env_vars: BTreeMap<String, String>,
    pub secure: bool,
    pub auto_pause: bool,
}

impl Shared {
    pub(crate) fn new(
        api_key: String,
        domain: String,
        envd_version: String,
        image: String,
        owner: test_docker::Owner,
        network: String,
    ) -> Self {
        Self {
            api_key,
            domain,
            envd_version,
            image,
            owner,
            network,
            sandboxes: Mutex::default(),
            snapshots: Mutex::default(),
            faults: Faults::default(),
            starting: AtomicUsize::new(0),
        }
    }

    pub(crate) fn get(&self, id: &str) -> Option<Arc<Sandbox>> {
        lock(&self.sandboxes).get(id).cloned()
    }

    /// The image of a template id: `base` (and its E2B id `rki5dems9wqfm4r03t7g`, harmlessly),
    /// or a snapshot by id or name.
    pub(crate) fn resolve_template(&self, template: &str) -> Option<Resolved> {
        if template == "base" {
            return Some(Resolved {
                image: self.image.clone(),
                template_id: "base".to_owned(),
                alias: Some("base".to_owned()),
            });
        }
        let snaps = lock(&self.snapshots);
        snaps
            .values()
            .find(|s| s.id == template || s.names.iter().any(|n| n == template))
            .map(|s| Resolved {
                image: s.image.clone(),
                template_id: s.id.clone(),
                alias: None,
            })
    }

    /// Start a container, wait for sandboxd, register the sandbox.
    pub(crate) async fn create(&self, new: NewSandbox) -> Result<Arc<Sandbox>, CreateError> {
        let id = crate::random_lower(20);
        let mut env: Vec<(String, String)> = vec![("SANDBOX_BASE_DIR".into(), "/".into())];
        env.extend(new.env_vars);
        let spec = test_docker::ContainerSpec {
            name: format!("e2bts-{}-{id}", self.owner.id()),
            image: new.resolved.image.clone(),
            env,
            labels: vec![(format!("{}.sandbox", crate::LABEL), id.clone())],
            ..Default::default()
        };
        self.starting.fetch_add(1, Ordering::SeqCst);
        let started = self.owner.run(&spec, &self.network).await;
        self.starting.fetch_sub(1, Ordering::SeqCst);
        let started = started.map_err(|e| CreateError::Docker(e.0))?;
        let ready = wait_ready(&started.ip).await;
        let grpc = match ready {
            Ok(c) => c,
            Err(e) => {
                let _ = test_docker::remove(&started.id).await;
                return Err(CreateError::NotReady(e));
            }
        };
        // E2B's default user `user` has the home /home/user (the default cwd).
        let mut client = ProcessServiceClient::new(grpc.clone());
        let _ = client
            .execute(sp::ExecuteRequest {
                config: Some(sp::ProcessConfig::new(["mkdir", "-p", "/home/user"])),
            })
            .await;
        let now = Utc::now();
        let sb = Arc::new(Sandbox {
            id: id.clone(),
            template_id: new.resolved.template_id,
            alias: new.resolved.alias,
            client_id: "e2b-testserver".to_owned(),
            container: started.id,
            ip: started.ip,
            started_at: now,
            metadata: new.metadata,
            inner: Mutex::new(Inner {
                state: State::Running,
                end_at: now + new.timeout,
                timeout: new.timeout,
                envd_token: new.secure.then(|| crate::random_string(32)),
                auto_pause: new.auto_pause,
            }),
            procs: Mutex::default(),
            grpc,
            http: reqwest::Client::new(),
        });
        lock(&self.sandboxes).insert(id, sb.clone());
        Ok(sb)
    }

    /// Remove the container behind the API's back.
    pub(crate) async fn disappear(&self, id: &str) -> Result<(), crate::Error> {
        let sb = self
            .get(id)
            .ok_or_else(|| crate::Error::NotFound(id.to_owned()))?;
        Ok(test_docker::remove(&sb.container).await?)
    }

    /// A new envd access token for a sandbox.
    pub(crate) fn rotate_envd_token(&self, id: &str) -> Result<String, crate::Error> {
        let sb = self
            .get(id)
            .ok_or_else(|| crate::Error::NotFound(id.to_owned()))?;
        let token = crate::random_string(32);
        lock(&sb.inner).envd_token = Some(token.clone());
        Ok(token)
    }

    /// Remove a sandbox and its container; false when there was none. The container goes
    /// first, so a sandbox the API no longer knows has no container left.
    pub(crate) async fn kill(&self, id: &str) -> bool {
        let Some(sb) = self.get(id) else {
            return false;
        };
        if let Err(e) = test_docker::remove(&sb.container).await {
            tracing::warn!(error = %e, sandbox = id, "removing a sandbox's container");
        }
        lock(&self.sandboxes).remove(id).is_some()
    }
}

/// Wait until sandboxd answers on REST and gRPC (up to 30 s).
async fn wait_ready(ip: &str) -> Result<Channel, String> {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    let http = reqwest::Client::new();
    let health = format!("http://{ip}:{}/v1/health", sp::DEFAULT_REST_PORT);
    let grpc_uri = format!("http://{ip}:{}", sp::DEFAULT_GRPC_PORT);
    let endpoint = Endpoint::from_shared(grpc_uri.clone())
        .map_err(|e| e.to_string())?
        .connect_timeout(Duration::from_secs(2))
        .tcp_nodelay(true);
    let mut last = String::new();
    while tokio::time::Instant::now() < deadline {
        let ok = http
            .get(&health)
            .timeout(Duration::from_secs(2))
            .send()
            .await
            .map(|r| r.status().is_success());
        match ok {
            Ok(true) => match endpoint.connect().await {
                Ok(c) => return Ok(c),
                Err(e) => last = format!("gRPC {grpc_uri}: {e}"),
            },
            Ok(false) => last = format!("{health} answered an error"),
            Err(e) => last = format!("{health}: {e}"),
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    Err(last)
}

/// Kill (or pause, with auto-pause) the sandboxes whose end time passed, like E2B does.
pub(crate) async fn reaper(shared: Arc<Shared>, every: Duration, mut stop: watch::Receiver<bool>) {
    loop {
        tokio::select! {
            _ = tokio::time::sleep(every) => {}
            _ = stop.wait_for(|s| *s) => return,
        }
        let now = Utc::now();
        let expired: Vec<(Arc<Sandbox>, bool)> = lock(&shared.sandboxes)
            .values()
            .filter_map(|sb| {
                let inner = lock(&sb.inner);
                (inner.state == State::Running && inner.end_at <= now)
                    .then(|| (sb.clone(), inner.auto_pause))
            })
            .collect();
        for (sb, auto_pause) in expired {
            if auto_pause {
                tracing::debug!(sandbox = %sb.id, "timeout reached: pausing");
                if test_docker::pause(&sb.container).await.is_ok() {
                    lock(&sb.inner).state = State::Paused;
                }
            } else {
                tracing::debug!(sandbox = %sb.id, "timeout reached: killing");
                shared.kill(&sb.id).await;
            }
        }
    }
}

/// The `EndEvent` of a process that sandboxd reports as exited with `code` (`128 + n` for
/// signal `n`), given the signal envd sent it.
pub(crate) fn end_event(code: i32, signalled: Option<ep::Signal>) -> process_event::EndEvent {
    let by_signal = signalled.filter(|s| code == 128 + *s as i32);
    match by_signal {
        Some(s) => process_event::EndEvent {
            exit_code: -1,
            exited: false,
            status: match s {
                ep::Signal::Sigterm => "signal: terminated".to_owned(),
                _ => "signal: killed".to_owned(),
            },
            error: None,
        },
        None => process_event::EndEvent {
            exit_code: code,
            exited: true,
            status: format!("exit status {code}"),
            error: None,
        },
    }
}

/// Why envd could not start a process.
pub(crate) enum StartError {
    /// sandboxd refused (its gRPC status).
    Status(tonic::Status),
}

/// Start a process through sandboxd; its table entry and the first event receiver (subscribed
/// before any event is sent). A background task reads sandboxd's stream until the process
/// exits, so the process outlives the client's stream, as in E2B.
pub(crate) async fn start_process(
    sb: &Arc<Sandbox>,
    req: ep::StartRequest,
) -> Result<(Arc<Proc>, broadcast::Receiver<ep::ProcessEvent>), StartError> {
    let config = req.process.clone().unwrap_or_default();
    let mut argv = vec![config.cmd.clone()];
    argv.extend(config.args.iter().cloned());
    let cwd = config
        .cwd
        .clone()
        .filter(|c| !c.is_empty())
        .unwrap_or_else(|| "/home/user".to_owned());
    let sconfig = sp::ProcessConfig {
        command: argv,
        env_vars: config.envs.clone(),
        cwd: Some(cwd),
    };
    let mut client = sb.client();
    let mut stream = client
        .start(sp::StartRequest {
            config: Some(sconfig),
            pty: None,
        })
        .await
        .map_err(StartError::Status)?
        .into_inner();
    // The first event is sandboxd's init with its process id (our pid).
    let first = stream.message().await.map_err(StartError::Status)?;
    let pid = match first.and_then(|m| m.event) {
        Some(sp::start_response::Event::Init(i)) => i.process_id as u32,
        _ => {
            return Err(StartError::Status(tonic::Status::internal(
                "sandboxd sent no init event",
            )));
        }
    };
    let stdin_open = req.stdin.unwrap_or(true);
    if !stdin_open {
        let _ = client
            .write_stdin(sp::WriteStdinRequest {
                process_id: pid as i32,
                payload: Some(sp::write_stdin_request::Payload::Eof(())),
            })
            .await;
    }
    let (tx, rx) = broadcast::channel(4096);
    let proc = Arc::new(Proc {
        pid,
        config,
        tag: req.tag.clone(),
        events: tx.clone(),
        signalled: Mutex::new(None),
    });
    lock(&sb.procs).insert(pid, proc.clone());
    let _ = tx.send(ep::ProcessEvent {
        event: Some(process_event::Event::Start(process_event::StartEvent {
            pid,
        })),
    });
    let sbc = sb.clone();
    let procc = proc.clone();
    tokio::spawn(async move {
        let data = |o| ep::ProcessEvent {
            event: Some(process_event::Event::Data(process_event::DataEvent {
                output: Some(o),
            })),
        };
        let end = loop {
            match stream.message().await {
                Ok(Some(m)) => match m.event {
                    Some(sp::start_response::Event::Stdout(b)) => {
                        let _ = tx.send(data(process_event::Output::Stdout(b)));
                    }
                    Some(sp::start_response::Event::Stderr(b)) => {
                        let _ = tx.send(data(process_event::Output::Stderr(b)));
                    }
                    Some(sp::start_response::Event::Exit(e)) => {
                        break end_event(e.exit_code, *lock(&procc.signalled));
                    }
                    _ => {}
                },
                Ok(None) => {
                    break process_event::EndEvent {
                        exit_code: -1,
                        exited: false,
                        status: "unknown".into(),
                        error: Some("the process stream ended without an exit".into()),
                    };
                }
                Err(e) => {
                    break process_event::EndEvent {
                        exit_code: -1,
                        exited: false,
                        status: "unknown".into(),
                        error: Some(format!("lost the process: {}", e.message())),
                    };
                }
            }
        };
        lock(&sbc.procs).remove(&procc.pid);
        let _ = tx.send(ep::ProcessEvent {
            event: Some(process_event::Event::End(end)),
        });
    });
    Ok((proc, rx))
}

/// Send `signal` to a process (its whole group, through sandboxd).
pub(crate) async fn signal_process(
    sb: &Sandbox,
    proc: &Proc,
    signal: ep::Signal,
) -> Result<(), tonic::Status> {
    let ssig = match signal {
        ep::Signal::Sigkill => sp::Signal::Sigkill,
        ep::Signal::Sigterm => sp::Signal::Sigterm,
        ep::Signal::Unspecified => {
            return Err(tonic::Status::invalid_argument("signal is not set"));
        }
    };
    *lock(&proc.signalled) = Some(signal);
    sb.client()
        .send_signal(sp::SendSignalRequest {
            process_id: proc.pid as i32,
            signal: ssig as i32,
        })
        .await
        .map(drop)
}

/// Find a process by selector.
pub(crate) fn find_proc(sb: &Sandbox, sel: Option<&ep::ProcessSelector>) -> Option<Arc<Proc>> {
    use ep::process_selector::Selector;
    let procs = lock(&sb.procs);
    match sel.and_then(|s| s.selector.as_ref())? {
        Selector::Pid(pid) => procs.get(pid).cloned(),
        Selector::Tag(tag) => procs
            .values()
            .find(|p| p.tag.as_deref() == Some(tag.as_str()))
            .cloned(),
    }
}

/// Run a shell script in the sandbox (`sh -c script sh args…`); exit code, stdout, stderr.
pub(crate) async fn sh(
    sb: &Sandbox,
    script: &str,
    args: &[&str],
) -> Result<(i32, Vec<u8>, Vec<u8>), tonic::Status> {
    let mut argv = vec!["/bin/sh", "-c", script, "sh"];
    argv.extend_from_slice(args);
    let r = sb
        .client()
        .execute(sp::ExecuteRequest {
            config: Some(sp::ProcessConfig::new(argv)),
        })
        .await?
        .into_inner();
    Ok((r.exit_code, r.stdout, r.stderr))
}
