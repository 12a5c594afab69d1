"""A small namespace testbed: a few network namespaces joined by veth pairs, each direction shaped by the
emulator's HTB shaper.

For measuring the probes against a known shaped rate, not for experiments (``EmulatedNetwork`` builds
those from a scenario). Link ``i`` joins nodes ``a`` and ``b`` through interface ``l<i>`` on both sides
(namespaces keep the names apart), addresses ``10.250.<i>.1`` (a) and ``.2`` (b); each node also has its
own address ``10.251.0.<node+1>`` that its neighbours reach over their link. The egress of each side
carries exactly what the emulator puts on an emulated WAN link (``shaping``: HTB at that direction's rate,
pure TCP ACKs ahead of data, wire-sized segments), so the probes are measured against the shaper the
emulation results come from. Namespace names carry the pid and a counter so parallel runs never collide;
``close`` (or leaving the ``with`` block) deletes them, which deletes their veths.

Code runs "inside" a namespace through threads (``netns.run_async_in``): each side gets its own thread
and event loop, like a process on its own host, with results handed back as futures.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import itertools
import os
from collections.abc import Callable, Coroutine, Sequence
from typing import Any, TypeVar

from netstorm.emulation import netns, shaping
from netstorm.emulation.errors import EmulationError

_counter = itertools.count()
T = TypeVar("T")


@dataclasses.dataclass(frozen=True)
class LinkSpec:
    """An undirected link between nodes ``a`` and ``b`` with a rate per direction (Mbit/s)."""

    a: int
    b: int
    rate_ab_mbit: float
    rate_ba_mbit: float


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
                netns.add_namespace(name)
                self._created.append(name)
            netns.ip_batch([f"link add {self.prefix}a{i} netns {self.names[spec.a]} type veth "
                            f"peer name {self.prefix}b{i} netns {self.names[spec.b]}"
                            for i, spec in enumerate(self.links)], what="create the testbed's veth pairs")
            ip: dict[str, list[str]] = {name: ["link set lo up"] for name in self.names}
            tc: dict[str, list[str]] = {name: [] for name in self.names}
            for i, spec in enumerate(self.links):
                dev = f"l{i}"
                for end, node in (("a", spec.a), ("b", spec.b)):
                    ns = self.names[node]
                    ip[ns] += [f"link set {self.prefix}{end}{i} name {dev}",
                               f"addr add {self.address(i, node)}/24 dev {dev}",
                               f"link set dev {dev} gso_max_size {shaping.GSO_MAX_SIZE}",
                               f"link set {dev} up"]
                    tc[ns] += shaping.setup_lines(dev, spec.rate_ab_mbit if node == spec.a else spec.rate_ba_mbit)
            for node, name in enumerate(self.names):
                ip[name].append(f"addr add {self.node_address(node)}/32 dev lo")
            for i, spec in enumerate(self.links):
                for here, there in ((spec.a, spec.b), (spec.b, spec.a)):
                    ip[self.names[here]].append(f"route add {self.node_address(there)}/32 via {self.address(i, there)}")
            for name in self.names:
                netns.ip_batch(ip[name], namespace=name, what=f"address and route {name}")
                netns.tc_batch(tc[name], namespace=name, what=f"shape the links of {name}")
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
            with contextlib.suppress(EmulationError):  # best effort: the others still go
                netns.delete_namespace(self._created.pop())

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
        netns.tc_batch(shaping.change_lines(f"l{link}", mbit), namespace=self.names[src],
                       what=f"re-shape link {link} from node {src}")

    def run_in(self, node: int, main: Callable[[], Coroutine[Any, Any, T]]) -> concurrent.futures.Future[T]:
        """Run ``asyncio.run(main())`` on a new thread inside node ``node``'s namespace."""
        return netns.run_async_in(self.names[node], main)
