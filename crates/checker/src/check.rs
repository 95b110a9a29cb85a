//! The aggregate check: runs every safety property in [`crate::properties`] over one test's inputs and
//! collects the violations, each a sentence naming the property and the evidence, into a [`Report`].

use crate::model::{AuditLine, Op, StoreRecord};
use crate::properties::{
    linearizable_locks, linearizable_reads, p10_lock_delay, p11_shared_holders, p1_one_holder,
    p2_replicas_agree, p3_tokens, p4_fenced_store, p5_acknowledged_in_log, p6_no_early_expiry,
    p8_no_unknowing_holder, p9_watch_streams,
};

#[derive(Debug, Default)]
pub struct Report {
    pub violations: Vec<String>,
    pub ops: usize,
    pub ok_grants: usize,
    pub ok_writes: usize,
    pub stale_refused: usize,
    pub applied_entries: usize,
    /// Session expiries checked against the client's last acknowledged renewal (P6).
    pub expiries_checked: usize,
    /// Describe results checked for linearizability against the log.
    pub reads_checked: usize,
    /// Operations placed by the black-box linearizability search, and locks where it gave up.
    pub linearized_ops: usize,
    pub linearizability_inconclusive: usize,
    /// Grants no client acknowledged, checked to end (P8).
    pub unacknowledged_grants_checked: usize,
    /// Events watchers received, checked against the log (P9).
    pub watch_events_checked: usize,
    /// Lock-delays checked to their end (P10).
    pub lock_delays_checked: usize,
    /// Grants of shared locks and semaphores checked against their other holders (P11).
    pub shared_grants_checked: usize,
}

impl Report {
    /// Adds `other`'s counts and violations (each prefixed with `prefix`) to this report.
    pub fn add(&mut self, other: Report, prefix: &str) {
        self.violations
            .extend(other.violations.into_iter().map(|v| format!("{prefix}{v}")));
        self.ops += other.ops;
        self.ok_grants += other.ok_grants;
        self.ok_writes += other.ok_writes;
        self.stale_refused += other.stale_refused;
        self.applied_entries += other.applied_entries;
        self.expiries_checked += other.expiries_checked;
        self.reads_checked += other.reads_checked;
        self.linearized_ops += other.linearized_ops;
        self.linearizability_inconclusive += other.linearizability_inconclusive;
        self.unacknowledged_grants_checked += other.unacknowledged_grants_checked;
        self.watch_events_checked += other.watch_events_checked;
        self.lock_delays_checked += other.lock_delays_checked;
        self.shared_grants_checked += other.shared_grants_checked;
    }
}

/// [`check`] for a cluster of several Raft groups: `audits[g]` holds each server's audit log of group
/// `g`, and `group_of` says which group owns a lock name. Each group is an independent log with its own
/// indexes, sessions and tokens, so each is checked on its own: against the operations on the names it
/// owns, the store's records of those names, and the operations that name no lock but say they are its
/// ([`Op::group`]: a session open in that group, its loss, where a watch started in it). Violations are
/// prefixed with their group when there are several.
pub fn check_groups(
    history: &[Op],
    audits: &[Vec<(u64, Vec<AuditLine>)>],
    store: &[StoreRecord],
    group_of: impl Fn(&str) -> u32,
) -> Report {
    let of_op = |o: &Op| {
        o.group.unwrap_or_else(|| match o.lock.is_empty() {
            true => 0,
            false => group_of(&o.lock),
        })
    };
    let mut report = Report::default();
    for (g, group_audits) in audits.iter().enumerate() {
        let g = g as u32;
        let history: Vec<Op> = history.iter().filter(|o| of_op(o) == g).cloned().collect();
        let store: Vec<StoreRecord> = store
            .iter()
            .filter(|r| group_of(&r.key) == g)
            .cloned()
            .collect();
        let prefix = match audits.len() {
            1 => String::new(),
            _ => format!("group {g}: "),
        };
        report.add(check(&history, group_audits, &store), &prefix);
    }
    report
}

