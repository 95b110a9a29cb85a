//! Backups: one file with a consistent copy of every group's lock table (`holdfast snapshot save`), and
//! seeding the data directory of a new cluster from it (`holdfast snapshot restore`).
//!
//! File format 1:
//!
//! ```text
//! magic "HFBACKUP" | format u32 (1) | header_len u32 | BackupHeader (protobuf, raft.proto)
//! | table bytes of each group, in header order | crc32 of everything before it
//! ```
//!
//! (integers little-endian). Each group's table bytes are the lock table's own snapshot encoding
//! (versioned, with its own CRC), taken by the group's leader at a committed index (see
//! `Holdfast.SnapshotGroup`), and the header records that index and the table's digest.
//!
//! A restore writes, for one server of the new cluster, an `IDENTITY` with a **new** cluster id and one
//! snapshot file per group, whose membership is the new members. The snapshot sits at the backup's index
//! plus [`DEFAULT_INDEX_GAP`] (or at `--index-floor`), under term 0 since the new cluster's terms start
//! afresh. Fencing tokens and session ids are log indexes, and the old cluster may have gone on after the
//! backup: starting far above it keeps every token the restored cluster issues above every token the old
//! one did, so a resource's "refuse lower tokens" check stays right. On start openraft finds a snapshot
//! and no log, and begins the log after it. Every session is given a new secret ([`restored_table`]):
//! the lost cluster's clients cannot renew them, so each expires, with its locks, one TTL after the new
//! leader starts timing it (until then its locks are granted to nobody else).
//!
//! `IDENTITY` is written last: a restore interrupted before it leaves snapshots and no `IDENTITY`,
//! which a server refuses to start on (`identity`), and which a second restore refuses (not empty).

use crate::formats;
use crate::identity::{self, Identity};
use crate::raft_types::{LogId, MemberNode, Membership, SnapshotMeta, StoredMembership};
use crate::snapshot_store::SnapshotStore;
use holdfast_lock_table::LockTable;
use holdfast_proto::v1 as pb;
use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

const MAGIC: &[u8; 8] = b"HFBACKUP";
pub const FORMAT: u32 = 1;

/// One group's part of a backup.
#[derive(Debug)]
pub struct GroupBackup {
    pub group: u32,
    pub last_log_id: LogId,
    pub digest: u64,
    pub table: Vec<u8>,
}

#[derive(Debug)]
pub struct Backup {
    pub cluster_id: u64,
    pub created_at_ms: u64,
    pub written_by: String,
    pub groups: Vec<GroupBackup>,
}

impl Backup {
    pub fn encode(&self) -> Vec<u8> {
        let header = pb::BackupHeader {
            cluster_id: self.cluster_id,
            group_count: self.groups.len() as u32,
            groups: self
                .groups
                .iter()
                .map(|g| pb::BackupGroup {
                    group: g.group,
                    last_log_id: Some(formats::log_id_to_pb(&g.last_log_id)),
                    digest: g.digest,
                    table_bytes: g.table.len() as u64,
                })
                .collect(),
            created_at_ms: self.created_at_ms,
            written_by: self.written_by.clone(),
        };
        let header = formats::to_bytes(&header);
        let mut out = Vec::new();
        out.extend_from_slice(MAGIC);
        out.extend_from_slice(&FORMAT.to_le_bytes());
        out.extend_from_slice(&(header.len() as u32).to_le_bytes());
        out.extend_from_slice(&header);
        for g in &self.groups {
            out.extend_from_slice(&g.table);
        }
        let crc = crc32fast::hash(&out);
        out.extend_from_slice(&crc.to_le_bytes());
        out
    }

