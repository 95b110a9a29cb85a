//! One Raft group on this server: its Raft handle, applied state, session leases and waiting acquires,
//! plus the two background tasks a leader runs (become-ready and expire-sessions).

use crate::config::ServerConfig;
use crate::lease::Leases;
use crate::metrics::GroupMetrics;
use crate::raft_types::{MemberNode, Raft, Request, Response, TypeConfig};
use crate::state_machine::SmState;
use holdfast_lock_table::{Command, Event, FencingToken, Outcome, RequestId, SessionId};
use openraft::async_runtime::WatchReceiver;
use openraft::errors::{ClientWriteError, ForwardReason, LinearizableReadError, RaftError};
use openraft::raft::ReadPolicy;
use openraft::{ChangeMembers, Instant as _, RaftMetrics, ServerState};
use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::Ordering::Relaxed;
use std::sync::{Arc, Mutex, RwLock};
use std::time::Duration;
use tokio::sync::oneshot;
use tokio::time::Instant;

/// How long the server keeps retrying a write that a just-elected leader refuses (LeaseExpired) before it
/// gives the client an UNAVAILABLE to retry.
const NEW_LEADER_RETRY: Duration = Duration::from_secs(3);

/// Longest a proposal may wait for its entry to commit and apply. A leader cut off from its followers
/// cannot commit; the client then gets UNAVAILABLE and retries elsewhere with the same request id.
const PROPOSE_TIMEOUT: Duration = Duration::from_secs(5);

/// Why a proposal or read did not produce an outcome.
#[derive(Debug)]
pub enum ProposeError {
    /// This server is not the leader; the leader's id if known.
    NotLeader(Option<u64>),
    /// The outcome is unknown (leader changed mid-way, timeout): retry with the same request id.
    Unknown(String),
    /// Raft on this server has stopped (storage failure or shutdown).
    Stopped(String),
    /// Refused before anything was proposed (a membership change that would be unsafe or is malformed).
    Refused(String),
}

/// A group's membership as one server sees it (see [`Group::membership_view`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MembershipView {
    pub voters: Vec<u64>,
    pub learners: Vec<u64>,
    pub joint: bool,
    pub log_id: Option<crate::raft_types::LogId>,
}

/// How long a snapshot asked for by [`Group::compact_log`] may take.
const COMPACT_TIMEOUT: Duration = Duration::from_secs(60);

/// How long one step of a membership change may take (a learner catching up by snapshot included).
const MEMBER_CHANGE_TIMEOUT: Duration = Duration::from_secs(60);

/// How long a voter being removed is given to receive the configuration that makes it a learner, before
/// it is removed for good (see [`Group::remove_member`]).
const DEMOTED_LEARNER_WAIT: Duration = Duration::from_secs(5);

fn membership_result<T>(
    r: Result<
        Result<T, RaftError<TypeConfig, ClientWriteError<TypeConfig>>>,
        tokio::time::error::Elapsed,
    >,
    step: &str,
) -> Result<(), ProposeError> {
    match r {
        Err(_) => Err(ProposeError::Unknown(format!(
            "{step} did not finish within {MEMBER_CHANGE_TIMEOUT:?}; the change may still complete: check `holdfast member list` and retry"
        ))),
        Ok(Ok(_)) => Ok(()),
        Ok(Err(RaftError::APIError(ClientWriteError::ForwardToLeader(f)))) => {
            Err(ProposeError::NotLeader(f.leader_id))
        }
        Ok(Err(RaftError::APIError(other))) => Err(ProposeError::Unknown(format!("{step}: {other}"))),
        Ok(Err(RaftError::Fatal(f))) => Err(ProposeError::Stopped(f.to_string())),
    }
}

/// How a waiting acquire ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WaitEnd {
    Granted(FencingToken),
    /// The waiter left the queue without a grant (its session ended, or it was cancelled).
    Removed,
}

/// Acquire calls waiting for a grant, keyed by (session, request id); woken from the applied log.
#[derive(Default)]
pub struct Waiters {
    map: Mutex<BTreeMap<(SessionId, RequestId), Wakers>>,
}

type Wakers = Vec<oneshot::Sender<WaitEnd>>;

/// One acquire call's registration ([`Waiters::register_call`]). However the call ends (answered,
/// failed, or its future dropped because the client went away), dropping this drops the receiver and
/// then the registration. One left behind is never woken when the acquire was granted at once, since
/// only a waiter's grant is an event: each such call used to leave ~250 bytes on the leader for good.
pub struct Registration {
    waiters: Arc<Waiters>,
    key: (SessionId, RequestId),
    rx: Option<oneshot::Receiver<WaitEnd>>,
}

impl Registration {
    /// The receiver, for the call to wait on (once).
    pub fn take(&mut self) -> Option<oneshot::Receiver<WaitEnd>> {
        self.rx.take()
    }
}

impl Drop for Registration {
    fn drop(&mut self) {
        self.rx = None;
        self.waiters.forget(self.key.0, self.key.1);
    }
}

impl Waiters {
    /// Registers an acquire call to be woken when `(session, request)` is granted or leaves the queue;
    /// the registration ends when the returned guard is dropped.
    pub fn register_call(self: &Arc<Self>, session: SessionId, request: RequestId) -> Registration {
        Registration {
            waiters: self.clone(),
            key: (session, request),
            rx: Some(self.register(session, request)),
        }
    }

