use std::io::Read as _;
use std::os::unix::fs::FileTypeExt as _;
use std::os::unix::fs::symlink;

use super::*;

fn rel(s: &str) -> RelPath {
    RelPath::new(s).unwrap()
}

/// A root with `inside/` and a sibling `outside/` holding a secret, plus links of every kind.
struct Layout {
    _tmp: tempfile::TempDir,
    root: PathBuf,
    outside: PathBuf,
}

fn layout() -> Layout {
    let tmp = tempfile::tempdir().unwrap();
    let root = tmp.path().join("root");
    let outside = tmp.path().join("outside");
    fs::create_dir_all(root.join("real/sub")).unwrap();
    fs::create_dir_all(&outside).unwrap();
    fs::write(root.join("real/sub/file.txt"), "inside").unwrap();
    fs::write(outside.join("secret.txt"), "secret").unwrap();
    symlink("real", root.join("rel_dir")).unwrap(); // stays inside
    symlink("real/sub/file.txt", root.join("rel_file")).unwrap();
    symlink(&outside, root.join("abs_out")).unwrap(); // absolute, outside
    symlink("../outside", root.join("dotdot_out")).unwrap(); // relative, outside
    symlink("../root/real", root.join("dotdot_back_in")).unwrap(); // leaves, then re-enters
    symlink("loop_b", root.join("loop_a")).unwrap();
    symlink("loop_a", root.join("loop_b")).unwrap();
    symlink("sub/..", root.join("real/up_link")).unwrap(); // `..` that stays inside
    Layout {
        _tmp: tmp,
        root,
        outside,
    }
}

fn read(dir: &Dir, path: &str, follow: Follow) -> io::Result<String> {
    let mut s = String::new();
    dir.read_file(&rel(path), follow)?.read_to_string(&mut s)?;
    Ok(s)
}

fn errno(r: io::Result<impl fmt::Debug>) -> Errno {
    let e = r.expect_err("refused");
    Errno::from_io_error(&e).unwrap_or_else(|| panic!("{e}"))
}

/// Every rule, through the kernel's `openat2` and through the portable walk.
fn both_paths(test: impl Fn()) {
    both_resolutions(test);
}

#[test]
fn never_refuses_every_symlink_on_the_way() {
    both_paths(|| {
        let l = layout();
        let root = Dir::open(&l.root).unwrap();
        assert_eq!(
            read(&root, "real/sub/file.txt", Follow::Never).unwrap(),
            "inside"
        );
        assert_eq!(
            errno(read(&root, "rel_dir/sub/file.txt", Follow::Never)),
            Errno::LOOP
        );
        assert_eq!(errno(read(&root, "rel_file", Follow::Never)), Errno::LOOP);
        assert_eq!(
            errno(read(&root, "abs_out/secret.txt", Follow::Never)),
            Errno::LOOP
        );
        assert_eq!(
            errno(root.open_dir(&rel("rel_dir"), Follow::Never)),
            Errno::LOOP
        );
        // Metadata under Never describes a final link instead of refusing it.
        let meta = root.metadata(&rel("abs_out"), Follow::Never).unwrap();
        assert!(meta.file_type().is_symlink());
    });
}

#[test]
fn beneath_follows_only_links_that_stay_inside() {
    both_paths(|| {
        let l = layout();
        let root = Dir::open(&l.root).unwrap();
        assert_eq!(
            read(&root, "rel_dir/sub/file.txt", Follow::Beneath).unwrap(),
            "inside"
        );
        assert_eq!(read(&root, "rel_file", Follow::Beneath).unwrap(), "inside");
        assert_eq!(
            read(&root, "real/up_link/sub/file.txt", Follow::Beneath).unwrap(),
            "inside"
        );
        assert_eq!(
            errno(read(&root, "abs_out/secret.txt", Follow::Beneath)),
            Errno::XDEV
        );
        assert_eq!(
            errno(read(&root, "dotdot_out/secret.txt", Follow::Beneath)),
            Errno::XDEV
        );
        // Leaving the root is refused even when the path would come back in.
        assert_eq!(
            errno(read(&root, "dotdot_back_in/sub/file.txt", Follow::Beneath)),
            Errno::XDEV
        );
        assert_eq!(errno(read(&root, "loop_a", Follow::Beneath)), Errno::LOOP);
        let dir = root.open_dir(&rel("rel_dir"), Follow::Beneath).unwrap();
        assert_eq!(read(&dir, "sub/file.txt", Follow::Never).unwrap(), "inside");
        let meta = root.metadata(&rel("rel_dir"), Follow::Beneath).unwrap();
        assert!(meta.is_dir());
        assert_eq!(
            errno(root.metadata(&rel("abs_out"), Follow::Beneath)),
            Errno::XDEV
        );
        assert!(
            refusal(&read(&root, "abs_out/secret.txt", Follow::Beneath).unwrap_err()).is_some()
        );
        assert!(refusal(&read(&root, "missing", Follow::Beneath).unwrap_err()).is_none());
    });
}

