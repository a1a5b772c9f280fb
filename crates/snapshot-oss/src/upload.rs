//! Streaming uploads: one `PUT` for what fits in [`OssOptions::single_put_max`], else a
//! multipart upload with a few parts in flight, aborted whenever it does not complete — on an
//! input error, on a store error, and when the future is dropped ([`Multipart`]'s `Drop`).

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use futures::stream::FuturesUnordered;
use futures::{FutureExt as _, StreamExt as _};
use object_store::path::Path;
use object_store::{MultipartUpload, PutMode, PutMultipartOptions, PutOptions, PutPayload};
use sandbox_core::stream::ByteStream;
use sandbox_core::{Error, Result};
use tokio::task::JoinHandle;

use crate::requests::Requests;
use crate::store::Inner;

/// How long an abandoned upload's clean-up lets parts still being sent finish before it
/// aborts the upload (a part that lands after the abort could outlive it on S3).
const DRAIN: Duration = Duration::from_secs(30);

/// Chunks read from the input and not yet sent, without copying them.
#[derive(Default)]
struct Buffer {
    chunks: VecDeque<Bytes>,
    len: usize,
}

impl Buffer {
    fn push(&mut self, chunk: Bytes) {
        if !chunk.is_empty() {
            self.len += chunk.len();
            self.chunks.push_back(chunk);
        }
    }

    /// The first `n` bytes (or all, if fewer), as a payload of the same chunks.
    fn take(&mut self, n: usize) -> PutPayload {
        let mut out = Vec::new();
        let mut left = n.min(self.len);
        self.len -= left;
        while left > 0 {
            let mut chunk = self.chunks.pop_front().expect("len counts the chunks");
            if chunk.len() > left {
                self.chunks.push_front(chunk.split_off(left));
            }
            left -= chunk.len();
            out.push(chunk);
        }
        out.into_iter().collect()
    }
}

/// Store `data` at `path`; `size` is the announced length, if any (checked).
pub(crate) async fn put(
    inner: &Inner,
    path: &Path,
    key: &str,
    mut data: ByteStream,
    size: Option<u64>,
    mode: PutMode,
) -> Result<u64> {
    let single_max = inner.options.single_put_max as u64;
    // What is read before deciding between one PUT and a multipart upload.
    let first = size.unwrap_or(single_max).min(single_max);
    let mut buf = Buffer::default();
    let mut total = 0u64;
    let mut ended = false;
    // A blob announced as larger goes straight to a multipart upload: nothing to buffer first.
    let decided = size.is_some_and(|n| n > single_max);
    while !decided && total <= first {
        match data.next().await {
            Some(chunk) => {
                let chunk = chunk?;
                total += chunk.len() as u64;
                check_size(size, total, false, key)?;
                buf.push(chunk);
            }
            None => {
                ended = true;
                break;
            }
        }
    }
    if ended {
        check_size(size, total, true, key)?;
        let payload = buf.take(buf.len);
        let opts = PutOptions::from(mode);
        let started = std::time::Instant::now();
        Requests::count(&inner.requests.put);
        inner
            .bounded_by(
                "put",
                key,
                inner.options.operation_timeout + inner.options.request_timeout,
                inner.store.put_opts(path, payload, opts),
            )
            .await?;
        tracing::debug!(key, bytes = total, elapsed = ?started.elapsed(), "single put");
        return Ok(total);
    }
    if !matches!(mode, PutMode::Overwrite) {
        return Err(Error::NotSupported {
            backend: inner.ctx.backend,
            operation: "conditional put of a blob larger than single_put_max",
        });
    }

    Requests::count(&inner.requests.multipart_start);
    let upload = inner
        .bounded_by(
            "start multipart upload",
            key,
            inner.options.operation_timeout,
            inner
                .store
                .put_multipart_opts(path, PutMultipartOptions::default()),
        )
        .await?;
    let mut multipart = Multipart {
        upload: Some(upload),
        parts: FuturesUnordered::new(),
        sent: 0,
        key: key.to_owned(),
        requests: inner.requests.clone(),
    };
    match stream_parts(inner, &mut multipart, &mut buf, data, size, total, key).await {
        Ok(total) => Ok(total),
        Err(e) => {
            // Abort before reporting: the caller sees the error only once nothing is left.
            multipart.abort().await;
            Err(e)
        }
    }
}

/// The multipart phase: send full parts as the input fills them, then the last one, then
/// complete.
async fn stream_parts(
    inner: &Inner,
    multipart: &mut Multipart,
    buf: &mut Buffer,
    mut data: ByteStream,
    size: Option<u64>,
    mut total: u64,
    key: &str,
) -> Result<u64> {
    let in_flight = inner.options.max_parts_in_flight;
    loop {
        loop {
            let part = inner.options.part_len(multipart.sent, size);
            if buf.len < part {
                break;
            }
            multipart.send(inner, buf.take(part), in_flight).await?;
        }
        multipart.reap(inner)?;
        match data.next().await {
            Some(chunk) => {
                let chunk = chunk?;
                total += chunk.len() as u64;
                check_size(size, total, false, key)?;
                buf.push(chunk);
            }
            None => break,
        }
    }
    check_size(size, total, true, key)?;
    if buf.len > 0 {
        multipart.send(inner, buf.take(buf.len), in_flight).await?;
    }
    multipart.complete(inner).await?;
    tracing::debug!(
        key,
        bytes = total,
        parts = multipart.sent,
        "multipart upload completed"
    );
    Ok(total)
}

