"""A FediAC job end to end with a LAN tier: a scheduler and two DC nodes (node 1 a gateway for two LAN
workers on a bridge, XDP or userspace), both DCs' trainers and the LAN workers running the same rounds.
The node tells its gateway role the job's compression, the gateway plans each round's wire, the LAN
workers send only those lanes, and the DC's exact integer sums reach the WAN roots, which threshold the
full counts: every participant decodes exactly what a numpy run of the four contributors' rounds does. With
``fediac_gia_reuse = 2`` every other iteration is one values round at the kept GIA, on the WAN and the LAN."""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path

import numpy as np
import pytest

import netstorm
from netstorm.compression.options import SCALE, VALUES, VOTES, CompressionOptions
from netstorm.compression.session import AsyncCompressedClient, Rounds
from netstorm.emulation.bridge_lan import GATEWAY_IP, Lan
from netstorm.lan.compressed import CompressedEdgeWorker, aconnect_compressed_edge
from netstorm.lan.introunds import Kind
from tests.test_edge_gateway import gateway_job

pytestmark = [pytest.mark.root, pytest.mark.slow]

EDGE_PORT = 9702
TIMEOUT = 60.0
OPTIONS = CompressionOptions("fediac", k=0.1, bits=10, votes=2)
SEED = 9
SHAPES = {"a.weight": (30, 40), "b.bias": (7,)}
CONTRIBUTORS = (1, 2, 10, 11)
"""DC 1's trainer, DC 2's trainer (their node ids seed their draws), the two LAN workers."""


def model() -> dict[str, np.ndarray]:
    return {name: np.zeros(shape, np.float32) for name, shape in SHAPES.items()}


