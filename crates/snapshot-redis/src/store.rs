//! [`RedisSnapshotStore`]: blobs cut into part keys, published by one metadata switch, listed
//! from a sorted-set index.

use std::fmt;
use std::sync::Arc;

use async_trait::async_trait;
use bytes::{Bytes, BytesMut};
use futures::StreamExt;
use futures::stream::FuturesUnordered;
use redis::Value;
use sandbox_core::snapshot::{BlobKey, BlobMeta, BlobStream, SnapshotStore, WriteHints};
use sandbox_core::stream::ByteStream;
use sandbox_core::{Error, Reach, Result};
use store_redis::conn::{Conn, Damage, strings};

use crate::options::{MAX_PART_SIZE, RedisSnapshotOptions, millis};
use crate::scripts::{ABANDON, DELETE, OPEN, PRUNE, PUBLISH};

/// The largest part a script carries (the one part of a small blob written by the publish,
/// the first bytes of a read returned by the open): beyond this, moving bytes through Lua
/// costs more than the round trip it saves.
const INLINE_MAX: u64 = 16 * 1024;

/// The metadata fields, in the order they are read.
const FIELDS: [&str; 5] = ["gen", "size", "parts", "part_size", "modified_ms"];

/// Snapshot blobs in Redis, shared by every replica ([`Reach::Cluster`]).
///
/// A blob is cut into parts of at most `part_size` bytes, each under a key of its own and of
/// its put's generation; one script then switches the blob's metadata to that generation and
/// indexes the key. See the crate docs for the key layout, TTLs and limits.
#[derive(Clone)]
pub struct RedisSnapshotStore {
    inner: Arc<Inner>,
}

struct Inner {
    conn: Conn,
    prefix: String,
    part_size: usize,
    in_flight: usize,
    ttl_ms: Option<u64>,
    grace_ms: u64,
    upload_ttl_ms: u64,
    page_size: usize,
    /// The server's clock minus ours (ms), from the last reply that carried it: turns a
    /// publish's local deadline into the server's time. (Measured when the reply arrives, so
    /// a deadline computed with it errs early: the safe side.)
    clock_offset_ms: std::sync::Mutex<Option<i64>>,
}

/// This host's clock, ms since the epoch.
fn local_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as i64)
}

impl fmt::Debug for RedisSnapshotStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let i = &self.inner;
        f.debug_struct("RedisSnapshotStore")
            .field("service", &i.conn.service())
            .field("prefix", &i.prefix)
            .field("part_size", &i.part_size)
            .field("ttl_ms", &i.ttl_ms)
            .finish_non_exhaustive()
    }
}

/// A blob's metadata as stored (a hash at `<prefix>blob:{<key>}`).
#[derive(Debug, Clone, PartialEq, Eq)]
struct Meta {
    gen_id: String,
    size: u64,
    parts: u64,
    part_size: u64,
    modified_ms: i64,
}

impl Meta {
    /// The length of part `n`.
    fn part_len(&self, n: u64) -> u64 {
        if n + 1 < self.parts {
            self.part_size
        } else {
            self.size - n * self.part_size
        }
    }

    /// Check a hash read with [`FIELDS`]: `None` when the blob does not exist.
    fn parse(fields: &[Option<Vec<u8>>]) -> std::result::Result<Option<Meta>, String> {
        if fields.iter().all(Option::is_none) {
            return Ok(None);
        }
        let text = |i: usize| -> std::result::Result<&str, String> {
            let raw = fields
                .get(i)
                .and_then(Option::as_deref)
                .ok_or_else(|| format!("the metadata has no `{}`", FIELDS[i]))?;
            std::str::from_utf8(raw).map_err(|_| format!("`{}` is not text", FIELDS[i]))
        };
        let number = |i: usize| -> std::result::Result<u64, String> {
            let t = text(i)?;
            t.parse::<u64>()
                .map_err(|_| format!("`{}` is not a number: {t:.40}", FIELDS[i]))
        };
        let gen_id = text(0)?;
        if gen_id.len() != 32
            || !gen_id
                .bytes()
                .all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'))
        {
            return Err("`gen` is not a generation id".to_owned());
        }
        let (size, parts, part_size) = (number(1)?, number(2)?, number(3)?);
        if part_size == 0 || part_size > MAX_PART_SIZE as u64 {
            return Err(format!("`part_size` {part_size} is out of range"));
        }
        if parts != size.div_ceil(part_size) {
            return Err(format!(
                "{parts} parts cannot hold {size} bytes in parts of {part_size}"
            ));
        }
        let modified_ms = i64::try_from(number(4)?).map_err(|_| "`modified_ms` is too large")?;
        Ok(Some(Meta {
            gen_id: gen_id.to_owned(),
            size,
            parts,
            part_size,
            modified_ms,
        }))
    }
}

