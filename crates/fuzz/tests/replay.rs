//! Runs every fuzz target over its committed corpus, over random mutations of it, and over random bytes.
//! `HOLDFAST_FUZZ_CASES` sets the number of generated inputs per target (default 300).
//! `HOLDFAST_WRITE_CORPUS=1 cargo test -p holdfast-fuzz write_corpus` rewrites the seed corpus.

use holdfast_fuzz::TARGETS;
use proptest::prelude::*;
use proptest::test_runner::{Config, TestRunner};
use std::path::PathBuf;

fn corpus_dir(target: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("corpus")
        .join(target)
}

fn corpus(target: &str) -> Vec<Vec<u8>> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(corpus_dir(target))
        .map(|d| d.filter_map(|e| e.ok().map(|e| e.path())).collect())
        .unwrap_or_default();
    files.sort();
    files.iter().map(|p| std::fs::read(p).unwrap()).collect()
}

fn cases() -> u32 {
    std::env::var("HOLDFAST_FUZZ_CASES")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(300)
}

#[derive(Debug, Clone)]
enum Edit {
    Flip(usize, u8),
    Insert(usize, u8),
    Truncate(usize),
}

fn mutate(seed: &[u8], edits: &[Edit]) -> Vec<u8> {
    let mut b = seed.to_vec();
    for e in edits {
        match *e {
            Edit::Flip(at, x) if !b.is_empty() => {
                let i = at % b.len();
                b[i] ^= x | 1;
            }
            Edit::Insert(at, x) => {
                let i = at % (b.len() + 1);
                b.insert(i, x);
            }
            Edit::Truncate(at) if !b.is_empty() => b.truncate(at % b.len()),
            _ => {}
        }
    }
    b
}

fn edit() -> impl Strategy<Value = Edit> {
    prop_oneof![
        4 => (any::<usize>(), any::<u8>()).prop_map(|(a, x)| Edit::Flip(a, x)),
        1 => (any::<usize>(), any::<u8>()).prop_map(|(a, x)| Edit::Insert(a, x)),
        1 => any::<usize>().prop_map(Edit::Truncate),
    ]
}

#[test]
fn every_target_survives_its_corpus_mutations_and_random_bytes() {
    for (name, target) in TARGETS {
        let seeds = corpus(name);
        assert!(
            !seeds.is_empty(),
            "no corpus for {name} in {}",
            corpus_dir(name).display()
        );
        for seed in &seeds {
            target(seed);
        }
        let mut runner = TestRunner::new_with_rng(
            Config {
                cases: cases(),
                ..Config::default()
            },
            proptest::test_runner::TestRng::deterministic_rng(
                proptest::test_runner::RngAlgorithm::ChaCha,
            ),
        );
        let seeds2 = seeds.clone();
        runner
            .run(
                &(0..seeds2.len(), proptest::collection::vec(edit(), 1..8)),
                |(i, edits)| {
                    target(&mutate(&seeds2[i], &edits));
                    Ok(())
                },
            )
            .unwrap_or_else(|e| panic!("{name}: {e}"));
        runner
            .run(&proptest::collection::vec(any::<u8>(), 0..512), |bytes| {
                target(&bytes);
                Ok(())
            })
            .unwrap_or_else(|e| panic!("{name}: {e}"));
    }
}

