//! `holdfast server`: one server process, configured by a TOML file and/or flags (flags win).

use anyhow::{anyhow, Context};
use clap::Args;
use holdfast_server::{Node, ServerConfig};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;

#[derive(Args, Debug)]
pub struct ServerArgs {
    /// TOML config file with the same keys as these flags (node_id, members = [{id, client, peer}], ...).
    #[arg(long, env = "HOLDFAST_CONFIG")]
    config: Option<PathBuf>,
    /// This server's id (one of the members).
    #[arg(long)]
    node_id: Option<u64>,
    /// Every server: `id=client_host:port/peer_host:port,...`.
    #[arg(long)]
    members: Option<String>,
    /// Directory for the WAL and snapshots (required, here or as data_dir in the config file).
    #[arg(long)]
    data_dir: Option<PathBuf>,
    /// Listen address for clients (default: this member's client address).
    #[arg(long)]
    client_listen: Option<SocketAddr>,
    /// Listen address for peers (default: this member's peer address).
    #[arg(long)]
    peer_listen: Option<SocketAddr>,
    /// Listen address for HTTP /metrics, /healthz, /readyz (default: off).
    #[arg(long)]
    http_listen: Option<SocketAddr>,
    /// Raft groups lock names are hashed over (fixed at creation; default 1).
    #[arg(long)]
    groups: Option<u32>,
    /// The cluster id (hex) a new data directory records (default: derived from the members' ids and
    /// client addresses, the groups and --cluster-token). For a server joining a cluster whose member list
    /// changed since it was created; `holdfast status` shows the id.
    #[arg(long)]
    cluster_id: Option<String>,
    /// Mixed into the derived cluster id: a cluster re-created on the same addresses needs a new one.
    #[arg(long)]
    cluster_token: Option<String>,
    /// Join an existing cluster: with an empty data dir, wait to be added by `holdfast member add`
    /// instead of forming a cluster with --members. Needs --cluster-id.
    #[arg(long)]
    join: bool,
    /// Leader heartbeat interval (default 50).
    #[arg(long)]
    heartbeat_interval_ms: Option<u64>,
    /// Election timeout range (default 200..350). The max is also the leader lease: a follower starts an
    /// election after max + a random time in [min, max) without hearing the leader.
    #[arg(long)]
    election_timeout_min_ms: Option<u64>,
    #[arg(long)]
    election_timeout_max_ms: Option<u64>,
    /// Snapshot and purge the log every this many entries (default 20000).
    #[arg(long)]
    snapshot_every_entries: Option<u64>,
    /// Log entries kept behind a snapshot for lagging followers (default 1000).
    #[arg(long)]
    snapshot_keep_entries: Option<u64>,
    /// Also snapshot once a group's log grew by this many bytes (default 67108864; 0 = off).
    #[arg(long)]
    snapshot_every_bytes: Option<u64>,
    /// A snapshot due by entries waits until the log since the last one holds this share of its size,
    /// in percent (default 25; 0 = never waits; at most 1000).
    #[arg(long)]
    snapshot_log_percent: Option<u64>,
    /// Drop from memory the table of a group this server is not a voter of once idle this long
    /// (default 30000; 0 = never); it is reloaded from its snapshot when needed.
    #[arg(long)]
    unload_after_ms: Option<u64>,
    /// Test hook: every WAL fsync after this many fails, as if the disk returned EIO.
    #[arg(long, hide = true)]
    fault_fsync_fail_after: Option<u64>,
    /// Test hook: answer keepalives as a server older than per-group keepalives (ignore their groups).
    #[arg(long, hide = true)]
    compat_ignore_keepalive_groups: bool,
    /// Test hook: answer keepalives as a server older than compact answers (ignore `compact` and
    /// `packed_secrets`).
    #[arg(long, hide = true)]
    compat_no_compact_keepalives: bool,
    /// Test hook: answer keepalives sent as calls on a `Calls` stream as a server older than them
    /// (INVALID_ARGUMENT).
    #[arg(long, hide = true)]
    compat_no_keepalive_calls: bool,
    /// Test hook: answer AppendStream as a server older than it (UNIMPLEMENTED).
    #[arg(long, hide = true)]
    compat_no_append_stream: bool,
    /// Test hook: close append connections outside gRPC, as a server older than them.
    #[arg(long, hide = true)]
    compat_no_raw_appends: bool,
    /// Test hook: answer Calls as a server older than it (UNIMPLEMENTED).
    #[arg(long, hide = true)]
    compat_no_call_streams: bool,
    /// Test hook: close `Calls` connections outside gRPC, as a server older than them.
    #[arg(long, hide = true)]
    compat_no_raw_calls: bool,
    /// Test hook: answer as a server older than batched expiries (report no features, expire one
    /// session an entry).
    #[arg(long, hide = true)]
    compat_no_expire_sessions: bool,
    /// Test hook: WAL segment size in bytes (default 64 MiB).
    #[arg(long, hide = true)]
    wal_segment_bytes: Option<u64>,
    /// Test hook (debug builds only): crash the process the Nth time it reaches failpoint NAME
    /// (`NAME` or `NAME=N`; the names are in `holdfast_wal::failpoint`).
    #[arg(long, hide = true)]
    failpoint: Option<String>,
    /// Test hook: append every applied command to DATA_DIR/audit-gN.jsonl for the fault tests' checker.
    #[arg(long, hide = true)]
    audit_log: bool,
    /// Check the configuration (file and flags), the listen addresses and the data dir against it, print
    /// a summary and exit (0 if it would start, 1 with the reason if not), without starting.
    #[arg(long)]
    check_config: bool,
    /// Exit when standard input closes (for supervisors and tests that must not leave servers behind).
    #[arg(long, hide = true)]
    exit_on_stdin_close: bool,
    /// Most client connections open at once; more are closed when accepted (default 4096).
    #[arg(long)]
    max_client_connections: Option<usize>,
    /// Most calls in progress per client connection (HTTP/2 streams; default 1024).
    #[arg(long)]
    max_streams_per_connection: Option<u32>,
    /// Worker threads of the server's runtime: Raft, replication, the peer and HTTP ports, and the
    /// client port unless --client-workers (default: one per core). Not in the config file: the
    /// runtime starts before the file is read.
    #[arg(long, env = "HOLDFAST_WORKERS", value_parser = clap::value_parser!(u16).range(1..=256))]
    pub workers: Option<u16>,
    /// Serve the client port on a runtime of its own with this many worker threads (default 0: on the
    /// server's runtime). For servers sharing a machine's cores: `holdfast dev` gives each
    /// `--workers 1 --client-workers 1`.
    #[arg(long, value_parser = clap::value_parser!(u16).range(0..=256))]
    client_workers: Option<u16>,
    /// A follower writes and syncs its leader's entries on its Raft thread when the WAL is idle,
    /// instead of waking the WAL thread (default true; only with one group). docs/operations.md,
    /// "Follower syncs".
    #[arg(long, env = "HOLDFAST_FOLLOWER_SYNCS_INLINE", value_name = "BOOL")]
    follower_syncs_inline: Option<bool>,
    /// How Linux schedules the server's threads: `batch` (SCHED_BATCH: a thread the server wakes does
    /// not preempt the one running on its core) or `normal` (SCHED_OTHER). Without it: batch, unless
    /// the server was started under another policy than SCHED_OTHER (`chrt`, systemd's
    /// `CPUSchedulingPolicy=`), which it then keeps. Costs no privilege; ignored elsewhere than Linux
    /// with glibc. Not in the config file: it is set before any thread starts. docs/performance.md,
    /// "Threads that do not preempt".
    #[arg(long, env = "HOLDFAST_SCHEDULING", value_enum)]
    pub scheduling: Option<Scheduling>,
    /// TLS on every port: the cluster CA (PEM). With --tls-cert and --tls-key; overrides `[tls]`.
    #[arg(long, requires_all = ["tls_cert", "tls_key"])]
    tls_ca: Option<std::path::PathBuf>,
    /// This server's certificate chain (PEM), from `holdfast certs server`.
    #[arg(long, requires = "tls_ca")]
    tls_cert: Option<std::path::PathBuf>,
    /// This server's private key (PEM).
    #[arg(long, requires = "tls_ca")]
    tls_key: Option<std::path::PathBuf>,
    /// Client certificates on the client port: `optional` (verified when presented; the default) or
    /// `required`.
    #[arg(long)]
    client_certs: Option<holdfast_server::tls::ClientCertMode>,
    /// The access policy file (roles on name prefixes, principals, tokens; docs/security.md). Without
    /// one every caller may do everything.
    #[arg(long)]
    policy: Option<std::path::PathBuf>,
    /// Spread the groups' leaderships over the servers by leader transfer (with several groups).
    #[arg(long)]
    balance_leaders: bool,
    /// TTL for sessions that ask for 0 (default 10000).
    #[arg(long)]
    default_ttl_ms: Option<u64>,
    /// Smallest TTL accepted (default 2000; at least 2 × election_timeout_max_ms).
    #[arg(long)]
    min_ttl_ms: Option<u64>,
    /// Largest TTL accepted (default 300000).
    #[arg(long)]
    max_ttl_ms: Option<u64>,
    /// Memory budget of each group's lock table in MiB (default 1024; 0: no budget). Sessions, grants
    /// and waits past it are refused LIMIT_EXCEEDED max_table_bytes.
    #[arg(long)]
    table_budget_mib: Option<u64>,
}

