//! The `Calls` stream: Acquire and Release calls multiplexed on one long-lived gRPC stream.
//!
//! Why: at 64 clients the leader spent a third of its time in the client connections' HTTP/2 work and a
//! fifth in the request handlers' setup (docs/performance.md, "At 64 clients"), most of it paid once per
//! unary call: headers encoded and decoded, an HTTP/2 stream opened and closed, a server task spawned.
//! On a stream a call is one DATA frame each way.
//!
//! A call here *is* the unary call: each message becomes a `tonic::Request` carrying the stream's
//! bearer token and TLS peer (so the access policy and quotas see the same caller) and is handed to the
//! same handler ([`ClientService::acquire`], [`ClientService::release`]). Its future runs inside this
//! stream's task; dropping it is what a unary call going away is, so a `cancel` message, or the stream
//! breaking or being reset, abandons an acquire exactly as before (`server::abandon`). A client that
//! ends its side still gets the answers of the calls in flight. Replies go out in the order the calls
//! finish.
//!
//! A keepalive message on the stream (`CallRequest.keep_alive`) is what a `KeepAliveStream` message is
//! ([`ClientService::keepalive`], checked against the access policy of the moment) and is answered at
//! once, in this stream's task: it is not a call in flight. A server with `--compat-no-keepalive-calls`
//! (or older compat hooks) refuses it as a server older than it does, as a message without a call.
//!
//! Limits: at most [`MAX_CALLS_PER_STREAM`] calls in flight on one stream, and at most
//! [`MAX_CALLS_PER_CONNECTION`] on all the `Calls` streams of one client connection together (one more
//! is refused at once and changes nothing); a message is at most `MAX_REQUEST_BYTES`, as a unary
//! request. A message that reuses the id of a call in flight ends the stream (`INVALID_ARGUMENT`), and
//! with it every call in flight: a refusal sent under that id could not be told from the first call's
//! answer, and a client that took it for one would never learn of a grant made to the call it thinks
//! refused.

use crate::access::Need;
use crate::errors::{invalid, limit};
use crate::service::ClientService;
use futures::stream::{FuturesUnordered, StreamExt};
use holdfast_proto::v1 as pb;
use holdfast_proto::v1::holdfast_server::Holdfast;
use std::collections::{BTreeMap, VecDeque};
use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};
use tokio::sync::oneshot;
use tokio_stream::Stream;
use tonic::metadata::MetadataMap;
use tonic::{Request, Status, Streaming};

/// Most calls in flight on one `Calls` stream. A client with more uses more streams or unary calls.
pub const MAX_CALLS_PER_STREAM: usize = 1024;

/// Most calls in flight on all the `Calls` streams of one client connection together: without it, a
/// connection could open `max_streams_per_connection` streams of [`MAX_CALLS_PER_STREAM`] calls each,
/// a million handler futures, where unary calls stop at `max_streams_per_connection`.
pub const MAX_CALLS_PER_CONNECTION: usize = 1024;

/// Calls in flight on the `Calls` streams of each client connection, by its peer address (the key
/// while the connection is open: the kernel does not reuse the address of an open connection).
pub type ByConnection = std::sync::Arc<std::sync::Mutex<BTreeMap<std::net::SocketAddr, usize>>>;

/// The refusal of a message without a call this server knows (what a server older than a kind of
/// call answers it with). Clients read its first words, "a CallRequest must carry", as "this server
/// does not know the call": keep them.
const NO_CALL: &str = "a CallRequest must carry acquire, release, cancel, ping or keep_alive";

/// Inbound messages taken in one poll before the replies get a turn (then the task wakes itself).
const INBOUND_PER_POLL: usize = 64;

/// The messages of one `Calls` stream: a gRPC stream's, or a connection's of its own
/// (`crate::raw_calls`).
pub type Inbound = Pin<Box<dyn Stream<Item = Result<pb::CallRequest, Status>> + Send>>;

