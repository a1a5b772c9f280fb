//! The hostile-archive corpus and round trips.

use super::*;
use crate::testkit::fs_state::record_with_root;
use crate::testkit::raw_tar::{Kind, RawTar};

fn run_extract(bytes: Vec<u8>, dest: &Path, policy: ArchivePolicy) -> Result<ExtractStats> {
    extract_blocking(&bytes[..], dest, policy)
}

async fn run_sanitize(bytes: Vec<u8>, policy: ArchivePolicy) -> Result<Bytes> {
    stream::collect(sanitize(stream::once(bytes), policy), 1 << 30).await
}

/// Each hostile archive, the reason fragment expected, and the strictness.
fn corpus() -> Vec<(&'static str, Vec<u8>, &'static str)> {
    let mut c = Vec::new();
    c.push((
        "absolute path",
        RawTar::new().file("/etc/passwd", b"x").finish(),
        "absolute",
    ));
    c.push((
        "dotdot",
        RawTar::new().file("../escape", b"x").finish(),
        "..",
    ));
    c.push((
        "nested dotdot",
        RawTar::new().dir("a").file("a/../../escape", b"x").finish(),
        "..",
    ));
    c.push((
        "write through planted symlink",
        RawTar::new()
            .symlink("link", "/tmp")
            .file("link/passwd", b"x")
            .finish(),
        "under the symlink",
    ));
    c.push((
        "write through relative planted symlink",
        RawTar::new()
            .symlink("up", "..")
            .file("up/escape", b"x")
            .finish(),
        "under the symlink",
    ));
    c.push((
        "symlink then dir under it",
        RawTar::new().symlink("d", "/").dir("d/etc").finish(),
        "under the symlink",
    ));
    c.push((
        "hard link to absolute",
        RawTar::new().hardlink("h", "/etc/passwd").finish(),
        "outside",
    ));
    c.push((
        "hard link climbing out",
        RawTar::new().hardlink("h", "../outside").finish(),
        "outside",
    ));
    c.push((
        "hard link to later file",
        RawTar::new()
            .hardlink("h", "later")
            .file("later", b"x")
            .finish(),
        "not an earlier file",
    ));
    c.push((
        "hard link to symlink",
        RawTar::new()
            .symlink("s", "/etc/passwd")
            .hardlink("h", "s")
            .finish(),
        "not an earlier file",
    ));
    c.push((
        "char device",
        RawTar::new().special("null", Kind::Char).finish(),
        "device",
    ));
    c.push((
        "block device",
        RawTar::new().special("sda", Kind::Block).finish(),
        "device",
    ));
    c.push((
        "fifo",
        RawTar::new().special("pipe", Kind::Fifo).finish(),
        "fifo",
    ));
    c.push((
        "duplicate",
        RawTar::new().file("a", b"1").file("a", b"2").finish(),
        "duplicate",
    ));
    c.push((
        "entry under a file",
        RawTar::new().file("f", b"1").file("f/x", b"2").finish(),
        "under the file",
    ));
    c.push((
        "non-utf8 name",
        RawTar::new().file_raw(b"bad\xff", b"x").finish(),
        "UTF-8",
    ));
    c.push((
        "gnu long name climbing out",
        RawTar::new()
            .long_name(&format!("{}../../x", "a/".repeat(60)), b"x")
            .finish(),
        "..",
    ));
    c.push((
        "pax path absolute",
        RawTar::new()
            .pax_path("/etc/shadow", "innocent", b"x")
            .finish(),
        "absolute",
    ));
    c.push((
        "truncated",
        {
            let mut t = RawTar::new().file("big", &vec![1u8; 10_000]).finish();
            t.truncate(3000);
            t
        },
        "truncated",
    ));
    c.push(("garbage", vec![0x55u8; 2048], "corrupt"));
    // Issue 8: an implicitly created directory replaced by a link (or a file), and names that
    // are not what their header says.
    c.push((
        "hard link through a symlink over an implicit dir",
        RawTar::new()
            .file("d/secret.txt", b"x")
            .symlink("d", "/tmp/sbx-outside")
            .hardlink("hl", "d/secret.txt")
            .finish(),
        "replace the directory",
    ));
    c.push((
        "dir mode through a symlink over an implicit dir",
        RawTar::new()
            .dir_mode("p/target.txt", 0o777)
            .symlink("p", "/tmp/sbx-outside")
            .finish(),
        "replace the directory",
    ));
    c.push((
        "symlink over a deep implicit dir",
        RawTar::new()
            .file("a/b/c/f", b"x")
            .symlink("a/b", "/")
            .file("a/b/c/g", b"y")
            .finish(),
        "replace the directory",
    ));
    c.push((
        "file over an implicit dir",
        RawTar::new().file("a/b", b"x").file("a", b"y").finish(),
        "replace the directory",
    ));
    c.push((
        "hard link over an implicit dir",
        RawTar::new()
            .file("a/b", b"x")
            .hardlink("a", "a/b")
            .finish(),
        "replace the directory",
    ));
    c.push((
        "symlink over an explicit dir",
        RawTar::new().dir("d").symlink("d", "/").finish(),
        "duplicate",
    ));
    c.push((
        "NUL in the name field",
        RawTar::new()
            .file_raw(b"ok\0/../../escape.txt", b"x")
            .finish(),
        "NUL",
    ));
    c.push((
        "NUL in the linkname field",
        RawTar::new().symlink_raw("l", b"x\0/../../etc").finish(),
        "NUL",
    ));
    c.push((
        "NUL in the ustar prefix field",
        RawTar::new()
            .ustar_file(b"ok\0/../..", b"escape.txt", b"x")
            .finish(),
        "NUL",
    ));
    c.push((
        "NUL inside a GNU long name",
        RawTar::new()
            .long_name("ok\0/../../escape.txt", b"x")
            .finish(),
        "NUL",
    ));
    c.push((
        "NUL inside a pax path",
        RawTar::new()
            .pax_path("ok\0/../../escape.txt", "innocent", b"x")
            .finish(),
        "NUL",
    ));
    c
}

