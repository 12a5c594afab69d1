"""TCP transport between general nodes: one connection per ordered pair, opened by the sender.

See docs/ARCHITECTURE.md, *The node: data plane, trainers, back-pressure*."""

from __future__ import annotations

import asyncio
import logging
import socket
import time
from collections.abc import Callable
from typing import cast

import numpy as np

from netstorm import auth, authconn
from netstorm.authconn import Credentials
from netstorm.errors import AuthError, ChunkError, ErrorCode, FrameError, NetStormError
from netstorm.frames import (
    PREFIX_SIZE,
    WIRE_FORMATS,
    ChunkHeader,
    ErrorFrame,
    Hello,
    Kind,
    Prefix,
    decode_header,
    decode_prefix,
)
from node import linkstats
from node.sendqueue import Outgoing, SendQueue

log = logging.getLogger("netstorm.node.peers")

STAGING_BYTES = 64 * 1024
WRITE_HIGH_WATER = 0
"""Bytes the transport may hold before it pauses the sender: none, the next frame waits in the queue."""
TLS_WRITE_HIGH_WATER = 1
"""The same over TLS (``wan_tls``): a TLS transport whose high-water mark is 0 pauses its writer even
when it holds nothing, and then never resumes it; with 1 it pauses only while bytes wait."""
SEND_LOWAT = 128 * 1024
"""Unsent bytes the kernel may hold per connection (TCP_NOTSENT_LOWAT): enough to keep a fast link busy
while the event loop comes round, little enough that the queue's order decides what goes next."""


class PeerError(NetStormError):
    """A connection to or from a peer failed; the message names the peer."""


OnHello = Callable[[Hello, "InboundProtocol"], None]
OnChunk = Callable[[int, ChunkHeader, np.ndarray, float], None]
OnLost = Callable[["InboundProtocol", str], None]
OnAdmit = Callable[[ChunkHeader], bool]
"""Checks a chunk's header before its payload is allocated: raises to reject it, False to stop reading
until ``InboundProtocol.resume`` (the node has no layout to check it against yet)."""
OnMade = Callable[["InboundProtocol"], None]


def _admit_all(header: ChunkHeader) -> bool:
    return True


