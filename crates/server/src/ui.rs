//! The web dashboard on the HTTP port: `GET /ui` is one embedded page (HTML, CSS and JavaScript in
//! `ui/index.html`, compiled into the binary: nothing is fetched from the network), which polls the JSON
//! endpoints below once a second and draws them.
//!
//! - `/ui/api/overview`: this server's view of the cluster ([`NodeShared::status`]) and, for the groups it
//!   leads, how far each follower's log is behind.
//! - `/ui/api/locks?prefix=P&limit=N`: the locks whose names start with `P` in every group, at most `N`
//!   (default 200, at most [`MAX_UI_ROWS`]) in all, from this server's **applied** state (so it is as of
//!   the applied index shown beside it, not a linearizable read: a follower may be a little behind).
//! - `/ui/api/sessions?limit=N`: sessions, the same way.
//!
//! What it never shows: session secrets (the lock table's views carry none). With an access policy the
//! lock and session lists are refused (403): the HTTP port authenticates nobody, and the policy may hide
//! lock names from some principals; the overview (counts and roles, what `/metrics` shows) stays.

use crate::node::NodeShared;
use holdfast_lock_table::{LockView, SessionId};
use serde_json::{json, Value};
use tokio::time::Instant;

/// Most rows one list request returns.
pub const MAX_UI_ROWS: usize = 1000;

/// The page, embedded at build time.
pub const PAGE: &str = include_str!("ui/index.html");

/// A response: status line, content type, body.
pub type Reply = (&'static str, &'static str, String);

/// Answers `path` (with its query string) if it is a dashboard path.
pub fn handle(node: &NodeShared, target: &str) -> Option<Reply> {
    let (path, query) = target.split_once('?').unwrap_or((target, ""));
    let json_reply = |v: Value| ("200 OK", "application/json", v.to_string());
    match path {
        "/ui" | "/ui/" => Some(("200 OK", "text/html; charset=utf-8", PAGE.to_string())),
        "/ui/api/overview" => Some(json_reply(overview(node))),
        "/ui/api/locks" | "/ui/api/sessions" if node.access.is_some() => Some((
            "403 Forbidden",
            "application/json",
            json!({"error": "this server has an access policy, and its HTTP port authenticates nobody: use `holdfast locks` / `holdfast sessions` with credentials"}).to_string(),
        )),
        "/ui/api/locks" => {
            let prefix = param(query, "prefix").unwrap_or_default();
            Some(json_reply(locks(node, &prefix, limit(query))))
        }
        "/ui/api/sessions" => Some(json_reply(sessions(node, limit(query)))),
        _ => None,
    }
}

fn limit(query: &str) -> usize {
    param(query, "limit")
        .and_then(|l| l.parse().ok())
        .unwrap_or(200)
        .clamp(1, MAX_UI_ROWS)
}

/// The value of `key` in a query string, percent-decoded (`+` is a space); None if absent or malformed.
fn param(query: &str, key: &str) -> Option<String> {
    query.split('&').find_map(|pair| {
        let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
        (k == key).then(|| percent_decode(v)).flatten()
    })
}

fn percent_decode(s: &str) -> Option<String> {
    let mut out = Vec::with_capacity(s.len());
    let mut bytes = s.bytes();
    while let Some(b) = bytes.next() {
        match b {
            b'+' => out.push(b' '),
            b'%' => {
                let hex = [bytes.next()?, bytes.next()?];
                out.push(u8::from_str_radix(std::str::from_utf8(&hex).ok()?, 16).ok()?);
            }
            b => out.push(b),
        }
    }
    String::from_utf8(out).ok()
}

/// A holder's value as text when it is UTF-8 (leader election stores names and addresses), else hex.
fn value_text(v: &[u8]) -> String {
    match std::str::from_utf8(v) {
        Ok(s) => s.to_string(),
        Err(_) => v.iter().map(|b| format!("{b:02x}")).collect(),
    }
}

