//! **P9: watch streams are the log.** The events a watcher received are, in order and with no gap and
//! no repeat, the changes that the applied log made to the locks under its prefix after the index its
//! watch started at.
//!
//! Input: the history's `watch-start` ops (a watcher began a watch of the prefix in `lock` after index
//! `value`) and `watch` ops (it received an event), per watcher (`process`, `client`), in order; and the
//! [`MergedLog`] with each entry's changes.
//!
//! Why it matters: a watcher acts on what it is told (an observer of an election follows leaders, a
//! cache invalidates on release). A missed event leaves it believing a stale holder; a repeated or
//! reordered one makes it act twice or go back in time. The client resumes streams across leader changes
//! and server restarts from `(index, skip)`, and this check is what says that resumption is exact.

use crate::model::Op;
use crate::properties::MergedLog;
use holdfast_lock_table::ChangeKind;
use std::collections::BTreeMap;

fn kind(k: ChangeKind) -> &'static str {
    match k {
        ChangeKind::Granted => "granted",
        ChangeKind::Released => "released",
        ChangeKind::Expired => "expired",
        ChangeKind::Queued => "queued",
        ChangeKind::Cancelled => "cancelled",
        ChangeKind::Delayed => "delayed",
        ChangeKind::DelayEnded => "delay-ended",
    }
}

/// (index, kind, name, session, token) of one event.
type Seen<'a> = (u64, &'a str, &'a str, u64, u64);

/// P9. Returns how many received events were checked.
pub fn check(history: &[Op], merged: &MergedLog<'_>, v: &mut Vec<String>) -> usize {
    // Each watch (a `watch-start` and the events after it, per watcher).
    let mut watches: Vec<(&Op, Vec<&Op>)> = Vec::new();
    let mut open: BTreeMap<(u32, usize), usize> = BTreeMap::new();
    for o in history {
        match o.op.as_str() {
            "watch-start" => {
                open.insert((o.process, o.client), watches.len());
                watches.push((o, Vec::new()));
            }
            "watch" => match open.get(&(o.process, o.client)) {
                Some(&w) => watches[w].1.push(o),
                None => v.push(format!("P9: a watch event without a watch-start: {o:?}")),
            },
            _ => {}
        }
    }
    let mut checked = 0;
    for (start, events) in &watches {
        let after = start.value.unwrap_or(0);
        let prefix = start.lock.as_str();
        let mut expected = merged
            .range(after + 1..)
            .flat_map(|(index, line)| line.changes.iter().map(move |c| (*index, c)))
            .filter(|(_, c)| c.name.as_str().starts_with(prefix))
            .map(|(index, c)| -> Seen<'_> {
                (
                    index,
                    kind(c.kind),
                    c.name.as_str(),
                    c.session.0,
                    c.token.map_or(0, |t| t.0),
                )
            });
        for (n, e) in events.iter().enumerate() {
            let got: Seen<'_> = (
                e.index.unwrap_or(0),
                e.kind.as_deref().unwrap_or(""),
                e.lock.as_str(),
                e.session.unwrap_or(0),
                e.token.unwrap_or(0),
            );
            checked += 1;
            match expected.next() {
                Some(want) if want == got => {}
                want => {
                    v.push(format!(
                        "P9: watcher {}/{} of {prefix:?} from index {after}: its event #{n} was {got:?}, but the log's next change under the prefix is {want:?}",
                        start.process, start.client
                    ));
                    break;
                }
            }
        }
    }
    checked
}
