//! The Raft state machine of one group: applies committed entries to the [`LockTable`] and manages its
//! snapshots.
//!
//! The table lives in [`SmState`] behind an `RwLock` shared with the gRPC layer, which reads it after a
//! linearizability check (ReadIndex). Apply takes the write lock per entry and reports the table's events
//! (grants, ended sessions) to the group's [`EventSink`] while still holding it, so a reader of the table
//! and the stream of events always agree on the order of changes.
//!
//! A group this server does not lead and that has been idle a while can be *unloaded*
//! ([`Unloader::unload`]): once its newest snapshot is exactly its applied state, the in-memory table is
//! dropped and [`SmState::unloaded`] names that snapshot. The next entry to apply (or a build, or an
//! installed snapshot) finds it there: apply reloads the table from that file first, a build returns
//! that snapshot, an install replaces it. So an unloaded group is the same state machine, kept on disk
//! instead of in memory; it is how a server that left a group (`holdfast member place`) gives back the
//! group's memory without forgetting anything it would need if it were added back.

use crate::raft_types::{
    Entry, LogId, Request, Response, Snapshot, SnapshotData, SnapshotMeta, StoredMembership,
    TypeConfig,
};
use crate::snapshot_store::SnapshotStore;
use futures::{Stream, TryStreamExt};
use holdfast_lock_table::{Event, LockTable};
use openraft::storage::{EntryResponder, RaftSnapshotBuilder, RaftStateMachine};
use openraft::{EntryPayload, OptionalSend};
use std::io;
use std::path::PathBuf;
use std::sync::{Arc, Mutex, RwLock};

/// Sessions or locks encoded per step of a snapshot build, under the state lock: the longest an apply
/// waits for a build (it used to wait for the whole encode: ~114 ms at 1,000,000 locks). Locks encode
/// at ~100 ns each, so a chunk of them takes about half a millisecond; a session with a full dedup
/// window costs more (not measured on its own). The simulation's tables are small, so it takes three at a time there,
/// to have entries applied between the chunks of nearly every snapshot.
const SNAPSHOT_CHUNK_ENTRIES: usize = if cfg!(holdfast_sim) { 3 } else { 4096 };

/// Receives the lock table's events after each applied entry (under the state lock).
pub type EventSink = Arc<dyn Fn(&SmState, Vec<Event>) + Send + Sync>;

/// The applied state of a group.
pub struct SmState {
    pub table: LockTable,
    pub last_applied: Option<LogId>,
    pub membership: StoredMembership,
    /// Recent lock changes, for watches (see [`crate::watch`]).
    pub history: crate::watch::History,
    /// The applied index, published after each batch of applies (watchers wait on it).
    pub applied_tx: tokio::sync::watch::Sender<u64>,
    /// Set while the table is on disk only (see the module docs): `table` is then empty, and this says
    /// which snapshot holds it and what it held.
    pub unloaded: Option<Unloaded>,
    /// Times the table was unloaded and loaded back since this server started (metrics).
    pub unloads: u64,
    pub reloads: u64,
}

/// Tables loaded back in this process (the simulation counts them per seed; it resets this first).
#[cfg(holdfast_sim)]
pub static SIM_RELOADS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// An unloaded table: the snapshot that holds it (at exactly `SmState::last_applied`) and its figures
/// as they were, so that status and metrics go on reporting them without reading the file.
#[derive(Clone, Debug)]
pub struct Unloaded {
    pub path: PathBuf,
    pub sessions: u64,
    pub locks: u64,
    pub waiters: u64,
    pub table_bytes: u64,
    pub table_budget: u64,
    pub digest: u64,
}

/// The figures of a group's table, loaded or not.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TableFigures {
    pub sessions: u64,
    pub locks: u64,
    pub waiters: u64,
    pub table_bytes: u64,
    pub table_budget: u64,
}

impl SmState {
    /// The table's figures: counted from the table, or as they were when it was unloaded.
    pub fn figures(&self) -> TableFigures {
        match &self.unloaded {
            Some(u) => TableFigures {
                sessions: u.sessions,
                locks: u.locks,
                waiters: u.waiters,
                table_bytes: u.table_bytes,
                table_budget: u.table_budget,
            },
            None => TableFigures {
                sessions: self.table.session_count() as u64,
                locks: self.table.lock_count() as u64,
                waiters: self.table.waiter_count(),
                table_bytes: self.table.table_bytes(),
                table_budget: self.table.table_budget(),
            },
        }
    }

