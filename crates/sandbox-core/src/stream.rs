//! Byte streams: how archives and blobs move between boxes and stores without being held whole
//! in memory.

use std::io;
use std::pin::Pin;

use bytes::Bytes;
use futures::{Stream, StreamExt, TryStreamExt};
use tokio::io::AsyncRead;
use tokio::sync::mpsc;

use crate::error::{Error, Result};

/// A stream of byte chunks, the unit every primitive uses to move archives and blobs.
pub type ByteStream = Pin<Box<dyn Stream<Item = Result<Bytes>> + Send + 'static>>;

/// Chunk size used when turning readers into streams.
pub const CHUNK: usize = 256 * 1024;

/// Turn an `AsyncRead` into a [`ByteStream`].
pub fn from_reader<R: AsyncRead + Send + 'static>(reader: R) -> ByteStream {
    tokio_util::io::ReaderStream::with_capacity(reader, CHUNK)
        .map_err(Error::from)
        .boxed()
}

/// Turn a [`ByteStream`] into an `AsyncRead`. Our errors survive the trip (see
/// `impl From<io::Error> for Error`).
pub fn into_reader(stream: ByteStream) -> impl AsyncRead + Send + Unpin + 'static {
    tokio_util::io::StreamReader::new(stream.map_err(io::Error::from))
}

/// A stream holding one in-memory buffer (small payloads only).
pub fn once(bytes: impl Into<Bytes>) -> ByteStream {
    futures::stream::once(futures::future::ready(Ok(bytes.into()))).boxed()
}

/// The bytes `[offset, offset + len)` of `stream`: what comes before is read and dropped, and
/// the input is no longer read once `len` bytes came (it may end earlier).
pub fn slice(stream: ByteStream, offset: u64, len: u64) -> ByteStream {
    futures::stream::unfold(
        (stream, offset, len),
        |(mut input, mut skip, mut left)| async move {
            while left > 0 {
                let mut chunk = match input.next().await? {
                    Ok(chunk) => chunk,
                    Err(e) => return Some((Err(e), (input, skip, 0))),
                };
                let cut = skip.min(chunk.len() as u64) as usize;
                skip -= cut as u64;
                let _ = chunk.split_to(cut);
                chunk.truncate(left.min(chunk.len() as u64) as usize);
                if !chunk.is_empty() {
                    left -= chunk.len() as u64;
                    return Some((Ok(chunk), (input, skip, left)));
                }
            }
            None
        },
    )
    .boxed()
}

/// Drain a stream into memory. Only for payloads known to be small (single files, manifests).
pub async fn collect(stream: ByteStream, limit: usize) -> Result<Bytes> {
    collect_sized(stream, 0, limit).await
}

/// The stream's bytes up to its first newline (included) or `limit` bytes, whichever comes
/// first; the rest is never read (a manifest's header line).
pub async fn collect_prefix(mut stream: ByteStream, limit: usize) -> Result<Bytes> {
    let mut buf = bytes::BytesMut::new();
    while buf.len() < limit
        && !buf.contains(&b'\n')
        && let Some(chunk) = stream.next().await
    {
        let chunk = chunk?;
        let take = chunk.len().min(limit - buf.len());
        buf.extend_from_slice(&chunk[..take]);
    }
    Ok(buf.freeze())
}

/// Most bytes a buffer is sized for up front from a length that came from outside (a manifest,
/// a store's listing, a tar header, a file's metadata). Larger payloads grow as their bytes
/// arrive, so a hostile length of 2^36 costs nothing until that many bytes really come.
pub const PREALLOC_MAX: usize = 4 << 20;

/// The capacity to reserve for `len` announced bytes: `len`, at most [`PREALLOC_MAX`].
pub fn capacity_for(len: u64) -> usize {
    usize::try_from(len).map_or(PREALLOC_MAX, |l| l.min(PREALLOC_MAX))
}

/// [`collect`] into a buffer sized for `expected` bytes up front (no regrowth for payloads of
/// a known size up to [`PREALLOC_MAX`]; `expected` is a hint and may be hostile).
pub async fn collect_sized(mut stream: ByteStream, expected: usize, limit: usize) -> Result<Bytes> {
    let mut buf = bytes::BytesMut::with_capacity(capacity_for(expected.min(limit) as u64));
    while let Some(chunk) = stream.next().await {
        let chunk = chunk?;
        if buf.len() + chunk.len() > limit {
            return Err(Error::invalid(
                "payload",
                format!("larger than the {limit}-byte limit"),
            ));
        }
        buf.extend_from_slice(&chunk);
    }
    Ok(buf.freeze())
}

