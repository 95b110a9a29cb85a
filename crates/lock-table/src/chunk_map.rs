//! [`ChunkMap`]: the ordered map the table's sessions and locks live in (under [`crate::cow::SnapMap`]).
//!
//! Why not `BTreeMap`: at the design's scale (1,000,000 locks) the map is the largest part of a server's
//! memory after the locks themselves, and a `BTreeMap` pays for it twice. Its nodes end barely over half
//! full when keys arrive about in order (lock names such as `tenant-7/job-3`, taken one session after
//! another), and its 11-slot nodes are too small to hold the values in place, so each value was a `Box` of
//! its own (a malloc chunk with its header). A `ChunkMap` keeps sorted runs ("chunks") of up to
//! [`ChunkMap::CAP`] entries, about 8 KiB each, **values in place**, with a sorted array of each chunk's
//! first key to find a chunk by binary search. A chunk that is full lends an entry to a neighbour that has
//! room before it splits, and an insert past the last key starts a new chunk instead of splitting the last
//! one, so chunks stay nearly full under in-order and random inserts alike.
//!
//! Invariants (checked by [`ChunkMap::check`], which the table's `check_invariants` calls):
//! - every chunk is non-empty, holds at most `CAP` entries in strictly increasing key order, and every key
//!   of a chunk is below every key of the next;
//! - `firsts[i]` is chunk `i`'s first key, and `len` is the number of entries;
//! - every chunk but the last holds at least `HALF` (half of `CAP`) entries, so the map is at least half
//!   full whatever the order of changes, as a B-tree is: a chunk that falls below half takes an entry from
//!   a neighbour that can spare one, or else merges with one (they fit in one chunk). A split makes two
//!   halves; the last chunk is exempt so that in-order inserts can start it with one entry. One lock
//!   taken and given back over and over at a chunk's edge moves at most one entry each time, never the
//!   top-level arrays: a split leaves room for the next insert, and a merge or a borrow leaves room for
//!   the next removal.
//!
//! Cost: a lookup is two binary searches; an insert or removal moves on average half a chunk (~4 KiB), and a
//! split or merge also moves the two top-level arrays (24 bytes a chunk: ~260 KiB each at 1,000,000 locks),
//! which happens about once per `CAP / 2` inserts at worst.

use std::borrow::Borrow;
use std::cmp::Ordering;
use std::ops::Bound;

pub(crate) struct ChunkMap<K, V> {
    /// `firsts[i]` is the first key of `chunks[i]`: one contiguous array for the binary search.
    firsts: Vec<K>,
    /// Each allocated with room for exactly `CAP` entries, and never grown past it.
    chunks: Vec<Vec<(K, V)>>,
    len: usize,
}

impl<K, V> ChunkMap<K, V> {
    /// Entries per chunk: about 8 KiB of them (at least 8).
    pub(crate) const CAP: usize = {
        let size = std::mem::size_of::<(K, V)>();
        if size == 0 || 8192 / size < 8 {
            8
        } else {
            8192 / size
        }
    };
    /// Every chunk but the last holds at least this many entries.
    const HALF: usize = Self::CAP / 2;

    pub(crate) fn new() -> Self {
        ChunkMap {
            firsts: Vec::new(),
            chunks: Vec::new(),
            len: 0,
        }
    }

    pub(crate) fn len(&self) -> usize {
        self.len
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Every entry in key order.
    pub(crate) fn iter(&self) -> Iter<'_, K, V> {
        Iter {
            chunk: [].iter(),
            rest: self.chunks.iter(),
            left: self.len,
        }
    }

    pub(crate) fn values_mut(&mut self) -> impl Iterator<Item = &mut V> {
        self.chunks
            .iter_mut()
            .flat_map(|c| c.iter_mut().map(|(_, v)| v))
    }

    fn new_chunk() -> Vec<(K, V)> {
        Vec::with_capacity(Self::CAP)
    }
}

impl<K: Ord + Clone, V> ChunkMap<K, V> {
    /// The chunk `key` belongs in: the last one whose first key is at or below it (chunk 0 for a key
    /// below every key). The map must not be empty.
    fn chunk_for<Q: ?Sized + Ord>(&self, key: &Q) -> usize
    where
        K: Borrow<Q>,
    {
        self.firsts
            .partition_point(|f| f.borrow() <= key)
            .saturating_sub(1)
    }

