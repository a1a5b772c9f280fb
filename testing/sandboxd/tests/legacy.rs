//! The legacy python-runtime API, as SDK 1.0.8 calls it (paths percent-encoded with
//! `quote(path, safe='')`), against a real server on loopback.

mod common;

use common::{Harness, quote, read};
use reqwest::StatusCode;
use serde_json::{Value, json};

async fn json_of(response: reqwest::Response) -> (StatusCode, Value) {
    let status = response.status();
    (status, response.json().await.unwrap())
}

#[tokio::test]
async fn health_and_execute() {
    let h = Harness::start().await;
    let (status, body) = json_of(h.http.get(h.legacy("/")).send().await.unwrap()).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(body["status"], "ok");

    std::fs::write(h.base().join("here.txt"), b"x").unwrap();
    let exec = |command: &str| {
        h.http
            .post(h.legacy("/execute"))
            .json(&json!({ "command": command }))
            .send()
    };
    // shlex-style split, no shell: quotes group, `;` is an ordinary argument; cwd is the base.
    let (status, body) = json_of(exec("sh -c 'ls; echo \"a b\" >&2; exit 4'").await.unwrap()).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(body["stdout"], "here.txt\n");
    assert_eq!(body["stderr"], "a b\n");
    assert_eq!(body["exit_code"], 4);
    assert_eq!(body["timed_out"], false);
    let (_, body) = json_of(exec("echo one ; two").await.unwrap()).await;
    assert_eq!(body["stdout"], "one ; two\n");

    // Spawn errors and unsplittable commands are still 200, with exit_code 1.
    for bad in ["/no/such/program", "echo 'unterminated", ""] {
        let (status, body) = json_of(exec(bad).await.unwrap()).await;
        assert_eq!(status, StatusCode::OK, "{bad}");
        assert_eq!(body["exit_code"], 1, "{bad}");
        assert!(
            body["stderr"]
                .as_str()
                .unwrap()
                .starts_with("Failed to execute command")
        );
    }

    // The SDK's `timeout_seconds`: the group is killed and the answer says so.
    let (status, body) = json_of(
        h.http
            .post(h.legacy("/execute"))
            .json(&json!({
                "command": "sh -c 'sleep 100 & echo $! > bg.pid; sleep 100'",
                "timeout_seconds": 2.0,
            }))
            .send()
            .await
            .unwrap(),
    )
    .await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(body["timed_out"], true);
    assert_eq!(body["exit_code"], 124);
    // The whole group died, the backgrounded grandchild included.
    let pid: i32 = std::fs::read_to_string(h.base().join("bg.pid"))
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    common::eventually_gone(pid).await;
}

#[tokio::test]
async fn upload_download_list_exists_round_trip() {
    let h = Harness::start().await;
    let form = reqwest::multipart::Form::new().part(
        "file",
        reqwest::multipart::Part::bytes(b"payload".to_vec()).file_name("dir/sub/f.txt"),
    );
    let (status, body) = json_of(
        h.http
            .post(h.legacy("/upload"))
            .multipart(form)
            .send()
            .await
            .unwrap(),
    )
    .await;
    assert_eq!(status, StatusCode::OK, "{body}");
    assert!(body["message"].is_string());
    assert_eq!(read(h.base().join("dir/sub/f.txt")), b"payload");

    let download = h
        .http
        .get(h.legacy(&format!("/download/{}", quote("dir/sub/f.txt"))))
        .send()
        .await
        .unwrap();
    assert_eq!(download.status(), StatusCode::OK);
    assert_eq!(
        download.headers()["content-type"],
        "application/octet-stream"
    );
    assert_eq!(download.bytes().await.unwrap().as_ref(), b"payload");
    let (status, body) =
        json_of(h.http.get(h.legacy("/download/nope")).send().await.unwrap()).await;
    assert_eq!(
        (status, body),
        (StatusCode::NOT_FOUND, json!({"message": "File not found"}))
    );

    let (status, body) = json_of(
        h.http
            .get(h.legacy(&format!("/list/{}", quote("dir"))))
            .send()
            .await
            .unwrap(),
    )
    .await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(body[0]["name"], "sub");
    assert_eq!(body[0]["type"], "directory");
    assert!(body[0]["mod_time"].as_f64().unwrap() > 1.0e9);
    let (_, body) = json_of(
        h.http
            .get(h.legacy(&format!("/list/{}", quote("dir/sub"))))
            .send()
            .await
            .unwrap(),
    )
    .await;
    assert_eq!(
        body,
        json!([{"name": "f.txt", "size": 7, "type": "file", "mod_time": body[0]["mod_time"]}])
    );
    let (_, root) = json_of(h.http.get(h.legacy("/list/")).send().await.unwrap()).await;
    assert_eq!(root[0]["name"], "dir");
    let missing = h.http.get(h.legacy("/list/nope")).send().await.unwrap();
    assert_eq!(missing.status(), StatusCode::NOT_FOUND);

    let (_, body) = json_of(
        h.http
            .get(h.legacy(&format!("/exists/{}", quote("dir/sub/f.txt"))))
            .send()
            .await
            .unwrap(),
    )
    .await;
    assert_eq!(body, json!({"path": "dir/sub/f.txt", "exists": true}));
    let (_, body) = json_of(h.http.get(h.legacy("/exists/nope")).send().await.unwrap()).await;
    assert_eq!(body["exists"], false);

    // An absolute path under the base directory is accepted.
    let abs = h.base().join("dir/sub/f.txt");
    let download = h
        .http
        .get(h.legacy(&format!("/download/{}", quote(abs.to_str().unwrap()))))
        .send()
        .await
        .unwrap();
    assert_eq!(download.bytes().await.unwrap().as_ref(), b"payload");
}

#[tokio::test]
async fn escapes_answer_access_denied_and_touch_nothing_outside() {
    let h = Harness::start().await;
    std::os::unix::fs::symlink(h.outside(), h.base().join("out")).unwrap();
    let denied = json!({"message": "Access denied"});
    let outside_secret = h.outside().join("secret");
    for name in [
        "../outside/secret".to_owned(),
        outside_secret.to_str().unwrap().to_owned(),
        "out/secret".to_owned(),
    ] {
        let form = reqwest::multipart::Form::new().part(
            "file",
            reqwest::multipart::Part::bytes(b"pwned".to_vec()).file_name(name.clone()),
        );
        let (status, body) = json_of(
            h.http
                .post(h.legacy("/upload"))
                .multipart(form)
                .send()
                .await
                .unwrap(),
        )
        .await;
        assert_eq!((status, &body), (StatusCode::FORBIDDEN, &denied), "{name}");
        for endpoint in ["download", "exists", "list"] {
            let url = h.legacy(&format!("/{endpoint}/{}", quote(&name)));
            let (status, body) = json_of(h.http.get(&url).send().await.unwrap()).await;
            assert_eq!(
                (status, &body),
                (StatusCode::FORBIDDEN, &denied),
                "{endpoint} {name}"
            );
        }
    }
    let form = reqwest::multipart::Form::new().part(
        "file",
        reqwest::multipart::Part::bytes(b"pwned".to_vec()).file_name("out/new"),
    );
    let status = h
        .http
        .post(h.legacy("/upload"))
        .multipart(form)
        .send()
        .await
        .unwrap()
        .status();
    assert_eq!(status, StatusCode::FORBIDDEN);
    h.assert_outside_untouched();
}
