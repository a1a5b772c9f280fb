//! sandboxd's REST API against a real server on loopback and a temporary base directory.

mod common;

use common::{Harness, read, sdk_files_endpoint};
use reqwest::StatusCode;
use serde_json::Value;

async fn error_code(response: reqwest::Response) -> String {
    let body: Value = response.json().await.unwrap();
    assert!(body["message"].is_string(), "{body}");
    body["code"].as_str().unwrap().to_owned()
}

#[tokio::test]
async fn put_get_head_round_trip_with_sdk_encoding() {
    let h = Harness::start().await;
    let url = h.rest(&sdk_files_endpoint("dir/sub/hello.txt"));
    let put = h.http.put(&url).body("hello world").send().await.unwrap();
    assert_eq!(put.status(), StatusCode::NO_CONTENT);
    assert_eq!(read(h.base().join("dir/sub/hello.txt")), b"hello world");

    let get = h.http.get(&url).send().await.unwrap();
    assert_eq!(get.status(), StatusCode::OK);
    assert_eq!(get.headers()["content-type"], "application/octet-stream");
    assert_eq!(get.bytes().await.unwrap().as_ref(), b"hello world");

    // Plain slashes reach the same file.
    let plain = h
        .http
        .get(h.rest("/v1/files/dir/sub/hello.txt"))
        .send()
        .await
        .unwrap();
    assert_eq!(plain.bytes().await.unwrap().as_ref(), b"hello world");

    let head = h.http.head(&url).send().await.unwrap();
    assert_eq!(head.status(), StatusCode::OK);
    let missing = h
        .http
        .head(h.rest(&sdk_files_endpoint("nope.txt")))
        .send()
        .await
        .unwrap();
    assert_eq!(missing.status(), StatusCode::NOT_FOUND);
    let missing = h
        .http
        .get(h.rest(&sdk_files_endpoint("nope.txt")))
        .send()
        .await
        .unwrap();
    assert_eq!(missing.status(), StatusCode::NOT_FOUND);
    assert_eq!(error_code(missing).await, "NOT_FOUND");
}

