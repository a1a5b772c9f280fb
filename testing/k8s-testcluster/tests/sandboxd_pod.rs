//! The router in front of the real pod image (sandboxd): REST over HTTP/1.1 on 8080, gRPC
//! over h2c on 9090, the legacy API on 8888.

mod common;

use bytes::Bytes;
use common::{CLAIMS, Client, eventually, ready};
use http_body_util::{BodyExt, Full};
use hyper_util::rt::{TokioExecutor, TokioIo};
use k8s_testcluster::{DEFAULT_POOL, TestCluster, TestClusterOptions};
use serde_json::{Value, json};

fn pod_image() -> String {
    std::env::var("SANDBOX_K8S_POD_IMAGE")
        .unwrap_or_else(|_| "sandbox-harness-test/k8s-pod:latest".to_owned())
}

/// `process.v1.ExecuteRequest{config: ProcessConfig{command}}`, protobuf by hand (all lengths
/// below 128, so one-byte varints).
fn execute_request(command: &[&str]) -> Vec<u8> {
    let mut config = Vec::new();
    for part in command {
        config.push(0x0a);
        config.push(u8::try_from(part.len()).unwrap());
        config.extend_from_slice(part.as_bytes());
    }
    let mut msg = vec![0x0a, u8::try_from(config.len()).unwrap()];
    msg.extend(config);
    let mut framed = vec![0u8];
    framed.extend_from_slice(&u32::try_from(msg.len()).unwrap().to_be_bytes());
    framed.extend(msg);
    framed
}

#[tokio::test]
#[cfg_attr(
    not(docker_tests),
    ignore = "needs Docker and the k8s pod image: cargo xtask test"
)]
async fn the_router_reaches_sandboxd_over_http1_and_h2c() {
    let c = TestCluster::start(TestClusterOptions {
        pod_image: Some(pod_image()),
        warm_pool_replicas: 1,
        ..TestClusterOptions::default()
    })
    .await
    .expect("cluster starts");
    let api = Client::new(&c);
    let pool = format!(
        "/apis/extensions.agents.x-k8s.io/v1beta1/namespaces/default/sandboxwarmpools/{DEFAULT_POOL}"
    );
    eventually(120, "a ready warm sandbox", || async {
        let (_, p) = api.get(&pool).await;
        (p["status"]["readyReplicas"] == 1).then_some(())
    })
    .await;
    api.post(
        CLAIMS,
        &json!({"metadata": {"name": "pod"}, "spec": {"warmPoolRef": {"name": DEFAULT_POOL}}}),
    )
    .await;
    let claim = eventually(120, "the claim to be ready", || async {
        let (_, o) = api.get(&format!("{CLAIMS}/pod")).await;
        ready(&o).is_some_and(|(s, _)| s == "True").then_some(o)
    })
    .await;
    let sandbox = claim["status"]["sandbox"]["name"]
        .as_str()
        .unwrap()
        .to_owned();
    assert_ne!(sandbox, "pod", "adopted from the warm pool");

    // REST (HTTP/1.1) on 8080.
    let http = reqwest::Client::new();
    let url = format!("{}/v1/files/notes/a.txt", c.router_url());
    let r = http
        .put(&url)
        .header("X-Sandbox-ID", &sandbox)
        .header("X-Sandbox-Port", "8080")
        .body("via the router")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 204);
    let r = http
        .get(&url)
        .header("X-Sandbox-ID", &sandbox)
        .header("X-Sandbox-Port", "8080")
        .send()
        .await
        .unwrap();
    assert_eq!(r.text().await.unwrap(), "via the router");

    // The legacy API (the router's default port).
    let r = http
        .post(format!("{}/execute", c.router_url()))
        .header("X-Sandbox-ID", &sandbox)
        .json(&json!({"command": "cat notes/a.txt"}))
        .send()
        .await
        .unwrap();
    let out: Value = r.json().await.unwrap();
    assert_eq!(
        (out["stdout"].as_str(), out["exit_code"].as_i64()),
        (Some("via the router"), Some(0))
    );

    // gRPC (h2c prior knowledge) on 9090.
    let addr = c.router_url().trim_start_matches("http://").to_owned();
    let stream = tokio::net::TcpStream::connect(&addr).await.unwrap();
    let (mut send, conn) =
        hyper::client::conn::http2::handshake(TokioExecutor::new(), TokioIo::new(stream))
            .await
            .unwrap();
    tokio::spawn(conn);
    let req = hyper::Request::post(format!("http://{addr}/process.v1.ProcessService/Execute"))
        .header("content-type", "application/grpc")
        .header("te", "trailers")
        .header("x-sandbox-id", &sandbox)
        .header("x-sandbox-port", "9090")
        .body(Full::new(Bytes::from(execute_request(&[
            "/bin/sh",
            "-c",
            "echo h2c-ok; exit 3",
        ]))))
        .unwrap();
    let resp = send.send_request(req).await.unwrap();
    assert_eq!(resp.status(), 200);
    let collected = resp.into_body().collect().await.unwrap();
    let trailers = collected.trailers().cloned().expect("gRPC trailers");
    assert_eq!(
        trailers.get("grpc-status").map(|v| v.to_str().unwrap()),
        Some("0")
    );
    let body = collected.to_bytes();
    // ExecuteResponse{exit_code: 3 (field 1 varint), stdout: "h2c-ok\n" (field 2)}.
    let msg = &body[5..];
    assert!(
        msg.windows(2).any(|w| w == [0x08, 0x03]),
        "exit code 3 in {msg:?}"
    );
    assert!(
        msg.windows(7).any(|w| w == b"h2c-ok\n"),
        "stdout in {msg:?}"
    );
}