impl RedisSnapshotStore {
    /// A store over `options` (checked here; no I/O: it connects on first use, inside a tokio
    /// runtime).
    pub fn new(options: RedisSnapshotOptions) -> Result<RedisSnapshotStore> {
        options.check()?;
        let conn = Conn::new(&options.connection, Damage::Kv)?;
        Ok(RedisSnapshotStore {
            inner: Arc::new(Inner {
                conn,
                prefix: options.connection.key_prefix.clone(),
                part_size: options.part_size,
                in_flight: options.parts_in_flight,
                ttl_ms: options.ttl.map(millis),
                grace_ms: millis(options.replaced_grace),
                upload_ttl_ms: millis(options.upload_ttl),
                page_size: options.connection.page_size,
                clock_offset_ms: std::sync::Mutex::new(None),
            }),
        })
    }

    /// Whether the server answers (a readiness probe).
    pub async fn ping(&self) -> Result<()> {
        self.inner.conn.ping().await
    }

    /// The bytes per part of new blobs.
    pub fn part_size(&self) -> usize {
        self.inner.part_size
    }
}

impl Inner {
    /// `<prefix>blob:{<key>}`: the metadata hash.
    fn meta_key(&self, key: &str) -> String {
        format!("{}blob:{{{key}}}", self.prefix)
    }

    /// `<prefix>blob:{<key>}:`: what part keys start with (then `<gen>:<n>`).
    fn part_base(&self, key: &str) -> String {
        format!("{}blob:{{{key}}}:", self.prefix)
    }

    /// `<prefix>blobs`: the index (a sorted set of blob keys, all of score 0, read by range).
    fn index_key(&self) -> String {
        format!("{}blobs", self.prefix)
    }

    fn part_key(&self, key: &str, gen_id: &str, n: u64) -> String {
        format!("{}{gen_id}:{n}", self.part_base(key))
    }

    fn damaged(&self, operation: &'static str, key: &str, reason: impl fmt::Display) -> Error {
        self.conn
            .damaged(operation, format!("blob `{key}`: {reason}"))
    }

    /// The blob's metadata, `None` when it does not exist.
    async fn meta(&self, operation: &'static str, key: &str) -> Result<Option<Meta>> {
        let meta_key = self.meta_key(key);
        let meta_key = &meta_key;
        let fields: Vec<Option<Vec<u8>>> = self
            .conn
            .run(operation, |mut c| async move {
                redis::cmd("HMGET")
                    .arg(meta_key)
                    .arg(&FIELDS[..])
                    .query_async(&mut c)
                    .await
            })
            .await?;
        Meta::parse(&fields).map_err(|reason| self.damaged(operation, key, reason))
    }

    /// Write one part under the upload TTL.
    async fn set_part(&self, part_key: String, part: Bytes) -> Result<()> {
        let (part_key, part, ttl) = (&part_key, &part, self.upload_ttl_ms);
        self.conn
            .run("put", |mut c| async move {
                redis::cmd("SET")
                    .arg(part_key)
                    .arg(&part[..])
                    .arg("PX")
                    .arg(ttl)
                    .query_async::<()>(&mut c)
                    .await
            })
            .await
    }

    /// Restart the upload TTL of parts `0..started` of an unpublished generation (parts not
    /// written yet get theirs with their `SET`).
    async fn renew_parts(&self, key: &str, gen_id: &str, started: u64) -> Result<()> {
        let mut pipe = redis::pipe();
        for n in 0..started {
            pipe.cmd("PEXPIRE")
                .arg(self.part_key(key, gen_id, n))
                .arg(self.upload_ttl_ms)
                .ignore();
        }
        let pipe = &pipe;
        self.conn
            .run("put", |mut c| async move {
                pipe.query_async::<()>(&mut c).await
            })
            .await
    }

