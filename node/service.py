"""The general node: the asyncio shell around ``NodeCore`` (``node/core.py``), which holds the protocol.

The shell moves bytes and time: it owns the data-plane server and one ``PeerLink`` per member, feeds
the core every event (a registered layout, a contribution, a policy from the control plane, a received
chunk, a dead member, a link that sent a frame, new link beliefs) with a snapshot of the links and the
event loop's clock, carries out the core's actions (queue or move frames, ask the control plane for a
policy, report a link), runs the core's one timer (``loop.call_at`` re-armed from ``next_timer``), and
resolves the futures the trainer endpoint and the LAN gateway role wait on.

The DC's contribution stream is ``contribute(key, values)`` / ``collect(keys)``: the n-th contribution
of a tensor belongs to its n-th iteration, so a trainer that pushes tensors one by one (as gradient
hooks do) overlaps its backward pass with the WAN.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Protocol

import numpy as np

from netstorm import auth, authconn
from netstorm.authconn import Credentials
from netstorm.compression.methods import COMPRESSION
from netstorm.compression.options import VOTES, CompressionOptions
from netstorm.config import Config
from netstorm.control import LanPlan, LinkBeliefs
from netstorm.errors import ChunkError, ErrorCode, FrameError, IterationFailed, LayoutMismatch, NetStormError
from netstorm.frames import ChunkHeader, ErrorFrame, Hello, frame_size
from netstorm.joblayout import job_layout
from netstorm.layout import Layout, TensorSpec
from netstorm.policy import Policy
from netstorm.probe import LinkReport
from netstorm.sendsched import LinkView
from node import actions as act
from node import pieces
from node.actions import (
    Action,
    AskPart,
    AskPolicy,
    Cause,
    IterationDone,
    KeyDone,
    MoveFrame,
    Prefetch,
    Released,
    ReportLink,
    ReportLost,
    ReportVacancy,
    SendFrame,
)
from node.core import LinkState, NodeCore
from node.forwarding import Forwarding
from node.linkstats import LinkCounters
from node.nodestats import NodeStats
from node.peers import InboundProtocol, PeerError, PeerLink
from node.sendqueue import Outgoing

log = logging.getLogger("netstorm.node")

WAN_HISTORY = 256
"""Iterations whose WAN bytes a node keeps (a trainer reads an iteration's with its result)."""

BOUNDARY_UNKNOWN = 2**62
"""The chunk horizon of a node admitted into a running job until its layout names its first iteration."""


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
    def report_unreachable(self, peer: int, reason: str) -> None: ...
    def on_beliefs(self, cb: Callable[[LinkBeliefs], None]) -> None: ...


class EdgeHook(Protocol):
    """What the node needs from the LAN edge aggregation of a gateway (bpf.gateway.GatewayRole)."""

    async def combine(self, iteration: int, key: int, values: np.ndarray | None,
                      sizes: list[int]) -> np.ndarray | None: ...
    async def combine_parts(self, iteration: int, key: int, values: np.ndarray | None, sizes: list[int],
                            parts: list[tuple[int, int]], hand: Callable[[int, np.ndarray], None]) -> None: ...
    def released(self, iteration: int, per_key: list[np.ndarray], workers: int) -> None: ...
    def failed(self, iteration: int) -> None: ...
    def compressed(self, layout: Layout, options: CompressionOptions) -> None: ...


class IterationTimeout(IterationFailed):
    """The iteration ran past iteration_timeout."""

    code = ErrorCode.TIMEOUT


class PeerLost(IterationFailed):
    """A peer the iteration needed was declared dead by the scheduler: the iteration is lost at every DC
    and the next one runs without it (the trainer's ``PeerLost``, retryable)."""

    code = ErrorCode.PEER_LOST


PeerGone = PeerLost
"""The former name of ``PeerLost``."""

RECONNECT_FIRST = 0.1
"""Seconds before the first attempt to reopen a lost link to a peer; each failure doubles it."""
RECONNECT_MAX = 5.0
"""Longest wait between attempts: a peer the scheduler still counts as a member is retried for good."""

_RAISES: dict[Cause, type[IterationFailed]] = {Cause.FAILED: IterationFailed, Cause.GONE: PeerLost,
                                               Cause.TIMEOUT: IterationTimeout}
"""The exception a waiter raises for each cause of an iteration's failure."""


class _Snapshot(Mapping[int, LinkState]):
    """The node's links as ``LinkState``s, each read once on first access and then held for the event."""

    def __init__(self, node: GeneralNode) -> None:
        self._node = node
        self._read: dict[int, LinkState] = {}

    def __getitem__(self, peer: int) -> LinkState:
        state = self._read.get(peer)
        if state is None:
            link = self._node.links[peer]  # KeyError for a peer without a link, as a dict would
            view = self._node._link_view(peer)
            state = self._read[peer] = LinkState(view.backlog_bytes, view.rate_bps, link.idle, link.tickets())
        return state

    def __iter__(self) -> Iterator[int]:
        return iter(list(self._node.links))

    def __len__(self) -> int:
        return len(self._node.links)

    def __contains__(self, peer: object) -> bool:
        return peer in self._node.links


class GeneralNode:
    """One DC's node. ``serve_data`` first (so its port can be advertised), then ``run(control)``.

    The protocol is ``self.core`` (``NodeCore``); this class feeds it events, carries out its actions
    and runs its one timer on the event loop's clock."""

    def __init__(self, node_id: int, config: Config, *, clock: Callable[[], float] = time.time,
                 credentials: Credentials | None = None) -> None:
        self.node_id = node_id
        self.config = config
        self.credentials = credentials
        """With a job secret, every data connection proves which node it is before its first frame."""
        self.clock = clock
        """The (synced) wall clock links stamp t_send with and the receiver reads t_last_byte from."""
        self.core = NodeCore(node_id, config)
        self.trainers = config.trainers
        """Trainers whose gradients make up this DC's contribution (this node's own option, not the job's)."""
        self.control: Control | None = None
        self.members: dict[int, tuple[str, int]] = {}
        self.links: dict[int, PeerLink] = {}
        self.wan_sent: dict[int, int] = {}
        self.stats = NodeStats()
        """What this node did, for operators (``node/metrics.py``, the heartbeat's iteration times)."""
        """Per iteration, bytes of the chunk frames this node queued on its WAN links."""
        self._inbound: set[InboundProtocol] = set()
        self._inbound_by_peer: dict[int, InboundProtocol] = {}
        self._server: asyncio.Server | None = None
        self._policy_waits: dict[int, asyncio.Future[Policy]] = {}
        """Iteration -> the future its policy's waiters share while the control plane is asked."""
        self._fetches: set[asyncio.Task[None]] = set()
        self._waiters: dict[int, list[asyncio.Future[None]]] = {}
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at: float | None = None
        self._link_marks: dict[int, LinkCounters] = {}
        self._stopping = asyncio.Event()
        self._stop_reason = ""
        self._ready = asyncio.Event()
        self._tg: asyncio.TaskGroup | None = None
        self.edge: EdgeHook | None = None
        self.lan_plan: LanPlan | None = None
        """The newest plan of this DC's LAN tier from the scheduler (``dc_planner``), None before one."""
        """The gateway role (bpf.gateway.GatewayRole): LAN workers' sums join this DC's contribution."""

    @property
    def layout(self) -> Layout | None:
        return self.core.layout

    def progress(self) -> tuple[tuple[tuple[int, float], ...], int]:
        """What a heartbeat tells the scheduler: the iteration times since the last one, the model's bytes."""
        layout = self.core.layout
        return self.stats.take_unreported(), 4 * layout.total if layout is not None else 0

    @property
    def workers(self) -> dict[int, int]:
        """Member -> workers whose gradients its contribution sums (from the scheduler; 1 when absent)."""
        return self.core.workers

    @property
    def down(self) -> dict[int, str]:
        """Members that are gone, and why."""
        return self.core.down

    @property
    def forwarding(self) -> Forwarding:
        return self.core.forwarding

    @property
    def first_iteration(self) -> int:
        return self.core.first_iteration

    @first_iteration.setter
    def first_iteration(self, iteration: int) -> None:
        self.core.first_iteration = iteration

    # ---- lifecycle ----------------------------------------------------------------------------------

    async def serve_data(self, host: str, port: int) -> tuple[str, int]:
        """Listen for peers; returns the bound address (port 0 picks a free one)."""
        loop = asyncio.get_running_loop()
        factory = authconn.server_factory(
            self.credentials, self._make_inbound, plane=auth.Plane.DATA, me=auth.node(self.node_id),
            allowed=(auth.Role.NODE,), timeout=self.config.connect_timeout,
            refuse=lambda why: ErrorFrame(why, ErrorCode.AUTH).encode(),
            on_refused=lambda why: log.warning("node %d: data connection refused: %s", self.node_id, why))
        context = self.credentials.server_ssl() if self.credentials is not None else None
        self._server = await loop.create_server(factory, host, port, ssl=context,
                                                ssl_handshake_timeout=self.config.connect_timeout if context else None)
        bound = self._server.sockets[0].getsockname()
        return str(bound[0]), int(bound[1])

    async def run(self, control: Control) -> None:
        """Serve until ``stop``; peer links and policy requests run in this scope and end with it."""
        self.control = control
        self.config = control.config
        self.members = dict(control.members)
        self.core.join(control.config, self.members, control.workers)
        if getattr(control, "running", False):
            # Admitted into a running job: peers may send its boundary iteration's chunks before this
            # node has heard (with its layout) which iteration that is; they wait for the layout.
            self.core.chunks.horizon = BOUNDARY_UNKNOWN
        for inbound in list(self._inbound):
            if inbound.peer_id is not None and inbound.peer_id not in self.members:
                inbound.reject(f"node {inbound.peer_id} is not a member of this job", ErrorCode.NOT_MEMBER)
        control.on_member_down(self.member_down)
        control.on_beliefs(self._believe)
        if hasattr(control, "on_member_up"):
            control.on_member_up(self.member_up)
        if hasattr(control, "on_iteration_lost"):
            control.on_iteration_lost(self._iteration_lost)
        if hasattr(control, "on_vacancy") and hasattr(control, "on_part_wanted"):
            control.on_vacancy(self._peer_vacancy)
            control.on_part_wanted(self._part_wanted)
        if hasattr(control, "on_lan_plan"):
            control.on_lan_plan(self._lan_plan)
            pushed = getattr(control, "lan_plan", None)
            if isinstance(pushed, LanPlan):  # pushed before this node ran
                self._lan_plan(pushed)
        try:
            async with asyncio.TaskGroup() as tg:
                self._tg = tg
                for peer, address in sorted(self.members.items()):
                    if peer != self.node_id:
                        self._start_link(peer, address)
                self._ready.set()
                await self._stopping.wait()
                for link in self.links.values():
                    link.close()
                for fetch in self._fetches:
                    fetch.cancel()
        finally:
            self._tg = None
            # a fetch cancelled before its first step never reached its handler: fail its waiter here
            for iteration, waiter in list(self._policy_waits.items()):
                if not waiter.done():
                    self._policy_unavailable(iteration, waiter, self._stopped_error(
                        f"before the policy of iteration {iteration} arrived"))
            if self._server is not None:
                self._server.close()
            for inbound in list(self._inbound):
                if inbound.transport is not None:
                    inbound.transport.close()

    def _start_link(self, peer: int, address: tuple[str, int]) -> None:
        assert self._tg is not None
        link = PeerLink(peer_id=peer, address=address, hello=self._hello, clock=self.clock,
                        connect_timeout=self.config.connect_timeout,
                        stall_timeout=self.config.iteration_timeout, on_progress=self._link_progress,
                        credentials=self.credentials, node_id=self.node_id,
                        keepalive=self.config.idle_timeout / 3)
        old = self.links.get(peer)
        if old is not None:
            old.close()
        self.links[peer] = link
        self._tg.create_task(self._run_link(link))

    def member_up(self, peer: int, address: tuple[str, int], workers: int, joins_at: int = -1) -> None:
        """A DC registered into the running job: a fresh link to it; policies name it from its boundary
        iteration ``joins_at`` (told once it is admitted), whose chunks it may send early."""
        if self._stopping.is_set() or peer == self.node_id:
            return
        fresh = peer not in self.members or peer in self.core.down or self.members[peer] != address
        self.members[peer] = address
        self.core.member_up(peer, workers, joins_at)
        if self._tg is not None and fresh:
            self._start_link(peer, address)
        log.info("node %d: node %d is a member again (data address %s:%d)", self.node_id, peer, *address)

    def joining(self, iteration: int) -> tuple[int, ...]:
        """DCs ``iteration`` admits: it hands them the live model instead of summing gradients."""
        joining = getattr(self.control, "joining", None)
        return tuple(joining(iteration)) if joining is not None else ()

    def stop(self, reason: str = "asked to stop") -> None:
        """Stop serving; ``reason`` is what the errors of whatever was still waiting will say (the first
        reason given wins: later ones are consequences of it)."""
        if not self._stopping.is_set():
            self._stop_reason = reason
        self._stopping.set()

    def _stopped_error(self, what: str) -> NetStormError:
        """The error of ``what`` cut short by this node's stop: why it stopped, and which members were
        already gone (often the real cause: a supervisor stops its survivors when one DC dies)."""
        gone = "".join(f"; {why}" for _, why in sorted(self.core.down.items()))
        return NetStormError(f"node {self.node_id} stopped ({self._stop_reason}) {what}{gone}")

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
        return self.core.num_workers

    # ---- the DC's contribution stream ---------------------------------------------------------------

    async def register(self, specs: Sequence[TensorSpec], compression: str = "none", votes: int = 0,
                       bits: int = 0, gia_reuse: int = 1) -> Layout:
        """Fix the layout from the trainer's tensors; the scheduler checks every DC agrees. The job's
        ``compression`` (this node's option or the trainer's) of fp16 sends float chunks as float16; with
        fediac the roots threshold the vote counts at a = ``votes`` (0: derived from the job's workers,
        as the trainer derives it), and the layout hash covers a. A gateway's LAN tier is told a sparse
        compression (and FediAC's ``bits`` and ``gia_reuse``): its rounds then travel on their own wires."""
        layout = job_layout(specs, self.config.chunk_size, compression, self.config.compression,
                            votes=votes or self.config.fediac_votes, workers=self.num_workers)
        if self.layout is not None:
            if layout.hash != self.layout.hash:
                raise LayoutMismatch(f"node {self.node_id} already serves layout {self.layout.hash}; this trainer "
                                     f"registers {layout.hash} (different tensors, shapes or dtypes)")
            return self.layout
        assert self.control is not None
        # the job's layout waits for a majority of its DCs' trainers to agree: as long as an iteration may take
        await self.control.check_layout(layout.hash, timeout=self.config.iteration_timeout)
        if self.layout is not None:  # a concurrent registration won
            return await self.register(specs, compression, votes, bits, gia_reuse)
        # a DC admitted into a running job starts at its boundary iteration
        self.core.first_iteration = max(self.core.first_iteration, getattr(self.control, "first_iteration", 0))
        self._apply(self.core.register(layout, self._links(), self._now()))
        if self.edge is not None and COMPRESSION.get_entry(compression).sparse and any(s.name == VOTES for s in specs):
            self.edge.compressed(layout, CompressionOptions(compression, bits=bits,
                                                            votes=votes or self.config.fediac_votes,
                                                            gia_reuse=max(1, gia_reuse)))
        for inbound in list(self._inbound):
            self._check_peer_layout(inbound)
        for inbound in list(self._inbound):
            inbound.resume()  # connections that stopped at a chunk before the layout existed
        log.info("node %d: layout %s, %d tensors, %d chunks, %d elements", self.node_id, layout.hash,
                 len(layout.tensors), len(layout.chunks), layout.total)
        return layout

    def next_iteration(self) -> int:
        """The iteration the next contribution of every tensor belongs to; error if they diverge."""
        return self.core.next_iteration()

    def pull_iteration(self, key: int) -> int:
        """The iteration the next ``collect`` of tensor ``key`` returns."""
        return self.core.pull_iteration(key)

    async def contribute(self, key: int, values: np.ndarray | None, *, iteration: int | None = None,
                         lan: bool = True) -> int:
        """This DC's values for tensor ``key`` in its next iteration (None contributes zeros).

        This is the hook for any source of the DC's contribution (the trainer endpoint, or the LAN edge
        aggregator): ``iteration``, when given, must be the tensor's next one. The iteration's policy
        is bound before the contribution enters the core. ``lan=False`` leaves the gateway's LAN workers
        out (the model hand-over to an admitted DC is no gradient of theirs).
        """
        iteration = self.core.open_contribution(key, iteration, self._now())
        self._rearm()
        self._check(iteration)
        await self.ensure_policy(iteration)
        self._check(iteration)
        if self.edge is not None and lan:
            assert self.layout is not None
            sizes = [t.size for t in self.layout.tensors]
            parts = self.layout.key_parts(key)
            try:
                if len(parts) > 1 and self.config.edge_overlap:
                    # a tensor of several chunks: each chunk goes up as soon as the LAN summed it
                    def hand(part: int, summed: np.ndarray) -> None:
                        self._check(iteration)
                        self._apply(self.core.contribute_part(key, iteration, part, summed, self._links(),
                                                              self._now()))

                    await self.edge.combine_parts(iteration, key, values, sizes, parts, hand)
                    return iteration
                values = await self.edge.combine(iteration, key, values, sizes)
            except NetStormError as exc:
                # the LAN tier failed this iteration (typed): it fails here at once, and the gateway is told
                self._apply(self.core.contribution_failed(
                    iteration, f"iteration {iteration}: node {self.node_id}'s LAN tier failed: {exc}", self._now()))
                raise
            self._check(iteration)
        self._apply(self.core.contribute(key, iteration, values, self._links(), self._now()))
        return iteration

    async def contribute_many(self, iteration: int, items: Sequence[tuple[int, np.ndarray | None]]) -> None:
        """This DC's values of many tensors, each in its next iteration ``iteration``: ``contribute`` for each,
        as one event of the core when no gateway's LAN tier adds to them (a push of a model of many small
        tensors must not cost a turn of the node's machinery per tensor)."""
        if self.edge is not None:
            for key, values in items:
                await self.contribute(key, values, iteration=iteration)
            return
        now = self._now()
        for key, _ in items:
            self.core.open_contribution(key, iteration, now)
        self._rearm()
        self._check(iteration)
        await self.ensure_policy(iteration)
        self._check(iteration)
        assert self.layout is not None
        layout = self.layout
        small: list[tuple[int, np.ndarray | None]] = []  # small tensors: up to PIECE elements in one event
        elements = 0
        for index, (key, values) in enumerate(items):
            parts = layout.key_parts(key)
            large = values is not None and values.size > pieces.PIECE
            if len(parts) == 1 and not large:
                small.append((key, values))
                elements += layout.tensors[key].size
                if index + 1 < len(items) and elements < pieces.PIECE:
                    continue
            if small:
                await self._between(iteration, index + 1 - len(small) - (len(parts) > 1 or large))
                actions, error = self.core.contribute_many(iteration, small, self._links(), self._now())
                self._apply(actions)
                if error is not None:
                    raise error
                small, elements = [], 0
            if len(parts) > 1 or large:
                flat = values.reshape(-1) if values is not None else None
                spans = parts if len(parts) > 1 else pieces.spans(layout.tensors[key].size)
                if self.core.key_next(key) != iteration:
                    raise ChunkError(f"tensor {layout.tensors[key].name!r}: contribution for iteration {iteration}, "
                                     f"but its next iteration is {self.core.key_next(key)}")
                for part, (start, stop) in enumerate(spans):
                    await self._between(iteration, index + part)
                    piece = None if flat is None else flat[start:stop]
                    if len(parts) > 1:  # a chunk the tensor fills alone: it goes up at once
                        self._apply(self.core.contribute_part(key, iteration, part, piece, self._links(),
                                                              self._now()))
                    else:
                        assert piece is not None
                        self.core.contribute_piece(key, iteration, start, piece)
                if len(parts) == 1:  # summed in pieces: counted whole, its chunks go up now
                    self._apply(self.core.contribute(key, iteration, None, self._links(), self._now()))

    async def _between(self, iteration: int, before: int) -> None:
        """A turn of the loop between two pieces of a push (none before the first): a model-sized push
        does not hold the heartbeat back; the iteration may have failed meanwhile."""
        if before:
            await pieces.turn()
            self._check(iteration)

    async def collect(self, keys: Sequence[int], sink: Callable[[int, np.ndarray], None]) -> int:
        """Wait for the oldest unpulled iteration of ``keys``; ``sink(key, flat float32 sum)`` reads each."""
        layout = self.layout
        assert layout is not None
        iteration = self.core.collect_iteration(keys)
        await self.wait_keys(iteration, keys)
        result = self.core.result(iteration)
        actions: list[Action] = []
        for key in keys:
            sink(key, result[layout.key_slice(key)])
            actions += self.core.pulled(iteration, key)
        self._apply(actions)
        return iteration

    def release(self, iteration: int, key: int) -> None:
        """Tensor ``key``'s sum of ``iteration`` was read by everyone who reads it (``collect`` does this
        itself; the trainer endpoint's ranks call it once the last of them has read)."""
        self._apply(self.core.pulled(iteration, key))

    async def wait_keys(self, iteration: int, keys: Sequence[int]) -> None:
        """Until every chunk of ``keys`` holds its full sum; IterationFailed (naming why) otherwise. The
        core's timer fails the iteration once it ran past iteration_timeout."""
        self._apply(self.core.track(iteration, self._now()))
        loop = asyncio.get_running_loop()
        while True:
            self._check(iteration)
            if self.core.keys_ready(iteration, keys):
                return
            waiter: asyncio.Future[None] = loop.create_future()
            self._waiters.setdefault(iteration, []).append(waiter)
            await waiter

    async def ensure_policy(self, iteration: int) -> Policy:
        """The policy bound to ``iteration``, asked once from the control plane and bound in the core."""
        policy = self.core.policy(iteration)
        if policy is not None:
            return policy
        waiter = self._policy_waits.get(iteration)
        if waiter is None:
            waiter = asyncio.get_running_loop().create_future()
            self._policy_waits[iteration] = waiter
            self._apply(self.core.policy_wanted(iteration))
        return await waiter

    async def _fetch_policy(self, iteration: int) -> None:
        """Ask the control plane for ``iteration``'s policy; feed the answer to the core and the waiters."""
        waiter = self._policy_waits[iteration]
        assert self.control is not None
        try:
            policy = await self.control.policy_for(iteration, timeout=self.config.connect_timeout)
        except Exception as exc:
            self._policy_unavailable(iteration, waiter, exc)
            return
        except asyncio.CancelledError:
            self._policy_unavailable(iteration, waiter, self._stopped_error(
                f"before the policy of iteration {iteration} arrived"))
            raise
        del self._policy_waits[iteration]
        waiter.set_result(policy)
        self._apply(self.core.policy_received(iteration, policy, self._links(), self._now()))

    def _policy_unavailable(self, iteration: int, waiter: asyncio.Future[Policy], exc: BaseException) -> None:
        del self._policy_waits[iteration]
        self.core.policy_unavailable(iteration)
        waiter.set_exception(exc)
        waiter.exception()  # retrieved: every waiter re-raises it itself

    def contributors(self, iteration: int) -> list[int]:
        """The DCs whose contributions make up ``iteration``'s sums (the nodes of its bound policy)."""
        return self.core.contributors(iteration)

    def contributor_count(self, iteration: int) -> int:
        """Workers whose gradients make up ``iteration``'s sums: over its contributing DCs, each DC's own
        trainer and its gateway's LAN workers (what ``average=True`` divides by)."""
        return self.core.contributor_count(iteration)

    def check(self, iteration: int) -> None:
        """Raise ``iteration``'s failure, typed by its cause, if it failed."""
        self._check(iteration)

    def _check(self, iteration: int) -> None:
        """Raise the iteration's failure, if it failed."""
        failure = self.core.failure(iteration)
        if failure is not None:
            raise _RAISES[failure.cause](failure.reason)

    # ---- faults -------------------------------------------------------------------------------------

    def member_down(self, peer: int, reason: str) -> None:
        """A peer is gone: every iteration in progress fails at once, naming the peer."""
        if self._stopping.is_set():
            return
        self._apply(self.core.member_down(peer, reason, self._now()))

    def vacate(self, reason: str, *, clean: bool = False) -> None:
        """This DC's trainer place is empty (its trainer closed or died after the init round): its iterations
        fail as soon as they are under way anywhere (``PeerLost`` for whoever waits, here and at every
        member), instead of at their timeout, until a replacement inits (``fill``). ``clean``: it said Bye,
        so only the iterations already under way here fail."""
        if not self._stopping.is_set():
            self._apply(self.core.vacate(reason, self._now(), clean=clean))

    def fill(self) -> None:
        """A replacement trainer took the empty place: this DC's part comes again."""
        self._apply(self.core.fill())

    def _peer_vacancy(self, peer: int, iteration: int, reason: str, filled: bool) -> None:
        if not self._stopping.is_set():
            self._apply(self.core.peer_vacancy(peer, iteration, reason, filled, self._now()))

    def _part_wanted(self, peer: int, iteration: int) -> None:
        if not self._stopping.is_set():
            self._apply(self.core.part_wanted(peer, iteration, self._now()))

    def _iteration_lost(self, peer: int, iteration: int, reason: str) -> None:
        """A member's part of ``iteration`` will not come: it fails here at once, naming that member."""
        if self._stopping.is_set():
            return
        self._apply(self.core.iteration_lost(iteration, f"iteration {iteration} failed at node {self.node_id}: "
                                                        f"node {peer}: {reason}", self._now()))

    async def _run_link(self, link: PeerLink) -> None:
        """Run the link to one peer; when it fails, tell the scheduler and reconnect with a growing
        backoff. Only the scheduler declares a member dead (``MemberDown``); then the link stops."""
        delay = RECONNECT_FIRST
        reported = False
        while True:
            sent = link.sent_frames
            try:
                await link.run()
                return
            except PeerError as exc:
                if self._stopping.is_set() or link.peer_id in self.core.down:
                    return
                if self.links.get(link.peer_id) is not link:  # replaced when the peer came back
                    return
                if link.sent_frames > sent:  # it worked for a while: a new outage, not the same one
                    delay, reported = RECONNECT_FIRST, False
                self.stats.errors["link_lost"] += 1
                log.warning("node %d: link to node %d lost (%s); reconnecting in %.1f s", self.node_id,
                            link.peer_id, exc, delay)
                if self.control is not None and not reported:  # once per outage: evidence, not a drumbeat
                    self.control.report_unreachable(link.peer_id, str(exc))
                    reported = True
            try:
                async with asyncio.timeout(delay):
                    await self._stopping.wait()
                return
            except TimeoutError:
                pass
            if link.peer_id in self.core.down or self.links.get(link.peer_id) is not link:
                return
            delay = min(delay * 2, RECONNECT_MAX)

    # ---- data plane ---------------------------------------------------------------------------------

    def _hello(self) -> Hello:
        return Hello(self.node_id, self.layout.hash if self.layout is not None else "")

    def _make_inbound(self, proven: auth.Identity | None = None) -> InboundProtocol:
        protocol = InboundProtocol(on_hello=self._on_hello, on_chunk=self._on_chunk, on_lost=self._on_lost,
                                   max_frame_bytes=self.config.max_frame_bytes, clock=self.clock,
                                   on_admit=self.core.admit, on_made=self._on_made,
                                   hello_timeout=self.config.hello_timeout, frame_timeout=self.config.frame_timeout,
                                   idle_timeout=self.config.idle_timeout, held_timeout=self.config.iteration_timeout)
        protocol.proven = proven.id if proven is not None else None
        self._inbound.add(protocol)
        return protocol

    def _on_made(self, protocol: InboundProtocol) -> None:
        """A new data connection: at most ``max_connections_per_source`` from one address."""
        cap = self.config.max_connections_per_source
        same = sum(1 for p in self._inbound if p.host == protocol.host and p.transport is not None)
        if same > cap:
            protocol.reject(f"more than {cap} connections from {protocol.host}", ErrorCode.PROTOCOL)

    def _on_hello(self, hello: Hello, protocol: InboundProtocol) -> None:
        if protocol.proven is not None and hello.node_id != protocol.proven:
            raise FrameError(f"Hello claims node {hello.node_id} on a connection authenticated as node "
                             f"{protocol.proven}")
        if self.members and hello.node_id not in self.members:
            raise FrameError(f"node {hello.node_id} is not a member of this job (members: {sorted(self.members)})")
        if hello.node_id == self.node_id:
            raise FrameError(f"a peer claims to be node {self.node_id}, which is this node")
        current = self._inbound_by_peer.get(hello.node_id)
        if current is not None and current is not protocol:
            # A member reconnecting after its link failed: the newer connection replaces the older one.
            log.info("node %d: node %d connects again from %s; closing its connection from %s", self.node_id,
                     hello.node_id, protocol.peername, current.peername)
            del self._inbound_by_peer[hello.node_id]
            current.close()
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
        self.stats.received_bytes[peer] += frame_size(header)
        self._apply(self.core.chunk_received(header, payload, t_last_byte, self._links(), self._now()))

    def _on_lost(self, protocol: InboundProtocol, reason: str) -> None:
        self._inbound.discard(protocol)
        peer = protocol.peer_id
        if peer is None or self._inbound_by_peer.get(peer) is not protocol:
            return
        del self._inbound_by_peer[peer]
        # Not a verdict: the peer reconnects if it lives, and the scheduler declares it dead if not.
        log.info("node %d: connection from node %d closed (%s)", self.node_id, peer, reason)

    def _link_progress(self, peer: int, sent: Outgoing | None) -> None:
        """A link sent a frame (or starts idle): the core may move a queued chunk in answer."""
        self._apply(self.core.link_progress(peer, sent.ticket if sent is not None else None, self._links()))

    def _lan_plan(self, plan: LanPlan) -> None:
        """The scheduler planned this DC's LAN tier: kept, and handed to the gateway role when it takes
        plans (``apply_lan_plan(plan)``; ``plan.two_level()`` is its configuration)."""
        self.lan_plan = plan
        apply = getattr(self.edge, "apply_lan_plan", None)
        if apply is not None:
            apply(plan)

    def _believe(self, beliefs: LinkBeliefs) -> None:
        self._apply(self.core.beliefs(beliefs, self._links()))

    def _link_view(self, peer: int) -> LinkView:
        """This node's link to ``peer`` as the path scheduler weighs it: backlog and measured rate."""
        link = self.links.get(peer)
        if link is None:
            return LinkView(backlog_bytes=0, rate_bps=0.0)  # no link: no path starts there
        return LinkView(backlog_bytes=link.backlog_bytes, rate_bps=link.meter.rate_bps)

    def _links(self) -> Mapping[int, LinkState]:
        """A snapshot of every sending link, for the event the core is about to be fed. Each link's state
        is read when the core first asks for it: most events (a chunk that completes nothing) consult no
        link, and building every link's state and queue for each of them cost the hot path for nothing."""
        return _Snapshot(self)

    def _now(self) -> float:
        return asyncio.get_running_loop().time()

    # ---- carrying out the core's actions ------------------------------------------------------------

    def _apply(self, actions: list[Action]) -> None:
        for action in actions:
            if isinstance(action, SendFrame):
                self.links[action.link].enqueue(Outgoing(action.header, action.payload, action.ticket))
                size = frame_size(action.header)
                self._count_wan(action.header.iteration, size)
                self.stats.sent_bytes[action.link] += size
            elif isinstance(action, MoveFrame):
                item = self.links[action.source].take_back(action.ticket)
                self.links[action.target].enqueue(Outgoing(action.header, item.payload, action.ticket))
                self.stats.sent_bytes[action.source] -= frame_size(item.header)
                self.stats.sent_bytes[action.target] += frame_size(action.header)
            elif isinstance(action, KeyDone):
                self._wake(action.iteration)
            elif isinstance(action, IterationDone):
                self._wake(action.iteration)
                self._log_done(action.iteration)
            elif isinstance(action, act.IterationFailed):
                self._wake(action.iteration)
                self.stats.failed[str(action.cause)] += 1
                log.error("node %d: %s", self.node_id, action.reason)
                if self.edge is not None:   # its LAN workers end the iteration too, and go on with the next
                    self.edge.failed(action.iteration)
            elif isinstance(action, Prefetch):
                if self.control is not None:
                    self.control.prefetch(action.iteration)
            elif isinstance(action, AskPolicy):
                self._ask_policy(action.iteration)
            elif isinstance(action, ReportLink):
                if self.control is not None:
                    self.control.report_link(action.report)
            elif isinstance(action, Released):
                self._release(action)
            elif isinstance(action, ReportLost | ReportVacancy | AskPart):
                self._report(action)
        self._rearm()

    def _report(self, action: ReportLost | ReportVacancy | AskPart) -> None:
        """Tell the control plane of an empty trainer place, of an iteration it cost, or ask a member whose
        place is empty for its part (a control plane without these calls, as in tests, is told nothing)."""
        if isinstance(action, ReportLost):
            call = getattr(self.control, "report_iteration_lost", None)
            if call is not None:
                call(action.iteration, action.reason)
        elif isinstance(action, ReportVacancy):
            log.warning("node %d: trainer place %s from iteration %d%s", self.node_id,
                        "taken again" if action.filled else "empty", action.iteration,
                        f" ({action.reason})" if action.reason else "")
            call = getattr(self.control, "report_vacancy", None)
            if call is not None:
                call(action.iteration, action.reason, action.filled)
        else:
            log.warning("node %d: iteration %d is under way here; node %d's trainer place is empty: asked for its part",
                     self.node_id, action.iteration, action.peer)
            call = getattr(self.control, "ask_part", None)
            if call is not None:
                call(action.peer, action.iteration)

    def _count_wan(self, iteration: int, size: int) -> None:
        """Add a frame of ``size`` bytes to its iteration's WAN bytes; only the newest ``WAN_HISTORY``
        iterations are kept."""
        sent = self.wan_sent
        if iteration not in sent and len(sent) >= WAN_HISTORY:
            del sent[min(sent)]
        sent[iteration] = sent.get(iteration, 0) + size

    def wan_bytes(self, iteration: int) -> int:
        """Bytes of chunk frames this node queued on WAN links for ``iteration`` (0 when not held)."""
        return self.wan_sent.get(iteration, 0)

    def _ask_policy(self, iteration: int) -> None:
        if self._tg is None:
            waiter = self._policy_waits[iteration]
            self._policy_unavailable(iteration, waiter, NetStormError(
                f"node {self.node_id} is not running: no policy for iteration {iteration}"))
            return
        fetch = self._tg.create_task(self._fetch_policy(iteration))
        self._fetches.add(fetch)
        fetch.add_done_callback(self._fetches.discard)

    def _release(self, released: Released) -> None:
        if self.edge is not None:
            layout = self.layout
            assert layout is not None
            self.edge.released(released.iteration, [released.result[layout.key_slice(k)].copy()
                                                    for k in range(len(layout.tensors))], released.workers)
        log.debug("node %d: iteration %d released", self.node_id, released.iteration)

    def _wake(self, iteration: int) -> None:
        for waiter in self._waiters.pop(iteration, []):
            if not waiter.done():
                waiter.set_result(None)

    def _rearm(self) -> None:
        """Keep the one timer at the core's next deadline."""
        when = self.core.next_timer()
        if when == self._timer_at:
            return
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._timer_at = when
        if when is not None:
            self._timer = asyncio.get_running_loop().call_at(when, self._on_timer)

    def _on_timer(self) -> None:
        assert self._timer_at is not None
        now = max(self._timer_at, asyncio.get_running_loop().time())  # the loop may run a timer a hair early
        self._timer = None
        self._timer_at = None
        self._apply(self.core.handle_timer(now))

    def _log_done(self, iteration: int) -> None:
        started = self.core.started(iteration)
        policy = self.core.policy(iteration)
        self.stats.done(iteration, self._now() - started if started is not None else 0.0,
                        policy.version if policy is not None else -1)
        forwarding = self.core.forwarding
        log.info("node %d: iteration %d complete in %.3f s (policy version %s, %d chunks sent on auxiliary paths "
                 "so far, %d of them moved from a queue, %d exploring); links %s", self.node_id, iteration,
                 self._now() - started if started is not None else 0.0, policy.version if policy is not None else "?",
                 forwarding.aux_chunks + forwarding.moved_chunks, forwarding.moved_chunks,
                 forwarding.explored_chunks, self._link_usage())

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
