"""The deployment switch core (netstorm/lan/redeploy.py): when a changed topology takes effect, which epoch
each iteration runs, whom a refused datagram is answered, and, against a model of the whole LAN (workers,
aggregator services, the gateway) with announcements lost at random, that every iteration's sum holds
every worker's contribution exactly once."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bpf.fallback import UserspaceAggregator
from netstorm.lan.deploy import LanTopology
from netstorm.lan.errors import StaleDeployment
from netstorm.lan.header import MAX_WORKERS, lanes_of
from netstorm.lan.layout import EdgeLayout
from netstorm.lan.packets import data_packets, set_epoch
from netstorm.lan.redeploy import KEEP_SWITCHES, Redeployment

WORKERS = 5
TOPOLOGIES = [LanTopology(WORKERS), LanTopology(WORKERS, {0: (1, 2)}), LanTopology(WORKERS, {3: (1, 4), 0: (2,)}),
              LanTopology(WORKERS, {4: (0, 1, 2, 3)}), LanTopology(WORKERS, {1: ()})]


def test_a_change_waits_for_the_next_released_result_and_runs_from_the_iteration_after() -> None:
    core = Redeployment(TOPOLOGIES[0])
    assert core.released(9) is None and core.epoch == 0 and core.epoch_of(10) == 0
    assert core.propose(TOPOLOGIES[1]) and core.topology == TOPOLOGIES[0]   # held, not applied
    switch = core.released(10)
    assert switch is not None and (switch.epoch, switch.since, switch.previous) == (1, 11, TOPOLOGIES[0])
    assert core.topology == TOPOLOGIES[1] and core.epoch_of(11) == 1 and core.epoch_of(10) == 0
    assert not core.propose(TOPOLOGIES[1]) and core.released(11) is None   # the running one: nothing to do
    core.propose(TOPOLOGIES[2])
    core.propose(TOPOLOGIES[1])   # proposing the running one again cancels the pending change
    assert core.released(12) is None and core.epoch == 1
    with pytest.raises(ValueError):
        core.propose(LanTopology(3))
    for k in range(13, 53, 2):   # twenty more switches: the oldest are forgotten, not the recent ones
        core.propose(TOPOLOGIES[k % 3 + 1] if core.topology != TOPOLOGIES[k % 3 + 1] else TOPOLOGIES[0])
        assert core.released(k) is not None
    assert len(core.switches) == KEEP_SWITCHES and core.epoch == 21
    assert core.epoch_of(52) == 21 and core.epoch_of(51) == 20 and core.epoch_of(11) is None


def test_refused_data_is_answered_only_from_the_switch_on_and_once_per_hold() -> None:
    core = Redeployment(TOPOLOGIES[0], hold=0.05)
    core.propose(TOPOLOGIES[1])
    core.released(20)
    assert not core.on_stale(1, 20, 0, now=1.0)      # a late copy of the iteration summed before the switch
    assert not core.on_stale(1, 21, 1, now=1.0)      # the current epoch: nothing to tell
    assert core.on_stale(1, 21, 0, now=1.0)
    assert not core.on_stale(1, 21, 0, now=1.01)     # its window is refused datagram by datagram: one answer
    assert core.on_stale(1, 21, 0, now=1.06) and core.on_stale(2, 21, 0, now=1.06)


def test_a_member_is_answered_once_its_aggregator_service_asked_under_the_current_epoch() -> None:
    core = Redeployment(TOPOLOGIES[0])
    assert core.member_ready(1)
    assert not core.on_service_hello(0)               # aggregates nothing yet: stands by
    core.propose(TOPOLOGIES[1])
    core.released(5)
    assert not core.member_ready(1) and not core.member_ready(0) and core.member_ready(3)
    assert core.on_service_hello(0)
    assert core.member_ready(1) and core.member_ready(0) and core.member_ready(2)


LAY = EdgeLayout.uniform([4], scale=0, lanes=4, pool=1)
"""One chunk in one slot: each iteration is one slot's life at every aggregator."""


def _data(worker: int, iteration: int, epoch: int) -> bytes:
    """Worker ``worker``'s DATA: lanes of 2**worker, so a sum says exactly who is in it, and how often."""
    rows = data_packets(LAY, job=1, worker=worker, iteration=iteration, tensor=0, values=np.full(4, 2.0**worker))
    return bytes(set_epoch(rows, epoch)[0].tobytes())


