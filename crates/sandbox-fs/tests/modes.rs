//! Behaviour specific to one mode: the shared store's namespaces, two-layer reads and
//! compare-and-set under many writers (over the in-memory store, and over Redis when
//! `SANDBOX_TEST_REDIS_URL` is set, as `cargo xtask test` does); the sandbox mode's per-call
//! binding; the facade.

use std::sync::Arc;

use sandbox_core::{CallContext, ErrorKind, IsolationScope, SandboxManager};
use sandbox_fs::{
    EditRequest, FileKind, Filesystem, FilesystemExt as _, FilesystemSpec, GlobOptions,
    GrepOptions, KvStore, LocalFs, LocalOptions, MemoryKvStore, Precondition, SharedStore,
    SharedStoreOptions, Tools, filesystem,
};
use serde_json::json;

struct Shared {
    _tmp: tempfile::TempDir,
    workspace: std::path::PathBuf,
    kv: Kv,
}

/// Where the shared data lives.
enum Kv {
    /// One in-memory store all replicas share.
    Memory(Arc<MemoryKvStore>),
    /// A Redis server: each replica connects on its own, under one key prefix.
    Redis(store_redis::RedisOptions),
}

impl Shared {
    fn new() -> Shared {
        Shared::over(Kv::Memory(Arc::new(MemoryKvStore::new())))
    }

    /// Over the test Redis, under a key prefix of its own (purged by `close`).
    fn redis() -> Shared {
        Shared::over(Kv::Redis(store_redis::testkit::options()))
    }

    fn over(kv: Kv) -> Shared {
        let tmp = tempfile::tempdir().unwrap();
        let workspace = tmp.path().join("ws");
        std::fs::create_dir_all(&workspace).unwrap();
        Shared {
            workspace,
            kv,
            _tmp: tmp,
        }
    }

    /// The in-memory store (for the scenarios that inspect it).
    fn memory(&self) -> &MemoryKvStore {
        match &self.kv {
            Kv::Memory(kv) => kv,
            Kv::Redis(_) => panic!("an in-memory scenario"),
        }
    }

    /// The store one replica reaches the shared data through.
    fn store(&self) -> Arc<dyn KvStore> {
        match &self.kv {
            Kv::Memory(kv) => kv.clone(),
            Kv::Redis(options) => {
                Arc::new(store_redis::RedisKvStore::new(options.clone()).unwrap())
            }
        }
    }

    async fn close(self) {
        if let Kv::Redis(options) = &self.kv {
            store_redis::testkit::purge(options).await.unwrap();
        }
    }

    /// One replica: its own `SharedStore` over the common KV and the common template dir.
    fn replica(&self, scope: IsolationScope) -> SharedStore {
        SharedStore::new(
            self.store(),
            SharedStoreOptions::default()
                .scope(scope)
                .add_shared_prefix("prompts/")
                .local(
                    LocalOptions::default()
                        .project(self._tmp.path())
                        .workspace(&self.workspace),
                ),
        )
        .unwrap()
    }
}

fn ctx(user: Option<&str>, session: Option<&str>) -> CallContext {
    let mut c = CallContext::new("cs");
    if let Some(u) = user {
        c = c.user(u);
    }
    if let Some(s) = session {
        c = c.session(s);
    }
    c
}

