//! The Daytona API (control plane) and toolbox (data plane) calls, over `sandbox_cloud::Http`.

use std::collections::{BTreeMap, HashMap};
use std::time::Duration;

use bytes::Bytes;
use sandbox_cloud::{Http, HttpOptions, Idempotency, Secret};
use sandbox_core::{Error, Result};
use serde::Deserialize;
use serde_json::Value;

use crate::BACKEND;

/// The fields of a `Sandbox` (and `SandboxListItem`) the backend reads.
#[derive(Debug, Clone, Deserialize)]
#[serde(rename_all = "camelCase")]
pub(crate) struct SandboxDto {
    pub id: String,
    pub name: String,
    #[serde(default)]
    pub state: Option<String>,
    #[serde(default)]
    pub error_reason: Option<String>,
    #[serde(default)]
    pub labels: BTreeMap<String, String>,
    #[serde(default)]
    pub toolbox_proxy_url: Option<String>,
}

impl SandboxDto {
    pub fn state(&self) -> &str {
        self.state.as_deref().unwrap_or("unknown")
    }
}

#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
struct ListPage {
    items: Vec<SandboxDto>,
    #[serde(default)]
    next_cursor: Option<String>,
}

#[derive(Debug, Deserialize)]
struct ProxyUrl {
    url: String,
}

/// `POST /process/execute`'s answer.
#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
pub(crate) struct ExecuteResponse {
    #[serde(default)]
    pub exit_code: Option<i32>,
    /// Older daemons send `code`.
    #[serde(default)]
    pub code: Option<i32>,
    #[serde(default)]
    pub result: String,
}

/// What one `execute` gave: an answer, or the daemon's 408 (the process group was killed).
#[derive(Debug)]
pub(crate) enum Executed {
    Done(ExecuteResponse),
    TimedOut,
}

