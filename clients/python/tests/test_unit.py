"""The client's safety paths against scripted servers: error classification, retries keeping the request
id, redirects, the cancel of an acquire whose outcome is unknown, a grant that arrives after the lease
lapsed, the lease rule, and a forgotten session that stops being renewed. The servers here are in-process
fakes that answer each RPC as the test scripts it (the real cluster tests cover the rest), so faults that
are hard to cause on a real cluster at an exact moment can be placed exactly."""

from __future__ import annotations

import gc
import threading
import time
from typing import Any, Callable, Optional

import grpc
import pytest

import holdfast
from holdfast import errors
from holdfast.client import Client, _Server
from holdfast.v1 import lock_pb2


class FakeRpcError(grpc.RpcError):
    def __init__(self, code: grpc.StatusCode, message: str = "", detail: Optional[lock_pb2.ErrorDetail] = None):
        super().__init__(message)
        self._code, self._message = code, message
        self._trailing = (
            (("grpc-status-details-bin", detail.SerializeToString()),) if detail is not None else ()
        )

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._message

    def trailing_metadata(self) -> Any:
        return self._trailing


def reason(r: int, code: grpc.StatusCode = grpc.StatusCode.FAILED_PRECONDITION, **fields: Any) -> FakeRpcError:
    return FakeRpcError(code, lock_pb2.Reason.Name(r).lower(), lock_pb2.ErrorDetail(reason=r, **fields))


class FakeFuture:
    """What a grpc stub's ``.future()`` returns, for the calls the client makes that way (waiting
    acquires): the call runs on a thread of its own."""

    def __init__(self, run: Callable[[], Any]) -> None:
        self._done = threading.Event()
        self._result: Any = None
        self._error: Optional[BaseException] = None
        self.cancelled = False
        threading.Thread(target=self._run, args=(run,), daemon=True).start()

    def _run(self, run: Callable[[], Any]) -> None:
        try:
            self._result = run()
        except BaseException as e:  # delivered by result(), as grpc does
            self._error = e
        finally:
            self._done.set()

    def result(self, timeout: Optional[float] = None) -> Any:
        if not self._done.wait(timeout):
            raise grpc.FutureTimeoutError()
        if self._error is not None:
            raise self._error
        return self._result

    def cancel(self) -> bool:
        self.cancelled = True
        return True


class FakeServer:
    """Answers each method with ``handlers[method](request)``; records every request."""

    def __init__(self, handlers: dict[str, Callable[[Any], Any]]) -> None:
        self.handlers = handlers
        self.calls: list[tuple[str, Any]] = []
        self.futures: list[FakeFuture] = []  # the calls made as futures, in order
        self.lock = threading.Lock()

    def __getattr__(self, method: str) -> Callable[..., Any]:
        def call(request: Any, timeout: float, metadata: Any) -> Any:
            with self.lock:
                self.calls.append((method, request))
            handler = self.handlers.get(method)
            if handler is None:
                raise FakeRpcError(grpc.StatusCode.UNAVAILABLE, "down")
            return handler(request)

        def future(request: Any, timeout: float, metadata: Any) -> FakeFuture:
            f = FakeFuture(lambda: call(request, timeout, metadata))
            with self.lock:
                self.futures.append(f)
            return f

        call.future = future  # type: ignore[attr-defined]
        return call

    def requests(self, method: str) -> list[Any]:
        with self.lock:
            return [r for m, r in self.calls if m == method]


class FakeChannel:
    def close(self) -> None:
        pass


def fake_client(servers: list[FakeServer], request_timeout: float = 2.0) -> Client:
    c = object.__new__(Client)
    c.request_timeout = request_timeout
    c.attempt_timeout = 0.5
    c.discover = True
    c._tls = None
    c._metadata = ()
    c._lock = threading.Lock()
    c._servers = []
    for i, s in enumerate(servers):
        srv = object.__new__(_Server)
        srv.endpoint, srv.channel, srv.stub = f"127.0.0.1:{9001 + i}", FakeChannel(), s
        srv.failed = None
        c._servers.append(srv)
    import random

    c._random = random.Random(1)
    c.groups = 1
    c._leaders = [0]
    from holdfast.keepalive import Registry

    c._keepalives = Registry(c)
    return c