/// How Linux schedules a server's threads (`holdfast server --scheduling`).
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum Scheduling {
    /// SCHED_BATCH: a woken thread does not preempt the running one; it takes an idle core, or waits
    /// for the running one to block or use up its slice.
    Batch,
    /// SCHED_OTHER, the kernel's default: a woken thread may preempt the running one at once.
    Normal,
}

/// What [`apply_scheduling`] did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Scheduled {
    /// The threads run under this policy.
    Set(Scheduling),
    /// No `--scheduling`, and the server was started under this policy (not SCHED_OTHER): kept.
    Kept(i32),
    /// Left as the process started (not Linux with glibc, where nothing is set).
    Untouched,
}

/// Puts the calling thread under `requested`, or with `None` under SCHED_BATCH if it runs under
/// SCHED_OTHER (another policy was chosen by whoever started the server: it is kept). Called in `main`
/// before the runtime or any other thread starts: threads inherit their creator's policy, so every
/// thread of the server has it.
///
/// Why batch: on the leader one thread sends an entry to each follower in turn. Under SCHED_OTHER
/// the follower woken by a send may preempt the sender on its core; the sends left ~55 µs apart at one
/// client, and under batch the second (the one a commit waits for) left 40–70 µs sooner. Batch threads
/// never preempt on wake-up: a woken one takes an idle core, or waits for the running thread to block
/// or use up its slice. Safety does not depend on it (no timing does); what it can cost is latency on
/// a machine whose cores are all busy, where a woken server thread waits for a slice or the
/// scheduler's tick (milliseconds; more with many runnable threads).
pub fn apply_scheduling(requested: Option<Scheduling>) -> std::io::Result<Scheduled> {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        if requested.is_none() {
            let inherited = current_policy()?;
            if inherited != libc::SCHED_OTHER {
                return Ok(Scheduled::Kept(inherited));
            }
        }
        let policy = requested.unwrap_or(Scheduling::Batch);
        set_policy(match policy {
            Scheduling::Batch => libc::SCHED_BATCH,
            Scheduling::Normal => libc::SCHED_OTHER,
        })?;
        Ok(Scheduled::Set(policy))
    }
    #[cfg(not(all(target_os = "linux", target_env = "gnu")))]
    {
        let _ = requested;
        Ok(Scheduled::Untouched)
    }
}