    /// Read bytes `[start, start + len)` of part `n` (the whole part with `GET`, else
    /// `GETRANGE`). A part that is missing or of another length is reported by what happened:
    /// the blob was replaced or removed while read ([`Error::Conflict`]), or it is damaged.
    async fn read_part(
        &self,
        key: &str,
        meta: &Meta,
        n: u64,
        start: u64,
        len: u64,
    ) -> Result<Bytes> {
        let part_key = self.part_key(key, &meta.gen_id, n);
        let whole = start == 0 && len == meta.part_len(n);
        let part_key = &part_key;
        let got: Vec<u8> = self
            .conn
            .run("get", |mut c| async move {
                if whole {
                    redis::cmd("GET")
                        .arg(part_key)
                        .query_async::<Option<Vec<u8>>>(&mut c)
                        .await
                        .map(Option::unwrap_or_default)
                } else {
                    redis::cmd("GETRANGE")
                        .arg(part_key)
                        .arg(start)
                        .arg(start + len - 1)
                        .query_async(&mut c)
                        .await
                }
            })
            .await?;
        self.checked(key, meta, n, got, len).await
    }

    /// `got`, read from part `n`, if it has the `len` bytes expected; else what happened.
    async fn checked(
        &self,
        key: &str,
        meta: &Meta,
        n: u64,
        got: Vec<u8>,
        len: u64,
    ) -> Result<Bytes> {
        if got.len() as u64 == len {
            return Ok(Bytes::from(got));
        }
        match self.meta("get", key).await? {
            Some(now) if now.gen_id == meta.gen_id => Err(self.damaged(
                "get",
                key,
                format!(
                    "part {n} holds {} bytes where {len} were expected",
                    got.len()
                ),
            )),
            _ => Err(Error::Conflict {
                key: key.to_owned(),
                reason: "the blob was replaced or removed while it was read (its parts outlive \
                         that by `replaced_grace` only)"
                    .to_owned(),
            }),
        }
    }

    /// Stream `len` bytes of the blob from `offset`: the metadata and the first part's bytes
    /// come in one round trip ([`OPEN`]), the other parts after, a few ahead.
    async fn open(self: &Arc<Self>, key: &BlobKey, offset: u64, len: u64) -> Result<ByteStream> {
        let (meta_key, base) = (self.meta_key(key.as_str()), self.part_base(key.as_str()));
        let (meta_key, base) = (&meta_key, &base);
        // Lua numbers are doubles: keep what the script adds up exact.
        let (offset, len) = (offset.min(1 << 52), len.min(1 << 52));
        let mut reply: Vec<Option<Vec<u8>>> = self
            .conn
            .run("get", |mut c| async move {
                OPEN.key(meta_key)
                    .arg(base)
                    .arg(offset)
                    .arg(len)
                    .arg(INLINE_MAX)
                    .invoke_async(&mut c)
                    .await
            })
            .await?;
        if reply.len() != FIELDS.len() + 1 {
            return Err(self.damaged("get", key.as_str(), "the metadata could not be read"));
        }
        let first = reply.pop().flatten().unwrap_or_default();
        let meta = Meta::parse(&reply)
            .map_err(|reason| self.damaged("get", key.as_str(), reason))?
            .ok_or_else(|| not_found(key))?;
        let end = offset.saturating_add(len).min(meta.size);
        if offset >= end {
            return Ok(futures::stream::empty().boxed());
        }
        let n = offset / meta.part_size;
        let first_end = end.min(n * meta.part_size + meta.part_len(n));
        if first_end - offset > INLINE_MAX {
            return Ok(self.stream(key, meta, offset, end));
        }
        let first = self
            .checked(key.as_str(), &meta, n, first, first_end - offset)
            .await?;
        let rest = self.stream(key, meta, first_end, end);
        Ok(futures::stream::once(async move { Ok(first) })
            .chain(rest)
            .boxed())
    }

