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

/// A validated lock name (see [`crate::validate_name`] for the rules). Shared (`Arc<str>`): the table keeps
/// a held lock's name in the lock map and in its session's set, and both point at one allocation.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
pub struct LockName(std::sync::Arc<str>);

impl LockName {
    /// Validates `name` and wraps it.
    pub fn new(name: impl Into<String>) -> Result<Self, crate::NameError> {
        let name = name.into();
        crate::validate_name(&name)?;
        Ok(LockName(name.into()))
    }

    pub fn as_str(&self) -> &str {
        &self.0
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
        f.write_str(&self.0)
    }
}

impl std::borrow::Borrow<str> for LockName {
    fn borrow(&self) -> &str {
        &self.0
    }
}

/// Names read back (from the log or a snapshot) are validated again: a decoder must not create a lock
/// name the API would refuse.
impl<'de> Deserialize<'de> for LockName {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        LockName::new(s).map_err(serde::de::Error::custom)
    }
}
