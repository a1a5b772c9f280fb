//! Pack objects and their redirects.
//!
//! A *pack* (`packs/<aa>/<id>`, `id` a UUIDv7 in 32 hex digits, `aa` its last two digits) is
//! chunks written back to back in one streamed `put`, nothing else: no header, no index. The
//! pinned manifest is the index: it gives every chunk's BLAKE3 and its location (pack, offset,
//! length), and restore checks each fetched chunk against its hash, so a location is never
//! trusted.
//!
//! A *redirect* (`packs/<aa>/<id>.moved`) is written by [`super::gc`] when it repacks a pack:
//! for every chunk of the old pack that a retained manifest still needed, its new location.
//! Restore follows it when the old pack is gone. Its encoding is binary and checked like any
//! hostile input ([`Redirect::parse`]):
//!
//! ```text
//! magic    8 bytes   "SBXMOVE1"
//! from    16 bytes   the old pack's id
//! count    4 bytes   little endian, at most MAX_PACK_CHUNKS
//! entries  count × 64 bytes, strictly ascending by hash:
//!            hash 32 · new pack 16 · offset u64 LE · len u64 LE
//! check   32 bytes   BLAKE3 of everything before
//! ```

use std::fmt;

use crate::error::Error;
use crate::snapshot::BlobKey;

/// Most chunks one pack holds (the writer seals a pack at this count; redirects are refused
/// above it).
pub const MAX_PACK_CHUNKS: usize = 1 << 18;

/// Largest piece a manifest may reference in a pack (the largest chunk is 1 MiB by default;
/// this bounds what one restore request holds in memory for a hostile manifest).
pub const MAX_PIECE_LEN: u64 = 64 << 20;

/// Redirects followed for one chunk before a restore gives up (GC keeps chains at length one;
/// the slack covers a repack running while a restore reads).
pub const MAX_REDIRECT_DEPTH: usize = 4;

const MAGIC: &[u8; 8] = b"SBXMOVE1";
const HEADER_LEN: usize = 8 + 16 + 4;
const ENTRY_LEN: usize = 32 + 16 + 8 + 8;
const CHECK_LEN: usize = 32;

/// The longest valid redirect.
pub fn max_redirect_len() -> usize {
    HEADER_LEN + MAX_PACK_CHUNKS * ENTRY_LEN + CHECK_LEN
}

/// The id of a pack: a UUIDv7 (sortable by creation time), written as 32 lowercase hex digits.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct PackId(u128);

impl PackId {
    /// A fresh id.
    pub fn generate() -> Self {
        PackId(uuid::Uuid::now_v7().as_u128())
    }

    /// Parse 32 lowercase hex digits; anything else is `None`.
    pub fn parse(s: &str) -> Option<Self> {
        if s.len() != 32 || !s.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f')) {
            return None;
        }
        u128::from_str_radix(s, 16).ok().map(PackId)
    }

    fn from_bytes(b: [u8; 16]) -> Self {
        PackId(u128::from_be_bytes(b))
    }

    fn to_bytes(self) -> [u8; 16] {
        self.0.to_be_bytes()
    }

    fn shard(self) -> String {
        format!("{:02x}", (self.0 & 0xff) as u8)
    }

    /// The pack's blob key, `packs/<aa>/<id>`.
    pub fn key(self) -> BlobKey {
        BlobKey::new(format!("packs/{}/{self}", self.shard())).expect("pack keys are valid")
    }

    /// The key of the pack's redirect, `packs/<aa>/<id>.moved`.
    pub fn redirect_key(self) -> BlobKey {
        BlobKey::new(format!("packs/{}/{self}.moved", self.shard()))
            .expect("redirect keys are valid")
    }
}

impl fmt::Display for PackId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:032x}", self.0)
    }
}

impl fmt::Debug for PackId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "PackId({self})")
    }
}

impl serde::Serialize for PackId {
    fn serialize<S: serde::Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> serde::Deserialize<'de> for PackId {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        let s = <std::borrow::Cow<'de, str>>::deserialize(d)?;
        PackId::parse(&s).ok_or_else(|| serde::de::Error::custom("a pack id is 32 hex digits"))
    }
}

/// What a key under `packs/` names.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PackBlob {
    /// A pack.
    Pack(PackId),
    /// A pack's redirect.
    Redirect(PackId),
}

