//! The control plane: claims, Sandboxes and Gateways through the Kubernetes API (kube).
//!
//! Idempotent calls (get, list, delete, and create under a name chosen before the first
//! attempt, whose 409 is resolved by reading the claim) are retried on connect errors and API
//! 5xx with exponential backoff and jitter. Waiting for Ready is a watch on the claim's name
//! that resumes from the last resourceVersion, starts over from a fresh read on 410 Gone,
//! fails fast on the terminal reasons, and is bounded by `ready_timeout`.

use std::future::Future;
use std::sync::Mutex;
use std::time::Duration;

use futures::{StreamExt, TryStreamExt};
use kube::api::{Api, DeleteParams, ListParams, PostParams, WatchEvent, WatchParams};
use kube::core::DynamicObject;
use sandbox_core::{Error, Result};

use crate::BACKEND;
use crate::crd::{self, ClaimStatus};

/// Longest single watch request (the server ends it; the loop resumes).
const WATCH_SECONDS: u32 = 60;

/// Pause before retry `attempt` (0-based): 200 ms doubling to 5 s, with ±50 % jitter.
pub(crate) fn backoff(attempt: u32) -> Duration {
    let base = 200u64.saturating_mul(1 << attempt.min(5)).min(5_000);
    Duration::from_millis(base / 2 + fastrand::u64(0..=base))
}

/// Whether a kube error may pass on retry (nothing was applied, or the call is idempotent).
fn transient(e: &kube::Error) -> bool {
    match e {
        kube::Error::Api(s) => matches!(s.code, 429 | 500 | 502 | 503 | 504),
        kube::Error::HyperError(_) | kube::Error::Service(_) => true,
        _ => false,
    }
}

fn api_code(e: &kube::Error) -> Option<u16> {
    match e {
        kube::Error::Api(s) => Some(s.code),
        _ => None,
    }
}

/// The API server's words for a failed call, as core's error.
pub(crate) fn map_err(api_url: &str, operation: &'static str, what: &str, e: kube::Error) -> Error {
    match &e {
        kube::Error::Api(s) => match s.code {
            404 => Error::NotFound {
                what: "kubernetes object",
                key: what.to_owned(),
            },
            409 => Error::Conflict {
                key: what.to_owned(),
                reason: s.message.clone(),
            },
            400 | 422 => Error::InvalidInput {
                what: "kubernetes object",
                reason: format!("{what}: {}", s.message),
            },
            429 | 500..=599 => Error::Unavailable {
                service: format!("kubernetes API at {api_url}"),
                reason: format!("{operation} {what}: {} {}", s.code, s.message),
                source: Some(Box::new(e)),
            },
            _ => Error::Backend {
                backend: BACKEND,
                operation,
                message: format!("{what}: {} {}", s.code, s.message),
                source: Some(Box::new(e)),
            },
        },
        kube::Error::HyperError(_) | kube::Error::Service(_) => Error::Unavailable {
            service: format!("kubernetes API at {api_url}"),
            reason: format!("{operation} {what}: {e}"),
            source: Some(Box::new(e)),
        },
        _ => Error::Backend {
            backend: BACKEND,
            operation,
            message: format!("{what}: {e}"),
            source: Some(Box::new(e)),
        },
    }
}

/// The claim, Sandbox and Gateway APIs of one namespace.
#[derive(Clone)]
pub(crate) struct Control {
    pub client: kube::Client,
    pub api_url: String,
    pub namespace: String,
    claims: Api<DynamicObject>,
    sandboxes: Api<DynamicObject>,
    retries: u32,
}

impl std::fmt::Debug for Control {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Control")
            .field("api_url", &self.api_url)
            .field("namespace", &self.namespace)
            .finish_non_exhaustive()
    }
}

impl Control {
    pub(crate) fn new(
        client: kube::Client,
        api_url: String,
        namespace: &str,
        retries: u32,
    ) -> Self {
        Control {
            claims: Api::namespaced_with(client.clone(), namespace, &crd::claim_resource()),
            sandboxes: Api::namespaced_with(client.clone(), namespace, &crd::sandbox_resource()),
            client,
            api_url,
            namespace: namespace.to_owned(),
            retries,
        }
    }

