//! Lock-delay against real servers: after a holder's session expires, nobody gets the lock for the
//! delay the grant asked for, waiters keep their places, and watchers see it; a clean end frees the lock
//! at once.

use crate::harness::{Cluster, Options};
use holdfast_client::{AcquireOptions, EventKind};
use holdfast_proto::v1 as pb;
use std::time::Duration;
use tokio::time::Instant;

const SECS_30: Duration = Duration::from_secs(30);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_expired_holder_s_lock_is_granted_to_nobody_for_its_lock_delay() {
    let c = Cluster::start(Options {
        nodes: 3,
        ..Options::default()
    })
    .await;
    let client = c.client().await;
    let mut watch = client.watch("d").await.unwrap();
    let mut next = async || {
        tokio::time::timeout(SECS_30, watch.next())
            .await
            .expect("no event within 30 s")
            .unwrap()
    };
    // A session that is never renewed (raw gRPC) takes "d" with a 3 s lock-delay.
    let (mut raw, opened) = c.silent_session(2_000, 3).await;
    let too_long = raw
        .acquire(pb::AcquireRequest {
            group: 0,
            session_id: opened.session_id,
            request_id: 1,
            name: "d".into(),
            session_secret: opened.session_secret.clone(),
            lock_delay_ms: 60_001,
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert!(
        too_long.message().contains("max_lock_delay_ms"),
        "{too_long:?}"
    );
    let token = raw
        .acquire(pb::AcquireRequest {
            group: 0,
            session_id: opened.session_id,
            request_id: 2,
            name: "d".into(),
            session_secret: opened.session_secret.clone(),
            lock_delay_ms: 3_000,
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner()
        .token;
    assert_eq!(next().await.kind, EventKind::Granted);
    let lock = client.describe("d").await.unwrap().unwrap();
    assert_eq!((lock.lock_delay_ms, lock.delayed), (3_000, false));

    let b = client.open_session(Duration::from_secs(10)).await.unwrap();
    let waiting = tokio::spawn({
        let b = b.clone();
        async move { b.acquire_timeout("d", SECS_30).await }
    });
    assert_eq!(next().await.kind, EventKind::Queued);
    // The silent session expires: the lock goes to nobody, not to the waiter.
    let expired = next().await;
    assert_eq!((expired.kind, expired.token), (EventKind::Expired, token));
    let delayed = next().await;
    let delayed_at = Instant::now();
    assert_eq!(
        (delayed.kind, delayed.session, delayed.token),
        (EventKind::Delayed, 0, token)
    );
    let lock = client.describe("d").await.unwrap().unwrap();
    assert!(lock.delayed, "{lock:?}");
    assert_eq!(
        (lock.holder_session_id, lock.token, lock.waiters.len()),
        (0, token, 1)
    );
    let c2 = client.open_session(Duration::from_secs(10)).await.unwrap();
    match c2.try_acquire("d").await {
        Err(holdfast_client::Error::LockHeld { message, .. }) => {
            assert!(message.contains("lock-delay"), "{message}")
        }
        other => panic!(
            "a try during the lock-delay got {:?}",
            other.map(|g| g.token())
        ),
    }
    // Then the first waiter gets it, no sooner than the delay after the expiry.
    let ended = next().await;
    assert_eq!((ended.kind, ended.token), (EventKind::DelayEnded, token));
    let granted = next().await;
    let gb = waiting.await.unwrap().unwrap();
    assert!(
        delayed_at.elapsed() >= Duration::from_millis(2_500),
        "granted {:?} after the delay began, before its 3 s",
        delayed_at.elapsed()
    );
    assert_eq!(
        (granted.kind, granted.session, granted.token),
        (EventKind::Granted, b.ids()[0], gb.token())
    );
    assert!(gb.token() > token);
    assert_eq!(granted.index, ended.index);

    // A close (or release) of a grant with a lock-delay frees the lock at once.
    let held = c2
        .acquire_with(
            "e",
            AcquireOptions {
                lock_delay: Duration::from_secs(60),
                ..Default::default()
            },
        )
        .await
        .unwrap();
    drop(held.into_parts());
    c2.close().await.unwrap();
    assert!(
        b.try_acquire("e").await.is_ok(),
        "a closed session's lock-delay must not apply"
    );
}
