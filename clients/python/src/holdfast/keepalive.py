"""Batched keepalives (the twin of crates/client/src/keepalive.rs): one thread per :class:`Client` renews
every session it opened, with one ``KeepAlive`` per round to each server that leads a group where some
of them are open (all of that server's groups in one message, ``KeepAliveRequest.groups``). So a client's
renewal traffic is one message per round per leading server, whatever the number of sessions and
groups. A group answered NOT_LEADER is sent again, in the same round, to the leader the answer names.
Against a server older than per-group answers (it answers none) a round falls back to one call per
group.

A session is due a third of its TTL after its last renewal was sent, and a round also takes the sessions
due within the next sixth of their TTL, so sessions opened at different times share rounds; a renewal
counts from the moment its round was **sent**. A failed round is retried on the next tick (every 100 ms) until the session's
client-side lease runs out, and then the session is lost.
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from typing import TYPE_CHECKING, Optional, Union

import grpc

from holdfast import errors
from holdfast.v1 import lock_pb2

if TYPE_CHECKING:
    from holdfast.client import Client
    from holdfast.session import Session

log = logging.getLogger("holdfast")

#: How often the keepalive thread looks for due sessions (seconds).
TICK = 0.1
#: Most session ids per keepalive message (the server's ``max_keepalive_batch``).
MAX_BATCH = 10_000

#: One group's outcome in a round: per member session, the TTL granted (seconds) or None if it is not
#: alive; or why the round failed for the group.
GroupOutcome = Union[list[Optional[float]], str]


class Registry:
    """The sessions one client keeps alive, and the thread that does it (started with the first)."""

    def __init__(self, client: "Client") -> None:
        self._client = weakref.ref(client)
        self._lock = threading.Lock()
        self._sessions: "weakref.WeakSet[Session]" = weakref.WeakSet()
        self._thread: Optional[threading.Thread] = None
        #: Keepalive messages sent (for tests and curious operators).
        self.messages = 0

    def add(self, session: "Session") -> None:
        with self._lock:
            self._sessions.add(session)
            if self._thread is None:
                # The thread holds the registry weakly: a client nobody refers to stops its keepalives,
                # and the servers expire its sessions.
                self._thread = threading.Thread(
                    target=_run, args=(weakref.ref(self),), name="holdfast-keepalive", daemon=True
                )
                self._thread.start()

    def _live(self) -> list["Session"]:
        with self._lock:
            return list(self._sessions)


def lease_clock() -> float:
    """Seconds on the lease's clock. The monotonic clock stands still while the machine is suspended,
    and the servers' TTLs do not: a laptop (or a guest that suspends itself) that slept past its sessions'
    TTLs would wake believing it still held their locks (a hypervisor pausing a VM stops both clocks, so
    that is not seen; fencing tokens cover it). So every lease instant (sends, ends, due times) is read on
    ``CLOCK_BOOTTIME`` where there is one (Linux), which counts the suspension, and on the monotonic
    clock elsewhere (the Rust client does the same, crates/client/src/session.rs)."""
    return time.clock_gettime(_BOOTTIME) if _BOOTTIME is not None else time.monotonic()


_BOOTTIME: Optional[int] = getattr(time, "CLOCK_BOOTTIME", None)

def _run(ref: "weakref.ref[Registry]") -> None:
    while True:
        time.sleep(TICK)
        if not _tick(ref):
            return


def _tick(ref: "weakref.ref[Registry]") -> bool:
    """One look for due sessions (and their round). In a function of its own so that nothing it
    refers to (a session, the client) is held while the thread sleeps. False once the client is gone."""
    registry = ref()
    client = registry._client() if registry is not None else None
    if registry is None or client is None:
        return False
    now = lease_clock()
    live = registry._live()
    if any(s._is_due(now) for s in live):
        # With them, the sessions due within the next sixth of their TTL: sessions opened at different
        # times then share their rounds from the first on.
        due = [s for s in live if s._is_due(now, early=True)]
        try:
            _round(client, registry, due)
        except Exception:  # never let the thread die: the leases would run out silently
            log.exception("keepalive round failed")
            for s in due:
                s._retry_soon(lease_clock() + TICK)
    return True


def _round(client: "Client", registry: Registry, due: list["Session"]) -> None:
    sent = lease_clock()
    per_message = max(MAX_BATCH // max(client.groups, 1), 1)
    for start in range(0, len(due), per_message):
        chunk = due[start : start + per_message]
        # Which sessions are open in each group, and their ids and secrets there, taken once: a session's
        # part in a group only goes from unopened to open; one opened since bounds its lease until the
        # next round (Session._renewed).
        parts = [s._parts() for s in chunk]
        members = [[i for i, p in enumerate(parts) if p[g] is not None] for g in range(client.groups)]
        deadline = min(s._lease_end() for s in chunk)
        outcomes = _fan_in(client, registry, parts, members, deadline)
        granted = [float("inf")] * len(chunk)
        failed = [False] * len(chunk)
        for g, outcome in enumerate(outcomes):
            if isinstance(outcome, str):
                log.debug("keepalive of group %d failed; retrying: %s", g, outcome)
                for i in members[g]:
                    failed[i] = True
                continue
            for i, ttl in zip(members[g], outcome):
                if ttl is None:
                    chunk[i]._mark_lost("the server expired or closed the session")
                    failed[i] = True
                else:
                    granted[i] = min(granted[i], ttl)
        for i, (s, ttl, f) in enumerate(zip(chunk, granted, failed)):
            if f or ttl == float("inf"):
                s._retry_soon(lease_clock() + TICK)
            else:
                s._renewed(sent, ttl, {g for g in range(client.groups) if parts[i][g] is not None})


def _fan_in(
    client: "Client",
    registry: Registry,
    parts: list[list[Optional[tuple[int, bytes]]]],
    members: list[list[int]],
    deadline: float,
) -> list[GroupOutcome]:
    """Renews the members of every group with one message per server that leads some of the groups (as
    far as the client knows), then again for groups answered NOT_LEADER, at the leader named, up to one
    more time than there are servers."""
    out: list[Optional[GroupOutcome]] = [[] if not m else None for m in members]
    for _attempt in range(len(client.endpoints) + 1):
        by_leader: dict[int, list[int]] = {}
        for g in range(client.groups):
            if out[g] is None:
                by_leader.setdefault(client._leader_of(g), []).append(g)
        if not by_leader:
            break
        for target, groups in by_leader.items():
            limit = min(client.attempt_timeout, deadline - lease_clock())
            if limit <= 0:
                for g in groups:
                    out[g] = "the leases ran out during the round"
                continue
            request = lock_pb2.KeepAliveRequest(
                # What a server older than `groups` checks alone: one the client believes it leads.
                group=groups[0],
                groups=[_group_request(parts, members[g], g) for g in groups],
                # Each group's answer as one packed field of TTLs (0: not alive) instead of a message
                # per session; a server older than `compact` answers in full (docs/api.md).
                compact=True,
            )
            server = client._server(target)
            try:
                registry.messages += 1
                reply = server.stub.KeepAlive(request, timeout=limit, metadata=client._metadata)
            except grpc.RpcError as e:
                outcome = errors.from_rpc_error(e)
                for g in groups:
                    _next_target(client, g, target, outcome, out)
                continue
            if not reply.groups:
                # A server older than per-group answers: one call per group, this round.
                for g in groups:
                    out[g] = _one_group(client, registry, parts, members[g], g, deadline)
                continue
            if len(reply.groups) != len(groups):
                for g in groups:
                    out[g] = "keepalive answered the wrong groups"
                continue
            for g, answer in zip(groups, reply.groups):
                if answer.group != g:
                    out[g] = "keepalive answered the wrong groups"
                elif answer.code == 0 and reply.compact:
                    out[g] = (
                        [t / 1000.0 if t > 0 else None for t in answer.ttl_ms]
                        if len(answer.ttl_ms) == len(members[g])
                        else "keepalive answered the wrong number of sessions"
                    )
                elif answer.code == 0:
                    out[g] = (
                        [r.ttl_ms / 1000.0 if r.alive else None for r in answer.results]
                        if len(answer.results) == len(members[g])
                        else "keepalive answered the wrong number of sessions"
                    )
                else:
                    detail = answer.error if answer.HasField("error") else None
                    outcome = errors.from_group_answer(answer.code, answer.message, detail)
                    _next_target(client, g, target, outcome, out)
    return [o if o is not None else "no server renewed the sessions" for o in out]


def _group_request(
    parts: list[list[Optional[tuple[int, bytes]]]], members: list[int], g: int
) -> lock_pb2.GroupKeepAlive:
    ids = [parts[i][g][0] for i in members]  # type: ignore[index]
    secrets = [parts[i][g][1] for i in members]  # type: ignore[index]
    # Sessions opened by a server that gave no secrets send none.
    if all(not s for s in secrets):
        secrets = []
    return lock_pb2.GroupKeepAlive(group=g, session_ids=ids, session_secrets=secrets)


def _one_group(
    client: "Client",
    registry: Registry,
    parts: list[list[Optional[tuple[int, bytes]]]],
    members: list[int],
    g: int,
    deadline: float,
) -> GroupOutcome:
    part = _group_request(parts, members, g)
    try:
        registry.messages += 1
        r = client.call(
            g,
            "KeepAlive",
            lock_pb2.KeepAliveRequest(group=g, session_ids=part.session_ids, session_secrets=part.session_secrets),
            # client.call counts on time.monotonic(); the deadline is on the lease clock.
            deadline=time.monotonic() + (deadline - lease_clock()),
        )
    except errors.HoldfastError as e:
        return str(e)
    if len(r.results) != len(members):
        return "keepalive answered the wrong number of sessions"
    return [x.ttl_ms / 1000.0 if x.alive else None for x in r.results]


def _next_target(
    client: "Client", g: int, target: int, outcome: Exception, out: list[Optional[GroupOutcome]]
) -> None:
    """Where group ``g``'s next try goes after ``target`` failed with ``outcome``: the leader it named,
    else the next server; or the group's outcome, if another server would fail the same way."""
    if errors.answered(outcome):
        client._mark_answered(target)
    if isinstance(outcome, errors.Redirect):
        i = client._redirect_target(outcome.endpoint)
        client._set_leader(g, i if i is not None else (target + 1) % len(client.endpoints))
    elif isinstance(outcome, errors.Retry):
        if not outcome.answered:
            client._mark_failed(target)
        client._set_leader(g, (target + 1) % len(client.endpoints))
    else:
        out[g] = str(outcome)
