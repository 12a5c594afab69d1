"""The gateway's edge agent: the asyncio shell of the LAN gateway's UDP port.

See docs/ARCHITECTURE.md, *The LAN tier*."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from bpf.fallback import UserspaceAggregator
from bpf.writer import SocketWriter
from bpf.xdp import XDP_PASS, XDP_TX, KernelResults, XdpAggregator, multicast_mac
from netstorm.lan import udp
from netstorm.lan.batch import DatagramBatch
from netstorm.lan.deploy import Deployment, LanTopology
from netstorm.lan.downlink import DownlinkReports
from netstorm.lan.errors import EdgeTimeout
from netstorm.lan.gatewaycore import GatewayCore
from netstorm.lan.header import HEADER_BYTES, KIND_AT, Kind
from netstorm.lan.layout import EdgeLayout
from netstorm.lan.outbox import Outbox
from netstorm.lan.redeploy import Redeployment, Switch
from netstorm.lan.resultwire import ResultWire
from netstorm.lan.sums import IterationSums
from netstorm.lan.tokens import LanTokens

Address = tuple[str, int]

RECEIVE_BATCH = 256
"""Datagrams taken per wake-up (the rest stay queued in the kernel for the next)."""
class EdgeAgent:
    """The asyncio agent on the gateway's UDP port: drives the XDP aggregator (its ring buffer) or the
    userspace one, and answers the LAN workers through its ``GatewayCore``."""

    def __init__(self, sock: socket.socket, layout: EdgeLayout, *, workers: int, job: int, mode: str,
                 xdp: XdpAggregator | None = None, slot_timeout: float = 0.2, max_nacks: int = 20,
                 secret: bytes | None = None, group: tuple[str, int] | None = None,
                 topology: LanTopology | None = None, retransmit: float = 0.005, query_nacks: bool = True) -> None:
        """``layout`` fixes the pool and lanes per datagram; ``group`` is the multicast (address, port) for
        ACKs and results (None: a unicast copy per worker); ``topology`` says which workers aggregate which
        (None: one level); ``retransmit`` is what workers are told to wait for progress before resending;
        ``query_nacks`` tells them to ask before resending."""
        if mode not in ("xdp", "userspace"):
            raise ValueError(f"mode must be 'xdp' or 'userspace', got {mode!r}")
        if mode == "xdp" and xdp is None:
            raise ValueError("xdp mode needs a loaded XdpAggregator")
        self.sock = sock
        self.layout = layout
        self.workers = workers
        self.job = job
        self.mode = mode
        self.xdp = xdp
        self.slot_timeout = slot_timeout
        self.retransmit = retransmit
        self.query_nacks = query_nacks
        expected = (topology or LanTopology(workers)).gateway_mask()
        self.fallback = (UserspaceAggregator(layout, job=job, expected=expected, timeout=slot_timeout,
                                             max_nacks=max_nacks) if mode == "userspace" else None)
        aggregator: Any = self.fallback if self.fallback is not None else xdp
        self.core = GatewayCore(layout, aggregator, workers=workers, job=job, userspace=self.fallback is not None,
                                port=sock.getsockname()[1], secret=secret, group=group,
                                topology=topology, retransmit=retransmit, query_nacks=query_nacks,
                                outbox_batch=udp.GSO_SEGMENTS if hasattr(socket, "SOL_UDP") else 1,
                                widen=self._widen if mode == "xdp" else None)
        self.roster = self.core.roster
        self.nacks = self.core.nacks
        self.results = self.core.results
        if group is not None and sock.getsockname()[0] not in ("0.0.0.0", ""):
            udp.multicast_from(sock, address=sock.getsockname()[0])
        self.writer = SocketWriter(sock, self.core.outbox, who="edge gateway")
        self._wake = self.writer.wake
        self._hello = asyncio.Event()
        self._waiters: dict[int, asyncio.Event] = {}
        self._stop = asyncio.Event()
        self._rx = DatagramBatch(RECEIVE_BATCH)
        self.receive_cpu = 0.0
        """Thread CPU seconds spent receiving and handling datagrams (not sending: no result broadcast)."""

    @property
    def tokens(self) -> LanTokens:
        """The job's LAN tokens (netstorm/lan/tokens.py)."""
        return self.core.tokens

    @property
    def agg_token(self) -> int:
        """The value the aggregator writes into aggregates (0: tokens are not checked)."""
        return self.core.agg_token

    @property
    def outbox(self) -> Outbox:
        """Everything the gateway sends, in the writer's order."""
        return self.core.outbox

    @property
    def kernel_results(self) -> bool:
        """The program returns every result itself."""
        return self.core.kernel_results

    @property
    def failed(self) -> dict[int, str]:
        """The newest iterations the node failed, and why."""
        return self.core.failed

    @property
    def errors(self) -> int:
        """Datagrams rejected as malformed or out of place."""
        return self.core.errors

    @property
    def delivery_cpu(self) -> float:
        """CPU seconds spent taking completed slots into the sums."""
        return self.core.delivery_cpu

    @property
    def acks_sent(self) -> int:
        """ACK datagrams sent."""
        return self.core.acks.sent

    @property
    def downlinks(self) -> DownlinkReports:
        """Each worker's result bursts as its REPORTs say."""
        return self.core.downlinks

    @property
    def addresses(self) -> dict[int, Address]:
        """Where each worker that said HELLO is."""
        return self.roster.addresses

    @property
    def topology(self) -> LanTopology:
        """Which workers aggregate which, in the running deployment."""
        return self.roster.topology

    @property
    def expected(self) -> int:
        """The contributors the gateway's slots expect."""
        return self.roster.expected

    @property
    def epoch(self) -> int:
        """The current deployment epoch."""
        return self.roster.epoch

    @property
    def deployments(self) -> Redeployment:
        """The deployment's epoch and its changes."""
        return self.roster.deployments

    @property
    def group(self) -> Address | None:
        """The workers' multicast group."""
        return self.roster.group

    @property
    def moved_sent(self) -> int:
        """MOVED notices sent."""
        return self.roster.moved_sent

    @property
    def stale_told(self) -> int:
        """MOVED sent to a sender behind the deployment."""
        return self.roster.stale_told

    @property
    def forged(self) -> int:
        """Datagrams the core dropped for a wrong token or a replayed nonce."""
        return self.roster.forged

    @property
    def query_nacks_sent(self) -> int:
        """(worker, chunk) pairs NACKed to unclustered workers."""
        return self.nacks.query_nacks_sent

    @property
    def nack_datagrams(self) -> int:
        """NACK datagrams sent to workers."""
        return self.nacks.nack_datagrams

    @property
    def cluster_nacks_sent(self) -> int:
        """NACKs sent to cluster aggregator services."""
        return self.nacks.cluster_nacks_sent

    @property
    def streamed_chunks(self) -> int:
        """Result chunks sent before their iteration was complete."""
        return self.results.streamed_chunks

    def expect(self, iteration: int) -> None:
        """Receive ``iteration`` and the window after it from now on (``GatewayCore.expect``)."""
        self.core.expect(iteration)

    def plan(self, iteration: int, layout: EdgeLayout, *, integer: bool = False,
             back: ResultWire | None = None) -> None:
        """Iteration ``iteration`` travels on ``layout`` (``GatewayCore.plan``)."""
        self.core.plan(iteration, layout, integer=integer, back=back)

    def layout_of(self, iteration: int) -> EdgeLayout:
        return self.results.layout_of(iteration)

    def result_wire(self, iteration: int) -> ResultWire:
        return self.results.result_wire(iteration)

    def redeploy(self, topology: LanTopology, iteration: int) -> Switch | None:
        """Run ``topology`` from iteration ``iteration + 1`` on (``GatewayCore.redeploy``)."""
        switch = self.core.redeploy(topology, iteration)
        self._acted()
        return switch

    def services_missing(self, topology: LanTopology) -> list[int]:
        return self.roster.services_missing(topology)

    def deployment(self, worker: int, *, aggregator: bool = False) -> Deployment | None:
        """What ``worker`` is told in the answer to its HELLO (``GatewayRoster.deployment``)."""
        return self.roster.deployment(worker, aggregator=aggregator, first_iteration=self.core.window.base)

    def watch(self, iteration: int, watcher: Callable[[np.ndarray], None]) -> IterationSums:
        """Call ``watcher`` as ``iteration``'s chunks complete (``GatewayCore.watch``)."""
        return self.core.book.watch(iteration, watcher)

    def stream_results(self, iteration: int, *, total: int, unicast: bool = False) -> None:
        """``iteration``'s result leaves chunk by chunk as its chunks complete (``ResultBook.stream``)."""
        self.core.stream_results(iteration, total=total, unicast=unicast)
        self._acted()

    def summed_at(self, iteration: int) -> tuple[float, float] | None:
        return self.core.book.summed_at(iteration)

    @property
    def pace_gbit(self) -> dict[int, float]:
        """Per worker, the Gbit/s its DATA is paced to (told in its HELLO answer)."""
        return self.roster.pace_gbit

    @pace_gbit.setter
    def pace_gbit(self, value: dict[int, float]) -> None:
        self.roster.pace_gbit = value

    @property
    def gia_threshold(self) -> int:
        """A FediAC job's threshold the WAN roots apply (told to every worker in its deployment)."""
        return self.roster.gia_threshold

    @gia_threshold.setter
    def gia_threshold(self, value: int) -> None:
        self.roster.gia_threshold = value

    # ------------------------------------------------------------------ bytes and time in
    async def run(self) -> None:
        """Serve until ``close``: receiving (a reader callback), sending, slot timers (userspace) or the
        ring buffer (xdp)."""
        loop = asyncio.get_running_loop()
        if self.xdp is not None and self.mode == "xdp":
            loop.add_reader(self.xdp.events_fd, self._on_ring)
        # one persistent reader: no future or re-registration per wake-up, which would cost more than
        # handling the datagram itself
        loop.add_reader(self.sock.fileno(), self._drain)
        try:
            async with asyncio.TaskGroup() as tg:
                send = tg.create_task(self.writer.run())
                timers = tg.create_task(self._timers()) if self.fallback is not None else None
                await self._stop.wait()
                for task in (send, timers):
                    if task is not None:
                        task.cancel()
        finally:
            loop.remove_reader(self.sock.fileno())
            if self.xdp is not None and self.mode == "xdp":
                loop.remove_reader(self.xdp.events_fd)

    def close(self) -> None:
        self._stop.set()

    def _drain(self) -> None:
        """One ``recvmmsg`` of up to a batch (the kernel keeps the rest for the next wake-up) into the core."""
        started = time.thread_time()
        batch = self._rx
        batch.clear()
        udp.receive_batch(self.sock, batch)
        self.core.datagrams(batch, time.monotonic())
        self._acted()
        self.receive_cpu += time.thread_time() - started

    def _on_ring(self) -> None:
        """The program's reports (slot timers, gaps, completed iterations), counted as receive work."""
        assert self.xdp is not None
        started = time.thread_time()
        self.core.slot_events(self.xdp.drain_events(), time.monotonic())
        self._acted()
        self.receive_cpu += time.thread_time() - started

    async def _timers(self) -> None:
        while True:
            deadline = self.core.next_timer()
            delay = self.slot_timeout if deadline is None else max(0.0, deadline - time.monotonic())
            await asyncio.sleep(min(delay, self.slot_timeout))
            self.core.handle_timer(time.monotonic())
            self._acted()

    def _acted(self) -> None:
        """Carry out what the core's last call asked: the writer wakes, and so does whoever awaits an
        iteration it settled or the first HELLOs."""
        self._wake.set()
        woken, self.core.woken = self.core.woken, set()
        for iteration in woken:
            waiter = self._waiters.get(iteration)
            if waiter is not None:
                waiter.set()
        if self.core.hello_seen:
            self.core.hello_seen = False
            self._hello.set()

    def _widen(self, data: bytes) -> tuple[bool, bytes]:
        """A narrow datagram the program passed up, widened and run through it: (an aggregate?, its output)."""
        assert self.xdp is not None
        verdict, out = self.xdp.run_widened(data)
        if verdict == XDP_PASS and len(out) >= HEADER_BYTES and out[KIND_AT] == Kind.AGG:
            return True, out
        return False, out if verdict == XDP_TX else b""

    # ------------------------------------------------------------------ the node's verbs
    def return_results_from_kernel(self, own_mac: bytes) -> None:
        """From now on the XDP program sends each completed slot back to the workers' multicast group itself
        (ALEPH's result path, ``edge_results=kernel``): nothing of a chunk's sum crosses into userspace. Needs
        the xdp mode, a multicast group and a layout with shadow slots (``EdgeLayout.shadow``); ``own_mac`` is
        the gateway interface's link-layer address the results leave from."""
        if self.mode != "xdp" or self.xdp is None:
            raise ValueError("results return from the kernel only on the xdp path")
        group = self.roster.group
        if self.roster.addresses or self.results.wires:
            raise ValueError("results from the kernel are chosen before any worker says HELLO or a round is planned")
        if group is None:
            raise ValueError("results return from the kernel to a multicast group: configure edge_group")
        if not self.layout.shadow:
            raise ValueError("results from the kernel need a layout with shadow slots (EdgeLayout.shadow)")
        host, port = self.sock.getsockname()[:2]
        self.xdp.return_results(KernelResults(group=group, group_mac=multicast_mac(group[0]), own=(host, port),
                                              own_mac=own_mac, total=self.workers, chunks=self.layout.num_chunks))
        self.core.results_from_kernel()

    async def completed(self, iteration: int, *, timeout: float) -> None:  # noqa: ASYNC109
        """Return once the program has sent the result of every chunk of ``iteration`` (results from the
        kernel); EdgeTimeout names the chunks still missing workers, as the slot reports said."""
        core = self.core
        if not core.kernel_results:
            raise ValueError("completed() waits for results the program returns itself; use collect()")
        assert self.xdp is not None
        if core.window.base is None:
            core.expect(iteration)
        # the window moves only on the program's reports: a caller already waiting for the next iteration must
        # not take the tokens of one whose lost results are still being sent again
        waiter = self._waiters.setdefault(iteration, asyncio.Event())
        core.book.collecting.add(iteration)
        try:
            async with asyncio.timeout(timeout):
                while not core.done(iteration):
                    waiter.clear()
                    with contextlib.suppress(TimeoutError):
                        async with asyncio.timeout(4 * self.slot_timeout):
                            await waiter.wait()
                    if not core.done(iteration) and self.xdp.completed_chunks(iteration) >= self.layout.num_chunks:
                        core.on_done(iteration)   # its report was lost (a full ring buffer): the count says so
                        self._acted()
        except TimeoutError:
            sums = core.book.open.get(iteration)
            missing = sums.describe_missing() if sums is not None and sums.missing else "no slot report yet"
            raise EdgeTimeout(f"edge gateway: iteration {iteration}: the program has not returned every result "
                              f"after {timeout} s: {missing}") from None
        finally:
            self._waiters.pop(iteration, None)
            core.book.collecting.discard(iteration)
            core.book.open.pop(iteration, None)

    @property
    def send_stalls(self) -> int:
        """Sends the kernel refused for a full buffer (EAGAIN, ENOBUFS) and the writer waited out."""
        return self.writer.stalls

    @property
    def send_errors(self) -> int:
        """Batches dropped for another send error (logged): the protocol's own recovery repeats them."""
        return self.writer.errors

    def _stats(self) -> dict[str, int]:
        if self.xdp is not None and self.mode == "xdp":
            return self.xdp.stats()
        return self.fallback.counters if self.fallback is not None else {}

    @property
    def bad_tokens(self) -> int:
        """Datagrams dropped for a wrong token: DATA in the aggregator plus what the core dropped itself."""
        return int(self._stats().get("bad_token", 0)) + self.roster.forged

    @property
    def future_refused(self) -> int:
        """DATA the aggregator refused for an iteration past the window's horizon (netstorm/lan/window.py)."""
        return int(self._stats().get("future", 0))

    async def wait_workers(self, timeout: float) -> None:  # noqa: ASYNC109
        """Return once every expected worker has said HELLO."""
        try:
            async with asyncio.timeout(timeout):
                while len(self.roster.addresses) < self.workers:
                    self._hello.clear()
                    await self._hello.wait()
        except TimeoutError:
            missing = sorted(set(range(self.workers)) - set(self.roster.addresses))
            raise EdgeTimeout(f"edge gateway: workers {missing} never said HELLO within {timeout} s") from None

    async def collect(self, iteration: int, *, timeout: float) -> list[np.ndarray]:  # noqa: ASYNC109
        """The LAN sum of every tensor for ``iteration`` (float32); EdgeTimeout names missing workers."""
        core = self.core
        core.expect(iteration)
        sums = core.book.sums(iteration)
        waiter = self._waiters.setdefault(iteration, asyncio.Event())
        core.book.collecting.add(iteration)
        deadline = time.monotonic() + timeout
        try:
            while not sums.done:
                if sums.failure is not None:
                    raise sums.failure
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise EdgeTimeout(f"edge gateway: iteration {iteration} incomplete after {timeout} s: "
                                      f"{sums.describe_missing()}")
                waiter.clear()
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(min(remaining, 4 * self.slot_timeout)):
                        await waiter.wait()
                if not sums.done and not waiter.is_set():
                    self.nacks.poke(sums)
                    self._acted()
            if iteration in self.results.streams:
                core.finish_stream(iteration)
                self._acted()
            return sums.result()
        finally:
            self._waiters.pop(iteration, None)
            core.collected(iteration, sums)

    async def send_results(self, iteration: int, results: Sequence[np.ndarray], *, total: int,
                           unicast: bool = False) -> None:
        """Queue for every worker the result of each chunk, a sum over ``total`` workers, in the iteration's
        planned ``result_wire``, once to the multicast group (``unicast``, or without a group: a copy to each
        worker); kept for PULLs until 4 iterations later. Returns once queued: the send task paces the burst
        (netstorm/lan/outbox.py). WireError if a result does not fit its planned format."""
        absent = self.core.send_results(iteration, results, total=total, unicast=unicast)
        self._acted()
        if absent:
            raise EdgeTimeout(f"edge gateway: iteration {iteration}: no address for workers {absent} (never said "
                              "HELLO); the others got their results")

    def fail(self, iteration: int, reason: str = "") -> None:
        """The node failed ``iteration``: its collection ends and the workers are told (``GatewayCore.fail``)."""
        self.core.fail(iteration, reason)
        self._acted()

    def uplink_bursts(self, iteration: int) -> list[tuple[int, int, float, float]]:
        """Each worker's first window of ``iteration`` as (worker, bytes, first, last arrival): timed by the
        core in userspace mode, by the XDP program in xdp mode (its meter map, read in one batched lookup)."""
        if self.xdp is not None and self.mode == "xdp":
            return self.xdp.uplink_spans(iteration, self.workers)
        return self.core.uplinks.close(iteration)

    def downlink_bursts(self) -> list[tuple[int, int, float, float]]:
        """The result bursts workers reported since the last call, as (worker, bytes, 0, span)."""
        return self.core.downlinks.drain()


