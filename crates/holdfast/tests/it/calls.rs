//! The `Calls` stream from outside, with a raw gRPC client: a call on it means what the unary call
//! means (replies in the order calls finish, errors as the unary status), a cancel or the stream's end
//! is a call going away (the server abandons the wait), bad or excess calls are refused alone, and a
//! call that reuses an id in flight ends the stream.

use crate::abandon::raw_session;
use crate::client::until;
use crate::harness::{Cluster, Options};
use holdfast_proto::v1 as pb;
use pb::call_reply::Reply;
use pb::call_request::Call;
use std::time::Duration;
use tokio::sync::mpsc;
use tonic::codegen::tokio_stream::wrappers::UnboundedReceiverStream;

fn three() -> Options {
    Options {
        nodes: 3,
        http: true,
        ..Options::default()
    }
}

struct RawStream {
    tx: mpsc::UnboundedSender<pb::CallRequest>,
    replies: tonic::Streaming<pb::CallReply>,
}

impl RawStream {
    async fn open(
        raw: &mut pb::holdfast_client::HoldfastClient<tonic::transport::Channel>,
    ) -> Self {
        let (tx, rx) = mpsc::unbounded_channel();
        let replies = raw
            .calls(UnboundedReceiverStream::new(rx))
            .await
            .expect("the leader serves Calls")
            .into_inner();
        RawStream { tx, replies }
    }

    fn send(&self, id: u64, call: Option<Call>) {
        self.tx.send(pb::CallRequest { id, call }).unwrap();
    }

    async fn next(&mut self) -> pb::CallReply {
        tokio::time::timeout(Duration::from_secs(10), self.replies.message())
            .await
            .expect("a reply within 10 s")
            .expect("the stream is healthy")
            .expect("the stream is open")
    }
}

fn acquire(session: u64, secret: &[u8], request_id: u64, name: &str, wait_ms: u64) -> Call {
    Call::Acquire(pb::AcquireRequest {
        group: 0,
        session_id: session,
        request_id,
        name: name.into(),
        wait_timeout_ms: wait_ms,
        value: vec![],
        client_cancels: false,
        session_secret: secret.to_vec(),
        lock_delay_ms: 0,
        shared: false,
        permits: 0,
    })
}

fn release(session: u64, secret: &[u8], request_id: u64, name: &str, token: u64) -> Call {
    Call::Release(pb::ReleaseRequest {
        group: 0,
        session_id: session,
        request_id,
        name: name.into(),
        token,
        session_secret: secret.to_vec(),
    })
}