/// The calling thread's policy, without the SCHED_RESET_ON_FORK flag (which libc does not name).
#[cfg(all(target_os = "linux", target_env = "gnu"))]
#[allow(
    unsafe_code,
    reason = "sched_getscheduler(2) on the calling thread only reads its policy"
)]
fn current_policy() -> std::io::Result<libc::c_int> {
    const SCHED_RESET_ON_FORK: libc::c_int = 0x4000_0000;
    // SAFETY: sched_getscheduler(2) has no memory-safety preconditions; pid 0 is the calling thread.
    match unsafe { libc::sched_getscheduler(0) } {
        -1 => Err(std::io::Error::last_os_error()),
        policy => Ok(policy & !SCHED_RESET_ON_FORK),
    }
}

#[cfg(all(target_os = "linux", target_env = "gnu"))]
#[allow(
    unsafe_code,
    reason = "sched_setscheduler(2) on the calling thread with a parameter struct on the stack"
)]
fn set_policy(policy: libc::c_int) -> std::io::Result<()> {
    // Priority 0 is the only one SCHED_BATCH and SCHED_OTHER take.
    let param = libc::sched_param { sched_priority: 0 };
    // SAFETY: pid 0 is the calling thread; `param` is a valid sched_param that outlives the call.
    match unsafe { libc::sched_setscheduler(0, policy, &param) } {
        0 => Ok(()),
        _ => Err(std::io::Error::last_os_error()),
    }
}

