"""Sizing the edge data plane from the model: which packet-sized chunk of which tensor uses which slot.

Every tensor is cut into chunks of at most ``lanes`` elements, one chunk per datagram. Chunk c of tensor t
has the sequence number ``seq = first[t] + c`` (its place in the whole model) and uses slot
``seq % pool``: a fixed pool of slots is reused across chunks and iterations, as in SwitchML. A worker
sends the chunk that reuses a slot only after the ACK of the slot's previous chunk came back (the agent
multicasts ACKs as slots complete), so at most ``pool`` chunks per worker are in flight and a slot is
only ever taken over by a newer key (later chunk of the same iteration, or a later iteration). With
``pool = 0`` the pool is one slot per chunk of the model (no reuse within an iteration).

Memory: each slot holds a 64-byte key/bitmap/timer block plus ``lanes`` int32 lanes, so the slot map needs
``pool * (64 + 4 * lanes)`` bytes whatever the model (``MAX_MAP_BYTES`` bounds it).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

import numpy as np

from netstorm.lan.errors import WireError
from netstorm.lan.header import MAX_LANES

SLOT_OVERHEAD_BYTES = 64
"""Bytes of a slot besides its lanes (lock, key, bitmaps, flags, struct bpf_timer), rounded up."""
MAX_MAP_BYTES = 56 << 20
"""Largest slot map a layout may ask for, so the program's maps stay within 64 MB in total."""
DEFAULT_POOL = 1024
"""Slots in the pool unless configured (``edge_pool_slots``)."""


