//! A stress kit for path races (time-of-check to time-of-use).
//!
//! A [`Swapper`] is a separate OS process — the agent's own shell could run the same loop —
//! that keeps flipping names *and parent directories* in a few arena directories between real
//! entries and symlinks to an [`Outside`] directory, while the test drives file operations in
//! a loop. The outside directory holds marker content and is recorded before the run (path,
//! content hash, mode, modification time, size): after it, an operation that returned the
//! marker read outside, and any difference in the outside tree (changed, removed or added
//! entries, stray temporary files included) is a write outside.
//!
//! The swapper process is the test binary itself, run again with only the calling test
//! selected and an environment variable saying what to swap: a race test calls
//! [`run_swapper_if_child`] first, which in the child runs the swap loop and exits.
//!
//! Arena layout ([`make_arena`]), each name flipping while the test runs:
//!
//! | name | real | flipped to |
//! | --- | --- | --- |
//! | `f` | file [`INSIDE`] | absolute symlink to `outside/secret` |
//! | `g` | file [`INSIDE`] | relative symlink climbing to `outside/secret` |
//! | `d` | directory holding `f`, `victim` | absolute symlink to the outside directory |

use std::collections::BTreeMap;
use std::fs;
use std::io;
use std::os::unix::fs::{MetadataExt as _, symlink};
use std::path::{Component, Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant, SystemTime};

/// Content only the outside directory has.
pub const MARKER: &str = "OUTSIDE-MARKER-5e1f";
/// A name only the outside directory has: a listing that shows it listed outside.
pub const OUTSIDE_ONLY: &str = "only-outside-5e1f";
/// Content of the real files in an arena. Edits flip `token` to `t0ken` and back; the outside
/// files hold `token` too, so an edit that read outside would match there.
pub const INSIDE: &str = "inside token\n";
/// Environment variable: seconds each race test runs (default 4).
pub const SECS_ENV: &str = "SANDBOX_RACE_SECS";
/// Environment variable that makes a test binary the swapper (set by [`Swapper::spawn`]).
const CHILD_ENV: &str = "SANDBOX_RACE_SWAPPER";

/// How long each race test drives operations: `SANDBOX_RACE_SECS` or 4 s.
pub fn duration() -> Duration {
    std::env::var(SECS_ENV)
        .ok()
        .and_then(|s| s.parse::<f64>().ok())
        .filter(|s| *s > 0.0)
        .map_or(Duration::from_secs(4), Duration::from_secs_f64)
}

/// Whether `data` came from outside.
pub fn leaked(data: &[u8]) -> bool {
    data.windows(MARKER.len()).any(|w| w == MARKER.as_bytes())
}

/// Create the arena `dir` (see the module docs).
pub fn make_arena(dir: &Path) -> io::Result<()> {
    fs::create_dir_all(dir.join("d"))?;
    for f in ["f", "g", "d/f", "d/victim"] {
        fs::write(dir.join(f), INSIDE)?;
    }
    Ok(())
}

/// What is recorded of one outside entry.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Facts {
    kind: &'static str,
    size: u64,
    mode: u32,
    mtime: Option<SystemTime>,
    hash: Option<blake3::Hash>,
}

/// The outside directory: marker files under names the tests use, recorded.
#[derive(Debug)]
pub struct Outside {
    dir: PathBuf,
    before: BTreeMap<PathBuf, Facts>,
}

impl Outside {
    /// Fill `dir` with marker files (`secret`, the arena's names, names the tests create or
    /// move, [`OUTSIDE_ONLY`], a subdirectory) and record it.
    pub fn create(dir: &Path) -> io::Result<Outside> {
        fs::create_dir_all(dir.join("sub"))?;
        let content = format!("{MARKER} token\n");
        for name in [
            "secret",
            "f",
            "g",
            "victim",
            "new",
            "mv-src",
            "mv-dst",
            OUTSIDE_ONLY,
            "sub/f",
        ] {
            fs::write(dir.join(name), &content)?;
        }
        Ok(Outside {
            dir: dir.to_path_buf(),
            before: record(dir)?,
        })
    }

