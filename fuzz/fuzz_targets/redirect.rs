//! Arbitrary bytes as a pack redirect: parsing never panics, what parses re-encodes to the same
//! bytes, and every lookup of one of its hashes finds that entry. Each input is parsed twice:
//! as it is, and with its trailing checksum recomputed, so that mutations reach the checks
//! behind the checksum (count, length, order, entry bounds).
#![no_main]

use libfuzzer_sys::fuzz_target;
use sandbox_core::snapshot::pack::Redirect;

fuzz_target!(|data: &[u8]| {
    check(data);
    if data.len() >= 32 {
        let mut sealed = data.to_vec();
        let body = sealed.len() - 32;
        let sum = *blake3::hash(&sealed[..body]).as_bytes();
        sealed[body..].copy_from_slice(&sum);
        check(&sealed);
    }
});

fn check(data: &[u8]) {
    if let Ok(r) = Redirect::parse(data, None) {
        assert_eq!(
            r.to_bytes(),
            data,
            "a parsed redirect re-encodes to its bytes"
        );
        let again = Redirect::parse(data, Some(r.from)).expect("parses for its own pack");
        assert_eq!(again, r);
        for e in r.entries() {
            let hex: String = e.hash.iter().map(|x| format!("{x:02x}")).collect();
            assert_eq!(r.find(&hex), Some(e), "its own hash is found");
        }
    }
}
