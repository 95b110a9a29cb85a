"""Fencing helpers against real resources: SQLite (stdlib), PostgreSQL (a server this test starts) and the
reference fenced store (`holdfast fence-store`). A holder that lost its lock to a newer holder is refused and
writes nothing."""

from __future__ import annotations

import sqlite3
from pathlib import Path
from typing import Any, Callable, ContextManager

import pytest

import holdfast
from holdfast.fence import FenceStale
from holdfast.fence import postgres as fpg
from holdfast.fence import sqlite as fsqlite
from holdfast.fence.store import FencedStore, Value


def two_holders(client: holdfast.Client, name: str) -> tuple[int, int]:
    """The tokens of two successive holders of ``name``: the first one's session ends (as a lapsed
    lease would) and the lock passes to the second."""
    old = client.session()
    t1 = old.try_acquire(name).token
    old.close()
    with client.session() as new:
        t2 = new.try_acquire(name).token
    assert t2 > t1
    return t1, t2


def check_fencing(
    fenced: Callable[[int], ContextManager[Any]],
    write: Callable[[Any, int], None],
    read: Callable[[], int],
    t1: int,
    t2: int,
) -> None:
    with fenced(t2) as tx:
        write(tx, 200)
    with pytest.raises(FenceStale) as e:
        with fenced(t1) as tx:
            write(tx, 100)  # never runs
    assert (e.value.token, e.value.seen) == (t1, t2)
    assert isinstance(e.value, holdfast.StaleToken) and e.value.current == t2
    assert read() == 200, "the stale holder wrote nothing"
    # A block that raises rolls back its writes and the fence with them.
    with pytest.raises(RuntimeError):
        with fenced(t2 + 10) as tx:
            write(tx, 300)
            raise RuntimeError("fail inside")
    assert read() == 200
    with fenced(t2) as tx:  # t2 + 10 was rolled back, so t2 still passes
        write(tx, 250)
    assert read() == 250


def test_sqlite(client: holdfast.Client, name: str, tmp_path: Path) -> None:
    conn = sqlite3.connect(tmp_path / "app.db")
    fsqlite.install(conn)
    conn.execute("CREATE TABLE accounts (name TEXT PRIMARY KEY, balance INTEGER)")
    conn.execute("INSERT INTO accounts VALUES ('alice', 0)")
    conn.commit()
    t1, t2 = two_holders(client, name)

    def write(tx: sqlite3.Connection, v: int) -> None:
        tx.execute("UPDATE accounts SET balance = ? WHERE name = 'alice'", (v,))

    def read() -> int:
        return int(conn.execute("SELECT balance FROM accounts").fetchone()[0])

    check_fencing(lambda t: fsqlite.fenced_transaction(conn, name, t), write, read, t1, t2)
    with pytest.raises(holdfast.InvalidArgument):
        with fsqlite.fenced_transaction(conn, name, 0):
            pass


def test_a_sqlite_block_may_not_end_its_fenced_transaction(tmp_path: Path) -> None:
    # What a block ran after committing would run outside the fence (and sqlite3 would open an unfenced
    # transaction for it that the helper then committed): a commit, rollback or BEGIN inside is refused,
    # and the whole transaction rolls back.
    conn = sqlite3.connect(tmp_path / "own.db")
    fsqlite.install(conn)
    conn.execute("CREATE TABLE t (v INTEGER)")
    conn.commit()
    for end in (conn.commit, conn.rollback, lambda: conn.execute("COMMIT")):
        with pytest.raises(sqlite3.DatabaseError, match="not authorized"):
            with fsqlite.fenced_transaction(conn, "r", 5) as tx:
                tx.execute("INSERT INTO t VALUES (1)")
                end()
                tx.execute("INSERT INTO t VALUES (2)")
        assert not conn.in_transaction
        assert conn.execute("SELECT count(*) FROM t").fetchone()[0] == 0
    with fsqlite.fenced_transaction(conn, "r", 5) as tx:  # the connection works as before afterwards
        tx.execute("INSERT INTO t VALUES (3)")
        tx.execute("SAVEPOINT inner")  # nested savepoints cannot end the fenced transaction: allowed
        tx.execute("INSERT INTO t VALUES (4)")
        tx.execute("ROLLBACK TO inner")
        tx.execute("RELEASE inner")
    assert conn.execute("SELECT v FROM t").fetchall() == [(3,)]
    conn.execute("INSERT INTO t VALUES (5)")  # and outside the helper, transactions are the caller's
    conn.commit()
    assert conn.execute("SELECT count(*) FROM t").fetchone()[0] == 2


def test_sqlite_shared_readers_pass_until_a_newer_writer(tmp_path: Path) -> None:
    conn = sqlite3.connect(tmp_path / "rw.db")
    fsqlite.install(conn)
    with fsqlite.fenced_transaction(conn, "r", 5, shared=True):
        pass
    with fsqlite.fenced_transaction(conn, "r", 4, shared=True):  # an older reader: still fine
        pass
    with fsqlite.fenced_transaction(conn, "r", 6, shared=False):  # a newer writer
        pass
    with pytest.raises(FenceStale) as e:
        with fsqlite.fenced_transaction(conn, "r", 5, shared=True):
            pass
    assert e.value.seen == 6


def test_postgres(client: holdfast.Client, name: str, postgres_dsn: str) -> None:
    import psycopg

    with psycopg.connect(postgres_dsn) as conn:
        fpg.install(conn)
        with conn.transaction():
            conn.execute("CREATE TABLE IF NOT EXISTS accounts (name TEXT PRIMARY KEY, balance INTEGER)")
            conn.execute("INSERT INTO accounts VALUES ('alice', 0) ON CONFLICT DO NOTHING")
        t1, t2 = two_holders(client, name)

        def write(tx: Any, v: int) -> None:
            tx.execute("UPDATE accounts SET balance = %s WHERE name = 'alice'", (v,))

        def read() -> int:
            with conn.transaction():
                row = conn.execute("SELECT balance FROM accounts WHERE name = 'alice'").fetchone()
            assert row is not None
            return int(row[0])

        check_fencing(lambda t: fpg.fenced_transaction(conn, name, t), write, read, t1, t2)
        # Inside a transaction the caller opened (psycopg opens one on the first statement), the fence
        # would be a savepoint that fences none of the caller's earlier statements: refused.
        conn.execute("UPDATE accounts SET balance = 99 WHERE name = 'alice'")
        with pytest.raises(holdfast.InvalidArgument, match="already in a transaction"):
            with fpg.fenced_transaction(conn, name, t2):
                pass
        conn.rollback()
        assert read() != 99


def test_fenced_store(client: holdfast.Client, name: str, fence_store: str) -> None:
    store = FencedStore(fence_store)
    t1, t2 = two_holders(client, name)
    assert store.write(name, t2, b"new") == t2
    with pytest.raises(FenceStale) as e:
        store.write(name, t1, b"old")
    assert e.value.seen == t2
    assert store.read(name, t2) == Value(b"new", t2)
    assert store.read(name + "/never", t2) is None
    with pytest.raises(holdfast.InvalidArgument, match="token 0"):  # a lost token, not a first one
        store.write(name + "/new", 0, b"x")
    store.close()