    /// Decodes and checks a backup: checksum, format, every group present once, and every table decodes
    /// to the digest the header recorded.
    pub fn decode(bytes: &[u8]) -> Result<Backup, String> {
        if bytes.len() < 20 || &bytes[..8] != MAGIC {
            return Err("not a holdfast backup (bad magic)".into());
        }
        let (body, crc) = bytes.split_at(bytes.len() - 4);
        if crc32fast::hash(body) != u32::from_le_bytes(crc.try_into().expect("4 bytes")) {
            return Err("backup checksum mismatch: the file is damaged or truncated".into());
        }
        let format = u32::from_le_bytes(body[8..12].try_into().expect("4 bytes"));
        if format != FORMAT {
            return Err(format!(
                "backup format {format} is not one this holdfast reads (format {FORMAT})"
            ));
        }
        let header_len = u32::from_le_bytes(body[12..16].try_into().expect("4 bytes")) as usize;
        let header_end = 16usize
            .checked_add(header_len)
            .filter(|&e| e <= body.len())
            .ok_or("backup header runs past the end")?;
        let header: pb::BackupHeader = formats::from_bytes(&body[16..header_end], "backup header")?;
        if header.groups.is_empty() {
            return Err("backup holds no groups".into());
        }
        if header.groups.len() != header.group_count as usize
            || header
                .groups
                .iter()
                .enumerate()
                .any(|(i, g)| g.group as usize != i)
        {
            return Err("backup header does not list groups 0..count in order".into());
        }
        let mut at = header_end;
        let mut groups = Vec::new();
        for g in &header.groups {
            let end = usize::try_from(g.table_bytes)
                .ok()
                .and_then(|n| at.checked_add(n))
                .filter(|&e| e <= body.len())
                .ok_or_else(|| format!("group {}: table runs past the end", g.group))?;
            let table = body[at..end].to_vec();
            at = end;
            let decoded = LockTable::decode_snapshot(&table)
                .map_err(|e| format!("group {}: table does not decode: {e}", g.group))?;
            // The digest of the bytes as written: a backup of an older format decodes into a table that
            // re-encodes in the current one, with another digest.
            let _ = decoded;
            let digest = holdfast_lock_table::name::fnv1a64(&table);
            if digest != g.digest {
                return Err(format!(
                    "group {}: table digest {digest:016x} differs from the recorded {:016x}",
                    g.group, g.digest
                ));
            }
            groups.push(GroupBackup {
                group: g.group,
                last_log_id: formats::log_id_from_pb(formats::required(
                    &g.last_log_id,
                    "group log id",
                )?),
                digest: g.digest,
                table,
            });
        }
        if at != body.len() {
            return Err("backup has bytes after its last table".into());
        }
        Ok(Backup {
            cluster_id: header.cluster_id,
            created_at_ms: header.created_at_ms,
            written_by: header.written_by,
            groups,
        })
    }
}

/// How far above the backup's index a restored log starts by default: 2^40 entries. Fencing tokens (and
/// session ids) are log indexes, and the old cluster may have gone on after the backup was taken; its
/// tokens must stay below every token the restored cluster issues. An old cluster at 10,000 entries a
/// second needs three and a half years past the backup to reach this.
pub const DEFAULT_INDEX_GAP: u64 = 1 << 40;

/// The cluster id a restored cluster gets: derived like a new cluster's, mixed with the backed-up
/// cluster's id and every group's position and digest, so it never equals the old cluster's (even on
/// the same addresses), and servers seeded from two different backups refuse each other.
pub fn restored_cluster_id(
    backup: &Backup,
    members: &[crate::config::Member],
    start: u64,
    token: &str,
) -> u64 {
    let mut mix = format!(
        "restored-from-{:016x}/start-{start}/{token}",
        backup.cluster_id
    );
    for g in &backup.groups {
        mix.push_str(&format!(
            "/{}:{}:{:016x}",
            g.group, g.last_log_id.index, g.digest
        ));
    }
    identity::derive_cluster_id(
        members.iter().map(|m| (m.id, m.client.as_str())),
        backup.groups.len() as u32,
        &mix,
    )
}

/// Where a restored group's log starts: `floor` if given (at least the backup's index), else the
/// backup's index plus [`DEFAULT_INDEX_GAP`].
pub fn restored_index(g: &GroupBackup, floor: Option<u64>) -> Result<u64, String> {
    match floor {
        Some(f) if f < g.last_log_id.index => Err(format!(
            "--index-floor {f} is below group {}'s backed-up index {}: tokens would repeat",
            g.group, g.last_log_id.index
        )),
        Some(f) => Ok(f),
        None => g
            .last_log_id
            .index
            .checked_add(DEFAULT_INDEX_GAP)
            .ok_or_else(|| format!("group {}: index overflows", g.group)),
    }
}

/// The table a restore seeds group `g` of the new cluster `cluster_id` with (encoded): the backup's,
/// with every session given a new secret derived from the new cluster id, the session and its old
/// secret (the same on every server restored with the same arguments). The lost cluster's clients
/// cannot renew those sessions any more (their keepalives are refused): a client of the old cluster
/// whose server addresses now reach the restored one must not go on as the holder of locks that may
/// have changed hands after the backup was taken, nor keep alive a session whose locks it released
/// since. So every restored session expires one TTL after the restored cluster starts, releasing its
/// locks, and until then nobody else is granted them.
pub fn restored_table(g: &GroupBackup, cluster_id: u64) -> Result<Vec<u8>, String> {
    let mut table = LockTable::decode_snapshot(&g.table).map_err(|e| {
        format!(
            "group {}: the backed-up table does not decode: {e}",
            g.group
        )
    })?;
    table.rekey_sessions(|session, old| {
        let mut input = Vec::with_capacity(48);
        input.extend_from_slice(b"holdfast restore secret");
        input.extend_from_slice(&cluster_id.to_le_bytes());
        input.extend_from_slice(&g.group.to_le_bytes());
        input.extend_from_slice(&session.0.to_le_bytes());
        input.extend_from_slice(&old.to_le_bytes());
        let d = ring::digest::digest(&ring::digest::SHA256, &input);
        let secret = u128::from_le_bytes(d.as_ref()[..16].try_into().expect("16 bytes"));
        secret.max(1)
    });
    Ok(table.encode_snapshot())
}

