//! The reference fenced store: per key, a value and a **mark** (the highest token seen by a read or a
//! write). A write or read with a token below the mark is refused; otherwise the mark rises to the token.
//! Every change is appended to one file and `fdatasync`ed before it is acknowledged.
//!
//! For a shared lock's readers, [`FencedStore::read_shared`] checks a second mark, the highest token of
//! an exclusive read or write (`write_mark`): a reader is refused only once a newer writer has been
//! here, never because of another reader (docs/api.md, "Shared locks and semaphores").
//!
//! Record: `len u32 | crc32(body) u32 | body`, body = `kind u8 | token u64 | key_len u16 | key | value`
//! (kind 1 = write, 2 = mark raised by a read, 3 = mark raised by a shared read). A record cut short
//! at the very end of the file (it runs past the end, or ends in bytes never written, zeros) is a torn
//! write, never acknowledged, and is cut. Any other bad record refuses to open, the last one included:
//! a whole record that fails its checksum may be an acknowledged one damaged since, and cutting it
//! could lower a mark and let a stale holder in.
//!
//! A failed append (a full disk) is cut back off the file, so the next one does not land after
//! garbage; if that fails too, or the `fdatasync` fails (after which the kernel may have dropped the
//! write or may still write it), the store refuses everything until it is restarted and reads its
//! file again: an append whose outcome is unknown must not be followed by one that assumes either.

use crate::fs::{File, OpenOptions};
use crate::FenceError;
use std::collections::BTreeMap;
use std::io::{Read, Write};
use std::path::Path;
use std::sync::Mutex;

/// Longest key in bytes.
pub const MAX_KEY_BYTES: usize = 1024;
/// Largest value in bytes.
pub const MAX_VALUE_BYTES: usize = 1 << 20;

const KIND_WRITE: u8 = 1;
const KIND_MARK: u8 = 2;
const KIND_SHARED_MARK: u8 = 3;

#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Entry {
    pub mark: u64,
    /// The highest token of an exclusive read or write (what a shared read is checked against).
    pub write_mark: u64,
    pub value: Option<Vec<u8>>,
    /// The token of the write that stored `value`.
    pub value_token: u64,
}

pub struct FencedStore {
    inner: Mutex<Inner>,
}

struct Inner {
    file: File,
    /// The file's length: where the next record goes, and what a failed append is cut back to.
    len: u64,
    /// Why the store stopped accepting (see the module docs).
    failed: Option<String>,
    keys: BTreeMap<String, Entry>,
}

fn check(key: &str, token: u64, value: &[u8]) -> Result<(), FenceError> {
    if token == 0 {
        // Holdfast's tokens start at 1: a 0 is a caller that lost its token, and would pass on
        // every key not written yet.
        return Err(FenceError::Invalid(
            "token 0 is not a Holdfast token (they start at 1)".into(),
        ));
    }
    if key.is_empty() || key.len() > MAX_KEY_BYTES {
        return Err(FenceError::Invalid(format!(
            "key must be 1..={MAX_KEY_BYTES} bytes (max_key_bytes)"
        )));
    }
    if value.len() > MAX_VALUE_BYTES {
        return Err(FenceError::Invalid(format!(
            "value of {} bytes is over {MAX_VALUE_BYTES} (max_value_bytes)",
            value.len()
        )));
    }
    Ok(())
}

