"""The LAN worker's side: send a gradient as fixed-point DATA datagrams to the gateway, answer NACKs from
what it kept, and receive the float32 result (PULLing chunks whose RESULT was lost) with the number of
workers it sums, which every RESULT datagram carries (``Header.total``).

With the job's secret, every datagram it sends carries its token for the iteration, and it takes RESULT,
NACK and the HELLO answer only with the gateway's token for it (netstorm/lan/tokens.py): a datagram
forged by anyone without the secret changes nothing it receives."""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import socket
import time
from collections.abc import Sequence

import numpy as np

from netstorm.lan import udp
from netstorm.lan.errors import EdgeTimeout, WireError
from netstorm.lan.header import HEADER_BYTES, KIND_AT, MAX_LANES, Flag, Header, Kind, lanes_of
from netstorm.lan.layout import EdgeLayout
from netstorm.lan.packets import control_packet, data_packets
from netstorm.lan.tokens import LanTokens, Sender

Address = tuple[str, int]


class EdgeSender:
    """One LAN worker's sender. ``loss`` drops that fraction of first transmissions on purpose (loss injection)."""

    def __init__(self, sock: socket.socket, gateway: Address, *, worker: int, layout: EdgeLayout, job: int,
                 loss: float = 0.0, seed: int = 0, pull_interval: float = 0.5, secret: bytes | None = None) -> None:
        self.sock = sock
        self.gateway = gateway
        self.worker = worker
        self.layout = layout
        self.job = job
        self.loss = loss
        self.rng = np.random.default_rng(seed * 1000 + worker)
        self.pull_interval = pull_interval
        self.retransmitted = 0
        self.dropped = 0
        self.rescaled = 0
        self.tokens = LanTokens(secret, job)
        self.forged = 0
        """Datagrams dropped for not carrying the gateway's token for this worker."""
        self.duplicate = 0.0
        """Fraction of first transmissions sent twice (duplicate injection)."""
        self._queued: list[bytes] = []
        self._total = 0
        """``total`` of the RESULT datagrams being gathered (0 until the first arrives)."""

    async def hello(self, *, timeout: float) -> Header:  # noqa: ASYNC109
        """Announce this worker until the gateway answers (it learns our address from it). The answer
        carries the gateway's tensor count (``tensor``), slots (``slot``) and fixed-point ``scale``. The
        HELLO's ``iteration`` is a fresh nonce: with a secret the gateway echoes it under its token, so an
        answer cannot be forged or replayed, and our HELLO cannot be replayed from another address."""
        nonce = secrets.randbits(32)
        hello = control_packet(Kind.HELLO, job=self.job, worker=self.worker, iteration=nonce,
                               token=self.tokens.of(Sender.WORKER, self.worker, nonce, keep=False))
        buf = bytearray(HEADER_BYTES + 4 * MAX_LANES)
        try:
            async with asyncio.timeout(timeout):
                while True:
                    await udp.sendto(self.sock, hello, self.gateway)
                    with contextlib.suppress(TimeoutError):
                        async with asyncio.timeout(0.2):
                            n, _ = await udp.recvfrom_into(self.sock, buf)
                            if n >= HEADER_BYTES and buf[KIND_AT] == Kind.HELLO:
                                with contextlib.suppress(WireError):
                                    reply = Header.decode(bytes(buf[:n]))
                                    if not self.tokens.enabled or (
                                            reply.iteration == nonce and reply.worker == self.worker and
                                            self.tokens.valid(Sender.GATEWAY, self.worker, nonce, reply.token,
                                                              keep=False)):
                                        return reply
                                    self.forged += 1
        except TimeoutError:
            raise EdgeTimeout(f"edge worker {self.worker}: gateway {self.gateway} did not answer HELLO "
                              f"within {timeout} s") from None

    async def push_pull(
        self, iteration: int, tensors: Sequence[np.ndarray], *, timeout: float  # noqa: ASYNC109
    ) -> tuple[list[np.ndarray], int]:
        """Contribute ``tensors`` to ``iteration``; the result the gateway sends back, and how many workers'
        gradients it sums (0 from a gateway that does not say)."""
        self._total = 0
        values = [np.asarray(t, np.float32).reshape(-1) for t in tensors]
        token = self.tokens.worker(self.worker, iteration)
        rows = np.concatenate([data_packets(self.layout, job=self.job, worker=self.worker, iteration=iteration,
                                            tensor=t, values=v, token=token) for t, v in enumerate(values)])
        results = [np.zeros(size, np.float32) for size in self.layout.sizes]
        missing = np.ones(self.layout.num_slots, bool)
        keep = rows.copy()
        for i, row in enumerate(rows):
            if self.loss and self.rng.random() < self.loss:
                self.dropped += 1
                continue
            await udp.sendto(self.sock, row.tobytes(), self.gateway)
            if self.duplicate and self.rng.random() < self.duplicate:
                await udp.sendto(self.sock, row.tobytes(), self.gateway)
            if i % 64 == 63:
                self._serve_pending(iteration, keep, values, results, missing)
        await self._gather(iteration, keep, values, results, missing, timeout)
        return results, self._total

    async def receive_first(self, *, timeout: float) -> tuple[int, list[np.ndarray], int]:  # noqa: ASYNC109
        """The next result the gateway sends, whatever its iteration (how a joining worker gets ``init``):
        its iteration, the result, and how many workers' gradients it sums."""
        self._total = 0
        results = [np.zeros(size, np.float32) for size in self.layout.sizes]
        missing = np.ones(self.layout.num_slots, bool)
        keep = np.zeros((0, 0), np.uint8)
        iteration = await self._gather(None, keep, [], results, missing, timeout)
        return iteration, results, self._total

    async def _gather(self, iteration: int | None, keep: np.ndarray, values: list[np.ndarray],
                      results: list[np.ndarray], missing: np.ndarray, timeout: float) -> int:  # noqa: ASYNC109
        """Receive RESULT datagrams (answering NACKs meanwhile) until every chunk is in."""
        buf = bytearray(HEADER_BYTES + 4 * MAX_LANES + 64)
        deadline = time.monotonic() + timeout
        while missing.any():
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                what = "the first result" if iteration is None else f"iteration {iteration}"
                raise EdgeTimeout(f"edge worker {self.worker}: {what}: {int(missing.sum())} result "
                                  f"chunks from gateway {self.gateway} missing after {timeout} s")
            try:
                async with asyncio.timeout(min(remaining, self.pull_interval)):
                    n, _ = await udp.recvfrom_into(self.sock, buf)
            except TimeoutError:
                if iteration is not None:
                    await self._pull(iteration, missing)
                continue
            data = bytes(buf[:n])
            if iteration is None and n >= HEADER_BYTES and data[KIND_AT] == Kind.RESULT:
                try:
                    head = Header.decode(data)
                except WireError:
                    continue
                if not self.tokens.valid(Sender.GATEWAY, self.worker, head.iteration, head.token, keep=False):
                    self.forged += 1
                    continue
                iteration = head.iteration
            if iteration is not None:
                self._on_datagram(data, iteration, keep, values, results, missing)
            await self._flush()
        assert iteration is not None
        return iteration

    # ------------------------------------------------------------------ internals
    def _serve_pending(self, iteration: int, keep: np.ndarray, values: list[np.ndarray],
                       results: list[np.ndarray], missing: np.ndarray) -> None:
        """Handle NACKs that arrived while we were still sending (non-blocking)."""
        buf = bytearray(HEADER_BYTES + 4 * MAX_LANES + 64)
        while True:
            try:
                n, _ = self.sock.recvfrom_into(buf)
            except BlockingIOError:
                return
            self._on_datagram(bytes(buf[:n]), iteration, keep, values, results, missing)

    def _on_datagram(self, data: bytes, iteration: int, keep: np.ndarray, values: list[np.ndarray],
                     results: list[np.ndarray], missing: np.ndarray) -> None:
        try:
            head = Header.decode(data)
        except WireError:
            return
        if head.job != self.job or head.iteration != iteration & 0xFFFFFFFF:
            return
        if head.kind in (Kind.RESULT, Kind.NACK) and not self.tokens.valid(Sender.GATEWAY, self.worker, iteration,
                                                                          head.token):
            self.forged += 1
            return
        if head.kind == Kind.RESULT:
            if self._total and head.total != self._total:
                raise WireError(f"edge worker {self.worker}: iteration {iteration}'s RESULT datagrams disagree on "
                                f"how many workers they sum ({self._total}, then {head.total})")
            self._total = head.total
            index = self.layout.slot(head.tensor, head.chunk)
            if missing[index]:
                start, stop = self.layout.bounds(head.tensor, head.chunk)
                results[head.tensor][start:stop] = lanes_of(data, "<f4")[: stop - start]
                missing[index] = False
        elif head.kind == Kind.NACK and keep.size:
            index = self.layout.slot(head.tensor, head.chunk)
            if head.flags & Flag.RESCALE:
                keep[index] = data_packets(self.layout, job=self.job, worker=self.worker, iteration=iteration,
                                           tensor=head.tensor, values=values[head.tensor],
                                           chunks=np.array([head.chunk]), scale=head.scale,
                                           token=self.tokens.worker(self.worker, iteration))[0]
                self.rescaled += 1
            self.retransmitted += 1
            self._queued.append(keep[index].tobytes())

    async def _flush(self) -> None:
        queued, self._queued = self._queued, []
        for datagram in queued:
            await udp.sendto(self.sock, datagram, self.gateway)

    async def _pull(self, iteration: int, missing: np.ndarray) -> None:
        """Retransmit queued answers, then ask for up to 256 result chunks that never arrived."""
        await self._flush()
        if missing.all():
            return  # the gateway has not started sending results (its WAN step is still running)
        for index in np.flatnonzero(missing)[:256]:
            tensor = int(np.searchsorted(self.layout.first_slot, index, side="right") - 1)
            chunk = int(index) - self.layout.first_slot[tensor]
            await udp.sendto(self.sock, control_packet(Kind.PULL, job=self.job, worker=self.worker,
                                                       iteration=iteration, tensor=tensor, chunk=chunk,
                                                       token=self.tokens.worker(self.worker, iteration)),
                             self.gateway)
