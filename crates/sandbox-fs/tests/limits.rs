//! Every tool on 64 MiB adversarial inputs — one line of one repeated character, 32 Mi short
//! lines, a million matches, a directory of 100,000 entries, commands printing 64 MiB —
//! ends with a result or a typed limit error before a hang guard, and a dropped call stops
//! its work (its CPU time stops advancing, its edit never lands).
//!
//! The hang guard is generous on purpose: it tells "answers" from "hangs" (the quadratic
//! `edit_file` of the attack probe gave no answer in 60 s at 256 KiB), it is not a speed
//! assertion; `cargo xtask bench tools` measures the times. The tests run one at a time (they
//! hold 64 MiB inputs, and the cancellation test reads the process's CPU time).

use std::future::Future;
use std::path::Path;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use sandbox_core::ErrorKind;
use sandbox_fs::{
    EditRequest, Filesystem, FilesystemExt as _, GrepOptions, LocalFs, LocalOptions, ReadOptions,
    Tools,
};
use serde_json::json;

/// The size of every adversarial file: the documented limit of the text tools.
const SIZE: usize = 64 << 20;
/// A call that has not answered by then hangs.
const HANG_GUARD: Duration = Duration::from_secs(300);
/// Lines of `matches.txt`, each holding one `needle`.
const MATCH_LINES: usize = 1 << 20;

static SERIAL: Mutex<()> = Mutex::new(());

fn serial() -> MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|e| e.into_inner())
}

/// Run `test` on a runtime of its own and fail if it has not finished within the hang guard.
/// The test body runs as a task, so the guard's timer fires even when the task blocks a worker
/// thread; a hung runtime is then abandoned, not waited for.
fn guarded<F>(name: &str, test: F)
where
    F: Future<Output = ()> + Send + 'static,
{
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let task = runtime.spawn(test);
    let outcome = runtime.block_on(async { tokio::time::timeout(HANG_GUARD, task).await });
    match outcome {
        Ok(Ok(())) => runtime.shutdown_timeout(Duration::from_secs(10)),
        Ok(Err(e)) => {
            runtime.shutdown_background();
            std::panic::resume_unwind(e.into_panic());
        }
        Err(_) => {
            runtime.shutdown_background();
            panic!("{name}: no answer within the hang guard of {HANG_GUARD:?}");
        }
    }
}

/// A project holding the adversarial inputs, and the local mode over it.
struct Inputs {
    fs: Arc<LocalFs>,
    tools: Tools,
    _tmp: tempfile::TempDir,
}

fn write(dir: &Path, name: &str, data: &[u8]) {
    std::fs::write(dir.join(name), data).unwrap();
}

impl Inputs {
    fn new() -> Inputs {
        let tmp = tempfile::tempdir().unwrap();
        let project = tmp.path().join("project");
        std::fs::create_dir_all(&project).unwrap();
        // One line of one repeated character.
        write(&project, "line.txt", &vec![b'y'; SIZE]);
        // 32 Mi short lines.
        write(&project, "lines.txt", &b"y\n".repeat(SIZE / 2));
        // A million matches: 64-byte lines each holding `needle`, and a unique last line.
        let mut matches = Vec::with_capacity(SIZE);
        for i in 0..MATCH_LINES - 1 {
            let line = format!("needle {i:>12} {}\n", "-".repeat(43));
            matches.extend_from_slice(line.as_bytes());
        }
        matches.extend_from_slice(format!("{:<63}\n", "THE END").as_bytes());
        assert_eq!(matches.len(), SIZE);
        write(&project, "matches.txt", &matches);
        // One byte over the limit.
        write(&project, "over.txt", &vec![b'y'; SIZE + 1]);
        let fs = Arc::new(
            LocalFs::new(
                LocalOptions::default()
                    .project(&project)
                    .max_output_bytes(100_000),
            )
            .unwrap(),
        );
        let tools = Tools::new(fs.clone() as Arc<dyn Filesystem>);
        Inputs {
            fs,
            tools,
            _tmp: tmp,
        }
    }

    fn project(&self) -> &Path {
        self.fs.project_dir()
    }
}

/// Call a tool and return its output, whatever it is.
async fn call(tools: &Tools, name: &str, args: serde_json::Value) -> sandbox_fs::ToolOutput {
    let shown = args.to_string();
    let shown = &shown[..shown.len().min(120)];
    let out = tools.call(name, args).await;
    eprintln!(
        "{name} {shown}: is_error={} {:?}",
        out.is_error,
        &out.text[..out.text.len().min(200)]
    );
    out
}

