//! What every seed must satisfy. P1–P6 and linearizability are the same checks the real-process fault
//! tests run, one file per property in `holdfast_checker::properties` (P1 one holder, P2 replicas agree,
//! P3 tokens, P4 fenced store, P5 acknowledged in log, P6 no early expiry, reads against the log, the
//! Wing–Gong–Lowe search over each lock's history, P8 no unknowing holder, P9 watch streams are the log, P10 lock-delays); P7
//! liveness after the heal is simulation-only and lives in [`p7_liveness`]. A host that failed or
//! panicked (openraft panics on a broken Raft invariant) is a violation too.

pub mod p7_liveness;

use crate::run::Outcome;

pub use holdfast_checker::Report;

/// The checker's report for the run, with P7's violations and any host failure added.
pub fn check_all(run: &Outcome) -> Report {
    let groups = run.groups;
    let mut r = holdfast_checker::check_groups(&run.history, &run.audits, &run.store, |name| {
        holdfast_client::group_for(name, groups)
    });
    if let Some(e) = &run.sim_error {
        r.violations.insert(0, format!("a host failed: {e}"));
    }
    r.violations.extend(p7_liveness::check(run));
    r.violations.extend(
        run.corruption_violations
            .iter()
            .map(|v| format!("storage corruption not refused: {v}")),
    );
    if run.replacements_done < run.replacements_asked {
        r.violations.push(format!(
            "P7: {} of {} server replacements did not complete (new member added, old removed) by the end",
            run.replacements_asked - run.replacements_done,
            run.replacements_asked
        ));
    }
    r
}

/// Sums over many seeds, for the summary line.
#[derive(Debug, Default)]
pub struct Totals {
    pub seeds: usize,
    pub ops: usize,
    pub ok_grants: usize,
    pub ok_writes: usize,
    pub stale_refused: usize,
    pub expiries_checked: usize,
    pub reads_checked: usize,
    pub linearized_ops: usize,
    pub linearizability_inconclusive: usize,
    pub unacknowledged_grants_checked: usize,
    pub watch_events_checked: usize,
    pub lock_delays_checked: usize,
    pub shared_grants_checked: usize,
    /// Damaged files a server refused to start on (`Fault::Corrupt`).
    pub corruptions_detected: u64,
    /// Opens and acquires refused for a full table (`Knobs::table_budget_bytes`).
    pub table_full_refusals: u64,
    /// Servers crashed at a failpoint (`Fault::Failpoint`), and servers stalled (`Fault::Stall`).
    pub failpoint_crashes: u64,
    pub stalls: u64,
    /// Seeds that ran several Raft groups (`Knobs::groups`).
    pub multi_group_seeds: u64,
    /// Unloaded tables loaded back (`Knobs::unload_after_ms`).
    pub table_reloads: u64,
}

impl Totals {
    pub fn add(&mut self, r: &Report) {
        self.seeds += 1;
        self.ops += r.ops;
        self.ok_grants += r.ok_grants;
        self.ok_writes += r.ok_writes;
        self.stale_refused += r.stale_refused;
        self.expiries_checked += r.expiries_checked;
        self.reads_checked += r.reads_checked;
        self.linearized_ops += r.linearized_ops;
        self.linearizability_inconclusive += r.linearizability_inconclusive;
        self.unacknowledged_grants_checked += r.unacknowledged_grants_checked;
        self.watch_events_checked += r.watch_events_checked;
        self.lock_delays_checked += r.lock_delays_checked;
        self.shared_grants_checked += r.shared_grants_checked;
    }
}

impl std::fmt::Display for Totals {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} operations, {} grants, {} fenced writes, {} stale writes refused, {} expiries and {} reads checked, {} operations linearized ({} locks inconclusive), {} unacknowledged grants checked to end, {} watch events, {} lock-delays and {} shared or semaphore grants checked, {} damaged files refused, {} refusals for a full table, {} crashes at failpoints, {} stalls, {} seeds with several groups, {} unloaded tables loaded back",
            self.ops,
            self.ok_grants,
            self.ok_writes,
            self.stale_refused,
            self.expiries_checked,
            self.reads_checked,
            self.linearized_ops,
            self.linearizability_inconclusive,
            self.unacknowledged_grants_checked,
            self.watch_events_checked,
            self.lock_delays_checked,
            self.shared_grants_checked,
            self.corruptions_detected,
            self.table_full_refusals,
            self.failpoint_crashes,
            self.stalls,
            self.multi_group_seeds,
            self.table_reloads
        )
    }
}
