//! A versioned, checksummed encoding of the whole table, and its digest.
//!
//! Layout: `b"HFLT"`, a little-endian `u16` format version, the postcard encoding of the table, then a
//! little-endian CRC-32 of everything before it. Ordered maps make the encoding canonical, so equal tables
//! have equal bytes and the digest (FNV-1a 64 of the bytes) can be compared across replicas (property P2).
//!
//! Versions: 8 (written now) adds the table's memory budget (`Command::SetTableBudget`; older
//! versions decode with none); 7 added shared holders and semaphores (each lock's further holders and
//! permits, each grant's and wait's mode); 6 added each grant's and wait's lock-delay; 5 added the principal that owns
//! each session opened under a quota; 4 added each session's secret; 3 added each wait's and grant's
//! acquire attempt. 7, 6, 5, 4, 3 and 2 are still read (7 with no budget): their locks are exclusive (one holder, no
//! permits), grants and waits before 6 have no lock-delay, sessions
//! before 5 have no owner, 3's and 2's get secret 0 (none), and version 2's waits and grants attempt
//! 0, which no server's abandon matches, so a data directory written by an older release still starts.

use crate::table::LockTable;

const MAGIC: &[u8; 4] = b"HFLT";
const VERSION: u16 = 8;

#[derive(Debug, thiserror::Error)]
pub enum SnapshotError {
    #[error("lock table snapshot is truncated ({len} bytes)")]
    Truncated { len: usize },
    #[error("lock table snapshot has bad magic")]
    BadMagic,
    #[error(
        "lock table snapshot has format version {0}, this build reads versions 2 to {VERSION}"
    )]
    UnknownVersion(u16),
    #[error(
        "lock table snapshot checksum mismatch (stored {stored:#010x}, computed {computed:#010x})"
    )]
    Checksum { stored: u32, computed: u32 },
    #[error("lock table snapshot does not decode: {0}")]
    Decode(String),
    #[error(
        "the snapshot being written was abandoned (the table was replaced or the snapshot aborted)"
    )]
    Abandoned,
}

/// A snapshot of a [`LockTable`] being written a chunk at a time ([`LockTable::snapshot_begin`]).
#[derive(Debug)]
pub struct SnapshotWriter {
    /// The snapshot's generation (see [`LockTable::snapshot_begin`]).
    generation: u64,
    stage: Stage,
    /// The number of locks at the start.
    locks: usize,
    /// The encoding of the fields after the locks, taken at the start.
    tail: Vec<u8>,
    crc: crc32fast::Hasher,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Stage {
    Sessions,
    Locks,
    Done,
}

/// Appends what every encoding of a table starts with: the magic and the format version.
fn push_header(out: &mut impl Extend<u8>) {
    out.extend(MAGIC.iter().copied());
    out.extend(VERSION.to_le_bytes());
}

/// Appends a map's length as postcard encodes it (the prefix of the map's entries).
fn push_map_len(out: &mut Vec<u8>, len: usize) {
    struct Len(usize);
    impl serde::Serialize for Len {
        fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
            serde::ser::SerializeMap::end(s.serialize_map(Some(self.0))?)
        }
    }
    let bytes = std::mem::take(out);
    *out = postcard::to_extend(&Len(len), bytes).expect("encoding to a Vec cannot fail");
}

impl LockTable {
    /// Encodes the whole table.
    pub fn encode_snapshot(&self) -> Vec<u8> {
        let mut out = self.encode_to(Vec::with_capacity(64 + self.lock_count() * 96));
        let crc = crc32fast::hash(&out);
        out.extend_from_slice(&crc.to_le_bytes());
        out
    }

    /// Appends the encoding up to its CRC (the magic, the version, the table) to `out`: what
    /// [`LockTable::encode_snapshot`] keeps and [`LockTable::digest`] hashes.
    fn encode_to<W: Extend<u8>>(&self, mut out: W) -> W {
        push_header(&mut out);
        postcard::to_extend(self, out).expect("encoding into memory cannot fail")
    }

