"""A running LAN tier switches its deployment at iteration boundaries (netstorm/lan/redeploy.py): flat, then
two clusters, then a member moved and another aggregator, then flat again, with every iteration's sum
exact; what each aggregator expects and forwards is read from the data plane (the fallback's fields or
the kernel's configuration map, and its forwarded counter), and a worker that does not act on the
announcement is told by the aggregator that refuses its DATA."""

from __future__ import annotations

import asyncio
import functools
import itertools
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from netstorm.lan.deploy import LanTopology
from netstorm.lan.layout import EdgeLayout
from tests.lan_reference import fixed_point_sums

pytestmark = [pytest.mark.root]

SCALE = 16
LANES = 357
POOL = 4
SIZES = (LANES * 5 + 11, 9)
JOB = 19
PORT = 9470
GROUP = ("239.77.0.19", 9471)
SECRET = b"redeploy-secret"
WORKERS = 5
_iterations = itertools.count(300, 20)

PLANS = {
    0: LanTopology(WORKERS),
    2: LanTopology(WORKERS, {0: (1, 2)}),             # two levels: 0 sums 1 and 2; 3 and 4 go straight up
    4: LanTopology(WORKERS, {3: (1, 4), 0: (2,)}),    # 1 moves to a new aggregator 3, 4 joins it
    6: LanTopology(WORKERS),                          # back to one level
}
"""Iteration (counted from the first summed one) -> the deployment it and the following ones run."""
ITERATIONS = 7
SERVICES = (0, 3)
"""The workers the plans make aggregators: each runs an aggregator service throughout, on standby while it
aggregates nothing (as ``netstorm emulate`` runs one on every worker where a re-plan may name it)."""
IGNORE = {2: {1}, 6: {2}}
"""Iteration -> workers that send it without acting on the announced epoch (as if the announcement were
lost): at the switch to two levels worker 1 sends as before, to the gateway, which no longer expects it
there; at the switch back to one level worker 2 sends to its old aggregator 0, now on standby."""


def layout() -> EdgeLayout:
    return EdgeLayout.uniform(SIZES, scale=SCALE, lanes=LANES, pool=POOL)


@pytest.fixture(scope="module")
def gateway_program() -> Iterator[Any]:
    from bpf.xdp import XdpAggregator

    agg = XdpAggregator(layout(), job=JOB, port=PORT, expected=1, timeout=0.05)
    yield agg
    agg.close()


def exact(contribs: list[list[np.ndarray]], scale: int = SCALE) -> list[np.ndarray]:
    """The LAN sum as every aggregator makes it: int64 fixed point at the common scale, once to float32."""
    return fixed_point_sums(contribs, [scale] * len(contribs[0]))


def wire_of(k: int) -> EdgeLayout:
    """Iteration k's wire in a compressed job's manner: exact integers at scale 0, a size of its own."""
    return EdgeLayout.uniform([LANES * (1 + k % 3) + 17 * k + 1, 5 + k], scale=0, lanes=LANES, pool=POOL)


def deployment_at(k: int) -> LanTopology:
    return PLANS[max(i for i in PLANS if i <= k)]


