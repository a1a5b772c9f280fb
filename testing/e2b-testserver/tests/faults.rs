//! Auth failures and every fault of the E2B test server, against real containers
//! (`SANDBOX_TEST_DOCKER=1`, `SANDBOX_K8S_POD_IMAGE`).

mod common;

use std::time::{Duration, Instant};

use common::{T, bash, docker_count, enabled};
use reqwest::{Method, StatusCode};
use serde_json::json;

#[tokio::test]
#[cfg_attr(
    not(docker_tests),
    ignore = "needs Docker: set SANDBOX_TEST_DOCKER=1 (cargo xtask test does)"
)]
async fn auth_failures() {
    enabled();
    let t = T::start().await;
    // Wrong and missing API key.
    let r = t.api_key("GET", "/v2/sandboxes", None, "e2b_wrong").await;
    assert_eq!(r.status, StatusCode::UNAUTHORIZED);
    assert_eq!(r.body["code"], 401);
    assert!(r.body["message"].as_str().unwrap().contains("API key"));
    let r = t
        .http
        .get(format!("{}/sandboxes", t.s.api_url()))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), StatusCode::UNAUTHORIZED);

    let (id, token) = t.create(json!({"templateID": "base"})).await;
    // envd: no token / wrong token → 401; /health needs none.
    let r = t
        .envd(Method::GET, &id, None, "/files?path=/etc/hostname")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), StatusCode::UNAUTHORIZED);
    let (s, v) = t
        .unary_json(&id, "wrong", "process.Process/List", json!({}))
        .await;
    assert_eq!(
        (s, v["code"].as_i64()),
        (StatusCode::UNAUTHORIZED, Some(401))
    );
    let r = t
        .envd(Method::GET, &id, None, "/health")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), StatusCode::NO_CONTENT);
    // Host routing instead of the header.
    let r = t
        .http
        .get(format!("{}/health", t.s.envd_url()))
        .header("host", format!("49983-{id}.{}", t.s.domain()))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), StatusCode::NO_CONTENT);
    // Signed file URLs: valid, tampered, expired.
    let sig = enc(&e2b_sig("/etc/hostname", "read", "", &token, None));
    let r = t
        .envd(
            Method::GET,
            &id,
            None,
            &format!("/files?path=/etc/hostname&signature={sig}"),
        )
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), StatusCode::OK);
    let r = t
        .envd(
            Method::GET,
            &id,
            None,
            &format!("/files?path=/etc/passwd&signature={sig}"),
        )
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), StatusCode::UNAUTHORIZED);
    let past = chrono::Utc::now().timestamp() - 10;
    let sig = enc(&e2b_sig("/etc/hostname", "read", "", &token, Some(past)));
    let r = t
        .envd(
            Method::GET,
            &id,
            None,
            &format!("/files?path=/etc/hostname&signature={sig}&signature_expiration={past}"),
        )
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), StatusCode::UNAUTHORIZED);
    // A rotated token: the old one is refused, the new one works.
    let new = t.s.rotate_envd_token(&id).unwrap();
    let (s, _) = t
        .unary_json(&id, &token, "process.Process/List", json!({}))
        .await;
    assert_eq!(s, StatusCode::UNAUTHORIZED);
    let (s, _) = t
        .unary_json(&id, &new, "process.Process/List", json!({}))
        .await;
    assert_eq!(s, StatusCode::OK);
    let d = t.api("GET", &format!("/sandboxes/{id}"), None).await;
    assert_eq!(d.body["envdAccessToken"], new.as_str());
    // Unknown sandbox: the proxy's 502.
    let r = t
        .envd(Method::GET, "nosuchsandbox", Some(&new), "/health")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), StatusCode::BAD_GATEWAY);
    let v: serde_json::Value = r.json().await.unwrap();
    assert!(v["message"].as_str().unwrap().contains("was not found"));
}

