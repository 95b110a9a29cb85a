//! The writer thread: group commit, segment rotation and deletion, fail-stop on I/O errors.

use crate::format::{
    encode_frame, encode_record, seal_frame, segment_header, segment_name, Place, Record,
    FRAME_HEADER_BYTES, MAX_APPEND_BYTES, MAX_RECORD_BYTES, RECORD_HEADER_BYTES, SEGMENT_VERSION,
    STANDBY,
};
use crate::fs::{File, OpenOptions};
use crate::recover::{io_err, recover, sync_dir, Recovered, SegmentInfo, Standby};
use crate::WalError;
use std::collections::{BTreeMap, VecDeque};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

/// Called after every sync with what it covered; used for the fsync latency and batch size metrics.
pub type SyncObserver = Arc<dyn Fn(SyncStats) + Send + Sync>;

/// A test hook run just before each `fdatasync`; an error is treated exactly like a failed sync.
pub type SyncFault = Arc<dyn Fn() -> std::io::Result<()> + Send + Sync>;

/// A completion callback: runs once the append is durable (or has failed), on the thread that made
/// the group commit: the writer thread, or a caller of [`Wal::append_inline`] (a follower's Raft
/// thread, a tokio worker), holding the writer's lock. It must not block, nor wait for the log.
pub type Done = Box<dyn FnOnce(Result<(), WalError>) + Send>;

#[derive(Clone, Copy, Debug)]
pub struct SyncStats {
    pub records: usize,
    pub bytes: usize,
    pub sync_duration: Duration,
}

/// The bytes an append's records take in a frame: payloads and record headers.
fn append_bytes(records: &[Record]) -> usize {
    records
        .iter()
        .map(|r| r.payload.len() + RECORD_HEADER_BYTES)
        .sum()
}

/// How far past the frames the active segment is filled with zeros ahead of time (see the writer's
/// `write_frame`). A sync that only overwrites blocks the file already has, below its length, flushes
/// the data alone; one that extends the file also commits the new length and blocks through
/// the file system's journal (ext4: a jbd2 commit, `ext4_write_inode` in a follower's profile). Zeros
/// written in 256 KiB steps put that commit on one sync in every step instead of on every sync: on
/// the development machine's ext4 a small write and `fdatasync` took 1.4–2.0 times as long on average
/// appending as over zeros, with 64 KiB, 256 KiB and 1 MiB steps alike on average and 1 MiB the worst
/// at p99.9 (docs/performance.md, "Syncs that do not grow the file").
pub const ZERO_AHEAD_BYTES: u64 = 256 << 10;

#[derive(Clone)]
pub struct WalOptions {
    /// A segment is closed and a new one started once it reaches this size. Smaller segments are
    /// deleted sooner after a purge; larger ones mean fewer files. 64 MiB holds ~500,000 lock entries.
    pub segment_bytes: u64,
    /// Most bytes one group commit gathers before it writes and syncs. Bounds the latency one batch adds
    /// to the appends behind it.
    pub max_batch_bytes: usize,
    pub observer: Option<SyncObserver>,
    pub sync_fault: Option<SyncFault>,
    /// In the simulation, how long a group commit's write and sync take in simulated time (a real
    /// disk's latency; it decides how appends batch).
    #[cfg(holdfast_sim)]
    pub sim_sync_delay: Duration,
}

impl Default for WalOptions {
    fn default() -> Self {
        WalOptions {
            segment_bytes: 64 << 20,
            max_batch_bytes: 4 << 20,
            observer: None,
            sync_fault: None,
            #[cfg(holdfast_sim)]
            sim_sync_delay: Duration::from_micros(500),
        }
    }
}

enum Op {
    Append(Vec<Record>, Done),
    Release(u32, u64),
}

/// Lazy records ([`Wal::append_lazy`]), each stamped with the number of appends sent before it. They
/// wait here, beside the queue, so that queuing one wakes no thread: it is written in the first frame
/// whose batch holds the append its stamp counts, after that append's records (so in the order the
/// calls were made), or at close.
type LazyQueue = Arc<Mutex<VecDeque<(u64, Vec<Record>)>>>;

/// What is waiting to be written, and who is writing.
struct Queue {
    ops: VecDeque<Op>,
    /// Appends queued so far, counted under this lock (so in queue order): the stamp of a lazy record.
    sent: u64,
    /// A group commit is under way (the writer thread's, or an inline one's: [`Wal::append_inline`]).
    /// Whoever set it takes the queue's front and commits it before anyone takes more, so frames are
    /// written in queue order.
    committing: bool,
    /// The writer thread waits for work (so a new append must wake it).
    idle: bool,
    /// An inline commit left the writer without a pre-created segment: the thread makes one.
    pre_create: bool,
    closed: bool,
}

