//! WAL integration tests on real files: order, group commit, torn tails, corruption, fail-stop, rotation.

use holdfast_wal::{Record, Wal, WalError, WalOptions};
use rand::{Rng, SeedableRng};
use std::path::Path;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

fn rec(group: u32, index: u64, payload: &[u8]) -> Record {
    Record {
        group,
        kind: 1,
        sticky: false,
        index,
        payload: payload.to_vec(),
    }
}

fn only_segment(dir: &Path) -> std::path::PathBuf {
    let segs = Wal::segment_paths(dir).unwrap();
    assert_eq!(segs.len(), 1, "{segs:?}");
    segs[0].clone()
}

/// Opens a log that must refuse to start: the error and its message.
fn refused(dir: &Path) -> (WalError, String) {
    let err = Wal::open(dir, WalOptions::default())
        .err()
        .expect("must refuse");
    let msg = err.to_string();
    (err, msg)
}

fn assert_names(msg: &str, path: &Path) {
    assert!(
        msg.contains(path.file_name().unwrap().to_str().unwrap()),
        "{msg}"
    );
}

/// Where each valid frame of the segment at `path` ends, as recovery reads it. (The file's length is
/// not a frame's end while the log is open: the writer fills it with zeros ahead of its frames.)
fn frame_ends(path: &Path) -> Vec<u64> {
    let seq = path
        .file_name()
        .and_then(|n| n.to_str())
        .and_then(holdfast_wal::format::parse_segment_name)
        .expect("a segment's name");
    holdfast_wal::format::valid_frames(&std::fs::read(path).unwrap(), seq)
        .into_iter()
        .map(|(body, len)| body + len)
        .collect()
}

/// The path of segment `seq` beside `segment`.
fn segment_beside(segment: &Path, seq: u64) -> std::path::PathBuf {
    segment.with_file_name(format!("wal-{seq:016x}.log"))
}

#[test]
fn records_come_back_in_order() {
    let dir = tempfile::tempdir().unwrap();
    let (wal, rec0) = Wal::open(dir.path(), WalOptions::default()).unwrap();
    assert!(rec0.records.is_empty());
    for i in 1..=100u64 {
        wal.append_blocking(vec![rec((i % 3) as u32, i, &i.to_le_bytes())])
            .unwrap();
    }
    drop(wal);
    let (_wal, recovered) = Wal::open(dir.path(), WalOptions::default()).unwrap();
    let indexes: Vec<u64> = recovered.records.iter().map(|r| r.index).collect();
    assert_eq!(indexes, (1..=100).collect::<Vec<_>>());
    assert!(recovered.torn.is_none());
}

#[test]
fn concurrent_appends_share_syncs() {
    let dir = tempfile::tempdir().unwrap();
    let syncs = Arc::new(AtomicUsize::new(0));
    let s2 = syncs.clone();
    let options = WalOptions {
        observer: Some(Arc::new(move |_| {
            s2.fetch_add(1, Ordering::Relaxed);
        })),
        ..WalOptions::default()
    };
    let (wal, _) = Wal::open(dir.path(), options).unwrap();
    let wal = Arc::new(wal);
    let done = Arc::new(AtomicUsize::new(0));
    let (tx, rx) = std::sync::mpsc::channel();
    let n = 2_000;
    for i in 0..n {
        let done = done.clone();
        let tx = tx.clone();
        wal.append(
            vec![rec(0, i, b"x")],
            Box::new(move |r| {
                r.unwrap();
                if done.fetch_add(1, Ordering::Relaxed) + 1 == n as usize {
                    tx.send(()).unwrap();
                }
            }),
        );
    }
    rx.recv().unwrap();
    let syncs = syncs.load(Ordering::Relaxed);
    assert!(
        syncs < n as usize,
        "{syncs} syncs for {n} appends: no group commit"
    );
}

/// Lazy records (the committed-index hint) cost no sync of their own: they ride in the next frame an
/// append waits for, in order, and whatever is left is written when the log closes.
#[test]
fn lazy_records_ride_with_the_next_append_and_are_written_at_close() {
    let dir = tempfile::tempdir().unwrap();
    let syncs = Arc::new(AtomicUsize::new(0));
    let s2 = syncs.clone();
    let options = || WalOptions {
        observer: Some(Arc::new({
            let s2 = s2.clone();
            move |_| {
                s2.fetch_add(1, Ordering::Relaxed);
            }
        })),
        ..WalOptions::default()
    };
    let (wal, _) = Wal::open(dir.path(), options()).unwrap();
    wal.append_lazy(vec![rec(1, 1, b"hint 1")]);
    wal.append_lazy(vec![rec(1, 2, b"hint 2")]);
    wal.append_blocking(vec![rec(0, 1, b"entry")]).unwrap();
    assert_eq!(
        syncs.load(Ordering::Relaxed),
        1,
        "the hints took syncs of their own"
    );
    wal.append_lazy(vec![rec(1, 3, b"hint 3")]);
    wal.close();
    assert_eq!(
        syncs.load(Ordering::Relaxed),
        2,
        "close writes the last hint"
    );
    drop(wal);
    let (_wal, recovered) = Wal::open(dir.path(), options()).unwrap();
    let payloads: Vec<&[u8]> = recovered.records.iter().map(|r| &r.payload[..]).collect();
    assert_eq!(
        payloads,
        [&b"hint 1"[..], b"hint 2", b"entry", b"hint 3"],
        "in the order they were queued"
    );
}

/// Lazy records wait beside the queue, not in it, and still land in call order among the appends,
/// however the writer batches: here appends queue up behind each other's syncs, and each batch stops
/// at a tiny byte limit, so a hint is often queued after an append the current batch did not take.
#[test]
fn lazy_records_keep_their_place_among_appends_whatever_the_batches() {
    let dir = tempfile::tempdir().unwrap();
    let options = || WalOptions {
        max_batch_bytes: 64,
        ..WalOptions::default()
    };
    let (wal, _) = Wal::open(dir.path(), options()).unwrap();
    let mut expected = Vec::new();
    let (done_tx, done_rx) = std::sync::mpsc::channel();
    let mut appends = 0;
    for i in 0..300u64 {
        let payload = format!("record {i}").into_bytes();
        expected.push(payload.clone());
        if i % 3 == 1 {
            wal.append_lazy(vec![rec(1, i, &payload)]);
        } else {
            let tx = done_tx.clone();
            wal.append(
                vec![rec(0, i, &payload)],
                Box::new(move |r| drop(tx.send(r))),
            );
            appends += 1;
        }
    }
    for _ in 0..appends {
        done_rx.recv().unwrap().unwrap();
    }
    wal.close();
    drop(wal);
    let (_wal, recovered) = Wal::open(dir.path(), options()).unwrap();
    let payloads: Vec<Vec<u8>> = recovered
        .records
        .iter()
        .map(|r| r.payload.to_vec())
        .collect();
    assert_eq!(
        payloads, expected,
        "records not in the order they were queued"
    );
}

