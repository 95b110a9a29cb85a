//! **P5: acknowledged operations are durable.** Every acknowledged session open, grant and release is in
//! the servers' applied log.
//!
//! Inputs: the history's `open`, `acquire` and `release` operations whose result is `ok`; the merged
//! applied log (see [`super::p2_replicas_agree`]), for opened sessions (`SessionOpened` outcomes) and
//! releases (`Release` commands with a `Released` outcome); and the grants found by replaying it (see
//! [`super::p1_one_holder`]). An open matches by session id, a grant and a release by (lock, session,
//! token).
//!
//! Why it matters: an acknowledgement is a promise. A grant the client was told about but that the
//! replicated log lost (say, across a leader change) would let the service hand the same lock to someone
//! else while the first client still believes it holds it.

use super::{Grants, MergedLog};
use crate::model::Op;
use holdfast_lock_table::{Command, Outcome};
use std::collections::HashSet;

/// P5: acknowledged opens, grants and releases are in the applied log.
pub fn check(history: &[Op], merged: &MergedLog<'_>, grants: &Grants, v: &mut Vec<String>) {
    let opened: HashSet<u64> = merged
        .values()
        .filter_map(|l| match l.outcome {
            Outcome::SessionOpened { session, .. } => Some(session.0),
            _ => None,
        })
        .collect();
    let released: HashSet<(String, u64, u64)> = merged
        .values()
        .filter_map(|l| match (&l.command, &l.outcome) {
            (
                Command::Release {
                    session,
                    name,
                    token,
                    ..
                },
                Outcome::Released,
            ) => Some((name.as_str().to_string(), session.0, token.0)),
            _ => None,
        })
        .collect();
    for o in history.iter().filter(|o| o.ok()) {
        let (session, token) = (o.session.unwrap_or(0), o.token.unwrap_or(0));
        match o.op.as_str() {
            "open" if !opened.contains(&session) => v.push(format!(
                "P5: acknowledged open of session {session} is not in the log: {o:?}"
            )),
            "acquire" if !grants.contains(&(o.lock.clone(), session, token)) => {
                v.push(format!("P5: acknowledged grant is not in the log: {o:?}"))
            }
            "release" if !released.contains(&(o.lock.clone(), session, token)) => {
                v.push(format!("P5: acknowledged release is not in the log: {o:?}"))
            }
            _ => {}
        }
    }
}
