//! **P11: shared locks and semaphores hold what they may.** For every name acquired shared or as a
//! semaphore (see [`multi_holder_names`]), a replay of the log's changes checks at every applied index:
//! - an exclusive grant finds no holder at all (readers and a writer never overlap);
//! - a shared grant finds only shared holders;
//! - a permit grant finds fewer holders than the semaphore's permits, and every grant of the name asks
//!   for the same number while the semaphore exists (at most N permit holders);
//! - a grant's token is its log index, and larger than every token of an earlier entry on the name;
//! - a release or expiry ends a grant that is held, with its token;
//! - a lock-delay's placeholder takes the expired grant's place (its mode, its permit) until its
//!   `DelayEnded`, which comes no earlier than the delay after the expiry (leader wall clock, less
//!   [`super::p10_lock_delay::MARGIN_MS`]), and every expiry of a grant that asked for a delay begins
//!   one.
//!
//! Input: the [`MergedLog`]'s changes, and which entries' acquires asked for a share or a lock-delay
//! (the wrappers the merged log no longer shows). Each grant's mode is its acquire's: the entry's own
//! for an immediate grant, the session's latest acquire of the name for a waiter granted later (a
//! session waits at most once per name).
//!
//! P1, P3, P4, P8, P10 and the linearizability checks keep to exclusive locks; these names are left to
//! this check (and to P2, P5, P6 and P9, which hold for every lock alike).
//!
//! Why it matters: a writer beside a reader, or N + 1 permit holders, is the shared-lock version of two
//! holders at once.

use super::p10_lock_delay::MARGIN_MS;
use super::{Grants, MergedLog};
use crate::model::Op;
use holdfast_lock_table::{ChangeKind, Command, Outcome, Share};
use std::collections::{BTreeMap, BTreeSet};

/// How an acquire asked to share, if it asked (`Command::WithShare`, under any other wrapper).
pub fn share_of(command: &Command) -> Option<Share> {
    match command {
        Command::WithShare { share, .. } => Some(*share),
        Command::Authorized { command, .. }
        | Command::Quota { command, .. }
        | Command::WithLockDelay { command, .. } => share_of(command),
        _ => None,
    }
}

/// The names this check owns: every name an acquire in the log asked for shared or as a semaphore
/// (`asked`), and every name the history's operations say they used so (`Op::share`), even if none
/// of those acquires reached the log.
pub fn multi_holder_names(
    merged: &MergedLog<'_>,
    asked: &BTreeMap<u64, Share>,
    history: &[Op],
) -> BTreeSet<String> {
    let mut names: BTreeSet<String> = history
        .iter()
        .filter(|o| o.share.is_some())
        .map(|o| o.lock.clone())
        .collect();
    for (index, share) in asked {
        if *share == Share::Exclusive {
            continue;
        }
        if let Some(Command::Acquire { name, .. }) = merged.get(index).map(|l| &l.command) {
            names.insert(name.as_str().to_string());
        }
    }
    names
}

#[derive(Clone, Copy, Debug)]
struct Holder {
    /// 0 for a lock-delay's placeholder.
    session: u64,
    token: u64,
    shared: bool,
    /// The lock-delay the grant asked for.
    delay_ms: u32,
    /// A placeholder's earliest end (leader wall clock): its expiry's stamp plus the delay, the latest
    /// of those if several grants with its token expired into it.
    ends_ms: u64,
}

#[derive(Default)]
struct Lock {
    permits: u32,
    holders: Vec<Holder>,
    /// The largest token of an entry before the current one.
    last_token: u64,
}

