//! What the Redis snapshot store guarantees under faults, on a real Redis: failed and dropped
//! puts leave no parts, readers never see two generations mixed, damaged data is a typed error,
//! TTLs cover every key of a blob, and an outage (a server of the test's own, killed or paused
//! by its pid) is a retryable error with the previous snapshot still restorable.

mod common;

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use futures::StreamExt;
use sandbox_core::snapshot::{BlobKey, SnapshotFormat, SnapshotStore, SnapshotStoreExt as _};
use sandbox_core::stream;
use sandbox_core::testkit::HookedStore;
use sandbox_core::testkit::blobs::{pattern, pieces};
use sandbox_core::{
    Acquire, CallContext, Error, ErrorKind, ExecRequest, FileStateStore, IsolationScope,
    Persistence, Result, SandboxConfig, SandboxManager, SnapshotSpec, WorkspaceSpec,
};
use sandbox_local::{LocalClient, LocalOptions};
use snapshot_redis::{RedisSnapshotOptions, RedisSnapshotStore};
use store_redis::testkit::Server;

fn key(s: &str) -> BlobKey {
    BlobKey::new(s).unwrap()
}

async fn read(store: &dyn SnapshotStore, k: &BlobKey) -> Result<Vec<u8>> {
    Ok(stream::collect(store.get(k).await?, 1 << 30)
        .await?
        .to_vec())
}

/// The keys under the prefix that are not the index or a blob's metadata: the parts.
async fn part_keys(options: &RedisSnapshotOptions) -> Vec<String> {
    let p = &options.connection.key_prefix;
    common::keys(&options.connection.url, p)
        .await
        .into_iter()
        .filter(|k| k.ends_with(|c: char| c.is_ascii_digit()) && k.contains("}:"))
        .collect()
}

