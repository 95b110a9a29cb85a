//! The checker on known-good and known-bad histories: each bad one must be caught by the right property.

use crate::{check, check_groups, AuditLine, Op, StoreRecord};
use holdfast_lock_table::{
    AcquireMode, Command, Event, FencingToken, LockName, Outcome, RequestId, SessionId,
};

fn name(n: &str) -> LockName {
    LockName::new(n).unwrap()
}

fn open(index: u64) -> AuditLine {
    AuditLine {
        index,
        command: Command::OpenSession {
            nonce: u128::from(index),
            ttl_ms: 3_000,
            now_ms: 0,
        },
        outcome: Outcome::SessionOpened {
            session: SessionId(index),
            ttl_ms: 3_000,
        },
        events: vec![],
        changes: Vec::new(),
    }
}

fn acquire(index: u64, session: u64, lock: &str, outcome: Outcome) -> AuditLine {
    AuditLine {
        index,
        command: Command::Acquire {
            session: SessionId(session),
            request: RequestId(index),
            name: name(lock),
            mode: AcquireMode::Wait,
            value: Box::default(),
            attempt: index,
            now_ms: 0,
        },
        outcome,
        events: vec![],
        changes: Vec::new(),
    }
}

fn release(index: u64, session: u64, lock: &str, token: u64, events: Vec<Event>) -> AuditLine {
    AuditLine {
        index,
        command: Command::Release {
            session: SessionId(session),
            request: RequestId(index),
            name: name(lock),
            token: FencingToken(token),
            now_ms: 0,
        },
        outcome: Outcome::Released,
        events,
        changes: Vec::new(),
    }
}

fn granted(t: u64) -> Outcome {
    Outcome::Granted {
        token: FencingToken(t),
    }
}

fn op(
    op: &str,
    lock: &str,
    session: u64,
    token: u64,
    invoke_ms: u64,
    complete_ms: u64,
    value: Option<u64>,
) -> Op {
    Op {
        op: op.into(),
        lock: lock.into(),
        session: Some(session),
        token: Some(token),
        invoke_ms,
        complete_ms,
        result: "ok".into(),
        value,
        ..Op::default()
    }
}

fn write(key: &str, token: u64, value: u64) -> StoreRecord {
    StoreRecord {
        write: true,
        key: key.into(),
        token,
        value: Some(value),
    }
}

/// Two sessions take turns on one lock; the second waited and was granted by the first's release.
fn good() -> (Vec<Op>, Vec<AuditLine>, Vec<StoreRecord>) {
    good_on("l")
}

/// [`good`] on lock `l`.
fn good_on(l: &str) -> (Vec<Op>, Vec<AuditLine>, Vec<StoreRecord>) {
    let log = vec![
        open(1),
        open(2),
        acquire(3, 1, l, granted(3)),
        acquire(4, 2, l, Outcome::Queued { position: 1 }),
        release(
            5,
            1,
            l,
            3,
            vec![Event::Granted {
                name: name(l),
                session: SessionId(2),
                request: RequestId(4),
                token: FencingToken(5),
            }],
        ),
    ];
    let history = vec![
        Op {
            op: "open".into(),
            session: Some(1),
            result: "ok".into(),
            ..Op::default()
        },
        Op {
            op: "open".into(),
            session: Some(2),
            result: "ok".into(),
            ..Op::default()
        },
        op("acquire", l, 1, 3, 10, 11, None),
        op("write", l, 1, 3, 12, 13, Some(1)),
        op("release", l, 1, 3, 14, 15, None),
        op("acquire", l, 2, 5, 11, 16, None),
        op("write", l, 2, 5, 17, 18, Some(2)),
    ];
    (history, log, vec![write(l, 3, 1), write(l, 5, 2)])
}

fn violations(
    history: &[Op],
    logs: &[(u64, Vec<AuditLine>)],
    store: &[StoreRecord],
) -> Vec<String> {
    check(history, logs, store).violations
}

#[test]
fn a_good_history_passes() {
    let (h, log, store) = good();
    let report = check(&h, &[(1, log.clone()), (2, log[..3].to_vec())], &store);
    assert!(report.violations.is_empty(), "{:?}", report.violations);
    assert_eq!((report.ok_grants, report.ok_writes), (2, 2));
}

#[test]
fn replicas_that_disagree_violate_p2() {
    let (h, log, store) = good();
    let mut other = log.clone();
    other[2].outcome = Outcome::Queued { position: 1 };
    let v = violations(&h, &[(1, log), (2, other)], &store);
    assert!(v.iter().any(|v| v.starts_with("P2")), "{v:?}");
}

