//! Per-server bounds on connections and streams: a flood is capped and the server keeps serving the
//! clients it already has.

use crate::harness::{Cluster, Options};
use std::time::{Duration, Instant};

const MAX_CONNECTIONS: usize = 16;
const MAX_STREAMS: u32 = 8;

/// The value of an unlabelled (or the first labelled) sample of `name` in a `/metrics` body.
fn metric(body: &str, name: &str) -> u64 {
    body.lines()
        .find(|l| l.starts_with(name) && !l.starts_with('#'))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("{name} not in {body}"))
}

/// Acquire+release cycles of an already connected client, with the latency of each.
async fn cycles(session: &holdfast_client::Session, prefix: &str, n: usize) -> Vec<Duration> {
    let mut took = Vec::with_capacity(n);
    for i in 0..n {
        let started = Instant::now();
        let guard = session
            .try_acquire(&format!("{prefix}/{i}"))
            .await
            .unwrap_or_else(|e| panic!("cycle {i} during the flood: {e}"));
        guard.release().await.unwrap();
        took.push(started.elapsed());
    }
    took.sort();
    took
}

fn p99(sorted: &[Duration]) -> Duration {
    sorted[(sorted.len() - 1) * 99 / 100]
}

/// 200 extra TCP connections to the leader's client port: at most `max_client_connections` stay open,
/// the rest are closed at accept and counted, and the client that was already connected keeps working.
/// 50 streams on one connection to a follower: at most `max_streams_per_connection` are in progress.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn floods_of_connections_and_streams_are_capped_and_others_are_served() {
    let c = Cluster::start(Options {
        nodes: 3,
        http: true,
        server_args: vec![
            format!("--max-client-connections={MAX_CONNECTIONS}"),
            format!("--max-streams-per-connection={MAX_STREAMS}"),
        ],
        ..Options::default()
    })
    .await;
    let leader = c.wait_for_leader(0, Duration::from_secs(10)).await;
    let client = c.client().await;
    let session = client.open_session(Duration::from_secs(10)).await.unwrap();
    let before = cycles(&session, "calm", 100).await;

    // Streams: each KeepAliveStream call waits for its first message, so all 50 would stay open.
    let follower = (1..=3).find(|&i| i != leader).unwrap();
    let raw = c.raw(follower).await;
    let mut streams = Vec::new();
    for _ in 0..50 {
        let mut raw = raw.clone();
        streams.push(tokio::spawn(async move {
            let never =
                tonic::codegen::tokio_stream::pending::<holdfast_proto::v1::KeepAliveRequest>();
            let _ = raw.keep_alive_stream(never).await;
            std::future::pending::<()>().await
        }));
    }
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let open = metric(
            &c.http_get(follower, "/metrics").await.1,
            "holdfast_keepalive_streams",
        );
        assert!(
            open <= u64::from(MAX_STREAMS),
            "{open} streams on one connection"
        );
        if open == u64::from(MAX_STREAMS) {
            break;
        }
        assert!(Instant::now() < deadline, "only {open} streams opened");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }

    // Connections: hold 200 more to the leader.
    let port: u16 = c
        .endpoint(leader)
        .rsplit(':')
        .next()
        .unwrap()
        .parse()
        .unwrap();
    let mut flood = Vec::new();
    for _ in 0..200 {
        flood.push(
            tokio::net::TcpStream::connect(("127.0.0.1", port))
                .await
                .unwrap(),
        );
    }
    let deadline = Instant::now() + Duration::from_secs(20);
    let (open, refused) = loop {
        let body = c.http_get(leader, "/metrics").await.1;
        let open = metric(&body, "holdfast_client_connections");
        let refused = metric(&body, "holdfast_connections_refused_total");
        assert!(open <= MAX_CONNECTIONS as u64, "{open} connections open");
        if open + refused >= 200 {
            break (open, refused);
        }
        assert!(Instant::now() < deadline, "{open} open, {refused} refused");
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert!(refused >= 200 - MAX_CONNECTIONS as u64, "{refused} refused");
    let during = cycles(&session, "flood", 100).await;
    eprintln!(
        "with {open} connections open and {refused} refused: cycle p99 {:?} before the flood, {:?} during it",
        p99(&before),
        p99(&during)
    );
    // Closed connections give their slots back: new clients get in again.
    drop(flood);
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let open = metric(
            &c.http_get(leader, "/metrics").await.1,
            "holdfast_client_connections",
        );
        if open < MAX_CONNECTIONS as u64 / 2 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "{open} connections still open after the flood closed"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let fresh = c.client().await;
    fresh.open_session(Duration::from_secs(10)).await.unwrap();
    for s in streams {
        s.abort();
    }
}

