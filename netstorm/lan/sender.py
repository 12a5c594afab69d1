"""The LAN worker's side: send a gradient as DATA datagrams to the gateway (or to its cluster's aggregator),
keep at most a pool's worth of chunks in flight, resend what is not acknowledged in time, and receive the
result (PULLing chunks whose RESULT was lost) with the number of workers it sums, which every RESULT
datagram carries (``Header.total``): float32 lanes, or, as a compressed round's wire says
(``netstorm/lan/resultwire.py``), exact integers at the width each datagram names, or a bitmap.

See docs/ARCHITECTURE.md, *The LAN tier*."""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import socket
import struct
import time
from collections.abc import Callable, Sequence

import numpy as np

from netstorm.lan import udp
from netstorm.lan.batch import DatagramBatch, copy_rows, dequantize_into, distinct, valid_headers
from netstorm.lan.deploy import Deployment
from netstorm.lan.downlink import ResultTimer, report_packet
from netstorm.lan.errors import EdgeTimeout, IterationAborted, WireError
from netstorm.lan.header import (
    HEADER_BYTES,
    HEADER_DTYPE,
    KIND_AT,
    MAX_LANES,
    Flag,
    Header,
    Kind,
    Precision,
)
from netstorm.lan.kinds import GATEWAY_TOKENED
from netstorm.lan.layout import EdgeLayout
from netstorm.lan.pacing import Pace
from netstorm.lan.packets import control_packet, data_packets, header_rows, set_epoch
from netstorm.lan.precision import integer_precision
from netstorm.lan.prefault import populated
from netstorm.lan.resultwire import RESULT_DTYPES, ResultWire
from netstorm.lan.tokens import LanTokens, Sender

Address = tuple[str, int]
GroupOpener = Callable[[Address, str], socket.socket]
"""Opens the socket that receives a multicast group (address, port) on the interface with a local address."""
RUN_ROWS = 8
"""Consecutive rows a send must average before they go out as slices of the model's rows instead of one copy."""
QUERY_CHUNKS = 256
"""Chunk numbers one QUERY datagram asks about."""
STALL_CHUNKS = 8
"""Oldest unacknowledged chunks resent when no ACK comes at all."""
MIN_PROBE = 0.0002
"""Shortest tail probe timeout (seconds): a floor against waking in a loop, far below any measured tail."""
PULL_CHUNKS = 1024
"""Missing result chunks PULLed per probe once results flow: a burst that overflowed the group socket can
leave most of a large model's results missing, and each probe waits a few retransmission timeouts."""
_GATEWAY_TOKENED = np.array([k in GATEWAY_TOKENED for k in range(256)])
"""Kinds (indexed by code) a worker takes only with the gateway's token (netstorm/lan/kinds.py)."""
RCVBUF_BYTES = 8 << 20
"""Receive buffer asked for the group socket (forced past ``net.core.rmem_max`` where allowed)."""


