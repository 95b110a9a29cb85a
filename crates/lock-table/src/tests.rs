//! Lock table tests: spec cases as data, then a property test against a simple reference model.

use crate::command::{
    AcquireMode::*, Command, Event, Limit, Outcome, Outcome::*, QuotaLimits, Refusal,
};
use crate::limits::*;
use crate::{FencingToken, LockName, LockTable, RequestId, SessionId};
use proptest::prelude::*;

pub(crate) fn name(s: &str) -> LockName {
    LockName::new(s).unwrap()
}
pub(crate) fn open(nonce: u128) -> Command {
    Command::OpenSession {
        nonce,
        ttl_ms: DEFAULT_TTL_MS,
        now_ms: 0,
    }
}
/// An acquire by the call with attempt `1000 * r + 1`: one call per request unless a case says otherwise.
/// `command` (an [`Command::Acquire`]) carrying `value`.
pub(crate) fn with_value(command: Command, value: &[u8]) -> Command {
    match command {
        Command::Acquire {
            session,
            request,
            name,
            mode,
            attempt,
            now_ms,
            ..
        } => Command::Acquire {
            session,
            request,
            name,
            mode,
            value: value.into(),
            attempt,
            now_ms,
        },
        other => panic!("not an acquire: {other:?}"),
    }
}

pub(crate) fn acq(s: u64, r: u64, n: &str, mode: crate::AcquireMode) -> Command {
    acq_attempt(s, r, n, mode, 1000 * r + 1)
}
pub(crate) fn acq_attempt(
    s: u64,
    r: u64,
    n: &str,
    mode: crate::AcquireMode,
    attempt: u64,
) -> Command {
    Command::Acquire {
        session: SessionId(s),
        request: RequestId(r),
        name: name(n),
        mode,
        value: Box::default(),
        attempt,
        now_ms: 0,
    }
}
pub(crate) fn rel(s: u64, r: u64, n: &str, t: u64) -> Command {
    Command::Release {
        session: SessionId(s),
        request: RequestId(r),
        name: name(n),
        token: FencingToken(t),
        now_ms: 0,
    }
}
pub(crate) fn cancel(s: u64, r: u64, n: &str) -> Command {
    Command::CancelWait {
        session: SessionId(s),
        request: RequestId(r),
        name: name(n),
        now_ms: 0,
    }
}
/// The client gives up on its request (any call's).
pub(crate) fn abandon(s: u64, r: u64, n: &str) -> Command {
    Command::AbandonAcquire {
        session: SessionId(s),
        request: RequestId(r),
        name: name(n),
        attempt: None,
        now_ms: 0,
    }
}
/// A server abandons the request because the call with `attempt` went away.
fn server_abandon(s: u64, r: u64, n: &str, attempt: u64) -> Command {
    Command::AbandonAcquire {
        session: SessionId(s),
        request: RequestId(r),
        name: name(n),
        attempt: Some(attempt),
        now_ms: 0,
    }
}
pub(crate) fn expire(s: u64) -> Command {
    Command::ExpireSession {
        session: SessionId(s),
        now_ms: 0,
    }
}
pub(crate) fn close(s: u64) -> Command {
    Command::CloseSession {
        session: SessionId(s),
        now_ms: 0,
    }
}
pub(crate) fn opened(s: u64) -> Outcome {
    SessionOpened {
        session: SessionId(s),
        ttl_ms: DEFAULT_TTL_MS,
    }
}
pub(crate) fn granted(t: u64) -> Outcome {
    Granted {
        token: FencingToken(t),
    }
}
pub(crate) fn refused(r: Refusal) -> Outcome {
    Refused(r)
}

/// Each case: a name, and the commands applied at log indexes 1, 2, 3, ... with the outcome each must give.
fn spec_cases() -> Vec<(&'static str, Vec<(Command, Outcome)>)> {
    vec![
        (
            "grant a free lock; token is the log index",
            vec![(open(1), opened(1)), (acq(1, 1, "a", Try), granted(2))],
        ),
        (
            "try-acquire of a held lock names the holder",
            vec![
                (open(1), opened(1)),
                (open(2), opened(2)),
                (acq(1, 1, "a", Try), granted(3)),
                (
                    acq(2, 1, "a", Try),
                    refused(Refusal::Held {
                        holder: SessionId(1),
                        token: FencingToken(3),
                    }),
                ),
            ],
        ),
        (
            "waiters are granted in FIFO order with increasing tokens",
            vec![
                (open(1), opened(1)),
                (open(2), opened(2)),
                (open(3), opened(3)),
                (acq(1, 1, "a", Wait), granted(4)),
                (acq(3, 1, "a", Wait), Queued { position: 1 }),
                (acq(2, 1, "a", Wait), Queued { position: 2 }),
                (rel(1, 2, "a", 4), Released),
                (
                    acq(1, 3, "a", Try),
                    refused(Refusal::Held {
                        holder: SessionId(3),
                        token: FencingToken(7),
                    }),
                ),
                (rel(3, 2, "a", 7), Released),
                (
                    acq(1, 4, "a", Try),
                    refused(Refusal::Held {
                        holder: SessionId(2),
                        token: FencingToken(9),
                    }),
                ),
            ],
        ),
        (
            "release with a stale token changes nothing",
            vec![
                (open(1), opened(1)),
                (acq(1, 1, "a", Try), granted(2)),
                (
                    rel(1, 2, "a", 1),
                    refused(Refusal::StaleToken {
                        current: FencingToken(2),
                    }),
                ),
                (
                    acq(1, 3, "a", Try),
                    refused(Refusal::AlreadyHolder {
                        token: FencingToken(2),
                    }),
                ),
            ],
        ),
        (
            "releasing a lock you do not hold is refused",
            vec![
                (open(1), opened(1)),
                (open(2), opened(2)),
                (acq(1, 1, "a", Try), granted(3)),
                (rel(2, 1, "a", 3), refused(Refusal::NotHolder)),
                (rel(2, 2, "free", 3), refused(Refusal::NotHolder)),
            ],
        ),
        (
            "unknown sessions are refused everywhere",
            vec![
                (acq(9, 1, "a", Try), refused(Refusal::UnknownSession)),
                (rel(9, 1, "a", 1), refused(Refusal::UnknownSession)),
                (expire(9), refused(Refusal::UnknownSession)),
                (close(9), refused(Refusal::UnknownSession)),
                (cancel(9, 1, "a"), refused(Refusal::UnknownSession)),
            ],
        ),
        (
            "expiry releases every lock and wait of the session, granting the next waiters",
            vec![
                (open(1), opened(1)),
                (open(2), opened(2)),
                (acq(1, 1, "a", Try), granted(3)),
                (acq(1, 2, "b", Try), granted(4)),
                (acq(2, 1, "a", Wait), Queued { position: 1 }),
                (acq(2, 2, "c", Try), granted(6)),
                (acq(1, 3, "c", Wait), Queued { position: 1 }),
                (expire(1), SessionClosed { released: 2 }),
                (
                    acq(2, 3, "a", Try),
                    refused(Refusal::AlreadyHolder {
                        token: FencingToken(8),
                    }),
                ),
                (acq(1, 4, "b", Try), refused(Refusal::UnknownSession)),
                (rel(2, 4, "c", 6), Released),
            ],
        ),
        (
            "a retried request returns its first outcome",
            vec![
                (open(1), opened(1)),
                (open(1), opened(1)),
                (open(2), opened(3)),
                (acq(1, 7, "a", Try), granted(4)),
                (acq(1, 7, "a", Try), granted(4)),
                (acq(3, 1, "a", Wait), Queued { position: 1 }),
                (acq(3, 1, "a", Wait), Queued { position: 1 }),
                (rel(1, 8, "a", 4), Released),
                (rel(1, 8, "a", 4), Released),
                (acq(3, 1, "a", Wait), granted(8)),
            ],
        ),
        (
            "a cancelled wait leaves the queue; a cancel after the grant returns the grant",
            vec![
                (open(1), opened(1)),
                (open(2), opened(2)),
                (open(3), opened(3)),
                (acq(1, 1, "a", Try), granted(4)),
                (acq(2, 1, "a", Wait), Queued { position: 1 }),
                (acq(3, 1, "a", Wait), Queued { position: 2 }),
                (cancel(2, 1, "a"), Cancelled),
                (acq(2, 1, "a", Wait), Cancelled),
                (rel(1, 2, "a", 4), Released),
                (cancel(3, 1, "a"), granted(9)),
                (cancel(3, 5, "a"), refused(Refusal::NotWaiting)),
            ],
        ),
        (
            "an abandoned wait leaves the queue and its retry learns it was abandoned",
            vec![
                (open(1), opened(1)),
                (open(2), opened(2)),
                (open(3), opened(3)),
                (acq(1, 1, "a", Try), granted(4)),
                (acq(2, 1, "a", Wait), Queued { position: 1 }),
                (acq(3, 1, "a", Wait), Queued { position: 2 }),
                (abandon(2, 1, "a"), Abandoned),
                (acq(2, 1, "a", Wait), Abandoned),
                (rel(1, 2, "a", 4), Released),
                (
                    acq(1, 3, "a", Try),
                    refused(Refusal::Held {
                        holder: SessionId(3),
                        token: FencingToken(9),
                    }),
                ),
            ],
        ),
        (
            "an abandoned grant is released to the next waiter; a later abandon changes nothing",
            vec![
                (open(1), opened(1)),
                (open(2), opened(2)),
                (open(3), opened(3)),
                (acq(1, 1, "a", Try), granted(4)),
                (acq(2, 1, "a", Wait), Queued { position: 1 }),
                (acq(3, 1, "a", Wait), Queued { position: 2 }),
                (rel(1, 2, "a", 4), Released),
                (abandon(2, 1, "a"), Abandoned),
                (
                    acq(1, 3, "a", Try),
                    refused(Refusal::Held {
                        holder: SessionId(3),
                        token: FencingToken(8),
                    }),
                ),
                (abandon(2, 1, "a"), Abandoned),
                (rel(3, 2, "a", 8), Released),
                (acq(1, 4, "a", Try), granted(12)),
            ],
        ),
        (
            "an abandon that reaches the log before its acquire makes the acquire change nothing",
            vec![
                (open(1), opened(1)),
                (abandon(1, 7, "a"), Abandoned),
                (acq(1, 7, "a", Wait), Abandoned),
                (acq(1, 8, "a", Try), granted(4)),
                (abandon(1, 7, "a"), Abandoned),
                (
                    acq(1, 9, "a", Try),
                    refused(Refusal::AlreadyHolder {
                        token: FencingToken(4),
                    }),
                ),
                (abandon(9, 1, "a"), refused(Refusal::UnknownSession)),
            ],
        ),
        (
            "a server's abandon applies only while the wait or grant is its call's",
            vec![
                (open(1), opened(1)),
                (open(2), opened(2)),
                (acq(1, 1, "a", Try), granted(3)),
                (acq_attempt(2, 1, "a", Wait, 50), Queued { position: 1 }),
                // The call with attempt 50 went away, but a retry (attempt 51) took the wait over first.
                (acq_attempt(2, 1, "a", Wait, 51), Queued { position: 1 }),
                (server_abandon(2, 1, "a", 50), refused(Refusal::NotWaiting)),
                (rel(1, 2, "a", 3), Released),
                (server_abandon(2, 1, "a", 50), refused(Refusal::NotWaiting)),
                (
                    acq(1, 3, "a", Try),
                    refused(Refusal::Held {
                        holder: SessionId(2),
                        token: FencingToken(7),
                    }),
                ),
                // The grant now belongs to attempt 51; when that call goes away too, it is released.
                (server_abandon(2, 1, "a", 51), Abandoned),
                (acq(1, 4, "a", Try), granted(11)),
                // A server's abandon of a request that never reached the log changes nothing, and a
                // wrong name for a waiting request is refused.
                (server_abandon(2, 9, "a", 9), refused(Refusal::NotWaiting)),
                (acq(2, 9, "a", Wait), Queued { position: 1 }),
                (abandon(2, 9, "b"), refused(Refusal::NotWaiting)),
                (abandon(2, 9, "a"), Abandoned),
            ],
        ),
        (
            "TTL bounds",
            vec![
                (
                    Command::OpenSession {
                        nonce: 1,
                        ttl_ms: MIN_TTL_MS - 1,
                        now_ms: 0,
                    },
                    refused(Refusal::InvalidTtl {
                        ttl_ms: MIN_TTL_MS - 1,
                    }),
                ),
                (
                    Command::OpenSession {
                        nonce: 2,
                        ttl_ms: MAX_TTL_MS + 1,
                        now_ms: 0,
                    },
                    refused(Refusal::InvalidTtl {
                        ttl_ms: MAX_TTL_MS + 1,
                    }),
                ),
                (
                    Command::OpenSession {
                        nonce: 3,
                        ttl_ms: MAX_TTL_MS,
                        now_ms: 0,
                    },
                    SessionOpened {
                        session: SessionId(3),
                        ttl_ms: MAX_TTL_MS,
                    },
                ),
            ],
        ),
        (
            "close releases like expiry",
            vec![
                (open(1), opened(1)),
                (acq(1, 1, "a", Try), granted(2)),
                (close(1), SessionClosed { released: 1 }),
                (open(2), opened(4)),
                (acq(4, 1, "a", Try), granted(5)),
            ],
        ),
    ]
}

