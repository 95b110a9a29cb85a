//! Raft traffic between servers over gRPC: the client side ([`PeerNetwork`], openraft's network) and the
//! server side ([`PeerService`]).
//!
//! Messages are the protobuf types of `proto/holdfast/v1/raft.proto` (service `Peer`, format
//! [`PEER_FORMAT`]), converted from and to openraft's by [`crate::formats`]. Every request starts with a
//! `PeerHeader`; the receiver checks its format, cluster id and addressee before anything else and refuses a
//! mismatch with a status that says which. Snapshots stream in 1 MiB chunks. Every call has a timeout taken
//! from openraft's `RPCOption`, so a partitioned peer costs a bounded wait.
//!
//! A peer's address comes from this server's configuration when it lists that member id (so a member can
//! move to a new address by configuration), else from the Raft membership.

use crate::formats::{self, required, PEER_FORMAT};
use crate::raft_types::{MemberNode, NodeId, Raft, Snapshot, SnapshotData, TypeConfig, Vote};
use holdfast_proto::v1 as pb;
use holdfast_proto::v1::peer_client::PeerClient as GrpcPeerClient;
use holdfast_proto::v1::peer_server::Peer;
use openraft::errors::{NetworkError, RPCError, ReplicationClosed, StreamingError, Unreachable};
use openraft::network::{RPCOption, RaftNetworkFactory, RaftNetworkV2};
use openraft::raft::{
    AppendEntriesRequest, AppendEntriesResponse, SnapshotResponse, TransferLeaderRequest,
    TransferLeaderResponse, VoteRequest, VoteResponse,
};
use std::collections::BTreeMap;
use std::future::Future;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tonic::transport::{Channel, Endpoint};

/// Snapshot bytes per streamed chunk.
const SNAPSHOT_CHUNK_BYTES: usize = 1 << 20;
/// Largest snapshot a server accepts from a peer: ~20× the design's 100 MB table.
pub const MAX_SNAPSHOT_BYTES: usize = 2 << 30;
/// Snapshots a server receives at once, over all its groups: each is buffered whole (up to
/// `MAX_SNAPSHOT_BYTES`) and decoded before it is installed, so this bounds that memory. Another is
/// refused `UNAVAILABLE` and its leader sends it again later (openraft retries a failed snapshot).
pub const MAX_SNAPSHOT_RECEIVES: usize = 2;
/// Largest single peer message (an AppendEntries batch).
pub const MAX_PEER_MESSAGE_BYTES: usize = 64 << 20;

/// Who this server is on the peer network: put in every request it sends, checked on every one it gets.
#[derive(Clone, Copy, Debug)]
pub struct PeerIdentity {
    pub cluster_id: u64,
    pub node_id: NodeId,
}

/// Connections to the other servers, one lazily connected channel per peer, shared by all groups.
#[derive(Clone)]
pub struct Peers {
    me: PeerIdentity,
    /// Peer addresses from this server's configuration, preferred over the Raft membership's.
    addresses: Arc<BTreeMap<NodeId, String>>,
    /// Keyed by address too: a member re-added at a new address gets a new channel.
    channels: Arc<Mutex<BTreeMap<(NodeId, String), Channel>>>,
    health: Arc<Mutex<BTreeMap<NodeId, Health>>>,
    /// Peers that answered AppendStream with UNIMPLEMENTED (they predate it): appends to them go one
    /// unary call at a time until then, when streaming is tried again (they may have been upgraded).
    /// Here rather than in a `PeerClient`, which openraft may make anew after an error.
    unary_until: Arc<Mutex<BTreeMap<NodeId, tokio::time::Instant>>>,
    /// What each peer's latest AppendEntries reply said it reads (`AppendEntriesReply.features`).
    features: PeerFeatures,
    /// Connect over TLS, presenting this server's certificate (see `crate::tls`).
    tls: Option<holdfast_proto::tls::TlsConnector>,
    /// Connections for appends outside gRPC ([`crate::raw_append`]).
    raw: crate::raw_append::RawPool,
}

/// What each peer's latest AppendEntries reply said its lock table reads (`AppendEntriesReply.features`;
/// a peer that predates the field says 0). Heartbeats are AppendEntries calls, so every live follower
/// of a group this server leads answers several times a second.
#[derive(Clone, Default)]
pub struct PeerFeatures(Arc<Mutex<BTreeMap<NodeId, u64>>>);

impl PeerFeatures {
    fn record(&self, peer: NodeId, features: u64) {
        self.0
            .lock()
            .expect("peer features lock")
            .insert(peer, features);
    }

    fn forget(&self, peer: NodeId) {
        self.0.lock().expect("peer features lock").remove(&peer);
    }

    /// Whether every one of `peers` has said, in its latest reply, that it reads `feature`. A peer
    /// not heard from yet has not.
    pub fn all_have(&self, peers: impl IntoIterator<Item = NodeId>, feature: u64) -> bool {
        let known = self.0.lock().expect("peer features lock");
        peers
            .into_iter()
            .all(|p| known.get(&p).is_some_and(|f| f & feature == feature))
    }
}

/// A peer that stopped answering: logged once when it happens, summarised every [`HEALTH_SUMMARY`], and
/// once more when it answers again, instead of one line per failed heartbeat (several a second). The
/// clock here only spaces log lines; it decides nothing.
struct Health {
    down_since: tokio::time::Instant,
    failed: u64,
    last_logged: tokio::time::Instant,
}

/// How often a peer that stays unreachable is summarised in the log.
const HEALTH_SUMMARY: Duration = Duration::from_secs(10);

impl Peers {
    pub fn new(
        me: PeerIdentity,
        addresses: BTreeMap<NodeId, String>,
        tls: Option<holdfast_proto::tls::TlsConnector>,
    ) -> Self {
        Peers {
            me,
            addresses: Arc::new(addresses),
            channels: Arc::default(),
            health: Arc::default(),
            unary_until: Arc::default(),
            features: PeerFeatures::default(),
            tls,
            raw: Default::default(),
        }
    }

    /// What the peers said they read, shared with the groups (see [`PeerFeatures::all_have`]).
    pub fn features(&self) -> PeerFeatures {
        self.features.clone()
    }

    /// Closes idle append connections until `stop` changes ([`crate::raw_append::RawPool::sweep_idle`]).
    pub async fn sweep_idle(self, stop: tokio::sync::watch::Receiver<bool>) {
        self.raw.sweep_idle(stop).await;
    }

    /// [`Peers::report`] of a call's result.
    fn report_result<T>(&self, target: NodeId, result: &Result<T, RPCError<TypeConfig>>) {
        match result {
            Ok(_) => self.report(target, Ok(())),
            Err(e) => self.report(target, Err(&e.to_string())),
        }
    }

    /// Records the outcome of one message to `target`, logging only the changes and a summary.
    fn report(&self, target: NodeId, result: Result<(), &str>) {
        let now = tokio::time::Instant::now();
        let mut health = self.health.lock().expect("peer health lock");
        match (result, health.get_mut(&target)) {
            (Ok(()), None) => {}
            (Ok(()), Some(h)) => {
                tracing::info!(
                    "node {target} reachable again after {:.1} s ({} messages to it failed)",
                    (now - h.down_since).as_secs_f64(),
                    h.failed
                );
                health.remove(&target);
            }
            (Err(e), None) => {
                tracing::warn!("node {target} unreachable: {e}; retrying (summarised every {} s until it answers)", HEALTH_SUMMARY.as_secs());
                health.insert(
                    target,
                    Health {
                        down_since: now,
                        failed: 1,
                        last_logged: now,
                    },
                );
            }
            (Err(e), Some(h)) => {
                h.failed += 1;
                if now - h.last_logged >= HEALTH_SUMMARY {
                    h.last_logged = now;
                    tracing::warn!(
                        "node {target} unreachable for {:.0} s, {} messages to it failed (last: {e})",
                        (now - h.down_since).as_secs_f64(),
                        h.failed
                    );
                }
            }
        }
    }

    /// The TLS connector for connections to `target` (gRPC and appends alike): over TLS, the
    /// answering server must be `target` itself.
    fn connector(&self, target: NodeId) -> Option<holdfast_proto::tls::TlsConnector> {
        self.tls
            .as_ref()
            .map(|t| holdfast_proto::tls::TlsConnector {
                expect_common_name: Some(format!("{}{target}", crate::tls::SERVER_NAME_PREFIX)),
                ..t.clone()
            })
    }

    fn channel(&self, target: NodeId, addr: &str) -> Result<Channel, String> {
        let mut channels = self.channels.lock().expect("peer channel lock");
        if let Some(c) = channels.get(&(target, addr.to_string())) {
            return Ok(c.clone());
        }
        let channel = Endpoint::from_shared(format!("http://{addr}"))
            .map_err(|e| format!("bad peer address {addr}: {e}"))?
            .connect_timeout(if self.tls.is_some() {
                holdfast_proto::transport::TLS_CONNECT_TIMEOUT
            } else {
                holdfast_proto::transport::CONNECT_TIMEOUT
            })
            .tcp_nodelay(true)
            // A connection that stops answering pings (a half-open socket, a stalled simulated stream)
            // is closed, and the next RPC reconnects instead of timing out on it forever.
            .http2_keep_alive_interval(Duration::from_secs(1))
            // Not too tight: a late ping answer closes the connection and fails every RPC on it.
            .keep_alive_timeout(Duration::from_secs(3))
            .keep_alive_while_idle(true);
        let connector = self.connector(target);
        let channel = holdfast_proto::transport::connect_lazy_tls(channel, connector.as_ref());
        channels.insert((target, addr.to_string()), channel.clone());
        Ok(channel)
    }
}

/// openraft's network factory for one group.
pub struct PeerNetwork {
    pub group: u32,
    pub peers: Peers,
    /// The group's log (see [`append_frame`]).
    pub log: crate::log_store::LogStore,
    /// The group's replication targets and what each acknowledged last ([`Acks`]).
    pub acks: Arc<Acks>,
}

