"""Passive LAN rates on a shaped LAN, in namespaces, on both aggregation paths: four workers whose uplinks
are shaped (HTB) to 1, 2, 4 and 8 times a base rate and whose downlinks the other way round, behind an
unshaped gateway port. The gateway times each worker's first window of DATA per iteration (in XDP mode the
program does, in the kernel), each worker times its result burst and reports it; the measured rates must
order the workers as their shaping does, each step of 2x shaping at least ``ORDER`` apart and the 8x span
at least ``STEP`` squared (ratios, not rates: the host is shared), while every sum stays exact.

Uplink order is asserted on the XDP path only: there the kernel stamps each datagram as it arrives. The
userspace aggregator stamps DATA when the agent takes it from its socket, and in this harness the agent
shares one event loop (one core at most) with the four workers, so a fast worker's window waits in the
socket for the agent and measures the agent's pace, not the port's."""

from __future__ import annotations

import asyncio
import statistics
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from netstorm.lan.layout import EdgeLayout
from tests.lan_reference import fixed_point_sum

pytestmark = [pytest.mark.root, pytest.mark.slow]

BASE_GBIT = 0.03
UP = tuple(BASE_GBIT * 2**i for i in range(4))
DOWN = tuple(reversed(UP))
STEP = 1.4
"""The workers shaped 8x apart must measure more than STEP squared apart (the whole span, not each step)."""
ORDER = 1.15
"""Each 2x step of shaping must measure at least this apart (its order, with a margin for noise)."""
POOL = 256
LAYOUT = EdgeLayout.uniform([2 * POOL * 357], scale=16, lanes=357, pool=POOL)
ITERATIONS = 4
PORT = 9520
GROUP = ("239.77.0.21", 9521)
JOB = 21


@pytest.fixture(scope="module")
def xdp_program() -> Iterator[Any]:
    from bpf.xdp import XdpAggregator

    agg = XdpAggregator(LAYOUT, job=JOB, port=PORT, expected=(1 << len(UP)) - 1, timeout=0.2)
    yield agg
    agg.close()



def reference(contribs: list[np.ndarray]) -> np.ndarray:
    return fixed_point_sum(contribs, 16)


def rates(bursts: list[tuple[int, int, float, float]]) -> dict[int, float]:
    """Each worker's median burst rate in Gbit/s."""
    per: dict[int, list[float]] = {}
    for worker, nbytes, first, last in bursts:
        per.setdefault(worker, []).append(nbytes * 8 / (last - first) / 1e9)
    return {w: statistics.median(r) for w, r in sorted(per.items())}


async def run(mode: str, xdp: Any) -> tuple[dict[int, float], dict[int, float]]:
    from bpf.agent import EdgeAgent
    from netstorm.emulation.bridge_lan import GATEWAY_IP, Lan
    from netstorm.emulation.netns import run_in
    from netstorm.lan.sender import EdgeSender

    rng = np.random.default_rng(21)
    n = len(UP)
    ups: list[tuple[int, int, float, float]] = []
    with Lan(n, rates=list(zip(UP, DOWN, strict=True))) as lan:
        if xdp is not None:
            ifindex = lan.gateway_ifindex()
            run_in(lan.gateway, lambda: xdp.attach(ifindex))
        try:
            agent = EdgeAgent(lan.udp_socket(lan.gateway, GATEWAY_IP, PORT), LAYOUT, workers=n, job=JOB,
                              mode=mode, xdp=xdp, slot_timeout=0.2, group=GROUP, retransmit=0.005)
            nodes = [EdgeSender(lan.udp_socket(ns, lan.worker_ip(i)), (GATEWAY_IP, PORT), worker=i, layout=LAYOUT,
                                job=JOB, group_opener=lan.group_opener(ns)) for i, ns in enumerate(lan.workers)]
            reported, last = asyncio.Event(), set()
            take = agent.downlinks.on_report

            def counted(worker: int, iteration: int, report: Any) -> bool:
                if iteration == ITERATIONS:
                    last.add(worker)
                    if len(last) == n:
                        reported.set()
                return take(worker, iteration, report)

            agent.downlinks.on_report = counted  # type: ignore[method-assign]
            async with asyncio.TaskGroup() as tg:
                serving = tg.create_task(agent.run())
                try:
                    await asyncio.gather(*(node.hello(timeout=10) for node in nodes))
                    await agent.wait_workers(timeout=10)
                    for k in range(1, ITERATIONS + 1):
                        contribs = [rng.standard_normal(LAYOUT.sizes[0]).astype(np.float32) for _ in nodes]
                        pushes = [tg.create_task(node.push_pull(k, [contribs[node.worker]], timeout=60))
                                  for node in nodes]
                        sums = await agent.collect(k, timeout=60)
                        want = reference(contribs)
                        np.testing.assert_array_equal(sums[0], want)
                        ups += agent.uplink_bursts(k)
                        await agent.send_results(k, sums, total=n)
                        for push in pushes:
                            got, _ = await push
                            np.testing.assert_array_equal(got[0], want)
                    # the last reports travel after the workers' push_pull returned: wait for every one
                    async with asyncio.timeout(10):
                        await reported.wait()
                    downs = agent.downlink_bursts()
                finally:
                    agent.close()
                    await serving
            for node in nodes:
                node.close()
        finally:
            if xdp is not None:
                xdp.detach()
    assert sorted({w for w, *_ in ups}) == list(range(n))
    # every burst holds a whole first window, the pool's datagrams (resends of its chunks too, in userspace)
    assert all(nbytes >= POOL * (44 + 4 * LAYOUT.lanes) for _, nbytes, *_ in ups), ups
    assert len(downs) == n * ITERATIONS
    return rates(ups), rates(downs)


def test_measured_rates_order_the_workers_as_their_shaping_does(mode: str, request: pytest.FixtureRequest) -> None:
    xdp = request.getfixturevalue("xdp_program") if mode == "xdp" else None
    up, down = asyncio.run(run(mode, xdp))
    # each 2x step in order with a margin, and the 8x span at least two steps' worth: on a busy host the
    # fastest port can measure the receiver's pace rather than its shaping, which compresses the top step
    for slower, faster in zip(range(3), range(1, 4), strict=True):
        assert down[slower] / down[faster] > ORDER, down
        if mode == "xdp":
            assert up[faster] / up[slower] > ORDER, up
    assert down[0] / down[3] > STEP ** 2, down
    if mode == "xdp":
        assert up[3] / up[0] > STEP ** 2, up
