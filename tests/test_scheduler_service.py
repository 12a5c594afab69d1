"""The scheduler service and the node's SchedulerClient, talking over real loopback TCP in one process."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import re
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence

import pytest

from netstorm import control, scenario
from netstorm.authconn import Credentials
from netstorm.config import Config
from netstorm.control import ControlError, LayoutMismatch, SchedulerGone
from netstorm.errors import ConfigError
from netstorm.policy import Policy
from netstorm.probe import LinkReport
from node.control_client import EDGE_REASON, REPORT_QUEUE, SchedulerClient
from scheduler import admin
from scheduler import service as service_module
from scheduler.cadence import Reason
from scheduler.service import SchedulerService
from tests.dataplane import until as wait_until

SCENARIO = scenario.parse({
    "name": "square",
    "node": [{"id": 1}, {"id": 2}, {"id": 3}, {"id": 4}],
    "link": [{"a": 1, "b": 2, "rate_mbit": 100}, {"a": 2, "b": 3, "rate_mbit": 50},
             {"a": 3, "b": 4, "rate_mbit": [80, 30]}, {"a": 4, "b": 1, "rate_mbit": 60},
             {"a": 1, "b": 3, "rate_mbit": 20}],
})
RATES = SCENARIO.rates()
FAST = Config(heartbeat_interval=0.1, heartbeat_timeout=1.0, update_time=60.0, connect_timeout=5.0)
T = 10.0  # deadline of every wait in these tests


def run(coro: Awaitable[None]) -> None:
    async def bounded() -> None:
        async with asyncio.timeout(60):
            await coro

    asyncio.run(bounded())


@contextlib.asynccontextmanager
async def scheduler(config: Config = FAST, nodes: Sequence[int] = (1, 2, 3, 4), topology: str = "fapt",
                    credentials: Credentials | None = None) -> AsyncIterator[SchedulerService]:
    """A scheduler serving on a free loopback port for the block's length (with ``credentials``, the job
    secret every connection must prove)."""
    service = SchedulerService(RATES, nodes, config, topology=topology, credentials=credentials)
    ready = asyncio.Event()
    task = asyncio.create_task(service.serve("127.0.0.1", 0, ready=lambda _address: ready.set()))
    try:
        async with asyncio.timeout(T):
            await ready.wait()
        yield service
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


def addr(service: SchedulerService) -> tuple[str, int]:
    assert service.address is not None
    return service.address


async def connect_all(service: SchedulerService, nodes: Sequence[int] = (1, 2, 3, 4),
                      workers: dict[int, int] | None = None) -> list[SchedulerClient]:
    return list(await asyncio.gather(*(
        SchedulerClient.connect(addr(service), n, ("127.0.0.1", 40000 + n), timeout=T,
                                workers=(workers or {}).get(n, 1)) for n in nodes)))


async def close_all(clients: Sequence[SchedulerClient]) -> None:
    for client in clients:
        await client.close()


async def until(condition: Callable[[], bool], what: str) -> None:
    """Wait for a condition the system under test makes true, with the tests' deadline."""
    await wait_until(condition, what, within=T)


def test_every_node_learns_how_many_workers_each_member_contributes() -> None:
    """Nodes 2 and 4 are gateways (their trainer and 3, resp. 1 LAN workers); the others register nothing
    about workers, as a node predating the field would, and count as one."""
    async def main() -> None:
        async with scheduler() as service:
            clients = await connect_all(service, workers={2: 4, 4: 2})
            try:
                assert all(client.workers == {1: 1, 2: 4, 3: 1, 4: 2} for client in clients)
            finally:
                await close_all(clients)

    run(main())


def test_registration_completes_with_members_and_the_schedulers_config() -> None:
    async def main() -> None:
        config = FAST.replace(chunk_size=1234, num_root_servers=2)
        async with scheduler(config) as service:
            clients = await connect_all(service)
            try:
                for client in clients:
                    assert client.members == {n: ("127.0.0.1", 40000 + n) for n in (1, 2, 3, 4)}
                    assert client.workers == {1: 1, 2: 1, 3: 1, 4: 1}
                    assert client.config == config
                status = await admin.status(addr(service), timeout=T)
                assert status.complete and status.alive == (1, 2, 3, 4) and status.version == 0
                policy = await clients[0].policy_for(0, timeout=T)
                assert len(policy.roots) == 2 and set(policy.nodes) == {1, 2, 3, 4}
            finally:
                await close_all(clients)

    run(main())


def test_unknown_and_duplicate_ids_are_refused_clearly() -> None:
    async def main() -> None:
        async with scheduler(nodes=(1, 2)) as service:
            with pytest.raises(ControlError, match="refused node 9: unknown node id 9: this job expects nodes 1, 2"):
                await SchedulerClient.connect(addr(service), 9, ("127.0.0.1", 1), timeout=T)
            first = asyncio.create_task(SchedulerClient.connect(addr(service), 1, ("127.0.0.1", 2), timeout=T))
            await until(lambda: service.membership.registered == (1,), "node 1 registered")
            with pytest.raises(ControlError, match="duplicate node id 1"):
                await SchedulerClient.connect(addr(service), 1, ("127.0.0.1", 3), timeout=T)
            second = await SchedulerClient.connect(addr(service), 2, ("127.0.0.1", 4), timeout=T)
            await close_all([await first, second])

    run(main())