async def run_switches(mode: str, program: Any, *, ignore: dict[int, set[int]] | None = None,
                       timeout: float = 20.0, wires: bool = False) -> dict[str, Any]:  # noqa: ASYNC109
    """Run ITERATIONS iterations through the deployments of PLANS, the SERVICES workers' hosts running an
    aggregator service (on standby where its worker aggregates nothing). ``ignore``: iteration -> workers
    that send it without acting on the announced epoch (as if the announcement were lost). ``wires``: every
    iteration travels on its own planned layout of exact integers (``wire_of``), as a compressed job's
    rounds do, planned before the previous result leaves."""
    from bpf.agent import EdgeAgent
    from bpf.cluster import ClusterAggregator
    from netstorm.emulation.bridge_lan import GATEWAY_IP, Lan
    from netstorm.emulation.netns import run_in
    from netstorm.lan.sender import EdgeSender

    ignore = ignore or {}
    rng = np.random.default_rng(19)
    lay = layout()
    out: dict[str, Any] = {"checked": 0, "expected": [], "forwarded": [], "epochs": [], "gateway_masks": []}
    with Lan(WORKERS) as lan:
        xdp = None
        if mode == "xdp":
            xdp = program
            xdp.redeploy(expected=PLANS[0].gateway_mask(), epoch=0)
            xdp.configure(job=JOB, port=PORT, expected=PLANS[0].gateway_mask(), timeout=0.05, max_nacks=50)
            ifindex = lan.gateway_ifindex()
            run_in(lan.gateway, lambda: xdp.attach(ifindex))
        services: list[ClusterAggregator] = []
        nodes: list[EdgeSender] = []
        try:
            agent = EdgeAgent(lan.udp_socket(lan.gateway, GATEWAY_IP, PORT), lay, workers=WORKERS, job=JOB, mode=mode,
                              xdp=xdp, slot_timeout=0.05, max_nacks=50, secret=SECRET, group=GROUP,
                              topology=PLANS[0], retransmit=0.01)
            nodes = [EdgeSender(lan.udp_socket(ns, lan.worker_ip(i)), (GATEWAY_IP, PORT), worker=i, layout=lay,
                                job=JOB, seed=7, secret=SECRET, group_opener=lan.group_opener(ns))
                     for i, ns in enumerate(lan.workers)]
            first = next(_iterations)
            agent.expect(first)
            async with asyncio.TaskGroup() as tg:
                serving = tg.create_task(agent.run())
                try:
                    for i in SERVICES:
                        ns = lan.workers[i]
                        service = ClusterAggregator(lan.udp_socket(ns, lan.worker_ip(i), PORT), (GATEWAY_IP, PORT),
                                                    worker=i, job=JOB, interface="eth0", mode=mode, secret=SECRET,
                                                    group_opener=lan.group_opener(ns), attach="generic")
                        services.append(service)
                        await service.start(timeout=10, load_in=functools.partial(run_in, ns))
                        tg.create_task(service.run())
                    await asyncio.gather(*(n.hello(timeout=10) for n in nodes))
                    await agent.wait_workers(timeout=10)
                    if wires:
                        agent.plan(first, wire_of(0), integer=True)
                    for k in range(ITERATIONS):
                        iteration = first + k
                        for node in nodes:
                            if wires:   # as CompressedEdgeWorker sets each round's wire before its push
                                node.layout, node.integers = wire_of(k), True
                            node.ignore_epoch = frozenset({iteration} if node.worker in ignore.get(k, ()) else ())
                        for service in services:
                            service.follow(iteration)
                        before = [s.stats().get("forwarded", 0) for s in services]
                        contribs = ([[rng.integers(-60, 61, size).astype(np.float32) for size in wire_of(k).sizes]
                                     for _ in range(WORKERS)] if wires else
                                    [[rng.standard_normal(size).astype(np.float32) for size in SIZES]
                                     for _ in range(WORKERS)])
                        pushes = [tg.create_task(n.push_pull(iteration, contribs[n.worker], timeout=timeout + 5))
                                  for n in nodes]
                        sums = await agent.collect(iteration, timeout=timeout)
                        want = exact(contribs, 0 if wires else SCALE)
                        for got, ref in zip(sums, want, strict=True):
                            np.testing.assert_array_equal(got, ref)
                        # what each aggregator expects, read back from its data plane, and what it forwarded
                        out["expected"].append([s.expected for s in services])
                        out["forwarded"].append([s.stats().get("forwarded", 0) - b
                                                 for s, b in zip(services, before, strict=True)])
                        out["epochs"].append(agent.epoch)
                        # the gateway's aggregator: its configuration map (xdp) or the fallback's mask in use
                        out["gateway_masks"].append(xdp.configured()["expected"] if xdp is not None else
                                                    agent.fallback.expected)  # type: ignore[union-attr]
                        if k + 1 in PLANS:   # the next iteration runs another deployment
                            agent.redeploy(PLANS[k + 1], iteration)
                        if wires:
                            agent.plan(iteration + 1, wire_of(k + 1), integer=True)
                        await agent.send_results(iteration, sums, total=WORKERS)
                        for task in pushes:
                            got_sums, _total = await task
                            for got, ref in zip(got_sums, want, strict=True):
                                np.testing.assert_array_equal(got, ref)
                        if wires:   # a HELLO said again for the switch kept the round's wire
                            assert all(n.layout == wire_of(k) for n in nodes)
                        out["checked"] += 1
                finally:
                    agent.close()
                    for service in services:
                        service.close()
                    await serving
            out["stale_told"] = agent.stale_told
            out["service_moved"] = [s.moved_sent for s in services]
            out["moved"] = [n.moved for n in nodes]
            out["rehellos"] = [n.rehellos for n in nodes]
            out["redeployed"] = [s.redeployed for s in services]
            stats = xdp.stats() if xdp is not None else agent.fallback.counters  # type: ignore[union-attr]
            out["old_epoch"] = stats["old_epoch"] + sum(s.stats().get("old_epoch", 0) for s in services)
            return out
        finally:
            for node in nodes:
                node.close()
            if xdp is not None:
                xdp.detach()


