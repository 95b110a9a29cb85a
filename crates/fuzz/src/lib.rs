//! Fuzz targets: each takes arbitrary bytes and must never panic, hang or allocate without bound; where
//! an input decodes, what it decodes to must be consistent (round trips, invariants).
//!
//! On stable, `tests/replay.rs` runs every target over its committed corpus (`corpus/<target>/`), over
//! mutations of it, and over random bytes. With a nightly toolchain and cargo-fuzz the same functions
//! are coverage-guided targets (`fuzz/`, see docs/testing.md); CI has no nightly toolchain.

use holdfast_lock_table::LockTable;
use holdfast_proto::v1 as pb;
use prost::Message;

/// Every target, by the name of its corpus directory.
/// A fuzz target: arbitrary bytes in, a panic on a bug.
pub type Target = fn(&[u8]);

pub const TARGETS: &[(&str, Target)] = &[
    ("wal_segment", wal_segment),
    ("lock_table_snapshot", lock_table_snapshot),
    ("lock_table_body", lock_table_body),
    ("wal_frame_body", wal_frame_body),
    ("server_snapshot", server_snapshot),
    ("client_request", client_request),
    ("peer_message", peer_message),
    ("fenced_store_log", fenced_store_log),
    ("backup_file", backup_file),
    ("certificate", certificate),
    ("policy_file", policy_file),
];

/// An access policy file as a server reads it: whatever parses answers every check without panicking,
/// the same way twice, and grants nothing to a principal it does not name.
pub fn policy_file(bytes: &[u8]) {
    use holdfast_server::access::{Need, Policy};
    let Ok(text) = std::str::from_utf8(bytes) else {
        return;
    };
    let Ok(policy) = Policy::parse(text) else {
        return;
    };
    // A name longer than a lock name, with a multibyte character where a refusal message cuts it.
    let long = format!("{}é{}", "n".repeat(255), "x".repeat(300));
    let names = [
        "",
        "a",
        "a/b",
        "billing/x",
        "anonymous",
        "\u{0}",
        "ci",
        long.as_str(),
    ];
    for principal in names.iter().chain(["nobody-listed-this-\u{1}"].iter()) {
        fn allowed(policy: &Policy, principal: &str, need: Need<'_>) -> bool {
            policy.check(principal, need).is_ok()
        }
        let may = |need: Need<'_>| allowed(&policy, principal, need);
        for name in names {
            for need in [
                Need::Lock(name),
                Need::Cancel(name),
                Need::Release(name),
                Need::LockAny,
                Need::Read(name),
                Need::Admin,
                Need::Any,
            ] {
                let first = may(need);
                assert_eq!(first, may(need));
                if policy.grants(principal).is_none() {
                    assert!(
                        !first,
                        "{principal:?} is not in the policy but may {need:?}"
                    );
                }
            }
            if may(Need::Lock(name)) {
                assert!(may(Need::LockAny) && may(Need::Cancel(name)));
            }
            // Giving up needs lock somewhere, not on the name (a revoked name can still be let go).
            assert_eq!(may(Need::Cancel(name)), may(Need::LockAny));
            assert_eq!(may(Need::Release(name)), may(Need::LockAny));
            if may(Need::LockAny) || may(Need::Admin) || may(Need::Read(name)) {
                assert!(may(Need::Any));
            }
            if may(Need::Read(name)) {
                let longer = format!("{name}/more");
                assert!(
                    may(Need::Read(&longer)),
                    "read on {name:?} covers longer names"
                );
            }
        }
    }
}

/// Certificate loading: PEM as a server or client reads its files, whole configurations built from the
/// same bytes, and the names read out of a certificate's DER (which reads only the first element, so
/// trailing bytes do not change what a certificate that parses says).
pub fn certificate(bytes: &[u8]) {
    use holdfast_proto::tls;
    let names = tls::cert_names(bytes);
    if names.is_some() {
        assert_eq!(tls::cert_names(&[bytes, b"\x30\x00junk"].concat()), names);
    }
    if let Ok(certs) = tls::certs_from_pem(bytes) {
        assert!(!certs.is_empty());
        for c in &certs {
            let _ = tls::cert_names(c);
        }
    }
    let _ = tls::key_from_pem(bytes);
    let _ = tls::verify_chain(bytes, bytes);
    let _ = tls::server_config(bytes, bytes, bytes, tls::ClientCerts::Required, true);
    let _ = tls::client_config(bytes, Some((bytes, bytes)));
}

