//! The Raft log of each group, kept in memory and made durable in the server's shared [`holdfast_wal::Wal`].
//!
//! Entries live in memory between snapshots (the log is purged after each snapshot, so this is bounded by
//! the snapshot policy) and every change is a WAL record tagged with the group:
//!
//! | kind | record | sticky |
//! |---|---|---|
//! | 1 | an entry (postcard), `index` = its log index | no |
//! | 2 | truncate: delete entries after `index` | no |
//! | 3 | the vote (postcard) | yes |
//! | 4 | purged up to this log id (postcard) | yes |
//! | 5 | committed log id (postcard), a hint that speeds up restart | yes |
//!
//! Invariant: an append is reported flushed to openraft only after its WAL frame is fsynced, and the vote is
//! durable before `save_vote` returns. Entries are visible to readers as soon as `append` returns, as
//! openraft requires.

use crate::raft_types::{Entry, LogId, TypeConfig, Vote};
use holdfast_wal::{Record, Wal, WalError};
use openraft::storage::{IOFlushed, LogState, RaftLogReader, RaftLogStorage};
use openraft::OptionalSend;
use std::collections::BTreeMap;
use std::fmt::Debug;
use std::io;
use std::ops::RangeBounds;
use std::sync::{Arc, Mutex};

const KIND_ENTRY: u8 = 1;
const KIND_TRUNCATE: u8 = 2;
const KIND_VOTE: u8 = 3;
const KIND_PURGED: u8 = 4;
const KIND_COMMITTED: u8 = 5;

/// The in-memory state of one group's log.
#[derive(Default)]
pub struct GroupLog {
    entries: BTreeMap<u64, Entry>,
    vote: Option<Vote>,
    purged: Option<LogId>,
    committed: Option<LogId>,
}

impl GroupLog {
    /// Replays this group's WAL records (in order) into a log.
    pub fn replay<'a>(records: impl Iterator<Item = &'a Record>) -> Result<GroupLog, String> {
        let mut log = GroupLog::default();
        for r in records {
            match r.kind {
                KIND_ENTRY => {
                    let entry: Entry = decode(&r.payload)?;
                    // An append overwrites any suffix from this index on.
                    log.entries.split_off(&r.index);
                    log.entries.insert(r.index, entry);
                }
                KIND_TRUNCATE => {
                    log.entries.split_off(&(r.index + 1));
                }
                KIND_VOTE => log.vote = Some(decode(&r.payload)?),
                KIND_PURGED => {
                    let purged: LogId = decode(&r.payload)?;
                    log.entries = log.entries.split_off(&(purged.index + 1));
                    log.purged = Some(purged);
                }
                KIND_COMMITTED => log.committed = Some(decode(&r.payload)?),
                other => return Err(format!("unknown wal record kind {other}")),
            }
        }
        // The committed hint may run ahead of what this server has on disk; never point past the log.
        let last = log.last_log_id();
        if log.committed > last {
            log.committed = last;
        }
        Ok(log)
    }

    fn last_log_id(&self) -> Option<LogId> {
        self.entries
            .values()
            .next_back()
            .map(|e| e.log_id)
            .or(self.purged)
    }
}

fn decode<T: serde::de::DeserializeOwned>(bytes: &[u8]) -> Result<T, String> {
    postcard::from_bytes(bytes).map_err(|e| format!("wal record does not decode: {e}"))
}

fn encode<T: serde::Serialize>(value: &T) -> Vec<u8> {
    postcard::to_allocvec(value).expect("encoding to a Vec cannot fail")
}

fn wal_io(e: WalError) -> io::Error {
    io::Error::other(e)
}

/// One group's log store. Cloning gives another handle on the same log (used as the log reader).
#[derive(Clone)]
pub struct LogStore {
    group: u32,
    log: Arc<Mutex<GroupLog>>,
    wal: Arc<Wal>,
}

impl LogStore {
    pub fn new(group: u32, log: GroupLog, wal: Arc<Wal>) -> Self {
        LogStore {
            group,
            log: Arc::new(Mutex::new(log)),
            wal,
        }
    }

