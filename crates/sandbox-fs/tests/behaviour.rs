//! One behaviour suite, run over every mode: local + shell, shared store (routed paths, and
//! unrouted paths that fall through to local files; over the in-memory store, and over Redis
//! when `SANDBOX_TEST_REDIS_URL` is set, as `cargo xtask test` does), and sandbox over the real
//! sandbox-local backend. Where the spec makes the modes differ (the shared store has no
//! shell), the scenario asserts the documented difference.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use sandbox_core::{Acquire, ActiveCall, CallContext, ErrorKind, SandboxManager};
use sandbox_fs::{
    EditRequest, FileKind, Filesystem, FilesystemExt as _, GlobOptions, GrepOptions, KvStore,
    LocalFs, LocalOptions, MemoryKvStore, ReadOptions, SandboxFs, SharedStore, SharedStoreOptions,
    Tools,
};
use serde_json::json;

/// One mode under test.
pub struct Fixture {
    /// The mode's name.
    pub mode: &'static str,
    /// The filesystem under test.
    pub fs: Arc<dyn Filesystem>,
    /// Prefix of the paths scenarios use (routes them to the store in shared-store mode).
    pub base: &'static str,
    /// Host directory where a relative symlink name is planted; `None`: plant with the shell.
    pub link_dir: Option<PathBuf>,
    /// A directory outside every root, holding `secret`.
    pub outside: PathBuf,
    call: Option<ActiveCall>,
    /// The Redis key prefix to purge at the end (shared store over Redis).
    redis: Option<store_redis::RedisOptions>,
    _tmp: tempfile::TempDir,
}

impl Fixture {
    fn p(&self, path: &str) -> String {
        format!("{}{path}", self.base)
    }

    async fn plant_link(&self, name: &str, target: &Path) {
        match &self.link_dir {
            Some(dir) => std::os::unix::fs::symlink(target, dir.join(name)).unwrap(),
            None => {
                let r = self
                    .fs
                    .execute(&format!("ln -s '{}' '{name}'", target.display()), None)
                    .await
                    .unwrap();
                assert!(r.success(), "{r:?}");
            }
        }
    }

    async fn close(mut self) {
        if let Some(call) = self.call.take() {
            call.finish().await.unwrap();
        }
        if let Some(options) = self.redis.take() {
            store_redis::testkit::purge(&options).await.unwrap();
        }
    }
}

fn outside(tmp: &Path) -> PathBuf {
    let dir = tmp.join("outside");
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("secret"), "top secret\n").unwrap();
    dir
}

async fn local() -> Fixture {
    let tmp = tempfile::tempdir().unwrap();
    let project = tmp.path().join("project");
    std::fs::create_dir_all(&project).unwrap();
    let fs = LocalFs::new(LocalOptions::default().project(&project)).unwrap();
    Fixture {
        mode: "local",
        link_dir: Some(fs.workspace_dir().to_path_buf()),
        fs: Arc::new(fs),
        base: "",
        outside: outside(tmp.path()),
        call: None,
        redis: None,
        _tmp: tmp,
    }
}

async fn shared(base: &'static str) -> Fixture {
    shared_over(Arc::new(MemoryKvStore::new()), None, base)
}

/// The shared store over Redis, under a key prefix of its own (purged by `close`).
async fn shared_redis(base: &'static str) -> Fixture {
    let options = store_redis::testkit::options();
    let kv = Arc::new(store_redis::RedisKvStore::new(options.clone()).unwrap());
    shared_over(kv, Some(options), base)
}

fn shared_over(
    kv: Arc<dyn KvStore>,
    redis: Option<store_redis::RedisOptions>,
    base: &'static str,
) -> Fixture {
    let tmp = tempfile::tempdir().unwrap();
    let project = tmp.path().join("project");
    std::fs::create_dir_all(&project).unwrap();
    let store = SharedStore::new(
        kv,
        SharedStoreOptions::default().local(LocalOptions::default().project(&project)),
    )
    .unwrap();
    let fs = store.for_call(&CallContext::new("suite").user("alice"));
    Fixture {
        mode: "shared_store",
        link_dir: Some(project.join(sandbox_fs::local::DEFAULT_WORKSPACE_DIR)),
        fs: Arc::new(fs),
        base,
        outside: outside(tmp.path()),
        call: None,
        redis,
        _tmp: tmp,
    }
}