def group_socket(group: Address, local_ip: str) -> socket.socket:
    """A non-blocking UDP socket that receives the gateway's multicast group on the interface of
    ``local_ip`` (several workers on one host share the port)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    receive_buffer(sock, RCVBUF_BYTES)
    sock.bind((group[0], group[1]))
    membership = struct.pack("4s4s", socket.inet_aton(group[0]), socket.inet_aton(local_ip))
    sock.setsockopt(socket.IPPROTO_IP, socket.IP_ADD_MEMBERSHIP, membership)
    sock.setblocking(False)
    return sock


def receive_buffer(sock: socket.socket, size: int) -> None:
    """Ask for ``size`` bytes of receive buffer: past ``net.core.rmem_max`` with the privilege to
    (``SO_RCVBUFFORCE``), else up to it. A whole model's results arrive in one burst; what the buffer
    cannot hold is PULLed back, one probe at a time."""
    try:
        sock.setsockopt(socket.SOL_SOCKET, getattr(socket, "SO_RCVBUFFORCE", 33), size)
    except OSError:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, size)


def local_address(sock: socket.socket, peer: Address) -> str:
    """The address ``sock`` sends from towards ``peer``."""
    host = sock.getsockname()[0]
    if host not in ("0.0.0.0", ""):
        return str(host)
    probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        probe.connect(peer)
        return str(probe.getsockname()[0])
    finally:
        probe.close()


class _Moved(Exception):
    """A MOVED for the iteration being sent: say HELLO again and send it anew."""

    def __init__(self, epoch: int) -> None:
        super().__init__(epoch)
        self.epoch = epoch


class EdgeSender:
    """One LAN worker's sender. ``loss`` drops that fraction of first transmissions on purpose (loss
    injection); ``precision`` is how its lanes travel (Precision: FIXED32 for an fp32 worker, FP16, BF16,
    INT8)."""

    def __init__(self, sock: socket.socket, gateway: Address, *, worker: int, layout: EdgeLayout, job: int,
                 loss: float = 0.0, seed: int = 0, pull_interval: float = 0.5, secret: bytes | None = None,
                 precision: Precision = Precision.FIXED32, gso: bool = True, gro: bool = True,
                 group_opener: GroupOpener | None = None) -> None:
        self.sock = sock
        self.group_opener = group_opener or group_socket
        """How the multicast socket is opened (a harness driving namespaces opens it inside the worker's)."""
        self.gateway = gateway
        self.worker = worker
        self.layout = layout
        self.job = job
        self.loss = loss
        self.precision = precision
        self.rng = np.random.default_rng(seed * 1000 + worker)
        self.pull_interval = pull_interval
        self.retransmitted = 0
        self.dropped = 0
        self.rescaled = 0
        self.integers = False
        """The lanes are exact integers at scale 0 (a compressed job's round): a push whose integers do not
        all fit ``precision`` goes on the narrowest lane that holds them (``precision.integer_precision``)."""
        self.widened = 0
        """Pushes of integers sent on wider lanes than ``precision``: each an overflow of the narrow lane
        avoided before it was sent, not found by the aggregator (which widens every lane to int32 anyway)."""
        self.queries = 0
        self.pulls = 0
        """PULL datagrams sent for result chunks that did not arrive."""
        self.tokens = LanTokens(secret, job)
        self.forged = 0
        """Datagrams dropped for not carrying the gateway's token for this worker."""
        self.duplicate = 0.0
        """Fraction of first transmissions sent twice (duplicate injection)."""
        self.deployment: Deployment | None = None
        self.send_to: Address = gateway
        """Where DATA goes: the gateway, or this worker's cluster aggregator (from the deployment)."""
        self.group_sock: socket.socket | None = None
        self.retransmit = 0.005
        self.query_nacks = False
        """Ask about a suspected chunk (and resend on the gateway's NACK) before resending it (deployment)."""
        self.drop: frozenset[int] = frozenset()
        """Sequence numbers whose first transmission is dropped on purpose (deterministic loss injection)."""
        self.silent: frozenset[int] = frozenset()
        """Iterations none of whose DATA leaves, resends included (fault injection: a worker whose uplink
        fails for a whole iteration; it still asks, PULLs and receives)."""
        self._muted = False
        self.resent_by_nack = 0
        """Chunks resent because a NACK named this worker."""
        self.stall_resends = 0
        self.primed = 0
        """Our HELLOs to our cluster's aggregator: before the first DATA (``_prime``) and with each QUERY."""
        self._said: bytes | None = None
        """Our latest HELLO while we send to a cluster's aggregator (None: to the gateway). Its one copy at
        ``_prime`` is all the aggregator learns our address from, and a gap is only asked about: were it lost,
        the aggregator could never NACK us and the chunk would wait for ever, so each QUERY says it again."""
        """Chunks taken as lost because no ACK at all came for a while (the oldest unacknowledged)."""
        self.tail_probes = 0
        """Tail probes: the iteration's last outstanding chunk asked about (or resent) when its ACK did not come
        within the tail's probe timeout (``_pto``)."""
        self.batch = udp.BatchSender(sock, gso=gso)
        self._gso = gso
        self.announced: int | None = None
        """The deployment epoch the latest accepted RESULT announced for the next iteration (None: none yet)."""
        self.ignore_epoch: frozenset[int] = frozenset()
        """Iterations sent without acting on the epoch the result before announced (fault injection: as if the
        announcement were lost); the aggregator that refuses their DATA answers MOVED."""
        self.rehellos = 0
        """HELLOs said again for a changed deployment (netstorm/lan/redeploy.py)."""
        self.moved = 0
        """MOVED notices taken: DATA of an iteration refused for an old deployment epoch, sent again."""
        self._queued: list[np.ndarray] = []
        """Datagram rows (of ``keep``) NACKs asked for, sent together by ``_flush``."""
        self._early: list[bytes] = []
        """Datagrams that arrived while waiting for the HELLO answer."""
        self.gro = gro
        """Take coalesced datagrams whole (UDP_GRO) once deployed: a result burst the gateway sent in GSO
        batches then reaches this worker's socket a batch per receive instead of one datagram each."""
        self._coalesced: set[int] = set()
        """File numbers of our sockets that have UDP_GRO on."""
        self._offered: set[int] = set()
        """File numbers of our sockets UDP_GRO was asked for."""
        self.rounds = 0
        """Receive rounds (batches taken), each a fixed cost in Python whatever it holds."""
        self._batch = DatagramBatch()
        """Where received datagrams land, a batch at a time (allocated once)."""
        self._arrays: tuple[EdgeLayout, np.ndarray, np.ndarray, np.ndarray] | None = None
        self._back = ResultWire.float32(layout)
        """How the result being gathered travels (``push_pull``'s ``back``)."""
        self._allowed = self._back.allowed()
        self._total = 0
        """``total`` of the RESULT datagrams being gathered (0 until the first arrives)."""
        self._rtt = 0.0
        """Smoothed time from a chunk's first send to its ACK (the retransmission timeout follows it)."""
        self.downlink = ResultTimer()
        """This iteration's result burst as it arrives (netstorm/lan/downlink.py), reported to the gateway."""
        self.reports = 0
        """Downlink REPORT datagrams sent to the gateway."""
        self._tail_rtt = 0.0
        self._tail_var = 0.0
        """Smoothed time from an iteration's last first send to the last chunk's ACK, and its mean deviation
        (the tail probe's timeout follows them)."""
        self._last_rtt = 0.0
        """The latest ACK round-trip sample."""
        self._min_rtt = float("inf")
        """The shortest ACK round trip of the iteration before (a chunk that queued behind nothing)."""

    @property
    def sockets(self) -> list[socket.socket]:
        return [self.sock] if self.group_sock is None else [self.sock, self.group_sock]

    async def hello(self, *, timeout: float, aggregator: bool = False) -> Header:  # noqa: ASYNC109
        """Announce this worker until the gateway answers with its deployment (the gateway learns our
        address from it), then apply it: the pool, lanes, where DATA goes, the multicast group. The answer's
        header carries the gateway's tensor count (``tensor``), chunks (``slot``) and fixed-point ``scale``.
        The HELLO's ``iteration`` is a fresh nonce: with a secret the gateway echoes it under its token, so an
        answer cannot be forged or replayed, and our HELLO cannot be replayed from another address.
        ``aggregator``: this is a cluster aggregator's service, not the worker's trainer."""
        nonce = secrets.randbits(32)
        hello = control_packet(Kind.HELLO, job=self.job, worker=self.worker, iteration=nonce,
                               flags=Flag.AGGREGATOR if aggregator else Flag.NONE,
                               token=self.tokens.of(Sender.WORKER, self.worker, nonce, keep=False))
        buf = bytearray(HEADER_BYTES + 4 * MAX_LANES)
        try:
            async with asyncio.timeout(timeout):
                while True:
                    await udp.sendto(self.sock, hello, self.gateway)
                    with contextlib.suppress(TimeoutError):
                        async with asyncio.timeout(0.2):
                            n, _ = await udp.recvfrom_into(self.sock, buf)
                            if n >= HEADER_BYTES and buf[KIND_AT] != Kind.HELLO:
                                # a result can overtake the answer to our HELLO: keep it for the receive loop
                                self._early.append(bytes(buf[:n]))
                                self._early = self._early[-4096:]
                            if n >= HEADER_BYTES and buf[KIND_AT] == Kind.HELLO:
                                with contextlib.suppress(WireError):
                                    data = bytes(buf[:n])
                                    reply = Header.decode(data)
                                    if not self.tokens.enabled or (
                                            reply.iteration == nonce and reply.worker == self.worker and
                                            self.tokens.valid(Sender.GATEWAY, self.worker, nonce, reply.token,
                                                              keep=False)):
                                        self._deploy(Deployment.decode(data[HEADER_BYTES:]), reply.scale)
                                        self._said = hello if self.send_to != self.gateway else None
                                        if self._said is not None:
                                            await self._prime(hello)
                                        return reply
                                    self.forged += 1
        except TimeoutError:
            raise EdgeTimeout(f"edge worker {self.worker}: gateway {self.gateway} did not answer HELLO "
                              f"within {timeout} s") from None

    async def _prime(self, datagram: bytes) -> None:
        """Send one datagram (our HELLO, which an aggregator ignores) to where DATA will go, so the kernel
        resolves that host's link-layer address now. This worker has never sent to its cluster's
        aggregator: unresolved, the kernel would hold only ``unres_qlen_bytes`` (about 100 datagrams) of
        the first window and drop the rest, oldest first, and their recovery cost whole windows of resends
        on a shaped LAN."""
        self.primed += 1
        await udp.sendto(self.sock, datagram, self.send_to)

    def _deploy(self, deployment: Deployment, scale: int) -> None:
        old = self.deployment
        self.deployment = deployment
        if old is None or (old.pool, old.lanes, old.kernel_results) != (deployment.pool, deployment.lanes,
                                                                         deployment.kernel_results):
            # a HELLO said again for a changed deployment keeps the layout in use (a compressed round's wire)
            self.layout = EdgeLayout(self.layout.sizes, tuple(scale for _ in self.layout.sizes),
                                     lanes=deployment.lanes, pool=deployment.pool,
                                     shadow=deployment.kernel_results)
        self.send_to = deployment.send_to if deployment.send_to is not None else self.gateway
        self.batch.gso = self._gso
        if self.send_to != self.gateway:
            # a cluster aggregator: its program runs in generic mode on the loopback device (this host's own
            # trainer) and may on its LAN interface, and a generic program never sees a UDP GSO batch that
            # arrives whole (lo and a veth whose peer runs no native program segment nothing): the batch is
            # lost. Separate datagrams keep every one in the program's path: a window of them per sendmmsg
            # (``udp.BatchSender``), each its own packet, one sendto each only where libc has no sendmmsg.
            self.batch.gso = False
        self.retransmit = deployment.retransmit
        self.query_nacks = deployment.query_nacks
        self.batch.pace = Pace.gbit(deployment.pace_gbit) if deployment.pace_gbit else None
        if deployment.group is not None and self.group_sock is None:
            self.group_sock = self.group_opener(deployment.group, local_address(self.sock, self.gateway))


    def close(self) -> None:
        if self.group_sock is not None:
            self.group_sock.close()
            self.group_sock = None

    @property
    def epoch(self) -> int:
        """The deployment epoch this worker's DATA carries (its latest HELLO answer's)."""
        return self.deployment.epoch if self.deployment is not None else 0

    async def push_pull(
        self, iteration: int, tensors: Sequence[np.ndarray], *, timeout: float,  # noqa: ASYNC109
        back: ResultWire | None = None,
    ) -> tuple[list[np.ndarray], int]:
        """Contribute ``tensors`` to ``iteration``; the result the gateway sends back (each tensor's elements,
        float32, as ``back`` says it travels: None, float32 lanes on this layout), and how many workers'
        gradients it sums (0 from a gateway that does not say).

        When the result before announced another deployment epoch than this worker's, it first says HELLO
        again for its part of the new deployment; a MOVED for the iteration (its DATA was refused for an old
        epoch) does the same and sends the whole iteration anew (netstorm/lan/redeploy.py)."""
        deadline = time.monotonic() + timeout
        stale = self.announced is not None and self.announced != self.epoch and iteration not in self.ignore_epoch
        while True:
            if stale:
                self.rehellos += 1
                try:
                    await self.hello(timeout=max(0.01, deadline - time.monotonic()))
                except EdgeTimeout as exc:
                    raise EdgeTimeout(f"{exc} (asked again for deployment epoch {self.announced})") from None
            try:
                return await self._push_pull(iteration, tensors, timeout=max(0.0, deadline - time.monotonic()),
                                             back=back)
            except _Moved as moved:
                self.moved += 1
                self.announced = moved.epoch
                stale = True

    async def _push_pull(
        self, iteration: int, tensors: Sequence[np.ndarray], *, timeout: float,  # noqa: ASYNC109
        back: ResultWire | None = None,
    ) -> tuple[list[np.ndarray], int]:
        self._total = 0
        self.downlink.start(iteration)
        self._muted = iteration in self.silent
        back = self._expect(ResultWire.float32(self.layout) if back is None else back)
        values = [np.asarray(t, np.float32).reshape(-1) for t in tensors]
        token = self.tokens.worker(self.worker, iteration)
        precision = self.precision
        if self.integers and precision != Precision.FIXED32:
            precision = integer_precision(values, precision)
            self.widened += precision != self.precision
        parts = [data_packets(self.layout, job=self.job, worker=self.worker, iteration=iteration, tensor=t,
                              values=v, token=token, precision=precision) for t, v in enumerate(values)]
        rows = set_epoch(parts[0] if len(parts) == 1 else np.concatenate(parts), self.epoch)
        flight = _Flight(len(rows), self.layout.window)
        out = self._result_matrix()
        missing = np.ones(back.layout.num_chunks, bool)
        deadline = time.monotonic() + timeout
        while not flight.acked.all():
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                open_ = np.flatnonzero(~flight.acked)[:8].tolist()
                raise EdgeTimeout(f"edge worker {self.worker}: iteration {iteration}: {flight.unacked()} chunks "
                                  f"never acknowledged by gateway {self.gateway} within {timeout} s (first: {open_})")
            start, stop = flight.sendable()
            if stop > start:
                await self._send_rows(rows, np.arange(start, stop), first=True)
                flight.sent(start, stop, time.monotonic())
            # a resent chunk's ACK needs a round trip through the queue too: wait that long before again
            grace = self._grace()
            # no longer than until the oldest gap is due: the gap rule, not the stall rule, takes a loss
            # that later ACKs revealed, also when no datagram comes meanwhile. The gateway NACKs a gap itself
            # once a later chunk completes, so a worker asks only when that answer is late too
            reorder = grace if self.query_nacks else None
            now = time.monotonic()
            probing = (self._pto(), self._reorder(flight))
            wait = min(self._rto(), flight.gap_due(now, grace, reorder), flight.probe_due(now, *probing))
            await self._receive(min(remaining, wait))
            self._take(iteration, rows, values, out, missing, flight)
            await self._flush()
            now = time.monotonic()
            gap, stalled = flight.late(now, grace, self._rto(), reorder)
            self.stall_resends += int(stalled.size)
            probe = flight.probe(now, *probing) if not stalled.size else None
            if probe is not None:
                # nothing later can reveal the tail's loss: ask about its newest chunk (the gateway NACKs
                # whoever is missing from it), or resend it without NACKs; its ACK then reveals the rest
                self.tail_probes += 1
                gap = distinct(np.append(gap, probe)) if self.query_nacks else gap
                stalled = stalled if self.query_nacks else distinct(np.append(stalled, probe))
            if self.query_nacks:
                # a gap is only asked about (again each timeout): the gateway NACKs whoever is missing
                ask = distinct(gap)
                ask = ask[~np.isin(ask, stalled)]
                if ask.size:
                    await self._query(iteration, ask)
                    flight.resent(ask, now, asked_only=True)
                    flight.asked[ask] = True
                late = stalled
            else:
                late = distinct(np.concatenate([gap, stalled]))[:QUERY_CHUNKS]
            if late.size:
                await self._resend(iteration, rows, late, flight, now)
        if flight.min_rtt < float("inf"):
            self._min_rtt = flight.min_rtt
        await self._gather(iteration, rows, values, out, missing, deadline - time.monotonic())
        await self._report(iteration)
        return back.decode(self._split(out)), self._total

    async def receive_first(self, *, timeout: float) -> tuple[int, list[np.ndarray], int]:  # noqa: ASYNC109
        """The next result the gateway sends, whatever its iteration (how a joining worker gets ``init``):
        its iteration, the result, and how many workers' gradients it sums."""
        self._total = 0
        self._expect(ResultWire.float32(self.layout))
        out = self._result_matrix()
        missing = np.ones(self.layout.num_chunks, bool)
        keep = np.zeros((0, 0), np.uint8)
        iteration = await self._gather(None, keep, [], out, missing, timeout)
        return iteration, self._split(out), self._total

    # ------------------------------------------------------------------ internals
    @property
    def ack_rtt(self) -> float:
        """The smoothed time from a chunk's first send to its ACK (queueing behind the window included)."""
        return self._rtt

    def _grace(self) -> float:
        """How long an unacknowledged chunk below an acknowledged one waits before it is taken as lost."""
        return max(self.retransmit, 1.25 * self._rtt)

    def _rto(self) -> float:
        """How long without any ACK before the oldest unacknowledged chunks are resent."""
        return max(4 * self.retransmit, 2 * self._rtt)

    def _pto(self) -> float:
        """The tail probe's timeout when no chunk sent with the last one was acknowledged yet, from the
        iteration's last first send: the tail round trip measured in earlier iterations plus four mean
        deviations (TCP's RTO formula over those samples), or before the first sample two ACK round trips
        (TCP's tail loss probe; the latest sample where it is longer than the smoothed one, since chunks sent
        later queue behind more); the stall rule's wait before any ACK came, and never longer."""
        if self._tail_rtt:
            pto = self._tail_rtt + 4 * self._tail_var
        elif self._rtt:
            pto = 2 * max(self._rtt, self._last_rtt)
        else:
            return self._rto()
        return min(self._rto(), max(pto, MIN_PROBE))

    def _reorder(self, flight: _Flight) -> float:
        """How long the last chunk's ACK may trail the ACK of the chunk sent just before it before it is
        probed: the shortest ACK round trip measured in this iteration and the one before it. The two
        complete a few datagrams apart at the aggregator; their ACKs are at most an agent's batch apart, and
        a batch takes less than a round trip that queued behind nothing."""
        shortest = min(flight.min_rtt, self._min_rtt)
        return max(MIN_PROBE, shortest if shortest < float("inf") else self._pto())

    def _tail_sample(self, sample: float) -> None:
        if not self._tail_rtt:
            self._tail_rtt, self._tail_var = sample, sample / 2
        else:
            self._tail_var = 0.75 * self._tail_var + 0.25 * abs(sample - self._tail_rtt)
            self._tail_rtt = 0.875 * self._tail_rtt + 0.125 * sample

    async def _send_rows(self, rows: np.ndarray, index: np.ndarray, *, first: bool) -> None:
        """Send the chosen rows in batches; first transmissions pass the loss and duplicate injection."""
        if self._muted:
            self.dropped += int(index.size)
            return
        if first and self.drop:
            keep = ~np.isin(index, np.fromiter(self.drop, np.int64, len(self.drop)))
            self.dropped += int(index.size - keep.sum())
            index = index[keep]
        if first and self.loss:
            keep = self.rng.random(index.size) >= self.loss
            self.dropped += int(index.size - keep.sum())
            index = index[keep]
        if first and self.duplicate:
            twice = index[self.rng.random(index.size) < self.duplicate]
            index = np.sort(np.concatenate([index, twice]))
        if not index.size:
            return
        # consecutive rows go out as slices of ``rows`` (views): a window's range, or what a lost datagram
        # splits it into, costs no copy of the rows kept (a copy of every row was most of a worker's Python
        # time under loss); rows scattered more finely than RUN_ROWS a run on average are copied once
        breaks = np.flatnonzero(np.diff(index) != 1) + 1
        if breaks.size and index.size < RUN_ROWS * (breaks.size + 1):
            await self.batch.send(rows[index], self.send_to)
            return
        for start, stop in zip([0, *breaks.tolist()], [*breaks.tolist(), index.size], strict=True):
            await self.batch.send(rows[int(index[start]): int(index[stop - 1]) + 1], self.send_to)

    async def _resend(self, iteration: int, rows: np.ndarray, late: np.ndarray, flight: _Flight, now: float) -> None:
        """Resend every chunk unacknowledged past the timeout, and ask the gateway which of them completed
        (their ACKs may be what was lost)."""
        self.retransmitted += int(late.size)
        await self._send_rows(rows, late, first=False)
        flight.resent(late, now)
        await self._query(iteration, late)

    async def _report(self, iteration: int) -> None:
        """Tell the gateway how this iteration's result burst arrived (its measure of our downlink); a lost
        report costs one sample."""
        report = self.downlink.report()
        if report is None:
            return
        self.reports += 1
        await udp.sendto(self.sock, report_packet(report, job=self.job, worker=self.worker, iteration=iteration,
                                                  token=self.tokens.worker(self.worker, iteration)), self.gateway)

    async def _query(self, iteration: int, chunks: np.ndarray) -> None:
        """Ask the gateway about ``chunks`` (sequence numbers), QUERY_CHUNKS per datagram; our cluster's
        aggregator, which the gateway NACKs for them, hears our HELLO again."""
        if self._said is not None:
            self.primed += 1
            await udp.sendto(self.sock, self._said, self.send_to)
        for start in range(0, chunks.size, QUERY_CHUNKS):
            part = chunks[start: start + QUERY_CHUNKS].astype("<u4")
            head = header_rows(1, kind=Kind.QUERY, job=self.job, worker=self.worker, iteration=iteration,
                               token=self.tokens.worker(self.worker, iteration))
            head["count"] = part.size
            head["need"] = 127
            self.queries += 1
            await udp.sendto(self.sock, head.tobytes() + part.tobytes(), self.gateway)

    async def _receive(self, timeout: float) -> int:  # noqa: ASYNC109
        """Fill the batch with what is queued on our sockets, waiting up to ``timeout`` for the first
        datagram; how many it holds."""
        if self._drain() or timeout <= 0:
            return self._batch.count
        loop = asyncio.get_running_loop()
        ready: asyncio.Future[None] = loop.create_future()

        def wake() -> None:
            if not ready.done():
                ready.set_result(None)

        socks = self.sockets
        for sock in socks:
            loop.add_reader(sock.fileno(), wake)
        try:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(timeout):
                    await ready
        finally:
            for sock in socks:
                loop.remove_reader(sock.fileno())
        return self._drain()

    def _drain(self) -> int:
        """Refill the batch: datagrams kept from before, then each socket's queue (one ``recvmmsg`` per
        socket and batch; what does not fit stays queued in the kernel for the next round)."""
        batch = self._batch
        batch.clear()
        self.rounds += 1
        while self._early and batch.put(self._early[0]):
            self._early.pop(0)
        for sock in self.sockets:
            if self.gro and sock.fileno() not in self._offered:
                # on the first receive of our own, not at HELLO: a cluster aggregator says HELLO through
                # this class but reads its sockets itself, one datagram per receive
                self._offered.add(sock.fileno())
                if udp.enable_gro(sock):
                    self._coalesced.add(sock.fileno())
            gro = sock.fileno() in self._coalesced
            while batch.count < batch.rows and udp.receive_batch(sock, batch, gro=gro):
                pass
        return batch.count

    def _expect(self, back: ResultWire) -> ResultWire:
        """The result being gathered travels as ``back`` (its chunks, and which precision each tensor's
        datagrams may carry)."""
        self._back = back
        self._allowed = back.allowed()
        self._arrays = None
        return back

    def _result_matrix(self) -> np.ndarray:
        """One row of lanes (as float32, exact) per chunk of the result: RESULT lanes land here by sequence
        number. Read only once every chunk's row was written (``_split``), so not cleared first; its pages
        are mapped at once (``populated``), not faulted in as results arrive."""
        layout = self._back.layout
        return populated((layout.num_chunks, layout.lanes), np.float32)

    def _split(self, out: np.ndarray) -> list[np.ndarray]:
        """Each tensor's result lanes: a view of its chunks' rows, without the last chunk's padding."""
        layout = self._back.layout
        return [out[first: first + chunks].reshape(-1)[:size]
                for first, chunks, size in zip(layout.first_slot, layout.chunks, layout.sizes, strict=True)]

    async def _gather(self, iteration: int | None, keep: np.ndarray, values: list[np.ndarray],
                      out: np.ndarray, missing: np.ndarray, timeout: float) -> int:  # noqa: ASYNC109
        """Receive RESULT datagrams (answering NACKs meanwhile) until every chunk is in."""
        deadline = time.monotonic() + timeout
        quiet = self.pull_interval
        progress = time.monotonic()
        """When a result chunk last arrived: other datagrams (ACKs of workers already in the next iteration)
        keep coming while ours are lost, so silence is measured on progress."""
        while missing.any():
            now = time.monotonic()
            remaining = deadline - now
            if remaining <= 0:
                what = "the first result" if iteration is None else f"iteration {iteration}"
                raise EdgeTimeout(f"edge worker {self.worker}: {what}: {int(missing.sum())} result "
                                  f"chunks from gateway {self.gateway} missing after {timeout} s")
            # once results flow, a gap of a few retransmission timeouts means some were lost
            wait = quiet if missing.all() else max(4 * self._rto(), 0.02)
            if now - progress >= wait:
                if iteration is not None:
                    await self._pull(iteration, missing)
                progress = now
            await self._receive(min(remaining, wait - (now - progress)))
            before = int(missing.sum())
            if iteration is None:
                iteration = self._first_iteration()
            if iteration is not None:
                self._take(iteration, keep, values, out, missing, None)
            if int(missing.sum()) < before:
                progress = time.monotonic()
            await self._flush()
        assert iteration is not None
        return iteration

    def _first_iteration(self) -> int | None:
        """The iteration of the batch's first RESULT that carries the gateway's token (a joining worker
        takes whatever iteration the gateway is sending)."""
        batch = self._batch
        heads = batch.headers()
        candidates = np.flatnonzero(valid_headers(heads, batch.lengths) & (heads["kind"] == Kind.RESULT) &
                                    (heads["job"] == self.job))
        for row in candidates:
            iteration, token = int(heads["iteration"][row]), int(heads["token"][row])
            if self._from_gateway(iteration, token):
                return iteration
            self.forged += 1
        return None

    def _from_gateway(self, iteration: int, token: int) -> bool:
        """Whether ``token`` is the gateway's for this worker, or for the whole group, in ``iteration``."""
        if not self.tokens.enabled:
            return True
        return self.tokens.valid(Sender.GATEWAY, self.worker, iteration, token) or \
            self.tokens.valid(Sender.GROUP, 0, iteration, token)

    def _take(self, iteration: int, keep: np.ndarray, values: list[np.ndarray], out: np.ndarray,
              missing: np.ndarray, flight: _Flight | None) -> None:
        """Handle the batch at once: every datagram's header is checked as ``Header.decode`` would
        (``batch.valid_headers``), those of another job or iteration or without the gateway's token are
        dropped, RESULT lanes are scattered into ``out`` by sequence number, and the chunk numbers of every
        ACK go to the window in one call. Only NACKs (rare: a slot timer fired) are handled one by one."""
        batch = self._batch
        if not batch.count:
            return
        heads = batch.headers()
        kind = heads["kind"]
        ok = valid_headers(heads, batch.lengths)
        ok &= (heads["job"] == self.job) & (heads["iteration"] == iteration & 0xFFFFFFFF)
        if self.tokens.enabled:
            tokens = heads["token"]
            genuine = (tokens == np.uint64(self.tokens.gateway(self.worker, iteration))) | \
                (tokens == np.uint64(self.tokens.group(iteration)))
            forged = ok & _GATEWAY_TOKENED[kind] & ~genuine
            self.forged += int(forged.sum())
            ok &= ~forged
        if np.any(ok & (kind == Kind.FAILED)):
            raise IterationAborted(f"edge worker {self.worker}: iteration {iteration} failed (the gateway says so): "
                                   f"no result will come")
        # a MOVED, or a NACK, from an aggregator under another deployment than this worker's: it sends where
        # an old one said (or the aggregator is behind, and asks too); it asks for its part and sends anew
        moved = np.flatnonzero(ok & (heads["epoch"] != self.epoch) & (
            ((kind == Kind.MOVED) & (heads["worker"] == self.worker)) | (kind == Kind.NACK)))
        if keep.size and moved.size:
            raise _Moved(int(heads["epoch"][moved[0]]))
        results = self._take_results(np.flatnonzero(ok & (kind == Kind.RESULT)), out, missing)
        if flight is not None:
            # a chunk's result says it completed as its ACK does (a gateway that streams results sends
            # them while this worker still sends): either frees the chunk's slot for reuse
            # (a result names a data chunk only when it travels on the data's own chunks: float32 lanes)
            same = self._back.layout == self.layout
            self._take_acks(np.flatnonzero(ok & (kind == Kind.ACK)), flight, also=results if same else None)
        if keep.size:
            nacks = ok & (kind == Kind.NACK)
            rescale = nacks & ((heads["flags"] & int(Flag.RESCALE)) != 0)
            self._on_nacks(np.flatnonzero(nacks & ~rescale), keep, flight)
            for row in np.flatnonzero(rescale):
                self._on_nack(Header.decode(batch.datagram(int(row))), iteration, keep, values, flight)

    def _take_results(self, rows: np.ndarray, out: np.ndarray, missing: np.ndarray) -> np.ndarray:
        """Scatter the lanes of RESULT ``rows`` to their chunks' rows of ``out``; a row naming no chunk of
        the layout, or not exactly its lane count, is dropped. Returns the sequence numbers of every chunk a
        valid RESULT named (new or repeated)."""
        if not rows.size:
            return np.zeros(0, np.int64)
        heads = self._batch.headers()
        totals = heads["total"][rows]
        total = self._total or int(totals[0])
        if np.any(totals != total):
            raise WireError(f"edge worker {self.worker}: the RESULT datagrams of one iteration disagree on how "
                            f"many workers they sum ({sorted({total, *map(int, totals)})})")
        self._total = total
        layout = self._back.layout
        tensor = heads["tensor"][rows].astype(np.int64)
        chunk = heads["chunk"][rows].astype(np.int64)
        precision = heads["precision"][rows].astype(np.int64)
        known = tensor < len(layout.sizes)
        tensor = np.where(known, tensor, 0)
        chunks, first, sizes = self._layout_arrays()
        known &= chunk < chunks[tensor]
        known &= heads["count"][rows] == np.minimum(layout.lanes, sizes[tensor] - chunk * layout.lanes)
        known &= self._allowed[tensor, precision]   # each tensor's datagrams carry what its format allows
        seq = first[tensor] + chunk
        fresh = known & missing[np.where(known, seq, 0)]
        named = seq[known]
        rows, seq, precision = rows[fresh], seq[fresh], precision[fresh]
        for code in distinct(precision).tolist():
            mine = precision == code
            if code == Precision.SCALED32:
                # the aggregate itself, from the aggregation program: converted as the agent converts its sums
                picked = rows[mine]
                dequantize_into(out, seq[mine], self._batch.lanes("<i4")[:, : layout.lanes], picked,
                                heads["scale"][picked])
                continue
            copy_rows(out, seq[mine], self._batch.lanes(RESULT_DTYPES[Precision(code)])[:, : layout.lanes], rows[mine])
        missing[seq] = False
        if rows.size:
            self.downlink.on_results(int(self._batch.lengths[rows].sum()), time.monotonic())
            self.announced = int(heads["epoch"][rows[0]])
        return named

    def _take_acks(self, rows: np.ndarray, flight: _Flight, *, also: np.ndarray | None = None) -> None:
        """Every chunk number the ACK ``rows`` list (and ``also``: chunks whose result came), to the window
        at once (with a round-trip sample)."""
        if not rows.size and (also is None or not also.size):
            return
        listed = also if also is not None else np.zeros(0, np.int64)
        if rows.size:
            counts = self._batch.headers()["count"][rows].astype(np.int64)
            width = int(counts.max())
            acked = self._batch.lanes("<u4")[rows, :width][np.arange(width) < counts[:, None]].astype(np.int64)
            listed = np.concatenate([acked, listed])
        sample, tail = flight.ack(listed[listed < flight.acked.size], time.monotonic())
        if sample is not None:
            self._rtt = sample if not self._rtt else 0.875 * self._rtt + 0.125 * sample
            self._last_rtt = sample
        if tail is not None:
            self._tail_sample(tail)

    def _layout_arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The result layout's chunks, first sequence number and size per tensor, as arrays (made once per
        layout)."""
        if self._arrays is None or self._arrays[0] is not self._back.layout:
            layout = self._back.layout
            self._arrays = (layout, np.asarray(layout.chunks, np.int64), np.asarray(layout.first_slot, np.int64),
                            np.asarray(layout.sizes, np.int64))
        return self._arrays[1], self._arrays[2], self._arrays[3]

    def _on_nacks(self, rows: np.ndarray, keep: np.ndarray, flight: _Flight | None) -> None:
        """Resend every chunk the NACK ``rows`` list (u32 sequence numbers), all at once: a number past the
        layout is ignored, one listed twice (or by several NACKs) is resent once, and, as for a single NACK,
        a chunk acknowledged already or resent within the last round trip is not resent (every asker's QUERY
        brings this worker a NACK for the same loss)."""
        if not rows.size:
            return
        counts = self._batch.headers()["count"][rows].astype(np.int64)
        width = int(counts.max())
        if not width:
            return
        listed = self._batch.lanes("<u4")[rows, :width][np.arange(width) < counts[:, None]].astype(np.int64)
        index = distinct(listed[listed < keep.shape[0]])
        if flight is not None:
            now = time.monotonic()
            index = index[index < flight.next]   # was sent at all
            index = index[~flight.acked[index] & (now - flight.resent_at[index] >= max(self.retransmit, self._rtt))]
        if not index.size:
            return
        self.retransmitted += int(index.size)
        self.resent_by_nack += int(index.size)
        self._queued.append(keep[index])
        if flight is not None:
            flight.resent(index, time.monotonic())

    def _on_nack(self, head: Header, iteration: int, keep: np.ndarray, values: list[np.ndarray],
                 flight: _Flight | None) -> None:
        """Resend the chunk a RESCALE NACK names, re-quantised first when it asks for a smaller scale."""
        try:
            index = self.layout.seq(head.tensor, head.chunk)
        except WireError:
            return
        current = int(np.frombuffer(keep[index][:HEADER_BYTES].tobytes(), HEADER_DTYPE)["scale"][0])
        if head.flags & Flag.RESCALE and head.scale < current:   # a repeated request finds it done
            keep[index] = data_packets(self.layout, job=self.job, worker=self.worker, iteration=iteration,
                                       tensor=head.tensor, values=values[head.tensor],
                                       chunks=np.array([head.chunk]), scale=head.scale,
                                       token=self.tokens.worker(self.worker, iteration),
                                       precision=self.precision)[0]
            self.rescaled += 1
        if flight is not None and not head.flags & Flag.RESCALE and (
                flight.acked[index] or time.monotonic() - flight.resent_at[index] < max(self.retransmit, self._rtt)):
            return   # done already, or resent moments ago (several workers' QUERYs name the same chunk)
        if flight is None or flight.was_sent(index):
            self.retransmitted += 1
            self.resent_by_nack += 1
            self._queued.append(keep[index: index + 1].copy())
            if flight is not None:
                flight.resent(np.array([index]), time.monotonic())

    async def _flush(self) -> None:
        """Send the chunks NACKs asked for since the last flush: one segmented send (UDP GSO) for all of
        them, as a first send goes."""
        queued, self._queued = self._queued, []
        if not queued:
            return
        rows = np.concatenate(queued) if len(queued) > 1 else queued[0]
        if self._muted:
            self.dropped += len(rows)
            return
        await self.batch.send(rows, self.send_to)

    async def _pull(self, iteration: int, missing: np.ndarray) -> None:
        """Retransmit queued answers, then ask for up to PULL_CHUNKS result chunks that never arrived (one
        while none has arrived)."""
        await self._flush()
        # none yet: the WAN step may still run, or every copy was lost; one PULL probes which (the gateway
        # answers only once it has the result), and the rest follow once results flow
        limit = 1 if missing.all() else PULL_CHUNKS
        self.downlink.on_pull()
        for index in np.flatnonzero(missing)[:limit]:
            tensor, chunk = self._back.layout.locate(int(index))
            self.pulls += 1
            await udp.sendto(self.sock, control_packet(Kind.PULL, job=self.job, worker=self.worker,
                                                       iteration=iteration, tensor=tensor, chunk=chunk,
                                                       token=self.tokens.worker(self.worker, iteration)),
                             self.gateway)


class _Flight:
    """Which chunks of one iteration were sent, when, and which came back acknowledged (the pool's window)."""

    def __init__(self, chunks: int, pool: int) -> None:
        self.pool = pool
        self.acked = np.zeros(chunks, bool)
        self.sent_at = np.full(chunks, np.inf)
        self.first_sent = np.full(chunks, np.inf)
        self.asked = np.zeros(chunks, bool)
        """Chunks a QUERY asked about (asked again only a timeout later)."""
        self.passed_at = np.full(chunks, np.inf)
        """When a later chunk's ACK first came for each chunk (a gap opened below it)."""
        self.resent_at = np.full(chunks, -np.inf)
        """When each chunk was last really sent again (not only asked about)."""
        self.next = 0
        """Chunks below this were sent at least once."""
        self.highest = 0
        """One past the highest chunk acknowledged."""
        self.last_ack = float("inf")
        """When the latest ACK came (inf until the first chunks are sent)."""
        self.backoff = 1
        self.final_sent = float("inf")
        """When the last chunk was first sent (the tail probe's clock starts there)."""
        self.probe_at = float("inf")
        """When the latest tail probe went out (inf: none yet)."""
        self.probes = 0
        """Tail probes since the last ACK that acknowledged something new (each doubles the next timeout)."""
        self.min_rtt = float("inf")
        """The shortest ACK round trip sampled in this iteration."""

    def sendable(self) -> tuple[int, int]:
        """The chunks [start, stop) the window allows now: chunk j once j < pool or chunk j - pool is acked."""
        start = self.next
        n = self.acked.size
        if start >= n:
            return start, start
        # chunk j needs chunk j - pool acknowledged, which was sent, so j < next + pool
        candidates = np.arange(start, min(n, start + self.pool))
        allowed = (candidates < self.pool) | self.acked[np.maximum(candidates - self.pool, 0)]
        return start, start + (int(np.argmin(allowed)) if not allowed.all() else candidates.size)

    def sent(self, start: int, stop: int, now: float) -> None:
        self.sent_at[start:stop] = now
        self.first_sent[start:stop] = now
        self.next = stop
        if stop == self.acked.size:
            self.final_sent = now
        if self.last_ack == float("inf"):
            self.last_ack = now

    def resent(self, index: np.ndarray, now: float, *, asked_only: bool = False) -> None:
        """``index`` went out again (or, ``asked_only``, was only asked about): its timeout starts over."""
        self.sent_at[index] = now
        if not asked_only:
            self.resent_at[index] = now

    def was_sent(self, index: int) -> bool:
        return index < self.next

    def ack(self, seqs: np.ndarray, now: float) -> tuple[float | None, float | None]:
        """Mark ``seqs`` acknowledged; an ACK round-trip sample from chunks sent once, if any, and a tail
        sample (the last chunk's first send to its ACK) if the last chunk is among them, sent once and never
        probed."""
        fresh = seqs[~self.acked[seqs]]
        self.acked[seqs] = True
        if not fresh.size:
            return None, None
        self.last_ack = now
        self.backoff = 1
        self.probes = 0
        highest = max(self.highest, int(fresh.max()) + 1)
        self.passed_at[self.highest: highest] = now
        self.highest = highest
        once = fresh[self.sent_at[fresh] == self.first_sent[fresh]]
        last = self.acked.size - 1
        tail = float(now - self.final_sent) if last in once and self.probe_at == float("inf") else None
        if not once.size:
            return None, tail
        self.min_rtt = min(self.min_rtt, float(now - np.max(self.sent_at[once])))
        return float(now - np.max(self.sent_at[once])), tail

    def _tail(self) -> int | None:
        """The newest unacknowledged chunk when every chunk was sent and no acknowledged one is above it
        (so no later ACK can reveal its loss), else None."""
        n = self.acked.size
        if self.next < n or self.acked[n - 1]:
            return None
        return n - 1

    def probe_due(self, now: float, pto: float, reorder: float) -> float:
        """Seconds until ``probe`` asks about the tail (inf: no tail outstanding). The tail is due ``reorder``
        after the chunk sent just before the last one was acknowledged (every worker sends the two back to
        back, so the last completes right after it unless a datagram was lost), else ``pto`` after the last
        first send; after a probe, not before ``reorder`` has passed, and while no ACK brings anything new,
        ``pto`` doubled per probe after it."""
        tail = self._tail()
        if tail is None:
            return float("inf")
        due = self.final_sent + pto
        if tail and self.acked[tail - 1]:
            due = min(due, self.last_ack + reorder)
        if self.probe_at < float("inf"):
            due = max(due, self.probe_at + (pto * 2 ** (self.probes - 1) if self.probes else reorder))
        return max(0.0, due - now)

    def probe(self, now: float, pto: float, reorder: float) -> int | None:
        """The chunk to probe now, if any: the newest (as TCP's tail loss probe sends its last segment),
        when ``probe_due`` has passed."""
        tail = self._tail()
        if tail is None or self.probe_due(now, pto, reorder) > 0:
            return None
        self.probe_at = now
        self.probes += 1
        return tail

    def late(self, now: float, grace: float, stall: float,
             reorder: float | None = None) -> tuple[np.ndarray, np.ndarray]:
        """Chunks taken as lost: (gap) unacknowledged ones older than a chunk already acknowledged (ACKs
        come back roughly in sending order, so a gap means a loss) once ``grace`` has passed since they were
        sent, at most QUERY_CHUNKS; (stalled) when no ACK came for ``stall`` seconds (doubled after every
        such round until an ACK comes, as TCP backs off: a slow peer is not a loss), the oldest few
        unacknowledged ones. With ``reorder`` (chunks are only asked about, which costs no data) a gap is
        due ``reorder`` after the later ACK came, not ``grace`` after its own send: the send-to-ACK time
        includes the queue of the whole window sent before it, while a later chunk's ACK shows at once that
        this one's datagrams went by; a chunk resent meanwhile (on the gateway's NACK) waits ``grace`` after
        that resend, and it is asked about again ``grace`` after each QUERY."""
        window = slice(0, self.next)
        open_ = ~self.acked[window]
        age = now - self.sent_at[window]
        below = open_ & (np.arange(self.next) < self.highest)
        if reorder is None:
            due = age > grace
        else:
            asked = self.asked[window]
            due = (age > grace) & (asked | (now - self.passed_at[window] > reorder))
        gap = np.flatnonzero(below & due)[:QUERY_CHUNKS]
        oldest = gap[:0]
        if now - self.last_ack > stall * self.backoff:
            oldest = np.flatnonzero(open_ & (age > stall * self.backoff))[:STALL_CHUNKS]
            if oldest.size:
                self.backoff = min(64, self.backoff * 2)
                self.last_ack = now
        return gap, oldest

    def gap_due(self, now: float, grace: float, reorder: float | None = None) -> float:
        """Seconds until ``late`` takes the first unacknowledged chunk below an acknowledged one (inf: none
        is below one)."""
        below = ~self.acked[: self.highest]
        if not below.any():
            return float("inf")
        due = self.sent_at[: self.highest] + grace
        if reorder is not None:
            due = np.where(self.asked[: self.highest], due, np.maximum(due, self.passed_at[: self.highest] + reorder))
        return max(0.0, float(due[below].min()) - now)

    def unacked(self) -> int:
        return int((~self.acked).sum())
