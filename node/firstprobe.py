"""The node's part of the first probe round: between its Register and the RegisterAck, the scheduler
may ask it (``ProbeRequest``) to measure its outgoing links with no stated rate.

The node keeps a bulk-probe sink on its data host from before it registers until the RegisterAck, so
its peers can measure their links to it; asked to probe, it measures its targets one after the other
(this host's links do not share its probe), each the fastest of ``bulkprobe.TRIES`` probes, and
heartbeats meanwhile in a second task, so the scheduler never takes a long probe for a dead node.
Neither task blocks the registration's read of the control connection.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

from netstorm import bulkprobe, control

log = logging.getLogger(__name__)

REASON = 400
"""Characters of a failed probe's reason a result carries."""


class FirstProbe:
    """One registration's probe sink and, once asked, its probe and heartbeat tasks."""

    def __init__(self, node_id: int, writer: asyncio.StreamWriter) -> None:
        self.node_id = node_id
        self._writer = writer
        self._lock = asyncio.Lock()
        self._tasks: list[asyncio.Task[None]] = []

    @staticmethod
    async def sink(host: str) -> asyncio.Server | None:
        """A probe sink on ``host`` (a free port), or None when none can be opened (the node is then not
        asked to probe, and its incoming links start from the prior)."""
        try:
            return await bulkprobe.serve_sink(host, 0)
        except OSError as exc:
            log.warning("no probe sink on %s: %s; links to this node start from the prior", host, exc)
            return None

    def start(self, request: control.ProbeRequest) -> float:
        """Run ``request`` in the background; seconds it may take at most."""
        self._tasks.append(asyncio.create_task(self._probe(request), name=f"first-probe-{self.node_id}"))
        if len(self._tasks) == 1:
            self._tasks.append(asyncio.create_task(self._heartbeat(request.heartbeat_s),
                                                   name=f"probe-heartbeat-{self.node_id}"))
        return request.timeout_s * len(request.targets)

    async def stop(self) -> None:
        """Registration ended (acknowledged or failed): end the tasks."""
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks.clear()

    async def _send(self, message: control.Message) -> None:
        async with self._lock:
            self._writer.write(control.encode(message))
            await self._writer.drain()

    async def _probe(self, request: control.ProbeRequest) -> None:
        rows = []
        for dst, host, port in request.targets:
            try:
                mbit = await bulkprobe.measure_best(host, port, request.nbytes, timeout=request.timeout_s)
            except bulkprobe.ProbeError as exc:
                log.warning("node %d: %s", self.node_id, exc)
                rows.append((dst, -1.0, str(exc)[:REASON]))
                continue
            log.info("node %d: link %d->%d probed at %.1f Mbit/s", self.node_id, self.node_id, dst, mbit)
            rows.append((dst, mbit, ""))
        with contextlib.suppress(ConnectionError, OSError):  # the registration's read sees a lost connection
            await self._send(control.ProbeResult(node_id=self.node_id, rows=tuple(rows)))

    async def _heartbeat(self, interval: float) -> None:
        with contextlib.suppress(ConnectionError, OSError):
            while True:
                await self._send(control.Heartbeat(self.node_id, time.time()))
                await asyncio.sleep(interval)
