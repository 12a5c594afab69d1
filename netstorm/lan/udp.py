"""Awaitable non-blocking UDP send and receive on any event loop (uvloop lacks sock_sendto and
sock_recvfrom_into). A full send buffer makes the sender wait for writability: visible back-pressure."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Callable

import numpy as np

Address = tuple[str, int]


async def _ready(sock: socket.socket, add: Callable[..., None], remove: Callable[[int], object]) -> None:
    loop = asyncio.get_running_loop()
    ready: asyncio.Future[None] = loop.create_future()

    def wake() -> None:
        if not ready.done():
            ready.set_result(None)

    add(sock.fileno(), wake)
    try:
        await ready
    finally:
        remove(sock.fileno())


async def readable(sock: socket.socket) -> None:
    """Until ``sock`` has a datagram queued."""
    loop = asyncio.get_running_loop()
    await _ready(sock, loop.add_reader, loop.remove_reader)


async def sendto(sock: socket.socket, data: bytes, address: Address) -> None:
    loop = asyncio.get_running_loop()
    while True:
        try:
            sock.sendto(data, address)
            return
        except BlockingIOError:
            await _ready(sock, loop.add_writer, loop.remove_writer)


async def recvfrom_into(sock: socket.socket, buf: bytearray) -> tuple[int, Address]:
    while True:
        try:
            n, address = sock.recvfrom_into(buf)
            return n, address
        except BlockingIOError:
            await readable(sock)


UDP_SEGMENT = 103
"""Linux's UDP generic segmentation offload option (linux/udp.h): one send carries many datagrams."""
GSO_BYTES = 65000
"""Largest payload of one segmented send (the IPv4 datagram limit, less headers)."""
GSO_SEGMENTS = 64
"""Most datagrams one segmented send may carry (UDP_MAX_SEGMENTS)."""


class BatchSender:
    """Sends rows of equal-size datagrams with as few system calls as the kernel allows: UDP GSO (one
    ``sendmsg`` with ``UDP_SEGMENT`` per up to 64 datagrams, cut by the kernel, or by the NIC) where it is
    available, else one ``sendto`` per datagram. ``calls`` counts system calls, ``datagrams`` what they
    carried."""

    def __init__(self, sock: socket.socket, *, gso: bool = True) -> None:
        self.sock = sock
        self.gso = gso and hasattr(socket, "SOL_UDP")
        self.calls = 0
        self.datagrams = 0

    async def send(self, rows: np.ndarray, address: Address) -> None:
        """Send every row of ``rows`` (uint8, one datagram per row) to ``address``."""
        size = int(rows.shape[1])
        data = np.ascontiguousarray(rows).reshape(-1).data.cast("B")
        total = len(data)
        per = max(1, min(GSO_SEGMENTS, GSO_BYTES // size)) if self.gso else 1
        step = per * size
        at = 0
        while at < total:
            part = data[at: at + step]
            try:
                if per > 1 and len(part) > size:
                    self.sock.sendmsg([part], [(socket.SOL_UDP, UDP_SEGMENT, size.to_bytes(2, "little"))], 0,
                                      address)
                else:
                    self.sock.sendto(part, address)
            except BlockingIOError:
                loop = asyncio.get_running_loop()
                await _ready(self.sock, loop.add_writer, loop.remove_writer)
                continue
            except OSError as exc:
                if per == 1 or exc.errno not in (5, 22, 90, 95):   # EIO, EINVAL, EMSGSIZE, EOPNOTSUPP
                    raise
                self.gso = False    # no segmentation here: one datagram per call from now on
                per, step = 1, size
                continue
            self.calls += 1
            self.datagrams += len(part) // size
            at += len(part)


def multicast_from(sock: socket.socket, *, address: str = "0.0.0.0", ifindex: int = 0) -> None:
    """Send ``sock``'s multicast datagrams out of the interface with ``address`` or ``ifindex`` (the LAN),
    one hop only, and not back to this host."""
    import struct

    mreqn = struct.pack("4s4si", socket.inet_aton("0.0.0.0"), socket.inet_aton(address), ifindex)
    sock.setsockopt(socket.IPPROTO_IP, socket.IP_MULTICAST_IF, mreqn)
    sock.setsockopt(socket.IPPROTO_IP, socket.IP_MULTICAST_TTL, 1)
    sock.setsockopt(socket.IPPROTO_IP, socket.IP_MULTICAST_LOOP, 0)
