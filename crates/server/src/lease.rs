//! Session leases on the leader's monotonic clock.
//!
//! This is the one place in Holdfast that reads a clock to decide anything, and it decides only *when to
//! propose* an `ExpireSession` (or `ExpireSessions`) entry; the expiry itself happens when that entry is applied, identically on
//! every replica. Keepalives are not log entries: they only move a deadline in this in-memory map.
//!
//! Rules (DESIGN.md §4):
//! - Only a leader keeps timers. [`Leases::start_leading`] gives every live session a full fresh TTL from
//!   that moment, which can only delay an expiry, never hasten it. [`Leases::stop_leading`] drops them all.
//! - A session whose expiry has been proposed is answered "not alive" from then on, so a keepalive is
//!   never acknowledged for a session that an in-flight entry is about to expire.
//! - Time is `tokio::time::Instant`, so tests drive it with paused time.
//! - Lock-delays are timed the same way: a leader proposes `EndLockDelay` a full delay after it applied
//!   the expiry that began it, or after it started leading, never earlier.

use holdfast_lock_table::{Delay, Event, FencingToken, LockName, SessionId};
use std::cmp::Reverse;
// Hash maps, not B-trees, on the keepalive path (a lookup per renewal, 100,000 sessions). Only looked
// up, never iterated where order matters: the heap pops in (deadline, id) order whatever order its
// entries were pushed in.
#[allow(clippy::disallowed_types)]
use std::collections::{BinaryHeap, HashMap};
use std::hash::{BuildHasherDefault, Hasher};
use std::sync::Mutex;
use std::time::Duration;
use tokio::sync::Notify;
use tokio::time::Instant;

/// One session's lease on the leader: 24 bytes (the secret as two words, not a 16-byte-aligned
/// `u128`; the deadline in milliseconds from [`State::epoch`]; the TTL and two flags in one word), so
/// a map slot with its key is 32 bytes instead of 48 and the timers of 100,000 sessions take 4.3 MB
/// (a 131,072-slot table) instead of 6.4.
struct Timer {
    /// What a keepalive must show for this session (0: the session has none), as [`split`] makes it.
    secret: [u64; 2],
    /// Milliseconds from the epoch, rounded up: a deadline is never earlier than the exact one.
    deadline: u32,
    /// The TTL in milliseconds (the low 30 bits), [`EXPIRING`] and [`RETRY`].
    ttl_and_flags: u32,
}

const _: () = assert!(std::mem::size_of::<(SessionId, Timer)>() == 32);

/// [`Timer::ttl_and_flags`]: its expiry was taken to be proposed: never renewed again, even if that
/// proposal's outcome is unknown (it may still commit), so no keepalive is ever acknowledged for a
/// session that may be expiring.
const EXPIRING: u32 = 1 << 30;
/// [`Timer::ttl_and_flags`]: the proposal failed without a known outcome; propose again at the deadline.
const RETRY: u32 = 1 << 31;
const TTL_BITS: u32 = EXPIRING - 1;

impl Timer {
    fn new(ttl_ms: u64, secret: u128, deadline: u32) -> Timer {
        Timer {
            secret: split(secret),
            deadline,
            // A TTL is at most MAX_TTL_MS (300,000): the log refuses longer ones.
            ttl_and_flags: u32::try_from(ttl_ms).unwrap_or(TTL_BITS).min(TTL_BITS),
        }
    }

    fn ttl_ms(&self) -> u32 {
        self.ttl_and_flags & TTL_BITS
    }

    fn expiring(&self) -> bool {
        self.ttl_and_flags & EXPIRING != 0
    }

    fn retry(&self) -> bool {
        self.ttl_and_flags & RETRY != 0
    }

    fn set(&mut self, flag: u32, on: bool) {
        if on {
            self.ttl_and_flags |= flag;
        } else {
            self.ttl_and_flags &= !flag;
        }
    }
}

/// A heap entry: a deadline (milliseconds from the epoch) and a session id as two words, high first,
/// so the derived order is (deadline, id). 12 bytes instead of the 24 of `(Instant, SessionId)`.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
struct Due {
    at: u32,
    id: [u32; 2],
}

const _: () = assert!(std::mem::size_of::<Due>() == 12);

impl Due {
    fn new(at: u32, id: SessionId) -> Due {
        Due {
            at,
            id: [(id.0 >> 32) as u32, id.0 as u32],
        }
    }

    fn id(&self) -> SessionId {
        SessionId(u64::from(self.id[0]) << 32 | u64::from(self.id[1]))
    }
}

/// `at` in milliseconds from `epoch`, rounded up (see [`State::deadline_ms`]).
fn deadline_ms(epoch: Instant, at: Instant) -> u32 {
    ceil_ms(at.saturating_duration_since(epoch))
}

/// `d` in whole milliseconds, rounded up (`u32::MAX` past 49 days: later, never earlier).
fn ceil_ms(d: Duration) -> u32 {
    let ms = d.as_millis() + u128::from(!d.subsec_nanos().is_multiple_of(1_000_000));
    u32::try_from(ms).unwrap_or(u32::MAX)
}

/// Deadlines are milliseconds from an epoch in a `u32` (49 days). The epoch is reset when a leadership
/// starts, and moved forward once a leadership has lasted this long (~24.8 days), so a deadline
/// (at most a TTL or a retry's back-off ahead) always fits.
const REBASE_AFTER_MS: u32 = 1 << 31;
/// How far before `now` a moved epoch is put (see [`State::rebase`]).
const REBASE_KEEP_MS: u128 = 3_600_000;

/// A secret as two words.
fn split(secret: u128) -> [u64; 2] {
    [secret as u64, (secret >> 64) as u64]
}

/// Hashes a session id with one multiply (as rustc's FxHash does). Session ids are log indexes, chosen
/// by the log and never by a client, so a keyed hash (std's SipHash) buys nothing here: a client can
/// only look ids up, and lookups do not change where entries sit. Used for the timers only.
#[derive(Default, Clone, Copy)]
struct IdHasher(u64);

impl Hasher for IdHasher {
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.write_u64(u64::from(b));
        }
    }

    fn write_u64(&mut self, n: u64) {
        self.0 = (self.0.rotate_left(5) ^ n).wrapping_mul(0x517c_c1b7_2722_0a95);
    }

    fn finish(&self) -> u64 {
        self.0
    }
}