/// A snapshot written by format version 2 (before acquire attempts; `testdata/snapshot-v2.bin`, made by
/// the build of that time from three sessions: 1 holds `a` with 2 and 3 waiting, 2 holds `dir/b`) still
/// decodes, and its waits and grants answer only to the client's own abandon.
#[test]
fn a_version_2_snapshot_still_decodes() {
    let mut t = LockTable::decode_snapshot(include_bytes!("../testdata/snapshot-v2.bin")).unwrap();
    let a = t.describe(&name("a")).unwrap();
    assert_eq!(
        (a.holder.session, a.holder.token),
        (SessionId(1), FencingToken(4))
    );
    assert_eq!(&*a.holder.value, b"v");
    let waiters: Vec<u64> = a.waiters.iter().map(|w| w.session.0).collect();
    assert_eq!(waiters, [2, 3]);
    let b = t.describe(&name("dir/b")).unwrap();
    assert_eq!(
        (b.holder.session, b.holder.token),
        (SessionId(2), FencingToken(7))
    );
    assert_eq!(t.session_count(), 3);
    assert_eq!(
        t.apply(8, &server_abandon(2, 1, "a", 1)),
        refused(Refusal::NotWaiting)
    );
    assert_eq!(t.apply(9, &abandon(2, 1, "a")), Abandoned);
    assert_eq!(t.apply(10, &rel(1, 2, "a", 4)), Released);
    assert_eq!(
        t.describe(&name("a")).unwrap().holder.token,
        FencingToken(10)
    );
    t.check_invariants();
}

/// An acquire entry written before attempts existed (`testdata/command-acquire-before-attempts.bin`,
/// postcard as the log stores it) decodes as [`Command::AcquireBeforeAttempts`] and applies as attempt 0.
#[test]
fn an_acquire_logged_before_attempts_still_decodes_and_applies() {
    let c: Command = postcard::from_bytes(include_bytes!(
        "../testdata/command-acquire-before-attempts.bin"
    ))
    .unwrap();
    assert_eq!(
        c,
        Command::AcquireBeforeAttempts {
            session: SessionId(5),
            request: RequestId(9),
            name: name("jobs/x"),
            mode: Wait,
            value: b"val".to_vec().into(),
            now_ms: 1234,
        }
    );
    let mut t = LockTable::new();
    for n in 1..=5 {
        t.apply(n, &open(u128::from(n)));
    }
    assert_eq!(t.apply(6, &c), granted(6));
    assert_eq!(
        t.apply(7, &server_abandon(5, 9, "jobs/x", 1)),
        refused(Refusal::NotWaiting)
    );
}

#[test]
fn spec() {
    for (title, steps) in spec_cases() {
        let mut table = LockTable::new();
        for (i, (command, expected)) in steps.into_iter().enumerate() {
            let index = i as u64 + 1;
            let got = table.apply(index, &command);
            assert_eq!(got, expected, "case {title:?}, step {index}: {command:?}");
            table.check_invariants();
            table.take_events();
        }
        let restored = LockTable::decode_snapshot(&table.encode_snapshot()).unwrap();
        assert_eq!(
            restored.digest(),
            table.digest(),
            "case {title:?}: snapshot round trip"
        );
    }
}

#[test]
fn events_report_grants_and_ends() {
    let mut t = LockTable::new();
    for (i, c) in [open(1), open(2), acq(1, 1, "a", Try), acq(2, 1, "a", Wait)]
        .iter()
        .enumerate()
    {
        t.apply(i as u64 + 1, c);
    }
    t.take_events();
    t.apply(5, &expire(1));
    assert_eq!(
        t.take_events(),
        vec![
            Event::Granted {
                name: name("a"),
                session: SessionId(2),
                request: RequestId(1),
                token: FencingToken(5)
            },
            Event::SessionEnded {
                session: SessionId(1)
            },
        ]
    );
}

