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
/// membership reads it from the start, so this bounds their work; 512 bytes holds 21 names of 22 bytes
/// that share no first byte, and up to 170 names that differ only in their last byte: more than most
/// sessions ever hold.
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
        reason = "the set in 16 bytes instead of 24 or more, for a form few sessions ever take"
    )]
    Tree(Box<BTreeSet<LockName>>),
}

const _: () = assert!(std::mem::size_of::<HeldNames>() == 16);

impl Default for HeldNames {
    fn default() -> Self {
        HeldNames(Repr::Packed(Box::default()))
    }
}

/// A name rebuilt from a packed set, on the stack.
#[derive(Clone, Copy)]
struct Name {
    bytes: [u8; INLINE_NAME_BYTES],
    len: usize,
}

impl Name {
    const EMPTY: Name = Name {
        bytes: [0; INLINE_NAME_BYTES],
        len: 0,
    };

    fn as_bytes(&self) -> &[u8] {
        &self.bytes[..self.len]
    }
}

/// Reads a packed set's entries in order, rebuilding each name from the one before.
struct Cursor<'a> {
    packed: &'a [u8],
    /// Where the next entry starts.
    at: usize,
    name: Name,
}

impl<'a> Cursor<'a> {
    fn new(packed: &'a [u8]) -> Self {
        Cursor {
            packed,
            at: 0,
            name: Name::EMPTY,
        }
    }

    /// Moves to the next entry: false at the end.
    fn advance(&mut self) -> bool {
        let Some(&[shared, more]) = self.packed.get(self.at..self.at + 2) else {
            return false;
        };
        let (shared, more) = (usize::from(shared), usize::from(more));
        let from = self.at + 2;
        self.name.bytes[shared..shared + more].copy_from_slice(&self.packed[from..from + more]);
        self.name.len = shared + more;
        self.at = from + more;
        true
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
    before: Name,
    /// The entry that follows `name`: when `name` was found, the entry after its own; otherwise the
    /// entry at `at`, which `name` would go before. Where that entry ends, and its name; `None` when no
    /// entry follows.
    next: Option<(usize, Name)>,
}

fn place(packed: &[u8], name: &[u8]) -> Place {
    let mut c = Cursor::new(packed);
    let mut before = Name::EMPTY;
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
        match c.name.as_bytes().cmp(name) {
            std::cmp::Ordering::Less => before = c.name,
            std::cmp::Ordering::Equal => {
                let next = c.advance().then_some((c.at, c.name));
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
                    next: Some((c.at, c.name)),
                }
            }
        }
    }
}

/// The packed entries, each as the name it holds.
fn entries(packed: &[u8]) -> impl Iterator<Item = LockName> + '_ {
    let mut c = Cursor::new(packed);
    std::iter::from_fn(move || {
        c.advance()
            .then(|| LockName::from_valid_bytes(c.name.as_bytes()))
    })
}

