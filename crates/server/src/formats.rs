//! Holdfast's own encodings of Raft data: what goes into WAL records, snapshot file headers and peer
//! messages. openraft's structs never reach a disk or a socket directly; they are converted to the
//! protobuf messages of `proto/holdfast/v1/raft.proto` here and back, so an openraft upgrade that changes its
//! types (or their serde layout) cannot make old data unreadable, and a change of ours is a new format
//! version, not an accident.
//!
//! | what | format 0 (Holdfast 0.1, read only) | format 1 (written) |
//! |---|---|---|
//! | WAL entry/vote/purged/committed records | kinds 1, 3, 4, 5: postcard of openraft's structs | kinds 11, 13, 14, 15: protobuf `Entry`, `Vote`, `LogId` |
//! | WAL truncate record | kind 2 | kind 12 (no payload in either) |
//! | snapshot file | magic `HFSNAP01`, postcard `SnapshotMeta` | magic `HFSNAP02`, protobuf `SnapshotMeta` |
//! | peer messages | service `RaftPeer`, postcard | service `Peer`, protobuf with a `PeerHeader` |
//!
//! Format 0 is decoded by the [`legacy`] mirror structs, which copy the layout openraft 0.10.0-alpha.37's
//! serde derive produced and do not depend on openraft at all. Golden-bytes tests (`tests` below) pin both.
//! The format-0 decoder cannot be dropped without a migration: a group's last format-0 sticky records
//! (vote, purged, committed; a few bytes) are carried at the head of every new WAL segment forever,
//! because the WAL keeps the latest sticky record per (group, kind) and format 1 uses new kinds. Replay meets them first in each
//! segment (lower kinds come first), so the newer format-1 record always wins.
//!
//! Invariant: `decode(encode(x)) == x` for every value (paired in the tests), and a decode failure is an
//! error naming what did not decode, never a panic or a default value.

use crate::raft_types::{
    Entry, LogId, MemberNode, Membership, Request, SnapshotMeta, StoredMembership, Vote,
};
use holdfast_lock_table::Command;
use holdfast_proto::v1 as pb;
use openraft::impls::leader_id_adv::LeaderId;
use openraft::EntryPayload;
use prost::Message;
use std::collections::{BTreeMap, BTreeSet};

/// The peer message format this server speaks (`PeerHeader.format`).
pub const PEER_FORMAT: u32 = 1;

/// `AppendEntriesReply.features`: this server's lock table applies `Command::ExpireSessions`.
pub const FEATURE_EXPIRE_SESSIONS: u64 = 1;

/// Every feature bit this release reports.
pub const FEATURES: u64 = FEATURE_EXPIRE_SESSIONS;

/// WAL record kinds (see the module table).
pub mod kind {
    pub const LEGACY_ENTRY: u8 = 1;
    pub const LEGACY_TRUNCATE: u8 = 2;
    pub const LEGACY_VOTE: u8 = 3;
    pub const LEGACY_PURGED: u8 = 4;
    pub const LEGACY_COMMITTED: u8 = 5;
    pub const ENTRY: u8 = 11;
    pub const TRUNCATE: u8 = 12;
    pub const VOTE: u8 = 13;
    pub const PURGED: u8 = 14;
    pub const COMMITTED: u8 = 15;
    // Every format-0 kind sorts before every format-1 kind, so a segment head (sticky records in kind
    // order) replays a group's older format-0 values before its newer format-1 ones.
    const _: () = assert!(LEGACY_COMMITTED < ENTRY);
}

pub fn log_id_to_pb(l: &LogId) -> pb::LogId {
    pb::LogId {
        term: l.leader_id.term,
        leader: l.leader_id.node_id,
        index: l.index,
    }
}

pub fn log_id_from_pb(l: &pb::LogId) -> LogId {
    LogId::new(
        LeaderId {
            term: l.term,
            node_id: l.leader,
        },
        l.index,
    )
}

pub fn opt_log_id_to_pb(l: &Option<LogId>) -> Option<pb::LogId> {
    l.as_ref().map(log_id_to_pb)
}