#[test]
fn limits_refuse_and_change_nothing() {
    let mut t = LockTable::new();
    t.apply(1, &open(1));
    let mut index = 2;
    for i in 0..MAX_LOCKS_PER_SESSION {
        assert!(matches!(
            t.apply(index, &acq(1, i as u64 + 1, &format!("l{i}"), Try)),
            Granted { .. }
        ));
        index += 1;
    }
    let digest = t.digest();
    let got = t.apply(index, &acq(1, 1_000_000, "one-more", Try));
    assert_eq!(got, refused(Refusal::LimitExceeded(Limit::LocksPerSession)));
    // The refusal is remembered for dedup but the lock set is unchanged.
    assert_eq!(t.lock_count(), MAX_LOCKS_PER_SESSION);
    assert!(t.describe(&name("one-more")).is_none());
    assert_ne!(digest, 0);

    let mut t = LockTable::new();
    t.apply(1, &open(0));
    t.apply(2, &acq(1, 1, "hot", Try));
    let mut index = 3;
    for s in 0..MAX_WAITERS_PER_LOCK as u128 {
        let SessionOpened { session, .. } = t.apply(index, &open(s + 10)) else {
            panic!()
        };
        index += 1;
        assert!(matches!(
            t.apply(index, &acq(session.0, 1, "hot", Wait)),
            Queued { .. }
        ));
        index += 1;
    }
    let SessionOpened { session, .. } = t.apply(index, &open(99_999)) else {
        panic!()
    };
    index += 1;
    assert_eq!(
        t.apply(index, &acq(session.0, 1, "hot", Wait)),
        refused(Refusal::LimitExceeded(Limit::WaitersPerLock))
    );
    assert_eq!(t.waiter_count(), MAX_WAITERS_PER_LOCK as u64);
    t.check_invariants();
}

#[test]
fn dedup_window_refuses_forgotten_requests() {
    let mut t = LockTable::new();
    t.apply(1, &open(1));
    let mut index = 2;
    for r in 1..=(DEDUP_WINDOW as u64 + 1) {
        t.apply(index, &acq(1, r, &format!("l{r}"), Try));
        index += 1;
    }
    // Request 1 fell out of the window: a retry must not acquire a second time.
    assert_eq!(
        t.apply(index, &acq(1, 1, "other", Try)),
        refused(Refusal::RequestIdTooOld)
    );
    assert_eq!(t.apply(index + 1, &acq(1, 2, "l2", Try)), granted(3));
}

#[test]
fn names_are_checked() {
    use crate::NameError;
    assert_eq!(LockName::new(""), Err(NameError::Empty));
    assert_eq!(
        LockName::new("x".repeat(MAX_NAME_BYTES + 1)),
        Err(NameError::TooLong {
            len: MAX_NAME_BYTES + 1
        })
    );
    assert!(LockName::new("x".repeat(MAX_NAME_BYTES)).is_ok());
    assert_eq!(
        LockName::new("a\nb"),
        Err(NameError::ControlCharacter { at: 1 })
    );
    assert_eq!(LockName::new(" a"), Err(NameError::OuterWhitespace));
    assert!(LockName::new("jobs/nightly report/éé").is_ok());
}

#[test]
fn group_hash_is_stable() {
    // These values are part of the client contract; changing them moves every lock.
    assert_eq!(crate::name::fnv1a64(b""), 0xcbf2_9ce4_8422_2325);
    assert_eq!(crate::name::fnv1a64(b"a"), 0xaf63_dc4c_8601_ec8c);
    assert_eq!(crate::group_for("a", 1).0, 0);
    assert_eq!(
        crate::group_for("a", 7).0,
        (0xaf63_dc4c_8601_ec8cu64 % 7) as u32
    );
}

#[test]
fn corrupt_snapshots_are_refused() {
    let mut t = LockTable::new();
    t.apply(1, &open(1));
    t.apply(2, &acq(1, 1, "a", Try));
    let bytes = t.encode_snapshot();
    for i in 0..bytes.len() {
        let mut bad = bytes.clone();
        bad[i] ^= 0x40;
        assert!(
            LockTable::decode_snapshot(&bad).is_err(),
            "flipped byte {i} went unnoticed"
        );
    }
    for len in 0..bytes.len() {
        assert!(LockTable::decode_snapshot(&bytes[..len]).is_err());
    }
}

// ---- property test against a reference model ----

/// The model: who holds each lock, with token, and each lock's queue; sessions are a set.
#[derive(Default, Clone)]
struct Model {
    sessions: std::collections::BTreeSet<u64>,
    holders: std::collections::BTreeMap<String, (u64, u64, u64)>, // name -> (session, token, request)
    queues: std::collections::BTreeMap<String, Vec<(u64, u64)>>,  // name -> [(session, request)]
    last_token: std::collections::BTreeMap<String, u64>,
    /// (session, request) -> the attempt of the call that last reported on its wait or grant.
    attempts: std::collections::BTreeMap<(u64, u64), u64>,
    /// (session, request) of acquires that asked for a lock-delay.
    delayed: std::collections::BTreeSet<(u64, u64)>,
}

impl Model {
    /// A session ends; if it `expired`, its grants that asked for a lock-delay stay held by nobody
    /// (session 0) until the delay ends.
    fn end(&mut self, s: u64, index: u64, expired: bool) {
        self.sessions.remove(&s);
        for q in self.queues.values_mut() {
            q.retain(|(ws, _)| *ws != s);
        }
        let held: Vec<String> = self
            .holders
            .iter()
            .filter(|(_, h)| h.0 == s)
            .map(|(n, _)| n.clone())
            .collect();
        for n in held {
            let (_, token, request) = self.holders[&n];
            if expired && self.delayed.contains(&(s, request)) {
                self.holders.insert(n, (0, token, 0));
            } else {
                self.hand_over(&n, index);
            }
        }
    }
    fn hand_over(&mut self, n: &str, index: u64) {
        self.holders.remove(n);
        let q = self.queues.entry(n.to_string()).or_default();
        if !q.is_empty() {
            let (ws, wr) = q.remove(0);
            self.holders.insert(n.to_string(), (ws, index, wr));
        }
    }
}

/// What a watcher of every lock knows, built from [`crate::Change`]s alone:
/// name -> (holder session, token, waiting sessions in queue order).
#[derive(Default)]
struct Watched {
    locks: std::collections::BTreeMap<String, (u64, u64, Vec<u64>)>,
    /// Locks in their lock-delay (held by nobody, not free).
    delayed: std::collections::BTreeSet<String>,
}

impl Watched {
    /// Applies one change, checking it is consistent with what came before (`expiring`: the entry
    /// expires a session, so its holders' locks are `Expired`, never `Released`).
    fn apply(&mut self, c: &crate::Change, expiring: bool) {
        use crate::ChangeKind::*;
        let name = c.name.as_str().to_string();
        let s = c.session.0;
        match c.kind {
            Granted => {
                let token = c.token.expect("a grant has a token").0;
                match self.locks.get_mut(&name) {
                    // The first waiter, after its holder left.
                    Some(lock) => {
                        assert_eq!(lock.0, 0, "granted {name} while held");
                        assert_eq!(
                            lock.2.first(),
                            Some(&s),
                            "granted {name} out of queue order"
                        );
                        lock.2.remove(0);
                        lock.0 = s;
                        lock.1 = token;
                    }
                    None => {
                        self.locks.insert(name, (s, token, Vec::new()));
                    }
                }
            }
            Delayed => {
                let token = c.token.expect("a delay names the expired grant").0;
                let lock = self
                    .locks
                    .entry(name.clone())
                    .or_insert((0, token, Vec::new()));
                assert_eq!(lock.0, 0, "delayed while held");
                lock.1 = token;
                self.delayed.insert(name);
            }
            DelayEnded => {
                assert!(self.delayed.remove(&name), "ended a delay not under way");
                let lock = self.locks.get_mut(&name).expect("a delay ended on no lock");
                assert_eq!(
                    (lock.0, lock.1),
                    (0, c.token.unwrap().0),
                    "ended another delay"
                );
                if lock.2.is_empty() {
                    self.locks.remove(&name);
                }
            }
            Released | Expired => {
                assert_eq!(c.kind == Expired, expiring, "{:?} of {name}", c.kind);
                let lock = self.locks.get_mut(&name).expect("released a lock not held");
                assert_eq!(
                    (lock.0, lock.1),
                    (s, c.token.expect("a release has a token").0)
                );
                lock.0 = 0;
                if lock.2.is_empty() {
                    self.locks.remove(&name);
                }
            }
            Queued => {
                assert!(c.token.is_none());
                self.locks
                    .get_mut(&name)
                    .expect("queued behind nobody")
                    .2
                    .push(s);
            }
            Cancelled => {
                let lock = self
                    .locks
                    .get_mut(&name)
                    .expect("cancelled a wait on no lock");
                let before = lock.2.len();
                lock.2.retain(|w| *w != s);
                assert_eq!(
                    before,
                    lock.2.len() + 1,
                    "cancelled a wait that was not queued"
                );
                if lock.0 == 0 && lock.2.is_empty() && !self.delayed.contains(&name) {
                    self.locks.remove(&name);
                }
            }
        }
    }
}

