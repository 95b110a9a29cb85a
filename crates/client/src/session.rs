//! Sessions: opened in a group at their first use there, kept alive in the background, and a
//! client-side lease that says when the session may be gone on the server.
//!
//! A [`Session`] is one session per Raft group under the hood, but only in the groups it uses: with one
//! group, [`Client::open_session`] opens it there; with several, it opens none, and the first
//! operation on a name opens the session in that name's group ([`Session::open_for`]). So a client
//! that uses two of eight groups costs the servers two sessions, two log entries to open, and
//! keepalives to the leaders of those two groups only.
//!
//! The lease is counted on this process's lease clock (below) from the moment the last successful keepalive
//! was **sent** (the server restarted the TTL when it *received* it, which is later), minus a safety margin
//! of a tenth of the TTL for clock-rate differences. So [`Session::lost`] fires before the server can expire
//! the session, and an application that stops acting as the holder when it fires never overlaps with the
//! next holder, as long as clocks tick at about the same rate. Fencing tokens cover the rest.
//!
//! The monotonic clock (`CLOCK_MONOTONIC`) stands still while the machine is suspended, and the servers'
//! clocks do not: a laptop (or a guest that suspends itself) that sleeps past its sessions' TTLs would
//! wake believing it still held their locks. (A hypervisor pausing a VM stops both of its clocks: that
//! pause is not seen, as a process stopped by SIGSTOP is not; fencing tokens cover those.) So the lease is read on [`lease_now`], the monotonic clock plus the time the machine
//! spent suspended since this process started (Linux: `CLOCK_BOOTTIME` against `CLOCK_MONOTONIC`).
//! After a resume, [`Session::is_valid`] is false at once for a lease that ran out meanwhile, and within
//! a second the keepalive task (or [`Session::lost`]'s own look) marks it lost.

use crate::client::Client;
use crate::error::Error;
use crate::guard::LockGuard;
use holdfast_proto::v1 as pb;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::watch;
use tokio::time::Instant;

/// Why a session's lease is (or may be) lost.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LeaseLost(pub String);

#[derive(Clone, Debug)]
struct Lease {
    /// The earliest lease end over the groups the session is open in (far in the future before the
    /// first opens: nothing can be lost yet).
    valid_until: Instant,
    /// Wall-clock ms when the last acknowledged renewal (or the open) was sent, for checkers.
    renewed_sent_wall_ms: u64,
    /// When the batched keepalive task should next renew this session.
    next_due: Instant,
    lost: Option<LeaseLost>,
    /// The smallest TTL granted by the groups opened so far; None before the first opens.
    ttl: Option<Duration>,
    /// Per group, once its open joined the lease: the lease end that open gave (from its send time),
    /// its send time on the wall clock, and when it is due. Written together with the lease, so a
    /// round that did not renew a group (it joined while the round was in flight) is bounded by it.
    opened: Vec<Option<(Instant, u64, Instant)>>,
}

/// The session's part in one group.
pub(crate) struct GroupSession {
    pub(crate) id: u64,
    /// Empty for a server that gave none: sent with every request that acts on the session, and
    /// never shown.
    /// Shared, not copied, into every keepalive that renews this part.
    pub(crate) secret: prost::bytes::Bytes,
}

/// A session: one per group it is used in under the hood (opened at the first use), renewed together.
/// Cheap to clone.
#[derive(Clone)]
pub struct Session {
    pub(crate) inner: Arc<SessionInner>,
}

pub(crate) struct SessionInner {
    pub(crate) client: Client,
    /// The TTL asked for (zero: the servers' default).
    requested_ttl: Duration,
    /// The session in each group, once opened there. A cell is set once and never cleared, so a
    /// concurrent first use of one group opens it once.
    groups: Vec<tokio::sync::OnceCell<GroupSession>>,
    /// The next request id in each group: each group's table checks its sessions' ids on their own
    /// (a request id may be at most 2^20 above that session's highest), so one counter per group.
    next_request: Vec<AtomicU64>,
    lease: watch::Sender<Lease>,
    keepalive: Mutex<Option<tokio::task::JoinHandle<()>>>,
}

impl Drop for SessionInner {
    fn drop(&mut self) {
        if let Some(task) = self.keepalive.lock().ok().and_then(|mut k| k.take()) {
            task.abort();
        }
    }
}

/// Wall-clock milliseconds since the Unix epoch.
pub(crate) fn wall_ms() -> u64 {
    #[cfg(holdfast_sim)]
    return turmoil::since_epoch().map_or(0, |d| d.as_millis() as u64);
    #[cfg(not(holdfast_sim))]
    return std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64);
}

fn margin(ttl: Duration) -> Duration {
    ttl / 10
}

/// A nonce for `OpenSession`, unique per open: 128 bits from the OS random number generator (a
/// repeated nonce would hand one client another's session). Should that fail, std's `RandomState`
/// (seeded from the OS per process) mixed with time, pid and a counter.
fn nonce(client: &Client) -> (u64, u64) {
    use std::hash::{BuildHasher, Hasher};
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    if let Some(seed) = client.options().nonce_seed {
        // `DefaultHasher::new()` has fixed keys: a reproducible stream of (seed, n), distinct per seed.
        let mut h = std::collections::hash_map::DefaultHasher::new();
        h.write_u64(seed);
        h.write_u64(client.inner().opens.fetch_add(1, Relaxed));
        let hi = h.finish();
        h.write_u64(hi);
        return (hi | 1, h.finish());
    }
    if let Some(n) = os_nonce() {
        return n;
    }
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default();
    h.write_u128(now.as_nanos());
    h.write_u32(std::process::id());
    h.write_u64(COUNTER.fetch_add(1, Relaxed));
    let hi = h.finish();
    h.write_u64(hi);
    (hi | 1, h.finish())
}

