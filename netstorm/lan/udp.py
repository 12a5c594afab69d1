"""Awaitable non-blocking UDP send and receive on any event loop (uvloop lacks sock_sendto and
sock_recvfrom_into). A full send buffer makes the sender wait for writability: visible back-pressure."""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import errno
import socket
import struct
import sys
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np

from netstorm.lan.pacing import Pace

if TYPE_CHECKING:
    from netstorm.lan.batch import DatagramBatch

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


async def writable(sock: socket.socket) -> None:
    """Until ``sock``'s send buffer has room again."""
    loop = asyncio.get_running_loop()
    await _ready(sock, loop.add_writer, loop.remove_writer)


async def sendto(sock: socket.socket, data: bytes, address: Address) -> None:
    while True:
        try:
            sock.sendto(data, address)
            return
        except BlockingIOError:
            await writable(sock)


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


NO_GSO_ERRNOS = frozenset({errno.EIO, errno.EINVAL, errno.EMSGSIZE, errno.EOPNOTSUPP})
"""What a segmented send fails with where this path cannot segment: send separate datagrams instead."""


def send_segmented(sock: socket.socket, data: memoryview | bytes, size: int, address: Address) -> None:
    """One system call for datagrams of ``size`` bytes laid end to end in ``data``: a UDP GSO ``sendmsg``
    (cut by the kernel, or the NIC) when it holds more than one, else a plain ``sendto``."""
    if len(data) > size:
        sock.sendmsg([data], [(socket.SOL_UDP, UDP_SEGMENT, size.to_bytes(2, "little"))], 0, address)
    else:
        sock.sendto(data, address)