def opens(ttl_ms: int = 3000) -> Callable[[Any], Any]:
    return lambda r: lock_pb2.OpenSessionResponse(session_id=7, ttl_ms=ttl_ms, session_secret=b"s" * 16)


def renews(ttl_ms: int = 3000) -> Callable[[Any], Any]:
    """Renews every session asked for: per group when the request has groups (as this version's servers
    answer), else the request's own ids (as older ones did)."""

    def answer(r: Any) -> Any:
        def results(ids: Any) -> list[Any]:
            return [lock_pb2.KeepAliveResult(session_id=i, alive=True, ttl_ms=ttl_ms) for i in ids]

        return lock_pb2.KeepAliveResponse(
            results=results(r.session_ids),
            groups=[lock_pb2.GroupKeepAliveResult(group=g.group, results=results(g.session_ids)) for g in r.groups],
        )

    return answer


def closes(r: Any) -> Any:
    return lock_pb2.CloseSessionResponse()


def down(r: Any) -> Any:
    raise FakeRpcError(grpc.StatusCode.UNAVAILABLE, "connection refused")


R = lock_pb2.Reason


@pytest.mark.parametrize(
    "error, expected",
    [
        (reason(R.LOCK_HELD, holder_session_id=3, current_token=9), errors.LockHeld),
        (reason(R.SESSION_UNKNOWN, grpc.StatusCode.NOT_FOUND), errors.SessionUnknown),
        (reason(R.STALE_TOKEN, current_token=9), errors.StaleToken),
        (reason(R.NOT_HOLDER), errors.NotHolder),
        (reason(R.LIMIT_EXCEEDED, limit="max_name_bytes", limit_value=256), errors.LimitExceeded),
        (reason(R.WRONG_GROUP, grpc.StatusCode.INVALID_ARGUMENT), errors.InvalidArgument),
        (reason(R.REQUEST_ID_TOO_OLD), errors.RequestIdTooOld),
        (reason(R.ACCESS_DENIED, grpc.StatusCode.PERMISSION_DENIED), errors.PermissionDenied),
        (reason(R.ACQUIRE_ABANDONED, grpc.StatusCode.ABORTED), errors.Abandoned),
        (reason(R.PERMITS_MISMATCH, limit_value=2), errors.PermitsMismatch),
        (reason(R.COMPACTED, grpc.StatusCode.OUT_OF_RANGE), errors.Compacted),
        (reason(R.NOT_LEADER, grpc.StatusCode.UNAVAILABLE, leader_endpoint="h:1"), errors.Redirect),
        (reason(R.NOT_LEADER, grpc.StatusCode.UNAVAILABLE), errors.Retry),
        (reason(R.UNAVAILABLE, grpc.StatusCode.UNAVAILABLE), errors.Retry),
        (FakeRpcError(grpc.StatusCode.DEADLINE_EXCEEDED), errors.Retry),
        (FakeRpcError(grpc.StatusCode.UNAVAILABLE), errors.Retry),
        (FakeRpcError(grpc.StatusCode.INVALID_ARGUMENT), errors.InvalidArgument),
        (FakeRpcError(grpc.StatusCode.UNIMPLEMENTED), errors.Unavailable),
    ],
)
def test_errors_are_classified_as_the_rust_client_does(error: FakeRpcError, expected: type) -> None:
    got = errors.from_rpc_error(error)
    assert type(got) is expected
    if isinstance(got, errors.LockHeld):
        assert (got.holder_session, got.token, got.not_applied) == (3, 9, True)
    if isinstance(got, errors.LimitExceeded):
        assert (got.limit, got.value) == ("max_name_bytes", 256)
    if isinstance(got, errors.PermitsMismatch):
        assert got.permits == 2
    if isinstance(got, errors.InvalidArgument) and error.trailing_metadata():
        assert got.reason == "WRONG_GROUP"