/// A nonce from the OS random number generator (the first half never 0), or None if it failed.
fn os_nonce() -> Option<(u64, u64)> {
    let mut bytes = [0u8; 16];
    getrandom::getrandom(&mut bytes).ok()?;
    let (hi, lo) = bytes.split_at(8);
    let hi = u64::from_le_bytes(hi.try_into().expect("8 bytes"));
    let lo = u64::from_le_bytes(lo.try_into().expect("8 bytes"));
    Some((hi | 1, lo))
}

/// An acquire in flight. Dropped while armed (the caller's future was dropped, or the call failed with an
/// unknown outcome), it cancels the acquire through the log, so no grant is left that nobody knows of.
struct PendingAcquire<'a> {
    session: Session,
    name: &'a str,
    request_id: u64,
    armed: bool,
}

impl Drop for PendingAcquire<'_> {
    fn drop(&mut self) {
        if self.armed {
            self.session
                .cancel_in_background(self.name.to_string(), self.request_id);
        }
    }
}

impl Client {
    /// Closes session `session_id` of `group` (a retry whose first attempt landed finds it gone).
    async fn close_in(&self, group: u32, session_id: u64, secret: &[u8]) -> Result<(), Error> {
        let r = self
            .call(group, Duration::ZERO, |mut c| {
                let session_secret = secret.to_vec();
                async move {
                    c.close_session(pb::CloseSessionRequest {
                        group,
                        session_id,
                        session_secret,
                    })
                    .await
                }
            })
            .await;
        match r {
            Ok(_) | Err(Error::SessionUnknown(_)) => Ok(()),
            Err(e) => Err(e),
        }
    }

    /// Opens a session with `ttl` (zero for the server's default) and keeps it alive every TTL/3.
    ///
    /// With one group the session is opened there now, so an unreachable cluster or a refused open
    /// fails here. With several it is opened in none yet: each group's part opens at the first use of
    /// a name in that group ([`Session::open_for`], which acquire calls), and fails there.
    pub async fn open_session(&self, ttl: Duration) -> Result<Session, Error> {
        let (lease, _) = watch::channel(Lease {
            valid_until: far_future(),
            renewed_sent_wall_ms: wall_ms(),
            next_due: far_future(),
            lost: None,
            ttl: None,
            opened: vec![None; self.groups() as usize],
        });
        let groups = self.groups() as usize;
        let inner = Arc::new(SessionInner {
            client: self.clone(),
            requested_ttl: ttl,
            groups: (0..groups).map(|_| tokio::sync::OnceCell::new()).collect(),
            next_request: (0..groups).map(|_| AtomicU64::new(1)).collect(),
            lease,
            keepalive: Mutex::new(None),
        });
        let session = Session { inner };
        if groups == 1 {
            session.open_in(0).await?;
        }
        if self.options().batched_keepalives {
            self.inner().registry.add(self.inner(), &session.inner);
        } else {
            let task = tokio::spawn(keepalive_loop(Arc::downgrade(&session.inner)));
            *session.inner.keepalive.lock().expect("keepalive lock") = Some(task);
        }
        Ok(session)
    }
}

/// Group `g`'s bit in a set of groups (`None` past 64 groups, which servers refuse: such a group
/// counts as not covered, the safe side).
pub(crate) fn group_bit(g: usize) -> Option<u64> {
    u32::try_from(g).ok().and_then(|g| 1u64.checked_shl(g))
}

/// Now on the lease's clock: the monotonic clock plus the time the machine spent suspended since this
/// process first asked (see the module docs). Every lease instant (sends, ends, due times) is on it.
pub(crate) fn lease_now() -> Instant {
    Instant::now() + suspended()
}

/// A lease-clock instant as a monotonic one, for a timer. A suspension after this makes the timer fire
/// late, so whatever it wakes reads [`lease_now`] again rather than trusting the timer.
pub(crate) fn timer_at(t: Instant) -> Instant {
    t.checked_sub(suspended()).unwrap_or_else(Instant::now)
}

/// How long the machine was suspended since the first call (whole milliseconds, so the two clocks'
/// readings a few nanoseconds apart do not count). Never decreases.
fn suspended() -> Duration {
    let measured = measured_suspension();
    #[cfg(test)]
    let measured = measured + tests::SUSPENDED.with(std::cell::Cell::get);
    measured
}

