//! A Holdfast server process: opens the WAL, restores every group, starts Raft, the gRPC servers (clients
//! and peers), the HTTP endpoint, and each group's leader tasks; shuts them down in order.

use crate::config::ServerConfig;
use crate::group::{event_sink, Group, Waiters};
use crate::lease::Leases;
use crate::log_store::{GroupLog, LogStore};
use crate::metrics::ServerMetrics;
use crate::peer::{
    PeerIdentity, PeerNetwork, PeerService, Peers, RaftLookup, MAX_PEER_MESSAGE_BYTES,
};
use crate::raft_types::Raft;
use crate::service::{ClientService, MAX_REQUEST_BYTES};
use crate::snapshot_store::SnapshotStore;
use crate::state_machine::StateMachine;
use anyhow::{anyhow, Context};
use holdfast_proto::transport::Listener;
use holdfast_proto::v1 as pb;
use holdfast_wal::fs;
use holdfast_wal::{Wal, WalOptions};
use openraft::{ServerState, SnapshotPolicy};
use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::watch;
use tokio::task::JoinHandle;

/// What the gRPC and HTTP handlers share.
pub struct NodeShared {
    pub config: Arc<ServerConfig>,
    /// From the data directory's IDENTITY.
    pub cluster_id: u64,
    pub groups: Vec<Arc<Group>>,
    pub metrics: Arc<ServerMetrics>,
    /// Ids for the acquire calls this server proposes (see `abandon`).
    pub attempt_ids: crate::abandon::AttemptIds,
    /// Abandons this server owes, kept on disk across a crash (see `abandon`).
    pub pending_abandons: crate::abandon::PendingAbandons,
    /// The log every group writes to (for its metrics; `Node` closes it).
    pub wal: Arc<Wal>,
    /// Where new sessions' secrets come from.
    pub secrets: crate::secrets::SecretSource,
    /// TLS on every port, when configured (see `tls`).
    pub tls: Option<Arc<crate::tls::Tls>>,
    /// The access policy, when configured (see `access`).
    pub access: Option<Arc<crate::access::Access>>,
    /// Permits for `SnapshotGroup` streams in progress (`service::MAX_SNAPSHOT_STREAMS`).
    pub snapshot_streams: Arc<tokio::sync::Semaphore>,
    /// Open `Watch` streams (see `watch::Slots`).
    pub watches: Arc<crate::watch::Slots>,
    /// Calls in flight on the `Calls` streams of each client connection (see `calls`).
    pub calls_by_connection: crate::calls::ByConnection,
    /// Channels to other servers' client ports, by node id and endpoint, for status probes (readiness,
    /// the leader balancer's round in a placed cluster) and abandons forwarded to a leader
    /// (`abandon::forward`): each probe or forward used to open, and close, a connection.
    client_channels: std::sync::Mutex<BTreeMap<(u64, String), tonic::transport::Channel>>,
    /// The members learned from the others in a placed cluster (see [`Directory`]).
    directory: std::sync::Mutex<Directory>,
}

/// The members this server learned from the other members' status the last time it asked
/// ([`NodeShared::leaders_everywhere`], every [`DIRECTORY_EVERY`] while it is not a voter of every group).
/// A server knows the members of its own groups, of the groups it was in (as they were when it left)
/// and of its configuration. With groups placed on some servers only, the voters a group gained after
/// this server left it are known only to others; once the servers that knew them are gone, a client
/// given only this server would never find that group. So this server asks the members it knows, and
/// the members those name, and reports what it learned in `Status.members`; the leaders they name are
/// where it redirects clients of the groups it is not a voter of ([`Group::leader_hint`]).
#[derive(Default)]
struct Directory {
    /// Each server that answered, as it describes itself, and each server that a voter of some group
    /// names as a voter of that group (it may be down for now: it is still a member). Replaced by each
    /// round that reached anyone, so a server that left the cluster drops out once no group names it.
    members: BTreeMap<u64, pb::Member>,
    /// When a round last reached anyone.
    refreshed: Option<tokio::time::Instant>,
}

/// How often a server that is not a voter of every group asks the others what they know
/// (`learn_members`): the leader balancer's period, whose rounds count too.
const DIRECTORY_EVERY: Duration = Duration::from_secs(2);

/// Most channels [`NodeShared::client_channel`] keeps (it starts over past it): far more than a cluster
/// has members, so only addresses that changed many times can reach it.
const MAX_CLIENT_CHANNELS: usize = 256;

impl RaftLookup for NodeShared {
    fn raft(&self, group: u32) -> Option<&Raft> {
        self.groups.get(group as usize).map(|g| &g.raft)
    }

    fn serves_append_streams(&self) -> bool {
        !self.config.compat_no_append_stream
    }

    fn append_stream_accepted(&self) {
        self.metrics.append_streams.inc();
    }

    fn serves_raw_appends(&self) -> bool {
        !self.config.compat_no_raw_appends
    }

    fn raw_appends_accepted(&self) {
        self.metrics.raw_appends.inc();
    }

    fn features(&self) -> u64 {
        if self.config.compat_no_expire_sessions {
            0
        } else {
            crate::formats::FEATURES
        }
    }
}

pub struct Node {
    pub shared: Arc<NodeShared>,
    wal: Arc<Wal>,
    shutdown: watch::Sender<bool>,
    tasks: Vec<JoinHandle<()>>,
    pub client_addr: SocketAddr,
    pub peer_addr: SocketAddr,
    pub http_addr: Option<SocketAddr>,
    /// The client port's runtime when `client_workers` > 0. Before `_dir_lock`, so that it stops
    /// before the data directory is released.
    _client_runtime: ClientRuntime,
    /// Holds the data directory's lock for the life of the server.
    _dir_lock: Option<std::fs::File>,
}

/// The runtime the client port runs on when [`ServerConfig::client_workers`] is not 0. Its tasks are
/// the client port's: the listener, gRPC connections and calls, `Calls` connections, and what they
/// spawn (the connections are registered with its I/O driver, as the task that accepts them runs
/// here). Everything else (Raft, replication, the WAL's callbacks, session timers, the peer and HTTP
/// ports) stays on the runtime that started the node. A call crosses between the two at its proposal
/// and its outcome, as it crossed between the workers of one runtime before.
struct ClientRuntime(Option<tokio::runtime::Runtime>);

impl ClientRuntime {
    /// None in the simulation: a host's tasks must all run on its simulated runtime.
    fn new(workers: usize) -> anyhow::Result<ClientRuntime> {
        if workers == 0 || cfg!(holdfast_sim) {
            return Ok(ClientRuntime(None));
        }
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(workers)
            .thread_name("holdfast-client")
            .enable_all()
            .build()
            .context("cannot start the client port's runtime")?;
        Ok(ClientRuntime(Some(runtime)))
    }

    /// `listener`, registered with this runtime's I/O driver, so that a thread of the server's runtime
    /// does not hand each accept over. (The accepted connections are this runtime's either way: a
    /// socket is registered with the runtime of the task that creates it.)
    fn adopt(&self, listener: Listener) -> std::io::Result<Listener> {
        match &self.0 {
            Some(runtime) => {
                let _inside = runtime.enter();
                listener.on_this_runtime()
            }
            None => Ok(listener),
        }
    }

    fn spawn<F>(&self, task: F) -> JoinHandle<F::Output>
    where
        F: std::future::Future + Send + 'static,
        F::Output: Send + 'static,
    {
        match &self.0 {
            Some(runtime) => runtime.spawn(task),
            None => tokio::spawn(task),
        }
    }
}

impl Drop for ClientRuntime {
    /// Stops its tasks without waiting for them: a runtime dropped inside another runtime's task (the
    /// server's, when the node goes) would panic, and its tasks are the client port's, which the
    /// shutdown signal has already ended.
    fn drop(&mut self) {
        if let Some(runtime) = self.0.take() {
            runtime.shutdown_background();
        }
    }
}