/// What the handle and the writer thread share.
struct Shared {
    queue: Mutex<Queue>,
    /// Wakes the writer thread ([`Queue::idle`]).
    work: Condvar,
    /// Taken by whoever set [`Queue::committing`]; never waited for long by anyone else.
    writer: Mutex<Writer>,
    /// Group commits made by the writer thread, and inline ([`Wal::commits`]).
    thread_commits: AtomicU64,
    inline_commits: AtomicU64,
}

impl Shared {
    fn queue(&self) -> std::sync::MutexGuard<'_, Queue> {
        self.queue.lock().expect("wal queue lock")
    }

    fn writer(&self) -> std::sync::MutexGuard<'_, Writer> {
        self.writer.lock().expect("wal writer lock")
    }

    /// The writer's last act: closes its segment. Not if a commit panicked ([`Committing`]): the
    /// lock is poisoned then, and the half-done state is left alone.
    fn close_writer(&self) {
        if let Ok(mut writer) = self.writer.lock() {
            writer.close();
        }
    }
}

/// Held by whoever commits. Should the commit unwind (a callback or the observer panicked), it
/// closes the log instead of leaving it committing for ever: what is queued is dropped, as the
/// writer thread's queue was when that thread died before, later appends fail with
/// [`WalError::Closed`], and the writer thread is woken to end (so [`Wal::close`] returns) without
/// touching the writer's state, which the panic may have left half changed.
struct Committing<'a>(&'a Shared);

impl Drop for Committing<'_> {
    fn drop(&mut self) {
        if !std::thread::panicking() {
            return;
        }
        let mut q = self.0.queue.lock().unwrap_or_else(|e| e.into_inner());
        q.committing = false;
        q.closed = true;
        q.pre_create = false;
        let dropped = std::mem::take(&mut q.ops);
        drop(q);
        self.0.work.notify_one();
        drop(dropped);
    }
}

/// The front of the queue for one group commit: at least one operation (appends up to
/// `max_batch_bytes`, the first always taken however large).
fn take(q: &mut Queue, max_batch_bytes: usize) -> Vec<Op> {
    let size = |op: &Op| match op {
        Op::Append(records, _) => append_bytes(records),
        _ => 0,
    };
    let mut ops = Vec::new();
    let mut bytes = 0;
    while let Some(op) = q.ops.front() {
        if !ops.is_empty() && bytes >= max_batch_bytes {
            break;
        }
        bytes += size(op);
        ops.push(q.ops.pop_front().expect("a front"));
    }
    ops
}

/// A handle to the log. Cheap to share behind an `Arc`; one writer thread writes what is queued
/// (group commit), and [`Wal::append_inline`] lets a caller write its own append when nobody is.
pub struct Wal {
    shared: Arc<Shared>,
    max_batch_bytes: usize,
    lazy: LazyQueue,
    /// Groups whose unreleased records keep the oldest closed segment on disk (see [`Wal::pinning_groups`]).
    pinning: Arc<Mutex<Vec<u32>>>,
    rotations: Arc<Rotations>,
    thread: Mutex<Option<std::thread::JoinHandle<()>>>,
    /// In the simulation the writer is a task on the host's runtime (a thread would run outside
    /// simulated time); this wakes it.
    #[cfg(holdfast_sim)]
    wake: Arc<tokio::sync::Notify>,
}

impl Wal {
    /// Recovers the log in `dir` (created if missing) and starts the writer on a fresh segment.
    pub fn open(dir: &Path, mut options: WalOptions) -> Result<(Wal, Recovered), WalError> {
        // A frame is a batch plus the append that crosses its limit: both bounded, below the frame limit.
        options.max_batch_bytes = options.max_batch_bytes.min(MAX_APPEND_BYTES);
        crate::fs::create_dir_all(dir).map_err(io_err(dir))?;
        let (recovered, segments, standby) = recover(dir)?;
        let mut sticky = BTreeMap::new();
        for r in recovered.records.iter().filter(|r| r.sticky) {
            sticky.insert((r.group, r.kind), r.clone());
        }
        let next_seq = standby
            .as_ref()
            .map(|s| s.seq)
            .or(segments.last().map(|s| s.seq))
            .map_or(1, |seq| seq + 1);
        let standby = match standby {
            Some(Standby { seq, path }) => Some(Active::open_standby(seq, path)?),
            None => None,
        };
        let mut writer = Writer {
            dir: dir.to_path_buf(),
            options,
            segments: segments.into(),
            active: None,
            standby,
            next_seq,
            sticky,
            lazy: LazyQueue::default(),
            received: 0,
            released: BTreeMap::new(),
            poisoned: None,
            pinning: Arc::default(),
            rotations: Arc::default(),
        };
        let pinning = writer.pinning.clone();
        let rotations = writer.rotations.clone();
        let lazy = writer.lazy.clone();
        let max_batch_bytes = writer.options.max_batch_bytes;
        writer.rotate()?;
        // `rotate` made the first segment of this run durable (a reused standby: its pre-creation
        // synced it and its directory, and the rotation its cleared state and sticky records), so a
        // crash before the first commit still finds it in use and the segment before it complete.
        writer.pre_create()?;
        let shared = Arc::new(Shared {
            queue: Mutex::new(Queue {
                ops: VecDeque::new(),
                sent: 0,
                committing: false,
                idle: false,
                pre_create: false,
                closed: false,
            }),
            work: Condvar::new(),
            writer: Mutex::new(writer),
            thread_commits: AtomicU64::new(0),
            inline_commits: AtomicU64::new(0),
        });
        #[cfg(not(holdfast_sim))]
        let thread = {
            let shared = shared.clone();
            Some(
                std::thread::Builder::new()
                    .name("holdfast-wal".into())
                    .spawn(move || run(shared, max_batch_bytes))
                    .map_err(io_err(dir))?,
            )
        };
        #[cfg(holdfast_sim)]
        let (thread, wake) = {
            let wake = Arc::new(tokio::sync::Notify::new());
            tokio::spawn(run_sim(shared.clone(), max_batch_bytes, wake.clone()));
            (None, wake)
        };
        Ok((
            Wal {
                shared,
                max_batch_bytes,
                lazy,
                pinning,
                rotations,
                thread: Mutex::new(thread),
                #[cfg(holdfast_sim)]
                wake,
            },
            recovered,
        ))
    }

