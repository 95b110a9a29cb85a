//! AppendEntries between servers over a framed byte stream of their own, beside gRPC on the peer port.
//!
//! Why: an AppendEntries over gRPC passes through hyper's tasks on both sides (the request body's pipe
//! task and the connection task on the leader, the connection task and the call's task on the
//! follower, and the same back), each a thread wake-up; at one client, replication was most of a
//! commit's ~450 µs of hand-offs (docs/performance.md, "Appends on a connection of their own"). Here
//! the leader's replication task writes the request to the socket itself and reads the reply itself,
//! and the follower's connection task calls Raft directly: one task per side.
//!
//! The protocol, on a connection to the peer port (over TLS when the cluster uses TLS, checked as for
//! gRPC: the follower knows the sender by its certificate):
//! - the connecting side sends [`PREFACE`] and the version ([`VERSION`], 4 bytes little-endian) once;
//! - then requests, one at a time: a 4-byte little-endian length (at most `MAX_PEER_MESSAGE_BYTES`) and a
//!   protobuf `AppendEntriesRequest`, the same message as the unary `Peer.AppendEntries` call's;
//! - each answered before the next is read: a 4-byte length, a status code byte (0: OK, else a gRPC
//!   code) and either a protobuf `AppendEntriesReply` or the refusal's message in UTF-8.
//!
//! A request that cannot be read (too long, malformed framing, a version this server does not know)
//! closes the connection; a request that is refused gets the refusal the unary call would return.
//!
//! The peer port tells these connections from gRPC ones by their first bytes
//! (`holdfast_proto::transport::divert`). A server that predates this protocol (or runs with
//! `--compat-no-raw-appends`) hands such a connection to its HTTP/2 server, which closes it: a leader
//! whose fresh connection closes before its first reply appends to that peer over gRPC (the
//! `AppendStream` call, or unary calls) for [`RAW_FALLBACK`], then tries again.

use crate::peer::{PeerService, RaftLookup, MAX_PEER_MESSAGE_BYTES};
use crate::raft_types::NodeId;
use holdfast_proto::transport::RawIo;
use holdfast_proto::v1 as pb;
use prost::Message;
use std::collections::BTreeMap;
use std::io;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

/// What a connection of this protocol starts with. Differs from HTTP/2's preface in its first byte.
pub const PREFACE: &[u8] = b"HFAPPEND";
/// The protocol's version, sent after the preface. A server closes a connection of a version it does
/// not know, which makes the leader fall back to gRPC.
pub const VERSION: u32 = 1;
/// How long an accepted connection may take to send its preface and version.
pub const PREFACE_TIMEOUT: Duration = Duration::from_secs(10);
/// A connection that sends no request for this long is closed by the follower (a leader that stepped
/// down keeps its idle connections; a leader's connections carry heartbeats many times a second).
pub const IDLE_TIMEOUT: Duration = Duration::from_secs(60);
/// How long a request's bytes may take to arrive once its length has.
pub const BODY_TIMEOUT: Duration = Duration::from_secs(30);
/// Idle connections a leader keeps per peer address (one carries appends, one heartbeats; more are
/// closed when given back).
pub const POOL_PER_PEER: usize = 4;
/// How long a peer that closed a fresh connection before answering gets its appends over gRPC.
pub const RAW_FALLBACK: Duration = Duration::from_secs(10);

/// Why a raw append did not get a reply.
pub enum RawError {
    /// No connection could be made: the peer is unreachable.
    Connect(io::Error),
    /// The peer closed a fresh connection, or answered in something else, before its first reply: it
    /// does not serve this protocol (or died just then). Send the request over gRPC.
    NotServed(io::Error),
    /// The connection failed after the peer had answered on it: a network error.
    Io(io::Error),
    /// The peer refused the request, as the unary call would have.
    Refused(tonic::Status),
}

/// Idle connections by peer and address.
type Idle = BTreeMap<(NodeId, String), Vec<Box<dyn RawIo>>>;

/// A leader's idle connections, by peer and address.
#[derive(Clone, Default)]
pub struct RawPool {
    idle: Arc<Mutex<Idle>>,
    /// Peers that did not serve this protocol, until when they get gRPC.
    not_served: Arc<Mutex<BTreeMap<NodeId, tokio::time::Instant>>>,
}

impl RawPool {
    /// Whether appends to `target` go over this protocol now.
    pub fn serves(&self, target: NodeId) -> bool {
        self.not_served
            .lock()
            .expect("raw pool lock")
            .get(&target)
            .is_none_or(|&until| tokio::time::Instant::now() >= until)
    }

    fn mark_not_served(&self, target: NodeId) {
        self.not_served
            .lock()
            .expect("raw pool lock")
            .insert(target, tokio::time::Instant::now() + RAW_FALLBACK);
    }