#[tokio::test]
async fn routed_paths_land_in_their_namespaces() {
    let s = Shared::new();
    let fs = s
        .replica(IsolationScope::User)
        .for_call(&ctx(Some("alice"), Some("s1")));
    assert_eq!(fs.namespace(), "agents/cs/users/alice");
    for (path, _) in [
        ("MEMORY.md", 0),
        ("memory/2024/notes.md", 0),
        ("skills/review/SKILL.md", 0),
        ("subagents/helper.md", 0),
        ("knowledge/faq.md", 0),
        ("agents/cs/sessions/s1.jsonl", 0),
        ("agents/cs/tasks/t1/state.json", 0),
        ("prompts/greeting.txt", 0),
        ("src/unrouted.rs", 0),
    ] {
        fs.write(path, "x".into()).await.unwrap();
    }
    let mut keys = s.memory().dump();
    keys.sort();
    let want = [
        ("agents/cs/users/alice/extra/prompts", "greeting.txt"),
        ("agents/cs/users/alice/knowledge", "faq.md"),
        ("agents/cs/users/alice/memory", "2024/notes.md"),
        ("agents/cs/users/alice/root", "MEMORY.md"),
        ("agents/cs/users/alice/sessions", "cs/s1.jsonl"),
        ("agents/cs/users/alice/skills", "review/SKILL.md"),
        ("agents/cs/users/alice/subagents", "helper.md"),
        ("agents/cs/users/alice/tasks", "cs/t1/state.json"),
    ];
    let want: Vec<(String, String)> = want
        .iter()
        .map(|(a, b)| (a.to_string(), b.to_string()))
        .collect();
    assert_eq!(keys, want);
    // Unrouted paths fall through to local files.
    assert!(s.workspace.join("src/unrouted.rs").is_file());
    assert!(!s.workspace.join("MEMORY.md").exists());
    // And listing the view shows both kinds, with the logical paths.
    let root: Vec<(String, FileKind)> = fs
        .list("")
        .await
        .unwrap()
        .into_iter()
        .map(|i| (i.path, i.kind))
        .collect();
    for want in [
        ("MEMORY.md".to_owned(), FileKind::File),
        ("agents".to_owned(), FileKind::Dir),
        ("memory".to_owned(), FileKind::Dir),
        ("src".to_owned(), FileKind::Dir),
    ] {
        assert!(root.contains(&want), "{want:?} missing from {root:?}");
    }
    let sessions: Vec<String> = fs
        .walk("agents")
        .await
        .unwrap()
        .into_iter()
        .map(|i| i.path)
        .collect();
    assert_eq!(
        sessions,
        [
            "agents/cs/sessions/s1.jsonl",
            "agents/cs/tasks/t1/state.json"
        ]
    );
    let g = fs
        .grep(GrepOptions::new("x").include("*.md"))
        .await
        .unwrap();
    assert_eq!(g.matches.len(), 5, "{g:?}");
}

#[tokio::test]
async fn scopes_and_anonymous_fallback_pick_the_namespace() {
    let s = Shared::new();
    let ns = |scope, user, session| s.replica(scope).namespace_for(&ctx(user, session));
    assert_eq!(
        ns(IsolationScope::User, Some("bob"), None),
        "agents/cs/users/bob"
    );
    assert_eq!(
        ns(IsolationScope::User, None, Some("s9")),
        "agents/cs/users/_default"
    );
    assert_eq!(
        ns(IsolationScope::Session, Some("bob"), Some("s9")),
        "agents/cs/sessions/s9"
    );
    assert_eq!(
        ns(IsolationScope::Session, None, None),
        "agents/cs/sessions/_default"
    );
    assert_eq!(
        ns(IsolationScope::Agent, Some("bob"), None),
        "agents/cs/shared"
    );
    assert_eq!(ns(IsolationScope::Global, None, None), "global/__global__");
    let custom = SharedStore::new(
        s.store(),
        SharedStoreOptions::default()
            .anonymous_user_id("anonymous")
            .local(
                LocalOptions::default()
                    .project(&s.workspace)
                    .workspace(&s.workspace),
            ),
    )
    .unwrap();
    assert_eq!(
        custom.namespace_for(&ctx(None, None)),
        "agents/cs/users/anonymous"
    );
    // Hostile ids are encoded, so they cannot address another user's namespace.
    assert_eq!(
        ns(IsolationScope::User, Some("../bob"), None),
        "agents/cs/users/%2E.%2Fbob"
    );
}

async fn users_are_isolated_and_replicas_share(s: &Shared) {
    let a = s.replica(IsolationScope::User);
    let b = s.replica(IsolationScope::User);
    a.for_call(&ctx(Some("alice"), None))
        .write("memory/m.md", "alice".into())
        .await
        .unwrap();
    // Another replica, same user: sees it.
    assert_eq!(
        &b.for_call(&ctx(Some("alice"), Some("other-session")))
            .read("memory/m.md")
            .await
            .unwrap()[..],
        b"alice"
    );
    // Another user: does not.
    let bob = b.for_call(&ctx(Some("bob"), None));
    assert_eq!(
        bob.read("memory/m.md").await.unwrap_err().kind(),
        ErrorKind::NotFound
    );
    assert!(
        bob.glob("**/*", GlobOptions::default())
            .await
            .unwrap()
            .files
            .is_empty()
    );
}