/// Most connections open at once on the peer port. A cluster needs a few per peer for gRPC, and each
/// group's leader keeps up to `raw_append::CONNECTIONS_PER_PEER` (4) append connections to each of its
/// followers: 256 at `MAX_GROUPS` (64), as many again for former leaders' until they are closed idle.
/// The bound keeps a flood of connections (which may hold a slot for a whole TLS handshake timeout)
/// from taking every file descriptor the WAL and the client port need.
pub const MAX_PEER_CONNECTIONS: usize = 1024;

fn parse_addr(s: &str) -> anyhow::Result<SocketAddr> {
    s.parse()
        .with_context(|| format!("{s:?} is not an ip:port address"))
}

impl Node {
    pub async fn start(config: ServerConfig) -> anyhow::Result<Node> {
        config.validate().map_err(|e| anyhow!(e))?;
        // Before anything reads openraft's clock on this (simulated host's) runtime.
        #[cfg(holdfast_sim)]
        crate::skew::set_rate(config.node_id, config.clock_rate_ppm);
        let config = Arc::new(config);
        fs::create_dir_all(&config.data_dir)
            .with_context(|| format!("cannot create data dir {}", config.data_dir.display()))?;
        let dir_lock = lock_data_dir(&config)?;
        let identity = crate::identity::check(&config)?;
        // Before anything else starts: a server whose certificates do not load must not start.
        let tls = match &config.tls {
            None => None,
            Some(files) => Some(Arc::new(
                crate::tls::Tls::load(files, config.node_id).map_err(|e| anyhow!("TLS: {e}"))?,
            )),
        };
        let access = match &config.policy {
            None => None,
            Some(path) => Some(Arc::new(
                crate::access::Access::load(path).map_err(|e| anyhow!("policy: {e}"))?,
            )),
        };
        #[cfg(holdfast_sim)]
        if tls.is_some() {
            anyhow::bail!("TLS is not simulated: the simulation runs plaintext");
        }

        let metrics = Arc::new(ServerMetrics::default());
        let m = metrics.clone();
        // The simulation sets every field; a real server leaves `max_batch_bytes` at its default.
        #[cfg_attr(holdfast_sim, allow(clippy::needless_update))]
        let wal_options = WalOptions {
            observer: Some(Arc::new(move |s: holdfast_wal::SyncStats| {
                crate::metrics::observe(&m.fsync, s.sync_duration);
                m.fsync_batch_records.observe(s.records as f64);
            })),
            sync_fault: config.fault_fsync_fail_after.map(|after| {
                let syncs = std::sync::atomic::AtomicU64::new(0);
                let fault: holdfast_wal::SyncFault = Arc::new(move || {
                    if syncs.fetch_add(1, Relaxed) >= after {
                        Err(std::io::Error::other(
                            "injected fsync failure (--fault-fsync-fail-after)",
                        ))
                    } else {
                        Ok(())
                    }
                });
                fault
            }),
            #[cfg(holdfast_sim)]
            sim_sync_delay: config.sim_fsync,
            segment_bytes: config
                .wal_segment_bytes
                .unwrap_or(WalOptions::default().segment_bytes),
            #[cfg(holdfast_sim)]
            max_batch_bytes: config
                .sim_wal_batch_bytes
                .unwrap_or(WalOptions::default().max_batch_bytes),
            ..WalOptions::default()
        };
        let (wal, recovered) = Wal::open(&config.data_dir.join("wal"), wal_options)?;
        if let Some(t) = &recovered.torn {
            tracing::warn!(segment = %t.segment.display(), offset = t.offset, bytes = t.bytes, saved_to = %t.saved_to.display(),
                "cut a torn write at the end of the log (a crash interrupted it before it was acknowledged)");
        }
        let wal = Arc::new(wal);

        let peer_identity = PeerIdentity {
            cluster_id: identity.cluster_id,
            node_id: config.node_id,
        };
        let peers = Peers::new(
            peer_identity,
            config
                .members
                .iter()
                .map(|m| (m.id, m.peer.clone()))
                .collect(),
            tls.as_ref().map(|t| t.peer_connector()),
        );
        let raft_config = Arc::new(
            openraft::Config {
                cluster_name: "holdfast".into(),
                heartbeat_interval: config.heartbeat_interval_ms,
                election_timeout_min: config.election_timeout_min_ms,
                election_timeout_max: config.election_timeout_max_ms,
                enable_pre_vote: Some(true),
                // A restarted leader must win a new election. With "leader restore" a leader killed while
                // its own WAL write was still queued came back in the same term without entries its
                // followers had already committed, and wrote a different entry at the same index (found by
                // the kill-the-leader fault scenario: two replicas applied different entries at index 431).
                enable_leader_restore: Some(false),
                snapshot_policy: SnapshotPolicy::LogsSinceLast(config.snapshot_every_entries),
                // Keep some log behind a snapshot so a briefly lagging follower catches up by log.
                max_in_snapshot_log_to_keep: config.snapshot_keep_entries,
                purge_batch_size: 256,
                install_snapshot_timeout: 30_000,
                ..Default::default()
            }
            .validate()
            .context("invalid raft timing")?,
        );
        let members: BTreeMap<u64, crate::raft_types::MemberNode> = config
            .members
            .iter()
            .map(|m| {
                let node = crate::raft_types::MemberNode {
                    peer: m.peer.clone(),
                    client: m.client.clone(),
                };
                (m.id, node)
            })
            .collect();

        let rng_seed = config.rng_seed.unwrap_or_else(random_seed);
        let mut groups = Vec::new();
        for g in 0..config.groups {
            let log = GroupLog::replay(recovered.records.iter().filter(|r| r.group == g))
                .map_err(|e| anyhow!("group {g}: {e}"))?;
            let log_bytes = Arc::new(std::sync::atomic::AtomicU64::new(0));
            let snapshots =
                SnapshotStore::open(config.data_dir.join("snapshots").join(format!("g{g}")))?;
            #[cfg(not(holdfast_sim))]
            let leases = Arc::new(Leases::default());
            #[cfg(holdfast_sim)]
            let leases = Arc::new(Leases::with_clock_rate_ppm(config.clock_rate_ppm));
            let waiters = Arc::new(Waiters::default());
            let pacing = Arc::new(crate::state_machine::SnapshotPacing::new(
                log_bytes.clone(),
                config.snapshot_log_percent,
            ));
            let (sm, state) = StateMachine::open(
                snapshots,
                event_sink(leases.clone(), waiters.clone()),
                pacing.clone(),
            )
            .map_err(|e| anyhow!("group {g}: {e}"))?;
            // The log replayed after the snapshot counts toward the next one, as the log appended
            // since does (the pacing and `snapshot_every_bytes` measure from it): without it a
            // restarted server's first due snapshot could wait for that much more log in memory.
            let snapshot_index = state
                .read()
                .expect("state lock")
                .last_applied
                .map(|l| l.index);
            log_bytes.store(
                log.bytes_after(snapshot_index),
                std::sync::atomic::Ordering::Relaxed,
            );
            // One group only: a server in several leads some while following others on the same
            // Raft thread, and their leader work would wait for each inline sync.
            let inline = config.follower_syncs_inline && config.groups == 1;
            let log_store = LogStore::new(
                g,
                config.node_id,
                inline,
                log,
                wal.clone(),
                log_bytes.clone(),
            );
            let unloader = sm.unloader();
            let sm = if let Some(sink) = &config.audit_sink {
                sm.with_audit_writer((sink.0)(g))
            } else if config.audit_log {
                let path = config.data_dir.join(format!("audit-g{g}.jsonl"));
                sm.with_audit_log(&path)
                    .with_context(|| format!("cannot open {}", path.display()))?
            } else {
                sm
            };
            let acks = Arc::new(crate::peer::Acks::default());
            let network = PeerNetwork {
                group: g,
                peers: peers.clone(),
                log: log_store.clone(),
                acks: acks.clone(),
            };
            // openraft's tasks draw their randomness from this seed (see `raft_types::Runtime`).
            let seed = rng_seed
                ^ config.node_id.wrapping_mul(0x9e37_79b9_7f4a_7c15)
                ^ u64::from(g).wrapping_mul(0xbf58_476d_1ce4_e5b9);
            let raft = crate::raft_types::Runtime::scope(
                seed,
                Raft::new(config.node_id, raft_config.clone(), network, log_store, sm),
            )
            .await
            .map_err(|e| anyhow!("group {g}: raft did not start: {e}"))?;
            // Every server initializes with the same membership; openraft makes that safe, and it means
            // the cluster forms whichever servers start first.
            // A joining server (now, or when its data dir was created) waits to be added instead.
            if !config.join
                && !identity.join
                && !raft.is_initialized().await.map_err(|e| anyhow!("{e}"))?
            {
                if let Err(e) = raft.initialize(members.clone()).await {
                    tracing::debug!(group = g, %e, "initialize skipped");
                }
            }
            groups.push(Arc::new(Group::new(
                g,
                raft,
                state,
                leases,
                waiters,
                log_bytes,
                pacing,
                &config,
                peers.features(),
                unloader,
                acks,
            )));
        }
        drop(recovered);

        let shared = Arc::new(NodeShared {
            config: config.clone(),
            cluster_id: identity.cluster_id,
            groups,
            metrics,
            attempt_ids: crate::abandon::AttemptIds::new(rng_seed, config.node_id, crate::now_ms()),
            pending_abandons: crate::abandon::PendingAbandons::open(&config.data_dir),
            wal: wal.clone(),
            secrets: crate::secrets::SecretSource::new(rng_seed ^ config.node_id),
            tls: tls.clone(),
            access: access.clone(),
            snapshot_streams: Arc::new(tokio::sync::Semaphore::new(
                crate::service::MAX_SNAPSHOT_STREAMS,
            )),
            watches: Default::default(),
            calls_by_connection: Default::default(),
            client_channels: Default::default(),
            directory: Default::default(),
        });
        crate::abandon::resume(&shared);
        let (shutdown, shutdown_rx) = watch::channel(false);
        let mut tasks = Vec::new();

        let me = config.me();
        let client_listen = match config.client_listen {
            Some(a) => a,
            None => parse_addr(&me.client)?,
        };
        let peer_listen = match config.peer_listen {
            Some(a) => a,
            None => parse_addr(&me.peer)?,
        };
        let peer_listener = Listener::bind(peer_listen)
            .await
            .with_context(|| format!("cannot listen for peers on {peer_listen}"))?;
        let client_listener = Listener::bind(client_listen)
            .await
            .with_context(|| format!("cannot listen for clients on {client_listen}"))?;
        let peer_addr = peer_listener.local_addr()?;
        let client_addr = client_listener.local_addr()?;
        let client_runtime = ClientRuntime::new(config.client_workers)?;
        let client_listener = client_runtime.adopt(client_listener)?;

        let peer_service = Arc::new(PeerService::new(shared.clone(), peer_identity));
        // Append connections outside gRPC (`crate::raw_append`), told apart from gRPC ones by their
        // first bytes, each served by a task of its own. `sender`: the node its certificate names.
        // A server with `--compat-no-raw-appends` hands them to gRPC, as one that predates them does.
        fn raw_appends<IO>(
            service: &Arc<PeerService<NodeShared>>,
            shutdown: &tokio::sync::watch::Receiver<bool>,
            sender: fn(&IO) -> Option<Option<u64>>,
        ) -> impl Fn(IO) + Send + Sync + 'static
        where
            IO: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
        {
            let (service, shutdown) = (service.clone(), shutdown.clone());
            move |io: IO| {
                service.lookup().raw_appends_accepted();
                let (service, mut shutdown) = (service.clone(), shutdown.clone());
                let sender = sender(&io);
                tokio::spawn(async move {
                    tokio::select! {
                        () = crate::raw_append::serve(&service, io, sender) => {}
                        _ = shutdown.changed() => {}
                    }
                });
            }
        }
        let raw_service = peer_service.clone();
        let raw_preface: &'static [u8] = if shared.serves_raw_appends() {
            crate::raw_append::PREFACE
        } else {
            holdfast_proto::transport::NO_PREFACE
        };
        let raw_shutdown = shutdown_rx.clone();
        let peer_service = holdfast_proto::v1::peer_server::PeerServer::from_arc(peer_service)
            .max_decoding_message_size(MAX_PEER_MESSAGE_BYTES)
            .max_encoding_message_size(MAX_PEER_MESSAGE_BYTES);
        let mut rx = shutdown_rx.clone();
        let peer_tls = tls.clone();
        let peer_slots = Arc::new(tokio::sync::Semaphore::new(MAX_PEER_CONNECTIONS));
        let peer_refused = shared.metrics.peer_connections_refused.clone();
        tasks.push(tokio::spawn(async move {
            let stop = async move {
                let _ = rx.changed().await;
            };
            let server = tonic::transport::Server::builder()
                // Close connections that stop answering (see `holdfast_proto::transport`).
                .http2_keepalive_interval(Some(Duration::from_secs(1)))
                .http2_keepalive_timeout(Some(Duration::from_secs(3)))
                .add_service(peer_service);
            let served = match peer_tls {
                #[cfg(not(holdfast_sim))]
                Some(tls) => {
                    let incoming = peer_listener.incoming_tls(
                        tls.peer_port.clone(),
                        Some((peer_slots, peer_refused)),
                        crate::tls::admit_peer,
                        tls.refused_peer.clone(),
                    );
                    let incoming = holdfast_proto::transport::divert(
                        incoming,
                        raw_preface,
                        crate::raw_append::PREFACE_TIMEOUT,
                        raw_appends(
                            &raw_service,
                            &raw_shutdown,
                            |io: &holdfast_proto::tls::TlsConn<
                                holdfast_proto::transport::Limited<tokio::net::TcpStream>,
                            >| {
                                Some(crate::peer::tls_sender(io.info()))
                            },
                        ),
                    );
                    server.serve_with_incoming_shutdown(incoming, stop).await
                }
                #[cfg(not(holdfast_sim))]
                _ => {
                    let incoming = peer_listener.incoming_limited(peer_slots, peer_refused);
                    let incoming = holdfast_proto::transport::divert(
                        incoming,
                        raw_preface,
                        crate::raw_append::PREFACE_TIMEOUT,
                        raw_appends(&raw_service, &raw_shutdown, |_| None),
                    );
                    server.serve_with_incoming_shutdown(incoming, stop).await
                }
                #[cfg(holdfast_sim)]
                _ => {
                    let _ = (peer_slots, peer_refused);
                    let incoming = holdfast_proto::transport::divert(
                        peer_listener.incoming(),
                        raw_preface,
                        crate::raw_append::PREFACE_TIMEOUT,
                        raw_appends(&raw_service, &raw_shutdown, |_| None),
                    );
                    server.serve_with_incoming_shutdown(incoming, stop).await
                }
            };
            if let Err(e) = served {
                tracing::error!(%e, "peer server failed");
            }
        }));