#[test]
fn two_holders_violate_p1() {
    let (h, mut log, store) = good();
    log[3].outcome = granted(4);
    let v = violations(&h, &[(1, log)], &store);
    assert!(v.iter().any(|v| v.starts_with("P1")), "{v:?}");
}

#[test]
fn reused_or_out_of_order_tokens_violate_p3() {
    let (mut h, log, store) = good();
    h[5].token = Some(3);
    let v = violations(&h, &[(1, log.clone())], &store);
    assert!(v.iter().any(|v| v.contains("granted twice")), "{v:?}");
    let (mut h, _, _) = good();
    // The second grant was invoked after the first completed, yet has a smaller token.
    h[5].invoke_ms = 12;
    h[5].token = Some(2);
    let v = violations(&h, &[(1, log)], &store);
    assert!(v.iter().any(|v| v.contains("invoked after")), "{v:?}");
}

#[test]
fn lost_or_stale_store_writes_violate_p4() {
    let (h, log, _) = good();
    let v = violations(
        &h,
        &[(1, log.clone())],
        &[write("l", 3, 1), write("l", 2, 2)],
    );
    assert!(v.iter().any(|v| v.contains("accepted token 2")), "{v:?}");
    // A lost update: both holders wrote 1.
    let v = violations(
        &h,
        &[(1, log.clone())],
        &[write("l", 3, 1), write("l", 5, 1)],
    );
    assert!(
        v.iter().any(|v| v.contains("lost or applied twice")),
        "{v:?}"
    );
    // An acknowledged write missing from the store.
    let v = violations(&h, &[(1, log)], &[write("l", 3, 1)]);
    assert!(
        v.iter()
            .any(|v| v.contains("acknowledged write is not in the store")),
        "{v:?}"
    );
}

#[test]
fn acknowledged_operations_missing_from_the_log_violate_p5() {
    let (h, log, store) = good();
    let v = violations(&h, &[(1, log[..4].to_vec())], &store);
    assert!(
        v.iter().any(|v| v.contains("P5: acknowledged grant")),
        "{v:?}"
    );
    assert!(
        v.iter().any(|v| v.contains("P5: acknowledged release")),
        "{v:?}"
    );
}

#[test]
fn unknown_and_failed_operations_are_not_required() {
    let (mut h, log, store) = good();
    h.push(Op {
        op: "acquire".into(),
        lock: "l".into(),
        session: Some(9),
        token: Some(99),
        result: "unknown".into(),
        ..Op::default()
    });
    h.push(Op {
        op: "write".into(),
        lock: "l".into(),
        session: Some(9),
        token: Some(1),
        value: Some(7),
        result: "fail".into(),
        ..Op::default()
    });
    assert!(violations(&h, &[(1, log)], &store).is_empty());
}

#[test]
fn a_retried_release_replays_its_outcome_without_a_second_release() {
    let (mut h, mut log, store) = good();
    // Session 1's release is retried (same request id 5) after session 2 got the lock.
    log.push(AuditLine {
        index: 6,
        ..release(5, 1, "l", 3, vec![])
    });
    h.push(op("release", "l", 1, 3, 19, 20, None));
    let v = violations(&h, &[(1, log)], &store);
    assert!(v.is_empty(), "{v:?}");
}

#[test]
fn an_expiry_before_the_last_renewal_plus_ttl_violates_p6() {
    let (mut h, mut log, store) = good();
    log.push(AuditLine {
        index: 6,
        command: Command::ExpireSession {
            session: SessionId(1),
            now_ms: 10_000,
        },
        outcome: Outcome::SessionClosed { released: 0 },
        events: vec![Event::SessionEnded {
            session: SessionId(1),
        }],
        changes: Vec::new(),
    });
    let lost = |renewed: u64| Op {
        op: "lost".into(),
        session: Some(1),
        renewed_sent_ms: Some(renewed),
        ttl_ms: Some(3_000),
        result: "ok".into(),
        ..Op::default()
    };
    h.push(lost(7_000));
    let report = check(&h, &[(1, log.clone())], &store);
    assert!(
        report.violations.is_empty() && report.expiries_checked == 1,
        "{:?}",
        report.violations
    );
    h.pop();
    h.push(lost(7_500));
    let v = violations(&h, &[(1, log)], &store);
    assert!(v.iter().any(|v| v.starts_with("P6")), "{v:?}");
}

