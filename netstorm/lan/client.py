"""The trainer API's edge mode: a LAN worker's ``push_pull`` goes to its DC gateway as UDP fixed-point
datagrams, and the WAN result comes back the same way.

``netstorm.connect("edge://GATEWAY:PORT?worker=I")`` returns an ``EdgeClient`` with the usual verbs
(``init``, ``push_pull``, ``push``, ``pull``, ``num_workers``, ``close``); ``netstorm.aconnect`` returns
the asyncio ``AsyncEdgeClient``. ``init`` registers nothing itself: the gateway's own trainer registers
the model at the node, and every LAN worker receives the values the DCs agreed on, exactly like a trainer
at the node. Tensors are ordered by name, as the node's layout orders them.

The gateway aggregates over UDP (``edge_mode`` xdp or userspace) or over TCP (``edge_mode=tcp``,
``tcpclient.py``); ``transport=`` in the address says which the worker uses: ``udp``, ``tcp`` or ``auto``
(the default), which tries the gateway's TCP port and a UDP HELLO in turn until one answers (a gateway
on a UDP path has no TCP listener, so its refusal is immediate).

Every result comes with the number of workers whose gradients it sums (every contributing DC's trainer
and LAN workers), the count the node's trainers see too: ``num_workers`` reports it and ``average=True``
divides the float32 sum by it, so a LAN worker's mean equals the node trainers' bit for bit.
"""

from __future__ import annotations

import asyncio
import socket
import urllib.parse
from collections.abc import Mapping

import numpy as np

from netstorm.errors import (
    IterationError,
    NodeGone,
    TrainerError,
    TrainerTimeout,
    UnknownTensor,
    WrongDtype,
    WrongShape,
)
from netstorm.lan.errors import EdgeTimeout, IterationAborted, WireError
from netstorm.lan.header import Header, Precision
from netstorm.lan.layout import EdgeLayout
from netstorm.lan.sender import RCVBUF_BYTES, EdgeSender, GroupOpener, receive_buffer
from netstorm.lan.tcpclient import GatewayRefused, SocketFactory, TcpEdgeWorker
from netstorm.layout import DTYPES

DEFAULT_TIMEOUT = 300.0
TRANSPORTS = ("auto", "udp", "tcp")
PROBE_S = 0.5
"""Seconds ``transport=auto`` gives one UDP HELLO before it tries the TCP port again."""


def parse_transport(address: str) -> str:
    """The ``transport=`` of an edge address (auto, udp or tcp; default auto)."""
    query = urllib.parse.parse_qs(urllib.parse.urlsplit(address).query)
    transport = query.get("transport", ["auto"])[0]
    if transport not in TRANSPORTS:
        raise TrainerError(f"bad edge address {address!r}: transport is one of {', '.join(TRANSPORTS)}")
    return transport


def parse_precision(address: str) -> Precision:
    """The ``precision=`` of an edge address (fp32, fp16, bf16 or int8; default fp32)."""
    query = urllib.parse.parse_qs(urllib.parse.urlsplit(address).query)
    try:
        return Precision.parse(query.get("precision", ["fp32"])[0])
    except WireError as exc:
        raise TrainerError(f"bad edge address {address!r}: {exc}") from None


def parse(address: str) -> tuple[tuple[str, int], int, int]:
    """((host, port), worker id, job) from ``edge://HOST:PORT?worker=I[&job=J][&precision=P][&transport=T]``."""
    url = urllib.parse.urlsplit(address)
    query = urllib.parse.parse_qs(url.query)
    if url.scheme != "edge" or not url.hostname or not url.port or "worker" not in query:
        raise TrainerError(f"bad edge address {address!r}: expected edge://HOST:PORT?worker=I")
    try:
        worker = int(query["worker"][0])
        job = int(query.get("job", ["1"])[0])
    except ValueError:
        raise TrainerError(f"bad edge address {address!r}: worker and job must be integers") from None
    if not 0 <= worker < 64:
        raise TrainerError(f"edge worker id must be in 0..63, got {worker}")
    return (url.hostname, url.port), worker, job


