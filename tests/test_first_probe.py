"""The scheduler's first probe round: links a scenario gives no rate for, measured by their nodes before
the first policy (``scheduler.proberound``, ``node.firstprobe``)."""

from __future__ import annotations

import asyncio
import logging
import time

import pytest

from netstorm import bulkprobe, control, scenario
from netstorm.policy import Policy
from node import firstprobe
from node.control_client import SchedulerClient
from scheduler.proberound import ProbeRound
from scheduler.service import SchedulerService
from tests.test_scheduler_service import FAST, T, addr, run, until

BARE = scenario.parse({
    "name": "bare-triangle",
    "node": [{"id": 1}, {"id": 2}, {"id": 3}],
    "link": [{"a": 1, "b": 2}, {"a": 2, "b": 3}, {"a": 1, "b": 3, "rate_mbit": 20}],
})
PRIOR = BARE.prior_mbit


def test_a_round_asks_every_member_and_keeps_the_prior_where_it_measured_nothing() -> None:
    members = {1: ("10.0.0.1", 9000), 2: ("10.0.0.2", 9000), 3: ("10.0.0.3", 9000)}
    probing = ProbeRound(BARE.unknown, BARE.rates(), members=members, sinks={1: 7001, 2: 7002, 3: 0},
                         nbytes=1000, timeout_s=5.0, heartbeat_s=0.5, now=100.0, deadline_s=30.0)
    assert probing.links == [(1, 2), (2, 1)] and probing.skipped == [(2, 3), (3, 2)]
    assert sorted(probing.requests) == [1, 2, 3]  # node 3 probes nothing, but heartbeats meanwhile
    assert probing.requests[1].targets == ((2, "10.0.0.2", 7002),) and probing.requests[3].targets == ()
    assert probing.deadline == 130.0
    assert probing.result(control.ProbeResult(node_id=1, rows=((2, 41.5, ""), (3, 9.0, "")))) \
        == ["link 1->3 was not asked for"]
    assert probing.result(control.ProbeResult(node_id=1, rows=())) == \
        ["node 1 was not asked to probe, or answered already"]
    probing.result(control.ProbeResult(node_id=2, rows=((1, -1.0, "refused"),)))
    assert not probing.done
    probing.gone(3)
    assert probing.done
    assert probing.failed == {(2, 1): "refused"}
    assert probing.missing == [(2, 1), (2, 3), (3, 2)]
    rates = probing.rates()
    assert rates[(1, 2)] == 41.5 and rates[(2, 1)] == PRIOR and rates[(1, 3)] == 20.0 and rates[(3, 2)] == PRIOR


