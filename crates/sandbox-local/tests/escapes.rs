//! Everything a command starts dies with it: eight ways of leaving a process behind
//! (background jobs, daemons, new sessions and process groups), each after a timeout, a normal
//! exit and a cancelled exec (the escapes and the driver: `sandbox_core::testkit::escapes`),
//! on the host shell (`Isolation::HostShell`: the driver checks host pids). The confined
//! box's version is in `escape.rs`.

mod common;

use common::TestBox;
use sandbox_core::ExecRequest;
use sandbox_core::WorkspaceSpec;
use sandbox_core::host::tree_kill;
use sandbox_core::testkit::escapes::{ESCAPES, End, survivors};
use sandbox_local::{Isolation, LocalOptions};

async fn check(end: End) {
    let b = TestBox::new(
        LocalOptions::default().isolation(Isolation::HostShell),
        WorkspaceSpec::default(),
    )
    .await;
    let survived = survivors(&b.root(), end, |script, timeout| {
        b.sandbox.exec(ExecRequest::shell(script).timeout(timeout))
    })
    .await;
    let mode = tree_kill();
    eprintln!(
        "tree kill {}: {end:?}: survived {survived:?}",
        mode.as_str()
    );
    if mode.kills_escaped() {
        assert!(survived.is_empty(), "{end:?}: survived: {survived:?}");
    } else {
        // Process groups only: what stays in the group dies, the rest may survive.
        for name in &survived {
            let escape = ESCAPES.iter().find(|e| e.name == *name).unwrap();
            assert!(
                escape.leaves_group,
                "{end:?}: {name} survived a process-group kill"
            );
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn everything_dies_on_timeout() {
    check(End::Timeout).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn everything_dies_on_exit() {
    check(End::Exit).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn everything_dies_on_cancel() {
    check(End::Cancel).await;
}
