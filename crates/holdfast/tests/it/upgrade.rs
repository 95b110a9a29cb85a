//! Upgrades and identity: data written by an older Holdfast still starts and serves, and a data directory
//! of another cluster cannot join this one.
//!
//! The fixture `tests/fixtures/datadir-v0` was written by Holdfast 0.1 (commit a1d4a08, formats 0: postcard
//! WAL records and snapshot meta, the format-0 IDENTITY) with `scripts/make-format-fixture`: three servers,
//! two groups, snapshots and entries after them, and `fixture/held` held by a 5-minute session.

use crate::harness::{copy_dir, Cluster, Options};
use holdfast_client::Error;
use std::path::{Path, PathBuf};
use std::time::Duration;

fn fixture() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/datadir-v0")
}

fn magic(path: &Path) -> Vec<u8> {
    std::fs::read(path).unwrap()[..8].to_vec()
}

fn snapshot_files(data_dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    for g in ["g0", "g1"] {
        let dir = data_dir.join("snapshots").join(g);
        for e in std::fs::read_dir(&dir).unwrap() {
            out.push(e.unwrap().path());
        }
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_data_dir_written_by_holdfast_0_1_starts_and_serves() {
    let held: serde_json::Value =
        serde_json::from_slice(&std::fs::read(fixture().join("held.json")).unwrap()).unwrap();
    let (holder, token) = (
        held["holder_session_id"].as_u64().unwrap(),
        held["token"].as_u64().unwrap(),
    );
    for n in 1..=3 {
        assert!(
            snapshot_files(&fixture().join(format!("node{n}")))
                .iter()
                .all(|p| magic(p) == b"HFSNAP01"),
            "the fixture holds format-0 snapshots"
        );
    }

    // New ports: the fixture's recorded addresses are not reachable, only its data is reused.
    let mut c = Cluster::start(Options {
        nodes: 3,
        groups: 2,
        snapshot_every_entries: 100,
        snapshot_keep_entries: 20,
        seed_data: Some(fixture()),
        ..Options::default()
    })
    .await;
    let before = [
        c.wait_converged(0, Duration::from_secs(30)).await,
        c.wait_converged(1, Duration::from_secs(30)).await,
    ];

    // The lock held when Holdfast 0.1 stopped is still held, by the same session, with the same token.
    let client = c.client().await;
    let info = client
        .describe("fixture/held")
        .await
        .unwrap()
        .expect("fixture/held is held");
    assert_eq!((info.holder_session_id, info.token), (holder, token));
    let session = client.open_session(Duration::from_secs(10)).await.unwrap();
    match session.try_acquire("fixture/held").await {
        Err(Error::LockHeld { holder_session, .. }) => assert_eq!(holder_session, holder),
        Err(other) => panic!("want LockHeld by the fixture's session, got {other:?}"),
        Ok(g) => panic!("fixture/held granted again, token {}", g.token()),
    }

    // New grants continue the fencing order, and enough entries go through that every group writes a
    // format-1 snapshot.
    let held_group = holdfast_lock_table::group_for("fixture/held", 2).0;
    let mut probe_token = None;
    for i in 0..160 {
        let name = format!("upgrade/probe-{i}");
        let guard = session.acquire(&name).await.unwrap();
        if holdfast_lock_table::group_for(&name, 2).0 == held_group {
            probe_token.get_or_insert(guard.token());
        }
        guard.release().await.unwrap();
    }
    assert!(
        probe_token.expect("some probe hashed into fixture/held's group") > token,
        "fencing tokens went backwards after the upgrade"
    );
    for g in 0..2 {
        let digest = c.wait_converged(g, Duration::from_secs(30)).await;
        assert_ne!(digest, before[g as usize], "group {g} applied nothing new");
    }

    // Every data dir was upgraded in place: format-1 IDENTITY with one cluster id, format-1 snapshots.
    let mut cluster_ids = std::collections::BTreeSet::new();
    for s in &c.servers {
        let identity = std::fs::read_to_string(s.data_dir.join("IDENTITY")).unwrap();
        assert!(identity.starts_with("format=1\n"), "{identity}");
        cluster_ids.insert(
            identity
                .lines()
                .find_map(|l| l.strip_prefix("cluster_id="))
                .unwrap()
                .to_string(),
        );
        let snapshots = snapshot_files(&s.data_dir);
        assert!(
            !snapshots.is_empty() && snapshots.iter().all(|p| magic(p) == b"HFSNAP02"),
            "node {}: {snapshots:?}",
            s.id
        );
    }
    assert_eq!(cluster_ids.len(), 1, "{cluster_ids:?}");

    // A restart now reads the mixed WAL (format-0 records, then format-1 ones) and a format-1 snapshot.
    c.kill(2).await;
    c.start_server(2);
    for g in 0..2 {
        c.wait_converged(g, Duration::from_secs(30)).await;
    }
    let info = client.describe("fixture/held").await.unwrap().unwrap();
    assert_eq!((info.holder_session_id, info.token), (holder, token));
    // `holdfast status` reports the cluster id the data dirs recorded.
    let out = c.holdfast().arg("status").output().await.unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    let id = cluster_ids.first().unwrap();
    assert!(text.starts_with(&format!("cluster {id}\n")), "{text}");
}

/// A server started on another cluster's data directory (same node id and groups) is refused by every
/// peer: its messages carry the other cluster's id, so it can neither vote nor append here.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_data_dir_of_another_cluster_is_refused_by_its_peers() {
    let three = Options {
        nodes: 3,
        ..Options::default()
    };
    let mut a = Cluster::start(three).await;
    let mut b = Cluster::start(Options {
        nodes: 3,
        ..Options::default()
    })
    .await;
    // Some state in A that must never reach B.
    let sa = a
        .client()
        .await
        .open_session(Duration::from_secs(10))
        .await
        .unwrap();
    let _guard = sa.acquire("cluster-a/only").await.unwrap();
    a.wait_converged(0, Duration::from_secs(20)).await;
    b.wait_converged(0, Duration::from_secs(20)).await;

    // B's node 3 is replaced by a copy of A's node 3.
    a.kill(3).await;
    b.kill(3).await;
    let b3 = b.servers[2].data_dir.clone();
    std::fs::remove_dir_all(&b3).unwrap();
    copy_dir(&a.servers[2].data_dir, &b3);
    b.start_server(3);

    // B's own members refuse it, and say why.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    loop {
        let refused = [1, 2, 3].iter().any(|&n| {
            b.log_text(n)
                .contains("refusing messages from another cluster")
        });
        if refused {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "nobody refused the other cluster's server; logs in {}",
            b.dir().display()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // B serves on without it, and nothing of A's reached B's members.
    let client = b.client().await;
    assert!(client.describe("cluster-a/only").await.unwrap().is_none());
    let s = client.open_session(Duration::from_secs(10)).await.unwrap();
    s.acquire("cluster-b/still-works").await.unwrap();
    for n in [1, 2] {
        let g = b.group_status(n, 0).await.unwrap();
        assert!(g.applied_index > 0);
    }
    // `holdfast status` names the split.
    let out = b.holdfast().arg("status").output().await.unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("servers belong to different clusters"),
        "{err}"
    );
}
