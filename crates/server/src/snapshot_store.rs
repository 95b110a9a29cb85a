//! Snapshot files of one group's state machine.
//!
//! A snapshot file `snap-<index, 20 digits>.bin` holds: magic `b"HFSNAP02"` (format 1), a little-endian
//! `u32` length and the protobuf `SnapshotMeta` (see [`crate::formats`]), then the lock table snapshot bytes
//! (which carry their own version and CRC), and a trailing CRC-32 of everything before it. Files with magic
//! `b"HFSNAP01"` (format 0, Holdfast 0.1: the same layout with a postcard meta) are still read.
//!
//! Files are written to a temporary name, fsynced,
//! renamed into place and the directory fsynced, so a crash leaves either the old or the new snapshot.

use crate::raft_types::SnapshotMeta;
use holdfast_lock_table::LockTable;
use holdfast_wal::fs;
use std::io::Write;
use std::path::PathBuf;

const MAGIC: &[u8; 8] = b"HFSNAP02";
const MAGIC_FORMAT_0: &[u8; 8] = b"HFSNAP01";

pub struct SnapshotStore {
    dir: PathBuf,
}

/// A snapshot file's bytes before the lock table's: the magic, the meta's length and the meta.
fn header(meta: &SnapshotMeta) -> Vec<u8> {
    let meta_bytes = crate::formats::to_bytes(&crate::formats::snapshot_meta_to_pb(meta));
    let mut out = Vec::with_capacity(12 + meta_bytes.len());
    out.extend_from_slice(MAGIC);
    out.extend_from_slice(&(meta_bytes.len() as u32).to_le_bytes());
    out.extend_from_slice(&meta_bytes);
    out
}

/// A snapshot file being written ([`SnapshotStore::create`]).
pub struct SnapshotFile {
    file: std::io::BufWriter<fs::File>,
    tmp: PathBuf,
    path: PathBuf,
    /// Of everything written so far (the file's trailing checksum).
    crc: crc32fast::Hasher,
    len: u64,
    /// Written back as it goes, so the final sync is small and WAL syncs do not queue behind it.
    behind: fs::WriteBehind,
}

impl SnapshotFile {
    /// Appends the next bytes of the lock table's snapshot.
    pub fn write(&mut self, bytes: &[u8]) -> std::io::Result<()> {
        self.crc.update(bytes);
        self.len += bytes.len() as u64;
        self.file.write_all(bytes)?;
        if self.len >= self.behind.next_step() {
            // What the buffer holds is not the kernel's yet: hand everything over first.
            self.file.flush()?;
            self.behind.written(self.file.get_ref(), self.len)?;
        }
        Ok(())
    }

    /// Appends the checksum, syncs the file, has `verify` read it (still under its temporary name),
    /// then renames it into place, syncs the directory and deletes older snapshots. Returns the file
    /// and its length. On an error before the rename the temporary file is removed, and the last good
    /// snapshot stays.
    pub fn finish(
        self,
        store: &SnapshotStore,
        verify: impl FnOnce(&std::path::Path) -> std::io::Result<()>,
    ) -> std::io::Result<(PathBuf, u64)> {
        let SnapshotFile {
            file,
            tmp,
            path,
            crc,
            len,
            behind: _,
        } = self;
        let written = (|| {
            let mut file = file.into_inner().map_err(|e| e.into_error())?;
            file.write_all(&crc.finalize().to_le_bytes())?;
            file.sync_all()?;
            drop(file);
            verify(&tmp)
        })();
        if let Err(e) = written {
            let _ = fs::remove_file(&tmp);
            return Err(e);
        }
        store.install(&tmp, &path)?;
        Ok((path, len + 4))
    }

    /// Gives up on the file (its writer failed): the temporary is removed.
    pub fn discard(self) {
        let SnapshotFile { file, tmp, .. } = self;
        drop(file.into_inner());
        let _ = fs::remove_file(tmp);
    }
}

/// A decoded snapshot file.
pub struct Loaded {
    pub meta: SnapshotMeta,
    pub table: LockTable,
}

impl SnapshotStore {
    pub fn open(dir: PathBuf) -> std::io::Result<Self> {
        fs::create_dir_all(&dir)?;
        // Leftover temporaries are snapshots a crash interrupted before their rename: never valid.
        for entry in fs::read_dir(&dir)? {
            let path = entry?.path();
            if path.extension().is_some_and(|e| e == "tmp") {
                fs::remove_file(&path)?;
            }
        }
        // The directory (DATA_DIR/snapshots/gN) and its entries in its parents, durably: a snapshot
        // synced into a directory whose own entry a crash loses is lost with it, after the log it
        // covers was purged (or, restoring a backup, before the IDENTITY written after it).
        fs::sync_dir(&dir)?;
        for parent in dir.ancestors().skip(1).take(2) {
            if !parent.as_os_str().is_empty() {
                fs::sync_dir(parent)?;
            }
        }
        Ok(SnapshotStore { dir })
    }

    /// Encodes a snapshot file's bytes (also what is sent to a peer that needs it).
    pub fn encode(meta: &SnapshotMeta, table_bytes: &[u8]) -> Vec<u8> {
        let mut out = header(meta);
        out.reserve(table_bytes.len() + 4);
        out.extend_from_slice(table_bytes);
        let crc = crc32fast::hash(&out);
        out.extend_from_slice(&crc.to_le_bytes());
        out
    }