class BatchSender:
    """Sends rows of equal-size datagrams with as few system calls as the kernel allows: UDP GSO (one
    ``sendmsg`` with ``UDP_SEGMENT`` per up to 64 datagrams, cut by the kernel, or by the NIC) where it is
    available and wanted (``gso``); else ``sendmmsg`` (up to SEND_BATCH separate datagrams per call, each its
    own packet from the start, which a generic-mode XDP program sees one by one); one ``sendto`` per datagram
    only where libc has no ``sendmmsg``. ``calls`` counts system calls, ``datagrams`` what they carried."""

    def __init__(self, sock: socket.socket, *, gso: bool = True) -> None:
        self.sock = sock
        self.gso = gso and hasattr(socket, "SOL_UDP")
        self.calls = 0
        self.datagrams = 0
        self._vectors: _SendVectors | None = None
        self.pace: Pace | None = None
        """Batches leave no faster than this (a LAN worker's planned rate); None: as the socket takes them."""
        self.paced_s = 0.0
        """Seconds spent waiting for the pace."""

    async def send(self, rows: np.ndarray, address: Address) -> None:
        """Send every row of ``rows`` (uint8, one datagram per row) to ``address``."""
        if not self.gso and _SENDMMSG is not None and self.sock.family == socket.AF_INET:
            await self._send_separate(np.ascontiguousarray(rows), address)
            return
        size = int(rows.shape[1])
        data = np.ascontiguousarray(rows).reshape(-1).data.cast("B")
        total = len(data)
        per = max(1, min(GSO_SEGMENTS, GSO_BYTES // size)) if self.gso else 1
        step = per * size
        at = 0
        while at < total:
            part = data[at: at + step]
            if self.pace is not None:
                wait = self.pace.delay(time.monotonic())
                if wait > 0:
                    self.paced_s += wait
                    await asyncio.sleep(wait)
            try:
                send_segmented(self.sock, part, size, address)
            except BlockingIOError:
                await writable(self.sock)
                continue
            except OSError as exc:
                if per == 1 or exc.errno not in NO_GSO_ERRNOS:
                    raise
                self.gso = False    # no segmentation here: separate datagrams from now on
                if _SENDMMSG is not None and self.sock.family == socket.AF_INET:
                    await self._send_separate(np.ascontiguousarray(rows[at // size:]), address)
                    return
                per, step = 1, size
                continue
            self.calls += 1
            self.datagrams += len(part) // size
            at += len(part)
            if self.pace is not None:
                self.pace.charge(len(part), time.monotonic())

    async def _send_separate(self, rows: np.ndarray, address: Address) -> None:
        """Every row as its own datagram, SEND_BATCH per ``sendmmsg`` (paced: at most the pace's depth of bytes
        per call); a call the full send buffer cut short (or refused) resumes at the first datagram it did not
        take once the socket is writable again."""
        send = _SENDMMSG
        assert send is not None
        vec = self._vectors
        if vec is None:
            vec = self._vectors = _SendVectors()
        vec.aim(address)
        count, size = rows.shape
        base = rows.ctypes.data
        batch = SEND_BATCH if self.pace is None else max(1, min(SEND_BATCH, self.pace.depth // size))
        at = 0
        while at < count:
            if self.pace is not None:
                wait = self.pace.delay(time.monotonic())
                if wait > 0:
                    self.paced_s += wait
                    await asyncio.sleep(wait)
            n = min(batch, count - at)
            vec.point(base + at * size, size, n)
            sent = send(self.sock.fileno(), ctypes.addressof(vec.msgs), n, MSG_DONTWAIT)
            if sent < 0:
                err = ctypes.get_errno()
                if err in (errno.EAGAIN, errno.EWOULDBLOCK):
                    await writable(self.sock)
                    continue
                if err == errno.EINTR:
                    continue
                raise OSError(err, f"sendmmsg: {errno.errorcode.get(err, err)}")
            self.calls += 1
            self.datagrams += sent
            at += sent
            if self.pace is not None:
                self.pace.charge(sent * size, time.monotonic())


def multicast_from(sock: socket.socket, *, address: str = "0.0.0.0", ifindex: int = 0) -> None:
    """Send ``sock``'s multicast datagrams out of the interface with ``address`` or ``ifindex`` (the LAN),
    one hop only, and not back to this host."""
    mreqn = struct.pack("4s4si", socket.inet_aton("0.0.0.0"), socket.inet_aton(address), ifindex)
    sock.setsockopt(socket.IPPROTO_IP, socket.IP_MULTICAST_IF, mreqn)
    sock.setsockopt(socket.IPPROTO_IP, socket.IP_MULTICAST_TTL, 1)
    sock.setsockopt(socket.IPPROTO_IP, socket.IP_MULTICAST_LOOP, 0)


MSG_DONTWAIT = 0x40
MSG_TRUNC = 0x20


class _Iovec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


class _Msghdr(ctypes.Structure):
    _fields_ = [("name", ctypes.c_void_p), ("namelen", ctypes.c_uint32), ("iov", ctypes.POINTER(_Iovec)),
                ("iovlen", ctypes.c_size_t), ("control", ctypes.c_void_p), ("controllen", ctypes.c_size_t),
                ("flags", ctypes.c_int)]


class _Mmsghdr(ctypes.Structure):
    _fields_ = [("hdr", _Msghdr), ("len", ctypes.c_uint)]


def _recvmmsg() -> Callable[..., int] | None:
    """libc's ``recvmmsg`` (Linux), or None where there is none (one ``recvfrom_into`` per datagram then)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        fn = libc.recvmmsg
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_uint, ctypes.c_int, ctypes.c_void_p]
    fn.restype = ctypes.c_int
    return fn


_RECVMMSG = _recvmmsg()


def _sendmmsg() -> Callable[..., int] | None:
    """libc's ``sendmmsg`` (Linux), or None where there is none (one ``sendto`` per datagram then)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        fn = libc.sendmmsg
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_uint, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


_SENDMMSG = _sendmmsg()
SEND_BATCH = 256
"""Datagrams one ``sendmmsg`` hands the kernel at most (the kernel's own cap is UIO_MAXIOV, 1024)."""


class _SendVectors:
    """The ``mmsghdr`` and ``iovec`` arrays of a ``sendmmsg``, built once: each message points at its own
    iovec and at one shared destination address; a send writes only the iovecs' bases and lengths, with
    numpy, so no Python runs per datagram."""

    def __init__(self) -> None:
        self.iov = (_Iovec * SEND_BATCH)()
        self.msgs = (_Mmsghdr * SEND_BATCH)()
        self.name = ctypes.create_string_buffer(16)
        self._aimed: Address | None = None
        raw = memoryview(self.msgs).cast("B")
        stride = ctypes.sizeof(_Mmsghdr)

        def field(offset: int, dtype: type) -> np.ndarray:
            return np.ndarray((SEND_BATCH,), dtype, buffer=raw, offset=offset, strides=(stride,))

        head = _Mmsghdr.hdr.offset
        field(head + _Msghdr.name.offset, np.uint64)[:] = ctypes.addressof(self.name)
        field(head + _Msghdr.namelen.offset, np.uint32)[:] = 16
        iov_size = ctypes.sizeof(_Iovec)
        field(head + _Msghdr.iov.offset, np.uint64)[:] = ctypes.addressof(self.iov) + iov_size * np.arange(
            SEND_BATCH, dtype=np.uint64)
        field(head + _Msghdr.iovlen.offset, np.uint64)[:] = 1
        iov_raw = memoryview(self.iov).cast("B")
        self.bases = np.ndarray((SEND_BATCH,), np.uint64, buffer=iov_raw, offset=_Iovec.base.offset,
                                strides=(iov_size,))
        self.lens = np.ndarray((SEND_BATCH,), np.uint64, buffer=iov_raw, offset=_Iovec.len.offset,
                               strides=(iov_size,))
        self._steps = np.arange(SEND_BATCH, dtype=np.uint64)

    def aim(self, address: Address) -> None:
        """Every message goes to ``address`` (an IPv4 sockaddr_in, rebuilt only when it changes)."""
        if address != self._aimed:
            host = socket.inet_aton(socket.gethostbyname(address[0]))
            self.name.raw = struct.pack("=H", socket.AF_INET) + struct.pack("!H", address[1]) + host + bytes(8)
            self._aimed = address

    def point(self, base: int, size: int, count: int) -> None:
        """Messages 0..count-1 carry the ``size``-byte datagrams laid end to end from address ``base``."""
        self.bases[:count] = np.uint64(base) + self._steps[:count] * np.uint64(size)
        self.lens[:count] = size


class _Vectors:
    """The ``mmsghdr`` array pointing at a batch's rows and at one sockaddr per row, built once per batch."""

    def __init__(self, batch: DatagramBatch) -> None:
        rows, width = batch.buf.shape
        self.iov = (_Iovec * rows)()
        self.msgs = (_Mmsghdr * rows)()
        base, names = batch.buf.ctypes.data, batch.names.ctypes.data
        for i in range(rows):
            self.iov[i].base, self.iov[i].len = base + i * width, width
            hdr = self.msgs[i].hdr
            hdr.name, hdr.namelen = names + 16 * i, 16
            hdr.iov, hdr.iovlen = ctypes.pointer(self.iov[i]), 1
        raw = memoryview(self.msgs).cast("B")
        self.lens = np.ndarray((rows,), np.uint32, buffer=raw, offset=_Mmsghdr.len.offset,
                               strides=(ctypes.sizeof(_Mmsghdr),))
        self.flags = np.ndarray((rows,), np.int32, buffer=raw, offset=_Mmsghdr.hdr.offset +
                                _Msghdr.flags.offset, strides=(ctypes.sizeof(_Mmsghdr),))
        self.namelens = np.ndarray((rows,), np.uint32, buffer=raw, offset=_Mmsghdr.hdr.offset +
                                   _Msghdr.namelen.offset, strides=(ctypes.sizeof(_Mmsghdr),))


UDP_GRO = 104
"""Linux's UDP receive offload option (linux/udp.h): the socket takes coalesced datagrams whole."""
GRO_BYTES = 65536
"""Largest coalesced datagram a socket with UDP_GRO may receive (one GSO send)."""
GRO_SEGMENTS = 128
"""Most datagrams the kernel coalesces into one (UDP_MAX_SEGMENTS, 64 before Linux 6.x raised it)."""


def enable_gro(sock: socket.socket) -> bool:
    """Ask the kernel to hand ``sock`` coalesced datagrams whole (UDP_GRO): a GSO batch the gateway sent,
    which the bridge replicates unsegmented, then arrives as one buffer of up to 64 datagrams instead of
    being cut at the socket into one queued datagram each. False where the kernel does not have it."""
    if not hasattr(socket, "SOL_UDP"):
        return False
    try:
        sock.setsockopt(socket.SOL_UDP, UDP_GRO, 1)
    except OSError:
        return False
    return True


def receive_batch(sock: socket.socket, batch: DatagramBatch, *, gro: bool = False) -> int:
    """Append what ``sock`` has queued to ``batch`` without waiting, up to its free rows, with one
    ``recvmmsg`` where libc has it; the number appended. Each one's sender lands in ``batch.names``. A
    datagram longer than a row gets a length past the row (rejected by ``valid_headers``). ``gro``: the
    socket has UDP_GRO on (``enable_gro``), so what it holds may be coalesced datagrams, which are cut back
    into one row each at the segment size the kernel reports."""
    if gro:
        return _receive_coalesced(sock, batch)
    start = batch.count
    free = batch.rows - start
    if free <= 0:
        return 0
    if _RECVMMSG is None or sock.family != socket.AF_INET:
        return _receive_each(sock, batch)
    vec = batch.vectors
    if not isinstance(vec, _Vectors):
        vec = batch.vectors = _Vectors(batch)
    vec.namelens[start:] = 16
    got = _RECVMMSG(sock.fileno(), ctypes.addressof(vec.msgs[start]), free, MSG_DONTWAIT, None)
    if got < 0:
        err = ctypes.get_errno()
        if err in (errno.EAGAIN, errno.EWOULDBLOCK, errno.EINTR):
            return 0
        raise OSError(err, f"recvmmsg: {errno.errorcode.get(err, err)}")
    stop = start + got
    lengths = vec.lens[start:stop].astype(np.int64)
    lengths[(vec.flags[start:stop] & MSG_TRUNC) != 0] = batch.buf.shape[1] + 1
    batch.lengths[start:stop] = lengths
    batch.count = stop
    return got


def _receive_each(sock: socket.socket, batch: DatagramBatch) -> int:
    start = batch.count
    width = batch.buf.shape[1]
    while batch.count < batch.rows:
        row = memoryview(batch.buf[batch.count])
        try:
            n, address = sock.recvfrom_into(row, width, MSG_TRUNC)
        except BlockingIOError:
            break
        batch.lengths[batch.count] = n if n <= width else width + 1
        batch.count += 1
        if sock.family == socket.AF_INET:
            batch.set_address(batch.count - 1, address)
    return batch.count - start


_CMSG_SPACE = socket.CMSG_SPACE(4) if hasattr(socket, "CMSG_SPACE") else 0


def _receive_coalesced(sock: socket.socket, batch: DatagramBatch) -> int:
    """``receive_batch`` for a socket with UDP_GRO: one ``recvmsg`` per coalesced buffer into a staging area,
    then one copy that lays its segments into rows. Stops while the batch could not take a whole buffer,
    so nothing received is ever dropped for want of rows."""
    stage = batch.staging
    if stage is None:
        stage = batch.staging = np.zeros(GRO_BYTES, np.uint8)
    view = stage.data
    start = batch.count
    width = batch.buf.shape[1]
    inet = sock.family == socket.AF_INET   # once: the property converts to an enum on every read
    named: tuple[str, int] | None = None
    while batch.rows - batch.count > GRO_SEGMENTS:
        try:
            n, ancillary, flags, address = sock.recvmsg_into([view], _CMSG_SPACE, MSG_DONTWAIT)
        except (BlockingIOError, InterruptedError):
            break
        size = n
        for level, kind, data in ancillary:
            if level == socket.SOL_UDP and kind == UDP_GRO and len(data) >= 2:
                size = int.from_bytes(data[:4], sys.byteorder) or n
        if flags & MSG_TRUNC:
            size = n = width + 1        # cannot be split truthfully: one rejected row
        at = batch.count
        if n <= size:
            batch.lengths[at] = n
            kept = min(n, width)
            batch.buf[at, :kept] = stage[:kept]
            rows = 1
        else:
            full, rest = divmod(n, size)
            if full > GRO_SEGMENTS:      # more than the kernel coalesces: keep what the rows hold
                full, rest = GRO_SEGMENTS, 0
            rows = full + (1 if rest else 0)
            kept = min(size, width)
            batch.buf[at: at + full, :kept] = stage[: full * size].reshape(full, size)[:, :kept]
            batch.lengths[at: at + full] = size
            if rest:
                batch.buf[at + full, : min(rest, width)] = stage[full * size: full * size + min(rest, width)]
                batch.lengths[at + full] = rest
        batch.coalesced += rows > 1
        if inet:
            if address == named:    # the same sender as the buffer before (the gateway, nearly always)
                batch.names[at: at + rows] = batch.names[at - 1]
            else:
                batch.set_address(slice(at, at + rows), address)
                named = address
        batch.count += rows
    return batch.count - start


def interface_mac(interface: str) -> bytes:
    """The interface's link-layer address (SIOCGIFHWADDR: valid in the calling thread's network namespace),
    for datagrams an XDP program writes itself (a cluster's forwarded sums, a gateway's results)."""
    import fcntl
    import struct

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        info = fcntl.ioctl(probe.fileno(), 0x8927, struct.pack("256s", interface.encode()[:15]))
    return bytes(info[18:24])
