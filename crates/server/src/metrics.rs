//! Prometheus metrics on `prometheus-client`: the hot paths update its counters and histograms (atomics
//! and a short mutex per observation); [`registry`] registers them, and a [`Collector`] reads everything
//! else at scrape time: per-group figures, gauges read from the groups (sessions, locks, term, lag), the
//! TLS and policy counters, and the standard `process_*` figures read from `/proc` ([`ProcessStats`]).
//! `/metrics` is encoded in the Prometheus text format 0.0.4 ([`render`]).

use crate::node::NodeShared;
use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric};
use prometheus_client::metrics::counter::{ConstCounter, Counter};
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::metrics::MetricType;
use prometheus_client::registry::Registry;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Arc;
use std::time::Duration;

/// 100 µs .. 10 s, roughly ×2.5 per step, in seconds: covers an fsync on tmpfs up to a stalled disk.
pub const LATENCY_BUCKETS: [f64; 13] = [
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0, 10.0,
];
/// Records per group commit.
pub const BATCH_BUCKETS: [f64; 11] = [
    1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0, 1024.0, 4096.0,
];

/// A latency histogram with [`LATENCY_BUCKETS`].
pub fn latency_histogram() -> Histogram {
    Histogram::new(LATENCY_BUCKETS)
}

/// Records a duration in seconds.
pub fn observe(h: &Histogram, d: Duration) {
    h.observe(d.as_secs_f64());
}

/// Server-wide metrics.
pub struct ServerMetrics {
    pub fsync: Histogram,
    pub fsync_batch_records: Histogram,
    /// Session ids renewed.
    pub keepalives: Counter,
    /// Keepalive messages (unary calls and stream messages); each may carry many session ids.
    pub keepalive_messages: Counter,
    /// Groups of keepalive messages renewed from packed secrets (`GroupKeepAlive.packed_secrets`).
    pub keepalive_packed_groups: Counter,
    /// Keepalive messages taken as calls on `Calls` streams (`CallRequest.keep_alive`).
    pub keepalive_calls: Counter,
    /// `KeepAliveStream` calls in progress.
    pub keepalive_streams: Arc<AtomicU64>,
    pub call_streams: Arc<AtomicU64>,
    /// Client connections closed at accept because `max_client_connections` were open.
    pub client_connections_refused: Arc<AtomicU64>,
    /// Peer connections closed at accept because [`crate::node::MAX_PEER_CONNECTIONS`] were open.
    pub peer_connections_refused: Arc<AtomicU64>,
    /// HTTP connections closed at accept because `http::MAX_CONNECTIONS` were being served.
    pub http_connections_refused: Counter,
    /// The client listener's connection slots (set when it starts listening).
    pub client_connection_slots: std::sync::OnceLock<Arc<tokio::sync::Semaphore>>,
    /// `AppendStream` calls accepted from leaders.
    pub append_streams: Counter,
    /// Append connections of `crate::raw_append` accepted from leaders.
    pub raw_appends: Counter,
    /// `Calls` connections of `crate::raw_calls` accepted from clients.
    pub raw_calls: Counter,
    /// Events sent on watch streams.
    pub watch_events: Counter,
    /// Watch streams ended because they fell behind the history (`WATCH_TOO_SLOW`).
    pub watches_cut_off: Counter,
}

impl Default for ServerMetrics {
    fn default() -> Self {
        ServerMetrics {
            fsync: latency_histogram(),
            fsync_batch_records: Histogram::new(BATCH_BUCKETS),
            keepalives: Counter::default(),
            keepalive_messages: Counter::default(),
            keepalive_packed_groups: Counter::default(),
            keepalive_calls: Counter::default(),
            keepalive_streams: Default::default(),
            call_streams: Default::default(),
            client_connections_refused: Default::default(),
            peer_connections_refused: Default::default(),
            http_connections_refused: Counter::default(),
            client_connection_slots: Default::default(),
            append_streams: Counter::default(),
            raw_appends: Counter::default(),
            raw_calls: Counter::default(),
            watch_events: Counter::default(),
            watches_cut_off: Counter::default(),
        }
    }
}

/// Per-group metrics.
pub struct GroupMetrics {
    pub commit: Histogram,
    pub proposals: Counter,
    pub leader_changes: Counter,
    pub expiries: Counter,
    /// Acquires abandoned by this server as leader (their caller went away, or CancelAcquire).
    pub abandons: Counter,
}