/// Query-encode like the SDK (`urllib.parse.quote`): `+` and `/` must not pass raw.
fn enc(s: &str) -> String {
    s.replace('+', "%2B").replace('/', "%2F")
}

/// The SDK's signature rule, computed independently of the server's code.
fn e2b_sig(path: &str, op: &str, user: &str, token: &str, exp: Option<i64>) -> String {
    use base64::Engine as _;
    use sha2::Digest as _;
    let raw = match exp {
        Some(e) => format!("{path}:{op}:{user}:{token}:{e}"),
        None => format!("{path}:{op}:{user}:{token}"),
    };
    let d = sha2::Sha256::digest(raw.as_bytes());
    let s = base64::engine::general_purpose::STANDARD.encode(d);
    format!("v1_{}", s.trim_end_matches('='))
}

#[tokio::test]
#[cfg_attr(
    not(docker_tests),
    ignore = "needs Docker: set SANDBOX_TEST_DOCKER=1 (cargo xtask test does)"
)]
async fn request_faults() {
    enabled();
    let t = T::start().await;
    t.s.faults().fail_next("POST", "/v2/sandboxes", 503, 1);
    let r = t
        .api("POST", "/v2/sandboxes", Some(json!({"templateID": "base"})))
        .await;
    assert_eq!(r.status, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(r.body["code"], 503);
    assert_eq!(
        docker_count(&[
            "ps",
            "-q",
            "--filter",
            &format!("label=sandbox-harness.e2b-testserver={}", t.s.server_id())
        ]),
        0
    );
    let (id, token) = t.create(json!({"templateID": "base"})).await;

    t.s.faults()
        .rate_limit_next("GET", "/sandboxes/", Duration::from_millis(1500), 2);
    for _ in 0..2 {
        let r = t.api("GET", &format!("/sandboxes/{id}"), None).await;
        assert_eq!(r.status, StatusCode::TOO_MANY_REQUESTS);
        assert_eq!(r.headers["retry-after"], "2");
    }
    assert_eq!(
        t.api("GET", &format!("/sandboxes/{id}"), None).await.status,
        StatusCode::OK
    );

    t.s.faults()
        .delay("GET", "/health", Duration::from_millis(700));
    let started = Instant::now();
    let r = t
        .envd(Method::GET, &id, None, "/health")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), StatusCode::NO_CONTENT);
    assert!(started.elapsed() >= Duration::from_millis(700));
    t.s.faults().clear();
    let started = Instant::now();
    t.envd(Method::GET, &id, None, "/health")
        .send()
        .await
        .unwrap();
    assert!(started.elapsed() < Duration::from_millis(700));

    // A Start stream cut after two outputs: no end event, no end-stream message; the
    // process itself runs on.
    t.s.faults().cut_next_start_stream(2);
    let run = t
        .run_json(
            &id,
            &token,
            bash("for i in 1 2 3 4 5; do echo $i; sleep 0.2; done; touch /tmp/finished"),
            &[],
        )
        .await;
    assert!(run.broken, "{run:?}");
    assert!(run.end.is_none() && run.end_stream.is_none());
    assert_eq!(run.stdout, b"1\n2\n");
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let r = t
        .envd(Method::GET, &id, Some(&token), "/files?path=/tmp/finished")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), StatusCode::OK);
    // The next stream is whole again.
    let run = t.run_json(&id, &token, bash("echo whole"), &[]).await;
    assert!(!run.broken && run.end.is_some());
}