fn check_size(size: Option<u64>, total: u64, ended: bool, key: &str) -> Result<()> {
    match size {
        Some(n) if total > n || (ended && total != n) => Err(Error::invalid(
            "blob size",
            format!("`{key}` was announced as {n} bytes and the stream gave {total}"),
        )),
        _ => Ok(()),
    }
}

/// A multipart upload in progress. Dropped before [`complete`](Self::complete) succeeded, it
/// spawns its own abort: parts still being sent are let finish (at most [`DRAIN`]), then the
/// upload is aborted, so no part outlives it on the server.
struct Multipart {
    upload: Option<Box<dyn MultipartUpload>>,
    parts: FuturesUnordered<JoinHandle<object_store::Result<()>>>,
    sent: usize,
    key: String,
    requests: Arc<Requests>,
}

impl Multipart {
    /// Start uploading `payload` as the next part, once fewer than `in_flight` parts run.
    async fn send(&mut self, inner: &Inner, payload: PutPayload, in_flight: usize) -> Result<()> {
        while self.parts.len() >= in_flight {
            if let Some(done) = self.parts.next().await {
                self.check(inner, done)?;
            }
        }
        let upload = self.upload.as_mut().expect("sending to a live upload");
        // Each part on a task of its own: parts upload while the input is read.
        Requests::count(&self.requests.part);
        self.parts.push(tokio::spawn(upload.put_part(payload)));
        self.sent += 1;
        Ok(())
    }

    /// Surface the failure of a part that already finished.
    fn reap(&mut self, inner: &Inner) -> Result<()> {
        while let Some(Some(done)) = self.parts.next().now_or_never() {
            self.check(inner, done)?;
        }
        Ok(())
    }

    fn check(
        &self,
        inner: &Inner,
        done: std::result::Result<object_store::Result<()>, tokio::task::JoinError>,
    ) -> Result<()> {
        match done {
            Ok(Ok(())) => Ok(()),
            Ok(Err(e)) => Err(inner.ctx.convert("upload part", &self.key, e)),
            Err(e) => Err(Error::backend(
                inner.ctx.backend,
                "upload part",
                format!("the part's task failed: {e}"),
            )),
        }
    }

    async fn complete(&mut self, inner: &Inner) -> Result<()> {
        while let Some(done) = self.parts.next().await {
            self.check(inner, done)?;
        }
        let upload = self.upload.as_mut().expect("completing a live upload");
        Requests::count(&self.requests.complete);
        inner
            .bounded_by(
                "complete multipart upload",
                &self.key,
                inner.options.operation_timeout,
                upload.complete(),
            )
            .await?;
        // Done: nothing to abort any more.
        self.upload = None;
        Ok(())
    }

    /// Abort now and wait until it is done (the clean-up runs on a task of its own, so it
    /// also finishes if this future is dropped meanwhile).
    async fn abort(&mut self) {
        if let Some(task) = self.spawn_abort() {
            let _ = task.await;
        }
    }

    fn spawn_abort(&mut self) -> Option<JoinHandle<()>> {
        let mut upload = self.upload.take()?;
        let mut parts = std::mem::take(&mut self.parts);
        let key = std::mem::take(&mut self.key);
        let requests = self.requests.clone();
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            tracing::warn!(
                key,
                "a multipart upload was dropped outside a tokio runtime and is not aborted \
                 (a bucket lifecycle rule removes it)"
            );
            return None;
        };
        Some(runtime.spawn(async move {
            let deadline = tokio::time::Instant::now() + DRAIN;
            while !parts.is_empty() {
                match tokio::time::timeout_at(deadline, parts.next()).await {
                    Ok(_) => {}
                    Err(_) => {
                        parts.iter().for_each(JoinHandle::abort);
                        break;
                    }
                }
            }
            for attempt in 1..=3 {
                Requests::count(&requests.abort);
                match upload.abort().await {
                    Ok(()) => {
                        tracing::debug!(key, "multipart upload aborted");
                        return;
                    }
                    Err(e) => {
                        tracing::warn!(key, attempt, error = %e, "aborting a multipart upload failed");
                        tokio::time::sleep(Duration::from_millis(200 * attempt)).await;
                    }
                }
            }
        }))
    }
}

impl Drop for Multipart {
    fn drop(&mut self) {
        // Cancelled (the put future was dropped) or failed without `abort`: clean up anyway.
        let _ = self.spawn_abort();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buffer_takes_exact_prefixes_without_copying() {
        let mut b = Buffer::default();
        b.push(Bytes::from_static(b"abc"));
        b.push(Bytes::new());
        b.push(Bytes::from_static(b"defgh"));
        assert_eq!(b.len, 8);
        let p = b.take(4);
        assert_eq!(p.content_length(), 4);
        let got: Vec<u8> = p.iter().flat_map(|c| c.to_vec()).collect();
        assert_eq!(got, b"abcd");
        assert_eq!(b.len, 4);
        let rest: Vec<u8> = b.take(100).iter().flat_map(|c| c.to_vec()).collect();
        assert_eq!(rest, b"efgh");
        assert_eq!(b.len, 0);
    }
}