/// The digest of [`restored_table`]: what the restored cluster's group reports
/// (`holdfast status --digest`) before it applies anything.
pub fn restored_digest(g: &GroupBackup, cluster_id: u64) -> Result<u64, String> {
    let table = restored_table(g, cluster_id)?;
    LockTable::decode_snapshot(&table)
        .map(|t| t.digest())
        .map_err(|e| format!("group {}: {e}", g.group))
}

/// Writes the data directory of server `node_id` of a new cluster seeded from `backup`. Refuses a data
/// directory that is not empty. Returns the new cluster id.
pub fn restore(
    backup: &Backup,
    data_dir: &Path,
    node_id: u64,
    members: &[crate::config::Member],
    index_floor: Option<u64>,
    token: &str,
) -> Result<u64, String> {
    if !members.iter().any(|m| m.id == node_id) {
        return Err(format!("node id {node_id} is not among the members"));
    }
    if members.len() < 3 {
        tracing::warn!(
            "restoring into a cluster of {} members, which survives no failure",
            members.len()
        );
    }
    if let Ok(mut entries) = std::fs::read_dir(data_dir) {
        if entries.next().is_some() {
            return Err(format!(
                "{} is not empty: restore only into a new, empty data directory",
                data_dir.display()
            ));
        }
    }
    std::fs::create_dir_all(data_dir).map_err(|e| format!("{}: {e}", data_dir.display()))?;
    let starts = backup
        .groups
        .iter()
        .map(|g| restored_index(g, index_floor))
        .collect::<Result<Vec<u64>, String>>()?;
    let cluster_id = restored_cluster_id(backup, members, index_floor.unwrap_or(0), token);
    let voters: BTreeSet<u64> = members.iter().map(|m| m.id).collect();
    let nodes: BTreeMap<u64, MemberNode> = members
        .iter()
        .map(|m| {
            let node = MemberNode {
                peer: m.peer.clone(),
                client: m.client.clone(),
            };
            (m.id, node)
        })
        .collect();
    let membership = Membership::new(vec![voters], nodes).map_err(|e| e.to_string())?;
    for (g, start) in backup.groups.iter().zip(starts) {
        let table = restored_table(g, cluster_id)?;
        // The new cluster's terms start afresh (its servers have voted in none), so the restored position
        // carries term 0 and leader 0: below every leader the new cluster elects, as openraft requires of
        // a log its new leader inherits. The index, which fencing tokens are, continues.
        let position = formats::log_id_from_pb(&pb::LogId {
            term: 0,
            leader: 0,
            index: start,
        });
        let meta = SnapshotMeta {
            last_log_id: Some(position),
            last_membership: StoredMembership::new(Some(position), membership.clone()),
        };
        let store = SnapshotStore::open(data_dir.join("snapshots").join(format!("g{}", g.group)))
            .map_err(|e| e.to_string())?;
        store
            .save(start, &SnapshotStore::encode(&meta, &table))
            .map_err(|e| format!("group {}: cannot write the snapshot: {e}", g.group))?;
    }
    identity::create(
        data_dir,
        &Identity {
            cluster_id,
            node_id,
            groups: backup.groups.len() as u32,
            join: false,
        },
    )
    .map_err(|e| e.to_string())?;
    Ok(cluster_id)
}

#[cfg(test)]
mod tests {
    use super::*;
    use holdfast_lock_table::Command;

    /// A backup written before the current table format (the fuzz corpus seed holds a version 3 table)
    /// still reads: its digest is checked over the bytes as written, not a re-encoding.
    #[test]
    fn a_backup_of_an_older_table_format_still_reads() {
        let bytes = include_bytes!("../../fuzz/corpus/backup_file/one-group");
        let b = Backup::decode(bytes).unwrap();
        assert_eq!(b.encode(), bytes.to_vec());
    }