impl FencedStore {
    /// Opens (or creates) the store file and replays it. A file it creates is made durable in its
    /// directory before anything is acknowledged, so marks cannot vanish with its directory entry.
    pub fn open(path: &Path) -> Result<FencedStore, FenceError> {
        let mut file = OpenOptions::new()
            .create(true)
            .read(true)
            .append(true)
            .open(path)?;
        // Every time, not only when this open created the file: a crash between creating it and this
        // sync would otherwise leave it unsynced for good.
        file.sync_all()?;
        let dir = path
            .parent()
            .filter(|d| !d.as_os_str().is_empty())
            .unwrap_or(Path::new("."));
        crate::fs::sync_dir(dir)?;
        let mut bytes = Vec::new();
        file.read_to_end(&mut bytes)?;
        let mut keys: BTreeMap<String, Entry> = BTreeMap::new();
        let mut at = 0;
        while at < bytes.len() {
            match decode(&bytes[at..]) {
                Some((kind, token, key, value, len)) => {
                    let e = keys.entry(key).or_default();
                    e.mark = e.mark.max(token);
                    if kind != KIND_SHARED_MARK {
                        e.write_mark = e.write_mark.max(token);
                    }
                    if kind == KIND_WRITE {
                        e.value = Some(value);
                        e.value_token = token;
                    }
                    at += len;
                }
                None => {
                    let later_valid = (at + 1..bytes.len()).any(|o| decode(&bytes[o..]).is_some());
                    if later_valid {
                        return Err(FenceError::Invalid(format!(
                            "{} is corrupt at offset {at}",
                            path.display()
                        )));
                    }
                    if !torn(&bytes[at..]) {
                        return Err(FenceError::Invalid(format!(
                            "{} is corrupt at offset {at}: its last record is whole but fails its \
                             checksum, so it may have been acknowledged and damaged since (cutting it \
                             could lower a mark). If you know its write never completed, truncate \
                             the file to {at} bytes",
                            path.display()
                        )));
                    }
                    tracing::warn!(path = %path.display(), offset = at, "cutting a torn record at the end of the fenced store");
                    file.set_len(at as u64)?;
                    file.sync_all()?;
                    break;
                }
            }
        }
        let len = file.metadata()?.len();
        Ok(FencedStore {
            inner: Mutex::new(Inner {
                file,
                len,
                failed: None,
                keys,
            }),
        })
    }

    /// Stores `value` under `key` if `token` is at least the key's mark; the mark becomes `token`.
    pub fn write(&self, key: &str, token: u64, value: &[u8]) -> Result<u64, FenceError> {
        check(key, token, value)?;
        let mut inner = self.inner.lock().expect("fenced store lock");
        inner.usable()?;
        let mark = inner.keys.get(key).map_or(0, |e| e.mark);
        if token < mark {
            return Err(FenceError::Stale {
                resource: key.to_string(),
                token,
                seen: mark,
            });
        }
        inner.append(KIND_WRITE, token, key, value)?;
        let e = inner.keys.entry(key.to_string()).or_default();
        e.mark = token;
        e.write_mark = token;
        e.value = Some(value.to_vec());
        e.value_token = token;
        Ok(token)
    }

    /// Reads `key` if `token` is at least the key's mark, raising the mark to `token` (durably).
    pub fn read(&self, key: &str, token: u64) -> Result<Entry, FenceError> {
        check(key, token, &[])?;
        let mut inner = self.inner.lock().expect("fenced store lock");
        inner.usable()?;
        let entry = inner.keys.get(key).cloned().unwrap_or_default();
        if token < entry.mark {
            return Err(FenceError::Stale {
                resource: key.to_string(),
                token,
                seen: entry.mark,
            });
        }
        if token > entry.write_mark {
            inner.append(KIND_MARK, token, key, &[])?;
            let e = inner.keys.entry(key.to_string()).or_default();
            e.mark = token;
            e.write_mark = token;
        }
        Ok(Entry {
            mark: token,
            write_mark: token,
            ..entry
        })
    }

    /// Reads `key` for a **shared** holder: refused only if an exclusive read or write with a token at
    /// or above `token` was here (a newer writer); raises the mark to `token` (durably), so a writer
    /// older than this reader is refused from then on. Readers never refuse each other.
    pub fn read_shared(&self, key: &str, token: u64) -> Result<Entry, FenceError> {
        check(key, token, &[])?;
        let mut inner = self.inner.lock().expect("fenced store lock");
        inner.usable()?;
        let entry = inner.keys.get(key).cloned().unwrap_or_default();
        if token <= entry.write_mark {
            return Err(FenceError::Stale {
                resource: key.to_string(),
                token,
                seen: entry.write_mark,
            });
        }
        if token > entry.mark {
            inner.append(KIND_SHARED_MARK, token, key, &[])?;
            inner.keys.entry(key.to_string()).or_default().mark = token;
        }
        Ok(Entry {
            mark: entry.mark.max(token),
            ..entry
        })
    }

    /// The key's state without any check (for tests and inspection).
    pub fn peek(&self, key: &str) -> Option<Entry> {
        self.inner
            .lock()
            .expect("fenced store lock")
            .keys
            .get(key)
            .cloned()
    }
}

impl Inner {
    fn usable(&self) -> Result<(), FenceError> {
        match &self.failed {
            None => Ok(()),
            Some(why) => Err(FenceError::Unavailable(format!(
                "the store stopped after a failed write ({why}); restart it to read its file again"
            ))),
        }
    }