impl RaftNetworkFactory<TypeConfig> for PeerNetwork {
    type Network = PeerClient;

    async fn new_client(&mut self, target: NodeId, node: &MemberNode) -> PeerClient {
        let addr = self
            .peers
            .addresses
            .get(&target)
            .cloned()
            .unwrap_or_else(|| node.peer.clone());
        PeerClient {
            group: self.group,
            target,
            channel: self.peers.channel(target, &addr),
            raw_tls: self.peers.connector(target),
            addr,
            peers: self.peers.clone(),
            log: self.log.clone(),
            acks: self.acks.joined(target),
        }
    }
}

pub struct PeerClient {
    group: u32,
    target: NodeId,
    channel: Result<Channel, String>,
    /// The peer's address, for connections outside gRPC.
    addr: String,
    /// Their TLS connector (checks the answering server is `target`), if the cluster uses TLS.
    raw_tls: Option<holdfast_proto::tls::TlsConnector>,
    peers: Peers,
    /// The group's log, whose encoding of recent entries appends copy.
    log: crate::log_store::LogStore,
    /// Counts this client among the group's replication targets while it lives.
    acks: Joined,
}

/// Replies of an append stream waiting to be sent (a leader has at most [`APPEND_STREAM_DEPTH`]
/// requests unanswered; an older leader's pipeline may have more).
const PIPELINE_REPLIES: usize = 64;

/// How long a peer that does not know AppendStream gets unary appends before streaming is tried again.
const UNARY_FALLBACK: Duration = Duration::from_secs(60);

impl PeerClient {
    fn client(&self) -> Result<GrpcPeerClient<Channel>, RPCError<TypeConfig>> {
        match &self.channel {
            Ok(c) => Ok(GrpcPeerClient::new(c.clone())
                .max_decoding_message_size(MAX_PEER_MESSAGE_BYTES)
                .max_encoding_message_size(MAX_PEER_MESSAGE_BYTES)),
            Err(e) => Err(RPCError::Unreachable(Unreachable::from_string(e))),
        }
    }

    fn header(&self) -> pb::PeerHeader {
        pb::PeerHeader {
            format: PEER_FORMAT,
            cluster_id: self.peers.me.cluster_id,
            from_node: self.peers.me.node_id,
            to_node: self.target,
            group: self.group,
        }
    }

    /// One call with a timeout; its outcome feeds the peer's health log.
    async fn call<Resp, F, Fut>(
        &self,
        timeout: Duration,
        f: F,
    ) -> Result<Resp, RPCError<TypeConfig>>
    where
        F: FnOnce(GrpcPeerClient<Channel>) -> Fut,
        Fut: Future<Output = Result<tonic::Response<Resp>, tonic::Status>>,
    {
        let result = match self.client() {
            Err(e) => Err(e),
            Ok(client) => match tokio::time::timeout(timeout, f(client)).await {
                Err(_) => Err(RPCError::Network(NetworkError::from_string(format!(
                    "no reply from node {} within {timeout:?}",
                    self.target
                )))),
                Ok(Err(status)) => Err(status_error(self.target, status)),
                Ok(Ok(reply)) => Ok(reply.into_inner()),
            },
        };
        self.peers.report_result(self.target, &result);
        result
    }

    fn malformed(&self, e: String) -> RPCError<TypeConfig> {
        RPCError::Network(NetworkError::from_string(format!(
            "malformed reply from node {}: {e}",
            self.target
        )))
    }
}

impl PeerClient {
    /// An AppendEntries on a connection of its own ([`crate::raw_append`]), or over gRPC if the peer
    /// does not serve those. Reported to the peer's health log like a gRPC call.
    async fn raw_append(
        &self,
        rpc: &AppendEntriesRequest<TypeConfig>,
        timeout: Duration,
    ) -> Result<pb::AppendEntriesReply, RPCError<TypeConfig>> {
        use crate::raw_append::RawError;
        let target = self.target;
        tracing::trace!(
            target: "holdfast::hop",
            to = target,
            index = rpc.entries.last().map_or(0, |e| e.log_id.index),
            "append sent"
        );
        let deadline = tokio::time::Instant::now() + timeout;
        let frame = append_frame(self.header(), rpc, |entries, field, out| {
            self.log.encode_entries(entries, field, out)
        });
        let sent = match frame {
            Ok(frame) => {
                self.peers
                    .raw
                    .append_frame(
                        (target, &self.addr, self.group),
                        self.raw_tls.as_ref(),
                        &frame,
                        rpc.entries.is_empty(),
                        deadline,
                    )
                    .await
            }
            Err(e) => Err(e),
        };
        let result = match sent {
            Ok(reply) => {
                tracing::trace!(target: "holdfast::hop", from = target, "append reply");
                Ok(reply)
            }
            Err(RawError::NotServed(_)) => {
                let left = deadline.saturating_duration_since(tokio::time::Instant::now());
                let req = append_request_to_pb(self.header(), rpc);
                return self
                    .call(left, |mut c| async move { c.append_entries(req).await })
                    .await;
            }
            // Unreachable, not a network error: openraft backs off at once instead of after ten.
            Err(RawError::Connect(e)) => Err(RPCError::Unreachable(Unreachable::from_string(
                format!("node {target}: no connection for appends: {e}"),
            ))),
            // A network error, not unreachable: a slow follower's features are not forgotten.
            Err(RawError::Busy(e)) => Err(RPCError::Network(NetworkError::from_string(format!(
                "node {target}: {e}"
            )))),
            Err(RawError::Io(e)) => Err(RPCError::Network(NetworkError::from_string(format!(
                "node {target}: append connection failed: {e}"
            )))),
            Err(RawError::TimedOut) => Err(RPCError::Network(NetworkError::from_string(format!(
                "no reply from node {target} within {timeout:?}"
            )))),
            Err(RawError::Refused(status)) => Err(status_error(target, status)),
        };
        self.peers.report_result(target, &result);
        result
    }
}

impl PeerClient {
    /// One request at a time, each answered before the next is taken: openraft's
    /// `stream_append_sequential`, except that the session ends once whether the peer takes appends
    /// on connections of their own changes (a request found it does not, here or in another session
    /// to it): openraft's next session then uses the `AppendStream` call instead of unary calls, or
    /// those connections again; and a request that carries only a commit index waits a moment for the
    /// next, which replaces it ([`COMMIT_ONLY_HOLD`]).
    fn append_sequential<'s, S>(
        &'s mut self,
        input: S,
        option: RPCOption,
    ) -> futures::future::BoxFuture<'s, Result<AppendResults<'s>, RPCError<TypeConfig>>>
    where
        S: futures::Stream<Item = AppendEntriesRequest<TypeConfig>> + Send + Unpin + 's,
    {
        use futures::StreamExt;
        // Whether the session began on appends' own connections: it ends once that changes (here,
        // or in another session to the same peer, such as the heartbeats').
        let raw = self.peers.raw.serves(self.target);
        let results = futures::stream::unfold(Some((self, input.fuse(), None)), move |state| {
            let option = option.clone();
            async move {
                // `answered`: when this session's last reply came, and whether it was late.
                let (network, mut input, answered) = state?;
                if let Some((at, true)) = answered {
                    tokio::time::sleep_until(at + LATE_WAIT).await;
                    network.acks.waited();
                }
                let req = input.next().await?;
                // Only after a reply in this session: openraft waits out its backoff (after an error)
                // as it builds a request, and only a reply it has seen turns that off, so a request
                // built during a hold before then would wait out a backoff (200 ms at first) that the
                // held one's reply would have ended.
                let req = match answered {
                    Some(_) => fold_commit_only(req, &mut input).await,
                    None => req,
                };
                let prev = req.prev_log_id;
                let last = req.entries.last().map(|e| e.log_id).or(prev);
                let entries = req.entries.len();
                let result = network.append_entries(req, option).await;
                let raw_after = network.peers.raw.serves(network.target);
                match result {
                    Ok(resp) => {
                        // A partial success stops the session, as in openraft's.
                        let whole = match &resp {
                            AppendEntriesResponse::PartialSuccess(m) => *m == last,
                            _ => true,
                        };
                        let result = resp.into_stream_result(prev, last);
                        let go_on = result.is_ok() && whole && raw == raw_after;
                        let late = match last {
                            Some(last) if go_on && entries > 0 => network
                                .acks
                                .acknowledged(last.index, entries <= LATE_MAX_ENTRIES),
                            _ => false,
                        };
                        let answered = Some((tokio::time::Instant::now(), late));
                        Some((Ok(result), go_on.then_some((network, input, answered))))
                    }
                    Err(e) => Some((Err(e), None)),
                }
            }
        });
        Box::pin(futures::future::ready(Ok(results.boxed())))
    }
}

/// How long the leader's replication session to a follower whose last acknowledgement was late waits
/// after it before it takes (so openraft builds) its next request: late means that enough other voters
/// had already acknowledged that index to commit it with the leader ([`Acks`]), so that follower's
/// acknowledgements are not what commits wait for. Meanwhile the leader's new entries gather, and the
/// follower gets them in one append. With five servers and one client, two followers commit each entry
/// and two are late: those two take the entries of 2 ms in one append instead of one append each, and
/// an append costs a follower a wake-up, a turn of its Raft core, a WAL write and sync, and a reply,
/// whatever its size (docs/performance.md, "Late followers wait"). A follower whose acknowledgement a
/// commit does need (another stalled, or went away) is not late, so it does not wait; nor does one
/// catching up ([`LATE_MAX_LAG`]), a learner, or any follower while the membership is joint. Only
/// replies to appends of a few entries count ([`LATE_MAX_ENTRIES`]): a heartbeat or a commit-only
/// request is never followed by a wait (a heartbeat's session ends after its reply, and openraft reads
/// that end before it counts the reply, which the linearizable-read check waits on). A session that
/// ends after a late reply (a probe done, a new batch id) ends up to this much later. Nothing about
/// safety changes: what commits, and the leader's lease, depend on acknowledgements, not on when
/// requests are sent.
pub(crate) const LATE_WAIT: Duration = Duration::from_millis(2);

