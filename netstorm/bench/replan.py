"""``netstorm bench replan``: a LAN whose link changes mid-run, measured, re-planned, and switched at an
iteration boundary of the running tier, against the same run keeping its first deployment.

See docs/ARCHITECTURE.md, *The LAN tier*."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import functools
import json
import os
import sys
import time
from typing import Any

import numpy as np

HELP = "a LAN link degrades mid-run: measured, re-planned, switched at an iteration boundary, against keeping"
PORT = 9520
GROUP = ("239.77.0.21", 9521)
JOB = 1
SCALE = 16


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--lan-scenario", default="lan-hetero-4", metavar="SCENARIO", help="whose DC --dc's LAN")
    parser.add_argument("--dc", type=int, default=3, metavar="N", help="the DC of --lan-scenario (default 3)")
    parser.add_argument("--dc-planner", default="aleph", metavar="P", help="the planner (default aleph)")
    parser.add_argument("--lan-bw-scale", type=float, default=0.05, metavar="X",
                        help="every described rate times X is what the ports are shaped to (default 0.05)")
    parser.add_argument("--elements", type=int, default=200_000, help="model size in float32 elements")
    parser.add_argument("--iterations", type=int, default=12, help="iterations per run (default 12)")
    parser.add_argument("--degrade-at", type=int, default=4, metavar="K",
                        help="reshape after iteration K's result (counted from 1; default 4)")
    parser.add_argument("--degrade", default="0:0.2", metavar="W:FACTOR",
                        help="worker W's ports to FACTOR of their rates (default 0:0.2)")
    parser.add_argument("--mode", choices=("userspace", "xdp"), default="userspace")
    parser.add_argument("--replan-change", type=float, default=None, metavar="X",
                        help="dc_replan_change (default: the configuration's)")
    parser.add_argument("--replan-hold", type=float, default=None, metavar="S",
                        help="dc_replan_hold (default: the configuration's)")
    parser.add_argument("--timeout", type=float, default=300.0, metavar="S",
                        help="seconds an iteration may take at the gateway (default 300)")
    parser.add_argument("--out", metavar="FILE", default=None, help="write the result JSON here")
    parser.add_argument("--json", action="store_true", help="print the result JSON instead of a table")


def _reference(contribs: list[np.ndarray], precisions: list[Any], lanes: int) -> np.ndarray:
    from netstorm.lan.precision import worker_values

    total = np.sum([np.rint(worker_values(v, p, lanes) * 2.0**SCALE).astype(np.int64)
                    for v, p in zip(contribs, precisions, strict=True)], axis=0)
    return (total.astype(np.float64) * 2.0**-SCALE).astype(np.float32)


async def _variant(args: argparse.Namespace, spec: Any, replan: bool) -> dict[str, Any]:
    from bpf.agent import EdgeAgent
    from bpf.cluster import ClusterAggregator
    from bpf.gateway import topology_from_plan
    from netstorm import lanreport
    from netstorm.config import resolve
    from netstorm.emulation.bridge_lan import GATEWAY_IP, Lan
    from netstorm.emulation.netns import run_in
    from netstorm.lan.header import Precision, lanes_for_mtu
    from netstorm.lan.layout import EdgeLayout
    from netstorm.lan.sender import EdgeSender
    from scheduler.lanplanning import LanPlanning

    config = resolve(overrides={"dc_planner": args.dc_planner, "dc_replan_change": args.replan_change,
                                "dc_replan_hold": args.replan_hold})
    clock = time.monotonic
    origin = clock()
    workers = len(spec.workers)
    described = dataclasses.replace(spec, gateway_gbit=spec.gateway_gbit * args.lan_bw_scale, workers=tuple(
        dataclasses.replace(w, up_gbit=w.up_gbit * args.lan_bw_scale, down_gbit=w.down_gbit * args.lan_bw_scale)
        for w in spec.workers))
    core = LanPlanning(config)
    core.report(lanreport.report_from_spec(1, described), clock())
    job = core.begin(1, clock())
    plan = core.finish(job, core.compute(job))
    if plan is None:
        raise RuntimeError(f"the {args.dc_planner} plan of this LAN cannot run in the data plane")
    topology = topology_from_plan(plan, workers)
    meter = lanreport.LanRateMeter(described, margin=config.dc_replan_change)
    schedule = lanreport.ReportSchedule(described, config.dc_replan_change, config.dc_replan_hold)
    worker_text, _, factor_text = args.degrade.partition(":")
    degraded, factor = int(worker_text), float(factor_text)
    precisions = [Precision.parse(w.precision) for w in spec.workers]
    lanes = lanes_for_mtu(1500)
    layout = EdgeLayout.uniform([args.elements], scale=SCALE, lanes=lanes)
    rng = np.random.default_rng(21)
    out: dict[str, Any] = {"plans": [{"after_iteration": 0, "t_s": 0.0, "clusters": _clusters(topology),
                                      "predicted_gbit": round(plan.predicted_gbit, 4)}], "reports": [],
                           "iterations": [], "dc_replan_change": config.dc_replan_change,
                           "dc_replan_hold": config.dc_replan_hold}
    with Lan(workers, rates=[(w.up_gbit, w.down_gbit) for w in spec.workers], gateway_gbit=spec.gateway_gbit,
             rate_scale=args.lan_bw_scale) as lan:
        xdp = None
        if args.mode == "xdp":
            from bpf.xdp import XdpAggregator

            xdp = XdpAggregator(layout, job=JOB, port=PORT, expected=topology.gateway_mask(), timeout=0.2)
            ifindex = lan.gateway_ifindex()
            run_in(lan.gateway, lambda: xdp.attach(ifindex))
        agent = EdgeAgent(lan.udp_socket(lan.gateway, GATEWAY_IP, PORT, rcvbuf=16 << 20), layout, workers=workers,
                          job=JOB, mode=args.mode, xdp=xdp, slot_timeout=0.2, group=GROUP, topology=topology,
                          retransmit=config.edge_retransmit, query_nacks=config.edge_query_nacks)
        services: list[ClusterAggregator] = []
        nodes = [EdgeSender(lan.udp_socket(ns, lan.worker_ip(i)), (GATEWAY_IP, PORT), worker=i, layout=layout,
                            job=JOB, precision=precisions[i], group_opener=lan.group_opener(ns))
                 for i, ns in enumerate(lan.workers)]
        try:
            async with asyncio.TaskGroup() as tg:
                serving = tg.create_task(agent.run())
                try:
                    for i, ns in enumerate(lan.workers):
                        service = ClusterAggregator(lan.udp_socket(ns, lan.worker_ip(i), PORT), (GATEWAY_IP, PORT),
                                                    worker=i, job=JOB, interface="eth0", mode=args.mode,
                                                    group_opener=lan.group_opener(ns), attach="generic")
                        services.append(service)
                        await service.start(timeout=30, load_in=functools.partial(run_in, ns))
                        tg.create_task(service.run())
                    await asyncio.gather(*(n.hello(timeout=30) for n in nodes))
                    await agent.wait_workers(timeout=30)
                    first = 1
                    agent.expect(first)
                    for k in range(1, args.iterations + 1):
                        iteration = first + k - 1
                        before = [s.stats().get("forwarded", 0) for s in services]
                        contribs = [rng.standard_normal(args.elements).astype(np.float32) for _ in range(workers)]
                        started = time.monotonic()
                        # the workers wait longer: the gateway's timeout names what is missing
                        pushes = [tg.create_task(n.push_pull(iteration, [contribs[n.worker]],
                                                             timeout=args.timeout + 30)) for n in nodes]
                        sums = await agent.collect(iteration, timeout=args.timeout)
                        want = _reference(contribs, precisions, lanes)
                        exact = bool(np.array_equal(sums[0], want))
                        bursts = [("up", b) for b in agent.uplink_bursts(iteration)]
                        bursts += [("down", b) for b in agent.downlink_bursts()]
                        # the gateway role's bounds: a paced worker's pace, an aggregator's slowest feed
                        bounds = lanreport.uplink_bounds(described, agent.topology.clusters, agent.pace_gbit,
                                                         {w.index: w.up_gbit for w in meter.measured().workers})
                        samples: dict[str, list[Any]] = {}
                        for direction, (worker, nbytes, t0, t1) in bursts:
                            bound = bounds.get(worker) if direction == "up" else None
                            meter.on_burst(worker, direction, nbytes, t0, t1, bound)
                            if t1 > t0:
                                samples[f"{worker}:{direction}"] = [round(nbytes * 8 / (t1 - t0) / 1e9, 4),
                                                                    None if bound is None else round(bound, 4)]
                        record: dict[str, Any] = {"iteration": k, "epoch": agent.epoch,
                                                  "clusters": _clusters(agent.topology),
                                                  "samples_gbit_bound": samples}
                        measured = meter.measured()
                        now = clock()
                        if replan and schedule.due(measured, now):
                            moved = _moved(schedule.reported, measured)
                            schedule.sent(measured, now)   # the gateway's measured report
                            core.report(lanreport.report_from_spec(1, measured, measured=True), now)
                            out["reports"].append({
                                "after_iteration": k, "t_s": round(now - origin, 3), "moved": moved,
                                "measured_gbit": {str(w.index): [round(w.up_gbit, 4), round(w.down_gbit, 4)]
                                                  for w in measured.workers}})
                        if replan and core.pending(now):   # the scheduler plans a DC when it is due
                            job = core.begin(1, now)
                            plan = core.finish(job, core.compute(job))
                            planned = topology_from_plan(plan, workers) if plan is not None else agent.topology
                            out["plans"].append({
                                "after_iteration": k, "t_s": round(now - origin, 3), "clusters": _clusters(planned),
                                "predicted_gbit": round(plan.predicted_gbit, 4) if plan is not None else None,
                                "measured_gbit": {str(w.index): [round(w.up_gbit, 4), round(w.down_gbit, 4)]
                                                  for w in job.spec.workers}})
                            if planned != agent.topology:   # held to this release: runs from the next iteration
                                agent.redeploy(planned, iteration)
                        await agent.send_results(iteration, sums, total=workers)
                        for task in pushes:
                            got, _ = await task
                            exact &= bool(np.array_equal(got[0], want))
                        record["lan_s"] = round(time.monotonic() - started, 4)
                        record["t_s"] = round(started - origin, 3)
                        record["exact"] = exact
                        record["forwarded"] = [s.stats().get("forwarded", 0) - b
                                               for s, b in zip(services, before, strict=True)]
                        out["iterations"].append(record)
                        if k == args.degrade_at:
                            w = spec.workers[degraded]
                            await asyncio.to_thread(lan.reshape, degraded, w.up_gbit * factor, w.down_gbit * factor)
                            out["cut"] = {"after_iteration": k, "t_s": round(clock() - origin, 3)}
                finally:
                    agent.close()
                    for service in services:
                        service.close()
                    await serving
        finally:
            for node in nodes:
                node.close()
            if xdp is not None:
                xdp.close()
    out["moved"] = [n.moved for n in nodes]
    out["rehellos"] = [n.rehellos for n in nodes]
    after = [r["lan_s"] for r in out["iterations"][args.degrade_at + 1:]]
    out["mean_lan_s_after_degrade"] = round(float(np.mean(after)), 4) if after else None
    out["exact"] = all(r["exact"] for r in out["iterations"])
    return out


def _moved(before: Any, after: Any) -> dict[str, list[float]]:
    """The rates of one report that moved by more than nothing against the one before, as
    ``"worker:direction": [before, after]``."""
    out = {}
    for a, b in zip(before.workers, after.workers, strict=True):
        for direction, x, y in (("up", a.up_gbit, b.up_gbit), ("down", a.down_gbit, b.down_gbit)):
            if abs(y - x) > 1e-9 * max(abs(x), 1.0):
                out[f"{a.index}:{direction}"] = [round(x, 4), round(y, 4)]
    return out


def _clusters(topology: Any) -> dict[str, list[int]]:
    return {str(a): list(m) for a, m in sorted(topology.clusters.items())}


def run(args: argparse.Namespace) -> int:
    from netstorm import scenario
    from netstorm.errors import NetStormError

    spec = scenario.load(args.lan_scenario).node(args.dc).lan
    if spec is None:
        raise NetStormError(f"DC {args.dc} of {args.lan_scenario} describes no LAN")
    host = {"kernel": os.uname().release, "cpus": os.cpu_count(), "load_average_before": os.getloadavg()}
    result: dict[str, Any] = {
        "scenario": args.lan_scenario, "dc": args.dc, "planner": args.dc_planner, "mode": args.mode,
        "elements": args.elements, "iterations": args.iterations, "lan_bw_scale": args.lan_bw_scale,
        "degrade": {"after_iteration": args.degrade_at, "worker_factor": args.degrade},
        "runs": {"replan": asyncio.run(_variant(args, spec, True)), "keep": asyncio.run(_variant(args, spec, False))},
    }
    result["host"] = {**host, "load_average_after": os.getloadavg()}
    result["command"] = "netstorm bench replan " + " ".join(sys.argv[3:]) if sys.argv[1:3] == ["bench", "replan"] \
        else " ".join(sys.argv)
    if args.out:
        from netstorm.provenance import write_result

        write_result(args.out, result)
    if args.json:
        print(json.dumps(result, indent=1))
    else:
        for name, run_ in result["runs"].items():
            print(f"{name}: exact {run_['exact']}, mean LAN time after the degradation "
                  f"{run_['mean_lan_s_after_degrade']} s, cut {run_.get('cut')}, plans {run_['plans']}")
            for report in run_["reports"]:
                print(f"  report after iteration {report['after_iteration']} at {report['t_s']} s: "
                      f"moved {report['moved']}")
            for r in run_["iterations"]:
                print(f"  {r['iteration']:3d} epoch {r['epoch']} clusters {r['clusters']} {r['lan_s']:.3f} s "
                      f"forwarded {r['forwarded']} exact {r['exact']}")
    return 0 if all(r["exact"] for r in result["runs"].values()) else 1
