"""The model's chunk layout: which slice of the flat float32 model each chunk covers.

Every node derives the same layout from the trainer's tensor list, and a short hash of it is compared
at registration and in every data-plane Hello, so two DCs that registered different models fail loudly
instead of adding unrelated numbers. Tensors are laid out in name order (independent of the order a
trainer's dict happens to have) as one flat float32 vector. Tensors above ``chunk_size`` elements are
split into near-equal chunks of at most ``chunk_size``; smaller tensors stay whole and consecutive small
ones share a chunk up to ``chunk_size`` elements, so a model of many biases costs a few frames, not one
frame per bias.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Iterable, Sequence

import msgpack
import numpy as np

from netstorm.errors import LayoutError, UnknownTensor

LAYOUT_VERSION = 1

DTYPES: dict[str, np.dtype] = {
    "float32": np.dtype(np.float32),
    "float16": np.dtype(np.float16),
}
"""Tensor dtypes a trainer may register; every one is aggregated in float32."""


@dataclasses.dataclass(frozen=True)
class TensorSpec:
    """One registered tensor: name, shape and dtype as the trainer gave them."""

    name: str
    shape: tuple[int, ...]
    dtype: str

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise LayoutError(f"tensor name must be a non-empty string, got {self.name!r}")
        if any((not isinstance(d, int)) or isinstance(d, bool) or d < 0 for d in self.shape):
            raise LayoutError(f"tensor {self.name!r}: shape must be non-negative integers, got {self.shape!r}")
        if self.dtype not in DTYPES:
            raise LayoutError(f"tensor {self.name!r}: dtype {self.dtype!r} not supported "
                              f"(supported: {', '.join(DTYPES)})")

    @property
    def size(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))

    @classmethod
    def of(cls, name: str, array: np.ndarray) -> TensorSpec:
        """The spec of a numpy array registered under ``name``."""
        return cls(name, tuple(int(d) for d in array.shape), np.dtype(array.dtype).name)


@dataclasses.dataclass(frozen=True)
class Chunk:
    """A contiguous slice ``[offset, offset + count)`` of the flat model; keys ``first_key..last_key``."""

    index: int
    offset: int
    count: int
    first_key: int
    last_key: int

    @property
    def stop(self) -> int:
        return self.offset + self.count


@dataclasses.dataclass(frozen=True)
class Layout:
    """Tensors in name order, their offsets in the flat model, and the chunks cut from it."""

    tensors: tuple[TensorSpec, ...]
    chunk_size: int
    offsets: tuple[int, ...]
    chunks: tuple[Chunk, ...]
    key_chunks: tuple[tuple[int, int], ...]
    """Per tensor, the half-open range of chunk indices that overlap it."""
    total: int
    hash: str

    @classmethod
    def build(cls, specs: Iterable[TensorSpec], chunk_size: int) -> Layout:
        if chunk_size <= 0:
            raise LayoutError(f"chunk_size must be positive, got {chunk_size}")
        tensors = tuple(sorted(specs, key=lambda s: s.name))
        names = [t.name for t in tensors]
        duplicates = sorted({n for n in names if names.count(n) > 1})
        if duplicates:
            raise LayoutError(f"tensor names registered twice: {', '.join(duplicates)}")
        if not tensors:
            raise LayoutError("no tensors registered")
        offsets: list[int] = []
        # Chunk boundaries as (offset, count); small tensors accumulate into an open chunk.
        bounds: list[tuple[int, int]] = []
        position = 0
        open_start: int | None = None
        for spec in tensors:
            offsets.append(position)
            size = spec.size
            if size > chunk_size:
                if open_start is not None and position > open_start:
                    bounds.append((open_start, position - open_start))
                open_start = None
                pieces = -(-size // chunk_size)
                base, extra = divmod(size, pieces)
                start = position
                for i in range(pieces):
                    count = base + (1 if i < extra else 0)
                    bounds.append((start, count))
                    start += count
            else:
                if open_start is not None and position + size - open_start > chunk_size:
                    bounds.append((open_start, position - open_start))
                    open_start = None
                if open_start is None:
                    open_start = position
            position += size
        if open_start is not None and position > open_start:
            bounds.append((open_start, position - open_start))
        if not bounds:
            raise LayoutError("the registered tensors hold no elements")
        chunk_starts = np.array([offset for offset, _ in bounds], dtype=np.int64)
        key_chunks: list[tuple[int, int]] = []
        for spec, offset in zip(tensors, offsets, strict=True):
            first = max(int(np.searchsorted(chunk_starts, min(offset, position - 1), side="right")) - 1, 0)
            if spec.size == 0:
                key_chunks.append((first, first + 1))
            else:
                key_chunks.append((first, int(np.searchsorted(chunk_starts, offset + spec.size, side="left"))))
        first_key = [len(tensors)] * len(bounds)
        last_key = [-1] * len(bounds)
        for key, (lo, hi) in enumerate(key_chunks):
            for index in range(lo, hi):
                first_key[index] = min(first_key[index], key)
                last_key[index] = max(last_key[index], key)
        chunks = tuple(Chunk(i, offset, count, first_key[i], last_key[i])
                       for i, (offset, count) in enumerate(bounds))
        digest = hashlib.sha256(msgpack.packb(
            [LAYOUT_VERSION, chunk_size, [[t.name, list(t.shape), t.dtype] for t in tensors]])).hexdigest()[:16]
        return cls(tensors, chunk_size, tuple(offsets), chunks, tuple(key_chunks), position, digest)

    def key(self, name: str) -> int:
        """Index of tensor ``name``; UnknownTensor (a LayoutError) naming it when unknown."""
        if not isinstance(name, str):
            raise UnknownTensor(f"unknown tensor {name!r}: tensor names are strings")
        lo, hi = 0, len(self.tensors)
        while lo < hi:
            mid = (lo + hi) // 2
            if self.tensors[mid].name < name:
                lo = mid + 1
            else:
                hi = mid
        if lo < len(self.tensors) and self.tensors[lo].name == name:
            return lo
        raise UnknownTensor(f"unknown tensor {name!r}")

    def key_slice(self, key: int) -> slice:
        start = self.offsets[key]
        return slice(start, start + self.tensors[key].size)

    def chunk_sizes(self) -> list[int]:
        return [c.count for c in self.chunks]

    def names(self) -> list[str]:
        return [t.name for t in self.tensors]


def build(specs: Sequence[TensorSpec], chunk_size: int) -> Layout:
    """Shorthand for ``Layout.build``."""
    return Layout.build(specs, chunk_size)
