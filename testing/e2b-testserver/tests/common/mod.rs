//! Shared helpers of the Docker-backed tests: a server, its API and envd calls.
#![allow(dead_code)]

use std::time::Duration;

use base64::Engine as _;
use e2b_envd_proto::envelope;
use e2b_envd_proto::process as ep;
use e2b_testserver::{E2bTestServer, E2bTestServerOptions};
use prost::Message as _;
use reqwest::StatusCode;
use reqwest::header::HeaderMap;
use serde_json::{Value, json};

/// The Docker tests run with `SANDBOX_TEST_DOCKER=1` (the `docker_tests` cfg, otherwise they
/// are ignored) and need the image of template `base`.
pub fn enabled() {
    assert!(
        std::env::var("SANDBOX_K8S_POD_IMAGE").is_ok_and(|i| !i.is_empty()),
        "SANDBOX_TEST_DOCKER=1 needs SANDBOX_K8S_POD_IMAGE (cargo xtask images)"
    );
}

pub struct T {
    pub s: E2bTestServer,
    pub http: reqwest::Client,
}

pub struct Resp {
    pub status: StatusCode,
    pub headers: HeaderMap,
    pub body: Value,
}

/// What a Start/Connect stream delivered.
#[derive(Debug, Default)]
pub struct Run {
    pub pid: Option<u32>,
    pub stdout: Vec<u8>,
    pub stderr: Vec<u8>,
    pub end: Option<ep::process_event::EndEvent>,
    /// The end-stream message (`{}` or `{"error":…}`); `None` if the stream broke off.
    pub end_stream: Option<Value>,
    pub keepalives: usize,
    /// The body broke off (connection cut).
    pub broken: bool,
}

impl T {
    pub async fn start() -> T {
        let s = E2bTestServer::start(E2bTestServerOptions::default())
            .await
            .expect("start the e2b test server");
        T {
            s,
            http: reqwest::Client::builder()
                .timeout(Duration::from_secs(120))
                .build()
                .unwrap(),
        }
    }

    pub async fn api(&self, method: &str, path: &str, body: Option<Value>) -> Resp {
        self.api_key(method, path, body, self.s.api_key()).await
    }

    pub async fn api_key(&self, method: &str, path: &str, body: Option<Value>, key: &str) -> Resp {
        let m = reqwest::Method::from_bytes(method.as_bytes()).unwrap();
        let mut rb = self
            .http
            .request(m, format!("{}{path}", self.s.api_url()))
            .header("X-API-Key", key);
        if let Some(b) = body {
            rb = rb
                .header("content-type", "application/json")
                .body(b.to_string());
        }
        let r = rb.send().await.expect("api request");
        let status = r.status();
        let headers = r.headers().clone();
        let bytes = r.bytes().await.unwrap();
        let body = if bytes.is_empty() {
            Value::Null
        } else {
            serde_json::from_slice(&bytes)
                .unwrap_or_else(|_| panic!("not JSON: {}", String::from_utf8_lossy(&bytes)))
        };
        Resp {
            status,
            headers,
            body,
        }
    }

    /// Create a sandbox through `POST /v2/sandboxes`; (id, envd token).
    pub async fn create(&self, body: Value) -> (String, String) {
        let r = self.api("POST", "/v2/sandboxes", Some(body)).await;
        assert_eq!(r.status, StatusCode::CREATED, "{}", r.body);
        (
            r.body["sandboxID"].as_str().unwrap().to_owned(),
            r.body["envdAccessToken"].as_str().unwrap().to_owned(),
        )
    }

    pub fn envd(
        &self,
        method: reqwest::Method,
        id: &str,
        token: Option<&str>,
        path: &str,
    ) -> reqwest::RequestBuilder {
        let mut rb = self
            .http
            .request(method, format!("{}{path}", self.s.envd_url()))
            .header("E2b-Sandbox-Id", id)
            .header("E2b-Sandbox-Port", "49983");
        if let Some(t) = token {
            rb = rb.header("X-Access-Token", t);
        }
        rb
    }

    /// A unary Connect call with the JSON codec.
    pub async fn unary_json(
        &self,
        id: &str,
        token: &str,
        method: &str,
        msg: Value,
    ) -> (StatusCode, Value) {
        let r = self
            .envd(
                reqwest::Method::POST,
                id,
                Some(token),
                &format!("/{method}"),
            )
            .header("content-type", "application/json")
            .header("connect-protocol-version", "1")
            .body(msg.to_string())
            .send()
            .await
            .unwrap();
        let status = r.status();
        let b = r.bytes().await.unwrap();
        (status, serde_json::from_slice(&b).unwrap_or(Value::Null))
    }

