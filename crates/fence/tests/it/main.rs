//! Fencing helpers against real resources: the reference store on real files and over gRPC, SQLite, and a
//! real PostgreSQL server started by the test.

mod postgres_server;

use holdfast_fence::service::{serve, FenceClient};
use holdfast_fence::store::FencedStore;
use holdfast_fence::FenceError;
use std::sync::Arc;

/// A shared lock's readers against the store: a reader is refused only after a newer writer, an old
/// writer after any newer reader, and readers never refuse each other; the marks survive a restart.
#[test]
fn the_store_fences_readers_only_against_newer_writers() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("fence.log");
    let store = FencedStore::open(&path).unwrap();
    store.write("k", 5, b"w5").unwrap();
    // Readers granted after that writer (tokens 7 and 6, in any order) both read.
    assert_eq!(
        store.read_shared("k", 7).unwrap().value.as_deref(),
        Some(&b"w5"[..])
    );
    assert_eq!(
        store.read_shared("k", 6).unwrap().value.as_deref(),
        Some(&b"w5"[..])
    );
    // The writer (5) is older than a reader seen: its late write is refused.
    assert!(matches!(
        store.write("k", 5, b"late"),
        Err(FenceError::Stale { seen: 7, .. })
    ));
    // A reader older than the writer is refused.
    assert!(matches!(
        store.read_shared("k", 4),
        Err(FenceError::Stale { seen: 5, .. })
    ));
    // A newer writer: from then on the old readers are refused.
    store.write("k", 8, b"w8").unwrap();
    drop(store);
    let store = FencedStore::open(&path).unwrap();
    let e = store.peek("k").unwrap();
    assert_eq!((e.mark, e.write_mark), (8, 8));
    assert!(matches!(
        store.read_shared("k", 7),
        Err(FenceError::Stale { seen: 8, .. })
    ));
    assert_eq!(
        store.read_shared("k", 9).unwrap().value.as_deref(),
        Some(&b"w8"[..])
    );
    drop(store);
    // A reader's mark survives a restart too: the writer 8 is now older than a reader seen.
    let store = FencedStore::open(&path).unwrap();
    assert_eq!(
        (
            store.peek("k").unwrap().mark,
            store.peek("k").unwrap().write_mark
        ),
        (9, 8)
    );
    assert!(matches!(
        store.write("k", 8, b"late"),
        Err(FenceError::Stale { seen: 9, .. })
    ));
}

/// The same rule on SQLite, through `fenced_rw_transaction`.
#[test]
fn sqlite_fences_readers_only_against_newer_writers() {
    use holdfast_fence::sql::Role::{Reader, Writer};
    use holdfast_fence::sqlite::{fenced_rw_transaction, install};
    let dir = tempfile::tempdir().unwrap();
    let mut conn = rusqlite::Connection::open(dir.path().join("db.sqlite")).unwrap();
    install(&conn).unwrap();
    let ok = |_: &rusqlite::Transaction<'_>| Ok(());
    fenced_rw_transaction(&mut conn, "doc", 5, Writer, ok).unwrap();
    fenced_rw_transaction(&mut conn, "doc", 7, Reader, ok).unwrap();
    fenced_rw_transaction(&mut conn, "doc", 6, Reader, ok).unwrap();
    let err = fenced_rw_transaction(&mut conn, "doc", 5, Writer, ok).unwrap_err();
    assert!(
        matches!(
            err,
            FenceError::Stale {
                token: 5,
                seen: 7,
                ..
            }
        ),
        "{err}"
    );
    let err = fenced_rw_transaction(&mut conn, "doc", 4, Reader, ok).unwrap_err();
    assert!(
        matches!(
            err,
            FenceError::Stale {
                token: 4,
                seen: 5,
                ..
            }
        ),
        "{err}"
    );
    fenced_rw_transaction(&mut conn, "doc", 8, Writer, ok).unwrap();
    let err = fenced_rw_transaction(&mut conn, "doc", 7, Reader, ok).unwrap_err();
    assert!(
        matches!(
            err,
            FenceError::Stale {
                token: 7,
                seen: 8,
                ..
            }
        ),
        "{err}"
    );
    fenced_rw_transaction(&mut conn, "doc", 9, Reader, ok).unwrap();
}

