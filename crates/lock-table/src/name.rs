//! Lock-name rules and the stable hash that places a name in a group.
//!
//! Rules: a name is 1..=[`MAX_NAME_BYTES`] bytes of UTF-8 with no control characters (U+0000–U+001F,
//! U+007F–U+009F). Everything else, including `/`, spaces inside the name and non-ASCII letters, is
//! allowed, so names can mirror the paths or keys of what they protect. Leading or trailing whitespace is
//! refused because it makes two names that print the same.

use crate::limits::MAX_NAME_BYTES;
use crate::GroupId;

/// Why a name was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum NameError {
    #[error("lock name is empty")]
    Empty,
    #[error("lock name is {len} bytes, over the limit of {max} bytes (max_name_bytes)", max = MAX_NAME_BYTES)]
    TooLong { len: usize },
    #[error("lock name contains a control character at byte {at}")]
    ControlCharacter { at: usize },
    #[error("lock name starts or ends with whitespace")]
    OuterWhitespace,
}

/// Checks `name` against the rules in the module docs.
pub fn validate_name(name: &str) -> Result<(), NameError> {
    if name.is_empty() {
        return Err(NameError::Empty);
    }
    if name.len() > MAX_NAME_BYTES {
        return Err(NameError::TooLong { len: name.len() });
    }
    if let Some((at, _)) = name.char_indices().find(|(_, c)| c.is_control()) {
        return Err(NameError::ControlCharacter { at });
    }
    if name.starts_with(char::is_whitespace) || name.ends_with(char::is_whitespace) {
        return Err(NameError::OuterWhitespace);
    }
    Ok(())
}

/// The group that owns `name` in a cluster of `groups` groups: FNV-1a (64-bit) of the UTF-8 bytes, modulo
/// `groups`. This function is part of the contract (clients compute it too) and must never change.
pub fn group_for(name: &str, groups: u32) -> GroupId {
    assert!(groups > 0, "a cluster has at least one group");
    GroupId((fnv1a64(name.as_bytes()) % u64::from(groups)) as u32)
}

/// FNV-1a, 64-bit. Chosen for being trivially reimplementable in any client language.
pub fn fnv1a64(bytes: &[u8]) -> u64 {
    fnv1a64_more(0xcbf2_9ce4_8422_2325, bytes)
}

/// Continues an FNV-1a hash (`fnv1a64(a ++ b) == fnv1a64_more(fnv1a64(a), b)`).
pub(crate) fn fnv1a64_more(mut hash: u64, bytes: &[u8]) -> u64 {
    for &b in bytes {
        hash ^= u64::from(b);
        hash = hash.wrapping_mul(0x0000_0100_0000_01b3);
    }
    hash
}
