//! Arbitrary bytes as a manifest: parsing never panics, and what parses re-encodes to
//! something that parses to the same manifest.
#![no_main]

use libfuzzer_sys::fuzz_target;
use sandbox_core::archive::ArchivePolicy;
use sandbox_core::snapshot::Manifest;

fuzz_target!(|data: &[u8]| {
    let policy = ArchivePolicy::default();
    if let Ok(m) = Manifest::read_from(data, &policy) {
        let bytes = m.to_bytes();
        let again = Manifest::read_from(&bytes[..], &policy).expect("re-encoded manifest parses");
        assert_eq!(again, m);
    }
});
