"""Passive one-way throughput probes: the model's own chunks measure the link they cross.

See docs/ARCHITECTURE.md, *The WAN tier: planning and the scheduler*."""

from __future__ import annotations

import math

from netstorm.control import LinkReport

__all__ = ["BITS_PER_MBIT", "LinkReport", "ProbeEstimator"]

BITS_PER_MBIT = 1e6


class ProbeEstimator:
    """Receiver-side estimator for one directed link; fed every chunk that crosses it, in arrival order."""

    def __init__(self, src: int, dst: int, *, probe_chunk_bytes: int, probe_chunk_num: int,
                 min_window_s: float = 0.0) -> None:
        if probe_chunk_bytes <= 0:
            raise ValueError(f"probe_chunk_bytes must be positive, got {probe_chunk_bytes}")
        if probe_chunk_num <= 0:
            raise ValueError(f"probe_chunk_num must be positive, got {probe_chunk_num}")
        if not (min_window_s >= 0 and math.isfinite(min_window_s)):
            raise ValueError(f"min_window_s must be a finite number >= 0, got {min_window_s}")
        self.min_window_s = min_window_s
        self.src = src
        self.dst = dst
        self.probe_chunk_bytes = probe_chunk_bytes
        self.probe_chunk_num = probe_chunk_num
        self._prev_last_byte = -math.inf
        self._samples: list[tuple[int, float, bool]] = []  # (bytes, effective duration, warm)
        self.dropped = 0
        """Samples discarded because their effective duration was not positive."""

    def on_chunk(self, nbytes: int, t_send: float, t_last_byte: float) -> LinkReport | None:
        """Account one chunk; returns a report when it completes a window of ``probe_chunk_num`` samples."""
        if nbytes < 0 or not (math.isfinite(t_send) and math.isfinite(t_last_byte)):
            raise ValueError(f"link {self.src}->{self.dst}: bad chunk stamp nbytes={nbytes} "
                             f"t_send={t_send} t_last_byte={t_last_byte}")
        prev = self._prev_last_byte
        self._prev_last_byte = max(prev, t_last_byte)
        if nbytes < self.probe_chunk_bytes:
            return None
        warm = t_send < prev
        duration = t_last_byte - max(t_send, prev)
        if duration <= 0.0:
            self.dropped += 1
            return None
        self._samples.append((nbytes, duration, warm))
        if len(self._samples) < self.probe_chunk_num:
            return None
        window = self._samples
        warm_samples = [s for s in window if s[2]]
        used = warm_samples or window
        total_bytes = sum(s[0] for s in used)
        total_time = sum(s[1] for s in used)
        if total_time < self.min_window_s:
            return None  # too short to trust its stamps: keep adding samples
        self._samples = []
        return LinkReport(self.src, self.dst, total_bytes * 8 / total_time / BITS_PER_MBIT, t_last_byte,
                          len(window), warm=bool(warm_samples))
