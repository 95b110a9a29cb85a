//! Crash points for the real-process fault suite: a server started with `--failpoint NAME[=N]` aborts
//! the process (SIGABRT, no destructors, no flushes: a crash) the Nth time it reaches the point NAME
//! (the first time without `=N`). Compiled out of release builds: there [`hit`] is an empty function and
//! [`arm`] refuses.
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

/// Crashes the process if `name` is armed and this is its Nth hit.
#[inline]
pub fn hit(name: &'static str) {
    hit_then(name, || ());
}

/// [`hit`], running `before` (a partial write) just before the crash.
#[inline]
pub fn hit_then(name: &'static str, before: impl FnOnce()) {
    #[cfg(debug_assertions)]
    if armed::triggered(name) {
        before();
        eprintln!("failpoint {name} reached: crashing (SIGABRT)");
        std::process::abort();
    }
    #[cfg(not(debug_assertions))]
    let _ = (name, before);
}
