"""A LAN worker's sender paced to its planned rate (``dc_pace_rates``), sans-I/O.

PAHInA allocates each worker a rate and has the sender keep to it: a worker that sends faster than its
share only fills the queue of the link it shares with the others (its aggregator's port, the gateway's),
and the overflow costs everyone resends. ``Pace`` lets a batch leave once the bytes before it are paid
for at the rate. A sender that wakes late (timers are coarse) keeps that lateness as credit, up to
``depth`` bytes, so it does not fall below its rate; a sender that was idle longer starts afresh, one
batch at once and the next a batch's time later, so an iteration's first window is not a burst.
"""

from __future__ import annotations


class Pace:
    def __init__(self, bytes_per_s: float, *, depth: int = 65000) -> None:
        if not bytes_per_s > 0:
            raise ValueError(f"a pace must be positive bytes per second, got {bytes_per_s!r}")
        if depth < 1:
            raise ValueError(f"a pace's depth must be positive, got {depth!r}")
        self.bytes_per_s = float(bytes_per_s)
        self.depth = depth
        """Most bytes of lateness kept as credit: one GSO send (at most 65000 bytes)."""
        self._free_at: float | None = None
        """When the bytes charged so far are paid for (None: nothing charged yet)."""

    @classmethod
    def gbit(cls, gbit: float) -> Pace:
        return cls(gbit * 1e9 / 8)

    def delay(self, now: float) -> float:
        """Seconds to wait before the next batch may leave (0: now)."""
        if self._free_at is None:
            return 0.0
        return max(0.0, self._free_at - now)

    def charge(self, nbytes: int, now: float) -> None:
        """``nbytes`` left at ``now``."""
        slack = self.depth / self.bytes_per_s
        free_at = self._free_at
        start = free_at if free_at is not None and now - free_at <= slack else now
        self._free_at = max(start, now - slack) + nbytes / self.bytes_per_s