/// A batched expiry (`ExpireSessions`) counts for P6 like one `ExpireSession` per session, and for P1 it
/// frees every lock of its sessions, so the waiter it grants is the one holder.
#[test]
fn a_batched_expiry_is_checked_per_session_and_frees_every_lock_it_ends() {
    let log = table_log(&[
        open(1).command,
        open(2).command,
        open(3).command,
        acquire(4, 1, "a", granted(4)).command,
        acquire(5, 2, "b", granted(5)).command,
        acquire(6, 3, "a", granted(6)).command,
        Command::ExpireSessions {
            sessions: vec![SessionId(1), SessionId(2)],
            now_ms: 10_000,
        },
    ]);
    assert!(log[6].events.iter().any(|e| matches!(
        e,
        Event::Granted {
            session: SessionId(3),
            ..
        }
    )));
    let lost = |session: u64, renewed: u64| Op {
        op: "lost".into(),
        session: Some(session),
        renewed_sent_ms: Some(renewed),
        ttl_ms: Some(3_000),
        result: "ok".into(),
        ..Op::default()
    };
    let report = check(&[lost(1, 7_000), lost(2, 7_000)], &[(1, log.clone())], &[]);
    assert!(report.violations.is_empty(), "{:?}", report.violations);
    assert_eq!(report.expiries_checked, 2);
    let report = check(&[lost(1, 7_000), lost(2, 7_500)], &[(1, log)], &[]);
    assert!(
        report
            .violations
            .iter()
            .any(|v| v.starts_with("P6: session 2")),
        "{:?}",
        report.violations
    );
}

#[test]
fn a_describe_that_misses_a_completed_grant_is_not_linearizable() {
    let (mut h, log, store) = good();
    let describe = |holder: u64, token: u64| Op {
        op: "describe".into(),
        lock: "l".into(),
        session: Some(holder),
        token: Some(token),
        invoke_ms: 20,
        complete_ms: 21,
        result: "ok".into(),
        ..Op::default()
    };
    h.push(describe(2, 5));
    let report = check(&h, &[(1, log.clone())], &store);
    assert!(
        report.violations.is_empty() && report.reads_checked == 1,
        "{:?}",
        report.violations
    );
    h.pop();
    // Session 2's grant (token 5) completed before this describe began: it cannot still see session 1.
    h.push(describe(1, 3));
    let v = violations(&h, &[(1, log.clone())], &store);
    assert!(v.iter().any(|v| v.starts_with("linearizability")), "{v:?}");
    h.pop();
    // A describe concurrent with the hand-over may see either holder.
    h.push(Op {
        invoke_ms: 12,
        complete_ms: 17,
        ..describe(1, 3)
    });
    assert!(violations(&h, &[(1, log)], &store).is_empty());
}

/// The black-box linearizability search alone (no audit logs, no store).
fn lin(history: &[Op]) -> Vec<String> {
    let mut v = Vec::new();
    crate::properties::linearizable_locks::check(history, &mut v);
    v
}

fn describe(lock: &str, holder: Option<(u64, u64)>, invoke_ms: u64, complete_ms: u64) -> Op {
    let (s, t) = holder.unwrap_or((0, 0));
    op("describe", lock, s, t, invoke_ms, complete_ms, None)
}

/// An acquire of "l" by `session` whose outcome the client never learned.
fn unknown_acquire(session: u64, invoke_ms: u64, complete_ms: u64) -> Op {
    let mut o = op("acquire", "l", session, 0, invoke_ms, complete_ms, None);
    o.result = "unknown".into();
    o.token = None;
    o
}

#[test]
fn wgl_accepts_waits_concurrent_reads_unknown_outcomes_and_expired_holders() {
    let (mut h, _, _) = good();
    // A read overlapping the hand-over may see either holder; a later one sees the second.
    h.push(describe("l", Some((1, 3)), 13, 17));
    h.push(describe("l", Some((2, 5)), 14, 17));
    h.push(describe("l", Some((2, 5)), 19, 20));
    // An acquire that timed out (unknown) and never took effect, and a failed one.
    h.push(unknown_acquire(3, 12, 13));
    let mut failed = op("acquire", "l", 4, 0, 12, 13, None);
    failed.result = "fail".into();
    h.push(failed);
    // Session 2 expires without a client operation; session 5 then gets the lock with a larger token.
    h.push(op("acquire", "l", 5, 9, 30, 31, None));
    h.push(describe("l", Some((5, 9)), 32, 33));
    h.push(op("release", "l", 5, 9, 33, 34, None));
    h.push(describe("l", None, 35, 36));
    assert!(lin(&h).is_empty(), "{:?}", lin(&h));
}

#[test]
fn wgl_learns_the_token_of_an_unknown_grant_from_a_read() {
    let h = vec![
        unknown_acquire(1, 0, 1),
        describe("l", Some((1, 4)), 5, 6),
        describe("l", Some((1, 4)), 7, 8),
    ];
    assert!(lin(&h).is_empty(), "{:?}", lin(&h));
    // The same read twice with different tokens cannot both be right.
    let h = vec![
        unknown_acquire(1, 0, 1),
        describe("l", Some((1, 4)), 5, 6),
        describe("l", Some((1, 6)), 7, 8),
    ];
    assert_eq!(lin(&h).len(), 1);
}

