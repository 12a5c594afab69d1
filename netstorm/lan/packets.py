"""Building whole tensors' datagrams at once in numpy: quantisation, headers and padding, no per-element loops."""

from __future__ import annotations

import itertools

import numpy as np

from netstorm.lan.errors import WireError
from netstorm.lan.fixedpoint import INT32_MAX, dequantize_rows
from netstorm.lan.header import (
    HEADER_BYTES,
    HEADER_DTYPE,
    MAGIC,
    NEED_NONE,
    OFFSETS,
    TOKEN_AT,
    VERSION,
    Flag,
    Kind,
    Precision,
)
from netstorm.lan.layout import EdgeLayout
from netstorm.lan.precision import encode_lanes, int8_scales, rounded
from netstorm.lan.prefault import populated
from netstorm.lan.resultwire import RESULT_DTYPES

EPOCH_AT = OFFSETS["epoch"]


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
    return scales_for_peaks(np.max(np.abs(matrix), axis=1))


def scales_for_peaks(peak: np.ndarray) -> np.ndarray:
    """``fit_scales`` from each row's largest magnitude (float64, finite)."""
    peak = np.asarray(peak, np.float64)
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
    if precision == Precision.FIXED32 and chunks is None:
        return _fixed_packets(layout, job=job, worker=worker, iteration=iteration, tensor=tensor, values=values,
                              scale=layout.scales[tensor] if scale is None else scale, token=token)
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
    rows["slot"] = layout.slot_numbers(layout.first_slot[tensor] + index, iteration)
    start = index * layout.lanes
    rows["count"] = np.minimum(layout.lanes, layout.sizes[tensor] - start)
    rows["scale"] = s
    rows["need"] = fit_scales(exact)
    rows["flags"] = np.where(overflow, int(Flag.OVERFLOW), 0)
    rows["precision"] = int(precision)
    rows["wscale"] = wscales
    return _assemble(rows, lanes)


QUANTISE_ROWS = 64
"""Rows ``_fixed_packets`` quantises per step (about 200 KB of float32 lanes at the widest datagram)."""


def _fixed_packets(layout: EdgeLayout, *, job: int, worker: int, iteration: int, tensor: int, values: np.ndarray,
                   scale: int, token: int) -> np.ndarray:
    """``data_packets`` of a whole fp32 tensor, quantised straight into the datagram rows.

    The general path pads the tensor into a float64 (chunks, lanes) matrix and makes a temporary per step
    (abs, scaled, overflow mask, clipped, int32, then the rows); at a few hundred thousand elements that
    was the larger part of a worker's CPU per datagram. Here the full chunks are a view of the tensor, each
    row's peak comes from one max and one min (NaN and inf propagate, so the finiteness check is on the
    peaks), overflow and ``need`` follow from the peaks alone (rint is monotonic), and the lanes are
    ``rint(x * 2**scale)`` in the tensor's own float32: the product of a float32 and a power of two is exact
    unless it is below 2**-126 (then it rounds to 0 either way) or it overflows, and a row that overflows is
    redone in float64 by the general rule (clipped to int32). The datagrams are bit for bit the general
    path's (tests/test_edge_batch.py)."""
    flat = np.asarray(values).reshape(-1)
    if flat.size != layout.sizes[tensor]:
        raise WireError(f"tensor {tensor} has {flat.size} elements, the layout says {layout.sizes[tensor]}")
    work = flat if flat.dtype == np.float32 else flat.astype(np.float64)
    n, width = layout.chunks[tensor], layout.lanes
    full = flat.size // width
    tail = np.zeros((n - full, width), work.dtype)
    tail.reshape(-1)[: flat.size - full * width] = work[full * width:]
    body = work[: full * width].reshape(full, width)
    peak = np.empty(n, np.float64)
    if full:
        peak[:full] = np.maximum(body.max(axis=1), -body.min(axis=1))
    if n > full:
        peak[full:] = np.abs(tail).max(axis=1)
    if not np.all(np.isfinite(peak)):
        raise WireError(f"tensor {tensor} contains inf or nan; it cannot be aggregated in fixed point")
    factor = 2.0**scale
    overflow = np.rint(peak * factor) > INT32_MAX
    out = populated((n, HEADER_BYTES + 4 * width), np.uint8)   # every byte is written below
    lanes = out[:, HEADER_BYTES:].view("<i4")
    # a few rows at a time through one small scratch that stays in cache, not a tensor-sized temporary
    scratch = np.empty((min(QUANTISE_ROWS, n), width), work.dtype)
    for first, block in ((0, body), (full, tail)):
        for at in range(0, len(block), QUANTISE_ROWS):
            part = block[at: at + QUANTISE_ROWS]
            scaled = scratch[: len(part)]
            with np.errstate(over="ignore"):     # an overflowing row becomes inf here, and is redone below
                np.multiply(part, work.dtype.type(factor), out=scaled)
            np.rint(scaled, out=scaled)
            scaled[overflow[first + at: first + at + len(part)]] = 0       # redone below, in float64
            lanes[first + at: first + at + len(part)] = scaled
    for row in np.flatnonzero(overflow):
        chunk = np.zeros(width, np.float64)
        part = flat[row * width: (row + 1) * width]
        chunk[: part.size] = part
        lanes[row] = np.clip(np.rint(chunk * factor), -INT32_MAX, INT32_MAX).astype("<i4")
    rows_ = header_rows(n, kind=Kind.DATA, job=job, worker=worker, iteration=iteration, token=token)
    index = np.arange(n)
    rows_["tensor"] = tensor
    rows_["chunk"] = index
    rows_["slot"] = layout.slot_numbers(layout.first_slot[tensor] + index, iteration)
    rows_["count"] = np.minimum(width, layout.sizes[tensor] - index * width)
    rows_["scale"] = scale
    rows_["need"] = scales_for_peaks(peak)
    rows_["flags"] = np.where(overflow, int(Flag.OVERFLOW), 0)
    rows_["precision"] = int(Precision.FIXED32)
    out[:, :HEADER_BYTES] = rows_.view(np.uint8).reshape(n, HEADER_BYTES)
    return out