    /// Queues `records` to be written in order after everything queued before; `done` runs once they are
    /// durable. Records over [`MAX_RECORD_BYTES`], or more than [`MAX_APPEND_BYTES`] in all, fail the
    /// whole append without writing any of it.
    pub fn append(&self, records: Vec<Record>, done: Done) {
        self.submit(records, done, false);
    }

    /// As [`Wal::append`], but when no group commit is under way the caller's thread makes one
    /// itself: the queue's front up to `max_batch_bytes`, which holds its append and everything
    /// queued before it unless that is more than the limit (then its own is left to the writer
    /// thread), written, synced and completed before this returns. Otherwise the append is queued
    /// for the commit under way to pass on. For a caller with nothing better to do meanwhile (a
    /// follower's Raft thread, whose next message waits on this append): it saves the hand-off to
    /// the writer thread and back, two thread wake-ups per append. It blocks the calling thread for
    /// that commit: an `fdatasync`, and now and then more (the segment rotation that commit may
    /// start, a queued release's segment deletions and directory sync), so not for a thread whose
    /// other work must go on while the disk syncs. In the simulation it queues, as [`Wal::append`]
    /// does.
    pub fn append_inline(&self, records: Vec<Record>, done: Done) {
        self.submit(records, done, cfg!(not(holdfast_sim)));
    }

    /// [`Wal::append`] and [`Wal::append_inline`]: refuses what recovery could not read back, else
    /// queues (and with `inline` may commit) the append.
    fn submit(&self, records: Vec<Record>, done: Done, inline: bool) {
        if let Some(r) = records.iter().find(|r| r.payload.len() > MAX_RECORD_BYTES) {
            done(Err(WalError::RecordTooLarge {
                len: r.payload.len(),
            }));
            return;
        }
        let len = append_bytes(&records);
        if len > MAX_APPEND_BYTES {
            done(Err(WalError::AppendTooLarge { len }));
            return;
        }
        if let Err(done) = self.queue(Op::Append(records, done), inline) {
            done(Err(WalError::Closed));
        }
    }

    /// Queues `op`, waking the writer thread if it waits; with `inline`, commits the queue on this
    /// thread instead when nobody is committing. Err: the log is closed (the append's callback back).
    fn queue(&self, op: Op, inline: bool) -> Result<(), Done> {
        let mut q = self.shared.queue();
        if q.closed {
            return match op {
                Op::Append(_, done) => Err(done),
                Op::Release(..) => Ok(()),
            };
        }
        if matches!(op, Op::Append(..)) {
            q.sent += 1;
        }
        q.ops.push_back(op);
        if inline && !q.committing {
            q.committing = true;
            let ops = take(&mut q, self.max_batch_bytes);
            drop(q);
            let _unwinding = Committing(&self.shared);
            let mut writer = self.shared.writer();
            if writer.commit(ops) {
                self.shared.inline_commits.fetch_add(1, Ordering::Relaxed);
            }
            // Pre-creating a segment takes two syncs and a file: the thread's work, not this one's.
            let pre_create = writer.wants_pre_create();
            drop(writer);
            let mut q = self.shared.queue();
            q.committing = false;
            q.pre_create |= pre_create;
            // The thread waits while a commit is under way: for what was queued meanwhile, the
            // segment to pre-create, or a close that came during this commit.
            let wake = q.idle && (!q.ops.is_empty() || q.pre_create || q.closed);
            drop(q);
            if wake {
                self.shared.work.notify_one();
            }
        } else {
            let wake = q.idle && !q.committing;
            drop(q);
            if wake {
                self.shared.work.notify_one();
            }
        }
        #[cfg(holdfast_sim)]
        self.wake.notify_one();
        Ok(())
    }