        let client_calls = ClientService {
            node: shared.clone(),
        };
        let client_service =
            holdfast_proto::v1::holdfast_server::HoldfastServer::new(client_calls.clone())
                .max_decoding_message_size(MAX_REQUEST_BYTES);
        // `Calls` connections outside gRPC (`crate::raw_calls`), told apart from gRPC ones by their
        // first bytes, each served by a task of its own. `peer`: who the connection is from.
        fn raw_calls<IO>(
            service: ClientService,
            shutdown: &tokio::sync::watch::Receiver<bool>,
            peer: fn(&IO) -> crate::raw_calls::Peer,
        ) -> impl Fn(IO) + Send + Sync + 'static
        where
            IO: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
        {
            let shutdown = shutdown.clone();
            move |io: IO| {
                let (service, mut shutdown) = (service.clone(), shutdown.clone());
                let peer = peer(&io);
                tokio::spawn(async move {
                    tokio::select! {
                        () = crate::raw_calls::serve(service, io, peer) => {}
                        _ = shutdown.changed() => {}
                    }
                });
            }
        }
        let calls_preface: &'static [u8] =
            if config.compat_no_raw_calls || config.compat_no_call_streams {
                holdfast_proto::transport::NO_PREFACE
            } else {
                crate::raw_calls::PREFACE
            };
        let calls_shutdown = shutdown_rx.clone();
        let mut rx = shutdown_rx.clone();
        let slots = Arc::new(tokio::sync::Semaphore::new(config.max_client_connections));
        let _ = shared.metrics.client_connection_slots.set(slots.clone());
        let max_streams = config.max_streams_per_connection;
        let refused = shared.metrics.client_connections_refused.clone();
        let client_tls = tls.clone();
        tasks.push(client_runtime.spawn(async move {
            let stop = async move {
                let _ = rx.changed().await;
            };
            let server = tonic::transport::Server::builder()
                .http2_keepalive_interval(Some(Duration::from_secs(10)))
                .max_concurrent_streams(Some(max_streams))
                .add_service(client_service);
            #[cfg(not(holdfast_sim))]
            let served = match client_tls {
                Some(tls) => {
                    let incoming = client_listener.incoming_tls(
                        tls.client_port.clone(),
                        Some((slots, refused)),
                        crate::tls::admit_client,
                        tls.refused_client.clone(),
                    );
                    let incoming = holdfast_proto::transport::divert(
                        incoming,
                        calls_preface,
                        crate::raw_calls::HELLO_TIMEOUT,
                        raw_calls(
                            client_calls,
                            &calls_shutdown,
                            |io: &holdfast_proto::tls::TlsConn<
                                holdfast_proto::transport::Limited<tokio::net::TcpStream>,
                            >| crate::raw_calls::Peer {
                                addr: io.info().remote_addr,
                                tls: Some(io.info().clone()),
                            },
                        ),
                    );
                    server.serve_with_incoming_shutdown(incoming, stop).await
                }
                None => {
                    let incoming = client_listener.incoming_limited(slots, refused);
                    let incoming = holdfast_proto::transport::divert(
                        incoming,
                        calls_preface,
                        crate::raw_calls::HELLO_TIMEOUT,
                        raw_calls(
                            client_calls,
                            &calls_shutdown,
                            |io: &holdfast_proto::transport::Limited<tokio::net::TcpStream>| {
                                use tonic::transport::server::Connected;
                                crate::raw_calls::Peer {
                                    addr: io.connect_info().remote_addr(),
                                    tls: None,
                                }
                            },
                        ),
                    );
                    server.serve_with_incoming_shutdown(incoming, stop).await
                }
            };
            #[cfg(holdfast_sim)]
            let served = {
                let _ = (client_tls, slots, refused);
                let incoming = holdfast_proto::transport::divert(
                    client_listener.incoming(),
                    calls_preface,
                    crate::raw_calls::HELLO_TIMEOUT,
                    raw_calls(client_calls, &calls_shutdown, |_| crate::raw_calls::Peer {
                        addr: None,
                        tls: None,
                    }),
                );
                server.serve_with_incoming_shutdown(incoming, stop).await
            };
            if let Err(e) = served {
                tracing::error!(%e, "client server failed");
            }
        }));

