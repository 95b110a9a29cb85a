//! **P4: the fenced store.** Per key, the tokens the store accepted (writes and marks) never go down; its
//! counter increments never repeat or skip (each accepted write's value is the previous one plus 1: no
//! lost update, nothing applied twice); and every acknowledged write is in it.
//!
//! Inputs: the fenced store's log (every write and mark it accepted, in order) and the history's `write`
//! operations whose result is `ok` (each must appear in the store with the same key, token and value).
//!
//! Why it matters: this is the end-to-end guarantee clients rely on. Even if a holder is paused past its
//! lease and another client acquires the lock, fencing tokens must keep the stale holder from overwriting
//! the newer one's work.

use crate::model::{Op, StoreRecord};
use std::collections::{HashMap, HashSet};

/// P4: the store's marks never go down, increments never repeat, acknowledged writes are all there.
pub fn check(history: &[Op], store: &[StoreRecord], v: &mut Vec<String>) {
    let mut mark: HashMap<&str, u64> = HashMap::new();
    let mut last_value: HashMap<&str, u64> = HashMap::new();
    let mut stored: HashSet<(&str, u64, u64)> = HashSet::new();
    for r in store {
        let m = mark.entry(&r.key).or_insert(0);
        if r.token < *m {
            v.push(format!(
                "P4: the store accepted token {} for {:?} after token {}",
                r.token, r.key, m
            ));
        }
        *m = (*m).max(r.token);
        if let (true, Some(value)) = (r.write, r.value) {
            let prev = last_value.insert(&r.key, value).unwrap_or(0);
            if value != prev + 1 {
                v.push(format!(
                    "P4: {:?} went from {prev} to {value}: an update was lost or applied twice",
                    r.key
                ));
            }
            stored.insert((&r.key, r.token, value));
        }
    }
    for o in history.iter().filter(|o| o.op == "write" && o.ok()) {
        let value = o.value.unwrap_or(0);
        if !stored.contains(&(o.lock.as_str(), o.token.unwrap_or(0), value)) {
            v.push(format!("P4: acknowledged write is not in the store: {o:?}"));
        }
    }
}