#[cfg(all(target_os = "linux", not(holdfast_sim)))]
fn measured_suspension() -> Duration {
    #[expect(
        unsafe_code,
        reason = "clock_gettime(2) with CLOCK_BOOTTIME has no safe wrapper in std"
    )]
    fn ns(clock: libc::clockid_t) -> i128 {
        let mut t = libc::timespec {
            tv_sec: 0,
            tv_nsec: 0,
        };
        // SAFETY: `t` is a valid timespec to write; both clocks exist on every Linux since 2.6.39.
        let rc = unsafe { libc::clock_gettime(clock, &mut t) };
        if rc != 0 {
            return 0;
        }
        i128::from(t.tv_sec) * 1_000_000_000 + i128::from(t.tv_nsec)
    }
    use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};
    // CLOCK_BOOTTIME minus CLOCK_MONOTONIC grows only by suspensions. Read between two monotonic
    // readings, the gap to the first is at least the true one and to the second at most: the start
    // takes the smaller, every later look the larger, so a pre-emption between the reads counts too
    // much (a shorter lease), never too little; and the result never goes down. A look whose reads
    // were far apart is taken again (up to four times), so that such an over-count rarely stays in
    // the maximum, where it would eat into a later real suspension.
    static START: AtomicI64 = AtomicI64::new(i64::MIN);
    static MAX_MS: AtomicU64 = AtomicU64::new(0);
    let read = || {
        (
            ns(libc::CLOCK_MONOTONIC),
            ns(libc::CLOCK_BOOTTIME),
            ns(libc::CLOCK_MONOTONIC),
        )
    };
    let mut reads = read();
    for _ in 0..4 {
        if reads.2 - reads.0 < 50_000 {
            break;
        }
        reads = read();
    }
    let (m1, b, m2) = reads;
    let (low, high) = ((b - m2) as i64, (b - m1) as i64);
    let start = match START.compare_exchange(i64::MIN, low, Ordering::Relaxed, Ordering::Relaxed) {
        Ok(_) => low,
        Err(start) => start,
    };
    let ms = u64::try_from((high - start) / 1_000_000).unwrap_or(0);
    Duration::from_millis(MAX_MS.fetch_max(ms, Ordering::Relaxed).max(ms))
}

/// Elsewhere (and in the deterministic simulation, whose clock is simulated) no suspension is seen.
#[cfg(not(all(target_os = "linux", not(holdfast_sim))))]
fn measured_suspension() -> Duration {
    Duration::ZERO
}

/// A timer for lease-clock instant `t` that also wakes within a second: after a suspension a timer
/// set before it fires late (the monotonic clock stood still), and whatever it wakes must look at
/// [`lease_now`] again soon.
fn lease_timer(t: Instant) -> tokio::time::Sleep {
    tokio::time::sleep_until(timer_at(t).min(Instant::now() + Duration::from_secs(1)))
}

/// An instant no lease reaches: ~30 years on (what tokio itself uses for "never").
fn far_future() -> Instant {
    Instant::now() + Duration::from_secs(86_400 * 365 * 30)
}

async fn keepalive_loop(weak: std::sync::Weak<SessionInner>) {
    loop {
        let Some(s) = weak.upgrade() else { return };
        // Subscribed before reading, so a first open that lands after the read still wakes the wait.
        let mut changed = s.lease.subscribe();
        let (next_due, valid_until, lost) = {
            let l = changed.borrow_and_update();
            (l.next_due, l.valid_until, l.lost.is_some())
        };
        if lost {
            return;
        }
        if lease_now() < next_due {
            // Not due (or open in no group yet): wait until due, or until a first group opens.
            drop(s);
            tokio::select! {
                _ = lease_timer(next_due) => {}
                _ = changed.changed() => {}
            }
            continue;
        }
        let sent = lease_now();
        let sent_wall_ms = wall_ms();
        if sent >= valid_until {
            s.mark_lost("no keepalive succeeded within the TTL".into());
            return;
        }
        match s.renew(valid_until).await {
            // Nothing open to renew (a first open still joining): look again shortly.
            Ok((_, 0)) => s.retry_soon(lease_now() + Duration::from_millis(100)),
            Ok((granted, covered)) => s.renewed(sent, sent_wall_ms, granted, covered),
            Err(Error::SessionUnknown(msg)) => {
                s.mark_lost(format!("the server expired or closed the session: {msg}"));
                return;
            }
            Err(e) => {
                tracing::debug!(%e, "keepalive failed; retrying");
                s.retry_soon(lease_now() + Duration::from_millis(200));
            }
        }
    }
}

impl SessionInner {
    pub(crate) fn is_lost(&self) -> bool {
        self.lease.borrow().lost.is_some()
    }

    /// Marks the session lost if its client-side lease ran out by `now` (on the lease clock).
    pub(crate) fn check_expired(&self, now: Instant) {
        if now >= self.lease.borrow().valid_until {
            self.mark_lost("no keepalive succeeded within the TTL".into());
        }
    }

    /// The TTL granted (the smallest over the groups opened), or the one asked for before any opened.
    pub(crate) fn ttl(&self) -> Duration {
        self.lease.borrow().ttl.unwrap_or(self.requested_ttl)
    }

    pub(crate) fn valid_until(&self) -> Instant {
        self.lease.borrow().valid_until
    }

    /// The earliest time the keepalive task must look at this session again: when it is due, or when
    /// its lease runs out (whichever is first).
    pub(crate) fn next_look(&self) -> Instant {
        let l = self.lease.borrow();
        l.next_due.min(l.valid_until)
    }

    pub(crate) fn is_due(&self, now: Instant) -> bool {
        let l = self.lease.borrow();
        l.lost.is_none() && now >= l.next_due
    }

