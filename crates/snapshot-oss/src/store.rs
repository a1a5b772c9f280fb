//! [`OssSnapshotStore`]: [`SnapshotStore`] over any `object_store` backend.

use std::fmt;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use bytes::Bytes;
use futures::{StreamExt as _, TryStreamExt as _};
use object_store::list::{PaginatedListOptions, PaginatedListStore};
use object_store::path::Path;
use object_store::{GetOptions, GetRange, ObjectMeta, ObjectStore, ObjectStoreExt as _, PutMode};
use sandbox_core::snapshot::{BlobKey, BlobMeta, BlobStream, SnapshotStore, WriteHints};
use sandbox_core::stream::ByteStream;
use sandbox_core::{Error, Reach, Result};
use tracing::Instrument as _;

use crate::error::Ctx;
use crate::options::OssOptions;
use crate::requests::{RequestCounts, Requests};
use crate::upload;

/// Snapshot blobs as objects in a bucket, under a key prefix: blob `chunks/ab/…` is object
/// `<prefix>/chunks/ab/…`.
///
/// - `put` is atomic: a blob up to [`OssOptions::single_put_max`] is one `PUT`; a larger one,
///   or one of unknown length that outgrows it, is a multipart upload streamed a part at a
///   time (a few parts in flight), which becomes visible only when completed and is aborted
///   when the input fails, the store fails, or the `put` future is dropped.
/// - `get` streams; `get_range` is one ranged `GET`.
/// - `list` is paginated (one request per [`OssOptions::list_page`] objects, as the stream is
///   read), with each object's last modification as `modified_unix`.
/// - Unreachable or failing services are [`Error::Unavailable`], requests that time out
///   [`Error::Timeout`] (both retryable); missing blobs [`Error::NotFound`].
///
/// Build it with [`S3Config`](crate::S3Config) (feature `aws`), or over any `object_store`
/// with [`from_object_store`](Self::from_object_store) (GCS, Azure, a local directory,
/// memory). `Debug` shows the service and the prefix, never credentials.
#[derive(Clone)]
pub struct OssSnapshotStore {
    inner: Arc<Inner>,
}

pub(crate) struct Inner {
    pub(crate) store: Arc<dyn ObjectStore>,
    /// Exact string-prefix listing, where the backend has it (S3, GCS, Azure).
    lister: Option<Arc<dyn PaginatedListStore>>,
    /// `""` or `a/b/`.
    prefix: String,
    name: &'static str,
    reach: Reach,
    pub(crate) options: OssOptions,
    pub(crate) ctx: Ctx,
    pub(crate) requests: Arc<Requests>,
}

impl fmt::Debug for OssSnapshotStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("OssSnapshotStore")
            .field("service", &self.inner.ctx.service)
            .field("prefix", &self.inner.prefix)
            .field("reach", &self.inner.reach)
            .field("options", &self.inner.options)
            .finish_non_exhaustive()
    }
}

impl OssSnapshotStore {
    /// A store over `store` (any `object_store` backend), with blobs under `prefix`
    /// (`/`-separated segments of `[A-Za-z0-9._-]`, or empty). Listing goes through
    /// [`ObjectStore::list`] on the prefix's directory, filtered to the exact prefix; use
    /// [`from_paginated`](Self::from_paginated) for backends that list by string prefix.
    /// Its [`Reach`] is [`Reach::Cluster`]: say otherwise with [`with_reach`](Self::with_reach)
    /// for a store only one host or process sees (a local directory, memory).
    pub fn from_object_store(store: Arc<dyn ObjectStore>, prefix: &str) -> Result<Self> {
        let service = format!("object store {store}");
        let options = OssOptions::default();
        Ok(OssSnapshotStore {
            inner: Arc::new(Inner {
                store,
                lister: None,
                prefix: normalize_prefix(prefix)?,
                name: "s3",
                reach: Reach::Cluster,
                ctx: Ctx {
                    backend: "s3",
                    service,
                    secrets: Vec::new(),
                    request_timeout: options.request_timeout,
                },
                options,
                requests: Arc::default(),
            }),
        })
    }

    /// [`from_object_store`](Self::from_object_store) for a backend that also lists by string
    /// prefix a page at a time (`AmazonS3`, `GoogleCloudStorage`, `MicrosoftAzure`).
    pub fn from_paginated<S>(store: Arc<S>, prefix: &str) -> Result<Self>
    where
        S: ObjectStore + PaginatedListStore,
    {
        let lister: Arc<dyn PaginatedListStore> = store.clone();
        let mut this = OssSnapshotStore::from_object_store(store, prefix)?;
        this.inner_mut().lister = Some(lister);
        Ok(this)
    }