pub fn opt_log_id_from_pb(l: &Option<pb::LogId>) -> Option<LogId> {
    l.as_ref().map(log_id_from_pb)
}

pub fn vote_to_pb(v: &Vote) -> pb::Vote {
    pb::Vote {
        term: v.leader_id.term,
        node: v.leader_id.node_id,
        committed: v.committed,
    }
}

pub fn vote_from_pb(v: &pb::Vote) -> Vote {
    if v.committed {
        Vote::new_committed(v.term, v.node)
    } else {
        Vote::new(v.term, v.node)
    }
}

/// A required message field: absent is a malformed message.
pub fn required<'a, T>(field: &'a Option<T>, what: &str) -> Result<&'a T, String> {
    field.as_ref().ok_or_else(|| format!("{what} is missing"))
}

pub fn membership_to_pb(m: &Membership) -> pb::Membership {
    pb::Membership {
        configs: m
            .get_joint_config()
            .iter()
            .map(|set| pb::VoterSet {
                ids: set.iter().copied().collect(),
            })
            .collect(),
        nodes: m
            .nodes()
            .map(|(id, n)| pb::MemberNode {
                id: *id,
                addr: n.peer.clone(),
                client: n.client.clone(),
            })
            .collect(),
    }
}

pub fn membership_from_pb(m: &pb::Membership) -> Result<Membership, String> {
    let configs: Vec<BTreeSet<u64>> = m
        .configs
        .iter()
        .map(|s| s.ids.iter().copied().collect())
        .collect();
    let nodes: BTreeMap<u64, MemberNode> = m
        .nodes
        .iter()
        .map(|n| {
            let node = MemberNode {
                peer: n.addr.clone(),
                client: n.client.clone(),
            };
            (n.id, node)
        })
        .collect();
    Membership::new(configs, nodes).map_err(|e| format!("invalid membership: {e}"))
}

pub fn entry_to_pb(e: &Entry) -> pb::Entry {
    use pb::entry::Payload;
    pb::Entry {
        log_id: Some(log_id_to_pb(&e.log_id)),
        payload: Some(match &e.payload {
            EntryPayload::Blank => Payload::Blank(pb::Blank {}),
            // A `Bytes` of the encoding's own buffer (encoding the message then costs a header for
            // it: the log and the append connections encode entries with `encode_entry`).
            EntryPayload::Normal(Request(c)) => Payload::Command(encode_command(c).into()),
            EntryPayload::Membership(m) => Payload::Membership(membership_to_pb(m)),
        }),
    }
}

/// `e` encoded as a `pb::Entry`: the bytes of `to_bytes(&entry_to_pb(e))`, written straight into one
/// buffer for a command, without building the message (its command's `Bytes`, which prost clones to
/// encode, and the separate buffer of the command's encoding). Every server encodes every entry it
/// appends to its log this way.
pub fn encode_entry(e: &Entry) -> Vec<u8> {
    use prost::encoding::{encode_key, encode_varint, encoded_len_varint, message, WireType};
    // The fields of `pb::Entry`: its log id, and the payload's `command`.
    const LOG_ID: u32 = 1;
    const COMMAND: u32 = 3;
    let EntryPayload::Normal(Request(c)) = &e.payload else {
        return to_bytes(&entry_to_pb(e));
    };
    let log_id = log_id_to_pb(&e.log_id);
    let mut out = Vec::with_capacity(128);
    message::encode(LOG_ID, &log_id, &mut out);
    encode_key(COMMAND, WireType::LengthDelimited, &mut out);
    // The command's length goes before it but is known only after it: one byte is kept for it, and
    // a longer length (a command of 128 bytes or more) moves the command up.
    let at = out.len();
    out.push(0);
    let mut out = postcard::to_extend(&**c, out).expect("encoding to a Vec cannot fail");
    let n = (out.len() - at - 1) as u64;
    if encoded_len_varint(n) == 1 {
        out[at] = n as u8;
    } else {
        let mut len = Vec::with_capacity(10);
        encode_varint(n, &mut len);
        out.splice(at..at + 1, len);
    }
    out
}

