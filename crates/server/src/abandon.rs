//! Acquires whose caller went away before it learned the outcome.
//!
//! A queued acquire keeps its place in the replicated table whether or not anybody still waits for the
//! answer, and the grant it later receives would leave a holder that never learns it holds the lock (its
//! process goes on renewing the session, so the lock is stuck). So every `Acquire` call gets an *attempt*
//! id, carried in its log entry, and a [`Call`] guard while its handler runs. If the handler is dropped
//! before it gave a definite answer (the client cancelled the call or reset its stream, the connection
//! closed, or the outcome is unknown), the server proposes `AbandonAcquire` for that attempt: the wait is
//! removed, or the grant released. When this server no longer leads the group, it forwards the abandon
//! to the leader's `CancelAcquire`, and keeps trying until it is applied, the session is gone, or this
//! server stops. A client that sets `AcquireRequest.client_cancels` takes this duty itself (the Rust
//! client does, so that an attempt that timed out keeps its place in the queue when retried).
//! docs/api.md gives the whole argument.
//!
//! An abandon this server owes is written to `DATA_DIR/abandons` (fsynced) before it is first proposed
//! and removed once it is done, and a restarted server takes the ones it finds up again: an isolated
//! leader cannot commit its abandon for as long as the partition lasts, and if it crashed meanwhile the
//! abandon would otherwise be forgotten (found by the simulation, seed 77). What remains is the moment
//! between the call going away and that fsync.
//!
//! Invariant: an abandon started here acts only on its own attempt. A retry of the same request by a
//! newer call, on this server or another, makes the wait or grant that call's (the table records the
//! attempt of the last acquire entry for it), and the older abandon then changes nothing; so a retry is
//! never answered with a grant that the abandon of its first call releases later. There is no shortcut
//! that skips an abandon because another call for the request runs here: that call may never reach the
//! log (its leader can be deposed first), and then nobody would answer for the wait.

use crate::group::{Group, ProposeError};
use crate::node::NodeShared;
use holdfast_lock_table::{Command, LockName, Outcome, RequestId, SessionId};
use holdfast_proto::v1 as pb;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Arc;
use std::time::Duration;

type Key = (SessionId, RequestId);

/// Backoff between attempts of an abandon that could not be applied yet (no leader, no quorum).
const RETRY_FIRST: Duration = Duration::from_millis(50);
const RETRY_MAX: Duration = Duration::from_secs(2);
/// An abandon still not applied after this many tries is logged as a warning (and every this many
/// tries after), since a grant nobody knows of may be stuck behind it.
const WARN_EVERY_TRIES: u32 = 30;

/// One forwarded attempt against the leader.
const FORWARD_TIMEOUT: Duration = Duration::from_secs(3);

/// Attempt ids for the acquire calls this server proposes: unique per call (a counter) and, with high
/// probability, across servers and restarts (a base drawn from the seed, the node id and the start
/// time). Never 0, which marks waits and grants from before attempts existed.
pub struct AttemptIds {
    base: u64,
    next: AtomicU64,
}

impl AttemptIds {
    pub fn new(seed: u64, node_id: u64, started_ms: u64) -> Self {
        let mix = |x: u64| (x ^ (x >> 31)).wrapping_mul(0x9E37_79B9_7F4A_7C15);
        AttemptIds {
            base: mix(seed ^ mix(node_id) ^ mix(started_ms.rotate_left(17))),
            next: AtomicU64::new(1),
        }
    }

    pub fn next(&self) -> u64 {
        loop {
            let n = self.next.fetch_add(1, Relaxed);
            let id = self
                .base
                .wrapping_add(n.wrapping_mul(0xD6E8_FEB8_6659_FD93));
            if id != 0 {
                return id;
            }
        }
    }
}

/// What happens when an attached call is dropped before it answered.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OnDrop {
    /// Abandon the acquire through the log (the default for any client).
    Abandon,
    /// Only detach: the client said it cancels by itself (`AcquireRequest.client_cancels`), retrying with
    /// the same request id after a failed attempt and sending `CancelAcquire` when it gives up.
    Detach,
}

