//! Acquires whose caller goes away, and grants that arrive after the client's lease lapsed: neither may
//! leave a holder that does not know it holds the lock (issue 8, defects 1 and 2).

use crate::client::until;
use crate::harness::{Cluster, Options};
use holdfast_proto::v1 as pb;
use std::process::Stdio;
use std::time::Duration;

fn three() -> Options {
    Options {
        nodes: 3,
        http: true,
        ..Options::default()
    }
}

/// Opens a session in group 0 with a raw gRPC client (no keepalives: the TTL must outlive the test).
pub(crate) async fn raw_session(
    raw: &mut holdfast_proto::v1::holdfast_client::HoldfastClient<tonic::transport::Channel>,
    ttl_ms: u64,
    nonce: u64,
) -> (u64, Vec<u8>) {
    let opened = raw
        .open_session(pb::OpenSessionRequest {
            group: 0,
            ttl_ms,
            nonce_hi: nonce,
            nonce_lo: nonce,
        })
        .await
        .unwrap()
        .into_inner();
    (opened.session_id, opened.session_secret)
}

/// A caller that drops a waiting `acquire` (a timeout around it) leaves no wait behind: when the holder
/// releases, a fresh session gets the lock, not the session whose caller gave up (which stays alive).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dropped_waiting_acquire_leaves_no_wait_and_no_unknowing_holder() {
    let c = Cluster::start(three()).await;
    let client = c.client().await;
    let a = client.open_session(Duration::from_secs(10)).await.unwrap();
    let b = client.open_session(Duration::from_secs(10)).await.unwrap();
    let held = a.try_acquire("x").await.unwrap();

    let gave_up = tokio::time::timeout(Duration::from_millis(500), b.acquire("x")).await;
    assert!(gave_up.is_err(), "the wait should still be pending");
    until(&client, "x", "rid of the abandoned wait", |l| {
        l.is_some_and(|l| l.waiters.is_empty())
    })
    .await;

    held.release().await.unwrap();
    let fresh = client.open_session(Duration::from_secs(10)).await.unwrap();
    let got = fresh
        .try_acquire("x")
        .await
        .expect("the lock is free for a fresh session, not granted to the caller that gave up");
    assert!(
        b.is_valid(),
        "B's session is alive: only its wait went away"
    );
    drop(got);
}

/// The server side, with no client library: an `Acquire` call whose stream is reset while it waits is
/// abandoned through the log by the server itself, and a retry of that request id learns it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_raw_acquire_whose_call_is_cancelled_is_abandoned_by_the_server() {
    let c = Cluster::start(three()).await;
    let leader = c.wait_for_leader(0, Duration::from_secs(10)).await;
    let client = c.client().await;
    let a = client.open_session(Duration::from_secs(10)).await.unwrap();
    let held = a.try_acquire("x").await.unwrap();

    let mut raw = c.raw(leader).await;
    // A long TTL: B's session outlives the test, so only the abandon can free the lock for others.
    let (b, b_secret) = raw_session(&mut raw, 120_000, 7).await;
    let acquire = pb::AcquireRequest {
        group: 0,
        session_id: b,
        request_id: 1,
        name: "x".into(),
        wait_timeout_ms: 60_000,
        value: vec![],
        client_cancels: false,
        session_secret: b_secret.clone(),
        lock_delay_ms: 0,
        shared: false,
        permits: 0,
    };
    // Dropping the call's future resets its HTTP/2 stream; the connection stays open.
    let dropped = tokio::time::timeout(
        Duration::from_millis(500),
        raw.clone().acquire(acquire.clone()),
    )
    .await;
    assert!(dropped.is_err(), "the wait should still be pending");
    until(&client, "x", "rid of the reset call's wait", |l| {
        l.is_some_and(|l| l.waiters.is_empty())
    })
    .await;
    let abandoned = c.metrics(leader).await;
    assert_eq!(
        abandoned.get("holdfast_acquires_abandoned_total{group=\"0\"}"),
        Some(&1),
        "{abandoned:?}"
    );

    // A retry of the abandoned request id changes nothing and says why.
    let retry = raw.acquire(acquire).await.unwrap_err();
    assert_eq!(
        retry
            .metadata()
            .get(holdfast_proto::REASON_METADATA_KEY)
            .and_then(|v| v.to_str().ok()),
        Some("ACQUIRE_ABANDONED"),
        "{retry:?}"
    );

    held.release().await.unwrap();
    let fresh = client.open_session(Duration::from_secs(10)).await.unwrap();
    fresh
        .try_acquire("x")
        .await
        .expect("nobody holds the lock after its holder released it");
}

