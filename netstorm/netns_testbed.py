"""A small namespace testbed: a few network namespaces joined by veth pairs, HTB on each direction.

For measuring the probes against a known shaped rate, not for experiments (the WAN emulator builds
those). Link ``i`` joins nodes ``a`` and ``b`` through interface ``l<i>`` on both sides (namespaces
keep the names apart), addresses ``10.250.<i>.1`` (a) and ``.2`` (b); each node also has its own
address ``10.251.0.<node+1>`` that its neighbours reach over their link. The egress of each side
carries HTB at that direction's rate, with pure TCP ACKs ahead of data (see ``_shape``). Namespace
names carry the pid and a counter so parallel runs never collide; ``close`` (or leaving the ``with``
block) deletes them, which deletes their veths.

Code runs "inside" a namespace through threads: ``setns(2)`` moves only the calling thread, and every
thread (and socket) it creates after that lives in the namespace too. ``run_in`` gives each side its
own thread and event loop, like a process on its own host, with results handed back as futures.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import ctypes
import dataclasses
import itertools
import os
import shutil
import subprocess
import threading
from collections.abc import Callable, Coroutine, Sequence
from typing import Any, TypeVar

from netstorm.errors import NetStormError

CLONE_NEWNET = 0x40000000
NETNS_DIR = "/run/netns"
_counter = itertools.count()
_libc = ctypes.CDLL(None, use_errno=True)

T = TypeVar("T")


class TestbedError(NetStormError):
    """A namespace, link or shaping command failed; the message has the command and its output."""


@dataclasses.dataclass(frozen=True)
class LinkSpec:
    """An undirected link between nodes ``a`` and ``b`` with a rate per direction (Mbit/s)."""

    a: int
    b: int
    rate_ab_mbit: float
    rate_ba_mbit: float


def available() -> str | None:
    """None when this host can build a testbed, else why not."""
    if os.geteuid() != 0:
        return "needs root (network namespaces and tc)"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"needs the {tool!r} command (iproute2)"
    return None


def _run(*cmd: str) -> None:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=30, check=False)
    if proc.returncode != 0:
        raise TestbedError(f"{' '.join(cmd)} failed ({proc.returncode}): {proc.stderr.strip()}")


def enter_netns(name: str) -> None:
    """Move the calling thread into namespace ``name``."""
    fd = os.open(os.path.join(NETNS_DIR, name), os.O_RDONLY)
    try:
        if _libc.setns(fd, CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise TestbedError(f"setns into {name}: {os.strerror(err)}")
    finally:
        os.close(fd)


ACK_SHARE = 0.05
"""Guaranteed share of a link for pure TCP ACKs; the rest (and whatever ACKs leave) carries data."""
ACK_FILTER = ("match", "ip", "protocol", "6", "0xff",   # TCP
              "match", "u8", "0x05", "0x0f", "at", "0",  # IP header without options
              "match", "u16", "0x0000", "0xffc0", "at", "2",  # total length below 64 bytes
              "match", "u8", "0x10", "0xff", "at", "33")  # flags: ACK alone


def _shape(ns: str, dev: str, mbit: float, *, add: bool) -> None:
    """HTB at ``mbit`` on ``dev``'s egress: class 1:1 caps the link; pure ACKs (1:10) go before data (1:20).

    Without the ACK class, the ACKs of the opposite direction's flow wait behind up to a TCP send
    window of this direction's data in the HTB queue, and the opposite flow (correctly measured) runs
    slower than its own shaping: real bidirectional bufferbloat, but not what these tests measure.
    """
    verb = "add" if add else "change"
    ack = max(mbit * ACK_SHARE, 0.1)
    if add:
        _run("tc", "-n", ns, "qdisc", "add", "dev", dev, "root", "handle", "1:", "htb", "default", "20")
    _run("tc", "-n", ns, "class", verb, "dev", dev, "parent", "1:", "classid", "1:1",
         "htb", "rate", f"{mbit}mbit", "ceil", f"{mbit}mbit")
    _run("tc", "-n", ns, "class", verb, "dev", dev, "parent", "1:1", "classid", "1:10",
         "htb", "rate", f"{ack}mbit", "ceil", f"{mbit}mbit", "prio", "0")
    _run("tc", "-n", ns, "class", verb, "dev", dev, "parent", "1:1", "classid", "1:20",
         "htb", "rate", f"{mbit - ack}mbit", "ceil", f"{mbit}mbit", "prio", "1")
    if add:
        _run("tc", "-n", ns, "filter", "add", "dev", dev, "parent", "1:", "protocol", "ip", "prio", "1",
             "u32", *ACK_FILTER, "flowid", "1:10")


class Testbed:
    """Namespaces ``0..nodes-1`` and shaped veth links between them; a context manager."""

    __test__ = False  # not a pytest test class, despite the name

    def __init__(self, nodes: int, links: Sequence[LinkSpec]) -> None:
        if nodes < 2:
            raise ValueError(f"a testbed needs at least two nodes, got {nodes}")
        for spec in links:
            if not (0 <= spec.a < nodes and 0 <= spec.b < nodes and spec.a != spec.b):
                raise ValueError(f"link {spec} must join two distinct nodes of 0..{nodes - 1}")
        self.prefix = f"nsaw{os.getpid()}x{next(_counter)}"
        self.names = [f"{self.prefix}-{i}" for i in range(nodes)]
        self.links = list(links)
        self._created: list[str] = []
        try:
            for name in self.names:
                _run("ip", "netns", "add", name)
                self._created.append(name)
                _run("ip", "-n", name, "link", "set", "lo", "up")
            for i, spec in enumerate(self.links):
                dev = f"l{i}"
                _run("ip", "link", "add", f"{self.prefix}a{i}", "netns", self.names[spec.a], "type", "veth",
                     "peer", "name", f"{self.prefix}b{i}", "netns", self.names[spec.b])
                for end, node in (("a", spec.a), ("b", spec.b)):
                    ns = self.names[node]
                    _run("ip", "-n", ns, "link", "set", f"{self.prefix}{end}{i}", "name", dev)
                    _run("ip", "-n", ns, "addr", "add", f"{self.address(i, node)}/24", "dev", dev)
                    _run("ip", "-n", ns, "link", "set", dev, "up")
                    rate = spec.rate_ab_mbit if node == spec.a else spec.rate_ba_mbit
                    _shape(ns, dev, rate, add=True)
            for node, name in enumerate(self.names):
                _run("ip", "-n", name, "addr", "add", f"{self.node_address(node)}/32", "dev", "lo")
            for i, spec in enumerate(self.links):
                for here, there in ((spec.a, spec.b), (spec.b, spec.a)):
                    _run("ip", "-n", self.names[here], "route", "add", f"{self.node_address(there)}/32",
                         "via", self.address(i, there))
        except BaseException:
            self.close()
            raise

    def __enter__(self) -> Testbed:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Delete every namespace this testbed created (their veths go with them)."""
        while self._created:
            name = self._created.pop()
            subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=30, check=False)

    def address(self, link: int, node: int) -> str:
        """Node ``node``'s address on link ``link``."""
        spec = self.links[link]
        if node not in (spec.a, spec.b):
            raise ValueError(f"node {node} is not on link {link} ({spec.a}-{spec.b})")
        return f"10.250.{link}.{1 if node == spec.a else 2}"

    def node_address(self, node: int) -> str:
        """Node ``node``'s own address (on its loopback), routed over the direct link from each neighbour.

        The first link listed between two nodes carries their traffic; nodes without a direct link
        cannot reach each other (no multi-hop routing here)."""
        return f"10.251.0.{node + 1}"

    def set_rate(self, link: int, src: int, mbit: float) -> None:
        """Reshape the direction ``src -> other end`` of ``link`` to ``mbit`` Mbit/s, traffic flowing."""
        self.address(link, src)
        _shape(self.names[src], f"l{link}", mbit, add=False)

    def run_in(self, node: int, main: Callable[[], Coroutine[Any, Any, T]]) -> concurrent.futures.Future[T]:
        """Run ``asyncio.run(main())`` on a new thread inside node ``node``'s namespace."""
        future: concurrent.futures.Future[T] = concurrent.futures.Future()
        name = self.names[node]

        def target() -> None:
            try:
                enter_netns(name)
                future.set_result(asyncio.run(main()))
            except BaseException as exc:
                future.set_exception(exc)

        threading.Thread(target=target, name=f"netns-{name}", daemon=True).start()
        return future
