//! `cargo xtask bench tools`: every agent tool of the local mode on the 64 MiB adversarial
//! inputs of `tests/limits.rs`, each against a floor measured in the same run.
//!
//! Inputs: `line.txt` (one line of 64 Mi `y`), `lines.txt` (32 Mi lines `y`), `matches.txt`
//! (a million 64-byte lines each holding `needle`, then `THE END`), `many/` (100,000 empty
//! files with 200-character names). Floors: a plain in-process pass doing the least the tool's
//! answer needs (`std::fs::read` + `str::from_utf8` + a newline count or `str::find` /
//! `str::replace`, a temporary file + `sync_data` + rename for writes), and where one exists a
//! command doing the same job (`sed`, `grep`, `find`, `ls`, a bare `sh -c` spawn). Best of 3
//! runs each (an edit's input is restored before each run). Prints a table; with
//! `SANDBOX_BENCH_OUT` set, also writes `tools.json` there.

use std::io::Write as _;
use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use sandbox_fs::{Filesystem, LocalFs, LocalOptions, Tools};
use serde_json::{Value, json};

const SIZE: usize = 64 << 20;
const MATCH_LINES: usize = 1 << 20;
const RUNS: usize = 3;

fn ms(d: Duration) -> f64 {
    (d.as_secs_f64() * 1e4).round() / 10.0
}

/// Best of [`RUNS`] of `f`, with `reset` run (untimed) before each.
fn best(mut reset: impl FnMut(), mut f: impl FnMut()) -> Duration {
    (0..RUNS)
        .map(|_| {
            reset();
            let started = Instant::now();
            f();
            started.elapsed()
        })
        .min()
        .expect("runs")
}

fn inputs(project: &Path) {
    std::fs::write(project.join("line.txt"), vec![b'y'; SIZE]).unwrap();
    std::fs::write(project.join("lines.txt"), b"y\n".repeat(SIZE / 2)).unwrap();
    let mut matches = Vec::with_capacity(SIZE);
    for i in 0..MATCH_LINES - 1 {
        let line = format!("needle {i:>12} {}\n", "-".repeat(43));
        matches.extend_from_slice(line.as_bytes());
    }
    matches.extend_from_slice(format!("{:<63}\n", "THE END").as_bytes());
    std::fs::write(project.join("matches.txt"), matches).unwrap();
    let many = project.join("many");
    std::fs::create_dir_all(&many).unwrap();
    for i in 0..100_000 {
        std::fs::File::create(many.join(format!("{i:0>200}.txt"))).unwrap();
    }
}

/// A command's run, output discarded.
fn sh(dir: &Path, script: &str) {
    let status = Command::new("sh")
        .args(["-c", script])
        .current_dir(dir)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .unwrap();
    assert!(status.code().is_some(), "{script}: {status}");
}

/// The write floor: a temporary file, `sync_data`, rename (what an atomic write needs).
fn write_floor(path: &Path, data: &[u8]) {
    let tmp = path.with_extension("floor-tmp");
    let mut f = std::fs::File::create(&tmp).unwrap();
    f.write_all(data).unwrap();
    f.sync_data().unwrap();
    std::fs::rename(&tmp, path).unwrap();
}

fn read_text(path: &Path) -> String {
    String::from_utf8(std::fs::read(path).unwrap()).unwrap()
}