@dataclass(frozen=True)
class EdgeLayout:
    """Tensor sizes (elements) and their agreed fixed-point scales, cut into datagram-sized chunks."""

    sizes: tuple[int, ...]
    scales: tuple[int, ...]
    lanes: int = MAX_LANES
    pool: int = 0
    """Slots reused across chunks (0: one per chunk of the model)."""
    shadow: bool = False
    """Results come from the aggregation program itself (``edge_results=kernel``): no agent keeps a copy to
    answer a worker that lost one, so a completed slot must stay intact until every worker has its result.
    As in SwitchML's shadow copies, the pool then holds up to two models' worth of chunks and a worker keeps
    at most half the pool in flight (``window``), with chunks numbered across iterations
    (``slot_numbers``): the chunk that takes a slot over is sent only after its sender had the result of the
    chunk half a pool later than the slot's, which needed every worker's DATA, each sent only after that
    worker had the slot's own result. Iterations are numbered below 2**32 here: past it the numbering starts
    over (a job of four billion iterations)."""

    def __post_init__(self) -> None:
        if len(self.sizes) != len(self.scales):
            raise WireError(f"{len(self.sizes)} tensor sizes but {len(self.scales)} scales")
        if not 1 <= self.lanes <= MAX_LANES:
            raise WireError(f"lanes must be in 1..{MAX_LANES}, got {self.lanes}")
        if any(size <= 0 for size in self.sizes):
            raise WireError(f"tensor sizes must be positive, got {self.sizes}")
        if any(not -128 <= s <= 126 for s in self.scales):
            raise WireError(f"scales must fit an int8 below 127, got {self.scales}")
        if self.pool < 0:
            raise WireError(f"pool must be >= 0 slots (0: one per chunk), got {self.pool}")
        if self.shadow and self.num_slots < 2:
            raise WireError("shadow slots need a pool of at least 2 (a worker keeps half of it in flight)")
        if self.map_bytes > MAX_MAP_BYTES:
            raise WireError(f"{self.num_slots} slots of {self.slot_bytes} bytes need {self.map_bytes} bytes of "
                            f"slot map, more than {MAX_MAP_BYTES}: choose a smaller pool (edge_pool_slots)")

    @classmethod
    def uniform(cls, sizes: Sequence[int], scale: int, lanes: int = MAX_LANES, pool: int = 0,
                shadow: bool = False) -> EdgeLayout:
        return cls(tuple(int(s) for s in sizes), tuple(scale for _ in sizes), lanes, pool, shadow)

    @cached_property
    def chunks(self) -> tuple[int, ...]:
        """Chunks per tensor."""
        return tuple(-(-size // self.lanes) for size in self.sizes)

    @cached_property
    def first_slot(self) -> tuple[int, ...]:
        return tuple(int(x) for x in np.concatenate([[0], np.cumsum(self.chunks)[:-1]]))

    @property
    def num_chunks(self) -> int:
        """Chunks (datagrams per worker) of the whole model."""
        return int(sum(self.chunks))

    @property
    def num_slots(self) -> int:
        """Slots in the map: the pool, or one per chunk when the pool is 0 or larger than the model."""
        most = 2 * self.num_chunks if self.shadow else self.num_chunks
        return most if not self.pool else min(self.pool, most)

    @property
    def window(self) -> int:
        """Chunks a worker may have in flight (sent, result or ACK not back): the pool, or half of it with
        ``shadow``."""
        return max(1, self.num_slots // 2) if self.shadow else self.num_slots

    def slot_numbers(self, seqs: np.ndarray | int, iteration: int) -> np.ndarray:
        """The slots of chunks ``seqs`` of ``iteration``: ``seq % num_slots``, or with ``shadow`` the chunk's
        place in the sequence of every iteration's chunks (``iteration * num_chunks + seq``) modulo the pool,
        so consecutive iterations go on round the pool instead of starting over at slot 0."""
        seqs = np.asarray(seqs, np.int64)
        if not self.shadow:
            return seqs % self.num_slots
        offset = (iteration & 0xFFFFFFFF) * self.num_chunks % self.num_slots
        return (seqs + offset) % self.num_slots

    @property
    def slot_bytes(self) -> int:
        return SLOT_OVERHEAD_BYTES + 4 * self.lanes

    @property
    def map_bytes(self) -> int:
        return self.num_slots * self.slot_bytes

    def seq(self, tensor: int, chunk: int) -> int:
        """The chunk's sequence number in the whole model (its index in per-chunk arrays)."""
        if not 0 <= tensor < len(self.sizes) or not 0 <= chunk < self.chunks[tensor]:
            raise WireError(f"no chunk {chunk} of tensor {tensor} in this layout")
        return self.first_slot[tensor] + chunk

    def seqs(self, tensors: np.ndarray, chunks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``seq`` for many chunks at once: their sequence numbers (int64; 0 where not a chunk of this layout)
        and the mask of those that are."""
        tensor = np.asarray(tensors, np.int64)
        chunk = np.asarray(chunks, np.int64)
        known = (tensor >= 0) & (tensor < len(self.sizes))
        tensor = np.where(known, tensor, 0)
        known &= (chunk >= 0) & (chunk < np.asarray(self.chunks, np.int64)[tensor])
        return np.where(known, np.asarray(self.first_slot, np.int64)[tensor] + chunk, 0), known

    def slot(self, tensor: int, chunk: int) -> int:
        """The pool slot the chunk uses (without ``shadow``; ``slot_numbers`` in general)."""
        return self.seq(tensor, chunk) % self.num_slots

    def locate(self, seq: int) -> tuple[int, int]:
        """(tensor, chunk) of a sequence number."""
        if not 0 <= seq < self.num_chunks:
            raise WireError(f"no chunk with sequence number {seq} in this layout")
        tensor = int(np.searchsorted(self.first_slot, seq, side="right") - 1)
        return tensor, seq - self.first_slot[tensor]

    def locate_many(self, seqs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(tensors, chunks) of sequence numbers already known to be in range, as int64 arrays."""
        seqs = np.asarray(seqs, np.int64)
        tensors = np.searchsorted(np.asarray(self.first_slot, np.int64), seqs, side="right") - 1
        return tensors, seqs - np.asarray(self.first_slot, np.int64)[tensors]

    def bounds(self, tensor: int, chunk: int) -> tuple[int, int]:
        """Element range [start, stop) of a chunk within its tensor."""
        start = chunk * self.lanes
        return start, min(start + self.lanes, self.sizes[tensor])

    def key(self) -> tuple[object, ...]:
        return (self.sizes, self.scales, self.lanes, self.pool, self.shadow)
