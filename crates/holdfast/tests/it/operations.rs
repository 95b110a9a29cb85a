//! Planned operations: a leader that stops hands its leadership over first, and `holdfast leader
//! transfer` does it by hand.

use crate::harness::{Cluster, Options};
use holdfast_proto::v1 as pb;
use std::time::Duration;
use tokio::time::Instant;

/// SIGTERM to the leader while a client loops acquire + release: the leader hands over before it exits,
/// so the longest gap between grants stays below 500 ms, which an election after a crash can never beat:
/// it waits out the followers' vote lease (the maximum election timeout, 350 ms) and then at least the
/// least election timeout (200 ms).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stopping_leader_hands_over_without_an_election_timeout() {
    let mut c = Cluster::start(Options {
        nodes: 3,
        ..Options::default()
    })
    .await;
    c.wait_converged(0, Duration::from_secs(20)).await;
    let leader = c.wait_for_leader(0, Duration::from_secs(10)).await;
    let client = c.client().await;
    let session = client.open_session(Duration::from_secs(10)).await.unwrap();
    use std::sync::atomic::{AtomicBool, AtomicU32, Ordering::Relaxed};
    let stop = std::sync::Arc::new(AtomicBool::new(false));
    let grants = std::sync::Arc::new(AtomicU32::new(0));
    let looping = tokio::spawn({
        let (session, stop, grants) = (session.clone(), stop.clone(), grants.clone());
        async move {
            let mut last = Instant::now();
            let mut longest = Duration::ZERO;
            while !stop.load(Relaxed) {
                let g = session
                    .acquire_timeout("ops/gap", Duration::from_secs(5))
                    .await
                    .expect("acquire during the hand-over");
                longest = longest.max(last.elapsed());
                last = Instant::now();
                grants.fetch_add(1, Relaxed);
                g.release().await.expect("release during the hand-over");
            }
            longest
        }
    });
    let grants_reach = |n: u32| {
        let grants = grants.clone();
        async move {
            let deadline = Instant::now() + Duration::from_secs(20);
            while grants.load(Relaxed) < n {
                assert!(
                    Instant::now() < deadline,
                    "the client stopped getting grants"
                );
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        }
    };
    // Some grants before, then stop the leader as an operator would, then some grants after.
    grants_reach(5).await;
    crate::harness::terminate(c.pid(leader));
    let status = c.wait_exit(leader, Duration::from_secs(20)).await;
    assert!(status.success(), "{status}");
    let next = c
        .wait_for_leader_except(0, leader, Duration::from_secs(10))
        .await;
    let before = grants.load(Relaxed);
    grants_reach(before + 5).await;
    stop.store(true, Relaxed);
    let longest = looping.await.unwrap();
    eprintln!("longest gap between grants across the hand-over: {longest:?}");
    let log = c.log_text(leader);
    assert!(
        log.contains(&format!("handed leadership of group 0 to node {next}")),
        "{log}"
    );
    assert!(
        longest < Duration::from_millis(500),
        "the longest gap between grants was {longest:?}: the hand-over waited for an election"
    );
}

/// `holdfast leader transfer --to N` moves a group's leadership to N; the cluster keeps serving.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn leader_transfer_moves_the_leadership_by_hand() {
    let c = Cluster::start(Options {
        nodes: 3,
        ..Options::default()
    })
    .await;
    c.wait_converged(0, Duration::from_secs(20)).await;
    let leader = c.wait_for_leader(0, Duration::from_secs(10)).await;
    let to = (1..=3).find(|&n| n != leader).unwrap();
    let out = c
        .holdfast()
        .args(["leader", "transfer", "--to", &to.to_string()])
        .output()
        .await
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(stdout.trim(), format!("group 0: led by node {to}"));
    assert_eq!(c.wait_for_leader(0, Duration::from_secs(10)).await, to);
    let client = c.client().await;
    let s = client.open_session(Duration::from_secs(10)).await.unwrap();
    s.try_acquire("ops/after")
        .await
        .unwrap()
        .release()
        .await
        .unwrap();
    // A node that is not a member is refused with a clear error.
    let out = c
        .holdfast()
        .args(["leader", "transfer", "--to", "9"])
        .output()
        .await
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(stderr.contains("node 9 is not a voter"), "{stderr}");
}

