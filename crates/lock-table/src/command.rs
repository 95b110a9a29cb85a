//! Commands (the payload of a Raft log entry) and what applying one returns.
//!
//! A command carries `now_ms`, the leader's wall-clock time when it proposed the entry. The table stores it
//! only for display (granted-at, opened-at); no decision in the table depends on it, so a clock jump on a
//! leader can make a display odd but can never change who holds a lock.

use crate::types::{FencingToken, LockName, RequestId, SessionId};
use serde::{Deserialize, Serialize};

/// How an acquire behaves when the lock is held.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum AcquireMode {
    /// Refuse at once, describing the current holder.
    Try,
    /// Join the lock's FIFO queue. The server removes the waiter with [`Command::CancelWait`] when the
    /// client's deadline passes.
    Wait,
}

/// How an acquire shares the lock with other holders ([`Command::WithShare`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub enum Share {
    /// The only holder (a mutex, or the writer of a read/write lock). What every acquire without a
    /// `WithShare` asks for.
    #[default]
    Exclusive,
    /// One of any number of shared holders (readers), none exclusive.
    Shared,
    /// One of at most `permits` holders of a semaphore. The first acquire of a free name fixes
    /// `permits` for as long as the semaphore is held or waited for; an acquire asking for another
    /// number (or the name as a lock) is [`Refusal::PermitsMismatch`].
    Permits(u32),
}

impl Share {
    /// Whether a grant shares the lock, and the semaphore's permits (0: a lock, not a semaphore).
    pub fn parts(self) -> (bool, u32) {
        match self {
            Share::Exclusive => (false, 0),
            Share::Shared => (true, 0),
            Share::Permits(n) => (false, n),
        }
    }
}

