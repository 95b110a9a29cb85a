//! Crash points for the real-process fault suite: a server started with `--failpoint NAME[=N]` aborts
//! the process (SIGABRT, no destructors, no flushes: a crash) the Nth time it reaches the point NAME
//! (the first time without `=N`). Compiled out of release builds other than the simulation's: there
//! [`hit`] returns `Ok(())` at once and [`arm`] refuses.
//!
//! In the simulation (`--cfg holdfast_sim`) the driver arms a point on one simulated server
//! ([`sim_arm`]). A process cannot abort there, so reaching the point makes [`hit`] return an I/O error
//! at once and reports the server ([`sim_take_crashed`]); the driver then crashes its host before the
//! next step, losing what was not synced, and restarts it later, unarmed. At `wal.write`, `wal.sync`,
//! `wal.rotate`, `snapshot.write` and `vote.save` the write or sync behind the point does not happen
//! and the WAL stops, so nothing past it becomes durable. `wal.purge` and `snapshot.rename` come after
//! their deletion or rename, as in a real server, but their error does not stop the WAL (a failed purge
//! is retried), and `apply` is behind no I/O: there the server may run on, and sync, until the end of
//! that step (at most 1 ms of simulated time).
//!
//! | name | where the process dies |
//! |---|---|
//! | `wal.write` | half of a group commit's frame written to the segment, the rest not |
//! | `wal.sync` | a frame written, before its `fdatasync` |
//! | `wal.rotate` | the next segment started (state word cleared, sticky records written), before the commit that needed it is written |
//! | `wal.purge` | an old segment deleted, before the directory is synced |
//! | `snapshot.write` | half of a snapshot written to its temporary file |
//! | `snapshot.rename` | a snapshot renamed into place, before the directory sync and before older ones are deleted |
//! | `apply` | before a committed entry is applied to the lock table |
//! | `vote.save` | before a vote is written to the WAL |

/// Every failpoint, in the order of the table above.
pub const NAMES: &[&str] = &[
    "wal.write",
    "wal.sync",
    "wal.rotate",
    "wal.purge",
    "snapshot.write",
    "snapshot.rename",
    "apply",
    "vote.save",
];

#[cfg(debug_assertions)]
mod armed {
    use std::sync::atomic::{AtomicU64, Ordering};
    use std::sync::OnceLock;

    pub(super) struct Armed {
        pub(super) name: &'static str,
        pub(super) at: u64,
        pub(super) hits: AtomicU64,
    }

    pub(super) static ARMED: OnceLock<Armed> = OnceLock::new();

    /// Counts a hit of `name`; true on the hit that must crash.
    pub(super) fn triggered(name: &str) -> bool {
        match ARMED.get() {
            Some(a) if a.name == name => a.hits.fetch_add(1, Ordering::Relaxed) + 1 == a.at,
            _ => false,
        }
    }
}

/// Arms one failpoint from `NAME` or `NAME=N` (N ≥ 1). Once per process.
pub fn arm(spec: &str) -> Result<(), String> {
    let (name, at) = parse(spec)?;
    #[cfg(debug_assertions)]
    {
        let armed = armed::Armed {
            name,
            at,
            hits: Default::default(),
        };
        armed::ARMED
            .set(armed)
            .map_err(|_| "a failpoint is already armed".to_string())
    }
    #[cfg(not(debug_assertions))]
    {
        let _ = (name, at);
        Err("failpoints are compiled out of release builds".into())
    }
}

/// `NAME` or `NAME=N` (N ≥ 1): the point's name as in [`NAMES`], and N.
fn parse(spec: &str) -> Result<(&'static str, u64), String> {
    let (name, at) = match spec.split_once('=') {
        Some((name, n)) => (
            name,
            n.parse::<u64>()
                .ok()
                .filter(|&n| n > 0)
                .ok_or_else(|| format!("failpoint {spec:?}: N must be a whole number ≥ 1"))?,
        ),
        None => (spec, 1),
    };
    let Some(&name) = NAMES.iter().find(|&&n| n == name) else {
        return Err(format!(
            "unknown failpoint {name:?}; the failpoints are {}",
            NAMES.join(", ")
        ));
    };
    Ok((name, at))
}

