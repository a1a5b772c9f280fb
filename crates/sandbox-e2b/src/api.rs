//! The E2B control plane (`X-API-Key`): sandboxes, their timeout, pause and connect,
//! snapshots, and the owner-filtered listing. Typed statuses and retries are
//! sandbox-cloud's; the only non-idempotent call, create, is made safe here by a creation tag
//! (see [`Api::create`]).

use std::collections::BTreeMap;
use std::fmt;
use std::time::Duration;

use sandbox_cloud::{Http, Idempotency, Secret};
use sandbox_core::{Error, ErrorKind, Result};
use serde::{Deserialize, Serialize};

use crate::BACKEND;

/// Metadata key of the tag that names one create request (a uuid), so a create whose answer
/// was lost can be found again instead of made twice.
pub const CREATION_TAG: &str = "io.sandbox-harness.creation";

/// How many times a create is sent when its answer is lost and no sandbox carries its tag.
const CREATE_ATTEMPTS: u32 = 3;

/// How many times the sandboxes are listed by creation tag after a lost answer, and the pause
/// between listings (the lost request may still be at work).
const CREATE_LOOKUPS: u32 = 3;
const LOOKUP_PAUSE: Duration = Duration::from_secs(1);

/// A sandbox as the API describes it. `Debug` hides the envd token.
#[derive(Clone)]
pub(crate) struct Sandbox {
    pub id: String,
    pub template: String,
    pub envd_version: Option<String>,
    pub token: Option<Secret>,
    pub domain: Option<String>,
    pub metadata: BTreeMap<String, String>,
    pub state: Option<String>,
}

impl fmt::Debug for Sandbox {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Sandbox")
            .field("id", &self.id)
            .field("template", &self.template)
            .field("envd_version", &self.envd_version)
            .field("token", &self.token.as_ref().map(|_| "***"))
            .field("domain", &self.domain)
            .field("state", &self.state)
            .finish_non_exhaustive()
    }
}

/// The wire shape of `Sandbox`, `SandboxDetail` and `ListedSandbox`.
#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct RawSandbox {
    #[serde(rename = "sandboxID")]
    sandbox_id: String,
    #[serde(rename = "templateID", default)]
    template_id: String,
    #[serde(default)]
    envd_version: Option<String>,
    #[serde(default)]
    envd_access_token: Option<String>,
    #[serde(default)]
    domain: Option<String>,
    #[serde(default)]
    metadata: Option<BTreeMap<String, String>>,
    #[serde(default)]
    state: Option<String>,
}

impl From<RawSandbox> for Sandbox {
    fn from(r: RawSandbox) -> Self {
        Sandbox {
            id: r.sandbox_id,
            template: r.template_id,
            envd_version: r.envd_version,
            token: r
                .envd_access_token
                .filter(|t| !t.is_empty())
                .map(Secret::new),
            domain: r.domain.filter(|d| !d.is_empty()),
            metadata: r.metadata.unwrap_or_default(),
            state: r.state,
        }
    }
}

#[derive(Serialize)]
#[serde(rename_all = "camelCase")]
struct NewSandbox<'a> {
    #[serde(rename = "templateID")]
    template_id: &'a str,
    timeout: u64,
    metadata: &'a BTreeMap<String, String>,
    env_vars: &'a BTreeMap<String, String>,
    secure: bool,
    auto_pause: bool,
}

/// What a new sandbox is made of.
pub(crate) struct CreateSpec<'a> {
    pub template: &'a str,
    pub timeout: Duration,
    pub metadata: BTreeMap<String, String>,
    pub env: &'a BTreeMap<String, String>,
    pub secure: bool,
}

/// The control plane.
#[derive(Clone)]
pub(crate) struct Api {
    http: Http,
    /// Without user info (sent as basic auth: [`BaseUrl`]).
    base: sandbox_cloud::BaseUrl,
    key: Secret,
}

