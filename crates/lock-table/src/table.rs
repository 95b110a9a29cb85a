//! The lock table state and [`LockTable::apply`].
//!
//! Ordered maps everywhere (`BTreeMap`, and for the two large ones `ChunkMap` under `SnapMap`), so
//! iteration order, snapshots and digests are identical on every replica and listings by prefix are
//! range scans.

use crate::command::{
    AcquireMode, Change, ChangeKind, Command, Event, Limit, Outcome, QuotaKind, QuotaLimits,
    Refusal, Share,
};
use crate::cow::SnapMap;
use crate::dedup::Window;
use crate::held::HeldNames;
use crate::limits::{
    DEDUP_WINDOW, GRANT_BYTES, LOCK_BYTES, MAX_EXPIRY_BATCH, MAX_HOLDERS_PER_LOCK, MAX_LOCKS,
    MAX_LOCKS_PER_SESSION, MAX_REQUEST_ID_AHEAD, MAX_SESSIONS, MAX_TTL_MS, MAX_WAITERS_PER_LOCK,
    MIN_TTL_MS, OPEN_NONCE_WINDOW, SESSION_BYTES,
};
use crate::types::{FencingToken, LockName, RequestId, SessionId};
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::ops::Bound;

#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct Session {
    pub(crate) ttl_ms: u64,
    pub(crate) opened_at_ms: u64,
    /// Derived from `locks` (not in snapshots; rebuilt on decode). Packed while small, a B-tree that
    /// shares the lock map's long names otherwise (`crate::held`).
    #[serde(skip)]
    pub(crate) held: HeldNames,
    /// Locks this session waits for, with the request id of the acquire that queued it.
    /// Derived from the locks' queues (not in snapshots; rebuilt on decode).
    #[serde(skip)]
    pub(crate) waiting: BTreeMap<LockName, RequestId>,
    /// The last [`DEDUP_WINDOW`] outcomes by request id, oldest first.
    pub(crate) dedup: Window,
    /// The largest request id that fell out of `dedup`; ids at or below it not in `dedup` are refused.
    pub(crate) dedup_evicted_max: u64,
    /// What a request must show to act on this session ([`Command::Authorized`]); 0 for a session opened
    /// without one (by `Command::OpenSession`, before secrets existed).
    pub(crate) secret: u128,
}

/// One grant of a lock, without the value it carries (see [`Holder`]): 48 bytes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Grant {
    pub(crate) session: SessionId,
    pub(crate) token: FencingToken,
    pub(crate) request: RequestId,
    pub(crate) granted_at_ms: u64,
    /// The acquire call that last reported on this grant (see [`Command::AbandonAcquire`]).
    pub(crate) attempt: u64,
    /// The lock-delay the grant asked for ([`Command::WithLockDelay`]); 0: none. On a delayed lock's
    /// placeholder holder ([`NO_SESSION`]), the delay under way.
    pub(crate) lock_delay_ms: u32,
    /// Held shared ([`Share::Shared`]); a placeholder keeps its expired grant's mode.
    pub(crate) shared: bool,
}

/// A grant and the value its acquire carried. A [`Lock`] keeps its first holder's value apart from
/// the grant (in the box the rare parts live in), so a lock is 56 bytes, a 64-byte malloc chunk
/// instead of an 80-byte one. Encoded as one record, its fields in the order snapshots always had.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Holder {
    pub(crate) grant: Grant,
    pub(crate) value: Value,
}

impl std::ops::Deref for Holder {
    type Target = Grant;
    fn deref(&self) -> &Grant {
        &self.grant
    }
}

impl std::ops::DerefMut for Holder {
    fn deref_mut(&mut self) -> &mut Grant {
        &mut self.grant
    }
}

/// [`Holder`] as encoded (format versions 6 to 8).
#[derive(Serialize)]
#[serde(rename = "Holder")]
struct HolderOut<'a> {
    session: SessionId,
    token: FencingToken,
    request: RequestId,
    granted_at_ms: u64,
    value: &'a Value,
    attempt: u64,
    lock_delay_ms: u32,
    shared: bool,
}

impl<'a> HolderOut<'a> {
    fn new(g: &Grant, value: &'a Value) -> HolderOut<'a> {
        HolderOut {
            session: g.session,
            token: g.token,
            request: g.request,
            granted_at_ms: g.granted_at_ms,
            value,
            attempt: g.attempt,
            lock_delay_ms: g.lock_delay_ms,
            shared: g.shared,
        }
    }
}

#[derive(Deserialize)]
#[serde(rename = "Holder")]
struct HolderIn {
    session: SessionId,
    token: FencingToken,
    request: RequestId,
    granted_at_ms: u64,
    value: Value,
    attempt: u64,
    lock_delay_ms: u32,
    shared: bool,
}

impl Serialize for Holder {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        HolderOut::new(&self.grant, &self.value).serialize(s)
    }
}

impl<'de> Deserialize<'de> for Holder {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let h = HolderIn::deserialize(d)?;
        Ok(Holder {
            grant: Grant {
                session: h.session,
                token: h.token,
                request: h.request,
                granted_at_ms: h.granted_at_ms,
                attempt: h.attempt,
                lock_delay_ms: h.lock_delay_ms,
                shared: h.shared,
            },
            value: h.value,
        })
    }
}

/// The holder of a lock in its lock-delay: no session (ids are log indexes, never 0). Its token is the
/// expired grant's, so the next grant's token is still larger.
pub(crate) const NO_SESSION: SessionId = SessionId(0);

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct Waiter {
    pub(crate) session: SessionId,
    pub(crate) request: RequestId,
    pub(crate) enqueued_at_ms: u64,
    pub(crate) value: Value,
    /// The acquire call that last reported on this wait (see [`Command::AbandonAcquire`]).
    pub(crate) attempt: u64,
    /// The lock-delay its grant will have.
    pub(crate) lock_delay_ms: u32,
    /// Waits to hold the lock shared.
    pub(crate) shared: bool,
}

/// A lock exists in the table exactly while it has a holder (a session's, or [`NO_SESSION`] during a
/// lock-delay); waiters exist only behind a holder.
///
/// In memory a lock is its first grant and one pointer (56 bytes): most locks have one holder with an
/// empty value, no waiters and no permits, and then `rest` is `None`. Encoded as it always was: the
/// holder (with its value), the queue (`None` when empty), the further holders (`None` when none) and
/// the permits.
#[derive(Clone, Debug)]
pub(crate) struct Lock {
    /// The oldest grant (inline: most locks have exactly one); its value is in `rest`.
    first: Grant,
    /// The first holder's value, the queue, the further holders and the permits; `None` exactly when
    /// all four are empty (0).
    rest: Option<Box<Rest>>,
}

/// What few locks have: a value, waiters, several holders, permits.
#[derive(Clone, Debug, Default)]
struct Rest {
    /// The first holder's value.
    value: Value,
    /// The FIFO queue.
    waiters: VecDeque<Waiter>,
    /// Further holders in grant order: shared holders, or a semaphore's other permits.
    more: Vec<Holder>,
    /// A semaphore's permits; 0 for a lock (exclusive or shared).
    permits: u32,
}

// A lock fills a 64-byte malloc chunk (8 bytes of it malloc's), not an 80-byte one.
const _: () = assert!(std::mem::size_of::<Lock>() == 56);

static NO_WAITERS: VecDeque<Waiter> = VecDeque::new();
static NO_VALUE: Value = Value(None);

impl PartialEq for Lock {
    fn eq(&self, other: &Lock) -> bool {
        self.first == other.first
            && self.first_value() == other.first_value()
            && self.waiters() == other.waiters()
            && self.more() == other.more()
            && self.permits() == other.permits()
    }
}

impl Eq for Lock {}

impl Lock {
    fn new(holder: Holder, permits: u32) -> Lock {
        Lock::from_parts(holder, VecDeque::new(), Vec::new(), permits)
    }

    pub(crate) fn from_parts(
        holder: Holder,
        waiters: VecDeque<Waiter>,
        more: Vec<Holder>,
        permits: u32,
    ) -> Lock {
        // No `Rest` for a lock that has nothing to put there (most: one holder, no value, no waiters):
        // boxing it only for `tidy` to drop it cost every grant of a free lock a malloc and a free.
        let bare = holder.value.is_empty() && waiters.is_empty() && more.is_empty() && permits == 0;
        Lock {
            first: holder.grant,
            rest: (!bare).then(|| {
                Box::new(Rest {
                    value: holder.value,
                    waiters,
                    more,
                    permits,
                })
            }),
        }
    }

    /// Drops `rest` when it holds nothing.
    fn tidy(&mut self) {
        if self.rest.as_ref().is_some_and(|r| {
            r.value.is_empty() && r.waiters.is_empty() && r.more.is_empty() && r.permits == 0
        }) {
            self.rest = None;
        }
    }