#[tokio::test]
async fn hostile_corpus_is_rejected_by_sanitize_and_extract() {
    for (name, bytes, reason) in corpus() {
        let err = run_sanitize(bytes.clone(), ArchivePolicy::default())
            .await
            .expect_err(name);
        assert!(
            matches!(err, Error::UnsafeArchive { .. }) && err.to_string().contains(reason),
            "sanitize {name}: got {err}"
        );
        let outer = tempfile::tempdir().unwrap();
        let dest = outer.path().join("dest");
        fs::create_dir(&dest).unwrap();
        let err = run_extract(bytes, &dest, ArchivePolicy::default()).expect_err(name);
        assert!(
            matches!(err, Error::UnsafeArchive { .. }) && err.to_string().contains(reason),
            "extract {name}: got {err}"
        );
        // Nothing landed outside dest.
        let outside: Vec<_> = fs::read_dir(outer.path())
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(
            outside,
            vec![std::ffi::OsString::from("dest")],
            "{name} wrote outside"
        );
    }
}

#[tokio::test]
async fn limits_are_enforced() {
    let policy = ArchivePolicy {
        max_entries: 2,
        ..ArchivePolicy::default()
    };
    let t = RawTar::new()
        .file("a", b"1")
        .file("b", b"2")
        .file("c", b"3")
        .finish();
    assert!(
        run_sanitize(t, policy)
            .await
            .unwrap_err()
            .to_string()
            .contains("more than 2 entries")
    );
    let policy = ArchivePolicy {
        max_total_bytes: 10,
        ..ArchivePolicy::default()
    };
    let t = RawTar::new()
        .file("a", &[0u8; 8])
        .file("b", &[0u8; 8])
        .finish();
    assert!(
        run_sanitize(t, policy)
            .await
            .unwrap_err()
            .to_string()
            .contains("exceeds 10 bytes")
    );
}

#[tokio::test]
async fn symlinks_survive_unless_strict() {
    let t = RawTar::new()
        .dir("venv")
        .dir("venv/bin")
        .symlink("venv/bin/python", "/usr/bin/python3")
        .symlink("venv/bin/python3", "python")
        .finish();
    let dir = tempfile::tempdir().unwrap();
    run_extract(t.clone(), dir.path(), ArchivePolicy::default()).unwrap();
    assert_eq!(
        fs::read_link(dir.path().join("venv/bin/python")).unwrap(),
        Path::new("/usr/bin/python3")
    );
    assert_eq!(
        fs::read_link(dir.path().join("venv/bin/python3")).unwrap(),
        Path::new("python")
    );
    let err = run_sanitize(t, ArchivePolicy::default().strict())
        .await
        .unwrap_err();
    assert!(err.to_string().contains("strict"), "{err}");
    let inward = RawTar::new().dir("a").symlink("a/l", "../b").finish();
    run_sanitize(inward, ArchivePolicy::default().strict())
        .await
        .unwrap();
}

