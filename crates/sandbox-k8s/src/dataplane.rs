//! Where the pod's servers are: URLs and headers per connection mode, and HTTP calls with the
//! retry rule (connect errors and 502/503 are retried with backoff and jitter for idempotent
//! calls; a call that may have reached the runtime is only retried when the connection was
//! never made).

use std::fmt;
use std::time::Duration;

use reqwest::header::{AUTHORIZATION, HeaderMap, HeaderName, HeaderValue};
use sandbox_core::{Error, Result};

use crate::BACKEND;
use crate::control::backoff;

/// How requests reach the pod.
#[derive(Clone)]
pub(crate) enum Route {
    /// Straight to a host (pod IP or Service DNS name) on each server's port.
    Direct { host: String },
    /// Through the router at `base` with the X-Sandbox-* headers.
    Router {
        base: String,
        token: Option<String>,
        sandbox: String,
        namespace: String,
    },
}

impl fmt::Debug for Route {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Route::Direct { host } => f.debug_struct("Direct").field("host", host).finish(),
            Route::Router {
                base,
                sandbox,
                namespace,
                ..
            } => f
                .debug_struct("Router")
                .field("base", base)
                .field("sandbox", sandbox)
                .field("namespace", namespace)
                .finish_non_exhaustive(),
        }
    }
}

impl Route {
    /// `http://host:port` for a direct route.
    fn host_port(host: &str, port: u16) -> String {
        if host.contains(':') && !host.starts_with('[') {
            format!("http://[{host}]:{port}")
        } else {
            format!("http://{host}:{port}")
        }
    }

    /// The URL of `path` (starting with `/`) on the server at `port`.
    pub(crate) fn url(&self, port: u16, path: &str) -> String {
        match self {
            Route::Direct { host } => format!("{}{path}", Self::host_port(host, port)),
            Route::Router { base, .. } => format!("{}{path}", base.trim_end_matches('/')),
        }
    }

    /// The gRPC endpoint of the server at `port`: the pod's, or the router's (h2c; the
    /// [`Route::headers`] of `port` name the pod).
    pub(crate) fn grpc_uri(&self, port: u16) -> String {
        match self {
            Route::Direct { host } => Self::host_port(host, port),
            Route::Router { base, .. } => base.trim_end_matches('/').to_owned(),
        }
    }

    /// Headers of every request to the server at `port`.
    pub(crate) fn headers(&self, port: u16) -> Result<HeaderMap> {
        let mut h = HeaderMap::new();
        if let Route::Router {
            token,
            sandbox,
            namespace,
            ..
        } = self
        {
            let value = |v: &str| {
                HeaderValue::from_str(v)
                    .map_err(|_| Error::invalid("router header", "not a valid header value"))
            };
            h.insert(HeaderName::from_static("x-sandbox-id"), value(sandbox)?);
            h.insert(
                HeaderName::from_static("x-sandbox-namespace"),
                value(namespace)?,
            );
            h.insert(
                HeaderName::from_static("x-sandbox-port"),
                value(&port.to_string())?,
            );
            if let Some(t) = token {
                let mut v = value(&format!("Bearer {t}"))?;
                v.set_sensitive(true);
                h.insert(AUTHORIZATION, v);
            }
        }
        Ok(h)
    }
}

/// An HTTP client for one box's runtime.
#[derive(Debug, Clone)]
pub(crate) struct Http {
    client: reqwest::Client,
    retries: u32,
    /// Shown in errors: the pod or sandbox.
    pub who: String,
}

impl Http {
    pub(crate) fn new(client: reqwest::Client, retries: u32, who: String) -> Self {
        Http {
            client,
            retries,
            who,
        }
    }

    pub(crate) fn client(&self) -> &reqwest::Client {
        &self.client
    }

    fn unavailable(&self, reason: String, source: Option<reqwest::Error>) -> Error {
        Error::Unavailable {
            service: format!("sandbox runtime of {}", self.who),
            reason,
            source: source.map(|e| Box::new(e) as _),
        }
    }