#[test]
fn creating_never_passes_through_a_link() {
    both_paths(|| {
        let l = layout();
        let root = Dir::open(&l.root).unwrap();
        let made = root.create_dir_all(&rel("new/a/b"), Follow::Never).unwrap();
        made.write_atomic("f.txt", b"x", 0o640).unwrap();
        assert_eq!(fs::read(l.root.join("new/a/b/f.txt")).unwrap(), b"x");
        assert_eq!(
            errno(root.create_dir_all(&rel("abs_out/planted"), Follow::Never)),
            Errno::LOOP
        );
        assert_eq!(
            errno(root.create_dir_all(&rel("abs_out/planted"), Follow::Beneath)),
            Errno::XDEV
        );
        assert!(!l.outside.join("planted").exists());
        // A link at the written name is replaced, its target untouched.
        let abs_out = rel("abs_out");
        let (parent, name) = root.parent_of(&abs_out, Follow::Never, false).unwrap();
        parent.write_atomic(name, b"replaced", 0o644).unwrap();
        assert!(
            fs::symlink_metadata(l.root.join("abs_out"))
                .unwrap()
                .is_file()
        );
        assert_eq!(
            fs::read_to_string(l.outside.join("secret.txt")).unwrap(),
            "secret"
        );
        // create_new does not follow a dangling link either.
        symlink(l.outside.join("created.txt"), l.root.join("dangling")).unwrap();
        assert_eq!(errno(root.create_new("dangling", 0o644)), Errno::EXIST);
        assert!(!l.outside.join("created.txt").exists());
    });
}

#[test]
fn remove_all_removes_links_not_their_targets() {
    let l = layout();
    let root = Dir::open(&l.root).unwrap();
    fs::create_dir(l.root.join("real/sub/deeper")).unwrap();
    symlink(&l.outside, l.root.join("real/sub/deeper/out")).unwrap();
    root.remove_all("real").unwrap();
    root.remove_all("abs_out").unwrap();
    root.remove_all("missing").unwrap();
    assert!(!l.root.join("real").exists());
    assert!(fs::symlink_metadata(l.root.join("abs_out")).is_err());
    assert_eq!(
        fs::read_to_string(l.outside.join("secret.txt")).unwrap(),
        "secret"
    );
}

#[test]
fn entries_hard_links_and_renames_stay_in_their_directories() {
    let l = layout();
    let root = Dir::open(&l.root).unwrap();
    let real = root.open_dir(&rel("real"), Follow::Never).unwrap();
    let mut names: Vec<_> = real.entries().unwrap();
    names.sort_by(|a, b| a.name.cmp(&b.name));
    assert_eq!(
        names,
        vec![
            DirEntry {
                name: "sub".into(),
                kind: Kind::Dir
            },
            DirEntry {
                name: "up_link".into(),
                kind: Kind::Symlink
            },
        ]
    );
    let sub = real.open_subdir("sub").unwrap();
    sub.hard_link("file.txt", &root, "hl").unwrap();
    assert_eq!(fs::metadata(l.root.join("hl")).unwrap().nlink(), 2);
    // A hard link of a symlink links the link itself.
    root.hard_link("abs_out", &root, "abs_out2").unwrap();
    assert!(
        fs::symlink_metadata(l.root.join("abs_out2"))
            .unwrap()
            .file_type()
            .is_symlink()
    );
    assert_eq!(
        errno(root.rename_noreplace("hl", &root, "rel_dir")),
        Errno::EXIST
    );
    root.rename("hl", &real, "moved").unwrap();
    assert_eq!(
        fs::read_to_string(l.root.join("real/moved")).unwrap(),
        "inside"
    );
    assert_eq!(root.read_link("rel_dir").unwrap(), PathBuf::from("real"));
    assert_eq!(errno(real.open_subdir("up_link")), Errno::NOTDIR);
}

use std::os::unix::fs::MetadataExt as _;

