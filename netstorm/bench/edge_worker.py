"""One LAN worker of the edge benchmark, as its own process in its own namespace (a worker is a host).

``python -m netstorm.bench.edge_worker --worker I --address IP --gateway HOST:PORT ...``

Workers used to be threads of the benchmark's process, beside the gateway's agent: every packet's Python
work then queued behind one interpreter lock with the agent's and the other workers', and a worker's
retransmission timer fired on ACKs that had arrived but not yet been read. As processes they contend for
the CPU as hosts sharing it do, not for one lock, as gloo's ranks do in the same benchmark.

Like a gloo rank it draws its own inputs (``edge_inputs``), says HELLO, prints ``ready``, waits for ``go``
on its stdin, pushes and pulls every iteration, prints its window (``t0``, ``t1`` on the shared monotonic
clock, its CPU, its retransmissions) and only then checks every result against the exact reference.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import resource
import socket
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np


def _cpu_seconds() -> tuple[float, float]:
    """(user, system) CPU seconds of this process so far."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime, usage.ru_stime


async def work(args: argparse.Namespace, secret: bytes | None) -> int:
    from netstorm.bench.edge_inputs import contribution
    from netstorm.bench.edge_levels import wire_precision
    from netstorm.lan.layout import EdgeLayout
    from netstorm.lan.sender import EdgeSender

    host, _, port = args.gateway.rpartition(":")
    precisions = args.precisions.split(",")
    layout = EdgeLayout.uniform([args.elements], scale=args.scale, lanes=args.lanes, pool=args.pool)
    inputs = [contribution(args.seed, k, args.worker, args.elements, args.scale, args.workers)
              for k in range(args.iterations)]
    if args.transport == "tcp":
        return await work_tcp(args, secret, inputs)
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)
    sock.bind((args.address, 0))
    sock.setblocking(False)
    node = EdgeSender(sock, (host, int(port)), worker=args.worker, layout=layout, job=args.job, loss=args.loss,
                      seed=7, secret=secret, precision=wire_precision(precisions[args.worker]), gso=not args.no_gso,
                      gro=not args.no_gro)
    await node.hello(timeout=args.timeout)
    timed = await _timed(node, args, inputs)
    if timed is None:
        return 2
    results, times = timed
    print(json.dumps({**times, "retransmitted": node.retransmitted, "resent_by_nack": node.resent_by_nack,
                      "stall_resends": node.stall_resends, "tail_probes": node.tail_probes,
                      "ack_rtt": node.ack_rtt, "queries": node.queries,
                      "receive_rounds": node.rounds,
                      "coalesced_receives": node.coalesced, "dropped": node.dropped,
                      "sender_calls": node.batch.calls, "sender_datagrams": node.batch.datagrams}), flush=True)
    exact = _exact(args, results)
    print(json.dumps({"worker": args.worker, "exact": exact}), flush=True)
    node.close()
    return 0


async def _timed(node: Any, args: argparse.Namespace,
                 inputs: list[np.ndarray]) -> tuple[list[np.ndarray], dict[str, float]] | None:
    """Say ready, wait for the harness's "go" (None: it said something else), then run the measured
    iterations on ``node`` (either path's worker): each iteration's sum, and the window's wall and CPU
    times, which both paths report alike."""
    print("ready", flush=True)
    loop = asyncio.get_running_loop()
    if (await loop.run_in_executor(None, sys.stdin.readline)).strip() != "go":
        return None
    results = []
    cpu0, t0 = _cpu_seconds(), time.monotonic()
    for k in range(args.iterations):
        sums, _total = await node.push_pull(args.first + k, [inputs[k]], timeout=args.timeout)
        results.append(sums[0])
    t1, cpu1 = time.monotonic(), _cpu_seconds()
    return results, {"worker": args.worker, "t0": t0, "t1": t1, "cpu": sum(cpu1) - sum(cpu0),
                     "cpu_user": cpu1[0] - cpu0[0], "cpu_system": cpu1[1] - cpu0[1]}


def _exact(args: argparse.Namespace, results: list[np.ndarray]) -> bool:
    """Whether every iteration's sum equals the exact reference of the inputs every worker sent."""
    from netstorm.bench.edge_levels import expected_sums

    want = expected_sums(args, args.seed, args.precisions.split(","), args.lanes)
    return all(np.array_equal(got, ref) for got, ref in zip(results, want, strict=True))


async def work_tcp(args: argparse.Namespace, secret: bytes | None, inputs: list[np.ndarray]) -> int:
    """The same worker on the TCP path (``edge_mode=tcp``)."""
    from netstorm.bench.edge_levels import wire_precision
    from netstorm.lan.tcpclient import TcpEdgeWorker

    host, _, port = args.gateway.rpartition(":")

    def bound() -> socket.socket:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.bind((args.address, 0))
        return sock

    node = TcpEdgeWorker((host, int(port)), worker=args.worker, sizes=[args.elements], job=args.job, secret=secret,
                         precision=wire_precision(args.precisions.split(",")[args.worker]), socket_factory=bound)
    await node.hello(timeout=args.timeout)
    timed = await _timed(node, args, inputs)
    if timed is None:
        return 2
    results, times = timed
    print(json.dumps({**times, "sender_calls": node.frames_sent}), flush=True)
    print(json.dumps({"worker": args.worker, "exact": _exact(args, results)}), flush=True)
    node.close()
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m netstorm.bench.edge_worker", description=__doc__.split("\n")[0])
    parser.add_argument("--worker", type=int, required=True)
    parser.add_argument("--workers", type=int, required=True)
    parser.add_argument("--address", required=True)
    parser.add_argument("--gateway", required=True, help="HOST:PORT of the gateway's agent")
    parser.add_argument("--job", type=int, required=True)
    parser.add_argument("--elements", type=int, required=True)
    parser.add_argument("--iterations", type=int, required=True)
    parser.add_argument("--first", type=int, required=True, help="the first iteration's number")
    parser.add_argument("--scale", type=int, required=True)
    parser.add_argument("--lanes", type=int, required=True)
    parser.add_argument("--pool", type=int, required=True)
    parser.add_argument("--seed", type=int, required=True)
    parser.add_argument("--precisions", required=True, help="every worker's precision, comma-separated")
    parser.add_argument("--transport", choices=("udp", "tcp"), default="udp")
    parser.add_argument("--loss", type=float, default=0.0)
    parser.add_argument("--no-gso", action="store_true",
                        help="separate datagrams (a window per sendmmsg) instead of UDP GSO batches")
    parser.add_argument("--no-gro", action="store_true", help="one datagram per receive instead of UDP_GRO")
    parser.add_argument("--secret-file", default=None)
    parser.add_argument("--timeout", type=float, default=60.0)
    args = parser.parse_args(argv)
    return asyncio.run(work(args, Path(args.secret_file).read_bytes() if args.secret_file else None))


if __name__ == "__main__":
    sys.exit(main())