    /// The outside directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Every difference from the recording: `changed`, `removed` or `added` with the path.
    pub fn changes(&self) -> io::Result<Vec<String>> {
        let after = record(&self.dir)?;
        let mut out = Vec::new();
        for (path, facts) in &self.before {
            match after.get(path) {
                None => out.push(format!("removed {}", path.display())),
                Some(now) if now != facts => out.push(format!("changed {}", path.display())),
                Some(_) => {}
            }
        }
        for path in after.keys().filter(|p| !self.before.contains_key(*p)) {
            out.push(format!("added {}", path.display()));
        }
        Ok(out)
    }
}

fn record(dir: &Path) -> io::Result<BTreeMap<PathBuf, Facts>> {
    let mut out = BTreeMap::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(cur) = stack.pop() {
        for entry in fs::read_dir(&cur)? {
            let entry = entry?;
            let meta = entry.metadata()?; // lstat: links are recorded, not followed
            let path = entry.path();
            let kind = if meta.is_dir() {
                stack.push(path.clone());
                "dir"
            } else if meta.file_type().is_symlink() {
                "symlink"
            } else {
                "file"
            };
            let hash = meta
                .is_file()
                .then(|| fs::read(&path).map(|d| blake3::hash(&d)))
                .transpose()?;
            let facts = Facts {
                kind,
                size: if meta.is_dir() { 0 } else { meta.len() },
                mode: meta.mode(),
                mtime: if meta.is_dir() {
                    None // the outside directories' own times change when we list
                } else {
                    meta.modified().ok()
                },
                hash,
            };
            out.insert(path.strip_prefix(dir).unwrap_or(&path).to_path_buf(), facts);
        }
    }
    Ok(out)
}

/// The swapper process.
#[derive(Debug)]
pub struct Swapper {
    child: Child,
    stop: PathBuf,
    count: PathBuf,
}

impl Swapper {
    /// Start swapping in `arenas` (made with [`make_arena`]) towards `outside`. `test` is the
    /// full name of the calling test (as `cargo test` prints it), which must call
    /// [`run_swapper_if_child`] first. `work` is a directory for the control files.
    pub fn spawn(test: &str, arenas: &[PathBuf], outside: &Path, work: &Path) -> Swapper {
        let stop = work.join("swapper.stop");
        let count = work.join("swapper.count");
        let mut spec = vec![stop.clone(), count.clone(), outside.to_path_buf()];
        spec.extend(arenas.iter().cloned());
        let spec: Vec<String> = spec.iter().map(|p| p.display().to_string()).collect();
        let child = Command::new(std::env::current_exe().expect("test binary"))
            .args([test, "--exact", "--nocapture", "--test-threads=1"])
            .env(CHILD_ENV, spec.join("\n"))
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .spawn()
            .expect("start the swapper process");
        // Operations start only once the swapper is running.
        let started = Instant::now();
        while !count.exists() {
            assert!(
                started.elapsed() < Duration::from_secs(30),
                "the swapper did not start"
            );
            std::thread::sleep(Duration::from_millis(5));
        }
        Swapper { child, stop, count }
    }

    /// Stop the swapper and return how many times it flipped a name to a symlink.
    pub fn stop(mut self) -> u64 {
        fs::write(&self.stop, b"").expect("stop file");
        let status = self.child.wait().expect("wait for the swapper");
        assert!(status.success(), "the swapper failed: {status}");
        fs::read_to_string(&self.count)
            .expect("swap count")
            .trim()
            .parse()
            .expect("a number")
    }
}