    /// The table's digest (computed now, or as it was when unloaded).
    pub fn digest(&self) -> u64 {
        match &self.unloaded {
            Some(u) => u.digest,
            None => self.table.digest(),
        }
    }
}

pub struct StateMachine {
    state: Arc<RwLock<SmState>>,
    snapshots: Arc<SnapshotStore>,
    /// The newest snapshot: its meta and its file.
    current: Arc<Mutex<Option<(SnapshotMeta, PathBuf)>>>,
    /// Held while a snapshot is built, so an installed snapshot never replaces the table under a build
    /// (and a second build is refused rather than queued).
    building: Arc<tokio::sync::Mutex<()>>,
    /// Held by each call of `apply` from its reload check to its last entry, so that an unload never
    /// comes between them (an entry would then apply to the emptied table).
    applying: Arc<tokio::sync::Mutex<()>>,
    events: EventSink,
    /// `--audit-log`: one JSON line per applied command, for the fault tests' checker.
    audit: Option<Box<dyn std::io::Write + Send + Sync>>,
    /// When a snapshot that openraft's policy asks for is built, and when it waits.
    pacing: Arc<SnapshotPacing>,
}

/// Paces the snapshots that openraft's policy asks for (every `snapshot_every_entries` entries): one
/// is built only once the log appended since the newest snapshot holds at least `percent`% of that
/// snapshot's bytes; until then openraft's request is deferred (it asks again
/// `snapshot_every_entries` entries later). Why: a snapshot writes the whole table, so at a fixed
/// count of entries its cost per entry grows with the table. At 1,000,000 locks a snapshot is ~34 MB,
/// and every 20,000 entries (~2 s under full load on the development machine) each server encoded
/// and wrote one, with the state lock taken for each of its chunks (docs/performance.md, "Snapshots
/// paced by their size"). With the default 25%, the log kept in memory between snapshots grows to
/// about a quarter of the snapshot's size (or `snapshot_every_entries` entries, whichever is more),
/// plus up to `snapshot_every_entries` entries, since a deferred snapshot is asked for again only
/// that many entries later; `snapshot_every_bytes` caps it when set. A group that goes quiet with a
/// snapshot waiting is not asked again: `node::compact_pinning_groups` snapshots it when its log
/// keeps the oldest WAL segment ([`SnapshotPacing::would_defer`]).
///
/// A snapshot someone asked for (to free a WAL segment, to unload a group, at `snapshot_every_bytes`)
/// is never deferred: its caller says so with [`SnapshotPacing::force`] first.
pub struct SnapshotPacing {
    /// The group's log bytes appended since this server started, plus those it replayed after its
    /// snapshot (`LogStore`'s counter).
    log_bytes: Arc<std::sync::atomic::AtomicU64>,
    /// 0: never deferred.
    percent: u64,
    /// The log bytes counter when the newest snapshot was built, installed or loaded, and that
    /// snapshot's size in bytes.
    mark: Mutex<(u64, u64)>,
    /// The next build is not deferred.
    forced: std::sync::atomic::AtomicBool,
    /// Builds deferred so far (`holdfast_snapshots_deferred_total`).
    pub deferred: std::sync::atomic::AtomicU64,
}

impl SnapshotPacing {
    pub fn new(log_bytes: Arc<std::sync::atomic::AtomicU64>, percent: u64) -> Self {
        SnapshotPacing {
            log_bytes,
            percent,
            mark: Mutex::new((0, 0)),
            forced: Default::default(),
            deferred: Default::default(),
        }
    }

    /// The next snapshot build goes ahead, whatever the log's size.
    pub fn force(&self) {
        self.forced
            .store(true, std::sync::atomic::Ordering::Release);
    }

    /// Whether a build the policy asked for waits (and counts it if so).
    fn defer(&self) -> bool {
        use std::sync::atomic::Ordering::{AcqRel, Relaxed};
        if self.forced.swap(false, AcqRel) {
            return false;
        }
        let wait = self.would_defer();
        if wait {
            self.deferred.fetch_add(1, Relaxed);
        }
        wait
    }

