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
//!   one;
//! - FIFO: an acquire is granted at once only if nobody waits, a waiter only from the front of the
//!   queue, and after every entry the first waiter does not fit beside the holders (so readers never
//!   overtake a waiting writer, and a holder or waiter leaving lets in whoever now fits).
//!
//! Input: the [`MergedLog`]'s changes, and which entries' acquires asked for a share or a lock-delay
//! (the wrappers the merged log no longer shows). Each grant's mode is its acquire's: the entry's own
//! for an immediate grant, the session's latest acquire of the name for a waiter granted later (a
//! session waits at most once per name).
//!
//! P1, P3, P4, P10 and the linearizability checks keep to exclusive locks; these names are left to
//! this check (and to P2, P5, P6 and P9, which hold for every lock alike, and P8, which `check.rs` runs
//! on each of their grants alone, from the [`Held`] list this check returns).
//!
//! Why it matters: a writer beside a reader, or N + 1 permit holders, is the shared-lock version of two
//! holders at once.

use super::p10_lock_delay::MARGIN_MS;
use super::{Grants, MergedLog};
use crate::model::Op;
use holdfast_lock_table::{ChangeKind, Command, Event, Share};
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
    /// A placeholder's start: the index of the expiry that began it.
    began: u64,
    /// A placeholder's earliest end (leader wall clock): its expiry's stamp plus the delay.
    ends_ms: u64,
}

#[derive(Default)]
struct Lock {
    permits: u32,
    holders: Vec<Holder>,
    /// Waiting sessions in queue order, with how they asked.
    queue: Vec<(u64, Share)>,
    /// The largest token of an entry before the current one.
    last_token: u64,
}

impl Lock {
    /// Whether a grant asked as `share` fits beside the holders.
    fn fits(&self, share: Share) -> bool {
        let others = self.holders.len();
        match share {
            Share::Exclusive => others == 0,
            Share::Shared => self.holders.iter().all(|h| h.shared),
            Share::Permits(n) => (others == 0 || self.permits == n) && others < n as usize,
        }
    }
}

/// One grant of a shared lock or a semaphore: from the index that made it to the one that ended it
/// (`None`: still held when the log ends). P8 judges those no client acknowledged, one at a time.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Held {
    pub name: String,
    pub session: u64,
    pub token: u64,
    pub from: u64,
    pub until: Option<u64>,
}