#[test]
fn extraction_never_follows_existing_links() {
    let outer = tempfile::tempdir().unwrap();
    let dest = outer.path().join("ws");
    let victim = outer.path().join("victim");
    fs::create_dir_all(&dest).unwrap();
    fs::create_dir_all(&victim).unwrap();
    fs::write(victim.join("secret"), "keep").unwrap();
    std::os::unix::fs::symlink(&victim, dest.join("out")).unwrap();
    std::os::unix::fs::symlink(victim.join("secret"), dest.join("file-link")).unwrap();

    // A path through the live link is refused.
    let t = RawTar::new().file("out/secret", b"pwned").finish();
    let err = run_extract(t, &dest, ArchivePolicy::default()).unwrap_err();
    assert!(err.to_string().contains("through the symlink"), "{err}");
    // A file at the link's own path replaces the link, not its target.
    let t = RawTar::new().file("file-link", b"new").finish();
    run_extract(t, &dest, ArchivePolicy::default()).unwrap();
    assert_eq!(fs::read_to_string(victim.join("secret")).unwrap(), "keep");
    assert_eq!(fs::read_to_string(dest.join("file-link")).unwrap(), "new");
    assert!(
        !fs::symlink_metadata(dest.join("file-link"))
            .unwrap()
            .file_type()
            .is_symlink()
    );
}

#[tokio::test]
async fn pack_dir_round_trips_through_sanitize_and_extract() {
    let src = tempfile::tempdir().unwrap();
    let s = src.path();
    fs::create_dir_all(s.join("a/b")).unwrap();
    fs::write(s.join("a/b/file.txt"), "hello").unwrap();
    fs::write(s.join("bin.dat"), [0u8, 1, 2, 255]).unwrap();
    fs::set_permissions(s.join("bin.dat"), fs::Permissions::from_mode(0o755)).unwrap();
    std::os::unix::fs::symlink("a/b/file.txt", s.join("link")).unwrap();
    fs::create_dir_all(s.join("node_modules/.cache")).unwrap();
    fs::write(s.join("node_modules/.cache/x"), "cache").unwrap();
    fs::write(s.join("node_modules/keep.js"), "js").unwrap();
    fs::create_dir_all(s.join("mnt")).unwrap();
    fs::write(s.join("mnt/host"), "host").unwrap();
    let long = format!("{}/deep.txt", "d".repeat(120));
    fs::create_dir_all(s.join("d".repeat(120))).unwrap();
    fs::write(s.join(&long), "deep").unwrap();

    let excludes = Excludes::new(
        vec![RelPath::new("mnt").unwrap()],
        &["node_modules/.cache".to_owned()],
    )
    .unwrap();
    let packed = pack_dir(s.to_path_buf(), None, excludes);
    let clean = sanitize(packed, ArchivePolicy::default());
    let dst = tempfile::tempdir().unwrap();
    extract_to_dir(clean, dst.path().to_path_buf(), ArchivePolicy::default())
        .await
        .unwrap();
    let d = dst.path();
    assert_eq!(fs::read_to_string(d.join("a/b/file.txt")).unwrap(), "hello");
    assert_eq!(fs::read(d.join("bin.dat")).unwrap(), vec![0u8, 1, 2, 255]);
    assert_eq!(
        fs::metadata(d.join("bin.dat")).unwrap().mode() & 0o777,
        0o755
    );
    assert_eq!(
        fs::read_link(d.join("link")).unwrap(),
        Path::new("a/b/file.txt")
    );
    assert_eq!(fs::read_to_string(d.join(&long)).unwrap(), "deep");
    assert!(d.join("node_modules/keep.js").exists());
    assert!(!d.join("node_modules/.cache").exists());
    assert!(!d.join("mnt").exists());

    let listed = list_dir(d).unwrap();
    let names: Vec<_> = listed.iter().map(|e| e.path.as_str()).collect();
    assert!(names.contains(&"a/b/file.txt") && names.contains(&"link"));
    let link = listed.iter().find(|e| e.path.as_str() == "link").unwrap();
    assert_eq!(link.kind, EntryType::Symlink);
    assert_eq!(link.link_target.as_deref(), Some("a/b/file.txt"));
}

