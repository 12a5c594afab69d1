"""A LAN worker on the TCP path (``edge_mode=tcp``): one connection to the gateway, the gradients
streamed in large DATA frames, the results received straight into float32 arrays (``tcpcore``).

Its verbs are the UDP sender's (``hello``, ``receive_first``, ``push_pull``, ``close``), so the trainer
API's ``AsyncEdgeClient`` drives either. Every wait has the caller's deadline and its error names the
gateway and the iteration; a REFUSAL from the gateway (a forged or malformed frame) is raised as the
WireError it states.
"""

from __future__ import annotations

import asyncio
import secrets
import socket
from collections.abc import Callable, Sequence

import numpy as np

from netstorm.lan import tcpwire
from netstorm.lan.errors import EdgeTimeout, WireError
from netstorm.lan.header import Precision
from netstorm.lan.tcpcore import ResultAssembly, encode_data
from netstorm.lan.tcpstream import FrameProtocol
from netstorm.lan.tcpwire import Data, Frame, Hello, Refusal, Result, Welcome
from netstorm.lan.tokens import LanTokens, Sender


class GatewayRefused(WireError):
    """The gateway answered with a REFUSAL (it speaks this protocol and will not take this worker's frames)."""


SocketFactory = Callable[[], socket.socket]
"""Makes the worker's TCP socket (a test makes it inside the worker's network namespace)."""