    fn rest_mut(&mut self) -> &mut Rest {
        self.rest.get_or_insert_with(Default::default)
    }

    /// The oldest grant.
    pub(crate) fn first(&self) -> &Grant {
        &self.first
    }

    /// The oldest grant's value.
    pub(crate) fn first_value(&self) -> &Value {
        self.rest.as_ref().map_or(&NO_VALUE, |r| &r.value)
    }

    /// Puts `h` in the place of the oldest grant, and returns that grant with its value.
    pub(crate) fn replace_first(&mut self, h: Holder) -> Holder {
        let grant = std::mem::replace(&mut self.first, h.grant);
        let value = if h.value.is_empty() && self.rest.is_none() {
            Value::default()
        } else {
            std::mem::replace(&mut self.rest_mut().value, h.value)
        };
        self.tidy();
        Holder { grant, value }
    }

    /// Puts `h` in the place of the grant `session` holds (which exists), and returns that grant's
    /// value.
    pub(crate) fn replace_held(&mut self, session: SessionId, h: Holder) -> Value {
        if self.first.session == session {
            return self.replace_first(h).value;
        }
        let held = self
            .rest
            .iter_mut()
            .flat_map(|r| r.more.iter_mut())
            .find(|m| m.session == session)
            .expect("the session holds it");
        std::mem::replace(held, h).value
    }

    /// The FIFO queue.
    pub(crate) fn waiters(&self) -> &VecDeque<Waiter> {
        self.rest.as_ref().map_or(&NO_WAITERS, |r| &r.waiters)
    }

    pub(crate) fn waiters_mut(&mut self) -> impl Iterator<Item = &mut Waiter> {
        self.rest.iter_mut().flat_map(|r| r.waiters.iter_mut())
    }

    pub(crate) fn push_waiter(&mut self, w: Waiter) {
        self.rest_mut().waiters.push_back(w);
    }

    pub(crate) fn pop_waiter(&mut self) -> Option<Waiter> {
        let w = self.rest.as_mut()?.waiters.pop_front();
        self.tidy();
        w
    }

    /// Removes `session`'s waits: how many there were, and what they were charged.
    pub(crate) fn remove_waits(&mut self, session: SessionId) -> (usize, u64) {
        let (mut removed, mut freed) = (0, 0);
        if let Some(r) = self.rest.as_mut() {
            r.waiters.retain(|w| {
                let keep = w.session != session;
                if !keep {
                    removed += 1;
                    freed += grant_bytes(&w.value);
                }
                keep
            });
        }
        self.tidy();
        (removed, freed)
    }

    /// Further holders in grant order: shared holders, or a semaphore's other permits.
    pub(crate) fn more(&self) -> &[Holder] {
        self.rest.as_ref().map_or(&[], |r| &r.more)
    }

    pub(crate) fn push_holder(&mut self, h: Holder) {
        self.rest_mut().more.push(h);
    }

    /// Removes the further holder at `at` (which exists).
    pub(crate) fn remove_more(&mut self, at: usize) -> Holder {
        let h = self.rest_mut().more.remove(at);
        self.tidy();
        h
    }

    /// A semaphore's permits; 0 for a lock (exclusive or shared).
    pub(crate) fn permits(&self) -> u32 {
        self.rest.as_ref().map_or(0, |r| r.permits)
    }

    /// Every holder's grant, oldest first.
    pub(crate) fn holders(&self) -> impl Iterator<Item = &Grant> {
        std::iter::once(&self.first).chain(self.more().iter().map(|h| &h.grant))
    }

    /// Every holder's grant and value, oldest first.
    pub(crate) fn holders_with_values(&self) -> impl Iterator<Item = (&Grant, &Value)> {
        std::iter::once((&self.first, self.first_value()))
            .chain(self.more().iter().map(|h| (&h.grant, &h.value)))
    }

    pub(crate) fn holder_count(&self) -> usize {
        1 + self.more().len()
    }

    /// The grant `session` holds (never a placeholder's: [`NO_SESSION`] holds nothing).
    pub(crate) fn held_by(&self, session: SessionId) -> Option<&Grant> {
        (session != NO_SESSION)
            .then(|| self.holders().find(|h| h.session == session))
            .flatten()
    }

    fn held_by_mut(&mut self, session: SessionId) -> Option<&mut Grant> {
        if session == NO_SESSION {
            return None;
        }
        if self.first.session == session {
            return Some(&mut self.first);
        }
        self.rest
            .iter_mut()
            .flat_map(|r| r.more.iter_mut())
            .map(|h| &mut h.grant)
            .find(|h| h.session == session)
    }

    /// Whether one more grant (`shared` or not) fits beside the holders, ignoring the queue.
    pub(crate) fn admits(&self, shared: bool) -> bool {
        let permits = self.permits();
        if permits > 0 {
            self.holder_count() < permits as usize
        } else {
            // With several holders all are shared, so the first one says how the lock is held.
            shared && self.first.shared && self.holder_count() < MAX_HOLDERS_PER_LOCK
        }
    }
}

/// [`Lock`] as snapshots encode it (the layout of format versions 7 and 8).
#[derive(Serialize)]
#[serde(rename = "Lock")]
struct LockOut<'a> {
    holder: HolderOut<'a>,
    waiters: Option<&'a VecDeque<Waiter>>,
    more: Option<&'a Vec<Holder>>,
    permits: u32,
}

#[derive(Deserialize)]
#[serde(rename = "Lock")]
struct LockIn {
    holder: Holder,
    waiters: Option<VecDeque<Waiter>>,
    more: Option<Vec<Holder>>,
    permits: u32,
}

impl Serialize for Lock {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let rest = self.rest.as_deref();
        LockOut {
            holder: HolderOut::new(&self.first, self.first_value()),
            waiters: rest.map(|r| &r.waiters).filter(|w| !w.is_empty()),
            more: rest.map(|r| &r.more).filter(|m| !m.is_empty()),
            permits: self.permits(),
        }
        .serialize(s)
    }
}

impl<'de> Deserialize<'de> for Lock {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let l = LockIn::deserialize(d)?;
        // Never `Some` and empty, so that equal locks encode alike.
        if l.waiters.as_ref().is_some_and(|w| w.is_empty())
            || l.more.as_ref().is_some_and(|m| m.is_empty())
        {
            return Err(serde::de::Error::custom("a lock has an empty queue"));
        }
        Ok(Lock::from_parts(
            l.holder,
            l.waiters.unwrap_or_default(),
            l.more.unwrap_or_default(),
            l.permits,
        ))
    }
}

/// The replicated state of one group.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct LockTable {
    /// Boxed, like `locks`: a node's empty room costs 16 bytes an entry instead of 136.
    /// A [`SnapMap`], like `locks`: snapshots are written from it while it changes.
    pub(crate) sessions: SnapMap<SessionId, Session>,
    /// Boxed: a map node has room for 11 entries, and inserting one at a time leaves about 6 of them
    /// used (the bench's load), so the room left empty costs 24 bytes an entry (name and pointer)
    /// instead of 80 (name and lock).
    pub(crate) locks: SnapMap<LockName, Lock>,
    /// Recent `OpenSession` nonces, so a retried open returns the session it opened the first time.
    pub(crate) open_nonces: BTreeMap<u128, (SessionId, u64)>,
    pub(crate) open_nonce_order: VecDeque<u128>,
    pub(crate) waiter_count: u64,
    /// The principal each session opened under a [`Command::Quota`] belongs to.
    pub(crate) owners: BTreeMap<SessionId, Box<str>>,
    /// The memory budget in bytes ([`Command::SetTableBudget`]); 0: none.
    pub(crate) budget: u64,
    /// What the table is charged now against `budget` (see [`LockTable::table_bytes`]). Derived (not
    /// in snapshots; recounted on decode).
    #[serde(skip)]
    pub(crate) bytes: u64,
    /// What each principal's sessions hold and wait for. Derived from `owners` and the sessions (not in
    /// snapshots; rebuilt on decode).
    #[serde(skip)]
    pub(crate) usage: BTreeMap<Box<str>, Usage>,
    #[serde(skip)]
    pub(crate) events: Vec<Event>,
    #[serde(skip)]
    pub(crate) changes: Vec<Change>,
    /// The lock-delay of the acquire being applied ([`Command::WithLockDelay`]); 0 between applies.
    #[serde(skip)]
    pub(crate) acquire_lock_delay: u32,
    /// How the acquire being applied shares the lock ([`Command::WithShare`]); exclusive between
    /// applies.
    #[serde(skip)]
    pub(crate) acquire_share: Share,
}

/// One principal's sessions, and the locks they hold and wait for.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Usage {
    pub sessions: u64,
    pub held: u64,
    pub waiting: u64,
}

