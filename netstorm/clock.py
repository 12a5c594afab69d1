"""Synchronized time for one-way delays: an SNTP (RFC 4330) server and a software-corrected clock.

The scheduler answers SNTP on its control address; a node (or a FAPT child, against its parent) asks
with ``ntplib`` and keeps the estimated offset in software. The system clock is never touched. On one
emulation host every namespace shares the kernel's clock, so a node can be given an artificial
``skew``: its local clock reads ``time.time() + skew`` and the offset estimate must remove it.

Nodes sync to the scheduler, over the management path, rather than to their FAPT parent: a chain of
parents adds each hop's error, and SNTP packets on a data link queue behind chunks in one direction
only, an asymmetry that turns straight into offset error (half the queueing delay). Where a
deployment has no such path, a node can serve its own corrected clock with ``serve_sntp(..., clock.now)``
to its children. Of a few exchanges the least delayed one wins, which filters out queued samples.

``ntplib`` stamps its request and the reply's arrival with ``time.time()``, not with our local clock;
the offset it reports is relative to ``time.time()``. Our local clock differs from that by exactly
``skew``, so the offset of the local clock is ntplib's offset minus the skew: the same number a client
reading the skewed clock would have measured.
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import socket
import struct
import time
from collections.abc import Callable, Mapping
from typing import cast

import ntplib

from netstorm.errors import ConfigError, NetStormError

log = logging.getLogger(__name__)

SKEW_ENV = "NETSTORM_CLOCK_SKEW"
NTP_EPOCH_OFFSET = 2_208_988_800
"""Seconds from the NTP era 0 (1900-01-01) to the Unix epoch."""
PACKET = struct.Struct("!BBbb4s4s4sQQQQ")
"""SNTP header: LI|VN|mode, stratum, poll, precision, root delay, root dispersion, reference id,
reference, originate, receive and transmit timestamps (64-bit fixed point, 32.32)."""
MODE_CLIENT = 3
MODE_SERVER = 4
STRATUM = 1
REFERENCE_ID = b"LOCL"
PRECISION = -20
"""log2 seconds: about a microsecond, the resolution of ``time.time()`` stamps."""


class ClockSyncError(NetStormError):
    """No usable SNTP reply from the server within the timeout; the message names the server."""


def to_ntp(t: float) -> int:
    """Unix seconds as a 64-bit NTP timestamp."""
    return int((t + NTP_EPOCH_OFFSET) * 2**32) & 0xFFFF_FFFF_FFFF_FFFF


def from_ntp(stamp: int) -> float:
    """A 64-bit NTP timestamp as Unix seconds."""
    return stamp / 2**32 - NTP_EPOCH_OFFSET


def sntp_reply(request: bytes, received: float, clock: Callable[[], float]) -> bytes | None:
    """The mode-4 reply to a mode-3 request received at ``received`` (server time), or None to ignore it."""
    if len(request) < PACKET.size:
        return None
    first = request[0]
    version, mode = (first >> 3) & 0x7, first & 0x7
    if mode != MODE_CLIENT or not 1 <= version <= 4:
        return None
    poll = struct.unpack_from("!b", request, 2)[0]
    client_transmit = struct.unpack_from("!Q", request, 40)[0]
    # Originate <- the client's transmit stamp, copied bit for bit so the client can match the reply.
    return PACKET.pack(
        (0 << 6) | (version << 3) | MODE_SERVER, STRATUM, poll, PRECISION,
        b"\0\0\0\0", b"\0\0\0\x10", REFERENCE_ID,
        to_ntp(received), client_transmit, to_ntp(received), to_ntp(clock()),
    )


class SntpServer(asyncio.DatagramProtocol):
    """Answers SNTP client requests from ``clock``; anything else is counted and ignored."""

    def __init__(self, clock: Callable[[], float]) -> None:
        self.clock = clock
        self.transport: asyncio.DatagramTransport | None = None
        self.answered = 0
        self.ignored = 0

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.DatagramTransport, transport)

    def datagram_received(self, data: bytes, addr: tuple[str | bytes, int]) -> None:
        received = self.clock()
        reply = sntp_reply(data, received, self.clock)
        if reply is None or self.transport is None:
            self.ignored += 1
            return
        self.answered += 1
        self.transport.sendto(reply, addr)

    def error_received(self, exc: Exception) -> None:
        log.debug("sntp server: %s", exc)


async def serve_sntp(host: str, port: int, clock: Callable[[], float], *,
                     sock: socket.socket | None = None) -> asyncio.DatagramTransport:
    """Serve SNTP on UDP ``host:port`` (or on an already bound ``sock``) with time from ``clock``.

    Close the returned transport to stop."""
    loop = asyncio.get_running_loop()
    if sock is not None:
        transport, _ = await loop.create_datagram_endpoint(lambda: SntpServer(clock), sock=sock)
    else:
        transport, _ = await loop.create_datagram_endpoint(lambda: SntpServer(clock), local_addr=(host, port))
    return transport


class Clock:
    """Synchronized time for one process: the local (possibly skewed) clock plus the estimated offset."""

    def __init__(self, skew: float = 0.0) -> None:
        if not math.isfinite(skew):
            raise ValueError(f"clock skew must be finite, got {skew}")
        self.skew = skew
        self.offset = 0.0
        """Estimated (server - local) seconds, applied by ``now``."""
        self.delay: float | None = None
        """Round-trip delay of the sample the offset came from (None before the first sync)."""

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> Clock:
        """A Clock with the skew ``NETSTORM_CLOCK_SKEW`` (seconds) asks for, 0 when unset."""
        env = os.environ if environ is None else environ
        raw = env.get(SKEW_ENV, "").strip()
        if not raw:
            return cls()
        try:
            skew = float(raw)
        except ValueError:
            raise ConfigError(f"environment {SKEW_ENV}: expected seconds as a number, got {raw!r}") from None
        if not math.isfinite(skew):
            raise ConfigError(f"environment {SKEW_ENV}: must be finite, got {raw!r}")
        return cls(skew)

    def local(self) -> float:
        """The local clock, skew included, no correction."""
        return time.time() + self.skew

    def now(self) -> float:
        """Local time corrected by the estimated offset: the server's time scale."""
        return self.local() + self.offset

    async def sync(self, host: str, port: int, *, timeout: float, samples: int = 4) -> float:  # noqa: ASYNC109 (contract)
        """Estimate the offset to the SNTP server at ``host:port`` from the least-delayed of ``samples``
        exchanges, apply it, and return it. Raises ClockSyncError naming the server if none succeeds."""
        if samples <= 0:
            raise ValueError(f"samples must be positive, got {samples}")
        best: tuple[float, float] | None = None  # (delay, offset relative to time.time())
        failures: list[str] = []
        per_request = max(timeout / samples, 0.01)
        client = ntplib.NTPClient()
        try:
            async with asyncio.timeout(timeout):
                for _ in range(samples):
                    try:
                        stats = await asyncio.to_thread(client.request, host, 4, port, per_request)
                    except (ntplib.NTPException, OSError) as exc:
                        failures.append(str(exc))
                        continue
                    if best is None or stats.delay < best[0]:
                        best = (stats.delay, stats.offset)
        except TimeoutError:
            failures.append(f"timed out after {timeout} s")
        if best is None:
            raise ClockSyncError(f"clock sync with SNTP server {host}:{port} failed: "
                                 f"{'; '.join(failures) or 'no reply'}")
        self.delay, self.offset = best[0], best[1] - self.skew
        return self.offset

    async def keep_synced(self, host: str, port: int, *, interval: float, timeout: float) -> None:  # noqa: ASYNC109
        """Re-estimate the offset every ``interval`` seconds until cancelled; a failed round keeps the
        previous offset and is logged."""
        while True:
            try:
                await self.sync(host, port, timeout=timeout)
            except ClockSyncError as exc:
                log.warning("%s; keeping offset %.6f s", exc, self.offset)
            await asyncio.sleep(interval)
