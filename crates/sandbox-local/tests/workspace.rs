//! Workspace primitives: import (Merge/Replace), export, list, read/write/remove, bind mounts.

mod common;

use std::fs;
use std::os::unix::fs::PermissionsExt as _;

use bytes::Bytes;
use common::{TestBox, names_with_prefix, rel, tar_bytes, tar_of, tree};
use futures::StreamExt as _;
use sandbox_core::stream::{self, ByteStream};
use sandbox_core::testkit::raw_tar::RawTar;
use sandbox_core::{
    CreateRequest, EntryType, Error, ExecRequest, ExportRequest, ImportMode, SandboxClient,
    WorkspaceSpec,
};
use sandbox_local::{LocalClient, LocalOptions};

/// A live workspace with files, a directory, a mode and a symlink.
async fn populated() -> TestBox {
    let b = TestBox::default().await;
    let h = b.handle();
    h.write_file(&rel("a.txt"), "alpha".into(), 0o644)
        .await
        .unwrap();
    h.write_file(&rel("dir/run.sh"), "#!/bin/sh\n".into(), 0o755)
        .await
        .unwrap();
    h.write_file(&rel("keepme/state.db"), "precious".into(), 0o600)
        .await
        .unwrap();
    std::os::unix::fs::symlink("a.txt", b.root().join("link")).unwrap();
    b
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replace_import_failing_midway_leaves_live_workspace_identical() {
    let b = populated().await;
    let before = tree(&b.root());
    assert!(before.len() >= 5, "{before:?}");

    // Valid tar bytes (one whole entry and part of the next), then the stream fails.
    let full = tar_bytes(&[("new1.txt", b"first"), ("new2.txt", &[7u8; 100_000])]).await;
    let prefix = full.slice(..512 + 512 + 512 + 4096);
    let failing: ByteStream = futures::stream::iter(vec![
        Ok(prefix),
        Err(Error::backend("test", "download", "connection dropped")),
    ])
    .boxed();
    let err = b
        .handle()
        .import(failing, ImportMode::Replace { keep: vec![] })
        .await
        .unwrap_err();
    assert!(err.to_string().contains("connection dropped"), "{err}");
    assert_eq!(tree(&b.root()), before);
    assert!(names_with_prefix(&b.box_dir(), ".staging-").is_empty());
    assert!(names_with_prefix(&b.box_dir(), ".old-").is_empty());

    // An unsafe entry after a good one: refused, live untouched as well.
    let hostile = RawTar::new()
        .file("fine.txt", b"ok")
        .file("../escape.txt", b"x")
        .finish();
    let err = b
        .handle()
        .import(stream::once(hostile), ImportMode::Replace { keep: vec![] })
        .await
        .unwrap_err();
    assert!(matches!(err, Error::UnsafeArchive { .. }), "{err}");
    assert_eq!(tree(&b.root()), before);
    assert!(!b.box_dir().join("escape.txt").exists());
    assert!(names_with_prefix(&b.box_dir(), ".staging-").is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replace_import_swaps_in_the_archive_and_keeps_keep_paths() {
    let b = populated().await;
    let kept_before = fs::read(b.root().join("keepme/state.db")).unwrap();
    b.handle()
        .import(
            tar_of(&[("new.txt", b"new"), ("keepme/from-archive", b"dropped")]),
            ImportMode::Replace {
                keep: vec![rel("keepme"), rel("not/there")],
            },
        )
        .await
        .unwrap();
    let after = tree(&b.root());
    let names: Vec<&str> = after.keys().map(String::as_str).collect();
    assert_eq!(names, ["keepme", "keepme/state.db", "new.txt"]);
    assert_eq!(
        fs::read(b.root().join("keepme/state.db")).unwrap(),
        kept_before
    );
    assert_eq!(after["keepme/state.db"].1, 0o600);
    assert!(names_with_prefix(&b.box_dir(), ".staging-").is_empty());
    assert!(names_with_prefix(&b.box_dir(), ".old-").is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn merge_never_writes_through_an_existing_outward_symlink() {
    let b = populated().await;
    let outside = b.outside();
    std::os::unix::fs::symlink(&outside, b.root().join("out")).unwrap();
    let err = b
        .handle()
        .import(tar_of(&[("out/pwn.txt", b"pwned")]), ImportMode::Merge)
        .await
        .unwrap_err();
    assert!(matches!(err, Error::UnsafeArchive { .. }), "{err}");
    assert_eq!(fs::read_dir(&outside).unwrap().count(), 0);
    assert!(
        fs::symlink_metadata(b.root().join("out"))
            .unwrap()
            .file_type()
            .is_symlink()
    );

    // A plain merge adds and overwrites, leaving the rest.
    b.handle()
        .import(
            tar_of(&[("a.txt", b"ALPHA"), ("b.txt", b"beta")]),
            ImportMode::Merge,
        )
        .await
        .unwrap();
    assert_eq!(fs::read(b.root().join("a.txt")).unwrap(), b"ALPHA");
    assert_eq!(fs::read(b.root().join("b.txt")).unwrap(), b"beta");
    assert!(b.root().join("dir/run.sh").exists());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn read_file_checks_the_resolved_path() {
    let b = populated().await;
    let h = b.handle();
    assert_eq!(&h.read_file(&rel("a.txt")).await.unwrap()[..], b"alpha");
    // An inward link is fine.
    assert_eq!(&h.read_file(&rel("link")).await.unwrap()[..], b"alpha");
    let outside = b.outside();
    fs::write(outside.join("secret"), "s3cret").unwrap();
    std::os::unix::fs::symlink(outside.join("secret"), b.root().join("leak")).unwrap();
    std::os::unix::fs::symlink(&outside, b.root().join("outdir")).unwrap();
    for p in ["leak", "outdir/secret"] {
        let err = h.read_file(&rel(p)).await.unwrap_err();
        assert!(matches!(err, Error::PathEscape { .. }), "{p}: {err}");
    }
    let err = h.read_file(&rel("missing.txt")).await.unwrap_err();
    assert!(matches!(err, Error::NotFound { what: "file", .. }), "{err}");
    let err = h.read_file(&rel("dir")).await.unwrap_err();
    assert!(matches!(err, Error::InvalidInput { .. }), "{err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn write_file_replaces_a_symlink_instead_of_following_it() {
    let b = populated().await;
    let h = b.handle();
    let outside = b.outside();
    fs::write(outside.join("target"), "original").unwrap();
    std::os::unix::fs::symlink(outside.join("target"), b.root().join("victim")).unwrap();
    h.write_file(&rel("victim"), "replaced".into(), 0o640)
        .await
        .unwrap();
    assert_eq!(
        fs::read_to_string(outside.join("target")).unwrap(),
        "original"
    );
    let meta = fs::symlink_metadata(b.root().join("victim")).unwrap();
    assert!(meta.is_file());
    assert_eq!(meta.permissions().mode() & 0o7777, 0o640);
    assert_eq!(&h.read_file(&rel("victim")).await.unwrap()[..], b"replaced");

    // Parents through an outward link are refused.
    std::os::unix::fs::symlink(&outside, b.root().join("outdir")).unwrap();
    let err = h
        .write_file(&rel("outdir/x"), "x".into(), 0o644)
        .await
        .unwrap_err();
    assert!(matches!(err, Error::PathEscape { .. }), "{err}");
    assert!(!outside.join("x").exists());
    // A name at NAME_MAX still works (the temp file's name does not grow with it).
    let long = "n".repeat(255);
    h.write_file(&rel(&long), "x".into(), 0o644).await.unwrap();
    // Set-id bits are dropped; no temp files are left behind.
    h.write_file(&rel("dir/suid"), "x".into(), 0o4755)
        .await
        .unwrap();
    let mode = fs::metadata(b.root().join("dir/suid"))
        .unwrap()
        .permissions()
        .mode();
    assert_eq!(mode & 0o7777, 0o755);
    assert!(names_with_prefix(&b.root().join("dir"), ".").is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn remove_never_follows_symlinks() {
    let b = populated().await;
    let h = b.handle();
    let outside = b.outside();
    fs::write(outside.join("keep.txt"), "stay").unwrap();
    std::os::unix::fs::symlink(&outside, b.root().join("outdir")).unwrap();

    let err = h.remove(&[rel("outdir/keep.txt")]).await.unwrap_err();
    assert!(matches!(err, Error::PathEscape { .. }), "{err}");
    assert!(outside.join("keep.txt").exists());

    // Removing the link removes the link, not what it points to.
    h.remove(&[
        rel("outdir"),
        rel("dir"),
        rel("missing"),
        rel("a.txt/under-a-file"),
    ])
    .await
    .unwrap();
    assert!(fs::symlink_metadata(b.root().join("outdir")).is_err());
    assert!(!b.root().join("dir").exists());
    assert!(outside.join("keep.txt").exists());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn export_list_and_import_round_trip() {
    let b = populated().await;
    let h = b.handle();
    h.write_file(&rel("cache/big.bin"), Bytes::from(vec![1u8; 10_000]), 0o644)
        .await
        .unwrap();
    h.write_file(&rel("x.log"), "log".into(), 0o644)
        .await
        .unwrap();

    let listed = h.list().await.unwrap();
    let kinds: Vec<(&str, EntryType)> = listed.iter().map(|e| (e.path.as_str(), e.kind)).collect();
    assert!(kinds.contains(&("link", EntryType::Symlink)), "{kinds:?}");
    assert!(kinds.contains(&("dir", EntryType::Dir)));
    let run = listed
        .iter()
        .find(|e| e.path.as_str() == "dir/run.sh")
        .unwrap();
    assert_eq!(run.mode, 0o755);
    assert_eq!(run.size, 10);

    let mut request = ExportRequest::default();
    request.exclude = vec![rel("cache")];
    request.exclude_globs = vec!["*.log".into()];
    let exported = h.export(&request).await.unwrap();

    let other = TestBox::default().await;
    other
        .handle()
        .import(exported, ImportMode::Replace { keep: vec![] })
        .await
        .unwrap();
    let mut expected = tree(&b.root());
    expected.retain(|k, _| !k.starts_with("cache") && !k.ends_with(".log"));
    assert_eq!(tree(&other.root()), expected);

    // Only some paths.
    let mut request = ExportRequest::default();
    request.paths = Some(vec![rel("dir"), rel("absent")]);
    let only = stream::collect(h.export(&request).await.unwrap(), 1 << 20)
        .await
        .unwrap();
    let third = TestBox::default().await;
    third
        .handle()
        .import(stream::once(only), ImportMode::Replace { keep: vec![] })
        .await
        .unwrap();
    let names: Vec<String> = tree(&third.root()).into_keys().collect();
    assert_eq!(names, ["dir", "dir/run.sh"]);

    // A requested path under an outward symlink is refused, not packed from outside.
    let outside = b.outside();
    fs::write(outside.join("secret"), "s3cret").unwrap();
    std::os::unix::fs::symlink(&outside, b.root().join("outdir")).unwrap();
    let mut request = ExportRequest::default();
    request.paths = Some(vec![rel("outdir/secret")]);
    let err = h.export(&request).await.err().unwrap();
    assert!(matches!(err, Error::PathEscape { .. }), "{err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn read_write_bind_mount_is_a_link_that_survives_replace() {
    let host = tempfile::tempdir().unwrap();
    fs::write(host.path().join("shared.txt"), "from host").unwrap();
    let spec = WorkspaceSpec::builder()
        .file("README.md", "hi")
        .bind_mount("mnt/data", host.path(), false)
        .build()
        .unwrap();
    let b = TestBox::new(LocalOptions::default(), spec.clone()).await;
    let link = b.root().join("mnt/data");
    assert_eq!(fs::read_link(&link).unwrap(), host.path());

    // Commands and the file primitives reach the host directory through the link.
    let r = b
        .sandbox
        .exec(
            ExecRequest::shell("cat mnt/data/shared.txt; echo written > mnt/data/new.txt").cwd("."),
        )
        .await
        .unwrap();
    assert_eq!(r.stdout_str(), "from host");
    assert_eq!(
        fs::read_to_string(host.path().join("new.txt")).unwrap(),
        "written\n"
    );
    assert_eq!(
        &b.handle()
            .read_file(&rel("mnt/data/shared.txt"))
            .await
            .unwrap()[..],
        b"from host"
    );
    let r = b
        .sandbox
        .exec(ExecRequest::argv(["pwd"]).cwd("mnt/data"))
        .await
        .unwrap();
    assert!(r.success(), "{r:?}");

    // A Replace without the link in the archive (and without it in `keep`) gets it back.
    b.handle()
        .import(
            tar_of(&[("other.txt", b"o")]),
            ImportMode::Replace { keep: vec![] },
        )
        .await
        .unwrap();
    assert_eq!(fs::read_link(&link).unwrap(), host.path());
    assert!(host.path().join("shared.txt").exists());

    // A link removed by a command comes back at the next boot.
    fs::remove_file(&link).unwrap();
    b.handle().boot().await.unwrap();
    assert_eq!(fs::read_link(&link).unwrap(), host.path());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bind_mount_paths_resolve_beneath_the_declared_host_directory() {
    let host = tempfile::tempdir().unwrap();
    fs::write(host.path().join("shared.txt"), "from host").unwrap();
    let spec = WorkspaceSpec::builder()
        .bind_mount("mnt/data", host.path(), false)
        .build()
        .unwrap();
    let b = TestBox::new(LocalOptions::default(), spec).await;
    let h = b.handle();
    // Writes and removes under the mount reach the host directory.
    h.write_file(&rel("mnt/data/sub/new.txt"), "new".into(), 0o644)
        .await
        .unwrap();
    assert_eq!(
        fs::read_to_string(host.path().join("sub/new.txt")).unwrap(),
        "new"
    );
    h.remove(&[rel("mnt/data/sub")]).await.unwrap();
    assert!(!host.path().join("sub").exists());
    // An absolute link back into the workspace is followed for reads.
    std::os::unix::fs::symlink(b.root().join("README.md"), b.root().join("abs_in")).unwrap();
    h.write_file(&rel("README.md"), "readme".into(), 0o644)
        .await
        .unwrap();
    assert_eq!(&h.read_file(&rel("abs_in")).await.unwrap()[..], b"readme");
    // Another absolute link into the host directory is followed for reads.
    std::os::unix::fs::symlink(host.path().join("shared.txt"), b.root().join("alias")).unwrap();
    assert_eq!(&h.read_file(&rel("alias")).await.unwrap()[..], b"from host");
    // The bind link re-pointed elsewhere redirects nothing: paths under the mount still
    // resolve beneath the declared host directory.
    let outside = b.outside();
    fs::write(outside.join("shared.txt"), "outside").unwrap();
    let link = b.root().join("mnt/data");
    fs::remove_file(&link).unwrap();
    std::os::unix::fs::symlink(&outside, &link).unwrap();
    assert_eq!(
        &h.read_file(&rel("mnt/data/shared.txt")).await.unwrap()[..],
        b"from host"
    );
    h.write_file(&rel("mnt/data/shared.txt"), "written".into(), 0o644)
        .await
        .unwrap();
    assert_eq!(
        fs::read_to_string(outside.join("shared.txt")).unwrap(),
        "outside"
    );
    // Anything else through that link stays refused.
    std::os::unix::fs::symlink(outside.join("shared.txt"), b.root().join("leak")).unwrap();
    let err = h.read_file(&rel("leak")).await.unwrap_err();
    assert!(matches!(err, Error::PathEscape { .. }), "{err}");
    // Removing the mount's own path removes the link, not the host directory.
    h.remove(&[rel("mnt/data")]).await.unwrap();
    assert!(fs::symlink_metadata(&link).is_err());
    assert!(host.path().join("shared.txt").exists());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn read_only_bind_mounts_and_custom_roots_are_not_supported() {
    let dir = tempfile::tempdir().unwrap();
    let client = LocalClient::new(
        LocalOptions::default()
            .isolation(sandbox_local::Isolation::HostShell)
            .base_dir(dir.path()),
    );
    let ro = WorkspaceSpec::builder()
        .bind_mount("data", "/srv", true)
        .build()
        .unwrap();
    let err = client
        .create(CreateRequest::new(&ro, None))
        .await
        .unwrap_err();
    assert!(
        matches!(
            err,
            Error::NotSupported {
                backend: "local",
                operation: "read-only bind mount"
            }
        ),
        "{err}"
    );
    let ok = client
        .create(CreateRequest::new(&WorkspaceSpec::default(), None))
        .await
        .unwrap();
    let err = client.resume(&*ok.state(), &ro).await.unwrap_err();
    assert!(matches!(err, Error::NotSupported { .. }), "{err}");

    let rooted = WorkspaceSpec::builder().root("/workspace").build().unwrap();
    let err = client
        .create(CreateRequest::new(&rooted, None))
        .await
        .unwrap_err();
    assert!(matches!(err, Error::NotSupported { .. }), "{err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn primitives_on_a_missing_workspace_say_so() {
    let b = TestBox::default().await;
    fs::remove_dir_all(b.root()).unwrap();
    let h = b.handle();
    assert!(!h.workspace_exists().await.unwrap());
    assert!(matches!(
        h.list().await.unwrap_err(),
        Error::NotFound {
            what: "workspace",
            ..
        }
    ));
    assert!(matches!(
        h.export(&ExportRequest::default()).await.err().unwrap(),
        Error::NotFound {
            what: "workspace",
            ..
        }
    ));
    assert!(matches!(
        h.write_file(&rel("x"), "x".into(), 0o644)
            .await
            .unwrap_err(),
        Error::NotFound {
            what: "workspace",
            ..
        }
    ));
    h.remove(&[rel("x")]).await.unwrap();
    // Merge creates the workspace.
    h.import(tar_of(&[("x", b"1")]), ImportMode::Merge)
        .await
        .unwrap();
    assert!(h.workspace_exists().await.unwrap());
}