/// P11. Adds every grant on these names to `grants` (for P5); returns how many grants it checked.
pub fn check(
    merged: &MergedLog<'_>,
    names: &BTreeSet<String>,
    asked_share: &BTreeMap<u64, Share>,
    asked_delay: &BTreeMap<u64, u32>,
    grants: &mut Grants,
    v: &mut Vec<String>,
) -> usize {
    let mut locks: BTreeMap<String, Lock> = BTreeMap::new();
    // (session, name) -> the share and delay of the session's latest acquire of the name.
    let mut acquires: BTreeMap<(u64, String), (Share, u32)> = BTreeMap::new();
    let mut checked = 0;
    for (&index, line) in merged {
        if let (
            Command::Acquire { session, name, .. },
            Outcome::Granted { .. } | Outcome::Queued { .. },
        ) = (&line.command, &line.outcome)
        {
            if names.contains(name.as_str()) {
                let share = asked_share.get(&index).copied().unwrap_or_default();
                let delay = asked_delay.get(&index).copied().unwrap_or(0);
                acquires.insert((session.0, name.as_str().to_string()), (share, delay));
            }
        }
        let now_ms = line.command.now_ms();
        for (at, c) in line.changes.iter().enumerate() {
            let name = c.name.as_str();
            if !names.contains(name) {
                continue;
            }
            let token = c.token.map_or(0, |t| t.0);
            let lock = locks.entry(name.to_string()).or_default();
            if lock.holders.is_empty() {
                lock.permits = 0;
            }
            match c.kind {
                ChangeKind::Granted => {
                    checked += 1;
                    grants.insert((name.to_string(), c.session.0, token));
                    let (share, delay_ms) = acquires
                        .get(&(c.session.0, name.to_string()))
                        .copied()
                        .unwrap_or_default();
                    let (shared, permits) = share.parts();
                    let others = lock.holders.len();
                    let fits = match share {
                        Share::Exclusive => others == 0,
                        Share::Shared => lock.holders.iter().all(|h| h.shared),
                        Share::Permits(n) => {
                            (others == 0 || lock.permits == n) && others < n as usize
                        }
                    };
                    if !fits {
                        v.push(format!(
                            "P11: at index {index} {name} was granted {share:?} to session {} while held by {:?} (permits {})",
                            c.session.0, lock.holders, lock.permits
                        ));
                    }
                    if token != index || token <= lock.last_token {
                        v.push(format!(
                            "P11: at index {index} {name} was granted with token {token} after token {}",
                            lock.last_token
                        ));
                    }
                    if others == 0 {
                        lock.permits = permits;
                    }
                    lock.holders.push(Holder {
                        session: c.session.0,
                        token,
                        shared,
                        delay_ms,
                        ends_ms: 0,
                    });
                }
                ChangeKind::Released | ChangeKind::Expired => {
                    let Some(pos) = lock
                        .holders
                        .iter()
                        .position(|h| h.session == c.session.0 && h.token == token)
                    else {
                        v.push(format!(
                            "P11: at index {index} session {} left {name} (token {token}) without holding it: {:?}",
                            c.session.0, lock.holders
                        ));
                        continue;
                    };
                    let gone = lock.holders.remove(pos);
                    let delay_follows = line.changes[at + 1..].iter().any(|d| {
                        d.kind == ChangeKind::Delayed && d.name == c.name && d.token == c.token
                    });
                    if c.kind == ChangeKind::Expired && gone.delay_ms > 0 {
                        // Its placeholder (added by the Delayed change) takes its place.
                        if !delay_follows {
                            v.push(format!(
                                "P11: at index {index} grant {token} of {name} expired, but its {} ms lock-delay did not begin",
                                gone.delay_ms
                            ));
                        }
                        let ends_ms = now_ms + u64::from(gone.delay_ms);
                        let merged_into = lock
                            .holders
                            .iter_mut()
                            .find(|h| h.session == 0 && h.token == token);
                        match merged_into {
                            Some(p) => p.ends_ms = p.ends_ms.max(ends_ms),
                            None => lock.holders.push(Holder {
                                session: 0,
                                ends_ms,
                                ..gone
                            }),
                        }
                    }
                }
                ChangeKind::Delayed => {
                    if !lock
                        .holders
                        .iter()
                        .any(|h| h.session == 0 && h.token == token)
                    {
                        v.push(format!(
                            "P11: at index {index} {name} entered a lock-delay for token {token} that no expired grant with a delay began"
                        ));
                    }
                }
                ChangeKind::DelayEnded => {
                    let Some(pos) = lock
                        .holders
                        .iter()
                        .position(|h| h.session == 0 && h.token == token)
                    else {
                        v.push(format!("P11: at index {index} a lock-delay of {name} (token {token}) ended that never began"));
                        continue;
                    };
                    let p = lock.holders.remove(pos);
                    if now_ms + MARGIN_MS < p.ends_ms {
                        v.push(format!(
                            "P11: the lock-delay of {name} (token {token}) ended at index {index}, {} ms before it could",
                            p.ends_ms - now_ms
                        ));
                    }
                }
                ChangeKind::Queued | ChangeKind::Cancelled => {}
            }
        }
        // Tokens of this entry's grants are the floor for the next entries'.
        for c in &line.changes {
            if let (ChangeKind::Granted, Some(lock)) = (c.kind, locks.get_mut(c.name.as_str())) {
                lock.last_token = lock.last_token.max(c.token.map_or(0, |t| t.0));
            }
        }
    }
    checked
}
