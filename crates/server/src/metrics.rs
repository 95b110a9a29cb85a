//! Prometheus metrics, rendered in the text exposition format by hand (no metrics dependency), and the
//! standard `process_*` figures read from `/proc` ([`ProcessStats`]).
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

/// What the process uses, read from `/proc/self` at scrape time (Linux; None elsewhere, or if `/proc`
/// cannot be read). Reported under the names every Prometheus client library uses (`process_*`), so
/// the usual dashboards and alerts work on them unchanged.
#[derive(Clone, Debug, PartialEq)]
pub struct ProcessStats {
    pub resident_bytes: u64,
    pub virtual_bytes: u64,
    /// User plus system CPU time.
    pub cpu_seconds: f64,
    pub open_fds: u64,
    /// The soft limit on open files (`ulimit -n`).
    pub max_fds: Option<u64>,
    /// When the process started, in seconds since the Unix epoch.
    pub start_time_seconds: f64,
}

impl ProcessStats {
    /// This process's figures. Reads `/proc` directly rather than through `holdfast_wal::fs`: these
    /// are not data files, and the simulation serves no metrics.
    pub fn read() -> Option<ProcessStats> {
        let stat = std::fs::read_to_string("/proc/self/stat").ok()?;
        let status = std::fs::read_to_string("/proc/self/status").ok()?;
        let boot = std::fs::read_to_string("/proc/stat").ok()?;
        let limits = std::fs::read_to_string("/proc/self/limits").unwrap_or_default();
        // Less the directory handle `read_dir` itself holds while it counts.
        let open_fds = (std::fs::read_dir("/proc/self/fd").ok()?.count() as u64).saturating_sub(1);
        Self::parse(&stat, &status, &boot, &limits, open_fds)
    }

    /// The figures from the text of `/proc/self/stat`, `/proc/self/status`, `/proc/stat` and
    /// `/proc/self/limits`.
    pub fn parse(
        stat: &str,
        status: &str,
        boot: &str,
        limits: &str,
        open_fds: u64,
    ) -> Option<ProcessStats> {
        // /proc reports times in USER_HZ ticks, 100 per second (a fixed ABI value, not the kernel's
        // HZ; Prometheus's procfs assumes the same). The resident set comes from `status` in KiB,
        // not from `stat` in pages, whose size varies (4, 16 or 64 KiB).
        const TICKS_PER_SECOND: f64 = 100.0;
        // The command name (field 2) is in parentheses and may hold spaces: count from the last ')'.
        let rest = &stat[stat.rfind(')')? + 1..];
        let fields: Vec<&str> = rest.split_whitespace().collect();
        // `rest` starts at field 3 (state): field N is fields[N - 3].
        let field = |n: usize| fields.get(n - 3)?.parse::<u64>().ok();
        let (utime, stime) = (field(14)?, field(15)?);
        let (start_ticks, vsize) = (field(22)?, field(23)?);
        let rss_kib: u64 = status
            .lines()
            .find_map(|l| l.strip_prefix("VmRSS:"))?
            .split_whitespace()
            .next()?
            .parse()
            .ok()?;
        let btime: u64 = boot
            .lines()
            .find_map(|l| l.strip_prefix("btime "))?
            .trim()
            .parse()
            .ok()?;
        let max_fds = limits
            .lines()
            .find_map(|l| l.strip_prefix("Max open files"))
            .and_then(|l| l.split_whitespace().next()?.parse().ok());
        Some(ProcessStats {
            resident_bytes: rss_kib * 1024,
            virtual_bytes: vsize,
            cpu_seconds: (utime + stime) as f64 / TICKS_PER_SECOND,
            open_fds,
            max_fds,
            start_time_seconds: btime as f64 + start_ticks as f64 / TICKS_PER_SECOND,
        })
    }