type Running =
    Pin<Box<dyn Future<Output = (u64, Option<Result<pb::call_reply::Reply, Status>>)> + Send>>;

/// The reply stream of one `Calls` RPC; it also drives the calls' futures.
pub struct CallReplies {
    service: ClientService,
    /// None once the client ended its side (the calls in flight still finish and are answered).
    inbound: Option<Inbound>,
    metadata: MetadataMap,
    extensions: tonic::codegen::http::Extensions,
    running: FuturesUnordered<Running>,
    /// The calls in flight: dropping one's sender drops its future (a cancel).
    cancels: BTreeMap<u64, oneshot::Sender<()>>,
    /// Replies decided without running anything (refusals).
    ready: VecDeque<pb::CallReply>,
    /// This stream's connection and the count its calls in flight take part in (none in the
    /// simulation, whose connections have no address: the per-stream limit applies alone there).
    connection: Option<(std::net::SocketAddr, ByConnection)>,
    _open: Open,
}

impl Drop for CallReplies {
    fn drop(&mut self) {
        // The calls in flight end with the stream (cancelled ones left the count already).
        self.ended(self.cancels.len());
    }
}

/// Counts the streams open (the `holdfast_call_streams` gauge).
struct Open(std::sync::Arc<std::sync::atomic::AtomicU64>);

impl Drop for Open {
    fn drop(&mut self) {
        self.0.fetch_sub(1, std::sync::atomic::Ordering::Relaxed);
    }
}

fn error_reply(id: u64, status: Status) -> pb::CallReply {
    pb::CallReply {
        id,
        reply: Some(pb::call_reply::Reply::Error(pb::CallError {
            code: status.code() as i32,
            message: status.message().to_string(),
            details: status.details().to_vec(),
        })),
    }
}

impl CallReplies {
    pub fn new(service: ClientService, r: Request<Streaming<pb::CallRequest>>) -> CallReplies {
        // Each call gets what the access policy reads of its caller (`access::Caller::of`): the bearer
        // token and the TLS peer. Nothing else, so that a call without them allocates no maps.
        let (all_metadata, all_extensions, inbound) = r.into_parts();
        let mut metadata = MetadataMap::new();
        if let Some(token) = all_metadata.get("authorization") {
            metadata.insert("authorization", token.clone());
        }
        let mut extensions = tonic::codegen::http::Extensions::new();
        let mut peer = all_extensions
            .get::<tonic::transport::server::TcpConnectInfo>()
            .and_then(|c| c.remote_addr());
        if let Some(tls) = all_extensions.get::<holdfast_proto::tls::TlsConnectInfo>() {
            peer = peer.or(tls.remote_addr);
            extensions.insert(tls.clone());
        }
        CallReplies::open(service, metadata, extensions, peer, Box::pin(inbound))
    }

    /// The replies to `inbound`'s calls, each call made as by a request with `metadata` and
    /// `extensions` (what the access policy reads of a caller), from the connection at `peer`.
    pub fn open(
        service: ClientService,
        metadata: MetadataMap,
        extensions: tonic::codegen::http::Extensions,
        peer: Option<std::net::SocketAddr>,
        inbound: Inbound,
    ) -> CallReplies {
        let streams = service.node.metrics.call_streams.clone();
        streams.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let connection = peer.map(|addr| (addr, service.node.calls_by_connection.clone()));
        CallReplies {
            service,
            inbound: Some(inbound),
            metadata,
            extensions,
            running: FuturesUnordered::new(),
            cancels: BTreeMap::new(),
            ready: VecDeque::new(),
            connection,
            _open: Open(streams),
        }
    }

    /// `n` calls of this stream ended: they leave the connection's count.
    fn ended(&self, n: usize) {
        let Some((addr, by)) = &self.connection else {
            return;
        };
        if n == 0 {
            return;
        }
        let mut by = by.lock().expect("calls by connection lock");
        if let Some(count) = by.get_mut(addr) {
            *count = count.saturating_sub(n);
            if *count == 0 {
                by.remove(addr);
            }
        }
    }

