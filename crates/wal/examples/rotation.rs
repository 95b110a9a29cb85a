//! Measures what a segment rotation costs the commit that triggers it.
//!
//! `cargo run --release -p holdfast-wal --example rotation [DIR]` appends 1 KiB records one at a time (each
//! waits for its fsync) into 64 KiB segments, so about every 60th commit fills a segment, and prints the
//! latency of the commits that started a new segment beside those that did not.

use holdfast_wal::{Record, Wal, WalOptions};
use std::time::{Duration, Instant};

fn main() {
    let base = std::env::args()
        .nth(1)
        .map(std::path::PathBuf::from)
        .unwrap_or_else(std::env::temp_dir);
    let dir = base.join(format!("holdfast-wal-rotation-{}", std::process::id()));
    let options = WalOptions {
        segment_bytes: 64 << 10,
        ..WalOptions::default()
    };
    let (wal, _) = Wal::open(&dir, options).expect("open");
    let mut rotating = Vec::new();
    let mut plain = Vec::new();
    let mut segments = Wal::segment_paths(&dir).expect("list").len();
    for i in 1..=6_000u64 {
        let started = Instant::now();
        wal.append_blocking(vec![Record {
            group: 0,
            kind: 1,
            sticky: false,
            index: i,
            payload: vec![7; 1024],
        }])
        .expect("append");
        let took = started.elapsed();
        // Keep the disk use flat: everything but the last 100 records may go.
        wal.release(0, i.saturating_sub(100));
        let now = Wal::segment_paths(&dir).expect("list").len();
        if now > segments {
            rotating.push(took);
        } else {
            plain.push(took);
        }
        segments = now;
    }
    drop(wal);
    let _ = std::fs::remove_dir_all(&dir);
    report("commits that started a segment", &mut rotating);
    report("other commits", &mut plain);
}

fn report(what: &str, samples: &mut [Duration]) {
    samples.sort();
    let at = |q: f64| samples[((samples.len() - 1) as f64 * q) as usize];
    println!(
        "{what}: n={} p50={:?} p90={:?} p99={:?} max={:?}",
        samples.len(),
        at(0.5),
        at(0.9),
        at(0.99),
        samples[samples.len() - 1]
    );
}