    /// Where `key` is (`Ok`) or would go (`Err`): its chunk and its position there.
    fn find<Q: ?Sized + Ord>(&self, key: &Q) -> (usize, Result<usize, usize>)
    where
        K: Borrow<Q>,
    {
        let c = self.chunk_for(key);
        (
            c,
            self.chunks[c].binary_search_by(|(k, _)| k.borrow().cmp(key)),
        )
    }

    pub(crate) fn get<Q: ?Sized + Ord>(&self, key: &Q) -> Option<&V>
    where
        K: Borrow<Q>,
    {
        if self.is_empty() {
            return None;
        }
        match self.find(key) {
            (c, Ok(i)) => Some(&self.chunks[c][i].1),
            _ => None,
        }
    }

    pub(crate) fn get_mut<Q: ?Sized + Ord>(&mut self, key: &Q) -> Option<&mut V>
    where
        K: Borrow<Q>,
    {
        if self.is_empty() {
            return None;
        }
        match self.find(key) {
            (c, Ok(i)) => Some(&mut self.chunks[c][i].1),
            _ => None,
        }
    }

    pub(crate) fn contains_key<Q: ?Sized + Ord>(&self, key: &Q) -> bool
    where
        K: Borrow<Q>,
    {
        self.get(key).is_some()
    }

    /// Entries from `from` on, in key order.
    pub(crate) fn range_from<Q: ?Sized + Ord>(&self, from: Bound<&Q>) -> Iter<'_, K, V>
    where
        K: Borrow<Q>,
    {
        let (key, inclusive) = match from {
            Bound::Unbounded => return self.iter(),
            Bound::Included(k) => (k, true),
            Bound::Excluded(k) => (k, false),
        };
        if self.is_empty() {
            return self.iter();
        }
        let (c, at) = self.find(key);
        let i = match at {
            Ok(i) if inclusive => i,
            Ok(i) => i + 1,
            Err(i) => i,
        };
        let before: usize = self.chunks[..c].iter().map(Vec::len).sum::<usize>() + i;
        Iter {
            chunk: self.chunks[c][i..].iter(),
            rest: self.chunks[c + 1..].iter(),
            left: self.len - before,
        }
    }

    /// Inserts or replaces; returns the value replaced.
    pub(crate) fn insert(&mut self, key: K, value: V) -> Option<V> {
        if self.is_empty() {
            let mut chunk = Self::new_chunk();
            self.firsts.push(key.clone());
            chunk.push((key, value));
            self.chunks.push(chunk);
            self.len = 1;
            return None;
        }
        let last = self.chunks.len() - 1;
        let (c, i) = if self.chunks[last].last().is_some_and(|(k, _)| *k < key) {
            // Past every key (decoding a snapshot, in-order inserts): no search.
            (last, self.chunks[last].len())
        } else {
            match self.find(&key) {
                (c, Ok(i)) => return Some(std::mem::replace(&mut self.chunks[c][i].1, value)),
                (c, Err(i)) => (c, i),
            }
        };
        self.len += 1;
        if self.chunks[c].len() < Self::CAP {
            self.chunks[c].insert(i, (key, value));
            if i == 0 {
                self.fix_first(c);
            }
            return None;
        }
        if c == last && i == Self::CAP {
            // Past the last key: a new chunk, so in-order inserts leave full chunks behind them.
            self.firsts.push(key.clone());
            let mut chunk = Self::new_chunk();
            chunk.push((key, value));
            self.chunks.push(chunk);
        } else if c < last && self.chunks[c + 1].len() < Self::CAP {
            // The right neighbour has room: it takes this chunk's last entry (or the new one).
            let moved = if i == Self::CAP {
                (key, value)
            } else {
                let moved = self.chunks[c].pop().expect("a full chunk");
                self.chunks[c].insert(i, (key, value));
                if i == 0 {
                    self.fix_first(c);
                }
                moved
            };
            self.chunks[c + 1].insert(0, moved);
            self.fix_first(c + 1);
        } else if c > 0 && self.chunks[c - 1].len() < Self::CAP {
            // The left neighbour has room: it takes this chunk's first entry (or the new one).
            if i == 0 {
                self.chunks[c - 1].push((key, value));
            } else {
                let moved = self.chunks[c].remove(0);
                self.chunks[c - 1].push(moved);
                self.chunks[c].insert(i - 1, (key, value));
                self.fix_first(c);
            }
        } else {
            // Both neighbours full (or absent): split in halves.
            let half = Self::CAP / 2;
            let mut right = Self::new_chunk();
            right.extend(self.chunks[c].drain(half..));
            if i <= half {
                self.chunks[c].insert(i, (key, value));
                if i == 0 {
                    self.fix_first(c);
                }
            } else {
                right.insert(i - half, (key, value));
            }
            self.firsts.insert(c + 1, right[0].0.clone());
            self.chunks.insert(c + 1, right);
        }
        None
    }

