//! Helpers of the test cluster's tests: a plain HTTP client with the cluster's token.
#![allow(dead_code)]

use std::time::Duration;

use futures::StreamExt;
use k8s_testcluster::TestCluster;
use serde_json::Value;

pub const CLAIMS: &str =
    "/apis/extensions.agents.x-k8s.io/v1beta1/namespaces/default/sandboxclaims";
pub const SANDBOXES: &str = "/apis/agents.x-k8s.io/v1beta1/namespaces/default/sandboxes";

pub struct Client {
    pub http: reqwest::Client,
    pub base: String,
    pub token: String,
}

impl Client {
    pub fn new(c: &TestCluster) -> Self {
        Self {
            http: reqwest::Client::new(),
            base: c.api_url(),
            token: c.token().to_owned(),
        }
    }

    pub fn req(&self, method: reqwest::Method, path: &str) -> reqwest::RequestBuilder {
        self.http
            .request(method, format!("{}{path}", self.base))
            .bearer_auth(&self.token)
    }

    /// Send and return (status, JSON body).
    pub async fn send(&self, rb: reqwest::RequestBuilder) -> (u16, Value) {
        let r = rb.send().await.expect("request sent");
        let code = r.status().as_u16();
        let body = r.bytes().await.expect("body read");
        (code, serde_json::from_slice(&body).unwrap_or(Value::Null))
    }

    pub async fn get(&self, path: &str) -> (u16, Value) {
        self.send(self.req(reqwest::Method::GET, path)).await
    }

    pub async fn post(&self, path: &str, body: &Value) -> (u16, Value) {
        self.send(self.req(reqwest::Method::POST, path).json(body))
            .await
    }

    pub async fn put(&self, path: &str, body: &Value) -> (u16, Value) {
        self.send(self.req(reqwest::Method::PUT, path).json(body))
            .await
    }

    pub async fn patch(&self, path: &str, ct: &str, body: &Value) -> (u16, Value) {
        self.send(
            self.req(reqwest::Method::PATCH, path)
                .header("content-type", ct)
                .body(body.to_string()),
        )
        .await
    }

    pub async fn delete(&self, path: &str) -> (u16, Value) {
        self.send(self.req(reqwest::Method::DELETE, path)).await
    }

    /// Open a watch; returns a reader of events.
    pub async fn watch(&self, path_and_query: &str) -> Watch {
        let r = self
            .req(reqwest::Method::GET, path_and_query)
            .send()
            .await
            .expect("watch opened");
        assert_eq!(r.status().as_u16(), 200, "watch status");
        Watch {
            stream: Box::pin(r.bytes_stream()),
            buf: Vec::new(),
        }
    }
}

pub struct Watch {
    stream: std::pin::Pin<Box<dyn futures::Stream<Item = reqwest::Result<bytes::Bytes>> + Send>>,
    buf: Vec<u8>,
}

impl Watch {
    /// The next event, `None` when the stream ended; panics after 10 s of silence.
    pub async fn next(&mut self) -> Option<Value> {
        loop {
            if let Some(i) = self.buf.iter().position(|b| *b == b'\n') {
                let line: Vec<u8> = self.buf.drain(..=i).collect();
                return Some(serde_json::from_slice(&line).expect("a JSON event line"));
            }
            let chunk = tokio::time::timeout(Duration::from_secs(10), self.stream.next())
                .await
                .expect("a watch event within 10 s");
            match chunk {
                Some(Ok(b)) => self.buf.extend_from_slice(&b),
                Some(Err(_)) | None => return None,
            }
        }
    }

    /// The next event that is not a BOOKMARK.
    pub async fn next_change(&mut self) -> Option<Value> {
        loop {
            let e = self.next().await?;
            if e["type"] != "BOOKMARK" {
                return Some(e);
            }
        }
    }
}

/// Poll `f` every 50 ms until it returns `Some`, for up to `secs` seconds.
pub async fn eventually<T, F, Fut>(secs: u64, what: &str, mut f: F) -> T
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Option<T>>,
{
    let deadline = tokio::time::Instant::now() + Duration::from_secs(secs);
    loop {
        if let Some(v) = f().await {
            return v;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "timed out waiting for {what}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// The Ready condition of an object.
pub fn ready(obj: &Value) -> Option<(String, String)> {
    obj["status"]["conditions"]
        .as_array()?
        .iter()
        .find(|c| c["type"] == "Ready")
        .map(|c| {
            (
                c["status"].as_str().unwrap_or("").to_owned(),
                c["reason"].as_str().unwrap_or("").to_owned(),
            )
        })
}
