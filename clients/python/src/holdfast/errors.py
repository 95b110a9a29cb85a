"""Errors: one exception class per reason the server gives (proto/holdfast/v1/lock.proto, ``Reason``).

Every server error carries an ``ErrorDetail`` (binary protobuf in the status details) with a
machine-readable reason; :func:`from_rpc_error` turns a failed call into the matching exception, with the
server's message and the detail's fields. The classes mirror the Rust client's ``Error`` enum.
"""

from __future__ import annotations

from typing import Optional

import grpc


class HoldfastError(Exception):
    """Base class of every Holdfast error. ``reason`` is the server's reason name (e.g. ``"LOCK_HELD"``),
    or ``""`` for an error the client raised itself."""

    reason: str = ""

    def __init__(self, message: str, *, reason: Optional[str] = None) -> None:
        super().__init__(message)
        self.message = message
        if reason is not None:
            self.reason = reason

    @property
    def not_applied(self) -> bool:
        """True if the request certainly was not applied. False if it may have been (a retried request can
        have been applied by an earlier attempt before a later one failed)."""
        return False


class NotApplied(HoldfastError):
    """A refusal: the request certainly changed nothing."""

    @property
    def not_applied(self) -> bool:
        return True


class LockHeld(NotApplied):
    """A try-acquire found the lock held, or a wait ran out. ``holder_session`` and ``token`` name the
    holder (0 if unknown)."""

    reason = "LOCK_HELD"

    def __init__(self, message: str, *, holder_session: int = 0, token: int = 0) -> None:
        super().__init__(message)
        self.holder_session = holder_session
        self.token = token


class SessionUnknown(HoldfastError):
    """The session is gone (closed or expired); its locks are released."""

    reason = "SESSION_UNKNOWN"


class StaleToken(NotApplied):
    """A release (or fenced write) with a token that is not the current one. ``current`` is the newest
    token the server or resource has seen."""

    reason = "STALE_TOKEN"

    def __init__(self, message: str, *, current: int = 0) -> None:
        super().__init__(message)
        self.current = current


class NotHolder(NotApplied):
    """A release of a lock the session does not hold."""

    reason = "NOT_HOLDER"


class AlreadyHeld(NotApplied):
    """The session already holds or waits for this lock under another request."""

    reason = "ALREADY_HELD"


class LimitExceeded(NotApplied):
    """A limit was exceeded: ``limit`` names it (e.g. ``"max_name_bytes"``), ``value`` is its value."""

    reason = "LIMIT_EXCEEDED"

    def __init__(self, message: str, *, limit: str = "", value: int = 0) -> None:
        super().__init__(message)
        self.limit = limit
        self.value = value


class InvalidArgument(NotApplied):
    """A malformed request (bad name, TTL out of range, a name sent to the wrong group, ...)."""

    reason = "INVALID_ARGUMENT"


class RequestIdTooOld(HoldfastError):
    """The request id fell out of the session's deduplication window."""

    reason = "REQUEST_ID_TOO_OLD"


class PermissionDenied(NotApplied):
    """The request lacked the session's secret, or the access policy refuses the caller."""

    reason = "PERMISSION_DENIED"


class Abandoned(HoldfastError):
    """A retry of an acquire that was cancelled: nothing is held or queued for it."""

    reason = "ACQUIRE_ABANDONED"


class PermitsMismatch(NotApplied):
    """The acquire asked for a semaphore of another size (or a lock while the name is a semaphore, or the
    other way round). ``permits`` is what the name is now (0: a lock)."""

    reason = "PERMITS_MISMATCH"

    def __init__(self, message: str, *, permits: int = 0) -> None:
        super().__init__(message)
        self.permits = permits


class Compacted(HoldfastError):
    """A watch position older than the events the servers keep."""

    reason = "COMPACTED"


class Unavailable(HoldfastError):
    """No server completed the request in time: the outcome may be unknown."""

    reason = "UNAVAILABLE"


class LeaseLost(HoldfastError):
    """The session's lease may have expired on the server: stop acting as the holder of its locks."""

    reason = "LEASE_LOST"


class Redirect(Exception):
    """Internal: a NOT_LEADER answer naming the leader's client endpoint."""

    def __init__(self, endpoint: str) -> None:
        super().__init__(endpoint)
        self.endpoint = endpoint


class Retry(Exception):
    """Internal: an attempt failed in a way another server (or a later try) may not. ``answered``: a
    Holdfast server said so (an error with its detail), rather than the transport or a proxy."""

    def __init__(self, message: str, answered: bool = False) -> None:
        super().__init__(message)
        self.answered = answered


# Limits a server checks before the lock table that depend on more than the request: the calls its
# connection has in flight at the moment.
_LIMITS_OF_THE_MOMENT = ("max_calls_per_connection", "max_calls_per_stream")


