//! `holdfast bench`: load against a running cluster, with latency histograms.
//!
//! `acquire-release`: N clients, each with its own session, loop acquire (waiting) + release over K lock
//! names for a duration; reports throughput and latency percentiles of the acquire+release pair. By
//! default each client has its own connections, as separate processes would (`--connections` shares
//! fewer among them).
//!
//! `--json` prints one JSON object per measurement (serde_json); times in milliseconds, to the
//! microsecond. `--plot FILE` also writes an SVG chart (see [`super::plot`]).

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
    /// Send every acquire and release as a unary call instead of on the client's `Calls` stream to
    /// each server (the default), to compare the two.
    #[arg(long, global = true)]
    unary_calls: bool,
    /// Carry each server's `Calls` stream over gRPC instead of on a connection of its own (the
    /// default), to compare the two.
    #[arg(long, global = true)]
    grpc_calls: bool,
    #[command(flatten)]
    tls: super::TlsArgs,
}

#[derive(Subcommand, Debug)]
enum Mode {
    /// Clients loop acquire + release; measures the pair's latency and the throughput.
    AcquireRelease {
        /// Concurrent clients, each with its own session; a comma-separated list (1,16,64,256) runs
        /// one measurement per count, in turn.
        #[arg(long, default_value = "1", value_delimiter = ',')]
        clients: Vec<usize>,
        /// Distinct lock names (default: one per client, so clients do not contend).
        #[arg(long)]
        names: Option<usize>,
        /// Client connections the clients share, round-robin (default: one per client, as separate
        /// processes would have; 1: every client on one connection to each server).
        #[arg(long)]
        connections: Option<usize>,
        /// How long to measure (e.g. 10s, 500ms, 1m), after a 1 s warm-up.
        #[arg(long, default_value = "10s", value_parser = parse_duration)]
        duration: Duration,
        /// Also write an SVG plot of latency percentiles against throughput, one point per client
        /// count.
        #[arg(long, value_name = "FILE")]
        plot: Option<std::path::PathBuf>,
    },
    /// C sessions each hold M locks for a duration with keepalives running; reports keepalive latency
    /// and every session whose lease was lost (which must be none).
    Hold {
        #[arg(long, default_value_t = 1_000)]
        sessions: usize,
        #[arg(long, default_value_t = 10)]
        locks_per_session: usize,
        #[arg(long, default_value = "30s", value_parser = parse_duration)]
        duration: Duration,
        #[arg(long, default_value = "10s", value_parser = parse_duration)]
        ttl: Duration,
        /// Requests in flight while opening sessions and acquiring locks.
        #[arg(long, default_value_t = 64)]
        concurrency: usize,
        /// Every session sends its own unary keepalive (the design's one heartbeat per client) instead of
        /// one batched message per round.
        #[arg(long)]
        unbatched_keepalives: bool,
        /// Also write an SVG plot of the keepalive latency (p50, p99, max) per second of the hold.
        #[arg(long, value_name = "FILE")]
        plot: Option<std::path::PathBuf>,
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
    let base = ClientOptions {
        tls: args.tls.client_tls()?,
        token: args.tls.auth_token.clone(),
        call_streams: !args.unary_calls,
        call_connections: !args.grpc_calls,
        ..ClientOptions::default()
    };
    match args.mode {
        Mode::AcquireRelease {
            clients,
            names,
            connections,
            duration,
            plot,
        } => {
            let mut points = Vec::new();
            for &clients in &clients {
                let clients = clients.max(1);
                let load = Load {
                    clients,
                    names: names.unwrap_or(clients).max(1),
                    connections: connections.unwrap_or(clients).clamp(1, clients),
                };
                points.push(
                    acquire_release(endpoints.clone(), base.clone(), load, duration, args.json)
                        .await?,
                );
            }
            if let Some(path) = plot {
                let title = match connections {
                    Some(c) => format!("holdfast acquire+release, clients on {c} connection(s)"),
                    None => "holdfast acquire+release, one connection per client".to_string(),
                };
                super::plot::latency_vs_throughput(&path, &title, &points)?;
                if !args.json {
                    println!("plot written to {}", path.display());
                }
            }
            Ok(ExitCode::SUCCESS)
        }
        Mode::Availability { duration } => availability(endpoints, base, duration, args.json).await,
        Mode::Hold {
            sessions,
            locks_per_session,
            duration,
            ttl,
            concurrency,
            unbatched_keepalives,
            plot,
        } => {
            let options = ClientOptions {
                batched_keepalives: !unbatched_keepalives,
                ..base
            };
            let setup = HoldSetup {
                sessions,
                locks_per_session,
                ttl,
                concurrency: concurrency.max(1),
            };
            hold(endpoints, options, setup, duration, args.json, plot).await
        }
    }
}

async fn availability(
    endpoints: Vec<String>,
    options: ClientOptions,
    duration: Duration,
    json: bool,
) -> anyhow::Result<ExitCode> {
    let client = connect(endpoints, options).await?;
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
        let gaps: Vec<serde_json::Value> = gaps
            .iter()
            .map(|&(at, gap)| serde_json::json!({ "at_s": at, "gap_ms": gap }))
            .collect();
        let out = serde_json::json!({
            "mode": "availability",
            "grants": grants,
            "errors": errors,
            "longest_gap_ms": longest,
            "gaps": gaps,
        });
        println!("{out}");
    } else {
        println!("availability: {grants} grants, {errors} errors, longest gap {longest:.0} ms");
    }
    let _ = session.close().await;
    Ok(ExitCode::SUCCESS)
}

