//! Request counts: what a workload costs on a metered service (requests, not bytes, are what
//! object storage bills per operation).

use std::sync::atomic::{AtomicU64, Ordering};

/// Requests an [`OssSnapshotStore`](crate::OssSnapshotStore) has sent, by kind, since it was
/// built (retries inside `object_store` are not counted separately).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct RequestCounts {
    /// Single `PUT`s (whole blobs).
    pub put: u64,
    /// Multipart uploads started.
    pub multipart_start: u64,
    /// Parts uploaded.
    pub part: u64,
    /// Multipart uploads completed.
    pub complete: u64,
    /// Multipart uploads aborted.
    pub abort: u64,
    /// `GET`s, ranged ones included.
    pub get: u64,
    /// Of those, ranged `GET`s.
    pub ranged_get: u64,
    /// `HEAD`s.
    pub head: u64,
    /// `DELETE`s.
    pub delete: u64,
    /// Listing requests (pages; one per listing for backends without paginated listing).
    pub list: u64,
}

impl RequestCounts {
    /// Requests that write or remove (billed as the dearer class on S3): puts, multipart
    /// starts, parts, completions, aborts, deletes, listings.
    pub fn writes(&self) -> u64 {
        self.put
            + self.multipart_start
            + self.part
            + self.complete
            + self.abort
            + self.delete
            + self.list
    }

    /// Requests that only read: gets and heads.
    pub fn reads(&self) -> u64 {
        self.get + self.head
    }

    /// What happened between `earlier` and `self`.
    pub fn since(&self, earlier: &RequestCounts) -> RequestCounts {
        RequestCounts {
            put: self.put - earlier.put,
            multipart_start: self.multipart_start - earlier.multipart_start,
            part: self.part - earlier.part,
            complete: self.complete - earlier.complete,
            abort: self.abort - earlier.abort,
            get: self.get - earlier.get,
            ranged_get: self.ranged_get - earlier.ranged_get,
            head: self.head - earlier.head,
            delete: self.delete - earlier.delete,
            list: self.list - earlier.list,
        }
    }
}

/// The live counters.
#[derive(Debug, Default)]
pub(crate) struct Requests {
    pub(crate) put: AtomicU64,
    pub(crate) multipart_start: AtomicU64,
    pub(crate) part: AtomicU64,
    pub(crate) complete: AtomicU64,
    pub(crate) abort: AtomicU64,
    pub(crate) get: AtomicU64,
    pub(crate) ranged_get: AtomicU64,
    pub(crate) head: AtomicU64,
    pub(crate) delete: AtomicU64,
    pub(crate) list: AtomicU64,
}

impl Requests {
    pub(crate) fn count(counter: &AtomicU64) {
        counter.fetch_add(1, Ordering::Relaxed);
    }

    pub(crate) fn snapshot(&self) -> RequestCounts {
        let g = |c: &AtomicU64| c.load(Ordering::Relaxed);
        RequestCounts {
            put: g(&self.put),
            multipart_start: g(&self.multipart_start),
            part: g(&self.part),
            complete: g(&self.complete),
            abort: g(&self.abort),
            get: g(&self.get),
            ranged_get: g(&self.ranged_get),
            head: g(&self.head),
            delete: g(&self.delete),
            list: g(&self.list),
        }
    }
}