impl fmt::Debug for Api {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Api")
            .field("base", &self.base)
            .finish_non_exhaustive()
    }
}

fn secs(d: Duration) -> u64 {
    d.as_secs().max(1)
}

/// `Ok(None)` for a 404.
fn found<T>(r: Result<T>) -> Result<Option<T>> {
    match r {
        Ok(v) => Ok(Some(v)),
        Err(Error::NotFound { .. }) => Ok(None),
        Err(e) => Err(e),
    }
}

impl Api {
    pub(crate) fn new(base: &str, key: Secret, options: sandbox_cloud::HttpOptions) -> Result<Api> {
        let base = sandbox_cloud::BaseUrl::new(base);
        let http = Http::new(BACKEND, format!("e2b api at {base}"), options)?;
        Ok(Api { http, base, key })
    }

    fn url(&self, path: &str) -> String {
        self.base.join(path)
    }

    fn req(
        &self,
        client: &reqwest::Client,
        method: reqwest::Method,
        url: &str,
    ) -> reqwest::RequestBuilder {
        self.base
            .apply(client.request(method, url))
            .header("X-API-Key", self.key.expose())
    }

    async fn create_once(&self, spec: &CreateSpec<'_>) -> Result<Sandbox> {
        let body = NewSandbox {
            template_id: spec.template,
            timeout: secs(spec.timeout),
            metadata: &spec.metadata,
            env_vars: spec.env,
            secure: spec.secure,
            auto_pause: false,
        };
        let url = self.url("/sandboxes");
        let raw: RawSandbox = self
            .http
            .json("create sandbox", Idempotency::NotIdempotent, |c| {
                self.req(c, reqwest::Method::POST, &url).json(&body)
            })
            .await?;
        Ok(raw.into())
    }

    /// Make a sandbox. Its metadata carries a fresh [`CREATION_TAG`]; when the answer is lost
    /// (a 5xx, a timeout, a cut connection: the sandbox may exist), the sandboxes carrying
    /// that tag are listed first, and one found is adopted instead of making another.
    #[tracing::instrument(skip_all, fields(backend = BACKEND, template = spec.template))]
    pub(crate) async fn create(&self, mut spec: CreateSpec<'_>) -> Result<Sandbox> {
        let tag = uuid::Uuid::new_v4().simple().to_string();
        spec.metadata.insert(CREATION_TAG.into(), tag.clone());
        let mut attempt = 0;
        loop {
            attempt += 1;
            let err = match self.create_once(&spec).await {
                Ok(s) => {
                    tracing::info!(sandbox = %s.id, "sandbox created");
                    return Ok(s);
                }
                Err(e) => e,
            };
            if matches!(
                err.kind(),
                ErrorKind::InvalidInput | ErrorKind::Unauthorized | ErrorKind::NotSupported
            ) || matches!(err, Error::RateLimited { .. } | Error::Conflict { .. })
            {
                return Err(err);
            }
            tracing::warn!(error = %err, attempt, "create's answer was lost: looking for a sandbox with its creation tag");
            let filter = BTreeMap::from([(CREATION_TAG.to_owned(), tag.clone())]);
            // The lost request may still be making the sandbox: look a few times.
            for lookup in 0..CREATE_LOOKUPS {
                if lookup > 0 {
                    tokio::time::sleep(LOOKUP_PAUSE).await;
                }
                let found = match self.list(&filter).await {
                    Ok(found) => found,
                    Err(e) => {
                        // Not knowing whether it exists, making another could leak one: stop.
                        tracing::warn!(error = %e, "listing by creation tag failed");
                        return Err(err);
                    }
                };
                if let Some(s) = found.into_iter().next() {
                    tracing::info!(sandbox = %s.id, "adopting the sandbox the lost create made");
                    // The listing has no token: the detail has.
                    return match self.get(&s.id).await? {
                        Some(d) => Ok(d),
                        None => Err(Error::Unavailable {
                            service: format!("e2b api at {}", self.base),
                            reason: format!("sandbox {} vanished right after create", s.id),
                            source: None,
                        }),
                    };
                }
            }
            if attempt >= CREATE_ATTEMPTS {
                return Err(err);
            }
            tokio::time::sleep(Duration::from_millis(200 * u64::from(attempt))).await;
        }
    }

