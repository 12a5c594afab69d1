"""Registration, heartbeats and liveness of the job's nodes, as a sans-I/O core with an injected clock.

The expected node ids are fixed when the job starts (the scenario's DCs or ``--nodes``). A node
registers once with its data-plane address and how many workers its contributions sum (its own trainer
and its gateway's LAN workers: what an average divides by); when the last expected node has registered the membership
is complete and every node learns the full member list. From then on each node must heartbeat at
least every ``heartbeat_timeout`` seconds; a silent node, or one whose control connection drops, is
declared dead once, and the shell tells every survivor and re-plans without it. A node that drops
before the membership is complete is simply unregistered, so a restarted process can register again.

DCs come back: once the job runs, a restarted DC (or, with ``allow_joiners``, a DC the job did not
expect) registers with ``rejoin`` and waits, pending, until the shell ``admit``s it at an iteration
boundary; a node that kept running while it lost the scheduler ``attach``es again. A restarted scheduler
``restore``s the members it had persisted (``rows``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

from netstorm.errors import NetStormError


def control_address(address: tuple[str, int]) -> str:
    return f"{address[0]}:{address[1]}"


class MembershipError(NetStormError):
    """A registration or heartbeat is refused (unknown id, duplicate id, dead node)."""


@dataclasses.dataclass(frozen=True)
class Down:
    """A member was declared dead."""

    node_id: int
    reason: str
    left: bool = False
    """It said it was leaving (a planned stop, not a failure)."""
    pending: bool = False
    """It had registered into the running job but was not admitted yet (no policy names it)."""


@dataclasses.dataclass(frozen=True)
class Row:
    """One DC as the scheduler persists it."""

    node_id: int
    host: str
    port: int
    workers: int
    dead: str | None
    """Why it was declared dead; None while it is a live member."""


class Membership:
    def __init__(self, expected: Iterable[int], *, heartbeat_timeout: float, allow_joiners: bool = False) -> None:
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
        self._pending: dict[int, tuple[tuple[str, int], int]] = {}
        """Registered into the running job, not admitted yet: node -> (address, workers)."""
        self._pending_seen: dict[int, float] = {}
        self.allow_joiners = allow_joiners
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

    @property
    def pending(self) -> tuple[int, ...]:
        """DCs registered into the running job and waiting for admission."""
        return tuple(sorted(self._pending))

    def candidate(self, node_id: int) -> tuple[tuple[str, int], int]:
        """A pending DC's data address and workers."""
        return self._pending[node_id]

    def rejoin(self, node_id: int, address: tuple[str, int], now: float, *, workers: int = 1) -> Down | None:
        """A new process registers as ``node_id`` into the running job: it is pending until ``admit``.

        A restarted expected DC is always taken; another id only with ``allow_joiners``. If the job still
        counts ``node_id`` alive (its old process died while nobody noticed, e.g. while the scheduler was
        away), that incarnation is declared dead first and its ``Down`` returned."""
        if workers < 1:
            raise MembershipError(f"node {node_id} registers {workers} workers; a DC has at least its own trainer")
        if not self.complete:
            raise MembershipError(f"node {node_id} rejoins before the job has started")
        if node_id not in self.expected and not self.allow_joiners and node_id not in self._addresses:
            raise MembershipError(
                f"unknown node id {node_id}: this job expects nodes {', '.join(map(str, self.expected))} and "
                "admits no other DCs (allow_joiners is off)")
        if node_id in self._pending:
            raise MembershipError(f"duplicate node id {node_id}: already waiting for admission from "
                                  f"{control_address(self._pending[node_id][0])}")
        prior = None
        if node_id in self._addresses and node_id not in self._dead:
            prior = self._declare(node_id, "a new process registered with its id")
        self._pending[node_id] = (address, workers)
        self._pending_seen[node_id] = now
        return prior

    def admit(self, node_id: int, now: float) -> None:
        """A pending DC becomes a live member (the shell binds its boundary iteration)."""
        if node_id not in self._pending:
            raise MembershipError(f"node {node_id} is not waiting for admission")
        address, workers = self._pending.pop(node_id)
        del self._pending_seen[node_id]
        self._dead.pop(node_id, None)
        self._addresses[node_id] = address
        self._workers[node_id] = workers
        self._last_seen[node_id] = now

    def attach(self, node_id: int, now: float) -> None:
        """A live member that kept running re-attaches (after the scheduler restarted, or its connection
        broke); one declared dead meanwhile must restart and rejoin."""
        if node_id in self._dead:
            raise MembershipError(f"node {node_id} was declared dead ({self._dead[node_id]}); restart it to rejoin")
        if node_id not in self._addresses or not self.complete:
            raise MembershipError(f"node {node_id} re-attaches but is not a member of the running job")
        self._last_seen[node_id] = max(self._last_seen[node_id], now)

    def rows(self) -> list[Row]:
        """Every DC that was admitted, alive or dead (what the scheduler persists)."""
        return [Row(n, self._addresses[n][0], self._addresses[n][1], self._workers[n], self._dead.get(n))
                for n in sorted(self._addresses)]

    def restore(self, rows: Iterable[Row], *, complete: bool, now: float) -> None:
        """A restarted scheduler's persisted members: live ones have ``heartbeat_timeout`` from ``now`` to
        re-attach."""
        for row in rows:
            self._addresses[row.node_id] = (row.host, row.port)
            self._workers[row.node_id] = row.workers
            self._last_seen[row.node_id] = now
            if row.dead is not None:
                self._dead[row.node_id] = row.dead
        self.complete = complete

    def heartbeat(self, node_id: int, now: float) -> None:
        if node_id in self._pending:
            self._pending_seen[node_id] = max(self._pending_seen[node_id], now)
            return
        if node_id not in self._addresses:
            raise MembershipError(f"heartbeat from node {node_id}, which has not registered")
        if node_id in self._dead:
            raise MembershipError(f"heartbeat from node {node_id}, which was declared dead ({self._dead[node_id]})")
        self._last_seen[node_id] = max(self._last_seen[node_id], now)

    def disconnected(self, node_id: int, now: float, *, leaving: str | None = None) -> Down | None:
        """The node's control connection closed (after a ``Leave`` saying ``leaving``, if it sent one):
        unregister it before completion, declare it gone after."""
        if node_id in self._pending:
            return self._drop_pending(node_id, "its control connection closed before it was admitted")
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
        out = [self._drop_pending(n, f"no heartbeat for {now - seen:.1f} s before its admission")
               for n, seen in list(self._pending_seen.items()) if now - seen > self._timeout]
        for node_id in self.alive:
            silence = now - self._last_seen[node_id]
            if silence > self._timeout:
                out.append(self._declare(node_id, f"no heartbeat for {silence:.1f} s (timeout {self._timeout} s)"))
        return out

    def next_deadline(self) -> float | None:
        """When the next ``check`` could declare someone dead (for the shell's timer)."""
        seen = [self._last_seen[n] for n in self.alive] + list(self._pending_seen.values())
        if not self.complete or not seen:
            return None
        return min(seen) + self._timeout

    def _drop_pending(self, node_id: int, reason: str) -> Down:
        del self._pending[node_id]
        del self._pending_seen[node_id]
        return Down(node_id, reason, pending=True)

    def _declare(self, node_id: int, reason: str) -> Down:
        self._dead[node_id] = reason
        return Down(node_id, reason)
