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
//! a broken gRPC connection is, unless [`FRESH_FAILURES`] fresh ones in a row close before answering
//! (an older server's close can come before its preface is read). A TCP proxy in front of a follower
//! that is down closes connections that way too: the follower then gets gRPC for up to
//! [`RAW_FALLBACK`] once it is back, which costs speed, not safety.
//!
//! A leader's connections to a follower are checked as its gRPC channel is: over TLS the answering
//! certificate must be that follower's (`holdfast-server-<id>`).

use crate::peer::{PeerService, RaftLookup, MAX_PEER_MESSAGE_BYTES};
use crate::raft_types::NodeId;
use holdfast_proto::transport::RawIo;
use holdfast_proto::v1 as pb;
use prost::bytes::Bytes;
use prost::Message;
use std::collections::BTreeMap;
use std::io;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

/// What a connection of this protocol starts with. Differs from HTTP/2's preface in its first byte.
pub const PREFACE: &[u8] = b"HFAPPEND";
/// The protocol's version, sent after the preface. A server closes a connection of a version it does
/// not know (after [`FRESH_FAILURES`] such closes in a row the leader falls back to gRPC).
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
/// Bytes a follower's connection reads ahead: a frame's length and its body (an append of a few
/// dozen entries, or a heartbeat) in one `recv`, where reading the length and then the body took two
/// and the probe for a close while the append is under way a third. A longer frame is read on past
/// the buffer. Allocated once the connection's preface is read: the peer port's 1,024 connections at
/// most make 16 MiB.
const REQUEST_READ_AHEAD: usize = 16 << 10;
/// The largest request buffer a follower's connection keeps between appends (it reads each into the
/// same buffer): a connection carrying a leader's appends at 256 clients reads ~10 KiB at a time, and
/// the peer port's 1,024 connections hold at most 64 MiB this way.
const KEPT_REQUEST_BUFFER: usize = 64 << 10;
/// Bytes a leader's connection reads ahead: a whole reply in one `recv`, not its length and then its
/// body.
const REPLY_READ_AHEAD: usize = 1 << 10;
/// Connections a leader keeps open per peer, address and group: in use, idle, connecting, or
/// finishing the read of a reply its caller stopped waiting for. Normally one carries the group's
/// appends and one its heartbeats; the rest cover replies still owed. With all taken, a call fails at once
/// (openraft retries it) instead of opening more: a follower that stopped answering (a stalled
/// process) costs at most this many connections, not one per heartbeat.
pub const CONNECTIONS_PER_PEER: usize = 4;
/// Of a key's connections, how many heartbeats may hold (in use, or reading a reply owed): a slow
/// follower's late heartbeat replies leave the others to appends.
pub const HEARTBEAT_CONNECTIONS: usize = 2;
/// How long a reply that its caller stopped waiting for is still read, so that its connection can
/// be used again (a heartbeat gives up after 37.5 ms; the follower answers it later). Short, because
/// the connection holds its place among [`CONNECTIONS_PER_PEER`] meanwhile: one into a network that
/// drops everything (a partition) is given up after this, as gRPC's keepalive gave up on a dead
/// connection after ~4 s.
pub const DRAIN_TIMEOUT: Duration = Duration::from_secs(2);
/// An idle connection not used for this long is closed by the leader (before the follower's
/// [`IDLE_TIMEOUT`]): those of groups it no longer leads, or of an address no longer used.
pub const IDLE_KEEP: Duration = Duration::from_secs(30);
/// How long a peer that answered a fresh connection with an HTTP/2 server's preface (a release that
/// predates this protocol) gets its appends over gRPC before this protocol is tried again.
pub const RAW_FALLBACK: Duration = Duration::from_secs(10);

