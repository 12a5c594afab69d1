"""A short bulk probe of one directed WAN link: a sender streams bytes, the receiver times them.

Where a scenario states no rates, they are measured before a job plans on them. The receiver times
the second half of the bytes, and the rate is that half over its time: TCP's slow start (several
round trips on a WAN) is over by then, so a probe of a few megabytes already measures the path's
steady rate, which the passive estimator (``netstorm.probe``) then follows. On Linux each read also
asks the kernel how many bytes it has received (``TCP_INFO``): a receiver that was not scheduled
for a while reads what piled up at once, and timing its reads would make the link look faster
(or slower) than it is, while the kernel's count at the moment of the read is a true point of the
arrival curve. The wire is a fixed header (magic, bytes to come) and an answer of two numbers;
``python -m netstorm.bulkprobe sink|send`` runs either end as a process (the emulator starts them in
its namespaces).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import socket
import struct
import sys
import time
from collections.abc import Callable, Sequence

from netstorm.control import PROBE_MAX_BYTES, parse_address
from netstorm.errors import NetStormError

MAGIC = b"NSPROBE1"
HEADER = struct.Struct("!8sQ")
"""Magic and the number of bytes that follow."""
ANSWER = struct.Struct("!Qd")
"""Bytes received and seconds the second half of them took."""
MAX_BYTES = PROBE_MAX_BYTES
"""Largest probe a sink accepts (16 GiB)."""
BLOCK = 1 << 16
TCP_INFO_BYTES_RECEIVED = struct.Struct("=Q"), 128
"""``tcpi_bytes_received`` in Linux's ``struct tcp_info`` (since 4.1): bytes the kernel has received in order."""
DEFAULT_BYTES = 4 * 1024 * 1024
"""Bytes of a first probe where nothing else is said: a few megabytes are past slow start."""
TRIES = 2
"""Probes of a link whose fastest counts (``measure_best``). The sink times by the kernel's counts, so a
host off the CPU can only slow a probe down (its sender lets the link idle), never speed it up: on a
loaded host a single probe may come out far below its link's rate, and the faster of two is what the
link carries."""


class ProbeError(NetStormError):
    """A probe could not measure its link."""


def second_half(samples: Sequence[tuple[float, int]], total: int, *, kernel: bool) -> tuple[int, float]:
    """(bytes, seconds) of a probe's second half from ``samples`` of (time, bytes received then).

    With ``kernel`` counts every sample is a point of the arrival curve, whenever the receiver took it:
    the window runs from the one nearest half the bytes to the last taken before every byte was in
    (after that the count stops, and a late read would only add time), or to the last when that
    leaves less than a quarter of the bytes. Without, the counts are what the receiver had read: the
    window runs from the first read past half the bytes to the last read.
    """
    half = total // 2
    if kernel:
        start = min(samples, key=lambda s: abs(s[1] - half))
        before = [s for s in samples if s[0] > start[0] and s[1] < total]
        end = before[-1] if before and before[-1][1] - start[1] >= total // 4 else samples[-1]
    else:
        start = next(s for s in samples if s[1] >= half)
        end = samples[-1]
    return end[1] - start[1], end[0] - start[0]


def _kernel_count(writer: asyncio.StreamWriter) -> Callable[[], int] | None:
    """Bytes this connection's kernel socket has received in order, or None where TCP_INFO cannot tell."""
    sock = writer.get_extra_info("socket")
    layout, offset = TCP_INFO_BYTES_RECEIVED
    option = getattr(socket, "TCP_INFO", None)
    if sock is None or option is None:
        return None

    def count() -> int:
        return int(layout.unpack_from(sock.getsockopt(socket.IPPROTO_TCP, option, 256), offset)[0])

    try:
        info = sock.getsockopt(socket.IPPROTO_TCP, option, 256)
    except OSError:
        return None
    return count if len(info) >= offset + layout.size else None