/// The table as [`Watched`] describes it.
fn watched_view(table: &LockTable) -> std::collections::BTreeMap<String, (u64, u64, Vec<u64>)> {
    table
        .list_locks("", None, usize::MAX)
        .into_iter()
        .map(|v| {
            let waiters = v.waiters.iter().map(|w| w.session.0).collect();
            (
                v.name.as_str().to_string(),
                (v.holder.session.0, v.holder.token.0, waiters),
            )
        })
        .collect()
}

#[derive(Debug, Clone)]
enum Op {
    Open,
    Close(usize),
    Expire(usize),
    Acquire(usize, usize, bool),
    Release(usize, usize, bool),
    Cancel(usize, usize),
    /// Abandon the acquire of session `.0` for lock `.1`: its wait, its grant, or (`.2`) a fresh id.
    Abandon(usize, usize, bool),
    /// A server abandons the wait or grant of session `.0` on lock `.1`, for its current call or (`.2`)
    /// for an older one.
    ServerAbandon(usize, usize, bool),
    /// A new call retries the waiting or granted request of session `.0` on lock `.1`.
    Reattach(usize, usize),
    /// A waiting acquire with a lock-delay.
    AcquireDelayed(usize, usize),
    /// The leader ends the lock-delay of lock `.0` (or, `.1`, proposes it with a wrong token).
    EndDelay(usize, bool),
    Retry,
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        1 => Just(Op::Open),
        1 => (0..6usize).prop_map(Op::Close),
        1 => (0..6usize).prop_map(Op::Expire),
        6 => (0..6usize, 0..4usize, any::<bool>()).prop_map(|(s, n, w)| Op::Acquire(s, n, w)),
        4 => (0..6usize, 0..4usize, any::<bool>()).prop_map(|(s, n, stale)| Op::Release(s, n, stale)),
        1 => (0..6usize, 0..4usize).prop_map(|(s, n)| Op::Cancel(s, n)),
        1 => (0..6usize, 0..4usize, any::<bool>()).prop_map(|(s, n, fresh)| Op::Abandon(s, n, fresh)),
        1 => (0..6usize, 0..4usize, any::<bool>()).prop_map(|(s, n, stale)| Op::ServerAbandon(s, n, stale)),
        1 => (0..6usize, 0..4usize).prop_map(|(s, n)| Op::Reattach(s, n)),
        2 => (0..6usize, 0..4usize).prop_map(|(s, n)| Op::AcquireDelayed(s, n)),
        2 => (0..4usize, any::<bool>()).prop_map(|(n, wrong)| Op::EndDelay(n, wrong)),
        2 => Just(Op::Retry),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]
    #[test]
    fn table_matches_model(
        ops in proptest::collection::vec(op(), 1..120),
        snapshot_every in 2..12u64,
        snapshot_chunk in 1..4usize,
    ) {
        let names = ["a", "b", "c", "dir/d"];
        let mut table = LockTable::new();
        // A snapshot written a chunk per entry while entries keep being applied (as a server writes
        // them), with the bytes `encode_snapshot` gave when it started.
        let mut snapshot: Option<(crate::SnapshotWriter, Vec<u8>, Vec<u8>)> = None;
        let mut model = Model::default();
        let mut opened: Vec<u64> = Vec::new();
        let mut next_request = 1u64;
        let mut last: Option<(Command, Outcome)> = None;
        let mut tokens_seen: std::collections::BTreeMap<String, u64> = Default::default();
        let mut watched = Watched::default();
        for (i, op) in ops.into_iter().enumerate() {
            let index = i as u64 + 1;
            let sess = |k: usize| opened.get(k % opened.len().max(1)).copied().unwrap_or(999);
            let command = match op {
                // Two sessions in three belong to one of two principals with quotas they never reach
                // (and every acquire is held to one), so the per-principal counts run through every
                // path, locks passing between principals included (check_invariants recounts them).
                Op::Open if index.is_multiple_of(3) => in_quota("p", BIG, open(index as u128)),
                Op::Open if index % 3 == 1 => in_quota("q", BIG, open(index as u128)),
                Op::Open => open(index as u128),
                Op::Close(k) => close(sess(k)),
                Op::Expire(k) => expire(sess(k)),
                Op::Acquire(k, n, wait) => { next_request += 1; in_quota("p", BIG, acq(sess(k), next_request, names[n], if wait { Wait } else { Try })) }
                Op::Release(k, n, stale) => {
                    next_request += 1;
                    let token = model.holders.get(names[n]).map_or(1, |h| h.1) - u64::from(stale);
                    rel(sess(k), next_request, names[n], token)
                }
                Op::Cancel(k, n) => {
                    let s = sess(k);
                    let r = model.queues.get(names[n]).and_then(|q| q.iter().find(|w| w.0 == s)).map_or(1, |w| w.1);
                    cancel(s, r, names[n])
                }
                Op::Abandon(k, n, fresh) => {
                    let s = sess(k);
                    let waiting = model.queues.get(names[n]).and_then(|q| q.iter().find(|w| w.0 == s)).map(|w| w.1);
                    let holding = model.holders.get(names[n]).filter(|h| h.0 == s).map(|h| h.2);
                    let r = match (fresh, waiting.or(holding)) {
                        (false, Some(r)) => r,
                        _ => { next_request += 1; next_request }
                    };
                    abandon(s, r, names[n])
                }
                Op::ServerAbandon(k, n, stale) => {
                    let s = sess(k);
                    let active = model.queues.get(names[n]).and_then(|q| q.iter().find(|w| w.0 == s)).map(|w| w.1)
                        .or_else(|| model.holders.get(names[n]).filter(|h| h.0 == s).map(|h| h.2));
                    let Some(r) = active else { continue };
                    let current = model.attempts[&(s, r)];
                    server_abandon(s, r, names[n], if stale { current + 7 } else { current })
                }
                Op::Reattach(k, n) => {
                    let s = sess(k);
                    let active = model.queues.get(names[n]).and_then(|q| q.iter().find(|w| w.0 == s)).map(|w| w.1)
                        .or_else(|| model.holders.get(names[n]).filter(|h| h.0 == s).map(|h| h.2));
                    let Some(r) = active else { continue };
                    next_request += 1;
                    acq_attempt(s, r, names[n], Wait, 1_000_000 + next_request)
                }
                Op::AcquireDelayed(k, n) => {
                    next_request += 1;
                    Command::WithLockDelay {
                        lock_delay_ms: 1_000,
                        command: Box::new(in_quota("p", BIG, acq(sess(k), next_request, names[n], Wait))),
                    }
                }
                Op::EndDelay(n, wrong) => {
                    let token = model.holders.get(names[n]).map_or(1, |h| h.1) + u64::from(wrong);
                    Command::EndLockDelay { name: name(names[n]), token: FencingToken(token), now_ms: 0 }
                }
                Op::Retry => match &last { Some((c, _)) => c.clone(), None => continue },
            };
            if let Command::WithLockDelay { command: inner, .. } = &command {
                if let Command::Acquire { session, request, .. } = inner.effective() {
                    model.delayed.insert((session.0, request.0));
                }
            }
            let got = table.apply(index, &command);
            table.take_events();
            table.check_invariants();
            if snapshot.is_none() && index.is_multiple_of(snapshot_every) {
                let expected = table.encode_snapshot();
                let mut out = Vec::new();
                let writer = table.snapshot_begin(&mut out);
                snapshot = Some((writer, out, expected));
            } else if let Some((writer, out, expected)) = snapshot.as_mut() {
                if table.snapshot_next(writer, out, snapshot_chunk).unwrap() {
                    prop_assert_eq!(&*out, &*expected, "snapshot written while applying differs");
                    snapshot = None;
                }
            }
            // A watcher that saw only the changes knows every lock's holder and queue.
            for change in table.take_changes() {
                watched.apply(&change, matches!(command.effective(), Command::ExpireSession { .. }));
            }
            prop_assert_eq!(&watched.locks, &watched_view(&table), "after {:?}", command);
            // Retrying an acquire, release or open returns the first outcome, unless the state moved on
            // (a queued acquire that was granted or cancelled meanwhile reports that).
            if let (Op::Retry, Some((_, first))) = (&op, &last) {
                match (command.effective(), first, &got) {
                    (Command::Acquire { .. }, Queued { .. }, Granted { .. } | Cancelled | Abandoned) => {}
                    (Command::Acquire { .. }, Granted { .. }, Abandoned) => {}
                    (Command::CloseSession { .. } | Command::ExpireSession { .. } | Command::CancelWait { .. } | Command::AbandonAcquire { .. } | Command::EndLockDelay { .. }, _, _) => {}
                    (Command::Acquire { .. }, Queued { .. }, Queued { .. }) => {}
                    _ => prop_assert_eq!(first, &got, "retry of {:?}", command),
                }
                last = None;
                // The model ignores retries of deduplicated requests; ends and cancels are recomputed.
                if !matches!(command.effective(), Command::CloseSession { .. } | Command::ExpireSession { .. } | Command::CancelWait { .. } | Command::AbandonAcquire { .. } | Command::EndLockDelay { .. }) {
                    continue;
                }
            }
            // Step the model.
            match command.effective() {
                Command::OpenSession { .. } => {
                    if let SessionOpened { session, .. } = got { if !opened.contains(&session.0) { opened.push(session.0); model.sessions.insert(session.0); } }
                }
                Command::CloseSession { session, .. } | Command::ExpireSession { session, .. } => {
                    let live = model.sessions.contains(&session.0);
                    prop_assert_eq!(live, matches!(got, SessionClosed { .. }));
                    let expired = matches!(command.effective(), Command::ExpireSession { .. });
                    if live { model.end(session.0, index, expired); }
                }
                // Checked against one expiry an entry in `expiry_tests`; not generated here.
                Command::ExpireSessions { .. } => prop_assert!(false, "not generated"),
                Command::EndLockDelay { name: n, token, .. } => {
                    let n = n.as_str();
                    match model.holders.get(n).copied() {
                        Some((0, t, _)) if t == token.0 => { prop_assert_eq!(&got, &Released); model.hand_over(n, index); }
                        _ => prop_assert_eq!(&got, &refused(Refusal::NotHolder)),
                    }
                }
                Command::Acquire { session, request, name, attempt, .. } if matches!(op, Op::Reattach(..)) => {
                    let (s, n) = (session.0, name.as_str());
                    match model.holders.get(n) {
                        Some(h) if h.0 == s && h.2 == request.0 => prop_assert_eq!(&got, &granted(h.1)),
                        _ => {
                            let pos = model.queues[n].iter().position(|w| *w == (s, request.0)).unwrap();
                            prop_assert_eq!(&got, &Queued { position: pos as u32 + 1 });
                        }
                    }
                    model.attempts.insert((s, request.0), *attempt);
                }
                Command::Acquire { session, request, name, mode, attempt, .. } => {
                    let s = session.0;
                    let n = name.as_str().to_string();
                    model.attempts.insert((s, request.0), *attempt);
                    if !model.sessions.contains(&s) {
                        prop_assert_eq!(&got, &refused(Refusal::UnknownSession));
                    } else {
                        match model.holders.get(&n).copied() {
                            None => { prop_assert_eq!(&got, &granted(index)); model.holders.insert(n.clone(), (s, index, request.0)); }
                            Some((hs, ht, _)) if hs == s => prop_assert_eq!(&got, &refused(Refusal::AlreadyHolder { token: FencingToken(ht) })),
                            Some(_) if model.queues.get(&n).is_some_and(|q| q.iter().any(|w| w.0 == s)) => prop_assert_eq!(&got, &refused(Refusal::AlreadyWaiting)),
                            Some((hs, ht, _)) if *mode == Try => prop_assert_eq!(&got, &refused(Refusal::Held { holder: SessionId(hs), token: FencingToken(ht) })),
                            Some(_) => {
                                let q = model.queues.entry(n.clone()).or_default();
                                q.push((s, request.0));
                                prop_assert_eq!(&got, &Queued { position: q.len() as u32 });
                            }
                        }
                    }
                }
                Command::Release { session, name, token, .. } => {
                    let s = session.0;
                    let n = name.as_str();
                    if !model.sessions.contains(&s) {
                        prop_assert_eq!(&got, &refused(Refusal::UnknownSession));
                    } else {
                        match model.holders.get(n).copied() {
                            Some((hs, ht, _)) if hs == s && ht == token.0 => { prop_assert_eq!(&got, &Released); model.hand_over(n, index); }
                            Some((hs, ht, _)) if hs == s => prop_assert_eq!(&got, &refused(Refusal::StaleToken { current: FencingToken(ht) })),
                            _ => prop_assert_eq!(&got, &refused(Refusal::NotHolder)),
                        }
                    }
                }
                Command::CancelWait { session, request, name, .. } => {
                    let s = session.0;
                    let n = name.as_str();
                    if !model.sessions.contains(&s) {
                        prop_assert_eq!(&got, &refused(Refusal::UnknownSession));
                    } else if let Some(pos) = model.queues.get(n).and_then(|q| q.iter().position(|w| *w == (s, request.0))) {
                        prop_assert_eq!(&got, &Cancelled);
                        model.queues.get_mut(n).unwrap().remove(pos);
                    } else if let Some((hs, ht, hr)) = model.holders.get(n).copied().filter(|h| h.0 == s && h.2 == request.0) {
                        let _ = (hs, hr);
                        prop_assert_eq!(&got, &granted(ht));
                    } else {
                        prop_assert_eq!(&got, &refused(Refusal::NotWaiting));
                    }
                }
                Command::AbandonAcquire { session, request, name, attempt: Some(a), .. } => {
                    let (s, n) = (session.0, name.as_str());
                    let waiting = model.queues.get(n).and_then(|q| q.iter().position(|w| *w == (s, request.0)));
                    let holding = model.holders.get(n).is_some_and(|h| h.0 == s && h.2 == request.0);
                    if !model.sessions.contains(&s) {
                        prop_assert_eq!(&got, &refused(Refusal::UnknownSession));
                    } else if !(waiting.is_some() || holding) {
                        // A retry of an abandon that was applied: it changes nothing.
                        prop_assert!(matches!(got, Abandoned | Refused(Refusal::NotWaiting)), "{:?}", got);
                    } else if model.attempts.get(&(s, request.0)) != Some(a) {
                        prop_assert_eq!(&got, &refused(Refusal::NotWaiting));
                    } else {
                        prop_assert_eq!(&got, &Abandoned);
                        match waiting {
                            Some(pos) => { model.queues.get_mut(n).unwrap().remove(pos); }
                            None => model.hand_over(n, index),
                        }
                    }
                }
                Command::AcquireBeforeAttempts { .. } => unreachable!("the property test always proposes attempts"),
                Command::EndLockDelayAt { .. } => unreachable!("exclusive delays end by token"),
                Command::SetTableBudget { .. } => unreachable!("the property test sets no budget"),
                Command::AbandonAcquire { session, request, name, attempt: None, .. } => {
                    let s = session.0;
                    let n = name.as_str();
                    if !model.sessions.contains(&s) {
                        prop_assert_eq!(&got, &refused(Refusal::UnknownSession));
                    } else {
                        prop_assert_eq!(&got, &Abandoned);
                        if let Some(pos) = model.queues.get(n).and_then(|q| q.iter().position(|w| *w == (s, request.0))) {
                            model.queues.get_mut(n).unwrap().remove(pos);
                        } else if model.holders.get(n).is_some_and(|h| h.0 == s && h.2 == request.0) {
                            model.hand_over(n, index);
                        }
                    }
                }
                Command::OpenSessionWithSecret { .. } | Command::Authorized { .. } | Command::Quota { .. } | Command::WithLockDelay { .. } | Command::WithShare { .. } => {
                    unreachable!("effective() unwraps these")
                }
            }
            last = Some((command, got));
            // Mutual exclusion and token monotonicity, checked against the table's own view.
            for n in names {
                let view = table.describe(&name(n));
                let m = model.holders.get(n);
                prop_assert_eq!(view.as_ref().map(|v| (v.holder.session.0, v.holder.token.0)), m.map(|h| (h.0, h.1)));
                if let Some(v) = view {
                    let prev = tokens_seen.insert(n.to_string(), v.holder.token.0).unwrap_or(0);
                    prop_assert!(v.holder.token.0 >= prev, "token for {} went backwards", n);
                    let waiters: Vec<u64> = v.waiters.iter().map(|w| w.session.0).collect();
                    let mq: Vec<u64> = model.queues.get(n).map(|q| q.iter().map(|w| w.0).collect()).unwrap_or_default();
                    prop_assert_eq!(waiters, mq, "FIFO order of {}", n);
                }
            }
            let _ = &model.last_token;
            let restored = LockTable::decode_snapshot(&table.encode_snapshot()).unwrap();
            prop_assert_eq!(restored.digest(), table.digest());
        }
    }
}

