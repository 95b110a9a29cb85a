//! Batched keepalives: one background task per [`Client`] renews every session it opened, sending one
//! message per round to each server that leads some of the client's groups (all the groups that server
//! leads in one message, `KeepAliveRequest.groups`). The message is a call on the client's `Calls`
//! stream to that server ([`crate::calls`], on a connection of its own where the server takes one: no
//! HTTP/2 tasks between this task and the server's renewals), or, where that stream does not take
//! keepalives (a server older than them, or a client without `Calls` streams), a message on a
//! long-lived `KeepAliveStream` per server, for [`NO_CALLS_FOR`] before the `Calls` stream is tried
//! again. This is what keeps the load at the design's "one heartbeat per client connection" instead of
//! one RPC per session, or one per group. A group answered NOT_LEADER is sent again, in the same round, to the
//! leader the answer names. Against a server older than per-group answers (it answers none) the task
//! falls back to one message per group per round, for the rest of its life.
//!
//! A session is due one third of its TTL after the last renewal was sent, and a round also takes the
//! sessions due within the next sixth of their TTL, so that sessions opened at different times share
//! rounds. A renewal counts from the moment its message was **sent**; a failed round is retried on the
//! next tick (every 100 ms) until the session's client-side lease runs out, and then the session is
//! marked lost.
//!
//! The task looks at its sessions only when one may need it: after a round, and then not before the
//! earliest time any session is due or its lease runs out (or something outside the task moved one of
//! those earlier: a new session, a part opened in another group, which [`Registry::poke`]s it). With
//! 100,000 sessions a look every tick cost a client about a third of a core.

use crate::client::{answered_by_a_server, Client, Inner};
use crate::error::{classify, Disposition};
use crate::session::SessionInner;
use holdfast_proto::v1 as pb;
use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;
use tokio::sync::mpsc;
use tokio::time::Instant;

/// How often the keepalive task looks for due sessions.
const TICK: Duration = Duration::from_millis(100);
/// Most session ids per keepalive message (the server's `max_keepalive_batch`).
const MAX_BATCH: usize = 10_000;

#[derive(Default)]
pub(crate) struct Registry {
    sessions: Mutex<Vec<Weak<SessionInner>>>,
    task: Mutex<Option<tokio::task::JoinHandle<()>>>,
    /// Round-trip times of keepalive messages, in µs, until drained (at most `MAX_SAMPLES`).
    pub(crate) latencies_us: Mutex<Vec<u32>>,
    /// A session was added, or one's lease or due time moved earlier outside the task: look at once.
    poked: std::sync::atomic::AtomicBool,
    /// How many times the task looked at every session (for tests and benchmarks).
    looks: std::sync::atomic::AtomicU64,
}

/// Keepalive latency samples kept until [`Client::take_keepalive_latencies`] drains them.
const MAX_SAMPLES: usize = 1_000_000;

impl Registry {
    pub(crate) fn record(&self, rtt: Duration) {
        let mut l = self.latencies_us.lock().expect("latency lock");
        if l.len() < MAX_SAMPLES {
            l.push(rtt.as_micros().min(u128::from(u32::MAX)) as u32);
        }
    }
}

impl Client {
    /// How many times the keepalive task has looked at every session of this client (for tests and
    /// benchmarks: with nothing due it does not look at each tick).
    #[doc(hidden)]
    pub fn keepalive_looks(&self) -> u64 {
        self.inner()
            .registry
            .looks
            .load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Round-trip times (µs) of the keepalive messages sent since the last call, for benchmarks.
    pub fn take_keepalive_latencies(&self) -> Vec<u32> {
        std::mem::take(
            &mut *self
                .inner()
                .registry
                .latencies_us
                .lock()
                .expect("latency lock"),
        )
    }
}

impl Drop for Registry {
    fn drop(&mut self) {
        if let Some(t) = self.task.lock().ok().and_then(|mut t| t.take()) {
            t.abort();
        }
    }
}

impl Registry {
    pub(crate) fn add(&self, client: &Arc<Inner>, session: &Arc<SessionInner>) {
        self.sessions
            .lock()
            .expect("registry lock")
            .push(Arc::downgrade(session));
        self.poke();
        let mut task = self.task.lock().expect("registry task lock");
        if task.is_none() {
            *task = Some(tokio::spawn(run(Arc::downgrade(client))));
        }
    }