async fn sandbox() -> Fixture {
    let tmp = tempfile::tempdir().unwrap();
    let client = sandbox_local::LocalClient::new(
        sandbox_local::LocalOptions::default().base_dir(tmp.path().join("boxes")),
    );
    let manager = SandboxManager::builder(Arc::new(client)).build().unwrap();
    let call = manager
        .begin(&CallContext::new("suite"), Acquire::Auto)
        .await
        .unwrap();
    let fs = SandboxFs::new(call.sandbox().clone());
    Fixture {
        mode: "sandbox",
        fs: Arc::new(fs),
        base: "",
        link_dir: None,
        outside: outside(tmp.path()),
        call: Some(call),
        redis: None,
        _tmp: tmp,
    }
}

fn kind<T: std::fmt::Debug>(r: sandbox_core::Result<T>) -> ErrorKind {
    r.expect_err("expected an error").kind()
}

mod scenarios {
    use super::*;

    pub async fn write_then_read(fx: &Fixture) {
        let fs = &fx.fs;
        let out = fs
            .write(&fx.p("notes/deep/a.txt"), "hello\n".into())
            .await
            .unwrap();
        assert!(out.created, "{}", fx.mode);
        assert_eq!(out.bytes, 6);
        assert_eq!(
            &fs.read(&fx.p("notes/deep/a.txt")).await.unwrap()[..],
            b"hello\n"
        );
        let out = fs
            .write(&fx.p("notes/deep/a.txt"), "bye\n".into())
            .await
            .unwrap();
        assert!(!out.created);
        assert_eq!(
            &fs.read(&fx.p("notes/deep/a.txt")).await.unwrap()[..],
            b"bye\n"
        );
        let info = fs.stat(&fx.p("notes/deep/a.txt")).await.unwrap().unwrap();
        assert_eq!((info.kind, info.size), (FileKind::File, 4));
        let dir = fs.stat(&fx.p("notes/deep")).await.unwrap().unwrap();
        assert_eq!(dir.kind, FileKind::Dir);
        // Writing over a directory is refused.
        assert_eq!(
            kind(fs.write(&fx.p("notes/deep"), "x".into()).await),
            ErrorKind::InvalidInput
        );
    }

    pub async fn read_window(fx: &Fixture) {
        let text: String = (1..=50).map(|i| format!("line {i}\n")).collect();
        fx.fs.write(&fx.p("long.txt"), text.into()).await.unwrap();
        let w = fx
            .fs
            .read_text(
                &fx.p("long.txt"),
                ReadOptions::default().offset(10).limit(5),
            )
            .await
            .unwrap();
        assert_eq!((w.first_line, w.lines, w.total_lines), (11, 5, 50));
        assert!(w.text.starts_with("    11\tline 11\n"), "{:?}", w.text);
        assert!(w.truncated);
        assert!(w.notice.unwrap().contains("offset=15"));
        let w = fx
            .fs
            .read_text(&fx.p("long.txt"), ReadOptions::default().max_bytes(100))
            .await
            .unwrap();
        assert!(w.text.len() <= 100 && w.lines > 0 && w.truncated);
        assert!(w.notice.unwrap().contains("cut at 100 bytes"));
        let w = fx
            .fs
            .read_text(&fx.p("long.txt"), ReadOptions::default())
            .await
            .unwrap();
        assert_eq!(w.lines, 50);
        assert!(!w.truncated && w.notice.is_none());
    }

    pub async fn read_missing_and_dirs(fx: &Fixture) {
        assert_eq!(
            kind(fx.fs.read(&fx.p("nope.txt")).await),
            ErrorKind::NotFound
        );
        assert!(fx.fs.stat(&fx.p("nope.txt")).await.unwrap().is_none());
        assert!(!fx.fs.exists(&fx.p("nope.txt")).await.unwrap());
        fx.fs.write(&fx.p("d/f.txt"), "x".into()).await.unwrap();
        assert_eq!(kind(fx.fs.read(&fx.p("d")).await), ErrorKind::InvalidInput);
    }

