"""Registration, heartbeats and liveness of the job's nodes, as a sans-I/O core with an injected clock.

The expected node ids are fixed when the job starts (the scenario's DCs or ``--nodes``). A node
registers once with its data-plane address and how many workers its contributions sum (its own trainer
and its gateway's LAN workers: what an average divides by); when the last expected node has registered the membership
is complete and every node learns the full member list. From then on each node must heartbeat at
least every ``heartbeat_timeout`` seconds; a silent node, or one whose control connection drops, is
declared dead once, and the shell tells every survivor and re-plans without it. A node that drops
before the membership is complete is simply unregistered, so a restarted process can register again.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

from netstorm.errors import NetStormError


class MembershipError(NetStormError):
    """A registration or heartbeat is refused (unknown id, duplicate id, dead node)."""


@dataclasses.dataclass(frozen=True)
class Down:
    """A member was declared dead."""

    node_id: int
    reason: str
    left: bool = False
    """It said it was leaving (a planned stop, not a failure)."""


class Membership:
    def __init__(self, expected: Iterable[int], *, heartbeat_timeout: float) -> None:
        self.expected: tuple[int, ...] = tuple(sorted(set(expected)))
        if not self.expected:
            raise MembershipError("a job needs at least one expected node")
        if heartbeat_timeout <= 0:
            raise MembershipError(f"heartbeat_timeout must be positive, got {heartbeat_timeout}")
        self._timeout = heartbeat_timeout
        self._addresses: dict[int, tuple[str, int]] = {}
        self._workers: dict[int, int] = {}
        self._last_seen: dict[int, float] = {}
        self._dead: dict[int, str] = {}
        self.complete = False

    @property
    def registered(self) -> tuple[int, ...]:
        return tuple(sorted(self._addresses))

    @property
    def alive(self) -> tuple[int, ...]:
        return tuple(n for n in sorted(self._addresses) if n not in self._dead)

    @property
    def dead(self) -> dict[int, str]:
        return dict(self._dead)

    def members(self) -> dict[int, tuple[str, int]]:
        """Live members and their data-plane addresses."""
        return {n: self._addresses[n] for n in self.alive}

    def workers(self) -> dict[int, int]:
        """Live members and the workers each one's contribution sums."""
        return {n: self._workers[n] for n in self.alive}

    def register(self, node_id: int, address: tuple[str, int], now: float, *, workers: int = 1) -> bool:
        """Record a registration; True when it completes the membership."""
        if workers < 1:
            raise MembershipError(f"node {node_id} registers {workers} workers; a DC has at least its own trainer")
        if node_id not in self.expected:
            raise MembershipError(
                f"unknown node id {node_id}: this job expects nodes {', '.join(map(str, self.expected))}")
        if node_id in self._dead:
            raise MembershipError(f"node {node_id} was declared dead ({self._dead[node_id]}); restart the job")
        if node_id in self._addresses:
            raise MembershipError(f"duplicate node id {node_id}: already registered from "
                                  f"{self._addresses[node_id][0]}:{self._addresses[node_id][1]}")
        if self.complete:
            raise MembershipError(f"node {node_id} registers after the membership was complete")
        self._addresses[node_id] = address
        self._workers[node_id] = workers
        self._last_seen[node_id] = now
        if len(self._addresses) == len(self.expected):
            self.complete = True
            for n in self._addresses:
                self._last_seen[n] = now  # liveness is judged from completion on
            return True
        return False

    def heartbeat(self, node_id: int, now: float) -> None:
        if node_id not in self._addresses:
            raise MembershipError(f"heartbeat from node {node_id}, which has not registered")
        if node_id in self._dead:
            raise MembershipError(f"heartbeat from node {node_id}, which was declared dead ({self._dead[node_id]})")
        self._last_seen[node_id] = max(self._last_seen[node_id], now)

    def disconnected(self, node_id: int, now: float, *, leaving: str | None = None) -> Down | None:
        """The node's control connection closed (after a ``Leave`` saying ``leaving``, if it sent one):
        unregister it before completion, declare it gone after."""
        if node_id not in self._addresses or node_id in self._dead:
            return None
        if not self.complete:
            del self._addresses[node_id]
            del self._workers[node_id]
            del self._last_seen[node_id]
            return None
        if leaving is not None:
            return dataclasses.replace(self._declare(node_id, f"it left ({leaving})"), left=True)
        return self._declare(node_id, "its control connection to the scheduler closed")

    def check(self, now: float) -> list[Down]:
        """Declare every live member silent for longer than heartbeat_timeout dead (once each)."""
        if not self.complete:
            return []
        out = []
        for node_id in self.alive:
            silence = now - self._last_seen[node_id]
            if silence > self._timeout:
                out.append(self._declare(node_id, f"no heartbeat for {silence:.1f} s (timeout {self._timeout} s)"))
        return out

    def next_deadline(self) -> float | None:
        """When the next ``check`` could declare someone dead (for the shell's timer)."""
        if not self.complete or not self.alive:
            return None
        return min(self._last_seen[n] for n in self.alive) + self._timeout

    def _declare(self, node_id: int, reason: str) -> Down:
        self._dead[node_id] = reason
        return Down(node_id, reason)