/// A follower this many entries or more behind the one furthest ahead is catching up, not late.
pub(crate) const LATE_MAX_LAG: u64 = 4096;

/// Only a reply to an append of at most this many entries can be late. Where appends are larger (64
/// clients or more on the development machine: 25–35 entries an append) the fixed cost an append saves
/// is a small part of each entry's, while a wait costs a commit up to [`LATE_WAIT`] whenever one of the
/// followers that usually commit is slow for a round and a waiting one is needed: measured, the
/// 256-client p99 rose by ~15% and nothing at 64 clients gained (docs/performance.md).
pub(crate) const LATE_MAX_ENTRIES: usize = 8;

/// At a group's leader: the index each replication target acknowledged last (`Target::acked`; a target
/// counts while openraft holds a network client for it), and the voters of the newest membership.
/// Shared by the group's sessions, so that each can tell whether its follower's acknowledgements are
/// the ones commits wait for ([`LATE_WAIT`]).
#[derive(Default)]
pub struct Acks {
    table: Mutex<AckTable>,
    /// Waits of [`LATE_WAIT`] before a request (`holdfast_replication_late_acks_total`).
    pub waits: std::sync::atomic::AtomicU64,
}

#[derive(Default)]
struct AckTable {
    targets: BTreeMap<NodeId, Target>,
    /// The voters of the newest membership other than this server, and how many of them a commit needs
    /// beside it. None before it is known and while the membership is joint (two majorities): then no
    /// acknowledgement is late.
    voters: Option<(std::collections::BTreeSet<NodeId>, usize)>,
}

#[derive(Default)]
struct Target {
    /// Network clients openraft holds for it.
    clients: usize,
    /// The last index it acknowledged in a reply to an append with entries on this server's
    /// sequential sessions (0 before its first). One from an earlier leadership of this server, left by
    /// a client that outlived it, can be wrong after the follower's log was cut back: then at most one
    /// reply is taken for late that was not, a wait of [`LATE_WAIT`] once.
    acked: u64,
}

/// One network client's membership of [`Acks`]: counted as a target while it lives.
struct Joined {
    acks: Arc<Acks>,
    target: NodeId,
}

impl Acks {
    fn joined(self: &Arc<Self>, target: NodeId) -> Joined {
        let mut table = self.table.lock().expect("acks lock");
        table.targets.entry(target).or_default().clients += 1;
        Joined {
            acks: self.clone(),
            target,
        }
    }

    /// The group's newest membership, as this server (`me`) sees it. Voters only: a learner's
    /// acknowledgement commits nothing.
    pub fn set_membership(
        &self,
        me: NodeId,
        membership: &openraft::Membership<NodeId, MemberNode>,
    ) {
        let configs = membership.get_joint_config();
        let voters = match configs.as_slice() {
            [voters] => {
                // A majority of the voters, less this server if it is one of them.
                let needed = voters.len() / 2 + 1 - usize::from(voters.contains(&me));
                let others = voters.iter().copied().filter(|&v| v != me).collect();
                Some((others, needed))
            }
            _ => None,
        };
        self.table.lock().expect("acks lock").voters = voters;
    }

    /// Whether `target`'s acknowledgement of `index` was late: `target` is a voter, as many other
    /// voters had already acknowledged `index` as a commit needs beside this server, and `target` is
    /// not catching up.
    fn late(table: &AckTable, target: NodeId, index: u64) -> bool {
        let Some((voters, needed)) = &table.voters else {
            return false;
        };
        if !voters.contains(&target) {
            return false;
        }
        let ahead = table
            .targets
            .iter()
            .filter(|&(&id, t)| id != target && voters.contains(&id) && t.acked >= index)
            .count();
        let furthest = table.targets.values().map(|t| t.acked).max().unwrap_or(0);
        ahead >= *needed && furthest.saturating_sub(index) < LATE_MAX_LAG
    }
}

impl Joined {
    /// Records that this client's target acknowledged `index` (an append with entries); says whether
    /// that was late ([`Acks::late`]) when it `may_be_late`.
    fn acknowledged(&self, index: u64, may_be_late: bool) -> bool {
        let mut table = self.acks.table.lock().expect("acks lock");
        if let Some(t) = table.targets.get_mut(&self.target) {
            t.acked = index;
        }
        may_be_late && Acks::late(&table, self.target, index)
    }

    /// Counts a wait of [`LATE_WAIT`] that is over.
    fn waited(&self) {
        self.acks
            .waits
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    }
}

impl Drop for Joined {
    fn drop(&mut self) {
        let mut table = self.acks.table.lock().expect("acks lock");
        if let Some(t) = table.targets.get_mut(&self.target) {
            t.clients -= 1;
            if t.clients == 0 {
                table.targets.remove(&self.target);
            }
        }
    }
}

/// How long a request that carries no entries, only a newer commit index, waits for the next request
/// of its replication session before it is sent. After every commit that leaves nothing else to send,
/// openraft's pipeline sends each follower such a request, so that it learns the commit (and applies)
/// at once; with one client, every entry cost each follower two round trips, one of them for this.
/// The next request carries the latest commit index too (openraft reads it as it builds a request,
/// and it only grows), and the same `prev_log_id` check, so it replaces the one held: one round trip
/// per entry. The price is that an idle follower learns a commit up to this much later (its heartbeats,
/// every `heartbeat_interval_ms`, carry the commit index as well). Nothing waits on that: the leader
/// answers a client once the entry is committed and applied on the leader, and its lease counts only
/// acknowledgements of what was sent, from when the request was built, so a request sent later is a
/// shorter lease, never a longer one.
pub(crate) const COMMIT_ONLY_HOLD: Duration = Duration::from_millis(2);

/// The request to send next in a replication session: `req`, unless it carries no entries and the
/// session yields another within [`COMMIT_ONLY_HOLD`]; then the first such with entries, or the last
/// one without when the hold ends or the session's requests do. A request not sent is acknowledged by
/// the reply to the one that replaced it (openraft drops every request in flight that a reply's
/// matching log id covers, and the replacement's covers the held one's, which has the same).
async fn fold_commit_only<S>(
    mut req: AppendEntriesRequest<TypeConfig>,
    input: &mut futures::stream::Fuse<S>,
) -> AppendEntriesRequest<TypeConfig>
where
    S: futures::Stream<Item = AppendEntriesRequest<TypeConfig>> + Unpin,
{
    use futures::stream::StreamExt;
    // A fused stream that ended says so here too.
    if !req.entries.is_empty() || futures::Stream::size_hint(input).1 == Some(0) {
        return req;
    }
    let hold = tokio::time::sleep(COMMIT_ONLY_HOLD);
    tokio::pin!(hold);
    loop {
        tokio::select! {
            biased;
            next = input.next() => match next {
                Some(next) => {
                    debug_assert!(next.leader_commit >= req.leader_commit, "a commit index went back");
                    debug_assert!(next.prev_log_id >= req.prev_log_id, "a session's requests went back");
                    req = next;
                    if !req.entries.is_empty() {
                        return req;
                    }
                }
                None => return req,
            },
            () = &mut hold => return req,
        }
    }
}

fn status_error(target: NodeId, status: tonic::Status) -> RPCError<TypeConfig> {
    let msg = format!(
        "node {target}: {}",
        holdfast_proto::status_with_causes(&status)
    );
    match status.code() {
        tonic::Code::Unavailable | tonic::Code::Unknown => {
            RPCError::Unreachable(Unreachable::from_string(msg))
        }
        _ => RPCError::Network(NetworkError::from_string(msg)),
    }
}

fn vote_request_to_pb(header: pb::PeerHeader, rpc: &VoteRequest<TypeConfig>) -> pb::VoteRequest {
    pb::VoteRequest {
        header: Some(header),
        vote: Some(formats::vote_to_pb(&rpc.vote)),
        last_log_id: formats::opt_log_id_to_pb(&rpc.last_log_id),
        leadership_transfer: rpc.leadership_transfer,
    }
}

fn vote_reply_from_pb(r: &pb::VoteReply) -> Result<VoteResponse<TypeConfig>, String> {
    Ok(VoteResponse {
        vote: formats::vote_from_pb(required(&r.vote, "vote")?),
        vote_granted: r.granted,
        last_log_id: formats::opt_log_id_from_pb(&r.last_log_id),
    })
}

fn append_request_to_pb(
    header: pb::PeerHeader,
    rpc: &AppendEntriesRequest<TypeConfig>,
) -> pb::AppendEntriesRequest {
    pb::AppendEntriesRequest {
        entries: rpc.entries.iter().map(formats::entry_to_pb).collect(),
        ..append_head_to_pb(header, rpc)
    }
}

/// `rpc`'s fields but its entries.
fn append_head_to_pb(
    header: pb::PeerHeader,
    rpc: &AppendEntriesRequest<TypeConfig>,
) -> pb::AppendEntriesRequest {
    pb::AppendEntriesRequest {
        header: Some(header),
        vote: Some(formats::vote_to_pb(&rpc.vote)),
        prev_log_id: formats::opt_log_id_to_pb(&rpc.prev_log_id),
        entries: Vec::new(),
        leader_commit: formats::opt_log_id_to_pb(&rpc.leader_commit),
    }
}

/// `rpc` framed for a connection of its own ([`crate::raw_append::finish_frame`]): the message
/// [`append_request_to_pb`] makes, with its entries last. `encoded` appends the entries as the log
/// encoded them when they were appended, if it still can ([`crate::log_store::GroupLog::encode_entries`]:
/// the newest, so a batch is encoded once for all followers); else they are encoded here (older
/// entries, which only a follower that lags gets).
fn append_frame(
    header: pb::PeerHeader,
    rpc: &AppendEntriesRequest<TypeConfig>,
    encoded: impl FnOnce(&[crate::raft_types::Entry], u32, &mut Vec<u8>) -> bool,
) -> Result<Vec<u8>, crate::raw_append::RawError> {
    const ENTRIES: u32 = 4;
    use prost::Message;
    let head = append_head_to_pb(header, rpc);
    let mut frame = Vec::with_capacity(4 + head.encoded_len() + 128 * rpc.entries.len());
    frame.extend_from_slice(&[0; 4]);
    head.encode(&mut frame)
        .expect("encoding to a Vec cannot fail");
    if !rpc.entries.is_empty() && !encoded(&rpc.entries, ENTRIES, &mut frame) {
        for e in &rpc.entries {
            formats::put_bytes_field(ENTRIES, &formats::encode_entry(e), &mut frame);
        }
    }
    crate::raw_append::finish_frame(frame)
}

