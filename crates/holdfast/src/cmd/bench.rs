//! `holdfast bench`: load against a running cluster, with latency histograms.
//!
//! `acquire-release`: N clients, each with its own session, loop acquire (waiting) + release over K lock
//! names for a duration; reports throughput and latency percentiles of the acquire+release pair.

use super::duration::parse_duration;
use anyhow::Context;
use clap::{Args, Subcommand};
use hdrhistogram::Histogram;
use holdfast_client::{Client, ClientOptions};
use std::process::ExitCode;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::sync::Arc;
use std::time::{Duration, Instant};

#[derive(Args, Debug)]
pub struct BenchArgs {
    #[command(subcommand)]
    mode: Mode,
    /// Client endpoints, comma-separated.
    #[arg(long, env = "HOLDFAST_ENDPOINTS", default_value = super::DEV_ENDPOINTS, global = true)]
    endpoints: String,
    /// Print the result as one JSON object.
    #[arg(long, global = true)]
    json: bool,
}

#[derive(Subcommand, Debug)]
enum Mode {
    /// Clients loop acquire + release; measures the pair's latency and the throughput.
    AcquireRelease {
        /// Concurrent clients, each with its own session.
        #[arg(long, default_value_t = 1)]
        clients: usize,
        /// Distinct lock names (default: one per client, so clients do not contend).
        #[arg(long)]
        names: Option<usize>,
        /// How long to measure (e.g. 10s, 500ms, 1m), after a 1 s warm-up.
        #[arg(long, default_value = "10s", value_parser = parse_duration)]
        duration: Duration,
    },
    /// One client loops acquire + release and reports every gap between successive grants longer than
    /// 100 ms: kill the leader meanwhile to measure the time from a failure to the next grant.
    Availability {
        #[arg(long, default_value = "20s", value_parser = parse_duration)]
        duration: Duration,
    },
}

pub async fn run(args: BenchArgs) -> anyhow::Result<ExitCode> {
    let endpoints: Vec<String> = args
        .endpoints
        .split(',')
        .map(|s| s.trim().to_string())
        .filter(|s| !s.is_empty())
        .collect();
    match args.mode {
        Mode::AcquireRelease {
            clients,
            names,
            duration,
        } => {
            let names = names.unwrap_or(clients).max(1);
            acquire_release(endpoints, clients.max(1), names, duration, args.json).await
        }
        Mode::Availability { duration } => availability(endpoints, duration, args.json).await,
    }
}

async fn availability(
    endpoints: Vec<String>,
    duration: Duration,
    json: bool,
) -> anyhow::Result<ExitCode> {
    let client = Client::connect_with(endpoints, ClientOptions::default())
        .await
        .context("cannot reach the cluster")?;
    let session = client
        .open_session(Duration::from_secs(10))
        .await
        .context("cannot open a session")?;
    let started = Instant::now();
    let mut last_grant = Instant::now();
    let mut gaps: Vec<(f64, f64)> = Vec::new();
    let mut grants = 0u64;
    let mut errors = 0u64;
    while started.elapsed() < duration {
        match session
            .acquire_timeout("bench/availability", Duration::from_secs(5))
            .await
        {
            Ok(guard) => {
                let now = Instant::now();
                let gap = now - last_grant;
                if gap > Duration::from_millis(100) {
                    gaps.push((
                        (last_grant - started).as_secs_f64(),
                        gap.as_secs_f64() * 1000.0,
                    ));
                    if !json {
                        println!(
                            "  {:>7.2} s: {:.0} ms without a grant",
                            (last_grant - started).as_secs_f64(),
                            gap.as_secs_f64() * 1000.0
                        );
                    }
                }
                last_grant = now;
                grants += 1;
                if guard.release().await.is_err() {
                    errors += 1;
                }
            }
            Err(e) => {
                errors += 1;
                if !json {
                    println!("  {:>7.2} s: {e}", started.elapsed().as_secs_f64());
                }
            }
        }
    }
    let longest = gaps.iter().map(|g| g.1).fold(0.0, f64::max);
    if json {
        let list: Vec<String> = gaps
            .iter()
            .map(|(at, ms)| format!("{{\"at_s\":{at:.3},\"gap_ms\":{ms:.1}}}"))
            .collect();
        println!("{{\"mode\":\"availability\",\"grants\":{grants},\"errors\":{errors},\"longest_gap_ms\":{longest:.1},\"gaps\":[{}]}}", list.join(","));
    } else {
        println!("availability: {grants} grants, {errors} errors, longest gap {longest:.0} ms");
    }
    let _ = session.close().await;
    Ok(ExitCode::SUCCESS)
}

