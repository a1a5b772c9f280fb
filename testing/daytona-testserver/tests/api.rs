//! The control plane without Docker (`docker: false`): auth, errors, create and its faults,
//! labels, autostop, list with cursor pagination and the `labels` filter, rate limits.

use std::time::Duration;

use daytona_testserver::{DaytonaTestServer, FailState, TestServerOptions};
use serde_json::{Value, json};

async fn server() -> DaytonaTestServer {
    DaytonaTestServer::start(TestServerOptions {
        docker: false,
        ..TestServerOptions::default()
    })
    .await
    .expect("server")
}

struct Client {
    http: reqwest::Client,
    base: String,
    key: String,
}

impl Client {
    fn new(s: &DaytonaTestServer) -> Self {
        Self {
            http: reqwest::Client::new(),
            base: s.api_url(),
            key: s.api_key().to_owned(),
        }
    }

    async fn send(&self, rb: reqwest::RequestBuilder) -> (u16, Value, reqwest::header::HeaderMap) {
        let r = rb.bearer_auth(&self.key).send().await.expect("sent");
        let code = r.status().as_u16();
        let headers = r.headers().clone();
        let body = r.bytes().await.expect("body");
        (
            code,
            serde_json::from_slice(&body).unwrap_or(Value::Null),
            headers,
        )
    }

    async fn get(&self, path: &str) -> (u16, Value) {
        let (c, v, _) = self
            .send(self.http.get(format!("{}{path}", self.base)))
            .await;
        (c, v)
    }

    async fn post(&self, path: &str, body: &Value) -> (u16, Value) {
        let (c, v, _) = self
            .send(self.http.post(format!("{}{path}", self.base)).json(body))
            .await;
        (c, v)
    }
}

#[tokio::test]
async fn auth_is_required_and_errors_are_nestjs_shaped() {
    let s = server().await;
    let r = reqwest::Client::new()
        .get(format!("{}/sandbox", s.api_url()))
        .bearer_auth("wrong")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 401);
    let v: Value = r.json().await.unwrap();
    assert_eq!(v["statusCode"], 401);
    assert_eq!(v["error"], "Unauthorized");
    let c = Client::new(&s);
    let (code, v) = c.get("/sandbox/nope").await;
    assert_eq!(code, 404);
    assert_eq!(v["error"], "Not Found");
    assert!(v["message"].as_str().unwrap().contains("nope"), "{v}");
    let (code, _) = c.post("/sandbox", &json!({"labels": {"a": 1}})).await;
    assert_eq!(code, 400, "non-string label values are refused");
}

