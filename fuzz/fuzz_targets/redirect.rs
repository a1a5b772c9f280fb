//! Arbitrary bytes as a pack redirect: parsing never panics, and what parses re-encodes to the
//! same bytes, and every lookup of one of its hashes finds that entry.
#![no_main]

use libfuzzer_sys::fuzz_target;
use sandbox_core::snapshot::pack::Redirect;

fuzz_target!(|data: &[u8]| {
    if let Ok(r) = Redirect::parse(data, None) {
        assert_eq!(
            r.to_bytes(),
            data,
            "a parsed redirect re-encodes to its bytes"
        );
        let again = Redirect::parse(data, Some(r.from)).expect("parses for its own pack");
        assert_eq!(again, r);
        for e in r.entries() {
            let found = r.find(&hex_of(&e.hash)).expect("its own hash is found");
            assert_eq!(found, e);
        }
    }
});

fn hex_of(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}
