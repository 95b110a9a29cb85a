//! Server configuration: from a TOML file, overridden by command-line flags (see `holdfast server --help`
//! and `docs/operations.md`).

use serde::Deserialize;
use std::net::SocketAddr;
use std::path::PathBuf;

/// One server of the cluster as every other server knows it.
#[derive(Clone, Debug, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct Member {
    pub id: u64,
    /// Where clients reach this server (gRPC `holdfast.v1.Holdfast`), as `host:port`.
    pub client: String,
    /// Where peers reach this server (gRPC `holdfast.v1.Peer`), as `host:port`.
    pub peer: String,
}

/// The largest `snapshot_log_percent`: a log ten times its snapshot's size.
pub const MAX_SNAPSHOT_LOG_PERCENT: u64 = 1_000;

#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ServerConfig {
    /// This server's id; must be one of `members`.
    pub node_id: u64,
    /// Listen address for clients. Defaults to this member's `client`.
    pub client_listen: Option<SocketAddr>,
    /// Listen address for peers. Defaults to this member's `peer`.
    pub peer_listen: Option<SocketAddr>,
    /// Listen address for `/metrics`, `/healthz` and `/readyz` (HTTP). None disables it.
    pub http_listen: Option<SocketAddr>,
    /// Where the WAL and snapshots live. Required: a server that silently wrote to the working
    /// directory would look like a fresh, empty member when started from another one.
    pub data_dir: PathBuf,
    /// The servers of the cluster (3 or 5 for real use): the initial membership of a new cluster, and the
    /// preferred addresses of those ids. Later changes go through `holdfast member` (see `group`).
    pub members: Vec<Member>,
    /// Number of Raft groups lock names are spread over. Fixed at creation.
    pub groups: u32,
    /// The cluster id (hex) a new data directory records. None: derived from the members' ids and client
    /// addresses, `groups` and `cluster_token` (see `identity`). Give it to a server that joins a cluster
    /// whose member list has changed since it was created (`holdfast status` shows the id).
    pub cluster_id: Option<String>,
    /// Mixed into a derived cluster id: give a cluster re-created on the same addresses a new token, so
    /// that a data directory of the old one cannot talk to it.
    pub cluster_token: String,
    /// Join an existing cluster instead of forming one: with an empty data directory, wait to be added
    /// (`holdfast member add`) instead of initializing the groups with `members`. Needs `cluster_id`.
    pub join: bool,
    /// Leader heartbeat interval.
    pub heartbeat_interval_ms: u64,
    /// A follower that has heard no leader for the max (openraft's leader lease: until then it refuses
    /// to vote for another) plus a random time in [min, max) starts an election. A leader answers
    /// keepalives only within 3/4 of the max of its last quorum contact. The defaults (50 ms heartbeat,
    /// 200..350 ms) fail over in about 0.7 s; see docs/operations.md, "Timeouts", for the trade-off.
    pub election_timeout_min_ms: u64,
    pub election_timeout_max_ms: u64,
    /// Build a snapshot and purge the log after this many entries (for a large table, once the log also
    /// holds `snapshot_log_percent` of the last snapshot's size).
    pub snapshot_every_entries: u64,
    /// Entries kept behind a snapshot, so a briefly lagging follower catches up by log, not snapshot.
    pub snapshot_keep_entries: u64,
    /// Also snapshot a group once its log grew by this many bytes since its last snapshot (checked every
    /// 5 s; 0 turns it off): with large lock values, few entries can be many bytes.
    pub snapshot_every_bytes: u64,
    /// A snapshot that `snapshot_every_entries` asks for waits until the log appended since the last
    /// snapshot holds at least this share of that snapshot's bytes, in percent (0: never waits): a
    /// large table is not rewritten every `snapshot_every_entries` entries. See
    /// `state_machine::SnapshotPacing`.
    pub snapshot_log_percent: u64,
    /// A group this server is not a voter of (it left it, or is a learner), with nothing appended or
    /// applied for this long, and not led here, is snapshotted and its table dropped from memory; the
    /// next entry to apply loads it back (see `state_machine`). 0: never. Checked every second.
    pub unload_after_ms: u64,
    /// Simulation only: unload idle groups this server is a voter of too (not led here), to put the
    /// reload path under the simulation's faults.
    #[cfg(holdfast_sim)]
    #[serde(skip)]
    pub sim_unload_voters: bool,
    /// Fault injection for storage tests: every WAL fsync after this many fails (as if the disk
    /// returned EIO). Never set in production, so only a hidden flag sets it, not a config file.
    #[serde(skip)]
    pub fault_fsync_fail_after: Option<u64>,
    /// Compatibility test hook: answer keepalives as a server older than `KeepAliveRequest.groups` did
    /// (ignore that field), so a test can check that clients fall back. Set by a hidden flag only.
    #[serde(skip)]
    pub compat_ignore_keepalive_groups: bool,
    /// Compatibility test hook: answer keepalives as a server older than compact answers did (ignore
    /// `KeepAliveRequest.compact` and `GroupKeepAlive.packed_secrets`). Hidden flag only.
    #[serde(skip)]
    pub compat_no_compact_keepalives: bool,
    /// Compatibility test hook: answer a keepalive sent as a call on a `Calls` stream
    /// (`CallRequest.keep_alive`) as a server older than those calls does (INVALID_ARGUMENT, the
    /// stream left open). Implied by the two hooks above (such servers are older still). Hidden flag
    /// only.
    #[serde(skip)]
    pub compat_no_keepalive_calls: bool,
    /// Compatibility test hook: answer `AppendStream` UNIMPLEMENTED, as a server older than it does, so
    /// a test can check that leaders fall back to one AppendEntries call at a time. Hidden flag only.
    #[serde(skip)]
    pub compat_no_append_stream: bool,
    /// Compatibility test hook: hand append connections of `crate::raw_append` to the HTTP/2 server
    /// (which closes them), as a server older than them does, so a test can check that leaders fall
    /// back to gRPC. Hidden flag only.
    #[serde(skip)]
    pub compat_no_raw_appends: bool,
    /// Compatibility test hook: answer `Calls` UNIMPLEMENTED, as a server older than it does, so a test
    /// can check that clients fall back to unary acquires and releases. Hidden flag only.
    #[serde(skip)]
    pub compat_no_call_streams: bool,
    /// Compatibility test hook: hand `Calls` connections of `crate::raw_calls` to the HTTP/2 server
    /// (which closes them), as a server older than them does, so a test can check that clients fall
    /// back to the gRPC `Calls` stream. Hidden flag only.
    #[serde(skip)]
    pub compat_no_raw_calls: bool,
    /// Test hook: answer as a server older than `Command::ExpireSessions` (report no features, and
    /// expire one session an entry). Hidden flag only.
    #[serde(skip)]
    pub compat_no_expire_sessions: bool,
    /// WAL segment size (default 64 MiB). A test hook (small segments rotate in a short test), set by a
    /// hidden flag only.
    #[serde(skip)]
    pub wal_segment_bytes: Option<u64>,
    /// For the fault tests' checker: append one JSON line per applied command to `DATA_DIR/audit-gN.jsonl`.
    /// A test hook, set by a hidden flag only.
    #[serde(skip)]
    pub audit_log: bool,
    /// Seed of Raft's randomized timeouts (mixed with the node id and group). None: drawn from the OS
    /// at start. Only the simulation sets it, so it is not read from config files.
    #[serde(skip)]
    pub rng_seed: Option<u64>,
    /// Instead of `audit_log`'s files: where group N's audit lines go (the simulation keeps them in memory).
    #[serde(skip)]
    pub audit_sink: Option<AuditSink>,
    /// Simulation only: this server's lease clock runs this many parts per million fast (or slow).
    #[cfg(holdfast_sim)]
    #[serde(skip)]
    pub clock_rate_ppm: i64,
    /// Simulation only: how long one WAL group commit takes between its write and its sync.
    #[cfg(holdfast_sim)]
    #[serde(skip)]
    pub sim_fsync: std::time::Duration,
    /// Simulation only: each group's table budget in bytes, instead of `table_budget_mib` (small
    /// enough for a handful of sessions, so that refusals for a full table happen under faults).
    #[cfg(holdfast_sim)]
    #[serde(skip)]
    pub sim_table_budget_bytes: Option<u64>,
    /// Simulation only: the most bytes one WAL group commit gathers (`WalOptions::max_batch_bytes`).
    #[cfg(holdfast_sim)]
    #[serde(skip)]
    pub sim_wal_batch_bytes: Option<usize>,
    /// Most client connections open at once; a connection beyond it is closed as soon as it is accepted
    /// (counted in `holdfast_connections_refused_total{port="client"}`), so a flood of connections
    /// cannot starve the connections already open of memory or file descriptors.
    pub max_client_connections: usize,
    /// Most concurrent HTTP/2 streams (calls in progress) per client connection, announced to the
    /// client in the HTTP/2 settings; a client that wants more waits for one to end.
    pub max_streams_per_connection: u32,
    /// Serve the client port (gRPC and `Calls` connections) on a runtime of its own with this many
    /// worker threads, apart from Raft, the peer port and HTTP; 0: on the server's runtime (the
    /// default). For servers that share a machine's cores (`holdfast dev` gives each 1 with 1 worker
    /// for the rest): a tokio runtime with several workers wakes a second one each time the first
    /// wakes with work, and a follower, whose client port is idle, then pays that on every append
    /// (docs/performance.md, "The client port on threads of its own", "One client-port thread").
    /// Ignored in the simulation.
    pub client_workers: usize,
    /// A follower writes and syncs the entries its leader sends on its own Raft thread, when the WAL
    /// has no group commit under way, instead of handing them to the WAL's writer thread and waiting
    /// to be woken: two thread wake-ups fewer per append (`holdfast_wal::Wal::append_inline`).
    /// Only where the cluster has one group (`groups = 1`): with several, a server's Raft thread
    /// also leads groups whose work would wait for each sync. The Raft thread is blocked for the
    /// commit (a sync, now and then a segment rotation or deletion), so a disk that stalls stalls it
    /// (its heartbeat replies too) rather than the WAL thread alone.
    /// Ignored in the simulation. docs/performance.md, "Followers sync on their own thread".
    pub follower_syncs_inline: bool,
    /// TLS on the client, peer and HTTP ports (the `[tls]` section; see `crate::tls`). None: plaintext.
    pub tls: Option<crate::tls::TlsConfig>,
    /// The access policy file (see `crate::access`). None: every caller may do everything.
    pub policy: Option<PathBuf>,
    /// Spread group leaderships over the servers by leader transfer (see `node::balance_leaders`).
    pub balance_leaders: bool,
    /// Session TTL used when a client asks for 0.
    pub default_ttl_ms: u64,
    /// TTL bounds this server accepts (within the lock table's hard limits 2 s ..= 5 min).
    pub min_ttl_ms: u64,
    pub max_ttl_ms: u64,
    /// The memory budget of each group's lock table, in MiB: the leader of a group puts it into the log
    /// as the group's budget (`Command::SetTableBudget`) when the group's differs. Per group, like
    /// `max_sessions` and `max_locks`, since a client has a session in every group: a server holds at
    /// most `groups` times this in lock tables. 0: no budget (the leader lifts one).
    pub table_budget_mib: u64,
}

