"""A LAN in network namespaces: one gateway and N workers on a bridge, for the edge tier's tests and
benchmark.

Every namespace name carries a per-run prefix (pid and a counter), every interface lives inside those
namespaces (nothing is created in the caller's namespace), and ``close`` deletes them all, also after a
failure. Sockets are opened *inside* a namespace from a short-lived thread that enters it
(``netns.run_in``), so one process and one event loop can drive the gateway and all workers.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import socket
from collections.abc import Callable

from netstorm.emulation import netns
from netstorm.emulation.errors import EmulationError

SUBNET = "10.77.0"
GATEWAY_IP = f"{SUBNET}.1"
_runs = itertools.count()


class Lan:
    """Gateway ``<prefix>g`` (eth0, 10.77.0.1) and workers ``<prefix>w<i>`` (eth0, 10.77.0.10+i) on a
    bridge in ``<prefix>b``. The gateway's veth pair has ``queues`` receive/transmit queues; every link has
    the IPv4 ``mtu``."""

    def __init__(self, workers: int, *, queues: int = 2, mtu: int = 1500) -> None:
        if not 1 <= workers <= 64:
            raise EmulationError(f"a LAN holds 1..64 workers, asked for {workers}")
        self.prefix = f"ns{os.getpid()}x{next(_runs)}"
        self.gateway = f"{self.prefix}g"
        self.bridge = f"{self.prefix}b"
        self.workers = [f"{self.prefix}w{i}" for i in range(workers)]
        self._created: list[str] = []
        try:
            for ns in (self.bridge, self.gateway, *self.workers):
                netns.add_namespace(ns)
                self._created.append(ns)
            q = str(queues)
            lines = ["link add br0 type bridge", "link set br0 up",
                     f"link add g numtxqueues {q} numrxqueues {q} type veth peer name eth0 netns {self.gateway} "
                     f"numtxqueues {q} numrxqueues {q}"]
            lines += [f"link add w{i} type veth peer name eth0 netns {ns}" for i, ns in enumerate(self.workers)]
            lines += [f"link set {end} master br0 up" for end in ("g", *(f"w{i}" for i in range(workers)))]
            if mtu != 1500:
                lines += [f"link set {end} mtu {mtu}" for end in ("br0", "g", *(f"w{i}" for i in range(workers)))]
            netns.ip_batch(lines, namespace=self.bridge, what=f"build the LAN bridge {self.bridge}")
            for ns, address in ((self.gateway, GATEWAY_IP),
                                *((ns, self.worker_ip(i)) for i, ns in enumerate(self.workers))):
                netns.ip_batch([f"addr add {address}/24 dev eth0", f"link set eth0 mtu {mtu}", "link set eth0 up",
                                "link set lo up"], namespace=ns, what=f"address {ns}")
        except BaseException:
            self.close()
            raise

    @staticmethod
    def worker_ip(i: int) -> str:
        return f"{SUBNET}.{10 + i}"

    def udp_socket(self, ns: str, host: str, port: int = 0, *, rcvbuf: int = 4 << 20) -> socket.socket:
        """A non-blocking UDP socket bound to (host, port) inside ``ns``."""

        def make() -> socket.socket:
            sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
            sock.bind((host, port))
            sock.setblocking(False)
            return sock

        return netns.run_in(ns, make)

    def group_opener(self, ns: str) -> Callable[[tuple[str, int], str], socket.socket]:
        """Opens a LAN worker's multicast group socket inside ``ns`` (netstorm/lan/sender.py's
        ``group_opener``: this process drives every namespace from one thread)."""
        from netstorm.lan.sender import group_socket

        return lambda group, local: netns.run_in(ns, lambda: group_socket(group, local))

    def gateway_ifindex(self) -> int:
        return netns.run_in(self.gateway, lambda: socket.if_nametoindex("eth0"))

    def close(self) -> None:
        for ns in reversed(self._created):
            with contextlib.suppress(EmulationError):  # best effort: the others still go
                netns.delete_namespace(ns)
        self._created.clear()

    def __enter__(self) -> Lan:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