/// 70 idle connections to the HTTP port: 64 are served (and closed by the 5 s request timeout), the
/// other 6 are closed at accept and counted; afterwards the port serves again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http_connections_are_capped() {
    use tokio::io::AsyncReadExt;
    let c = Cluster::start(Options {
        nodes: 1,
        http: true,
        ..Options::default()
    })
    .await;
    let port = c.servers[0].http_port.unwrap();
    let mut idle = Vec::new();
    for _ in 0..70 {
        idle.push(
            tokio::net::TcpStream::connect(("127.0.0.1", port))
                .await
                .unwrap(),
        );
    }
    // Every one ends: refused at once, or dropped by the server's request timeout.
    for mut s in idle {
        let mut buf = [0u8; 16];
        let n = s.read(&mut buf).await.unwrap_or(0);
        assert_eq!(n, 0, "an idle connection was answered");
    }
    let refused = c.metrics(1).await["holdfast_connections_refused_total{port=\"http\"}"];
    assert_eq!(refused, 70 - holdfast_server::http::MAX_CONNECTIONS as u64);
}

/// A two-group cluster whose servers give each table 1 MiB: acquires with values fill group 1's until
/// a grant is refused LIMIT_EXCEEDED `max_table_bytes` (naming the budget), every server reports the
/// same charge, never above the budget, and a new session is refused too (at its first use of the full
/// group; a session opens in no group it does not use); releasing a lock makes room again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_table_refuses_new_sessions_and_locks_until_a_release_makes_room() {
    const BUDGET: u64 = 1 << 20;
    let c = Cluster::start(Options {
        nodes: 3,
        groups: 2,
        http: true,
        server_args: vec!["--table-budget-mib=1".into()],
        ..Options::default()
    })
    .await;
    let leader = c.wait_for_leader(1, Duration::from_secs(10)).await;
    let client = c.client().await;
    let session = client.open_session(Duration::from_secs(30)).await.unwrap();
    // The leaders put their budget into the log: every server has it, in both groups.
    for group in 0..2 {
        c.wait_converged(group, Duration::from_secs(10)).await;
        for id in 1..=3 {
            let g = c.group_status(id, group).await.unwrap();
            assert_eq!(g.table_budget, BUDGET, "node {id}, group {group}");
        }
    }
    // Fill it: first with 1 KiB values, then with empty ones, each until refused.
    let mut guards = Vec::new();
    let mut refusal = None;
    for (i, value) in [vec![b'v'; 1024], Vec::new()].iter().enumerate() {
        for n in 0.. {
            let name = format!("full/{i}/{n}");
            if holdfast_client::group_for(&name, 2) != 1 {
                continue;
            }
            match session
                .acquire_with_value(&name, Duration::ZERO, value)
                .await
            {
                Ok(guard) => guards.push(guard),
                Err(e) => {
                    refusal = Some(e);
                    break;
                }
            }
        }
    }
    match refusal.unwrap() {
        holdfast_client::Error::LimitExceeded { limit, value, .. } => {
            assert_eq!((limit.as_str(), value), ("max_table_bytes", BUDGET));
        }
        other => panic!("expected max_table_bytes, got {other}"),
    }
    assert!(
        guards.len() > 700,
        "only {} locks fit in 1 MiB",
        guards.len()
    );
    // Less than an empty grant is left, so a session (1,024 bytes) does not fit either: a new session's
    // first use of group 1 is refused. (With two groups a session opens in a group at its first use
    // there, so the open itself asks nothing of any server.)
    let refused = client.open_session(Duration::from_secs(30)).await.unwrap();
    match refused.open_for(guards[0].name()).await {
        Err(holdfast_client::Error::LimitExceeded { limit, .. }) => {
            assert_eq!(limit, "max_table_bytes")
        }
        Err(e) => panic!("expected max_table_bytes for a new session, got {e}"),
        Ok(_) => panic!("a new session was opened in a full table"),
    }
    assert_eq!(refused.ids(), vec![0, 0]);
    // Neither session was ever used in group 0, so group 0 has none.
    c.wait_converged(0, Duration::from_secs(10)).await;
    let g0 = c.group_status(leader, 0).await.unwrap();
    assert_eq!(
        g0.sessions, 0,
        "sessions used only in group 1 are in group 0 too"
    );
    c.wait_converged(1, Duration::from_secs(10)).await;
    let charged: Vec<u64> = {
        let mut v = Vec::new();
        for id in 1..=3 {
            v.push(c.group_status(id, 1).await.unwrap().table_bytes);
        }
        v
    };
    assert!(
        charged.iter().all(|&b| b == charged[0] && b <= BUDGET),
        "{charged:?}"
    );
    let metrics = c.metrics(leader).await;
    assert_eq!(metrics["holdfast_table_bytes{group=\"1\"}"], charged[0]);
    assert_eq!(metrics["holdfast_table_budget_bytes{group=\"1\"}"], BUDGET);
    // `holdfast status` warns that the table is nearly full.
    let out = c.holdfast().args(["status"]).output().await.unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("of its memory budget"), "{stderr}");
    // A release frees a lock with its value: a new session and a lock fit again.
    guards.swap_remove(0).release().await.unwrap();
    let other = client.open_session(Duration::from_secs(30)).await.unwrap();
    let after = (0..)
        .map(|n| format!("full/after/{n}"))
        .find(|n| holdfast_client::group_for(n, 2) == 1)
        .unwrap();
    other.try_acquire(&after).await.unwrap();
}