#[test]
fn wgl_rejects_two_holders() {
    // B was granted while A held, and A then released as the holder.
    let h = vec![
        op("acquire", "l", 1, 3, 0, 1, None),
        op("acquire", "l", 2, 4, 2, 3, None),
        op("release", "l", 1, 3, 4, 5, None),
    ];
    let v = lin(&h);
    assert_eq!(v.len(), 1, "{v:?}");
    assert!(v[0].contains("linearizability (WGL)"), "{v:?}");
}

#[test]
fn wgl_rejects_stale_reads_and_tokens_that_go_down() {
    // A read after the release completed still sees the holder.
    let stale = vec![
        op("acquire", "l", 1, 3, 0, 1, None),
        op("release", "l", 1, 3, 2, 3, None),
        describe("l", Some((1, 3)), 4, 5),
    ];
    assert_eq!(lin(&stale).len(), 1);
    // A read that misses a grant that completed before it.
    let missed = vec![
        op("acquire", "l", 1, 3, 0, 1, None),
        describe("l", None, 2, 3),
    ];
    assert!(
        lin(&missed).is_empty(),
        "the holder may have expired in between"
    );
    let missed = vec![
        op("acquire", "l", 1, 3, 0, 1, None),
        describe("l", None, 2, 3),
        op("release", "l", 1, 3, 4, 5, None),
    ];
    assert_eq!(lin(&missed).len(), 1, "it still held: it released later");
    // A later grant with a smaller token.
    let down = vec![
        op("acquire", "l", 1, 5, 0, 1, None),
        op("release", "l", 1, 5, 2, 3, None),
        op("acquire", "l", 2, 4, 4, 5, None),
    ];
    assert_eq!(lin(&down).len(), 1);
    // Releasing a lock the session never held.
    let foreign = vec![
        op("acquire", "l", 1, 3, 0, 1, None),
        op("release", "l", 2, 3, 2, 3, None),
    ];
    assert_eq!(lin(&foreign).len(), 1);
}

#[test]
fn the_aggregate_check_runs_the_search() {
    let (h, log, store) = good();
    let report = check(&h, &[(1, log)], &store);
    assert_eq!(report.linearized_ops, 3);
    assert_eq!(report.linearizability_inconclusive, 0);
}