fn append_request_from_pb(
    m: &pb::AppendEntriesRequest,
) -> Result<AppendEntriesRequest<TypeConfig>, String> {
    Ok(AppendEntriesRequest {
        vote: formats::vote_from_pb(required(&m.vote, "vote")?),
        prev_log_id: formats::opt_log_id_from_pb(&m.prev_log_id),
        entries: formats::collect_sized(
            m.entries.len(),
            m.entries.iter().map(formats::entry_from_pb),
        )?,
        leader_commit: formats::opt_log_id_from_pb(&m.leader_commit),
    })
}

type AppendResults<'s> = futures::stream::BoxStream<
    's,
    Result<openraft::raft::StreamAppendResult<TypeConfig>, RPCError<TypeConfig>>,
>;

impl PeerClient {
    /// AppendEntries over one long-lived AppendStream call: each request goes out when openraft
    /// produces it and the one before it is answered ([`APPEND_STREAM_DEPTH`]), replies come back in
    /// order. A reply owed for longer than the append deadline fails the
    /// stream (openraft then starts a new one), so a follower that stops answering costs a bounded wait.
    async fn append_stream<S>(
        &mut self,
        mut input: S,
        option: RPCOption,
    ) -> Result<AppendResults<'static>, RPCError<TypeConfig>>
    where
        S: futures::Stream<Item = AppendEntriesRequest<TypeConfig>> + Send + Unpin + 'static,
    {
        use futures::StreamExt;
        // Take the first request before opening the call. openraft sleeps its retry backoff (after
        // an unreachable follower, or a session that made no progress) inside the request stream,
        // when the next request is taken: a setup that fails before taking one skips the backoff, and
        // openraft starts the next session at once. Against a follower that refuses connections at
        // once that is a retry loop with no timer in it (in the simulation it ran a server out of
        // ports, each refused connect keeping one). `stream_append_sequential` takes it first too.
        let Some(first) = input.next().await else {
            return Ok(futures::stream::empty().boxed());
        };
        let input = futures::stream::once(futures::future::ready(first)).chain(input);
        let mut client = self.client()?;
        let deadline = option.soft_ttl().max(APPEND_ENTRIES_MIN_TIMEOUT);
        // When each request without a reply yet was sent, oldest first.
        let owed: Arc<Mutex<std::collections::VecDeque<tokio::time::Instant>>> = Arc::default();
        let header = self.header();
        // Once the replies are no longer read (openraft dropped them, or they failed), the requests
        // end too: openraft's next session shares this one's request state, and a request stream
        // left to the connection (which may be dead, and then holds it open until its keepalive
        // gives up) would keep taking its requests.
        let (replies_alive, replies_gone) = tokio::sync::oneshot::channel::<()>();
        let replied = Arc::new(tokio::sync::Notify::new());
        // Set when openraft's requests end (a probe done, or a new batch id): with nothing owed the
        // replies are then complete, and the results end without waiting for the follower's trailers.
        let input_done = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let input_ended = Arc::new(tokio::sync::Notify::new());
        let outgoing = {
            let input_ended = input_ended.clone();
            let (owed, replied, input_done) = (owed.clone(), replied.clone(), input_done.clone());
            // A request is taken from openraft only while fewer than APPEND_STREAM_DEPTH are
            // unanswered: openraft builds a request when it is taken, from every entry not yet sent,
            // so under load the requests a follower gets are batches, not one entry each. The
            // `take_until` is outside the wait, so requests also end while it waits for a reply that
            // will not be read.
            futures::stream::unfold(input, move |mut input| {
                let (owed, replied, input_done, input_ended) = (
                    owed.clone(),
                    replied.clone(),
                    input_done.clone(),
                    input_ended.clone(),
                );
                async move {
                    loop {
                        let notified = replied.notified();
                        if owed.lock().expect("append stream lock").len() < APPEND_STREAM_DEPTH {
                            break;
                        }
                        notified.await;
                    }
                    let Some(rpc) = input.next().await else {
                        input_done.store(true, std::sync::atomic::Ordering::Release);
                        input_ended.notify_one();
                        return None;
                    };
                    owed.lock()
                        .expect("append stream lock")
                        .push_back(tokio::time::Instant::now());
                    tracing::trace!(
                        target: "holdfast::hop",
                        to = header.to_node,
                        index = rpc.entries.last().map_or(0, |e| e.log_id.index),
                        "append sent"
                    );
                    Some((append_request_to_pb(header, &rpc), input))
                }
            })
            .take_until(replies_gone)
        };
        let target = self.target;
        let started = tokio::time::timeout(deadline, client.append_stream(outgoing)).await;
        let replies = match started {
            // Unreachable, not a network error: openraft backs off at once instead of after ten.
            Err(_) => Err(RPCError::Unreachable(Unreachable::from_string(format!(
                "node {target} did not take an append stream within {deadline:?}"
            )))),
            Ok(Err(status)) if status.code() == tonic::Code::Unimplemented => {
                tracing::info!(
                    "node {target} does not take append streams (an older version); appending one call at a time"
                );
                self.peers
                    .unary_until
                    .lock()
                    .expect("peer fallback lock")
                    .insert(target, tokio::time::Instant::now() + UNARY_FALLBACK);
                // Not a failure of the peer, so not reported as one (no "unreachable" warning every
                // UNARY_FALLBACK): openraft retries the batch, now one call at a time.
                return Err(status_error(target, status));
            }
            Ok(Err(status)) => Err(status_error(target, status)),
            Ok(Ok(r)) => Ok(r.into_inner()),
        };
        let replies = match replies {
            Ok(r) => r,
            Err(e) => {
                self.peers.report(target, Err(&e.to_string()));
                return Err(e);
            }
        };
        let peers = self.peers.clone();
        // The state carries whether the last reply was handed to openraft: its request is counted
        // as answered (and the next one may be taken) only when openraft asks for the next result,
        // having handled that one, as with unary calls.
        let results = futures::stream::unfold(
            Some((replies, owed, replies_alive, false)),
            move |state| {
                let (peers, replied) = (peers.clone(), replied.clone());
                let (input_done, input_ended) = (input_done.clone(), input_ended.clone());
                async move {
                    let (mut replies, owed, alive, answered) = state?;
                    if answered {
                        owed.lock().expect("append stream lock").pop_front();
                        replied.notify_one();
                    }
                    let result = loop {
                        let oldest = owed.lock().expect("append stream lock").front().copied();
                        let now = tokio::time::Instant::now();
                        if oldest.is_some_and(|t| now >= t + deadline) {
                            break Err(RPCError::Network(NetworkError::from_string(format!(
                                "no append reply from node {target} within {deadline:?}"
                            ))));
                        }
                        if oldest.is_none() && input_done.load(std::sync::atomic::Ordering::Acquire)
                        {
                            return None;
                        }
                        // With nothing owed, look again after a deadline (a request may go out meanwhile)
                        // or when the requests end.
                        let wait = oldest.map_or(deadline, |t| (t + deadline) - now);
                        let ended = input_ended.notified();
                        let message = tokio::time::timeout(wait, replies.message());
                        let next = tokio::select! {
                            m = message => m,
                            _ = ended, if oldest.is_none() => continue,
                        };
                        match next {
                            Err(_) => continue,
                            Ok(Err(status)) => break Err(status_error(target, status)),
                            // The follower ended the stream with a request unanswered: an error, so that
                            // openraft does not take it for a clean end.
                            Ok(Ok(None))
                                if !owed.lock().expect("append stream lock").is_empty() =>
                            {
                                break Err(RPCError::Network(NetworkError::from_string(format!(
                                "node {target} ended an append stream with a request unanswered"
                            ))))
                            }
                            Ok(Ok(None)) => return None,
                            Ok(Ok(Some(reply))) => {
                                tracing::trace!(target: "holdfast::hop", from = target, "append reply");
                                break append_reply_from_pb(reply).map_err(|e| {
                                    RPCError::Network(NetworkError::from_string(format!(
                                        "malformed append reply from node {target}: {e}"
                                    )))
                                });
                            }
                        }
                    };
                    peers.report_result(target, &result);
                    // Any error ends the stream (and with it the requests): after a conflict or a higher
                    // vote openraft starts over, and this stream must not take its next request. So
                    // does the peer taking append connections again (this stream began in a fallback):
                    // openraft's next session uses them.
                    let next = (matches!(result, Ok(Ok(_))) && !peers.raw.serves(target))
                        .then_some((replies, owed, alive, true));
                    Some((result, next))
                }
            },
        );
        Ok(Box::pin(results))
    }
}

fn append_reply_from_pb(
    reply: pb::AppendStreamReply,
) -> Result<openraft::raft::StreamAppendResult<TypeConfig>, String> {
    use openraft::raft::StreamAppendError;
    use pb::append_stream_reply::Result as R;
    match reply.result {
        Some(R::Matching(m)) => Ok(Ok(formats::opt_log_id_from_pb(&m.matching))),
        Some(R::Conflict(l)) => Ok(Err(StreamAppendError::Conflict(formats::log_id_from_pb(
            &l,
        )))),
        Some(R::HigherVote(v)) => Ok(Err(StreamAppendError::HigherVote(formats::vote_from_pb(
            &v,
        )))),
        None => Err("an append reply without a result".into()),
    }
}

