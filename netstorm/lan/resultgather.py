"""Where one iteration's RESULT lanes land on the LAN worker: a row per result chunk, scattered a batch at a
time by sequence number, in whatever precision each tensor's wire allows (netstorm/lan/resultwire.py)."""

from __future__ import annotations

import numpy as np

from netstorm.lan.batch import DatagramBatch, copy_rows, dequantize_into, distinct
from netstorm.lan.errors import WireError
from netstorm.lan.header import Precision
from netstorm.lan.prefault import populated
from netstorm.lan.resultwire import RESULT_DTYPES, ResultWire


class ResultGather:
    """One iteration's result as it arrives: the lanes (``out``), the chunks still ``missing`` and the
    worker count every RESULT carries (``total``)."""

    def __init__(self, back: ResultWire) -> None:
        self.back = back
        layout = back.layout
        self.allowed = back.allowed()
        """Which precision each tensor's datagrams may carry."""
        self.out = populated((layout.num_chunks, layout.lanes), np.float32)
        """One row of lanes (float32, exact) per chunk: read only once every row was written, so not cleared
        first; its pages are mapped at once, not faulted in as results arrive."""
        self.missing = np.ones(layout.num_chunks, bool)
        self.total = 0
        """``total`` of the RESULT datagrams (0 until the first arrives)."""
        self._chunks = np.asarray(layout.chunks, np.int64)
        self._first = np.asarray(layout.first_slot, np.int64)
        self._sizes = np.asarray(layout.sizes, np.int64)

    def complete(self) -> bool:
        return not self.missing.any()

    def take(self, batch: DatagramBatch, rows: np.ndarray, worker: int) -> tuple[np.ndarray, np.ndarray]:
        """Scatter the lanes of RESULT ``rows`` of ``batch`` to their chunks' rows; a row naming no chunk of the
        layout, or not exactly its lane count, is dropped. Returns the sequence numbers of every chunk a valid
        RESULT named (new or repeated) and the rows that were new. Raises WireError when the datagrams disagree
        on ``total``."""
        if not rows.size:
            return np.zeros(0, np.int64), rows
        heads = batch.headers()
        totals = heads["total"][rows]
        total = self.total or int(totals[0])
        if np.any(totals != total):
            raise WireError(f"edge worker {worker}: the RESULT datagrams of one iteration disagree on how "
                            f"many workers they sum ({sorted({total, *map(int, totals)})})")
        self.total = total
        layout = self.back.layout
        tensor = heads["tensor"][rows].astype(np.int64)
        chunk = heads["chunk"][rows].astype(np.int64)
        precision = heads["precision"][rows].astype(np.int64)
        known = tensor < len(layout.sizes)
        tensor = np.where(known, tensor, 0)
        known &= chunk < self._chunks[tensor]
        known &= heads["count"][rows] == np.minimum(layout.lanes, self._sizes[tensor] - chunk * layout.lanes)
        known &= self.allowed[tensor, precision]   # each tensor's datagrams carry what its format allows
        seq = self._first[tensor] + chunk
        fresh = known & self.missing[np.where(known, seq, 0)]
        named = seq[known]
        rows, seq, precision = rows[fresh], seq[fresh], precision[fresh]
        for code in distinct(precision).tolist():
            mine = precision == code
            if code == Precision.SCALED32:
                # the aggregate itself, from the aggregation program: converted as the agent converts its sums
                picked = rows[mine]
                dequantize_into(self.out, seq[mine], batch.lanes("<i4")[:, : layout.lanes], picked,
                                heads["scale"][picked])
                continue
            copy_rows(self.out, seq[mine], batch.lanes(RESULT_DTYPES[Precision(code)])[:, : layout.lanes],
                      rows[mine])
        self.missing[seq] = False
        return named, rows

    def split(self) -> list[np.ndarray]:
        """Each tensor's result lanes: a view of its chunks' rows, without the last chunk's padding."""
        layout = self.back.layout
        return [self.out[first: first + chunks].reshape(-1)[:size]
                for first, chunks, size in zip(layout.first_slot, layout.chunks, layout.sizes, strict=True)]

    def result(self) -> list[np.ndarray]:
        """Each tensor's elements, float32, decoded as the result travelled."""
        return self.back.decode(self.split())
