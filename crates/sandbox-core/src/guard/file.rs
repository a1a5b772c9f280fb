//! [`FileGuard`]: leases shared by the processes of one host, as small files under a directory.
//!
//! One lease record per key (`<dir>/<key>.lease`: owner, fencing token, expiry), read and
//! written under an exclusive `flock` of `<dir>/<key>.lease.lock` held only for the few
//! microseconds of the read-modify-write. A lease has a time to live and is renewed by a
//! background task at a third of it; a holder that cannot renew before its expiry (its process
//! was paused, the disk hung) counts its lease as lost, and another process may take the key
//! over with a higher token. This is the same model as a distributed lease (Redis `SET NX PX`),
//! so a process that dies holding a key delays the next holder by at most the TTL.
//!
//! Tokens come from a counter kept in the record (never reset by a release), seeded from the
//! clock in microseconds: they increase per key across processes and restarts, and they start
//! above any counter a state store issued on its own before this guard was used.

use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use async_trait::async_trait;
use serde::{Deserialize, Serialize};
use tokio_util::sync::CancellationToken;

use super::{Lease, LeaseHandle, SandboxExecutionGuard};
use crate::error::{Error, Result};
use crate::isolation::IsolationKey;
use crate::reach::Reach;

/// Options of [`FileGuard`].
///
/// | option | default |
/// | --- | --- |
/// | [`ttl`](Self::ttl) | 30 s |
/// | [`wait`](Self::wait) | 10 min |
/// | [`retry`](Self::retry) | 20 ms, doubling to 1 s, ±50 % jitter |
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct FileGuardOptions {
    /// How long a lease lives without renewal; renewed every third of it.
    pub ttl: Duration,
    /// Longest wait in [`SandboxExecutionGuard::enter`] before [`Error::Timeout`].
    pub wait: Duration,
    /// First pause between attempts on a held key (doubles up to `max_retry`, with jitter).
    pub retry: Duration,
    /// Longest pause between attempts.
    pub max_retry: Duration,
}

impl Default for FileGuardOptions {
    fn default() -> Self {
        FileGuardOptions {
            ttl: Duration::from_secs(30),
            wait: Duration::from_secs(600),
            retry: Duration::from_millis(20),
            max_retry: Duration::from_secs(1),
        }
    }
}

impl FileGuardOptions {
    /// Set the lease time to live (at least 30 ms).
    pub fn ttl(mut self, ttl: Duration) -> Self {
        self.ttl = ttl.max(Duration::from_millis(30));
        self
    }

    /// Set the longest wait for a held key.
    pub fn wait(mut self, wait: Duration) -> Self {
        self.wait = wait;
        self
    }

    /// Set the first and the longest pause between attempts.
    pub fn retry(mut self, first: Duration, max: Duration) -> Self {
        self.retry = first.max(Duration::from_millis(1));
        self.max_retry = max.max(self.retry);
        self
    }
}

/// Leases for the processes of one host, kept as files under a directory (see the module
/// docs). Several processes sharing a [`crate::FileStateStore`] use one `FileGuard` directory.
#[derive(Debug, Clone)]
pub struct FileGuard {
    dir: Arc<PathBuf>,
    options: FileGuardOptions,
}

/// The lease record of one key.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
struct Record {
    /// The holder's random id; `None` when free.
    owner: Option<String>,
    /// The last token granted (the counter).
    token: u64,
    /// When the holder's lease ends unless renewed, ms since the epoch.
    expires_unix_ms: i64,
}

fn now_ms() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as i64)
}

fn now_us() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_micros() as u64)
}

impl FileGuard {
    /// A guard keeping its records under `dir` (created on first use), default options.
    pub fn new(dir: impl Into<PathBuf>) -> Self {
        FileGuard {
            dir: Arc::new(dir.into()),
            options: FileGuardOptions::default(),
        }
    }

    /// Set the options.
    pub fn options(mut self, options: FileGuardOptions) -> Self {
        self.options = options;
        self
    }

    fn record_path(&self, key: &IsolationKey) -> PathBuf {
        // Key components are percent-encoded and never start with `.`: this stays under dir.
        self.dir.join(format!("{}.lease", key.as_str()))
    }

