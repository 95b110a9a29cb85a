//! The reference fenced store: per key, a value and a **mark** (the highest token seen by a read or a
//! write). A write or read with a token below the mark is refused; otherwise the mark rises to the token.
//! Every change is appended to one file and `fdatasync`ed before it is acknowledged.
//!
//! For a shared lock's readers, [`FencedStore::read_shared`] checks a second mark, the highest token of
//! an exclusive read or write (`write_mark`): a reader is refused only once a newer writer has been
//! here, never because of another reader (docs/api.md, "Shared locks and semaphores").
//!
//! Record: `len u32 | crc32(body) u32 | body`, body = `kind u8 | token u64 | key_len u16 | key | value`
//! (kind 1 = write, 2 = mark raised by a read, 3 = mark raised by a shared read). A bad record at the
//! very end of the file is a torn write and is cut; a bad record followed by valid ones refuses to open.

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
    keys: BTreeMap<String, Entry>,
}

fn check(key: &str, value: &[u8]) -> Result<(), FenceError> {
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
    /// Opens (or creates) the store file and replays it.
    pub fn open(path: &Path) -> Result<FencedStore, FenceError> {
        let mut file = OpenOptions::new()
            .create(true)
            .read(true)
            .append(true)
            .open(path)?;
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
                    tracing::warn!(path = %path.display(), offset = at, "cutting a torn record at the end of the fenced store");
                    file.set_len(at as u64)?;
                    file.sync_all()?;
                    break;
                }
            }
        }
        Ok(FencedStore {
            inner: Mutex::new(Inner { file, keys }),
        })
    }

    /// Stores `value` under `key` if `token` is at least the key's mark; the mark becomes `token`.
    pub fn write(&self, key: &str, token: u64, value: &[u8]) -> Result<u64, FenceError> {
        check(key, value)?;
        let mut inner = self.inner.lock().expect("fenced store lock");
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
        check(key, &[])?;
        let mut inner = self.inner.lock().expect("fenced store lock");
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
        check(key, &[])?;
        let mut inner = self.inner.lock().expect("fenced store lock");
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
        self.file.write_all(&record)?;
        self.file.sync_data()?;
        Ok(())
    }
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