/// Read-only view of a lock's holder.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HolderView {
    pub session: SessionId,
    pub token: FencingToken,
    pub granted_at_ms: u64,
    pub value: Box<[u8]>,
    /// The grant's lock-delay; for a delayed lock (session 0), the delay under way, and `granted_at_ms`
    /// is when it began.
    pub lock_delay_ms: u32,
    pub shared: bool,
}

/// Read-only view of a waiter.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct WaiterView {
    pub session: SessionId,
    pub enqueued_at_ms: u64,
    pub shared: bool,
}

/// Read-only view of a lock.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LockView {
    pub name: LockName,
    /// The oldest holder.
    pub holder: HolderView,
    /// The other holders (of a lock held shared, or a semaphore), in grant order.
    pub more: Vec<HolderView>,
    pub waiters: Vec<WaiterView>,
    /// A semaphore's permits; 0 for a lock.
    pub permits: u32,
}

impl LockView {
    /// Every holder, oldest grant first.
    pub fn holders(&self) -> impl Iterator<Item = &HolderView> {
        std::iter::once(&self.holder).chain(self.more.iter())
    }
}

/// Read-only view of a session.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SessionView {
    pub session: SessionId,
    pub ttl_ms: u64,
    pub opened_at_ms: u64,
    pub held: u32,
    pub waiting: u32,
}

impl LockTable {
    pub fn new() -> Self {
        Self::default()
    }

    /// Applies the command of the log entry at `index`. `index` becomes the session id of an opened session
    /// and the fencing token of every grant this entry makes, which is what makes tokens strictly increase
    /// per lock: log indexes only grow, and one entry grants a given lock at most once.
    pub fn apply(&mut self, index: u64, command: &Command) -> Outcome {
        assert!(
            index > 0,
            "log indexes start at 1, so token 0 is never issued"
        );
        match command {
            Command::OpenSession {
                nonce,
                ttl_ms,
                now_ms,
            } => self.open_session(index, *nonce, *ttl_ms, 0, *now_ms),
            Command::OpenSessionWithSecret {
                nonce,
                ttl_ms,
                secret,
                now_ms,
            } => self.open_session(index, *nonce, *ttl_ms, *secret, *now_ms),
            Command::Authorized { secret, command } => self.authorized(index, *secret, command),
            Command::Quota {
                principal,
                quota,
                command,
            } => self.quota(index, principal, quota, command),
            Command::CloseSession { session, now_ms } => {
                self.end_session(index, *session, ChangeKind::Released, *now_ms)
            }
            Command::ExpireSession { session, now_ms } => {
                self.end_session(index, *session, ChangeKind::Expired, *now_ms)
            }
            Command::ExpireSessions { sessions, now_ms } => {
                self.expire_sessions(index, sessions, *now_ms)
            }
            Command::AcquireBeforeAttempts {
                session,
                request,
                name,
                mode,
                value,
                now_ms,
            } => self.acquire(index, *session, *request, name, *mode, value, 0, *now_ms),
            Command::Acquire {
                session,
                request,
                name,
                mode,
                value,
                attempt,
                now_ms,
            } => self.acquire(
                index, *session, *request, name, *mode, value, *attempt, *now_ms,
            ),
            Command::Release {
                session,
                request,
                name,
                token,
                now_ms,
            } => self.release(index, *session, *request, name, *token, *now_ms),
            Command::CancelWait {
                session,
                request,
                name,
                now_ms,
            } => self.cancel_wait(index, *session, *request, name, *now_ms),
            Command::AbandonAcquire {
                session,
                request,
                name,
                attempt,
                now_ms,
            } => self.abandon(index, *session, *request, name, *attempt, *now_ms),
            Command::WithLockDelay {
                lock_delay_ms,
                command,
            } => {
                self.acquire_lock_delay = *lock_delay_ms;
                let outcome = self.apply(index, command);
                self.acquire_lock_delay = 0;
                outcome
            }
            Command::EndLockDelay {
                name,
                token,
                now_ms,
            } => self.end_lock_delay(index, name, *token, None, *now_ms),
            Command::EndLockDelayAt {
                name,
                token,
                began,
                now_ms,
            } => self.end_lock_delay(index, name, *token, Some(*began), *now_ms),
            Command::WithShare { share, command } => {
                self.acquire_share = *share;
                let outcome = self.apply(index, command);
                self.acquire_share = Share::Exclusive;
                outcome
            }
            Command::SetTableBudget { bytes, .. } => Outcome::BudgetSet {
                previous: std::mem::replace(&mut self.budget, *bytes),
            },
        }
    }

    /// Whether `more` bytes fit in the budget; Err is the refusal.
    fn charge_fits(&self, more: u64) -> Result<(), Refusal> {
        if self.budget == 0 || self.bytes.saturating_add(more) <= self.budget {
            Ok(())
        } else {
            Err(Refusal::TableFull {
                budget: self.budget,
                used: self.bytes,
            })
        }
    }

    fn charge(&mut self, bytes: u64) {
        self.bytes += bytes;
    }

    fn discharge(&mut self, bytes: u64) {
        debug_assert!(
            self.bytes >= bytes,
            "the table is charged for what it frees"
        );
        self.bytes = self.bytes.saturating_sub(bytes);
    }

    /// [`Command::EndLockDelay`] (`began` None: the first delay with `token`) and
    /// [`Command::EndLockDelayAt`].
    fn end_lock_delay(
        &mut self,
        index: u64,
        name: &LockName,
        token: FencingToken,
        began: Option<u64>,
        now_ms: u64,
    ) -> Outcome {
        let placeholder = |h: &Grant| {
            h.session == NO_SESSION
                && h.token == token
                && began.is_none_or(|b| h.request == RequestId(b))
        };
        match self.locks.get(name) {
            Some(lock) if lock.holders().any(placeholder) => {
                self.changed(name, ChangeKind::DelayEnded, NO_SESSION, Some(token));
                self.remove_holder(index, name, placeholder, now_ms);
                Outcome::Released
            }
            _ => Outcome::Refused(Refusal::NotHolder),
        }
    }

    /// The grant `token` of `name` held by `session` expired with a lock-delay (in the entry at `index`):
    /// a placeholder takes its place (its mode, its permit) until [`Delay::end`]. Waiters stay queued.
    ///
    /// A placeholder is named by its token and the index of the expiry that began it (kept in its
    /// `request`), which no other delay of the lock shares: readers granted by one entry share a token
    /// but expire in different entries. So an end command, which a leader may propose twice, ends one
    /// delay at most once and never a newer one.
    ///
    /// [`Delay::end`]: crate::Delay::end
    fn delay_lock(
        &mut self,
        index: u64,
        name: &LockName,
        session: SessionId,
        token: FencingToken,
        delay_ms: u32,
        now_ms: u64,
    ) {
        let lock = self.locks.get_mut(name).expect("a held lock exists");
        let shared = lock.held_by(session).expect("the session holds it").shared;
        let placeholder = Holder {
            grant: Grant {
                session: NO_SESSION,
                token,
                request: RequestId(index),
                granted_at_ms: now_ms,
                attempt: 0,
                lock_delay_ms: delay_ms,
                shared,
            },
            value: Value::default(),
        };
        let freed = lock.replace_held(session, placeholder).len() as u64;
        // The placeholder keeps the grant's charge but not its value.
        self.discharge(freed);
        self.changed(name, ChangeKind::Delayed, NO_SESSION, Some(token));
        self.events.push(Event::LockDelayed {
            name: name.clone(),
            token,
            delay_ms,
            began: index,
            shared,
        });
    }

    /// Side effects of the applies since the last call, in apply order.
    pub fn take_events(&mut self) -> Vec<Event> {
        std::mem::take(&mut self.events)
    }

    /// What happened to locks in the applies since the last call, in apply order (see [`Change`]).
    pub fn take_changes(&mut self) -> Vec<Change> {
        std::mem::take(&mut self.changes)
    }

    fn changed(
        &mut self,
        name: &LockName,
        kind: ChangeKind,
        session: SessionId,
        token: Option<FencingToken>,
    ) {
        self.changes.push(Change {
            name: name.clone(),
            kind,
            session,
            token,
            value: Box::default(),
        });
    }

    /// [`Command::Authorized`]: the secret and request-id checks, then the command.
    fn authorized(&mut self, index: u64, secret: u128, command: &Command) -> Outcome {
        match self.authorization(secret, command) {
            Ok(()) => self.apply(index, command),
            Err(refused) => refused,
        }
    }

