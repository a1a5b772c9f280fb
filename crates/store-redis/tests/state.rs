//! `RedisStateStore` on a real Redis (`SANDBOX_TEST_REDIS_URL`, as `cargo xtask test` sets;
//! servers of the tests' own for restarts and pauses): core's state-store suite, fences across
//! replicas, paged listings, expiry, failures and damaged data.

mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use common::{Server, eventually, free_port, raw};
use sandbox_core::testkit::states::{self, key};
use sandbox_core::{
    CallContext, Error, ErrorKind, IsolationKey, IsolationScope, Reach, StateStore,
};
use store_redis::{RedisOptions, RedisStateStore, testkit};

fn store(options: &RedisOptions) -> RedisStateStore {
    RedisStateStore::new(options.clone()).unwrap()
}

fn user_key(agent: &str, user: &str) -> IsolationKey {
    IsolationKey::resolve(IsolationScope::User, &CallContext::new(agent).user(user)).unwrap()
}

#[tokio::test]
#[cfg_attr(not(redis_tests), ignore = "needs Redis; run by cargo xtask test")]
async fn contract() {
    let options = testkit::options();
    let s = store(&options);
    assert_eq!(s.reach(), Reach::Cluster);
    s.ping().await.unwrap();
    states::contract(&s).await;
    testkit::purge(&options).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[cfg_attr(not(redis_tests), ignore = "needs Redis; run by cargo xtask test")]
async fn fences_hold_across_replicas() {
    let options = testkit::options();
    // Two replicas: two stores, two connections, the same server and prefix.
    states::shared_between(&store(&options), &store(&options)).await;
    let replicas: Vec<Arc<dyn StateStore>> = (0..4)
        .map(|_| Arc::new(store(&options)) as Arc<dyn StateStore>)
        .collect();
    states::concurrent_registrations(&replicas).await;
    // Another prefix is another deployment: it does not see these fences.
    let elsewhere = testkit::options();
    let other = store(&elsewhere);
    assert_eq!(other.fence(&key("carol"), None).await.unwrap(), 1);
    testkit::purge(&options).await.unwrap();
    testkit::purge(&elsewhere).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[cfg_attr(not(redis_tests), ignore = "needs Redis; run by cargo xtask test")]
async fn keys_carry_their_isolation_key_as_hash_tag() {
    let options = testkit::options();
    let s = store(&options);
    let k = key("erin");
    s.fence(&k, Some(3)).await.unwrap();
    s.save(&k, "{}", Some(3)).await.unwrap();
    let names = common::keys_under(&options.url, &options.key_prefix).await;
    let mut c = raw(&options.url).await;
    let p = &options.key_prefix;
    assert_eq!(
        names,
        [
            format!("{p}{{agents/a/users/erin}}:fence"),
            format!("{p}{{agents/a/users/erin}}:state")
        ],
        "one slot per isolation key (the hash tag), the fence in a key of its own"
    );
    let ttl: i64 = redis::cmd("PTTL")
        .arg(&names[0])
        .query_async(&mut c)
        .await
        .unwrap();
    assert_eq!(ttl, -1, "without state_ttl nothing expires");
    testkit::purge(&options).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[cfg_attr(not(redis_tests), ignore = "needs Redis; run by cargo xtask test")]
async fn listing_pages_through_thousands_of_keys() {
    // A small COUNT: a listing of 2,500 states takes many SCAN pages.
    let options = testkit::options().scan_count(50);
    let s = Arc::new(store(&options));
    let keys: Vec<IsolationKey> = (0..2500)
        .map(|i| user_key(if i < 2000 { "big" } else { "small" }, &format!("u{i}")))
        .collect();
    for batch in keys.chunks(250) {
        futures::future::try_join_all(batch.iter().map(|k| s.save(k, "{}", None)))
            .await
            .unwrap();
    }
    // Fences alone, and keys under the prefix that are not states of ours, are not listed.
    for i in 0..100 {
        s.fence(&user_key("big", &format!("fenced-only-{i}")), None)
            .await
            .unwrap();
    }
    let mut c = raw(&options.url).await;
    let p = &options.key_prefix;
    for foreign in [
        format!("{p}{{not-an-isolation-key}}:state"),
        format!("{p}{{agents/big/users/x}}:state:old"),
        format!("{p}agents/big/users/y"),
    ] {
        let _: () = redis::cmd("SET")
            .arg(foreign)
            .arg("{}")
            .query_async(&mut c)
            .await
            .unwrap();
    }

    let all = s.list("").await.unwrap();
    assert_eq!(all.len(), 2500, "every state exactly once");
    let mut want: Vec<String> = keys.iter().map(|k| k.to_string()).collect();
    let mut got: Vec<String> = all.iter().map(|k| k.to_string()).collect();
    want.sort();
    got.sort();
    assert_eq!(got, want);
    assert_eq!(s.list("agents/big/").await.unwrap().len(), 2000);
    assert_eq!(s.list("agents/small/").await.unwrap().len(), 500);
    // A prefix is a string prefix: u1, u10–u19, u100–u199, u1000–u1999.
    assert_eq!(s.list("agents/big/users/u1").await.unwrap().len(), 1111);
    // Glob metacharacters in a prefix are literal.
    for literal in [
        "agents/*",
        "agents/big/users/u?",
        "agents/[bs]",
        "agents\\",
        "*",
    ] {
        assert_eq!(s.list(literal).await.unwrap(), vec![], "{literal}");
    }
    testkit::purge(&options).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[cfg_attr(not(redis_tests), ignore = "needs Redis; run by cargo xtask test")]
async fn states_expire_but_fences_never_do() {
    assert!(matches!(
        RedisStateStore::new(testkit::options().state_ttl(Duration::ZERO)),
        Err(Error::InvalidInput { .. })
    ));
    let ttl = Duration::from_millis(1500);
    let options = testkit::options().state_ttl(ttl);
    let s = store(&options);
    assert_eq!(s.state_ttl(), Some(ttl));
    let k = key("frank");
    assert_eq!(s.fence(&k, Some(5)).await.unwrap(), 5);
    s.save(&k, "{\"n\":1}", Some(5)).await.unwrap();
    let mut c = raw(&options.url).await;
    let state_key = format!("{}{{{k}}}:state", options.key_prefix);
    let fence_key = format!("{}{{{k}}}:fence", options.key_prefix);
    let pttl: i64 = redis::cmd("PTTL")
        .arg(&state_key)
        .query_async(&mut c)
        .await
        .unwrap();
    assert!(pttl > 0 && pttl <= 1500, "{pttl}");
    // Each save restarts the expiry.
    tokio::time::sleep(Duration::from_millis(1000)).await;
    s.save(&k, "{\"n\":2}", Some(5)).await.unwrap();
    tokio::time::sleep(Duration::from_millis(1000)).await;
    assert_eq!(
        s.load(&k).await.unwrap().as_deref(),
        Some("{\"n\":2}"),
        "2 s after the first save, 1 s after the second"
    );
    // Past the expiry: the state is gone and unlisted ...
    tokio::time::sleep(Duration::from_millis(1000)).await;
    assert_eq!(s.load(&k).await.unwrap(), None);
    assert_eq!(s.list("").await.unwrap(), vec![]);
    // ... and the fence is still there: a stale holder is refused, numbering goes on.
    let pttl: i64 = redis::cmd("PTTL")
        .arg(&fence_key)
        .query_async(&mut c)
        .await
        .unwrap();
    assert_eq!(pttl, -1, "the fence has no expiry");
    assert!(matches!(
        s.save(&k, "{\"stale\":1}", Some(4)).await,
        Err(Error::StaleLease {
            token: 4,
            current: 5,
            ..
        })
    ));
    assert_eq!(s.fence(&k, None).await.unwrap(), 6);
    testkit::purge(&options).await.unwrap();
}

/// Every operation of `s` fails with a retryable error naming the service, and never shows
/// `secret`.
async fn all_fail_retryably(s: &RedisStateStore, secret: &str, service: &str) {
    let k = key("gina");
    let results: Vec<(&str, Result<(), Error>)> = vec![
        ("ping", s.ping().await),
        ("load", s.load(&k).await.map(drop)),
        ("fence", s.fence(&k, Some(1)).await.map(drop)),
        ("fence none", s.fence(&k, None).await.map(drop)),
        ("save", s.save(&k, "{}", Some(1)).await),
        ("delete", s.delete(&k, Some(1)).await),
        ("list", s.list("").await.map(drop)),
    ];
    for (op, r) in results {
        let err = r.expect_err(op);
        assert!(err.is_retryable(), "{op}: {err}");
        let (shown, debug) = (err.to_string(), format!("{err:?}"));
        assert!(shown.contains(service), "{op}: {shown}");
        assert!(
            !shown.contains(secret) && !debug.contains(secret),
            "{op}: {debug}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[cfg_attr(not(redis_tests), ignore = "needs Redis; run by cargo xtask test")]
async fn an_unreachable_server_is_a_retryable_error_without_the_password() {
    let secret = sandbox_core::testkit::logs::SECRET;
    let port = free_port();
    let s = store(&RedisOptions::new(format!(
        "redis://admin:{secret}@127.0.0.1:{port}/3"
    )));
    assert!(!format!("{s:?}").contains(secret));
    let started = Instant::now();
    all_fail_retryably(&s, secret, &format!("redis at 127.0.0.1:{port}")).await;
    assert!(
        started.elapsed() < Duration::from_secs(10),
        "refused connections fail fast: {:?}",
        started.elapsed()
    );
    let err = s.load(&key("gina")).await.unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Unavailable, "{err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[cfg_attr(not(redis_tests), ignore = "needs Redis; run by cargo xtask test")]
async fn a_paused_server_times_out_and_the_store_recovers() {
    let mut server = Server::start(&["--save", "", "--appendonly", "no"]);
    let options = RedisOptions::new(server.url(None))
        .key_prefix("t:")
        .response_timeout(Duration::from_millis(300))
        .connect_timeout(Duration::from_millis(300));
    let s = store(&options);
    let k = key("hank");
    assert_eq!(s.fence(&k, Some(1)).await.unwrap(), 1);
    s.save(&k, "{\"n\":1}", Some(1)).await.unwrap();
    server.pause();
    let started = Instant::now();
    let err = s.save(&k, "{\"n\":2}", Some(1)).await.unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Timeout, "{err}");
    assert!(err.is_retryable());
    assert!(
        started.elapsed() < Duration::from_secs(3),
        "{:?}",
        started.elapsed()
    );
    let err = s.load(&k).await.unwrap_err();
    assert!(err.is_retryable(), "{err}");
    server.resume();
    // The same store answers again. The timed-out save may or may not have been applied
    // (a timeout leaves the outcome open), but never half: the state is one of the two.
    let state = eventually(Duration::from_secs(10), || s.load(&k)).await;
    assert!(
        matches!(state.as_deref(), Some("{\"n\":1}") | Some("{\"n\":2}")),
        "{state:?}"
    );
    s.save(&k, "{\"n\":3}", Some(1)).await.unwrap();
    assert_eq!(s.load(&k).await.unwrap().as_deref(), Some("{\"n\":3}"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[cfg_attr(not(redis_tests), ignore = "needs Redis; run by cargo xtask test")]
async fn a_crash_mid_way_loses_no_acknowledged_save_with_persistence() {
    // What operators must configure: an append-only file synced on every write.
    let mut server = Server::start(&[
        "--save",
        "",
        "--appendonly",
        "yes",
        "--appendfsync",
        "always",
    ]);
    let options = RedisOptions::new(server.url(None))
        .key_prefix("t:")
        .connect_timeout(Duration::from_millis(500))
        .response_timeout(Duration::from_secs(2));
    let s = Arc::new(store(&options));
    let n = 300;
    let acked = Arc::new(AtomicUsize::new(0));
    let mut tasks = Vec::new();
    for i in 0..n {
        let (s, acked) = (s.clone(), acked.clone());
        tasks.push(tokio::spawn(async move {
            let k = user_key("crash", &format!("u{i}"));
            let token = 10 + i as u64;
            s.fence(&k, Some(token)).await?;
            // Big enough that the writes take a while.
            let state = format!("{{\"i\":{i},\"pad\":\"{}\"}}", "x".repeat(20_000));
            s.save(&k, &state, Some(token)).await?;
            acked.fetch_add(1, Ordering::SeqCst);
            Ok::<_, Error>(i)
        }));
    }
    // Crash once some (not all) are acknowledged.
    let deadline = Instant::now() + Duration::from_secs(20);
    while acked.load(Ordering::SeqCst) < 20 {
        assert!(Instant::now() < deadline, "no saves acknowledged");
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    server.kill();
    let mut saved = Vec::new();
    for t in tasks {
        match t.await.unwrap() {
            Ok(i) => saved.push(i),
            Err(e) => assert!(e.is_retryable(), "a crash is a retryable error: {e}"),
        }
    }
    eprintln!("{} of {n} saves acknowledged before the crash", saved.len());
    assert!(
        saved.len() < n,
        "the crash came mid-way ({} of {n} saved)",
        saved.len()
    );
    // While it is down: typed, retryable errors.
    let down = s.load(&user_key("crash", "u0")).await.unwrap_err();
    assert_eq!(down.kind(), ErrorKind::Unavailable, "{down}");

    server.restart();
    eventually(Duration::from_secs(10), || s.ping()).await;
    for i in 0..n {
        let k = user_key("crash", &format!("u{i}"));
        let state = s.load(&k).await.unwrap();
        let want = format!("{{\"i\":{i},\"pad\":\"{}\"}}", "x".repeat(20_000));
        match state {
            Some(state) => assert_eq!(state, want, "a state is whole or absent"),
            None => assert!(!saved.contains(&i), "acknowledged save {i} was lost"),
        }
        if saved.contains(&i) {
            // The fence survived too: an older holder is still refused.
            let token = 10 + i as u64;
            assert!(matches!(
                s.save(&k, "{}", Some(token - 1)).await,
                Err(Error::StaleLease { current, .. }) if current == token
            ));
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[cfg_attr(not(redis_tests), ignore = "needs Redis; run by cargo xtask test")]
async fn without_persistence_a_restart_forgets_the_fences() {
    // Why the crate docs require persistence: a server that loses its data loses the fences,
    // and a stale holder's token passes again.
    let mut server = Server::start(&["--save", "", "--appendonly", "no"]);
    let s = store(&RedisOptions::new(server.url(None)).key_prefix("t:"));
    let k = key("ivan");
    assert_eq!(s.fence(&k, Some(5)).await.unwrap(), 5);
    s.save(&k, "{\"by\":5}", Some(5)).await.unwrap();
    assert!(s.save(&k, "{\"by\":1}", Some(1)).await.is_err());
    server.restart();
    eventually(Duration::from_secs(10), || s.ping()).await;
    assert_eq!(s.load(&k).await.unwrap(), None, "the state is gone");
    s.save(&k, "{\"by\":1}", Some(1))
        .await
        .expect("with the fence gone, a stale token is accepted");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[cfg_attr(not(redis_tests), ignore = "needs Redis; run by cargo xtask test")]
async fn damaged_data_is_a_typed_error() {
    let options = testkit::options();
    let s = store(&options);
    let mut c = raw(&options.url).await;
    let p = options.key_prefix.clone();
    let malformed = |r: Result<(), Error>, what: &str| {
        let err = r.expect_err(what);
        assert!(matches!(err, Error::MalformedState { .. }), "{what}: {err}");
    };

    // A fence that is not a token.
    let k = key("judy");
    let _: () = redis::cmd("SET")
        .arg(format!("{p}{{{k}}}:fence"))
        .arg("12abc")
        .query_async(&mut c)
        .await
        .unwrap();
    malformed(s.fence(&k, Some(1)).await.map(drop), "fence");
    malformed(s.fence(&k, None).await.map(drop), "fence none");
    malformed(s.save(&k, "{}", Some(1)).await, "save");
    malformed(s.delete(&k, Some(1)).await, "delete");

    // A fence of another type (the script's own command fails).
    let k = key("kim");
    let _: () = redis::cmd("RPUSH")
        .arg(format!("{p}{{{k}}}:fence"))
        .arg("1")
        .query_async(&mut c)
        .await
        .unwrap();
    malformed(s.fence(&k, Some(1)).await.map(drop), "fence on a list");
    malformed(s.save(&k, "{}", Some(1)).await, "save on a list");

    // A state of another type, and one that is not UTF-8.
    let k = key("lee");
    let _: () = redis::cmd("HSET")
        .arg(format!("{p}{{{k}}}:state"))
        .arg("f")
        .arg("v")
        .query_async(&mut c)
        .await
        .unwrap();
    malformed(s.load(&k).await.map(drop), "load of a hash");
    let k = key("max");
    let _: () = redis::cmd("SET")
        .arg(format!("{p}{{{k}}}:state"))
        .arg(&b"{\"\xff\"}"[..])
        .query_async(&mut c)
        .await
        .unwrap();
    malformed(s.load(&k).await.map(drop), "load of bytes");
    // A fence past what INCR can raise: a typed error, not a wrapped-around token.
    let k = key("ned");
    assert_eq!(
        s.fence(&k, Some(i64::MAX as u64)).await.unwrap(),
        i64::MAX as u64
    );
    let err = s.fence(&k, None).await.unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Backend, "{err}");
    // Tokens above 2^53 compare exactly (no Lua doubles).
    let k = key("olga");
    let big = (1u64 << 60) + 1;
    assert_eq!(s.fence(&k, Some(big)).await.unwrap(), big);
    assert!(matches!(
        s.save(&k, "{}", Some(big - 1)).await,
        Err(Error::StaleLease { token, current, .. }) if token == big - 1 && current == big
    ));
    assert_eq!(s.fence(&k, None).await.unwrap(), big + 1);
    assert_eq!(s.fence(&k, Some(u64::MAX)).await.unwrap(), u64::MAX);
    assert!(matches!(
        s.fence(&k, Some(u64::MAX - 1)).await,
        Err(Error::StaleLease {
            current: u64::MAX,
            ..
        })
    ));
    testkit::purge(&options).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[cfg_attr(not(redis_tests), ignore = "needs Redis; run by cargo xtask test")]
async fn the_store_recovers_after_refused_credentials() {
    let pw = "first-password";
    let server = Server::start(&["--save", "", "--appendonly", "no", "--requirepass", pw]);
    let s = store(&RedisOptions::new(server.url(Some(pw))).key_prefix("t:"));
    let k = key("pat");
    s.save(&k, "{}", None).await.unwrap();
    // The operator rotates the password and drops the connections: refused, not retryable.
    let mut admin = raw(&server.url(Some(pw))).await;
    let _: () = redis::cmd("CONFIG")
        .arg("SET")
        .arg("requirepass")
        .arg("rotated")
        .query_async(&mut admin)
        .await
        .unwrap();
    let _: i64 = redis::cmd("CLIENT")
        .arg("KILL")
        .arg("TYPE")
        .arg("normal")
        .query_async(&mut admin)
        .await
        .unwrap_or(0);
    let err = eventually(Duration::from_secs(10), || async {
        match s.load(&k).await {
            Err(e) if e.kind() == ErrorKind::Backend => Ok(e),
            other => Err(format!("{other:?}")),
        }
    })
    .await;
    assert!(!err.is_retryable(), "{err}");
    assert!(!err.to_string().contains(pw), "{err}");
    // ... and back: the same store instance connects again (a manager whose connection was
    // refused is replaced, not kept failing).
    let mut admin = raw(&server.url(Some("rotated"))).await;
    let _: () = redis::cmd("CONFIG")
        .arg("SET")
        .arg("requirepass")
        .arg(pw)
        .query_async(&mut admin)
        .await
        .unwrap();
    let state = eventually(Duration::from_secs(10), || s.load(&k)).await;
    assert_eq!(state.as_deref(), Some("{}"));
}
