//! **P8: no unknowing holder.** A grant that no client acknowledged (no `acquire` op returned its token:
//! its caller gave up, its answer was lost, or the grant came too late to use) must not stay held: the
//! client cancels it, the server abandons it, or the session ends. Checked from the merged log's holder
//! timelines (see [`super::p1_one_holder`]): every such grant must end within [`UNKNOWING_BOUND_MS`] of
//! leader time (the `now_ms` the leader stamps into entries). A grant still held when the log ends, less
//! than the bound after it was made, is not judged.
//!
//! Why it matters: a lock granted to a session whose process never learned it is stuck for as long as
//! that process keeps the session alive (issue 8, defect 1): nobody can take it, nobody will release it.
//!
//! The bound is generous because faults delay the end legitimately: a client cut off from the leader
//! cannot cancel, but then it cannot renew either, so its session expires within a TTL (plus a fresh TTL
//! after a leader change, plus an election); a client that can renew reaches the leader with its cancel
//! within one retry.

use super::{MergedLog, Timelines};
use crate::model::Op;
use std::collections::HashSet;

/// Longest an unacknowledged grant may stay held, in leader time: well above two TTLs (2 s in the
/// simulation, 3 s in the fault tests), an election and the client's request timeout.
pub const UNKNOWING_BOUND_MS: u64 = 15_000;

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
            if acknowledged.contains(&(lock.as_str(), session, token)) {
                continue;
            }
            let (Some(granted_ms), Some(last_ms)) = (now_at(*from), last_ms) else {
                continue;
            };
            let ended_ms = timeline.get(i + 1).and_then(|(to, _)| now_at(*to));
            let held_ms = ended_ms.unwrap_or(last_ms).saturating_sub(granted_ms);
            if ended_ms.is_none() && held_ms <= UNKNOWING_BOUND_MS {
                continue;
            }
            judged += 1;
            if held_ms > UNKNOWING_BOUND_MS {
                v.push(format!(
                    "P8: lock {lock:?} was granted to session {session} with token {token} at index {from}, which no client acknowledged, and stayed held {held_ms} ms{}",
                    if ended_ms.is_none() { " until the log ends" } else { "" }
                ));
            }
        }
    }
    judged
}