    /// Whether a build the policy asked for now would wait for a longer log.
    pub fn would_defer(&self) -> bool {
        let (at, size) = *self.mark.lock().expect("snapshot pacing lock");
        let since = self.log_bytes_now().saturating_sub(at);
        since.saturating_mul(100) < size.saturating_mul(self.percent)
    }

    /// The log bytes counter when the newest snapshot was begun (0 for the one loaded at start).
    pub fn begun(&self) -> u64 {
        self.mark.lock().expect("snapshot pacing lock").0
    }

    fn log_bytes_now(&self) -> u64 {
        self.log_bytes.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// A snapshot of `size` bytes, begun when the log bytes counter read `begun`, is the newest now:
    /// the log appended while it was written counts toward the next one.
    fn made(&self, begun: u64, size: u64) {
        *self.mark.lock().expect("snapshot pacing lock") = (begun, size);
    }
}

/// One line of the audit log: what an applied entry did on this replica.
#[derive(serde::Serialize, serde::Deserialize, Debug, Clone, PartialEq, Eq)]
pub struct AuditLine {
    pub index: u64,
    pub command: holdfast_lock_table::Command,
    pub outcome: holdfast_lock_table::Outcome,
    pub events: Vec<holdfast_lock_table::Event>,
    /// What the entry did to locks (what watchers receive); absent in lines of older servers.
    #[serde(default)]
    pub changes: Vec<holdfast_lock_table::Change>,
}

impl StateMachine {
    /// Appends a JSON line per applied command to `path` (created, or appended to after a restart, when
    /// re-applied entries are written again).
    pub fn with_audit_log(self, path: &std::path::Path) -> std::io::Result<Self> {
        let file = holdfast_wal::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(path)?;
        Ok(self.with_audit_writer(Box::new(std::io::BufWriter::new(file))))
    }

    /// Writes the audit lines to `out` instead of a file (the simulation collects them in memory).
    pub fn with_audit_writer(mut self, out: Box<dyn std::io::Write + Send + Sync>) -> Self {
        self.audit = Some(out);
        self
    }
    /// Restores the newest snapshot on disk (if any); openraft then re-applies the committed log after it.
    pub fn open(
        snapshots: SnapshotStore,
        events: EventSink,
        pacing: Arc<SnapshotPacing>,
    ) -> Result<(Self, Arc<RwLock<SmState>>), String> {
        let mut state = SmState {
            table: LockTable::new(),
            last_applied: None,
            membership: StoredMembership::default(),
            history: crate::watch::History::new(0),
            applied_tx: tokio::sync::watch::Sender::new(0),
            unloaded: None,
            unloads: 0,
            reloads: 0,
        };
        let mut current = None;
        if let Some((path, bytes)) = snapshots
            .latest()
            .map_err(|e| format!("cannot read snapshots: {e}"))?
        {
            let loaded = SnapshotStore::decode(&bytes).map_err(|e| {
                format!(
                    "snapshot {} is unusable: {e}; refusing to start",
                    path.display()
                )
            })?;
            state.table = loaded.table;
            state.last_applied = loaded.meta.last_log_id;
            state.membership = loaded.meta.last_membership.clone();
            let index = state.last_applied.map_or(0, |l| l.index);
            state.history = crate::watch::History::new(index);
            state.applied_tx.send_replace(index);
            // The counter starts at the size of the log replayed after this snapshot (`Node::start`).
            pacing.made(0, bytes.len() as u64);
            current = Some((loaded.meta, path));
        }
        let state = Arc::new(RwLock::new(state));
        let sm = StateMachine {
            state: state.clone(),
            snapshots: Arc::new(snapshots),
            current: Arc::new(Mutex::new(current)),
            building: Arc::new(tokio::sync::Mutex::new(())),
            applying: Arc::new(tokio::sync::Mutex::new(())),
            events,
            audit: None,
            pacing,
        };
        Ok((sm, state))
    }

    /// What a group's upkeep needs to unload this state machine's table.
    pub fn unloader(&self) -> Unloader {
        Unloader {
            state: self.state.clone(),
            current: self.current.clone(),
            building: self.building.clone(),
            applying: self.applying.clone(),
        }
    }

