//! A segmented write-ahead log with group commit.
//!
//! One `Wal` per server holds the Raft logs and votes of every group (records are tagged by group). It is
//! deliberately ignorant of Raft: a [`Record`] is `(group, kind, index, payload)` and the owner interprets
//! it on replay. The WAL only guarantees:
//!
//! - **Durability.** An append's completion callback runs only after the bytes are on disk
//!   (`fdatasync`). One writer thread batches every append that is waiting into one frame, writes it, syncs
//!   once, then completes them all (group commit). [`Wal::append_inline`] lets a caller that has nothing
//!   else to do meanwhile make that commit on its own thread when none is under way (no hand-off to the
//!   writer thread and back); one commit at a time, whoever makes it, each taking the queue's front.
//! - **Order.** Records come back from [`Wal::open`] in exactly the order they were appended.
//! - **Detected corruption.** Every frame carries a CRC-32. On open, an invalid frame at the end of the last
//!   segment is a torn write from a crash: it is cut off (a copy is kept beside the segment) and recovery
//!   continues. An invalid frame anywhere else means acknowledged data is damaged, and `open` refuses with
//!   an error naming the file and offset.
//! - **Fail-stop.** If a write or sync fails, the WAL is poisoned: that append and every later one fails.
//!   It never retries a failed fsync, because after a failed fsync the kernel may have dropped the dirty
//!   pages and a retry can report success for data that is gone.
//! - **Syncs that do not grow the file.** The segment in use is filled with zeros ahead of its frames
//!   ([`ZERO_AHEAD_BYTES`] at a time), so most syncs flush data into blocks the file already has and
//!   commit no new length through the file system's journal. Recovery reads zeros from a frame's start
//!   to the end of the tail segment (the last, or the one before an empty standby or a file that never
//!   got its header) as its clean end and cuts them; a segment is cut to its last frame, durably, before
//!   the next one starts, so zeros anywhere else are damage.
//! - **Bounded size.** Segments roll over at [`WalOptions::segment_bytes`]. Records marked *sticky* (votes,
//!   purge points) are rewritten at the head of each new segment, so an old segment can be deleted once the
//!   owner says, through [`Wal::release`], that its entries are no longer needed.
//! - **Rotation off the commit path.** The next segment is created and synced ahead of time, marked
//!   standby in its header. Starting it clears that mark and writes the sticky records, synced on
//!   their own before the commit that needed the segment writes its frame, so a segment still marked
//!   standby holds nothing acknowledged and recovery cuts whatever follows its header. (That commit
//!   also cuts the zeros off the closing segment and syncs the cut first: one sync more per segment.)
//!
//! On-disk format: see [`format`].

pub mod failpoint;
pub mod format;
pub mod fs;
mod recover;
mod writer;

pub use format::{Record, MAX_APPEND_BYTES, MAX_RECORD_BYTES};
pub use recover::{scan_segment, Recovered, Scan, TornTail};
pub use writer::{Done, SyncFault, SyncObserver, SyncStats, Wal, WalOptions, ZERO_AHEAD_BYTES};

use std::path::PathBuf;

/// Errors from opening or writing the log.
#[derive(Debug, thiserror::Error)]
pub enum WalError {
    #[error("wal i/o error on {path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("wal is corrupt: {path} at offset {offset}: {reason}; refusing to start because this is not a torn tail (only the end of the last segment can be torn by a crash)")]
    Corrupt {
        path: PathBuf,
        offset: u64,
        reason: String,
    },
    #[error("wal is stopped after an earlier write or fsync failure ({0}); the server must restart and recover from disk")]
    Poisoned(String),
    #[error("wal record of {len} bytes is over the limit of {max} bytes (max_record_bytes)", max = MAX_RECORD_BYTES)]
    RecordTooLarge { len: usize },
    #[error("wal append of {len} bytes is over the limit of {max} bytes (max_append_bytes)", max = MAX_APPEND_BYTES)]
    AppendTooLarge { len: usize },
    #[error("wal writer has shut down")]
    Closed,
}
