//! Raft traffic between servers over gRPC: the client side ([`PeerNetwork`], openraft's network) and the
//! server side ([`PeerService`]).
//!
//! Each message is an openraft request encoded with postcard inside a `RaftMessage { group, payload }`; the
//! reply is a postcard `Result<response, String>`. Snapshots stream in 1 MiB chunks. Every call has a
//! timeout taken from openraft's `RPCOption`, so a partitioned peer costs a bounded wait.

use crate::raft_types::{NodeId, Raft, Snapshot, SnapshotData, SnapshotMeta, TypeConfig, Vote};
use holdfast_proto::v1::raft_peer_client::RaftPeerClient;
use holdfast_proto::v1::raft_peer_server::RaftPeer;
use holdfast_proto::v1::{RaftMessage, SnapshotChunk};
use openraft::errors::{NetworkError, RPCError, ReplicationClosed, StreamingError, Unreachable};
use openraft::network::{RPCOption, RaftNetworkFactory, RaftNetworkV2};
use openraft::raft::{
    AppendEntriesRequest, AppendEntriesResponse, SnapshotResponse, TransferLeaderRequest,
    TransferLeaderResponse, VoteRequest, VoteResponse,
};
use openraft::BasicNode;
use serde::de::DeserializeOwned;
use serde::Serialize;
use std::collections::HashMap;
use std::future::Future;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tonic::transport::{Channel, Endpoint};

/// Snapshot bytes per streamed chunk.
const SNAPSHOT_CHUNK_BYTES: usize = 1 << 20;
/// Largest snapshot a server accepts from a peer: ~20× the design's 100 MB table.
pub const MAX_SNAPSHOT_BYTES: usize = 2 << 30;
/// Largest single peer message (an AppendEntries batch).
pub const MAX_PEER_MESSAGE_BYTES: usize = 64 << 20;

fn encode<T: Serialize>(v: &T) -> Vec<u8> {
    postcard::to_allocvec(v).expect("encoding to a Vec cannot fail")
}

fn decode<T: DeserializeOwned>(b: &[u8]) -> Result<T, String> {
    postcard::from_bytes(b).map_err(|e| format!("bad peer message: {e}"))
}

/// Connections to the other servers, one lazily connected channel per peer, shared by all groups.
#[derive(Clone, Default)]
pub struct Peers {
    channels: Arc<Mutex<HashMap<NodeId, Channel>>>,
    health: Arc<Mutex<HashMap<NodeId, Health>>>,
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

    fn channel(&self, target: NodeId, addr: &str) -> Result<Channel, String> {
        let mut channels = self.channels.lock().expect("peer channel lock");
        if let Some(c) = channels.get(&target) {
            return Ok(c.clone());
        }
        let channel = Endpoint::from_shared(format!("http://{addr}"))
            .map_err(|e| format!("bad peer address {addr}: {e}"))?
            .connect_timeout(holdfast_proto::transport::CONNECT_TIMEOUT)
            .tcp_nodelay(true)
            // A connection that stops answering pings (a half-open socket, a stalled simulated stream)
            // is closed, and the next RPC reconnects instead of timing out on it forever.
            .http2_keep_alive_interval(Duration::from_secs(1))
            // Not too tight: a late ping answer closes the connection and fails every RPC on it.
            .keep_alive_timeout(Duration::from_secs(3))
            .keep_alive_while_idle(true);
        let channel = holdfast_proto::transport::connect_lazy(channel);
        channels.insert(target, channel.clone());
        Ok(channel)
    }
}

/// openraft's network factory for one group.
pub struct PeerNetwork {
    pub group: u32,
    pub peers: Peers,
}

impl RaftNetworkFactory<TypeConfig> for PeerNetwork {
    type Network = PeerClient;

    async fn new_client(&mut self, target: NodeId, node: &BasicNode) -> PeerClient {
        PeerClient {
            group: self.group,
            target,
            channel: self.peers.channel(target, &node.addr),
            peers: self.peers.clone(),
        }
    }
}

pub struct PeerClient {
    group: u32,
    target: NodeId,
    channel: Result<Channel, String>,
    peers: Peers,
}

impl PeerClient {
    fn client(&self) -> Result<RaftPeerClient<Channel>, RPCError<TypeConfig>> {
        match &self.channel {
            Ok(c) => Ok(RaftPeerClient::new(c.clone())
                .max_decoding_message_size(MAX_PEER_MESSAGE_BYTES)
                .max_encoding_message_size(MAX_PEER_MESSAGE_BYTES)),
            Err(e) => Err(RPCError::Unreachable(Unreachable::from_string(e))),
        }
    }

