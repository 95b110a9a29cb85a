//! Watches: the recent history of what happened to a group's locks, and reading it as a stream.
//!
//! Every applied entry's [`Change`]s are appended to the group's [`History`] under the state machine's
//! write lock, so a watcher that reads the table and the history under one read lock sees them agree.
//! The history is a bounded ring shared by all watchers of the group: a watcher is only a cursor into it
//! (no per-watcher queue to grow), and a watcher whose cursor falls off the ring's old end is cut off
//! (`WATCH_TOO_SLOW`) instead of holding memory for it.
//!
//! Invariant: the ring holds **every** change at log indexes in `(floor, applied]`, in log order. Changes
//! are a pure function of the log (the lock table is deterministic), so a watcher can resume on any
//! server from a log index that is still in that server's ring and get exactly the events it missed.
//! After a restart the ring starts at the snapshot's index (openraft re-applies the log after it, which
//! re-creates the same changes); after installing a snapshot from the leader, at that snapshot's index.

use holdfast_lock_table::{Change, ChangeKind};
use std::collections::{BTreeMap, VecDeque};
use std::sync::{Arc, Mutex};

/// Changes kept per group. 80 bytes each (`(u64, Change)`, names of up to 22 bytes in place) plus longer
/// names and values: 8 MB, enough for a watcher to ride out a reconnect at tens of thousands of changes
/// a second. Reserved once, in full (untouched until used): grown by doubling, the queue would end at
/// 131,072 slots, 2.5 MB more.
pub const HISTORY_EVENTS: usize = 100_000;
/// Bytes of grant values kept per group (values are up to 1 KiB each); older changes are dropped first.
pub const HISTORY_VALUE_BYTES: usize = 16 << 20;
/// A `WatchResponse` ends at the first entry boundary after this many events, so it holds at most
/// twice as many; only an entry with more than this many matching events is split (see `through_index`).
pub const MAX_BATCH_EVENTS: usize = 1_000;
/// Most locks listed in a watch's first message (`include_current`).
pub const MAX_CURRENT: usize = 1_000;
/// Watch streams open at once on one server. Each costs a task and a cursor (the history is shared),
/// and each scans the group's changes as they come: the bound keeps that scan cost bounded too.
pub const MAX_WATCH_STREAMS: usize = 1_024;

pub struct History {
    events: VecDeque<(u64, Change)>,
    value_bytes: usize,
    /// Changes at indexes <= floor may be missing.
    floor: u64,
    /// The floor moved because old changes were dropped (not because the state was replaced).
    evicted: bool,
    /// The last applied index (changes up to it are here, if above `floor`).
    applied: u64,
}

/// Where a watcher is: deliver the matching changes at indexes >= `index`, except the first `skip`
/// matching ones at `index` itself.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Cursor {
    pub index: u64,
    pub skip: usize,
}

/// What a watcher asks for.
pub struct Filter {
    pub prefix: String,
    pub exact: bool,
}

impl Filter {
    pub fn matches(&self, name: &str) -> bool {
        if self.exact {
            name == self.prefix
        } else {
            name.starts_with(&self.prefix)
        }
    }
}

/// One read of the history: events, the index they are complete through, and the cursor after them.
pub struct Batch {
    pub events: Vec<(u64, Change)>,
    pub through: u64,
    pub next: Cursor,
    /// The read stopped early: more is there already.
    pub more: bool,
}

/// The watcher's cursor is at or below the floor: what it needs next is gone.
#[derive(Debug, PartialEq, Eq)]
pub struct Gone {
    pub floor: u64,
    /// Gone because the history dropped it (the watcher was too slow), not because this server's state
    /// was replaced by a snapshot (or it restarted) after the watcher's position.
    pub evicted: bool,
}

impl History {
    /// An empty history of a group whose state is at `applied` (its snapshot's index, or 0).
    pub fn new(applied: u64) -> History {
        History {
            events: VecDeque::with_capacity(HISTORY_EVENTS),
            value_bytes: 0,
            floor: applied,
            evicted: false,
            applied,
        }
    }