/// An inline append on a log nobody is writing is written, synced and completed on the caller's
/// thread before the call returns: the writer thread takes no part (its hand-off is what inline saves).
#[test]
fn an_inline_append_on_an_idle_log_completes_before_it_returns() {
    let dir = tempfile::tempdir().unwrap();
    let syncs = Arc::new(AtomicUsize::new(0));
    let s2 = syncs.clone();
    let options = WalOptions {
        observer: Some(Arc::new(move |_| {
            s2.fetch_add(1, Ordering::Relaxed);
        })),
        ..WalOptions::default()
    };
    let (wal, _) = Wal::open(dir.path(), options).unwrap();
    let caller = std::thread::current().id();
    for i in 1..=50u64 {
        let ran = Arc::new(std::sync::Mutex::new(None));
        let r2 = ran.clone();
        wal.append_inline(
            vec![rec(0, i, &i.to_le_bytes())],
            Box::new(move |r| {
                r.unwrap();
                *r2.lock().unwrap() = Some(std::thread::current().id());
            }),
        );
        assert_eq!(
            *ran.lock().unwrap(),
            Some(caller),
            "append {i} was not completed on the caller's thread before it returned"
        );
        assert_eq!(
            syncs.load(Ordering::Relaxed),
            i as usize,
            "one sync per append"
        );
    }
    drop(wal);
    let (_wal, recovered) = Wal::open(dir.path(), WalOptions::default()).unwrap();
    let indexes: Vec<u64> = recovered.records.iter().map(|r| r.index).collect();
    assert_eq!(indexes, (1..=50).collect::<Vec<_>>());
}

/// Inline appends, queued appends and lazy records from several threads at once, with batches cut
/// at a tiny byte limit: each thread's records come back in the order it made its calls (an inline
/// append that finds a commit under way is queued behind it; one that finds none writes everything
/// queued before it first), and every append completes once.
#[test]
fn inline_and_queued_appends_from_many_threads_keep_each_threads_order() {
    let dir = tempfile::tempdir().unwrap();
    let options = || WalOptions {
        max_batch_bytes: 64,
        ..WalOptions::default()
    };
    let (wal, _) = Wal::open(dir.path(), options()).unwrap();
    let wal = Arc::new(wal);
    let threads = 4u32;
    let per_thread = 300u64;
    let completed = Arc::new(AtomicUsize::new(0));
    let appends = Arc::new(AtomicUsize::new(0));
    std::thread::scope(|scope| {
        for t in 0..threads {
            let (wal, completed, appends) = (wal.clone(), completed.clone(), appends.clone());
            scope.spawn(move || {
                let mut rng = rand::rngs::StdRng::seed_from_u64(u64::from(t));
                let (tx, rx) = std::sync::mpsc::channel();
                let mut mine = 0;
                for i in 0..per_thread {
                    let payload = format!("thread {t} record {i}").into_bytes();
                    let tx = tx.clone();
                    let completed = completed.clone();
                    let done: holdfast_wal::Done = Box::new(move |r| {
                        r.unwrap();
                        completed.fetch_add(1, Ordering::Relaxed);
                        let _ = tx.send(());
                    });
                    match rng.random_range(0..3) {
                        0 => {
                            wal.append_lazy(vec![rec(t, i, &payload)]);
                            continue;
                        }
                        1 => wal.append(vec![rec(t, i, &payload)], done),
                        _ => wal.append_inline(vec![rec(t, i, &payload)], done),
                    }
                    mine += 1;
                }
                appends.fetch_add(mine, Ordering::Relaxed);
                for _ in 0..mine {
                    rx.recv().unwrap();
                }
            });
        }
    });
    assert_eq!(
        completed.load(Ordering::Relaxed),
        appends.load(Ordering::Relaxed),
        "an append completed twice or not at all"
    );
    let (by_writer, inline) = wal.commits();
    assert!(
        inline > 0,
        "no commit was made inline ({by_writer} by the writer thread)"
    );
    wal.close();
    drop(wal);
    let (_wal, recovered) = Wal::open(dir.path(), options()).unwrap();
    for t in 0..threads {
        let got: Vec<u64> = recovered
            .records
            .iter()
            .filter(|r| r.group == t)
            .map(|r| r.index)
            .collect();
        assert_eq!(
            got,
            (0..per_thread).collect::<Vec<_>>(),
            "thread {t}'s records out of order or missing"
        );
    }
}

/// A failed sync in an inline commit stops the log as one on the writer thread does: that append
/// fails, and every later one, inline or queued, fails without another sync.
#[test]
fn a_failed_inline_sync_stops_the_log_for_good() {
    let dir = tempfile::tempdir().unwrap();
    let calls = Arc::new(AtomicUsize::new(0));
    let c2 = calls.clone();
    let options = WalOptions {
        sync_fault: Some(Arc::new(move || {
            if c2.fetch_add(1, Ordering::Relaxed) >= 2 {
                Err(std::io::Error::other("injected EIO"))
            } else {
                Ok(())
            }
        })),
        ..WalOptions::default()
    };
    let (wal, _) = Wal::open(dir.path(), options).unwrap();
    let inline = |i: u64| {
        let result = Arc::new(std::sync::Mutex::new(None));
        let r2 = result.clone();
        wal.append_inline(
            vec![rec(0, i, b"x")],
            Box::new(move |r| *r2.lock().unwrap() = Some(r)),
        );
        let r = result.lock().unwrap().take();
        r.expect("completed before returning")
    };
    inline(1).unwrap();
    inline(2).unwrap();
    let err = inline(3).unwrap_err();
    assert!(err.to_string().contains("injected EIO"), "{err}");
    assert!(matches!(inline(4).unwrap_err(), WalError::Poisoned(_)));
    let err = wal.append_blocking(vec![rec(0, 5, b"after")]).unwrap_err();
    assert!(matches!(err, WalError::Poisoned(_)), "{err}");
    assert_eq!(calls.load(Ordering::Relaxed), 3, "a sync was retried");
}