class TcpEdgeWorker:
    """One LAN worker's TCP connection to its gateway."""

    def __init__(self, gateway: tuple[str, int], *, worker: int, sizes: Sequence[int], job: int,
                 secret: bytes | None = None, precision: Precision = Precision.FIXED32,
                 socket_factory: SocketFactory | None = None) -> None:
        self.gateway = gateway
        self.worker = worker
        self.sizes = tuple(max(1, int(s)) for s in sizes)
        self.job = job
        self.precision = precision
        self.tokens = LanTokens(secret, job)
        self.socket_factory = socket_factory
        self.welcome: Welcome | None = None
        self.assembly: ResultAssembly | None = None
        self._proto: FrameProtocol | None = None
        self._waiter: asyncio.Future[None] | None = None
        self._error: Exception | None = None
        self._nonce = 0
        self.frames_sent = 0

    # --- the connection's callbacks ---------------------------------------------------------------

    def _expect(self, message: Frame, payload_len: int) -> memoryview | None:
        if isinstance(message, Result):
            if self.assembly is None:
                raise WireError(f"edge worker {self.worker}: RESULT before the gateway's WELCOME")
            return self.assembly.target(message, payload_len)
        if payload_len:
            raise WireError(f"edge worker {self.worker}: a {type(message).__name__} frame with a payload")
        if isinstance(message, Welcome | Refusal):
            return None
        raise WireError(f"edge worker {self.worker}: the gateway sent {type(message).__name__}")

    def _on_frame(self, message: Frame, payload: memoryview) -> None:
        if isinstance(message, Refusal):
            self._fail(GatewayRefused(f"edge worker {self.worker}: gateway {self.gateway} refused ({message.code}): "
                                      f"{message.message}"))
        elif isinstance(message, Welcome):
            if self.welcome is not None or message.worker != self.worker or message.nonce != self._nonce or \
                    not self.tokens.valid(Sender.GATEWAY, self.worker, self._nonce, message.token, keep=False):
                self._fail(WireError(f"edge worker {self.worker}: a WELCOME without the gateway's token over "
                                     f"this worker's nonce"))
                return
            if len(message.scales) != len(self.sizes):
                self._fail(WireError(f"edge worker {self.worker}: the gateway's model has {len(message.scales)} "
                                     f"tensors, this worker's {len(self.sizes)}"))
                return
            self.welcome = message
            self.assembly = ResultAssembly(self.sizes, message.segment, self.tokens, self.worker)
            self._wake()
        elif isinstance(message, Result):
            assert self.assembly is not None
            if self.assembly.received(message):
                self._wake()

    def _fail(self, exc: Exception) -> None:
        if self._error is None:
            self._error = exc
        if self._proto is not None:
            self._proto.close()
        self._wake()

    def _on_lost(self, exc: Exception | None) -> None:
        self._fail(ConnectionError(f"edge worker {self.worker}: connection to gateway {self.gateway} lost"
                                   + (f": {exc}" if exc else "")))

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    async def _wait(self, what: str, timeout: float, done: Callable[[], bool]) -> None:  # noqa: ASYNC109
        try:
            async with asyncio.timeout(timeout):
                while self._error is None and not done():
                    self._waiter = asyncio.get_running_loop().create_future()
                    await self._waiter
        except TimeoutError:
            raise EdgeTimeout(f"edge worker {self.worker}: gateway {self.gateway} (tcp): no {what} within "
                              f"{timeout} s") from None
        finally:
            self._waiter = None
        if self._error is not None:
            raise self._error

    # --- verbs -------------------------------------------------------------------------------------

    async def connect(self, timeout: float) -> None:  # noqa: ASYNC109
        """Open the connection (ConnectionRefusedError at once where the gateway has no TCP listener)."""
        loop = asyncio.get_running_loop()
        sock = self.socket_factory() if self.socket_factory is not None else socket.socket()
        sock.setblocking(False)
        try:
            async with asyncio.timeout(timeout):
                await loop.sock_connect(sock, self.gateway)
                _, proto = await loop.create_connection(
                    lambda: FrameProtocol(self._expect, self._on_frame, on_error=self._fail, on_lost=self._on_lost,
                                          max_payload=tcpwire.MAX_RESULT_PAYLOAD),
                    sock=sock)
        except BaseException:
            sock.close()
            raise
        self._proto = proto

    async def hello(self, *, timeout: float) -> Welcome:  # noqa: ASYNC109
        """Say who this worker is and wait for the gateway's deployment."""
        if self._proto is None:
            try:
                await self.connect(timeout)
            except TimeoutError:
                raise EdgeTimeout(f"edge worker {self.worker}: no TCP connection to gateway {self.gateway} within "
                                  f"{timeout} s") from None
        assert self._proto is not None
        self._nonce = secrets.randbits(32)
        hello = Hello(self.job, self.worker, self._nonce,
                      self.tokens.of(Sender.WORKER, self.worker, self._nonce, keep=False), self.sizes,
                      int(self.precision))
        self._proto.write(tcpwire.encode(hello))
        await self._wait("WELCOME", timeout, lambda: self.welcome is not None)
        assert self.welcome is not None
        return self.welcome

    async def receive_first(self, *, timeout: float) -> tuple[int, list[np.ndarray], int]:  # noqa: ASYNC109
        """The first result (the values ``init`` returns), whatever its iteration: (iteration, arrays, total)."""
        assert self.assembly is not None, "hello first"
        self.assembly.begin(None)
        assembly = self.assembly
        await self._wait("first result", timeout, lambda: assembly.complete)
        assert self.assembly.iteration is not None
        return self.assembly.iteration, self.assembly.arrays, self.assembly.total

    async def push_pull(self, iteration: int, tensors: Sequence[np.ndarray], *,
                        timeout: float) -> tuple[list[np.ndarray], int]:  # noqa: ASYNC109
        """Send ``tensors`` (float32, flat) as ``iteration``'s DATA; its result and the count of workers."""
        if self._proto is None or self.welcome is None or self.assembly is None:
            raise WireError(f"edge worker {self.worker}: push_pull before hello")
        if self._error is not None:
            raise self._error
        welcome = self.welcome
        self.assembly.begin(iteration)
        token = self.tokens.worker(self.worker, iteration)
        try:
            async with asyncio.timeout(timeout):
                for t, values in enumerate(tensors):
                    flat = np.asarray(values, np.float32).reshape(-1)
                    if flat.size != self.sizes[t]:
                        raise WireError(f"edge worker {self.worker}: tensor {t} has {flat.size} elements, "
                                        f"{self.sizes[t]} registered")
                    for offset, count in tcpwire.frame_bounds(flat.size, welcome.segment):
                        payload, wide = encode_data(flat[offset: offset + count], self.precision,
                                                    welcome.scales[t], welcome.lanes)
                        head = Data(self.worker, iteration & 0xFFFFFFFF, t, offset, count, int(self.precision),
                                    wide, token)
                        self._proto.write(tcpwire.encode(head, len(payload)), payload)
                        self.frames_sent += 1
                        await self._proto.drain()
        except TimeoutError:
            raise EdgeTimeout(f"edge worker {self.worker}: iteration {iteration}: gateway {self.gateway} (tcp) "
                              f"took no DATA within {timeout} s") from None
        except ConnectionError:
            if self._error is not None:
                raise self._error from None
            raise
        assembly = self.assembly
        await self._wait(f"result of iteration {iteration}", timeout, lambda: assembly.complete)
        return self.assembly.arrays, self.assembly.total

    def close(self) -> None:
        if self._proto is not None:
            self._proto.close()
