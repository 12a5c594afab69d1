"""DCs and the scheduler come back: the persisted state, admission at a boundary (plain calls on the
sans-I/O cores), and a real scheduler restarted on loopback under clients that ride it out."""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path

import pytest

from netstorm.config import Config
from netstorm.errors import ConfigError
from node.control_client import SchedulerClient
from scheduler.consistency import Consistency
from scheduler.membership import Membership, MembershipError, Row
from scheduler.persistence import StateStore
from scheduler.service import SchedulerService
from tests.test_consistency import policies
from tests.test_scheduler_service import RATES, T, addr, close_all, connect_all, run, until

ADDR = ("127.0.0.1", 5000)
JOB = {"nodes": [1, 2, 3], "topology": "fapt"}


def test_the_state_file_gives_back_what_was_saved(tmp_path: Path) -> None:
    store = StateStore.open(tmp_path / "state", JOB)
    assert store.load().empty
    p0, p1 = policies(2)
    store.save_policy(0, p0.to_wire(), "first plan")
    store.save_policy(1, p1.to_wire(), "node 3 joins")
    store.save_binding(0, 0)
    store.save_binding(1, 1, (3,))
    store.save_members([Row(1, "10.0.0.1", 7001, 1, None), Row(3, "10.0.0.3", 7003, 2, "it died")])
    store.save_layout("abc123", 1)
    store.save_complete()
    store.close()

    saved = StateStore.open(tmp_path / "state", JOB).load()
    assert saved.complete and saved.layout == ("abc123", 1)
    assert [(v, r) for v, _, r in saved.policies] == [(0, "first plan"), (1, "node 3 joins")]
    assert saved.policies[1][1] == p1.to_wire()
    assert saved.bindings == {0: 0, 1: 1} and saved.joining == {1: (3,)}
    assert saved.members == [Row(1, "10.0.0.1", 7001, 1, None), Row(3, "10.0.0.3", 7003, 2, "it died")]


def test_a_state_directory_is_never_resumed_by_another_job(tmp_path: Path) -> None:
    StateStore.open(tmp_path, JOB).close()
    with pytest.raises(ConfigError, match="another job"):
        StateStore.open(tmp_path, {**JOB, "nodes": [1, 2]})


def full(**options: bool) -> Membership:
    m = Membership([1, 2, 3], heartbeat_timeout=5.0, **options)
    for n in (1, 2, 3):
        m.register(n, ADDR, now=0.0)
    return m


def test_a_dead_dc_rejoins_pending_and_is_a_member_once_admitted() -> None:
    m = full()
    assert m.disconnected(3, now=1.0) is not None
    with pytest.raises(MembershipError, match="restart it to rejoin"):
        m.attach(3, now=2.0)  # the old process cannot come back as if nothing happened
    assert m.rejoin(3, ("127.0.0.1", 6003), now=2.0, workers=2) is None
    assert m.pending == (3,) and m.alive == (1, 2)
    m.heartbeat(3, now=3.0)  # a pending DC heartbeats while its trainer starts
    with pytest.raises(MembershipError, match="already waiting"):
        m.rejoin(3, ADDR, now=3.0)
    m.admit(3, now=4.0)
    assert m.alive == (1, 2, 3) and m.pending == ()
    assert m.members()[3] == ("127.0.0.1", 6003) and m.workers()[3] == 2


def test_a_new_process_under_a_live_id_ends_the_old_incarnation() -> None:
    m = full()
    down = m.rejoin(2, ADDR, now=1.0)
    assert down is not None and down.node_id == 2 and not down.pending
    assert m.alive == (1, 3) and m.pending == (2,)


def test_strangers_join_only_when_joiners_are_allowed() -> None:
    with pytest.raises(MembershipError, match="allow_joiners"):
        full().rejoin(7, ADDR, now=1.0)
    m = full(allow_joiners=True)
    m.rejoin(7, ADDR, now=1.0)
    m.admit(7, now=1.5)
    assert m.alive == (1, 2, 3, 7)


def test_a_pending_dc_that_falls_silent_is_dropped_and_reported() -> None:
    m = full()
    m.disconnected(3, now=1.0)
    m.rejoin(3, ADDR, now=1.0)
    for n in (1, 2):
        m.heartbeat(n, now=6.5)
    downs = m.check(now=6.5)
    assert [(d.node_id, d.pending) for d in downs] == [(3, True)]
    assert m.pending == ()


def test_members_survive_a_restart_of_the_scheduler_as_plain_rows() -> None:
    m = full()
    m.disconnected(3, now=1.0)
    again = Membership([1, 2, 3], heartbeat_timeout=5.0)
    again.restore(m.rows(), complete=True, now=10.0)
    assert again.alive == (1, 2) and set(again.dead) == {3} and again.complete
    again.attach(1, now=11.0)
    assert again.check(now=14.0) == []


