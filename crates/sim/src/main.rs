//! `holdfast-sim`: runs seeds of the deterministic simulation. Build it with `scripts/sim`, which sets
//! `--cfg holdfast_sim --cfg tokio_unstable`.
//!
//! ```text
//! scripts/sim --seed 42            # one seed; its plan, fault log and what it checked
//! scripts/sim --seed 42 --trace    # every operation and applied entry too
//! scripts/sim --seeds 1000         # seeds 0..1000
//! scripts/sim --from 5000 --seeds 200 --work-ms 30000
//! ```
//!
//! Standard output is a function of the arguments alone (wall-clock timings go to standard error; only
//! the order of a failing seed's violation lines may vary), so the same command prints the same run.
//! A seed run alone (`--seed N`) and the same seed run after others in one process (`--from`/`--seeds`)
//! can take different, equally valid, paths: tokio numbers tasks with a process-wide counter and, when a
//! simulated host crashes, drops its tasks (closing their sockets, each close drawing a simulated
//! latency) in an order that depends on those numbers. So a failure found by `--seeds` replays with the
//! same `--from`/`--seeds` command, and CI runs every seed in its own process.

#[cfg(not(holdfast_sim))]
fn main() -> std::process::ExitCode {
    eprintln!("holdfast-sim must be built with --cfg holdfast_sim; run it with scripts/sim");
    std::process::ExitCode::from(2)
}

#[cfg(holdfast_sim)]
fn main() -> std::process::ExitCode {
    use holdfast_sim::run::{run, Options};
    let mut args = std::env::args().skip(1);
    let mut one = None;
    let mut from = 0u64;
    let mut count = 1u64;
    let mut options = Options::default();
    let (mut trace, mut json) = (false, false);
    let mut log: Option<String> = None;
    while let Some(a) = args.next() {
        let mut value = || -> u64 {
            args.next().and_then(|v| v.parse().ok()).unwrap_or_else(|| {
                eprintln!("error: {a} needs a number");
                std::process::exit(2)
            })
        };
        match a.as_str() {
            "--seed" => one = Some(value()),
            "--from" => from = value(),
            "--seeds" => count = value(),
            "--work-ms" => options.work_ms = value(),
            "--trace" => trace = true,
            "--json" => json = true,
            "--net-trace" => log = Some("turmoil=trace".into()),
            "--log" => log = args.next(),
            _ => {
                eprintln!(
                    "usage: holdfast-sim [--seed N | --from N --seeds COUNT] [--work-ms MS] [--trace] [--json] [--net-trace | --log FILTER]"
                );
                return std::process::ExitCode::from(2);
            }
        }
    }
    if let Some(filter) = log {
        // Server logs (`--log warn`) or turmoil's packet log (`--net-trace`: every send, delivery and
        // receive with its bytes) on standard error.
        tracing_subscriber::fmt()
            .with_env_filter(filter)
            .without_time()
            .with_ansi(false)
            .with_writer(std::io::stderr)
            .init();
    }
    let seeds: Vec<u64> = match one {
        Some(s) => vec![s],
        None => (from..from + count).collect(),
    };
    let started = std::time::Instant::now();
    let mut failed = Vec::new();
    let mut totals = holdfast_sim::invariants::Totals::default();
    for &seed in &seeds {
        let t = std::time::Instant::now();
        let outcome = run(seed, &options);
        let lines = if trace {
            &outcome.trace[..]
        } else if one.is_some() && !json {
            &outcome.trace[..outcome.fault_log_len]
        } else {
            &[]
        };
        for line in lines {
            println!("{line}");
        }
        let report = holdfast_sim::invariants::check_all(&outcome);
        totals.add(&report);
        totals.corruptions_detected += outcome.corruptions_detected;
        totals.table_full_refusals += outcome.table_full_refusals;
        totals.failpoint_crashes += outcome.failpoint_crashes;
        totals.stalls += outcome.stalls;
        totals.table_reloads += outcome.table_reloads;
        totals.multi_group_seeds += u64::from(outcome.groups > 1);
        if json {
            let line = serde_json::json!({
                "seed": seed,
                "ops": report.ops,
                "ok_grants": report.ok_grants,
                "ok_writes": report.ok_writes,
                "stale_refused": report.stale_refused,
                "expiries_checked": report.expiries_checked,
                "reads_checked": report.reads_checked,
                "linearized_ops": report.linearized_ops,
                "linearizability_inconclusive": report.linearizability_inconclusive,
                "unacknowledged_grants_checked": report.unacknowledged_grants_checked,
                "watch_events_checked": report.watch_events_checked,
                "lock_delays_checked": report.lock_delays_checked,
                "shared_grants_checked": report.shared_grants_checked,
                "applied_entries": report.applied_entries,
                "recovered_after_ms": outcome.recovered_after_ms,
                "converged_after_ms": outcome.converged_after_ms,
                "replacements": outcome.replacements_done,
                "leader_transfers": outcome.leader_transfers,
                "corruptions_detected": outcome.corruptions_detected,
                "table_full_refusals": outcome.table_full_refusals,
                "failpoint_crashes": outcome.failpoint_crashes,
                "stalls": outcome.stalls,
                "table_reloads": outcome.table_reloads,
                "groups": outcome.groups,
                "violations": report.violations,
            });
            println!("{line}");
        } else {
            println!(
                "seed {seed}: {} ops, {} applied entries, recovered {:?} ms and converged {:?} ms after the heal, {} violations",
                report.ops,
                report.applied_entries,
                outcome.recovered_after_ms,
                outcome.converged_after_ms,
                report.violations.len(),
            );
            for v in report.violations.iter().take(20) {
                println!("  {v}");
            }
        }
        eprintln!("seed {seed}: {:.2} s", t.elapsed().as_secs_f64());
        if !report.violations.is_empty() {
            if !json {
                println!("  reproduce: scripts/sim --seed {seed}");
            }
            failed.push(seed);
        }
    }
    if !json {
        println!(
            "{} seeds: {} failed {failed:?}; {totals}",
            seeds.len(),
            failed.len()
        );
    }
    eprintln!(
        "{} seeds in {:.1} s",
        seeds.len(),
        started.elapsed().as_secs_f64()
    );
    if failed.is_empty() {
        std::process::ExitCode::SUCCESS
    } else {
        std::process::ExitCode::FAILURE
    }
}