impl Default for GroupMetrics {
    fn default() -> Self {
        GroupMetrics {
            commit: latency_histogram(),
            proposals: Counter::default(),
            leader_changes: Counter::default(),
            expiries: Counter::default(),
            abandons: Counter::default(),
        }
    }
}

/// Every metric of `node`: the server-wide counters and histograms registered, the rest read by a
/// [`NodeCollector`] at each scrape. Help texts are given without their final period (the registry adds it).
pub fn registry(node: Arc<NodeShared>) -> Registry {
    let mut r = Registry::default();
    let m = &node.metrics;
    r.register(
        "holdfast_wal_fsync_seconds",
        "WAL fdatasync latency",
        m.fsync.clone(),
    );
    r.register(
        "holdfast_wal_batch_records",
        "Records per group commit (one fsync)",
        m.fsync_batch_records.clone(),
    );
    r.register(
        "holdfast_watch_events",
        "Events sent on watch streams",
        m.watch_events.clone(),
    );
    r.register(
        "holdfast_watches_cut_off",
        "Watch streams ended because they fell behind the kept history (WATCH_TOO_SLOW)",
        m.watches_cut_off.clone(),
    );
    r.register(
        "holdfast_keepalives",
        "Session keepalives answered as leader",
        m.keepalives.clone(),
    );
    r.register(
        "holdfast_keepalive_messages",
        "Keepalive messages answered as leader (each may renew many sessions)",
        m.keepalive_messages.clone(),
    );
    r.register(
        "holdfast_keepalive_packed_groups",
        "Groups of keepalive messages renewed as leader from packed secrets",
        m.keepalive_packed_groups.clone(),
    );
    r.register(
        "holdfast_keepalive_calls",
        "Keepalive messages taken as calls on Calls streams (each answered as a KeepAlive call)",
        m.keepalive_calls.clone(),
    );
    r.register(
        "holdfast_peer_append_streams",
        "AppendStream calls accepted from a leader (each carries that leader's appends to this server for one group until it ends)",
        m.append_streams.clone(),
    );
    r.register(
        "holdfast_peer_append_connections",
        "Connections of appends outside gRPC accepted from a leader (docs/operations.md, \"Upgrades and formats\"; each carries a leader's appends to this server, one at a time, until it closes)",
        m.raw_appends.clone(),
    );
    r.register(
        "holdfast_call_connections",
        "Connections of calls outside gRPC accepted from clients (docs/performance.md, \"Calls on connections of their own\"; each carries one client's acquires and releases to this server until it closes)",
        m.raw_calls.clone(),
    );
    r.register_collector(Box::new(NodeCollector(node)));
    r
}

/// `/metrics`: the registry in the Prometheus text format (0.0.4).
pub fn render(registry: &Registry) -> String {
    let mut out = String::with_capacity(16 << 10);
    // Writing to a String cannot fail; a metric's own encoder only fails on its writer.
    let _ = prometheus_client::encoding::prometheus_text::encode(&mut out, registry);
    out
}

/// The content type of [`render`]'s output.
pub const CONTENT_TYPE: &str = prometheus_client::encoding::prometheus_text::CONTENT_TYPE;

/// The figures read at scrape time from the node: per group, from the other modules' counters, from
/// `/proc`.
pub struct NodeCollector(pub Arc<NodeShared>);

impl std::fmt::Debug for NodeCollector {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("NodeCollector")
    }
}

/// One family: its descriptor, then a value per label set (no labels when a set is empty).
fn family<M: EncodeMetric>(
    encoder: &mut DescriptorEncoder<'_>,
    name: &str,
    help: &str,
    kind: MetricType,
    series: impl IntoIterator<Item = (Labels, M)>,
) -> Result<(), std::fmt::Error> {
    let mut family = encoder.encode_descriptor(name, help, None, kind)?;
    for (labels, metric) in series {
        metric.encode(family.encode_family(&labels)?)?;
    }
    Ok(())
}

