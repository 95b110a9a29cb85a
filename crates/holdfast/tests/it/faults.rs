//! Real-process fault scenarios: five servers, two client processes running the lock-set workload
//! against the reference fenced store, and a nemesis; then the checker (`holdfast-checker`) verifies
//! P1–P5 on the clients' history, the servers' audit logs and the store's log.
//!
//! Each scenario runs the workload for `HOLDFAST_FAULT_SECS` seconds (default 15) and needs at least
//! 1,000 operations. Run longer: `HOLDFAST_FAULT_SECS=120 cargo nextest run -p holdfast faults`.

use crate::harness::{Cluster, Options};
use holdfast_checker::{check, parse_lines, AuditLine, Op, StoreRecord};
use holdfast_fence::store::FencedStore;
use std::sync::Arc;
use std::time::Duration;
use tokio::time::Instant;

#[derive(Clone, Copy, Debug)]
enum Nemesis {
    /// kill -9 the leader, restart it a second later.
    KillLeader,
    /// SIGSTOP the leader for 2 s (longer than the election timeout), then SIGCONT.
    PauseLeader,
    /// Cut every link of the leader for 2 s (clients still reach it).
    IsolateLeader,
    /// Cut two servers off from everyone for 2 s.
    PartitionMinority,
    /// SIGSTOP one client process for 4 s, longer than its 3 s TTL: its sessions expire mid-work.
    PauseClients,
    /// A seeded random choice of the above at each step.
    Mixed,
    /// Restart every server once, one after the other, as an upgrade would: SIGTERM (the server hands
    /// its leadership over first), wait for it to exit cleanly, start it, wait until it has caught up.
    RollingRestart,
}

fn signal(pid: u32, sig: &str) {
    let ok = std::process::Command::new("kill")
        .args([sig, &pid.to_string()])
        .status()
        .unwrap()
        .success();
    assert!(ok, "kill {sig} {pid}");
}