impl PackBlob {
    /// Classify a key; `None` for anything that is neither (temporary files, strangers).
    pub fn of_key(key: &str) -> Option<PackBlob> {
        let rest = key.strip_prefix("packs/")?;
        let (shard, name) = rest.split_once('/')?;
        let (id, redirect) = match name.strip_suffix(".moved") {
            Some(id) => (id, true),
            None => (name, false),
        };
        let id = PackId::parse(id)?;
        if id.shard() != shard {
            return None;
        }
        Some(if redirect {
            PackBlob::Redirect(id)
        } else {
            PackBlob::Pack(id)
        })
    }
}

/// One moved chunk: where it is now.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RedirectEntry {
    /// BLAKE3 of the chunk.
    pub hash: [u8; 32],
    /// The pack now holding it.
    pub pack: PackId,
    /// Its offset there.
    pub offset: u64,
    /// Its length.
    pub len: u64,
}

/// The new locations of the chunks of a repacked pack.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Redirect {
    /// The repacked (deleted) pack.
    pub from: PackId,
    /// Entries, strictly ascending by hash.
    entries: Vec<RedirectEntry>,
}

/// Why a redirect blob was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum RedirectError {
    /// Shorter than an empty redirect.
    #[error("{len} bytes is too short for a redirect")]
    TooShort {
        /// Bytes seen.
        len: usize,
    },
    /// Not a redirect.
    #[error("bad magic")]
    BadMagic,
    /// More entries than a pack can hold.
    #[error("{count} entries exceed the limit of {max}")]
    TooMany {
        /// Entries announced.
        count: u64,
        /// The limit.
        max: usize,
    },
    /// The length does not match the count.
    #[error("{got} bytes, {expected} expected for the announced entries")]
    Length {
        /// Bytes the count implies.
        expected: usize,
        /// Bytes seen.
        got: usize,
    },
    /// The trailing checksum does not match.
    #[error("checksum mismatch")]
    Checksum,
    /// It describes another pack than the one whose key it is under.
    #[error("redirect of pack {got}, expected {expected}")]
    WrongPack {
        /// The pack of the key.
        expected: String,
        /// The pack it names.
        got: String,
    },
    /// Entries out of order or duplicated.
    #[error("entry {index} is out of order or duplicated")]
    Unsorted {
        /// The entry.
        index: usize,
    },
    /// An entry that cannot be a chunk location.
    #[error("entry {index}: {reason}")]
    BadEntry {
        /// The entry.
        index: usize,
        /// What is wrong.
        reason: &'static str,
    },
}

impl Redirect {
    /// A redirect from `from`; `entries` are sorted and deduplicated by hash here. Fails like
    /// [`parse`](Self::parse) would on what it would write.
    pub fn new(
        from: PackId,
        mut entries: Vec<RedirectEntry>,
    ) -> std::result::Result<Self, RedirectError> {
        entries.sort_by_key(|e| e.hash);
        entries.dedup_by(|a, b| a.hash == b.hash);
        let r = Redirect { from, entries };
        r.check()?;
        Ok(r)
    }

    /// The entries, ascending by hash.
    pub fn entries(&self) -> &[RedirectEntry] {
        &self.entries
    }

    /// The new location of the chunk whose BLAKE3 is `hash` (hex).
    pub fn find(&self, hash: &str) -> Option<&RedirectEntry> {
        let mut raw = [0u8; 32];
        hex::decode_to_slice(hash, &mut raw).ok()?;
        self.entries
            .binary_search_by(|e| e.hash.cmp(&raw))
            .ok()
            .map(|i| &self.entries[i])
    }

    /// Encode.
    pub fn to_bytes(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(HEADER_LEN + self.entries.len() * ENTRY_LEN + CHECK_LEN);
        out.extend_from_slice(MAGIC);
        out.extend_from_slice(&self.from.to_bytes());
        out.extend_from_slice(&(self.entries.len() as u32).to_le_bytes());
        for e in &self.entries {
            out.extend_from_slice(&e.hash);
            out.extend_from_slice(&e.pack.to_bytes());
            out.extend_from_slice(&e.offset.to_le_bytes());
            out.extend_from_slice(&e.len.to_le_bytes());
        }
        let check = blake3::hash(&out);
        out.extend_from_slice(check.as_bytes());
        out
    }