    /// Starts writing a snapshot of the table as it is now, while it goes on changing: returns the
    /// writer and appends the first bytes to `out`. Then [`LockTable::snapshot_next`] appends the rest a
    /// chunk at a time, with any number of applies in between; the bytes are exactly what
    /// [`LockTable::encode_snapshot`] returned at this call. While it runs, the first change to each
    /// session or lock not yet written keeps a copy of its encoding (see the `cow` module). A snapshot
    /// already under way is abandoned.
    pub fn snapshot_begin(&mut self, out: &mut Vec<u8>) -> SnapshotWriter {
        let start = out.len();
        push_header(out);
        push_map_len(out, self.sessions.len());
        // Unique per snapshot in this process, so a writer whose snapshot was abandoned (and another
        // begun) is refused instead of advancing the other's. Not part of the table's state.
        static GENERATIONS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);
        let generation = GENERATIONS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        self.sessions.freeze(generation);
        self.locks.freeze(generation);
        // The small parts, encoded now (the fields after `locks`, in their order).
        let tail = postcard::to_allocvec(&(
            &self.open_nonces,
            &self.open_nonce_order,
            self.waiter_count,
            &self.owners,
            self.budget,
        ))
        .expect("encoding to a Vec cannot fail");
        let mut crc = crc32fast::Hasher::new();
        crc.update(&out[start..]);
        SnapshotWriter {
            generation,
            stage: Stage::Sessions,
            locks: self.locks.len(),
            tail,
            crc,
        }
    }

    /// Appends up to `max_entries` more sessions or locks (or the end) of the snapshot `writer` writes.
    /// Returns true once the snapshot is complete (its checksum appended). An error if the table is not
    /// the one the writer started on (it was replaced, or [`LockTable::snapshot_abort`] was called, or
    /// another snapshot began).
    pub fn snapshot_next(
        &mut self,
        writer: &mut SnapshotWriter,
        out: &mut Vec<u8>,
        max_entries: usize,
    ) -> Result<bool, SnapshotError> {
        let start = out.len();
        let done = match writer.stage {
            Stage::Sessions | Stage::Locks => {
                let map_done = if writer.stage == Stage::Sessions {
                    if !self.sessions.is_frozen_by(writer.generation) {
                        return Err(SnapshotError::Abandoned);
                    }
                    self.sessions.write_chunk(out, max_entries)
                } else {
                    if !self.locks.is_frozen_by(writer.generation) {
                        return Err(SnapshotError::Abandoned);
                    }
                    self.locks.write_chunk(out, max_entries)
                };
                if map_done {
                    writer.stage = if writer.stage == Stage::Sessions {
                        push_map_len(out, writer.locks);
                        Stage::Locks
                    } else {
                        out.extend_from_slice(&writer.tail);
                        Stage::Done
                    };
                }
                writer.stage == Stage::Done
            }
            Stage::Done => return Ok(true),
        };
        writer.crc.update(&out[start..]);
        if done {
            let crc = std::mem::take(&mut writer.crc).finalize();
            out.extend_from_slice(&crc.to_le_bytes());
        }
        Ok(done)
    }

    /// Abandons a snapshot under way (its writer failed): changes stop keeping copies.
    pub fn snapshot_abort(&mut self) {
        self.sessions.thaw();
        self.locks.thaw();
    }

    /// Decodes a table from [`LockTable::encode_snapshot`] output, checking magic, version and checksum.
    pub fn decode_snapshot(bytes: &[u8]) -> Result<Self, SnapshotError> {
        if bytes.len() < 10 {
            return Err(SnapshotError::Truncated { len: bytes.len() });
        }
        let (body, crc) = bytes.split_at(bytes.len() - 4);
        let stored = u32::from_le_bytes(crc.try_into().expect("4 bytes"));
        let computed = crc32fast::hash(body);
        if stored != computed {
            return Err(SnapshotError::Checksum { stored, computed });
        }
        if &body[..4] != MAGIC {
            return Err(SnapshotError::BadMagic);
        }
        let version = u16::from_le_bytes([body[4], body[5]]);
        let decode = |e: postcard::Error| SnapshotError::Decode(e.to_string());
        let mut table: LockTable = match version {
            VERSION => postcard::from_bytes(&body[6..]).map_err(decode)?,
            7 => postcard::from_bytes::<v7::LockTable>(&body[6..])
                .map_err(decode)?
                .into(),
            6 => postcard::from_bytes::<v6::LockTable>(&body[6..])
                .map_err(decode)?
                .into(),
            5 => postcard::from_bytes::<v5::LockTable>(&body[6..])
                .map_err(decode)?
                .into(),
            4 => postcard::from_bytes::<v4::LockTable>(&body[6..])
                .map_err(decode)?
                .into(),
            3 => postcard::from_bytes::<v3::LockTable>(&body[6..])
                .map_err(decode)?
                .into(),
            2 => postcard::from_bytes::<v2::LockTable>(&body[6..])
                .map_err(decode)?
                .into(),
            _ => return Err(SnapshotError::UnknownVersion(version)),
        };
        table.rebuild_derived().map_err(SnapshotError::Decode)?;
        table.validate_decoded().map_err(SnapshotError::Decode)?;
        Ok(table)
    }

    /// A digest of the whole state: equal on two replicas exactly when their tables are equal. The FNV-1a
    /// hash of [`LockTable::encode_snapshot`]'s bytes (backups record it), hashed as they are produced
    /// instead of from a copy of the encoding (at 1M locks a 41 MB encoding, in a buffer reserved at 96 MB).
    pub fn digest(&self) -> u64 {
        let mut sink = self.encode_to(DigestSink {
            buf: Vec::with_capacity(DigestSink::BUF),
            fnv: crate::name::fnv1a64(&[]),
            crc: crc32fast::Hasher::new(),
        });
        sink.flush();
        // The encoding ends with the CRC of everything before it.
        let crc = sink.crc.finalize().to_le_bytes();
        crate::name::fnv1a64_more(sink.fnv, &crc)
    }

    /// A checksummed snapshot can still be written by a buggy build; refuse one that breaks an invariant
    /// rather than panic later in `apply`.
    fn validate_decoded(&self) -> Result<(), String> {
        std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| self.check_invariants()))
            .map_err(|_| "snapshot breaks a lock table invariant".to_string())
    }
}