/// An acquire call in progress. Call [`Call::answered`] just before the handler returns a definite
/// answer; dropped without it, the call's attempt is abandoned through the log (unless
/// [`OnDrop::Detach`]).
pub struct Call {
    node: Arc<NodeShared>,
    group: u32,
    key: Key,
    name: LockName,
    attempt: u64,
    /// The secret the call showed, which its abandon shows too.
    secret: u128,
    on_drop: OnDrop,
    answered: bool,
}

impl Call {
    /// Starts guarding the call for (session, request) that proposes `attempt`.
    pub fn new(
        node: &Arc<NodeShared>,
        group: &Group,
        (session, request): Key,
        name: &LockName,
        attempt: u64,
        secret: u128,
        on_drop: OnDrop,
    ) -> Call {
        Call {
            node: node.clone(),
            group: group.id,
            key: (session, request),
            name: name.clone(),
            attempt,
            secret,
            on_drop,
            answered: false,
        }
    }

    /// The handler produced a definite answer: nothing to abandon.
    pub fn answered(mut self) {
        self.answered = true;
    }
}

impl Drop for Call {
    fn drop(&mut self) {
        if self.answered || self.on_drop == OnDrop::Detach {
            return;
        }
        let Some(group) = self.node.groups.get(self.group as usize).cloned() else {
            return;
        };
        if let Ok(rt) = tokio::runtime::Handle::try_current() {
            let (node, key, name, attempt, secret) = (
                self.node.clone(),
                self.key,
                self.name.clone(),
                self.attempt,
                self.secret,
            );
            rt.spawn(async move { abandon(&node, &group, key, name, attempt, secret).await });
        }
    }
}

/// Abandons one attempt from this server, retrying until it is applied, the session is gone, or this
/// server stops (then the intent on disk makes the next start take it up again).
async fn abandon(
    node: &NodeShared,
    group: &Group,
    key: Key,
    name: LockName,
    attempt: u64,
    secret: u128,
) {
    let intent = Intent {
        group: group.id,
        session: key.0 .0,
        request: key.1 .0,
        name: name.as_str().to_string(),
        attempt,
        secret,
    };
    node.pending_abandons.add(&intent).await;
    if run_abandon(node, group, key, name, attempt, secret).await {
        node.pending_abandons.remove(&intent).await;
    }
}

/// Takes up the abandons a previous run of this server left on disk.
pub fn resume(node: &Arc<NodeShared>) {
    for intent in node.pending_abandons.loaded() {
        let Some(group) = node.groups.get(intent.group as usize).cloned() else {
            continue;
        };
        let Ok(name) = LockName::new(intent.name.clone()) else {
            continue;
        };
        tracing::info!(
            group = intent.group,
            session = intent.session,
            request = intent.request,
            "taking up an abandon left by the last run"
        );
        let node = node.clone();
        tokio::spawn(async move {
            let key = (SessionId(intent.session), RequestId(intent.request));
            if run_abandon(&node, &group, key, name, intent.attempt, intent.secret).await {
                node.pending_abandons.remove(&intent).await;
            }
        });
    }
}

/// The retry loop; true when the abandon is settled (applied, or nothing left to abandon), false when
/// this server is stopping.
async fn run_abandon(
    node: &NodeShared,
    group: &Group,
    key: Key,
    name: LockName,
    attempt: u64,
    secret: u128,
) -> bool {
    let (session, request) = key;
    let mut backoff = RETRY_FIRST;
    let mut tries = 0u32;
    loop {
        let last_error = match propose(group, session, request, &name, Some(attempt), secret).await
        {
            Ok(_) => return true,
            Err(ProposeError::NotLeader(Some(leader))) if leader != node.config.node_id => {
                match forward(node, leader, group.id, key, &name, attempt, secret).await {
                    Ok(()) => return true,
                    Err(e) => e,
                }
            }
            Err(ProposeError::Stopped(_)) => return false,
            Err(e) => format!("{e:?}"),
        };
        if session_gone(group, session) {
            return true;
        }
        tries += 1;
        if tries.is_multiple_of(WARN_EVERY_TRIES) {
            tracing::warn!(group = group.id, session = session.0, request = request.0, lock = name.as_str(), tries, error = %last_error,
                "an abandoned acquire is not applied yet; its wait or grant stays until it is or the session ends");
        }
        tokio::time::sleep(backoff).await;
        backoff = (backoff * 2).min(RETRY_MAX);
    }
}

