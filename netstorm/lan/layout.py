"""Sizing the edge data plane from the model: which packet-sized chunk of which tensor uses which slot.

Every tensor is cut into chunks of at most ``lanes`` elements, one chunk per datagram. Chunk c of tensor t
uses slot ``first[t] + c``, so one iteration's chunks never share a slot and the slot map holds exactly
one model's worth of slots: a slot is taken over by the next iteration only after its own iteration
completed (workers are synchronous), which makes reuse across iterations safe without clearing the map.

Memory: each slot holds a 40-byte key/bitmap/timer block plus ``lanes`` int32 lanes, so a model of P
float32 parameters needs about P * 4 * (1 + 40 / (4 * lanes)) bytes of slot map (about 1.03x the model).
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


@dataclass(frozen=True)
class EdgeLayout:
    """Tensor sizes (elements) and their agreed fixed-point scales, cut into datagram-sized chunks."""

    sizes: tuple[int, ...]
    scales: tuple[int, ...]
    lanes: int = MAX_LANES

    def __post_init__(self) -> None:
        if len(self.sizes) != len(self.scales):
            raise WireError(f"{len(self.sizes)} tensor sizes but {len(self.scales)} scales")
        if not 1 <= self.lanes <= MAX_LANES:
            raise WireError(f"lanes must be in 1..{MAX_LANES}, got {self.lanes}")
        if any(size <= 0 for size in self.sizes):
            raise WireError(f"tensor sizes must be positive, got {self.sizes}")
        if any(not -128 <= s <= 126 for s in self.scales):
            raise WireError(f"scales must fit an int8 below 127, got {self.scales}")

    @classmethod
    def uniform(cls, sizes: Sequence[int], scale: int, lanes: int = MAX_LANES) -> EdgeLayout:
        return cls(tuple(int(s) for s in sizes), tuple(scale for _ in sizes), lanes)

    @cached_property
    def chunks(self) -> tuple[int, ...]:
        """Chunks per tensor."""
        return tuple(-(-size // self.lanes) for size in self.sizes)

    @cached_property
    def first_slot(self) -> tuple[int, ...]:
        return tuple(int(x) for x in np.concatenate([[0], np.cumsum(self.chunks)[:-1]]))

    @property
    def num_slots(self) -> int:
        """Slots in the map: one per chunk of the whole model."""
        return int(sum(self.chunks))

    @property
    def slot_bytes(self) -> int:
        return SLOT_OVERHEAD_BYTES + 4 * self.lanes

    @property
    def map_bytes(self) -> int:
        return self.num_slots * self.slot_bytes

    def slot(self, tensor: int, chunk: int) -> int:
        if not 0 <= tensor < len(self.sizes) or not 0 <= chunk < self.chunks[tensor]:
            raise WireError(f"no chunk {chunk} of tensor {tensor} in this layout")
        return self.first_slot[tensor] + chunk

    def bounds(self, tensor: int, chunk: int) -> tuple[int, int]:
        """Element range [start, stop) of a chunk within its tensor."""
        start = chunk * self.lanes
        return start, min(start + self.lanes, self.sizes[tensor])

    def key(self) -> tuple[object, ...]:
        return (self.sizes, self.scales, self.lanes)
