//! **Linearizability of acquire, release and describe, per lock, from the client history alone** (a
//! Wing–Gong–Lowe search with memoization, as in Lowe's "Testing for linearizability" and porcupine).
//!
//! The history must be explainable by some order of its operations that respects real time (an
//! operation that completed before another was invoked comes first) against a sequential lock:
//! - `acquire` by session `s` returning token `t` takes a free lock, and `t` is larger than every token
//!   granted before (it is a log index);
//! - `release(s, t)` frees the lock held by `(s, t)`;
//! - `describe` returns the holder, or none.
//!
//! Operations that failed had no effect and are left out. Operations with an unknown outcome (the
//! client timed out) may take effect at any time after their invocation, or never; an acquire with an
//! unknown outcome holds with a token the client never learned. A session can also end without a client
//! operation (it expires, or its owner closes it), freeing its lock: the model allows the holder to
//! vanish at any point. That keeps the check sound for every correct run while still catching two
//! holders at once (a holder vanished to let another in, then released as if it still held), a token that
//! does not increase, a release acknowledged for a lock its session did not hold, and every stale or
//! impossible `describe`.
//!
//! Unlike [`super::linearizable_reads`], this needs nothing from the servers (no audit logs), so it also
//! judges runs without them. A search that grows past [`MAX_STATES`] is reported as inconclusive.

use crate::model::Op;
use std::collections::{BTreeMap, HashSet};

/// Stack for one lock's search (about 200 bytes per placed operation; untouched pages cost nothing).
const SEARCH_STACK_BYTES: usize = 1 << 30;

/// Explored (linearized set, state) pairs per lock before the search gives up as inconclusive.
pub const MAX_STATES: usize = 2_000_000;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
struct State {
    /// The holder's session and token; token 0 when an acquire with an unknown outcome was granted.
    holder: Option<(u64, u64)>,
    /// The largest token known to be granted.
    last: u64,
}

#[derive(Clone, Copy, Debug)]
enum Kind {
    Acquire { session: u64, token: Option<u64> },
    Release { session: u64, token: u64 },
    Describe { holder: Option<(u64, u64)> },
}

#[derive(Clone, Debug)]
struct Call {
    kind: Kind,
    invoke: u64,
    /// `u64::MAX` for an unknown outcome.
    complete: u64,
    /// Acknowledged (must take effect), as opposed to unknown (may).
    must: bool,
}

/// What the checks found, for the report.
#[derive(Debug, Default, Clone, Copy)]
pub struct Summary {
    /// Operations the search placed (over all locks).
    pub ops: usize,
    /// Locks whose search gave up (neither verdict).
    pub inconclusive: usize,
}

/// The states `call` can leave `s` in: as is, or after the holder vanished (an expiry or a close the
/// history does not show) when that is what lets it happen.
fn step(s: State, call: &Call) -> [Option<State>; 2] {
    let apply = |s: State| -> Option<State> {
        match call.kind {
            Kind::Acquire { session, token } => match (s.holder, token) {
                (None, Some(t)) if t > s.last => Some(State {
                    holder: Some((session, t)),
                    last: t,
                }),
                (None, None) => Some(State {
                    holder: Some((session, 0)),
                    last: s.last,
                }),
                _ => None,
            },
            Kind::Release { session, token } => {
                (s.holder == Some((session, token))).then_some(State { holder: None, ..s })
            }
            Kind::Describe { holder } => match (s.holder, holder) {
                (None, None) => Some(s),
                (Some(h), Some(d)) if h == d => Some(s),
                // The token of an acquire with an unknown outcome, learned from a read.
                (Some((hs, 0)), Some((ds, dt))) if hs == ds && dt > s.last => Some(State {
                    holder: Some((ds, dt)),
                    last: dt,
                }),
                _ => None,
            },
        }
    };
    let direct = apply(s);
    let vanished = match s.holder {
        Some(_) if direct.is_none() => apply(State { holder: None, ..s }),
        _ => None,
    };
    [direct, vanished]
}

struct Search<'a> {
    calls: &'a [Call],
    seen: HashSet<(Vec<u64>, State)>,
    gave_up: bool,
    /// The furthest the search got: fewest acknowledged calls left, the state there, and the call that
    /// had to come next (the remaining acknowledged call that completed first). The evidence on failure.
    furthest: Option<(usize, State, usize)>,
}

