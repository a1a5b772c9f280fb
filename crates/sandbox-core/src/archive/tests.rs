//! The hostile-archive corpus and round trips.

use super::*;
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
    c
}

#[tokio::test]
async fn hostile_corpus_is_rejected_by_sanitize_and_extract() {
    for (name, bytes, reason) in corpus() {
        let err = run_sanitize(bytes.clone(), ArchivePolicy::default())
            .await
            .unwrap_err();
        assert!(
            matches!(err, Error::UnsafeArchive { .. }) && err.to_string().contains(reason),
            "sanitize {name}: got {err}"
        );
        let outer = tempfile::tempdir().unwrap();
        let dest = outer.path().join("dest");
        fs::create_dir(&dest).unwrap();
        let err = run_extract(bytes, &dest, ArchivePolicy::default()).unwrap_err();
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
