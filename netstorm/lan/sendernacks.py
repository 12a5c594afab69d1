"""The LAN worker's answers to the gateway's NACKs: which listed chunks it resends (each once, and not one
acknowledged already or resent within the round trip), and a RESCALE NACK's re-quantised chunk. Part of
``SenderCore`` (netstorm/lan/sendercore.py); the resends leave together, one segmented send per flush."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from netstorm.lan.batch import DatagramBatch, distinct
from netstorm.lan.errors import WireError
from netstorm.lan.header import HEADER_BYTES, HEADER_DTYPE, Flag, Header
from netstorm.lan.packets import data_packets
from netstorm.lan.senderactions import SendData

if TYPE_CHECKING:
    from netstorm.lan.sendercore import SenderCore


class NackAnswers:
    """The NACK rules of one worker's core, and the resends they queued since the last flush."""

    def __init__(self, core: SenderCore) -> None:
        self.core = core
        self.queued: list[np.ndarray] = []
        """Datagram rows NACKs asked for, sent together by ``flush``."""
        self.resent = 0
        """Chunks resent because a NACK named this worker."""
        self.rescaled = 0
        """Chunks re-quantised at a smaller scale on a RESCALE NACK."""

    def listed(self, batch: DatagramBatch, rows: np.ndarray, now: float) -> None:
        """Resend every chunk the NACK ``rows`` list (u32 sequence numbers), all at once: a number past the
        layout is ignored, one listed twice (or by several NACKs) is resent once, and a chunk acknowledged
        already or resent within the last round trip is not (every asker's QUERY brings this worker a NACK
        for the same loss)."""
        if not rows.size:
            return
        core = self.core
        keep, window = core.rows, core.window
        counts = batch.headers()["count"][rows].astype(np.int64)
        width = int(counts.max())
        if not width:
            return
        listed = batch.lanes("<u4")[rows, :width][np.arange(width) < counts[:, None]].astype(np.int64)
        index = distinct(listed[listed < keep.shape[0]])
        if window is not None:
            index = index[index < window.next]   # was sent at all
            index = index[~window.acked[index] & (now - window.resent_at[index] >= core.timers.recent())]
        if not index.size:
            return
        core.retransmitted += int(index.size)
        self.resent += int(index.size)
        self.queued.append(keep[index])
        if window is not None:
            window.resent(index, now)

    def rescale(self, head: Header, now: float) -> None:
        """Resend the chunk a RESCALE NACK names, re-quantised first when it asks for a smaller scale."""
        core = self.core
        keep, window, layout = core.rows, core.window, core.layout
        assert layout is not None and core.iteration is not None
        try:
            index = layout.seq(head.tensor, head.chunk)
        except WireError:
            return
        current = int(np.frombuffer(keep[index][:HEADER_BYTES].tobytes(), HEADER_DTYPE)["scale"][0])
        if head.flags & Flag.RESCALE and head.scale < current:   # a repeated request finds it done
            keep[index] = data_packets(layout, job=core.job, worker=core.worker, iteration=core.iteration,
                                       tensor=head.tensor, values=core.values[head.tensor],
                                       chunks=np.array([head.chunk]), scale=head.scale,
                                       token=core.tokens.worker(core.worker, core.iteration),
                                       precision=core.precision)[0]
            self.rescaled += 1
        if window is not None and not head.flags & Flag.RESCALE and (
                window.acked[index] or now - window.resent_at[index] < core.timers.recent()):
            return   # done already, or resent moments ago (several workers' QUERYs name the same chunk)
        if window is None or window.was_sent(index):
            core.retransmitted += 1
            self.resent += 1
            self.queued.append(keep[index: index + 1].copy())
            if window is not None:
                window.resent(np.array([index]), now)

    def flush(self) -> None:
        """Hand the queued resends to the core's sends as one set of rows (one segmented send)."""
        queued, self.queued = self.queued, []
        if queued:
            self.core.send(SendData(np.concatenate(queued) if len(queued) > 1 else queued[0], None, first=False))
