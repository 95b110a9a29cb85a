//! The names of the locks one session holds (`Session::held`): derived from the locks (not in
//! snapshots, rebuilt on decode), walked when the session ends to release them, and consulted by the
//! invariant checks.
//!
//! Most sessions hold a few locks with short names, often alike (`tenant-7/job-1`, `tenant-7/job-2`).
//! A `BTreeSet<LockName>` kept such a set in a B-tree leaf of 11 slots of 24 bytes, a 288-byte malloc
//! chunk: 28 MB of a server holding the design's 100,000 sessions of 10 locks (docs/performance.md,
//! "Held names, packed"). A small set is now one allocation of exactly its bytes: its names in order,
//! each as how many leading bytes it shares with the name before it, how many bytes follow, and those
//! bytes (front coding, as search indexes keep sorted terms). Ten names `hold/12345/0` to `/9` take
//! 14 + 9 × 3 = 41 bytes, a 64-byte chunk. A set that would pass [`PACKED_MAX_BYTES`], or that gets a
//! name longer than [`INLINE_NAME_BYTES`] (which the lock map keeps once, in an `Arc` that a B-tree
//! slot shares, where a packed set would copy it), becomes a B-tree and stays one until it is empty.
//!
//! Both forms give the names in the same order (their bytes', which is `LockName`'s), so which form a
//! session's set has never changes what the table does: every replica applies the same entries the
//! same way whatever its history of sets.

use crate::types::{LockName, INLINE_NAME_BYTES};
use std::collections::BTreeSet;

/// Most bytes a packed set takes before it becomes a B-tree. Insert and remove copy the set and
/// membership reads it from the start, so this bounds their work; 512 bytes holds 21 names that share
/// nothing, and up to 170 that differ in their last byte, more than most sessions ever hold.
pub(crate) const PACKED_MAX_BYTES: usize = 512;

/// A session's held names. 16 bytes; an empty set allocates nothing.
#[derive(Clone)]
pub(crate) struct HeldNames(Repr);

#[derive(Clone)]
enum Repr {
    /// `[shared][len][bytes]` for each name, in order: the name is the first `shared` bytes of the name
    /// before it (0 for the first) and then `len` (at least 1) more. Every name is at most
    /// `INLINE_NAME_BYTES` bytes, so both counts fit a byte. Exactly as long as its entries.
    Packed(Box<[u8]>),
    #[allow(
        clippy::box_collection,
        reason = "16 bytes in every session instead of 24, for a form few sessions ever take"
    )]
    Tree(Box<BTreeSet<LockName>>),
}

const _: () = assert!(std::mem::size_of::<HeldNames>() == 16);

impl Default for HeldNames {
    fn default() -> Self {
        HeldNames(Repr::Packed(Box::default()))
    }
}

/// Reads a packed set's entries in order, rebuilding each name from the one before.
struct Cursor<'a> {
    packed: &'a [u8],
    /// Where the next entry starts.
    at: usize,
    name: [u8; INLINE_NAME_BYTES],
    len: usize,
}

impl<'a> Cursor<'a> {
    fn new(packed: &'a [u8]) -> Self {
        Cursor {
            packed,
            at: 0,
            name: [0; INLINE_NAME_BYTES],
            len: 0,
        }
    }

    /// Moves to the next entry: false at the end.
    fn advance(&mut self) -> bool {
        let Some(&[shared, more]) = self.packed.get(self.at..self.at + 2) else {
            return false;
        };
        let (shared, more) = (usize::from(shared), usize::from(more));
        let from = self.at + 2;
        self.name[shared..shared + more].copy_from_slice(&self.packed[from..from + more]);
        self.len = shared + more;
        self.at = from + more;
        true
    }

    fn name(&self) -> &[u8] {
        &self.name[..self.len]
    }
}

/// The one or two entries an insert or a remove writes in place of the ones it changes, on the stack.
struct Entries {
    bytes: [u8; 2 * (2 + INLINE_NAME_BYTES)],
    len: usize,
}

