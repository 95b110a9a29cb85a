//! A real server process crashed at each failpoint (`holdfast_wal::failpoint`: WAL write and sync,
//! segment rotation, purge, snapshot write and rename, apply, vote save) recovers: it starts again
//! from what it left on disk, with every entry it had acknowledged to the leader still in its own log
//! (checked while it is cut off from the others, so nothing is re-sent), then catches up and ends with
//! the same table as the others, and no acknowledged grant is lost.
//!
//! A process crash keeps what the process wrote (the kernel has it); what a power loss also loses is
//! the simulation's and the WAL tests' subject.

use crate::harness::{Cluster, Options};
use holdfast_client::{LockGuard, Session};
use std::os::unix::process::ExitStatusExt;
use std::time::Duration;

const SECS_30: Duration = Duration::from_secs(30);

/// Each failpoint with the hit that crashes (later hits land in the middle of a busy log).
const CASES: &[(&str, u32)] = &[
    ("wal.write", 20),
    ("wal.sync", 20),
    ("wal.rotate", 3),
    ("wal.purge", 2),
    ("snapshot.write", 2),
    ("snapshot.rename", 2),
    ("apply", 200),
    ("vote.save", 1),
];

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_crashed_at_each_failpoint_recovers_and_loses_nothing() {
    assert_eq!(
        CASES.iter().map(|c| c.0).collect::<Vec<_>>(),
        holdfast_wal::failpoint::NAMES,
        "every failpoint has a case"
    );
    // Small segments and frequent snapshots, so rotations, purges and snapshots happen within seconds.
    let mut c = Cluster::start(Options {
        nodes: 3,
        http: true,
        snapshot_every_entries: 100,
        snapshot_keep_entries: 10,
        server_args: vec!["--wal-segment-bytes=65536".into()],
        ..Options::default()
    })
    .await;
    let client = c.client().await;
    let session = client.open_session(Duration::from_secs(60)).await.unwrap();
    let mut held: Vec<LockGuard> = Vec::new();
    for &(name, at) in CASES {
        let leader = c.wait_for_leader(0, SECS_30).await;
        let victim = (1..=3).find(|&i| i != leader).unwrap();
        c.kill(victim).await;
        c.servers[(victim - 1) as usize].extra_args = vec![format!("--failpoint={name}={at}")];
        // The log file is appended to by every start of the victim: wait for this start's line.
        let armed = c.log_text(victim).matches("failpoint armed").count();
        c.start_server(victim);
        c.wait_for_log(victim, "failpoint armed", armed + 1).await;
        // Load until the victim reaches its failpoint; the other two keep acknowledging.
        let (stop, stopped) = tokio::sync::watch::channel(false);
        let load = tokio::spawn(load(session.clone(), name, stopped));
        if name == "vote.save" {
            // A vote is saved when the term changes: move leadership to the third server.
            let third = (1..=3).find(|&i| i != leader && i != victim).unwrap();
            c.holdfast_ok(&["leader", "transfer", "--to", &third.to_string()])
                .await;
        }
        let status = c.wait_exit(victim, Duration::from_secs(60)).await;
        stop.send_replace(true);
        held.extend(load.await.unwrap());
        // What the victim acknowledged before it died: the leader's log end minus its lag, read once
        // the load has stopped (keepalives are not log entries, so the log end stays put).
        let leader = c.wait_for_leader(0, SECS_30).await;
        let acknowledged = {
            let last = c.group_status(leader, 0).await.unwrap().last_log_index;
            let lag = c.metrics(leader).await
                [&format!("holdfast_replication_lag_entries{{group=\"0\",follower=\"{victim}\"}}")];
            last - lag
        };
        assert_eq!(
            status.signal(),
            Some(6),
            "{name}: the victim aborts ({status})"
        );
        let log = c.log_text(victim);
        assert!(
            log.contains(&format!("failpoint {name} reached")),
            "{name}: the crash is the failpoint's:\n{log}"
        );
        // Restarted without it and cut off from the others, the victim has every entry it
        // acknowledged in its own log (or in its snapshot); then it catches up.
        c.proxies.isolate(victim);
        c.start_server(victim);
        let deadline = std::time::Instant::now() + SECS_30;
        let recovered = loop {
            if let Some(g) = c.group_status(victim, 0).await {
                break g.last_log_index.max(g.snapshot_index);
            }
            assert!(
                std::time::Instant::now() < deadline,
                "{name}: the victim does not start"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        };
        assert!(
            recovered >= acknowledged,
            "{name}: the victim acknowledged entries up to {acknowledged} but recovered to {recovered}"
        );
        c.proxies.heal();
        c.wait_converged(0, Duration::from_secs(60)).await;
        crate::storage::assert_held(&client, &session, &held).await;
        eprintln!(
            "failpoint {name}={at}: node {victim} crashed having acknowledged up to {acknowledged}, recovered to {recovered}; {} locks held",
            held.len()
        );
    }
}

/// Acquire+release cycles, holding every tenth lock, until told to stop; returns the held locks.
async fn load(
    session: Session,
    name: &'static str,
    mut stopped: tokio::sync::watch::Receiver<bool>,
) -> Vec<LockGuard> {
    let mut held = Vec::new();
    let mut i = 0;
    while !*stopped.borrow_and_update() {
        let guard = session
            .try_acquire(&format!("fp/{name}/{i}"))
            .await
            .unwrap_or_else(|e| panic!("{name}: acquire {i} while one server crashes: {e}"));
        if i % 10 == 0 {
            held.push(guard);
        } else {
            guard.release().await.unwrap();
        }
        i += 1;
    }
    held
}
