"""The Holdfast client for Python: sessions, locks with fencing tokens, leader election, fencing helpers.

::

    import holdfast
    client = holdfast.Client("127.0.0.1:7001,127.0.0.1:7002")
    with client.session() as session, session.lock("reports/nightly") as lock:
        print("holding it with token", lock.token)   # send lock.token with every write

Layout: :mod:`holdfast.client` (endpoints, leader following, retries), :mod:`holdfast.session` (the
keepalive thread, the client-side lease, held locks), :mod:`holdfast.election`, :mod:`holdfast.fence`
(the resource side), :mod:`holdfast.errors`. ``holdfast.v1`` holds the stubs generated from
proto/holdfast/v1 when the package was built. See docs/python.md.
"""

from holdfast.client import Client, Tls, group_for
from holdfast.election import Leader, Leadership
from holdfast.errors import (
    Abandoned,
    AlreadyHeld,
    Compacted,
    HoldfastError,
    InvalidArgument,
    LeaseLost,
    LimitExceeded,
    LockHeld,
    NotHolder,
    PermissionDenied,
    PermitsMismatch,
    RequestIdTooOld,
    SessionUnknown,
    StaleToken,
    Unavailable,
)
from holdfast.session import Lock, Session

__all__ = [
    "Abandoned",
    "AlreadyHeld",
    "Client",
    "Compacted",
    "HoldfastError",
    "InvalidArgument",
    "Leader",
    "Leadership",
    "LeaseLost",
    "LimitExceeded",
    "Lock",
    "LockHeld",
    "NotHolder",
    "PermissionDenied",
    "PermitsMismatch",
    "RequestIdTooOld",
    "Session",
    "SessionUnknown",
    "StaleToken",
    "Tls",
    "Unavailable",
    "group_for",
]
