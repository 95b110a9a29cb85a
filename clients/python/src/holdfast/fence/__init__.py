"""The resource side of fencing (the twin of crates/fence).

A lock alone cannot protect a resource: a holder can pause (GC, a stalled VM, a slow network) for longer
than its lease, lose the lock without knowing, and write afterwards. Every grant carries a fencing token
that strictly increases per lock; the **resource** must remember the highest token it has seen and refuse
anything older. These helpers do that check:

- :mod:`holdfast.fence.sqlite` and :mod:`holdfast.fence.postgres` (psycopg 3): a fencing table, updated
  first, in the same transaction as the protected reads and writes (docs/fencing.md explains why the
  whole read-modify-write is fenced, not only the write).
- :mod:`holdfast.fence.store`: a client of the reference fenced store (``holdfast fence-store``).
"""

from __future__ import annotations

from holdfast.errors import StaleToken

#: Creates the fencing table.
SCHEMA = "CREATE TABLE IF NOT EXISTS holdfast_fence (resource TEXT PRIMARY KEY, token BIGINT NOT NULL)"

#: For shared locks: per resource the highest token seen from anyone and from a writer.
RW_SCHEMA = (
    "CREATE TABLE IF NOT EXISTS holdfast_fence_rw "
    "(resource TEXT PRIMARY KEY, any_token BIGINT NOT NULL, write_token BIGINT NOT NULL)"
)

#: Raises the fence of a resource to a token if no higher token was seen; 1 row affected means the check
#: passed, and the row stays locked until the transaction ends. ``{p}`` is the driver's placeholder.
CHECK_AND_RAISE = (
    "INSERT INTO holdfast_fence (resource, token) VALUES ({p}, {p}) "
    "ON CONFLICT (resource) DO UPDATE SET token = excluded.token "
    "WHERE holdfast_fence.token <= excluded.token"
)
SEEN = "SELECT token FROM holdfast_fence WHERE resource = {p}"

#: A writer of a shared lock's resource (the exclusive holder): no newer reader or writer was here.
CHECK_WRITER = (
    "INSERT INTO holdfast_fence_rw (resource, any_token, write_token) VALUES ({p}, {p}, {p}) "
    "ON CONFLICT (resource) DO UPDATE SET any_token = excluded.any_token, write_token = excluded.write_token "
    "WHERE holdfast_fence_rw.any_token <= excluded.any_token"
)
#: A reader (shared holder): no newer writer was here; raises any_token.
CHECK_READER = (
    "INSERT INTO holdfast_fence_rw (resource, any_token, write_token) VALUES ({p}, {p}, 0) "
    "ON CONFLICT (resource) DO UPDATE SET any_token = CASE WHEN holdfast_fence_rw.any_token > "
    "excluded.any_token THEN holdfast_fence_rw.any_token ELSE excluded.any_token END "
    "WHERE holdfast_fence_rw.write_token < excluded.any_token"
)
SEEN_RW = "SELECT any_token, write_token FROM holdfast_fence_rw WHERE resource = {p}"

#: The largest token a BIGINT column holds.
MAX_SQL_TOKEN = 2**63 - 1


class FenceStale(StaleToken):
    """The token is lower than the highest the resource has seen: the caller no longer holds the lock.
    Nothing was written."""

    def __init__(self, resource: str, token: int, seen: int) -> None:
        super().__init__(
            f"stale token {token} for {resource!r}: the resource has seen token {seen}", current=seen
        )
        self.resource = resource
        self.token = token
        self.seen = seen


def check_token(token: int) -> None:
    if not 0 < token <= MAX_SQL_TOKEN:
        from holdfast.errors import InvalidArgument

        raise InvalidArgument(f"token {token} is not a Holdfast token (1..=2^63-1)")


def statements(placeholder: str, shared: bool | None) -> tuple[str, str, int]:
    """The check and the "seen" query for a role (``None``: a plain lock; ``True``: a shared holder;
    ``False``: the exclusive holder of a shared lock's resource), and how many token parameters the check
    takes."""
    p = placeholder
    if shared is None:
        return CHECK_AND_RAISE.format(p=p), SEEN.format(p=p), 1
    if shared:
        return CHECK_READER.format(p=p), SEEN_RW.format(p=p), 1
    return CHECK_WRITER.format(p=p), SEEN_RW.format(p=p), 2


def seen_of(row: tuple[int, ...] | None, shared: bool | None) -> int:
    """The mark a refused check lost to."""
    if row is None:
        return 0
    if shared is None:
        return int(row[0])
    return int(row[1] if shared else row[0])
