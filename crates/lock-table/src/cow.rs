//! [`SnapMap`]: an ordered map that can be encoded as it was at one moment while it keeps changing.
//!
//! The table's two large maps (sessions and locks: at the design's scale a million entries, a ~40 MB
//! encoding) are `SnapMap`s, so a snapshot is written a chunk at a time between applies instead of under
//! one long lock ([`crate::LockTable::snapshot_begin`]). While a map is *frozen*, the first change to an
//! entry the encoder has not reached yet saves that entry's encoding as it was (or that it was absent):
//! copy-on-write by entry, paid only for the entries changed during a snapshot, once each. The entries
//! themselves live in a [`ChunkMap`] (values in place, chunks kept nearly full: see `chunk_map`).
//!
//! Invariant: reads go straight to the map (it derefs to the `ChunkMap`), and every change goes through
//! [`SnapMap::get_mut`], [`SnapMap::insert`] or [`SnapMap::remove`], which record the before-image. There
//! is no `DerefMut`, so the compiler finds any change that would bypass them.

use crate::chunk_map::{ChunkMap, Iter};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::ops::Bound;

pub(crate) struct SnapMap<K, V> {
    map: ChunkMap<K, V>,
    frozen: Option<Box<Frozen<K>>>,
}

impl<K: std::fmt::Debug, V: std::fmt::Debug> std::fmt::Debug for SnapMap<K, V> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.map.fmt(f)
    }
}

/// The part of a frozen map the encoder has not written yet.
#[derive(Debug)]
struct Frozen<K> {
    /// Which snapshot froze the map (see [`SnapMap::freeze`]).
    generation: u64,
    /// Every entry up to and including this key is written (`None`: none yet).
    written: Option<K>,
    /// Entries after `written` changed since the freeze: their encoding at the freeze (`None`: absent
    /// then).
    before: BTreeMap<K, Option<Vec<u8>>>,
}

impl<K, V> std::ops::Deref for SnapMap<K, V> {
    type Target = ChunkMap<K, V>;
    fn deref(&self) -> &Self::Target {
        &self.map
    }
}

impl<'a, K, V> IntoIterator for &'a SnapMap<K, V> {
    type Item = (&'a K, &'a V);
    type IntoIter = Iter<'a, K, V>;
    fn into_iter(self) -> Self::IntoIter {
        self.map.iter()
    }
}

/// A copy is never frozen (it is not being written).
impl<K: Clone, V: Clone> Clone for SnapMap<K, V> {
    fn clone(&self) -> Self {
        SnapMap {
            map: self.map.clone(),
            frozen: None,
        }
    }
}

/// Equal contents; whether a snapshot is under way does not matter.
impl<K: PartialEq, V: PartialEq> PartialEq for SnapMap<K, V> {
    fn eq(&self, other: &Self) -> bool {
        self.map == other.map
    }
}
impl<K: Eq, V: Eq> Eq for SnapMap<K, V> {}

/// As a `BTreeMap` of the same entries serializes (a map, in key order): the snapshot bytes do not
/// depend on the map's structure.
impl<K: Serialize, V: Serialize> Serialize for SnapMap<K, V> {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_map(self.map.iter())
    }
}

/// Entries are inserted as they are decoded (no copy of the whole map in between); in key order, as a
/// snapshot has them, they fill each chunk.
impl<'de, K: Ord + Clone + Deserialize<'de>, V: Deserialize<'de>> Deserialize<'de>
    for SnapMap<K, V>
{
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct Visit<K, V>(std::marker::PhantomData<(K, V)>);
        impl<'de, K: Ord + Clone + Deserialize<'de>, V: Deserialize<'de>> serde::de::Visitor<'de>
            for Visit<K, V>
        {
            type Value = ChunkMap<K, V>;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("a map")
            }
            fn visit_map<A: serde::de::MapAccess<'de>>(
                self,
                mut m: A,
            ) -> Result<Self::Value, A::Error> {
                let mut map = ChunkMap::new();
                while let Some((k, v)) = m.next_entry()? {
                    map.insert(k, v);
                }
                Ok(map)
            }
        }
        Ok(SnapMap {
            map: d.deserialize_map(Visit(std::marker::PhantomData))?,
            frozen: None,
        })
    }
}

impl<K, V> Default for SnapMap<K, V> {
    fn default() -> Self {
        SnapMap {
            map: ChunkMap::new(),
            frozen: None,
        }
    }
}

impl<K: Ord + Clone, V> FromIterator<(K, V)> for SnapMap<K, V> {
    fn from_iter<I: IntoIterator<Item = (K, V)>>(iter: I) -> Self {
        SnapMap {
            map: iter.into_iter().collect(),
            frozen: None,
        }
    }
}

