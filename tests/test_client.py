"""Trainer endpoint and clients: shared memory over a Unix socket, inline over TCP, blocking and asyncio.

Three DCs each with a trainer of a different kind; every result is compared exactly with numpy.
"""

from __future__ import annotations

import asyncio
import gc
import glob
import os
import warnings
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import uvloop

import netstorm
from netstorm.config import Config
from netstorm.errors import NodeGone, TrainerProtocolError, TrainerTimeout, UnknownTensor, WrongDtype, WrongShape
from netstorm.planning.plan import plan
from netstorm.policy import Policy
from node.trainer_endpoint import TrainerEndpoint
from tests.dataplane import cluster

RATES = {(1, 2): 50.0, (2, 1): 40.0, (2, 3): 80.0, (3, 2): 60.0, (1, 3): 20.0, (3, 1): 25.0}
CONFIG = Config(chunk_size=300, iteration_timeout=20.0, connect_timeout=5.0)


def policy(iteration: int) -> Policy:
    return plan(RATES, topology="fapt", version=0)


def model(seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        "fc.weight": rng.integers(-50, 50, (20, 40)).astype(np.float32),
        "fc.bias": rng.integers(-50, 50, (40,)).astype(np.float32),
        "emb": rng.integers(-50, 50, (7, 3)).astype(np.float16),
        "scalar": np.array(rng.integers(-50, 50), dtype=np.float32),
    }


def shm_files() -> set[str]:
    return set(glob.glob(f"/dev/shm/netstorm-{os.getpid()}-*"))


def run_cluster(tmp_path: Path, body: Callable[[dict[int, str]], object], config: Config = CONFIG,
                workers: dict[int, int] | None = None) -> None:
    async def main() -> None:
        async with cluster([1, 2, 3], config, policy, workers) as nodes:
            endpoints = {i: TrainerEndpoint(n) for i, n in nodes.items()}
            addresses = {}
            for i, endpoint in endpoints.items():
                await endpoint.serve_unix(tmp_path / f"node-{i}.sock")
                addresses[i] = str(tmp_path / f"node-{i}.sock")
            tcp = await endpoints[2].serve_tcp("127.0.0.1", 0)
            addresses[2] = f"tcp://127.0.0.1:{tcp.sockets[0].getsockname()[1]}"
            try:
                result = body(addresses)
                if asyncio.iscoroutine(result):
                    await result
            finally:
                for endpoint in endpoints.values():
                    endpoint.close()
    uvloop.run(main())


def test_three_kinds_of_trainers_agree_exactly(tmp_path: Path):
    before = shm_files()
    models = {i: model(i) for i in (1, 2, 3)}
    steps = [{i: model(10 * k + i) for i in (1, 2, 3)} for k in range(3)]

    def sync_trainer(address: str, dc: int) -> list[dict[str, np.ndarray]]:
        with netstorm.connect(address, timeout=30) as kv:
            out = [kv.init(models[dc])]
            assert kv.num_workers == 3
            out.append(kv.push_pull(steps[0][dc]))
            out.append(kv.push_pull(steps[1][dc], average=True))
            for name, value in steps[2][dc].items():
                kv.push(name, value)
            out.append({name: kv.pull(name) for name in steps[2][dc]})
            return out

    async def async_trainer(address: str, dc: int) -> list[dict[str, np.ndarray]]:
        kv = await netstorm.aconnect(address, timeout=30)
        async with kv:
            out = [await kv.init(models[dc])]
            out.append(await kv.push_pull(steps[0][dc]))
            out.append(await kv.push_pull(steps[1][dc], average=True))
            for name, value in steps[2][dc].items():
                await kv.push(name, value)
            out.append({name: await kv.pull(name) for name in steps[2][dc]})
            return out

    async def body(addresses: dict[int, str]) -> None:
        results = await asyncio.gather(asyncio.to_thread(sync_trainer, addresses[1], 1),
                                       asyncio.to_thread(sync_trainer, addresses[2], 2),
                                       async_trainer(addresses[3], 3))
        for dc_results in results:
            init, summed, averaged, split = dc_results
            for name, value in models[1].items():  # node 1 has the lowest id: its values everywhere
                assert init[name].dtype == value.dtype and init[name].shape == value.shape
                np.testing.assert_array_equal(init[name], value)
            for name in models[1]:
                dtype = models[1][name].dtype
                total = np.sum([steps[0][i][name].astype(np.float32) for i in (1, 2, 3)], axis=0)
                np.testing.assert_array_equal(summed[name], total.astype(dtype))
                mean = np.sum([steps[1][i][name].astype(np.float32) for i in (1, 2, 3)], axis=0) / np.float32(3)
                np.testing.assert_array_equal(averaged[name], mean.astype(dtype))
                total = np.sum([steps[2][i][name].astype(np.float32) for i in (1, 2, 3)], axis=0)
                np.testing.assert_array_equal(split[name], total.astype(dtype))
        assert shm_files() == before  # the shared-memory files were unlinked once mapped

    run_cluster(tmp_path, body)