fn open_secret(nonce: u128, secret: u128) -> Command {
    Command::OpenSessionWithSecret {
        nonce,
        ttl_ms: DEFAULT_TTL_MS,
        secret,
        now_ms: 0,
    }
}
fn auth(secret: u128, command: Command) -> Command {
    Command::Authorized {
        secret,
        command: Box::new(command),
    }
}

/// Every session-scoped command with a wrong secret (or none) is refused and changes nothing: not the
/// locks, not the waits, not the session's deduplication window (so a third party cannot use request
/// ids to lock the owner out either).
#[test]
fn a_wrong_secret_is_refused_and_changes_nothing() {
    let mut t = LockTable::new();
    assert_eq!(t.apply(1, &open_secret(1, 0xA)), opened(1));
    assert_eq!(t.apply(2, &open_secret(2, 0xB)), opened(2));
    assert_eq!(t.session_secret(SessionId(1)), Some(0xA));
    assert_eq!(t.apply(3, &auth(0xA, acq(1, 1, "x", Try))), granted(3));
    assert!(matches!(
        t.apply(4, &auth(0xB, acq(2, 1, "x", Wait))),
        Queued { .. }
    ));
    let before = t.digest();
    let attacks = [
        close(1),
        acq(1, 2, "y", Try),
        acq_attempt(1, u64::MAX, "y", Try, 1),
        rel(1, 3, "x", 3),
        cancel(2, 1, "x"),
        abandon(2, 1, "x"),
        server_abandon(2, 1, "x", 1001),
    ];
    for (i, command) in attacks.iter().enumerate() {
        for secret in [0, 0xC, 0xB ^ 0xA] {
            assert_eq!(
                t.apply(10 + i as u64, &auth(secret, command.clone())),
                refused(Refusal::PermissionDenied),
                "{command:?} with secret {secret:#x}"
            );
        }
    }
    // Commands that do not act on a session are never authorized ones.
    assert_eq!(
        t.apply(20, &auth(0xA, expire(1))),
        refused(Refusal::PermissionDenied)
    );
    assert_eq!(t.digest(), before, "nothing changed");
    // The owners still can.
    assert_eq!(t.apply(21, &auth(0xA, rel(1, 2, "x", 3))), Released);
    assert_eq!(t.describe(&name("x")).unwrap().holder.session, SessionId(2));
    assert_eq!(
        t.apply(22, &auth(0xB, close(2))),
        SessionClosed { released: 1 }
    );
    t.check_invariants();
}

