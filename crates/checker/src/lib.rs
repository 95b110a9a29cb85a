//! The fault tests' checker: reads what happened and says which safety property, if any, was violated.
//!
//! Inputs (see `crates/holdfast/tests/it/faults.rs`):
//! - the **history**: every client operation (`holdfast workload`), with invoke and complete times and a
//!   result `ok` (happened), `fail` (did not happen) or `unknown` (may have happened);
//! - each server's **audit log**: one line per command it applied (index, command, outcome, events);
//! - the **fenced store's log**: every write and mark it accepted, in order.
//!
//! Properties (DESIGN.md §9):
//! - **P1** at most one holder per lock at every applied index (a model replays the merged log);
//! - **P2** replicas agree: every index applied on several servers applied the same command with the same
//!   outcome and events;
//! - **P3** tokens: a grant's token is its log index; per lock the tokens of acknowledged grants are unique,
//!   and a grant that completed before another was invoked has the smaller token;
//! - **P4** the fenced store's tokens never go down per key, its counter increments never repeat (no lost
//!   update), and every acknowledged write is in it;
//! - **P5** every acknowledged session open, grant and release is in the servers' applied log;
//! - **P6** no early expiry: an `ExpireSession` (or each session of an `ExpireSessions`) is proposed no earlier than the send time of the session's
//!   last acknowledged renewal plus its TTL (client and servers share the machine's wall clock; a 100 ms
//!   margin absorbs slewing).
//!
//! - **P9** watch streams are the log: the events a watcher received are, in order, with no gap and no
//!   repeat, the log's changes under its prefix after the index its watch started at.
//! - **P10** a lock in its lock-delay is granted only by the `EndLockDelay` of that delay, no earlier than
//!   the delay after the expiry (leader wall clock, 100 ms margin).
//! - **linearizable reads**: every `describe` returns the lock's holder as of some log index between the
//!   grants and opens (whose log indexes the history knows) that completed before it and those invoked
//!   after it completed.
//!
//! Files (`src/`):
//! - `lib.rs`: this overview and the public re-exports;
//! - `model.rs`: the inputs ([`Op`], [`AuditLine`], [`StoreRecord`]) and [`parse_lines`];
//! - `check.rs`: [`check()`], which runs every property below in order, and its [`Report`];
//!   [`check_groups`], which checks a cluster of several Raft groups one group at a time;
//! - `properties/mod.rs`: the properties' order and the data they pass on (merged log, grants, timelines);
//! - `properties/p1_one_holder.rs`: P1 (and the log side of P3), by replaying the merged log;
//! - `properties/p2_replicas_agree.rs`: P2, and merging the servers' audit logs into one applied log;
//! - `properties/p3_tokens.rs`: P3 on the history (unique tokens per lock, real-time order);
//! - `properties/p4_fenced_store.rs`: P4;
//! - `properties/p5_acknowledged_in_log.rs`: P5;
//! - `properties/p6_no_early_expiry.rs`: P6 and its margin, `EXPIRY_MARGIN_MS`;
//! - `properties/linearizable_reads.rs`: linearizable reads;
//! - `properties/p9_watch_streams.rs`: P9;
//! - `properties/p10_lock_delay.rs`: P10;
//! - `tests.rs`: known-good and known-bad histories, each bad one caught by the right property.

// A pure function of its inputs, run after the simulation: hash maps cannot change what it reports.
#![allow(clippy::disallowed_types)]

mod check;
mod model;
pub mod properties;

pub use check::{check, check_groups, Report};
pub use model::{parse_lines, AuditLine, Op, StoreRecord};

#[cfg(test)]
mod tests;
