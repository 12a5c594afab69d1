"""A LAN worker paced to its planned rate (``dc_pace_rates``): the token bucket exactly, the rate reaching
the worker in its HELLO answer (the plan's rate times the LAN's scale), and in namespaces the rate the
gateway measures (``LanRateMeter``, from each worker's first window of DATA) following the plan while
every sum stays exact."""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
import pytest

from bpf.gateway import EdgeOptions, GatewayRole
from netstorm.control import LanPlan
from netstorm.lan.deploy import Deployment
from netstorm.lan.layout import EdgeLayout
from netstorm.lan.pacing import Pace
from netstorm.lan_scenario import LanSpec, LanWorker
from tests.lan_reference import fixed_point_sum

PLANNED = (0.1, 0.2, 0.4, 0.8)
"""The plan's Gbit/s per worker; the emulated LAN is these x SCALE."""
SCALE = 0.1
PLAN = LanPlan(node_id=1, version=0, planner="pahina", clusters=(), direct=(0, 1, 2, 3),
               rates=tuple(enumerate(PLANNED)))
SPEC = LanSpec(tuple(LanWorker(i, 10.0, 10.0) for i in range(len(PLANNED))))


def test_a_pace_lets_batches_out_at_its_rate_keeping_lateness_up_to_its_depth() -> None:
    pace = Pace(1000.0, depth=100)
    assert pace.delay(5.0) == 0.0                    # nothing charged: go
    pace.charge(300, 5.0)
    assert pace.delay(5.0) == pytest.approx(0.3)    # 300 bytes at 1000 B/s
    pace.charge(500, 5.3)
    assert pace.delay(5.3) == pytest.approx(0.5)
    pace.charge(100, 5.85)                           # woke 0.05 s late: kept as credit
    assert pace.delay(5.85) == pytest.approx(0.05)
    pace.charge(100, 6.1)                            # 0.2 s late, beyond the depth (0.1 s): a fresh start
    assert pace.delay(6.1) == pytest.approx(0.1)
    pace.charge(100, 100.0)                          # idle for long: one batch at once, the next a batch later
    assert pace.delay(100.0) == pytest.approx(0.1)
    assert Pace.gbit(8e-9).bytes_per_s == pytest.approx(1.0)
    with pytest.raises(ValueError):
        Pace(0.0)


def test_the_hello_answer_carries_the_plans_rate_scaled_to_the_lan_only_with_the_option() -> None:
    role = GatewayRole(EdgeOptions(workers=4, listen=("127.0.0.1", 0), mode="userspace", lan=SPEC,
                                   pace_rates=True, rate_scale=SCALE), iteration_timeout=1.0)
    assert role.paces() == {}                        # no plan yet
    role.apply_lan_plan(PLAN)
    assert role.paces() == pytest.approx({w: r * SCALE for w, r in enumerate(PLANNED)})
    off = GatewayRole(EdgeOptions(workers=4, listen=("127.0.0.1", 0), mode="userspace", lan=SPEC),
                      iteration_timeout=1.0)
    off.apply_lan_plan(PLAN)
    assert off.paces() == {}                         # dc_pace_rates off: nobody is paced
    told = Deployment(pool=8, lanes=4, scale=16, pace_gbit=0.04)
    assert Deployment.decode(told.encode()) == told
    assert Deployment.decode(Deployment(pool=8, lanes=4, scale=16).encode()).pace_gbit is None


POOL = 256
LAYOUT = EdgeLayout.uniform([2 * POOL * 357], scale=16, lanes=357, pool=POOL)
ITERATIONS = 4
PORT = 9530
GROUP = ("239.77.0.31", 9531)
JOB = 31
ORDER = 1.25
"""Least ratio measured between two workers paced 2x apart (a margin for a shared host)."""


def _reference(contribs: list[np.ndarray]) -> np.ndarray:
    return fixed_point_sum(contribs, 16)


