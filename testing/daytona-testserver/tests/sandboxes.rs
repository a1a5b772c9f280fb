//! Sandboxes as real containers (the pod image: Debian + sandboxd): lifecycle, the toolbox's
//! execute, files and sessions, faults, and cleanup. Needs Docker and the image
//! (`SANDBOX_TEST_DOCKER=1`, as `cargo xtask test` sets).

use std::time::Duration;

use daytona_testserver::{DaytonaTestServer, FailState, TestServerOptions};
use serde_json::{Value, json};

struct Client {
    http: reqwest::Client,
    api: String,
    key: String,
}

impl Client {
    fn new(s: &DaytonaTestServer) -> Self {
        Self {
            http: reqwest::Client::new(),
            api: s.api_url(),
            key: s.api_key().to_owned(),
        }
    }

    async fn send(&self, rb: reqwest::RequestBuilder) -> (u16, Value) {
        let r = rb.bearer_auth(&self.key).send().await.expect("sent");
        let code = r.status().as_u16();
        let body = r.bytes().await.expect("body");
        (code, serde_json::from_slice(&body).unwrap_or(Value::Null))
    }

    async fn api_get(&self, path: &str) -> (u16, Value) {
        self.send(self.http.get(format!("{}{path}", self.api)))
            .await
    }

    async fn api_post(&self, path: &str) -> (u16, Value) {
        self.send(self.http.post(format!("{}{path}", self.api)))
            .await
    }

    /// Create a sandbox and wait for `started`; (id, toolbox base).
    async fn started(&self, body: Value) -> (String, String) {
        let (code, v) = self
            .send(self.http.post(format!("{}/sandbox", self.api)).json(&body))
            .await;
        assert_eq!(code, 200, "{v}");
        assert_eq!(
            v["state"], "creating",
            "create answers before the sandbox runs"
        );
        let id = v["id"].as_str().unwrap().to_owned();
        let toolbox = format!("{}/{id}", v["toolboxProxyUrl"].as_str().unwrap());
        self.wait_state(&id, "started").await;
        (id, toolbox)
    }

    async fn wait_state(&self, id: &str, want: &str) {
        let mut last = Value::Null;
        for _ in 0..600 {
            let (_, v) = self.api_get(&format!("/sandbox/{id}")).await;
            if v["state"] == want {
                return;
            }
            last = v;
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        panic!("sandbox {id} never reached {want}: {last}");
    }

    async fn execute(&self, toolbox: &str, body: Value) -> (u16, Value) {
        self.send(
            self.http
                .post(format!("{toolbox}/process/execute"))
                .json(&body),
        )
        .await
    }
}

async fn server() -> DaytonaTestServer {
    DaytonaTestServer::start(TestServerOptions::default())
        .await
        .expect("server")
}

fn containers_of(server_id: &str) -> usize {
    let out = std::process::Command::new("docker")
        .args([
            "ps",
            "-aq",
            "--filter",
            &format!("label=sandbox-harness.daytona-testserver={server_id}"),
        ])
        .output()
        .expect("docker ps");
    String::from_utf8_lossy(&out.stdout)
        .split_whitespace()
        .count()
}

#[tokio::test]
#[cfg_attr(
    not(docker_tests),
    ignore = "needs Docker and the pod image: cargo xtask test"
)]
async fn execute_runs_a_shell_with_cwd_env_and_timeout() {
    let s = server().await;
    let c = Client::new(&s);
    let (_, tb) = c
        .started(json!({"env": {"FROM_CREATE": "yes"}, "labels": {"t": "exec"}}))
        .await;
    let (code, v) = c
        .execute(
            &tb,
            json!({"command": "echo out; echo err >&2; echo $FROM_CREATE; exit 3"}),
        )
        .await;
    assert_eq!(code, 200, "{v}");
    assert_eq!(v["exitCode"], 3);
    let result = v["result"].as_str().unwrap();
    for want in ["out", "err", "yes"] {
        assert!(result.contains(want), "{want} in {result:?}");
    }
    let (_, v) = c
        .execute(
            &tb,
            json!({"command": "pwd; echo $X", "cwd": "/tmp", "envs": {"X": "x1"}}),
        )
        .await;
    assert_eq!(v["result"], "/tmp\nx1\n");
    // A relative cwd is under the work dir.
    let (_, v) = c.execute(&tb, json!({"command": "pwd", "cwd": "."})).await;
    assert_eq!(v["result"], format!("{}\n", daytona_testserver::WORK_DIR));
    // The command is the shell's stdin: several lines, quotes and all.
    let (_, v) = c
        .execute(&tb, json!({"command": "a='it''s'\nprintf '%s\\n' \"$a\""}))
        .await;
    assert_eq!(v["result"], "its\n");
    let (code, _) = c.execute(&tb, json!({"command": "  "})).await;
    assert_eq!(code, 400);
    let (_, v) = c
        .execute(&tb, json!({"command": "true", "cwd": "/no/such/dir"}))
        .await;
    assert_eq!(
        v["exitCode"], -1,
        "a process that cannot start: exit code -1"
    );
    // Over the timeout: 408, and the process group (grandchildren too) is killed.
    let t = std::time::Instant::now();
    let (code, v) = c
        .execute(
            &tb,
            json!({"command": "sleep 300 & echo $! > /tmp/gc.pid; wait", "timeout": 1}),
        )
        .await;
    assert_eq!(code, 408, "{v}");
    assert_eq!(v["message"], "request timeout: command execution timeout");
    assert!(t.elapsed() < Duration::from_secs(10));
    let (_, v) = c
        .execute(
            &tb,
            json!({"command": "p=$(cat /tmp/gc.pid); sleep 0.3; if [ -e /proc/$p ] && ! grep -q '^State:.*Z' /proc/$p/status; then echo alive; else echo dead; fi"}),
        )
        .await;
    assert_eq!(v["result"], "dead\n");
}