#[tokio::test]
async fn hard_links_inside_the_archive_work() {
    let t = RawTar::new()
        .file("orig", b"data")
        .hardlink("copy", "orig")
        .finish();
    let clean = run_sanitize(t, ArchivePolicy::default()).await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    run_extract(clean.to_vec(), dir.path(), ArchivePolicy::default()).unwrap();
    assert_eq!(fs::read_to_string(dir.path().join("copy")).unwrap(), "data");
    assert_eq!(
        fs::metadata(dir.path().join("copy")).unwrap().ino(),
        fs::metadata(dir.path().join("orig")).unwrap().ino()
    );
}

#[tokio::test]
async fn setid_bits_are_dropped() {
    let t = RawTar::new().file_mode("suid", b"x", 0o4755).finish();
    let dir = tempfile::tempdir().unwrap();
    run_extract(t, dir.path(), ArchivePolicy::default()).unwrap();
    assert_eq!(
        fs::metadata(dir.path().join("suid")).unwrap().mode() & 0o7777,
        0o755
    );
}

#[test]
fn link_containment() {
    let p = RelPath::new("a/b/link").unwrap();
    assert!(link_stays_inside(&p, "../c"));
    assert!(link_stays_inside(&p, "../../c"));
    assert!(!link_stays_inside(&p, "../../../c"));
    assert!(!link_stays_inside(&p, "/etc"));
}

/// A destination with a sibling `outside` directory holding what the issue-8 probes aimed at.
struct Neighbourhood {
    _tmp: tempfile::TempDir,
    dest: PathBuf,
    outside: PathBuf,
}

impl Neighbourhood {
    fn new() -> Self {
        let tmp = tempfile::tempdir().unwrap();
        let dest = tmp.path().join("dest");
        let outside = tmp.path().join("outside");
        fs::create_dir_all(&dest).unwrap();
        fs::create_dir_all(outside.join("sub")).unwrap();
        fs::write(outside.join("secret.txt"), "secret").unwrap();
        fs::write(outside.join("target.txt"), "target").unwrap();
        fs::write(outside.join("f"), "outside f").unwrap();
        fs::set_permissions(
            outside.join("target.txt"),
            fs::Permissions::from_mode(0o640),
        )
        .unwrap();
        fs::set_permissions(&outside, fs::Permissions::from_mode(0o750)).unwrap();
        // Old mtimes, so that a touch through a link shows even within one clock tick.
        for p in ["secret.txt", "target.txt", "f", "sub", ""] {
            let f = fs::File::open(outside.join(p)).unwrap();
            f.set_modified(UNIX_EPOCH + Duration::from_secs(1_000_000))
                .unwrap();
        }
        Neighbourhood {
            _tmp: tmp,
            dest,
            outside,
        }
    }

    fn outside_str(&self) -> &str {
        self.outside.to_str().unwrap()
    }
}

fn assert_unsafe<T: std::fmt::Debug>(what: &str, r: Result<T>) {
    match r {
        Err(Error::UnsafeArchive { .. }) => {}
        other => panic!("{what}: expected UnsafeArchive, got {other:?}"),
    }
}

/// Refused by `inspect`, `sanitize` and `extract_to_dir`, with nothing outside changed.
async fn refused_everywhere(n: &Neighbourhood, t: Vec<u8>) {
    let before = record_with_root(&n.outside);
    assert_unsafe(
        "inspect",
        inspect(&mut &t[..], ArchivePolicy::default(), &mut NoHooks),
    );
    assert_unsafe(
        "sanitize",
        run_sanitize(t.clone(), ArchivePolicy::default()).await,
    );
    assert_unsafe(
        "extract_to_dir",
        extract_to_dir(stream::once(t), n.dest.clone(), ArchivePolicy::default()).await,
    );
    assert_eq!(record_with_root(&n.outside), before, "the outside changed");
}