    /// A keepalive message as a call: what a `KeepAliveStream` message gets, checked against the
    /// access policy of the moment as each of those is, and answered at once (the renewals take no
    /// log entry and no wait). Not a call in flight: a message of up to 10,000 sessions is answered
    /// before the next message is read.
    fn keep_alive(&self, req: pb::KeepAliveRequest) -> Result<pb::KeepAliveResponse, Status> {
        let config = &self.service.node.config;
        // A server older than compact keepalives (or than groups) is older than these calls too.
        if config.compat_no_keepalive_calls
            || config.compat_no_compact_keepalives
            || config.compat_ignore_keepalive_groups
        {
            return Err(invalid(NO_CALL));
        }
        let r = Request::from_parts(self.metadata.clone(), self.extensions.clone(), ());
        self.service.allow(&r, Need::LockAny)?;
        self.service.node.metrics.keepalive_calls.inc();
        self.service.keepalive(req)
    }

    /// Starts, refuses or cancels the call one message carries; an error ends the stream.
    fn take(&mut self, m: pb::CallRequest) -> Result<(), Status> {
        let id = m.id;
        if let Some(pb::call_request::Call::Ping(ping)) = m.call {
            self.ready.push_back(pb::CallReply {
                id,
                reply: Some(pb::call_reply::Reply::Pong(ping)),
            });
            return Ok(());
        }
        if self.cancels.contains_key(&id)
            && !matches!(m.call, Some(pb::call_request::Call::Cancel(_)))
        {
            return Err(invalid(format!(
                "call id {id} is already in flight on this stream: the stream is ended, and its calls in flight with it (a call's id must be unique among the calls in flight)"
            )));
        }
        let call = match m.call {
            Some(pb::call_request::Call::KeepAlive(req)) => {
                let reply = match self.keep_alive(req) {
                    Ok(r) => pb::CallReply {
                        id,
                        reply: Some(pb::call_reply::Reply::KeepAlive(r)),
                    },
                    Err(status) => error_reply(id, status),
                };
                self.ready.push_back(reply);
                return Ok(());
            }
            Some(pb::call_request::Call::Cancel(_)) => {
                // Dropping the sender ends the call's future at its next poll; an id not in flight (it
                // finished, or never was) is nothing to cancel. A cancelled call leaves the connection's
                // count now, as it leaves this stream's: a client that sends a new call right after a
                // cancel, at the limit, must not be refused for the one it cancelled.
                if self.cancels.remove(&id).is_some() {
                    self.ended(1);
                }
                return Ok(());
            }
            None => {
                self.ready.push_back(error_reply(id, invalid(NO_CALL)));
                return Ok(());
            }
            Some(call) => call,
        };
        if self.cancels.len() >= MAX_CALLS_PER_STREAM {
            self.ready.push_back(error_reply(
                id,
                limit(
                    "max_calls_per_stream",
                    MAX_CALLS_PER_STREAM as u64,
                    format!(
                        "{MAX_CALLS_PER_STREAM} calls are in flight on this stream already (max_calls_per_stream): wait for one, or open another stream"
                    ),
                ),
            ));
            return Ok(());
        }
        if let Some((addr, by)) = &self.connection {
            let mut by = by.lock().expect("calls by connection lock");
            let count = by.entry(*addr).or_default();
            if *count >= MAX_CALLS_PER_CONNECTION {
                drop(by);
                self.ready.push_back(error_reply(
                    id,
                    limit(
                        "max_calls_per_connection",
                        MAX_CALLS_PER_CONNECTION as u64,
                        format!(
                            "{MAX_CALLS_PER_CONNECTION} calls are in flight on this connection's Calls streams already (max_calls_per_connection): wait for one"
                        ),
                    ),
                ));
                return Ok(());
            }
            *count += 1;
        }
        tracing::trace!(target: "holdfast::hop", id, "call received");
        let (cancel, cancelled) = oneshot::channel::<()>();
        self.cancels.insert(id, cancel);
        let service = self.service.clone();
        let (metadata, extensions) = (self.metadata.clone(), self.extensions.clone());
        let reply = async move {
            match call {
                pb::call_request::Call::Acquire(r) => service
                    .acquire(Request::from_parts(metadata, extensions, r))
                    .await
                    .map(|r| pb::call_reply::Reply::Acquire(r.into_inner())),
                pb::call_request::Call::Release(r) => service
                    .release(Request::from_parts(metadata, extensions, r))
                    .await
                    .map(|r| pb::call_reply::Reply::Release(r.into_inner())),
                pb::call_request::Call::Cancel(_)
                | pb::call_request::Call::Ping(_)
                | pb::call_request::Call::KeepAlive(_) => {
                    unreachable!("handled above")
                }
            }
        };
        self.running.push(Box::pin(async move {
            // Cancelled first: a call cancelled is never answered, even if its reply is ready too.
            tokio::select! {
                biased;
                _ = cancelled => (id, None),
                reply = reply => (id, Some(reply)),
            }
        }));
        Ok(())
    }
}