def test_a_permission_denied_without_detail_may_have_been_applied() -> None:
    got = errors.from_rpc_error(FakeRpcError(grpc.StatusCode.PERMISSION_DENIED, "no"))
    assert isinstance(got, errors.HoldfastError) and not got.not_applied


def test_a_retry_goes_to_the_next_server_with_the_same_request_id() -> None:
    granted = lambda r: lock_pb2.AcquireResponse(token=42)  # noqa: E731
    a = FakeServer({"OpenSession": opens(), "KeepAlive": renews(), "Acquire": down})
    b = FakeServer({"OpenSession": opens(), "KeepAlive": renews(), "Acquire": granted, "CloseSession": closes})
    c = fake_client([a, b])
    with c.session() as s:
        lock = s.acquire("x", timeout=5)
        assert lock.token == 42
        (first,), (second,) = a.requests("Acquire"), b.requests("Acquire")
        assert first.request_id == second.request_id == 1
        assert second.wait_timeout_ms <= first.wait_timeout_ms and second.client_cancels
        assert c._leader_of(0) == 1, "the server that answered is the leader now"
        assert s.acquire("y", timeout=0).token == 42
        assert b.requests("Acquire")[-1].request_id == 2, "a new request gets a new id"


def test_a_not_leader_answer_is_followed_at_once() -> None:
    leader = FakeServer({"Release": lambda r: lock_pb2.ReleaseResponse()})
    follower = FakeServer(
        {"Release": lambda r: (_ for _ in ()).throw(
            reason(R.NOT_LEADER, grpc.StatusCode.UNAVAILABLE, leader_endpoint="127.0.0.1:9002"))}
    )
    c = fake_client([follower, leader])
    c.call(0, "Release", lock_pb2.ReleaseRequest(name="x", request_id=5))
    assert [r.request_id for r in leader.requests("Release")] == [5]
    assert c._leader_of(0) == 1


def test_a_redirect_to_a_server_that_just_failed_is_not_followed() -> None:
    # A server that left a group names the last leader it heard of, which is dead: following it would go
    # dead, stale, dead, stale, ... and never reach the third server, which leads.
    dead = FakeServer({"Release": down})
    stale = FakeServer(
        {"Release": lambda r: (_ for _ in ()).throw(
            reason(R.NOT_LEADER, grpc.StatusCode.UNAVAILABLE, leader_endpoint="127.0.0.1:9001"))}
    )
    leader = FakeServer({"Release": lambda r: lock_pb2.ReleaseResponse()})
    c = fake_client([dead, stale, leader])
    c.call(0, "Release", lock_pb2.ReleaseRequest(name="x", request_id=5))
    assert [r.request_id for r in leader.requests("Release")] == [5]
    assert len(dead.requests("Release")) == 1, "the redirect back to the dead server was not followed"
    assert c._leader_of(0) == 2


def test_a_server_that_answers_again_is_trusted_again() -> None:
    # Killed (no answer), then restarted: its NOT_LEADER is an answer, so when its peers name it as the
    # new leader the redirect is followed at once.
    calls = {"n": 0}

    def restarted(r: Any) -> Any:
        calls["n"] += 1
        if calls["n"] == 1:
            down(r)
        if calls["n"] == 2:
            raise reason(R.NOT_LEADER, grpc.StatusCode.UNAVAILABLE)
        return lock_pb2.ReleaseResponse()

    back = FakeServer({"Release": restarted})
    follower = FakeServer(
        {"Release": lambda r: (_ for _ in ()).throw(
            reason(R.NOT_LEADER, grpc.StatusCode.UNAVAILABLE, leader_endpoint="127.0.0.1:9001"))}
    )
    other = FakeServer(
        {"Release": lambda r: (_ for _ in ()).throw(reason(R.NOT_LEADER, grpc.StatusCode.UNAVAILABLE))}
    )
    c = fake_client([back, follower, other])
    c.call(0, "Release", lock_pb2.ReleaseRequest(name="x", request_id=5))
    assert calls["n"] == 3
    assert len(other.requests("Release")) == 1, "the redirect to the server that answered again was not followed"
    assert c._leader_of(0) == 0


