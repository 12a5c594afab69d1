"""Per-link sending counters from the kernel (``TCP_INFO``): how long a link was busy, and with what.

The question they answer is whether an iteration's time is the links' (some link busy for all of it,
so only the plan can help) or the runtime's (every link idle part of the time, waiting on aggregation,
on a queue or on the barrier). ``busy`` is the time the connection had data unacknowledged or unsent
(Linux's ``tcpi_busy_time``, which includes the time limited by the receive window or the send
buffer); ``acked`` the payload bytes the peer acknowledged. Both are cumulative; callers diff them.
"""

from __future__ import annotations

import collections
import dataclasses
import socket
import struct
from typing import Any

_TCP_INFO_LEN = 232
_OFFSETS = {"bytes_acked": 120, "notsent": 144, "busy_us": 168, "rwnd_limited_us": 176, "sndbuf_limited_us": 184}


@dataclasses.dataclass(frozen=True)
class LinkCounters:
    """Cumulative counters of one sending connection."""

    acked_bytes: int = 0
    busy_s: float = 0.0
    rwnd_limited_s: float = 0.0
    sndbuf_limited_s: float = 0.0
    notsent_bytes: int = 0

    def minus(self, earlier: LinkCounters) -> LinkCounters:
        """The counters accumulated since ``earlier`` (notsent is a level, kept as is)."""
        return LinkCounters(self.acked_bytes - earlier.acked_bytes, self.busy_s - earlier.busy_s,
                            self.rwnd_limited_s - earlier.rwnd_limited_s,
                            self.sndbuf_limited_s - earlier.sndbuf_limited_s, self.notsent_bytes)


def parse_tcp_info(raw: bytes) -> LinkCounters:
    """Counters from a ``TCP_INFO`` blob; a kernel too old for the chrono fields raises ValueError."""
    if len(raw) < _OFFSETS["sndbuf_limited_us"] + 8:
        raise ValueError(f"TCP_INFO of {len(raw)} bytes lacks the busy-time fields (Linux 4.10+)")

    def u64(name: str) -> int:
        return int(struct.unpack_from("<Q", raw, _OFFSETS[name])[0])

    return LinkCounters(acked_bytes=u64("bytes_acked"), busy_s=u64("busy_us") / 1e6,
                        rwnd_limited_s=u64("rwnd_limited_us") / 1e6,
                        sndbuf_limited_s=u64("sndbuf_limited_us") / 1e6,
                        notsent_bytes=int(struct.unpack_from("<I", raw, _OFFSETS["notsent"])[0]))


def read(sock: Any) -> LinkCounters | None:
    """The counters of a connected TCP socket (or uvloop's socket view); None where unavailable."""
    try:
        raw = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, _TCP_INFO_LEN)
        return parse_tcp_info(raw)
    except (OSError, ValueError, AttributeError):
        return None


class RateMeter:
    """A link's sending rate while it was backlogged, over its last ``window_s`` seconds of busy time.

    The sender samples the kernel's counters each time a frame has left. A step between two samples
    counts only when frames were waiting at the first of them, so the link was fed the whole step and
    its throughput is the link's, not the sender's: an application-limited step (one chunk, then a
    wait for the next) would otherwise read as a slow link wherever the round trip is long. Busy time
    stops while the link idles, so the window reaches back across the gaps between iterations.
    """

    def __init__(self, window_s: float = 0.5, min_s: float = 0.05) -> None:
        self.window_s = window_s
        self.min_s = min_s
        self._steps: collections.deque[tuple[float, int]] = collections.deque()
        self._busy_s = 0.0
        self._bytes = 0
        self._last: LinkCounters | None = None
        self._fed = False

    def sample(self, counters: LinkCounters, waiting: bool) -> None:
        """The link's counters now; ``waiting``: more frames wait to be sent after this one."""
        last, fed = self._last, self._fed
        self._last, self._fed = counters, waiting
        if last is None or not fed:
            return
        busy = counters.busy_s - last.busy_s
        acked = counters.acked_bytes - last.acked_bytes
        if busy <= 0 or acked < 0:  # no time passed in the kernel's clock, or a new connection
            return
        self._steps.append((busy, acked))
        self._busy_s += busy
        self._bytes += acked
        while len(self._steps) > 1 and self._busy_s - self._steps[0][0] >= self.window_s:
            old_busy, old_bytes = self._steps.popleft()
            self._busy_s -= old_busy
            self._bytes -= old_bytes

    @property
    def rate_bps(self) -> float | None:
        """Bytes per second over the window; None until it holds ``min_s`` of backlogged sending."""
        return self._bytes / self._busy_s if self._busy_s >= self.min_s else None

    @property
    def unsent_bytes(self) -> int:
        """Bytes the kernel held unsent at the last sample."""
        return self._last.notsent_bytes if self._last is not None else 0