/// A close that comes while an inline commit is syncing waits for it, and then ends: the writer
/// thread, which waits while anyone commits, is woken when the inline commit is over.
#[test]
fn a_close_during_an_inline_commit_ends_once_the_commit_does() {
    let dir = tempfile::tempdir().unwrap();
    let (entered_tx, entered_rx) = std::sync::mpsc::channel();
    let (go_tx, go_rx) = std::sync::mpsc::channel::<()>();
    let go_rx = std::sync::Mutex::new(go_rx);
    let armed = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let a2 = armed.clone();
    let options = WalOptions {
        sync_fault: Some(Arc::new(move || {
            if a2.swap(false, Ordering::SeqCst) {
                entered_tx.send(()).unwrap();
                go_rx.lock().unwrap().recv().unwrap();
            }
            Ok(())
        })),
        ..WalOptions::default()
    };
    let (wal, _) = Wal::open(dir.path(), options).unwrap();
    let wal = Arc::new(wal);
    armed.store(true, Ordering::SeqCst);
    let w = wal.clone();
    let appender = std::thread::spawn(move || {
        w.append_inline(vec![rec(0, 1, b"synced inline")], Box::new(|r| r.unwrap()))
    });
    entered_rx.recv().unwrap();
    let (closed_tx, closed_rx) = std::sync::mpsc::channel();
    let w = wal.clone();
    std::thread::spawn(move || {
        w.close();
        closed_tx.send(()).unwrap();
    });
    while !wal.closing() {
        std::thread::yield_now();
    }
    go_tx.send(()).unwrap();
    appender.join().unwrap();
    closed_rx
        .recv_timeout(std::time::Duration::from_secs(30))
        .expect("close never returned after the inline commit it waited for");
    drop(wal);
    let (_wal, recovered) = Wal::open(dir.path(), WalOptions::default()).unwrap();
    assert_eq!(recovered.records.len(), 1);
}

/// After close, an inline append fails as a queued one does, and is not written.
#[test]
fn an_inline_append_after_close_fails() {
    let dir = tempfile::tempdir().unwrap();
    let (wal, _) = Wal::open(dir.path(), WalOptions::default()).unwrap();
    wal.append_inline(vec![rec(0, 1, b"before")], Box::new(|r| r.unwrap()));
    wal.close();
    let result = Arc::new(std::sync::Mutex::new(None));
    let r2 = result.clone();
    wal.append_inline(
        vec![rec(0, 2, b"after")],
        Box::new(move |r| *r2.lock().unwrap() = Some(r)),
    );
    let r = result.lock().unwrap().take().expect("completed at once");
    assert!(matches!(r, Err(WalError::Closed)), "{r:?}");
    drop(wal);
    let (_wal, recovered) = Wal::open(dir.path(), WalOptions::default()).unwrap();
    let indexes: Vec<u64> = recovered.records.iter().map(|r| r.index).collect();
    assert_eq!(indexes, [1]);
}

/// Writes `batches` frames, one per batch, closes the log and returns the file offset where each frame
/// ends (the file's length: a log closed cleanly cuts the zeros ahead of its frames).
fn write_batches(dir: &Path, batches: usize) -> (Vec<u64>, Vec<Vec<Record>>) {
    let (wal, _) = Wal::open(dir, WalOptions::default()).unwrap();
    let seg = only_segment(dir);
    let mut all = Vec::new();
    let mut index = 0;
    for b in 0..batches {
        let records: Vec<Record> = (0..(b % 4 + 1))
            .map(|_| {
                index += 1;
                rec(0, index, &vec![b as u8; 10 + (index as usize * 7) % 50])
            })
            .collect();
        wal.append_blocking(records.clone()).unwrap();
        all.push(records);
    }
    drop(wal);
    let ends = frame_ends(&seg);
    assert_eq!(ends.len(), batches);
    assert_eq!(std::fs::metadata(&seg).unwrap().len(), ends[batches - 1]);
    (ends, all)
}

fn copy_dir(from: &Path, to: &Path) {
    for e in std::fs::read_dir(from).unwrap() {
        let e = e.unwrap();
        std::fs::copy(e.path(), to.join(e.file_name())).unwrap();
    }
}

/// A crash cuts the log anywhere; the zeros the writer put ahead of its frames may follow the cut or not
/// (alternate rounds): either way recovery keeps exactly the whole frames before the cut, calls a cut
/// inside a frame torn, and one at a frame's end clean. (Zeros after a cut give back whatever zero
/// bytes the cut took, such as the end of the header: the cut is then where those end.)
#[test]
fn cut_at_random_offsets_keeps_exactly_the_whole_batches() {
    let dir = tempfile::tempdir().unwrap();
    let (ends, batches) = write_batches(dir.path(), 40);
    let seg = only_segment(dir.path());
    let name = seg.file_name().unwrap().to_owned();
    let len = *ends.last().unwrap();
    let original = std::fs::read(&seg).unwrap();
    let mut rng = rand::rngs::StdRng::seed_from_u64(7);
    for round in 0..500 {
        let mut cut = rng.random_range(0..len);
        let work = tempfile::tempdir().unwrap();
        copy_dir(dir.path(), work.path());
        let file = std::fs::OpenOptions::new()
            .write(true)
            .open(work.path().join(&name))
            .unwrap();
        file.set_len(cut).unwrap();
        // (Not after a cut inside the header, which is written and synced before any frame: zeros
        // there give back a header whose version word reads 0, which no crash leaves.)
        if round % 2 == 1 && cut >= 16 {
            let zeros = rng.random_range(1..=holdfast_wal::ZERO_AHEAD_BYTES);
            file.set_len(cut + zeros).unwrap();
            let given_back = original[cut as usize..]
                .iter()
                .take_while(|&&b| b == 0)
                .count() as u64;
            cut += given_back.min(zeros);
        }
        drop(file);
        let (_wal, recovered) = Wal::open(work.path(), WalOptions::default())
            .unwrap_or_else(|e| panic!("round {round}: cut at {cut} refused: {e}"));
        let whole = ends.iter().filter(|&&end| end <= cut).count();
        let expected: Vec<Record> = batches[..whole].iter().flatten().cloned().collect();
        assert_eq!(recovered.records, expected, "round {round}: cut at {cut}");
        let clean_cut = cut == 16 || ends.contains(&cut);
        assert_eq!(
            recovered.torn.is_some(),
            !clean_cut,
            "round {round}: cut at {cut}"
        );
        // The torn bytes are kept beside the segment.
        if let Some(t) = &recovered.torn {
            assert_eq!(std::fs::metadata(&t.saved_to).unwrap().len(), t.bytes);
        }
    }
}