impl Default for ServerConfig {
    fn default() -> Self {
        ServerConfig {
            node_id: 1,
            client_listen: None,
            peer_listen: None,
            http_listen: None,
            data_dir: PathBuf::new(),
            members: Vec::new(),
            groups: 1,
            cluster_id: None,
            cluster_token: String::new(),
            join: false,
            heartbeat_interval_ms: 50,
            election_timeout_min_ms: 200,
            election_timeout_max_ms: 350,
            snapshot_every_entries: 20_000,
            snapshot_keep_entries: 1_000,
            snapshot_every_bytes: 64 << 20,
            snapshot_log_percent: 25,
            unload_after_ms: 30_000,
            #[cfg(holdfast_sim)]
            sim_unload_voters: false,
            fault_fsync_fail_after: None,
            compat_ignore_keepalive_groups: false,
            compat_no_compact_keepalives: false,
            compat_no_keepalive_calls: false,
            compat_no_append_stream: false,
            compat_no_raw_appends: false,
            compat_no_call_streams: false,
            compat_no_raw_calls: false,
            compat_no_expire_sessions: false,
            wal_segment_bytes: None,
            audit_log: false,
            rng_seed: None,
            audit_sink: None,
            #[cfg(holdfast_sim)]
            clock_rate_ppm: 0,
            #[cfg(holdfast_sim)]
            sim_fsync: std::time::Duration::from_micros(500),
            #[cfg(holdfast_sim)]
            sim_table_budget_bytes: None,
            #[cfg(holdfast_sim)]
            sim_wal_batch_bytes: None,
            max_client_connections: 4_096,
            max_streams_per_connection: 1_024,
            client_workers: 0,
            follower_syncs_inline: true,
            tls: None,
            balance_leaders: false,
            policy: None,
            default_ttl_ms: holdfast_lock_table::limits::DEFAULT_TTL_MS,
            min_ttl_ms: holdfast_lock_table::limits::MIN_TTL_MS,
            max_ttl_ms: holdfast_lock_table::limits::MAX_TTL_MS,
            table_budget_mib: DEFAULT_TABLE_BUDGET_MIB,
        }
    }
}

