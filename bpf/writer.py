"""The one task that writes a UDP socket of the LAN tier (the gateway's agent, a cluster aggregator): it
sends what its ``Outbox`` (netstorm/lan/outbox.py) says goes next, and treats a full buffer as back-pressure.

EAGAIN (the socket's send buffer is full, its datagrams wait in the interface's queue) waits for the socket
to be writable; ENOBUFS (the interface's queue refused the datagram) waits a pause growing from 1 ms to
64 ms. Either way the same batch is asked for again, so nothing is lost or reordered and memory stays what
the outbox holds. Any other error drops that batch (logged, counted): the protocol repeats what matters
(NACK timers, PULLs, QUERYs, members' resends), and the tier goes on.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import socket
import time

from netstorm.lan import udp
from netstorm.lan.outbox import Outbox

log = logging.getLogger(__name__)
YIELD_DATAGRAMS = 64
"""Datagrams sent before the loop may run the receivers (one GSO batch, or 64 single sends)."""
PAUSE_S = (0.001, 0.064)
"""First and longest pause after ENOBUFS."""


class SocketWriter:
    def __init__(self, sock: socket.socket, outbox: Outbox, *, who: str) -> None:
        self.sock = sock
        self.outbox = outbox
        self.who = who
        self.wake = asyncio.Event()
        """Set by whoever queues into the outbox: the writer looks again."""
        self.stalls = 0
        """Sends the kernel refused for a full buffer (EAGAIN, ENOBUFS), waited out."""
        self.errors = 0
        """Batches dropped for another send error."""

    async def run(self) -> None:
        pause = PAUSE_S[0]
        since_yield = 0
        while True:
            now = time.monotonic()
            batch = self.outbox.next(now)
            if batch is None:
                wake = self.outbox.wake_at(now)
                self.wake.clear()
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(None if wake is None else max(0.0, wake - now)):
                        await self.wake.wait()
                continue
            try:
                udp.send_segmented(self.sock, batch.data, batch.size, batch.address)
            except BlockingIOError:
                self.stalls += 1
                await self._writable()
                continue
            except OSError as exc:
                if exc.errno == errno.ENOBUFS:
                    self.stalls += 1
                    await asyncio.sleep(pause)
                    pause = min(2 * pause, PAUSE_S[1])
                    continue
                if batch.count > 1 and exc.errno in udp.NO_GSO_ERRNOS:
                    self.outbox.batch = 1   # no segmentation here: one datagram per call from now on
                    continue
                self.errors += 1
                log.warning("%s: %d datagram(s) to %s not sent: %s", self.who, batch.count, batch.address, exc)
            pause = PAUSE_S[0]
            self.outbox.done(batch, time.monotonic())
            since_yield += batch.count
            if since_yield >= YIELD_DATAGRAMS:
                since_yield = 0
                await asyncio.sleep(0)

    async def _writable(self) -> None:
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(1.0):   # a missed wake-up costs a second, never the tier
                await udp.writable(self.sock)
