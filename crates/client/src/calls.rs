//! The client's side of the `Calls` stream: acquires and releases sent to one server as messages on
//! one long-lived gRPC stream, instead of a unary call (a new HTTP/2 request) each. The batched
//! keepalives go on it too ([`Calls::keep_alive`], used by [`crate::keepalive`]), and where it cannot
//! carry them they are given back to go on `KeepAliveStream`, not sent as unary calls.
//!
//! One stream per server, shared by every session of the client, opened at the first acquire or
//! release sent there and reopened at the next one after it ends. A call on it means what the unary
//! call means, and fails the same way: a reply carries the status the unary call would have returned,
//! and a stream that ends or breaks fails every call in flight on it as `UNAVAILABLE` without a
//! Holdfast detail, whatever ended it, so [`crate::Client`]'s retries treat it as an unreachable server
//! and retry with the same request id. A call whose caller gives up (a timeout, a dropped future) is
//! cancelled on the stream, which on the server is a unary call going away. A server older than the
//! stream answers UNIMPLEMENTED; the client then uses unary calls to it from then on. A call past
//! [`MAX_IN_FLIGHT`] calls in flight on one stream (the server's limit), or too big for one message,
//! goes as a unary call too (on the stream, an oversized message would end it and fail every call).
//!
//! The stream goes on a connection of its own to the server's client port when the server serves
//! that (`holdfast_server::raw_calls` has the protocol): the same messages, one task writing them and
//! one reading the replies, without HTTP/2's tasks in between. A connection from which nothing was
//! read for [`PING_EVERY`], or to which nothing was written for [`PING_IDLE_WRITES`] (the server
//! closes one it has read nothing from for a minute), is pinged; one whose ping is still unanswered
//! two ticks later, or whose writes stall for [`WRITE_TIMEOUT`], is closed: it ends as a broken
//! stream does. When the connection cannot be had (the server predates it, refuses this caller (over
//! gRPC the refusal comes with its reasons), or the connection failed before its hello was answered)
//! the stream goes over gRPC instead, the calls already sent included; so does every stream to that
//! server for [`RAW_FALLBACK`] (twice as long for each time in a row, up to 16 minutes), after which
//! the next call opens a new stream, on a connection of its own if it can, and the gRPC one ends once
//! its calls in flight are answered.

use crate::client::Rpc;
use holdfast_proto::v1 as pb;
use pb::call_reply::Reply;
use pb::call_request::Call;
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::{mpsc, oneshot};
// The simulation's clock (crates/sim), not the machine's: which transport a stream takes must not
// depend on how fast a run goes.
use tokio::time::Instant;

/// The server's `max_calls_per_stream`: a call beyond this many in flight goes as a unary call.
pub(crate) const MAX_IN_FLIGHT: usize = 1024;

/// The largest message the server decodes (its `MAX_REQUEST_BYTES`). A bigger call goes as a unary
/// call, so that only it fails: on the stream the server would end the stream, and every call on it.
const MAX_MESSAGE_BYTES: usize = 512 << 10;

/// Call ids, unique among every stream of the process (the server needs them unique among one stream's
/// calls in flight): so `scripts/hop-figures` can match a call's events at the client and the server
/// with many clients in one process.
static NEXT_CALL_ID: AtomicU64 = AtomicU64::new(1);

/// A connection for calls from which nothing was read this long gets a ping; one whose ping is still
/// unanswered two of these later is closed (a dead connection found in ~6-8 s; two, so that a pong
/// read by a reader task that a stalled runtime has not run yet is not taken for a dead server).
pub(crate) const PING_EVERY: Duration = Duration::from_secs(2);

/// A connection to which nothing was written this long gets a ping, whatever was read: the server
/// closes a connection from which it reads nothing for 60 s (`raw_calls::IDLE_TIMEOUT`), and a client
/// whose calls are waits being granted one by one reads often and may write nothing.
const PING_IDLE_WRITES: Duration = Duration::from_secs(20);

/// A write to the connection that takes longer than this closes it (the server stopped reading).
const WRITE_TIMEOUT: Duration = Duration::from_secs(6);

/// How long the server may take to answer a connection's hello.
const HELLO_TIMEOUT: Duration = Duration::from_secs(5);

/// How long a server that did not take a connection for calls gets the gRPC stream instead.
pub(crate) const RAW_FALLBACK: Duration = Duration::from_secs(30);

