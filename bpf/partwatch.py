"""One iteration's LAN sums as the node takes them part by part: which parts of each tensor are ready and
not handed yet, and what each hands the node (its LAN sum, plus the gateway trainer's own values there).

``PartWatch`` is a sans-I/O core: it is fed the LAN chunks that completed (the agent's completion hook,
through ``PartReadiness``) and the clock at each hand-out, and answers with the tensors that got a part
ready and the parts to hand. Its asyncio shell (bpf/parthandout.py) wakes the node's waiters.

See docs/ARCHITECTURE.md, *The LAN tier*."""

from __future__ import annotations

import numpy as np

from bpf.agent import IterationSums
from bpf.lanparts import PartReadiness
from bpf.tcpagent import TcpPartial


class PartWatch:
    """Tensor by tensor, the parts of one iteration whose LAN chunks all completed, in completion order."""

    def __init__(self, sums: IterationSums | TcpPartial) -> None:
        """``sums``: the iteration's LAN sums as they grow (what completed before is read from their mask)."""
        self.sums = sums
        self.readiness = PartReadiness(sums.layout, ~sums.open)
        self.pending: dict[int, list[int]] = {}
        """tensor -> its parts ready and not handed yet."""
        self.handed = 0
        self.first_handed: float | None = None
        """When the node was handed the iteration's first part (the phase log's figure)."""

    def completed(self, seqs: np.ndarray) -> set[int]:
        """LAN chunks ``seqs`` completed: the tensors that got a part ready (their waiters are woken)."""
        woken = set()
        for tensor, part in self.readiness.completed(seqs):
            self.pending.setdefault(tensor, []).append(part)
            woken.add(tensor)
        return woken

    def follow(self, tensor: int, parts: list[tuple[int, int]]) -> None:
        """The node takes ``tensor`` in ``parts`` (``(start, stop)`` elements, in order, covering it)."""
        self.pending.setdefault(tensor, []).extend(self.readiness.watch(tensor, parts))

    def ready(self, tensor: int) -> bool:
        """Whether a part of ``tensor`` is ready and not handed yet."""
        return bool(self.pending.get(tensor))

    def next_part(self, tensor: int) -> int | None:
        """The first ready part of ``tensor`` not handed yet, taken (None: none is ready)."""
        ready = self.pending.get(tensor)
        return ready.pop(0) if ready else None

    def summed(self, tensor: int, start: int, stop: int, own: np.ndarray | None) -> np.ndarray:
        """What the node is handed of ``tensor``'s elements ``start:stop``: the LAN sum there, plus ``own``
        (the gateway trainer's flat values; None: it has none) there."""
        lan = self.sums.part(tensor, start, stop)
        return lan if own is None else own[start:stop] + lan

    def handed_one(self, now: float) -> None:
        """The node was handed a part at ``now`` (monotonic clock)."""
        self.handed += 1
        if self.first_handed is None:
            self.first_handed = now