/// `Err` of the typed limit error.
fn assert_limit<T: std::fmt::Debug>(what: &str, r: sandbox_core::Result<T>) {
    match r {
        Err(e) => assert_eq!(e.kind(), ErrorKind::LimitExceeded, "{what}: {e}"),
        Ok(v) => panic!("{what}: expected a limit error, got {v:?}"),
    }
}

#[test]
fn read_file_on_64_mib_inputs() {
    let _serial = serial();
    let inputs = Inputs::new();
    guarded("read_file", async move {
        let t = &inputs.tools;
        let out = call(t, "read_file", json!({"path": "line.txt"})).await;
        assert!(
            !out.is_error && out.text.contains("[line cut]"),
            "{}",
            out.text
        );
        for path in ["lines.txt", "matches.txt"] {
            let out = call(t, "read_file", json!({"path": path})).await;
            assert!(!out.is_error && out.text.contains("read on with offset="));
            // The last window: every line before it is passed over.
            let out = call(
                t,
                "read_file",
                json!({"path": path, "offset": 33_554_431, "limit": 100_000}),
            )
            .await;
            assert!(!out.is_error, "{}", out.text);
        }
        let w = inputs
            .fs
            .read_text("lines.txt", ReadOptions::default().offset(SIZE / 2 - 1))
            .await
            .unwrap();
        assert_eq!((w.total_lines, w.lines), (SIZE / 2, 1));
        let out = call(t, "read_file", json!({"path": "over.txt"})).await;
        assert!(
            out.is_error && out.text.contains("more than"),
            "{}",
            out.text
        );
        assert_limit(
            "read_text over.txt",
            inputs
                .fs
                .read_text("over.txt", ReadOptions::default())
                .await,
        );
    });
}

#[test]
fn edit_file_on_64_mib_inputs() {
    let _serial = serial();
    let inputs = Inputs::new();
    guarded("edit_file", async move {
        let t = &inputs.tools;
        // The attack probe's case: a one-line file of `y`s, old_string `y`.
        for path in ["line.txt", "lines.txt"] {
            let out = call(
                t,
                "edit_file",
                json!({"path": path, "old_string": "y", "new_string": "z"}),
            )
            .await;
            assert!(
                out.is_error && out.text.contains("more than 1000 times"),
                "{}",
                out.text
            );
        }
        let out = call(
            t,
            "edit_file",
            json!({"path": "matches.txt", "old_string": "needle", "new_string": "pin"}),
        )
        .await;
        assert!(out.is_error && out.text.contains("more than 1000 times"));
        // One match at the very end: one whole pass.
        let out = call(
            t,
            "edit_file",
            json!({"path": "matches.txt", "old_string": "THE END", "new_string": "the end"}),
        )
        .await;
        assert!(!out.is_error, "{}", out.text);
        assert!(
            out.text.contains(&format!("line {MATCH_LINES}")),
            "{}",
            out.text
        );
        // Every one of 64 Mi and of a million occurrences.
        for (path, old, count) in [
            ("line.txt", "y", SIZE),
            ("lines.txt", "y", SIZE / 2),
            ("matches.txt", "needle", MATCH_LINES - 1),
        ] {
            let out = call(
                t,
                "edit_file",
                json!({"path": path, "old_string": old, "new_string": "z", "replace_all": true}),
            )
            .await;
            assert!(
                !out.is_error && out.text.contains(&format!("replaced {count} occurrences")),
                "{}",
                out.text
            );
        }
        let edited = std::fs::read(inputs.fs.workspace_dir().join("line.txt")).unwrap();
        assert!(edited.len() == SIZE && edited.iter().all(|&b| b == b'z'));
        // A result over the limit is refused before it is built.
        let out = call(
            t,
            "edit_file",
            json!({"path": "lines.txt", "old_string": "z", "new_string": "zz", "replace_all": true}),
        )
        .await;
        assert!(
            out.is_error && out.text.contains("more than"),
            "{}",
            out.text
        );
        assert_limit(
            "edit doubling lines.txt",
            inputs
                .fs
                .edit("lines.txt", EditRequest::new("z", "zz").replace_all(true))
                .await,
        );
        assert_limit(
            "edit over.txt",
            inputs.fs.edit("over.txt", EditRequest::new("y", "z")).await,
        );
    });
}

