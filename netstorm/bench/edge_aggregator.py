"""One cluster aggregator of the edge benchmark's two-level LAN, as a process in its worker's namespace.

``python -m netstorm.bench.edge_aggregator --worker I --address IP --gateway HOST:PORT --job J --mode M``

A cluster aggregator loads its XDP program onto its own interfaces and reads their link-layer addresses
from /sys, which shows the namespace of the process that mounted it: so it runs as its own process
started with ``ip netns exec`` (which mounts /sys for the namespace), as a LAN worker's host would run it.
It says HELLO to the gateway as the cluster's aggregator, loads and attaches its program (or the
userspace fallback), prints one JSON line ``{"ready": ...}`` and serves until its stdin closes.

Its program attaches to the LAN interface in generic mode by default (``--attach``): on a veth, a native
program's XDP_TX frames (the forwarded aggregates) are dropped unless the bridge-side peer runs NAPI, so in
native mode nearly every aggregate a member's datagram completed was lost and came back only as a
re-emission (on lan-runtime-3 DC 1 at 100 k elements: 1,674 re-emissions for 1,686 completed slots).
A physical NIC has no such peer.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import sys
from collections.abc import Sequence
from pathlib import Path


async def serve(args: argparse.Namespace, secret: bytes | None) -> int:
    from bpf.cluster import ClusterAggregator

    host, _, port = args.gateway.rpartition(":")
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 16 << 20)
    sock.bind((args.address, int(port)))
    sock.setblocking(False)
    agg = ClusterAggregator(sock, (host, int(port)), worker=args.worker, job=args.job, interface=args.interface,
                            mode=args.mode, secret=secret, attach=args.attach)
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    try:
        deployment = await agg.start(timeout=args.timeout)
        print(json.dumps({"ready": True, "members": list(deployment.members), "attached": agg.attached}),
              flush=True)
        loop.add_reader(sys.stdin.fileno(), lambda: stop.set() if not sys.stdin.readline() else None)
        async with asyncio.TaskGroup() as tg:
            serving = tg.create_task(agg.run())
            await stop.wait()
            agg.close()
            await serving
    finally:
        agg.close()
    print(json.dumps({"stats": agg.stats()}), flush=True)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m netstorm.bench.edge_aggregator",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--worker", type=int, required=True)
    parser.add_argument("--address", required=True, help="this worker's LAN address")
    parser.add_argument("--gateway", required=True, help="HOST:PORT of the gateway's agent")
    parser.add_argument("--job", type=int, required=True)
    parser.add_argument("--mode", choices=("xdp", "userspace"), required=True)
    parser.add_argument("--interface", default="eth0")
    parser.add_argument("--secret-file", default=None)
    parser.add_argument("--timeout", type=float, default=60.0)
    parser.add_argument("--attach", choices=("auto", "native", "generic"), default="generic",
                        help="XDP mode on the LAN interface (generic: a veth drops a native program's XDP_TX frames "
                             "unless its peer runs NAPI)")
    args = parser.parse_args(argv)
    return asyncio.run(serve(args, Path(args.secret_file).read_bytes() if args.secret_file else None))


if __name__ == "__main__":
    sys.exit(main())