    fn backup() -> Backup {
        let mut table = LockTable::new();
        table.apply(
            5,
            &Command::OpenSession {
                nonce: 1,
                ttl_ms: 10_000,
                now_ms: 1,
            },
        );
        let bytes = table.encode_snapshot();
        let lid = formats::log_id_from_pb(&pb::LogId {
            term: 2,
            leader: 1,
            index: 5,
        });
        Backup {
            cluster_id: 9,
            created_at_ms: 1,
            written_by: "test".into(),
            groups: vec![
                GroupBackup {
                    group: 0,
                    last_log_id: lid,
                    digest: table.digest(),
                    table: bytes,
                },
                GroupBackup {
                    group: 1,
                    last_log_id: lid,
                    digest: LockTable::new().digest(),
                    table: LockTable::new().encode_snapshot(),
                },
            ],
        }
    }

    #[test]
    fn round_trips_and_refuses_damage() {
        let bytes = backup().encode();
        let back = Backup::decode(&bytes).unwrap();
        assert_eq!(back.groups.len(), 2);
        assert_eq!(back.groups[0].digest, backup().groups[0].digest);
        assert_eq!(back.cluster_id, 9);
        for at in [9, 20, bytes.len() / 2, bytes.len() - 1] {
            let mut bad = bytes.clone();
            bad[at] ^= 1;
            assert!(Backup::decode(&bad).is_err(), "flip at {at} accepted");
        }
        assert!(Backup::decode(&bytes[..bytes.len() - 3]).is_err());
        // A recorded digest that does not match its table is refused even with a good checksum.
        let mut wrong = backup();
        wrong.groups[0].digest ^= 1;
        assert!(Backup::decode(&wrong.encode())
            .unwrap_err()
            .contains("digest"));
    }

    #[test]
    fn restore_writes_a_new_cluster_and_refuses_a_used_dir() {
        let dir = tempfile::tempdir().unwrap();
        let members =
            crate::config::ServerConfig::parse_members("1=h:1/p:1,2=h:2/p:2,3=h:3/p:3").unwrap();
        let b = backup();
        let id = restore(&b, &dir.path().join("n1"), 1, &members, None, "").unwrap();
        assert_ne!(id, b.cluster_id);
        assert_ne!(
            id,
            identity::derive_cluster_id(members.iter().map(|m| (m.id, m.client.as_str())), 2, ""),
            "a restored cluster must not get the id a fresh cluster on these addresses would"
        );
        let snap = SnapshotStore::open(dir.path().join("n1/snapshots/g0"))
            .unwrap()
            .latest()
            .unwrap()
            .unwrap();
        let loaded = SnapshotStore::decode(&snap.1).unwrap();
        assert_eq!(
            loaded.meta.last_log_id.unwrap().index,
            5 + DEFAULT_INDEX_GAP
        );
        // The backup's table, its session re-keyed for the new cluster: the same on every server
        // restored with the same arguments, and the old secret (0 here) no longer the session's.
        let session = holdfast_lock_table::SessionId(5);
        assert_eq!(b.groups[0].digest, {
            let t = LockTable::decode_snapshot(&b.groups[0].table).unwrap();
            assert_eq!(t.session_secret(session), Some(0));
            t.digest()
        });
        assert_ne!(loaded.table.digest(), b.groups[0].digest);
        assert_ne!(loaded.table.session_secret(session), Some(0));
        assert!(loaded.table.session_secret(session).is_some());
        restore(&b, &dir.path().join("n1-again"), 2, &members, None, "").unwrap();
        let again = SnapshotStore::open(dir.path().join("n1-again/snapshots/g0"))
            .unwrap()
            .latest()
            .unwrap()
            .unwrap();
        assert_eq!(
            again.1, snap.1,
            "two servers of one restore got different tables"
        );
        assert!(restore(&b, &dir.path().join("n1"), 1, &members, None, "")
            .unwrap_err()
            .contains("not empty"));
        assert!(restore(&b, &dir.path().join("n9"), 9, &members, None, "").is_err());
        // An explicit floor, never below the backup.
        let id2 = restore(&b, &dir.path().join("n2"), 2, &members, Some(1_000), "").unwrap();
        assert_ne!(id2, id, "another start is another cluster");
        assert!(
            restore(&b, &dir.path().join("n3"), 3, &members, Some(4), "")
                .unwrap_err()
                .contains("below")
        );
        // Servers seeded from a different backup get a different cluster id.
        let mut other = backup();
        other.groups[1].last_log_id = formats::log_id_from_pb(&pb::LogId {
            term: 2,
            leader: 1,
            index: 6,
        });
        assert_ne!(restored_cluster_id(&other, &members, 0, ""), id);
    }
}
