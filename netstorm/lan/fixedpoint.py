"""Fixed-point quantisation of the LAN edge tier: gradients travel as int32 lanes ``rint(x * 2**scale)``.

Sums of int32 lanes are exact (the XDP program adds them in int64 and flags overflow), so the only
rounding is each worker's own quantisation and the final conversion back to float32. A scale is agreed
per tensor; an overflow is recovered by re-quantising at a smaller scale (``rescale_for``).
"""

from __future__ import annotations

import math
from typing import Final

import numpy as np

from netstorm.lan.errors import WireError
from netstorm.lan.header import NEED_NONE

INT32_MAX: Final = 2**31 - 1


def fit_scale(values: np.ndarray) -> int:
    """The largest power-of-two scale at which every value rounds into int32 (NEED_NONE for all zeros)."""
    peak = float(np.max(np.abs(values), initial=0.0))
    if peak == 0.0:
        return NEED_NONE
    if not math.isfinite(peak):
        raise WireError("gradient contains inf or nan; it cannot be aggregated in fixed point")
    # round(peak * 2**s) <= INT32_MAX  <=  peak * 2**s <= 2**31 - 1
    scale = math.floor(math.log2(INT32_MAX / peak))
    while scale > -128 and np.rint(peak * 2.0**scale) > INT32_MAX:
        scale -= 1
    return max(-128, min(NEED_NONE - 1, scale))


def quantize(values: np.ndarray, scale: int) -> tuple[np.ndarray, bool]:
    """``values`` as int32 lanes ``rint(x * 2**scale)`` and whether any value fell outside int32 (clipped)."""
    scaled = np.rint(np.asarray(values, np.float64) * 2.0**scale)
    overflow = bool(np.any(np.abs(scaled) > INT32_MAX))
    if overflow:
        np.clip(scaled, -INT32_MAX, INT32_MAX, out=scaled)
    return scaled.astype("<i4"), overflow


def dequantize(sums: np.ndarray, scale: int) -> np.ndarray:
    """Fixed-point sums back to float32: exact int64 sum times 2**-scale, rounded once."""
    return (np.asarray(sums, np.float64) * 2.0**-scale).astype(np.float32)


def rescale_for(need: int, workers: int) -> int:
    """A scale at which ``workers`` values that each fit at ``need`` cannot overflow when summed."""
    return need - max(0, math.ceil(math.log2(max(1, workers))))