    fn record(&self, kind: u8, sticky: bool, index: u64, payload: Vec<u8>) -> Record {
        Record {
            group: self.group,
            kind,
            sticky,
            index,
            payload,
        }
    }

    /// Appends records and waits until they are durable, without blocking the async runtime.
    async fn write_durable(&self, records: Vec<Record>) -> io::Result<()> {
        let (tx, rx) = tokio::sync::oneshot::channel();
        self.wal
            .append(records, Box::new(move |r| drop(tx.send(r))));
        rx.await
            .map_err(|_| io::Error::other("wal writer stopped"))?
            .map_err(wal_io)
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, GroupLog> {
        self.log.lock().expect("group log lock poisoned")
    }
}

impl RaftLogReader<TypeConfig> for LogStore {
    async fn try_get_log_entries<RB: RangeBounds<u64> + Clone + Debug + OptionalSend>(
        &mut self,
        range: RB,
    ) -> Result<Vec<Entry>, io::Error> {
        Ok(self
            .lock()
            .entries
            .range(range)
            .map(|(_, e)| e.clone())
            .collect())
    }

    async fn read_vote(&mut self) -> Result<Option<Vote>, io::Error> {
        Ok(self.lock().vote)
    }
}

impl RaftLogStorage<TypeConfig> for LogStore {
    type LogReader = LogStore;

    async fn get_log_state(&mut self) -> Result<LogState<TypeConfig>, io::Error> {
        let log = self.lock();
        Ok(LogState {
            last_purged_log_id: log.purged,
            last_log_id: log.last_log_id(),
        })
    }

    async fn get_log_reader(&mut self) -> Self::LogReader {
        self.clone()
    }

    async fn save_vote(&mut self, vote: &Vote) -> Result<(), io::Error> {
        self.write_durable(vec![self.record(KIND_VOTE, true, 0, encode(vote))])
            .await?;
        self.lock().vote = Some(*vote);
        Ok(())
    }

    async fn save_committed(&mut self, committed: Option<LogId>) -> Result<(), io::Error> {
        // Only a restart-speed hint: written with the next group commit, not waited for.
        if let Some(c) = committed {
            self.lock().committed = Some(c);
            self.wal.append(
                vec![self.record(KIND_COMMITTED, true, 0, encode(&c))],
                Box::new(|_| {}),
            );
        }
        Ok(())
    }

    async fn read_committed(&mut self) -> Result<Option<LogId>, io::Error> {
        Ok(self.lock().committed)
    }

    async fn append<I>(
        &mut self,
        entries: I,
        callback: IOFlushed<TypeConfig>,
    ) -> Result<(), io::Error>
    where
        I: IntoIterator<Item = Entry> + OptionalSend,
        I::IntoIter: OptionalSend,
    {
        let mut records = Vec::new();
        {
            let mut log = self.lock();
            for entry in entries {
                let index = entry.log_id.index;
                records.push(self.record(KIND_ENTRY, false, index, encode(&entry)));
                log.entries.split_off(&index);
                log.entries.insert(index, entry);
            }
        }
        self.wal.append(
            records,
            Box::new(move |r| callback.io_completed(r.map_err(wal_io))),
        );
        Ok(())
    }

    async fn truncate_after(&mut self, last_log_id: Option<LogId>) -> Result<(), io::Error> {
        let keep_through = last_log_id.map_or(0, |l| l.index);
        self.write_durable(vec![self.record(
            KIND_TRUNCATE,
            false,
            keep_through,
            Vec::new(),
        )])
        .await?;
        self.lock().entries.split_off(&(keep_through + 1));
        Ok(())
    }

    async fn purge(&mut self, log_id: LogId) -> Result<(), io::Error> {
        {
            let mut log = self.lock();
            log.entries = log.entries.split_off(&(log_id.index + 1));
            log.purged = Some(log_id);
        }
        self.write_durable(vec![self.record(KIND_PURGED, true, 0, encode(&log_id))])
            .await?;
        self.wal.release(self.group, log_id.index);
        Ok(())
    }
}