async fn routed_reads_fall_back_to_the_local_template(s: &Shared) {
    std::fs::write(s.workspace.join("AGENTS.md"), "template persona\n").unwrap();
    std::fs::create_dir_all(s.workspace.join("skills/review")).unwrap();
    std::fs::write(
        s.workspace.join("skills/review/SKILL.md"),
        "template skill\n",
    )
    .unwrap();
    let fs = s.replica(IsolationScope::Agent).for_call(&ctx(None, None));
    assert_eq!(
        &fs.read("AGENTS.md").await.unwrap()[..],
        b"template persona\n"
    );
    let skills: Vec<String> = fs
        .walk("skills")
        .await
        .unwrap()
        .into_iter()
        .map(|i| i.path)
        .collect();
    assert_eq!(skills, ["skills/review/SKILL.md"]);
    // An edit starts from the template and writes to the store; the template stays.
    fs.edit("AGENTS.md", EditRequest::new("template", "shared"))
        .await
        .unwrap();
    assert_eq!(
        &fs.read("AGENTS.md").await.unwrap()[..],
        b"shared persona\n"
    );
    assert_eq!(
        std::fs::read_to_string(s.workspace.join("AGENTS.md")).unwrap(),
        "template persona\n"
    );
    // Another replica reads the stored version first.
    let other = s
        .replica(IsolationScope::Agent)
        .for_call(&ctx(Some("x"), None));
    assert_eq!(
        &other.read("AGENTS.md").await.unwrap()[..],
        b"shared persona\n"
    );
    // Deleting the stored copy brings the template back; the template itself is read-only.
    other.delete("AGENTS.md").await.unwrap();
    assert_eq!(
        &other.read("AGENTS.md").await.unwrap()[..],
        b"template persona\n"
    );
    let err = other.delete("AGENTS.md").await.unwrap_err();
    assert!(
        err.to_string().contains("read-only local template"),
        "{err}"
    );
}