async def _serve_one(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, timeout: float) -> None:  # noqa: ASYNC109
    try:
        async with asyncio.timeout(timeout):
            magic, total = HEADER.unpack(await reader.readexactly(HEADER.size))
            if magic != MAGIC or not 0 < total <= MAX_BYTES:
                return
            kernel = _kernel_count(writer)  # the connection carries the header, then the probe's bytes alone
            got = 0
            samples: list[tuple[float, int]] = []
            while got < total:
                chunk = await reader.read(min(BLOCK * 16, total - got))
                if not chunk:
                    return
                got += len(chunk)
                now = time.monotonic()
                samples.append((now, min(total, kernel() - HEADER.size) if kernel is not None else got))
            counted, seconds = second_half(samples, total, kernel=kernel is not None)
            writer.write(ANSWER.pack(counted, seconds))
            await writer.drain()
    except (TimeoutError, asyncio.IncompleteReadError, ConnectionError):
        pass
    finally:
        writer.close()
        with contextlib.suppress(ConnectionError):
            await writer.wait_closed()


async def serve_sink(host: str, port: int, *, timeout: float = 60.0) -> asyncio.Server:  # noqa: ASYNC109
    """Accept probes on host:port (port 0 picks one) until the server closes."""
    return await asyncio.start_server(lambda r, w: _serve_one(r, w, timeout), host, port)


def _check_bytes(nbytes: int) -> None:
    if not 2 <= nbytes <= MAX_BYTES:
        raise ProbeError(f"a probe sends 2..{MAX_BYTES} bytes, not {nbytes}")


async def measure(host: str, port: int, nbytes: int, *, timeout: float = 60.0) -> float:  # noqa: ASYNC109
    """Stream ``nbytes`` to the sink at host:port; the rate (Mbit/s) the receiver saw after slow start."""
    _check_bytes(nbytes)
    try:
        async with asyncio.timeout(timeout):
            reader, writer = await asyncio.open_connection(host, port)
            try:
                writer.write(HEADER.pack(MAGIC, nbytes))
                block = bytes(BLOCK)
                left = nbytes
                while left:
                    writer.write(block[:min(BLOCK, left)])
                    left -= min(BLOCK, left)
                    await writer.drain()
                counted, seconds = ANSWER.unpack(await reader.readexactly(ANSWER.size))
            finally:
                writer.close()
    except (OSError, TimeoutError, asyncio.IncompleteReadError) as exc:
        raise ProbeError(f"probe to {host}:{port} failed: {exc or type(exc).__name__}") from None
    if not seconds > 0:
        raise ProbeError(f"probe to {host}:{port}: {nbytes} bytes are too few to time; send more")
    return counted * 8 / seconds / 1e6


async def measure_best(host: str, port: int, nbytes: int, *, tries: int = TRIES,
                       timeout: float = 60.0) -> float:  # noqa: ASYNC109
    """The fastest of ``tries`` probes of ``nbytes`` to host:port, all within ``timeout`` seconds; fails
    only when none measured."""
    _check_bytes(nbytes)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    best = 0.0
    error: ProbeError | None = None
    for _ in range(max(1, tries)):
        left = deadline - loop.time()
        if left <= 0:
            break
        try:
            best = max(best, await measure(host, port, nbytes, timeout=left))
        except ProbeError as exc:
            error = exc
    if best > 0:
        return best
    raise error or ProbeError(f"probe to {host}:{port}: no time left to measure")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m netstorm.bulkprobe", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="role", required=True)
    sink = sub.add_parser("sink", help="accept probes until killed")
    sink.add_argument("listen", metavar="HOST:PORT")
    send = sub.add_parser("send", help="probe links one after the other; one JSON line per target")
    send.add_argument("bytes", type=int)
    send.add_argument("targets", metavar="HOST:PORT", nargs="+")
    send.add_argument("--timeout", type=float, default=60.0, help="seconds per target, its tries together")
    send.add_argument("--tries", type=int, default=TRIES, help=f"probes per target, the fastest kept (default {TRIES})")
    args = parser.parse_args(argv)
    if args.role == "sink":
        async def run_sink() -> None:
            server = await serve_sink(*parse_address(args.listen, "sink"))
            print(f"sink on {args.listen}", flush=True)
            async with server:
                await server.serve_forever()

        with contextlib.suppress(KeyboardInterrupt):
            asyncio.run(run_sink())
        return 0
    failed = 0
    for target in args.targets:  # one at a time: this host's links do not share its probe
        host, port = parse_address(target, "target")
        try:
            rate = asyncio.run(measure_best(host, port, args.bytes, tries=args.tries, timeout=args.timeout))
        except ProbeError as exc:
            print(json.dumps({"target": target, "error": str(exc)}), flush=True)
            failed += 1
            continue
        print(json.dumps({"target": target, "mbit": rate}), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