/// A `std::io::Write` that sends what is written as chunks of a [`ByteStream`]; for producing a
/// stream from blocking code (tar writers) on a blocking thread. Backpressure: `write` blocks
/// while the channel holds `depth` unread chunks.
pub struct ChannelWriter {
    tx: mpsc::Sender<Result<Bytes>>,
    buf: Vec<u8>,
}

impl ChannelWriter {
    /// A writer and the stream its bytes appear on. `depth` chunks of [`CHUNK`] bytes may be
    /// in flight.
    pub fn new(depth: usize) -> (ChannelWriter, ByteStream) {
        let (tx, rx) = mpsc::channel(depth.max(1));
        let stream = tokio_stream_from(rx);
        (
            ChannelWriter {
                tx,
                buf: Vec::with_capacity(CHUNK),
            },
            stream,
        )
    }

    /// Send an error to the reader in place of further data (ends the stream).
    pub fn fail(mut self, err: Error) {
        self.buf.clear();
        let _ = self.tx.blocking_send(Err(err));
    }

    /// Flush and close, ending the stream cleanly.
    pub fn finish(mut self) -> io::Result<()> {
        io::Write::flush(&mut self)
    }

    fn send(&mut self) -> io::Result<()> {
        if self.buf.is_empty() {
            return Ok(());
        }
        let chunk = Bytes::from(std::mem::replace(&mut self.buf, Vec::with_capacity(CHUNK)));
        self.tx
            .blocking_send(Ok(chunk))
            .map_err(|_| io::Error::new(io::ErrorKind::BrokenPipe, "stream reader went away"))
    }
}

impl io::Write for ChannelWriter {
    fn write(&mut self, data: &[u8]) -> io::Result<usize> {
        self.buf.extend_from_slice(data);
        if self.buf.len() >= CHUNK {
            self.send()?;
        }
        Ok(data.len())
    }

    fn flush(&mut self) -> io::Result<()> {
        self.send()
    }
}

impl Drop for ChannelWriter {
    fn drop(&mut self) {
        let _ = self.send();
    }
}

fn tokio_stream_from(mut rx: mpsc::Receiver<Result<Bytes>>) -> ByteStream {
    futures::stream::poll_fn(move |cx| rx.poll_recv(cx)).boxed()
}

/// `input`, read by a task of its own on the runtime and handed on in batches of at least
/// `min` bytes (the last one may be smaller), nothing copied. For a consumer on a blocking
/// thread (a [`blocking_reader`]) of a stream that arrives in small frames (an HTTP body):
/// that thread is then woken once per batch, not once per frame. Dropping the result stops
/// the task, which drops `input`.
pub fn batched(mut input: ByteStream, min: usize) -> ByteStream {
    let (tx, mut rx) = mpsc::channel::<Vec<Result<Bytes>>>(2);
    tokio::spawn(async move {
        loop {
            let (mut batch, mut n, mut end) = (Vec::new(), 0, false);
            while n < min {
                let item = tokio::select! {
                    biased;
                    () = tx.closed() => return,
                    item = input.next() => item,
                };
                match item {
                    Some(Ok(chunk)) => {
                        n += chunk.len();
                        batch.push(Ok(chunk));
                    }
                    Some(Err(e)) => {
                        batch.push(Err(e));
                        end = true;
                        break;
                    }
                    None => {
                        end = true;
                        break;
                    }
                }
            }
            if (!batch.is_empty() && tx.send(batch).await.is_err()) || end {
                return;
            }
        }
    });
    let mut ready = std::collections::VecDeque::new();
    futures::stream::poll_fn(move |cx| {
        loop {
            if let Some(item) = ready.pop_front() {
                return std::task::Poll::Ready(Some(item));
            }
            match std::task::ready!(rx.poll_recv(cx)) {
                Some(batch) => ready.extend(batch),
                None => return std::task::Poll::Ready(None),
            }
        }
    })
    .boxed()
}

/// Run blocking code that writes into a [`ChannelWriter`] on a blocking thread, returning the
/// stream right away. An error returned by `produce` ends the stream with that error.
pub fn spawn_writer<F>(depth: usize, produce: F) -> ByteStream
where
    F: FnOnce(&mut ChannelWriter) -> Result<()> + Send + 'static,
{
    let (mut writer, stream) = ChannelWriter::new(depth);
    tokio::task::spawn_blocking(move || match produce(&mut writer) {
        Ok(()) => {
            let _ = writer.finish();
        }
        Err(err) => writer.fail(err),
    });
    stream
}

