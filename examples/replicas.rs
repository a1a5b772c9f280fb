//! Two replicas, one Redis: each call on a key may land on any replica and continues the work
//! of the one before. Both replicas live in this process, but share nothing except what a
//! deployment's replicas would share: Redis (leases and states, through
//! `redis_distributed(url)`) and a snapshot directory every host mounts. Each has its own
//! client, base directory and Redis connections.
//!
//! ```text
//! redis-server --port 6379 --save "" --appendonly yes &
//! cargo run --example replicas --features redis            # REDIS_URL=redis://… for another server
//! ```
//!
//! Four calls on one USER key alternate between the replicas; each appends a line to
//! `journal.txt` and prints the journal it sees and its fencing token. The key is a fresh user
//! per run, deleted at the end (its fence stays in Redis: tokens never go backwards). Exits 0
//! only if every call saw all the lines before its own, with increasing tokens; 2 if Redis is
//! not reachable.

use std::path::Path;
use std::process::ExitCode;
use std::sync::Arc;

use sandbox_harness::local::{LocalClient, LocalOptions};
use sandbox_harness::{
    Acquire, CallContext, ErrorKind, ExecRequest, IsolationScope, LocalDirSnapshotStore,
    Persistence, SandboxConfig, SandboxManager, WorkspaceSpec, redis_distributed,
};

const CALLS: usize = 4;

/// One replica: its own local client (boxes under `root/<name>/`) and Redis connections;
/// the snapshot directory is the one every replica reads.
fn replica(root: &Path, name: &str, url: &str) -> sandbox_harness::Result<SandboxManager> {
    let client = LocalClient::new(
        LocalOptions::default()
            .base_dir(root.join(name))
            // A box lives for one call; the next call restores the workspace from the
            // snapshot, whichever replica it runs on.
            .persistence(Persistence::Ephemeral),
    );
    let shared = redis_distributed(url)?.snapshots(Arc::new(
        LocalDirSnapshotStore::shared_by_all_hosts(root.join("snapshots")),
    ));
    SandboxManager::builder(Arc::new(client))
        .scope(IsolationScope::User)
        .config(SandboxConfig::new(WorkspaceSpec::default()))
        // Guard, state store and snapshots every replica shares; `build` refuses the set-up
        // if any of them is not (require_distributed).
        .distributed(shared)
        .build()
}

/// What one call saw.
struct Step {
    token: Option<u64>,
    journal: Vec<String>,
}

/// One call through `begin`/`finish` (rather than `call`), to read the call's fencing token.
async fn step(
    replica: &SandboxManager,
    ctx: &CallContext,
    line: &str,
) -> sandbox_harness::Result<Step> {
    let call = replica.begin(ctx, Acquire::Auto).await?;
    let token = call.fencing_token();
    let branch = call.start_report().map(|s| s.branch.to_string());
    let exec = call
        .sandbox()
        .exec(ExecRequest::shell(format!(
            "echo '{line}' >> journal.txt && cat journal.txt"
        )))
        .await;
    // Snapshot, save the state (fenced by the token), release: also if the exec failed.
    let report = call.finish().await?;
    let journal: Vec<String> = exec?.stdout_str().lines().map(str::to_owned).collect();
    println!(
        "  fencing token {} · {} · state saved: {}",
        token.map_or_else(|| "-".to_owned(), |t| t.to_string()),
        branch.as_deref().unwrap_or("no start"),
        report.persisted
    );
    for l in &journal {
        println!("    journal.txt │ {l}");
    }
    Ok(Step { token, journal })
}

/// The URL without its password, for messages.
fn shown(url: &str) -> String {
    match (url.split_once("://"), url.rsplit_once('@')) {
        (Some((scheme, _)), Some((_, host))) => format!("{scheme}://***@{host}"),
        _ => url.to_owned(),
    }
}

#[tokio::main]
async fn main() -> ExitCode {
    let url = std::env::var("REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379".to_owned());
    let root = Path::new(".sandbox/replicas");
    let replicas = match (replica(root, "a", &url), replica(root, "b", &url)) {
        (Ok(a), Ok(b)) => [("a", a), ("b", b)],
        (Err(e), _) | (_, Err(e)) => {
            eprintln!("cannot set up the replicas: {e}");
            return ExitCode::FAILURE;
        }
    };
    // A fresh user per run: runs never see each other's journal.
    let user = format!("alice-{}", &uuid::Uuid::new_v4().simple().to_string()[..8]);
    let ctx = CallContext::new("replicas-example").user(&user);
    println!(
        "two replicas (a, b) sharing {} and the snapshots in {}/snapshots/; key: user {user}\n",
        shown(&url),
        root.display()
    );

    let mut tokens = Vec::new();
    let mut ok = true;
    for n in 1..=CALLS {
        let (name, manager) = &replicas[(n - 1) % 2];
        let line = format!("call {n} on replica {name}");
        println!("call {n} · replica {name}");
        match step(manager, &ctx, &line).await {
            Ok(step) => {
                let expected: Vec<String> = (1..=n)
                    .map(|i| format!("call {i} on replica {}", replicas[(i - 1) % 2].0))
                    .collect();
                if step.journal != expected {
                    println!("  ✗ expected the lines of calls 1..={n}, in order");
                    ok = false;
                }
                tokens.push(step.token);
            }
            Err(e) if matches!(e.kind(), ErrorKind::Unavailable | ErrorKind::Timeout) => {
                eprintln!(
                    "\nRedis is not reachable: {e}\nStart one with\n    \
                     redis-server --port 6379 --save \"\" --appendonly yes &\nor point \
                     REDIS_URL at yours."
                );
                return ExitCode::from(2);
            }
            Err(e) => {
                eprintln!("  call {n} failed: {e}");
                return ExitCode::FAILURE;
            }
        }
    }
    let increasing = tokens
        .windows(2)
        .all(|w| matches!((w[0], w[1]), (Some(a), Some(b)) if a < b));
    println!();
    println!(
        "{} every call saw the lines of the calls before it, on either replica",
        if ok { "✓" } else { "✗" }
    );
    println!(
        "{} fencing tokens increase from call to call: a replica holding an older token \
         can no longer save",
        if increasing { "✓" } else { "✗" }
    );

    // Clean up through the replica that ran the last call: its state names a box of its
    // base directory.
    let (name, last) = &replicas[(CALLS - 1) % 2];
    match last.delete(&ctx).await {
        Ok(report) => println!(
            "deleted user {user} through replica {name}: state {}, {} snapshot(s) (the fence \
             stays in Redis)",
            if report.state { "removed" } else { "none" },
            report.snapshots
        ),
        Err(e) => {
            eprintln!("deleting user {user} failed: {e}");
            ok = false;
        }
    }
    if ok && increasing {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}