/// Hashes an encoding as postcard produces it (a byte or a few at a time), a buffer-full at a time.
struct DigestSink {
    buf: Vec<u8>,
    fnv: u64,
    crc: crc32fast::Hasher,
}

impl DigestSink {
    const BUF: usize = 64 * 1024;

    fn flush(&mut self) {
        self.fnv = crate::name::fnv1a64_more(self.fnv, &self.buf);
        self.crc.update(&self.buf);
        self.buf.clear();
    }
}

impl Extend<u8> for DigestSink {
    fn extend<I: IntoIterator<Item = u8>>(&mut self, bytes: I) {
        for b in bytes {
            self.buf.push(b);
            if self.buf.len() == Self::BUF {
                self.flush();
            }
        }
    }
}

/// Format version 7: today's sessions and locks, no memory budget.
mod v7 {
    use crate::table::{self, Lock, Session};
    use crate::types::{LockName, SessionId};
    use serde::Deserialize;
    use std::collections::{BTreeMap, VecDeque};

    #[derive(Deserialize)]
    pub(super) struct LockTable {
        sessions: BTreeMap<SessionId, Box<Session>>,
        locks: BTreeMap<LockName, Box<Lock>>,
        open_nonces: BTreeMap<u128, (SessionId, u64)>,
        open_nonce_order: VecDeque<u128>,
        waiter_count: u64,
        owners: BTreeMap<SessionId, Box<str>>,
    }