/// The lock-out sequence: request ids near `u64::MAX` used to push a session's window so high that every
/// later request was REQUEST_ID_TOO_OLD. An id more than MAX_REQUEST_ID_AHEAD above the highest is now
/// refused and remembered nowhere, and the next ids work.
#[test]
fn request_ids_far_ahead_are_refused_without_locking_the_session_out() {
    let mut t = LockTable::new();
    assert_eq!(t.apply(1, &open_secret(1, 7)), opened(1));
    let mut index = 2;
    for r in [u64::MAX, u64::MAX - 1, MAX_REQUEST_ID_AHEAD + 1] {
        for _ in 0..(DEDUP_WINDOW + 2) {
            assert_eq!(
                t.apply(index, &auth(7, acq_attempt(1, r, "far", Try, 1))),
                refused(Refusal::RequestIdTooNew { highest: 0 })
            );
            index += 1;
        }
    }
    assert_eq!(
        t.apply(index, &auth(7, acq(1, 1, "a", Try))),
        granted(index)
    );
    index += 1;
    // Within the gap is fine, and from there the next gap opens.
    let far = 1 + MAX_REQUEST_ID_AHEAD;
    assert_eq!(
        t.apply(index, &auth(7, acq_attempt(1, far, "b", Try, 1))),
        granted(index)
    );
    index += 1;
    assert_eq!(
        t.apply(
            index,
            &auth(
                7,
                acq_attempt(1, far + 2 * MAX_REQUEST_ID_AHEAD, "c", Try, 1)
            )
        ),
        refused(Refusal::RequestIdTooNew { highest: far })
    );
    index += 1;
    for r in far + 1..far + 1 + 2 * DEDUP_WINDOW as u64 {
        assert!(matches!(
            t.apply(index, &auth(7, rel(1, r, "zzz", 1))),
            Refused(Refusal::NotHolder)
        ));
        index += 1;
    }
    t.check_invariants();
}

/// A retried open returns the session with the secret of its first open, not the retry's.
#[test]
fn a_retried_open_keeps_the_first_secret() {
    let mut t = LockTable::new();
    assert_eq!(t.apply(1, &open_secret(9, 0x1111)), opened(1));
    assert_eq!(t.apply(2, &open_secret(9, 0x2222)), opened(1));
    assert_eq!(t.session_secret(SessionId(1)), Some(0x1111));
    assert_eq!(
        t.apply(3, &auth(0x2222, close(1))),
        refused(Refusal::PermissionDenied)
    );
    assert_eq!(
        t.apply(4, &auth(0x1111, close(1))),
        SessionClosed { released: 0 }
    );
}

/// Sessions opened without a secret (by Holdfast 0.1, or `Command::OpenSession`) have secret 0, and a
/// version 3 snapshot (`testdata/snapshot-v3.bin`, made by the build before secrets: session 1 holds `a`
/// with 2 waiting, 2 holds `dir/b`) decodes with every session at secret 0.
#[test]
fn a_version_3_snapshot_decodes_with_sessions_without_secrets() {
    let mut t = LockTable::decode_snapshot(include_bytes!("../testdata/snapshot-v3.bin")).unwrap();
    t.check_invariants();
    assert_eq!(t.session_secret(SessionId(1)), Some(0));
    assert_eq!(t.session_secret(SessionId(2)), Some(0));
    let a = t.describe(&name("a")).unwrap();
    assert_eq!(
        (a.holder.session, a.holder.token),
        (SessionId(1), FencingToken(3))
    );
    assert_eq!(a.waiters.len(), 1);
    // The dedup window came along: a retry of session 2's wait is still queued.
    assert!(matches!(
        t.apply(6, &acq(2, 1, "a", Wait)),
        Queued { position: 1 }
    ));
    // The retry took the wait over, so an abandon by another call changes nothing.
    assert_eq!(
        t.apply(7, &server_abandon(2, 1, "a", 6001)),
        refused(Refusal::NotWaiting)
    );
    assert_eq!(t.apply(8, &auth(0, rel(1, 2, "a", 3))), Released);
    assert_eq!(
        t.apply(9, &auth(5, close(2))),
        refused(Refusal::PermissionDenied)
    );
    assert_eq!(
        t.apply(10, &auth(0, close(2))),
        SessionClosed { released: 2 }
    );
    let again = LockTable::decode_snapshot(&t.encode_snapshot()).unwrap();
    assert_eq!(again.digest(), t.digest());
}

#[test]
fn audit_lines_show_what_a_command_does_without_its_secret() {
    assert_eq!(open_secret(5, 77).without_secrets(), open(5));
    assert_eq!(auth(77, close(3)).without_secrets(), close(3));
    assert_eq!(rel(1, 2, "x", 3).without_secrets(), rel(1, 2, "x", 3));
}

const BIG: QuotaLimits = QuotaLimits {
    sessions: u64::MAX,
    locks: u64::MAX,
    waiting: u64::MAX,
};

fn in_quota(principal: &str, quota: QuotaLimits, command: Command) -> Command {
    Command::Quota {
        principal: principal.into(),
        quota,
        command: Box::new(command),
    }
}

fn quota_exceeded(quota: crate::QuotaKind, value: u64) -> Outcome {
    refused(Refusal::QuotaExceeded { quota, value })
}

