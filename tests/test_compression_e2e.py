"""Compression over a `netstorm local` cluster: every DC's result equals an in-process replay of the same
protocol with numpy sums, bit for bit (so the nodes summed every vote count and quantized value exactly,
over multi-root trees), the GIA is the same at every DC, and the nodes count their WAN frames."""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest

import netstorm
from netstorm.compression.options import VOTES, CompressionOptions
from netstorm.compression.session import AsyncCompressedClient, Rounds, RoundStats, Tensors
from netstorm.frames import PREFIX_SIZE
from netstorm.layout import Layout, TensorSpec
from netstorm.local import LocalCluster

pytestmark = pytest.mark.slow

NODES = [1, 2, 3, 4, 5]
TIMEOUT = 60.0
STEPS = 4


def gradients(dc: int, step: int) -> Tensors:
    """Dyadic values (k / 1024): their float32 sums are exact in any order, so the replay can match."""
    rng = np.random.default_rng(100 * step + dc)

    def draw(*shape: int) -> np.ndarray:
        heavy = rng.integers(-2000, 2000, shape) * (rng.random(shape) < 0.2)
        return ((rng.integers(-30, 30, shape) + heavy) / 1024).astype(np.float32)

    return {"fc.weight": draw(60, 100), "fc.bias": draw(60), "conv": draw(3, 900)}


def replay(options: CompressionOptions, steps: int) -> list[dict[int, Tensors]]:
    """The protocol run in-process: each round's pushes summed with numpy (integers as int64)."""
    model = gradients(1, 0)
    rounds = {dc: Rounds(options, model) for dc in NODES}
    # FediAC's roots threshold the full vote counts; the DCs get the 0/1 GIA back
    applied = options.votes_of(len(NODES)) if options.method == "fediac" else 0
    for dc in NODES:
        rounds[dc].registered(model)
        rounds[dc].start(len(NODES), dc, applied)
    out = []
    for step in range(1, steps + 1):
        gens = {dc: r.iteration(gradients(dc, step)) for dc, r in rounds.items()}
        pushes = {dc: next(g) for dc, g in gens.items()}
        results: dict[int, Tensors] = {}
        while pushes:
            summed: Tensors = {}
            for name in next(iter(pushes.values())):
                values = [np.asarray(p[name]) for p in pushes.values()]
                summed[name] = np.asarray(np.sum(values, axis=0, dtype=np.int64) if values[0].dtype.kind in "iu"
                                          else np.sum(values, axis=0, dtype=np.float32))
                if name == VOTES and applied:
                    summed[name] = (summed[name] >= applied).astype(np.int64)
            following = {}
            for dc, gen in gens.items():
                try:
                    following[dc] = gen.send(summed)
                except StopIteration as done:
                    results[dc] = done.value
            pushes = following
        out.append(results)
    return out


async def run_cluster(tmp_path: Path, options: CompressionOptions, steps: int,
                      ) -> tuple[list[dict[int, Tensors]], list[dict[int, RoundStats]], dict[int, int]]:
    cluster = LocalCluster("scale-5", NODES, tmp_path / "run",
                           scheduler_args=["--num-root-servers", "3", "--enable-aux-path", "false"],
                           common_args=["--chunk-size", "2500", "--iteration-timeout", "30"])
    results: list[dict[int, Tensors]] = []
    stats: list[dict[int, RoundStats]] = []
    applied: dict[int, int] = {}
    async with cluster:
        raw = {dc: await netstorm.aconnect(cluster.socket_path(dc), timeout=TIMEOUT) for dc in NODES}
        clients = {dc: AsyncCompressedClient(kv, options) for dc, kv in raw.items()}
        try:
            await asyncio.gather(*(c.init(gradients(1, 0)) for c in clients.values()))
            applied = {dc: c.rounds.applied if c.rounds is not None else -1 for dc, c in clients.items()}
            for step in range(1, steps + 1):
                got = await asyncio.gather(*(c.push_pull(gradients(dc, step)) for dc, c in clients.items()))
                results.append(dict(zip(clients, got, strict=True)))
                stats.append({dc: c.last for dc, c in clients.items()})
        finally:
            for kv in raw.values():
                await kv.close()
    return results, stats, applied


@pytest.mark.parametrize("method", ["fediac", "topk"])
def test_sparse_methods_match_their_replay_bit_for_bit(tmp_path: Path, method: str) -> None:
    options = CompressionOptions(method, k=0.03, bits=0, votes=2)
    results, stats, applied = asyncio.run(run_cluster(tmp_path, options, STEPS))
    expected = replay(options, STEPS)
    for step, (got, want) in enumerate(zip(results, expected, strict=True), start=1):
        for dc in NODES:
            assert set(got[dc]) == {"fc.weight", "fc.bias", "conv"}
            for name, value in want[dc].items():
                assert np.array_equal(got[dc][name], value), (method, step, dc, name)
                assert np.array_equal(got[dc][name], got[1][name])  # every DC holds the same sum
        gia = {s.gia for s in stats[step - 1].values()}
        assert len(gia) == 1
        assert applied == dict.fromkeys(NODES, 2 if method == "fediac" else 0)  # FediAC's roots: a = 2
        first = stats[step - 1][1]
        assert all(s.wan_bytes > 0 for s in stats[step - 1].values())
        if method == "fediac" and step == 1:
            assert first.dense and first.round_trips == 1 and 2 < first.bits <= 24
        else:
            assert first.round_trips == 2 and 0 < gia.pop() < 60 * 100 + 60 + 2700


def test_fp16_wire_and_wan_byte_count(tmp_path: Path) -> None:
    """fp16 through the trainer API: every DC gets the same float16-rounded sum; the nodes' WAN bytes
    are the frames of a chunk up and down every tree edge (no auxiliary paths): 2 (N - 1) per chunk."""
    options = CompressionOptions("fp16")
    results, stats, _ = asyncio.run(run_cluster(tmp_path, options, 2))
    for step, got in enumerate(results, start=1):
        exact = {name: np.sum([gradients(dc, step)[name] for dc in NODES], axis=0) for name in got[1]}
        for dc in NODES:
            for name, value in got[dc].items():
                assert np.array_equal(value, got[1][name])
                np.testing.assert_allclose(value, exact[name], rtol=2e-3, atol=2e-3)
                assert np.array_equal(value, value.astype(np.float16).astype(np.float32))
        total = sum(s.wan_bytes for s in stats[step - 1].values())
        elements = sum(v.size for v in got[1].values())
        chunks = len(Layout.build([TensorSpec.of(n, v) for n, v in got[1].items()], 2500).chunks)
        assert chunks == 6  # conv in 2, fc.bias alone, fc.weight in 3
        hops = 2 * (len(NODES) - 1) * chunks
        payload = 2 * (len(NODES) - 1) * 2 * elements  # float16, no zero tail
        # a chunk header is about a hundred bytes of msgpack
        assert payload + hops * (PREFIX_SIZE + 80) <= total <= payload + hops * (PREFIX_SIZE + 130)