        let http_addr = match config.http_listen {
            Some(addr) => {
                let listener = tokio::net::TcpListener::bind(addr)
                    .await
                    .with_context(|| format!("cannot listen for http on {addr}"))?;
                let local = listener.local_addr()?;
                tasks.push(tokio::spawn(crate::http::serve(
                    listener,
                    shared.clone(),
                    shutdown_rx.clone(),
                )));
                Some(local)
            }
            None => None,
        };

        if let Some(tls) = &tls {
            tasks.push(tokio::spawn(tls.clone().watch(shutdown_rx.clone())));
        }
        tasks.push(tokio::spawn(peers.clone().sweep_idle(shutdown_rx.clone())));
        if let Some(access) = &access {
            tasks.push(tokio::spawn(access.clone().watch(shutdown_rx.clone())));
        }
        for group in &shared.groups {
            tasks.push(tokio::spawn(group.clone().run_leadership()));
            tasks.push(tokio::spawn(group.clone().run_expiry(shutdown_rx.clone())));
        }
        tasks.push(tokio::spawn(learn_members(
            shared.clone(),
            shutdown_rx.clone(),
        )));
        if config.balance_leaders && shared.groups.len() > 1 {
            tasks.push(tokio::spawn(balance_leaders(
                shared.clone(),
                shutdown_rx.clone(),
            )));
        }
        tasks.push(tokio::spawn(compact_pinning_groups(
            wal.clone(),
            shared.clone(),
            shutdown_rx.clone(),
        )));
        tasks.push(tokio::spawn(unload_idle_groups(
            shared.clone(),
            shutdown_rx.clone(),
        )));
        tracing::info!(node = config.node_id, %client_addr, %peer_addr, groups = config.groups, "holdfast server started");
        Ok(Node {
            shared,
            wal,
            shutdown,
            tasks,
            client_addr,
            peer_addr,
            http_addr,
            _client_runtime: client_runtime,
            _dir_lock: dir_lock,
        })
    }

    /// Resolves when Raft in any group has stopped on its own (a storage failure): the process must exit.
    pub async fn fatal(&self) -> String {
        let mut waits = Vec::new();
        for g in &self.shared.groups {
            // Waits for openraft's core to end, which drops the senders of its metrics channels. Not
            // by watching `Raft::metrics` for the error: those are published on every turn of the core
            // loop (each message, I/O completion and 10 ms tick), and this future runs on the main
            // thread (`block_on`), so each publication was a thread wake-up, ~5 per log entry. The
            // server metrics change only with the role, vote, leader or membership.
            let mut server = g.raft.server_metrics();
            let all = g.raft.metrics();
            waits.push(Box::pin(async move {
                use openraft::async_runtime::WatchReceiver;
                while server.changed().await.is_ok() {}
                match &all.borrow_watched().running_state {
                    Err(e) => format!("group {}: {e}", g.id),
                    Ok(()) => format!("group {}: raft stopped", g.id),
                }
            }));
        }
        futures::future::select_all(waits).await.0
    }

    /// Hands leadership of every group this server leads to an up-to-date follower (a planned restart
    /// then costs a transfer, not an election timeout), stops serving, stops Raft in every group, then
    /// flushes and closes the WAL.
    pub async fn shutdown(self) {
        self.shared.hand_over_all(HAND_OVER_ON_STOP).await;
        let _ = self.shutdown.send(true);
        for g in &self.shared.groups {
            if let Err(e) = g.raft.shutdown().await {
                tracing::warn!(group = g.id, %e, "raft shutdown");
            }
        }
        for t in self.tasks {
            t.abort();
        }
        let wal = self.wal.clone();
        let _ = crate::blocking(move || {
            wal.close();
            Ok(())
        })
        .await;
        tracing::info!("holdfast server stopped");
    }
}

/// How long a stopping server waits for each group's new leader to take over before it stops anyway.
/// Short, because every server of `holdfast dev` stops at once and a transfer to a stopping follower
/// cannot complete.
const HAND_OVER_ON_STOP: Duration = Duration::from_secs(1);

impl NodeShared {
    /// Hands over every group this server leads, all at once, each within `within`; logs the outcome.
    pub async fn hand_over_all(&self, within: Duration) {
        let led: Vec<_> = self
            .groups
            .iter()
            .filter(|g| g.raft_metrics().state == ServerState::Leader)
            .collect();
        let started = tokio::time::Instant::now();
        let results =
            futures::future::join_all(led.iter().map(|g| g.hand_over(None, within))).await;
        for (g, r) in led.iter().zip(results) {
            match r {
                Ok(to) => tracing::info!(
                    group = g.id,
                    "handed leadership of group {} to node {to} in {} ms before stopping",
                    g.id,
                    started.elapsed().as_millis()
                ),
                Err(e) => tracing::warn!(
                    group = g.id,
                    "could not hand leadership of group {} over before stopping: {e}",
                    g.id
                ),
            }
        }
    }

