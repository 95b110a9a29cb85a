//! Every error reason is returned for a request that should get it, and changes nothing.

use crate::harness::{name_in_group, Cluster, Options};
use holdfast_proto::v1::holdfast_client::HoldfastClient;
use holdfast_proto::v1::*;
use prost::Message;
use std::time::Duration;
use tonic::transport::Channel;

pub(crate) fn reason_of<T: std::fmt::Debug>(
    r: Result<tonic::Response<T>, tonic::Status>,
) -> (Reason, ErrorDetail, String) {
    let status = r.expect_err("request should have been refused");
    let d = ErrorDetail::decode(status.details()).unwrap_or_default();
    let reason = Reason::try_from(d.reason).unwrap_or(Reason::Unspecified);
    assert_eq!(
        status
            .metadata()
            .get("holdfast-reason")
            .map(|v| v.to_str().unwrap().to_string()),
        Some(reason.as_str_name().to_string())
    );
    (reason, d, status.message().to_string())
}

pub(crate) async fn snapshot(c: &Cluster, leader: u64, group: u32) -> (u64, u64) {
    let g = c.group_status(leader, group).await.unwrap();
    (g.applied_index, g.digest)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_error_reason_is_returned_and_changes_nothing() {
    let groups = 2;
    let c = Cluster::start(Options {
        nodes: 3,
        groups,
        ..Options::default()
    })
    .await;
    let leader = c.wait_for_leader(0, Duration::from_secs(30)).await;
    c.wait_for_leader(1, Duration::from_secs(30)).await;
    // Use group 0 only: its leader is `leader`.
    let mut raw: HoldfastClient<Channel> = c.raw(leader).await;
    let open = |nonce: u64| OpenSessionRequest {
        group: 0,
        ttl_ms: 5_000,
        nonce_hi: nonce,
        nonce_lo: nonce,
    };
    let opened = raw.open_session(open(1)).await.unwrap().into_inner();
    let (a, a_secret) = (opened.session_id, opened.session_secret);
    let opened = raw.open_session(open(2)).await.unwrap().into_inner();
    let (b, b_secret) = (opened.session_id, opened.session_secret);
    assert_eq!((a_secret.len(), b_secret.len()), (16, 16));
    assert_ne!(a_secret, b_secret);
    let secret_of = {
        let (a_secret, b_secret) = (a_secret.clone(), b_secret.clone());
        move |id: u64| match id {
            id if id == a => a_secret.clone(),
            id if id == b => b_secret.clone(),
            _ => Vec::new(),
        }
    };
    let keep = {
        let mut raw = raw.clone();
        let secrets = vec![a_secret.clone().into(), b_secret.clone().into()];
        tokio::spawn(async move {
            loop {
                let _ = raw
                    .keep_alive(KeepAliveRequest {
                        group: 0,
                        session_ids: vec![a, b],
                        session_secrets: secrets.clone(),
                        ..Default::default()
                    })
                    .await;
                tokio::time::sleep(Duration::from_millis(500)).await;
            }
        })
    };
    let lock = name_in_group(0, groups, "bad/");
    let acq = |session_id, request_id, name: &str| AcquireRequest {
        group: 0,
        session_id,
        request_id,
        name: name.into(),
        wait_timeout_ms: 0,
        value: vec![],
        client_cancels: false,
        session_secret: secret_of(session_id),
        lock_delay_ms: 0,
        shared: false,
        permits: 0,
    };
    let token = raw
        .acquire(acq(a, 1, &lock))
        .await
        .unwrap()
        .into_inner()
        .token;

    // Validation failures never reach the log: applied index and digest stay the same.
    let before = snapshot(&c, leader, 0).await;
    let long = "x".repeat(257);
    let cases: Vec<(&str, Reason, (Reason, ErrorDetail, String))> = vec![
        (
            "name over 256 bytes",
            Reason::LimitExceeded,
            reason_of(raw.acquire(acq(a, 2, &long)).await),
        ),
        (
            "semaphore over 1,000 permits",
            Reason::LimitExceeded,
            reason_of(
                raw.acquire(AcquireRequest {
                    permits: 1_001,
                    ..acq(a, 2, "sem")
                })
                .await,
            ),
        ),
        (
            "shared semaphore",
            Reason::InvalidArgument,
            reason_of(
                raw.acquire(AcquireRequest {
                    permits: 2,
                    shared: true,
                    ..acq(a, 2, "sem")
                })
                .await,
            ),
        ),
        (
            "control character in name",
            Reason::InvalidArgument,
            reason_of(raw.acquire(acq(a, 3, "a\u{7}b")).await),
        ),
        (
            "empty name",
            Reason::InvalidArgument,
            reason_of(raw.acquire(acq(a, 4, "")).await),
        ),
        (
            "request id 0",
            Reason::InvalidArgument,
            reason_of(raw.acquire(acq(a, 0, &lock)).await),
        ),
        (
            "ttl below the minimum",
            Reason::InvalidArgument,
            reason_of(
                raw.open_session(OpenSessionRequest {
                    ttl_ms: 100,
                    ..open(9)
                })
                .await,
            ),
        ),
        (
            "ttl above the maximum",
            Reason::InvalidArgument,
            reason_of(
                raw.open_session(OpenSessionRequest {
                    ttl_ms: 301_000,
                    ..open(9)
                })
                .await,
            ),
        ),
        (
            "zero nonce",
            Reason::InvalidArgument,
            reason_of(raw.open_session(open(0)).await),
        ),
        (
            "group that does not exist",
            Reason::InvalidArgument,
            reason_of(
                raw.acquire(AcquireRequest {
                    group: 7,
                    ..acq(a, 5, &lock)
                })
                .await,
            ),
        ),
        (
            "name of another group",
            Reason::WrongGroup,
            reason_of(
                raw.acquire(acq(a, 6, &name_in_group(1, groups, "bad/")))
                    .await,
            ),
        ),
        (
            "wait over the maximum",
            Reason::LimitExceeded,
            reason_of(
                raw.acquire(AcquireRequest {
                    wait_timeout_ms: 301_000,
                    ..acq(a, 7, &lock)
                })
                .await,
            ),
        ),
        (
            "keepalive batch over the maximum",
            Reason::LimitExceeded,
            reason_of(
                raw.keep_alive(KeepAliveRequest {
                    group: 0,
                    session_ids: vec![a; 10_001],
                    session_secrets: vec![],
                    ..Default::default()
                })
                .await,
            ),
        ),
        (
            "page over the maximum",
            Reason::LimitExceeded,
            reason_of(
                raw.list_locks(ListLocksRequest {
                    group: 0,
                    prefix: String::new(),
                    after: String::new(),
                    limit: 1_001,
                })
                .await,
            ),
        ),
        (
            "release with token 0",
            Reason::InvalidArgument,
            reason_of(
                raw.release(ReleaseRequest {
                    group: 0,
                    session_id: a,
                    request_id: 8,
                    name: lock.clone(),
                    token: 0,
                    session_secret: a_secret.clone(),
                })
                .await,
            ),
        ),
    ];
    for (what, want, (got, _, message)) in &cases {
        assert_eq!(got, want, "{what}: {message}");
        assert!(
            !message.is_empty()
                && !message.chars().next().unwrap().is_uppercase()
                && !message.ends_with('.'),
            "{what}: message {message:?}"
        );
    }
    let limit_detail = &cases[0].2 .1;
    assert_eq!(
        (limit_detail.limit.as_str(), limit_detail.limit_value),
        ("max_name_bytes", 256)
    );
    assert_eq!(
        snapshot(&c, leader, 0).await,
        before,
        "a refused request changed the state"
    );

    // A follower asked to write names the leader and writes nothing. It must know the leader first: a
    // follower that has not heard from it yet rightly answers NOT_LEADER without a name.
    let follower = (1..=3).find(|&i| i != leader).unwrap();
    c.wait_for_known_leader(follower, 0, leader, Duration::from_secs(20))
        .await;
    let (r, d, _) = reason_of(c.raw(follower).await.acquire(acq(a, 9, &lock)).await);
    assert_eq!(
        (r, d.leader_endpoint),
        (Reason::NotLeader, c.endpoint(leader))
    );

    // Refusals decided by the log leave locks and sessions as they were.
    let describe = |raw: &mut HoldfastClient<Channel>| {
        let mut raw = raw.clone();
        let lock = lock.clone();
        async move {
            // The remaining TTL moves with time; everything else must stay as it was.
            let lock = raw
                .describe(DescribeRequest {
                    group: 0,
                    name: lock,
                })
                .await
                .unwrap()
                .into_inner()
                .lock;
            // The remaining TTLs count down between the two reads; everything else must not change.
            lock.map(|l| LockInfo {
                holder_ttl_remaining_ms: 0,
                holders: l
                    .holders
                    .iter()
                    .map(|h| holdfast_proto::v1::Holder {
                        ttl_remaining_ms: 0,
                        ..h.clone()
                    })
                    .collect(),
                ..l
            })
        }
    };
    let held_before = describe(&mut raw).await;
    let (r, d, _) = reason_of(raw.acquire(acq(b, 1, &lock)).await);
    assert_eq!(
        (r, d.holder_session_id, d.current_token),
        (Reason::LockHeld, a, token)
    );
    let (r, d, _) = reason_of(
        raw.release(ReleaseRequest {
            group: 0,
            session_id: a,
            request_id: 10,
            name: lock.clone(),
            token: token - 1,
            session_secret: a_secret.clone(),
        })
        .await,
    );
    assert_eq!((r, d.current_token), (Reason::StaleToken, token));
    let (r, _, _) = reason_of(
        raw.release(ReleaseRequest {
            group: 0,
            session_id: b,
            request_id: 2,
            name: lock.clone(),
            token,
            session_secret: b_secret.clone(),
        })
        .await,
    );
    assert_eq!(r, Reason::NotHolder);
    let (r, _, _) = reason_of(raw.acquire(acq(a, 11, &lock)).await);
    assert_eq!(r, Reason::AlreadyHeld);
    // The lock asked for as a semaphore: refused, naming what it is (0 permits: a lock).
    let (r, d, msg) = reason_of(
        raw.acquire(AcquireRequest {
            permits: 2,
            ..acq(b, 3, &lock)
        })
        .await,
    );
    assert_eq!((r, d.limit_value), (Reason::PermitsMismatch, 0), "{msg}");
    assert!(msg.contains("is a lock, not a semaphore"), "{msg}");
    let (r, _, _) = reason_of(raw.acquire(acq(999_999, 1, &lock)).await);
    assert_eq!(r, Reason::SessionUnknown);
    let (r, _, _) = reason_of(
        raw.close_session(CloseSessionRequest {
            group: 0,
            session_id: 999_999,
            session_secret: vec![],
        })
        .await,
    );
    assert_eq!(r, Reason::SessionUnknown);
    assert_eq!(
        describe(&mut raw).await,
        held_before,
        "a refused request changed the lock"
    );

    // A retried acquire returns the first outcome and never grants twice.
    let again = raw
        .acquire(acq(a, 1, &lock))
        .await
        .unwrap()
        .into_inner()
        .token;
    assert_eq!(again, token);
    // Request ids older than the dedup window are refused rather than executed again.
    for rid in 100..120 {
        raw.acquire(acq(
            b,
            rid,
            &name_in_group(0, groups, &format!("dedup{rid}-")),
        ))
        .await
        .unwrap();
    }
    let (r, _, _) = reason_of(
        raw.acquire(acq(b, 1, &name_in_group(0, groups, "fresh-")))
            .await,
    );
    assert_eq!(r, Reason::RequestIdTooOld);
    keep.abort();
}