/// Writes the seed corpus from real encoders. Only with `HOLDFAST_WRITE_CORPUS=1`.
#[test]
fn write_corpus() {
    if std::env::var("HOLDFAST_WRITE_CORPUS").is_err() {
        return;
    }
    use holdfast_lock_table::{AcquireMode, Command, LockName, LockTable, RequestId, SessionId};
    let write = |target: &str, name: &str, bytes: &[u8]| {
        let dir = corpus_dir(target);
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join(name), bytes).unwrap();
    };
    // A small table: two sessions, a held lock with a waiter, a free lock.
    let mut table = LockTable::new();
    let acquire = |s: u64, r: u64, n: &str| Command::Acquire {
        session: SessionId(s),
        request: RequestId(r),
        name: LockName::new(n).unwrap(),
        mode: AcquireMode::Wait,
        value: b"v".to_vec().into(),
        attempt: r,
        now_ms: 5,
    };
    table.apply(
        1,
        &Command::OpenSession {
            nonce: 1,
            ttl_ms: 10_000,
            now_ms: 1,
        },
    );
    table.apply(
        2,
        &Command::OpenSession {
            nonce: 2,
            ttl_ms: 10_000,
            now_ms: 2,
        },
    );
    table.apply(3, &acquire(1, 1, "a"));
    table.apply(4, &acquire(2, 1, "a"));
    table.apply(5, &acquire(2, 2, "b"));
    let snapshot = table.encode_snapshot();
    write("lock_table_snapshot", "small", &snapshot);
    write(
        "lock_table_snapshot",
        "empty",
        &LockTable::new().encode_snapshot(),
    );
    write("lock_table_body", "small", &snapshot[6..snapshot.len() - 4]);
    let meta = holdfast_server::raft_types::SnapshotMeta::default();
    write(
        "server_snapshot",
        "small",
        &holdfast_server::snapshot_store::SnapshotStore::encode(&meta, &snapshot),
    );

    // A real WAL segment.
    let dir = tempfile::tempdir().unwrap();
    {
        let (wal, _) =
            holdfast_wal::Wal::open(dir.path(), holdfast_wal::WalOptions::default()).unwrap();
        for i in 1..=5u64 {
            let r = holdfast_wal::Record {
                group: 0,
                kind: 1,
                sticky: i == 3,
                index: i,
                payload: vec![i as u8; i as usize * 3],
            };
            wal.append_blocking(vec![r]).unwrap();
        }
    }
    let segment =
        std::fs::read(holdfast_wal::Wal::segment_paths(dir.path()).unwrap()[0].clone()).unwrap();
    write("wal_segment", "five-frames", &segment);
    write(
        "wal_frame_body",
        "first-frame",
        &segment[28..28 + u32::from_le_bytes(segment[20..24].try_into().unwrap()) as usize],
    );

    use prost::Message;
    let req = holdfast_proto::v1::AcquireRequest {
        group: 0,
        session_id: 3,
        request_id: 9,
        name: "jobs/a".into(),
        wait_timeout_ms: 100,
        value: b"x".to_vec(),
        client_cancels: false,
        session_secret: Vec::new(),
        lock_delay_ms: 0,
        shared: false,
        permits: 0,
    };
    write(
        "client_request",
        "acquire",
        &[&[0u8][..], &req.encode_to_vec()].concat(),
    );
    let rel = holdfast_proto::v1::ReleaseRequest {
        group: 0,
        session_id: 3,
        request_id: 10,
        name: "jobs/a".into(),
        token: 7,
        session_secret: Vec::new(),
    };
    write(
        "client_request",
        "release",
        &[&[1u8][..], &rel.encode_to_vec()].concat(),
    );
    let call = holdfast_proto::v1::CallRequest {
        id: 1,
        call: Some(holdfast_proto::v1::call_request::Call::Acquire(req.clone())),
    };
    write(
        "client_request",
        "calls",
        &[&[4u8][..], &call.encode_to_vec()].concat(),
    );
    let ka = holdfast_proto::v1::KeepAliveRequest {
        group: 0,
        session_ids: vec![1, 2, 3],
        session_secrets: Vec::new(),
        ..Default::default()
    };
    write(
        "client_request",
        "keepalive",
        &[&[3u8][..], &ka.encode_to_vec()].concat(),
    );

    use holdfast_server::formats;
    let vote = formats::vote_to_pb(&holdfast_server::raft_types::Vote::new_committed(3, 1));
    let header = holdfast_proto::v1::PeerHeader {
        format: formats::PEER_FORMAT,
        cluster_id: 7,
        from_node: 1,
        to_node: 2,
        group: 0,
    };
    let entry = holdfast_server::raft_types::Entry {
        log_id: openraft::LogId::new(
            openraft::impls::leader_id_adv::LeaderId {
                term: 3,
                node_id: 1,
            },
            6,
        ),
        payload: openraft::EntryPayload::Normal(holdfast_server::raft_types::Request::new(
            acquire(1, 2, "c"),
        )),
    };
    let append = holdfast_proto::v1::AppendEntriesRequest {
        header: Some(header),
        vote: Some(vote),
        prev_log_id: Some(holdfast_proto::v1::LogId {
            term: 3,
            leader: 1,
            index: 5,
        }),
        entries: vec![formats::entry_to_pb(&entry)],
        leader_commit: None,
    };
    write(
        "peer_message",
        "append-entries",
        &[&[0u8][..], &append.encode_to_vec()].concat(),
    );
    let vote_req = holdfast_proto::v1::VoteRequest {
        header: Some(header),
        vote: Some(vote),
        last_log_id: None,
        leadership_transfer: false,
    };
    write(
        "peer_message",
        "vote",
        &[&[1u8][..], &vote_req.encode_to_vec()].concat(),
    );
    let chunk = holdfast_proto::v1::SnapshotChunk {
        header: Some(header),
        vote: Some(vote),
        meta: Some(formats::snapshot_meta_to_pb(&meta)),
        data: Vec::new(),
    };
    write(
        "peer_message",
        "snapshot-header",
        &[&[2u8][..], &chunk.encode_to_vec()].concat(),
    );
    write(
        "peer_message",
        "legacy-entry",
        &[&[3u8][..], &postcard::to_allocvec(&entry).unwrap()].concat(),
    );

    let backup = holdfast_server::backup::Backup {
        cluster_id: 7,
        created_at_ms: 1,
        written_by: "corpus".into(),
        groups: vec![holdfast_server::backup::GroupBackup {
            group: 0,
            last_log_id: openraft::LogId::new(
                openraft::impls::leader_id_adv::LeaderId {
                    term: 3,
                    node_id: 1,
                },
                5,
            ),
            digest: table.digest(),
            table: table.encode_snapshot(),
        }],
    };
    write("backup_file", "one-group", &backup.encode());

    let fence = dir.path().join("fence.log");
    let store = holdfast_fence::store::FencedStore::open(&fence).unwrap();
    store.write("k", 3, b"one").unwrap();
    store.read("k", 5).unwrap();
    store.write("k", 5, b"two").unwrap();
    drop(store);
    write(
        "fenced_store_log",
        "three-records",
        &std::fs::read(&fence).unwrap(),
    );
}
