//! The Raft log of each group, kept in memory and made durable in the server's shared [`holdfast_wal::Wal`].
//!
//! Entries live in memory between snapshots (the log is purged after each snapshot, so this is bounded by
//! the snapshot policy), encoded as their WAL records are, with the newest also decoded (see [`GroupLog`]),
//! and every change is a WAL record tagged with the group. Records are written in
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
use std::borrow::Cow;
use std::collections::{BTreeMap, VecDeque};
use std::fmt::Debug;
use std::io;
use std::ops::RangeBounds;
use std::sync::{Arc, Mutex};

use crate::formats::{self, kind};
use holdfast_proto::v1 as pb;

/// How many of the newest entries are also kept decoded: replication and apply read the log's tail soon
/// after it is appended, and a clone is cheaper than a decode. Older entries (read only by a follower that
/// lags) are decoded when read.
const HOT_ENTRIES: usize = 1024;

/// Entries are packed into chunks of this many bytes (an entry larger than that gets a chunk of its own).
const CHUNK_BYTES: usize = 64 << 10;

/// The in-memory state of one group's log.
///
/// Entries are kept encoded, as the payloads of their WAL records (format 1), packed into chunks: about
/// 100 bytes an entry for the locks a client holds, where a decoded [`Entry`] in a B-tree took ~300 B. The
/// log between two snapshots is the largest thing in memory after the lock table, so this is what lets a
/// group snapshot less often (docs/performance.md, "An encoded log").
pub struct GroupLog {
    /// Log index of `slots[0]` (meaningful while `slots` is not empty).
    first: u64,
    /// One per entry, in index order, without gaps: where its encoding lies.
    slots: VecDeque<Slot>,
    /// Sequence number of `chunks[0]`; a slot names its chunk by sequence number.
    first_chunk: u64,
    /// Only the last chunk is appended to. A chunk is freed when no slot points into it.
    chunks: VecDeque<Vec<u8>>,
    /// The last `hot.len()` entries of `slots`, decoded (at most `hot_limit`).
    hot: VecDeque<Entry>,
    hot_limit: usize,
    chunk_bytes: usize,
    vote: Option<Vote>,
    purged: Option<LogId>,
    committed: Option<LogId>,
}

#[derive(Clone, Copy)]
struct Slot {
    chunk: u64,
    start: u32,
    end: u32,
}

impl Default for GroupLog {
    fn default() -> Self {
        GroupLog::with_limits(HOT_ENTRIES, CHUNK_BYTES)
    }
}

impl GroupLog {
    fn with_limits(hot_limit: usize, chunk_bytes: usize) -> GroupLog {
        GroupLog {
            first: 0,
            slots: VecDeque::new(),
            first_chunk: 0,
            chunks: VecDeque::new(),
            hot: VecDeque::new(),
            hot_limit,
            chunk_bytes,
            vote: None,
            purged: None,
            committed: None,
        }
    }