/// P8: a grant no client acknowledged must end; acknowledged grants and short-lived ones are fine.
#[test]
fn an_unacknowledged_grant_that_stays_held_violates_p8() {
    use crate::properties::p8_no_unknowing_holder::{CLOSE_BOUND_MS, UNKNOWING_BOUND_MS};
    let at = |mut l: AuditLine, now_ms: u64| {
        match &mut l.command {
            Command::OpenSession { now_ms: n, .. }
            | Command::Acquire { now_ms: n, .. }
            | Command::Release { now_ms: n, .. } => *n = now_ms,
            _ => {}
        }
        l
    };
    let later = UNKNOWING_BOUND_MS + 1_000;
    let log = |end: AuditLine| {
        vec![
            at(open(1), 0),
            at(open(2), 0),
            at(acquire(3, 1, "l", granted(3)), 10),
            at(acquire(4, 2, "m", granted(4)), 10),
            end,
        ]
    };
    // Session 1's grant of "l" was acknowledged; session 2's of "m" never was.
    let history = vec![op("acquire", "l", 1, 3, 5, 20, None), {
        let mut o = op("acquire", "m", 2, 0, 5, 2_000, None);
        o.result = "unknown".into();
        o.token = None;
        o
    }];
    let held_on = log(at(release(5, 1, "l", 3, vec![]), later));
    let r = check(&history, &[(1, held_on)], &[]);
    assert!(
        r.violations
            .iter()
            .any(|v| v.starts_with("P8:") && v.contains("\"m\"")),
        "{:?}",
        r.violations
    );
    assert!(
        !r.violations.iter().any(|v| v.contains("\"l\"")),
        "{:?}",
        r.violations
    );
    // Released soon: fine.
    let released = log(at(release(5, 2, "m", 4, vec![]), 1_000));
    let r = check(&history, &[(1, released)], &[]);
    assert!(
        !r.violations.iter().any(|v| v.starts_with("P8:")),
        "{:?}",
        r.violations
    );
    assert_eq!(r.unacknowledged_grants_checked, 1);
    // Closed by its own session long after the client gave up (at 2,000): nothing cancelled it. Closed
    // soon after it gave up is fine even if long after the grant: the call outlasted the grant.
    let close = |now_ms| AuditLine {
        index: 5,
        command: Command::CloseSession {
            session: SessionId(2),
            now_ms,
        },
        outcome: Outcome::SessionClosed { released: 1 },
        events: vec![],
        changes: Vec::new(),
    };
    // Closed long after the client gave up, although its next operation got through at once: it could
    // have cancelled.
    let through = |through_ms| {
        let mut h = history.clone();
        h.push(op("describe", "x", 0, 0, 2_100, through_ms, None));
        h
    };
    let late_close = 2_000 + CLOSE_BOUND_MS + 500;
    let r = check(&through(2_150), &[(1, log(close(late_close)))], &[]);
    assert!(
        r.violations
            .iter()
            .any(|v| v.contains("until its own session closed it")),
        "{:?}",
        r.violations
    );
    let r = check(
        &through(2_150),
        &[(1, log(close(2_000 + CLOSE_BOUND_MS - 500)))],
        &[],
    );
    assert!(
        !r.violations.iter().any(|v| v.starts_with("P8:")),
        "{:?}",
        r.violations
    );
    // A paused or cut-off client: nothing of its process got through until long after it gave up (or
    // nothing at all before the close), so it could not cancel; a close soon after it is heard again
    // is fine.
    for h in [through(late_close - 40), history.clone()] {
        let r = check(&h, &[(1, log(close(late_close)))], &[]);
        assert!(
            !r.violations.iter().any(|v| v.starts_with("P8:")),
            "{:?}",
            r.violations
        );
    }
    // An acknowledged grant ended by an abandon: a retry's grant was taken back.
    let abandoned = AuditLine {
        index: 5,
        command: Command::AbandonAcquire {
            session: SessionId(1),
            request: RequestId(3),
            name: name("l"),
            attempt: Some(1),
            now_ms: 50,
        },
        outcome: Outcome::Abandoned,
        events: vec![Event::GrantAbandoned {
            name: name("l"),
            session: SessionId(1),
            token: FencingToken(3),
        }],
        changes: Vec::new(),
    };
    let r = check(&history, &[(1, log(abandoned))], &[]);
    assert!(
        r.violations
            .iter()
            .any(|v| v.contains("a grant a client acknowledged, and an abandon ended it")),
        "{:?}",
        r.violations
    );
}

/// `good()`'s log with the changes its entries make, as a server's audit log has them.
fn with_changes(mut log: Vec<AuditLine>) -> Vec<AuditLine> {
    use holdfast_lock_table::{Change, ChangeKind};
    let change = |kind, session, token: Option<u64>| Change {
        name: name("l"),
        kind,
        session: SessionId(session),
        token: token.map(FencingToken),
        value: Box::default(),
    };
    for line in &mut log {
        line.changes = match line.index {
            3 => vec![change(ChangeKind::Granted, 1, Some(3))],
            4 => vec![change(ChangeKind::Queued, 2, None)],
            5 => vec![
                change(ChangeKind::Released, 1, Some(3)),
                change(ChangeKind::Granted, 2, Some(5)),
            ],
            _ => vec![],
        };
    }
    log
}

fn watch_start(prefix: &str, after: u64) -> Op {
    Op {
        op: "watch-start".into(),
        lock: prefix.into(),
        value: Some(after),
        result: "ok".into(),
        process: 9,
        ..Op::default()
    }
}

fn watched(index: u64, kind: &str, session: u64, token: u64) -> Op {
    Op {
        op: "watch".into(),
        lock: "l".into(),
        index: Some(index),
        kind: Some(kind.into()),
        session: Some(session),
        token: Some(token),
        result: "ok".into(),
        process: 9,
        ..Op::default()
    }
}

#[test]
fn p9_watch_streams_must_be_the_log_without_gaps_or_repeats() {
    let (h, log, store) = good();
    let log = with_changes(log);
    let every = [
        watched(3, "granted", 1, 3),
        watched(4, "queued", 2, 0),
        watched(5, "released", 1, 3),
        watched(5, "granted", 2, 5),
    ];
    let run = |events: &[Op], after: u64, prefix: &str| {
        let mut h = h.clone();
        h.push(watch_start(prefix, after));
        h.extend(events.iter().cloned());
        let r = check(&h, &[(1, log.clone())], &store);
        (r.violations, r.watch_events_checked)
    };
    // All of it, part of it (a watcher may stop anywhere), from a later start, another prefix.
    assert_eq!(run(&every, 0, ""), (vec![], 4));
    assert_eq!(run(&every[..3], 0, "l").0, Vec::<String>::new());
    assert_eq!(run(&every[2..], 4, "").0, Vec::<String>::new());
    assert_eq!(run(&[], 0, "other/").0, Vec::<String>::new());
    // A gap, a repeat (a resume that skipped nothing), an event out of order, a wrong token.
    for bad in [
        vec![every[0].clone(), every[2].clone()],
        vec![every[0].clone(), every[1].clone(), every[1].clone()],
        vec![every[1].clone(), every[0].clone()],
        vec![watched(3, "granted", 1, 4)],
    ] {
        let (v, _) = run(&bad, 0, "");
        assert!(v.len() == 1 && v[0].starts_with("P9:"), "{bad:?}: {v:?}");
    }
    // An event before the watch's start is one it cannot have had.
    let (v, _) = run(&every[..1], 3, "");
    assert!(v.len() == 1 && v[0].starts_with("P9:"), "{v:?}");
}