    fn register(&self, session: SessionId, request: RequestId) -> oneshot::Receiver<WaitEnd> {
        let (tx, rx) = oneshot::channel();
        self.map
            .lock()
            .expect("waiters lock")
            .entry((session, request))
            .or_default()
            .push(tx);
        rx
    }

    /// Acquire calls registered here (each waits for a grant, or has not yet dropped its
    /// registration).
    pub fn registered(&self) -> usize {
        self.map
            .lock()
            .expect("waiters lock")
            .values()
            .map(Vec::len)
            .sum()
    }

    /// Drops registrations whose caller went away (only through [`Registration`]'s drop, so that a
    /// call's own receiver is always gone first).
    fn forget(&self, session: SessionId, request: RequestId) {
        let mut map = self.map.lock().expect("waiters lock");
        if let Some(list) = map.get_mut(&(session, request)) {
            list.retain(|tx| !tx.is_closed());
            if list.is_empty() {
                map.remove(&(session, request));
            }
        }
    }

    fn on_events(&self, events: &[Event]) {
        let mut map = self.map.lock().expect("waiters lock");
        if map.is_empty() {
            return;
        }
        for event in events {
            let (key, end) = match event {
                Event::Granted {
                    session,
                    request,
                    token,
                    ..
                } => ((*session, *request), WaitEnd::Granted(*token)),
                Event::WaiterRemoved {
                    session, request, ..
                } => ((*session, *request), WaitEnd::Removed),
                _ => continue,
            };
            for tx in map.remove(&key).into_iter().flatten() {
                let _ = tx.send(end);
            }
        }
    }
}

pub struct Group {
    /// Bytes of log entries this server appended for the group, from the size of the log it replayed
    /// after its snapshot at start (monotonic; see `LogStore`).
    pub log_bytes: Arc<std::sync::atomic::AtomicU64>,
    /// When the snapshots openraft's policy asks for are built (`state_machine::SnapshotPacing`).
    pub pacing: Arc<crate::state_machine::SnapshotPacing>,
    /// The group's replication targets as its leader sees them, and how many waits followed a late
    /// reply (`peer::LATE_WAIT`).
    pub acks: Arc<crate::peer::Acks>,
    pub id: u32,
    pub raft: Raft,
    pub state: Arc<RwLock<SmState>>,
    pub leases: Arc<Leases>,
    pub waiters: Arc<Waiters>,
    pub metrics: Arc<GroupMetrics>,
    metrics_rx: openraft::alias::WatchReceiverOf<TypeConfig, RaftMetrics<TypeConfig>>,
    /// How long after its last quorum contact a leader may still renew sessions (see [`Group::can_renew`]).
    renew_guard: Duration,
    /// This leader is handing leadership over ([`Group::hand_over`]): it has stopped timing and renewing
    /// sessions and must not start again in this term.
    handing_over: std::sync::atomic::AtomicBool,
    /// Signalled when a hand-over ends, so that [`Group::run_leadership`] looks again at once.
    hand_over_ended: tokio::sync::Notify,
    /// The memory budget this server's configuration gives the group's table (0: none); a leader puts
    /// it into the log when the table's differs.
    table_budget: u64,
    /// What the other servers said they read; `None` with `--compat-no-expire-sessions` (this server
    /// acts as one older than batched expiries).
    peer_features: Option<crate::peer::PeerFeatures>,
    /// Held while expiry batches are proposed, so that they go into the log one at a time.
    expiring: tokio::sync::Mutex<()>,
    /// Drops the table of an idle group this server is not a voter of (see `node::unload_idle_groups`).
    pub unloader: crate::state_machine::Unloader,
    /// The group's leader as the other members said it last (0: none), in a placed cluster where this
    /// server is not a voter of every group (see `node::Directory`, [`Group::leader_hint`]).
    learned_leader: std::sync::atomic::AtomicU64,
}

/// How long the expiry task waits, once something came due, before it looks: every session that comes
/// due meanwhile goes into the same batch, and the heap entries of sessions renewed since they were
/// pushed go back in bulk instead of one wake-up each. Expiries and lock-delay ends happen up to this
/// much later than their deadlines, never earlier.
const EXPIRY_GATHER: Duration = Duration::from_millis(50);

/// A just-elected leader refuses requests until a quorum has acknowledged it (LeaseExpired, no leader
/// id): a reason to wait briefly here, not to send the client elsewhere.
fn still_becoming_leader(
    f: &openraft::errors::ForwardToLeader<TypeConfig>,
    give_up: Instant,
) -> bool {
    f.reason == ForwardReason::LeaseExpired && f.leader_id.is_none() && Instant::now() < give_up
}

/// True if this server is a voter of the newest configuration it has of the group (of either half,
/// during a joint change).
pub fn a_voter(id: u64, membership: &openraft::alias::StoredMembershipOf<TypeConfig>) -> bool {
    membership
        .membership()
        .get_joint_config()
        .iter()
        .any(|voters| voters.contains(&id))
}

/// The state-machine event sink for a group: follows the log into the leases and the waiting acquires.
pub fn event_sink(leases: Arc<Leases>, waiters: Arc<Waiters>) -> crate::state_machine::EventSink {
    Arc::new(move |_state: &SmState, events: Vec<Event>| {
        leases.on_events(&events, Instant::now());
        waiters.on_events(&events);
    })
}

