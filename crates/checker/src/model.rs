//! The checker's inputs.

use holdfast_lock_table::{Change, Command, Event, Outcome};
use serde::Deserialize;

/// One client operation from the history.
#[derive(Clone, Debug, Default, Deserialize, PartialEq, Eq)]
pub struct Op {
    pub process: u32,
    pub client: usize,
    /// `open`, `acquire`, `read`, `write`, `release`, `describe`, `lost`; `watch-start` (a watch of the
    /// prefix in `lock` began after index `value`) and `watch` (it delivered an event: `index`, `kind`,
    /// the lock in `lock`, `session`, `token`).
    pub op: String,
    #[serde(default)]
    pub lock: String,
    pub invoke_ms: u64,
    pub complete_ms: u64,
    /// `ok`, `fail` or `unknown`.
    pub result: String,
    pub session: Option<u64>,
    pub token: Option<u64>,
    pub value: Option<u64>,
    /// On `lost`: when the session's last acknowledged renewal (or its open) was sent, and its TTL.
    pub renewed_sent_ms: Option<u64>,
    pub ttl_ms: Option<u64>,
    /// On `watch`: the event's log index and kind (`granted`, `released`, `expired`, `queued`, `cancelled`).
    #[serde(default)]
    pub index: Option<u64>,
    #[serde(default)]
    pub kind: Option<String>,
    /// On `acquire` and `release` of a shared lock or a semaphore: how the acquire asked (`shared`,
    /// `exclusive` for a writer of a shared lock, `permits:N`). Such names are checked by P11 only.
    #[serde(default)]
    pub share: Option<String>,
    /// The Raft group an operation that names no lock belongs to (`open`, `lost` and `watch-start`
    /// record one per group, with that group's session id or position); see [`crate::check_groups`].
    /// None: the group that owns `lock` (group 0 if none does).
    #[serde(default)]
    pub group: Option<u32>,
}

impl Op {
    pub fn ok(&self) -> bool {
        self.result == "ok"
    }
}

/// One applied command, from a server's audit log.
#[derive(Clone, Debug, Deserialize, PartialEq, Eq)]
pub struct AuditLine {
    pub index: u64,
    pub command: Command,
    pub outcome: Outcome,
    pub events: Vec<Event>,
    /// What the entry did to locks, as watchers see it.
    #[serde(default)]
    pub changes: Vec<Change>,
}

/// One record the fenced store accepted, in file order.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StoreRecord {
    pub write: bool,
    pub key: String,
    pub token: u64,
    pub value: Option<u64>,
}

impl StoreRecord {
    /// A record of the fenced store's file; the workload's values are decimal counters.
    pub fn new(write: bool, key: String, token: u64, value: &[u8]) -> StoreRecord {
        StoreRecord {
            write,
            key,
            token,
            value: std::str::from_utf8(value).ok().and_then(|v| v.parse().ok()),
        }
    }
}

/// Parses JSON lines, naming the first bad line.
pub fn parse_lines<T: serde::de::DeserializeOwned>(text: &str) -> Result<Vec<T>, String> {
    text.lines()
        .enumerate()
        .filter(|(_, l)| !l.trim().is_empty())
        .map(|(i, l)| serde_json::from_str(l).map_err(|e| format!("line {}: {e}: {l}", i + 1)))
        .collect()
}