    pub fn applied(&self) -> u64 {
        self.applied
    }

    pub fn floor(&self) -> u64 {
        self.floor
    }

    /// Records the changes of the entry at `index` (the next one applied).
    pub fn record(&mut self, index: u64, changes: Vec<Change>) {
        // Apply is in log order, once per index (openraft never re-applies an index without restoring
        // state first, which resets this history).
        // (Index 0 is the group's first membership entry: no changes, and nothing before it.)
        assert!(
            index > self.applied || (index == 0 && changes.is_empty()),
            "changes recorded out of log order: {index} after {}",
            self.applied
        );
        self.applied = self.applied.max(index);
        // Make room first, so the queue stays within the capacity reserved for it (the same entries are
        // dropped as when dropping after: the oldest, whole, until what is left and the new ones fit).
        let (count, bytes) = (
            changes.len(),
            changes.iter().map(|c| c.value.len()).sum::<usize>(),
        );
        while !self.events.is_empty() && self.over_with(count, bytes) {
            self.drop_oldest_entry();
        }
        for change in changes {
            self.value_bytes += change.value.len();
            self.events.push_back((index, change));
        }
        // Only an entry with more than the history holds is still over: it goes too.
        while self.over_with(0, 0) {
            self.drop_oldest_entry();
        }
    }

    /// Whether `count` more changes carrying `bytes` of values would be more than the history keeps.
    fn over_with(&self, count: usize, bytes: usize) -> bool {
        self.events.len() + count > HISTORY_EVENTS || self.value_bytes + bytes > HISTORY_VALUE_BYTES
    }

    /// Drops every change of the oldest entry still here (never part of one: the floor is an index).
    fn drop_oldest_entry(&mut self) {
        let Some(&(oldest, _)) = self.events.front() else {
            return;
        };
        while self.events.front().is_some_and(|(i, _)| *i == oldest) {
            let (_, change) = self.events.pop_front().expect("checked");
            self.value_bytes -= change.value.len();
        }
        self.floor = oldest;
        self.evicted = true;
    }

    /// The state jumped to `applied` (a snapshot was installed): what came before is unknown here.
    pub fn reset(&mut self, applied: u64) {
        self.events.clear();
        self.value_bytes = 0;
        self.floor = applied;
        self.evicted = false;
        self.applied = applied;
    }

    /// Reads matching events from `at`: whole entries, stopping at the first entry boundary after `max`
    /// events; an entry with more than `max` matching events alone is split after `2 * max`.
    pub fn read(&self, at: Cursor, filter: &Filter, max: usize) -> Result<Batch, Gone> {
        if at.index <= self.floor {
            return Err(Gone {
                floor: self.floor,
                evicted: self.evicted,
            });
        }
        let start = self.events.partition_point(|(i, _)| *i < at.index);
        let mut events = Vec::new();
        // Matching events already seen of the entry `current`.
        let mut current = at.index;
        let mut seen = 0usize;
        let mut skip = at.skip;
        for (index, change) in self.events.range(start..) {
            if *index != current {
                if events.len() >= max {
                    // Stop at an entry boundary: everything before `index` is delivered.
                    return Ok(Batch {
                        events,
                        through: index - 1,
                        next: Cursor {
                            index: *index,
                            skip: 0,
                        },
                        more: true,
                    });
                }
                current = *index;
                seen = 0;
                skip = 0;
            }
            if !filter.matches(change.name.as_str()) {
                continue;
            }
            seen += 1;
            if skip > 0 {
                skip -= 1;
                continue;
            }
            if events.len() >= 2 * max {
                // Only an entry with more than `max` matching events gets here (it started below
                // `max`): stop inside it.
                return Ok(Batch {
                    events,
                    through: current - 1,
                    next: Cursor {
                        index: current,
                        skip: seen - 1,
                    },
                    more: true,
                });
            }
            events.push((*index, change.clone()));
        }
        Ok(Batch {
            events,
            through: self.applied.max(at.index - 1),
            next: Cursor {
                index: self.applied.max(at.index - 1) + 1,
                skip: 0,
            },
            more: false,
        })
    }
}