def test_every_node_gets_the_same_version_per_iteration_across_a_policy_change() -> None:
    async def main() -> None:
        async with scheduler() as service:
            clients = await connect_all(service)
            try:
                zero = await asyncio.gather(*(c.policy_for(0, timeout=T) for c in clients))
                assert {p.version for p in zero} == {0}
                for c in clients:  # what a node does when iteration 0 completes there
                    c.prefetch(1)
                await until(lambda: 1 in service.consistency.bindings, "iteration 1 prefetched")
                slow = {**RATES, (1, 2): 1.0, (2, 1): 1.0}
                version = await admin.override_policy(addr(service), slow, timeout=T)
                assert version == 1
                one = await asyncio.gather(*(c.policy_for(1, timeout=T) for c in clients))
                two = await asyncio.gather(*(c.policy_for(2, timeout=T) for c in clients))
                assert {p.version for p in one} == {0}, "an iteration bound before the change keeps its policy"
                assert {p.version for p in two} == {1}
                assert two[0] == two[3] and two[0].trees != zero[0].trees
                assert service.consistency.bindings[2] == 1
                status = await admin.status(addr(service), timeout=T)
                assert status.version == 1
                assert status.bindings[:3] == ((0, 0), (1, 0), (2, 1))
                assert await admin.fetch_policy(addr(service), timeout=T) == two[0]
                assert await admin.fetch_policy(addr(service), 0, timeout=T) == zero[0]
                with pytest.raises(ControlError, match="policy version 99 is not held"):
                    await admin.fetch_policy(addr(service), 99, timeout=T)
            finally:
                await close_all(clients)

    run(main())


@pytest.mark.parametrize("aux", [True, False])
def test_a_new_policy_pushes_its_rates_and_moves_replanned_for_the_running_iteration(aux: bool) -> None:
    """Iteration 0 is bound to version 0 when link 1-2 collapses: version 1's rates reach every node,
    with moves for version 0's trees that take 1-2's chunks round it (auxiliary paths on only)."""
    async def main() -> None:
        async with scheduler(FAST.replace(enable_aux_path=aux)) as service:
            clients = await connect_all(service)
            pushed: dict[int, list[control.LinkBeliefs]] = {c.node_id: [] for c in clients}
            for c in clients:
                c.on_beliefs(pushed[c.node_id].append)
            try:
                zero = (await asyncio.gather(*(c.policy_for(0, timeout=T) for c in clients)))[0]
                slow = {**RATES, (1, 2): 1.0, (2, 1): 1.0}
                assert await admin.override_policy(addr(service), slow, timeout=T) == 1
                if not aux:
                    await until(lambda: service.consistency.current_version == 1, "version 1 published")
                    assert all(not got for got in pushed.values())
                    return
                await until(lambda: all(pushed.values()), "every node got version 1's beliefs")
                one = pushed[1][0]
                assert all(got == [one] for got in pushed.values())
                assert one.version == 1 and one.rates == slow and one.amends == 0
                assert set(one.offload) <= zero.tree_links() and {(1, 2), (2, 1)} & set(one.offload)
                for link, moves in one.offload.items():
                    assert {path for path, _ in moves} <= set(zero.aux_paths[link][1:])
                    assert all({(1, 2), (2, 1)}.isdisjoint(itertools.pairwise(p)) for p, _ in moves)
            finally:
                await close_all(clients)

    run(main())


def test_the_layout_a_majority_agrees_on_is_the_jobs_and_a_mismatch_names_both_hashes() -> None:
    async def main() -> None:
        async with scheduler(nodes=(1, 2, 3)) as service:
            one, two, three = await connect_all(service, (1, 2, 3))
            try:
                early = asyncio.ensure_future(three.check_layout("bbbb", timeout=T))  # first, and wrong
                first = asyncio.ensure_future(one.check_layout("aaaa", timeout=T))
                await asyncio.wait({early, first}, timeout=0.3)
                assert not early.done() and not first.done()  # one vote each: undecided
                await two.check_layout("aaaa", timeout=T)  # a majority
                await first
                with pytest.raises(LayoutMismatch, match="node 3 has layout bbbb but the job's layout is aaaa"):
                    await early
                await one.check_layout("aaaa", timeout=T)
                await three.check_layout("aaaa", timeout=T)  # the connection is still usable
            finally:
                await close_all([one, two, three])

    run(main())


def test_a_configured_layout_refuses_a_wrong_first_check_of_two_dcs_at_once() -> None:
    async def main() -> None:
        async with scheduler(FAST.replace(layout_hash="00000000000000aa"), nodes=(1, 2)) as service:
            one, two = await connect_all(service, (1, 2))
            try:
                with pytest.raises(LayoutMismatch, match=r"the job's layout is 00000000000000aa \(the scheduler's"):
                    await one.check_layout("bbbb", timeout=T)  # first, and alone: no vote to wait for
                await two.check_layout("00000000000000aa", timeout=T)
                await one.check_layout("00000000000000aa", timeout=T)
            finally:
                await close_all([one, two])

    run(main())


def heard(into: list[tuple[object, ...]], me: int, *message: object) -> None:
    into.append((me, *message))


