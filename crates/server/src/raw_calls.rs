//! The `Calls` stream over a connection of its own, beside gRPC on the client port.
//!
//! Why: on the gRPC `Calls` stream each call passes through hyper's tasks on both sides (on the
//! client: the caller's channel, the request body's pipe task, the connection task; on the server: the
//! connection task and the stream's task; and the same back), each a thread wake-up and most of the
//! per-call cost left at one client (docs/performance.md, "Calls on connections of their own"). Here
//! the server reads, runs and answers a connection's calls in one task, and the client writes from one
//! task and reads in another.
//!
//! A call here is a call on the gRPC stream ([`crate::calls::CallReplies`] serves both): the same
//! `CallRequest` and `CallReply` messages, the same limits, refusals and cancels, made as by a request
//! carrying the connection's bearer token and TLS peer (so the access policy and quotas see the same
//! caller), and the connection closing is the stream ending (its calls in flight go away). The
//! protocol, on a connection to the client port (over TLS when the server uses TLS):
//! - the client sends [`PREFACE`], the version ([`VERSION`], 4 bytes little-endian), and its
//!   `authorization` value (a 4-byte little-endian length, at most [`MAX_AUTHORIZATION_BYTES`], then
//!   the bytes; length 0 for none);
//! - the server answers [`PREFACE`], its version, and one status byte: 0, the connection carries
//!   calls from now on; anything else (a version it does not speak, a caller the access policy does
//!   not let lock anything, a value that is not a header's), it closes the connection, and the client
//!   uses the gRPC stream, where a refusal is told with its reasons;
//! - then frames both ways (`holdfast_proto::frames`): `CallRequest`s of at most `MAX_REQUEST_BYTES`
//!   from the client, `CallReply`s from the server, replies in the order calls finish. A ping gets a
//!   pong at once: the client pings a connection that has been silent for a while, and closes one
//!   whose ping goes unanswered (the server being gone or cut off).
//!
//! A frame that cannot be read (too long, malformed), or nothing read for [`IDLE_TIMEOUT`], closes the
//! connection; the client port tells these connections from gRPC ones by their first bytes
//! (`holdfast_proto::transport::divert`). A server that predates them (or runs with
//! `--compat-no-raw-calls` or `--compat-no-call-streams`) hands them to its HTTP/2 server, which
//! answers with its own preface and closes them: the client then uses the gRPC stream for a while.

use crate::calls::CallReplies;
use crate::service::{ClientService, MAX_REQUEST_BYTES};
use holdfast_proto::frames::{self, FrameReader};
use holdfast_proto::v1 as pb;
use std::net::SocketAddr;
use std::time::Duration;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tonic::codegen::tokio_stream::StreamExt;
use tonic::metadata::MetadataMap;

/// What a connection of this protocol starts with, and the server's answer too. Differs from
/// HTTP/2's preface in its first byte.
pub const PREFACE: &[u8] = b"HFCALLS\0";
/// The protocol's version, sent by both sides after the preface.
pub const VERSION: u32 = 1;
/// How long an accepted connection may take to send its version and authorization once its preface
/// is read.
pub const HELLO_TIMEOUT: Duration = Duration::from_secs(10);
/// A connection from which nothing is read for this long is closed (a client pings one it uses every
/// few seconds; see `holdfast_client`'s `calls`).
pub const IDLE_TIMEOUT: Duration = Duration::from_secs(60);
/// A write of replies (or the close) that takes longer than this closes the connection: a client that
/// stopped reading does not hold its task, its connection slot and its calls in flight for good.
pub const WRITE_TIMEOUT: Duration = Duration::from_secs(30);
/// The longest `authorization` value a client may send (a bearer token is far shorter).
pub const MAX_AUTHORIZATION_BYTES: usize = 8 << 10;
/// Replies written together at most: more ready than this wait for the next write.
const WRITE_BATCH_BYTES: usize = 64 << 10;

/// Who is at the other end of a connection, as a gRPC request's extensions would say.
pub struct Peer {
    pub addr: Option<SocketAddr>,
    pub tls: Option<holdfast_proto::tls::TlsConnectInfo>,
}

