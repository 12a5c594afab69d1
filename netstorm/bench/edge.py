"""``netstorm bench edge``: LAN aggregation per CPU core, XDP against the userspace fallback, same run.

See docs/ARCHITECTURE.md, *The LAN tier*."""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import json
import os
from pathlib import Path
from typing import Any

import numpy as np

from netstorm.bench.hostcpu import CpuWindow, HostCpu
from netstorm.bench.kernelmaps import kernel_map_bytes, map_memory

HELP = ("LAN edge aggregation: XDP, the userspace fallback and gloo all_reduce on one veth LAN, per CPU core, "
        "per wall-second and per host CPU-second")
PORT = 9500
JOB = 1
TARGET_RATIO = 10.0
PATHS = ("xdp", "userspace", "tcp", "gloo")
SEED = 1
LAN_PATHS = ("xdp", "userspace", "tcp")
"""The paths a gateway can run (gloo is the peer measured against, not a mode)."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--workers", type=int, default=4, help="LAN workers (1..64, default 4)")
    parser.add_argument("--loss", type=float, default=0.0, help="fraction of first transmissions dropped (0..1)")
    parser.add_argument("--elements", type=int, default=400_000, help="model size in float32 elements")
    parser.add_argument("--iterations", type=int, default=8, help="iterations per path (default 8)")
    parser.add_argument("--scale", type=int, default=20, help="fixed-point scale: lanes hold x * 2**scale")
    parser.add_argument("--slot-timeout", type=float, default=2.0, help="slot timer period in seconds")
    parser.add_argument("--secret-file", default=None, metavar="FILE",
                        help="job secret: authenticate every LAN datagram with its token (default: none)")
    parser.add_argument("--levels", type=int, choices=(1, 2), default=1,
                        help="1: every worker sends to the gateway; 2: --aggregators workers aggregate clusters "
                             "(XDP on their own hosts) and forward partial sums to the gateway (default 1)")
    parser.add_argument("--aggregators", type=int, default=1, metavar="K",
                        help="cluster aggregators with --levels 2: workers 0..K-1, the others dealt to them in turn")
    parser.add_argument("--precision", default="fp32", metavar="P[,P...]",
                        help="lane precision per worker, cycled: fp32, fp16, bf16, int8 (default fp32; gloo "
                             "always all-reduces float32)")
    parser.add_argument("--pool", "--pool-slots", dest="pool", type=int, default=None, metavar="SLOTS",
                        help="slots the aggregators reuse across chunks (default edge_pool_slots; 0: one per chunk)")
    parser.add_argument("--mtu", type=int, default=None,
                        help="LAN MTU: lanes per datagram follow (default edge_mtu)")
    parser.add_argument("--no-gso", action="store_true",
                        help="separate datagrams (a window per sendmmsg) instead of UDP GSO batches")
    parser.add_argument("--no-gro", action="store_true",
                        help="workers receive one datagram per receive instead of whole GSO batches (UDP_GRO)")
    parser.add_argument("--no-query-nacks", action="store_true",
                        help="workers resend on a gap at once instead of asking the gateway (edge_query_nacks=false)")
    parser.add_argument("--config", default=None, metavar="FILE", help="TOML file of options (the LAN tier's)")
    parser.add_argument("--lan-gbit", type=float, default=None, metavar="GBIT",
                        help="shape every worker's uplink and downlink to GBIT with HTB (default: unshaped)")
    parser.add_argument("--lan-uplink", choices=("veth", "ifb"), default="veth",
                        help="where a shaped uplink is metered (lan_uplink_shaping; default veth)")
    parser.add_argument("--lan-scenario", default=None, metavar="SCENARIO",
                        help="take the workers, their shaped rates, the gateway's rate and the precisions from "
                             "this scenario's DC --dc")
    parser.add_argument("--dc", type=int, default=None, metavar="N", help="the DC of --lan-scenario")
    parser.add_argument("--lan-bw-scale", type=float, default=1.0, metavar="X",
                        help="multiply the scenario's LAN rates (default 1)")
    parser.add_argument("--dc-planner", default=None, metavar="P",
                        help="with --lan-scenario: deploy planner P's two-level plan (flat, aleph, pahina, eina) or "
                             "baseline P's two-level form (atp, grid, precision-oblivious)")
    parser.add_argument("--pace-rates", action="store_true",
                        help="with --dc-planner: each worker paces its DATA to its rate in the plan (x --lan-bw-scale),"
                             " told in its HELLO answer (dc_pace_rates; default here: unpaced)")
    parser.add_argument("--results", choices=("stream", "whole", "kernel"), default="stream",
                        help="stream: each chunk's result goes down as the chunk completes (the LAN's own sum is "
                             "the result here); whole: after the whole iteration is summed, as when a WAN step "
                             "follows; kernel: on the xdp path the XDP program sends each completed chunk's "
                             "result to the workers' multicast group itself, with shadow slots (ALEPH's result "
                             "path: nothing of a sum crosses into userspace), and the userspace path streams "
                             "(default stream)")
    parser.add_argument("--paths", default=",".join(PATHS),
                        help=f"comma-separated paths to run, in this order: {', '.join(PATHS)} (default all)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    parser.add_argument("--maps-only", action="store_true",
                        help="load the XDP program for the model and pool, report kernel_map_bytes and stop "
                             "(no traffic)")
    parser.add_argument("--perf", metavar="DIR", default=None,
                        help="record each LAN path's measured window with perf into DIR and put where its CPU "
                             "went (by shared object and symbol) into the result")
    parser.add_argument("--out", metavar="FILE", default=None,
                        help="also write the JSON, with the command line and the host's load, to FILE")


def _prog_stats(fd: int) -> tuple[int, int]:
    """(run_time_ns, run_cnt) of a BPF program from its fdinfo."""
    values = {}
    with open(f"/proc/self/fdinfo/{fd}") as info:
        for line in info:
            key, _, value = line.partition(":")
            values[key.strip()] = value.strip()
    return int(values.get("run_time_ns", 0)), int(values.get("run_cnt", 0))


def _enable_bpf_stats() -> int:
    """An fd that keeps kernel BPF run-time statistics on until closed (no global sysctl is changed)."""
    from bpf.timer_link import libbpf

    lib = libbpf()
    lib.bpf_enable_stats.argtypes = [ctypes.c_int]
    fd = int(lib.bpf_enable_stats(0))  # BPF_STATS_RUN_TIME
    if fd < 0:
        raise OSError(-fd, f"BPF_ENABLE_STATS failed: {os.strerror(-fd)}")
    return fd


def apply_lan_scenario(args: argparse.Namespace) -> None:
    """``--lan-scenario``/``--dc``/``--dc-planner`` into the run's workers, rates, precisions and topology."""
    from netstorm import scenario
    from netstorm.config import resolve
    from netstorm.errors import NetStormError

    if args.lan_scenario is None:
        if args.dc is not None or args.dc_planner is not None:
            raise NetStormError("--dc and --dc-planner need --lan-scenario")
        return
    if args.dc is None:
        raise NetStormError("--lan-scenario needs --dc N")
    if not args.lan_bw_scale > 0:
        raise NetStormError(f"--lan-bw-scale must be positive, got {args.lan_bw_scale}")
    spec = scenario.load(args.lan_scenario).node(args.dc).lan
    if spec is None:
        raise NetStormError(f"DC {args.dc} of {args.lan_scenario} describes no LAN")
    args.workers = len(spec.workers)
    args.rates = [(w.up_gbit * args.lan_bw_scale, w.down_gbit * args.lan_bw_scale) for w in spec.workers]
    args.gateway_gbit = spec.gateway_gbit * args.lan_bw_scale
    args.racks = [(r.id, r.uplink_gbit * args.lan_bw_scale) for r in spec.racks]   # each behind its uplink
    args.worker_racks = [w.rack for w in spec.workers]
    if args.precision == "fp32":
        args.precision = ",".join(w.precision for w in spec.workers)
    if args.dc_planner is not None:
        args.topology, args.plan = planned_topology(spec, args.dc_planner, resolve(file=args.config))
    if getattr(args, "pace_rates", False):
        rates = getattr(args, "plan", {}).get("rates")
        if not rates:
            raise NetStormError("--pace-rates needs --dc-planner with a plan that allocates rates")
        args.pace_gbit = {int(w): r * args.lan_bw_scale for w, r in rates.items() if r > 0}
        args.plan["paced"] = True


