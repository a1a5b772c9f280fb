//! The E2B test server against real containers (`SANDBOX_TEST_DOCKER=1`,
//! `SANDBOX_K8S_POD_IMAGE`): lifecycle, exec in both codecs, files, pause, snapshots, lists.

mod common;

use std::time::Duration;

use common::{T, bash, docker_count, enabled};
use e2b_envd_proto::filesystem as fs;
use e2b_envd_proto::process as ep;
use reqwest::{Method, StatusCode};
use serde_json::json;

#[tokio::test]
#[cfg_attr(
    not(docker_tests),
    ignore = "needs Docker: set SANDBOX_TEST_DOCKER=1 (cargo xtask test does)"
)]
async fn create_exec_files_pause_snapshot_delete() {
    enabled();
    let t = T::start().await;
    let (id, token) = t
        .create(
            json!({"templateID": "base", "timeout": 300, "metadata": {"purpose": "test"},
                       "envVars": {"GREETING": "hello"}}),
        )
        .await;

    // Detail.
    let d = t.api("GET", &format!("/sandboxes/{id}"), None).await;
    assert_eq!(d.status, StatusCode::OK);
    assert_eq!(d.body["state"], "running");
    assert_eq!(d.body["metadata"]["purpose"], "test");
    assert_eq!(d.body["envdAccessToken"], token.as_str());
    assert!(d.body["endAt"].as_str().unwrap() > d.body["startedAt"].as_str().unwrap());

    // Exec, JSON codec: env, cwd, stdout, stderr, exit code.
    let mut req = bash("echo \"$GREETING $EXTRA\"; pwd; echo oops >&2; exit 3");
    req["process"]["envs"] = json!({"EXTRA": "world"});
    req["process"]["cwd"] = json!("/tmp");
    let run = t.run_json(&id, &token, req, &[]).await;
    assert!(run.pid.is_some());
    assert_eq!(String::from_utf8_lossy(&run.stdout), "hello world\n/tmp\n");
    assert_eq!(String::from_utf8_lossy(&run.stderr), "oops\n");
    let end = run.end.expect("end event");
    assert_eq!(
        (end.exit_code, end.exited, end.status.as_str()),
        (3, true, "exit status 3")
    );
    assert_eq!(run.end_stream, Some(json!({})));

    // Exec, proto codec; the default cwd is the user's home.
    let run = t
        .run_proto(
            &id,
            &token,
            &ep::StartRequest {
                process: Some(ep::ProcessConfig {
                    cmd: "/bin/sh".into(),
                    args: vec!["-c".into(), "pwd; printf 'a\\0b'".into()],
                    ..Default::default()
                }),
                stdin: Some(false),
                ..Default::default()
            },
        )
        .await;
    assert_eq!(run.stdout, b"/home/user\na\0b");
    assert_eq!(run.end.unwrap().exit_code, 0);

    // Files: octet-stream upload, read back, multipart upload, errors.
    let r = t
        .envd(Method::POST, &id, Some(&token), "/files?path=notes%2Fa.txt")
        .header("content-type", "application/octet-stream")
        .body("alpha")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), StatusCode::OK);
    let info: serde_json::Value = r.json().await.unwrap();
    assert_eq!(
        info,
        json!([{"path": "/home/user/notes/a.txt", "name": "a.txt", "type": "file"}])
    );
    let r = t
        .envd(
            Method::GET,
            &id,
            Some(&token),
            "/files?path=%2Fhome%2Fuser%2Fnotes%2Fa.txt",
        )
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), StatusCode::OK);
    assert_eq!(r.bytes().await.unwrap(), "alpha");
    let boundary = "XyZ";
    let mp = format!(
        "--{boundary}\r\nContent-Disposition: form-data; name=\"file\"; filename=\"/srv/b.bin\"\r\nContent-Type: application/octet-stream\r\n\r\nbeta\r\n--{boundary}\r\nContent-Disposition: form-data; name=\"file\"; filename=\"/srv/c.bin\"\r\n\r\ngamma\r\n--{boundary}--\r\n"
    );
    let r = t
        .envd(Method::POST, &id, Some(&token), "/files")
        .header(
            "content-type",
            format!("multipart/form-data; boundary={boundary}"),
        )
        .body(mp)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), StatusCode::OK);
    let info: serde_json::Value = r.json().await.unwrap();
    assert_eq!(info.as_array().unwrap().len(), 2);
    let r = t
        .envd(Method::GET, &id, Some(&token), "/files?path=/srv/c.bin")
        .send()
        .await
        .unwrap();
    assert_eq!(r.bytes().await.unwrap(), "gamma");
    let r = t
        .envd(Method::GET, &id, Some(&token), "/files?path=/nope")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), StatusCode::NOT_FOUND);
    let e: serde_json::Value = r.json().await.unwrap();
    assert_eq!(e["code"], 404);
    let r = t
        .envd(Method::GET, &id, Some(&token), "/files?path=/srv")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), StatusCode::BAD_REQUEST);
    let r = t
        .envd(
            Method::GET,
            &id,
            Some(&token),
            "/files?path=/srv/b.bin&username=mallory",
        )
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), StatusCode::UNAUTHORIZED);

    // Filesystem RPCs, JSON and proto.
    let (s, v) = t
        .unary_json(
            &id,
            &token,
            "filesystem.Filesystem/ListDir",
            json!({"path": "/srv", "depth": 1}),
        )
        .await;
    assert_eq!(s, StatusCode::OK, "{v}");
    let mut names: Vec<&str> = v["entries"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["name"].as_str().unwrap())
        .collect();
    names.sort_unstable();
    assert_eq!(names, ["b.bin", "c.bin"]);
    assert_eq!(v["entries"][0]["type"], "FILE_TYPE_FILE");
    let c = v["entries"]
        .as_array()
        .unwrap()
        .iter()
        .find(|e| e["name"] == "c.bin")
        .unwrap();
    // int64 is a string in proto3 JSON.
    assert_eq!(c["size"], "5");
    assert_eq!(c["path"], "/srv/c.bin");
    let st: fs::StatResponse = t
        .unary_proto(
            &id,
            &token,
            "filesystem.Filesystem/Stat",
            &fs::StatRequest {
                path: "/srv/c.bin".into(),
            },
        )
        .await
        .unwrap();
    let e = st.entry.unwrap();
    assert_eq!(
        (e.name.as_str(), e.size, e.r#type),
        ("c.bin", 5, fs::FileType::File as i32)
    );
    let err = t
        .unary_proto::<_, fs::StatResponse>(
            &id,
            &token,
            "filesystem.Filesystem/Stat",
            &fs::StatRequest {
                path: "/none".into(),
            },
        )
        .await
        .unwrap_err();
    assert_eq!(err.0, StatusCode::NOT_FOUND);
    assert_eq!(err.1["code"], "not_found");
    let (s, v) = t
        .unary_json(
            &id,
            &token,
            "filesystem.Filesystem/MakeDir",
            json!({"path": "/srv/d"}),
        )
        .await;
    assert_eq!(s, StatusCode::OK, "{v}");
    assert_eq!(v["entry"]["type"], "FILE_TYPE_DIRECTORY");
    let (s, v) = t
        .unary_json(
            &id,
            &token,
            "filesystem.Filesystem/MakeDir",
            json!({"path": "/srv/d"}),
        )
        .await;
    assert_eq!(
        (s, v["code"].as_str()),
        (StatusCode::CONFLICT, Some("already_exists"))
    );
    let (s, v) = t
        .unary_json(
            &id,
            &token,
            "filesystem.Filesystem/Move",
            json!({"source": "/srv/b.bin", "destination": "/srv/d/b2.bin"}),
        )
        .await;
    assert_eq!(s, StatusCode::OK, "{v}");
    assert_eq!(v["entry"]["path"], "/srv/d/b2.bin");
    let (s, _) = t
        .unary_json(
            &id,
            &token,
            "filesystem.Filesystem/Remove",
            json!({"path": "/srv/d"}),
        )
        .await;
    assert_eq!(s, StatusCode::OK);
    let (s, _) = t
        .unary_json(
            &id,
            &token,
            "filesystem.Filesystem/Stat",
            json!({"path": "/srv/d"}),
        )
        .await;
    assert_eq!(s, StatusCode::NOT_FOUND);

    // Pause: envd is gone, connect resumes (201), a second connect is 200.
    let p = t.api("POST", &format!("/sandboxes/{id}/pause"), None).await;
    assert_eq!(p.status, StatusCode::NO_CONTENT);
    let p = t.api("POST", &format!("/sandboxes/{id}/pause"), None).await;
    assert_eq!(p.status, StatusCode::CONFLICT);
    let st = test_docker::inspect(&t.s.container_of(&id).unwrap())
        .await
        .unwrap()
        .unwrap();
    assert!(st.paused);
    let d = t.api("GET", &format!("/sandboxes/{id}"), None).await;
    assert_eq!(d.body["state"], "paused");
    let r = t
        .envd(Method::GET, &id, Some(&token), "/files?path=/srv/c.bin")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), StatusCode::BAD_GATEWAY);
    let c = t
        .api(
            "POST",
            &format!("/v2/sandboxes/{id}/connect"),
            Some(json!({"timeout": 120})),
        )
        .await;
    assert_eq!(c.status, StatusCode::CREATED, "{}", c.body);
    assert_eq!(c.body["sandboxID"], id.as_str());
    let c = t
        .api(
            "POST",
            &format!("/sandboxes/{id}/connect"),
            Some(json!({"timeout": 120})),
        )
        .await;
    assert_eq!(c.status, StatusCode::OK);
    let run = t.run_json(&id, &token, bash("cat /srv/c.bin"), &[]).await;
    assert_eq!(run.stdout, b"gamma");

    // Snapshot, then a sandbox from it sees the file.
    let s = t
        .api(
            "POST",
            &format!("/sandboxes/{id}/snapshots"),
            Some(json!({"name": "with-gamma"})),
        )
        .await;
    assert_eq!(s.status, StatusCode::CREATED, "{}", s.body);
    let snap = s.body["snapshotID"].as_str().unwrap().to_owned();
    assert_eq!(s.body["names"], json!(["with-gamma"]));
    let l = t
        .api("GET", &format!("/snapshots?sandboxID={id}"), None)
        .await;
    assert_eq!(l.body.as_array().unwrap().len(), 1);
    let (id2, token2) = t.create(json!({"templateID": snap, "timeout": 60})).await;
    let run = t.run_json(&id2, &token2, bash("cat /srv/c.bin"), &[]).await;
    assert_eq!(run.stdout, b"gamma");
    let d2 = t.api("GET", &format!("/sandboxes/{id2}"), None).await;
    assert_eq!(d2.body["templateID"], snap.as_str());
    // Unknown template.
    let bad = t
        .api(
            "POST",
            "/v2/sandboxes",
            Some(json!({"templateID": "no-such-template"})),
        )
        .await;
    assert_eq!(bad.status, StatusCode::NOT_FOUND);
    assert_eq!(bad.body["code"], 404);

    // Delete: sandbox 204 then 404; the snapshot (a template) 204 then 404.
    let filter = format!("label=sandbox-harness.e2b-testserver={}", t.s.server_id());
    assert_eq!(docker_count(&["images", "-q", "--filter", &filter]), 1);
    assert_eq!(
        t.api("DELETE", &format!("/sandboxes/{id2}"), None)
            .await
            .status,
        StatusCode::NO_CONTENT
    );
    assert_eq!(
        t.api("DELETE", &format!("/templates/{snap}"), None)
            .await
            .status,
        StatusCode::NO_CONTENT
    );
    assert_eq!(
        t.api("DELETE", &format!("/templates/{snap}"), None)
            .await
            .status,
        StatusCode::NOT_FOUND
    );
    assert_eq!(docker_count(&["images", "-q", "--filter", &filter]), 0);
    assert_eq!(
        t.api("DELETE", &format!("/sandboxes/{id}"), None)
            .await
            .status,
        StatusCode::NO_CONTENT
    );
    let g = t.api("DELETE", &format!("/sandboxes/{id}"), None).await;
    assert_eq!(
        (g.status, g.body["code"].as_i64()),
        (StatusCode::NOT_FOUND, Some(404))
    );
    assert_eq!(docker_count(&["ps", "-aq", "--filter", &filter]), 0);
}