#[allow(clippy::disallowed_types)]
struct State {
    /// The term this server leads in, once it is ready to time sessions.
    leading: Option<u64>,
    /// What the timers' and the heap's deadlines count milliseconds from.
    epoch: Instant,
    timers: HashMap<SessionId, Timer, BuildHasherDefault<IdHasher>>,
    /// One entry at or before its deadline per timer that may still come due (none for one whose
    /// expiry is proposed, until [`Leases::retry_expiry`]): a keepalive only moves the timer's
    /// deadline, and [`Leases::take_due`] puts an entry that comes due for a renewed session back at
    /// the new deadline. So a renewal costs a hash lookup and no heap work, and each session's entry is
    /// popped and pushed once per TTL instead of once per renewal (with 100,000 sessions the stale
    /// pops were a fifth of a leader's CPU during a hold). Entries of ended sessions stay until they
    /// come due and are dropped then.
    heap: BinaryHeap<Reverse<Due>>,
    /// Lock-delays under way, in the order they end: (end, lock, token of the expired grant, index of
    /// the expiry that began it) and the delay. One per delay (`delay_ends`, by lock, token and start).
    delays: std::collections::BTreeMap<(Instant, LockName, FencingToken, u64), Delay>,
    delay_ends: HashMap<(LockName, FencingToken, u64), Instant>,
    /// A hand-over of leadership is under way ([`Leases::begin_hand_over`]): timing may not start.
    handing_over: bool,
    /// The sessions whose expiry was proposed (or waited for a retry) when a hand-over stopped the
    /// timers, and the term: if the hand-over fails and timing starts again in that term, they stay
    /// expiring. An expiry proposed in this term may still commit after the restart's barrier (a
    /// read barrier waits for what is committed, not for what this leader appended), so a session
    /// renewed in between would be expired just after a keepalive was acknowledged.
    expiring_at_hand_over: Option<(u64, Vec<SessionId>)>,
}

#[allow(clippy::disallowed_types)]
impl Default for State {
    fn default() -> State {
        State {
            leading: None,
            epoch: Instant::now(),
            timers: HashMap::default(),
            heap: BinaryHeap::new(),
            delays: std::collections::BTreeMap::new(),
            delay_ends: HashMap::default(),
            expiring_at_hand_over: None,
            handing_over: false,
        }
    }
}

impl State {
    /// `now` in milliseconds from the epoch, rounded down (so nothing comes due early); moves the
    /// epoch forward first if this leadership has lasted [`REBASE_AFTER_MS`].
    fn now_ms(&mut self, now: Instant) -> u32 {
        let mut ms = now.saturating_duration_since(self.epoch).as_millis();
        if ms >= u128::from(REBASE_AFTER_MS) {
            self.rebase(now);
            ms = now.saturating_duration_since(self.epoch).as_millis();
        }
        u32::try_from(ms).expect("rebased above")
    }

    /// `at` in milliseconds from the epoch, rounded up (so no deadline is earlier than the exact one).
    /// `at` is at most a TTL or a back-off past a `now` given to [`State::now_ms`].
    fn deadline_ms(&self, at: Instant) -> u32 {
        deadline_ms(self.epoch, at)
    }

    /// The instant of a deadline.
    fn instant(&self, ms: u32) -> Instant {
        self.epoch + Duration::from_millis(u64::from(ms))
    }

    /// Moves the epoch forward to an hour before `now`: every deadline moves back by the same amount
    /// (those more than an hour past, long due, to 0), so each heap entry stays at or before its
    /// timer's deadline, and a caller whose clock reading is up to an hour older than `now` still
    /// compares exactly.
    fn rebase(&mut self, now: Instant) {
        let ms = now.saturating_duration_since(self.epoch).as_millis();
        let shift = u64::try_from(ms.saturating_sub(REBASE_KEEP_MS)).unwrap_or(u64::MAX);
        self.epoch += Duration::from_millis(shift);
        // A leader left idle for longer than a u32 of milliseconds moves further than any deadline.
        let shift = u32::try_from(shift).unwrap_or(u32::MAX);
        // Each timer moves on its own, so the map's order does not matter.
        for t in self.timers.values_mut() {
            t.deadline = t.deadline.saturating_sub(shift);
        }
        let heap = std::mem::take(&mut self.heap).into_vec();
        self.heap = heap
            .into_iter()
            .map(|Reverse(d)| Reverse(Due::new(d.at.saturating_sub(shift), d.id())))
            .collect();
    }

    /// Times `delay` to end at `end`, or later if it is already timed to end later.
    fn delay_until(&mut self, delay: Delay, end: Instant) {
        let id = (delay.name.clone(), delay.token, delay.began);
        if let Some(&old) = self.delay_ends.get(&id) {
            if old >= end {
                return;
            }
            self.delays.remove(&(old, id.0.clone(), id.1, id.2));
        }
        self.delays.insert((end, id.0.clone(), id.1, id.2), delay);
        self.delay_ends.insert(id, end);
    }
}

/// Why a keepalive renewed nothing.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KeepAliveRefused {
    /// This server is not timing sessions (it does not lead).
    NotLeading,
    /// The secret sent for this session is not its secret.
    WrongSecret(SessionId),
}

/// The answer to one session's keepalive.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KeepAlive {
    /// Alive; the TTL restarted now (or runs out later still).
    Alive { ttl_ms: u64 },
    /// Unknown, closed, or its expiry is already proposed.
    Gone,
}

#[derive(Default)]
pub struct Leases {
    state: Mutex<State>,
    /// Woken when a deadline earlier than the ones the expiry task sleeps on may have appeared.
    pub wake: Notify,
    /// The simulation's clock-rate error of this server: positive runs fast (TTLs end early in real
    /// time). Always 0 outside the simulation.
    rate_ppm: i64,
}

impl Leases {
    /// Leases on a clock that runs `rate_ppm` parts per million fast (or slow, if negative). Only the
    /// simulation uses it, to check that safety survives bounded clock-rate differences.
    pub fn with_clock_rate_ppm(rate_ppm: i64) -> Leases {
        Leases {
            rate_ppm,
            ..Leases::default()
        }
    }