async fn many_writers_on_many_replicas_lose_no_update(s: &Shared) {
    let path = "memory/counter.md";
    s.replica(IsolationScope::Agent)
        .for_call(&ctx(None, None))
        .write(path, "END\n".into())
        .await
        .unwrap();
    let writers = 64;
    let mut tasks = Vec::new();
    for i in 0..writers {
        // Each writer is its own replica (its own SharedStore, no shared locks): only the
        // store's compare-and-set keeps them from losing each other's edits.
        let fs = s
            .replica(IsolationScope::Agent)
            .for_call(&ctx(Some(&format!("u{i}")), None));
        tasks.push(tokio::spawn(async move {
            fs.edit(path, EditRequest::new("END", format!("line {i}\nEND")))
                .await
                .unwrap();
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    let fs = s.replica(IsolationScope::Agent).for_call(&ctx(None, None));
    let text = String::from_utf8(fs.read(path).await.unwrap().to_vec()).unwrap();
    for i in 0..writers {
        assert!(text.contains(&format!("line {i}\n")), "lost line {i}");
    }
    assert_eq!(text.lines().count(), writers + 1);
}

async fn a_blind_writer_cannot_overwrite_a_newer_version(s: &Shared) {
    let kv = s.store();
    let v1 = kv
        .put("ns", "k", "one".into(), Precondition::Absent)
        .await
        .unwrap();
    kv.put("ns", "k", "two".into(), Precondition::Version(v1))
        .await
        .unwrap();
    let err = kv
        .put("ns", "k", "stale".into(), Precondition::Version(v1))
        .await
        .unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Conflict);
    assert_eq!(&kv.get("ns", "k").await.unwrap().unwrap().value[..], b"two");
}

/// The scenarios above, on each store.
macro_rules! on_every_store {
    ($($name:ident),* $(,)?) => {
        mod memory {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $name() {
                    let s = super::Shared::new();
                    super::$name(&s).await;
                    s.close().await;
                }
            )*
        }
        mod redis {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                #[cfg_attr(not(redis_tests), ignore = "needs Redis; run by cargo xtask test")]
                async fn $name() {
                    let s = super::Shared::redis();
                    super::$name(&s).await;
                    s.close().await;
                }
            )*
        }
    };
}

on_every_store!(
    users_are_isolated_and_replicas_share,
    routed_reads_fall_back_to_the_local_template,
    many_writers_on_many_replicas_lose_no_update,
    a_blind_writer_cannot_overwrite_a_newer_version,
);

#[tokio::test]
async fn listings_scan_only_the_namespaces_they_need() {
    let s = Shared::new();
    let store = s.replica(IsolationScope::User);
    // A big neighbour: another user's memory.
    let bob = store.for_call(&ctx(Some("bob"), None));
    for i in 0..500 {
        bob.write(&format!("memory/{i}.md"), "b".into())
            .await
            .unwrap();
    }
    let alice = store.for_call(&ctx(Some("alice"), None));
    alice.write("memory/a.md", "a".into()).await.unwrap();
    alice.write("knowledge/k.md", "k".into()).await.unwrap();
    let before = s.memory().keys_scanned();
    let found = alice
        .glob("*.md", GlobOptions::default().base("memory"))
        .await
        .unwrap();
    assert_eq!(found.files.len(), 1);
    let scanned = s.memory().keys_scanned() - before;
    assert!(scanned <= 3, "a memory/ glob visited {scanned} keys");
    let before = s.memory().keys_scanned();
    alice.walk("").await.unwrap();
    assert!(
        s.memory().keys_scanned() - before <= 10,
        "a full walk of alice's view visits only her keys"
    );
}

#[tokio::test]
async fn concurrent_calls_each_get_their_own_sandbox() {
    // The binding to a call's sandbox lives in the SandboxFs made for that call: two calls in
    // flight at once, for two users, never see each other's files.
    let tmp = tempfile::tempdir().unwrap();
    let client = sandbox_local::LocalClient::new(
        sandbox_local::LocalOptions::default().base_dir(tmp.path().join("boxes")),
    );
    let manager = SandboxManager::builder(Arc::new(client))
        .scope(IsolationScope::User)
        .build()
        .unwrap();
    let agent = Arc::new(filesystem(FilesystemSpec::sandbox(manager)).unwrap());
    assert!(agent.has_shell());
    let mut tasks = Vec::new();
    for user in ["alice", "bob"] {
        let agent = agent.clone();
        tasks.push(tokio::spawn(async move {
            agent
                .call(&CallContext::new("coder").user(user), |fs| async move {
                    let tools = Tools::new(fs.clone());
                    tools
                        .call("write_file", json!({"path": "who.txt", "content": user}))
                        .await;
                    tokio::time::sleep(std::time::Duration::from_millis(100)).await;
                    let seen = fs.read("who.txt").await.unwrap();
                    let r = fs.execute("cat who.txt", None).await.unwrap();
                    (
                        String::from_utf8(seen.to_vec()).unwrap(),
                        r.stdout_str().to_string(),
                    )
                })
                .await
                .unwrap()
        }));
    }
    for (task, user) in tasks.into_iter().zip(["alice", "bob"]) {
        assert_eq!(task.await.unwrap(), (user.to_owned(), user.to_owned()));
    }
}

#[tokio::test]
async fn facade_defaults_to_local_with_shell_and_accepts_a_custom_filesystem() {
    let tmp = tempfile::tempdir().unwrap();
    let agent = filesystem(FilesystemSpec::local(
        LocalOptions::default().project(tmp.path()),
    ))
    .unwrap();
    assert_eq!(agent.mode(), "local");
    assert!(agent.has_shell());
    assert!(matches!(
        FilesystemSpec::default(),
        FilesystemSpec::Local(_)
    ));
    // With a user id, local calls get the multi-user layout.
    agent
        .call(&CallContext::new("a").user("carol"), |fs| async move {
            fs.write("MEMORY.md", "c".into()).await.unwrap();
        })
        .await
        .unwrap();
    assert!(
        tmp.path()
            .join(".sandbox-harness/workspace/carol/MEMORY.md")
            .is_file()
    );
    // Shared store: no shell, so no execute tool.
    let shared = filesystem(FilesystemSpec::shared_store(
        Arc::new(MemoryKvStore::new()),
        SharedStoreOptions::default().local(LocalOptions::default().project(tmp.path())),
    ))
    .unwrap();
    assert!(!shared.has_shell());
    let names = shared
        .call(&CallContext::new("a"), |fs| async move {
            Tools::new(fs).names()
        })
        .await
        .unwrap();
    assert!(!names.contains(&"execute"));
    // The escape hatch: any Filesystem.
    let mine: Arc<dyn Filesystem> =
        Arc::new(LocalFs::new(LocalOptions::default().project(tmp.path()).shell(false)).unwrap());
    let custom = filesystem(FilesystemSpec::custom(mine)).unwrap();
    assert_eq!(custom.mode(), "local");
    assert!(!custom.has_shell());
}