@pytest.mark.slow
def test_deployment_switches_at_iteration_boundaries_and_a_worker_missing_the_announcement_is_told(
        mode: str, request: pytest.FixtureRequest) -> None:
    """Flat, two clusters, a member moved to a new aggregator, flat again; two workers do not act on an
    announcement (IGNORE): each aggregator refuses the old epoch's DATA and answers MOVED (the gateway for
    worker 1, the standby service of worker 0 for worker 2), the worker asks and resends."""
    program = request.getfixturevalue("gateway_program") if mode == "xdp" else None
    out = asyncio.run(run_switches(mode, program, ignore=IGNORE))
    assert out["checked"] == ITERATIONS   # every iteration's sums equal numpy's, at the gateway and every worker
    chunks = layout().num_chunks
    for k in range(ITERATIONS):
        topology = deployment_at(k)
        # each service's aggregator expects its cluster (nothing on standby), as read from its data plane
        assert out["expected"][k] == [topology.cluster_mask(w) if w in topology.clusters else 0
                                      for w in SERVICES], (k, out["expected"][k])
        # and the clusters of this deployment are the ones that forwarded its sums: one datagram per chunk at
        # least (a retransmission re-forwards), nothing from a service on standby
        for w, forwarded in zip(SERVICES, out["forwarded"][k], strict=True):
            assert (forwarded >= chunks) if w in topology.clusters else forwarded == 0, (k, w, out["forwarded"][k])
    assert out["epochs"] == [0, 0, 1, 1, 2, 2, 3]
    # the gateway's own aggregator expects the deployment's contributors (its configuration map in xdp mode)
    assert out["gateway_masks"] == [deployment_at(k).gateway_mask() for k in range(ITERATIONS)]
    assert out["redeployed"] == [3, 3]   # every service took every switch
    # every worker asked at every switch; the two that ignored an announcement were told and asked then
    assert all(r >= 3 for r in out["rehellos"]) and [out["rehellos"][w] for w in (0, 3, 4)] == [3, 3, 3]
    assert out["moved"][1] >= 1 and out["moved"][2] >= 1, out["moved"]
    # worker 2's stale DATA reaches the standby service of worker 0, which answers MOVED once it has taken
    # the switch; on two busy cores the DATA came first once, and worker 2 was told by the gateway instead
    # (moved[2] above): either way it was told, and nothing stale was summed
    assert out["stale_told"] >= 1, (out["stale_told"], out["service_moved"])
    assert out["old_epoch"] >= 2   # refused, counted by the aggregators, never summed


def test_a_compressed_jobs_integer_wires_keep_working_across_switches() -> None:
    """Each iteration on its own planned wire of exact integers (a compressed job's rounds): the switches
    and the HELLOs said again for them keep each worker on its round's wire, and every sum is exact. The
    userspace path only: the wires are the agent's, the same on both paths."""
    out = asyncio.run(run_switches("userspace", None, ignore=IGNORE, wires=True))
    assert out["checked"] == ITERATIONS and out["epochs"] == [0, 0, 1, 1, 2, 2, 3]
    assert out["moved"][1] >= 1 and out["moved"][2] >= 1, out["moved"]