/// Makes the audit writer of group N (see [`ServerConfig::audit_sink`]).
#[derive(Clone)]
pub struct AuditSink(
    pub std::sync::Arc<dyn Fn(u32) -> Box<dyn std::io::Write + Send + Sync> + Send + Sync>,
);

impl std::fmt::Debug for AuditSink {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("AuditSink")
    }
}

/// The default memory budget per group: about 2.5 times what the design's load (1,000,000 locks in
/// 100,000 sessions) is charged in one group, and more than enough for it spread over several (each
/// client session is charged in every group, its locks only in theirs).
pub const DEFAULT_TABLE_BUDGET_MIB: u64 = 1_024;

/// Most worker threads of a runtime (`client_workers`, `holdfast server --workers`): a bound on a
/// typo, not a tuning hint.
pub const MAX_WORKERS: usize = 256;

/// Largest number of groups; each costs a Raft instance (tasks, timers, heartbeats) on every server.
pub const MAX_GROUPS: u32 = 64;

impl ServerConfig {
    pub fn from_toml(text: &str) -> Result<Self, String> {
        toml::from_str(text).map_err(|e| format!("bad config file: {e}"))
    }

    pub fn validate(&self) -> Result<(), String> {
        use holdfast_lock_table::limits::{MAX_TTL_MS, MIN_TTL_MS};
        if self.members.is_empty() {
            return Err(
                "no members configured (give --members or members in the config file)".into(),
            );
        }
        if self.data_dir.as_os_str().is_empty() {
            return Err("no data directory configured (give --data-dir or data_dir in the config file): where this server keeps its log and snapshots".into());
        }
        if !self.members.iter().any(|m| m.id == self.node_id) {
            return Err(format!("node id {} is not among the members", self.node_id));
        }
        let mut ids: Vec<u64> = self.members.iter().map(|m| m.id).collect();
        ids.sort();
        ids.dedup();
        if ids.len() != self.members.len() || ids.contains(&0) {
            return Err("member ids must be unique and non-zero".into());
        }
        if self.groups == 0 || self.groups > MAX_GROUPS {
            return Err(format!(
                "groups must be 1..={MAX_GROUPS}, got {}",
                self.groups
            ));
        }
        if let Some(id) = &self.cluster_id {
            crate::identity::parse_cluster_id(id)?;
        }
        if self.join && self.cluster_id.is_none() {
            return Err(
                "join needs the cluster's id (--cluster-id; `holdfast status` shows it)".into(),
            );
        }
        if self.election_timeout_min_ms <= self.heartbeat_interval_ms * 3 {
            return Err("election_timeout_min_ms must exceed 3 × heartbeat_interval_ms".into());
        }
        if self.election_timeout_max_ms <= self.election_timeout_min_ms {
            return Err("election_timeout_max_ms must exceed election_timeout_min_ms".into());
        }
        if !(MIN_TTL_MS <= self.min_ttl_ms
            && self.min_ttl_ms <= self.default_ttl_ms
            && self.default_ttl_ms <= self.max_ttl_ms
            && self.max_ttl_ms <= MAX_TTL_MS)
        {
            return Err(format!(
                "ttl bounds must satisfy {MIN_TTL_MS} <= min_ttl_ms <= default_ttl_ms <= max_ttl_ms <= {MAX_TTL_MS} (in ms)"
            ));
        }
        // A session must outlive a leader election, or every failover would expire healthy sessions.
        if self.min_ttl_ms < 2 * self.election_timeout_max_ms {
            return Err("min_ttl_ms must be at least 2 × election_timeout_max_ms".into());
        }
        if self.snapshot_every_entries < 100 {
            return Err("snapshot_every_entries must be at least 100".into());
        }
        if self.max_client_connections == 0 || self.max_streams_per_connection == 0 {
            return Err(
                "max_client_connections and max_streams_per_connection must be at least 1".into(),
            );
        }
        if self.client_workers > MAX_WORKERS {
            return Err(format!("client_workers must be at most {MAX_WORKERS}"));
        }
        // Without TLS a policy could not tell servers from clients (they call each other's client ports),
        // and bearer tokens would cross the network in the clear.
        if self.policy.is_some() && self.tls.is_none() {
            return Err("an access policy needs TLS ([tls] or --tls-ca/--tls-cert/--tls-key): without it servers cannot be told from clients and tokens travel in the clear".into());
        }
        if self.table_budget_mib > 1 << 30 {
            return Err("table_budget_mib must be at most 1073741824 (1 PiB)".into());
        }
        if self.snapshot_log_percent > MAX_SNAPSHOT_LOG_PERCENT {
            return Err(format!(
                "snapshot_log_percent must be at most {MAX_SNAPSHOT_LOG_PERCENT} (the log between snapshots is kept in memory)"
            ));
        }
        if self.snapshot_every_bytes != 0 && self.snapshot_every_bytes < 64 << 10 {
            return Err("snapshot_every_bytes must be 0 (off) or at least 65536".into());
        }
        Ok(())
    }

