//! Newtypes for the identities the table deals in, so a session id can never be passed where a token is
//! expected.

use serde::{Deserialize, Serialize};
use std::fmt;

/// A session, named by the log index of the `OpenSession` entry that created it (unique within a group).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct SessionId(pub u64);

/// A fencing token: the log index of the entry that granted the lock. Strictly increasing per lock, never 0.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct FencingToken(pub u64);

/// A Raft group. Lock names map to groups by [`crate::group_for`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct GroupId(pub u32);

/// A client-chosen id, unique per session, that makes a retried request return its first outcome.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct RequestId(pub u64);

/// A validated lock name (see [`crate::validate_name`] for the rules).
///
/// 24 bytes. A name of up to [`INLINE_NAME_BYTES`] bytes (most: `orders/4711`, `hold/12345/6`) is
/// stored in place, so a held lock's name costs no allocation of its own; a longer one is shared
/// (`Arc<str>`) by the lock map and its session's set. At a million locks, a 12-byte name in its own
/// `Arc<str>` was a 48-byte malloc chunk: ~48 MB (docs/performance.md, "Where the memory goes").
/// Ordered, compared and hashed as the string, whichever way it is stored.
#[derive(Clone)]
pub struct LockName(Repr);

/// The longest name [`LockName`] stores in place.
pub const INLINE_NAME_BYTES: usize = 22;

#[derive(Clone)]
enum Repr {
    Inline {
        len: u8,
        bytes: [u8; INLINE_NAME_BYTES],
    },
    Shared(std::sync::Arc<str>),
}

const _: () = assert!(std::mem::size_of::<LockName>() == 24);

impl LockName {
    /// Validates `name` and wraps it.
    pub fn new(name: impl Into<String>) -> Result<Self, crate::NameError> {
        let name = name.into();
        crate::validate_name(&name)?;
        Ok(LockName::from_valid(&name))
    }

    fn from_valid(name: &str) -> LockName {
        if name.len() <= INLINE_NAME_BYTES {
            let mut bytes = [0; INLINE_NAME_BYTES];
            bytes[..name.len()].copy_from_slice(name.as_bytes());
            LockName(Repr::Inline {
                len: name.len() as u8,
                bytes,
            })
        } else {
            LockName(Repr::Shared(name.into()))
        }
    }

    /// The name whose bytes are `bytes`, at most [`INLINE_NAME_BYTES`] of them, copied from a valid
    /// name (a packed set of held names keeps its names this way: `crate::held`).
    pub(crate) fn from_valid_bytes(bytes: &[u8]) -> LockName {
        let mut inline = [0; INLINE_NAME_BYTES];
        inline[..bytes.len()].copy_from_slice(bytes);
        LockName(Repr::Inline {
            len: bytes.len() as u8,
            bytes: inline,
        })
    }

    pub fn as_str(&self) -> &str {
        match &self.0 {
            // Copied from a `str` whole and never changed, so this cannot fail; checked anyway
            // (the crate has no unsafe code), at the cost of a scan of at most 22 bytes.
            Repr::Inline { len, bytes } => {
                std::str::from_utf8(&bytes[..usize::from(*len)]).expect("a name is UTF-8")
            }
            Repr::Shared(s) => s,
        }
    }

    /// The name's bytes, without the UTF-8 check `as_str` makes: what comparisons use.
    pub(crate) fn as_bytes(&self) -> &[u8] {
        match &self.0 {
            Repr::Inline { len, bytes } => &bytes[..usize::from(*len)],
            Repr::Shared(s) => s.as_bytes(),
        }
    }
}

/// As the string: `str`'s order is its bytes' order.
impl PartialEq for LockName {
    fn eq(&self, other: &LockName) -> bool {
        self.as_bytes() == other.as_bytes()
    }
}

impl Eq for LockName {}

impl PartialOrd for LockName {
    fn partial_cmp(&self, other: &LockName) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}

impl Ord for LockName {
    fn cmp(&self, other: &LockName) -> std::cmp::Ordering {
        match (&self.0, &other.0) {
            // Two names in place: their zero-padded bytes as three big-endian words, then their lengths.
            // Words order as the bytes do; padded bytes that are equal leave the shorter name a prefix
            // of the longer one (followed by NULs, if by anything), which sorts first, as with strings.
            // No call to `memcmp`: in the table benchmark a third of the time went to it, from the lock
            // map's binary searches.
            (Repr::Inline { len: a, bytes: x }, Repr::Inline { len: b, bytes: y }) => {
                words(x).cmp(&words(y)).then(a.cmp(b))
            }
            _ => self.as_bytes().cmp(other.as_bytes()),
        }
    }
}