    /// Send the request `build` makes. `idempotent` calls are retried on connect errors and
    /// 502/503; others only when the connection was never made (nothing was sent).
    pub(crate) async fn send(
        &self,
        idempotent: bool,
        build: impl Fn() -> reqwest::RequestBuilder,
    ) -> Result<reqwest::Response> {
        let mut attempt = 0;
        loop {
            let last = attempt + 1 >= self.retries;
            match build().send().await {
                Ok(r) if idempotent && matches!(r.status().as_u16(), 502 | 503) && !last => {
                    tracing::debug!(who = %self.who, status = %r.status(), attempt, "runtime not routable yet; retrying");
                }
                Ok(r) if matches!(r.status().as_u16(), 502 | 503) => {
                    let status = r.status();
                    let body = r.text().await.unwrap_or_default();
                    return Err(self.unavailable(format!("{status}: {}", clip(&body)), None));
                }
                Ok(r) => return Ok(r),
                Err(e) if e.is_connect() && !last => {
                    tracing::debug!(who = %self.who, error = %e, attempt, "runtime connect failed; retrying");
                }
                Err(e) if idempotent && e.is_timeout() && !last => {
                    tracing::debug!(who = %self.who, attempt, "runtime call timed out; retrying");
                }
                Err(e) => return Err(self.unavailable(e.to_string(), Some(e))),
            }
            tokio::time::sleep(backoff(attempt)).await;
            attempt += 1;
        }
    }

    /// Turn a non-success answer into a typed error (`what`: the file or operation).
    pub(crate) async fn check(
        &self,
        operation: &'static str,
        what: &str,
        r: reqwest::Response,
    ) -> Result<reqwest::Response> {
        let status = r.status().as_u16();
        if r.status().is_success() {
            return Ok(r);
        }
        let body = r.text().await.unwrap_or_default();
        let message = format!("{what}: {status} {}", clip(&body));
        Err(match status {
            404 => Error::NotFound {
                what: "file",
                key: what.to_owned(),
            },
            400 | 403 | 409 | 422 => Error::InvalidInput {
                what: "runtime request",
                reason: message,
            },
            500..=599 => self.unavailable(message, None),
            _ => Error::backend(BACKEND, operation, message),
        })
    }
}

/// `argv` run in `dir`: a `cd` by `sh` first, so `dir` means the same on every runtime (the
/// runtimes resolve their own `cwd` against their base directory).
pub(crate) fn in_dir(dir: &str, argv: Vec<String>) -> Vec<String> {
    let mut out = vec![
        "sh".to_owned(),
        "-c".to_owned(),
        "cd -- \"$1\" && shift && exec \"$@\"".to_owned(),
        "sh".to_owned(),
        dir.to_owned(),
    ];
    out.extend(argv);
    out
}

/// A short, single-line excerpt of a server's answer.
fn clip(body: &str) -> String {
    let one: String = body.chars().take(300).collect();
    one.replace('\n', " ")
}

/// Percent-encode one path segment (everything but unreserved characters).
pub(crate) fn encode_segment(s: &str) -> String {
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

/// A reqwest client for runtimes: no redirects, bounded connects.
pub(crate) fn http_client() -> Result<reqwest::Client> {
    reqwest::Client::builder()
        .redirect(reqwest::redirect::Policy::none())
        .connect_timeout(Duration::from_secs(5))
        .build()
        .map_err(|e| Error::backend(BACKEND, "build HTTP client", e.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn direct_urls() {
        let r = Route::Direct {
            host: "10.1.2.3".into(),
        };
        assert_eq!(
            r.url(8080, "/v1/files/a"),
            "http://10.1.2.3:8080/v1/files/a"
        );
        assert_eq!(r.grpc_uri(9090), "http://10.1.2.3:9090");
        assert!(r.headers(8080).unwrap().is_empty());
        let v6 = Route::Direct {
            host: "fd00::5".into(),
        };
        assert_eq!(v6.url(8888, "/"), "http://[fd00::5]:8888/");
    }

    #[test]
    fn router_headers() {
        let r = Route::Router {
            base: "http://router:8080/".into(),
            token: Some("tok".into()),
            sandbox: "sb-1".into(),
            namespace: "agents".into(),
        };
        assert_eq!(r.url(8888, "/execute"), "http://router:8080/execute");
        assert_eq!(r.grpc_uri(9090), "http://router:8080");
        let h = r.headers(8888).unwrap();
        assert_eq!(h["x-sandbox-id"], "sb-1");
        assert_eq!(h["x-sandbox-namespace"], "agents");
        assert_eq!(h["x-sandbox-port"], "8888");
        assert_eq!(h[AUTHORIZATION], "Bearer tok");
        assert!(h[AUTHORIZATION].is_sensitive());
        assert!(!format!("{r:?}").contains("tok\""), "{r:?}");
    }

    #[test]
    fn segments_are_encoded() {
        assert_eq!(encode_segment("a b/c%d"), "a%20b%2Fc%25d");
        assert_eq!(encode_segment("ok-_.~9"), "ok-_.~9");
    }
}