class InboundProtocol(asyncio.BufferedProtocol):
    """Frames from one peer. Callbacks raise FrameError/ChunkError to reject the peer's input.

    Deadlines, one in every state: a connection that has not said Hello within ``hello_timeout``, one
    that stalls in the middle of a frame for ``frame_timeout`` (no byte arrives), one silent between
    frames for ``idle_timeout`` after its Hello (a live sender repeats its Hello as a keepalive) and one
    held for ``held_timeout`` are closed, so idle or half-sent connections cannot pile up. A chunk
    header is checked (``on_admit``) before its payload is allocated; while the node has no layout the
    connection stops reading (held: the bytes stay in the kernel and the sender's queue) instead of
    buffering chunks nobody can check."""

    def __init__(self, *, on_hello: OnHello, on_chunk: OnChunk, on_lost: OnLost, max_frame_bytes: int,
                 clock: Callable[[], float], on_admit: OnAdmit = _admit_all, on_made: OnMade | None = None,
                 hello_timeout: float | None = None, frame_timeout: float | None = None,
                 idle_timeout: float | None = None, held_timeout: float | None = None) -> None:
        self._on_hello = on_hello
        self._on_chunk = on_chunk
        self._on_lost = on_lost
        self._on_admit = on_admit
        self._on_made = on_made
        self._hello_timeout = hello_timeout
        self._frame_timeout = frame_timeout
        self._idle_timeout = idle_timeout
        self._held_timeout = held_timeout
        self._held_at = 0.0
        self._max_frame = max_frame_bytes
        self._clock = clock
        self._staging = bytearray(STAGING_BYTES)
        self._staging_view = memoryview(self._staging)
        self._fill = 0
        self._prefix: Prefix | None = None
        self._chunk: ChunkHeader | None = None
        self._payload: np.ndarray | None = None
        self._payload_bytes: memoryview | None = None
        self._payload_fill = 0
        self._held: ChunkHeader | None = None
        """A chunk header read while the node had no layout: reading stopped there."""
        self._closing = False
        self._timer: asyncio.TimerHandle | None = None
        self._last_read = 0.0
        self.rejected = False
        self.transport: asyncio.Transport | None = None
        self.peer_id: int | None = None
        self.proven: int | None = None
        """The node id this connection proved with the job secret (None without one): its Hello must claim it."""
        self.layout_hash = ""
        self.peername = "?"
        self.host = "?"
        self.frames = 0

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's transports are not subclasses
        peer = transport.get_extra_info("peername")
        self.peername = str(peer)
        self.host = str(peer[0]) if isinstance(peer, tuple) and peer else self.peername
        self._last_read = time.monotonic()
        self._arm()
        if self._on_made is not None:
            self._on_made(self)

    # ---- deadlines ----------------------------------------------------------------------------------

    @property
    def in_frame(self) -> bool:
        return self._prefix is not None or self._payload_bytes is not None or self._fill > 0

    def _deadline(self) -> tuple[float, str] | None:
        """When this connection is closed unless it makes progress, and why (None: no deadline)."""
        if self._closing:
            return None
        if self._held is not None:
            if self._held_timeout is None:
                return None
            return self._held_at + self._held_timeout, f"this node had no layout for {self._held_timeout:g} s"
        if self.peer_id is None and self._hello_timeout is not None:
            return self._last_read + self._hello_timeout, f"no Hello within {self._hello_timeout:g} s"
        if self.in_frame and self._frame_timeout is not None:
            return self._last_read + self._frame_timeout, f"stalled mid-frame for {self._frame_timeout:g} s"
        if not self.in_frame and self._idle_timeout is not None:
            return self._last_read + self._idle_timeout, f"silent for {self._idle_timeout:g} s"
        return None

    def _arm(self) -> None:
        if self._timer is not None or self._closing:
            return
        deadline = self._deadline()
        if deadline is not None:
            delay = max(0.0, deadline[0] - time.monotonic())
            self._timer = asyncio.get_running_loop().call_later(delay, self._expire)

    def _expire(self) -> None:
        self._timer = None
        deadline = self._deadline()
        if deadline is None:
            return
        if time.monotonic() >= deadline[0]:
            self.reject(f"closing connection from {self.peername}: {deadline[1]}", ErrorCode.TIMEOUT)
            return
        self._arm()

    # ---- reading ------------------------------------------------------------------------------------

    def get_buffer(self, sizehint: int) -> memoryview:
        if self._payload_bytes is not None:
            return self._payload_bytes[self._payload_fill:]
        return self._staging_view[self._fill:]

    def buffer_updated(self, nbytes: int) -> None:
        if self._closing:
            return
        try:
            self._last_read = time.monotonic()
            if self._payload_bytes is not None:
                self._payload_fill += nbytes
                if self._payload_fill == len(self._payload_bytes):
                    self._finish_chunk()
                    self._parse_staging()
                return
            self._fill += nbytes
            self._parse_staging()
        except (FrameError, ChunkError) as exc:
            self.reject(str(exc), exc.code)
        finally:
            self._arm()

    def resume(self) -> None:
        """The node can check chunks now (its layout exists): go on with a held chunk and read again."""
        header, self._held = self._held, None
        if header is None or self._closing:
            return
        assert self.transport is not None
        self.transport.resume_reading()
        self._last_read = time.monotonic()
        try:
            pos = self._start_chunk(header, 0)
            if pos is not None:
                self._compact(pos)
                self._parse_staging()
        except (FrameError, ChunkError) as exc:
            self.reject(str(exc), exc.code)
        finally:
            self._arm()

    def _compact(self, pos: int) -> None:
        rest = self._fill - pos
        if rest and pos:
            self._staging[:rest] = self._staging[pos:self._fill]
        self._fill = rest

    def _start_chunk(self, header: ChunkHeader, pos: int) -> int | None:
        """Admit ``header`` and take its payload from the staging buffer at ``pos``; the position after
        it when it is complete, None when the rest is to be read straight into the payload (or reading
        stopped until the node has a layout)."""
        if not self._on_admit(header):
            self._held = header
            self._held_at = time.monotonic()
            self._compact(pos)
            assert self.transport is not None
            self.transport.pause_reading()
            return None
        view = self._staging_view
        payload = np.empty(header.payload_items, dtype=WIRE_FORMATS[header.dtype])
        raw = payload.data.cast("B")
        take = min(self._fill - pos, len(raw))
        raw[:take] = view[pos:pos + take]
        pos += take
        self._chunk, self._payload, self._payload_bytes, self._payload_fill = header, payload, raw, take
        if take == len(raw):
            self._finish_chunk()
            return pos
        self._compact(pos)
        return None

    def _parse_staging(self) -> None:
        view = self._staging_view
        pos = 0
        while not self._closing and self._held is None and self._payload_bytes is None:
            available = self._fill - pos
            if self._prefix is None:
                if available < PREFIX_SIZE:
                    break
                self._prefix = decode_prefix(view[pos:pos + PREFIX_SIZE], max_frame_bytes=self._max_frame)
                pos += PREFIX_SIZE
                continue
            prefix = self._prefix
            if available < prefix.header_len:
                break
            header = decode_header(prefix, view[pos:pos + prefix.header_len])
            pos += prefix.header_len
            self._prefix = None
            self.frames += 1
            if isinstance(header, ChunkHeader):
                if self.peer_id is None:
                    raise FrameError("chunk before Hello")
                if header.src != self.peer_id:
                    raise FrameError(f"chunk claims to come from node {header.src} on node {self.peer_id}'s "
                                     f"connection")
                after = self._start_chunk(header, pos)
                if after is None:
                    return  # compacted already: the payload (or the layout) comes first
                pos = after
                continue
            if isinstance(header, Hello):
                # A repeated Hello is the sender's keepalive (it may name the layout the first lacked).
                if self.peer_id is not None and header.node_id != self.peer_id:
                    raise FrameError(f"Hello as node {header.node_id} on node {self.peer_id}'s connection")
                self._on_hello(header, self)
                self.peer_id = header.node_id
            else:
                raise FrameError(f"peer sent an Error frame: {header.message}")
        if not self._closing:
            self._compact(pos)

    def _finish_chunk(self) -> None:
        header, payload = self._chunk, self._payload
        assert header is not None and payload is not None and self.peer_id is not None
        self._chunk = self._payload = self._payload_bytes = None
        self._payload_fill = 0
        self._on_chunk(self.peer_id, header, payload, self._clock())

    def reject(self, message: str, code: ErrorCode = ErrorCode.PROTOCOL) -> None:
        """Tell the peer why (``code`` for its program, ``message`` for people), close the connection; the
        node keeps serving everyone else."""
        if self._closing or self.transport is None:
            return
        self._closing = True
        self.rejected = True
        who = f"node {self.peer_id}" if self.peer_id is not None else f"peer {self.peername}"
        log.warning("rejecting %s: %s", who, message)
        self.transport.write(ErrorFrame(message, code).encode())
        self.transport.close()

    def close(self) -> None:
        """Close without a word (a newer connection from the same member replaced this one)."""
        if self._closing or self.transport is None:
            return
        self._closing = True
        self.transport.close()

    def eof_received(self) -> bool | None:
        return None

    def connection_lost(self, exc: Exception | None) -> None:
        reason = f"connection closed{' mid-frame' if self.in_frame else ''}" + (f": {exc}" if exc else "")
        self._closing = True
        self._held = None
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._on_lost(self, reason)