impl Stream for CallReplies {
    type Item = Result<pb::CallReply, Status>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        let this = &mut *self;
        let mut taken = 0;
        while let Some(inbound) = this.inbound.as_mut() {
            // Refusals wait in `ready`: a client that sends and does not read stops being read.
            if taken == INBOUND_PER_POLL || this.ready.len() >= INBOUND_PER_POLL {
                cx.waker().wake_by_ref();
                break;
            }
            match Pin::new(inbound).poll_next(cx) {
                Poll::Ready(Some(Ok(m))) => {
                    // A keepalive renews up to 10,000 sessions where it is read: the task yields after
                    // one, so a client cannot hold the thread for many in a row.
                    taken += if matches!(m.call, Some(pb::call_request::Call::KeepAlive(_))) {
                        INBOUND_PER_POLL
                    } else {
                        1
                    };
                    if let Err(status) = this.take(m) {
                        return Poll::Ready(Some(Err(status)));
                    }
                }
                // The client ended its side: answer what is in flight, then end.
                Poll::Ready(None) => this.inbound = None,
                // A malformed message or a broken stream: end it (dropping the calls in flight, which
                // is what a broken unary call is).
                Poll::Ready(Some(Err(status))) => return Poll::Ready(Some(Err(status))),
                Poll::Pending => break,
            }
        }
        if let Some(reply) = this.ready.pop_front() {
            return Poll::Ready(Some(Ok(reply)));
        }
        loop {
            match this.running.poll_next_unpin(cx) {
                Poll::Ready(Some((id, Some(reply)))) => {
                    tracing::trace!(target: "holdfast::hop", id, "call answered");
                    if this.cancels.remove(&id).is_some() {
                        this.ended(1);
                    }
                    let reply = match reply {
                        Ok(reply) => pb::CallReply {
                            id,
                            reply: Some(reply),
                        },
                        Err(status) => error_reply(id, status),
                    };
                    return Poll::Ready(Some(Ok(reply)));
                }
                // Cancelled: its id left `cancels` and the count when the cancel arrived.
                Poll::Ready(Some((_, None))) => continue,
                Poll::Ready(None) if this.inbound.is_none() => return Poll::Ready(None),
                Poll::Ready(None) | Poll::Pending => return Poll::Pending,
            }
        }
    }
}

impl ClientService {
    /// Opens a `Calls` stream (see the module docs).
    pub fn open_calls(
        &self,
        r: Request<Streaming<pb::CallRequest>>,
    ) -> Result<CallReplies, Status> {
        if self.node.config.compat_no_call_streams {
            return Err(Status::unimplemented(
                "Calls is not served (--compat-no-call-streams)",
            ));
        }
        self.allow(&r, Need::LockAny)?;
        Ok(CallReplies::new(self.clone(), r))
    }
}
