"""The LAN tier on a shaped LAN, in namespaces: eight workers whose ports spread from 60 to 290 Mbit/s behind
a 200 Mbit/s gateway port (lan-runtime-3's DC 1 at ``lan_bw_scale`` 0.02), each worker starting its first
iteration as soon as its own first result is in, as a LAN worker does.

The gateway's port queue holds its sends, so its socket's send buffer fills: the first result (a copy per
worker) and the ACKs, NACKs and answers meet a full buffer at once. Two waiters on one socket's
writability do not both wake (the event loop keeps one writer per descriptor), and that wedged the tier:
some workers never got their first result. With one writer (netstorm/lan/outbox.py) every worker gets it and every
iteration's sum is exact, also with a send buffer cut to 16 KB, where nearly every send meets a full one.
The gateway also measures each worker's first window of DATA per iteration (its achieved uplink)."""

from __future__ import annotations

import asyncio
import socket
from typing import Any

import numpy as np
import pytest

from netstorm.lan.header import HEADER_BYTES
from netstorm.lan.layout import EdgeLayout
from tests.lan_reference import fixed_point_sum

pytestmark = [pytest.mark.root]

RATES = (5.285, 5.407, 12.678, 3.0, 9.426, 3.0, 14.404, 10.812)   # lan-runtime-3 DC 1, Gbit/s
GATEWAY_GBIT = 10.0
SCALE = 0.02
PORT = 9490
GROUP = ("239.77.0.19", 9491)
JOB = 19
FIXED = 16


def reference(contribs: list[np.ndarray]) -> np.ndarray:
    return fixed_point_sum(contribs, FIXED)


async def run_shaped(*, elements: int, iterations: int, sndbuf: int = 0,
                     timeout: float = 60.0) -> dict[str, Any]:  # noqa: ASYNC109
    from bpf.agent import EdgeAgent
    from netstorm.emulation.bridge_lan import GATEWAY_IP, Lan
    from netstorm.lan.sender import EdgeSender

    lay = EdgeLayout.uniform([elements], scale=FIXED, lanes=357, pool=1024)
    datagram = HEADER_BYTES + 4 * lay.lanes
    rng = np.random.default_rng(elements)
    contribs = [[rng.standard_normal(elements).astype(np.float32) for _ in RATES] for _ in range(iterations)]
    first = rng.standard_normal(elements).astype(np.float32)
    with Lan(len(RATES), rates=[(r, r) for r in RATES], gateway_gbit=GATEWAY_GBIT, rate_scale=SCALE) as lan:
        gateway_sock = lan.udp_socket(lan.gateway, GATEWAY_IP, PORT)
        if sndbuf:
            gateway_sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, sndbuf)
        agent = EdgeAgent(gateway_sock, lay, workers=len(RATES), job=JOB, mode="userspace", slot_timeout=0.2,
                          group=GROUP, retransmit=0.005)
        nodes = [EdgeSender(lan.udp_socket(ns, lan.worker_ip(i)), (GATEWAY_IP, PORT), worker=i, layout=lay,
                            job=JOB, seed=7, group_opener=lan.group_opener(ns)) for i, ns in enumerate(lan.workers)]

        async def worker(node: EdgeSender) -> list[np.ndarray]:
            """Like a LAN worker: its first result, then each iteration as soon as the previous is back."""
            iteration, values, _ = await node.receive_first(timeout=timeout)
            assert iteration == 0
            np.testing.assert_array_equal(values[0], first)
            out = []
            for k in range(1, iterations + 1):
                got, total = await node.push_pull(k, [contribs[k - 1][node.worker]], timeout=timeout)
                assert total == len(RATES)
                out.append(got[0])
            return out

        agent.expect(0)
        try:
            async with asyncio.TaskGroup() as tg:
                serving = tg.create_task(agent.run())
                try:
                    await asyncio.gather(*(n.hello(timeout=10) for n in nodes))
                    await agent.wait_workers(timeout=10)
                    workers = [tg.create_task(worker(n)) for n in nodes]
                    await agent.send_results(0, [first], total=len(RATES), unicast=True)
                    for k in range(1, iterations + 1):
                        sums = await agent.collect(k, timeout=timeout)
                        np.testing.assert_array_equal(sums[0], reference(contribs[k - 1]))
                        # every worker's first window arrived (the sum is exact), so its burst holds it all
                        bursts = agent.uplink_bursts(k)
                        assert [w for w, *_ in bursts] == list(range(len(RATES)))
                        assert all(nbytes >= lay.num_slots * datagram and last > first
                                   for _, nbytes, first, last in bursts), bursts
                        await agent.send_results(k, sums, total=len(RATES))
                    results = [await w for w in workers]
                finally:
                    agent.close()
                    await serving
        finally:
            for node in nodes:
                node.close()
        for k in range(iterations):
            want = reference(contribs[k])
            for per_worker in results:
                np.testing.assert_array_equal(per_worker[k], want)
        return {"stalls": agent.send_stalls, "errors": agent.send_errors, "pending": agent.outbox.pending}


@pytest.mark.slow
def test_a_shaped_lan_delivers_every_first_result_and_exact_sums() -> None:
    out = asyncio.run(run_shaped(elements=500_000, iterations=2))
    assert out["errors"] == 0


@pytest.mark.slow
def test_a_tiny_send_buffer_is_back_pressure_not_a_failure() -> None:
    out = asyncio.run(run_shaped(elements=500_000, iterations=2, sndbuf=16 << 10))
    assert out["stalls"] > 0      # the buffer was full, and the sends waited it out
    assert out["errors"] == 0