#[test]
fn flipped_bytes_are_torn_in_the_last_frame_and_corrupt_before_it() {
    let dir = tempfile::tempdir().unwrap();
    let (ends, batches) = write_batches(dir.path(), 30);
    let seg = only_segment(dir.path());
    let name = seg.file_name().unwrap().to_owned();
    let len = *ends.last().unwrap();
    let last_start = ends[ends.len() - 2];
    let mut rng = rand::rngs::StdRng::seed_from_u64(11);
    for round in 0..500 {
        let at = rng.random_range(0..len);
        let work = tempfile::tempdir().unwrap();
        copy_dir(dir.path(), work.path());
        let path = work.path().join(&name);
        let mut bytes = std::fs::read(&path).unwrap();
        bytes[at as usize] ^= 1 << rng.random_range(0..8);
        std::fs::write(&path, &bytes).unwrap();
        match Wal::open(work.path(), WalOptions::default()) {
            Ok((_wal, recovered)) => {
                assert!(
                    at >= last_start,
                    "round {round}: flip at {at} before the last frame was accepted"
                );
                let expected: Vec<Record> = batches[..batches.len() - 1]
                    .iter()
                    .flatten()
                    .cloned()
                    .collect();
                assert_eq!(recovered.records, expected);
            }
            Err(WalError::Corrupt {
                path: p,
                offset,
                reason,
            }) => {
                assert!(
                    at < last_start,
                    "round {round}: flip at {at} in the last frame refused: {reason}"
                );
                assert_eq!(p, path);
                assert!(
                    offset <= at,
                    "corruption reported at {offset}, flip was at {at}"
                );
            }
            Err(e) => panic!("round {round}: unexpected {e}"),
        }
    }
}

#[test]
fn corruption_in_an_older_segment_refuses_to_start() {
    let dir = tempfile::tempdir().unwrap();
    {
        let (wal, _) = Wal::open(dir.path(), WalOptions::default()).unwrap();
        wal.append_blocking(vec![rec(0, 1, b"hello world")])
            .unwrap();
    }
    // A second open starts a second segment, so the first is no longer the tail.
    drop(Wal::open(dir.path(), WalOptions::default()).unwrap());
    let first = Wal::segment_paths(dir.path()).unwrap()[0].clone();
    let mut bytes = std::fs::read(&first).unwrap();
    let n = bytes.len();
    bytes[n - 1] ^= 0xff;
    std::fs::write(&first, &bytes).unwrap();
    let (err, msg) = refused(dir.path());
    assert!(matches!(err, WalError::Corrupt { .. }), "{msg}");
    assert_names(&msg, &first);
}

#[test]
fn a_failed_fsync_stops_the_writer_for_good() {
    let dir = tempfile::tempdir().unwrap();
    let calls = Arc::new(AtomicUsize::new(0));
    let c2 = calls.clone();
    let options = WalOptions {
        sync_fault: Some(Arc::new(move || {
            if c2.fetch_add(1, Ordering::Relaxed) >= 3 {
                Err(std::io::Error::other("injected EIO"))
            } else {
                Ok(())
            }
        })),
        ..WalOptions::default()
    };
    let (wal, _) = Wal::open(dir.path(), options).unwrap();
    for i in 1..=3 {
        wal.append_blocking(vec![rec(0, i, b"ok")]).unwrap();
    }
    let err = wal.append_blocking(vec![rec(0, 4, b"fails")]).unwrap_err();
    assert!(err.to_string().contains("injected EIO"), "{err}");
    // No retry: later appends fail without syncing again.
    let err = wal.append_blocking(vec![rec(0, 5, b"after")]).unwrap_err();
    assert!(matches!(err, WalError::Poisoned(_)), "{err}");
    assert_eq!(calls.load(Ordering::Relaxed), 4);
}

/// An append too big for the frames recovery reads back is refused whole, before anything is written:
/// acknowledged, it could not be recovered.
#[test]
fn oversized_appends_are_refused_whole() {
    let dir = tempfile::tempdir().unwrap();
    let (wal, _) = Wal::open(dir.path(), WalOptions::default()).unwrap();
    let most = vec![0u8; holdfast_wal::MAX_RECORD_BYTES];
    let records = (0..=(holdfast_wal::MAX_APPEND_BYTES / most.len()) as u64)
        .map(|i| rec(0, i + 1, &most))
        .collect::<Vec<_>>();
    let err = wal.append_blocking(records).unwrap_err();
    assert!(
        matches!(err, WalError::AppendTooLarge { len } if len > holdfast_wal::MAX_APPEND_BYTES),
        "{err}"
    );
    // Just under the limit is written and comes back.
    let records = (0..(holdfast_wal::MAX_APPEND_BYTES / (most.len() + 64)) as u64)
        .map(|i| rec(0, i + 1, &most))
        .collect::<Vec<_>>();
    let n = records.len();
    wal.append_blocking(records).unwrap();
    drop(wal);
    let (_wal, recovered) = Wal::open(dir.path(), WalOptions::default()).unwrap();
    assert_eq!(recovered.records.len(), n);
}

#[test]
fn oversized_records_are_refused_whole() {
    let dir = tempfile::tempdir().unwrap();
    let (wal, _) = Wal::open(dir.path(), WalOptions::default()).unwrap();
    let big = vec![0u8; holdfast_wal::MAX_RECORD_BYTES + 1];
    let err = wal
        .append_blocking(vec![rec(0, 1, b"small"), rec(0, 2, &big)])
        .unwrap_err();
    assert!(matches!(err, WalError::RecordTooLarge { .. }));
    drop(wal);
    let (_wal, recovered) = Wal::open(dir.path(), WalOptions::default()).unwrap();
    assert!(recovered.records.is_empty());
}

