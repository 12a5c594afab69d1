"""One registered round: how collectives of any size travel through a node that knows one fixed layout.

A node sums the tensors its trainers registered at ``init``, with one layout checked by hash across
DCs, and every node iteration carries every registered tensor. DDP all-reduces flat buckets whose sizes
change after its first step (bucket rebuild), and ``torch.distributed`` users call collectives of any
size. So a rank registers one float32 tensor of ``round`` elements (``torch_round``), the same in every
rank, and a collective becomes a sequence of node iterations: its float32 payload cut into pieces of
``round`` elements, the last one padded with zeros. Every rank issues the same collectives in the same
order (what every ``torch.distributed`` backend requires), so every rank's k-th iteration holds the same
piece of the same collective and the node's sums are the collective's. Nothing is registered lazily and
no layout changes: a bucket rebuild only changes how many iterations a bucket takes.

The price is the padding: a collective of N elements moves ``ceil(N / round) * round`` elements. With
``round`` equal to DDP's bucket size (``bucket_cap_mb``) a bucket is one iteration and nothing is
padded but its last bucket; a barrier or a small broadcast costs one whole round.

``Stage`` also keeps the integration's own cost apart from the node's: the seconds spent waiting in the
client for the node's sums (``node_s``) and those spent copying into and out of the round
(``copy_s``); the backend adds its encoding and decoding (``overhead_s``).
"""

from __future__ import annotations

import dataclasses
import threading
import time
from typing import Protocol

import numpy as np

ROUND_NAME = "netstorm.torch.round"
"""The one tensor a rank registers."""


class RoundClient(Protocol):
    """The part of ``netstorm.connect()``'s client a stage uses."""

    @property
    def num_workers(self) -> int: ...

    @property
    def node_id(self) -> int: ...

    @property
    def iteration(self) -> int: ...

    def init(self, tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]: ...

    def push_pull(self, tensors: dict[str, np.ndarray], average: bool = False) -> dict[str, np.ndarray]: ...

    def close(self) -> None: ...


@dataclasses.dataclass
class StageStats:
    """Seconds and counts since the stage started; ``overhead_s`` is the integration's own cost."""

    collectives: int = 0
    iterations: int = 0
    elements: int = 0
    """Payload elements the collectives carried."""
    padded: int = 0
    """Zero elements added to fill the last round of each collective."""
    node_s: float = 0.0
    """In ``push_pull``: the node's synchronization the backend waits on."""
    copy_s: float = 0.0
    """Copies into and out of the round."""
    overhead_s: float = 0.0
    """Encoding, decoding and bookkeeping around the node (the backend's and the hook's), copies included."""

    def copy(self) -> StageStats:
        return dataclasses.replace(self)


class Stage:
    """A connected, registered rank: ``reduce(payload)`` returns the sum (or mean) over all ranks."""

    def __init__(self, client: RoundClient, round_elements: int) -> None:
        if round_elements < 1:
            raise ValueError(f"a round needs at least one element, got {round_elements}")
        self.client = client
        self.round = round_elements
        self._buffer = np.zeros(round_elements, dtype=np.float32)
        self._lock = threading.Lock()
        self.stats = StageStats()
        # The init round: every DC's rank registers the same layout (hash-checked) and waits for the others.
        client.init({ROUND_NAME: self._buffer})

    @property
    def workers(self) -> int:
        """Ranks whose values make up each sum (every DC's trainers, as its node counts them)."""
        return self.client.num_workers

    @property
    def node_id(self) -> int:
        return self.client.node_id

    @property
    def iteration(self) -> int:
        """The newest node iteration this rank has completed (-1 before the first)."""
        return self.client.iteration

    def reduce(self, payload: np.ndarray, *, average: bool = False) -> np.ndarray:
        """The element-wise sum (or mean over ``workers``) of ``payload`` over every rank, in as many node
        iterations as it takes; every rank must call it with a payload of the same size."""
        size = int(payload.size)
        out = np.empty(size, dtype=np.float32)
        with self._lock:
            self.stats.collectives += 1
            self.stats.elements += size
            for start in range(0, max(size, 1), self.round):
                stop = min(size, start + self.round)
                began = time.perf_counter()
                self._buffer[:stop - start] = payload[start:stop]
                self._buffer[stop - start:] = 0.0
                self.stats.padded += self.round - (stop - start)
                pushed = time.perf_counter()
                result = self.client.push_pull({ROUND_NAME: self._buffer}, average=average)[ROUND_NAME]
                pulled = time.perf_counter()
                out[start:stop] = result[:stop - start]
                done = time.perf_counter()
                self.stats.iterations += 1
                self.stats.node_s += pulled - pushed
                self.stats.copy_s += (pushed - began) + (done - pulled)
                self.stats.overhead_s += (pushed - began) + (done - pulled)
        return out

    def charge(self, seconds: float) -> None:
        """Add the caller's own encoding or decoding time to the integration's cost."""
        with self._lock:
            self.stats.overhead_s += seconds

    def snapshot(self) -> StageStats:
        with self._lock:
            return self.stats.copy()

    def close(self) -> None:
        self.client.close()
