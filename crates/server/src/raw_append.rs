//! AppendEntries between servers over a framed byte stream of their own, beside gRPC on the peer port.
//!
//! Why: an AppendEntries over gRPC passes through hyper's tasks on both sides (the request body's pipe
//! task and the connection task on the leader, the connection task and the call's task on the
//! follower, and the same back), each a thread wake-up; at one client, replication was most of a
//! commit's ~450 µs of hand-offs (docs/performance.md, "Appends on connections of their own"). Here
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
//! `--compat-no-raw-appends`) hands such a connection to its HTTP/2 server, which answers with its
//! own preface (a SETTINGS frame) and closes it: a leader whose fresh connection gets bytes that are
//! not a reply appends to that peer over gRPC (the `AppendStream` call, or unary calls) for
//! [`RAW_FALLBACK`], then tries again. A connection that just closes or fails is a network error, as
//! a broken gRPC connection is.
//!
//! A leader's connections to a follower are checked as its gRPC channel is: over TLS the answering
//! certificate must be that follower's (`holdfast-server-<id>`).

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
/// How long an accepted connection may take to send its version once its preface is read.
pub const PREFACE_TIMEOUT: Duration = Duration::from_secs(10);
/// A connection that sends no request for this long is closed by the follower (a leader that stepped
/// down keeps its idle connections; a leader's connections carry heartbeats many times a second).
pub const IDLE_TIMEOUT: Duration = Duration::from_secs(60);
/// How long a request's bytes may take to arrive once its length has.
pub const BODY_TIMEOUT: Duration = Duration::from_secs(30);
/// The largest reply a leader reads (a reply is a few bytes, a refusal's message a few hundred).
const MAX_REPLY_BYTES: usize = 1 << 20;
/// Connections a leader keeps open per peer, address and group: in use, idle, connecting, or
/// finishing the read of a reply its caller stopped waiting for. One carries the group's appends,
/// one its heartbeats; the rest cover replies still owed. With all taken, a call fails at once
/// (openraft retries it) instead of opening more: a follower that stopped answering (a stalled
/// process) costs at most this many connections, not one per heartbeat.
pub const CONNECTIONS_PER_PEER: usize = 4;
/// How long a reply that its caller stopped waiting for is still read, so that its connection can
/// be used again (a heartbeat gives up after 37.5 ms; the follower answers it later).
pub const DRAIN_TIMEOUT: Duration = Duration::from_secs(10);
/// How long a peer that answered a fresh connection with bytes that are not a reply (an older
/// server's HTTP/2 preface) gets its appends over gRPC before this protocol is tried again.
pub const RAW_FALLBACK: Duration = Duration::from_secs(10);

/// Why a raw append did not get a reply.
pub enum RawError {
    /// No connection could be made: the peer is unreachable (refused, reset, no route).
    Connect(io::Error),
    /// No connection in time: all [`CONNECTIONS_PER_PEER`] are taken, or opening one outlasted the
    /// deadline. A slow peer, not an unreachable one.
    Busy(io::Error),
    /// The peer answered a fresh connection with something that is not a reply: it does not serve
    /// this protocol. Send the request over gRPC.
    NotServed(io::Error),
    /// The connection failed before the reply.
    Io(io::Error),
    /// No reply by the deadline (its connection goes on reading it, see [`DRAIN_TIMEOUT`]).
    TimedOut,
    /// The peer refused the request, as the unary call would have.
    Refused(tonic::Status),
}

/// Fresh connections in a row that a peer may close (or reset) before its first reply before it
/// counts as not serving this protocol. An older server's HTTP/2 side answers with its preface and
/// closes, but when the close comes first the preface is lost with the connection; a server that
/// crashed or is stopping closes a connection too, and does not do it three times in a row for long.
pub const FRESH_FAILURES: u32 = 3;

/// A leader's connections to one peer for one group: (peer, address, group).
type Key = (NodeId, String, u32);

#[derive(Default)]
struct Conns {
    idle: Vec<Box<dyn RawIo>>,
    /// Connections alive (idle or not), at most [`CONNECTIONS_PER_PEER`].
    open: usize,
}

/// A leader's connections, by peer, address and group.
#[derive(Clone, Default)]
pub struct RawPool {
    conns: Arc<Mutex<BTreeMap<Key, Conns>>>,
    /// Peers that did not serve this protocol, until when they get gRPC.
    not_served: Arc<Mutex<BTreeMap<NodeId, tokio::time::Instant>>>,
    /// Fresh connections in a row that a peer closed before answering (see [`FRESH_FAILURES`]).
    fresh_failures: Arc<Mutex<BTreeMap<NodeId, u32>>>,
}

/// A connection taken from the pool (or room for one, `io` None until it is opened): counted in its
/// key's `open` until it is dropped (closed) or given back (then the idle list holds it).
struct Conn {
    io: Option<Box<dyn RawIo>>,
    pool: RawPool,
    key: Key,
    counted: bool,
}