#[test]
fn rotation_keeps_sticky_records_and_release_deletes_old_segments() {
    let dir = tempfile::tempdir().unwrap();
    let options = WalOptions {
        segment_bytes: 4096,
        ..WalOptions::default()
    };
    let (wal, _) = Wal::open(dir.path(), options.clone()).unwrap();
    let vote = Record {
        group: 0,
        kind: 9,
        sticky: true,
        index: 0,
        payload: b"vote-term-3".to_vec(),
    };
    wal.append_blocking(vec![vote.clone()]).unwrap();
    for i in 1..=200u64 {
        wal.append_blocking(vec![rec(0, i, &[7u8; 100])]).unwrap();
    }
    let before = Wal::segment_paths(dir.path()).unwrap().len();
    assert!(before > 3, "expected rotation, got {before} segments");
    wal.release(0, 150);
    // A release is processed by the writer in order, so one more durable append means it is done.
    wal.append_blocking(vec![rec(0, 201, b"x")]).unwrap();
    let after = Wal::segment_paths(dir.path()).unwrap().len();
    assert!(
        after < before,
        "release deleted nothing ({before} -> {after})"
    );
    drop(wal);
    let (_wal, recovered) = Wal::open(dir.path(), options).unwrap();
    assert!(
        recovered.records.contains(&vote),
        "the vote survived deletion of its segment"
    );
    let indexes: Vec<u64> = recovered
        .records
        .iter()
        .filter(|r| !r.sticky)
        .map(|r| r.index)
        .collect();
    assert!(
        indexes.first().unwrap() <= &151,
        "entries after the release point are kept: {:?}",
        &indexes[..3]
    );
    assert_eq!(*indexes.last().unwrap(), 201);
    let mut sorted = indexes.clone();
    sorted.dedup();
    assert_eq!(sorted, indexes);
}

/// A group that wrote once and never releases pins the oldest segment: the WAL names it, and once it
/// releases, the segments go.
#[test]
fn a_group_that_never_releases_is_named_as_pinning_the_oldest_segment() {
    let dir = tempfile::tempdir().unwrap();
    let options = WalOptions {
        segment_bytes: 4096,
        ..WalOptions::default()
    };
    let (wal, _) = Wal::open(dir.path(), options).unwrap();
    wal.append_blocking(vec![rec(1, 1, b"cold")]).unwrap();
    assert!(wal.pinning_groups().is_empty(), "no closed segment yet");
    for i in 1..=200u64 {
        wal.append_blocking(vec![rec(0, i, &[7u8; 100])]).unwrap();
    }
    wal.release(0, 200);
    wal.append_blocking(vec![rec(0, 201, b"x")]).unwrap();
    let segments = Wal::segment_paths(dir.path()).unwrap().len();
    assert!(
        segments > 3,
        "group 1 pins the first segment, so nothing goes: {segments}"
    );
    assert_eq!(wal.pinning_groups(), vec![1]);
    wal.release(1, 1);
    wal.append_blocking(vec![rec(0, 202, b"y")]).unwrap();
    assert!(wal.pinning_groups().is_empty());
    let after = Wal::segment_paths(dir.path()).unwrap().len();
    assert!(after <= 2, "released segments stay: {segments} -> {after}");
}

/// The segment after the active one is created ahead of time, so the commit that fills a segment
/// only clears the next one's state word instead of creating a file and syncing it and its directory.
#[test]
fn rotation_starts_the_pre_created_segment() {
    let dir = tempfile::tempdir().unwrap();
    let options = WalOptions {
        segment_bytes: 4096,
        ..WalOptions::default()
    };
    let (wal, _) = Wal::open(dir.path(), options).unwrap();
    for i in 1..=200u64 {
        wal.append_blocking(vec![rec(0, i, &[7u8; 100])]).unwrap();
    }
    let (pre_created, inline) = wal.rotations();
    assert!(pre_created > 3, "expected rotations, got {pre_created}");
    assert_eq!(
        inline, 0,
        "a rotation had to create its segment ({pre_created} did not)"
    );
    drop(wal);
    let in_use = Wal::segment_paths(dir.path()).unwrap();
    let standby = standby_of(dir.path(), &in_use);
    assert_eq!(std::fs::metadata(&standby).unwrap().len(), 16);
}

/// An inline commit that starts the pre-created segment leaves making the next one to the writer
/// thread (two syncs and a file are not the caller's to wait for): it is there before the segment
/// in use fills, so no rotation has to create its segment inside a commit.
#[test]
fn after_an_inline_rotation_the_writer_thread_pre_creates_the_next_segment() {
    let dir = tempfile::tempdir().unwrap();
    let options = WalOptions {
        segment_bytes: 4096,
        ..WalOptions::default()
    };
    let (wal, _) = Wal::open(dir.path(), options).unwrap();
    let mut seen = 0;
    let (done_tx, done_rx) = std::sync::mpsc::channel();
    for i in 1..=200u64 {
        // Inline unless the writer thread is still syncing the segment it pre-created (then it
        // is queued, and waited for here, so that each frame holds one append).
        let tx = done_tx.clone();
        wal.append_inline(
            vec![rec(0, i, &[7u8; 100])],
            Box::new(move |r| drop(tx.send(r))),
        );
        done_rx.recv().unwrap().unwrap();
        let (pre_created, _) = wal.rotations();
        if pre_created > seen {
            seen = pre_created;
            wait_for_standby(dir.path());
        }
    }
    assert!(wal.commits().1 > 100, "few appends were made inline");
    let (pre_created, inline) = wal.rotations();
    assert!(
        pre_created > 3,
        "expected rotations, got {pre_created} ({inline} created inline)"
    );
    assert_eq!(
        inline, 0,
        "a rotation had to create its segment ({pre_created} did not)"
    );
}

fn file_len(path: &Path) -> u64 {
    std::fs::metadata(path).unwrap().len()
}

