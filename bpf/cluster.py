"""A LAN worker's aggregator role in a two-level LAN (ALEPH): its host runs the aggregation program for its
cluster, and each completed slot goes on to the gateway as this worker's DATA, so the gateway sums one
datagram per cluster instead of one per member.

This is the asyncio shell of the service: its socket and the gateway's multicast group, the program (XDP or
the userspace fallback), one timer and one writer. The rules are the core's (netstorm/lan/clustercore.py).

See docs/ARCHITECTURE.md, *The LAN tier*."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from bpf.fallback import UserspaceAggregator
from bpf.writer import SocketWriter
from bpf.xdp import XDP_REDIRECT, XDP_TX, Upstream, XdpAggregator
from netstorm.lan import udp
from netstorm.lan.clusteractions import (
    AGGREGATE,
    Action,
    Bound,
    Configure,
    Fail,
    InstallTokens,
    ReadSlots,
    RequireTokens,
    Send,
)
from netstorm.lan.clustercore import ClusterCore
from netstorm.lan.deploy import Deployment
from netstorm.lan.errors import EdgeTimeout, StaleDeployment, WireError
from netstorm.lan.header import HEADER_BYTES, KIND_AT, MAX_LANES, OFFSETS, Kind
from netstorm.lan.layout import EdgeLayout
from netstorm.lan.outbox import Outbox
from netstorm.lan.sender import EdgeSender, GroupOpener
from netstorm.lan.tokens import LanTokens

log = logging.getLogger("netstorm.edge.cluster")
Address = tuple[str, int]
_ITERATION_AT = OFFSETS["iteration"]
_EPOCH_AT = OFFSETS["epoch"]
_WORKER_AT = OFFSETS["worker"]
RECEIVE_ROUND = 256
"""Datagrams taken from the service socket per wake-up (the rest stay queued for the next)."""


def _neighbour_mac(ip: str) -> bytes:
    """The link-layer address the kernel resolved for ``ip`` (we have just exchanged datagrams with it), from
    the calling thread's namespace."""
    for line in Path("/proc/thread-self/net/arp").read_text().splitlines()[1:]:
        parts = line.split()
        if parts and parts[0] == ip and parts[3] != "00:00:00:00:00:00":
            return bytes.fromhex(parts[3].replace(":", ""))
    raise EdgeTimeout(f"edge aggregator: no resolved link-layer address for the gateway {ip}")