#[tokio::test]
#[cfg_attr(
    not(docker_tests),
    ignore = "needs Docker: set SANDBOX_TEST_DOCKER=1 (cargo xtask test does)"
)]
async fn list_pagination_metadata_and_state() {
    enabled();
    let t = T::start().await;
    let mut ids = Vec::new();
    for (i, team) in ["red", "red", "blue"].iter().enumerate() {
        let (id, _) = t
            .create(json!({"templateID": "base", "metadata": {"team": team, "n": i.to_string(), "odd key": "a&b"}}))
            .await;
        ids.push(id);
    }
    // Pages of 2: the token leads to the rest.
    let p1 = t.api("GET", "/v2/sandboxes?limit=2", None).await;
    assert_eq!(p1.status, StatusCode::OK);
    assert_eq!(p1.body.as_array().unwrap().len(), 2);
    assert_eq!(p1.headers["x-total-running"], "3");
    let tok = p1.headers["x-next-token"].to_str().unwrap().to_owned();
    let p2 = t
        .api(
            "GET",
            &format!("/v2/sandboxes?limit=2&nextToken={tok}"),
            None,
        )
        .await;
    assert_eq!(p2.body.as_array().unwrap().len(), 1);
    assert!(p2.headers.get("x-next-token").is_none());
    let mut seen: Vec<String> = p1
        .body
        .as_array()
        .unwrap()
        .iter()
        .chain(p2.body.as_array().unwrap())
        .map(|s| s["sandboxID"].as_str().unwrap().to_owned())
        .collect();
    seen.sort();
    let mut want = ids.clone();
    want.sort();
    assert_eq!(seen, want);
    // Metadata: ONE query parameter holding url-encoded k=v&k2=v2 (keys and values quoted).
    let red = t
        .api("GET", "/v2/sandboxes?metadata=team%3Dred", None)
        .await;
    assert_eq!(red.body.as_array().unwrap().len(), 2);
    let one = t
        .api("GET", "/v2/sandboxes?metadata=team%3Dred%26n%3D1", None)
        .await;
    assert_eq!(one.body.as_array().unwrap().len(), 1);
    assert_eq!(one.body[0]["sandboxID"], ids[1].as_str());
    let odd = t
        .api(
            "GET",
            "/v2/sandboxes?metadata=odd%2520key%3Da%2526b%26team%3Dblue",
            None,
        )
        .await;
    assert_eq!(odd.body.as_array().unwrap().len(), 1, "{}", odd.body);
    // State filter.
    assert_eq!(
        t.api("POST", &format!("/sandboxes/{}/pause", ids[0]), None)
            .await
            .status,
        StatusCode::NO_CONTENT
    );
    let paused = t.api("GET", "/v2/sandboxes?state=paused", None).await;
    assert_eq!(paused.body.as_array().unwrap().len(), 1);
    assert_eq!(paused.body[0]["state"], "paused");
    assert_eq!(paused.headers["x-total-running"], "2");
    let v1 = t.api("GET", "/sandboxes", None).await;
    assert_eq!(v1.body.as_array().unwrap().len(), 2);
    let bad = t.api("GET", "/v2/sandboxes?limit=0", None).await;
    assert_eq!(bad.status, StatusCode::BAD_REQUEST);
    let bad = t.api("GET", "/v2/sandboxes?nextToken=garbage", None).await;
    assert_eq!(bad.status, StatusCode::BAD_REQUEST);
}