    pub fn status(&self, with_digest: bool) -> pb::StatusResponse {
        let groups = self
            .groups
            .iter()
            .map(|g| {
                let m = g.raft_metrics();
                let view = g.membership_view();
                let leader_endpoint = m
                    .current_leader
                    .and_then(|l| self.client_endpoint(l))
                    .unwrap_or_default();
                let s = g.state.read().expect("state lock");
                let f = s.figures();
                pb::GroupStatus {
                    group: g.id,
                    role: role(m.state).into(),
                    term: m.current_term,
                    leader_id: m.current_leader.unwrap_or(0),
                    leader_endpoint,
                    last_log_index: m.last_log_index.unwrap_or(0),
                    committed_index: m.local_committed.map_or(0, |l| l.index),
                    applied_index: s.last_applied.map_or(0, |l| l.index),
                    snapshot_index: m.snapshot.map_or(0, |l| l.index),
                    purged_index: m.purged.map_or(0, |l| l.index),
                    sessions: f.sessions,
                    locks: f.locks,
                    waiters: f.waiters,
                    digest: if with_digest { s.digest() } else { 0 },
                    leader_confirmed: g.quorum_confirmed(),
                    table_bytes: f.table_bytes,
                    table_budget: f.table_budget,
                    voters: view.voters,
                    learners: view.learners,
                    unloaded: s.unloaded.is_some(),
                }
            })
            .collect();
        pb::StatusResponse {
            node_id: self.config.node_id,
            cluster_id: format!("{:016x}", self.cluster_id),
            group_count: self.config.groups,
            groups,
            members: self.members(),
        }
    }

    /// Where clients reach member `id`: this server's configuration, else the Raft membership of any
    /// group (a member added after this server was configured).
    pub fn client_endpoint(&self, id: u64) -> Option<String> {
        if let Some(m) = self.config.member(id) {
            return Some(m.client.clone());
        }
        self.groups
            .iter()
            .find_map(|g| {
                g.raft_metrics()
                    .membership_config
                    .membership()
                    .get_node(&id)
                    .map(|n| n.client.clone())
                    .filter(|c| !c.is_empty())
            })
            .or_else(|| {
                let directory = self.directory.lock().expect("directory lock");
                directory
                    .members
                    .get(&id)
                    .map(|m| m.client_endpoint.clone())
                    .filter(|c| !c.is_empty())
            })
    }

    /// Every group's members (voters of any group, then learners of some group only), then configured
    /// servers in no group. A cluster of more than five servers places each group on some of them, so
    /// no one group names them all. `voter_of` counts only the groups this server is a voter of: its
    /// view of a group it left, or was never in, may be stale. Members that only others know of come
    /// from the [`Directory`], as they describe themselves.
    fn members(&self) -> Vec<pb::Member> {
        let me = self.config.node_id;
        let mut known: BTreeMap<u64, (crate::raft_types::MemberNode, Vec<u32>, bool)> =
            BTreeMap::new();
        for g in &self.groups {
            let metrics = g.raft_metrics();
            let membership = metrics.membership_config.membership();
            let voters: std::collections::BTreeSet<u64> = membership.voter_ids().collect();
            let current = voters.contains(&me);
            for (id, n) in membership.nodes() {
                let entry = known
                    .entry(*id)
                    .or_insert_with(|| (n.clone(), Vec::new(), false));
                if voters.contains(id) {
                    entry.2 = true;
                    if current {
                        entry.1.push(g.id);
                    }
                }
            }
        }
        let mut out: Vec<pb::Member> = known
            .into_iter()
            .map(|(id, (n, voter_of, voter))| {
                let configured = self.config.member(id);
                pb::Member {
                    node_id: id,
                    client_endpoint: configured
                        .map(|m| m.client.clone())
                        .unwrap_or_else(|| n.client.clone()),
                    peer_endpoint: configured
                        .map(|m| m.peer.clone())
                        .unwrap_or_else(|| n.peer.clone()),
                    role: if voter { "voter" } else { "learner" }.into(),
                    voter_of,
                }
            })
            .collect();
        {
            let directory = self.directory.lock().expect("directory lock");
            for m in directory.members.values() {
                if !out.iter().any(|o| o.node_id == m.node_id) {
                    out.push(m.clone());
                }
            }
        }
        out.sort_by_key(|m| (m.role != "voter", m.node_id));
        for m in &self.config.members {
            if !out.iter().any(|o| o.node_id == m.id) {
                out.push(pb::Member {
                    node_id: m.id,
                    client_endpoint: m.client.clone(),
                    peer_endpoint: m.peer.clone(),
                    role: "configured".into(),
                    voter_of: Vec::new(),
                });
            }
        }
        out
    }

    /// Every group's leader and every group's voters, in a cluster whose groups are placed on some
    /// servers only: this server's view of its own groups, and what each other member says it leads
    /// (with a quorum's confirmation), asked for its status within a second each. A group no answer
    /// accounts for has no leader here. What the answers say of the members goes to the [`Directory`].
    async fn leaders_everywhere(&self) -> (Vec<Option<u64>>, std::collections::BTreeSet<u64>) {
        let me = self.config.node_id;
        let mut leaders = vec![None; self.groups.len()];
        let mut voters = std::collections::BTreeSet::new();
        for g in &self.groups {
            let view = g.membership_view();
            if view.voters.contains(&me) {
                leaders[g.id as usize] = g.current_leader();
                voters.extend(view.voters);
            }
        }
        // Every member this server knows of, and every member those name (a server in none of this
        // server's groups may be known only to others).
        let mut to_ask: Vec<(u64, String)> = self
            .members()
            .into_iter()
            .filter(|m| m.role != "configured")
            .map(|m| (m.node_id, m.client_endpoint))
            .collect();
        let mut asked = std::collections::BTreeSet::from([me]);
        let mut learned: BTreeMap<u64, pb::Member> = BTreeMap::new();
        let mut reached = false;
        while let Some((id, endpoint)) = to_ask.pop() {
            if !asked.insert(id) {
                continue;
            }
            let Ok(s) = self.member_status(&endpoint, id).await else {
                continue;
            };
            reached = true;
            learn_from(&s, &mut learned);
            to_ask.extend(
                s.members
                    .iter()
                    .filter(|m| m.role != "configured" && !asked.contains(&m.node_id))
                    .map(|m| (m.node_id, m.client_endpoint.clone())),
            );
            for g in s
                .groups
                .iter()
                .filter(|g| g.role == "leader" && g.leader_confirmed)
            {
                if let Some(slot) = leaders.get_mut(g.group as usize) {
                    *slot = Some(s.node_id);
                    voters.extend(g.voters.iter().copied());
                }
            }
        }
        for (g, leader) in self.groups.iter().zip(&leaders) {
            g.learn_leader(*leader);
        }
        if reached {
            learned.remove(&me);
            let mut directory = self.directory.lock().expect("directory lock");
            directory.members = learned;
            directory.refreshed = Some(tokio::time::Instant::now());
        }
        (leaders, voters)
    }