def planned_topology(spec: Any, planner: str, config: Any) -> tuple[Any, dict[str, Any]]:
    """The LanTopology the scheduler's planning core deploys for ``planner``, or a baseline's two-level
    form (``atp``, ``grid``, ``precision-oblivious``: ``dcplan.baseline_plan`` with workers as the only
    aggregators, as the planning core plans), and what the plan predicts."""
    import dataclasses

    from netstorm import lanreport
    from netstorm.dcplanners import PLANNERS
    from netstorm.errors import NetStormError, PolicyError
    from netstorm.lan.deploy import LanTopology
    from netstorm.planning import dcplan
    from netstorm.planning.lanmodel import two_level
    from scheduler.lanplanning import LanPlanning

    if planner not in (*PLANNERS, *dcplan.TREE_BASELINES):
        raise NetStormError(f"--dc-planner {planner!r}: one of {', '.join((*PLANNERS, *dcplan.TREE_BASELINES))}")
    if planner in dcplan.TREE_BASELINES:
        try:
            plan = dcplan.baseline_plan(spec, planner, dcplan.Options.from_config(config, tor=False))
            clusters, _direct = two_level(plan)
        except PolicyError as exc:
            raise NetStormError(f"--dc-planner {planner!r}: {exc}") from None
        info = {"planner": planner, "predicted_gbit": plan.prediction.gbit, "notes": list(plan.notes)}
    else:
        try:
            core = LanPlanning(dataclasses.replace(config, dc_planner=planner))
        except Exception as exc:
            raise NetStormError(f"--dc-planner {planner!r}: {exc}") from None
        core.report(lanreport.report_from_spec(0, spec))
        job = core.begin(0)
        message = core.finish(job, core.compute(job))
        if message is None:
            raise NetStormError(f"the {planner} plan of this LAN cannot run in the data plane")
        clusters = {a: list(m) for a, m in message.clusters}
        info = {"planner": planner, "predicted_gbit": message.predicted_gbit,
                "rates": {str(w): r for w, r in message.rates}}
    topo = LanTopology(len(spec.workers), {a: tuple(m) for a, m in clusters.items()})
    return topo, {**info, "clusters": {str(a): list(m) for a, m in topo.clusters.items()}}


