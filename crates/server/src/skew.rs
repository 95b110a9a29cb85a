//! Simulation only: openraft's runtime with a per-server clock rate and clock stalls, so that a
//! server's clock fault reaches openraft's election and heartbeat timers, its leader lease and the
//! keepalive guard (`Group::can_renew` compares openraft instants), not just the session lease timer
//! (`Leases::with_clock_rate_ppm`).
//!
//! Each simulated host runs on its own tokio runtime, so the rate is kept per runtime: [`set_rate`]
//! (called by `Node::start` before anything reads openraft's clock) fixes it for every task of the
//! calling runtime that uses openraft's clock (the server's own tokio timers, other than the session
//! lease timer, which has its own rate, run on true time). A [`SkewedInstant`] is the time since the
//! runtime was registered, scaled by `1 + ppm / 10^6`; sleeping converts back, rounding so that a
//! sleep until `t` never wakes before `now() >= t` (but see stalls below).
//!
//! A **stall** ([`stall`], the simulation's driver calls it while it holds every message of the
//! server) is a VM pause seen from inside: the clock stops, timers set during the stall and the session
//! expiry loop ([`wait_unstalled`]) wait for its end, and when it ends the clock jumps to where it
//! would have been, so that every deadline that passed meanwhile is due at once, as after
//! SIGSTOP/SIGCONT. Not quite a pause: a tokio timer set *before* the stall keeps its true-time
//! deadline and may fire during it, reading the stopped clock (openraft's RPC timeouts, say); the
//! elections and heartbeats openraft decides by comparing the clock still wait.
//! Checks made just before the stall (a leader's lease, the keepalive guard) are stale when their
//! answers are finally delivered, which is the hazard a real stall brings.

// The maps here are keyed by tokio's runtime id, which has no order, and only looked up.
#![allow(clippy::disallowed_types)]

use openraft::impls::TokioRuntime;
use openraft::rt::{AsyncRuntime, OptionalSend, Select2, Select3, Select4};
use std::collections::HashMap;
use std::future::Future;
use std::ops::{Add, AddAssign, Sub, SubAssign};
use std::sync::Mutex;
use std::time::Duration;

#[derive(Clone)]
struct Clock {
    /// The runtime whose (paused, simulated) tokio clock this one scales.
    runtime: tokio::runtime::Handle,
    origin: tokio::time::Instant,
    ppm: i64,
    /// A stall in force: the reading it froze at, and the (true) instant it ends.
    stall: Option<(Duration, tokio::time::Instant)>,
}

static CLOCKS: Mutex<Option<HashMap<tokio::runtime::Id, Clock>>> = Mutex::new(None);
/// Which runtime each node id runs on now (a restarted server registers its new runtime).
static NODES: Mutex<Option<HashMap<u64, tokio::runtime::Id>>> = Mutex::new(None);

fn with_clocks<R>(f: impl FnOnce(&mut HashMap<tokio::runtime::Id, Clock>) -> R) -> R {
    let mut clocks = CLOCKS.lock().expect("skew clocks lock");
    f(clocks.get_or_insert_with(HashMap::new))
}

/// The calling runtime's clock (registered with rate 0 on first use).
fn clock() -> Clock {
    clock_of(tokio::runtime::Handle::current().id())
}

fn clock_of(id: tokio::runtime::Id) -> Clock {
    with_clocks(|c| {
        c.entry(id)
            .or_insert_with(|| Clock {
                runtime: tokio::runtime::Handle::current(),
                origin: tokio::time::Instant::now(),
                ppm: 0,
                stall: None,
            })
            .clone()
    })
}

/// Runs the calling runtime's openraft clock `ppm` parts per million fast (negative: slow), from now,
/// as node `node`'s clock (for [`stall`]).
pub fn set_rate(node: u64, ppm: i64) {
    assert!(ppm.abs() < 1_000_000, "a clock rate of {ppm} ppm");
    let id = tokio::runtime::Handle::current().id();
    with_clocks(|c| {
        c.insert(
            id,
            Clock {
                runtime: tokio::runtime::Handle::current(),
                origin: tokio::time::Instant::now(),
                ppm,
                stall: None,
            },
        );
    });
    NODES
        .lock()
        .expect("skew nodes lock")
        .get_or_insert_with(HashMap::new)
        .insert(node, id);
}

