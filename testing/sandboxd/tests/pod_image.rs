//! The k8s test pod image (`cargo xtask images` builds it): the static `sandboxd` in the
//! Debian test image, run as a container on a Docker network this test creates, reached on
//! the container's address as the test cluster reaches its pods.

#![cfg_attr(not(docker_tests), allow(dead_code, unused_imports))]

mod common;

use std::process::Command;
use std::time::Duration;

use common::sdk_files_endpoint;
use sandboxd_proto::{ProcessConfig, ProcessServiceClient, StartRequest, start_response::Event};

/// Default image when `SANDBOX_K8S_POD_IMAGE` is not set.
const DEFAULT_IMAGE: &str = "sandbox-harness-test/k8s-pod:latest";

fn docker(args: &[&str]) -> Result<String, String> {
    let out = Command::new("docker")
        .args(args)
        .output()
        .map_err(|e| format!("cannot run docker: {e}"))?;
    if out.status.success() {
        Ok(String::from_utf8_lossy(&out.stdout).trim().to_owned())
    } else {
        Err(format!(
            "docker {}: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        ))
    }
}

/// Removes a Docker object when dropped (also when the test fails).
struct Removed {
    args: Vec<String>,
}

impl Drop for Removed {
    fn drop(&mut self) {
        let args: Vec<&str> = self.args.iter().map(String::as_str).collect();
        if let Err(e) = docker(&args) {
            eprintln!("cleanup failed: {e}");
        }
    }
}

#[tokio::test]
#[cfg_attr(
    not(docker_tests),
    ignore = "needs Docker and the pod image: SANDBOX_TEST_DOCKER=1 (cargo xtask test)"
)]
async fn the_pod_image_serves_all_three_apis_on_its_network_address() {
    let image = std::env::var("SANDBOX_K8S_POD_IMAGE").unwrap_or_else(|_| DEFAULT_IMAGE.to_owned());
    let suffix = format!("{:016x}", fastrand::u64(..));
    let network = format!("sandboxd-test-{suffix}");
    docker(&["network", "create", &network]).unwrap();
    let _network = Removed {
        args: vec!["network".into(), "rm".into(), network.clone()],
    };
    let name = format!("sandboxd-test-{suffix}");
    docker(&["run", "-d", "--name", &name, "--network", &network, &image]).unwrap();
    let _container = Removed {
        args: vec!["rm".into(), "-f".into(), name.clone()],
    };
    let ip = docker(&[
        "inspect",
        "-f",
        "{{range .NetworkSettings.Networks}}{{.IPAddress}}{{end}}",
        &name,
    ])
    .unwrap();
    assert!(!ip.is_empty(), "the container has no address on {network}");

    let http = reqwest::Client::new();
    let rest = format!("http://{ip}:8080");
    // Readiness is polled, never slept for blindly.
    let mut ready = false;
    for _ in 0..300 {
        if let Ok(r) = http.get(format!("{rest}/v1/health")).send().await
            && r.status().is_success()
        {
            ready = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    if !ready {
        let logs = docker(&["logs", &name]).unwrap_or_default();
        panic!("sandboxd in {name} never answered on {rest}; logs:\n{logs}");
    }

    // A file round trip through REST, seen by a process started through gRPC.
    let put = http
        .put(format!("{rest}{}", sdk_files_endpoint("in/pod.txt")))
        .body("written over REST")
        .send()
        .await
        .unwrap();
    assert_eq!(put.status(), reqwest::StatusCode::NO_CONTENT);
    let mut grpc = ProcessServiceClient::connect(format!("http://{ip}:9090"))
        .await
        .unwrap();
    let mut config = ProcessConfig::new([
        "/bin/sh",
        "-c",
        "cat in/pod.txt; pwd; echo \"$X\" >&2; exit 5",
    ]);
    config.env_vars.insert("X".into(), "from env".into());
    let mut stream = grpc
        .start(StartRequest {
            config: Some(config),
            pty: None,
        })
        .await
        .unwrap()
        .into_inner();
    let (mut stdout, mut stderr, mut exit) = (Vec::new(), Vec::new(), None);
    while let Some(msg) = stream.message().await.unwrap() {
        match msg.event.unwrap() {
            Event::Stdout(b) => stdout.extend(b),
            Event::Stderr(b) => stderr.extend(b),
            Event::Exit(e) => exit = Some(e.exit_code),
            Event::Init(_) => {}
        }
    }
    assert_eq!(String::from_utf8_lossy(&stdout), "written over REST/app\n");
    assert_eq!(String::from_utf8_lossy(&stderr), "from env\n");
    assert_eq!(exit, Some(5));

    // A file written by a process, read back through REST and the legacy API.
    let out = grpc
        .execute(sandboxd_proto::ExecuteRequest {
            config: Some(ProcessConfig::new([
                "/bin/sh",
                "-c",
                "echo made in pod > out.txt",
            ])),
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(out.exit_code, 0);
    let got = http
        .get(format!("{rest}{}", sdk_files_endpoint("out.txt")))
        .send()
        .await
        .unwrap();
    assert_eq!(got.bytes().await.unwrap().as_ref(), b"made in pod\n");
    let legacy = format!("http://{ip}:8888");
    let got = http
        .get(format!("{legacy}/download/out.txt"))
        .send()
        .await
        .unwrap();
    assert_eq!(got.bytes().await.unwrap().as_ref(), b"made in pod\n");
    let exec: serde_json::Value = http
        .post(format!("{legacy}/execute"))
        .json(&serde_json::json!({"command": "cat in/pod.txt"}))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(exec["stdout"], "written over REST");
    assert_eq!(exec["exit_code"], 0);

    // SIGKILL reaches the backgrounded grandchild, and PID 1 (sandboxd's init) reaps the
    // orphan: it does not linger as a zombie.
    let mut stream = grpc
        .start(StartRequest {
            config: Some(ProcessConfig::new([
                "/bin/sh",
                "-c",
                "sleep 100 & echo $!; sleep 100",
            ])),
            pty: None,
        })
        .await
        .unwrap()
        .into_inner();
    let id = match stream.message().await.unwrap().unwrap().event.unwrap() {
        Event::Init(init) => init.process_id,
        other => panic!("expected init, got {other:?}"),
    };
    let grandchild = match stream.message().await.unwrap().unwrap().event.unwrap() {
        Event::Stdout(b) => String::from_utf8(b).unwrap().trim().to_owned(),
        other => panic!("expected the background pid, got {other:?}"),
    };
    grpc.send_signal(sandboxd_proto::SendSignalRequest {
        process_id: id,
        signal: sandboxd_proto::Signal::Sigkill as i32,
    })
    .await
    .unwrap();
    while stream.message().await.unwrap().is_some() {}
    let probe = format!(
        "p={grandchild}; i=0; while [ $i -lt 200 ]; do [ -e /proc/$p ] || {{ echo gone; exit 0; }}; \
         i=$((i+1)); sleep 0.05; done; grep State /proc/$p/status"
    );
    let out = grpc
        .execute(sandboxd_proto::ExecuteRequest {
            config: Some(ProcessConfig::new(["/bin/sh", "-c", probe.as_str()])),
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(String::from_utf8_lossy(&out.stdout), "gone\n");

    // `docker stop` sends SIGTERM to PID 1, which passes it on: the server stops (exit 0;
    // connections still open get a few seconds), not by the SIGKILL that follows an ignored
    // SIGTERM (137).
    // Off the runtime, so our open connections keep being served (and see the server's
    // goodbye) while `docker stop` waits.
    let stopping = name.clone();
    tokio::task::spawn_blocking(move || docker(&["stop", &stopping]))
        .await
        .unwrap()
        .unwrap();
    let code = docker(&["inspect", "-f", "{{.State.ExitCode}}", &name]).unwrap();
    let logs = Command::new("docker")
        .args(["logs", &name])
        .output()
        .unwrap();
    let logs = String::from_utf8_lossy(&logs.stderr).into_owned();
    assert_eq!(code, "0", "sandboxd's log:\n{logs}");
}
