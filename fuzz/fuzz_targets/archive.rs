//! Arbitrary bytes as an archive: the validator and the extractor must never panic, never
//! change anything outside the destination, and whatever `rewrite` accepts must be accepted
//! again unchanged (canonical output is a fixed point).
//!
//! The destination has a neighbourhood worth attacking, at a fixed path per process so that
//! inputs (and the hand-made seeds) can name it:
//!
//! ```text
//! <base>/o/            the outside: s, t (files), h (a hard link of s), d/f, l -> s, x -> d
//! <base>/w/            the destination, rebuilt before each input, with links planted in it:
//!     x -> ../o   y -> ../o/s   z -> <base>/o   e/q -> ../../o/t   k (a file)
//! ```
//!
//! `<base>` is `/tmp/sbx-fuzz` for the process holding the lock `/tmp/sbx-fuzz.lock` (so
//! seeds can use absolute links to `/tmp/sbx-fuzz/o`), else `/tmp/sbx-fuzz-<pid>`; relative
//! links (`../o`) reach the outside either way. Before each input the outside is recorded
//! (kind, mode, mtime, size, link count, content hash or link target of every path, the
//! outside directory itself included) and compared after: any difference is a crash, as is
//! anything new beside the destination.
#![no_main]

use std::collections::BTreeMap;
use std::fs;
use std::os::unix::fs::{PermissionsExt as _, symlink};
use std::path::{Path, PathBuf};
use std::sync::OnceLock;
use std::time::{Duration, UNIX_EPOCH};

use libfuzzer_sys::fuzz_target;
use sandbox_core::archive::{self, ArchivePolicy, RewriteHooks};
use sandbox_core::testkit::fs_state::{NodeState, record_with_root};

struct Plain;
impl RewriteHooks for Plain {}

fn policy() -> ArchivePolicy {
    let mut p = ArchivePolicy::default();
    p.max_entries = 1000;
    p.max_total_bytes = 1 << 20;
    p
}

/// The per-process neighbourhood and its record.
struct Scene {
    base: PathBuf,
    outside: PathBuf,
    dest: PathBuf,
    before: BTreeMap<String, NodeState>,
    /// Held for the life of the process: the lock on the shared base.
    _lock: Option<fs::File>,
}

fn scene() -> &'static Scene {
    static SCENE: OnceLock<Scene> = OnceLock::new();
    SCENE.get_or_init(|| {
        let lock = fs::File::create("/tmp/sbx-fuzz.lock")
            .ok()
            .filter(|f| f.try_lock().is_ok());
        let base = if lock.is_some() {
            PathBuf::from("/tmp/sbx-fuzz")
        } else {
            PathBuf::from(format!("/tmp/sbx-fuzz-{}", std::process::id()))
        };
        let _ = fs::remove_dir_all(&base);
        let outside = base.join("o");
        fs::create_dir_all(outside.join("d")).unwrap();
        fs::write(outside.join("s"), "secret").unwrap();
        fs::write(outside.join("t"), "target").unwrap();
        fs::write(outside.join("d/f"), "deep").unwrap();
        fs::hard_link(outside.join("s"), outside.join("h")).unwrap();
        symlink("s", outside.join("l")).unwrap();
        symlink("d", outside.join("x")).unwrap();
        fs::set_permissions(outside.join("t"), fs::Permissions::from_mode(0o640)).unwrap();
        fs::set_permissions(&outside, fs::Permissions::from_mode(0o750)).unwrap();
        // Old mtimes: a change made through a link shows even within one clock tick.
        for p in ["s", "t", "d/f", "d", ""] {
            fs::File::open(outside.join(p))
                .unwrap()
                .set_modified(UNIX_EPOCH + Duration::from_secs(1_000_000))
                .unwrap();
        }
        let before = record_with_root(&outside);
        Scene {
            dest: base.join("w"),
            base,
            outside,
            before,
            _lock: lock,
        }
    })
}

/// A fresh destination with links out planted in it.
fn fresh_dest(s: &Scene) {
    let _ = fs::remove_dir_all(&s.dest);
    fs::create_dir_all(s.dest.join("e")).unwrap();
    symlink("../o", s.dest.join("x")).unwrap();
    symlink("../o/s", s.dest.join("y")).unwrap();
    symlink(&s.outside, s.dest.join("z")).unwrap();
    symlink("../../o/t", s.dest.join("e/q")).unwrap();
    fs::write(s.dest.join("k"), "k").unwrap();
}

fn inside(root: &Path, dir: &Path) {
    for entry in fs::read_dir(dir).unwrap() {
        let entry = entry.unwrap();
        let meta = fs::symlink_metadata(entry.path()).unwrap();
        assert!(entry.path().starts_with(root));
        if meta.is_dir() {
            inside(root, &entry.path());
        }
    }
}

fuzz_target!(|data: &[u8]| {
    let s = scene();
    fresh_dest(s);
    let _ = archive::extract_blocking(data, &s.dest, policy());
    // Nothing new beside the destination, nothing changed outside it.
    let mut names: Vec<_> = fs::read_dir(&s.base)
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    names.sort();
    assert_eq!(names, ["o", "w"], "extraction wrote beside its destination");
    let after = record_with_root(&s.outside);
    assert!(
        after == s.before,
        "extraction changed the outside: {}",
        diff(&s.before, &after)
    );
    inside(&s.dest, &s.dest);

    let mut input = data;
    if let Ok(canonical) = archive::rewrite(&mut input, Vec::new(), policy(), &mut Plain) {
        let mut again = &canonical[..];
        let second = archive::rewrite(&mut again, Vec::new(), policy(), &mut Plain)
            .expect("canonical output must be accepted");
        assert_eq!(second, canonical, "canonical output must be a fixed point");
    }
});

/// The paths whose record differs, with both states.
fn diff(before: &BTreeMap<String, NodeState>, after: &BTreeMap<String, NodeState>) -> String {
    let mut out = String::new();
    for path in before
        .keys()
        .chain(after.keys().filter(|k| !before.contains_key(*k)))
    {
        let (b, a) = (before.get(path), after.get(path));
        if b != a {
            out.push_str(&format!("\n  {path}: {b:?} -> {a:?}"));
        }
    }
    out
}