    pub(crate) fn remove<Q: ?Sized + Ord>(&mut self, key: &Q) -> Option<V>
    where
        K: Borrow<Q>,
    {
        if self.is_empty() {
            return None;
        }
        let (c, i) = match self.find(key) {
            (c, Ok(i)) => (c, i),
            _ => return None,
        };
        let (_, value) = self.chunks[c].remove(i);
        self.len -= 1;
        if self.chunks[c].is_empty() {
            // Only the last chunk can empty (the others hold at least `HALF`, at least 4).
            self.chunks.remove(c);
            self.firsts.remove(c);
            return Some(value);
        }
        if i == 0 {
            self.fix_first(c);
        }
        if c + 1 < self.chunks.len() && self.chunks[c].len() < Self::HALF {
            self.refill(c);
        }
        Some(value)
    }

    /// Chunk `c`, not the last, fell one below half: it takes an entry from a neighbour that holds more
    /// than half, or else merges with one (both then hold at most half: they fit in one chunk).
    fn refill(&mut self, c: usize) {
        if c > 0 && self.chunks[c - 1].len() > Self::HALF {
            let moved = self.chunks[c - 1].pop().expect("more than half full");
            self.chunks[c].insert(0, moved);
            self.fix_first(c);
        } else if self.chunks[c + 1].len() > Self::HALF {
            let moved = self.chunks[c + 1].remove(0);
            self.chunks[c].push(moved);
            self.fix_first(c + 1);
        } else if c > 0 {
            self.merge_into_left(c - 1);
        } else {
            self.merge_into_left(c);
        }
    }

    /// Moves chunk `c + 1`'s entries to the end of chunk `c` and drops it.
    fn merge_into_left(&mut self, c: usize) {
        let right = self.chunks.remove(c + 1);
        self.firsts.remove(c + 1);
        self.chunks[c].extend(right);
    }

    fn fix_first(&mut self, c: usize) {
        self.firsts[c] = self.chunks[c][0].0.clone();
    }

    /// Checks the invariants in the module docs; panics on the first one broken. O(size).
    pub(crate) fn check(&self) {
        assert_eq!(
            self.firsts.len(),
            self.chunks.len(),
            "one first key a chunk"
        );
        assert_eq!(
            self.chunks.iter().map(Vec::len).sum::<usize>(),
            self.len,
            "len counts every entry"
        );
        let mut before: Option<&K> = None;
        for (c, chunk) in self.chunks.iter().enumerate() {
            assert!(!chunk.is_empty(), "chunk {c} is empty");
            assert!(chunk.len() <= Self::CAP, "chunk {c} holds too many");
            assert!(
                self.firsts[c] == chunk[0].0,
                "chunk {c}'s first key is stale"
            );
            for (k, _) in chunk {
                assert!(
                    before.is_none_or(|b| b.cmp(k) == Ordering::Less),
                    "keys out of order in chunk {c}"
                );
                before = Some(k);
            }
            if c + 1 < self.chunks.len() {
                assert!(
                    chunk.len() >= Self::HALF,
                    "chunk {c} is less than half full"
                );
            }
        }
    }
}

impl<K: Ord + Clone, V> FromIterator<(K, V)> for ChunkMap<K, V> {
    /// In any order; for equal keys the last one wins (as with `BTreeMap`). In-order input fills chunks.
    fn from_iter<I: IntoIterator<Item = (K, V)>>(iter: I) -> Self {
        let mut map = ChunkMap::new();
        for (k, v) in iter {
            map.insert(k, v);
        }
        map
    }
}