    /// Stream bytes `[offset, end)` of the blob `meta` describes, a few parts ahead.
    fn stream(self: &Arc<Self>, key: &BlobKey, meta: Meta, offset: u64, end: u64) -> ByteStream {
        if offset >= end {
            return futures::stream::empty().boxed();
        }
        let ps = meta.part_size;
        let (first, last) = (offset / ps, (end - 1) / ps);
        let (inner, key, meta) = (self.clone(), key.as_str().to_owned(), Arc::new(meta));
        let ahead = self.in_flight.div_ceil(2).max(1);
        futures::stream::iter(first..=last)
            .map(move |n| {
                let (inner, key, meta) = (inner.clone(), key.clone(), meta.clone());
                async move {
                    let from = offset.max(n * ps) - n * ps;
                    let to = end.min(n * ps + meta.part_len(n)) - n * ps;
                    inner.read_part(&key, &meta, n, from, to - from).await
                }
            })
            .buffered(ahead)
            .boxed()
    }

    /// Write the parts of `data` under `gen_id`; returns the bytes and parts, and the only
    /// part of a blob that fits in one, left for the publish to write.
    async fn write_parts(
        &self,
        key: &str,
        data: &mut ByteStream,
        size: Option<u64>,
        orphans: &mut Orphans,
    ) -> Result<(u64, u64, Option<Bytes>)> {
        let ps = self.part_size;
        let mut buf = BytesMut::new();
        let mut writes = FuturesUnordered::new();
        let mut total = 0u64;
        let too_long = |total: u64| {
            Error::invalid(
                "blob size",
                format!("the stream gave {total} bytes, {size:?} were announced"),
            )
        };
        // Parts written wait for the publish under the upload TTL, renewed while the put
        // lasts (a slow input, a long blob).
        let renew_every = std::time::Duration::from_millis(self.upload_ttl_ms / 3);
        let mut renew_at = tokio::time::Instant::now() + renew_every;
        loop {
            // Part writes progress while the input is awaited.
            let next = tokio::select! {
                biased;
                done = writes.next(), if !writes.is_empty() => {
                    let done: Option<Result<()>> = done;
                    done.expect("not empty")?;
                    continue;
                }
                () = tokio::time::sleep_until(renew_at), if orphans.started > 0 => {
                    self.renew_parts(key, &orphans.gen_id, orphans.started).await?;
                    renew_at = tokio::time::Instant::now() + renew_every;
                    continue;
                }
                chunk = data.next() => chunk,
            };
            let Some(chunk) = next else { break };
            let mut chunk = chunk?;
            total += chunk.len() as u64;
            if size.is_some_and(|s| total > s) {
                return Err(too_long(total));
            }
            while !chunk.is_empty() {
                let part = if buf.is_empty() && chunk.len() >= ps {
                    chunk.split_to(ps)
                } else {
                    if buf.is_empty() {
                        buf.reserve(ps);
                    }
                    let take = (ps - buf.len()).min(chunk.len());
                    buf.extend_from_slice(&chunk.split_to(take));
                    if buf.len() < ps {
                        continue;
                    }
                    buf.split().freeze()
                };
                while writes.len() >= self.in_flight {
                    writes.next().await.expect("not empty")?;
                }
                let n = orphans.started;
                orphans.started += 1;
                writes.push(self.set_part(self.part_key(key, &orphans.gen_id, n), part));
            }
        }
        if size.is_some_and(|s| total != s) {
            return Err(too_long(total));
        }
        let mut single = None;
        if !buf.is_empty() {
            let n = orphans.started;
            orphans.started += 1;
            if n == 0 && buf.len() as u64 <= INLINE_MAX {
                single = Some(buf.freeze());
            } else {
                writes.push(self.set_part(self.part_key(key, &orphans.gen_id, n), buf.freeze()));
            }
        }
        while let Some(done) = writes.next().await {
            done?;
        }
        Ok((total, orphans.started, single))
    }