    async fn call<Req, Resp, F, Fut>(
        &self,
        req: &Req,
        timeout: Duration,
        f: F,
    ) -> Result<Resp, RPCError<TypeConfig>>
    where
        Req: Serialize,
        Resp: DeserializeOwned,
        F: FnOnce(RaftPeerClient<Channel>, RaftMessage) -> Fut,
        Fut: Future<Output = Result<tonic::Response<RaftMessage>, tonic::Status>>,
    {
        let result = self.call_once(req, timeout, f).await;
        let outcome = match &result {
            // An answer, even a refusal, means the peer is reachable.
            Ok(_) | Err(RPCError::RemoteError(_)) => Ok(()),
            Err(e) => Err(e.to_string()),
        };
        self.peers.report(
            self.target,
            outcome.as_ref().map(|_| ()).map_err(String::as_str),
        );
        result
    }

    async fn call_once<Req, Resp, F, Fut>(
        &self,
        req: &Req,
        timeout: Duration,
        f: F,
    ) -> Result<Resp, RPCError<TypeConfig>>
    where
        Req: Serialize,
        Resp: DeserializeOwned,
        F: FnOnce(RaftPeerClient<Channel>, RaftMessage) -> Fut,
        Fut: Future<Output = Result<tonic::Response<RaftMessage>, tonic::Status>>,
    {
        let client = self.client()?;
        let msg = RaftMessage {
            group: self.group,
            payload: encode(req),
        };
        let reply = match tokio::time::timeout(timeout, f(client, msg)).await {
            Err(_) => {
                return Err(RPCError::Network(NetworkError::from_string(format!(
                    "no reply from node {} within {timeout:?}",
                    self.target
                ))))
            }
            Ok(Err(status)) => return Err(status_error(self.target, status)),
            Ok(Ok(reply)) => reply.into_inner(),
        };
        let result: Result<Resp, String> =
            decode(&reply.payload).map_err(|e| RPCError::Network(NetworkError::from_string(e)))?;
        result.map_err(|e| {
            RPCError::Network(NetworkError::from_string(format!(
                "node {}: {e}",
                self.target
            )))
        })
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

impl RaftNetworkV2<TypeConfig> for PeerClient {
    type SnapshotData = SnapshotData;

    async fn append_entries(
        &mut self,
        rpc: AppendEntriesRequest<TypeConfig>,
        option: RPCOption,
    ) -> Result<AppendEntriesResponse<TypeConfig>, RPCError<TypeConfig>> {
        self.call(&rpc, option.soft_ttl(), |mut c, m| async move {
            c.append_entries(m).await
        })
        .await
    }

    async fn vote(
        &mut self,
        rpc: VoteRequest<TypeConfig>,
        option: RPCOption,
    ) -> Result<VoteResponse<TypeConfig>, RPCError<TypeConfig>> {
        self.call(&rpc, option.soft_ttl(), |mut c, m| async move {
            c.vote(m).await
        })
        .await
    }

    async fn pre_vote(
        &mut self,
        rpc: VoteRequest<TypeConfig>,
        option: RPCOption,
    ) -> Result<VoteResponse<TypeConfig>, RPCError<TypeConfig>> {
        self.call(&rpc, option.soft_ttl(), |mut c, m| async move {
            c.pre_vote(m).await
        })
        .await
    }

    async fn transfer_leader(
        &mut self,
        req: TransferLeaderRequest<TypeConfig>,
        option: RPCOption,
    ) -> Result<TransferLeaderResponse<TypeConfig>, RPCError<TypeConfig>> {
        self.call(&req, option.soft_ttl(), |mut c, m| async move {
            c.transfer_leader(m).await
        })
        .await
    }

    async fn full_snapshot(
        &mut self,
        vote: Vote,
        snapshot: Snapshot,
        cancel: impl Future<Output = ReplicationClosed> + openraft::OptionalSend + 'static,
        _option: RPCOption,
    ) -> Result<SnapshotResponse<TypeConfig>, StreamingError<TypeConfig>> {
        let mut client = self.client()?;
        let header = encode(&(vote, snapshot.meta.clone()));
        let data = snapshot.snapshot.into_inner();
        let group = self.group;
        let mut chunks = Vec::with_capacity(data.len() / SNAPSHOT_CHUNK_BYTES + 1);
        let mut first = true;
        for piece in data
            .chunks(SNAPSHOT_CHUNK_BYTES)
            .chain(data.is_empty().then_some(&[][..]))
        {
            let header = if first { header.clone() } else { Vec::new() };
            first = false;
            chunks.push(SnapshotChunk {
                group,
                header,
                data: piece.to_vec(),
            });
        }
        let send = client.install_snapshot(tokio_stream::iter(chunks));
        let reply = tokio::select! {
            closed = cancel => return Err(StreamingError::Closed(closed)),
            reply = send => reply,
        };
        let reply = reply
            .map_err(|s| StreamingError::from(status_error(self.target, s)))?
            .into_inner();
        let result: Result<SnapshotResponse<TypeConfig>, String> = decode(&reply.payload)
            .map_err(|e| StreamingError::Network(NetworkError::from_string(e)))?;
        result.map_err(|e| StreamingError::Network(NetworkError::from_string(e)))
    }
}

/// Resolves a group id to its Raft handle on this server.
pub trait RaftLookup: Send + Sync + 'static {
    fn raft(&self, group: u32) -> Option<&Raft>;
}

/// The server side of peer traffic.
pub struct PeerService<L> {
    pub lookup: Arc<L>,
}

impl<L: RaftLookup> PeerService<L> {
    fn raft(&self, group: u32) -> Result<&Raft, tonic::Status> {
        self.lookup.raft(group).ok_or_else(|| {
            tonic::Status::not_found(format!("no raft group {group} on this server"))
        })
    }
}

fn reply<T: Serialize, E: std::fmt::Display>(
    r: Result<T, E>,
) -> Result<tonic::Response<RaftMessage>, tonic::Status> {
    let r = r.map_err(|e| e.to_string());
    Ok(tonic::Response::new(RaftMessage {
        group: 0,
        payload: encode(&r),
    }))
}

fn request<T: DeserializeOwned>(m: &RaftMessage) -> Result<T, tonic::Status> {
    decode(&m.payload).map_err(tonic::Status::invalid_argument)
}

#[tonic::async_trait]
impl<L: RaftLookup> RaftPeer for PeerService<L> {
    async fn append_entries(
        &self,
        r: tonic::Request<RaftMessage>,
    ) -> Result<tonic::Response<RaftMessage>, tonic::Status> {
        let m = r.into_inner();
        let raft = self.raft(m.group)?;
        reply(raft.append_entries(request(&m)?).await)
    }

