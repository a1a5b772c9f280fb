//! Exports of path lists on the real engine (`SANDBOX_TEST_DOCKER=1`, set by
//! `cargo xtask test`): one engine archive call however many files, counted from the engine's
//! own event log, and the content round-trips; a few files spread over a large workspace are
//! fetched one by one rather than by downloading it all.

mod common;

use std::collections::{BTreeMap, HashMap};
use std::io::Read;
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use bollard::query_parameters::EventsOptionsBuilder;
use bytes::Bytes;
use common::{BUSYBOX, DEBIAN, Sweep, docker, options};
use futures::StreamExt;
use sandbox_core::testkit::sh;
use sandbox_core::{ExportRequest, RelPath, Sandbox, SandboxConfig, WorkspaceSpec};
use sandbox_docker::{DockerClient, DockerState};

fn now_ns() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .expect("clock")
        .as_nanos() as i64
}

/// The engine's events for `container` between `from` and `to` (ns), by action.
async fn events(container: &str, from: i64, to: i64) -> BTreeMap<String, usize> {
    let filters = HashMap::from([("container", vec![container])]);
    let options = EventsOptionsBuilder::default()
        .since(&(from / 1_000_000_000 - 1).to_string())
        .until(&(to / 1_000_000_000 + 1).to_string())
        .filters(&filters)
        .build();
    let mut stream = docker().events(Some(options));
    let mut out = BTreeMap::new();
    while let Some(e) = stream.next().await {
        let e = e.expect("event");
        let at = e.time_nano.unwrap_or(0);
        if at < from || at > to {
            continue;
        }
        let action = e.action.unwrap_or_default();
        // `exec_create: sh -c …` carries the command: keep the action's name only.
        let name = action.split(':').next().unwrap_or("").to_owned();
        *out.entry(name).or_default() += 1;
    }
    out
}

/// Read an export: regular files by path, and every other entry's path.
fn unpack(tar: &[u8]) -> (BTreeMap<String, Vec<u8>>, Vec<String>) {
    let mut files = BTreeMap::new();
    let mut others = Vec::new();
    let mut archive = tar::Archive::new(tar);
    for entry in archive.entries().expect("tar") {
        let mut entry = entry.expect("entry");
        let path = entry.path().expect("path").to_string_lossy().into_owned();
        if entry.header().entry_type().is_file() {
            let mut data = Vec::new();
            entry.read_to_end(&mut data).expect("read");
            files.insert(path, data);
        } else {
            others.push(path);
        }
    }
    (files, others)
}

async fn export(sb: &Sandbox, paths: &[String]) -> Vec<u8> {
    let mut request = ExportRequest::default();
    request.paths = Some(
        paths
            .iter()
            .map(|p| RelPath::new(p).expect("path"))
            .collect(),
    );
    let mut stream = sb.handle().export(&request).await.expect("export");
    let mut out = Vec::new();
    while let Some(chunk) = stream.next().await {
        out.extend_from_slice(&chunk.expect("chunk"));
    }
    out
}