/// The largest reply frame read (a reply is a few hundred bytes; as gRPC's default limit).
const MAX_REPLY_BYTES: usize = 4 << 20;

/// Replies and calls written together at most.
const WRITE_BATCH_BYTES: usize = 64 << 10;

/// The protocol of `holdfast_server::raw_calls`.
const PREFACE: &[u8] = b"HFCALLS\0";
const VERSION: u32 = 1;

/// Where and how to open a connection for calls to one server.
pub(crate) struct RawTarget {
    pub(crate) endpoint: String,
    pub(crate) tls: Option<holdfast_proto::tls::TlsConnector>,
    /// The `authorization` value this client sends (`Bearer TOKEN`), if any.
    pub(crate) authorization: Option<String>,
    /// How long a TCP connection may take to be set up (`ClientOptions::connect_timeout`).
    pub(crate) connect_timeout: Duration,
    /// Until when the server gets the gRPC stream (it did not take a connection), and how many
    /// times in a row it did not.
    grpc_until: Mutex<(Option<Instant>, u32)>,
}

impl RawTarget {
    pub(crate) fn new(
        endpoint: &str,
        tls: Option<holdfast_proto::tls::TlsConnector>,
        authorization: Option<String>,
        connect_timeout: Duration,
    ) -> RawTarget {
        RawTarget {
            endpoint: endpoint.to_string(),
            tls,
            authorization,
            connect_timeout,
            grpc_until: Mutex::new((None, 0)),
        }
    }

    fn usable(&self) -> bool {
        let until = self.grpc_until.lock().expect("raw target lock");
        until.0.is_none_or(|t| Instant::now() >= t)
    }

    /// The server did not take a connection: the gRPC stream for [`RAW_FALLBACK`], twice as long
    /// for each time in a row (up to 32 times: 16 minutes), so that a server whose hellos fail
    /// slowly does not hold up the calls of every new stream each time.
    fn not_taken(&self) {
        let mut until = self.grpc_until.lock().expect("raw target lock");
        let misses = until.1.min(5);
        *until = (
            Some(Instant::now() + RAW_FALLBACK * (1 << misses)),
            misses + 1,
        );
    }

    /// The server took a connection.
    fn taken(&self) {
        self.grpc_until.lock().expect("raw target lock").1 = 0;
    }
}

type Pending = BTreeMap<u64, oneshot::Sender<Result<Reply, tonic::Status>>>;

/// The `Calls` stream to one server, if open.
pub(crate) struct Calls {
    state: Mutex<State>,
    /// Open the stream on a connection of its own to this server when it serves that.
    raw: Option<Arc<RawTarget>>,
}

enum State {
    Closed,
    Open(Arc<Stream>),
    /// Unary calls only: the server answered UNIMPLEMENTED, or this client does not use the stream
    /// ([`crate::ClientOptions::call_streams`]).
    Unary,
}

struct Stream {
    tx: mpsc::UnboundedSender<pb::CallRequest>,
    shared: Arc<Shared>,
}

struct Shared {
    /// The calls awaiting a reply; `None` once the stream ended (a call then opens a new one).
    pending: Mutex<Option<Pending>>,
    /// The server answered the stream's opening: it serves `Calls`.
    confirmed: AtomicBool,
    /// The stream went over gRPC because its connection could not be had: replaced by a new stream
    /// once the server is to be tried again ([`RAW_FALLBACK`]).
    over_grpc_instead: AtomicBool,
}

/// A call sent and not answered yet: dropped before its reply, it cancels the call on the stream.
struct InFlight<'a> {
    stream: &'a Stream,
    id: u64,
    answered: bool,
}

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        if self.answered {
            return;
        }
        let mut pending = self.stream.shared.pending.lock().expect("calls lock");
        if pending
            .as_mut()
            .is_some_and(|p| p.remove(&self.id).is_some())
        {
            // Sent under the lock, so a call that takes this one's place in `pending` is sent after
            // the cancel: the server never counts both against its limit. Unbounded, so a cancel is
            // never lost to a full queue (the in-flight limit bounds it) and sending never blocks.
            let _ = self.stream.tx.send(pb::CallRequest {
                id: self.id,
                call: Some(Call::Cancel(pb::CallCancel {})),
            });
        }
    }
}