/// The writer fills the segment in use with zeros ahead of its frames (so that most syncs do not grow
/// the file), never past the segment's size, and cuts them off, durably, before it starts the next: a
/// closed segment ends at its last frame. An image of the log taken while it runs (a crash) ends in
/// zeros, which recovery reads as the clean end: every record back, nothing called torn, the zeros cut.
#[test]
fn zeros_ahead_of_the_frames_are_only_in_the_segment_in_use_and_end_it_cleanly() {
    let dir = tempfile::tempdir().unwrap();
    let options = WalOptions {
        segment_bytes: 64 << 10,
        ..WalOptions::default()
    };
    let (wal, _) = Wal::open(dir.path(), options.clone()).unwrap();
    let mut written = 0u64;
    let mut append = |wal: &Wal| {
        written += 1;
        // 131-byte frames: a segment's frames do not end at its size by chance.
        wal.append_blocking(vec![rec(0, written, &[7u8; 101])])
            .unwrap();
    };
    for _ in 0..1000 {
        append(&wal);
    }
    // Once the writer has pre-created the next segment it is idle, so a copy of the directory is what
    // a crash would leave.
    let standby = wait_for_standby(dir.path());
    let segments = Wal::segment_paths(dir.path()).unwrap();
    assert!(segments.len() >= 2, "{segments:?}");
    let (active, closed) = segments.split_last().unwrap();
    for path in closed {
        let ends = frame_ends(path);
        assert_eq!(file_len(path), *ends.last().unwrap(), "{path:?} is closed");
    }
    let end = *frame_ends(active).last().unwrap();
    assert!(file_len(active) > end, "no zeros ahead in {active:?}");
    assert!(file_len(active) <= options.segment_bytes);
    let bytes = std::fs::read(active).unwrap();
    assert!(bytes[end as usize..].iter().all(|&b| b == 0));

    // A crash while the writer idles; and two while it was creating the next segment, its file there
    // but not its header (empty, as ext4 leaves it, or zeros): the segment in use is still the one
    // before it, and its zeros its clean end, not damage.
    for header in [None, Some(&[][..]), Some(&[0u8; 16][..])] {
        let crashed = tempfile::tempdir().unwrap();
        copy_dir(dir.path(), crashed.path());
        if let Some(header) = header {
            std::fs::write(crashed.path().join(standby.file_name().unwrap()), header).unwrap();
        }
        let (_reopened, recovered) = Wal::open(crashed.path(), options.clone())
            .unwrap_or_else(|e| panic!("header {header:?}: {e}"));
        let indexes: Vec<u64> = recovered.records.iter().map(|r| r.index).collect();
        assert_eq!(indexes, (1..=written).collect::<Vec<_>>());
        assert_eq!(
            file_len(&crashed.path().join(active.file_name().unwrap())),
            end
        );
        match header {
            None => assert!(recovered.torn.is_none(), "{:?}", recovered.torn),
            // The file without a header is removed, as a torn one.
            Some(_) => assert_eq!(recovered.torn.expect("the empty file").offset, 0),
        }
    }

    drop(wal);
    assert_eq!(file_len(active), end, "closed cleanly: the zeros are cut");
}

/// A crash while the next segment's file was being created leaves it without its header. That happens
/// between two commits (or in a rotation, after the segment was cut to its last frame), so the segment
/// before it may end in zeros but was otherwise complete: zeros there are its clean end, while a bad
/// frame there is damage, refused, not cut as a tear.
#[test]
fn before_a_file_that_never_got_its_header_zeros_end_the_segment_and_a_bad_frame_is_corruption() {
    let headers: [&[u8]; 2] = [b"", &[0u8; 16]];
    for header in headers {
        for (tail, accepted) in [(vec![0u8; 4096], true), (torn_frame(), false)] {
            let dir = tempfile::tempdir().unwrap();
            let (first, standby) = closed_log_with_standby(dir.path());
            std::fs::write(&standby, header).unwrap();
            let mut bytes = std::fs::read(&first).unwrap();
            let end = bytes.len() as u64;
            bytes.extend_from_slice(&tail);
            std::fs::write(&first, &bytes).unwrap();
            let files = |dir: &Path| {
                let mut names: Vec<_> = std::fs::read_dir(dir)
                    .unwrap()
                    .map(|e| e.unwrap().file_name())
                    .collect();
                names.sort();
                names
            };
            let before = files(dir.path());
            match Wal::open(dir.path(), WalOptions::default()) {
                Ok((_wal, recovered)) => {
                    assert!(accepted, "{header:?}: a bad frame was cut as a tear");
                    assert_eq!(recovered.records.len(), 3);
                    assert_eq!(file_len(&first), end);
                }
                Err(WalError::Corrupt { path, offset, .. }) => {
                    assert!(!accepted, "{header:?}: zeros were refused");
                    assert_eq!((path, offset), (first.clone(), end));
                    // Refused before anything on disk was touched: a restart refuses the same way.
                    assert_eq!(std::fs::read(&first).unwrap(), bytes);
                    assert_eq!(std::fs::read(&standby).unwrap(), header);
                    assert_eq!(files(dir.path()), before);
                }
                Err(e) => panic!("{header:?}: {e}"),
            }
        }
    }
}

/// A frame's first bytes, as a write torn by a crash leaves them: a plausible header and a few bytes.
fn torn_frame() -> Vec<u8> {
    let mut torn = b"HFWF".to_vec();
    torn.extend_from_slice(&200u32.to_le_bytes());
    torn.extend_from_slice(&[0xab; 20]);
    torn
}

/// Only the segment in use may end in zeros: after a closed segment's last frame they are damage (a
/// file system that lost or zeroed acknowledged frames), and the log refuses to start, naming the file.
#[test]
fn zeros_at_the_end_of_a_closed_segment_are_corruption() {
    let dir = tempfile::tempdir().unwrap();
    let (first, _) = closed_log_with_standby(dir.path());
    let (wal, _) = Wal::open(dir.path(), WalOptions::default()).unwrap();
    wal.append_blocking(vec![rec(0, 4, b"next segment")])
        .unwrap();
    drop(wal);
    assert_eq!(Wal::segment_paths(dir.path()).unwrap().len(), 2);
    let len = file_len(&first);
    std::fs::OpenOptions::new()
        .write(true)
        .open(&first)
        .unwrap()
        .set_len(len + 4096)
        .unwrap();
    let (err, msg) = refused(dir.path());
    match err {
        WalError::Corrupt { offset, .. } => assert_eq!(offset, len, "{msg}"),
        other => panic!("{other}"),
    }
    assert_names(&msg, &first);
}

/// Every segment file in `dir` (`*.log`, the standby included), oldest first.
fn segment_files(dir: &Path) -> Vec<std::path::PathBuf> {
    let mut all: Vec<_> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "log"))
        .collect();
    all.sort();
    all
}