def _rates(args: argparse.Namespace) -> list[tuple[float, float]] | None:
    """Each worker's shaped (up, down) Gbit/s: ``args.rates`` (a calibration's), else ``--lan-gbit``."""
    if getattr(args, "rates", None):
        return list(args.rates)
    gbit = getattr(args, "lan_gbit", None)
    return [(gbit, gbit)] * args.workers if gbit else None





def _racks(args: argparse.Namespace) -> dict[str, Any]:
    """The LAN's racks for ``Lan`` (``--lan-scenario``'s: each rack's workers behind its uplink, scaled by
    ``--lan-bw-scale`` as the workers' rates are), or none."""
    if not getattr(args, "racks", None):
        return {}
    return {"racks": args.racks, "worker_racks": args.worker_racks}


def run_path(path: str, args: argparse.Namespace) -> dict[str, Any]:
    """One LAN path (``xdp`` or ``userspace``) on a fresh namespace LAN, with the run's LAN options."""
    import tempfile

    from bpf.agent import EdgeAgent
    from bpf.xdp import PassProgram, XdpAggregator
    from netstorm.bench.edge_levels import (
        Aggregators,
        Workers,
        expected_sums,
        parse_precisions,
        topology,
    )
    from netstorm.emulation.bridge_lan import GATEWAY_IP, GATEWAY_PORT, Lan
    from netstorm.emulation.netns import run_in
    from netstorm.lan.header import lanes_for_mtu
    from netstorm.lan.layout import EdgeLayout

    cfg = _lan_config(args)
    mtu = args.mtu if args.mtu is not None else cfg.edge_mtu
    lanes = lanes_for_mtu(mtu)
    pool = args.pool if args.pool is not None else cfg.edge_pool_slots
    kernel = getattr(args, "results", "stream") == "kernel" and path == "xdp"
    layout = EdgeLayout((args.elements,), (args.scale,), lanes=lanes, pool=pool, shadow=kernel)
    workers = args.workers
    precisions = parse_precisions(args.precision, workers)
    topo = getattr(args, "topology", None) or topology(workers, args.levels, args.aggregators)
    expected = expected_sums(args, SEED, precisions, lanes)
    secret = Path(args.secret_file).read_bytes() if args.secret_file else None
    group = _address(cfg.edge_group) if cfg.edge_group else None
    xdp = None
    passer: Any = None
    stats_fd = -1
    mode = "userspace"
    with (Lan(workers, mtu=mtu, rates=_rates(args), uplink=getattr(args, "lan_uplink", "veth"),
              gateway_gbit=getattr(args, "gateway_gbit", None), **_racks(args)) as lan,
          tempfile.TemporaryDirectory(prefix="netstorm-bench-edge-") as logs):
        aggregators = (Aggregators(lan, topo, gateway=(GATEWAY_IP, PORT), job=JOB, mode=path,
                                   secret_file=args.secret_file, log_dir=Path(logs)) if topo.clusters else None)
        try:
            if path == "xdp":
                xdp = XdpAggregator(layout, job=JOB, port=PORT, expected=topo.gateway_mask(),
                                    timeout=args.slot_timeout, max_nacks=50)
                ifindex = lan.gateway_ifindex()
                mode = run_in(lan.gateway, lambda: xdp.attach(ifindex))
                stats_fd = _enable_bpf_stats()
            sock = lan.udp_socket(lan.gateway, GATEWAY_IP, PORT, rcvbuf=16 << 20)
            agent = EdgeAgent(sock, layout, workers=workers, job=JOB, mode=path, xdp=xdp,
                              slot_timeout=args.slot_timeout, max_nacks=50, secret=secret, group=group,
                              topology=topo, retransmit=cfg.edge_retransmit,
                              query_nacks=cfg.edge_query_nacks)
            agent.pace_gbit = dict(getattr(args, "pace_gbit", None) or {})
            if kernel:
                if mode == "native":
                    passer = PassProgram()   # the bridge's end of the veth takes XDP_TX frames only so
                    run_in(lan.bridge, lambda: passer.attach(GATEWAY_PORT))
                agent.return_results_from_kernel(lan.gateway_mac())
            first = 1
            procs = Workers(lan, gateway=(GATEWAY_IP, PORT), job=JOB, args=args, lanes=lanes, pool=pool,
                            precisions=precisions, seed=SEED, first=first, log_dir=Path(logs))
            cpu = HostCpu()
            perf = None
            if getattr(args, "perf", None):
                from netstorm.bench.perfprof import PerfRecorder

                Path(args.perf).mkdir(parents=True, exist_ok=True)
                perf = PerfRecorder(Path(args.perf) / f"{path}-{workers}w-loss{args.loss:g}-l{args.levels}.data")
            try:
                result = asyncio.run(_drive(agent, procs, expected, xdp, cpu, perf, aggregators, first=first,
                                            results="kernel" if kernel else (
                                                "whole" if getattr(args, "results", "stream") == "whole"
                                                else "stream")))
            finally:
                procs.close()
            result["lan_drops"] = lan.drops()
            if lan.racks:
                result["lan_racks"] = lan.rack_record()
            if xdp is not None:
                result["kernel_map_bytes"] = kernel_map_bytes() + sum(
                    kernel_map_bytes(str(pid)) for pid in (aggregators.pids if aggregators else []))
        finally:
            if aggregators is not None:
                aggregators.close()
            if stats_fd >= 0:
                os.close(stats_fd)
            if xdp is not None:
                xdp.close()
            if passer is not None:
                passer.close()
    result["mode"] = mode
    result["levels"] = topo.levels
    result["clusters"] = {str(a): list(m) for a, m in topo.clusters.items()}
    result["precisions"] = precisions
    result["pool"] = layout.num_slots
    if aggregators is not None:
        result["aggregators"] = {str(w): {**aggregators.ready.get(w, {}), **aggregators.final.get(w, {})}
                                 for w in aggregators.heads}
    result["lanes"], result["pool_slots"], result["mtu"] = lanes, layout.num_slots, mtu
    return result