/// An abandon this server owes, as kept on disk (with the session secret its call showed: the data
/// directory holds every session's secret in its log and snapshots anyway).
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, serde::Serialize, serde::Deserialize)]
pub struct Intent {
    group: u32,
    session: u64,
    request: u64,
    name: String,
    attempt: u64,
    secret: u128,
}

/// An intent as format 1 (before session secrets) kept it.
#[derive(serde::Deserialize)]
struct IntentV1 {
    group: u32,
    session: u64,
    request: u64,
    name: String,
    attempt: u64,
}

/// Most abandons kept on disk at once; beyond this they still run, but a crash forgets them (each is a
/// call that went away while its abandon could not commit: thousands mean the cluster is down anyway).
const MAX_PENDING_ABANDONS: usize = 10_000;

/// The abandons this server owes, mirrored in `DATA_DIR/abandons`: a version byte, the postcard list,
/// and a CRC-32 of both; replaced whole (temporary file, fsync, rename, directory fsync) after changes.
/// Changes that arrive while a write runs are carried by the next write together, so a burst of calls
/// going away (a client's connection with many waits) costs a few writes, not one each.
pub struct PendingAbandons {
    path: std::path::PathBuf,
    /// What is owed, and how many changes it has had.
    set: std::sync::Mutex<(std::collections::BTreeSet<Intent>, u64)>,
    /// How many changes the file on disk holds. Held while a write runs, so writes do not interleave.
    written: tokio::sync::Mutex<u64>,
    /// Writes of the file so far (for tests).
    writes: AtomicU64,
    loaded: Vec<Intent>,
}

const PENDING_FORMAT: u8 = 2;

impl PendingAbandons {
    /// Reads what a previous run left. An unreadable file is reported and ignored: losing it only
    /// reopens the gap it closes.
    pub fn open(data_dir: &std::path::Path) -> Self {
        let path = data_dir.join("abandons");
        let loaded = match holdfast_wal::fs::read(&path) {
            Ok(bytes) => Self::decode(&bytes).unwrap_or_else(|e| {
                tracing::warn!(path = %path.display(), %e, "ignoring the pending abandons file");
                Vec::new()
            }),
            Err(_) => Vec::new(),
        };
        PendingAbandons {
            path,
            set: std::sync::Mutex::new((loaded.iter().cloned().collect(), 0)),
            written: tokio::sync::Mutex::new(0),
            writes: AtomicU64::new(0),
            loaded,
        }
    }

    fn loaded(&self) -> Vec<Intent> {
        self.loaded.clone()
    }

    fn decode(bytes: &[u8]) -> Result<Vec<Intent>, String> {
        let (body, crc) = bytes.split_last_chunk::<4>().ok_or("truncated")?;
        if crc32fast::hash(body) != u32::from_le_bytes(*crc) {
            return Err("checksum mismatch".into());
        }
        match body.split_first() {
            Some((&PENDING_FORMAT, list)) => postcard::from_bytes(list).map_err(|e| e.to_string()),
            Some((1, list)) => Ok(postcard::from_bytes::<Vec<IntentV1>>(list)
                .map_err(|e| e.to_string())?
                .into_iter()
                .map(|i| Intent {
                    group: i.group,
                    session: i.session,
                    request: i.request,
                    name: i.name,
                    attempt: i.attempt,
                    secret: 0,
                })
                .collect()),
            Some((v, _)) => Err(format!("unknown format version {v}")),
            None => Err("empty".into()),
        }
    }

    /// Adds an abandon this server owes; returns once the file holds it (or writing it failed, which is
    /// logged: the abandon still runs, but a crash would forget it).
    async fn add(&self, intent: &Intent) {
        let change = {
            let mut set = self.set.lock().expect("pending abandons lock");
            if set.0.len() >= MAX_PENDING_ABANDONS || !set.0.insert(intent.clone()) {
                return;
            }
            set.1 += 1;
            set.1
        };
        self.write_through(change).await;
    }

