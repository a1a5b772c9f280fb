//! What the store does with the bytes it is given ([`OssOptions`]), and how it reaches an S3
//! bucket ([`S3Config`], feature `aws`).

use std::fmt;
use std::time::Duration;

/// One MiB.
pub const MIB: usize = 1024 * 1024;

/// The smallest part S3 accepts (every part of a multipart upload but the last).
pub const MIN_PART: usize = 5 * MIB;

/// The most parts one S3 multipart upload may have.
pub const MAX_PARTS: usize = 10_000;

/// The largest part S3 accepts.
pub const MAX_PART: usize = 5 * 1024 * MIB;

/// Upload, listing and time limits of an [`OssSnapshotStore`](crate::OssSnapshotStore).
///
/// The defaults keep an upload's memory under about `single_put_max` + `max_parts_in_flight`
/// × `part_size` (16 + 3 × 5 MiB) for blobs up to tens of GiB; parts grow past that (see
/// [`part_size`](Self::part_size)).
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct OssOptions {
    /// The first part size of a multipart upload (default 5 MiB, S3's minimum). For a blob of
    /// unknown length the part size doubles every 1,000 parts, so S3's 10,000 parts cover
    /// about 4.9 TiB; for a blob of known length it is chosen once, so that 10,000 parts cover
    /// it.
    pub part_size: usize,
    /// How many parts upload at once (default 3); the input is not read further while they
    /// all run.
    pub max_parts_in_flight: usize,
    /// Blobs up to this size (default 16 MiB) go up in one `PUT`: one request, atomic, no
    /// multipart upload to clean up. A blob of unknown length is buffered up to this size
    /// before a multipart upload starts.
    pub single_put_max: usize,
    /// Objects per listing request (default 1,000, S3's maximum).
    pub list_page: usize,
    /// Time limit of one request that carries no blob body (HEAD, DELETE, a listing page,
    /// opening a GET, starting, completing or aborting a multipart upload), retries
    /// included (default 60 s): past it the call fails with [`sandbox_core::Error::Timeout`].
    pub operation_timeout: Duration,
    /// S3: time limit to open a connection (default 5 s).
    pub connect_timeout: Duration,
    /// S3: time limit of one HTTP request, body included (default 120 s). A GET whose body
    /// outlives it is resumed from where it stopped.
    pub request_timeout: Duration,
    /// S3: how long a connection may go without receiving a byte (default 30 s): how a
    /// stalled store is detected.
    pub read_timeout: Duration,
    /// S3: retries of a failed idempotent request (default 3), with exponential backoff.
    pub max_retries: usize,
    /// S3: no retry starts later than this after the first attempt (default 15 s).
    pub retry_timeout: Duration,
}

impl Default for OssOptions {
    fn default() -> Self {
        OssOptions {
            part_size: MIN_PART,
            max_parts_in_flight: 3,
            single_put_max: 16 * MIB,
            list_page: 1000,
            operation_timeout: Duration::from_secs(60),
            connect_timeout: Duration::from_secs(5),
            request_timeout: Duration::from_secs(120),
            read_timeout: Duration::from_secs(30),
            max_retries: 3,
            retry_timeout: Duration::from_secs(15),
        }
    }
}

impl OssOptions {
    /// Set [`part_size`](Self::part_size).
    pub fn part_size(mut self, bytes: usize) -> Self {
        self.part_size = bytes;
        self
    }

    /// Set [`max_parts_in_flight`](Self::max_parts_in_flight).
    pub fn max_parts_in_flight(mut self, parts: usize) -> Self {
        self.max_parts_in_flight = parts;
        self
    }

    /// Set [`single_put_max`](Self::single_put_max).
    pub fn single_put_max(mut self, bytes: usize) -> Self {
        self.single_put_max = bytes;
        self
    }

    /// Set [`list_page`](Self::list_page).
    pub fn list_page(mut self, objects: usize) -> Self {
        self.list_page = objects;
        self
    }

    /// Set [`operation_timeout`](Self::operation_timeout).
    pub fn operation_timeout(mut self, limit: Duration) -> Self {
        self.operation_timeout = limit;
        self
    }

    /// Set [`connect_timeout`](Self::connect_timeout).
    pub fn connect_timeout(mut self, limit: Duration) -> Self {
        self.connect_timeout = limit;
        self
    }

    /// Set [`request_timeout`](Self::request_timeout).
    pub fn request_timeout(mut self, limit: Duration) -> Self {
        self.request_timeout = limit;
        self
    }

    /// Set [`read_timeout`](Self::read_timeout).
    pub fn read_timeout(mut self, limit: Duration) -> Self {
        self.read_timeout = limit;
        self
    }

    /// Set [`max_retries`](Self::max_retries).
    pub fn max_retries(mut self, retries: usize) -> Self {
        self.max_retries = retries;
        self
    }

