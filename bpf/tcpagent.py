"""The gateway's TCP path (``edge_mode=tcp``): the asyncio shell of ``TcpGatewayCore``.

It serves the same verbs as the UDP paths' ``EdgeAgent`` for the gateway role and the benchmark
(``run``, ``wait_workers``, ``expect``, ``collect``, ``send_results``, ``uplink_bursts``, ``close``): one
listening socket, one ``FrameProtocol`` per worker connection, and the core deciding everything. A
connection whose frame is malformed, forged or out of order gets a REFUSAL saying why and is closed;
the other workers' connections go on. ``collect`` has a deadline whose error names the missing workers.
Results leave as one header per frame and worker with the result arrays' bytes shared; each
connection's back-pressure is awaited with the same deadline, and a worker that stops reading is
disconnected rather than buffered for without bound.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import socket
import time
from collections.abc import Callable, Sequence

import numpy as np

from netstorm.authconn import REFUSE_LINGER_S
from netstorm.lan.errors import EdgeTimeout, WireError
from netstorm.lan.layout import EdgeLayout
from netstorm.lan.tcpcore import Completed, Send, Summed, TcpGatewayCore
from netstorm.lan.tcpstream import FrameProtocol
from netstorm.lan.tcpwire import Frame

log = logging.getLogger("netstorm.edge")
WATCHED = 8
"""Iterations whose watchers are kept (older ones are dropped as newer ones are watched)."""


class TcpPartial:
    """One iteration's LAN sums as far as every worker's DATA covers them (``TcpEdgeAgent.watch``): the
    view the gateway role reads parts of a tensor from, as it reads ``IterationSums`` on the UDP paths."""

    def __init__(self, core: TcpGatewayCore, iteration: int) -> None:
        self.core = core
        self.iteration = iteration
        self.layout = core.layout
        self.open = np.arange(core.layout.num_chunks) >= core.frontier(iteration)
        """Chunks (by sequence number) not summed when the view was made."""

    def part(self, tensor: int, start: int, stop: int) -> np.ndarray:
        return self.core.partial(self.iteration, tensor, start, stop)


class TcpEdgeAgent:
    """The TCP path's gateway side on ``sock`` (a bound TCP socket: it listens from construction, and
    connections are served from ``run``)."""

    mode = "tcp"

    def __init__(self, sock: socket.socket, layout: EdgeLayout, *, workers: int, job: int,
                 secret: bytes | None = None) -> None:
        self.sock = sock
        sock.listen(128)   # workers may connect before ``run``: the kernel queues them
        self.layout = layout
        self.core = TcpGatewayCore(layout, workers=workers, job=job, secret=secret)
        self._conns: dict[int, FrameProtocol] = {}
        self._ids = itertools.count()
        self._changed = asyncio.Event()
        self._server: asyncio.Server | None = None
        self._closed = asyncio.Event()
        self.receive_cpu = 0.0
        """Thread CPU seconds spent receiving and summing DATA (the benchmark's gateway figure)."""
        self.delivery_cpu = 0.0
        self._watchers: dict[int, list[Callable[[np.ndarray], None]]] = {}

    # --- connections -------------------------------------------------------------------------------

    def _protocol(self) -> FrameProtocol:
        conn = next(self._ids)

        def expect(message: Frame, payload_len: int) -> memoryview | None:
            self.core.expect(conn, message, payload_len)
            return None

        def on_frame(message: Frame, payload: memoryview) -> None:
            cpu = time.thread_time()
            actions = self.core.on_frame(conn, message, payload, time.monotonic())
            self.receive_cpu += time.thread_time() - cpu
            self._act(actions)

        def on_error(exc: WireError) -> None:
            worker = self.core.worker_of.get(conn)
            log.error("edge (tcp): %s connection refused: %s", f"worker {worker}'s" if worker is not None else "a",
                      exc)
            proto = self._conns.get(conn)
            if proto is not None:
                send = self.core.refuse(conn, exc)
                with contextlib.suppress(ConnectionError):
                    proto.write(send.header)
                proto.refuse_and_close(REFUSE_LINGER_S)

        def on_lost(exc: Exception | None) -> None:
            self._conns.pop(conn, None)
            self.core.closed(conn)
            self._changed.set()

        proto = FrameProtocol(expect, on_frame, on_error=on_error, on_lost=on_lost, max_payload=self.core.max_payload)
        self._conns[conn] = proto
        return proto

    def _act(self, actions: Sequence[Send | Completed | Summed]) -> None:
        for action in actions:
            if isinstance(action, Summed):
                for watcher in self._watchers.get(action.iteration, ()):
                    watcher(np.arange(action.since, action.upto, dtype=np.int64))
            elif isinstance(action, Send):
                proto = self._conns.get(action.conn)
                if proto is not None:
                    with contextlib.suppress(ConnectionError):
                        proto.write(action.header, action.payload)
        self._changed.set()

    # --- the agent's verbs -------------------------------------------------------------------------

    async def run(self) -> None:
        """Serve until ``close`` or cancellation."""
        self.sock.setblocking(False)
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(self._protocol, sock=self.sock, backlog=128)
        try:
            await self._closed.wait()
        finally:
            self._server.close()
            for proto in list(self._conns.values()):
                proto.close()

    def close(self) -> None:
        self._closed.set()

    def expect(self, iteration: int) -> None:
        """Nothing to install: DATA tokens are checked as frames arrive (the UDP agent's signature)."""

    def watch(self, iteration: int, watcher: Callable[[np.ndarray], None]) -> TcpPartial:
        """Call ``watcher`` with the sequence numbers of ``iteration``'s LAN chunks (``layout``'s) as every
        worker's DATA covers them (from now on; the returned view's ``open`` mask says which did before)."""
        watchers = self._watchers.setdefault(iteration, [])
        watchers.append(watcher)
        for old in [k for k in self._watchers if k < iteration - WATCHED]:
            del self._watchers[old]
        return TcpPartial(self.core, iteration)

    async def _until(self, ready: Callable[[], bool], timeout: float) -> None:  # noqa: ASYNC109
        async with asyncio.timeout(timeout):
            while not ready():
                self._changed.clear()
                await self._changed.wait()

    async def wait_workers(self, timeout: float) -> None:  # noqa: ASYNC109
        """Until every worker has said HELLO; EdgeTimeout naming those that did not."""
        try:
            await self._until(lambda: len(self.core.conn_of) == self.core.workers, timeout)
        except TimeoutError:
            missing = [w for w in range(self.core.workers) if w not in self.core.conn_of]
            raise EdgeTimeout(f"edge (tcp): workers {missing} did not connect within {timeout} s") from None

    async def collect(self, iteration: int, *, timeout: float) -> list[np.ndarray]:  # noqa: ASYNC109
        """The LAN sums of ``iteration`` (float32, one per tensor); EdgeTimeout naming the missing workers."""
        try:
            await self._until(lambda: self.core.ready(iteration), timeout)
        except TimeoutError:
            raise self.core.timed_out(iteration, timeout) from None
        return self.core.take(iteration)

    async def send_results(self, iteration: int, results: Sequence[np.ndarray], *, total: int,
                           unicast: bool = False, timeout: float = 60.0) -> None:  # noqa: ASYNC109
        """``iteration``'s result to every connected worker (``unicast``: the UDP agent's argument; TCP is
        always one copy per worker). A worker that does not take its copy within ``timeout`` is dropped."""
        cpu = time.thread_time()
        self._act(self.core.results(iteration, results, total=total))
        self.delivery_cpu += time.thread_time() - cpu

        async def drained(conn: int, proto: FrameProtocol) -> None:
            try:
                async with asyncio.timeout(timeout):
                    await proto.drain()
            except (TimeoutError, ConnectionError) as exc:
                log.error("edge (tcp): worker %s did not take the result of iteration %d (%s); disconnected",
                          self.core.worker_of.get(conn), iteration, type(exc).__name__)
                proto.close()

        await asyncio.gather(*(drained(c, p) for c, p in list(self._conns.items())))

    def uplink_bursts(self, iteration: int) -> list[tuple[int, int, float, float]]:
        return self.core.uplink_bursts(iteration)

    def summed_at(self, iteration: int) -> tuple[float, float] | None:
        """When the first and the last of a collected ``iteration``'s frames arrived (monotonic clock): the
        TCP core sums each frame as it arrives, so these bound when its sum began and completed."""
        bursts = self.core.uplink_bursts(iteration)
        if not bursts:
            return None
        return min(b[2] for b in bursts), max(b[3] for b in bursts)

    def downlink_bursts(self) -> list[tuple[int, int, float, float]]:
        """None: TCP workers send no downlink REPORT (that is a UDP datagram kind), so on this path the
        meter keeps the scenario's downlink rates."""
        return []