impl Calls {
    /// `streams`: use the stream (else every call is unary); `raw`: on a connection of its own.
    pub(crate) fn new(streams: bool, raw: Option<RawTarget>) -> Calls {
        Calls {
            state: Mutex::new(if streams { State::Closed } else { State::Unary }),
            raw: raw.map(Arc::new),
        }
    }

    /// An acquire on the stream (or unary, see the module docs).
    pub(crate) async fn acquire(
        &self,
        rpc: Rpc,
        req: pb::AcquireRequest,
    ) -> Result<tonic::Response<pb::AcquireResponse>, tonic::Status> {
        match self.call(&rpc, Call::Acquire(req)).await {
            Ok(Reply::Acquire(r)) => Ok(tonic::Response::new(r)),
            Ok(_) => Err(mismatched()),
            Err(Fallback::Unary(Call::Acquire(req))) => rpc.clone().acquire(req).await,
            Err(Fallback::Unary(_)) => unreachable!("the call given back is the one sent"),
            Err(Fallback::Failed(status)) => Err(status),
        }
    }

    /// A release on the stream (or unary, see the module docs).
    pub(crate) async fn release(
        &self,
        rpc: Rpc,
        req: pb::ReleaseRequest,
    ) -> Result<tonic::Response<pb::ReleaseResponse>, tonic::Status> {
        match self.call(&rpc, Call::Release(req)).await {
            Ok(Reply::Release(r)) => Ok(tonic::Response::new(r)),
            Ok(_) => Err(mismatched()),
            Err(Fallback::Unary(Call::Release(req))) => rpc.clone().release(req).await,
            Err(Fallback::Unary(_)) => unreachable!("the call given back is the one sent"),
            Err(Fallback::Failed(status)) => Err(status),
        }
    }

    /// A keepalive message as a call on the stream (`CallRequest.keep_alive`; see
    /// [`crate::keepalive`]). `Err` gives the message back, to go on `KeepAliveStream`: this client does
    /// not use the stream, the server does not serve it, or the message is too big for one.
    pub(crate) async fn keep_alive(
        &self,
        rpc: &Rpc,
        req: pb::KeepAliveRequest,
    ) -> Result<Result<pb::KeepAliveResponse, tonic::Status>, pb::KeepAliveRequest> {
        match self.call(rpc, Call::KeepAlive(req)).await {
            Ok(Reply::KeepAlive(r)) => Ok(Ok(r)),
            Ok(_) => Ok(Err(mismatched())),
            Err(Fallback::Unary(Call::KeepAlive(req))) => Err(req),
            Err(Fallback::Unary(_)) => unreachable!("the call given back is the one sent"),
            Err(Fallback::Failed(status)) => Ok(Err(status)),
        }
    }

    /// Sends `call` on the stream and waits for its reply, or gives it back to be sent unary.
    async fn call(&self, rpc: &Rpc, call: Call) -> Result<Reply, Fallback> {
        let size = match &call {
            Call::Acquire(r) => prost::Message::encoded_len(r),
            Call::Release(r) => prost::Message::encoded_len(r),
            Call::KeepAlive(r) => prost::Message::encoded_len(r),
            Call::Cancel(_) | Call::Ping(_) => 0,
        };
        // The call's own bytes, and room for its id and the tags and lengths around it.
        if size + 32 > MAX_MESSAGE_BYTES {
            return Err(Fallback::Unary(call));
        }
        // At most two streams: one found ended when used is replaced once.
        let mut call = Some(call);
        for _ in 0..2 {
            let Some(stream) = self.stream(rpc) else {
                return Err(Fallback::Unary(call.take().expect("call")));
            };
            let id = NEXT_CALL_ID.fetch_add(1, Relaxed);
            let rx = {
                let mut pending = stream.shared.pending.lock().expect("calls lock");
                match pending.as_mut() {
                    None => {
                        drop(pending);
                        self.ended(&stream);
                        continue;
                    }
                    Some(p) if p.len() >= MAX_IN_FLIGHT => {
                        return Err(Fallback::Unary(call.take().expect("call")))
                    }
                    Some(p) => {
                        let (tx, rx) = oneshot::channel();
                        p.insert(id, tx);
                        rx
                    }
                }
            };
            // Until the server has shown it serves the stream, keep a copy to resend unary.
            let copy =
                (!stream.shared.confirmed.load(Relaxed)).then(|| call.clone().expect("call"));
            let mut in_flight = InFlight {
                stream: &stream,
                id,
                answered: false,
            };
            tracing::trace!(target: "holdfast::hop", id, "call sent");
            let sent = stream.tx.send(pb::CallRequest {
                id,
                call: call.take(),
            });
            if let Err(mpsc::error::SendError(m)) = sent {
                // The stream's request side is gone (its call ended): nothing was sent.
                in_flight.answered = true;
                if let Some(p) = stream.shared.pending.lock().expect("calls lock").as_mut() {
                    p.remove(&id);
                }
                self.ended(&stream);
                call = m.call;
                continue;
            }
            let reply = rx.await;
            tracing::trace!(target: "holdfast::hop", id, "call returned");
            in_flight.answered = true;
            return match reply {
                Ok(Ok(reply)) => Ok(reply),
                // The server does not serve the stream (it did nothing with the call): unary from now on.
                Ok(Err(status))
                    if status.code() == tonic::Code::Unimplemented
                        && status.details().is_empty()
                        && copy.is_some() =>
                {
                    self.unsupported();
                    Err(Fallback::Unary(copy.expect("checked")))
                }
                Ok(Err(status)) => Err(Fallback::Failed(status)),
                Err(_) => Err(Fallback::Failed(tonic::Status::unavailable(
                    "the Calls stream ended without answering the call",
                ))),
            };
        }
        Err(Fallback::Failed(tonic::Status::unavailable(
            "the Calls stream to this server ended twice in a row",
        )))
    }

