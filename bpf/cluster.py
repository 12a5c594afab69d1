"""A LAN worker's aggregator role in a two-level LAN (ALEPH): its host runs the aggregation program for its
cluster, and each completed slot goes on to the gateway as this worker's DATA, so the gateway sums one
datagram per cluster instead of one per member.

See docs/ARCHITECTURE.md, *The LAN tier*."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import socket
from collections.abc import Callable
from pathlib import Path

import numpy as np

from bpf.fallback import UserspaceAggregator
from bpf.writer import SocketWriter
from bpf.xdp import XDP_REDIRECT, XDP_TX, Upstream, XdpAggregator
from netstorm.lan import udp
from netstorm.lan.deploy import Deployment
from netstorm.lan.errors import EdgeTimeout, StaleDeployment, WireError
from netstorm.lan.header import HEADER_BYTES, KIND_AT, MAX_LANES, OFFSETS, Flag, Header, Kind
from netstorm.lan.layout import EdgeLayout
from netstorm.lan.outbox import Outbox
from netstorm.lan.packets import control_packet, nack_packets
from netstorm.lan.sender import EdgeSender, GroupOpener
from netstorm.lan.slots import TOKEN_WINDOW
from netstorm.lan.tokens import LanTokens, Sender

log = logging.getLogger("netstorm.edge.cluster")
Address = tuple[str, int]
_ITERATION_AT = OFFSETS["iteration"]
_EPOCH_AT = OFFSETS["epoch"]
_WORKER_AT = OFFSETS["worker"]
REHELLO_S = 0.2
"""Seconds between two HELLOs of a service asking for its part of a changed deployment."""
MOVED_HOLD = 0.05
"""Least seconds between two MOVED this service sends one member for one iteration."""
REORDER_MIN = 0.002
"""Least wait between the gateway's NACK for a chunk and reading the chunk's slot here (the wait is at least the
members' ``retransmit``): the gateway may ask while members' datagrams are still on their way (aggregates
reach it from two paths, and a member's GSO batches may be reordered before this host's program), and a
member NACKed for a datagram that then arrives resends a duplicate."""


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
        self.deployment: Deployment | None = None
        self.xdp: XdpAggregator | None = None
        self.fallback: UserspaceAggregator | None = None
        self.attached: list[str] = []
        # gro=False: this socket's DATA is read one datagram per receive below, so the kernel must not
        # hand it the members' GSO batches coalesced
        self._hello = EdgeSender(sock, gateway, worker=worker, layout=EdgeLayout.uniform([1], 0), job=job,
                                 secret=secret, group_opener=group_opener, gro=False)
        self._installed = -1
        self._last_from: Address = ("", 0)
        self._scale = 0
        self._stop = asyncio.Event()
        self.outbox = Outbox(batch=1)
        """Aggregates forwarded to the gateway (userspace mode), sent by one writer: a full send buffer (this
        worker's shaped uplink) holds them back instead of dropping them (bpf/writer.py)."""
        self.writer = SocketWriter(sock, self.outbox, who=f"edge aggregator {worker}")
        self.members: dict[int, Address] = {}
        """Where each worker that said HELLO here sends from (its members', its own trainer's, and after a
        deployment change possibly a member's whose HELLO came before this service took its new part):
        the address of its latest HELLO here. NACKs go only to the members its slot lacks."""
        self.nacks_in = 0
        """The gateway's NACKs for a chunk this cluster's aggregate is missing from."""
        self.nacks_out = 0
        """NACKs this service sent its members (a re-emission asked of its own trainer included)."""
        self.forged = 0
        self._final: dict[str, int] = {}
        self.rehellos = 0
        """HELLOs this service said again for a changed deployment."""
        self.redeployed = 0
        """Deployments taken while running (the program's configuration rewritten)."""
        self.moved_sent = 0
        """MOVED sent to members whose DATA carried another epoch."""
        self._token_workers: tuple[int, ...] = ()
        """Whose tokens are installed: this worker, its members, and after a change its previous members too
        (their DATA of the old epoch then authenticates, and is answered MOVED instead of dropped)."""
        self._nonce: int | None = None
        """The nonce of the HELLO this service awaits an answer to (None: none outstanding)."""
        self._told: dict[tuple[int, int], float] = {}
        self._asked: dict[int, tuple[int, int, int]] = {}
        """Slot -> the (iteration, tensor, chunk) the gateway asked about, looked at after a reorder window (at
        most one per slot, so the gateway's NACKs cannot grow it past the pool)."""

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
        self.deployment = self._hello.deployment
        self._scale = reply.scale
        return self.deployment

    def load(self) -> None:
        """Load and attach the aggregation program (blocking: compiling takes seconds; interfaces and
        addresses are those of the calling thread's namespace)."""
        deployment = self.deployment
        if deployment is None:
            raise RuntimeError("edge aggregator: load before hello")
        members = self._mask(deployment)
        layout = EdgeLayout.uniform([deployment.pool * deployment.lanes], scale=self._scale, lanes=deployment.lanes,
                                    pool=deployment.pool, shadow=deployment.kernel_results)
        own_ip, port = self.sock.getsockname()[0], self.sock.getsockname()[1]
        agg_token = 0
        if self.mode == "xdp":
            upstream = Upstream(worker=self.worker, ifindex=socket.if_nametoindex(self.interface), gateway=self.gateway,
                                gateway_mac=_neighbour_mac(self.gateway[0]), own=(own_ip, port),
                                own_mac=udp.interface_mac(self.interface))
            xdp = XdpAggregator(layout, job=self.job, port=port, expected=members, timeout=1.0, max_nacks=0,
                                upstream=upstream)
            self.xdp = xdp
            xdp.redeploy(expected=members, epoch=deployment.epoch)
            if self.tokens.enabled:
                agg_token = 1
                xdp.require_tokens(agg_token)
            self.attached.append(xdp.attach(upstream.ifindex, mode=self.attach_mode))
            self.attached.append(xdp.attach(socket.if_nametoindex("lo"), mode="generic"))
        else:
            self.fallback = UserspaceAggregator(layout, job=self.job, expected=members, timeout=1.0, max_nacks=0,
                                                up_worker=self.worker)
            self.fallback.epoch = deployment.epoch
            if self.tokens.enabled:
                agg_token = 1
                self.fallback.require_tokens(agg_token)
        if deployment.first_iteration is not None:
            self._install(deployment.first_iteration)
        log.info("edge aggregator: worker %d %s for gateway %s:%d (%s, deployment epoch %d)", self.worker,
                 "stands by" if deployment.standby else f"aggregates {sorted(deployment.members)}", *self.gateway,
                 self.mode, deployment.epoch)

    def _mask(self, deployment: Deployment) -> int:
        """The contributors this service's aggregator expects: itself and its members (none on standby)."""
        return 0 if deployment.standby else (1 << self.worker) | sum(1 << m for m in deployment.members)

    @property
    def epoch(self) -> int:
        return self.deployment.epoch if self.deployment is not None else 0

    @property
    def expected(self) -> int:
        """The contributor mask in use, read back from the aggregator (the kernel's configuration map)."""
        if self.xdp is not None:
            return self.xdp.configured()["expected"]
        return self.fallback.expected if self.fallback is not None else 0

    def ask(self) -> None:
        """Say HELLO to the gateway for this service's part of the current deployment, every REHELLO_S until
        answered (``_on_answer``); a call while one is outstanding changes nothing."""
        if self._nonce is not None:
            return
        self._nonce = secrets.randbits(32)
        self.rehellos += 1
        self._send_hello()

    def _send_hello(self) -> None:
        nonce = self._nonce
        if nonce is None or self._stop.is_set():
            return
        hello = control_packet(Kind.HELLO, job=self.job, worker=self.worker, iteration=nonce, flags=Flag.AGGREGATOR,
                               token=self.tokens.of(Sender.WORKER, self.worker, nonce, keep=False))
        self.outbox.control(hello, self.gateway)
        self.writer.wake.set()
        asyncio.get_running_loop().call_later(REHELLO_S, self._send_hello_again, nonce)

    def _send_hello_again(self, nonce: int) -> None:
        if self._nonce == nonce:
            self._send_hello()

    def _on_answer(self, head: Header, data: bytes) -> None:
        """The gateway's answer to this service's HELLO: take the deployment it carries."""
        nonce = self._nonce
        if nonce is None or head.iteration != nonce or (self.tokens.enabled and not self.tokens.valid(
                Sender.GATEWAY, self.worker, nonce, head.token, keep=False)):
            return
        self._nonce = None
        self.redeploy(Deployment.decode(data[HEADER_BYTES:]))

    def redeploy(self, deployment: Deployment) -> None:
        """Take a new part while running: the members and epoch rewritten in the aggregator in place, the
        members' tokens installed from the deployment's first iteration."""
        old = self.deployment
        self.deployment = deployment
        if old is not None and old.epoch == deployment.epoch and old.members == deployment.members \
                and old.standby == deployment.standby:
            return
        mask = self._mask(deployment)
        if self.xdp is not None:
            self.xdp.redeploy(expected=mask, epoch=deployment.epoch)
        elif self.fallback is not None:
            self.fallback.expected = mask
            self.fallback.epoch = deployment.epoch
        self._token_workers = tuple(sorted({self.worker, *deployment.members, *(old.members if old else ())}))
        self._installed = -1
        if deployment.first_iteration is not None:
            self._install(deployment.first_iteration)
        self.redeployed += 1
        log.info("edge aggregator: worker %d %s from deployment epoch %d", self.worker,
                 "stands by" if deployment.standby else f"aggregates {sorted(deployment.members)}", deployment.epoch)

    def _on_stale(self, worker: int, iteration: int, address: Address) -> None:
        """DATA of another epoch reached this aggregator: its sender is told (once per iteration and hold),
        and this service asks the gateway in case it is the one behind."""
        now = asyncio.get_running_loop().time()
        key = (worker, iteration)
        if now - self._told.get(key, float("-inf")) >= MOVED_HOLD:
            self._told[key] = now
            if len(self._told) > 256:
                self._told.clear()
            token = self.tokens.gateway(worker, iteration) if self.tokens.enabled else 0
            self.outbox.control(control_packet(Kind.MOVED, job=self.job, worker=worker, iteration=iteration,
                                               epoch=self.epoch, token=token), address)
            self.writer.wake.set()
            self.moved_sent += 1
        self.ask()

    def kernel_map_bytes(self) -> int:
        return self.xdp.kernel_map_bytes() if self.xdp is not None else 0

    def stats(self) -> dict[str, int]:
        """The aggregation's counters (the program's, or the fallback's) and this service's NACKs."""
        own = {"cluster_nacks_in": self.nacks_in, "cluster_nacks_out": self.nacks_out, "cluster_forged": self.forged}
        if self.xdp is not None:
            return {**self.xdp.stats(), **own}
        if self.fallback is not None:
            return {**self.fallback.counters, **own}
        return {**self._final, **own}

    def _install(self, base: int) -> None:
        """Tokens of every member and of this worker for iterations base .. base + TOKEN_WINDOW - 1."""
        last = base + TOKEN_WINDOW - 1
        if not self.tokens.enabled or last <= self._installed or self.deployment is None:
            return
        first = max(base, self._installed + 1)
        workers = self._token_workers or (self.worker, *self.deployment.members)
        entries = [(w, k, self.tokens.worker(w, k)) for k in range(first, last + 1) for w in workers]
        target = self.xdp if self.xdp is not None else self.fallback
        assert target is not None
        target.install_tokens(entries)
        if self.fallback is not None:
            self.fallback.up_tokens.update({k & 0xFFFFFFFF: self.tokens.worker(self.worker, k)
                                            for k in range(first, last + 1)})
        self._installed = last

    async def run(self) -> None:
        """Until ``close``: follow the iterations (tokens) from the gateway's multicast and, in userspace
        mode, aggregate the members' DATA and forward completed slots."""
        loop = asyncio.get_running_loop()
        group = self._hello.group_sock
        buf = bytearray(HEADER_BYTES + 4 * MAX_LANES + 64)

        def on_group() -> None:
            assert group is not None
            while True:
                try:
                    data = group.recv(len(buf))
                except BlockingIOError:
                    return
                except OSError:   # closed under a reader still registered (close() before run() unwound)
                    return
                if len(data) >= HEADER_BYTES and data[KIND_AT] in (Kind.ACK, Kind.RESULT):
                    iteration = int.from_bytes(data[_ITERATION_AT: _ITERATION_AT + 4], "little")
                    # an ACK or a RESULT of iteration k: its DATA may still be in flight (results can stream
                    # while members still send) and k + 1 comes next; the window from k holds both
                    self._install(iteration)
                    if data[KIND_AT] == Kind.RESULT and \
                            int.from_bytes(data[_EPOCH_AT: _EPOCH_AT + 2], "little") != self.epoch:
                        self.ask()      # the next iteration runs another deployment

        def on_data() -> None:
            view = memoryview(buf)
            for _ in range(256):
                try:
                    n, self._last_from = self.sock.recvfrom_into(buf)
                except BlockingIOError:
                    return
                if n < HEADER_BYTES:
                    continue
                if buf[KIND_AT] in (Kind.HELLO, Kind.MOVED) and self._last_from[0] == self.gateway[0] and \
                        buf[_WORKER_AT] == self.worker and (buf[KIND_AT] == Kind.MOVED or
                                                            buf[OFFSETS["flags"]] & Flag.AGGREGATOR):
                    try:
                        head = Header.decode(view[:n])
                        if head.job != self.job:
                            continue
                        if head.kind == Kind.HELLO:
                            self._on_answer(head, bytes(view[:n]))
                        elif not self.tokens.enabled or head.token == self.tokens.gateway(self.worker, head.iteration):
                            self.ask()
                        else:
                            self.forged += 1
                    except WireError as exc:
                        log.warning("edge aggregator: rejected datagram: %s", exc)
                    continue
                if buf[KIND_AT] in (Kind.HELLO, Kind.NACK):
                    try:
                        head = Header.decode(view[:n])
                        # a gateway's NACK lists its chunk's sequence number, passed on to the members
                        listed = int.from_bytes(view[HEADER_BYTES: HEADER_BYTES + 4], "little") \
                            if head.kind == Kind.NACK and head.count else None
                        self._on_control(head, self._last_from, listed)
                    except WireError as exc:
                        log.warning("edge aggregator: rejected datagram: %s", exc)
                    continue
                if buf[KIND_AT] != Kind.DATA:
                    continue
                out: bytes | None = None
                try:
                    if self.fallback is not None:
                        out = self.fallback.on_data(bytes(view[:n]), loop.time())
                    elif int.from_bytes(buf[_EPOCH_AT: _EPOCH_AT + 2], "little") != self.epoch:
                        # the program passes up DATA of another epoch (its token checked there)
                        self._on_stale(buf[_WORKER_AT], int.from_bytes(buf[_ITERATION_AT: _ITERATION_AT + 4],
                                                                       "little"), self._last_from)
                        continue
                    elif self.xdp is not None:
                        # narrow lanes the program passed up for want of tailroom: widened here, summed there
                        verdict, after = self.xdp.run_widened(bytes(view[:n]))
                        out = after if verdict in (XDP_TX, XDP_REDIRECT) else None
                except StaleDeployment as exc:
                    self._on_stale(exc.worker, exc.iteration, self._last_from)
                    continue
                except WireError as exc:
                    log.warning("edge aggregator: rejected datagram: %s", exc)
                    continue
                if out is not None:
                    self.outbox.control(out, self.gateway)
                    self.writer.wake.set()

        # fd numbers taken now: close() may close the sockets before this task unwinds
        group_fd = group.fileno() if group is not None else -1
        data_fd = self.sock.fileno()
        if group_fd >= 0:
            loop.add_reader(group_fd, on_group)
        if data_fd >= 0:
            loop.add_reader(data_fd, on_data)
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

    def _on_control(self, head: Header, address: Address, seq: int | None = None) -> None:
        """A member's HELLO (its address) or the gateway's NACK for a chunk this cluster's aggregate is missing
        from (NACK the members its slot lacks)."""
        deployment = self.deployment
        if deployment is None or head.job != self.job:
            return
        if head.kind == Kind.HELLO:
            if self.tokens.enabled and not self.tokens.valid(Sender.WORKER, head.worker, head.iteration, head.token,
                                                             keep=False):
                self.forged += 1
                return
            # whoever says HELLO here, member or not yet: after a change the gateway may answer a member (once
            # this service asked) before the answer that makes it a member reaches this service
            self.members[head.worker] = (address[0], address[1])
            return
        if head.flags & Flag.RESCALE or seq is None:
            return      # a RESCALE goes to every worker from the gateway itself; a NACK lists its chunk
        if address[0] != self.gateway[0] or (
                self.tokens.enabled and head.token != self.tokens.gateway(self.worker, head.iteration)):
            # from anywhere but the gateway, or without its token for us: accepted, it would make us NACK
            # members whose slot is empty (every one)
            self.forged += 1
            return
        self.nacks_in += 1
        if head.epoch != self.epoch:
            self.ask()      # the gateway runs another deployment: this service missed the switch
        key = (head.iteration, head.tensor, head.chunk)
        if self._asked.get(head.slot) == key:
            return      # already due for a look
        self._asked[head.slot] = key
        window = max(self.deployment.retransmit, REORDER_MIN) if self.deployment is not None else REORDER_MIN
        asyncio.get_running_loop().call_later(window, self._nack_members, head, seq)

    def _nack_members(self, head: Header, seq: int) -> None:
        """A reorder window after the gateway's NACK for ``head``'s chunk: NACK whoever the slot still lacks."""
        if self._asked.get(head.slot) != (head.iteration, head.tensor, head.chunk):
            return
        del self._asked[head.slot]
        for worker in self.missing(head):
            where = self.members.get(worker)
            if where is None:
                continue
            token = self.tokens.gateway(worker, head.iteration) if self.tokens.enabled else 0
            nack, = nack_packets(np.array([seq]), job=self.job, iteration=head.iteration, token=token,
                                 epoch=self.epoch)
            self.nacks_out += 1
            self.outbox.control(nack, where)
        self.writer.wake.set()

    def missing(self, head: Header) -> list[int]:
        """Who should resend the chunk ``head`` names: the members its slot here lacks; every member when the
        slot holds an older key or nothing (every datagram was lost); this worker's own trainer when the slot
        completed (its duplicate re-emits the aggregate); nobody when a newer key took the slot over."""
        target = self.xdp if self.xdp is not None else self.fallback
        if target is None or self.deployment is None:
            return []
        state = target.slot_states(np.array([head.slot], np.int64))[0]
        cluster = (self.worker, *self.deployment.members)
        key = (int(state["iteration"]), int(state["tensor"]), int(state["chunk"]))
        bitmap = int(state["bitmap"])
        age = ((head.iteration - key[0] + 2**31) & 0xFFFFFFFF) - 2**31
        if key == (head.iteration & 0xFFFFFFFF, head.tensor, head.chunk) and bitmap:
            if not int(state["busy"]):
                return [self.worker]
            return [w for w in cluster if not bitmap >> w & 1]
        if not bitmap or age > 0 or (age == 0 and key[1:] < (head.tensor, head.chunk)):
            return list(cluster)
        return []

    def follow(self, iteration: int) -> None:
        """Install tokens from ``iteration`` on (for a harness that knows the iterations)."""
        self._install(iteration)

    def close(self) -> None:
        self._stop.set()
        self._hello.close()
        if self.xdp is not None:
            self._final = self.xdp.stats()      # the program's counters outlive it
            self.xdp.close()
            self.xdp = None