    /// The switch: publish `gen_id` as the blob (see [`PUBLISH`]), writing its `single` part
    /// first when given.
    async fn publish(
        &self,
        key: &str,
        gen_id: &str,
        size: u64,
        parts: u64,
        single: Option<&Bytes>,
    ) -> Result<()> {
        let (meta_key, index, base) = (self.meta_key(key), self.index_key(), self.part_base(key));
        let ttl = self.ttl_ms.map(|t| t.to_string()).unwrap_or_default();
        let (meta_key, index, base, ttl) = (&meta_key, &index, &base, &ttl);
        let (part_size, grace) = (self.part_size, self.grace_ms);
        let deadline = (local_ms()
            + i64::try_from(self.conn.budget().as_millis()).unwrap_or(i64::MAX / 2)
            + self.clock_offset().await?)
            .to_string();
        let deadline = &deadline;
        let reply: Value = self
            .conn
            .run("put", |mut c| async move {
                let mut call = PUBLISH.key(meta_key);
                call.key(index)
                    .arg(key)
                    .arg(base)
                    .arg(gen_id)
                    .arg(size)
                    .arg(parts)
                    .arg(part_size)
                    .arg(ttl)
                    .arg(grace)
                    .arg(deadline);
                if let Some(part) = single {
                    call.arg(&part[..]);
                }
                call.invoke_async(&mut c).await
            })
            .await?;
        match strings(&reply).as_deref() {
            Some([ok, server_ms]) if ok == "ok" => {
                if let Ok(server_ms) = server_ms.parse::<i64>() {
                    self.set_clock_offset(server_ms);
                }
                Ok(())
            }
            // It arrived after its caller gave up (who therefore saw a timeout): nothing was
            // published. Said as the timeout it is.
            Some([expired]) if expired == "expired" => Err(Error::Timeout {
                operation: format!(
                    "redis put of `{key}` (the publish reached the server after its deadline)"
                ),
                after: self.conn.budget(),
            }),
            Some([missing, n]) if missing == "missing" => Err(Error::Timeout {
                operation: format!(
                    "redis put of `{key}`: part {n} expired before the blob was published \
                     (the upload took longer than upload_ttl)"
                ),
                after: std::time::Duration::from_millis(self.upload_ttl_ms),
            }),
            _ => Err(self.conn.unexpected("put", &reply)),
        }
    }

    /// The server's clock minus ours, asked with `TIME` the first time.
    async fn clock_offset(&self) -> Result<i64> {
        if let Some(offset) = *self
            .clock_offset_ms
            .lock()
            .unwrap_or_else(|e| e.into_inner())
        {
            return Ok(offset);
        }
        let (secs, micros): (i64, i64) = self
            .conn
            .run("time", |mut c| async move {
                redis::cmd("TIME").query_async(&mut c).await
            })
            .await?;
        Ok(self.set_clock_offset(secs * 1000 + micros / 1000))
    }

    fn set_clock_offset(&self, server_ms: i64) -> i64 {
        let offset = server_ms - local_ms();
        *self
            .clock_offset_ms
            .lock()
            .unwrap_or_else(|e| e.into_inner()) = Some(offset);
        offset
    }

    /// Remove the parts of an unpublished generation (see [`ABANDON`]).
    async fn abandon(&self, key: &str, gen_id: &str, started: u64) -> Result<u64> {
        let (meta_key, base) = (self.meta_key(key), self.part_base(key));
        let (meta_key, base) = (&meta_key, &base);
        self.conn
            .run("put clean-up", |mut c| async move {
                ABANDON
                    .key(meta_key)
                    .arg(base)
                    .arg(gen_id)
                    .arg(started)
                    .invoke_async(&mut c)
                    .await
            })
            .await
    }