class ClusterAggregator:
    """The aggregator service of LAN worker ``worker``, for the gateway at ``gateway``; ``sock`` is bound to
    this host's LAN address and the gateway's port (where its members send)."""

    def __init__(self, sock: socket.socket, gateway: Address, *, worker: int, job: int, interface: str,
                 mode: str = "xdp", secret: bytes | None = None, group_opener: GroupOpener | None = None,
                 attach: str = "auto") -> None:
        if mode not in ("xdp", "userspace"):
            raise ValueError(f"mode must be 'xdp' or 'userspace', got {mode!r}")
        self.sock = sock
        self.gateway = gateway
        self.worker = worker
        self.job = job
        self.interface = interface
        self.mode = mode
        self.attach_mode = attach
        self.tokens = LanTokens(secret, job)
        self.core = ClusterCore(worker=worker, job=job, gateway=gateway, tokens=self.tokens,
                                userspace=mode == "userspace")
        """The rules (netstorm/lan/clustercore.py); this class moves their bytes and drives the program."""
        self.xdp: XdpAggregator | None = None
        self.fallback: UserspaceAggregator | None = None
        self.attached: list[str] = []
        # gro=False: this socket's DATA is read one datagram per receive below, so the kernel must not
        # hand it the members' GSO batches coalesced
        self._hello = EdgeSender(sock, gateway, worker=worker, layout=EdgeLayout.uniform([1], 0), job=job,
                                 secret=secret, group_opener=group_opener, gro=False)
        self._answered: Deployment | None = None
        self._scale = 0
        self._stop = asyncio.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at: float | None = None
        self.failure: Exception | None = None
        """Why the service stopped by itself (a ``Fail`` of the core), raised by ``run``."""
        self.outbox = Outbox(batch=1)
        """What this service sends (userspace aggregates, HELLO, MOVED, NACKs), by one writer: a full send
        buffer (this worker's shaped uplink) holds it back instead of dropping it (bpf/writer.py)."""
        self.writer = SocketWriter(sock, self.outbox, who=f"edge aggregator {worker}")
        self._final: dict[str, int] = {}

    members = property(lambda self: self.core.members, doc="Where each worker that said HELLO here sends from.")
    nacks_in = property(lambda self: self.core.nacks_in, doc="The gateway's NACKs for this cluster's chunks.")
    nacks_out = property(lambda self: self.core.nacks_out, doc="NACKs this service sent its members.")
    forged = property(lambda self: self.core.forged, doc="Datagrams dropped for a wrong token or sender.")
    rehellos = property(lambda self: self.core.rehellos, doc="HELLOs said again for a changed deployment.")
    redeployed = property(lambda self: self.core.redeployed, doc="Deployments taken while running.")
    moved_sent = property(lambda self: self.core.moved_sent, doc="MOVED sent to members of another epoch.")

    @property
    def deployment(self) -> Deployment | None:
        """The part this service runs (from its HELLO's answer until the program is loaded)."""
        return self.core.deployment if self.core.deployment is not None else self._answered

    @property
    def epoch(self) -> int:
        deployment = self.deployment
        return deployment.epoch if deployment is not None else 0

    @property
    def expected(self) -> int:
        """The contributor mask in use, read back from the aggregator (the kernel's configuration map)."""
        if self.xdp is not None:
            return self.xdp.configured()["expected"]
        return self.fallback.expected if self.fallback is not None else 0

    async def start(self, *, timeout: float,  # noqa: ASYNC109
                    load_in: Callable[[Callable[[], None]], object] | None = None) -> Deployment:
        """HELLO the gateway for this cluster's deployment, then load and attach the aggregation program, in a
        thread (through ``load_in`` where it must run in another context, such as the worker's network
        namespace: ``functools.partial(netns.run_in, namespace)``)."""
        deployment = await self.hello(timeout=timeout)
        if load_in is None:
            await asyncio.to_thread(self.load)
        else:
            await asyncio.to_thread(load_in, self.load)
        return deployment

    async def hello(self, *, timeout: float) -> Deployment:  # noqa: ASYNC109
        """Ask the gateway for this cluster's deployment (members, pool, lanes, scale, group)."""
        reply = await self._hello.hello(timeout=timeout, aggregator=True)
        assert self._hello.deployment is not None
        self._answered = self._hello.deployment
        self._scale = reply.scale
        return self._answered

    def load(self) -> None:
        """Load the aggregation program, configure it as the core says and attach it (blocking: compiling takes
        seconds; interfaces and addresses are those of the calling thread's namespace)."""
        deployment = self._answered
        if deployment is None:
            raise RuntimeError("edge aggregator: load before hello")
        layout = EdgeLayout.uniform([deployment.pool * deployment.lanes], scale=self._scale, lanes=deployment.lanes,
                                    pool=deployment.pool, shadow=deployment.kernel_results)
        own_ip, port = self.sock.getsockname()[0], self.sock.getsockname()[1]
        upstream = None
        if self.mode == "xdp":
            upstream = Upstream(worker=self.worker, ifindex=socket.if_nametoindex(self.interface), gateway=self.gateway,
                                gateway_mac=_neighbour_mac(self.gateway[0]), own=(own_ip, port),
                                own_mac=udp.interface_mac(self.interface))
            self.xdp = XdpAggregator(layout, job=self.job, port=port, expected=0, timeout=1.0, max_nacks=0,
                                     upstream=upstream)
        else:
            self.fallback = UserspaceAggregator(layout, job=self.job, expected=0, timeout=1.0, max_nacks=0,
                                                up_worker=self.worker)
        self._apply(self.core.begin(deployment))
        if self.xdp is not None and upstream is not None:
            self.attached.append(self.xdp.attach(upstream.ifindex, mode=self.attach_mode))
            self.attached.append(self.xdp.attach(socket.if_nametoindex("lo"), mode="generic"))
        log.info("edge aggregator: worker %d %s for gateway %s:%d (%s, deployment epoch %d)", self.worker,
                 "stands by" if deployment.standby else f"aggregates {sorted(deployment.members)}", *self.gateway,
                 self.mode, deployment.epoch)

    def ask(self) -> None:
        """Say HELLO to the gateway for this service's part of the current deployment (``ClusterCore.ask``)."""
        self._apply(self.core.ask(time.monotonic()))

    def redeploy(self, deployment: Deployment) -> None:
        """Take a new part while running (``ClusterCore.redeploy``)."""
        self._apply(self.core.redeploy(deployment))

    def follow(self, iteration: int) -> None:
        """Install tokens and raise the horizon from ``iteration`` on (for a harness that knows the iterations)."""
        self._apply(self.core.follow(iteration))

    def kernel_map_bytes(self) -> int:
        return self.xdp.kernel_map_bytes() if self.xdp is not None else 0

    def stats(self) -> dict[str, int]:
        """The aggregation's counters (the program's, or the fallback's) and this service's NACKs."""
        core = self.core
        own = {"cluster_nacks_in": core.nacks_in, "cluster_nacks_out": core.nacks_out, "cluster_forged": core.forged}
        if self.xdp is not None:
            return {**self.xdp.stats(), **own}
        if self.fallback is not None:
            return {**self.fallback.counters, **own}
        return {**self._final, **own}

    # ------------------------------------------------------------------ bytes and time in
    async def run(self) -> None:
        """Until ``close``: hand the multicast group's datagrams and the service socket's to the core and, in
        userspace mode, aggregate the members' DATA and forward completed slots. Raises the core's failure."""
        loop = self._loop = asyncio.get_running_loop()
        group = self._hello.group_sock
        buf = bytearray(HEADER_BYTES + 4 * MAX_LANES + 64)
        # fd numbers taken now: close() may close the sockets before this task unwinds
        group_fd = group.fileno() if group is not None else -1
        data_fd = self.sock.fileno()
        if group is not None and group_fd >= 0:
            loop.add_reader(group_fd, self._on_group, group, buf)
        if data_fd >= 0:
            loop.add_reader(data_fd, self._on_data, buf)
        self._arm()
        writer = asyncio.create_task(self.writer.run())
        try:
            await self._stop.wait()
        finally:
            writer.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await writer
            for fd in (group_fd, data_fd):
                if fd >= 0:
                    loop.remove_reader(fd)
            self._disarm()
        if self.failure is not None:
            raise self.failure

    def _on_group(self, group: socket.socket, buf: bytearray) -> None:
        while True:
            try:
                n = group.recv_into(buf)
            except (BlockingIOError, OSError):   # drained, or closed under a reader still registered
                return
            self._apply(self.core.group(memoryview(buf)[:n], time.monotonic()))

    def _on_data(self, buf: bytearray) -> None:
        view = memoryview(buf)
        for _ in range(RECEIVE_ROUND):
            try:
                n, address = self.sock.recvfrom_into(buf)
            except (BlockingIOError, OSError):
                return
            if n < HEADER_BYTES:
                continue
            now = time.monotonic()
            if buf[KIND_AT] != Kind.DATA:
                self._apply(self.core.datagram(bytes(view[:n]), address, now))
                continue
            actions = self.core.data(buf[_WORKER_AT], int.from_bytes(buf[_ITERATION_AT: _ITERATION_AT + 4], "little"),
                                     int.from_bytes(buf[_EPOCH_AT: _EPOCH_AT + 2], "little"), address, now)
            if actions and actions[0] is AGGREGATE:
                self._aggregate(bytes(view[:n]), address, now)
            else:
                self._apply(actions)

    def _aggregate(self, data: bytes, address: Address, now: float) -> None:
        """Run one DATA datagram through the program; a completed slot goes on to the gateway."""
        out: bytes | None = None
        try:
            if self.fallback is not None:
                out = self.fallback.on_data(data, now)
            elif self.xdp is not None:
                # narrow lanes the program passed up for want of tailroom: widened here, summed there
                verdict, after = self.xdp.run_widened(data)
                out = after if verdict in (XDP_TX, XDP_REDIRECT) else None
        except StaleDeployment as exc:
            self._apply(self.core.stale(exc.worker, exc.iteration, address, now))
            return
        except WireError as exc:
            log.warning("edge aggregator: rejected datagram: %s", exc)
            return
        if out is not None:
            self.outbox.control(out, self.gateway)
            self.writer.wake.set()

    def _on_timer(self) -> None:
        self._timer = self._timer_at = None
        self._apply(self.core.tick(time.monotonic()))

    # ------------------------------------------------------------------ actions out
    def _apply(self, actions: Sequence[Action]) -> None:
        """Carry out what the core asked, then set the one timer to its next wake-up."""
        program = self.xdp if self.xdp is not None else self.fallback
        sent = False
        for action in actions:
            if isinstance(action, Send):
                self.outbox.control(action.datagram, action.to)
                sent = True
            elif isinstance(action, ReadSlots):
                if program is not None:
                    states = program.slot_states(np.array([a.slot for a in action.asks], np.int64))
                    self._apply(self.core.slots(action.asks, states))
            elif isinstance(action, Fail):
                log.error("%s", action.error)
                self.failure = action.error
                self._stop.set()
            elif program is not None:
                self._program(program, action)
        if sent:
            self.writer.wake.set()
        self._arm()

    def _program(self, program: XdpAggregator | UserspaceAggregator, action: Action) -> None:
        if isinstance(action, Configure):
            program.redeploy(expected=action.expected, epoch=action.epoch)
        elif isinstance(action, RequireTokens):
            program.require_tokens(action.agg_token)
        elif isinstance(action, InstallTokens):
            program.install_tokens(action.entries)
            if self.fallback is not None:   # the fallback stamps this worker's own token on what it forwards
                self.fallback.up_tokens.update({k & 0xFFFFFFFF: t for w, k, t in action.entries if w == self.worker})
        elif isinstance(action, Bound):
            program.bound(action.horizon)

    def _arm(self) -> None:
        """The one timer, at the core's next wake-up (moved only when that changed)."""
        if self._loop is None or self._stop.is_set():
            return
        at = self.core.next_timer()
        if at == self._timer_at:
            return
        self._disarm()
        if at is not None:
            self._timer_at = at
            self._timer = self._loop.call_later(max(0.0, at - time.monotonic()), self._on_timer)

    def _disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._timer = self._timer_at = None

    def close(self) -> None:
        self._stop.set()
        self._disarm()
        self._hello.close()
        if self.xdp is not None:
            self._final = self.xdp.stats()      # the program's counters outlive it
            self.xdp.close()
            self.xdp = None