    /// The session's part in `group`, if it is open there.
    pub(crate) fn in_group(&self, group: u32) -> Option<&GroupSession> {
        self.groups[group as usize].get()
    }

    /// The secret to send with a request on `group` (empty if not open there: the server refuses).
    pub(crate) fn secret_in(&self, group: u32) -> &[u8] {
        self.in_group(group).map_or(&[], |g| &g.secret[..])
    }

    /// A keepalive round sent at `sent` renewed the session's parts in the groups of `covered` (bit g:
    /// group g) with `ttl` (the smallest granted). A part open now that the round did not cover was
    /// opened while the round was in flight: its open may have been sent before the round, so the lease
    /// may not outlast what that open gave (and is due when that part is).
    pub(crate) fn renewed(&self, sent: Instant, sent_wall_ms: u64, ttl: Duration, covered: u64) {
        if covered == 0 {
            return;
        }
        self.lease.send_modify(|l| {
            // Read with the lease: a part joins it (`join`) before its cell is set.
            let cap = (l.opened.iter().enumerate())
                .filter(|&(g, _)| group_bit(g).is_none_or(|bit| covered & bit == 0))
                .filter_map(|(_, opened)| *opened)
                .reduce(|a, b| (a.0.min(b.0), a.1.min(b.1), a.2.min(b.2)));
            let ttl = l.ttl.map_or(ttl, |t| t.min(ttl));
            let (mut end, mut wall, mut due) =
                (sent + ttl - margin(ttl), sent_wall_ms, sent + ttl / 3);
            if let Some((e, w, d)) = cap {
                (end, wall, due) = (end.min(e), wall.min(w), due.min(d));
            }
            l.valid_until = l.valid_until.max(end);
            l.renewed_sent_wall_ms = l.renewed_sent_wall_ms.max(wall);
            l.next_due = due;
        });
        self.client.inner().registry.poke();
    }

    pub(crate) fn retry_soon(&self, at: Instant) {
        self.lease.send_modify(|l| l.next_due = at);
        self.client.inner().registry.poke();
    }

    pub(crate) fn mark_lost(&self, why: String) {
        self.lease.send_if_modified(|l| {
            if l.lost.is_none() {
                l.lost = Some(LeaseLost(why));
                true
            } else {
                false
            }
        });
    }

    /// Opens this session's part in `group` (its first use there): one `OpenSession`, whose grant joins
    /// the lease (the first group's starts it; a later one can only shorten it). Refused once the
    /// session is lost; a part whose open returns after the session was lost or closed is closed again.
    async fn open_part(&self, group: u32) -> Result<GroupSession, Error> {
        self.check_expired(lease_now());
        let lost = self.lease.borrow().lost.clone();
        if let Some(lost) = lost {
            return Err(Error::LeaseLost(lost.0));
        }
        let sent = lease_now();
        let sent_wall_ms = wall_ms();
        let (hi, lo) = nonce(&self.client);
        let ttl_ms = self.requested_ttl.as_millis() as u64;
        let r = self
            .client
            .call(group, Duration::ZERO, |mut c| async move {
                c.open_session(pb::OpenSessionRequest {
                    group,
                    ttl_ms,
                    nonce_hi: hi,
                    nonce_lo: lo,
                })
                .await
            })
            .await?;
        let granted = Duration::from_millis(r.ttl_ms);
        let part = GroupSession {
            id: r.session_id,
            secret: r.session_secret.into(),
        };
        if let Err(lost) = self.join(group, sent, sent_wall_ms, granted) {
            // Best effort: otherwise its TTL ends it, as it would any session renewed no more.
            let _ = self.client.close_in(group, part.id, &part.secret).await;
            return Err(Error::LeaseLost(lost.0));
        }
        Ok(part)
    }

    /// Joins the lease of `group`'s just-opened part (its open sent at `sent`, granted `granted`) to
    /// the session's: the first part's starts it, a later one can only shorten it (and an open sent
    /// earlier than the renewal on record moves that record back). Refused if the session was lost or
    /// closed meanwhile.
    fn join(
        &self,
        group: u32,
        sent: Instant,
        sent_wall_ms: u64,
        granted: Duration,
    ) -> Result<(), LeaseLost> {
        let (end, due) = (sent + granted - margin(granted), sent + granted / 3);
        let mut refused = None;
        self.lease.send_modify(|l| {
            if let Some(lost) = &l.lost {
                refused = Some(lost.clone());
                return;
            }
            if l.ttl.is_none() {
                l.valid_until = end;
                l.next_due = due;
                l.renewed_sent_wall_ms = sent_wall_ms;
            } else {
                l.valid_until = l.valid_until.min(end);
                l.next_due = l.next_due.min(due);
                l.renewed_sent_wall_ms = l.renewed_sent_wall_ms.min(sent_wall_ms);
            }
            l.ttl = Some(l.ttl.map_or(granted, |t| t.min(granted)));
            l.opened[group as usize] = Some((end, sent_wall_ms, due));
        });
        // Every change to a lease pokes the keepalive task, which then looks at once.
        self.client.inner().registry.poke();
        refused.map_or(Ok(()), Err)
    }