async fn pttl(url: &str, name: &str) -> i64 {
    redis::cmd("PTTL")
        .arg(name)
        .query_async(&mut common::raw(url).await)
        .await
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[cfg_attr(not(redis_tests), ignore = "needs Redis; run by cargo xtask test")]
async fn failed_and_dropped_puts_leave_no_parts() {
    // Unpublished parts would live an hour: only the store's own clean-up can remove them
    // within this test.
    let options = common::options()
        .part_size(64 * 1024)
        .upload_ttl(Duration::from_secs(3600));
    let (store, _purge) = common::store_with(options.clone()).await;
    let k = key("snapshots/ns/a.tar");
    let old = pattern(1, 100_000);
    store.put_bytes(&k, Bytes::from(old.clone())).await.unwrap();
    let published = part_keys(&options).await;
    assert_eq!(published.len(), 2, "100,000 bytes in 64 KiB parts");

    // The input fails after 1 MiB (16 parts written).
    let big = pattern(2, 1024 * 1024);
    let failing = pieces(&big, 10_000)
        .chain(futures::stream::iter([Err(Error::Timeout {
            operation: "export".into(),
            after: Duration::from_secs(1),
        })]))
        .boxed();
    let err = store
        .put(&k, failing, None)
        .await
        .expect_err("input failed");
    assert!(
        matches!(err, Error::Timeout { .. }),
        "the input's error: {err}"
    );
    assert_eq!(
        part_keys(&options).await,
        published,
        "the failed put's parts are gone"
    );
    assert_eq!(read(&*store, &k).await.unwrap(), old);

    // A put whose input stalls after 1 MiB, then is dropped.
    let stalling = pieces(&big, 10_000)
        .chain(futures::stream::pending())
        .boxed();
    let mut put = store.put(&k, stalling, None);
    assert!(
        tokio::time::timeout(Duration::from_secs(1), &mut put)
            .await
            .is_err()
    );
    let pending = part_keys(&options).await;
    assert!(
        pending.len() >= published.len() + 16,
        "the stalled put wrote its parts: {pending:?}"
    );
    for name in pending.iter().filter(|n| !published.contains(n)) {
        let left = pttl(&options.connection.url, name).await;
        assert!(
            (1..=3_600_000).contains(&left),
            "an unpublished part carries the upload TTL: {name} {left}"
        );
    }
    assert_eq!(read(&*store, &k).await.unwrap(), old, "nothing published");
    drop(put);
    let deadline = Instant::now() + Duration::from_secs(10);
    while part_keys(&options).await != published {
        assert!(
            Instant::now() < deadline,
            "the dropped put's parts are still there: {:?}",
            part_keys(&options).await
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(read(&*store, &k).await.unwrap(), old);

    // An announced size the stream does not match is refused, and cleaned up too.
    let err = store
        .put(&k, pieces(&big, 100_000), Some(big.len() as u64 + 1))
        .await
        .expect_err("short stream");
    assert_eq!(err.kind(), ErrorKind::InvalidInput, "{err}");
    assert_eq!(part_keys(&options).await, published);
}

/// A put that lasts three times its upload TTL (a slow input) keeps its early parts alive
/// until it publishes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[cfg_attr(not(redis_tests), ignore = "needs Redis; run by cargo xtask test")]
async fn a_slow_put_outlives_its_upload_ttl() {
    let options = common::options()
        .part_size(4096)
        .upload_ttl(Duration::from_secs(1));
    let (store, _purge) = common::store_with(options.clone()).await;
    let k = key("packs/slow");
    let data = pattern(6, 30 * 10_000);
    let slow = futures::stream::iter(
        data.chunks(10_000)
            .map(|c| Ok(Bytes::copy_from_slice(c)))
            .collect::<Vec<Result<Bytes>>>(),
    )
    .then(|chunk| async move {
        tokio::time::sleep(Duration::from_millis(100)).await;
        chunk
    })
    .boxed();
    let started = Instant::now();
    store.put(&k, slow, None).await.expect("the slow put");
    assert!(started.elapsed() >= Duration::from_secs(3));
    assert!(read(&*store, &k).await.unwrap() == data);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[cfg_attr(not(redis_tests), ignore = "needs Redis; run by cargo xtask test")]
async fn readers_never_see_two_generations() {
    let options = common::options().part_size(64 * 1024);
    let (store, _purge) = common::store_with(options.clone()).await;
    let k = key("snapshots/ns/m.manifest");
    let (a, b) = (pattern(10, 1024 * 1024), pattern(11, 1024 * 1024));
    store.put(&k, pieces(&a, 50_000), None).await.unwrap();

    // A reader that started on A finishes reading A after B is published.
    let mut reader = store.get(&k).await.unwrap();
    let first = reader.next().await.unwrap().unwrap();
    store.put(&k, pieces(&b, 50_000), None).await.unwrap();
    let mut got = first.to_vec();
    while let Some(chunk) = reader.next().await {
        got.extend_from_slice(&chunk.unwrap());
    }
    assert!(got == a, "the old reader read A whole");
    assert!(
        read(&*store, &k).await.unwrap() == b,
        "a new reader reads B"
    );
    // A's parts are retired: they expire after the grace period (60 s).
    let parts = part_keys(&options).await;
    assert_eq!(parts.len(), 32, "A's 16 parts (retiring) and B's 16");
    let mut retiring = 0;
    for name in &parts {
        let left = pttl(&options.connection.url, name).await;
        if left != -1 {
            assert!((1..=60_000).contains(&left), "{name}: {left}");
            retiring += 1;
        }
    }
    assert_eq!(retiring, 16, "A's parts expire, B's do not");

    // Without a grace period the old parts go at once: a reader still on them gets a
    // conflict, never B's bytes.
    let eager = RedisSnapshotStore::new(options.clone().replaced_grace(Duration::ZERO)).unwrap();
    let mut reader = store.get(&k).await.unwrap();
    let first = reader.next().await.unwrap().unwrap();
    assert!(first[..] == b[..first.len()]);
    eager.put(&k, pieces(&a, 50_000), None).await.unwrap();
    let mut rest = Vec::new();
    let mut failed = None;
    while let Some(chunk) = reader.next().await {
        match chunk {
            Ok(c) => rest.extend_from_slice(&c),
            Err(e) => {
                failed = Some(e);
                break;
            }
        }
    }
    let err = failed.expect("the reader lost its generation");
    assert!(matches!(err, Error::Conflict { .. }), "{err}");
    let seen = first.len() + rest.len();
    assert!(
        rest[..] == b[first.len()..seen],
        "what was read before the conflict is B's"
    );
    assert_eq!(
        part_keys(&options).await.len(),
        16 + 16,
        "the first A's retiring parts and the new A's: B's went at once"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[cfg_attr(not(redis_tests), ignore = "needs Redis; run by cargo xtask test")]
async fn damaged_data_is_a_typed_error() {
    let options = common::options().part_size(4096);
    let (store, _purge) = common::store_with(options.clone()).await;
    let url = &options.connection.url;
    let p = &options.connection.key_prefix;
    let mut c = common::raw(url).await;
    let damaged = |what: &str, r: std::result::Result<(), Error>| {
        let err = r.expect_err(what);
        assert_eq!(err.kind(), ErrorKind::Backend, "{what}: {err}");
        assert!(err.to_string().contains("damaged"), "{what}: {err}");
    };
    let get = |k: BlobKey| {
        let store = store.clone();
        async move { read(&*store, &k).await.map(drop) }
    };
    let range = |k: BlobKey| {
        let store = store.clone();
        async move {
            stream::collect(store.get_range(&k, 1, 5000).await?, 1 << 20)
                .await
                .map(drop)
        }
    };

    // Metadata whose fields are not ours.
    let bad_meta = key("snapshots/ns/bad-meta");
    for (field, value) in [("gen", "not-a-generation"), ("size", "12"), ("parts", "x")] {
        let _: () = redis::cmd("HSET")
            .arg(format!("{p}blob:{{{bad_meta}}}"))
            .arg(field)
            .arg(value)
            .query_async(&mut c)
            .await
            .unwrap();
    }
    damaged("get, bad metadata", get(bad_meta.clone()).await);
    damaged("range, bad metadata", range(bad_meta.clone()).await);
    // Metadata of another type.
    let wrong_type = key("snapshots/ns/wrong-type");
    let _: () = redis::cmd("SET")
        .arg(format!("{p}blob:{{{wrong_type}}}"))
        .arg("hello")
        .query_async(&mut c)
        .await
        .unwrap();
    damaged("get, wrong type", get(wrong_type.clone()).await);

    // A part cut short behind the store's back.
    let short = key("snapshots/ns/short");
    store
        .put(&short, pieces(&pattern(3, 10_000), 1000), None)
        .await
        .unwrap();
    let part = part_keys(&options)
        .await
        .into_iter()
        .find(|n| n.ends_with(":1"))
        .expect("part 1");
    let _: () = redis::cmd("SET")
        .arg(&part)
        .arg("tiny")
        .query_async(&mut c)
        .await
        .unwrap();
    damaged("get, short part", get(short.clone()).await);
    damaged("range, short part", range(short.clone()).await);

    // A name in the index that is not a blob key.
    let _: () = redis::cmd("ZADD")
        .arg(format!("{p}blobs"))
        .arg(0)
        .arg("snapshots/../x")
        .query_async(&mut c)
        .await
        .unwrap();
    damaged("list", store.list_all("snapshots/").await.map(drop));

    // A put over damaged metadata repairs it; delete removes what is there.
    for k in [&bad_meta, &wrong_type] {
        store
            .put_bytes(k, Bytes::from_static(b"fresh"))
            .await
            .unwrap();
        assert_eq!(read(&*store, k).await.unwrap(), b"fresh");
        store.delete(k).await.unwrap();
        assert!(!store.exists(k).await.unwrap());
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[cfg_attr(not(redis_tests), ignore = "needs Redis; run by cargo xtask test")]
async fn ttl_covers_every_key_and_the_index_forgets_expired_blobs() {
    let ttl = Duration::from_millis(1500);
    let options = common::options().part_size(4096).ttl(ttl);
    let (store, _purge) = common::store_with(options.clone()).await;
    let url = &options.connection.url;
    let p = &options.connection.key_prefix;
    let k = key("chunks/aa/c1");
    store
        .put(&k, pieces(&pattern(4, 10_000), 999), None)
        .await
        .unwrap();
    let names = common::keys(url, p).await;
    assert_eq!(
        names.len(),
        1 + 1 + 3,
        "index, metadata, 3 parts: {names:?}"
    );
    for name in &names {
        let left = pttl(url, name).await;
        if name == &format!("{p}blobs") {
            assert_eq!(left, -1, "the index does not expire");
        } else {
            assert!((1..=1500).contains(&left), "{name}: {left}");
        }
    }
    let listed = store.list_all("chunks/").await.unwrap();
    assert_eq!(
        common::sizes(&listed),
        [("chunks/aa/c1".to_owned(), 10_000)]
    );

    let deadline = Instant::now() + Duration::from_secs(10);
    while store.exists(&k).await.unwrap() {
        assert!(Instant::now() < deadline, "the blob did not expire");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(matches!(
        store.get(&k).await.err(),
        Some(Error::NotFound { .. })
    ));
    // The index still names it until a listing prunes the entry.
    let score: Option<f64> = redis::cmd("ZSCORE")
        .arg(format!("{p}blobs"))
        .arg(k.as_str())
        .query_async(&mut common::raw(url).await)
        .await
        .unwrap();
    assert_eq!(score, Some(0.0));
    assert!(store.list_all("chunks/").await.unwrap().is_empty());
    let score: Option<f64> = redis::cmd("ZSCORE")
        .arg(format!("{p}blobs"))
        .arg(k.as_str())
        .query_async(&mut common::raw(url).await)
        .await
        .unwrap();
    assert_eq!(score, None, "the listing pruned the expired entry");
}

fn retryable(what: &str, e: &Error) {
    assert!(e.is_retryable(), "{what}: {e} is not retryable");
    assert!(
        matches!(e, Error::Unavailable { .. } | Error::Timeout { .. }),
        "{what}: {e}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[cfg_attr(not(redis_tests), ignore = "needs Redis; run by cargo xtask test")]
async fn redis_down_or_paused_is_a_retryable_error() {
    let mut server = Server::start(&["--save", "", "--appendonly", "no"]);
    let store = RedisSnapshotStore::new(
        RedisSnapshotOptions::new(server.url(None))
            .key_prefix("t:")
            .connect_timeout(Duration::from_millis(500))
            .response_timeout(Duration::from_millis(500)),
    )
    .unwrap();
    let k = key("snapshots/ns/x");
    store
        .put_bytes(&k, Bytes::from_static(b"v1"))
        .await
        .unwrap();

    server.pause();
    let err = store
        .put(&k, pieces(&pattern(5, 200_000), 10_000), None)
        .await
        .expect_err("paused");
    retryable("put, paused", &err);
    retryable("get, paused", &store.get(&k).await.err().expect("paused"));
    server.resume();
    // Let the resumed server run what reached it while it was stopped: the publish, past its
    // deadline, must do nothing (the put was reported as failed).
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(
        read(&store, &k).await.unwrap(),
        b"v1",
        "the failed put changed nothing, also later"
    );

    server.kill();
    retryable(
        "put, down",
        &store
            .put_bytes(&k, Bytes::from_static(b"v2"))
            .await
            .unwrap_err(),
    );
    retryable("get, down", &store.get(&k).await.err().expect("down"));
    retryable(
        "range, down",
        &store.get_range(&k, 0, 1).await.err().expect("down"),
    );
    retryable("exists, down", &store.exists(&k).await.unwrap_err());
    retryable("delete, down", &store.delete(&k).await.unwrap_err());
    let listed: Vec<_> = store.list("").collect().await;
    assert_eq!(listed.len(), 1, "one error ends the listing");
    retryable("list, down", listed[0].as_ref().unwrap_err());
}

fn kill(pid: u32) {
    let status = std::process::Command::new("kill")
        .arg("-KILL")
        .arg(pid.to_string())
        .status()
        .expect("kill");
    assert!(status.success());
}

/// Forwards to `inner`; the first put after `pid` is set kills the server by that pid once its
/// input has passed `after` bytes.
fn kill_mid_put(
    inner: Arc<dyn SnapshotStore>,
    pid: Arc<Mutex<Option<u32>>>,
    after: usize,
) -> HookedStore {
    HookedStore::new(inner).on_put(move |_, data| {
        let Some(pid) = pid.lock().unwrap().take() else {
            return data;
        };
        let mut seen = 0usize;
        data.inspect(move |chunk| {
            if let Ok(c) = chunk {
                let before = seen;
                seen += c.len();
                if before < after && seen >= after {
                    kill(pid);
                }
            }
        })
        .boxed()
    })
}

fn manager(
    base: &std::path::Path,
    states: &Arc<FileStateStore>,
    store: Arc<dyn SnapshotStore>,
    format: SnapshotFormat,
) -> SandboxManager {
    let client = LocalClient::new(
        LocalOptions::default()
            .base_dir(base)
            .persistence(Persistence::Ephemeral),
    );
    SandboxManager::builder(Arc::new(client))
        .scope(IsolationScope::User)
        .state_store(states.clone())
        .config(
            SandboxConfig::new(WorkspaceSpec::default())
                .snapshots(SnapshotSpec::new(store).format(format)),
        )
        .build()
        .expect("manager")
}

/// Redis killed while a stop streams the snapshot into it (the tar format: one archive
/// streamed into one put, cut after 1 MiB): the call fails with a retryable error, saves
/// nothing, and once Redis is back the previous snapshot restores; what the cut put left
/// behind expires.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[cfg_attr(not(redis_tests), ignore = "needs Redis; run by cargo xtask test")]
async fn redis_killed_mid_stop_keeps_the_previous_snapshot() {
    killed_mid_stop(SnapshotFormat::Tar, 1024 * 1024).await;
}

/// The same with the chunked format (content-addressed chunks, one put each: cut in the
/// first).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[cfg_attr(not(redis_tests), ignore = "needs Redis; run by cargo xtask test")]
async fn redis_killed_mid_chunked_stop_keeps_the_previous_snapshot() {
    killed_mid_stop(SnapshotFormat::Chunked, 1).await;
}

async fn killed_mid_stop(format: SnapshotFormat, after: usize) {
    let tmp = tempfile::tempdir().unwrap();
    let mut server = Server::start(&[
        "--appendonly",
        "yes",
        "--appendfsync",
        "always",
        "--save",
        "",
    ]);
    let options = RedisSnapshotOptions::new(server.url(None))
        .key_prefix("t:")
        .part_size(64 * 1024)
        .connect_timeout(Duration::from_millis(500))
        .response_timeout(Duration::from_millis(1000));
    let pid = Arc::new(Mutex::new(None));
    let store: Arc<dyn SnapshotStore> = Arc::new(kill_mid_put(
        Arc::new(RedisSnapshotStore::new(options.clone()).unwrap()),
        pid.clone(),
        after,
    ));
    let states = Arc::new(FileStateStore::new(tmp.path().join("states")));
    let m = manager(&tmp.path().join("host-a"), &states, store.clone(), format);
    let ctx = CallContext::new("redis-snap").user("alice");

    m.call(&ctx, |sb| async move {
        sb.exec(ExecRequest::shell(
            "echo v1 > v.txt && head -c 3000000 /dev/urandom > big.bin",
        ))
        .await
        .expect("exec");
    })
    .await
    .expect("the first call");

    let call = m.begin(&ctx, Acquire::Auto).await.expect("begin");
    call.sandbox()
        .exec(ExecRequest::shell(
            "echo v2 > v.txt && head -c 3000000 /dev/urandom > big.bin",
        ))
        .await
        .expect("exec");
    *pid.lock().unwrap() = server.pid();
    let err = call.finish().await.expect_err("Redis died mid-stop");
    assert!(pid.lock().unwrap().is_none(), "the kill happened in a put");
    retryable("stop", &err.error);
    assert!(!err.report.expect("report").persisted);

    server.restart();
    // Another replica (a box directory of its own) restores the first call's snapshot.
    let other = manager(&tmp.path().join("host-b"), &states, store.clone(), format);
    let deadline = Instant::now() + Duration::from_secs(20);
    let seen = loop {
        match other
            .call(&ctx, |sb| async move {
                sb.exec(ExecRequest::shell("cat v.txt && wc -c < big.bin"))
                    .await
                    .expect("exec")
                    .stdout_str()
                    .into_owned()
            })
            .await
        {
            Ok(seen) => break seen,
            Err(e) if e.error.is_retryable() && Instant::now() < deadline => {
                eprintln!("not yet: {}", e.error);
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            Err(e) => panic!("the previous snapshot did not restore: {}", e.error),
        }
    };
    assert_eq!(seen.value, "v1\n3000000\n");
    assert!(matches!(
        seen.report.start.map(|s| s.branch),
        Some(sandbox_core::StartBranch::RestoreEphemeral)
    ));

    // What the cut put wrote before the server died is not a blob, and expires.
    let parts = part_keys(&options).await;
    let mut published = 0;
    for name in &parts {
        let left = pttl(&options.connection.url, name).await;
        if left == -1 {
            published += 1;
        } else {
            assert!((1..=3_600_000).contains(&left), "{name}: {left}");
        }
    }
    assert!(published > 0);
}

const KILL_CHILD: &str = "SANDBOX_REDIS_KILLED_WRITER_PREFIX";
const KILL_MARK: &str = "killed-writer-mark";

/// The child side of `killed_writers_leave_only_expiring_parts`: one put of 32 MiB (64 KiB
/// parts) under the prefix it is given, killed by the parent wherever it is by then.
async fn killed_writer_child() {
    let Ok(prefix) = std::env::var(KILL_CHILD) else {
        return;
    };
    let mut options = common::options()
        .part_size(64 * 1024)
        .upload_ttl(Duration::from_secs(3600));
    options.connection.key_prefix = prefix;
    let store = RedisSnapshotStore::new(options).expect("store");
    // Far more than it can send before the last kill point.
    let data = pattern(3, 32 * 1024 * 1024);
    println!("\n{KILL_MARK}");
    let _ = store
        .put(&key("packs/ab/killed"), pieces(&data, 16 * 1024), None)
        .await;
    // Finished before the kill: wait for it.
    futures::future::pending::<()>().await;
}

/// A writer SIGKILLed at many points of its upload (this binary again, as a child) cleans up
/// nothing, and needs nothing cleaned: what it leaves are unpublished parts that each carry
/// the upload TTL, no metadata and no index entry, so listings never show them and
/// `sweep_leftovers` has nothing to do.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[cfg_attr(not(redis_tests), ignore = "needs Redis; run by cargo xtask test")]
async fn killed_writers_leave_only_expiring_parts() {
    use std::io::BufRead as _;
    killed_writer_child().await;
    let options = common::options()
        .part_size(64 * 1024)
        .upload_ttl(Duration::from_secs(3600));
    let (store, _purge) = common::store_with(options.clone()).await;
    let kept = key("packs/ab/kept");
    store
        .put_bytes(&kept, Bytes::from(pattern(1, 100_000)))
        .await
        .unwrap();
    let published = part_keys(&options).await;
    let mut left_behind = 0;
    for k in 0..8u64 {
        let mut child = std::process::Command::new(std::env::current_exe().unwrap())
            .args([
                "--exact",
                "killed_writers_leave_only_expiring_parts",
                "--nocapture",
                "--include-ignored",
            ])
            .env(KILL_CHILD, &options.connection.key_prefix)
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::null())
            .spawn()
            .unwrap();
        let lines = std::io::BufReader::new(child.stdout.take().unwrap()).lines();
        for line in lines {
            if line.unwrap() == KILL_MARK {
                break;
            }
        }
        std::thread::sleep(Duration::from_millis(2 * k * k));
        child.kill().unwrap(); // SIGKILL
        child.wait().unwrap();
        let parts = part_keys(&options).await;
        for name in parts.iter().filter(|n| !published.contains(n)) {
            let left = pttl(&options.connection.url, name).await;
            assert!(
                (1..=3_600_000).contains(&left),
                "a killed writer's part expires on its own: {name} {left}"
            );
        }
        left_behind = left_behind.max(parts.len() - published.len());
        let listed: Vec<String> = store
            .list_all("")
            .await
            .unwrap()
            .into_iter()
            .map(|m| m.key.to_string())
            .collect();
        assert_eq!(listed, ["packs/ab/kept"], "a put cut short shows nowhere");
    }
    assert!(
        left_behind > 0,
        "no kill landed inside an upload: the test proved nothing"
    );
    let swept = store
        .sweep_leftovers(sandbox_core::LeftoverSweep::default().grace(Duration::ZERO))
        .await
        .unwrap();
    assert!(swept.is_empty(), "{swept:?}");
    assert_eq!(read(&*store, &kept).await.unwrap(), pattern(1, 100_000));
}