#[tokio::test]
#[cfg_attr(
    not(docker_tests),
    ignore = "needs Docker and the pod image: cargo xtask test"
)]
async fn files_upload_download_list_info_folder_move_delete() {
    let s = server().await;
    let c = Client::new(&s);
    let (_, tb) = c.started(json!({})).await;
    let payload: Vec<u8> = (0..=255u8).cycle().take(70_000).collect();
    // Single upload (multipart `file`).
    let form = reqwest::multipart::Form::new().part(
        "file",
        reqwest::multipart::Part::bytes(payload.clone()).file_name("x"),
    );
    let (code, _) = c
        .send(
            c.http
                .post(format!("{tb}/files/upload?path=/tmp/f/one.bin"))
                .multipart(form),
        )
        .await;
    assert_eq!(code, 200);
    // Bulk upload (`files[i].path` / `files[i].file`), relative path under the work dir.
    let form = reqwest::multipart::Form::new()
        .text("files[0].path", "/tmp/f/two.txt")
        .part(
            "files[0].file",
            reqwest::multipart::Part::bytes(b"two".to_vec()).file_name("two.txt"),
        )
        .text("files[1].path", "rel.txt")
        .part(
            "files[1].file",
            reqwest::multipart::Part::bytes(b"rel".to_vec()).file_name("rel.txt"),
        );
    let (code, v) = c
        .send(
            c.http
                .post(format!("{tb}/files/bulk-upload"))
                .multipart(form),
        )
        .await;
    assert_eq!(code, 200, "{v}");
    let r = c
        .http
        .get(format!("{tb}/files/download?path=/tmp/f/one.bin"))
        .bearer_auth(&c.key)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    assert_eq!(r.bytes().await.unwrap().as_ref(), payload.as_slice());
    // Bulk download: a multipart answer, a file part per path and an error part for a miss.
    let r = c
        .http
        .post(format!("{tb}/files/bulk-download"))
        .bearer_auth(&c.key)
        .json(&json!({"paths": ["/tmp/f/two.txt", "/tmp/f/missing"]}))
        .send()
        .await
        .unwrap();
    let ct = r.headers()["content-type"].to_str().unwrap().to_owned();
    assert!(ct.starts_with("multipart/form-data; boundary="), "{ct}");
    let body = String::from_utf8_lossy(&r.bytes().await.unwrap()).into_owned();
    assert!(body.contains("name=\"file\"; filename=\"/tmp/f/two.txt\"\r\nContent-Type: application/octet-stream\r\n\r\ntwo\r\n"), "{body}");
    assert!(
        body.contains("name=\"error\"; filename=\"/tmp/f/missing\""),
        "{body}"
    );
    // List and info.
    let (code, list) = c.send(c.http.get(format!("{tb}/files?path=/tmp/f"))).await;
    assert_eq!(code, 200);
    let names: Vec<&str> = list
        .as_array()
        .unwrap()
        .iter()
        .map(|f| f["name"].as_str().unwrap())
        .collect();
    assert_eq!(names, ["one.bin", "two.txt"]);
    let one = &list[0];
    assert_eq!(one["size"], 70_000);
    assert_eq!(one["isDir"], false);
    assert_eq!(one["permissions"], "0644");
    assert_eq!(one["mode"], "-rw-r--r--");
    for f in ["owner", "group", "modTime"] {
        assert!(one[f].is_string(), "{f}: {one}");
    }
    let (code, info) = c
        .send(c.http.get(format!("{tb}/files/info?path=/tmp/f")))
        .await;
    assert_eq!((code, info["isDir"].as_bool()), (200, Some(true)));
    let (code, _) = c
        .send(c.http.get(format!("{tb}/files/info?path=/tmp/nope")))
        .await;
    assert_eq!(code, 404);
    // Folder, move, delete.
    let (code, _) = c
        .send(
            c.http
                .post(format!("{tb}/files/folder?path=/tmp/f/sub&mode=0700")),
        )
        .await;
    assert_eq!(code, 201);
    let (code, _) = c
        .send(c.http.post(format!(
            "{tb}/files/move?source=/tmp/f/two.txt&destination=/tmp/f/sub/moved.txt"
        )))
        .await;
    assert_eq!(code, 200);
    let (_, v) = c
        .execute(
            &tb,
            json!({"command": "stat -c %a /tmp/f/sub; cat /tmp/f/sub/moved.txt; cat rel.txt"}),
        )
        .await;
    assert_eq!(v["result"], "700\ntworel");
    let (code, _) = c
        .send(c.http.delete(format!("{tb}/files?path=/tmp/f")))
        .await;
    assert_eq!(code, 409, "a non-empty directory needs recursive");
    let (code, _) = c
        .send(
            c.http
                .delete(format!("{tb}/files?path=/tmp/f&recursive=true")),
        )
        .await;
    assert_eq!(code, 204);
    let (code, _) = c
        .send(
            c.http
                .get(format!("{tb}/files/download?path=/tmp/f/one.bin")),
        )
        .await;
    assert_eq!(code, 404);
}

