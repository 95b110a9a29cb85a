//! A versioned, checksummed encoding of the whole table, and its digest.
//!
//! Layout: `b"HFLT"`, a little-endian `u16` format version, the postcard encoding of the table, then a
//! little-endian CRC-32 of everything before it. Ordered maps make the encoding canonical, so equal tables
//! have equal bytes and the digest (FNV-1a 64 of the bytes) can be compared across replicas (property P2).

use crate::table::LockTable;

const MAGIC: &[u8; 4] = b"HFLT";
const VERSION: u16 = 2;

#[derive(Debug, thiserror::Error)]
pub enum SnapshotError {
    #[error("lock table snapshot is truncated ({len} bytes)")]
    Truncated { len: usize },
    #[error("lock table snapshot has bad magic")]
    BadMagic,
    #[error("lock table snapshot has format version {0}, this build reads version {VERSION}")]
    UnknownVersion(u16),
    #[error(
        "lock table snapshot checksum mismatch (stored {stored:#010x}, computed {computed:#010x})"
    )]
    Checksum { stored: u32, computed: u32 },
    #[error("lock table snapshot does not decode: {0}")]
    Decode(String),
}

impl LockTable {
    /// Encodes the whole table.
    pub fn encode_snapshot(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(64 + self.lock_count() * 96);
        out.extend_from_slice(MAGIC);
        out.extend_from_slice(&VERSION.to_le_bytes());
        let out = postcard::to_extend(self, out).expect("encoding to a Vec cannot fail");
        let mut out = out;
        let crc = crc32fast::hash(&out);
        out.extend_from_slice(&crc.to_le_bytes());
        out
    }

    /// Decodes a table from [`LockTable::encode_snapshot`] output, checking magic, version and checksum.
    pub fn decode_snapshot(bytes: &[u8]) -> Result<Self, SnapshotError> {
        if bytes.len() < 10 {
            return Err(SnapshotError::Truncated { len: bytes.len() });
        }
        let (body, crc) = bytes.split_at(bytes.len() - 4);
        let stored = u32::from_le_bytes(crc.try_into().expect("4 bytes"));
        let computed = crc32fast::hash(body);
        if stored != computed {
            return Err(SnapshotError::Checksum { stored, computed });
        }
        if &body[..4] != MAGIC {
            return Err(SnapshotError::BadMagic);
        }
        let version = u16::from_le_bytes([body[4], body[5]]);
        if version != VERSION {
            return Err(SnapshotError::UnknownVersion(version));
        }
        let mut table: LockTable =
            postcard::from_bytes(&body[6..]).map_err(|e| SnapshotError::Decode(e.to_string()))?;
        table.rebuild_derived().map_err(SnapshotError::Decode)?;
        table.validate_decoded().map_err(SnapshotError::Decode)?;
        Ok(table)
    }

    /// A digest of the whole state: equal on two replicas exactly when their tables are equal.
    pub fn digest(&self) -> u64 {
        crate::name::fnv1a64(&self.encode_snapshot())
    }

    /// A checksummed snapshot can still be written by a buggy build; refuse one that breaks an invariant
    /// rather than panic later in `apply`.
    fn validate_decoded(&self) -> Result<(), String> {
        std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| self.check_invariants()))
            .map_err(|_| "snapshot breaks a lock table invariant".to_string())
    }
}