#[tokio::test]
#[cfg_attr(
    not(docker_tests),
    ignore = "needs Docker: set SANDBOX_TEST_DOCKER=1 (cargo xtask test does)"
)]
async fn sandboxes_disappear_and_expire() {
    enabled();
    let t = T::start().await;
    let (id, token) = t
        .create(json!({"templateID": "base", "timeout": 300}))
        .await;
    t.s.disappear(&id).await.unwrap();
    // The API still lists it; envd answers as E2B's proxy does for a dead sandbox.
    assert_eq!(
        t.api("GET", &format!("/sandboxes/{id}"), None).await.status,
        StatusCode::OK
    );
    let r = t
        .envd(Method::GET, &id, Some(&token), "/files?path=/etc/hostname")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), StatusCode::BAD_GATEWAY);
    let v: serde_json::Value = r.json().await.unwrap();
    assert!(
        v["message"].as_str().unwrap().contains("was not found"),
        "{v}"
    );
    // Connect calls too, streaming or unary: the proxy answers, not envd.
    let b = e2b_envd_proto::envelope::encode(0, common::bash("true").to_string().as_bytes());
    let r = t
        .envd(Method::POST, &id, Some(&token), "/process.Process/Start")
        .header("content-type", "application/connect+json")
        .body(b)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), StatusCode::BAD_GATEWAY);
    let (s, v) = t
        .unary_json(
            &id,
            &token,
            "filesystem.Filesystem/Stat",
            json!({"path": "/"}),
        )
        .await;
    assert_eq!(s, StatusCode::BAD_GATEWAY, "{v}");
    // The fault endpoint (for clients outside the process) reaches the same plan.
    let r = t
        .api("POST", "/e2b-testserver/v1/faults", Some(json!({"action": "fail_next", "method": "GET", "path": "/v2/sandboxes", "status": 502})))
        .await;
    assert_eq!(r.status, StatusCode::NO_CONTENT);
    assert_eq!(
        t.api("GET", "/v2/sandboxes", None).await.status,
        StatusCode::BAD_GATEWAY
    );
    assert_eq!(
        t.api("GET", "/v2/sandboxes", None).await.status,
        StatusCode::OK
    );
    let r = t
        .api(
            "POST",
            "/e2b-testserver/v1/faults",
            Some(json!({"action": "explode"})),
        )
        .await;
    assert_eq!(r.status, StatusCode::BAD_REQUEST);

    // Timeout: the TTL counts from now; an expired sandbox is removed with its container.
    let (id2, _) = t
        .create(json!({"templateID": "base", "timeout": 300}))
        .await;
    let container = t.s.container_of(&id2).unwrap();
    assert_eq!(
        t.api(
            "POST",
            &format!("/sandboxes/{id2}/timeout"),
            Some(json!({"timeout": 1}))
        )
        .await
        .status,
        StatusCode::NO_CONTENT
    );
    let mut gone = false;
    for _ in 0..40 {
        tokio::time::sleep(Duration::from_millis(200)).await;
        if t.api("GET", &format!("/sandboxes/{id2}"), None)
            .await
            .status
            == StatusCode::NOT_FOUND
        {
            gone = true;
            break;
        }
    }
    assert!(gone, "the expired sandbox is still there");
    assert!(test_docker::inspect(&container).await.unwrap().is_none());
    // With autoPause, expiry pauses instead.
    let (id3, _) = t
        .create(json!({"templateID": "base", "timeout": 1, "autoPause": true}))
        .await;
    let mut paused = false;
    for _ in 0..40 {
        tokio::time::sleep(Duration::from_millis(200)).await;
        if t.api("GET", &format!("/sandboxes/{id3}"), None).await.body["state"] == "paused" {
            paused = true;
            break;
        }
    }
    assert!(paused);
    // Connect without a timeout resumes it with its last timeout again (201).
    let c = t
        .api(
            "POST",
            &format!("/v2/sandboxes/{id3}/connect"),
            Some(json!({})),
        )
        .await;
    assert_eq!(c.status, StatusCode::CREATED, "{}", c.body);
    let d = t.api("GET", &format!("/sandboxes/{id3}"), None).await;
    assert_eq!(d.body["state"], "running");
    assert_eq!(
        t.api(
            "POST",
            &format!("/sandboxes/{id3}/timeout"),
            Some(json!({}))
        )
        .await
        .status,
        StatusCode::BAD_REQUEST
    );
}