    /// Queues `records` to be written with the next append that is waited for (or when the log closes),
    /// never on their own: for hints whose loss in a crash costs nothing, such as the committed index,
    /// which would otherwise cost a write and an `fdatasync` of its own after every commit. They keep
    /// their place in order after everything queued before them. Queuing them wakes no thread (they
    /// wait beside the queue, see [`LazyQueue`]): one a commit, that wake-up was half of all the
    /// writer thread's.
    pub fn append_lazy(&self, records: Vec<Record>) {
        if records.iter().any(|r| r.payload.len() > MAX_RECORD_BYTES) {
            return;
        }
        let q = self.shared.queue();
        if !q.closed {
            self.lazy
                .lock()
                .expect("wal lazy queue lock")
                .push_back((q.sent, records));
        }
    }

    /// Appends and blocks until durable. For callers that are not latency-critical (votes, tests).
    pub fn append_blocking(&self, records: Vec<Record>) -> Result<(), WalError> {
        let (tx, rx) = std::sync::mpsc::channel();
        self.append(records, Box::new(move |r| drop(tx.send(r))));
        rx.recv().unwrap_or(Err(WalError::Closed))
    }

    /// Says that records of `group` with `index <= index` are no longer needed (they are in a snapshot).
    /// Whole segments whose records are all released, oldest first, are deleted.
    pub fn release(&self, group: u32, index: u64) {
        let _ = self.queue(Op::Release(group, index), false);
    }

    /// The groups that keep the oldest closed segment from being deleted: each has a record in it that
    /// it has not released (purged) yet. Empty while no closed segment waits. A group that rarely writes
    /// would otherwise pin old segments for ever; the owner compacts such a group (the server snapshots
    /// it and purges its log) so that disk use stays bounded.
    pub fn pinning_groups(&self) -> Vec<u32> {
        self.pinning.lock().expect("wal pinning lock").clone()
    }

    /// How many segments were started from a pre-created file, and how many had to be created inside the
    /// commit that filled the previous one (when pre-creating had no chance to run: a commit that filled
    /// the segment from less than half full).
    pub fn rotations(&self) -> (u64, u64) {
        (
            self.rotations.pre_created.load(Ordering::Relaxed),
            self.rotations.created_inline.load(Ordering::Relaxed),
        )
    }

    /// Group commits so far that had an append to write: made by the writer thread, and inline by
    /// callers of [`Wal::append_inline`] (each writes a frame and syncs it, unless the log has
    /// stopped; a commit that rotates the segment syncs more).
    pub fn commits(&self) -> (u64, u64) {
        (
            self.shared.thread_commits.load(Ordering::Relaxed),
            self.shared.inline_commits.load(Ordering::Relaxed),
        )
    }

    /// Whether [`Wal::close`] has begun: appends from now on fail with [`WalError::Closed`].
    pub fn closing(&self) -> bool {
        self.shared.queue().closed
    }

    /// Stops the writer after it has finished everything queued.
    pub fn close(&self) {
        self.shared.queue().closed = true;
        self.shared.work.notify_one();
        #[cfg(holdfast_sim)]
        self.wake.notify_one();
        if let Some(thread) = self.thread.lock().expect("wal thread lock").take() {
            let _ = thread.join();
        }
    }

    /// Paths of the segment files in use, oldest first, without the pre-created one (for tests and tools).
    pub fn segment_paths(dir: &Path) -> Result<Vec<PathBuf>, WalError> {
        let mut paths = Vec::new();
        for (_, path) in crate::recover::list_segments(dir)? {
            if !crate::recover::is_empty_standby(&path)? {
                paths.push(path);
            }
        }
        Ok(paths)
    }
}

impl Drop for Wal {
    fn drop(&mut self) {
        self.close();
    }
}

#[derive(Default)]
struct Rotations {
    pre_created: AtomicU64,
    created_inline: AtomicU64,
}

/// A segment file open for writing: the active one, or the pre-created standby.
struct Active {
    file: File,
    path: PathBuf,
    /// Bytes written, all synced once a commit completes (a rotation syncs the cleared state and the
    /// sticky frame before the commit's frame is written). Frames are written at this offset: the file is
    /// not opened in append mode, because Linux's `pwrite` ignores the offset in append mode and the
    /// standby's state word must be rewritten in place.
    len: u64,
    /// The file's length as this writer made it: zeros from `len` to here ([`ZERO_AHEAD_BYTES`]). Cut
    /// back to `len` before the segment is closed, so only the segment in use can end in zeros.
    zeroed: u64,
    seq: u64,
    max_index: BTreeMap<u32, u64>,
}

