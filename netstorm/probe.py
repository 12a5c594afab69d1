"""Passive one-way throughput probes: the model's own chunks measure the link they cross.

The hop's sender stamps ``t_send`` (its synchronized clock) when a chunk's first byte is handed to the
socket; the receiver stamps ``t_last_byte`` (its own synchronized clock) when the chunk's last byte has
arrived. One ``ProbeEstimator`` per directed link turns these pairs into throughput reports without
sending a single byte of its own.

Effective duration. Chunks on one link share one TCP connection, so chunk i cannot start arriving
before chunk i-1 has finished arriving; time spent queued behind its predecessor (in the sender's
buffers, the socket, the shaper) is not the link's fault. The sample therefore starts at

    start_i = max(t_send_i, t_last_byte_{i-1})        d_i = t_last_byte_i - start_i

Every chunk, small or large, moves ``t_last_byte_{i-1}`` forward; only chunks of at least
``probe_chunk_bytes`` become samples.

Warm and cold samples. A *warm* sample (``t_send_i < t_last_byte_{i-1}``: the chunk was handed over
while its predecessor was still arriving) kept the pipe busy, so ``d_i`` is pure serialization time,
measured between two stamps of the receiver's own clock: immune to clock-sync error and latency.
Over a run of warm samples the durations telescope (their sum is the time between the run's first
and last stamps), so a late stamp inside a window costs nothing. What stays is real: a fresh TCP
connection's first megabytes arrive below the link's rate while its windows grow (the bound
``tests/test_probe_accuracy.py`` allows); the node's connections are long-lived, so this is paid
once per peer.

A *cold* sample (the link was idle when the chunk was sent) also carries the one-way propagation
delay, TCP's ramp-up after idle and the residual clock offset; it underestimates the rate.
A report is made every ``probe_chunk_num`` samples (the paper's PROBE_CHUNK_NUM, its Eq. 14 averaged
over the window), or more when those span less than ``min_window_s``: each stamp is late by however
long the receiver's event loop was busy (milliseconds), which against a window of a few small chunks on
a fast link (tens of milliseconds) made many reports far off:

    tau = sum(S_i) / sum(d_i)      over the window's warm samples when there are any,
                                   otherwise over all its (cold) samples

so a link that only ever carries one chunk at a time still gets reports (pessimistic by about one
latency per chunk, which is also what such a chunk really costs), while a link that streams is
measured exactly. Samples whose duration is not positive (a clock step, a stale stamp) are dropped.
"""

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