/// Crashes the process if `name` is armed and this is its Nth hit. Returns an error only in the
/// simulation (see the module docs); callers stop what they were doing with it.
#[inline]
pub fn hit(name: &'static str) -> std::io::Result<()> {
    hit_then(name, || ())
}

/// [`hit`], running `before` (a partial write) just before the crash.
#[inline]
pub fn hit_then(name: &'static str, before: impl FnOnce()) -> std::io::Result<()> {
    #[cfg(debug_assertions)]
    if armed::triggered(name) {
        before();
        eprintln!("failpoint {name} reached: crashing (SIGABRT)");
        std::process::abort();
    }
    #[cfg(holdfast_sim)]
    if sim::triggered(name) {
        before();
        return Err(std::io::Error::other(format!(
            "failpoint {name} reached: crashing"
        )));
    }
    let _ = (name, before);
    Ok(())
}

#[cfg(holdfast_sim)]
// Keyed by tokio's runtime id, which has no order; only looked up.
#[allow(clippy::disallowed_types)]
mod sim {
    use std::collections::HashMap;
    use std::sync::Mutex;

    pub(super) struct Armed {
        pub(super) name: &'static str,
        pub(super) at: u64,
        pub(super) hits: u64,
    }

    /// Per simulated server, by the tokio runtime its host runs on.
    pub(super) static ARMED: Mutex<Option<HashMap<tokio::runtime::Id, Armed>>> = Mutex::new(None);
    /// Servers that reached their point, not yet crashed by the driver.
    pub(super) static CRASHED: Mutex<Vec<tokio::runtime::Id>> = Mutex::new(Vec::new());

    pub(super) fn triggered(name: &str) -> bool {
        let Ok(rt) = tokio::runtime::Handle::try_current() else {
            return false;
        };
        let id = rt.id();
        let mut armed = ARMED.lock().expect("failpoint lock");
        let Some(a) = armed.as_mut().and_then(|m| m.get_mut(&id)) else {
            return false;
        };
        if a.name != name {
            return false;
        }
        a.hits += 1;
        if a.hits < a.at {
            return false;
        }
        // Once reached, every later hit fails too until the driver crashes the host.
        if a.hits == a.at {
            CRASHED.lock().expect("failpoint lock").push(id);
        }
        true
    }
}

/// Simulation only: arms `spec` (as for [`arm`]) on the simulated server whose host runs on runtime
/// `runtime`, replacing what it had armed.
#[cfg(holdfast_sim)]
pub fn sim_arm(runtime: tokio::runtime::Id, spec: &str) -> Result<(), String> {
    let (name, at) = parse(spec)?;
    sim::ARMED
        .lock()
        .expect("failpoint lock")
        .get_or_insert_with(Default::default)
        .insert(runtime, sim::Armed { name, at, hits: 0 });
    Ok(())
}

/// Simulation only: disarms every server and forgets what was reached (before each seed).
#[cfg(holdfast_sim)]
pub fn sim_reset() {
    *sim::ARMED.lock().expect("failpoint lock") = None;
    sim::CRASHED.lock().expect("failpoint lock").clear();
}

/// Simulation only: disarms the server on `runtime`; true if its point was reached.
#[cfg(holdfast_sim)]
pub fn sim_disarm(runtime: tokio::runtime::Id) -> bool {
    sim::ARMED
        .lock()
        .expect("failpoint lock")
        .as_mut()
        .and_then(|m| m.remove(&runtime))
        .is_some_and(|a| a.hits >= a.at)
}

/// Simulation only: true if the server on the calling runtime reached its armed point (it is about to
/// be crashed, so its host waits for that instead of reporting the I/O error it stopped on).
#[cfg(holdfast_sim)]
pub fn sim_reached_here() -> bool {
    let Ok(rt) = tokio::runtime::Handle::try_current() else {
        return false;
    };
    sim::ARMED
        .lock()
        .expect("failpoint lock")
        .as_ref()
        .and_then(|m| m.get(&rt.id()))
        .is_some_and(|a| a.hits >= a.at)
}

/// Simulation only: the runtimes of the servers that reached their armed point since the last call.
#[cfg(holdfast_sim)]
pub fn sim_take_crashed() -> Vec<tokio::runtime::Id> {
    std::mem::take(&mut *sim::CRASHED.lock().expect("failpoint lock"))
}