    /// The checks of [`Command::Authorized`]: Err is the refusal.
    fn authorization(&self, secret: u128, command: &Command) -> Result<(), Outcome> {
        let (session, request) = match command {
            Command::CloseSession { session, .. } => (*session, None),
            Command::Acquire {
                session, request, ..
            }
            | Command::Release {
                session, request, ..
            }
            | Command::CancelWait {
                session, request, ..
            }
            | Command::AbandonAcquire {
                session, request, ..
            } => (*session, Some(*request)),
            _ => return Err(Outcome::Refused(Refusal::PermissionDenied)),
        };
        if let Some(s) = self.sessions.get(&session) {
            if s.secret != secret {
                return Err(Outcome::Refused(Refusal::PermissionDenied));
            }
            let highest = s
                .dedup
                .highest()
                .map_or(s.dedup_evicted_max, |h| h.max(s.dedup_evicted_max));
            if request.is_some_and(|r| r.0 > highest.saturating_add(MAX_REQUEST_ID_AHEAD)) {
                return Err(Outcome::Refused(Refusal::RequestIdTooNew { highest }));
            }
        }
        Ok(())
    }

    /// [`Command::Quota`].
    fn quota(
        &mut self,
        index: u64,
        principal: &str,
        quota: &QuotaLimits,
        command: &Command,
    ) -> Outcome {
        match command {
            Command::OpenSession { nonce, ttl_ms, .. }
            | Command::OpenSessionWithSecret { nonce, ttl_ms, .. } => {
                // A retried open returns its session whatever the quota says now, but only to the
                // principal that opened it (the answer carries the session's secret).
                let retry = self.open_nonces.get(nonce).map(|(s, _)| *s);
                if let Some(session) = retry {
                    let owner = self.owners.get(&session).map(|o| &**o);
                    if self.sessions.contains_key(&session) && owner.is_some_and(|o| o != principal)
                    {
                        return Outcome::Refused(Refusal::PermissionDenied);
                    }
                }
                let retry = retry.is_some();
                let owned = self.usage.get(principal).map_or(0, |u| u.sessions);
                // A TTL out of range gets its own refusal first.
                let valid_ttl = (MIN_TTL_MS..=MAX_TTL_MS).contains(ttl_ms);
                if !retry && valid_ttl && owned >= quota.sessions {
                    return Outcome::Refused(Refusal::QuotaExceeded {
                        quota: QuotaKind::Sessions,
                        value: quota.sessions,
                    });
                }
                let outcome = self.apply(index, command);
                if let Outcome::SessionOpened { session, .. } = outcome {
                    if !retry {
                        self.owners.insert(session, principal.into());
                        self.usage.entry(principal.into()).or_default().sessions += 1;
                    }
                }
                outcome
            }
            Command::Authorized {
                secret,
                command: inner,
            } => {
                if let Err(refused) = self.authorization(*secret, inner) {
                    return refused;
                }
                self.quota_acquire(index, quota, inner)
            }
            // As audit lines show it (`Command::without_secrets`).
            acquire @ Command::Acquire { .. } => self.quota_acquire(index, quota, acquire),
            other => self.apply(index, other),
        }
    }

    /// An acquire held to `quota` (anything else is applied as it is).
    fn quota_acquire(&mut self, index: u64, quota: &QuotaLimits, command: &Command) -> Outcome {
        if let Command::Acquire {
            session,
            request,
            name,
            mode,
            ..
        } = command
        {
            if let Some(refusal) = self.over_quota(*session, *request, name, *mode, quota) {
                let outcome = Outcome::Refused(refusal);
                self.remember(*session, *request, &outcome);
                return outcome;
            }
        }
        self.apply(index, command)
    }

    /// Whether an acquire would give the session's owner one lock more than `quota` allows (a new grant
    /// or wait), or one wait more. None when it would not, or when the acquire changes nothing anyway
    /// (a retry, a lock it already holds or waits for, a refused try) and should get its own outcome.
    fn over_quota(
        &self,
        session_id: SessionId,
        request: RequestId,
        name: &LockName,
        mode: AcquireMode,
        quota: &QuotaLimits,
    ) -> Option<Refusal> {
        let session = self.sessions.get(&session_id)?;
        let owner = self.owners.get(&session_id)?;
        if self.replay(session, request).is_some() || session.waiting.contains_key(name) {
            return None;
        }
        let usage = self.usage.get(owner).copied().unwrap_or_default();
        let locks = Refusal::QuotaExceeded {
            quota: QuotaKind::Locks,
            value: quota.locks,
        };
        let (shared, permits) = self.acquire_share.parts();
        match self.locks.get(name) {
            Some(lock) if lock.held_by(session_id).is_some() => None,
            None if usage.held + usage.waiting >= quota.locks => Some(locks),
            None => None,
            // Refused for its own reason.
            Some(lock) if lock.permits() != permits => None,
            Some(lock) if lock.waiters().is_empty() && lock.admits(shared) => {
                (usage.held + usage.waiting >= quota.locks).then_some(locks)
            }
            Some(_) if mode == AcquireMode::Try => None,
            Some(_) if usage.held + usage.waiting >= quota.locks => Some(locks),
            Some(_) if usage.waiting >= quota.waiting => Some(Refusal::QuotaExceeded {
                quota: QuotaKind::Waiting,
                value: quota.waiting,
            }),
            Some(_) => None,
        }
    }

    /// Counts a change in what `session` holds (`held`) and waits for (`waiting`) against its owner.
    fn count(&mut self, session: SessionId, held: i64, waiting: i64) {
        if self.owners.is_empty() {
            return;
        }
        let Some(owner) = self.owners.get(&session) else {
            return;
        };
        // Derived counters: `check_invariants` recounts them; never stop a replica over them.
        let u = self.usage.entry(owner.clone()).or_default();
        debug_assert!(u.held.checked_add_signed(held).is_some());
        debug_assert!(u.waiting.checked_add_signed(waiting).is_some());
        u.held = u.held.saturating_add_signed(held);
        u.waiting = u.waiting.saturating_add_signed(waiting);
    }

    /// What `principal`'s sessions use now.
    pub fn usage(&self, principal: &str) -> Usage {
        self.usage.get(principal).copied().unwrap_or_default()
    }

    /// The secret a request must show to act on `session` (0: none), if the session exists.
    pub fn session_secret(&self, session: SessionId) -> Option<u128> {
        self.sessions.get(&session).map(|s| s.secret)
    }

    /// Gives every session the secret `rekey(session, old secret)`. Not a command and never applied
    /// from the log: a restore (`holdfast snapshot restore`) re-keys the table it seeds a new cluster
    /// with, the same way on every server, so that the clients of the lost cluster cannot renew the
    /// sessions the backup holds (their locks may have changed hands since the backup was taken).
    /// The remembered `OpenSession` nonces are forgotten too: a retried open would be answered with
    /// its session and the new secret.
    pub fn rekey_sessions(&mut self, rekey: impl Fn(SessionId, u128) -> u128) {
        let ids: Vec<SessionId> = self.sessions.iter().map(|(id, _)| *id).collect();
        for id in ids {
            if let Some(s) = self.sessions.get_mut(&id) {
                s.secret = rekey(id, s.secret);
            }
        }
        self.open_nonces.clear();
        self.open_nonce_order.clear();
    }

    fn open_session(
        &mut self,
        index: u64,
        nonce: u128,
        ttl_ms: u64,
        secret: u128,
        now_ms: u64,
    ) -> Outcome {
        if let Some(&(session, ttl_ms)) = self.open_nonces.get(&nonce) {
            return Outcome::SessionOpened { session, ttl_ms };
        }
        if !(MIN_TTL_MS..=MAX_TTL_MS).contains(&ttl_ms) {
            return Outcome::Refused(Refusal::InvalidTtl { ttl_ms });
        }
        if self.sessions.len() >= MAX_SESSIONS {
            return Outcome::Refused(Refusal::LimitExceeded(Limit::Sessions));
        }
        if let Err(full) = self.charge_fits(SESSION_BYTES) {
            return Outcome::Refused(full);
        }
        self.charge(SESSION_BYTES);
        let session = SessionId(index);
        self.sessions.insert(
            session,
            Session {
                ttl_ms,
                opened_at_ms: now_ms,
                secret,
                ..Session::default()
            },
        );
        self.open_nonces.insert(nonce, (session, ttl_ms));
        self.open_nonce_order.push_back(nonce);
        if self.open_nonce_order.len() > OPEN_NONCE_WINDOW {
            if let Some(old) = self.open_nonce_order.pop_front() {
                self.open_nonces.remove(&old);
            }
        }
        self.events.push(Event::SessionOpened {
            session,
            ttl_ms,
            secret,
        });
        Outcome::SessionOpened { session, ttl_ms }
    }