    /// The memory budget of each group's table in bytes (0: none).
    pub fn group_table_budget(&self) -> u64 {
        #[cfg(holdfast_sim)]
        if let Some(bytes) = self.sim_table_budget_bytes {
            return bytes;
        }
        self.table_budget_mib << 20
    }

    pub fn me(&self) -> &Member {
        self.members
            .iter()
            .find(|m| m.id == self.node_id)
            .expect("validated: node id is a member")
    }

    pub fn member(&self, id: u64) -> Option<&Member> {
        self.members.iter().find(|m| m.id == id)
    }

    /// Parses `--members 1=127.0.0.1:7001/127.0.0.1:7101,2=...` (id=client/peer).
    pub fn parse_members(spec: &str) -> Result<Vec<Member>, String> {
        spec.split(',')
            .filter(|s| !s.trim().is_empty())
            .map(|item| {
                let (id, addrs) = item
                    .trim()
                    .split_once('=')
                    .ok_or(format!("bad member {item:?}: want id=client/peer"))?;
                let (client, peer) = addrs
                    .split_once('/')
                    .ok_or(format!("bad member {item:?}: want id=client/peer"))?;
                let id = id
                    .parse()
                    .map_err(|_| format!("bad member id in {item:?}"))?;
                Ok(Member {
                    id,
                    client: client.to_string(),
                    peer: peer.to_string(),
                })
            })
            .collect()
    }
}
