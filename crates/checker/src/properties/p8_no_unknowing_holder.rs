//! **P8: no unknowing holder.** A grant that no client acknowledged (no `acquire` op returned its token:
//! its caller gave up, its answer was lost, or the grant came too late to use) must not stay held: the
//! client cancels it or the server abandons it (a `Release` or `AbandonAcquire` ends it), or the session
//! expires. Checked from the merged log's holder timelines (see [`super::p1_one_holder`]), in leader time
//! (the `now_ms` the leader stamps into entries). Two endings are violations:
//! - the session's own `CloseSession` ends it more than [`CLOSE_BOUND_MS`] after the grant and after the
//!   client gave up on the call (the `acquire` op that was under way when it was granted ended) and
//!   could reach the cluster again (the first operation of its process invoked after that which got
//!   through, or the close itself if none did: a paused or cut-off client cannot cancel until it is
//!   heard again): the
//!   client was alive and reaching the leader (it closed), yet nothing cancelled a grant it never used,
//!   which is what a process that forgets an abandoned acquire looks like;
//! - it is still held when the log ends, more than [`UNKNOWING_BOUND_MS`] after the grant.
//!
//! An expiry is a legitimate end however late: a client cut off from the leader can neither cancel nor
//! renew, so its session expires (after a fresh TTL per leader change), and its grants with it.
//!
//! The converse is checked too: a grant a client acknowledged is never ended by an abandon. A server's
//! abandon acts only on its own call's attempt, so an abandon of a first attempt that a retry took over
//! (and answered) must change nothing.
//!
//! Why it matters: a lock granted to a session whose process never learned it is stuck for as long as
//! that process keeps the session alive (issue 8, defect 1): nobody can take it, nobody will release it.

use super::{MergedLog, Timelines};
use crate::model::Op;
use holdfast_lock_table::{Command, Event};
use std::collections::HashSet;

/// Longest an unacknowledged grant may stay held until the log ends, in leader time: well above two
/// TTLs (2 s in the simulation, 3 s in the fault tests), an election and the client's request timeout.
pub const UNKNOWING_BOUND_MS: u64 = 15_000;

/// Longest an unacknowledged grant may stay held before its own session closes it: a client that can
/// close can also cancel, which takes one retry (500 ms) plus a commit; the rest is slack for a cancel
/// sent just before the close.
pub const CLOSE_BOUND_MS: u64 = 5_000;

/// Checks P8; returns how many unacknowledged grants were judged.
pub fn check(
    history: &[Op],
    merged: &MergedLog<'_>,
    timelines: &Timelines,
    v: &mut Vec<String>,
) -> usize {
    let acknowledged: HashSet<(&str, u64, u64)> = history
        .iter()
        .filter(|o| o.op == "acquire" && o.ok())
        .filter_map(|o| Some((o.lock.as_str(), o.session?, o.token?)))
        .collect();
    // When the client stopped waiting for a grant: the end of its unacknowledged acquire of the lock
    // that was under way when the grant was made (a call can outlast a grant it never hears of). And
    // from when it could have cancelled: the first operation of that client process that got through
    // after it gave up. A process whose every message is held (a paused client) cannot cancel until
    // the pause ends, however long it lasts; its session may meanwhile outlive the pause (each new
    // leader gives it a fresh TTL) and be closed right after (seeds 1000058, 1001668, 1002574).
    let gave_up = |lock: &str, session: u64, granted_ms: u64| {
        let call = history
            .iter()
            .filter(|o| {
                o.op == "acquire" && !o.ok() && o.lock == lock && o.session == Some(session)
            })
            .filter(|o| o.invoke_ms <= granted_ms && granted_ms <= o.complete_ms)
            .max_by_key(|o| o.complete_ms);
        let Some(call) = call else {
            return granted_ms;
        };
        // (`lost` is the client's own record, not an answer from anyone.) If nothing got through before
        // the log ends, the close itself was the first message to.
        let heard_again = history
            .iter()
            .filter(|o| o.process == call.process && o.ok() && o.op != "lost")
            .filter(|o| o.invoke_ms >= call.complete_ms)
            .map(|o| o.complete_ms)
            .min();
        heard_again.unwrap_or(u64::MAX).max(call.complete_ms)
    };
    let now_at = |index: u64| merged.get(&index).map(|l| l.command.now_ms());
    let last_ms = merged.values().next_back().map(|l| l.command.now_ms());
    // Locks the workload uses; others (a liveness probe's) have no history to judge them by.
    let used: HashSet<&str> = history.iter().map(|o| o.lock.as_str()).collect();
    let mut judged = 0;
    for (lock, timeline) in timelines.iter().filter(|(l, _)| used.contains(l.as_str())) {
        for (i, (from, holder)) in timeline.iter().enumerate() {
            let Some((session, token)) = *holder else {
                continue;
            };
            let end = timeline.get(i + 1).and_then(|(to, _)| merged.get(to));
            if acknowledged.contains(&(lock.as_str(), session, token)) {
                let abandoned = end.is_some_and(|l| {
                    l.events.iter().any(|e| {
                        matches!(e, Event::GrantAbandoned { session: s, token: t, .. } if s.0 == session && t.0 == token)
                    })
                });
                if abandoned {
                    v.push(format!(
                        "P8: lock {lock:?} was granted to session {session} with token {token}, a grant a client acknowledged, and an abandon ended it at index {}",
                        timeline[i + 1].0
                    ));
                }
                continue;
            }
            let (Some(granted_ms), Some(last_ms)) = (now_at(*from), last_ms) else {
                continue;
            };
            let held_ms = end
                .map_or(last_ms, |l| l.command.now_ms())
                .saturating_sub(granted_ms);
            let violation = match end.map(|l| &l.command) {
                Some(Command::CloseSession { session: s, now_ms }) if s.0 == session => {
                    let since_gave_up = now_ms.saturating_sub(gave_up(lock, session, granted_ms));
                    (since_gave_up > CLOSE_BOUND_MS).then_some("until its own session closed it")
                }
                Some(_) => None,
                None if held_ms <= UNKNOWING_BOUND_MS => continue,
                None => Some("until the log ends"),
            };
            judged += 1;
            if let Some(how) = violation {
                v.push(format!(
                    "P8: lock {lock:?} was granted to session {session} with token {token} at index {from}, which no client acknowledged, and stayed held {held_ms} ms, {how}"
                ));
            }
        }
    }
    judged
}