    /// Ready when a write or a linearizable read of every group can be served now, here or at the leader
    /// this server redirects to: the group's leader (this server, or the one it names) has been
    /// acknowledged by a quorum within 3/4 of the election timeout. Err says, per group, why not. Only
    /// the groups this server is a voter of count (all of them, up to five servers; `holdfast member
    /// place` puts groups on some servers only); a server that is a voter of none is not ready.
    pub async fn readiness(&self) -> Result<(), String> {
        let mut problems = Vec::new();
        let mut elsewhere: std::collections::BTreeMap<u64, Vec<u32>> = Default::default();
        let me = self.config.node_id;
        let mine: Vec<&Arc<Group>> = self
            .groups
            .iter()
            .filter(|g| g.membership_view().voters.contains(&me))
            .collect();
        if mine.is_empty() {
            return Err(format!(
                "this server is a voter of none of the {} groups (a joining server waits for `holdfast member add` or `holdfast member place`)",
                self.groups.len()
            ));
        }
        for g in mine {
            if g.quorum_confirmed() {
                continue;
            }
            match g.current_leader() {
                Some(l) if l == self.config.node_id => problems.push(format!(
                    "group {}: this server leads but no quorum acknowledged it recently",
                    g.id
                )),
                Some(l) => elsewhere.entry(l).or_default().push(g.id),
                None => problems.push(format!("group {}: no leader known", g.id)),
            }
        }
        for (leader, groups) in elsewhere {
            let endpoint = self.client_endpoint(leader);
            let answer = match &endpoint {
                Some(ep) => self.member_status(ep, leader).await,
                None => Err(format!("node {leader} is not a member")),
            };
            for g in groups {
                let why = match &answer {
                    Ok(s) => match s.groups.iter().find(|gs| gs.group == g) {
                        Some(gs) if gs.leader_confirmed => continue,
                        _ => "does not have a quorum".to_string(),
                    },
                    Err(e) => format!("is unreachable ({e})"),
                };
                problems.push(format!(
                    "group {g}: the leader, node {leader} at {}, {why}",
                    endpoint.as_deref().unwrap_or("?")
                ));
            }
        }
        if problems.is_empty() {
            Ok(())
        } else {
            Err(problems.join("\n"))
        }
    }
}

impl NodeShared {
    /// A channel to node `id`'s client port at `endpoint`, kept for the next call to it (over TLS when
    /// the cluster has it). It has no request timeout: callers bound their calls.
    pub fn client_channel(
        &self,
        id: u64,
        endpoint: &str,
    ) -> Result<tonic::transport::Channel, String> {
        let mut channels = self.client_channels.lock().expect("client channels lock");
        let key = (id, endpoint.to_string());
        if let Some(channel) = channels.get(&key) {
            return Ok(channel.clone());
        }
        let endpoint = tonic::transport::Endpoint::from_shared(format!("http://{endpoint}"))
            .map_err(|e| e.to_string())?
            .connect_timeout(if self.tls.is_some() {
                holdfast_proto::transport::TLS_CONNECT_TIMEOUT
            } else {
                holdfast_proto::transport::CONNECT_TIMEOUT
            })
            // A kept connection that went half-open is closed (the next call reconnects) instead
            // of failing every call until the kernel gives up on it (see `holdfast_proto::transport`).
            .http2_keep_alive_interval(Duration::from_secs(1))
            .keep_alive_timeout(Duration::from_secs(3))
            .keep_alive_while_idle(true);
        let channel = crate::tls::client_channel(endpoint, id, self.tls.as_deref());
        if channels.len() >= MAX_CLIENT_CHANNELS {
            channels.clear();
        }
        channels.insert(key, channel.clone());
        Ok(channel)
    }

    /// Asks another server (node `id` at `endpoint`) for its status, within a second.
    async fn member_status(&self, endpoint: &str, id: u64) -> Result<pb::StatusResponse, String> {
        const PROBE_TIMEOUT: Duration = Duration::from_secs(1);
        let channel = self.client_channel(id, endpoint)?;
        let mut client = pb::holdfast_client::HoldfastClient::new(channel);
        match tokio::time::timeout(PROBE_TIMEOUT, client.status(pb::StatusRequest::default())).await
        {
            Ok(Ok(r)) => Ok(r.into_inner()),
            Ok(Err(s)) => Err(s.message().to_string()),
            Err(_) => Err(format!("no answer within {PROBE_TIMEOUT:?}")),
        }
    }
}

fn role(s: ServerState) -> &'static str {
    match s {
        ServerState::Leader => "leader",
        ServerState::Follower => "follower",
        ServerState::Candidate => "candidate",
        ServerState::Learner => "learner",
        ServerState::Shutdown => "shutdown",
    }
}

/// How often the server looks for groups that pin the oldest WAL segment, and the least time between two
/// compactions of one group (a group that keeps writing a little would otherwise be snapshotted on every
/// look).
const PIN_CHECK_INTERVAL: Duration = Duration::from_secs(5);
const PIN_COMPACT_MIN_INTERVAL: Duration = Duration::from_secs(30);
/// A group that pins the oldest segment but would reach its snapshot threshold within this long at its
/// current rate is not compacted.
const PIN_PATIENCE: Duration = Duration::from_secs(600);

/// Snapshots a group whose log grew by `snapshot_every_bytes` since its last snapshot, and keeps disk use
/// bounded: a group whose old records keep the oldest closed WAL segment on disk, and that
/// will not reach its own snapshot threshold soon (a group that rarely writes may never, and one whose
/// due snapshot would wait for a longer log may not for long), is snapshotted
/// and its log purged. A group that writes fast enough to reach the threshold within
/// [`PIN_PATIENCE`] is left to its normal snapshot (after a restart every group pins the segment the
/// restart closed).
async fn compact_pinning_groups(
    wal: Arc<Wal>,
    shared: Arc<NodeShared>,
    mut shutdown: watch::Receiver<bool>,
) {
    let mut last: std::collections::BTreeMap<u32, tokio::time::Instant> = Default::default();
    // Per group: applied index at the previous look, to estimate its rate.
    let mut seen: std::collections::BTreeMap<u32, u64> = Default::default();
    let every = shared.config.snapshot_every_entries;
    let size_limit = shared.config.snapshot_every_bytes;
    // Per group: (snapshot index, log bytes) when that snapshot was first seen.
    let mut size_marks: std::collections::BTreeMap<u32, (u64, u64)> = Default::default();
    loop {
        tokio::select! {
            _ = tokio::time::sleep(PIN_CHECK_INTERVAL) => {}
            _ = shutdown.changed() => return,
        }
        let pinning = wal.pinning_groups();
        for (g, group) in shared.groups.iter().enumerate() {
            let g = g as u32;
            let m = group.raft_metrics();
            // By size: a group whose log grew by `snapshot_every_bytes` since its last snapshot is
            // snapshotted now (openraft's own policy counts entries only; large values make few entries
            // many bytes). The normal purge follows, keeping `snapshot_keep_entries`.
            let bytes = group.log_bytes.load(Relaxed);
            let snapshot_index = m.snapshot.map_or(0, |l| l.index);
            // The first mark is where the newest snapshot began on the counter (0 for the one loaded
            // at start: the counter starts at the log replayed after it; later for one built since).
            let mark = size_marks
                .entry(g)
                .or_insert_with(|| (snapshot_index, group.pacing.begun()));
            if mark.0 != snapshot_index {
                *mark = (snapshot_index, bytes);
            } else if size_limit > 0 && bytes - mark.1 >= size_limit {
                tracing::info!(
                    group = g,
                    bytes = bytes - mark.1,
                    "log over snapshot_every_bytes: snapshotting"
                );
                mark.1 = bytes;
                if let Err(e) = group.snapshot_now().await {
                    tracing::warn!(group = g, %e, "cannot trigger a snapshot");
                }
            }
            let applied = m.last_applied.map_or(0, |l| l.index);
            let previous = seen.insert(g, applied);
            if !pinning.contains(&g) {
                continue;
            }
            let Some(previous) = previous else { continue };
            let since_snapshot = applied - snapshot_index.min(applied);
            let rate_per_check = applied.saturating_sub(previous);
            let checks = PIN_PATIENCE.as_secs() / PIN_CHECK_INTERVAL.as_secs();
            // It will snapshot by itself soon enough: it reaches openraft's next ask within
            // PIN_PATIENCE at its current rate, and that ask is not deferred. While its snapshots
            // wait for a longer log (`SnapshotPacing`) openraft asks again only `every` entries after
            // the last ask, so it must write that many more: a large table's group that went quiet
            // after a due snapshot waited would never be asked again and keep the segment for ever,
            // while a busy one (a full purge here would send lagging followers the snapshot) is
            // left to its paced snapshot.
            let asked_soon = if group.pacing.would_defer() {
                rate_per_check * checks >= every
            } else {
                since_snapshot + rate_per_check * checks >= every
            };
            if asked_soon {
                continue;
            }
            let now = tokio::time::Instant::now();
            if last
                .get(&g)
                .is_some_and(|t| now - *t < PIN_COMPACT_MIN_INTERVAL)
            {
                continue;
            }
            last.insert(g, now);
            group.compact_log().await;
        }
    }
}

