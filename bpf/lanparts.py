"""Which parts of a tensor the LAN has summed: the gateway hands the node each part of the DC's
contribution as soon as every LAN chunk under it completed, so the part's WAN chunk leaves while the LAN
still sums the rest of the iteration.

``PartReadiness`` is a sans-I/O core: it is told the parts the node contributes a tensor in (element
ranges of the tensor, ``netstorm.layout.Layout.key_parts``: one per WAN chunk of a large tensor) and the
LAN chunks that completed (sequence numbers of the iteration's ``EdgeLayout``, as
``IterationSums`` reports them), and answers with the parts that became ready. LAN chunks are cut at the
LAN's lanes per datagram, WAN chunks at the node's chunk size, so a LAN chunk may straddle two parts:
a part is ready once every LAN chunk overlapping it completed. No clock and no sockets: ``PartWatch``
(bpf/partwatch.py) feeds it from the agent's completion hook, and its shell wakes the node's waiters.
"""

from __future__ import annotations

import numpy as np

from netstorm.lan.batch import distinct
from netstorm.lan.layout import EdgeLayout


class PartReadiness:
    """One iteration's LAN chunks against the parts the node contributes tensors in."""

    def __init__(self, layout: EdgeLayout, completed: np.ndarray | None = None) -> None:
        """``completed``: a mask over the layout's chunk sequence numbers of those already complete."""
        self.layout = layout
        self.done = np.zeros(layout.num_chunks, bool) if completed is None else completed.astype(bool).copy()
        self._watched: dict[int, tuple[np.ndarray, np.ndarray, np.ndarray]] = {}
        """tensor -> per part: first LAN chunk, one past its last, how many of them are still open."""
        self._ready: dict[int, np.ndarray] = {}
        """tensor -> which parts were reported ready."""

    def watch(self, tensor: int, parts: list[tuple[int, int]]) -> list[int]:
        """Follow tensor ``tensor`` contributed in ``parts`` (``(start, stop)`` elements, in order, covering
        it); returns the parts whose LAN chunks are all complete already (each part is reported once)."""
        if tensor in self._watched:
            return []
        layout = self.layout
        if not 0 <= tensor < len(layout.sizes):
            raise ValueError(f"the LAN layout has no tensor {tensor}")
        bounds = np.asarray(parts, np.int64).reshape(-1, 2)
        if bounds.size and (bounds[0, 0] != 0 or bounds[-1, 1] != layout.sizes[tensor]
                            or np.any(bounds[1:, 0] != bounds[:-1, 1]) or np.any(bounds[:, 1] <= bounds[:, 0])):
            raise ValueError(f"parts {parts} do not cover tensor {tensor}'s {layout.sizes[tensor]} elements in order")
        first = layout.first_slot[tensor]
        lo = first + bounds[:, 0] // layout.lanes
        hi = first + -(-bounds[:, 1] // layout.lanes)
        done = np.concatenate([[0], np.cumsum(self.done, dtype=np.int64)])
        left = (hi - lo) - (done[hi] - done[lo])
        self._watched[tensor] = (lo, hi, left)
        self._ready[tensor] = np.zeros(len(bounds), bool)
        return self._newly_ready(tensor)

    def completed(self, seqs: np.ndarray) -> list[tuple[int, int]]:
        """LAN chunks ``seqs`` completed: (tensor, part) of every watched part that became ready."""
        seqs = distinct(np.asarray(seqs, np.int64))
        seqs = seqs[(seqs >= 0) & (seqs < self.layout.num_chunks)]
        fresh = seqs[~self.done[seqs]]
        if not fresh.size:
            return []
        self.done[fresh] = True
        out: list[tuple[int, int]] = []
        for tensor, (lo, hi, left) in self._watched.items():
            left -= np.searchsorted(fresh, hi) - np.searchsorted(fresh, lo)
            out += [(tensor, part) for part in self._newly_ready(tensor)]
        return out

    def ready(self, tensor: int) -> np.ndarray:
        """Which parts of a watched ``tensor`` were reported ready."""
        return self._ready[tensor]

    def _newly_ready(self, tensor: int) -> list[int]:
        left = self._watched[tensor][2]
        reported = self._ready[tensor]
        fresh = np.flatnonzero((left == 0) & ~reported)
        reported[fresh] = True
        return fresh.tolist()
