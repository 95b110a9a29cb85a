//! The resource side of fencing.
//!
//! A lock alone cannot protect a resource: a holder can pause (GC, a stalled VM, a slow network) for longer
//! than its lease, lose the lock without knowing, and write afterwards. Every Holdfast grant carries a
//! fencing token that strictly increases per lock; the **resource** must remember the highest token it
//! has seen and refuse anything older. This crate gives that check for the resources we test against:
//!
//! - [`store::FencedStore`]: the reference fenced store, a small durable key-value store (and, in
//!   [`service`], its gRPC service and client) used by Holdfast's own end-to-end and fault tests.
//! - [`sql`]: the pattern for SQL databases (a fencing table updated first, in the same transaction as the
//!   protected reads and writes), with helpers for SQLite ([`sqlite`], feature `sqlite`) and PostgreSQL
//!   ([`postgres`], feature `postgres`).
//!
//! Both fence **whole read-modify-write operations**, not only writes: a fenced read raises the mark too.
//! With write-only fencing, a stale holder's write can land after the new holder has read but before it
//! writes; the new holder's write then silently overwrites it and an acknowledged update is lost although
//! no stale write was ever refused. See `docs/fencing.md`.

/// The store's files: `std::fs`, or turmoil's simulated file system in the simulation (`--cfg holdfast_sim`).
mod fs {
    #[cfg(not(holdfast_sim))]
    pub(crate) use std::fs::*;
    #[cfg(holdfast_sim)]
    pub(crate) use turmoil::fs::shim::std::fs::*;

    /// Makes the directory's entries (a created file) durable.
    #[cfg(not(holdfast_sim))]
    pub(crate) fn sync_dir(dir: &std::path::Path) -> std::io::Result<()> {
        File::open(dir)?.sync_all()
    }
    #[cfg(holdfast_sim)]
    pub(crate) fn sync_dir(dir: &std::path::Path) -> std::io::Result<()> {
        turmoil::fs::shim::std::fs::sync_dir(dir)
    }
}
pub mod service;
pub mod sql;
pub mod store;

#[cfg(feature = "postgres")]
pub mod postgres;
#[cfg(feature = "sqlite")]
pub mod sqlite;

/// A fenced operation was refused, or failed.
#[derive(Debug, thiserror::Error)]
pub enum FenceError {
    /// The token is lower than the highest the resource has seen: the caller no longer holds the lock.
    #[error("stale token {token} for {resource:?}: the resource has seen token {seen}")]
    Stale {
        resource: String,
        token: u64,
        seen: u64,
    },
    #[error("{0}")]
    Invalid(String),
    #[error("fenced store i/o error: {0}")]
    Io(#[from] std::io::Error),
    #[error("database error: {0}")]
    Database(String),
    #[error("fenced store unavailable: {0}")]
    Unavailable(String),
}
