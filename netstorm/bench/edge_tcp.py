"""The edge benchmark's ``tcp`` path: the gateway's ``TcpEdgeAgent`` in this process, the workers as processes
in their namespaces (``edge_worker.py --transport tcp``), on the same LAN, inputs and exactness checks as
the UDP paths.

``--loss`` cannot skip a TCP worker's first transmissions (TCP resends whatever is lost on its own), so on
this path the kernel drops that fraction of the packets leaving every worker and the gateway (a tc
classifier on each eth0, ``netstorm/emulation/lossfilter.py``). Those packets are the skbs veth carries,
which for TCP are segments of up to 64 KB: one loss costs a whole segment and a TCP recovery, a harsher
loss than the UDP paths' per-datagram one.
"""

from __future__ import annotations

import argparse
import asyncio
import socket
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from netstorm.bench.hostcpu import HostCpu


def run_tcp_path(args: argparse.Namespace, *, seed: int, job: int, port: int, mtu: int,
                 rates: list[tuple[float, float]] | None, timeout: float) -> dict[str, Any]:
    """The path on a fresh LAN; ``timeout`` bounds each iteration (``edge.deadline_s``)."""
    from bpf.tcpagent import TcpEdgeAgent
    from netstorm.bench.edge_levels import Workers, expected_sums, parse_precisions
    from netstorm.emulation import lossfilter
    from netstorm.emulation.bridge_lan import GATEWAY_IP, Lan
    from netstorm.emulation.netns import run_in
    from netstorm.lan.header import lanes_for_mtu
    from netstorm.lan.layout import EdgeLayout

    lanes = lanes_for_mtu(mtu)
    layout = EdgeLayout.uniform([args.elements], scale=args.scale, lanes=lanes)
    workers = args.workers
    precisions = parse_precisions(args.precision, workers)
    expected = expected_sums(args, seed, precisions, lanes)
    secret = Path(args.secret_file).read_bytes() if args.secret_file else None
    with (Lan(workers, mtu=mtu, rates=rates, uplink=getattr(args, "lan_uplink", "veth"),
              gateway_gbit=getattr(args, "gateway_gbit", None)) as lan,
          tempfile.TemporaryDirectory(prefix="netstorm-bench-tcp-") as logs):
        if args.loss > 0:
            lossfilter.attach({(ns, "eth0"): args.loss for ns in (lan.gateway, *lan.workers)}, Path(logs) / "bpffs")

        def listener() -> socket.socket:
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((GATEWAY_IP, port))
            return sock

        agent = TcpEdgeAgent(run_in(lan.gateway, listener), layout, workers=workers, job=job, secret=secret)
        procs = Workers(lan, gateway=(GATEWAY_IP, port), job=job, args=args, lanes=lanes, pool=0,
                        precisions=precisions, seed=seed, first=1, log_dir=Path(logs), transport="tcp")
        try:
            result = asyncio.run(_drive(agent, procs, expected, HostCpu(), timeout))
        finally:
            procs.close()
            agent.sock.close()
    result.update({"mode": "numpy sums", "lanes": lanes, "mtu": mtu, "precisions": precisions,
                   "levels": 1, "kernel_loss": args.loss})
    return result


async def _drive(agent: Any, workers: Any, expected: list[np.ndarray], cpu: Any,
                 timeout: float) -> dict[str, Any]:  # noqa: ASYNC109
    exact = True
    async with asyncio.TaskGroup() as tg:
        serving = tg.create_task(agent.run())
        try:
            workers.spawn()
            await asyncio.to_thread(workers.wait_ready)
            await agent.wait_workers(timeout=30)
            cpu0 = agent.receive_cpu
            cpu.start()
            workers.go()
            for k in range(len(expected)):
                sums = await agent.collect(1 + k, timeout=timeout)
                exact &= bool(np.array_equal(sums[0], expected[k]))
                await agent.send_results(1 + k, sums, total=len(workers.procs), timeout=timeout)
            await asyncio.to_thread(workers.wait_done, timeout)
            window = cpu.stop(extra=sum(w["cpu"] for w in workers.windows))
            receive_cpu = agent.receive_cpu - cpu0
            await asyncio.to_thread(workers.wait_checked, timeout + 60.0 * len(expected))
        finally:
            agent.close()
            await serving
    wall = max(w["t1"] for w in workers.windows) - min(w["t0"] for w in workers.windows)
    return {
        "wall_seconds": wall,
        "exact": exact and all(c["exact"] for c in workers.checks),
        "host_cpu": window,
        "gateway_sum_cpu_seconds": receive_cpu,
        "frames": sum(w["sender_calls"] for w in workers.windows),
        "workers_cpu_seconds": sum(w["cpu"] for w in workers.windows),
        "workers_cpu_user_seconds": sum(w["cpu_user"] for w in workers.windows),
        "workers_cpu_system_seconds": sum(w["cpu_system"] for w in workers.windows),
        "authenticated": agent.core.tokens.enabled,
        "refused": agent.core.refused,
    }
