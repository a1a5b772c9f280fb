//! The agent filesystem is reachable through the facade (feature `fs`).

#![cfg(feature = "fs")]

use sandbox_harness::fs::{Filesystem as _, FilesystemExt as _, LocalFs, LocalOptions};

#[tokio::test]
async fn local_fs_writes_and_its_shell_sees_the_file() {
    let project = tempfile::tempdir().unwrap();
    let fs = LocalFs::new(LocalOptions::default().project(project.path())).unwrap();
    fs.write("note.txt", "hi\n".into()).await.unwrap();
    assert_eq!(&fs.read("note.txt").await.unwrap()[..], b"hi\n");
    // The workspace is the upper layer; the shell runs in the project, `HOME` is the workspace.
    let r = fs.execute("cat \"$HOME/note.txt\"", None).await.unwrap();
    assert!(r.success(), "{r:?}");
    assert_eq!(r.stdout_str(), "hi\n");
}
