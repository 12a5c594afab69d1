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


EXACT_FLOAT32_SCALES: Final = (-96, 126)
"""Scales at which an int32 lane rounded to float32 and then multiplied by 2**-scale is exactly the float64
product rounded once (``dequantize_rows``): 2**-scale and every non-zero product stay normal float32."""


def dequantize_rows(raw: np.ndarray, scales: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """Rows of exact int32 sums ``raw`` back to float32, row ``i`` times ``2**-scales[i]``, rounded once, into
    ``out`` (a float32 array of ``raw``'s shape, possibly a strided view into datagrams) or a new array.

    The same values as ``dequantize`` row by row, without its float64 temporaries: the int32 lane is rounded
    to float32 first (the one rounding), and multiplying by a power of two is exact while the product stays a
    normal float32 (``EXACT_FLOAT32_SCALES``). A row scaled outside that range goes through float64."""
    raw = np.asarray(raw)
    scales = np.asarray(scales, np.int64)
    if out is None:
        out = np.empty(raw.shape, np.float32)
    low, high = EXACT_FLOAT32_SCALES
    if scales.size and (int(scales.min()) < low or int(scales.max()) > high):
        np.multiply(raw, np.exp2(-scales.astype(np.float64))[:, None], out=out, casting="same_kind")
        return out
    np.copyto(out, raw, casting="unsafe")
    np.multiply(out, np.ldexp(np.ones(scales.size, np.float32), (-scales).astype(np.int32))[:, None], out=out)
    return out


def rescale_for(need: int, workers: int) -> int:
    """A scale at which ``workers`` values that each fit at ``need`` cannot overflow when summed."""
    return need - max(0, math.ceil(math.log2(max(1, workers))))