    async fn remove(&self, intent: &Intent) {
        let change = {
            let mut set = self.set.lock().expect("pending abandons lock");
            if !set.0.remove(intent) {
                return;
            }
            set.1 += 1;
            set.1
        };
        self.write_through(change).await;
    }

    /// Returns once the file holds change number `change` (a write that started after it was made
    /// carried it), writing the whole set if none has yet.
    async fn write_through(&self, change: u64) {
        let mut written = self.written.lock().await;
        if *written >= change {
            return;
        }
        let (bytes, changes) = {
            let set = self.set.lock().expect("pending abandons lock");
            let list: Vec<&Intent> = set.0.iter().collect();
            let mut bytes = vec![PENDING_FORMAT];
            bytes.extend(postcard::to_allocvec(&list).expect("encoding to a Vec cannot fail"));
            bytes.extend(crc32fast::hash(&bytes).to_le_bytes());
            (bytes, set.1)
        };
        self.writes.fetch_add(1, Relaxed);
        let path = self.path.clone();
        let result = crate::blocking(move || {
            use std::io::Write;
            let tmp = path.with_extension("tmp");
            let mut file = holdfast_wal::fs::File::create(&tmp)?;
            file.write_all(&bytes)?;
            file.sync_all()?;
            holdfast_wal::fs::rename(&tmp, &path)?;
            holdfast_wal::fs::sync_dir(path.parent().unwrap_or(std::path::Path::new(".")))
        })
        .await;
        match result {
            Ok(()) => *written = changes,
            Err(e) => {
                tracing::warn!(path = %self.path.display(), %e, "cannot write the pending abandons file")
            }
        }
    }
}

/// Proposes the abandon here (this server must lead the group). `attempt` is `None` for a client's own
/// cancel (`CancelAcquire`), `Some` for a call's abandon (proposed here or forwarded by another server).
/// Refusals are answers: `NotWaiting` (the request waits for another lock, or a newer call took it
/// over) or an unknown session.
pub async fn propose(
    group: &Group,
    session: SessionId,
    request: RequestId,
    name: &LockName,
    attempt: Option<u64>,
    secret: u128,
) -> Result<Outcome, ProposeError> {
    let outcome = group
        .propose(Command::Authorized {
            secret,
            command: Box::new(Command::AbandonAcquire {
                session,
                request,
                name: name.clone(),
                attempt,
                now_ms: crate::now_ms(),
            }),
        })
        .await?;
    if outcome == Outcome::Abandoned {
        group.metrics.abandons.inc();
    }
    tracing::debug!(
        group = group.id,
        session = session.0,
        request = request.0,
        lock = name.as_str(),
        ?attempt,
        ?outcome,
        "abandon applied"
    );
    Ok(outcome)
}

/// True once this server has applied past the session's creation and the session is not there: it
/// holds and waits for nothing any more, so there is nothing left to abandon. (Not known while the
/// group's table is unloaded: the abandon goes on to the leader.)
fn session_gone(group: &Group, session: SessionId) -> bool {
    let state = group.state.read().expect("state lock");
    state.unloaded.is_none()
        && state.last_applied.map_or(0, |l| l.index) >= session.0
        && !state.table.has_session(session)
}