    /// Makes the task look at every session on its next tick.
    pub(crate) fn poke(&self) {
        self.poked.store(true, std::sync::atomic::Ordering::Release);
    }

    fn take_poked(&self) -> bool {
        self.poked.swap(false, std::sync::atomic::Ordering::AcqRel)
    }

    fn live(&self) -> Vec<Arc<SessionInner>> {
        let mut sessions = self.sessions.lock().expect("registry lock");
        sessions.retain(|w| w.upgrade().is_some_and(|s| !s.is_lost()));
        sessions.iter().filter_map(Weak::upgrade).collect()
    }
}

struct Stream {
    endpoint: usize,
    tx: mpsc::Sender<pb::KeepAliveRequest>,
    rx: tonic::Streaming<pb::KeepAliveResponse>,
    /// Its server answered compact, so it takes packed secrets (`GroupKeepAlive.packed_secrets`).
    packed: bool,
}

/// What one round made of one group's sessions: per session open in the group (in the order of its
/// members), the TTL granted or `None` if not alive; or why the round failed for the group.
type GroupOutcome = Result<Vec<Option<Duration>>, String>;

/// Which sessions of a chunk are open in each group (indexes into the chunk), taken once per chunk: a
/// session's part in a group only ever goes from unopened to open, so the message and the reading of
/// its answer agree. A part opened since is renewed from the next round on; until then it bounds the
/// session's lease (`SessionInner::renewed`), since its open may have been sent before this round.
fn members_by_group(groups: u32, chunk: &[&Arc<SessionInner>]) -> Vec<Vec<usize>> {
    (0..groups)
        .map(|g| {
            (0..chunk.len())
                .filter(|&i| chunk[i].in_group(g).is_some())
                .collect()
        })
        .collect()
}

/// The ids and secrets of `members` of `chunk` in `group` (secrets empty if the server gave none).
fn ids_and_secrets(
    chunk: &[&Arc<SessionInner>],
    members: &[usize],
    group: u32,
) -> (Vec<u64>, Vec<prost::bytes::Bytes>) {
    let parts = members.iter().filter_map(|&i| chunk[i].in_group(group));
    let (ids, secrets): (Vec<u64>, Vec<prost::bytes::Bytes>) =
        parts.map(|p| (p.id, p.secret.clone())).unzip();
    // Sessions opened by a server that gave no secrets send none.
    if secrets.iter().all(|s| s.is_empty()) {
        (ids, Vec::new())
    } else {
        (ids, secrets)
    }
}

async fn run(client: Weak<Inner>) {
    // Fan-in streams by server (endpoint index); per-group streams once `legacy`.
    let mut by_server: BTreeMap<usize, Stream> = BTreeMap::new();
    let mut by_group: BTreeMap<u32, Stream> = BTreeMap::new();
    // Servers whose `Calls` stream did not take a keepalive, and until when they get the stream instead.
    let mut no_calls: BTreeMap<usize, Instant> = BTreeMap::new();
    let mut legacy = false;
    // No session is due and no lease runs out before this (`None`: look at the next tick).
    let mut quiet_until: Option<Instant> = None;
    loop {
        tokio::time::sleep(TICK).await;
        let Some(inner) = client.upgrade() else {
            return;
        };
        let client = Client::from_inner(inner);
        // Lease instants are on the lease clock (`session::lease_now`), which counts a suspension.
        let now = crate::session::lease_now();
        let poked = client.inner().registry.take_poked();
        if !poked && quiet_until.is_some_and(|t| now < t) {
            continue;
        }
        let sessions = client.inner().registry.live();
        client
            .inner()
            .registry
            .looks
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        for s in &sessions {
            s.check_expired(now);
        }
        if !sessions.iter().any(|s| s.is_due(now)) {
            quiet_until = sessions.iter().map(|s| s.next_look()).min();
            continue;
        }
        quiet_until = None;
        // With them, the sessions due within the next sixth of their TTL: sessions opened at different
        // times then share their rounds from the first on, instead of each set its own.
        let due: Vec<&Arc<SessionInner>> = sessions
            .iter()
            .filter(|s| s.is_due(now + s.ttl() / 6))
            .collect();
        let sent = crate::session::lease_now();
        let sent_wall_ms = crate::session::wall_ms();
        // A session is renewed when every group renewed it; the smallest TTL granted counts.
        let mut granted: Vec<Option<Duration>> = vec![Some(Duration::MAX); due.len()];
        // Which groups the round renewed each session in (bit g: group g).
        let mut covered: Vec<u64> = vec![0; due.len()];
        // One message carries a chunk's sessions in every group it goes to: at most MAX_BATCH ids.
        let per_message = (MAX_BATCH / client.groups().max(1) as usize).max(1);
        for (chunk_no, chunk) in due.chunks(per_message).enumerate() {
            // A round may take no longer than the earliest lease in it has left.
            let limit = || {
                chunk
                    .iter()
                    .map(|s| s.valid_until())
                    .min()
                    .unwrap_or(now)
                    .saturating_duration_since(crate::session::lease_now())
            };
            let members = members_by_group(client.groups(), chunk);
            let outcomes: Vec<GroupOutcome> = if legacy {
                let mut outcomes = Vec::new();
                for group in 0..client.groups() {
                    if members[group as usize].is_empty() {
                        outcomes.push(Ok(Vec::new()));
                        continue;
                    }
                    let limit = limit();
                    let (ids, secrets) = ids_and_secrets(chunk, &members[group as usize], group);
                    let round = round(&client, &mut by_group, group, ids, secrets);
                    outcomes.push(match tokio::time::timeout(limit, round).await {
                        Ok(r) => r,
                        Err(_) => {
                            by_group.remove(&group);
                            Err("the leases ran out during the round".to_string())
                        }
                    });
                }
                outcomes
            } else {
                let fan_in = fan_in(&client, &mut by_server, &mut no_calls, chunk, &members);
                match tokio::time::timeout(limit(), fan_in).await {
                    Ok(Ok(outcomes)) => outcomes,
                    Ok(Err(Unsupported)) => {
                        tracing::info!("a server answers no per-group keepalives (an older version): one keepalive per group from now on");
                        legacy = true;
                        by_server.clear();
                        vec![Err("retried per group".to_string()); client.groups() as usize]
                    }
                    Err(_) => {
                        by_server.clear();
                        vec![
                            Err("the leases ran out during the round".to_string());
                            client.groups() as usize
                        ]
                    }
                }
            };
            for (group, outcome) in outcomes.into_iter().enumerate() {
                let members = &members[group];
                for &i in members {
                    covered[chunk_no * per_message + i] |=
                        crate::session::group_bit(group).unwrap_or(0);
                }
                match outcome {
                    Ok(results) => {
                        for (&i, r) in members.iter().zip(results) {
                            let slot = &mut granted[chunk_no * per_message + i];
                            match r {
                                Some(ttl) => *slot = slot.map(|g| g.min(ttl)),
                                None => {
                                    chunk[i].mark_lost(
                                        "the server expired or closed the session".into(),
                                    );
                                    *slot = None;
                                }
                            }
                        }
                    }
                    Err(reason) => {
                        tracing::debug!(group, %reason, "keepalive round failed; retrying");
                        for &i in members {
                            granted[chunk_no * per_message + i] = None;
                        }
                    }
                }
            }
        }
        for ((s, g), covered) in due.iter().zip(granted).zip(covered) {
            match g {
                Some(ttl) if ttl != Duration::MAX => s.renewed(sent, sent_wall_ms, ttl, covered),
                _ => s.retry_soon(crate::session::lease_now() + TICK),
            }
        }
    }
}

/// Puts `g`'s secrets in `packed_secrets`, 16 bytes each (an empty one, a session without a secret,
/// as 16 zero bytes, which is what the server reads an empty one as), for a server that answered
/// compact. Left as they are if one is neither empty nor 16 bytes (the server refuses it either way,
/// and says why).
fn pack(g: &mut pb::GroupKeepAlive) {
    if g.session_secrets.is_empty()
        || g.session_secrets
            .iter()
            .any(|s| !s.is_empty() && s.len() != 16)
    {
        return;
    }
    let mut packed = Vec::with_capacity(16 * g.session_secrets.len());
    for s in g.session_secrets.drain(..) {
        if s.is_empty() {
            packed.extend_from_slice(&[0; 16]);
        } else {
            packed.extend_from_slice(&s);
        }
    }
    g.packed_secrets = packed.into();
}

/// The other way: each group's packed secrets back into `session_secrets` (slices of the same bytes),
/// for a server not known to take them.
fn unpack(request: &mut pb::KeepAliveRequest) {
    for g in &mut request.groups {
        if g.packed_secrets.is_empty() {
            continue;
        }
        let packed = std::mem::take(&mut g.packed_secrets);
        g.session_secrets = (0..packed.len() / 16)
            .map(|i| packed.slice(i * 16..i * 16 + 16))
            .collect();
    }
}

/// The server answered no per-group results: it predates `KeepAliveRequest.groups`.
struct Unsupported;

/// Renews `chunk`'s sessions in every group they are open in (`members`) with one message per server
/// that leads some of those groups (as far as the client knows), then again for the groups answered
/// NOT_LEADER, at the leader named, up to one more time than there are servers. Returns each group's
/// outcome, by group (an empty success for a group none of them is open in: nothing is sent for it).
async fn fan_in(
    client: &Client,
    streams: &mut BTreeMap<usize, Stream>,
    no_calls: &mut BTreeMap<usize, Instant>,
    chunk: &[&Arc<SessionInner>],
    members: &[Vec<usize>],
) -> Result<Vec<GroupOutcome>, Unsupported> {
    let mut out: Vec<Option<GroupOutcome>> = members
        .iter()
        .map(|m| m.is_empty().then(|| Ok(Vec::new())))
        .collect();
    let groups = client.groups();
    for _attempt in 0..client.server_count() + 1 {
        let mut by_leader: BTreeMap<usize, Vec<u32>> = BTreeMap::new();
        for group in (0..groups).filter(|&g| out[g as usize].is_none()) {
            by_leader
                .entry(client.leader_of(group))
                .or_default()
                .push(group);
        }
        if by_leader.is_empty() {
            break;
        }
        for (endpoint, to_renew) in by_leader {
            // Packed on the `Calls` stream (a server that takes keepalives there takes packed
            // secrets; `exchange` unpacks them for a stream whose server is not known to).
            let packed =
                takes_calls(no_calls, endpoint) || streams.get(&endpoint).is_some_and(|s| s.packed);
            let request = pb::KeepAliveRequest {
                // A server older than `groups` checks only this (with no ids): one the client
                // believes it leads, so that such a server answers (with no groups) instead of
                // redirecting the whole message elsewhere.
                group: to_renew[0],
                groups: to_renew
                    .iter()
                    .map(|&group| {
                        let (session_ids, session_secrets) =
                            ids_and_secrets(chunk, &members[group as usize], group);
                        let mut g = pb::GroupKeepAlive {
                            group,
                            session_ids,
                            session_secrets,
                            ..Default::default()
                        };
                        if packed {
                            pack(&mut g);
                        }
                        g
                    })
                    .collect(),
                compact: true,
                ..Default::default()
            };
            let reply = match exchange(client, streams, no_calls, endpoint, request).await {
                Ok(reply) => reply,
                Err(status) => {
                    // A server of this version answers NOT_LEADER per group, never for the whole
                    // message: one that did predates `groups` (it checked `group` alone).
                    if status
                        .as_ref()
                        .and_then(|s| prost::Message::decode(s.details()).ok())
                        .is_some_and(|d: pb::ErrorDetail| d.reason == pb::Reason::NotLeader as i32)
                    {
                        return Err(Unsupported);
                    }
                    // The whole message failed (the server is gone, or refused the call): each
                    // group tries where the answer points, or the next server.
                    for &group in &to_renew {
                        match status.as_ref().map(classify) {
                            Some(Disposition::Fail(e)) => {
                                out[group as usize] = Some(Err(e.to_string()))
                            }
                            Some(d) => next_target(
                                client,
                                group,
                                endpoint,
                                d,
                                status.as_ref().is_some_and(answered_by_a_server),
                            ),
                            None => no_answer(client, group, endpoint),
                        }
                    }
                    continue;
                }
            };
            if reply.groups.is_empty() {
                return Err(Unsupported);
            }
            if reply.groups.len() != to_renew.len() {
                streams.remove(&endpoint);
                for &group in &to_renew {
                    out[group as usize] = Some(Err("keepalive answered the wrong groups".into()));
                }
                continue;
            }
            for (&group, answer) in to_renew.iter().zip(reply.groups) {
                if answer.group != group {
                    out[group as usize] = Some(Err("keepalive answered the wrong groups".into()));
                } else if answer.code == 0 {
                    // Per session, the TTL granted or None if not alive, from either form.
                    let ttls: Vec<Option<Duration>> = if reply.compact {
                        let granted = |&ttl: &u64| (ttl > 0).then(|| Duration::from_millis(ttl));
                        answer.ttl_ms.iter().map(granted).collect()
                    } else {
                        let granted = |r: &pb::KeepAliveResult| {
                            r.alive.then(|| Duration::from_millis(r.ttl_ms))
                        };
                        answer.results.iter().map(granted).collect()
                    };
                    out[group as usize] = Some(if ttls.len() == members[group as usize].len() {
                        Ok(ttls)
                    } else {
                        Err("keepalive answered the wrong number of sessions".into())
                    });
                } else {
                    let status = tonic::Status::with_details(
                        tonic::Code::from(answer.code),
                        answer.message,
                        answer
                            .error
                            .map(|e| prost::Message::encode_to_vec(&e))
                            .unwrap_or_default()
                            .into(),
                    );
                    match classify(&status) {
                        Disposition::Fail(e) => out[group as usize] = Some(Err(e.to_string())),
                        d => next_target(client, group, endpoint, d, true),
                    }
                }
            }
        }
    }
    Ok(out
        .into_iter()
        .map(|o| o.unwrap_or_else(|| Err("no server renewed the sessions".into())))
        .collect())
}

/// How long a server whose `Calls` stream did not take a keepalive gets its keepalives on
/// `KeepAliveStream` before the stream is tried again (it may have been upgraded since).
const NO_CALLS_FOR: Duration = Duration::from_secs(60);

/// Whether `endpoint`'s keepalives go on its `Calls` stream first.
fn takes_calls(no_calls: &BTreeMap<usize, Instant>, endpoint: usize) -> bool {
    no_calls.get(&endpoint).is_none_or(|&t| Instant::now() >= t)
}

/// Sends one message to `endpoint` and waits for its answer: as a call on its `Calls` stream (the
/// acquires' and releases', on a connection of its own: no HTTP/2 tasks between the sender and the
/// server's renewals), else on its `KeepAliveStream` (opened if need be). `Err(None)`: no answer in
/// time, or the stream broke; `Err(Some(status))`: the call failed with `status`.
async fn exchange(
    client: &Client,
    streams: &mut BTreeMap<usize, Stream>,
    no_calls: &mut BTreeMap<usize, Instant>,
    endpoint: usize,
    mut request: pb::KeepAliveRequest,
) -> Result<pb::KeepAliveResponse, Option<tonic::Status>> {
    if takes_calls(no_calls, endpoint) {
        match on_calls(client, endpoint, &request).await {
            Some(answer) => {
                // The server's keepalive stream, if one was kept, is not needed any more.
                if answer.is_ok() {
                    no_calls.remove(&endpoint);
                    streams.remove(&endpoint);
                }
                return answer;
            }
            None => {
                tracing::debug!(
                    endpoint,
                    "keepalives go on KeepAliveStream: the Calls stream does not take them"
                );
                no_calls.insert(endpoint, Instant::now() + NO_CALLS_FOR);
            }
        }
    }
    if !streams.get(&endpoint).is_some_and(|s| s.packed) {
        unpack(&mut request);
    }
    let timeout = client.options().attempt_timeout;
    // A stream kept from an earlier round may have died since (its server was restarted, or ended
    // it): that says nothing about the server now. So a kept stream that fails without a server's
    // answer is replaced by a fresh one once before the server counts as not answering, which would
    // make the client skip redirects to it for a while, and a restarted server may be the leader its
    // peers name a moment later (found in the failover figures: a gap of 1.25 s instead of ~0.7).
    let mut kept = streams.contains_key(&endpoint);
    let mut request = Some(request);
    loop {
        let stream = match streams.entry(endpoint) {
            std::collections::btree_map::Entry::Occupied(e) => e.into_mut(),
            std::collections::btree_map::Entry::Vacant(e) => {
                let (tx, rx) = mpsc::channel(4);
                let mut c = client.rpc(endpoint);
                match tokio::time::timeout(timeout, c.keep_alive_stream(tokio_stream_from(rx)))
                    .await
                {
                    Ok(Ok(resp)) => {
                        // A fresh stream's server may not take packed secrets (it may be another
                        // process than the one that answered compact on the stream before).
                        if let Some(r) = request.as_mut() {
                            unpack(r);
                        }
                        e.insert(Stream {
                            endpoint,
                            tx,
                            rx: resp.into_inner(),
                            packed: false,
                        })
                    }
                    Ok(Err(status)) => return Err(Some(status)),
                    Err(_) => return Err(None),
                }
            }
        };
        // Kept for a retry only while one may follow.
        let message = if kept {
            request
                .clone()
                .expect("the request is kept while a retry may follow")
        } else {
            request
                .take()
                .expect("the request is sent once after the last retry")
        };
        let sent = Instant::now();
        if stream.tx.send(message).await.is_err() {
            streams.remove(&endpoint);
            if std::mem::take(&mut kept) {
                continue;
            }
            return Err(None);
        }
        match tokio::time::timeout(timeout, stream.rx.message()).await {
            Ok(Ok(Some(reply))) => {
                client.inner().registry.record(sent.elapsed());
                stream.packed |= reply.compact;
                client.mark_answered(endpoint);
                return Ok(reply);
            }
            Ok(Ok(None)) => {
                streams.remove(&endpoint);
                if std::mem::take(&mut kept) {
                    continue;
                }
                return Err(None);
            }
            Ok(Err(status)) if !answered_by_a_server(&status) && kept => {
                streams.remove(&endpoint);
                kept = false;
            }
            Ok(Err(status)) => {
                streams.remove(&endpoint);
                return Err(Some(status));
            }
            Err(_) => {
                streams.remove(&endpoint);
                return Err(None);
            }
        }
    }
}

/// Sends `request` as a call on `endpoint`'s `Calls` stream. `None`: it is for `KeepAliveStream`
/// (this client does not use the `Calls` stream, the server does not serve it, or the server predates
/// keepalives on it and refused the message as a call it does not know: INVALID_ARGUMENT, "a
/// CallRequest must carry ...", the words of every server since the `Calls` stream).
async fn on_calls(
    client: &Client,
    endpoint: usize,
    request: &pb::KeepAliveRequest,
) -> Option<Result<pb::KeepAliveResponse, Option<tonic::Status>>> {
    let calls = client.calls(endpoint);
    let rpc = client.rpc(endpoint);
    let attempts = async {
        // A stream kept from an earlier call may have died since (its server was restarted): that
        // says nothing about the server now, so one that ends without an answer is replaced by a
        // fresh one once (as `exchange` does with a kept `KeepAliveStream`).
        for attempt in 0..2 {
            let sent = Instant::now();
            match calls.keep_alive(&rpc, request.clone()).await {
                Err(_given_back) => return None,
                Ok(Ok(reply)) => {
                    client.inner().registry.record(sent.elapsed());
                    client.mark_answered(endpoint);
                    return Some(Ok(reply));
                }
                // What a server answers a call it does not know with (one older than these calls,
                // or acting so); any other refusal is the message's own.
                Ok(Err(status))
                    if status.code() == tonic::Code::InvalidArgument
                        && status.message().starts_with("a CallRequest must carry") =>
                {
                    return None
                }
                Ok(Err(status)) if !answered_by_a_server(&status) => {
                    if attempt == 1 {
                        return Some(Err(None));
                    }
                }
                Ok(Err(status)) => return Some(Err(Some(status))),
            }
        }
        Some(Err(None))
    };
    tokio::time::timeout(client.options().attempt_timeout, attempts)
        .await
        .unwrap_or(Some(Err(None)))
}

/// Sends one keepalive message for `group` and returns, per id, the TTL granted or `None` if not alive.
async fn round(
    client: &Client,
    streams: &mut BTreeMap<u32, Stream>,
    group: u32,
    ids: Vec<u64>,
    secrets: Vec<prost::bytes::Bytes>,
) -> Result<Vec<Option<Duration>>, String> {
    let n = ids.len();
    let request = pb::KeepAliveRequest {
        group,
        session_ids: ids,
        session_secrets: secrets,
        // The legacy form, for a server older than `groups`: older than `compact` too.
        groups: Vec::new(),
        compact: false,
    };
    let timeout = client.options().attempt_timeout;
    for _attempt in 0..client.server_count() + 1 {
        // A stream kept from an earlier round that fails without a server's answer died before this
        // round (see `exchange`): the next attempt opens a fresh one, and the server is not marked.
        let kept = streams.contains_key(&group);
        let stream = match streams.get_mut(&group) {
            Some(s) => s,
            None => {
                let endpoint = client.leader_of(group);
                let (tx, rx) = mpsc::channel(4);
                let mut c = client.rpc(endpoint);
                let opened =
                    tokio::time::timeout(timeout, c.keep_alive_stream(tokio_stream_from(rx))).await;
                match opened {
                    Ok(Ok(resp)) => streams.entry(group).or_insert(Stream {
                        endpoint,
                        tx,
                        rx: resp.into_inner(),
                        packed: false,
                    }),
                    Ok(Err(status)) => {
                        next_target_after(client, group, endpoint, &status);
                        continue;
                    }
                    Err(_) => {
                        no_answer(client, group, endpoint);
                        continue;
                    }
                }
            }
        };
        let endpoint = stream.endpoint;
        let sent = Instant::now();
        if stream.tx.send(request.clone()).await.is_err() {
            streams.remove(&group);
            continue;
        }
        match tokio::time::timeout(timeout, stream.rx.message()).await {
            Ok(Ok(Some(reply))) if reply.results.len() == n => {
                client.inner().registry.record(sent.elapsed());
                client.mark_answered(endpoint);
                return Ok(reply
                    .results
                    .iter()
                    .map(|r| r.alive.then(|| Duration::from_millis(r.ttl_ms)))
                    .collect());
            }
            Ok(Ok(_)) => {
                streams.remove(&group);
                return Err(
                    "keepalive stream ended or answered the wrong number of sessions".into(),
                );
            }
            Ok(Err(status)) if kept && !answered_by_a_server(&status) => {
                streams.remove(&group);
            }
            Ok(Err(status)) => {
                streams.remove(&group);
                next_target_after(client, group, endpoint, &status);
            }
            Err(_) => {
                streams.remove(&group);
                no_answer(client, group, endpoint);
                return Err(format!("no keepalive answer within {timeout:?}"));
            }
        }
    }
    Err("no server renewed the sessions".into())
}

/// Where `group`'s next try goes after `endpoint` failed with `disposition` (`answered`: the server
/// itself said so): the leader it named (unless that server failed a moment ago:
/// `Client::redirect_target`), else the next server.
fn next_target(
    client: &Client,
    group: u32,
    endpoint: usize,
    disposition: Disposition,
    answered: bool,
) {
    if answered {
        client.mark_answered(endpoint);
    }
    let next = match disposition {
        Disposition::Redirect(ep) => client.redirect_target(&ep),
        _ if !answered => return no_answer(client, group, endpoint),
        _ => None,
    };
    client.set_leader(
        group,
        next.unwrap_or((endpoint + 1) % client.server_count()),
    );
}

/// [`next_target`] after `endpoint` failed with `status`.
fn next_target_after(client: &Client, group: u32, endpoint: usize, status: &tonic::Status) {
    next_target(
        client,
        group,
        endpoint,
        classify(status),
        answered_by_a_server(status),
    );
}

/// After `endpoint` did not answer (unreachable, reset, timed out): it is marked failed
/// (`Client::mark_failed`) and `group`'s next try goes to the next server.
fn no_answer(client: &Client, group: u32, endpoint: usize) {
    client.mark_failed(endpoint);
    client.set_leader(group, (endpoint + 1) % client.server_count());
}

fn tokio_stream_from(
    rx: mpsc::Receiver<pb::KeepAliveRequest>,
) -> impl tokio_stream::Stream<Item = pb::KeepAliveRequest> + Send + 'static {
    tokio_stream::wrappers::ReceiverStream::new(rx)
}