    /// One keepalive round over every group the session is open in; returns the smallest TTL granted
    /// and the groups renewed (bit g: group g).
    async fn renew(&self, valid_until: Instant) -> Result<(Duration, u64), Error> {
        let mut granted = Duration::MAX;
        let mut covered = 0;
        for (group, part) in self.groups.iter().enumerate() {
            let Some(part) = part.get() else { continue };
            covered |= group_bit(group).unwrap_or(0);
            let (id, secret) = (part.id, &part.secret);
            let group = group as u32;
            let sent = Instant::now();
            let r = self
                .client
                .call_until(
                    group,
                    timer_at(valid_until),
                    Duration::ZERO,
                    |mut c| async move {
                        c.keep_alive(pb::KeepAliveRequest {
                            group,
                            session_ids: vec![id],
                            session_secrets: vec![secret.clone()],
                            ..Default::default()
                        })
                        .await
                    },
                )
                .await?;
            self.client.inner().registry.record(sent.elapsed());
            match r.results.first() {
                Some(k) if k.alive => granted = granted.min(Duration::from_millis(k.ttl_ms)),
                _ => return Err(Error::SessionUnknown(format!("session {id} is not alive"))),
            }
        }
        Ok((granted, covered))
    }
}

impl Session {
    /// The session's secret in each group (index = group; empty where it is not open yet, or the server
    /// gave none). Whoever has it can act on the session (renew, close, acquire and release its locks),
    /// so keep it to this process, or hand it only to a process that acts for this one.
    pub fn secrets(&self) -> Vec<Vec<u8>> {
        (0..self.inner.groups.len() as u32)
            .map(|g| self.inner.secret_in(g).to_vec())
            .collect()
    }

    /// The session id in each group (index = group; 0, which no session has, where it is not open yet).
    pub fn ids(&self) -> Vec<u64> {
        (0..self.inner.groups.len() as u32)
            .map(|g| self.inner.in_group(g).map_or(0, |p| p.id))
            .collect()
    }

    /// The session id in the group that owns `name` (0 if it is not open there yet).
    pub fn id_for(&self, name: &str) -> u64 {
        let group = crate::group_for(name, self.inner.client.groups());
        self.inner.in_group(group).map_or(0, |p| p.id)
    }

    /// The TTL the servers granted (the smallest over the groups opened so far); before the first group
    /// opens, the TTL asked for (zero: the servers' default, not known yet).
    pub fn ttl(&self) -> Duration {
        self.inner.ttl()
    }

    /// Opens the session in the group that owns `name`, if it is not open there yet, and returns its id
    /// there. Acquire does this itself; call it to learn the id before the first acquire, or to have an
    /// unreachable group fail here rather than there. Fails with [`Error::LeaseLost`] once the session
    /// is lost or closed: a lost session opens no more groups.
    pub async fn open_for(&self, name: &str) -> Result<u64, Error> {
        let group = crate::group_for(name, self.inner.client.groups());
        Ok(self.open_in(group).await?.id)
    }

    /// The session's part in `group`, opened now if need be.
    async fn open_in(&self, group: u32) -> Result<&GroupSession, Error> {
        let cell = &self.inner.groups[group as usize];
        if let Some(part) = cell.get() {
            return Ok(part);
        }
        cell.get_or_try_init(|| self.inner.open_part(group)).await
    }

    pub fn client(&self) -> &Client {
        &self.inner.client
    }

    /// Resolves when the lease may be lost: the server said the session is gone, or no keepalive succeeded
    /// in time. After this, stop acting as the holder of any of this session's locks.
    pub async fn lost(&self) -> LeaseLost {
        let mut rx = self.inner.lease.subscribe();
        loop {
            let (lost, until) = {
                let l = rx.borrow_and_update();
                (l.lost.clone(), l.valid_until)
            };
            if let Some(lost) = lost {
                return lost;
            }
            tokio::select! {
                _ = lease_timer(until) => {
                    if lease_now() >= self.inner.lease.borrow().valid_until {
                        self.inner.mark_lost("no keepalive succeeded within the TTL".into());
                    }
                }
                changed = rx.changed() => if changed.is_err() { return LeaseLost("session dropped".into()) },
            }
        }
    }

    /// True while the client-side lease is valid.
    pub fn is_valid(&self) -> bool {
        let l = self.inner.lease.borrow();
        l.lost.is_none() && lease_now() < l.valid_until
    }

    /// When the last keepalive the server acknowledged was sent (wall-clock ms since the Unix epoch; the
    /// first group's open, before any keepalive) and the TTL granted: every group the session is open in
    /// keeps it at least until then plus the TTL. For checkers of "no early expiry".
    pub fn last_renewal(&self) -> (u64, Duration) {
        (self.inner.lease.borrow().renewed_sent_wall_ms, self.ttl())
    }

    /// How long the client-side lease still runs, if valid.
    pub fn lease_remaining(&self) -> Option<Duration> {
        let l = self.inner.lease.borrow();
        l.lost
            .is_none()
            .then(|| l.valid_until.saturating_duration_since(lease_now()))
    }

    pub(crate) fn next_request_id(&self, group: u32) -> u64 {
        self.inner.next_request[group as usize].fetch_add(1, Relaxed)
    }

    /// Acquires `name`, waiting in its FIFO queue for as long as the server allows (5 minutes).
    pub async fn acquire(&self, name: &str) -> Result<LockGuard, Error> {
        self.acquire_timeout(name, Duration::from_secs(300)).await
    }

