//! Acquires whose caller went away before it learned the outcome.
//!
//! A queued acquire keeps its place in the replicated table whether or not anybody still waits for the
//! answer, and the grant it later receives would leave a holder that never learns it holds the lock (its
//! process goes on renewing the session, so the lock is stuck). So every `Acquire` call is *attached* here
//! while its handler runs ([`Calls::attach`] returns a [`Call`]). If the handler is dropped before it
//! answered (the client cancelled the call or reset its stream, or the connection closed), the server
//! proposes `AbandonAcquire` for it: the wait is removed, or the grant released. When this server no longer
//! leads the group, it forwards the abandon to the leader's `CancelAcquire`, and keeps trying until the
//! abandon is applied, the session is gone, or this server stops. A client that sets
//! `AcquireRequest.client_cancels` takes this duty itself (the Rust client does, so that an attempt that
//! timed out keeps its place in the queue when retried). docs/api.md gives the whole argument.
//!
//! Invariant: on one server, an abandon of (session, request) and an acquire call for the same pair never
//! overlap. A call that arrives while the abandon is in flight waits for it (and then finds its request
//! abandoned); an abandon that finds a call attached is skipped, because that call will answer, or abandon
//! in turn when it is dropped. Without this, a client's retry on a new connection could be answered with a
//! grant that the abandon of its first attempt releases a moment later.

use crate::errors;
use crate::group::{Group, ProposeError};
use crate::node::NodeShared;
use holdfast_lock_table::{Command, LockName, Outcome, Refusal, RequestId, SessionId};
use holdfast_proto::v1 as pb;
use std::collections::{HashMap, HashSet};
use std::sync::atomic::Ordering::Relaxed;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::Notify;
use tokio::time::Instant;

type Key = (SessionId, RequestId);

/// Longest an acquire call waits for an abandon of the same request on this server before it answers
/// UNAVAILABLE (the client retries with the same id). An abandon takes one commit; this is the proposal
/// timeout with room to spare.
const ABANDON_WAIT: Duration = Duration::from_secs(10);

/// Backoff between attempts of an abandon that could not be applied yet (no leader, no quorum).
const RETRY_FIRST: Duration = Duration::from_millis(50);
const RETRY_MAX: Duration = Duration::from_secs(2);

/// One forwarded attempt against the leader.
const FORWARD_TIMEOUT: Duration = Duration::from_secs(3);

/// The acquire calls attached on this server, and the abandons in flight, of one group.
#[derive(Default)]
pub struct Calls {
    inner: Mutex<Inner>,
    abandoned: Notify,
}

#[derive(Default)]
struct Inner {
    attached: HashMap<Key, u32>,
    abandoning: HashSet<Key>,
}

/// What happens when an attached call is dropped before it answered.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OnDrop {
    /// Abandon the acquire through the log (the default for any client).
    Abandon,
    /// Only detach: the client said it cancels by itself (`AcquireRequest.client_cancels`), retrying with
    /// the same request id after a failed attempt and sending `CancelAcquire` when it gives up.
    Detach,
}

/// An attached acquire call. Call [`Call::answered`] just before the handler returns its result; dropped
/// without it, the acquire is abandoned through the log (unless [`OnDrop::Detach`]).
pub struct Call {
    node: Arc<NodeShared>,
    group: u32,
    key: Key,
    name: LockName,
    on_drop: OnDrop,
    answered: bool,
}

impl Calls {
    /// Attaches a call for (session, request), first waiting for an abandon of the same pair to finish.
    pub async fn attach(
        node: &Arc<NodeShared>,
        group: &Group,
        session: SessionId,
        request: RequestId,
        name: &LockName,
        on_drop: OnDrop,
    ) -> Result<Call, tonic::Status> {
        let calls = &group.calls;
        let key = (session, request);
        let give_up = Instant::now() + ABANDON_WAIT;
        loop {
            // Created before the check, so an abandon that ends between the check and the wait wakes it.
            let ended = calls.abandoned.notified();
            {
                let mut inner = calls.inner.lock().expect("calls lock");
                if !inner.abandoning.contains(&key) {
                    *inner.attached.entry(key).or_default() += 1;
                    break;
                }
            }
            if tokio::time::timeout_at(give_up, ended).await.is_err() {
                return Err(errors::unavailable(
                    "an abandon of this request is still in flight; retry with the same request id",
                ));
            }
        }
        Ok(Call {
            node: node.clone(),
            group: group.id,
            key,
            name: name.clone(),
            on_drop,
            answered: false,
        })
    }

    fn detach(&self, key: Key) {
        let mut inner = self.inner.lock().expect("calls lock");
        if let Some(n) = inner.attached.get_mut(&key) {
            *n -= 1;
            if *n == 0 {
                inner.attached.remove(&key);
            }
        }
    }

    /// Starts an abandon of `key` unless a call for it is attached (that call is responsible now) or an
    /// abandon of it is already in flight. True if the caller must run the abandon and then call
    /// [`Calls::end_abandon`].
    fn begin_abandon(&self, key: Key) -> bool {
        let mut inner = self.inner.lock().expect("calls lock");
        !inner.attached.contains_key(&key) && inner.abandoning.insert(key)
    }

    fn end_abandon(&self, key: Key) {
        self.inner
            .lock()
            .expect("calls lock")
            .abandoning
            .remove(&key);
        self.abandoned.notify_waiters();
    }
}

