"""Endpoints, leader following and retries (the Python twin of crates/client/src/client.rs).

Each write goes to the server believed to lead the lock's group. A ``NOT_LEADER`` answer names the leader
and the request is sent there at once; an unreachable server, an election in progress or an unknown
outcome make the client try the next server after a backoff (20 ms doubling to 200 ms, each pause
jittered between half and all of that), until the request's deadline. Every attempt has its own timeout,
so a silent (partitioned or paused) server costs at most one attempt. A retried write carries the same
request id (or session nonce), which the server deduplicates: it never acts twice.
"""

from __future__ import annotations

import random
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Optional, Sequence, Union

import grpc

from holdfast import errors
from holdfast.v1 import lock_pb2, lock_pb2_grpc

if TYPE_CHECKING:
    from holdfast.election import Leader
    from holdfast.session import Session

#: Most servers one client keeps channels to (a cluster has 3 or 5; a misconfigured one could name
#: endless addresses).
MAX_SERVERS = 64

_CHANNEL_OPTIONS = [
    # Pings find a dead (half-open) connection in ~4 s, as the Rust client's do.
    ("grpc.keepalive_time_ms", 2000),
    ("grpc.keepalive_timeout_ms", 2000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
    # Fail fast on a dead server (the retry loop moves on) instead of gRPC's own reconnect backoff.
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
    ("grpc.enable_retries", 0),
]


def group_for(name: str, groups: int) -> int:
    """FNV-1a 64 of the name's UTF-8 bytes modulo the group count: the group that owns a lock name (the
    same function as the server's and the Rust client's)."""
    h = 0xCBF29CE484222325
    for b in name.encode("utf-8"):
        h ^= b
        h = (h * 0x100000001B3) & 0xFFFFFFFFFFFFFFFF
    return h % max(groups, 1)


def check_endpoint(endpoint: str) -> None:
    """Raises :class:`errors.InvalidArgument` unless ``endpoint`` is ``host:port``."""

    def bad(why: str) -> errors.InvalidArgument:
        return errors.InvalidArgument(f"endpoint {endpoint!r} {why}")

    if "://" in endpoint:
        raise bad("has a scheme: give host:port, such as 127.0.0.1:7001")
    host, sep, port = endpoint.rpartition(":")
    if not sep:
        raise bad("is not host:port (such as 127.0.0.1:7001)")
    if not host or any(c.isspace() for c in host) or "/" in host:
        raise bad("has no valid host: give host:port, such as 127.0.0.1:7001")
    if not port.isdigit() or not 0 < int(port) < 65536:
        raise bad("has no valid port (1..=65535)")


@dataclass
class Tls:
    """TLS for every connection: the cluster's CA (PEM bytes), and a client certificate and key when the
    servers ask for one (docs/security.md)."""

    ca: bytes
    cert: Optional[bytes] = None
    key: Optional[bytes] = None

    @classmethod
    def from_files(cls, ca: str, cert: Optional[str] = None, key: Optional[str] = None) -> "Tls":
        def read(path: Optional[str]) -> Optional[bytes]:
            if path is None:
                return None
            with open(path, "rb") as f:
                return f.read()

        return cls(ca=read(ca) or b"", cert=read(cert), key=read(key))


class Lazy:
    """A request built afresh for every attempt (a retried acquire waits only for what is left)."""

    def __init__(self, build: Callable[[], Any]) -> None:
        self.build = build


# How long after a server failed a call a redirect to it is not followed: a server that left a group
# still names the last leader it heard of, which may be dead, and following it would go dead server,
# stale server, dead server, ... without ever trying the others (as the Rust client's REDIRECT_DISTRUST).
REDIRECT_DISTRUST = 2.0


class _Server:
    def __init__(self, endpoint: str, channel: grpc.Channel) -> None:
        self.endpoint = endpoint
        self.channel = channel
        self.stub = lock_pb2_grpc.HoldfastStub(channel)  # type: ignore[no-untyped-call]
        # time.monotonic() of the last failed call to it (see REDIRECT_DISTRUST).
        self.failed: Optional[float] = None


class Client:
    """A connection to a Holdfast cluster, safe to share between threads.

    ``endpoints`` are some of the servers' client endpoints (``host:port``, a list or a comma-separated
    string); one reachable server is enough, the client learns the others from it (unless
    ``discover=False``, for servers reached through addresses other than the ones they advertise).
    """

    def __init__(
        self,
        endpoints: Union[str, Sequence[str]],
        *,
        request_timeout: float = 15.0,
        attempt_timeout: float = 3.0,
        discover: bool = True,
        tls: Optional[Tls] = None,
        token: Optional[str] = None,
    ) -> None:
        if isinstance(endpoints, str):
            endpoints = [e.strip() for e in endpoints.split(",") if e.strip()]
        if not endpoints:
            raise errors.InvalidArgument("no endpoints given")
        self.request_timeout = request_timeout
        self.attempt_timeout = attempt_timeout
        self.discover = discover
        self._tls = tls
        self._metadata: tuple[tuple[str, str], ...] = ()
        if token is not None:
            if any(ord(c) < 0x20 or ord(c) > 0x7E for c in token):
                raise errors.InvalidArgument("the token has characters a header cannot carry")
            self._metadata = (("authorization", f"Bearer {token}"),)
        self._lock = threading.Lock()
        self._servers: list[_Server] = []
        for ep in endpoints:
            check_endpoint(ep)
            self._servers.append(_Server(ep, self._channel(ep)))
        self._random = random.Random()  # seeded from the OS: retry pauses spread across clients
        self.groups = 1
        self._leaders: list[int] = [0]
        self._connect(list(endpoints))
        from holdfast.keepalive import Registry

        #: Renews every session of this client, one message per leading server per round.
        self._keepalives = Registry(self)

    # -- connections -------------------------------------------------------------------------------

    def _channel(self, endpoint: str) -> grpc.Channel:
        if self._tls is None:
            return grpc.insecure_channel(endpoint, options=_CHANNEL_OPTIONS)
        creds = grpc.ssl_channel_credentials(
            root_certificates=self._tls.ca,
            private_key=self._tls.key,
            certificate_chain=self._tls.cert,
        )
        return grpc.secure_channel(endpoint, creds, options=_CHANNEL_OPTIONS)

    def _connect(self, endpoints: list[str]) -> None:
        """Learns the group count, the members and a first leader per group from any server."""
        deadline = time.monotonic() + self.request_timeout
        problems = ["" for _ in endpoints]
        while True:
            not_holdfast = denied = 0
            for i, ep in enumerate(endpoints):
                try:
                    s = self._servers[i].stub.Status(
                        lock_pb2.StatusRequest(), timeout=self.attempt_timeout, metadata=self._metadata
                    )
                except grpc.RpcError as e:
                    code = e.code() if hasattr(e, "code") else None
                    not_holdfast += code == grpc.StatusCode.UNIMPLEMENTED
                    denied += code == grpc.StatusCode.PERMISSION_DENIED
                    problems[i] = f"{ep}: {_describe(e)}"
                    continue
                self.groups = max(s.group_count, 1)
                if self.discover:
                    for m in s.members:
                        self._index_or_add(m.client_endpoint)
                leaders = []
                for g in range(self.groups):
                    hint = next((gs.leader_endpoint for gs in s.groups if gs.group == g), "")
                    known = [j for j, srv in enumerate(self._servers) if srv.endpoint == hint]
                    leaders.append(known[0] if known else i)
                self._leaders = leaders
                return
            if denied == len(endpoints):
                raise errors.PermissionDenied("; ".join(problems))
            if not_holdfast == len(endpoints) or time.monotonic() > deadline:
                raise errors.Unavailable("no server answered: " + "; ".join(problems))
            time.sleep(0.1)

    def _index_or_add(self, endpoint: str) -> Optional[int]:
        with self._lock:
            for i, s in enumerate(self._servers):
                if s.endpoint == endpoint:
                    return i
            if not self.discover or len(self._servers) >= MAX_SERVERS:
                return None
            try:
                check_endpoint(endpoint)
            except errors.InvalidArgument:
                return None
            self._servers.append(_Server(endpoint, self._channel(endpoint)))
            return len(self._servers) - 1

    @property
    def endpoints(self) -> list[str]:
        """Every server this client knows: the endpoints given, then the members the cluster named."""
        with self._lock:
            return [s.endpoint for s in self._servers]

    def close(self) -> None:
        """Closes every connection."""
        with self._lock:
            for s in self._servers:
                s.channel.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- the retry loop ----------------------------------------------------------------------------

    def _server(self, index: int) -> _Server:
        with self._lock:
            return self._servers[index]

    def _leader_of(self, group: int) -> int:
        with self._lock:
            return self._leaders[group] if group < len(self._leaders) else 0

    def _redirect_target(self, endpoint: str) -> Optional[int]:
        """The server a redirect to ``endpoint`` should go to, unless it failed a call within
        ``REDIRECT_DISTRUST`` seconds (then the caller moves on to the next server)."""
        i = self._index_or_add(endpoint)
        if i is None:
            return None
        failed = self._server(i).failed
        if failed is not None and time.monotonic() - failed < REDIRECT_DISTRUST:
            return None
        return i

    def _mark_failed(self, index: int) -> None:
        self._server(index).failed = time.monotonic()

    def _mark_answered(self, index: int) -> None:
        """Server ``index`` answered (an error it sent included): a failure marked before no longer
        holds. A restarted server may be the leader its peers redirect to a moment later."""
        self._server(index).failed = None

    def _set_leader(self, group: int, index: int) -> None:
        with self._lock:
            if group < len(self._leaders):
                self._leaders[group] = index

    def call(
        self,
        group: int,
        method: str,
        request: Any,
        *,
        extra: float = 0.0,
        deadline: Optional[float] = None,
        abort: Optional[Callable[[], Optional[str]]] = None,
    ) -> Any:
        """Sends ``request`` to ``method`` (e.g. ``"Acquire"``) on ``group``'s leader, following redirects
        and retrying until ``deadline`` (``time.monotonic()`` seconds; default: ``request_timeout`` +
        ``extra`` from now). ``extra`` also lengthens each attempt (a waiting acquire's wait). ``abort``,
        asked every 100 ms while an attempt runs and before each retry, ends the call with
        :class:`errors.LeaseLost` (its reason) as soon as it returns one: a waiting acquire of a session
        that was lost meanwhile."""
        if deadline is None:
            deadline = time.monotonic() + self.request_timeout + extra
        target = self._leader_of(group)
        backoff = 0.02
        redirects = 0
        # Why an earlier attempt's outcome is unknown (it timed out, or failed in a way that may have come
        # after the server took it): a later refusal that can change between attempts is then no proof
        # that nothing was applied (see errors.refused_for_now).
        unknown: Optional[str] = None
        while True:
            with self._lock:
                server = self._servers[target]
                count = len(self._servers)
            limit = min(self.attempt_timeout + extra, deadline - time.monotonic())
            if limit <= 0:
                raise errors.Unavailable(f"no server completed {method} in time")
            why = abort() if abort is not None else None
            if why is not None:
                raise errors.LeaseLost(why)
            try:
                message = request.build() if isinstance(request, Lazy) else request
                rpc = getattr(server.stub, method)
                if abort is None:
                    response = rpc(message, timeout=limit, metadata=self._metadata)
                else:
                    response = self._abortable(rpc, message, limit, abort)
                self._mark_answered(target)
                self._set_leader(group, target)
                return response
            except grpc.RpcError as e:
                outcome = errors.from_rpc_error(e)
            if errors.answered(outcome):
                self._mark_answered(target)
            if isinstance(outcome, errors.Redirect):
                i = self._redirect_target(outcome.endpoint)
                if i is not None and redirects < 2 * count:
                    redirects += 1
                    target = i
                    self._set_leader(group, i)
                    continue
                reason = (
                    f"redirected to {outcome.endpoint}, which is not among the endpoints (discovery is off)"
                    if i is None and not self.discover
                    else f"redirected too often, or to an unusable endpoint or one that failed a moment ago ({outcome.endpoint})"
                )
            elif isinstance(outcome, errors.Retry):
                if not outcome.answered:
                    self._mark_failed(target)
                reason = f"{server.endpoint}: {outcome}"
                unknown = reason
            elif unknown is not None and errors.refused_for_now(outcome):
                raise errors.Unavailable(
                    f"a retry was refused ({outcome}), but an earlier attempt may have been applied ({unknown})"
                ) from outcome
            else:
                raise outcome
            pause = backoff / 2 + self._random.random() * (backoff / 2)
            if time.monotonic() + pause > deadline:
                raise errors.Unavailable(reason)
            time.sleep(pause)
            backoff = min(backoff * 2, 0.2)
            target = (target + 1) % count
            redirects = 0

    def _abortable(self, rpc: Any, message: Any, limit: float, abort: Callable[[], Optional[str]]) -> Any:
        """One attempt of ``rpc`` that ends early with :class:`errors.LeaseLost` once ``abort`` says so
        (the call is cancelled; the caller cancels what it may have queued)."""
        future = rpc.future(message, timeout=limit, metadata=self._metadata)
        try:
            while True:
                try:
                    return future.result(timeout=0.1)
                except grpc.FutureTimeoutError:
                    why = abort()
                    if why is not None:
                        raise errors.LeaseLost(why) from None
        finally:
            # Whatever ends the wait (the lease, an interrupt) ends the call; a no-op once it finished.
            future.cancel()

    # -- reads -------------------------------------------------------------------------------------

    def describe(self, name: str) -> Optional[lock_pb2.LockInfo]:
        """The lock ``name`` (linearizable): holders, token, waiters; ``None`` if it is free."""
        group = group_for(name, self.groups)
        r = self.call(group, "Describe", lock_pb2.DescribeRequest(group=group, name=name))
        return r.lock if r.HasField("lock") else None

    def list_locks(self, prefix: str = "") -> list[lock_pb2.LockInfo]:
        """Every lock whose name starts with ``prefix``, in every group (linearizable per group), in name
        order."""
        out: list[lock_pb2.LockInfo] = []
        for group in range(self.groups):
            after = ""
            while True:
                page = self.call(
                    group,
                    "ListLocks",
                    lock_pb2.ListLocksRequest(group=group, prefix=prefix, after=after, limit=1000),
                )
                out.extend(page.locks)
                if not page.more or not page.locks:
                    break
                after = page.locks[-1].name
        out.sort(key=lambda lock: lock.name)
        return out

    def list_sessions(self) -> list[tuple[int, lock_pb2.SessionInfo]]:
        """Every session of every group as ``(group, info)`` (linearizable per group)."""
        out: list[tuple[int, lock_pb2.SessionInfo]] = []
        for group in range(self.groups):
            after = 0
            while True:
                page = self.call(
                    group,
                    "ListSessions",
                    lock_pb2.ListSessionsRequest(group=group, after=after, limit=1000),
                )
                out.extend((group, s) for s in page.sessions)
                if not page.more or not page.sessions:
                    break
                after = page.sessions[-1].session_id
        return out

    def status(self, endpoint: Optional[str] = None) -> lock_pb2.StatusResponse:
        """One server's own view of the cluster (not linearizable): the first endpoint's, or ``endpoint``'s."""
        i = 0 if endpoint is None else self._index_or_add(endpoint)
        if i is None:
            raise errors.InvalidArgument(f"unknown endpoint {endpoint!r}")
        with self._lock:
            server = self._servers[i]
        try:
            status: lock_pb2.StatusResponse = server.stub.Status(
                lock_pb2.StatusRequest(), timeout=self.attempt_timeout, metadata=self._metadata
            )
            return status
        except grpc.RpcError as e:
            raise errors.Unavailable(f"{server.endpoint}: {_describe(e)}") from None

    def leader(self, role: str) -> Optional["Leader"]:
        """Who leads ``role`` now (linearizable), if anyone (see :meth:`Session.campaign`)."""
        from holdfast.election import Leader

        lock = self.describe(role)
        if lock is None or lock.delayed:
            return None
        return Leader(value=lock.holder_value, epoch=lock.token, session=lock.holder_session_id)

    # -- sessions ----------------------------------------------------------------------------------

    def session(self, ttl: float = 10.0, *, on_lost: Optional[Callable[[str], None]] = None) -> "Session":
        """Opens a session with ``ttl`` seconds (0: the server's default, 10 s), kept alive by this
        client's keepalive thread. With one group it is opened now; with several, in each group at its
        first use there (:meth:`Session.open_for`). Use it as a context manager (``with client.session()
        as s:``) to close it at the end."""
        from holdfast.session import Session

        return Session(self, ttl, on_lost=on_lost)


def _describe(e: grpc.RpcError) -> str:
    code = e.code() if hasattr(e, "code") else None
    details = e.details() if hasattr(e, "details") else str(e)
    if code == grpc.StatusCode.UNIMPLEMENTED:
        return "not a Holdfast client port (it does not serve holdfast.v1.Holdfast: a peer or HTTP port?)"
    return f"{code.name if code else 'error'}: {details}"

