"""Iteration bookkeeping that cannot lie, seen from trainers: three DCs in-process on loopback.

One trainer per node unless more are configured (then each counts and the worker count says so); a
trainer beyond them is refused at its init; a replacement trainer inits and continues; a push too far
ahead of its own pulls is refused (and memory stays bounded); NaN/Inf is refused with
``check_finite``; a DC declared dead fails the iteration in flight with ``PeerLost``, and the next
result names the DCs it holds. Every sum is compared exactly with numpy.
"""

from __future__ import annotations

import asyncio
import contextlib
import tracemalloc
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import numpy as np
import pytest
import uvloop

import netstorm
from netstorm import trainer_wire as tw
from netstorm.aclient import AsyncClient
from netstorm.config import Config
from netstorm.errors import IterationError, NonFinite, PeerLost, TooFarAhead, TrainerLimit
from netstorm.planning.plan import plan
from netstorm.policy import Policy
from node.service import GeneralNode
from node.trainer_endpoint import TrainerEndpoint
from tests.dataplane import FixedControl, cluster, until

RATES = {(1, 2): 50.0, (2, 1): 40.0, (2, 3): 80.0, (3, 2): 60.0, (1, 3): 20.0, (3, 1): 25.0}
CONFIG = Config(chunk_size=300, iteration_timeout=20.0, connect_timeout=5.0)
MB = 1 << 20


def model(seed: int, size: int = 64) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {"w": rng.integers(-50, 50, (size,)).astype(np.float32),
            "b": rng.integers(-50, 50, (3,)).astype(np.float32)}