    /// One page of the index after `after` (exclusive) under `prefix`, with each blob's
    /// metadata; entries whose metadata expired are pruned.
    async fn list_page(
        &self,
        prefix: &str,
        after: Option<&str>,
    ) -> Result<(Vec<Result<BlobMeta>>, Option<String>)> {
        let min: Vec<u8> = match after {
            Some(a) => [b"(", a.as_bytes()].concat(),
            None if prefix.is_empty() => b"-".to_vec(),
            None => [b"[", prefix.as_bytes()].concat(),
        };
        // Every key under `prefix` sorts before `prefix` + 0xFF (keys are ASCII).
        let max: Vec<u8> = if prefix.is_empty() {
            b"+".to_vec()
        } else {
            [b"(", prefix.as_bytes(), &[0xFF]].concat()
        };
        let index = self.index_key();
        let (index, min, max, count) = (&index, &min, &max, self.page_size);
        let members: Vec<Vec<u8>> = self
            .conn
            .run("list", |mut c| async move {
                redis::cmd("ZRANGEBYLEX")
                    .arg(index)
                    .arg(min)
                    .arg(max)
                    .arg("LIMIT")
                    .arg(0)
                    .arg(count)
                    .query_async(&mut c)
                    .await
            })
            .await?;
        let next = (members.len() == count)
            .then(|| {
                members
                    .last()
                    .map(|m| String::from_utf8_lossy(m).into_owned())
            })
            .flatten();
        let mut pipe = redis::pipe();
        for m in &members {
            pipe.cmd("HMGET")
                .arg(self.meta_key(&String::from_utf8_lossy(m)))
                .arg(&FIELDS[..]);
        }
        let pipe = &pipe;
        let metas: Vec<Vec<Option<Vec<u8>>>> = if members.is_empty() {
            Vec::new()
        } else {
            self.conn
                .run(
                    "list",
                    |mut c| async move { pipe.query_async(&mut c).await },
                )
                .await?
        };
        let mut out = Vec::with_capacity(members.len());
        let mut gone = Vec::new();
        for (member, fields) in members.iter().zip(&metas) {
            let name = String::from_utf8_lossy(member);
            let key = match BlobKey::new(name.as_ref()) {
                Ok(k) if k.as_str().starts_with(prefix) => k,
                _ => {
                    out.push(Err(self.damaged(
                        "list",
                        &name,
                        "the index holds a name that is not a blob key",
                    )));
                    continue;
                }
            };
            match Meta::parse(fields) {
                Ok(Some(meta)) => out.push(Ok(BlobMeta::new(
                    key,
                    meta.size,
                    Some(meta.modified_ms.div_euclid(1000)),
                ))),
                Ok(None) => gone.push(key),
                Err(reason) => out.push(Err(self.damaged("list", key.as_str(), reason))),
            }
        }
        if !gone.is_empty() {
            let head = format!("{}blob:{{", self.prefix);
            let (head, gone) = (&head, &gone);
            let pruned = self
                .conn
                .run("list", |mut c| async move {
                    let mut call = PRUNE.key(index);
                    call.arg(head);
                    for k in gone {
                        call.arg(k.as_str());
                    }
                    call.invoke_async::<u64>(&mut c).await
                })
                .await;
            // The listing is right without it: a later one prunes them.
            if let Err(e) = pruned {
                tracing::debug!(error = %e, "pruning expired index entries failed");
            }
        }
        Ok((out, next))
    }
}

/// The parts a put has started: removed when the put fails, and when its future is dropped
/// (on a task, as `Drop` cannot wait), unless the generation was published. Parts that even
/// this misses (the process died, Redis was unreachable) expire after the upload TTL.
struct Orphans {
    inner: Arc<Inner>,
    key: String,
    gen_id: String,
    started: u64,
    armed: bool,
}

impl Orphans {
    /// Remove them now (best effort; the upload TTL is the backstop).
    async fn clean(&mut self) {
        if self.started > 0
            && let Err(e) = self
                .inner
                .abandon(&self.key, &self.gen_id, self.started)
                .await
        {
            tracing::warn!(key = %self.key, error = %e, "removing the parts of a failed put failed; they expire after upload_ttl");
        }
        self.armed = false;
    }
}

impl Drop for Orphans {
    fn drop(&mut self) {
        if !self.armed || self.started == 0 {
            return;
        }
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let (inner, key, gen_id, started) = (
            self.inner.clone(),
            std::mem::take(&mut self.key),
            std::mem::take(&mut self.gen_id),
            self.started,
        );
        // Sent on the same connection after every part write already handed to it, so it
        // runs after them on the server.
        runtime.spawn(async move {
            if let Err(e) = inner.abandon(&key, &gen_id, started).await {
                tracing::warn!(key = %key, error = %e, "removing the parts of a dropped put failed; they expire after upload_ttl");
            }
        });
    }
}