fn append_reply_to_pb(
    result: openraft::raft::StreamAppendResult<TypeConfig>,
) -> pb::AppendStreamReply {
    use openraft::raft::StreamAppendError;
    use pb::append_stream_reply::Result as R;
    pb::AppendStreamReply {
        result: Some(match result {
            Ok(matching) => R::Matching(pb::PartialSuccess {
                matching: formats::opt_log_id_to_pb(&matching),
            }),
            Err(StreamAppendError::Conflict(l)) => R::Conflict(formats::log_id_to_pb(&l)),
            Err(StreamAppendError::HigherVote(v)) => R::HigherVote(formats::vote_to_pb(&v)),
        }),
    }
}

/// How many append requests may be unanswered on one stream. Measured (docs/performance.md, "Append
/// streams"): with no limit each request carried the few entries that arrived since the last one and
/// 256 clients did 29% fewer pairs/s than unary calls; with 2 or 4, fewer than with 1. With 1 the stream
/// still saves a call's setup per batch. A request counts as answered once openraft has taken its
/// reply and asks for the next, as with unary calls.
const APPEND_STREAM_DEPTH: usize = 1;

/// The least time an AppendEntries that carries entries is given before it counts as failed (it includes
/// the follower's WAL fsync). A vote's deadline is openraft's (3/4 of `election_timeout_min`).
pub const APPEND_ENTRIES_MIN_TIMEOUT: Duration = Duration::from_millis(200);

impl RaftNetworkV2<TypeConfig> for PeerClient {
    type SnapshotData = SnapshotData;

    async fn append_entries(
        &mut self,
        rpc: AppendEntriesRequest<TypeConfig>,
        option: RPCOption,
    ) -> Result<AppendEntriesResponse<TypeConfig>, RPCError<TypeConfig>> {
        // openraft gives replication the heartbeat interval as its deadline (37.5 ms of it with the
        // 50 ms default): less than a loaded follower's fsync, after which a give-up only resends the
        // same entries. Entries get at least APPEND_ENTRIES_MIN_TIMEOUT; heartbeats keep the short one.
        let timeout = if rpc.entries.is_empty() {
            option.soft_ttl()
        } else {
            option.soft_ttl().max(APPEND_ENTRIES_MIN_TIMEOUT)
        };
        let reply = if self.peers.raw.serves(self.target) {
            self.raw_append(&rpc, timeout).await
        } else {
            let req = append_request_to_pb(self.header(), &rpc);
            self.call(timeout, |mut c| async move { c.append_entries(req).await })
                .await
        };
        let reply = match reply {
            Ok(reply) => reply,
            Err(e) => {
                // A peer that cannot be reached (not one slow to answer: heartbeats time out under
                // load, and forgetting then sent a mass expiry one session an entry, measured) may
                // come back as another release: it has said nothing until it answers again.
                if matches!(e, RPCError::Unreachable(_)) {
                    self.peers.features.forget(self.target);
                }
                return Err(e);
            }
        };
        self.peers.features.record(self.target, reply.features);
        use pb::append_entries_reply::Result as R;
        match reply.result {
            Some(R::Success(_)) => Ok(AppendEntriesResponse::Success),
            Some(R::PartialSuccess(p)) => Ok(AppendEntriesResponse::PartialSuccess(
                formats::opt_log_id_from_pb(&p.matching),
            )),
            Some(R::Conflict(_)) => Ok(AppendEntriesResponse::Conflict),
            Some(R::HigherVote(v)) => {
                Ok(AppendEntriesResponse::HigherVote(formats::vote_from_pb(&v)))
            }
            None => Err(self.malformed("append entries reply without a result".into())),
        }
    }

    fn stream_append<'s, S>(
        &'s mut self,
        input: S,
        option: RPCOption,
    ) -> futures::future::BoxFuture<'s, Result<AppendResults<'s>, RPCError<TypeConfig>>>
    where
        S: futures::Stream<Item = AppendEntriesRequest<TypeConfig>>
            + openraft::OptionalSend
            + Unpin
            + 'static,
    {
        let unary = self
            .peers
            .unary_until
            .lock()
            .expect("peer fallback lock")
            .get(&self.target)
            .is_some_and(|&t| tokio::time::Instant::now() < t);
        // openraft sends each heartbeat as a stream of one request: a unary call costs less than
        // opening a stream for it.
        let single = input.size_hint().1.is_some_and(|n| n <= 1);
        // On a connection of their own appends go one at a time, each answered before the next is
        // taken (as `APPEND_STREAM_DEPTH` does on the gRPC stream), so openraft batches the same way.
        if unary || single || self.peers.raw.serves(self.target) {
            return self.append_sequential(input, option);
        }
        Box::pin(async move { self.append_stream(input, option).await })
    }

    async fn vote(
        &mut self,
        rpc: VoteRequest<TypeConfig>,
        option: RPCOption,
    ) -> Result<VoteResponse<TypeConfig>, RPCError<TypeConfig>> {
        let req = vote_request_to_pb(self.header(), &rpc);
        let reply = self
            .call(option.soft_ttl(), |mut c| async move { c.vote(req).await })
            .await?;
        vote_reply_from_pb(&reply).map_err(|e| self.malformed(e))
    }

    async fn pre_vote(
        &mut self,
        rpc: VoteRequest<TypeConfig>,
        option: RPCOption,
    ) -> Result<VoteResponse<TypeConfig>, RPCError<TypeConfig>> {
        let req = vote_request_to_pb(self.header(), &rpc);
        let reply = self
            .call(
                option.soft_ttl(),
                |mut c| async move { c.pre_vote(req).await },
            )
            .await?;
        vote_reply_from_pb(&reply).map_err(|e| self.malformed(e))
    }

    async fn transfer_leader(
        &mut self,
        req: TransferLeaderRequest<TypeConfig>,
        option: RPCOption,
    ) -> Result<TransferLeaderResponse<TypeConfig>, RPCError<TypeConfig>> {
        let msg = pb::PeerTransferLeaderRequest {
            header: Some(self.header()),
            from_leader: Some(formats::vote_to_pb(req.from_leader())),
            to_node: *req.to_node_id(),
            last_log_id: formats::opt_log_id_to_pb(&req.last_log_id().copied()),
        };
        let reply = self
            .call(option.soft_ttl(), |mut c| async move {
                c.transfer_leader(msg).await
            })
            .await?;
        use openraft::raft::TransferLeaderError as E;
        use pb::peer_transfer_leader_reply::Result as R;
        match reply.result {
            Some(R::Accepted(_)) => Ok(Ok(())),
            Some(R::VoteChanged(v)) => {
                let expected =
                    required(&v.expected, "expected vote").map_err(|e| self.malformed(e))?;
                let actual = required(&v.actual, "actual vote").map_err(|e| self.malformed(e))?;
                Ok(Err(E::VoteChanged {
                    expected: formats::vote_from_pb(expected),
                    actual: formats::vote_from_pb(actual),
                }))
            }
            Some(R::LogNotFlushed(l)) => Ok(Err(E::LogNotFlushed {
                expected: formats::opt_log_id_from_pb(&l.expected),
                actual: formats::opt_log_id_from_pb(&l.actual),
            })),
            None => Err(self.malformed("transfer leader reply without a result".into())),
        }
    }

    async fn full_snapshot(
        &mut self,
        vote: Vote,
        snapshot: Snapshot,
        cancel: impl Future<Output = ReplicationClosed> + openraft::OptionalSend + 'static,
        _option: RPCOption,
    ) -> Result<SnapshotResponse<TypeConfig>, StreamingError<TypeConfig>> {
        let mut client = self.client()?;
        let path = match snapshot.snapshot {
            SnapshotData::File(path) => path,
            SnapshotData::Received { .. } => {
                return Err(StreamingError::from(
                    self.malformed("only a snapshot file of this server is sent".into()),
                ))
            }
        };
        let file = crate::blocking(move || holdfast_wal::fs::File::open(&path))
            .await
            .map_err(|e| StreamingError::from(openraft::error::Unreachable::new(&e)))?;
        // The file is read a chunk at a time as the stream is sent: never all of it in memory.
        let mut prefix = Some(pb::SnapshotChunk {
            header: Some(self.header()),
            vote: Some(formats::vote_to_pb(&vote)),
            meta: Some(formats::snapshot_meta_to_pb(&snapshot.meta)),
            ..Default::default()
        });
        let chunks = futures::stream::unfold(Some(file), move |file| {
            let first = prefix.take();
            async move {
                let mut file = file?;
                let read = crate::blocking(move || {
                    let mut data = vec![0; SNAPSHOT_CHUNK_BYTES];
                    let mut filled = 0;
                    while filled < data.len() {
                        match std::io::Read::read(&mut file, &mut data[filled..])? {
                            0 => break,
                            n => filled += n,
                        }
                    }
                    data.truncate(filled);
                    Ok((file, data))
                })
                .await;
                match read {
                    Ok((file, data)) if data.is_empty() && first.is_none() => {
                        drop(file);
                        None
                    }
                    Ok((file, data)) => {
                        let mut chunk = first.unwrap_or_default();
                        chunk.data = data;
                        Some((chunk, Some(file)))
                    }
                    Err(e) => {
                        // Ends the stream short: the receiver's checksum refuses it.
                        tracing::warn!(%e, "cannot read the snapshot file being sent");
                        None
                    }
                }
            }
        });
        let send = client.install_snapshot(chunks);
        let reply = tokio::select! {
            closed = cancel => return Err(StreamingError::Closed(closed)),
            reply = send => reply,
        };
        let reply = reply
            .map_err(|s| StreamingError::from(status_error(self.target, s)))?
            .into_inner();
        let vote =
            required(&reply.vote, "vote").map_err(|e| StreamingError::from(self.malformed(e)))?;
        Ok(SnapshotResponse::new(formats::vote_from_pb(vote)))
    }
}