def test_a_redirect_to_a_new_server_is_learned() -> None:
    follower = FakeServer(
        {"Describe": lambda r: (_ for _ in ()).throw(
            reason(R.NOT_LEADER, grpc.StatusCode.UNAVAILABLE, leader_endpoint="127.0.0.1:1"))}
    )
    c = fake_client([follower], request_timeout=0.3)
    with pytest.raises(errors.Unavailable):
        c.call(0, "Describe", lock_pb2.DescribeRequest(name="x"))
    assert "127.0.0.1:1" in c.endpoints, "the leader named by the redirect was added"


def acquire_with_no_answer(cancel: Callable[[Any], Any]) -> FakeServer:
    """A server whose acquires time out (their outcome unknown) and whose CancelAcquire is ``cancel``;
    one acquire is made against it, and fails with Unavailable."""
    server = FakeServer({"OpenSession": opens(), "KeepAlive": renews(), "CancelAcquire": cancel})
    server.handlers["Acquire"] = lambda r: (_ for _ in ()).throw(
        FakeRpcError(grpc.StatusCode.DEADLINE_EXCEEDED, "deadline"))
    c = fake_client([server], request_timeout=0.4)
    with pytest.raises(errors.Unavailable):
        c.session().acquire("x", timeout=0)
    return server


def test_an_acquire_with_an_unknown_outcome_is_cancelled() -> None:
    cancelled = threading.Event()

    def cancel(r: Any) -> Any:
        cancelled.set()
        return lock_pb2.CancelAcquireResponse()

    server = acquire_with_no_answer(cancel)
    assert cancelled.wait(10), "the acquire whose outcome is unknown was never cancelled"
    (acquire, *_), (cancel_req,) = server.requests("Acquire"), server.requests("CancelAcquire")
    assert (cancel_req.name, cancel_req.request_id, cancel_req.session_id) == ("x", acquire.request_id, 7)


def test_a_cancel_refused_by_the_policy_is_retried() -> None:
    # A policy reload can refuse for a while (a file fixed within the TTL leaves the session alive): the
    # wait must still be taken back once the policy lets the cancel through.
    cancelled = threading.Event()
    answers = iter([reason(lock_pb2.ACCESS_DENIED, grpc.StatusCode.PERMISSION_DENIED)])

    def cancel(r: Any) -> Any:
        refusal = next(answers, None)
        if refusal is not None:
            raise refusal
        cancelled.set()
        return lock_pb2.CancelAcquireResponse()

    server = acquire_with_no_answer(cancel)
    assert cancelled.wait(10), "a cancel refused once by the policy was not tried again"
    assert len(server.requests("CancelAcquire")) == 2


def test_a_waiting_acquire_ends_as_soon_as_its_session_is_lost() -> None:
    # The wait would go on at the server until it expires the session; the caller learns at once.
    answered = threading.Event()

    def slow(r: Any) -> Any:
        answered.wait(30)
        return lock_pb2.AcquireResponse(token=9)

    cancelled = threading.Event()

    def cancel(r: Any) -> Any:
        cancelled.set()
        return lock_pb2.CancelAcquireResponse()

    server = FakeServer(
        {"OpenSession": opens(10_000), "KeepAlive": renews(10_000), "Acquire": slow, "CancelAcquire": cancel}
    )
    c = fake_client([server], request_timeout=30)
    c.attempt_timeout = 30
    s = c.session(ttl=10)
    s.open_for("x")
    lose = threading.Timer(0.3, lambda: s._mark_lost("the test lost it"))
    lose.start()
    started = time.monotonic()
    try:
        with pytest.raises(errors.LeaseLost, match="the test lost it"):
            s.acquire("x", timeout=20)
        assert time.monotonic() - started < 5, "the wait went on after the session was lost"
        assert server.futures and all(f.cancelled for f in server.futures), "the call was not cancelled"
        assert cancelled.wait(10), "the acquire that may be queued was not cancelled at the server"
    finally:
        lose.cancel()
        answered.set()


