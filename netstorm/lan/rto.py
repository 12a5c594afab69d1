"""The LAN worker's round-trip estimates and the timeouts that follow them: the gap's grace, the stall's RTO,
the tail's probe timeout (PTO) and the reorder allowance. The samples come from the send window's ACKs;
the ``retransmit`` floor is the deployment's."""

from __future__ import annotations

from netstorm.lan.sendwindow import SendWindow

MIN_PROBE = 0.0002
"""Shortest tail probe timeout (seconds): a floor against waking in a loop, far below any measured tail."""


class RetransmitTimers:
    """Smoothed ACK and tail round trips, kept across iterations, and the timeouts derived from them."""

    def __init__(self, retransmit: float = 0.005) -> None:
        self.retransmit = retransmit
        """The shortest wait before a chunk is taken as lost (the deployment's ``retransmit``)."""
        self.rtt = 0.0
        """Smoothed time from a chunk's first send to its ACK (queueing behind the window included)."""
        self.last_rtt = 0.0
        """The latest ACK round-trip sample."""
        self.tail_rtt = 0.0
        self.tail_var = 0.0
        """Smoothed time from an iteration's last first send to the last chunk's ACK, and its mean deviation."""
        self.min_rtt = float("inf")
        """The shortest ACK round trip of the iteration before (a chunk that queued behind nothing)."""

    def ack_sample(self, sample: float) -> None:
        self.rtt = sample if not self.rtt else 0.875 * self.rtt + 0.125 * sample
        self.last_rtt = sample

    def tail_sample(self, sample: float) -> None:
        if not self.tail_rtt:
            self.tail_rtt, self.tail_var = sample, sample / 2
        else:
            self.tail_var = 0.75 * self.tail_var + 0.25 * abs(sample - self.tail_rtt)
            self.tail_rtt = 0.875 * self.tail_rtt + 0.125 * sample

    def finished(self, window: SendWindow) -> None:
        """An iteration's every chunk was acknowledged: its shortest round trip bounds the next reorder."""
        if window.min_rtt < float("inf"):
            self.min_rtt = window.min_rtt

    def grace(self) -> float:
        """How long an unacknowledged chunk below an acknowledged one waits before it is taken as lost."""
        return max(self.retransmit, 1.25 * self.rtt)

    def recent(self) -> float:
        """A chunk resent more recently than this is not resent again on a NACK (its resend is on its way)."""
        return max(self.retransmit, self.rtt)

    def rto(self) -> float:
        """How long without any ACK before the oldest unacknowledged chunks are resent."""
        return max(4 * self.retransmit, 2 * self.rtt)

    def pto(self) -> float:
        """The tail probe's timeout from the iteration's last first send: the tail round trip of earlier
        iterations plus four mean deviations (TCP's RTO formula), or before the first tail sample two ACK
        round trips (TCP's tail loss probe, on the latest sample where it is longer); never past the RTO."""
        if self.tail_rtt:
            pto = self.tail_rtt + 4 * self.tail_var
        elif self.rtt:
            pto = 2 * max(self.rtt, self.last_rtt)
        else:
            return self.rto()
        return min(self.rto(), max(pto, MIN_PROBE))

    def reorder(self, window: SendWindow) -> float:
        """How long the last chunk's ACK may trail the ACK of the chunk sent just before it: the shortest ACK
        round trip of this iteration and the one before (the two complete a few datagrams apart)."""
        shortest = min(window.min_rtt, self.min_rtt)
        return max(MIN_PROBE, shortest if shortest < float("inf") else self.pto())