/// Resolves a group id to its Raft handle on this server.
pub trait RaftLookup: Send + Sync + 'static {
    fn raft(&self, group: u32) -> Option<&Raft>;
    /// Whether `AppendStream` is served (a compatibility test turns it off).
    fn serves_append_streams(&self) -> bool {
        true
    }
    /// Counts an accepted `AppendStream`.
    fn append_stream_accepted(&self) {}
    /// Whether appends on connections of their own are served ([`crate::raw_append`]; a compatibility
    /// test turns it off).
    fn serves_raw_appends(&self) -> bool {
        true
    }
    /// Counts an accepted connection of [`crate::raw_append`].
    fn raw_appends_accepted(&self) {}
    /// What this server's lock table reads, as `AppendEntriesReply.features` says (a compatibility
    /// test turns it off).
    fn features(&self) -> u64 {
        formats::FEATURES
    }
}

/// The server side of peer traffic.
pub struct PeerService<L> {
    lookup: Arc<L>,
    me: PeerIdentity,
    /// `MAX_SNAPSHOT_RECEIVES` permits, one held by each snapshot being received.
    receiving: Arc<tokio::sync::Semaphore>,
}

impl<L: RaftLookup> PeerService<L> {
    pub fn new(lookup: Arc<L>, me: PeerIdentity) -> Self {
        PeerService {
            lookup,
            me,
            receiving: Arc::new(tokio::sync::Semaphore::new(MAX_SNAPSHOT_RECEIVES)),
        }
    }

    /// Serves one `AppendStream`: the first request's header and vote are checked like a unary
    /// append's, and every later one must carry the same header and a vote of the same node.
    async fn serve_append_stream(
        &self,
        mut stream: tonic::Streaming<pb::AppendEntriesRequest>,
        sender: Option<Option<u64>>,
        tx: &tokio::sync::mpsc::Sender<Result<pb::AppendStreamReply, tonic::Status>>,
    ) -> Result<(), tonic::Status> {
        use futures::StreamExt;
        let Some(first) = stream.message().await? else {
            return Ok(());
        };
        let raft = self
            .raft(&first.header, sender, first.vote.as_ref())?
            .clone();
        self.lookup.append_stream_accepted();
        let header = first.header;
        let node = first.vote.as_ref().map(|v| v.node);
        // openraft spawns the stream's task with its runtime's deterministic seed, which lives in a
        // task-local: give it one drawn from the stream's identity (the same in every simulation run).
        let seed = header.as_ref().map_or(0, |h| {
            (h.from_node.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ u64::from(h.group))
                .wrapping_add(first.vote.as_ref().map_or(0, |v| v.term))
        });
        // A later request refused here ends openraft's input; the stream then ends with this status
        // (after the replies to the requests before it) instead of OK, so the leader sees why.
        let refused: Arc<std::sync::Mutex<Option<tonic::Status>>> = Arc::default();
        let refuse = refused.clone();
        let input = futures::stream::unfold((Some(first), stream), move |(first, mut stream)| {
            let refuse = refuse.clone();
            async move {
                let m = match first {
                    Some(m) => m,
                    None => match stream.message().await {
                        Ok(Some(m)) => m,
                        Ok(None) => return None,
                        Err(e) => {
                            tracing::debug!(%e, "append stream from the leader ended");
                            return None;
                        }
                    },
                };
                if m.header != header || m.vote.as_ref().map(|v| v.node) != node {
                    let why = "an append stream's request carries another header or vote node than its first";
                    tracing::warn!("{why}; ending it");
                    *refuse.lock().expect("append stream refusal") =
                        Some(tonic::Status::invalid_argument(why));
                    return None;
                }
                tracing::trace!(
                    target: "holdfast::hop",
                    from = m.vote.as_ref().map_or(0, |v| v.node),
                    index = m.entries.last().and_then(|e| e.log_id.as_ref()).map_or(0, |l| l.index),
                    "append received"
                );
                match append_request_from_pb(&m) {
                    Ok(req) => Some((req, (None, stream))),
                    Err(e) => {
                        tracing::warn!(%e, "append stream: malformed request; ending it");
                        *refuse.lock().expect("append stream refusal") =
                            Some(tonic::Status::invalid_argument(format!(
                                "malformed append request: {e}"
                            )));
                        None
                    }
                }
            }
        });
        crate::raft_types::Runtime::scope(seed, async move {
            let replies = raft.stream_append(input);
            futures::pin_mut!(replies);
            while let Some(r) = replies.next().await {
                let reply = match r {
                    Ok(result) => Ok(append_reply_to_pb(result)),
                    Err(fatal) => Err(tonic::Status::unavailable(format!(
                        "this server's Raft stopped: {fatal}"
                    ))),
                };
                tracing::trace!(target: "holdfast::hop", "append answered");
                if tx.send(reply).await.is_err() {
                    break;
                }
            }
        })
        .await;
        let refusal = refused.lock().expect("append stream refusal").take();
        refusal.map_or(Ok(()), Err)
    }

    /// Checks a request's header and finds its group. Refusals name what did not match.
    /// `sender`: over TLS, the node id the sender's certificate names (`sender_id`); the header must
    /// claim the same one, so that one server's key cannot speak for another.
    /// `vote`: the Raft vote the message carries (a leader's or candidate's own); over TLS its node must
    /// be the sender too, or one server could send entries or votes in another's name.
    fn raft(
        &self,
        header: &Option<pb::PeerHeader>,
        sender: Option<Option<u64>>,
        vote: Option<&pb::Vote>,
    ) -> Result<&Raft, tonic::Status> {
        let h = header
            .as_ref()
            .ok_or_else(|| tonic::Status::invalid_argument("peer message without a header"))?;
        if let Some(cert) = sender {
            if cert != Some(h.from_node) {
                return Err(tonic::Status::permission_denied(format!(
                    "a message claiming to be from node {} came over a connection whose certificate is {}",
                    h.from_node,
                    cert.map_or("no server's".to_string(), |id| format!("node {id}'s"))
                )));
            }
            if let Some(v) = vote {
                if v.node != h.from_node {
                    return Err(tonic::Status::permission_denied(format!(
                        "node {} sent a message carrying node {}'s vote",
                        h.from_node, v.node
                    )));
                }
            }
        }
        if h.format != PEER_FORMAT {
            return Err(tonic::Status::failed_precondition(format!(
                "node {} speaks peer format {}, this server (node {}) format {PEER_FORMAT}: run one holdfast version",
                h.from_node, h.format, self.me.node_id
            )));
        }
        if h.cluster_id != self.me.cluster_id {
            return Err(tonic::Status::permission_denied(format!(
                "node {} belongs to cluster {:016x}, this server (node {}) to cluster {:016x}: refusing messages from another cluster",
                h.from_node, h.cluster_id, self.me.node_id, self.me.cluster_id
            )));
        }
        if h.to_node != self.me.node_id {
            return Err(tonic::Status::failed_precondition(format!(
                "message from node {} for node {} reached node {}: its address for node {} is wrong",
                h.from_node, h.to_node, self.me.node_id, h.to_node
            )));
        }
        self.lookup.raft(h.group).ok_or_else(|| {
            tonic::Status::not_found(format!("no raft group {} on this server", h.group))
        })
    }
}

/// None: not a TLS connection (plaintext cluster, or the simulation). Some(id): the node id the
/// verified server certificate names (None inside if it names none; the peer port admits no such
/// connection, so that is a bug's tell).
fn sender_id<T>(r: &tonic::Request<T>) -> Option<Option<u64>> {
    r.extensions()
        .get::<holdfast_proto::tls::TlsConnectInfo>()
        .map(tls_sender)
}

/// What [`sender_id`] says of a TLS connection with `info`.
pub fn tls_sender(info: &holdfast_proto::tls::TlsConnectInfo) -> Option<u64> {
    info.cert.as_deref().and_then(crate::tls::server_id)
}

fn bad(e: String) -> tonic::Status {
    tonic::Status::invalid_argument(format!("malformed peer message: {e}"))
}

fn raft_error(e: impl std::fmt::Display) -> tonic::Status {
    tonic::Status::internal(format!("raft: {e}"))
}

fn vote_request_from_pb(r: &pb::VoteRequest) -> Result<VoteRequest<TypeConfig>, tonic::Status> {
    let mut req = VoteRequest::new(
        formats::vote_from_pb(required(&r.vote, "vote").map_err(bad)?),
        formats::opt_log_id_from_pb(&r.last_log_id),
    );
    req.leadership_transfer = r.leadership_transfer;
    Ok(req)
}

fn vote_reply_to_pb(r: VoteResponse<TypeConfig>) -> tonic::Response<pb::VoteReply> {
    tonic::Response::new(pb::VoteReply {
        vote: Some(formats::vote_to_pb(&r.vote)),
        granted: r.vote_granted,
        last_log_id: formats::opt_log_id_to_pb(&r.last_log_id),
    })
}

impl<L: RaftLookup> PeerService<L> {
    /// The lookup of groups this service answers for.
    pub fn lookup(&self) -> &L {
        &self.lookup
    }

    /// One AppendEntries, from gRPC or [`crate::raw_append`]: `sender` as [`PeerService::raft`] takes it.
    pub(crate) async fn append_entries_pb(
        &self,
        m: pb::AppendEntriesRequest,
        sender: Option<Option<u64>>,
    ) -> Result<pb::AppendEntriesReply, tonic::Status> {
        let raft = self.raft(&m.header, sender, m.vote.as_ref())?;
        let req = append_request_from_pb(&m).map_err(bad)?;
        use pb::append_entries_reply::Result as R;
        let result = match raft.append_entries(req).await.map_err(raft_error)? {
            AppendEntriesResponse::Success => R::Success(pb::Blank {}),
            AppendEntriesResponse::PartialSuccess(l) => R::PartialSuccess(pb::PartialSuccess {
                matching: formats::opt_log_id_to_pb(&l),
            }),
            AppendEntriesResponse::Conflict => R::Conflict(pb::Blank {}),
            AppendEntriesResponse::HigherVote(v) => R::HigherVote(formats::vote_to_pb(&v)),
        };
        Ok(pb::AppendEntriesReply {
            result: Some(result),
            features: self.lookup.features(),
        })
    }
}

