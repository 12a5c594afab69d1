"""``netstorm lan-aggregator``: a LAN worker's host aggregating its cluster (two-level LAN, ALEPH).

The gateway names the cluster (``edge_clusters`` at the gateway's node, or the scheduler's plan): this
command says HELLO to the gateway as worker ``--worker``, learns its members, pool, lanes and multicast
group, loads the XDP program on ``--interface`` (and the loopback device, for the host's own trainer) and
serves until stopped. The host's trainer then connects as usual (``edge://GATEWAY:PORT?worker=I``): the
gateway's answer tells it to send here. Where the worker aggregates no cluster the service stands by, and
takes the part a later deployment gives it (a re-plan while the job runs, netstorm/lan/redeploy.py).
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import socket

from netstorm import config as config_mod
from netstorm.control import parse_address

NAME = "lan-aggregator"
HELP = "aggregate this host's LAN cluster for a DC gateway (two-level LAN; XDP or userspace)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--gateway", required=True, metavar="HOST:PORT", help="the gateway's LAN address (UDP)")
    parser.add_argument("--worker", type=int, required=True, help="this host's LAN worker id (the aggregator's)")
    parser.add_argument("--listen", required=True, metavar="IP",
                        help="this host's LAN address (members send to IP and the gateway's port)")
    parser.add_argument("--interface", required=True, metavar="IFACE", help="the LAN-facing interface")
    parser.add_argument("--mode", choices=("xdp", "userspace"), default="xdp", help="aggregate in XDP or userspace")
    parser.add_argument("--job", type=int, default=1, help="the job id on the LAN (default 1)")
    parser.add_argument("--attach", choices=("auto", "native", "generic"), default="auto",
                        help="XDP mode on IFACE (auto: native where the driver has it; generic on a veth, which "
                             "drops a native program's XDP_TX frames unless its peer runs NAPI)")
    config_mod.add_arguments(parser, ("Trust", "Operations", "LAN tier"))


def run(args: argparse.Namespace) -> int:
    from netstorm.commands.node import edge_secret

    config = config_mod.from_args(args)
    gateway = parse_address(args.gateway, "--gateway")
    return asyncio.run(serve(gateway, args.worker, args.listen, args.interface, args.mode, args.job,
                             edge_secret(config), attach=args.attach))


async def serve(gateway: tuple[str, int], worker: int, listen: str, interface: str, mode: str, job: int,
                secret: bytes | None, *, attach: str = "auto") -> int:
    from bpf.cluster import ClusterAggregator

    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    # a cluster's members push their chunks at once, as they do at the gateway (same buffer as there)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 8 << 20)
    sock.bind((listen, gateway[1]))
    sock.setblocking(False)
    cluster = ClusterAggregator(sock, gateway, worker=worker, job=job, interface=interface, mode=mode,
                                secret=secret, attach=attach)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, cluster.close)
    try:
        deployment = await cluster.start(timeout=60.0)
        what = "stands by (aggregates no cluster until a deployment names it)" if deployment.standby else \
            f"aggregates workers {sorted(deployment.members)} and itself"
        print(f"lan aggregator: worker {worker} {what} for gateway {gateway[0]}:{gateway[1]} ({mode}, "
              f"{' and '.join(cluster.attached) or 'socket'})", flush=True)
        await cluster.run()
    finally:
        cluster.close()
        sock.close()
    return 0