/// Appends `bytes` to `out` as field `field` of a protobuf message: its key, its length, the bytes (an
/// entry's encoding, as a message's repeated `Entry` field carries it).
pub fn put_bytes_field(field: u32, bytes: &[u8], out: &mut Vec<u8>) {
    prost::encoding::encode_key(field, prost::encoding::WireType::LengthDelimited, out);
    prost::encoding::encode_varint(bytes.len() as u64, out);
    out.extend_from_slice(bytes);
}

/// The items of `items` in a `Vec` allocated once for `len` of them, or the first error: what
/// `collect::<Result<Vec<_>, _>>()` gives, without its growth. That collect cannot know how many items
/// will come (it may stop at an error), so its `Vec` starts at four and doubles, moving every entry at
/// each step: an append's ~40 entries took five allocations and four moves on every follower (the
/// reallocation was 4.5% of a follower's samples at 64 clients, docs/performance.md, "Entries
/// collected at their size"). `len` is a capacity, not a promise: fewer or more items are fine.
pub fn collect_sized<T, E>(
    len: usize,
    items: impl Iterator<Item = Result<T, E>>,
) -> Result<Vec<T>, E> {
    let mut out = Vec::with_capacity(len);
    for item in items {
        out.push(item?);
    }
    Ok(out)
}

pub fn entry_from_pb(e: &pb::Entry) -> Result<Entry, String> {
    use pb::entry::Payload;
    let log_id = log_id_from_pb(required(&e.log_id, "entry log id")?);
    let payload = match required(&e.payload, "entry payload")? {
        Payload::Blank(_) => EntryPayload::Blank,
        Payload::Command(bytes) => EntryPayload::Normal(Request::new(decode_command(bytes)?)),
        Payload::Membership(m) => EntryPayload::Membership(membership_from_pb(m)?),
    };
    Ok(Entry { log_id, payload })
}

fn encode_command(c: &Command) -> Vec<u8> {
    postcard::to_allocvec(c).expect("encoding to a Vec cannot fail")
}

fn decode_command(bytes: &[u8]) -> Result<Command, String> {
    postcard::from_bytes(bytes).map_err(|e| format!("command does not decode: {e}"))
}

pub fn snapshot_meta_to_pb(m: &SnapshotMeta) -> pb::SnapshotMeta {
    pb::SnapshotMeta {
        last_log_id: opt_log_id_to_pb(&m.last_log_id),
        membership_log_id: opt_log_id_to_pb(m.last_membership.log_id()),
        membership: Some(membership_to_pb(m.last_membership.membership())),
    }
}

pub fn snapshot_meta_from_pb(m: &pb::SnapshotMeta) -> Result<SnapshotMeta, String> {
    Ok(SnapshotMeta {
        last_log_id: opt_log_id_from_pb(&m.last_log_id),
        last_membership: StoredMembership::new(
            opt_log_id_from_pb(&m.membership_log_id),
            membership_from_pb(required(&m.membership, "snapshot membership")?)?,
        ),
    })
}

/// Encodes a protobuf message to a fresh buffer.
pub fn to_bytes<M: Message>(m: &M) -> Vec<u8> {
    m.encode_to_vec()
}

/// Decodes a protobuf message, naming `what` in the error.
pub fn from_bytes<M: Message + Default>(bytes: &[u8], what: &str) -> Result<M, String> {
    M::decode(bytes).map_err(|e| format!("{what} does not decode: {e}"))
}

/// Format 0: mirror structs of the serde layout of openraft 0.10.0-alpha.37's types, as Holdfast 0.1
/// wrote them with postcard. Read only; nothing writes format 0 any more.
pub mod legacy {
    use super::*;
    use serde::Deserialize;

    #[derive(Deserialize)]
    struct LeaderIdV0 {
        term: u64,
        node_id: u64,
    }

    #[derive(Deserialize)]
    struct LogIdV0 {
        leader_id: LeaderIdV0,
        index: u64,
    }

    #[derive(Deserialize)]
    struct VoteV0 {
        leader_id: LeaderIdV0,
        committed: bool,
    }