def test_a_refused_acquire_is_not_cancelled() -> None:
    server = FakeServer({"OpenSession": opens(), "KeepAlive": renews()})
    server.handlers["Acquire"] = lambda r: (_ for _ in ()).throw(reason(R.LOCK_HELD, grpc.StatusCode.ABORTED))
    c = fake_client([server])
    s = c.session()
    with pytest.raises(errors.LockHeld):
        s.try_acquire("x")
    assert server.requests("CancelAcquire") == []


@pytest.mark.parametrize(
    "late",
    [
        reason(lock_pb2.LIMIT_EXCEEDED, grpc.StatusCode.RESOURCE_EXHAUSTED, limit="max_calls_per_connection"),
        reason(lock_pb2.ACCESS_DENIED, grpc.StatusCode.PERMISSION_DENIED),
    ],
)
def test_a_refusal_of_a_retry_after_a_lost_answer_still_cancels_the_acquire(late: FakeRpcError) -> None:
    # Attempt 1 may have been queued at the leader (its answer was lost); the retry under the same request
    # id is refused on grounds that change between attempts (the calls in flight, a policy reloaded
    # meanwhile). The refusal speaks for the retry only: attempt 1's wait may still be granted, so the
    # acquire must be cancelled.
    cancelled = threading.Event()

    def cancel(r: Any) -> Any:
        cancelled.set()
        return lock_pb2.CancelAcquireResponse()

    answers = iter([FakeRpcError(grpc.StatusCode.DEADLINE_EXCEEDED, "deadline"), late])
    server = FakeServer({"OpenSession": opens(), "KeepAlive": renews(), "CancelAcquire": cancel})
    server.handlers["Acquire"] = lambda r: (_ for _ in ()).throw(next(answers))
    c = fake_client([server])
    s = c.session()
    with pytest.raises(errors.Unavailable, match="may have been applied") as raised:
        s.acquire("x", timeout=1)
    assert not raised.value.not_applied
    assert cancelled.wait(10), "the acquire whose first attempt may have been queued was never cancelled"
    first, second = server.requests("Acquire")
    assert first.request_id == second.request_id == server.requests("CancelAcquire")[0].request_id


@pytest.mark.parametrize(
    "late",
    [
        reason(lock_pb2.LIMIT_EXCEEDED, grpc.StatusCode.INVALID_ARGUMENT, limit="max_name_bytes"),
        reason(lock_pb2.PERMISSION_DENIED, grpc.StatusCode.PERMISSION_DENIED),
        reason(lock_pb2.LOCK_HELD, grpc.StatusCode.ABORTED),
    ],
)
def test_a_refusal_every_attempt_meets_alike_stays_a_refusal_after_a_lost_answer(late: FakeRpcError) -> None:
    # A check of the request itself, of its session's secret, or the lock table's own answer: the lost
    # attempt met (or will meet) the same, so nothing was applied and nothing is cancelled.
    answers = iter([FakeRpcError(grpc.StatusCode.DEADLINE_EXCEEDED, "deadline"), late])
    server = FakeServer({"OpenSession": opens(), "KeepAlive": renews()})
    server.handlers["Acquire"] = lambda r: (_ for _ in ()).throw(next(answers))
    s = fake_client([server]).session()
    with pytest.raises(errors.HoldfastError) as raised:
        s.acquire("x", timeout=1)
    assert raised.value.not_applied and not isinstance(raised.value, errors.Unavailable)
    assert len(server.requests("Acquire")) == 2 and server.requests("CancelAcquire") == []