def _lan_model(plans: list[int], lost: list[set[int]], lost_service: list[set[int]], dropped: list[set[int]]) -> None:
    """The gateway's core and the real userspace aggregators (the gateway's, and a service on every worker's
    host) with workers that send every round (duplicates everywhere). Iteration k runs the plan proposed
    at the release of k - 1; ``lost[k]``: workers that do not act on its announcement, ``lost_service[k]``:
    services that miss both the gateway's MOVED and the announcement, ``dropped[k]``: workers whose DATA is
    lost in the first round. Refusals and NACKs are answered as the gateway and services answer them.
    Every iteration must complete with every worker's contribution exactly once."""
    core = Redeployment(TOPOLOGIES[0], hold=0.0)
    gateway = UserspaceAggregator(LAY, job=1, expected=core.topology.gateway_mask(), timeout=1.0, max_nacks=0)
    services = [UserspaceAggregator(LAY, job=1, expected=0, timeout=1.0, max_nacks=0, up_worker=w)
                for w in range(WORKERS)]
    told = [(0, TOPOLOGIES[0])] * WORKERS
    asking: set[int] = set()

    def service_asks(head: int) -> None:
        in_cluster = core.on_service_hello(head)
        services[head].expected = core.topology.cluster_mask(head) if in_cluster else 0
        services[head].epoch = core.epoch

    def worker_asks(w: int) -> None:
        if core.member_ready(w):
            told[w] = (core.epoch, core.topology)
            asking.discard(w)
        else:
            asking.add(w)        # not answered yet: it says HELLO again

    def to_gateway(data: bytes, sender: int, service: bool, k: int) -> bytes | None:
        try:
            return gateway.on_data(data, 0.0)
        except StaleDeployment as exc:
            if core.on_stale(exc.worker + (MAX_WORKERS if service else 0), k, exc.epoch, 0.0):
                (service_asks if service else worker_asks)(sender)
            return None

    for w in range(WORKERS):
        service_asks(w)
    for k, plan in enumerate(plans):
        if k:
            core.propose(TOPOLOGIES[plan])
            if core.released(k - 1) is not None:
                gateway.expected, gateway.epoch = core.topology.gateway_mask(), core.epoch
                for w in set(range(WORKERS)) - lost_service[k]:
                    service_asks(w)   # the gateway's MOVED at the switch, or the result's epoch on the group
                for w in set(range(WORKERS)) - lost[k]:
                    worker_asks(w)    # the result of k - 1 announced the epoch
        total = None
        for round_ in range(8 * WORKERS):
            for w in sorted(asking):
                worker_asks(w)
            for w in range(WORKERS):
                if round_ == 0 and w in dropped[k]:
                    continue
                data = _data(w, k, told[w][0])
                head = told[w][1].aggregator_of(w)
                if head is None:
                    out = to_gateway(data, w, False, k)
                else:
                    try:
                        forwarded = services[head].on_data(data, 0.0)
                    except StaleDeployment:
                        worker_asks(w)            # the service's MOVED
                        if services[head].epoch != core.epoch:
                            service_asks(head)    # and it asks too, in case it is the one behind
                        continue
                    out = None if forwarded is None else to_gateway(forwarded, head, True, k)
                if out is not None:
                    total = int(lanes_of(out)[0])
                    break
            if total is not None:
                break
            slot = gateway.slots[0]
            have = slot.bitmap if slot.iteration == k and slot.bitmap else 0
            for w in range(WORKERS):      # the gateway's NACKs of whom its slot lacks
                if not (core.topology.gateway_mask() & ~have) >> w & 1:
                    continue
                if w in core.topology.clusters and core.services.get(w) != core.epoch:
                    service_asks(w)       # a service behind is sent MOVED instead of the cluster NACK
                elif w not in core.topology.clusters and told[w][0] != core.epoch:
                    worker_asks(w)        # a worker behind is sent MOVED instead of the NACK
                if w in core.topology.clusters and core.services.get(w) == core.epoch:
                    own = services[w].slots[0]   # the service NACKs the members its slot lacks, under its epoch
                    got = own.bitmap if own.iteration == k else 0
                    for m in (w, *core.topology.clusters[w]):
                        if not got >> m & 1 and told[m][0] != core.epoch:
                            worker_asks(m)
        assert total == 2**WORKERS - 1, (k, plan, total, told, core.topology)
        assert core.epoch_of(k) == core.epoch


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_every_sum_holds_every_worker_once_whatever_announcements_are_lost(data: st.DataObject) -> None:
    n = data.draw(st.integers(2, 8))
    plans = [0, *data.draw(st.lists(st.integers(0, len(TOPOLOGIES) - 1), min_size=n - 1, max_size=n - 1))]
    subsets = st.sets(st.integers(0, WORKERS - 1), max_size=WORKERS)
    lost = data.draw(st.lists(subsets, min_size=n, max_size=n))
    lost_service = data.draw(st.lists(subsets, min_size=n, max_size=n))
    dropped = data.draw(st.lists(subsets, min_size=n, max_size=n))
    _lan_model(plans, lost, lost_service, dropped)