/// A backup file as `holdfast snapshot restore` reads it: whatever decodes re-encodes to the same bytes.
pub fn backup_file(bytes: &[u8]) {
    if let Ok(b) = holdfast_server::backup::Backup::decode(bytes) {
        assert_eq!(b.encode(), bytes);
    }
}

/// The WAL recovery decoder: a segment's bytes, as the last segment and as an older one.
pub fn wal_segment(bytes: &[u8]) {
    let last = holdfast_wal::scan_segment(bytes, 1, true);
    let older = holdfast_wal::scan_segment(bytes, 1, false);
    match (&last, &older) {
        // An older segment is never torn: what the last one calls torn, an older one calls corrupt.
        (Ok(l), Ok(o)) => {
            assert!(l.torn_at.is_none() && o.torn_at.is_none());
            assert!(l.zeros_at.is_none() && o.zeros_at.is_none());
            assert_eq!(l.records, o.records);
        }
        // A pre-created segment holds nothing and may only be the last one.
        (Ok(l), Err((offset, _))) if l.standby => {
            assert_eq!(*offset, 12, "refused at its state word");
            assert!(l.records.is_empty());
            assert_eq!(l.torn_at, (bytes.len() > 16).then_some(16));
        }
        // Zeros after the last frame are the last segment's clean end, and damage in an older one.
        (Ok(l), Err((offset, _))) if l.zeros_at.is_some() => {
            assert_eq!(l.zeros_at, Some(*offset));
            assert!(l.torn_at.is_none());
            assert!(bytes[*offset..].iter().all(|&b| b == 0));
        }
        (Ok(l), Err((offset, _))) => assert_eq!(l.torn_at, Some(*offset)),
        (Err(a), Err(b)) => assert_eq!(a.0, b.0),
        (Err(_), Ok(_)) => {
            panic!("a segment that is corrupt as the last one cannot be fine as an older one")
        }
    }
}

/// The lock table's snapshot decoder: a decoded table re-encodes to the same bytes.
pub fn lock_table_snapshot(bytes: &[u8]) {
    if let Ok(table) = LockTable::decode_snapshot(bytes) {
        table.check_invariants();
        let again = table.encode_snapshot();
        assert_eq!(
            LockTable::decode_snapshot(&again).map(|t| t.digest()).ok(),
            Some(table.digest())
        );
    }
}

/// The lock table decoder past its checksum: `bytes` is a snapshot body, wrapped with a valid header and
/// CRC, once for every format version this build reads, so that each version's decoding and the
/// invariant validation are reached.
pub fn lock_table_body(bytes: &[u8]) {
    for version in 2u16..=8 {
        let mut framed = b"HFLT".to_vec();
        framed.extend_from_slice(&version.to_le_bytes());
        framed.extend_from_slice(bytes);
        let crc = crc32(&framed);
        framed.extend_from_slice(&crc.to_le_bytes());
        lock_table_snapshot(&framed);
    }
}

/// The WAL record decoder past its checksum: `bytes` is a frame body, wrapped in a segment header and a
/// frame with a valid CRC, once for every segment format version this build reads (segment number 1).
pub fn wal_frame_body(bytes: &[u8]) {
    use holdfast_wal::format::{frame_crc, Place, SEGMENT_VERSION, SEGMENT_VERSION_UNPLACED};
    for version in SEGMENT_VERSION_UNPLACED..=SEGMENT_VERSION {
        let mut segment = b"HFWALSEG".to_vec();
        segment.extend_from_slice(&version.to_le_bytes());
        segment.extend_from_slice(&[0; 4]);
        let place = Place {
            seq: 1,
            version,
            offset: segment.len() as u64,
        };
        segment.extend_from_slice(b"HFWF");
        segment.extend_from_slice(&(bytes.len() as u32).to_le_bytes());
        segment.extend_from_slice(&frame_crc(place, bytes).to_le_bytes());
        segment.extend_from_slice(bytes);
        wal_segment(&segment);
    }
}

fn crc32(bytes: &[u8]) -> u32 {
    // The IEEE CRC-32 that the snapshot format uses, computed bit by bit so this crate needs no extra dependency.
    let mut crc = !0u32;
    for &b in bytes {
        crc ^= u32::from(b);
        for _ in 0..8 {
            crc = if crc & 1 == 1 {
                (crc >> 1) ^ 0xedb8_8320
            } else {
                crc >> 1
            };
        }
    }
    !crc
}

