//! The safety properties, one file per property (DESIGN.md §9). Each module's `check` appends one sentence
//! per violation, naming the property and the evidence, to `v`; [`crate::check()`] runs them all.
//!
//! Some checks build on what another one computed, so they run in this order:
//! 1. [`p2_replicas_agree`] merges the servers' audit logs into one applied log ([`MergedLog`]);
//! 2. [`p1_one_holder`] replays that log: it checks P1 (and the log side of P3) and returns every grant in
//!    the log ([`Grants`]) and each lock's holder over the log ([`Timelines`]);
//! 3. [`linearizable_reads`] checks `describe` results against the [`Timelines`];
//! 4. [`p3_tokens`] checks the history's tokens;
//! 5. [`p5_acknowledged_in_log`] checks acknowledged operations against the [`MergedLog`] and [`Grants`];
//! 6. [`p4_fenced_store`] checks the fenced store's log against the history;
//! 7. [`p6_no_early_expiry`] checks expiries in the [`MergedLog`] against the history's renewals;
//! 8. [`linearizable_locks`] searches the history alone for a linearization of each lock's operations;
//! 9. [`p8_no_unknowing_holder`] checks that grants no client acknowledged end, from the [`Timelines`];
//! 10. [`p9_watch_streams`] checks the events watchers received against the changes in the [`MergedLog`];
//! 11. [`p10_lock_delay`] checks that no lock is granted during a lock-delay, from the [`MergedLog`];
//! 12. [`p11_shared_holders`] checks shared locks and semaphores (whose names 2–11 skip where they
//!     assume one holder), from the [`MergedLog`], adding their grants to [`Grants`] before P5.

pub mod linearizable_locks;
pub mod linearizable_reads;
pub mod p10_lock_delay;
pub mod p11_shared_holders;
pub mod p1_one_holder;
pub mod p2_replicas_agree;
pub mod p3_tokens;
pub mod p4_fenced_store;
pub mod p5_acknowledged_in_log;
pub mod p6_no_early_expiry;
pub mod p8_no_unknowing_holder;
pub mod p9_watch_streams;

pub use p1_one_holder::{Grants, Timelines};
pub use p2_replicas_agree::MergedLog;