struct Row {
    tool: &'static str,
    case: &'static str,
    ours: Duration,
    floor: (&'static str, Duration),
    command: Option<(&'static str, Duration)>,
}

fn main() {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let tmp = tempfile::tempdir().unwrap();
    let project = tmp.path().join("project");
    std::fs::create_dir_all(&project).unwrap();
    inputs(&project);
    let fs = Arc::new(LocalFs::new(LocalOptions::default().project(&project)).unwrap());
    let ws = fs.workspace_dir().to_path_buf();
    let tools = Tools::new(fs.clone() as Arc<dyn Filesystem>);
    let tool = |name: &str, args: Value| {
        let out = runtime.block_on(tools.call(name, args.clone()));
        assert!(
            !out.is_error || name == "edit_file",
            "{name} {args}: {}",
            out.text
        );
        out
    };
    // An edit's input is the project's copy: drop the workspace copy an earlier run made.
    let fresh = |name: &str| {
        let _ = std::fs::remove_file(ws.join(name));
    };
    let p = |name: &str| project.join(name);
    let mut rows = Vec::new();

    // read_file: the first window, and the last one (every line before it passed over).
    rows.push(Row {
        tool: "read_file",
        case: "lines.txt, last window (offset 33,554,331)",
        ours: best(
            || {},
            || {
                tool(
                    "read_file",
                    json!({"path": "lines.txt", "offset": 33_554_331, "limit": 100}),
                );
            },
        ),
        floor: (
            "read + utf8 + count newlines",
            best(
                || {},
                || {
                    let t = read_text(&p("lines.txt"));
                    assert!(t.bytes().filter(|&b| b == b'\n').count() > 0);
                },
            ),
        ),
        command: Some((
            "sed -n '33554332,33554431p'",
            best(
                || {},
                || sh(&project, "sed -n '33554332,33554431p' lines.txt"),
            ),
        )),
    });
    rows.push(Row {
        tool: "read_file",
        case: "line.txt, first window (a 64 MiB line, cut)",
        ours: best(
            || {},
            || {
                tool("read_file", json!({"path": "line.txt"}));
            },
        ),
        floor: (
            "read + utf8 + count newlines",
            best(
                || {},
                || {
                    let t = read_text(&p("line.txt"));
                    assert_eq!(t.bytes().filter(|&b| b == b'\n').count(), 0);
                },
            ),
        ),
        command: Some((
            "head -n 2000",
            best(|| {}, || sh(&project, "head -n 2000 line.txt")),
        )),
    });

    // edit_file: non-unique (stops after 1,001 matches), unique at the very end, replace-all.
    rows.push(Row {
        tool: "edit_file",
        case: "line.txt, `y` not unique (the probe's case)",
        ours: best(
            || {},
            || {
                let out = tool(
                    "edit_file",
                    json!({"path": "line.txt", "old_string": "y", "new_string": "z"}),
                );
                assert!(out.is_error && out.text.contains("more than 1000"));
            },
        ),
        floor: (
            "read + utf8",
            best(
                || {},
                || {
                    read_text(&p("line.txt"));
                },
            ),
        ),
        command: None,
    });
    rows.push(Row {
        tool: "edit_file",
        case: "matches.txt, unique last line",
        ours: best(
            || fresh("matches.txt"),
            || {
                let out = tool(
                    "edit_file",
                    json!({"path": "matches.txt", "old_string": "THE END", "new_string": "the end"}),
                );
                assert!(!out.is_error, "{}", out.text);
            },
        ),
        floor: (
            "read + utf8 + find + splice + write",
            best(
                || {},
                || {
                    let t = read_text(&p("matches.txt"));
                    let at = t.find("THE END").unwrap();
                    let new = format!("{}the end{}", &t[..at], &t[at + 7..]);
                    write_floor(&tmp.path().join("floor.txt"), new.as_bytes());
                },
            ),
        ),
        command: Some((
            "sed 's/THE END/the end/' > file",
            best(
                || {},
                || sh(&project, "sed 's/THE END/the end/' matches.txt > ../sed.txt"),
            ),
        )),
    });
    for (case, path, old) in [
        ("line.txt, replace all 64 Mi `y`", "line.txt", "y"),
        (
            "matches.txt, replace all 1 Mi `needle`",
            "matches.txt",
            "needle",
        ),
    ] {
        rows.push(Row {
            tool: "edit_file",
            case,
            ours: best(
                || fresh(path),
                || {
                    let out = tool(
                        "edit_file",
                        json!({"path": path, "old_string": old, "new_string": "z", "replace_all": true}),
                    );
                    assert!(!out.is_error, "{}", out.text);
                },
            ),
            floor: (
                "read + utf8 + str::replace + write",
                best(
                    || {},
                    || {
                        let t = read_text(&p(path));
                        let new = t.replace(old, "z");
                        write_floor(&tmp.path().join("floor.txt"), new.as_bytes());
                    },
                ),
            ),
            command: Some((
                "sed 's/old/z/g' > file",
                best(
                    || {},
                    || {
                        let script = format!("sed 's/{old}/z/g' {path} > ../sed.txt");
                        sh(&project, &script)
                    },
                ),
            )),
        });
    }

    // grep_files (the tool searches files up to 10 MiB by default, so through the trait).
    for (case, pattern, path, cap) in [
        (
            "matches.txt, `needle`, first 10,000",
            "needle",
            "matches.txt",
            10_000,
        ),
        (
            "matches.txt, absent (every line)",
            "absent",
            "matches.txt",
            10_000,
        ),
        (
            "lines.txt, absent (32 Mi lines)",
            "absent",
            "lines.txt",
            10_000,
        ),
        (
            "line.txt, `(y|yy)+z` (a 64 MiB line)",
            "(y|yy)+z",
            "line.txt",
            10_000,
        ),
    ] {
        let mut options = sandbox_fs::GrepOptions::new(pattern)
            .path(path)
            .max_results(cap)
            .timeout(Duration::from_secs(600));
        options.max_file_bytes = SIZE as u64;
        let ours = best(
            || {},
            || {
                let r = runtime
                    .block_on(sandbox_fs::FilesystemExt::grep(&*fs, options.clone()))
                    .unwrap();
                assert!(!r.timed_out);
            },
        );
        let regex = regex_floor(pattern);
        rows.push(Row {
            tool: "grep_files",
            case,
            ours,
            floor: (
                "read + utf8 + regex per line",
                best(
                    || {},
                    || {
                        let t = read_text(&p(path));
                        let mut n = 0;
                        for line in t.lines() {
                            if regex.is_match(line) {
                                n += 1;
                                if n == cap {
                                    break;
                                }
                            }
                        }
                    },
                ),
            ),
            command: Some((
                "grep -E -n -m cap",
                best(
                    || {},
                    || sh(&project, &format!("grep -E -n -m {cap} '{pattern}' {path}")),
                ),
            )),
        });
    }

    // glob_files and list_files over 100,000 entries.
    rows.push(Row {
        tool: "glob_files",
        case: "many/, `**/*.absent` (every path matched)",
        ours: best(
            || {},
            || {
                tool(
                    "glob_files",
                    json!({"pattern": "**/*.absent", "path": "many"}),
                );
            },
        ),
        floor: (
            "read_dir + stat each",
            best(
                || {},
                || {
                    let n = std::fs::read_dir(p("many"))
                        .unwrap()
                        .filter(|e| e.as_ref().unwrap().metadata().unwrap().is_file())
                        .count();
                    assert_eq!(n, 100_000);
                },
            ),
        ),
        command: Some((
            "find -name",
            best(|| {}, || sh(&project, "find many -name '*.absent'")),
        )),
    });
    rows.push(Row {
        tool: "list_files",
        case: "many/ (first 1,000 of 100,000 shown)",
        ours: best(
            || {},
            || {
                tool("list_files", json!({"path": "many"}));
            },
        ),
        floor: (
            "read_dir + stat each + sort",
            best(
                || {},
                || {
                    let mut names: Vec<_> = std::fs::read_dir(p("many"))
                        .unwrap()
                        .map(|e| {
                            let e = e.unwrap();
                            (e.file_name(), e.metadata().unwrap().len())
                        })
                        .collect();
                    names.sort();
                },
            ),
        ),
        command: Some(("ls -l", best(|| {}, || sh(&project, "ls -l many")))),
    });

    // write_file of 64 MiB.
    let content = "y\n".repeat(SIZE / 2);
    rows.push(Row {
        tool: "write_file",
        case: "32 Mi lines, 64 MiB",
        ours: best(
            || {},
            || {
                tool(
                    "write_file",
                    json!({"path": "w/lines.txt", "content": content}),
                );
            },
        ),
        floor: (
            "temp file + sync_data + rename",
            best(
                || {},
                || write_floor(&tmp.path().join("floor.txt"), content.as_bytes()),
            ),
        ),
        command: None,
    });

    // execute printing 64 MiB (the tool keeps 100,000 bytes per stream).
    rows.push(Row {
        tool: "execute",
        case: "cat matches.txt (64 MiB out)",
        ours: best(
            || {},
            || {
                tool("execute", json!({"command": "cat matches.txt"}));
            },
        ),
        floor: (
            "sh -c spawn, output discarded",
            best(|| {}, || sh(&project, "cat matches.txt")),
        ),
        command: None,
    });

    println!(
        "sandbox-fs tools on 64 MiB inputs, best of {RUNS} (ms; ratio = ours / floor, ours / command)"
    );
    println!(
        "{:<11} {:<44} {:>9} {:>9} {:>7} {:>9} {:>7}",
        "tool", "case", "ours", "floor", "ratio", "command", "ratio"
    );
    let mut report = Vec::new();
    for r in &rows {
        let ratio = r.ours.as_secs_f64() / r.floor.1.as_secs_f64();
        let (cmd_ms, cmd_ratio) = match r.command {
            Some((_, d)) => (
                format!("{:.1}", ms(d)),
                format!("{:.2}", r.ours.as_secs_f64() / d.as_secs_f64()),
            ),
            None => ("-".into(), "-".into()),
        };
        println!(
            "{:<11} {:<44} {:>9.1} {:>9.1} {:>7.2} {:>9} {:>7}",
            r.tool,
            r.case,
            ms(r.ours),
            ms(r.floor.1),
            ratio,
            cmd_ms,
            cmd_ratio
        );
        report.push(json!({
            "tool": r.tool,
            "case": r.case,
            "ours_ms": ms(r.ours),
            "floor": r.floor.0,
            "floor_ms": ms(r.floor.1),
            "ratio": (ratio * 100.0).round() / 100.0,
            "command": r.command.map(|c| c.0),
            "command_ms": r.command.map(|c| ms(c.1)),
            "command_ratio": r.command.map(|c| (r.ours.as_secs_f64() / c.1.as_secs_f64() * 100.0).round() / 100.0),
        }));
    }
    if let Some(out) = std::env::var_os("SANDBOX_BENCH_OUT") {
        let out = Path::new(&out);
        std::fs::create_dir_all(out).unwrap();
        let text = serde_json::to_string_pretty(&Value::Array(report)).unwrap();
        std::fs::write(out.join("tools.json"), text).unwrap();
    }
}

fn regex_floor(pattern: &str) -> regex::Regex {
    regex::Regex::new(pattern).unwrap()
}