impl ServerArgs {
    pub fn into_config(self) -> anyhow::Result<ServerConfig> {
        let mut c = match &self.config {
            Some(path) => {
                let text = std::fs::read_to_string(path)
                    .with_context(|| format!("cannot read {}", path.display()))?;
                ServerConfig::from_toml(&text).map_err(|e| anyhow!("{}: {e}", path.display()))?
            }
            None => ServerConfig::default(),
        };
        macro_rules! set {
            ($($field:ident),*) => { $( if let Some(v) = self.$field { c.$field = v; } )* };
        }
        set!(
            node_id,
            data_dir,
            groups,
            heartbeat_interval_ms,
            election_timeout_min_ms,
            election_timeout_max_ms,
            snapshot_every_entries,
            snapshot_keep_entries,
            snapshot_every_bytes,
            snapshot_log_percent,
            unload_after_ms,
            cluster_token,
            default_ttl_ms,
            min_ttl_ms,
            max_ttl_ms,
            max_client_connections,
            max_streams_per_connection,
            follower_syncs_inline,
            table_budget_mib
        );
        if let Some(n) = self.client_workers {
            c.client_workers = usize::from(n);
        }
        if self.audit_log {
            c.audit_log = true;
        }
        if self.wal_segment_bytes.is_some() {
            c.wal_segment_bytes = self.wal_segment_bytes;
        }
        if self.fault_fsync_fail_after.is_some() {
            c.fault_fsync_fail_after = self.fault_fsync_fail_after;
        }
        if self.compat_ignore_keepalive_groups {
            c.compat_ignore_keepalive_groups = true;
        }
        if self.compat_no_compact_keepalives {
            c.compat_no_compact_keepalives = true;
        }
        if self.compat_no_keepalive_calls {
            c.compat_no_keepalive_calls = true;
        }
        if self.compat_no_append_stream {
            c.compat_no_append_stream = true;
        }
        if self.compat_no_raw_appends {
            c.compat_no_raw_appends = true;
        }
        if self.compat_no_raw_calls {
            c.compat_no_raw_calls = true;
        }
        if self.compat_no_call_streams {
            c.compat_no_call_streams = true;
        }
        if self.compat_no_expire_sessions {
            c.compat_no_expire_sessions = true;
        }
        if self.join {
            c.join = true;
        }
        if self.cluster_id.is_some() {
            c.cluster_id = self.cluster_id.clone();
        }
        if let Some(a) = self.client_listen {
            c.client_listen = Some(a);
        }
        if let Some(a) = self.peer_listen {
            c.peer_listen = Some(a);
        }
        if let Some(a) = self.http_listen {
            c.http_listen = Some(a);
        }
        if let Some(m) = &self.members {
            c.members = ServerConfig::parse_members(m).map_err(|e| anyhow!(e))?;
        }
        if let (Some(ca), Some(cert), Some(key)) = (&self.tls_ca, &self.tls_cert, &self.tls_key) {
            c.tls = Some(holdfast_server::tls::TlsConfig {
                ca: ca.clone(),
                cert: cert.clone(),
                key: key.clone(),
                client_certs: c.tls.as_ref().map(|t| t.client_certs).unwrap_or_default(),
            });
        }
        if self.balance_leaders {
            c.balance_leaders = true;
        }
        if let Some(p) = &self.policy {
            c.policy = Some(p.clone());
        }
        if let Some(mode) = self.client_certs {
            match &mut c.tls {
                Some(tls) => tls.client_certs = mode,
                None => anyhow::bail!(
                    "--client-certs needs TLS (--tls-ca, --tls-cert, --tls-key or [tls])"
                ),
            }
        }
        c.validate().map_err(|e| anyhow!(e))?;
        Ok(c)
    }
}

