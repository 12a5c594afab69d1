"""A LAN worker of a compressed job (FediAC, top-k): the same ``Rounds`` core as a trainer at a node, each
round sent on its own wire (``introunds.RoundPlan``) so only the lanes that carry data travel.

Votes, the scale one-hot and FediAC's b-bit values go as exact integers at scale 0, which the gateway's XDP
program (or its userspace fallback) sums like any int32 lane; the gateway adds its own trainer's integers
and hands the DC's exact sum to the node, so the WAN roots see the full counts of every contributor. The
worker's ``Rounds`` is seeded with its own contributor id, so its votes and rounding are its own draws.
What comes back is what the rounds need, exactly and narrow (``Wire.back``): the GIA as a bitmap (the
gateway applied the threshold, so the worker's rounds read it as the roots' GIA), the b-bit sums as the
narrowest integers that hold them. With ``fediac_gia_reuse`` the reused iterations push values and the scale
one-hot on their own wire, without a vote round, as a trainer at a node does.

A failed iteration (the gateway's FAILED notice, ``IterationAborted``, or this worker's own timeout) raises
here as at every other contributor; the worker undoes its rounds (``Rounds.abort``), counts the failed
round's iteration as spent and starts the next push on the restart wire (``RoundPlan.restart``), which is
what the gateway plans for it (``GatewayRounds.failed``).
"""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import Mapping

import numpy as np

from netstorm.compression.options import CompressionOptions
from netstorm.compression.session import Push, Rounds, RoundStats
from netstorm.errors import TrainerError, WrongShape
from netstorm.lan.client import parse, parse_precision
from netstorm.lan.introunds import RoundPlan, Wire, layout_order
from netstorm.lan.layout import EdgeLayout
from netstorm.lan.sender import RCVBUF_BYTES, EdgeSender, GroupOpener, receive_buffer


