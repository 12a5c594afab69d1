"""``netstorm bench edge``: LAN aggregation per CPU core, XDP against the userspace fallback, same run.

Both paths run on the same namespace LAN (a gateway and N workers on a bridge, the gateway's veth with
two queues), the same model, the same iterations and the same injected loss. Workers are threads with
their own event loops; the gateway's agent runs on the main thread. Each iteration's LAN sum is checked
exactly against numpy (int64 fixed-point sums) before its result goes back to the workers.

Two CPU figures per path (result broadcast and the exactness checks are excluded from both):
- aggregation (``pps_per_core``, ``ratio_per_core``, ``cpu_seconds_per_gb``): xdp = the XDP program's run
  time (kernel BPF run-time statistics, enabled for this run only through BPF_ENABLE_STATS); userspace =
  the agent thread's CPU receiving and aggregating DATA datagrams, minus the delivery below;
- gateway (``gateway_pps_per_core``, ``gateway_ratio_per_core``): aggregation plus the agent's work that
  both paths share per completed chunk (receiving the aggregate and taking it into the iteration's sums,
  ring-buffer reports, NACKs). Because that work is per chunk, not per worker packet, this ratio grows with
  the number of workers.
``pps_per_core`` = DATA datagrams aggregated per CPU-second; ratios are against the userspace fallback of
the same run. With ``--secret-file`` every datagram carries its token and both paths check it (the cost of
authentication: run once with and once without).
"""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import json
import os
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

HELP = "LAN edge aggregation per CPU core: XDP (bpf_timer) against the userspace fallback on one veth LAN"
PORT = 9500
JOB = 1
GROUP = ("239.77.0.50", 9501)
TARGET_RATIO = 10.0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--workers", type=int, default=4, help="LAN workers (1..64, default 4)")
    parser.add_argument("--loss", type=float, default=0.0, help="fraction of first transmissions dropped (0..1)")
    parser.add_argument("--elements", type=int, default=400_000, help="model size in float32 elements")
    parser.add_argument("--iterations", type=int, default=8, help="iterations per path (default 8)")
    parser.add_argument("--scale", type=int, default=20, help="fixed-point scale: lanes hold x * 2**scale")
    parser.add_argument("--slot-timeout", type=float, default=2.0, help="slot timer period in seconds")
    parser.add_argument("--secret-file", default=None, metavar="FILE",
                        help="job secret: authenticate every LAN datagram with its token (default: none)")
    parser.add_argument("--mtu", type=int, default=1500, help="LAN MTU: lanes per datagram follow (default 1500)")
    parser.add_argument("--pool-slots", type=int, default=None, metavar="SLOTS",
                        help="aggregation slots reused across chunks (default: the edge_pool_slots default)")
    parser.add_argument("--no-gso", action="store_true", help="one sendto per datagram instead of UDP GSO")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a table")


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


def _worker_thread(node: Any, contribs: list[list[np.ndarray]], first: int, timeout: float,
                   errors: list[BaseException]) -> None:
    async def main() -> None:
        for k, tensors in enumerate(contribs):
            await node.push_pull(first + k, tensors, timeout=timeout)

    try:
        asyncio.run(main())
    except BaseException as exc:
        errors.append(exc)


def run_path(path: str, args: argparse.Namespace) -> dict[str, Any]:
    from bpf.agent import EdgeAgent
    from bpf.xdp import XdpAggregator
    from netstorm.emulation.bridge_lan import GATEWAY_IP, Lan
    from netstorm.emulation.netns import run_in
    from netstorm.lan.header import lanes_for_mtu
    from netstorm.lan.layout import DEFAULT_POOL, EdgeLayout
    from netstorm.lan.sender import EdgeSender

    lanes = lanes_for_mtu(args.mtu)
    pool = DEFAULT_POOL if args.pool_slots is None else args.pool_slots
    layout = EdgeLayout.uniform([args.elements], scale=args.scale, lanes=lanes, pool=pool)
    rng = np.random.default_rng(1)
    workers = args.workers
    contribs = [[[rng.standard_normal(args.elements).astype(np.float32)] for _ in range(workers)]
                for _ in range(args.iterations)]
    expected = []
    for tensors in contribs:
        total = np.sum([np.rint(w[0].astype(np.float64) * 2.0**args.scale).astype(np.int64) for w in tensors], axis=0)
        expected.append((total.astype(np.float64) * 2.0**-args.scale).astype(np.float32))
    secret = Path(args.secret_file).read_bytes() if args.secret_file else None
    xdp = None
    stats_fd = -1
    mode = "userspace"
    with Lan(workers, mtu=args.mtu) as lan:
        try:
            if path == "xdp":
                xdp = XdpAggregator(layout, job=JOB, port=PORT, expected=(1 << workers) - 1,
                                    timeout=args.slot_timeout, max_nacks=50)
                ifindex = lan.gateway_ifindex()
                mode = run_in(lan.gateway, lambda: xdp.attach(ifindex))
                stats_fd = _enable_bpf_stats()
            sock = lan.udp_socket(lan.gateway, GATEWAY_IP, PORT, rcvbuf=16 << 20)
            agent = EdgeAgent(sock, layout, workers=workers, job=JOB, mode=path, xdp=xdp,
                              slot_timeout=args.slot_timeout, max_nacks=50, secret=secret, group=GROUP)
            nodes = [EdgeSender(lan.udp_socket(ns, lan.worker_ip(i)), (GATEWAY_IP, PORT), worker=i, layout=layout,
                                job=JOB, loss=args.loss, seed=7, secret=secret, gso=not args.no_gso,
                                group_opener=lan.group_opener(ns)) for i, ns in enumerate(lan.workers)]
            kernel_map_bytes = xdp.kernel_map_bytes() if xdp is not None else 0
            result = asyncio.run(_drive(agent, nodes, contribs, expected, xdp))
        finally:
            if stats_fd >= 0:
                os.close(stats_fd)
            if xdp is not None:
                xdp.close()
    result["mode"] = mode
    result["kernel_map_bytes"] = kernel_map_bytes
    result["lanes"], result["pool_slots"], result["mtu"] = lanes, layout.num_slots, args.mtu
    return result