    /// Ends `session` (closed or expired: `how` is what watchers see for the locks it held).
    fn end_session(
        &mut self,
        index: u64,
        session: SessionId,
        how: ChangeKind,
        now_ms: u64,
    ) -> Outcome {
        let Some(ended) = self.end_waits(session) else {
            return Outcome::Refused(Refusal::UnknownSession);
        };
        // A wait that left the front may let the next ones in (a writer leaving from before readers).
        // The session's own holds are still in place, so its lock-delays are not yet decided.
        for name in ended.waiting.keys() {
            self.promote(index, name, now_ms);
        }
        let released = self.end_holds(index, session, &ended, how, now_ms);
        Outcome::SessionClosed { released }
    }

    /// [`Command::ExpireSessions`]: every session's waits go before any of their holds, so that no
    /// session of the batch is granted a lock by this entry (its grants all have one token).
    fn expire_sessions(&mut self, index: u64, ids: &[SessionId], now_ms: u64) -> Outcome {
        if !self.fits_expiry_batch(ids) {
            return Outcome::Refused(Refusal::LimitExceeded(Limit::ExpiryBatch));
        }
        let ended: Vec<(SessionId, Session)> = ids
            .iter()
            .filter_map(|&id| Some((id, self.end_waits(id)?)))
            .collect();
        for (_, s) in &ended {
            for name in s.waiting.keys() {
                self.promote(index, name, now_ms);
            }
        }
        let mut released = 0;
        for (id, s) in &ended {
            released += self.end_holds(index, *id, s, ChangeKind::Expired, now_ms);
        }
        Outcome::SessionClosed { released }
    }

    /// `ids` (sessions whose leases ran out) split into the fewest [`Command::ExpireSessions`] batches
    /// that this table would apply, in order: each session once, unknown ones left out. A leader sizes
    /// its batches with it; if the table changes before a batch is applied, the batch may be refused.
    pub fn expiry_batches(&self, ids: &[SessionId]) -> Vec<Vec<SessionId>> {
        let mut batches: Vec<Vec<SessionId>> = Vec::new();
        let (mut work, mut held) = (0, BTreeSet::new());
        for id in ids {
            let Some(s) = self.sessions.get(id) else {
                continue;
            };
            let load = s.held.len() + s.waiting.len();
            let fits = batches.last().is_some_and(|b| {
                b.len() < MAX_EXPIRY_BATCH
                    && work + load <= MAX_LOCKS_PER_SESSION
                    && !b.contains(id)
                    && self.delayed_holds(*id, s).all(|n| !held.contains(&n))
            });
            if !fits {
                batches.push(Vec::new());
                (work, held) = (0, BTreeSet::new());
            }
            batches.last_mut().expect("pushed above").push(*id);
            work += load;
            held.extend(self.delayed_holds(*id, s));
        }
        batches
    }

    /// Whether `ids` may be expired by one entry (see [`Command::ExpireSessions`]).
    fn fits_expiry_batch(&self, ids: &[SessionId]) -> bool {
        if ids.len() > MAX_EXPIRY_BATCH {
            return false;
        }
        let mut work = 0;
        let mut held = BTreeSet::new();
        for id in ids {
            let Some(s) = self.sessions.get(id) else {
                continue;
            };
            work += s.held.len() + s.waiting.len();
            if self.delayed_holds(*id, s).any(|name| !held.insert(name)) {
                return false;
            }
        }
        ids.len() <= 1 || work <= MAX_LOCKS_PER_SESSION
    }