/// `--check-config`: everything `holdfast server` checks before it starts, without starting.
fn check_config(config: &ServerConfig) -> anyhow::Result<()> {
    let me = config.me();
    for (what, addr) in [
        (
            "client",
            config
                .client_listen
                .map(|a| a.to_string())
                .unwrap_or(me.client.clone()),
        ),
        (
            "peer",
            config
                .peer_listen
                .map(|a| a.to_string())
                .unwrap_or(me.peer.clone()),
        ),
    ] {
        addr.parse::<SocketAddr>()
            .map_err(|_| anyhow!("this member's {what} listen address {addr:?} is not ip:port (give --{what}-listen)"))?;
    }
    if let Some(files) = &config.tls {
        holdfast_server::tls::Tls::load(files, config.node_id).map_err(|e| anyhow!("TLS: {e}"))?;
        println!(
            "TLS OK: {} signed by a CA in {}; client certificates {:?}",
            files.cert.display(),
            files.ca.display(),
            files.client_certs
        );
    }
    if let Some(path) = &config.policy {
        holdfast_server::access::Access::load(path).map_err(|e| anyhow!("policy: {e}"))?;
        println!("policy OK: {}", path.display());
    }
    let identity = holdfast_server::identity::inspect(config)?;
    println!(
        "config OK: node {} of {} members, {} groups, heartbeat {} ms, election timeout {}..{} ms, TTL {}..{} ms (default {})",
        config.node_id,
        config.members.len(),
        config.groups,
        config.heartbeat_interval_ms,
        config.election_timeout_min_ms,
        config.election_timeout_max_ms,
        config.min_ttl_ms,
        config.max_ttl_ms,
        config.default_ttl_ms
    );
    match identity {
        None => println!(
            "data dir {}: new{}",
            config.data_dir.display(),
            if config.join {
                " (will wait to be added: --join)"
            } else {
                " (will form the cluster with these members)"
            }
        ),
        Some(id) => println!(
            "data dir {}: node {} of cluster {:016x}",
            config.data_dir.display(),
            id.node_id,
            id.cluster_id
        ),
    }
    if config.members.len() < 3 {
        println!(
            "warning: {} members survive no server failure; use 3 or 5",
            config.members.len()
        );
    } else if config.members.len().is_multiple_of(2) {
        println!(
            "warning: {} members tolerate as many failures as {}; use an odd number",
            config.members.len(),
            config.members.len() - 1
        );
    }
    Ok(())
}

/// `scheduled`: what `main` got from [`apply_scheduling`], logged once logging is up.
pub async fn run(
    args: ServerArgs,
    scheduled: std::io::Result<Scheduled>,
) -> anyhow::Result<ExitCode> {
    if args.check_config {
        let config = args.into_config()?;
        check_config(&config)?;
        return Ok(ExitCode::SUCCESS);
    }
    let filter = tracing_subscriber::EnvFilter::try_from_env("HOLDFAST_LOG")
        // While a peer is down, openraft warns once per failed heartbeat and replication attempt, and
        // once a second about the peer's progress; `peer` logs the same as one line when a peer goes
        // away, a summary every 10 s, and one when it is back. Errors from those modules still show.
        .unwrap_or_else(|_| {
            tracing_subscriber::EnvFilter::new(
                "info,openraft=warn,openraft::core::heartbeat=error,openraft::replication=error,openraft::engine::handler::replication_handler=error",
            )
        });
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_writer(std::io::stderr)
        .init();
    match scheduled {
        Ok(Scheduled::Set(policy)) => tracing::debug!(?policy, "threads scheduled"),
        Ok(Scheduled::Kept(policy)) => tracing::info!(
            policy,
            "kept the scheduling policy this server was started under (--scheduling sets one)"
        ),
        Ok(Scheduled::Untouched) => {}
        // Only speed depends on it: go on under the policy the process started with.
        Err(e) => tracing::warn!(
            requested = ?args.scheduling,
            error = %e,
            "cannot set the threads' scheduling policy; left as inherited"
        ),
    }
    let exit_on_stdin_close = args.exit_on_stdin_close;
    if let Some(spec) = &args.failpoint {
        holdfast_server::failpoint::arm(spec).map_err(|e| anyhow!("--failpoint: {e}"))?;
        tracing::warn!(
            failpoint = spec,
            "failpoint armed: this server will crash when it reaches it"
        );
    }
    let config = args.into_config()?;
    let node = Node::start(config).await?;
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
    let code = tokio::select! {
        _ = tokio::signal::ctrl_c() => ExitCode::SUCCESS,
        _ = term.recv() => ExitCode::SUCCESS,
        _ = stdin_closed(exit_on_stdin_close) => ExitCode::SUCCESS,
        reason = node.fatal() => {
            tracing::error!(%reason, "raft stopped after a storage failure; exiting so the server restarts and recovers from disk");
            ExitCode::from(2)
        }
    };
    node.shutdown().await;
    Ok(code)
}

/// Resolves when standard input reaches end of file, if `enabled`; never otherwise.
async fn stdin_closed(enabled: bool) {
    if !enabled {
        return std::future::pending().await;
    }
    let (tx, rx) = tokio::sync::oneshot::channel::<()>();
    std::thread::spawn(move || {
        let mut sink = [0u8; 256];
        let mut stdin = std::io::stdin();
        while matches!(std::io::Read::read(&mut stdin, &mut sink), Ok(n) if n > 0) {}
        let _ = tx.send(());
    });
    let _ = rx.await;
}
