"""FediAC's phase 2 arithmetic: a global scale, unbiased stochastic rounding to b bits, the lane dtype.

The paper's scale is f = (2**(b-1) - N) / (N m) with m the largest |update| over all N contributors,
so that N rounded values sum within a signed b-bit range: |round(f U)| <= |f U| + 1 <= (2**(b-1) - N)/N
+ 1, and N of them stay <= 2**(b-1). The paper does not say how m is agreed; here every contributor
adds a one-hot histogram of its own max |U|, bucketed at a quarter octave, to its votes (an integer
sum like the votes), and the highest occupied bucket's upper edge is the m everyone uses. That m is
at most 2**0.25 above the true max: f is at most 16 % smaller than the paper's, a quarter of a bit of
resolution, and the sums still cannot overflow.
"""

from __future__ import annotations

import math

import numpy as np

BUCKETS_PER_OCTAVE = 4
LOWEST_OCTAVE = -96
SCALE_BUCKETS = 192 * BUCKETS_PER_OCTAVE
"""Buckets 0..767 cover max |U| from 2**-96 to 2**96: any finite float32 gradient of interest."""


def magnitude_bucket(peak: float) -> int | None:
    """The bucket whose upper edge is the smallest at or above ``peak``; None for 0."""
    if peak == 0.0:
        return None
    if not (peak > 0.0 and math.isfinite(peak)):
        raise ValueError(f"the largest |update| must be finite and positive, got {peak!r}")
    bucket = math.ceil((math.log2(peak) - LOWEST_OCTAVE) * BUCKETS_PER_OCTAVE)
    while bucket_edge(bucket) < peak:  # log2 rounding
        bucket += 1
    if bucket >= SCALE_BUCKETS:
        raise ValueError(f"|update| of {peak!r} is beyond the scale histogram (2**{LOWEST_OCTAVE + 192})")
    return max(0, bucket)


def bucket_edge(bucket: int) -> float:
    """The upper edge of ``bucket``: the m a contributor whose max |U| falls in it stands for."""
    return float(2.0 ** (LOWEST_OCTAVE + bucket / BUCKETS_PER_OCTAVE))


def scale_histogram(update: np.ndarray) -> np.ndarray:
    """This contributor's one-hot (uint8) at the bucket of its max |U|; all zeros for a zero update."""
    histogram = np.zeros(SCALE_BUCKETS, dtype=np.uint8)
    # max |U| as the larger of max U and -min U: no model-sized |U| (np.maximum keeps a nan)
    peak = float(np.maximum(np.max(update, initial=0.0), -np.min(update, initial=0.0)))
    bucket = magnitude_bucket(peak)
    if bucket is not None:
        histogram[bucket] = 1
    return histogram


def global_peak(histogram_sum: np.ndarray) -> float:
    """The agreed m from the summed histograms: the top occupied bucket's edge (0 if all updates are 0)."""
    occupied = np.flatnonzero(np.asarray(histogram_sum).reshape(-1))
    return bucket_edge(int(occupied[-1])) if occupied.size else 0.0


def scale(bits: int, contributors: int, peak: float) -> float:
    """f = (2**(b-1) - N) / (N m), the paper's global scale; ValueError if b leaves no room for N."""
    room = 2 ** (bits - 1) - contributors
    if room <= 0:
        raise ValueError(f"b = {bits} bits cannot sum {contributors} contributors: 2**(b-1) must exceed N")
    if not peak > 0.0:
        raise ValueError(f"the scale needs a positive max |update|, got {peak!r}")
    return room / (contributors * peak)


def stochastic_round(scaled: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """Eq. (1): floor(x) + 1 with probability x - floor(x), else floor(x); unbiased. int64 out."""
    x = np.asarray(scaled, dtype=np.float64)
    low = np.floor(x)
    up = rng.random(x.shape) < (x - low)
    return (low + up).astype(np.int64)


def lane_dtype(bits: int) -> str:
    """The integer lane a b-bit signed sum travels in."""
    if bits <= 8:
        return "int8"
    if bits <= 16:
        return "int16"
    return "int32"


def lane_range(dtype: str) -> tuple[int, int]:
    info = np.iinfo(np.dtype(dtype))
    return int(info.min), int(info.max)