impl Entries {
    fn new() -> Self {
        Entries {
            bytes: [0; 2 * (2 + INLINE_NAME_BYTES)],
            len: 0,
        }
    }

    /// Adds `name`'s entry after `before` (the name that precedes it; empty for the first).
    fn push(&mut self, before: &[u8], name: &[u8]) {
        let shared = before.iter().zip(name).take_while(|(a, b)| a == b).count();
        let more = name.len() - shared;
        self.bytes[self.len] = shared as u8;
        self.bytes[self.len + 1] = more as u8;
        self.bytes[self.len + 2..self.len + 2 + more].copy_from_slice(&name[shared..]);
        self.len += 2 + more;
    }

    fn as_slice(&self) -> &[u8] {
        &self.bytes[..self.len]
    }
}

/// `packed` with its bytes `range` replaced by `with`, in one allocation of exactly its length (glibc
/// grows or shrinks a small chunk in place when it can).
fn splice(packed: &mut Box<[u8]>, range: std::ops::Range<usize>, with: &[u8]) {
    let mut v = std::mem::take(packed).into_vec();
    v.reserve_exact(with.len().saturating_sub(range.len()));
    v.splice(range, with.iter().copied());
    *packed = v.into_boxed_slice();
}

/// Where `name` goes in a packed set: the entry that holds it or would follow it (its offset, and
/// whether it is `name`), with the name before that entry and the entry after it (the offset past
/// it, and its name), which are what an insert or a remove re-encodes.
struct Place {
    at: usize,
    found: bool,
    before: ([u8; INLINE_NAME_BYTES], usize),
    /// The entry after `at` (after `name` itself when found, after the place `name` would take
    /// otherwise is `at`'s own entry): where it ends, and its name. `None` at the end of the set.
    next: Option<(usize, [u8; INLINE_NAME_BYTES], usize)>,
}

fn place(packed: &[u8], name: &[u8]) -> Place {
    let mut c = Cursor::new(packed);
    let mut before = ([0; INLINE_NAME_BYTES], 0);
    loop {
        let at = c.at;
        if !c.advance() {
            return Place {
                at,
                found: false,
                before,
                next: None,
            };
        }
        match c.name().cmp(name) {
            std::cmp::Ordering::Less => before = (c.name, c.len),
            std::cmp::Ordering::Equal => {
                let next = c.advance().then_some((c.at, c.name, c.len));
                return Place {
                    at,
                    found: true,
                    before,
                    next,
                };
            }
            std::cmp::Ordering::Greater => {
                return Place {
                    at,
                    found: false,
                    before,
                    next: Some((c.at, c.name, c.len)),
                }
            }
        }
    }
}

/// The packed entries, each as the name it holds.
fn entries(packed: &[u8]) -> impl Iterator<Item = LockName> + '_ {
    let mut c = Cursor::new(packed);
    std::iter::from_fn(move || c.advance().then(|| LockName::from_valid_bytes(c.name())))
}

impl HeldNames {
    pub(crate) fn len(&self) -> usize {
        match &self.0 {
            Repr::Packed(p) => {
                let (mut at, mut n) = (0, 0);
                while at < p.len() {
                    at += 2 + usize::from(p[at + 1]);
                    n += 1;
                }
                n
            }
            Repr::Tree(t) => t.len(),
        }
    }

    pub(crate) fn contains(&self, name: &LockName) -> bool {
        match &self.0 {
            Repr::Packed(p) => {
                name.as_bytes().len() <= INLINE_NAME_BYTES && place(p, name.as_bytes()).found
            }
            Repr::Tree(t) => t.contains(name),
        }
    }

    /// Adds `name`; false if it was there already.
    pub(crate) fn insert(&mut self, name: &LockName) -> bool {
        let p = match &mut self.0 {
            Repr::Packed(p) => p,
            Repr::Tree(t) => return t.insert(name.clone()),
        };
        let bytes = name.as_bytes();
        if bytes.len() <= INLINE_NAME_BYTES {
            let Place {
                at,
                found,
                before: (before, before_len),
                next,
            } = place(p, bytes);
            if found {
                return false;
            }
            let mut with = Entries::new();
            with.push(&before[..before_len], bytes);
            let mut end = at;
            if let Some((next_end, next, next_len)) = next {
                with.push(bytes, &next[..next_len]);
                end = next_end;
            }
            if p.len() - (end - at) + with.len <= PACKED_MAX_BYTES {
                splice(p, at..end, with.as_slice());
                return true;
            }
        }
        let mut tree: BTreeSet<LockName> = entries(p).collect();
        let added = tree.insert(name.clone());
        self.0 = Repr::Tree(Box::new(tree));
        added
    }