#[cfg(test)]
mod tests {
    use super::{next_target_after, pack, unpack, Client};
    use holdfast_proto::v1::{self as pb, ErrorDetail, Reason};

    /// Packed secrets are the secrets in order, 16 bytes each (an empty one as zeros, which the server
    /// reads an empty one as), and unpack to the same; a group with a secret of another length, or
    /// with none, is left as it is.
    #[test]
    fn secrets_pack_in_order_and_unpack_to_the_same() {
        let s = |b: u8| prost::bytes::Bytes::from(vec![b; 16]);
        let group = |secrets: Vec<prost::bytes::Bytes>| pb::GroupKeepAlive {
            group: 1,
            session_ids: (0..secrets.len() as u64).collect(),
            session_secrets: secrets,
            ..Default::default()
        };
        let mut g = group(vec![s(1), prost::bytes::Bytes::new(), s(3)]);
        pack(&mut g);
        assert!(g.session_secrets.is_empty());
        assert_eq!(
            g.packed_secrets.to_vec(),
            [vec![1; 16], vec![0; 16], vec![3; 16]].concat()
        );
        let mut r = pb::KeepAliveRequest {
            groups: vec![g, group(vec![s(4)])],
            ..Default::default()
        };
        pack(&mut r.groups[1]);
        unpack(&mut r);
        assert_eq!(r.groups[0].session_secrets, vec![s(1), s(0), s(3)]);
        assert_eq!(r.groups[1].session_secrets, vec![s(4)]);
        assert!(r.groups.iter().all(|g| g.packed_secrets.is_empty()));
        for odd in [vec![s(1), prost::bytes::Bytes::from(vec![2; 15])], vec![]] {
            let mut g = group(odd.clone());
            pack(&mut g);
            assert_eq!(g.session_secrets, odd);
            assert!(g.packed_secrets.is_empty());
        }
    }