#[async_trait]
impl SnapshotStore for RedisSnapshotStore {
    fn name(&self) -> &'static str {
        "redis"
    }

    fn reach(&self) -> Reach {
        Reach::Cluster
    }

    /// The part being filled and the parts in flight, each with its encoded copy.
    fn write_hints(&self) -> WriteHints {
        let i = &self.inner;
        WriteHints::buffering((2 * i.in_flight as u64 + 1) * i.part_size as u64)
    }

    #[tracing::instrument(level = "debug", name = "redis_blob_put", skip_all, fields(key = %key, size = ?size))]
    async fn put(&self, key: &BlobKey, mut data: ByteStream, size: Option<u64>) -> Result<u64> {
        let inner = &self.inner;
        let mut orphans = Orphans {
            inner: inner.clone(),
            key: key.as_str().to_owned(),
            gen_id: uuid::Uuid::new_v4().simple().to_string(),
            started: 0,
            armed: true,
        };
        let written = inner
            .write_parts(key.as_str(), &mut data, size, &mut orphans)
            .await;
        let (total, parts, single) = match written {
            Ok(w) => w,
            Err(e) => {
                orphans.clean().await;
                return Err(e);
            }
        };
        match inner
            .publish(key.as_str(), &orphans.gen_id, total, parts, single.as_ref())
            .await
        {
            Ok(()) => {
                orphans.armed = false;
                Ok(total)
            }
            Err(e) => {
                // Removes nothing if the publish landed after all.
                orphans.clean().await;
                Err(e)
            }
        }
    }

    #[tracing::instrument(level = "debug", name = "redis_blob_get", skip_all, fields(key = %key))]
    async fn get(&self, key: &BlobKey) -> Result<ByteStream> {
        self.inner.open(key, 0, u64::MAX).await
    }

    #[tracing::instrument(level = "debug", name = "redis_blob_get_range", skip_all, fields(key = %key, offset, len))]
    async fn get_range(&self, key: &BlobKey, offset: u64, len: u64) -> Result<ByteStream> {
        self.inner.open(key, offset, len).await
    }

    #[tracing::instrument(level = "debug", name = "redis_blob_exists", skip_all, fields(key = %key))]
    async fn exists(&self, key: &BlobKey) -> Result<bool> {
        let meta_key = self.inner.meta_key(key.as_str());
        let meta_key = &meta_key;
        let n: u64 = self
            .inner
            .conn
            .run("exists", |mut c| async move {
                redis::cmd("EXISTS").arg(meta_key).query_async(&mut c).await
            })
            .await?;
        Ok(n > 0)
    }

    #[tracing::instrument(level = "debug", name = "redis_blob_delete", skip_all, fields(key = %key))]
    async fn delete(&self, key: &BlobKey) -> Result<()> {
        let inner = &self.inner;
        let (meta_key, index, base) = (
            inner.meta_key(key.as_str()),
            inner.index_key(),
            inner.part_base(key.as_str()),
        );
        let (meta_key, index, base, grace) = (&meta_key, &index, &base, inner.grace_ms);
        let reply: Value = inner
            .conn
            .run("delete", |mut c| async move {
                DELETE
                    .key(meta_key)
                    .key(index)
                    .arg(key.as_str())
                    .arg(base)
                    .arg(grace)
                    .invoke_async(&mut c)
                    .await
            })
            .await?;
        match strings(&reply).as_deref() {
            Some([ok]) if ok == "ok" => Ok(()),
            _ => Err(inner.conn.unexpected("delete", &reply)),
        }
    }

    fn list(&self, prefix: &str) -> BlobStream {
        struct Page {
            inner: Arc<Inner>,
            prefix: String,
            after: Option<String>,
            done: bool,
        }
        let start = Page {
            inner: self.inner.clone(),
            prefix: prefix.to_owned(),
            after: None,
            done: false,
        };
        futures::stream::unfold(start, |mut page| async move {
            if page.done {
                return None;
            }
            match page
                .inner
                .list_page(&page.prefix, page.after.as_deref())
                .await
            {
                Ok((items, next)) => {
                    page.done = next.is_none();
                    page.after = next;
                    Some((items, page))
                }
                Err(e) => {
                    page.done = true;
                    Some((vec![Err(e)], page))
                }
            }
        })
        .flat_map(futures::stream::iter)
        .boxed()
    }

    /// Nothing to sweep: an unpublished put's parts are written under the upload TTL (renewed
    /// only while the put runs) and its metadata is written only by the publish, so a writer
    /// killed mid-`put` leaves keys that expire on their own within `upload_ttl`, and nothing
    /// a listing shows. Listing the server's keys to find them sooner would cost a `SCAN` of
    /// the whole keyspace.
    async fn sweep_leftovers(
        &self,
        _sweep: sandbox_core::LeftoverSweep,
    ) -> Result<sandbox_core::LeftoverReport> {
        Ok(sandbox_core::LeftoverReport::default())
    }
}