async fn acquire_release(
    endpoints: Vec<String>,
    clients: usize,
    names: usize,
    duration: Duration,
    json: bool,
) -> anyhow::Result<ExitCode> {
    let client = Client::connect_with(endpoints, ClientOptions::default())
        .await
        .context("cannot reach the cluster")?;
    let mut sessions = Vec::new();
    for _ in 0..clients {
        sessions.push(
            client
                .open_session(Duration::from_secs(10))
                .await
                .context("cannot open a session")?,
        );
    }
    let measuring = Arc::new(AtomicBool::new(false));
    let stop = Arc::new(AtomicBool::new(false));
    let errors = Arc::new(AtomicU64::new(0));
    let mut workers = Vec::new();
    for (i, session) in sessions.iter().cloned().enumerate() {
        let (measuring, stop, errors) = (measuring.clone(), stop.clone(), errors.clone());
        workers.push(tokio::spawn(async move {
            let mut hist = Histogram::<u64>::new_with_bounds(1, 60_000_000, 3)
                .expect("valid histogram bounds");
            let mut n = i;
            while !stop.load(Relaxed) {
                let name = format!("bench/{}", n % names);
                n += clients;
                let started = Instant::now();
                let result = async {
                    let guard = session
                        .acquire_timeout(&name, Duration::from_secs(5))
                        .await?;
                    guard.release().await
                }
                .await;
                match result {
                    Ok(()) if measuring.load(Relaxed) => {
                        let _ = hist.record(started.elapsed().as_micros() as u64);
                    }
                    Ok(()) => {}
                    Err(_) => {
                        errors.fetch_add(1, Relaxed);
                    }
                }
            }
            hist
        }));
    }
    tokio::time::sleep(Duration::from_secs(1)).await;
    measuring.store(true, Relaxed);
    let started = Instant::now();
    tokio::time::sleep(duration).await;
    measuring.store(false, Relaxed);
    let elapsed = started.elapsed();
    stop.store(true, Relaxed);
    let mut total =
        Histogram::<u64>::new_with_bounds(1, 60_000_000, 3).expect("valid histogram bounds");
    for w in workers {
        total.add(w.await?).expect("same bounds");
    }
    for s in sessions {
        let _ = s.close().await;
    }
    let ops = total.len();
    let per_sec = ops as f64 / elapsed.as_secs_f64();
    let q = |p: f64| total.value_at_quantile(p) as f64 / 1000.0;
    if json {
        println!(
            "{{\"mode\":\"acquire-release\",\"clients\":{clients},\"names\":{names},\"seconds\":{:.2},\"ops\":{ops},\"ops_per_sec\":{per_sec:.1},\"p50_ms\":{:.3},\"p99_ms\":{:.3},\"p999_ms\":{:.3},\"max_ms\":{:.3},\"errors\":{}}}",
            elapsed.as_secs_f64(), q(0.5), q(0.99), q(0.999), total.max() as f64 / 1000.0, errors.load(Relaxed)
        );
    } else {
        println!(
            "acquire+release: {clients} clients, {names} names, {:.1} s",
            elapsed.as_secs_f64()
        );
        println!(
            "  {ops} pairs, {per_sec:.0} pairs/s ({:.0} log entries/s)",
            per_sec * 2.0
        );
        println!(
            "  latency ms: p50 {:.2}  p99 {:.2}  p99.9 {:.2}  max {:.2}",
            q(0.5),
            q(0.99),
            q(0.999),
            total.max() as f64 / 1000.0
        );
        println!("  errors: {}", errors.load(Relaxed));
    }
    Ok(ExitCode::SUCCESS)
}
