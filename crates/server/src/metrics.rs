//! Prometheus metrics, rendered in the text exposition format by hand (no metrics dependency).
//!
//! Counters and histograms are atomics updated on the hot paths; gauges (sessions, locks, term, ...) are
//! read from the groups at scrape time.

use std::fmt::Write;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::time::Duration;

/// A fixed-bucket histogram of durations.
pub struct Histogram {
    bounds_us: &'static [u64],
    counts: Vec<AtomicU64>,
    sum_us: AtomicU64,
    count: AtomicU64,
}

/// 100 µs .. 10 s, roughly ×2.5 per step: covers an fsync on tmpfs up to a stalled disk.
pub const LATENCY_BUCKETS_US: &[u64] = &[
    100, 250, 500, 1_000, 2_500, 5_000, 10_000, 25_000, 50_000, 100_000, 250_000, 1_000_000,
    10_000_000,
];
/// Records per group commit.
pub const BATCH_BUCKETS: &[u64] = &[1, 2, 4, 8, 16, 32, 64, 128, 256, 1024, 4096];

impl Histogram {
    pub fn new(bounds_us: &'static [u64]) -> Self {
        Histogram {
            bounds_us,
            counts: (0..bounds_us.len()).map(|_| AtomicU64::new(0)).collect(),
            sum_us: AtomicU64::new(0),
            count: AtomicU64::new(0),
        }
    }

    pub fn observe(&self, d: Duration) {
        self.observe_value(d.as_micros() as u64);
    }

    pub fn observe_value(&self, v: u64) {
        if let Some(i) = self.bounds_us.iter().position(|&b| v <= b) {
            self.counts[i].fetch_add(1, Relaxed);
        }
        self.sum_us.fetch_add(v, Relaxed);
        self.count.fetch_add(1, Relaxed);
    }
}

/// What a histogram's values are.
#[derive(Clone, Copy)]
pub enum Unit {
    /// Microseconds, rendered as seconds (exact decimals, not float noise like `0.00009999999999999999`).
    Seconds,
    /// Plain counts.
    Count,
}

impl Unit {
    fn show(self, v: u64) -> String {
        match self {
            Unit::Count => v.to_string(),
            Unit::Seconds => {
                let (whole, micros) = (v / 1_000_000, v % 1_000_000);
                if micros == 0 {
                    whole.to_string()
                } else {
                    format!("{whole}.{}", format!("{micros:06}").trim_end_matches('0'))
                }
            }
        }
    }
}

/// Renders one histogram family: its HELP and TYPE once, then every series (`labels` without braces,
/// empty for none).
pub fn histograms(
    out: &mut String,
    name: &str,
    help: &str,
    unit: Unit,
    series: &[(String, &Histogram)],
) {
    let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} histogram");
    for (labels, h) in series {
        let braces = |extra: &str| match (labels.is_empty(), extra.is_empty()) {
            (true, true) => String::new(),
            (true, false) => format!("{{{extra}}}"),
            (false, true) => format!("{{{labels}}}"),
            (false, false) => format!("{{{labels},{extra}}}"),
        };
        let mut cumulative = 0;
        for (b, c) in h.bounds_us.iter().zip(&h.counts) {
            cumulative += c.load(Relaxed);
            let le = format!("le=\"{}\"", unit.show(*b));
            let _ = writeln!(out, "{name}_bucket{} {cumulative}", braces(&le));
        }
        let count = h.count.load(Relaxed);
        let _ = writeln!(out, "{name}_bucket{} {count}", braces("le=\"+Inf\""));
        let _ = writeln!(
            out,
            "{name}_sum{} {}",
            braces(""),
            unit.show(h.sum_us.load(Relaxed))
        );
        let _ = writeln!(out, "{name}_count{} {count}", braces(""));
    }
}