    /// `NOT_LEADER` naming `leader`, as a server sends it.
    fn redirect_to(leader: &str) -> tonic::Status {
        let detail = ErrorDetail {
            reason: Reason::NotLeader as i32,
            leader_endpoint: leader.to_string(),
            ..Default::default()
        };
        tonic::Status::with_details(
            tonic::Code::FailedPrecondition,
            "not the leader",
            prost::Message::encode_to_vec(&detail).into(),
        )
    }

    /// The keepalive's side of the stale-redirect fix: after the dead server failed to answer, a
    /// stale server's redirect back to it is not followed; the next server is tried instead. Without
    /// the failure, the same redirect is followed.
    #[tokio::test]
    async fn a_keepalive_does_not_follow_a_redirect_to_a_server_that_just_failed() {
        let (dead, stale, live) = ("127.0.0.1:9", "127.0.0.1:10", "127.0.0.1:11");
        let client = Client::unconnected_to(&[dead, stale, live], 1);
        next_target_after(
            &client,
            0,
            0,
            &tonic::Status::unavailable("tcp connect error"),
        );
        assert_eq!(client.leader_of(0), 1, "after no answer, the next server");
        next_target_after(&client, 0, 1, &redirect_to(dead));
        assert_eq!(
            client.leader_of(0),
            2,
            "the redirect to the server that just failed was followed"
        );

        let fresh = Client::unconnected_to(&[dead, stale, live], 1);
        fresh.set_leader(0, 1);
        next_target_after(&fresh, 0, 1, &redirect_to(dead));
        assert_eq!(
            fresh.leader_of(0),
            0,
            "a redirect to a server that did not fail is followed"
        );
    }

    /// A server that failed to answer and then answered (it was restarted) is trusted again: the
    /// redirect to it that its peers send once it leads is followed.
    #[tokio::test]
    async fn a_server_that_answers_again_is_trusted_again() {
        let (restarted, other, third) = ("127.0.0.1:9", "127.0.0.1:10", "127.0.0.1:11");
        let client = Client::unconnected_to(&[restarted, other, third], 1);
        next_target_after(
            &client,
            0,
            0,
            &tonic::Status::unavailable("tcp connect error"),
        );
        // Back, not leading yet: NOT_LEADER without a leader, sent by the server.
        next_target_after(&client, 0, 0, &redirect_to(""));
        next_target_after(&client, 0, 1, &redirect_to(restarted));
        assert_eq!(
            client.leader_of(0),
            0,
            "the redirect to the restarted server was not followed"
        );
    }
}