/// One state change. Every variant is one log entry.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Command {
    /// Open a session. `nonce` is chosen by the client so a retried open returns the same session.
    OpenSession {
        nonce: u128,
        ttl_ms: u64,
        now_ms: u64,
    },
    /// The client closes its session: its locks are released and its waits removed.
    CloseSession { session: SessionId, now_ms: u64 },
    /// The leader saw no keepalive for a full TTL: same effect as a close.
    ExpireSession { session: SessionId, now_ms: u64 },
    /// [`Command::Acquire`] as logs written before acquire attempts existed encode it (this position in
    /// the enum is its encoding). Applied as an acquire of attempt 0; never proposed any more.
    AcquireBeforeAttempts {
        session: SessionId,
        request: RequestId,
        name: LockName,
        mode: AcquireMode,
        value: Box<[u8]>,
        now_ms: u64,
    },
    /// Release requires the token of the current grant, so a late release from an old grant changes nothing.
    Release {
        session: SessionId,
        request: RequestId,
        name: LockName,
        token: FencingToken,
        now_ms: u64,
    },
    /// Remove the waiter that `request` (the acquire's request id) created. If the waiter was granted the
    /// lock before this entry, the outcome is that grant: the log order decides the race.
    CancelWait {
        session: SessionId,
        request: RequestId,
        name: LockName,
        now_ms: u64,
    },
    /// Nobody will learn the outcome of the acquire `request`, so nobody may be left holding or waiting
    /// because of it: its wait is removed, or, if it was granted and the grant is still current, the lock
    /// is released (to the next waiter). A retry of the acquire after this entry gets
    /// [`Outcome::Abandoned`].
    ///
    /// `attempt` says whose decision this is. `None`: the client's own (it gave up): it applies to the
    /// request whatever call made it, and a request id the session has not used yet is remembered as
    /// abandoned, so an acquire with it that reaches the log later changes nothing. `Some(a)`: a server's,
    /// because the call that made attempt `a` went away before it was answered: it applies only while the
    /// wait or grant still belongs to attempt `a`. A retry of the request by a newer call (after a
    /// connection failure, possibly on another server) takes the wait or grant over, and then this
    /// abandon changes nothing.
    AbandonAcquire {
        session: SessionId,
        request: RequestId,
        name: LockName,
        attempt: Option<u64>,
        now_ms: u64,
    },
    /// `value` is stored with the grant and shown by describe (at most [`crate::limits::MAX_VALUE_BYTES`]);
    /// leader election puts the leader's name or address there. `attempt` identifies the call that
    /// proposed this entry (chosen by the server, unique per call, never 0): a retry of a queued or
    /// granted request makes the wait or grant its own, see [`Command::AbandonAcquire`].
    Acquire {
        session: SessionId,
        request: RequestId,
        name: LockName,
        mode: AcquireMode,
        value: Box<[u8]>,
        attempt: u64,
        now_ms: u64,
    },
    /// [`Command::OpenSession`] for a session that only holders of `secret` may act on (see
    /// [`Command::Authorized`]). The leader draws `secret` from the OS RNG (never 0); a retried open with
    /// the same nonce returns the session with the secret it was opened with.
    OpenSessionWithSecret {
        nonce: u128,
        ttl_ms: u64,
        secret: u128,
        now_ms: u64,
    },
    /// `command`, acting on a session, sent by someone who showed `secret`. If the session exists and its
    /// secret differs, the outcome is [`Refusal::PermissionDenied`] and nothing changes, not even the
    /// session's deduplication window. A request id more than [`crate::limits::MAX_REQUEST_ID_AHEAD`]
    /// above the session's highest is [`Refusal::RequestIdTooNew`], also remembered nowhere. Sessions
    /// opened before secrets existed have secret 0. `command` is one of `CloseSession`, `Acquire`,
    /// `Release`, `CancelWait` and `AbandonAcquire`; anything else is refused.
    Authorized { secret: u128, command: Box<Command> },
    /// `command` on behalf of `principal`, within `quota` (the proposing server's access policy for
    /// that principal when it proposed this entry: the table never reads a policy). Around an open
    /// (`OpenSession`, `OpenSessionWithSecret`), the session is refused with
    /// [`Refusal::QuotaExceeded`] if the principal already owns `quota.sessions` sessions, and otherwise
    /// belongs to `principal` from then on. Around an [`Command::Authorized`] `Acquire` of a session
    /// some principal owns, a new grant or wait is refused when the owner's sessions already hold or
    /// wait for `quota.locks` locks, or a new wait when they wait for `quota.waiting`. Around anything
    /// else, or a session no principal owns, it is `command` unchanged. A bare `Acquire` (as audit
    /// lines show an authorized one) is held to the quota too. A retried open of a session another
    /// principal owns is [`Refusal::PermissionDenied`].
    Quota {
        principal: Box<str>,
        quota: QuotaLimits,
        command: Box<Command>,
    },
    /// `command` (an acquire, possibly inside `Quota` and `Authorized`) asks for a lock-delay: if the
    /// grant it makes (or the wait it queues, once granted) ends because its session **expired**, the
    /// lock is not granted again until [`Command::EndLockDelay`] (which the leader proposes
    /// `lock_delay_ms` after applying the expiry, on its monotonic clock). A clean release, a close or
    /// an abandon frees it at once. At most [`crate::limits::MAX_LOCK_DELAY_MS`].
    WithLockDelay {
        lock_delay_ms: u32,
        command: Box<Command>,
    },
    /// Ends the lock-delay of `name`, which began when the grant with `token` expired: the first waiter
    /// is granted, or the lock is deleted. Anything else (no delay, another token) changes nothing.
    EndLockDelay {
        name: LockName,
        token: FencingToken,
        now_ms: u64,
    },
    /// `command` (an acquire, possibly inside the other wrappers) takes the lock shared or a permit of a
    /// semaphore instead of exclusively (see [`Share`]). A new acquire is granted at once only when
    /// nobody waits and the grant fits beside the current holders; otherwise it queues (or, a try, is
    /// refused), so a writer waiting behind readers is never overtaken by later readers. When holders
    /// leave, waiters are granted from the front of the queue for as long as they fit, all with the
    /// token of that entry.
    WithShare { share: Share, command: Box<Command> },
    /// [`Command::EndLockDelay`] of the one delay that the expiry at log index `began` started. Two
    /// readers granted by one entry share a token, and each expiry starts a delay of its own, so a
    /// token alone cannot say which of them ends (nor tell an `EndLockDelay` of a delay already over
    /// from one for a newer delay with the same token). The leader proposes this for delays of shared
    /// holders, and the plain `EndLockDelay` for the others, whose tokens are unique per lock (so that
    /// a cluster still running the release before this one reads it).
    EndLockDelayAt {
        name: LockName,
        token: FencingToken,
        began: u64,
        now_ms: u64,
    },
    /// From this entry on, the group's table may use at most `bytes` of accounted memory
    /// ([`crate::LockTable::table_bytes`]); 0 lifts the budget. An open, grant or wait that would take
    /// the table past it is [`Refusal::TableFull`] and changes nothing; what frees memory (a release, a
    /// close, an expiry, a cancel) is never refused. A rule switched on by a log entry, not a constant,
    /// so that a log written before budgets existed replays to the same outcomes. The leader proposes
    /// it when its configured budget differs from the table's (`--table-budget-mib`).
    SetTableBudget { bytes: u64, now_ms: u64 },
    /// Several sessions' leases ran out: each is expired as by [`Command::ExpireSession`], except that
    /// every one of their waits is removed before any of their locks is released, so that no session of
    /// the batch is granted a lock by this entry (every grant of one entry has the same token). Refused
    /// whole ([`Limit::ExpiryBatch`]) with more than [`crate::limits::MAX_EXPIRY_BATCH`] sessions, more
    /// than [`crate::limits::MAX_LOCKS_PER_SESSION`] locks and waits among them (with more than one
    /// session), or two of them holding one lock both with a lock-delay (their placeholders could share a
    /// name); the leader then expires them one entry each. Outcome: [`Outcome::SessionClosed`] with the locks released by all.
    /// Unknown sessions (ended meanwhile) are skipped. Written only when every member of the group reads
    /// it (the leader learns that from their replies), so a cluster half way through an upgrade keeps
    /// expiring one session an entry.
    ExpireSessions {
        sessions: Vec<SessionId>,
        now_ms: u64,
    },
}