/// A TransferLeader whose caller gives up half way (to a server that is down, so the hand-over would
/// wait out its 3 s) must not keep that server from timing sessions when it leads again. A dropped call
/// used to leave the hand-over flag set for good, so that when the server next led, in a later term, it
/// never renewed or expired a session (found by the simulation with openraft's timers on skewed clocks,
/// seed 1,003,702: its table filled with sessions nobody renewed or expired).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_transfer_whose_caller_gives_up_leaves_the_leader_timing_sessions() {
    let mut c = Cluster::start(Options {
        nodes: 3,
        http: true,
        ..Options::default()
    })
    .await;
    c.wait_converged(0, Duration::from_secs(20)).await;
    let leader = c.wait_for_leader(0, Duration::from_secs(10)).await;
    let to = (1..=3).find(|&n| n != leader).unwrap();
    c.kill(to).await;
    const STARTED: &str = "leading: session timers started";
    c.wait_for_log(leader, STARTED, 1).await;
    let started = c.log_text(leader).matches(STARTED).count();

    let mut raw = c.raw(leader).await;
    let call = raw.transfer_leader(pb::TransferLeaderRequest { group: 0, to });
    assert!(
        tokio::time::timeout(Duration::from_millis(300), call)
            .await
            .is_err(),
        "a transfer to a server that is down answered within 300 ms"
    );

    // openraft's leader stops its heartbeats once a transfer is triggered, so the third server takes
    // over; then leadership comes back by hand.
    let other = c
        .wait_for_leader_except(0, leader, Duration::from_secs(10))
        .await;
    assert_ne!(other, to);
    c.holdfast_ok(&["leader", "transfer", "--to", &leader.to_string()])
        .await;
    assert_eq!(c.wait_for_leader(0, Duration::from_secs(10)).await, leader);
    c.wait_for_log(leader, STARTED, started + 1).await;
    // It renews a live client's session ...
    let client = c.client().await;
    let s = client.open_session(Duration::from_secs(2)).await.unwrap();
    let opened = s.last_renewal().0;
    let deadline = Instant::now() + Duration::from_secs(10);
    while s.last_renewal().0 == opened {
        assert!(
            Instant::now() < deadline,
            "no keepalive acknowledged within 10 s"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(s.is_valid());
    // ... and expires a silent one.
    let expired = c.metrics(leader).await[r#"holdfast_session_expiries_total{group="0"}"#];
    let _silent = c.silent_session(2_000, 7).await;
    let deadline = Instant::now() + Duration::from_secs(10);
    while c.metrics(leader).await[r#"holdfast_session_expiries_total{group="0"}"#] == expired {
        assert!(
            Instant::now() < deadline,
            "a silent session was not expired within 10 s"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// `holdfast server --check-config` on the shipped example configuration (deploy/config/holdfast.toml),
/// a broken variant, and a data dir of another node: it says what a start would do or why it would
/// fail, and writes nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn check_config_judges_the_shipped_example_and_writes_nothing() {
    let example =
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../deploy/config/holdfast.toml");
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let check = |extra: &[&str]| {
        let mut c = std::process::Command::new(env!("CARGO_BIN_EXE_holdfast"));
        c.args(["server", "--check-config", "--config"])
            .arg(&example)
            .arg("--data-dir")
            .arg(&data)
            .args(extra);
        c.output().unwrap()
    };
    let out = check(&["--node-id", "1"]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        stdout.contains("config OK: node 1 of 5 members, 4 groups"),
        "{stdout}"
    );
    assert!(stdout.contains("new (will form the cluster"), "{stdout}");
    assert!(
        !data.join("IDENTITY").exists(),
        "--check-config wrote to the data dir"
    );

    let out = check(&["--node-id", "1", "--min-ttl-ms", "500"]);
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("min_ttl_ms"));
    let out = check(&["--node-id", "1", "--snapshot-log-percent", "1001"]);
    assert_eq!(out.status.code(), Some(1));
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("snapshot_log_percent must be at most 1000"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    for flag in ["--workers=0", "--workers=257", "--client-workers=257"] {
        let out = check(&["--node-id", "1", flag]);
        assert_eq!(out.status.code(), Some(2), "{flag}: refused as a bad flag");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(stderr.contains("is not in"), "{flag}: {stderr}");
    }
    // The same bound on the key in the config file.
    let too_many = dir.path().join("too-many-workers.toml");
    let text = std::fs::read_to_string(&example).unwrap();
    std::fs::write(
        &too_many,
        text.replace("client_workers = 0", "client_workers = 257"),
    )
    .unwrap();
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_holdfast"))
        .args(["server", "--check-config", "--node-id", "1", "--config"])
        .arg(&too_many)
        .arg("--data-dir")
        .arg(&data)
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("client_workers must be at most 256"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let out = check(&["--node-id", "9"]);
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("node id 9 is not among the members"));

    // A data dir created for node 2 is refused for node 1, naming both.
    std::fs::create_dir_all(&data).unwrap();
    std::fs::write(
        data.join("IDENTITY"),
        "format=1\ncluster_id=00000000000000aa\nnode_id=2\ngroups=4\n",
    )
    .unwrap();
    let out = check(&["--node-id", "1"]);
    assert_eq!(out.status.code(), Some(1));
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("was created for node 2 with 4 groups"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let out = check(&["--node-id", "2"]);
    assert!(out.status.success());
    assert!(String::from_utf8_lossy(&out.stdout).contains("node 2 of cluster 00000000000000aa"));
}

/// What `read` finds in each of a process's threads' directories (`/proc/PID/task/TID`); a thread that
/// ends between the listing and the read (`read` gives `None`) is left out.
fn per_thread<T>(pid: u32, read: impl Fn(&std::path::Path) -> Option<T>) -> Vec<T> {
    std::fs::read_dir(format!("/proc/{pid}/task"))
        .unwrap()
        .filter_map(|t| read(&t.ok()?.path()))
        .collect()
}

/// The name and the context switches so far (voluntary and not) of each of a process's threads, from
/// /proc.
fn threads(pid: u32) -> Vec<(String, u64)> {
    per_thread(pid, |path| {
        let name = std::fs::read_to_string(path.join("comm")).ok()?;
        let status = std::fs::read_to_string(path.join("status")).ok()?;
        let switches = status
            .lines()
            .filter(|l| l.contains("ctxt_switches:"))
            .filter_map(|l| l.split_whitespace().nth(1)?.parse::<u64>().ok())
            .sum();
        Some((name.trim_end().to_string(), switches))
    })
}

/// The context switches of `pid`'s threads called `name`, summed.
fn switches_of(pid: u32, name: &str) -> u64 {
    threads(pid)
        .iter()
        .filter(|(n, _)| n == name)
        .map(|(_, s)| s)
        .sum()
}

/// The scheduling policy of each of a process's threads (`/proc/PID/task/TID/stat`, field 41: 0
/// SCHED_OTHER, 3 SCHED_BATCH), by thread name.
fn policies(pid: u32) -> Vec<(String, u32)> {
    per_thread(pid, |path| {
        let stat = std::fs::read_to_string(path.join("stat")).ok()?;
        // The name, in parentheses, may hold spaces; the fields after it start at field 3.
        let (head, fields) = stat.rsplit_once(") ")?;
        let name = head.split_once(" (")?.1.to_string();
        let policy = fields.split_whitespace().nth(41 - 3)?.parse().ok()?;
        Some((name, policy))
    })
}

/// Puts every thread of this test process under `policy`, so that the servers it starts next inherit
/// it (as they would from `chrt` or systemd).
#[allow(
    unsafe_code,
    reason = "sched_setscheduler(2) on this process's own threads with a parameter struct on the stack"
)]
fn schedule_own_threads(policy: libc::c_int) {
    let param = libc::sched_param { sched_priority: 0 };
    let tids = per_thread(std::process::id(), |path| {
        path.file_name()?.to_str()?.parse::<libc::pid_t>().ok()
    });
    for tid in tids {
        // SAFETY: `param` is a valid sched_param that outlives the call; `tid` is a thread of ours.
        if unsafe { libc::sched_setscheduler(tid, policy, &param) } != 0 {
            let e = std::io::Error::last_os_error();
            // A thread may end between the listing and the call.
            assert_eq!(e.raw_os_error(), Some(libc::ESRCH), "thread {tid}: {e}");
        }
    }
    assert_eq!(policies(std::process::id())[0].1, policy as u32);
}

/// Started under SCHED_BATCH (this test's threads have it, and the servers inherit it), a server with
/// `--scheduling normal` puts every thread of its under SCHED_OTHER and serves as usual; one without
/// the flag keeps the policy it was started under and says so. (Started under SCHED_OTHER, a server
/// without the flag goes to SCHED_BATCH: `a_server_can_serve_its_client_port_on_threads_of_its_own`.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_takes_the_scheduling_policy_it_is_given_or_keeps_the_one_it_was_started_under() {
    schedule_own_threads(libc::SCHED_BATCH);
    for (flags, want, says) in [
        (vec!["--scheduling=normal"], 0, None),
        (
            vec![],
            3,
            Some("kept the scheduling policy this server was started under"),
        ),
    ] {
        let mut server_args: Vec<String> = flags.iter().map(|f| f.to_string()).collect();
        server_args.push("--client-workers=2".into());
        let c = Cluster::start(Options {
            nodes: 1,
            server_args,
            ..Options::default()
        })
        .await;
        let leader = c.wait_for_leader(0, Duration::from_secs(10)).await;
        let client = c.client().await;
        let session = client.open_session(Duration::from_secs(2)).await.unwrap();
        session
            .try_acquire("sched/normal")
            .await
            .unwrap()
            .release()
            .await
            .unwrap();
        let policies = policies(c.pid(leader));
        assert!(policies.len() >= 4, "{flags:?}: {policies:?}");
        assert!(
            policies.iter().all(|(_, p)| *p == want),
            "{flags:?}: {policies:?}"
        );
        if let Some(text) = says {
            assert!(c.log_text(leader).contains(text), "{flags:?}");
        }
    }
}

/// `--workers 1 --client-workers 2` (what `holdfast dev` gave each server until 2026-12-07; it now
/// gives the client port one thread): the client port runs on two
/// threads of its own and the rest on one; calls are served on the `Calls` connection, keepalives over
/// gRPC; a stopping leader still hands over and exits cleanly, its client port's runtime shut down from
/// inside the server's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_can_serve_its_client_port_on_threads_of_its_own() {
    // Started under SCHED_OTHER whatever ran the tests, so that SCHED_BATCH below is the server's doing.
    schedule_own_threads(libc::SCHED_OTHER);
    let mut c = Cluster::start(Options {
        nodes: 3,
        http: true,
        server_args: vec!["--workers=1".into(), "--client-workers=2".into()],
        ..Options::default()
    })
    .await;
    let leader = c.wait_for_leader(0, Duration::from_secs(10)).await;
    // Exact counts: a fresh server has run no blocking work yet (whose pool threads would carry the
    // same names as its runtime's workers).
    let pid = c.pid(leader);
    let names: Vec<String> = threads(pid).into_iter().map(|(n, _)| n).collect();
    let count = |name: &str| names.iter().filter(|n| *n == name).count();
    assert_eq!(count("holdfast-client"), 2, "{names:?}");
    assert_eq!(count("tokio-rt-worker"), 1, "{names:?}");
    // The default policy, set in `main` before any thread started: every thread has it (the WAL's
    // writer and the client port's runtime included), not only the main one.
    let policies = policies(pid);
    for name in [
        "holdfast",
        "holdfast-client",
        "tokio-rt-worker",
        "holdfast-wal",
    ] {
        assert!(
            policies.iter().any(|(n, _)| n == name),
            "no thread {name}: {policies:?}"
        );
    }
    assert!(policies.iter().all(|(_, p)| *p == 3), "{policies:?}");

    let client = c.client().await;
    let session = client.open_session(Duration::from_secs(2)).await.unwrap();
    // The calls run on the client port's threads: each of the 100 wakes one of them from idle (they
    // would sleep through all of them if the port had stayed on the server's runtime).
    let before = switches_of(pid, "holdfast-client");
    for i in 0..50 {
        let guard = session.try_acquire(&format!("rt/{i}")).await.unwrap();
        guard.release().await.unwrap();
    }
    let woken = switches_of(pid, "holdfast-client") - before;
    assert!(
        woken >= 50,
        "the client port's threads switched {woken} times for 100 calls"
    );
    // Past a TTL the lease lives only if its keepalives (gRPC, on the client port) are answered.
    let lost = tokio::time::timeout(Duration::from_millis(2500), session.lost()).await;
    assert!(
        lost.is_err(),
        "the session's keepalives went unanswered: {lost:?}"
    );
    session
        .try_acquire("rt/after")
        .await
        .unwrap()
        .release()
        .await
        .unwrap();
    let metrics = c.http_get(leader, "/metrics").await.1;
    let connections: u64 = metrics
        .lines()
        .find(|l| l.starts_with("holdfast_call_connections_total"))
        .and_then(|l| l.rsplit(' ').next()?.parse().ok())
        .unwrap_or_else(|| panic!("no holdfast_call_connections_total in {metrics}"));
    assert!(
        connections >= 1,
        "calls went over gRPC: {connections} connections"
    );

    crate::harness::terminate(c.pid(leader));
    let status = c.wait_exit(leader, Duration::from_secs(20)).await;
    assert!(status.success(), "{status}");
    c.wait_for_leader_except(0, leader, Duration::from_secs(10))
        .await;
    session
        .try_acquire("rt/next")
        .await
        .unwrap()
        .release()
        .await
        .unwrap();
}