    /// Acquires `name` if it is free; fails at once with [`Error::LockHeld`] otherwise.
    pub async fn try_acquire(&self, name: &str) -> Result<LockGuard, Error> {
        self.acquire_timeout(name, Duration::ZERO).await
    }

    /// Acquires `name`, waiting in its FIFO queue up to `wait`. The wait is cancelled through the log when
    /// it runs out, so a late grant is never left held by nobody.
    pub async fn acquire_timeout(&self, name: &str, wait: Duration) -> Result<LockGuard, Error> {
        self.acquire_with_value(name, wait, &[]).await
    }

    /// [`Session::acquire_timeout`] that stores `value` (at most 1,024 bytes) with the grant; describe
    /// returns it as the holder's value. Leader election uses it for the leader's name or address.
    ///
    /// Dropping the returned future before it resolves (a `select!`, a timeout, a shutdown) cancels the
    /// acquire through the log in the background: its wait is removed, or the lock released if it was
    /// granted meanwhile. A grant that arrives when this session's client-side lease may have lapsed is
    /// never returned: it is released and the call fails with [`Error::LeaseLost`].
    pub async fn acquire_with_value(
        &self,
        name: &str,
        wait: Duration,
        value: &[u8],
    ) -> Result<LockGuard, Error> {
        self.acquire_with(
            name,
            AcquireOptions {
                wait,
                value,
                ..AcquireOptions::default()
            },
        )
        .await
    }

    /// [`Session::acquire_with_value`] with every option (see [`AcquireOptions`]), such as a lock-delay.
    pub async fn acquire_with(
        &self,
        name: &str,
        options: AcquireOptions<'_>,
    ) -> Result<LockGuard, Error> {
        if let Some(lost) = self.inner.lease.borrow().lost.clone() {
            return Err(Error::LeaseLost(lost.0));
        }
        let group = crate::group_for(name, self.inner.client.groups());
        self.open_in(group).await?;
        let mut pending = PendingAcquire {
            session: self.clone(),
            name,
            request_id: self.next_request_id(group),
            armed: true,
        };
        // A session lost while the acquire waits ends the wait here at once (LeaseLost), rather than
        // when the server, a TTL later, expires the session; the pending acquire is then cancelled (or
        // ends with the session, renewed no more).
        let outcome = tokio::select! {
            outcome = self.acquire_once(name, group, pending.request_id, &options) => outcome,
            lost = self.lost() => Err(Error::LeaseLost(lost.0)),
        };
        match outcome {
            Ok(token) => {
                if !self.is_valid() {
                    // The server may already have expired this session and granted the lock to someone
                    // else: a guard now would be a lie. The session is lost for good (it is renewed no
                    // more, so the server expires it), and the pending acquire releases the grant now.
                    self.inner
                        .mark_lost("no keepalive succeeded within the TTL".into());
                    return Err(Error::LeaseLost(format!(
                        "the grant of lock {name:?} (token {token}) arrived after this session's lease may have lapsed; it is being released (or ends with the session)"
                    )));
                }
                pending.armed = false;
                Ok(LockGuard::new(self.clone(), name.to_string(), group, token))
            }
            Err(e) => {
                // Certainly not applied: nothing to cancel. Otherwise the pending acquire is cancelled
                // when it drops here, since this caller will never learn its outcome.
                pending.armed = !e.not_applied();
                Err(e)
            }
        }
    }

    /// One acquire call (with retries under the same request id); the token granted.
    async fn acquire_once(
        &self,
        name: &str,
        group: u32,
        request_id: u64,
        options: &AcquireOptions<'_>,
    ) -> Result<u64, Error> {
        let (wait, value) = (options.wait, options.value);
        let lock_delay_ms = u32::try_from(options.lock_delay.as_millis()).unwrap_or(u32::MAX);
        let part = self.open_in(group).await?;
        let (session_id, secret) = (part.id, &part.secret);
        let wait_ms = wait.as_millis() as u64;
        let started = Instant::now();
        let r = self
            .inner
            .client
            .call_via(group, wait, |c| {
                // A retry waits only for what is left of the caller's wait; the server's dedup keeps its
                // place in the queue.
                let left = wait_ms.saturating_sub(started.elapsed().as_millis() as u64);
                let req = pb::AcquireRequest {
                    group,
                    session_id,
                    request_id,
                    name: name.to_string(),
                    wait_timeout_ms: if wait_ms == 0 { 0 } else { left.max(1) },
                    value: value.to_vec(),
                    // By default this client retries with the same request id after a failed attempt
                    // and cancels the acquire itself when its caller gives up (PendingAcquire), so the
                    // server must not abandon it when an attempt times out or its connection breaks.
                    client_cancels: self.inner.client.options().client_cancels,
                    session_secret: secret.to_vec(),
                    lock_delay_ms,
                    shared: options.shared,
                    permits: options.permits,
                };
                async move { c.acquire(req).await }
            })
            .await?;
        Ok(r.token)
    }

    /// Cancels the acquire `request_id` of `name` (see `CancelAcquire` in the proto): its wait is removed,
    /// or the lock released if it was granted. Idempotent.
    pub async fn cancel_acquire(&self, name: &str, request_id: u64) -> Result<(), Error> {
        let group = crate::group_for(name, self.inner.client.groups());
        let session_id = self.id_in_or_unknown(group)?;
        self.inner
            .client
            .call(group, Duration::ZERO, |mut c| {
                let req = pb::CancelAcquireRequest {
                    group,
                    session_id,
                    request_id,
                    name: name.to_string(),
                    attempt: 0,
                    session_secret: self.inner.secret_in(group).to_vec(),
                };
                async move { c.cancel_acquire(req).await }
            })
            .await?;
        Ok(())
    }