impl Active {
    fn open_standby(seq: u64, path: PathBuf) -> Result<Active, WalError> {
        let file = OpenOptions::new()
            .write(true)
            .open(&path)
            .map_err(io_err(&path))?;
        Ok(Active {
            file,
            path,
            len: crate::format::SEGMENT_HEADER_BYTES,
            zeroed: crate::format::SEGMENT_HEADER_BYTES,
            seq,
            max_index: BTreeMap::new(),
        })
    }

    /// Where the next frame goes.
    fn place(&self) -> Place {
        Place {
            seq: self.seq,
            version: SEGMENT_VERSION,
            offset: self.len,
        }
    }

    fn write(&mut self, bytes: &[u8]) -> Result<(), WalError> {
        self.file
            .write_all_at(bytes, self.len)
            .map_err(io_err(&self.path))?;
        self.zeroed = self.zeroed.max(self.len + bytes.len() as u64);
        Ok(())
    }

    /// Fills the file with zeros from `from` (the end of a frame just written) to `to`, if it is not
    /// that long yet: best effort, since a sync is as safe (only slower) without it. On a disk too full
    /// for the zeros the frames still go in, extending the file as they did before zeros were written.
    fn zero_ahead(&mut self, from: u64, to: u64) {
        let from = from.max(self.zeroed);
        if from >= to {
            return;
        }
        let zeros = vec![0u8; (to - from) as usize];
        match self.file.write_all_at(&zeros, from) {
            Ok(()) => self.zeroed = to,
            Err(e) => {
                // Part of the zeros may be in: the file may be anywhere from `from` to `to` long, all
                // zeros past `from`. `to` is the bound `trim` needs to cut them all off.
                self.zeroed = to;
                tracing::debug!(error = %e, path = %self.path.display(), "could not write zeros ahead of the wal's frames");
            }
        }
    }

    /// Cuts the zeros written ahead ([`Active::zero_ahead`]) off the file and makes that durable: a
    /// closed segment ends at its last frame, so recovery reads zeros only at the end of the segment
    /// that was in use.
    fn trim(&mut self) -> Result<(), WalError> {
        if self.zeroed > self.len {
            self.file.set_len(self.len).map_err(io_err(&self.path))?;
            self.file.sync_data().map_err(io_err(&self.path))?;
            self.zeroed = self.len;
        }
        Ok(())
    }
}

/// A group commit between its write and its sync.
#[derive(Default)]
struct Batch {
    dones: Vec<Done>,
    releases: Vec<(u32, u64)>,
    sticky: Vec<Record>,
    index: BTreeMap<u32, u64>,
    records: usize,
    /// The frame's length, or why writing it failed; None if the batch had no appends.
    written: Option<Result<u64, WalError>>,
}

struct Writer {
    dir: PathBuf,
    options: WalOptions,
    /// Closed segments, oldest first.
    segments: VecDeque<SegmentInfo>,
    active: Option<Active>,
    /// The next segment, created and made durable ahead of time so that the commit which fills the
    /// active segment does not also create a file, fsync it and fsync the directory.
    standby: Option<Active>,
    next_seq: u64,
    /// The latest sticky record per (group, kind), rewritten at the head of each new segment.
    sticky: BTreeMap<(u32, u8), Record>,
    /// Lazy records waiting for the frame of the append they follow ([`Wal::append_lazy`]).
    lazy: LazyQueue,
    /// Appends taken from the queue so far (compared with the lazy records' stamps).
    received: u64,
    released: BTreeMap<u32, u64>,
    poisoned: Option<String>,
    pinning: Arc<Mutex<Vec<u32>>>,
    rotations: Arc<Rotations>,
}

/// The writer thread: commits whatever is queued while nobody else is committing (an inline commit,
/// [`Wal::append_inline`], may be), pre-creates the next segment when it has nothing queued, and at
/// close finishes the queue.
#[cfg(not(holdfast_sim))]
fn run(shared: Arc<Shared>, max_batch_bytes: usize) {
    let mut q = shared.queue();
    loop {
        if q.committing || (q.ops.is_empty() && !q.pre_create) {
            if q.closed && !q.committing && q.ops.is_empty() {
                q.committing = true;
                drop(q);
                return shared.close_writer();
            }
            q.idle = true;
            q = shared.work.wait(q).expect("wal queue lock");
            q.idle = false;
            continue;
        }
        q.committing = true;
        q.pre_create = false;
        let ops = take(&mut q, max_batch_bytes);
        drop(q);
        let _unwinding = Committing(&shared);
        let mut writer = shared.writer();
        if writer.commit(ops) {
            shared.thread_commits.fetch_add(1, Ordering::Relaxed);
        }
        let idle = shared.queue().ops.is_empty();
        writer.maybe_pre_create(idle);
        drop(writer);
        q = shared.queue();
        q.committing = false;
    }
}