#[tokio::test]
async fn put_sets_mode_replaces_atomically_and_leaves_no_temp_files() {
    use std::os::unix::fs::PermissionsExt as _;
    let h = Harness::start().await;
    let url = h.rest(&sdk_files_endpoint("run.sh"));
    let put = h
        .http
        .put(format!("{url}?mode=0750"))
        .body("v1")
        .send()
        .await
        .unwrap();
    assert_eq!(put.status(), StatusCode::NO_CONTENT);
    let mode = std::fs::metadata(h.base().join("run.sh"))
        .unwrap()
        .permissions()
        .mode();
    assert_eq!(mode & 0o777, 0o750);

    // A body larger than one chunk, streamed.
    let big: Vec<u8> = (0..300_000u32).map(|i| (i % 251) as u8).collect();
    let put = h.http.put(&url).body(big.clone()).send().await.unwrap();
    assert_eq!(put.status(), StatusCode::NO_CONTENT);
    assert_eq!(read(h.base().join("run.sh")), big);
    let get = h.http.get(&url).send().await.unwrap();
    assert_eq!(
        get.headers()["content-length"],
        big.len().to_string().as_str()
    );
    assert_eq!(get.bytes().await.unwrap().as_ref(), &big[..]);

    let bad = h
        .http
        .put(format!("{url}?mode=755"))
        .body("x")
        .send()
        .await
        .unwrap();
    assert_eq!(bad.status(), StatusCode::BAD_REQUEST);
    assert_eq!(error_code(bad).await, "INVALID_ARGUMENT");
    assert_eq!(
        read(h.base().join("run.sh")),
        big,
        "a refused PUT changes nothing"
    );

    // A body that breaks off mid-way leaves the old content and no temporary file.
    let failing = futures::stream::iter(vec![
        Ok::<_, std::io::Error>(bytes::Bytes::from_static(b"partial")),
        Err(std::io::Error::other("client gave up")),
    ]);
    let broken = h
        .http
        .put(&url)
        .body(reqwest::Body::wrap_stream(failing))
        .send()
        .await;
    assert!(broken.is_err() || broken.unwrap().status() != StatusCode::NO_CONTENT);
    let names: Vec<_> = std::fs::read_dir(h.base())
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    // The server may still be cleaning up after the broken connection: wait for it.
    for _ in 0..200 {
        let names: Vec<_> = std::fs::read_dir(h.base())
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .collect();
        if names == ["run.sh"] {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    let after: Vec<_> = std::fs::read_dir(h.base())
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    assert_eq!(after, ["run.sh"], "before: {names:?}");
    assert_eq!(read(h.base().join("run.sh")), big);

    // PUT onto a directory is refused.
    std::fs::create_dir(h.base().join("adir")).unwrap();
    let onto_dir = h
        .http
        .put(h.rest(&sdk_files_endpoint("adir")))
        .body("x")
        .send()
        .await
        .unwrap();
    assert_eq!(onto_dir.status(), StatusCode::BAD_REQUEST);
}

#[tokio::test]
async fn put_accepts_a_multipart_file_part() {
    let h = Harness::start().await;
    let form = reqwest::multipart::Form::new()
        .text("other", "ignored")
        .part(
            "file",
            reqwest::multipart::Part::bytes(b"from a form".to_vec()).file_name("x"),
        );
    let put = h
        .http
        .put(h.rest(&sdk_files_endpoint("form.txt")))
        .multipart(form)
        .send()
        .await
        .unwrap();
    assert_eq!(put.status(), StatusCode::NO_CONTENT);
    assert_eq!(read(h.base().join("form.txt")), b"from a form");
}

#[tokio::test]
async fn directory_listing_has_the_sandboxd_shape() {
    let h = Harness::start().await;
    std::fs::create_dir_all(h.base().join("d/inner")).unwrap();
    std::fs::write(h.base().join("d/a.txt"), b"12345").unwrap();
    std::os::unix::fs::symlink("a.txt", h.base().join("d/link")).unwrap();
    std::os::unix::fs::symlink("../../outside/secret", h.base().join("d/leak")).unwrap();

    for url in [h.rest(&sdk_files_endpoint("d")), h.rest("/v1/files/d/")] {
        let listing: Value = h.http.get(&url).send().await.unwrap().json().await.unwrap();
        assert_eq!(listing["path"], "/d");
        let entries = listing["entries"].as_array().unwrap();
        let names: Vec<_> = entries
            .iter()
            .map(|e| e["name"].as_str().unwrap())
            .collect();
        // Sorted; the link leading out of the base directory is left out.
        assert_eq!(names, ["a.txt", "inner", "link"]);
        assert_eq!(entries[0]["type"], "file");
        assert_eq!(entries[0]["size"], 5);
        assert_eq!(entries[0]["mode"], "0644");
        let modified = entries[0]["modified_at"].as_str().unwrap();
        assert!(
            modified.ends_with('Z') && modified.len() == 20,
            "{modified}"
        );
        assert_eq!(entries[1]["type"], "directory");
        assert_eq!(
            entries[2]["type"], "file",
            "a symlink is listed as what it leads to"
        );
    }

    // The root, as the SDK spells "." and "".
    for url in [h.rest("/v1/files/%2E"), h.rest("/v1/files/")] {
        let listing: Value = h.http.get(&url).send().await.unwrap().json().await.unwrap();
        assert_eq!(listing["path"], "/");
        assert_eq!(listing["entries"][0]["name"], "d");
    }
}

#[tokio::test]
async fn delete_files_and_directories() {
    let h = Harness::start().await;
    std::fs::create_dir_all(h.base().join("full/sub")).unwrap();
    std::fs::write(h.base().join("full/sub/f"), b"x").unwrap();
    std::fs::create_dir(h.base().join("empty")).unwrap();
    std::fs::write(h.base().join("file"), b"x").unwrap();

    let del = |p: &str| h.http.delete(h.rest(&sdk_files_endpoint(p)));
    let r = del("full").send().await.unwrap();
    assert_eq!(r.status(), StatusCode::CONFLICT);
    assert_eq!(error_code(r).await, "CONFLICT");
    assert!(h.base().join("full/sub/f").exists());

    assert_eq!(
        del("empty").send().await.unwrap().status(),
        StatusCode::NO_CONTENT
    );
    assert!(!h.base().join("empty").exists());
    assert_eq!(
        del("file").send().await.unwrap().status(),
        StatusCode::NO_CONTENT
    );
    assert!(!h.base().join("file").exists());
    assert_eq!(
        del("file").send().await.unwrap().status(),
        StatusCode::NOT_FOUND
    );

    let r = h
        .http
        .delete(format!(
            "{}?recursive=true",
            h.rest(&sdk_files_endpoint("full"))
        ))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), StatusCode::NO_CONTENT);
    assert!(!h.base().join("full").exists());

    let r = h
        .http
        .delete(format!(
            "{}?recursive=maybe",
            h.rest(&sdk_files_endpoint("x"))
        ))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), StatusCode::BAD_REQUEST);

    // The root: refused without recursive; emptied (not removed) with it.
    std::fs::write(h.base().join("left"), b"x").unwrap();
    assert_eq!(
        h.http
            .delete(h.rest("/v1/files/"))
            .send()
            .await
            .unwrap()
            .status(),
        StatusCode::CONFLICT
    );
    let r = h
        .http
        .delete(h.rest("/v1/files/?recursive=true"))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), StatusCode::NO_CONTENT);
    assert!(h.base().is_dir());
    assert_eq!(std::fs::read_dir(h.base()).unwrap().count(), 0);
}