/// The server's snapshot file decoder (metadata + table + checksum).
pub fn server_snapshot(bytes: &[u8]) {
    if let Ok(loaded) = holdfast_server::snapshot_store::SnapshotStore::decode(bytes) {
        loaded.table.check_invariants();
        let table = loaded.table.encode_snapshot();
        let again = holdfast_server::snapshot_store::SnapshotStore::encode(&loaded.meta, &table);
        assert!(holdfast_server::snapshot_store::SnapshotStore::decode(&again).is_ok());
    }
}

/// Client requests as the server decodes them, then the name rules the server applies. The first byte
/// picks the message type.
pub fn client_request(bytes: &[u8]) {
    let Some((&kind, body)) = bytes.split_first() else {
        return;
    };
    let name = match kind % 5 {
        0 => pb::AcquireRequest::decode(body).map(|r| r.name).ok(),
        1 => pb::ReleaseRequest::decode(body).map(|r| r.name).ok(),
        2 => pb::DescribeRequest::decode(body).map(|r| r.name).ok(),
        3 => pb::KeepAliveRequest::decode(body)
            .map(|_| String::new())
            .ok(),
        // A message of a `Calls` stream.
        _ => pb::CallRequest::decode(body)
            .map(|r| match r.call {
                Some(pb::call_request::Call::Acquire(a)) => a.name,
                Some(pb::call_request::Call::Release(r)) => r.name,
                Some(
                    pb::call_request::Call::Cancel(_)
                    | pb::call_request::Call::Ping(_)
                    | pb::call_request::Call::KeepAlive(_),
                )
                | None => String::new(),
            })
            .ok(),
    };
    if let Some(name) = name {
        if holdfast_lock_table::validate_name(&name).is_ok() {
            assert!(holdfast_lock_table::group_for(&name, 7).0 < 7);
            assert!(name.len() <= holdfast_lock_table::limits::MAX_NAME_BYTES);
        }
    }
}

/// Raft messages from a peer as the peer service decodes them (protobuf, then `formats`), and WAL entry
/// payloads of both formats. The first byte picks the decoder. Whatever converts must convert back to
/// the same value.
pub fn peer_message(bytes: &[u8]) {
    use holdfast_server::formats;
    let Some((&kind, body)) = bytes.split_first() else {
        return;
    };
    let entry_round_trip = |e: &holdfast_server::raft_types::Entry| {
        let again =
            formats::entry_from_pb(&formats::entry_to_pb(e)).expect("re-encoded entry decodes");
        assert_eq!(&again, e);
    };
    match kind % 4 {
        0 => {
            if let Ok(m) = pb::AppendEntriesRequest::decode(body) {
                for e in &m.entries {
                    if let Ok(entry) = formats::entry_from_pb(e) {
                        entry_round_trip(&entry);
                    }
                }
            }
        }
        1 => {
            if let Ok(m) = pb::VoteRequest::decode(body) {
                if let Some(v) = &m.vote {
                    assert_eq!(formats::vote_to_pb(&formats::vote_from_pb(v)), *v);
                }
            }
        }
        2 => {
            if let Ok(m) = pb::SnapshotChunk::decode(body) {
                if let Some(Ok(meta)) = m.meta.as_ref().map(formats::snapshot_meta_from_pb) {
                    let again =
                        formats::snapshot_meta_from_pb(&formats::snapshot_meta_to_pb(&meta));
                    assert_eq!(again.expect("re-encoded meta decodes"), meta);
                }
            }
        }
        _ => {
            if let Ok(entry) = formats::legacy::entry(body) {
                entry_round_trip(&entry);
            }
        }
    }
}

/// The reference fenced store's file, opened from arbitrary bytes.
pub fn fenced_store_log(bytes: &[u8]) {
    let dir = std::env::temp_dir().join(format!(
        "holdfast-fuzz-{}-{:?}",
        std::process::id(),
        std::thread::current().id()
    ));
    let _ = std::fs::create_dir_all(&dir);
    let path = dir.join("fence.log");
    if std::fs::write(&path, bytes).is_ok() {
        if let Ok(store) = holdfast_fence::store::FencedStore::open(&path) {
            // Whatever opened must accept a write above every mark and refuse one below.
            let _ = store.write("k", u64::MAX, b"v");
            assert!(store.write("k", 1, b"late").is_err());
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
}
