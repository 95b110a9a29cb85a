//! **P10: a lock in its lock-delay goes to nobody until the delay has passed.** After an entry expires a
//! grant that asked for a lock-delay (its `Delayed` change), the lock is granted to nobody until its
//! `DelayEnded`, which only an `EndLockDelay` for that grant's token makes, stamped (leader wall clock)
//! no earlier than the expiry's stamp plus the delay, less [`MARGIN_MS`].
//!
//! And the other way round: every expiry of a grant whose acquire asked for a lock-delay begins one, of
//! the length asked for (a delay silently lost is a lock handed over at once).
//!
//! Input: the [`MergedLog`] (commands, events and changes of every applied entry), and which entries'
//! acquires asked for a lock-delay (`Command::WithLockDelay`, which the merged log no longer shows).
//!
//! Why it matters: a lock-delay is for resources that cannot check tokens; a grant inside it lets a new
//! holder write while the expired one's last requests may still land.

use crate::properties::MergedLog;
use holdfast_lock_table::{ChangeKind, Command, Event, Outcome};
use std::collections::BTreeMap;

/// Slack for the leaders' wall clocks (they share the machine's, which NTP may slew), like P6's.
pub const MARGIN_MS: u64 = 100;

/// P10. Returns how many lock-delays were checked to their end. Names in `multi` (shared locks and
/// semaphores, several placeholders at once) are left to P11.
pub fn check(
    merged: &MergedLog<'_>,
    asked: &BTreeMap<u64, u32>,
    multi: &std::collections::BTreeSet<String>,
    v: &mut Vec<String>,
) -> usize {
    // Lock -> (token of the expired grant, when the expiry was stamped, delay).
    let mut delayed: BTreeMap<String, (u64, u64, u64)> = BTreeMap::new();
    // Grants whose acquire asked for a delay: (lock, token) -> delay; and such acquires still queued:
    // (session, request) -> delay.
    let mut grants: BTreeMap<(String, u64), u32> = BTreeMap::new();
    let mut queued: BTreeMap<(u64, u64), u32> = BTreeMap::new();
    let mut checked = 0;
    for (index, line) in merged {
        let command = line.command.effective();
        if let (
            Some(&ms),
            Command::Acquire {
                session,
                request,
                name,
                ..
            },
        ) = (asked.get(index), command)
        {
            match &line.outcome {
                Outcome::Granted { token } => {
                    grants.insert((name.as_str().to_string(), token.0), ms);
                }
                Outcome::Queued { .. } => {
                    queued.insert((session.0, request.0), ms);
                }
                _ => {}
            }
        }
        for e in &line.events {
            match e {
                Event::Granted {
                    name,
                    session,
                    request,
                    token,
                } => {
                    if let Some(ms) = queued.remove(&(session.0, request.0)) {
                        grants.insert((name.as_str().to_string(), token.0), ms);
                    }
                }
                Event::WaiterRemoved {
                    session, request, ..
                } => {
                    queued.remove(&(session.0, request.0));
                }
                _ => {}
            }
        }
        for c in line
            .changes
            .iter()
            .filter(|c| !multi.contains(c.name.as_str()))
        {
            let name = c.name.as_str().to_string();
            match c.kind {
                ChangeKind::Expired | ChangeKind::Released => {
                    let token = c.token.map_or(0, |t| t.0);
                    let Some(ms) = grants.remove(&(name.clone(), token)) else {
                        continue;
                    };
                    let began = line.events.iter().any(|e| {
                        matches!(e, Event::LockDelayed { name: n, token: t, delay_ms, .. } if n == &c.name && t.0 == token && *delay_ms == ms)
                    });
                    if c.kind == ChangeKind::Expired && !began {
                        v.push(format!(
                            "P10: at index {index} grant {token} of {name} expired, but the {ms} ms lock-delay its acquire asked for did not begin"
                        ));
                    }
                }
                ChangeKind::Delayed => {
                    let delay = line.events.iter().find_map(|e| match e {
                        Event::LockDelayed {
                            name: n, delay_ms, ..
                        } if n == &c.name => Some(u64::from(*delay_ms)),
                        _ => None,
                    });
                    match delay {
                        Some(d) => {
                            delayed.insert(name, (c.token.map_or(0, |t| t.0), command.now_ms(), d));
                        }
                        None => v.push(format!("P10: at index {index} {name} entered a lock-delay without a LockDelayed event")),
                    }
                }
                ChangeKind::DelayEnded => {
                    let Some((token, expired_ms, delay)) = delayed.remove(&name) else {
                        v.push(format!("P10: at index {index} a lock-delay of {name} ended that never began"));
                        continue;
                    };
                    checked += 1;
                    match command {
                        Command::EndLockDelay { token: t, now_ms, .. } if t.0 == token => {
                            if now_ms + MARGIN_MS < expired_ms + delay {
                                v.push(format!(
                                    "P10: the lock-delay of {name} ended at index {index}, {} ms after the expiry of token {token} that began its {delay} ms",
                                    now_ms.saturating_sub(expired_ms)
                                ));
                            }
                        }
                        other => v.push(format!(
                            "P10: the lock-delay of {name} after token {token} expired was ended at index {index} by {other:?}"
                        )),
                    }
                }
                ChangeKind::Granted if delayed.contains_key(&name) => v.push(format!(
                    "P10: {name} was granted at index {index} during the lock-delay after token {} expired",
                    delayed[&name].0
                )),
                _ => {}
            }
        }
    }
    checked
}