#[tokio::test]
async fn hard_link_through_a_symlink_over_an_implicit_dir_is_refused() {
    let n = Neighbourhood::new();
    let t = RawTar::new()
        .file("d/secret.txt", b"inside")
        .symlink("d", n.outside_str())
        .hardlink("hl", "d/secret.txt")
        .finish();
    refused_everywhere(&n, t).await;
    assert!(fs::symlink_metadata(n.dest.join("hl")).is_err());
    assert!(fs::symlink_metadata(n.dest.join("d")).unwrap().is_dir());
}

#[tokio::test]
async fn dir_mode_through_a_symlink_over_an_implicit_dir_is_refused() {
    let n = Neighbourhood::new();
    let t = RawTar::new()
        .dir_mode("p/target.txt", 0o777)
        .symlink("p", n.outside_str())
        .finish();
    refused_everywhere(&n, t).await;
    assert!(fs::symlink_metadata(n.dest.join("p")).unwrap().is_dir());
}

#[tokio::test]
async fn symlink_or_file_over_an_implicit_dir_is_refused() {
    for (what, t) in [
        (
            "symlink",
            RawTar::new().file("a/b/f", b"x").symlink("a", "b").finish(),
        ),
        (
            "symlink over the deeper one",
            RawTar::new()
                .file("a/b/f", b"x")
                .symlink("a/b", ".")
                .finish(),
        ),
        (
            "file",
            RawTar::new().file("a/b/f", b"x").file("a", b"y").finish(),
        ),
        (
            "hard link",
            RawTar::new()
                .file("a/f", b"x")
                .file("g", b"y")
                .hardlink("a", "g")
                .finish(),
        ),
    ] {
        let err = inspect(&mut &t[..], ArchivePolicy::default(), &mut NoHooks).expect_err(what);
        assert!(
            matches!(err, Error::UnsafeArchive { .. })
                && err.to_string().contains("replace the directory"),
            "{what}: {err}"
        );
    }
}

#[tokio::test]
async fn explicit_dir_after_its_implicit_creation_is_accepted() {
    let t = RawTar::new()
        .file("a/b/f", b"x")
        .dir_mode("a/b", 0o750)
        .dir_mode("a", 0o755)
        .finish();
    let clean = run_sanitize(t.clone(), ArchivePolicy::default())
        .await
        .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let stats = run_extract(clean.to_vec(), dir.path(), ArchivePolicy::default()).unwrap();
    assert_eq!(stats.entries, 3);
    let b = fs::metadata(dir.path().join("a/b")).unwrap();
    assert_eq!(b.mode() & 0o7777, 0o750);
    assert_eq!(b.mtime(), 1_700_000_000);
    assert_eq!(fs::read_to_string(dir.path().join("a/b/f")).unwrap(), "x");
    // Once explicit, a second entry for it is a duplicate.
    let again = RawTar::new().file("a/f", b"x").dir("a").dir("a").finish();
    let err = run_sanitize(again, ArchivePolicy::default())
        .await
        .unwrap_err();
    assert!(err.to_string().contains("duplicate"), "{err}");
}

#[tokio::test]
async fn a_name_cut_short_by_a_nul_is_refused_not_truncated() {
    let n = Neighbourhood::new();
    let t = RawTar::new()
        .file_raw(b"ok\0/../../escape.txt", b"x")
        .finish();
    refused_everywhere(&n, t).await;
    assert!(fs::symlink_metadata(n.dest.join("ok")).is_err());
    // A name field that ends in NULs is fine.
    let t = RawTar::new().file_raw(b"ok\0\0\0", b"x").finish();
    run_extract(t, &n.dest, ArchivePolicy::default()).unwrap();
    assert_eq!(fs::read_to_string(n.dest.join("ok")).unwrap(), "x");
}

/// A reader that runs `action` once, just before the first read at or after `at` (the start of
/// a later entry's header, so every entry before it was extracted): a concurrent process
/// changing the destination between two entries.
struct ActAt<'a, F: FnOnce()> {
    data: &'a [u8],
    pos: usize,
    at: usize,
    action: Option<F>,
}

impl<F: FnOnce()> Read for ActAt<'_, F> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        if self.pos >= self.at
            && let Some(action) = self.action.take()
        {
            action();
        }
        let end = if self.pos < self.at {
            self.at
        } else {
            self.data.len()
        };
        let n = buf.len().min(end - self.pos);
        buf[..n].copy_from_slice(&self.data[self.pos..self.pos + n]);
        self.pos += n;
        Ok(n)
    }
}