/// A principal's sessions, locks (held and waited for together) and waits are bounded by the quota its
/// commands carry; a retry gets its first outcome whatever the count is now; other principals and
/// sessions without an owner are not counted; ending a session gives its share back.
#[test]
fn quotas_bound_what_a_principal_opens_holds_and_waits_for() {
    use crate::QuotaKind::{Locks, Sessions, Waiting};
    let q = QuotaLimits {
        sessions: 2,
        locks: 3,
        waiting: 1,
    };
    let mut t = LockTable::new();
    let a = |c| in_quota("alice", q, auth(0, c));
    assert_eq!(t.apply(1, &in_quota("alice", q, open(1))), opened(1));
    assert_eq!(t.apply(2, &in_quota("alice", q, open(2))), opened(2));
    assert_eq!(
        t.apply(3, &in_quota("alice", q, open(3))),
        quota_exceeded(Sessions, 2)
    );
    // A retried open is its session, not a third one; but not to another principal.
    assert_eq!(t.apply(4, &in_quota("alice", q, open(2))), opened(2));
    assert_eq!(
        t.apply(4, &in_quota("bob", q, open(2))),
        refused(Refusal::PermissionDenied)
    );
    assert_eq!(t.apply(5, &in_quota("bob", q, open(5))), opened(5));
    assert_eq!(t.apply(6, &open(6)), opened(6));
    assert_eq!(t.usage("alice").sessions, 2);

    // Locks: 3 across both of alice's sessions, waits included.
    assert!(matches!(
        t.apply(7, &a(acq(1, 1, "x", Wait))),
        Granted { .. }
    ));
    assert!(matches!(
        t.apply(8, &a(acq(2, 1, "y", Wait))),
        Granted { .. }
    ));
    assert!(matches!(
        t.apply(9, &auth(0, acq(5, 1, "z", Wait))),
        Granted { .. }
    ));
    assert!(matches!(
        t.apply(10, &a(acq(1, 2, "z", Wait))),
        Queued { .. }
    ));
    assert_eq!(
        t.usage("alice"),
        crate::table::Usage {
            sessions: 2,
            held: 2,
            waiting: 1
        }
    );
    assert_eq!(
        t.apply(11, &a(acq(2, 2, "w", Wait))),
        quota_exceeded(Locks, 3)
    );
    // Remembered: the same request is refused the same way even once there is room.
    // A try that would be refused anyway, and a lock the session holds, get their own outcomes.
    assert!(matches!(
        t.apply(12, &a(acq(2, 3, "z", Try))),
        Outcome::Refused(Refusal::Held { .. })
    ));
    assert!(matches!(
        t.apply(13, &a(acq(1, 4, "x", Wait))),
        Outcome::Refused(Refusal::AlreadyHolder { .. })
    ));
    // A retry of the queued request is still queued.
    assert!(matches!(
        t.apply(14, &a(acq(1, 2, "z", Wait))),
        Queued { .. }
    ));

    // Waits: one. Free a lock so that the lock count is not what refuses.
    assert_eq!(t.apply(15, &a(rel(2, 5, "y", 8))), Released);
    assert_eq!(
        t.apply(16, &a(acq(2, 6, "z", Wait))),
        quota_exceeded(Waiting, 1)
    );
    assert_eq!(
        t.apply(17, &a(acq(2, 2, "w", Wait))),
        quota_exceeded(Locks, 3),
        "remembered"
    );
    assert!(matches!(
        t.apply(18, &a(acq(2, 7, "v", Wait))),
        Granted { .. }
    ));

    // Bob's lock counts for bob, not alice.
    assert_eq!(
        t.usage("bob"),
        crate::table::Usage {
            sessions: 1,
            held: 1,
            waiting: 0
        }
    );
    // Session 5 releases z: alice's wait becomes a hold (one lock either way).
    assert_eq!(t.apply(19, &auth(0, rel(5, 2, "z", 9))), Released);
    assert_eq!(
        t.usage("alice"),
        crate::table::Usage {
            sessions: 2,
            held: 3,
            waiting: 0
        }
    );
    assert_eq!(
        t.usage("bob"),
        crate::table::Usage {
            sessions: 1,
            held: 0,
            waiting: 0
        }
    );
    t.check_invariants();
    // Ending a session gives its share back, and a snapshot keeps the owners.
    assert_eq!(
        t.apply(20, &auth(0, close(1))),
        SessionClosed { released: 2 }
    );
    assert_eq!(
        t.usage("alice"),
        crate::table::Usage {
            sessions: 1,
            held: 1,
            waiting: 0
        }
    );
    assert_eq!(t.apply(21, &in_quota("alice", q, open(21))), opened(21));
    let restored = LockTable::decode_snapshot(&t.encode_snapshot()).unwrap();
    assert_eq!(restored.usage("alice"), t.usage("alice"));
    assert_eq!(restored.digest(), t.digest());
    t.check_invariants();
}

/// An audit line shows a quota'd acquire without its secret; replayed, it is held to the same quota.
#[test]
fn a_quota_holds_without_the_secret_wrapper_as_audit_lines_show_it() {
    let q = QuotaLimits {
        sessions: 1,
        locks: 1,
        waiting: 1,
    };
    let mut t = LockTable::new();
    t.apply(1, &in_quota("a", q, open(1)));
    let first = in_quota("a", q, auth(0, acq(1, 1, "x", Wait)));
    let second = in_quota("a", q, auth(0, acq(1, 2, "y", Wait)));
    assert!(matches!(
        t.apply(2, &first.without_secrets()),
        Granted { .. }
    ));
    assert_eq!(
        t.apply(3, &second.without_secrets()),
        quota_exceeded(crate::QuotaKind::Locks, 1)
    );
}

/// A version 4 snapshot (`testdata/snapshot-v4.bin`, made by the build before quotas: sessions 1 and 2
/// with secrets 0x1111 and 0x2222; 1 holds `a`, 2 waits for it and holds `dir/b`) decodes with no
/// session owned by anyone, and its sessions keep their secrets.
#[test]
fn a_version_4_snapshot_decodes_without_owners() {
    let mut t = LockTable::decode_snapshot(include_bytes!("../testdata/snapshot-v4.bin")).unwrap();
    t.check_invariants();
    assert_eq!(t.session_secret(SessionId(2)), Some(0x2222));
    assert_eq!(t.describe(&name("a")).unwrap().holder.session, SessionId(1));
    assert_eq!(
        t.describe(&name("dir/b")).unwrap().holder.session,
        SessionId(2)
    );
    assert_eq!(t.usage("anyone"), crate::table::Usage::default());
    // Unowned sessions are not held to a quota, and a new owned one is counted.
    let none = QuotaLimits {
        sessions: 0,
        locks: 0,
        waiting: 0,
    };
    assert!(matches!(
        t.apply(6, &in_quota("p", none, auth(0x1111, acq(1, 2, "c", Wait)))),
        Granted { .. }
    ));
    assert_eq!(
        t.apply(7, &in_quota("p", none, open(7))),
        quota_exceeded(crate::QuotaKind::Sessions, 0)
    );
    let again = LockTable::decode_snapshot(&t.encode_snapshot()).unwrap();
    assert_eq!(again.digest(), t.digest());
}

/// A version 5 snapshot (`testdata/snapshot-v5.bin`, made by the build before lock-delays: session 1,
/// owned by principal `p`, holds `a`; session 2 waits for it and holds `dir/b`) decodes with no
/// lock-delay anywhere, and keeps its owners.
#[test]
fn a_version_5_snapshot_decodes_without_lock_delays() {
    let mut t = LockTable::decode_snapshot(include_bytes!("../testdata/snapshot-v5.bin")).unwrap();
    t.check_invariants();
    assert_eq!(t.usage("p").sessions, 1);
    assert_eq!(t.usage("p").held, 1);
    let a = t.describe(&name("a")).unwrap();
    assert_eq!(
        (a.holder.session, a.holder.lock_delay_ms),
        (SessionId(1), 0)
    );
    assert_eq!(a.waiters.len(), 1);
    // Its grants have no delay: an expiry hands `a` straight to the waiter.
    assert_eq!(
        t.apply(6, &expire(1)),
        Outcome::SessionClosed { released: 1 }
    );
    assert_eq!(t.describe(&name("a")).unwrap().holder.session, SessionId(2));
    assert!(t.delayed_locks().is_empty());
}

pub(crate) fn delayed(ms: u32, command: Command) -> Command {
    Command::WithLockDelay {
        lock_delay_ms: ms,
        command: Box::new(command),
    }
}

pub(crate) fn end_delay(n: &str, token: u64) -> Command {
    Command::EndLockDelay {
        name: name(n),
        token: FencingToken(token),
        now_ms: 0,
    }
}