impl Conn {
    fn io(&mut self) -> &mut Box<dyn RawIo> {
        self.io.as_mut().expect("an open connection")
    }

    /// Back to the idle list, for the next call (still counted open there).
    fn give_back(mut self) {
        let io = self.io.take().expect("an open connection");
        let mut conns = self.pool.conns.lock().expect("raw pool lock");
        conns.entry(self.key.clone()).or_default().idle.push(io);
        self.counted = false;
    }
}

impl Drop for Conn {
    fn drop(&mut self) {
        if !self.counted {
            return;
        }
        let mut conns = self.pool.conns.lock().expect("raw pool lock");
        if let Some(c) = conns.get_mut(&self.key) {
            c.open = c.open.saturating_sub(1);
            if c.open == 0 && c.idle.is_empty() {
                conns.remove(&self.key);
            }
        }
    }
}

/// How one exchange on a connection went.
enum Exchange {
    /// A reply (an answer or a refusal); the connection went back to the pool.
    Replied(Result<pb::AppendEntriesReply, RawError>),
    /// The deadline passed; the connection, if the request was all written, reads the reply on.
    TimedOut,
    /// The connection failed, or sent something that is not a reply.
    Failed(io::Error),
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

    /// Counts a fresh connection `target` closed before answering; true when that makes
    /// [`FRESH_FAILURES`] in a row.
    fn failed_fresh(&self, target: NodeId) -> bool {
        let mut failures = self.fresh_failures.lock().expect("raw pool lock");
        let n = failures.entry(target).or_default();
        *n += 1;
        if *n >= FRESH_FAILURES {
            failures.remove(&target);
            return true;
        }
        false
    }

    fn mark_not_served(&self, target: NodeId) {
        self.not_served
            .lock()
            .expect("raw pool lock")
            .insert(target, tokio::time::Instant::now() + RAW_FALLBACK);
    }

    /// An idle connection, or room for a new one (counted open at once), or None if all
    /// [`CONNECTIONS_PER_PEER`] are taken. `replacing`: room for one that takes the place of a
    /// connection just closed, whatever the count.
    fn take(&self, key: &Key, replacing: bool) -> Option<Conn> {
        let mut conns = self.conns.lock().expect("raw pool lock");
        let c = conns.entry(key.clone()).or_default();
        let io = match c.idle.pop() {
            Some(io) if !replacing => Some(io),
            idle => {
                if let Some(io) = idle {
                    c.idle.push(io);
                }
                if c.open >= CONNECTIONS_PER_PEER && !replacing {
                    return None;
                }
                c.open += 1;
                None
            }
        };
        Some(Conn {
            io,
            pool: self.clone(),
            key: key.clone(),
            counted: true,
        })
    }

    /// Sends `req` to `target` at `addr` for `group` and reads its reply by `deadline`, on an idle
    /// connection or a new one. A reused connection that fails before its reply (the peer closed it
    /// while it was idle) is replaced by a new one once: an AppendEntries may be sent twice. `tls`:
    /// the connector that checks the answering server is `target` (as the gRPC channel's does).
    pub async fn append(
        &self,
        (target, addr, group): (NodeId, &str, u32),
        tls: Option<&holdfast_proto::tls::TlsConnector>,
        req: &pb::AppendEntriesRequest,
        deadline: tokio::time::Instant,
    ) -> Result<pb::AppendEntriesReply, RawError> {
        let mut frame = Vec::with_capacity(4 + req.encoded_len());
        frame.extend_from_slice(&(req.encoded_len() as u32).to_le_bytes());
        req.encode(&mut frame)
            .expect("encoding to a Vec cannot fail");
        let key = (target, addr.to_string(), group);
        let Some(conn) = self.take(&key, false) else {
            return Err(RawError::Busy(io::Error::new(
                io::ErrorKind::WouldBlock,
                format!("all {CONNECTIONS_PER_PEER} append connections to node {target} are taken"),
            )));
        };
        let conn = if conn.io.is_none() {
            conn
        } else {
            match self.exchange(conn, &frame, deadline).await {
                Exchange::Replied(reply) => return reply,
                Exchange::TimedOut => return Err(RawError::TimedOut),
                // Closed while idle: a new connection takes its place.
                Exchange::Failed(_) => self.take(&key, true).expect("room for a replacement"),
            }
        };
        let conn = self.connect(conn, tls, deadline).await?;
        match self.exchange(conn, &frame, deadline).await {
            Exchange::Replied(reply) => {
                self.fresh_failures
                    .lock()
                    .expect("raw pool lock")
                    .remove(&target);
                reply
            }
            Exchange::TimedOut => Err(RawError::TimedOut),
            Exchange::Failed(e)
                if e.kind() == io::ErrorKind::InvalidData || self.failed_fresh(target) =>
            {
                tracing::info!(
                    error = %e,
                    "node {target} answered an append connection with something else (a release that predates them?); appending to it over gRPC for {RAW_FALLBACK:?}"
                );
                self.mark_not_served(target);
                Err(RawError::NotServed(e))
            }
            Exchange::Failed(e) => Err(RawError::Io(e)),
        }
    }

