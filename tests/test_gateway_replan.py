"""The scheduler re-plans a DC whose measured LAN moved, and the running job takes the new deployment at an
iteration boundary: a real scheduler over loopback TCP, the gateway role (userspace aggregation) and its
LAN workers and aggregator services in namespaces, the node's side of each iteration driven as the node
drives it (``combine`` per tensor, then ``released``). Every sum is exact across the switch, and the
aggregator services' own data planes show which cluster is summed where before and after it."""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

import numpy as np
import pytest

from bpf.gateway import EdgeOptions, GatewayRole, topology_from_plan
from netstorm import lanreport, scenario
from netstorm.control import LanPlan
from netstorm.lan.layout import EdgeLayout
from netstorm.lan_scenario import LanSpec
from tests.test_scheduler_service import FAST, T, close_all, connect_all, scheduler

pytestmark = [pytest.mark.root]

SIZES = [357 * 4 + 3, 11]
PORT = 9480
GROUP = ("239.77.0.20", 9481)
SECRET = b"replan-secret"
SCALE = 16
ITERATIONS = 5
MOVE_AFTER = 2
"""The measured LAN is reported after this iteration's sum: the re-plan's deployment runs from a later one."""


def _spec() -> LanSpec:
    spec = scenario.load("lan-hetero-4").node(3).lan   # six workers, ALEPH clusters five under worker 0
    assert spec is not None
    return spec


def _moved(spec: LanSpec) -> LanSpec:
    """Worker 0's links measured at a twentieth of what the description says (ALEPH then picks worker 1)."""
    workers = list(spec.workers)
    workers[0] = dataclasses.replace(workers[0], up_gbit=workers[0].up_gbit / 20, down_gbit=workers[0].down_gbit / 20)
    return dataclasses.replace(spec, workers=tuple(workers))


def _exact(contribs: list[list[np.ndarray]]) -> list[np.ndarray]:
    return [(np.sum([np.rint(w[t].astype(np.float64) * 2.0**SCALE).astype(np.int64) for w in contribs], axis=0)
             .astype(np.float64) * 2.0**-SCALE).astype(np.float32) for t in range(len(SIZES))]