/// Why a raw append did not get a reply.
pub enum RawError {
    /// No connection could be made: the peer is unreachable (refused, reset, no route).
    Connect(io::Error),
    /// No connection in time: all [`CONNECTIONS_PER_PEER`] (or a heartbeat's
    /// [`HEARTBEAT_CONNECTIONS`]) are taken, or opening one outlasted the deadline. A slow peer, not an
    /// unreachable one.
    Busy(io::Error),
    /// The peer does not serve this protocol. Send the request over gRPC.
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

/// How often the pool looks for connections idle past [`IDLE_KEEP`].
const SWEEP_EVERY: Duration = Duration::from_secs(10);

/// A leader's connections to one peer for one group: (peer, address, group).
type Key = (NodeId, String, u32);

/// A connection waiting for its next call.
struct Idle {
    io: Box<dyn RawIo>,
    /// The peer has answered on it (else it was opened for a call that gave up waiting).
    answered: bool,
    since: tokio::time::Instant,
}

#[derive(Default)]
struct Conns {
    idle: Vec<Idle>,
    /// Connections alive (idle or not), at most [`CONNECTIONS_PER_PEER`].
    open: usize,
    /// Of those, held by heartbeats, at most [`HEARTBEAT_CONNECTIONS`].
    heartbeats: usize,
}

#[derive(Default)]
struct Pool {
    conns: BTreeMap<Key, Conns>,
    swept: Option<tokio::time::Instant>,
}

/// A leader's connections, by peer, address and group.
#[derive(Clone, Default)]
pub struct RawPool {
    pool: Arc<Mutex<Pool>>,
    /// Peers that did not serve this protocol, until when they get gRPC.
    not_served: Arc<Mutex<BTreeMap<NodeId, tokio::time::Instant>>>,
    /// Fresh connections in a row that a peer closed before answering (see [`FRESH_FAILURES`]).
    fresh_failures: Arc<Mutex<BTreeMap<NodeId, u32>>>,
}

/// A connection taken from the pool (or room for one, `io` None until it is opened): counted in its
/// key's `open` (and `heartbeats`) until it is dropped (closed) or given back (then the idle list
/// holds it).
struct Conn {
    io: Option<Box<dyn RawIo>>,
    answered: bool,
    heartbeat: bool,
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
        let mut pool = self.pool.pool.lock().expect("raw pool lock");
        let c = pool.conns.entry(self.key.clone()).or_default();
        if self.heartbeat {
            c.heartbeats = c.heartbeats.saturating_sub(1);
        }
        c.idle.push(Idle {
            io,
            answered: self.answered,
            since: tokio::time::Instant::now(),
        });
        self.counted = false;
    }
}

