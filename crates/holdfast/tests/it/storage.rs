//! Storage faults on real servers: a failed fsync stops the server, a full disk gives a clear error, and a
//! torn or truncated log tail is recovered; in every case no acknowledged change is lost.

use crate::harness::{name_in_group, names_in_group, Cluster, Options};
use holdfast_client::{LockGuard, Session};
use rand::{Rng, SeedableRng};
use std::path::{Path, PathBuf};
use std::time::Duration;

const SECS_30: Duration = Duration::from_secs(30);

fn three() -> Options {
    Options {
        nodes: 3,
        ..Options::default()
    }
}

async fn hold_some(session: &Session, prefix: &str, n: usize) -> Vec<LockGuard> {
    let mut held = Vec::new();
    for i in 0..n {
        held.push(session.try_acquire(&format!("{prefix}/{i}")).await.unwrap());
    }
    held
}

/// Every lock in `held` is still held by `session` with its token.
pub(crate) async fn assert_held(
    client: &holdfast_client::Client,
    session: &Session,
    held: &[LockGuard],
) {
    for g in held {
        let lock = client
            .describe(g.name())
            .await
            .unwrap()
            .unwrap_or_else(|| panic!("acknowledged lock {} lost", g.name()));
        assert_eq!(
            (lock.holder_session_id, lock.token),
            (session.ids()[0], g.token()),
            "{}",
            g.name()
        );
    }
}