    impl From<LockTable> for table::LockTable {
        fn from(t: LockTable) -> Self {
            table::LockTable {
                sessions: t.sessions.into(),
                locks: t.locks.into(),
                open_nonces: t.open_nonces,
                open_nonce_order: t.open_nonce_order,
                waiter_count: t.waiter_count,
                owners: t.owners,
                budget: 0,
                ..table::LockTable::default()
            }
        }
    }
}

/// Format version 6: every lock exclusive (one holder, no permits, no modes).
mod v6 {
    use crate::table;
    use crate::types::{FencingToken, LockName, RequestId, SessionId};
    use serde::Deserialize;
    use std::collections::{BTreeMap, VecDeque};

    #[derive(Deserialize)]
    pub(super) struct LockTable {
        sessions: BTreeMap<SessionId, Box<table::Session>>,
        locks: BTreeMap<LockName, Lock>,
        open_nonces: BTreeMap<u128, (SessionId, u64)>,
        open_nonce_order: VecDeque<u128>,
        waiter_count: u64,
        owners: BTreeMap<SessionId, Box<str>>,
    }

    #[derive(Deserialize)]
    struct Lock {
        holder: Holder,
        // A `Box` in the table; the encoding is the same.
        waiters: Option<VecDeque<Waiter>>,
    }

    #[derive(Deserialize)]
    struct Holder {
        session: SessionId,
        token: FencingToken,
        request: RequestId,
        granted_at_ms: u64,
        value: Box<[u8]>,
        attempt: u64,
        lock_delay_ms: u32,
    }

    #[derive(Deserialize)]
    struct Waiter {
        session: SessionId,
        request: RequestId,
        enqueued_at_ms: u64,
        value: Box<[u8]>,
        attempt: u64,
        lock_delay_ms: u32,
    }

    impl From<Lock> for table::Lock {
        fn from(l: Lock) -> Self {
            let h = l.holder;
            let mut waiters = VecDeque::new();
            for w in l.waiters.into_iter().flat_map(|q| q.into_iter()) {
                waiters.push_back(table::Waiter {
                    session: w.session,
                    request: w.request,
                    enqueued_at_ms: w.enqueued_at_ms,
                    value: w.value.into(),
                    attempt: w.attempt,
                    lock_delay_ms: w.lock_delay_ms,
                    shared: false,
                });
            }
            table::Lock::from_parts(
                table::Holder {
                    grant: table::Grant {
                        session: h.session,
                        token: h.token,
                        request: h.request,
                        granted_at_ms: h.granted_at_ms,
                        attempt: h.attempt,
                        lock_delay_ms: h.lock_delay_ms,
                        shared: false,
                    },
                    value: h.value.into(),
                },
                waiters,
                Vec::new(),
                0,
            )
        }
    }

    impl From<LockTable> for table::LockTable {
        fn from(t: LockTable) -> Self {
            table::LockTable {
                sessions: t.sessions.into(),
                locks: t.locks.into_iter().map(|(n, l)| (n, l.into())).collect(),
                open_nonces: t.open_nonces,
                open_nonce_order: t.open_nonce_order,
                waiter_count: t.waiter_count,
                owners: t.owners,
                ..table::LockTable::default()
            }
        }
    }
}

/// Format version 5: grants and waits without a lock-delay.
mod v5 {
    use crate::table;
    use crate::types::{FencingToken, LockName, RequestId, SessionId};
    use serde::Deserialize;
    use std::collections::{BTreeMap, VecDeque};

    #[derive(Deserialize)]
    pub(super) struct LockTable {
        sessions: BTreeMap<SessionId, Box<table::Session>>,
        locks: BTreeMap<LockName, Lock>,
        open_nonces: BTreeMap<u128, (SessionId, u64)>,
        open_nonce_order: VecDeque<u128>,
        waiter_count: u64,
        owners: BTreeMap<SessionId, Box<str>>,
    }

    #[derive(Deserialize)]
    pub(super) struct Lock {
        holder: Holder,
        // A `Box` in the table; the encoding is the same.
        waiters: Option<VecDeque<Waiter>>,
    }