    /// Removes `name`; false if it was not there.
    pub(crate) fn remove(&mut self, name: &LockName) -> bool {
        match &mut self.0 {
            Repr::Packed(p) => {
                let bytes = name.as_bytes();
                if bytes.len() > INLINE_NAME_BYTES {
                    return false;
                }
                let Place {
                    at,
                    found,
                    before: (before, before_len),
                    next,
                } = place(p, bytes);
                if !found {
                    return false;
                }
                // Never longer: the next name shares at least as much with the one before.
                let mut with = Entries::new();
                let mut end = p.len();
                if let Some((next_end, next, next_len)) = next {
                    with.push(&before[..before_len], &next[..next_len]);
                    end = next_end;
                }
                splice(p, at..end, with.as_slice());
                true
            }
            Repr::Tree(t) => {
                let removed = t.remove(name);
                if t.is_empty() {
                    *self = HeldNames::default();
                }
                removed
            }
        }
    }

    pub(crate) fn clear(&mut self) {
        *self = HeldNames::default();
    }

    /// The names, in order. Each is rebuilt from the set's bytes (at most 22 of them, in place) or
    /// cloned from the B-tree (which shares a long name's `Arc`).
    pub(crate) fn iter(&self) -> impl Iterator<Item = LockName> + '_ {
        let (packed, tree) = match &self.0 {
            Repr::Packed(p) => (Some(entries(p)), None),
            Repr::Tree(t) => (None, Some(t.iter().cloned())),
        };
        packed
            .into_iter()
            .flatten()
            .chain(tree.into_iter().flatten())
    }

    /// The packed bytes, if the set is packed (for tests).
    #[cfg(test)]
    fn packed(&self) -> Option<&[u8]> {
        match &self.0 {
            Repr::Packed(p) => Some(p),
            Repr::Tree(_) => None,
        }
    }
}

/// Equal when they hold the same names, whichever form each has.
impl PartialEq for HeldNames {
    fn eq(&self, other: &HeldNames) -> bool {
        self.iter().eq(other.iter())
    }
}

impl Eq for HeldNames {}

impl std::fmt::Debug for HeldNames {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_set().entries(self.iter()).finish()
    }
}

#[cfg(test)]
mod tests {
    use super::{HeldNames, PACKED_MAX_BYTES};
    use crate::types::LockName;
    use proptest::prelude::*;
    use std::collections::BTreeSet;

    /// One of 48 names: most 10 to 22 bytes (so a set of two thirds of them hovers around
    /// `PACKED_MAX_BYTES`), some a prefix of another (which sorts first), some with a two-byte
    /// character, and every twelfth longer than a name kept in place.
    fn name() -> impl Strategy<Value = LockName> {
        (0usize..48).prop_map(|i| {
            let base = ["a", "ab", "a/b", "b", "é"][i % 5];
            let len = if i % 12 == 11 {
                23 + i % 7
            } else {
                10 + (i * 7) % 13
            };
            let mut s = format!("{base}{i}");
            while s.len() < len {
                s.push('x');
            }
            LockName::new(s).expect("a valid name")
        })
    }