def refused_for_now(outcome: Exception) -> bool:
    """True for a refusal a server makes before the request reaches the lock table, on grounds that can
    change between two attempts of one request: the access policy (ACCESS_DENIED; a reload changes it)
    and the limits on calls in flight. A retry can meet one while an earlier attempt, whose answer never
    arrived, was applied (queued or granted): such a refusal speaks for the retry only. Every other
    refusal either refuses every attempt alike (checks of the request's own fields, its session's
    secret) or is the lock table's answer, which the table gives a request id it has seen from its
    deduplication window: either way the request's own outcome."""
    if isinstance(outcome, PermissionDenied):
        return outcome.reason == "ACCESS_DENIED"
    return isinstance(outcome, LimitExceeded) and outcome.limit in _LIMITS_OF_THE_MOMENT


def answered(outcome: Exception) -> bool:
    """True if a Holdfast server sent ``outcome`` (a redirect, or a retry with its detail): the server is up."""
    return isinstance(outcome, Redirect) or (isinstance(outcome, Retry) and outcome.answered)


_RETRY_CODES = {
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.UNKNOWN,
    grpc.StatusCode.CANCELLED,
    grpc.StatusCode.DEADLINE_EXCEEDED,
    grpc.StatusCode.INTERNAL,
}


def _detail(error: grpc.RpcError) -> Optional[object]:
    from holdfast.v1 import lock_pb2

    trailing = error.trailing_metadata() if hasattr(error, "trailing_metadata") else None
    for key, value in trailing or ():
        if key == "grpc-status-details-bin" and isinstance(value, bytes):
            detail = lock_pb2.ErrorDetail()
            try:
                detail.ParseFromString(value)
            except Exception:  # not a Holdfast server's detail
                return None
            return detail if detail.reason != 0 else None
    return None


def from_rpc_error(error: grpc.RpcError) -> Exception:
    """Classifies a failed call: a :class:`HoldfastError` to raise, or an internal :class:`Redirect` or
    :class:`Retry` for the retry loop."""
    code = error.code() if hasattr(error, "code") else grpc.StatusCode.UNKNOWN
    message = (error.details() if hasattr(error, "details") else None) or str(code)
    return classify(code, message, _detail(error))


def from_group_answer(code: int, message: str, detail: Optional[object]) -> Exception:
    """Classifies one group's failed part of a batched keepalive (``GroupKeepAliveResult``: the gRPC
    code as a number, its message and error detail), as :func:`from_rpc_error` would the same failure
    of a keepalive for that group alone."""
    status = next((c for c in grpc.StatusCode if c.value[0] == code), grpc.StatusCode.UNKNOWN)
    reason = getattr(detail, "reason", 0)
    return classify(status, message or str(status), detail if reason else None)


def classify(code: grpc.StatusCode, message: str, d: Optional[object]) -> Exception:
    """The exception for a failure with ``code``, ``message`` and Holdfast error detail ``d`` (None if
    the failure carried none)."""
    from holdfast.v1 import lock_pb2

    if d is None:
        if code == grpc.StatusCode.UNIMPLEMENTED:
            return Unavailable(
                "not a Holdfast client port (it does not serve holdfast.v1.Holdfast: a peer or HTTP port?)"
            )
        if code in _RETRY_CODES:
            return Retry(f"{code.name}: {message}")
        if code == grpc.StatusCode.INVALID_ARGUMENT:
            return InvalidArgument(message)
        return HoldfastError(f"{code.name}: {message}")
    R = lock_pb2.Reason
    reason = d.reason  # type: ignore[attr-defined]
    name = R.Name(reason) if reason in R.values() else "REASON_UNSPECIFIED"
    if reason == R.NOT_LEADER and d.leader_endpoint:  # type: ignore[attr-defined]
        return Redirect(d.leader_endpoint)  # type: ignore[attr-defined]
    if reason in (R.NOT_LEADER, R.UNAVAILABLE, R.REASON_UNSPECIFIED) or name == "REASON_UNSPECIFIED":
        return Retry(message, answered=True)
    if reason == R.LOCK_HELD:
        return LockHeld(message, holder_session=d.holder_session_id, token=d.current_token)  # type: ignore[attr-defined]
    if reason == R.STALE_TOKEN:
        return StaleToken(message, current=d.current_token)  # type: ignore[attr-defined]
    if reason == R.LIMIT_EXCEEDED:
        return LimitExceeded(message, limit=d.limit, value=d.limit_value)  # type: ignore[attr-defined]
    if reason == R.PERMITS_MISMATCH:
        return PermitsMismatch(message, permits=d.limit_value)  # type: ignore[attr-defined]
    simple: dict[int, type[HoldfastError]] = {
        R.SESSION_UNKNOWN: SessionUnknown,
        R.NOT_HOLDER: NotHolder,
        R.ALREADY_HELD: AlreadyHeld,
        R.INVALID_ARGUMENT: InvalidArgument,
        R.WRONG_GROUP: InvalidArgument,
        R.REQUEST_ID_TOO_OLD: RequestIdTooOld,
        R.REQUEST_ID_TOO_NEW: InvalidArgument,
        R.PERMISSION_DENIED: PermissionDenied,
        R.ACCESS_DENIED: PermissionDenied,
        R.ACQUIRE_ABANDONED: Abandoned,
        R.COMPACTED: Compacted,
        R.WATCH_TOO_SLOW: Compacted,
    }
    cls = simple.get(reason, HoldfastError)
    e = cls(message)
    e.reason = name
    return e
