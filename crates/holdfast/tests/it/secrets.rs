//! Session secrets: only the opener of a session can act on it, and request ids cannot lock it out.

use crate::bad_input::{reason_of, snapshot};
use crate::harness::{Cluster, Options};
use holdfast_proto::v1::*;
use std::time::Duration;

fn three() -> Options {
    Options {
        nodes: 3,
        ..Options::default()
    }
}

fn acquire(session_id: u64, request_id: u64, name: &str, secret: &[u8]) -> AcquireRequest {
    AcquireRequest {
        group: 0,
        session_id,
        request_id,
        name: name.into(),
        wait_timeout_ms: 0,
        value: vec![],
        client_cancels: false,
        session_secret: secret.to_vec(),
        lock_delay_ms: 0,
        shared: false,
        permits: 0,
    }
}

/// For every RPC that acts on a session, a missing, wrong or another session's secret is
/// PERMISSION_DENIED and changes nothing: the applied index and the table digest stay the same (the
/// leader refuses it before the log). The owner's requests then work, and the secret is in no log line.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wrong_secret_is_refused_by_every_session_rpc_and_changes_nothing() {
    let c = Cluster::start(three()).await;
    let leader = c.wait_for_leader(0, Duration::from_secs(10)).await;
    let mut raw = c.raw(leader).await;
    let open = |nonce: u64| OpenSessionRequest {
        group: 0,
        ttl_ms: 60_000,
        nonce_hi: nonce,
        nonce_lo: nonce,
    };
    let opened = raw.open_session(open(1)).await.unwrap().into_inner();
    let (a, secret) = (opened.session_id, opened.session_secret);
    let other = raw.open_session(open(2)).await.unwrap().into_inner();
    assert_eq!(secret.len(), 16);
    // A retried open returns the same session and secret.
    let again = raw.open_session(open(1)).await.unwrap().into_inner();
    assert_eq!((again.session_id, &again.session_secret), (a, &secret));
    let token = raw
        .acquire(acquire(a, 1, "s/held", &secret))
        .await
        .unwrap()
        .into_inner()
        .token;

    let before = snapshot(&c, leader, 0).await;
    let mut flipped = secret.clone();
    flipped[15] ^= 1;
    for wrong in [vec![], flipped, other.session_secret.clone()] {
        let refused = [
            reason_of(
                raw.keep_alive(KeepAliveRequest {
                    group: 0,
                    session_ids: vec![other.session_id, a],
                    session_secrets: vec![
                        other.session_secret.clone().into(),
                        wrong.clone().into(),
                    ],
                    ..Default::default()
                })
                .await,
            ),
            reason_of(raw.acquire(acquire(a, 2, "s/new", &wrong)).await),
            reason_of(raw.acquire(acquire(a, u64::MAX, "s/new", &wrong)).await),
            reason_of(
                raw.release(ReleaseRequest {
                    group: 0,
                    session_id: a,
                    request_id: 3,
                    name: "s/held".into(),
                    token,
                    session_secret: wrong.clone(),
                })
                .await,
            ),
            reason_of(
                raw.cancel_acquire(CancelAcquireRequest {
                    group: 0,
                    session_id: a,
                    request_id: 1,
                    name: "s/held".into(),
                    attempt: 0,
                    session_secret: wrong.clone(),
                })
                .await,
            ),
            reason_of(
                raw.close_session(CloseSessionRequest {
                    group: 0,
                    session_id: a,
                    session_secret: wrong.clone(),
                })
                .await,
            ),
        ];
        for (i, (reason, _, message)) in refused.iter().enumerate() {
            assert_eq!(*reason, Reason::PermissionDenied, "rpc {i}: {message}");
            assert!(message.contains(&format!("session {a}")), "{message}");
        }
    }
    let (reason, _, message) = reason_of(
        raw.close_session(CloseSessionRequest {
            group: 0,
            session_id: a,
            session_secret: vec![1; 5],
        })
        .await,
    );
    assert_eq!(reason, Reason::InvalidArgument, "{message}");
    assert_eq!(
        snapshot(&c, leader, 0).await,
        before,
        "a refused request changed something"
    );

    // The owner's requests work: renew, then release with the right secret.
    let renewed = raw
        .keep_alive(KeepAliveRequest {
            group: 0,
            session_ids: vec![a],
            session_secrets: vec![secret.clone().into()],
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    assert!(renewed.results[0].alive);
    raw.release(ReleaseRequest {
        group: 0,
        session_id: a,
        request_id: 3,
        name: "s/held".into(),
        token,
        session_secret: secret.clone(),
    })
    .await
    .unwrap();

    // The secret is never shown: not in lists, describe or status, nor in any server's log.
    let hex: String = secret.iter().map(|b| format!("{b:02x}")).collect();
    let decimal = u128::from_be_bytes(secret.clone().try_into().unwrap()).to_string();
    for id in 1..=3 {
        let log = c.log_text(id);
        assert!(
            !log.contains(&hex) && !log.contains(&decimal),
            "node {id} logged the secret"
        );
    }
    let listed = format!(
        "{:?}",
        raw.list_sessions(ListSessionsRequest {
            group: 0,
            after: 0,
            limit: 0,
        })
        .await
        .unwrap()
        .into_inner()
    );
    assert!(listed.contains(&format!("session_id: {a}")), "{listed}");
    assert!(!listed.contains(&decimal) && !listed.contains(&hex));
}

/// Request ids near `u64::MAX` used to push a session's deduplication window so far that every later
/// request was REQUEST_ID_TOO_OLD. Now a third party cannot send them (no secret), and the owner's are
/// refused as REQUEST_ID_TOO_NEW without being remembered, so the next ordinary ids still work.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn request_ids_near_the_maximum_do_not_lock_a_session_out() {
    let c = Cluster::start(three()).await;
    let leader = c.wait_for_leader(0, Duration::from_secs(10)).await;
    let mut raw = c.raw(leader).await;
    let opened = raw
        .open_session(OpenSessionRequest {
            group: 0,
            ttl_ms: 60_000,
            nonce_hi: 3,
            nonce_lo: 3,
        })
        .await
        .unwrap()
        .into_inner();
    let (a, secret) = (opened.session_id, opened.session_secret);
    for i in 0..20 {
        let (reason, _, message) = reason_of(
            raw.acquire(acquire(a, u64::MAX - i, &format!("far/{i}"), &secret))
                .await,
        );
        assert_eq!(reason, Reason::RequestIdTooNew, "{message}");
        let (reason, _, _) = reason_of(raw.acquire(acquire(a, u64::MAX - i, "far/x", &[])).await);
        assert_eq!(reason, Reason::PermissionDenied);
    }
    for request_id in 1..=20 {
        let token = raw
            .acquire(acquire(
                a,
                request_id,
                &format!("near/{request_id}"),
                &secret,
            ))
            .await
            .unwrap_or_else(|e| panic!("request {request_id} of the owner: {e}"))
            .into_inner()
            .token;
        assert!(token > 0);
    }
}
