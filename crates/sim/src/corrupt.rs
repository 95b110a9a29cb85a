//! Storage corruption for `Fault::Corrupt`: damage to one file of a stopped server's data dir, the way
//! a failing disk does it (a flipped bit, a zeroed sector), where the server must notice it when it
//! starts: in a WAL frame that a valid frame follows, or in the group's snapshot file. (A bad *last*
//! frame of the last segment is what a torn write looks like, which recovery cuts by design; damage
//! there is not drawn.) The server must refuse to start, naming the file; the driver then replaces the
//! replica as an operator would, and the cluster must stay correct meanwhile.

use holdfast_wal::format::{
    FRAME_HEADER_BYTES, FRAME_MAGIC, SEGMENT_HEADER_BYTES, SEGMENT_STATE_OFFSET,
};
use holdfast_wal::fs;
use std::io::{Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};

/// Which file is damaged.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Target {
    WalFrame,
    Snapshot,
}

/// How it is damaged.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Damage {
    /// One bit of one byte flipped.
    BitFlip,
    /// Up to 512 bytes zeroed (within one frame for the WAL, so a valid frame still follows).
    ZeroedSector,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Corruption {
    pub target: Target,
    pub damage: Damage,
    /// Chooses the frame, the offset and the bit.
    pub pick: u64,
}

/// Applies `c` under `data_dir` (on this host's simulated disk, durably). Returns the damaged file and
/// what was done, or None when there is nothing of that kind to damage (no snapshot yet, a WAL of one
/// frame).
pub fn apply(data_dir: &Path, c: Corruption) -> std::io::Result<Option<(PathBuf, String)>> {
    let (path, start, len) = match c.target {
        Target::WalFrame => {
            let frames = wal_frames(&data_dir.join("wal"))?;
            // Every frame but the very last one (which would read as a torn write).
            let Some(candidates) = frames.len().checked_sub(1).filter(|&n| n > 0) else {
                return Ok(None);
            };
            let (path, body, len) = frames[(c.pick % candidates as u64) as usize].clone();
            (path, body, len)
        }
        Target::Snapshot => {
            let dir = data_dir.join("snapshots").join("g0");
            let mut files: Vec<PathBuf> = match fs::read_dir(&dir) {
                Ok(entries) => entries
                    .filter_map(|e| e.ok().map(|e| e.path()))
                    .filter(|p| p.extension().is_some_and(|e| e == "bin"))
                    .collect(),
                Err(_) => Vec::new(),
            };
            files.sort();
            let Some(path) = files.pop() else {
                // No snapshot yet (the seed's thresholds are high): a WAL frame instead.
                let wal = Corruption {
                    target: Target::WalFrame,
                    ..c
                };
                return apply(data_dir, wal);
            };
            let len = fs::read(&path)?.len() as u64;
            (path, 0, len)
        }
    };
    let bytes = fs::read(&path)?;
    let at = start + (c.pick >> 8) % len.max(1);
    let (offset, new): (u64, Vec<u8>) = match c.damage {
        Damage::ZeroedSector => {
            let n = 512.min(start + len - at);
            let zeros = vec![0u8; n as usize];
            if bytes[at as usize..(at + n) as usize] != zeros[..] {
                (at, zeros)
            } else {
                // Already zero there: a flip instead, so the damage is real.
                (at, vec![bytes[at as usize] ^ 0x01])
            }
        }
        Damage::BitFlip => (at, vec![bytes[at as usize] ^ (1 << ((c.pick >> 40) % 8))]),
    };
    let mut file = fs::OpenOptions::new().write(true).open(&path)?;
    file.seek(SeekFrom::Start(offset))?;
    file.write_all(&new)?;
    file.sync_all()?;
    let what = format!(
        "{:?} of {} byte(s) at offset {offset} of {}",
        c.damage,
        new.len(),
        path.display()
    );
    Ok(Some((path, what)))
}

/// Every valid frame of the WAL in `dir`, oldest first: (segment, body offset, body length).
fn wal_frames(dir: &Path) -> std::io::Result<Vec<(PathBuf, u64, u64)>> {
    let segments =
        holdfast_wal::Wal::segment_paths(dir).map_err(|e| std::io::Error::other(e.to_string()))?;
    let mut frames = Vec::new();
    for path in segments {
        let buf = fs::read(&path)?;
        // Only a segment in use (state 0): recovery cuts whatever follows a standby's header unread
        // (a crash can keep the frames of its first batch but lose the write that put it in use).
        let state = buf
            .get(SEGMENT_STATE_OFFSET as usize..SEGMENT_HEADER_BYTES as usize)
            .map(|w| u32::from_le_bytes(w.try_into().expect("4 bytes")));
        if state != Some(0) {
            continue;
        }
        let mut at = SEGMENT_HEADER_BYTES as usize;
        while at + FRAME_HEADER_BYTES <= buf.len() {
            let word = |o: usize| u32::from_le_bytes(buf[o..o + 4].try_into().expect("4 bytes"));
            let (magic, len, crc) = (word(at), word(at + 4) as usize, word(at + 8));
            let body = at + FRAME_HEADER_BYTES;
            if magic != FRAME_MAGIC || body + len > buf.len() || len == 0 {
                break;
            }
            if crc32fast::hash(&buf[body..body + len]) != crc {
                break;
            }
            frames.push((path.clone(), body as u64, len as u64));
            at = body + len;
        }
    }
    Ok(frames)
}
