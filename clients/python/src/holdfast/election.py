"""Leader election on a lock named for the role (DESIGN.md §5), as in crates/client/src/election.rs.

The holder of the role's lock is the leader, its fencing token is the leader's **epoch**, and the value
stored with the grant says who leads. Downstream systems reject messages that carry an epoch older than
the newest they have seen, exactly as a fenced resource rejects old tokens::

    with client.session() as s:
        leadership = s.campaign("svc/scheduler", b"node-a")   # waits in line
        while leadership.is_valid():
            do_leader_work(epoch=leadership.epoch)
        # lease lost: stop acting as leader at once

``client.leader("svc/scheduler")`` says who leads now (linearizable).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

if TYPE_CHECKING:
    from holdfast.session import Lock


@dataclass(frozen=True)
class Leader:
    """The current leader of a role, as seen by a linearizable read."""

    #: The value the leader campaigned with.
    value: bytes
    #: The leader's epoch (its fencing token): strictly increasing across leaders of the role.
    epoch: int
    #: The leader's session id (in the role's group).
    session: int


class Leadership:
    """Leadership of a role, held until :meth:`resign`, the session's end, or the loss of its lease."""

    def __init__(self, lock: "Lock", value: bytes) -> None:
        self.lock = lock
        self.value = value

    @property
    def role(self) -> str:
        return self.lock.name

    @property
    def epoch(self) -> int:
        """The epoch of this leadership: send it with every message a leader sends."""
        return self.lock.token

    def is_valid(self) -> bool:
        """True while the session's lease is valid: stop acting as leader once it is not."""
        return self.lock.is_valid()

    def wait_lost(self, timeout: Optional[float] = None) -> Optional[str]:
        """Blocks until leadership may be lost (returns why) or ``timeout`` seconds pass (``None``)."""
        return self.lock.session.wait_lost(timeout)

    def resign(self) -> None:
        """Steps down, letting the next candidate in line lead."""
        self.lock.release()

    def __enter__(self) -> "Leadership":
        return self

    def __exit__(self, *exc: object) -> None:
        self.resign()
