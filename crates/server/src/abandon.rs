//! Acquires whose caller went away before it learned the outcome.
//!
//! A queued acquire keeps its place in the replicated table whether or not anybody still waits for the
//! answer, and the grant it later receives would leave a holder that never learns it holds the lock (its
//! process goes on renewing the session, so the lock is stuck). So every `Acquire` call gets an *attempt*
//! id, carried in its log entry, and a [`Call`] guard while its handler runs. If the handler is dropped
//! before it gave a definite answer (the client cancelled the call or reset its stream, the connection
//! closed, or the outcome is unknown), the server proposes `AbandonAcquire` for that attempt: the wait is
//! removed, or the grant released. When this server no longer leads the group, it forwards the abandon
//! to the leader's `CancelAcquire`, and keeps trying until it is applied, the session is gone, or this
//! server stops. A client that sets `AcquireRequest.client_cancels` takes this duty itself (the Rust
//! client does, so that an attempt that timed out keeps its place in the queue when retried).
//! docs/api.md gives the whole argument.
//!
//! Invariant: an abandon started here acts only on its own attempt. A retry of the same request by a
//! newer call, on this server or another, makes the wait or grant that call's (the table records the
//! attempt of the last acquire entry for it), and the older abandon then changes nothing; so a retry is
//! never answered with a grant that the abandon of its first call releases later. There is no shortcut
//! that skips an abandon because another call for the request runs here: that call may never reach the
//! log (its leader can be deposed first), and then nobody would answer for the wait.

use crate::group::{Group, ProposeError};
use crate::node::NodeShared;
use holdfast_lock_table::{Command, LockName, Outcome, Refusal, RequestId, SessionId};
use holdfast_proto::v1 as pb;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Arc;
use std::time::Duration;

type Key = (SessionId, RequestId);

/// Backoff between attempts of an abandon that could not be applied yet (no leader, no quorum).
const RETRY_FIRST: Duration = Duration::from_millis(50);
const RETRY_MAX: Duration = Duration::from_secs(2);
/// An abandon still not applied after this many tries is logged as a warning (and every this many
/// tries after), since a grant nobody knows of may be stuck behind it.
const WARN_EVERY_TRIES: u32 = 30;

/// One forwarded attempt against the leader.
const FORWARD_TIMEOUT: Duration = Duration::from_secs(3);

/// Attempt ids for the acquire calls this server proposes: unique per call (a counter) and, with high
/// probability, across servers and restarts (a base drawn from the seed, the node id and the start
/// time). Never 0, which marks waits and grants from before attempts existed.
pub struct AttemptIds {
    base: u64,
    next: AtomicU64,
}

impl AttemptIds {
    pub fn new(seed: u64, node_id: u64, started_ms: u64) -> Self {
        let mix = |x: u64| (x ^ (x >> 31)).wrapping_mul(0x9E37_79B9_7F4A_7C15);
        AttemptIds {
            base: mix(seed ^ mix(node_id) ^ mix(started_ms.rotate_left(17))),
            next: AtomicU64::new(1),
        }
    }

    pub fn next(&self) -> u64 {
        loop {
            let n = self.next.fetch_add(1, Relaxed);
            let id = self
                .base
                .wrapping_add(n.wrapping_mul(0xD6E8_FEB8_6659_FD93));
            if id != 0 {
                return id;
            }
        }
    }
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

/// An acquire call in progress. Call [`Call::answered`] just before the handler returns a definite
/// answer; dropped without it, the call's attempt is abandoned through the log (unless
/// [`OnDrop::Detach`]).
pub struct Call {
    node: Arc<NodeShared>,
    group: u32,
    key: Key,
    name: LockName,
    attempt: u64,
    on_drop: OnDrop,
    answered: bool,
}

impl Call {
    /// Starts guarding the call for (session, request) that proposes `attempt`.
    pub fn new(
        node: &Arc<NodeShared>,
        group: &Group,
        (session, request): Key,
        name: &LockName,
        attempt: u64,
        on_drop: OnDrop,
    ) -> Call {
        Call {
            node: node.clone(),
            group: group.id,
            key: (session, request),
            name: name.clone(),
            attempt,
            on_drop,
            answered: false,
        }
    }

