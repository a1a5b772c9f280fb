//! [`RedisSnapshotOptions`]: the connection (store-redis's [`RedisOptions`]) and how blobs are
//! cut into parts, how long they live and how long replaced parts stay readable.

use std::time::Duration;

use sandbox_core::{Error, Result};
use store_redis::RedisOptions;

/// The largest part size accepted: far below Redis's 512 MB value limit, and small enough that
/// a few parts in flight stay a few hundred MiB at worst.
pub const MAX_PART_SIZE: usize = 64 * 1024 * 1024;

/// The smallest part size accepted.
pub const MIN_PART_SIZE: usize = 1024;

/// Options of [`RedisSnapshotStore`](crate::RedisSnapshotStore).
///
/// | option | default | what |
/// | --- | --- | --- |
/// | `connection` | [`RedisOptions::default()`] | URL, key prefix, connect and response timeouts, `page_size` (index entries per listing page) |
/// | `part_size` | 1 MiB | bytes per part key; 1 KiB ..= 64 MiB |
/// | `parts_in_flight` | 4 | part writes (and reads) pipelined at once; memory is about `part_size` × (2 × this + 1) per transfer |
/// | `ttl` | none | every key of a blob expires this long after its put |
/// | `replaced_grace` | 60 s | parts of a replaced or deleted blob stay readable this long for readers that already started |
/// | `upload_ttl` | 1 h | parts of a put not yet published expire after this unless the put renews them (every third of it): a crashed writer leaves nothing for longer |
///
/// `Debug` shows the URL with its password replaced by `***`.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct RedisSnapshotOptions {
    /// Where and how to connect, the key prefix, the listing's page size.
    pub connection: RedisOptions,
    /// Bytes per part (the last part of a blob may be shorter).
    pub part_size: usize,
    /// Part writes and reads in flight at once.
    pub parts_in_flight: usize,
    /// Expiry of every key of a blob, from its put (`None`: never).
    pub ttl: Option<Duration>,
    /// How long the parts of a replaced or deleted blob remain for readers already reading.
    pub replaced_grace: Duration,
    /// Expiry of parts written by a put that has not published them yet (renewed by the put
    /// every third of it while it runs).
    pub upload_ttl: Duration,
}

impl Default for RedisSnapshotOptions {
    fn default() -> Self {
        RedisSnapshotOptions {
            connection: RedisOptions::default(),
            part_size: 1024 * 1024,
            parts_in_flight: 4,
            ttl: None,
            replaced_grace: Duration::from_secs(60),
            upload_ttl: Duration::from_secs(3600),
        }
    }
}

impl RedisSnapshotOptions {
    /// Defaults with the server at `url`.
    pub fn new(url: impl Into<String>) -> Self {
        RedisSnapshotOptions {
            connection: RedisOptions::new(url),
            ..RedisSnapshotOptions::default()
        }
    }

    /// Defaults over these connection options (URL, prefix, timeouts, page size).
    pub fn with_connection(connection: RedisOptions) -> Self {
        RedisSnapshotOptions {
            connection,
            ..RedisSnapshotOptions::default()
        }
    }

    /// Set the key prefix (one per deployment sharing a server; no `{` or `}`).
    pub fn key_prefix(mut self, prefix: impl Into<String>) -> Self {
        self.connection.key_prefix = prefix.into();
        self
    }

    /// Set the limit of one connection attempt.
    pub fn connect_timeout(mut self, timeout: Duration) -> Self {
        self.connection.connect_timeout = timeout;
        self
    }

    /// Set the limit of one command or script (past it: [`Error::Timeout`]).
    pub fn response_timeout(mut self, timeout: Duration) -> Self {
        self.connection.response_timeout = timeout;
        self
    }

    /// Set how many index entries a listing reads per page.
    pub fn page_size(mut self, entries: usize) -> Self {
        self.connection.page_size = entries;
        self
    }

    /// Set the bytes per part.
    pub fn part_size(mut self, bytes: usize) -> Self {
        self.part_size = bytes;
        self
    }

    /// Set how many part transfers are in flight at once.
    pub fn parts_in_flight(mut self, n: usize) -> Self {
        self.parts_in_flight = n;
        self
    }

    /// Let every key of a blob expire `ttl` after its put (`None`: never).
    pub fn ttl(mut self, ttl: impl Into<Option<Duration>>) -> Self {
        self.ttl = ttl.into();
        self
    }

    /// Set how long parts of a replaced or deleted blob stay readable (zero: removed at once).
    pub fn replaced_grace(mut self, grace: Duration) -> Self {
        self.replaced_grace = grace;
        self
    }

    /// Set the expiry of parts a put has written but not published yet.
    pub fn upload_ttl(mut self, ttl: Duration) -> Self {
        self.upload_ttl = ttl;
        self
    }

    /// Refuse values the store cannot work with.
    pub(crate) fn check(&self) -> Result<()> {
        if !(MIN_PART_SIZE..=MAX_PART_SIZE).contains(&self.part_size) {
            return Err(Error::invalid(
                "redis snapshot options",
                format!(
                    "part_size {} is outside {MIN_PART_SIZE}..={MAX_PART_SIZE} bytes",
                    self.part_size
                ),
            ));
        }
        if self.parts_in_flight == 0 || self.parts_in_flight > 64 {
            return Err(Error::invalid(
                "redis snapshot options",
                "parts_in_flight must be 1..=64",
            ));
        }
        if self.ttl.is_some_and(|t| t < Duration::from_millis(1)) {
            return Err(Error::invalid(
                "redis snapshot options",
                "ttl is below a millisecond (use None for blobs that never expire)",
            ));
        }
        if self.upload_ttl < Duration::from_secs(1) {
            return Err(Error::invalid(
                "redis snapshot options",
                "upload_ttl is below a second",
            ));
        }
        Ok(())
    }
}

/// Whole milliseconds, a sub-millisecond rest rounded up (`PX` takes milliseconds).
pub(crate) fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_micros().div_ceil(1000)).unwrap_or(u64::MAX)
}