    /// Sends `req` to `target` at `addr` and reads its reply, on an idle connection or a new one. A
    /// reused connection that fails before its reply (the peer closed it while it was idle) is
    /// replaced by a new one once: an AppendEntries may be sent twice.
    pub async fn append(
        &self,
        target: NodeId,
        addr: &str,
        tls: Option<&holdfast_proto::tls::TlsConnector>,
        req: &pb::AppendEntriesRequest,
    ) -> Result<pb::AppendEntriesReply, RawError> {
        let mut frame = Vec::with_capacity(4 + req.encoded_len());
        frame.extend_from_slice(&(req.encoded_len() as u32).to_le_bytes());
        req.encode(&mut frame)
            .expect("encoding to a Vec cannot fail");
        let key = (target, addr.to_string());
        let pooled = self
            .idle
            .lock()
            .expect("raw pool lock")
            .get_mut(&key)
            .and_then(Vec::pop);
        if let Some(mut io) = pooled {
            if let Ok(reply) = exchange(&mut io, &frame).await {
                let reply = reply?;
                self.give_back(key, io);
                return Ok(reply);
            }
        }
        let mut io = holdfast_proto::transport::connect_raw(addr, tls)
            .await
            .map_err(RawError::Connect)?;
        let mut hello = PREFACE.to_vec();
        hello.extend_from_slice(&VERSION.to_le_bytes());
        if let Err(e) = io.write_all(&hello).await {
            return Err(RawError::Io(e));
        }
        match exchange(&mut io, &frame).await {
            Ok(reply) => {
                let reply = reply?;
                self.give_back(key, io);
                Ok(reply)
            }
            Err(e) => {
                tracing::info!(
                    error = %e,
                    "node {target} closed an append connection before answering (a release that predates them?); appending to it over gRPC for {RAW_FALLBACK:?}"
                );
                self.mark_not_served(target);
                Err(RawError::NotServed(e))
            }
        }
    }

    fn give_back(&self, key: (NodeId, String), io: Box<dyn RawIo>) {
        let mut idle = self.idle.lock().expect("raw pool lock");
        let conns = idle.entry(key).or_default();
        if conns.len() < POOL_PER_PEER {
            conns.push(io);
        }
    }
}

/// Writes one request frame and reads its reply. `Err`: the connection failed (or sent something
/// that is not a reply) before a reply was read; `Ok(Err)`: the peer refused the request.
async fn exchange(
    io: &mut Box<dyn RawIo>,
    frame: &[u8],
) -> io::Result<Result<pb::AppendEntriesReply, RawError>> {
    io.write_all(frame).await?;
    let reply = read_frame(io, None).await?;
    let (&code, body) = reply
        .split_first()
        .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidData, "an empty reply"))?;
    if code != 0 {
        let status = tonic::Status::new(
            tonic::Code::from(i32::from(code)),
            String::from_utf8_lossy(body).into_owned(),
        );
        return Ok(Err(RawError::Refused(status)));
    }
    let reply = pb::AppendEntriesReply::decode(body).map_err(|e| {
        io::Error::new(
            io::ErrorKind::InvalidData,
            format!("a malformed reply: {e}"),
        )
    })?;
    Ok(Ok(reply))
}

/// Reads one length-prefixed frame (at most `MAX_PEER_MESSAGE_BYTES` and a status byte). `idle`: the
/// longest wait for its first byte.
async fn read_frame<R: AsyncRead + Unpin>(
    io: &mut R,
    idle: Option<Duration>,
) -> io::Result<Vec<u8>> {
    let mut len = [0u8; 4];
    match idle {
        Some(t) => tokio::time::timeout(t, io.read_exact(&mut len))
            .await
            .map_err(|_| io::Error::new(io::ErrorKind::TimedOut, "idle"))??,
        None => io.read_exact(&mut len).await?,
    };
    let n = u32::from_le_bytes(len) as usize;
    if n > MAX_PEER_MESSAGE_BYTES + 1 {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!("a frame of {n} bytes (the limit is {MAX_PEER_MESSAGE_BYTES})"),
        ));
    }
    let mut buf = vec![0u8; n];
    tokio::time::timeout(BODY_TIMEOUT, io.read_exact(&mut buf))
        .await
        .map_err(|_| io::Error::new(io::ErrorKind::TimedOut, "a frame's bytes stopped coming"))??;
    Ok(buf)
}

/// Serves one connection whose [`PREFACE`] was read: its version, then its requests one at a time.
/// `sender`: as for a gRPC request (`peer::sender_id`), the node the connection's certificate names.
pub async fn serve<L: RaftLookup, IO: AsyncRead + AsyncWrite + Unpin>(
    service: &PeerService<L>,
    mut io: IO,
    sender: Option<Option<u64>>,
) {
    let mut version = [0u8; 4];
    match tokio::time::timeout(PREFACE_TIMEOUT, io.read_exact(&mut version)).await {
        Ok(Ok(_)) if u32::from_le_bytes(version) == VERSION => {}
        Ok(Ok(_)) => {
            tracing::info!(
                version = u32::from_le_bytes(version),
                "an append connection of a version this server does not know; closing it"
            );
            return;
        }
        _ => return,
    }
    loop {
        let request = match read_frame(&mut io, Some(IDLE_TIMEOUT)).await {
            Ok(r) => r,
            Err(e) => {
                if e.kind() == io::ErrorKind::InvalidData {
                    tracing::warn!(error = %e, "closing an append connection");
                }
                return;
            }
        };
        let reply = match pb::AppendEntriesRequest::decode(&request[..]) {
            Ok(m) => {
                tracing::trace!(
                    target: "holdfast::hop",
                    from = m.vote.as_ref().map_or(0, |v| v.node),
                    index = m.entries.last().and_then(|e| e.log_id.as_ref()).map_or(0, |l| l.index),
                    "append received"
                );
                service.append_entries_pb(m, sender).await
            }
            Err(e) => Err(tonic::Status::invalid_argument(format!(
                "malformed peer message: {e}"
            ))),
        };
        let mut out = vec![0u8; 5];
        match reply {
            Ok(r) => r.encode(&mut out).expect("encoding to a Vec cannot fail"),
            Err(status) => {
                out[4] = status.code() as u8;
                out.extend_from_slice(status.message().as_bytes());
            }
        }
        let n = (out.len() - 4) as u32;
        out[..4].copy_from_slice(&n.to_le_bytes());
        if io.write_all(&out).await.is_err() {
            return;
        }
        tracing::trace!(target: "holdfast::hop", "append answered");
    }
}