async def _run(mode: str, xdp: Any) -> dict[int, float]:
    from bpf.agent import EdgeAgent
    from netstorm.emulation.bridge_lan import GATEWAY_IP, Lan
    from netstorm.emulation.netns import run_in
    from netstorm.lan.sender import EdgeSender

    role = GatewayRole(EdgeOptions(workers=4, listen=(GATEWAY_IP, PORT), mode="userspace", lan=SPEC, pace_rates=True,
                                   rate_scale=SCALE), iteration_timeout=1.0)
    role.apply_lan_plan(PLAN)
    meter = role.meter
    assert meter is not None
    rng = np.random.default_rng(31)
    n = len(PLANNED)
    with Lan(n) as lan:   # unshaped ports: only the pace holds a worker back
        if xdp is not None:
            ifindex = lan.gateway_ifindex()
            run_in(lan.gateway, lambda: xdp.attach(ifindex))
        try:
            agent = EdgeAgent(lan.udp_socket(lan.gateway, GATEWAY_IP, PORT), LAYOUT, workers=n, job=JOB,
                              mode=mode, xdp=xdp, slot_timeout=0.2, group=GROUP, retransmit=0.005)
            agent.pace_gbit = role.paces()
            nodes = [EdgeSender(lan.udp_socket(ns, lan.worker_ip(i)), (GATEWAY_IP, PORT), worker=i, layout=LAYOUT,
                                job=JOB, group_opener=lan.group_opener(ns)) for i, ns in enumerate(lan.workers)]
            async with asyncio.TaskGroup() as tg:
                serving = tg.create_task(agent.run())
                try:
                    await asyncio.gather(*(node.hello(timeout=10) for node in nodes))
                    assert [node.batch.pace is not None and node.batch.pace.bytes_per_s for node in nodes] == \
                        pytest.approx([r * SCALE * 1e9 / 8 for r in PLANNED])
                    await agent.wait_workers(timeout=10)
                    for k in range(1, ITERATIONS + 1):
                        contribs = [rng.standard_normal(LAYOUT.sizes[0]).astype(np.float32) for _ in nodes]
                        pushes = [tg.create_task(node.push_pull(k, [contribs[node.worker]], timeout=60))
                                  for node in nodes]
                        sums = await agent.collect(k, timeout=60)
                        want = _reference(contribs)
                        np.testing.assert_array_equal(sums[0], want)
                        for burst in agent.uplink_bursts(k):
                            meter.on_burst(burst[0], "up", *burst[1:])
                        await agent.send_results(k, sums, total=n)
                        for push in pushes:
                            got, _ = await push
                            np.testing.assert_array_equal(got[0], want)
                finally:
                    agent.close()
                    await serving
            for node in nodes:
                node.close()
        finally:
            if xdp is not None:
                xdp.detach()
    measured = {w: meter.rate(w, "up") for w in range(n)}
    assert all(r is not None for r in measured.values()), measured
    return {w: float(r) for w, r in measured.items() if r is not None}


@pytest.fixture(scope="module")
def xdp_program() -> Any:
    from bpf.xdp import XdpAggregator

    agg = XdpAggregator(LAYOUT, job=JOB, port=PORT, expected=(1 << len(PLANNED)) - 1, timeout=0.2)
    yield agg
    agg.close()


@pytest.mark.root
@pytest.mark.slow
def test_a_paced_workers_rate_as_the_gateway_measures_it_follows_the_plan(mode: str,
                                                                         request: pytest.FixtureRequest) -> None:
    """On unshaped ports the four workers would all send as fast as the host lets them; paced, each one's
    first window measures at most its planned rate (one batch of credit over it) and 2x steps apart."""
    xdp = request.getfixturevalue("xdp_program") if mode == "xdp" else None
    measured = asyncio.run(_run(mode, xdp))
    window = POOL * (44 + 4 * LAYOUT.lanes)
    for w, planned in enumerate(PLANNED):
        paced = planned * SCALE
        # a window of ``window`` bytes whose first GSO send (65000 bytes) leaves at once
        assert measured[w] < paced * window / (window - 65000) * 1.1, (w, measured)
    for slower, faster in zip(range(3), range(1, 4), strict=True):
        assert measured[faster] / measured[slower] > ORDER, measured
