//! The limits of the file tools, and running their work off the async workers.
//!
//! Every tool is linear in its input (or bounded by one of these limits), and the work that
//! scans text, matches globs or walks directories runs on a blocking thread
//! ([`off_worker`]) with a [`Cancel`] flag that the caller's future raises when it is dropped
//! (a `tokio::time::timeout` that fired, a cancelled call): the loops check it and stop, so
//! a dropped call stops its work instead of running on unseen.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use sandbox_core::{Error, Result};

/// Largest file the text operations (`read_text`, `edit`, `grep`, the `read_file`,
/// `edit_file`, `grep_files` and `write_file` tools) hold in memory: 64 MiB. A larger file
/// is refused with [`Error::LimitExceeded`] before it is read; an edit whose result would be
/// larger is refused before it is built.
pub const MAX_TEXT_BYTES: u64 = 64 << 20;

/// Longest grep pattern, in bytes (before escaping).
pub const MAX_PATTERN_BYTES: usize = 16 << 10;

/// Most memory a compiled grep pattern may take (the regex crate's `size_limit`); a pattern
/// over it is [`Error::LimitExceeded`].
pub const REGEX_SIZE_LIMIT: usize = 1 << 20;

/// Most memory of the lazy DFA cache of a grep pattern (the regex crate's `dfa_size_limit`).
pub const REGEX_DFA_SIZE_LIMIT: usize = 2 << 20;

/// Matches of a non-unique `old_string` counted before the error says "at least".
pub const MAX_COUNTED_MATCHES: usize = 1000;

/// Line numbers an [`EditOutcome`](crate::EditOutcome) lists (the first ones).
pub const MAX_EDIT_LINES: usize = 1000;

/// Entries `list_files` shows by default.
pub const MAX_LIST_ENTRIES: usize = 1000;

/// Text up to this size is searched on the async worker (bounded work); larger texts go to a
/// blocking thread.
pub(crate) const INLINE_BYTES: usize = 64 << 10;

/// Work between two looks at the [`Cancel`] flag in byte scans.
pub(crate) const SCAN_CHUNK: usize = 1 << 20;

/// Raised when the future waiting for some work is dropped; the work checks it in its loops.
#[derive(Debug, Clone, Default)]
pub(crate) struct Cancel(Arc<AtomicBool>);

impl Cancel {
    /// A flag that is not raised.
    pub(crate) fn new() -> Self {
        Cancel::default()
    }

    /// Whether the caller went away.
    pub(crate) fn is_cancelled(&self) -> bool {
        self.0.load(Ordering::Relaxed)
    }

    /// `Err` once the caller went away (nobody sees the error: it ends the work).
    pub(crate) fn check(&self) -> Result<()> {
        if self.is_cancelled() {
            return Err(Error::backend(
                "sandbox-fs",
                "file tool",
                "cancelled: the caller stopped waiting",
            ));
        }
        Ok(())
    }
}

/// Raises its flag when dropped: when the future holding it completes or is dropped.
struct RaiseOnDrop(Cancel);

impl Drop for RaiseOnDrop {
    fn drop(&mut self) {
        self.0.0.store(true, Ordering::Relaxed);
    }
}

/// Run `f` on a blocking thread; dropping the returned future raises the flag `f` gets.
pub(crate) async fn off_worker<T, F>(what: &'static str, f: F) -> Result<T>
where
    T: Send + 'static,
    F: FnOnce(&Cancel) -> Result<T> + Send + 'static,
{
    let cancel = Cancel::new();
    let _raise = RaiseOnDrop(cancel.clone());
    tokio::task::spawn_blocking(move || f(&cancel))
        .await
        .map_err(|e| Error::backend("sandbox-fs", what, format!("worker failed: {e}")))?
}

/// `Err(LimitExceeded)` when a file of `size` bytes at `path` is over `max`.
pub(crate) fn check_file_size(path: &str, size: u64, max: u64) -> Result<()> {
    if size <= max {
        return Ok(());
    }
    Err(Error::LimitExceeded {
        what: "file",
        limit: max,
        reason: format!(
            "`{path}` has {size} bytes, more than the {max} bytes the file tools load; read parts of it with a shell command (`head -c`, `sed -n`) where there is one, or split it"
        ),
    })
}

/// The number of `\n` bytes in `bytes`, looking at `cancel` every [`SCAN_CHUNK`].
pub(crate) fn count_newlines(bytes: &[u8], cancel: &Cancel) -> Result<usize> {
    let mut n = 0;
    for chunk in bytes.chunks(SCAN_CHUNK) {
        cancel.check()?;
        n += chunk.iter().filter(|&&b| b == b'\n').count();
    }
    Ok(n)
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// A flag already raised.
    pub(crate) fn raised() -> Cancel {
        let cancel = Cancel::new();
        drop(RaiseOnDrop(cancel.clone()));
        cancel
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn dropping_the_future_raises_the_flag() {
        let (seen_tx, seen_rx) = std::sync::mpsc::channel();
        let (started_tx, started_rx) = tokio::sync::oneshot::channel();
        let work = off_worker("test", move |cancel| {
            let _ = started_tx.send(());
            while !cancel.is_cancelled() {
                std::thread::yield_now();
            }
            let _ = seen_tx.send(());
            Ok(())
        });
        let handle = tokio::spawn(work);
        started_rx.await.unwrap();
        handle.abort();
        // The worker sees the flag and ends (a hang here fails by the test's timeout).
        tokio::task::spawn_blocking(move || seen_rx.recv().unwrap())
            .await
            .unwrap();
    }

    #[test]
    fn sizes_and_newlines() {
        assert!(check_file_size("f", 10, 10).is_ok());
        let err = check_file_size("f", 11, 10).unwrap_err();
        assert_eq!(err.kind(), sandbox_core::ErrorKind::LimitExceeded);
        assert_eq!(count_newlines(b"a\nb\n\n", &Cancel::new()).unwrap(), 3);
        assert!(count_newlines(b"a", &raised()).is_err());
    }
}
