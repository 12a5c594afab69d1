"""Membership: registration of the expected nodes, heartbeats and death, driven by an explicit clock."""

from __future__ import annotations

import re

import pytest

from scheduler.membership import Down, Membership, MembershipError

ADDR = ("127.0.0.1", 5000)


def full(timeout: float = 5.0) -> Membership:
    m = Membership([1, 2, 3], heartbeat_timeout=timeout)
    assert m.register(1, ADDR, now=0.0) is False
    assert m.register(3, ("127.0.0.1", 5003), now=0.5) is False
    assert m.register(2, ("127.0.0.1", 5002), now=1.0) is True
    return m


def test_membership_completes_when_every_expected_node_registered() -> None:
    m = full()
    assert m.complete
    assert m.members() == {1: ADDR, 2: ("127.0.0.1", 5002), 3: ("127.0.0.1", 5003)}


def test_unknown_and_duplicate_ids_are_refused_by_name() -> None:
    m = Membership([1, 2], heartbeat_timeout=5.0)
    with pytest.raises(MembershipError, match="unknown node id 7: this job expects nodes 1, 2"):
        m.register(7, ADDR, now=0.0)
    m.register(1, ADDR, now=0.0)
    with pytest.raises(MembershipError, match=re.escape("duplicate node id 1: already registered from 127.0.0.1:5000")):
        m.register(1, ("127.0.0.1", 6000), now=0.1)
    assert m.registered == (1,)
    assert not m.complete


def test_drop_before_completion_unregisters_so_a_restart_can_register() -> None:
    m = Membership([1, 2], heartbeat_timeout=5.0)
    m.register(1, ADDR, now=0.0)
    assert m.disconnected(1, now=1.0) is None
    assert m.registered == ()
    m.register(1, ("127.0.0.1", 6001), now=2.0)
    assert m.register(2, ADDR, now=2.0) is True


def test_each_member_keeps_the_workers_it_registered_until_it_dies() -> None:
    m = Membership([1, 2, 3], heartbeat_timeout=5.0)
    m.register(1, ADDR, now=0.0, workers=4)
    m.disconnected(1, now=0.5)  # a restarted node 1 registers afresh, with another LAN
    m.register(1, ADDR, now=1.0, workers=3)
    m.register(2, ADDR, now=1.0)
    with pytest.raises(MembershipError, match="node 3 registers 0 workers"):
        m.register(3, ADDR, now=1.0, workers=0)
    assert m.register(3, ADDR, now=1.0, workers=2) is True
    assert m.workers() == {1: 3, 2: 1, 3: 2}
    m.disconnected(1, now=2.0)
    assert m.workers() == {2: 1, 3: 2}


def test_silence_longer_than_the_timeout_is_death_reported_once() -> None:
    m = full(timeout=5.0)  # complete at t=1.0: every node counts as seen then
    m.heartbeat(1, now=4.0)
    m.heartbeat(2, now=5.5)
    assert m.check(now=6.0) == []  # node 3 silent for exactly 5.0 s: not yet more than the timeout
    assert m.next_deadline() == pytest.approx(6.0)
    downs = m.check(now=6.01)
    assert [d.node_id for d in downs] == [3]
    assert "no heartbeat for 5.0 s" in downs[0].reason
    assert m.alive == (1, 2)
    later = m.check(now=9.1)  # node 1 last seen at 4.0
    assert later == [Down(1, m.dead[1])]
    assert "timeout 5.0 s" in later[0].reason
    assert m.check(now=100.0) == [Down(2, m.dead[2])]
    assert m.check(now=200.0) == []
    assert m.next_deadline() is None


def test_a_node_that_said_it_leaves_is_gone_but_not_failed() -> None:
    m = full()
    down = m.disconnected(2, now=3.0, leaving="stopped")
    assert down is not None and down.node_id == 2 and down.left and "left (stopped)" in down.reason
    assert m.members().keys() == {1, 3}
    assert not m.disconnected(3, now=3.0).left  # type: ignore[union-attr]


def test_no_deaths_before_completion() -> None:
    m = Membership([1, 2], heartbeat_timeout=1.0)
    m.register(1, ADDR, now=0.0)
    assert m.check(now=100.0) == []


def test_connection_loss_after_completion_is_death() -> None:
    m = full()
    down = m.disconnected(2, now=3.0)
    assert down is not None and down.node_id == 2 and "control connection" in down.reason
    assert m.disconnected(2, now=3.5) is None
    assert m.members().keys() == {1, 3}
    with pytest.raises(MembershipError, match="declared dead"):
        m.heartbeat(2, now=4.0)
    with pytest.raises(MembershipError, match="declared dead"):
        m.register(2, ADDR, now=4.0)


def test_heartbeat_from_a_stranger_is_refused() -> None:
    m = full()
    with pytest.raises(MembershipError, match="has not registered"):
        m.heartbeat(9, now=2.0)


def test_old_heartbeat_never_moves_last_seen_backwards() -> None:
    m = full(timeout=2.0)
    m.heartbeat(1, now=10.0)
    m.heartbeat(1, now=3.0)
    m.heartbeat(2, now=10.0)
    m.heartbeat(3, now=10.0)
    assert m.check(now=11.5) == []