    fn inner_mut(&mut self) -> &mut Inner {
        Arc::get_mut(&mut self.inner).expect("configured before it is shared")
    }

    /// Set the upload, listing and time limits (the HTTP ones apply only through
    /// [`S3Config`](crate::S3Config)).
    pub fn with_options(mut self, options: OssOptions) -> Result<Self> {
        options.check()?;
        let inner = self.inner_mut();
        inner.ctx.request_timeout = options.request_timeout;
        inner.options = options;
        Ok(self)
    }

    /// How far what is written is shared (default [`Reach::Cluster`]).
    pub fn with_reach(mut self, reach: Reach) -> Self {
        self.inner_mut().reach = reach;
        self
    }

    /// The name in logs and errors (default `"s3"`; e.g. `"gcs"`, `"memory"`).
    pub fn with_name(mut self, name: &'static str) -> Self {
        let inner = self.inner_mut();
        inner.name = name;
        inner.ctx.backend = name;
        self
    }

    /// How the service is named in errors (`s3 bucket `b` at https://…`; never a secret).
    pub fn with_service(mut self, service: impl Into<String>) -> Self {
        self.inner_mut().ctx.service = service.into();
        self
    }

    /// Texts that must never appear in an error message (secret keys, tokens).
    pub(crate) fn with_secrets(mut self, secrets: Vec<String>) -> Self {
        self.inner_mut().ctx.secrets = secrets;
        self
    }

    /// The key prefix (`""` or ending in `/`).
    pub fn prefix(&self) -> &str {
        &self.inner.prefix
    }

    /// The limits in force.
    pub fn options(&self) -> &OssOptions {
        &self.inner.options
    }

    /// The requests sent so far, by kind.
    pub fn requests(&self) -> RequestCounts {
        self.inner.requests.snapshot()
    }

    /// The underlying object store.
    pub fn object_store(&self) -> &Arc<dyn ObjectStore> {
        &self.inner.store
    }

    /// Store `data` under `key` only if no blob is there: `Ok(true)` if written, `Ok(false)`
    /// if one already was (its content is not compared). One conditional `PUT`
    /// (`If-None-Match: *` on S3); [`Error::NotSupported`] where the service has no such
    /// write (configured off, e.g. Alibaba OSS) or for data beyond
    /// [`OssOptions::single_put_max`].
    pub async fn put_if_absent(&self, key: &BlobKey, data: Bytes) -> Result<bool> {
        let path = self.inner.path(key)?;
        let size = data.len() as u64;
        if data.len() > self.inner.options.single_put_max {
            return Err(Error::NotSupported {
                backend: self.inner.name,
                operation: "conditional put of a blob larger than single_put_max",
            });
        }
        let span = tracing::debug_span!("oss_put_if_absent", key = %key, size);
        match upload::put(
            &self.inner,
            &path,
            key.as_str(),
            sandbox_core::stream::once(data),
            Some(size),
            PutMode::Create,
        )
        .instrument(span)
        .await
        {
            Ok(_) => Ok(true),
            Err(Error::Conflict { .. }) => Ok(false),
            Err(e) => Err(e),
        }
    }
}

impl Inner {
    pub(crate) fn path(&self, key: &BlobKey) -> Result<Path> {
        let full = format!("{}{}", self.prefix, key.as_str());
        Path::parse(&full).map_err(|e| Error::invalid("blob key", e.to_string()))
    }

    /// `fut` within `limit`, its error converted.
    pub(crate) async fn bounded_by<T>(
        &self,
        operation: &'static str,
        key: &str,
        limit: Duration,
        fut: impl Future<Output = object_store::Result<T>>,
    ) -> Result<T> {
        match tokio::time::timeout(limit, fut).await {
            Ok(Ok(v)) => Ok(v),
            Ok(Err(e)) => Err(self.ctx.convert(operation, key, e)),
            Err(_) => Err(self.ctx.timeout(operation, key, limit)),
        }
    }

