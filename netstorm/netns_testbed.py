"""A small namespace testbed: a few network namespaces joined by veth pairs, HTB on each direction.

For measuring the probes against a known shaped rate, not for experiments (the WAN emulator builds
those). Link ``i`` joins nodes ``a`` and ``b`` through interface ``l<i>`` on both sides (namespaces
keep the names apart), addresses ``10.250.<i>.1`` (a) and ``.2`` (b); the egress of each side carries
an HTB class at that direction's rate. Namespace names carry the pid and a counter so parallel runs
never collide; ``close`` (or leaving the ``with`` block) deletes them, which deletes their veths.

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
                    _run("tc", "-n", ns, "qdisc", "add", "dev", dev, "root", "handle", "1:", "htb", "default", "1")
                    rate = spec.rate_ab_mbit if node == spec.a else spec.rate_ba_mbit
                    _run("tc", "-n", ns, "class", "add", "dev", dev, "parent", "1:", "classid", "1:1",
                         "htb", "rate", f"{rate}mbit", "ceil", f"{rate}mbit")
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

    def set_rate(self, link: int, src: int, mbit: float) -> None:
        """Reshape the direction ``src -> other end`` of ``link`` to ``mbit`` Mbit/s, traffic flowing."""
        self.address(link, src)
        _run("tc", "-n", self.names[src], "class", "change", "dev", f"l{link}", "parent", "1:", "classid", "1:1",
             "htb", "rate", f"{mbit}mbit", "ceil", f"{mbit}mbit")

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