#[tonic::async_trait]
impl<L: RaftLookup> Peer for PeerService<L> {
    async fn append_entries(
        &self,
        r: tonic::Request<pb::AppendEntriesRequest>,
    ) -> Result<tonic::Response<pb::AppendEntriesReply>, tonic::Status> {
        let sender = sender_id(&r);
        self.append_entries_pb(r.into_inner(), sender)
            .await
            .map(tonic::Response::new)
    }

    type AppendStreamStream = std::pin::Pin<
        Box<dyn futures::Stream<Item = Result<pb::AppendStreamReply, tonic::Status>> + Send>,
    >;

    async fn append_stream(
        &self,
        r: tonic::Request<tonic::Streaming<pb::AppendEntriesRequest>>,
    ) -> Result<tonic::Response<Self::AppendStreamStream>, tonic::Status> {
        if !self.lookup.serves_append_streams() {
            return Err(tonic::Status::unimplemented(
                "AppendStream is not served (--compat-no-append-stream)",
            ));
        }
        let sender = sender_id(&r);
        let stream = r.into_inner();
        // Answered at once (the leader waits for the response headers, while its first request may
        // wait for an entry to send); a task reads the requests, checks them and drives openraft's
        // stream, whose replies it hands over through a channel (that stream borrows its `Raft`
        // handle by type, so it cannot be returned from here). It ends when either side does.
        let (tx, rx) = tokio::sync::mpsc::channel(PIPELINE_REPLIES);
        let service = PeerService {
            lookup: self.lookup.clone(),
            me: self.me,
            receiving: self.receiving.clone(),
        };
        tokio::spawn(async move {
            if let Err(status) = service.serve_append_stream(stream, sender, &tx).await {
                let _ = tx.send(Err(status)).await;
            }
        });
        let replies = tokio_stream::wrappers::ReceiverStream::new(rx);
        Ok(tonic::Response::new(Box::pin(replies)))
    }

    async fn vote(
        &self,
        r: tonic::Request<pb::VoteRequest>,
    ) -> Result<tonic::Response<pb::VoteReply>, tonic::Status> {
        let sender = sender_id(&r);
        let m = r.into_inner();
        let raft = self.raft(&m.header, sender, m.vote.as_ref())?;
        let req = vote_request_from_pb(&m)?;
        Ok(vote_reply_to_pb(raft.vote(req).await.map_err(raft_error)?))
    }

    async fn pre_vote(
        &self,
        r: tonic::Request<pb::VoteRequest>,
    ) -> Result<tonic::Response<pb::VoteReply>, tonic::Status> {
        let sender = sender_id(&r);
        let m = r.into_inner();
        let raft = self.raft(&m.header, sender, m.vote.as_ref())?;
        let req = vote_request_from_pb(&m)?;
        Ok(vote_reply_to_pb(
            raft.pre_vote(req).await.map_err(raft_error)?,
        ))
    }

    async fn transfer_leader(
        &self,
        r: tonic::Request<pb::PeerTransferLeaderRequest>,
    ) -> Result<tonic::Response<pb::PeerTransferLeaderReply>, tonic::Status> {
        let sender = sender_id(&r);
        let m = r.into_inner();
        let raft = self.raft(&m.header, sender, m.from_leader.as_ref())?;
        let req = TransferLeaderRequest::new(
            formats::vote_from_pb(required(&m.from_leader, "from_leader").map_err(bad)?),
            m.to_node,
            formats::opt_log_id_from_pb(&m.last_log_id),
        );
        use openraft::raft::TransferLeaderError as E;
        use pb::peer_transfer_leader_reply::Result as R;
        let result = match raft.handle_transfer_leader(req).await.map_err(raft_error)? {
            Ok(()) => R::Accepted(pb::Blank {}),
            Err(E::VoteChanged { expected, actual }) => R::VoteChanged(pb::VoteChanged {
                expected: Some(formats::vote_to_pb(&expected)),
                actual: Some(formats::vote_to_pb(&actual)),
            }),
            Err(E::LogNotFlushed { expected, actual }) => R::LogNotFlushed(pb::LogNotFlushed {
                expected: formats::opt_log_id_to_pb(&expected),
                actual: formats::opt_log_id_to_pb(&actual),
            }),
        };
        Ok(tonic::Response::new(pb::PeerTransferLeaderReply {
            result: Some(result),
        }))
    }