def test_a_grant_that_arrives_after_the_lease_lapsed_is_released_not_returned() -> None:
    cancelled = threading.Event()

    def slow_grant(r: Any) -> Any:
        time.sleep(2.1)  # past the lease: 0.9 of the 2 s TTL, with no renewal succeeding meanwhile
        return lock_pb2.AcquireResponse(token=5)

    def cancel(r: Any) -> Any:
        cancelled.set()
        return lock_pb2.CancelAcquireResponse()

    server = FakeServer(
        {"OpenSession": opens(2000), "KeepAlive": down, "Acquire": slow_grant, "CancelAcquire": cancel}
    )
    c = fake_client([server], request_timeout=5)
    c.attempt_timeout = 5
    s = c.session(ttl=2)
    with pytest.raises(errors.LeaseLost, match="token 5"):
        s.acquire("x", timeout=0)
    assert cancelled.wait(10), "the late grant was not released"
    assert not s.is_valid()


def test_a_suspension_past_the_lease_ends_it_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    # The monotonic clock stands still while the machine sleeps; the servers' TTLs do not. The lease is
    # read on a clock that counts the suspension, so on resume it is over at once.
    import holdfast.keepalive
    import holdfast.session

    server = FakeServer({"OpenSession": opens(10_000), "KeepAlive": renews()})
    s = fake_client([server]).session(ttl=10)
    s.open_for("x")
    assert s.is_valid() and (s.lease_remaining() or 0) > 8
    slept = holdfast.keepalive.lease_clock
    monkeypatch.setattr(holdfast.session, "lease_clock", lambda: slept() + 20)
    assert not s.is_valid()
    assert s.lease_remaining() == 0.0
    assert s.wait_lost(timeout=1) == "no keepalive succeeded within the TTL"


def test_the_lease_ends_a_tenth_of_the_ttl_before_the_server_could_expire_the_session() -> None:
    server = FakeServer({"OpenSession": opens(2000), "KeepAlive": down})
    c = fake_client([server])
    sent = time.monotonic()
    s = c.session(ttl=2)
    remaining = s.lease_remaining()
    assert remaining is not None and remaining <= 1.8
    why = s.wait_lost(timeout=5)
    lost_after = time.monotonic() - sent
    assert why == "no keepalive succeeded within the TTL"
    # Counted from when the open was sent (the server counts from when it received it, later).
    assert 1.8 - 0.01 <= lost_after < 2.0, lost_after
    assert len(server.requests("KeepAlive")) >= 2, "renewals were retried meanwhile"


def test_a_renewal_extends_the_lease_from_when_it_was_sent() -> None:
    gate = threading.Event()
    renewed = threading.Event()
    sent_at: list[float] = []

    def slow_renewal(r: Any) -> Any:
        sent_at.append(time.monotonic())
        gate.wait(5)
        time.sleep(0.5)  # the answer comes 0.5 s after the request was sent
        renewed.set()
        return renews(2000)(r)

    server = FakeServer({"OpenSession": opens(2000), "KeepAlive": slow_renewal, "CloseSession": closes})
    c = fake_client([server])
    with c.session(ttl=2) as s:
        gate.set()
        assert renewed.wait(5)
        time.sleep(0.05)
        remaining = s.lease_remaining()
        assert remaining is not None
        assert remaining <= sent_at[0] + 1.8 - time.monotonic() + 0.01


def test_a_forgotten_session_stops_being_renewed() -> None:
    server = FakeServer({"OpenSession": opens(2000), "KeepAlive": renews(2000)})
    c = fake_client([server])
    s = c.session(ttl=2)
    assert c._keepalives._live() == [s]
    del s
    gc.collect()
    assert c._keepalives._live() == [], "the keepalives kept a session nobody refers to"
    # And a forgotten client's keepalive thread ends (at its next tick).
    thread = c._keepalives._thread
    assert thread is not None
    del c
    gc.collect()
    thread.join(2)
    assert not thread.is_alive(), "the keepalive thread outlived its client"