    /// One attempt: take the key if free or expired.
    async fn attempt(&self, key: &IsolationKey) -> Result<Option<Lease>> {
        let path = self.record_path(key);
        let owner = uuid::Uuid::new_v4().simple().to_string();
        let ttl_ms = self.options.ttl.as_millis() as i64;
        let me = owner.clone();
        let granted = blocking(move || {
            let busy = |e: Error| match e {
                // A stalled process sits in the record's lock: the key counts as held.
                Error::Timeout { .. } => Ok(None),
                e => Err(e),
            };
            update(&path, |rec| {
                let now = now_ms();
                if rec.owner.is_some() && rec.expires_unix_ms > now {
                    return None;
                }
                rec.owner = Some(me);
                rec.token = (rec.token + 1).max(now_us());
                rec.expires_unix_ms = now + ttl_ms;
                Some(rec.token)
            })
            .or_else(busy)
        })
        .await?;
        let Some(token) = granted else {
            return Ok(None);
        };
        let lost = CancellationToken::new();
        let shared = Arc::new(Held {
            path: self.record_path(key),
            owner,
            token,
            // Counted from before the grant was written: never later than the record's.
            deadline: Mutex::new(Instant::now() + self.options.ttl),
        });
        let renewal = tokio::spawn(renew(shared.clone(), self.options.ttl, lost.clone()));
        Ok(Some(
            Lease::new(
                key.clone(),
                Some(token),
                Box::new(FileLease {
                    held: shared,
                    renewal: Some(renewal),
                    lost: lost.clone(),
                }),
            )
            .with_lost_signal(lost),
        ))
    }
}

/// What a holder knows of its lease.
#[derive(Debug)]
struct Held {
    path: PathBuf,
    owner: String,
    token: u64,
    /// Until when the lease is certainly ours (the last successful renewal's start + TTL).
    deadline: Mutex<Instant>,
}

impl Held {
    fn ours(&self, rec: &Record) -> bool {
        rec.owner.as_deref() == Some(self.owner.as_str()) && rec.token == self.token
    }
}

async fn renew(held: Arc<Held>, ttl: Duration, lost: CancellationToken) {
    let every = ttl / 3;
    loop {
        tokio::select! {
            () = lost.cancelled() => return,
            () = tokio::time::sleep(every) => {}
        }
        let started = Instant::now();
        if started >= *held.deadline.lock().expect("deadline lock") {
            // Renewing too late: someone may already hold the key.
            tracing::warn!(path = %held.path.display(), "lease expired before it could be renewed");
            lost.cancel();
            return;
        }
        let h = held.clone();
        let ttl_ms = ttl.as_millis() as i64;
        let renewed = blocking(move || {
            update(&h.path, |rec| {
                if h.ours(rec) {
                    rec.expires_unix_ms = now_ms() + ttl_ms;
                    Some(())
                } else {
                    None
                }
            })
        })
        .await;
        match renewed {
            Ok(Some(())) => *held.deadline.lock().expect("deadline lock") = started + ttl,
            Ok(None) => {
                tracing::warn!(path = %held.path.display(), "lease taken over by another holder");
                lost.cancel();
                return;
            }
            // A failed renewal is retried until the deadline passes.
            Err(e) => {
                tracing::warn!(path = %held.path.display(), error = %e, "lease renewal failed")
            }
        }
    }
}

struct FileLease {
    held: Arc<Held>,
    renewal: Option<tokio::task::JoinHandle<()>>,
    lost: CancellationToken,
}

impl fmt::Debug for FileLease {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("FileLease")
            .field("path", &self.held.path)
            .field("token", &self.held.token)
            .finish()
    }
}

impl FileLease {
    fn stop_renewal(&mut self) {
        if let Some(task) = self.renewal.take() {
            task.abort();
        }
    }
}

fn free(held: &Held) -> Result<()> {
    update(&held.path, |rec| {
        if held.ours(rec) {
            rec.owner = None;
            rec.expires_unix_ms = 0;
        }
        Some(())
    })
    .map(|_| ())
}

#[async_trait]
impl LeaseHandle for FileLease {
    fn is_lost(&self) -> bool {
        self.lost.is_cancelled()
            || Instant::now() >= *self.held.deadline.lock().expect("deadline lock")
    }

    async fn release(&mut self) -> Result<()> {
        self.stop_renewal();
        let held = self.held.clone();
        blocking(move || free(&held)).await
    }