    /// How long `ttl` measured on this server's clock takes in real time.
    fn span(&self, ttl: Duration) -> Duration {
        if self.rate_ppm == 0 {
            ttl
        } else {
            ttl.mul_f64(1e6 / (1e6 + self.rate_ppm as f64))
        }
    }

    /// [`Leases::span`] of a TTL in milliseconds, rounded up to whole milliseconds.
    fn span_ms(&self, ttl_ms: u32) -> u32 {
        if self.rate_ppm == 0 {
            return ttl_ms;
        }
        ceil_ms(self.span(Duration::from_millis(u64::from(ttl_ms))))
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().expect("lease lock poisoned")
    }

    /// Starts timing every live session with a full TTL from `now`, unless a hand-over is under way
    /// (false). The caller holds the state machine's read lock, so no session can open or end between
    /// the listing and this call.
    pub fn start_leading(
        &self,
        term: u64,
        sessions: impl Iterator<Item = (SessionId, u64, u128)>,
        delayed: Vec<Delay>,
        now: Instant,
    ) -> bool {
        let mut s = self.lock();
        if s.handing_over {
            return false;
        }
        s.leading = Some(term);
        s.epoch = now;
        s.timers.clear();
        s.heap.clear();
        s.delays.clear();
        s.delay_ends.clear();
        for delay in delayed {
            let end = now + self.span(Duration::from_millis(u64::from(delay.delay_ms)));
            s.delay_until(delay, end);
        }
        for (id, ttl_ms, secret) in sessions {
            let deadline = s.deadline_ms(now + self.span(Duration::from_millis(ttl_ms)));
            s.timers.insert(id, Timer::new(ttl_ms, secret, deadline));
            s.heap.push(Reverse(Due::new(deadline, id)));
        }
        // Timing again in the term of a hand-over that failed: the expiries proposed before it may
        // still commit, so those sessions are never renewed, and their expiry is proposed again now.
        if let Some((kept, ids)) = s.expiring_at_hand_over.take() {
            if kept == term {
                let at = s.deadline_ms(now);
                for id in ids {
                    if let Some(t) = s.timers.get_mut(&id) {
                        t.set(EXPIRING, true);
                        t.set(RETRY, true);
                        t.deadline = at;
                        s.heap.push(Reverse(Due::new(at, id)));
                    }
                }
            }
        }
        drop(s);
        self.wake.notify_one();
        true
    }

    /// Stops timing sessions and refuses to start again until [`Leases::end_hand_over`]: in one step
    /// under the lock, so that a `start_leading` whose barrier was under way when a hand-over began
    /// cannot slip in after it (a transfer's target is elected without waiting out the vote lease).
    pub fn begin_hand_over(&self) {
        let mut s = self.lock();
        let expiring = match s.leading {
            Some(term) => Some((
                term,
                s.timers
                    .iter()
                    .filter(|(_, t)| t.expiring())
                    .map(|(id, _)| *id)
                    .collect(),
            )),
            // Not timing (a hand-over before this one failed and timing has not started again).
            None => s.expiring_at_hand_over.take(),
        };
        *s = State {
            handing_over: true,
            expiring_at_hand_over: expiring,
            ..State::default()
        };
    }

    /// Lets timing start again after [`Leases::begin_hand_over`].
    pub fn end_hand_over(&self) {
        self.lock().handing_over = false;
    }

    pub fn stop_leading(&self) {
        let mut s = self.lock();
        *s = State {
            handing_over: s.handing_over,
            // Kept for a restart in the same term (see `start_leading`); another term drops it.
            expiring_at_hand_over: s.expiring_at_hand_over.take(),
            ..State::default()
        };
    }

    /// The term this server is timing sessions for, if it leads.
    pub fn leading_term(&self) -> Option<u64> {
        self.lock().leading
    }

    /// Restarts the TTL of each session in `ids`, if every one of `secrets` (one per id, or none at all
    /// for sessions without secrets) is that session's; otherwise renews nothing. A session this server
    /// does not know is [`KeepAlive::Gone`] whatever the secret.
    pub fn keepalive(
        &self,
        ids: &[u64],
        secrets: &[u128],
        now: Instant,
        out: &mut Vec<KeepAlive>,
    ) -> Result<(), KeepAliveRefused> {
        let mut guard = self.lock();
        let s = &mut *guard;
        if s.leading.is_none() {
            return Err(KeepAliveRefused::NotLeading);
        }
        // One lookup per session: each is renewed as it is checked, and its deadline before is kept so
        // that a wrong secret further on can put every one back (in reverse, so an id sent twice ends
        // where it began). A wrong secret is rare; a second lookup per session for it was not.
        let start = out.len();
        // Moves the epoch if it must, before any deadline is taken from it. Then `now` rounded up,
        // once per message; each renewal adds its TTL's span, also rounded up, so a deadline is never
        // earlier than the exact one, without a division per session.
        s.now_ms(now);
        let base = s.deadline_ms(now);
        let mut before: Vec<u32> = Vec::with_capacity(ids.len());
        for (i, &id) in ids.iter().enumerate() {
            let shown = split(secrets.get(i).copied().unwrap_or(0));
            match s.timers.get_mut(&SessionId(id)) {
                Some(t) if t.secret != shown => {
                    let wrong = SessionId(id);
                    for (k, &id) in out.drain(start..).zip(&ids[..i]).rev() {
                        if k == KeepAlive::Gone {
                            continue;
                        }
                        let t = s.timers.get_mut(&SessionId(id)).expect("renewed above");
                        t.deadline = before.pop().expect("one per renewal");
                    }
                    return Err(KeepAliveRefused::WrongSecret(wrong));
                }
                Some(t) if !t.expiring() => {
                    // Never earlier: two keepalives may take the lock in the other order than they
                    // read the clock, and the heap entry must stay at or before the deadline.
                    before.push(t.deadline);
                    let renewed = base.saturating_add(self.span_ms(t.ttl_ms()));
                    t.deadline = t.deadline.max(renewed);
                    out.push(KeepAlive::Alive {
                        ttl_ms: u64::from(t.ttl_ms()),
                    });
                }
                _ => out.push(KeepAlive::Gone),
            }
        }
        Ok(())
    }