/// A lock-delay under way, as a leader times it ([`crate::LockTable::delayed_locks`],
/// [`Event::LockDelayed`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Delay {
    pub name: LockName,
    /// The expired grant's.
    pub token: FencingToken,
    /// The log index of the expiry that began it.
    pub began: u64,
    /// The expired grant was shared.
    pub shared: bool,
    pub delay_ms: u32,
}

impl Delay {
    /// The command that ends this delay (see [`Command::EndLockDelayAt`]).
    pub fn end(&self, now_ms: u64) -> Command {
        if self.shared {
            Command::EndLockDelayAt {
                name: self.name.clone(),
                token: self.token,
                began: self.began,
                now_ms,
            }
        } else {
            Command::EndLockDelay {
                name: self.name.clone(),
                token: self.token,
                now_ms,
            }
        }
    }
}

/// Per-principal bounds carried by [`Command::Quota`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct QuotaLimits {
    pub sessions: u64,
    /// Locks held and waited for, together.
    pub locks: u64,
    pub waiting: u64,
}

/// Which per-principal quota a refusal is about.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum QuotaKind {
    Sessions,
    Locks,
    Waiting,
}

impl QuotaKind {
    /// The name in error messages and docs (`principal_` and the policy file's key), distinct from the
    /// group-wide limits `max_sessions` and `max_locks`.
    pub fn name(self) -> &'static str {
        match self {
            QuotaKind::Sessions => "principal_max_sessions",
            QuotaKind::Locks => "principal_max_locks",
            QuotaKind::Waiting => "principal_max_waiting",
        }
    }
}

impl Command {
    /// What the command does, without its secrets, for audit lines and logs: an `Authorized` command is
    /// the command it carries, and `OpenSessionWithSecret` is an `OpenSession`. (A refusal for a wrong
    /// secret then reads as that command refused with [`Refusal::PermissionDenied`].)
    pub fn without_secrets(&self) -> Command {
        match self {
            Command::OpenSessionWithSecret {
                nonce,
                ttl_ms,
                now_ms,
                ..
            } => Command::OpenSession {
                nonce: *nonce,
                ttl_ms: *ttl_ms,
                now_ms: *now_ms,
            },
            Command::Authorized { command, .. } => command.without_secrets(),
            Command::Quota {
                principal,
                quota,
                command,
            } => Command::Quota {
                principal: principal.clone(),
                quota: *quota,
                command: Box::new(command.without_secrets()),
            },
            Command::WithLockDelay {
                lock_delay_ms,
                command,
            } => Command::WithLockDelay {
                lock_delay_ms: *lock_delay_ms,
                command: Box::new(command.without_secrets()),
            },
            Command::WithShare { share, command } => Command::WithShare {
                share: *share,
                command: Box::new(command.without_secrets()),
            },
            other => other.clone(),
        }
    }