    #[derive(Deserialize)]
    struct Holder {
        session: SessionId,
        token: FencingToken,
        request: RequestId,
        granted_at_ms: u64,
        value: Box<[u8]>,
        attempt: u64,
    }

    #[derive(Deserialize)]
    struct Waiter {
        session: SessionId,
        request: RequestId,
        enqueued_at_ms: u64,
        value: Box<[u8]>,
        attempt: u64,
    }

    impl From<Lock> for table::Lock {
        fn from(l: Lock) -> Self {
            let h = l.holder;
            let mut waiters = VecDeque::new();
            for w in l.waiters.into_iter().flat_map(|q| q.into_iter()) {
                waiters.push_back(table::Waiter {
                    session: w.session,
                    request: w.request,
                    enqueued_at_ms: w.enqueued_at_ms,
                    value: w.value.into(),
                    attempt: w.attempt,
                    lock_delay_ms: 0,
                    shared: false,
                });
            }
            table::Lock::from_parts(
                table::Holder {
                    grant: table::Grant {
                        session: h.session,
                        token: h.token,
                        request: h.request,
                        granted_at_ms: h.granted_at_ms,
                        attempt: h.attempt,
                        lock_delay_ms: 0,
                        shared: false,
                    },
                    value: h.value.into(),
                },
                waiters,
                Vec::new(),
                0,
            )
        }
    }

    /// Version 5's locks as this version's.
    pub(super) fn locks(
        locks: BTreeMap<LockName, Lock>,
    ) -> crate::cow::SnapMap<LockName, table::Lock> {
        locks.into_iter().map(|(n, l)| (n, l.into())).collect()
    }

    impl From<LockTable> for table::LockTable {
        fn from(t: LockTable) -> Self {
            table::LockTable {
                sessions: t.sessions.into(),
                locks: locks(t.locks),
                open_nonces: t.open_nonces,
                open_nonce_order: t.open_nonce_order,
                waiter_count: t.waiter_count,
                owners: t.owners,
                ..table::LockTable::default()
            }
        }
    }
}

/// Format version 4: no session owners.
mod v4 {
    use crate::table;
    use crate::types::{LockName, SessionId};
    use serde::Deserialize;
    use std::collections::{BTreeMap, VecDeque};

    #[derive(Deserialize)]
    pub(super) struct LockTable {
        sessions: BTreeMap<SessionId, Box<table::Session>>,
        locks: BTreeMap<LockName, super::v5::Lock>,
        open_nonces: BTreeMap<u128, (SessionId, u64)>,
        open_nonce_order: VecDeque<u128>,
        waiter_count: u64,
    }

    impl From<LockTable> for table::LockTable {
        fn from(t: LockTable) -> Self {
            table::LockTable {
                budget: 0,
                bytes: 0,
                sessions: t.sessions.into(),
                locks: super::v5::locks(t.locks),
                open_nonces: t.open_nonces,
                open_nonce_order: t.open_nonce_order,
                waiter_count: t.waiter_count,
                owners: BTreeMap::new(),
                usage: BTreeMap::new(),
                events: Vec::new(),
                changes: Vec::new(),
                acquire_lock_delay: 0,
                acquire_share: Default::default(),
            }
        }
    }
}

/// Format version 3: sessions without a secret.
mod v3 {
    use crate::command::Outcome;
    use crate::table;
    use crate::types::{LockName, RequestId, SessionId};
    use serde::Deserialize;
    use std::collections::{BTreeMap, VecDeque};

    #[derive(Deserialize)]
    pub(super) struct Session {
        ttl_ms: u64,
        opened_at_ms: u64,
        dedup: VecDeque<(RequestId, Outcome)>,
        dedup_evicted_max: u64,
    }

    impl From<Session> for table::Session {
        fn from(s: Session) -> Self {
            table::Session {
                ttl_ms: s.ttl_ms,
                opened_at_ms: s.opened_at_ms,
                dedup: s.dedup.into_iter().collect(),
                dedup_evicted_max: s.dedup_evicted_max,
                secret: 0,
                ..table::Session::default()
            }
        }
    }