    fn release_detached(&mut self) {
        self.stop_renewal();
        let held = self.held.clone();
        match tokio::runtime::Handle::try_current() {
            Ok(rt) => {
                rt.spawn_blocking(move || {
                    if let Err(e) = free(&held) {
                        tracing::warn!(error = %e, "releasing a dropped lease failed; it expires by itself");
                    }
                });
            }
            // No runtime: the record is small and the lock is held for microseconds.
            Err(_) => {
                let _ = free(&held);
            }
        }
    }
}

impl Drop for FileLease {
    fn drop(&mut self) {
        self.stop_renewal();
    }
}

#[async_trait]
impl SandboxExecutionGuard for FileGuard {
    async fn enter(&self, key: &IsolationKey) -> Result<Lease> {
        let started = Instant::now();
        let mut pause = self.options.retry;
        loop {
            if let Some(lease) = self.attempt(key).await? {
                return Ok(lease);
            }
            let waited = started.elapsed();
            if waited >= self.options.wait {
                return Err(Error::Timeout {
                    operation: format!("waiting for the lease on {key}"),
                    after: waited,
                });
            }
            // Jitter spreads waiters out so they do not retry in lockstep.
            let jittered = pause.mul_f64(0.5 + fastrand::f64());
            tokio::time::sleep(jittered.min(self.options.wait - waited)).await;
            pause = (pause * 2).min(self.options.max_retry);
        }
    }

    async fn try_enter(&self, key: &IsolationKey) -> Result<Option<Lease>> {
        self.attempt(key).await
    }

    fn reach(&self) -> Reach {
        Reach::Host
    }
}

async fn blocking<T: Send + 'static>(f: impl FnOnce() -> Result<T> + Send + 'static) -> Result<T> {
    tokio::task::spawn_blocking(f)
        .await
        .map_err(|e| Error::backend("file-guard", "lease", e.to_string()))?
}

/// How long [`update`] waits for the record's lock before giving up: a holder that was
/// stopped inside its (microseconds long) critical section must not stall everyone.
const LOCK_WAIT: Duration = Duration::from_secs(2);

