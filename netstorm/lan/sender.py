"""The LAN worker's asyncio shell: its UDP socket (and the multicast group's), one timer, and the bytes its
sender core (netstorm/lan/sendercore.py) asks to send. The core holds the rules: the pool's window, the
retransmission timeouts, the NACK answers, the gathered RESULTs and PULLs; the shell says HELLO, applies
the deployment, injects loss on first sends when asked, and hands every receive batch and wake-up to it.

See docs/ARCHITECTURE.md, *The LAN tier*."""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import socket
import struct
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from netstorm.lan import udp
from netstorm.lan.batch import DatagramBatch
from netstorm.lan.deploy import Deployment
from netstorm.lan.errors import EdgeTimeout, WireError
from netstorm.lan.header import HEADER_BYTES, KIND_AT, MAX_LANES, Header, Kind, Precision
from netstorm.lan.layout import EdgeLayout
from netstorm.lan.pacing import Pace
from netstorm.lan.resultwire import ResultWire
from netstorm.lan.senderactions import Action, Done, Failed, Moved, Outcome, SendControl
from netstorm.lan.sendercore import SenderCore
from netstorm.lan.tokens import LanTokens

Address = tuple[str, int]
GroupOpener = Callable[[Address, str], socket.socket]
"""Opens the socket that receives a multicast group (address, port) on the interface with a local address."""
RUN_ROWS = 8
"""Consecutive rows a send must average before they go out as slices of the model's rows instead of one copy."""
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