class CompressedEdgeWorker:
    """One LAN worker's compressed rounds over an ``EdgeSender`` (not yet said HELLO)."""

    def __init__(self, sender: EdgeSender, options: CompressionOptions, *, contributor: int, seed: int = 0,
                 applied: int | None = None, timeout: float = 60.0) -> None:
        """``contributor``: this worker's id among every contributor of the job (it seeds its draws; a
        node trainer's is its node id); ``applied``: the vote threshold the WAN roots apply (0: none, the
        gateway applies it to the counts it returns; None: as the gateway's deployment says)."""
        if not options.sparse:
            raise TrainerError(f"compression {options.method!r} has no rounds to run on the LAN")
        self.sender = sender
        self.options = options
        self.contributor = contributor
        self.seed = seed
        self.applied = applied
        self.timeout = timeout
        self.iteration = -1
        self.rounds: Rounds | None = None
        self.plan: RoundPlan | None = None
        self.wire: Wire | None = None
        self.received: list[tuple[Wire, list[np.ndarray]]] = []
        """The last iteration's rounds: each wire and the sums that came back on it."""
        self._registered: dict[str, np.ndarray] = {}
        self._workers = 0

    @property
    def num_workers(self) -> int:
        """Contributors to each sum (what the gateway's results say)."""
        return self._workers

    @property
    def last(self) -> RoundStats:
        return self._need_rounds().last

    async def init(self, model: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Say HELLO, receive the values the DCs agreed on, and start the rounds."""
        rounds = Rounds(self.options, model, self.seed)
        registered = rounds.registered(model)
        names = layout_order(registered)
        sizes = [max(1, int(np.asarray(registered[n]).size)) for n in names]
        self.sender.layout = EdgeLayout.uniform(sizes, scale=0, lanes=self.sender.layout.lanes)
        reply = await self.sender.hello(timeout=self.timeout)
        full = self.sender.layout
        if reply.tensor != len(sizes) or reply.slot != full.num_chunks:
            raise WrongShape(f"edge worker {self.sender.worker}: the gateway registered {reply.tensor} tensors in "
                             f"{reply.slot} chunks, this compressed job {len(sizes)} in {full.num_chunks}")
        self.iteration, flat, self._workers = await self.sender.receive_first(timeout=self.timeout)
        if self._workers < 1:
            raise TrainerError(f"edge worker {self.sender.worker}: the gateway's results do not say how many "
                               f"contributors they sum, which the compressed rounds need")
        deployment = self.sender.deployment
        assert deployment is not None
        if self.applied is None:
            self.applied = deployment.gia_threshold
        self.plan = RoundPlan(registered, self.options, lanes=full.lanes, pool=deployment.pool, scale=reply.scale,
                              contributors=self._workers, applied=self.applied)
        # the gateway returns the GIA, not the counts: the rounds read it as a GIA the roots thresholded
        rounds.start(self._workers, self.contributor, applied=self.plan.threshold)
        self.rounds = rounds
        self._registered = registered
        self.wire = self.plan.first()
        initial = self.plan.shaped(flat, registered)
        return {name: initial[name].astype(np.asarray(model[name]).dtype) for name in rounds.names}

    async def push_pull(self, gradients: Mapping[str, np.ndarray], average: bool = False) -> dict[str, np.ndarray]:
        """One iteration of the job's rounds: the decoded sum (or mean) of every contributor's update. A
        shell over the ``Rounds`` core, as the node clients' are: each push goes out on its round's wire."""
        rounds = self._need_rounds()
        plan, wire = self.plan, self.wire
        assert plan is not None and wire is not None
        self.received = []
        action = rounds.begin(gradients, average=average)
        iteration = self.iteration
        try:
            while isinstance(action, Push):
                iteration = self.iteration + 1
                lanes = plan.lanes_of(wire, action.tensors)
                self.sender.layout = wire.layout
                self.sender.precision = wire.precision
                self.sender.integers = wire.integer
                started = time.perf_counter()
                back, self._workers = await self.sender.push_pull(iteration, lanes, timeout=self.timeout,
                                                                  back=wire.result)
                seconds = time.perf_counter() - started
                self.iteration = iteration
                self.received.append((wire, back))
                result = plan.shaped(plan.expand(wire, back), self._registered)
                wire = self.wire = plan.following(wire, back)
                action = rounds.received(result, seconds=seconds)
        except BaseException:
            # the round failed (IterationAborted: the gateway says so; EdgeTimeout; cancelled): so did the
            # iteration at every contributor. Its number is spent, the rounds are undone (error feedback as
            # before it), and the next iteration starts them again on the restart wire, as the gateway plans.
            rounds.abort()
            self.iteration = iteration
            self.wire = plan.restart(wire)
            raise
        return dict(action.tensors)

    async def close(self) -> None:
        self.sender.close()
        self.sender.sock.close()

    def _need_rounds(self) -> Rounds:
        if self.rounds is None:
            raise TrainerError("push_pull before init")
        return self.rounds


async def aconnect_compressed_edge(address: str, options: CompressionOptions, *, contributor: int, seed: int = 0,
                                   timeout: float = 300.0,  # noqa: ASYNC109
                                   sock: socket.socket | None = None, secret: bytes | None = None,
                                   group_opener: GroupOpener | None = None) -> CompressedEdgeWorker:
    """A LAN worker of a compressed job at ``edge://GATEWAY:PORT?worker=I[&job=J]``; ``init`` says HELLO."""
    gateway, worker, job = parse(address)
    if sock is None:
        sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        receive_buffer(sock, RCVBUF_BYTES)
    sock.setblocking(False)
    sender = EdgeSender(sock, gateway, worker=worker, layout=EdgeLayout.uniform([1], scale=0), job=job,
                        secret=secret, precision=parse_precision(address), group_opener=group_opener)
    return CompressedEdgeWorker(sender, options, contributor=contributor, seed=seed, timeout=timeout)


class CompressedEdgeClient:
    """The blocking face of ``CompressedEdgeWorker`` (its own event loop, one call at a time)."""

    def __init__(self, inner: CompressedEdgeWorker) -> None:
        self.inner = inner
        self._loop = asyncio.new_event_loop()

    @property
    def num_workers(self) -> int:
        return self.inner.num_workers

    @property
    def last(self) -> RoundStats:
        return self.inner.last

    def init(self, model: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        return self._loop.run_until_complete(self.inner.init(model))

    def push_pull(self, gradients: Mapping[str, np.ndarray], average: bool = False) -> dict[str, np.ndarray]:
        return self._loop.run_until_complete(self.inner.push_pull(gradients, average))

    def close(self) -> None:
        self._loop.run_until_complete(self.inner.close())
        self._loop.close()


def connect_compressed_edge(address: str, options: CompressionOptions, *, contributor: int, seed: int = 0,
                            timeout: float = 300.0, sock: socket.socket | None = None,
                            secret: bytes | None = None) -> CompressedEdgeClient:
    """The blocking ``aconnect_compressed_edge``."""
    loop = asyncio.new_event_loop()
    try:
        inner = loop.run_until_complete(aconnect_compressed_edge(address, options, contributor=contributor, seed=seed,
                                                                 timeout=timeout, sock=sock, secret=secret))
    finally:
        loop.close()
    return CompressedEdgeClient(inner)