    /// The open stream, opening one if there is none; `None` if the server has none to offer.
    fn stream(&self, rpc: &Rpc) -> Option<Arc<Stream>> {
        let mut state = self.state.lock().expect("calls lock");
        match &*state {
            // A stream that went over gRPC only because its connection could not be had is replaced
            // when the server is to be tried again: it ends once its calls in flight are answered
            // (its sender goes with the last of them).
            State::Open(s)
                if s.shared.over_grpc_instead.load(Relaxed)
                    && self.raw.as_ref().is_some_and(|r| r.usable()) =>
            {
                let s = Arc::new(open(rpc.clone(), self.raw.clone(), false));
                *state = State::Open(s.clone());
                Some(s)
            }
            State::Open(s) => Some(s.clone()),
            State::Unary => None,
            State::Closed => {
                // A stream opened over gRPC while the server is not to be tried is replaced too.
                let raw = self.raw.clone().filter(|r| r.usable());
                let instead = self.raw.is_some() && raw.is_none();
                let s = Arc::new(open(rpc.clone(), raw, instead));
                *state = State::Open(s.clone());
                Some(s)
            }
        }
    }

    /// Forgets `stream` if it is still the open one, so the next call opens another.
    fn ended(&self, stream: &Arc<Stream>) {
        let mut state = self.state.lock().expect("calls lock");
        if matches!(&*state, State::Open(s) if Arc::ptr_eq(s, stream)) {
            *state = State::Closed;
        }
    }

    fn unsupported(&self) {
        *self.state.lock().expect("calls lock") = State::Unary;
    }
}

enum Fallback {
    /// Not sent on a stream: send it as a unary call.
    Unary(Call),
    Failed(tonic::Status),
}

fn mismatched() -> tonic::Status {
    tonic::Status::internal(
        "the server answered a call on the Calls stream with another call's reply",
    )
}

/// Opens a `Calls` stream, on a connection of its own with `raw` (if the server takes it), else over
/// gRPC: the request side is fed from the returned sender; a task reads the replies and hands each to
/// its caller, and when the stream ends fails every call still in flight. `instead`: over gRPC only
/// because the server is not to be tried now (to be replaced when it is).
fn open(rpc: Rpc, raw: Option<Arc<RawTarget>>, instead: bool) -> Stream {
    let (tx, rx) = mpsc::unbounded_channel();
    let shared = Arc::new(Shared {
        pending: Mutex::new(Some(BTreeMap::new())),
        confirmed: AtomicBool::new(false),
        over_grpc_instead: AtomicBool::new(instead),
    });
    let reader = shared.clone();
    tokio::spawn(async move {
        let rx = match raw {
            None => Ok(rx),
            Some(raw) => match raw_stream(&raw, rx, &reader).await {
                RawEnd::Ended(status) => Err(status),
                RawEnd::NotServed(back, why) => {
                    tracing::debug!(
                        endpoint = raw.endpoint,
                        why,
                        "no connection of its own for calls: using the gRPC stream"
                    );
                    raw.not_taken();
                    reader.over_grpc_instead.store(true, Relaxed);
                    Ok(back)
                }
            },
        };
        let end = match rx {
            Ok(rx) => grpc_stream(rpc, rx, &reader).await,
            Err(end) => end,
        };
        let pending = reader.pending.lock().expect("calls lock").take();
        for (_, waiter) in pending.into_iter().flatten() {
            let _ = waiter.send(Err(end.clone()));
        }
    });
    Stream { tx, shared }
}