def test_the_mean_is_over_every_worker_when_dcs_sum_lan_workers(tmp_path: Path):
    """DC 1 registered 3 workers (its trainer and 2 LAN workers), DC 3 registered 2: every sum then holds
    6 workers' gradients, and the mean divides the float32 sum by 6, not by the 3 DCs."""
    workers = {1: 3, 2: 1, 3: 2}
    steps = [{i: model(20 * k + i) for i in (1, 2, 3)} for k in range(2)]

    async def trainer(address: str, dc: int) -> list[tuple[int, dict[str, np.ndarray]]]:
        kv = await netstorm.aconnect(address, timeout=30)
        async with kv:
            await kv.init(model(dc))
            out = [(kv.num_workers, await kv.push_pull(steps[0][dc], average=True))]
            for name, value in steps[1][dc].items():
                await kv.push(name, value)
            out.append((kv.num_workers, {name: await kv.pull(name, average=True) for name in steps[1][dc]}))
            return out

    async def body(addresses: dict[int, str]) -> None:
        results = await asyncio.gather(*(trainer(addresses[i], i) for i in (1, 2, 3)))
        for dc_results in results:
            for k, (num_workers, averaged) in enumerate(dc_results):
                assert num_workers == 6
                for name in steps[k][1]:
                    total = np.sum([steps[k][i][name].astype(np.float32) for i in (1, 2, 3)], axis=0)
                    mean = (total / np.float32(6)).astype(steps[k][1][name].dtype)
                    np.testing.assert_array_equal(averaged[name], mean, err_msg=f"{name}, step {k}")

    run_cluster(tmp_path, body, workers=workers)


def test_bad_requests_get_clear_errors_and_the_connection_stays_usable(tmp_path: Path):
    def trainer(address: str, dc: int) -> None:
        with netstorm.connect(address, timeout=30) as kv:
            kv.init(model(dc))
            good = model(dc + 5)
            with pytest.raises(UnknownTensor, match="'nope'"):
                kv.push_pull({**good, "nope": np.zeros(3, np.float32)})
            with pytest.raises(UnknownTensor, match="unknown tensor 7"):
                kv.push_pull({**good, 7: np.zeros(3, np.float32)})  # type: ignore[dict-item]
            with pytest.raises(WrongShape, match=r"'fc.bias': shape \(41,\), registered \(40,\)"):
                kv.push("fc.bias", np.zeros(41, np.float32))
            with pytest.raises(WrongDtype, match="'emb': dtype float32, registered float16"):
                kv.push("emb", np.zeros((7, 3), np.float32))
            if dc == 1:
                with pytest.raises(TrainerProtocolError, match="pulled before it was pushed"):
                    kv.pull("fc.bias")
            out = kv.push_pull(good)  # nothing of the rejected requests entered the sums
            for name in good:
                expected = np.sum([model(i + 5)[name].astype(np.float32) for i in (1, 2, 3)], axis=0)
                np.testing.assert_array_equal(out[name], expected.astype(good[name].dtype))

    async def body(addresses: dict[int, str]) -> None:
        await asyncio.gather(*(asyncio.to_thread(trainer, addresses[i], i) for i in (1, 2, 3)))

    run_cluster(tmp_path, body)


def test_a_failed_connect_closes_its_socket(tmp_path: Path):
    gc.collect()  # what earlier tests in this process left (their event loops) warns now, not below
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", ResourceWarning)
        with pytest.raises(NodeGone, match="cannot reach the node"):
            netstorm.connect(str(tmp_path / "nobody.sock"), timeout=2)
        gc.collect()
    assert [str(w.message) for w in caught if issubclass(w.category, ResourceWarning)
            and "socket" in str(w.message)] == []