    /// Follows the applied log: new sessions start their TTL now, ended ones stop.
    ///
    /// Events that time nothing (a waiter granted or gone) do not take the lock: apply calls this on
    /// the Raft runtime's thread (one worker in the dev layout) holding the state machine's write lock,
    /// and a keepalive message holds the lease lock, on a client-port thread, while it renews up to
    /// 10,000 sessions. Waiting for it would hold up the group's Raft work and every reader of its table.
    pub fn on_events(&self, events: &[Event], now: Instant) {
        if !events.iter().any(Self::times) {
            return;
        }
        let mut s = self.lock();
        if s.leading.is_none() {
            return;
        }
        s.now_ms(now); // moves the epoch if it must, before any deadline is taken from it
        let mut earlier = false;
        for event in events {
            match event {
                Event::SessionOpened {
                    session,
                    ttl_ms,
                    secret,
                } => {
                    let deadline = s.deadline_ms(now + self.span(Duration::from_millis(*ttl_ms)));
                    s.timers
                        .insert(*session, Timer::new(*ttl_ms, *secret, deadline));
                    s.heap.push(Reverse(Due::new(deadline, *session)));
                    earlier = true;
                }
                Event::SessionEnded { session } => {
                    s.timers.remove(session);
                }
                Event::LockDelayed {
                    name,
                    token,
                    delay_ms,
                    began,
                    shared,
                } => {
                    let end = now + self.span(Duration::from_millis(u64::from(*delay_ms)));
                    let delay = Delay {
                        name: name.clone(),
                        token: *token,
                        began: *began,
                        shared: *shared,
                        delay_ms: *delay_ms,
                    };
                    s.delay_until(delay, end);
                    earlier = true;
                }
                _ => {}
            }
        }
        drop(s);
        if earlier {
            self.wake.notify_one();
        }
    }

    /// Whether `event` changes what the leases time: a session that starts or ends, a lock delay.
    /// Every kind is named, so that a new one must be placed here (and in [`Leases::on_events`]).
    fn times(event: &Event) -> bool {
        match event {
            Event::SessionOpened { .. }
            | Event::SessionEnded { .. }
            | Event::LockDelayed { .. } => true,
            Event::Granted { .. } | Event::GrantAbandoned { .. } | Event::WaiterRemoved { .. } => {
                false
            }
        }
    }

    /// The remaining TTL of a session on this leader's clock.
    pub fn remaining(&self, id: SessionId, now: Instant) -> Option<Duration> {
        let s = self.lock();
        s.timers
            .get(&id)
            .map(|t| s.instant(t.deadline).saturating_duration_since(now))
    }

    /// Sessions whose deadline has passed; each is marked as expiring and returned once. An entry
    /// that comes due for a session renewed since goes back at its new deadline.
    pub fn take_due(&self, now: Instant) -> Vec<SessionId> {
        let mut guard = self.lock();
        let s = &mut *guard;
        let mut due = Vec::new();
        let now = s.now_ms(now);
        while let Some(Reverse(entry)) = s.heap.peek().copied() {
            if entry.at > now {
                break;
            }
            s.heap.pop();
            let id = entry.id();
            let Some(t) = s.timers.get_mut(&id) else {
                continue; // ended
            };
            if t.expiring() && !t.retry() {
                continue; // proposed; `retry_expiry` pushes it again if that fails
            }
            if t.deadline > now {
                let at = t.deadline;
                s.heap.push(Reverse(Due::new(at, id)));
                continue;
            }
            t.set(EXPIRING, true);
            t.set(RETRY, false);
            due.push(id);
        }
        due
    }

    /// Those of `ids` whose expiry this server may still propose: it still times sessions in `term`,
    /// and each is marked expiring (taken by [`Leases::take_due`]) and not waiting for a retry. A
    /// session given a fresh TTL since (leadership lost and regained in a new term) is not: it may
    /// have been renewed since. After a hand-over that failed, timing restarts in the same term with
    /// such sessions still expiring (see `expiring_at_hand_over`).
    pub fn still_expiring(&self, term: u64, ids: &[SessionId]) -> Vec<SessionId> {
        let s = self.lock();
        if s.leading != Some(term) {
            return Vec::new();
        }
        ids.iter()
            .copied()
            .filter(|id| s.timers.get(id).is_some_and(|t| t.expiring() && !t.retry()))
            .collect()
    }

    /// An expiry proposal failed for a reason other than losing leadership: propose again at `at`. The
    /// session stays expiring (it may have committed), so it is still never renewed. A timer that is
    /// not expiring was started again since (this server lost and regained leadership: the new term's
    /// barrier settled the old proposal, and the session has a full fresh TTL): left alone.
    pub fn retry_expiry(&self, id: SessionId, at: Instant) {
        let mut guard = self.lock();
        let s = &mut *guard;
        let at = s.deadline_ms(at);
        if let Some(t) = s.timers.get_mut(&id).filter(|t| t.expiring()) {
            t.set(RETRY, true);
            t.deadline = at;
            s.heap.push(Reverse(Due::new(at, id)));
        }
        drop(guard);
        self.wake.notify_one();
    }

    /// Lock-delays that have run their full time: each is returned once.
    pub fn take_due_delays(&self, now: Instant) -> Vec<Delay> {
        let mut s = self.lock();
        let mut due = Vec::new();
        while s
            .delays
            .first_key_value()
            .is_some_and(|((end, ..), _)| *end <= now)
        {
            let ((_, name, token, began), delay) = s.delays.pop_first().expect("checked above");
            s.delay_ends.remove(&(name, token, began));
            due.push(delay);
        }
        due
    }

    /// An `EndLockDelay` proposal failed for a reason other than losing leadership: propose it again
    /// at `at` (ending a delay twice changes nothing).
    pub fn retry_delay(&self, delay: Delay, at: Instant) {
        let mut s = self.lock();
        if s.leading.is_some() {
            s.delay_until(delay, at);
        }
        drop(s);
        self.wake.notify_one();
    }

