//! The table's memory budget ([`Command::SetTableBudget`]): what is charged, what is refused, and a
//! property test that the table never grows past its budget and that a refusal changes no lock.

use crate::command::{AcquireMode::*, Command, Outcome, Outcome::*, Refusal, Share};
use crate::limits::{GRANT_BYTES, LOCK_BYTES, SESSION_BYTES};
use crate::tests::{acq, cancel, close, expire, granted, name, open, opened, rel};
use crate::{LockTable, RequestId, SessionId};
use proptest::prelude::*;

fn budget(bytes: u64) -> Command {
    Command::SetTableBudget { bytes, now_ms: 0 }
}

fn with_value(command: Command, len: usize) -> Command {
    crate::tests::with_value(command, &vec![7; len])
}

fn full(budget: u64, used: u64) -> Outcome {
    Refused(Refusal::TableFull { budget, used })
}

/// Sessions, locks (with their names), grants and waits (with their values) are charged; an open, a
/// grant or a wait past the budget is refused, naming the budget and the use, while whatever frees
/// memory still works and makes room again. Without a budget (0) nothing is refused.
#[test]
fn the_budget_refuses_what_does_not_fit_and_never_what_frees() {
    let mut t = LockTable::new();
    let session = SESSION_BYTES;
    let lock = |n: &str| LOCK_BYTES + n.len() as u64;
    assert_eq!(t.apply(1, &open(1)), opened(1));
    assert_eq!(t.apply(2, &open(2)), opened(2));
    assert_eq!(t.table_bytes(), 2 * session);
    // Room for one more lock with a 100-byte value, and nothing else.
    let room = 2 * session + lock("a") + GRANT_BYTES + 100;
    assert_eq!(t.apply(3, &budget(room)), BudgetSet { previous: 0 });
    assert_eq!(t.table_budget(), room);
    assert_eq!(
        t.apply(4, &with_value(acq(1, 1, "a", Wait), 100)),
        granted(4)
    );
    assert_eq!(t.table_bytes(), room);
    // A wait, a new lock, a shared grant beside it and a new session: each is refused.
    let used = room;
    assert_eq!(t.apply(5, &acq(2, 1, "a", Wait)), full(room, used));
    assert_eq!(t.apply(6, &acq(2, 2, "b", Wait)), full(room, used));
    assert_eq!(t.apply(7, &open(3)), full(room, used));
    // A refused acquire is remembered like any other outcome; nothing else changed.
    assert_eq!(t.apply(8, &acq(2, 1, "a", Wait)), full(room, used));
    assert_eq!(t.lock_count(), 1);
    assert_eq!(t.waiter_count(), 0);
    assert_eq!(t.table_bytes(), used);
    t.check_invariants();
    // Releasing frees the lock and its value: now "b" fits, and a wait behind it does not.
    assert_eq!(t.apply(9, &rel(1, 2, "a", 4)), Released);
    assert_eq!(t.table_bytes(), 2 * session);
    assert_eq!(t.apply(10, &acq(2, 3, "b", Wait)), granted(10));
    assert_eq!(t.apply(11, &acq(1, 3, "b", Wait)), Queued { position: 1 });
    let used = t.table_bytes();
    assert_eq!(used, 2 * session + lock("b") + 2 * GRANT_BYTES);
    assert_eq!(t.apply(12, &acq(1, 4, "c", Try)), full(room, used));
    // Granting the waiter costs nothing more; cancelling and closing free their charge.
    assert_eq!(t.apply(13, &rel(2, 4, "b", 10)), Released);
    assert_eq!(t.table_bytes(), 2 * session + lock("b") + GRANT_BYTES);
    assert_eq!(t.apply(14, &close(1)), SessionClosed { released: 1 });
    assert_eq!(t.table_bytes(), session);
    // Lifting the budget lets anything in again.
    assert_eq!(t.apply(15, &budget(0)), BudgetSet { previous: room });
    for s in 16..20 {
        assert_eq!(t.apply(s, &open(s.into())), opened(s));
    }
    t.check_invariants();
}

/// A lock-delay's placeholder keeps its grant's charge without the value; a budget set below what the
/// table uses refuses new things but takes nothing away.
#[test]
fn a_delay_keeps_its_charge_and_a_lower_budget_takes_nothing_away() {
    let mut t = LockTable::new();
    assert_eq!(t.apply(1, &open(1)), opened(1));
    let delayed = Command::WithLockDelay {
        lock_delay_ms: 1_000,
        command: Box::new(with_value(acq(1, 1, "a", Wait), 50)),
    };
    assert_eq!(t.apply(2, &delayed), granted(2));
    assert_eq!(t.apply(3, &budget(1)), BudgetSet { previous: 0 });
    assert_eq!(
        t.apply(4, &open(4)),
        full(1, SESSION_BYTES + LOCK_BYTES + 1 + GRANT_BYTES + 50)
    );
    assert_eq!(t.lock_count(), 1);
    assert_eq!(t.apply(5, &expire(1)), SessionClosed { released: 1 });
    assert_eq!(t.table_bytes(), LOCK_BYTES + 1 + GRANT_BYTES);
    let end = t.delayed_locks()[0].end(0);
    assert_eq!(t.apply(6, &end), Released);
    assert_eq!(t.table_bytes(), 0);
    t.check_invariants();
}