    fn bounded<'a, T: 'a>(
        &'a self,
        operation: &'static str,
        key: &'a str,
        fut: impl Future<Output = object_store::Result<T>> + 'a,
    ) -> impl Future<Output = Result<T>> + 'a {
        self.bounded_by(operation, key, self.options.operation_timeout, fut)
    }

    fn meta(&self, meta: ObjectMeta) -> Option<BlobMeta> {
        let name = meta.location.as_ref().strip_prefix(self.prefix.as_str())?;
        let Ok(key) = BlobKey::new(name) else {
            // Not one of ours (written by something else under the prefix).
            tracing::debug!(object = %meta.location, "skipping an object whose name is no blob key");
            return None;
        };
        Some(BlobMeta::new(
            key,
            meta.size,
            Some(meta.last_modified.timestamp()),
        ))
    }

    async fn get_stream(
        self: &Arc<Self>,
        key: &BlobKey,
        range: Option<std::ops::Range<u64>>,
    ) -> Result<ByteStream> {
        let path = self.path(key)?;
        Requests::count(&self.requests.get);
        if range.is_some() {
            Requests::count(&self.requests.ranged_get);
        }
        let options = GetOptions::new().with_range(range.map(GetRange::Bounded));
        let got = self
            .bounded("get", key.as_str(), self.store.get_opts(&path, options))
            .await?;
        let this = self.clone();
        let key = key.to_string();
        Ok(got
            .into_stream()
            .map_err(move |e| this.ctx.convert("read", &key, e))
            .boxed())
    }
}

fn normalize_prefix(prefix: &str) -> Result<String> {
    let trimmed = prefix.trim_matches('/');
    if trimmed.is_empty() {
        return Ok(String::new());
    }
    // The same alphabet as blob keys: nothing that an object store would encode or refuse.
    BlobKey::new(trimmed).map_err(|_| {
        Error::invalid(
            "object store prefix",
            format!("`{prefix}` must be `/`-separated segments of [A-Za-z0-9._-]"),
        )
    })?;
    Ok(format!("{trimmed}/"))
}

#[async_trait]
impl SnapshotStore for OssSnapshotStore {
    fn name(&self) -> &'static str {
        self.inner.name
    }

    fn reach(&self) -> Reach {
        self.inner.reach
    }

    /// A blob up to `single_put_max` is held whole for its one `PUT`; a larger one holds the
    /// parts in flight.
    fn write_hints(&self) -> WriteHints {
        WriteHints::buffering(self.inner.options.buffered_per_put())
    }

    async fn put(&self, key: &BlobKey, data: ByteStream, size: Option<u64>) -> Result<u64> {
        let path = self.inner.path(key)?;
        let span = tracing::debug_span!("oss_put", key = %key, size);
        upload::put(
            &self.inner,
            &path,
            key.as_str(),
            data,
            size,
            PutMode::Overwrite,
        )
        .instrument(span)
        .await
    }

    async fn get(&self, key: &BlobKey) -> Result<ByteStream> {
        let span = tracing::debug_span!("oss_get", key = %key);
        self.inner.get_stream(key, None).instrument(span).await
    }

    async fn get_range(&self, key: &BlobKey, offset: u64, len: u64) -> Result<ByteStream> {
        let span = tracing::debug_span!("oss_get_range", key = %key, offset, len);
        async {
            let empty = || futures::stream::empty().boxed();
            if len == 0 {
                // Nothing to read, but a missing blob is still reported.
                return if self.exists(key).await? {
                    Ok(empty())
                } else {
                    Err(Error::NotFound {
                        what: "snapshot blob",
                        key: key.to_string(),
                    })
                };
            }
            let end = offset.saturating_add(len);
            match self.inner.get_stream(key, Some(offset..end)).await {
                Ok(s) => Ok(s),
                Err(
                    e
                    @ (Error::NotFound { .. } | Error::Unavailable { .. } | Error::Timeout { .. }),
                ) => Err(e),
                // A range that starts at or past the end is refused by the service: the blob
                // simply ends before it.
                Err(e) => {
                    let path = self.inner.path(key)?;
                    Requests::count(&self.inner.requests.head);
                    match self
                        .inner
                        .bounded("head", key.as_str(), self.inner.store.head(&path))
                        .await
                    {
                        Ok(meta) if meta.size <= offset => Ok(empty()),
                        _ => Err(e),
                    }
                }
            }
        }
        .instrument(span)
        .await
    }

    async fn exists(&self, key: &BlobKey) -> Result<bool> {
        let path = self.inner.path(key)?;
        let span = tracing::debug_span!("oss_exists", key = %key);
        Requests::count(&self.inner.requests.head);
        match self
            .inner
            .bounded("head", key.as_str(), self.inner.store.head(&path))
            .instrument(span)
            .await
        {
            Ok(_) => Ok(true),
            Err(Error::NotFound { .. }) => Ok(false),
            Err(e) => Err(e),
        }
    }

    async fn delete(&self, key: &BlobKey) -> Result<()> {
        let path = self.inner.path(key)?;
        let span = tracing::debug_span!("oss_delete", key = %key);
        Requests::count(&self.inner.requests.delete);
        match self
            .inner
            .bounded("delete", key.as_str(), self.inner.store.delete(&path))
            .instrument(span)
            .await
        {
            Ok(()) | Err(Error::NotFound { .. }) => Ok(()),
            Err(e) => Err(e),
        }
    }

    fn list(&self, prefix: &str) -> BlobStream {
        let inner = self.inner.clone();
        let full = format!("{}{}", inner.prefix, prefix);
        match inner.lister.clone() {
            Some(lister) => list_paginated(inner, lister, full),
            None => list_directory(inner, full),
        }
    }

    /// Not supported: a put that fails or is dropped aborts its multipart upload, but the
    /// parts of one whose process was killed stay on the server, invisible to listings and
    /// billed, and the object-store client cannot list unfinished uploads to abort them. Give
    /// the bucket a lifecycle rule that aborts them instead (S3's
    /// `AbortIncompleteMultipartUpload` with `DaysAfterInitiation`; OSS's
    /// `AbortMultipartUpload`).
    async fn sweep_leftovers(
        &self,
        _sweep: sandbox_core::LeftoverSweep,
    ) -> Result<sandbox_core::LeftoverReport> {
        Err(Error::NotSupported {
            backend: self.inner.name,
            operation: "aborting the multipart uploads of killed writers (set the bucket's \
                        AbortIncompleteMultipartUpload lifecycle rule)",
        })
    }
}