    pub async fn edit_exact_strings(fx: &Fixture) {
        let p = fx.p("code.txt");
        fx.fs
            .write(&p, "a = 1\nb = 2\na = 1\nc = 3\na = 1\n".into())
            .await
            .unwrap();
        let err = fx
            .fs
            .edit(&p, EditRequest::new("a = 1", "a = 9"))
            .await
            .unwrap_err();
        assert_eq!(err.kind(), ErrorKind::Conflict);
        assert!(err.to_string().contains("3 times (lines 1, 3, 5)"), "{err}");
        let err = fx
            .fs
            .edit(&p, EditRequest::new("zzz", "y"))
            .await
            .unwrap_err();
        assert_eq!(err.kind(), ErrorKind::NotFound);
        assert!(err.to_string().contains("0 matches"), "{err}");
        let e = fx
            .fs
            .edit(&p, EditRequest::new("b = 2", "b = 20"))
            .await
            .unwrap();
        assert_eq!((e.replacements, e.lines.clone()), (1, vec![2]));
        let e = fx
            .fs
            .edit(&p, EditRequest::new("a = 1", "a = 0").replace_all(true))
            .await
            .unwrap();
        assert_eq!(e.replacements, 3);
        assert_eq!(
            &fx.fs.read(&p).await.unwrap()[..],
            b"a = 0\nb = 20\na = 0\nc = 3\na = 0\n"
        );
        assert_eq!(
            kind(
                fx.fs
                    .edit(&fx.p("absent.txt"), EditRequest::new("a", "b"))
                    .await
            ),
            ErrorKind::NotFound
        );
    }

    pub async fn edit_keeps_line_endings(fx: &Fixture) {
        let p = fx.p("dos.txt");
        fx.fs
            .write(&p, "one\r\ntwo\r\nthree\r\n".into())
            .await
            .unwrap();
        fx.fs
            .edit(&p, EditRequest::new("two\nthree", "2\n3"))
            .await
            .unwrap();
        assert_eq!(&fx.fs.read(&p).await.unwrap()[..], b"one\r\n2\r\n3\r\n");
    }

    pub async fn binary_roundtrip(fx: &Fixture) {
        let data: Vec<u8> = (0..4).flat_map(|_| 0u8..=255).collect();
        let p = fx.p("blob.bin");
        fx.fs.write(&p, data.clone().into()).await.unwrap();
        assert_eq!(&fx.fs.read(&p).await.unwrap()[..], &data[..]);
        assert_eq!(
            kind(fx.fs.read_text(&p, ReadOptions::default()).await),
            ErrorKind::InvalidInput
        );
        assert_eq!(
            kind(fx.fs.edit(&p, EditRequest::new("a", "b")).await),
            ErrorKind::InvalidInput
        );
        assert_eq!(
            &fx.fs.read(&p).await.unwrap()[..],
            &data[..],
            "a refused edit changes nothing"
        );
        // Invalid UTF-8 without NUL bytes survives too.
        fx.fs
            .write(&fx.p("latin1.txt"), vec![0x63, 0x61, 0x66, 0xe9].into())
            .await
            .unwrap();
        assert_eq!(
            &fx.fs.read(&fx.p("latin1.txt")).await.unwrap()[..],
            b"caf\xe9"
        );
        let g = fx
            .fs
            .grep(GrepOptions::new(".").path(fx.p("")))
            .await
            .unwrap();
        assert!(g.matches.is_empty() && g.files_skipped == 2, "{g:?}");
    }

    pub async fn list_entries(fx: &Fixture) {
        fx.fs.write(&fx.p("top/a.txt"), "abc".into()).await.unwrap();
        fx.fs
            .write(&fx.p("top/sub/b.txt"), "de".into())
            .await
            .unwrap();
        let entries = fx.fs.list(&fx.p("top")).await.unwrap();
        let got: Vec<(String, FileKind, u64)> = entries
            .iter()
            .map(|e| (e.path.clone(), e.kind, e.size))
            .collect();
        assert_eq!(
            got,
            [
                (fx.p("top/a.txt"), FileKind::File, 3),
                (fx.p("top/sub"), FileKind::Dir, 0)
            ]
        );
        assert_eq!(entries[0].name(), "a.txt");
        assert_eq!(
            kind(fx.fs.list(&fx.p("top/a.txt")).await),
            ErrorKind::InvalidInput
        );
        assert_eq!(
            kind(fx.fs.list(&fx.p("missing")).await),
            ErrorKind::NotFound
        );
        let root = fx.fs.list("").await.unwrap();
        let top = fx
            .base
            .split('/')
            .next()
            .filter(|s| !s.is_empty())
            .unwrap_or("top");
        assert!(
            root.iter()
                .any(|e| e.name() == top && e.kind == FileKind::Dir),
            "{root:?}"
        );
    }

