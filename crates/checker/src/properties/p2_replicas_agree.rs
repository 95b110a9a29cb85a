//! **P2: replicas agree.** Every log index applied on several servers applied the same command with the
//! same outcome and events.
//!
//! Input: each server's audit log (one [`AuditLine`] per command it applied: index, command, outcome,
//! events), as `(server id, lines)`.
//!
//! Why it matters: the lock table is a replicated state machine; if two replicas applied an index
//! differently, they disagree about who holds what and which token was granted, and a failover would hand
//! clients a different history. Agreement is also what lets the other checks replay one merged log: the
//! merged log this check returns holds, for each index, the line of the first server seen to apply it.

use crate::model::AuditLine;
use std::collections::BTreeMap;

/// The servers' applied log, merged: each index's line, as first seen in the audits.
pub type MergedLog<'a> = BTreeMap<u64, &'a AuditLine>;

/// P2: the same index applied the same way everywhere. Returns the merged log.
pub fn check<'a>(audits: &'a [(u64, Vec<AuditLine>)], v: &mut Vec<String>) -> MergedLog<'a> {
    let mut merged: BTreeMap<u64, (u64, &AuditLine)> = BTreeMap::new();
    for (server, lines) in audits {
        for line in lines {
            match merged.get(&line.index) {
                Some((other, seen)) if *seen != line => v.push(format!(
                    "P2: at index {} server {other} applied {seen:?} but server {server} applied {line:?}",
                    line.index
                )),
                Some(_) => {}
                None => {
                    merged.insert(line.index, (*server, line));
                }
            }
        }
    }
    merged.into_iter().map(|(i, (_, l))| (i, l)).collect()
}