    /// Cancels in the background until the server answers, the session is gone, or it is lost (a lost
    /// session is renewed no more, so the server expires it, and its locks with it).
    fn cancel_in_background(&self, name: String, request_id: u64) {
        let Ok(rt) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let session = self.clone();
        rt.spawn(async move {
            loop {
                match session.cancel_acquire(&name, request_id).await {
                    Ok(()) | Err(Error::SessionUnknown(_)) => return,
                    // Refusals every try would meet alike. (A policy refusal is retried: a policy
                    // fixed within the TTL leaves the session, and the wait, alive.)
                    Err(
                        e @ (Error::InvalidArgument(_)
                        | Error::LimitExceeded { .. }
                        | Error::Other(_)
                        | Error::NotHolder(_)),
                    ) => {
                        tracing::warn!(%e, name, "cancelling an abandoned acquire failed");
                        return;
                    }
                    Err(e) => {
                        tracing::debug!(%e, name, "cancelling an abandoned acquire; retrying")
                    }
                }
                if session.inner.is_lost() {
                    return;
                }
                tokio::time::sleep(Duration::from_millis(500)).await;
            }
        });
    }

    /// Releases a lock by name and token (what [`LockGuard::release`] does).
    pub async fn release(&self, name: &str, token: u64) -> Result<(), Error> {
        let group = crate::group_for(name, self.inner.client.groups());
        let session_id = self.id_in_or_unknown(group)?;
        let request_id = self.next_request_id(group);
        let n = name.to_string();
        self.inner
            .client
            .call_via(group, Duration::ZERO, |c| {
                let req = pb::ReleaseRequest {
                    group,
                    session_id,
                    request_id,
                    name: n.clone(),
                    token,
                    session_secret: self.inner.secret_in(group).to_vec(),
                };
                async move { c.release(req).await }
            })
            .await?;
        Ok(())
    }

    /// Closes the session in every group, releasing all its locks. Stops the keepalives. The lease
    /// ends first (`lost()` fires), so no clone of this session still acts as a holder once the server
    /// has freed a lock; if closing fails, the session is renewed no more and the servers expire it.
    pub async fn close(self) -> Result<(), Error> {
        if let Some(task) = self.inner.keepalive.lock().expect("keepalive lock").take() {
            task.abort();
        }
        self.inner.mark_lost("session closed".into());
        // A group still opening sees the loss when its open returns and closes itself (open_part).
        for (group, part) in self.inner.groups.iter().enumerate() {
            if let Some(part) = part.get() {
                self.inner
                    .client
                    .close_in(group as u32, part.id, &part.secret)
                    .await?;
            }
        }
        Ok(())
    }

    /// The session id in `group`; a session never opened there holds nothing there.
    fn id_in_or_unknown(&self, group: u32) -> Result<u64, Error> {
        self.inner.in_group(group).map(|p| p.id).ok_or_else(|| {
            Error::NotHolder(format!(
                "this session was never opened in group {group}: it holds no lock there"
            ))
        })
    }
}

/// How [`Session::acquire_with`] acquires.
#[derive(Clone, Copy, Debug, Default)]
pub struct AcquireOptions<'a> {
    /// How long to wait in the lock's FIFO queue; zero: try once.
    pub wait: Duration,
    /// Stored with the grant (at most 1,024 bytes); describe and watches show it.
    pub value: &'a [u8],
    /// Lock-delay (at most 60 s; zero: none): if this grant ends because the session **expired**, the
    /// lock is granted to nobody for this long after the expiry (docs/api.md, "Lock-delay"). For a
    /// resource that cannot check fencing tokens: it gives the expired holder's last requests time to
    /// drain. A release or a close frees the lock at once.
    pub lock_delay: Duration,
    /// Hold the lock shared (a reader): with other shared holders, never beside an exclusive one.
    /// FIFO: a reader that arrives while a writer waits queues behind it. Each shared holder gets a
    /// token, shared with the readers granted by the same entry (docs/api.md, "Shared locks and
    /// semaphores", says what a resource compares).
    pub shared: bool,
    /// Non-zero: the name is a semaphore of this many permits (at most 1,000) and the grant is one of
    /// them. The first acquire of a free name fixes the number; asking for another is
    /// [`Error::PermitsMismatch`]. Not with `shared`.
    pub permits: u32,
}

#[cfg(test)]
mod tests {
    use super::{GroupSession, SessionInner};
    use crate::client::Client;
    use std::time::Duration;
    use tokio::time::Instant;

    /// Sets `s`'s part in `group` as if its open had been sent at `sent` and granted `ttl`.
    fn opened(s: &SessionInner, group: usize, sent: Instant, ttl: Duration) {
        s.join(group as u32, sent, 0, ttl).unwrap();
        let part = GroupSession {
            id: group as u64 + 1,
            secret: prost::bytes::Bytes::new(),
        };
        assert!(s.groups[group].set(part).is_ok());
    }

