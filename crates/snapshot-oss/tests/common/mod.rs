//! An `ObjectStore` wrapper that counts requests by kind, records how many parts upload at
//! once, and fails the n-th part on demand (a store error in the middle of a multipart upload).
#![allow(dead_code)] // each test binary uses a part

use std::fmt;
use std::ops::Range;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use async_trait::async_trait;
use bytes::Bytes;
use futures::FutureExt as _;
use futures::stream::BoxStream;
use object_store::path::Path;
use object_store::{
    CopyOptions, GetOptions, GetResult, ListResult, MultipartUpload, ObjectMeta, ObjectStore,
    PutMultipartOptions, PutOptions, PutPayload, PutResult, RenameOptions, UploadPart,
};

/// Request counts, and the injected fault.
#[derive(Debug, Default)]
pub struct Counts {
    pub puts: AtomicUsize,
    pub multipart_starts: AtomicUsize,
    pub parts: AtomicUsize,
    pub part_sizes: std::sync::Mutex<Vec<usize>>,
    pub completes: AtomicUsize,
    pub aborts: AtomicUsize,
    pub gets: AtomicUsize,
    pub ranged_gets: AtomicUsize,
    pub lists: AtomicUsize,
    in_flight: AtomicUsize,
    pub max_in_flight: AtomicUsize,
    /// Fail the part with this number (1-based, counted across uploads); 0 = never.
    pub fail_part: AtomicUsize,
}

impl Counts {
    pub fn get(c: &AtomicUsize) -> usize {
        c.load(Ordering::SeqCst)
    }
}

/// Forwards everything to `inner`, counting.
pub struct Counting {
    pub inner: Arc<dyn ObjectStore>,
    pub counts: Arc<Counts>,
}

impl Counting {
    pub fn new(inner: Arc<dyn ObjectStore>) -> Counting {
        Counting {
            inner,
            counts: Arc::new(Counts::default()),
        }
    }
}

impl fmt::Debug for Counting {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Counting({})", self.inner)
    }
}

impl fmt::Display for Counting {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Counting({})", self.inner)
    }
}

#[async_trait]
impl ObjectStore for Counting {
    async fn put_opts(
        &self,
        location: &Path,
        payload: PutPayload,
        opts: PutOptions,
    ) -> object_store::Result<PutResult> {
        self.counts.puts.fetch_add(1, Ordering::SeqCst);
        self.inner.put_opts(location, payload, opts).await
    }

    async fn put_multipart_opts(
        &self,
        location: &Path,
        opts: PutMultipartOptions,
    ) -> object_store::Result<Box<dyn MultipartUpload>> {
        self.counts.multipart_starts.fetch_add(1, Ordering::SeqCst);
        let inner = self.inner.put_multipart_opts(location, opts).await?;
        Ok(Box::new(CountingUpload {
            inner,
            counts: self.counts.clone(),
        }))
    }

    async fn get_opts(
        &self,
        location: &Path,
        options: GetOptions,
    ) -> object_store::Result<GetResult> {
        if options.range.is_some() {
            self.counts.ranged_gets.fetch_add(1, Ordering::SeqCst);
        } else if !options.head {
            self.counts.gets.fetch_add(1, Ordering::SeqCst);
        }
        self.inner.get_opts(location, options).await
    }

    async fn get_ranges(
        &self,
        location: &Path,
        ranges: &[Range<u64>],
    ) -> object_store::Result<Vec<Bytes>> {
        self.inner.get_ranges(location, ranges).await
    }

    fn delete_stream(
        &self,
        locations: BoxStream<'static, object_store::Result<Path>>,
    ) -> BoxStream<'static, object_store::Result<Path>> {
        self.inner.delete_stream(locations)
    }

    fn list(&self, prefix: Option<&Path>) -> BoxStream<'static, object_store::Result<ObjectMeta>> {
        self.counts.lists.fetch_add(1, Ordering::SeqCst);
        self.inner.list(prefix)
    }

    async fn list_with_delimiter(&self, prefix: Option<&Path>) -> object_store::Result<ListResult> {
        self.inner.list_with_delimiter(prefix).await
    }

    async fn copy_opts(
        &self,
        from: &Path,
        to: &Path,
        options: CopyOptions,
    ) -> object_store::Result<()> {
        self.inner.copy_opts(from, to, options).await
    }

    async fn rename_opts(
        &self,
        from: &Path,
        to: &Path,
        options: RenameOptions,
    ) -> object_store::Result<()> {
        self.inner.rename_opts(from, to, options).await
    }
}

#[derive(Debug)]
struct CountingUpload {
    inner: Box<dyn MultipartUpload>,
    counts: Arc<Counts>,
}

#[async_trait]
impl MultipartUpload for CountingUpload {
    fn put_part(&mut self, data: PutPayload) -> UploadPart {
        let n = self.counts.parts.fetch_add(1, Ordering::SeqCst) + 1;
        self.counts
            .part_sizes
            .lock()
            .unwrap()
            .push(data.content_length());
        let counts = self.counts.clone();
        let fail = Counts::get(&counts.fail_part) == n;
        let upload = self.inner.put_part(data);
        async move {
            let now = counts.in_flight.fetch_add(1, Ordering::SeqCst) + 1;
            counts.max_in_flight.fetch_max(now, Ordering::SeqCst);
            let result = if fail {
                // The part reached the server; the reply says it failed (a 503).
                let _ = upload.await;
                Err(object_store::Error::Generic {
                    store: "S3",
                    source:
                        "Server returned non-2xx status code: 503 Service Unavailable: injected"
                            .into(),
                })
            } else {
                upload.await
            };
            counts.in_flight.fetch_sub(1, Ordering::SeqCst);
            result
        }
        .boxed()
    }

    async fn complete(&mut self) -> object_store::Result<PutResult> {
        self.counts.completes.fetch_add(1, Ordering::SeqCst);
        self.inner.complete().await
    }

    async fn abort(&mut self) -> object_store::Result<()> {
        self.counts.aborts.fetch_add(1, Ordering::SeqCst);
        self.inner.abort().await
    }
}