async fn run(nemesis: Nemesis, seed: u64) {
    let secs: u64 = std::env::var("HOLDFAST_FAULT_SECS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(15);
    let mut c = Cluster::start(Options {
        audit: true,
        ..Options::default()
    })
    .await;
    // Inside the cluster's directory, so a failed run keeps the history and the store with the logs.
    let work = c.dir().join("work");
    std::fs::create_dir_all(&work).unwrap();
    let store_path = work.join("fence.log");
    let store = Arc::new(FencedStore::open(&store_path).unwrap());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let store_addr = listener.local_addr().unwrap().to_string();
    tokio::spawn(holdfast_fence::service::serve(
        listener,
        store,
        std::future::pending(),
    ));

    let mut clients = Vec::new();
    for p in 0..2u64 {
        let child = c
            .holdfast()
            .args([
                "workload",
                "--clients",
                "4",
                "--locks",
                "4",
                "--ttl",
                "3s",
                "--pause-ms",
                "100",
            ])
            .args([
                "--duration",
                &format!("{secs}s"),
                "--min-ops",
                "600",
                "--store",
                &store_addr,
                "--seed",
                &(seed * 10 + p).to_string(),
            ])
            .arg("--history")
            .arg(work.join(format!("history-{p}.jsonl")))
            // One process sends its acquires and releases on the Calls streams, the other unary.
            .args((p == 1).then_some("--unary-calls"))
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        clients.push(child);
    }

    let mut rng = seed;
    let mut next = |n: u64| {
        rng = rng
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        (rng >> 33) % n
    };
    let started = Instant::now();
    let mut faults = Vec::new();
    if let Nemesis::RollingRestart = nemesis {
        for id in 1..=5u64 {
            tokio::time::sleep(Duration::from_millis(500)).await;
            let leader = c.wait_for_leader(0, Duration::from_secs(30)).await;
            faults.push(format!(
                "{:.1}s restart {id}{}",
                started.elapsed().as_secs_f64(),
                if id == leader { " (the leader)" } else { "" }
            ));
            crate::harness::terminate(c.pid(id));
            let status = c.wait_exit(id, Duration::from_secs(20)).await;
            assert!(
                status.success(),
                "server {id} did not stop cleanly: {status}"
            );
            c.start_server(id);
            c.wait_converged(0, Duration::from_secs(30)).await;
        }
    }
    while !matches!(nemesis, Nemesis::RollingRestart)
        && started.elapsed() + Duration::from_secs(4) < Duration::from_secs(secs)
    {
        tokio::time::sleep(Duration::from_millis(500 + next(1000))).await;
        let step = match nemesis {
            Nemesis::Mixed => [
                Nemesis::KillLeader,
                Nemesis::PauseLeader,
                Nemesis::IsolateLeader,
                Nemesis::PartitionMinority,
                Nemesis::PauseClients,
            ][next(5) as usize],
            other => other,
        };
        let leader = c.wait_for_leader(0, Duration::from_secs(30)).await;
        faults.push(format!(
            "{:.1}s {step:?} (leader {leader})",
            started.elapsed().as_secs_f64()
        ));
        match step {
            Nemesis::KillLeader => {
                c.kill(leader).await;
                tokio::time::sleep(Duration::from_secs(1)).await;
                c.start_server(leader);
            }
            Nemesis::PauseLeader => {
                signal(c.pid(leader), "-STOP");
                tokio::time::sleep(Duration::from_secs(2)).await;
                signal(c.pid(leader), "-CONT");
            }
            Nemesis::IsolateLeader => {
                c.proxies.isolate(leader);
                tokio::time::sleep(Duration::from_secs(2)).await;
                c.proxies.heal();
            }
            Nemesis::PartitionMinority => {
                let a = 1 + next(5);
                let b = 1 + (a + next(4)) % 5;
                c.proxies.isolate(a);
                c.proxies.isolate(b);
                tokio::time::sleep(Duration::from_secs(2)).await;
                c.proxies.heal();
            }
            Nemesis::PauseClients => {
                let pid = clients[next(2) as usize].id().unwrap();
                signal(pid, "-STOP");
                tokio::time::sleep(Duration::from_secs(4)).await;
                signal(pid, "-CONT");
            }
            Nemesis::Mixed | Nemesis::RollingRestart => unreachable!(),
        }
    }
    for mut client in clients {
        // A workload keeps going up to three times its duration (`--min-ops`), and a rolling restart
        // ends long before the workload does: wait for that, and a minute more.
        let limit = Duration::from_secs(secs * 3 + 60).saturating_sub(started.elapsed());
        let out = tokio::time::timeout(limit, client.wait())
            .await
            .expect("workload ended")
            .unwrap();
        assert!(out.success(), "a workload process failed: {out:?}");
    }
    c.proxies.heal();
    c.wait_converged(0, Duration::from_secs(30)).await;

    let mut history: Vec<Op> = Vec::new();
    for p in 0..2 {
        let text = std::fs::read_to_string(work.join(format!("history-{p}.jsonl"))).unwrap();
        history.extend(parse_lines::<Op>(&text).unwrap());
    }
    let mut audits = Vec::new();
    for s in &c.servers {
        let text = std::fs::read_to_string(s.data_dir.join("audit-g0.jsonl")).unwrap_or_default();
        audits.push((s.id, parse_lines::<AuditLine>(&text).unwrap()));
    }
    let store: Vec<StoreRecord> = holdfast_fence::store::read_records(&store_path)
        .unwrap()
        .into_iter()
        .map(|r| StoreRecord::new(r.write, r.key, r.token, &r.value))
        .collect();
    let report = check(&history, &audits, &store);
    // Availability: the longest time without a successful acquire completing, and the operations whose
    // outcome the client could not learn.
    let mut grants: Vec<u64> = history
        .iter()
        .filter(|o| o.op == "acquire" && o.ok())
        .map(|o| o.complete_ms)
        .collect();
    grants.sort();
    let longest_gap_ms = grants.windows(2).map(|w| w[1] - w[0]).max().unwrap_or(0);
    let unknown = history.iter().filter(|o| o.result == "unknown").count();
    eprintln!(
        "{nemesis:?} seed {seed}: longest gap between grants {longest_gap_ms} ms, {unknown} outcomes unknown; {} ops, {} grants, {} writes acknowledged, {} stale writes refused, {} entries applied, {} expiries checked, {} reads checked, {} operations linearized ({} locks inconclusive), {} watch events and {} lock-delays checked; faults: {}",
        report.ops, report.ok_grants, report.ok_writes, report.stale_refused, report.applied_entries, report.expiries_checked, report.reads_checked, report.linearized_ops, report.linearizability_inconclusive, report.watch_events_checked, report.lock_delays_checked, faults.join(", ")
    );
    assert!(
        report.violations.is_empty(),
        "{nemesis:?} seed {seed}: {} violations, first: {:#?}",
        report.violations.len(),
        &report.violations[..report.violations.len().min(10)]
    );
    assert!(
        report.ops >= 1_000,
        "{nemesis:?}: only {} operations",
        report.ops
    );
    assert!(!faults.is_empty());
    // Both workload processes watch every lock through the faults (P9 checked what they received).
    assert!(
        report.watch_events_checked >= report.ok_grants,
        "{nemesis:?}: only {} watch events checked for {} grants",
        report.watch_events_checked,
        report.ok_grants
    );
    if let Nemesis::RollingRestart = nemesis {
        // Planned restarts hand leadership over: no election between grants (after a crash one takes at
        // least the 350 ms vote lease plus the 200 ms least election timeout), and no request left
        // without an answer.
        assert!(
            longest_gap_ms < 500,
            "a rolling restart left {longest_gap_ms} ms without a grant; faults: {faults:?}"
        );
        assert_eq!(
            unknown, 0,
            "operations with an unknown outcome during a rolling restart"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn faults_rolling_restart_of_every_server() {
    run(Nemesis::RollingRestart, 7).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn faults_kill_the_leader() {
    run(Nemesis::KillLeader, 1).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn faults_pause_the_leader() {
    run(Nemesis::PauseLeader, 2).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn faults_isolate_the_leader() {
    run(Nemesis::IsolateLeader, 3).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn faults_partition_a_minority() {
    run(Nemesis::PartitionMinority, 4).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn faults_pause_clients_past_their_ttl() {
    run(Nemesis::PauseClients, 5).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn faults_mixed() {
    run(Nemesis::Mixed, 6).await;
}