impl Drop for Conn {
    fn drop(&mut self) {
        if !self.counted {
            return;
        }
        let mut pool = self.pool.pool.lock().expect("raw pool lock");
        if let Some(c) = pool.conns.get_mut(&self.key) {
            c.open = c.open.saturating_sub(1);
            if self.heartbeat {
                c.heartbeats = c.heartbeats.saturating_sub(1);
            }
            if c.open == 0 && c.idle.is_empty() {
                pool.conns.remove(&self.key);
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

    /// A fresh connection (or one the peer never answered on) to `target` failed with `e` before
    /// its first reply: not served if that was an HTTP/2 server's preface, or the
    /// [`FRESH_FAILURES`]th such failure in a row; else a network error.
    fn fresh_failed(&self, target: NodeId, e: io::Error) -> RawError {
        let http2 = e.kind() == io::ErrorKind::Unsupported;
        let in_a_row = {
            let mut failures = self.fresh_failures.lock().expect("raw pool lock");
            let n = failures.entry(target).or_default();
            *n += 1;
            *n >= FRESH_FAILURES
        };
        if !(http2 || in_a_row) {
            return RawError::Io(e);
        }
        self.fresh_failures
            .lock()
            .expect("raw pool lock")
            .remove(&target);
        tracing::info!(
            error = %e,
            "node {target} does not take append connections (a release that predates them?); appending to it over gRPC for {RAW_FALLBACK:?}"
        );
        self.not_served
            .lock()
            .expect("raw pool lock")
            .insert(target, tokio::time::Instant::now() + RAW_FALLBACK);
        RawError::NotServed(e)
    }

    fn answered(&self, target: NodeId) {
        self.fresh_failures
            .lock()
            .expect("raw pool lock")
            .remove(&target);
    }

    /// An idle connection, or room for a new one (counted open at once), or None if all
    /// [`CONNECTIONS_PER_PEER`] (or [`HEARTBEAT_CONNECTIONS`] for a heartbeat) are taken.
    /// `replacing`: room for one that takes the place of a connection just closed, whatever the
    /// counts.
    fn take(&self, key: &Key, heartbeat: bool, replacing: bool) -> Option<Conn> {
        let mut pool = self.pool.lock().expect("raw pool lock");
        let now = tokio::time::Instant::now();
        if pool.swept.is_none_or(|t| now >= t + SWEEP_EVERY) {
            sweep(&mut pool, now);
        }
        let c = pool.conns.entry(key.clone()).or_default();
        if heartbeat && c.heartbeats >= HEARTBEAT_CONNECTIONS && !replacing {
            return None;
        }
        let mut conn = Conn {
            io: None,
            answered: false,
            heartbeat,
            pool: self.clone(),
            key: key.clone(),
            counted: true,
        };
        match c.idle.pop() {
            Some(idle) if !replacing => {
                conn.io = Some(idle.io);
                conn.answered = idle.answered;
            }
            idle => {
                c.idle.extend(idle);
                if c.open >= CONNECTIONS_PER_PEER && !replacing {
                    // Not counted: dropping it must not count a connection closed.
                    conn.counted = false;
                    return None;
                }
                c.open += 1;
            }
        }
        if heartbeat {
            c.heartbeats += 1;
        }
        Some(conn)
    }

    /// Closes the connections idle past [`IDLE_KEEP`], every [`SWEEP_EVERY`] until `stop` changes:
    /// calls do it too, but a server that no longer leads any group makes none (`node` runs this).
    pub async fn sweep_idle(&self, mut stop: tokio::sync::watch::Receiver<bool>) {
        loop {
            tokio::select! {
                () = tokio::time::sleep(SWEEP_EVERY) => {}
                _ = stop.changed() => return,
            }
            let mut pool = self.pool.lock().expect("raw pool lock");
            sweep(&mut pool, tokio::time::Instant::now());
        }
    }

    /// [`Self::append_frame`] with `req` framed ([`finish_frame`]): the tests' way in (a leader
    /// frames its appends with `peer::append_frame`).
    #[cfg(test)]
    async fn append(
        &self,
        to: (NodeId, &str, u32),
        tls: Option<&holdfast_proto::tls::TlsConnector>,
        req: &pb::AppendEntriesRequest,
        deadline: tokio::time::Instant,
    ) -> Result<pb::AppendEntriesReply, RawError> {
        let mut frame = vec![0; 4];
        req.encode(&mut frame)
            .expect("encoding to a Vec cannot fail");
        let frame = finish_frame(frame)?;
        self.append_frame(to, tls, &frame, req.entries.is_empty(), deadline)
            .await
    }

    /// Sends `frame` (an `AppendEntriesRequest` framed: [`finish_frame`]; a heartbeat if it carries
    /// no entries) to `target` at `addr` for `group` and reads its reply by `deadline`, on an idle
    /// connection or a new one. A reused connection that fails before its reply (the peer closed it
    /// while it was idle) is replaced by a new one once: an AppendEntries may be sent twice. `tls`:
    /// the connector that checks the answering server is `target` (as the gRPC channel's does).
    pub async fn append_frame(
        &self,
        (target, addr, group): (NodeId, &str, u32),
        tls: Option<&holdfast_proto::tls::TlsConnector>,
        frame: &[u8],
        heartbeat: bool,
        deadline: tokio::time::Instant,
    ) -> Result<pb::AppendEntriesReply, RawError> {
        let key = (target, addr.to_string(), group);
        let Some(conn) = self.take(&key, heartbeat, false) else {
            return Err(RawError::Busy(io::Error::new(
                io::ErrorKind::WouldBlock,
                format!("the append connections to node {target} are all taken"),
            )));
        };
        let conn = if conn.io.is_none() {
            conn
        } else {
            let answered = conn.answered;
            match self.exchange(conn, frame, deadline).await {
                Exchange::Replied(reply) => {
                    self.answered(target);
                    return reply;
                }
                Exchange::TimedOut => return Err(RawError::TimedOut),
                // Opened for an earlier call and never answered on: as a fresh one.
                Exchange::Failed(e) if !answered => return Err(self.fresh_failed(target, e)),
                // Closed while idle: a new connection takes its place.
                Exchange::Failed(_) => self
                    .take(&key, heartbeat, true)
                    .expect("room for a replacement"),
            }
        };
        let conn = self.connect(conn, tls, deadline).await?;
        match self.exchange(conn, frame, deadline).await {
            Exchange::Replied(reply) => {
                self.answered(target);
                reply
            }
            Exchange::TimedOut => Err(RawError::TimedOut),
            Exchange::Failed(e) => Err(self.fresh_failed(target, e)),
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
                let io = holdfast_proto::transport::connect_raw(&addr, tls.as_ref()).await?;
                let mut io: Box<dyn RawIo> =
                    Box::new(tokio::io::BufReader::with_capacity(REPLY_READ_AHEAD, io));
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
            match tx.send(opened) {
                Err(Ok(conn)) => conn.give_back(),
                Err(Err(e)) => tracing::debug!(
                    error = %e,
                    "an append connection to {addr} failed after its caller stopped waiting"
                ),
                Ok(()) => {}
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
        let (mut conn, reply) = match tokio::time::timeout_at(deadline, &mut read).await {
            Ok(done) => done,
            Err(_) => {
                tokio::spawn(async move {
                    if let Ok((mut conn, Ok(_))) = tokio::time::timeout(DRAIN_TIMEOUT, read).await {
                        conn.answered = true;
                        conn.give_back();
                    }
                });
                return Exchange::TimedOut;
            }
        };
        match reply.and_then(|r| parse_reply(&r)) {
            Err(e) => Exchange::Failed(e),
            Ok(reply) => {
                conn.answered = true;
                conn.give_back();
                Exchange::Replied(reply)
            }
        }
    }
}

/// Writes the length of the message that follows `frame`'s first 4 bytes into them: the frame of an
/// `AppendEntriesRequest` whose encoding was written after 4 bytes of room. Refused (as the unary call
/// refuses it) when the message is over `MAX_PEER_MESSAGE_BYTES`: the follower would close the
/// connection.
pub fn finish_frame(mut frame: Vec<u8>) -> Result<Vec<u8>, RawError> {
    let len = frame.len() - 4;
    if len > MAX_PEER_MESSAGE_BYTES {
        return Err(RawError::Refused(tonic::Status::out_of_range(format!(
            "an append of {len} bytes (the limit is {MAX_PEER_MESSAGE_BYTES})"
        ))));
    }
    frame[..4].copy_from_slice(&(len as u32).to_le_bytes());
    Ok(frame)
}

/// Closes the idle connections older than [`IDLE_KEEP`] (an idle connection counts in `open` until
/// then) and forgets keys with none left.
fn sweep(pool: &mut Pool, now: tokio::time::Instant) {
    pool.swept = Some(now);
    pool.conns.retain(|_, c| {
        let before = c.idle.len();
        c.idle.retain(|i| now < i.since + IDLE_KEEP);
        let closed = before - c.idle.len();
        debug_assert!(c.open >= closed, "idle connections are counted open");
        c.open = c.open.saturating_sub(closed);
        c.open > 0
    });
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
/// byte. The body is read as it arrives, not allocated whole from its length. A length over the
/// limit that is an HTTP/2 server's first frame (a SETTINGS frame: a 3-byte big-endian length below
/// 2^16, then type 4; read as ours, a length of at least 64 MiB) is `Unsupported`.
async fn read_frame<R: AsyncRead + Unpin>(
    io: &mut R,
    limit: usize,
    idle: Option<Duration>,
) -> io::Result<Vec<u8>> {
    let mut buf = Vec::new();
    read_frame_into(io, limit, idle, &mut buf).await?;
    Ok(buf)
}

/// [`read_frame`] into `buf` (cleared first), whose capacity is kept for the next: a follower reads
/// every append into one buffer. A fresh buffer of a few KiB each time cost more than its size says:
/// a request of 1 KiB or more makes glibc's malloc consolidate the small chunks freed since the last
/// one first (`malloc_consolidate`, 1.9% of a follower's samples at 64 clients).
async fn read_frame_into<R: AsyncRead + Unpin>(
    io: &mut R,
    limit: usize,
    idle: Option<Duration>,
    buf: &mut Vec<u8>,
) -> io::Result<()> {
    buf.clear();
    let mut len = [0u8; 4];
    match idle {
        Some(t) => tokio::time::timeout(t, io.read_exact(&mut len))
            .await
            .map_err(|_| io::Error::new(io::ErrorKind::TimedOut, "idle"))??,
        None => io.read_exact(&mut len).await?,
    };
    let n = u32::from_le_bytes(len) as usize;
    if n > limit {
        if len[0] == 0 && len[3] == 4 {
            return Err(io::Error::new(
                io::ErrorKind::Unsupported,
                "an HTTP/2 server's preface, not a reply",
            ));
        }
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!("a frame of {n} bytes (the limit is {limit})"),
        ));
    }
    // Room for the body up to 64 KiB now: a length alone allocates no more.
    buf.reserve(n.min(64 << 10));
    let got = tokio::time::timeout(BODY_TIMEOUT, (&mut *io).take(n as u64).read_to_end(buf))
        .await
        .map_err(|_| io::Error::new(io::ErrorKind::TimedOut, "a frame's bytes stopped coming"))??;
    if got < n {
        return Err(io::ErrorKind::UnexpectedEof.into());
    }
    Ok(())
}

/// `buf`'s bytes as a `Bytes` that holds its buffer, for decoding an append from: prost decodes a
/// `Bytes` field (an entry's command) from a `Bytes` as a slice of it, where from a `&[u8]` it copied
/// each into an allocation of its own (one `malloc` per entry on every follower, ~15% of their
/// calls). [`reclaim`] gives the buffer back once nothing points into it.
fn share(buf: &mut Vec<u8>) -> Bytes {
    Bytes::from(std::mem::take(buf))
}

/// Puts `frame`'s buffer back in `buf` (emptied, its room kept) when `frame` is the last reference to
/// it, as it is once the message decoded from it is gone (each entry's command is decoded from its
/// slice into a `Command` of its own); otherwise `buf` starts again empty.
fn reclaim(buf: &mut Vec<u8>, frame: Bytes) {
    if let Ok(b) = frame.try_into_mut() {
        *buf = Vec::from(b);
    }
    buf.clear();
}

/// Lets go of `buf`'s room when a rare big append (a follower catching up) grew it past
/// [`KEPT_REQUEST_BUFFER`]: a connection keeps at most that between appends.
fn shed_big_buffer(buf: &mut Vec<u8>) {
    if buf.capacity() > KEPT_REQUEST_BUFFER {
        *buf = Vec::new();
    }
}

/// Serves one connection whose [`PREFACE`] was read: its version, then its requests one at a time.
/// `sender`: as for a gRPC request (`peer::sender_id`), the node the connection's certificate names.
pub async fn serve<L: RaftLookup, IO: AsyncRead + AsyncWrite + Unpin>(
    service: &PeerService<L>,
    io: IO,
    sender: Option<Option<u64>>,
) {
    // Writes go straight through; reads come from the buffer.
    let mut io = tokio::io::BufReader::with_capacity(REQUEST_READ_AHEAD, io);
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
    let mut request = Vec::new();
    loop {
        shed_big_buffer(&mut request);
        match read_frame_into(
            &mut io,
            MAX_PEER_MESSAGE_BYTES,
            Some(IDLE_TIMEOUT),
            &mut request,
        )
        .await
        {
            Ok(()) => {}
            Err(e) => {
                if e.kind() == io::ErrorKind::InvalidData {
                    tracing::warn!(error = %e, "closing an append connection");
                }
                return;
            }
        };
        let frame = share(&mut request);
        let reply = match pb::AppendEntriesRequest::decode(frame.clone()) {
            Ok(m) => {
                tracing::trace!(
                    target: "holdfast::hop",
                    from = m.vote.as_ref().map_or(0, |v| v.node),
                    index = m.entries.last().and_then(|e| e.log_id.as_ref()).map_or(0, |l| l.index),
                    "append received"
                );
                // A leader sends nothing more before the reply: anything read meanwhile (its close,
                // after it gave up on this request) ends the connection, so a follower whose Raft is
                // stuck does not keep a task and a connection slot for each one its leaders closed.
                let mut probe = [0u8; 1];
                tokio::select! {
                    reply = service.append_entries_pb(m, sender) => reply,
                    _ = io.read(&mut probe) => return,
                }
            }
            Err(e) => Err(tonic::Status::invalid_argument(format!(
                "malformed peer message: {e}"
            ))),
        };
        reclaim(&mut request, frame);
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

#[cfg(all(test, not(holdfast_sim)))]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};

    /// A follower that speaks the protocol but answers nothing until `release` is notified, then
    /// everything owed: counts the connections it accepted.
    async fn silent_follower() -> (String, Arc<AtomicUsize>, Arc<tokio::sync::Notify>) {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        let (accepted, release) = (
            Arc::new(AtomicUsize::new(0)),
            Arc::new(tokio::sync::Notify::new()),
        );
        let (a, r) = (accepted.clone(), release.clone());
        tokio::spawn(async move {
            loop {
                let (mut io, _) = listener.accept().await.unwrap();
                a.fetch_add(1, Ordering::SeqCst);
                let r = r.clone();
                tokio::spawn(async move {
                    let mut hello = [0u8; 12];
                    io.read_exact(&mut hello).await.unwrap();
                    assert_eq!(&hello[..8], PREFACE);
                    let released = r.notified();
                    tokio::pin!(released);
                    let mut owed = 0;
                    loop {
                        tokio::select! {
                            frame = read_frame(&mut io, MAX_PEER_MESSAGE_BYTES, None) => {
                                if frame.is_err() {
                                    return;
                                }
                                owed += 1;
                            }
                            () = &mut released, if owed > 0 => break,
                        }
                    }
                    loop {
                        let reply = pb::AppendEntriesReply {
                            result: Some(pb::append_entries_reply::Result::Success(pb::Blank {})),
                            features: 1,
                        };
                        let mut out = ((reply.encoded_len() + 1) as u32).to_le_bytes().to_vec();
                        out.push(0);
                        reply.encode(&mut out).unwrap();
                        for _ in 0..owed {
                            if io.write_all(&out).await.is_err() {
                                return;
                            }
                        }
                        // Released: from now on each request is answered as it comes.
                        match read_frame(&mut io, MAX_PEER_MESSAGE_BYTES, None).await {
                            Ok(_) => owed = 1,
                            Err(_) => return,
                        }
                    }
                });
            }
        });
        (addr, accepted, release)
    }

    /// How [`switching_follower`] treats its next connection.
    const CLOSE: u8 = 0;
    const ANSWER: u8 = 1;
    const HTTP2: u8 = 2;

    /// A follower whose connections are closed unread (as a TCP proxy in front of a server that is
    /// down closes them), answered, or sent an HTTP/2 server's preface and closed (as a release that
    /// predates this protocol does), as `mode` says when each is accepted.
    async fn switching_follower() -> (String, Arc<std::sync::atomic::AtomicU8>) {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        let mode = Arc::new(std::sync::atomic::AtomicU8::new(CLOSE));
        let m = mode.clone();
        tokio::spawn(async move {
            loop {
                let (mut io, _) = listener.accept().await.unwrap();
                match m.load(Ordering::SeqCst) {
                    CLOSE => drop(io),
                    HTTP2 => {
                        // What the connection sent is read first: a close with bytes unread
                        // resets it, and the preface could be lost (see `FRESH_FAILURES`).
                        let mut hello = [0u8; 12];
                        io.read_exact(&mut hello).await.unwrap();
                        read_frame(&mut io, MAX_PEER_MESSAGE_BYTES, None)
                            .await
                            .unwrap();
                        // An empty SETTINGS frame: length 0, type 4, no flags, stream 0.
                        let _ = io.write_all(&[0, 0, 0, 4, 0, 0, 0, 0, 0]).await;
                    }
                    _ => {
                        tokio::spawn(async move {
                            let mut hello = [0u8; 12];
                            io.read_exact(&mut hello).await.unwrap();
                            while read_frame(&mut io, MAX_PEER_MESSAGE_BYTES, None)
                                .await
                                .is_ok()
                            {
                                let reply = pb::AppendEntriesReply {
                                    result: Some(pb::append_entries_reply::Result::Success(
                                        pb::Blank {},
                                    )),
                                    features: 1,
                                };
                                let mut out =
                                    ((reply.encoded_len() + 1) as u32).to_le_bytes().to_vec();
                                out.push(0);
                                reply.encode(&mut out).unwrap();
                                if io.write_all(&out).await.is_err() {
                                    return;
                                }
                            }
                        });
                    }
                }
            }
        });
        (addr, mode)
    }

    /// A peer that closes `FRESH_FAILURES` fresh connections in a row unanswered, or answers one
    /// with an HTTP/2 server's preface, gets its appends over gRPC (`serves` is false) for
    /// `RAW_FALLBACK`, then this protocol again; closes with an answer between them do not add up.
    #[tokio::test]
    async fn a_peer_that_closes_fresh_connections_in_a_row_gets_grpc_for_a_while() {
        let (addr, mode) = switching_follower().await;
        let pool = RawPool::default();
        let call = || {
            let (pool, addr) = (pool.clone(), addr.clone());
            async move {
                let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
                // Entries, not a heartbeat: every call may open a connection.
                pool.append((2, &addr, 0), None, &request(1), deadline)
                    .await
            }
        };
        for _ in 1..FRESH_FAILURES {
            assert!(matches!(call().await, Err(RawError::Io(_))));
        }
        // An answer in between: the closes so far do not count.
        mode.store(ANSWER, Ordering::SeqCst);
        assert!(call().await.is_ok());
        // Group 0's connection stays open in the pool; other groups' connections are fresh.
        mode.store(CLOSE, Ordering::SeqCst);
        let fresh = |group| {
            let (pool, addr) = (pool.clone(), addr.clone());
            async move {
                let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
                pool.append((2, &addr, group), None, &request(1), deadline)
                    .await
            }
        };
        for group in 1..FRESH_FAILURES {
            assert!(matches!(fresh(group).await, Err(RawError::Io(_))));
            assert!(pool.serves(2));
        }
        assert!(matches!(
            fresh(FRESH_FAILURES).await,
            Err(RawError::NotServed(_))
        ));
        assert!(!pool.serves(2), "closes in a row: gRPC");
        assert!(pool.serves(3), "another peer is not concerned");
        // The fallback began a little before the clock stops: half of it later it still holds, and
        // RAW_FALLBACK after the pause it is over.
        tokio::time::pause();
        tokio::time::advance(RAW_FALLBACK / 2).await;
        assert!(!pool.serves(2));
        tokio::time::advance(RAW_FALLBACK / 2).await;
        assert!(pool.serves(2), "tried again after RAW_FALLBACK");
        tokio::time::resume();
        // An HTTP/2 server's preface is not served at once.
        mode.store(HTTP2, Ordering::SeqCst);
        assert!(matches!(fresh(100).await, Err(RawError::NotServed(_))));
        assert!(!pool.serves(2), "an HTTP/2 preface: gRPC");
    }

    fn request(entries: usize) -> pb::AppendEntriesRequest {
        pb::AppendEntriesRequest {
            entries: (0..entries).map(|_| pb::Entry::default()).collect(),
            ..Default::default()
        }
    }

    /// A follower that stops answering costs a leader at most `CONNECTIONS_PER_PEER` connections per
    /// group, at most `HEARTBEAT_CONNECTIONS` of them to heartbeats (not one per heartbeat); once it
    /// answers what is owed, the same connections carry the next calls.
    #[tokio::test]
    async fn a_silent_follower_costs_a_bounded_number_of_connections_and_they_are_reused() {
        let (addr, accepted, release) = silent_follower().await;
        let pool = RawPool::default();
        let soon = || tokio::time::Instant::now() + Duration::from_millis(50);
        let call = |entries| {
            let (pool, addr) = (pool.clone(), addr.clone());
            async move {
                pool.append((2, &addr, 0), None, &request(entries), soon())
                    .await
            }
        };
        for _ in 0..2 {
            assert!(matches!(call(0).await, Err(RawError::TimedOut)));
        }
        assert!(
            matches!(call(0).await, Err(RawError::Busy(_))),
            "a third heartbeat connection"
        );
        for _ in 0..2 {
            assert!(matches!(call(1).await, Err(RawError::TimedOut)));
        }
        assert!(
            matches!(call(1).await, Err(RawError::Busy(_))),
            "a fifth connection"
        );
        assert_eq!(accepted.load(Ordering::SeqCst), CONNECTIONS_PER_PEER);
        // Another group has connections of its own.
        let other = pool.append((2, &addr, 1), None, &request(1), soon()).await;
        assert!(matches!(other, Err(RawError::TimedOut)));
        // The follower answers what it owes: the drained connections go back to the pool.
        release.notify_waiters();
        let deadline = tokio::time::Instant::now() + DRAIN_TIMEOUT;
        let reply = loop {
            let later = tokio::time::Instant::now() + Duration::from_secs(1);
            match pool.append((2, &addr, 0), None, &request(1), later).await {
                Ok(reply) => break reply,
                Err(RawError::Busy(_)) if tokio::time::Instant::now() < deadline => {
                    tokio::time::sleep(Duration::from_millis(10)).await;
                }
                Err(_) => panic!("no reply from the reused connections"),
            }
        };
        assert_eq!(reply.features, 1);
        assert_eq!(
            accepted.load(Ordering::SeqCst),
            CONNECTIONS_PER_PEER + 1,
            "a connection was opened instead of reusing one"
        );
    }

    /// An append decoded from its shared frame holds its entries' commands as slices of the frame (no
    /// copy), and once the message is gone the frame's buffer comes back with its room.
    #[test]
    fn an_append_decoded_from_a_shared_frame_borrows_its_commands_and_gives_the_buffer_back() {
        let entry = |index: u64, command: &[u8]| pb::Entry {
            log_id: Some(pb::LogId {
                term: 3,
                leader: 1,
                index,
            }),
            payload: Some(pb::entry::Payload::Command(Bytes::copy_from_slice(command))),
        };
        let commands: Vec<Vec<u8>> = (0..5u8).map(|i| vec![i; 40 + usize::from(i)]).collect();
        let m = pb::AppendEntriesRequest {
            entries: commands
                .iter()
                .enumerate()
                .map(|(i, c)| entry(i as u64 + 1, c))
                .collect(),
            ..Default::default()
        };
        let mut request = Vec::with_capacity(16 << 10);
        m.encode(&mut request).unwrap();
        let (at, room) = (request.as_ptr(), request.capacity());
        let frame = share(&mut request);
        let span = frame.as_ptr_range();
        let decoded = pb::AppendEntriesRequest::decode(frame.clone()).unwrap();
        assert_eq!(decoded, m);
        for e in &decoded.entries {
            let Some(pb::entry::Payload::Command(c)) = &e.payload else {
                panic!("an entry without its command");
            };
            assert!(
                span.contains(&c.as_ptr()),
                "a command was copied out of the frame"
            );
        }
        drop(decoded);
        reclaim(&mut request, frame);
        assert!(request.is_empty());
        assert_eq!(
            (request.as_ptr(), request.capacity()),
            (at, room),
            "the frame's buffer did not come back"
        );
        // A buffer exactly the frame's length (a fresh one, reserved for one frame) comes back too:
        // its `Bytes` gets its shared header from the first clone, not from the conversion.
        let mut request = m.encode_to_vec();
        request.shrink_to_fit();
        assert_eq!(request.len(), request.capacity());
        let (at, room) = (request.as_ptr(), request.capacity());
        let frame = share(&mut request);
        let decoded = pb::AppendEntriesRequest::decode(frame.clone()).unwrap();
        assert_eq!(decoded, m);
        drop(decoded);
        reclaim(&mut request, frame);
        assert_eq!(
            (request.as_ptr(), request.capacity()),
            (at, room),
            "an exact buffer did not come back"
        );
        // While something still points into it, the buffer stays with that, and the next read
        // starts from an empty one.
        request.extend_from_slice(&m.encode_to_vec());
        let frame = share(&mut request);
        let kept = pb::AppendEntriesRequest::decode(frame.clone()).unwrap();
        reclaim(&mut request, frame);
        assert_eq!(request.capacity(), 0);
        assert_eq!(kept, m);
    }

    /// Frames read one after another into one buffer each read as itself: a short frame after a long
    /// one, an empty one, a long one again; the buffer keeps its room between them up to
    /// `KEPT_REQUEST_BUFFER` and lets go of more (as `serve` sheds it); a frame over the limit and
    /// one cut short are errors.
    #[tokio::test]
    async fn frames_read_into_one_buffer_are_each_their_own_bytes() {
        let bodies: Vec<Vec<u8>> = vec![
            (0..3000u32).map(|i| i as u8).collect(),
            b"short".to_vec(),
            Vec::new(),
            vec![7; 70 << 10],
            b"last".to_vec(),
        ];
        let mut stream = Vec::new();
        for b in &bodies {
            stream.extend_from_slice(&(b.len() as u32).to_le_bytes());
            stream.extend_from_slice(b);
        }
        let mut io = &stream[..];
        let mut buf = Vec::new();
        for (i, want) in bodies.iter().enumerate() {
            // As `serve` does before each read.
            shed_big_buffer(&mut buf);
            match i {
                2 => assert!(
                    buf.capacity() >= 3000,
                    "the first frame's room was not kept"
                ),
                4 => assert_eq!(buf.capacity(), 0, "the 70 KiB frame's room was kept"),
                _ => {}
            }
            read_frame_into(&mut io, 1 << 20, None, &mut buf)
                .await
                .unwrap();
            assert_eq!(&buf, want, "frame {i}");
        }
        let err = read_frame_into(&mut &stream[..], 100, None, &mut buf)
            .await
            .unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::InvalidData, "{err}");
        let cut = &stream[..4 + 1000];
        let err = read_frame_into(&mut &cut[..], 1 << 20, None, &mut buf)
            .await
            .unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::UnexpectedEof, "{err}");
    }
}