    /// Appends the `process_*` families.
    pub fn render(&self, out: &mut String) {
        let mut float = |name: &str, help: &str, kind: &str, v: f64| {
            let _ = writeln!(
                out,
                "# HELP {name} {help}\n# TYPE {name} {kind}\n{name} {v}"
            );
        };
        float(
            "process_cpu_seconds_total",
            "User and system CPU time spent, in seconds.",
            "counter",
            self.cpu_seconds,
        );
        float(
            "process_start_time_seconds",
            "When the process started, in seconds since the Unix epoch.",
            "gauge",
            self.start_time_seconds,
        );
        gauge(
            out,
            "process_resident_memory_bytes",
            "Resident memory size in bytes.",
            &[(String::new(), self.resident_bytes)],
        );
        gauge(
            out,
            "process_virtual_memory_bytes",
            "Virtual memory size in bytes.",
            &[(String::new(), self.virtual_bytes)],
        );
        gauge(
            out,
            "process_open_fds",
            "Open file descriptors.",
            &[(String::new(), self.open_fds)],
        );
        if let Some(max) = self.max_fds {
            gauge(
                out,
                "process_max_fds",
                "The limit on open file descriptors.",
                &[(String::new(), max)],
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A real `/proc/self/stat` line of a process whose name holds a space and a parenthesis.
    #[test]
    fn process_stats_are_read_from_proc_text() {
        let stat = "4242 (holdfast (x) y) S 1 4242 4242 0 -1 4194560 1000 0 0 0 250 50 0 0 20 0 \
                    9 0 123400 987654321 2048 18446744073709551615 1 1 0 0 0 0 0 4096 0 0 0 0 17 \
                    1 0 0 0 0 0";
        let boot = "cpu  1 2 3\nbtime 1790000000\nprocesses 7\n";
        let limits = "Limit                     Soft Limit           Hard Limit           Units\n\
                      Max open files            1024                 524288               files\n";
        let status = "Name:\tholdfast\nVmSize:\t  964506 kB\nVmRSS:\t    8192 kB\nThreads:\t9\n";
        let s = ProcessStats::parse(stat, status, boot, limits, 12).unwrap();
        assert_eq!(
            s,
            ProcessStats {
                resident_bytes: 8192 * 1024,
                virtual_bytes: 987_654_321,
                cpu_seconds: 3.0,
                open_fds: 12,
                max_fds: Some(1024),
                start_time_seconds: 1_790_000_000.0 + 1_234.0,
            }
        );
        assert_eq!(
            ProcessStats::parse("garbage", status, boot, limits, 1),
            None
        );
        assert_eq!(
            ProcessStats::parse(stat, "Name:\tx\n", boot, limits, 1),
            None
        );
        let mut out = String::new();
        s.render(&mut out);
        assert!(out.contains("\nprocess_cpu_seconds_total 3\n"), "{out}");
        assert!(
            out.contains("\nprocess_resident_memory_bytes 8388608\n"),
            "{out}"
        );
        assert!(out.contains("\nprocess_max_fds 1024\n"), "{out}");
    }

    /// This process, read for real: it uses memory, has files open and started before now; its
    /// resident size agrees with `stat`'s page count at this machine's 4 KiB pages.
    #[test]
    fn this_process_has_memory_files_and_a_start_time() {
        let s = ProcessStats::read().expect("/proc is readable on Linux");
        assert!(s.resident_bytes > 1 << 20, "{s:?}");
        let stat = std::fs::read_to_string("/proc/self/stat").unwrap();
        let pages: u64 = stat[stat.rfind(')').unwrap() + 1..]
            .split_whitespace()
            .nth(24 - 3)
            .unwrap()
            .parse()
            .unwrap();
        let (a, b) = (s.resident_bytes / 1024, pages * 4);
        assert!(
            a.abs_diff(b) < b / 2 + 1024,
            "status says {a} KiB, stat {b} KiB"
        );
        assert!(s.virtual_bytes >= s.resident_bytes, "{s:?}");
        assert!(
            s.open_fds >= 3 && s.max_fds.is_some_and(|m| m >= s.open_fds),
            "{s:?}"
        );
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_secs_f64();
        assert!(
            s.start_time_seconds <= now + 1.0 && s.start_time_seconds > now - 86_400.0 * 365.0,
            "{s:?}"
        );
        assert!(s.cpu_seconds >= 0.0, "{s:?}");
    }

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
