//! **P1: at most one holder per lock at every applied index**, checked by a model that replays the merged
//! applied log (see [`super::p2_replicas_agree`]). Also checks **the log side of P3**: a grant's token is
//! its log index, and per lock the tokens granted in the log strictly increase.
//!
//! Input: the merged log. The replay follows `Acquire` outcomes (`Granted`), `Release` outcomes
//! (`Released`, which must come from the current holder with its token), `CloseSession` /
//! `ExpireSession` / `ExpireSessions` (`SessionClosed`, which frees the sessions' locks) and `Granted` events (a waiter
//! promoted). Retried requests (same session and request id) replay their first outcome and change
//! nothing, so they are skipped.
//!
//! Why it matters: mutual exclusion is the service's whole point; two holders at once means two clients
//! both believe they may act on the protected resource. Tokens equal to log indexes are what make fencing
//! (P4) work: a newer grant always has a larger token.
//!
//! Besides the violations, returns every grant in the log ([`Grants`], used by P5) and each lock's holder
//! over the log ([`Timelines`], used by the linearizable-reads check).

use super::MergedLog;
use holdfast_lock_table::{Command, Event, Outcome, SessionId};
use std::collections::{BTreeSet, HashMap, HashSet};

/// Every grant in the log, as (lock, session, token).
pub type Grants = HashSet<(String, u64, u64)>;

/// Each lock's holder over the log: (index, holder session and token after that index), at every change.
pub type Timelines = HashMap<String, Vec<(u64, Option<(u64, u64)>)>>;

/// P1 and the log side of P3: replays the merged log; returns every grant as (lock, session, token) and
/// each lock's holder timeline. Names in `multi` (shared locks and semaphores) are left to P11.
pub fn check(
    merged: &MergedLog<'_>,
    multi: &BTreeSet<String>,
    v: &mut Vec<String>,
) -> (Grants, Timelines) {
    let mut timelines: Timelines = HashMap::new();
    let mut holders: HashMap<String, (SessionId, u64)> = HashMap::new();
    let mut last_token: HashMap<String, u64> = HashMap::new();
    let mut grants = HashSet::new();
    let mut grant = |name: &str,
                     session: SessionId,
                     token: u64,
                     index: u64,
                     holders: &mut HashMap<String, (SessionId, u64)>,
                     v: &mut Vec<String>| {
        if multi.contains(name) {
            return;
        }
        if let Some((other, t)) = holders.get(name) {
            v.push(format!("P1: at index {index} lock {name:?} granted to session {} while session {} holds it (token {t})", session.0, other.0));
        }
        if token != index {
            v.push(format!(
                "P3: lock {name:?} granted at index {index} with token {token}"
            ));
        }
        if let Some(prev) = last_token.insert(name.to_string(), token) {
            if prev >= token {
                v.push(format!(
                    "P3: lock {name:?} token went from {prev} to {token} at index {index}"
                ));
            }
        }
        holders.insert(name.to_string(), (session, token));
        grants.insert((name.to_string(), session.0, token));
    };
    // Retried requests (same session and request id) replay their first outcome and change nothing.
    let mut seen_requests = HashSet::new();
    for (&index, line) in merged {
        let replay = match &line.command {
            Command::Acquire {
                session, request, ..
            }
            | Command::Release {
                session, request, ..
            } => !seen_requests.insert((*session, *request)),
            _ => false,
        };
        if replay {
            continue;
        }
        let mut touched: Vec<String> = line
            .events
            .iter()
            .filter_map(|e| match e {
                Event::Granted { name, .. } | Event::GrantAbandoned { name, .. } => {
                    Some(name.as_str().to_string())
                }
                _ => None,
            })
            .collect();
        match &line.command {
            Command::Acquire { name, .. } | Command::Release { name, .. } => {
                touched.push(name.as_str().to_string())
            }
            Command::CloseSession { session, .. } | Command::ExpireSession { session, .. } => {
                touched.extend(
                    holders
                        .iter()
                        .filter(|(_, (s, _))| s == session)
                        .map(|(n, _)| n.clone()),
                );
            }
            Command::ExpireSessions { sessions, .. } => {
                touched.extend(
                    holders
                        .iter()
                        .filter(|(_, (s, _))| sessions.contains(s))
                        .map(|(n, _)| n.clone()),
                );
            }
            _ => {}
        }
        match (&line.command, &line.outcome) {
            (Command::Acquire { session, name, .. }, Outcome::Granted { token }) if token.0 == index => {
                grant(name.as_str(), *session, token.0, index, &mut holders, v);
            }
            (Command::Release { name, .. }, _) if multi.contains(name.as_str()) => {}
            (Command::Release { session, name, token, .. }, Outcome::Released) => match holders.get(name.as_str()) {
                Some((s, t)) if s == session && *t == token.0 => {
                    holders.remove(name.as_str());
                }
                other => v.push(format!("P1: at index {index} session {} released {name} (token {}) but the holder was {other:?}", session.0, token.0)),
            },
            (Command::CloseSession { session, .. } | Command::ExpireSession { session, .. }, Outcome::SessionClosed { .. }) => {
                holders.retain(|_, (s, _)| s != session);
            }
            (Command::ExpireSessions { sessions, .. }, Outcome::SessionClosed { .. }) => {
                holders.retain(|_, (s, _)| !sessions.contains(s));
            }
            _ => {}
        }
        for e in &line.events {
            match e {
                Event::GrantAbandoned { name, .. } if multi.contains(name.as_str()) => {}
                Event::GrantAbandoned {
                    name,
                    session,
                    token,
                } => match holders.get(name.as_str()) {
                    Some((s, t)) if s == session && *t == token.0 => {
                        holders.remove(name.as_str());
                    }
                    other => v.push(format!("P1: at index {index} session {} abandoned {name} (token {}) but the holder was {other:?}", session.0, token.0)),
                },
                Event::Granted {
                    name,
                    session,
                    token,
                    ..
                } => grant(name.as_str(), *session, token.0, index, &mut holders, v),
                _ => {}
            }
        }
        for name in touched.into_iter().filter(|n| !multi.contains(n)) {
            let now = holders.get(&name).map(|(s, t)| (s.0, *t));
            let timeline = timelines.entry(name).or_default();
            if timeline.last().map(|(_, h)| *h) != Some(now) {
                timeline.push((index, now));
            }
        }
    }
    (grants, timelines)
}
