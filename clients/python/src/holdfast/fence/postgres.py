"""Fenced transactions on PostgreSQL with psycopg 3 (``pip install holdfast[postgres]``), as
crates/fence/src/postgres.rs.

::

    with psycopg.connect(dsn) as conn:
        holdfast.fence.postgres.install(conn)
        with session.lock("accounts/alice") as lock:
            with holdfast.fence.postgres.fenced_transaction(conn, "accounts/alice", lock.token):
                conn.execute("UPDATE accounts SET balance = balance + 10 WHERE name = 'alice'")

The transaction first upserts the resource's fence row (which row-locks it until the transaction ends, so
two holders' transactions on one resource are serialized), checking the token against every token that
committed before; then it runs the block, and commits when the block ends or rolls back (fence included) if
it raises. A holder whose token is stale gets :class:`holdfast.fence.FenceStale` and nothing is written.
The connection must not be in a transaction already (psycopg opens one on the first ``execute`` unless
``autocommit`` is set): the fence would be a savepoint of it, the caller's earlier statements in it would
not be fenced, and a caller that caught ``FenceStale`` and committed would commit them anyway.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator, Optional

from holdfast.fence import RW_SCHEMA, SCHEMA, FenceStale, check_token, seen_of, statements


def install(conn: Any) -> None:
    """Creates the fencing tables if they do not exist (``conn``: a ``psycopg.Connection``)."""
    with conn.transaction():
        conn.execute(SCHEMA)
        conn.execute(RW_SCHEMA)


@contextmanager
def fenced_transaction(
    conn: Any, resource: str, token: int, *, shared: Optional[bool] = None
) -> Iterator[Any]:
    """Runs the block in a transaction of ``conn`` (a ``psycopg.Connection``) fenced by ``token`` for
    ``resource``; yields the connection. ``shared`` as in :func:`holdfast.fence.sqlite.fenced_transaction`.
    """
    check_token(token)
    from psycopg.pq import TransactionStatus

    if conn.info.transaction_status != TransactionStatus.IDLE:
        from holdfast.errors import InvalidArgument

        raise InvalidArgument(
            "the connection is already in a transaction: commit or roll it back first (or use autocommit)"
        )
    check, seen, tokens = statements("%s", shared)
    with conn.transaction():
        changed = conn.execute(check, (resource, *([token] * tokens))).rowcount
        if changed != 1:
            row = conn.execute(seen, (resource,)).fetchone()
            raise FenceStale(resource, token, seen_of(row, shared))
        yield conn