    /// A sandbox's detail (with its envd token); `None` when it is gone.
    pub(crate) async fn get(&self, id: &str) -> Result<Option<Sandbox>> {
        let url = self.url(&format!("/sandboxes/{}", seg(id)));
        let raw = found(
            self.http
                .json::<RawSandbox>("get sandbox", Idempotency::Idempotent, |c| {
                    self.req(c, reqwest::Method::GET, &url)
                })
                .await,
        )?;
        Ok(raw.map(Sandbox::from))
    }

    /// Kill a sandbox; `false` when it was gone.
    pub(crate) async fn delete(&self, id: &str) -> Result<bool> {
        let url = self.url(&format!("/sandboxes/{}", seg(id)));
        let r = found(
            self.http
                .send("delete sandbox", Idempotency::Idempotent, |c| {
                    self.req(c, reqwest::Method::DELETE, &url)
                })
                .await,
        )?;
        Ok(r.is_some())
    }

    /// Set the sandbox's remaining life to `timeout` from now.
    pub(crate) async fn set_timeout(&self, id: &str, timeout: Duration) -> Result<()> {
        let url = self.url(&format!("/sandboxes/{}/timeout", seg(id)));
        let body = serde_json::json!({ "timeout": secs(timeout) });
        self.http
            .send("set sandbox timeout", Idempotency::Idempotent, |c| {
                self.req(c, reqwest::Method::POST, &url).json(&body)
            })
            .await
            .map(|_| ())
    }

    /// Pause a sandbox (memory kept); already paused or gone is fine.
    pub(crate) async fn pause(&self, id: &str) -> Result<()> {
        let url = self.url(&format!("/sandboxes/{}/pause", seg(id)));
        match self
            .http
            .send("pause sandbox", Idempotency::Idempotent, |c| {
                self.req(c, reqwest::Method::POST, &url)
                    .json(&serde_json::json!({}))
            })
            .await
        {
            Ok(_) | Err(Error::Conflict { .. }) => Ok(()),
            Err(Error::NotFound { .. }) => {
                // Nothing left to keep: the next call makes a new sandbox and restores.
                tracing::warn!(sandbox = %id, "pausing: the sandbox is already gone");
                Ok(())
            }
            Err(e) => Err(e),
        }
    }

    /// Resume (or keep running) a sandbox for `timeout`; `None` when it is gone.
    pub(crate) async fn connect(&self, id: &str, timeout: Duration) -> Result<Option<Sandbox>> {
        let url = self.url(&format!("/sandboxes/{}/connect", seg(id)));
        let body = serde_json::json!({ "timeout": secs(timeout) });
        let raw = found(
            self.http
                .json::<RawSandbox>("connect sandbox", Idempotency::Idempotent, |c| {
                    self.req(c, reqwest::Method::POST, &url).json(&body)
                })
                .await,
        )?;
        Ok(raw.map(Sandbox::from))
    }

    /// Snapshot a sandbox; the id new sandboxes take as their template.
    pub(crate) async fn snapshot(&self, id: &str) -> Result<String> {
        #[derive(Deserialize)]
        struct Snap {
            #[serde(rename = "snapshotID")]
            snapshot_id: String,
        }
        let url = self.url(&format!("/sandboxes/{}/snapshots", seg(id)));
        let s: Snap = self
            .http
            .json("snapshot sandbox", Idempotency::NotIdempotent, |c| {
                self.req(c, reqwest::Method::POST, &url)
                    .json(&serde_json::json!({}))
            })
            .await?;
        if s.snapshot_id.is_empty() {
            return Err(Error::backend(
                BACKEND,
                "snapshot sandbox",
                "empty snapshotID",
            ));
        }
        Ok(s.snapshot_id)
    }

