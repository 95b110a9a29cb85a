//! Recovery: read every segment in order, cut a torn tail, refuse real corruption.

use crate::format::{
    check_frame, decode_records, parse_segment_name, segment_state, segment_version, FrameCheck,
    Record, FRAME_MAGIC, SEGMENT_HEADER_BYTES, SEGMENT_STATE_OFFSET, SEGMENT_VERSION,
    SEGMENT_VERSION_OFFSET, SEGMENT_VERSION_UNPLACED, STANDBY,
};
use crate::fs;
use crate::WalError;
use std::collections::BTreeMap;
use std::io::{Read, Write};
use std::path::{Path, PathBuf};

/// What [`crate::Wal::open`] found on disk.
#[derive(Debug, Default)]
pub struct Recovered {
    /// Every record of every complete frame, in append order.
    pub records: Vec<Record>,
    /// A torn tail that was cut: the segment, the offset it was cut at, and where the cut bytes were saved.
    pub torn: Option<TornTail>,
}

#[derive(Debug, Clone)]
pub struct TornTail {
    pub segment: PathBuf,
    pub offset: u64,
    pub bytes: u64,
    pub saved_to: PathBuf,
}

/// Per segment: the largest non-sticky record index per group, so the writer knows when it may delete it.
pub(crate) struct SegmentInfo {
    pub(crate) seq: u64,
    pub(crate) path: PathBuf,
    pub(crate) max_index: BTreeMap<u32, u64>,
}

pub(crate) fn io_err(path: &Path) -> impl FnOnce(std::io::Error) -> WalError + '_ {
    move |source| WalError::Io {
        path: path.to_path_buf(),
        source,
    }
}

pub(crate) fn list_segments(dir: &Path) -> Result<Vec<(u64, PathBuf)>, WalError> {
    let mut segments = Vec::new();
    for entry in fs::read_dir(dir).map_err(io_err(dir))? {
        let entry = entry.map_err(io_err(dir))?;
        if let Some(seq) = entry.file_name().to_str().and_then(parse_segment_name) {
            segments.push((seq, entry.path()));
        }
    }
    segments.sort();
    Ok(segments)
}

/// A segment pre-created for the next rotation, found empty (or emptied) by recovery.
pub(crate) struct Standby {
    pub(crate) seq: u64,
    pub(crate) path: PathBuf,
}

/// Whether the file holds nothing a writer could have written into: shorter than a header, or
/// nothing but zeros. A crash while a segment file was being created (pre-created, or created inside
/// a rotation) can leave it so: its directory entry durable, its header not.
pub(crate) fn holds_nothing(path: &Path) -> Result<bool, WalError> {
    let mut file = fs::File::open(path).map_err(io_err(path))?;
    let len = file.metadata().map_err(io_err(path))?.len();
    if len < SEGMENT_HEADER_BYTES {
        return Ok(true);
    }
    let mut header = [0u8; SEGMENT_HEADER_BYTES as usize];
    file.read_exact(&mut header).map_err(io_err(path))?;
    if header.iter().any(|&b| b != 0) {
        return Ok(false);
    }
    let buf = fs::read(path).map_err(io_err(path))?;
    Ok(buf.iter().all(|&b| b == 0))
}

/// Whether the file is a pre-created segment holding nothing but its header.
pub(crate) fn is_empty_standby(path: &Path) -> Result<bool, WalError> {
    let mut file = fs::File::open(path).map_err(io_err(path))?;
    if file.metadata().map_err(io_err(path))?.len() != SEGMENT_HEADER_BYTES {
        return Ok(false);
    }
    let mut header = [0u8; SEGMENT_HEADER_BYTES as usize];
    file.read_exact(&mut header).map_err(io_err(path))?;
    Ok(segment_state(&header) == Some(STANDBY))
}

