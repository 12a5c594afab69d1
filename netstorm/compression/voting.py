"""FediAC's phase 1: each contributor votes k indices, the counts are summed, a threshold makes the GIA.

The paper (eq. 3) models a vote as k independent draws with probability proportional to |update|, so
an index drawn twice holds one vote and fewer than k bits may be set; ``sample_votes`` does exactly
that. Top-k's deterministic vote is ``top_votes``. Counts are summed as integers up the trees; the
threshold a applies only to the full count (``consensus``), which every DC then holds identically.
"""

from __future__ import annotations

import numpy as np

_BLOCK = 1 << 20
"""Elements per pass of ``top_votes``' block loop."""


def sample_votes(update: np.ndarray, k: int, rng: np.random.Generator) -> np.ndarray:
    """A 0/1 uint8 vote array: k draws with replacement, index l drawn with probability |U_l| / ||U||_1."""
    magnitude = np.abs(np.asarray(update, dtype=np.float64).reshape(-1))
    votes = np.zeros(magnitude.size, dtype=np.uint8)
    nonzero = magnitude > 0
    last = magnitude.size - 1 - int(np.argmax(nonzero[::-1])) if magnitude.size else 0  # the last nonzero
    del nonzero
    cumulative = np.cumsum(magnitude, out=magnitude)   # in place: |U| is not needed past its sums
    total = float(cumulative[-1]) if cumulative.size else 0.0
    if k <= 0 or not total > 0.0:
        return votes
    if not np.isfinite(total):
        raise ValueError("the update holds inf or nan: no index can be voted by magnitude")
    draws = rng.random(k) * total
    # side="right": a draw u lands on the l with cumulative[l-1] <= u < cumulative[l], never on a zero.
    picked = np.searchsorted(cumulative, draws, side="right")
    picked = np.minimum(picked, last)  # u rounded up to the total
    votes[picked] = 1
    return votes


def top_votes(update: np.ndarray, k: int) -> np.ndarray:
    """A 0/1 uint8 vote array on the k largest |U_l| (ties to the lower index): plain top-k's selection.

    One model-sized |U| at a time: it is partitioned in place for the k-th largest, then the votes are
    taken a block at a time from U itself."""
    update = np.asarray(update).reshape(-1)
    size = update.size
    votes = np.zeros(size, dtype=np.uint8)
    k = min(k, size)
    if k <= 0:
        return votes
    magnitude = np.abs(update)
    if k < size and not np.isnan(magnitude).any():
        # the stable sort's first k, in O(n): every |U| above the k-th largest, then its ties by index
        magnitude.partition(size - k)
        kth = magnitude[size - k]
        del magnitude
        ties: list[np.ndarray] = []
        above = collected = 0
        for start in range(0, size, _BLOCK):
            block = np.abs(update[start:start + _BLOCK])
            over = block > kth
            votes[start:start + _BLOCK][over] = 1
            above += int(np.count_nonzero(over))
            room = k - above - collected   # at least the ties still to take: ``above`` only grows
            if room > 0:
                ties.append(np.flatnonzero(block == kth)[:room] + start)
                collected += ties[-1].size
        tied = np.concatenate(ties)[:k - above] if ties else np.zeros(0, dtype=np.int64)
        votes[tied] = 1
        return votes
    order = np.argsort(-magnitude, kind="stable")[:k]
    votes[order] = 1
    return votes


def consensus(counts: np.ndarray, threshold: int) -> np.ndarray:
    """The GIA as ascending indices: every index with at least ``threshold`` votes."""
    if threshold < 1:
        raise ValueError(f"the vote threshold must be >= 1, got {threshold}")
    return np.flatnonzero(np.asarray(counts).reshape(-1) >= threshold)


def count_dtype(contributors: int) -> str:
    """The narrowest integer lane holding a count of ``contributors`` votes."""
    if contributors <= np.iinfo(np.uint8).max:
        return "uint8"
    if contributors <= np.iinfo(np.int16).max:
        return "int16"
    return "int32"


def pack_gia(gia: np.ndarray, elements: int) -> bytes:
    """The GIA as a bitmap of ``elements`` bits (d/8 bytes): what a root broadcasting it down would send."""
    mask = np.zeros(elements, dtype=bool)
    mask[gia] = True
    return np.packbits(mask).tobytes()


def unpack_gia(bitmap: bytes, elements: int) -> np.ndarray:
    """Inverse of ``pack_gia``."""
    return np.flatnonzero(np.unpackbits(np.frombuffer(bitmap, dtype=np.uint8), count=elements))