/// How often [`unload_idle_groups`] looks.
const UNLOAD_CHECK: Duration = Duration::from_secs(1);

/// Drops from memory the table of each group this server is not a voter of (it left the group, or is a
/// learner) and does not lead, once nothing was appended to or applied in it for `unload_after_ms`:
/// snapshots it at its applied state if no snapshot is there yet, then [`Unloader::unload`]s it. The
/// next entry applied loads it back (`state_machine`), so this frees memory and forgets nothing.
///
/// Why only non-voters: a voter applies every entry of its group, so an unloaded voter would reload at
/// the group's next write. A server that left a group, though, hears nothing more of it (openraft stops
/// replicating to a removed member at once), and kept the whole table in memory before this.
///
/// [`Unloader::unload`]: crate::state_machine::Unloader::unload
async fn unload_idle_groups(shared: Arc<NodeShared>, mut shutdown: watch::Receiver<bool>) {
    let after = Duration::from_millis(shared.config.unload_after_ms);
    if after.is_zero() {
        return;
    }
    #[cfg(holdfast_sim)]
    let voters_too = shared.config.sim_unload_voters;
    #[cfg(not(holdfast_sim))]
    let voters_too = false;
    // Per group: (last log index, applied index), and since when they have not moved.
    type Mark = (Option<u64>, Option<u64>);
    let mut quiet: BTreeMap<u32, (Mark, tokio::time::Instant)> = BTreeMap::new();
    loop {
        tokio::select! {
            _ = tokio::time::sleep(UNLOAD_CHECK) => {}
            _ = shutdown.changed() => return,
        }
        let now = tokio::time::Instant::now();
        for group in &shared.groups {
            let m = group.raft_metrics();
            let mark = (m.last_log_index, m.last_applied.as_ref().map(|l| l.index));
            let since = quiet.entry(group.id).or_insert((mark, now));
            if since.0 != mark {
                *since = (mark, now);
                continue;
            }
            let voter = crate::group::a_voter(m.id, &m.membership_config);
            if now - since.1 < after
                || m.last_applied.is_none()
                || m.state == ServerState::Leader
                || (voter && !voters_too)
                || group.unloader.is_unloaded()
            {
                continue;
            }
            if m.snapshot != m.last_applied {
                // openraft ignores this while it builds one; the next look sees the snapshot.
                if let Err(e) = group.snapshot_now().await {
                    tracing::warn!(group = group.id, %e, "cannot snapshot an idle group to unload it");
                }
                continue;
            }
            let unloader = group.unloader.clone();
            let leads = group.clone();
            let unloaded = crate::blocking(move || {
                Ok(unloader.unload(|| leads.raft_metrics().state != ServerState::Leader))
            })
            .await;
            match unloaded {
                Ok(Ok(locks)) => tracing::info!(
                    group = group.id,
                    locks,
                    applied = m.last_applied.map_or(0, |l| l.index),
                    voter,
                    "idle group unloaded: its table is on disk only until it is needed"
                ),
                Ok(Err(why)) => tracing::debug!(group = group.id, ?why, "not unloaded"),
                Err(e) => tracing::warn!(group = group.id, %e, "unloading failed"),
            }
        }
    }
}

/// A seed for Raft's randomized timeouts that differs per process and start: from the OS random number
/// generator, or (should that fail) a hash of the time and pid with std's per-process random keys.
fn random_seed() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut bytes = [0u8; 8];
    if getrandom::getrandom(&mut bytes).is_ok() {
        return u64::from_le_bytes(bytes);
    }
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u64(crate::now_ms());
    h.write_u32(std::process::id());
    h.finish()
}

/// Refuses to run two servers on one data directory (they would interleave WAL writes). The simulated
/// file system has no locks, and a simulated host cannot run twice.
#[cfg(holdfast_sim)]
fn lock_data_dir(_config: &ServerConfig) -> anyhow::Result<Option<std::fs::File>> {
    Ok(None)
}

/// Refuses to run two servers on one data directory (they would interleave WAL writes).
#[cfg(not(holdfast_sim))]
fn lock_data_dir(config: &ServerConfig) -> anyhow::Result<Option<std::fs::File>> {
    let path = config.data_dir.join("LOCK");
    let file = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(&path)
        .with_context(|| format!("cannot open {}", path.display()))?;
    match file.try_lock() {
        Ok(()) => Ok(Some(file)),
        Err(_) => anyhow::bail!(
            "data dir {} is in use by another holdfast server",
            config.data_dir.display()
        ),
    }
}

/// What the [`Directory`] takes from one server's status: its word on itself, then on its fellow voters
/// of the groups it is a voter of. Not the members it only learned of from others (their groups are
/// none of its own): two servers would otherwise keep naming a departed server to each other for ever.
fn learn_from(s: &pb::StatusResponse, learned: &mut BTreeMap<u64, pb::Member>) {
    let own = s.members.iter().find(|m| m.node_id == s.node_id);
    let its_groups = own.map_or(&[][..], |m| &m.voter_of[..]);
    for m in s
        .members
        .iter()
        .filter(|m| m.voter_of.iter().any(|g| its_groups.contains(g)))
    {
        learned.entry(m.node_id).or_insert_with(|| m.clone());
    }
    if let Some(own) = own.filter(|m| m.role != "configured") {
        learned.insert(s.node_id, own.clone());
    }
}

/// Keeps the [`Directory`] of a server that is not a voter of every group: every [`DIRECTORY_EVERY`], a
/// round of [`NodeShared::leaders_everywhere`] unless the leader balancer ran one since. A server that
/// is a voter of every group knows every member from its own groups and forgets what it learned.
async fn learn_members(node: Arc<NodeShared>, mut shutdown: watch::Receiver<bool>) {
    let me = node.config.node_id;
    let mut tick = tokio::time::interval(DIRECTORY_EVERY);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    // When this task's own last round that reached anyone ended.
    let mut own_round = None;
    loop {
        tokio::select! {
            _ = tick.tick() => {}
            _ = shutdown.changed() => return,
        }
        if *shutdown.borrow() {
            return;
        }
        // A group with no voters known yet (a server starting, or waiting to be added) says
        // nothing: a round then would only copy what this server is about to know itself.
        let everywhere = node.groups.iter().all(|g| {
            let voters = g.membership_view().voters;
            voters.is_empty() || voters.contains(&me)
        });
        if everywhere {
            *node.directory.lock().expect("directory lock") = Directory::default();
            for g in &node.groups {
                g.learn_leader(None);
            }
            continue;
        }
        // The balancer's rounds come every DIRECTORY_EVERY too, at another phase: one of its rounds a
        // little older than a period still counts, so the two do not both ask every member.
        let refreshed = node.directory.lock().expect("directory lock").refreshed;
        let by_balancer = refreshed.is_some_and(|t| {
            Some(t) != own_round && t.elapsed() < DIRECTORY_EVERY + DIRECTORY_EVERY / 4
        });
        if !by_balancer {
            node.leaders_everywhere().await;
            own_round = node.directory.lock().expect("directory lock").refreshed;
        }
    }
}