/// The budget survives a snapshot, and the charge is recounted on decode.
#[test]
fn the_budget_survives_a_snapshot() {
    let mut t = LockTable::new();
    assert_eq!(t.apply(1, &open(1)), opened(1));
    assert_eq!(t.apply(2, &budget(10_000)), BudgetSet { previous: 0 });
    assert_eq!(t.apply(3, &acq(1, 1, "lock", Wait)), granted(3));
    let back = LockTable::decode_snapshot(&t.encode_snapshot()).unwrap();
    assert_eq!(back.digest(), t.digest());
    assert_eq!(
        (back.table_budget(), back.table_bytes()),
        (10_000, t.table_bytes())
    );
}

#[derive(Clone, Debug)]
enum Op {
    Open(u8),
    Close(u8),
    Expire(u8),
    Acquire {
        s: u8,
        n: u8,
        value: u8,
        shared: bool,
        wait: bool,
    },
    Release {
        s: u8,
        n: u8,
    },
    Cancel {
        s: u8,
        n: u8,
    },
    Budget(u16),
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        1 => (0u8..4).prop_map(Op::Open),
        1 => (0u8..4).prop_map(Op::Close),
        1 => (0u8..4).prop_map(Op::Expire),
        4 => (0u8..4, 0u8..4, 0u8..200, any::<bool>(), any::<bool>())
            .prop_map(|(s, n, value, shared, wait)| Op::Acquire { s, n, value, shared, wait }),
        2 => (0u8..4, 0u8..4).prop_map(|(s, n)| Op::Release { s, n }),
        1 => (0u8..4, 0u8..4).prop_map(|(s, n)| Op::Cancel { s, n }),
        1 => (0u16..16).prop_map(Op::Budget),
    ]
}

proptest! {
    /// Whatever the commands, the table is charged exactly what it holds (`check_invariants` recounts
    /// it), it grows past its budget never (it can only be over a budget set below its use, and then
    /// only shrinks), and a `TableFull` refusal leaves every lock, wait and session as it was.
    #[test]
    fn the_table_never_grows_past_its_budget(ops in prop::collection::vec(op(), 1..120)) {
        let mut t = LockTable::new();
        // Session slot -> session id, and each session's last token per name.
        let mut sessions: [Option<u64>; 4] = [None; 4];
        let mut request = 0u64;
        for (i, op) in ops.iter().enumerate() {
            let index = i as u64 + 1;
            request += 1;
            let sid = |s: u8| sessions[s as usize].unwrap_or(999);
            let lock_name = |n: u8| ["a", "bb", "ccc", "dddd"][n as usize];
            let command = match op {
                Op::Open(s) => open(u128::from(*s) + 1000 * index as u128),
                Op::Close(s) => close(sid(*s)),
                Op::Expire(s) => expire(sid(*s)),
                Op::Acquire { s, n, value, shared, wait } => {
                    let a = with_value(acq(sid(*s), request, lock_name(*n), if *wait { Wait } else { Try }), *value as usize);
                    if *shared { Command::WithShare { share: Share::Shared, command: Box::new(a) } } else { a }
                }
                Op::Release { s, n } => {
                    let token = t.describe(&name(lock_name(*n)))
                        .and_then(|v| v.holders().find(|h| h.session == SessionId(sid(*s))).map(|h| h.token.0))
                        .unwrap_or(1);
                    rel(sid(*s), request, lock_name(*n), token)
                }
                Op::Cancel { s, n } => {
                    // Cancel whatever request the session waits for on that name, if any.
                    let waiting = t.sessions.get(&SessionId(sid(*s))).and_then(|x| x.waiting.get(&name(lock_name(*n))).copied());
                    cancel(sid(*s), waiting.unwrap_or(RequestId(request)).0, lock_name(*n))
                }
                Op::Budget(k) => budget(u64::from(*k) * 1_000),
            };
            let before = t.clone();
            let got = t.apply(index, &command);
            t.take_events();
            t.take_changes();
            t.check_invariants();
            if let (Op::Open(s), SessionOpened { session, .. }) = (op, &got) {
                sessions[*s as usize] = Some(session.0);
            }
            if t.table_budget() > 0 && t.table_bytes() > t.table_budget() {
                prop_assert!(t.table_bytes() <= before.table_bytes(), "grew past the budget: {:?} -> {:?}", command, got);
            }
            if let Refused(Refusal::TableFull { budget, used }) = got {
                prop_assert_eq!((budget, used), (before.table_budget(), before.table_bytes()));
                prop_assert_eq!(&t.locks, &before.locks);
                prop_assert_eq!(t.session_count(), before.session_count());
                prop_assert_eq!(t.table_bytes(), before.table_bytes());
            }
        }
    }
}

/// A long-lived session's deduplication window keeps at most `DEDUP_WINDOW` outcomes and never
/// allocates room for more: 512 bytes, what the budget's `SESSION_BYTES` counts on.
#[test]
fn a_long_lived_sessions_dedup_window_stays_its_size() {
    use crate::limits::DEDUP_WINDOW;
    let mut t = LockTable::new();
    assert_eq!(t.apply(1, &open(1)), opened(1));
    for r in 1..=200u64 {
        let index = 2 * r;
        assert_eq!(
            t.apply(index, &acq(1, 2 * r - 1, "a", Wait)),
            granted(index)
        );
        assert_eq!(t.apply(index + 1, &rel(1, 2 * r, "a", index)), Released);
    }
    let window = &t.sessions[&SessionId(1)].dedup;
    assert_eq!(window.len(), DEDUP_WINDOW);
    assert!(
        window.capacity() <= DEDUP_WINDOW,
        "the window allocated {} entries",
        window.capacity()
    );
    t.check_invariants();
}