/// A copy keeps chunks of the same capacity, so it grows as the original would.
impl<K: Clone, V: Clone> Clone for ChunkMap<K, V> {
    fn clone(&self) -> Self {
        ChunkMap {
            firsts: self.firsts.clone(),
            chunks: self
                .chunks
                .iter()
                .map(|c| {
                    let mut copy = Self::new_chunk();
                    copy.extend(c.iter().cloned());
                    copy
                })
                .collect(),
            len: self.len,
        }
    }
}

/// Equal entries; how they are split into chunks does not matter.
impl<K: PartialEq, V: PartialEq> PartialEq for ChunkMap<K, V> {
    fn eq(&self, other: &Self) -> bool {
        self.len == other.len && self.iter().eq(other.iter())
    }
}
impl<K: Eq, V: Eq> Eq for ChunkMap<K, V> {}

impl<K: std::fmt::Debug, V: std::fmt::Debug> std::fmt::Debug for ChunkMap<K, V> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_map().entries(self.iter()).finish()
    }
}

impl<K: Ord + Clone + Borrow<Q>, Q: ?Sized + Ord, V> std::ops::Index<&Q> for ChunkMap<K, V> {
    type Output = V;
    fn index(&self, key: &Q) -> &V {
        self.get(key).expect("no entry for the key")
    }
}

impl<'a, K, V> IntoIterator for &'a ChunkMap<K, V> {
    type Item = (&'a K, &'a V);
    type IntoIter = Iter<'a, K, V>;
    fn into_iter(self) -> Iter<'a, K, V> {
        self.iter()
    }
}

/// Entries in key order (from [`ChunkMap::iter`] or [`ChunkMap::range_from`]).
pub(crate) struct Iter<'a, K, V> {
    chunk: std::slice::Iter<'a, (K, V)>,
    rest: std::slice::Iter<'a, Vec<(K, V)>>,
    /// Entries not yet yielded, for `size_hint` (and so `ExactSizeIterator`).
    left: usize,
}

impl<'a, K, V> Iterator for Iter<'a, K, V> {
    type Item = (&'a K, &'a V);
    fn next(&mut self) -> Option<Self::Item> {
        loop {
            if let Some((k, v)) = self.chunk.next() {
                self.left -= 1;
                return Some((k, v));
            }
            self.chunk = self.rest.next()?.iter();
        }
    }
    fn size_hint(&self) -> (usize, Option<usize>) {
        (self.left, Some(self.left))
    }
}