/// The simulation's writer: the same commit, as a task in simulated time (batches are whatever
/// queued up, to `max_batch_bytes`, which the simulation draws per seed). Nothing commits inline there.
#[cfg(holdfast_sim)]
async fn run_sim(shared: Arc<Shared>, max_batch_bytes: usize, wake: Arc<tokio::sync::Notify>) {
    loop {
        let (ops, closed) = {
            let mut q = shared.queue();
            (take(&mut q, max_batch_bytes), q.closed)
        };
        if ops.is_empty() {
            if closed {
                return shared.close_writer();
            }
            wake.notified().await;
            continue;
        }
        let _unwinding = Committing(&shared);
        // Written, then synced after the simulated disk time: a crash in between finds the frame
        // pending, which turmoil's disk loses, keeps, or tears.
        let (batch, delay) = {
            let mut writer = shared.writer();
            (writer.write(ops), writer.options.sim_sync_delay)
        };
        tokio::time::sleep(delay).await;
        let mut writer = shared.writer();
        if batch.written.is_some() {
            shared.thread_commits.fetch_add(1, Ordering::Relaxed);
        }
        writer.sync(batch);
        // Pre-creating takes no simulated time, so the simulation always does it at once.
        writer.maybe_pre_create(true);
    }
}

impl Writer {
    /// One group commit: writes `ops` as one frame and syncs it, then completes them. Whether it
    /// had an append (a frame to write and sync; releases alone write nothing).
    fn commit(&mut self, ops: Vec<Op>) -> bool {
        let batch = self.write(ops);
        let frame = batch.written.is_some();
        self.sync(batch);
        frame
    }

    /// Whether [`Writer::maybe_pre_create`] would create a segment now, were the writer idle.
    fn wants_pre_create(&self) -> bool {
        self.standby.is_none() && self.poisoned.is_none()
    }

    /// As the log closes: writes the lazy records still waiting (best effort: they are hints), and cuts
    /// the zeros written ahead off the active segment (recovery would cut them too; a log closed
    /// cleanly leaves files that end at their last frame).
    fn close(&mut self) {
        let waiting = !self.lazy.lock().expect("wal lazy queue lock").is_empty();
        if waiting && self.poisoned.is_none() {
            let batch = self.write(vec![Op::Append(Vec::new(), Box::new(|_| {}))]);
            self.sync(batch);
        }
        if self.poisoned.is_none() {
            if let Some(Err(e)) = self.active.as_mut().map(Active::trim) {
                tracing::warn!(error = %e, "could not cut the zeros off the wal's last segment at close; recovery will");
            }
        }
    }

    /// First half of a group commit: encodes the batch and writes it (not yet durable). Lazy records
    /// wait for a batch with an append someone waits for, and go in after the appends sent before them.
    fn write(&mut self, ops: Vec<Op>) -> Batch {
        let mut b = Batch::default();
        if !ops.iter().any(|op| matches!(op, Op::Append(..))) {
            for op in ops {
                if let Op::Release(group, index) = op {
                    b.releases.push((group, index));
                }
            }
            return b;
        }
        let mut records = Vec::new();
        {
            let mut lazy = self.lazy.lock().expect("wal lazy queue lock");
            let mut sent_after = |received: u64, records: &mut Vec<Record>| {
                while let Some((_, rs)) = lazy.pop_front_if(|(stamp, _)| *stamp <= received) {
                    records.extend(rs);
                }
            };
            for op in ops {
                match op {
                    Op::Append(rs, done) => {
                        sent_after(self.received, &mut records);
                        records.extend(rs);
                        self.received += 1;
                        b.dones.push(done);
                    }
                    Op::Release(group, index) => b.releases.push((group, index)),
                }
            }
            sent_after(self.received, &mut records);
        }
        // The frame in one buffer of its size: room for its header, then the records. (Before
        // a64aa7b a body grown from empty was reallocated ~8 times for a batch of a few KiB, then
        // copied into a second buffer behind the header.)
        let mut frame = Vec::with_capacity(FRAME_HEADER_BYTES + append_bytes(&records));
        frame.resize(FRAME_HEADER_BYTES, 0);
        for r in &records {
            encode_record(&mut frame, r);
            if r.sticky {
                b.sticky.push(r.clone());
            } else {
                let m = b.index.entry(r.group).or_insert(0);
                *m = r.index.max(*m);
            }
        }
        b.records = records.len();
        b.written = Some(self.write_frame(&mut frame));
        b
    }