/// Read the record at `path`, let `f` change it, and write it back if `f` returns `Some` —
/// all under the key's `flock`.
///
/// The write is not fsynced: a record only matters while its holder's process lives, and a
/// crash that could lose the write (power loss, kernel panic) ends every holder of this host.
/// After such a crash the record may be the previous one, or empty (renamed before its data
/// reached the disk): an empty or unreadable record counts as free, and the next token, seeded
/// from the clock, still exceeds every token granted before (the fence the state store keeps
/// durably is what stops a stale holder). The directory is created only when the lock file
/// cannot be opened for its absence, so a call costs no `mkdir`.
fn update<T>(path: &Path, f: impl FnOnce(&mut Record) -> Option<T>) -> Result<Option<T>> {
    let parent = path.parent().expect("lease paths have a parent");
    let lock_path = path.with_extension("lease.lock");
    let mut file = crate::durable::in_dir(parent, false, || {
        std::fs::OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(&lock_path)
    })
    .map_err(|e| Error::io(&lock_path, e))?;
    let started = Instant::now();
    let _lock = loop {
        match nix::fcntl::Flock::lock(file, nix::fcntl::FlockArg::LockExclusiveNonblock) {
            Ok(lock) => break lock,
            Err((f, nix::errno::Errno::EWOULDBLOCK)) if started.elapsed() < LOCK_WAIT => {
                file = f;
                std::thread::sleep(Duration::from_millis(1));
            }
            Err((_, nix::errno::Errno::EWOULDBLOCK)) => {
                return Err(Error::Timeout {
                    operation: format!("locking the lease record {}", lock_path.display()),
                    after: started.elapsed(),
                });
            }
            Err((_, e)) => return Err(Error::io(&lock_path, e.into())),
        }
    };
    let mut rec = match std::fs::read(path) {
        Ok(bytes) => serde_json::from_slice(&bytes).unwrap_or_else(|e| {
            tracing::warn!(path = %path.display(), error = %e, "unreadable lease record (left by a crash): counted as free");
            Record::default()
        }),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Record::default(),
        Err(e) => return Err(Error::io(path, e)),
    };
    let out = f(&mut rec);
    if out.is_some() {
        let bytes = serde_json::to_vec(&rec).expect("record serializes");
        crate::durable::replace(path, &bytes, crate::durable::Sync::Nothing)
            .map_err(|e| Error::io(path, e))?;
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testkit::guards;

    fn guard(dir: &Path) -> FileGuard {
        FileGuard::new(dir).options(
            FileGuardOptions::default()
                .ttl(Duration::from_millis(600))
                .retry(Duration::from_millis(5), Duration::from_millis(50)),
        )
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn file_guard_passes_the_guard_suite() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().to_path_buf();
        // Each instance stands for another process: they share only the directory.
        guards::suite(&move || Arc::new(guard(&path)) as Arc<dyn SandboxExecutionGuard>).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_paused_holder_loses_its_lease_to_a_higher_token() {
        let dir = tempfile::tempdir().unwrap();
        let key = guards::key("paused");
        let (path, k) = (dir.path().to_path_buf(), key.clone());
        // Holder A runs on its own runtime, which is then blocked: its renewal cannot run, as
        // if its process were stopped.
        let (tx, rx) = std::sync::mpsc::channel();
        let (resume_tx, resume_rx) = std::sync::mpsc::channel::<()>();
        let a = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap();
            rt.block_on(async {
                let lease = guard(&path).enter(&k).await.unwrap();
                tx.send(lease.token().unwrap()).unwrap();
                resume_rx.recv().unwrap(); // blocks the runtime: no renewal
                // Resumed: its next renewal (or the expiry it overslept) finds the key taken.
                let deadline = std::time::Instant::now() + Duration::from_secs(5);
                while !lease.is_lost() && std::time::Instant::now() < deadline {
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
                (lease.token().unwrap(), lease.is_lost())
            })
        });
        let a_token = rx.recv().unwrap();
        let b = tokio::time::timeout(Duration::from_secs(5), guard(dir.path()).enter(&key))
            .await
            .expect("B takes the key once A's lease expired")
            .unwrap();
        assert!(b.token().unwrap() > a_token);
        resume_tx.send(()).unwrap();
        let (_, a_lost) = a.join().unwrap();
        assert!(a_lost, "A learns it lost its lease once it resumes");
        b.release().await.unwrap();
    }

    #[tokio::test]
    async fn a_bounded_wait_times_out_with_a_typed_error() {
        let dir = tempfile::tempdir().unwrap();
        let key = guards::key("bounded");
        let holder = FileGuard::new(dir.path()).enter(&key).await.unwrap();
        let waiter = FileGuard::new(dir.path()).options(
            FileGuardOptions::default()
                .wait(Duration::from_millis(150))
                .retry(Duration::from_millis(5), Duration::from_millis(20)),
        );
        let err = waiter.enter(&key).await.unwrap_err();
        assert!(matches!(err, Error::Timeout { .. }), "{err}");
        holder.release().await.unwrap();
        waiter.enter(&key).await.unwrap();
    }

    /// Records are not fsynced, so a crash may leave one empty (renamed before its data was
    /// written) or garbled: it counts as free, and the next token still exceeds the old ones.
    #[tokio::test]
    async fn a_record_left_empty_by_a_crash_counts_as_free() {
        let dir = tempfile::tempdir().unwrap();
        let key = guards::key("crashed");
        let g = FileGuard::new(dir.path());
        let first = g.enter(&key).await.unwrap();
        let t1 = first.token().unwrap();
        drop(first); // its process "crashed": the lease is not released
        let record = g.record_path(&key);
        for damage in [&b""[..], b"{\"owner\":\"ab"] {
            std::fs::write(&record, damage).unwrap();
            let next = tokio::time::timeout(Duration::from_secs(5), g.enter(&key))
                .await
                .expect("a damaged record does not hold the key")
                .unwrap();
            assert!(next.token().unwrap() > t1);
            next.release().await.unwrap();
        }
    }

    #[tokio::test]
    async fn tokens_start_above_small_counters_and_survive_release() {
        let dir = tempfile::tempdir().unwrap();
        let key = guards::key("tokens");
        let g = FileGuard::new(dir.path());
        let first = g.enter(&key).await.unwrap();
        let t1 = first.token().unwrap();
        assert!(t1 > 1_000_000_000_000, "seeded from the clock: {t1}");
        first.release().await.unwrap();
        let second = FileGuard::new(dir.path()).enter(&key).await.unwrap();
        assert!(second.token().unwrap() > t1);
    }
}