    /// Opens `conn`'s connection and sends the preface and version, in a task of its own: if the
    /// deadline passes first, the connection still opens and is kept for the next call (a TLS
    /// handshake can take longer than a heartbeat's 37.5 ms deadline).
    async fn connect(
        &self,
        mut conn: Conn,
        tls: Option<&holdfast_proto::tls::TlsConnector>,
        deadline: tokio::time::Instant,
    ) -> Result<Conn, RawError> {
        let (tx, rx) = tokio::sync::oneshot::channel::<io::Result<Conn>>();
        let tls = tls.cloned();
        let addr = conn.key.1.clone();
        tokio::spawn(async move {
            let opened = async {
                let mut io = holdfast_proto::transport::connect_raw(&addr, tls.as_ref()).await?;
                let mut hello = PREFACE.to_vec();
                hello.extend_from_slice(&VERSION.to_le_bytes());
                io.write_all(&hello).await?;
                io.flush().await?;
                Ok(io)
            }
            .await;
            let opened = opened.map(|io| {
                conn.io = Some(io);
                conn
            });
            if let Err(Ok(conn)) = tx.send(opened) {
                conn.give_back();
            }
        });
        match tokio::time::timeout_at(deadline, rx).await {
            Err(_) => Err(RawError::Busy(io::Error::new(
                io::ErrorKind::TimedOut,
                "connecting took longer than the call's deadline (the connection is kept for the next call)",
            ))),
            Ok(Err(_)) => Err(RawError::Connect(io::Error::other(
                "the connecting task ended",
            ))),
            Ok(Ok(Err(e))) => Err(RawError::Connect(e)),
            Ok(Ok(Ok(conn))) => Ok(conn),
        }
    }

    /// Writes one request frame and reads its reply by `deadline`. A reply still owed at the deadline
    /// is read on in the background (at most [`DRAIN_TIMEOUT`]) and the connection then kept.
    async fn exchange(
        &self,
        mut conn: Conn,
        frame: &[u8],
        deadline: tokio::time::Instant,
    ) -> Exchange {
        let write = async {
            let io = conn.io();
            io.write_all(frame).await?;
            // TLS: rustls keeps what it could not write yet until flushed.
            io.flush().await
        };
        match tokio::time::timeout_at(deadline, write).await {
            // Part of a frame may be in the connection: it is closed.
            Err(_) => return Exchange::TimedOut,
            Ok(Err(e)) => return Exchange::Failed(e),
            Ok(Ok(())) => {}
        }
        let mut read = Box::pin(async move {
            let reply = read_frame(conn.io(), MAX_REPLY_BYTES, None).await;
            (conn, reply)
        });
        let (conn, reply) = match tokio::time::timeout_at(deadline, &mut read).await {
            Ok(done) => done,
            Err(_) => {
                tokio::spawn(async move {
                    if let Ok((conn, Ok(_))) = tokio::time::timeout(DRAIN_TIMEOUT, read).await {
                        conn.give_back();
                    }
                });
                return Exchange::TimedOut;
            }
        };
        match reply.and_then(|r| parse_reply(&r)) {
            Err(e) => Exchange::Failed(e),
            Ok(reply) => {
                conn.give_back();
                Exchange::Replied(reply)
            }
        }
    }
}

/// A reply frame's answer or refusal; `Err` if it is neither (it is not a reply).
fn parse_reply(reply: &[u8]) -> io::Result<Result<pb::AppendEntriesReply, RawError>> {
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

/// Reads one length-prefixed frame of at most `limit` bytes. `idle`: the longest wait for its first
/// byte. The body is read as it arrives, not allocated whole from its length.
async fn read_frame<R: AsyncRead + Unpin>(
    io: &mut R,
    limit: usize,
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
    if n > limit {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!("a frame of {n} bytes (the limit is {limit})"),
        ));
    }
    let mut buf = Vec::with_capacity(n.min(64 << 10));
    let got = tokio::time::timeout(
        BODY_TIMEOUT,
        (&mut *io).take(n as u64).read_to_end(&mut buf),
    )
    .await
    .map_err(|_| io::Error::new(io::ErrorKind::TimedOut, "a frame's bytes stopped coming"))??;
    if got < n {
        return Err(io::ErrorKind::UnexpectedEof.into());
    }
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
        let request = match read_frame(&mut io, MAX_PEER_MESSAGE_BYTES, Some(IDLE_TIMEOUT)).await {
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
        // TLS: rustls keeps what it could not write yet until flushed.
        if io.write_all(&out).await.is_err() || io.flush().await.is_err() {
            return;
        }
        tracing::trace!(target: "holdfast::hop", "append answered");
    }
}