    /// Second half: syncs what [`Writer::write`] wrote, then completes the batch's appends.
    fn sync(&mut self, b: Batch) {
        let Batch {
            dones,
            releases,
            sticky,
            index,
            records,
            written,
        } = b;
        let result = written.map(|w| w.and_then(|frame| self.sync_frame(frame, records)));
        match &result {
            Some(Ok(())) => {
                for r in sticky {
                    self.sticky.insert((r.group, r.kind), r);
                }
                let active = self.active.as_mut().expect("an active segment");
                for (g, i) in index {
                    let m = active.max_index.entry(g).or_insert(0);
                    *m = i.max(*m);
                }
            }
            Some(Err(e)) => {
                tracing::error!(error = %e, "wal write failed; the log is stopped and will not retry");
                self.poisoned.get_or_insert(e.to_string());
            }
            None => {}
        }
        // Releases are applied before the batch's appends are completed, so an append queued after a
        // release returns only once the released segments are gone.
        for (group, index) in releases {
            let r = self.released.entry(group).or_insert(0);
            *r = index.max(*r);
        }
        // Nothing is deleted once the log has failed: the sticky records of a segment that a failed batch
        // started may not be durable, and the older segments still hold them.
        if self.poisoned.is_some() {
        } else if let Err(e) = self.delete_released() {
            tracing::warn!(error = %e, "could not delete a released wal segment; will retry on the next release");
        }
        match result {
            Some(Ok(())) => dones.into_iter().for_each(|done| done(Ok(()))),
            Some(Err(e)) => {
                let msg = e.to_string();
                dones
                    .into_iter()
                    .for_each(|done| done(Err(WalError::Poisoned(msg.clone()))));
            }
            None => {}
        }
    }

    /// Appends one frame to the active segment (rotating first if it would not fit). Returns its length.
    /// `frame` is the frame's header, not yet written ([`seal_frame`] writes it here), and its body.
    fn write_frame(&mut self, frame: &mut [u8]) -> Result<u64, WalError> {
        if let Some(p) = &self.poisoned {
            return Err(WalError::Poisoned(p.clone()));
        }
        let frame_len = frame.len() as u64;
        let full = self
            .active
            .as_ref()
            .is_some_and(|a| a.len + frame_len > self.options.segment_bytes);
        if full {
            let pre_created = self.standby.is_some();
            self.rotate()?;
            crate::failpoint::hit("wal.rotate").map_err(io_err(&self.dir))?;
            let counter = match pre_created {
                true => &self.rotations.pre_created,
                false => &self.rotations.created_inline,
            };
            counter.fetch_add(1, Ordering::Relaxed);
        }
        let segment_bytes = self.options.segment_bytes;
        let active = self.active.as_mut().expect("an active segment");
        // Sealed only now: the checksum covers the place, which a rotation just changed.
        seal_frame(frame, active.place());
        let reached = crate::failpoint::hit_then("wal.write", || {
            let _ = active.write(&frame[..frame.len() / 2]);
        });
        reached.map_err(io_err(&active.path))?;
        let end = active.len + frame_len;
        let short = end > active.zeroed;
        active.write(frame)?;
        // Zeros ahead of the frames, so that while frames land below the file's length their syncs
        // commit no new length ([`ZERO_AHEAD_BYTES`]); never past the segment's size, where it
        // rotates. Written after the frame, so a disk with no room for them still takes it.
        if short {
            active.zero_ahead(end, (end + ZERO_AHEAD_BYTES).min(segment_bytes));
        }
        Ok(frame_len)
    }

    /// Makes the frame just written durable.
    fn sync_frame(&mut self, frame_len: u64, records: usize) -> Result<(), WalError> {
        let active = self.active.as_mut().expect("an active segment");
        let started = Instant::now();
        if let Some(fault) = &self.options.sync_fault {
            fault().map_err(io_err(&active.path))?;
        }
        crate::failpoint::hit("wal.sync").map_err(io_err(&active.path))?;
        active.file.sync_data().map_err(io_err(&active.path))?;
        active.len += frame_len;
        if let Some(observer) = &self.options.observer {
            observer(SyncStats {
                records,
                bytes: frame_len as usize,
                sync_duration: started.elapsed(),
            });
        }
        Ok(())
    }