impl Call {
    /// The handler produced its answer: nothing to abandon.
    pub fn answered(mut self) {
        self.answered = true;
    }
}

impl Drop for Call {
    fn drop(&mut self) {
        let Some(group) = self.node.groups.get(self.group as usize).cloned() else {
            return;
        };
        // Detach first: the abandon below must not see this very call as the one responsible.
        group.calls.detach(self.key);
        if self.answered || self.on_drop == OnDrop::Detach {
            return;
        }
        if let Ok(rt) = tokio::runtime::Handle::try_current() {
            let (node, key, name) = (self.node.clone(), self.key, self.name.clone());
            rt.spawn(async move { abandon(&node, &group, key.0, key.1, name).await });
        }
    }
}

/// What an abandon came to.
#[derive(Debug, PartialEq, Eq)]
pub enum Abandoned {
    /// The abandon is applied (or the session is gone, which holds and waits for nothing).
    Done,
    /// A call for the same request is attached on this server; it answers or abandons in turn.
    Skipped,
}

/// Abandons one acquire from this server, retrying until it is applied, the session is gone, or this
/// server stops (it then holds no lock, and its own callers' connections are closed with it).
pub async fn abandon(
    node: &Arc<NodeShared>,
    group: &Arc<Group>,
    session: SessionId,
    request: RequestId,
    name: LockName,
) {
    if !group.calls.begin_abandon((session, request)) {
        return;
    }
    let mut backoff = RETRY_FIRST;
    loop {
        match propose(group, session, request, &name).await {
            Ok(_) => break,
            Err(ProposeError::NotLeader(Some(leader))) if leader != node.config.node_id => {
                match forward(node, leader, group.id, session, request, &name).await {
                    Ok(()) => break,
                    Err(e) => {
                        tracing::debug!(group = group.id, session = session.0, %e, "forwarding an abandon failed; retrying")
                    }
                }
            }
            Err(ProposeError::Stopped(_)) => break,
            Err(e) => {
                tracing::debug!(
                    group = group.id,
                    session = session.0,
                    ?e,
                    "abandon not applied yet; retrying"
                )
            }
        }
        if session_gone(group, session) {
            break;
        }
        tokio::time::sleep(backoff).await;
        backoff = (backoff * 2).min(RETRY_MAX);
    }
    group.calls.end_abandon((session, request));
}

/// Proposes the abandon here (this server must lead the group).
async fn propose(
    group: &Group,
    session: SessionId,
    request: RequestId,
    name: &LockName,
) -> Result<Outcome, ProposeError> {
    let outcome = group
        .propose(Command::AbandonAcquire {
            session,
            request,
            name: name.clone(),
            now_ms: crate::now_ms(),
        })
        .await?;
    group.metrics.abandons.fetch_add(1, Relaxed);
    tracing::debug!(
        group = group.id,
        session = session.0,
        request = request.0,
        name = name.as_str(),
        ?outcome,
        "acquire abandoned"
    );
    Ok(outcome)
}

/// The `CancelAcquire` RPC on this server: skipped if a call for the request is attached here, otherwise
/// proposed here (NOT_LEADER when this server does not lead: the caller follows the leader).
pub async fn cancel(
    group: &Group,
    session: SessionId,
    request: RequestId,
    name: &LockName,
) -> Result<Abandoned, ProposeError> {
    let key = (session, request);
    if !group.calls.begin_abandon(key) {
        return Ok(Abandoned::Skipped);
    }
    let result = propose(group, session, request, name).await;
    group.calls.end_abandon(key);
    match result? {
        Outcome::Abandoned | Outcome::Refused(Refusal::UnknownSession) => Ok(Abandoned::Done),
        other => Err(ProposeError::Unknown(format!(
            "unexpected outcome of an abandon: {other:?}"
        ))),
    }
}

/// True once this server has applied past the session's creation and the session is not there: it
/// holds and waits for nothing any more, so there is nothing left to abandon.
fn session_gone(group: &Group, session: SessionId) -> bool {
    let state = group.state.read().expect("state lock");
    state.last_applied.map_or(0, |l| l.index) >= session.0 && !state.table.has_session(session)
}

/// Sends the abandon to the leader's client port.
async fn forward(
    node: &NodeShared,
    leader: u64,
    group: u32,
    session: SessionId,
    request: RequestId,
    name: &LockName,
) -> Result<(), String> {
    let member = node
        .config
        .member(leader)
        .ok_or_else(|| format!("node {leader} is not a member"))?;
    let endpoint = tonic::transport::Endpoint::from_shared(format!("http://{}", member.client))
        .map_err(|e| e.to_string())?
        .connect_timeout(holdfast_proto::transport::CONNECT_TIMEOUT)
        .timeout(FORWARD_TIMEOUT);
    let mut client =
        pb::holdfast_client::HoldfastClient::new(holdfast_proto::transport::connect_lazy(endpoint));
    let request = pb::CancelAcquireRequest {
        group,
        session_id: session.0,
        request_id: request.0,
        name: name.as_str().to_string(),
    };
    match tokio::time::timeout(FORWARD_TIMEOUT, client.cancel_acquire(request)).await {
        Ok(Ok(_)) => Ok(()),
        Ok(Err(status)) => Err(format!("node {leader}: {}", status.message())),
        Err(_) => Err(format!(
            "node {leader} did not answer within {FORWARD_TIMEOUT:?}"
        )),
    }
}