    fn append(&mut self, kind: u8, token: u64, key: &str, value: &[u8]) -> Result<(), FenceError> {
        let mut body = Vec::with_capacity(11 + key.len() + value.len());
        body.push(kind);
        body.extend_from_slice(&token.to_le_bytes());
        body.extend_from_slice(&(key.len() as u16).to_le_bytes());
        body.extend_from_slice(key.as_bytes());
        body.extend_from_slice(value);
        let mut record = Vec::with_capacity(8 + body.len());
        record.extend_from_slice(&(body.len() as u32).to_le_bytes());
        record.extend_from_slice(&crc32fast::hash(&body).to_le_bytes());
        record.extend_from_slice(&body);
        if let Err(e) = self.file.write_all(&record) {
            // Cut what part of it was written, so the next record does not land after garbage.
            let cut = self
                .file
                .set_len(self.len)
                .and_then(|()| self.file.sync_all());
            if let Err(cut) = cut {
                self.failed = Some(format!("{e}; cutting it back failed: {cut}"));
            }
            return Err(e.into());
        }
        if let Err(e) = self.file.sync_data() {
            self.failed = Some(format!("fdatasync: {e}"));
            return Err(e.into());
        }
        self.len += record.len() as u64;
        Ok(())
    }
}

/// Whether the bad record at the start of `tail` (the file's last bytes) is a write cut short by a
/// crash: its header or body runs past the end of the file, or it ends in bytes the crash left
/// unwritten (zeros: a file's length can reach the disk before its data). A whole record that fails
/// its checksum otherwise is damage, not a torn write (one whose last 8 bytes happen to be zeros is
/// taken for torn: the one damage this cannot tell apart).
fn torn(tail: &[u8]) -> bool {
    if tail.iter().all(|&b| b == 0) {
        return true;
    }
    let Some(len) = tail.get(0..4) else {
        return true;
    };
    let len = u32::from_le_bytes(len.try_into().expect("4 bytes")) as usize;
    // A crash leaves a length field as written or zero, never out of range: a length no record can
    // have is damage, even where it runs past the end of the file.
    if !(11..=11 + MAX_KEY_BYTES + MAX_VALUE_BYTES).contains(&len) {
        return false;
    }
    let end = len + 8;
    if tail.len() < end {
        return true;
    }
    tail[end - 8..].iter().all(|&b| b == 0)
}

/// Decodes one record at the start of `buf`: (kind, token, key, value, record length).
fn decode(buf: &[u8]) -> Option<(u8, u64, String, Vec<u8>, usize)> {
    let len = u32::from_le_bytes(buf.get(0..4)?.try_into().ok()?) as usize;
    let crc = u32::from_le_bytes(buf.get(4..8)?.try_into().ok()?);
    if !(11..=11 + MAX_KEY_BYTES + MAX_VALUE_BYTES).contains(&len) {
        return None;
    }
    let body = buf.get(8..8 + len)?;
    if crc32fast::hash(body) != crc {
        return None;
    }
    let kind = body[0];
    if !matches!(kind, KIND_WRITE | KIND_MARK | KIND_SHARED_MARK) {
        return None;
    }
    let token = u64::from_le_bytes(body[1..9].try_into().ok()?);
    let key_len = u16::from_le_bytes(body[9..11].try_into().ok()?) as usize;
    let key = String::from_utf8(body.get(11..11 + key_len)?.to_vec()).ok()?;
    let value = body[11 + key_len..].to_vec();
    Some((kind, token, key, value, 8 + len))
}

/// One accepted change, as the store's file records it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Record {
    /// A write (true) or a mark raised by a read (false).
    pub write: bool,
    pub key: String,
    pub token: u64,
    pub value: Vec<u8>,
}

/// Every change a store file holds, in the order the store accepted them (for checkers). Stops at a
/// torn tail.
pub fn read_records(path: &Path) -> Result<Vec<Record>, FenceError> {
    let bytes = crate::fs::read(path)?;
    let mut out = Vec::new();
    let mut at = 0;
    while let Some((kind, token, key, value, len)) = decode(&bytes[at..]) {
        out.push(Record {
            write: kind == KIND_WRITE,
            key,
            token,
            value,
        });
        at += len;
    }
    Ok(out)
}