/// A grant with a lock-delay that expires leaves the lock held by nobody until `EndLockDelay`; waiters
/// keep their places and the first is granted then. A clean end (close, release) frees it at once.
#[test]
fn a_lock_delay_follows_an_expiry_and_only_an_expiry() {
    let mut t = LockTable::new();
    for i in 1..=3 {
        assert_eq!(t.apply(i, &open(i as u128)), opened(i));
    }
    assert_eq!(
        t.apply(4, &delayed(5_000, acq(1, 1, "x", Wait))),
        granted(4)
    );
    assert!(matches!(
        t.apply(5, &acq(2, 1, "x", Wait)),
        Queued { position: 1 }
    ));
    t.take_events();
    t.take_changes();
    assert_eq!(
        t.apply(6, &expire(1)),
        Outcome::SessionClosed { released: 1 }
    );
    assert!(t.take_events().contains(&Event::LockDelayed {
        name: name("x"),
        token: FencingToken(4),
        delay_ms: 5_000,
        began: 6,
        shared: false,
    }));
    let kinds: Vec<_> = t.take_changes().iter().map(|c| c.kind).collect();
    assert_eq!(
        kinds,
        [crate::ChangeKind::Expired, crate::ChangeKind::Delayed]
    );
    t.check_invariants();
    let x = t.describe(&name("x")).unwrap();
    assert_eq!(
        (x.holder.session, x.holder.token, x.holder.lock_delay_ms),
        (SessionId(0), FencingToken(4), 5_000)
    );
    let delays: Vec<_> = t
        .delayed_locks()
        .into_iter()
        .map(|d| (d.name, d.token, d.began, d.delay_ms))
        .collect();
    assert_eq!(delays, vec![(name("x"), FencingToken(4), 6, 5_000)]);
    // Nobody gets it meanwhile: a try is refused, a wait queues behind the first waiter.
    assert_eq!(
        t.apply(7, &acq(3, 1, "x", Try)),
        refused(Refusal::Held {
            holder: SessionId(0),
            token: FencingToken(4)
        })
    );
    assert!(matches!(
        t.apply(8, &acq(3, 2, "x", Wait)),
        Queued { position: 2 }
    ));
    // The delay survives a snapshot.
    let mut t = LockTable::decode_snapshot(&t.encode_snapshot()).unwrap();
    // Another token changes nothing; the right one grants the first waiter, with a larger token.
    assert_eq!(t.apply(9, &end_delay("x", 5)), refused(Refusal::NotHolder));
    assert_eq!(t.apply(10, &end_delay("x", 4)), Released);
    let x = t.describe(&name("x")).unwrap();
    assert_eq!(
        (x.holder.session, x.holder.token),
        (SessionId(2), FencingToken(10))
    );
    assert_eq!(t.apply(11, &end_delay("x", 4)), refused(Refusal::NotHolder));
    // A close of a delayed grant, and a release, free the lock at once.
    assert_eq!(
        t.apply(12, &delayed(5_000, acq(3, 3, "y", Wait))),
        granted(12)
    );
    assert_eq!(
        t.apply(13, &close(3)),
        Outcome::SessionClosed { released: 1 }
    );
    assert!(t.describe(&name("y")).is_none());
    t.check_invariants();
}

/// A snapshot written a few entries at a time reads exactly as the table did when it started, whatever
/// was applied in between: sessions and locks removed, added, and changed, before and after the part
/// already written.
#[test]
fn a_snapshot_written_while_applying_is_the_table_at_its_start() {
    let mut t = LockTable::new();
    let mut index = 0;
    let mut next = |t: &mut LockTable, c: Command| {
        index += 1;
        let out = t.apply(index, &c);
        t.take_events();
        t.take_changes();
        out
    };
    let mut sessions = Vec::new();
    for i in 0..40u128 {
        let Outcome::SessionOpened { session, .. } = next(&mut t, open(i + 1)) else {
            panic!("open failed")
        };
        sessions.push(session.0);
    }
    let mut tokens = std::collections::BTreeMap::new();
    for i in 0..400u64 {
        let s = sessions[(i % 40) as usize];
        let n = format!("l/{i:04}");
        match next(&mut t, acq(s, 1000 + i, &n, crate::AcquireMode::Wait)) {
            Outcome::Granted { token, .. } => {
                tokens.insert(n, (s, token.0, 1000 + i));
            }
            other => panic!("{other:?}"),
        }
    }
    let clone = t.clone();
    let expected = t.encode_snapshot();
    let mut out = Vec::new();
    let mut writer = t.snapshot_begin(&mut out);
    let mut step = 0u64;
    loop {
        // Between chunks: release a lock, take a new one, end a session, open one, queue a waiter,
        // spread over the names and sessions written and not yet written.
        step += 1;
        let k = (step * 37) % 400;
        let n = format!("l/{k:04}");
        if let Some((s, token, r)) = tokens.remove(&n) {
            next(&mut t, rel(s, r + 5000, &n, token));
        }
        next(
            &mut t,
            acq(
                sessions[(step % 40) as usize],
                9000 + step,
                &format!("l/{:04}x", (step * 13) % 400),
                crate::AcquireMode::Wait,
            ),
        );
        next(
            &mut t,
            acq(
                sessions[((step + 1) % 40) as usize],
                20000 + step,
                &format!("l/{:04}", (step * 11) % 400),
                crate::AcquireMode::Wait,
            ),
        );
        if step.is_multiple_of(5) {
            next(&mut t, close(sessions[(step % 40) as usize]));
            next(&mut t, open(1000 + step as u128));
        }
        if t.snapshot_next(&mut writer, &mut out, 7).unwrap() {
            break;
        }
    }
    t.check_invariants();
    assert!(step > 50, "the snapshot took {step} chunks");
    assert_eq!(out, expected, "the snapshot is not the table at its start");
    assert_eq!(LockTable::decode_snapshot(&out).unwrap(), clone);
    // Once written, changes keep no copies, and a new snapshot is today's table.
    let mut again = Vec::new();
    let mut w = t.snapshot_begin(&mut again);
    while !t.snapshot_next(&mut w, &mut again, 1000).unwrap() {}
    assert_eq!(again, t.encode_snapshot());
}

/// A writer whose snapshot was aborted (or whose table was replaced) stops with an error.
#[test]
fn an_aborted_snapshot_stops_its_writer() {
    let mut t = LockTable::new();
    t.apply(1, &open(1));
    t.apply(2, &acq(1, 1, "a", crate::AcquireMode::Wait));
    let mut out = Vec::new();
    let mut w = t.snapshot_begin(&mut out);
    t.snapshot_abort();
    assert!(matches!(
        t.snapshot_next(&mut w, &mut out, 1),
        Err(crate::SnapshotError::Abandoned)
    ));
    // A writer whose snapshot another one replaced is refused too, and leaves the other's alone.
    let mut first = Vec::new();
    let mut old = t.snapshot_begin(&mut first);
    let mut second = Vec::new();
    let mut new = t.snapshot_begin(&mut second);
    assert!(matches!(
        t.snapshot_next(&mut old, &mut first, 1),
        Err(crate::SnapshotError::Abandoned)
    ));
    while !t.snapshot_next(&mut new, &mut second, 1).unwrap() {}
    assert_eq!(second, t.encode_snapshot());
}

/// The digest is the FNV-1a hash of the snapshot encoding (backups record it), though it is computed
/// without the encoding: pinned on a table whose encoding spans several of the hasher's buffers.
#[test]
fn the_digest_is_the_hash_of_the_encoding() {
    let mut t = LockTable::new();
    assert_eq!(t.digest(), crate::name::fnv1a64(&t.encode_snapshot()));
    let mut index = 0;
    let mut sessions = Vec::new();
    for i in 0..50u128 {
        index += 1;
        let Outcome::SessionOpened { session, .. } = t.apply(index, &open(i + 1)) else {
            panic!("open failed")
        };
        sessions.push(session.0);
    }
    for i in 0..4_000u64 {
        index += 1;
        let name = format!("digest/{i:05}/with-a-longer-name-than-fits-in-place");
        t.apply(
            index,
            &acq(
                sessions[(i % 50) as usize],
                10 + i,
                &name,
                crate::AcquireMode::Try,
            ),
        );
    }
    t.take_events();
    t.take_changes();
    let bytes = t.encode_snapshot();
    assert!(bytes.len() > 3 * 64 * 1024, "{} bytes", bytes.len());
    assert_eq!(t.digest(), crate::name::fnv1a64(&bytes));
}
