//! What a newcomer and an operator hit first (issue 14): a partial endpoint list, readiness and status
//! without a quorum, malformed endpoints.

use crate::harness::{Cluster, Options};
use std::time::Duration;
use tokio::time::Instant;

/// A client given only followers' endpoints still reaches the leader: it learns the members from the
/// first server that answers and follows redirects to the leader's advertised endpoint, also after the
/// leader changes to a server it was never told about.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_with_a_partial_endpoint_list_follows_the_leader_anywhere() {
    let mut c = Cluster::start(Options::default()).await;
    let leader = c.wait_for_leader(0, Duration::from_secs(10)).await;
    let followers: Vec<String> = (1..=5)
        .filter(|&n| n != leader)
        .take(2)
        .map(|n| c.endpoint(n))
        .collect();
    let client = holdfast_client::Client::connect(followers.clone())
        .await
        .unwrap();
    assert!(
        client.endpoints().contains(&c.endpoint(leader)),
        "the members were learned: {:?}",
        client.endpoints()
    );
    let s = client.open_session(Duration::from_secs(10)).await.unwrap();
    let g = s.try_acquire("partial").await.unwrap();
    g.release().await.unwrap();

    // The same through the CLI, with one follower's endpoint only.
    let out = c
        .holdfast()
        .env("HOLDFAST_ENDPOINTS", &followers[0])
        .args(["lock", "partial", "--", "true"])
        .output()
        .await
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );

    // The leader dies; the next one may be any server, also one this client was never given.
    c.kill(leader).await;
    let next = c
        .wait_for_leader_except(0, leader, Duration::from_secs(20))
        .await;
    let g = s
        .acquire_timeout("partial", Duration::from_secs(10))
        .await
        .unwrap_or_else(|e| panic!("acquire after the leader moved to node {next}: {e}"));
    assert!(g.token() > 0);
}

/// With two of three servers down, the survivor is not ready and `holdfast status` says why and exits
/// non-zero; with all up, both say healthy.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readiness_and_status_need_a_leader_a_quorum_confirms() {
    let mut c = Cluster::start(Options {
        nodes: 3,
        http: true,
        ..Options::default()
    })
    .await;
    c.wait_converged(0, Duration::from_secs(20)).await;
    for id in 1..=3 {
        let (code, body) = c.http_get(id, "/readyz").await;
        assert_eq!(code, 200, "node {id}: {body}");
    }
    let out = c.holdfast().arg("status").output().await.unwrap();
    assert!(
        out.status.success(),
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );

    let leader = c.wait_for_leader(0, Duration::from_secs(10)).await;
    let survivor = (1..=3).find(|&n| n != leader).unwrap();
    for id in (1..=3).filter(|&n| n != survivor) {
        c.kill(id).await;
    }
    // The survivor may take a moment to notice: wait for /readyz to turn (bounded).
    let deadline = Instant::now() + Duration::from_secs(20);
    let body = loop {
        let (code, body) = c.http_get(survivor, "/readyz").await;
        if code == 503 {
            break body;
        }
        assert!(
            Instant::now() < deadline,
            "still ready without a quorum: {code} {body}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert!(body.contains("group 0"), "{body}");

    // Status from the survivor alone still shows every member, and flags the dead ones and the group.
    let out = c
        .holdfast()
        .env("HOLDFAST_ENDPOINTS", c.endpoint(survivor))
        .arg("status")
        .output()
        .await
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stdout}{stderr}");
    for id in (1..=3).filter(|&n| n != survivor) {
        assert!(
            stderr.contains(&format!("node {id} at {} is unreachable", c.endpoint(id))),
            "{stderr}"
        );
    }
    assert!(
        stderr.contains("group 0 has no leader confirmed by a quorum"),
        "{stderr}"
    );
}

/// Malformed endpoints are refused at once with a message that says what is wrong; a port that is not
/// a Holdfast client port is named as such instead of a silent 15 s wait.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_endpoints_fail_fast_and_say_why() {
    let c = Cluster::start(Options {
        nodes: 1,
        ..Options::default()
    })
    .await;
    for (endpoint, expected) in [
        ("garbage", "is not host:port"),
        ("http://127.0.0.1:7001", "has a scheme"),
        ("127.0.0.1:99999", "no valid port"),
    ] {
        let started = Instant::now();
        let out = c
            .holdfast()
            .env("HOLDFAST_ENDPOINTS", endpoint)
            .arg("locks")
            .output()
            .await
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{endpoint}: {stderr}");
        assert!(stderr.contains(expected), "{endpoint}: {stderr}");
        assert_eq!(stderr.lines().count(), 1, "{stderr}");
        assert!(
            started.elapsed() < Duration::from_secs(5),
            "{endpoint} took {:?}",
            started.elapsed()
        );
    }
    // A peer port speaks gRPC, but not the client API.
    let peer = c.peer_endpoint(1);
    let out = c
        .holdfast()
        .env("HOLDFAST_ENDPOINTS", &peer)
        .args(["locks", "--timeout", "3s"])
        .output()
        .await
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(stderr.contains("not a Holdfast client port"), "{stderr}");
    // Nothing listens: the cause is named, within the --timeout given.
    let started = Instant::now();
    let out = c
        .holdfast()
        .env("HOLDFAST_ENDPOINTS", "127.0.0.1:1")
        .args(["locks", "--timeout", "2s"])
        .output()
        .await
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.to_lowercase().contains("connection refused"),
        "{stderr}"
    );
    assert!(
        started.elapsed() < Duration::from_secs(6),
        "took {:?}",
        started.elapsed()
    );
}
