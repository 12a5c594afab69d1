"""The LAN worker's send window for one iteration: which chunks were sent and when, which came back
acknowledged, and the rules that take a chunk as lost (a gap below an acknowledged one, a stall, the tail
probe). Pure state over a clock the caller passes in, so tests drive it with plain numbers."""

from __future__ import annotations

import numpy as np

QUERY_CHUNKS = 256
"""Chunk numbers one QUERY datagram asks about (and the most chunks one wake-up takes as lost by a gap)."""
STALL_CHUNKS = 8
"""Oldest unacknowledged chunks resent when no ACK comes at all."""


class SendWindow:
    """Which chunks of one iteration were sent, when, and which came back acknowledged (the pool's window)."""

    def __init__(self, chunks: int, pool: int) -> None:
        self.pool = pool
        self.acked = np.zeros(chunks, bool)
        self.sent_at = np.full(chunks, np.inf)
        self.first_sent = np.full(chunks, np.inf)
        self.asked = np.zeros(chunks, bool)
        """Chunks a QUERY asked about (asked again only a timeout later)."""
        self.passed_at = np.full(chunks, np.inf)
        """When a later chunk's ACK first came for each chunk (a gap opened below it)."""
        self.resent_at = np.full(chunks, -np.inf)
        """When each chunk was last really sent again (not only asked about)."""
        self.next = 0
        """Chunks below this were sent at least once."""
        self.highest = 0
        """One past the highest chunk acknowledged."""
        self.last_ack = float("inf")
        """When the latest ACK came (inf until the first chunks are sent)."""
        self.backoff = 1
        self.opened = False
        """The latest ``sent`` started the stall's clock (the first window), so ``left`` moves it too."""
        self.final_sent = float("inf")
        """When the last chunk was first sent (the tail probe's clock starts there)."""
        self.probe_at = float("inf")
        """When the latest tail probe went out (inf: none yet)."""
        self.probes = 0
        """Tail probes since the last ACK that acknowledged something new (each doubles the next timeout)."""
        self.min_rtt = float("inf")
        """The shortest ACK round trip sampled in this iteration."""

    def sendable(self) -> tuple[int, int]:
        """The chunks [start, stop) the window allows now: chunk j once j < pool or chunk j - pool is acked."""
        start = self.next
        n = self.acked.size
        if start >= n:
            return start, start
        # chunk j needs chunk j - pool acknowledged, which was sent, so j < next + pool
        candidates = np.arange(start, min(n, start + self.pool))
        allowed = (candidates < self.pool) | self.acked[np.maximum(candidates - self.pool, 0)]
        return start, start + (int(np.argmin(allowed)) if not allowed.all() else candidates.size)

    def sent(self, start: int, stop: int, now: float) -> None:
        self.sent_at[start:stop] = now
        self.first_sent[start:stop] = now
        self.next = stop
        if stop == self.acked.size:
            self.final_sent = now
        if self.last_ack == float("inf"):
            self.last_ack = now
            self.opened = True

    def left(self, start: int, stop: int, now: float) -> None:
        """The first sends of [start, stop) were handed out at ``sent``'s time and the send carrying them
        returned at ``now``: their clocks start there, as the stall's when no ACK came meanwhile."""
        if self.opened:
            self.last_ack = now
            self.opened = False
        self.sent_at[start:stop] = now
        self.first_sent[start:stop] = now
        if stop == self.acked.size:
            self.final_sent = now

    def resent(self, index: np.ndarray, now: float, *, asked_only: bool = False) -> None:
        """``index`` went out again (or, ``asked_only``, was only asked about): its timeout starts over."""
        self.sent_at[index] = now
        if not asked_only:
            self.resent_at[index] = now

    def was_sent(self, index: int) -> bool:
        return index < self.next

    def ack(self, seqs: np.ndarray, now: float) -> tuple[float | None, float | None]:
        """Mark ``seqs`` acknowledged; an ACK round-trip sample from chunks sent once, if any, and a tail
        sample (the last chunk's first send to its ACK) if the last chunk is among them, sent once and never
        probed."""
        fresh = seqs[~self.acked[seqs]]
        self.acked[seqs] = True
        if not fresh.size:
            return None, None
        self.last_ack = now
        self.backoff = 1
        self.probes = 0
        highest = max(self.highest, int(fresh.max()) + 1)
        self.passed_at[self.highest: highest] = now
        self.highest = highest
        once = fresh[self.sent_at[fresh] == self.first_sent[fresh]]
        last = self.acked.size - 1
        tail = float(now - self.final_sent) if last in once and self.probe_at == float("inf") else None
        if not once.size:
            return None, tail
        self.min_rtt = min(self.min_rtt, float(now - np.max(self.sent_at[once])))
        return float(now - np.max(self.sent_at[once])), tail

    def _tail(self) -> int | None:
        """The newest unacknowledged chunk when every chunk was sent and no acknowledged one is above it
        (so no later ACK can reveal its loss), else None."""
        n = self.acked.size
        if self.next < n or self.acked[n - 1]:
            return None
        return n - 1

    def probe_due(self, now: float, pto: float, reorder: float) -> float:
        """Seconds until ``probe`` asks about the tail (inf: no tail outstanding). The tail is due ``reorder``
        after the chunk sent just before the last one was acknowledged (every worker sends the two back to
        back, so the last completes right after it unless a datagram was lost), else ``pto`` after the last
        first send; after a probe, not before ``reorder`` has passed, and while no ACK brings anything new,
        ``pto`` doubled per probe after it."""
        tail = self._tail()
        if tail is None:
            return float("inf")
        due = self.final_sent + pto
        if tail and self.acked[tail - 1]:
            due = min(due, self.last_ack + reorder)
        if self.probe_at < float("inf"):
            due = max(due, self.probe_at + (pto * 2 ** (self.probes - 1) if self.probes else reorder))
        return max(0.0, due - now)

    def probe(self, now: float, pto: float, reorder: float) -> int | None:
        """The chunk to probe now, if any: the newest (as TCP's tail loss probe sends its last segment),
        when ``probe_due`` has passed."""
        tail = self._tail()
        if tail is None or self.probe_due(now, pto, reorder) > 0:
            return None
        self.probe_at = now
        self.probes += 1
        return tail

    def late(self, now: float, grace: float, stall: float,
             reorder: float | None = None) -> tuple[np.ndarray, np.ndarray]:
        """Chunks taken as lost: (gap) unacknowledged ones older than a chunk already acknowledged (ACKs
        come back roughly in sending order, so a gap means a loss) once ``grace`` has passed since they were
        sent, at most QUERY_CHUNKS; (stalled) when no ACK came for ``stall`` seconds (doubled after every
        such round until an ACK comes, as TCP backs off: a slow peer is not a loss), the oldest few
        unacknowledged ones. With ``reorder`` (chunks are only asked about, which costs no data) a gap is
        due ``reorder`` after the later ACK came, not ``grace`` after its own send: the send-to-ACK time
        includes the queue of the whole window sent before it, while a later chunk's ACK shows at once that
        this one's datagrams went by; a chunk resent meanwhile (on the gateway's NACK) waits ``grace`` after
        that resend, and it is asked about again ``grace`` after each QUERY."""
        window = slice(0, self.next)
        open_ = ~self.acked[window]
        age = now - self.sent_at[window]
        below = open_ & (np.arange(self.next) < self.highest)
        if reorder is None:
            due = age > grace
        else:
            asked = self.asked[window]
            due = (age > grace) & (asked | (now - self.passed_at[window] > reorder))
        gap = np.flatnonzero(below & due)[:QUERY_CHUNKS]
        oldest = gap[:0]
        if now - self.last_ack > stall * self.backoff:
            oldest = np.flatnonzero(open_ & (age > stall * self.backoff))[:STALL_CHUNKS]
            if oldest.size:
                self.backoff = min(64, self.backoff * 2)
                self.last_ack = now
        return gap, oldest

    def gap_due(self, now: float, grace: float, reorder: float | None = None) -> float:
        """Seconds until ``late`` takes the first unacknowledged chunk below an acknowledged one (inf: none
        is below one)."""
        below = ~self.acked[: self.highest]
        if not below.any():
            return float("inf")
        due = self.sent_at[: self.highest] + grace
        if reorder is not None:
            due = np.where(self.asked[: self.highest], due, np.maximum(due, self.passed_at[: self.highest] + reorder))
        return max(0.0, float(due[below].min()) - now)

    def unacked(self) -> int:
        return int((~self.acked).sum())