/// A blocking `std::io::Read` over a [`ByteStream`], for blocking consumers (tar readers) on a
/// blocking thread.
pub fn blocking_reader(stream: ByteStream) -> impl io::Read + Send + 'static {
    tokio_util::io::SyncIoBridge::new(into_reader(stream))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{Read, Write};

    /// Batches keep every byte in order, are at least `min` bytes but the last, and the input's
    /// error comes through last.
    #[tokio::test]
    async fn batched_keeps_order_and_errors_and_hands_on_whole_batches() {
        let chunks: Vec<Result<Bytes>> = (0..100u8)
            .map(|i| Ok(Bytes::from(vec![i; 1000])))
            .chain([Err(Error::unsafe_archive("x", "cut"))])
            .collect();
        let mut out = batched(futures::stream::iter(chunks).boxed(), 4096);
        let mut bytes = Vec::new();
        let mut err = None;
        while let Some(item) = out.next().await {
            match item {
                Ok(b) => bytes.extend_from_slice(&b),
                Err(e) => err = Some(e),
            }
        }
        let want: Vec<u8> = (0..100u8).flat_map(|i| vec![i; 1000]).collect();
        assert_eq!(bytes, want);
        assert!(matches!(err, Some(Error::UnsafeArchive { .. })), "{err:?}");
    }

    /// Dropping the batched stream stops its task and drops the input, even while the input
    /// has nothing more to give.
    #[tokio::test]
    async fn dropping_a_batched_stream_drops_its_input() {
        struct Guard(std::sync::Arc<std::sync::atomic::AtomicBool>);
        impl Drop for Guard {
            fn drop(&mut self) {
                self.0.store(true, std::sync::atomic::Ordering::SeqCst);
            }
        }
        let dropped = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let guard = Guard(dropped.clone());
        let input = futures::stream::iter([Ok(Bytes::from_static(b"some"))])
            .chain(futures::stream::pending())
            .map(move |item| {
                let _ = &guard;
                item
            })
            .boxed();
        let out = batched(input, 1 << 20);
        tokio::task::yield_now().await;
        assert!(!dropped.load(std::sync::atomic::Ordering::SeqCst));
        drop(out);
        for _ in 0..100 {
            if dropped.load(std::sync::atomic::Ordering::SeqCst) {
                return;
            }
            tokio::time::sleep(std::time::Duration::from_millis(10)).await;
        }
        panic!("the input outlived the batched stream");
    }

    #[tokio::test]
    async fn slices_cross_chunk_boundaries_and_stop_reading() {
        let data: Vec<u8> = (0..=255u8).cycle().take(1000).collect();
        let pieces = |sizes: &[usize]| -> ByteStream {
            let mut at = 0;
            let mut chunks = Vec::new();
            for &n in sizes {
                chunks.push(Ok(Bytes::copy_from_slice(&data[at..at + n])));
                at += n;
            }
            // An error after the data: a slice that ends before it never reads it.
            chunks.push(Err(Error::unsafe_archive("x", "read past the slice")));
            futures::stream::iter(chunks).boxed()
        };
        let sizes = [1, 99, 300, 0, 250, 350];
        for (offset, len) in [
            (0, 1000),
            (0, 1),
            (1, 99),
            (50, 500),
            (399, 2),
            (999, 1),
            (0, 0),
        ] {
            let got = collect(slice(pieces(&sizes), offset, len), 1 << 20)
                .await
                .unwrap();
            assert_eq!(
                &got[..],
                &data[offset as usize..(offset + len) as usize],
                "{offset}+{len}"
            );
        }
        // Past the end: what there is, then the input's own end (here its error).
        assert!(
            collect(slice(pieces(&sizes), 990, 20), 1 << 20)
                .await
                .is_err()
        );
    }

    #[tokio::test]
    async fn writer_to_stream_and_back() {
        let stream = spawn_writer(2, |w| {
            for i in 0..1000u32 {
                w.write_all(&i.to_le_bytes())?;
            }
            Ok(())
        });
        let data = collect(stream, 1 << 20).await.unwrap();
        assert_eq!(data.len(), 4000);
    }

    #[tokio::test]
    async fn producer_error_reaches_reader() {
        let stream = spawn_writer(2, |w| {
            w.write_all(b"partial")?;
            Err(Error::unsafe_archive("x", "boom"))
        });
        let err = tokio::task::spawn_blocking(move || {
            let mut r = blocking_reader(stream);
            let mut out = Vec::new();
            r.read_to_end(&mut out).map_err(Error::from)
        })
        .await
        .unwrap()
        .unwrap_err();
        assert!(matches!(err, Error::UnsafeArchive { .. }), "{err}");
    }
}
