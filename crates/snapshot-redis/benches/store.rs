//! `cargo bench -p snapshot-redis --bench store`: the Redis snapshot store against the same
//! bytes moved with plain pipelined commands, in the same run, on a `redis-server` this bench
//! starts (a free loopback port, a temporary directory, no persistence; killed at the end, also
//! on failure). `SANDBOX_TEST_REDIS_SERVER` names the binary (else `redis-server` on the PATH).
//!
//! Workloads (median of `ROUNDS`):
//! - put of a 64 MiB blob (a pack) streamed in 256 KiB pieces, against `SET`s of its 1 MiB
//!   parts with as many in flight (the floor: what any layout of 1 MiB values costs);
//! - get of it, against `GET`s of the parts;
//! - 200 ranged reads of 64 KiB, then of 4 KiB, at scattered offsets, against one `GETRANGE`
//!   each;
//! - 500 puts of 4 KiB blobs one after another, against one `SET` each.
//!
//! Prints a table: times, the ratio to the floor, and commands per operation.
//! `BENCH_IN_FLIGHT` sets the store's `parts_in_flight` (default 4, as the floor's).

use std::time::{Duration, Instant};

use bytes::Bytes;
use futures::StreamExt;
use sandbox_core::snapshot::{BlobKey, SnapshotStore, SnapshotStoreExt as _};
use sandbox_core::stream::ByteStream;
use snapshot_redis::{RedisSnapshotOptions, RedisSnapshotStore};
use store_redis::testkit::Server;

const MIB: usize = 1024 * 1024;
const BLOB: usize = 64 * MIB;
const ROUNDS: usize = 5;
const RANGES: usize = 200;
const SMALL: usize = 500;

fn data() -> Bytes {
    let mut x: u64 = 0x9E37_79B9_7F4A_7C15;
    let mut out = Vec::with_capacity(BLOB);
    while out.len() < BLOB {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        out.extend_from_slice(&x.to_le_bytes());
    }
    Bytes::from(out)
}

fn pieces(data: &Bytes) -> ByteStream {
    let data = data.clone();
    futures::stream::iter((0..data.len()).step_by(256 * 1024))
        .map(move |at| Ok(data.slice(at..(at + 256 * 1024).min(data.len()))))
        .boxed()
}

fn median(mut v: Vec<Duration>) -> Duration {
    v.sort();
    v[v.len() / 2]
}

async fn commands(c: &mut redis::aio::MultiplexedConnection) -> u64 {
    let info: String = redis::cmd("INFO")
        .arg("stats")
        .query_async(c)
        .await
        .expect("INFO");
    info.lines()
        .find_map(|l| l.strip_prefix("total_commands_processed:"))
        .and_then(|v| v.trim().parse().ok())
        .expect("total_commands_processed")
}

struct Row {
    what: &'static str,
    store: Duration,
    floor: Duration,
    store_cmds: f64,
    floor_cmds: f64,
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let server = Server::start(&["--save", "", "--appendonly", "no"]);
    let url = server.url(None);
    let in_flight: usize = std::env::var("BENCH_IN_FLIGHT")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(4);
    let store = RedisSnapshotStore::new(
        RedisSnapshotOptions::new(&url)
            .key_prefix("bench:")
            .parts_in_flight(in_flight),
    )
    .expect("store");
    let mut raw = redis::Client::open(url.as_str())
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap();
    let blob = data();
    let key = BlobKey::new("packs/00/bench.pack").unwrap();
    let parts: Vec<Bytes> = (0..BLOB)
        .step_by(MIB)
        .map(|at| blob.slice(at..at + MIB))
        .collect();
    let mut rows = Vec::new();

    // Put.
    let (mut s, mut f) = (Vec::new(), Vec::new());
    let (mut sc, mut fc) = (0, 0);
    for round in 0..ROUNDS {
        let before = commands(&mut raw).await;
        let t = Instant::now();
        store.put(&key, pieces(&blob), None).await.expect("put");
        s.push(t.elapsed());
        let mid = commands(&mut raw).await;
        let t = Instant::now();
        futures::stream::iter(parts.iter().enumerate())
            .map(|(n, p)| {
                let mut c = raw.clone();
                async move {
                    redis::cmd("SET")
                        .arg(format!("floor:{round}:{n}"))
                        .arg(&p[..])
                        .query_async::<()>(&mut c)
                        .await
                }
            })
            .buffer_unordered(4)
            .for_each(|r| async move { r.expect("SET") })
            .await;
        f.push(t.elapsed());
        let after = commands(&mut raw).await;
        sc = mid - before - 1;
        fc = after - mid - 1;
    }
    rows.push(Row {
        what: "put 64 MiB (streamed, 1 MiB parts)",
        store: median(s),
        floor: median(f),
        store_cmds: sc as f64,
        floor_cmds: fc as f64,
    });