    /// Set [`retry_timeout`](Self::retry_timeout).
    pub fn retry_timeout(mut self, limit: Duration) -> Self {
        self.retry_timeout = limit;
        self
    }

    pub(crate) fn check(&self) -> sandbox_core::Result<()> {
        let bad = |reason: &str| Err(sandbox_core::Error::invalid("object store options", reason));
        if self.part_size == 0 || self.part_size > MAX_PART {
            return bad("part_size must be between 1 byte and 5 GiB");
        }
        if self.max_parts_in_flight == 0 || self.list_page == 0 {
            return bad("max_parts_in_flight and list_page must be at least 1");
        }
        for (name, d) in [
            ("operation_timeout", self.operation_timeout),
            ("connect_timeout", self.connect_timeout),
            ("request_timeout", self.request_timeout),
            ("read_timeout", self.read_timeout),
        ] {
            if d.is_zero() {
                return bad(&format!("{name} is zero"));
            }
        }
        Ok(())
    }

    /// The most bytes of one upload's input held in memory at once (parts of the first 1,000
    /// sizes): a blob up to `single_put_max` whole, or the parts in flight and the one being
    /// filled.
    pub(crate) fn buffered_per_put(&self) -> u64 {
        let parts = (self.max_parts_in_flight as u64 + 1).saturating_mul(self.part_size as u64);
        parts.max(self.single_put_max as u64)
    }

    /// The size of part `index` (from 0) of a multipart upload of a blob of `known` length
    /// (or of unknown length).
    pub(crate) fn part_len(&self, index: usize, known: Option<u64>) -> usize {
        match known {
            // One size for every part: the smallest 1-MiB multiple that lets 10,000 parts
            // cover the blob.
            Some(total) => {
                let needed = total.div_ceil(MAX_PARTS as u64).div_ceil(MIB as u64) * MIB as u64;
                (self.part_size as u64).max(needed).min(MAX_PART as u64) as usize
            }
            // Doubles every 1,000 parts: small blobs keep small parts (little memory), and
            // 10,000 parts still reach about 4.9 TiB from 5 MiB.
            None => {
                let doublings = (index / 1000).min(20) as u32;
                self.part_size
                    .saturating_mul(1usize << doublings)
                    .min(MAX_PART)
            }
        }
    }
}

/// A credential that never shows in `Debug` or logs.
#[derive(Clone, PartialEq, Eq)]
pub(crate) struct Secret(pub(crate) String);

impl fmt::Debug for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("\"***\"")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unknown_lengths_reach_terabytes_in_10000_growing_parts() {
        let o = OssOptions::default();
        let sizes: Vec<usize> = (0..MAX_PARTS).map(|i| o.part_len(i, None)).collect();
        assert_eq!(sizes[0], MIN_PART);
        assert!(sizes.windows(2).all(|w| w[0] <= w[1]), "parts never shrink");
        assert!(sizes.iter().all(|&s| (MIN_PART..=MAX_PART).contains(&s)));
        let total: u128 = sizes.iter().map(|&s| s as u128).sum();
        assert!(
            total >= 4 * (1u128 << 40),
            "10,000 parts cover {total} bytes"
        );
        // The first thousand parts (5 GB) stay at the minimum: a 64 MiB pack needs 13 parts of
        // 5 MiB, never more memory.
        assert_eq!(sizes[999], MIN_PART);
        assert_eq!(sizes[1000], 2 * MIN_PART);
    }

    #[test]
    fn known_lengths_get_one_part_size_that_fits_10000_parts() {
        let o = OssOptions::default();
        assert_eq!(o.part_len(0, Some(100 * MIB as u64)), MIN_PART);
        let big = 1u64 << 40; // 1 TiB
        let part = o.part_len(7, Some(big));
        assert_eq!(part % MIB, 0);
        assert!(part as u64 * MAX_PARTS as u64 >= big);
        assert!(
            ((part - MIB) as u64) * (MAX_PARTS as u64) < big,
            "the smallest that fits"
        );
        assert_eq!(o.part_len(0, Some(u64::MAX)), MAX_PART);
    }

    #[test]
    fn a_put_holds_a_single_put_blob_or_its_parts() {
        // Defaults: three 5 MiB parts in flight and one filling pass the 16 MiB single PUT.
        assert_eq!(OssOptions::default().buffered_per_put(), 20 * MIB as u64);
        let one_put = OssOptions::default().single_put_max(64 * MIB);
        assert_eq!(one_put.buffered_per_put(), 64 * MIB as u64);
    }

    #[test]
    fn options_are_checked() {
        assert!(OssOptions::default().check().is_ok());
        assert!(OssOptions::default().part_size(0).check().is_err());
        assert!(
            OssOptions::default()
                .max_parts_in_flight(0)
                .check()
                .is_err()
        );
        assert!(
            OssOptions::default()
                .read_timeout(Duration::ZERO)
                .check()
                .is_err()
        );
    }
}