def test_an_empty_trainer_place_is_told_to_every_member_and_asks_for_its_part_reach_it_alone() -> None:
    async def main() -> None:
        async with scheduler() as service:
            clients = await connect_all(service)
            vacancies: list[tuple[object, ...]] = []
            asks: list[tuple[object, ...]] = []
            for c in clients:
                c.on_vacancy(functools.partial(heard, vacancies, c.node_id))
                c.on_part_wanted(functools.partial(heard, asks, c.node_id))
            try:
                clients[0].report_vacancy(3, "its trainer died")
                await until(lambda: len(vacancies) == 3, "every other member told")
                assert sorted(vacancies) == [(me, 1, 3, "its trainer died", False) for me in (2, 3, 4)]
                clients[2].ask_part(1, 3)
                await until(lambda: len(asks) == 1, "node 1 asked")
                assert asks == [(1, 3, 3)]
                assert service._vacancies[1].iteration == 3  # kept for members that re-attach later
                clients[0].report_vacancy(4, "", filled=True)
                await until(lambda: len(vacancies) == 6, "every other member told it is taken again")
                assert all(filled for *_, filled in vacancies[3:]) and not service._vacancies
            finally:
                await close_all(clients)

    run(main())


def record(into: list[tuple[int, int, str]], me: int, node: int, reason: str) -> None:
    into.append((me, node, reason))


@pytest.mark.parametrize(("leaves", "reason", "level"), [
    (False, "its control connection to the scheduler closed", "WARNING"),  # a crash
    (True, "it left (training done)", "INFO"),  # a planned stop: no failure
])
def test_a_node_gone_is_announced_and_the_next_policy_excludes_it(
        leaves: bool, reason: str, level: str, caplog: pytest.LogCaptureFixture) -> None:
    async def main() -> None:
        async with scheduler() as service:
            clients = await connect_all(service)
            downs: list[tuple[int, int, str]] = []
            for c in clients:
                c.on_member_down(functools.partial(record, downs, c.node_id))
            try:
                await asyncio.gather(*(c.policy_for(0, timeout=T) for c in clients[:3]))
                await (clients[3].leave("training done") if leaves else clients[3].close())
                await until(lambda: len(downs) == 3, "every survivor told")
                assert sorted(me for me, _, _ in downs) == [1, 2, 3]
                assert all(node == 4 and why == reason for _, node, why in downs)
                await until(lambda: service.consistency.current_version == 1, "re-planned without node 4")
                later = await clients[0].policy_for(5, timeout=T)
                assert later.version == 1 and set(later.nodes) == {1, 2, 3}
            finally:
                await close_all(clients[:3])

    with caplog.at_level("INFO", logger="scheduler.service"):
        run(main())
    gone = [r.levelname for r in caplog.records if r.getMessage().startswith("node 4 is down")]
    assert gone == [level]
    assert any(r.getMessage() == "node 4 leaves: training done" for r in caplog.records) == leaves


def test_a_leave_for_another_node_is_ignored(caplog: pytest.LogCaptureFixture) -> None:
    async def main() -> None:
        async with scheduler() as service:
            clients = await connect_all(service)
            try:
                await clients[0]._send(control.Leave(node_id=2, reason="not yours to say"))
                await until(lambda: any("leave for node 2" in r.getMessage() for r in caplog.records),
                            "leave refused")
                assert (await clients[0].policy_for(0, timeout=T)).version == 0  # node 1 still served
                assert service.membership.alive == (1, 2, 3, 4), "node 2 is still a member"
            finally:
                await close_all(clients)

    with caplog.at_level("INFO", logger="scheduler.service"):
        run(main())


def test_silent_member_is_declared_dead_after_the_heartbeat_timeout() -> None:
    async def main() -> None:
        async with scheduler(nodes=(1, 2)) as service:
            started = asyncio.get_running_loop().time()  # before the membership completes: a lower bound
            reader, writer = await asyncio.open_connection(*addr(service))
            writer.write(control.encode(control.Register(2, "127.0.0.1", 9)))
            one = await SchedulerClient.connect(addr(service), 1, ("127.0.0.1", 8), timeout=T)
            assert isinstance(await control.read_message(reader), control.RegisterAck)
            downs: list[tuple[int, str]] = []
            one.on_member_down(lambda node, reason: downs.append((node, reason)))
            try:
                acked = asyncio.get_running_loop().time()  # after the membership completed: an upper bound
                # The silent node itself is told, then disconnected.
                message = await asyncio.wait_for(control.read_message(reader), T)
                assert isinstance(message, control.MemberDown) and message.node_id == 2
                now = asyncio.get_running_loop().time()
                # Never before the timeout (0.99: wall-clock slew against the loop's monotonic clock).
                assert now - started > FAST.heartbeat_timeout * 0.99
                assert now - acked < FAST.heartbeat_timeout * 5
                silence = re.fullmatch(r"no heartbeat for (\d+\.\d) s \(timeout 1\.0 s\)", message.reason)
                assert silence is not None and float(silence[1]) >= FAST.heartbeat_timeout, message.reason
                await until(lambda: downs == [(2, message.reason)], "node 1 told")
                assert await asyncio.wait_for(control.read_message(reader), T) is None
                assert service.membership.alive == (1,)  # node 1 heartbeats, so it lives on
            finally:
                writer.close()
                await one.close()

    run(main())


