//! What every seed must satisfy. P1–P6 and linearizability are the same checks the real-process fault
//! tests run, one file per property in `holdfast_checker::properties` (P1 one holder, P2 replicas agree,
//! P3 tokens, P4 fenced store, P5 acknowledged in log, P6 no early expiry, reads against the log, and the
//! Wing–Gong–Lowe search over each lock's history); P7
//! liveness after the heal is simulation-only and lives in [`p7_liveness`]. A host that failed or
//! panicked (openraft panics on a broken Raft invariant) is a violation too.

pub mod p7_liveness;

use crate::run::Outcome;

#[derive(Debug, Default)]
pub struct Report {
    pub violations: Vec<String>,
    pub ops: usize,
    pub ok_grants: usize,
    pub ok_writes: usize,
    pub stale_refused: usize,
    pub applied_entries: usize,
    pub expiries_checked: usize,
    pub reads_checked: usize,
    pub linearized_ops: usize,
    pub linearizability_inconclusive: usize,
}

pub fn check_all(run: &Outcome) -> Report {
    let mut violations = Vec::new();
    if let Some(e) = &run.sim_error {
        violations.push(format!("a host failed: {e}"));
    }
    let r = holdfast_checker::check(&run.history, &run.audits, &run.store);
    violations.extend(r.violations);
    violations.extend(p7_liveness::check(run));
    Report {
        violations,
        ops: r.ops,
        ok_grants: r.ok_grants,
        ok_writes: r.ok_writes,
        stale_refused: r.stale_refused,
        applied_entries: r.applied_entries,
        expiries_checked: r.expiries_checked,
        reads_checked: r.reads_checked,
        linearized_ops: r.linearized_ops,
        linearizability_inconclusive: r.linearizability_inconclusive,
    }
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
    }
}

impl std::fmt::Display for Totals {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} operations, {} grants, {} fenced writes, {} stale writes refused, {} expiries and {} reads checked, {} operations linearized ({} locks inconclusive)",
            self.ops,
            self.ok_grants,
            self.ok_writes,
            self.stale_refused,
            self.expiries_checked,
            self.reads_checked,
            self.linearized_ops,
            self.linearizability_inconclusive
        )
    }
}
