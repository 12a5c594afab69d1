"""Per-tensor iteration counters whose minimum is known without scanning them.

A node asks for the slowest tensor's iteration on every contribution and every pull (the ``max_ahead``
window, the chunk horizon). Scanning every counter each time made a push of n tensors cost O(n²): a
model of 20,000 small tensors blocked the node's loop for seconds, long enough to miss its heartbeats.
Counters only move forward, so the minimum is kept with the number of counters holding it, and
recomputed only when the last of them moves on: amortized O(1) per step. The counters are a Python
list, not a numpy array: one element read or written at a time, a list is many times faster.
"""

from __future__ import annotations


class Counters:
    """``size`` non-decreasing integer counters starting at ``start``; ``low`` is their minimum."""

    def __init__(self, size: int, start: int) -> None:
        self.values = [start] * size
        self.low = start
        self._at_low = size

    def __len__(self) -> int:
        return len(self.values)

    def __getitem__(self, key: int) -> int:
        return self.values[key]

    def step(self, key: int) -> None:
        """Counter ``key`` moves to its next iteration."""
        value = self.values[key]
        self.values[key] = value + 1
        if value == self.low:
            self._at_low -= 1
            if self._at_low == 0:
                self._recount()

    def raise_to(self, floor: int) -> None:
        """Every counter below ``floor`` moves to it (the iterations before it are over)."""
        if floor > self.low:
            self.values = [max(value, floor) for value in self.values]
            self._recount()

    def high(self) -> int:
        return max(self.values) if self.values else self.low

    def behind(self) -> list[int]:
        """The counters at the minimum."""
        return [key for key, value in enumerate(self.values) if value == self.low]

    def _recount(self) -> None:
        if not self.values:
            return
        self.low = min(self.values)
        self._at_low = self.values.count(self.low)