    async fn install_snapshot(
        &self,
        r: tonic::Request<tonic::Streaming<pb::SnapshotChunk>>,
    ) -> Result<tonic::Response<pb::SnapshotReply>, tonic::Status> {
        let sender = sender_id(&r);
        let mut stream = r.into_inner();
        let first = stream
            .message()
            .await?
            .ok_or_else(|| tonic::Status::invalid_argument("empty snapshot stream"))?;
        let raft = self.raft(&first.header, sender, first.vote.as_ref())?;
        let vote = formats::vote_from_pb(required(&first.vote, "vote").map_err(bad)?);
        let meta =
            formats::snapshot_meta_from_pb(required(&first.meta, "snapshot meta").map_err(bad)?)
                .map_err(bad)?;
        // Held until the snapshot is installed (or refused): its bytes and its decoded table are
        // in memory until then.
        let _receiving = self.receiving.clone().try_acquire_owned().map_err(|_| {
            tonic::Status::unavailable(format!(
                "{MAX_SNAPSHOT_RECEIVES} snapshots are being received already \
                 (max_snapshot_receives); send this one again later"
            ))
        })?;
        let mut data = Vec::new();
        let mut next = Some(first.data);
        while let Some(piece) = match next.take() {
            Some(first) => Some(first),
            None => stream.message().await?.map(|c| c.data),
        } {
            if data.len() + piece.len() > MAX_SNAPSHOT_BYTES {
                return Err(tonic::Status::resource_exhausted(format!(
                    "snapshot over the limit of {MAX_SNAPSHOT_BYTES} bytes (max_snapshot_bytes)"
                )));
            }
            data.extend_from_slice(&piece);
        }
        // Check the bytes before handing them to openraft, which treats a bad snapshot as fatal, and
        // keep what they decode to: installing it does not decode again. Off the runtime: at a
        // million locks a decode takes about half a second.
        let (data, loaded) = crate::blocking(move || {
            let loaded = crate::snapshot_store::SnapshotStore::decode(&data);
            Ok((data, loaded))
        })
        .await
        .map_err(|e| tonic::Status::internal(e.to_string()))?;
        let loaded = loaded.map_err(|e| {
            tonic::Status::invalid_argument(format!("snapshot from the leader is unusable: {e}"))
        })?;
        if loaded.meta != meta {
            return Err(tonic::Status::invalid_argument(
                "snapshot from the leader is unusable: its file is of another log index than its header says",
            ));
        }
        let snapshot = Snapshot {
            meta,
            snapshot: SnapshotData::Received {
                bytes: data,
                table: Box::new(loaded.table),
            },
        };
        let reply = raft
            .install_full_snapshot(vote, snapshot)
            .await
            .map_err(raft_error)?;
        Ok(tonic::Response::new(pb::SnapshotReply {
            vote: Some(formats::vote_to_pb(&reply.vote)),
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::PeerFeatures;
    use crate::formats::FEATURE_EXPIRE_SESSIONS as F;

    /// A frame for a connection of its own is its length and the message the gRPC calls send, whether
    /// its entries are copied from the log or encoded on the spot; a heartbeat asks the log for nothing.
    #[test]
    fn an_append_frame_is_the_grpc_message_with_its_entries_from_the_log_or_encoded() {
        use super::{append_frame, append_request_to_pb};
        use crate::formats;
        use crate::raft_types::{Entry, LogId, Request};
        use holdfast_lock_table::{Command, LockName, RequestId, SessionId};
        use holdfast_proto::v1 as pb;
        use openraft::impls::leader_id_adv::LeaderId;
        use prost::Message;
        let log_id = |term, index| LogId::new(LeaderId { term, node_id: 2 }, index);
        let entries = vec![
            Entry {
                log_id: log_id(3, 41),
                payload: openraft::EntryPayload::Blank,
            },
            Entry {
                log_id: log_id(3, 42),
                payload: openraft::EntryPayload::Normal(Request::new(Command::Release {
                    session: SessionId(7),
                    request: RequestId(9),
                    name: LockName::new("frames/a").unwrap(),
                    token: holdfast_lock_table::FencingToken(12),
                    now_ms: 5,
                })),
            },
        ];
        let header = pb::PeerHeader {
            format: 1,
            cluster_id: 77,
            from_node: 2,
            to_node: 4,
            group: 1,
        };
        let rpc = |entries: Vec<Entry>| openraft::raft::AppendEntriesRequest {
            vote: openraft::Vote::new_committed(3, 2),
            prev_log_id: Some(log_id(2, 40)),
            leader_commit: Some(log_id(2, 39)),
            entries,
        };
        let body = |frame: &[u8]| {
            let len = u32::from_le_bytes(frame[..4].try_into().unwrap()) as usize;
            assert_eq!(len, frame.len() - 4, "the length prefix");
            pb::AppendEntriesRequest::decode(&frame[4..]).unwrap()
        };
        let full = rpc(entries.clone());
        let want = append_request_to_pb(header, &full);
        // Encoded on the spot: the log did not have them.
        let frame = append_frame(header, &full, |_, _, _| false).ok().unwrap();
        assert_eq!(body(&frame), want);
        // Copied from the log, as it encoded them.
        let frame = append_frame(header, &full, |asked, field, out| {
            assert_eq!(asked, &entries[..]);
            for e in asked {
                prost::encoding::message::encode(field, &formats::entry_to_pb(e), out);
            }
            true
        })
        .ok()
        .unwrap();
        assert_eq!(body(&frame), want);
        // A heartbeat.
        let empty = rpc(Vec::new());
        let frame = append_frame(header, &empty, |_, _, _| {
            panic!("a heartbeat has no entries")
        })
        .ok()
        .unwrap();
        assert_eq!(body(&frame), append_request_to_pb(header, &empty));
    }

    /// A request with no entries, only a commit index, waits up to `COMMIT_ONLY_HOLD` for the next
    /// request of its session, which replaces it; one with entries, or a session's last, goes at once.
    #[tokio::test(start_paused = true)]
    async fn a_request_with_only_a_commit_waits_a_moment_for_the_next_which_replaces_it() {
        use super::{fold_commit_only, COMMIT_ONLY_HOLD};
        use crate::raft_types::{Entry, LogId};
        use futures::StreamExt;
        use openraft::impls::leader_id_adv::LeaderId;
        use tokio::time::{Duration, Instant};
        let log_id = |index| {
            Some(LogId::new(
                LeaderId {
                    term: 3,
                    node_id: 2,
                },
                index,
            ))
        };
        let rpc = move |prev, commit, entries: &[u64]| openraft::raft::AppendEntriesRequest {
            vote: openraft::Vote::new_committed(3, 2),
            prev_log_id: log_id(prev),
            leader_commit: log_id(commit),
            entries: entries
                .iter()
                .map(|&i| Entry {
                    log_id: log_id(i).unwrap(),
                    payload: openraft::EntryPayload::Blank,
                })
                .collect::<Vec<_>>(),
        };
        let indexes = |r: &openraft::raft::AppendEntriesRequest<crate::raft_types::TypeConfig>| {
            let last = r.entries.last().map(|e| e.log_id.index);
            (r.leader_commit.unwrap().index, last)
        };
        // Requests a session yields: a channel, so a test can leave the next one pending.
        let session = |reqs: Vec<_>, end: bool| {
            let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
            for r in reqs {
                tx.send(r).unwrap();
            }
            let keep = (!end).then_some(tx);
            (
                keep,
                tokio_stream::wrappers::UnboundedReceiverStream::new(rx).fuse(),
            )
        };

        // With entries: sent as it is, the next one left where it is.
        let (_tx, mut input) = session(vec![rpc(11, 9, &[12])], false);
        let t = Instant::now();
        let got = fold_commit_only(rpc(10, 9, &[11]), &mut input).await;
        assert_eq!(
            (indexes(&got), t.elapsed()),
            ((9, Some(11)), Duration::ZERO)
        );
        assert_eq!(indexes(&input.next().await.unwrap()), (9, Some(12)));

        // Only a commit, and the next request (with entries) already there: the next goes instead,
        // at once, carrying the newer commit.
        let (_tx, mut input) = session(vec![rpc(10, 11, &[]), rpc(10, 11, &[11])], false);
        let got = fold_commit_only(rpc(10, 10, &[]), &mut input).await;
        assert_eq!(
            (indexes(&got), t.elapsed()),
            ((11, Some(11)), Duration::ZERO)
        );

        // Only a commit, and nothing more within the hold: the latest commit-only request is sent
        // when the hold ends.
        let (tx, mut input) = session(vec![rpc(10, 10, &[])], false);
        let t = Instant::now();
        let got = fold_commit_only(rpc(10, 9, &[]), &mut input).await;
        assert_eq!((indexes(&got), t.elapsed()), ((10, None), COMMIT_ONLY_HOLD));
        // A request that comes during the hold ends it, whenever it comes.
        let t = Instant::now();
        let late = tokio::spawn(async move {
            tokio::time::sleep(COMMIT_ONLY_HOLD / 2).await;
            tx.unwrap().send(rpc(10, 10, &[11])).unwrap();
        });
        let got = fold_commit_only(rpc(10, 10, &[]), &mut input).await;
        assert_eq!(
            (indexes(&got), t.elapsed()),
            ((10, Some(11)), COMMIT_ONLY_HOLD / 2)
        );
        late.await.unwrap();

        // The session ends during the hold: the held request goes then.
        let (tx, mut input) = session(vec![], false);
        let t = Instant::now();
        let end = tokio::spawn(async move {
            tokio::time::sleep(COMMIT_ONLY_HOLD / 2).await;
            drop(tx);
        });
        let got = fold_commit_only(rpc(10, 10, &[]), &mut input).await;
        assert_eq!(
            (indexes(&got), t.elapsed()),
            ((10, None), COMMIT_ONLY_HOLD / 2)
        );
        end.await.unwrap();
        assert!(input.next().await.is_none(), "ended, and fused");

        // The session's last request (a heartbeat is a session of one): sent at once.
        let (_, mut input) = session(vec![], true);
        let t = Instant::now();
        let got = fold_commit_only(rpc(10, 10, &[]), &mut input).await;
        assert_eq!((indexes(&got), t.elapsed()), ((10, None), Duration::ZERO));
        let mut once = Box::pin(futures::stream::once(async { rpc(10, 10, &[]) })).fuse();
        let first = once.next().await.unwrap();
        let got = fold_commit_only(first, &mut once).await;
        assert_eq!((indexes(&got), t.elapsed()), ((10, None), Duration::ZERO));
    }

    /// A feature counts only for peers whose latest reply said so: not for one never heard from, one
    /// that said 0 (an older release), or one whose last call failed (it may come back as another).
    #[test]
    fn a_feature_counts_only_while_every_peer_last_said_so() {
        let f = PeerFeatures::default();
        assert!(f.all_have([], F), "no other member");
        assert!(!f.all_have([2, 3], F), "never heard from");
        f.record(2, F);
        f.record(3, 0);
        assert!(!f.all_have([2, 3], F));
        f.record(3, F | 2);
        assert!(f.all_have([2, 3], F));
        f.forget(3);
        assert!(!f.all_have([2, 3], F));
        assert!(f.all_have([2], F));
    }

    /// A follower's acknowledgement is late once as many other voters have acknowledged that index as
    /// a commit needs beside the leader, unless it is catching up; never a learner's, nor while the
    /// membership is joint or unknown; a target counts while a network client for it lives.
    #[test]
    fn an_acknowledgement_after_a_commit_quorum_is_late() {
        use super::{Acks, LATE_MAX_LAG};
        use std::collections::{BTreeMap, BTreeSet};
        let membership = |configs: Vec<Vec<u64>>, learners: Vec<u64>| {
            let nodes: BTreeMap<u64, crate::raft_types::MemberNode> = configs
                .iter()
                .flatten()
                .chain(&learners)
                .map(|&n| (n, Default::default()))
                .collect();
            let configs: Vec<BTreeSet<u64>> = configs
                .into_iter()
                .map(|c| c.into_iter().collect())
                .collect();
            openraft::Membership::new(configs, nodes).unwrap()
        };
        const B: u64 = 100_000;
        let acks = std::sync::Arc::new(Acks::default());
        let f: Vec<_> = (2..=5).map(|t| acks.joined(t)).collect();
        let late = |i: usize, index: u64| f[i].acknowledged(index, true);
        // No membership known yet: nothing is late.
        assert_eq!([late(0, B), late(1, B), late(2, B), late(3, B)], [false; 4]);
        // Four followers (five voters): a commit needs two of them.
        acks.set_membership(1, &membership(vec![vec![1, 2, 3, 4, 5]], vec![]));
        let first = [
            late(0, B + 10),
            late(1, B + 10),
            late(2, B + 10),
            late(3, B + 10),
        ];
        assert_eq!(first, [false, false, true, true]);
        // A late one that gets ahead is not late; the one that then comes third is.
        let next = [late(3, B + 11), late(2, B + 11), late(1, B + 11)];
        assert_eq!(next, [false, false, true]);
        // Two stopped acknowledging (stalled or gone, their clients still live): both others are
        // needed by every commit, so neither is ever late.
        assert_eq!([late(0, B + 20), late(1, B + 20)], [false, false]);
        assert_eq!([late(1, B + 21), late(0, B + 21)], [false, false]);
        // One `LATE_MAX_LAG` behind the one furthest ahead is catching up, not late; one closer is.
        assert!(!late(2, B + 21 - LATE_MAX_LAG));
        assert!(late(2, B + 22 - LATE_MAX_LAG));
        // Three voters and two learners (4 and 5): a learner is never late, and a learner ahead does
        // not make the one voter a commit needs late.
        acks.set_membership(1, &membership(vec![vec![1, 2, 3]], vec![4, 5]));
        let with_learners = [
            late(2, B + 30),
            late(3, B + 30),
            late(0, B + 30),
            late(1, B + 30),
        ];
        assert_eq!(with_learners, [false, false, false, true]);
        // A joint membership (two majorities): nothing is late.
        acks.set_membership(
            1,
            &membership(vec![vec![1, 2, 3], vec![1, 2, 3, 4, 5]], vec![]),
        );
        assert_eq!(
            [late(0, B + 40), late(1, B + 40), late(2, B + 40)],
            [false; 3]
        );
        // A leader outside its newest configuration (removing itself): a commit needs a majority of
        // the others, two of three.
        acks.set_membership(1, &membership(vec![vec![2, 3, 4]], vec![]));
        assert_eq!(
            [late(0, B + 50), late(1, B + 50), late(2, B + 50)],
            [false, false, true]
        );

        // A second client for a target (openraft's heartbeats, say) does not count it twice, and it
        // counts until its last client goes.
        let again = acks.joined(5);
        assert_eq!(acks.table.lock().unwrap().targets.len(), 4);
        drop(f);
        assert_eq!(acks.table.lock().unwrap().targets.len(), 1);
        drop(again);
        assert!(acks.table.lock().unwrap().targets.is_empty());

        // Two followers (three voters): the second to acknowledge is late.
        acks.set_membership(1, &membership(vec![vec![1, 2, 3]], vec![]));
        let f: Vec<_> = (2..=3).map(|t| acks.joined(t)).collect();
        let late = |i: usize, index: u64, small: bool| f[i].acknowledged(index, small);
        assert_eq!([late(1, 5, true), late(0, 5, true)], [false, true]);
        // A reply to a large append is never late, but it is recorded: it can make another late.
        assert_eq!([late(0, 9, false), late(1, 9, true)], [false, true]);
    }
}