def test_the_first_policy_is_planned_from_the_probe_while_the_nodes_heartbeat(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """Nodes 1 and 2 keep probe sinks, node 3 none. Each probe is held until the scheduler has gone
    three heartbeat timeouts without a policy: the nodes stay members throughout, and the first policy
    plans links 1<->2 at what their probes measured, the links to node
    3 at the prior and the stated link at its rate."""
    gate = asyncio.Event()
    measure = bulkprobe.measure

    async def held(host: str, port: int, nbytes: int, *, timeout: float = 60.0) -> float:  # noqa: ASYNC109
        await gate.wait()
        return await measure(host, port, nbytes, timeout=timeout)

    monkeypatch.setattr(firstprobe.bulkprobe, "measure", held)

    async def main() -> None:
        service = SchedulerService(BARE.rates(), BARE.node_ids, FAST, unknown=BARE.unknown, probe_bytes=2_000_000,
                                   probe_deadline=T)
        ready = asyncio.Event()
        task = asyncio.create_task(service.serve("127.0.0.1", 0, ready=lambda _address: ready.set()))
        clients: list[SchedulerClient] = []
        try:
            await asyncio.wait_for(ready.wait(), T)
            connecting = asyncio.gather(*(
                SchedulerClient.connect(addr(service), n, ("127.0.0.1", 40000 + n), timeout=T,
                                        probe_host="127.0.0.1" if n != 3 else None) for n in (1, 2, 3)))
            await until(lambda: service.probing is not None, "the probe round starts")
            started = time.time()
            await until(lambda: time.time() > started + 3 * FAST.heartbeat_timeout, "three heartbeat timeouts")
            assert sorted(service.membership.alive) == [1, 2, 3] and not service.complete.is_set()
            assert service.status().states[0][2] == "probing the links with no rate"
            gate.set()
            clients = list(await connecting)
            assert service.complete.is_set() and sorted(service.membership.alive) == [1, 2, 3]
            assert service.probing is not None
            measured = service.probing.measured
            assert sorted(measured) == [(1, 2), (2, 1)]
            version = service.consistency.current_version
            assert version is not None
            policy = service.consistency.policy(version)
            assert isinstance(policy, Policy)
            for link in measured:
                assert policy.rates[link] == measured[link] != PRIOR
            assert policy.rates[(2, 3)] == policy.rates[(3, 2)] == PRIOR and policy.rates[(1, 3)] == 20.0
            assert service.collector.estimate(time.time())[(1, 2)] == measured[(1, 2)]
            assert "start from the prior" in caplog.text
            assert service.history(0, 0).policies[0].reason == "first plan, 2 link(s) probed"
            status = service.status()  # what the emulator sets against the applied rates
            assert status.probed == ((1, 2, measured[(1, 2)], ""), (2, 1, measured[(2, 1)], ""),
                                     (2, 3, -1.0, "no probe sink at an end"), (3, 2, -1.0, "no probe sink at an end"))
            assert status.probe_s >= 3 * FAST.heartbeat_timeout
        finally:
            for client in clients:
                await client.close()
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    with caplog.at_level(logging.INFO, logger="scheduler.service"):
        run(main())


def test_past_the_probe_deadline_the_first_policy_comes_from_the_prior_and_says_so(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """No probe ever returns: at the deadline the scheduler plans from the prior, the nodes (alive all
    along) are acknowledged and their stuck probes end with their registration."""
    never = asyncio.Event()

    async def stuck(host: str, port: int, nbytes: int, *, timeout: float = 60.0) -> float:  # noqa: ASYNC109
        await never.wait()
        raise AssertionError("unreachable")

    monkeypatch.setattr(firstprobe.bulkprobe, "measure", stuck)

    async def main() -> None:
        deadline = 2 * FAST.heartbeat_timeout
        service = SchedulerService(BARE.rates(), BARE.node_ids, FAST, unknown=BARE.unknown, probe_deadline=deadline)
        ready = asyncio.Event()
        task = asyncio.create_task(service.serve("127.0.0.1", 0, ready=lambda _address: ready.set()))
        clients: list[SchedulerClient] = []
        try:
            await asyncio.wait_for(ready.wait(), T)
            clients = list(await asyncio.gather(*(
                SchedulerClient.connect(addr(service), n, ("127.0.0.1", 40000 + n), timeout=T,
                                        probe_host="127.0.0.1") for n in (1, 2, 3))))
            assert sorted(service.membership.alive) == [1, 2, 3]
            version = service.consistency.current_version
            assert version is not None
            policy = service.consistency.policy(version)
            assert isinstance(policy, Policy)
            assert policy.rates == BARE.rates()
            assert service.history(0, 0).policies[0].reason == "first plan"
            assert [row[2:] for row in service.status().probed] == [(-1.0, "no result by the deadline")] * 4
            assert "probe deadline passed: link(s) ['1->2', '2->1', '2->3', '3->2'] start from the prior" in caplog.text
            assert not [t for t in asyncio.all_tasks() if t.get_name().startswith("first-probe-")]
        finally:
            for client in clients:
                await client.close()
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    with caplog.at_level(logging.INFO, logger="scheduler.service"):
        run(main())


def test_status_shows_what_the_first_probe_measured_and_what_starts_from_the_prior() -> None:
    from netstorm.commands import status as status_command

    status = control.Status(expected=(1, 2), registered=(1, 2), alive=(1, 2), complete=True, version=0,
                            probed=((1, 2, 41.5, ""), (2, 1, -1.0, "probe to 10.0.0.1:9 failed: refused")),
                            probe_s=3.25)
    data = status_command.summary(status)
    assert data["first_probe"] == {"seconds": 3.25, "links": [
        {"src": 1, "dst": 2, "mbit": 41.5, "why": ""},
        {"src": 2, "dst": 1, "mbit": None, "why": "probe to 10.0.0.1:9 failed: refused"}]}
    lines = status_command.render(data).splitlines()
    assert "first probe: 1 of 2 link(s) with no rate measured in 3.2 s" in lines
    assert "  2->1 starts from the prior: probe to 10.0.0.1:9 failed: refused" in lines
    assert status_command.summary(control.Status(expected=(1, 2), registered=(1, 2), alive=(1, 2), complete=True,
                                                 version=0))["first_probe"] is None
