"""Which iterations a LAN gateway receives: the window its tokens are installed for, and its horizon.

A sans-I/O rule the gateway's shell asks (bpf/agent.py). The window starts at the lowest iteration the
gateway may still receive (``expect``) and spans ``span`` iterations: its tokens are installed, and only its
iterations may open per-iteration state. The horizon is the newest iteration whose DATA the aggregator sums:
the one after the newest that completed or failed, and never below the window's start. No worker can send an
iteration past it (each needs every result of the one before), and a datagram that did would take over the
slot of a chunk still being summed: the aggregator refuses and counts it instead (``bound``).
"""

from __future__ import annotations

_WRAP = 2**32


def newer(a: int, b: int) -> bool:
    """Whether iteration ``a`` is after ``b``, compared modulo 2**32 as the aggregation program does."""
    return 0 < (a - b) % _WRAP < 2**31


class ReceiveWindow:
    """The iterations a gateway receives and the newest whose DATA it sums."""

    def __init__(self, span: int) -> None:
        self.span = span
        self.base: int | None = None
        """Lowest iteration the gateway may still receive (None: not yet known, any may come)."""
        self.installed = -1
        """Highest iteration whose tokens are installed."""
        self.completed: int | None = None
        """The newest iteration that completed (every chunk summed) or failed."""

    def expect(self, iteration: int) -> range | None:
        """Receive ``iteration`` and the ``span - 1`` after it from now on, nothing older: the iterations whose
        tokens are to be installed now (None: the window did not move)."""
        if self.base is not None and iteration <= self.base:
            return None
        self.base = iteration
        last = iteration + self.span - 1
        first = max(iteration, self.installed + 1)
        self.installed = max(self.installed, last)
        return range(first, last + 1)

    def complete(self, iteration: int) -> bool:
        """``iteration`` completed or failed: its workers may send the next one. Whether the horizon rose."""
        if self.completed is not None and not newer(iteration, self.completed):
            return False
        self.completed = iteration
        return True

    @property
    def horizon(self) -> int | None:
        """The newest iteration whose DATA is summed; None before the window is known (any may come)."""
        if self.base is None:
            return None
        if self.completed is None or not newer(self.completed + 1, self.base):
            return self.base
        return self.completed + 1

    def inside(self, iteration: int) -> bool:
        """Whether ``iteration`` is in the window (False while the window is not known)."""
        return self.base is not None and 0 <= iteration - self.base < self.span

    def beyond(self, iteration: int) -> bool:
        """Whether ``iteration`` is past the horizon: its DATA is refused."""
        horizon = self.horizon
        return horizon is not None and newer(iteration, horizon)