/// The length of `t` without its end-of-archive blocks: where the next entry would start.
fn offset_after(t: RawTar) -> usize {
    t.finish().len() - 1024
}

/// Swap the directory `dest/name` for a symlink to `target`.
fn swap_for_link(dest: &Path, name: &str, target: &Path) {
    fs::rename(dest.join(name), dest.join(format!("{name}-moved"))).unwrap();
    std::os::unix::fs::symlink(target, dest.join(name)).unwrap();
}

#[test]
fn deferred_dir_modes_never_follow_a_symlink_swapped_in() {
    crate::beneath::both_resolutions(deferred_dir_mode_swap);
}

fn deferred_dir_mode_swap() {
    let n = Neighbourhood::new();
    let head = || RawTar::new().dir_mode("p", 0o777).file("p/t", b"x");
    let at = offset_after(head());
    let t = head().file("z", b"z").finish();
    let before = record_with_root(&n.outside);
    let reader = ActAt {
        data: &t,
        pos: 0,
        at,
        action: Some(|| swap_for_link(&n.dest, "p", &n.outside)),
    };
    // The extraction itself may succeed: `p` is no longer the archive's directory.
    let _ = extract_blocking(reader, &n.dest, ArchivePolicy::default());
    assert_eq!(record_with_root(&n.outside), before, "the outside changed");
}

#[test]
fn hard_link_sources_never_resolve_through_a_symlink_swapped_in() {
    crate::beneath::both_resolutions(hard_link_source_swap);
}

fn hard_link_source_swap() {
    let n = Neighbourhood::new();
    let head = || RawTar::new().file("d/f", b"inside f");
    let at = offset_after(head());
    let t = head().file("pad", b"p").hardlink("hl", "d/f").finish();
    let before = record_with_root(&n.outside);
    let reader = ActAt {
        data: &t,
        pos: 0,
        at,
        action: Some(|| swap_for_link(&n.dest, "d", &n.outside)),
    };
    assert_unsafe(
        "extract",
        extract_blocking(reader, &n.dest, ArchivePolicy::default()),
    );
    assert_eq!(record_with_root(&n.outside), before, "the outside changed");
    assert!(fs::symlink_metadata(n.dest.join("hl")).is_err());
}

