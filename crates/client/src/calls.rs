//! The client's side of the `Calls` stream: acquires and releases sent to one server as messages on
//! one long-lived gRPC stream, instead of a unary call (a new HTTP/2 request) each.
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

use crate::client::Rpc;
use holdfast_proto::v1 as pb;
use pb::call_reply::Reply;
use pb::call_request::Call;
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex};
use tokio::sync::{mpsc, oneshot};

/// The server's `max_calls_per_stream`: a call beyond this many in flight goes as a unary call.
pub(crate) const MAX_IN_FLIGHT: usize = 1024;

/// The largest message the server decodes (its `MAX_REQUEST_BYTES`). A bigger call goes as a unary
/// call, so that only it fails: on the stream the server would end the stream, and every call on it.
const MAX_MESSAGE_BYTES: usize = 512 << 10;

/// Call ids, unique among every stream of the process (the server needs them unique among one stream's
/// calls in flight): so `scripts/hop-figures` can match a call's events at the client and the server
/// with many clients in one process.
static NEXT_CALL_ID: AtomicU64 = AtomicU64::new(1);

type Pending = BTreeMap<u64, oneshot::Sender<Result<Reply, tonic::Status>>>;

/// The `Calls` stream to one server, if open.
pub(crate) struct Calls {
    state: Mutex<State>,
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
    /// `streams`: use the stream (else every call is unary).
    pub(crate) fn new(streams: bool) -> Calls {
        Calls {
            state: Mutex::new(if streams { State::Closed } else { State::Unary }),
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

    /// Sends `call` on the stream and waits for its reply, or gives it back to be sent unary.
    async fn call(&self, rpc: &Rpc, call: Call) -> Result<Reply, Fallback> {
        let size = match &call {
            Call::Acquire(r) => prost::Message::encoded_len(r),
            Call::Release(r) => prost::Message::encoded_len(r),
            Call::Cancel(_) => 0,
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
            State::Open(s) => Some(s.clone()),
            State::Unary => None,
            State::Closed => {
                let s = Arc::new(open(rpc.clone()));
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

/// Opens a `Calls` stream: the request side is fed from the returned sender; a task reads the replies
/// and hands each to its caller, and when the stream ends fails every call still in flight.
fn open(rpc: Rpc) -> Stream {
    let (tx, rx) = mpsc::unbounded_channel();
    let shared = Arc::new(Shared {
        pending: Mutex::new(Some(BTreeMap::new())),
        confirmed: AtomicBool::new(false),
    });
    let reader = shared.clone();
    tokio::spawn(async move {
        let mut rpc = rpc;
        let end = match rpc
            .calls(tokio_stream::wrappers::UnboundedReceiverStream::new(rx))
            .await
        {
            Err(status) => status,
            Ok(replies) => {
                reader.confirmed.store(true, Relaxed);
                let mut replies = replies.into_inner();
                loop {
                    match replies.message().await {
                        Ok(Some(reply)) => {
                            tracing::trace!(target: "holdfast::hop", id = reply.id, "call reply");
                            let waiter = reader
                                .pending
                                .lock()
                                .expect("calls lock")
                                .as_mut()
                                .and_then(|p| p.remove(&reply.id));
                            // No waiter: the call was cancelled meanwhile.
                            if let Some(waiter) = waiter {
                                let _ = waiter.send(answer(reply.reply));
                            }
                        }
                        Ok(None) => {
                            break tonic::Status::unavailable("the server ended the Calls stream")
                        }
                        // Whatever ended the stream (a broken connection, or the server refusing
                        // one message by ending it), it is not the answer to the calls in flight,
                        // whose outcome is unknown: they are retried with their request ids. So no
                        // Holdfast detail of the stream's status passes to them.
                        Err(status) => {
                            break tonic::Status::unavailable(format!(
                                "the Calls stream ended: {}: {}",
                                status.code(),
                                status.message()
                            ))
                        }
                    }
                }
            }
        };
        let pending = reader.pending.lock().expect("calls lock").take();
        for (_, waiter) in pending.into_iter().flatten() {
            let _ = waiter.send(Err(end.clone()));
        }
    });
    Stream { tx, shared }
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
        // Nothing listens on port 1: a stream opened to it fails at once.
        let channel = tonic::transport::Channel::from_static("http://127.0.0.1:1").connect_lazy();
        let rpc = pb::holdfast_client::HoldfastClient::with_interceptor(
            channel,
            crate::client::Auth::new(None).expect("no token"),
        );
        let calls = Calls::new(true);
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
}
