//! `holdfast-sim`: runs seeds of the deterministic simulation. Build it with `scripts/sim`, which sets
//! `--cfg holdfast_sim --cfg tokio_unstable`.
//!
//! ```text
//! scripts/sim --seed 42            # one seed; prints its fault log and what it checked
//! scripts/sim --seeds 1000         # seeds 0..1000
//! scripts/sim --from 5000 --seeds 200 --work-ms 30000
//! ```

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
    let mut verbose = false;
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
            "--trace" => verbose = true,
            _ => {
                eprintln!("usage: holdfast-sim [--seed N | --from N --seeds COUNT] [--work-ms MS] [--trace]");
                return std::process::ExitCode::from(2);
            }
        }
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
        let lines = if verbose {
            &outcome.trace[..]
        } else if one.is_some() {
            &outcome.trace[..outcome.fault_log_len]
        } else {
            &[]
        };
        for line in lines {
            println!("{line}");
        }
        if let Some(e) = &outcome.sim_error {
            println!("seed {seed}: the simulation stopped: {e}");
        }
        let report = holdfast_sim::invariants::check_all(&outcome);
        totals.add(&report);
        println!(
            "seed {seed}: {} ops, {} applied entries, recovered {:?} ms, converged {:?} ms after heal, {} violations ({:.1} s)",
            report.ops,
            report.applied_entries,
            outcome.recovered_after_ms,
            outcome.converged_after_ms,
            report.violations.len(),
            t.elapsed().as_secs_f64()
        );
        if !report.violations.is_empty() {
            for v in report.violations.iter().take(20) {
                println!("  {v}");
            }
            println!("  reproduce: scripts/sim --seed {seed}");
            failed.push(seed);
        }
    }
    println!(
        "{} seeds in {:.1} s: {} failed {failed:?}; {}",
        seeds.len(),
        started.elapsed().as_secs_f64(),
        failed.len(),
        totals
    );
    if failed.is_empty() {
        std::process::ExitCode::SUCCESS
    } else {
        std::process::ExitCode::FAILURE
    }
}