/// Serves one connection whose [`PREFACE`] was read: the rest of its hello, then its calls.
pub async fn serve<IO>(service: ClientService, mut io: IO, peer: Peer)
where
    IO: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let Ok(Ok((version, authorization))) =
        tokio::time::timeout(HELLO_TIMEOUT, read_hello(&mut io)).await
    else {
        return;
    };
    let mut metadata = MetadataMap::new();
    let mut extensions = tonic::codegen::http::Extensions::new();
    let mut accepted = version == VERSION;
    if !authorization.is_empty() {
        match tonic::metadata::MetadataValue::try_from(authorization.as_slice()) {
            Ok(v) => {
                metadata.insert("authorization", v);
            }
            Err(_) => accepted = false,
        }
    }
    if let Some(tls) = peer.tls {
        extensions.insert(tls);
    }
    if accepted {
        // As the gRPC stream's opening is checked (`ClientService::open_calls`).
        let r = tonic::Request::from_parts(metadata.clone(), extensions.clone(), ());
        if let Err(status) = service.allow(&r, crate::access::Need::LockAny) {
            tracing::debug!(%status, "a Calls connection refused; the client will use gRPC");
            accepted = false;
        }
    }
    let mut answer = Vec::with_capacity(PREFACE.len() + 5);
    answer.extend_from_slice(PREFACE);
    answer.extend_from_slice(&VERSION.to_le_bytes());
    answer.push(if accepted { 0 } else { 1 });
    let answered = tokio::time::timeout(WRITE_TIMEOUT, async {
        io.write_all(&answer).await?;
        io.flush().await
    })
    .await;
    if !matches!(answered, Ok(Ok(()))) || !accepted {
        return;
    }
    service.node.metrics.raw_calls.inc();

    let (read, mut write) = tokio::io::split(io);
    let inbound = FrameReader::<_, pb::CallRequest>::new(read, MAX_REQUEST_BYTES)
        .idle(IDLE_TIMEOUT)
        .map(|m| {
            m.map_err(|e| tonic::Status::invalid_argument(format!("the Calls connection: {e}")))
        })
        // The client's end of its side is its going away (its client closes only when dropped): the
        // calls in flight go with it, as on a stream that is reset, not answered as on one it ended.
        .chain(tonic::codegen::tokio_stream::once(Err(
            tonic::Status::cancelled("the client closed the Calls connection"),
        )));
    let mut replies =
        CallReplies::open(service, metadata, extensions, peer.addr, Box::pin(inbound));
    let mut out = Vec::with_capacity(4096);
    loop {
        let reply = match replies.next().await {
            Some(Ok(reply)) => reply,
            None => break,
            Some(Err(status)) => {
                if status.code() == tonic::Code::InvalidArgument {
                    tracing::debug!(%status, "closing a Calls connection");
                }
                break;
            }
        };
        frames::encode(&reply, &mut out);
        // Every reply ready now goes in the same write.
        let mut ended = false;
        while out.len() < WRITE_BATCH_BYTES {
            match futures::FutureExt::now_or_never(replies.next()) {
                Some(Some(Ok(reply))) => frames::encode(&reply, &mut out),
                Some(_) => {
                    ended = true;
                    break;
                }
                None => break,
            }
        }
        // TLS: rustls keeps what it could not write yet until flushed.
        let written = tokio::time::timeout(WRITE_TIMEOUT, async {
            write.write_all(&out).await?;
            write.flush().await
        })
        .await;
        if !matches!(written, Ok(Ok(()))) || ended {
            break;
        }
        out.clear();
    }
    // Dropping the replies drops the calls still in flight: the stream ended.
    drop(replies);
    let _ = tokio::time::timeout(WRITE_TIMEOUT, write.shutdown()).await;
}

/// The version and `authorization` value a client sends after the preface.
async fn read_hello<IO: AsyncRead + Unpin>(io: &mut IO) -> std::io::Result<(u32, Vec<u8>)> {
    let mut head = [0u8; 8];
    io.read_exact(&mut head).await?;
    let version = u32::from_le_bytes(head[..4].try_into().expect("4 bytes"));
    let len = u32::from_le_bytes(head[4..].try_into().expect("4 bytes")) as usize;
    if len > MAX_AUTHORIZATION_BYTES {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            "an authorization value over the limit",
        ));
    }
    let mut authorization = vec![0; len];
    io.read_exact(&mut authorization).await?;
    Ok((version, authorization))
}
