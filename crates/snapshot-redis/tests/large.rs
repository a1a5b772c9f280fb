//! A 100 MiB blob on a real Redis: no value larger than a part, and the process's peak memory
//! while putting and getting it a small fraction of the blob. Alone in its test binary, so
//! nothing else allocates while the peak is measured.

mod common;

use bytes::Bytes;
use futures::StreamExt;
use sandbox_core::snapshot::BlobKey;
use sandbox_core::stream::ByteStream;
use sandbox_core::testkit::blobs::pattern;

const MIB: u64 = 1024 * 1024;
const SIZE: u64 = 100 * MIB + 12_345;
const PIECE: usize = 256 * 1024;

/// `SIZE` bytes made as they are read (never held whole), and their hash.
fn generated() -> (ByteStream, blake3::Hash) {
    let mut hasher = blake3::Hasher::new();
    for (i, len) in pieces() {
        hasher.update(&pattern(i, len));
    }
    let stream = futures::stream::iter(pieces())
        .map(|(i, len)| Ok(Bytes::from(pattern(i, len))))
        .boxed();
    (stream, hasher.finalize())
}

fn pieces() -> impl Iterator<Item = (u64, usize)> + Send + 'static {
    let n = SIZE.div_ceil(PIECE as u64);
    (0..n).map(|i| {
        let len = (SIZE - i * PIECE as u64).min(PIECE as u64) as usize;
        (i, len)
    })
}

/// A field of `/proc/self/status`, in bytes.
fn status_bytes(field: &str) -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").expect("/proc/self/status");
    let line = status
        .lines()
        .find(|l| l.starts_with(field))
        .unwrap_or_else(|| panic!("no {field} in /proc/self/status"));
    let kib: u64 = line
        .split_whitespace()
        .nth(1)
        .and_then(|v| v.parse().ok())
        .expect("a number of kB");
    kib * 1024
}

/// Reset the peak resident set size to the current one (`/proc/self/clear_refs`, value 5).
fn reset_peak() -> u64 {
    std::fs::write("/proc/self/clear_refs", "5").expect("reset the peak RSS");
    status_bytes("VmRSS:")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[cfg_attr(not(redis_tests), ignore = "needs Redis; run by cargo xtask test")]
async fn a_100_mib_blob_is_cut_into_parts_with_bounded_memory() {
    // Replaced parts go at once: the warm-up blob's part is not counted below.
    let options = common::options().replaced_grace(std::time::Duration::ZERO);
    let part = options.part_size as u64;
    assert_eq!(part, MIB, "the default part size");
    let (store, _purge) = common::store_with(options.clone()).await;
    let key = BlobKey::new("packs/00/large.pack").unwrap();
    // Connect and load the scripts first: the measured peak is the transfer's.
    store
        .put(&key, sandbox_core::stream::once("warm-up"), Some(7))
        .await
        .unwrap();

    let (input, want) = generated();
    let before = reset_peak();
    let written = store.put(&key, input, None).await.expect("put");
    let put_peak = status_bytes("VmHWM:").saturating_sub(before);
    assert_eq!(written, SIZE);

    let before = reset_peak();
    let mut got = store.get(&key).await.expect("get");
    let mut hasher = blake3::Hasher::new();
    let mut n = 0u64;
    while let Some(chunk) = got.next().await {
        let chunk = chunk.expect("read");
        n += chunk.len() as u64;
        hasher.update(&chunk);
    }
    let get_peak = status_bytes("VmHWM:").saturating_sub(before);
    assert_eq!(n, SIZE);
    assert_eq!(hasher.finalize(), want, "the blob comes back intact");
    println!(
        "{SIZE} bytes: peak RSS above the start {:.1} MiB while putting, {:.1} MiB while getting",
        put_peak as f64 / MIB as f64,
        get_peak as f64 / MIB as f64
    );
    // Parts in flight, their encoded copies, the part being filled, the input's pieces and the
    // allocator's slack: a few MiB. A store that held the blob would need over 100.
    for (what, peak) in [("put", put_peak), ("get", get_peak)] {
        assert!(
            peak < 32 * MIB,
            "{what}: the peak RSS grew by {peak} bytes for a {SIZE}-byte blob"
        );
    }

    // Every value is at most one part.
    let prefix = &options.connection.key_prefix;
    let names = common::keys(&options.connection.url, prefix).await;
    let mut c = common::raw(&options.connection.url).await;
    let mut strings = 0u64;
    let mut largest = 0u64;
    for name in &names {
        let kind: String = redis::cmd("TYPE")
            .arg(name)
            .query_async(&mut c)
            .await
            .unwrap();
        let usage: u64 = redis::cmd("MEMORY")
            .arg("USAGE")
            .arg(name)
            .query_async(&mut c)
            .await
            .unwrap();
        assert!(
            usage <= part + part / 2,
            "{name} ({kind}) takes {usage} bytes of Redis memory"
        );
        if kind == "string" {
            let len: u64 = redis::cmd("STRLEN")
                .arg(name)
                .query_async(&mut c)
                .await
                .unwrap();
            assert!(len <= part, "{name} holds {len} bytes, over the part size");
            largest = largest.max(len);
            strings += 1;
        }
    }
    assert_eq!(
        strings,
        SIZE.div_ceil(part),
        "one string per part of the blob (the warm-up blob's part went at the replacement)"
    );
    assert_eq!(largest, part);
}
