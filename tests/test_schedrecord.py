"""The emulator's record of a run from the scheduler's admin interface: the result fields made from admin
answers, and a watch that follows a real scheduler on loopback while iterations bind and policies change."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import AsyncIterator

import pytest

from netstorm import control, scenario
from netstorm.config import Config
from netstorm.control import PolicyRecord
from netstorm.emulation.schedrecord import OVERLAP, SchedulerRecord, SchedulerWatch
from netstorm.planning.plan import plan
from node.control_client import SchedulerClient
from scheduler import admin
from scheduler.service import SchedulerService

RATES = scenario.parse({
    "name": "square",
    "node": [{"id": 1}, {"id": 2}, {"id": 3}, {"id": 4}],
    "link": [{"a": 1, "b": 2, "rate_mbit": 100}, {"a": 2, "b": 3, "rate_mbit": 50},
             {"a": 3, "b": 4, "rate_mbit": [80, 30]}, {"a": 4, "b": 1, "rate_mbit": 60},
             {"a": 1, "b": 3, "rate_mbit": 20}],
}).rates()
FAST = Config(heartbeat_interval=0.1, heartbeat_timeout=1.0, update_time=60.0, connect_timeout=5.0)
T = 10.0


def history(bindings: tuple[tuple[int, int], ...], *versions: tuple[int, str, tuple[int, ...]]) -> control.History:
    return control.History(bindings, tuple(PolicyRecord(v, why, roots, ()) for v, why, roots in versions))


def test_policy_versions_keep_the_fields_the_log_lines_gave() -> None:
    record = SchedulerRecord()
    assert record.policy_versions() == {"bound": {}, "policies": []}
    assert record.next_request() == control.HistoryRequest(0, 0)
    assert record.add_history(history(((0, 0), (1, 0)), (0, "first plan", (3, 1))))
    assert record.add_history(history(((1, 0), (2, 1)), (1, "periodic update", (3, 1))))
    assert not record.add_history(history(((2, 1),))), "nothing new"
    assert record.policy_versions() == {
        "bound": {"0": 0, "1": 0, "2": 1},
        "policies": [{"version": 0, "reason": "first plan", "roots": "[3, 1]"},
                     {"version": 1, "reason": "periodic update", "roots": "[3, 1]"}]}
    assert record.next_request() == control.HistoryRequest(3, 2)
    assert record.next_request(overlap=OVERLAP) == control.HistoryRequest(0, 2), "a few iterations again"
    record.add_history(history(tuple((k, 1) for k in range(3, 40))))
    assert record.next_request(overlap=OVERLAP) == control.HistoryRequest(40 - OVERLAP, 2)


def test_policy_trees_are_kept_per_version_in_the_plan_json_form() -> None:
    record = SchedulerRecord()
    assert record.policy_trees() == {}
    record.add_history(control.History(((0, 0),), (
        PolicyRecord(0, "first plan", (3, 1), ((3, 1, 3), (3, 2, 1), (3, 4, 3), (1, 2, 1), (1, 3, 1), (1, 4, 3))),)))
    record.add_history(control.History(((1, 1),), (PolicyRecord(1, "periodic update", (2,), ((2, 1, 2), (2, 3, 2),
                                                                                           (2, 4, 2))),)))
    assert record.policy_trees() == {
        "0": {"3": {"1": 3, "2": 1, "3": None, "4": 3}, "1": {"1": None, "2": 1, "3": 1, "4": 3}},
        "1": {"2": {"1": 2, "2": None, "3": 2, "4": 2}}}
    # The form ``netstorm plan --json`` prints a policy's trees in.
    policy = plan(RATES, topology="star", hub=2)
    assert record.policy_trees()["1"] == policy.to_wire()["trees"]
    assert list(record.policy_versions()["policies"][1]) == ["version", "reason", "roots"], "fields unchanged"


@contextlib.asynccontextmanager
async def scheduler() -> AsyncIterator[tuple[SchedulerService, list[SchedulerClient]]]:
    service = SchedulerService(RATES, (1, 2, 3, 4), FAST)
    ready = asyncio.Event()
    task = asyncio.create_task(service.serve("127.0.0.1", 0, ready=lambda _address: ready.set()))
    try:
        async with asyncio.timeout(T):
            await ready.wait()
        assert service.address is not None
        clients = list(await asyncio.gather(*(
            SchedulerClient.connect(service.address, n, ("127.0.0.1", 40000 + n), timeout=T,
                                    workers=3 if n == 2 else 1) for n in (1, 2, 3, 4))))
        try:
            yield service, clients
        finally:
            for client in clients:
                await client.close()
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def polled(watch: SchedulerWatch, past: int) -> None:
    """Until the watch has answered a poll begun after its ``past``-th."""
    async with asyncio.timeout(T):
        while watch.polls < past + 2:  # noqa: ASYNC110 (the watch thread offers nothing to wait on)
            await asyncio.sleep(0.01)


def test_a_watch_follows_a_running_scheduler_and_polls_once_more_when_stopped(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from scheduler import service as service_module

    monkeypatch.setattr(service_module, "HISTORY_BINDINGS", 4)  # several pages per poll
    monkeypatch.setattr(service_module, "HISTORY_POLICIES", 1)
    record = SchedulerRecord()

    async def main() -> None:
        async with scheduler() as (service, clients):
            assert service.address is not None
            watch = SchedulerWatch(service.address, record, interval=0.05, timeout=T)
            watch.start()
            try:
                for k in range(10):
                    await asyncio.gather(*(c.policy_for(k, timeout=T) for c in clients))
                await polled(watch, watch.polls)
                assert record.policy_versions()["bound"] == {str(k): 0 for k in range(10)}
                assert record.edge_modes([2]) == {"2": "not started"}
                await admin.override_policy(service.address, {**RATES, (1, 2): 1.0, (2, 1): 1.0}, timeout=T)
                await admin.override_policy(service.address, RATES, timeout=T)
                await polled(watch, watch.polls)
                assert [p["version"] for p in record.policy_versions()["policies"]] == [0, 1, 2]
                clients[1].report_edge("userspace", "cannot load: EPERM")
                # Bound after every version was seen: found past a first page of iterations already held.
                for k in range(10, 13):
                    await asyncio.gather(*(c.policy_for(k, timeout=T) for c in clients))
                await until_reported(service)
            finally:
                await asyncio.to_thread(watch.stop)  # its last poll sees everything above
            assert watch.error is None
            assert not any(t.name == "scheduler-watch" for t in threading.enumerate())

    asyncio.run(main())
    versions = record.policy_versions()
    assert versions["bound"] == {**{str(k): 0 for k in range(10)}, **{str(k): 2 for k in range(10, 13)}}
    assert [p["version"] for p in versions["policies"]] == [0, 1, 2]
    assert versions["policies"][0]["reason"] == "first plan"
    assert versions["policies"][1]["reason"].startswith("override from 127.0.0.1:")
    assert all(p["roots"].startswith("[") for p in versions["policies"])
    assert record.edge_modes([2, 4]) == {"2": "userspace (XDP unavailable: cannot load: EPERM)", "4": "not started"}


async def until_reported(service: SchedulerService) -> None:
    """Until the scheduler holds node 2's edge report (it travels on the node's own connection)."""
    assert service.address is not None
    async with asyncio.timeout(T):
        while not (await admin.status(service.address, timeout=T)).edge:  # noqa: ASYNC110 (the scheduler's state, seen over TCP)
            await asyncio.sleep(0.01)


def test_a_watch_of_a_scheduler_that_is_not_there_says_why() -> None:
    record = SchedulerRecord()

    async def free_port() -> tuple[str, int]:
        server = await asyncio.start_server(lambda _r, _w: None, "127.0.0.1", 0)
        address = server.sockets[0].getsockname()[:2]
        server.close()
        await server.wait_closed()
        return address[0], address[1]

    address = asyncio.run(free_port())
    with SchedulerWatch(address, record, interval=0.01, timeout=T) as watch:
        pass
    assert watch.error is not None and "history_request failed" in watch.error
    assert record.policy_versions() == {"bound": {}, "policies": []}
