//! `RedisKvStore` on a real Redis (`SANDBOX_TEST_REDIS_URL`): compare-and-set, binary values,
//! versions never reused, the sorted-set index behind listings, namespaces as hash tags,
//! failures. The shared-store filesystem's suites (sandbox-fs `tests/behaviour.rs`,
//! `tests/modes.rs`) run over this store too.

mod common;

use std::collections::BTreeMap;
use std::time::Duration;

use bytes::Bytes;
use common::{free_port, raw};
use sandbox_core::{Error, ErrorKind, StateStore as _};
use sandbox_fs::{KvStore, Precondition};
use store_redis::{RedisKvStore, RedisOptions, testkit};

fn store(options: &RedisOptions) -> RedisKvStore {
    RedisKvStore::new(options.clone()).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[cfg_attr(not(redis_tests), ignore = "needs Redis; run by cargo xtask test")]
async fn compare_and_set() {
    let options = testkit::options();
    let kv = store(&options);
    assert_eq!(kv.get("ns", "k").await.unwrap(), None);
    let v1 = kv
        .put("ns", "k", "a".into(), Precondition::Absent)
        .await
        .unwrap();
    let err = kv
        .put("ns", "k", "b".into(), Precondition::Absent)
        .await
        .unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Conflict, "{err}");
    assert!(err.to_string().contains("ns/k"), "{err}");
    let v2 = kv
        .put("ns", "k", "b".into(), Precondition::Version(v1))
        .await
        .unwrap();
    assert!(v2 > v1);
    // A blind writer holding an old version cannot overwrite the newer one.
    let err = kv
        .put("ns", "k", "stale".into(), Precondition::Version(v1))
        .await
        .unwrap_err();
    assert!(matches!(err, Error::Conflict { .. }), "{err}");
    let got = kv.get("ns", "k").await.unwrap().unwrap();
    assert_eq!((&got.value[..], got.version), (&b"b"[..], v2));
    // A version on a missing key, and an absent precondition on delete, are refused.
    assert_eq!(
        kv.put("ns", "other", "x".into(), Precondition::Version(v2))
            .await
            .unwrap_err()
            .kind(),
        ErrorKind::Conflict
    );
    assert_eq!(
        kv.delete("ns", "k", Precondition::Absent)
            .await
            .unwrap_err()
            .kind(),
        ErrorKind::InvalidInput
    );
    assert!(
        kv.delete("ns", "k", Precondition::Version(v1))
            .await
            .is_err()
    );
    assert_eq!(kv.get("ns", "k").await.unwrap().unwrap().version, v2);
    assert!(
        kv.delete("ns", "k", Precondition::Version(v2))
            .await
            .unwrap()
    );
    assert!(!kv.delete("ns", "k", Precondition::Any).await.unwrap());
    assert_eq!(
        kv.delete("ns", "k", Precondition::Version(v2))
            .await
            .unwrap_err()
            .kind(),
        ErrorKind::Conflict
    );
    assert_eq!(kv.get("ns", "k").await.unwrap(), None);
    assert_eq!(kv.list("ns", "").await.unwrap(), vec![]);
    // Re-created: a version never seen before for this key.
    let v3 = kv
        .put("ns", "k", "c".into(), Precondition::Absent)
        .await
        .unwrap();
    assert!(v3 > v2, "versions are never reused");
    let v4 = kv
        .put("ns", "k", "d".into(), Precondition::Any)
        .await
        .unwrap();
    assert!(v4 > v3);
    assert!(kv.delete("ns", "k", Precondition::Any).await.unwrap());
    testkit::purge(&options).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[cfg_attr(not(redis_tests), ignore = "needs Redis; run by cargo xtask test")]
async fn values_are_binary_safe() {
    let options = testkit::options();
    let kv = store(&options);
    let every_byte: Vec<u8> = (0..=255u8).chain((0..=255u8).rev()).collect();
    for value in [
        Bytes::new(),
        Bytes::from(every_byte),
        Bytes::from_static(b"\r\n$-1\r\n*0\r\n"),
        Bytes::from(vec![0u8; 1 << 20]),
    ] {
        let v = kv
            .put("bin", "blob", value.clone(), Precondition::Any)
            .await
            .unwrap();
        let got = kv.get("bin", "blob").await.unwrap().unwrap();
        assert_eq!((got.value, got.version), (value.clone(), v));
        let listed = kv.list("bin", "").await.unwrap();
        assert_eq!(listed.len(), 1);
        assert_eq!((listed[0].size, listed[0].version), (value.len() as u64, v));
    }
    testkit::purge(&options).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[cfg_attr(not(redis_tests), ignore = "needs Redis; run by cargo xtask test")]
async fn listings_are_sorted_prefix_ranges_read_in_pages() {
    // Pages of 7 keys: most listings below take several.
    let options = testkit::options().page_size(7);
    let kv = store(&options);
    let mut keys: Vec<String> = (0..40).map(|i| format!("a/{i:02}")).collect();
    keys.extend(
        [
            "a",
            "a0",
            "a.",
            "a/",
            "a/b/c",
            "ab",
            "b",
            "b/a",
            "ä/x",
            "a/ü",
            "a/\u{10FFFF}",
            "zz",
            "a/*",
            "a/[x]",
            "a/?",
        ]
        .map(str::to_owned),
    );
    let mut model = BTreeMap::new();
    for (i, key) in keys.iter().enumerate() {
        let value = Bytes::from(vec![b'x'; i]);
        let v = kv
            .put("ns", key, value.clone(), Precondition::Absent)
            .await
            .unwrap();
        model.insert(key.clone(), (v, value.len() as u64));
        // A neighbour namespace whose name extends this one's.
        kv.put("ns2", key, "n".into(), Precondition::Any)
            .await
            .unwrap();
    }
    for prefix in [
        "",
        "a",
        "a/",
        "a/0",
        "a/b",
        "a/*",
        "a/[",
        "b",
        "ä",
        "c",
        "a/\u{10FFFF}",
    ] {
        let got: Vec<(String, u64, u64)> = kv
            .list("ns", prefix)
            .await
            .unwrap()
            .into_iter()
            .map(|e| (e.key, e.version, e.size))
            .collect();
        let want: Vec<(String, u64, u64)> = model
            .iter()
            .filter(|(k, _)| k.starts_with(prefix))
            .map(|(k, (v, s))| (k.clone(), *v, *s))
            .collect();
        assert_eq!(got, want, "prefix {prefix:?}");
    }
    // Deleted keys leave the index.
    for i in 0..40 {
        kv.delete("ns", &format!("a/{i:02}"), Precondition::Any)
            .await
            .unwrap();
    }
    let left: Vec<String> = kv
        .list("ns", "a/")
        .await
        .unwrap()
        .into_iter()
        .map(|e| e.key)
        .collect();
    assert_eq!(
        left,
        ["a/", "a/*", "a/?", "a/[x]", "a/b/c", "a/ü", "a/\u{10FFFF}"]
    );
    testkit::purge(&options).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[cfg_attr(not(redis_tests), ignore = "needs Redis; run by cargo xtask test")]
async fn one_namespace_is_one_hash_tag() {
    let options = testkit::options();
    let kv = store(&options);
    // Namespaces whose naive key names would collide stay apart.
    kv.put("a}:e:x", "k", "one".into(), Precondition::Any)
        .await
        .unwrap();
    kv.put("a", "x}:e:k", "two".into(), Precondition::Any)
        .await
        .unwrap();
    kv.put("", "k", "three".into(), Precondition::Any)
        .await
        .unwrap();
    kv.put(
        "agents/a/users/u/memory",
        "notes.md",
        "four".into(),
        Precondition::Any,
    )
    .await
    .unwrap();
    assert_eq!(
        &kv.get("a}:e:x", "k").await.unwrap().unwrap().value[..],
        b"one"
    );
    assert_eq!(
        &kv.get("a", "x}:e:k").await.unwrap().unwrap().value[..],
        b"two"
    );
    assert_eq!(&kv.get("", "k").await.unwrap().unwrap().value[..], b"three");
    assert_eq!(kv.list("a", "").await.unwrap().len(), 1);
    let names = common::keys_under(&options.url, &options.key_prefix).await;
    let p = &options.key_prefix;
    for name in &names {
        let tag = name
            .strip_prefix(&format!("{p}kv:{{"))
            .and_then(|rest| rest.split_once('}'))
            .map(|(tag, _)| tag)
            .unwrap_or_else(|| panic!("{name} has no hash tag"));
        assert!(
            ["a%7D:e:x", "a", "%00", "agents/a/users/u/memory"].contains(&tag),
            "{name}: tag {tag}"
        );
    }
    let mut want = vec![
        format!("{p}kv:{{%00}}:e:k"),
        format!("{p}kv:{{%00}}:idx"),
        format!("{p}kv:{{%00}}:seq"),
        format!("{p}kv:{{a%7D:e:x}}:e:k"),
        format!("{p}kv:{{a%7D:e:x}}:idx"),
        format!("{p}kv:{{a%7D:e:x}}:seq"),
        format!("{p}kv:{{a}}:e:x}}:e:k"),
        format!("{p}kv:{{a}}:idx"),
        format!("{p}kv:{{a}}:seq"),
        format!("{p}kv:{{agents/a/users/u/memory}}:e:notes.md"),
        format!("{p}kv:{{agents/a/users/u/memory}}:idx"),
        format!("{p}kv:{{agents/a/users/u/memory}}:seq"),
    ];
    want.sort();
    assert_eq!(
        names, want,
        "an entry, an index and a counter per namespace"
    );
    testkit::purge(&options).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[cfg_attr(not(redis_tests), ignore = "needs Redis; run by cargo xtask test")]
async fn damaged_entries_and_a_missing_server_are_typed_errors() {
    let options = testkit::options();
    let kv = store(&options);
    let mut c = raw(&options.url).await;
    let entry = format!("{}kv:{{ns}}:e:k", options.key_prefix);
    let _: () = redis::cmd("HSET")
        .arg(&entry)
        .arg("v")
        .arg("no version")
        .query_async(&mut c)
        .await
        .unwrap();
    let err = kv.get("ns", "k").await.unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Backend, "{err}");
    assert!(err.to_string().contains("damaged"), "{err}");
    let _: () = redis::cmd("HSET")
        .arg(&entry)
        .arg("ver")
        .arg("x1")
        .query_async(&mut c)
        .await
        .unwrap();
    assert!(
        kv.get("ns", "k")
            .await
            .unwrap_err()
            .to_string()
            .contains("damaged")
    );
    let _: () = redis::cmd("SET")
        .arg(format!("{}kv:{{ns2}}:idx", options.key_prefix))
        .arg("not a sorted set")
        .query_async(&mut c)
        .await
        .unwrap();
    let err = kv
        .put("ns2", "k", "v".into(), Precondition::Any)
        .await
        .unwrap_err();
    assert!(err.to_string().contains("damaged"), "{err}");
    assert!(
        kv.get("ns2", "k").await.unwrap().is_none(),
        "a failed script wrote nothing before the failing command"
    );
    testkit::purge(&options).await.unwrap();

    let secret = sandbox_core::testkit::logs::SECRET;
    let gone = RedisKvStore::new(
        RedisOptions::new(format!("redis://:{secret}@127.0.0.1:{}", free_port()))
            .connect_timeout(Duration::from_millis(500)),
    )
    .unwrap();
    for err in [
        gone.get("ns", "k").await.unwrap_err(),
        gone.put("ns", "k", "v".into(), Precondition::Any)
            .await
            .unwrap_err(),
        gone.delete("ns", "k", Precondition::Any).await.unwrap_err(),
        gone.list("ns", "").await.unwrap_err(),
    ] {
        assert_eq!(err.kind(), ErrorKind::Unavailable, "{err}");
        assert!(!format!("{err} {err:?} {gone:?}").contains(secret));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[cfg_attr(not(redis_tests), ignore = "needs Redis; run by cargo xtask test")]
async fn a_server_out_of_memory_refuses_whole_writes() {
    let server = common::Server::start(&["--save", "", "--appendonly", "no"]);
    let options = RedisOptions::new(server.url(None)).key_prefix("t:");
    let kv = store(&options);
    let states = store_redis::RedisStateStore::new(options.clone()).unwrap();
    let k = sandbox_core::testkit::states::key("rita");
    let v1 = kv
        .put("ns", "k", "one".into(), Precondition::Absent)
        .await
        .unwrap();
    // Fill the server past a memory limit that forbids eviction.
    let mut c = raw(&options.url).await;
    let _: () = redis::cmd("SET")
        .arg("ballast")
        .arg(vec![7u8; 4 << 20])
        .query_async(&mut c)
        .await
        .unwrap();
    for (name, value) in [("maxmemory-policy", "noeviction"), ("maxmemory", "1mb")] {
        let _: () = redis::cmd("CONFIG")
            .arg("SET")
            .arg(name)
            .arg(value)
            .query_async(&mut c)
            .await
            .unwrap();
    }
    let err = kv
        .put("ns", "k", "two".into(), Precondition::Version(v1))
        .await
        .unwrap_err();
    assert!(err.to_string().contains("OOM"), "{err}");
    assert!(states.save(&k, "{}", None).await.is_err());
    assert!(states.fence(&k, None).await.is_err());
    // Reads still work, and show that nothing was written.
    let got = kv.get("ns", "k").await.unwrap().unwrap();
    assert_eq!((&got.value[..], got.version), (&b"one"[..], v1));
    assert_eq!(states.load(&k).await.unwrap(), None);
    let counter: Option<String> = redis::cmd("GET")
        .arg("t:kv:{ns}:seq")
        .query_async(&mut c)
        .await
        .unwrap();
    assert_eq!(counter, Some(v1.to_string()), "no version was taken");
    let _: () = redis::cmd("CONFIG")
        .arg("SET")
        .arg("maxmemory")
        .arg("0")
        .query_async(&mut c)
        .await
        .unwrap();
    kv.put("ns", "k", "two".into(), Precondition::Version(v1))
        .await
        .expect("writes again once memory is back");
}