    /// The locks session `id` (`s`) holds with a lock-delay: the ones its expiry would leave to a
    /// placeholder named by the grant's token and the entry's index. Two sessions of one batch holding
    /// one of them (readers granted by one entry share a token) would give two placeholders one name,
    /// so a batch may not have that. Holders without delays may share locks within a batch: a lock's
    /// holders leave one by one, and only the last one's leaving grants its waiters a new token.
    fn delayed_holds<'a>(
        &'a self,
        id: SessionId,
        s: &'a Session,
    ) -> impl Iterator<Item = LockName> + 'a {
        s.held.iter().filter(move |name| {
            self.locks
                .get(name)
                .and_then(|l| l.held_by(id))
                .is_some_and(|h| h.lock_delay_ms > 0)
        })
    }

    /// Ends `session` (if it exists) and removes its waits, each with its event and change; returns it,
    /// with its holds still in place.
    fn end_waits(&mut self, session: SessionId) -> Option<Session> {
        let ended = self.sessions.remove(&session)?;
        self.discharge(SESSION_BYTES);
        if let Some(owner) = self.owners.remove(&session) {
            // Derived counters: `check_invariants` recounts them; never stop a replica over them.
            let u = self.usage.entry(owner.clone()).or_default();
            debug_assert!(u.sessions >= 1 && u.held >= ended.held.len() as u64);
            u.sessions = u.sessions.saturating_sub(1);
            u.held = u.held.saturating_sub(ended.held.len() as u64);
            u.waiting = u.waiting.saturating_sub(ended.waiting.len() as u64);
            if u.sessions == 0 {
                self.usage.remove(&owner);
            }
        }
        // Waits go first, so a lock this session holds is never handed to this same session's waiter.
        for (name, request) in &ended.waiting {
            let lock = self.locks.get_mut(name).expect("a waited-for lock exists");
            let (removed, freed) = lock.remove_waits(session);
            assert_eq!(removed, 1, "a session waits at most once per lock");
            self.discharge(freed);
            self.waiter_count -= 1;
            self.events.push(Event::WaiterRemoved {
                name: name.clone(),
                session,
                request: *request,
            });
            self.changed(name, ChangeKind::Cancelled, session, None);
        }
        Some(ended)
    }

    /// Releases (or, for an expiry with a lock-delay, delays) every lock `ended` held; returns how many.
    fn end_holds(
        &mut self,
        index: u64,
        session: SessionId,
        ended: &Session,
        how: ChangeKind,
        now_ms: u64,
    ) -> u32 {
        let released = ended.held.len() as u32;
        for name in ended.held.iter() {
            let holder = self.locks[&name]
                .held_by(session)
                .expect("the session holds it");
            let (token, delay) = (holder.token, holder.lock_delay_ms);
            self.changed(&name, how, session, Some(token));
            if how == ChangeKind::Expired && delay > 0 {
                self.delay_lock(index, &name, session, token, delay, now_ms);
            } else {
                self.remove_holder(index, &name, |h| h.session == session, now_ms);
            }
        }
        self.events.push(Event::SessionEnded { session });
        released
    }

    /// The outcome a retried request gets, if `request` was seen before; `None` for a new request.
    fn replay(&self, session: &Session, request: RequestId) -> Option<Outcome> {
        if let Some(outcome) = session.dedup.get(request) {
            return Some(outcome);
        }
        if request.0 <= session.dedup_evicted_max {
            return Some(Outcome::Refused(Refusal::RequestIdTooOld));
        }
        None
    }

    #[allow(
        clippy::too_many_arguments,
        reason = "the fields of Command::Acquire, plus the log index"
    )]
    fn acquire(
        &mut self,
        index: u64,
        session_id: SessionId,
        request: RequestId,
        name: &LockName,
        mode: AcquireMode,
        value: &[u8],
        attempt: u64,
        now_ms: u64,
    ) -> Outcome {
        let Some(session) = self.sessions.get(&session_id) else {
            return Outcome::Refused(Refusal::UnknownSession);
        };
        // A retry sees the current state of its own request first: a queued acquire may have been
        // granted. The retry's call now answers for the wait or grant, so it takes them over.
        let waiting = session.waiting.get(name) == Some(&request);
        if let Some(lock) = self.locks.get_mut(name) {
            if let Some(holder) = lock
                .held_by_mut(session_id)
                .filter(|h| h.request == request)
            {
                holder.attempt = attempt;
                return Outcome::Granted {
                    token: holder.token,
                };
            }
            if waiting {
                let mut position = 0;
                for (i, w) in lock.waiters_mut().enumerate() {
                    if w.session == session_id {
                        w.attempt = attempt;
                        position = i as u32 + 1;
                    }
                }
                return Outcome::Queued { position };
            }
        }
        let session = &self.sessions[&session_id];
        let lock = self.locks.get(name);
        if let Some(outcome) = self.replay(session, request) {
            return outcome;
        }
        let (shared, permits) = self.acquire_share.parts();
        // What a new grant or wait, and a new lock with its grant, would be charged.
        let fits_grant = self.charge_fits(grant_bytes(value));
        let fits_lock = self.charge_fits(lock_bytes(name) + grant_bytes(value));
        let outcome = match lock {
            _ if matches!(self.acquire_share, Share::Permits(n) if n == 0 || n as usize > MAX_HOLDERS_PER_LOCK) => {
                Outcome::Refused(Refusal::InvalidPermits { permits })
            }
            Some(lock) if lock.held_by(session_id).is_some() => {
                Outcome::Refused(Refusal::AlreadyHolder {
                    token: lock.held_by(session_id).expect("matched").token,
                })
            }
            _ if session.waiting.contains_key(name) => Outcome::Refused(Refusal::AlreadyWaiting),
            Some(lock) if lock.permits() != permits => Outcome::Refused(Refusal::PermitsMismatch {
                permits: lock.permits(),
            }),
            _ if session.held.len() + session.waiting.len() >= MAX_LOCKS_PER_SESSION => {
                Outcome::Refused(Refusal::LimitExceeded(Limit::LocksPerSession))
            }
            None if self.locks.len() >= MAX_LOCKS => {
                Outcome::Refused(Refusal::LimitExceeded(Limit::Locks))
            }
            Some(lock)
                if lock.waiters().is_empty() && lock.admits(shared) && fits_grant.is_err() =>
            {
                Outcome::Refused(fits_grant.expect_err("matched"))
            }
            None if fits_lock.is_err() => Outcome::Refused(fits_lock.expect_err("matched")),
            Some(lock) if lock.waiters().is_empty() && lock.admits(shared) => {
                let token = FencingToken(index);
                assert!(
                    lock.holders().all(|h| h.token < token),
                    "tokens strictly increase per lock"
                );
                let holder = Holder {
                    grant: Grant {
                        session: session_id,
                        token,
                        request,
                        granted_at_ms: now_ms,
                        attempt,
                        lock_delay_ms: self.acquire_lock_delay,
                        shared,
                    },
                    value: value.into(),
                };
                let lock = self.locks.get_mut(name).expect("matched above");
                lock.push_holder(holder);
                self.charge(grant_bytes(value));
                self.session_mut(session_id).held.insert(name);
                self.count(session_id, 1, 0);
                self.changes.push(Change {
                    name: name.clone(),
                    kind: ChangeKind::Granted,
                    session: session_id,
                    token: Some(token),
                    value: value.into(),
                });
                Outcome::Granted { token }
            }
            None => {
                let token = FencingToken(index);
                let holder = Holder {
                    grant: Grant {
                        session: session_id,
                        token,
                        request,
                        granted_at_ms: now_ms,
                        attempt,
                        lock_delay_ms: self.acquire_lock_delay,
                        shared,
                    },
                    value: value.into(),
                };
                self.locks.insert(name.clone(), Lock::new(holder, permits));
                self.charge(lock_bytes(name) + grant_bytes(value));
                self.session_mut(session_id).held.insert(name);
                self.count(session_id, 1, 0);
                self.changes.push(Change {
                    name: name.clone(),
                    kind: ChangeKind::Granted,
                    session: session_id,
                    token: Some(token),
                    value: value.into(),
                });
                Outcome::Granted { token }
            }
            Some(lock) if mode == AcquireMode::Try => Outcome::Refused(Refusal::Held {
                holder: lock.first().session,
                token: lock.first().token,
            }),
            Some(lock) if lock.waiters().len() >= MAX_WAITERS_PER_LOCK => {
                Outcome::Refused(Refusal::LimitExceeded(Limit::WaitersPerLock))
            }
            Some(_) if fits_grant.is_err() => Outcome::Refused(fits_grant.expect_err("matched")),
            Some(_) => {
                let lock = self.locks.get_mut(name).expect("matched above");
                lock.push_waiter(Waiter {
                    session: session_id,
                    request,
                    enqueued_at_ms: now_ms,
                    value: value.into(),
                    attempt,
                    lock_delay_ms: self.acquire_lock_delay,
                    shared,
                });
                let position = lock.waiters().len() as u32;
                self.charge(grant_bytes(value));
                self.waiter_count += 1;
                self.session_mut(session_id)
                    .waiting
                    .insert(name.clone(), request);
                self.count(session_id, 0, 1);
                self.changed(name, ChangeKind::Queued, session_id, None);
                Outcome::Queued { position }
            }
        };
        self.remember(session_id, request, &outcome);
        outcome
    }

    fn release(
        &mut self,
        index: u64,
        session_id: SessionId,
        request: RequestId,
        name: &LockName,
        token: FencingToken,
        now_ms: u64,
    ) -> Outcome {
        let Some(session) = self.sessions.get(&session_id) else {
            return Outcome::Refused(Refusal::UnknownSession);
        };
        if let Some(outcome) = self.replay(session, request) {
            return outcome;
        }
        let held = self
            .locks
            .get(name)
            .and_then(|l| l.held_by(session_id))
            .map(|h| h.token);
        let outcome = match held {
            Some(current) if current == token => {
                self.session_mut(session_id).held.remove(name);
                self.count(session_id, -1, 0);
                self.changed(name, ChangeKind::Released, session_id, Some(token));
                self.remove_holder(index, name, |h| h.session == session_id, now_ms);
                Outcome::Released
            }
            Some(current) => Outcome::Refused(Refusal::StaleToken { current }),
            None => Outcome::Refused(Refusal::NotHolder),
        };
        self.remember(session_id, request, &outcome);
        outcome
    }

    fn cancel_wait(
        &mut self,
        index: u64,
        session_id: SessionId,
        request: RequestId,
        name: &LockName,
        now_ms: u64,
    ) -> Outcome {
        let Some(session) = self.sessions.get(&session_id) else {
            return Outcome::Refused(Refusal::UnknownSession);
        };
        if session.waiting.get(name) == Some(&request) {
            self.remove_waiter(index, session_id, request, name, now_ms);
            // A retry of the acquire must now learn that it was cancelled, not that it is queued.
            self.update_remembered(session_id, request, Outcome::Cancelled);
            return Outcome::Cancelled;
        }
        match self.locks.get(name).and_then(|l| l.held_by(session_id)) {
            Some(holder) if holder.request == request => Outcome::Granted {
                token: holder.token,
            },
            _ => Outcome::Refused(Refusal::NotWaiting),
        }
    }

    fn abandon(
        &mut self,
        index: u64,
        session_id: SessionId,
        request: RequestId,
        name: &LockName,
        attempt: Option<u64>,
        now_ms: u64,
    ) -> Outcome {
        let Some(session) = self.sessions.get(&session_id) else {
            // A session that is gone holds and waits for nothing.
            return Outcome::Refused(Refusal::UnknownSession);
        };
        // A server's abandon applies only while the wait or grant is still its call's.
        let ours = |a: u64| attempt.is_none_or(|mine| mine == a);
        if session.waiting.get(name) == Some(&request) {
            let lock = &self.locks[name];
            let w = lock.waiters().iter().find(|w| w.session == session_id);
            if !w.is_some_and(|w| ours(w.attempt)) {
                return Outcome::Refused(Refusal::NotWaiting);
            }
            self.remove_waiter(index, session_id, request, name, now_ms);
            self.update_remembered(session_id, request, Outcome::Abandoned);
            return Outcome::Abandoned;
        }
        let granted = self
            .locks
            .get(name)
            .and_then(|l| l.held_by(session_id))
            .filter(|h| h.request == request)
            .map(|h| (h.token, h.attempt));
        if let Some((token, holder_attempt)) = granted {
            if !ours(holder_attempt) {
                return Outcome::Refused(Refusal::NotWaiting);
            }
            self.events.push(Event::GrantAbandoned {
                name: name.clone(),
                session: session_id,
                token,
            });
            self.session_mut(session_id).held.remove(name);
            self.count(session_id, -1, 0);
            self.changed(name, ChangeKind::Released, session_id, Some(token));
            self.remove_holder(index, name, |h| h.session == session_id, now_ms);
            self.update_remembered(session_id, request, Outcome::Abandoned);
            return Outcome::Abandoned;
        }
        match self.replay(session, request) {
            // The request waits, but for another lock: the name is wrong.
            Some(Outcome::Queued { .. }) => Outcome::Refused(Refusal::NotWaiting),
            // The acquire ended already (refused, released, cancelled, abandoned): nothing to undo.
            Some(_) => Outcome::Abandoned,
            // The client gives up on a request whose acquire has not reached the log yet: when it does, it
            // must change nothing. (A server's abandon always follows its call's acquire in the log.)
            None if attempt.is_none() => {
                self.remember(session_id, request, &Outcome::Abandoned);
                Outcome::Abandoned
            }
            None => Outcome::Refused(Refusal::NotWaiting),
        }
    }

    /// The outcome remembered for a request of a session, if it is in the dedup window.
    pub fn remembered(&self, session: SessionId, request: RequestId) -> Option<Outcome> {
        self.sessions.get(&session)?.dedup.get(request)
    }

    /// Removes the wait that `request` of `session_id` has in `name`'s queue (the caller checked it
    /// exists), and grants the waiters behind it that now fit.
    fn remove_waiter(
        &mut self,
        index: u64,
        session_id: SessionId,
        request: RequestId,
        name: &LockName,
        now_ms: u64,
    ) {
        let removed = self.session_mut(session_id).waiting.remove(name);
        assert_eq!(removed, Some(request), "the session records this wait");
        self.count(session_id, 0, -1);
        let lock = self.locks.get_mut(name).expect("a waited-for lock exists");
        let (_, freed) = lock.remove_waits(session_id);
        self.discharge(freed);
        self.waiter_count -= 1;
        self.events.push(Event::WaiterRemoved {
            name: name.clone(),
            session: session_id,
            request,
        });
        self.changed(name, ChangeKind::Cancelled, session_id, None);
        self.promote(index, name, now_ms);
    }

    /// Removes the first holder of `name` that `which` picks (its session already forgot the lock),
    /// then grants the waiters that now fit with token `index`, or deletes the lock.
    fn remove_holder(
        &mut self,
        index: u64,
        name: &LockName,
        which: impl Fn(&Grant) -> bool,
        now_ms: u64,
    ) {
        let lock = self.locks.get_mut(name).expect("a held lock exists");
        if lock.holder_count() > 1 {
            let removed = if which(lock.first()) {
                let next = lock.remove_more(0);
                lock.replace_first(next)
            } else {
                let at = lock
                    .more()
                    .iter()
                    .position(|h| which(h))
                    .expect("the holder to remove");
                lock.remove_more(at)
            };
            self.discharge(grant_bytes(&removed.value));
            self.promote(index, name, now_ms);
            return;
        }
        assert!(which(lock.first()), "the holder to remove");
        // The last holder left: the lock goes, unless a waiter takes it (and those behind that fit).
        let mut lock = self.locks.remove(name).expect("a held lock exists");
        self.discharge(grant_bytes(lock.first_value()));
        let Some(next) = lock.pop_waiter() else {
            self.discharge(lock_bytes(name));
            return;
        };
        let previous = lock.first().token;
        let holder = self.grant_waiter(index, name, next, previous, now_ms);
        lock.replace_first(holder);
        self.locks.insert(name.clone(), lock);
        self.promote(index, name, now_ms);
    }

    /// Grants `name` to the waiters at the front of its queue for as long as they fit, each with token
    /// `index` (FIFO: a waiter that does not fit stops the ones behind it, so readers never overtake a
    /// waiting writer).
    fn promote(&mut self, index: u64, name: &LockName, now_ms: u64) {
        loop {
            let Some(lock) = self.locks.get_mut(name) else {
                return;
            };
            match lock.waiters().front() {
                Some(w) if lock.admits(w.shared) => {}
                _ => return,
            }
            let next = lock.pop_waiter().expect("checked above");
            // Holders granted by this same entry share its token; every earlier one is smaller.
            let previous = lock
                .holders()
                .map(|h| h.token)
                .filter(|t| t.0 != index)
                .max()
                .unwrap_or(FencingToken(0));
            let holder = self.grant_waiter(index, name, next, previous, now_ms);
            self.locks
                .get_mut(name)
                .expect("still held")
                .push_holder(holder);
        }
    }

    /// Makes waiter `next` of `name` a holder with token `index` (the caller puts the holder in place):
    /// its session's records, counts, remembered outcome, change and event.
    fn grant_waiter(
        &mut self,
        index: u64,
        name: &LockName,
        next: Waiter,
        previous: FencingToken,
        now_ms: u64,
    ) -> Holder {
        let token = FencingToken(index);
        assert!(token > previous, "tokens strictly increase per lock");
        self.waiter_count -= 1;
        let session = self.session_mut(next.session);
        let queued_for = session.waiting.remove(name);
        assert_eq!(
            queued_for,
            Some(next.request),
            "a waiter's session records its wait"
        );
        session.held.insert(name);
        self.count(next.session, 1, -1);
        self.update_remembered(next.session, next.request, Outcome::Granted { token });
        self.changes.push(Change {
            name: name.clone(),
            kind: ChangeKind::Granted,
            session: next.session,
            token: Some(token),
            value: next.value.to_boxed(),
        });
        self.events.push(Event::Granted {
            name: name.clone(),
            session: next.session,
            request: next.request,
            token,
        });
        Holder {
            grant: Grant {
                session: next.session,
                token,
                request: next.request,
                granted_at_ms: now_ms,
                attempt: next.attempt,
                lock_delay_ms: next.lock_delay_ms,
                shared: next.shared,
            },
            value: next.value,
        }
    }

    fn remember(&mut self, session_id: SessionId, request: RequestId, outcome: &Outcome) {
        let session = self.session_mut(session_id);
        // Evict before pushing: pushing a 17th outcome first would double the window's allocation to
        // 32 entries (1 KiB per session instead of 512 B) for the rest of the session's life.
        if session.dedup.len() >= DEDUP_WINDOW {
            if let Some(old) = session.dedup.pop_front() {
                session.dedup_evicted_max = session.dedup_evicted_max.max(old.0);
            }
        }
        session.dedup.push_back(request, outcome);
    }

    fn update_remembered(&mut self, session_id: SessionId, request: RequestId, outcome: Outcome) {
        let session = self.session_mut(session_id);
        session.dedup.update(request, &outcome);
    }

    fn session_mut(&mut self, session: SessionId) -> &mut Session {
        self.sessions.get_mut(&session).expect("the session exists")
    }

    // ---- reads ----

    /// Locks in their lock-delay: (name, the expired grant's token, the delay). A new leader times each
    /// with the full delay from when it starts leading.
    pub fn delayed_locks(&self) -> Vec<crate::Delay> {
        self.locks
            .iter()
            .flat_map(|(n, l)| {
                l.holders()
                    .filter(|h| h.session == NO_SESSION)
                    .map(|h| crate::Delay {
                        name: n.clone(),
                        token: h.token,
                        began: h.request.0,
                        shared: h.shared,
                        delay_ms: h.lock_delay_ms,
                    })
            })
            .collect()
    }

    pub fn has_session(&self, session: SessionId) -> bool {
        self.sessions.contains_key(&session)
    }

    pub fn session_count(&self) -> usize {
        self.sessions.len()
    }

    pub fn lock_count(&self) -> usize {
        self.locks.len()
    }

    pub fn waiter_count(&self) -> u64 {
        self.waiter_count
    }

    /// Every live session and its TTL, for a new leader to start its timers.
    /// Every session with its TTL and secret, for a new leader's lease timers.
    pub fn session_leases(&self) -> impl Iterator<Item = (SessionId, u64, u128)> + '_ {
        self.sessions
            .iter()
            .map(|(id, s)| (*id, s.ttl_ms, s.secret))
    }

    pub fn describe(&self, name: &LockName) -> Option<LockView> {
        self.locks.get(name).map(|lock| lock_view(name, lock))
    }

    /// Locks whose name starts with `prefix`, in name order, after `after` (exclusive), at most `limit`.
    pub fn list_locks(&self, prefix: &str, after: Option<&str>, limit: usize) -> Vec<LockView> {
        let start = match after {
            Some(after) if after >= prefix => Bound::Excluded(after),
            _ => Bound::Included(prefix),
        };
        self.locks
            .range_from::<str>(start)
            .take_while(|(name, _)| name.as_str().starts_with(prefix))
            .take(limit)
            .map(|(name, lock)| lock_view(name, lock))
            .collect()
    }

    /// Sessions in id order after `after` (exclusive), at most `limit`.
    pub fn list_sessions(&self, after: Option<SessionId>, limit: usize) -> Vec<SessionView> {
        let start = after.map_or(Bound::Unbounded, Bound::Excluded);
        self.sessions
            .range_from(start.as_ref())
            .take(limit)
            .map(|(id, s)| session_view(*id, s))
            .collect()
    }

    /// Checks every structural invariant; panics with a description on the first violation. O(size).
    pub fn check_invariants(&self) {
        let mut waiters = 0u64;
        self.sessions.check();
        self.locks.check();
        assert!(!self.sessions.contains_key(&NO_SESSION), "no session 0");
        for (name, lock) in &self.locks {
            assert_eq!(
                lock.rest.is_none(),
                lock.first_value().is_empty()
                    && lock.waiters().is_empty()
                    && lock.more().is_empty()
                    && lock.permits() == 0,
                "{name}: the box of rare parts exists exactly when one of them is there"
            );
            assert!(
                lock.holders_with_values()
                    .all(|(h, v)| h.session != NO_SESSION || v.is_empty()),
                "{name}: a lock-delay placeholder has no value"
            );
            let mut holding = BTreeSet::new();
            let mut delays = BTreeSet::new();
            for holder in lock.holders() {
                if holder.session == NO_SESSION {
                    assert!(holder.lock_delay_ms > 0, "{name}: no holder, no delay");
                    assert!(
                        delays.insert((holder.token, holder.request)),
                        "{name}: two delays with one token and one start"
                    );
                    // Only readers share tokens: the others' delays end by token alone.
                    assert!(
                        holder.shared
                            || lock
                                .holders()
                                .filter(|h| h.session == NO_SESSION && h.token == holder.token)
                                .count()
                                == 1,
                        "{name}: an exclusive or permit delay shares its token"
                    );
                } else {
                    assert!(holding.insert(holder.session), "session holds {name} twice");
                    let session = self
                        .sessions
                        .get(&holder.session)
                        .expect("holder session exists");
                    assert!(
                        session.held.contains(name),
                        "holder's session lists {name} as held"
                    );
                }
                assert!(holder.token.0 > 0, "token 0 is never issued");
            }
            if lock.permits() > 0 {
                assert!(
                    lock.holder_count() <= lock.permits() as usize
                        && lock.permits() as usize <= MAX_HOLDERS_PER_LOCK,
                    "{name}: more holders than permits"
                );
                assert!(
                    lock.holders().all(|h| !h.shared) && lock.waiters().iter().all(|w| !w.shared),
                    "{name}: a semaphore held shared"
                );
            } else if lock.holder_count() > 1 {
                assert!(
                    lock.holders().all(|h| h.shared) && lock.holder_count() <= MAX_HOLDERS_PER_LOCK,
                    "{name}: an exclusive holder beside others"
                );
            }
            if let Some(front) = lock.waiters().front() {
                assert!(!lock.admits(front.shared), "{name}: its first waiter fits");
            }
            let mut seen = BTreeSet::new();
            for w in lock.waiters().iter() {
                assert!(seen.insert(w.session), "session waits twice for {name}");
                assert!(
                    !holding.contains(&w.session),
                    "holder also waits for {name}"
                );
                let s = self
                    .sessions
                    .get(&w.session)
                    .expect("waiter session exists");
                assert_eq!(
                    s.waiting.get(name),
                    Some(&w.request),
                    "waiter's session lists its wait"
                );
                waiters += 1;
            }
        }
        assert_eq!(waiters, self.waiter_count, "waiter count");
        for (id, s) in &self.sessions {
            for name in s.held.iter() {
                assert!(
                    self.locks
                        .get(&name)
                        .is_some_and(|l| l.held_by(*id).is_some()),
                    "held lock {name} names its holder"
                );
            }
            for name in s.waiting.keys() {
                assert!(
                    !s.held.contains(name),
                    "session both holds and waits for {name}"
                );
                assert!(self
                    .locks
                    .get(name)
                    .is_some_and(|l| l.waiters().iter().any(|w| w.session == *id)));
            }
            assert!(s.dedup.len() <= DEDUP_WINDOW);
            s.dedup.check();
        }
        assert_eq!(self.usage, self.recount_usage(), "per-principal usage");
        assert_eq!(
            self.bytes,
            self.recount_bytes(),
            "the table's charged bytes"
        );
        for id in self.owners.keys() {
            assert!(self.sessions.contains_key(id), "owned session {id} exists");
        }
    }

    /// What the table is charged, counted from scratch.
    fn recount_bytes(&self) -> u64 {
        let sessions = self.sessions.len() as u64 * SESSION_BYTES;
        let locks: u64 = self
            .locks
            .iter()
            .map(|(name, lock)| {
                lock_bytes(name)
                    + lock
                        .holders_with_values()
                        .map(|(_, v)| grant_bytes(v))
                        .sum::<u64>()
                    + lock
                        .waiters()
                        .iter()
                        .map(|w| grant_bytes(&w.value))
                        .sum::<u64>()
            })
            .sum();
        sessions + locks
    }

    /// The memory the table is charged for now: [`SESSION_BYTES`] per session, [`LOCK_BYTES`] plus
    /// the name per lock, [`GRANT_BYTES`] plus the value per grant and per wait. Equal on every replica.
    pub fn table_bytes(&self) -> u64 {
        self.bytes
    }

    /// The memory budget ([`Command::SetTableBudget`]); 0: none.
    pub fn table_budget(&self) -> u64 {
        self.budget
    }

    /// Per-principal usage counted from scratch.
    fn recount_usage(&self) -> BTreeMap<Box<str>, Usage> {
        let mut usage: BTreeMap<Box<str>, Usage> = BTreeMap::new();
        for (id, owner) in &self.owners {
            let Some(s) = self.sessions.get(id) else {
                continue;
            };
            let u = usage.entry(owner.clone()).or_default();
            u.sessions += 1;
            u.held += s.held.len() as u64;
            u.waiting += s.waiting.len() as u64;
        }
        usage
    }
}

