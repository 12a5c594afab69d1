"""Host CPU use from /proc/stat: a run that saturates the CPU measures the host, not the network."""

from __future__ import annotations

import os
from pathlib import Path

CPU_BOUND_PCT = 90.0
"""Mean host CPU use above this marks a result as CPU-bound."""


def _totals() -> tuple[int, int]:
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    return sum(fields[:8]), idle


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
        return {"mean_pct": round(_busy(self._first, _totals()), 1), "peak_pct": round(self.peak_pct, 1),
                "cpus": float(os.cpu_count() or 1)}


def _busy(a: tuple[int, int], b: tuple[int, int]) -> float:
    total = b[0] - a[0]
    if total <= 0:
        return 0.0
    return 100.0 * (1.0 - (b[1] - a[1]) / total)