def test_timeouts_and_missing_nodes(tmp_path: Path):
    with pytest.raises(NodeGone, match="cannot reach the node"):
        netstorm.connect(str(tmp_path / "nobody.sock"), timeout=2)

    def lonely(address: str) -> None:
        with netstorm.connect(address, timeout=1.0) as kv:
            with pytest.raises(TrainerTimeout, match="init: no answer from the node"):
                kv.init(model(1))  # the other DCs never call init
            # The late reply would be taken for the next request's: the connection refuses further use.
            with pytest.raises(NodeGone, match="unusable after: init: no answer"):
                kv.init(model(1))

    async def body(addresses: dict[int, str]) -> None:
        await asyncio.to_thread(lonely, addresses[1])

    run_cluster(tmp_path, body)


def test_an_async_request_cancelled_mid_flight_leaves_the_connection_refusing_further_use(tmp_path: Path):
    async def body(addresses: dict[int, str]) -> None:
        akv = await netstorm.aconnect(addresses[1], timeout=30.0)
        try:
            with pytest.raises(TimeoutError):
                async with asyncio.timeout(0.5):
                    await akv.init(model(1))  # the other DCs never call init: cancelled while waiting
            # The node's late answer would be read as the next request's: the connection refuses instead.
            with pytest.raises(NodeGone, match="unusable after: init: cancelled before the node answered"):
                await akv.init(model(1))
        finally:
            await akv.close()

    run_cluster(tmp_path, body)


def test_the_node_maps_only_the_trainers_own_shared_memory_files(tmp_path: Path):
    import socket

    from netstorm import trainer_wire as tw
    from netstorm.client import shm_directory

    victim = tmp_path / "precious.bin"
    victim.write_bytes(b"\x01" * 4 * 4)
    link = Path(shm_directory()) / f"netstorm-{os.getpid()}-symlink-test"
    link.unlink(missing_ok=True)
    link.symlink_to(victim)

    def init_with(address: str, shm: str, fd: int = -1) -> tw.Message:
        with socket.socket(socket.AF_UNIX) as s:
            s.settimeout(10)
            s.connect(address)
            s.sendall(tw.encode(tw.InitRequest((("w", (4,), "float32"),), shm, fd=fd)))
            prefix = s.recv(tw.PREFIX.size, socket.MSG_WAITALL)
            header_len, _ = tw.decode_prefix(prefix, max_payload=0)
            return tw.decode(s.recv(header_len, socket.MSG_WAITALL))

    async def body(addresses: dict[int, str]) -> None:
        for shm, message in ((str(victim), "is not a netstorm-* file"), (str(link), "cannot open")):
            reply = await asyncio.to_thread(init_with, addresses[1], shm)
            assert isinstance(reply, tw.ErrorReply) and message in reply.message, reply
        # a descriptor of this process that is not its model memory: the node opens nothing through it
        with victim.open("rb") as held:
            reply = await asyncio.to_thread(init_with, addresses[1], "", held.fileno())
        assert isinstance(reply, tw.ErrorReply) and "not its model memory" in reply.message, reply
        assert victim.read_bytes() == b"\x01" * 16

    try:
        run_cluster(tmp_path, body)
    finally:
        link.unlink(missing_ok=True)


def test_the_nodes_iteration_timeout_reaches_the_trainer_as_a_timeout_naming_the_iteration(tmp_path: Path):
    def lonely(address: str) -> None:
        with netstorm.connect(address, timeout=30) as kv, \
                pytest.raises(TrainerTimeout, match="iteration 0 timed out at node 2 after 1 s"):
            kv.init(model(2))  # over TCP; the other DCs never call init

    async def body(addresses: dict[int, str]) -> None:
        await asyncio.to_thread(lonely, addresses[2])

    run_cluster(tmp_path, body, CONFIG.replace(iteration_timeout=1.0))


def test_an_init_that_fails_while_filling_shared_memory_leaves_no_file(monkeypatch: pytest.MonkeyPatch):
    from netstorm import client as client_module
    from netstorm.client import Registry

    def interrupted(*args: object, **kwargs: object) -> None:
        raise KeyboardInterrupt

    before = shm_files()
    registry = Registry(inline=False)
    monkeypatch.setattr(client_module, "_place", interrupted)
    with pytest.raises(KeyboardInterrupt):
        registry.prepare_init(model(1))
    monkeypatch.undo()
    registry.close()
    assert shm_files() == before
