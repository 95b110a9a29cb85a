//! The Holdfast lock table: a pure, deterministic state machine.
//!
//! Every replica applies the same committed log entries, in the same order, to a [`LockTable`], so every
//! replica holds the same table (property P2). To make that true by construction this crate has
//! **no clock, no randomness, no I/O and no async runtime**: time enters only as `now_ms`, a value the
//! leader stamped into the [`Command`] before proposing it, and fencing tokens and session ids are the
//! Raft log index of the entry that created them, which the caller passes to [`LockTable::apply`].
//!
//! Layout:
//! - [`types`]: newtypes for identities (`SessionId`, `LockName`, `FencingToken`, `GroupId`, `RequestId`).
//! - [`limits`]: every bound the table enforces, with the reason for each number.
//! - [`command`]: the commands (log entry payloads) and their outcomes.
//! - [`table`]: the state and `apply`, plus read-only views for describe/list.
//! - `cow`: the copy-on-write map the table's sessions and locks live in, so a snapshot can be written
//!   a chunk at a time while entries keep being applied.
//! - `chunk_map`: the ordered map under it (sorted runs of entries, values in place, kept nearly full),
//!   which holds a million locks in about two thirds of a `BTreeMap`'s memory.
//! - `held`: each session's set of held names, packed into one allocation of its bytes while small.
//! - [`snapshot`]: a versioned, checksummed encoding of the whole table and its digest.
//! - [`name`]: lock-name rules and the stable name → group hash.
//!
//! Invariants (checked by `LockTable::check_invariants`, used by tests and simulations):
//! - a lock has one exclusive holder, or any number (at most `MAX_HOLDERS_PER_LOCK`) of shared holders,
//!   or at most its permits of holders if it is a semaphore; every holder's session exists and lists
//!   the lock as held (or, in a lock-delay after its holder expired, the holder is session 0, which
//!   never exists);
//! - the first waiter never fits beside the holders (it would have been granted);
//! - a session never both holds and waits for the same lock, and never waits twice in one queue;
//! - tokens are log indexes, so they strictly increase per lock and are never 0.

mod chunk_map;
pub mod command;
mod cow;
mod dedup;
mod held;
pub mod limits;
pub mod name;
pub mod snapshot;
pub mod table;
pub mod types;

pub use command::{
    AcquireMode, Change, ChangeKind, Command, Delay, Event, Outcome, QuotaKind, QuotaLimits,
    Refusal, Share,
};
pub use name::{group_for, validate_name, NameError};
pub use snapshot::{SnapshotError, SnapshotWriter};
pub use table::{HolderView, LockTable, LockView, SessionView, WaiterView};
pub use types::{FencingToken, GroupId, LockName, RequestId, SessionId};

#[cfg(test)]
mod tests;

#[cfg(test)]
mod shared_tests;

#[cfg(test)]
mod budget_tests;

#[cfg(test)]
mod expiry_tests;