    // Get.
    let (mut s, mut f) = (Vec::new(), Vec::new());
    for _ in 0..ROUNDS {
        let before = commands(&mut raw).await;
        let t = Instant::now();
        let mut got = store.get(&key).await.expect("get");
        let mut n = 0;
        while let Some(c) = got.next().await {
            n += c.expect("read").len();
        }
        assert_eq!(n, BLOB);
        s.push(t.elapsed());
        let mid = commands(&mut raw).await;
        let t = Instant::now();
        let n: usize = futures::stream::iter(0..parts.len())
            .map(|i| {
                let mut c = raw.clone();
                async move {
                    redis::cmd("GET")
                        .arg(format!("floor:0:{i}"))
                        .query_async::<Vec<u8>>(&mut c)
                        .await
                        .expect("GET")
                        .len()
                }
            })
            .buffered(2)
            .fold(0, |a, b| async move { a + b })
            .await;
        assert_eq!(n, BLOB);
        f.push(t.elapsed());
        let after = commands(&mut raw).await;
        sc = mid - before - 1;
        fc = after - mid - 1;
    }
    rows.push(Row {
        what: "get 64 MiB",
        store: median(s),
        floor: median(f),
        store_cmds: sc as f64,
        floor_cmds: fc as f64,
    });

    // Ranged reads.
    for (len, what) in [
        (65_536usize, "200 ranges of 64 KiB"),
        (4096, "200 ranges of 4 KiB"),
    ] {
        let offsets: Vec<usize> = (0..RANGES)
            .map(|i| (i * 7_919 * 4096 + 12_345) % (BLOB - len))
            .collect();
        let (mut s, mut f) = (Vec::new(), Vec::new());
        for _ in 0..ROUNDS {
            let before = commands(&mut raw).await;
            let t = Instant::now();
            for &at in &offsets {
                let got = sandbox_core::stream::collect(
                    store
                        .get_range(&key, at as u64, len as u64)
                        .await
                        .expect("range"),
                    1 << 20,
                )
                .await
                .expect("read");
                if got[..] != blob[at..at + len] {
                    let first = got.iter().zip(&blob[at..]).position(|(a, b)| a != b);
                    panic!(
                        "len {len} at {at}: got {} bytes, first difference at {first:?}",
                        got.len()
                    );
                }
            }
            s.push(t.elapsed());
            let mid = commands(&mut raw).await;
            let t = Instant::now();
            for &at in &offsets {
                // The floor reads the bytes from one part (a range may span two in the store).
                let (part, start) = (at / MIB, at % MIB);
                let got: Vec<u8> = redis::cmd("GETRANGE")
                    .arg(format!("floor:0:{part}"))
                    .arg(start)
                    .arg(start + len - 1)
                    .query_async(&mut raw)
                    .await
                    .expect("GETRANGE");
                assert!(!got.is_empty());
            }
            f.push(t.elapsed());
            let after = commands(&mut raw).await;
            sc = mid - before - 1;
            fc = after - mid - 1;
        }
        rows.push(Row {
            what,
            store: median(s),
            floor: median(f),
            store_cmds: sc as f64 / RANGES as f64,
            floor_cmds: fc as f64 / RANGES as f64,
        });
    }

    // Small puts.
    let small = blob.slice(..4096);
    let (mut s, mut f) = (Vec::new(), Vec::new());
    for round in 0..ROUNDS {
        let before = commands(&mut raw).await;
        let t = Instant::now();
        for i in 0..SMALL {
            let k = BlobKey::new(format!("chunks/{round}/{i}")).unwrap();
            store.put_bytes(&k, small.clone()).await.expect("small put");
        }
        s.push(t.elapsed());
        let mid = commands(&mut raw).await;
        let t = Instant::now();
        for i in 0..SMALL {
            redis::cmd("SET")
                .arg(format!("floor:small:{round}:{i}"))
                .arg(&small[..])
                .query_async::<()>(&mut raw)
                .await
                .expect("SET");
        }
        f.push(t.elapsed());
        let after = commands(&mut raw).await;
        sc = mid - before - 1;
        fc = after - mid - 1;
    }
    rows.push(Row {
        what: "500 puts of 4 KiB, one after another",
        store: median(s),
        floor: median(f),
        store_cmds: sc as f64 / SMALL as f64,
        floor_cmds: fc as f64 / SMALL as f64,
    });

    println!(
        "{:<38} {:>10} {:>10} {:>7} {:>22}",
        "workload (median of 5)", "store", "floor", "ratio", "commands: store/floor"
    );
    for r in rows {
        println!(
            "{:<38} {:>8.1}ms {:>8.1}ms {:>6.2}x {:>10.1} / {:<10.1}",
            r.what,
            r.store.as_secs_f64() * 1e3,
            r.floor.as_secs_f64() * 1e3,
            r.store.as_secs_f64() / r.floor.as_secs_f64(),
            r.store_cmds,
            r.floor_cmds
        );
    }
    println!("(commands: total_commands_processed deltas; a script's inner calls count too)");
    drop(server);
}
