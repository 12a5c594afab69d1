"""Datagrams taken a batch at a time: received into one preallocated buffer and parsed with numpy.

A LAN worker receives a RESULT per chunk of the model and ACKs as slots complete; the gateway's agent an
AGG per chunk. Decoding each into a ``Header`` (struct unpack, enum look-ups, a dataclass) and handling it
in Python cost more than the kernel spent delivering it. A ``DatagramBatch`` is a fixed buffer of rows
(one datagram each, up to the wire's largest) that ``udp.receive_batch`` fills with one system call
(``recvmmsg``); ``headers`` views the rows' headers as a structured array (``HEADER_DTYPE``), and
``valid_headers`` applies every rule of ``Header.decode`` to all of them at once, so a malformed or
hostile datagram is a False in a mask and never stops the others. Receivers then select rows by kind,
job, iteration and token and scatter their lanes with fancy indexing.

The buffer is allocated once: a batch never holds more than ``rows`` datagrams, whatever arrives.
"""

from __future__ import annotations

import itertools
import socket
from typing import Final

import numpy as np

from netstorm.lan.fixedpoint import dequantize_rows
from netstorm.lan.header import (
    DATA_PRECISIONS,
    HEADER_BYTES,
    HEADER_DTYPE,
    LANED_KINDS,
    MAGIC,
    MAX_LANES,
    MAX_WORKERS,
    RESULT_PRECISIONS,
    VERSION,
    Flag,
    Kind,
    Precision,
)
from netstorm.lan.kinds import MAX_PAYLOAD
from netstorm.lan.prefault import populated

ROW_BYTES: Final = HEADER_BYTES + 4 * MAX_LANES
"""The largest datagram the wire allows; a longer one is truncated on receipt and rejected."""
BATCH_ROWS: Final = 1024
"""Datagrams one batch holds (about 4 MB of buffer)."""
_LANED: Final = np.array([k in LANED_KINDS for k in range(256)])
"""Kinds whose payload is lanes (indexed by kind code)."""
_DATA_PRECISION: Final = np.array([p in {int(q) for q in DATA_PRECISIONS} for p in range(256)])
_RESULT_PRECISION: Final = np.array([p in {int(q) for q in RESULT_PRECISIONS} for p in range(256)])
_KNOWN: Final = np.array([k in {int(kind) for kind in Kind} for k in range(256)])
_BYTES_MOST: Final = np.zeros(256, np.int64)
_BYTES_MOST[[int(k) for k in MAX_PAYLOAD]] = list(MAX_PAYLOAD.values())
"""The payload limit of each kind whose payload is bytes (indexed by kind code; 0 for every other)."""
_LANE_BYTES: Final = np.array([Precision(p).lane_bytes if p in {int(q) for q in Precision} else 1
                               for p in range(256)], np.int64)


def _pair_tables() -> tuple[np.ndarray, ...]:
    """``valid_headers``' rules that depend only on (kind, precision), one entry per ``kind << 8 | precision``:
    whether the pair is allowed (a known kind; FIXED32, a narrow precision only on DATA, RESULT's own on
    RESULT), the payload's granule (the lane width, 1 for kinds without lanes), the bytes each of ``count``
    lanes needs (0 without lanes), the largest payload, whether ``total`` may be set (RESULT) and whether it
    is a NACK."""
    kind = np.repeat(np.arange(256), 256)
    precision = np.tile(np.arange(256), 256)
    width = _LANE_BYTES[precision]
    laned = _LANED[kind]
    pair_ok = _KNOWN[kind] & ((precision == Precision.FIXED32) | (_DATA_PRECISION[precision] & (kind == Kind.DATA))
                              | (_RESULT_PRECISION[precision] & (kind == Kind.RESULT)))
    most = np.where(laned, width * MAX_LANES, _BYTES_MOST[kind])
    return (pair_ok, np.where(laned, width, 1).astype(np.int64), np.where(laned, width, 0).astype(np.int64),
            most.astype(np.int64), kind == Kind.RESULT, kind == Kind.NACK)