    /// The handler produced a definite answer: nothing to abandon.
    pub fn answered(mut self) {
        self.answered = true;
    }
}

impl Drop for Call {
    fn drop(&mut self) {
        if self.answered || self.on_drop == OnDrop::Detach {
            return;
        }
        let Some(group) = self.node.groups.get(self.group as usize).cloned() else {
            return;
        };
        if let Ok(rt) = tokio::runtime::Handle::try_current() {
            let (node, key, name, attempt) =
                (self.node.clone(), self.key, self.name.clone(), self.attempt);
            rt.spawn(async move { abandon(&node, &group, key, name, attempt).await });
        }
    }
}

/// Abandons one attempt from this server, retrying until it is applied, the session is gone, or this
/// server stops (its callers' connections close with it, see docs/api.md).
async fn abandon(node: &NodeShared, group: &Group, key: Key, name: LockName, attempt: u64) {
    let (session, request) = key;
    let mut backoff = RETRY_FIRST;
    let mut tries = 0u32;
    loop {
        let last_error = match propose(group, session, request, &name, Some(attempt)).await {
            Ok(_) => return,
            Err(ProposeError::NotLeader(Some(leader))) if leader != node.config.node_id => {
                match forward(node, leader, group.id, key, &name, attempt).await {
                    Ok(()) => return,
                    Err(e) => e,
                }
            }
            Err(ProposeError::Stopped(_)) => return,
            Err(e) => format!("{e:?}"),
        };
        if session_gone(group, session) {
            return;
        }
        tries += 1;
        if tries.is_multiple_of(WARN_EVERY_TRIES) {
            tracing::warn!(group = group.id, session = session.0, request = request.0, lock = name.as_str(), tries, error = %last_error,
                "an abandoned acquire is not applied yet; its wait or grant stays until it is or the session ends");
        }
        tokio::time::sleep(backoff).await;
        backoff = (backoff * 2).min(RETRY_MAX);
    }
}

/// Proposes the abandon here (this server must lead the group).
async fn propose(
    group: &Group,
    session: SessionId,
    request: RequestId,
    name: &LockName,
    attempt: Option<u64>,
) -> Result<Outcome, ProposeError> {
    let outcome = group
        .propose(Command::AbandonAcquire {
            session,
            request,
            name: name.clone(),
            attempt,
            now_ms: crate::now_ms(),
        })
        .await?;
    if outcome == Outcome::Abandoned {
        group.metrics.abandons.fetch_add(1, Relaxed);
    }
    tracing::debug!(
        group = group.id,
        session = session.0,
        request = request.0,
        lock = name.as_str(),
        ?attempt,
        ?outcome,
        "abandon applied"
    );
    Ok(outcome)
}

/// The `CancelAcquire` RPC on this server (it must lead the group): `attempt` is `None` for a client's
/// own cancel, `Some` for an abandon forwarded by another server. Refusals are answers: `NotWaiting`
/// (the request waits for another lock, or a newer call took it over) or an unknown session.
pub async fn cancel(
    group: &Group,
    session: SessionId,
    request: RequestId,
    name: &LockName,
    attempt: Option<u64>,
) -> Result<Outcome, ProposeError> {
    propose(group, session, request, name, attempt).await
}

/// True once this server has applied past the session's creation and the session is not there: it
/// holds and waits for nothing any more, so there is nothing left to abandon.
fn session_gone(group: &Group, session: SessionId) -> bool {
    let state = group.state.read().expect("state lock");
    state.last_applied.map_or(0, |l| l.index) >= session.0 && !state.table.has_session(session)
}

/// Sends the abandon to the leader's client port. A refusal from the leader is an answer too: the
/// attempt no longer owns a wait or grant, or the session is gone.
async fn forward(
    node: &NodeShared,
    leader: u64,
    group: u32,
    (session, request): Key,
    name: &LockName,
    attempt: u64,
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
        attempt,
    };
    match tokio::time::timeout(FORWARD_TIMEOUT, client.cancel_acquire(request)).await {
        Ok(Ok(_)) => Ok(()),
        Ok(Err(status)) => match holdfast_proto::reason(&status) {
            Some(pb::Reason::NotHolder | pb::Reason::SessionUnknown) => Ok(()),
            _ => Err(format!("node {leader}: {}", status.message())),
        },
        Err(_) => Err(format!(
            "node {leader} did not answer within {FORWARD_TIMEOUT:?}"
        )),
    }
}

/// Maps a cancel's outcome to the RPC's answer.
pub fn cancel_result(outcome: Outcome) -> Result<(), Refusal> {
    match outcome {
        Outcome::Abandoned => Ok(()),
        Outcome::Refused(r) => Err(r),
        other => Err(Refusal::NotWaiting).inspect_err(|_| {
            tracing::warn!(?other, "unexpected outcome of an abandon");
        }),
    }
}