    #[derive(Debug, Clone)]
    enum Op {
        Insert(LockName),
        Remove(LockName),
        Clear,
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            6 => name().prop_map(Op::Insert),
            3 => name().prop_map(Op::Remove),
            1 => Just(Op::Clear),
        ]
    }

    proptest! {
        /// Against a `BTreeSet` of the same names: every answer and, after every step, the length, the
        /// names in order, membership, and the form (packed exactly while every name fits in place and
        /// the bytes fit; a B-tree, once it is one, until the set is empty).
        #[test]
        fn a_set_of_held_names_behaves_as_a_btreeset(ops in proptest::collection::vec(op(), 0..300)) {
            let (mut set, mut model) = (HeldNames::default(), BTreeSet::new());
            let mut was_tree = false;
            for op in ops {
                match op {
                    Op::Insert(n) => prop_assert_eq!(set.insert(&n), model.insert(n.clone())),
                    Op::Remove(n) => prop_assert_eq!(set.remove(&n), model.remove(&n)),
                    Op::Clear => {
                        set.clear();
                        model.clear();
                    }
                }
                prop_assert_eq!(set.len(), model.len());
                prop_assert!(set.iter().eq(model.iter().cloned()));
                for n in &model {
                    prop_assert!(set.contains(n));
                }
                let bytes = front_coded_bytes(&model);
                let fits = model.iter().all(|n| n.as_bytes().len() <= crate::types::INLINE_NAME_BYTES)
                    && bytes <= PACKED_MAX_BYTES;
                was_tree = (was_tree || !fits) && !model.is_empty();
                prop_assert_eq!(set.packed().map(<[u8]>::len), (!was_tree).then_some(bytes));
                let mut rebuilt = HeldNames::default();
                for n in &model {
                    rebuilt.insert(n);
                }
                prop_assert_eq!(&rebuilt, &set);
            }
            // Emptied one name at a time, a B-tree goes back to the packed form.
            for n in std::mem::take(&mut model) {
                prop_assert!(set.remove(&n));
                prop_assert!(!set.contains(&n));
            }
            prop_assert_eq!(set.len(), 0);
            prop_assert_eq!(set.packed(), Some(&[][..]));
            prop_assert_eq!(set, HeldNames::default());
        }
    }

    /// What the names take front-coded, counted apart from the code under test: two bytes a name and
    /// what it does not share with the name before.
    fn front_coded_bytes(names: &BTreeSet<LockName>) -> usize {
        let mut before: &[u8] = &[];
        let mut bytes = 0;
        for n in names {
            let n = n.as_bytes();
            let shared = before.iter().zip(n).take_while(|(a, b)| a == b).count();
            bytes += 2 + n.len() - shared;
            before = n;
        }
        bytes
    }

    #[test]
    fn ten_alike_names_take_what_each_adds() {
        let mut set = HeldNames::default();
        for i in (0..10).rev() {
            assert!(set.insert(&LockName::new(format!("hold/12345/{i}")).unwrap()));
        }
        assert_eq!(set.packed().map(<[u8]>::len), Some(14 + 9 * 3));
        assert!(!set.insert(&LockName::new("hold/12345/3").unwrap()));
        assert_eq!(set.len(), 10);
        assert!(set.remove(&LockName::new("hold/12345/0").unwrap()));
        assert_eq!(set.packed().map(<[u8]>::len), Some(14 + 8 * 3));
        assert_eq!(set.iter().next().unwrap().as_str(), "hold/12345/1");
    }

    #[test]
    fn a_set_is_packed_up_to_its_limit_and_a_btree_past_it() {
        // 28 names of 16 bytes and one of 6, no two sharing a first byte: 28 * 18 + 8 bytes.
        let firsts = ('A'..='Z').chain('a'..='b');
        let mut set = HeldNames::default();
        for c in firsts {
            set.insert(&LockName::new(format!("{c}{}", "x".repeat(15))).unwrap());
        }
        set.insert(&LockName::new("cxxxxx").unwrap());
        assert_eq!(28 * 18 + 8, PACKED_MAX_BYTES);
        assert_eq!(
            set.packed().map(<[u8]>::len),
            Some(PACKED_MAX_BYTES),
            "at the limit"
        );
        set.insert(&LockName::new("zz").unwrap());
        assert!(set.packed().is_none(), "past it");
        assert!(set.remove(&LockName::new("zz").unwrap()));
        assert!(
            set.packed().is_none(),
            "a B-tree stays one until it is empty"
        );
        assert_eq!(set.len(), 29);
    }
}