    /// Closes the active segment and starts the next, beginning with the latest sticky records. The next
    /// is the pre-created standby when there is one: its state word is cleared and the sticky records
    /// written and synced before the commit's frame is written. Without that sync a crash could keep
    /// the state word and the commit's frame but lose the sticky frame between them: a bad frame with a
    /// valid one after it, which recovery must refuse as corruption although nothing in it was
    /// acknowledged. One more `fdatasync` per segment (64 MiB) buys that. Without a standby a file is
    /// created, synced and its directory synced here.
    ///
    /// The standby's whole header is rewritten, not just its state word: a standby pre-created by an
    /// older release carries that release's format version, and its frames are written in this one's.
    fn rotate(&mut self) -> Result<(), WalError> {
        // First the closing segment loses its zeros, durably: once the next segment is in use, recovery
        // takes this one to be complete and reads zeros at its end as damage.
        if let Some(active) = self.active.as_mut() {
            active.trim()?;
        }
        let mut sticky_body = Vec::new();
        for r in self.sticky.values() {
            encode_record(&mut sticky_body, r);
        }
        let sticky_frame = |at: Place| {
            let mut frame = Vec::new();
            if !sticky_body.is_empty() {
                encode_frame(&mut frame, at, &sticky_body);
            }
            frame
        };
        let next = match self.standby.take() {
            Some(mut standby) => {
                standby
                    .file
                    .write_all_at(&segment_header(0), 0)
                    .map_err(io_err(&standby.path))?;
                let sticky_frame = sticky_frame(standby.place());
                standby.write(&sticky_frame)?;
                standby.len += sticky_frame.len() as u64;
                if let Some(fault) = &self.options.sync_fault {
                    fault().map_err(io_err(&standby.path))?;
                }
                standby.file.sync_data().map_err(io_err(&standby.path))?;
                standby
            }
            None => {
                let mut next = self.create_segment(0)?;
                let sticky_frame = sticky_frame(next.place());
                next.write(&sticky_frame)?;
                next.len += sticky_frame.len() as u64;
                next.file.sync_all().map_err(io_err(&next.path))?;
                sync_dir(&self.dir)?;
                next
            }
        };
        if let Some(old) = self.active.take() {
            self.segments.push_back(SegmentInfo {
                seq: old.seq,
                path: old.path,
                max_index: old.max_index,
            });
        }
        self.update_pinning();
        self.active = Some(next);
        Ok(())
    }

    /// Creates segment `next_seq` with just its header (not yet synced).
    fn create_segment(&mut self, state: u32) -> Result<Active, WalError> {
        let seq = self.next_seq;
        let path = self.dir.join(segment_name(seq));
        let file = OpenOptions::new()
            .create_new(true)
            .write(true)
            .open(&path)
            .map_err(io_err(&path))?;
        let mut segment = Active {
            file,
            path,
            len: 0,
            zeroed: 0,
            seq,
            max_index: BTreeMap::new(),
        };
        let header = segment_header(state);
        if let Err(e) = segment.write(&header) {
            // Nothing is in it: a file left without its header only has recovery guess why.
            let _ = crate::fs::remove_file(&segment.path);
            return Err(e);
        }
        segment.len = header.len() as u64;
        self.next_seq = seq + 1;
        Ok(segment)
    }

    /// Pre-creates the next segment when there is none: right away when the writer has nothing queued,
    /// otherwise once the active segment is half full (so a busy log pays the two syncs once per segment,
    /// on a commit that does not also rotate).
    fn maybe_pre_create(&mut self, idle: bool) {
        if self.standby.is_some() || self.poisoned.is_some() {
            return;
        }
        let half_full = self
            .active
            .as_ref()
            .is_some_and(|a| a.len >= self.options.segment_bytes / 2);
        if !(idle || half_full) {
            return;
        }
        if let Err(e) = self.pre_create() {
            tracing::error!(error = %e, "could not pre-create the next wal segment; the log is stopped");
            self.poisoned.get_or_insert(e.to_string());
        }
    }

    /// Creates the next segment marked standby, and makes it and its directory entry durable. If that
    /// fails (a full disk), the file is removed, best effort; should a crash leave it without its header,
    /// recovery reads a last file that holds nothing as the end of the log, not as a segment in use.
    fn pre_create(&mut self) -> Result<(), WalError> {
        let standby = self.create_segment(STANDBY)?;
        let synced = standby
            .file
            .sync_all()
            .map_err(io_err(&standby.path))
            .and_then(|()| sync_dir(&self.dir));
        if let Err(e) = synced {
            let _ = crate::fs::remove_file(&standby.path);
            return Err(e);
        }
        self.standby = Some(standby);
        Ok(())
    }

    /// Recomputes [`Wal::pinning_groups`] from the oldest closed segment.
    fn update_pinning(&self) {
        let groups = self.segments.front().map_or_else(Vec::new, |oldest| {
            oldest
                .max_index
                .iter()
                .filter(|(g, max)| self.released.get(g).is_none_or(|r| *max > r))
                .map(|(g, _)| *g)
                .collect()
        });
        *self.pinning.lock().expect("wal pinning lock") = groups;
    }

    fn delete_released(&mut self) -> Result<(), WalError> {
        let mut deleted = false;
        while let Some(oldest) = self.segments.front() {
            let releasable = oldest
                .max_index
                .iter()
                .all(|(g, max)| self.released.get(g).is_some_and(|r| max <= r));
            if !releasable {
                break;
            }
            crate::fs::remove_file(&oldest.path).map_err(io_err(&oldest.path))?;
            crate::failpoint::hit("wal.purge").map_err(io_err(&oldest.path))?;
            self.segments.pop_front();
            deleted = true;
        }
        if deleted {
            sync_dir(&self.dir)?;
        }
        self.update_pinning();
        Ok(())
    }
}