/// The protobuf kind of a change.
pub fn kind(k: ChangeKind) -> holdfast_proto::v1::WatchEventKind {
    use holdfast_proto::v1::WatchEventKind as K;
    match k {
        ChangeKind::Granted => K::Granted,
        ChangeKind::Released => K::Released,
        ChangeKind::Expired => K::Expired,
        ChangeKind::Queued => K::Queued,
        ChangeKind::Cancelled => K::Cancelled,
        ChangeKind::Delayed => K::Delayed,
        ChangeKind::DelayEnded => K::DelayEnded,
    }
}

/// Open watch streams, server-wide and per principal.
#[derive(Default)]
pub struct Slots {
    inner: Mutex<SlotsInner>,
}

#[derive(Default)]
struct SlotsInner {
    total: usize,
    by_principal: BTreeMap<String, u64>,
}

/// One open watch stream's place in [`Slots`], given back when dropped.
pub struct Slot {
    slots: Arc<Slots>,
    principal: Option<String>,
}

/// Why a watch could not open: the limit's name and value.
#[derive(Debug, PartialEq, Eq)]
pub struct Full {
    pub limit: &'static str,
    pub value: u64,
}

impl Slots {
    pub fn open(&self) -> usize {
        self.inner.lock().expect("watch slots").total
    }