def test_garbage_gets_an_error_and_the_scheduler_keeps_serving() -> None:
    async def main() -> None:
        async with scheduler(nodes=(1, 2)) as service:
            reader, writer = await asyncio.open_connection(*addr(service))
            writer.write(control.LENGTH.pack(5) + b"\xc1junk")
            reply = await asyncio.wait_for(control.read_message(reader), T)
            assert isinstance(reply, control.Error) and "bad control message" in reply.message
            assert await asyncio.wait_for(control.read_message(reader), T) is None
            writer.close()
            reader, writer = await asyncio.open_connection(*addr(service))
            writer.write(control.LENGTH.pack(2**31))  # oversized: refused before reading it
            reply = await asyncio.wait_for(control.read_message(reader), T)
            assert isinstance(reply, control.Error) and "exceeds the limit" in reply.message
            writer.close()
            with pytest.raises(ControlError, match="unregistered connection"):
                await admin.request(addr(service), control.PolicyRequest(1, 0, -1), timeout=T)
            clients = await connect_all(service, (1, 2))
            assert (await clients[0].policy_for(0, timeout=T)).version == 0
            await close_all(clients)

    run(main())


def test_link_reports_reach_the_collector_and_awareness_replans() -> None:
    async def main() -> None:
        config = FAST.replace(update_time=0.2, update_rate=0.5)
        async with scheduler(config, nodes=(1, 2, 3, 4)) as service:
            clients = await connect_all(service)
            try:
                first = await clients[0].policy_for(0, timeout=T)
                cycles = service.cycles
                await until(lambda: service.cycles >= cycles + 2, "two quiet update cycles")
                assert service.consistency.current_version == 0, "nothing measured: no new policy"
                clients[1].report_link(LinkReport(src=4, dst=2, mbit_s=9.0, t=0.0, samples=4))  # not a link
                # The scenario's rate is the first vote: two reports carry the link's new rate.
                for t in (0.0, 0.1):
                    clients[1].report_link(LinkReport(src=1, dst=2, mbit_s=2.0, t=t, samples=4))
                await until(lambda: service.collector.state(1, 2).samples == 4 and
                            service.collector.state(1, 2).recent[-2:] == (2.0, 2.0), "reports collected")
                assert service.collector.state(1, 2).mbit_s == 2.0
                await until(lambda: service.consistency.current_version == 1, "re-planned from the report")
                changed = await clients[0].policy_for(9, timeout=T)
                assert changed.version == 1 and changed.roots == first.roots, "roots never move"
                assert changed.trees != first.trees
            finally:
                await close_all(clients)

    run(main())


def test_a_report_far_from_the_planned_rate_replans_before_the_period() -> None:
    async def main() -> None:
        config = FAST.replace(react_change=0.3, react_interval=0.0)  # update_time 60 s: never due in this test
        async with scheduler(config, nodes=(1, 2, 3, 4)) as service:
            clients = await connect_all(service)
            try:
                await clients[0].policy_for(0, timeout=T)
                assert service.cadence is not None
                planned = RATES[(1, 2)]
                for near in (planned * 1.1, planned * 1.2):
                    clients[1].report_link(LinkReport(src=1, dst=2, mbit_s=near, t=0.0, samples=4))
                    await until(functools.partial(lambda rate: service.collector.state(1, 2).latest == rate, near),
                                "near report collected")
                    assert service.cadence.reason() is Reason.PERIODIC, "within react_change"
                assert service.consistency.current_version == 0
                # The collector believes the median of the last three reports: one far report is not enough.
                clients[1].report_link(LinkReport(src=1, dst=2, mbit_s=planned * 0.2, t=0.0, samples=4))
                await until(lambda: service.collector.state(1, 2).latest == planned * 0.2, "far report collected")
                assert service.cadence.reason() is Reason.PERIODIC and service.consistency.current_version == 0
                clients[1].report_link(LinkReport(src=1, dst=2, mbit_s=planned * 0.2, t=0.0, samples=4))
                await until(lambda: service.consistency.current_version == 1, "re-planned early")
                assert service.planner.planned_rates is not None
                assert service.planner.planned_rates[(1, 2)] == planned * 0.2
            finally:
                await close_all(clients)

    run(main())


def report_round(clients: list[SchedulerClient], up: list[tuple[int, int]], down: tuple[int, int],
                 scale: float, down_scale: float | None) -> None:
    """One report per ``up`` link at ``scale`` x its rate, and one for ``down`` unless ``down_scale`` is None."""
    for src, dst in up:
        clients[src - 1].report_link(LinkReport(src=src, dst=dst, mbit_s=RATES[(src, dst)] * scale, t=0.0,
                                                samples=4))
    if down_scale is not None:
        clients[down[0] - 1].report_link(LinkReport(src=down[0], dst=down[1], mbit_s=RATES[down] * down_scale,
                                                    t=0.0, samples=4))