def gradient(who: int, step: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(1000 * step + who)
    return {name: rng.standard_normal(shape).astype(np.float32) for name, shape in SHAPES.items()}


def reference(steps: int | list[int], options: CompressionOptions = OPTIONS) -> list[dict[str, np.ndarray]]:
    """The decoded sums of every step (1..steps, or the steps listed): the four contributors' rounds, their
    tensors summed in numpy and the vote counts thresholded at a = 2 as the WAN roots do (the 0/1 GIA comes
    back)."""
    rounds = [Rounds(options, model(), SEED) for _ in CONTRIBUTORS]
    for r, who in zip(rounds, CONTRIBUTORS, strict=True):
        r.registered(model())
        r.start(len(CONTRIBUTORS), who, applied=2)
    out = []
    for step in range(1, steps + 1) if isinstance(steps, int) else steps:
        gens = [r.iteration(gradient(who, step)) for r, who in zip(rounds, CONTRIBUTORS, strict=True)]
        pushes = [next(g) for g in gens]
        while True:
            summed = {name: np.sum([np.asarray(p[name], np.int64 if name in (VOTES, SCALE, VALUES) else np.float64)
                                    for p in pushes], axis=0) for name in pushes[0]}
            summed[VOTES] = (summed[VOTES] >= 2).astype(np.int64)
            results = []
            for g in gens:
                try:
                    pushes[gens.index(g)] = g.send(summed)
                except StopIteration as done:
                    results.append(done.value)
            if results:
                out.append(results[0])
                for other in results[1:]:
                    for name in SHAPES:
                        assert np.array_equal(other[name], results[0][name])
                break
    return out


@pytest.mark.parametrize("reuse", [1, 2])
@pytest.mark.parametrize("mode", ["userspace", pytest.param("xdp", marks=pytest.mark.bcc)])
def test_fediac_with_lan_workers_matches_numpy(tmp_path: Path, mode: str, reuse: int) -> None:
    with Lan(2) as lan, gateway_job(tmp_path, lan, mode, edge_port=EDGE_PORT, port_offset=500,
                                            gateway_flags=("--edge-pool-slots", "2")):
        asyncio.run(_drive(tmp_path, lan, steps=4 if reuse > 1 else 3,
                           options=dataclasses.replace(OPTIONS, gia_reuse=reuse)))


async def _drive(tmp_path: Path, lan: Lan, steps: int, options: CompressionOptions) -> None:
    workers = [await aconnect_compressed_edge(f"edge://{GATEWAY_IP}:{EDGE_PORT}?worker={i}", options,
                                              contributor=CONTRIBUTORS[2 + i], seed=SEED, timeout=TIMEOUT,
                                              sock=lan.udp_socket(ns, lan.worker_ip(i)),
                                              group_opener=lan.group_opener(ns))
               for i, ns in enumerate(lan.workers)]
    gw_raw = await netstorm.aconnect(str(tmp_path / "n1.sock"), timeout=TIMEOUT)
    dc2_raw = await netstorm.aconnect(str(tmp_path / "n2.sock"), timeout=TIMEOUT)
    gw = AsyncCompressedClient(gw_raw, options, SEED)
    dc2 = AsyncCompressedClient(dc2_raw, options, SEED)
    want = reference(steps, options)
    try:
        await asyncio.gather(gw.init(model()), dc2.init(model()), *(w.init(model()) for w in workers))
        everyone: list[AsyncCompressedClient | CompressedEdgeWorker] = [gw, dc2, *workers]
        assert [kv.num_workers for kv in everyone] == [4, 4, 4, 4]
        for step in range(1, steps + 1):
            outs = await asyncio.gather(*(kv.push_pull(gradient(who, step))
                                          for kv, who in zip(everyone, CONTRIBUTORS, strict=True)))
            for who, out in zip(CONTRIBUTORS, outs, strict=True):
                for name in SHAPES:
                    np.testing.assert_array_equal(out[name], want[step - 1][name],
                                                  err_msg=f"contributor {who}, {name}, step {step}")
            gia = gw.last.gia
            assert 0 < gia < 1207
            reused = options.gia_reuse > 1 and step % 2 == 0
            assert gw.last.reused == dc2.last.reused == reused
            for w in workers:
                assert w.last.gia == gia and w.last.reused == reused
                if reused:   # one round: the values at the kept GIA and the scale one-hot
                    (again, _), = w.received
                    assert again.kind is Kind.REUSED and again.gia == gia
                    continue
                (votes, _), (values, _) = w.received
                # only the GIA's lanes travelled in the values round, on a pool of GIA-sized work
                assert votes.kind is Kind.VOTES and values.kind is Kind.VALUES and values.gia == gia
                assert values.layout.num_chunks == -(-gia // values.layout.lanes)
    finally:
        await gw_raw.close()
        await dc2_raw.close()
        for w in workers:
            await w.close()


@pytest.mark.parametrize("mode", ["userspace", pytest.param("xdp", marks=pytest.mark.bcc)])
def test_after_a_lan_worker_fails_a_round_the_job_recovers_with_exact_sums(tmp_path: Path, mode: str) -> None:
    """LAN worker 0's uplink fails for the whole votes round of step 2: the gateway's LAN sum times out,
    node 1 fails the iteration and tells its gateway role, which plans the restart wire and tells the LAN
    workers. Every contributor (both DCs' trainers, both LAN workers) ends step 2 with a typed error and
    undoes it; steps 3 and 4 decode exactly what numpy's run of the four contributors' rounds over steps
    1, 3 and 4 decodes, with the same GIA everywhere."""
    with Lan(2) as lan, gateway_job(tmp_path, lan, mode, edge_port=EDGE_PORT + 7, port_offset=507,
                                    gateway_flags=("--edge-pool-slots", "2"), iteration_timeout=RECOVERY_TIMEOUT[mode]):
        asyncio.run(_drive_failure(tmp_path, lan))


RECOVERY_TIMEOUT = {"userspace": 30.0, "xdp": 40.0}
"""Both nodes' iteration timeout (and so the gateway's wait for its LAN sum): the failed step costs it. The
init iteration must fit in it too, and on the XDP path it includes compiling and loading the program."""


async def _drive_failure(tmp_path: Path, lan: Lan) -> None:
    from netstorm.errors import NetStormError
    from netstorm.lan.errors import IterationAborted

    workers = [await aconnect_compressed_edge(f"edge://{GATEWAY_IP}:{EDGE_PORT + 7}?worker={i}", OPTIONS,
                                              contributor=CONTRIBUTORS[2 + i], seed=SEED, timeout=TIMEOUT,
                                              sock=lan.udp_socket(ns, lan.worker_ip(i)),
                                              group_opener=lan.group_opener(ns))
               for i, ns in enumerate(lan.workers)]
    gw_raw = await netstorm.aconnect(str(tmp_path / "n1.sock"), timeout=TIMEOUT)
    dc2_raw = await netstorm.aconnect(str(tmp_path / "n2.sock"), timeout=TIMEOUT)
    gw = AsyncCompressedClient(gw_raw, OPTIONS, SEED)
    dc2 = AsyncCompressedClient(dc2_raw, OPTIONS, SEED)
    want = dict(zip([1, 3, 4], reference([1, 3, 4]), strict=True))   # step 2 failed everywhere: undone
    try:
        await asyncio.gather(gw.init(model()), dc2.init(model()), *(w.init(model()) for w in workers))
        everyone: list[AsyncCompressedClient | CompressedEdgeWorker] = [gw, dc2, *workers]
        for step in (1, 2, 3, 4):
            if step == 2:   # worker 0's DATA of the votes round never leaves, resends included
                workers[0].sender.silent = frozenset({workers[0].iteration + 1})
            outs = await asyncio.gather(*(kv.push_pull(gradient(who, step))
                                          for kv, who in zip(everyone, CONTRIBUTORS, strict=True)),
                                        return_exceptions=True)
            if step == 2:
                # a typed error at every contributor; the LAN workers' from the gateway's notice, long
                # before their own 60 s timeout would have ended the wait
                assert all(isinstance(out, NetStormError) for out in outs), outs
                assert all(isinstance(out, IterationAborted) for out in outs[2:]), outs[2:]
                continue
            for who, out in zip(CONTRIBUTORS, outs, strict=True):
                assert isinstance(out, dict), (who, out)
                for name in SHAPES:
                    np.testing.assert_array_equal(out[name], want[step][name],
                                                  err_msg=f"contributor {who}, {name}, step {step}")
            gia = gw.last.gia
            assert 0 < gia < 1207 and dc2.last.gia == gia
            for w in workers:
                assert w.last.gia == gia
                (votes, _), (values, _) = w.received
                assert votes.kind is Kind.VOTES and values.kind is Kind.VALUES and values.gia == gia
    finally:
        await gw_raw.close()
        await dc2_raw.close()
        for w in workers:
            await w.close()