impl<K, V> ExactSizeIterator for Iter<'_, K, V> {}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::collections::BTreeMap;

    /// Small entries, so a few hundred keys make many chunks (`CAP` is 8192 / 16 = 512 for `(u64, u64)`:
    /// the tests use a wide value instead).
    type Wide = [u64; 64];
    type Map = ChunkMap<u32, Wide>;

    fn v(x: u64) -> Wide {
        [x; 64]
    }

    #[derive(Clone, Debug)]
    enum Op {
        Insert(u32, u64),
        Remove(u32),
    }

    fn ops() -> impl Strategy<Value = Vec<Op>> {
        // Keys from a small range so inserts and removals meet; some runs in order.
        let op = prop_oneof![
            3 => (0u32..400, any::<u64>()).prop_map(|(k, x)| Op::Insert(k, x)),
            2 => (0u32..400).prop_map(Op::Remove),
        ];
        prop::collection::vec(op, 0..1500)
    }

    fn same(map: &Map, model: &BTreeMap<u32, Wide>) {
        map.check();
        assert_eq!(map.len(), model.len());
        assert!(map
            .iter()
            .map(|(k, v)| (*k, v[0]))
            .eq(model.iter().map(|(k, v)| (*k, v[0]))));
    }

    proptest! {
        /// Every insert, replace, removal, lookup and range agrees with `BTreeMap`, and the chunks keep
        /// their invariants after every step.
        #[test]
        fn behaves_as_a_btreemap(ops in ops(), probes in prop::collection::vec(0u32..410, 20)) {
            let mut map = Map::new();
            let mut model = BTreeMap::new();
            for op in ops {
                match op {
                    Op::Insert(k, x) => {
                        prop_assert_eq!(map.insert(k, v(x)).map(|w| w[0]), model.insert(k, v(x)).map(|w| w[0]));
                    }
                    Op::Remove(k) => {
                        prop_assert_eq!(map.remove(&k).map(|w| w[0]), model.remove(&k).map(|w| w[0]));
                    }
                }
                map.check();
                prop_assert_eq!(map.len(), model.len());
            }
            same(&map, &model);
            for p in probes {
                prop_assert_eq!(map.get(&p).map(|w| w[0]), model.get(&p).map(|w| w[0]));
                prop_assert_eq!(map.contains_key(&p), model.contains_key(&p));
                for bound in [Bound::Included(&p), Bound::Excluded(&p), Bound::Unbounded] {
                    let got: Vec<u32> = map.range_from(bound).map(|(k, _)| *k).collect();
                    let want: Vec<u32> = model.range((bound, Bound::Unbounded)).map(|(k, _)| *k).collect();
                    prop_assert_eq!(map.range_from(bound).len(), want.len());
                    prop_assert_eq!(got, want);
                }
                if let Some(w) = map.get_mut(&p) {
                    w[0] = w[0].wrapping_add(1);
                    model.get_mut(&p).expect("present in both")[0] = w[0];
                }
            }
            same(&map, &model);
            prop_assert!(map.clone() == map);
            let rebuilt: Map = map.iter().map(|(k, v)| (*k, *v)).collect();
            prop_assert!(rebuilt == map);
        }
    }

    /// Chunks fill up whatever order the keys come in: the point of the map (a `BTreeMap`'s nodes end
    /// about half full under in-order inserts).
    #[test]
    fn chunks_stay_nearly_full() {
        let n = 20_000u32;
        let fill = |map: &Map| map.len() as f64 / (map.chunks.len() * Map::CAP) as f64;
        let in_order: Map = (0..n).map(|k| (k, v(0))).collect();
        in_order.check();
        assert!(fill(&in_order) > 0.99, "in order: {}", fill(&in_order));
        // Interleaved: 64 "sessions" each taking its next key in turn (the hold bench's pattern).
        let mut interleaved = Map::new();
        for round in 0..(n / 64) {
            for s in 0..64 {
                interleaved.insert(s * n + round, v(0));
            }
        }
        interleaved.check();
        assert!(
            fill(&interleaved) > 0.95,
            "interleaved: {}",
            fill(&interleaved)
        );
        // A scattered order (a multiplicative permutation of 0..n).
        let scattered: Map = (0..n)
            .map(|k| (k.wrapping_mul(2_654_435_761) % n, v(0)))
            .collect();
        scattered.check();
        assert!(fill(&scattered) > 0.8, "scattered: {}", fill(&scattered));
    }

    /// However entries are removed, every chunk but the last stays at least half full (a `BTreeMap`'s
    /// guarantee), where merging only neighbours that together hold 3/4 of a chunk would let thinning
    /// leave the map about 3/8 full.
    #[test]
    fn removals_leave_chunks_at_least_half_full() {
        let n = 20_000u32;
        let mut map: Map = (0..n).map(|k| (k, v(0))).collect();
        // Thin every chunk to just over a third, from the front and from the back.
        for k in (0..n).filter(|k| k % 3 != 0) {
            map.remove(&k);
        }
        map.check();
        let mut map: Map = (0..n).map(|k| (k, v(0))).collect();
        for k in (0..n).rev().filter(|k| k % 8 != 0) {
            map.remove(&k);
        }
        map.check();
        let full = map.chunks.len() - 1;
        assert!(map.chunks[..full].iter().all(|c| c.len() >= Map::CAP / 2));
        assert_eq!(map.len(), (n / 8) as usize);
    }

    /// One key acquired and released over and over at a chunk's edge does not split and merge each time.
    #[test]
    fn a_key_coming_and_going_at_an_edge_moves_no_chunks() {
        let cap = Map::CAP as u32;
        let mut map: Map = (0..cap * 3).map(|k| (k * 2, v(0))).collect();
        let chunks = map.chunks.len();
        for _ in 0..100 {
            map.insert(cap * 2 + 1, v(1));
            let after_insert = map.chunks.len();
            map.remove(&(cap * 2 + 1));
            map.check();
            assert!(after_insert <= chunks + 1 && map.chunks.len() == after_insert);
        }
    }
}