    /// When the expiry task should next look.
    pub fn next_deadline(&self) -> Option<Instant> {
        let s = self.lock();
        let session = s.heap.peek().map(|Reverse(d)| s.instant(d.at));
        let delay = s.delays.first_key_value().map(|((d, ..), _)| *d);
        match (session, delay) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn alive(leases: &Leases, id: u64, now: Instant) -> Option<KeepAlive> {
        let mut out = Vec::new();
        leases.keepalive(&[id], &[], now, &mut out).ok()?;
        out.pop()
    }

    /// Apply hands every entry's events to the leases on the Raft runtime's thread, holding the state
    /// machine's write lock. Events that time nothing (a waiter granted or gone) must not wait for the
    /// lease lock, which a keepalive of thousands of sessions holds on another thread while it renews
    /// them: the whole Raft pipeline would wait with them.
    #[tokio::test]
    async fn events_that_time_nothing_do_not_wait_for_the_lease_lock() {
        let leases = Leases::default();
        let t0 = Instant::now();
        leases.start_leading(1, [(SessionId(1), 10_000, 0)].into_iter(), Vec::new(), t0);
        let name = LockName::new("x").unwrap();
        let events = [
            Event::Granted {
                name: name.clone(),
                session: SessionId(1),
                request: holdfast_lock_table::RequestId(2),
                token: FencingToken(3),
            },
            Event::WaiterRemoved {
                name: name.clone(),
                session: SessionId(1),
                request: holdfast_lock_table::RequestId(4),
            },
            Event::GrantAbandoned {
                name,
                session: SessionId(1),
                token: FencingToken(3),
            },
        ];
        let (done_tx, done) = std::sync::mpsc::channel();
        std::thread::scope(|scope| {
            // Held as a keepalive holds it, and let go before the verdict, so the thread always ends.
            let held = leases.lock();
            scope.spawn(|| {
                leases.on_events(&events, t0);
                done_tx.send(()).unwrap();
            });
            let finished = done.recv_timeout(Duration::from_secs(30));
            drop(held);
            finished.expect("apply's events waited for the lease lock");
        });
        // An event that does time something still goes in.
        leases.on_events(
            &[Event::SessionEnded {
                session: SessionId(1),
            }],
            t0,
        );
        assert_eq!(leases.remaining(SessionId(1), t0), None);
    }

    #[tokio::test(start_paused = true)]
    async fn a_fast_clock_ends_a_ttl_early_in_real_time_and_a_slow_one_late() {
        let t0 = Instant::now();
        // 5% fast: a 10 s TTL on this clock is 9.524 s of real time.
        let fast = Leases::with_clock_rate_ppm(50_000);
        fast.start_leading(1, [(SessionId(1), 10_000, 0)].into_iter(), Vec::new(), t0);
        assert!(fast.take_due(t0 + Duration::from_millis(9_523)).is_empty());
        assert_eq!(
            fast.take_due(t0 + Duration::from_millis(9_524)),
            vec![SessionId(1)]
        );
        // 5% slow: 10.526 s.
        let slow = Leases::with_clock_rate_ppm(-50_000);
        slow.start_leading(1, [(SessionId(2), 10_000, 0)].into_iter(), Vec::new(), t0);
        assert!(slow.take_due(t0 + Duration::from_millis(10_526)).is_empty());
        assert_eq!(
            slow.take_due(t0 + Duration::from_millis(10_527)),
            vec![SessionId(2)]
        );
        // A keepalive on the fast clock renews for the same 9.524 s.
        fast.start_leading(2, [(SessionId(1), 10_000, 0)].into_iter(), Vec::new(), t0);
        let renewed = t0 + Duration::from_secs(1);
        assert!(alive(&fast, 1, renewed).is_some());
        assert!(fast
            .take_due(renewed + Duration::from_millis(9_523))
            .is_empty());
        assert_eq!(
            fast.take_due(renewed + Duration::from_millis(9_524)),
            vec![SessionId(1)]
        );
    }

    #[tokio::test(start_paused = true)]
    async fn no_timing_starts_while_a_hand_over_is_under_way() {
        let leases = Leases::default();
        let t0 = Instant::now();
        let sessions = || [(SessionId(3), 10_000, 0)].into_iter();
        assert!(leases.start_leading(1, sessions(), Vec::new(), t0));
        leases.begin_hand_over();
        assert_eq!(leases.leading_term(), None);
        assert_eq!(alive(&leases, 3, t0), None, "renewed during a hand-over");
        // A leadership barrier that was under way finishes now: it must not start timing.
        assert!(!leases.start_leading(1, sessions(), Vec::new(), t0));
        leases.stop_leading();
        assert!(!leases.start_leading(2, sessions(), Vec::new(), t0));
        assert_eq!(leases.leading_term(), None);
        leases.end_hand_over();
        assert!(leases.start_leading(2, sessions(), Vec::new(), t0));
        assert_eq!(leases.leading_term(), Some(2));
    }

    /// A hand-over that fails leaves this server timing sessions again in the same term. A session
    /// whose expiry was proposed before it may still be expired by that proposal, so it must not be
    /// renewed in between: it stays expiring and its expiry is proposed again. In a new term (whose
    /// barrier settled every earlier proposal) it gets a fresh TTL like every other session.
    #[tokio::test(start_paused = true)]
    async fn a_failed_hand_over_does_not_revive_a_session_whose_expiry_was_proposed() {
        let leases = Leases::default();
        let t0 = Instant::now();
        let sessions = || [(SessionId(4), 10_000, 0), (SessionId(5), 10_000, 0)].into_iter();
        assert!(leases.start_leading(1, sessions(), Vec::new(), t0));
        // Session 5 is renewed; session 4 is not, and its expiry is proposed.
        let later = t0 + Duration::from_secs(6);
        assert!(alive(&leases, 5, later).is_some());
        let due = t0 + Duration::from_secs(10);
        assert_eq!(leases.take_due(due), vec![SessionId(4)]);
        // A hand-over begins and fails twice; timing starts again in term 1.
        leases.begin_hand_over();
        leases.end_hand_over();
        leases.stop_leading();
        leases.begin_hand_over();
        leases.end_hand_over();
        let restart = due + Duration::from_millis(5);
        assert!(leases.start_leading(1, sessions(), Vec::new(), restart));
        assert_eq!(alive(&leases, 4, restart), Some(KeepAlive::Gone));
        assert_eq!(
            alive(&leases, 5, restart),
            Some(KeepAlive::Alive { ttl_ms: 10_000 })
        );
        assert_eq!(
            leases.take_due(restart),
            vec![SessionId(4)],
            "proposed again"
        );
        assert_eq!(
            leases.still_expiring(1, &[SessionId(4)]),
            vec![SessionId(4)]
        );
        // A new term: the proposal was settled by its barrier, and the session has a fresh TTL.
        leases.begin_hand_over();
        leases.end_hand_over();
        assert!(leases.start_leading(2, sessions(), Vec::new(), restart));
        assert_eq!(
            alive(&leases, 4, restart),
            Some(KeepAlive::Alive { ttl_ms: 10_000 })
        );
        assert!(leases.take_due(restart).is_empty());
    }

    #[tokio::test(start_paused = true)]
    async fn a_session_expires_one_ttl_after_its_last_keepalive() {
        let leases = Leases::default();
        let t0 = Instant::now();
        leases.start_leading(1, [(SessionId(7), 10_000, 0)].into_iter(), Vec::new(), t0);
        tokio::time::advance(Duration::from_secs(9)).await;
        assert_eq!(
            alive(&leases, 7, Instant::now()),
            Some(KeepAlive::Alive { ttl_ms: 10_000 })
        );
        tokio::time::advance(Duration::from_millis(9_999)).await;
        assert!(
            leases.take_due(Instant::now()).is_empty(),
            "expired before its TTL"
        );
        tokio::time::advance(Duration::from_millis(1)).await;
        assert_eq!(leases.take_due(Instant::now()), vec![SessionId(7)]);
        // Once proposed, the session is not renewed and not proposed twice.
        assert_eq!(alive(&leases, 7, Instant::now()), Some(KeepAlive::Gone));
        assert!(leases
            .take_due(Instant::now() + Duration::from_secs(60))
            .is_empty());
    }

    #[tokio::test(start_paused = true)]
    async fn a_failed_expiry_is_retried_and_never_renewed_meanwhile() {
        let leases = Leases::default();
        let t0 = Instant::now();
        leases.start_leading(1, [(SessionId(4), 2_000, 0)].into_iter(), Vec::new(), t0);
        let due_at = t0 + Duration::from_secs(2);
        assert_eq!(leases.take_due(due_at), vec![SessionId(4)]);
        // The proposal's outcome is unknown: it may still commit, so the session must stay unrenewable.
        leases.retry_expiry(SessionId(4), due_at + Duration::from_millis(500));
        let mut out = Vec::new();
        leases
            .keepalive(&[4], &[], due_at + Duration::from_millis(100), &mut out)
            .unwrap();
        assert_eq!(out, vec![KeepAlive::Gone]);
        assert!(leases
            .take_due(due_at + Duration::from_millis(499))
            .is_empty());
        assert_eq!(
            leases.take_due(due_at + Duration::from_millis(500)),
            vec![SessionId(4)]
        );
    }

    #[tokio::test(start_paused = true)]
    async fn a_new_leader_gives_a_full_fresh_ttl() {
        let leases = Leases::default();
        let t0 = Instant::now();
        leases.start_leading(1, [(SessionId(1), 5_000, 0)].into_iter(), Vec::new(), t0);
        tokio::time::advance(Duration::from_secs(4)).await;
        leases.stop_leading();
        assert_eq!(
            alive(&leases, 1, Instant::now()),
            None,
            "a follower does not renew"
        );
        let t1 = Instant::now();
        leases.start_leading(2, [(SessionId(1), 5_000, 0)].into_iter(), Vec::new(), t1);
        assert!(leases
            .take_due(t1 + Duration::from_millis(4_999))
            .is_empty());
        assert_eq!(
            leases.take_due(t1 + Duration::from_millis(5_000)),
            vec![SessionId(1)]
        );
    }

    /// A failed expiry proposal whose retry arrives after this server lost and regained leadership
    /// changes nothing: the new term gave the session a full fresh TTL, and it keeps it.
    #[tokio::test(start_paused = true)]
    async fn a_retry_from_an_earlier_term_does_not_cut_a_fresh_ttl_short() {
        let leases = Leases::default();
        let t0 = Instant::now();
        leases.start_leading(1, [(SessionId(1), 5_000, 0)].into_iter(), Vec::new(), t0);
        assert_eq!(
            leases.take_due(t0 + Duration::from_secs(5)),
            vec![SessionId(1)]
        );
        leases.stop_leading();
        let t1 = t0 + Duration::from_secs(6);
        leases.start_leading(2, [(SessionId(1), 5_000, 0)].into_iter(), Vec::new(), t1);
        leases.retry_expiry(SessionId(1), t1 + Duration::from_millis(500));
        assert!(leases
            .take_due(t1 + Duration::from_millis(4_999))
            .is_empty());
        assert_eq!(
            leases.take_due(t1 + Duration::from_secs(5)),
            vec![SessionId(1)]
        );
    }

    /// Two keepalives that take the lock in the other order than they read the clock: the deadline
    /// stays at the later one's.
    #[tokio::test(start_paused = true)]
    async fn an_older_clock_reading_never_moves_a_deadline_earlier() {
        let leases = Leases::default();
        let t0 = Instant::now();
        leases.start_leading(1, [(SessionId(1), 5_000, 0)].into_iter(), Vec::new(), t0);
        let later = t0 + Duration::from_secs(2);
        assert!(alive(&leases, 1, later).is_some());
        assert!(alive(&leases, 1, t0 + Duration::from_secs(1)).is_some());
        assert!(leases
            .take_due(later + Duration::from_millis(4_999))
            .is_empty());
        assert_eq!(
            leases.take_due(later + Duration::from_secs(5)),
            vec![SessionId(1)]
        );
    }

    fn opened_event(id: u64, ttl_ms: u64) -> Event {
        Event::SessionOpened {
            session: SessionId(id),
            ttl_ms,
            secret: 0,
        }
    }

    /// Deadlines are kept in whole milliseconds: rounded up, never down, so a session opened or renewed
    /// between two milliseconds is never due before its exact deadline.
    #[tokio::test(start_paused = true)]
    async fn a_deadline_between_milliseconds_comes_due_after_it_never_before() {
        let leases = Leases::default();
        let t0 = Instant::now();
        leases.start_leading(1, std::iter::empty(), Vec::new(), t0);
        let opened = t0 + Duration::from_micros(1_500);
        leases.on_events(&[opened_event(4, 10_000)], opened);
        let exact = opened + Duration::from_secs(10); // t0 + 10,001.5 ms
        assert!(leases.take_due(exact - Duration::from_micros(1)).is_empty());
        assert_eq!(
            leases.remaining(SessionId(4), exact),
            Some(Duration::from_micros(500))
        );
        assert_eq!(
            leases.take_due(exact + Duration::from_micros(500)),
            vec![SessionId(4)]
        );
        // A keepalive between milliseconds rounds up the same way.
        leases.on_events(&[opened_event(5, 10_000)], t0);
        let renewed = t0 + Duration::from_micros(2_300);
        assert!(alive(&leases, 5, renewed).is_some());
        let exact = renewed + Duration::from_secs(10);
        assert!(leases.take_due(exact).is_empty());
        assert_eq!(
            leases.take_due(exact + Duration::from_micros(700)),
            vec![SessionId(5)]
        );
    }

    /// Deadlines count milliseconds in 32 bits from an epoch; a leadership that lasts longer than that
    /// (49 days) moves the epoch forward, and every timer keeps its deadline.
    #[tokio::test(start_paused = true)]
    async fn a_leadership_of_months_keeps_every_deadline() {
        let leases = Leases::default();
        let t0 = Instant::now();
        let sessions = [(SessionId(1), 10_000, 0), (SessionId(2), 300_000, 0)];
        leases.start_leading(1, sessions.into_iter(), Vec::new(), t0);
        let day = Duration::from_secs(86_400);
        // Both sessions are renewed once a day (nothing takes their expiries in between, so a day's
        // gap renews them like a keepalive every few seconds would), for 100 days: the epoch moves
        // four times (every ~24.9 days).
        let mut now = t0;
        for _ in 0..100 {
            now += day;
            assert_eq!(
                alive(&leases, 1, now),
                Some(KeepAlive::Alive { ttl_ms: 10_000 })
            );
            assert_eq!(
                alive(&leases, 2, now),
                Some(KeepAlive::Alive { ttl_ms: 300_000 })
            );
            assert!(leases
                .take_due(now + Duration::from_millis(9_999))
                .is_empty());
        }
        assert_eq!(
            leases.remaining(SessionId(1), now),
            Some(Duration::from_secs(10))
        );
        assert_eq!(leases.next_deadline(), Some(now + Duration::from_secs(10)));
        assert_eq!(
            leases.take_due(now + Duration::from_secs(10)),
            vec![SessionId(1)]
        );
        assert!(leases
            .take_due(now + Duration::from_millis(299_999))
            .is_empty());
        assert_eq!(
            leases.take_due(now + Duration::from_secs(300)),
            vec![SessionId(2)]
        );
        // A leader left alone for 200 days (more than a u32 of milliseconds past the epoch): a
        // session that opens then gets its full TTL.
        now += day * 200;
        leases.on_events(&[opened_event(3, 10_000)], now);
        assert!(leases
            .take_due(now + Duration::from_millis(9_999))
            .is_empty());
        assert_eq!(
            leases.take_due(now + Duration::from_secs(10)),
            vec![SessionId(3)]
        );
    }

    /// An expiry taken in one term may be proposed only while this server still times sessions in that
    /// term and the session is still expiring.
    #[tokio::test(start_paused = true)]
    async fn a_taken_expiry_is_proposed_only_in_its_term() {
        let leases = Leases::default();
        let t0 = Instant::now();
        let ids = [SessionId(1), SessionId(2)];
        leases.start_leading(1, ids.iter().map(|&id| (id, 5_000, 0)), Vec::new(), t0);
        let due = leases.take_due(t0 + Duration::from_secs(5));
        assert_eq!(leases.still_expiring(1, &due), ids.to_vec());
        leases.retry_expiry(SessionId(2), t0 + Duration::from_secs(6));
        assert_eq!(leases.still_expiring(1, &due), vec![SessionId(1)]);
        leases.stop_leading();
        assert!(leases.still_expiring(1, &due).is_empty());
        leases.start_leading(2, ids.iter().map(|&id| (id, 5_000, 0)), Vec::new(), t0);
        assert!(leases.still_expiring(1, &due).is_empty());
        assert!(leases.still_expiring(2, &due).is_empty(), "a fresh TTL");
    }

    /// A keepalive with a wrong secret for any of its sessions renews none of them.
    #[tokio::test(start_paused = true)]
    async fn a_wrong_secret_renews_nothing() {
        let leases = Leases::default();
        let t0 = Instant::now();
        leases.start_leading(
            1,
            [(SessionId(1), 5_000, 11), (SessionId(2), 5_000, 22)].into_iter(),
            Vec::new(),
            t0,
        );
        tokio::time::advance(Duration::from_secs(4)).await;
        let now = Instant::now();
        // What `out` held before a refused call stays; nothing of the call is left in it.
        let mut out = vec![KeepAlive::Gone];
        for (ids, secrets, wrong) in [
            (&[1, 2][..], &[11, 23][..], 2),
            (&[1, 2], &[], 1),
            (&[1, 2], &[11], 2),
            // Renewed, unknown, renewed again, then refused: every renewal is put back.
            (&[1, 9, 1, 2], &[11, 5, 11, 21], 2),
        ] {
            assert_eq!(
                leases.keepalive(ids, secrets, now, &mut out),
                Err(KeepAliveRefused::WrongSecret(SessionId(wrong))),
            );
        }
        assert_eq!(out, [KeepAlive::Gone]);
        out.clear();
        for id in [1, 2] {
            assert_eq!(
                leases.remaining(SessionId(id), now),
                Some(Duration::from_secs(1))
            );
        }
        // Refused sessions still come due at their old deadlines.
        assert!(leases.take_due(now + Duration::from_millis(999)).is_empty());
        assert_eq!(
            leases.take_due(now + Duration::from_secs(1)),
            [SessionId(1), SessionId(2)]
        );
        let leases = Leases::default();
        leases.start_leading(
            1,
            [(SessionId(1), 5_000, 11), (SessionId(2), 5_000, 22)].into_iter(),
            Vec::new(),
            t0,
        );
        leases
            .keepalive(&[1, 2, 9], &[11, 22, 5], now, &mut out)
            .unwrap();
        assert_eq!(out[2], KeepAlive::Gone);
        assert_eq!(
            leases.remaining(SessionId(1), now),
            Some(Duration::from_secs(5))
        );
    }

    #[tokio::test(start_paused = true)]
    async fn opened_and_ended_sessions_follow_the_log() {
        let leases = Leases::default();
        let now = Instant::now();
        leases.start_leading(1, std::iter::empty(), Vec::new(), now);
        leases.on_events(
            &[Event::SessionOpened {
                session: SessionId(3),
                ttl_ms: 2_000,
                secret: 0,
            }],
            now,
        );
        assert_eq!(
            leases.remaining(SessionId(3), now),
            Some(Duration::from_secs(2))
        );
        leases.on_events(
            &[Event::SessionEnded {
                session: SessionId(3),
            }],
            now,
        );
        assert_eq!(alive(&leases, 3, now), Some(KeepAlive::Gone));
        assert!(leases.take_due(now + Duration::from_secs(10)).is_empty());
    }

    /// Renewals do not grow the heap: it keeps one entry per session, and an entry that comes due for a
    /// renewed session goes back at the new deadline, so the session expires a full TTL after its last
    /// renewal, not after its first.
    #[tokio::test(start_paused = true)]
    async fn many_keepalives_keep_one_heap_entry_per_session() {
        let leases = Leases::default();
        let now = Instant::now();
        leases.start_leading(
            1,
            (1..=100).map(|i| (SessionId(i), 10_000, 0)),
            Vec::new(),
            now,
        );
        for round in 0..1_000u64 {
            let t = now + Duration::from_millis(round);
            let mut out = Vec::new();
            leases
                .keepalive(&(1..=100).collect::<Vec<_>>(), &[], t, &mut out)
                .unwrap();
        }
        assert_eq!(leases.lock().heap.len(), 100);
        // The last renewal was at +999 ms: nothing is due at +10 s (the entries from the start come
        // due and go back), everything at +10.999 s.
        assert!(leases.take_due(now + Duration::from_secs(10)).is_empty());
        assert_eq!(leases.lock().heap.len(), 100);
        assert!(leases
            .take_due(now + Duration::from_millis(10_998))
            .is_empty());
        assert_eq!(
            leases.take_due(now + Duration::from_millis(10_999)).len(),
            100
        );
    }

    fn delay(name: &LockName, token: u64, began: u64, shared: bool, delay_ms: u32) -> Delay {
        Delay {
            name: name.clone(),
            token: FencingToken(token),
            began,
            shared,
            delay_ms,
        }
    }

    fn delayed_event(d: &Delay) -> Event {
        Event::LockDelayed {
            name: d.name.clone(),
            token: d.token,
            delay_ms: d.delay_ms,
            began: d.began,
            shared: d.shared,
        }
    }

    #[tokio::test(start_paused = true)]
    async fn a_lock_delay_ends_a_full_delay_after_the_expiry_or_the_new_term() {
        let x = LockName::new("x").unwrap();
        let leases = Leases::default();
        let t0 = Instant::now();
        // A new leader times a delay already under way with the full delay from now.
        leases.start_leading(
            1,
            std::iter::empty(),
            vec![delay(&x, 4, 5, false, 3_000)],
            t0,
        );
        assert_eq!(leases.next_deadline(), Some(t0 + Duration::from_secs(3)));
        assert!(leases
            .take_due_delays(t0 + Duration::from_millis(2_999))
            .is_empty());
        let due = leases.take_due_delays(t0 + Duration::from_secs(3));
        assert_eq!(due, vec![delay(&x, 4, 5, false, 3_000)]);
        assert!(
            leases
                .take_due_delays(t0 + Duration::from_secs(9))
                .is_empty(),
            "returned once"
        );
        // One that begins while leading runs from the apply.
        let y = LockName::new("y").unwrap();
        let t1 = t0 + Duration::from_secs(10);
        leases.on_events(&[delayed_event(&delay(&y, 9, 12, false, 1_000))], t1);
        assert_eq!(leases.next_deadline(), Some(t1 + Duration::from_secs(1)));
        // A follower keeps no delay timers.
        leases.stop_leading();
        assert!(leases
            .take_due_delays(t1 + Duration::from_secs(5))
            .is_empty());
        assert_eq!(leases.next_deadline(), None);
    }

    /// Two delays of one lock are timed apart, whether they differ in token (a semaphore's permits) or
    /// only in start (two readers granted by one entry, expired one after the other); each is returned
    /// once, with what ends it.
    #[tokio::test(start_paused = true)]
    async fn delays_are_timed_per_lock_token_and_start() {
        let s = LockName::new("s").unwrap();
        let leases = Leases::default();
        let t0 = Instant::now();
        leases.start_leading(
            1,
            std::iter::empty(),
            vec![delay(&s, 4, 6, false, 1_000), delay(&s, 5, 7, false, 1_000)],
            t0,
        );
        let due = leases.take_due_delays(t0 + Duration::from_secs(1));
        assert_eq!(
            due.iter().map(|d| d.token.0).collect::<Vec<_>>(),
            vec![4, 5]
        );
        let t1 = t0 + Duration::from_secs(10);
        let first = delay(&s, 9, 11, true, 3_000);
        let second = delay(&s, 9, 12, true, 1_000);
        leases.on_events(&[delayed_event(&first)], t1);
        leases.on_events(&[delayed_event(&second)], t1 + Duration::from_secs(1));
        assert_eq!(leases.next_deadline(), Some(t1 + Duration::from_secs(2)));
        assert_eq!(
            leases.take_due_delays(t1 + Duration::from_secs(2)),
            vec![second.clone()]
        );
        assert!(matches!(
            second.end(0),
            holdfast_lock_table::Command::EndLockDelayAt { began: 12, .. }
        ));
        assert_eq!(
            leases.take_due_delays(t1 + Duration::from_secs(3)),
            vec![first]
        );
        assert_eq!(leases.next_deadline(), None);
    }
}
