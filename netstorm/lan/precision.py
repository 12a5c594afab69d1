"""Mixed-precision lanes (PAHInA): what a worker sending at fp16, bf16 or int8 puts on the wire, and the
exact int32 fixed-point value every lane stands for at the slot's common scale.

A worker's values are first rounded to its precision (``rounded``); that rounded value, times
``2**scale`` and rounded half to even (``numpy.rint``), is the fixed-point lane the aggregator adds. The
conversion is exact in float64 (fp16, bf16 and int8-times-a-power-of-two values times a power of two are
all representable), so the userspace fallback (``to_fixed``), the XDP program (integer shifts with
round-half-even, bpf/aggregator.c) and a numpy reference agree bit for bit. int8 lanes carry the sender's
own per-chunk scale (``wscale``) so small gradients keep their resolution.

Exact integers (a compressed job's rounds, at scale 0) travel narrow only where every one fits:
``integer_precision`` picks, from a round's narrow precision up, the first that carries all of a
contributor's integers exactly (int8 up to 127, fp16 up to 2048, else int32 lanes).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from netstorm.lan.header import Precision

INT8_MAX = 127
INTEGER_RANGE = {Precision.INT8: INT8_MAX, Precision.BF16: 256, Precision.FP16: 2048}
"""Largest |integer| each narrow precision carries exactly at scale 0 (int8 at a per-chunk wscale >= 0; the
significand of fp16 holds 11 bits, bf16's 8)."""


def int8_scales(matrix: np.ndarray) -> np.ndarray:
    """Per row, the largest scale at which every value rounds into -127..127 (0 for an all-zero row)."""
    peak = np.max(np.abs(matrix), axis=1)
    out = np.zeros(peak.shape, np.int64)
    nz = peak > 0
    guess = np.floor(np.log2(INT8_MAX / peak[nz])).astype(np.int64)
    guess -= (np.rint(peak[nz] * np.exp2(guess)) > INT8_MAX).astype(np.int64)
    out[nz] = np.clip(guess, -128, 127)
    return out


def _bf16_bits(matrix: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bits, rounded to nearest even (finite values only)."""
    bits = np.asarray(matrix, np.float32).view(np.uint32).astype(np.uint64)
    rounded_bits = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    return rounded_bits.astype("<u2")


def encode_lanes(matrix: np.ndarray, precision: Precision, wscales: np.ndarray) -> np.ndarray:
    """The lanes a worker at ``precision`` sends for a (chunks, lanes) float64 matrix."""
    if precision == Precision.FP16:
        return np.clip(matrix, -65504.0, 65504.0).astype("<f2").view("<u2")
    if precision == Precision.BF16:
        return _bf16_bits(matrix)
    if precision == Precision.INT8:
        q = np.rint(matrix * np.exp2(wscales.astype(np.float64))[:, None])
        return np.clip(q, -INT8_MAX, INT8_MAX).astype("i1")
    raise ValueError(f"{precision.name} lanes are fixed point already")


def decode_lanes(lanes: np.ndarray, precision: Precision, wscales: np.ndarray) -> np.ndarray:
    """The exact float64 values lanes of ``precision`` stand for (``wscales``: one per row, INT8 only)."""
    if precision == Precision.FP16:
        return np.asarray(lanes).view("<f2").astype(np.float64)
    if precision == Precision.BF16:
        bits = np.asarray(lanes).view("<u2").astype(np.uint32) << 16
        return bits.view(np.float32).astype(np.float64)
    if precision == Precision.INT8:
        return np.asarray(lanes).view("i1").astype(np.float64) * np.exp2(-np.asarray(wscales, np.float64))[..., None]
    raise ValueError(f"{precision.name} lanes are fixed point already")


def rounded(matrix: np.ndarray, precision: Precision, wscales: np.ndarray) -> np.ndarray:
    """A (chunks, lanes) float64 matrix as the worker's precision represents it (fp32 values unchanged)."""
    if precision == Precision.FIXED32:
        return np.asarray(matrix, np.float64)
    return decode_lanes(encode_lanes(matrix, precision, wscales), precision, wscales)


def to_fixed(lanes: np.ndarray, precision: Precision, wscale: int, scale: int) -> np.ndarray:
    """One datagram's lanes as int64 fixed point at ``scale`` (the aggregator's conversion)."""
    if precision == Precision.FIXED32:
        return np.asarray(lanes).view("<i4").astype(np.int64)
    values = decode_lanes(lanes, precision, np.asarray([wscale]))[0] if precision == Precision.INT8 else \
        decode_lanes(lanes, precision, np.zeros(0))
    return np.rint(values.reshape(-1) * 2.0**scale).astype(np.int64)


def worker_values(values: np.ndarray, precision: Precision, lanes: int) -> np.ndarray:
    """A flat tensor as a worker at ``precision`` contributes it, chunk by chunk of ``lanes`` elements
    (int8 scales are chosen per chunk): the reference a test or benchmark sums."""
    flat = np.asarray(values, np.float64).reshape(-1)
    chunks = -(-flat.size // lanes)
    matrix = np.zeros((chunks, lanes), np.float64)
    matrix.reshape(-1)[: flat.size] = flat
    wscales = int8_scales(matrix) if precision == Precision.INT8 else np.zeros(chunks, np.int64)
    return rounded(matrix, precision, wscales).reshape(-1)[: flat.size]


def integer_precision(tensors: Sequence[np.ndarray], narrowest: Precision) -> Precision:
    """The narrowest precision, ``narrowest`` or wider (fp16, then int32 lanes), that carries every integer
    of ``tensors`` exactly: how a contributor sends an integer round whose own values outgrew the round's
    narrow lanes. The aggregator widens every datagram to int32 before adding, so contributors of one slot
    may differ in precision and the sum stays exact."""
    if narrowest == Precision.FIXED32:
        return narrowest
    peak = max((float(np.max(np.abs(t), initial=0.0)) for t in tensors), default=0.0)
    for precision in (narrowest, Precision.FP16):
        if precision.lane_bytes >= narrowest.lane_bytes and peak <= INTEGER_RANGE[precision]:
            return precision
    return Precision.FIXED32
