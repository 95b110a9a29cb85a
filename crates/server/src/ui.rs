//! The web dashboard on the HTTP port: `GET /ui` is one embedded page (HTML, CSS and JavaScript in
//! `ui/index.html`, compiled into the binary: nothing is fetched from the network), which polls the JSON
//! endpoints below about once a second (the next poll starts a second after the last one ended) and
//! draws them.
//!
//! - `/ui/api/overview`: this server's view of the cluster ([`NodeShared::status`]) and, for the groups it
//!   leads, how far each follower's log is behind.
//! - `/ui/api/locks?prefix=P&after=A&limit=N`: the locks whose names start with `P` and sort after `A`,
//!   in every group, by name, at most `N` (default 200, at most [`MAX_UI_ROWS`]) and at most
//!   [`MAX_UI_BODY_BYTES`] of JSON, from this server's **applied** state (so it is as of the applied
//!   index shown beside it, not a linearizable read: a follower may be a little behind). A lock lists at
//!   most [`MAX_LISTED_PER_LOCK`] holders and as many waiters, with their full counts.
//! - `/ui/api/sessions?after=S&limit=N`: sessions of every group after id `S`, merged by id, the same way.
//!
//! `more: true` in a list says there is a next page, which starts after the last row's name or id.
//! A malformed query (bad percent-encoding, a non-number) is answered 400.
//!
//! What it never shows: session secrets (the lock table's views carry none). With an access policy the
//! lock and session lists are refused (403), and the overview leaves out the cluster id and the
//! servers' endpoints: the HTTP port authenticates nobody, and the policy may hide lock names from some
//! principals. The lists are built on the blocking pool, so a large page never holds up a runtime worker.

use crate::node::NodeShared;
use axum::extract::{RawQuery, State};
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::Router;
use holdfast_lock_table::{LockView, SessionId};
use serde_json::{json, Value};
use std::sync::Arc;
use tokio::time::Instant;

/// Most rows one list request returns.
pub const MAX_UI_ROWS: usize = 1000;
/// Most bytes of JSON rows one list answer carries; the rows past it are left for the next page.
pub const MAX_UI_BODY_BYTES: usize = 1 << 20;
/// Most holders, and most waiters, listed for one lock (a semaphore may have thousands).
pub const MAX_LISTED_PER_LOCK: usize = 16;

/// The page, embedded at build time.
pub const PAGE: &str = include_str!("ui/index.html");

/// The dashboard's paths.
pub fn routes() -> Router<Arc<NodeShared>> {
    Router::new()
        .route("/ui", get(page))
        .route("/ui/", get(page))
        .route("/ui/api/overview", get(overview_json))
        .route("/ui/api/locks", get(locks_json))
        .route("/ui/api/sessions", get(sessions_json))
}

async fn page() -> Response {
    ([(header::CONTENT_TYPE, "text/html; charset=utf-8")], PAGE).into_response()
}

fn json_reply(status: StatusCode, body: String) -> Response {
    (status, [(header::CONTENT_TYPE, "application/json")], body).into_response()
}

fn error(status: StatusCode, message: &str) -> Response {
    json_reply(status, json!({ "error": message }).to_string())
}

async fn overview_json(State(node): State<Arc<NodeShared>>) -> Response {
    json_reply(StatusCode::OK, overview(&node).to_string())
}

/// Refuses the lists when the server has an access policy.
fn lists_refused(node: &NodeShared) -> Option<Response> {
    node.access.as_ref().map(|_| {
        error(
            StatusCode::FORBIDDEN,
            "this server has an access policy, and its HTTP port authenticates nobody: use `holdfast locks` / `holdfast sessions` with credentials",
        )
    })
}

/// Runs a list on the blocking pool (it reads the tables under their locks and encodes up to a MiB).
async fn on_blocking_pool(f: impl FnOnce() -> Response + Send + 'static) -> Response {
    tokio::task::spawn_blocking(f)
        .await
        .unwrap_or_else(|_| error(StatusCode::INTERNAL_SERVER_ERROR, "the list failed"))
}

async fn locks_json(State(node): State<Arc<NodeShared>>, RawQuery(q): RawQuery) -> Response {
    if let Some(refused) = lists_refused(&node) {
        return refused;
    }
    let q = q.unwrap_or_default();
    let (prefix, after, limit) = match (param(&q, "prefix"), param(&q, "after"), limit(&q)) {
        (Ok(p), Ok(a), Ok(l)) => (p.unwrap_or_default(), a.filter(|a| !a.is_empty()), l),
        _ => {
            return error(
                StatusCode::BAD_REQUEST,
                "malformed query: prefix and after are percent-encoded UTF-8, limit a number",
            )
        }
    };
    on_blocking_pool(move || {
        json_reply(
            StatusCode::OK,
            locks(&node, &prefix, after.as_deref(), limit),
        )
    })
    .await
}