    /// Loads an unloaded table back from its snapshot before anything changes it.
    async fn reload_if_unloaded(&mut self) -> Result<(), io::Error> {
        let Some(unloaded) = read(&self.state).unloaded.clone() else {
            return Ok(());
        };
        let path = unloaded.path.clone();
        let loaded = crate::blocking(move || {
            let bytes = SnapshotStore::read(&path)?;
            SnapshotStore::decode(&bytes).map_err(|e| {
                io::Error::other(format!(
                    "cannot reload the unloaded table from {}: {e}",
                    path.display()
                ))
            })
        })
        .await?;
        let mut s = self.state.write().expect("state machine lock poisoned");
        // Only apply and installs (this task, serially) change an unloaded state: it is still the one read.
        if loaded.meta.last_log_id != s.last_applied {
            return Err(io::Error::other(format!(
                "the unloaded table's snapshot {} is at {:?}, the applied state at {:?}",
                unloaded.path.display(),
                loaded.meta.last_log_id,
                s.last_applied
            )));
        }
        s.table = loaded.table;
        s.unloaded = None;
        s.reloads += 1;
        #[cfg(holdfast_sim)]
        SIM_RELOADS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        tracing::info!(
            index = s.last_applied.map_or(0, |l| l.index),
            locks = unloaded.locks,
            "reloaded the table from its snapshot"
        );
        Ok(())
    }
}

/// Unloads a group's table (see the module docs). Cloned from [`StateMachine::unloader`].
#[derive(Clone)]
pub struct Unloader {
    state: Arc<RwLock<SmState>>,
    current: Arc<Mutex<Option<(SnapshotMeta, PathBuf)>>>,
    building: Arc<tokio::sync::Mutex<()>>,
    applying: Arc<tokio::sync::Mutex<()>>,
}

/// Hands the memory glibc keeps in its arenas after a large free back to the kernel: after a table is
/// unloaded or replaced by an installed snapshot, both rare. Without it a server that unloaded tables
/// kept its resident memory as it was (measured: 362-396 MB per server before, 363-401 MB after each
/// unloaded one or two of four groups' tables of 250,000 locks; with it 317-383 MB,
/// docs/performance.md). Not after every snapshot build: that saved 2-4 MB on a leader holding 1M
/// locks, and cost a quarter of the throughput at 64 clients (a build every ~1.5 s there).
#[cfg(all(target_os = "linux", target_env = "gnu"))]
#[allow(
    unsafe_code,
    reason = "malloc_trim(3): glibc's own call to return free memory, after a table is freed"
)]
fn trim_heap() {
    // SAFETY: malloc_trim has no preconditions; it only returns free pages of the arenas to the
    // kernel and touches no allocated block.
    unsafe {
        libc::malloc_trim(0);
    }
}

#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
fn trim_heap() {}

/// Why [`Unloader::unload`] did not unload.
#[derive(Debug, PartialEq, Eq)]
pub enum NotUnloaded {
    /// Already unloaded.
    Already,
    /// No snapshot is at the applied state (yet): build one first.
    NoSnapshotAtApplied,
    /// A snapshot is being built, or entries applied.
    Busy,
    /// This server leads the group.
    Leading,
}

