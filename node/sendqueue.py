"""A link's queue of frames waiting to be sent, and the order they leave in.

Pure data structure (no I/O): ``node/peers.py`` drains it onto a socket, and the node core
(``node/core.py``) uses ``leave_order`` to tell which queued frame would leave last when it moves one to
another link.
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
from collections.abc import Callable

import numpy as np

from netstorm.frames import ChunkHeader, Phase


def leave_order(header: ChunkHeader) -> tuple[int, int]:
    """Where a frame sorts in its link's queue: oldest iteration first, then lowest chunk number, the
    result (DOWN) before the partial sum (UP) of the same chunk. Frames that tie leave in queue order."""
    return header.iteration, 2 * header.chunk + (0 if header.phase is Phase.DOWN else 1)


@dataclasses.dataclass
class Outgoing:
    """One frame waiting in a link's queue. ``ticket`` is the node core's name for it (None: a frame the
    core does not track, such as one a test queues by hand)."""

    header: ChunkHeader
    payload: np.ndarray
    ticket: int | None = None


class SendQueue:
    """A link's waiting frames in ``leave_order``, then arrival order.

    Chunk numbers interleave the roots in proportion to their shares (``allot_chunks``), so serving
    every link lowest chunk first moves all trees' pipelines forward together: a result waits only
    behind partial sums of earlier chunks, and a partial sum behind results of earlier chunks. Serving
    every result first instead starved the up-trees while results queued.
    """

    def __init__(self) -> None:
        self._heap: list[tuple[int, int, int, Outgoing]] = []
        self._seq = itertools.count()

    def push(self, item: Outgoing) -> None:
        heapq.heappush(self._heap, (*leave_order(item.header), next(self._seq), item))

    def pop(self) -> Outgoing:
        return heapq.heappop(self._heap)[3]

    def last(self, wanted: Callable[[Outgoing], bool]) -> Outgoing | None:
        """The frame that would leave last among those ``wanted`` accepts (still queued)."""
        entries = [entry for entry in self._heap if wanted(entry[3])]
        return max(entries, key=lambda entry: entry[:3])[3] if entries else None

    def count(self, wanted: Callable[[Outgoing], bool]) -> int:
        """How many queued frames ``wanted`` accepts."""
        return sum(1 for entry in self._heap if wanted(entry[3]))

    def remove(self, item: Outgoing) -> None:
        """Take ``item`` out of the queue (linear: queues hold tens of frames)."""
        index = next(i for i, entry in enumerate(self._heap) if entry[3] is item)
        self._heap[index] = self._heap[-1]
        self._heap.pop()
        heapq.heapify(self._heap)

    def __len__(self) -> int:
        return len(self._heap)
