"""Host CPU use from /proc/stat: a run that saturates the CPU measures the host, not the network, and
on a virtual machine the hypervisor's steal time (CPU taken by other guests) slows every process of
the run the same way without showing as our own work."""

from __future__ import annotations

import os
from pathlib import Path

CPU_BOUND_PCT = 90.0
"""Mean host CPU use above this marks a result as CPU-bound."""
STEAL_WARN_PCT = 3.0
"""Mean steal time above this marks a result as shared with other guests: on a development host with
steal time, a fixed plan on exact rates ran markedly slower than in quiet runs (``results/DECISIONS.md``)."""


def parse_stat(text: str) -> tuple[int, int, int]:
    """(total, idle + iowait, steal) jiffies from /proc/stat's first line."""
    fields = [int(x) for x in text.split("\n", 1)[0].split()[1:]]
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)
    return sum(fields[:8]), idle, fields[7] if len(fields) > 7 else 0


def _totals() -> tuple[int, int, int]:
    return parse_stat(Path("/proc/stat").read_text())


class CpuMeter:
    """Busy share of all CPUs between samples, and over the meter's whole life."""

    def __init__(self) -> None:
        self._first = self._last = _totals()
        self.peak_pct = 0.0

    def sample(self) -> float:
        """Per cent busy (0-100, all CPUs together) since the previous sample."""
        now = _totals()
        pct = _busy(self._last, now)
        self._last = now
        self.peak_pct = max(self.peak_pct, pct)
        return pct

    def summary(self) -> dict[str, float]:
        now = _totals()
        return {"mean_pct": round(_busy(self._first, now), 1), "peak_pct": round(self.peak_pct, 1),
                "steal_pct": round(_steal(self._first, now), 1), "cpus": float(os.cpu_count() or 1)}


def _busy(a: tuple[int, int, int], b: tuple[int, int, int]) -> float:
    total = b[0] - a[0]
    if total <= 0:
        return 0.0
    return 100.0 * (1.0 - (b[1] - a[1]) / total)


def _steal(a: tuple[int, int, int], b: tuple[int, int, int]) -> float:
    total = b[0] - a[0]
    return 100.0 * (b[2] - a[2]) / total if total > 0 else 0.0