def _lan_config(args: argparse.Namespace) -> Any:
    """The LAN tier's options (config file, environment, defaults) for the benchmark."""
    from netstorm.config import resolve

    return resolve(file=getattr(args, "config", None), overrides=getattr(args, "lan_overrides", None))


def _address(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    return host, int(port)


def deadline_s(elements: int, workers: int) -> float:
    """Seconds an iteration may take: a minute, plus its gradient bytes at 0.02 Gbit/s."""
    return 60.0 + elements * 4 * workers * 8 / 2e7


async def _drive(agent: Any, workers: Any, expected: list[np.ndarray], xdp: Any, cpu: Any, perf: Any = None,
                 aggregators: Any = None, *, first: int, results: str = "stream") -> dict[str, Any]:
    timeout = deadline_s(agent.layout.sizes[0], len(workers.lan.workers))
    exact = True
    async with asyncio.TaskGroup() as tg:
        serving = tg.create_task(agent.run())
        try:
            if aggregators is not None:  # their HELLO first: members are told to send to them
                aggregators.spawn()
                await asyncio.to_thread(aggregators.wait_ready)
                cpu.add(aggregators.pids)
            workers.spawn()
            await asyncio.to_thread(workers.wait_ready)
            await agent.wait_workers(timeout=30)
            agent.expect(first)   # the first iteration's tokens are in place before any DATA
            prog0 = _prog_stats(xdp.fd) if xdp is not None else (0, 0)
            cpu0, delivery0 = agent.receive_cpu, agent.delivery_cpu
            if perf is not None:
                perf.start([p.pid for p in workers.procs])
            cpu.start()
            workers.go()
            for k in range(len(expected)):
                if results == "kernel":   # the program sends each result; the workers check them
                    await agent.completed(first + k, timeout=timeout)
                    continue
                if results == "stream":   # this LAN alone: each chunk's sum is its result, sent as it completes
                    agent.stream_results(first + k, total=len(workers.procs))
                sums = await agent.collect(first + k, timeout=timeout)
                exact &= bool(np.array_equal(sums[0], expected[k]))
                if results == "whole":
                    await agent.send_results(first + k, sums, total=len(workers.procs))
            await asyncio.to_thread(workers.wait_done, timeout)
            window = cpu.stop(extra=sum(w["cpu"] for w in workers.windows))
            profile = perf.stop() if perf is not None else None
            prog1 = _prog_stats(xdp.fd) if xdp is not None else (0, 0)
            agent_cpu = agent.receive_cpu - cpu0
            delivery_cpu = agent.delivery_cpu - delivery0
            await asyncio.to_thread(workers.wait_checked, timeout + 60.0 * len(expected))
        finally:
            agent.close()
            await serving
    wall = max(w["t1"] for w in workers.windows) - min(w["t0"] for w in workers.windows)
    exact &= all(c["exact"] for c in workers.checks)
    if xdp is not None:
        stats = xdp.stats()
        packets = stats["rx"]
        prog_cpu = (prog1[0] - prog0[0]) / 1e9
        if prog1[1] - prog0[1] <= 0:
            raise RuntimeError("the XDP program never ran: was it attached to the gateway's interface?")
    else:
        stats = dict(agent.fallback.counters)
        packets = stats["rx"]
        prog_cpu = 0.0
    cpu = prog_cpu if xdp is not None else agent_cpu - delivery_cpu
    gateway_cpu = prog_cpu + agent_cpu
    lanes_bytes = agent.layout.lanes * 4
    aggregated_gb = packets * lanes_bytes / 1e9
    return {
        "packets": packets,
        "cpu_seconds": cpu,
        "gateway_cpu_seconds": gateway_cpu,
        "xdp_program_cpu_seconds": prog_cpu,
        "agent_cpu_seconds": agent_cpu,
        "agent_delivery_cpu_seconds": delivery_cpu,
        "pps_per_core": packets / cpu if cpu > 0 else float("inf"),
        "gbit_per_core": packets * lanes_bytes * 8 / 1e9 / cpu if cpu > 0 else float("inf"),
        "cpu_seconds_per_gb": cpu / aggregated_gb if aggregated_gb else float("nan"),
        "gateway_pps_per_core": packets / gateway_cpu if gateway_cpu > 0 else float("inf"),
        "gateway_cpu_seconds_per_gb": gateway_cpu / aggregated_gb if aggregated_gb else float("nan"),
        "wall_seconds": wall,
        "wall_pps": packets / wall,
        "sender_calls": sum(w["sender_calls"] for w in workers.windows),
        "sender_datagrams": sum(w["sender_datagrams"] for w in workers.windows),
        "exact": exact,
        "timer_events": stats["timer_events"],
        "duplicates": stats["dup"],
        "retransmitted": sum(w["retransmitted"] for w in workers.windows),
        "streamed_result_chunks": agent.streamed_chunks,
        "per_worker": {str(w["worker"]): {k: w.get(k, 0) for k in ("retransmitted", "resent_by_nack", "stall_resends",
                                                                   "queries", "ack_rtt")} for w in workers.windows},
        "resent_by_nack": sum(w.get("resent_by_nack", 0) for w in workers.windows),
        "stall_resends": sum(w.get("stall_resends", 0) for w in workers.windows),
        "tail_probes": sum(w.get("tail_probes", 0) for w in workers.windows),
        "queries": sum(w.get("queries", 0) for w in workers.windows),
        "ack_rtt_seconds": max((w.get("ack_rtt", 0.0) for w in workers.windows), default=0.0),
        "query_nacks": agent.query_nacks_sent,
        "nack_datagrams": agent.nack_datagrams,
        "dropped_on_purpose": sum(w["dropped"] for w in workers.windows),
        "workers_cpu_seconds": sum(w["cpu"] for w in workers.windows),
        "workers_receive_rounds": sum(w["receive_rounds"] for w in workers.windows),
        "workers_coalesced_receives": sum(w["coalesced_receives"] for w in workers.windows),
        "workers_cpu_user_seconds": sum(w["cpu_user"] for w in workers.windows),
        "workers_cpu_system_seconds": sum(w["cpu_system"] for w in workers.windows),
        "authenticated": agent.tokens.enabled,
        "bad_tokens": agent.bad_tokens,
        "host_cpu": window,
        **({"perf": profile} if profile is not None else {}),
    }


def run_gloo_path(args: argparse.Namespace) -> dict[str, Any]:
    import tempfile

    from netstorm.bench.gloo_lan import run_gloo
    from netstorm.emulation.bridge_lan import Lan

    mtu = args.mtu if args.mtu is not None else _lan_config(args).edge_mtu   # the same LAN as the other paths
    with (Lan(args.workers, mtu=mtu, rates=_rates(args), uplink=args.lan_uplink, **_racks(args)) as lan,
          tempfile.TemporaryDirectory(prefix="netstorm-bench-gloo-") as logs):
        out = run_gloo(lan, elements=args.elements, iterations=args.iterations, scale=args.scale, seed=SEED,
                       log_dir=Path(logs))
    return {"wall_seconds": out["wall_seconds"], "exact": out["exact"], "host_cpu": out["host_cpu"],
            "ranks_cpu_seconds": out["ranks_cpu_seconds"], "mode": "gloo all_reduce (ring), float32", "mtu": mtu}


def run_one(path: str, args: argparse.Namespace) -> dict[str, Any]:
    """One path of the benchmark on its own fresh namespace LAN."""
    if path == "gloo":
        return run_gloo_path(args)
    if path == "tcp":
        from netstorm.bench.edge_tcp import run_tcp_path

        cfg = _lan_config(args)
        return run_tcp_path(args, seed=SEED, job=JOB, port=PORT, mtu=args.mtu if args.mtu is not None else cfg.edge_mtu,
                            rates=_rates(args), timeout=deadline_s(args.elements, args.workers))
    return run_path(path, args)


def with_host_figures(result: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    """``result`` with wall_gbit and the host CPU per GB of contributed gradient bytes (module docstring)."""
    window: CpuWindow = result.pop("host_cpu")
    gradient_gb = args.workers * args.elements * 4 * args.iterations / 1e9
    wall = result["wall_seconds"]
    return {**result,
            "gradient_gb": gradient_gb,
            "wall_gbit": gradient_gb * 8 / wall if wall > 0 else float("inf"),
            "host_cpu_seconds": window.seconds,
            "host_cpu_seconds_per_gb": window.seconds / gradient_gb,
            "host_busy_seconds_per_gb": window.host_seconds / gradient_gb,
            "host_busy_cores": window.host_seconds / window.wall if window.wall > 0 else 0.0}


def parse_paths(text: str) -> list[str]:
    from netstorm.errors import NetStormError

    paths = [p.strip() for p in text.split(",") if p.strip()]
    unknown = [p for p in paths if p not in PATHS]
    if unknown or not paths:
        raise NetStormError(f"--paths takes {', '.join(PATHS)}; got {text!r}")
    return paths


def auto_pick(results: dict[str, dict[str, Any]], allowed: tuple[str, ...] = LAN_PATHS) -> str | None:
    """The LAN path ``edge_mode=auto`` takes under the measured conditions (``netstorm.lan.pathpick``: the
    fastest exact path, the leaner of two within its tie); None when no LAN path ran exactly."""
    from netstorm.lan.pathpick import Measured, pick

    measured = {name: Measured(r["wall_gbit"], bool(r.get("exact")), r.get("host_cpu_seconds_per_gb"))
                for name, r in results.items() if name in allowed}
    if not any(m.exact for m in measured.values()):
        return None
    return pick(measured, allowed).path


CALIBRATION_ELEMENTS = 400_000
"""Largest model a calibration sends per iteration: enough datagrams per worker for the per-packet
costs to dominate, small enough to take a few seconds per path."""


def calibrate(workers: int, *, elements: int, rates: list[tuple[float, float]] | None = None,
              iterations: int = 2, options: dict[str, Any] | None = None,
              paths: tuple[str, ...] = LAN_PATHS, racks: list[tuple[int, float]] | None = None,
              worker_racks: list[int | None] | None = None) -> dict[str, Any]:
    """The LAN ``paths`` on a namespace LAN like the one to serve (its workers, their shaped rates, its racks
    behind their shaped uplinks, the model up to CALIBRATION_ELEMENTS, the run's LAN tier ``options`` such as
    ``edge_pool_slots``): each
    path's wall_gbit (None with the reason where it could not run) and ``pick`` with its ``reason``
    (``netstorm.lan.pathpick``). This is ``edge_mode=auto`` measured, not assumed."""
    from netstorm.lan.pathpick import Measured, pick

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--workers", str(workers), "--elements", str(max(1, min(elements, CALIBRATION_ELEMENTS))),
                              "--iterations", str(iterations)])
    args.rates = rates
    args.racks, args.worker_racks = racks, worker_racks
    args.lan_overrides = options or {}
    out: dict[str, Any] = {"workers": workers, "elements": args.elements, "iterations": iterations}
    if racks:
        out["racks"] = [[rid, gbit] for rid, gbit in racks]   # (id, shaped uplink Gbit/s)
    measured: dict[str, Measured] = {}
    for path in paths:
        try:
            r = with_host_figures(run_one(path, args), args)
            out[path] = r["wall_gbit"]
            out[f"{path}_host_cpu_seconds_per_gb"] = r["host_cpu_seconds_per_gb"]
            measured[path] = Measured(r["wall_gbit"], bool(r["exact"]), r["host_cpu_seconds_per_gb"])
        except Exception as exc:  # the path cannot run here: another one is the pick
            out[path] = None
            out[f"{path}_error"] = f"{type(exc).__name__}: {exc}"
            measured[path] = Measured(None, False, error=out[f"{path}_error"])
    chosen = pick(measured, paths)
    out["pick"], out["reason"] = chosen.path, chosen.reason
    return out