    pub async fn glob_patterns(fx: &Fixture) {
        for p in [
            "g/README.md",
            "g/docs/guide.md",
            "g/src/main.rs",
            "g/src/util/mod.rs",
        ] {
            fx.fs.write(&fx.p(p), "x\n".into()).await.unwrap();
        }
        let base = fx.p("g");
        let paths = |r: sandbox_fs::GlobResult| -> Vec<String> {
            r.files.into_iter().map(|f| f.path).collect()
        };
        let g = |pat: &'static str| {
            let base = base.clone();
            let fs = fx.fs.clone();
            async move {
                fs.glob(pat, GlobOptions::default().base(base))
                    .await
                    .unwrap()
            }
        };
        assert_eq!(
            paths(g("*.md").await),
            [fx.p("g/README.md"), fx.p("g/docs/guide.md")]
        );
        assert_eq!(
            paths(g("src/**/*.rs").await),
            [fx.p("g/src/main.rs"), fx.p("g/src/util/mod.rs")]
        );
        assert_eq!(paths(g("src/*.rs").await), [fx.p("g/src/main.rs")]);
        assert_eq!(paths(g("docs/").await), [fx.p("g/docs/guide.md")]);
        let r = fx
            .fs
            .glob(
                "*",
                GlobOptions::default().base(base.clone()).max_results(1),
            )
            .await
            .unwrap();
        assert!(r.truncated && r.files.len() == 1);
        assert_eq!(
            kind(fx.fs.glob("../*", GlobOptions::default()).await),
            ErrorKind::InvalidInput
        );
    }

    pub async fn grep_search(fx: &Fixture) {
        fx.fs
            .write(
                &fx.p("s/a.rs"),
                "fn alpha() {}\nlet a.b = 1;\nFN BETA\n".into(),
            )
            .await
            .unwrap();
        fx.fs
            .write(&fx.p("s/b.md"), "fn gamma\naxb\n".into())
            .await
            .unwrap();
        let base = fx.p("s");
        let r = fx
            .fs
            .grep(GrepOptions::new(r"fn \w+").path(&base))
            .await
            .unwrap();
        let got: Vec<(String, usize)> = r
            .matches
            .iter()
            .map(|m| (m.path.clone(), m.line_number))
            .collect();
        assert_eq!(got, [(fx.p("s/a.rs"), 1), (fx.p("s/b.md"), 1)]);
        let r = fx
            .fs
            .grep(GrepOptions::new("a.b").literal(true).path(&base))
            .await
            .unwrap();
        assert_eq!(r.matches.len(), 1);
        assert_eq!(r.matches[0].line, "let a.b = 1;");
        let r = fx
            .fs
            .grep(
                GrepOptions::new("fn")
                    .include("*.rs")
                    .case_insensitive(true)
                    .path(&base),
            )
            .await
            .unwrap();
        assert_eq!(r.matches.len(), 2);
        let r = fx
            .fs
            .grep(GrepOptions::new("a").path(&base).max_results(2))
            .await
            .unwrap();
        assert!(r.truncated && r.matches.len() == 2);
        let r = fx
            .fs
            .grep(GrepOptions::new("gamma").path(fx.p("s/b.md")))
            .await
            .unwrap();
        assert_eq!(r.matches.len(), 1);
        assert_eq!(
            kind(fx.fs.grep(GrepOptions::new("(unclosed").path(&base)).await),
            ErrorKind::InvalidInput
        );
    }

    pub async fn delete_and_exists(fx: &Fixture) {
        fx.fs.write(&fx.p("del/one.txt"), "1".into()).await.unwrap();
        fx.fs
            .write(&fx.p("del/sub/two.txt"), "2".into())
            .await
            .unwrap();
        assert!(fx.fs.exists(&fx.p("del/one.txt")).await.unwrap());
        fx.fs.delete(&fx.p("del/one.txt")).await.unwrap();
        assert!(!fx.fs.exists(&fx.p("del/one.txt")).await.unwrap());
        assert_eq!(
            kind(fx.fs.delete(&fx.p("del/one.txt")).await),
            ErrorKind::NotFound
        );
        fx.fs.delete(&fx.p("del")).await.unwrap();
        assert!(!fx.fs.exists(&fx.p("del/sub/two.txt")).await.unwrap());
        assert!(!fx.fs.exists(&fx.p("del")).await.unwrap());
    }

    pub async fn move_files_and_dirs(fx: &Fixture) {
        fx.fs.write(&fx.p("m/a.txt"), "A".into()).await.unwrap();
        fx.fs
            .rename(&fx.p("m/a.txt"), &fx.p("m/b.txt"))
            .await
            .unwrap();
        assert!(!fx.fs.exists(&fx.p("m/a.txt")).await.unwrap());
        assert_eq!(&fx.fs.read(&fx.p("m/b.txt")).await.unwrap()[..], b"A");
        fx.fs.write(&fx.p("m/c.txt"), "C".into()).await.unwrap();
        assert_eq!(
            kind(fx.fs.rename(&fx.p("m/c.txt"), &fx.p("m/b.txt")).await),
            ErrorKind::Conflict
        );
        fx.fs
            .write(&fx.p("m/dir/x/y.txt"), "Y".into())
            .await
            .unwrap();
        fx.fs
            .rename(&fx.p("m/dir"), &fx.p("m/moved"))
            .await
            .unwrap();
        assert_eq!(
            &fx.fs.read(&fx.p("m/moved/x/y.txt")).await.unwrap()[..],
            b"Y"
        );
        assert!(!fx.fs.exists(&fx.p("m/dir")).await.unwrap());
        assert_eq!(
            kind(fx.fs.rename(&fx.p("m/nope"), &fx.p("m/z")).await),
            ErrorKind::NotFound
        );
    }

    pub async fn escapes_rejected(fx: &Fixture) {
        let secret = fx.outside.join("secret").display().to_string();
        let planted = fx.outside.join("planted").display().to_string();
        for bad in [
            "../x",
            "a/../../x",
            "ok/../../../etc/passwd",
            "a\0b",
            "/etc/passwd",
            &secret,
        ] {
            let err = fx.fs.read(bad).await.unwrap_err();
            assert_eq!(
                err.kind(),
                ErrorKind::InvalidInput,
                "{} read {bad:?}: {err}",
                fx.mode
            );
            assert!(
                matches!(err, sandbox_core::Error::PathEscape { .. }),
                "{bad:?}: {err}"
            );
            let err = fx.fs.write(bad, "x".into()).await.unwrap_err();
            assert!(
                matches!(err, sandbox_core::Error::PathEscape { .. }),
                "{bad:?}: {err}"
            );
        }
        let err = fx.fs.write(&planted, "x".into()).await.unwrap_err();
        assert!(
            matches!(err, sandbox_core::Error::PathEscape { .. }),
            "{err}"
        );
        assert!(!fx.outside.join("planted").exists());
        for bad in ["..", "/", "../outside"] {
            assert!(fx.fs.list(bad).await.is_err(), "{} list {bad:?}", fx.mode);
        }
        assert!(
            fx.fs
                .glob("*", GlobOptions::default().base(".."))
                .await
                .is_err()
        );
        assert!(
            fx.fs
                .grep(GrepOptions::new("secret").path("../"))
                .await
                .is_err()
        );
    }

    pub async fn symlinks_cannot_lead_out(fx: &Fixture) {
        fx.plant_link("leak", &fx.outside.join("secret")).await;
        fx.plant_link("outdir", &fx.outside).await;
        for path in ["leak", "outdir/secret"] {
            let err = fx.fs.read(path).await.unwrap_err();
            assert!(
                matches!(err, sandbox_core::Error::PathEscape { .. }),
                "{} {path}: {err}",
                fx.mode
            );
        }
        let err = fx.fs.write("outdir/new.txt", "x".into()).await.unwrap_err();
        assert_eq!(err.kind(), ErrorKind::InvalidInput, "{err}");
        assert!(!fx.outside.join("new.txt").exists());
        assert!(
            fx.fs
                .edit("leak", EditRequest::new("top", "bottom"))
                .await
                .is_err()
        );
        assert_eq!(
            std::fs::read_to_string(fx.outside.join("secret")).unwrap(),
            "top secret\n"
        );
        let g = fx.fs.grep(GrepOptions::new("secret")).await.unwrap();
        assert!(
            g.matches.is_empty(),
            "{} grep reached through a link: {g:?}",
            fx.mode
        );
    }

    pub async fn shell(fx: &Fixture) {
        if fx.mode == "shared_store" {
            // The spec: this mode has no shell, on purpose.
            assert!(fx.fs.shell().is_none());
            let err = fx.fs.execute("echo hi", None).await.unwrap_err();
            assert_eq!(err.kind(), ErrorKind::NotSupported);
            assert!(err.to_string().contains("no shell"), "{err}");
            return;
        }
        let r = fx
            .fs
            .execute("echo out; echo err >&2; exit 3", None)
            .await
            .unwrap();
        assert_eq!(r.exit_code, Some(3));
        assert_eq!(
            (&r.stdout[..], &r.stderr[..]),
            (&b"out\n"[..], &b"err\n"[..])
        );
        assert!(!r.timed_out && !r.truncated());
        let r = fx
            .fs
            .execute("head -c 300000 /dev/zero | tr '\\0' a", None)
            .await
            .unwrap();
        assert!(
            r.stdout_truncated && r.stdout.len() == 100_000,
            "{}",
            r.stdout.len()
        );
        let started = std::time::Instant::now();
        let r = fx
            .fs
            .execute(
                "echo before; sleep 30 & echo $! > bg.pid; wait",
                Some(Duration::from_secs(1)),
            )
            .await
            .unwrap();
        assert!(r.timed_out && r.exit_code.is_none(), "{r:?}");
        assert_eq!(&r.stdout[..], b"before\n");
        assert!(started.elapsed() < Duration::from_secs(10));
        let pid: i32 = String::from_utf8(fx.fs.read("bg.pid").await.unwrap().to_vec())
            .unwrap()
            .trim()
            .parse()
            .unwrap();
        // In sandbox mode the box is the local backend's confined default: `$!` is a pid of
        // the command's own PID namespace, which means nothing on the host (and that namespace
        // dies whole at the timeout: sandbox-local's `tests/escape.rs` checks it from inside).
        if fx.mode != "sandbox" {
            assert!(
                !alive(pid),
                "the backgrounded grandchild survived the timeout"
            );
        }
    }

    pub async fn tools_surface(fx: &Fixture) {
        let tools = Tools::new(fx.fs.clone());
        let names: Vec<&str> = tools.definitions().iter().map(|d| d.name).collect();
        let mut want = vec![
            "read_file",
            "write_file",
            "edit_file",
            "grep_files",
            "glob_files",
            "list_files",
        ];
        if fx.mode != "shared_store" {
            want.push("execute");
        }
        assert_eq!(names, want);
        for d in tools.definitions() {
            assert_eq!(d.parameters["type"], "object");
            assert_eq!(d.parameters["additionalProperties"], false);
        }
        let p = fx.p("t/x.txt");
        let out = tools
            .call("write_file", json!({"path": p, "content": "a\nb\na\n"}))
            .await;
        assert!(!out.is_error && out.text.starts_with("Created"), "{out:?}");
        let out = tools.call("read_file", json!({"path": p})).await;
        assert_eq!(out.text, "     1\ta\n     2\tb\n     3\ta\n");
        let out = tools
            .call(
                "edit_file",
                json!({"path": p, "old_string": "a", "new_string": "c"}),
            )
            .await;
        assert!(
            out.is_error && out.text.contains("occurs 2 times (lines 1, 3)"),
            "{out:?}"
        );
        let out = tools.call("read_file", json!({"file": p})).await;
        assert!(
            out.is_error
                && out.text.contains("unknown argument `file`")
                && out.text.contains("path"),
            "{out:?}"
        );
        let out = tools
            .call("read_file", json!({"path": p, "offset": -1}))
            .await;
        assert!(out.is_error && out.text.contains("`offset`"), "{out:?}");
        let out = tools
            .call("read_file", json!({"path": "../etc/passwd"}))
            .await;
        assert!(out.is_error && out.text.contains("not allowed"), "{out:?}");
        let out = tools
            .call("read_file", json!({"path": fx.p("t/none.txt")}))
            .await;
        assert!(out.is_error && out.text.contains("list_files"), "{out:?}");
        let out = tools
            .call("grep_files", json!({"pattern": "b", "path": fx.p("t")}))
            .await;
        assert_eq!(out.text, format!("{p}:2: b\n"));
        let out = tools
            .call("glob_files", json!({"pattern": "*.txt", "path": fx.p("t")}))
            .await;
        assert_eq!(out.text, format!("{p}\n"));
        let out = tools.call("list_files", json!({"path": fx.p("t")})).await;
        assert_eq!(out.text, "x.txt  (6 bytes)\n");
        let out = tools.call("delete_everything", json!({})).await;
        assert!(out.is_error && out.text.contains("available tools"));
        let out = tools.call("execute", json!({"command": "echo hi"})).await;
        if fx.mode == "shared_store" {
            assert!(out.is_error && out.text.contains("no shell"), "{out:?}");
        } else {
            assert_eq!(out.text, "exit code: 0\nstdout:\nhi\n");
        }
    }

    pub async fn concurrent_edits_lose_nothing(fx: &Fixture) {
        let p = fx.p("shared-log.md");
        fx.fs.write(&p, "# log\nEND\n".into()).await.unwrap();
        let writers = 24;
        let mut tasks = Vec::new();
        for i in 0..writers {
            let fs = fx.fs.clone();
            let p = p.clone();
            tasks.push(tokio::spawn(async move {
                fs.edit(&p, EditRequest::new("END", format!("entry {i}\nEND")))
                    .await
                    .unwrap();
            }));
        }
        for t in tasks {
            t.await.unwrap();
        }
        let text = String::from_utf8(fx.fs.read(&p).await.unwrap().to_vec()).unwrap();
        for i in 0..writers {
            assert!(
                text.contains(&format!("entry {i}\n")),
                "{} lost entry {i}",
                fx.mode
            );
        }
        assert_eq!(text.lines().count(), writers + 2);
    }
}