def test_one_keepalive_goes_to_each_leader_and_a_group_it_does_not_lead_follows_the_redirect() -> None:
    """Two groups, two servers: server 0 leads group 0 and answers group 1 NOT_LEADER (naming server 1),
    as this version's servers do, per group. Three sessions open in both groups are renewed by one
    message to each server per round, the redirect is followed in the same round, and none is lost."""
    first = FakeServer({"OpenSession": opens(2000), "CloseSession": closes})
    second = FakeServer({"OpenSession": opens(2000), "CloseSession": closes})
    c = fake_client([first, second])
    c.groups = 2
    c._leaders = [0, 0]  # stale: the client believes server 0 leads both
    r2 = renews(2000)
    second.handlers["KeepAlive"] = r2

    def first_keepalive(r: Any) -> Any:
        answer = r2(r)
        for g in answer.groups:
            if g.group == 1:
                del g.results[:]
                g.code = grpc.StatusCode.FAILED_PRECONDITION.value[0]
                g.message = "not the leader"
                g.error.CopyFrom(lock_pb2.ErrorDetail(reason=R.NOT_LEADER, leader_endpoint="127.0.0.1:9002"))
        return answer

    first.handlers["KeepAlive"] = first_keepalive
    sessions = [c.session(ttl=2) for _ in range(3)]
    for s in sessions:
        s._open_in(0)
        s._open_in(1)
    c._leaders = [0, 0]
    end = time.monotonic() + 5
    while len(second.requests("KeepAlive")) < 2:
        assert time.monotonic() < end, "group 1 was never renewed at its leader"
        time.sleep(0.05)
    to_first, to_second = first.requests("KeepAlive"), second.requests("KeepAlive")
    # Three sessions, two groups: each message carries all three ids of each group it is for.
    assert all(len(g.session_ids) == 3 for r in to_first + to_second for g in r.groups)
    assert [g.group for g in to_second[-1].groups] == [1], "after the redirect, group 1 alone"
    assert [g.group for g in to_first[-1].groups] == [0], "server 0 now gets group 0 alone"
    assert all(s.is_valid() for s in sessions)
    for s in sessions:
        s.close()


def test_close_ends_the_lease_before_the_server_frees_the_locks() -> None:
    valid_during_close: list[bool] = []
    holder: list[holdfast.Session] = []

    def close(r: Any) -> Any:
        valid_during_close.append(holder[0].is_valid())
        return lock_pb2.CloseSessionResponse()

    server = FakeServer({"OpenSession": opens(), "KeepAlive": renews(), "CloseSession": close})
    c = fake_client([server])
    holder.append(c.session())
    holder[0].close()
    assert valid_during_close == [False]
    assert holder[0].lost_reason == "session closed"


def test_a_group_opened_during_a_round_bounds_the_lease_the_round_renews() -> None:
    """A group whose open was sent before a keepalive round, but which joined the session after the round
    chose what to renew, was not renewed by it: the round must not stretch the lease past what that open
    gave. Once a round covers it, the lease runs from that round."""
    server = FakeServer({"OpenSession": opens(10_000), "CloseSession": closes})
    c = fake_client([server])
    c.groups = 2
    c._leaders = [0, 0]
    s = c.session(ttl=10)
    s._open_in(0)
    t0 = time.monotonic()
    # As if group 1's open had been sent at t0 + 4 s, and a round covering group 0 only at t0 + 5 s.
    s._opened[0] = (t0 + 9, t0 + 10 / 3)
    s._opened[1] = (t0 + 4 + 9, t0 + 4 + 10 / 3)
    s.ids[1] = 8
    s._valid_until = t0 + 9
    s._renewed(t0 + 5, 10.0, {0})
    assert (s._valid_until, s._next_due) == (t0 + 13, t0 + 4 + 10 / 3)
    s._renewed(t0 + 6, 10.0, {0, 1})
    assert (s._valid_until, s._next_due) == (t0 + 15, t0 + 6 + 10 / 3)
    s.close()