impl Search<'_> {
    fn run(&mut self, state: State, done: &mut Vec<u64>, remaining_must: usize) -> bool {
        if remaining_must == 0 {
            return true;
        }
        if self.seen.len() >= MAX_STATES {
            self.gave_up = true;
            return false;
        }
        if !self.seen.insert((done.clone(), state)) {
            return false;
        }
        let open = |i: usize, done: &Vec<u64>| done[i / 64] & (1 << (i % 64)) == 0;
        // Whatever goes next must have been invoked before every remaining acknowledged call completed.
        let first = (0..self.calls.len())
            .filter(|&i| open(i, done) && self.calls[i].must)
            .min_by_key(|&i| self.calls[i].complete);
        let horizon = first.map_or(u64::MAX, |i| self.calls[i].complete);
        if let Some(i) = first {
            if self
                .furthest
                .is_none_or(|(left, _, _)| remaining_must < left)
            {
                self.furthest = Some((remaining_must, state, i));
            }
        }
        for i in 0..self.calls.len() {
            let call = &self.calls[i];
            if call.invoke > horizon {
                break;
            }
            if !open(i, done) {
                continue;
            }
            for next in step(state, call).into_iter().flatten() {
                done[i / 64] |= 1 << (i % 64);
                let found = self.run(next, done, remaining_must - usize::from(call.must));
                done[i / 64] &= !(1 << (i % 64));
                if found {
                    return true;
                }
                if self.gave_up {
                    return false;
                }
            }
        }
        false
    }
}

fn calls_by_lock(history: &[Op]) -> BTreeMap<&str, Vec<Call>> {
    let mut by_lock: BTreeMap<&str, Vec<Call>> = BTreeMap::new();
    for o in history {
        let must = match o.result.as_str() {
            "ok" => true,
            "unknown" => false,
            _ => continue,
        };
        let kind = match (o.op.as_str(), o.session, o.token) {
            ("acquire", Some(session), token) => Kind::Acquire {
                session,
                token: if must { token } else { None },
            },
            ("release", Some(session), Some(token)) => Kind::Release { session, token },
            ("describe", session, token) if must => Kind::Describe {
                holder: match (session, token) {
                    (Some(s), Some(t)) if s != 0 => Some((s, t)),
                    _ => None,
                },
            },
            _ => continue,
        };
        if let Kind::Acquire { token: None, .. } = kind {
            if must {
                continue; // an acknowledged grant always has its token
            }
        }
        let calls = by_lock.entry(&o.lock).or_default();
        let complete = if must { o.complete_ms } else { u64::MAX };
        // Two releases of one grant in the history count as one (a caller may release again after an
        // unknown outcome; the repeat is refused, or replays the first outcome if it is a retry). So
        // the search cannot see a server acknowledge a second release of a grant; P1, replaying the
        // log, does.
        if let Kind::Release { session, token } = kind {
            let same = |c: &&mut Call| matches!(c.kind, Kind::Release { session: s, token: t } if (s, t) == (session, token));
            if let Some(first) = calls.iter_mut().find(|c| same(c)) {
                first.invoke = first.invoke.min(o.invoke_ms);
                first.complete = first.complete.min(complete);
                first.must |= must;
                continue;
            }
        }
        calls.push(Call {
            kind,
            invoke: o.invoke_ms,
            complete,
            must,
        });
    }
    for calls in by_lock.values_mut() {
        calls.sort_by_key(|c| (c.invoke, c.complete));
    }
    by_lock
}

/// Searches each lock's history for a linearization. Appends a violation per lock that has none.
pub fn check(history: &[Op], v: &mut Vec<String>) -> Summary {
    let mut summary = Summary::default();
    for (lock, calls) in calls_by_lock(history) {
        let must = calls.iter().filter(|c| c.must).count();
        let mut search = Search {
            calls: &calls,
            seen: HashSet::new(),
            gave_up: false,
            furthest: None,
        };
        let mut done = vec![0u64; calls.len().div_ceil(64)];
        let start = State {
            holder: None,
            last: 0,
        };
        // The search recurses once per placed operation; long histories need a deep stack.
        let found = std::thread::scope(|scope| {
            std::thread::Builder::new()
                .stack_size(SEARCH_STACK_BYTES)
                .spawn_scoped(scope, || search.run(start, &mut done, must))
                .map(|t| t.join().unwrap_or(false))
        });
        let Ok(found) = found else {
            // No thread with a deep enough stack (strict overcommit): neither verdict.
            summary.inconclusive += 1;
            continue;
        };
        if found {
            summary.ops += calls.len();
        } else if search.gave_up {
            summary.inconclusive += 1;
        } else {
            let stuck = search.furthest.map_or(String::new(), |(left, state, i)| {
                format!(
                    "; furthest: {} of {must} acknowledged operations placed, the lock {:?} (largest \
                     token {}), and none of the placeable operations explains {:?}",
                    must - left,
                    state.holder,
                    state.last,
                    calls[i]
                )
            });
            v.push(format!(
                "linearizability (WGL): no order of the {} acquire/release/describe operations on {lock:?} \
                 respects real time and a sequential lock ({} states explored{stuck})",
                calls.len(),
                search.seen.len()
            ));
        }
    }
    summary
}
