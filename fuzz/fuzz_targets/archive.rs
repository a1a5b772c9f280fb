//! Arbitrary bytes as an archive: the validator and the extractor must never panic, never
//! create anything outside the destination, and whatever `rewrite` accepts must be accepted
//! again unchanged (canonical output is a fixed point).
#![no_main]

use std::path::Path;

use libfuzzer_sys::fuzz_target;
use sandbox_core::archive::{self, ArchivePolicy, RewriteHooks};

struct Plain;
impl RewriteHooks for Plain {}

fn policy() -> ArchivePolicy {
    let mut p = ArchivePolicy::default();
    p.max_entries = 1000;
    p.max_total_bytes = 1 << 20;
    p
}

fn inside(root: &Path, dir: &Path) {
    for entry in std::fs::read_dir(dir).unwrap() {
        let entry = entry.unwrap();
        let meta = std::fs::symlink_metadata(entry.path()).unwrap();
        assert!(entry.path().starts_with(root));
        if meta.is_dir() {
            inside(root, &entry.path());
        }
    }
}

fuzz_target!(|data: &[u8]| {
    let outer = tempfile::tempdir().unwrap();
    let dest = outer.path().join("dest");
    std::fs::create_dir(&dest).unwrap();
    let _ = archive::extract_blocking(data, &dest, policy());
    // Only `dest` exists beside nothing else in the outer directory.
    let names: Vec<_> = std::fs::read_dir(outer.path()).unwrap().map(|e| e.unwrap().file_name()).collect();
    assert_eq!(names.len(), 1, "extraction wrote outside its destination: {names:?}");
    inside(&dest, &dest);

    let mut input = data;
    if let Ok(canonical) = archive::rewrite(&mut input, Vec::new(), policy(), &mut Plain) {
        let mut again = &canonical[..];
        let second = archive::rewrite(&mut again, Vec::new(), policy(), &mut Plain).expect("canonical output must be accepted");
        assert_eq!(second, canonical, "canonical output must be a fixed point");
    }
});