class OutboundProtocol(asyncio.Protocol):
    """The sending side's view of a connection: write flow control and the receiver's Error frame."""

    def __init__(self, peer_id: int) -> None:
        self.peer_id = peer_id
        self.transport: asyncio.Transport | None = None
        self._paused = False
        self._drain: asyncio.Future[None] | None = None
        self._incoming = bytearray()
        self.closed: asyncio.Future[str] = asyncio.get_running_loop().create_future()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)
        tls = transport.get_extra_info("ssl_object") is not None
        self.transport.set_write_buffer_limits(high=TLS_WRITE_HIGH_WATER if tls else WRITE_HIGH_WATER)
        sock = transport.get_extra_info("socket")
        lowat = getattr(socket, "TCP_NOTSENT_LOWAT", None)
        if sock is not None and lowat is not None:
            try:
                sock.setsockopt(socket.IPPROTO_TCP, lowat, SEND_LOWAT)
            except OSError as exc:  # not fatal: the link still works, with the kernel's deeper buffer
                log.warning("connection to node %d: cannot limit unsent bytes: %s", self.peer_id, exc)

    def pause_writing(self) -> None:
        self._paused = True

    def resume_writing(self) -> None:
        self._paused = False
        if self._drain is not None and not self._drain.done():
            self._drain.set_result(None)

    async def drain(self) -> None:
        if self.closed.done():
            raise PeerError(f"connection to node {self.peer_id} lost: {self.closed.result()}")
        if not self._paused:
            return
        self._drain = asyncio.get_running_loop().create_future()
        waiters: list[asyncio.Future[object]] = [self._drain, self.closed]  # type: ignore[list-item]
        await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
        if self.closed.done():
            raise PeerError(f"connection to node {self.peer_id} lost: {self.closed.result()}")

    def data_received(self, data: bytes) -> None:
        self._incoming += data
        if len(self._incoming) < PREFIX_SIZE:
            return
        try:
            prefix = decode_prefix(self._incoming[:PREFIX_SIZE], max_frame_bytes=1 << 20)
            if prefix.kind is not Kind.ERROR:
                raise FrameError(f"unexpected {prefix.kind.name} frame on a sending connection")
            if len(self._incoming) < PREFIX_SIZE + prefix.header_len:
                return
            message = ErrorFrame.decode(self._incoming[PREFIX_SIZE:PREFIX_SIZE + prefix.header_len]).message
            reason = f"node {self.peer_id} rejected us: {message}"
        except FrameError as exc:
            reason = f"node {self.peer_id} sent garbage: {exc}"
        if not self.closed.done():
            self.closed.set_result(reason)
        assert self.transport is not None
        self.transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.closed.done():
            self.closed.set_result(f"connection to node {self.peer_id} closed" + (f": {exc}" if exc else ""))
        if self._drain is not None and not self._drain.done():
            self._drain.set_result(None)