impl HeldNames {
    /// How many names. A packed set is counted by walking its entries (at most
    /// `PACKED_MAX_BYTES` / 3 of them), which an acquire does once to check the session's limit.
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
            let place = place(p, bytes);
            if place.found {
                return false;
            }
            let mut with = Entries::new();
            with.push(place.before.as_bytes(), bytes);
            let mut end = place.at;
            if let Some((next_end, next)) = &place.next {
                with.push(bytes, next.as_bytes());
                end = *next_end;
            }
            if p.len() - (end - place.at) + with.len <= PACKED_MAX_BYTES {
                splice(p, place.at..end, with.as_slice());
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
                let place = place(p, bytes);
                if !place.found {
                    return false;
                }
                // The next name's new entry is shorter than the two it replaces: with the name before
                // it shares at least the lesser of what it shared with the removed name and what the
                // removed name shared with that name.
                let mut with = Entries::new();
                let mut end = p.len();
                if let Some((next_end, next)) = &place.next {
                    with.push(place.before.as_bytes(), next.as_bytes());
                    end = *next_end;
                }
                splice(p, place.at..end, with.as_slice());
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
    use crate::types::{LockName, INLINE_NAME_BYTES};
    use proptest::prelude::*;
    use std::collections::BTreeSet;

    /// The names a case draws from: 48 pairs, the first of each a prefix of the second (so it sorts
    /// just before it), of 3 to 22 bytes, some with a two-byte character; with `long`, every eighth
    /// pair's second name is longer than a name kept in place. Sets of them pass `PACKED_MAX_BYTES`
    /// between clears (counted once: in 256 cases about 70 sets became B-trees by size, and nearly
    /// 900 steps left a packed set within 32 bytes of the limit).
    fn pool(long: bool) -> Vec<LockName> {
        let mut names = Vec::new();
        for j in 0..48u64 {
            let base = ["a", "ab", "a/b", "b", "é"][(j % 5) as usize];
            let mut full = format!("{base}{:06x}", j.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 40);
            let len = if long && j % 8 == 7 {
                23 + j % 7
            } else {
                12 + (j * 5) % 11
            };
            let pad = char::from(b'k' + (j % 10) as u8);
            while (full.len() as u64) < len {
                full.push(pad);
            }
            let prefix = full[..base.len() + 1 + (j % 4) as usize].to_string();
            names.push(LockName::new(prefix).expect("a valid name"));
            names.push(LockName::new(full).expect("a valid name"));
        }
        names
    }

    #[derive(Debug, Clone)]
    enum Op {
        Insert(usize),
        Remove(usize),
        Clear,
    }

    /// Few clears, so that sets grow to and past `PACKED_MAX_BYTES` between them.
    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            80 => (0usize..96).prop_map(Op::Insert),
            32 => (0usize..96).prop_map(Op::Remove),
            1 => Just(Op::Clear),
        ]
    }

    /// The names front-coded, computed apart from the code under test: for each name, the count of
    /// leading bytes it shares with the name before, the count of bytes that follow, and those bytes.
    fn front_coded(names: &BTreeSet<LockName>) -> Vec<u8> {
        let mut before: &[u8] = &[];
        let mut out = Vec::new();
        for n in names {
            let n = n.as_bytes();
            let shared = before.iter().zip(n).take_while(|(a, b)| a == b).count();
            out.push(shared as u8);
            out.push((n.len() - shared) as u8);
            out.extend_from_slice(&n[shared..]);
            before = n;
        }
        out
    }

    proptest! {
        /// Against a `BTreeSet` of the same names: every answer and, after every step, the length, the
        /// names in order, membership of the step's name and of all the set's, equality with the same
        /// names in the other form, and the form: packed, with exactly the front-coded bytes, while
        /// every name fits in place and the bytes fit; a B-tree, once it is one, until the set is
        /// empty. Then the set, emptied one name at a time, is packed again.
        #[test]
        fn a_set_of_held_names_behaves_as_a_btreeset(
            long in any::<bool>(),
            ops in proptest::collection::vec(op(), 0..400),
        ) {
            let names = pool(long);
            let never_held = LockName::new("z".repeat(30)).expect("a valid name");
            let (mut set, mut model) = (HeldNames::default(), BTreeSet::new());
            let mut was_tree = false;
            for op in ops {
                let name = match op {
                    Op::Insert(i) => {
                        prop_assert_eq!(set.insert(&names[i]), model.insert(names[i].clone()));
                        Some(&names[i])
                    }
                    Op::Remove(i) => {
                        prop_assert_eq!(set.remove(&names[i]), model.remove(&names[i]));
                        Some(&names[i])
                    }
                    Op::Clear => {
                        set.clear();
                        model.clear();
                        None
                    }
                };
                if let Some(n) = name {
                    prop_assert_eq!(set.contains(n), model.contains(n));
                }
                prop_assert!(!set.contains(&never_held));
                prop_assert_eq!(set.len(), model.len());
                prop_assert!(set.iter().eq(model.iter().cloned()));
                for n in &model {
                    prop_assert!(set.contains(n));
                }
                let coded = front_coded(&model);
                let fits = model.iter().all(|n| n.as_bytes().len() <= INLINE_NAME_BYTES)
                    && coded.len() <= PACKED_MAX_BYTES;
                was_tree = (was_tree || !fits) && !model.is_empty();
                prop_assert_eq!(set.packed(), (!was_tree).then_some(&coded[..]));
                // The same names in the other form are equal to it.
                let mut other = HeldNames::default();
                if !was_tree {
                    other.insert(&never_held);
                }
                for n in &model {
                    other.insert(n);
                }
                if !was_tree {
                    other.remove(&never_held);
                    prop_assert!(other.packed().is_none() || model.is_empty());
                }
                prop_assert_eq!(&other, &set);
            }
            for n in std::mem::take(&mut model) {
                prop_assert!(set.remove(&n));
                prop_assert!(!set.contains(&n));
            }
            prop_assert_eq!(set.len(), 0);
            prop_assert_eq!(set.packed(), Some(&[][..]));
            prop_assert_eq!(set, HeldNames::default());
        }
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
        let mut names: Vec<String> = ('A'..='Z')
            .chain('a'..='b')
            .map(|c| format!("{c}{}", "x".repeat(15)))
            .collect();
        names.push("cxxxxx".into());
        let mut set = HeldNames::default();
        for n in &names {
            assert!(set.insert(&LockName::new(n.as_str()).unwrap()));
        }
        assert_eq!(28 * 18 + 8, PACKED_MAX_BYTES);
        assert_eq!(
            set.packed().map(<[u8]>::len),
            Some(PACKED_MAX_BYTES),
            "at the limit"
        );
        assert!(set.insert(&LockName::new("zz").unwrap()));
        assert!(set.packed().is_none(), "past it");
        names.push("zz".into());
        assert!(set
            .iter()
            .map(|n| n.as_str().to_string())
            .eq(names.iter().cloned()));
        assert!(set.remove(&LockName::new("zz").unwrap()));
        assert!(
            set.packed().is_none(),
            "a B-tree stays one until it is empty"
        );
        names.pop();
        assert!(set
            .iter()
            .map(|n| n.as_str().to_string())
            .eq(names.iter().cloned()));
    }
}