/// The error a reply carries, with its reason.
fn error(reply: &pb::CallReply) -> (i32, pb::Reason) {
    use prost::Message;
    match &reply.reply {
        Some(Reply::Error(e)) => {
            let detail = pb::ErrorDetail::decode(e.details.as_slice()).expect("an ErrorDetail");
            (e.code, pb::Reason::try_from(detail.reason).unwrap())
        }
        other => panic!("expected an error, got {other:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn calls_on_a_stream_answer_as_unary_calls_and_a_cancel_abandons_a_wait() {
    let c = Cluster::start(three()).await;
    let leader = c.wait_for_leader(0, Duration::from_secs(10)).await;
    let client = c.client().await;
    let a = client.open_session(Duration::from_secs(10)).await.unwrap();
    let held = a.try_acquire("y").await.unwrap();
    let mut raw = c.raw(leader).await;
    let (b, secret) = raw_session(&mut raw, 120_000, 11).await;
    let mut s = RawStream::open(&mut raw).await;

    // A grant, then a wait that stays in flight while a later call is answered first.
    s.send(1, Some(acquire(b, &secret, 1, "x", 0)));
    let first = s.next().await;
    assert_eq!(first.id, 1);
    let Some(Reply::Acquire(granted)) = first.reply else {
        panic!("expected a grant: {first:?}")
    };
    assert!(granted.token > 0);
    s.send(2, Some(acquire(b, &secret, 2, "y", 60_000)));
    until(&client, "y", "waited for by B", |l| {
        l.is_some_and(|l| l.waiters.len() == 1)
    })
    .await;
    s.send(3, Some(release(b, &secret, 3, "x", granted.token)));
    let third = s.next().await;
    assert_eq!(
        third.id, 3,
        "the release is answered while the wait goes on"
    );
    assert!(matches!(third.reply, Some(Reply::Release(_))), "{third:?}");
    until(&client, "x", "released", |l| l.is_none()).await;

    // Errors come back as the unary call's status, one call at a time.
    s.send(4, Some(release(b, &secret, 4, "x", granted.token)));
    let (code, reason) = error(&s.next().await);
    assert_eq!(code, tonic::Code::FailedPrecondition as i32);
    assert_eq!(reason, pb::Reason::NotHolder);
    s.send(5, None);
    let reply = s.next().await;
    assert_eq!(reply.id, 5);
    assert_eq!(error(&reply).1, pb::Reason::InvalidArgument);
    // Cancelling the wait is its call going away: the server abandons it, and it is never answered.
    s.send(2, Some(Call::Cancel(pb::CallCancel {})));
    until(&client, "y", "rid of the cancelled wait", |l| {
        l.is_some_and(|l| l.waiters.is_empty())
    })
    .await;
    let m = c.metrics(leader).await;
    assert_eq!(
        m.get("holdfast_acquires_abandoned_total{group=\"0\"}"),
        Some(&1),
        "{m:?}"
    );
    // This one and the client library's (A's acquire went on it).
    assert_eq!(m.get("holdfast_call_streams"), Some(&2), "{m:?}");
    s.send(7, Some(release(b, &secret, 7, "y", 1)));
    let reply = s.next().await;
    assert_eq!(reply.id, 7, "no reply for the cancelled call");

    // A second call under the id of a call in flight ends the stream, and the call in flight with it
    // (a refusal under that id could pass for the first call's answer): the wait is abandoned, and
    // the second call changed nothing.
    s.send(8, Some(acquire(b, &secret, 8, "y", 60_000)));
    until(&client, "y", "waited for by B again", |l| {
        l.is_some_and(|l| l.waiters.len() == 1)
    })
    .await;
    s.send(8, Some(acquire(b, &secret, 9, "z", 0)));
    let ended = tokio::time::timeout(Duration::from_secs(10), s.replies.message())
        .await
        .expect("the stream ends within 10 s")
        .expect_err("the stream ends with an error");
    assert_eq!(ended.code(), tonic::Code::InvalidArgument, "{ended:?}");
    until(&client, "y", "rid of the ended stream's wait", |l| {
        l.is_some_and(|l| l.waiters.is_empty())
    })
    .await;
    until(&client, "z", "left alone by the second call", |l| {
        l.is_none()
    })
    .await;
    let m = c.metrics(leader).await;
    assert_eq!(
        m.get("holdfast_acquires_abandoned_total{group=\"0\"}"),
        Some(&2),
        "{m:?}"
    );
    held.release().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_calls_stream_that_ends_abandons_its_waits_and_caps_its_calls_in_flight() {
    let c = Cluster::start(three()).await;
    let leader = c.wait_for_leader(0, Duration::from_secs(10)).await;
    let client = c.client().await;
    let a = client.open_session(Duration::from_secs(10)).await.unwrap();
    let mut raw = c.raw(leader).await;
    // 64 sessions with 16 calls in flight each: no more than a session's dedup window.
    let mut waiters = Vec::new();
    for n in 0..64 {
        waiters.push(raw_session(&mut raw, 120_000, 100 + n).await);
    }
    let max = holdfast_server::calls::MAX_CALLS_PER_STREAM as u64;

    // Fill the stream with waits: one per lock, each lock held by A.
    let mut held = Vec::new();
    for i in 0..max {
        held.push(a.try_acquire(&format!("q/{i}")).await.unwrap());
    }
    let streams_before = c
        .metrics(leader)
        .await
        .get("holdfast_call_streams")
        .copied();
    let mut s = RawStream::open(&mut raw).await;
    for i in 0..max {
        let (b, secret) = &waiters[(i % 64) as usize];
        let name = format!("q/{i}");
        s.send(i + 1, Some(acquire(*b, secret, i / 64 + 1, &name, 60_000)));
    }
    until(&client, &format!("q/{}", max - 1), "waited for", |l| {
        l.is_some_and(|l| l.waiters.len() == 1)
    })
    .await;
    let (b, secret) = &waiters[0];
    s.send(max + 1, Some(acquire(*b, secret, 17, "free", 0)));
    let reply = s.next().await;
    assert_eq!(reply.id, max + 1, "{reply:?}");
    let (code, reason) = error(&reply);
    assert_eq!(code, tonic::Code::ResourceExhausted as i32);
    assert_eq!(reason, pb::Reason::LimitExceeded);
    until(&client, "free", "left alone by the refused call", |l| {
        l.is_none()
    })
    .await;

    // Another stream on the same connection shares its count: no call goes in while the first
    // holds the connection's 1,024.
    assert_eq!(
        holdfast_server::calls::MAX_CALLS_PER_CONNECTION as u64,
        max,
        "the first stream fills the connection's count too"
    );
    let mut s2 = RawStream::open(&mut raw).await;
    s2.send(1, Some(acquire(*b, secret, 18, "free", 0)));
    let reply = s2.next().await;
    let (code, reason) = error(&reply);
    assert_eq!(code, tonic::Code::ResourceExhausted as i32);
    assert_eq!(reason, pb::Reason::LimitExceeded);
    let Some(Reply::Error(e)) = &reply.reply else {
        unreachable!("checked above")
    };
    let detail = <pb::ErrorDetail as prost::Message>::decode(e.details.as_slice()).unwrap();
    assert_eq!(detail.limit, "max_calls_per_connection", "{detail:?}");
    // A cancel frees its place at once: a call sent right after it, at the limit, goes in (here a
    // try of a held lock, answered LOCK_HELD rather than LIMIT_EXCEEDED).
    s.send(1, Some(Call::Cancel(pb::CallCancel {})));
    s.send(max + 2, Some(acquire(*b, secret, 20, "q/1", 0)));
    let reply = s.next().await;
    assert_eq!(reply.id, max + 2, "{reply:?}");
    assert_eq!(error(&reply).1, pb::Reason::LockHeld, "{reply:?}");

    // The client goes away: every wait in flight is abandoned by the server.
    drop(s);
    for i in [0, max / 2, max - 1] {
        until(&client, &format!("q/{i}"), "rid of the wait", |l| {
            l.is_some_and(|l| l.waiters.is_empty())
        })
        .await;
    }
    // Their count left the connection's with them: the other stream's calls go in again.
    s2.send(2, Some(acquire(*b, secret, 19, "free", 0)));
    let reply = s2.next().await;
    assert!(matches!(reply.reply, Some(Reply::Acquire(_))), "{reply:?}");
    drop(s2);
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    loop {
        let m = c.metrics(leader).await;
        if m.get("holdfast_acquires_abandoned_total{group=\"0\"}") == Some(&max)
            && m.get("holdfast_call_streams").copied() == streams_before
        {
            break;
        }
        assert!(std::time::Instant::now() < deadline, "{m:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Against servers older than the stream (hidden flag `--compat-no-call-streams`: `Calls` answers
/// UNIMPLEMENTED), the client sends its acquires and releases as unary calls, and nothing is lost or
/// done twice on the way: the first acquire, sent on the stream before the client knew, is resent.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_falls_back_to_unary_calls_against_servers_without_the_stream() {
    let c = Cluster::start(Options {
        server_args: vec!["--compat-no-call-streams".into()],
        ..three()
    })
    .await;
    let leader = c.wait_for_leader(0, Duration::from_secs(10)).await;
    let client = c.client().await;
    let s = client.open_session(Duration::from_secs(10)).await.unwrap();
    let proposals = "holdfast_proposals_total{group=\"0\"}";
    let before = c.metrics(leader).await[proposals];
    let mut last = 0;
    for i in 0..20 {
        let g = s.acquire(&format!("old/{}", i % 3)).await.unwrap();
        assert!(g.token() > last, "tokens increase");
        last = g.token();
        g.release().await.unwrap();
    }
    for i in 0..3 {
        until(&client, &format!("old/{i}"), "free", |l| l.is_none()).await;
    }
    let m = c.metrics(leader).await;
    assert_eq!(m.get("holdfast_call_streams"), Some(&0), "{m:?}");
    // 20 acquires and 20 releases, each proposed once.
    assert_eq!(m[proposals] - before, 40, "{m:?}");
}

/// Against current servers a client carries its calls on a connection of its own to each server;
/// against servers that do not take such connections (hidden flag `--compat-no-raw-calls`, as a
/// server older than them), on the gRPC stream. Both carry every call once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_carries_calls_on_a_connection_of_its_own_or_on_the_grpc_stream_of_older_servers()
{
    for (args, raw) in [
        (vec![], true),
        (vec!["--compat-no-raw-calls".to_string()], false),
    ] {
        let c = Cluster::start(Options {
            server_args: args.clone(),
            ..three()
        })
        .await;
        let leader = c.wait_for_leader(0, Duration::from_secs(10)).await;
        let client = c.client().await;
        let s = client.open_session(Duration::from_secs(10)).await.unwrap();
        let proposals = "holdfast_proposals_total{group=\"0\"}";
        let before = c.metrics(leader).await[proposals];
        for i in 0..10 {
            let g = s.acquire(&format!("conn/{}", i % 3)).await.unwrap();
            g.release().await.unwrap();
        }
        let m = c.metrics(leader).await;
        // One, unless the client had to open it again.
        let connections = m["holdfast_call_connections_total"];
        assert_eq!(connections > 0, raw, "{args:?}: {m:?}");
        assert_eq!(m.get("holdfast_call_streams"), Some(&1), "{args:?}: {m:?}");
        // 10 acquires and 10 releases, each proposed once.
        assert_eq!(m[proposals] - before, 20, "{args:?}: {m:?}");
    }
}

/// A keepalive sent as a call on the stream (`CallRequest.keep_alive`) is answered at once with what a
/// `KeepAlive` call answers: compact TTLs (0 for a session not alive), packed secrets taken, a wrong
/// secret refused for its group and nothing renewed. It is not a call in flight: a cancel of its id is
/// nothing, and the id may be used again at once. A server older than these calls (hidden flag
/// `--compat-no-keepalive-calls`) refuses it as a message without a call it knows, INVALID_ARGUMENT,
/// and the stream goes on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keepalives_are_taken_as_calls_on_the_stream_or_refused_by_older_servers() {
    for (args, served) in [
        (vec![], true),
        (vec!["--compat-no-keepalive-calls".to_string()], false),
    ] {
        let c = Cluster::start(Options {
            server_args: args.clone(),
            ..three()
        })
        .await;
        let leader = c.wait_for_leader(0, Duration::from_secs(10)).await;
        let mut raw = c.raw(leader).await;
        let (a, secret) = raw_session(&mut raw, 7_000, 31).await;
        let mut s = RawStream::open(&mut raw).await;
        let keep_alive = |packed: &[u8]| {
            Some(Call::KeepAlive(pb::KeepAliveRequest {
                groups: vec![pb::GroupKeepAlive {
                    group: 0,
                    session_ids: vec![a, 999_999],
                    packed_secrets: packed.to_vec().into(),
                    ..Default::default()
                }],
                compact: true,
                ..Default::default()
            }))
        };
        let packed = [secret.clone(), vec![0; 16]].concat();
        s.send(1, keep_alive(&packed));
        let reply = s.next().await;
        assert_eq!(reply.id, 1);
        if !served {
            assert_eq!(
                error(&reply),
                (
                    tonic::Code::InvalidArgument as i32,
                    pb::Reason::InvalidArgument
                ),
                "{args:?}"
            );
            s.send(2, Some(Call::Ping(pb::CallPing {})));
            let pong = s.next().await;
            assert_eq!(pong.reply, Some(Reply::Pong(pb::CallPing {})), "{args:?}");
            let m = c.metrics(leader).await;
            assert_eq!(m.get("holdfast_keepalive_calls_total"), Some(&0), "{m:?}");
            continue;
        }
        let answered = |reply: pb::CallReply| match reply.reply {
            Some(Reply::KeepAlive(r)) => r,
            other => panic!("expected a keepalive answer: {other:?}"),
        };
        let r = answered(reply);
        assert!(r.compact, "{r:?}");
        assert_eq!(r.groups[0].code, 0, "{r:?}");
        assert_eq!(r.groups[0].ttl_ms, vec![7_000, 0]);

        let mut wrong = packed.clone();
        wrong[3] ^= 1;
        s.send(2, keep_alive(&wrong));
        let reply = s.next().await;
        assert_eq!(reply.id, 2);
        let r = answered(reply);
        assert_eq!(
            tonic::Code::from(r.groups[0].code),
            tonic::Code::PermissionDenied,
            "{r:?}"
        );
        assert!(r.groups[0].ttl_ms.is_empty(), "{r:?}");

        // Not in flight: the cancel is nothing, and id 2 is taken again.
        s.send(2, Some(Call::Cancel(pb::CallCancel {})));
        s.send(2, keep_alive(&packed));
        let reply = s.next().await;
        assert_eq!(reply.id, 2);
        assert_eq!(answered(reply).groups[0].ttl_ms, vec![7_000, 0]);
        let m = c.metrics(leader).await;
        assert_eq!(m.get("holdfast_keepalive_calls_total"), Some(&3), "{m:?}");
        assert_eq!(m.get("holdfast_call_streams"), Some(&1), "{m:?}");
    }
}

/// Sends a `Calls` connection's hello (`holdfast_server::raw_calls`) with `authorization` (empty: none)
/// and reads the answer: its status byte (0: taken).
pub(crate) async fn calls_hello<IO>(io: &mut IO, version: u32, authorization: &str) -> u8
where
    IO: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + ?Sized,
{
    use holdfast_server::raw_calls::{PREFACE, VERSION};
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut hello = PREFACE.to_vec();
    hello.extend_from_slice(&version.to_le_bytes());
    hello.extend_from_slice(&(authorization.len() as u32).to_le_bytes());
    hello.extend_from_slice(authorization.as_bytes());
    io.write_all(&hello).await.unwrap();
    io.flush().await.unwrap();
    let mut answer = [0u8; 13];
    tokio::time::timeout(Duration::from_secs(10), io.read_exact(&mut answer))
        .await
        .expect("an answer within 10 s")
        .unwrap();
    assert_eq!(&answer[..8], PREFACE);
    assert_eq!(
        u32::from_le_bytes(answer[8..12].try_into().unwrap()),
        VERSION
    );
    answer[12]
}

/// A `Calls` connection (`holdfast_server::raw_calls`) spoken byte by byte: the hello and its answer,
/// calls and their replies as frames, a ping answered, the connection's close abandoning its wait, and
/// a frame over the limit or an unknown version closing the connection.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_calls_connection_carries_frames_and_closes_one_it_cannot_read() {
    use holdfast_server::raw_calls::VERSION;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    async fn hello(addr: &str, version: u32) -> (tokio::net::TcpStream, u8) {
        let mut conn = tokio::net::TcpStream::connect(addr).await.unwrap();
        let status = calls_hello(&mut conn, version, "").await;
        (conn, status)
    }
    async fn send(conn: &mut tokio::net::TcpStream, id: u64, call: Call) {
        let mut out = Vec::new();
        holdfast_proto::frames::encode(
            &pb::CallRequest {
                id,
                call: Some(call),
            },
            &mut out,
        );
        conn.write_all(&out).await.unwrap();
    }
    async fn next(conn: &mut tokio::net::TcpStream) -> pb::CallReply {
        let mut len = [0u8; 4];
        tokio::time::timeout(Duration::from_secs(10), conn.read_exact(&mut len))
            .await
            .expect("a reply within 10 s")
            .unwrap();
        let mut body = vec![0; u32::from_le_bytes(len) as usize];
        conn.read_exact(&mut body).await.unwrap();
        <pb::CallReply as prost::Message>::decode(body.as_slice()).unwrap()
    }
    async fn closed(conn: &mut tokio::net::TcpStream) {
        let mut buf = [0u8; 64];
        let n = tokio::time::timeout(Duration::from_secs(10), conn.read(&mut buf))
            .await
            .expect("closed within 10 s");
        assert!(matches!(n, Ok(0) | Err(_)), "{n:?}");
    }

    let c = Cluster::start(three()).await;
    let leader = c.wait_for_leader(0, Duration::from_secs(10)).await;
    let client = c.client().await;
    let a = client.open_session(Duration::from_secs(10)).await.unwrap();
    let held = a.try_acquire("y").await.unwrap();
    let mut raw = c.raw(leader).await;
    let (b, secret) = raw_session(&mut raw, 120_000, 21).await;
    let addr = c.endpoint(leader);
    // The client library's, for A's try.
    let taken_before = c.metrics(leader).await["holdfast_call_connections_total"];
    assert!(taken_before >= 1);

    let (mut conn, status) = hello(&addr, VERSION).await;
    assert_eq!(status, 0, "the connection is taken");
    send(&mut conn, 1, acquire(b, &secret, 1, "x", 0)).await;
    let reply = next(&mut conn).await;
    assert_eq!(reply.id, 1);
    let Some(Reply::Acquire(granted)) = reply.reply else {
        panic!("expected a grant: {reply:?}")
    };
    send(&mut conn, 0, Call::Ping(pb::CallPing {})).await;
    let reply = next(&mut conn).await;
    assert_eq!(
        (reply.id, reply.reply),
        (0, Some(Reply::Pong(pb::CallPing {})))
    );
    // Refusals are the unary call's, and leave the connection open.
    send(&mut conn, 2, release(b, &secret, 2, "x", granted.token + 1)).await;
    let reply = next(&mut conn).await;
    assert_eq!(reply.id, 2);
    assert_eq!(error(&reply).1, pb::Reason::StaleToken, "{reply:?}");
    // A wait in flight when the connection closes is abandoned, as a stream's.
    send(&mut conn, 3, acquire(b, &secret, 3, "y", 60_000)).await;
    until(&client, "y", "waited for by B", |l| {
        l.is_some_and(|l| l.waiters.len() == 1)
    })
    .await;
    drop(conn);
    until(&client, "y", "rid of the closed connection's wait", |l| {
        l.is_some_and(|l| l.waiters.is_empty())
    })
    .await;
    let m = c.metrics(leader).await;
    assert_eq!(
        m.get("holdfast_acquires_abandoned_total{group=\"0\"}"),
        Some(&1),
        "{m:?}"
    );

    // A frame longer than a request may be closes the connection before its bytes are read.
    let (mut conn, _) = hello(&addr, VERSION).await;
    let too_long = (holdfast_server::service::MAX_REQUEST_BYTES + 1) as u32;
    conn.write_all(&too_long.to_le_bytes()).await.unwrap();
    closed(&mut conn).await;
    // A version this server does not speak is answered with its own, refused, and closed.
    let (mut conn, status) = hello(&addr, VERSION + 1).await;
    assert_ne!(status, 0, "a version it does not know is refused");
    closed(&mut conn).await;

    let m = c.metrics(leader).await;
    // The two taken, not the one refused.
    assert_eq!(
        m["holdfast_call_connections_total"],
        taken_before + 2,
        "{m:?}"
    );
    held.release().await.unwrap();
}