#[test]
fn the_store_refuses_stale_tokens_and_keeps_its_marks_across_restarts() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("fence.log");
    let store = FencedStore::open(&path).unwrap();
    assert_eq!(store.write("k", 5, b"five").unwrap(), 5);
    assert_eq!(
        store.write("k", 5, b"five again").unwrap(),
        5,
        "the same holder may write again"
    );
    assert!(matches!(
        store.write("k", 4, b"late"),
        Err(FenceError::Stale { seen: 5, .. })
    ));
    // A fenced read by a newer holder raises the mark: the old holder can no longer write.
    assert_eq!(
        store.read("k", 7).unwrap().value.as_deref(),
        Some(&b"five again"[..])
    );
    assert!(matches!(
        store.write("k", 5, b"lost update"),
        Err(FenceError::Stale { seen: 7, .. })
    ));
    assert!(matches!(
        store.read("k", 6),
        Err(FenceError::Stale { seen: 7, .. })
    ));
    drop(store);
    let store = FencedStore::open(&path).unwrap();
    let e = store.peek("k").unwrap();
    assert_eq!(
        (e.mark, e.value_token, e.value.as_deref()),
        (7, 5, Some(&b"five again"[..]))
    );
    assert!(matches!(
        store.write("k", 6, b"x"),
        Err(FenceError::Stale { seen: 7, .. })
    ));
}

#[test]
fn a_torn_last_record_is_cut_and_earlier_ones_kept() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("fence.log");
    let store = FencedStore::open(&path).unwrap();
    store.write("a", 1, b"one").unwrap();
    store.write("a", 2, b"two").unwrap();
    drop(store);
    let len = std::fs::metadata(&path).unwrap().len();
    let file = std::fs::OpenOptions::new().write(true).open(&path).unwrap();
    file.set_len(len - 3).unwrap();
    drop(file);
    let store = FencedStore::open(&path).unwrap();
    assert_eq!(store.peek("a").unwrap().value.as_deref(), Some(&b"one"[..]));
    // A corrupt record followed by a valid one is not a torn write: refuse to open.
    store.write("a", 3, b"three").unwrap();
    drop(store);
    let mut bytes = std::fs::read(&path).unwrap();
    bytes[10] ^= 0xff;
    std::fs::write(&path, &bytes).unwrap();
    assert!(matches!(
        FencedStore::open(&path),
        Err(FenceError::Invalid(_))
    ));
}

/// Only a record cut short is a torn write. A whole last record that fails its checksum may have been
/// acknowledged and damaged since: cutting it would lower the mark it raised and let an older holder
/// in, so the store refuses to open and says where. One whose end the crash left unwritten (zeros) is
/// cut.
#[test]
fn a_whole_damaged_last_record_refuses_to_open_and_an_unwritten_end_is_cut() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("fence.log");
    let store = FencedStore::open(&path).unwrap();
    store.write("a", 1, b"one").unwrap();
    let first = std::fs::metadata(&path).unwrap().len() as usize;
    store.write("a", 9, b"nine, which raised the mark").unwrap();
    drop(store);
    let good = std::fs::read(&path).unwrap();

    let mut damaged = good.clone();
    damaged[first + 12] ^= 0x01;
    std::fs::write(&path, &damaged).unwrap();
    match FencedStore::open(&path) {
        Err(FenceError::Invalid(m)) => {
            assert!(
                m.contains(&format!("truncate the file to {first} bytes")),
                "{m}"
            )
        }
        Ok(_) => panic!("a damaged acknowledged record was cut"),
        Err(e) => panic!("{e}"),
    }

    // A length no record can have is damage too, though it "runs past the end of the file".
    let mut long = good.clone();
    long[first..first + 4].copy_from_slice(&0xffff_fff0u32.to_le_bytes());
    std::fs::write(&path, &long).unwrap();
    assert!(matches!(
        FencedStore::open(&path),
        Err(FenceError::Invalid(_))
    ));

    let mut unwritten = good.clone();
    let end = unwritten.len();
    unwritten[end - 10..].fill(0);
    std::fs::write(&path, &unwritten).unwrap();
    let store = FencedStore::open(&path).unwrap();
    assert_eq!(store.peek("a").unwrap().mark, 1);
    assert_eq!(std::fs::metadata(&path).unwrap().len() as usize, first);
}