async fn sessions_json(State(node): State<Arc<NodeShared>>, RawQuery(q): RawQuery) -> Response {
    if let Some(refused) = lists_refused(&node) {
        return refused;
    }
    let q = q.unwrap_or_default();
    let after = match param(&q, "after").map(|a| a.map(|a| a.parse::<u64>())) {
        Ok(None) => None,
        Ok(Some(Ok(a))) => Some(SessionId(a)),
        _ => {
            return error(
                StatusCode::BAD_REQUEST,
                "malformed query: after is a session id",
            )
        }
    };
    let Ok(limit) = limit(&q) else {
        return error(
            StatusCode::BAD_REQUEST,
            "malformed query: limit is a number",
        );
    };
    on_blocking_pool(move || json_reply(StatusCode::OK, sessions(&node, after, limit))).await
}

/// Malformed: a parameter that is not percent-encoded UTF-8, or not a number where one is needed.
#[derive(Debug, PartialEq)]
struct Malformed;

fn limit(query: &str) -> Result<usize, Malformed> {
    match param(query, "limit")? {
        None => Ok(200),
        Some(l) => l
            .parse::<usize>()
            .map(|l| l.clamp(1, MAX_UI_ROWS))
            .map_err(|_| Malformed),
    }
}

/// The value of `key` in a query string, percent-decoded (`+` is a space); None if absent.
fn param(query: &str, key: &str) -> Result<Option<String>, Malformed> {
    query
        .split('&')
        .find_map(|pair| {
            let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
            (k == key).then(|| percent_decode(v).ok_or(Malformed))
        })
        .transpose()
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

/// Appends JSON rows to a list until [`MAX_UI_BODY_BYTES`] or `limit` rows.
struct Rows {
    body: String,
    count: usize,
    limit: usize,
    /// A row was left out: there is a next page.
    more: bool,
}

impl Rows {
    fn new(limit: usize) -> Self {
        Rows {
            body: String::from("["),
            count: 0,
            limit,
            more: false,
        }
    }

    /// Adds `row` unless the list is full; false (and `more` set) if it was.
    fn push(&mut self, row: &Value) -> bool {
        let text = row.to_string();
        if self.count >= self.limit || self.body.len() + text.len() > MAX_UI_BODY_BYTES {
            self.more = true;
            return false;
        }
        if self.count > 0 {
            self.body.push(',');
        }
        self.body.push_str(&text);
        self.count += 1;
        true
    }

    /// `{"key": [rows], "more": bool, ...fields}` as text.
    fn finish(mut self, key: &str, fields: Value) -> String {
        self.body.push(']');
        let mut head = fields.to_string();
        head.pop(); // the closing brace
        let sep = if head.len() > 1 { "," } else { "" };
        format!(
            "{head}{sep}\"more\":{},\"{key}\":{}}}",
            self.more, self.body
        )
    }
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
    // With a policy the HTTP port shows roles and counts only, nothing that names the cluster or says
    // where to reach it.
    let hide = node.access.is_some();
    let endpoint = |e: &str| (!hide).then(|| e.to_string());
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
                "leader_id": g.leader_id, "leader_endpoint": endpoint(&g.leader_endpoint),
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
        .map(|m| json!({"node_id": m.node_id, "client_endpoint": endpoint(&m.client_endpoint), "peer_endpoint": endpoint(&m.peer_endpoint), "role": m.role}))
        .collect();
    json!({
        "node_id": status.node_id,
        "cluster_id": (!hide).then_some(status.cluster_id),
        "group_count": status.group_count,
        "version": env!("CARGO_PKG_VERSION"),
        "members": members,
        "groups": groups,
        "lists_allowed": !hide,
    })
}

fn locks(node: &NodeShared, prefix: &str, after: Option<&str>, limit: usize) -> String {
    let now = Instant::now();
    let mut views: Vec<(u32, LockView)> = Vec::new();
    let mut applied = Vec::new();
    for group in &node.groups {
        // One page per group under the state lock (a range of the name index, at most `limit + 1`
        // rows), so a dashboard never holds up apply for long.
        let s = group.state.read().expect("state lock");
        views.extend(
            s.table
                .list_locks(prefix, after, limit + 1)
                .into_iter()
                .map(|v| (group.id, v)),
        );
        applied.push(s.last_applied.map_or(0, |l| l.index));
    }
    views.sort_by(|a, b| a.1.name.as_str().cmp(b.1.name.as_str()));
    let mut rows = Rows::new(limit);
    for (g, v) in &views {
        let group = &node.groups[*g as usize];
        let remaining = |s: SessionId| group.leases.remaining(s, now).map(|d| d.as_millis() as u64);
        let holders: Vec<Value> = v
            .holders()
            .take(MAX_LISTED_PER_LOCK)
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
            .take(MAX_LISTED_PER_LOCK)
            .map(|w| json!({"session": w.session.0, "enqueued_at_ms": w.enqueued_at_ms, "shared": w.shared}))
            .collect();
        let row = json!({
            "group": g, "name": v.name.as_str(), "permits": v.permits,
            "holder_count": v.holders().count(), "holders": holders,
            "waiter_count": v.waiters.len(), "waiters": waiters,
        });
        if !rows.push(&row) {
            break;
        }
    }
    rows.finish(
        "locks",
        json!({"node_id": node.config.node_id, "applied_index": applied}),
    )
}

fn sessions(node: &NodeShared, after: Option<SessionId>, limit: usize) -> String {
    let now = Instant::now();
    let mut views = Vec::new();
    for group in &node.groups {
        let s = group.state.read().expect("state lock");
        views.extend(
            s.table
                .list_sessions(after, limit + 1)
                .into_iter()
                .map(|v| (group.id, v)),
        );
    }
    // Merged by id (each group numbers its own sessions, by log index, so ids may repeat across
    // groups; the next page starts after the last id shown, in every group).
    views.sort_by_key(|(g, v)| (v.session, *g));
    let mut rows = Rows::new(limit);
    let mut last = None;
    for (g, v) in &views {
        // A page ends between ids, never between two groups' sessions of one id.
        if rows.count + 1 > limit && last == Some(v.session) {
            rows.limit += 1;
        }
        let group = &node.groups[*g as usize];
        let row = json!({
            "group": g, "session": v.session.0, "ttl_ms": v.ttl_ms,
            "opened_at_ms": v.opened_at_ms, "held": v.held, "waiting": v.waiting,
            "ttl_remaining_ms": group.leases.remaining(v.session, now).map(|d| d.as_millis() as u64),
        });
        if !rows.push(&row) {
            break;
        }
        last = Some(v.session);
    }
    rows.finish("sessions", json!({"node_id": node.config.node_id}))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn query_parameters_are_percent_decoded() {
        assert_eq!(
            param("limit=5&prefix=jobs%2Fa+b", "prefix"),
            Ok(Some("jobs/a b".to_string()))
        );
        assert_eq!(param("limit=5", "prefix"), Ok(None));
        assert_eq!(param("limit=5&prefix=%zz", "prefix"), Err(Malformed));
        assert_eq!(limit("limit=5000"), Ok(MAX_UI_ROWS));
        assert_eq!(limit(""), Ok(200));
        assert_eq!(limit("limit=x"), Err(Malformed));
        assert_eq!(percent_decode("%e2%9c%93").as_deref(), Some("✓"));
        assert_eq!(percent_decode("%zz"), None);
        assert_eq!(percent_decode("%4"), None);
        assert_eq!(percent_decode("%ff"), None, "not UTF-8");
    }

    #[test]
    fn lists_stop_at_the_row_limit_and_the_byte_cap() {
        let mut rows = Rows::new(2);
        assert!(rows.push(&json!({"a": 1})) && rows.push(&json!({"a": 2})));
        assert!(!rows.push(&json!({"a": 3})));
        let text = rows.finish("x", json!({"node_id": 4}));
        let v: Value = serde_json::from_str(&text).unwrap();
        assert_eq!(
            v,
            json!({"node_id": 4, "more": true, "x": [{"a": 1}, {"a": 2}]})
        );

        let mut rows = Rows::new(MAX_UI_ROWS);
        let big = json!({"v": "x".repeat(100_000)});
        let mut pushed = 0;
        while rows.push(&big) {
            pushed += 1;
        }
        assert_eq!(pushed, 10, "1 MiB holds ten rows of 100,009 bytes");
        let text = rows.finish("x", json!({}));
        assert!(text.len() <= MAX_UI_BODY_BYTES + 64, "{}", text.len());
        let v: Value = serde_json::from_str(&text).unwrap();
        assert_eq!(v["more"], json!(true));
        assert_eq!(v["x"].as_array().unwrap().len(), pushed);
    }
}
