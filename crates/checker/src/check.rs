//! The checks. Each violation is a sentence naming the property and the evidence.

use crate::model::{AuditLine, Op, StoreRecord};
use holdfast_lock_table::{Command, Event, Outcome, SessionId};
use std::collections::{BTreeMap, HashMap, HashSet};

#[derive(Debug, Default)]
pub struct Report {
    pub violations: Vec<String>,
    pub ops: usize,
    pub ok_grants: usize,
    pub ok_writes: usize,
    pub stale_refused: usize,
    pub applied_entries: usize,
    /// Session expiries checked against the client's last acknowledged renewal (P6).
    pub expiries_checked: usize,
    /// Describe results checked for linearizability against the log.
    pub reads_checked: usize,
}

pub fn check(history: &[Op], audits: &[(u64, Vec<AuditLine>)], store: &[StoreRecord]) -> Report {
    let mut r = Report {
        ops: history.len(),
        ..Report::default()
    };
    let merged = agree(audits, &mut r.violations);
    r.applied_entries = merged.len();
    let (grants, timelines) = one_holder(&merged, &mut r.violations);
    r.reads_checked = reads(history, &timelines, &mut r.violations);
    tokens(history, &mut r.violations);
    acknowledged_in_log(history, &merged, &grants, &mut r.violations);
    fenced_store(history, store, &mut r.violations);
    r.expiries_checked = no_early_expiry(history, &merged, &mut r.violations);
    r.ok_grants = history
        .iter()
        .filter(|o| o.op == "acquire" && o.ok())
        .count();
    r.ok_writes = history.iter().filter(|o| o.op == "write" && o.ok()).count();
    r.stale_refused = history
        .iter()
        .filter(|o| o.op == "write" && o.result == "fail")
        .count();
    r
}

/// P2: the same index applied the same way everywhere. Returns the merged log.
fn agree<'a>(
    audits: &'a [(u64, Vec<AuditLine>)],
    v: &mut Vec<String>,
) -> BTreeMap<u64, &'a AuditLine> {
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

/// P1 and the log side of P3: replays the merged log; returns every grant as (lock, session, token).
/// Each lock's holder over the log: (index, holder session and token after that index), at every change.
type Timelines = HashMap<String, Vec<(u64, Option<(u64, u64)>)>>;

fn one_holder(
    merged: &BTreeMap<u64, &AuditLine>,
    v: &mut Vec<String>,
) -> (HashSet<(String, u64, u64)>, Timelines) {
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
                Event::Granted { name, .. } => Some(name.as_str().to_string()),
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
            _ => {}
        }
        match (&line.command, &line.outcome) {
            (Command::Acquire { session, name, .. }, Outcome::Granted { token }) if token.0 == index => {
                grant(name.as_str(), *session, token.0, index, &mut holders, v);
            }
            (Command::Release { session, name, token, .. }, Outcome::Released) => match holders.get(name.as_str()) {
                Some((s, t)) if s == session && *t == token.0 => {
                    holders.remove(name.as_str());
                }
                other => v.push(format!("P1: at index {index} session {} released {name} (token {}) but the holder was {other:?}", session.0, token.0)),
            },
            (Command::CloseSession { session, .. } | Command::ExpireSession { session, .. }, Outcome::SessionClosed { .. }) => {
                holders.retain(|_, (s, _)| s != session);
            }
            _ => {}
        }
        for e in &line.events {
            if let Event::Granted {
                name,
                session,
                token,
                ..
            } = e
            {
                grant(name.as_str(), *session, token.0, index, &mut holders, v);
            }
        }
        for name in touched {
            let now = holders.get(&name).map(|(s, t)| (s.0, *t));
            let timeline = timelines.entry(name).or_default();
            if timeline.last().map(|(_, h)| *h) != Some(now) {
                timeline.push((index, now));
            }
        }
    }
    (grants, timelines)
}