/// Waits (10 s at most) until the writer has pre-created the next segment: the directory's last file, a
/// 16-byte header marked standby. The writer does it after a commit when nothing is queued, and no call
/// returns when it is done, so this looks every 5 ms.
fn wait_for_standby(dir: &Path) -> std::path::PathBuf {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    loop {
        let all = segment_files(dir);
        if let Some(last) = all.last() {
            let bytes = std::fs::read(last).unwrap_or_default();
            if bytes.len() == 16 && &bytes[12..16] == b"STBY" {
                return last.clone();
            }
        }
        assert!(
            std::time::Instant::now() < deadline,
            "no standby pre-created in {dir:?}: {all:?}"
        );
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
}

/// The one segment file that `segment_paths` leaves out: the pre-created standby.
fn standby_of(dir: &Path, in_use: &[std::path::PathBuf]) -> std::path::PathBuf {
    let mut all = segment_files(dir);
    assert_eq!(all.len(), in_use.len() + 1, "{all:?}");
    let standby = all.pop().unwrap();
    assert_eq!(&all[..], in_use, "the standby is the last file");
    let bytes = std::fs::read(&standby).unwrap();
    assert_eq!(&bytes[12..16], b"STBY", "state word of {standby:?}");
    standby
}

/// Three batches written and the log closed: one segment in use and an empty standby after it.
fn closed_log_with_standby(dir: &Path) -> (std::path::PathBuf, std::path::PathBuf) {
    let (wal, _) = Wal::open(dir, WalOptions::default()).unwrap();
    for i in 1..=3u64 {
        wal.append_blocking(vec![rec(0, i, b"batch")]).unwrap();
    }
    drop(wal);
    let in_use = only_segment(dir);
    let standby = standby_of(dir, std::slice::from_ref(&in_use));
    (in_use, standby)
}

#[test]
fn a_restart_puts_the_standby_in_use_and_pre_creates_another() {
    let dir = tempfile::tempdir().unwrap();
    let (first, standby) = closed_log_with_standby(dir.path());
    let (wal, recovered) = Wal::open(dir.path(), WalOptions::default()).unwrap();
    assert_eq!(recovered.records.len(), 3);
    assert!(recovered.torn.is_none());
    wal.append_blocking(vec![rec(0, 4, b"after")]).unwrap();
    drop(wal);
    let in_use = Wal::segment_paths(dir.path()).unwrap();
    assert_eq!(
        in_use,
        vec![first, standby.clone()],
        "the standby is in use"
    );
    assert_eq!(&std::fs::read(&standby).unwrap()[12..16], &[0; 4]);
    standby_of(dir.path(), &in_use);
    let (_wal, recovered) = Wal::open(dir.path(), WalOptions::default()).unwrap();
    let indexes: Vec<u64> = recovered.records.iter().map(|r| r.index).collect();
    assert_eq!(indexes, vec![1, 2, 3, 4]);
}

/// A crash mid-commit in the active segment: the empty standby after it does not make its torn tail
/// look like damage to an older segment.
#[test]
fn a_torn_tail_before_an_empty_standby_is_cut() {
    let dir = tempfile::tempdir().unwrap();
    let (first, _) = closed_log_with_standby(dir.path());
    let len = std::fs::metadata(&first).unwrap().len();
    std::fs::OpenOptions::new()
        .write(true)
        .open(&first)
        .unwrap()
        .set_len(len - 3)
        .unwrap();
    let (_wal, recovered) = Wal::open(dir.path(), WalOptions::default()).unwrap();
    assert_eq!(recovered.records.len(), 2);
    assert_eq!(recovered.torn.expect("torn").segment, first);
}

/// A crash while a standby was being put in use leaves it marked standby with bytes after its header:
/// they were never synced (the sync that makes them durable also makes the cleared state durable), so
/// they are cut. The segment before it was complete, so damage to its end is corruption.
#[test]
fn a_standby_started_but_never_synced_is_cut_and_the_segment_before_stays_strict() {
    let dir = tempfile::tempdir().unwrap();
    let (first, standby) = closed_log_with_standby(dir.path());
    let frame = {
        let bytes = std::fs::read(&first).unwrap();
        bytes[16..].to_vec()
    };
    let mut started = std::fs::read(&standby).unwrap();
    started.extend_from_slice(&frame);
    std::fs::write(&standby, &started).unwrap();
    let damaged = tempfile::tempdir().unwrap();
    copy_dir(dir.path(), damaged.path());

    let (_wal, recovered) = Wal::open(dir.path(), WalOptions::default()).unwrap();
    assert_eq!(recovered.records.len(), 3, "nothing from the standby");
    let torn = recovered.torn.expect("the standby's bytes are cut");
    assert_eq!((torn.segment, torn.offset), (standby, 16));

    let first = damaged.path().join(first.file_name().unwrap());
    let mut bytes = std::fs::read(&first).unwrap();
    let n = bytes.len();
    bytes[n - 1] ^= 0xff;
    std::fs::write(&first, &bytes).unwrap();
    let (err, msg) = refused(damaged.path());
    assert!(matches!(err, WalError::Corrupt { .. }), "{msg}");
    assert_names(&msg, &first);
}

#[test]
fn a_standby_that_is_not_the_last_segment_or_an_unknown_state_is_corruption() {
    let dir = tempfile::tempdir().unwrap();
    let (first, standby) = closed_log_with_standby(dir.path());
    let later = tempfile::tempdir().unwrap();
    copy_dir(dir.path(), later.path());
    let copy = segment_beside(&later.path().join(first.file_name().unwrap()), 99);
    std::fs::copy(&first, copy).unwrap();
    let (_, msg) = refused(later.path());
    assert!(msg.contains("followed by later segments"), "{msg}");
    assert_names(&msg, &standby);

    let mut bytes = std::fs::read(&first).unwrap();
    bytes[12] = 1;
    std::fs::write(&first, &bytes).unwrap();
    let (_, msg) = refused(dir.path());
    assert!(msg.contains("unknown segment state 0x00000001"), "{msg}");
}

/// Two standbys (a state the writer never makes): the first is not the last file, so it is refused
/// rather than having its bytes cut, even though the segment before an empty standby may be torn.
#[test]
fn two_standbys_are_corruption() {
    let dir = tempfile::tempdir().unwrap();
    let (_, standby) = closed_log_with_standby(dir.path());
    std::fs::copy(&standby, segment_beside(&standby, 99)).unwrap();
    let (_, msg) = refused(dir.path());
    assert!(msg.contains("followed by later segments"), "{msg}");
    assert_names(&msg, &standby);
}

/// A crash right after a segment file was created leaves it empty: it is removed, and the log keeps
/// deleting released segments afterwards (it used to keep the removed file in its list and fail every
/// deletion on it).
#[test]
fn an_empty_segment_file_is_removed_and_deletion_goes_on() {
    let dir = tempfile::tempdir().unwrap();
    let options = WalOptions {
        segment_bytes: 4096,
        ..WalOptions::default()
    };
    {
        let (wal, _) = Wal::open(dir.path(), options.clone()).unwrap();
        for i in 1..=100u64 {
            wal.append_blocking(vec![rec(0, i, &[7u8; 100])]).unwrap();
        }
    }
    // Replace the standby by an empty file, as a crash inside pre-creation can leave it.
    let in_use = Wal::segment_paths(dir.path()).unwrap();
    let standby = standby_of(dir.path(), &in_use);
    std::fs::write(&standby, b"").unwrap();
    let (wal, recovered) = Wal::open(dir.path(), options).unwrap();
    assert_eq!(
        recovered
            .torn
            .expect("the empty file is a torn header")
            .offset,
        0
    );
    for i in 101..=200u64 {
        wal.append_blocking(vec![rec(0, i, &[7u8; 100])]).unwrap();
    }
    let before = Wal::segment_paths(dir.path()).unwrap().len();
    assert!(before > 6, "{before}");
    wal.release(0, 200);
    wal.append_blocking(vec![rec(0, 201, b"x")]).unwrap();
    // The writer may be pre-creating the next segment as the append returns, and a file caught half
    // made looks like a segment in use: stop the writer first (it finishes what it started).
    wal.close();
    let after = Wal::segment_paths(dir.path()).unwrap().len();
    assert_eq!(
        after, 1,
        "segments written after the removed one stay ({before} -> {after})"
    );
}

/// A disk that writes a valid frame to the wrong place (a misdirected write): every byte of the frame
/// is one the log wrote, and its checksum over its body alone still matches, but it belongs elsewhere.
/// The checksum covers the frame's segment and offset, so recovery sees corruption and, since valid
/// frames follow, refuses to start, naming the file and the offset.
#[test]
fn a_valid_frame_written_to_the_wrong_place_is_corruption() {
    let dir = tempfile::tempdir().unwrap();
    let (wal, _) = Wal::open(dir.path(), WalOptions::default()).unwrap();
    let seg = only_segment(dir.path());
    for i in 1..=8u64 {
        wal.append_blocking(vec![rec(0, i, &[i as u8; 40])])
            .unwrap();
    }
    drop(wal);
    let ends: Vec<u64> = std::iter::once(16).chain(frame_ends(&seg)).collect();
    let mut bytes = std::fs::read(&seg).unwrap();
    let frame = |k: usize| ends[k] as usize..ends[k + 1] as usize;
    assert_eq!(frame(2).len(), frame(5).len(), "same-length frames");
    let copy = bytes[frame(2)].to_vec();
    bytes[frame(5)].copy_from_slice(&copy);
    std::fs::write(&seg, &bytes).unwrap();
    let (err, msg) = refused(dir.path());
    match err {
        WalError::Corrupt { offset, .. } => assert_eq!(offset, ends[5], "{msg}"),
        other => panic!("{other}"),
    }
    assert!(msg.contains("checksum"), "{msg}");
    assert_names(&msg, &seg);
}

/// A segment header: magic, version, state.
fn header(version: u32, state: &[u8; 4]) -> Vec<u8> {
    let mut h = b"HFWALSEG".to_vec();
    h.extend_from_slice(&version.to_le_bytes());
    h.extend_from_slice(state);
    h
}

/// A log left by a release that wrote format version 1 (checksums over the body alone): a segment in
/// use and its pre-created standby. This release reads it, takes the standby into use with its whole
/// header rewritten to version 2, and reads both back after a restart.
#[test]
fn a_version_1_log_and_its_standby_are_read_and_continued() {
    use holdfast_wal::format::{frame_crc, Place, SEGMENT_VERSION};
    let encode_record = |r: &Record| {
        let mut body = Vec::new();
        holdfast_wal::format::encode_record(&mut body, r);
        body
    };
    let dir = tempfile::tempdir().unwrap();
    let mut old = header(1, &[0; 4]);
    let records: Vec<Record> = (1..=3u64).map(|i| rec(0, i, b"version one")).collect();
    for r in &records {
        let body = encode_record(r);
        let place = Place {
            seq: 1,
            version: 1,
            offset: old.len() as u64,
        };
        old.extend_from_slice(b"HFWF");
        old.extend_from_slice(&(body.len() as u32).to_le_bytes());
        old.extend_from_slice(&frame_crc(place, &body).to_le_bytes());
        old.extend_from_slice(&body);
    }
    // The same checksum over the body alone: version 1 really is read the old way.
    assert_eq!(
        u32::from_le_bytes(old[24..28].try_into().unwrap()),
        crc32fast::hash(&old[28..28 + encode_record(&records[0]).len()])
    );
    let first = dir.path().join("wal-0000000000000001.log");
    let standby = dir.path().join("wal-0000000000000002.log");
    std::fs::write(&first, &old).unwrap();
    std::fs::write(&standby, header(1, b"STBY")).unwrap();

    let (wal, recovered) = Wal::open(dir.path(), WalOptions::default()).unwrap();
    assert_eq!(recovered.records, records);
    wal.append_blocking(vec![rec(0, 4, b"version two")])
        .unwrap();
    drop(wal);
    let taken = std::fs::read(&standby).unwrap();
    assert_eq!(&taken[..16], &header(SEGMENT_VERSION, &[0; 4])[..]);
    let (_wal, recovered) = Wal::open(dir.path(), WalOptions::default()).unwrap();
    let indexes: Vec<u64> = recovered.records.iter().map(|r| r.index).collect();
    assert_eq!(indexes, vec![1, 2, 3, 4]);
}

/// A segment in a format version this build does not know (a newer release's, say) is refused, naming
/// the file and the version, rather than read by guesswork.
#[test]
fn an_unknown_segment_version_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let (first, _) = closed_log_with_standby(dir.path());
    let mut bytes = std::fs::read(&first).unwrap();
    bytes[8..12].copy_from_slice(&3u32.to_le_bytes());
    std::fs::write(&first, &bytes).unwrap();
    let (err, msg) = refused(dir.path());
    assert!(matches!(err, WalError::Corrupt { offset: 8, .. }), "{msg}");
    assert!(msg.contains("unknown segment format version 3"), "{msg}");
    assert_names(&msg, &first);
}