pub fn check(history: &[Op], audits: &[(u64, Vec<AuditLine>)], store: &[StoreRecord]) -> Report {
    let mut r = Report {
        // Client operations; what watchers received is counted in `watch_events_checked`.
        ops: history
            .iter()
            .filter(|o| !o.op.starts_with("watch"))
            .count(),
        ..Report::default()
    };
    // Which entries' acquires asked for a lock-delay (P10), before the wrappers are taken off below.
    // And which asked to share (P11).
    let mut asked_delay = std::collections::BTreeMap::new();
    let mut asked_share = std::collections::BTreeMap::new();
    for (_, lines) in audits {
        for l in lines {
            if let Some(ms) = lock_delay_of(&l.command) {
                asked_delay.insert(l.index, ms);
            }
            if let Some(share) = p11_shared_holders::share_of(&l.command) {
                asked_share.insert(l.index, share);
            }
        }
    }
    // The properties read what each entry did: quota and secret wrappers only gate it.
    let audits: Vec<(u64, Vec<AuditLine>)> = audits
        .iter()
        .map(|(node, lines)| {
            let lines = lines
                .iter()
                .map(|l| AuditLine {
                    command: l.command.effective().clone(),
                    ..l.clone()
                })
                .collect();
            (*node, lines)
        })
        .collect();
    let audits = &audits[..];
    let merged = p2_replicas_agree::check(audits, &mut r.violations);
    r.applied_entries = merged.len();
    // Shared locks and semaphores: P11's alone where the other checks assume one holder.
    let multi = p11_shared_holders::multi_holder_names(&merged, &asked_share, history);
    let all_history = history;
    let history: Vec<Op> = history
        .iter()
        .filter(|o| !multi.contains(&o.lock))
        .cloned()
        .collect();
    let history = &history[..];
    let (mut grants, timelines) = p1_one_holder::check(&merged, &multi, &mut r.violations);
    let (shared_grants_checked, shared_held) = p11_shared_holders::check(
        &merged,
        &multi,
        &asked_share,
        &asked_delay,
        &mut grants,
        &mut r.violations,
    );
    r.shared_grants_checked = shared_grants_checked;
    r.reads_checked = linearizable_reads::check(history, &timelines, &mut r.violations);
    p3_tokens::check(history, &mut r.violations);
    p5_acknowledged_in_log::check(all_history, &merged, &grants, &mut r.violations);
    p4_fenced_store::check(history, store, &mut r.violations);
    r.expiries_checked = p6_no_early_expiry::check(all_history, &merged, &mut r.violations);
    let lin = linearizable_locks::check(history, &mut r.violations);
    r.unacknowledged_grants_checked =
        p8_no_unknowing_holder::check(history, &merged, &timelines, &mut r.violations);
    // P8 for shared locks and semaphores: each grant alone, as a timeline of its own.
    let mut by_name: std::collections::BTreeMap<&str, Vec<Op>> = Default::default();
    for o in all_history.iter().filter(|o| multi.contains(&o.lock)) {
        by_name.entry(o.lock.as_str()).or_default().push(o.clone());
    }
    for h in &shared_held {
        let Some(ops) = by_name.get(h.name.as_str()) else {
            continue;
        };
        let mut timeline = vec![(h.from, Some((h.session, h.token)))];
        timeline.extend(h.until.map(|until| (until, None)));
        let timelines = std::iter::once((h.name.clone(), timeline)).collect();
        r.unacknowledged_grants_checked +=
            p8_no_unknowing_holder::check(ops, &merged, &timelines, &mut r.violations);
    }
    r.watch_events_checked = p9_watch_streams::check(all_history, &merged, &mut r.violations);
    r.lock_delays_checked = p10_lock_delay::check(&merged, &asked_delay, &multi, &mut r.violations);
    r.linearized_ops = lin.ops;
    r.linearizability_inconclusive = lin.inconclusive;
    r.ok_grants = all_history
        .iter()
        .filter(|o| o.op == "acquire" && o.ok())
        .count();
    r.ok_writes = history.iter().filter(|o| o.op == "write" && o.ok()).count();
    r.stale_refused = history
        .iter()
        .filter(|o| o.op == "write" && o.result == "fail")
        .count();
    r
}

/// The lock-delay an acquire asked for (`Command::WithLockDelay`, under any other wrapper).
fn lock_delay_of(command: &holdfast_lock_table::Command) -> Option<u32> {
    use holdfast_lock_table::Command;
    match command {
        Command::WithLockDelay { lock_delay_ms, .. } => Some(*lock_delay_ms),
        Command::Authorized { command, .. }
        | Command::Quota { command, .. }
        | Command::WithShare { command, .. } => lock_delay_of(command),
        _ => None,
    }
}