def maps_only(args: argparse.Namespace) -> dict[str, Any]:
    """The XDP aggregator loaded for ``--elements`` and the pool, its maps' memory read from the kernel."""
    from bpf.xdp import XdpAggregator
    from netstorm.lan.header import lanes_for_mtu
    from netstorm.lan.layout import EdgeLayout

    cfg = _lan_config(args)
    mtu = args.mtu if args.mtu is not None else cfg.edge_mtu
    pool = args.pool if args.pool is not None else cfg.edge_pool_slots
    layout = EdgeLayout.uniform([args.elements], scale=args.scale, lanes=lanes_for_mtu(mtu), pool=pool)
    before = set(map_memory())
    xdp = XdpAggregator(layout, job=JOB, port=PORT, expected=(1 << args.workers) - 1, timeout=args.slot_timeout)
    try:
        maps = {m: b for m, b in map_memory().items() if m not in before}
    finally:
        xdp.close()
    return {"elements": args.elements, "chunks": layout.num_chunks, "pool_slots": layout.num_slots,
            "lanes": layout.lanes, "mtu": mtu, "kernel_map_bytes": sum(maps.values()),
            "maps": {str(m): b for m, b in sorted(maps.items())}}


def run(args: argparse.Namespace) -> int:
    from netstorm.errors import NetStormError

    if os.geteuid() != 0:
        raise NetStormError("bench edge needs root (network namespaces and XDP)")
    if not 0.0 <= args.loss < 1.0:
        raise NetStormError(f"--loss must be in [0, 1), got {args.loss}")
    if args.maps_only:
        doc = maps_only(args)
        if args.out:
            import shlex
            import sys

            from netstorm.provenance import write_result

            write_result(args.out, {"command": shlex.join(["netstorm", *sys.argv[1:]]), **doc})
        print(json.dumps(doc, indent=2) if args.json else
              f"XDP aggregator for {args.elements} elements ({doc['chunks']} chunks, pool {doc['pool_slots']} slots): "
              f"{doc['kernel_map_bytes'] / 2**20:.1f} MiB of maps in the kernel")
        return 0
    if getattr(args, "no_query_nacks", False):
        args.lan_overrides = {**(getattr(args, "lan_overrides", None) or {}), "edge_query_nacks": False}
    paths = parse_paths(args.paths)
    from netstorm.bench.edge_levels import parse_precisions, topology

    apply_lan_scenario(args)
    precisions = parse_precisions(args.precision, args.workers)   # refuse bad options before any run
    topo = getattr(args, "topology", None) or topology(args.workers, args.levels, args.aggregators)
    host = {"kernel": os.uname().release, "cpus": os.cpu_count(), "load_average_before": os.getloadavg()}
    results: dict[str, dict[str, Any]] = {}
    if topo.clusters and "tcp" in paths:
        paths.remove("tcp")   # the TCP path is one level
    for path in paths:
        results[path] = with_host_figures(run_one(path, args), args)
    out: dict[str, Any] = {
        "workers": args.workers, "loss": args.loss, "elements": args.elements, "iterations": args.iterations,
        "lan_gbit": args.lan_gbit, "lan_uplink": args.lan_uplink, "levels": args.levels,
        "clusters": {str(a): list(m) for a, m in topo.clusters.items()}, "precisions": precisions,
        "pool": args.pool if args.pool is not None else _lan_config(args).edge_pool_slots,
        "baseline": "userspace", "target_ratio_per_core": TARGET_RATIO, "peer": "gloo",
        "mtu": args.mtu if args.mtu is not None else _lan_config(args).edge_mtu,
        "gso": not args.no_gso, "gro": not getattr(args, "no_gro", False),
        "query_nacks": _lan_config(args).edge_query_nacks,
        "results": getattr(args, "results", "stream"),
    }
    if args.lan_scenario is not None:
        out["lan_scenario"] = {"scenario": args.lan_scenario, "dc": args.dc, "lan_bw_scale": args.lan_bw_scale,
                               "rates_gbit": [list(r) for r in args.rates], "gateway_gbit": args.gateway_gbit,
                               **getattr(args, "plan", {"planner": None})}
        # the racks the LAN emulated (every rack holding a worker), their uplinks as the kernel holds them
        out["lan_scenario"]["racks"] = next((r["lan_racks"] for r in results.values() if "lan_racks" in r), [])
    xdp, userspace, gloo = results.get("xdp"), results.get("userspace"), results.get("gloo")
    if xdp is not None and userspace is not None:
        userspace["ratio_per_core"] = userspace["gateway_ratio_per_core"] = 1.0
        xdp["ratio_per_core"] = xdp["pps_per_core"] / userspace["pps_per_core"]
        xdp["gateway_ratio_per_core"] = xdp["gateway_pps_per_core"] / userspace["gateway_pps_per_core"]
    if xdp is not None:
        out["kernel_map_bytes"] = xdp.pop("kernel_map_bytes")
    if gloo is not None:
        for r in results.values():
            r["wall_gbit_vs_gloo"] = r["wall_gbit"] / gloo["wall_gbit"]
            r["host_cpu_per_gb_vs_gloo"] = r["host_cpu_seconds_per_gb"] / gloo["host_cpu_seconds_per_gb"]
    out.update(results)
    out["auto_pick"] = auto_pick(results)
    out["host"] = {**host, "load_average_after": os.getloadavg()}
    if args.out:
        import shlex
        import sys

        doc = {"command": shlex.join(["netstorm", *sys.argv[1:]]), **out}
        from netstorm.provenance import write_result

        write_result(args.out, doc)
    if args.json:
        print(json.dumps(out, indent=2))
    else:
        print(table(out, args))
    return 0 if all(r["exact"] for r in results.values()) else 1