    /// Decode and check a redirect read from the store: length, magic, count, checksum, the
    /// pack it belongs to (`expected`, when known), entry order and every entry's bounds.
    pub fn parse(
        bytes: &[u8],
        expected: Option<PackId>,
    ) -> std::result::Result<Redirect, RedirectError> {
        if bytes.len() < HEADER_LEN + CHECK_LEN {
            return Err(RedirectError::TooShort { len: bytes.len() });
        }
        if &bytes[..8] != MAGIC {
            return Err(RedirectError::BadMagic);
        }
        let from = PackId::from_bytes(bytes[8..24].try_into().expect("16 bytes"));
        let count = u32::from_le_bytes(bytes[24..28].try_into().expect("4 bytes")) as usize;
        if count > MAX_PACK_CHUNKS {
            return Err(RedirectError::TooMany {
                count: count as u64,
                max: MAX_PACK_CHUNKS,
            });
        }
        let expected_len = HEADER_LEN + count * ENTRY_LEN + CHECK_LEN;
        if bytes.len() != expected_len {
            return Err(RedirectError::Length {
                expected: expected_len,
                got: bytes.len(),
            });
        }
        let (body, check) = bytes.split_at(bytes.len() - CHECK_LEN);
        if blake3::hash(body).as_bytes() != check {
            return Err(RedirectError::Checksum);
        }
        if let Some(want) = expected
            && want != from
        {
            return Err(RedirectError::WrongPack {
                expected: want.to_string(),
                got: from.to_string(),
            });
        }
        let entries = body[HEADER_LEN..]
            .chunks_exact(ENTRY_LEN)
            .map(|e| RedirectEntry {
                hash: e[..32].try_into().expect("32 bytes"),
                pack: PackId::from_bytes(e[32..48].try_into().expect("16 bytes")),
                offset: u64::from_le_bytes(e[48..56].try_into().expect("8 bytes")),
                len: u64::from_le_bytes(e[56..64].try_into().expect("8 bytes")),
            })
            .collect();
        let r = Redirect { from, entries };
        r.check()?;
        Ok(r)
    }

    fn check(&self) -> std::result::Result<(), RedirectError> {
        if self.entries.len() > MAX_PACK_CHUNKS {
            return Err(RedirectError::TooMany {
                count: self.entries.len() as u64,
                max: MAX_PACK_CHUNKS,
            });
        }
        for (index, e) in self.entries.iter().enumerate() {
            if index > 0 && self.entries[index - 1].hash >= e.hash {
                return Err(RedirectError::Unsorted { index });
            }
            let bad = |reason| Err(RedirectError::BadEntry { index, reason });
            if e.len == 0 || e.len > MAX_PIECE_LEN {
                return bad("length out of bounds");
            }
            if e.offset.checked_add(e.len).is_none() {
                return bad("offset overflows");
            }
            if e.pack == self.from {
                return bad("points at the pack it replaces");
            }
        }
        Ok(())
    }
}

impl From<(BlobKey, RedirectError)> for Error {
    fn from((key, e): (BlobKey, RedirectError)) -> Self {
        Error::unsafe_archive(key.as_str(), format!("redirect: {e}"))
    }
}

/// One chunk wanted from a pack: its hash (hex), absolute offset and length.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Piece {
    pub hash: String,
    pub offset: u64,
    pub len: u64,
}

/// One ranged read of a pack covering several pieces, in the order the caller wants them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct RangeRead {
    pub pack: PackId,
    pub offset: u64,
    pub len: u64,
    pub pieces: Vec<Piece>,
}

impl RangeRead {
    /// Grow the read to cover `piece` too (see [`Coalesce::extends`]).
    pub fn extend(&mut self, piece: Piece) {
        self.len = (piece.offset + piece.len).max(self.offset + self.len) - self.offset;
        self.pieces.push(piece);
    }
}

/// Coalescing bounds for restore reads.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Coalesce {
    /// Largest gap of unwanted bytes read through to join two pieces.
    pub max_gap: u64,
    /// Largest span of one read (a single larger piece is read alone).
    pub max_read: u64,
}