#[test]
fn anchored_reads_follow_absolute_links_only_into_anchors() {
    both_paths(|| {
        let l = layout();
        let other = l.root.parent().unwrap().join("other");
        fs::create_dir_all(other.join("sub")).unwrap();
        fs::write(other.join("sub/o.txt"), "other").unwrap();
        symlink(other.join("sub/o.txt"), l.root.join("to_other_file")).unwrap();
        symlink(&other, l.root.join("to_other")).unwrap();
        symlink(other.join("sub/../.."), l.root.join("above_other")).unwrap();
        // A link inside the anchor that climbs out of it.
        symlink("../outside", other.join("climb")).unwrap();
        let root = Dir::open(&l.root).unwrap();
        let other_dir = Dir::open(&other).unwrap();
        let anchors = [Anchor {
            path: &other,
            dir: &other_dir,
        }];
        let read = |p: &str| -> io::Result<String> {
            let mut s = String::new();
            root.read_file_anchored(&rel(p), &anchors)?
                .read_to_string(&mut s)?;
            Ok(s)
        };
        assert_eq!(read("to_other_file").unwrap(), "other");
        assert_eq!(read("to_other/sub/o.txt").unwrap(), "other");
        assert_eq!(read("rel_dir/sub/file.txt").unwrap(), "inside");
        let dir = root.open_dir_anchored(&rel("to_other"), &anchors).unwrap();
        assert_eq!(read_names(&dir), ["climb", "sub"]);
        assert!(
            root.open_path_anchored(&rel("to_other/sub"), &anchors)
                .unwrap()
                .metadata()
                .unwrap()
                .is_dir()
        );
        // Absolute targets elsewhere, and `..` above the anchor, are still refused.
        assert_eq!(errno(read("abs_out/secret.txt")), Errno::XDEV);
        assert_eq!(errno(read("above_other/outside/secret.txt")), Errno::XDEV);
        assert_eq!(errno(read("to_other/climb/secret.txt")), Errno::XDEV);
        // Without anchors it is the plain Beneath rule.
        assert_eq!(
            errno(root.read_file_anchored(&rel("to_other_file"), &[])),
            Errno::XDEV
        );
    });
}

fn read_names(dir: &Dir) -> Vec<String> {
    let mut names: Vec<String> = dir
        .entries()
        .unwrap()
        .into_iter()
        .map(|e| e.name.to_string_lossy().into_owned())
        .collect();
    names.sort();
    names
}

#[test]
fn copy_all_copies_trees_without_following_links() {
    let l = layout();
    let root = Dir::open(&l.root).unwrap();
    fs::set_permissions(
        l.root.join("real/sub/file.txt"),
        fs::Permissions::from_mode(0o640),
    )
    .unwrap();
    symlink(&l.outside, l.root.join("real/sub/out")).unwrap();
    root.copy_all("real", &root, "copy").unwrap();
    assert_eq!(
        fs::read_to_string(l.root.join("copy/sub/file.txt")).unwrap(),
        "inside"
    );
    let mode = fs::metadata(l.root.join("copy/sub/file.txt"))
        .unwrap()
        .permissions()
        .mode();
    assert_eq!(mode & 0o777, 0o640);
    // Links are copied as links, their targets verbatim.
    assert_eq!(
        fs::read_link(l.root.join("copy/sub/out")).unwrap(),
        l.outside
    );
    assert_eq!(
        fs::read_link(l.root.join("copy/up_link")).unwrap(),
        PathBuf::from("sub/..")
    );
    // A link at the top is copied as a link, not as what it points to.
    root.copy_all("abs_out", &root, "abs_copy").unwrap();
    assert!(
        fs::symlink_metadata(l.root.join("abs_copy"))
            .unwrap()
            .file_type()
            .is_symlink()
    );
    assert_eq!(
        fs::read_dir(&l.outside).unwrap().count(),
        1,
        "nothing was written outside"
    );
    assert_eq!(errno(root.copy_all("real", &root, "copy")), Errno::EXIST);
    let meta = root.stat().unwrap();
    assert_eq!(meta.ino(), fs::metadata(&l.root).unwrap().ino());
}

use std::os::unix::fs::PermissionsExt as _;

#[test]
fn open_entry_reads_files_and_refuses_links_without_blocking() {
    let l = layout();
    let root = Dir::open(&l.root).unwrap();
    let sub = root.open_dir(&rel("real/sub"), Follow::Never).unwrap();
    let mut s = String::new();
    sub.open_entry("file.txt")
        .unwrap()
        .read_to_string(&mut s)
        .unwrap();
    assert_eq!(s, "inside");
    // A link is refused wherever it points, and never read through.
    assert_eq!(errno(root.open_entry("rel_file")), Errno::LOOP);
    assert_eq!(errno(root.open_entry("abs_out")), Errno::LOOP);
    // A fifo opens at once (no writer needed) and says what it is.
    rustix::fs::mknodat(
        root.as_fd(),
        "fifo",
        rustix::fs::FileType::Fifo,
        Mode::from_raw_mode(0o600),
        0,
    )
    .unwrap();
    let fifo = root.open_entry("fifo").unwrap();
    assert!(fifo.metadata().unwrap().file_type().is_fifo());
}

#[test]
fn stat_describes_the_handle_not_the_path() {
    let l = layout();
    let root = Dir::open(&l.root).unwrap();
    let sub = root.open_dir(&rel("real/sub"), Follow::Never).unwrap();
    let ino = fs::metadata(l.root.join("real/sub")).unwrap().ino();
    assert_eq!(sub.stat().unwrap().ino(), ino);
    // Swapped for a link to elsewhere, the path names something else; the handle does not.
    fs::rename(l.root.join("real/sub"), l.root.join("real/moved")).unwrap();
    symlink(&l.outside, l.root.join("real/sub")).unwrap();
    let meta = sub.stat().unwrap();
    assert!(meta.is_dir());
    assert_eq!(meta.ino(), ino);
}
