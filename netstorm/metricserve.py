"""A minimal HTTP endpoint on the process's own event loop that answers ``GET /metrics``.

The services render their metrics from state the event loop owns; serving on that loop (not on the
thread ``prometheus_client.start_http_server`` would start) means a scrape reads that state between
two events, never in the middle of one. The page itself comes from a callable, so this module needs
no metrics library: the services' ``metrics`` modules hand it ``prometheus_client``'s exposition.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable

from netstorm.control import parse_address
from netstorm.errors import ConfigError

log = logging.getLogger(__name__)

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
"""The Prometheus text exposition format's media type."""
REQUEST_TIMEOUT = 10.0
"""Seconds a scraper may take to send its request head; then the connection is closed."""
MAX_HEAD = 16 * 1024
"""Largest request head read; a longer one is refused."""


async def serve_metrics(listen: str, render: Callable[[], bytes]) -> asyncio.Server:
    """Serve ``render()`` at ``/metrics`` on ``listen`` (HOST:PORT, port 0 picks one) until the server closes."""
    host, port = parse_address(listen, "metrics_listen")

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            async with asyncio.timeout(REQUEST_TIMEOUT):
                head = await reader.readuntil(b"\r\n\r\n")
            request = head.split(b"\r\n", 1)[0].decode("latin-1").split()
            if len(request) < 2 or request[0] not in ("GET", "HEAD"):
                status, body, kind = "405 Method Not Allowed", b"only GET /metrics\n", "text/plain"
            elif request[1].split("?", 1)[0] != "/metrics":
                status, body, kind = "404 Not Found", b"metrics are at /metrics\n", "text/plain"
            else:
                try:
                    status, body, kind = "200 OK", render(), CONTENT_TYPE
                except Exception as exc:  # a broken metric must not take the process down, nor hide
                    log.exception("metrics: rendering failed")
                    status, body, kind = "500 Internal Server Error", f"{exc!r}\n".encode(), "text/plain"
            writer.write(f"HTTP/1.1 {status}\r\nContent-Type: {kind}\r\nContent-Length: {len(body)}\r\n"
                         "Connection: close\r\n\r\n".encode("latin-1"))
            if request and request[0] != "HEAD":
                writer.write(body)
            await writer.drain()
        except (TimeoutError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError):
            pass
        finally:
            writer.close()
            with contextlib.suppress(ConnectionError):
                await writer.wait_closed()

    try:
        server = await asyncio.start_server(handle, host, port, limit=MAX_HEAD)
    except OSError as exc:
        raise ConfigError(f"cannot serve metrics on {listen}: {exc}") from None
    bound = server.sockets[0].getsockname()
    log.info("metrics at http://%s:%d/metrics", bound[0], bound[1])
    print(f"metrics at http://{bound[0]}:{bound[1]}/metrics", flush=True)
    return server