impl Unloader {
    /// Drops the table from memory if the newest snapshot holds exactly the applied state and
    /// `not_leading()` (asked under the state lock) is true; returns how many locks it held. Blocking (it
    /// digests and frees the table): call it on the blocking pool.
    ///
    /// Why not on a leader: a leader reads its table without applying anything first (linearizable
    /// reads, session timers). A server elected after `not_leading` answered still applies its term's
    /// first entry before it reads, and that apply loads the table back; one elected before has that
    /// entry applied already, so its applied state is newer than the snapshot unless a snapshot was
    /// built since, while `not_leading` still said so (openraft publishes the new role long before).
    pub fn unload(&self, not_leading: impl Fn() -> bool) -> Result<u64, NotUnloaded> {
        // Never under a build (it reads the table it froze), nor between an apply's reload check and
        // its entries.
        let (Ok(_building), Ok(_applying)) = (self.building.try_lock(), self.applying.try_lock())
        else {
            return Err(NotUnloaded::Busy);
        };
        let current = self.current.lock().expect("snapshot meta lock").clone();
        let old = {
            let mut s = self.state.write().expect("state machine lock poisoned");
            if s.unloaded.is_some() {
                return Err(NotUnloaded::Already);
            }
            let Some((meta, path)) = current else {
                return Err(NotUnloaded::NoSnapshotAtApplied);
            };
            if s.last_applied.is_none() || meta.last_log_id != s.last_applied {
                return Err(NotUnloaded::NoSnapshotAtApplied);
            }
            if !not_leading() {
                return Err(NotUnloaded::Leading);
            }
            let f = s.figures();
            s.unloaded = Some(Unloaded {
                path,
                sessions: f.sessions,
                locks: f.locks,
                waiters: f.waiters,
                table_bytes: f.table_bytes,
                table_budget: f.table_budget,
                digest: s.table.digest(),
            });
            s.unloads += 1;
            std::mem::replace(&mut s.table, LockTable::new())
        };
        let locks = old.lock_count() as u64;
        // Freed here, outside the state lock.
        drop(old);
        trim_heap();
        Ok(locks)
    }

    /// True while the table is unloaded.
    pub fn is_unloaded(&self) -> bool {
        read(&self.state).unloaded.is_some()
    }
}

fn read(state: &RwLock<SmState>) -> std::sync::RwLockReadGuard<'_, SmState> {
    state.read().expect("state machine lock poisoned")
}

impl RaftStateMachine<TypeConfig> for StateMachine {
    type SnapshotData = SnapshotData;
    type SnapshotBuilder = SnapshotBuilder;

    async fn applied_state(&mut self) -> Result<(Option<LogId>, StoredMembership), io::Error> {
        let s = read(&self.state);
        Ok((s.last_applied, s.membership.clone()))
    }

    async fn apply<Strm>(&mut self, mut entries: Strm) -> Result<(), io::Error>
    where
        Strm: Stream<Item = Result<EntryResponder<TypeConfig>, io::Error>> + Unpin + OptionalSend,
    {
        let applying = self.applying.clone();
        let _applying = applying.lock().await;
        self.reload_if_unloaded().await?;
        while let Some((entry, responder)) = entries.try_next().await? {
            tracing::trace!(target: "holdfast::hop", index = entry.log_id.index, "apply");
            let audited = match (&self.audit, &entry.payload) {
                (Some(_), EntryPayload::Normal(Request(command))) => {
                    Some((entry.log_id.index, command.clone()))
                }
                _ => None,
            };
            let response = {
                let mut s = self.state.write().expect("state machine lock poisoned");
                let index = entry.log_id.index;
                let response = apply_one(&mut s, entry);
                let changes = s.table.take_changes();
                let audited_changes = match (&self.audit, &audited) {
                    (Some(_), Some(_)) => changes.clone(),
                    _ => Vec::new(),
                };
                s.history.record(index, changes);
                let events = s.table.take_events();
                let outcome = match &response {
                    Response::Outcome(o) | Response::Opened { outcome: o, .. } => Some(o),
                    Response::None => None,
                };
                if let (Some((index, command)), Some(audit), Some(outcome)) =
                    (audited, self.audit.as_mut(), outcome)
                {
                    // Secrets stay out of the audit log, like every other log.
                    let line = AuditLine {
                        index,
                        command: command.without_secrets(),
                        outcome: outcome.clone(),
                        events: events.iter().map(redacted).collect(),
                        changes: audited_changes,
                    };
                    let written =
                        serde_json::to_writer(&mut *audit, &line).map_err(io::Error::other);
                    if let Err(e) = written.and_then(|()| std::io::Write::write_all(audit, b"\n")) {
                        tracing::warn!(%e, "audit log write failed");
                    }
                }
                if !events.is_empty() {
                    (self.events)(&s, events);
                }
                response
            };
            if let Some(responder) = responder {
                responder.send(response);
            }
        }
        if let Some(audit) = self.audit.as_mut() {
            std::io::Write::flush(audit)?;
        }
        let s = read(&self.state);
        s.applied_tx.send_replace(s.history.applied());
        Ok(())
    }