class AsyncEdgeClient:
    """One LAN worker of a gateway; create with ``aconnect_edge``."""

    def __init__(self, gateway: tuple[str, int], worker: int, *, job: int, timeout: float,
                 sock: socket.socket | None = None, secret: bytes | None = None,
                 precision: Precision = Precision.FIXED32, group_opener: GroupOpener | None = None,
                 transport: str = "auto", socket_factory: SocketFactory | None = None) -> None:
        self.gateway = gateway
        self.transport = transport
        """udp, tcp or auto (whichever the gateway answers on); after ``init``, the one in use."""
        self.socket_factory = socket_factory
        self.group_opener = group_opener
        self.precision = precision
        """How this worker's gradients travel (PAHInA's per-worker precision): fp32 as int32 fixed point,
        fp16, bf16 or int8 with a per-chunk scale; the gateway sums them at one fixed-point scale."""
        self.secret = secret
        """The job secret (its datagrams' tokens); None: unauthenticated, as a gateway without one."""
        self.worker_id = worker
        self.job = job
        self.timeout = timeout
        if sock is None:
            sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
            receive_buffer(sock, RCVBUF_BYTES)   # PULLed results come back here in bursts
        self.sock = sock
        self.sock.setblocking(False)
        self.names: tuple[str, ...] = ()
        self.shapes: dict[str, tuple[int, ...]] = {}
        self.dtypes: dict[str, np.dtype] = {}
        self.iteration = -1
        self._worker: EdgeSender | TcpEdgeWorker | None = None
        self._pushed: dict[str, np.ndarray] = {}
        self._pulled: dict[str, np.ndarray] = {}
        self._workers = 0

    @property
    def num_workers(self) -> int:
        """Workers whose gradients make up each sum in the latest iteration: every contributing DC's own
        trainer and LAN workers (0 if the gateway does not say)."""
        return self._workers

    async def init(self, tensors: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Announce this worker and wait for the values every DC agreed on."""
        for name, value in tensors.items():
            dtype = np.asarray(value).dtype
            if dtype.name not in DTYPES:
                raise WrongDtype(f"tensor {name!r} has dtype {dtype.name}; supported: {', '.join(DTYPES)}")
        self.names = tuple(sorted(tensors))
        self.shapes = {n: tuple(np.shape(tensors[n])) for n in self.names}
        self.dtypes = {n: np.asarray(tensors[n]).dtype for n in self.names}
        sizes = [max(1, int(np.prod(self.shapes[n], dtype=np.int64))) for n in self.names]
        if self.transport != "udp":
            found = await self._connect_tcp(sizes)
            if isinstance(found, TcpEdgeWorker):
                return await self._init_tcp(found)
            return await self._init_udp(*found, sizes)
        worker = EdgeSender(self.sock, self.gateway, worker=self.worker_id,
                            layout=EdgeLayout.uniform(sizes, scale=0), job=self.job, secret=self.secret,
                            precision=self.precision, group_opener=self.group_opener)
        try:
            reply = await worker.hello(timeout=self.timeout)
        except EdgeTimeout as exc:
            worker.close()
            raise NodeGone(str(exc)) from None
        return await self._init_udp(worker, reply, sizes)

    async def _connect_tcp(self, sizes: list[int]) -> TcpEdgeWorker | tuple[EdgeSender, Header]:
        """The TCP connection to the gateway (``transport=tcp``), or with ``auto`` the UDP sender and the
        gateway's answer once it answered a UDP HELLO instead; NodeGone when neither answered in time."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.timeout
        probe = EdgeSender(self.sock, self.gateway, worker=self.worker_id, layout=EdgeLayout.uniform(sizes, scale=0),
                           job=self.job, secret=self.secret, precision=self.precision,
                           group_opener=self.group_opener) if self.transport == "auto" else None
        while True:
            tcp = TcpEdgeWorker(self.gateway, worker=self.worker_id, sizes=sizes, job=self.job, secret=self.secret,
                                precision=self.precision, socket_factory=self.socket_factory)
            try:   # a TCP gateway, not merely a TCP listener: it must answer HELLO
                await tcp.connect(timeout=max(0.01, min(PROBE_S, deadline - loop.time())))
                wait = deadline - loop.time() if self.transport == "tcp" else PROBE_S
                await tcp.hello(timeout=max(0.01, min(wait, deadline - loop.time())))
                self.transport = "tcp"
                return tcp
            except (OSError, TimeoutError, EdgeTimeout) as exc:
                tcp.close()
                if self.transport == "tcp" and isinstance(exc, EdgeTimeout):
                    raise NodeGone(str(exc)) from None
            except GatewayRefused as exc:
                tcp.close()
                raise TrainerError(str(exc)) from None
            except WireError as exc:   # a listener that is no TCP edge gateway
                tcp.close()
                if self.transport == "tcp":
                    raise TrainerError(str(exc)) from None
            if probe is not None:
                try:
                    reply = await probe.hello(timeout=max(0.01, min(PROBE_S, deadline - loop.time())))
                    self.transport = "udp"
                    return probe, reply
                except EdgeTimeout:
                    pass   # neither transport answered yet: both are tried again until the deadline
            elif loop.time() < deadline:
                await asyncio.sleep(min(PROBE_S, deadline - loop.time()))
            if loop.time() >= deadline:
                tried = "on TCP or UDP" if self.transport == "auto" else "on TCP"
                raise NodeGone(f"edge worker {self.worker_id}: gateway {self.gateway} did not answer HELLO {tried} "
                               f"within {self.timeout} s")

    async def _init_tcp(self, tcp: TcpEdgeWorker) -> dict[str, np.ndarray]:
        """After the gateway's WELCOME: wait for the first result, as over UDP."""
        try:
            self._worker = tcp
            self.iteration, flat, self._workers = await tcp.receive_first(timeout=self.timeout)
        except EdgeTimeout as exc:
            tcp.close()
            raise TrainerTimeout(str(exc)) from None
        except (WireError, ConnectionError) as exc:
            tcp.close()
            raise TrainerError(str(exc)) from None
        return self._shape(flat)

    async def _init_udp(self, worker: EdgeSender, reply: Header, sizes: list[int]) -> dict[str, np.ndarray]:
        # the HELLO answer's deployment set the layout's scale, lanes and pool
        layout = worker.layout
        if reply.tensor != len(sizes) or reply.slot != layout.num_chunks:
            worker.close()
            raise WrongShape(f"edge worker {self.worker_id}: the gateway's model has {reply.tensor} tensors in "
                             f"{reply.slot} chunks, this worker's has {len(sizes)} in {layout.num_chunks}")
        self._worker = worker
        try:
            self.iteration, flat, self._workers = await self._worker.receive_first(timeout=self.timeout)
        except EdgeTimeout as exc:
            raise TrainerTimeout(str(exc)) from None
        except WireError as exc:
            raise TrainerError(str(exc)) from None
        return self._shape(flat)

    async def push_pull(self, tensors: Mapping[str, np.ndarray], average: bool = False) -> dict[str, np.ndarray]:
        """One synchronous iteration: every registered tensor, in any order."""
        if self._worker is None:
            raise TrainerError("push_pull before init")
        if average and self._workers < 1:
            raise TrainerError(f"edge worker {self.worker_id}: average=True needs the number of workers each sum "
                               f"holds, and gateway {self.gateway}'s results do not carry it (an older gateway)")
        unknown = sorted(set(tensors) - set(self.names))
        if unknown:
            raise UnknownTensor(f"unknown tensor(s) {unknown}; registered: {list(self.names)}")
        absent = sorted(set(self.names) - set(tensors))
        if absent:
            raise TrainerError(f"edge mode pushes every tensor each iteration; missing {absent}")
        values = []
        for name in self.names:
            value = np.asarray(tensors[name])
            if value.shape != self.shapes[name]:
                raise WrongShape(f"tensor {name!r}: shape {value.shape}, registered {self.shapes[name]}")
            if value.dtype != self.dtypes[name]:
                raise WrongDtype(f"tensor {name!r}: dtype {value.dtype}, registered {self.dtypes[name]}")
            values.append(value.astype(np.float32).reshape(-1))
        iteration = self.iteration + 1
        try:
            flat, total = await self._worker.push_pull(iteration, values, timeout=self.timeout)
        except IterationAborted as exc:
            self.iteration = iteration   # failed at the gateway's node: the next push is the one after it
            raise IterationError(str(exc)) from None
        except EdgeTimeout as exc:
            raise TrainerTimeout(str(exc)) from None
        except (WireError, ConnectionError) as exc:
            raise TrainerError(str(exc)) from None
        self.iteration = iteration
        self._workers = total
        if average:
            if total < 1:
                raise TrainerError(f"edge worker {self.worker_id}: iteration {iteration}: the gateway's results do "
                                   f"not say how many workers they sum (a gateway older than this worker); "
                                   f"average=True needs that count")
            scale = np.float32(total)
            for f in flat:  # float32 sum / count, exactly what a trainer at the node gets
                np.divide(f, scale, out=f)
        return self._shape(flat)

    async def push(self, name: str, value: np.ndarray) -> None:
        if name not in self.shapes:
            raise UnknownTensor(f"unknown tensor {name!r}")
        self._pushed[name] = value

    async def pull(self, name: str, average: bool = False) -> np.ndarray:
        """The result of ``name``; the iteration runs once every tensor has been pushed."""
        if name not in self._pulled:
            if set(self._pushed) != set(self.names):
                raise TrainerError(f"pull of {name!r} before every tensor was pushed (edge mode sends them together)")
            self._pulled = await self.push_pull(self._pushed, average)
            self._pushed = {}
        return self._pulled.pop(name)

    def _shape(self, flat: list[np.ndarray]) -> dict[str, np.ndarray]:
        return {n: f[: int(np.prod(self.shapes[n], dtype=np.int64))].reshape(self.shapes[n]).astype(self.dtypes[n])
                for n, f in zip(self.names, flat, strict=True)}

    async def close(self) -> None:
        if self._worker is not None:
            self._worker.close()
        self.sock.close()


class EdgeClient:
    """The blocking face of ``AsyncEdgeClient`` (its own event loop, one call at a time)."""

    def __init__(self, inner: AsyncEdgeClient) -> None:
        self._inner = inner
        self._loop = asyncio.new_event_loop()

    @property
    def num_workers(self) -> int:
        return self._inner.num_workers

    def init(self, tensors: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        return self._loop.run_until_complete(self._inner.init(tensors))

    def push_pull(self, tensors: Mapping[str, np.ndarray], average: bool = False) -> dict[str, np.ndarray]:
        return self._loop.run_until_complete(self._inner.push_pull(tensors, average))

    def push(self, name: str, value: np.ndarray) -> None:
        self._loop.run_until_complete(self._inner.push(name, value))

    def pull(self, name: str, average: bool = False) -> np.ndarray:
        return self._loop.run_until_complete(self._inner.pull(name, average))

    def close(self) -> None:
        self._loop.run_until_complete(self._inner.close())
        self._loop.close()

    def __enter__(self) -> EdgeClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def connect_edge(address: str, *, timeout: float = DEFAULT_TIMEOUT, sock: socket.socket | None = None,
                 secret: bytes | None = None) -> EdgeClient:
    """A LAN worker of the gateway at ``address``; ``secret`` is the job secret when the job has one (the
    gateway then ignores datagrams without this worker's tokens, and the worker the gateway's)."""
    gateway, worker, job = parse(address)
    return EdgeClient(AsyncEdgeClient(gateway, worker, job=job, timeout=timeout, sock=sock, secret=secret,
                                      precision=parse_precision(address), transport=parse_transport(address)))


async def aconnect_edge(address: str, *, timeout: float = DEFAULT_TIMEOUT,  # noqa: ASYNC109
                        sock: socket.socket | None = None, secret: bytes | None = None) -> AsyncEdgeClient:
    gateway, worker, job = parse(address)
    return AsyncEdgeClient(gateway, worker, job=job, timeout=timeout, sock=sock, secret=secret,
                           precision=parse_precision(address), transport=parse_transport(address))
