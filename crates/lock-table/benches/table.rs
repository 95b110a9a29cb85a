//! Lock table benchmarks (`cargo bench -p holdfast-lock-table`): apply throughput, snapshot speed, and
//! heap bytes per held lock at the design's load (100,000 sessions × 10 locks), measured exactly with a
//! counting allocator. No benchmark framework: a plain `main` keeps the dependency tree lean.
//! `HOLDFAST_BENCH_SESSIONS` scales the load (default 100,000).

use holdfast_lock_table::{AcquireMode, Command, LockName, LockTable, RequestId, SessionId};
use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};
use std::time::Instant;

struct Counting;
static LIVE: AtomicUsize = AtomicUsize::new(0);
/// The same, as glibc's malloc chunks: the request plus an 8-byte header, rounded up to 16, at least
/// 32. What the servers' resident memory pays (they use glibc's allocator).
static CHUNKS: AtomicUsize = AtomicUsize::new(0);

fn chunk(size: usize) -> usize {
    (size + 8).next_multiple_of(16).max(32)
}

#[allow(
    unsafe_code,
    reason = "a counting wrapper around the system allocator, for the memory figure"
)]
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        LIVE.fetch_add(layout.size(), Relaxed);
        CHUNKS.fetch_add(chunk(layout.size()), Relaxed);
        // SAFETY: forwarded unchanged to the system allocator.
        unsafe { System.alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        LIVE.fetch_sub(layout.size(), Relaxed);
        CHUNKS.fetch_sub(chunk(layout.size()), Relaxed);
        // SAFETY: forwarded unchanged to the system allocator.
        unsafe { System.dealloc(ptr, layout) }
    }
}

#[global_allocator]
static ALLOC: Counting = Counting;

fn main() {
    let sessions: u64 = std::env::var("HOLDFAST_BENCH_SESSIONS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(100_000);
    let per_session = 10u64;
    let before = LIVE.load(Relaxed);
    let chunks_before = CHUNKS.load(Relaxed);
    let mut table = LockTable::new();
    let mut index = 0u64;
    let started = Instant::now();
    for s in 0..sessions {
        index += 1;
        table.apply(
            index,
            &Command::OpenSession {
                nonce: u128::from(s) + 1,
                ttl_ms: 10_000,
                now_ms: 0,
            },
        );
        table.take_events();
        table.take_changes();
    }
    let opened = started.elapsed();
    let started = Instant::now();
    for s in 0..sessions {
        for l in 0..per_session {
            index += 1;
            let command = Command::Acquire {
                session: SessionId(s + 1),
                request: RequestId(l + 1),
                name: LockName::new(format!("tenant-{s}/job-{l}")).expect("valid name"),
                mode: AcquireMode::Try,
                value: Box::default(),
                attempt: index,
                now_ms: 0,
            };
            table.apply(index, &command);
            // As the server does after every entry (else they pile up: 73 B per lock here).
            table.take_events();
            table.take_changes();
        }
    }
    let acquired = started.elapsed();
    let locks = sessions * per_session;
    let heap = LIVE.load(Relaxed) - before;
    let chunks = CHUNKS.load(Relaxed) - chunks_before;
    println!("{sessions} sessions x {per_session} locks = {locks} locks");
    println!(
        "  open session:  {:.0} ns/op",
        opened.as_nanos() as f64 / sessions as f64
    );
    println!(
        "  acquire:       {:.0} ns/op",
        acquired.as_nanos() as f64 / locks as f64
    );
    println!(
        "  heap:          {} MB, {:.0} B per lock (sessions and dedup windows included)",
        heap / 1_000_000,
        heap as f64 / locks as f64
    );
    println!(
        "  as glibc malloc chunks: {} MB, {:.0} B per lock",
        chunks / 1_000_000,
        chunks as f64 / locks as f64
    );

    let started = Instant::now();
    let snapshot = table.encode_snapshot();
    let encoded = started.elapsed();
    let started = Instant::now();
    let before_decode = LIVE.load(Relaxed);
    let restored = LockTable::decode_snapshot(&snapshot).expect("round trip");
    let decoded = started.elapsed();
    let restored_heap = LIVE.load(Relaxed) - before_decode;
    println!(
        "  snapshot:      {} MB, encode {:.0} ms, decode {:.0} ms",
        snapshot.len() / 1_000_000,
        encoded.as_secs_f64() * 1e3,
        decoded.as_secs_f64() * 1e3
    );
    println!(
        "  decoded table: {} MB, {:.0} B per lock",
        restored_heap / 1_000_000,
        restored_heap as f64 / locks as f64
    );
    assert_eq!(restored.lock_count(), locks as usize);
    drop(restored);

    let started = Instant::now();
    for s in 0..sessions {
        index += 1;
        table.apply(
            index,
            &Command::ExpireSession {
                session: SessionId(s + 1),
                now_ms: 0,
            },
        );
    }
    println!(
        "  expire:        {:.0} ns per session of {per_session} locks",
        started.elapsed().as_nanos() as f64 / sessions as f64
    );
    assert_eq!(table.lock_count(), 0);
}
