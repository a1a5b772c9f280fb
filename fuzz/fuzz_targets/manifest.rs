//! Arbitrary bytes as a manifest: parsing never panics, what parses re-encodes to something
//! that parses to the same manifest, and no parsed reference is longer than a piece may be
//! (restore sizes reads from these lengths; seeds `hostile-*` hold the shapes that once
//! aborted a restore).
#![no_main]

use libfuzzer_sys::fuzz_target;
use sandbox_core::archive::ArchivePolicy;
use sandbox_core::snapshot::Manifest;
use sandbox_core::snapshot::pack::MAX_PIECE_LEN;

fuzz_target!(|data: &[u8]| {
    let policy = ArchivePolicy::default();
    if let Ok(m) = Manifest::read_from(data, &policy) {
        let bytes = m.to_bytes();
        let again = Manifest::read_from(&bytes[..], &policy).expect("re-encoded manifest parses");
        assert_eq!(again, m);
        for c in m.entries.iter().flat_map(|e| &e.chunks) {
            assert!(c.len <= MAX_PIECE_LEN, "unbounded reference {c:?}");
        }
    }
});
