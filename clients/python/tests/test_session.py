"""Sessions and the client-side lease on a real cluster, through real faults: a session closed behind the
client's back, a leader killed (the client follows the new one and the session survives), and a cluster
that lost its quorum (the lease runs out on the client's clock, before the server could expire it)."""

from __future__ import annotations

import threading
import time

import holdfast
from holdfast.v1 import lock_pb2
from conftest import DevCluster


def test_keepalives_keep_a_session_past_its_ttl(client: holdfast.Client, name: str) -> None:
    with client.session(ttl=2) as s:
        assert s.ttl == 2.0
        lock = s.try_acquire(name)
        done = s.wait_lost(timeout=5)  # 2.5 TTLs
        assert done is None and s.is_valid() and lock.is_valid()
        info = client.describe(name)
        assert info is not None and info.holder_session_id == s.id_for(name)


def test_a_session_closed_elsewhere_is_lost_and_on_lost_fires(client: holdfast.Client, name: str) -> None:
    fired: list[str] = []
    called = threading.Event()

    def on_lost(why: str) -> None:
        fired.append(why)
        called.set()

    s = client.session(ttl=2, on_lost=on_lost)
    s.open_for(name)
    for group, sid in enumerate(s.ids):
        if not sid:
            continue
        client.call(
            group,
            "CloseSession",
            lock_pb2.CloseSessionRequest(group=group, session_id=sid, session_secret=s._secrets[group]),
        )
    why = s.wait_lost(timeout=10)
    assert why is not None and "expired or closed" in why
    assert called.wait(5) and fired == [why]
    assert not s.is_valid()


def test_a_killed_leader_costs_no_session(client: holdfast.Client, cluster: DevCluster, name: str) -> None:
    group = holdfast.group_for(name, client.groups)
    with client.session(ttl=10) as s:
        before = s.try_acquire(name)
        leader = cluster.leader_of(group)
        cluster.control("kill", leader)
        try:
            before.release()  # follows the new leader; same request id on retries
            after = s.acquire(name, timeout=10)
            assert after.token > before.token
            assert cluster.leader_of(group) != leader
            assert s.is_valid(), s.lost_reason
            after.release()
        finally:
            cluster.control("restart", leader)
            cluster.wait_all_groups_led()


def test_without_a_quorum_the_lease_runs_out_on_the_client(
    client: holdfast.Client, cluster: DevCluster, name: str
) -> None:
    s = client.session(ttl=3)
    s.try_acquire(name)
    killed = [1, 2, 3]
    start = time.monotonic()
    remaining = s.lease_remaining()
    # The lease runs from the last renewal sent, less a tenth of the TTL for clock-rate differences.
    assert remaining is not None and remaining <= 0.9 * 3
    for n in killed:
        cluster.control("kill", n)
    quorum_gone = time.monotonic()
    try:
        why = s.wait_lost(timeout=10)
        lost = time.monotonic()
        assert why == "no keepalive succeeded within the TTL"
        # Never before the lease ran out. And at most the lease (0.9 TTL) after the last renewal that
        # succeeded, which can be a little after the quorum is gone: a leader cut off from it still
        # answers until it notices (3/4 of the election timeout, under a second).
        assert lost - start >= remaining - 0.01, f"lost {lost - start:.2f} s after, lease {remaining:.2f} s"
        assert lost - quorum_gone <= 0.9 * 3 + 1.5, f"lost {lost - quorum_gone:.2f} s after the kills"
        try:
            s.try_acquire(name)
            raise AssertionError("an acquire on a lost session succeeded")
        except holdfast.LeaseLost:
            pass
    finally:
        for n in killed:
            cluster.control("restart", n)
        cluster.wait_all_groups_led()
    # The servers expire the session on their own clock: the lock is freed.
    end = time.monotonic() + 30
    while client.describe(name) is not None:
        assert time.monotonic() < end, "the lost session's lock was never freed"
        time.sleep(0.1)


def test_a_session_opens_only_where_used_and_its_client_sends_one_keepalive_per_leader(
    client: holdfast.Client, cluster: DevCluster
) -> None:
    """Sessions open in a group at their first use there, and one keepalive thread per client renews all
    of them: one message per round per server that leads a group where one is open, whatever the
    number of sessions."""
    groups = client.groups
    assert groups > 1
    names = [
        next(n for n in (f"py/lazy/{i}" for i in range(1000)) if holdfast.group_for(n, groups) == g)
        for g in range(groups)
    ]
    sessions = [client.session(ttl=2) for _ in range(4)]
    try:
        assert all(s.ids == [0] * groups for s in sessions), "opened in no group before a use"
        sessions[0].try_acquire(names[0])
        for s in sessions[1:]:
            s.open_for(names[1])
        assert [bool(x) for x in sessions[0].ids] == [g == 0 for g in range(groups)]
        assert all([bool(x) for x in s.ids] == [g == 1 for g in range(groups)] for s in sessions[1:])
        leaders = {client._leader_of(0), client._leader_of(1)}
        before = client._keepalives.messages
        time.sleep(4.0)  # five or six rounds at a TTL of 2 s (each due every 0.67 s)
        sent = client._keepalives.messages - before
        assert all(s.is_valid() for s in sessions), [s.lost_reason for s in sessions]
        # One message per round per leading server (not per session, not per group).
        assert 4 * len(leaders) <= sent <= 8 * len(leaders), f"{sent} messages to {len(leaders)} leaders"
    finally:
        for s in sessions:
            s.close()