/// A name's in-place bytes (zero past its length: [`LockName::from_valid`] is the only place that
/// makes them) as three big-endian words.
fn words(b: &[u8; INLINE_NAME_BYTES]) -> (u64, u64, u64) {
    let word = |i: usize| {
        let mut w = [0u8; 8];
        let end = (i + 8).min(INLINE_NAME_BYTES);
        w[..end - i].copy_from_slice(&b[i..end]);
        u64::from_be_bytes(w)
    };
    (word(0), word(8), word(16))
}

/// As the string, so that maps keyed by names can be searched with a `&str` ([`Borrow`]).
///
/// [`Borrow`]: std::borrow::Borrow
impl std::hash::Hash for LockName {
    fn hash<H: std::hash::Hasher>(&self, state: &mut H) {
        self.as_str().hash(state)
    }
}

impl fmt::Debug for LockName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(self.as_str(), f)
    }
}

/// Encoded as the string, as it always was.
impl Serialize for LockName {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(self.as_str())
    }
}

impl fmt::Display for SessionId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.0)
    }
}

impl fmt::Display for FencingToken {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.0)
    }
}

impl fmt::Display for LockName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl std::borrow::Borrow<str> for LockName {
    fn borrow(&self) -> &str {
        self.as_str()
    }
}

/// Names read back (from the log or a snapshot) are validated again: a decoder must not create a lock
/// name the API would refuse.
impl<'de> Deserialize<'de> for LockName {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        // A visitor, not `String::deserialize`: a decoder that lends the bytes (postcard from a slice)
        // then makes no allocation for a short name.
        struct Visit;
        impl serde::de::Visitor<'_> for Visit {
            type Value = LockName;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a lock name")
            }
            fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<LockName, E> {
                crate::validate_name(v).map_err(E::custom)?;
                Ok(LockName::from_valid(v))
            }
        }
        d.deserialize_str(Visit)
    }
}

#[cfg(test)]
mod tests {
    use super::{LockName, INLINE_NAME_BYTES};
    use proptest::prelude::*;
    use std::collections::BTreeMap;

    /// Names on both sides of the inline limit, and ones that share long prefixes, so comparisons cross
    /// the two representations.
    fn name() -> impl Strategy<Value = String> {
        prop_oneof![
            "[a-c/]{1,30}",
            "[a-zé0-9/._-]{1,40}",
            (0usize..3).prop_map(|d| "x".repeat(INLINE_NAME_BYTES - 1 + d)),
        ]
    }

    proptest! {
        /// A name orders, compares, hashes, prints and encodes as its string, whichever way it is stored.
        #[test]
        fn a_name_behaves_as_its_string(a in name(), b in name()) {
            let (na, nb) = (LockName::new(a.clone()).unwrap(), LockName::new(b.clone()).unwrap());
            prop_assert_eq!(na.as_str(), a.as_str());
            prop_assert_eq!(na.cmp(&nb), a.cmp(&b));
            prop_assert_eq!(na == nb, a == b);
            prop_assert_eq!(na.to_string(), a.clone());
            prop_assert_eq!(format!("{na:?}"), format!("{a:?}"));
            let hash = |v: &dyn Fn(&mut std::hash::DefaultHasher)| {
                let mut h = std::hash::DefaultHasher::new();
                v(&mut h);
                std::hash::Hasher::finish(&h)
            };
            prop_assert_eq!(
                hash(&|h| std::hash::Hash::hash(&na, h)),
                hash(&|h| std::hash::Hash::hash(a.as_str(), h))
            );
            let bytes = postcard::to_allocvec(&na).unwrap();
            prop_assert_eq!(&bytes, &postcard::to_allocvec(a.as_str()).unwrap());
            prop_assert_eq!(postcard::from_bytes::<LockName>(&bytes).unwrap(), na.clone());
            // Found by its string in a map keyed by names.
            let map: BTreeMap<LockName, ()> = [(na, ()), (nb, ())].into_iter().collect();
            prop_assert!(map.contains_key(a.as_str()) && map.contains_key(b.as_str()));
        }
    }

    #[test]
    fn a_decoded_name_is_validated_again() {
        for bad in ["", " leading", "tab\there", &"x".repeat(300)] {
            let bytes = postcard::to_allocvec(bad).unwrap();
            assert!(
                postcard::from_bytes::<LockName>(&bytes).is_err(),
                "{bad:?} decoded"
            );
        }
    }
}
