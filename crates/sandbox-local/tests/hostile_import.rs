//! Issue 8 through the backend: hostile archives imported with Merge and Replace are refused
//! with a typed error, and nothing beside the box changes (content, mode, mtime, link count).

mod common;

use std::fs;
use std::os::unix::fs::PermissionsExt as _;
use std::path::Path;
use std::time::{Duration, UNIX_EPOCH};

use common::{TestBox, rel, tree};
use sandbox_core::stream;
use sandbox_core::testkit::fs_state::record_with_root;
use sandbox_core::testkit::raw_tar::RawTar;
use sandbox_core::{Error, ImportMode};

/// A box with a populated workspace and a populated directory outside it.
async fn setup() -> (TestBox, std::path::PathBuf) {
    let b = TestBox::default().await;
    b.handle()
        .write_file(&rel("existing.txt"), "live".into(), 0o644)
        .await
        .unwrap();
    let outside = b.outside();
    fs::write(outside.join("secret.txt"), "secret").unwrap();
    fs::write(outside.join("target.txt"), "target").unwrap();
    fs::set_permissions(
        outside.join("target.txt"),
        fs::Permissions::from_mode(0o640),
    )
    .unwrap();
    fs::set_permissions(&outside, fs::Permissions::from_mode(0o750)).unwrap();
    // Old mtimes, so that a touch through a link shows even within one clock tick.
    for p in ["secret.txt", "target.txt", ""] {
        fs::File::open(outside.join(p))
            .unwrap()
            .set_modified(UNIX_EPOCH + Duration::from_secs(1_000_000))
            .unwrap();
    }
    (b, outside)
}

/// The archives of the probe, aimed at `outside`.
fn probes(outside: &Path) -> Vec<(&'static str, Vec<u8>)> {
    let out = outside.to_str().unwrap();
    vec![
        (
            "hard link through a symlink over an implicit dir",
            RawTar::new()
                .file("d/secret.txt", b"inside")
                .symlink("d", out)
                .hardlink("hl", "d/secret.txt")
                .finish(),
        ),
        (
            "dir mode through a symlink over an implicit dir",
            RawTar::new()
                .dir_mode("p/target.txt", 0o777)
                .symlink("p", out)
                .finish(),
        ),
        (
            "a name cut short by a NUL",
            RawTar::new()
                .file_raw(b"ok\0/../../escape.txt", b"x")
                .finish(),
        ),
    ]
}

fn assert_refused(what: &str, r: sandbox_core::Result<()>) {
    match r {
        Err(Error::UnsafeArchive { .. }) => {}
        other => panic!("{what}: expected UnsafeArchive, got {other:?}"),
    }
}

/// Nothing the probes aimed at exists in the workspace.
fn assert_no_probe_effects(root: &Path) {
    assert!(fs::symlink_metadata(root.join("hl")).is_err());
    assert!(fs::symlink_metadata(root.join("ok")).is_err());
    for name in ["d", "p"] {
        if let Ok(m) = fs::symlink_metadata(root.join(name)) {
            assert!(m.is_dir(), "`{name}` is not a directory");
        }
    }
}

/// Probe `index` of [`probes`] against a fresh box: refused, nothing outside changed, and
/// for Replace the live workspace untouched.
async fn probe(index: usize, mode: ImportMode) {
    let (b, outside) = setup().await;
    let (what, archive) = probes(&outside).swap_remove(index);
    let replace = matches!(mode, ImportMode::Replace { .. });
    let outside_before = record_with_root(&outside);
    let live_before = tree(&b.root());
    let r = b.handle().import(stream::once(archive), mode).await;
    assert_refused(what, r);
    assert_eq!(
        record_with_root(&outside),
        outside_before,
        "{what}: the outside changed"
    );
    let root = b.root();
    assert_no_probe_effects(&root);
    if replace {
        assert_eq!(
            tree(&root),
            live_before,
            "{what}: the live workspace changed"
        );
    }
    assert_eq!(
        fs::read_to_string(root.join("existing.txt")).unwrap(),
        "live"
    );
}

fn merge() -> ImportMode {
    ImportMode::Merge
}

fn replace() -> ImportMode {
    ImportMode::Replace { keep: vec![] }
}

#[tokio::test]
async fn merge_refuses_a_hard_link_through_a_symlink_over_an_implicit_dir() {
    probe(0, merge()).await;
}

#[tokio::test]
async fn merge_refuses_a_dir_mode_through_a_symlink_over_an_implicit_dir() {
    probe(1, merge()).await;
}

#[tokio::test]
async fn merge_refuses_a_name_cut_short_by_a_nul() {
    probe(2, merge()).await;
}

#[tokio::test]
async fn replace_refuses_a_hard_link_through_a_symlink_over_an_implicit_dir() {
    probe(0, replace()).await;
}

#[tokio::test]
async fn replace_refuses_a_dir_mode_through_a_symlink_over_an_implicit_dir() {
    probe(1, replace()).await;
}

#[tokio::test]
async fn replace_refuses_a_name_cut_short_by_a_nul() {
    probe(2, replace()).await;
}