def total(*models: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    return {name: np.asarray(np.sum([m[name] for m in models], axis=0, dtype=np.float32)) for name in models[0]}


def same(got: dict[str, np.ndarray], want: dict[str, np.ndarray]) -> None:
    assert set(got) == set(want)
    for name, value in want.items():
        np.testing.assert_array_equal(got[name], value, err_msg=name)


class Job:
    """Three nodes, a trainer endpoint each (Unix socket; node 2 also over TCP), and the members the
    test's scheduler still counts (policies span them)."""

    def __init__(self, nodes: dict[int, GeneralNode], endpoints: dict[int, TrainerEndpoint],
                 sockets: dict[int, str]) -> None:
        self.nodes = nodes
        self.endpoints = endpoints
        self.sockets = sockets
        self.alive = set(nodes)

    async def connect(self, dc: int, within: float = 10.0) -> AsyncClient:
        return await netstorm.aconnect(self.sockets[dc], timeout=within)

    def declare_down(self, dc: int) -> None:
        """What the scheduler does for a dead DC: policies without it, ``MemberDown`` everywhere."""
        self.alive.discard(dc)
        for node in self.nodes.values():
            assert isinstance(node.control, FixedControl)
            node.control.declare_down(dc, "no heartbeat")


@contextlib.asynccontextmanager
async def job(tmp_path: Path, config: Config = CONFIG, workers: dict[int, int] | None = None,
              trainers: dict[int, int] | None = None) -> AsyncIterator[Job]:
    alive: set[int] = {1, 2, 3}

    def policy(iteration: int) -> Policy:
        rates = {(a, b): r for (a, b), r in RATES.items() if a in alive and b in alive}
        return plan(rates, topology="fapt", version=3 - len(alive))

    async with cluster([1, 2, 3], config, policy, workers) as nodes:
        for dc, count in (trainers or {}).items():
            nodes[dc].trainers = count
        endpoints = {i: TrainerEndpoint(n) for i, n in nodes.items()}
        sockets = {}
        for i, endpoint in endpoints.items():
            await endpoint.serve_unix(tmp_path / f"node-{i}.sock")
            sockets[i] = str(tmp_path / f"node-{i}.sock")
        tcp = await endpoints[2].serve_tcp("127.0.0.1", 0)
        sockets[2] = f"tcp://127.0.0.1:{tcp.sockets[0].getsockname()[1]}"
        the_job = Job(nodes, endpoints, sockets)
        the_job.alive = alive
        try:
            yield the_job
        finally:
            for endpoint in endpoints.values():
                endpoint.close()


def run(tmp_path: Path, body: Callable[[Job], Awaitable[None]], **options: object) -> None:
    async def main() -> None:
        async with job(tmp_path, **options) as the_job:  # type: ignore[arg-type]
            await body(the_job)
    uvloop.run(main())


async def init_all(clients: dict[int, AsyncClient], seed: int = 0) -> None:
    await asyncio.gather(*(kv.init(model(seed)) for kv in clients.values()))


def test_a_second_trainer_on_a_node_is_refused_at_init_and_sums_stay_exact(tmp_path: Path) -> None:
    async def body(j: Job) -> None:
        clients = {dc: await j.connect(dc) for dc in (1, 2, 3)}
        await init_all(clients)
        second = await j.connect(1)
        with pytest.raises(TrainerLimit, match=r"trainers = 1"):
            await second.init(model(0))
        steps = {dc: model(10 + dc) for dc in clients}
        results = await asyncio.gather(*(kv.push_pull(steps[dc]) for dc, kv in clients.items()))
        for got in results:
            same(got, total(*steps.values()))
        assert all(kv.num_workers == 3 and kv.contributors == (1, 2, 3) for kv in clients.values())
        await second.close()
        for kv in clients.values():
            await kv.close()
    run(tmp_path, body)


def test_configured_trainers_each_count_and_the_worker_count_says_so(tmp_path: Path) -> None:
    async def body(j: Job) -> None:
        ranks = [await j.connect(1), await j.connect(1)]
        others = {dc: await j.connect(dc) for dc in (2, 3)}
        await asyncio.gather(*(kv.init(model(0)) for kv in [*ranks, *others.values()]))
        with pytest.raises(TrainerLimit, match=r"trainers = 2"):
            await (await j.connect(1)).init(model(0))
        for step in (1, 2):
            values = [model(100 * step + i) for i in range(4)]
            results = await asyncio.gather(*(kv.push_pull(v, average=True)
                                             for kv, v in zip([*ranks, *others.values()], values, strict=True)))
            want = {name: value / np.float32(4) for name, value in total(*values).items()}
            for got in results:
                same(got, want)
        assert all(kv.num_workers == 4 for kv in [*ranks, *others.values()])
    run(tmp_path, body, workers={1: 2}, trainers={1: 2})


def test_a_replacement_trainer_inits_and_continues(tmp_path: Path) -> None:
    async def body(j: Job) -> None:
        clients = {dc: await j.connect(dc) for dc in (1, 2, 3)}
        await init_all(clients)
        # DC 1's trainer pushes iteration 1, then dies before pulling it.
        steps = {dc: model(20 + dc) for dc in clients}
        for name, value in steps[1].items():
            await clients[1].push(name, value)
        await clients[1].close()
        others = [asyncio.ensure_future(clients[dc].push_pull(steps[dc])) for dc in (2, 3)]
        await until(lambda: len(j.endpoints[1].ranks) == 0, "DC 1's trainer gone")
        replacement = await j.connect(1)
        own = model(7)
        same(await replacement.init(own), own)  # its own values back; no round of its own
        for got in await asyncio.gather(*others):
            same(got, total(*steps.values()))  # the departed trainer's push counted, once
        clients[1] = replacement
        steps = {dc: model(30 + dc) for dc in clients}
        results = await asyncio.gather(*(kv.push_pull(steps[dc]) for dc, kv in clients.items()))
        for got in results:
            same(got, total(*steps.values()))
        assert all(kv.contributors == (1, 2, 3) and kv.num_workers == 3 for kv in clients.values())
    run(tmp_path, body)


def test_a_push_too_far_ahead_is_refused_and_the_node_holds_no_more(tmp_path: Path) -> None:
    size = MB // 4  # a 1 MB tensor

    async def body(j: Job) -> None:
        clients = {dc: await j.connect(dc, within=30) for dc in (1, 2, 3)}
        await asyncio.gather(*(kv.init(model(0, size)) for kv in clients.values()))
        pushed: list[dict[str, np.ndarray]] = []
        refused = 0
        tracemalloc.start()
        base = 0
        for step in range(20):  # a trainer that pushes and never pulls
            if step == CONFIG.max_ahead + 1:  # what the window allows is in: from here on nothing more
                base = tracemalloc.get_traced_memory()[0]
            values = model(40 + step, size)
            try:
                for name, value in values.items():
                    await clients[1].push(name, value)
                pushed.append(values)
            except TooFarAhead as exc:
                assert "pull first" in str(exc)
                refused += 1
        grown = tracemalloc.get_traced_memory()[0] - base
        tracemalloc.stop()
        assert len(pushed) == CONFIG.max_ahead + 1 and refused == 20 - len(pushed)
        assert grown < 3 * MB, grown  # one model per further iteration before
        for k, values in enumerate(pushed):  # what was accepted completes exactly, nothing else counted
            steps = {dc: model(50 + 10 * k + dc, size) for dc in (2, 3)}
            results = await asyncio.gather(*(clients[dc].push_pull(steps[dc]) for dc in (2, 3)),
                                           *(clients[1].pull(name) for name in values))
            for got in results[:2]:
                same(got, total(values, *steps.values()))
        assert not any(n.down for n in j.nodes.values())
    # the window is the subject, not the timeout: iteration 1 waits for DCs 2 and 3 through twenty traced
    # pushes, which on two busy cores took longer than 20 s and timed it out, opening the window
    run(tmp_path, body, config=CONFIG.replace(iteration_timeout=120.0))


def test_nan_and_inf_are_refused_at_push_naming_dc_and_tensor(tmp_path: Path) -> None:
    async def body(j: Job) -> None:
        clients = {dc: await j.connect(dc) for dc in (1, 2, 3)}
        await init_all(clients)
        bad = model(60)
        bad["b"][1] = np.nan
        with pytest.raises(NonFinite, match=r"DC 2: tensor 'b'"):  # inline over TCP
            await clients[2].push_pull(bad)
        bad["b"][1] = -np.inf
        with pytest.raises(NonFinite, match=r"DC 1: tensor 'b'"):  # through shared memory
            await clients[1].push("b", bad["b"])
        steps = {dc: model(70 + dc) for dc in clients}  # nothing of the refused push counted
        for got in await asyncio.gather(*(kv.push_pull(steps[dc]) for dc, kv in clients.items())):
            same(got, total(*steps.values()))
    run(tmp_path, body, config=CONFIG.replace(check_finite=True))


def test_a_dc_declared_dead_fails_the_iteration_everywhere_and_the_next_names_its_contributors(
        tmp_path: Path) -> None:
    async def body(j: Job) -> None:
        clients = {dc: await j.connect(dc) for dc in (1, 2, 3)}
        await init_all(clients)
        steps = {dc: model(80 + dc) for dc in clients}
        waiting = [asyncio.ensure_future(clients[dc].push_pull(steps[dc])) for dc in (1, 2)]
        await until(lambda: all(j.nodes[dc].core.policy(1) is not None for dc in (1, 2)), "iteration 1 bound")
        j.declare_down(3)
        for outcome in await asyncio.gather(*waiting, return_exceptions=True):
            assert isinstance(outcome, PeerLost) and isinstance(outcome, IterationError), outcome
            assert "node 3" in str(outcome) and "iteration 1" in str(outcome)
        steps = {dc: model(90 + dc) for dc in (1, 2)}
        for got in await asyncio.gather(*(clients[dc].push_pull(steps[dc]) for dc in (1, 2))):
            same(got, total(*steps.values()))
        assert all(clients[dc].contributors == (1, 2) and clients[dc].num_workers == 2 for dc in (1, 2))
    run(tmp_path, body)


def test_an_init_too_large_for_any_layout_is_refused_before_anything_is_built(tmp_path: Path) -> None:
    async def body(j: Job) -> None:
        host, port = j.sockets[2].removeprefix("tcp://").rsplit(":", 1)
        reader, writer = await asyncio.open_connection(host, int(port))
        elements = 2**29  # more than 2**20 chunks of 300 elements
        writer.write(tw.encode(tw.InitRequest(tensors=(("w", (elements,), "float32"),), shm=""), 4 * elements))
        async with asyncio.timeout(10):
            header_len, payload_len = tw.decode_prefix(await reader.readexactly(tw.PREFIX.size), max_payload=0)
            reply = tw.decode(await reader.readexactly(header_len))
        assert isinstance(reply, tw.ErrorReply) and payload_len == 0
        assert f"init of {elements} elements" in reply.message
        writer.close()
        assert j.nodes[2].layout is None and len(j.endpoints[2].ranks) == 0
    run(tmp_path, body)


def test_trainer_connections_from_one_address_are_capped(tmp_path: Path) -> None:
    async def body(j: Job) -> None:
        host, port = j.sockets[2].removeprefix("tcp://").rsplit(":", 1)
        crowd = [await asyncio.open_connection(host, int(port)) for _ in range(5)]
        reader, _ = crowd[-1]
        async with asyncio.timeout(10):
            header_len, _ = tw.decode_prefix(await reader.readexactly(tw.PREFIX.size), max_payload=0)
            reply = tw.decode(await reader.readexactly(header_len))
            assert isinstance(reply, tw.ErrorReply) and "more than 4 trainer connections" in reply.message
            assert await reader.read() == b""
        for _, w in crowd:
            w.close()
        # The crowd is gone: a trainer connects and trains.
        clients = {dc: await j.connect(dc) for dc in (1, 2, 3)}
        await init_all(clients)
    run(tmp_path, body, config=CONFIG.replace(max_connections_per_source=4))


def test_the_blocking_client_names_the_contributors_too(tmp_path: Path) -> None:
    async def body(j: Job) -> None:
        blocking = await asyncio.to_thread(netstorm.connect, j.sockets[1], timeout=10)
        others = {dc: await j.connect(dc) for dc in (2, 3)}
        await asyncio.gather(asyncio.to_thread(blocking.init, model(0)), *(kv.init(model(0)) for kv in others.values()))
        assert blocking.contributors == (1,)  # the init round: node 1's values everywhere
        steps = {dc: model(110 + dc) for dc in (1, 2, 3)}
        results = await asyncio.gather(asyncio.to_thread(blocking.push_pull, steps[1]),
                                       *(kv.push_pull(steps[dc]) for dc, kv in others.items()))
        for got in results:
            same(got, total(*steps.values()))
        assert blocking.contributors == (1, 2, 3) and blocking.num_workers == 3
        blocking.close()
    run(tmp_path, body)


def test_a_rank_ahead_of_the_slowest_waits_for_it(tmp_path: Path) -> None:
    async def body(j: Job) -> None:
        a, b = await j.connect(1), await j.connect(1)
        others = {dc: await j.connect(dc) for dc in (2, 3)}
        await asyncio.gather(*(kv.init(model(0)) for kv in [a, b, *others.values()]))
        steps = [{dc: model(120 + 10 * k + dc) for dc in range(4)} for k in range(3)]

        async def push(kv: AsyncClient, values: dict[str, np.ndarray]) -> None:
            for name, value in values.items():
                await kv.push(name, value)

        async def pull(kv: AsyncClient, names: list[str]) -> dict[str, np.ndarray]:
            return {name: await kv.pull(name) for name in names}

        names = list(model(0))
        for k in (0, 1):  # the other DCs run iterations 1 and 2 whenever node 1's sums come
            for dc, kv in others.items():
                await push(kv, steps[k][dc])
        await push(a, steps[0][0])
        await push(b, steps[0][1])
        await push(a, steps[1][0])  # one ahead of its own pulls: allowed
        same(await pull(a, names), total(*steps[0].values()))
        # Rank a is one ahead of its own pulls again, but two past rank b's: its push waits for b.
        late = asyncio.ensure_future(push(a, steps[2][0]))
        await asyncio.wait([late], timeout=0.3)
        assert not late.done()
        same(await pull(b, names), total(*steps[0].values()))
        await late
        await push(b, steps[1][1])
        for kv in (a, b):
            same(await pull(kv, names), total(*steps[1].values()))
        for kv in [a, b, *others.values()]:
            await kv.close()
    run(tmp_path, body, workers={1: 2}, trainers={1: 2})


def test_a_trainer_that_goes_away_mid_request_frees_its_place_at_once(tmp_path: Path,
                                                                     record_property: Callable[[str, object], None]
                                                                     ) -> None:
    """Its push_pull waits for the other DCs; it closes; a replacement inits straight away, well before
    iteration_timeout (60 s), and the iteration it had pushed completes exactly for the others."""
    async def body(j: Job) -> None:
        clients = {dc: await j.connect(dc, within=60) for dc in (1, 2, 3)}
        await init_all(clients)
        steps = {dc: model(40 + dc) for dc in clients}
        waiting = asyncio.ensure_future(clients[1].push_pull(steps[1]))
        await until(lambda: j.nodes[1].core.key_next(0) == 2, "DC 1's push in")
        loop = asyncio.get_running_loop()
        start = loop.time()
        clients[1]._writer.transport.abort()  # as a killed process's socket closes
        await until(lambda: len(j.endpoints[1].ranks) == 0, "DC 1's place free", within=5)
        freed = loop.time() - start
        with contextlib.suppress(Exception):
            await waiting
        await clients[1].close()
        replacement = await j.connect(1, within=5)
        own = model(8)
        async with asyncio.timeout(5):
            same(await replacement.init(own), own)
        record_property("place_freed_s", freed)
        record_property("replacement_init_s", loop.time() - start)
        for got in await asyncio.gather(*(clients[dc].push_pull(steps[dc]) for dc in (2, 3))):
            same(got, total(*steps.values()))
        clients[1] = replacement
        steps = {dc: model(50 + dc) for dc in clients}
        for got in await asyncio.gather(*(kv.push_pull(steps[dc]) for dc, kv in clients.items())):
            same(got, total(*steps.values()))
    run(tmp_path, body, config=CONFIG.replace(iteration_timeout=60.0))