#[tokio::test]
async fn escapes_are_refused_and_touch_nothing_outside() {
    let h = Harness::start().await;
    std::fs::create_dir(h.base().join("d")).unwrap();
    std::os::unix::fs::symlink(h.outside(), h.base().join("out")).unwrap();
    std::os::unix::fs::symlink("../outside", h.base().join("rel-out")).unwrap();

    // `..` above the root, as the SDK encodes it and as plain text.
    for url in [
        h.rest(&sdk_files_endpoint("../outside/secret")),
        h.rest(&sdk_files_endpoint("d/../../outside/secret")),
        h.rest("/v1/files/..%2Foutside%2Fsecret"),
    ] {
        let get = h.http.get(&url).send().await.unwrap();
        assert_eq!(get.status(), StatusCode::FORBIDDEN, "{url}");
        assert_eq!(error_code(get).await, "PERMISSION_DENIED");
        let put = h.http.put(&url).body("pwned").send().await.unwrap();
        assert_eq!(put.status(), StatusCode::FORBIDDEN, "{url}");
        let del = h
            .http
            .delete(format!("{url}?recursive=true"))
            .send()
            .await
            .unwrap();
        assert_eq!(del.status(), StatusCode::FORBIDDEN, "{url}");
    }

    // An absolute path is read beneath the base directory, never as a host path.
    let abs = h.outside().join("secret");
    let url = h.rest(&sdk_files_endpoint(abs.to_str().unwrap()));
    assert_eq!(
        h.http.get(&url).send().await.unwrap().status(),
        StatusCode::NOT_FOUND
    );

    // Through symlinks that lead out (absolute and relative targets).
    for link in ["out", "rel-out"] {
        let url = h.rest(&sdk_files_endpoint(&format!("{link}/secret")));
        let get = h.http.get(&url).send().await.unwrap();
        assert_eq!(get.status(), StatusCode::FORBIDDEN, "{link}");
        let put = h.http.put(&url).body("pwned").send().await.unwrap();
        assert_eq!(put.status(), StatusCode::FORBIDDEN, "{link}");
        let new = h.rest(&sdk_files_endpoint(&format!("{link}/new")));
        let put = h.http.put(&new).body("pwned").send().await.unwrap();
        assert_eq!(put.status(), StatusCode::FORBIDDEN, "{link}");
        let del = h.http.delete(&url).send().await.unwrap();
        assert_eq!(del.status(), StatusCode::FORBIDDEN, "{link}");
        let list = h
            .http
            .get(h.rest(&sdk_files_endpoint(link)))
            .send()
            .await
            .unwrap();
        assert_eq!(list.status(), StatusCode::FORBIDDEN, "{link}");
    }
    // Deleting the link itself removes the link, not what it points to.
    let del = h
        .http
        .delete(h.rest(&sdk_files_endpoint("out")))
        .send()
        .await
        .unwrap();
    assert_eq!(del.status(), StatusCode::NO_CONTENT);
    assert!(h.base().join("out").symlink_metadata().is_err());
    h.assert_outside_untouched();
}

#[tokio::test]
async fn health_and_metadata() {
    let h = Harness::start().await;
    let health: Value = h
        .http
        .get(h.rest("/v1/health"))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(health["status"], "ok");
    assert!(health["uptime_seconds"].is_u64());
    let meta: Value = h
        .http
        .get(h.rest("/v1/metadata"))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert!(meta["env"].is_object());
    let unknown = h.http.get(h.rest("/v2/nothing")).send().await.unwrap();
    assert_eq!(unknown.status(), StatusCode::NOT_FOUND);
    assert_eq!(error_code(unknown).await, "NOT_FOUND");
}