    #[derive(Deserialize)]
    struct NodeV0 {
        addr: String,
    }

    #[derive(Deserialize)]
    struct MembershipV0 {
        configs: Vec<BTreeSet<u64>>,
        nodes: BTreeMap<u64, NodeV0>,
    }

    #[derive(Deserialize)]
    enum PayloadV0 {
        Blank,
        Normal(Command),
        Membership(MembershipV0),
    }

    #[derive(Deserialize)]
    struct EntryV0 {
        log_id: LogIdV0,
        payload: PayloadV0,
    }

    #[derive(Deserialize)]
    struct StoredMembershipV0 {
        log_id: Option<LogIdV0>,
        membership: MembershipV0,
    }

    #[derive(Deserialize)]
    struct SnapshotMetaV0 {
        last_log_id: Option<LogIdV0>,
        last_membership: StoredMembershipV0,
        #[allow(dead_code)]
        snapshot_id: String,
    }

    fn postcard<'a, T: Deserialize<'a>>(bytes: &'a [u8], what: &str) -> Result<T, String> {
        postcard::from_bytes(bytes).map_err(|e| format!("{what} (format 0) does not decode: {e}"))
    }

    fn log_id(l: LogIdV0) -> LogId {
        LogId::new(
            LeaderId {
                term: l.leader_id.term,
                node_id: l.leader_id.node_id,
            },
            l.index,
        )
    }

    fn membership(m: MembershipV0) -> Result<Membership, String> {
        let nodes: BTreeMap<u64, MemberNode> = m
            .nodes
            .into_iter()
            .map(|(id, n)| {
                let node = MemberNode {
                    peer: n.addr,
                    client: String::new(),
                };
                (id, node)
            })
            .collect();
        Membership::new(m.configs, nodes).map_err(|e| format!("invalid membership: {e}"))
    }

    pub fn entry(bytes: &[u8]) -> Result<Entry, String> {
        let e: EntryV0 = postcard(bytes, "wal entry")?;
        let payload = match e.payload {
            PayloadV0::Blank => EntryPayload::Blank,
            PayloadV0::Normal(c) => EntryPayload::Normal(Request::new(c)),
            PayloadV0::Membership(m) => EntryPayload::Membership(membership(m)?),
        };
        Ok(Entry {
            log_id: log_id(e.log_id),
            payload,
        })
    }

    pub fn vote(bytes: &[u8]) -> Result<Vote, String> {
        let v: VoteV0 = postcard(bytes, "wal vote")?;
        Ok(vote_from_pb(&pb::Vote {
            term: v.leader_id.term,
            node: v.leader_id.node_id,
            committed: v.committed,
        }))
    }

    pub fn log_id_record(bytes: &[u8]) -> Result<LogId, String> {
        Ok(log_id(postcard(bytes, "wal log id")?))
    }

    pub fn snapshot_meta(bytes: &[u8]) -> Result<SnapshotMeta, String> {
        let m: SnapshotMetaV0 = postcard(bytes, "snapshot meta")?;
        Ok(SnapshotMeta {
            last_log_id: m.last_log_id.map(log_id),
            last_membership: StoredMembership::new(
                m.last_membership.log_id.map(log_id),
                membership(m.last_membership.membership)?,
            ),
        })
    }
}

#[cfg(test)]
mod tests {
    //! Golden bytes: a change to any of these encodings fails here first. If the change is intended, it is
    //! a new format version (new record kinds, a new magic, a new `PEER_FORMAT`), and the old bytes stay
    //! decodable: never edit an expected byte string of a released format.

    use super::*;
    use holdfast_lock_table::{Command, FencingToken, LockName, RequestId, SessionId};

    fn hex(b: &[u8]) -> String {
        b.iter().map(|x| format!("{x:02x}")).collect()
    }