#[tokio::test]
async fn create_returns_a_full_sandbox_and_names_are_unique() {
    let s = server().await;
    let c = Client::new(&s);
    let (code, v) = c
        .post(
            "/sandbox",
            &json!({"name": "n1", "labels": {"k": "v"}, "env": {"E": "1"}, "autoStopInterval": 0}),
        )
        .await;
    assert_eq!(code, 200, "{v}");
    for field in [
        "id",
        "organizationId",
        "name",
        "user",
        "env",
        "labels",
        "public",
        "networkBlockAll",
        "kvm",
        "target",
        "cpu",
        "gpu",
        "memory",
        "disk",
        "toolboxProxyUrl",
    ] {
        assert!(
            v.get(field).is_some(),
            "required field {field} missing: {v}"
        );
    }
    assert_eq!(v["name"], "n1");
    assert_eq!(v["labels"]["k"], "v");
    assert_eq!(v["autoStopInterval"], 0);
    assert_eq!(v["toolboxProxyUrl"], s.toolbox_url());
    // Without Docker the sandbox cannot run: it ends in `error` with a reason.
    let id = v["id"].as_str().unwrap().to_owned();
    let mut state = String::new();
    for _ in 0..100 {
        let (_, v) = c.get("/sandbox/n1").await;
        state = v["state"].as_str().unwrap_or("").to_owned();
        if state == "error" {
            assert!(v["errorReason"].as_str().is_some(), "{v}");
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(state, "error");
    let (code, _) = c.post("/sandbox", &json!({"name": "n1"})).await;
    assert_eq!(code, 409, "names are unique");
    let (code, v) = c.get(&format!("/sandbox/{id}/toolbox-proxy-url")).await;
    assert_eq!(
        (code, v["url"].as_str()),
        (200, Some(s.toolbox_url().as_str()))
    );
    let (code, v, _) = c
        .send(c.http.delete(format!("{}/sandbox/{id}", c.base)))
        .await;
    assert_eq!(code, 200, "DELETE answers 200 with the sandbox");
    assert_eq!(v["id"], id.as_str());
    assert_eq!(c.get(&format!("/sandbox/{id}")).await.0, 404);
}

#[tokio::test]
async fn create_faults_put_the_sandbox_in_error_or_build_failed() {
    let s = server().await;
    let c = Client::new(&s);
    s.faults()
        .fail_next_create(FailState::BuildFailed, "no such image");
    let (_, v) = c.post("/sandbox", &json!({})).await;
    assert_eq!(v["state"], "build_failed");
    assert_eq!(v["errorReason"], "no such image");
    let (_, again) = c
        .get(&format!("/sandbox/{}", v["id"].as_str().unwrap()))
        .await;
    assert_eq!(again["state"], "build_failed", "the state sticks");
    let (code, _) = c
        .post(
            &format!("/sandbox/{}/start", v["id"].as_str().unwrap()),
            &json!({}),
        )
        .await;
    assert_eq!(code, 400, "a failed sandbox cannot be started");
}

#[tokio::test]
async fn labels_autostop_and_paginated_filtered_list() {
    let s = server().await;
    let c = Client::new(&s);
    let mut ids = Vec::new();
    for i in 0..5 {
        let team = if i % 2 == 0 { "even" } else { "odd" };
        let (_, v) = c
            .post(
                "/sandbox",
                &json!({"labels": {"team": team, "i": i.to_string()}}),
            )
            .await;
        ids.push(v["id"].as_str().unwrap().to_owned());
    }
    let (code, v, _) = c
        .send(
            c.http
                .put(format!("{}/sandbox/{}/labels", c.base, ids[1]))
                .json(&json!({"labels": {"team": "even", "i": "1"}})),
        )
        .await;
    assert_eq!((code, v["labels"]["team"].as_str()), (200, Some("even")));
    let (code, v) = c
        .post(&format!("/sandbox/{}/autostop/7", ids[0]), &json!({}))
        .await;
    assert_eq!((code, v["autoStopInterval"].as_i64()), (200, Some(7)));
    // Two per page, newest first, filtered by a JSON `labels` string.
    let filter = urlencode(r#"{"team":"even"}"#);
    let mut seen = Vec::new();
    let mut cursor: Option<String> = None;
    loop {
        let mut path = format!("/sandbox?limit=2&labels={filter}");
        if let Some(cur) = &cursor {
            path.push_str(&format!("&cursor={cur}"));
        }
        let (code, page) = c.get(&path).await;
        assert_eq!(code, 200, "{page}");
        assert!(
            page.get("nextCursor").is_some(),
            "nextCursor is always present"
        );
        for item in page["items"].as_array().unwrap() {
            assert!(item.get("env").is_none(), "list items are SandboxListItem");
            seen.push(item["id"].as_str().unwrap().to_owned());
        }
        match page["nextCursor"].as_str() {
            Some(n) => cursor = Some(n.to_owned()),
            None => break,
        }
    }
    let want: Vec<String> = [4, 2, 1, 0].iter().map(|i| ids[*i].clone()).collect();
    assert_eq!(seen, want);
    assert_eq!(c.get("/sandbox?limit=500").await.0, 400);
    assert_eq!(c.get("/sandbox?labels=notjson").await.0, 400);
}

#[tokio::test]
async fn rate_limits_carry_retry_after_and_5xx_are_injected() {
    let s = server().await;
    let c = Client::new(&s);
    s.faults()
        .rate_limit_next("GET", "/sandbox", 1, Duration::from_secs(2));
    let (code, _, headers) = c.send(c.http.get(format!("{}/sandbox", c.base))).await;
    assert_eq!(code, 429);
    assert_eq!(headers["retry-after"], "2");
    assert_eq!(c.get("/sandbox").await.0, 200, "only the next one");
    s.faults().fail_next("POST", "/sandbox", 503, 1);
    assert_eq!(c.post("/sandbox", &json!({})).await.0, 503);
    assert_eq!(s.sandbox_count(), 0, "a failed create made nothing");
    s.faults()
        .delay("GET", "/sandbox", Duration::from_millis(300));
    let t = std::time::Instant::now();
    c.get("/sandbox").await;
    assert!(t.elapsed() >= Duration::from_millis(300));
}

fn urlencode(s: &str) -> String {
    s.bytes()
        .map(|b| {
            if b.is_ascii_alphanumeric() {
                char::from(b).to_string()
            } else {
                format!("%{b:02X}")
            }
        })
        .collect()
}