#[tokio::test]
async fn pack_dir_never_reads_through_a_symlinked_parent() {
    let n = Neighbourhood::new();
    std::os::unix::fs::symlink(&n.outside, n.dest.join("out")).unwrap();
    let packed = pack_dir(
        n.dest.clone(),
        Some(vec![RelPath::new("out/secret.txt").unwrap()]),
        Excludes::default(),
    );
    match stream::collect(packed, 1 << 20).await {
        Err(Error::PathEscape { .. }) => {}
        other => panic!("expected PathEscape, got {other:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pack_dir_never_reads_a_file_swapped_for_a_symlink() {
    // A file flips between a regular file and a symlink to a secret outside while the tree is
    // packed over and over: a walk that looks at the name and then opens it by path reads the
    // secret when the flip falls between the two.
    let n = Neighbourhood::new();
    let secret = "SECRET-SECRET-SECRET";
    fs::write(n.outside.join("secret.txt"), secret).unwrap();
    let spare = n.dest.parent().unwrap().join("spare");
    fs::create_dir(&spare).unwrap();
    fs::write(n.dest.join("b"), "inside-inside-inside").unwrap();
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let flipper = {
        let (stop, dest, outside) = (stop.clone(), n.dest.clone(), n.outside.clone());
        std::thread::spawn(move || {
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                let _ = fs::remove_file(spare.join("l"));
                std::os::unix::fs::symlink(outside.join("secret.txt"), spare.join("l")).unwrap();
                fs::rename(spare.join("l"), dest.join("b")).unwrap();
                fs::write(spare.join("f"), "inside-inside-inside").unwrap();
                fs::rename(spare.join("f"), dest.join("b")).unwrap();
            }
        })
    };
    let started = std::time::Instant::now();
    let mut leaked = false;
    let mut rounds = 0;
    while rounds < 3000 && started.elapsed() < Duration::from_secs(4) {
        rounds += 1;
        let packed = pack_dir(n.dest.clone(), None, Excludes::default());
        if let Ok(bytes) = stream::collect(packed, 1 << 20).await
            && bytes.windows(6).any(|w| w == b"SECRET")
        {
            leaked = true;
            break;
        }
    }
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    flipper.join().unwrap();
    assert!(!leaked, "a snapshot read the outside file (round {rounds})");
}

#[test]
fn extraction_replaces_what_is_there_through_both_resolutions() {
    crate::beneath::both_resolutions(|| {
        let n = Neighbourhood::new();
        let d = &n.dest;
        // What an earlier state of the workspace left: a file, a link out, a directory, and a
        // link where the archive has a directory.
        fs::write(d.join("f"), "old").unwrap();
        std::os::unix::fs::symlink(n.outside.join("secret.txt"), d.join("l")).unwrap();
        fs::create_dir_all(d.join("gone/deep")).unwrap();
        fs::write(d.join("gone/deep/x"), "x").unwrap();
        std::os::unix::fs::symlink(&n.outside, d.join("dir")).unwrap();
        let before = record_with_root(&n.outside);
        let t = RawTar::new()
            .file("f", b"new f")
            .file("l", b"new l")
            .symlink("gone", "f")
            .dir_mode("dir", 0o750)
            .file("dir/in", b"in")
            .file("a/b/c", b"c")
            .hardlink("a/h", "a/b/c")
            .dir_mode("a", 0o500)
            .finish();
        let stats = extract_blocking(&t[..], d, ArchivePolicy::default()).unwrap();
        assert_eq!(stats.entries, 8);
        assert_eq!(record_with_root(&n.outside), before, "the outside changed");
        assert_eq!(fs::read_to_string(d.join("f")).unwrap(), "new f");
        assert_eq!(fs::read_to_string(d.join("l")).unwrap(), "new l");
        assert_eq!(fs::read_link(d.join("gone")).unwrap(), Path::new("f"));
        let dir = fs::symlink_metadata(d.join("dir")).unwrap();
        assert!(dir.is_dir());
        assert_eq!(dir.mode() & 0o7777, 0o750);
        assert_eq!(fs::read_to_string(d.join("dir/in")).unwrap(), "in");
        assert_eq!(
            fs::metadata(d.join("a/h")).unwrap().ino(),
            fs::metadata(d.join("a/b/c")).unwrap().ino()
        );
        // Owner access is kept while extracting (and after): 0o500 | 0o700.
        assert_eq!(fs::metadata(d.join("a")).unwrap().mode() & 0o7777, 0o700);
    });
}

#[tokio::test]
async fn deep_trees_are_walked_with_a_bounded_number_of_handles() {
    // Deeper than the handles a walk holds at once; at every level a file sorts after the
    // subdirectory, so each level's handle is needed again after the walk below it.
    let src = tempfile::tempdir().unwrap();
    let depth = HELD_DIRS + 20;
    let mut cur = src.path().to_path_buf();
    let mut expected = Vec::new();
    let mut rel = String::new();
    for level in 0..depth {
        cur.push("d");
        fs::create_dir(&cur).unwrap();
        fs::write(cur.with_file_name("z"), level.to_string()).unwrap();
        rel.push_str(if rel.is_empty() { "d" } else { "/d" });
        expected.push(rel.clone());
    }
    let mut zs: Vec<String> = expected
        .iter()
        .map(|d| match d.rsplit_once('/') {
            Some((parent, _)) => format!("{parent}/z"),
            None => "z".to_owned(),
        })
        .collect();
    expected.append(&mut zs);
    expected.sort_by(|a, b| {
        // Parents before children, siblings by name: compare component lists.
        a.split('/').cmp(b.split('/'))
    });
    let listed: Vec<String> = list_dir(src.path())
        .unwrap()
        .into_iter()
        .map(|e| e.path.as_str().to_owned())
        .collect();
    assert_eq!(listed, expected);
    // The same through pack_dir and back.
    let dst = tempfile::tempdir().unwrap();
    extract_to_dir(
        pack_dir(src.path().to_path_buf(), None, Excludes::default()),
        dst.path().to_path_buf(),
        ArchivePolicy::default(),
    )
    .await
    .unwrap();
    let deepest = dst
        .path()
        .join(expected.iter().rev().find(|p| p.ends_with("/z")).unwrap());
    assert!(deepest.is_file());
    let back: Vec<String> = list_dir(dst.path())
        .unwrap()
        .into_iter()
        .map(|e| e.path.as_str().to_owned())
        .collect();
    assert_eq!(back, expected);
}
