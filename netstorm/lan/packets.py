"""Building whole tensors' datagrams at once in numpy: quantisation, headers and padding, no per-element loops."""

from __future__ import annotations

import numpy as np

from netstorm.lan.errors import WireError
from netstorm.lan.fixedpoint import INT32_MAX
from netstorm.lan.header import (
    HEADER_BYTES,
    HEADER_DTYPE,
    MAGIC,
    NEED_NONE,
    TOKEN_AT,
    VERSION,
    Flag,
    Kind,
    Precision,
)
from netstorm.lan.layout import EdgeLayout
from netstorm.lan.precision import encode_lanes, int8_scales, rounded


def chunk_matrix(layout: EdgeLayout, tensor: int, values: np.ndarray) -> np.ndarray:
    """``values`` as a (chunks, lanes) float64 matrix, zero-padded."""
    flat = np.asarray(values).reshape(-1)
    if flat.size != layout.sizes[tensor]:
        raise WireError(f"tensor {tensor} has {flat.size} elements, the layout says {layout.sizes[tensor]}")
    if not np.all(np.isfinite(flat)):
        raise WireError(f"tensor {tensor} contains inf or nan; it cannot be aggregated in fixed point")
    out = np.zeros((layout.chunks[tensor], layout.lanes), np.float64)
    out.reshape(-1)[: flat.size] = flat
    return out


def fit_scales(matrix: np.ndarray) -> np.ndarray:
    """Per row, the largest scale at which every value rounds into int32 (NEED_NONE for an all-zero row)."""
    peak = np.max(np.abs(matrix), axis=1)
    need = np.full(peak.shape, NEED_NONE, np.int64)
    nz = peak > 0
    guess = np.floor(np.log2(INT32_MAX / peak[nz])).astype(np.int64)
    guess -= (np.rint(peak[nz] * np.exp2(guess)) > INT32_MAX).astype(np.int64)
    need[nz] = np.clip(guess, -128, NEED_NONE - 1)
    return need


def header_rows(n: int, *, kind: Kind, job: int, worker: int, iteration: int, token: int = 0) -> np.ndarray:
    rows = np.zeros(n, HEADER_DTYPE)
    rows["token"] = token
    rows["magic"] = MAGIC
    rows["version"] = VERSION
    rows["kind"] = int(kind)
    rows["job"] = job
    rows["worker"] = worker
    rows["iteration"] = iteration & 0xFFFFFFFF
    return rows


def data_packets(layout: EdgeLayout, *, job: int, worker: int, iteration: int, tensor: int, values: np.ndarray,
                 chunks: np.ndarray | None = None, scale: int | None = None, token: int = 0,
                 precision: Precision = Precision.FIXED32) -> np.ndarray:
    """DATA datagrams (one row each, uint8) for the given chunks (default all) of one tensor, carrying the
    worker's ``token`` for the iteration, its lanes encoded at ``precision``.

    The values are first rounded to the worker's precision (``precision.rounded``); a row whose rounded
    values do not fit int32 at ``scale`` carries the OVERFLOW flag (its lanes will not be used); ``need``
    tells the gateway the scale at which they would fit."""
    matrix = chunk_matrix(layout, tensor, values)
    index = np.arange(layout.chunks[tensor]) if chunks is None else np.asarray(chunks, np.int64)
    matrix = matrix[index]
    s = layout.scales[tensor] if scale is None else scale
    wscales = int8_scales(matrix) if precision == Precision.INT8 else np.zeros(len(index), np.int64)
    exact = rounded(matrix, precision, wscales)
    scaled = np.rint(exact * 2.0**s)
    overflow = np.any(np.abs(scaled) > INT32_MAX, axis=1)
    if precision == Precision.FIXED32:
        np.clip(scaled, -INT32_MAX, INT32_MAX, out=scaled)
        lanes = scaled.astype("<i4")
    else:
        lanes = encode_lanes(matrix, precision, wscales)
    rows = header_rows(len(index), kind=Kind.DATA, job=job, worker=worker, iteration=iteration, token=token)
    rows["tensor"] = tensor
    rows["chunk"] = index
    rows["slot"] = (layout.first_slot[tensor] + index) % layout.num_slots
    start = index * layout.lanes
    rows["count"] = np.minimum(layout.lanes, layout.sizes[tensor] - start)
    rows["scale"] = s
    rows["need"] = fit_scales(exact)
    rows["flags"] = np.where(overflow, int(Flag.OVERFLOW), 0)
    rows["precision"] = int(precision)
    rows["wscale"] = wscales
    return _assemble(rows, lanes)