    /// Replays this group's WAL records (in order) into a log.
    pub fn replay<'a>(records: impl Iterator<Item = &'a Record>) -> Result<GroupLog, String> {
        let mut log = GroupLog::default();
        // Replayed into a map first: a gap is only an error if no later purge or truncation removes it.
        let mut entries: BTreeMap<u64, Cow<'a, [u8]>> = BTreeMap::new();
        for r in records {
            match r.kind {
                kind::ENTRY | kind::LEGACY_ENTRY => {
                    // Decoded here to check it, and kept as format 1.
                    let (entry, bytes) = if r.kind == kind::ENTRY {
                        let entry =
                            formats::entry_from_pb(&formats::from_bytes(&r.payload, "wal entry")?)?;
                        (entry, Cow::Borrowed(&r.payload[..]))
                    } else {
                        let entry = formats::legacy::entry(&r.payload)?;
                        let bytes = formats::encode_entry(&entry);
                        (entry, Cow::Owned(bytes))
                    };
                    if entry.log_id.index != r.index {
                        return Err(format!(
                            "wal entry record at index {} holds entry {}",
                            r.index, entry.log_id.index
                        ));
                    }
                    // An append overwrites any suffix from this index on.
                    entries.split_off(&r.index);
                    entries.insert(r.index, bytes);
                }
                kind::TRUNCATE | kind::LEGACY_TRUNCATE => {
                    entries.split_off(&(r.index + 1));
                }
                kind::VOTE => {
                    log.vote = Some(formats::vote_from_pb(&formats::from_bytes::<pb::Vote>(
                        &r.payload, "wal vote",
                    )?))
                }
                kind::LEGACY_VOTE => log.vote = Some(formats::legacy::vote(&r.payload)?),
                kind::PURGED | kind::LEGACY_PURGED => {
                    let purged = decode_log_id(r)?;
                    entries = entries.split_off(&(purged.index + 1));
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
        let mut indexes = entries.keys();
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
        for (index, bytes) in entries {
            log.push(index, &bytes, None);
        }
        // The hint is written after the appends of the entries it names (a lazy record rides in the
        // frame of a later append), so it never runs past the log on disk. If it does (damage), it
        // names nothing this server can trust: capping it at the last entry would call a suffix
        // committed that may not be (a deposed leader's) and apply it. Fall back to the purge point,
        // which a snapshot covers, and learn the rest from the leader.
        let last = log.last_log_id()?;
        if log.committed > last {
            tracing::warn!(
                hint = ?log.committed,
                last = ?last,
                "the committed-index hint names an entry past the log on disk; ignoring it"
            );
            log.committed = log.purged;
        }
        Ok(log)
    }

    /// The index the next append continues at.
    fn next_index(&self) -> u64 {
        if self.slots.is_empty() {
            self.purged.map_or(0, |p| p.index + 1)
        } else {
            self.first + self.slots.len() as u64
        }
    }

    fn last_log_id(&self) -> Result<Option<LogId>, String> {
        if let Some(e) = self.hot.back() {
            return Ok(Some(e.log_id));
        }
        match self.slots.len() {
            0 => Ok(self.purged),
            n => Ok(Some(self.decode(n - 1)?.log_id)),
        }
    }

    /// Adds the entry at `index`, encoded as `bytes`, after the last one (the caller removed any suffix
    /// from `index` on). `decoded` is the entry itself when the caller has it: it joins the hot tail.
    fn push(&mut self, index: u64, bytes: &[u8], decoded: Option<Entry>) {
        debug_assert!(self.slots.is_empty() || index == self.next_index());
        if self.slots.is_empty() {
            self.first = index;
        }
        let fits = self
            .chunks
            .back()
            .is_some_and(|c| c.capacity() - c.len() >= bytes.len());
        if !fits {
            self.chunks
                .push_back(Vec::with_capacity(self.chunk_bytes.max(bytes.len())));
        }
        let chunk_seq = self.first_chunk + self.chunks.len() as u64 - 1;
        let chunk = self.chunks.back_mut().expect("a chunk was just ensured");
        let start = chunk.len();
        chunk.extend_from_slice(bytes);
        // An entry is at most the request size limit, far below 4 GiB.
        self.slots.push_back(Slot {
            chunk: chunk_seq,
            start: start as u32,
            end: chunk.len() as u32,
        });
        match decoded {
            Some(e) => {
                self.hot.push_back(e);
                if self.hot.len() > self.hot_limit {
                    self.hot.pop_front();
                }
            }
            // The hot entries must be the log's last ones.
            None => self.hot.clear(),
        }
    }

    /// Removes the entries from `index` on.
    fn truncate_from(&mut self, index: u64) {
        if self.slots.is_empty() {
            return;
        }
        let keep = index
            .saturating_sub(self.first)
            .min(self.slots.len() as u64) as usize;
        let removed = self.slots.len() - keep;
        self.slots.truncate(keep);
        self.hot.truncate(self.hot.len().saturating_sub(removed));
        match self.slots.back() {
            Some(last) => {
                self.chunks
                    .truncate((last.chunk - self.first_chunk) as usize + 1);
                let chunk = self.chunks.back_mut().expect("the last slot's chunk");
                chunk.truncate(last.end as usize);
            }
            None => self.drop_chunks(),
        }
    }

    /// Removes the entries up to and including `index`.
    fn purge_through(&mut self, index: u64) {
        if self.slots.is_empty() {
            return;
        }
        let n = (index + 1)
            .saturating_sub(self.first)
            .min(self.slots.len() as u64) as usize;
        self.slots.drain(..n);
        self.first += n as u64;
        while self.hot.len() > self.slots.len() {
            self.hot.pop_front();
        }
        match self.slots.front() {
            Some(front) => {
                self.chunks
                    .drain(..(front.chunk - self.first_chunk) as usize);
                self.first_chunk = front.chunk;
            }
            None => self.drop_chunks(),
        }
    }

    fn drop_chunks(&mut self) {
        self.first_chunk += self.chunks.len() as u64;
        self.chunks.clear();
        self.hot.clear();
    }

    /// The encoded size of the entries after `index` (all of them if `None`): what a restarted server
    /// replayed after its snapshot, counted toward the next one ([`crate::state_machine::SnapshotPacing`]).
    pub fn bytes_after(&self, index: Option<u64>) -> u64 {
        let skip = index.map_or(0, |i| {
            (i + 1)
                .saturating_sub(self.first)
                .min(self.slots.len() as u64)
        });
        self.slots
            .iter()
            .skip(skip as usize)
            .map(|s| u64::from(s.end - s.start))
            .sum()
    }

    fn bytes(&self, slot: usize) -> &[u8] {
        let s = self.slots[slot];
        &self.chunks[(s.chunk - self.first_chunk) as usize][s.start as usize..s.end as usize]
    }

    /// Appends to `out` each of `entries` as field `field` of a protobuf message (its key, its length,
    /// and the entry's encoding as its record holds it), and returns true, if each is one of the newest
    /// entries kept decoded with the same log id (so the same entry: Raft's log matching); else
    /// appends nothing and returns false. A leader sends each batch to every follower: this copies
    /// the encoding made once at append instead of encoding the entries again for each.
    pub fn encode_entries(&self, entries: &[Entry], field: u32, out: &mut Vec<u8>) -> bool {
        let after_last = self.first + self.slots.len() as u64;
        let hot_from = after_last - self.hot.len() as u64;
        let held = |e: &Entry| {
            let index = e.log_id.index;
            (hot_from..after_last).contains(&index)
                && self.hot[(index - hot_from) as usize].log_id == e.log_id
        };
        if self.hot.is_empty() || !entries.iter().all(held) {
            return false;
        }
        for e in entries {
            let bytes = self.bytes((e.log_id.index - self.first) as usize);
            formats::put_bytes_field(field, bytes, out);
        }
        true
    }

    fn decode(&self, slot: usize) -> Result<Entry, String> {
        formats::entry_from_pb(&formats::from_bytes(self.bytes(slot), "log entry")?)
    }

    /// The entries of `range` that the log holds, in order.
    fn read(&self, range: impl RangeBounds<u64>) -> Result<Vec<Entry>, String> {
        use std::ops::Bound::*;
        if self.slots.is_empty() {
            return Ok(Vec::new());
        }
        let after_last = self.first + self.slots.len() as u64;
        let start = match range.start_bound() {
            Included(&s) => s,
            Excluded(&s) => s.saturating_add(1),
            Unbounded => 0,
        }
        .max(self.first);
        let end = match range.end_bound() {
            Included(&e) => e.saturating_add(1),
            Excluded(&e) => e,
            Unbounded => u64::MAX,
        }
        .min(after_last);
        let hot_from = after_last - self.hot.len() as u64;
        // At most the log's length: `end` is within it and `start` at or past its first entry (0
        // when `start` is past `end`).
        let len = end.saturating_sub(start) as usize;
        crate::formats::collect_sized(
            len,
            (start..end).map(|index| {
                if index >= hot_from {
                    Ok(self.hot[(index - hot_from) as usize].clone())
                } else {
                    self.decode((index - self.first) as usize)
                        .map_err(|e| format!("log entry {index}: {e}"))
                }
            }),
        )
    }

    #[cfg(test)]
    fn indexes(&self) -> Vec<u64> {
        (self.first..self.first + self.slots.len() as u64).collect()
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
    /// This server's node id: entries another node's leadership made are a follower's appends.
    me: u64,
    /// A follower's appends are written and synced on the calling (Raft) thread when the WAL is idle
    /// ([`Wal::append_inline`]; `ServerConfig::follower_syncs_inline`).
    inline: bool,
    log: Arc<Mutex<GroupLog>>,
    wal: Arc<Wal>,
    /// Bytes of entry records appended so far, from the size of the log replayed after the snapshot at
    /// start (monotonic): the server snapshots a group by log size too.
    appended_bytes: Arc<std::sync::atomic::AtomicU64>,
}

impl LogStore {
    pub fn new(
        group: u32,
        me: u64,
        inline: bool,
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
            me,
            inline,
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

    /// [`GroupLog::encode_entries`] on this group's log.
    pub fn encode_entries(&self, entries: &[Entry], field: u32, out: &mut Vec<u8>) -> bool {
        self.lock().encode_entries(entries, field, out)
    }
}

impl RaftLogReader<TypeConfig> for LogStore {
    async fn try_get_log_entries<RB: RangeBounds<u64> + Clone + Debug + OptionalSend>(
        &mut self,
        range: RB,
    ) -> Result<Vec<Entry>, io::Error> {
        let group = self.group;
        self.lock()
            .read(range)
            .map_err(|e| io::Error::other(format!("group {group}: {e}")))
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
            last_log_id: log.last_log_id().map_err(io::Error::other)?,
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
        let mut follower = true;
        {
            let mut log = self.lock();
            // Appends continue the log with no gap (they may replace a suffix: openraft truncates a
            // conflict first, and an entry at an index already present replaces it).
            let mut next = log.next_index();
            for entry in entries {
                let index = entry.log_id.index;
                assert!(
                    index <= next,
                    "group {}: append of entry {index} leaves a gap after {}",
                    self.group,
                    next.saturating_sub(1)
                );
                next = index + 1;
                follower &= entry.log_id.leader_id.node_id != self.me;
                let bytes = formats::encode_entry(&entry);
                if crate::state_machine::EXPENSIVE_CHECKS {
                    // What goes to disk must read back as the entry (encode and decode are a pair).
                    let back = formats::from_bytes(&bytes, "log entry")
                        .and_then(|pb| formats::entry_from_pb(&pb))
                        .expect("an entry just encoded decodes");
                    assert!(back == entry, "entry {index} reads back differently");
                }
                log.truncate_from(index);
                log.push(index, &bytes, Some(entry));
                records.push(self.record(kind::ENTRY, false, index, bytes));
            }
        }
        let (group, last) = (self.group, records.last().map_or(0, |r| r.index));
        tracing::trace!(target: "holdfast::hop", group, index = last, "log append");
        let bytes: usize = records.iter().map(|r| r.payload.len()).sum();
        self.appended_bytes
            .fetch_add(bytes as u64, std::sync::atomic::Ordering::Relaxed);
        let done: holdfast_wal::Done = Box::new(move |r| {
            tracing::trace!(target: "holdfast::hop", group, index = last, "log synced");
            callback.io_completed(r.map_err(wal_io))
        });
        // A follower's appends (entries its leader made): its Raft thread has nothing to do until
        // they are durable (the leader's next request waits for this one's reply), so it writes and
        // syncs them itself when no commit is under way, saving the WAL thread's wake-up and its own.
        // A leader's go to the WAL thread: its Raft thread sends them to the followers meanwhile.
        if self.inline && follower && !records.is_empty() {
            self.wal.append_inline(records, done);
        } else {
            self.wal.append(records, done);
        }
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
        self.lock().truncate_from(keep_through + 1);
        Ok(())
    }

    async fn purge(&mut self, log_id: LogId) -> Result<(), io::Error> {
        {
            let mut log = self.lock();
            log.purge_through(log_id.index);
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
        assert_eq!(log.indexes(), vec![7, 8]);
        // Nor is a gap that a later purge covers.
        let purged = formats::log_id_to_pb(&legacy::log_id_record(&[1, 1, 5]).unwrap());
        let records = [
            entry_record(3),
            entry_record(6),
            record(kind::PURGED, 0, formats::to_bytes(&purged)),
            entry_record(7),
        ];
        let log = GroupLog::replay(records.iter()).unwrap();
        assert_eq!(log.indexes(), vec![6, 7]);
    }

    /// A committed-index hint past the log on disk (only damage makes one) names nothing to trust:
    /// replay falls back to the purge point, and does not call the log's last entries committed
    /// (they may be a deposed leader's, and would be applied).
    #[test]
    fn a_committed_hint_past_the_log_falls_back_to_the_purge_point() {
        let log_id = |index: u8| legacy::log_id_record(&[1, 1, index]).unwrap();
        let hint = |index: u8| {
            record(
                kind::COMMITTED,
                0,
                formats::to_bytes(&formats::log_id_to_pb(&log_id(index))),
            )
        };
        let purged = record(
            kind::PURGED,
            0,
            formats::to_bytes(&formats::log_id_to_pb(&log_id(4))),
        );
        let records = [purged.clone(), entry_record(5), entry_record(6), hint(9)];
        let log = GroupLog::replay(records.iter()).unwrap();
        assert_eq!(log.committed, Some(log_id(4)));
        // A hint within the log stands.
        let records = [purged, entry_record(5), entry_record(6), hint(5)];
        let log = GroupLog::replay(records.iter()).unwrap();
        assert_eq!(log.committed, Some(log_id(5)));
        // With nothing purged, no entry is called committed.
        let records = [entry_record(5), hint(7)];
        assert_eq!(GroupLog::replay(records.iter()).unwrap().committed, None);
    }
}

/// The encoded log against a model (a map of decoded entries), with tiny chunks and a tiny hot tail so
/// that every operation crosses their boundaries.
#[cfg(test)]
mod model {
    use super::*;
    use holdfast_lock_table::{AcquireMode, Command, LockName, RequestId, SessionId};
    use proptest::prelude::*;

    #[derive(Debug, Clone)]
    enum Op {
        /// Append `count` entries at `back` entries before the end (replacing that suffix).
        Append {
            back: u64,
            count: u64,
            value: usize,
            term: u64,
        },
        /// Remove the last `back` entries.
        Truncate { back: u64 },
        /// Purge `ahead` entries past the first.
        Purge { ahead: u64 },
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            4 => (0..4u64, 1..12u64, 0..300usize, 1..4u64)
                .prop_map(|(back, count, value, term)| Op::Append { back, count, value, term }),
            1 => (0..6u64).prop_map(|back| Op::Truncate { back }),
            1 => (0..15u64).prop_map(|ahead| Op::Purge { ahead }),
        ]
    }

    fn entry(index: u64, term: u64, value: usize) -> Entry {
        let payload = if value.is_multiple_of(7) {
            openraft::EntryPayload::Blank
        } else {
            openraft::EntryPayload::Normal(crate::raft_types::Request::new(Command::Acquire {
                session: SessionId(index),
                request: RequestId(1),
                name: LockName::new(format!("lock-{index}")).unwrap(),
                mode: AcquireMode::Try,
                value: vec![index as u8; value].into(),
                attempt: 1,
                now_ms: index,
            }))
        };
        Entry {
            log_id: LogId::new(
                openraft::impls::leader_id_adv::LeaderId {
                    term,
                    node_id: term % 5,
                },
                index,
            ),
            payload,
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(64))]
        #[test]
        fn the_encoded_log_reads_as_the_entries_appended(ops in proptest::collection::vec(op(), 1..120)) {
            let mut log = GroupLog::with_limits(5, 200);
            let mut model: BTreeMap<u64, Entry> = BTreeMap::new();
            let mut purged: Option<LogId> = None;
            for op in ops {
                let next = model.keys().next_back().map_or(purged.map_or(0, |p| p.index + 1), |i| i + 1);
                let first = purged.map_or(0, |p| p.index + 1);
                match op {
                    Op::Append { back, count, value, term } => {
                        let at = next.saturating_sub(back).max(first);
                        model.split_off(&at);
                        log.truncate_from(at);
                        for index in at..at + count {
                            let e = entry(index, term, value + index as usize % 50);
                            let bytes = formats::to_bytes(&formats::entry_to_pb(&e));
                            model.insert(index, e.clone());
                            log.push(index, &bytes, Some(e));
                        }
                    }
                    Op::Truncate { back } => {
                        let from = next.saturating_sub(back).max(first);
                        model.split_off(&from);
                        log.truncate_from(from);
                    }
                    Op::Purge { ahead } => {
                        let through = first + ahead;
                        let Some(id) = model.get(&through).map(|e| e.log_id) else { continue };
                        model = model.split_off(&(through + 1));
                        log.purge_through(through);
                        log.purged = Some(id);
                        purged = Some(id);
                    }
                }
                let want: Vec<Entry> = model.values().cloned().collect();
                prop_assert_eq!(log.read(..).unwrap(), want);
                prop_assert_eq!(log.next_index(), model.keys().next_back().map_or(purged.map_or(0, |p| p.index + 1), |i| i + 1));
                prop_assert_eq!(log.last_log_id().unwrap(), model.values().next_back().map(|e| e.log_id).or(purged));
                // A range in the middle, bounds of both kinds.
                if let (Some(&lo), Some(&hi)) = (model.keys().next(), model.keys().next_back()) {
                    let (a, b) = (lo + (hi - lo) / 3, hi - (hi - lo) / 3);
                    let want: Vec<Entry> = model.range(a..=b).map(|(_, e)| e.clone()).collect();
                    prop_assert_eq!(log.read(a..=b).unwrap(), want);
                    let want: Vec<Entry> = model.range(a + 1..b.max(a + 1)).map(|(_, e)| e.clone()).collect();
                    prop_assert_eq!(log.read(a + 1..b).unwrap(), want);
                }
                // No chunk is kept that no entry points into, and the hot tail stays within its limit.
                match (log.slots.front(), log.slots.back()) {
                    (Some(f), Some(l)) => {
                        prop_assert_eq!(log.first_chunk, f.chunk);
                        prop_assert_eq!(log.chunks.len() as u64, l.chunk - f.chunk + 1);
                    }
                    _ => prop_assert!(log.chunks.is_empty()),
                }
                prop_assert!(log.hot.len() <= 5);
                // The newest entries, as a leader sends them: copied as the log encoded them into
                // field 4 of a message, or refused whole with nothing written.
                let tail: Vec<Entry> = model.values().rev().take(7).rev().cloned().collect();
                for k in 0..=tail.len() {
                    let batch = &tail[tail.len() - k..];
                    let mut out = vec![0xff];
                    let copied = log.encode_entries(batch, 4, &mut out);
                    prop_assert_eq!(copied, !log.hot.is_empty() && k <= log.hot.len());
                    if copied {
                        let msg = <pb::AppendEntriesRequest as prost::Message>::decode(&out[1..]).unwrap();
                        let want: Vec<pb::Entry> = batch.iter().map(formats::entry_to_pb).collect();
                        prop_assert_eq!(msg.entries, want);
                    } else {
                        prop_assert_eq!(out, vec![0xff]);
                    }
                }
                if let Op::Append { count, .. } = op {
                    // What was just appended is kept decoded, up to the limit.
                    prop_assert!(log.hot.len() as u64 >= count.min(5));
                }
                // An entry of another term at a held index is another entry: not copied.
                if let Some(last) = tail.last() {
                    let mut other = last.clone();
                    other.log_id.leader_id.term += 10;
                    let mut out = Vec::new();
                    prop_assert!(!log.encode_entries(&[other], 4, &mut out));
                    prop_assert!(out.is_empty());
                }
            }
        }
    }

    /// A log replayed from the WAL has no decoded tail; reads decode every entry, and the first append
    /// after it starts a new one.
    #[test]
    fn a_replayed_log_reads_its_entries_decoded_from_their_records() {
        let records: Vec<Record> = (1..=40)
            .map(|i| Record {
                group: 0,
                kind: kind::ENTRY,
                sticky: false,
                index: i,
                payload: formats::to_bytes(&formats::entry_to_pb(&entry(i, 2, i as usize * 13))),
            })
            .collect();
        let mut log = GroupLog::replay(records.iter()).unwrap();
        assert!(log.hot.is_empty());
        // What a restarted server counts toward its next snapshot: the entries after its snapshot's.
        let size =
            |from: usize| -> u64 { records[from..].iter().map(|r| r.payload.len() as u64).sum() };
        assert_eq!(log.bytes_after(None), size(0));
        assert_eq!(log.bytes_after(Some(0)), size(0));
        assert_eq!(log.bytes_after(Some(30)), size(30));
        assert_eq!(log.bytes_after(Some(40)), 0);
        assert_eq!(log.bytes_after(Some(99)), 0);
        let want: Vec<Entry> = (1..=40).map(|i| entry(i, 2, i as usize * 13)).collect();
        assert_eq!(log.read(..).unwrap(), want);
        assert_eq!(log.last_log_id().unwrap(), Some(want[39].log_id));
        let e = entry(41, 3, 5);
        log.push(
            41,
            &formats::to_bytes(&formats::entry_to_pb(&e)),
            Some(e.clone()),
        );
        assert_eq!(log.read(40..).unwrap(), vec![want[39].clone(), e]);
    }
}