/// Hands a reply to the call waiting for it (none: the call was cancelled meanwhile).
fn deliver(shared: &Shared, reply: pb::CallReply) {
    tracing::trace!(target: "holdfast::hop", id = reply.id, "call reply");
    let waiter = shared
        .pending
        .lock()
        .expect("calls lock")
        .as_mut()
        .and_then(|p| p.remove(&reply.id));
    if let Some(waiter) = waiter {
        let _ = waiter.send(answer(reply.reply));
    }
}

/// The stream over gRPC, until it ends: the status its calls in flight fail with.
async fn grpc_stream(
    mut rpc: Rpc,
    rx: mpsc::UnboundedReceiver<pb::CallRequest>,
    shared: &Shared,
) -> tonic::Status {
    let replies = match rpc
        .calls(tokio_stream::wrappers::UnboundedReceiverStream::new(rx))
        .await
    {
        Err(status) => return status,
        Ok(replies) => replies,
    };
    shared.confirmed.store(true, Relaxed);
    let mut replies = replies.into_inner();
    loop {
        match replies.message().await {
            Ok(Some(reply)) => deliver(shared, reply),
            Ok(None) => return tonic::Status::unavailable("the server ended the Calls stream"),
            // Whatever ended the stream (a broken connection, or the server refusing one message
            // by ending it), it is not the answer to the calls in flight, whose outcome is
            // unknown: they are retried with their request ids. So no Holdfast detail of the
            // stream's status passes to them.
            Err(status) => {
                return tonic::Status::unavailable(format!(
                    "the Calls stream ended: {}: {}",
                    status.code(),
                    status.message()
                ))
            }
        }
    }
}

/// How a stream on a connection of its own ended.
enum RawEnd {
    /// The connection could not be had (not taken by the server, or failed before its hello was
    /// answered: nothing but the hello was sent on it), and why: the calls queued go to the gRPC
    /// stream.
    NotServed(mpsc::UnboundedReceiver<pb::CallRequest>, String),
    /// It ended after it was taken: the status its calls fail with.
    Ended(tonic::Status),
}

/// The stream on a connection of its own, until it ends.
async fn raw_stream(
    raw: &RawTarget,
    mut rx: mpsc::UnboundedReceiver<pb::CallRequest>,
    shared: &Arc<Shared>,
) -> RawEnd {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let unavailable = |what: String| {
        RawEnd::Ended(tonic::Status::unavailable(format!(
            "the connection for calls to {}: {what}",
            raw.endpoint
        )))
    };
    let mut io = match holdfast_proto::transport::connect_raw_within(
        &raw.endpoint,
        raw.tls.as_ref(),
        raw.connect_timeout,
    )
    .await
    {
        Ok(io) => io,
        Err(e) => return RawEnd::NotServed(rx, format!("cannot connect: {e}")),
    };
    let auth = raw.authorization.as_deref().unwrap_or_default().as_bytes();
    let mut hello = Vec::with_capacity(PREFACE.len() + 8 + auth.len());
    hello.extend_from_slice(PREFACE);
    hello.extend_from_slice(&VERSION.to_le_bytes());
    hello.extend_from_slice(&(auth.len() as u32).to_le_bytes());
    hello.extend_from_slice(auth);
    let mut answer = [0u8; 13];
    let answered = tokio::time::timeout(HELLO_TIMEOUT, async {
        io.write_all(&hello).await?;
        io.flush().await?;
        io.read_exact(&mut answer).await
    })
    .await;
    // Whatever went wrong, nothing but the hello was sent: the calls can go over gRPC. A server that
    // predates these connections answers with its HTTP/2 server's preface, or closes at once.
    match answered {
        Err(_) => {
            return RawEnd::NotServed(rx, format!("no answer to the hello in {HELLO_TIMEOUT:?}"))
        }
        Ok(Err(e)) => return RawEnd::NotServed(rx, format!("the hello failed: {e}")),
        Ok(Ok(_)) if &answer[..PREFACE.len()] != PREFACE => {
            return RawEnd::NotServed(rx, "not answered by this protocol".into())
        }
        Ok(Ok(_)) if answer[12] != 0 => {
            return RawEnd::NotServed(rx, "not taken by the server".into())
        }
        Ok(Ok(_)) => {}
    }
    shared.confirmed.store(true, Relaxed);
    raw.taken();
    let (read, write) = tokio::io::split(io);
    let reads = Arc::new(AtomicU64::new(0));
    let mut reader = tokio::spawn(read_replies(
        holdfast_proto::frames::FrameReader::new(read, MAX_REPLY_BYTES),
        shared.clone(),
        reads.clone(),
    ));
    let end = tokio::select! {
        end = &mut reader => end.unwrap_or_else(|e| format!("its reader failed: {e}")),
        end = write_calls(write, &mut rx, &reads, shared) => {
            reader.abort();
            end
        }
    };
    unavailable(end)
}