async fn churn(session: &Session, prefix: &str, n: usize) {
    for i in 0..n {
        session
            .try_acquire(&format!("{prefix}/{i}"))
            .await
            .unwrap()
            .release()
            .await
            .unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_fsync_stops_the_server_and_nothing_acknowledged_is_lost() {
    let mut c = Cluster::start(three()).await;
    let client = c.client().await;
    let session = client.open_session(Duration::from_secs(10)).await.unwrap();
    let mut held = hold_some(&session, "before", 5).await;
    let leader = c.wait_for_leader(0, SECS_30).await;
    let victim = (1..=3).find(|&i| i != leader).unwrap();

    c.kill(victim).await;
    c.servers[(victim - 1) as usize].extra_args = vec!["--fault-fsync-fail-after=3".into()];
    c.start_server(victim);
    // Load makes the victim sync until its injected failure; the other two keep acknowledging.
    let (stop, mut stopped) = tokio::sync::watch::channel(false);
    let load = {
        let session = session.clone();
        tokio::spawn(async move {
            let mut held = Vec::new();
            while !*stopped.borrow_and_update() {
                held.push(
                    session
                        .try_acquire(&format!("during/{}", held.len()))
                        .await
                        .unwrap(),
                );
            }
            held
        })
    };
    let status = c.wait_exit(victim, SECS_30).await;
    stop.send_replace(true);
    assert_eq!(
        status.code(),
        Some(2),
        "a server whose fsync failed must exit with 2"
    );
    let log = c.log_text(victim);
    assert!(
        log.contains("injected fsync failure"),
        "the reason is logged:\n{log}"
    );
    assert!(
        log.contains("will not retry"),
        "a failed fsync is not retried:\n{log}"
    );
    held.extend(load.await.unwrap());

    // Restarted without the fault, it recovers from what was durable and catches up.
    c.start_server(victim);
    c.wait_converged(0, SECS_30).await;
    assert_held(&client, &session, &held).await;
}

/// Mounts a tmpfs of `bytes` at `path` for the life of the value (the test runs as root, as CI does).
struct SmallDisk(PathBuf);

impl SmallDisk {
    fn mount(path: &Path, bytes: u64) -> SmallDisk {
        std::fs::create_dir_all(path).unwrap();
        let ok = std::process::Command::new("mount")
            .args(["-t", "tmpfs", "-o", &format!("size={bytes}"), "tmpfs"])
            .arg(path)
            .status()
            .unwrap()
            .success();
        assert!(ok, "mounting a small tmpfs needs root (CI runs as root)");
        SmallDisk(path.to_path_buf())
    }
}

impl Drop for SmallDisk {
    fn drop(&mut self) {
        let _ = std::process::Command::new("umount")
            .arg("-l")
            .arg(&self.0)
            .status();
    }
}

/// The bytes of the files under `dir`, each rounded up to 4 KiB pages as tmpfs stores them.
fn tree_bytes(dir: &Path) -> u64 {
    std::fs::read_dir(dir)
        .unwrap()
        .map(|e| {
            let e = e.unwrap();
            match e.file_type().unwrap().is_dir() {
                true => tree_bytes(&e.path()) + 4096,
                false => e.metadata().unwrap().len().div_ceil(4096) * 4096,
            }
        })
        .sum()
}

fn copy_tree(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for e in std::fs::read_dir(from).unwrap() {
        let e = e.unwrap();
        let target = to.join(e.file_name());
        if e.file_type().unwrap().is_dir() {
            copy_tree(&e.path(), &target);
        } else {
            std::fs::copy(e.path(), target).unwrap();
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_disk_stops_the_server_with_a_clear_error_and_nothing_is_lost() {
    let mut c = Cluster::start(three()).await;
    let client = c.client().await;
    let session = client.open_session(Duration::from_secs(10)).await.unwrap();
    let mut held = hold_some(&session, "before", 5).await;
    let leader = c.wait_for_leader(0, SECS_30).await;
    let victim = (1..=3).find(|&i| i != leader).unwrap();
    let data = c.servers[(victim - 1) as usize].data_dir.clone();

    c.kill(victim).await;
    let saved = data.with_extension("saved");
    std::fs::rename(&data, &saved).unwrap();
    // Room for what it holds (the segment in use with the zeros the log writes ahead of its frames,
    // which recovery cuts) and 256 KiB more.
    let disk = SmallDisk::mount(&data, tree_bytes(&saved) + (256 << 10));
    copy_tree(&saved, &data);
    c.start_server(victim);
    // Fill it: each entry is a WAL record; 256 KiB (and the zeros recovery cuts) hold a few thousand.
    let filler = {
        let session = session.clone();
        tokio::spawn(async move { churn(&session, "fill", 3_000).await })
    };
    let status = c.wait_exit(victim, Duration::from_secs(120)).await;
    assert_eq!(status.code(), Some(2));
    let log = c.log_text(victim);
    assert!(
        log.contains("No space left on device"),
        "the error says the disk is full:\n{}",
        &log[log.len().saturating_sub(2000)..]
    );
    filler.await.unwrap();
    held.extend(hold_some(&session, "after", 5).await);

    // Give it room (copy its data to the big disk) and restart: it recovers and catches up.
    std::fs::remove_dir_all(&saved).unwrap();
    copy_tree(&data, &saved);
    drop(disk);
    std::fs::remove_dir_all(&data).unwrap();
    std::fs::rename(&saved, &data).unwrap();
    c.start_server(victim);
    c.wait_converged(0, SECS_30).await;
    assert_held(&client, &session, &held).await;
}

/// A crash in the middle of a write leaves a partial frame at the end of the log; only bytes that were
/// never fsynced (so never acknowledged) can be torn. Recovery cuts exactly them and the server rejoins.
/// (Cutting deeper would model a disk that lost fsynced data: openraft's leader then stops on "follower
/// log reversion", see docs/operations.md.) A corrupt frame before the tail refuses to start instead.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_torn_tail_is_cut_and_a_corrupt_log_refuses_to_start() {
    let mut c = Cluster::start(three()).await;
    let client = c.client().await;
    let session = client.open_session(Duration::from_secs(10)).await.unwrap();
    let mut held = Vec::new();
    let mut rng = rand::rngs::StdRng::seed_from_u64(42);
    for round in 0..3 {
        held.extend(hold_some(&session, &format!("r{round}"), 5).await);
        let leader = c.wait_for_leader(0, SECS_30).await;
        let victim = (1..=3).find(|&i| i != leader).unwrap();
        c.kill(victim).await;
        let last = newest_segment(&c.servers[(victim - 1) as usize].data_dir);
        // A torn frame: a plausible header (magic, length) and part of its body.
        let mut torn = b"HFWF".to_vec();
        torn.extend_from_slice(&200u32.to_le_bytes());
        torn.extend((0..rng.random_range(0..150)).map(|_| rng.random::<u8>()));
        // Written where the next frame would have gone: after the last valid frame, over the zeros the
        // log writes ahead of its frames (which stay after it).
        let mut bytes = std::fs::read(&last).unwrap();
        let seq = last
            .file_name()
            .and_then(|n| n.to_str())
            .and_then(holdfast_wal::format::parse_segment_name)
            .unwrap();
        let whole = holdfast_wal::format::valid_frames(&bytes, seq)
            .last()
            .map_or(16, |(body, len)| (body + len) as usize);
        let file_len = bytes.len();
        bytes.truncate(whole);
        bytes.extend_from_slice(&torn);
        bytes.resize(bytes.len().max(file_len), 0);
        std::fs::write(&last, &bytes).unwrap();
        c.start_server(victim);
        churn(&session, &format!("churn{round}"), 10).await;
        c.wait_converged(0, SECS_30).await;
        assert!(
            c.log_text(victim).contains(&format!("offset={whole}")),
            "the torn bytes were cut at {whole}"
        );
        assert_held(&client, &session, &held).await;
    }

    // A flipped byte in an acknowledged frame is corruption, not a crash: refuse to start, naming it.
    let leader = c.wait_for_leader(0, SECS_30).await;
    let victim = (1..=3).find(|&i| i != leader).unwrap();
    c.kill(victim).await;
    let segment = oldest_segment(&c.servers[(victim - 1) as usize].data_dir);
    let original = std::fs::read(&segment).unwrap();
    let mut bad = original.clone();
    bad[40] ^= 0x55;
    std::fs::write(&segment, &bad).unwrap();
    c.start_server(victim);
    let status = c.wait_exit(victim, SECS_30).await;
    assert_eq!(status.code(), Some(1));
    let log = c.log_text(victim);
    let name = segment.file_name().unwrap().to_str().unwrap();
    assert!(
        log.contains("wal is corrupt") && log.contains(name),
        "the error names the file:\n{log}"
    );
    // With the file repaired, it starts and catches up.
    std::fs::write(&segment, &original).unwrap();
    c.start_server(victim);
    c.wait_converged(0, SECS_30).await;
    assert_held(&client, &session, &held).await;
}

/// The segments in use, oldest first (not the pre-created standby after them).
fn segments(data_dir: &Path) -> Vec<PathBuf> {
    holdfast_wal::Wal::segment_paths(&data_dir.join("wal")).unwrap()
}

fn newest_segment(data_dir: &Path) -> PathBuf {
    segments(data_dir).pop().unwrap()
}

fn oldest_segment(data_dir: &Path) -> PathBuf {
    segments(data_dir).remove(0)
}

/// How many segments are in use, and their bytes.
fn wal_segments(data_dir: &std::path::Path) -> (usize, u64) {
    let paths = segments(data_dir);
    let bytes = paths
        .iter()
        .map(|p| std::fs::metadata(p).unwrap().len())
        .sum();
    (paths.len(), bytes)
}

/// One busy group and one idle one, with 64 KiB WAL segments: the idle group's few old entries would keep
/// the oldest segment, and every later one, on disk for ever. The server snapshots and purges the group
/// that pins the oldest segment, so the WAL stays one or two segments long (without that: 4 after 2,400 entries, and growing).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idle_group_does_not_pin_the_wal() {
    let c = Cluster::start(Options {
        nodes: 3,
        groups: 2,
        snapshot_every_entries: 200,
        snapshot_keep_entries: 20,
        server_args: vec!["--wal-segment-bytes=65536".into()],
        ..Options::default()
    })
    .await;
    let client = c.client().await;
    let session = client.open_session(Duration::from_secs(10)).await.unwrap();
    let busy = names_in_group(0, 2, "busy/", 4);
    let mut most = 0;
    for i in 0..1500 {
        let g = session.acquire(&busy[i % busy.len()]).await.unwrap();
        g.release().await.unwrap();
        if i % 100 == 0 {
            most = most.max(wal_segments(&c.servers[0].data_dir).0);
        }
    }
    let written = c.group_status(1, 0).await.unwrap().last_log_index;
    // The idle group applied only its first entries and never reached its snapshot threshold.
    assert!(c.group_status(1, 1).await.unwrap().applied_index < 10);
    let sizes = wal_becomes_short(&c, "").await;
    eprintln!(
        "{written} entries in group 0; at most {most} segments on node 1 while writing; now (segments, bytes) per node: {sizes:?}"
    );
}

/// Waits (30 s at most) until every server's WAL is at most two segments long, and returns each one's
/// (segments, bytes); `why` goes in the failure's message.
async fn wal_becomes_short(c: &Cluster, why: &str) -> Vec<(usize, u64)> {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    loop {
        let sizes: Vec<(usize, u64)> = c
            .servers
            .iter()
            .map(|s| wal_segments(&s.data_dir))
            .collect();
        if sizes.iter().all(|(n, _)| *n <= 2) {
            return sizes;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "the WAL stayed long: {sizes:?} (segments, bytes) per node{why}; logs in {}",
            c.dir().display()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// The same with the idle group's snapshots paced by their size: it holds 200 KB of values, then a
/// few hundred small entries make a snapshot due that waits for a longer log (`SnapshotPacing`), and
/// then it goes quiet. openraft asks for its next snapshot only after as many entries again, which
/// never come; the server must still snapshot and purge it when it pins the oldest segment (it did
/// not before it looked at the pacing: the WAL grew with the busy group's entries).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_quiet_group_whose_snapshot_waits_does_not_pin_the_wal() {
    let c = Cluster::start(Options {
        nodes: 3,
        groups: 2,
        http: true,
        snapshot_every_entries: 200,
        snapshot_keep_entries: 20,
        server_args: vec!["--wal-segment-bytes=65536".into()],
        ..Options::default()
    })
    .await;
    let client = c.client().await;
    let session = client.open_session(Duration::from_secs(30)).await.unwrap();
    let value = vec![b'v'; holdfast_lock_table::limits::MAX_VALUE_BYTES];
    let mut held = Vec::new();
    for name in names_in_group(1, 2, "big/", 210) {
        held.push(
            session
                .acquire_with_value(&name, Duration::ZERO, &value)
                .await
                .unwrap(),
        );
    }
    // Small entries in group 1 until a due snapshot has waited on every server.
    let small = name_in_group(1, 2, "small/");
    let c = &c;
    let deferred = |id: u64| async move {
        c.metrics(id)
            .await
            .get("holdfast_snapshots_deferred_total{group=\"1\"}")
            .copied()
            .unwrap_or(0)
    };
    let mut pairs = 0;
    loop {
        let mut waited = true;
        for id in 1..=3 {
            waited &= deferred(id).await > 0;
        }
        if waited {
            break;
        }
        assert!(pairs < 300, "no due snapshot of group 1 waited");
        session
            .acquire(&small)
            .await
            .unwrap()
            .release()
            .await
            .unwrap();
        pairs += 1;
    }
    let quiet = c.group_status(1, 1).await.unwrap();
    let busy = names_in_group(0, 2, "busy/", 4);
    for i in 0..1500 {
        let g = session.acquire(&busy[i % busy.len()]).await.unwrap();
        g.release().await.unwrap();
    }
    wal_becomes_short(c, &format!("; group 1 went quiet at {quiet:?}")).await;
    assert_eq!(held.len(), 210);
}

/// A group is snapshotted by log size too: with the entry threshold out of reach, 1 KiB lock values
/// make the log pass `--snapshot-every-bytes` (64 KiB) within ~150 acquires, and a snapshot appears.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_log_that_grows_by_bytes_is_snapshotted() {
    let c = Cluster::start(Options {
        nodes: 3,
        snapshot_every_entries: 1_000_000,
        server_args: vec!["--snapshot-every-bytes=65536".into()],
        ..Options::default()
    })
    .await;
    let session = c
        .client()
        .await
        .open_session(Duration::from_secs(10))
        .await
        .unwrap();
    let value = vec![b'v'; holdfast_lock_table::limits::MAX_VALUE_BYTES];
    for i in 0..150 {
        let g = session
            .acquire_with_value(&format!("bytes/{}", i % 4), Duration::from_secs(5), &value)
            .await
            .unwrap();
        g.release().await.unwrap();
    }
    let entries = c.group_status(1, 0).await.unwrap().last_log_index;
    assert!(
        entries < 1_000,
        "{entries} entries: far below the entry threshold"
    );
    let snapshots = |id: usize| {
        std::fs::read_dir(c.servers[id].data_dir.join("snapshots/g0"))
            .map(|d| d.count())
            .unwrap_or(0)
    };
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    while (0..3).any(|i| snapshots(i) == 0) {
        assert!(
            tokio::time::Instant::now() < deadline,
            "no snapshot by size after {entries} entries; logs in {}",
            c.dir().display()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// A snapshot written from a peer (`SnapshotStore::save`, an install) onto a disk that fills up fails
/// with the disk's error and leaves no partial file behind taking the space, and the snapshot before
/// it stays.
#[test]
fn a_snapshot_save_that_fills_the_disk_leaves_no_partial_file() {
    use holdfast_server::snapshot_store::SnapshotStore;
    let dir = tempfile::tempdir().unwrap();
    let _disk = SmallDisk::mount(dir.path(), 1 << 20);
    let store = SnapshotStore::open(dir.path().join("snapshots").join("g0")).unwrap();
    store.save(1, &[7u8; 64 << 10]).unwrap();
    let err = store.save(2, &vec![7u8; 2 << 20]).unwrap_err();
    assert_eq!(err.raw_os_error(), Some(28), "ENOSPC: {err}");
    let mut names: Vec<String> = std::fs::read_dir(dir.path().join("snapshots").join("g0"))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    assert_eq!(names, vec![format!("snap-{:020}.bin", 1)]);
}

/// The fenced store on a full disk: an append that does not fit is refused and cut back off the file, so
/// the store goes on (a smaller write passes once there is room) and opens again afterwards. Before, the
/// part of the record that fit stayed, the next record landed after it, and the store then refused to
/// open ("corrupt": a bad record followed by valid ones).
#[test]
fn the_fenced_store_on_a_full_disk_refuses_the_write_and_opens_again() {
    use holdfast_fence::store::FencedStore;
    let dir = tempfile::tempdir().unwrap();
    let _disk = SmallDisk::mount(dir.path(), 1 << 20);
    let path = dir.path().join("fence.log");
    let store = FencedStore::open(&path).unwrap();
    store.write("k", 5, &vec![5u8; 512 << 10]).unwrap();
    let before = std::fs::metadata(&path).unwrap().len();
    let err = store.write("k", 6, &vec![6u8; 1 << 20]).unwrap_err();
    assert!(err.to_string().contains("No space left"), "{err}");
    assert_eq!(
        std::fs::metadata(&path).unwrap().len(),
        before,
        "the partial record stayed"
    );
    assert_eq!(
        store.peek("k").unwrap().mark,
        5,
        "a refused write raised the mark"
    );
    store.write("k", 7, b"seven").unwrap();
    drop(store);
    let store = FencedStore::open(&path).unwrap();
    let e = store.peek("k").unwrap();
    assert_eq!((e.mark, e.value.as_deref()), (7, Some(&b"seven"[..])));
}