def _core(path: str, doc: str) -> Any:
    """A property of the shell that reads and writes ``path`` (dotted) of its core: the counters and
    settings callers know the sender by."""
    *owners, name = path.split(".")

    def owner(self: EdgeSender) -> Any:
        obj: Any = self.core
        for part in owners:
            obj = getattr(obj, part)
        return obj

    return property(lambda self: getattr(owner(self), name),
                    lambda self, value: setattr(owner(self), name, value), doc=doc)


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
        self.tokens = LanTokens(secret, job)
        self.core = SenderCore(worker=worker, job=job, tokens=self.tokens, gateway=gateway,
                               pull_interval=pull_interval)
        """The rules (netstorm/lan/sendercore.py); this class moves their bytes."""
        self.integers = False
        """The lanes are exact integers at scale 0 (a compressed job's round): a push whose integers do not
        all fit ``precision`` goes on the narrowest lane that holds them (``precision.integer_precision``)."""
        self.dropped = 0
        self.duplicate = 0.0
        """Fraction of first transmissions sent twice (duplicate injection)."""
        self.deployment: Deployment | None = None
        self.send_to: Address = gateway
        """Where DATA goes: the gateway, or this worker's cluster aggregator (from the deployment)."""
        self.group_sock: socket.socket | None = None
        self.drop: frozenset[int] = frozenset()
        """Sequence numbers whose first transmission is dropped on purpose (deterministic loss injection)."""
        self.silent: frozenset[int] = frozenset()
        """Iterations none of whose DATA leaves, resends included (fault injection: a worker whose uplink
        fails for a whole iteration; it still asks, PULLs and receives)."""
        self._muted = False
        self.primed = 0
        """Our HELLOs to our cluster's aggregator: before the first DATA (``_prime``) and with each QUERY (the
        core's ``hello_again``)."""
        self.batch = udp.BatchSender(sock, gso=gso)
        self._gso = gso
        self.ignore_epoch: frozenset[int] = frozenset()
        """Iterations sent without acting on the epoch the result before announced (fault injection: as if the
        announcement were lost); the aggregator that refuses their DATA answers MOVED."""
        self.rehellos = 0
        """HELLOs said again for a changed deployment (netstorm/lan/redeploy.py)."""
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

    retransmitted = _core("retransmitted", "Chunks sent again (on a timeout or a NACK).")
    resent_by_nack = _core("nacks.resent", "Chunks resent because a NACK named this worker.")
    rescaled = _core("nacks.rescaled", "Chunks re-quantised at a smaller scale on a RESCALE NACK.")
    stall_resends = _core("stall_resends", "Chunks taken as lost because no ACK at all came for a while.")
    tail_probes = _core("tail_probes", "The last outstanding chunk asked about (or resent) on the probe timeout.")
    queries = _core("queries", "QUERY datagrams sent.")
    pulls = _core("pulls", "PULL datagrams sent for result chunks that did not arrive.")
    forged = _core("forged", "Datagrams dropped for not carrying the gateway's token for this worker.")
    widened = _core("widened", "Pushes of integers sent on wider lanes than ``precision`` (no overflow).")
    reports = _core("reports", "Downlink REPORT datagrams sent to the gateway.")
    moved = _core("moved", "MOVED notices taken: an iteration's DATA refused for an old epoch, sent again.")
    announced = _core("announced", "The deployment epoch the latest RESULT announced (None: none yet).")
    downlink = _core("downlink", "This iteration's result burst as it arrives (netstorm/lan/downlink.py).")
    retransmit = _core("timers.retransmit", "The shortest wait before a chunk is taken as lost (deployment).")
    query_nacks = _core("query_nacks", "Ask about a suspected chunk before resending it (deployment).")
    pull_interval = _core("pull_interval", "Silence before the first result chunk is PULLed.")

    @property
    def ack_rtt(self) -> float:
        """The smoothed time from a chunk's first send to its ACK (queueing behind the window included)."""
        return self.core.timers.rtt

    @property
    def coalesced(self) -> int:
        """Receives that took a coalesced (UDP_GRO) buffer whole."""
        return self._batch.coalesced

    @property
    def sockets(self) -> list[socket.socket]:
        return [self.sock] if self.group_sock is None else [self.sock, self.group_sock]

    @property
    def epoch(self) -> int:
        """The deployment epoch this worker's DATA carries (its latest HELLO answer's)."""
        return self.deployment.epoch if self.deployment is not None else 0

    async def hello(self, *, timeout: float, aggregator: bool = False) -> Header:  # noqa: ASYNC109
        """Announce this worker until the gateway answers with its deployment (the gateway learns our
        address from it), then apply it: the pool, lanes, where DATA goes, the multicast group. The answer's
        header carries the gateway's tensor count (``tensor``), chunks (``slot``) and fixed-point ``scale``.
        The HELLO's ``iteration`` is a fresh nonce: with a secret the gateway echoes it under its token, so an
        answer cannot be forged or replayed, and our HELLO cannot be replayed from another address.
        ``aggregator``: this is a cluster aggregator's service, not the worker's trainer."""
        nonce = secrets.randbits(32)
        hello = self.core.hello_packet(nonce, aggregator=aggregator)
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
                                    if self.core.hello_answer(reply, nonce):
                                        self._deploy(Deployment.decode(data[HEADER_BYTES:]), reply.scale)
                                        self.core.hello_again = hello if self.send_to != self.gateway else None
                                        if self.core.hello_again is not None:
                                            await self._prime(hello)
                                        return reply
        except TimeoutError:
            raise EdgeTimeout(f"edge worker {self.worker}: gateway {self.gateway} did not answer HELLO "
                              f"within {timeout} s") from None

    async def _prime(self, datagram: bytes) -> None:
        """Send one datagram (our HELLO, which an aggregator ignores) to where DATA will go, so the kernel
        resolves that host's link-layer address now: unresolved, it would hold only ``unres_qlen_bytes``
        (about 100 datagrams) of the first window and drop the rest, whose recovery costs whole windows."""
        self.primed += 1
        await udp.sendto(self.sock, datagram, self.send_to)

    def _deploy(self, deployment: Deployment, scale: int) -> None:
        old = self.deployment
        self.deployment = deployment
        self.core.epoch = deployment.epoch
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
            self._muted = iteration in self.silent
            now = time.monotonic()
            self.core.push(iteration, tensors, layout=self.layout, now=now, timeout=max(0.0, deadline - now),
                           back=back, precision=self.precision, integers=self.integers)
            outcome = await self._run()
            if not isinstance(outcome, Moved):
                return self._result(outcome)[1:]
            stale = True

    async def receive_first(self, *, timeout: float) -> tuple[int, list[np.ndarray], int]:  # noqa: ASYNC109
        """The next result the gateway sends, whatever its iteration (how a joining worker gets ``init``):
        its iteration, the result, and how many workers' gradients it sums."""
        self.core.first(layout=self.layout, now=time.monotonic(), timeout=timeout)
        return self._result(await self._run())

    # ------------------------------------------------------------------ internals
    @staticmethod
    def _result(outcome: Outcome) -> tuple[int, list[np.ndarray], int]:
        if isinstance(outcome, Failed):
            raise outcome.error
        assert isinstance(outcome, Done)
        return outcome.iteration, outcome.result, outcome.total

    async def _run(self) -> Outcome:
        """Move the core's bytes until its iteration ends: send what it asks, then wait for datagrams or its
        timer, whichever comes first, and hand it either."""
        core = self.core
        while True:
            await self._transmit(core.actions())
            if core.outcome is not None:
                return core.outcome
            timer = core.get_timer()
            assert timer is not None
            if await self._receive(timer):
                core.datagrams_received(self._batch, time.monotonic())
            else:
                core.handle_timer(time.monotonic())

    async def _transmit(self, actions: list[Action]) -> None:
        """Control datagrams go to the gateway; DATA rows to where DATA goes (first sends through injection)."""
        for action in actions:
            if isinstance(action, SendControl) and action.aggregator:
                self.primed += 1
                await udp.sendto(self.sock, action.datagram, self.send_to)
            elif isinstance(action, SendControl):
                await udp.sendto(self.sock, action.datagram, self.gateway)
            elif action.index is not None:
                await self.send_rows(action.rows, action.index, first=action.first)
                if action.first:
                    self.core.sent(time.monotonic())
            elif self._muted:
                self.dropped += len(action.rows)
            else:
                await self.batch.send(action.rows, self.send_to)

    async def send_rows(self, rows: np.ndarray, index: np.ndarray, *, first: bool) -> None:
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

    async def _receive(self, until: float) -> int:
        """Fill the batch with what is queued on our sockets, waiting until ``until`` (monotonic seconds: the
        core's timer, the one timer this shell runs) for the first datagram; how many it holds."""
        delay = until - time.monotonic()
        if self._drain() or delay <= 0:
            return self._batch.count
        loop = asyncio.get_running_loop()
        ready: asyncio.Future[None] = loop.create_future()

        def wake() -> None:
            if not ready.done():
                ready.set_result(None)

        socks = self.sockets
        for sock in socks:
            loop.add_reader(sock.fileno(), wake)
        timer = loop.call_later(delay, wake)
        try:
            await ready
        finally:
            timer.cancel()
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