    async fn try_create_snapshot_builder(&mut self, force: bool) -> Option<Self::SnapshotBuilder> {
        // A build under way already writes a snapshot at most a few thousand entries old: a second
        // one would only double the work (openraft asks again later). A forced build waits its turn.
        let guard = match self.building.clone().try_lock_owned() {
            Ok(guard) => Some(guard),
            Err(_) if force => None,
            Err(_) => return None,
        };
        if !force && self.pacing.defer() {
            tracing::debug!("snapshot deferred: the log since the last one is small beside it");
            return None;
        }
        Some(SnapshotBuilder {
            state: self.state.clone(),
            snapshots: self.snapshots.clone(),
            current: self.current.clone(),
            building: self.building.clone(),
            guard,
            pacing: self.pacing.clone(),
        })
    }

    async fn get_snapshot_builder(&mut self) -> Self::SnapshotBuilder {
        SnapshotBuilder {
            state: self.state.clone(),
            snapshots: self.snapshots.clone(),
            current: self.current.clone(),
            building: self.building.clone(),
            guard: None,
            pacing: self.pacing.clone(),
        }
    }

    async fn install_snapshot(
        &mut self,
        meta: &SnapshotMeta,
        snapshot: SnapshotData,
    ) -> Result<(), io::Error> {
        let index = meta.last_log_id.map_or(0, |l| l.index);
        let (bytes, table) = match snapshot {
            SnapshotData::Received { bytes, table } => (bytes, table),
            // Not how openraft installs (it passes what the network received), but correct anyway.
            SnapshotData::File(path) => {
                crate::blocking(move || {
                    let bytes = SnapshotStore::read(&path)?;
                    let loaded = SnapshotStore::decode(&bytes).map_err(io::Error::other)?;
                    Ok((bytes, Box::new(loaded.table)))
                })
                .await?
            }
        };
        // Never under a build: it would write the replaced table's snapshot after this one.
        let _building = self.building.lock().await;
        let store = self.snapshots.clone();
        let size = bytes.len() as u64;
        let begun = self.pacing.log_bytes_now();
        let path = crate::blocking(move || {
            store.save(index, &bytes)?;
            Ok(store.path_of(index))
        })
        .await?;
        self.pacing.made(begun, size);
        let old = {
            let mut s = self.state.write().expect("state machine lock poisoned");
            let old = std::mem::replace(&mut s.table, *table);
            s.last_applied = meta.last_log_id;
            s.membership = meta.last_membership.clone();
            s.unloaded = None;
            // Watchers behind the snapshot's index are cut off (COMPACTED): the changes before it are
            // not known here.
            s.history.reset(index);
            s.applied_tx.send_replace(index);
            old
        };
        *self.current.lock().expect("snapshot meta lock") = Some((meta.clone(), path));
        // Freeing a large table takes a while: not under the state lock, not on the runtime.
        crate::blocking(move || {
            drop(old);
            trim_heap();
            Ok(())
        })
        .await?;
        tracing::info!(?meta.last_log_id, "installed snapshot from the leader");
        Ok(())
    }

    async fn get_current_snapshot(&mut self) -> Result<Option<Snapshot>, io::Error> {
        Ok(self
            .current
            .lock()
            .expect("snapshot meta lock")
            .clone()
            .map(|(meta, path)| Snapshot {
                meta,
                snapshot: SnapshotData::File(path),
            }))
    }
}

fn redacted(event: &holdfast_lock_table::Event) -> holdfast_lock_table::Event {
    match event {
        holdfast_lock_table::Event::SessionOpened {
            session, ttl_ms, ..
        } => holdfast_lock_table::Event::SessionOpened {
            session: *session,
            ttl_ms: *ttl_ms,
            secret: 0,
        },
        other => other.clone(),
    }
}

/// Whether the checks too costly for production (a whole-table invariant check and a decode of every
/// snapshot built) run: in debug builds (tests) and in the simulation.
pub const EXPENSIVE_CHECKS: bool = cfg!(any(debug_assertions, holdfast_sim));