fn holder_view(h: &Grant, value: &Value) -> HolderView {
    HolderView {
        session: h.session,
        token: h.token,
        granted_at_ms: h.granted_at_ms,
        value: value.to_boxed(),
        lock_delay_ms: h.lock_delay_ms,
        shared: h.shared,
    }
}

fn lock_view(name: &LockName, lock: &Lock) -> LockView {
    LockView {
        name: name.clone(),
        holder: holder_view(lock.first(), lock.first_value()),
        more: lock
            .more()
            .iter()
            .map(|h| holder_view(&h.grant, &h.value))
            .collect(),
        waiters: lock
            .waiters()
            .iter()
            .map(|w| WaiterView {
                session: w.session,
                enqueued_at_ms: w.enqueued_at_ms,
                shared: w.shared,
            })
            .collect(),
        permits: lock.permits(),
    }
}

fn session_view(id: SessionId, s: &Session) -> SessionView {
    SessionView {
        session: id,
        ttl_ms: s.ttl_ms,
        opened_at_ms: s.opened_at_ms,
        held: s.held.len() as u32,
        waiting: s.waiting.len() as u32,
    }
}

impl LockTable {
    /// Rebuilds what snapshots leave out (each session's held and waited-for locks) from the locks, sharing
    /// the lock map's long names.
    pub(crate) fn rebuild_derived(&mut self) -> Result<(), String> {
        // Session ids are log indexes (never 0); 0 marks a lock in its lock-delay.
        if self.sessions.contains_key(&NO_SESSION) {
            return Err("the table has a session 0".into());
        }
        for s in self.sessions.values_mut() {
            s.held.clear();
            s.waiting.clear();
        }
        for (name, lock) in &self.locks {
            for holder in lock.holders() {
                if holder.session == NO_SESSION {
                    if holder.lock_delay_ms == 0 {
                        return Err(format!("lock {name} has no holder and no lock-delay"));
                    }
                } else if !self
                    .sessions
                    .get_mut(&holder.session)
                    .ok_or_else(|| {
                        format!("lock {name} is held by unknown session {}", holder.session)
                    })?
                    .held
                    .insert(name)
                {
                    return Err(format!("session {} holds {name} twice", holder.session));
                }
            }
            for w in lock.waiters().iter() {
                let s = self.sessions.get_mut(&w.session).ok_or_else(|| {
                    format!("lock {name} has a waiter of unknown session {}", w.session)
                })?;
                if s.waiting.insert(name.clone(), w.request).is_some() {
                    return Err(format!("session {} waits twice for {name}", w.session));
                }
            }
        }
        if let Some(id) = self
            .owners
            .keys()
            .find(|id| !self.sessions.contains_key(id))
        {
            return Err(format!("owned session {id} does not exist"));
        }
        self.usage = self.recount_usage();
        self.bytes = self.recount_bytes();
        Ok(())
    }
}