#[test]
fn grep_files_on_64_mib_inputs() {
    let _serial = serial();
    let inputs = Inputs::new();
    guarded("grep_files", async move {
        let t = &inputs.tools;
        // The tool's default skips files over 10 MiB: a result at once.
        let out = call(t, "grep_files", json!({"pattern": "y"})).await;
        assert!(
            !out.is_error && out.text.contains("skipped"),
            "{}",
            out.text
        );
        let grep = |pattern: &str, path: &str| {
            let mut options = GrepOptions::new(pattern)
                .path(path)
                .max_results(10_000)
                .timeout(HANG_GUARD);
            options.max_file_bytes = SIZE as u64;
            options
        };
        for (pattern, path, found) in [
            ("y", "line.txt", 1),
            ("y", "lines.txt", 10_000),
            ("needle", "matches.txt", 10_000),
            // No match: every line is looked at.
            ("absent", "line.txt", 0),
            ("absent", "lines.txt", 0),
            ("absent", "matches.txt", 0),
            ("THE END", "matches.txt", 1),
            // Patterns that make a regex engine work per byte.
            (r"(y|yy)+z", "line.txt", 0),
            (r"\w+\s+\w+z", "lines.txt", 0),
            (r"[a-z]{1,40}\d{20}", "matches.txt", 0),
        ] {
            let r = inputs.fs.grep(grep(pattern, path)).await.unwrap();
            eprintln!(
                "grep {pattern:?} {path}: {} matches, truncated {}, timed out {}",
                r.matches.len(),
                r.truncated,
                r.timed_out
            );
            assert_eq!(r.matches.len(), found, "{pattern} in {path}");
            assert_eq!(r.files_searched, 1);
            assert!(!r.timed_out);
        }
        let r = inputs.fs.grep(grep("y", "over.txt")).await.unwrap();
        assert_eq!((r.files_searched, r.files_skipped), (0, 1));
        // Patterns over the limits are typed errors, before any file is read.
        assert_limit(
            "a long pattern",
            inputs.fs.grep(grep(&"a".repeat(100_000), "")).await,
        );
        assert_limit(
            "a pattern compiling too big",
            inputs.fs.grep(grep(r"\w{1000}\w{1000}", "")).await,
        );
    });
}

#[test]
fn write_file_on_64_mib_inputs() {
    let _serial = serial();
    let inputs = Inputs::new();
    guarded("write_file", async move {
        let t = &inputs.tools;
        let content = "y".repeat(SIZE);
        let out = call(
            t,
            "write_file",
            json!({"path": "w/line.txt", "content": content}),
        )
        .await;
        assert!(!out.is_error, "{}", out.text);
        let lines = "y\n".repeat(SIZE / 2);
        let out = call(
            t,
            "write_file",
            json!({"path": "w/lines.txt", "content": lines}),
        )
        .await;
        assert!(!out.is_error, "{}", out.text);
        let out = call(
            t,
            "write_file",
            json!({"path": "w/over.txt", "content": "y".repeat(SIZE + 1)}),
        )
        .await;
        assert!(
            out.is_error && out.text.contains("more than"),
            "{}",
            out.text
        );
        assert!(!inputs.fs.workspace_dir().join("w/over.txt").exists());
    });
}

#[test]
fn glob_and_list_on_100_000_entries() {
    let _serial = serial();
    let inputs = Inputs::new();
    let dir = inputs.project().join("many");
    std::fs::create_dir_all(&dir).unwrap();
    for i in 0..100_000 {
        std::fs::File::create(dir.join(format!("{i:0>200}.txt"))).unwrap();
    }
    guarded("glob_files and list_files", async move {
        let t = &inputs.tools;
        let out = call(t, "glob_files", json!({"pattern": "*.txt"})).await;
        assert!(
            !out.is_error && out.text.contains("[stopped at 1000 paths"),
            "{}",
            out.text
        );
        let out = call(t, "glob_files", json!({"pattern": "**/*.absent"})).await;
        assert!(!out.is_error && out.text.contains("No files match"));
        let out = call(
            t,
            "glob_files",
            json!({"pattern": "many/**", "max_results": 100_000}),
        )
        .await;
        assert!(!out.is_error && !out.text.contains("[stopped"));
        assert_eq!(out.text.lines().count(), 100_000);
        let out = call(t, "list_files", json!({"path": "many"})).await;
        assert!(
            !out.is_error
                && out
                    .text
                    .contains("[showing the first 1000 of 100000 entries"),
            "{}",
            &out.text[out.text.len() - 200..]
        );
        let listed = inputs.fs.list_max("many", 10).await.unwrap();
        assert_eq!((listed.entries.len(), listed.total), (10, 100_000));
        assert!(listed.truncated);
    });
}