fn not_found(key: &BlobKey) -> Error {
    Error::NotFound {
        what: "snapshot blob",
        key: key.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fields(v: [Option<&str>; 5]) -> Vec<Option<Vec<u8>>> {
        v.iter().map(|f| f.map(|s| s.as_bytes().to_vec())).collect()
    }

    const GEN: &str = "0123456789abcdef0123456789abcdef";

    #[test]
    fn metadata_is_checked() {
        assert_eq!(Meta::parse(&fields([None; 5])), Ok(None));
        let ok = Meta::parse(&fields([
            Some(GEN),
            Some("2097153"),
            Some("3"),
            Some("1048576"),
            Some("1764500000123"),
        ]))
        .unwrap()
        .unwrap();
        assert_eq!((ok.part_len(0), ok.part_len(2)), (1048576, 1));
        let empty = Meta::parse(&fields([
            Some(GEN),
            Some("0"),
            Some("0"),
            Some("1024"),
            Some("1"),
        ]));
        assert_eq!(empty.unwrap().unwrap().parts, 0);
        // Hostile counts: a part count that does not match the size (2^64 - 1 parts for one
        // byte, 2^36 parts for 2^36 bytes in 1 MiB parts) is refused; a consistent huge blob
        // is accepted and only ever read part by part (nothing is sized from its length).
        for (size, parts) in [
            ("1", "18446744073709551615"),
            ("68719476736", "68719476736"),
        ] {
            let m = Meta::parse(&fields([
                Some(GEN),
                Some(size),
                Some(parts),
                Some("1048576"),
                Some("1"),
            ]));
            assert!(m.is_err(), "{size} bytes in {parts} parts");
        }
        let huge = Meta::parse(&fields([
            Some(GEN),
            Some("68719476736"),
            Some("65536"),
            Some("1048576"),
            Some("1"),
        ]))
        .unwrap()
        .unwrap();
        assert_eq!(huge.part_len(65535), 1 << 20);
        for bad in [
            [Some(GEN), None, Some("1"), Some("1024"), Some("1")],
            [Some("zz"), Some("1"), Some("1"), Some("1024"), Some("1")],
            [Some(GEN), Some("x"), Some("1"), Some("1024"), Some("1")],
            [Some(GEN), Some("5000"), Some("1"), Some("1024"), Some("1")],
            [Some(GEN), Some("1"), Some("1"), Some("0"), Some("1")],
            [
                Some(GEN),
                Some("1"),
                Some("1"),
                Some("999999999999"),
                Some("1"),
            ],
            [Some(GEN), Some("1"), Some("1"), Some("1024"), Some("-5")],
            [
                Some(GEN),
                Some("18446744073709551615"),
                Some("1"),
                Some("1024"),
                Some("1"),
            ],
        ] {
            assert!(Meta::parse(&fields(bad)).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn options_are_checked() {
        use std::time::Duration;
        for bad in [
            RedisSnapshotOptions::default().part_size(10),
            RedisSnapshotOptions::default().part_size(MAX_PART_SIZE + 1),
            RedisSnapshotOptions::default().parts_in_flight(0),
            RedisSnapshotOptions::default().ttl(Duration::ZERO),
            RedisSnapshotOptions::default().upload_ttl(Duration::from_millis(10)),
            RedisSnapshotOptions::default().key_prefix("a{b}"),
        ] {
            let err = RedisSnapshotStore::new(bad).unwrap_err();
            assert_eq!(err.kind(), sandbox_core::ErrorKind::InvalidInput, "{err}");
        }
        let secret = "s3cr3t-MARKER";
        let store =
            RedisSnapshotStore::new(RedisSnapshotOptions::new(format!("redis://:{secret}@h:1")))
                .unwrap();
        assert!(!format!("{store:?}").contains(secret));
    }
}