async def _drive(agent: Any, nodes: list[Any], contribs: list[list[list[np.ndarray]]],
                 expected: list[np.ndarray], xdp: Any) -> dict[str, Any]:
    timeout = 60.0
    exact = True
    errors: list[BaseException] = []
    async with asyncio.TaskGroup() as tg:
        serving = tg.create_task(agent.run())
        try:
            await asyncio.gather(*(n.hello(timeout=10) for n in nodes))
            await agent.wait_workers(timeout=10)
            # the workers' sockets now move to their own threads and loops
            first = 1
            agent.expect(first)   # the first iteration's tokens are in place before any DATA
            threads = [threading.Thread(target=_worker_thread,
                                        args=(n, [c[n.worker] for c in contribs], first, timeout, errors))
                       for n in nodes]
            prog0 = _prog_stats(xdp.fd) if xdp is not None else (0, 0)
            cpu0, delivery0 = agent.receive_cpu, agent.delivery_cpu
            wall0 = time.perf_counter()
            for t in threads:
                t.start()
            for k in range(len(contribs)):
                sums = await agent.collect(first + k, timeout=timeout)
                exact &= bool(np.array_equal(sums[0], expected[k]))
                await agent.send_results(first + k, sums, total=len(nodes))  # this LAN alone
            def join_all() -> None:
                for t in threads:
                    t.join()

            await asyncio.to_thread(join_all)
            wall = time.perf_counter() - wall0
            prog1 = _prog_stats(xdp.fd) if xdp is not None else (0, 0)
            agent_cpu = agent.receive_cpu - cpu0
            delivery_cpu = agent.delivery_cpu - delivery0
        finally:
            agent.close()
            await serving
    if errors:
        raise errors[0]
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
        "wall_gbit": len(nodes) * len(contribs) * agent.layout.sizes[0] * 4 * 8 / 1e9 / wall,
        "sender_calls": sum(n.batch.calls for n in nodes),
        "sender_datagrams": sum(n.batch.datagrams for n in nodes),
        "exact": exact,
        "timer_events": stats["timer_events"],
        "duplicates": stats["dup"],
        "retransmitted": sum(n.retransmitted for n in nodes),
        "dropped_on_purpose": sum(n.dropped for n in nodes),
        "authenticated": agent.tokens.enabled,
        "bad_tokens": agent.bad_tokens,
    }


def run(args: argparse.Namespace) -> int:
    from netstorm.errors import NetStormError

    if os.geteuid() != 0:
        raise NetStormError("bench edge needs root (network namespaces and XDP)")
    if not 0.0 <= args.loss < 1.0:
        raise NetStormError(f"--loss must be in [0, 1), got {args.loss}")
    userspace = run_path("userspace", args)
    xdp = run_path("xdp", args)
    userspace["ratio_per_core"] = userspace["gateway_ratio_per_core"] = 1.0
    xdp["ratio_per_core"] = xdp["pps_per_core"] / userspace["pps_per_core"]
    xdp["gateway_ratio_per_core"] = xdp["gateway_pps_per_core"] / userspace["gateway_pps_per_core"]
    out = {
        "workers": args.workers, "loss": args.loss, "elements": args.elements, "iterations": args.iterations,
        "baseline": "userspace", "target_ratio_per_core": TARGET_RATIO,
        "xdp": xdp, "userspace": userspace,
    }
    if args.json:
        print(json.dumps(out, indent=2))
    else:
        print(f"edge aggregation: {args.workers} workers, {args.elements} elements x {args.iterations} iterations, "
              f"loss {args.loss}; XDP ran in {xdp['mode']} mode; "
              f"{'datagrams authenticated by tokens' if args.secret_file else 'no secret'}")
        for name, r in (("xdp", xdp), ("userspace", userspace)):
            print(f"  {name:9s} {r['pps_per_core']:12.0f} pkt/s/core {r['gbit_per_core']:7.2f} Gbit/s/core "
                  f"{r['cpu_seconds_per_gb']:8.3f} CPU-s/GB  ratio {r['ratio_per_core']:6.1f}x  exact={r['exact']}  "
                  f"timer events {r['timer_events']}")
        verdict = "meets" if xdp["ratio_per_core"] >= TARGET_RATIO else "misses"
        print(f"  XDP/userspace aggregation per core: {xdp['ratio_per_core']:.1f}x ({verdict} the "
              f"{TARGET_RATIO:.0f}x target); whole gateway incl. per-chunk delivery: "
              f"{xdp['gateway_ratio_per_core']:.1f}x")
    return 0 if xdp["exact"] and userspace["exact"] else 1
