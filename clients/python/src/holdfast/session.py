"""Sessions, their keepalive thread and client-side lease, and held locks (the twin of
crates/client/src/session.rs and guard.rs).

The lease follows the Rust client's rule: it is counted on this process's monotonic clock from the moment
the last successful keepalive was **sent** (the server restarted the TTL when it *received* it, which is
later), minus a safety margin of a tenth of the TTL for clock-rate differences. So the lease ends (and
``lost`` fires) before the server can expire the session, and an application that stops acting as the
holder when it fires never overlaps with the next holder, as long as clocks tick at about the same rate.
Fencing tokens cover the rest: send :attr:`Lock.token` with every write to the protected resource.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import weakref
from types import TracebackType
from typing import TYPE_CHECKING, Callable, Optional

from holdfast import errors
from holdfast.client import Lazy, group_for
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
    """A session: one per group of the cluster under the hood, renewed together by a background thread
    every TTL/3. Locks hang off it: when it is closed or expires, its locks are released.

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
        started = time.monotonic()
        self.ids: list[int] = []
        self._secrets: list[bytes] = []
        granted = float("inf")
        try:
            for group in range(client.groups):
                hi, lo = _nonce()
                r = client.call(
                    group,
                    "OpenSession",
                    lock_pb2.OpenSessionRequest(group=group, ttl_ms=_ms(ttl), nonce_hi=hi, nonce_lo=lo),
                )
                self.ids.append(r.session_id)
                self._secrets.append(r.session_secret)
                granted = min(granted, r.ttl_ms / 1000.0)
        except BaseException:
            # The sessions opened in the groups before would hold memory until their TTL ran out.
            self._close_groups(best_effort=True)
            raise
        self.ttl = granted
        self._valid_until = started + granted - granted / 10
        self._next_due = started + granted / 3
        self._next_request = [1] * len(self.ids)
        # The thread holds the session only weakly (between rounds), so a session nobody refers to any
        # more (no Session, no Lock) stops being renewed and the servers expire it, as in Rust.
        self._thread = threading.Thread(
            target=_keepalive_loop,
            args=(weakref.ref(self), self._cond),
            name=f"holdfast-keepalive-{self.ids[0]}",
            daemon=True,
        )
        self._thread.start()

    # -- the lease ---------------------------------------------------------------------------------

    def is_valid(self) -> bool:
        """True while the client-side lease is valid."""
        with self._cond:
            return self._lost is None and time.monotonic() < self._valid_until

    def lease_remaining(self) -> Optional[float]:
        """Seconds the lease still runs, or ``None`` if it is lost."""
        with self._cond:
            if self._lost is not None:
                return None
            return max(self._valid_until - time.monotonic(), 0.0)

    @property
    def lost_reason(self) -> Optional[str]:
        """Why the lease is lost, or ``None`` while it holds."""
        with self._cond:
            return self._lost

    def wait_lost(self, timeout: Optional[float] = None) -> Optional[str]:
        """Blocks until the lease may be lost (and returns why) or ``timeout`` seconds pass (``None``)."""
        end = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while self._lost is None:
                now = time.monotonic()
                if now >= self._valid_until:
                    self._mark_lost_locked("no keepalive succeeded within the TTL")
                    break
                wake = self._valid_until if end is None else min(self._valid_until, end)
                if end is not None and now >= end:
                    return None
                self._cond.wait(wake - now)
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

    def _keepalive_step(self) -> Optional[float]:
        """Renews the session if a round is due. Returns how long to wait before the next step, or
        ``None`` when the keepalives are over (closed or lost)."""
        with self._cond:
            if self._closed or self._lost is not None:
                return None
            now = time.monotonic()
            if now >= self._valid_until:
                self._mark_lost_locked("no keepalive succeeded within the TTL")
                return None
            if now < self._next_due:
                return min(self._next_due, self._valid_until) - now
            valid_until = self._valid_until
        sent = time.monotonic()
        try:
            granted = self._renew(valid_until)
        except errors.SessionUnknown as e:
            self._mark_lost(f"the server expired or closed the session: {e}")
            return None
        except Exception as e:  # unavailable: try again soon, until the lease runs out
            log.debug("keepalive failed; retrying: %s", e)
            with self._cond:
                self._next_due = time.monotonic() + 0.2
            return 0.0
        with self._cond:
            self._valid_until = max(self._valid_until, sent + granted - granted / 10)
            self._next_due = max(self._next_due, sent + granted / 3)
            self._cond.notify_all()
        return 0.0

    def _renew(self, valid_until: float) -> float:
        """One keepalive round over every group; the smallest TTL granted, in seconds."""
        granted = float("inf")
        for group, (sid, secret) in enumerate(zip(self.ids, self._secrets)):
            r = self.client.call(
                group,
                "KeepAlive",
                lock_pb2.KeepAliveRequest(group=group, session_ids=[sid], session_secrets=[secret]),
                deadline=valid_until,
            )
            if not r.results or not r.results[0].alive:
                raise errors.SessionUnknown(f"session {sid} is not alive")
            granted = min(granted, r.results[0].ttl_ms / 1000.0)
        return granted

    # -- locks -------------------------------------------------------------------------------------

    def _request_id(self, group: int) -> int:
        with self._cond:
            rid = self._next_request[group]
            self._next_request[group] += 1
            return rid

    def id_for(self, name: str) -> int:
        """The session id in the group that owns ``name``."""
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
            r = self.client.call(group, "Acquire", Lazy(request), extra=timeout)
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
        group = group_for(name, self.client.groups)
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
                except (errors.InvalidArgument, errors.NotHolder, errors.PermissionDenied) as e:
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
        group = group_for(name, self.client.groups)
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
        for group, (sid, secret) in enumerate(zip(self.ids, self._secrets)):
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
        """Closes the session in every group, releasing all its locks, and stops the keepalives. The
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


def _keepalive_loop(ref: "weakref.ref[Session]", cond: threading.Condition) -> None:
    while True:
        session = ref()
        if session is None:
            return
        wait = session._keepalive_step()
        del session  # not held while waiting
        if wait is None:
            return
        if wait > 0:
            with cond:
                cond.wait(wait)


def _call_quietly(callback: Callable[[str], None], why: str) -> None:
    try:
        callback(why)
    except Exception:
        log.exception("the on_lost callback raised")