    async fn vote(
        &self,
        r: tonic::Request<RaftMessage>,
    ) -> Result<tonic::Response<RaftMessage>, tonic::Status> {
        let m = r.into_inner();
        reply(self.raft(m.group)?.vote(request(&m)?).await)
    }

    async fn pre_vote(
        &self,
        r: tonic::Request<RaftMessage>,
    ) -> Result<tonic::Response<RaftMessage>, tonic::Status> {
        let m = r.into_inner();
        reply(self.raft(m.group)?.pre_vote(request(&m)?).await)
    }

    async fn transfer_leader(
        &self,
        r: tonic::Request<RaftMessage>,
    ) -> Result<tonic::Response<RaftMessage>, tonic::Status> {
        let m = r.into_inner();
        let result = self
            .raft(m.group)?
            .handle_transfer_leader(request(&m)?)
            .await;
        match result {
            Ok(inner) => reply::<TransferLeaderResponse<TypeConfig>, String>(Ok(inner)),
            Err(fatal) => reply::<TransferLeaderResponse<TypeConfig>, _>(Err(fatal)),
        }
    }

    async fn install_snapshot(
        &self,
        r: tonic::Request<tonic::Streaming<SnapshotChunk>>,
    ) -> Result<tonic::Response<RaftMessage>, tonic::Status> {
        let mut stream = r.into_inner();
        let mut header: Option<(u32, Vote, SnapshotMeta)> = None;
        let mut data = Vec::new();
        while let Some(chunk) = stream.message().await? {
            if header.is_none() {
                let (vote, meta): (Vote, SnapshotMeta) =
                    decode(&chunk.header).map_err(tonic::Status::invalid_argument)?;
                header = Some((chunk.group, vote, meta));
            }
            if data.len() + chunk.data.len() > MAX_SNAPSHOT_BYTES {
                return Err(tonic::Status::resource_exhausted(format!(
                    "snapshot over the limit of {MAX_SNAPSHOT_BYTES} bytes (max_snapshot_bytes)"
                )));
            }
            data.extend_from_slice(&chunk.data);
        }
        let (group, vote, meta) =
            header.ok_or_else(|| tonic::Status::invalid_argument("empty snapshot stream"))?;
        // Check the bytes before handing them to openraft, which treats a bad snapshot as fatal.
        crate::snapshot_store::SnapshotStore::decode(&data).map_err(|e| {
            tonic::Status::invalid_argument(format!("snapshot from the leader is unusable: {e}"))
        })?;
        let snapshot = Snapshot {
            meta,
            snapshot: std::io::Cursor::new(data),
        };
        reply(
            self.raft(group)?
                .install_full_snapshot(vote, snapshot)
                .await,
        )
    }
}