def test_the_boundary_is_the_first_iteration_bound_after_the_admitting_policy() -> None:
    c = Consistency()
    p0, p1, p2 = policies(3)
    c.publish(p0)
    for k in range(3):
        assert c.request(k, -1).joining == ()
    c.publish(p1, joining=(3,))
    answer = c.boundary(3)  # nobody asked for iteration 3 yet: it is bound now
    assert (answer.iteration, answer.version, answer.joining, answer.newly_bound) == (3, 1, (3,), True)
    assert c.request(3, 0).joining == (3,)  # every node hears of it with the iteration's policy
    assert c.request(4, 1).joining == ()
    c.publish(p2, joining=(5,))
    assert c.request(5, 1).joining == (5,)  # a node asked first: the joiner learns the same iteration
    assert c.boundary(5).iteration == 5


def test_bindings_and_joiners_survive_a_restore() -> None:
    c = Consistency()
    p0, p1 = policies(2)
    c.publish(p0)
    c.request(0, -1)
    c.publish(p1, joining=(2,))
    c.request(1, -1)
    again = Consistency()
    again.restore([p0, p1], c.bindings, c.joining)
    assert again.request(0, -1).version == 0 and not again.request(0, -1).newly_bound
    assert again.request(1, -1).joining == (2,)
    assert again.current_version == 1 and again.last_bound == 1


def test_a_restarted_scheduler_resumes_and_its_nodes_ride_out_the_outage(tmp_path: Path) -> None:
    config = Config(heartbeat_interval=0.1, heartbeat_timeout=1.0, update_time=60.0, connect_timeout=5.0,
                    state_dir=str(tmp_path / "state"), scheduler_grace=30.0)

    async def start(port: int) -> tuple[SchedulerService, asyncio.Task[None]]:
        service = SchedulerService(RATES, (1, 2, 3, 4), config)
        ready = asyncio.Event()
        task = asyncio.create_task(service.serve("127.0.0.1", port, ready=lambda _address: ready.set()))
        async with asyncio.timeout(T):
            await ready.wait()
        return service, task

    async def stop(task: asyncio.Task[None]) -> None:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task

    async def main() -> None:
        first, task = await start(0)
        clients = await connect_all(first)
        try:
            bound = {k: (await clients[k % 4].policy_for(k, timeout=T)).version for k in range(3)}
            await stop(task)
            await until(lambda: not any(c.connected for c in clients), "every node notices the outage")
            assert all(c.lost is None for c in clients)  # riding it out, not given up
            # A request made during the outage is answered once the scheduler is back.
            waiting = asyncio.ensure_future(clients[0].policy_for(3, timeout=0.5))
            second, task = await start(addr(first)[1])
            assert second.resumed and second.complete.is_set()
            await until(lambda: all(c.connected and c.reconnections == 1 for c in clients), "re-attached")
            assert (await waiting).version == second.consistency.current_version
            assert {k: second.consistency.bindings[k] for k in range(3)} == bound  # nothing bound again
            assert second.membership.alive == (1, 2, 3, 4)
            assert (await clients[2].policy_for(4, timeout=T)).version == second.consistency.current_version
        finally:
            await close_all(clients)
            await stop(task)

    run(main())


def test_a_dc_the_job_did_not_expect_joins_at_a_boundary_when_joiners_are_allowed() -> None:
    config = Config(heartbeat_interval=0.1, heartbeat_timeout=1.0, update_time=60.0, connect_timeout=5.0,
                    allow_joiners=True)

    async def main() -> None:
        service = SchedulerService(RATES, (1, 2, 3), config)
        ready = asyncio.Event()
        task = asyncio.create_task(service.serve("127.0.0.1", 0, ready=lambda _address: ready.set()))
        async with asyncio.timeout(T):
            await ready.wait()
        clients = await connect_all(service, (1, 2, 3))
        ups: list[tuple[int, int]] = []
        clients[0].on_member_up(lambda node, address, workers, joins_at: ups.append((node, joins_at)))
        try:
            for k in range(2):
                for client in clients:
                    assert 4 not in (await client.policy_for(k, timeout=T)).nodes
            # a majority of the job's DCs decides its layout, so the checks are answered together
            await asyncio.gather(*(client.check_layout("layout-a", timeout=T) for client in clients))
            joiner = await SchedulerClient.connect(addr(service), 4, ("127.0.0.1", 40004), timeout=T)
            clients.append(joiner)
            assert joiner.running and set(joiner.members) == {1, 2, 3, 4}
            await until(lambda: ups == [(4, -1)], "the members hear of the joiner")
            assert 4 not in service.membership.alive  # pending until its trainer's layout check
            await joiner.check_layout("layout-a", timeout=T)
            boundary = joiner.first_iteration
            assert boundary == 2  # the first iteration not yet bound
            await until(lambda: ups == [(4, -1), (4, boundary)], "the members hear of its boundary")
            policy = await clients[1].policy_for(boundary, timeout=T)
            assert 4 in policy.nodes and clients[1].joining(boundary) == (4,)
            assert (await joiner.policy_for(boundary, timeout=T)).version == policy.version
            assert clients[1].joining(boundary + 1) == ()
        finally:
            await close_all(clients)
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    run(main())