    /// The command inside any `Authorized`, `Quota`, `WithLockDelay` and `WithShare` wrappers: what it
    /// does to the table when the wrappers' checks pass.
    pub fn effective(&self) -> &Command {
        match self {
            Command::Authorized { command, .. }
            | Command::Quota { command, .. }
            | Command::WithLockDelay { command, .. }
            | Command::WithShare { command, .. } => command.effective(),
            other => other,
        }
    }

    pub fn now_ms(&self) -> u64 {
        match self {
            Command::OpenSession { now_ms, .. }
            | Command::CloseSession { now_ms, .. }
            | Command::ExpireSession { now_ms, .. }
            | Command::AcquireBeforeAttempts { now_ms, .. }
            | Command::Acquire { now_ms, .. }
            | Command::Release { now_ms, .. }
            | Command::CancelWait { now_ms, .. }
            | Command::AbandonAcquire { now_ms, .. }
            | Command::EndLockDelay { now_ms, .. }
            | Command::EndLockDelayAt { now_ms, .. }
            | Command::SetTableBudget { now_ms, .. }
            | Command::ExpireSessions { now_ms, .. }
            | Command::OpenSessionWithSecret { now_ms, .. } => *now_ms,
            Command::Authorized { command, .. }
            | Command::Quota { command, .. }
            | Command::WithLockDelay { command, .. }
            | Command::WithShare { command, .. } => command.now_ms(),
        }
    }
}

/// The result of applying a command. Refusals are normal values, not errors: they are replicated outcomes
/// that every replica computes identically.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Outcome {
    SessionOpened {
        session: SessionId,
        ttl_ms: u64,
    },
    /// The session ended; `released` locks passed to their next waiter or became free.
    SessionClosed {
        released: u32,
    },
    Granted {
        token: FencingToken,
    },
    /// Waiting in the FIFO queue at `position` (1 = next).
    Queued {
        position: u32,
    },
    Released,
    /// The waiter was removed before it was granted.
    Cancelled,
    Refused(Refusal),
    /// The acquire was abandoned ([`Command::AbandonAcquire`]): its wait or grant is gone. Also what a
    /// retry of that acquire gets, so the caller knows to start again with a new request id.
    Abandoned,
    /// [`Command::SetTableBudget`] applied; `previous` is the budget it replaced (0: none).
    BudgetSet {
        previous: u64,
    },
}

/// Why a command changed nothing.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Refusal {
    /// The session does not exist: never opened, closed, or expired.
    UnknownSession,
    /// A try-acquire found the lock held.
    Held {
        holder: SessionId,
        token: FencingToken,
    },
    /// The session already holds this lock (under another request id).
    AlreadyHolder {
        token: FencingToken,
    },
    /// The session already waits for this lock (under another request id).
    AlreadyWaiting,
    /// A release by a session that does not hold the lock.
    NotHolder,
    /// A release with a token that is not the current grant's.
    StaleToken {
        current: FencingToken,
    },
    /// A cancel for a wait that does not exist.
    NotWaiting,
    /// A session TTL outside the limits.
    InvalidTtl {
        ttl_ms: u64,
    },
    LimitExceeded(Limit),
    /// The request id is older than the session's deduplication window: its first outcome is forgotten,
    /// so it is refused rather than executed a second time.
    RequestIdTooOld,
    /// The request did not carry the session's secret ([`Command::Authorized`]).
    PermissionDenied,
    /// The request id is more than [`crate::limits::MAX_REQUEST_ID_AHEAD`] above the session's highest.
    RequestIdTooNew {
        highest: u64,
    },
    /// The owning principal is at its quota ([`Command::Quota`]): `value` is the quota it was held to.
    QuotaExceeded {
        quota: QuotaKind,
        value: u64,
    },
    /// The acquire asked for the name as a semaphore of another size, or as a lock while it is a
    /// semaphore, or the other way round: `permits` is what the name is now (0: a lock).
    PermitsMismatch {
        permits: u32,
    },
    /// A semaphore of 0 permits, or more than [`crate::limits::MAX_HOLDERS_PER_LOCK`].
    InvalidPermits {
        permits: u32,
    },
    /// The open, grant or wait would take the table past its memory budget
    /// ([`Command::SetTableBudget`]): `budget` is that budget in bytes, `used` what the table uses.
    TableFull {
        budget: u64,
        used: u64,
    },
}