#[tokio::test]
#[cfg_attr(
    not(docker_tests),
    ignore = "needs Docker: set SANDBOX_TEST_DOCKER=1 (cargo xtask test does)"
)]
async fn signals_deadlines_list_and_connect() {
    enabled();
    let t = T::start().await;
    let (id, token) = t.create(json!({"templateID": "base"})).await;
    // The call's deadline kills the command and ends the stream deadline_exceeded.
    let started = std::time::Instant::now();
    let run = t
        .run_json(
            &id,
            &token,
            bash("echo before; sleep 30"),
            &[("connect-timeout-ms", "1500")],
        )
        .await;
    assert!(started.elapsed() < Duration::from_secs(10));
    assert_eq!(run.stdout, b"before\n");
    assert_eq!(
        run.end_stream.as_ref().unwrap()["error"]["code"],
        "deadline_exceeded"
    );

    // A background process: List shows it, Connect follows it, SendSignal kills it.
    let t2 = std::sync::Arc::new(t);
    let tt = t2.clone();
    let (idc, tokc) = (id.clone(), token.clone());
    let bg = tokio::spawn(async move {
        let mut req = bash("echo up; sleep 60");
        req["tag"] = json!("sleeper");
        tt.run_json(&idc, &tokc, req, &[]).await
    });
    let mut pid = None;
    for _ in 0..50 {
        let (s, v) = t2
            .unary_json(&id, &token, "process.Process/List", json!({}))
            .await;
        assert_eq!(s, StatusCode::OK);
        if let Some(p) = v["processes"]
            .as_array()
            .and_then(|a| a.iter().find(|p| p["tag"] == "sleeper"))
        {
            assert_eq!(p["config"]["cmd"], "/bin/bash");
            pid = p["pid"].as_u64();
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let pid = pid.expect("the tagged process is listed");
    let tt = t2.clone();
    let (idc, tokc) = (id.clone(), token.clone());
    let follower = tokio::spawn(async move {
        let body = e2b_envd_proto::envelope::encode(
            0,
            json!({"process": {"tag": "sleeper"}})
                .to_string()
                .as_bytes(),
        );
        let r = tt
            .envd(Method::POST, &idc, Some(&tokc), "/process.Process/Connect")
            .header("content-type", "application/connect+json")
            .body(body)
            .send()
            .await
            .unwrap();
        r.bytes().await.unwrap()
    });
    tokio::time::sleep(Duration::from_millis(300)).await;
    let (s, v) = t2
        .unary_json(
            &id,
            &token,
            "process.Process/SendSignal",
            json!({"process": {"pid": pid}, "signal": "SIGNAL_SIGKILL"}),
        )
        .await;
    assert_eq!(s, StatusCode::OK, "{v}");
    let run = bg.await.unwrap();
    assert_eq!(run.stdout, b"up\n");
    let end = run.end.unwrap();
    assert_eq!(
        (end.exit_code, end.exited, end.status.as_str()),
        (-1, false, "signal: killed")
    );
    let followed = follower.await.unwrap();
    assert!(String::from_utf8_lossy(&followed).contains("signal: killed"));
    let (s, v) = t2
        .unary_json(
            &id,
            &token,
            "process.Process/SendSignal",
            json!({"process": {"pid": pid}, "signal": "SIGNAL_SIGKILL"}),
        )
        .await;
    assert_eq!(
        (s, v["code"].as_str()),
        (StatusCode::NOT_FOUND, Some("not_found"))
    );
    // A proto-codec SendSignal for a missing process.
    let err = t2
        .unary_proto::<_, ep::SendSignalResponse>(
            &id,
            &token,
            "process.Process/SendSignal",
            &ep::SendSignalRequest {
                process: Some(ep::ProcessSelector::pid(9999)),
                signal: ep::Signal::Sigterm as i32,
            },
        )
        .await
        .unwrap_err();
    assert_eq!(err.0, StatusCode::NOT_FOUND);
}
