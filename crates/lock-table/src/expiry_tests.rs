//! `Command::ExpireSessions`: one entry expiring several sessions ends in the same holders and queues as
//! cancelling their waits and expiring them one entry each, gives no session of the batch a lock, and
//! refuses (changing nothing) what it may not do in one entry.

use crate::command::{AcquireMode::*, Command, Limit, Outcome, Refusal, Share};
use crate::limits::{MAX_EXPIRY_BATCH, MAX_LOCKS_PER_SESSION};
use crate::tests::{acq, cancel, delayed, expire, name, open, rel};
use crate::{LockTable, SessionId};
use proptest::prelude::*;

fn batch(ids: &[u64]) -> Command {
    Command::ExpireSessions {
        sessions: ids.iter().map(|&s| SessionId(s)).collect(),
        now_ms: 0,
    }
}

fn share(share: Share, command: Command) -> Command {
    Command::WithShare {
        share,
        command: Box::new(command),
    }
}

/// Per lock: its holders' sessions (0: a lock-delay's placeholder) and its queue's, in order; and the
/// live sessions. Tokens and times are left out: one entry's grants share its index.
type Shape = (Vec<(String, Vec<u64>, Vec<u64>)>, Vec<u64>);

fn shape(t: &LockTable) -> Shape {
    let locks = t
        .list_locks("", None, usize::MAX)
        .into_iter()
        .map(|l| {
            (
                l.name.as_str().to_string(),
                l.holders().map(|h| h.session.0).collect(),
                l.waiters.iter().map(|w| w.session.0).collect(),
            )
        })
        .collect();
    let sessions = t
        .list_sessions(None, usize::MAX)
        .into_iter()
        .map(|s| s.session.0)
        .collect();
    (locks, sessions)
}

/// A queue of writers and readers behind an expiring holder, where the batch holds a waiter too: the
/// waiter of the batch is never granted (one entry would grant the lock twice with one token), and the
/// lock goes straight to the first waiter that outlives the batch.
#[test]
fn a_waiter_of_the_batch_is_never_granted() {
    let mut t = LockTable::new();
    for i in 1..=4 {
        t.apply(i, &open(i as u128));
    }
    t.apply(5, &acq(1, 1, "x", Wait));
    t.apply(6, &acq(2, 1, "x", Wait));
    t.apply(7, &acq(3, 1, "x", Wait));
    t.take_events();
    t.take_changes();
    assert_eq!(
        t.apply(8, &batch(&[1, 2, 99])),
        Outcome::SessionClosed { released: 1 }
    );
    t.check_invariants();
    let v = t.describe(&name("x")).unwrap();
    assert_eq!((v.holder.session.0, v.holder.token.0), (3, 8));
    assert!(v.waiters.is_empty());
    let granted: Vec<u64> = t
        .take_changes()
        .iter()
        .filter(|c| c.kind == crate::ChangeKind::Granted)
        .map(|c| c.session.0)
        .collect();
    assert_eq!(granted, vec![3], "only the survivor is granted");
}

/// Refused whole, changing nothing: two sessions of the batch holding one lock with lock-delays (their
/// placeholders would share a name), more locks and waits than one session may have, more sessions
/// than the limit. Two holders of one lock without delays are expired together.
#[test]
fn a_batch_it_may_not_apply_in_one_entry_is_refused_whole() {
    let mut t = LockTable::new();
    for i in 1..=3 {
        t.apply(i, &open(i as u128));
    }
    t.apply(4, &delayed(100, share(Share::Shared, acq(1, 1, "r", Wait))));
    t.apply(5, &delayed(100, share(Share::Shared, acq(2, 1, "r", Wait))));
    t.apply(6, &acq(3, 1, "x", Wait));
    let before = t.digest();
    let too_big = Outcome::Refused(Refusal::LimitExceeded(Limit::ExpiryBatch));
    assert_eq!(t.apply(7, &batch(&[1, 2])), too_big);
    let many: Vec<u64> = (1..=MAX_EXPIRY_BATCH as u64 + 1).collect();
    assert_eq!(t.apply(8, &batch(&many)), too_big);
    assert_eq!(t.digest(), before);
    // One session holding the lock with another is fine, and so is one alone.
    assert_eq!(
        t.apply(9, &batch(&[1, 3])),
        Outcome::SessionClosed { released: 2 }
    );
    t.check_invariants();
    assert_eq!(shape(&t).1, vec![2]);

    // Two readers without lock-delays go in one entry, and the writer behind them gets the lock.
    let mut t = LockTable::new();
    for i in 1..=3 {
        t.apply(i, &open(i as u128));
    }
    t.apply(4, &share(Share::Shared, acq(1, 1, "r", Wait)));
    t.apply(5, &share(Share::Shared, acq(2, 1, "r", Wait)));
    t.apply(6, &acq(3, 1, "r", Wait));
    assert_eq!(
        t.apply(7, &batch(&[1, 2])),
        Outcome::SessionClosed { released: 2 }
    );
    t.check_invariants();
    let v = t.describe(&name("r")).unwrap();
    assert_eq!((v.holder.session.0, v.holder.token.0), (3, 7));

    // Work: two sessions whose locks add up to more than one session may hold.
    let mut t = LockTable::new();
    t.apply(1, &open(1));
    t.apply(2, &open(2));
    let per = MAX_LOCKS_PER_SESSION as u64 / 2 + 1;
    let mut index = 2;
    for s in 1..=2u64 {
        for i in 0..per {
            index += 1;
            let o = t.apply(index, &acq(s, i + 1, &format!("w/{s}/{i}"), Try));
            assert!(matches!(o, Outcome::Granted { .. }), "{o:?}");
        }
    }
    let before = t.digest();
    assert_eq!(t.apply(index + 1, &batch(&[1, 2])), too_big);
    assert_eq!(t.digest(), before);
    assert!(matches!(
        t.apply(index + 2, &batch(&[1])),
        Outcome::SessionClosed { .. }
    ));
}