/// A limit from [`crate::limits`], named in a refusal.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Limit {
    LocksPerSession,
    WaitersPerLock,
    Sessions,
    Locks,
    /// A [`Command::ExpireSessions`] too large, or with two sessions holding one lock with lock-delays.
    ExpiryBatch,
}

impl Limit {
    /// The name used in error messages and docs.
    pub fn name(self) -> &'static str {
        match self {
            Limit::LocksPerSession => "max_locks_per_session",
            Limit::WaitersPerLock => "max_waiters_per_lock",
            Limit::Sessions => "max_sessions",
            Limit::Locks => "max_locks",
            Limit::ExpiryBatch => "max_expiry_batch",
        }
    }

    pub fn value(self) -> usize {
        use crate::limits::*;
        match self {
            Limit::LocksPerSession => MAX_LOCKS_PER_SESSION,
            Limit::WaitersPerLock => MAX_WAITERS_PER_LOCK,
            Limit::Sessions => MAX_SESSIONS,
            Limit::Locks => MAX_LOCKS,
            Limit::ExpiryBatch => MAX_EXPIRY_BATCH,
        }
    }
}

/// What happened to a lock in one applied entry, in the order it happened: the events a `Watch` stream
/// delivers. Drained with [`crate::LockTable::take_changes`]. Deterministic like everything else here, so
/// every replica (and a replica re-applying its log after a restart) produces the same changes for the
/// same entry, which is what lets a watcher resume on any server from a log index.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Change {
    pub name: LockName,
    pub kind: ChangeKind,
    /// The holder's session (`Granted`, `Released`, `Expired`) or the waiter's (`Queued`, `Cancelled`).
    /// A lock held shared, or a semaphore, has one `Granted` per holder, and each holder's own
    /// `Released` or `Expired`.
    pub session: SessionId,
    /// The grant's fencing token; `None` for `Queued` and `Cancelled`.
    pub token: Option<FencingToken>,
    /// The value the granted acquire carried (`Granted` only; empty otherwise).
    pub value: Box<[u8]>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum ChangeKind {
    /// The lock was granted (at once, or to the first waiter after its holder left).
    Granted,
    /// The holder released it, closed its session, or abandoned the acquire that got it.
    Released,
    /// The holder's session expired.
    Expired,
    /// A session started waiting for it.
    Queued,
    /// A waiter left the queue without the lock: cancelled, abandoned, or its session ended.
    Cancelled,
    /// Follows `Expired` when the expired grant had a lock-delay: nobody holds the lock and nobody is
    /// granted it until `DelayEnded` (`session` is 0, `token` the expired grant's).
    Delayed,
    /// The lock-delay ended (`session` 0, `token` the expired grant's): the lock is free, or a `Granted`
    /// for the first waiter follows in the same entry.
    DelayEnded,
}

/// Side effects of an apply that the server reacts to (wake a waiting acquire, stop a session's timer).
/// Drained with [`crate::LockTable::take_events`].
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Event {
    /// A waiter was promoted to holder.
    Granted {
        name: LockName,
        session: SessionId,
        request: RequestId,
        token: FencingToken,
    },
    /// An abandoned acquire's grant was released ([`Command::AbandonAcquire`]); a `Granted` for the next
    /// waiter may follow in the same entry.
    GrantAbandoned {
        name: LockName,
        session: SessionId,
        token: FencingToken,
    },
    /// A waiter left its queue without being granted (cancelled, or its session ended).
    WaiterRemoved {
        name: LockName,
        session: SessionId,
        request: RequestId,
    },
    /// A session was opened. `secret` is 0 for a session without one (see [`Command::Authorized`]); the
    /// leader's keepalive checks it.
    SessionOpened {
        session: SessionId,
        ttl_ms: u64,
        secret: u128,
    },
    /// A session was closed or expired.
    SessionEnded { session: SessionId },
    /// The grant `token` of `name` expired with a lock-delay: the leader proposes
    /// [`Delay::end`] `delay_ms` later.
    LockDelayed {
        name: LockName,
        token: FencingToken,
        delay_ms: u32,
        /// The index of the expiry (0 in audit lines from before shared locks).
        #[serde(default)]
        began: u64,
        /// The expired grant was shared.
        #[serde(default)]
        shared: bool,
    },
}
