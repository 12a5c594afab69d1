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

import socket
from typing import Final

import numpy as np

from netstorm.lan.header import (
    DATA_PRECISIONS,
    HEADER_BYTES,
    HEADER_DTYPE,
    LANED_KINDS,
    MAGIC,
    MAX_DEPLOY_BYTES,
    MAX_LANES,
    MAX_REPORT_BYTES,
    MAX_WORKERS,
    RESULT_PRECISIONS,
    VERSION,
    Flag,
    Kind,
    Precision,
)

ROW_BYTES: Final = HEADER_BYTES + 4 * MAX_LANES
"""The largest datagram the wire allows; a longer one is truncated on receipt and rejected."""
BATCH_ROWS: Final = 1024
"""Datagrams one batch holds (about 4 MB of buffer)."""
_LANED: Final = np.array([k in LANED_KINDS for k in range(256)])
"""Kinds whose payload is lanes (indexed by kind code)."""
_DATA_PRECISION: Final = np.array([p in {int(q) for q in DATA_PRECISIONS} for p in range(256)])
_RESULT_PRECISION: Final = np.array([p in {int(q) for q in RESULT_PRECISIONS} for p in range(256)])
_KNOWN: Final = np.array([k in {int(kind) for kind in Kind} for k in range(256)])
_LANE_BYTES: Final = np.array([Precision(p).lane_bytes if p in {int(q) for q in Precision} else 1
                               for p in range(256)], np.int64)


class DatagramBatch:
    """``rows`` datagram buffers of ``ROW_BYTES`` each and the length of what each holds (``count`` filled).

    ``lengths`` holds the length the datagram really had: a datagram longer than a row is marked longer
    than ``ROW_BYTES`` (truncated), which ``valid_headers`` rejects."""

    def __init__(self, rows: int = BATCH_ROWS) -> None:
        if rows < 1:
            raise ValueError(f"a batch holds at least one datagram, got {rows}")
        self.buf = np.zeros((rows, ROW_BYTES), np.uint8)
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


def valid_headers(headers: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """Which datagrams ``Header.decode`` accepts, for a batch at once: a bool per row.

    The same rules, in the same terms: the length holds a header, magic and version, a known kind, at most
    MAX_LANES lanes, a worker id below MAX_WORKERS, a known precision (a narrow one
    only on DATA, RESULT's own on RESULT), a payload that holds ``count`` lanes of that width (and at most
    MAX_LANES), a HELLO payload of at most MAX_DEPLOY_BYTES, a REPORT payload of at most MAX_REPORT_BYTES,
    no payload on the other kinds, known flags, ``total`` only on RESULT, and no payload on a RESCALE NACK.
    A row shorter than a header is rejected before its (stale) fields count."""
    lengths = np.asarray(lengths, np.int64)[: headers.size]
    kind = headers["kind"].astype(np.int64)
    precision = headers["precision"].astype(np.int64)
    count = headers["count"].astype(np.int64)
    payload = lengths - HEADER_BYTES
    width = _LANE_BYTES[precision]
    laned = _LANED[kind]
    lanes_fit = (payload % width == 0) & (width * count <= payload) & (payload <= width * MAX_LANES)
    hello = kind == Kind.HELLO
    report = kind == Kind.REPORT
    payload_ok = np.where(laned, lanes_fit, np.where(hello, payload <= MAX_DEPLOY_BYTES,
                                                     np.where(report, payload <= MAX_REPORT_BYTES, payload == 0)))
    precision_ok = (precision == Precision.FIXED32) | (_DATA_PRECISION[precision] & (kind == Kind.DATA)) | \
        (_RESULT_PRECISION[precision] & (kind == Kind.RESULT))
    ok = (lengths >= HEADER_BYTES) & (lengths <= ROW_BYTES)
    ok &= headers["magic"] == MAGIC
    ok &= headers["version"] == VERSION
    ok &= _KNOWN[kind]
    ok &= count <= MAX_LANES
    ok &= headers["worker"] < MAX_WORKERS
    ok &= precision_ok
    ok &= payload_ok
    ok &= headers["flags"] < 8
    ok &= (headers["total"] == 0) | (kind == Kind.RESULT)
    ok &= ~((kind == Kind.NACK) & ((headers["flags"] & int(Flag.RESCALE)) != 0) & ((count > 0) | (payload != 0)))
    return np.asarray(ok, bool)