    fn unhex(s: &str) -> Vec<u8> {
        (0..s.len())
            .step_by(2)
            .map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap())
            .collect()
    }

    fn lid(term: u64, node: u64, index: u64) -> LogId {
        LogId::new(
            LeaderId {
                term,
                node_id: node,
            },
            index,
        )
    }

    /// Three voters with peer addresses only, as format 0 could record them.
    fn membership() -> Membership {
        let nodes: BTreeMap<u64, MemberNode> = [(1, "a:1"), (2, "b:2"), (3, "c:3")]
            .into_iter()
            .map(|(id, a)| {
                let node = MemberNode {
                    peer: a.into(),
                    client: String::new(),
                };
                (id, node)
            })
            .collect();
        Membership::new(vec![BTreeSet::from([1, 2, 3])], nodes).unwrap()
    }

    fn command_entry() -> Entry {
        Entry {
            log_id: lid(7, 2, 300),
            payload: EntryPayload::Normal(Request::new(Command::Release {
                session: SessionId(5),
                request: RequestId(9),
                name: LockName::new("jobs/a").unwrap(),
                token: FencingToken(42),
                now_ms: 1_000,
            })),
        }
    }

    #[test]
    fn items_collected_at_their_size_are_the_items_or_the_first_error() {
        let ok: Result<Vec<u32>, String> = collect_sized(3, [1, 2, 3].into_iter().map(Ok));
        let ok = ok.unwrap();
        assert_eq!(ok, vec![1, 2, 3]);
        assert_eq!(ok.capacity(), 3, "allocated once, at the length given");
        // More items than the length given still all come (it is a capacity, not a promise).
        let more: Result<Vec<u32>, String> = collect_sized(1, (0..5).map(Ok));
        assert_eq!(more.unwrap(), vec![0, 1, 2, 3, 4]);
        let items = [Ok(1), Err("second"), Ok(3), Err("fourth")];
        assert_eq!(collect_sized(4, items.into_iter()), Err("second"));
    }

    /// `encode_entry` writes the bytes of the message `entry_to_pb` builds, for commands whose
    /// encoding takes one byte of length and several, and for the payloads it leaves to the message.
    #[test]
    fn an_entry_encoded_directly_is_the_message_s_bytes() {
        let expire = |n: u64| Entry {
            log_id: lid(3, 1, 1 << 40),
            payload: EntryPayload::Normal(Request::new(Command::ExpireSessions {
                sessions: (0..n).map(|i| SessionId(i << 20)).collect(),
                now_ms: 7,
            })),
        };
        let entries = [
            command_entry(),
            expire(0),
            // Commands of 123, 127 and 131 bytes, and 24,744: the length's varint takes one byte, one,
            // two and three (it grows at 128 and at 16,384).
            expire(31),
            expire(32),
            expire(33),
            expire(5_000),
            Entry {
                log_id: lid(1, 1, 0),
                payload: EntryPayload::Blank,
            },
            Entry {
                log_id: lid(2, 1, 5),
                payload: EntryPayload::Membership(membership()),
            },
        ];
        let mut lengths = BTreeSet::new();
        for e in &entries {
            let direct = encode_entry(e);
            assert_eq!(hex(&direct), hex(&to_bytes(&entry_to_pb(e))), "{e:?}");
            let back = entry_from_pb(&from_bytes(&direct, "entry").unwrap()).unwrap();
            assert_eq!(&back, e);
            if let EntryPayload::Normal(Request(c)) = &e.payload {
                lengths.insert(postcard::to_allocvec(&**c).unwrap().len());
            }
        }
        assert!(
            lengths.contains(&127)
                && lengths.iter().any(|&n| (128..16_384).contains(&n))
                && lengths.iter().any(|&n| n >= 16_384),
            "the commands do not cover the lengths' sizes: {lengths:?}"
        );
    }

    /// (value, format-1 bytes) for every WAL payload shape.
    #[test]
    fn format_1_wal_payloads_are_pinned() {
        let entry = command_entry();
        let bytes = to_bytes(&entry_to_pb(&entry));
        assert_eq!(
            hex(&bytes),
            "0a070807100218ac021a0d040509066a6f62732f612ae807"
        );
        let back = entry_from_pb(&from_bytes(&bytes, "entry").unwrap()).unwrap();
        assert_eq!(back, entry);

        let blank = Entry {
            log_id: lid(1, 1, 1),
            payload: EntryPayload::Blank,
        };
        let bytes = to_bytes(&entry_to_pb(&blank));
        assert_eq!(hex(&bytes), "0a06080110011801 1200".replace(' ', ""));
        assert_eq!(
            entry_from_pb(&from_bytes(&bytes, "entry").unwrap()).unwrap(),
            blank
        );

        let member = Entry {
            log_id: lid(1, 1, 2),
            payload: EntryPayload::Membership(membership()),
        };
        let bytes = to_bytes(&entry_to_pb(&member));
        assert_eq!(
            hex(&bytes),
            "0a0608011001180222220a050a03010203 120708011203613a31 120708021203623a32 120708031203633a33"
                .replace(' ', "")
        );
        assert_eq!(
            entry_from_pb(&from_bytes(&bytes, "entry").unwrap()).unwrap(),
            member
        );

        let vote = Vote::new_committed(7, 2);
        let bytes = to_bytes(&vote_to_pb(&vote));
        assert_eq!(hex(&bytes), "080710021801");
        assert_eq!(vote_from_pb(&from_bytes(&bytes, "vote").unwrap()), vote);
        let uncommitted = Vote::new(8, 3);
        assert_eq!(
            vote_from_pb(&from_bytes(&to_bytes(&vote_to_pb(&uncommitted)), "vote").unwrap()),
            uncommitted
        );

        let l = lid(7, 2, 300);
        let bytes = to_bytes(&log_id_to_pb(&l));
        assert_eq!(hex(&bytes), "08071002 18ac02".replace(' ', ""));
        assert_eq!(log_id_from_pb(&from_bytes(&bytes, "log id").unwrap()), l);
    }

    #[test]
    fn format_1_snapshot_meta_is_pinned() {
        let meta = SnapshotMeta {
            last_log_id: Some(lid(7, 2, 300)),
            last_membership: StoredMembership::new(Some(lid(1, 1, 2)), membership()),
        };
        let bytes = to_bytes(&snapshot_meta_to_pb(&meta));
        assert_eq!(
            hex(&bytes),
            "0a0708071002 18ac02 1206080110011802 1a22 0a050a03010203 120708011203613a31 120708021203623a32 120708031203633a33"
                .replace(' ', "")
        );
        assert_eq!(
            snapshot_meta_from_pb(&from_bytes(&bytes, "meta").unwrap()).unwrap(),
            meta
        );
    }

    /// Format 0 bytes as Holdfast 0.1 wrote them (postcard of openraft's structs), decoded by the mirrors.
    #[test]
    fn format_0_is_still_read() {
        // postcard of openraft::Entry for `command_entry()`, captured from Holdfast 0.1 (commit a1d4a08).
        let entry = legacy::entry(&unhex(&hex_format0_entry())).unwrap();
        assert_eq!(entry, command_entry());
        assert_eq!(
            legacy::vote(&unhex("070201")).unwrap(),
            Vote::new_committed(7, 2)
        );
        assert_eq!(
            legacy::log_id_record(&unhex("0702ac02")).unwrap(),
            lid(7, 2, 300)
        );
        let meta = legacy::snapshot_meta(&unhex(&hex_format0_meta())).unwrap();
        assert_eq!(meta.last_log_id, Some(lid(7, 2, 300)));
        assert_eq!(*meta.last_membership.log_id(), Some(lid(1, 1, 2)));
        assert_eq!(meta.last_membership.membership(), &membership());
    }

    fn hex_format0_entry() -> String {
        // log_id {leader_id {term 7, node 2}, index 300}, payload Normal(Release{5, 9, "jobs/a", 42, 1000})
        "0702ac0201040509066a6f62732f612ae807".into()
    }

    fn hex_format0_meta() -> String {
        // Some(log id 7/2/300), StoredMembership {Some(1/1/2), configs [{1,2,3}], nodes {1:a:1, 2:b:2, 3:c:3}}, ""
        "010702ac02 01010102 0103010203 03 01 03613a31 02 03623a32 03 03633a33 00".replace(' ', "")
    }

    /// The format-0 golden bytes are what openraft 0.10.0-alpha.37's own serde produces. This cross-check
    /// holds only while that version is pinned: after an openraft upgrade it may fail, and should then be
    /// deleted (the golden bytes above stay the contract; they are what old data directories hold).
    #[test]
    fn format_0_golden_bytes_are_what_openraft_alpha_37_wrote() {
        use openraft::BasicNode;
        type Node = BasicNode;
        let postcard = |v: &dyn erased::Ser| v.bytes();
        let nodes: BTreeMap<u64, Node> = [(1, "a:1"), (2, "b:2"), (3, "c:3")]
            .into_iter()
            .map(|(id, a)| (id, BasicNode::new(a)))
            .collect();
        let m =
            openraft::Membership::<u64, Node>::new(vec![BTreeSet::from([1, 2, 3])], nodes).unwrap();
        let Entry { log_id, payload } = command_entry();
        let EntryPayload::Normal(request) = payload else {
            unreachable!()
        };
        let entry = openraft::Entry::<LeaderId<u64, u64>, EntryPayload<Request, u64, Node>> {
            log_id,
            payload: EntryPayload::Normal(request),
        };
        assert_eq!(hex(&postcard(&entry)), hex_format0_entry());
        let meta = openraft::storage::SnapshotMeta::<LeaderId<u64, u64>, u64, Node> {
            last_log_id: Some(lid(7, 2, 300)),
            last_membership: openraft::StoredMembership::new(Some(lid(1, 1, 2)), m),
        };
        assert_eq!(hex(&postcard(&meta)), hex_format0_meta());
        assert_eq!(hex(&postcard(&Vote::new_committed(7, 2))), "070201");
        assert_eq!(hex(&postcard(&lid(7, 2, 300))), "0702ac02");
    }

    /// A member's client address is recorded too (format 1 only).
    #[test]
    fn format_1_membership_records_client_addresses() {
        let nodes: BTreeMap<u64, MemberNode> = [(1, "p:1", "c:1"), (4, "p:4", "")]
            .into_iter()
            .map(|(id, p, c)| {
                let node = MemberNode {
                    peer: p.into(),
                    client: c.into(),
                };
                (id, node)
            })
            .collect();
        // A joint configuration ({1} then {1, 4}) with its learner-to-be.
        let m = Membership::new(vec![BTreeSet::from([1]), BTreeSet::from([1, 4])], nodes).unwrap();
        let bytes = to_bytes(&membership_to_pb(&m));
        assert_eq!(
            hex(&bytes),
            "0a030a0101 0a040a020104 120c0801 1203703a31 1a03633a31 120708041203703a34"
                .replace(' ', "")
        );
        assert_eq!(
            membership_from_pb(&from_bytes(&bytes, "membership").unwrap()).unwrap(),
            m
        );
    }

    mod erased {
        pub trait Ser {
            fn bytes(&self) -> Vec<u8>;
        }
        impl<T: serde::Serialize> Ser for T {
            fn bytes(&self) -> Vec<u8> {
                postcard::to_allocvec(self).unwrap()
            }
        }
    }

    #[test]
    fn malformed_bytes_are_errors_not_panics() {
        assert!(from_bytes::<pb::Entry>(&[0xff, 0xff], "entry").is_err());
        let no_payload = pb::Entry {
            log_id: Some(log_id_to_pb(&lid(1, 1, 1))),
            payload: None,
        };
        assert!(entry_from_pb(&no_payload)
            .unwrap_err()
            .contains("entry payload is missing"));
        let bad_command = pb::Entry {
            log_id: Some(log_id_to_pb(&lid(1, 1, 1))),
            payload: Some(pb::entry::Payload::Command(vec![0xff; 3].into())),
        };
        assert!(entry_from_pb(&bad_command).is_err());
        // A voter that is not among the nodes is not a membership.
        let bad_membership = pb::Membership {
            configs: vec![pb::VoterSet { ids: vec![9] }],
            nodes: vec![],
        };
        assert!(membership_from_pb(&bad_membership).is_err());
        assert!(legacy::entry(&[1, 2]).is_err());
    }
}