/// `CancelAcquire` on a request that was granted releases the grant; on one that never reached the log,
/// it makes the later acquire change nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancel_acquire_releases_a_grant_and_forestalls_a_late_acquire() {
    let c = Cluster::start(three()).await;
    let client = c.client().await;
    let s = client.open_session(Duration::from_secs(10)).await.unwrap();
    let (name, token) = s.try_acquire("y").await.unwrap().into_parts();
    assert!(token > 0);
    // The guard took request id 1 (the first of this session).
    s.cancel_acquire(&name, 1).await.unwrap();
    until(&client, "y", "released by the cancel", |l| l.is_none()).await;

    s.cancel_acquire("z", 1_000).await.unwrap();
    let mut raw = c
        .raw(c.wait_for_leader(0, Duration::from_secs(10)).await)
        .await;
    let late = raw
        .acquire(pb::AcquireRequest {
            group: 0,
            session_id: s.ids()[0],
            request_id: 1_000,
            name: "z".into(),
            wait_timeout_ms: 0,
            value: vec![],
            client_cancels: false,
            session_secret: s.secrets()[0].clone(),
            lock_delay_ms: 0,
            shared: false,
            permits: 0,
        })
        .await
        .unwrap_err();
    assert_eq!(late.code(), tonic::Code::Aborted, "{late:?}");
    assert!(client.describe("z").await.unwrap().is_none());
}

/// A `holdfast lock` process is frozen (SIGSTOP) while it waits; the lock is granted to it, then its
/// session expires on the server. When it wakes up, the grant it finds must not be used: the command
/// does not run and `holdfast lock` exits 75 (the lease may be lost).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_grant_that_arrives_after_the_lease_lapsed_is_not_returned() {
    let c = Cluster::start(three()).await;
    let client = c.client().await;
    let a = client.open_session(Duration::from_secs(10)).await.unwrap();
    let held = a.try_acquire("late").await.unwrap();
    let work = tempfile::tempdir().unwrap();
    let ran = work.path().join("ran");
    let waiter = c
        .holdfast()
        .args([
            "lock", "late", "--ttl", "2s", "--wait", "60s", "--", "touch",
        ])
        .arg(&ran)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    until(&client, "late", "queued", |l| {
        l.is_some_and(|l| l.waiters.len() == 1)
    })
    .await;
    let pid = waiter.id().unwrap().to_string();
    assert!(std::process::Command::new("kill")
        .args(["-STOP", &pid])
        .status()
        .unwrap()
        .success());
    let waiter_session = client.describe("late").await.unwrap().unwrap().waiters[0].session_id;
    held.release().await.unwrap();
    until(&client, "late", "granted to the frozen waiter", |l| {
        l.is_some_and(|l| l.holder_session_id == waiter_session)
    })
    .await;
    // Its session expires (no keepalives for 2 s), which frees the lock.
    until(&client, "late", "freed by the expiry", |l| l.is_none()).await;
    assert!(std::process::Command::new("kill")
        .args(["-CONT", &pid])
        .status()
        .unwrap()
        .success());
    let out = tokio::time::timeout(Duration::from_secs(30), waiter.wait_with_output())
        .await
        .expect("holdfast lock exits")
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(75), "{stderr}");
    assert!(stderr.contains("lease"), "{stderr}");
    assert!(
        !ran.exists(),
        "the command ran under a grant whose lease had lapsed"
    );
}

/// A retry of a queued request with no wait left (a try) ends the wait in the log, so a client that
/// retries after a broken connection and then gives up leaves nothing queued.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_try_retry_of_a_queued_request_ends_its_wait() {
    let c = Cluster::start(three()).await;
    let leader = c.wait_for_leader(0, Duration::from_secs(10)).await;
    let client = c.client().await;
    let a = client.open_session(Duration::from_secs(10)).await.unwrap();
    let held = a.try_acquire("t").await.unwrap();
    let mut raw = c.raw(leader).await;
    let (b, b_secret) = raw_session(&mut raw, 60_000, 9).await;
    let mut acquire = pb::AcquireRequest {
        group: 0,
        session_id: b,
        request_id: 1,
        name: "t".into(),
        wait_timeout_ms: 60_000,
        value: vec![],
        // This caller says it cancels by itself, so the server keeps the wait when the call goes away.
        client_cancels: true,
        session_secret: b_secret.clone(),
        lock_delay_ms: 0,
        shared: false,
        permits: 0,
    };
    let dropped = tokio::time::timeout(
        Duration::from_millis(300),
        raw.clone().acquire(acquire.clone()),
    )
    .await;
    assert!(dropped.is_err());
    assert_eq!(
        client.describe("t").await.unwrap().unwrap().waiters.len(),
        1
    );
    acquire.wait_timeout_ms = 0;
    let retry = raw.acquire(acquire).await.unwrap_err();
    assert_eq!(retry.code(), tonic::Code::Aborted, "{retry:?}");
    let lock = client.describe("t").await.unwrap().unwrap();
    assert!(
        lock.waiters.is_empty(),
        "the wait outlived its last try: {lock:?}"
    );
    held.release().await.unwrap();
}