def result_packets(layout: EdgeLayout, *, job: int, iteration: int, tensor: int, values: np.ndarray, total: int,
                   chunks: np.ndarray | None = None, precision: Precision = Precision.FIXED32) -> np.ndarray:
    """RESULT datagrams carrying one tensor's result lanes, a sum over ``total`` workers (token 0: the gateway
    sets each recipient's token on a copy, ``with_token``), at ``precision``: float32 (FIXED32's code) or, as
    ``netstorm.lan.resultwire.ResultWire.encode`` chose them, exact integers or bitmap bytes."""
    if not 0 < total <= 0xFFFFFFFF:
        raise WireError(f"a RESULT sums at least one worker and at most 2**32-1, got total {total}")
    matrix = chunk_matrix(layout, tensor, values)
    index = np.arange(layout.chunks[tensor]) if chunks is None else np.asarray(chunks, np.int64)
    rows = header_rows(len(index), kind=Kind.RESULT, job=job, worker=0, iteration=iteration)
    rows["total"] = total
    rows["tensor"] = tensor
    rows["chunk"] = index
    rows["slot"] = layout.slot_numbers(layout.first_slot[tensor] + index, iteration)
    rows["count"] = np.minimum(layout.lanes, layout.sizes[tensor] - index * layout.lanes)
    rows["need"] = NEED_NONE
    rows["precision"] = int(precision)
    return _assemble(rows, matrix[index].astype(RESULT_DTYPES[precision]))


def _result_headers(layout: EdgeLayout, seqs: np.ndarray, *, job: int, iteration: int,
                    total: int) -> tuple[np.ndarray, np.ndarray]:
    """The RESULT headers of single chunks ``seqs`` (as bytes, one row each) and each one's lane count."""
    if not 0 < total <= 0xFFFFFFFF:
        raise WireError(f"a RESULT sums at least one worker and at most 2**32-1, got total {total}")
    first = np.asarray(layout.first_slot, np.int64)
    tensor = np.searchsorted(first, seqs, side="right") - 1
    chunk = seqs - first[tensor]
    count = np.minimum(layout.lanes, np.asarray(layout.sizes, np.int64)[tensor] - chunk * layout.lanes)
    rows = header_rows(len(seqs), kind=Kind.RESULT, job=job, worker=0, iteration=iteration)
    rows["total"] = total
    rows["tensor"] = tensor
    rows["chunk"] = chunk
    rows["slot"] = layout.slot_numbers(seqs, iteration)
    rows["count"] = count
    rows["need"] = NEED_NONE
    return rows.view(np.uint8).reshape(len(seqs), HEADER_BYTES), count