/// One request per page, sent when the consumer has read the previous page.
fn list_paginated(
    inner: Arc<Inner>,
    lister: Arc<dyn PaginatedListStore>,
    full: String,
) -> BlobStream {
    struct State {
        token: Option<String>,
        done: bool,
    }
    let start = State {
        token: None,
        done: false,
    };
    futures::stream::try_unfold(start, move |state| {
        let (inner, lister, full) = (inner.clone(), lister.clone(), full.clone());
        async move {
            if state.done {
                return Ok(None);
            }
            let opts = PaginatedListOptions {
                max_keys: Some(inner.options.list_page),
                page_token: state.token,
                ..Default::default()
            };
            let prefix = (!full.is_empty()).then_some(full.as_str());
            Requests::count(&inner.requests.list);
            let page = inner
                .bounded("list", &full, lister.list_paginated(prefix, opts))
                .await?;
            let items: Vec<Result<BlobMeta>> = page
                .result
                .objects
                .into_iter()
                .filter_map(|m| inner.meta(m))
                .map(Ok)
                .collect();
            let next = State {
                done: page.page_token.is_none(),
                token: page.page_token,
            };
            Ok::<_, Error>(Some((futures::stream::iter(items), next)))
        }
    })
    .try_flatten()
    .boxed()
}

/// Backends without string-prefix listing: list the prefix's directory, keep the matches.
fn list_directory(inner: Arc<Inner>, full: String) -> BlobStream {
    let dir = full.rfind('/').map(|i| Path::from(&full[..i]));
    Requests::count(&inner.requests.list);
    let listed = inner.store.list(dir.as_ref());
    let keep = full.clone();
    listed
        .map_err({
            let inner = inner.clone();
            move |e| inner.ctx.convert("list", &full, e)
        })
        .try_filter_map(move |meta| {
            let hit = meta.location.as_ref().starts_with(keep.as_str());
            let out = if hit { inner.meta(meta) } else { None };
            futures::future::ready(Ok(out))
        })
        .boxed()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prefixes_are_checked_and_normalized() {
        assert_eq!(normalize_prefix("").unwrap(), "");
        assert_eq!(normalize_prefix("/").unwrap(), "");
        assert_eq!(normalize_prefix("team/a").unwrap(), "team/a/");
        assert_eq!(normalize_prefix("/team/a/").unwrap(), "team/a/");
        for bad in ["a//b", "a/../b", "sp ace", ".hidden"] {
            assert!(normalize_prefix(bad).is_err(), "{bad}");
        }
    }
}