/// Whether `pid` is a live process. A killed process whose new parent (pid 1 in a container)
/// has not reaped it yet is a zombie: dead. Polls for up to 2 s (SIGKILL is asynchronous).
fn alive(pid: i32) -> bool {
    let running = || match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Ok(stat) => {
            let state = stat
                .rsplit(')')
                .next()
                .unwrap_or("")
                .split_whitespace()
                .next();
            !matches!(state, Some("Z") | Some("X"))
        }
        Err(_) => false,
    };
    for _ in 0..20 {
        if !running() {
            return false;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    true
}

macro_rules! suite {
    ($mode:ident, $make:expr $(, #[$attr:meta])*) => {
        mod $mode {
            use super::*;
            suite!(@tests $make; [$(#[$attr])*]; write_then_read, read_window,
                read_missing_and_dirs, edit_exact_strings, edit_keeps_line_endings,
                binary_roundtrip, list_entries, glob_patterns, grep_search, delete_and_exists,
                move_files_and_dirs, escapes_rejected, symlinks_cannot_lead_out, shell,
                tools_surface, concurrent_edits_lose_nothing);
        }
    };
    (@tests $make:expr; $attrs:tt; $($name:ident),* $(,)?) => {
        $(
            suite!(@test $make; $attrs; $name);
        )*
    };
    (@test $make:expr; [$(#[$attr:meta])*]; $name:ident) => {
        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        $(#[$attr])*
        async fn $name() {
            let fx = $make.await;
            scenarios::$name(&fx).await;
            fx.close().await;
        }
    };
}

suite!(local_mode, local());
suite!(shared_store_routed, shared("memory/"));
suite!(shared_store_unrouted, shared(""));
suite!(
    shared_store_redis_routed,
    shared_redis("memory/"),
    #[cfg_attr(not(redis_tests), ignore = "needs Redis; run by cargo xtask test")]
);
suite!(
    shared_store_redis_unrouted,
    shared_redis(""),
    #[cfg_attr(not(redis_tests), ignore = "needs Redis; run by cargo xtask test")]
);
suite!(sandbox_mode_over_sandbox_local, sandbox());