def test_several_links_moving_together_mark_a_change_and_replan_at_once() -> None:
    async def main() -> None:
        config = FAST.replace(react_change=0.3, react_interval=0.0, replan_gain=0.0)  # never periodic here
        async with scheduler(config, nodes=(1, 2, 3, 4)) as service:
            clients = await connect_all(service)
            try:
                await clients[0].policy_for(0, timeout=T)
                up, down = [(2, 3), (3, 4), (1, 4)], (2, 1)
                # Faster links never slow the policy, and one report below its plan moves no belief: only
                # the change point can re-plan early here.
                for scale, down_scale in ((1.0, 1.0), (3.0, None), (3.0, 0.5)):  # first reports count for nothing
                    report_round(clients, up, down, scale, down_scale)
                    if scale == 1.0:
                        await until(lambda: all(service.collector.state(*link).measured for link in [*up, down]),
                                    "first reports collected")
                    elif down_scale is None:
                        await until(lambda: all(len(service.collector.state(*link).recent) == 3 for link in up),
                                    "second reports collected")
                        assert service.collector.change_at is None, "every link that moved moved up"
                await until(lambda: service.collector.change_at is not None, "change marked")
                await until(lambda: service.consistency.current_version == 1, "re-planned at once")
                assert service.planner.planned_rates is not None
                assert all(service.planner.planned_rates[link] == RATES[link] * 3.0 for link in up)
                assert service.planner.planned_rates[down] == RATES[down] * 0.5, "its report since the change alone"
            finally:
                await close_all(clients)

    run(main())


def test_after_a_change_policies_ask_to_explore_idle_links_and_their_news_replans() -> None:
    async def main() -> None:
        config = FAST.replace(react_change=0.3, react_interval=0.0, replan_gain=0.0, num_root_servers=1)
        async with scheduler(config, nodes=(1, 2, 3, 4)) as service:
            clients = await connect_all(service)
            try:
                first = await clients[0].policy_for(0, timeout=T)
                assert first.explore == frozenset(), "nothing to explore before the network changed"
                up, down = [(2, 3), (3, 4), (1, 4)], (2, 1)
                for scale, down_scale in ((1.0, 1.0), (3.0, None), (3.0, 0.5)):
                    report_round(clients, up, down, scale, down_scale)
                    await until(functools.partial(lambda s: service.collector.state(2, 3).latest == s,
                                                  RATES[(2, 3)] * scale), "reports collected")
                await until(lambda: service.consistency.current_version == 1, "re-planned at once")
                changed: Policy = service.consistency.policy(1)  # type: ignore[assignment]
                measured = {*up, down}
                idle = {link for link in RATES if link not in changed.tree_links() and link not in measured}
                assert idle, "one tree over four nodes leaves links idle"
                assert changed.explore == idle
                planned = service.planner.planned_rates
                assert planned is not None
                steady, fast = sorted(idle)[:2]
                cycles = service.cycles
                clients[steady[0] - 1].report_link(LinkReport(src=steady[0], dst=steady[1],
                                                              mbit_s=planned[steady], t=0.0, samples=4))
                await until(lambda: service.collector.state(*steady).measured, "report collected")
                assert service.cadence is not None and service.cadence.reason() is Reason.PERIODIC, \
                    "an explored link at its believed rate changes nothing"
                clients[fast[0] - 1].report_link(LinkReport(src=fast[0], dst=fast[1], mbit_s=planned[fast] * 3,
                                                            t=0.0, samples=4))
                await until(lambda: service.cycles > cycles, "an explored link much faster re-plans at once")
            finally:
                await close_all(clients)

    run(main())


def test_react_change_zero_waits_for_the_period() -> None:
    async def main() -> None:
        async with scheduler(FAST.replace(react_change=0.0), nodes=(1, 2, 3, 4)) as service:
            clients = await connect_all(service)
            try:
                await clients[0].policy_for(0, timeout=T)
                links = [link for link in sorted(RATES) if max(link) <= 4][:3]
                for rate in (1.0, 1.1, 1.2):  # three links far off their plan, three times: no re-plan, no change
                    for src, dst in links:
                        clients[src - 1].report_link(LinkReport(src=src, dst=dst, mbit_s=rate, t=0.0, samples=4))
                    await until(functools.partial(
                        lambda r: all(service.collector.state(*link).latest == r for link in links), rate),
                        "reports collected")
                assert service.cadence is not None and service.cadence.reason() is Reason.PERIODIC
                assert service.collector.change_at is None
                assert service.consistency.current_version == 0
            finally:
                await close_all(clients)

    run(main())


def test_without_awareness_the_first_policy_stays() -> None:
    async def main() -> None:
        config = FAST.replace(update_time=0.1, enable_awareness=False)
        async with scheduler(config, nodes=(1, 2)) as service:
            clients = await connect_all(service, (1, 2))
            try:
                clients[0].report_link(LinkReport(src=1, dst=2, mbit_s=1.0, t=0.0, samples=4))
                cycles = service.cycles
                await until(lambda: service.cycles >= cycles + 3, "three update cycles")
                assert service.consistency.current_version == 0
            finally:
                await close_all(clients)

    run(main())


