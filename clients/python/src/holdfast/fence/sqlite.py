"""Fenced transactions on SQLite (the standard library's ``sqlite3``), as crates/fence/src/sqlite.rs.

::

    conn = sqlite3.connect("app.db")
    holdfast.fence.sqlite.install(conn)
    with session.lock("accounts/alice") as lock:
        with holdfast.fence.sqlite.fenced_transaction(conn, "accounts/alice", lock.token) as tx:
            (balance,) = tx.execute("SELECT balance FROM accounts WHERE name = 'alice'").fetchone()
            tx.execute("UPDATE accounts SET balance = ? WHERE name = 'alice'", (balance + 10,))

The transaction begins with ``BEGIN IMMEDIATE`` (SQLite's write lock for the whole database), checks the
token against the highest one seen for the resource and raises it, then runs the block; it commits when the
block ends and rolls back (fence included) if the block raises. A holder whose token is stale gets
:class:`holdfast.fence.FenceStale` and nothing is written.
"""

from __future__ import annotations

import sqlite3
import sys
from contextlib import contextmanager
from typing import Iterator, Optional

from holdfast.errors import InvalidArgument
from holdfast.fence import RW_SCHEMA, SCHEMA, FenceStale, check_token, seen_of, statements


def install(conn: sqlite3.Connection) -> None:
    """Creates the fencing tables if they do not exist."""
    conn.execute(SCHEMA)
    conn.execute(RW_SCHEMA)
    conn.commit()


@contextmanager
def fenced_transaction(
    conn: sqlite3.Connection, resource: str, token: int, *, shared: Optional[bool] = None
) -> Iterator[sqlite3.Connection]:
    """Runs the block in a transaction fenced by ``token`` for ``resource`` (see the module docs).

    ``shared``: ``None`` for a plain lock; for a shared lock's resource, ``True`` for a shared holder
    (refused only after a newer writer) and ``False`` for the exclusive one (refused after any newer
    holder).
    """
    check_token(token)
    if getattr(conn, "autocommit", None) is False:
        # Python 3.12's autocommit=False keeps a transaction open at all times, so this one could not
        # begin with the write lock.
        raise InvalidArgument("the connection has autocommit=False: use the default, or autocommit=True")
    if conn.in_transaction:
        raise InvalidArgument("the connection is already in a transaction: commit or roll it back first")
    check, seen, tokens = statements("?", shared)
    # Explicit statements, not conn.commit()/rollback(), which do nothing under autocommit=True.
    conn.execute("BEGIN IMMEDIATE")
    try:
        changed = conn.execute(check, (resource, *([token] * tokens))).rowcount
        if changed != 1:
            row = conn.execute(seen, (resource,)).fetchone()
            raise FenceStale(resource, token, seen_of(row, shared))
        # The block may not end the transaction itself: what it ran after a commit would run unfenced
        # (sqlite3 opens a new transaction for it, which this function would then commit). While the
        # block runs, an authorizer refuses transaction statements (conn.commit() included).
        # (It replaces, and afterwards removes, any authorizer the application set on the connection.)
        conn.set_authorizer(_no_transaction_control)
        try:
            yield conn
        finally:
            # Python 3.10 takes None for a callback that refuses everything; 3.11 clears it.
            conn.set_authorizer(None if sys.version_info >= (3, 11) else _allow_all)
        conn.execute("COMMIT")
    except BaseException:
        if conn.in_transaction:
            conn.execute("ROLLBACK")  # also after a failed COMMIT, which leaves the transaction open
        raise


def _no_transaction_control(action: int, *_: object) -> int:
    """An authorizer that refuses BEGIN, COMMIT and ROLLBACK, and allows everything else (savepoints
    included: inside the transaction, RELEASE and ROLLBACK TO cannot end it)."""
    if action == sqlite3.SQLITE_TRANSACTION:
        return sqlite3.SQLITE_DENY
    return sqlite3.SQLITE_OK


def _allow_all(*_: object) -> int:
    return sqlite3.SQLITE_OK
