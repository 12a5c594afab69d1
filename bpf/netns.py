"""A LAN in network namespaces: one gateway and N workers on a bridge, for tests and the edge benchmark.

Every namespace name carries a per-run prefix (pid and a counter), every interface lives inside those
namespaces (nothing is created in the caller's namespace), and ``close`` deletes them all, also after a
failure. Sockets are opened *inside* a namespace from a short-lived thread that enters it with setns(2),
so one process and one event loop can drive the gateway and all workers.
"""

from __future__ import annotations

import ctypes
import itertools
import os
import socket
import subprocess
import threading
from collections.abc import Callable
from typing import TypeVar

from netstorm.errors import NetStormError

CLONE_NEWNET = 0x40000000
SUBNET = "10.77.0"
GATEWAY_IP = f"{SUBNET}.1"
_runs = itertools.count()
T = TypeVar("T")


class NetnsError(NetStormError):
    """Creating or entering a namespace failed; the message names the command and its output."""


def _ip(*args: str) -> None:
    proc = subprocess.run(["ip", *args], capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise NetnsError(f"ip {' '.join(args)}: {proc.stderr.strip() or proc.stdout.strip()}")


def run_in(ns: str, fn: Callable[[], T]) -> T:
    """Run ``fn`` in a thread that has entered network namespace ``ns``; returns its result."""
    libc = ctypes.CDLL(None, use_errno=True)
    box: dict[str, object] = {}

    def body() -> None:
        try:
            fd = os.open(f"/run/netns/{ns}", os.O_RDONLY)
            try:
                if libc.setns(fd, CLONE_NEWNET) != 0:
                    raise NetnsError(f"setns into {ns}: {os.strerror(ctypes.get_errno())}")
            finally:
                os.close(fd)
            box["value"] = fn()
        except BaseException as exc:
            box["error"] = exc

    thread = threading.Thread(target=body, name=f"netns-{ns}")
    thread.start()
    thread.join()
    if "error" in box:
        raise box["error"]  # type: ignore[misc]
    return box["value"]  # type: ignore[return-value]


class Lan:
    """Gateway ``<prefix>g`` (eth0, 10.77.0.1) and workers ``<prefix>w<i>`` (eth0, 10.77.0.10+i) on a
    bridge in ``<prefix>b``. The gateway's veth pair has ``queues`` receive/transmit queues."""

    def __init__(self, workers: int, *, queues: int = 2) -> None:
        if not 1 <= workers <= 64:
            raise NetnsError(f"a LAN holds 1..64 workers, asked for {workers}")
        self.prefix = f"ns{os.getpid()}x{next(_runs)}"
        self.gateway = f"{self.prefix}g"
        self.bridge = f"{self.prefix}b"
        self.workers = [f"{self.prefix}w{i}" for i in range(workers)]
        self._created: list[str] = []
        try:
            for ns in (self.bridge, self.gateway, *self.workers):
                _ip("netns", "add", ns)
                self._created.append(ns)
            b = self.bridge
            _ip("-n", b, "link", "add", "br0", "type", "bridge")
            _ip("-n", b, "link", "set", "br0", "up")
            q = str(queues)
            _ip("-n", b, "link", "add", "g", "numtxqueues", q, "numrxqueues", q, "type", "veth", "peer", "name",
                "eth0", "netns", self.gateway, "numtxqueues", q, "numrxqueues", q)
            self._plug("g", self.gateway, GATEWAY_IP)
            for i, ns in enumerate(self.workers):
                _ip("-n", b, "link", "add", f"w{i}", "type", "veth", "peer", "name", "eth0", "netns", ns)
                self._plug(f"w{i}", ns, self.worker_ip(i))
        except BaseException:
            self.close()
            raise

    def _plug(self, bridge_end: str, ns: str, address: str) -> None:
        _ip("-n", self.bridge, "link", "set", bridge_end, "master", "br0", "up")
        _ip("-n", ns, "addr", "add", f"{address}/24", "dev", "eth0")
        _ip("-n", ns, "link", "set", "eth0", "up")
        _ip("-n", ns, "link", "set", "lo", "up")

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

        return run_in(ns, make)

    def gateway_ifindex(self) -> int:
        return run_in(self.gateway, lambda: socket.if_nametoindex("eth0"))

    def close(self) -> None:
        for ns in reversed(self._created):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, check=False)
        self._created.clear()

    def __enter__(self) -> Lan:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
