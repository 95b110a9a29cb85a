//! The file system the WAL (and the server's snapshot files) use: `std::fs` in a real server, turmoil's
//! simulated file system in the deterministic simulation (`--cfg holdfast_sim`), where a crash keeps only
//! what was synced. Every file operation of the log goes through this module, so the simulation runs the
//! same recovery code as a real server.

#[cfg(not(holdfast_sim))]
pub use std::fs::*;
#[cfg(holdfast_sim)]
pub use turmoil::fs::shim::std::fs::*;

use std::path::Path;

/// Makes the directory's entries (created, renamed and removed files) durable.
#[cfg(not(holdfast_sim))]
pub fn sync_dir(dir: &Path) -> std::io::Result<()> {
    File::open(dir)?.sync_all()
}

/// Makes the directory's entries (created, renamed and removed files) durable.
#[cfg(holdfast_sim)]
pub fn sync_dir(dir: &Path) -> std::io::Result<()> {
    turmoil::fs::shim::std::fs::sync_dir(dir)
}

/// Write-back of a large file as it is written (a snapshot), at most ~2 × [`WriteBehind::STEP`] of it
/// dirty in the page cache at a time. Without it, the file's tens of megabytes reach the disk in one
/// burst at its final `fsync` (or when the kernel's flusher wakes), and every WAL `fdatasync` on the
/// same disk waits behind that burst. Five servers under full load holding 1M locks (a 34 MB snapshot
/// every ~2.7 s each) had ~800 of ~220,000 WAL syncs take over 10 ms and ~100 over 50 ms; writing back
/// 1 MiB at a time, waiting for the MiB before, left ~90 over 10 ms and none over 50 ms
/// (docs/performance.md, "Snapshot write-back"). The snapshot's writer, not the WAL, waits for the disk.
#[derive(Default)]
pub struct WriteBehind {
    /// Bytes from the start of the file handed to the kernel's write-back so far.
    started: u64,
    /// The range started last, waited for before the next is started.
    last: Option<(u64, u64)>,
}

impl WriteBehind {
    pub const STEP: u64 = 1 << 20;

    /// The file length at which [`WriteBehind::written`] next does something.
    pub fn next_step(&self) -> u64 {
        self.started + Self::STEP
    }

    /// Call after the file's first `end` bytes were written (not buffered in user space): once a step
    /// has accumulated, waits until the last step is on disk and starts writing back the new one.
    pub fn written(&mut self, file: &File, end: u64) -> std::io::Result<()> {
        if end < self.next_step() {
            return Ok(());
        }
        if let Some((offset, len)) = self.last {
            sync_range(file, offset, len, true)?;
        }
        sync_range(file, self.started, end - self.started, false)?;
        self.last = Some((self.started, end - self.started));
        self.started = end;
        Ok(())
    }
}

/// `sync_file_range`: starts write-back of the range, and with `wait`, waits for any write-back of it in
/// progress before and until it is written after. No durability promise (that is what `fsync` is for).
/// Its errors are returned, not ignored as a hint's might be: waiting reports (and so consumes) a
/// write-back error of the file, which the final `fsync` would then no longer see.
#[cfg(all(not(holdfast_sim), target_os = "linux"))]
#[allow(
    unsafe_code,
    reason = "sync_file_range(2) has no safe wrapper in std; the call only reads its arguments"
)]
fn sync_range(file: &File, offset: u64, len: u64, wait: bool) -> std::io::Result<()> {
    use std::os::fd::AsRawFd;
    let flags = if wait {
        libc::SYNC_FILE_RANGE_WAIT_BEFORE
            | libc::SYNC_FILE_RANGE_WRITE
            | libc::SYNC_FILE_RANGE_WAIT_AFTER
    } else {
        libc::SYNC_FILE_RANGE_WRITE
    };
    // SAFETY: a plain system call on a file descriptor this `File` owns for the call's duration.
    let r = unsafe { libc::sync_file_range(file.as_raw_fd(), offset as i64, len as i64, flags) };
    if r == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}

/// The simulated file system has no page cache to pace (and other systems no such call).
#[cfg(any(holdfast_sim, not(target_os = "linux")))]
fn sync_range(_file: &File, _offset: u64, _len: u64, _wait: bool) -> std::io::Result<()> {
    Ok(())
}

#[cfg(all(test, not(holdfast_sim)))]
mod tests {
    use super::*;
    use std::io::Write;

    /// The steps handed to the kernel follow each other without gaps or overlaps, each at least a step
    /// long, and the calls succeed on a real file (a wrong flag or range is `EINVAL`).
    #[test]
    fn write_behind_hands_over_the_file_in_consecutive_steps() {
        let dir = tempfile::tempdir().unwrap();
        let mut file = File::create(dir.path().join("f")).unwrap();
        let mut behind = WriteBehind::default();
        let piece = vec![7u8; 100 << 10];
        let (mut end, mut steps) = (0u64, Vec::new());
        while end < 7 << 19 {
            file.write_all(&piece).unwrap();
            end += piece.len() as u64;
            let before = behind.last;
            behind.written(&file, end).unwrap();
            if behind.last != before {
                steps.push(behind.last.unwrap());
            }
        }
        assert_eq!(steps.len(), 3, "{steps:?}");
        let mut next = 0;
        for (offset, len) in steps {
            assert_eq!(offset, next);
            assert!(len >= WriteBehind::STEP);
            next = offset + len;
        }
        assert_eq!(behind.next_step(), next + WriteBehind::STEP);
        file.sync_all().unwrap();
        assert_eq!(
            std::fs::read(dir.path().join("f")).unwrap().len() as u64,
            end
        );
    }
}