/// P3 on the history: unique tokens per lock, and real-time order.
fn tokens(history: &[Op], v: &mut Vec<String>) {
    let mut by_lock: HashMap<&str, Vec<&Op>> = HashMap::new();
    for o in history.iter().filter(|o| o.op == "acquire" && o.ok()) {
        by_lock.entry(&o.lock).or_default().push(o);
    }
    for (lock, mut grants) in by_lock {
        let mut seen: HashMap<u64, &Op> = HashMap::new();
        for g in &grants {
            let token = g.token.unwrap_or(0);
            if token == 0 {
                v.push(format!("P3: lock {lock:?} granted with token 0 to {g:?}"));
            }
            if let Some(other) = seen.insert(token, g) {
                v.push(format!(
                    "P3: lock {lock:?} token {token} granted twice: {other:?} and {g:?}"
                ));
            }
        }
        grants.sort_by_key(|g| g.complete_ms);
        // For each grant, every grant invoked after it completed must have a larger token.
        for (i, a) in grants.iter().enumerate() {
            for b in &grants[i + 1..] {
                if b.invoke_ms > a.complete_ms && b.token <= a.token {
                    v.push(format!("P3: lock {lock:?}: grant {b:?} invoked after {a:?} completed has a token not above it"));
                }
            }
        }
    }
}

/// P5: acknowledged opens, grants and releases are in the applied log.
fn acknowledged_in_log(
    history: &[Op],
    merged: &BTreeMap<u64, &AuditLine>,
    grants: &HashSet<(String, u64, u64)>,
    v: &mut Vec<String>,
) {
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

/// P4: the store's marks never go down, increments never repeat, acknowledged writes are all there.
fn fenced_store(history: &[Op], store: &[StoreRecord], v: &mut Vec<String>) {
    let mut mark: HashMap<&str, u64> = HashMap::new();
    let mut last_value: HashMap<&str, u64> = HashMap::new();
    let mut stored: HashSet<(&str, u64, u64)> = HashSet::new();
    for r in store {
        let m = mark.entry(&r.key).or_insert(0);
        if r.token < *m {
            v.push(format!(
                "P4: the store accepted token {} for {:?} after token {}",
                r.token, r.key, m
            ));
        }
        *m = (*m).max(r.token);
        if let (true, Some(value)) = (r.write, r.value) {
            let prev = last_value.insert(&r.key, value).unwrap_or(0);
            if value != prev + 1 {
                v.push(format!(
                    "P4: {:?} went from {prev} to {value}: an update was lost or applied twice",
                    r.key
                ));
            }
            stored.insert((&r.key, r.token, value));
        }
    }
    for o in history.iter().filter(|o| o.op == "write" && o.ok()) {
        let value = o.value.unwrap_or(0);
        if !stored.contains(&(o.lock.as_str(), o.token.unwrap_or(0), value)) {
            v.push(format!("P4: acknowledged write is not in the store: {o:?}"));
        }
    }
}

/// How much earlier than renewal + TTL an expiry may be proposed before it counts as early: the leader's
/// wall clock and the client's are the same machine's in the tests, so this only absorbs clock slewing.
pub const EXPIRY_MARGIN_MS: u64 = 100;

/// P6: an expiry is proposed (leader wall time `now_ms`) no earlier than the send time of the session's
/// last acknowledged renewal plus its TTL. Returns how many expiries could be checked.
fn no_early_expiry(
    history: &[Op],
    merged: &BTreeMap<u64, &AuditLine>,
    v: &mut Vec<String>,
) -> usize {
    let renewals: HashMap<u64, (u64, u64)> = history
        .iter()
        .filter(|o| o.op == "lost")
        .filter_map(|o| Some((o.session?, (o.renewed_sent_ms?, o.ttl_ms?))))
        .collect();
    let mut checked = 0;
    for (index, line) in merged {
        if let Command::ExpireSession { session, now_ms } = &line.command {
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

/// Linearizable reads: a describe returns the lock's holder as of some log index `r` between the entries it
/// must follow and those it must precede. Entries whose log position the history knows (a grant's token
/// and an open's session id are their log indexes) bound `r`: at least every such index that completed
/// before the describe was invoked, and below every such index invoked after it completed.
fn reads(history: &[Op], timelines: &Timelines, v: &mut Vec<String>) -> usize {
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