/// Stops node `node`'s clock for `d` (true time), then lets it jump to where it would have been (see
/// the module docs). Called from outside the node's runtime; false if the node has no clock.
pub fn stall(node: u64, d: Duration) -> bool {
    let Some(id) = runtime_of(node) else {
        return false;
    };
    with_clocks(|c| {
        let Some(clock) = c.get_mut(&id) else {
            return false;
        };
        let frozen = clock.now();
        let _on = clock.runtime.enter();
        clock.stall = Some((frozen, tokio::time::Instant::now() + d));
        true
    })
}

/// Forgets every clock (the simulation calls it before each seed, whose hosts are all new runtimes).
pub fn reset() {
    *CLOCKS.lock().expect("skew clocks lock") = None;
    *NODES.lock().expect("skew nodes lock") = None;
}

/// The runtime node `node` runs on now, if it started (the simulation arms failpoints by it).
pub fn runtime_of(node: u64) -> Option<tokio::runtime::Id> {
    NODES
        .lock()
        .expect("skew nodes lock")
        .as_ref()
        .and_then(|n| n.get(&node).copied())
}

/// Waits until a stall of the calling runtime's clock ends (at once if none is in force).
pub async fn wait_unstalled() {
    if let Some((_, end)) = clock().stall {
        tokio::time::sleep_until(end).await;
    }
}

fn scale(d: Duration, num: i64, den: i64, round_up: bool) -> Duration {
    let nanos = d.as_nanos() * num as u128;
    let den = den as u128;
    let q = if round_up {
        nanos.div_ceil(den)
    } else {
        nanos / den
    };
    Duration::from_nanos(u64::try_from(q).unwrap_or(u64::MAX))
}

impl Clock {
    /// This clock's time, read on its own runtime's tokio clock, also when asked from outside that
    /// runtime (the simulation's driver reads servers' status between steps).
    fn now(&self) -> Duration {
        let _on = self.runtime.enter();
        let t = tokio::time::Instant::now();
        match self.stall {
            Some((frozen, end)) if t < end => frozen,
            _ => scale(
                t.saturating_duration_since(self.origin),
                1_000_000 + self.ppm,
                1_000_000,
                false,
            ),
        }
    }

    /// How long to really wait for `d` to pass on this clock.
    fn real(&self, d: Duration) -> Duration {
        scale(d, 1_000_000, 1_000_000 + self.ppm, true)
    }

    /// The tokio instant at which this clock reads `t`: never before a stall in force ends, and now if
    /// it already does.
    fn deadline(&self, t: SkewedInstant) -> tokio::time::Instant {
        debug_assert_eq!(
            t.clock,
            self.runtime.id(),
            "a deadline of another runtime's clock"
        );
        let now = tokio::time::Instant::now();
        let earliest = match self.stall {
            Some((_, end)) if now < end => end,
            _ => now,
        };
        earliest.max(self.origin + self.real(t.at))
    }

    /// The tokio instant at which `d` has passed on this clock from now.
    fn after(&self, d: Duration) -> tokio::time::Instant {
        self.deadline(SkewedInstant {
            at: self.now() + d,
            clock: self.runtime.id(),
        })
    }
}

/// An instant of a runtime's skewed clock: the scaled time since it was registered, and which
/// runtime's clock it is, so that `elapsed` is right even when asked from outside that runtime (the
/// simulation's driver reads a server's status between steps). Compared by time only.
#[derive(Clone, Copy, Debug)]
pub struct SkewedInstant {
    at: Duration,
    clock: tokio::runtime::Id,
}

impl PartialEq for SkewedInstant {
    fn eq(&self, other: &Self) -> bool {
        self.at == other.at
    }
}

impl Eq for SkewedInstant {}

impl PartialOrd for SkewedInstant {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}

impl Ord for SkewedInstant {
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        self.at.cmp(&other.at)
    }
}

impl Add<Duration> for SkewedInstant {
    type Output = Self;
    fn add(self, rhs: Duration) -> Self {
        SkewedInstant {
            at: self.at + rhs,
            ..self
        }
    }
}

impl AddAssign<Duration> for SkewedInstant {
    fn add_assign(&mut self, rhs: Duration) {
        self.at += rhs;
    }
}

impl Sub<Duration> for SkewedInstant {
    type Output = Self;
    fn sub(self, rhs: Duration) -> Self {
        SkewedInstant {
            at: self.at.saturating_sub(rhs),
            ..self
        }
    }
}

impl Sub<Self> for SkewedInstant {
    type Output = Duration;
    fn sub(self, rhs: Self) -> Duration {
        self.at.saturating_sub(rhs.at)
    }
}