def test_policy_errors_and_timeouts_name_the_scheduler_and_iteration() -> None:
    async def stuck(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """A scheduler that acknowledges registration and then never answers."""
        await control.read_message(reader)
        writer.write(control.encode(control.RegisterAck({1: ("127.0.0.1", 7)}, {}, 0.0)))
        while await control.read_message(reader) is not None:
            pass

    async def main() -> None:
        async with scheduler(nodes=(1, 2)) as service:
            client, other = await connect_all(service, (1, 2))
            try:
                with pytest.raises(ControlError, match=r"scheduler 127\.0\.0\.1:\d+: iteration -1: .*>= 0"):
                    await client.policy_for(-1, timeout=T)
                assert (await client.policy_for(0, timeout=T)).version == 0  # still usable
            finally:
                await close_all([client, other])
            with pytest.raises(ControlError, match=r"scheduler 127\.0\.0\.1:\d+: .*iteration 3"):
                await client.policy_for(3, timeout=T)
        server = await asyncio.start_server(stuck, "127.0.0.1", 0)
        async with server:
            address = server.sockets[0].getsockname()[:2]
            client = await SchedulerClient.connect(address, 1, ("127.0.0.1", 7), timeout=T)
            try:
                with pytest.raises(control.ControlTimeout, match=r"127\.0\.0\.1:\d+: no policy for iteration 0 "
                                                                  r"within 0\.3 s"):
                    await client.policy_for(0, timeout=0.3)
            finally:
                await client.close()

    run(main())


def test_a_one_dc_job_is_refused() -> None:
    with pytest.raises(ConfigError, match="at least two DCs"):
        SchedulerService(RATES, [1], FAST)


def test_nodes_that_cannot_form_a_job_are_refused_at_startup() -> None:
    with pytest.raises(ConfigError, match="cannot plan a fapt policy"):
        two_islands = {(1, 2): 10.0, (2, 1): 10.0, (3, 4): 10.0, (4, 3): 10.0}
        SchedulerService(two_islands, [1, 2, 3, 4], FAST)


def test_losing_the_scheduler_for_longer_than_the_grace_fails_waiters_and_is_signalled() -> None:
    async def main() -> None:
        lost: list[ControlError] = []
        async with scheduler(FAST.replace(scheduler_grace=0.3), nodes=(1, 2)) as service:
            clients = await connect_all(service, (1, 2))
            clients[0].on_lost(lost.append)
            await clients[0].policy_for(0, timeout=T)
        # The scheduler is gone (its server and every connection closed).
        await until(lambda: len(lost) == 1, "loss signalled")
        assert clients[0].lost is lost[0]
        assert isinstance(lost[0], SchedulerGone)
        assert re.search(r"scheduler 127\.0\.0\.1:\d+ closed the control connection of node 1", str(lost[0]))
        with pytest.raises(ControlError, match=r"iteration 7: .*closed the control connection"):
            await clients[0].policy_for(7, timeout=T)
        await close_all(clients)

    run(main())


@pytest.mark.parametrize("topology", ["fapt", "fapt1", "star", "bkt", "mst"])
def test_roots_stay_fixed_across_replans_for_every_topology(topology: str) -> None:
    async def main() -> None:
        config = FAST.replace(num_root_servers=2)
        async with scheduler(config, topology=topology) as service:
            clients = await connect_all(service)
            try:
                first = await clients[0].policy_for(0, timeout=T)
                assert first.topology == topology
                # Rates that make the first roots look poor: every link touching them becomes slow.
                slow = {(a, b): 1.0 if a in first.roots or b in first.roots else 500.0 for a, b in RATES}
                version = await admin.override_policy(addr(service), slow, timeout=T)
                later = await clients[0].policy_for(5, timeout=T)
                assert later.version == version == 1
                assert later.roots == first.roots
            finally:
                await close_all(clients)

    run(main())


def test_a_busy_listen_port_is_a_clear_error() -> None:
    async def main() -> None:
        async with scheduler(nodes=(1, 2)) as first:
            port = addr(first)[1]
            second = SchedulerService(RATES, (1, 2), FAST)
            with pytest.raises(ConfigError, match=rf"cannot listen on TCP 127\.0\.0\.1:{port}: .*in use"):
                await second.serve("127.0.0.1", port)

    run(main())


def test_a_late_answer_to_a_timed_out_request_is_not_taken_for_the_next_ones() -> None:
    """Replies pair with requests by order: the answer to a request that timed out must be dropped."""
    async def late(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Acknowledges registration; answers the first layout check only after the second arrived."""
        await control.read_message(reader)
        writer.write(control.encode(control.RegisterAck({1: ("127.0.0.1", 7)}, {}, 0.0)))
        checks: list[control.LayoutCheck] = []
        while len(checks) < 2:  # heartbeats come in between
            message = await control.read_message(reader)
            if isinstance(message, control.LayoutCheck):
                checks.append(message)
            else:
                assert isinstance(message, control.Heartbeat), message
        first = checks[0]
        writer.write(control.encode(control.Error(f"layout mismatch: answer to {first.layout_hash}")))
        writer.write(control.encode(control.LayoutAck()))
        while await control.read_message(reader) is not None:
            pass

    async def main() -> None:
        server = await asyncio.start_server(late, "127.0.0.1", 0)
        async with server:
            address = server.sockets[0].getsockname()[:2]
            client = await SchedulerClient.connect(address, 1, ("127.0.0.1", 7), timeout=T)
            try:
                with pytest.raises(control.ControlTimeout, match=r"layout check of node 1 within 0\.2 s"):
                    await client.check_layout("slow", timeout=0.2)
                await client.check_layout("second", timeout=T)  # its own answer, the LayoutAck
                assert client.lost is None
            finally:
                await client.close()

    run(main())


def test_a_garbled_registration_answer_names_the_scheduler_and_closes_the_connection() -> None:
    closed = asyncio.Event()

    async def garbled(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await control.read_message(reader)
        writer.write(control.LENGTH.pack(5) + b"\xc1junk")
        await reader.read()  # returns at the client's end of stream
        closed.set()
        writer.close()

    async def main() -> None:
        server = await asyncio.start_server(garbled, "127.0.0.1", 0)
        async with server:
            address = server.sockets[0].getsockname()[:2]
            with pytest.raises(ControlError, match=r"scheduler 127\.0\.0\.1:\d+: registration of node 3: "
                                                   r"undecodable control frame"):
                await SchedulerClient.connect(address, 3, ("127.0.0.1", 7), timeout=T)
            async with asyncio.timeout(T):
                await closed.wait()

    run(main())


def test_a_member_that_died_while_the_job_started_is_planned_out_without_awareness() -> None:
    """The death's wake-up can reach the re-plan loop before the first policy exists; it must not be lost."""
    async def main() -> None:
        service = SchedulerService(RATES, (1, 2, 3, 4), FAST.replace(enable_awareness=False, update_time=0.05))
        for n in (1, 2, 3, 4):
            service.membership.register(n, ("127.0.0.1", 40000 + n), service.clock())
        await service._start_job()  # plans over all four; no connections to tell
        assert service.consistency.current_version == 0
        assert service.membership.disconnected(4, service.clock()) is not None  # recorded, loop not woken
        async with asyncio.TaskGroup() as tasks:
            loop = tasks.create_task(service._replan_loop())
            await until(lambda: service.consistency.current_version == 1, "re-planned without node 4")
            loop.cancel()
        policy = service.consistency.policy(1)
        assert isinstance(policy, Policy) and set(policy.nodes) == {1, 2, 3}

    run(main())


def test_a_full_report_queue_drops_the_oldest_reports_and_says_so(caplog: pytest.LogCaptureFixture) -> None:
    async def main() -> None:
        async with scheduler(nodes=(1, 2)) as service:
            clients = await connect_all(service, (1, 2))
            try:
                extra = 44
                for i in range(REPORT_QUEUE + extra):  # no await in between: the sender cannot run
                    clients[0].report_link(LinkReport(src=2, dst=1, mbit_s=float(i + 1), t=0.0, samples=4))
                assert clients[0].dropped_reports == extra
                newest = float(REPORT_QUEUE + extra)
                await until(lambda: service.collector.state(2, 1).latest == newest, "the newest report kept")
            finally:
                await close_all(clients)

    with caplog.at_level("WARNING", logger="node.control_client"):
        run(main())
    drops = [r for r in caplog.records if "dropped the oldest" in r.getMessage()]
    assert len(drops) == 1 and "(1 so far)" in drops[0].getMessage()


def test_an_error_the_scheduler_sends_unasked_is_the_reason_the_connection_is_lost() -> None:
    async def refusing(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Acknowledges registration, then refuses the first heartbeat and hangs up, as for a dead node."""
        await control.read_message(reader)
        writer.write(control.encode(control.RegisterAck({1: ("127.0.0.1", 7)}, {}, 0.0)))
        assert isinstance(await control.read_message(reader), control.Heartbeat)
        writer.write(control.encode(control.Error("heartbeat from node 1, which was declared dead (silent)")))
        writer.close()

    async def main() -> None:
        server = await asyncio.start_server(refusing, "127.0.0.1", 0)
        async with server:
            address = server.sockets[0].getsockname()[:2]
            client = await SchedulerClient.connect(address, 1, ("127.0.0.1", 7), timeout=T)
            lost: list[ControlError] = []
            client.on_lost(lost.append)
            try:
                await until(lambda: client.lost is not None, "connection lost")
                assert re.fullmatch(r"scheduler 127\.0\.0\.1:\d+ refused node 1: heartbeat from node 1, which was "
                                    r"declared dead \(silent\)", str(client.lost))
                assert lost == [client.lost]
            finally:
                await client.close()

    run(main())


def test_an_admin_answer_cut_off_mid_frame_names_the_scheduler_and_the_request() -> None:
    async def cut_off(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await control.read_message(reader)
        writer.write(control.encode(control.LayoutAck())[:-1])
        writer.close()

    async def main() -> None:
        server = await asyncio.start_server(cut_off, "127.0.0.1", 0)
        async with server:
            address = server.sockets[0].getsockname()[:2]
            with pytest.raises(ControlError, match=r"^scheduler 127\.0\.0\.1:\d+: status_request failed: "
                                                   r"connection closed inside a \d+-byte control frame"):
                await admin.status(address, timeout=T)

    run(main())


def test_no_connection_handler_outlives_serve() -> None:
    def handlers() -> list[asyncio.Task[object]]:
        return [t for t in asyncio.all_tasks() if "_serve_connection" in t.get_coro().__qualname__]  # type: ignore[union-attr]

    async def main() -> None:
        writers = []
        async with scheduler(nodes=(1, 2, 3)) as service:
            for n in (1, 2):
                _reader, writer = await asyncio.open_connection(*addr(service))
                writer.write(control.encode(control.Register(n, "127.0.0.1", 9)))
                writers.append(writer)
            await until(lambda: service.membership.registered == (1, 2), "two nodes registered")
            assert len(handlers()) == 2
        assert handlers() == []  # serve returned: its connections' handlers are over too
        for writer in writers:
            writer.close()

    run(main())


def test_tree_packing_option_reaches_the_planner() -> None:
    from netstorm import scenario
    from netstorm.config import Config
    from netstorm.planning.plan import plan
    from scheduler.service import SchedulerService

    rates = scenario.load("internet2-9").rates()
    nodes = sorted({a for a, _ in rates})
    for packing in (True, False):
        service = SchedulerService(rates, nodes, Config(tree_packing=packing))
        first = service.planner.first(rates, nodes)
        assert first == plan(rates, packing=packing).with_version(first.version)
    # the two planners really differ on this overlay, so the check above could fail
    assert plan(rates, packing=True).chunk_share != plan(rates, packing=False).chunk_share


def test_stale_options_reach_the_collector() -> None:
    from netstorm import scenario
    from netstorm.config import Config
    from scheduler.service import SchedulerService

    rates = scenario.load("internet2-9").rates()
    nodes = sorted({a for a, _ in rates})
    clock = iter([100.0])
    service = SchedulerService(rates, nodes, Config(stale_after=2.0, stale_half_life=4.0), clock=lambda: next(clock))
    assert (service.collector.stale_after, service.collector.half_life) == (2.0, 4.0)
    # Never measured since the start at t=100: believed as given for 2 s, then halfway to the fastest
    # link's rate after one half-life more.
    slow = min(rates, key=lambda link: rates[link])
    top = max(rates.values())
    assert service.collector.estimate(101.9)[slow] == rates[slow]
    assert service.collector.estimate(106.0)[slow] == pytest.approx((rates[slow] + top) / 2)


def test_stale_options_are_validated() -> None:
    from netstorm.config import Config

    with pytest.raises(ConfigError, match="stale_half_life"):
        Config().replace(stale_half_life=0.0)
    with pytest.raises(ConfigError, match="stale_after"):
        Config().replace(stale_after=-1.0)


def test_history_pages_bindings_and_published_policies_over_the_admin_interface(
        monkeypatch: pytest.MonkeyPatch) -> None:
    async def main() -> None:
        async with scheduler() as service:
            clients = await connect_all(service)
            try:
                for k in (0, 1, 2):
                    await asyncio.gather(*(c.policy_for(k, timeout=T) for c in clients))
                slow = {**RATES, (1, 2): 1.0, (2, 1): 1.0}
                assert await admin.override_policy(addr(service), slow, timeout=T) == 1
                await clients[0].policy_for(3, timeout=T)
                history = await admin.history(addr(service), timeout=T)
                assert history.bindings == ((0, 0), (1, 0), (2, 0), (3, 1))
                assert [r.version for r in history.policies] == [0, 1]
                assert history.policies[0].reason == "first plan"
                assert re.fullmatch(r"override from 127\.0\.0\.1:\d+", history.policies[1].reason)
                for record in history.policies:
                    policy = service.consistency.policy(record.version)
                    assert isinstance(policy, Policy)
                    assert record.roots == policy.roots
                    assert record.trees() == {root: {child: parent for child, parent in policy.trees[root].edges()}
                                              for root in policy.roots}
                later = await admin.history(addr(service), 3, 1, timeout=T)
                assert later.bindings == ((3, 1),) and [r.version for r in later.policies] == [1]
                assert await admin.history(addr(service), 4, 2, timeout=T) == control.History((), ())
                monkeypatch.setattr(service_module, "HISTORY_BINDINGS", 2)
                monkeypatch.setattr(service_module, "HISTORY_POLICIES", 1)
                page = await admin.history(addr(service), 1, 0, timeout=T)
                assert page.bindings == ((1, 0), (2, 0)) and [r.version for r in page.policies] == [0]
            finally:
                await close_all(clients)

    run(main())


def test_status_names_each_gateways_lan_aggregation_mode(caplog: pytest.LogCaptureFixture) -> None:
    async def main() -> None:
        async with scheduler(nodes=(1, 2, 3)) as service:
            clients = await connect_all(service, (1, 2, 3), workers={2: 3, 3: 2})
            try:
                assert (await admin.status(addr(service), timeout=T)).edge == {}
                clients[1].report_edge("xdp (native)")
                clients[2].report_edge("userspace", "cannot load: bpf_prog_load EPERM " + "x" * 1000)
                await clients[0]._send(control.EdgeReport(3, "xdp (generic)"))  # not node 3's connection

                async def reported() -> control.Status:
                    while True:
                        status = await admin.status(addr(service), timeout=T)
                        if len(status.edge) == 2:
                            return status
                        await asyncio.sleep(0.01)  # the reports travel on other connections

                async with asyncio.timeout(T):
                    status = await reported()
                assert status.edge[2] == ("xdp (native)", "")
                mode, fallback = status.edge[3]
                assert mode == "userspace" and fallback.startswith("cannot load: bpf_prog_load EPERM x")
                assert len(fallback) == EDGE_REASON, "a long reason is cut, the report stays small"
                await until(lambda: any("edge report names node 3" in r.getMessage() for r in caplog.records),
                            "a report for another node refused")
                assert (await admin.status(addr(service), timeout=T)).edge[3][0] == "userspace"
            finally:
                await close_all(clients)

    with caplog.at_level("INFO", logger="scheduler.service"):
        run(main())
