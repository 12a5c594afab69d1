"""The TCP path's asyncio shell for one connection, both sides: a ``BufferedProtocol`` that receives into
``FrameReader``'s buffers (payloads straight into their numpy arrays) and hands every complete frame to
its owner, with visible back-pressure on the writing side (``drain``: the aiohttp pattern)."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Callable
from typing import cast

from netstorm.lan.errors import WireError
from netstorm.lan.tcpwire import Expect, Frame, FrameReader

HIGH_WATER = 4 << 20
"""Bytes a connection's transport buffers before its writer waits (``drain``)."""


class FrameProtocol(asyncio.BufferedProtocol):
    """One connection of the TCP path. ``on_frame`` is called with each frame (its payload view valid for
    the call only); ``on_error`` with the WireError that makes the connection unusable (malformed,
    refused, or the REFUSAL the other side sent) and ``on_lost`` once it is gone."""

    def __init__(self, expect: Expect, on_frame: Callable[[Frame, memoryview], None], *,
                 on_error: Callable[[WireError], None], on_lost: Callable[[Exception | None], None],
                 max_payload: int = 0) -> None:
        self.reader = FrameReader(expect, max_payload=max_payload)
        self.on_frame = on_frame
        self.on_error = on_error
        self.on_lost = on_lost
        self.transport: asyncio.Transport | None = None
        self._paused = False
        self._drained: asyncio.Future[None] | None = None
        self._lost = False
        self._failed: bytearray | None = None
        """Once a frame was refused: where further bytes go, unread (the connection is closing)."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports are not asyncio.Transport subclasses, but have its methods
        self.transport = cast(asyncio.Transport, transport)
        sock = transport.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.transport.set_write_buffer_limits(high=HIGH_WATER)

    def get_buffer(self, sizehint: int) -> memoryview:
        return memoryview(self._failed) if self._failed is not None else self.reader.buffer()

    def buffer_updated(self, nbytes: int) -> None:
        if self._failed is not None:
            return
        try:
            for message, payload in self.reader.advance(nbytes):
                self.on_frame(message, payload)
        except WireError as exc:
            self._failed = bytearray(1 << 16)   # nothing more is read into the owner's buffers
            self.on_error(exc)

    def write(self, header: bytes, payload: bytes | memoryview = b"") -> None:
        if self.transport is None or self.transport.is_closing():
            raise ConnectionError("the TCP edge connection is closed")
        self.transport.write(header)
        if len(payload):
            self.transport.write(payload)

    def pause_writing(self) -> None:
        self._paused = True

    def resume_writing(self) -> None:
        self._paused = False
        if self._drained is not None and not self._drained.done():
            self._drained.set_result(None)
        self._drained = None

    async def drain(self) -> None:
        """Wait until the transport's buffer is below its high-water mark (ConnectionError once lost)."""
        if self._lost:
            raise ConnectionError("the TCP edge connection is closed")
        if not self._paused:
            return
        if self._drained is None:
            self._drained = asyncio.get_running_loop().create_future()
        await self._drained

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()

    def refuse_and_close(self, linger: float) -> None:
        """After a REFUSAL was written: half-close, keep discarding what the peer still sends for ``linger``
        seconds, then close (closing with unread input would reset the connection and lose the REFUSAL)."""
        if self.transport is None or self.transport.is_closing():
            return
        if self._failed is None:
            self._failed = bytearray(1 << 16)
        if self.transport.can_write_eof():
            self.transport.write_eof()
        asyncio.get_running_loop().call_later(linger, self.close)

    def connection_lost(self, exc: Exception | None) -> None:
        self._lost = True
        if self._drained is not None and not self._drained.done():
            self._drained.set_exception(ConnectionError(f"the TCP edge connection was lost: {exc}"))
        self.on_lost(exc)