pub(crate) fn recover(
    dir: &Path,
) -> Result<(Recovered, Vec<SegmentInfo>, Option<Standby>), WalError> {
    let segments = list_segments(dir)?;
    let mut recovered = Recovered::default();
    let mut infos = Vec::new();
    let mut standby = None;
    let last = segments.len().saturating_sub(1);
    // The segment that was being written when the server stopped is the last one, or the one before an
    // empty pre-created segment or a file that never got its header (a crash while the next segment was
    // being created): only its end may be torn, or end in the zeros written ahead of its frames. (A
    // pre-created segment with bytes after its header was being started when the server stopped, so
    // the segment before it was complete, and cut to its last frame.)
    // Such a file is only left by a crash while the file was being created, between two commits (or
    // inside a rotation, after the segment before it was cut to its last frame): that segment may end
    // in zeros, but a bad frame there is damage, not a tear (`complete_tail`).
    let (tail, complete_tail) = match segments.last() {
        Some((_, path)) if last > 0 && is_empty_standby(path)? => (last - 1, false),
        Some((_, path)) if last > 0 && holds_nothing(path)? => (last - 1, true),
        _ => (last, false),
    };
    for (i, (seq, path)) in segments.iter().enumerate() {
        let buf = fs::read(path).map_err(io_err(path))?;
        let start = recovered.records.len();
        let corrupt = |offset: usize, reason: String| WalError::Corrupt {
            path: path.clone(),
            offset: offset as u64,
            reason,
        };
        let scan =
            scan_segment(&buf, *seq, i == last || i == tail).map_err(|(o, r)| corrupt(o, r))?;
        if let Some(offset) = scan.torn_at.filter(|_| i == tail && complete_tail) {
            return Err(corrupt(
                offset,
                "a bad frame at the end of the segment before a file that never got its header: \
                 that file was being created between two commits or in a rotation, when this \
                 segment was complete"
                    .into(),
            ));
        }
        // The tail before an empty standby may be torn, but only the last file may be a standby.
        if scan.standby && i != last {
            return Err(corrupt(
                SEGMENT_STATE_OFFSET as usize,
                "a pre-created (standby) segment is followed by later segments".into(),
            ));
        }
        recovered.records.extend(scan.records);
        if let Some(offset) = scan.zeros_at {
            // The zeros the writer puts ahead of its frames: the clean end of the segment that was in
            // use. Cut (the writer starts a new segment, and a closed one must end at its last frame),
            // with no copy kept: nothing was written there.
            tracing::info!(
                segment = %path.display(),
                offset,
                bytes = buf.len() - offset,
                "cut the zeros written ahead of the wal's last frame"
            );
            cut(path, offset as u64)?;
        }
        if let Some(offset) = scan.torn_at {
            let saved_to = path.with_extension(format!("log.torn-{offset}"));
            save_and_cut(path, &buf, offset, &saved_to)?;
            recovered.torn = Some(TornTail {
                segment: path.clone(),
                offset: offset as u64,
                bytes: (buf.len() - offset) as u64,
                saved_to,
            });
            if offset == 0 {
                // A torn header: the file is gone, and it held nothing.
                continue;
            }
        }
        if scan.standby {
            standby = Some(Standby {
                seq: *seq,
                path: path.clone(),
            });
            continue;
        }
        let mut max_index = BTreeMap::new();
        for r in recovered.records[start..].iter().filter(|r| !r.sticky) {
            let m = max_index.entry(r.group).or_insert(0);
            *m = r.index.max(*m);
        }
        infos.push(SegmentInfo {
            seq: *seq,
            path: path.clone(),
            max_index,
        });
    }
    Ok((recovered, infos, standby))
}

/// Keeps a copy of the torn bytes for post-mortems, then truncates the segment. A segment whose header was
/// torn is removed entirely (it holds nothing).
fn save_and_cut(path: &Path, buf: &[u8], offset: usize, saved_to: &Path) -> Result<(), WalError> {
    let mut copy = fs::File::create(saved_to).map_err(io_err(saved_to))?;
    copy.write_all(&buf[offset..]).map_err(io_err(saved_to))?;
    copy.sync_all().map_err(io_err(saved_to))?;
    if offset == 0 {
        fs::remove_file(path).map_err(io_err(path))?;
        if let Some(dir) = path.parent() {
            sync_dir(dir)?;
        }
    } else {
        cut(path, offset as u64)?;
    }
    Ok(())
}

/// Truncates the segment at `path` to `len` bytes, durably.
fn cut(path: &Path, len: u64) -> Result<(), WalError> {
    let file = fs::OpenOptions::new()
        .write(true)
        .open(path)
        .map_err(io_err(path))?;
    file.set_len(len).map_err(io_err(path))?;
    file.sync_all().map_err(io_err(path))
}

