//! The file system the WAL (and the server's snapshot files) use: `std::fs` in a real server, turmoil's
//! simulated file system in the deterministic simulation (`--cfg holdfast_sim`), where a crash keeps only
//! what was synced. Every file operation of the log goes through this module, so the simulation runs the
//! same recovery code as a real server.

#[cfg(not(holdfast_sim))]
pub use std::fs::*;
#[cfg(holdfast_sim)]
pub use turmoil::fs::shim::std::fs::*;

use std::path::Path;

/// Makes the directory's entries (created, renamed and removed files) durable.
#[cfg(not(holdfast_sim))]
pub fn sync_dir(dir: &Path) -> std::io::Result<()> {
    File::open(dir)?.sync_all()
}

/// Makes the directory's entries (created, renamed and removed files) durable.
#[cfg(holdfast_sim)]
pub fn sync_dir(dir: &Path) -> std::io::Result<()> {
    turmoil::fs::shim::std::fs::sync_dir(dir)
}
