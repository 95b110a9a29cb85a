//! The Holdfast client library.
//!
//! ```no_run
//! # async fn demo() -> Result<(), holdfast_client::Error> {
//! use std::time::Duration;
//! let client = holdfast_client::Client::connect(["127.0.0.1:7001", "127.0.0.1:7002"]).await?;
//! let session = client.open_session(Duration::from_secs(10)).await?;
//! let guard = session.acquire_timeout("reports/nightly", Duration::from_secs(5)).await?;
//! // Send guard.token() with every write to the protected resource; stop if guard.lost() fires.
//! guard.release().await?;
//! # Ok(()) }
//! ```
//!
//! Layout: [`client`] (endpoints, leader following, retries), [`session`] (keepalive and the client-side
//! lease), [`guard`] (a held lock), [`watch`] (event streams), [`election`], [`tls`], [`error`], [`placement`] (which servers should be each group's voters, for
//! `holdfast member place`). The crate depends only on the protocol crate
//! (`holdfast-proto`), never on server internals.
//!
//! Retries are safe: every write carries an id (a random nonce for opening a session, a per-session
//! request id otherwise) that the server deduplicates, so a retried acquire never creates a second grant
//! or waiter and a retried release never releases someone else's lock.

mod calls;
pub mod client;
pub mod election;
pub mod error;
pub mod guard;
mod keepalive;
pub mod placement;
pub mod session;
pub mod tls;
pub mod watch;

pub use client::{Client, ClientOptions};
pub use election::{Leader, Leadership, Observer};
pub use error::Error;
pub use guard::LockGuard;
pub use session::{AcquireOptions, LeaseLost, Session};
pub use tls::ClientTls;
pub use watch::{EventKind, Position, Watch, WatchEvent};

/// FNV-1a 64 of the name's bytes modulo the group count: the group that owns a lock name. Must match the
/// server's `holdfast_lock_table::group_for` (a test checks it does).
pub fn group_for(name: &str, groups: u32) -> u32 {
    let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
    for &b in name.as_bytes() {
        hash ^= u64::from(b);
        hash = hash.wrapping_mul(0x0000_0100_0000_01b3);
    }
    (hash % u64::from(groups.max(1))) as u32
}
