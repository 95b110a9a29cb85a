//! **Linearizable reads.** Every `describe` returns the lock's holder (session and token, or none) as of
//! some log index `r` between the entries it must follow and those it must precede.
//!
//! Inputs: the history's operations whose result is `ok`, and each lock's holder over the log
//! ([`Timelines`], from replaying the merged log in [`super::p1_one_holder`]). Entries whose log position
//! the history knows (a grant's token and an open's session id are their log indexes) bound `r`: it is at
//! least every such index that completed before the describe was invoked, and below every such index
//! invoked after the describe completed. The describe's result must be the holder at the lower bound or
//! one the lock had at some index strictly between the bounds.
//!
//! Why it matters: a client that reads a stale holder (say, from a deposed leader) could act on a lock
//! state that no longer exists, e.g. conclude a lock is free after it was granted to someone else.

use super::Timelines;
use crate::model::Op;

/// Linearizable reads: a describe returns the lock's holder as of some log index `r` between the entries it
/// must follow and those it must precede. Returns how many describes were checked.
pub fn check(history: &[Op], timelines: &Timelines, v: &mut Vec<String>) -> usize {
    let positioned: Vec<(u64, u64, u64)> = history
        .iter()
        .filter(|o| o.ok())
        .filter_map(|o| match o.op.as_str() {
            "acquire" => Some((o.invoke_ms, o.complete_ms, o.token?)),
            "open" => Some((o.invoke_ms, o.complete_ms, o.session?)),
            _ => None,
        })
        .collect();
    let empty = Vec::new();
    let mut checked = 0;
    for d in history.iter().filter(|o| o.op == "describe" && o.ok()) {
        let observed = match (d.session, d.token) {
            (Some(s), Some(t)) if s != 0 => Some((s, t)),
            _ => None,
        };
        let low = positioned
            .iter()
            .filter(|p| p.1 < d.invoke_ms)
            .map(|p| p.2)
            .max()
            .unwrap_or(0);
        let high = positioned
            .iter()
            .filter(|p| p.0 > d.complete_ms)
            .map(|p| p.2)
            .min()
            .unwrap_or(u64::MAX);
        let timeline = timelines.get(&d.lock).unwrap_or(&empty);
        let at_low = timeline
            .iter()
            .take_while(|(i, _)| *i <= low)
            .last()
            .and_then(|(_, h)| *h);
        let possible = std::iter::once(at_low)
            .chain(
                timeline
                    .iter()
                    .filter(|(i, _)| *i > low && *i < high)
                    .map(|(_, h)| *h),
            )
            .any(|h| h == observed);
        checked += 1;
        if !possible {
            v.push(format!(
                "linearizability: describe of {:?} returned {observed:?}, which the lock never had between log indexes {low} and {high}: {d:?}",
                d.lock
            ));
        }
    }
    checked
}