/// How many calls await their reply on a stream.
fn in_flight(shared: &Shared) -> usize {
    shared
        .pending
        .lock()
        .expect("calls lock")
        .as_ref()
        .map_or(0, |p| p.len())
}

/// Hands every reply read to its call, until the connection ends: why it ended.
async fn read_replies<R: tokio::io::AsyncRead + Unpin>(
    mut frames: holdfast_proto::frames::FrameReader<R, pb::CallReply>,
    shared: Arc<Shared>,
    reads: Arc<AtomicU64>,
) -> String {
    use tokio_stream::StreamExt;
    loop {
        match frames.next().await {
            Some(Ok(reply)) => {
                reads.fetch_add(1, Relaxed);
                if !matches!(reply.reply, Some(Reply::Pong(_))) {
                    deliver(&shared, reply);
                }
            }
            Some(Err(e)) => return format!("reading failed: {e}"),
            None => return "the server closed it".into(),
        }
    }
}

/// Writes the calls sent, several to a write when they come together, and pings the server when
/// nothing was read for [`PING_EVERY`] or written for [`PING_IDLE_WRITES`], until the connection
/// fails, a ping goes unanswered, or every sender is gone: why.
async fn write_calls<W: tokio::io::AsyncWrite + Unpin>(
    mut write: W,
    rx: &mut mpsc::UnboundedReceiver<pb::CallRequest>,
    reads: &AtomicU64,
    shared: &Shared,
) -> String {
    use tokio::io::AsyncWriteExt;
    let mut out = Vec::with_capacity(4096);
    let mut tick = tokio::time::interval_at(tokio::time::Instant::now() + PING_EVERY, PING_EVERY);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    // The reads counted at the last tick; the ticks since a ping went unanswered (None: none out).
    let (mut seen, mut unanswered) = (0, None::<u32>);
    let mut last_write = Instant::now();
    // The replies read when the last write was made: calls answered since are likely to be
    // followed by their callers' next ones.
    let mut reads_at_write = 0;
    loop {
        tokio::select! {
            m = rx.recv() => {
                let Some(m) = m else {
                    // The client is gone, and no call waits: close.
                    let _ = tokio::time::timeout(WRITE_TIMEOUT, write.shutdown()).await;
                    return "the client closed it".into();
                };
                holdfast_proto::frames::encode(&m, &mut out);
                // With other calls in flight and replies read since the last write, once more after
                // letting the other tasks run: the callers of the calls answered are often a moment
                // from sending their next, and one write for many calls saves a system call and a
                // wake-up of the server each (64 clients on one connection spent three times the
                // system time of the gRPC stream writing each call alone). A lone call is written at
                // once (the yield cost 4-7% at 64 clients on their own connections), and so is one
                // beside waits that nothing was answered of.
                for round in 0..2 {
                    if round == 1 {
                        if out.len() >= WRITE_BATCH_BYTES
                            || reads.load(Relaxed) == reads_at_write
                            || in_flight(shared) <= 1
                        {
                            break;
                        }
                        tokio::task::yield_now().await;
                    }
                    while out.len() < WRITE_BATCH_BYTES {
                        match rx.try_recv() {
                            Ok(m) => holdfast_proto::frames::encode(&m, &mut out),
                            Err(_) => break,
                        }
                    }
                }
            }
            _ = tick.tick() => {
                let now = reads.load(Relaxed);
                let read = now != seen;
                seen = now;
                match unanswered {
                    Some(_) if read => unanswered = None,
                    Some(ticks) if ticks >= 1 => {
                        return format!("no answer to a ping in {:?}", PING_EVERY * 2);
                    }
                    Some(ticks) => {
                        unanswered = Some(ticks + 1);
                        continue;
                    }
                    None => {}
                }
                if read && last_write.elapsed() < PING_IDLE_WRITES {
                    continue;
                }
                unanswered = Some(0);
                holdfast_proto::frames::encode(
                    &pb::CallRequest { id: 0, call: Some(Call::Ping(pb::CallPing {})) },
                    &mut out,
                );
            }
        }
        // TLS: rustls keeps what it could not write yet until flushed.
        let started = Instant::now();
        let written = tokio::time::timeout(WRITE_TIMEOUT, async {
            write.write_all(&out).await?;
            write.flush().await
        })
        .await;
        match written {
            Ok(Ok(())) => {
                out.clear();
                // A write that took ticks (the server slow to read) does not eat a ping's grace.
                if started.elapsed() > PING_EVERY {
                    tick.reset();
                }
                last_write = Instant::now();
                reads_at_write = reads.load(Relaxed);
            }
            Ok(Err(e)) => return format!("writing failed: {e}"),
            Err(_) => return format!("a write stalled for {WRITE_TIMEOUT:?}"),
        }
    }
}