/// Holdfast's tokens start at 1: a 0 (a caller that lost its token) is refused, not taken as a first
/// token on a key never written.
#[test]
fn token_0_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let store = FencedStore::open(&dir.path().join("fence.log")).unwrap();
    assert!(matches!(
        store.write("k", 0, b"x"),
        Err(FenceError::Invalid(_))
    ));
    assert!(matches!(store.read("k", 0), Err(FenceError::Invalid(_))));
    assert!(matches!(
        store.read_shared("k", 0),
        Err(FenceError::Invalid(_))
    ));
    assert!(store.peek("k").is_none());
}

#[tokio::test]
async fn the_store_over_grpc() {
    let dir = tempfile::tempdir().unwrap();
    let store = Arc::new(FencedStore::open(&dir.path().join("fence.log")).unwrap());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let server = tokio::spawn(serve(listener, store.clone(), async move {
        let _ = stopped.await;
    }));
    let mut client = FenceClient::connect(&addr.to_string()).await.unwrap();
    client.write("acct", 10, b"100").await.unwrap();
    assert_eq!(
        client.read("acct", 11).await.unwrap(),
        Some((b"100".to_vec(), 10))
    );
    let err = client.write("acct", 10, b"late").await.unwrap_err();
    assert!(
        matches!(
            err,
            FenceError::Stale {
                token: 10,
                seen: 11,
                ..
            }
        ),
        "{err}"
    );
    assert_eq!(
        store.peek("acct").unwrap().value.as_deref(),
        Some(&b"100"[..])
    );
    // Shared reads: readers 13 and 12 both read after the exclusive read at 11; the writer 12 is
    // then older than a reader seen, and a reader 11 is not newer than the exclusive read at 11.
    assert_eq!(
        client.read_shared("acct", 13).await.unwrap(),
        Some((b"100".to_vec(), 10))
    );
    assert!(client.read_shared("acct", 12).await.is_ok());
    assert!(matches!(
        client.write("acct", 12, b"late").await,
        Err(FenceError::Stale { seen: 13, .. })
    ));
    assert!(matches!(
        client.read_shared("acct", 11).await,
        Err(FenceError::Stale { seen: 11, .. })
    ));
    let _ = stop.send(());
    server.await.unwrap().unwrap();
}

/// The read-modify-write scenario of DESIGN.md §5 on SQLite: a stale holder's transaction after the new
/// holder's is refused whole, and nothing it wrote lands.
#[test]
fn sqlite_fences_whole_transactions() {
    use holdfast_fence::sqlite::{fenced_transaction, install};
    let dir = tempfile::tempdir().unwrap();
    let mut conn = rusqlite::Connection::open(dir.path().join("db.sqlite")).unwrap();
    install(&conn).unwrap();
    conn.execute(
        "CREATE TABLE acct (id TEXT PRIMARY KEY, balance INTEGER NOT NULL)",
        [],
    )
    .unwrap();
    conn.execute("INSERT INTO acct VALUES ('a', 100)", [])
        .unwrap();
    let add = |amount: i64| {
        move |tx: &rusqlite::Transaction<'_>| {
            let balance: i64 =
                tx.query_row("SELECT balance FROM acct WHERE id = 'a'", [], |r| r.get(0))?;
            tx.execute(
                "UPDATE acct SET balance = ?1 WHERE id = 'a'",
                [balance + amount],
            )
        }
    };
    fenced_transaction(&mut conn, "acct/a", 8, add(10)).unwrap();
    fenced_transaction(&mut conn, "acct/a", 9, add(20)).unwrap();
    let err = fenced_transaction(&mut conn, "acct/a", 8, add(1000)).unwrap_err();
    assert!(
        matches!(
            err,
            FenceError::Stale {
                token: 8,
                seen: 9,
                ..
            }
        ),
        "{err}"
    );
    // Work that fails rolls the fence back too.
    let err = fenced_transaction(&mut conn, "acct/a", 12, |tx| {
        tx.execute("UPDATE nope SET x = 1", [])
    })
    .unwrap_err();
    assert!(matches!(err, FenceError::Database(_)));
    fenced_transaction(&mut conn, "acct/a", 10, add(5)).unwrap();
    let balance: i64 = conn
        .query_row("SELECT balance FROM acct WHERE id = 'a'", [], |r| r.get(0))
        .unwrap();
    assert_eq!(balance, 135);
    // A lost token (0) is refused, not taken as the first one of a resource never fenced.
    let err = fenced_transaction(&mut conn, "acct/new", 0, add(1)).unwrap_err();
    assert!(matches!(err, FenceError::Invalid(_)), "{err}");
    let seen: i64 = conn
        .query_row(
            "SELECT token FROM holdfast_fence WHERE resource = 'acct/a'",
            [],
            |r| r.get(0),
        )
        .unwrap();
    assert_eq!(seen, 10);
}