    /// Decodes and checks snapshot bytes.
    pub fn decode(bytes: &[u8]) -> Result<Loaded, String> {
        if bytes.len() < MAGIC.len() + 8 {
            return Err(format!("snapshot is truncated ({} bytes)", bytes.len()));
        }
        let (body, crc) = bytes.split_at(bytes.len() - 4);
        let stored = u32::from_le_bytes(crc.try_into().expect("4 bytes"));
        if crc32fast::hash(body) != stored {
            return Err("snapshot checksum mismatch".into());
        }
        let format_0 = match &body[..8] {
            m if m == MAGIC => false,
            m if m == MAGIC_FORMAT_0 => true,
            _ => {
                return Err(
                    "snapshot has bad magic (not a holdfast snapshot, or a newer format)".into(),
                )
            }
        };
        let meta_len = u32::from_le_bytes(body[8..12].try_into().expect("4 bytes")) as usize;
        let meta_end = 12usize
            .checked_add(meta_len)
            .filter(|&e| e <= body.len())
            .ok_or("snapshot meta runs past its end")?;
        let meta_bytes = &body[12..meta_end];
        let meta: SnapshotMeta = if format_0 {
            crate::formats::legacy::snapshot_meta(meta_bytes)?
        } else {
            crate::formats::snapshot_meta_from_pb(&crate::formats::from_bytes(
                meta_bytes,
                "snapshot meta",
            )?)?
        };
        let table = LockTable::decode_snapshot(&body[meta_end..]).map_err(|e| e.to_string())?;
        Ok(Loaded { meta, table })
    }

    fn path_for(&self, index: u64) -> PathBuf {
        self.dir.join(format!("snap-{index:020}.bin"))
    }

    /// Durably stores `bytes` as the snapshot at `index` and deletes older ones.
    pub fn save(&self, index: u64, bytes: &[u8]) -> std::io::Result<()> {
        let path = self.path_for(index);
        let tmp = path.with_extension("tmp");
        let mut file = fs::File::create(&tmp)?;
        holdfast_wal::failpoint::hit_then("snapshot.write", || {
            let _ = file.write_all(&bytes[..bytes.len() / 2]);
        })?;
        let written = (|| {
            let mut behind = fs::WriteBehind::default();
            let mut written = 0;
            for piece in bytes.chunks(fs::WriteBehind::STEP as usize) {
                file.write_all(piece)?;
                written += piece.len() as u64;
                behind.written(&file, written)?;
            }
            file.sync_all()
        })();
        if let Err(e) = written {
            // A full disk, say: the partial file would take the space until a restart removed it.
            drop(file);
            let _ = fs::remove_file(&tmp);
            return Err(e);
        }
        self.install(&tmp, &path)
    }

    /// Renames the synced temporary file `tmp` to `path`, syncs the directory and deletes every other
    /// snapshot.
    fn install(&self, tmp: &std::path::Path, path: &std::path::Path) -> std::io::Result<()> {
        fs::rename(tmp, path)?;
        holdfast_wal::failpoint::hit("snapshot.rename")?;
        fs::sync_dir(&self.dir)?;
        for old in self.files()? {
            if old != path {
                fs::remove_file(old)?;
            }
        }
        Ok(())
    }

    /// Starts writing the snapshot at `meta`'s index a piece at a time ([`SnapshotFile::write`]), to a
    /// temporary file that [`SnapshotFile::finish`] makes durable and renames into place. The table's
    /// bytes are streamed in, so a snapshot is never one buffer in memory.
    pub fn create(&self, meta: &SnapshotMeta) -> std::io::Result<SnapshotFile> {
        let index = meta.last_log_id.map_or(0, |l| l.index);
        let path = self.path_for(index);
        let tmp = path.with_extension("tmp");
        let header = header(meta);
        let mut file = SnapshotFile {
            file: std::io::BufWriter::with_capacity(1 << 20, fs::File::create(&tmp)?),
            tmp,
            path,
            crc: crc32fast::Hasher::new(),
            len: 0,
            behind: fs::WriteBehind::default(),
        };
        let started = holdfast_wal::failpoint::hit_then("snapshot.write", || {
            let _ = file.file.write_all(&header[..header.len() / 2]);
            let _ = file.file.flush();
        })
        .and_then(|()| file.write(&header));
        match started {
            Ok(()) => Ok(file),
            Err(e) => {
                file.discard();
                Err(e)
            }
        }
    }

    /// Where the snapshot at `index` is (or would be) stored.
    pub fn path_of(&self, index: u64) -> PathBuf {
        self.path_for(index)
    }

    /// A snapshot file's bytes.
    pub fn read(path: &std::path::Path) -> std::io::Result<Vec<u8>> {
        fs::read(path)
    }

    /// The newest snapshot file's bytes, if any.
    pub fn latest(&self) -> std::io::Result<Option<(PathBuf, Vec<u8>)>> {
        match self.files()?.pop() {
            Some(path) => {
                let bytes = fs::read(&path)?;
                Ok(Some((path, bytes)))
            }
            None => Ok(None),
        }
    }

    fn files(&self) -> std::io::Result<Vec<PathBuf>> {
        let mut files: Vec<PathBuf> = fs::read_dir(&self.dir)?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.extension().is_some_and(|e| e == "bin"))
            .collect();
        files.sort();
        Ok(files)
    }
}
