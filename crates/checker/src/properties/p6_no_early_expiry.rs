//! **P6: no early expiry.** An `ExpireSession` (or each session of an `ExpireSessions`) is proposed (at the leader's wall time `now_ms`, recorded
//! in the command) no earlier than the send time of the session's last acknowledged renewal plus its TTL,
//! less [`EXPIRY_MARGIN_MS`].
//!
//! Inputs: the merged applied log's `ExpireSession` commands (see [`super::p2_replicas_agree`]) and the
//! history's `lost` operations, which carry, per session, when its last acknowledged renewal (or its open)
//! was sent (`renewed_sent_ms`) and its TTL (`ttl_ms`). Client and servers share the machine's wall clock
//! in the tests; expiries of sessions without a `lost` record cannot be checked and are not counted.
//!
//! Why it matters: a client may act as the holder until its lease runs out, measured from when it sent
//! its last acknowledged renewal. If the service expired the session earlier, it could grant the lock to
//! another client while the first one still rightly believes it holds it.

use super::MergedLog;
use crate::model::Op;
use holdfast_lock_table::Command;
use std::collections::HashMap;

/// How much earlier than renewal + TTL an expiry may be proposed before it counts as early: the leader's
/// wall clock and the client's are the same machine's in the tests, so this only absorbs clock slewing.
pub const EXPIRY_MARGIN_MS: u64 = 100;

/// P6: an expiry is proposed (leader wall time `now_ms`) no earlier than the send time of the session's
/// last acknowledged renewal plus its TTL. Returns how many expiries could be checked.
pub fn check(history: &[Op], merged: &MergedLog<'_>, v: &mut Vec<String>) -> usize {
    let renewals: HashMap<u64, (u64, u64)> = history
        .iter()
        .filter(|o| o.op == "lost")
        .filter_map(|o| Some((o.session?, (o.renewed_sent_ms?, o.ttl_ms?))))
        .collect();
    let mut checked = 0;
    for (index, line) in merged {
        let (sessions, now_ms) = match &line.command {
            Command::ExpireSession { session, now_ms } => (std::slice::from_ref(session), now_ms),
            Command::ExpireSessions { sessions, now_ms } => (&sessions[..], now_ms),
            _ => continue,
        };
        for session in sessions {
            if let Some(&(sent, ttl)) = renewals.get(&session.0) {
                checked += 1;
                if now_ms + EXPIRY_MARGIN_MS < sent + ttl {
                    v.push(format!(
                        "P6: session {} expired at index {index} at {now_ms} ms, before its last renewal (sent {sent} ms) + TTL {ttl} ms",
                        session.0
                    ));
                }
            }
        }
    }
    checked
}