/// What one grant or wait with `value` is charged.
fn grant_bytes(value: &[u8]) -> u64 {
    GRANT_BYTES + value.len() as u64
}

/// What one lock named `name` is charged besides its grants and waits.
fn lock_bytes(name: &LockName) -> u64 {
    LOCK_BYTES + name.as_str().len() as u64
}

/// A grant's or wait's value: one null pointer (8 bytes) when empty, which almost every value is, instead
/// of a `Box<[u8]>` (16 bytes). Encoded exactly as a `Box<[u8]>`.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(crate) struct Value(Option<Box<Box<[u8]>>>);

impl From<&[u8]> for Value {
    fn from(v: &[u8]) -> Value {
        Value((!v.is_empty()).then(|| Box::new(v.into())))
    }
}

impl From<Box<[u8]>> for Value {
    fn from(v: Box<[u8]>) -> Value {
        Value((!v.is_empty()).then(|| Box::new(v)))
    }
}

impl std::ops::Deref for Value {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        self.0.as_deref().map_or(&[], |v| v)
    }
}

impl Value {
    pub(crate) fn to_boxed(&self) -> Box<[u8]> {
        (**self).into()
    }
}

impl Serialize for Value {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        <[u8]>::serialize(self, s)
    }
}

impl<'de> Deserialize<'de> for Value {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        Box::<[u8]>::deserialize(d).map(Value::from)
    }
}
