"""Result delivery of a model far larger than the pool, in namespaces on both aggregation paths: every
chunk's RESULT a worker misses (its multicast socket overflowing under the burst of a whole model's
results, or loss on its downlink) is recovered by PULL, whatever slot of the pool the chunk used, so each
iteration ends with the exact sum against numpy; a result the gateway no longer has is a named timeout,
not a stall."""

from __future__ import annotations

import asyncio
import itertools
import socket
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from netstorm.lan.errors import EdgeTimeout
from netstorm.lan.layout import EdgeLayout
from tests.lan_reference import fixed_point_sums

pytestmark = [pytest.mark.root]

SCALE = 16
LANES = 357
POOL = 64
JOB = 13
PORT = 9480
GROUP = ("239.77.0.13", 9481)
_iterations = itertools.count(300, 20)


def layout(chunks: int) -> EdgeLayout:
    """Two tensors, ``chunks`` datagrams per worker through POOL slots: most chunks use a reused slot."""
    return EdgeLayout.uniform((LANES * (chunks - 1) - 11, 11), scale=SCALE, lanes=LANES, pool=POOL)


@pytest.fixture(scope="module")
def gateway_program() -> Iterator[Any]:
    from bpf.xdp import XdpAggregator

    agg = XdpAggregator(layout(4096), job=JOB, port=PORT, expected=1, timeout=0.05)
    yield agg
    agg.close()



def reference(contribs: list[list[np.ndarray]]) -> list[np.ndarray]:
    """The exact sums: int64 fixed point at the common scale (the values stay far from int32's range)."""
    return fixed_point_sums(contribs, [SCALE] * len(contribs[0]))


def small_buffer(opener: Callable[[tuple[str, int], str], socket.socket],
                 size: int) -> Callable[[tuple[str, int], str], socket.socket]:
    """``opener`` with the group socket's receive buffer cut to ``size`` bytes (0: as it is): a burst of
    results overflows it for certain."""
    def opened(group: tuple[str, int], local: str) -> socket.socket:
        sock = opener(group, local)
        if size:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, size)
        return sock

    return opened


async def run_lan(mode: str, program: Any, *, chunks: int, workers: int, iterations: int, tmp: Path,
                  downlink_loss: float = 0.0, keep_results: bool = True, group_rcvbuf: int = 0,
                  timeout: float = 60.0) -> dict[str, Any]:  # noqa: ASYNC109
    from bpf.agent import EdgeAgent
    from netstorm.emulation.bridge_lan import GATEWAY_IP, Lan
    from netstorm.emulation.netns import run_in
    from netstorm.lan.sender import EdgeSender

    lay = layout(chunks)
    rng = np.random.default_rng(chunks + workers)
    out: dict[str, Any] = {"checked": 0}
    with Lan(workers) as lan:
        if downlink_loss:
            from netstorm.emulation import lossfilter

            # the bridge's port towards each worker: results, ACKs and NACKs to that worker alone are lost
            lossfilter.attach({(lan.bridge, f"w{i}"): downlink_loss for i in range(workers)}, tmp / "bpf")
        xdp = None
        if mode == "xdp":
            xdp = program
            xdp.configure(job=JOB, port=PORT, expected=(1 << workers) - 1, timeout=0.05, max_nacks=50)
            ifindex = lan.gateway_ifindex()
            run_in(lan.gateway, lambda: xdp.attach(ifindex))
        nodes: list[EdgeSender] = []
        try:
            agent = EdgeAgent(lan.udp_socket(lan.gateway, GATEWAY_IP, PORT), lay, workers=workers, job=JOB,
                              mode=mode, xdp=xdp, slot_timeout=0.05, max_nacks=50, group=GROUP, retransmit=0.01)
            nodes = [EdgeSender(lan.udp_socket(ns, lan.worker_ip(i)), (GATEWAY_IP, PORT), worker=i, layout=lay,
                                job=JOB, seed=7, group_opener=small_buffer(lan.group_opener(ns), group_rcvbuf))
                     for i, ns in enumerate(lan.workers)]
            first = next(_iterations)
            agent.expect(first)
            async with asyncio.TaskGroup() as tg:
                serving = tg.create_task(agent.run())
                try:
                    await asyncio.gather(*(n.hello(timeout=10) for n in nodes))
                    await agent.wait_workers(timeout=10)
                    for k in range(iterations):
                        iteration = first + k
                        contribs = [[rng.standard_normal(s).astype(np.float32) for s in lay.sizes]
                                    for _ in range(workers)]
                        pushes = [tg.create_task(n.push_pull(iteration, contribs[n.worker], timeout=timeout))
                                  for n in nodes]
                        sums = await agent.collect(iteration, timeout=timeout)
                        expected = reference(contribs)
                        for got, want in zip(sums, expected, strict=True):
                            np.testing.assert_array_equal(got, want)
                        await agent.send_results(iteration, sums, total=workers)
                        if not keep_results:   # the gateway forgets them: what a worker missed cannot come back
                            agent.results.kept.pop(iteration)
                        for task in pushes:
                            got_sums, got_total = await task
                            assert got_total == workers
                            for got, want in zip(got_sums, expected, strict=True):
                                np.testing.assert_array_equal(got, want)
                        out["checked"] += 1
                finally:
                    agent.close()
                    await serving
            out["pulls"] = sum(n.pulls for n in nodes)
            return out
        finally:
            for node in nodes:
                node.close()
            if xdp is not None:
                xdp.detach()


@pytest.mark.slow
def test_results_lost_on_the_downlink_are_pulled_back_for_every_slot_of_the_pool(
        mode: str, tmp_path: Path, request: pytest.FixtureRequest) -> None:
    """Every chunk number past the pool shares a slot with earlier ones: a PULL must bring back the chunk
    it names, not the one that first used its slot."""
    program = request.getfixturevalue("gateway_program") if mode == "xdp" else None
    out = asyncio.run(run_lan(mode, program, chunks=2048, workers=4, iterations=3, tmp=tmp_path,
                              downlink_loss=0.02))
    assert out["checked"] == 3
    assert layout(2048).num_chunks > 16 * POOL
    assert out["pulls"] > 0   # results were lost and pulled back


def test_a_whole_model_of_results_in_one_burst_is_recovered(mode: str, tmp_path: Path,
                                                            request: pytest.FixtureRequest) -> None:
    """Thousands of RESULT datagrams multicast at once into group sockets that hold a few dozen: what
    overflows a worker's socket is pulled back, well over a pool's worth of chunks each iteration. (2048
    chunks, 32 pools' worth, overflow those sockets as surely as 4096 did, at half the run.)"""
    program = request.getfixturevalue("gateway_program") if mode == "xdp" else None
    out = asyncio.run(run_lan(mode, program, chunks=2048, workers=4, iterations=2, tmp=tmp_path,
                              group_rcvbuf=64 << 10))
    assert out["checked"] == 2
    assert out["pulls"] > POOL


def test_results_the_gateway_no_longer_keeps_are_a_named_timeout(tmp_path: Path) -> None:
    with pytest.raises(ExceptionGroup) as caught:
        asyncio.run(run_lan("userspace", None, chunks=512, workers=2, iterations=1, tmp=tmp_path,
                            downlink_loss=0.2, keep_results=False, timeout=3.0))
    timeouts = caught.value.subgroup(EdgeTimeout)
    assert timeouts is not None
    assert any("result chunks" in str(e) and "missing" in str(e) for e in timeouts.exceptions), caught.value