def table(out: dict[str, Any], args: argparse.Namespace) -> str:
    """The human-readable report: each path against gloo, then the per-core view."""
    lines = [f"edge aggregation: {args.workers} workers, {args.elements} elements x {args.iterations} iterations, "
             f"loss {args.loss}; "
             f"{'datagrams authenticated by tokens' if args.secret_file else 'no secret'}; "
             + (f"DC {args.dc} of {args.lan_scenario} at x{args.lan_bw_scale:g}, "
                f"{(out['lan_scenario'].get('planner') or 'configured')} deployment"
                if out.get("lan_scenario") else
                f"every port shaped to {args.lan_gbit:g} Gbit/s (uplinks on {args.lan_uplink})" if args.lan_gbit
                else "LAN unshaped")
             + f"; {out['levels']} level(s){' clusters ' + str(out['clusters']) if out['clusters'] else ''}, "
               f"pool {out['pool']} slots, precisions {','.join(sorted(set(out['precisions'])))}"]
    lines.append(f"  {'path':9s} {'mode':22s} {'wall Gbit/s':>11s} {'vs gloo':>8s} {'host CPU-s/GB':>13s} "
                 f"{'vs gloo':>8s} {'host busy cores':>15s}  exact")
    for name in PATHS:
        r = out.get(name)
        if r is None:
            continue
        vs = (f"{r['wall_gbit_vs_gloo']:7.2f}x", f"{r['host_cpu_per_gb_vs_gloo']:7.2f}x") if "gloo" in out else ("", "")
        lines.append(f"  {name:9s} {r.get('mode', '')!s:22.22s} {r['wall_gbit']:11.3f} {vs[0]:>8s} "
                     f"{r['host_cpu_seconds_per_gb']:13.3f} {vs[1]:>8s} {r['host_busy_cores']:15.2f}  {r['exact']}")
    if "kernel_map_bytes" in out:
        lines.append(f"  XDP maps in the kernel: {out['kernel_map_bytes'] / 2**20:.1f} MiB")
    for name in ("xdp", "userspace"):
        r = out.get(name)
        if r is not None:
            lines.append(f"  {name:9s} {r['pps_per_core']:12.0f} pkt/s/core {r['gbit_per_core']:7.2f} Gbit/s/core "
                         f"{r['cpu_seconds_per_gb']:8.3f} CPU-s/GB  gateway {r['gateway_cpu_seconds_per_gb']:8.3f} "
                         f"CPU-s/GB  timer events {r['timer_events']}")
    if "xdp" in out and "userspace" in out:
        xdp = out["xdp"]
        verdict = "meets" if xdp["ratio_per_core"] >= TARGET_RATIO else "misses"
        lines.append(f"  XDP/userspace aggregation per core: {xdp['ratio_per_core']:.1f}x ({verdict} the "
                     f"{TARGET_RATIO:.0f}x target); whole gateway incl. per-chunk delivery: "
                     f"{xdp['gateway_ratio_per_core']:.1f}x")
    if out.get("auto_pick"):
        lines.append(f"  edge_mode=auto takes: {out['auto_pick']}")
    return "\n".join(lines)