async fn one_stream_for_many_files(image: &str) {
    let o = options(image);
    let _sweep = Sweep(o.name_prefix.clone());
    let c = Arc::new(DockerClient::new(o).expect("client"));
    let sb = Sandbox::create(&*c, SandboxConfig::new(WorkspaceSpec::default()), None)
        .await
        .expect("create");
    sb.start().await.expect("start");
    let name = sb
        .state()
        .downcast::<DockerState>("docker")
        .expect("state")
        .container_name
        .clone();
    // 60 files with distinct contents in two directories, a file beside them that is not
    // asked for, and a hard link (to an unlisted file) that is.
    sh(
        &sb,
        "mkdir -p src/a src/b other && i=0; while [ $i -lt 60 ]; do \
         d=a; [ $((i % 2)) = 0 ] && d=b; printf 'file %s\\n' $i > src/$d/f$i; \
         head -c $((i * 1000)) /dev/zero >> src/$d/f$i; i=$((i+1)); done; \
         echo secret > src/a/unlisted; echo outside > other/x; ln src/a/unlisted src/b/hl",
    )
    .await;
    let mut want: Vec<String> = (0..60)
        .map(|i| format!("src/{}/f{i}", if i % 2 == 0 { "b" } else { "a" }))
        .collect();
    want.push("src/b/hl".into());
    // Expected contents, read one by one through the engine.
    let mut expected = BTreeMap::new();
    for p in &want {
        let data: Bytes = sb
            .handle()
            .read_file(&RelPath::new(p).expect("path"))
            .await
            .expect("read");
        expected.insert(p.clone(), data.to_vec());
    }

    let from = now_ns();
    let tar = export(&sb, &want).await;
    let to = now_ns();
    let (files, others) = unpack(&tar);
    assert_eq!(files, expected, "{image}: exported contents");
    assert!(
        others.is_empty(),
        "{image}: only the listed files are exported, got {others:?}"
    );

    let seen = events(&name, from, to).await;
    let archive_calls = seen.get("archive-path").copied().unwrap_or(0);
    let execs = seen.get("exec_create").copied().unwrap_or(0);
    // One download of `src`, one more for the hard link (fetched on its own as a regular
    // file); no exec. A download per file would be 61.
    assert_eq!(
        (archive_calls, execs),
        (2, 0),
        "{image}: engine calls for 61 files: {seen:?}"
    );

    // A few paths are downloaded one by one (no more than that many calls).
    let few = vec!["src/a/f1".to_owned(), "other/x".to_owned()];
    let from = now_ns();
    let (files, others) = unpack(&export(&sb, &few).await);
    let to = now_ns();
    assert_eq!(
        files.keys().cloned().collect::<Vec<_>>(),
        ["other/x", "src/a/f1"],
        "{image}: {others:?}"
    );
    assert_eq!(files["other/x"], b"outside\n");
    let seen = events(&name, from, to).await;
    assert_eq!(
        seen.get("archive-path").copied().unwrap_or(0),
        2,
        "{seen:?}"
    );

    // Five files spread over a workspace that also holds 96 MiB nobody asked for: once a
    // listing has shown the sizes, one download each beats downloading the whole workspace.
    sh(
        &sb,
        "mkdir -p bulk && head -c 100663296 /dev/zero > bulk/blob",
    )
    .await;
    sb.handle().list().await.expect("list");
    let spread: Vec<String> = ["src/a/f1", "src/b/f2", "other/x", "src/a/f3", "src/b/f4"]
        .map(str::to_owned)
        .to_vec();
    let from = now_ns();
    let (files, others) = unpack(&export(&sb, &spread).await);
    let to = now_ns();
    let mut names = spread.clone();
    names.sort();
    assert_eq!(
        files.keys().cloned().collect::<Vec<_>>(),
        names,
        "{image}: {others:?}"
    );
    for p in ["src/a/f1", "src/b/f2", "src/a/f3", "src/b/f4"] {
        assert_eq!(files[p], expected[p], "{image}: {p}");
    }
    let seen = events(&name, from, to).await;
    assert_eq!(
        seen.get("archive-path").copied().unwrap_or(0),
        5,
        "{image}: a download per file, not one of the 96 MiB workspace: {seen:?}"
    );
    sb.destroy().await.expect("destroy");
}

#[tokio::test]
#[cfg_attr(not(docker_tests), ignore = "needs Docker; run by cargo xtask test")]
async fn path_list_export_is_one_stream_busybox() {
    one_stream_for_many_files(BUSYBOX).await;
}

#[tokio::test]
#[cfg_attr(not(docker_tests), ignore = "needs Docker; run by cargo xtask test")]
async fn path_list_export_is_one_stream_debian() {
    one_stream_for_many_files(DEBIAN).await;
}
