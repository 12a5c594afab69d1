"""Chunks and their roots: tensors split into chunks, chunks allotted to roots by quality share.

Every node runs the same pure functions on the same layout, so all agree on which root aggregates
which chunk without exchanging the assignment.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import numpy as np

from netstorm.errors import PolicyError


def split_chunks(tensor_sizes: Sequence[int], chunk_size: int) -> list[int]:
    """Chunk sizes (elements) in order: each tensor cut into ``chunk_size`` pieces plus a remainder."""
    if chunk_size <= 0:
        raise PolicyError(f"chunk size must be positive, got {chunk_size}")
    chunks: list[int] = []
    for i, size in enumerate(tensor_sizes):
        if size <= 0:
            raise PolicyError(f"tensor {i} has {size} elements; sizes must be positive")
        full, rest = divmod(int(size), chunk_size)
        chunks.extend([chunk_size] * full)
        if rest:
            chunks.append(rest)
    return chunks


def allot_chunks(chunk_sizes: Sequence[int], shares: Mapping[int, float]) -> list[int]:
    """The root of each chunk: sizes follow ``shares`` as closely as whole chunks allow.

    Walking the chunks in order, each goes to the root furthest below its share of the elements seen so
    far (ties to the smaller root id), so every prefix of the model is spread across the roots too and
    their trees work in parallel from the first chunk on.
    """
    if not shares:
        raise PolicyError("no roots to allot chunks to")
    roots = sorted(shares)
    weights = np.array([float(shares[r]) for r in roots])
    if not np.all(np.isfinite(weights)) or np.any(weights < 0) or weights.sum() <= 0:
        raise PolicyError(f"chunk shares must be non-negative with a positive sum, got {dict(shares)}")
    if not math.isclose(float(weights.sum()), 1.0, rel_tol=1e-9):
        weights = weights / weights.sum()
    assigned = np.zeros(len(roots))
    total = 0.0
    out: list[int] = []
    for size in chunk_sizes:
        if size <= 0:
            raise PolicyError(f"chunk sizes must be positive, got {size}")
        total += size
        deficit = weights * total - assigned
        k = int(np.argmax(deficit))  # first maximum = smallest root id
        assigned[k] += size
        out.append(roots[k])
    return out