fn apply_one(s: &mut SmState, entry: Entry) -> Response {
    let log_id = entry.log_id;
    // Entries are applied once each, in log order, with no gap: anything else means the log or the
    // applied state is corrupt, and applying on would make this replica diverge silently.
    let expected = s.last_applied.map_or(0, |l| l.index + 1);
    assert!(
        log_id.index == expected || (s.last_applied.is_none() && log_id.index > 0),
        "apply out of order: entry {} after {:?}",
        log_id.index,
        s.last_applied
    );
    s.last_applied = Some(log_id);
    match entry.payload {
        EntryPayload::Blank => Response::None,
        EntryPayload::Normal(Request(command)) => {
            // Not behind any I/O: in the simulation the server runs on in memory until its host is
            // crashed at the end of the step (see `holdfast_wal::failpoint`).
            let _ = holdfast_wal::failpoint::hit("apply");
            let outcome = s.table.apply(log_id.index, &command);
            let opened = match &*command {
                holdfast_lock_table::Command::Quota { command, .. } => &**command,
                other => other,
            };
            match (opened, &outcome) {
                (
                    holdfast_lock_table::Command::OpenSessionWithSecret { .. },
                    holdfast_lock_table::Outcome::SessionOpened { session, .. },
                ) => Response::Opened {
                    secret: s.table.session_secret(*session).unwrap_or(0),
                    outcome,
                },
                _ => Response::Outcome(outcome),
            }
        }
        EntryPayload::Membership(m) => {
            s.membership = StoredMembership::new(Some(log_id), m);
            Response::None
        }
    }
}

/// Builds a snapshot of the state at one applied index while entries go on being applied: the table is
/// encoded [`SNAPSHOT_CHUNK_ENTRIES`] at a time under the state lock (copy-on-write keeps what changes
/// meanwhile as it was), on the blocking pool, straight into the snapshot file.
pub struct SnapshotBuilder {
    state: Arc<RwLock<SmState>>,
    snapshots: Arc<SnapshotStore>,
    pacing: Arc<SnapshotPacing>,
    current: Arc<Mutex<Option<(SnapshotMeta, PathBuf)>>>,
    building: Arc<tokio::sync::Mutex<()>>,
    /// Taken when the builder was created (a forced build takes it when it starts).
    guard: Option<tokio::sync::OwnedMutexGuard<()>>,
}

/// Thaws the table (`LockTable::snapshot_abort`) when dropped while armed.
struct Unfreeze<'a>(Option<&'a RwLock<SmState>>);

impl Drop for Unfreeze<'_> {
    fn drop(&mut self) {
        if let Some(state) = self.0 {
            if let Ok(mut s) = state.write() {
                s.table.snapshot_abort();
            }
        }
    }
}

impl RaftSnapshotBuilder<TypeConfig> for SnapshotBuilder {
    type SnapshotData = SnapshotData;