/// A reply as the unary call's result.
fn answer(reply: Option<Reply>) -> Result<Reply, tonic::Status> {
    match reply {
        Some(Reply::Error(e)) => Err(tonic::Status::with_details(
            tonic::Code::from(e.code),
            e.message,
            e.details.into(),
        )),
        Some(reply) => Ok(reply),
        None => Err(tonic::Status::internal(
            "an empty reply on the Calls stream",
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn acquire_with_value(bytes: usize) -> Call {
        Call::Acquire(pb::AcquireRequest {
            value: vec![0; bytes],
            ..Default::default()
        })
    }

    /// A call too big for one message is given back, to go as a unary call, before any stream is
    /// opened for it (on a stream the server would end the stream, and every call in flight on it);
    /// one that fits opens the stream.
    #[tokio::test]
    async fn an_oversized_call_goes_unary_without_touching_the_stream() {
        let rpc = nowhere();
        let calls = Calls::new(true, None);
        match calls
            .call(&rpc, acquire_with_value(MAX_MESSAGE_BYTES))
            .await
        {
            Err(Fallback::Unary(Call::Acquire(r))) => assert_eq!(r.value.len(), MAX_MESSAGE_BYTES),
            _ => panic!("the oversized call was not given back for a unary call"),
        }
        assert!(
            matches!(*calls.state.lock().unwrap(), State::Closed),
            "a stream was opened for it"
        );
        match calls.call(&rpc, acquire_with_value(1024)).await {
            Err(Fallback::Failed(status)) => {
                assert_eq!(status.code(), tonic::Code::Unavailable, "{status:?}")
            }
            _ => panic!("a call that fits was not sent on the stream"),
        }
        assert!(
            matches!(*calls.state.lock().unwrap(), State::Open(_)),
            "no stream was opened for a call that fits"
        );
    }

    fn target(addr: &str) -> RawTarget {
        RawTarget::new(addr, None, None, Duration::from_millis(500))
    }

    fn nowhere() -> Rpc {
        // Nothing listens on port 1: a gRPC stream opened to it fails at once.
        let channel = tonic::transport::Channel::from_static("http://127.0.0.1:1").connect_lazy();
        pb::holdfast_client::HoldfastClient::with_interceptor(
            channel,
            crate::client::Auth::new(None).expect("no token"),
        )
    }

    /// A server that takes the connection and then answers nothing (stopped, or cut off) is found
    /// out by a ping: the call in flight fails UNAVAILABLE, as on a broken stream, and the server
    /// got the call, then the ping.
    #[tokio::test]
    async fn a_server_that_stops_answering_is_found_by_a_ping() {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        use tokio_stream::StreamExt;
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let server = tokio::spawn(async move {
            let (mut io, _) = listener.accept().await.unwrap();
            let mut hello = [0u8; 16];
            io.read_exact(&mut hello).await.unwrap();
            assert_eq!(&hello[..8], PREFACE);
            assert_eq!(&hello[8..], [1, 0, 0, 0, 0, 0, 0, 0], "version 1, no token");
            let mut answer = PREFACE.to_vec();
            answer.extend_from_slice(&VERSION.to_le_bytes());
            answer.push(0);
            io.write_all(&answer).await.unwrap();
            let mut frames =
                holdfast_proto::frames::FrameReader::<_, pb::CallRequest>::new(io, 1 << 20);
            let mut got = Vec::new();
            while let Some(m) = frames.next().await {
                let m = m.expect("a good frame");
                let ping = matches!(m.call, Some(Call::Ping(_)));
                got.push(m);
                if ping {
                    break;
                }
            }
            // Kept open, unanswered, until the client gives up on it.
            assert!(frames.next().await.is_none_or(|r| r.is_err()));
            got
        });
        let calls = Calls::new(true, Some(target(&addr.to_string())));
        match calls.call(&nowhere(), acquire_with_value(10)).await {
            Err(Fallback::Failed(status)) => {
                assert_eq!(status.code(), tonic::Code::Unavailable, "{status:?}");
                assert!(status.message().contains("ping"), "{status:?}");
            }
            _ => panic!("the call on a silent connection did not fail"),
        }
        let got = server.await.unwrap();
        assert!(matches!(got[0].call, Some(Call::Acquire(_))), "{got:?}");
        assert_eq!(got.len(), 2, "{got:?}");
    }

    /// A call whose connection cannot be had goes on the gRPC stream instead, and so do the next
    /// streams to that server for a while: against a server that answers the hello with an HTTP/2
    /// server's preface (one that predates these connections), and against an address where nothing
    /// listens (the connection fails before its hello is answered).
    #[tokio::test]
    async fn a_call_whose_connection_cannot_be_had_goes_on_the_grpc_stream() {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let older = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let older_addr = older.local_addr().unwrap();
        tokio::spawn(async move {
            let (mut io, _) = older.accept().await.unwrap();
            // An empty SETTINGS frame, then a close.
            io.write_all(&[0, 0, 0, 4, 0, 0, 0, 0, 0]).await.unwrap();
            let mut hello = [0u8; 16];
            let _ = io.read_exact(&mut hello).await;
        });
        let closed = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let closed_addr = closed.local_addr().unwrap();
        drop(closed);
        for addr in [older_addr, closed_addr] {
            let calls = Calls::new(true, Some(target(&addr.to_string())));
            match calls.call(&nowhere(), acquire_with_value(10)).await {
                // Sent on the gRPC stream, to nothing.
                Err(Fallback::Failed(status)) => {
                    assert_eq!(status.code(), tonic::Code::Unavailable, "{status:?}");
                    assert!(
                        !status.message().contains("connection for calls"),
                        "{addr}: {status:?}"
                    );
                }
                _ => panic!("{addr}: the call did not go to the gRPC stream"),
            }
            assert!(
                !calls.raw.as_ref().unwrap().usable(),
                "{addr}: the server was not remembered to get the gRPC stream"
            );
        }
    }

    /// A server that did not take a connection gets the gRPC stream for 30 s, twice as long each
    /// time in a row, and 30 s again once it took one.
    #[tokio::test(start_paused = true)]
    async fn a_server_not_taking_connections_is_tried_less_often() {
        let raw = target("127.0.0.1:1");
        assert!(raw.usable());
        for (misses, wait) in [(1, 30), (2, 60), (3, 120)] {
            raw.not_taken();
            tokio::time::advance(Duration::from_secs(wait - 1)).await;
            assert!(!raw.usable(), "{misses} in a row: usable before {wait} s");
            tokio::time::advance(Duration::from_secs(1)).await;
            assert!(raw.usable(), "{misses} in a row: not usable after {wait} s");
        }
        raw.taken();
        raw.not_taken();
        tokio::time::advance(Duration::from_secs(30)).await;
        assert!(
            raw.usable(),
            "the count starts over once a connection was taken"
        );
    }
}