def result_packets(layout: EdgeLayout, *, job: int, iteration: int, tensor: int, values: np.ndarray, total: int,
                   chunks: np.ndarray | None = None) -> np.ndarray:
    """RESULT datagrams carrying float32 lanes of one tensor's result, a sum over ``total`` workers (token 0:
    the gateway sets each recipient's token on a copy, ``with_token``)."""
    if not 0 < total <= 0xFFFFFFFF:
        raise WireError(f"a RESULT sums at least one worker and at most 2**32-1, got total {total}")
    matrix = chunk_matrix(layout, tensor, values)
    index = np.arange(layout.chunks[tensor]) if chunks is None else np.asarray(chunks, np.int64)
    rows = header_rows(len(index), kind=Kind.RESULT, job=job, worker=0, iteration=iteration)
    rows["total"] = total
    rows["tensor"] = tensor
    rows["chunk"] = index
    rows["slot"] = (layout.first_slot[tensor] + index) % layout.num_slots
    rows["count"] = np.minimum(layout.lanes, layout.sizes[tensor] - index * layout.lanes)
    rows["need"] = NEED_NONE
    return _assemble(rows, matrix[index].astype("<f4"))


def _assemble(rows: np.ndarray, lanes: np.ndarray) -> np.ndarray:
    out = np.empty((len(rows), HEADER_BYTES + lanes.dtype.itemsize * lanes.shape[1]), np.uint8)
    out[:, :HEADER_BYTES] = rows.view(np.uint8).reshape(len(rows), HEADER_BYTES)
    out[:, HEADER_BYTES:] = np.ascontiguousarray(lanes).view(np.uint8).reshape(len(rows), -1)
    return out


def ack_packets(seqs: np.ndarray, *, job: int, iteration: int, token: int = 0, per_packet: int = 256) -> list[bytes]:
    """ACK datagrams listing completed chunks' sequence numbers (u32 lanes), ``per_packet`` at most each."""
    out = []
    seqs = np.asarray(seqs, "<u4")
    for start in range(0, len(seqs), per_packet):
        part = seqs[start: start + per_packet]
        rows = header_rows(1, kind=Kind.ACK, job=job, worker=0, iteration=iteration, token=token)
        rows["count"] = len(part)
        rows["need"] = NEED_NONE
        out.append(rows.tobytes() + part.tobytes())
    return out


def with_token(rows: np.ndarray, token: int) -> np.ndarray:
    """A copy of datagram rows (uint8, one per row) whose header carries ``token``."""
    out = rows.copy()
    out[:, TOKEN_AT: TOKEN_AT + 8] = np.frombuffer(token.to_bytes(8, "little"), np.uint8)
    return out


def control_packet(kind: Kind, *, job: int, worker: int, iteration: int = 0, tensor: int = 0, chunk: int = 0,
                   slot: int = 0, scale: int = 0, flags: Flag = Flag.NONE, token: int = 0) -> bytes:
    """A lane-less datagram: HELLO, NACK or PULL."""
    rows = header_rows(1, kind=kind, job=job, worker=worker, iteration=iteration, token=token)
    rows["tensor"], rows["chunk"], rows["slot"], rows["scale"], rows["flags"] = tensor, chunk, slot, scale, int(flags)
    rows["need"] = NEED_NONE
    return rows.tobytes()