/// Ends a [`Group::hand_over`] when dropped: clears the flag and wakes [`Group::run_leadership`],
/// which restarts session timers after a barrier, as in any new term, if this server still leads.
struct HandOverEnds<'a>(&'a Group);

impl Drop for HandOverEnds<'_> {
    fn drop(&mut self) {
        self.0.leases.end_hand_over();
        self.0.handing_over.store(false, Relaxed);
        self.0.hand_over_ended.notify_one();
    }
}

impl Group {
    #[allow(
        clippy::too_many_arguments,
        reason = "the parts node.rs builds for each group, and the configuration"
    )]
    pub fn new(
        id: u32,
        raft: Raft,
        state: Arc<RwLock<SmState>>,
        leases: Arc<Leases>,
        waiters: Arc<Waiters>,
        log_bytes: Arc<std::sync::atomic::AtomicU64>,
        pacing: Arc<crate::state_machine::SnapshotPacing>,
        config: &ServerConfig,
        peer_features: crate::peer::PeerFeatures,
        unloader: crate::state_machine::Unloader,
        acks: Arc<crate::peer::Acks>,
    ) -> Self {
        let metrics_rx = raft.metrics();
        // Followers refuse to vote for a new leader until election_timeout_max after they last heard the
        // leader, and the leader's last quorum contact is the *send* time of a heartbeat a quorum acked. So
        // no other leader can exist before last_quorum_acked + election_timeout_max; renewing only within 3/4
        // of that leaves a quarter for clock-rate differences between servers.
        let renew_guard = Duration::from_millis(config.election_timeout_max_ms * 3 / 4);
        Group {
            id,
            raft,
            state,
            leases,
            waiters,
            metrics: Arc::new(GroupMetrics::default()),
            metrics_rx,
            renew_guard,
            handing_over: Default::default(),
            learned_leader: Default::default(),
            hand_over_ended: Default::default(),
            log_bytes,
            pacing,
            acks,
            table_budget: config.group_table_budget(),
            peer_features: (!config.compat_no_expire_sessions).then_some(peer_features),
            expiring: tokio::sync::Mutex::new(()),
            unloader,
        }
    }

    /// Hands leadership of this group to `to` (or the follower whose log is the most up to date) and
    /// waits, up to `within`, until this server no longer leads; returns the new leader.
    ///
    /// Safety: the target is elected without waiting out the followers' vote lease, which is what makes
    /// keepalives safe to acknowledge (see [`Group::can_renew`]). So this server stops renewing sessions
    /// *before* it asks for the transfer: no keepalive it acknowledges can outlive a deadline of the new
    /// leader, which starts every session with a full fresh TTL anyway.
    pub async fn hand_over(&self, to: Option<u64>, within: Duration) -> Result<u64, String> {
        let m = self.raft_metrics();
        if m.state != ServerState::Leader {
            return Err(format!("this server does not lead group {}", self.id));
        }
        let voters: Vec<u64> = m
            .membership_config
            .membership()
            .voter_ids()
            .filter(|&n| n != m.id)
            .collect();
        let target = match to {
            Some(t) if voters.contains(&t) => t,
            Some(t) => {
                return Err(format!(
                    "node {t} is not a voter of group {} (voters besides this server: {voters:?})",
                    self.id
                ))
            }
            None => {
                let matched = |n: &u64| {
                    m.replication
                        .as_ref()
                        .and_then(|r| r.get(n).cloned().flatten())
                        .map_or(0, |l| l.index)
                };
                *voters
                    .iter()
                    .max_by_key(|n| (matched(n), std::cmp::Reverse(**n)))
                    .ok_or_else(|| {
                        format!("group {} has no other voter to hand over to", self.id)
                    })?
            }
        };
        // One hand-over at a time (the balancer, an operator's transfer and shutdown may overlap).
        if self
            .handing_over
            .compare_exchange(false, true, Relaxed, Relaxed)
            .is_err()
        {
            return Err(format!(
                "group {} is already handing its leadership over",
                self.id
            ));
        }
        // However this ends, also when the caller drops the call half way (a TransferLeader or
        // RemoveMember whose client gave up): a flag left set keeps this leader from ever timing,
        // renewing or expiring sessions again in its term (found by the simulation with openraft's
        // timers on skewed clocks, seed 1,003,702: no session expired, the table filled).
        let _ended = HandOverEnds(self);
        self.leases.begin_hand_over();
        async {
            self.raft
                .trigger()
                .transfer_leader(target)
                .await
                .map_err(|e| e.to_string())?;
            let mut rx = self.raft.metrics();
            let wait = async {
                loop {
                    let (state, leader) = {
                        let m = rx.borrow_watched();
                        (m.state, m.current_leader)
                    };
                    if state != ServerState::Leader && leader.is_some_and(|l| l != m.id) {
                        return leader;
                    }
                    if rx.changed().await.is_err() {
                        return None;
                    }
                }
            };
            match tokio::time::timeout(within, wait).await {
                Ok(Some(leader)) => Ok(leader),
                Ok(None) => Err("raft stopped".to_string()),
                Err(_) => Err(format!("node {target} did not take over within {within:?}")),
            }
        }
        .await
    }

    /// True while [`Group::hand_over`] runs.
    pub fn is_handing_over(&self) -> bool {
        self.handing_over.load(Relaxed)
    }

    pub fn raft_metrics(&self) -> RaftMetrics<TypeConfig> {
        self.metrics_rx.borrow_watched().clone()
    }

    pub fn current_leader(&self) -> Option<u64> {
        self.metrics_rx.borrow_watched().current_leader
    }

    /// The leader to send a client to, given this server's own idea of it (`own`): that, unless this
    /// server is not a voter of the group (it left it, so its idea is the leader of then, perhaps long
    /// dead) and the members it asks named the group's leader ([`Group::learn_leader`]).
    pub fn leader_hint(&self, own: Option<u64>) -> Option<u64> {
        let learned = self
            .learned_leader
            .load(std::sync::atomic::Ordering::Relaxed);
        if learned == 0 {
            return own;
        }
        let m = self.metrics_rx.borrow_watched();
        if a_voter(m.id, &m.membership_config) {
            own
        } else {
            Some(learned)
        }
    }

    /// Notes the leader the other members named (`None`: none did, or this server no longer asks).
    pub fn learn_leader(&self, leader: Option<u64>) {
        self.learned_leader
            .store(leader.unwrap_or(0), std::sync::atomic::Ordering::Relaxed);
    }

    /// True if this server may acknowledge keepalives now: it leads, has started timing sessions for this
    /// term, and heard from a quorum recently enough that no newer leader can exist.
    pub fn can_renew(&self) -> bool {
        let m = self.metrics_rx.borrow_watched();
        self.leases.leading_term() == Some(m.current_term) && self.confirmed(&m)
    }

    /// True if this server leads and a quorum acknowledged it recently enough that no newer leader can
    /// exist: it can serve writes and linearizable reads now.
    pub fn quorum_confirmed(&self) -> bool {
        self.confirmed(&self.metrics_rx.borrow_watched())
    }

    fn confirmed(&self, m: &RaftMetrics<TypeConfig>) -> bool {
        m.state == ServerState::Leader
            && m.last_quorum_acked
                .as_ref()
                .is_some_and(|t| t.elapsed() < self.renew_guard)
    }

    /// Proposes `command` and waits until it is committed and applied here.
    pub async fn propose(&self, command: Command) -> Result<Outcome, ProposeError> {
        match self.propose_for_response(command).await? {
            Response::Outcome(o) | Response::Opened { outcome: o, .. } => Ok(o),
            Response::None => Err(ProposeError::Unknown(
                "entry applied without an outcome".into(),
            )),
        }
    }

    /// Opens a session with a secret: the outcome and the session's secret.
    pub async fn propose_open(&self, command: Command) -> Result<(Outcome, u128), ProposeError> {
        match self.propose_for_response(command).await? {
            Response::Opened { outcome, secret } => Ok((outcome, secret)),
            Response::Outcome(o) => Ok((o, 0)),
            Response::None => Err(ProposeError::Unknown(
                "entry applied without an outcome".into(),
            )),
        }
    }

    async fn propose_for_response(&self, command: Command) -> Result<Response, ProposeError> {
        let give_up = Instant::now() + NEW_LEADER_RETRY;
        let request = Request::new(command);
        loop {
            let started = Instant::now();
            self.metrics.proposals.inc();
            tracing::trace!(target: "holdfast::hop", group = self.id, "propose");
            let write =
                tokio::time::timeout(PROPOSE_TIMEOUT, self.raft.client_write(request.clone()));
            let written = write.await;
            tracing::trace!(target: "holdfast::hop", group = self.id, "proposed");
            let Ok(written) = written else {
                return Err(ProposeError::Unknown(format!(
                    "not committed within {PROPOSE_TIMEOUT:?}"
                )));
            };
            match written {
                Ok(resp) => {
                    crate::metrics::observe(&self.metrics.commit, started.elapsed());
                    return Ok(resp.data);
                }
                Err(RaftError::APIError(ClientWriteError::ForwardToLeader(f))) => {
                    // Retrying is safe: a refused entry was not appended.
                    if still_becoming_leader(&f, give_up) {
                        tokio::time::sleep(Duration::from_millis(20)).await;
                        continue;
                    }
                    return Err(ProposeError::NotLeader(self.leader_hint(f.leader_id)));
                }
                Err(RaftError::APIError(ClientWriteError::LogEntryDiscarded(_))) => {
                    return Err(ProposeError::Unknown(
                        "leadership changed before the entry committed".into(),
                    ))
                }
                Err(RaftError::APIError(other)) => {
                    return Err(ProposeError::Unknown(other.to_string()))
                }
                Err(RaftError::Fatal(f)) => return Err(ProposeError::Stopped(f.to_string())),
            }
        }
    }

    /// The group's membership as this server knows it: the voters of the newest configuration (the
    /// target of a joint change in progress), learners, whether a joint change is in progress, and the
    /// log id of the entry that made it.
    pub fn membership_view(&self) -> MembershipView {
        let m = self.raft_metrics();
        let stored = &m.membership_config;
        let joint = stored.membership().get_joint_config();
        MembershipView {
            voters: joint
                .last()
                .map(|set| set.iter().copied().collect())
                .unwrap_or_default(),
            learners: stored.membership().learner_ids().collect(),
            joint: joint.len() > 1,
            log_id: *stored.log_id(),
        }
    }

    fn ensure_leader(&self) -> Result<(), ProposeError> {
        let m = self.raft_metrics();
        if m.state == ServerState::Leader {
            Ok(())
        } else {
            Err(ProposeError::NotLeader(
                self.leader_hint(m.current_leader.filter(|&l| l != m.id)),
            ))
        }
    }

    /// Adds `id` as a learner, waits until it has caught up, then makes it a voter (joint consensus). On
    /// the leader only. A voter of a settled configuration is left alone; a change left joint by an
    /// interrupted earlier call is finished.
    pub async fn add_member(&self, id: u64, node: MemberNode) -> Result<(), ProposeError> {
        self.ensure_leader()?;
        let view = self.membership_view();
        if !view.joint && view.voters.contains(&id) {
            return Ok(());
        }
        // openraft keeps a known node's addresses on a re-add; say so instead of keeping them silently.
        if let Some(known) = self
            .raft_metrics()
            .membership_config
            .membership()
            .get_node(&id)
            .filter(|known| **known != node)
        {
            return Err(ProposeError::Refused(format!(
                "node {id} is already known as {known} (client/peer); remove it first to change its addresses"
            )));
        }
        let learner =
            tokio::time::timeout(MEMBER_CHANGE_TIMEOUT, self.raft.add_learner(id, node, true));
        membership_result(learner.await, "adding the learner")?;
        let voter = tokio::time::timeout(
            MEMBER_CHANGE_TIMEOUT,
            self.raft
                .change_membership(ChangeMembers::AddVoterIds(BTreeSet::from([id])), false),
        );
        membership_result(voter.await, "promoting the learner to voter")
    }

    /// Refuses removing voter `id` when fewer than 3 voters would remain, unless `force`.
    pub fn check_removal(
        &self,
        view: &MembershipView,
        id: u64,
        force: bool,
    ) -> Result<(), ProposeError> {
        if !view.voters.contains(&id) || force {
            return Ok(());
        }
        let remaining = view.voters.len() - 1;
        if remaining < 3 {
            return Err(ProposeError::Refused(format!(
                "removing node {id} would leave group {} with {remaining} voters, which survives {} failures; give force to do it anyway",
                self.id,
                remaining.saturating_sub(1) / 2
            )));
        }
        Ok(())
    }

    /// Removes voter or learner `id` (and its node). On the leader only. Refused when fewer than 3 voters
    /// would remain, unless `force`; the check and the change are tied together by the membership log id
    /// the check saw, so a concurrent change makes this one fail (and a retry check again) instead of
    /// both passing the check.
    pub async fn remove_member(&self, id: u64, force: bool) -> Result<(), ProposeError> {
        self.ensure_leader()?;
        let view = self.membership_view();
        self.check_removal(&view, id, force)?;
        let mut view = view;
        if view.voters.contains(&id) && !view.joint {
            // First a learner, then gone. openraft stops replicating to a removed voter as soon as the
            // leader appends the configuration without it, so a voter removed in one step never learns
            // it was removed and stands for election in this group for as long as it runs (harmless to
            // the others, whose logs are longer, but endless). Kept as a learner, it receives the
            // configuration that makes it one, and then stops standing (`run_leadership`); a server
            // that leaves some groups but stays in others (`holdfast member place`) needs that.
            let demoted = tokio::time::timeout(
                MEMBER_CHANGE_TIMEOUT,
                self.raft.change_membership_if(
                    ChangeMembers::RemoveVoters(BTreeSet::from([id])),
                    true,
                    [openraft::raft::Precondition::LastMembershipLogId {
                        last_membership_log_id: view.log_id,
                    }],
                ),
            );
            membership_result(demoted.await, "making the voter a learner")?;
            view = self.membership_view();
            let config_index = view.log_id.map_or(0, |l| l.index);
            // Best effort, and only for a server that answered this leader lately: one that is down
            // learns nothing (and is stopped anyway), so waiting for it would only slow a replacement.
            let live = self
                .raft_metrics()
                .heartbeat
                .as_ref()
                .and_then(|h| h.get(&id).cloned().flatten())
                .is_some_and(|at| openraft::Instant::elapsed(&*at) < self.renew_guard);
            let reached = if !live {
                Ok(())
            } else {
                self.raft
                    .wait(Some(DEMOTED_LEARNER_WAIT))
                    .metrics(
                        |m| {
                            m.replication
                                .as_ref()
                                .and_then(|r| r.get(&id).cloned().flatten())
                                .is_some_and(|l| l.index >= config_index)
                        },
                        "the demoted voter has the configuration that makes it a learner",
                    )
                    .await
                    .map(|_| ())
            };
            if reached.is_err() {
                tracing::info!(
                    group = self.id,
                    node = id,
                    "the removed voter did not receive its removal within {DEMOTED_LEARNER_WAIT:?}; removing it anyway"
                );
            }
        }
        let change = if view.voters.contains(&id) {
            ChangeMembers::RemoveVoters(BTreeSet::from([id]))
        } else if view.learners.contains(&id) {
            ChangeMembers::RemoveNodes(BTreeSet::from([id]))
        } else if view.joint {
            // A removal left joint by an interrupted call: finish it.
            ChangeMembers::RemoveVoters(BTreeSet::new())
        } else {
            return Ok(());
        };
        let removed = tokio::time::timeout(
            MEMBER_CHANGE_TIMEOUT,
            self.raft.change_membership_if(
                change,
                false,
                [openraft::raft::Precondition::LastMembershipLogId {
                    last_membership_log_id: view.log_id,
                }],
            ),
        );
        membership_result(removed.await, "removing the member")
    }

    /// Waits until this server may serve a linearizable read of the state machine: it is the leader, a
    /// quorum has confirmed it (ReadIndex), and it has applied everything committed before the read.
    pub async fn linearizable_read(&self) -> Result<(), ProposeError> {
        let give_up = Instant::now() + NEW_LEADER_RETRY;
        loop {
            let read = tokio::time::timeout(
                PROPOSE_TIMEOUT,
                self.raft.ensure_linearizable(ReadPolicy::ReadIndex),
            );
            let Ok(read) = read.await else {
                return Err(ProposeError::Unknown(format!(
                    "no quorum confirmed this leader within {PROPOSE_TIMEOUT:?}"
                )));
            };
            match read {
                Ok(_) => return Ok(()),
                Err(RaftError::APIError(LinearizableReadError::ForwardToLeader(f))) => {
                    if still_becoming_leader(&f, give_up) {
                        tokio::time::sleep(Duration::from_millis(20)).await;
                        continue;
                    }
                    return Err(ProposeError::NotLeader(self.leader_hint(f.leader_id)));
                }
                Err(RaftError::APIError(LinearizableReadError::QuorumNotEnough(q))) => {
                    if Instant::now() < give_up {
                        tokio::time::sleep(Duration::from_millis(50)).await;
                        continue;
                    }
                    return Err(ProposeError::Unknown(format!(
                        "no quorum confirmed this leader: {q}"
                    )));
                }
                Err(RaftError::Fatal(f)) => return Err(ProposeError::Stopped(f.to_string())),
            }
        }
    }

    /// Runs until Raft shuts down: follows this server's role, starting session timers (after a
    /// linearizable barrier, so every entry of earlier terms is applied) when it becomes leader, and
    /// dropping them when it stops leading.
    pub async fn run_leadership(self: Arc<Self>) {
        // The server metrics (role, vote, leader, membership), not `Raft::metrics`: openraft publishes
        // the full metrics on every turn of its core loop (each message, I/O completion and 10 ms
        // tick), while these change only when one of those does. Woken by the full metrics, this task
        // ran ~6 times per log entry and ~100 times a second idle, for nothing.
        let mut rx = self.raft.server_metrics();
        let mut last_leader = None;
        let mut eligible_before = None;
        let mut membership_before = None;
        loop {
            let (state, term, leader) = {
                let m = rx.borrow_watched();
                (m.state, m.vote.leader_id().term, m.current_leader)
            };
            if leader != last_leader {
                self.metrics.leader_changes.inc();
                last_leader = leader;
            }
            // A server stands for election in this group only while its newest configuration counts
            // it a voter (or it has none yet). openraft would also let it stand while its committed
            // configuration does, which a server removed from the group (and told so, see
            // `remove_member`) may keep for good, since nothing reaches it afterwards. Not standing
            // cannot break safety (it still votes), nor liveness: the configuration that leaves it out
            // has the voters to elect a leader without it. (No allocation: this runs on every change
            // of the server metrics.)
            let eligible = {
                let m = rx.borrow_watched();
                m.membership_config.membership().nodes().next().is_none()
                    || a_voter(m.id, &m.membership_config)
            };
            {
                // What replication counts as a late acknowledgement (`peer::LATE_WAIT`) follows the
                // newest membership (compared by its log id, so this allocates only when it changes).
                let m = rx.borrow_watched();
                let at = Some(*m.membership_config.log_id());
                if membership_before != at {
                    self.acks
                        .set_membership(m.id, m.membership_config.membership());
                    membership_before = at;
                }
            }
            if eligible_before != Some(eligible) {
                self.raft.runtime_config().elect(eligible);
                if eligible_before.is_some() || !eligible {
                    tracing::info!(
                        group = self.id,
                        eligible,
                        "{}",
                        if eligible {
                            "a voter of this group's newest configuration: stands for election"
                        } else {
                            "not a voter of this group's newest configuration: stands for no election"
                        }
                    );
                }
                eligible_before = Some(eligible);
            }
            if state == ServerState::Leader && !self.handing_over.load(Relaxed) {
                if self.leases.leading_term() != Some(term) {
                    self.leases.stop_leading();
                    // The barrier makes sure an ExpireSession proposed by an earlier leader is either applied
                    // (the session is gone) or will never commit, before any keepalive is acknowledged.
                    let barrier = self.linearizable_read().await;
                    if let Err(e) = &barrier {
                        // Metrics say leader but the barrier failed (e.g. openraft forwards reads while a
                        // membership change leaves this leader outside the voters). Without a pause
                        // each failed read changes the metrics and wakes this loop again at once: a
                        // hot loop (found by the simulation's server replacements, seed 80).
                        tracing::debug!(group = self.id, ?e, "leader barrier failed; retrying");
                        tokio::time::sleep(Duration::from_millis(50)).await;
                        continue;
                    }
                    {
                        let s = self.state.read().expect("state machine lock poisoned");
                        let still = rx.borrow_watched();
                        if still.state == ServerState::Leader
                            && still.vote.leader_id().term == term
                            // False if a hand-over began while the barrier ran.
                            && self.leases.start_leading(
                                term,
                                s.table.session_leases(),
                                s.table.delayed_locks(),
                                Instant::now(),
                            )
                        {
                            tracing::info!(
                                group = self.id,
                                term,
                                sessions = s.table.session_count(),
                                "leading: session timers started with a fresh TTL"
                            );
                            if s.table.table_budget() != self.table_budget {
                                tokio::spawn(self.clone().set_table_budget(term));
                            }
                        }
                        continue;
                    }
                }
            } else if self.leases.leading_term().is_some() {
                self.leases.stop_leading();
                tracing::info!(
                    group = self.id,
                    term,
                    "no longer leading: session timers stopped"
                );
            }
            tokio::select! {
                changed = rx.changed() => if changed.is_err() {
                    return;
                },
                // A failed hand-over leaves this server leading in the same term, which may change no
                // metric: look again now (`notify_one` keeps the wake-up if this loop is not waiting).
                _ = self.hand_over_ended.notified() => {}
            }
        }
    }

    /// Puts this server's table budget into the log while it leads in `term`, retrying an unknown
    /// outcome (proposing it twice is harmless: the second sets the same budget).
    async fn set_table_budget(self: Arc<Self>, term: u64) {
        let command = Command::SetTableBudget {
            bytes: self.table_budget,
            now_ms: crate::now_ms(),
        };
        while self.leases.leading_term() == Some(term) {
            match self.propose(command.clone()).await {
                Ok(outcome) => {
                    tracing::info!(
                        group = self.id,
                        bytes = self.table_budget,
                        ?outcome,
                        "table budget set"
                    );
                    return;
                }
                Err(ProposeError::NotLeader(Some(_))) => return,
                Err(e @ (ProposeError::Stopped(_) | ProposeError::Refused(_))) => {
                    tracing::warn!(group = self.id, ?e, "table budget not proposed");
                    return;
                }
                Err(e) => {
                    tracing::warn!(
                        group = self.id,
                        ?e,
                        "table budget not committed; will retry"
                    );
                    tokio::time::sleep(Duration::from_millis(500)).await;
                }
            }
        }
    }

    /// Runs until Raft shuts down: proposes `ExpireSession(s)` for every session whose deadline passed, and
    /// `EndLockDelay` for every lock-delay that ran its time.
    pub async fn run_expiry(self: Arc<Self>, mut shutdown: tokio::sync::watch::Receiver<bool>) {
        loop {
            let next = self
                .leases
                .next_deadline()
                .unwrap_or_else(|| Instant::now() + Duration::from_secs(1));
            tokio::select! {
                _ = tokio::time::sleep_until(next) => {}
                _ = self.leases.wake.notified() => continue,
                _ = shutdown.changed() => return,
            }
            tokio::time::sleep(EXPIRY_GATHER).await;
            // A stalled process runs nothing: in the simulation this loop waits out a clock stall
            // (`crate::skew`), then finds every deadline that passed meanwhile due at once.
            #[cfg(holdfast_sim)]
            crate::skew::wait_unstalled().await;
            for delay in self.leases.take_due_delays(Instant::now()) {
                let group = self.clone();
                tokio::spawn(async move {
                    match group.propose(delay.end(crate::now_ms())).await {
                        Ok(outcome) => tracing::info!(
                            group = group.id,
                            name = delay.name.as_str(),
                            token = delay.token.0,
                            began = delay.began,
                            ?outcome,
                            "lock-delay ended"
                        ),
                        Err(ProposeError::NotLeader(Some(_))) => {}
                        // NotLeader(None) includes a leader whose lease lapsed for a moment in the same
                        // term (no new start_leading would time this delay again): retry, which stops
                        // by itself once this server no longer leads. Ending a delay twice is harmless:
                        // the end names its delay (token, and for a shared one the expiry's index), so
                        // a second one changes nothing and never ends a newer delay.
                        Err(e) => {
                            tracing::warn!(
                                group = group.id,
                                name = delay.name.as_str(),
                                ?e,
                                "lock-delay end not committed; will retry"
                            );
                            group
                                .leases
                                .retry_delay(delay, Instant::now() + Duration::from_millis(500));
                        }
                    }
                });
            }
            let term = self.leases.leading_term();
            let due = self.leases.take_due(Instant::now());
            if due.is_empty() {
                continue;
            }
            if let Some(term) = term.filter(|_| self.expires_in_batches()) {
                tokio::spawn(self.clone().expire_in_batches(term, due));
            } else {
                for session in due {
                    tokio::spawn(self.clone().expire_one(session));
                }
            }
        }
    }

    /// Whether every other member of the group reads `Command::ExpireSessions` (its latest
    /// AppendEntries reply said so), and this server is not acting as one older than it.
    fn expires_in_batches(&self) -> bool {
        let Some(features) = &self.peer_features else {
            return false;
        };
        let m = self.metrics_rx.borrow_watched();
        let me = m.id;
        let others = m
            .membership_config
            .membership()
            .nodes()
            .map(|(id, _)| *id)
            .filter(|&id| id != me)
            .collect::<Vec<_>>();
        features.all_have(others, crate::formats::FEATURE_EXPIRE_SESSIONS)
    }

    /// Expires `due` in `Command::ExpireSessions` entries sized by the table
    /// ([`holdfast_lock_table::LockTable::expiry_batches`]: at most 1,000 sessions and 10,000 locks and
    /// waits an entry), one entry at a time: each is committed before the next is proposed, so a mass
    /// expiry (a fleet of clients gone at once) leaves room in the log for everything else, as etcd
    /// limits its lease revocations. A batch the table refuses (it changed since the batch was sized)
    /// is expired one session an entry. Before each entry the batch keeps only the sessions this server
    /// may still expire in `term` (none once it no longer times sessions in that term: a session given
    /// a fresh TTL since may have been renewed), and if a member now predates batches the rest go one
    /// session an entry.
    async fn expire_in_batches(self: Arc<Self>, term: u64, due: Vec<SessionId>) {
        let _one_at_a_time = self.expiring.lock().await;
        let batches = (self
            .state
            .read()
            .expect("state machine lock poisoned")
            .table)
            .expiry_batches(&due);
        for batch in batches {
            let batch = self.leases.still_expiring(term, &batch);
            if batch.is_empty() {
                continue;
            }
            if !self.expires_in_batches() {
                for session in batch {
                    tokio::spawn(self.clone().expire_one(session));
                }
                continue;
            }
            let command = Command::ExpireSessions {
                sessions: batch.clone(),
                now_ms: crate::now_ms(),
            };
            match self.propose(command).await {
                Ok(Outcome::Refused(refusal)) => {
                    tracing::info!(
                        group = self.id,
                        sessions = batch.len(),
                        ?refusal,
                        "expiry batch refused; expiring one session an entry"
                    );
                    for session in batch {
                        tokio::spawn(self.clone().expire_one(session));
                    }
                }
                Ok(outcome) => {
                    self.metrics.expiries.inc_by(batch.len() as u64);
                    tracing::info!(
                        group = self.id,
                        sessions = batch.len(),
                        first = batch[0].0,
                        ?outcome,
                        "sessions expired"
                    );
                    tracing::debug!(group = self.id, ids = ?batch.iter().map(|s| s.0).collect::<Vec<_>>(), "sessions expired");
                }
                Err(ProposeError::NotLeader(Some(_))) => return,
                // As for one session: retry each (a no-op once this server no longer leads).
                Err(e) => {
                    tracing::warn!(
                        group = self.id,
                        sessions = batch.len(),
                        ?e,
                        "expiry batch not committed; will retry"
                    );
                    let at = Instant::now() + Duration::from_millis(500);
                    for session in batch {
                        self.leases.retry_expiry(session, at);
                    }
                }
            }
        }
    }

    /// Expires one session with `Command::ExpireSession` (a member of the group predates batches).
    async fn expire_one(self: Arc<Self>, session: SessionId) {
        let group = self;
        let command = Command::ExpireSession {
            session,
            now_ms: crate::now_ms(),
        };
        match group.propose(command).await {
            Ok(outcome) => {
                group.metrics.expiries.inc();
                tracing::info!(
                    group = group.id,
                    session = session.0,
                    ?outcome,
                    "session expired"
                );
            }
            Err(ProposeError::NotLeader(Some(_))) => {}
            // As for lock-delays (`run_expiry`): a lease that lapsed within the term gets no new
            // start_leading, so retry (a no-op once this server stops leading).
            Err(e) => {
                tracing::warn!(
                    group = group.id,
                    session = session.0,
                    ?e,
                    "expiry not committed; will retry"
                );
                group
                    .leases
                    .retry_expiry(session, Instant::now() + Duration::from_millis(500));
            }
        }
    }

    /// Asks openraft for a snapshot now, one that its pacing does not defer (openraft ignores the ask
    /// while it builds one already).
    pub async fn snapshot_now(
        &self,
    ) -> Result<(), openraft::error::Fatal<crate::raft_types::TypeConfig>> {
        self.pacing.force();
        self.raft.trigger().snapshot().await
    }

    /// Snapshots this group and purges its whole log up to the snapshot, ignoring the entries normally
    /// kept behind it: for a group whose old records keep a WAL segment on disk (see
    /// `holdfast_wal::Wal::pinning_groups`), which a group that rarely writes would otherwise do for ever.
    /// A follower that needs the purged entries gets the snapshot instead.
    pub async fn compact_log(&self) {
        let m = self.raft_metrics();
        let applied = m.last_applied.map(|l| l.index);
        let before = m.snapshot.map(|l| l.index);
        if before < applied {
            if let Err(e) = self.snapshot_now().await {
                tracing::warn!(group = self.id, %e, "cannot snapshot to free a wal segment");
                return;
            }
            // openraft ignores the trigger while a snapshot is already being built; either way a new
            // snapshot appears, and whatever it covers is purged (the next look catches the rest).
            let deadline = Instant::now() + COMPACT_TIMEOUT;
            while self.raft_metrics().snapshot.map(|l| l.index) == before {
                if Instant::now() > deadline {
                    tracing::warn!(
                        group = self.id,
                        "snapshot to free a wal segment not built within {COMPACT_TIMEOUT:?}"
                    );
                    return;
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
        if let Some(snapshot) = self.raft_metrics().snapshot {
            tracing::info!(
                group = self.id,
                upto = snapshot.index,
                "purging the log to free an old wal segment"
            );
            if let Err(e) = self.raft.trigger().purge_log(snapshot.index).await {
                tracing::warn!(group = self.id, %e, "cannot purge the log");
            }
        }
    }
}
