"""Awaitable non-blocking UDP send and receive on any event loop (uvloop lacks sock_sendto and
sock_recvfrom_into). A full send buffer makes the sender wait for writability: visible back-pressure."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Callable

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