_PAIR_OK, _WIDTH, _PER_LANE, _MAX_PAYLOAD, _TOTAL_OK, _IS_NACK = _pair_tables()
_RESCALE: Final = int(Flag.RESCALE)


class DatagramBatch:
    """``rows`` datagram buffers of ``ROW_BYTES`` each and the length of what each holds (``count`` filled).

    ``lengths`` holds the length the datagram really had: a datagram longer than a row is marked longer
    than ``ROW_BYTES`` (truncated), which ``valid_headers`` rejects."""

    def __init__(self, rows: int = BATCH_ROWS) -> None:
        if rows < 1:
            raise ValueError(f"a batch holds at least one datagram, got {rows}")
        self.buf = populated((rows, ROW_BYTES), np.uint8)   # mapped now, not page by page in the first batches
        self.buf.fill(0)
        self.lengths = np.zeros(rows, np.int64)
        self.names = np.zeros((rows, 16), np.uint8)
        """Each datagram's sender as the kernel wrote it (``struct sockaddr_in``)."""
        self.count = 0
        self.coalesced = 0
        """Buffers received holding several datagrams (UDP_GRO), over the batch's life."""
        self.staging: np.ndarray | None = None
        """Where a coalesced buffer (UDP_GRO) lands before its segments are cut into rows."""
        self.vectors: object = None
        """The receive vectors pointing at ``buf`` (``udp.receive_batch`` builds them on first use)."""

    @property
    def rows(self) -> int:
        return int(self.buf.shape[0])

    def clear(self) -> None:
        self.count = 0

    def put(self, data: bytes | bytearray | memoryview) -> bool:
        """Append one datagram already received (False when the batch is full)."""
        if self.count >= self.rows:
            return False
        n = len(data)
        kept = min(n, ROW_BYTES)
        self.buf[self.count, :kept] = np.frombuffer(data, np.uint8, count=kept)
        self.lengths[self.count] = n
        self.count += 1
        return True

    def address(self, row: int) -> tuple[str, int]:
        """The (IPv4 address, port) row ``row`` came from."""
        name = self.names[row].tobytes()
        return socket.inet_ntoa(name[4:8]), int.from_bytes(name[2:4], "big")

    def set_address(self, rows: slice | int, address: tuple[str, int]) -> None:
        """Record ``address`` as the sender of ``rows`` (a receive that did not fill ``names`` itself)."""
        self.names[rows, :8] = np.frombuffer(socket.AF_INET.to_bytes(2, "little") + address[1].to_bytes(2, "big") +
                                             socket.inet_aton(address[0]), np.uint8)

    def headers(self) -> np.ndarray:
        """The headers of the ``count`` datagrams held, as a structured view (no copy)."""
        return np.ndarray((self.count,), HEADER_DTYPE, buffer=self.buf, strides=(ROW_BYTES,))

    def lanes(self, dtype: str) -> np.ndarray:
        """Every row's payload as lanes of ``dtype`` (a view; what a row holds past its length is stale)."""
        return self.buf[: self.count, HEADER_BYTES:].view(dtype)

    def datagram(self, row: int) -> bytes:
        """Row ``row`` as the bytes received (for the rare kinds handled one at a time)."""
        return self.buf[row, : min(int(self.lengths[row]), ROW_BYTES)].tobytes()


def distinct(values: np.ndarray) -> np.ndarray:
    """The sorted distinct values of a 1-d array: ``np.unique`` without its per-call dispatch and masked-array
    check (whose first call also imports ``numpy.ma``, tens of milliseconds inside a process's first
    iteration), for the per-batch paths of the LAN tier."""
    out = np.sort(np.asarray(values).reshape(-1))
    if out.size > 1:
        out = out[np.concatenate(([True], out[1:] != out[:-1]))]
    return out


RUN_SEGMENTS: Final = 16
"""Most runs ``copy_rows`` copies one slice at a time before it gathers and scatters instead."""