#[test]
fn p10_no_grant_inside_a_lock_delay() {
    use holdfast_lock_table::{Change, ChangeKind};
    let change = |kind, session, token| Change {
        name: name("l"),
        kind,
        session: SessionId(session),
        token: Some(FencingToken(token)),
        value: Box::default(),
    };
    let expiry = AuditLine {
        index: 4,
        command: Command::ExpireSession {
            session: SessionId(1),
            now_ms: 1_000,
        },
        outcome: Outcome::SessionClosed { released: 1 },
        events: vec![
            Event::LockDelayed {
                name: name("l"),
                token: FencingToken(3),
                delay_ms: 500,
                began: 4,
                shared: false,
            },
            Event::SessionEnded {
                session: SessionId(1),
            },
        ],
        changes: vec![
            change(ChangeKind::Expired, 1, 3),
            change(ChangeKind::Delayed, 0, 3),
        ],
    };
    let end = |now_ms| AuditLine {
        index: 5,
        command: Command::EndLockDelay {
            name: name("l"),
            token: FencingToken(3),
            now_ms,
        },
        outcome: Outcome::Released,
        events: vec![],
        changes: vec![
            change(ChangeKind::DelayEnded, 0, 3),
            change(ChangeKind::Granted, 2, 5),
        ],
    };
    let run = |grant: AuditLine| {
        let log = vec![open(1), open(2), expiry.clone(), grant];
        let r = check(&[], &[(1, log)], &[]);
        let p10: Vec<_> = r
            .violations
            .into_iter()
            .filter(|v| v.starts_with("P10"))
            .collect();
        (p10, r.lock_delays_checked)
    };
    assert_eq!(run(end(1_500)), (vec![], 1));
    // Granted 100 ms after the expiry of a 500 ms delay.
    assert_eq!(run(end(1_100)).0.len(), 1);
    // Granted by something other than the delay's end.
    let mut early = end(1_500);
    early.command = Command::Acquire {
        session: SessionId(2),
        request: RequestId(1),
        name: name("l"),
        mode: AcquireMode::Wait,
        value: Box::default(),
        attempt: 1,
        now_ms: 1_500,
    };
    assert_eq!(run(early).0.len(), 1);
}

#[test]
fn p10_an_expiry_of_a_grant_that_asked_for_a_lock_delay_begins_one() {
    use holdfast_lock_table::{Change, ChangeKind};
    let asked = AuditLine {
        command: Command::WithLockDelay {
            lock_delay_ms: 500,
            command: Box::new(acquire(3, 1, "l", granted(3)).command),
        },
        changes: vec![Change {
            name: name("l"),
            kind: ChangeKind::Granted,
            session: SessionId(1),
            token: Some(FencingToken(3)),
            value: Box::default(),
        }],
        ..acquire(3, 1, "l", granted(3))
    };
    // Its session expires and the lock goes free at once: the delay was lost.
    let expiry = AuditLine {
        index: 4,
        command: Command::ExpireSession {
            session: SessionId(1),
            now_ms: 1_000,
        },
        outcome: Outcome::SessionClosed { released: 1 },
        events: vec![Event::SessionEnded {
            session: SessionId(1),
        }],
        changes: vec![Change {
            name: name("l"),
            kind: ChangeKind::Expired,
            session: SessionId(1),
            token: Some(FencingToken(3)),
            value: Box::default(),
        }],
    };
    let r = check(&[], &[(1, vec![open(1), asked, expiry])], &[]);
    let p10: Vec<_> = r
        .violations
        .iter()
        .filter(|v| v.starts_with("P10"))
        .collect();
    assert_eq!(p10.len(), 1, "{:?}", r.violations);
    assert!(p10[0].contains("did not begin"), "{p10:?}");
}

// ---- P11: shared locks and semaphores ----