    /// Delete a snapshot (a template, as the API sees it); `false` when it was gone.
    pub(crate) async fn delete_snapshot(&self, snapshot: &str) -> Result<bool> {
        let url = self.url(&format!("/templates/{}", seg(snapshot)));
        let r = found(
            self.http
                .send("delete snapshot", Idempotency::Idempotent, |c| {
                    self.req(c, reqwest::Method::DELETE, &url)
                })
                .await,
        )?;
        Ok(r.is_some())
    }

    /// Every running or paused sandbox whose metadata holds all of `filter`, following
    /// `X-Next-Token`.
    pub(crate) async fn list(&self, filter: &BTreeMap<String, String>) -> Result<Vec<Sandbox>> {
        let metadata = {
            let mut s = reqwest::Url::parse("x:/").expect("static url");
            s.query_pairs_mut().extend_pairs(filter.iter());
            s.query().unwrap_or_default().to_owned()
        };
        let mut out = Vec::new();
        let mut token: Option<String> = None;
        for _page in 0..1000 {
            let mut url = reqwest::Url::parse(&self.url("/v2/sandboxes"))
                .map_err(|e| Error::invalid("api url", e.to_string()))?;
            {
                let mut q = url.query_pairs_mut();
                q.append_pair("metadata", &metadata);
                q.append_pair("state", "running,paused");
                q.append_pair("limit", "100");
                if let Some(t) = &token {
                    q.append_pair("nextToken", t);
                }
            }
            let url = url.to_string();
            let r = self
                .http
                .send("list sandboxes", Idempotency::Idempotent, |c| {
                    self.req(c, reqwest::Method::GET, &url)
                })
                .await?;
            token = r
                .headers()
                .get("x-next-token")
                .and_then(|v| v.to_str().ok())
                .filter(|t| !t.is_empty())
                .map(str::to_owned);
            let body = r.bytes().await.map_err(|e| Error::Unavailable {
                service: format!("e2b api at {}", self.base),
                reason: format!("reading the sandbox list: {e}"),
                source: Some(Box::new(e)),
            })?;
            let page: Vec<RawSandbox> = serde_json::from_slice(&body).map_err(|e| {
                Error::backend(
                    BACKEND,
                    "list sandboxes",
                    format!("not a sandbox list: {e}"),
                )
            })?;
            out.extend(
                page.into_iter()
                    .map(Sandbox::from)
                    // The filter is the server's; checked again here.
                    .filter(|s| filter.iter().all(|(k, v)| s.metadata.get(k) == Some(v))),
            );
            if token.is_none() {
                return Ok(out);
            }
        }
        Err(Error::backend(
            BACKEND,
            "list sandboxes",
            "more than 1000 pages",
        ))
    }
}

/// Percent-encode one path segment.
pub(crate) fn seg(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for b in s.bytes() {
        if b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.' | b'~') {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sandbox_debug_hides_the_token() {
        let raw: RawSandbox = serde_json::from_str(
            r#"{"sandboxID":"abc","templateID":"base","clientID":"x","envdVersion":"0.5.7","envdAccessToken":"tok-secret","domain":null}"#,
        )
        .unwrap();
        let s = Sandbox::from(raw);
        assert_eq!(s.token.as_ref().unwrap().expose(), "tok-secret");
        assert_eq!(s.domain, None);
        let shown = format!("{s:?}");
        assert!(!shown.contains("tok-secret"), "{shown}");
    }

    #[test]
    fn path_segments_are_encoded() {
        assert_eq!(seg("a b/c"), "a%20b%2Fc");
        assert_eq!(seg("i1-x_y.z"), "i1-x_y.z");
    }
}
