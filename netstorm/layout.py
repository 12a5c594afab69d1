"""The model's chunk layout: which slice of the flat float32 model each chunk covers.

Every node derives the same layout from the trainer's tensor list, and a short hash of it is compared
at registration and in every data-plane Hello, so two DCs that registered different models fail loudly
instead of adding unrelated numbers. Tensors are laid out in name order (independent of the order a
trainer's dict happens to have) as one flat float32 vector. Tensors above ``chunk_size`` elements are
split into near-equal chunks of at most ``chunk_size``; smaller tensors stay whole and consecutive small
ones share a chunk up to ``chunk_size`` elements, so a model of many biases costs a few frames, not one
frame per bias.

Integer tensors (``INT_DTYPES``: vote counts, quantized values) are summed exactly as integers by the
nodes and travel as narrow integer lanes. They are laid out after the float tensors, grouped by dtype,
and a chunk never mixes lanes, so every chunk has one lane dtype (``Chunk.dtype``); ``chunk_size`` counts
float32 elements, and an integer chunk holds as many bytes of its dtype (four times the elements for
uint8), so a sparse method's extra tensors do not multiply the frames. ``float_wire`` says
how float chunks travel between nodes (float32, or float16 for the fp16 compression); the hash covers
every dtype and the float wire, so DCs that disagree on either fail at registration.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import hashlib
import itertools
import math
import operator
from collections.abc import Iterable, Sequence

import msgpack
import numpy as np

from netstorm.errors import LayoutError, UnknownTensor

LAYOUT_VERSION = 1

DTYPES: dict[str, np.dtype] = {
    "float32": np.dtype(np.float32),
    "float16": np.dtype(np.float16),
}
"""Float tensor dtypes a trainer may register; every one is aggregated in float32."""

INT_DTYPES: dict[str, np.dtype] = {
    "uint8": np.dtype(np.uint8),
    "int8": np.dtype(np.int8),
    "int16": np.dtype(np.int16),
    "int32": np.dtype(np.int32),
}
"""Integer tensor dtypes: summed exactly as integers; each hop travels in the narrowest integer dtype that
holds its partial sum, so the registered dtype only bounds what a trainer pushes."""

TENSOR_DTYPES: dict[str, np.dtype] = {**DTYPES, **INT_DTYPES}
"""Every dtype a trainer may register."""

FLOAT_WIRES = ("float32", "float16")
"""How float chunks may travel between nodes."""

INT_EXACT = 1 << 24
"""Largest integer magnitude the trainer path (float32) carries exactly: bound of integer sums."""


def lane(dtype: str) -> str:
    """The lane a tensor of ``dtype`` is summed in: float32 for floats, the dtype itself for integers."""
    return dtype if dtype in INT_DTYPES else "float32"


@functools.lru_cache(maxsize=64)
def dtype_name(dtype: np.dtype) -> str:
    """``dtype.name``, looked up once per dtype (numpy builds the string on every access: a model of
    100k tensors would pay for it 100k times per push)."""
    return np.dtype(dtype).name


_ORDER: dict[str, tuple[bool, str]] = {d: (lane(d) != "float32", lane(d)) for d in TENSOR_DTYPES}
"""Where a dtype's tensors go in a layout: float tensors first, then the integer lanes by name."""