def chunk_result_packets(layout: EdgeLayout, *, job: int, iteration: int, seqs: np.ndarray, raw: np.ndarray,
                         scales: np.ndarray, total: int) -> np.ndarray:
    """RESULT datagrams of single chunks (``seqs``: sequence numbers over the whole model) straight from their
    exact int32 sums ``raw`` (one row per chunk) and scales: each lane ``raw * 2**-scale`` rounded once to
    float32, the value ``result_packets`` of the whole tensor would carry, so a result can leave chunk by
    chunk as the chunks complete. Lanes past a tensor's end are zero, as there."""
    seqs = np.asarray(seqs, np.int64)
    heads, count = _result_headers(layout, seqs, job=job, iteration=iteration, total=total)
    out = np.empty((len(seqs), HEADER_BYTES + 4 * layout.lanes), np.uint8)
    out[:, :HEADER_BYTES] = heads
    lanes = out[:, HEADER_BYTES:].view("<f4")
    dequantize_rows(raw[seqs, : layout.lanes], scales[seqs], out=lanes)
    _zero_padding(lanes, count, layout.lanes)
    return out


def chunk_results_into(rows: np.ndarray, layout: EdgeLayout, *, job: int, iteration: int, seqs: np.ndarray,
                       raw: np.ndarray, scales: np.ndarray, total: int) -> list[np.ndarray]:
    """``chunk_result_packets`` written in place into ``rows`` (one row of ``HEADER_BYTES + 4 * lanes`` bytes
    per chunk of the model, row ``seq`` for chunk ``seq``), for ``seqs`` ascending and distinct: the lanes
    are converted straight into the datagrams (``dequantize_rows``), without a float64 copy or a second copy
    into ``rows``. Returns the rows written, as one view per run of consecutive chunks.

    When the runs lie close together (a batch with a few lost datagrams between its chunks) the whole span
    from the first to the last is converted in one pass: the rows between the runs belong to chunks not
    yet complete, whose row is written again, from their sum, when they complete (until then it is never
    sent or read), or to chunks complete before, whose row gets the same bytes again."""
    seqs = np.asarray(seqs, np.int64)
    if rows.shape[1] != HEADER_BYTES + 4 * layout.lanes:
        raise ValueError(f"RESULT rows of {layout.lanes} lanes do not fit rows of {rows.shape[1]} bytes")
    if not seqs.size:
        return []
    heads, count = _result_headers(layout, seqs, job=job, iteration=iteration, total=total)
    cuts = [0, *(np.flatnonzero(np.diff(seqs) != 1) + 1).tolist(), int(seqs.size)]
    lo, hi = int(seqs[0]), int(seqs[-1]) + 1
    if len(cuts) > 2 and hi - lo <= 2 * seqs.size:
        span = rows[lo:hi]
        dequantize_rows(raw[lo:hi, : layout.lanes], scales[lo:hi], out=span[:, HEADER_BYTES:].view("<f4"))
        rows[seqs, :HEADER_BYTES] = heads
        _zero_padding(rows[:, HEADER_BYTES:].view("<f4"), count, layout.lanes, seqs)
        return [rows[int(seqs[a]): int(seqs[b - 1]) + 1] for a, b in itertools.pairwise(cuts)]
    views = []
    for a, b in itertools.pairwise(cuts):
        first = int(seqs[a])
        view = rows[first: first + b - a]
        view[:, :HEADER_BYTES] = heads[a:b]
        lanes = view[:, HEADER_BYTES:].view("<f4")
        dequantize_rows(raw[first: first + b - a, : layout.lanes], scales[first: first + b - a], out=lanes)
        _zero_padding(lanes, count[a:b], layout.lanes)
        views.append(view)
    return views


def _zero_padding(lanes: np.ndarray, count: np.ndarray, width: int, at: np.ndarray | None = None) -> None:
    """Zero the lanes past each row's count (a tensor's last chunk); with ``at``, row ``i``'s count is of
    row ``at[i]`` of ``lanes``."""
    for i in np.flatnonzero(count < width).tolist():
        lanes[i if at is None else int(at[i]), count[i]:] = 0.0