    /// A group whose open was sent before a keepalive round, but which joined the session after the
    /// round chose what to renew, was not renewed by it: the round must not stretch the lease past
    /// what that open gave. Once a round covers it, the lease runs from that round.
    #[tokio::test]
    async fn a_group_opened_during_a_round_bounds_the_lease_the_round_renews() {
        let client = Client::unconnected(2);
        let session = client.open_session(Duration::from_secs(10)).await.unwrap();
        let s = &session.inner;
        let ttl = Duration::from_secs(10);
        let t0 = Instant::now();
        let lease = |s: &SessionInner| {
            let l = s.lease.borrow();
            (l.valid_until, l.next_due)
        };
        opened(s, 0, t0, ttl);
        assert_eq!(lease(s).0, t0 + Duration::from_secs(9));
        // Group 1's open is sent at t0 + 4 s; a round is sent at t0 + 5 s covering group 0 only, and
        // group 1 joins before the round's answer.
        opened(s, 1, t0 + Duration::from_secs(4), ttl);
        assert_eq!(
            lease(s).0,
            t0 + Duration::from_secs(9),
            "a later group never lengthens it"
        );
        s.renewed(t0 + Duration::from_secs(5), 0, ttl, 0b01);
        assert_eq!(
            lease(s),
            (
                t0 + Duration::from_secs(13),
                t0 + Duration::from_secs(4) + ttl / 3
            ),
            "bounded by group 1's open, not the round's 5 s + 9 s"
        );
        // A round that renewed nothing changes nothing.
        s.renewed(t0 + Duration::from_secs(7), 0, ttl, 0);
        assert_eq!(lease(s).0, t0 + Duration::from_secs(13));
        // A round that covers both groups runs the lease from itself.
        s.renewed(t0 + Duration::from_secs(6), 0, ttl, 0b11);
        assert_eq!(
            lease(s),
            (
                t0 + Duration::from_secs(15),
                t0 + Duration::from_secs(6) + ttl / 3
            )
        );
    }

    /// A session lost while one of its acquires is in flight (retrying against a server that does not
    /// answer, or waiting in a queue) ends that acquire at once with LeaseLost, instead of when the
    /// server expires the session a TTL later (here: when its 60 s wait and retries run out).
    #[tokio::test]
    async fn a_session_lost_during_an_acquire_ends_it_at_once() {
        let client = Client::unconnected(2);
        let session = client.open_session(Duration::from_secs(10)).await.unwrap();
        let group = crate::group_for("x", 2) as usize;
        opened(
            &session.inner,
            group,
            super::lease_now(),
            Duration::from_secs(10),
        );
        let s = session.clone();
        let acquiring =
            tokio::spawn(async move { s.acquire_timeout("x", Duration::from_secs(60)).await });
        // In flight: its first attempt reached the (unanswering) server.
        let deadline = Instant::now() + Duration::from_secs(10);
        while !client.has_failed(0) {
            assert!(
                Instant::now() < deadline,
                "the acquire never made an attempt"
            );
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        session.inner.mark_lost("the test lost it".into());
        let ended = tokio::time::timeout(Duration::from_secs(5), acquiring)
            .await
            .expect("the acquire went on after the session was lost")
            .unwrap();
        match ended {
            Err(crate::Error::LeaseLost(_)) => {}
            Err(e) => panic!("{e:?}"),
            Ok(_) => panic!("granted by a server that does not answer"),
        }
    }

    thread_local! {
        /// A suspension the tests pretend happened (on this thread), added to the measured one.
        pub(super) static SUSPENDED: std::cell::Cell<Duration> =
            const { std::cell::Cell::new(Duration::ZERO) };
    }

    /// A machine suspended past the lease: the monotonic clock stood still, but the servers' TTL ran
    /// on. The lease counts the suspension, so the session is invalid at once on resume and the next
    /// look of the keepalive task marks it lost; a shorter suspension shortens it by as much.
    #[tokio::test]
    async fn a_suspension_counts_against_the_lease() {
        let client = Client::unconnected(2);
        let session = client.open_session(Duration::from_secs(10)).await.unwrap();
        let s = &session.inner;
        opened(s, 0, super::lease_now(), Duration::from_secs(10));
        let before = session.lease_remaining().unwrap();
        assert!(
            session.is_valid() && before > Duration::from_secs(8),
            "{before:?}"
        );
        SUSPENDED.with(|d| d.set(Duration::from_secs(5)));
        let after = session.lease_remaining().unwrap();
        assert!(
            before - after >= Duration::from_secs(5) && session.is_valid(),
            "{before:?} -> {after:?}"
        );
        SUSPENDED.with(|d| d.set(Duration::from_secs(20)));
        assert!(!session.is_valid());
        assert_eq!(session.lease_remaining(), Some(Duration::ZERO));
        s.check_expired(super::lease_now());
        assert!(s.is_lost());
    }

    /// The OS generator works here, and its nonces do not repeat (a repeat would hand one client
    /// another's session).
    #[test]
    fn os_nonces_are_drawn_and_do_not_repeat() {
        let drawn: std::collections::BTreeSet<(u64, u64)> = (0..10_000)
            .map(|_| super::os_nonce().expect("the OS random number generator"))
            .collect();
        assert_eq!(drawn.len(), 10_000);
        assert!(drawn.iter().all(|(hi, _)| hi & 1 == 1));
    }
}
