//! A Holdfast server: every Raft group of the cluster on one process.
//!
//! Layout (each module's header says its role and invariant):
//! - [`config`]: flags/TOML configuration and its validation; [`identity`]: which cluster and node a data
//!   directory belongs to.
//! - [`node`]: starts and stops everything below in order.
//! - [`group`]: one Raft group: proposals, linearizable reads, the leader's become-ready and expiry tasks.
//! - [`lease`]: session deadlines on the leader's monotonic clock, the **only** clock that decides anything.
//! - [`state_machine`], [`snapshot_store`]: apply committed entries to the pure lock table; snapshot files.
//! - [`log_store`]: openraft's log storage on top of the shared WAL (`holdfast-wal`).
//! - [`formats`]: Holdfast's own versioned encodings of Raft data (WAL records, snapshot headers, peer
//!   messages); openraft's structs never reach a disk or a socket.
//! - [`peer`]: Raft traffic between servers over gRPC.
//! - [`service`], [`errors`]: the client gRPC API and how refusals become statuses.
//! - [`backup`]: backup files of every group's table, and seeding a new cluster's data dirs from one.
//! - [`abandon`]: acquires whose caller went away are abandoned through the log.
//! - [`http`], [`metrics`], [`ui`]: the HTTP port (axum on hyper): `/metrics` (prometheus-client),
//!   `/healthz`, `/readyz` and the dashboard.
//! - [`access`]: principals and the policy file (who may lock, read, administer which names).
//! - [`tls`]: certificates for all three ports, who the peer port admits, reloading on change.
//! - [`watch`]: the recent history of lock changes that `Watch` streams read.

pub mod abandon;
pub mod access;
pub mod backup;
pub mod calls;
pub mod config;
pub mod errors;
pub mod formats;
pub mod group;
pub mod http;
pub mod identity;
pub mod lease;
pub mod log_store;
pub mod metrics;
pub mod node;
pub mod peer;
pub mod raft_types;
pub mod raw_append;
pub mod raw_calls;
pub mod secrets;
pub mod service;
#[cfg(holdfast_sim)]
pub mod skew;
pub mod snapshot_store;
pub mod state_machine;
pub mod tls;
pub mod ui;
pub mod watch;

pub use config::{Member, ServerConfig};
/// Crash points for the fault suite (see `holdfast_wal::failpoint`).
pub use holdfast_wal::failpoint;
pub use node::Node;

/// Wall-clock milliseconds since the Unix epoch, stamped into commands for display (granted-at). No
/// decision depends on it.
pub fn now_ms() -> u64 {
    #[cfg(holdfast_sim)]
    return turmoil::since_epoch().map_or(0, |d| d.as_millis() as u64);
    #[cfg(not(holdfast_sim))]
    return std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64);
}

/// Runs blocking file work (snapshot files) off the async threads. In the simulation it runs inline: a
/// thread would run outside simulated time and make runs irreproducible.
pub async fn blocking<T: Send + 'static>(
    f: impl FnOnce() -> std::io::Result<T> + Send + 'static,
) -> std::io::Result<T> {
    #[cfg(holdfast_sim)]
    return f();
    #[cfg(not(holdfast_sim))]
    return tokio::task::spawn_blocking(f)
        .await
        .map_err(std::io::Error::other)?;
}
