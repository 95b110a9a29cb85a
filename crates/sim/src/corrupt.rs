//! Storage corruption for `Fault::Corrupt`: damage to one file of a stopped server's data dir, the way
//! a failing disk does it (a flipped bit, a zeroed sector, a misdirected write: bytes that belong
//! elsewhere, even a whole valid frame, written over the wrong place), where the server must notice it when it
//! starts: in a WAL frame that a valid frame follows, or in the group's snapshot file. (A bad *last*
//! frame of the last segment is what a torn write looks like, which recovery cuts by design; damage
//! there is not drawn.) The server must refuse to start, naming the file; the driver then replaces the
//! replica as an operator would, and the cluster must stay correct meanwhile.

use holdfast_wal::format::{parse_segment_name, valid_frames, FRAME_HEADER_BYTES};
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
    /// Bytes from elsewhere written over the place: in the WAL, a whole other frame of the same length
    /// when there is one (its checksum was valid where it was written), else up to 512 bytes of another
    /// frame; in a snapshot, up to 512 bytes of the file copied to another offset.
    Misdirected,
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
            let target = (c.pick % candidates as u64) as usize;
            if c.damage == Damage::Misdirected {
                return misdirect(&frames, target, c.pick);
            }
            frames[target].clone()
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
        Damage::Misdirected => {
            // Only a snapshot gets here: a run of the file written at another offset.
            let from = (c.pick >> 24) % len.max(1);
            let n = 512.min(len - at).min(len - from);
            let copied = bytes[from as usize..(from + n) as usize].to_vec();
            if copied != bytes[at as usize..(at + n) as usize] {
                (at, copied)
            } else {
                (at, vec![bytes[at as usize] ^ 0x01])
            }
        }
    };
    overwrite(&path, offset, &new)?;
    let what = format!(
        "{:?} of {} byte(s) at offset {offset} of {}",
        c.damage,
        new.len(),
        path.display()
    );
    Ok(Some((path, what)))
}

/// Writes `new` over `path` at `offset`, durably.
fn overwrite(path: &Path, offset: u64, new: &[u8]) -> std::io::Result<()> {
    let mut file = fs::OpenOptions::new().write(true).open(path)?;
    file.seek(SeekFrom::Start(offset))?;
    file.write_all(new)?;
    file.sync_all()
}

/// A misdirected write over WAL frame `target` of `frames` (which has at least two).
fn misdirect(
    frames: &[(PathBuf, u64, u64)],
    target: usize,
    pick: u64,
) -> std::io::Result<Option<(PathBuf, String)>> {
    let header = FRAME_HEADER_BYTES as u64;
    let (path, body, len) = &frames[target];
    let others: Vec<usize> = (0..frames.len()).filter(|&i| i != target).collect();
    let same_len: Vec<usize> = others
        .iter()
        .copied()
        .filter(|&i| frames[i].2 == *len)
        .collect();
    let (source, whole) = match same_len.is_empty() {
        false => (
            same_len[((pick >> 8) % same_len.len() as u64) as usize],
            true,
        ),
        true => (others[((pick >> 8) % others.len() as u64) as usize], false),
    };
    let (from_path, from_body, from_len) = &frames[source];
    let from_bytes = fs::read(from_path)?;
    // The whole frame, header and all; or a run from the start of the other frame, landing inside this
    // frame so that the valid frame after it is left alone.
    let (from, at, n) = match whole {
        true => (from_body - header, body - header, len + header),
        false => {
            let at = body + (pick >> 16) % len;
            (
                from_body - header,
                at,
                (body + len - at).min(from_len + header).min(512),
            )
        }
    };
    let mut new = from_bytes[from as usize..(from + n) as usize].to_vec();
    let bytes = fs::read(path)?;
    if new == bytes[at as usize..(at + n) as usize] {
        // The same bytes were there already: a flip instead, so the damage is real.
        new = vec![bytes[at as usize] ^ 0x01];
    }
    overwrite(path, at, &new)?;
    let what = format!(
        "Misdirected write of {} byte(s) ({}) from offset {from} of {} to offset {at} of {}",
        new.len(),
        if whole {
            "a whole frame"
        } else {
            "part of a frame"
        },
        from_path.display(),
        path.display()
    );
    Ok(Some((path.clone(), what)))
}

/// Every valid frame of the WAL in `dir`, oldest first: (segment, body offset, body length). Only
/// segments in use: recovery cuts whatever follows a standby's header unread (a crash can keep the
/// frames of its first batch but lose the write that put it in use).
fn wal_frames(dir: &Path) -> std::io::Result<Vec<(PathBuf, u64, u64)>> {
    let segments =
        holdfast_wal::Wal::segment_paths(dir).map_err(|e| std::io::Error::other(e.to_string()))?;
    let mut frames = Vec::new();
    for path in segments {
        let buf = fs::read(&path)?;
        let Some(seq) = path
            .file_name()
            .and_then(|n| n.to_str())
            .and_then(parse_segment_name)
        else {
            continue;
        };
        for (body, len) in valid_frames(&buf, seq)
            .into_iter()
            .filter(|&(_, len)| len > 0)
        {
            frames.push((path.clone(), body, len));
        }
    }
    Ok(frames)
}