/// Server-wide metrics.
pub struct ServerMetrics {
    pub fsync: Histogram,
    pub fsync_batch_records: Histogram,
    /// Session ids renewed.
    pub keepalives: AtomicU64,
    /// Keepalive messages (unary calls and stream messages); each may carry many session ids.
    pub keepalive_messages: AtomicU64,
    /// `KeepAliveStream` calls in progress.
    pub keepalive_streams: std::sync::Arc<AtomicU64>,
    /// Client connections closed at accept because `max_client_connections` were open.
    pub client_connections_refused: std::sync::Arc<AtomicU64>,
    /// Peer connections closed at accept because [`crate::node::MAX_PEER_CONNECTIONS`] were open.
    pub peer_connections_refused: std::sync::Arc<AtomicU64>,
    /// HTTP connections closed at accept because `http::MAX_CONNECTIONS` were being served.
    pub http_connections_refused: AtomicU64,
    /// The client listener's connection slots (set when it starts listening).
    pub client_connection_slots: std::sync::OnceLock<std::sync::Arc<tokio::sync::Semaphore>>,
    /// Events sent on watch streams.
    pub watch_events: AtomicU64,
    /// Watch streams ended because they fell behind the history (`WATCH_TOO_SLOW`).
    pub watches_cut_off: AtomicU64,
}

impl Default for ServerMetrics {
    fn default() -> Self {
        ServerMetrics {
            fsync: Histogram::new(LATENCY_BUCKETS_US),
            fsync_batch_records: Histogram::new(BATCH_BUCKETS),
            keepalives: AtomicU64::new(0),
            keepalive_messages: AtomicU64::new(0),
            keepalive_streams: Default::default(),
            client_connections_refused: Default::default(),
            peer_connections_refused: Default::default(),
            http_connections_refused: AtomicU64::new(0),
            client_connection_slots: Default::default(),
            watch_events: AtomicU64::new(0),
            watches_cut_off: AtomicU64::new(0),
        }
    }
}

/// Per-group metrics.
pub struct GroupMetrics {
    pub commit: Histogram,
    pub proposals: AtomicU64,
    pub leader_changes: AtomicU64,
    pub expiries: AtomicU64,
    /// Acquires abandoned by this server as leader (their caller went away, or CancelAcquire).
    pub abandons: AtomicU64,
}

impl Default for GroupMetrics {
    fn default() -> Self {
        GroupMetrics {
            commit: Histogram::new(LATENCY_BUCKETS_US),
            proposals: AtomicU64::new(0),
            leader_changes: AtomicU64::new(0),
            expiries: AtomicU64::new(0),
            abandons: AtomicU64::new(0),
        }
    }
}

pub fn counter(out: &mut String, name: &str, help: &str, values: &[(String, u64)]) {
    series(out, name, help, "counter", values);
}

pub fn gauge(out: &mut String, name: &str, help: &str, values: &[(String, u64)]) {
    series(out, name, help, "gauge", values);
}

fn series(out: &mut String, name: &str, help: &str, kind: &str, values: &[(String, u64)]) {
    let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} {kind}");
    for (labels, v) in values {
        if labels.is_empty() {
            let _ = writeln!(out, "{name} {v}");
        } else {
            let _ = writeln!(out, "{name}{{{labels}}} {v}");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn histograms_render_exact_bounds_and_no_empty_label_sets() {
        let h = Histogram::new(LATENCY_BUCKETS_US);
        h.observe(Duration::from_micros(90));
        h.observe(Duration::from_micros(2_400));
        let mut out = String::new();
        histograms(
            &mut out,
            "x_seconds",
            "help.",
            Unit::Seconds,
            &[(String::new(), &h)],
        );
        assert!(out.contains("x_seconds_bucket{le=\"0.0001\"} 1\n"), "{out}");
        assert!(out.contains("x_seconds_bucket{le=\"0.0025\"} 2\n"), "{out}");
        assert!(out.contains("x_seconds_bucket{le=\"10\"} 2\n"), "{out}");
        assert!(out.contains("x_seconds_sum 0.00249\n"), "{out}");
        assert!(out.contains("x_seconds_count 2\n"), "{out}");
        assert!(!out.contains("{}"), "{out}");
        let mut out = String::new();
        let b = Histogram::new(BATCH_BUCKETS);
        b.observe_value(3);
        histograms(
            &mut out,
            "b",
            "help.",
            Unit::Count,
            &[("group=\"0\"".into(), &b), ("group=\"1\"".into(), &b)],
        );
        assert_eq!(out.matches("# TYPE b histogram").count(), 1, "{out}");
        assert!(out.contains("b_bucket{group=\"1\",le=\"4\"} 1\n"), "{out}");
        assert!(out.contains("b_sum{group=\"0\"} 3\n"), "{out}");
    }
}