/// Sends the abandon to the leader's client port. A refusal from the leader is an answer too: the
/// attempt no longer owns a wait or grant, or the session is gone.
async fn forward(
    node: &NodeShared,
    leader: u64,
    group: u32,
    (session, request): Key,
    name: &LockName,
    attempt: u64,
    secret: u128,
) -> Result<(), String> {
    let client_endpoint = node
        .client_endpoint(leader)
        .ok_or_else(|| format!("node {leader} is not a member"))?;
    // Over TLS when the cluster has it (the request carries the session's secret), on a channel kept
    // for the next forward: thousands of abandons retried against one leader share a connection.
    let mut client =
        pb::holdfast_client::HoldfastClient::new(node.client_channel(leader, &client_endpoint)?);
    let request = pb::CancelAcquireRequest {
        group,
        session_id: session.0,
        request_id: request.0,
        name: name.as_str().to_string(),
        attempt,
        session_secret: crate::errors::secret_bytes(secret),
    };
    match tokio::time::timeout(FORWARD_TIMEOUT, client.cancel_acquire(request)).await {
        Ok(Ok(_)) => Ok(()),
        Ok(Err(status)) => match holdfast_proto::reason(&status) {
            // A wrong secret stays wrong: the acquire it was for was refused the same way. (A policy
            // refusal, ACCESS_DENIED, is retried: servers pass the policy, so it means a misconfiguration
            // that may be fixed.)
            Some(
                pb::Reason::NotHolder | pb::Reason::SessionUnknown | pb::Reason::PermissionDenied,
            ) => Ok(()),
            _ => Err(format!("node {leader}: {}", status.message())),
        },
        Err(_) => Err(format!(
            "node {leader} did not answer within {FORWARD_TIMEOUT:?}"
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn intent(request: u64) -> Intent {
        Intent {
            group: 0,
            session: 7,
            request,
            name: "a/b".into(),
            attempt: 99,
            secret: 0x5ec,
        }
    }

    #[tokio::test]
    async fn pending_abandons_survive_a_restart_and_a_bad_file_is_ignored() {
        let dir = tempfile::tempdir().unwrap();
        let p = PendingAbandons::open(dir.path());
        assert!(p.loaded().is_empty());
        p.add(&intent(1)).await;
        p.add(&intent(2)).await;
        p.remove(&intent(1)).await;
        // A new start finds what was still owed.
        assert_eq!(PendingAbandons::open(dir.path()).loaded(), vec![intent(2)]);
        let path = dir.path().join("abandons");
        let mut bytes = std::fs::read(&path).unwrap();
        *bytes.last_mut().unwrap() ^= 1;
        std::fs::write(&path, &bytes).unwrap();
        assert!(PendingAbandons::open(dir.path()).loaded().is_empty());
    }

    /// A burst of abandons (a connection with many waits going away) is written a few times, not once
    /// per abandon, and what is on disk afterwards is exactly what is still owed.
    #[tokio::test]
    async fn a_burst_of_abandons_shares_its_writes() {
        let dir = tempfile::tempdir().unwrap();
        let p = Arc::new(PendingAbandons::open(dir.path()));
        // Adds (or removes) the intents of `requests` all at once, each from a task of its own.
        let at_once = |requests: Vec<u64>, add: bool| {
            let tasks: Vec<_> = requests
                .into_iter()
                .map(|r| {
                    let p = p.clone();
                    tokio::spawn(async move {
                        if add {
                            p.add(&intent(r)).await
                        } else {
                            p.remove(&intent(r)).await
                        }
                    })
                })
                .collect();
            async move {
                for task in tasks {
                    task.await.unwrap();
                }
            }
        };
        at_once((1..=200).collect(), true).await;
        let writes = p.writes.load(Relaxed);
        assert!((1..=10).contains(&writes), "{writes} writes for 200 adds");
        assert_eq!(PendingAbandons::open(dir.path()).loaded().len(), 200);
        at_once((1..=200).filter(|r| r % 2 == 0).collect(), false).await;
        assert!(p.writes.load(Relaxed) - writes <= 10);
        let left = PendingAbandons::open(dir.path()).loaded();
        assert_eq!(
            left,
            (1..=200)
                .filter(|r| r % 2 == 1)
                .map(intent)
                .collect::<Vec<_>>()
        );
    }

    /// A file written before session secrets (format 1) is still taken up, with secret 0.
    #[test]
    fn a_format_1_file_is_read_with_secret_0() {
        let v1: Vec<(u32, u64, u64, String, u64)> = vec![(0, 7, 3, "a/b".into(), 99)];
        let mut bytes = vec![1u8];
        bytes.extend(postcard::to_allocvec(&v1).unwrap());
        bytes.extend(crc32fast::hash(&bytes).to_le_bytes());
        assert_eq!(
            PendingAbandons::decode(&bytes).unwrap(),
            vec![Intent {
                secret: 0,
                ..intent(3)
            }]
        );
    }
}
