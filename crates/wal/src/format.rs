//! The on-disk format.
//!
//! A segment file `wal-<seq, 16 hex digits>.log` starts with a 16-byte header: magic `b"HFWALSEG"`, a
//! little-endian `u32` format version, and a little-endian `u32` state: 0 for a segment in use, or
//! [`STANDBY`] for a segment created ahead of time that holds nothing yet (see [`crate::Wal`]; any other
//! value is corruption). Then come frames, one per group commit:
//!
//! ```text
//! frame  = magic u32 ("HFWF") | body_len u32 | crc32(body) u32 | body
//! body   = record*
//! record = group u32 | kind u8 | sticky u8 | index u64 | payload_len u32 | payload
//! ```
//!
//! All integers are little-endian. A frame is either entirely valid or treated as absent, so a batch of
//! appends becomes durable atomically.

pub const SEGMENT_MAGIC: &[u8; 8] = b"HFWALSEG";
pub const SEGMENT_VERSION: u32 = 1;
pub const SEGMENT_HEADER_BYTES: u64 = 16;
/// Offset of the header's state word.
pub const SEGMENT_STATE_OFFSET: u64 = 12;
/// The state of a pre-created segment that has not been used yet: `b"STBY"`. A whole word rather than a
/// bit, so that no single flipped bit turns a segment in use into one whose contents recovery ignores.
pub const STANDBY: u32 = u32::from_le_bytes(*b"STBY");
pub const FRAME_MAGIC: u32 = u32::from_le_bytes(*b"HFWF");
pub const FRAME_HEADER_BYTES: usize = 12;
pub const RECORD_HEADER_BYTES: usize = 18;

/// Largest payload of one record. A Raft entry holds one command (a lock name is at most 256 bytes) or a
/// membership change; snapshots are separate files. 1 MiB leaves room for batched payloads later.
pub const MAX_RECORD_BYTES: usize = 1 << 20;

/// Largest frame body the reader accepts; the writer never builds a bigger one. Bounds the memory a
/// corrupt length field can make recovery allocate.
pub const MAX_FRAME_BYTES: usize = 64 << 20;

/// One log record. `kind` and `index` mean whatever the owner says; the WAL uses `index` only to decide
/// when a segment can be deleted (see [`crate::Wal::release`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Record {
    pub group: u32,
    pub kind: u8,
    /// Sticky records are rewritten at the head of every new segment (the latest one per `(group, kind)`).
    pub sticky: bool,
    pub index: u64,
    pub payload: Vec<u8>,
}

pub(crate) fn encode_record(out: &mut Vec<u8>, r: &Record) {
    out.extend_from_slice(&r.group.to_le_bytes());
    out.push(r.kind);
    out.push(u8::from(r.sticky));
    out.extend_from_slice(&r.index.to_le_bytes());
    out.extend_from_slice(&(r.payload.len() as u32).to_le_bytes());
    out.extend_from_slice(&r.payload);
}

/// Decodes the records of a frame body whose CRC already matched. An inconsistency here means a bug or
/// a CRC collision, reported as corruption.
pub(crate) fn decode_records(mut body: &[u8], out: &mut Vec<Record>) -> Result<(), String> {
    while !body.is_empty() {
        if body.len() < RECORD_HEADER_BYTES {
            return Err(format!(
                "record header truncated ({} bytes left)",
                body.len()
            ));
        }
        let group = u32::from_le_bytes(body[0..4].try_into().expect("4 bytes"));
        let kind = body[4];
        let sticky = match body[5] {
            0 => false,
            1 => true,
            other => return Err(format!("bad sticky flag {other}")),
        };
        let index = u64::from_le_bytes(body[6..14].try_into().expect("8 bytes"));
        let len = u32::from_le_bytes(body[14..18].try_into().expect("4 bytes")) as usize;
        if len > MAX_RECORD_BYTES || body.len() < RECORD_HEADER_BYTES + len {
            return Err(format!("record payload length {len} runs past its frame"));
        }
        let payload = body[RECORD_HEADER_BYTES..RECORD_HEADER_BYTES + len].to_vec();
        out.push(Record {
            group,
            kind,
            sticky,
            index,
            payload,
        });
        body = &body[RECORD_HEADER_BYTES + len..];
    }
    Ok(())
}

/// Appends a frame holding `body` to `out`.
pub(crate) fn encode_frame(out: &mut Vec<u8>, body: &[u8]) {
    out.extend_from_slice(&FRAME_MAGIC.to_le_bytes());
    out.extend_from_slice(&(body.len() as u32).to_le_bytes());
    out.extend_from_slice(&crc32fast::hash(body).to_le_bytes());
    out.extend_from_slice(body);
}

/// What a frame at some offset of a file looks like.
pub(crate) enum FrameCheck<'a> {
    Valid { body: &'a [u8], next: usize },
    Invalid(String),
}

pub(crate) fn check_frame(buf: &[u8], at: usize) -> FrameCheck<'_> {
    let rest = &buf[at..];
    if rest.len() < FRAME_HEADER_BYTES {
        return FrameCheck::Invalid(format!(
            "frame header truncated ({} bytes left)",
            rest.len()
        ));
    }
    let magic = u32::from_le_bytes(rest[0..4].try_into().expect("4 bytes"));
    if magic != FRAME_MAGIC {
        return FrameCheck::Invalid(format!("bad frame magic {magic:#010x}"));
    }
    let len = u32::from_le_bytes(rest[4..8].try_into().expect("4 bytes")) as usize;
    if len > MAX_FRAME_BYTES {
        return FrameCheck::Invalid(format!("frame length {len} over the limit"));
    }
    if rest.len() < FRAME_HEADER_BYTES + len {
        return FrameCheck::Invalid(format!(
            "frame of {len} bytes runs past the end of the file"
        ));
    }
    let crc = u32::from_le_bytes(rest[8..12].try_into().expect("4 bytes"));
    let body = &rest[FRAME_HEADER_BYTES..FRAME_HEADER_BYTES + len];
    let computed = crc32fast::hash(body);
    if crc != computed {
        return FrameCheck::Invalid(format!(
            "frame checksum mismatch (stored {crc:#010x}, computed {computed:#010x})"
        ));
    }
    FrameCheck::Valid {
        body,
        next: at + FRAME_HEADER_BYTES + len,
    }
}

/// A segment's header; `state` is 0 (in use) or [`STANDBY`].
pub(crate) fn segment_header(state: u32) -> Vec<u8> {
    let mut h = Vec::with_capacity(SEGMENT_HEADER_BYTES as usize);
    h.extend_from_slice(SEGMENT_MAGIC);
    h.extend_from_slice(&SEGMENT_VERSION.to_le_bytes());
    h.extend_from_slice(&state.to_le_bytes());
    h
}

/// The state word of a segment that starts with a valid header, or None.
pub(crate) fn segment_state(buf: &[u8]) -> Option<u32> {
    if (buf.len() as u64) < SEGMENT_HEADER_BYTES || &buf[..8] != SEGMENT_MAGIC {
        return None;
    }
    let at = SEGMENT_STATE_OFFSET as usize;
    Some(u32::from_le_bytes(
        buf[at..at + 4].try_into().expect("4 bytes"),
    ))
}

pub(crate) fn segment_name(seq: u64) -> String {
    format!("wal-{seq:016x}.log")
}

pub(crate) fn parse_segment_name(name: &str) -> Option<u64> {
    let hex = name.strip_prefix("wal-")?.strip_suffix(".log")?;
    if hex.len() != 16 {
        return None;
    }
    u64::from_str_radix(hex, 16).ok()
}