/// The audit lines a real table writes for `commands`, applied at indexes 1, 2, 3, ...
fn table_log(commands: &[Command]) -> Vec<AuditLine> {
    let mut t = holdfast_lock_table::LockTable::new();
    commands
        .iter()
        .enumerate()
        .map(|(i, c)| {
            let index = i as u64 + 1;
            let outcome = t.apply(index, c);
            AuditLine {
                index,
                command: c.clone(),
                outcome,
                events: t.take_events(),
                changes: t.take_changes(),
            }
        })
        .collect()
}

fn shared_acquire(
    index: u64,
    session: u64,
    lock: &str,
    share: holdfast_lock_table::Share,
) -> Command {
    Command::WithShare {
        share,
        command: Box::new(acquire(index, session, lock, granted(index)).command),
    }
}

fn p11(log: Vec<AuditLine>) -> (Vec<String>, usize) {
    let r = check(&[], &[(1, log)], &[]);
    let p11 = r
        .violations
        .into_iter()
        .filter(|v| v.starts_with("P11"))
        .collect();
    (p11, r.shared_grants_checked)
}

#[test]
fn p11_accepts_what_the_table_does_with_readers_writers_and_permits() {
    use holdfast_lock_table::Share::*;
    let log = table_log(&[
        open(1).command,
        open(2).command,
        open(3).command,
        shared_acquire(4, 1, "r", Shared),
        shared_acquire(5, 2, "r", Shared),
        acquire(6, 3, "r", granted(6)).command,
        release(7, 1, "r", 4, vec![]).command,
        release(8, 2, "r", 5, vec![]).command,
        shared_acquire(9, 1, "s", Permits(2)),
        shared_acquire(10, 2, "s", Permits(2)),
        Command::WithLockDelay {
            lock_delay_ms: 500,
            command: Box::new(shared_acquire(11, 3, "s", Permits(2))),
        },
        release(12, 1, "s", 9, vec![]).command,
        Command::ExpireSession {
            session: SessionId(3),
            now_ms: 1_000,
        },
        Command::EndLockDelay {
            name: name("s"),
            token: FencingToken(13),
            now_ms: 1_600,
        },
    ]);
    // The writer is granted at index 8 (the last reader left), the delayed permit at 12.
    assert!(log[7].events.iter().any(|e| matches!(
        e,
        Event::Granted {
            session: SessionId(3),
            ..
        }
    )));
    let (v, checked) = p11(log);
    assert_eq!(v, Vec::<String>::new());
    assert_eq!(checked, 6);
}

#[test]
fn p11_catches_a_writer_beside_a_reader_and_a_permit_too_many() {
    use holdfast_lock_table::{Change, ChangeKind, Share::*};
    let grant = |index: u64, session: u64, lock: &str| Change {
        name: name(lock),
        kind: ChangeKind::Granted,
        session: SessionId(session),
        token: Some(FencingToken(index)),
        value: Box::default(),
    };
    // The writer's acquire queued behind the reader; a buggy table grants it anyway.
    let mut log = table_log(&[
        open(1).command,
        open(2).command,
        open(3).command,
        shared_acquire(4, 1, "r", Shared),
        acquire(5, 2, "r", granted(5)).command,
    ]);
    log[4].outcome = granted(5);
    log[4].changes = vec![grant(5, 2, "r")];
    let (v, _) = p11(log);
    assert_eq!(v.len(), 1, "{v:?}");
    assert!(v[0].contains("granted Exclusive"), "{v:?}");
    // A semaphore of 2 grants a third permit.
    let mut log = table_log(&[
        open(1).command,
        open(2).command,
        open(3).command,
        shared_acquire(4, 1, "s", Permits(2)),
        shared_acquire(5, 2, "s", Permits(2)),
        shared_acquire(6, 3, "s", Permits(2)),
    ]);
    log[5].outcome = granted(6);
    log[5].changes = vec![grant(6, 3, "s")];
    let (v, _) = p11(log);
    assert_eq!(v.len(), 1, "{v:?}");
    assert!(v[0].contains("Permits(2)"), "{v:?}");
}

#[test]
fn p11_catches_a_lock_delay_of_a_permit_that_ends_early() {
    use holdfast_lock_table::Share::*;
    let log = |end_ms| {
        table_log(&[
            open(1).command,
            open(2).command,
            Command::WithLockDelay {
                lock_delay_ms: 500,
                command: Box::new(shared_acquire(3, 1, "s", Permits(1))),
            },
            shared_acquire(4, 2, "s", Permits(1)),
            Command::ExpireSession {
                session: SessionId(1),
                now_ms: 1_000,
            },
            Command::EndLockDelay {
                name: name("s"),
                token: FencingToken(3),
                now_ms: end_ms,
            },
        ])
    };
    assert_eq!(p11(log(1_500)).0, Vec::<String>::new());
    let (v, _) = p11(log(1_200));
    assert_eq!(v.len(), 1, "{v:?}");
    assert!(v[0].contains("before it could"), "{v:?}");
}