#[test]
fn execute_printing_64_mib() {
    let _serial = serial();
    let inputs = Inputs::new();
    guarded("execute", async move {
        let t = &inputs.tools;
        for command in [
            // One line of one repeated character.
            "head -c 67108864 /dev/zero | tr '\\0' y",
            // 32 Mi short lines, on both streams.
            "yes | head -n 33554432; yes | head -n 33554432 >&2",
            "cat matches.txt",
        ] {
            let out = call(t, "execute", json!({"command": command})).await;
            assert!(
                out.text.contains("exit code: 0") && out.text.contains("[stdout cut at 100000"),
                "{command}: {}",
                &out.text[..out.text.len().min(300)]
            );
            assert!(out.text.len() < 300_000);
        }
    });
}

/// This process's CPU time (user + system, every thread): `/proc/self/stat`, in the
/// kernel's USER_HZ ticks (100 per second on Linux).
fn cpu_time() -> Duration {
    let stat = std::fs::read_to_string("/proc/self/stat").unwrap();
    let fields: Vec<&str> = stat[stat.rfind(')').unwrap() + 2..].split(' ').collect();
    let ticks: u64 = fields[11].parse::<u64>().unwrap() + fields[12].parse::<u64>().unwrap();
    Duration::from_millis(ticks * 10)
}

/// CPU time this process spends over `window` of wall time.
async fn cpu_over(window: Duration) -> Duration {
    let before = cpu_time();
    tokio::time::sleep(window).await;
    cpu_time().saturating_sub(before)
}

/// 64 MiB of pseudo-random `a`/`b` in a million 64-byte lines: the input that makes
/// [`SLOW_PATTERN`] slow.
fn ab_lines() -> Vec<u8> {
    let mut x: u64 = 12345;
    let mut out = Vec::with_capacity(SIZE);
    for _ in 0..MATCH_LINES {
        for _ in 0..63 {
            x = x
                .wrapping_mul(6_364_136_223_846_793_005)
                .wrapping_add(1_442_695_040_888_963_407);
            out.push(if (x >> 33) & 1 == 0 { b'a' } else { b'b' });
        }
        out.push(b'\n');
    }
    out
}

/// A pattern whose lazy DFA has too many states for its cache on [`ab_lines`], so the regex
/// engine falls back to simulating the NFA: linear, but seconds per 100,000 lines.
const SLOW_PATTERN: &str = r"a[ab]{20}[^ab]";

/// Start a search of `path` for [`SLOW_PATTERN`] that takes far longer than the test waits,
/// drop it, and check the process stops burning CPU.
async fn drop_a_slow_search(fs: &Arc<LocalFs>, path: &str) {
    let mut options = GrepOptions::new(SLOW_PATTERN)
        .path(path)
        .timeout(Duration::from_secs(3600));
    options.max_file_bytes = SIZE as u64;
    let search = {
        let (fs, options) = (fs.clone(), options.clone());
        tokio::spawn(async move { fs.grep(options).await })
    };
    // While it runs, the process burns CPU.
    let running = cpu_over(Duration::from_secs(3)).await;
    assert!(
        !search.is_finished(),
        "{path}: the search must outlast the test"
    );
    search.abort();
    assert!(search.await.unwrap_err().is_cancelled());
    // A dropped call stops its work: after a moment to see the flag, CPU time stays put.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let after = cpu_over(Duration::from_secs(3)).await;
    eprintln!(
        "{path}: CPU time over 3 s: {running:?} while the search ran, {after:?} after it was dropped"
    );
    assert!(
        running >= Duration::from_millis(150) && after * 3 < running,
        "{path}: the dropped search kept working: {running:?} while running, {after:?} after"
    );
}

#[test]
fn a_dropped_call_stops_its_work() {
    let _serial = serial();
    let inputs = Inputs::new();
    let ab = ab_lines();
    write(inputs.project(), "ab.txt", &ab);
    // The same as one 64 MiB line: searched window by window.
    let one_line: Vec<u8> = ab
        .iter()
        .map(|&b| if b == b'\n' { b'a' } else { b })
        .collect();
    write(inputs.project(), "ab-line.txt", &one_line);
    drop((ab, one_line));
    guarded("cancellation", async move {
        let fs = inputs.fs.clone();
        drop_a_slow_search(&fs, "ab.txt").await;
        drop_a_slow_search(&fs, "ab-line.txt").await;

        // A timeout around an edit fires, and the dropped edit never lands.
        let edit = fs.edit("line.txt", EditRequest::new("y", "z").replace_all(true));
        let timed = tokio::time::timeout(Duration::from_millis(20), edit).await;
        assert!(
            timed.is_err(),
            "a 64 MiB replace-all within 20 ms: {timed:?}"
        );
        tokio::time::sleep(Duration::from_secs(3)).await;
        assert!(
            !fs.workspace_dir().join("line.txt").exists(),
            "the dropped edit was written"
        );
    });
}