/// A path for a query string.
fn enc(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for b in s.bytes() {
        if b.is_ascii_alphanumeric() || b"-_.~/".contains(&b) {
            out.push(char::from(b));
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

/// The Daytona API and toolbox for one client.
#[derive(Debug, Clone)]
pub(crate) struct Api {
    base: String,
    key: Secret,
    http: Http,
    /// For `execute`: no per-attempt time limit of its own (the daemon's `timeout` ends the
    /// command; the call is bounded by the caller).
    exec_http: Http,
}

impl Api {
    pub fn new(base: &str, key: Secret, options: &HttpOptions) -> Result<Api> {
        let base = base.trim_end_matches('/').to_owned();
        let http = Http::new(BACKEND, format!("daytona api at {base}"), options.clone())?;
        let exec_http = Http::new(
            BACKEND,
            format!("daytona toolbox of {base}"),
            options
                .clone()
                .request_timeout(Duration::from_secs(24 * 3600)),
        )?;
        Ok(Api {
            base,
            key,
            http,
            exec_http,
        })
    }

    fn url(&self, path: &str) -> String {
        format!("{}{path}", self.base)
    }

    fn auth(&self, rb: reqwest::RequestBuilder) -> reqwest::RequestBuilder {
        rb.bearer_auth(self.key.expose())
            .header("X-Daytona-Source", "sandbox-harness")
    }

    /// `GET /sandbox/{idOrName}`; `None` when it does not exist.
    pub async fn get(&self, id: &str) -> Result<Option<SandboxDto>> {
        let url = self.url(&format!("/sandbox/{}", enc(id)));
        match self
            .http
            .json::<SandboxDto>("get sandbox", Idempotency::Idempotent, |c| {
                self.auth(c.get(&url))
            })
            .await
        {
            Ok(s) => Ok(Some(s)),
            Err(Error::NotFound { .. }) => Ok(None),
            Err(e) => Err(e),
        }
    }

    /// `POST /sandbox` (not retried: it may have happened).
    pub async fn create(&self, body: &Value) -> Result<SandboxDto> {
        let url = self.url("/sandbox");
        self.http
            .json("create sandbox", Idempotency::NotIdempotent, |c| {
                self.auth(c.post(&url)).json(body)
            })
            .await
    }

    /// `DELETE /sandbox/{id}`; gone already is fine.
    pub async fn delete(&self, id: &str) -> Result<()> {
        let url = self.url(&format!("/sandbox/{}", enc(id)));
        match self
            .http
            .send("delete sandbox", Idempotency::Idempotent, |c| {
                self.auth(c.delete(&url))
            })
            .await
        {
            Ok(_) | Err(Error::NotFound { .. }) => Ok(()),
            Err(e) => Err(e),
        }
    }

    /// `POST /sandbox/{id}/start` or `/stop`.
    pub async fn lifecycle(&self, id: &str, action: &'static str) -> Result<SandboxDto> {
        let url = self.url(&format!("/sandbox/{}/{action}", enc(id)));
        let op = if action == "start" {
            "start sandbox"
        } else {
            "stop sandbox"
        };
        self.http
            .json(op, Idempotency::Idempotent, |c| self.auth(c.post(&url)))
            .await
    }

    /// `GET /sandbox/{id}/toolbox-proxy-url`.
    pub async fn toolbox_url(&self, id: &str) -> Result<String> {
        let url = self.url(&format!("/sandbox/{}/toolbox-proxy-url", enc(id)));
        let p: ProxyUrl = self
            .http
            .json("toolbox proxy url", Idempotency::Idempotent, |c| {
                self.auth(c.get(&url))
            })
            .await?;
        Ok(p.url)
    }

    /// Every sandbox whose labels include `labels` (`GET /sandbox`, all pages).
    pub async fn list(&self, labels: &BTreeMap<String, String>) -> Result<Vec<SandboxDto>> {
        let filter = serde_json::to_string(labels)
            .map_err(|e| Error::backend(BACKEND, "list sandboxes", e.to_string()))?;
        let mut out = Vec::new();
        let mut cursor: Option<String> = None;
        for _ in 0..10_000 {
            let mut url = format!("{}?limit=100&labels={}", self.url("/sandbox"), enc(&filter));
            if let Some(c) = &cursor {
                url.push_str(&format!("&cursor={}", enc(c)));
            }
            let page: ListPage = self
                .http
                .json("list sandboxes", Idempotency::Idempotent, |c| {
                    self.auth(c.get(&url))
                })
                .await?;
            out.extend(page.items);
            match page.next_cursor.filter(|c| !c.is_empty()) {
                Some(c) if Some(&c) != cursor.as_ref() => cursor = Some(c),
                _ => return Ok(out),
            }
        }
        Err(Error::backend(
            BACKEND,
            "list sandboxes",
            "more than 10,000 pages",
        ))
    }

    // ---- toolbox --------------------------------------------------------------------

    /// `POST {toolbox}/{id}/process/execute`: the command is fed to the daemon's shell; over
    /// `timeout` (whole seconds, at least 1) the daemon kills the process group and answers 408.
    pub async fn execute(
        &self,
        toolbox: &str,
        command: &str,
        env: &HashMap<String, String>,
        timeout: Duration,
    ) -> Result<Executed> {
        let secs = timeout.as_secs() + u64::from(timeout.subsec_nanos() > 0);
        let secs = secs.max(1);
        let body = serde_json::json!({"command": command, "envs": env, "timeout": secs});
        let url = format!("{toolbox}/process/execute");
        // The daemon answers by `timeout`; a minute more for the answer to come back.
        let bound = Duration::from_secs(secs + 60);
        let call =
            self.exec_http
                .json::<ExecuteResponse>("execute", Idempotency::NotIdempotent, |c| {
                    self.auth(c.post(&url)).json(&body)
                });
        match tokio::time::timeout(bound, call).await {
            Ok(Ok(r)) => Ok(Executed::Done(r)),
            // The daemon's 408: `request timeout: command execution timeout`.
            Ok(Err(Error::Timeout { .. })) => Ok(Executed::TimedOut),
            Ok(Err(e)) => Err(e),
            Err(_) => Err(Error::Timeout {
                operation: format!("execute ({toolbox})"),
                after: bound,
            }),
        }
    }

    /// `GET {toolbox}/files/download?path=`: a file's bytes (not found → `Error::NotFound`).
    pub async fn download(&self, toolbox: &str, path: &str) -> Result<reqwest::Response> {
        let url = format!("{toolbox}/files/download?path={}", enc(path));
        self.http
            .send("download file", Idempotency::Idempotent, |c| {
                self.auth(c.get(&url))
            })
            .await
    }

    /// `POST {toolbox}/files/bulk-upload` of one file (multipart `files[0].path` and
    /// `files[0].file`); whole-body writes are idempotent.
    pub async fn upload(&self, toolbox: &str, path: &str, data: Bytes) -> Result<()> {
        let url = format!("{toolbox}/files/bulk-upload");
        self.http
            .send("upload file", Idempotency::Idempotent, |c| {
                let part = reqwest::multipart::Part::stream(reqwest::Body::from(data.clone()))
                    .file_name(path.to_owned())
                    .mime_str("application/octet-stream")
                    .expect("static mime type");
                let form = reqwest::multipart::Form::new()
                    .text("files[0].path", path.to_owned())
                    .part("files[0].file", part);
                self.auth(c.post(&url)).multipart(form)
            })
            .await
            .map(drop)
    }

    /// `DELETE {toolbox}/files?path=&recursive=true`; gone already is fine.
    pub async fn delete_file(&self, toolbox: &str, path: &str) -> Result<()> {
        let url = format!("{toolbox}/files?path={}&recursive=true", enc(path));
        match self
            .http
            .send("delete file", Idempotency::Idempotent, |c| {
                self.auth(c.delete(&url))
            })
            .await
        {
            Ok(_) | Err(Error::NotFound { .. }) => Ok(()),
            Err(e) => Err(e),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn query_values_are_encoded() {
        assert_eq!(enc("/a b/c&d"), "/a%20b/c%26d");
        assert_eq!(enc("{\"k\":\"v\"}"), "%7B%22k%22%3A%22v%22%7D");
    }

    #[test]
    fn old_daemons_exit_code_field_is_read() {
        let r: ExecuteResponse = serde_json::from_str(r#"{"code":3,"result":"x"}"#).unwrap();
        assert_eq!((r.exit_code, r.code), (None, Some(3)));
    }
}
