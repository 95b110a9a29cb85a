//! The Raft log of each group, kept in memory and made durable in the server's shared [`holdfast_wal::Wal`].
//!
//! Entries live in memory between snapshots (the log is purged after each snapshot, so this is bounded by
//! the snapshot policy) and every change is a WAL record tagged with the group. Records are written in
//! format 1 and format-0 records (Holdfast 0.1) are still read; see [`crate::formats`]:
//!
//! | kind (format 1 / 0) | record | sticky |
//! |---|---|---|
//! | 11 / 1 | an entry, `index` = its log index | no |
//! | 12 / 2 | truncate: delete entries after `index` | no |
//! | 13 / 3 | the vote | yes |
//! | 14 / 4 | purged up to this log id | yes |
//! | 15 / 5 | committed log id, a hint that speeds up restart | yes |
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

use crate::formats::{self, kind};
use holdfast_proto::v1 as pb;

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
                kind::ENTRY | kind::LEGACY_ENTRY => {
                    let entry = if r.kind == kind::ENTRY {
                        formats::entry_from_pb(&formats::from_bytes(&r.payload, "wal entry")?)?
                    } else {
                        formats::legacy::entry(&r.payload)?
                    };
                    if entry.log_id.index != r.index {
                        return Err(format!(
                            "wal entry record at index {} holds entry {}",
                            r.index, entry.log_id.index
                        ));
                    }
                    // An append overwrites any suffix from this index on.
                    log.entries.split_off(&r.index);
                    log.entries.insert(r.index, entry);
                }
                kind::TRUNCATE | kind::LEGACY_TRUNCATE => {
                    log.entries.split_off(&(r.index + 1));
                }
                kind::VOTE => {
                    log.vote = Some(formats::vote_from_pb(&formats::from_bytes::<pb::Vote>(
                        &r.payload, "wal vote",
                    )?))
                }
                kind::LEGACY_VOTE => log.vote = Some(formats::legacy::vote(&r.payload)?),
                kind::PURGED | kind::LEGACY_PURGED => {
                    let purged = decode_log_id(r)?;
                    log.entries = log.entries.split_off(&(purged.index + 1));
                    log.purged = Some(purged);
                }
                kind::COMMITTED | kind::LEGACY_COMMITTED => log.committed = Some(decode_log_id(r)?),
                other => {
                    return Err(format!(
                        "unknown wal record kind {other} (written by a newer holdfast?)"
                    ))
                }
            }
        }
        // openraft keeps a log without holes, so a gap between the entries replayed means a lost or
        // misplaced record (defence in depth behind the WAL's checksums). Checked on the log as replayed,
        // not record by record: a gap that a later purge or truncation removed harmed nothing. The first
        // entry is not checked against the purge point: once older segments are deleted, it may follow a
        // purge point that a later sticky record has since moved.
        let mut indexes = log.entries.keys();
        if let Some(mut before) = indexes.next().copied() {
            for &index in indexes {
                if before + 1 != index {
                    return Err(format!(
                        "wal entry record at index {index} follows entry {before}: a gap in the log"
                    ));
                }
                before = index;
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

fn decode_log_id(r: &Record) -> Result<LogId, String> {
    if r.kind >= kind::ENTRY {
        Ok(formats::log_id_from_pb(&formats::from_bytes::<pb::LogId>(
            &r.payload,
            "wal log id",
        )?))
    } else {
        formats::legacy::log_id_record(&r.payload)
    }
}

fn encode_log_id(l: &LogId) -> Vec<u8> {
    formats::to_bytes(&formats::log_id_to_pb(l))
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
    /// Bytes of entry records appended so far (monotonic): the server snapshots a group by log size too.
    appended_bytes: Arc<std::sync::atomic::AtomicU64>,
}

impl LogStore {
    pub fn new(
        group: u32,
        log: GroupLog,
        wal: Arc<Wal>,
        appended_bytes: Arc<std::sync::atomic::AtomicU64>,
    ) -> Self {
        // What was purged before a restart stays released, or its segments would never be deleted.
        if let Some(purged) = log.purged {
            wal.release(group, purged.index);
        }
        LogStore {
            group,
            log: Arc::new(Mutex::new(log)),
            wal,
            appended_bytes,
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
        // A vote never goes back (Raft's safety rests on it): a smaller one means a bug or a state this
        // server must not act on.
        if let Some(old) = self.lock().vote {
            assert!(
                vote.partial_cmp(&old) != Some(std::cmp::Ordering::Less),
                "group {}: vote {vote} is older than the saved {old}",
                self.group
            );
        }
        holdfast_wal::failpoint::hit("vote.save")?;
        self.write_durable(vec![self.record(
            kind::VOTE,
            true,
            0,
            formats::to_bytes(&formats::vote_to_pb(vote)),
        )])
        .await?;
        self.lock().vote = Some(*vote);
        Ok(())
    }

    async fn save_committed(&mut self, committed: Option<LogId>) -> Result<(), io::Error> {
        // Only a restart-speed hint: written with the next append someone waits for, never on its own
        // (on its own it cost every server a second write and fdatasync per entry at low load).
        if let Some(c) = committed {
            self.lock().committed = Some(c);
            self.wal.append_lazy(vec![self.record(
                kind::COMMITTED,
                true,
                0,
                encode_log_id(&c),
            )]);
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
            // Appends continue the log with no gap (they may replace a suffix: openraft truncates a
            // conflict first, and an entry at an index already present replaces it).
            let mut next = log.last_log_id().map_or(0, |l| l.index + 1);
            for entry in entries {
                let index = entry.log_id.index;
                assert!(
                    index <= next,
                    "group {}: append of entry {index} leaves a gap after {}",
                    self.group,
                    next.saturating_sub(1)
                );
                next = index + 1;
                let pb = formats::entry_to_pb(&entry);
                if crate::state_machine::EXPENSIVE_CHECKS {
                    // What goes to disk must read back as the entry (encode and decode are a pair).
                    let back = formats::entry_from_pb(&pb).expect("an entry just encoded decodes");
                    assert!(back == entry, "entry {index} reads back differently");
                }
                records.push(self.record(kind::ENTRY, false, index, formats::to_bytes(&pb)));
                log.entries.split_off(&index);
                log.entries.insert(index, entry);
            }
        }
        let (group, last) = (self.group, records.last().map_or(0, |r| r.index));
        tracing::trace!(target: "holdfast::hop", group, index = last, "log append");
        let bytes: usize = records.iter().map(|r| r.payload.len()).sum();
        self.appended_bytes
            .fetch_add(bytes as u64, std::sync::atomic::Ordering::Relaxed);
        self.wal.append(
            records,
            Box::new(move |r| {
                tracing::trace!(target: "holdfast::hop", group, index = last, "log synced");
                callback.io_completed(r.map_err(wal_io))
            }),
        );
        Ok(())
    }

    async fn truncate_after(&mut self, last_log_id: Option<LogId>) -> Result<(), io::Error> {
        let keep_through = last_log_id.map_or(0, |l| l.index);
        self.write_durable(vec![self.record(
            kind::TRUNCATE,
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
        self.write_durable(vec![self.record(
            kind::PURGED,
            true,
            0,
            encode_log_id(&log_id),
        )])
        .await?;
        self.wal.release(self.group, log_id.index);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::formats::legacy;

    fn record(kind: u8, index: u64, payload: Vec<u8>) -> Record {
        Record {
            group: 0,
            kind,
            sticky: true,
            index,
            payload,
        }
    }

    /// A segment head after an upgrade holds the group's last format-0 sticky records before its format-1
    /// ones (the WAL orders them by kind); replay must end with the newer, format-1 values.
    #[test]
    fn format_1_sticky_records_win_over_the_format_0_ones_before_them() {
        let old_vote = vec![5, 1, 1]; // postcard: term 5, node 1, committed
        assert_eq!(legacy::vote(&old_vote).unwrap(), Vote::new_committed(5, 1));
        let new_vote = Vote::new_committed(7, 2);
        let old_purged = vec![5, 1, 40]; // term 5, node 1, index 40
        let new_purged = crate::formats::log_id_to_pb(&legacy::log_id_record(&[7, 2, 90]).unwrap());
        let records = [
            record(kind::LEGACY_VOTE, 0, old_vote),
            record(kind::LEGACY_PURGED, 0, old_purged),
            record(
                kind::VOTE,
                0,
                formats::to_bytes(&formats::vote_to_pb(&new_vote)),
            ),
            record(kind::PURGED, 0, formats::to_bytes(&new_purged)),
        ];
        let log = GroupLog::replay(records.iter()).unwrap();
        assert_eq!(log.vote, Some(new_vote));
        assert_eq!(log.purged.map(|p| p.index), Some(90));
    }

    #[test]
    fn unknown_kinds_and_misplaced_entries_are_refused() {
        let err = GroupLog::replay([record(99, 0, vec![])].iter())
            .err()
            .unwrap();
        assert!(err.contains("unknown wal record kind 99"), "{err}");
        let entry = Entry {
            log_id: legacy::log_id_record(&[1, 1, 5]).unwrap(),
            payload: openraft::EntryPayload::Blank,
        };
        let bytes = formats::to_bytes(&formats::entry_to_pb(&entry));
        let mut r = record(kind::ENTRY, 6, bytes);
        r.sticky = false;
        let err = GroupLog::replay([r].iter()).err().unwrap();
        assert!(err.contains("at index 6 holds entry 5"), "{err}");
    }

    fn entry_record(index: u64) -> Record {
        let entry = Entry {
            log_id: legacy::log_id_record(&[1, 1, index as u8]).unwrap(),
            payload: openraft::EntryPayload::Blank,
        };
        let mut r = record(
            kind::ENTRY,
            index,
            formats::to_bytes(&formats::entry_to_pb(&entry)),
        );
        r.sticky = false;
        r
    }

    #[test]
    fn a_gap_in_the_replayed_log_is_refused_but_not_after_a_stale_purge_point() {
        let err = GroupLog::replay([entry_record(3), entry_record(5)].iter())
            .err()
            .unwrap();
        assert!(err.contains("at index 5 follows entry 3"), "{err}");
        // Purged up to 2, but the oldest segment kept starts at entry 7: not a gap.
        let purged = formats::log_id_to_pb(&legacy::log_id_record(&[1, 1, 2]).unwrap());
        let records = [
            record(kind::PURGED, 0, formats::to_bytes(&purged)),
            entry_record(7),
            entry_record(8),
            // A rewrite of a suffix (after a truncation) is not a gap either.
            entry_record(8),
        ];
        let log = GroupLog::replay(records.iter()).unwrap();
        assert_eq!(log.entries.keys().copied().collect::<Vec<_>>(), vec![7, 8]);
        // Nor is a gap that a later purge covers.
        let purged = formats::log_id_to_pb(&legacy::log_id_record(&[1, 1, 5]).unwrap());
        let records = [
            entry_record(3),
            entry_record(6),
            record(kind::PURGED, 0, formats::to_bytes(&purged)),
            entry_record(7),
        ];
        let log = GroupLog::replay(records.iter()).unwrap();
        assert_eq!(log.entries.keys().copied().collect::<Vec<_>>(), vec![6, 7]);
    }
}