pub(crate) fn sync_dir(dir: &Path) -> Result<(), WalError> {
    fs::sync_dir(dir).map_err(io_err(dir))
}

/// What one segment's bytes hold.
#[derive(Debug, Default)]
pub struct Scan {
    /// The records of every valid frame before the first invalid one.
    pub records: Vec<Record>,
    /// Where a torn tail starts, if the last segment ends in one.
    pub torn_at: Option<usize>,
    /// Where the zeros start that the writer puts ahead of its frames
    /// ([`crate::writer::ZERO_AHEAD_BYTES`]), if the tail segment ends in them: its clean end, not a
    /// tear. Only the segment in use has them (a segment is cut to its last frame before the next one
    /// starts), so in an older segment they are damage like any other invalid frame.
    pub zeros_at: Option<usize>,
    /// The segment was pre-created and never put in use: it holds no records, and whatever follows its
    /// header is cut as torn.
    pub standby: bool,
}

/// Decodes the bytes of segment number `seq` without any I/O (recovery's decoder, and a fuzz target). A
/// bad frame is a torn tail only in the last segment and only if no valid frame follows it; otherwise
/// the segment is corrupt: `Err((offset, reason))`. Nothing but zeros from a frame's start to the end
/// of the last segment (`is_last`: the tail) is its clean end ([`Scan::zeros_at`]). A pre-created
/// segment may only be the last. A version this build does not know is refused, not guessed at.
pub fn scan_segment(buf: &[u8], seq: u64, is_last: bool) -> Result<Scan, (usize, String)> {
    let mut scan = Scan::default();
    let mut at = SEGMENT_HEADER_BYTES as usize;
    let mut bad: Option<(usize, String)> = None;
    let version = segment_version(buf).unwrap_or(SEGMENT_VERSION);
    if !(SEGMENT_VERSION_UNPLACED..=SEGMENT_VERSION).contains(&version) {
        return Err((
            SEGMENT_VERSION_OFFSET as usize,
            format!(
                "unknown segment format version {version} (this build reads versions \
                 {SEGMENT_VERSION_UNPLACED} to {SEGMENT_VERSION}; was it written by a newer release?)"
            ),
        ));
    }
    match segment_state(buf) {
        None => bad = Some((0, "bad segment header".to_string())),
        Some(0) => {}
        Some(STANDBY) if !is_last => {
            return Err((
                SEGMENT_STATE_OFFSET as usize,
                "a pre-created (standby) segment is followed by later segments".into(),
            ))
        }
        Some(STANDBY) => {
            // Putting a pre-created segment in use clears its state in the same write-then-sync as the
            // first frames after its header. A segment still marked standby therefore never completed
            // that sync, and nothing after its header was acknowledged.
            scan.standby = true;
            if buf.len() > at {
                scan.torn_at = Some(at);
            }
            return Ok(scan);
        }
        Some(other) => {
            return Err((
                SEGMENT_STATE_OFFSET as usize,
                format!("unknown segment state 0x{other:08x}"),
            ))
        }
    }
    if bad.is_none() {
        while at < buf.len() {
            match check_frame(buf, seq, version, at) {
                FrameCheck::Valid { body, next } => {
                    decode_records(body, &mut scan.records).map_err(|reason| (at, reason))?;
                    at = next;
                }
                FrameCheck::Invalid(reason) => {
                    bad = Some((at, reason));
                    break;
                }
            }
        }
    }
    if let Some((offset, reason)) = bad {
        // A crash can only tear the frame being written when it struck, which is the last one in the
        // last segment: so a bad frame is torn only if no valid frame follows it.
        let valid_later = (offset + 1..buf.len().saturating_sub(3)).any(|o| {
            buf[o..o + 4] == FRAME_MAGIC.to_le_bytes()
                && matches!(check_frame(buf, seq, version, o), FrameCheck::Valid { .. })
        });
        if !is_last || valid_later {
            return Err((offset, reason));
        }
        // (A header of zeros is not a clean end: the file holds nothing and is removed as torn.)
        if offset > 0 && buf[offset..].iter().all(|&b| b == 0) {
            scan.zeros_at = Some(offset);
        } else {
            scan.torn_at = Some(offset);
        }
    }
    Ok(scan)
}