#[tokio::test]
#[cfg_attr(
    not(docker_tests),
    ignore = "needs Docker and the pod image: cargo xtask test"
)]
async fn sessions_sync_async_status_and_logs() {
    let s = server().await;
    let c = Client::new(&s);
    let (_, tb) = c.started(json!({})).await;
    let (code, _) = c
        .send(
            c.http
                .post(format!("{tb}/process/session"))
                .json(&json!({"sessionId": "s"})),
        )
        .await;
    assert_eq!(code, 201);
    let (code, v) = c
        .send(
            c.http
                .post(format!("{tb}/process/session/s/exec"))
                .json(&json!({"command": "echo o; echo e >&2; exit 4"})),
        )
        .await;
    assert_eq!(code, 200);
    assert_eq!(
        (
            v["exitCode"].as_i64(),
            v["stdout"].as_str(),
            v["stderr"].as_str()
        ),
        (Some(4), Some("o\n"), Some("e\n"))
    );
    // The session's shell state carries over: `cd` and `export`, even after `exit`.
    for cmd in [
        "cd /tmp; export SESSION_VAR=kept; exit 0",
        "echo \"$(pwd) $SESSION_VAR\"",
    ] {
        let (_, v) = c
            .send(
                c.http
                    .post(format!("{tb}/process/session/s/exec"))
                    .json(&json!({"command": cmd})),
            )
            .await;
        if cmd.starts_with("echo") {
            assert_eq!(v["stdout"], "/tmp kept\n", "{v}");
        }
    }
    let (code, v) = c
        .send(
            c.http
                .post(format!("{tb}/process/session/s/exec"))
                .json(&json!({"command": "sleep 0.3; echo later", "runAsync": true})),
        )
        .await;
    assert_eq!(code, 202);
    let cmd = v["cmdId"].as_str().unwrap().to_owned();
    let (_, status) = c
        .send(c.http.get(format!("{tb}/process/session/s/command/{cmd}")))
        .await;
    assert!(status.get("exitCode").is_none(), "still running: {status}");
    let mut done = Value::Null;
    for _ in 0..100 {
        let (_, st) = c
            .send(c.http.get(format!("{tb}/process/session/s/command/{cmd}")))
            .await;
        if st.get("exitCode").is_some() {
            done = st;
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(done["exitCode"], 0);
    let (_, logs) = c
        .send(
            c.http
                .get(format!("{tb}/process/session/s/command/{cmd}/logs")),
        )
        .await;
    assert_eq!(logs["stdout"], "later\n");
    let (_, sess) = c.send(c.http.get(format!("{tb}/process/session/s"))).await;
    assert_eq!(sess["commands"].as_array().unwrap().len(), 4);
    let (code, _) = c
        .send(c.http.delete(format!("{tb}/process/session/s")))
        .await;
    assert_eq!(code, 204);
}

#[tokio::test]
#[cfg_attr(
    not(docker_tests),
    ignore = "needs Docker and the pod image: cargo xtask test"
)]
async fn stop_start_vanish_break_and_cleanup() {
    let mut s = server().await;
    let c = Client::new(&s);
    let (id, tb) = c.started(json!({"name": "keeper"})).await;
    c.execute(&tb, json!({"command": "echo kept > /tmp/k"}))
        .await;
    let (code, v) = c.api_post(&format!("/sandbox/{id}/stop")).await;
    assert_eq!(code, 200, "{v}");
    c.wait_state(&id, "stopped").await;
    let (code, _) = c.execute(&tb, json!({"command": "true"})).await;
    assert_eq!(code, 409, "the toolbox of a stopped sandbox answers 409");
    c.api_post("/sandbox/keeper/start").await;
    c.wait_state(&id, "started").await;
    let (_, v) = c.execute(&tb, json!({"command": "cat /tmp/k"})).await;
    assert_eq!(
        v["result"], "kept\n",
        "the container's files survive stop/start"
    );
    // A sandbox broken by a fault is `error` with its reason, and stays so.
    s.faults()
        .break_sandbox(&id, FailState::Error, "disk on fire")
        .await
        .unwrap();
    let (_, v) = c.api_get(&format!("/sandbox/{id}")).await;
    assert_eq!(
        (v["state"].as_str(), v["errorReason"].as_str()),
        (Some("error"), Some("disk on fire"))
    );
    // Vanished: the API forgets it, the container is gone.
    let (other, _) = c.started(json!({})).await;
    let container = s.container_of(&other).unwrap();
    s.faults().vanish(&other).await.unwrap();
    assert_eq!(c.api_get(&format!("/sandbox/{other}")).await.0, 404);
    let gone = std::process::Command::new("docker")
        .args(["inspect", &container])
        .output()
        .unwrap();
    assert!(
        !gone.status.success(),
        "the vanished sandbox's container is removed"
    );
    assert!(containers_of(s.server_id()) >= 1);
    let server_id = s.server_id().to_owned();
    s.shutdown();
    assert_eq!(
        containers_of(&server_id),
        0,
        "shutdown removes every container"
    );
}

#[tokio::test]
#[cfg_attr(
    not(docker_tests),
    ignore = "needs Docker and the pod image: cargo xtask test"
)]
async fn an_idle_sandbox_is_auto_stopped() {
    // One auto-stop "minute" is half a second here.
    let s = DaytonaTestServer::start(TestServerOptions {
        autostop_unit: Duration::from_millis(500),
        ..TestServerOptions::default()
    })
    .await
    .expect("server");
    let c = Client::new(&s);
    let (idle, _) = c.started(json!({"autoStopInterval": 1})).await;
    let (never, _) = c.started(json!({"autoStopInterval": 0})).await;
    c.wait_state(&idle, "stopped").await;
    let (_, v) = c.api_get(&format!("/sandbox/{never}")).await;
    assert_eq!(v["state"], "started", "autoStopInterval 0 never stops");
}
