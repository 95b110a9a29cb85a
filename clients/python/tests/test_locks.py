"""Locks on a real cluster: tokens, holders, waiting, timeouts, and the refusals that change nothing."""

from __future__ import annotations

import threading
import time

import pytest

import holdfast
from conftest import DevCluster


def test_lock_gives_increasing_tokens_and_describe_shows_the_holder(client: holdfast.Client, name: str) -> None:
    with client.session() as s:
        with s.lock(name) as first:
            assert first.token > 0
            info = client.describe(name)
            assert info is not None
            assert info.holder_session_id == s.id_for(name)
            assert info.token == first.token
        assert client.describe(name) is None, "leaving the block releases the lock"
        with s.lock(name) as second:
            assert second.token > first.token


def test_try_acquire_of_a_held_lock_names_the_holder(client: holdfast.Client, name: str) -> None:
    with client.session() as a, client.session() as b:
        held = a.try_acquire(name)
        with pytest.raises(holdfast.LockHeld) as e:
            b.try_acquire(name)
        assert e.value.holder_session == a.id_for(name)
        assert e.value.token == held.token
        assert e.value.reason == "LOCK_HELD" and e.value.not_applied
        held.release()


def test_a_waiter_is_granted_when_the_holder_releases(client: holdfast.Client, name: str) -> None:
    with client.session() as a, client.session() as b:
        held = a.acquire(name)
        got: list[holdfast.Lock] = []
        waiter = threading.Thread(target=lambda: got.append(b.acquire(name, timeout=30)))
        waiter.start()
        end = time.monotonic() + 10
        while True:  # until the server shows b queued
            info = client.describe(name)
            assert info is not None
            if [w.session_id for w in info.waiters] == [b.id_for(name)]:
                break
            assert time.monotonic() < end, "b never queued"
            time.sleep(0.02)
        held.release()
        waiter.join(30)
        assert got and got[0].token > held.token
        info = client.describe(name)
        assert info is not None and info.holder_session_id == b.id_for(name)


def test_a_wait_that_runs_out_leaves_no_waiter(client: holdfast.Client, name: str) -> None:
    with client.session() as a, client.session() as b:
        held = a.acquire(name)
        started = time.monotonic()
        with pytest.raises(holdfast.LockHeld):
            b.acquire(name, timeout=0.3)
        assert time.monotonic() - started >= 0.3
        info = client.describe(name)
        assert info is not None and list(info.waiters) == []
        held.release()


def test_release_with_a_stale_token_or_by_another_session_changes_nothing(
    client: holdfast.Client, name: str
) -> None:
    with client.session() as a, client.session() as b:
        held = a.acquire(name)
        with pytest.raises(holdfast.StaleToken) as stale:
            a.release(name, held.token + 1)
        assert stale.value.current == held.token
        with pytest.raises((holdfast.NotHolder, holdfast.StaleToken)):
            b.release(name, held.token)
        info = client.describe(name)
        assert info is not None and info.holder_session_id == a.id_for(name) and info.token == held.token
        held.release()


def test_bad_names_are_refused_with_the_limit(client: holdfast.Client) -> None:
    with client.session() as s:
        with pytest.raises(holdfast.LimitExceeded) as e:
            s.try_acquire("x" * 300)
        assert e.value.limit == "max_name_bytes" and e.value.value == 256
        with pytest.raises(holdfast.InvalidArgument):
            s.try_acquire("")
        with pytest.raises(holdfast.InvalidArgument):
            s.acquire("ok", timeout=301)


def test_names_spread_over_every_group(client: holdfast.Client, cluster: DevCluster) -> None:
    # A name sent to the wrong group is refused (WRONG_GROUP), so this also checks group_for against the
    # server's hash.
    names = [f"py/spread/{i}" for i in range(40)]
    assert client.groups == cluster.groups
    assert {holdfast.group_for(n, client.groups) for n in names} == set(range(cluster.groups))
    with client.session() as s:
        locks = [s.try_acquire(n) for n in names]
        assert sorted(lock.name for lock in client.list_locks("py/spread/")) == sorted(names)
        for lock in locks:
            lock.release()
    assert client.list_locks("py/spread/") == []


def test_closing_a_session_releases_its_locks(client: holdfast.Client, name: str) -> None:
    s = client.session()
    s.try_acquire(name)
    s.try_acquire(name + "/2")
    sessions = {sid for _, info in client.list_sessions() for sid in [info.session_id]}
    # Opened only in the groups of the two names (a session opens in a group at its first use there).
    opened = {sid for sid in s.ids if sid}
    assert opened == {s.id_for(name), s.id_for(name + "/2")} and opened <= sessions
    s.close()
    assert client.describe(name) is None and client.describe(name + "/2") is None
    assert not s.is_valid() and s.lost_reason == "session closed"
    with pytest.raises(holdfast.LeaseLost):
        s.try_acquire(name)


def test_shared_holders_and_semaphores(client: holdfast.Client, name: str) -> None:
    with client.session() as a, client.session() as b, client.session() as c:
        ra = a.try_acquire(name, shared=True)
        rb = b.try_acquire(name, shared=True)
        with pytest.raises(holdfast.LockHeld):
            c.try_acquire(name)  # a writer waits for the readers
        info = client.describe(name)
        assert info is not None and len(info.holders) == 2
        ra.release()
        rb.release()
        sem = name + "/sem"
        a.try_acquire(sem, permits=2)
        b.try_acquire(sem, permits=2)
        with pytest.raises(holdfast.LockHeld):
            c.try_acquire(sem, permits=2)
        with pytest.raises(holdfast.PermitsMismatch) as e:
            c.try_acquire(sem, permits=3)
        assert e.value.permits == 2


def test_wrong_endpoints_fail_fast_with_a_clear_error() -> None:
    with pytest.raises(holdfast.InvalidArgument, match="scheme"):
        holdfast.Client("http://127.0.0.1:7001")
    with pytest.raises(holdfast.InvalidArgument, match="port"):
        holdfast.Client("127.0.0.1")
    with pytest.raises(holdfast.Unavailable, match="no server answered"):
        holdfast.Client("127.0.0.1:1", request_timeout=0.5, attempt_timeout=0.2)