/// How often a server checks whether it leads more than its share of the groups.
const BALANCE_EVERY: Duration = Duration::from_secs(2);
/// After a move that failed, how long a server leaves leaderships where they are.
const BALANCE_BACKOFF: Duration = Duration::from_secs(30);
/// After a leadership change this server did not make (an operator's transfer, an election, another
/// server's move), how long it waits for things to settle before it moves anything.
const BALANCE_SETTLE: Duration = Duration::from_secs(10);

/// Spreads group leaderships over the voters (`balance_leaders`). Each server only ever gives away its
/// own leaderships, one at a time: when, in its own view of every group's leader (with groups placed on
/// some servers only, learned from the other members' status), it leads at least two
/// more than the live voter that leads the fewest, and either more than its share (`ceil(groups /
/// voters)`) or the most of all servers (the lowest id among equals), it hands one group to that voter.
/// So the counts end at most one apart: within one of even. The target must have acknowledged this leader within the last
/// election timeout (a dead voter leads nothing and would otherwise be chosen again and again) and
/// have the group's log up to the commit index; groups in a membership change, or already handing
/// over, are left alone. After a failed move it waits [`BALANCE_BACKOFF`], and after any change of
/// leaders it did not make, [`BALANCE_SETTLE`]. The two-apart rule is the hysteresis. A move stops that group's keepalive answers until the target takes over (tens of ms; a
/// failed move costs an election, under a second) and gives every session of the group a fresh TTL.
async fn balance_leaders(node: Arc<NodeShared>, mut shutdown: watch::Receiver<bool>) {
    let me = node.config.node_id;
    let live_within = Duration::from_millis(node.config.election_timeout_min_ms);
    let mut tick = tokio::time::interval(BALANCE_EVERY);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    // The elections that start a cluster are changes this server did not make: settle after them too
    // (an operator may be placing leaders by hand meanwhile).
    let mut quiet_until = tokio::time::Instant::now() + BALANCE_SETTLE;
    // The leaders seen at the last tick (None: not comparable, after this server's own move).
    let mut last_seen: Option<Vec<Option<u64>>> = None;
    loop {
        tokio::select! {
            _ = tick.tick() => {}
            _ = shutdown.changed() => return,
        }
        if tokio::time::Instant::now() < quiet_until || *shutdown.borrow() {
            continue;
        }
        // The groups this server is a voter of: all of them up to five servers. With groups placed on
        // some servers only (`holdfast member place`) the other groups' leaders are learned by asking
        // every other member for its status.
        let voter_of: Vec<&Arc<Group>> = node
            .groups
            .iter()
            .filter(|g| g.membership_view().voters.contains(&me))
            .collect();
        let (leaders, voters) = if voter_of.len() == node.groups.len() {
            let leaders: Vec<Option<u64>> =
                node.groups.iter().map(|g| g.current_leader()).collect();
            let voters: std::collections::BTreeSet<u64> = node
                .groups
                .iter()
                .flat_map(|g| {
                    let m = g.raft_metrics();
                    m.membership_config
                        .membership()
                        .voter_ids()
                        .collect::<Vec<_>>()
                })
                .collect();
            (leaders, voters)
        } else {
            node.leaders_everywhere().await
        };
        // Only with a settled view: every group has a leader this server knows.
        if leaders.iter().any(Option::is_none) {
            continue;
        }
        let changed = last_seen.as_ref().is_some_and(|seen| *seen != leaders);
        last_seen = Some(leaders.clone());
        if changed {
            quiet_until = tokio::time::Instant::now() + BALANCE_SETTLE;
            continue;
        }
        let mut led: BTreeMap<u64, usize> = voters.iter().map(|&v| (v, 0)).collect();
        for l in leaders.iter().flatten() {
            *led.entry(*l).or_default() += 1;
        }
        let mine = led.get(&me).copied().unwrap_or(0);
        let share = node.groups.len().div_ceil(led.len().max(1));
        // Over its share, a server gives one away. At or under it, only the lowest-numbered of the
        // servers that lead the most does, so that a server that leads nothing (just restarted: its
        // groups went to others, every one of which is now at its share) still gets one, and the
        // servers at the top do not all hand it one at once.
        let most = led.values().copied().max().unwrap_or(0);
        let first_of_most = led.iter().find(|(_, n)| **n == most).map(|(id, _)| *id);
        if mine <= share && first_of_most != Some(me) {
            continue;
        }
        let candidate = voter_of.iter().find_map(|g| {
            if !g.quorum_confirmed() || g.is_handing_over() {
                return None;
            }
            let m = g.raft_metrics();
            let settled = m.membership_config.log_id() == m.committed_membership_config.log_id()
                && m.membership_config.membership().get_joint_config().len() == 1;
            if !settled {
                return None;
            }
            let committed = m.local_committed.map_or(0, |l| l.index);
            let live = |v: &u64| {
                m.heartbeat
                    .as_ref()
                    .and_then(|h| h.get(v).cloned().flatten())
                    .is_some_and(|at| openraft::Instant::elapsed(&*at) < live_within)
            };
            let caught_up = |v: &u64| {
                m.replication
                    .as_ref()
                    .and_then(|r| r.get(v).cloned().flatten())
                    .is_some_and(|l| l.index >= committed)
            };
            m.membership_config
                .membership()
                .voter_ids()
                .filter(|&v| v != me)
                .filter(|v| live(v) && caught_up(v))
                .map(|v| (led.get(&v).copied().unwrap_or(0), v))
                .min()
                .filter(|(count, _)| mine >= count + 2)
                .map(|(_, v)| (Arc::clone(g), v))
        });
        let Some((group, to)) = candidate else {
            continue;
        };
        last_seen = None;
        match group.hand_over(Some(to), Duration::from_secs(2)).await {
            Ok(leader) => tracing::info!(
                group = group.id,
                to = leader,
                "leadership moved to spread groups ({mine} led here, share {share})"
            ),
            Err(e) => {
                tracing::info!(group = group.id, to, %e, "leadership move failed; leaving leaderships alone for {BALANCE_BACKOFF:?}");
                quiet_until = tokio::time::Instant::now() + BALANCE_BACKOFF;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn member(id: u64, role: &str, voter_of: &[u32]) -> pb::Member {
        pb::Member {
            node_id: id,
            client_endpoint: format!("127.0.0.1:{}", 7000 + id),
            peer_endpoint: format!("127.0.0.1:{}", 8000 + id),
            role: role.into(),
            voter_of: voter_of.to_vec(),
        }
    }

    /// Node 2 is a voter of group 0 with nodes 3 and 4; it names node 9 only from what it learned of
    /// others (a voter of group 1, which node 2 is not in), and node 5 from a group it left.
    #[test]
    fn a_server_is_believed_on_itself_and_its_fellow_voters_only() {
        let status = pb::StatusResponse {
            node_id: 2,
            members: vec![
                member(2, "voter", &[0]),
                member(3, "voter", &[0]),
                member(4, "voter", &[0]),
                member(5, "voter", &[]),
                member(9, "voter", &[1]),
                member(6, "configured", &[]),
            ],
            ..Default::default()
        };
        let mut learned = BTreeMap::new();
        // Node 3 described itself earlier in the round: its own word stands.
        learned.insert(3, member(3, "voter", &[0, 2]));
        learn_from(&status, &mut learned);
        assert_eq!(learned.keys().copied().collect::<Vec<_>>(), [2, 3, 4]);
        assert_eq!(learned[&3].voter_of, [0, 2]);

        // A server's word on itself replaces what others said of it.
        let own = pb::StatusResponse {
            node_id: 4,
            members: vec![member(4, "voter", &[0, 3])],
            ..Default::default()
        };
        learn_from(&own, &mut learned);
        assert_eq!(learned[&4].voter_of, [0, 3]);

        // A server in no group is not a member to name.
        let joining = pb::StatusResponse {
            node_id: 6,
            members: vec![member(6, "configured", &[])],
            ..Default::default()
        };
        learn_from(&joining, &mut learned);
        assert!(!learned.contains_key(&6));
    }
}