def _assemble(rows: np.ndarray, lanes: np.ndarray) -> np.ndarray:
    out = np.empty((len(rows), HEADER_BYTES + lanes.dtype.itemsize * lanes.shape[1]), np.uint8)
    out[:, :HEADER_BYTES] = rows.view(np.uint8).reshape(len(rows), HEADER_BYTES)
    out[:, HEADER_BYTES:] = np.ascontiguousarray(lanes).view(np.uint8).reshape(len(rows), -1)
    return out


def ack_packets(seqs: np.ndarray, *, job: int, iteration: int, token: int = 0, per_packet: int = 256) -> list[bytes]:
    """ACK datagrams listing completed chunks' sequence numbers (u32 lanes), ``per_packet`` at most each."""
    return listing_packets(Kind.ACK, seqs, job=job, iteration=iteration, token=token, per_packet=per_packet)


def nack_packets(seqs: np.ndarray, *, job: int, iteration: int, token: int = 0, per_packet: int = 256,
                 epoch: int = 0) -> list[bytes]:
    """NACK datagrams asking one worker to resend the chunks ``seqs`` lists (u32 lanes), ``per_packet`` at
    most each: one datagram for every chunk the agent found that worker missing from, not one per chunk.
    ``epoch``: the sender's deployment epoch (a worker under another one asks for its part instead)."""
    return listing_packets(Kind.NACK, seqs, job=job, iteration=iteration, token=token, per_packet=per_packet,
                           epoch=epoch)


def cluster_nack_packet(layout: EdgeLayout, seq: int, *, job: int, iteration: int, token: int = 0) -> bytes:
    """The gateway's NACK to a cluster aggregator's service for chunk ``seq``: the chunk's tensor, chunk and
    slot in the header (the service reads that slot's contributor bitmap) and ``seq`` as its one listed lane
    (what the service lists in its own NACKs to the members that slot lacks)."""
    tensor, chunk = layout.locate(seq)
    rows = header_rows(1, kind=Kind.NACK, job=job, worker=0, iteration=iteration, token=token)
    rows["tensor"], rows["chunk"], rows["slot"] = tensor, chunk, int(layout.slot_numbers(seq, iteration))
    rows["scale"], rows["count"], rows["need"] = layout.scales[tensor], 1, NEED_NONE
    return rows.tobytes() + np.array([seq], "<u4").tobytes()


def listing_packets(kind: Kind, seqs: np.ndarray, *, job: int, iteration: int, token: int = 0,
                    per_packet: int = 256, epoch: int = 0) -> list[bytes]:
    """Datagrams of ``kind`` (ACK, QUERY or NACK) listing chunk sequence numbers as u32 lanes."""
    out = []
    seqs = np.asarray(seqs, "<u4")
    for start in range(0, len(seqs), per_packet):
        part = seqs[start: start + per_packet]
        rows = header_rows(1, kind=kind, job=job, worker=0, iteration=iteration, token=token)
        rows["count"] = len(part)
        rows["need"] = NEED_NONE
        rows["epoch"] = epoch
        out.append(rows.tobytes() + part.tobytes())
    return out


def set_epoch(rows: np.ndarray, epoch: int) -> np.ndarray:
    """Write the deployment ``epoch`` into the header of every datagram row (uint8, one per row), in place."""
    if len(rows):
        rows[:, EPOCH_AT: EPOCH_AT + 2] = np.frombuffer(epoch.to_bytes(2, "little"), np.uint8)
    return rows


def with_token(rows: np.ndarray, token: int) -> np.ndarray:
    """A copy of datagram rows (uint8, one per row) whose header carries ``token``."""
    out = rows.copy()
    out[:, TOKEN_AT: TOKEN_AT + 8] = np.frombuffer(token.to_bytes(8, "little"), np.uint8)
    return out


def control_packet(kind: Kind, *, job: int, worker: int, iteration: int = 0, tensor: int = 0, chunk: int = 0,
                   slot: int = 0, scale: int = 0, flags: Flag = Flag.NONE, token: int = 0, epoch: int = 0) -> bytes:
    """A lane-less datagram: HELLO, PULL, FAILED, MOVED, or a RESCALE NACK."""
    rows = header_rows(1, kind=kind, job=job, worker=worker, iteration=iteration, token=token)
    rows["epoch"] = epoch
    rows["tensor"], rows["chunk"], rows["slot"], rows["scale"], rows["flags"] = tensor, chunk, slot, scale, int(flags)
    rows["need"] = NEED_NONE
    return rows.tobytes()