#[derive(Clone, Debug)]
enum Op {
    Acquire {
        s: u64,
        n: usize,
        shared: bool,
        delay: bool,
    },
    Release {
        s: u64,
        n: usize,
    },
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        3 => (1..=6u64, 0..3usize, any::<bool>(), any::<bool>())
            .prop_map(|(s, n, shared, delay)| Op::Acquire { s, n, shared, delay }),
        1 => (1..=6u64, 0..3usize).prop_map(|(s, n)| Op::Release { s, n }),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]
    /// From any table of six sessions and three locks (exclusive and shared holders, queues,
    /// lock-delays), expiring a set of sessions in one entry ends in the shape that cancelling their
    /// waits and then expiring them one entry each does, or is refused and changes nothing, and only
    /// when two of them hold one lock both with a lock-delay. (Expiring them one entry each without the cancels can grant a
    /// lock to a session of the batch first, which then expires holding it: with a lock-delay that
    /// leaves the lock to nobody for the delay, for a grant its client never learned of.)
    #[test]
    fn one_entry_ends_where_one_entry_each_does(
        ops in proptest::collection::vec(op(), 0..40),
        expiring in proptest::sample::subsequence(vec![1u64, 2, 3, 4, 5, 6], 0..=6),
    ) {
        let names = ["a", "b", "c"];
        let mut t = LockTable::new();
        for i in 1..=6u64 {
            t.apply(i, &open(u128::from(i)));
        }
        let mut index = 6;
        let mut request = [0u64; 7];
        for op in ops {
            index += 1;
            match op {
                Op::Acquire { s, n, shared, delay } => {
                    request[s as usize] += 1;
                    let mut c = acq(s, request[s as usize], names[n], Wait);
                    if shared {
                        c = share(Share::Shared, c);
                    }
                    if delay {
                        c = delayed(100, c);
                    }
                    t.apply(index, &c);
                }
                Op::Release { s, n } => {
                    let token = t
                        .describe(&name(names[n]))
                        .and_then(|v| v.holders().find(|h| h.session.0 == s).map(|h| h.token.0));
                    if let Some(token) = token {
                        request[s as usize] += 1;
                        t.apply(index, &rel(s, request[s as usize], names[n], token));
                    }
                }
            }
        }
        t.take_events();
        t.take_changes();
        let shared_hold = names.iter().any(|n| {
            t.describe(&name(n)).is_some_and(|v| {
                v.holders()
                    .filter(|h| expiring.contains(&h.session.0) && h.lock_delay_ms > 0)
                    .count()
                    > 1
            })
        });
        let mut one = t.clone();
        let mut each = t.clone();
        let before = t.digest();
        let outcome = one.apply(index + 1, &batch(&expiring));
        if shared_hold {
            prop_assert_eq!(outcome, Outcome::Refused(Refusal::LimitExceeded(Limit::ExpiryBatch)));
            prop_assert_eq!(one.digest(), before);
            return Ok(());
        }
        prop_assert!(matches!(outcome, Outcome::SessionClosed { .. }), "{:?}", outcome);
        one.check_invariants();
        // One entry each, with the batch's waits cancelled first (from the back of each queue, so
        // that no cancel lets another waiter of the batch in): what the batch does in one entry.
        let mut next = index;
        for n in names {
            let queue: Vec<u64> = each
                .describe(&name(n))
                .map(|v| v.waiters.iter().map(|w| w.session.0).collect())
                .unwrap_or_default();
            for &s in queue.iter().rev().filter(|s| expiring.contains(s)) {
                let request = each.sessions[&SessionId(s)].waiting[&name(n)];
                next += 1;
                prop_assert_eq!(each.apply(next, &cancel(s, request.0, n)), Outcome::Cancelled);
            }
        }
        for &s in &expiring {
            next += 1;
            each.apply(next, &expire(s));
        }
        each.check_invariants();
        prop_assert_eq!(shape(&one), shape(&each));
        // No session of the batch was granted anything by the entry.
        for c in one.take_changes() {
            prop_assert!(
                c.kind != crate::ChangeKind::Granted || !expiring.contains(&c.session.0),
                "{:?}",
                c
            );
        }
    }
}

/// `ExpireSessions` is the newest variant (appended after `SetTableBudget`, so every earlier
/// encoding keeps its meaning), and its bytes are pinned.
#[test]
fn expire_sessions_is_appended_and_its_encoding_is_pinned() {
    let budget = postcard::to_allocvec(&Command::SetTableBudget {
        bytes: 0,
        now_ms: 0,
    })
    .unwrap();
    let command = Command::ExpireSessions {
        sessions: vec![SessionId(3), SessionId(300)],
        now_ms: 7,
    };
    let bytes = postcard::to_allocvec(&command).unwrap();
    assert_eq!(bytes, vec![budget[0] + 1, 2, 3, 0xac, 0x02, 7]);
    assert_eq!(postcard::from_bytes::<Command>(&bytes).unwrap(), command);
}