    /// Takes a slot, for `principal` (with its `max_watches`) if a policy is loaded.
    pub fn take(self: &Arc<Self>, principal: Option<(String, Option<u64>)>) -> Result<Slot, Full> {
        let mut inner = self.inner.lock().expect("watch slots");
        if inner.total >= MAX_WATCH_STREAMS {
            return Err(Full {
                limit: "max_watch_streams",
                value: MAX_WATCH_STREAMS as u64,
            });
        }
        if let Some((p, max)) = &principal {
            let used = inner.by_principal.get(p).copied().unwrap_or(0);
            if let Some(max) = *max {
                if used >= max {
                    return Err(Full {
                        limit: "principal_max_watches",
                        value: max,
                    });
                }
            }
            inner.by_principal.insert(p.clone(), used + 1);
        }
        inner.total += 1;
        Ok(Slot {
            slots: self.clone(),
            principal: principal.map(|(p, _)| p),
        })
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        let mut inner = self.slots.inner.lock().expect("watch slots");
        inner.total -= 1;
        if let Some(p) = &self.principal {
            if let Some(n) = inner.by_principal.get_mut(p) {
                *n -= 1;
                if *n == 0 {
                    inner.by_principal.remove(p);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use holdfast_lock_table::{FencingToken, LockName, SessionId};

    fn change(name: &str, session: u64) -> Change {
        Change {
            name: LockName::new(name).unwrap(),
            kind: ChangeKind::Granted,
            session: SessionId(session),
            token: Some(FencingToken(1)),
            value: Box::default(),
        }
    }

    fn all() -> Filter {
        Filter {
            prefix: String::new(),
            exact: false,
        }
    }

    fn at(index: u64, skip: usize) -> Cursor {
        Cursor { index, skip }
    }

    /// (index, session) of each event read.
    fn ids(b: &Batch) -> Vec<(u64, u64)> {
        b.events.iter().map(|(i, c)| (*i, c.session.0)).collect()
    }

    #[test]
    fn reads_resume_exactly_where_they_stopped() {
        let mut h = History::new(10);
        h.record(11, vec![change("a", 1), change("b", 2)]);
        h.record(12, vec![]);
        h.record(13, vec![change("a", 3)]);
        let b = h.read(at(11, 0), &all(), 10).unwrap();
        assert_eq!(ids(&b), [(11, 1), (11, 2), (13, 3)]);
        assert_eq!((b.through, b.next, b.more), (13, at(14, 0), false));
        // Skipping what the caller has of entry 11.
        let b = h.read(at(11, 1), &all(), 10).unwrap();
        assert_eq!(ids(&b), [(11, 2), (13, 3)]);
        // A filter, and a cursor past everything.
        let only_a = Filter {
            prefix: "a".into(),
            exact: true,
        };
        assert_eq!(ids(&h.read(at(12, 0), &only_a, 10).unwrap()), [(13, 3)]);
        let b = h.read(at(14, 0), &all(), 10).unwrap();
        assert!(b.events.is_empty());
        assert_eq!((b.through, b.next), (13, at(14, 0)));
        // The floor: the snapshot's index, and below it nothing is known.
        assert_eq!(
            h.read(at(10, 0), &all(), 10).err(),
            Some(Gone {
                floor: 10,
                evicted: false
            })
        );
    }

    #[test]
    fn batches_end_at_entry_boundaries_unless_one_entry_is_too_big() {
        let mut h = History::new(0);
        h.record(1, vec![change("a", 1), change("a", 2)]);
        h.record(2, vec![change("a", 3), change("a", 4)]);
        h.record(3, (0..7).map(|s| change("a", 10 + s)).collect());
        // max 3: entry 1 (2 events) then entry 2 would make 4, still under 2*max, but the batch stops at
        // the first boundary once it has max.
        let b = h.read(at(1, 0), &all(), 3).unwrap();
        assert_eq!(ids(&b), [(1, 1), (1, 2), (2, 3), (2, 4)]);
        assert_eq!((b.through, b.next, b.more), (2, at(3, 0), true));
        // Entry 3 has 7 > 3 events: split after 6, and the cursor skips the 6 delivered.
        let b = h.read(b.next, &all(), 3).unwrap();
        assert_eq!(b.events.len(), 6);
        assert_eq!((b.through, b.next, b.more), (2, at(3, 6), true));
        let b = h.read(b.next, &all(), 3).unwrap();
        assert_eq!(ids(&b), [(3, 16)]);
        assert_eq!((b.through, b.next, b.more), (3, at(4, 0), false));
    }

    #[test]
    fn old_entries_fall_off_whole_and_a_snapshot_resets() {
        let mut h = History::new(0);
        for i in 1..=(HISTORY_EVENTS as u64 / 2 + 1) {
            h.record(i, vec![change("a", i), change("b", i)]);
        }
        // One entry more than fits: the oldest entry went, both of its changes.
        assert_eq!(h.floor(), 1);
        assert_eq!(
            h.read(at(1, 0), &all(), 10).err(),
            Some(Gone {
                floor: 1,
                evicted: true
            })
        );
        assert_eq!(ids(&h.read(at(2, 0), &all(), 1).unwrap())[0], (2, 2));
        // Room was made before the new entry went in: the queue never grew past what was reserved.
        assert_eq!(h.events.len(), HISTORY_EVENTS);
        assert!(h.events.capacity() < HISTORY_EVENTS + HISTORY_EVENTS / 4);
        // An entry with more changes than the history holds: everything before it goes, then it too.
        let many = (0..HISTORY_EVENTS as u64 + 1)
            .map(|i| change("c", i))
            .collect();
        h.record(HISTORY_EVENTS as u64, many);
        assert!(h.events.is_empty());
        assert_eq!(h.floor(), HISTORY_EVENTS as u64);
        h.reset(1_000_000);
        assert_eq!(
            h.read(at(5, 0), &all(), 10).err(),
            Some(Gone {
                floor: 1_000_000,
                evicted: false
            })
        );
        let b = h.read(at(1_000_001, 0), &all(), 10).unwrap();
        assert!(b.events.is_empty());
    }

    #[test]
    fn slots_bound_streams_per_principal_and_give_them_back() {
        let slots = Arc::new(Slots::default());
        let a = slots.take(Some(("p".into(), Some(1)))).unwrap();
        let full = slots.take(Some(("p".into(), Some(1)))).err().unwrap();
        assert_eq!(full.limit, "principal_max_watches");
        let _other = slots.take(Some(("q".into(), Some(1)))).unwrap();
        let _open = slots.take(None).unwrap();
        assert_eq!(slots.open(), 3);
        drop(a);
        assert!(slots.take(Some(("p".into(), Some(1)))).is_ok());
    }
}
