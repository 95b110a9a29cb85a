//! The on-disk format.
//!
//! A segment file `wal-<seq, 16 hex digits>.log` starts with a 16-byte header: magic `b"HFWALSEG"`, a
//! little-endian `u32` format version, and a little-endian `u32` state: 0 for a segment in use, or
//! [`STANDBY`] for a segment created ahead of time that holds nothing yet (see [`crate::Wal`]; any other
//! value is corruption). Then come frames, one per group commit:
//!
//! ```text
//! frame  = magic u32 ("HFWF") | body_len u32 | crc u32 | body
//! crc    = crc32(seq u64 | offset u64 | body)       (version 2; version 1: crc32(body))
//! body   = record*
//! record = group u32 | kind u8 | sticky u8 | index u64 | payload_len u32 | payload
//! ```
//!
//! All integers are little-endian. A frame is either entirely valid or treated as absent, so a batch of
//! appends becomes durable atomically.
//!
//! The segment in use may end in zeros after its last frame: the writer fills the file ahead of its
//! frames (see [`crate::ZERO_AHEAD_BYTES`]) and cuts the zeros off, durably, before the next segment is
//! started. Releases before commit d3435f3 (2026-12-06) read zeros at the end of the last segment as a
//! torn tail, and cut them the same (keeping a copy).
//!
//! Version 2 folds the frame's place into its checksum: `seq` is the segment's number (from its file
//! name) and `offset` the frame's offset in the file. A disk that writes a valid frame to the wrong
//! place (a misdirected write), or a copy of another segment's bytes, then yields a frame whose checksum
//! fails, so recovery sees corruption instead of reading a well-formed frame that does not belong there.
//! Version 1 segments (written before this) are still read, with the body-only checksum; every segment
//! started now is version 2.

pub const SEGMENT_MAGIC: &[u8; 8] = b"HFWALSEG";
/// The version every new segment is written in.
pub const SEGMENT_VERSION: u32 = 2;
/// The first version, whose frame checksum covers the body alone. Read, never written.
pub const SEGMENT_VERSION_UNPLACED: u32 = 1;
/// Offset of the header's version word.
pub const SEGMENT_VERSION_OFFSET: u64 = 8;
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

/// Most bytes one append may carry (its records' payloads and headers). A frame holds the appends one
/// group commit gathers, up to `max_batch_bytes` (clamped to this too) plus the one that crosses it,
/// and the small lazy and sticky records around them: under [`MAX_FRAME_BYTES`], which recovery
/// refuses, so an acknowledged frame can always be read back.
pub const MAX_APPEND_BYTES: usize = MAX_FRAME_BYTES / 4;

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

/// Appends `r` as a frame body holds it (the same in every segment version).
pub fn encode_record(out: &mut Vec<u8>, r: &Record) {
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

/// Where a frame sits: the number and version of its segment and its offset in the file.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Place {
    pub seq: u64,
    pub version: u32,
    pub offset: u64,
}

/// The checksum a frame holding `body` at `place` carries.
pub fn frame_crc(place: Place, body: &[u8]) -> u32 {
    let mut h = crc32fast::Hasher::new();
    if place.version != SEGMENT_VERSION_UNPLACED {
        h.update(&place.seq.to_le_bytes());
        h.update(&place.offset.to_le_bytes());
    }
    h.update(body);
    h.finalize()
}

/// Appends a frame holding `body`, to be written at `place`, to `out`.
pub(crate) fn encode_frame(out: &mut Vec<u8>, place: Place, body: &[u8]) {
    let at = out.len();
    out.resize(at + FRAME_HEADER_BYTES, 0);
    out.extend_from_slice(body);
    seal_frame(&mut out[at..], place);
}

/// Writes the header of `frame` (its first [`FRAME_HEADER_BYTES`]) for the body after it, to be
/// written at `place`: a batch's records are encoded after room left for the header, which is written
/// once the frame's place is known (a rotation may change it), so the body is not copied into a
/// second buffer.
pub(crate) fn seal_frame(frame: &mut [u8], place: Place) {
    let (header, body) = frame.split_at_mut(FRAME_HEADER_BYTES);
    header[0..4].copy_from_slice(&FRAME_MAGIC.to_le_bytes());
    header[4..8].copy_from_slice(&(body.len() as u32).to_le_bytes());
    header[8..12].copy_from_slice(&frame_crc(place, body).to_le_bytes());
}

/// What a frame at some offset of a file looks like.
pub(crate) enum FrameCheck<'a> {
    Valid { body: &'a [u8], next: usize },
    Invalid(String),
}

/// Checks the frame at offset `at` of segment `seq`, whose header says `version`.
pub(crate) fn check_frame(buf: &[u8], seq: u64, version: u32, at: usize) -> FrameCheck<'_> {
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
    let place = Place {
        seq,
        version,
        offset: at as u64,
    };
    let computed = frame_crc(place, body);
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

/// The version word of a segment that starts with a valid header, or None.
pub(crate) fn segment_version(buf: &[u8]) -> Option<u32> {
    segment_state(buf)?;
    let at = SEGMENT_VERSION_OFFSET as usize;
    Some(u32::from_le_bytes(
        buf[at..at + 4].try_into().expect("4 bytes"),
    ))
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

/// The number of the segment file called `name`, or None if it is not a segment's name.
pub fn parse_segment_name(name: &str) -> Option<u64> {
    let hex = name.strip_prefix("wal-")?.strip_suffix(".log")?;
    if hex.len() != 16 {
        return None;
    }
    u64::from_str_radix(hex, 16).ok()
}

/// Every valid frame of segment `seq`'s bytes that recovery would read, in order, as (offset of its
/// body, body length): none for a standby or a segment with a bad header, and up to the first invalid
/// frame otherwise. For tools and the simulation's corruption fault.
pub fn valid_frames(buf: &[u8], seq: u64) -> Vec<(u64, u64)> {
    let mut frames = Vec::new();
    let (Some(0), Some(version)) = (segment_state(buf), segment_version(buf)) else {
        return frames;
    };
    let mut at = SEGMENT_HEADER_BYTES as usize;
    while at < buf.len() {
        match check_frame(buf, seq, version, at) {
            FrameCheck::Valid { body, next } => {
                frames.push(((at + FRAME_HEADER_BYTES) as u64, body.len() as u64));
                at = next;
            }
            FrameCheck::Invalid(_) => break,
        }
    }
    frames
}