/// The same against a real PostgreSQL server, including two concurrent transactions: the stale holder's
/// transaction, started while the new holder's holds the fence row, is refused once that commits.
#[test]
fn postgres_fences_whole_transactions() {
    use holdfast_fence::postgres::{fenced_transaction, install};
    let pg = postgres_server::PgServer::start();
    let mut client = pg.connect();
    install(&mut client).unwrap();
    client.batch_execute("CREATE TABLE acct (id TEXT PRIMARY KEY, balance BIGINT NOT NULL); INSERT INTO acct VALUES ('a', 100);").unwrap();
    fn add(
        amount: i64,
    ) -> impl FnOnce(&mut postgres::Transaction<'_>) -> Result<u64, postgres::Error> {
        move |tx| {
            let balance: i64 = tx
                .query_one("SELECT balance FROM acct WHERE id = 'a'", &[])?
                .get(0);
            tx.execute(
                "UPDATE acct SET balance = $1 WHERE id = 'a'",
                &[&(balance + amount)],
            )
        }
    }
    fenced_transaction(&mut client, "acct/a", 8, add(10)).unwrap();
    fenced_transaction(&mut client, "acct/a", 9, add(20)).unwrap();
    let err = fenced_transaction(&mut client, "acct/a", 8, add(1000)).unwrap_err();
    assert!(
        matches!(
            err,
            FenceError::Stale {
                token: 8,
                seen: 9,
                ..
            }
        ),
        "{err}"
    );

    // A shared lock's holders: readers refused only after a newer writer, writers after any newer holder.
    {
        use holdfast_fence::postgres::fenced_rw_transaction;
        use holdfast_fence::sql::Role::{Reader, Writer};
        let ok = |_: &mut postgres::Transaction<'_>| Ok(());
        fenced_rw_transaction(&mut client, "doc", 5, Writer, ok).unwrap();
        fenced_rw_transaction(&mut client, "doc", 7, Reader, ok).unwrap();
        fenced_rw_transaction(&mut client, "doc", 6, Reader, ok).unwrap();
        let err = fenced_rw_transaction(&mut client, "doc", 5, Writer, ok).unwrap_err();
        assert!(
            matches!(
                err,
                FenceError::Stale {
                    token: 5,
                    seen: 7,
                    ..
                }
            ),
            "{err}"
        );
        fenced_rw_transaction(&mut client, "doc", 8, Writer, ok).unwrap();
        let err = fenced_rw_transaction(&mut client, "doc", 7, Reader, ok).unwrap_err();
        assert!(
            matches!(
                err,
                FenceError::Stale {
                    token: 7,
                    seen: 8,
                    ..
                }
            ),
            "{err}"
        );
    }

    // Concurrency: B (token 11) holds the fence row in an open transaction; A (stale, token 10) blocks on
    // it, then is refused when B commits.
    let mut b = pg.connect();
    let mut tx_b = b.transaction().unwrap();
    let n = tx_b
        .execute(holdfast_fence::sql::CHECK_AND_RAISE, &[&"acct/a", &11i64])
        .unwrap();
    assert_eq!(n, 1);
    let a = std::thread::spawn({
        let mut a = pg.connect();
        move || fenced_transaction(&mut a, "acct/a", 10, add(1000))
    });
    // Wait until A is blocked on B's fence row lock.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    loop {
        let waiting: i64 = client
            .query_one(
                "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock'",
                &[],
            )
            .unwrap()
            .get(0);
        if waiting > 0 {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "A never blocked on the fence row"
        );
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    let balance: i64 = tx_b
        .query_one("SELECT balance FROM acct WHERE id = 'a'", &[])
        .unwrap()
        .get(0);
    tx_b.execute(
        "UPDATE acct SET balance = $1 WHERE id = 'a'",
        &[&(balance + 1)],
    )
    .unwrap();
    tx_b.commit().unwrap();
    let err = a.join().unwrap().unwrap_err();
    assert!(
        matches!(
            err,
            FenceError::Stale {
                token: 10,
                seen: 11,
                ..
            }
        ),
        "{err}"
    );
    let balance: i64 = client
        .query_one("SELECT balance FROM acct WHERE id = 'a'", &[])
        .unwrap()
        .get(0);
    assert_eq!(balance, 131);
}