    #[derive(Deserialize)]
    pub(super) struct LockTable {
        sessions: BTreeMap<SessionId, Session>,
        locks: BTreeMap<LockName, super::v5::Lock>,
        open_nonces: BTreeMap<u128, (SessionId, u64)>,
        open_nonce_order: VecDeque<u128>,
        waiter_count: u64,
    }

    impl From<LockTable> for table::LockTable {
        fn from(t: LockTable) -> Self {
            table::LockTable {
                budget: 0,
                bytes: 0,
                sessions: t
                    .sessions
                    .into_iter()
                    .map(|(id, s)| (id, s.into()))
                    .collect(),
                locks: super::v5::locks(t.locks),
                open_nonces: t.open_nonces,
                open_nonce_order: t.open_nonce_order,
                waiter_count: t.waiter_count,
                owners: BTreeMap::new(),
                usage: BTreeMap::new(),
                events: Vec::new(),
                changes: Vec::new(),
                acquire_lock_delay: 0,
                acquire_share: Default::default(),
            }
        }
    }
}

/// Format version 2: waits and grants without their acquire attempt, sessions without a secret.
mod v2 {
    use super::v3::Session;
    use crate::table;
    use crate::types::{FencingToken, LockName, RequestId, SessionId};
    use serde::Deserialize;
    use std::collections::{BTreeMap, VecDeque};

    #[derive(Deserialize)]
    pub(super) struct LockTable {
        sessions: BTreeMap<SessionId, Session>,
        locks: BTreeMap<LockName, Lock>,
        open_nonces: BTreeMap<u128, (SessionId, u64)>,
        open_nonce_order: VecDeque<u128>,
        waiter_count: u64,
    }

    #[derive(Deserialize)]
    struct Lock {
        holder: Holder,
        // A `Box` in the table; the encoding is the same.
        waiters: Option<VecDeque<Waiter>>,
    }

    #[derive(Deserialize)]
    struct Holder {
        session: SessionId,
        token: FencingToken,
        request: RequestId,
        granted_at_ms: u64,
        value: Box<[u8]>,
    }

    #[derive(Deserialize)]
    struct Waiter {
        session: SessionId,
        request: RequestId,
        enqueued_at_ms: u64,
        value: Box<[u8]>,
    }

    impl From<LockTable> for table::LockTable {
        fn from(t: LockTable) -> Self {
            let locks = t
                .locks
                .into_iter()
                .map(|(name, l)| {
                    let h = l.holder;
                    let holder = table::Holder {
                        grant: table::Grant {
                            session: h.session,
                            token: h.token,
                            request: h.request,
                            granted_at_ms: h.granted_at_ms,
                            attempt: 0,
                            lock_delay_ms: 0,
                            shared: false,
                        },
                        value: h.value.into(),
                    };
                    let mut waiters = VecDeque::new();
                    for w in l.waiters.into_iter().flat_map(|q| q.into_iter()) {
                        waiters.push_back(table::Waiter {
                            session: w.session,
                            request: w.request,
                            enqueued_at_ms: w.enqueued_at_ms,
                            value: w.value.into(),
                            attempt: 0,
                            lock_delay_ms: 0,
                            shared: false,
                        });
                    }
                    let lock = table::Lock::from_parts(holder, waiters, Vec::new(), 0);
                    (name, lock)
                })
                .collect();
            table::LockTable {
                budget: 0,
                bytes: 0,
                sessions: t
                    .sessions
                    .into_iter()
                    .map(|(id, s)| (id, s.into()))
                    .collect(),
                locks,
                open_nonces: t.open_nonces,
                open_nonce_order: t.open_nonce_order,
                waiter_count: t.waiter_count,
                owners: BTreeMap::new(),
                usage: BTreeMap::new(),
                events: Vec::new(),
                changes: Vec::new(),
                acquire_lock_delay: 0,
                acquire_share: Default::default(),
            }
        }
    }
}