@dataclasses.dataclass(frozen=True)
class TensorSpec:
    """One registered tensor: name, shape and dtype as the trainer gave them."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    size: int = dataclasses.field(init=False, repr=False, compare=False)
    """Elements, computed once (Python integers: a shape's product never wraps around)."""

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise LayoutError(f"tensor name must be a non-empty string, got {self.name!r}")
        if not all(type(d) is int and d >= 0 for d in self.shape) \
                and any((not isinstance(d, int)) or isinstance(d, bool) or d < 0 for d in self.shape):
            raise LayoutError(f"tensor {self.name!r}: shape must be non-negative integers, got {self.shape!r}")
        if self.dtype not in TENSOR_DTYPES:
            raise LayoutError(f"tensor {self.name!r}: dtype {self.dtype!r} not supported "
                              f"(supported: {', '.join(TENSOR_DTYPES)})")
        object.__setattr__(self, "size", math.prod(self.shape))

    @classmethod
    def of(cls, name: str, array: np.ndarray) -> TensorSpec:
        """The spec of a numpy array registered under ``name``."""
        return cls(name, tuple(int(d) for d in array.shape), dtype_name(array.dtype))


@dataclasses.dataclass(frozen=True)
class Chunk:
    """A contiguous slice ``[offset, offset + count)`` of the flat model; keys ``first_key..last_key``."""

    index: int
    offset: int
    count: int
    first_key: int
    last_key: int
    dtype: str = "float32"
    """The chunk's lane: float32, or the integer dtype of every tensor in it."""

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
    float_wire: str = "float32"
    """How float chunks travel between nodes: float32, or float16 (the fp16 compression)."""
    int_start: int = -1
    """Flat offset where the integer tensors begin (``total`` when there are none)."""
    gia_key: int = -1
    """The vote-count tensor whose full sums the roots threshold (FediAC), or -1."""
    gia_threshold: int = 0
    """That threshold a: a root sends 1 where a count reaches it, else 0 (a bitmap down the trees)."""

    @classmethod
    def build(cls, specs: Iterable[TensorSpec], chunk_size: int, float_wire: str = "float32",
              gia: tuple[str, int] | None = None) -> Layout:
        """``gia``: (tensor, a) when the roots apply FediAC's threshold to that integer tensor's counts."""
        if chunk_size <= 0:
            raise LayoutError(f"chunk_size must be positive, got {chunk_size}")
        if float_wire not in FLOAT_WIRES:
            raise LayoutError(f"float_wire must be one of {', '.join(FLOAT_WIRES)}, got {float_wire!r}")
        # float tensors first, then integer tensors grouped by lane; names order within each group
        groups: dict[tuple[bool, str], list[TensorSpec]] = {}
        for spec in specs:
            groups.setdefault(_ORDER[spec.dtype], []).append(spec)
        by_name = operator.attrgetter("name")
        lanes_in_order = sorted(groups)
        for group in lanes_in_order:
            groups[group].sort(key=by_name)
        tensors = tuple(spec for group in lanes_in_order for spec in groups[group])
        names = [t.name for t in tensors]
        if len(set(names)) != len(names):  # a set, not a count per name: O(n)
            duplicates = sorted(n for n, times in collections.Counter(names).items() if times > 1)
            raise LayoutError(f"tensor names registered twice: {', '.join(duplicates)}")
        if not tensors:
            raise LayoutError("no tensors registered")
        sizes_list = [spec.size for spec in tensors]
        offsets = [0, *itertools.accumulate(sizes_list)]
        position = offsets.pop()
        int_start = next((offsets[k] for k, spec in enumerate(tensors) if spec.dtype in INT_DTYPES), None)
        # Chunk boundaries as (offset, count), lane by lane (a chunk never mixes lanes): small tensors
        # accumulate into an open chunk, larger ones are cut into near-equal pieces.
        bounds: list[tuple[int, int]] = []
        first = 0
        for group in lanes_in_order:
            members = groups[group]
            # chunk_size counts float32 elements; an integer lane's chunks hold as many bytes of its dtype
            dtype = members[0].dtype  # an integer lane holds one dtype
            limit = chunk_size * 4 // INT_DTYPES[dtype].itemsize if dtype in INT_DTYPES else chunk_size
            open_start = -1
            here = offsets[first]
            for size in sizes_list[first:first + len(members)]:
                if size > limit:
                    if 0 <= open_start < here:
                        bounds.append((open_start, here - open_start))
                    open_start = -1
                    pieces = -(-size // limit)
                    base, extra = divmod(size, pieces)
                    start = here
                    for i in range(pieces):
                        count = base + (1 if i < extra else 0)
                        bounds.append((start, count))
                        start += count
                else:
                    if open_start >= 0 and here + size - open_start > limit:
                        bounds.append((open_start, here - open_start))
                        open_start = -1
                    if open_start < 0:
                        open_start = here
                here += size
            if 0 <= open_start < here:
                bounds.append((open_start, here - open_start))
            first += len(members)
        if not bounds:
            raise LayoutError("the registered tensors hold no elements")
        # Which chunks each tensor overlaps, and each chunk's first and last tensor, in array operations:
        # a model of many small tensors (100k) builds as fast as one of a few large ones.
        chunk_starts = np.fromiter((offset for offset, _ in bounds), dtype=np.int64, count=len(bounds))
        starts = np.asarray(offsets, dtype=np.int64)
        sizes = np.asarray(sizes_list, dtype=np.int64)
        firsts = np.maximum(np.searchsorted(chunk_starts, np.minimum(starts, position - 1), side="right") - 1, 0)
        lasts = np.where(sizes == 0, firsts + 1, np.searchsorted(chunk_starts, starts + sizes, side="left"))
        key_chunks = list(zip(firsts.tolist(), lasts.tolist(), strict=True))
        spans = lasts - firsts  # >= 1 for every tensor
        owners = np.repeat(np.arange(len(tensors), dtype=np.int64), spans)
        covered = np.arange(int(spans.sum()), dtype=np.int64) - np.repeat(np.cumsum(spans) - spans - firsts, spans)
        first_key = np.full(len(bounds), len(tensors), dtype=np.int64)
        last_key = np.full(len(bounds), -1, dtype=np.int64)
        np.minimum.at(first_key, covered, owners)
        np.maximum.at(last_key, covered, owners)
        # a chunk's lane is that of the non-empty tensor holding its first element
        filled = np.flatnonzero(sizes)
        holder = filled[np.searchsorted(starts[filled], chunk_starts, side="right") - 1]
        lanes = [lane(tensors[int(k)].dtype) for k in holder]
        chunks = tuple(Chunk(i, offset, count, first, last, chunk_lane)
                       for i, ((offset, count), first, last, chunk_lane)
                       in enumerate(zip(bounds, first_key.tolist(), last_key.tolist(), lanes, strict=True)))
        # tuples pack as msgpack arrays, as lists do: the hash is the one lists gave
        described: list[object] = [LAYOUT_VERSION, chunk_size, [(t.name, t.shape, t.dtype) for t in tensors]]
        if float_wire != "float32":  # a float32 wire keeps the hashes layouts had before other wires existed
            described.append(float_wire)
        gia_key = -1
        if gia is not None:
            gia_key = next((k for k, t in enumerate(tensors) if t.name == gia[0]), -1)
            if gia_key < 0 or tensors[gia_key].dtype not in INT_DTYPES or gia[1] < 1:
                raise LayoutError(f"the GIA threshold needs an integer tensor {gia[0]!r} and a >= 1, got {gia!r}")
            described.append(["gia", gia[0], gia[1]])
        digest = hashlib.sha256(msgpack.packb(described)).hexdigest()[:16]
        return cls(tensors, chunk_size, tuple(offsets), chunks, tuple(key_chunks), position, digest, float_wire,
                   position if int_start is None else int_start, gia_key, gia[1] if gia is not None else 0)

    def key(self, name: str) -> int:
        """Index of tensor ``name``; UnknownTensor (a LayoutError) naming it when unknown."""
        if not isinstance(name, str):
            raise UnknownTensor(f"unknown tensor {name!r}: tensor names are strings")
        key = self._keys.get(name)
        if key is None:
            raise UnknownTensor(f"unknown tensor {name!r}")
        return key

    @functools.cached_property
    def _keys(self) -> dict[str, int]:
        return {spec.name: key for key, spec in enumerate(self.tensors)}

    def is_int(self, key: int) -> bool:
        """Whether tensor ``key`` is summed as integers."""
        return self.tensors[key].dtype in INT_DTYPES

    def key_slice(self, key: int) -> slice:
        start = self.offsets[key]
        return slice(start, start + self.tensors[key].size)

    def key_parts(self, key: int) -> list[tuple[int, int]]:
        """Tensor ``key`` as the parts its contribution may arrive in, each ``(start, stop)`` elements of the
        tensor: one per chunk when the tensor fills its chunks alone (a tensor above ``chunk_size``), so a
        chunk can go up the tree before the rest of the tensor is in (a gateway's LAN sum, summed chunk by
        chunk); else the whole tensor, whose chunk it shares with others."""
        size = self.tensors[key].size
        lo, hi = self.key_chunks[key]
        mine = self.chunks[lo:hi]
        if size == 0 or any(c.first_key != key or c.last_key != key for c in mine):
            return [(0, size)]
        start = self.offsets[key]
        return [(c.offset - start, c.stop - start) for c in mine]

    def chunk_sizes(self) -> list[int]:
        return [c.count for c in self.chunks]

    def names(self) -> list[str]:
        return [t.name for t in self.tensors]


def build(specs: Sequence[TensorSpec], chunk_size: int, float_wire: str = "float32",
          gia: tuple[str, int] | None = None) -> Layout:
    """Shorthand for ``Layout.build``."""
    return Layout.build(specs, chunk_size, float_wire, gia)