def _runs(dst_rows: np.ndarray, src_rows: np.ndarray) -> list[int] | None:
    """Where ``dst_rows`` and ``src_rows`` both name consecutive rows: the bounds of each stretch, or None
    beyond RUN_SEGMENTS of them (then a gather and scatter is cheaper)."""
    cuts = np.flatnonzero((np.diff(dst_rows) != 1) | (np.diff(src_rows) != 1)) + 1
    if cuts.size >= RUN_SEGMENTS:
        return None
    return [0, *cuts.tolist(), int(dst_rows.size)]


def copy_rows(dst: np.ndarray, dst_rows: np.ndarray, src: np.ndarray, src_rows: np.ndarray) -> None:
    """``dst[dst_rows] = src[src_rows]`` (the later row where ``dst_rows`` repeats one), one slice copy per
    stretch where both name consecutive rows (aggregates or results of consecutive chunks received in order:
    one or a few stretches per batch, a lost datagram adds two) instead of a gather into a temporary and a
    scatter from it; beyond RUN_SEGMENTS stretches, the gather and scatter."""
    if not dst_rows.size:
        return
    bounds = _runs(dst_rows, src_rows)
    if bounds is None:
        dst[dst_rows] = src[src_rows]
        return
    for a, b in itertools.pairwise(bounds):
        to, since = int(dst_rows[a]), int(src_rows[a])
        dst[to: to + b - a] = src[since: since + b - a]


def dequantize_into(dst: np.ndarray, dst_rows: np.ndarray, src: np.ndarray, src_rows: np.ndarray,
                    scales: np.ndarray) -> None:
    """``dst[dst_rows] = src[src_rows] * 2**-scales`` rounded once to float32 (``fixedpoint.dequantize_rows``;
    ``scales``: one per row named), converted straight into ``dst`` a stretch at a time as ``copy_rows``
    copies: how a worker takes fixed-point results the aggregation program sent."""
    if not dst_rows.size:
        return
    bounds = _runs(dst_rows, src_rows)
    if bounds is None:
        dst[dst_rows] = dequantize_rows(src[src_rows], scales)
        return
    for a, b in itertools.pairwise(bounds):
        to, since = int(dst_rows[a]), int(src_rows[a])
        dequantize_rows(src[since: since + b - a], scales[a:b], out=dst[to: to + b - a])


def valid_headers(headers: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """Which datagrams ``Header.decode`` accepts, for a batch at once: a bool per row.

    The same rules, in the same terms: the length holds a header, magic and version, a known kind, at most
    MAX_LANES lanes, a worker id below MAX_WORKERS, a known precision (a narrow one
    only on DATA, RESULT's own on RESULT), a payload that holds ``count`` lanes of that width (and at most
    MAX_LANES), a HELLO payload of at most MAX_DEPLOY_BYTES, a REPORT payload of at most MAX_REPORT_BYTES,
    no payload on the other kinds, known flags, ``total`` only on RESULT, and no payload on a RESCALE NACK.
    A row shorter than a header is rejected before its (stale) fields count. The rules that depend only on
    the kind and the precision are looked up in tables made once (``_pair_tables``)."""
    lengths = np.asarray(lengths, np.int64)[: headers.size]
    code = (headers["kind"].astype(np.intp) << 8) | headers["precision"]
    count = headers["count"].astype(np.int64)
    flags = headers["flags"]
    payload = lengths - HEADER_BYTES
    ok = _PAIR_OK[code] & (lengths >= HEADER_BYTES) & (lengths <= ROW_BYTES)
    ok &= payload % _WIDTH[code] == 0
    ok &= _PER_LANE[code] * count <= payload
    ok &= payload <= _MAX_PAYLOAD[code]
    ok &= headers["magic"] == MAGIC
    ok &= headers["version"] == VERSION
    ok &= count <= MAX_LANES
    ok &= headers["worker"] < MAX_WORKERS
    ok &= flags < 8
    ok &= (headers["total"] == 0) | _TOTAL_OK[code]
    ok &= ~(_IS_NACK[code] & ((flags & _RESCALE) != 0) & ((count > 0) | (payload != 0)))
    return np.asarray(ok, bool)