/// P11. Adds every grant on these names to `grants` (for P5); returns how many grants it checked, and
/// each grant's time held.
pub fn check(
    merged: &MergedLog<'_>,
    names: &BTreeSet<String>,
    asked_share: &BTreeMap<u64, Share>,
    asked_delay: &BTreeMap<u64, u32>,
    grants: &mut Grants,
    v: &mut Vec<String>,
) -> (usize, Vec<Held>) {
    let mut held: Vec<Held> = Vec::new();
    // (name, session, token) -> its entry in `held` while it is held.
    let mut holding: BTreeMap<(String, u64, u64), usize> = BTreeMap::new();
    let mut locks: BTreeMap<String, Lock> = BTreeMap::new();
    // (session, request) -> how the acquire asked: its share and lock-delay (the first entry of the
    // request decides; a retry's outcome is the first one's).
    let mut requests: BTreeMap<(u64, u64), (Share, u32)> = BTreeMap::new();
    let mut checked = 0;
    for (&index, line) in merged {
        // The acquire this entry is, if any: (session, request), for its own grant or queuing.
        let mut this_acquire = None;
        if let Command::Acquire {
            session,
            request,
            name,
            ..
        } = &line.command
        {
            if names.contains(name.as_str()) {
                let share = asked_share.get(&index).copied().unwrap_or_default();
                let delay = asked_delay.get(&index).copied().unwrap_or(0);
                requests
                    .entry((session.0, request.0))
                    .or_insert((share, delay));
                this_acquire = Some((session.0, request.0));
            }
        }
        let now_ms = line.command.now_ms();
        let mut touched = BTreeSet::new();
        for (at, c) in line.changes.iter().enumerate() {
            let name = c.name.as_str();
            if !names.contains(name) {
                continue;
            }
            touched.insert(name.to_string());
            let token = c.token.map_or(0, |t| t.0);
            let lock = locks.entry(name.to_string()).or_default();
            if lock.holders.is_empty() {
                lock.permits = 0;
            }
            match c.kind {
                ChangeKind::Granted => {
                    checked += 1;
                    grants.insert((name.to_string(), c.session.0, token));
                    holding.insert((name.to_string(), c.session.0, token), held.len());
                    held.push(Held {
                        name: name.to_string(),
                        session: c.session.0,
                        token,
                        from: index,
                        until: None,
                    });
                    // A waiter's grant comes with its `Granted` event; otherwise it is this entry's
                    // own acquire, granted at once.
                    let waiter = line.events.iter().find_map(|e| match e {
                        Event::Granted {
                            name: n,
                            session,
                            request,
                            ..
                        } if n == &c.name && session.0 == c.session.0 => Some(request.0),
                        _ => None,
                    });
                    let request = waiter.or(this_acquire.map(|(_, r)| r)).unwrap_or(0);
                    let (share, delay_ms) = requests
                        .get(&(c.session.0, request))
                        .copied()
                        .unwrap_or_default();
                    match waiter {
                        Some(_) if lock.queue.first().map(|w| w.0) != Some(c.session.0) => {
                            v.push(format!(
                                "P11: at index {index} {name} was granted to waiting session {} out of queue order {:?}",
                                c.session.0, lock.queue
                            ));
                            lock.queue.retain(|w| w.0 != c.session.0);
                        }
                        Some(_) => {
                            lock.queue.remove(0);
                        }
                        None if !lock.queue.is_empty() => v.push(format!(
                            "P11: at index {index} {name} was granted at once to session {} while {:?} waited",
                            c.session.0, lock.queue
                        )),
                        None => {}
                    }
                    if !lock.fits(share) {
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
                    if lock.holders.is_empty() {
                        lock.permits = share.parts().1;
                    }
                    lock.holders.push(Holder {
                        session: c.session.0,
                        token,
                        shared: share.parts().0,
                        delay_ms,
                        began: 0,
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
                    if let Some(at) = holding.remove(&(name.to_string(), c.session.0, token)) {
                        held[at].until = Some(index);
                    }
                    let delay_follows = line.changes[at + 1..].iter().any(|d| {
                        d.kind == ChangeKind::Delayed && d.name == c.name && d.token == c.token
                    });
                    if c.kind == ChangeKind::Expired && gone.delay_ms > 0 {
                        // Its placeholder (announced by the Delayed change) takes its place.
                        if !delay_follows {
                            v.push(format!(
                                "P11: at index {index} grant {token} of {name} expired, but its {} ms lock-delay did not begin",
                                gone.delay_ms
                            ));
                        }
                        lock.holders.insert(
                            pos,
                            Holder {
                                session: 0,
                                began: index,
                                ends_ms: now_ms + u64::from(gone.delay_ms),
                                ..gone
                            },
                        );
                    }
                }
                ChangeKind::Delayed => {
                    if !lock
                        .holders
                        .iter()
                        .any(|h| h.session == 0 && h.token == token && h.began == index)
                    {
                        v.push(format!(
                            "P11: at index {index} {name} entered a lock-delay for token {token} that no expired grant with a delay began"
                        ));
                    }
                }
                ChangeKind::DelayEnded => {
                    // An `EndLockDelayAt` names the delay's start; a plain end, the first with the token.
                    let began = match &line.command {
                        Command::EndLockDelayAt { began, .. } => Some(*began),
                        _ => None,
                    };
                    let Some(pos) = lock.holders.iter().position(|h| {
                        h.session == 0 && h.token == token && began.is_none_or(|b| h.began == b)
                    }) else {
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
                ChangeKind::Queued => {
                    let share = this_acquire
                        .and_then(|r| requests.get(&r))
                        .map_or(Share::Exclusive, |(s, _)| *s);
                    lock.queue.push((c.session.0, share));
                }
                ChangeKind::Cancelled => lock.queue.retain(|w| w.0 != c.session.0),
            }
        }
        for name in touched {
            let lock = locks.get_mut(&name).expect("touched above");
            // Tokens of this entry's grants are the floor for the next entries'.
            if let Some(t) = lock.holders.iter().map(|h| h.token).max() {
                lock.last_token = lock.last_token.max(t);
            }
            // After every entry the first waiter does not fit: it would have been granted.
            if let Some(&(session, share)) = lock.queue.first() {
                if lock.fits(share) {
                    v.push(format!(
                        "P11: after index {index} session {session} still waits for {name} ({share:?}) although it fits beside {:?}",
                        lock.holders
                    ));
                }
            }
        }
    }
    (checked, held)
}