#[test]
fn p11_catches_a_reader_that_overtakes_a_waiting_writer() {
    use holdfast_lock_table::{Change, ChangeKind, Share::*};
    let mut log = table_log(&[
        open(1).command,
        open(2).command,
        open(3).command,
        shared_acquire(4, 1, "r", Shared),
        acquire(5, 2, "r", granted(5)).command,
        shared_acquire(6, 3, "r", Shared),
    ]);
    assert!(matches!(log[5].outcome, Outcome::Queued { .. }));
    // A buggy table lets the late reader join the reader ahead of the waiting writer.
    log[5].outcome = granted(6);
    log[5].changes = vec![Change {
        name: name("r"),
        kind: ChangeKind::Granted,
        session: SessionId(3),
        token: Some(FencingToken(6)),
        value: Box::default(),
    }];
    let (v, _) = p11(log);
    assert_eq!(v.len(), 1, "{v:?}");
    assert!(v[0].contains("granted at once"), "{v:?}");
}

/// Two readers granted by one entry expire one after the other: an end of the first delay that names
/// only the token (as a stale or repeated proposal would) ends the second one early.
#[test]
fn p11_catches_an_end_that_cuts_a_newer_delay_with_the_same_token_short() {
    use holdfast_lock_table::Share::*;
    let reader = |index, session| Command::WithLockDelay {
        lock_delay_ms: 500,
        command: Box::new(shared_acquire(index, session, "r", Shared)),
    };
    let log = |second_end: Command| {
        table_log(&[
            open(1).command,
            open(2).command,
            open(3).command,
            acquire(4, 1, "r", granted(4)).command,
            reader(5, 2),
            reader(6, 3),
            release(7, 1, "r", 4, vec![]).command,
            Command::ExpireSession {
                session: SessionId(2),
                now_ms: 1_000,
            },
            Command::EndLockDelayAt {
                name: name("r"),
                token: FencingToken(7),
                began: 8,
                now_ms: 1_500,
            },
            Command::ExpireSession {
                session: SessionId(3),
                now_ms: 1_600,
            },
            second_end,
        ])
    };
    let at = |began, now_ms| Command::EndLockDelayAt {
        name: name("r"),
        token: FencingToken(7),
        began,
        now_ms,
    };
    // The repeated end of the first delay changes nothing; the second ends on time.
    assert_eq!(p11(log(at(8, 1_700))).0, Vec::<String>::new());
    assert_eq!(p11(log(at(10, 2_100))).0, Vec::<String>::new());
    // A plain end by token alone takes the second delay 100 ms after it began.
    let plain = Command::EndLockDelay {
        name: name("r"),
        token: FencingToken(7),
        now_ms: 1_700,
    };
    let (v, _) = p11(log(plain));
    assert_eq!(v.len(), 1, "{v:?}");
    assert!(v[0].contains("before it could"), "{v:?}");
}

/// Two groups are two independent logs: the same indexes, session ids and tokens in each. Checked as
/// one they would disagree (P2); each is checked against its own log, with the operations on the names
/// it owns and the opens recorded for it, and a violation names its group.
#[test]
fn groups_are_checked_each_against_its_own_log() {
    let group_of = |name: &str| u32::from(name == "m");
    let (mut h, log0, mut store) = good_on("l");
    let (h1, log1, store1) = good_on("m");
    for mut o in h1 {
        if o.op == "open" {
            o.group = Some(1);
        }
        h.push(o);
    }
    store.extend(store1);
    let audits = vec![
        vec![(1, log0.clone()), (2, log0.clone())],
        vec![(1, log1.clone()), (2, log1.clone())],
    ];
    let report = check_groups(&h, &audits, &store, group_of);
    assert!(report.violations.is_empty(), "{:?}", report.violations);
    assert_eq!((report.ok_grants, report.ok_writes), (4, 4));
    let merged: Vec<(u64, Vec<AuditLine>)> = vec![(1, log0.clone()), (2, log1.clone())];
    assert!(!check(&h, &merged, &store).violations.is_empty());

    // Group 1 lost its first grant: P5, in group 1 only.
    let mut lost = log1.clone();
    lost.retain(|l| l.index != 3);
    let audits = vec![vec![(1, log0)], vec![(1, lost)]];
    let v = check_groups(&h, &audits, &store, group_of).violations;
    assert!(
        !v.is_empty() && v.iter().all(|v| v.starts_with("group 1: ")),
        "{v:?}"
    );
    assert!(v.iter().any(|v| v.contains("P5")), "{v:?}");
}