    /// Run an idempotent call, retrying transient failures.
    async fn retry<T, F, Fut>(&self, operation: &'static str, what: &str, f: F) -> Result<T>
    where
        F: Fn() -> Fut,
        Fut: Future<Output = kube::Result<T>>,
    {
        let mut attempt = 0;
        loop {
            match f().await {
                Ok(v) => return Ok(v),
                Err(e) if transient(&e) && attempt + 1 < self.retries => {
                    tracing::debug!(operation, what, attempt, error = %e, "retrying a kubernetes call");
                    tokio::time::sleep(backoff(attempt)).await;
                    attempt += 1;
                }
                Err(e) => return Err(map_err(&self.api_url, operation, what, e)),
            }
        }
    }

    /// The claim `name`, if it exists.
    pub(crate) async fn get_claim(&self, name: &str) -> Result<Option<DynamicObject>> {
        self.retry("get claim", name, || self.claims.get_opt(name))
            .await
    }

    /// Create `claim`; if one of its name exists already, return that one (the caller checks
    /// its owner). `created` tells which.
    pub(crate) async fn create_claim(
        &self,
        claim: &DynamicObject,
    ) -> Result<(DynamicObject, bool)> {
        let name = claim.metadata.name.clone().unwrap_or_default();
        let mut attempt = 0;
        loop {
            match self.claims.create(&PostParams::default(), claim).await {
                Ok(c) => {
                    tracing::info!(claim = %name, namespace = %self.namespace, "claim created");
                    return Ok((c, true));
                }
                // Ours from an earlier attempt whose answer was lost, or someone else's: the
                // caller decides by the owner label.
                Err(e) if api_code(&e) == Some(409) => {
                    return match self.get_claim(&name).await? {
                        Some(c) => Ok((c, false)),
                        None => Err(map_err(&self.api_url, "create claim", &name, e)),
                    };
                }
                Err(e) if transient(&e) && attempt + 1 < self.retries => {
                    tracing::debug!(claim = %name, attempt, error = %e, "retrying claim creation");
                    tokio::time::sleep(backoff(attempt)).await;
                    attempt += 1;
                }
                Err(e) => return Err(map_err(&self.api_url, "create claim", &name, e)),
            }
        }
    }

    /// Delete the claim `name` (its Sandbox and pod go with it); gone already is fine.
    pub(crate) async fn delete_claim(&self, name: &str) -> Result<()> {
        let params = DeleteParams::background();
        let res = self
            .retry("delete claim", name, || async {
                match self.claims.delete(name, &params).await {
                    Ok(_) => Ok(()),
                    Err(e) if api_code(&e) == Some(404) => Ok(()),
                    Err(e) => Err(e),
                }
            })
            .await;
        if res.is_ok() {
            tracing::info!(claim = %name, namespace = %self.namespace, "claim deleted");
        }
        res
    }

    /// Wait until the claim `name` is gone (its deletion may take a while).
    pub(crate) async fn wait_gone(&self, name: &str, timeout: Duration) -> Result<()> {
        let wait = async {
            let mut attempt = 0;
            while self.get_claim(name).await?.is_some() {
                tokio::time::sleep(backoff(attempt.min(2))).await;
                attempt += 1;
            }
            Ok(())
        };
        tokio::time::timeout(timeout, wait)
            .await
            .map_err(|_| Error::Timeout {
                operation: format!("deletion of claim `{name}`"),
                after: timeout,
            })?
    }

    /// The claims carrying `selector`.
    pub(crate) async fn list_claims(&self, selector: &str) -> Result<Vec<DynamicObject>> {
        let params = ListParams::default().labels(selector);
        self.retry("list claims", selector, || self.claims.list(&params))
            .await
            .map(|l| l.items)
    }

    /// The Sandbox `name`, if it exists.
    pub(crate) async fn get_sandbox(&self, name: &str) -> Result<Option<crd::SandboxInfo>> {
        let s = self
            .retry("get sandbox", name, || self.sandboxes.get_opt(name))
            .await?;
        s.as_ref().map(crd::sandbox_info).transpose()
    }

    /// The first address of the Gateway `name` in `namespace`.
    pub(crate) async fn gateway_address(&self, name: &str, namespace: &str) -> Result<String> {
        let api: Api<DynamicObject> =
            Api::namespaced_with(self.client.clone(), namespace, &crd::gateway_resource());
        let g = self
            .retry("get gateway", name, || api.get_opt(name))
            .await?
            .ok_or_else(|| Error::NotFound {
                what: "gateway",
                key: format!("{namespace}/{name}"),
            })?;
        crd::gateway_address(&g).ok_or_else(|| Error::Unavailable {
            service: format!("gateway {namespace}/{name}"),
            reason: "no address in its status yet".into(),
            source: None,
        })
    }

    /// Wait for the claim `name` to be Ready and bound; returns the Sandbox's name and the
    /// claim as last seen.
    pub(crate) async fn wait_ready(
        &self,
        name: &str,
        timeout: Duration,
    ) -> Result<(String, DynamicObject)> {
        let last = Mutex::new(None::<String>);
        match tokio::time::timeout(timeout, self.watch_ready(name, &last)).await {
            Ok(r) => r,
            Err(_) => Err(Error::Timeout {
                operation: format!(
                    "claim `{name}` becoming Ready (last reason: {})",
                    last.lock().expect("last").as_deref().unwrap_or("none")
                ),
                after: timeout,
            }),
        }
    }

    async fn watch_ready(
        &self,
        name: &str,
        last: &Mutex<Option<String>>,
    ) -> Result<(String, DynamicObject)> {
        let seen = |claim: DynamicObject| -> Result<Option<(String, DynamicObject)>> {
            match crd::claim_status(&claim) {
                ClaimStatus::Bound(sandbox) => Ok(Some((sandbox, claim))),
                ClaimStatus::Pending(reason) => {
                    *last.lock().expect("last") = reason;
                    Ok(None)
                }
                ClaimStatus::Failed { reason, message } => {
                    Err(crd::claim_failure(name, &reason, &message))
                }
            }
        };
        let gone = || Error::NotFound {
            what: "sandbox claim",
            key: format!("{}/{name}", self.namespace),
        };
        let fields = format!("metadata.name={name}");
        let mut version: Option<String> = None;
        let mut failures = 0u32;
        loop {
            // A fresh start (first, or after 410 Gone): read the claim, then watch from there.
            let rv = match &version {
                Some(v) => v.clone(),
                None => {
                    let claim = self.get_claim(name).await?.ok_or_else(gone)?;
                    let rv = claim.metadata.resource_version.clone().unwrap_or_default();
                    if let Some(done) = seen(claim)? {
                        return Ok(done);
                    }
                    version = Some(rv.clone());
                    rv
                }
            };
            let params = WatchParams::default()
                .fields(&fields)
                .timeout(WATCH_SECONDS);
            let stream = match self.claims.watch(&params, &rv).await {
                Ok(s) => s,
                Err(e) if transient(&e) && failures + 1 < self.retries.max(3) * 4 => {
                    tracing::debug!(claim = name, error = %e, "watch did not start; retrying");
                    tokio::time::sleep(backoff(failures)).await;
                    failures += 1;
                    continue;
                }
                Err(e) if api_code(&e) == Some(410) => {
                    version = None;
                    continue;
                }
                Err(e) => return Err(map_err(&self.api_url, "watch claim", name, e)),
            };
            let mut stream = std::pin::pin!(stream.into_stream());
            while let Some(event) = stream.next().await {
                match event {
                    Ok(WatchEvent::Added(o)) | Ok(WatchEvent::Modified(o)) => {
                        failures = 0;
                        version = o.metadata.resource_version.clone().or(version);
                        if let Some(done) = seen(o)? {
                            return Ok(done);
                        }
                    }
                    Ok(WatchEvent::Deleted(_)) => return Err(gone()),
                    Ok(WatchEvent::Bookmark(b)) => {
                        version = Some(b.metadata.resource_version);
                    }
                    Ok(WatchEvent::Error(s)) if s.code == 410 => {
                        tracing::debug!(claim = name, "watch expired (410 Gone): starting over");
                        version = None;
                        break;
                    }
                    Ok(WatchEvent::Error(s)) => {
                        tracing::debug!(claim = name, code = s.code, message = %s.message, "watch error event");
                        tokio::time::sleep(backoff(failures)).await;
                        failures += 1;
                        break;
                    }
                    Err(e) => {
                        // A dropped connection: resume from the last version seen.
                        tracing::debug!(claim = name, error = %e, "watch stream broke; resuming");
                        tokio::time::sleep(backoff(failures)).await;
                        failures += 1;
                        break;
                    }
                }
            }
        }
    }
}