    /// A unary Connect call with the proto codec.
    pub async fn unary_proto<Q: prost::Message, A: prost::Message + Default>(
        &self,
        id: &str,
        token: &str,
        method: &str,
        msg: &Q,
    ) -> Result<A, (StatusCode, Value)> {
        let r = self
            .envd(
                reqwest::Method::POST,
                id,
                Some(token),
                &format!("/{method}"),
            )
            .header("content-type", "application/proto")
            .body(msg.encode_to_vec())
            .send()
            .await
            .unwrap();
        let status = r.status();
        let b = r.bytes().await.unwrap();
        if status.is_success() {
            Ok(A::decode(b.as_ref()).expect("proto answer"))
        } else {
            Err((status, serde_json::from_slice(&b).unwrap_or(Value::Null)))
        }
    }

    /// `process.Process/Start` with the JSON codec, read to the end.
    pub async fn run_json(
        &self,
        id: &str,
        token: &str,
        req: Value,
        headers: &[(&str, &str)],
    ) -> Run {
        let mut rb = self
            .envd(
                reqwest::Method::POST,
                id,
                Some(token),
                "/process.Process/Start",
            )
            .header("content-type", "application/connect+json")
            .header("connect-protocol-version", "1");
        for (k, v) in headers {
            rb = rb.header(*k, *v);
        }
        let body = envelope::encode(0, req.to_string().as_bytes());
        let r = rb.body(body).send().await.unwrap();
        assert_eq!(r.status(), StatusCode::OK);
        assert_eq!(
            r.headers()["content-type"].to_str().unwrap(),
            "application/connect+json"
        );
        read_stream(r, |payload, run| {
            let v: Value = serde_json::from_slice(payload).expect("JSON message");
            let ev = &v["event"];
            let b64 = |s: &Value| {
                base64::engine::general_purpose::STANDARD
                    .decode(s.as_str().unwrap())
                    .unwrap()
            };
            if let Some(p) = ev["start"]["pid"].as_u64() {
                run.pid = Some(p as u32);
            } else if !ev["data"]["stdout"].is_null() {
                run.stdout.extend(b64(&ev["data"]["stdout"]));
            } else if !ev["data"]["stderr"].is_null() {
                run.stderr.extend(b64(&ev["data"]["stderr"]));
            } else if ev["end"].is_object() {
                let e = &ev["end"];
                run.end = Some(ep::process_event::EndEvent {
                    exit_code: e["exitCode"].as_i64().unwrap_or(0) as i32,
                    exited: e["exited"].as_bool().unwrap_or(false),
                    status: e["status"].as_str().unwrap_or("").to_owned(),
                    error: e["error"].as_str().map(str::to_owned),
                });
            } else if ev["keepalive"].is_object() {
                run.keepalives += 1;
            } else {
                panic!("unexpected event {v}");
            }
        })
        .await
    }

    /// `process.Process/Start` with the proto codec, read to the end.
    pub async fn run_proto(&self, id: &str, token: &str, req: &ep::StartRequest) -> Run {
        let body = envelope::encode(0, &req.encode_to_vec());
        let r = self
            .envd(
                reqwest::Method::POST,
                id,
                Some(token),
                "/process.Process/Start",
            )
            .header("content-type", "application/connect+proto")
            .body(body)
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), StatusCode::OK);
        read_stream(r, |payload, run| {
            use ep::process_event::{Event, Output};
            let m = ep::StartResponse::decode(payload).expect("proto message");
            match m.event.and_then(|e| e.event) {
                Some(Event::Start(s)) => run.pid = Some(s.pid),
                Some(Event::Data(d)) => match d.output {
                    Some(Output::Stdout(b)) => run.stdout.extend(b),
                    Some(Output::Stderr(b)) => run.stderr.extend(b),
                    _ => {}
                },
                Some(Event::End(e)) => run.end = Some(e),
                Some(Event::Keepalive(_)) => run.keepalives += 1,
                None => panic!("empty event"),
            }
        })
        .await
    }
}

async fn read_stream(mut r: reqwest::Response, mut on_msg: impl FnMut(&[u8], &mut Run)) -> Run {
    let mut run = Run::default();
    let mut d = envelope::Decoder::new();
    loop {
        match r.chunk().await {
            Ok(Some(c)) => d.push(&c),
            Ok(None) => break,
            Err(_) => {
                run.broken = true;
                break;
            }
        }
        while let Some((flags, payload)) = d.next_envelope() {
            if flags & envelope::END_STREAM != 0 {
                run.end_stream = Some(serde_json::from_slice(&payload).expect("end-stream JSON"));
            } else {
                on_msg(&payload, &mut run);
            }
        }
    }
    run
}

/// The SDK's `commands.run` request.
pub fn bash(cmd: &str) -> Value {
    json!({"process": {"cmd": "/bin/bash", "args": ["-l", "-c", cmd]}, "stdin": false})
}

pub fn docker_count(args: &[&str]) -> usize {
    let out = std::process::Command::new("docker")
        .args(args)
        .output()
        .unwrap();
    String::from_utf8_lossy(&out.stdout)
        .split_whitespace()
        .count()
}