impl Default for Coalesce {
    fn default() -> Self {
        // Reads of 4 MiB took a 1 GiB restore from ~50 to ~87 MiB peak RSS (each read is one
        // buffer held until its last piece is consumed, several in flight, and glibc keeps
        // freed large buffers in per-thread arenas); 1 MiB, the largest chunk, keeps it there.
        Coalesce {
            max_gap: 64 << 10,
            max_read: 1 << 20,
        }
    }
}

impl Coalesce {
    /// Whether `piece` of `pack` extends `read` (same pack, starting inside the read or at
    /// most `max_gap` after it, and the grown read stays within `max_read`).
    pub fn extends(&self, read: &RangeRead, pack: PackId, piece: &Piece) -> bool {
        let end = read.offset + read.len;
        read.pack == pack
            && piece.offset >= read.offset
            && piece.offset <= end.saturating_add(self.max_gap)
            && (piece.offset + piece.len).max(end) - read.offset <= self.max_read
    }

    /// Add `piece` to `reads`: into the last read when it [`extends`](Self::extends) it, else
    /// as a new read.
    pub fn push(&self, reads: &mut Vec<RangeRead>, pack: PackId, piece: Piece) {
        if let Some(last) = reads.last_mut()
            && self.extends(last, pack, &piece)
        {
            last.extend(piece);
            return;
        }
        reads.push(RangeRead {
            pack,
            offset: piece.offset,
            len: piece.len,
            pieces: vec![piece],
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(n: u8, pack: PackId) -> RedirectEntry {
        RedirectEntry {
            hash: *blake3::hash(&[n]).as_bytes(),
            pack,
            offset: u64::from(n) * 10,
            len: 10,
        }
    }

    #[test]
    fn ids_and_keys() {
        let id = PackId::generate();
        assert_eq!(PackId::parse(&id.to_string()), Some(id));
        assert_eq!(
            PackBlob::of_key(id.key().as_str()),
            Some(PackBlob::Pack(id))
        );
        assert_eq!(
            PackBlob::of_key(id.redirect_key().as_str()),
            Some(PackBlob::Redirect(id))
        );
        assert_eq!(PackBlob::of_key("packs/00/x"), None);
        let wrong_shard = format!("packs/zz/{id}");
        assert_eq!(PackBlob::of_key(&wrong_shard), None);
        assert_eq!(PackId::parse(&id.to_string().to_uppercase()), None);
        assert_eq!(PackId::parse("+0000000000000000000000000000000"), None);
    }

    #[test]
    fn redirect_round_trip_and_lookup() {
        let (from, to) = (PackId::generate(), PackId::generate());
        let r = Redirect::new(from, (0..20).rev().map(|n| entry(n, to)).collect()).unwrap();
        let back = Redirect::parse(&r.to_bytes(), Some(from)).unwrap();
        assert_eq!(back, r);
        let h = blake3::hash(&[7]).to_hex().to_string();
        assert_eq!(back.find(&h).map(|e| e.offset), Some(70));
        assert!(back.find(&"0".repeat(64)).is_none());
        assert!(back.find("zz").is_none());
    }

    /// The fuzz target's seed is a valid redirect (regenerate with `SANDBOX_WRITE_SEED=1`).
    #[test]
    fn fuzz_seed_parses() {
        let path = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../../fuzz/seeds/redirect/valid"
        );
        if std::env::var_os("SANDBOX_WRITE_SEED").is_some() {
            let from = PackId::parse("01a22dde00007000800000000000aa01").unwrap();
            let to = PackId::parse("01a22dde00007000800000000000bb02").unwrap();
            let r = Redirect::new(from, (0..3).map(|n| entry(n, to)).collect()).unwrap();
            std::fs::create_dir_all(std::path::Path::new(path).parent().unwrap()).unwrap();
            std::fs::write(path, r.to_bytes()).unwrap();
        }
        let seed = std::fs::read(path).expect("the seed exists");
        let r = Redirect::parse(&seed, None).expect("the seed parses");
        assert_eq!(r.entries().len(), 3);
    }

    #[test]
    fn hostile_redirects_are_refused() {
        let (from, to) = (PackId::generate(), PackId::generate());
        let good = Redirect::new(from, vec![entry(1, to), entry(2, to)])
            .unwrap()
            .to_bytes();
        let reseal = |mut b: Vec<u8>| {
            let n = b.len() - CHECK_LEN;
            let check = *blake3::hash(&b[..n]).as_bytes();
            b[n..].copy_from_slice(&check);
            b
        };
        let mut magic = good.clone();
        magic[0] = b'X';
        let mut flipped = good.clone();
        flipped[40] ^= 1;
        let mut count = good.clone();
        count[24..28].copy_from_slice(&u32::MAX.to_le_bytes());
        let mut count3 = good.clone();
        count3[24..28].copy_from_slice(&3u32.to_le_bytes());
        let mut swapped = good.clone();
        let (a, b) = (HEADER_LEN, HEADER_LEN + ENTRY_LEN);
        let first: Vec<u8> = swapped[a..b].to_vec();
        swapped.copy_within(b..b + ENTRY_LEN, a);
        swapped[b..b + ENTRY_LEN].copy_from_slice(&first);
        let mut zero_len = good.clone();
        zero_len[HEADER_LEN + 56..HEADER_LEN + 64].fill(0);
        let mut overflow = good.clone();
        overflow[HEADER_LEN + 48..HEADER_LEN + 56].fill(0xff);
        let mut self_ref = good.clone();
        self_ref[HEADER_LEN + 32..HEADER_LEN + 48].copy_from_slice(&from.to_bytes());
        type Case = (&'static str, Vec<u8>, fn(&RedirectError) -> bool);
        let cases: Vec<Case> = vec![
            ("empty", Vec::new(), |e| {
                matches!(e, RedirectError::TooShort { .. })
            }),
            ("magic", magic, |e| matches!(e, RedirectError::BadMagic)),
            ("checksum", flipped, |e| {
                matches!(e, RedirectError::Checksum)
            }),
            ("count", reseal(count), |e| {
                matches!(e, RedirectError::TooMany { .. })
            }),
            ("length", reseal(count3), |e| {
                matches!(e, RedirectError::Length { .. })
            }),
            ("truncated", good[..good.len() - 1].to_vec(), |e| {
                matches!(e, RedirectError::Length { .. })
            }),
            ("order", reseal(swapped), |e| {
                matches!(e, RedirectError::Unsorted { .. })
            }),
            ("zero length", reseal(zero_len), |e| {
                matches!(e, RedirectError::BadEntry { .. })
            }),
            ("overflow", reseal(overflow), |e| {
                matches!(e, RedirectError::BadEntry { .. })
            }),
            ("self", reseal(self_ref), |e| {
                matches!(e, RedirectError::BadEntry { .. })
            }),
        ];
        for (name, bytes, want) in cases {
            let err = Redirect::parse(&bytes, Some(from)).expect_err(name);
            assert!(want(&err), "{name}: {err}");
        }
        let other = Redirect::parse(&good, Some(to)).expect_err("wrong pack");
        assert!(matches!(other, RedirectError::WrongPack { .. }), "{other}");
    }

    #[test]
    fn coalescing_is_bounded() {
        let (p, q) = (PackId::generate(), PackId::generate());
        let c = Coalesce {
            max_gap: 10,
            max_read: 100,
        };
        let piece = |offset, len| Piece {
            hash: String::new(),
            offset,
            len,
        };
        let mut reads = Vec::new();
        c.push(&mut reads, p, piece(0, 20));
        c.push(&mut reads, p, piece(20, 20)); // adjacent
        c.push(&mut reads, p, piece(45, 20)); // gap 5
        c.push(&mut reads, p, piece(0, 20)); // the same chunk again: inside the read
        c.push(&mut reads, p, piece(90, 20)); // gap 25: new read
        c.push(&mut reads, q, piece(110, 5)); // other pack
        c.push(&mut reads, q, piece(115, 100)); // would grow past max_read
        c.push(&mut reads, q, piece(0, 5)); // backwards
        let spans: Vec<(u64, u64, usize)> = reads
            .iter()
            .map(|r| (r.offset, r.len, r.pieces.len()))
            .collect();
        assert_eq!(
            spans,
            vec![
                (0, 65, 4),
                (90, 20, 1),
                (110, 5, 1),
                (115, 100, 1),
                (0, 5, 1)
            ]
        );
    }
}