async def _run() -> dict[str, Any]:
    from bpf.cluster import ClusterAggregator
    from netstorm.emulation.bridge_lan import GATEWAY_IP, Lan
    from netstorm.emulation.netns import run_in
    from netstorm.lan.sender import EdgeSender

    spec = _spec()
    workers = len(spec.workers)
    out: dict[str, Any] = {"plans": [], "epochs": [], "forwarded": [], "expected": [], "checked": 0}
    config = dataclasses.replace(FAST, dc_planner="aleph", dc_replan_change=0.2, dc_replan_hold=0.0)
    async with scheduler(config) as service:
        clients = await connect_all(service)
        try:
            control = clients[0]
            role = GatewayRole(EdgeOptions(workers=workers, listen=(GATEWAY_IP, PORT), mode="userspace", lan=spec,
                                           plan_wait=T, secret=SECRET, group=GROUP, retransmit=0.01,
                                           slot_timeout=0.05), iteration_timeout=T)
            planned = asyncio.Event()

            def on_plan(plan: LanPlan) -> None:   # what the node does with a pushed plan (node/service.py)
                out["plans"].append(plan)
                role.apply_lan_plan(plan)
                planned.set()
            control.on_lan_plan(on_plan)
            report = role.announce(1)
            assert report is not None
            control.report_lan(report)
            await role.wait_plan()
            assert role.plan is not None and role.options.topology is not None
            out["first"] = role.options.topology
            rng = np.random.default_rng(20)
            with Lan(workers) as lan:
                role.agent = await asyncio.to_thread(run_in, lan.gateway, lambda: role._start(SIZES))
                role._started.set()
                layout = EdgeLayout.uniform(SIZES, scale=SCALE, lanes=role.agent.layout.lanes)
                services: list[ClusterAggregator] = []
                nodes = [EdgeSender(lan.udp_socket(ns, lan.worker_ip(i)), (GATEWAY_IP, PORT), worker=i,
                                    layout=layout, job=1, secret=SECRET, group_opener=lan.group_opener(ns))
                         for i, ns in enumerate(lan.workers)]
                try:
                    async with asyncio.TaskGroup() as tg:
                        serving = tg.create_task(role.run())
                        try:
                            for i, ns in enumerate(lan.workers):
                                cluster = ClusterAggregator(lan.udp_socket(ns, lan.worker_ip(i), PORT),
                                                            (GATEWAY_IP, PORT), worker=i, job=1, interface="eth0",
                                                            mode="userspace", secret=SECRET,
                                                            group_opener=lan.group_opener(ns))
                                services.append(cluster)
                                await cluster.start(timeout=T)
                                tg.create_task(cluster.run())
                            await asyncio.gather(*(n.hello(timeout=T) for n in nodes))
                            # the init iteration: the values every DC agreed on go to the LAN workers
                            first = 40
                            init = [rng.standard_normal(s).astype(np.float32) for s in SIZES]
                            for key in range(len(SIZES)):
                                await role.combine(first, key, init[key], SIZES)
                            firsts = [tg.create_task(n.receive_first(timeout=T)) for n in nodes]
                            role.released(first, init, workers)
                            for joined in firsts:
                                assert (await joined)[0] == first
                            for k in range(1, ITERATIONS + 1):
                                iteration = first + k
                                for cluster in services:
                                    cluster.follow(iteration)
                                before = [c.stats().get("forwarded", 0) for c in services]
                                contribs = [[rng.standard_normal(s).astype(np.float32) for s in SIZES]
                                            for _ in range(workers)]
                                pushes = [tg.create_task(n.push_pull(iteration, contribs[n.worker], timeout=T))
                                          for n in nodes]
                                sums = [await role.combine(iteration, key, None, SIZES) for key in range(len(SIZES))]
                                want = _exact(contribs)
                                for got, ref in zip(sums, want, strict=True):
                                    np.testing.assert_array_equal(got, ref)
                                out["epochs"].append(role.agent.epoch)   # type: ignore[union-attr]
                                out["expected"].append([c.expected for c in services])
                                out["forwarded"].append([c.stats().get("forwarded", 0) - b
                                                         for c, b in zip(services, before, strict=True)])
                                if k == MOVE_AFTER:   # the node's measured report (GatewayRole.on_measured)
                                    planned.clear()
                                    control.report_lan(lanreport.report_from_spec(1, _moved(spec), measured=True))
                                    async with asyncio.timeout(T):
                                        await planned.wait()
                                    out["pending_before_release"] = role.pending
                                assert all(s is not None for s in sums)
                                role.released(iteration, [s for s in sums if s is not None], workers)
                                for task in pushes:
                                    got_sums, total = await task
                                    assert total == workers
                                    for got, ref in zip(got_sums, want, strict=True):
                                        np.testing.assert_array_equal(got, ref)
                                out["checked"] += 1
                            out["last"] = role.options.topology
                            out["scheduler_plan"] = service.lan.plans[1]
                        finally:
                            for cluster in services:
                                cluster.close()
                            serving.cancel()
                finally:
                    for node in nodes:
                        node.close()
        finally:
            await close_all(clients)
    return out


def test_a_measured_lan_change_replans_and_the_job_switches_at_an_iteration_boundary() -> None:
    out = asyncio.run(_run())
    workers = len(_spec().workers)
    assert out["checked"] == ITERATIONS   # every iteration's sums equal numpy's, at the gateway and every worker
    first, last = out["first"], out["last"]
    assert first.clusters and last.clusters and first != last   # the re-plan moved the aggregator
    assert [p.version for p in out["plans"]] == [0, 1] and out["plans"][1] == out["scheduler_plan"]
    assert topology_from_plan(out["plans"][1], workers) == last
    assert out["pending_before_release"] is out["plans"][1]   # held until the next released result
    chunks = sum(EdgeLayout.uniform(SIZES, scale=SCALE).chunks)
    for k, topology in enumerate([first] * MOVE_AFTER + [last] * (ITERATIONS - MOVE_AFTER)):
        assert out["epochs"][k] == (0 if topology is first else 1)
        # the services' aggregators expect their cluster of the deployment the iteration ran (read back), and
        # the clusters of that deployment forwarded its sums, nobody else
        assert out["expected"][k] == [topology.cluster_mask(w) if w in topology.clusters else 0
                                      for w in range(workers)], (k, out["expected"][k])
        for w, forwarded in enumerate(out["forwarded"][k]):
            assert (forwarded >= chunks) if w in topology.clusters else forwarded == 0, (k, out["forwarded"][k])