impl Drop for Swapper {
    fn drop(&mut self) {
        // Only if `stop` was not reached (a failing test): never leave the process behind.
        if self.child.try_wait().ok().flatten().is_none() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// In the swapper process: run the swap loop until told to stop, then exit the process.
/// Elsewhere: return at once.
pub fn run_swapper_if_child() {
    let Ok(spec) = std::env::var(CHILD_ENV) else {
        return;
    };
    let mut lines = spec.lines().map(PathBuf::from);
    let (stop, count, outside) = (
        lines.next().expect("stop path"),
        lines.next().expect("count path"),
        lines.next().expect("outside path"),
    );
    let arenas: Vec<PathBuf> = lines.collect();
    let secret = outside.join("secret");
    let climbing: Vec<PathBuf> = arenas.iter().map(|a| relative(a, &secret)).collect();
    fs::write(&count, b"0").expect("count file");
    // A bound in case the parent dies without stopping us.
    let deadline = Instant::now() + duration() * 4 + Duration::from_secs(60);
    let mut swaps: u64 = 0;
    let mut round: u64 = 0;
    while Instant::now() < deadline {
        for (arena, climb) in arenas.iter().zip(&climbing) {
            swaps += flip_file(arena, "f", &secret);
            swaps += flip_file(arena, "g", climb);
            swaps += flip_dir(arena, "d", &outside);
        }
        round += 1;
        if round.is_multiple_of(64) && stop.exists() {
            break;
        }
    }
    fs::write(&count, swaps.to_string()).expect("count file");
    std::process::exit(0);
}

/// `name` becomes a symlink to `target`, then a real file again. Returns 1 if it was a link.
fn flip_file(arena: &Path, name: &str, target: &Path) -> u64 {
    let link = arena.join(format!(".swap-link-{name}"));
    let file = arena.join(format!(".swap-file-{name}"));
    let at = arena.join(name);
    let _ = fs::remove_file(&link);
    let mut swapped = 0;
    if symlink(target, &link).is_ok() && fs::rename(&link, &at).is_ok() {
        swapped = 1;
        std::hint::spin_loop();
    }
    if fs::write(&file, INSIDE).is_ok() {
        let _ = fs::rename(&file, &at);
    }
    swapped
}

/// The directory `name` is moved aside and a symlink to `target` takes its place, then the
/// directory comes back. Returns 1 if the link was in place.
fn flip_dir(arena: &Path, name: &str, target: &Path) -> u64 {
    let at = arena.join(name);
    let stash = arena.join(format!(".swap-dir-{name}"));
    if fs::rename(&at, &stash).is_err() {
        // Removed or replaced by the operations under test: start it afresh.
        let _ = fs::remove_file(&at);
        let _ = fs::create_dir_all(&stash);
    }
    let mut swapped = 0;
    if symlink(target, &at).is_ok() {
        swapped = 1;
        std::hint::spin_loop();
        let _ = fs::remove_file(&at);
    }
    if fs::rename(&stash, &at).is_err() {
        // An operation recreated `name` meanwhile; keep that one.
        let _ = fs::remove_dir_all(&stash);
    }
    swapped
}

/// A relative path from the directory `from` to `to` (both absolute, lexically normal).
fn relative(from: &Path, to: &Path) -> PathBuf {
    let from: Vec<Component<'_>> = from.components().collect();
    let to: Vec<Component<'_>> = to.components().collect();
    let common = from.iter().zip(&to).take_while(|(a, b)| a == b).count();
    let mut out = PathBuf::new();
    for _ in common..from.len() {
        out.push("..");
    }
    for c in &to[common..] {
        out.push(c);
    }
    out
}

/// What a stress run saw: print the counts (they go in reports) and assert it touched nothing
/// outside, and that it really ran (so it cannot pass vacuously).
pub fn assert_clean(
    label: &str,
    elapsed: Duration,
    swaps: u64,
    operations: u64,
    outside_reads: u64,
    changes: &[String],
) {
    println!(
        "race {label}: {:.1} s, operations={operations} swaps={swaps} \
         outside_reads={outside_reads} outside_writes={}",
        elapsed.as_secs_f64(),
        changes.len()
    );
    for c in changes {
        println!("  outside write: {c}");
    }
    assert!(swaps > 100, "the swapper barely ran: {swaps} swaps");
    assert!(operations > 100, "the operations barely ran: {operations}");
    assert_eq!(outside_reads, 0, "operations returned outside content");
    assert!(changes.is_empty(), "the outside tree changed: {changes:?}");
}
