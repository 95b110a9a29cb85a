"""Leader election: the holder of the role's lock leads, and epochs increase across leaders."""

from __future__ import annotations

import threading

import holdfast


def test_campaign_resign_and_the_next_candidate_leads(client: holdfast.Client, name: str) -> None:
    with client.session() as a, client.session() as b:
        first = a.campaign(name, b"node-a")
        assert client.leader(name) == holdfast.Leader(b"node-a", first.epoch, a.id_for(name))
        second: list[holdfast.Leadership] = []
        t = threading.Thread(target=lambda: second.append(b.campaign(name, b"node-b")))
        t.start()
        first.resign()
        t.join(30)
        assert second, "b did not become leader after a resigned"
        assert second[0].epoch > first.epoch and second[0].is_valid()
        leader = client.leader(name)
        assert leader is not None and leader.value == b"node-b" and leader.epoch == second[0].epoch
        second[0].resign()
        assert client.leader(name) is None