/// A series' labels (none: an empty list).
type Labels = Vec<(&'static str, String)>;

fn one<T>(v: T) -> [(Labels, T); 1] {
    [(Vec::new(), v)]
}

fn counters(
    encoder: &mut DescriptorEncoder<'_>,
    name: &str,
    help: &str,
    series: impl IntoIterator<Item = (Labels, u64)>,
) -> Result<(), std::fmt::Error> {
    family(
        encoder,
        name,
        help,
        MetricType::Counter,
        series.into_iter().map(|(l, v)| (l, ConstCounter::new(v))),
    )
}

fn gauges(
    encoder: &mut DescriptorEncoder<'_>,
    name: &str,
    help: &str,
    series: impl IntoIterator<Item = (Labels, u64)>,
) -> Result<(), std::fmt::Error> {
    family(
        encoder,
        name,
        help,
        MetricType::Gauge,
        series
            .into_iter()
            .map(|(l, v)| (l, ConstGauge::new(v as i64))),
    )
}

impl Collector for NodeCollector {
    fn encode(&self, mut e: DescriptorEncoder<'_>) -> Result<(), std::fmt::Error> {
        let node = &self.0;
        let m = &node.metrics;
        let label = |k: &'static str, v: &str| vec![(k, v.to_string())];
        gauges(
            &mut e,
            "holdfast_build_info",
            "Always 1; the labels say which build this server runs.",
            [(label("version", env!("CARGO_PKG_VERSION")), 1)],
        )?;
        gauges(
            &mut e,
            "holdfast_keepalive_streams",
            "KeepAliveStream calls in progress (at most max_streams_per_connection per connection).",
            one(m.keepalive_streams.load(Relaxed)),
        )?;
        gauges(
            &mut e,
            "holdfast_call_streams",
            "Calls streams (acquires and releases on one stream) open now.",
            one(m.call_streams.load(Relaxed)),
        )?;
        gauges(
            &mut e,
            "holdfast_watch_streams",
            "Watch streams open now (at most watch::MAX_WATCH_STREAMS, 1,024).",
            one(node.watches.open() as u64),
        )?;
        let open = m.client_connection_slots.get().map_or(0, |s| {
            node.config
                .max_client_connections
                .saturating_sub(s.available_permits()) as u64
        });
        gauges(
            &mut e,
            "holdfast_client_connections",
            "Client connections open now (at most max_client_connections).",
            one(open),
        )?;
        counters(
            &mut e,
            "holdfast_connections_refused",
            "Connections closed as soon as they were accepted, because max_client_connections (port=\"client\"), MAX_PEER_CONNECTIONS, 1,024 (port=\"peer\"), or http::MAX_CONNECTIONS, 64 (port=\"http\"), were open.",
            [
                (label("port", "client"), m.client_connections_refused.load(Relaxed)),
                (label("port", "peer"), m.peer_connections_refused.load(Relaxed)),
                (label("port", "http"), m.http_connections_refused.get()),
            ],
        )?;
        if let Some(tls) = &node.tls {
            counters(
                &mut e,
                "holdfast_tls_reloads",
                "Changes of the certificate files, by whether they loaded (now in use) or not (the previous ones stay).",
                [
                    (label("result", "ok"), tls.reloads.load(Relaxed)),
                    (label("result", "error"), tls.reload_failures.load(Relaxed)),
                ],
            )?;
            counters(
                &mut e,
                "holdfast_tls_handshakes_refused",
                "Connections closed because their TLS handshake failed (no or a foreign certificate, plaintext, a timeout) or, on the peer port, the certificate is not a server's.",
                [
                    (label("port", "client"), tls.refused_client.load(Relaxed)),
                    (label("port", "peer"), tls.refused_peer.load(Relaxed)),
                ],
            )?;
        }
        if let Some(access) = &node.access {
            counters(
                &mut e,
                "holdfast_policy_reloads",
                "Changes of the policy file, by whether they loaded (now in use) or not (the previous policy stays).",
                [
                    (label("result", "ok"), access.reloads.load(Relaxed)),
                    (label("result", "error"), access.reload_failures.load(Relaxed)),
                ],
            )?;
            counters(
                &mut e,
                "holdfast_permission_denied",
                "Client requests the access policy refused (PERMISSION_DENIED naming the principal).",
                one(access.denied.load(Relaxed)),
            )?;
        }
        let (pre_created, created_inline) = node.wal.rotations();
        counters(
            &mut e,
            "holdfast_wal_rotations",
            "WAL segments started, by whether the next file was pre-created or had to be created inside the commit that filled the last one.",
            [
                (label("segment", "pre_created"), pre_created),
                (label("segment", "created_inline"), created_inline),
            ],
        )?;
        let (by_writer, inline) = node.wal.commits();
        counters(
            &mut e,
            "holdfast_wal_commits",
            "WAL group commits (each writes a frame and syncs it), by the thread that made them: the WAL's writer thread, or a follower's Raft thread writing its leader's entries itself (follower_syncs_inline).",
            [
                (label("thread", "writer"), by_writer),
                (label("thread", "raft"), inline),
            ],
        )?;
        let group = |g: &crate::group::Group| label("group", &g.id.to_string());
        family(
            &mut e,
            "holdfast_commit_seconds",
            "Time from proposal to applied outcome on the leader.",
            MetricType::Histogram,
            node.groups
                .iter()
                .map(|g| (group(g), g.metrics.commit.clone())),
        )?;
        // How far each follower's log is behind this leader's (leaders only).
        let me = node.config.node_id;
        let lag = node.groups.iter().flat_map(|g| {
            let m = g.raft_metrics();
            let last = m.last_log_index.unwrap_or(0);
            m.replication
                .into_iter()
                .flatten()
                .filter(|(follower, _)| *follower != me)
                .map(move |(follower, matched)| {
                    (
                        vec![
                            ("group", g.id.to_string()),
                            ("follower", follower.to_string()),
                        ],
                        last.saturating_sub(matched.map_or(0, |l| l.index)),
                    )
                })
                .collect::<Vec<_>>()
        });
        gauges(
            &mut e,
            "holdfast_replication_lag_entries",
            "Log entries a follower is behind this leader's last log index (reported by leaders).",
            lag,
        )?;
        type PerGroup = fn(&GroupMetrics) -> u64;
        let per_group: [(&str, &str, PerGroup); 4] = [
            ("holdfast_proposals", "Log entries proposed by this server.", |m| m.proposals.get()),
            ("holdfast_leader_changes", "Leader changes seen by this server.", |m| m.leader_changes.get()),
            ("holdfast_session_expiries", "Sessions expired by this server as leader.", |m| m.expiries.get()),
            (
                "holdfast_acquires_abandoned",
                "Acquires abandoned through the log by this server as leader: their caller went away before the answer, or sent CancelAcquire.",
                |m| m.abandons.get(),
            ),
        ];
        for (name, help, value) in per_group {
            counters(
                &mut e,
                name,
                help,
                node.groups.iter().map(|g| (group(g), value(&g.metrics))),
            )?;
        }
        counters(
            &mut e,
            "holdfast_replication_late_acks",
            "Replies of a follower that came after enough others had acknowledged the same entries to commit them, after which this leader waited 2 ms before it built that follower's next append, so that it would carry more entries.",
            node.groups
                .iter()
                .map(|g| (group(g), g.acks.waits.load(Relaxed))),
        )?;
        counters(
            &mut e,
            "holdfast_snapshots_deferred",
            "Snapshots due by snapshot_every_entries that waited because the log since the last one was under snapshot_log_percent of its size.",
            node.groups
                .iter()
                .map(|g| (group(g), g.pacing.deferred.load(Relaxed))),
        )?;
        let tables: Vec<(Labels, [u64; 12])> = node
            .groups
            .iter()
            .map(|g| {
                let m = g.raft_metrics();
                let s = g.state.read().expect("state lock");
                let f = s.figures();
                let values = [
                    f.sessions,
                    f.locks,
                    f.waiters,
                    m.current_term,
                    s.last_applied.map_or(0, |l| l.index),
                    u64::from(m.state == openraft::ServerState::Leader),
                    f.table_bytes,
                    f.table_budget,
                    g.waiters.registered() as u64,
                    u64::from(s.unloaded.is_some()),
                    s.unloads,
                    s.reloads,
                ];
                (group(g), values)
            })
            .collect();
        let names = [
            ("holdfast_sessions", "Live sessions."),
            ("holdfast_locks", "Held locks."),
            ("holdfast_waiters", "Queued waiters."),
            ("holdfast_raft_term", "Current Raft term."),
            ("holdfast_applied_index", "Last applied log index."),
            ("holdfast_is_leader", "1 if this server leads the group."),
            (
                "holdfast_table_bytes",
                "What the lock table is charged against its memory budget (sessions, locks, grants, waits).",
            ),
            (
                "holdfast_table_budget_bytes",
                "The lock table's memory budget (0: none); past it opens, grants and waits are refused.",
            ),
            (
                "holdfast_acquire_calls_waiting",
                "Acquire calls on this server waiting for a grant (registered for the applied log to wake).",
            ),
            (
                "holdfast_table_unloaded",
                "1 while the group's table is on disk only (an idle group this server is not a voter of); the other table gauges then give its figures as they were.",
            ),
            (
                "holdfast_table_unloads",
                "Times the group's table was unloaded since this server started.",
            ),
            (
                "holdfast_table_reloads",
                "Times the group's table was loaded back from its snapshot since this server started.",
            ),
        ];
        for (i, (name, help)) in names.iter().enumerate() {
            gauges(
                &mut e,
                name,
                help,
                tables.iter().map(|(l, v)| (l.clone(), v[i])),
            )?;
        }
        if let Some(process) = ProcessStats::read() {
            process.encode(&mut e)?;
        }
        Ok(())
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

    /// Encodes the `process_*` families.
    pub fn encode(&self, e: &mut DescriptorEncoder<'_>) -> Result<(), std::fmt::Error> {
        family(
            e,
            "process_cpu_seconds",
            "User and system CPU time spent, in seconds.",
            MetricType::Counter,
            one(ConstCounter::new(self.cpu_seconds)),
        )?;
        family(
            e,
            "process_start_time_seconds",
            "When the process started, in seconds since the Unix epoch.",
            MetricType::Gauge,
            one(ConstGauge::new(self.start_time_seconds)),
        )?;
        gauges(
            e,
            "process_resident_memory_bytes",
            "Resident memory size in bytes.",
            one(self.resident_bytes),
        )?;
        gauges(
            e,
            "process_virtual_memory_bytes",
            "Virtual memory size in bytes.",
            one(self.virtual_bytes),
        )?;
        gauges(
            e,
            "process_open_fds",
            "Open file descriptors.",
            one(self.open_fds),
        )?;
        if let Some(max) = self.max_fds {
            gauges(
                e,
                "process_max_fds",
                "The limit on open file descriptors.",
                one(max),
            )?;
        }
        Ok(())
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
        let out = render(&process_registry(s));
        assert!(out.contains("\nprocess_cpu_seconds_total 3.0\n"), "{out}");
        assert!(
            out.contains("\nprocess_resident_memory_bytes 8388608\n"),
            "{out}"
        );
        assert!(
            out.contains("\n# TYPE process_cpu_seconds_total counter\n"),
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

    #[derive(Debug)]
    struct Process(ProcessStats);

    impl Collector for Process {
        fn encode(&self, mut e: DescriptorEncoder<'_>) -> Result<(), std::fmt::Error> {
            self.0.encode(&mut e)
        }
    }

    fn process_registry(s: ProcessStats) -> Registry {
        let mut r = Registry::default();
        r.register_collector(Box::new(Process(s)));
        r
    }

    /// The bucket bounds come out as the exact decimals of the docs (no float noise such as
    /// `0.00025000000000000001`), and a series without labels has no empty braces.
    #[test]
    fn histograms_render_exact_bounds_and_no_empty_label_sets() {
        let h = latency_histogram();
        observe(&h, Duration::from_micros(90));
        observe(&h, Duration::from_micros(2_400));
        let b = Histogram::new(BATCH_BUCKETS);
        b.observe(3.0);
        let c = Counter::<u64>::default();
        c.inc_by(7);
        let mut r = Registry::default();
        r.register("x_seconds", "help", h);
        r.register("b", "help", b);
        r.register("c", "help", c);
        let out = render(&r);
        assert!(out.contains("x_seconds_bucket{le=\"0.0001\"} 1\n"), "{out}");
        assert!(
            out.contains("x_seconds_bucket{le=\"0.00025\"} 1\n"),
            "{out}"
        );
        assert!(out.contains("x_seconds_bucket{le=\"0.0025\"} 2\n"), "{out}");
        assert!(out.contains("x_seconds_bucket{le=\"10\"} 2\n"), "{out}");
        assert!(out.contains("x_seconds_bucket{le=\"+Inf\"} 2\n"), "{out}");
        assert!(out.contains("x_seconds_count 2\n"), "{out}");
        assert!(out.contains("b_bucket{le=\"4\"} 1\n"), "{out}");
        assert!(
            out.contains("\n# TYPE c_total counter\nc_total 7\n"),
            "{out}"
        );
        assert!(!out.contains("{}"), "{out}");
        assert!(
            !out.lines()
                .any(|l| l.contains("_bucket") && l.contains("0000000")),
            "{out}"
        );
    }
}
