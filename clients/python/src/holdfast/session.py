"""Sessions, their keepalive thread and client-side lease, and held locks (the twin of
crates/client/src/session.rs and guard.rs).

The lease follows the Rust client's rule: it is counted on this process's lease clock from the moment
the last successful keepalive was **sent** (the server restarted the TTL when it *received* it, which is
later), minus a safety margin of a tenth of the TTL for clock-rate differences. So the lease ends (and
``lost`` fires) before the server can expire the session, and an application that stops acting as the
holder when it fires never overlaps with the next holder, as long as clocks tick at about the same rate.
Fencing tokens cover the rest: send :attr:`Lock.token` with every write to the protected resource.
The lease is read on :func:`holdfast.keepalive.lease_clock`, which counts time the machine spent suspended
(the monotonic clock does not), so a lease that ran out during a suspend is invalid at once on resume.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from types import TracebackType
from typing import TYPE_CHECKING, Callable, Optional

from holdfast import errors
from holdfast.client import Lazy, group_for
from holdfast.keepalive import lease_clock
from holdfast.v1 import lock_pb2

if TYPE_CHECKING:
    from holdfast.client import Client
    from holdfast.election import Leadership

log = logging.getLogger("holdfast")

#: The longest one acquire may wait in a lock's queue (the server's bound).
MAX_WAIT = 300.0


def _nonce() -> tuple[int, int]:
    """128 bits from the OS random number generator: a retried open with the same nonce returns the same
    session, so a nonce must never repeat (it would hand one client another's session)."""
    b = os.urandom(16)
    return int.from_bytes(b[:8], "little") | 1, int.from_bytes(b[8:], "little")


def _ms(seconds: float) -> int:
    return max(int(round(seconds * 1000)), 0)


class Session:
    """A session: one per group it is used in under the hood (opened at the first use of a name in that
    group; with one group, at once), renewed together by its client's keepalive thread every TTL/3.
    Locks hang off it: when it is closed or expires, its locks are released.

    ``ids[g]`` is the session's id in group ``g``, 0 where it is not open yet.

    Use it as a context manager, or call :meth:`close`. ``on_lost`` (if given) is called once, with the
    reason, when the lease may be lost; call :meth:`wait_lost` or check :meth:`is_valid` otherwise.
    """

    def __init__(
        self, client: "Client", ttl: float = 10.0, *, on_lost: Optional[Callable[[str], None]] = None
    ) -> None:
        self.client = client
        self._on_lost = on_lost
        self._cond = threading.Condition()
        self._lost: Optional[str] = None
        self._closed = False
        #: The TTL granted (the smallest over the groups opened so far); before the first opens, the
        #: TTL asked for (0: the servers' default, not known yet).
        self.ttl = float(ttl)
        self._requested_ms = _ms(ttl)
        self.ids: list[int] = [0] * client.groups
        self._secrets: list[bytes] = [b""] * client.groups
        self._next_request = [1] * client.groups
        # Per group, the lease end and due time its open gave (from the open's send time): they bound the
        # session's lease until a round renews that group.
        self._opened: list[Optional[tuple[float, float]]] = [None] * client.groups
        # Nothing can be lost before a group opens.
        self._valid_until = float("inf")
        self._next_due = float("inf")
        # One open at a time per group: a group's first uses, concurrent, open it once (and a slow group
        # does not hold up the first use of another).
        self._opening = [threading.Lock() for _ in range(client.groups)]
        if client.groups == 1:
            self._open_in(0)
        client._keepalives.add(self)

    def open_for(self, name: str) -> int:
        """Opens the session in the group that owns ``name`` if it is not open there yet, and returns its
        id there. :meth:`acquire` does this itself; call it to learn the id before the first acquire.
        Raises :class:`errors.LeaseLost` once the session is lost or closed."""
        return self._open_in(group_for(name, self.client.groups))

    def _open_in(self, group: int) -> int:
        if self.ids[group]:
            return self.ids[group]
        with self._opening[group]:
            if self.ids[group]:
                return self.ids[group]
            with self._cond:
                if self._lost is None and lease_clock() >= self._valid_until:
                    self._mark_lost_locked("no keepalive succeeded within the TTL")
                if self._lost is not None:
                    raise errors.LeaseLost(self._lost)
            sent = lease_clock()
            hi, lo = _nonce()
            r = self.client.call(
                group,
                "OpenSession",
                lock_pb2.OpenSessionRequest(group=group, ttl_ms=self._requested_ms, nonce_hi=hi, nonce_lo=lo),
            )
            granted = r.ttl_ms / 1000.0
            with self._cond:
                lost = self._lost
                if lost is None:
                    end, due = sent + granted - granted / 10, sent + granted / 3
                    if all(o is None for o in self._opened):  # the first group to open
                        self._valid_until, self._next_due, self.ttl = end, due, granted
                    else:
                        self._valid_until = min(self._valid_until, end)
                        self._next_due = min(self._next_due, due)
                        self.ttl = min(self.ttl, granted)
                    self._opened[group] = (end, due)
                    self._secrets[group] = r.session_secret
                    self.ids[group] = r.session_id
                    self._cond.notify_all()
            if lost is not None:
                # Closed or lost while it opened: close this part too (else its TTL ends it).
                try:
                    self.client.call(
                        group,
                        "CloseSession",
                        lock_pb2.CloseSessionRequest(
                            group=group, session_id=r.session_id, session_secret=r.session_secret
                        ),
                    )
                except Exception:
                    pass
                raise errors.LeaseLost(lost)
            return self.ids[group]

    # -- the lease ---------------------------------------------------------------------------------

    def is_valid(self) -> bool:
        """True while the client-side lease is valid."""
        with self._cond:
            return self._lost is None and lease_clock() < self._valid_until

    def lease_remaining(self) -> Optional[float]:
        """Seconds the lease still runs, or ``None`` if it is lost."""
        with self._cond:
            if self._lost is not None:
                return None
            return max(self._valid_until - lease_clock(), 0.0)

    @property
    def lost_reason(self) -> Optional[str]:
        """Why the lease is lost, or ``None`` while it holds."""
        with self._cond:
            return self._lost

    def wait_lost(self, timeout: Optional[float] = None) -> Optional[str]:
        """Blocks until the lease may be lost (and returns why) or ``timeout`` seconds pass (``None``)."""
        end = None if timeout is None else lease_clock() + timeout
        with self._cond:
            while self._lost is None:
                now = lease_clock()
                if now >= self._valid_until:
                    self._mark_lost_locked("no keepalive succeeded within the TTL")
                    break
                wake = self._valid_until if end is None else min(self._valid_until, end)
                if end is not None and now >= end:
                    return None
                self._cond.wait(wake - now)
            return self._lost

    def _gone(self) -> Optional[str]:
        """Why the lease is lost (marking it if it just ran out), or ``None`` while it holds."""
        with self._cond:
            if self._lost is None and lease_clock() >= self._valid_until:
                self._mark_lost_locked("no keepalive succeeded within the TTL")
            return self._lost

    def _mark_lost_locked(self, why: str) -> None:
        if self._lost is not None:
            return
        self._lost = why
        self._cond.notify_all()
        if self._on_lost is not None:
            callback, self._on_lost = self._on_lost, None
            threading.Thread(target=_call_quietly, args=(callback, why), daemon=True).start()

    def _mark_lost(self, why: str) -> None:
        with self._cond:
            self._mark_lost_locked(why)

    # -- for the client's keepalive thread (holdfast.keepalive) -----------------------------------------

    def _is_due(self, now: float, *, early: bool = False) -> bool:
        """True if a renewal is due (``early``: or due within the next sixth of the TTL); marks the
        session lost if its lease ran out."""
        with self._cond:
            if self._closed or self._lost is not None:
                return False
            if now >= self._valid_until:
                self._mark_lost_locked("no keepalive succeeded within the TTL")
                return False
            return now + (self.ttl / 6 if early else 0.0) >= self._next_due

    def _parts(self) -> list[Optional[tuple[int, bytes]]]:
        """Per group, the session's (id, secret) there, or None where it is not open."""
        with self._cond:
            return [(i, s) if i else None for i, s in zip(self.ids, self._secrets)]

    def _lease_end(self) -> float:
        with self._cond:
            return self._valid_until

    def _renewed(self, sent: float, granted: float, covered: set[int]) -> None:
        """A round sent at ``sent`` renewed the session in the groups ``covered`` with ``granted``. A
        group open now that it did not cover was opened while the round was in flight, maybe sent before
        it: the lease may not outlast what that open gave (and is due when that group is)."""
        with self._cond:
            ttl = min(granted, self.ttl) if self.ttl > 0 else granted
            end, due = sent + ttl - ttl / 10, sent + ttl / 3
            for g, opened in enumerate(self._opened):
                if opened is not None and g not in covered:
                    end, due = min(end, opened[0]), min(due, opened[1])
            self._valid_until = max(self._valid_until, end)
            self._next_due = due
            self._cond.notify_all()

    def _retry_soon(self, at: float) -> None:
        with self._cond:
            self._next_due = at

    # -- locks -------------------------------------------------------------------------------------

    def _request_id(self, group: int) -> int:
        with self._cond:
            rid = self._next_request[group]
            self._next_request[group] += 1
            return rid

    def id_for(self, name: str) -> int:
        """The session id in the group that owns ``name`` (0 if it is not open there yet)."""
        return self.ids[group_for(name, self.client.groups)]

    def acquire(
        self,
        name: str,
        timeout: float = MAX_WAIT,
        *,
        value: bytes = b"",
        shared: bool = False,
        permits: int = 0,
        lock_delay: float = 0.0,
    ) -> "Lock":
        """Acquires ``name``, waiting in its FIFO queue up to ``timeout`` seconds (0: try once), and returns
        the held :class:`Lock`. Raises :class:`errors.LockHeld` if it is still held then.

        ``value`` (at most 1,024 bytes) is stored with the grant (describe shows it); ``shared`` holds it
        as a reader; ``permits`` > 0 makes the name a semaphore of that many permits; ``lock_delay``
        (seconds, at most 60) keeps the lock from anyone for that long after this session *expires*.

        If the outcome is unknown (the call failed after it may have reached the server, or was
        interrupted), the acquire is cancelled through the log before this raises, so no grant is left
        that nobody knows of. A grant that arrives when the lease may have lapsed is released and
        :class:`errors.LeaseLost` raised.
        """
        with self._cond:
            if self._lost is not None:
                raise errors.LeaseLost(self._lost)
        if not 0 <= timeout <= MAX_WAIT:
            raise errors.InvalidArgument(f"timeout {timeout} s is outside 0..={MAX_WAIT:.0f} s")
        group = group_for(name, self.client.groups)
        self._open_in(group)
        request_id = self._request_id(group)
        wait_ms = _ms(timeout)
        started = time.monotonic()

        def request() -> lock_pb2.AcquireRequest:
            left = max(wait_ms - _ms(time.monotonic() - started), 1) if wait_ms else 0
            return lock_pb2.AcquireRequest(
                group=group,
                session_id=self.ids[group],
                request_id=request_id,
                name=name,
                wait_timeout_ms=left,
                value=value,
                client_cancels=True,
                session_secret=self._secrets[group],
                lock_delay_ms=_ms(lock_delay),
                shared=shared,
                permits=permits,
            )

        try:
            # A wait ends as soon as the session is lost (LeaseLost), not when the server expires it.
            r = self.client.call(
                group, "Acquire", Lazy(request), extra=timeout, abort=self._gone if wait_ms else None
            )
        except errors.HoldfastError as e:
            if not e.not_applied:
                self._cancel_in_background(name, group, request_id)
            raise
        except BaseException:
            # Interrupted (KeyboardInterrupt, ...): the server may grant it later; take it back.
            self._cancel_in_background(name, group, request_id)
            raise
        if not self.is_valid():
            # The server may already have expired this session and granted the lock to someone else.
            self._mark_lost("no keepalive succeeded within the TTL")
            self._cancel_in_background(name, group, request_id)
            raise errors.LeaseLost(
                f"the grant of lock {name!r} (token {r.token}) arrived after this session's lease may "
                "have lapsed; it was released (or ends with the session)"
            )
        return Lock(self, name, group, r.token)

    def try_acquire(self, name: str, **options: object) -> "Lock":
        """Acquires ``name`` if it is free; raises :class:`errors.LockHeld` at once otherwise."""
        return self.acquire(name, 0.0, **options)  # type: ignore[arg-type]

    def lock(
        self,
        name: str,
        timeout: float = MAX_WAIT,
        *,
        value: bytes = b"",
        shared: bool = False,
        permits: int = 0,
        lock_delay: float = 0.0,
    ) -> "_LockContext":
        """``with session.lock("name") as lock:`` acquires (as :meth:`acquire`) on entry and releases on
        exit; ``lock.token`` is the fencing token."""
        return _LockContext(
            self,
            name,
            timeout,
            dict(value=value, shared=shared, permits=permits, lock_delay=lock_delay),
        )

    def cancel_acquire(self, name: str, request_id: int) -> None:
        """Cancels the acquire ``request_id`` of ``name``: its wait is removed, or the lock released if it
        was granted. Idempotent."""
        group = self._opened_group(name)
        self.client.call(
            group,
            "CancelAcquire",
            lock_pb2.CancelAcquireRequest(
                group=group,
                session_id=self.ids[group],
                request_id=request_id,
                name=name,
                session_secret=self._secrets[group],
            ),
        )

    def _cancel_in_background(self, name: str, group: int, request_id: int) -> None:
        """Cancels an acquire whose outcome this client will not learn, on a thread of its own, retrying
        until the server answers, the session is gone, or its lease is lost (a lost session is renewed no
        more, so the servers expire it and its locks with it)."""

        def run() -> None:
            while True:
                try:
                    self.cancel_acquire(name, request_id)
                    return
                except errors.SessionUnknown:
                    return
                except (errors.InvalidArgument, errors.LimitExceeded, errors.NotHolder, errors.PermissionDenied) as e:
                    # A policy refusal (ACCESS_DENIED) is retried: a policy fixed within the TTL leaves
                    # the session, and the wait, alive. A wrong secret stays wrong.
                    if e.reason == "ACCESS_DENIED":
                        log.debug("cancelling an abandoned acquire of %r; retrying: %s", name, e)
                    else:
                        log.warning("cancelling an abandoned acquire of %r failed: %s", name, e)
                        return
                except Exception as e:
                    log.debug("cancelling an abandoned acquire of %r; retrying: %s", name, e)
                with self._cond:
                    if self._lost is not None:
                        return
                    self._cond.wait(0.5)

        threading.Thread(target=run, name=f"holdfast-cancel-{request_id}", daemon=True).start()

    def release(self, name: str, token: int) -> None:
        """Releases ``name`` held with ``token``. Raises :class:`errors.StaleToken` or
        :class:`errors.NotHolder` if that grant ended already."""
        group = self._opened_group(name)
        self.client.call(
            group,
            "Release",
            lock_pb2.ReleaseRequest(
                group=group,
                session_id=self.ids[group],
                request_id=self._request_id(group),
                name=name,
                token=token,
                session_secret=self._secrets[group],
            ),
        )

    def _opened_group(self, name: str) -> int:
        """The group of ``name``, where this session must be open to hold or wait for it."""
        group = group_for(name, self.client.groups)
        if not self.ids[group]:
            raise errors.NotHolder(f"this session was never opened in group {group}: it holds no lock there")
        return group

    def campaign(self, role: str, value: bytes = b"") -> "Leadership":
        """Waits in line (FIFO) until this session leads ``role``; see :mod:`holdfast.election`."""
        from holdfast.election import Leadership

        while True:
            try:
                return Leadership(self.acquire(role, MAX_WAIT, value=value), value)
            except errors.LockHeld:
                continue

    # -- closing -----------------------------------------------------------------------------------

    def _close_groups(self, *, best_effort: bool) -> None:
        # A group still opening sees the loss when its open returns and closes itself (_open_in).
        for group, (sid, secret) in enumerate(zip(self.ids, self._secrets)):
            if not sid:
                continue
            try:
                self.client.call(
                    group,
                    "CloseSession",
                    lock_pb2.CloseSessionRequest(group=group, session_id=sid, session_secret=secret),
                )
            except errors.SessionUnknown:
                pass
            except Exception:
                if not best_effort:
                    raise

    def close(self) -> None:
        """Closes the session in every group it is open in, releasing all its locks, and stops the
        keepalives. The
        lease ends first, so no thread of this process still acts as a holder once a lock is free."""
        with self._cond:
            if self._closed:
                return
            self._closed = True
            self._mark_lost_locked("session closed")
        self._close_groups(best_effort=False)

    def __enter__(self) -> "Session":
        return self

    def __exit__(
        self,
        kind: Optional[type[BaseException]],
        exc: Optional[BaseException],
        tb: Optional[TracebackType],
    ) -> None:
        try:
            self.close()
        except errors.HoldfastError:
            if kind is None:
                raise
            log.warning("closing the session failed", exc_info=True)


class Lock:
    """A lock held by a :class:`Session`, with its fencing token."""

    def __init__(self, session: Session, name: str, group: int, token: int) -> None:
        self.session = session
        self.name = name
        self.group = group
        #: The fencing token of this grant: send it with every write to the protected resource.
        self.token = token
        self.released = False

    def is_valid(self) -> bool:
        """True while the session's lease is valid (stop acting as the holder once it is not)."""
        return not self.released and self.session.is_valid()

    def release(self) -> None:
        """Releases the lock. Raises :class:`errors.StaleToken` or :class:`errors.NotHolder` if the grant
        ended already (the session expired and someone else may hold it now)."""
        if self.released:
            return
        self.released = True
        self.session.release(self.name, self.token)

    def __repr__(self) -> str:
        return f"Lock(name={self.name!r}, token={self.token}, session={self.session.ids[self.group]})"


class _LockContext:
    def __init__(self, session: Session, name: str, timeout: float, options: dict[str, object]) -> None:
        self._session, self._name, self._timeout, self._options = session, name, timeout, options
        self._lock: Optional[Lock] = None

    def __enter__(self) -> Lock:
        self._lock = self._session.acquire(self._name, self._timeout, **self._options)  # type: ignore[arg-type]
        return self._lock

    def __exit__(
        self,
        kind: Optional[type[BaseException]],
        exc: Optional[BaseException],
        tb: Optional[TracebackType],
    ) -> None:
        assert self._lock is not None
        try:
            self._lock.release()
        except Exception:
            # Raised only when the block itself succeeded (a grant that ended before the block did means
            # its work may not have been exclusive, and the caller must hear of it); never in place of
            # the block's own exception.
            if kind is None:
                raise
            log.warning("releasing %r failed", self._name, exc_info=True)


def _call_quietly(callback: Callable[[str], None], why: str) -> None:
    try:
        callback(why)
    except Exception:
        log.exception("the on_lost callback raised")