/// What `acquire-release` runs.
struct Load {
    clients: usize,
    names: usize,
    /// `Client`s (each with its own connection to every server) the clients share, round-robin.
    connections: usize,
}

/// Milliseconds to the microsecond, for the JSON output.
fn ms(us: f64) -> f64 {
    us.round() / 1000.0
}

async fn acquire_release(
    endpoints: Vec<String>,
    options: ClientOptions,
    load: Load,
    duration: Duration,
    json: bool,
) -> anyhow::Result<super::plot::SweepPoint> {
    let Load {
        clients,
        names,
        connections,
    } = load;
    let mut pool = Vec::new();
    for _ in 0..connections {
        pool.push(connect(endpoints.clone(), options.clone()).await?);
    }
    let mut sessions = Vec::new();
    for i in 0..clients {
        sessions.push(
            pool[i % connections]
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
    let calls = match (options.call_streams, options.call_connections) {
        (false, _) => "unary",
        (true, false) => "stream",
        (true, true) => "connection",
    };
    if json {
        let us = |p: f64| ms(total.value_at_quantile(p) as f64);
        let out = serde_json::json!({
            "mode": "acquire-release",
            "clients": clients,
            "connections": connections,
            "calls": calls,
            "names": names,
            "seconds": elapsed.as_secs_f64(),
            "ops": ops,
            "ops_per_sec": per_sec,
            "p50_ms": us(0.5),
            "p99_ms": us(0.99),
            "p999_ms": us(0.999),
            "max_ms": ms(total.max() as f64),
            "errors": errors.load(Relaxed),
        });
        println!("{out}");
    } else {
        println!(
            "acquire+release: {clients} clients on {connections} connection(s), {calls} calls, {names} names, {:.1} s",
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
    Ok(super::plot::SweepPoint {
        clients,
        pairs_per_sec: per_sec,
        p50_ms: q(0.5),
        p99_ms: q(0.99),
        p999_ms: q(0.999),
    })
}

async fn connect(endpoints: Vec<String>, options: ClientOptions) -> anyhow::Result<Client> {
    Client::connect_with(endpoints, options)
        .await
        .context("cannot reach the cluster")
}

struct HoldSetup {
    sessions: usize,
    locks_per_session: usize,
    ttl: Duration,
    concurrency: usize,
}

/// Runs `n` jobs with at most `concurrency` in flight, printing progress to stderr every second.
async fn in_parallel<F, Fut, T>(
    what: &str,
    n: usize,
    concurrency: usize,
    f: F,
) -> anyhow::Result<Vec<T>>
where
    F: Fn(usize) -> Fut,
    Fut: std::future::Future<Output = anyhow::Result<T>> + Send + 'static,
    T: Send + 'static,
{
    let mut out = Vec::with_capacity(n);
    let mut running = tokio::task::JoinSet::new();
    let started = Instant::now();
    let mut last_report = Instant::now();
    let mut next = 0;
    while next < n || !running.is_empty() {
        while next < n && running.len() < concurrency {
            let job = f(next);
            running.spawn(async move { (next, job.await) });
            next += 1;
        }
        if let Some(done) = running.join_next().await {
            let (i, r) = done?;
            out.push((i, r?));
        }
        if last_report.elapsed() >= Duration::from_secs(1)
            && std::io::IsTerminal::is_terminal(&std::io::stderr())
        {
            eprint!(
                "\r  {what}: {}/{n} ({:.0}/s)   ",
                out.len(),
                out.len() as f64 / started.elapsed().as_secs_f64()
            );
            last_report = Instant::now();
        }
    }
    eprintln!(
        "  {what}: {n}/{n} in {:.1} s ({:.0}/s)   ",
        started.elapsed().as_secs_f64(),
        n as f64 / started.elapsed().as_secs_f64()
    );
    out.sort_by_key(|(i, _)| *i);
    Ok(out.into_iter().map(|(_, t)| t).collect())
}

async fn hold(
    endpoints: Vec<String>,
    options: ClientOptions,
    setup: HoldSetup,
    duration: Duration,
    json: bool,
    plot: Option<std::path::PathBuf>,
) -> anyhow::Result<ExitCode> {
    let client = connect(endpoints, options).await?;
    let ttl = setup.ttl;
    let c = client.clone();
    let sessions = in_parallel(
        "sessions opened",
        setup.sessions,
        setup.concurrency,
        move |_| {
            let c = c.clone();
            async move { Ok(c.open_session(ttl).await?) }
        },
    )
    .await?;
    let m = setup.locks_per_session;
    let all = Arc::new(sessions);
    let s2 = all.clone();
    let guards = in_parallel(
        "locks acquired",
        setup.sessions * m,
        setup.concurrency,
        move |i| {
            let session = s2[i / m].clone();
            async move {
                Ok(session
                    .try_acquire(&format!("hold/{}/{}", i / m, i % m))
                    .await?)
            }
        },
    )
    .await?;
    let _ = client.take_keepalive_latencies();
    let started = Instant::now();
    let mut hist =
        Histogram::<u64>::new_with_bounds(1, 60_000_000, 3).expect("valid histogram bounds");
    let mut samples = 0usize;
    // Each second's keepalive latencies, for the plot.
    let mut seconds = Vec::new();
    while started.elapsed() < duration {
        tokio::time::sleep(Duration::from_secs(1).min(duration.saturating_sub(started.elapsed())))
            .await;
        let mut second =
            Histogram::<u64>::new_with_bounds(1, 60_000_000, 3).expect("valid histogram bounds");
        for us in client.take_keepalive_latencies() {
            let _ = second.record(u64::from(us).max(1));
        }
        if !second.is_empty() {
            seconds.push(super::plot::HoldSecond {
                at_s: started.elapsed().as_secs_f64(),
                p50_ms: second.value_at_quantile(0.5) as f64 / 1000.0,
                p99_ms: second.value_at_quantile(0.99) as f64 / 1000.0,
                max_ms: second.max() as f64 / 1000.0,
            });
        }
        samples += second.len() as usize;
        hist.add(&second).expect("same bounds");
        // Looking at every session costs ~30 ms a second at 100,000 of them, on the runtime that
        // sends their keepalives: only for the progress line, and once at the end.
        if !std::io::IsTerminal::is_terminal(&std::io::stderr()) {
            continue;
        }
        eprint!(
            "\r  holding {} locks in {} sessions: {:.0} s, sessions lost {}   ",
            guards.len(),
            all.len(),
            started.elapsed().as_secs_f64(),
            lost(&all)
        );
    }
    if std::io::IsTerminal::is_terminal(&std::io::stderr()) {
        eprintln!();
    }
    let lost_total = lost(&all);
    let q = |p: f64| hist.value_at_quantile(p) as f64 / 1000.0;
    let per_sec = samples as f64 / duration.as_secs_f64();
    if json {
        let us = |p: f64| ms(hist.value_at_quantile(p) as f64);
        let out = serde_json::json!({
            "mode": "hold",
            "sessions": all.len(),
            "locks": guards.len(),
            "seconds": duration.as_secs_f64(),
            "keepalive_messages": samples,
            "keepalive_messages_per_sec": per_sec,
            "keepalive_p50_ms": us(0.5),
            "keepalive_p99_ms": us(0.99),
            "keepalive_p999_ms": us(0.999),
            "keepalive_max_ms": ms(hist.max() as f64),
            "sessions_lost": lost_total,
        });
        println!("{out}");
    } else {
        println!(
            "hold: {} sessions x {} locks = {} locks for {:.0} s",
            all.len(),
            m,
            guards.len(),
            duration.as_secs_f64()
        );
        println!("  keepalive messages: {samples} ({per_sec:.0}/s)");
        println!(
            "  keepalive latency ms: p50 {:.2}  p99 {:.2}  p99.9 {:.2}  max {:.2}",
            q(0.5),
            q(0.99),
            q(0.999),
            hist.max() as f64 / 1000.0
        );
        println!("  sessions lost: {lost_total}");
    }
    if let Some(path) = &plot {
        let title = format!(
            "holdfast keepalive latency: {} sessions holding {} locks",
            all.len(),
            guards.len()
        );
        super::plot::keepalive_over_time(path, &title, &seconds)?;
        if !json {
            println!("plot written to {}", path.display());
        }
    }
    // Leave the locks to the sessions' close: one entry per session instead of one per lock.
    guards.into_iter().for_each(|g| drop(g.into_parts()));
    let closers = Arc::try_unwrap(all).unwrap_or_else(|a| (*a).clone());
    let _ = in_parallel("sessions closed", closers.len(), setup.concurrency, {
        let closers = Arc::new(closers);
        move |i| {
            let s = closers[i].clone();
            async move { Ok(s.close().await?) }
        }
    })
    .await;
    Ok(if lost_total == 0 {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    })
}

/// How many of `sessions` are lost (their client-side lease ran out, or the server ended them).
fn lost(sessions: &[holdfast_client::Session]) -> usize {
    sessions.iter().filter(|s| !s.is_valid()).count()
}