    async fn build_snapshot(&mut self) -> Result<Snapshot, io::Error> {
        let _building = match self.guard.take() {
            Some(guard) => guard,
            None => self.building.clone().lock_owned().await,
        };
        // An unloaded table is its newest snapshot, at the applied state: nothing newer to build.
        let unloaded_at = {
            let s = self.state.read().expect("state machine lock poisoned");
            s.unloaded.as_ref().map(|_| s.last_applied)
        };
        if let Some(applied) = unloaded_at {
            if let Some((meta, path)) = self.current.lock().expect("snapshot meta lock").clone() {
                if meta.last_log_id == applied {
                    return Ok(Snapshot {
                        meta,
                        snapshot: SnapshotData::File(path),
                    });
                }
            }
            return Err(io::Error::other(
                "an unloaded table's snapshot is no longer the newest one",
            ));
        }
        let (meta, mut writer, header, digest) = {
            let mut s = self.state.write().expect("state machine lock poisoned");
            let meta = SnapshotMeta {
                last_log_id: s.last_applied,
                last_membership: s.membership.clone(),
            };
            // Debug builds and the simulation check what is written against the table now.
            let digest = EXPENSIVE_CHECKS.then(|| s.table.digest());
            let mut header = Vec::new();
            let writer = s.table.snapshot_begin(&mut header);
            (meta, writer, header, digest)
        };
        let begun = self.pacing.log_bytes_now();
        // From here until the last chunk the table keeps copies of what changes; however the build
        // ends early (an error, or its task dropped), it must stop.
        let mut unfreeze = Unfreeze(Some(&self.state));
        let index = meta.last_log_id.map_or(0, |l| l.index);
        let written = async {
            let store = self.snapshots.clone();
            let for_file = meta.clone();
            let mut file = crate::blocking(move || {
                let mut file = store.create(&for_file)?;
                match file.write(&header) {
                    Ok(()) => Ok(file),
                    Err(e) => {
                        file.discard();
                        Err(e)
                    }
                }
            })
            .await?;
            loop {
                let state = self.state.clone();
                let (back, done) = crate::blocking(move || {
                    let mut chunk = Vec::with_capacity(SNAPSHOT_CHUNK_ENTRIES * 64);
                    let done = state
                        .write()
                        .expect("state machine lock poisoned")
                        .table
                        .snapshot_next(&mut writer, &mut chunk, SNAPSHOT_CHUNK_ENTRIES)
                        .map_err(io::Error::other);
                    let done = done.and_then(|done| file.write(&chunk).map(|()| done));
                    match done {
                        Ok(done) => Ok(((file, writer), done)),
                        Err(e) => {
                            file.discard();
                            Err(e)
                        }
                    }
                })
                .await?;
                (file, writer) = back;
                if done {
                    break;
                }
                // Let the entries waiting for the state lock be applied (the simulation runs the
                // blocking steps inline, so this is where applies come between chunks there).
                tokio::task::yield_now().await;
            }
            let store = self.snapshots.clone();
            crate::blocking(move || {
                file.finish(&store, |written| {
                    let Some(digest) = digest else {
                        return Ok(());
                    };
                    // Never keep (or send) a snapshot that does not read back as the table it was
                    // taken of: checked before it replaces the last good one. An error, not a
                    // panic: openraft builds snapshots in a task of its own, where a panic would be
                    // swallowed, while an error stops the group (and the server) loudly.
                    let loaded =
                        SnapshotStore::decode(&SnapshotStore::read(written)?).map_err(|e| {
                            io::Error::other(format!(
                                "refusing a snapshot that does not read back: {e}"
                            ))
                        })?;
                    if loaded.table.digest() != digest {
                        return Err(io::Error::other(
                            "refusing a snapshot that reads back as another table",
                        ));
                    }
                    Ok(())
                })
            })
            .await
        }
        .await;
        let (path, len) = written?;
        // The last chunk thawed the table.
        unfreeze.0 = None;
        *self.current.lock().expect("snapshot meta lock") = Some((meta.clone(), path.clone()));
        self.pacing.made(begun, len);
        tracing::info!(index, bytes = len, "built snapshot");
        Ok(Snapshot {
            meta,
            snapshot: SnapshotData::File(path),
        })
    }
}

#[cfg(test)]
mod pacing_tests {
    use super::SnapshotPacing;
    use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
    use std::sync::Arc;

    #[test]
    fn a_due_snapshot_waits_for_a_log_of_its_share_of_the_last_one() {
        let log = Arc::new(AtomicU64::new(0));
        let p = SnapshotPacing::new(log.clone(), 25);
        assert!(
            !p.defer(),
            "before any snapshot there is nothing to wait for"
        );
        p.made(0, 1_000);
        log.store(249, Relaxed);
        assert!(p.would_defer());
        assert!(p.defer(), "249 bytes of log beside a snapshot of 1,000");
        log.store(250, Relaxed);
        assert!(!p.would_defer());
        assert!(!p.defer(), "a quarter of its size");
        // Begun at 250 and finished at 300: the 50 bytes written meanwhile count toward the next.
        log.store(300, Relaxed);
        p.made(250, 1_000);
        assert_eq!(p.begun(), 250, "where the size trigger counts from");
        log.store(499, Relaxed);
        assert!(p.defer(), "counted from the newest snapshot's beginning");
        log.store(500, Relaxed);
        assert!(!p.would_defer());
        log.store(400, Relaxed);
        p.force();
        assert!(!p.defer(), "a forced build goes ahead");
        assert!(p.defer(), "once");
        assert_eq!(p.deferred.load(Relaxed), 3, "would_defer counts nothing");

        let never = SnapshotPacing::new(log, 0);
        never.made(0, u64::MAX);
        assert!(!never.defer(), "0% never waits");
    }
}
