//! Watches against real servers: every change in log order, across groups, across a killed leader,
//! resumed from a position without a gap or a repeat, refused once the position is compacted away;
//! `holdfast watch` prints them.

use crate::harness::{Cluster, Options};
use holdfast_client::{EventKind, Watch, WatchEvent};
use holdfast_proto::v1 as pb;
use std::time::Duration;

const SECS_30: Duration = Duration::from_secs(30);

async fn next(w: &mut Watch) -> WatchEvent {
    tokio::time::timeout(SECS_30, w.next())
        .await
        .expect("no watch event within 30 s")
        .expect("the watch failed")
}

/// (kind, name, session, token) of an event, for comparing with what the test did.
fn seen(e: &WatchEvent) -> (EventKind, String, u64, u64) {
    (e.kind, e.name.clone(), e.session, e.token)
}

fn ev(kind: EventKind, name: &str, session: u64, token: u64) -> (EventKind, String, u64, u64) {
    (kind, name.to_string(), session, token)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_watch_sees_every_change_in_order_across_groups_and_a_killed_leader() {
    let mut c = Cluster::start(Options {
        groups: 2,
        ..Options::default()
    })
    .await;
    let client = c.client().await;
    // Two names in different groups, so the watch merges two streams.
    let (n1, n2) = ("w/a", "w/b");
    assert_ne!(
        holdfast_client::group_for(n1, 2),
        holdfast_client::group_for(n2, 2)
    );
    let mut watch = client.watch("w/").await.unwrap();
    let a = client.open_session(Duration::from_secs(10)).await.unwrap();
    let b = client.open_session(Duration::from_secs(10)).await.unwrap();
    // With several groups a session opens in a group at its first use there: open them now to know
    // the ids.
    let (sa1, sb1) = (a.open_for(n1).await.unwrap(), b.open_for(n1).await.unwrap());
    let sa2 = a.open_for(n2).await.unwrap();

    // Outside the prefix: never reported.
    let other = a.try_acquire("x/outside").await.unwrap();
    let g1 = a.try_acquire(n1).await.unwrap();
    assert_eq!(
        seen(&next(&mut watch).await),
        ev(EventKind::Granted, n1, sa1, g1.token())
    );
    let waiting = tokio::spawn({
        let b = b.clone();
        async move { b.acquire_timeout("w/a", SECS_30).await }
    });
    // The watch tells when the wait is queued (no polling).
    assert_eq!(
        seen(&next(&mut watch).await),
        ev(EventKind::Queued, n1, sb1, 0)
    );
    let t1 = g1.token();
    g1.release().await.unwrap();
    // Release and hand-over are one entry: both events, same index, in that order.
    let released = next(&mut watch).await;
    let granted = next(&mut watch).await;
    let gb = waiting.await.unwrap().unwrap();
    assert_eq!(seen(&released), ev(EventKind::Released, n1, sa1, t1));
    assert_eq!(seen(&granted), ev(EventKind::Granted, n1, sb1, gb.token()));
    assert_eq!(released.index, granted.index);
    assert_eq!(granted.index, gb.token(), "a grant's index is its token");

    // The other group, with a value.
    let g2 = a
        .acquire_with_value(n2, Duration::ZERO, b"v2")
        .await
        .unwrap();
    let e = next(&mut watch).await;
    assert_eq!(seen(&e), ev(EventKind::Granted, n2, sa2, g2.token()));
    assert_eq!(e.value, b"v2");

    // Kill the leader of n1's group: the stream resumes on the new leader, from where it was.
    let group1 = holdfast_client::group_for(n1, 2);
    let leader = c.wait_for_leader(group1, SECS_30).await;
    c.kill(leader).await;
    c.wait_for_leader_except(group1, leader, SECS_30).await;
    let t = gb.token();
    gb.release().await.unwrap();
    assert_eq!(
        seen(&next(&mut watch).await),
        ev(EventKind::Released, n1, sb1, t)
    );

    // Closing a session reports its locks released.
    let position = watch.position();
    drop(watch);
    let t2 = g2.token();
    a.close().await.unwrap();
    drop(other);
    let mut resumed = client.watch_from(&position).await.unwrap();
    assert_eq!(
        seen(&next(&mut resumed).await),
        ev(EventKind::Released, n2, sa2, t2)
    );
    // Nothing more: the next change is the next event (no repeat of anything before the position).
    let g3 = b.try_acquire(n2).await.unwrap();
    let e = next(&mut resumed).await;
    assert_eq!(
        seen(&e),
        ev(
            EventKind::Granted,
            n2,
            b.ids()[holdfast_client::group_for(n2, 2) as usize],
            g3.token()
        )
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_expired_holder_and_a_waiter_that_gives_up_are_reported() {
    let c = Cluster::start(Options {
        nodes: 3,
        ..Options::default()
    })
    .await;
    let client = c.client().await;
    let mut watch = client.watch("e").await.unwrap();
    // A session that is never renewed (raw gRPC), holding "e".
    let (mut raw, opened) = c.silent_session(2_000, 1).await;
    let token = raw
        .acquire(pb::AcquireRequest {
            group: 0,
            session_id: opened.session_id,
            request_id: 1,
            name: "e".into(),
            session_secret: opened.session_secret.clone(),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner()
        .token;
    assert_eq!(
        seen(&next(&mut watch).await),
        ev(EventKind::Granted, "e", opened.session_id, token)
    );
    // A waiter that gives up after 300 ms leaves the queue.
    let b = client.open_session(Duration::from_secs(10)).await.unwrap();
    assert!(b
        .acquire_timeout("e", Duration::from_millis(300))
        .await
        .is_err());
    assert_eq!(
        seen(&next(&mut watch).await),
        ev(EventKind::Queued, "e", b.ids()[0], 0)
    );
    assert_eq!(
        seen(&next(&mut watch).await),
        ev(EventKind::Cancelled, "e", b.ids()[0], 0)
    );
    // The silent session expires after its TTL.
    assert_eq!(
        seen(&next(&mut watch).await),
        ev(EventKind::Expired, "e", opened.session_id, token)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_position_older_than_every_server_keeps_is_compacted() {
    let mut c = Cluster::start(Options {
        nodes: 3,
        snapshot_every_entries: 100,
        snapshot_keep_entries: 5,
        ..Options::default()
    })
    .await;
    let client = c.client().await;
    let old = client.watch("").await.unwrap().position();
    let s = client.open_session(Duration::from_secs(10)).await.unwrap();
    for _ in 0..120 {
        s.try_acquire("k").await.unwrap().release().await.unwrap();
    }
    // A restarted server keeps changes only after its snapshot.
    for id in 1..=3 {
        c.kill(id).await;
        c.start_server(id);
    }
    let err = client.watch_from(&old).await.err().expect("compacted");
    assert!(
        matches!(err, holdfast_client::Error::Compacted(ref m) if m.contains("no longer kept")),
        "{err}"
    );
    // From now works, and sees the next change.
    let mut now = client.watch("").await.unwrap();
    let g = s.try_acquire("k").await.unwrap();
    assert_eq!(seen(&next(&mut now).await).3, g.token());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn holdfast_watch_prints_events_as_json() {
    use tokio::io::{AsyncBufReadExt, BufReader};
    let c = Cluster::start(Options {
        nodes: 3,
        ..Options::default()
    })
    .await;
    let mut child = c
        .holdfast()
        .args(["watch", "cli/", "--json", "--count", "2"])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    // It says on stderr when it is watching; from then on nothing is missed.
    let mut stderr = BufReader::new(child.stderr.take().unwrap()).lines();
    let line = tokio::time::timeout(SECS_30, stderr.next_line())
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    assert!(line.starts_with("watching"), "{line}");
    let client = c.client().await;
    let s = client.open_session(Duration::from_secs(10)).await.unwrap();
    let g = s.try_acquire("cli/x").await.unwrap();
    let token = g.token();
    g.release().await.unwrap();
    let out = tokio::time::timeout(SECS_30, child.wait_with_output())
        .await
        .unwrap()
        .unwrap();
    assert!(out.status.success());
    let lines: Vec<serde_json::Value> = String::from_utf8(out.stdout)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(lines.len(), 2, "{lines:?}");
    assert_eq!(lines[0]["kind"], "granted");
    assert_eq!(lines[1]["kind"], "released");
    for l in &lines {
        assert_eq!(l["name"], "cli/x");
        assert_eq!(l["token"], token);
        assert_eq!(l["session"], s.ids()[0]);
    }
}

/// The leader is frozen (SIGSTOP, as a VM stall would): its streams go silent, and the watch resumes on
/// the new leader by itself and delivers what happens there.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_watch_leaves_a_frozen_leader_and_misses_nothing() {
    let c = Cluster::start(Options {
        nodes: 3,
        ..Options::default()
    })
    .await;
    let client = c.client().await;
    let s = client.open_session(Duration::from_secs(10)).await.unwrap();
    let mut watch = client.watch("f").await.unwrap();
    let before = s.try_acquire("f1").await.unwrap();
    assert_eq!(next(&mut watch).await.token, before.token());
    let leader = c.wait_for_leader(0, SECS_30).await;
    let signal = |sig: &str| {
        let pid = c.pid(leader).to_string();
        let ok = std::process::Command::new("kill")
            .args([sig, &pid])
            .status()
            .unwrap()
            .success();
        assert!(ok, "kill {sig} {pid}");
    };
    signal("-STOP");
    let after = s.try_acquire("f2").await.unwrap();
    let e = next(&mut watch).await;
    signal("-CONT");
    assert_eq!(
        seen(&e),
        ev(EventKind::Granted, "f2", s.ids()[0], after.token())
    );
}