/// From the maps of older snapshot versions, which boxed each value.
impl<K: Ord + Clone, V> From<BTreeMap<K, Box<V>>> for SnapMap<K, V> {
    fn from(map: BTreeMap<K, Box<V>>) -> Self {
        map.into_iter().map(|(k, v)| (k, *v)).collect()
    }
}

impl<K: Ord + Clone + Serialize, V: Serialize> SnapMap<K, V> {
    /// Records `key`'s before-image if a snapshot is under way and has not written it yet.
    #[inline]
    fn touch(&mut self, key: &K) {
        if let Some(f) = self.frozen.as_deref_mut() {
            let pending = f.written.as_ref().is_none_or(|w| key > w);
            if pending && !f.before.contains_key(key) {
                let image = self.map.get(key).map(|v| encode_entry(key, v));
                f.before.insert(key.clone(), image);
            }
        }
    }

    pub(crate) fn get_mut(&mut self, key: &K) -> Option<&mut V> {
        self.touch(key);
        self.map.get_mut(key)
    }

    pub(crate) fn insert(&mut self, key: K, value: V) -> Option<V> {
        self.touch(&key);
        self.map.insert(key, value)
    }

    pub(crate) fn remove(&mut self, key: &K) -> Option<V> {
        self.touch(key);
        self.map.remove(key)
    }

    /// Every value, to change; only outside a snapshot (rebuilding derived state after a decode).
    pub(crate) fn values_mut(&mut self) -> impl Iterator<Item = &mut V> {
        assert!(self.frozen.is_none(), "values_mut during a snapshot");
        self.map.values_mut()
    }

    /// Starts snapshot `generation`: from now on [`SnapMap::write_chunk`] writes the map as it is now.
    pub(crate) fn freeze(&mut self, generation: u64) {
        self.frozen = Some(Box::new(Frozen {
            generation,
            written: None,
            before: BTreeMap::new(),
        }));
    }

    /// Ends a snapshot early (its writer gave up): no more before-images are kept.
    pub(crate) fn thaw(&mut self) {
        self.frozen = None;
    }

    /// Whether snapshot `generation` (and not another) is writing the map.
    pub(crate) fn is_frozen_by(&self, generation: u64) -> bool {
        self.frozen
            .as_ref()
            .is_some_and(|f| f.generation == generation)
    }

    /// Appends the encoding of up to `max` more entries as they were at the freeze (each a postcard
    /// `(key, value)`, exactly as in the whole map's encoding) to `out`. Returns true, and thaws, once
    /// every entry is written.
    pub(crate) fn write_chunk(&mut self, out: &mut Vec<u8>, max: usize) -> bool {
        let Some(f) = self.frozen.as_deref_mut() else {
            return true;
        };
        let from = match &f.written {
            Some(k) => Bound::Excluded(k),
            None => Bound::Unbounded,
        };
        let mut live = self.map.range_from(from).peekable();
        let mut old = f.before.range((from, Bound::Unbounded)).peekable();
        let mut last: Option<K> = None;
        let mut done = false;
        for _ in 0..max.max(1) {
            let key = match (live.peek(), old.peek()) {
                (None, None) => {
                    done = true;
                    break;
                }
                (Some((l, _)), Some((o, _))) if o <= l => {
                    let (k, image) = old.next().expect("peeked");
                    if k == *l {
                        live.next();
                    }
                    if let Some(bytes) = image {
                        out.extend_from_slice(bytes);
                    }
                    k
                }
                (Some(_), _) => {
                    // Not changed since the freeze (a change would have left a before-image).
                    let (k, v) = live.next().expect("peeked");
                    let out_vec = std::mem::take(out);
                    *out = postcard::to_extend(&(k, v), out_vec)
                        .expect("encoding to a Vec cannot fail");
                    k
                }
                (None, Some(_)) => {
                    let (k, image) = old.next().expect("peeked");
                    if let Some(bytes) = image {
                        out.extend_from_slice(bytes);
                    }
                    k
                }
            };
            last = Some(key.clone());
        }
        if !done && live.peek().is_none() && old.peek().is_none() {
            done = true;
        }
        if done {
            self.frozen = None;
            return true;
        }
        if let Some(last) = last {
            // Before-images at or below the written key are no longer needed.
            let mut rest = f.before.split_off(&last);
            rest.remove(&last);
            f.before = rest;
            f.written = Some(last);
        }
        false
    }
}

fn encode_entry<K: Serialize, V: Serialize>(key: &K, value: &V) -> Vec<u8> {
    postcard::to_allocvec(&(key, value)).expect("encoding to a Vec cannot fail")
}
