//! Shared locks and semaphores against real servers, through the Rust client and the CLI: readers
//! share, a writer waits and is not overtaken by later readers, a semaphore grants its permits and
//! queues the rest, a mismatch is a clear error that changes nothing, and describe, watches and
//! `holdfast lock --permits` see it all.

use crate::harness::{Cluster, Options};
use holdfast_client::{AcquireOptions, Error, EventKind};
use std::time::Duration;

const SECS_30: Duration = Duration::from_secs(30);

fn three() -> Options {
    Options {
        nodes: 3,
        ..Options::default()
    }
}

fn reader() -> AcquireOptions<'static> {
    AcquireOptions {
        wait: SECS_30,
        shared: true,
        ..AcquireOptions::default()
    }
}

fn permit(n: u32, wait: Duration) -> AcquireOptions<'static> {
    AcquireOptions {
        wait,
        permits: n,
        ..AcquireOptions::default()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readers_share_and_a_waiting_writer_is_not_overtaken() {
    let c = Cluster::start(three()).await;
    let client = c.client().await;
    let mut seen = Seen::new(&client, "rw").await;
    let ttl = Duration::from_secs(10);
    let (r1, r2, w, r3) = (
        client.open_session(ttl).await.unwrap(),
        client.open_session(ttl).await.unwrap(),
        client.open_session(ttl).await.unwrap(),
        client.open_session(ttl).await.unwrap(),
    );
    let g1 = r1.acquire_with("rw", reader()).await.unwrap();
    let g2 = r2.acquire_with("rw", reader()).await.unwrap();
    let (t1, t2) = (g1.token(), g2.token());
    assert!(t2 > t1, "every grant has its own token");
    let lock = client.describe("rw").await.unwrap().unwrap();
    let holders: Vec<_> = lock
        .holders
        .iter()
        .map(|h| (h.session_id, h.token, h.shared))
        .collect();
    assert_eq!(
        holders,
        vec![(r1.ids()[0], t1, true), (r2.ids()[0], t2, true)]
    );
    // An exclusive try is refused; a writer waits.
    assert!(matches!(
        w.try_acquire("rw").await,
        Err(Error::LockHeld { .. })
    ));
    let writer = tokio::spawn({
        let w = w.clone();
        async move { w.acquire_timeout("rw", SECS_30).await }
    });
    seen.until(EventKind::Queued, 1).await;
    // A reader arriving now queues behind the writer instead of joining the readers.
    let late = tokio::spawn({
        let r3 = r3.clone();
        async move { r3.acquire_with("rw", reader()).await }
    });
    seen.until(EventKind::Queued, 2).await;
    let lock = client.describe("rw").await.unwrap().unwrap();
    let waiters: Vec<_> = lock
        .waiters
        .iter()
        .map(|w| (w.session_id, w.shared))
        .collect();
    assert_eq!(waiters, vec![(w.ids()[0], false), (r3.ids()[0], true)]);
    // The writer gets it only when both readers are gone, and the late reader only after the writer.
    g1.release().await.unwrap();
    assert!(!writer.is_finished());
    g2.release().await.unwrap();
    let gw = tokio::time::timeout(SECS_30, writer)
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    let tw = gw.token();
    assert!(!late.is_finished());
    let lock = client.describe("rw").await.unwrap().unwrap();
    assert_eq!(
        (lock.holders.len(), lock.holder_session_id),
        (1, w.ids()[0])
    );
    gw.release().await.unwrap();
    let g3 = tokio::time::timeout(SECS_30, late)
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    assert!(g3.token() > tw);
    // A watcher saw one grant per holder, in log order.
    seen.until(EventKind::Granted, 4).await;
    let grants: Vec<_> = seen
        .events
        .iter()
        .filter(|e| e.kind == EventKind::Granted)
        .map(|e| (e.session, e.token))
        .collect();
    assert_eq!(
        grants,
        vec![
            (r1.ids()[0], t1),
            (r2.ids()[0], t2),
            (w.ids()[0], tw),
            (r3.ids()[0], g3.token()),
        ]
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_semaphore_grants_its_permits_and_refuses_another_size() {
    let c = Cluster::start(three()).await;
    let client = c.client().await;
    let mut seen = Seen::new(&client, "pool").await;
    let ttl = Duration::from_secs(10);
    let mut sessions = Vec::new();
    for _ in 0..3 {
        sessions.push(client.open_session(ttl).await.unwrap());
    }
    let a = sessions[0]
        .acquire_with("pool", permit(2, Duration::ZERO))
        .await
        .unwrap();
    let b = sessions[1]
        .acquire_with("pool", permit(2, Duration::ZERO))
        .await
        .unwrap();
    // The third permit is not there: a try is refused, a wait queues.
    let full = sessions[2]
        .acquire_with("pool", permit(2, Duration::ZERO))
        .await
        .map(|g| g.token());
    assert!(matches!(full, Err(Error::LockHeld { .. })), "{full:?}");
    // Another size, or the name as a lock, is refused with what the name is.
    match sessions[2]
        .acquire_with("pool", permit(3, Duration::ZERO))
        .await
        .map(|g| g.token())
    {
        Err(Error::PermitsMismatch {
            permits: 2,
            message,
        }) => {
            assert!(message.contains("semaphore of 2 permits"), "{message}")
        }
        other => panic!("{other:?}"),
    }
    assert!(matches!(
        sessions[2].try_acquire("pool").await.map(|g| g.token()),
        Err(Error::PermitsMismatch { permits: 2, .. })
    ));
    let s = sessions[2].clone();
    let third = tokio::spawn(async move { s.acquire_with("pool", permit(2, SECS_30)).await });
    seen.until(EventKind::Queued, 1).await;
    let lock = client.describe("pool").await.unwrap().unwrap();
    assert_eq!((lock.permits, lock.holders.len()), (2, 2));
    // A release hands its permit to the waiter.
    a.release().await.unwrap();
    let c3 = tokio::time::timeout(SECS_30, third)
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    assert!(c3.token() > b.token());
    let lock = client.describe("pool").await.unwrap().unwrap();
    let holders: Vec<_> = lock.holders.iter().map(|h| h.session_id).collect();
    assert_eq!(holders, vec![sessions[1].ids()[0], sessions[2].ids()[0]]);
    // Out-of-range sizes are refused before the log.
    let err = sessions[0]
        .acquire_with("other", permit(1_001, Duration::ZERO))
        .await
        .map(|g| g.token())
        .unwrap_err();
    assert!(err.to_string().contains("max_holders_per_lock"), "{err}");
    let err = sessions[0]
        .acquire_with(
            "other",
            AcquireOptions {
                shared: true,
                permits: 2,
                ..AcquireOptions::default()
            },
        )
        .await
        .map(|g| g.token())
        .unwrap_err();
    assert!(matches!(err, Error::InvalidArgument(_)), "{err:?}");
}

/// `holdfast lock --permits 2` runs two commands at once and queues the third until one ends.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lock_with_permits_runs_at_most_that_many_commands() {
    let c = Cluster::start(three()).await;
    let client = c.client().await;
    let mut seen = Seen::new(&client, "jobs/pool").await;
    let dir = tempfile::tempdir().unwrap();
    let gate = dir.path().join("gate");
    // Each command records its token and waits for the gate file to exist.
    let script = format!(
        "echo $HOLDFAST_TOKEN >> {}; while [ ! -e {} ]; do sleep 0.05; done",
        dir.path().join("started").display(),
        gate.display()
    );
    let mut children = Vec::new();
    for _ in 0..3 {
        children.push(
            c.holdfast()
                .args([
                    "lock",
                    "jobs/pool",
                    "--permits",
                    "2",
                    "--",
                    "sh",
                    "-c",
                    &script,
                ])
                .kill_on_drop(true)
                .spawn()
                .unwrap(),
        );
    }
    seen.until(EventKind::Queued, 1).await;
    seen.until(EventKind::Granted, 2).await;
    let lock = client.describe("jobs/pool").await.unwrap().unwrap();
    assert_eq!((lock.permits, lock.holders.len()), (2, 2));
    let out = c
        .holdfast()
        .args(["describe", "jobs/pool"])
        .output()
        .await
        .unwrap();
    let stdout = String::from_utf8(out.stdout).unwrap();
    assert!(stdout.contains("2 of 2 permits"), "{stdout}");
    std::fs::write(&gate, b"").unwrap();
    for mut child in children {
        let status = tokio::time::timeout(SECS_30, child.wait())
            .await
            .unwrap()
            .unwrap();
        assert!(status.success(), "{status:?}");
    }
    let started = std::fs::read_to_string(dir.path().join("started")).unwrap();
    assert_eq!(started.lines().count(), 3, "{started}");
    assert!(client.describe("jobs/pool").await.unwrap().is_none());
}

/// A watch and every event it delivered so far.
struct Seen {
    watch: holdfast_client::Watch,
    events: Vec<holdfast_client::WatchEvent>,
}

impl Seen {
    async fn new(client: &holdfast_client::Client, prefix: &str) -> Seen {
        Seen {
            watch: client.watch(prefix).await.unwrap(),
            events: Vec::new(),
        }
    }

    /// Reads events until `n` of `kind` arrived in all (at most 30 s).
    async fn until(&mut self, kind: EventKind, n: usize) {
        while self.events.iter().filter(|e| e.kind == kind).count() < n {
            let e = tokio::time::timeout(SECS_30, self.watch.next())
                .await
                .unwrap_or_else(|_| panic!("fewer than {n} {kind:?} events within 30 s"))
                .unwrap();
            self.events.push(e);
        }
    }
}