impl SubAssign<Duration> for SkewedInstant {
    fn sub_assign(&mut self, rhs: Duration) {
        self.at = self.at.saturating_sub(rhs);
    }
}

impl openraft::rt::Instant for SkewedInstant {
    fn now() -> Self {
        let id = tokio::runtime::Handle::current().id();
        SkewedInstant {
            at: clock_of(id).now(),
            clock: id,
        }
    }

    fn elapsed(&self) -> Duration {
        clock_of(self.clock).now().saturating_sub(self.at)
    }
}

/// Tokio, on the calling runtime's skewed clock.
#[derive(Debug)]
pub struct SkewedRuntime(TokioRuntime);

impl AsyncRuntime for SkewedRuntime {
    type JoinError = <TokioRuntime as AsyncRuntime>::JoinError;
    type JoinHandle<T: OptionalSend + 'static> = <TokioRuntime as AsyncRuntime>::JoinHandle<T>;
    type Sleep = tokio::time::Sleep;
    type Instant = SkewedInstant;
    type TimeoutError = tokio::time::error::Elapsed;
    type Timeout<R, T: Future<Output = R> + OptionalSend> = tokio::time::Timeout<T>;
    type ThreadLocalRng = <TokioRuntime as AsyncRuntime>::ThreadLocalRng;

    fn spawn<T>(future: T) -> Self::JoinHandle<T::Output>
    where
        T: Future + OptionalSend + 'static,
        T::Output: OptionalSend + 'static,
    {
        TokioRuntime::spawn(future)
    }

    fn sleep(duration: Duration) -> Self::Sleep {
        tokio::time::sleep_until(clock().after(duration))
    }

    fn sleep_until(deadline: Self::Instant) -> Self::Sleep {
        tokio::time::sleep_until(clock().deadline(deadline))
    }

    fn timeout<R, F: Future<Output = R> + OptionalSend>(
        duration: Duration,
        future: F,
    ) -> Self::Timeout<R, F> {
        tokio::time::timeout_at(clock().after(duration), future)
    }

    fn timeout_at<R, F: Future<Output = R> + OptionalSend>(
        deadline: Self::Instant,
        future: F,
    ) -> Self::Timeout<R, F> {
        tokio::time::timeout_at(clock().deadline(deadline), future)
    }

    fn select2<A, B>(
        a: A,
        b: B,
    ) -> impl Future<Output = Select2<A::Output, B::Output>> + OptionalSend
    where
        A: Future + OptionalSend,
        B: Future + OptionalSend,
    {
        TokioRuntime::select2(a, b)
    }

    fn select3<A, B, C>(
        a: A,
        b: B,
        c: C,
    ) -> impl Future<Output = Select3<A::Output, B::Output, C::Output>> + OptionalSend
    where
        A: Future + OptionalSend,
        B: Future + OptionalSend,
        C: Future + OptionalSend,
    {
        TokioRuntime::select3(a, b, c)
    }

    fn select4<A, B, C, D>(
        a: A,
        b: B,
        c: C,
        d: D,
    ) -> impl Future<Output = Select4<A::Output, B::Output, C::Output, D::Output>> + OptionalSend
    where
        A: Future + OptionalSend,
        B: Future + OptionalSend,
        C: Future + OptionalSend,
        D: Future + OptionalSend,
    {
        TokioRuntime::select4(a, b, c, d)
    }

    fn is_panic(join_error: &Self::JoinError) -> bool {
        TokioRuntime::is_panic(join_error)
    }

    fn thread_rng() -> Self::ThreadLocalRng {
        TokioRuntime::thread_rng()
    }

    type Mpsc = <TokioRuntime as AsyncRuntime>::Mpsc;
    type Watch = <TokioRuntime as AsyncRuntime>::Watch;
    type Oneshot = <TokioRuntime as AsyncRuntime>::Oneshot;
    type Mutex<T: OptionalSend + 'static> = <TokioRuntime as AsyncRuntime>::Mutex<T>;

    fn new(threads: usize) -> Self {
        SkewedRuntime(TokioRuntime::new(threads))
    }

    fn block_on<F, T>(&mut self, future: F) -> T
    where
        F: Future<Output = T>,
    {
        self.0.block_on(future)
    }

    fn spawn_blocking<F, T>(f: F) -> impl Future<Output = Result<T, std::io::Error>> + Send
    where
        F: FnOnce() -> T + Send + 'static,
        T: Send + 'static,
    {
        TokioRuntime::spawn_blocking(f)
    }
}