class PeerLink:
    """The sending half towards one peer: a queue and the task that drains it."""

    def __init__(self, *, peer_id: int, address: tuple[str, int], hello: Callable[[], Hello],
                 clock: Callable[[], float], connect_timeout: float, stall_timeout: float = 300.0,
                 on_progress: Callable[[int, Outgoing | None], None] | None = None,
                 credentials: Credentials | None = None, node_id: int = 0, keepalive: float | None = None) -> None:
        self.peer_id = peer_id
        self._keepalive = keepalive
        """Seconds an open connection may go without a frame before its Hello is sent again, so the
        receiver's idle deadline never closes a live link (None: never)."""
        self._credentials = credentials
        """With a job secret, a connection proves this is node ``node_id`` before its Hello."""
        self._node_id = node_id
        self._on_progress = on_progress
        """Called with ``peer_id`` and the frame after each frame left (the queue may have run empty), and
        with None when the link starts with nothing to send: an event for the node's shell, which may
        queue frames here in answer."""
        self.address = address
        self._hello = hello
        self._clock = clock
        self._connect_timeout = connect_timeout
        self._stall_timeout = stall_timeout
        self._queue = SendQueue()
        self._tickets: dict[int, Outgoing] = {}
        self._wakeup = asyncio.Event()
        self._closing = False
        self.queued_bytes = 0
        self.sent_frames = 0
        self.sent_bytes = 0
        self.protocol: OutboundProtocol | None = None
        self.meter = linkstats.RateMeter()
        """The rate this link sends at while frames wait (what auxiliary path decisions compare)."""

    def counters(self) -> linkstats.LinkCounters | None:
        """The kernel's cumulative counters of this link's connection (None before it is open)."""
        transport = self.protocol.transport if self.protocol is not None else None
        if transport is None:
            return None
        return linkstats.read(transport.get_extra_info("socket"))

    @property
    def backlog_bytes(self) -> int:
        """Bytes waiting for this link: queued here and unsent in the kernel at the last sample."""
        return self.queued_bytes + self.meter.unsent_bytes

    def enqueue(self, item: Outgoing) -> None:
        self._queue.push(item)
        self.queued_bytes += item.payload.nbytes
        if item.ticket is not None:
            self._tickets[item.ticket] = item
        self._wakeup.set()

    def tickets(self) -> tuple[int, ...]:
        """The tickets of the frames still queued here (not yet handed to the socket)."""
        return tuple(self._tickets)

    def last(self, wanted: Callable[[Outgoing], bool]) -> Outgoing | None:
        """The queued frame that would leave last among those ``wanted`` accepts."""
        return self._queue.last(wanted)

    def count(self, wanted: Callable[[Outgoing], bool]) -> int:
        """How many queued frames ``wanted`` accepts."""
        return self._queue.count(wanted)

    def take_back(self, ticket: int) -> Outgoing:
        """Remove the queued frame named ``ticket``; it will not be sent on this link."""
        item = self._tickets.pop(ticket)
        self._queue.remove(item)
        self.queued_bytes -= item.payload.nbytes
        return item

    @property
    def idle(self) -> bool:
        """Nothing queued here (the kernel may still hold the last frame's bytes)."""
        return not self._queue

    def close(self) -> None:
        """Stop after the queue is empty."""
        self._closing = True
        self._wakeup.set()

    async def _connect(self) -> OutboundProtocol:
        host, port = self.address
        try:
            async with asyncio.timeout(self._connect_timeout):
                _, protocol = await authconn.create_connection(
                    lambda: OutboundProtocol(self.peer_id), host, port, self._credentials, plane=auth.Plane.DATA,
                    me=auth.node(self._node_id), timeout=self._connect_timeout)
        except (OSError, TimeoutError, AuthError) as exc:
            raise PeerError(f"cannot connect to node {self.peer_id} at {host}:{port}: "
                            f"{exc or f'timed out after {self._connect_timeout:.1f} s'}") from None
        assert protocol.transport is not None
        protocol.transport.write(self._hello().encode())
        return protocol

    async def _idle(self) -> None:
        """Wait for a frame to send; on an open connection, say Hello again every ``keepalive`` s."""
        protocol = self.protocol
        if protocol is None or self._keepalive is None:
            await self._wakeup.wait()
            return
        try:
            async with asyncio.timeout(self._keepalive):
                await self._wakeup.wait()
        except TimeoutError:
            if not protocol.closed.done() and protocol.transport is not None:
                protocol.transport.write(self._hello().encode())

    async def run(self) -> None:
        """Send queued frames until closed; raises PeerError when the peer cannot be reached."""
        try:
            if not self._queue and self._on_progress is not None:
                self._on_progress(self.peer_id, None)  # may hand this idle link a frame
            while True:
                while not self._queue:
                    if self._closing:
                        return
                    self._wakeup.clear()
                    await self._idle()
                if self.protocol is None:
                    self.protocol = await self._connect()
                protocol = self.protocol
                if protocol.closed.done():  # before taking a frame: it stays queued for the next connection
                    raise PeerError(f"connection to node {self.peer_id} lost: {protocol.closed.result()}")
                item = self._queue.pop()
                if item.ticket is not None:
                    del self._tickets[item.ticket]
                transport = protocol.transport
                assert transport is not None
                header = item.header.hop(item.header.src, item.header.dst, self._clock())
                transport.write(header.encode())
                transport.write(item.payload.data.cast("B"))
                self.queued_bytes -= item.payload.nbytes
                self.sent_frames += 1
                self.sent_bytes += item.payload.nbytes
                try:
                    async with asyncio.timeout(self._stall_timeout):
                        await protocol.drain()
                except TimeoutError:
                    raise PeerError(f"node {self.peer_id} accepted no data for {self._stall_timeout:g} s (sending "
                                    f"chunk {header.chunk} of iteration {header.iteration})") from None
                counters = self.counters()
                if counters is not None:
                    self.meter.sample(counters, waiting=bool(self._queue))
                if self._on_progress is not None:
                    self._on_progress(self.peer_id, item)  # its rate and backlog changed, or it ran empty
        finally:
            if self.protocol is not None and self.protocol.transport is not None:
                self.protocol.transport.close()
            self.protocol = None  # a later run connects afresh; the queue keeps what was not sent
