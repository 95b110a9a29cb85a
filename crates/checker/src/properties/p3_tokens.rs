//! **P3: tokens**, on the client history. Per lock, the tokens of acknowledged grants are unique and
//! nonzero, and a grant that completed before another was invoked has the smaller token (real-time
//! order).
//!
//! Input: the history's `acquire` operations whose result is `ok`. The log side of P3 (a grant's token is
//! its log index, tokens per lock increase along the log) is checked while replaying the log, in
//! [`super::p1_one_holder`].
//!
//! Why it matters: the fencing token is what a protected resource uses to refuse a stale holder (P4); that
//! only works if a later holder always carries a larger token than every earlier one.

use crate::model::Op;
use std::collections::HashMap;

/// P3 on the history: unique tokens per lock, and real-time order.
pub fn check(history: &[Op], v: &mut Vec<String>) {
    let mut by_lock: HashMap<&str, Vec<&Op>> = HashMap::new();
    for o in history.iter().filter(|o| o.op == "acquire" && o.ok()) {
        by_lock.entry(&o.lock).or_default().push(o);
    }
    for (lock, mut grants) in by_lock {
        let mut seen: HashMap<u64, &Op> = HashMap::new();
        for g in &grants {
            let token = g.token.unwrap_or(0);
            if token == 0 {
                v.push(format!("P3: lock {lock:?} granted with token 0 to {g:?}"));
            }
            if let Some(other) = seen.insert(token, g) {
                v.push(format!(
                    "P3: lock {lock:?} token {token} granted twice: {other:?} and {g:?}"
                ));
            }
        }
        grants.sort_by_key(|g| g.complete_ms);
        // For each grant, every grant invoked after it completed must have a larger token.
        for (i, a) in grants.iter().enumerate() {
            for b in &grants[i + 1..] {
                if b.invoke_ms > a.complete_ms && b.token <= a.token {
                    v.push(format!("P3: lock {lock:?}: grant {b:?} invoked after {a:?} completed has a token not above it"));
                }
            }
        }
    }
}