fn overview(node: &NodeShared) -> Value {
    let status = node.status(false);
    let groups: Vec<Value> = status
        .groups
        .iter()
        .zip(&node.groups)
        .map(|(g, group)| {
            let m = group.raft_metrics();
            let last = m.last_log_index.unwrap_or(0);
            let followers: Vec<Value> = m
                .replication
                .into_iter()
                .flatten()
                .filter(|(id, _)| *id != node.config.node_id)
                .map(|(id, matched)| {
                    json!({"node": id, "lag": last.saturating_sub(matched.map_or(0, |l| l.index))})
                })
                .collect();
            json!({
                "group": g.group, "role": g.role, "term": g.term,
                "leader_id": g.leader_id, "leader_endpoint": g.leader_endpoint,
                "leader_confirmed": g.leader_confirmed,
                "last_log_index": g.last_log_index, "committed_index": g.committed_index,
                "applied_index": g.applied_index, "snapshot_index": g.snapshot_index,
                "sessions": g.sessions, "locks": g.locks, "waiters": g.waiters,
                "table_bytes": g.table_bytes, "table_budget": g.table_budget,
                "followers": followers,
            })
        })
        .collect();
    let members: Vec<Value> = status
        .members
        .iter()
        .map(|m| json!({"node_id": m.node_id, "client_endpoint": m.client_endpoint, "peer_endpoint": m.peer_endpoint, "role": m.role}))
        .collect();
    json!({
        "node_id": status.node_id,
        "cluster_id": status.cluster_id,
        "group_count": status.group_count,
        "version": env!("CARGO_PKG_VERSION"),
        "members": members,
        "groups": groups,
        "lists_allowed": node.access.is_none(),
    })
}

fn locks(node: &NodeShared, prefix: &str, limit: usize) -> Value {
    let now = Instant::now();
    let mut rows: Vec<(u32, LockView)> = Vec::new();
    let mut applied = Vec::new();
    let mut more = false;
    for group in &node.groups {
        // One page per group under the state lock (a range of the name index, at most `limit + 1`
        // rows), so a dashboard never holds up apply for long.
        let (views, index) = {
            let s = group.state.read().expect("state lock");
            (
                s.table.list_locks(prefix, None, limit + 1),
                s.last_applied.map_or(0, |l| l.index),
            )
        };
        more |= views.len() > limit;
        applied.push(index);
        rows.extend(views.into_iter().take(limit).map(|v| (group.id, v)));
    }
    rows.sort_by(|a, b| a.1.name.as_str().cmp(b.1.name.as_str()));
    more |= rows.len() > limit;
    rows.truncate(limit);
    let locks: Vec<Value> = rows
        .iter()
        .map(|(g, v)| {
            let group = &node.groups[*g as usize];
            let remaining = |s: SessionId| {
                group
                    .leases
                    .remaining(s, now)
                    .map(|d| d.as_millis() as u64)
            };
            let holders: Vec<Value> = v
                .holders()
                .map(|h| {
                    json!({
                        "session": h.session.0, "token": h.token.0,
                        "granted_at_ms": h.granted_at_ms,
                        "ttl_remaining_ms": remaining(h.session),
                        "shared": h.shared, "delayed": h.session.0 == 0,
                        "lock_delay_ms": h.lock_delay_ms,
                        "value": value_text(&h.value),
                    })
                })
                .collect();
            let waiters: Vec<Value> = v
                .waiters
                .iter()
                .map(|w| json!({"session": w.session.0, "enqueued_at_ms": w.enqueued_at_ms, "shared": w.shared}))
                .collect();
            json!({"group": g, "name": v.name.as_str(), "permits": v.permits, "holders": holders, "waiters": waiters})
        })
        .collect();
    json!({"node_id": node.config.node_id, "applied_index": applied, "more": more, "locks": locks})
}

fn sessions(node: &NodeShared, limit: usize) -> Value {
    let now = Instant::now();
    let mut rows = Vec::new();
    let mut more = false;
    for group in &node.groups {
        let views = {
            let s = group.state.read().expect("state lock");
            s.table.list_sessions(None, limit + 1)
        };
        more |= views.len() > limit;
        for v in views.into_iter().take(limit) {
            rows.push(json!({
                "group": group.id, "session": v.session.0, "ttl_ms": v.ttl_ms,
                "opened_at_ms": v.opened_at_ms, "held": v.held, "waiting": v.waiting,
                "ttl_remaining_ms": group.leases.remaining(v.session, now).map(|d| d.as_millis() as u64),
            }));
        }
    }
    more |= rows.len() > limit;
    rows.truncate(limit);
    json!({"node_id": node.config.node_id, "more": more, "sessions": rows})
}

#[cfg(test)]
mod tests {
    use super::{param, percent_decode};

    #[test]
    fn query_parameters_are_percent_decoded() {
        assert_eq!(
            param("limit=5&prefix=jobs%2Fa+b", "prefix").as_deref(),
            Some("jobs/a b")
        );
        assert_eq!(param("limit=5", "prefix"), None);
        assert_eq!(percent_decode("%e2%9c%93").as_deref(), Some("✓"));
        assert_eq!(percent_decode("%zz"), None);
        assert_eq!(percent_decode("%4"), None);
        assert_eq!(percent_decode("%ff"), None, "not UTF-8");
    }
}
