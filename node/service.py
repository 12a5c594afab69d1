"""The general node: the asyncio shell around ``ChunkCore`` that moves chunks between peers.

It owns the data-plane server, one ``PeerLink`` per member, the policy binding per iteration (asked
from the control plane before this DC's contribution enters the core; the node asks for k+1 when k
completes here), the auxiliary path choice per tree edge, the passive probes on every received hop,
and the completion signals the trainer endpoint (or the LAN edge aggregator) waits on.

The DC's contribution stream is ``contribute(key, values)`` / ``collect(keys)``: the n-th contribution
of a tensor belongs to its n-th iteration, so a trainer that pushes tensors one by one (as gradient
hooks do) overlaps its backward pass with the WAN.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Protocol

import msgspec
import numpy as np

from netstorm.config import Config
from netstorm.control import LinkBeliefs
from netstorm.errors import ChunkError, ErrorCode, FrameError, IterationFailed, LayoutError
from netstorm.frames import ChunkHeader, Hello
from netstorm.layout import Layout, TensorSpec
from netstorm.policy import Policy
from netstorm.probe import LinkReport, ProbeEstimator
from netstorm.sendsched import LinkView, PathScheduler
from node.chunks import Action, ChunkCore, IterationDone, KeyDone, Send
from node.chunks import IterationFailed as FailedAction
from node.forwarding import Forwarding
from node.linkstats import LinkCounters
from node.peers import InboundProtocol, Outgoing, PeerError, PeerLink

log = logging.getLogger("netstorm.node")


class Control(Protocol):
    """What the node needs from the control plane (node/control_client.SchedulerClient)."""

    @property
    def members(self) -> Mapping[int, tuple[str, int]]: ...
    @property
    def workers(self) -> Mapping[int, int]: ...
    @property
    def config(self) -> Config: ...
    @property
    def node_id(self) -> int: ...

    async def check_layout(self, layout_hash: str, *, timeout: float) -> None: ...  # noqa: ASYNC109
    async def policy_for(self, iteration: int, *, timeout: float) -> Policy: ...  # noqa: ASYNC109
    def prefetch(self, iteration: int) -> None: ...
    def report_link(self, report: LinkReport) -> None: ...
    def on_member_down(self, cb: Callable[[int, str], None]) -> None: ...
    def on_beliefs(self, cb: Callable[[LinkBeliefs], None]) -> None: ...


class EdgeHook(Protocol):
    """What the node needs from the LAN edge aggregation of a gateway (bpf/gateway.EdgeRole)."""

    async def combine(self, iteration: int, key: int, values: np.ndarray | None,
                      sizes: list[int]) -> np.ndarray | None: ...
    def released(self, iteration: int, per_key: list[np.ndarray], workers: int) -> None: ...


class IterationTimeout(IterationFailed):
    """The iteration ran past iteration_timeout."""

    code = ErrorCode.TIMEOUT


class PeerGone(IterationFailed):
    """A peer died while the iteration needed it."""

    code = ErrorCode.PEER_GONE


def _failure(cause: str, reason: str) -> IterationFailed:
    if cause == "gone":
        return PeerGone(reason)
    if cause == "timeout":
        return IterationTimeout(reason)
    return IterationFailed(reason)


@dataclasses.dataclass
class _Tracker:
    """Completion state of one iteration, for the waiters at this node."""

    started: float
    changed: asyncio.Event = dataclasses.field(default_factory=asyncio.Event)
    keys_done: set[int] = dataclasses.field(default_factory=set)
    pulled: set[int] = dataclasses.field(default_factory=set)
    done: bool = False
    failed: str | None = None
    cause: str = "failed"

    def check(self) -> None:
        if self.failed is not None:
            raise _failure(self.cause, self.failed)


class GeneralNode:
    """One DC's node. ``serve_data`` first (so its port can be advertised), then ``run(control)``."""

    def __init__(self, node_id: int, config: Config, *, clock: Callable[[], float] = time.time) -> None:
        self.node_id = node_id
        self.config = config
        self.clock = clock
        self.core = ChunkCore(node_id)
        self.layout: Layout | None = None
        self.control: Control | None = None
        self.members: dict[int, tuple[str, int]] = {}
        self.workers: dict[int, int] = {}
        """Member -> workers whose gradients its contribution sums (from the scheduler; 1 when absent)."""
        self.links: dict[int, PeerLink] = {}
        self.down: dict[int, str] = {}
        self.forwarding = Forwarding(node_id, config)
        self._inbound: set[InboundProtocol] = set()
        self._inbound_by_peer: dict[int, InboundProtocol] = {}
        self._server: asyncio.Server | None = None
        self._trackers: dict[int, _Tracker] = {}
        self._policy_waits: dict[int, asyncio.Future[Policy]] = {}
        self._key_next: np.ndarray = np.zeros(0, dtype=np.int64)
        self._key_pull: np.ndarray = np.zeros(0, dtype=np.int64)
        self._probes: dict[tuple[int, int], ProbeEstimator] = {}
        self._link_marks: dict[int, LinkCounters] = {}
        self._stopping = asyncio.Event()
        self._ready = asyncio.Event()
        self._tg: asyncio.TaskGroup | None = None
        self.first_iteration = 0
        self.edge: EdgeHook | None = None
        """The gateway role (bpf/gateway.EdgeRole): LAN workers' sums join this DC's contribution."""

    # ---- lifecycle ----------------------------------------------------------------------------------

    async def serve_data(self, host: str, port: int) -> tuple[str, int]:
        """Listen for peers; returns the bound address (port 0 picks a free one)."""
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(self._make_inbound, host, port)
        bound = self._server.sockets[0].getsockname()
        return str(bound[0]), int(bound[1])

    async def run(self, control: Control) -> None:
        """Serve until ``stop``; peer links run in this scope and end with it."""
        self.control = control
        self.config = control.config
        self.forwarding = Forwarding(self.node_id, self.config)
        self.members = dict(control.members)
        self.workers = dict(control.workers)
        for inbound in list(self._inbound):
            if inbound.peer_id is not None and inbound.peer_id not in self.members:
                inbound.reject(f"node {inbound.peer_id} is not a member of this job", ErrorCode.NOT_MEMBER)
        control.on_member_down(self.member_down)
        control.on_beliefs(self._believe)
        try:
            async with asyncio.TaskGroup() as tg:
                self._tg = tg
                for peer, address in sorted(self.members.items()):
                    if peer == self.node_id:
                        continue
                    link = PeerLink(peer_id=peer, address=address, hello=self._hello, clock=self.clock,
                                    connect_timeout=self.config.connect_timeout,
                                    stall_timeout=self.config.iteration_timeout, on_progress=self._rebalance)
                    self.links[peer] = link
                    tg.create_task(self._run_link(link))
                self._ready.set()
                await self._stopping.wait()
                for link in self.links.values():
                    link.close()
        finally:
            self._tg = None
            if self._server is not None:
                self._server.close()
            for inbound in list(self._inbound):
                if inbound.transport is not None:
                    inbound.transport.close()

    def stop(self) -> None:
        self._stopping.set()

    @property
    def stopped(self) -> bool:
        return self._stopping.is_set()

    async def wait_stopped(self) -> None:
        await self._stopping.wait()

    async def wait_ready(self) -> None:
        await self._ready.wait()

    @property
    def num_workers(self) -> int:
        """Workers of the job's live members (each DC's trainer and LAN workers)."""
        return sum(self.workers.get(n, 1) for n in self.members if n not in self.down)

    # ---- the DC's contribution stream ---------------------------------------------------------------

    async def register(self, specs: Sequence[TensorSpec]) -> Layout:
        """Fix the layout from the trainer's tensors; the scheduler checks every DC agrees."""
        layout = Layout.build(specs, self.config.chunk_size)
        if self.layout is not None:
            if layout.hash != self.layout.hash:
                raise LayoutError(f"node {self.node_id} already serves layout {self.layout.hash}; this trainer "
                                  f"registers {layout.hash} (different tensors, shapes or dtypes)")
            return self.layout
        assert self.control is not None
        await self.control.check_layout(layout.hash, timeout=self.config.connect_timeout)
        if self.layout is not None:  # a concurrent registration won
            return await self.register(specs)
        self.layout = layout
        self._key_next = np.full(len(layout.tensors), self.first_iteration, dtype=np.int64)
        self._key_pull = self._key_next.copy()
        self.core.horizon = self.first_iteration + 1
        self._apply(self.core.set_layout(layout))
        for inbound in list(self._inbound):
            self._check_peer_layout(inbound)
        log.info("node %d: layout %s, %d tensors, %d chunks, %d elements", self.node_id, layout.hash,
                 len(layout.tensors), len(layout.chunks), layout.total)
        return layout

    def next_iteration(self) -> int:
        """The iteration the next contribution of every tensor belongs to; error if they diverge."""
        if self.layout is None:
            raise LayoutError("no tensors registered")
        low, high = int(self._key_next.min()), int(self._key_next.max())
        if low != high:
            behind = [self.layout.tensors[i].name for i in np.flatnonzero(self._key_next == low)[:5]]
            raise ChunkError(f"tensors are at different iterations ({low}..{high}); not yet pushed for "
                             f"iteration {low}: {', '.join(behind)}")
        return low

    def pull_iteration(self, key: int) -> int:
        """The iteration the next ``collect`` of tensor ``key`` returns."""
        return int(self._key_pull[key])

    async def contribute(self, key: int, values: np.ndarray | None, *, iteration: int | None = None) -> int:
        """This DC's values for tensor ``key`` in its next iteration (None contributes zeros).

        This is the hook for any source of the DC's contribution (the trainer endpoint, or the LAN edge
        aggregator): ``iteration``, when given, must be the tensor's next one.
        """
        if self.layout is None:
            raise LayoutError("no tensors registered")
        if iteration is not None and iteration != int(self._key_next[key]):
            raise ChunkError(f"tensor {self.layout.tensors[key].name!r}: contribution for iteration {iteration}, "
                             f"but its next iteration is {int(self._key_next[key])}")
        iteration = int(self._key_next[key])
        tracker = self._tracker(iteration)
        tracker.check()
        await self.ensure_policy(iteration)
        tracker.check()
        if self.edge is not None:
            values = await self.edge.combine(iteration, key, values, [t.size for t in self.layout.tensors])
            tracker.check()
        self._key_next[key] += 1
        self.core.horizon = max(self.core.horizon, iteration + 1)
        self._apply(self.core.push_local(iteration, key, values))
        return iteration

    async def collect(self, keys: Sequence[int], sink: Callable[[int, np.ndarray], None]) -> int:
        """Wait for the oldest unpulled iteration of ``keys``; ``sink(key, flat float32 sum)`` reads each."""
        assert self.layout is not None
        iterations = {int(self._key_pull[k]) for k in keys}
        if len(iterations) != 1:
            raise ChunkError(f"tensors pulled together are at different iterations {sorted(iterations)}")
        iteration = iterations.pop()
        for key in keys:
            if self._key_pull[key] >= self._key_next[key]:
                raise ChunkError(f"tensor {self.layout.tensors[key].name!r} pulled before it was pushed "
                                 f"(iteration {iteration})")
        await self.wait_keys(iteration, keys)
        tracker = self._trackers[iteration]
        result = self.core.result(iteration)
        for key in keys:
            sink(key, result[self.layout.key_slice(key)])
            self._key_pull[key] += 1
            tracker.pulled.add(key)
        if len(tracker.pulled) == len(self.layout.tensors):
            if self.edge is not None:
                self.edge.released(iteration, [result[self.layout.key_slice(k)].copy()
                                               for k in range(len(self.layout.tensors))],
                                   self.contributor_count(iteration))
            self.core.release(iteration)
            del self._trackers[iteration]
            log.debug("node %d: iteration %d released", self.node_id, iteration)
        return iteration

    async def wait_keys(self, iteration: int, keys: Sequence[int]) -> None:
        """Until every chunk of ``keys`` holds its full sum; IterationFailed (naming why) otherwise."""
        tracker = self._tracker(iteration)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + max(0.0, tracker.started + self.config.iteration_timeout - time.monotonic())
        try:
            async with asyncio.timeout_at(deadline):
                while True:
                    tracker.check()
                    if tracker.done or tracker.keys_done.issuperset(keys):
                        return
                    tracker.changed.clear()
                    await tracker.changed.wait()
        except TimeoutError:
            status = self.core.status(iteration)
            reason = (f"iteration {iteration} timed out at node {self.node_id} after "
                      f"{self.config.iteration_timeout:g} s: {status}")
            self._apply(self.core.fail(iteration, reason, "timeout"))
            raise IterationTimeout(reason) from None

    async def ensure_policy(self, iteration: int) -> Policy:
        """The policy bound to ``iteration``, asked once from the control plane and bound in the core."""
        waiter = self._policy_waits.get(iteration)
        if waiter is not None:
            return await waiter
        waiter = asyncio.get_running_loop().create_future()
        self._policy_waits[iteration] = waiter
        assert self.control is not None
        try:
            policy = await self.control.policy_for(iteration, timeout=self.config.connect_timeout)
        except Exception as exc:
            del self._policy_waits[iteration]
            waiter.set_exception(exc)
            waiter.exception()  # retrieved: other waiters re-raise it themselves
            raise
        waiter.set_result(policy)
        for old in [k for k in self._policy_waits if k < iteration - 2]:
            del self._policy_waits[old]
        self.forwarding.forget_before(policy.version - 1)
        in_policy = set(policy.trees[policy.roots[0]].parent)
        dead = sorted(set(self.down) & in_policy)
        strangers = sorted(in_policy - set(self.members))
        if strangers:
            self._apply(self.core.fail(iteration, f"iteration {iteration}: policy version {policy.version} "
                                                  f"names node(s) {strangers}, not members of this job"))
        elif dead:
            self._apply(self.core.fail(iteration, f"iteration {iteration}: policy version {policy.version} "
                                                  f"includes node(s) {dead}, which are gone: "
                                                  f"{'; '.join(self.down[d] for d in dead)}", "gone"))
        else:
            log.debug("node %d: iteration %d bound to policy version %d", self.node_id, iteration, policy.version)
            self._apply(self.core.bind_policy(iteration, policy))
        return policy

    # ---- faults -------------------------------------------------------------------------------------

    def member_down(self, peer: int, reason: str) -> None:
        """A peer is gone: every iteration in progress fails at once, naming the peer."""
        if peer in self.down or peer == self.node_id or self._stopping.is_set():
            return
        self.down[peer] = f"node {peer} is gone: {reason}"
        live = self.core.live_iterations()
        pending = [k for k, t in self._trackers.items() if t.failed is None and not t.done]
        affected = sorted(set(live) | set(pending))
        if affected:
            log.warning("node %d: node %d is gone (%s); failing iterations %s", self.node_id, peer, reason, affected)
        else:
            log.info("node %d: node %d is gone (%s); no iteration in progress", self.node_id, peer, reason)
        for iteration in affected:
            self._apply(self.core.fail(iteration, f"iteration {iteration} failed at node {self.node_id}: "
                                                  f"node {peer} is gone ({reason})", "gone"))

    async def _run_link(self, link: PeerLink) -> None:
        try:
            await link.run()
        except PeerError as exc:
            self.member_down(link.peer_id, str(exc))

    # ---- data plane ---------------------------------------------------------------------------------

    def _hello(self) -> Hello:
        return Hello(self.node_id, self.layout.hash if self.layout is not None else "")

    def _make_inbound(self) -> InboundProtocol:
        protocol = InboundProtocol(on_hello=self._on_hello, on_chunk=self._on_chunk, on_lost=self._on_lost,
                                   max_frame_bytes=self.config.max_frame_bytes, clock=self.clock)
        self._inbound.add(protocol)
        return protocol

    def _on_hello(self, hello: Hello, protocol: InboundProtocol) -> None:
        if self.members and hello.node_id not in self.members:
            raise FrameError(f"node {hello.node_id} is not a member of this job (members: {sorted(self.members)})")
        if hello.node_id == self.node_id:
            raise FrameError(f"a peer claims to be node {self.node_id}, which is this node")
        current = self._inbound_by_peer.get(hello.node_id)
        if current is not None and current is not protocol:
            raise FrameError(f"node {hello.node_id} is already connected from {current.peername}")
        protocol.layout_hash = hello.layout_hash
        protocol.peer_id = hello.node_id
        self._check_peer_layout(protocol)
        self._inbound_by_peer[hello.node_id] = protocol

    def _check_peer_layout(self, protocol: InboundProtocol) -> None:
        theirs = protocol.layout_hash
        if self.layout is not None and theirs and theirs != self.layout.hash:
            protocol.reject(f"layout mismatch: node {protocol.peer_id} has {theirs}, node {self.node_id} "
                            f"has {self.layout.hash}", ErrorCode.LAYOUT_MISMATCH)

    def _on_chunk(self, peer: int, header: ChunkHeader, payload: np.ndarray, t_last_byte: float) -> None:
        self._probe(header, payload.nbytes, t_last_byte)
        self._apply(self.core.receive(header, payload))

    def _on_lost(self, protocol: InboundProtocol, reason: str) -> None:
        self._inbound.discard(protocol)
        peer = protocol.peer_id
        if peer is None or self._inbound_by_peer.get(peer) is not protocol:
            return
        del self._inbound_by_peer[peer]
        if not protocol.rejected:
            self.member_down(peer, f"its connection to node {self.node_id} closed ({reason})")

    def _probe(self, header: ChunkHeader, nbytes: int, t_last_byte: float) -> None:
        """Feed the hop's estimator. Not in this node's first iteration: its connections are new, TCP's
        windows are still opening and reports read low; alone, such reports re-planned runs whose rates
        were exact by the end of the first iteration."""
        if not self.config.enable_awareness or self.control is None or header.iteration <= self.first_iteration:
            return
        link = (header.src, self.node_id)
        estimator = self._probes.get(link)
        if estimator is None:
            estimator = ProbeEstimator(header.src, self.node_id, probe_chunk_bytes=self.config.probe_chunk_size,
                                       probe_chunk_num=self.config.probe_chunk_num,
                                       min_window_s=self.config.probe_window)
            self._probes[link] = estimator
        try:
            report = estimator.on_chunk(nbytes, header.t_send, t_last_byte)
        except ValueError as exc:  # a peer's unusable stamp costs its sample, not the chunk
            log.warning("node %d: %s", self.node_id, exc)
            return
        if report is not None:
            log.debug("node %d: link %d->%d measured %.1f Mbit/s", self.node_id, report.src, report.dst,
                      report.mbit_s)
            self.control.report_link(report)

    def _skip(self, iteration: int) -> None:
        """A failed iteration is over for every tensor: the DC's next push and pull go to the one after."""
        if self.layout is None:
            return
        np.maximum(self._key_next, iteration + 1, out=self._key_next)
        np.maximum(self._key_pull, iteration + 1, out=self._key_pull)
        self.core.horizon = max(self.core.horizon, iteration + 2)
        for old in [k for k, t in self._trackers.items() if k < iteration - 2 and t.failed is not None]:
            del self._trackers[old]

    def contributors(self, iteration: int) -> list[int]:
        """The DCs whose contributions make up ``iteration``'s sums (the nodes of its bound policy)."""
        waiter = self._policy_waits.get(iteration)
        if waiter is None or not waiter.done() or waiter.exception() is not None:
            return sorted(self.members)
        return sorted(waiter.result().nodes)

    def contributor_count(self, iteration: int) -> int:
        """Workers whose gradients make up ``iteration``'s sums: over its contributing DCs, each DC's own
        trainer and its gateway's LAN workers (what ``average=True`` divides by)."""
        return sum(self.workers.get(n, 1) for n in self.contributors(iteration))

    def _tracker(self, iteration: int) -> _Tracker:
        tracker = self._trackers.get(iteration)
        if tracker is None:
            tracker = _Tracker(started=time.monotonic())
            self._trackers[iteration] = tracker
        return tracker

    def _apply(self, actions: list[Action]) -> None:
        for action in actions:
            if isinstance(action, Send):
                self._send(action)
            elif isinstance(action, KeyDone):
                tracker = self._tracker(action.iteration)
                tracker.keys_done.add(action.key)
                tracker.changed.set()
            elif isinstance(action, IterationDone):
                tracker = self._tracker(action.iteration)
                tracker.done = True
                tracker.changed.set()
                if self.control is not None:  # bind the next iteration now, to the newest policy
                    self.control.prefetch(action.iteration + 1)
                waiter = self._policy_waits.get(action.iteration)
                version = waiter.result().version if waiter is not None and waiter.done() and \
                    waiter.exception() is None else "?"
                log.info("node %d: iteration %d complete in %.3f s (policy version %s, %d chunks sent on "
                         "auxiliary paths so far, %d of them moved from a queue, %d exploring); links %s",
                         self.node_id, action.iteration, time.monotonic() - tracker.started, version,
                         self.forwarding.aux_chunks + self.forwarding.moved_chunks, self.forwarding.moved_chunks,
                         self.forwarding.explored_chunks, self._link_usage())
            elif isinstance(action, FailedAction):
                tracker = self._tracker(action.iteration)
                tracker.failed = action.reason
                tracker.cause = action.cause
                tracker.changed.set()
                self._skip(action.iteration)
                log.error("node %d: %s", self.node_id, action.reason)

    def _link_usage(self) -> str:
        """Bytes each outgoing link carried and how long it was busy since the last call (kernel counters)."""
        parts = []
        for peer, link in sorted(self.links.items()):
            now = link.counters()
            if now is None:
                continue
            delta = now.minus(self._link_marks.get(peer, LinkCounters()))
            self._link_marks[peer] = now
            if delta.acked_bytes > 1:
                parts.append(f"->{peer} {delta.acked_bytes / 1e6:.2f} MB busy {delta.busy_s:.2f} s "
                             f"(sndbuf-limited {delta.sndbuf_limited_s:.2f} s)")
        return ", ".join(parts) or "idle"

    def _link_view(self, peer: int) -> LinkView:
        """This node's link to ``peer`` as the path scheduler weighs it: backlog and measured rate."""
        link = self.links.get(peer)
        if link is None:
            return LinkView(backlog_bytes=0, rate_bps=0.0)  # no link: no path starts there
        return LinkView(backlog_bytes=link.backlog_bytes, rate_bps=link.meter.rate_bps)

    def _send(self, send: Send) -> None:
        header = send.header
        on_sent: Callable[[], None] | None = None
        chosen_by: PathScheduler | None = None
        if header.origin == self.node_id and not header.is_aux:
            state_policy = self._policy_waits.get(header.iteration)
            if state_policy is not None and state_policy.done() and not state_policy.exception():
                path, scheduler = self.forwarding.choose(state_policy.result(), header.final, self._link_view,
                                                         send.payload.nbytes, header.iteration)
                on_sent = _done_callback(scheduler, path)
                if len(path) > 2:
                    header = msgspec.structs.replace(header, dst=path[1], is_aux=True, path=path)
                else:
                    chosen_by = scheduler
        link = self.links.get(header.dst)
        if link is None:
            raise ChunkError(f"node {self.node_id} has no link to node {header.dst}")
        if header.dst in self.down:
            self._apply(self.core.fail(header.iteration, f"iteration {header.iteration}: cannot send to "
                                                         f"{self.down[header.dst]}", "gone"))
            return
        link.enqueue(Outgoing(header, send.payload, on_sent, chosen_by))

    def _believe(self, beliefs: LinkBeliefs) -> None:
        """A newer policy was published: detours of older ones follow its rates, and the queued chunks of
        tree edges whose moves were re-planned leave on the new moves' paths in their planned fractions."""
        for scheduler in self.forwarding.believe(beliefs.version, beliefs.rates, beliefs.amends, beliefs.offload):
            self._move_planned(scheduler)

    def _move_planned(self, scheduler: PathScheduler) -> None:
        """Move each detour's fraction of the chunks queued on ``scheduler``'s tree edge, last first."""
        source = self.links.get(scheduler.primary[1])
        if source is None:
            return

        def ours(item: Outgoing) -> bool:
            return item.scheduler is scheduler and not item.header.is_aux

        queued = source.count(ours)
        for path, fraction in scheduler.offload:
            if path[1] not in self.links or path[1] in self.down:
                continue
            for _ in range(round(fraction * queued)):
                item = source.last(ours)
                if item is None:
                    return
                scheduler.take(path)
                self._detour(source, item, scheduler, path)

    def _detour(self, source: PeerLink, item: Outgoing, scheduler: PathScheduler, path: tuple[int, ...]) -> None:
        """Send ``item``, queued on ``source`` for its tree edge, over the auxiliary ``path`` instead."""
        source.take_back(item)
        self.forwarding.moved_chunks += 1
        header = msgspec.structs.replace(item.header, dst=path[1], is_aux=True, path=path)
        self.links[path[1]].enqueue(Outgoing(header, item.payload, _done_callback(scheduler, path)))

    def _rebalance(self, peer: int) -> None:
        """Link ``peer`` ran empty, or sent a frame with more waiting: move one queued tree-edge chunk
        from a lagging link onto an idle one whose auxiliary path delivers it sooner
        (``PathScheduler.reroute``). Paths are chosen when chunks are queued; this lets chunks queued
        before a link slowed down leave it."""
        if not self.config.enable_aux_path or self.config.aux_slowdown == 0 or self.config.aux_reroute == 0:
            return
        link = self.links[peer]
        if link.idle:
            pairs = [(other, peer) for other, busy in self.links.items() if other != peer and not busy.idle]
        else:
            pairs = [(peer, other) for other, idle in self.links.items() if other != peer and idle.idle]
        for source, target in pairs:
            if self._move_last(self.links[source], target):
                return

    def _move_last(self, source: PeerLink, target: int) -> bool:
        item = source.last(lambda o: o.scheduler is not None and o.header.dst == source.peer_id
                           and not o.header.is_aux)
        if item is None or item.scheduler is None or target in self.down:
            return False
        path = item.scheduler.reroute(self._link_view, item.payload.nbytes, target)
        if path is None:
            return False
        self._detour(source, item, item.scheduler, path)
        return True


def _done_callback(scheduler: PathScheduler, path: tuple[int, ...]) -> Callable[[], None]:
    def done() -> None:
        scheduler.done(path)
    return done
