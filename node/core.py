"""The protocol of a general node, without I/O: fed events and a clock, it answers with actions.

``NodeCore`` holds everything a node decides: which iteration the next contribution and the next
collection of every tensor belong to, the policy bound to each iteration (asked once, checked against
the members before it binds), the aggregation state (``ChunkCore``), the completion and failure of each
iteration (failures carry a ``Cause``), the path of every chunk this node sends over a tree edge and
the moves of queued chunks onto auxiliary paths, the passive probes of the links into this node, and
one timer: ``iteration_timeout`` per iteration.

It reads no clock and touches no socket: every event that needs the time takes ``now`` (the shell's
monotonic clock; ``next_timer`` and ``handle_timer`` speak the same clock), and every event that can
send or move frames takes a snapshot of the node's sending links (``LinkState``: backlog, measured rate,
idle, the tickets of the queued frames), as the shell saw them when the event happened. The asyncio
shell (``node/service.py``) moves the bytes, runs the one timer and carries out the actions
(``node/actions.py``); tests drive several cores with plain calls and a fake clock.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
from collections.abc import Callable, Iterable, Mapping, Sequence

import msgspec
import numpy as np

from netstorm.config import Config
from netstorm.control import LinkBeliefs
from netstorm.errors import ChunkError, LayoutError
from netstorm.frames import ChunkHeader
from netstorm.layout import Layout
from netstorm.policy import Policy
from netstorm.probe import ProbeEstimator
from netstorm.sendsched import LinkView, PathScheduler
from node import chunks
from node.actions import (
    Action,
    AskPart,
    AskPolicy,
    Cause,
    IterationDone,
    IterationFailed,
    KeyDone,
    MoveFrame,
    Prefetch,
    Released,
    ReportLink,
    ReportLost,
    ReportVacancy,
    SendFrame,
)
from node.counters import Counters
from node.forwarding import Forwarding
from node.sendqueue import leave_order
from node.vacancy import Vacancies

log = logging.getLogger("netstorm.node")

Path = tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class LinkState:
    """This node's sending link to one peer, as the shell saw it when an event happened."""

    backlog_bytes: int
    """Bytes waiting for the link: queued, and unsent in the kernel at its last sample."""
    rate_bps: float | None
    """Bytes per second it sent at while backlogged, recently (None before a measurement)."""
    idle: bool
    """Nothing queued (the kernel may still hold the last frame's bytes)."""
    queued: tuple[int, ...] = ()
    """Tickets of the frames in its queue, not yet handed to the socket."""


def detour_header(header: ChunkHeader, path: Path) -> ChunkHeader:
    """``header`` sent over the auxiliary ``path`` instead of its tree edge: the first hop is ``path[1]``."""
    return msgspec.structs.replace(header, dst=path[1], is_aux=True, path=path)


@dataclasses.dataclass
class _Tracker:
    """Completion state of one iteration at this node, for its waiters and its timer."""

    started: float
    keys_done: set[int] = dataclasses.field(default_factory=set)
    pulled: set[int] = dataclasses.field(default_factory=set)
    done: bool = False
    failure: IterationFailed | None = None


@dataclasses.dataclass
class _Route:
    """A frame whose path this node chose, until it left its first hop."""

    scheduler: PathScheduler
    path: Path
    header: ChunkHeader
    nbytes: int
    movable: bool
    """Queued on its tree edge as first chosen: a move may still send it over an auxiliary path."""


class _Links:
    """An event's link snapshot, kept current while the core answers the event: frames it queues or
    moves count on their links at once, as they would in the links' own queues."""

    def __init__(self, states: Mapping[int, LinkState]) -> None:
        self._states = states
        self._added: dict[int, int] = {}
        self._queued: dict[int, list[int]] = {}

    def __contains__(self, peer: int) -> bool:
        return peer in self._states

    def peers(self) -> list[int]:
        return list(self._states)

    def view(self, peer: int) -> LinkView:
        state = self._states.get(peer)
        if state is None:
            return LinkView(backlog_bytes=0, rate_bps=0.0)  # no link: no path starts there
        return LinkView(backlog_bytes=state.backlog_bytes + self._added.get(peer, 0), rate_bps=state.rate_bps)

    def idle(self, peer: int) -> bool:
        return self._states[peer].idle and not self._added.get(peer)

    def queued(self, peer: int) -> list[int]:
        tickets = self._queued.get(peer)
        if tickets is None:
            tickets = self._queued[peer] = list(self._states[peer].queued)
        return tickets

    def queue(self, peer: int, ticket: int, nbytes: int) -> None:
        self._added[peer] = self._added.get(peer, 0) + nbytes
        if peer in self._queued:
            self._queued[peer].append(ticket)

    def move(self, ticket: int, source: int, target: int, nbytes: int) -> None:
        self.queued(source).remove(ticket)
        self._added[source] = self._added.get(source, 0) - nbytes
        self.queue(target, ticket, nbytes)


class NodeCore:
    """The protocol state of node ``node_id``; see the module docstring."""

    def __init__(self, node_id: int, config: Config) -> None:
        self.node_id = node_id
        self.config = config
        self.chunks = chunks.ChunkCore(node_id)
        self.forwarding = Forwarding(node_id, config)
        self.members: frozenset[int] = frozenset()
        self.workers: dict[int, int] = {}
        """Member -> workers whose gradients its contribution sums (from the scheduler; 1 when absent)."""
        self.down: dict[int, str] = {}
        """Member -> why it is gone."""
        self.joined = False
        """The control plane gave this node its job (members, workers, config)."""
        self.first_iteration = 0
        self._key_next = Counters(0, 0)
        self._key_pull = Counters(0, 0)
        self._trackers: dict[int, _Tracker] = {}
        self._policies: dict[int, Policy] = {}
        self._asked: set[int] = set()
        self._probes: dict[tuple[int, int], ProbeEstimator] = {}
        self._routes: dict[int, _Route] = {}
        self.vacancies = Vacancies()
        """Empty trainer places, this DC's and its members' (``node/vacancy.py``)."""
        self._tickets = itertools.count()

    @property
    def layout(self) -> Layout | None:
        return self.chunks.layout

    # ---- events: the job and the DC's contribution stream -------------------------------------------

    def join(self, config: Config, members: Iterable[int], workers: Mapping[int, int]) -> None:
        """The control plane's answer to this node's registration: the job's config and members."""
        self.config = config
        self.forwarding = Forwarding(self.node_id, config)
        self.members = frozenset(members)
        self.workers = dict(workers)
        self.joined = True

    def register(self, layout: Layout, links: Mapping[int, LinkState], now: float) -> list[Action]:
        """The layout every DC agreed on; chunks peers sent before it are processed now."""
        self._key_next = Counters(len(layout.tensors), self.first_iteration)
        self._key_pull = Counters(len(layout.tensors), self.first_iteration)
        self.chunks.horizon = self.first_iteration + self.config.max_ahead
        return self._process(self.chunks.set_layout(layout), _Links(links), now)

    def next_iteration(self) -> int:
        """The iteration the next contribution of every tensor belongs to; error if they diverge."""
        layout = self._need_layout()
        low, high = self._key_next.low, self._key_next.high()
        if low != high:
            behind = [layout.tensors[i].name for i in self._key_next.behind()[:5]]
            raise ChunkError(f"tensors are at different iterations ({low}..{high}); not yet pushed for "
                             f"iteration {low}: {', '.join(behind)}")
        return low

    def pull_iteration(self, key: int) -> int:
        """The iteration the next collection of tensor ``key`` returns."""
        return self._key_pull[key]

    def open_contribution(self, key: int, iteration: int | None, now: float) -> int:
        """The iteration the next contribution of tensor ``key`` belongs to (``iteration``, when given,
        must be it); its clock starts now if it has not."""
        layout = self._need_layout()
        if iteration is not None and iteration != self._key_next[key]:
            raise ChunkError(f"tensor {layout.tensors[key].name!r}: contribution for iteration {iteration}, "
                             f"but its next iteration is {self._key_next[key]}")
        iteration = self._key_next[key]
        if not self.window(iteration):
            raise ChunkError(f"tensor {layout.tensors[key].name!r}: a contribution for iteration {iteration} runs "
                             f"more than max_ahead = {self.config.max_ahead} iterations past iteration "
                             f"{self.oldest_unpulled()}, not collected yet (peers would refuse its chunks)")
        self._tracker(iteration, now)
        return iteration

    def contribute(self, key: int, iteration: int, values: np.ndarray | None, links: Mapping[int, LinkState],
                   now: float) -> list[Action]:
        """This DC's values of tensor ``key`` for ``iteration`` (from ``open_contribution``; None: zeros).
        A contribution the aggregation core refuses (it raises) changes no counter."""
        actions = self.chunks.push_local(iteration, key, values)
        self._key_next.step(key)
        self._widen_horizon()
        return self._process(actions, _Links(links), now) + self._under_way(iteration, now)

    def contribute_many(self, iteration: int, items: Sequence[tuple[int, np.ndarray | None]],
                        links: Mapping[int, LinkState], now: float) -> tuple[list[Action], ChunkError | None]:
        """This DC's values of many tensors for ``iteration`` (each opened with ``open_contribution``), in
        order, as one event: a push of n small tensors costs one pass over the node's actions, not n. The
        first tensor the aggregation core refuses stops the batch: the tensors before it count, it and
        those after do not, and the refusal is returned beside the actions of those that counted."""
        chunk_actions: list[chunks.Action] = []
        error: ChunkError | None = None
        for key, values in items:
            if self._key_next[key] != iteration:
                error = ChunkError(f"tensor {self._need_layout().tensors[key].name!r}: contribution for iteration "
                                   f"{iteration}, but its next iteration is {self._key_next[key]}")
                break
            try:
                chunk_actions += self.chunks.push_local(iteration, key, values)
            except ChunkError as exc:
                error = exc
                break
            self._key_next.step(key)
        self._widen_horizon()
        return self._process(chunk_actions, _Links(links), now) + self._under_way(iteration, now), error

    def contribute_part(self, key: int, iteration: int, part: int, values: np.ndarray | None,
                        links: Mapping[int, LinkState], now: float) -> list[Action]:
        """Part ``part`` of this DC's values of tensor ``key`` for ``iteration`` (``layout.key_parts(key)``;
        from ``open_contribution``): its chunk can leave before the tensor's other parts are in. The tensor's
        next contribution belongs to the next iteration once every part is in."""
        actions = self.chunks.push_part(iteration, key, part, values)
        if self.chunks.key_pushed(iteration, key):
            self._key_next.step(key)
            self._widen_horizon()
        return self._process(actions, _Links(links), now) + self._under_way(iteration, now)

    def contribute_piece(self, key: int, iteration: int, start: int, values: np.ndarray) -> None:
        """Elements ``start`` on of this DC's values of tensor ``key`` for ``iteration`` (from
        ``open_contribution``), summed ahead of ``contribute(key, iteration, None, ...)``, which counts the
        tensor: a large tensor is added between turns of the node's loop. No action: nothing can go up yet."""
        if self._key_next[key] != iteration:
            raise ChunkError(f"tensor {self._need_layout().tensors[key].name!r}: contribution for iteration "
                             f"{iteration}, but its next iteration is {self._key_next[key]}")
        self.chunks.add_piece(iteration, key, start, values)

    def key_next(self, key: int) -> int:
        """The iteration the next contribution of tensor ``key`` belongs to."""
        return self._key_next[key]

    def oldest_unpulled(self) -> int:
        """The oldest iteration some tensor has not been collected from yet."""
        return self._key_pull.low if len(self._key_pull) else self.first_iteration

    def window(self, iteration: int) -> bool:
        """A contribution to ``iteration`` is within ``max_ahead`` iterations of the oldest unpulled one,
        so the results this node holds stay bounded."""
        return iteration - self.oldest_unpulled() <= self.config.max_ahead

    def admit(self, header: ChunkHeader) -> bool:
        """Check a chunk's header before anything is allocated for its payload: False when no layout
        exists yet (the shell stops reading until one does: nothing is buffered for a layout that does
        not exist). Raises ChunkError for a chunk index, element count, dtype or iteration no correct peer sends."""
        layout = self.chunks.layout
        if layout is None:
            return False
        self.chunks.check_header(header)  # index, element count and wire dtype
        if header.iteration > self.chunks.horizon + 1:  # a pass-through hop may be one iteration further on
            raise ChunkError(f"chunk {header.chunk} from node {header.origin} for iteration {header.iteration}, far "
                             f"ahead of node {self.node_id} (it accepts up to iteration {self.chunks.horizon})")
        return True

    def _widen_horizon(self) -> None:
        """Peers may send chunks up to ``max_ahead`` iterations past this node's slowest tensor: a peer's
        trainer runs at most that far ahead of its own pulls, which wait for this node's contributions."""
        if len(self._key_next):
            self.chunks.horizon = max(self.chunks.horizon, self._key_next.low + self.config.max_ahead)

    def collect_iteration(self, keys: Sequence[int]) -> int:
        """The iteration a collection of ``keys`` returns: their oldest unpulled one, the same for all."""
        layout = self._need_layout()
        iterations = {self._key_pull[k] for k in keys}
        if len(iterations) != 1:
            raise ChunkError(f"tensors pulled together are at different iterations {sorted(iterations)}")
        iteration = iterations.pop()
        for key in keys:
            if self._key_pull[key] >= self._key_next[key]:
                raise ChunkError(f"tensor {layout.tensors[key].name!r} pulled before it was pushed "
                                 f"(iteration {iteration})")
        return iteration

    def track(self, iteration: int, now: float) -> list[Action]:
        """Someone at this node waits for ``iteration``: its clock starts now if it has not."""
        self._tracker(iteration, now)
        return self._under_way(iteration, now)

    def pulled(self, iteration: int, key: int) -> list[Action]:
        """Tensor ``key``'s sum of ``iteration`` was read; after the last tensor the iteration is released."""
        layout = self._need_layout()
        tracker = self._trackers[iteration]
        self._key_pull.step(key)
        tracker.pulled.add(key)
        if len(tracker.pulled) < len(layout.tensors):
            return []
        result = self.chunks.result(iteration)
        workers = self.contributor_count(iteration)
        self.chunks.release(iteration)
        del self._trackers[iteration]
        return [Released(iteration, result, workers)]

    # ---- events: policies ---------------------------------------------------------------------------

    def policy_wanted(self, iteration: int) -> list[Action]:
        """``iteration`` needs its policy: asked once, until the control plane answers."""
        if iteration in self._asked or iteration in self._policies:
            return []
        self._asked.add(iteration)
        return [AskPolicy(iteration)]

    def policy_unavailable(self, iteration: int) -> None:
        """The control plane could not give ``iteration``'s policy; the next want asks again."""
        self._asked.discard(iteration)

    def policy_received(self, iteration: int, policy: Policy, links: Mapping[int, LinkState],
                        now: float) -> list[Action]:
        """Bind ``iteration`` to ``policy``, unless it names strangers (the iteration fails) or members
        that are gone (it fails as GONE)."""
        self._asked.discard(iteration)
        self._policies[iteration] = policy
        for old in [k for k in self._policies if k < iteration - 2]:
            del self._policies[old]
        self.forwarding.forget_before(policy.version - 1)
        in_policy = set(policy.trees[policy.roots[0]].parent)
        dead = sorted(set(self.down) & in_policy)
        strangers = sorted(in_policy - self.members)
        view = _Links(links)
        if strangers:
            return self._fail(iteration, f"iteration {iteration}: policy version {policy.version} names node(s) "
                                         f"{strangers}, not members of this job", Cause.FAILED, view, now)
        if dead:
            return self._fail(iteration, f"iteration {iteration}: policy version {policy.version} includes "
                                         f"node(s) {dead}, which are gone: {'; '.join(self.down[d] for d in dead)}",
                              Cause.GONE, view, now)
        log.debug("node %d: iteration %d bound to policy version %d", self.node_id, iteration, policy.version)
        return self._process(self.chunks.bind_policy(iteration, policy), view, now) + self._under_way(iteration, now)

    def beliefs(self, beliefs: LinkBeliefs, links: Mapping[int, LinkState]) -> list[Action]:
        """A newer policy was published: detours of older ones follow its rates, and the queued chunks of
        tree edges whose moves were re-planned leave on the new moves' paths in their planned fractions."""
        view = _Links(links)
        actions: list[Action] = []
        for scheduler in self.forwarding.believe(beliefs.version, beliefs.rates, beliefs.amends, beliefs.offload):
            actions += self._move_planned(scheduler, view)
        return actions

    # ---- events: peers and links --------------------------------------------------------------------

    def chunk_received(self, header: ChunkHeader, payload: np.ndarray, t_last_byte: float,
                       links: Mapping[int, LinkState], now: float) -> list[Action]:
        """A hop addressed to this node, its last byte read at ``t_last_byte`` (the synced clock the
        sender stamped ``t_send`` with). Raises ChunkError for input no correct peer sends."""
        actions = self._probe(header, payload.nbytes, t_last_byte)
        actions += self._process(self.chunks.receive(header, payload), _Links(links), now)
        return actions + self._under_way(header.iteration, now)

    def member_down(self, peer: int, reason: str, now: float) -> list[Action]:
        """A peer is gone: every iteration in progress fails at once, naming the peer."""
        if peer in self.down or peer == self.node_id:
            return []
        self.down[peer] = f"node {peer} is gone: {reason}"
        self.vacancies.forget(peer)
        live = self.chunks.live_iterations()
        pending = [k for k, t in self._trackers.items() if t.failure is None and not t.done]
        affected = sorted(set(live) | set(pending))
        if affected:
            log.warning("node %d: node %d is gone (%s); failing iterations %s", self.node_id, peer, reason, affected)
        else:
            log.info("node %d: node %d is gone (%s); no iteration in progress", self.node_id, peer, reason)
        actions: list[Action] = []
        for iteration in affected:
            actions += self._fail(iteration, f"iteration {iteration} failed at node {self.node_id}: node {peer} is "
                                             f"gone ({reason})", Cause.GONE, _Links({}), now)
        return actions

    def iteration_lost(self, iteration: int, reason: str, now: float) -> list[Action]:
        """A DC's part of ``iteration`` will not come (its trainer is gone): the iteration fails at once as a
        lost peer's does (``PeerLost``: retry), unless it is over already."""
        tracker = self._trackers.get(iteration)
        if tracker is not None and (tracker.done or tracker.failure is not None):
            return []
        return self._fail(iteration, reason, Cause.GONE, _Links({}), now)

    # ---- events: empty trainer places ---------------------------------------------------------------

    def vacate(self, reason: str, now: float, *, clean: bool = False) -> list[Action]:
        """This DC's trainer place is empty after the init round (its trainer closed or died; no
        replacement yet): its part of every iteration from its next on will not come. The iterations
        under way here fail at once and are reported, the place's emptiness too, so that, if none was,
        the next fails as soon as it is under way anywhere (``part_wanted``, a peer's chunk, a waiter).
        ``clean`` (the trainer said Bye: its job is over): only the iterations under way fail, and the next
        job's trainers, which may init at the other DCs first, are waited for."""
        if self.vacancies.own is not None or self.chunks.layout is None:
            return []
        if clean:
            running = self._running()
            return self._lose_through(max(running), now) if running else []
        self.vacancies.own, self.vacancies.spent = reason, False
        running = self._running()
        actions = self._lose_through(max(running), now) if running else []
        return [*actions, ReportVacancy(self.oldest_part(), reason)]

    def fill(self) -> list[Action]:
        """A replacement trainer took the empty place: this DC's part comes again from its next iteration."""
        if self.vacancies.own is None:
            return []
        self.vacancies.own = None
        return [ReportVacancy(self.oldest_part(), "", filled=True)]

    def peer_vacancy(self, peer: int, iteration: int, reason: str, filled: bool, now: float) -> list[Action]:
        """Member ``peer`` told its trainer place is empty from ``iteration`` on (``filled``: taken again).
        Its part of the iterations under way here is asked for at once."""
        if peer == self.node_id or peer in self.down:
            return []
        self.vacancies.told(peer, iteration, reason, filled)
        if filled:
            return []
        actions: list[Action] = []
        for running in self._running():
            actions += self._under_way(running, now)
        return actions

    def part_wanted(self, peer: int, iteration: int, now: float) -> list[Action]:
        """Member ``peer`` has ``iteration`` under way and asks for this DC's part: with the place still
        empty and no iteration failed for it yet, every iteration of this DC up to ``iteration`` fails (and
        is reported); taken again, the replacement's push is the part, and nothing happens."""
        if self.vacancies.own is None or self.vacancies.spent or self.chunks.layout is None:
            return []
        return self._lose_through(iteration, now)

    def oldest_part(self) -> int:
        """The oldest iteration this DC's part is not wholly in: every tensor's next contribution is in it or
        later."""
        return self._key_next.low if len(self._key_next) else self.first_iteration

    def contribution_failed(self, iteration: int, reason: str, now: float) -> list[Action]:
        """This DC's contribution to ``iteration`` cannot be made (its gateway's LAN tier failed it: a
        worker missing, an overflow): the iteration fails here at once, so the DC's next push goes to the
        one after it, instead of waiting for its timeout with the push that cannot come."""
        return self._fail(iteration, reason, Cause.FAILED, _Links({}), now)

    def member_up(self, peer: int, workers: int, joins_at: int = -1) -> None:
        """A DC registered into the running job (restarted, or new): a member again, named by policies
        from its boundary iteration ``joins_at`` on (-1: not admitted yet). The joiner contributes to
        that iteration at once, possibly before this node has reached the one before: its chunks wait."""
        self.down.pop(peer, None)
        self.members = self.members | {peer}
        self.workers[peer] = workers
        self.chunks.horizon = max(self.chunks.horizon, joins_at)

    def link_progress(self, peer: int, sent: int | None, links: Mapping[int, LinkState]) -> list[Action]:
        """Link ``peer`` handed frame ``sent`` to its socket (None: it started idle), and is now idle or
        still has frames waiting (``links[peer].idle``). A tree-edge chunk queued on a lagging link may
        move onto an idle one whose auxiliary path delivers it sooner (``PathScheduler.reroute``): paths
        are chosen when chunks are queued, and this lets chunks queued before a link slowed down leave it."""
        if sent is not None:
            route = self._routes.pop(sent, None)
            if route is not None:
                route.scheduler.done(route.path)
        if not self.config.enable_aux_path or self.config.aux_slowdown == 0 or self.config.aux_reroute == 0:
            return []
        view = _Links(links)
        if peer not in view:
            return []
        if view.idle(peer):
            pairs = [(other, peer) for other in view.peers() if other != peer and not view.idle(other)]
        else:
            pairs = [(peer, other) for other in view.peers() if other != peer and view.idle(other)]
        for source, target in pairs:
            move = self._move_last(view, source, target)
            if move is not None:
                return [move]
        return []

    # ---- the timer ----------------------------------------------------------------------------------

    def next_timer(self) -> float | None:
        """When the earliest running iteration times out (None: nothing runs)."""
        deadlines = [t.started for t in self._trackers.values() if not t.done and t.failure is None]
        return min(deadlines) + self.config.iteration_timeout if deadlines else None

    def handle_timer(self, now: float) -> list[Action]:
        """Fail every running iteration older than ``iteration_timeout`` at ``now``."""
        actions: list[Action] = []
        for iteration in sorted(self._trackers):
            tracker = self._trackers.get(iteration)
            if tracker is None or tracker.done or tracker.failure is not None:
                continue
            if tracker.started + self.config.iteration_timeout > now:
                continue
            reason = (f"iteration {iteration} timed out at node {self.node_id} after "
                      f"{self.config.iteration_timeout:g} s: {self.chunks.status(iteration)}")
            failed = self._fail(iteration, reason, Cause.TIMEOUT, _Links({}), now)
            if tracker.failure is None:  # the aggregation core had closed it already: fail its waiters anyway
                failed += self._process([IterationFailed(iteration, reason, Cause.TIMEOUT)], _Links({}), now)
            actions += failed
        return actions

    # ---- queries ------------------------------------------------------------------------------------

    def policy(self, iteration: int) -> Policy | None:
        """The policy ``iteration`` received (None: not asked, not answered, or long forgotten)."""
        return self._policies.get(iteration)

    def failure(self, iteration: int) -> IterationFailed | None:
        tracker = self._trackers.get(iteration)
        return tracker.failure if tracker is not None else None

    def keys_ready(self, iteration: int, keys: Iterable[int]) -> bool:
        """Every chunk of ``keys`` holds its full sum for ``iteration``."""
        tracker = self._trackers.get(iteration)
        return tracker is not None and (tracker.done or tracker.keys_done.issuperset(keys))

    def started(self, iteration: int) -> float | None:
        tracker = self._trackers.get(iteration)
        return tracker.started if tracker is not None else None

    def result(self, iteration: int) -> np.ndarray:
        return self.chunks.result(iteration)

    def contributors(self, iteration: int) -> list[int]:
        """The DCs whose contributions make up ``iteration``'s sums (the nodes of its policy)."""
        policy = self._policies.get(iteration)
        return sorted(policy.nodes) if policy is not None else sorted(self.members)

    def contributor_count(self, iteration: int) -> int:
        """Workers whose gradients make up ``iteration``'s sums: over its contributing DCs, each DC's own
        trainer and its gateway's LAN workers (what ``average=True`` divides by)."""
        return sum(self.workers.get(n, 1) for n in self.contributors(iteration))

    @property
    def num_workers(self) -> int:
        """Workers of the job's live members (each DC's trainer and LAN workers)."""
        return sum(self.workers.get(n, 1) for n in self.members if n not in self.down)

    def movable(self, ticket: int) -> bool:
        """Frame ``ticket`` waits on its tree edge as first chosen, so a move may still send it elsewhere."""
        route = self._routes.get(ticket)
        return route is not None and route.movable

    # ---- internals ----------------------------------------------------------------------------------

    def _need_layout(self) -> Layout:
        layout = self.chunks.layout
        if layout is None:
            raise LayoutError("no tensors registered")
        return layout

    def _tracker(self, iteration: int, now: float) -> _Tracker:
        tracker = self._trackers.get(iteration)
        if tracker is None:
            tracker = _Tracker(started=now)
            self._trackers[iteration] = tracker
        return tracker

    def _process(self, actions: list[chunks.Action], links: _Links, now: float) -> list[Action]:
        """The aggregation core's actions, turned into the node's: paths for the sends, the iteration
        bookkeeping for the rest."""
        out: list[Action] = []
        for action in actions:
            if isinstance(action, chunks.Send):
                out += self._route(action, links, now)
            elif isinstance(action, KeyDone):
                self._tracker(action.iteration, now).keys_done.add(action.key)
                out.append(action)
            elif isinstance(action, IterationDone):
                self._tracker(action.iteration, now).done = True
                out.append(action)
                if self.joined:  # bind the next iteration now, to the newest policy
                    out.append(Prefetch(action.iteration + 1))
            else:
                self._tracker(action.iteration, now).failure = action
                self._skip(action.iteration)
                out.append(action)
        return out

    def _running(self) -> list[int]:
        """The iterations under way at this node and neither complete nor failed: with a waiter, chunks
        held, or part of this DC's contribution in."""
        low = self.oldest_part()
        candidates = set(self.chunks.live_iterations()) | set(self._trackers)
        if len(self._key_next):
            candidates |= set(range(low, self._key_next.high()))
        return sorted(i for i in candidates if self.failure(i) is None and not self._complete(i))

    def _complete(self, iteration: int) -> bool:
        tracker = self._trackers.get(iteration)
        return (tracker is not None and tracker.done) or self.chunks.is_done(iteration)

    def _under_way(self, iteration: int, now: float) -> list[Action]:
        """``iteration`` is under way at this node: with this DC's place empty (and no iteration failed for
        it yet) it fails, with the ones before it that lack this DC's part; members whose places are empty
        are asked for their parts."""
        if (self.vacancies.own is None and not self.vacancies.peers) or self.failure(iteration) is not None:
            return []
        actions: list[Action] = []
        if self.vacancies.own is not None and not self.vacancies.spent:
            actions += self._lose_through(iteration, now)
        if self.vacancies.peers and self.failure(iteration) is None and not self._complete(iteration):
            actions += [AskPart(peer, iteration) for peer in
                        self.vacancies.asks(iteration, self.contributors(iteration), self.oldest_unpulled())]
        return actions

    def _lose_through(self, iteration: int, now: float) -> list[Action]:
        """This DC's place is empty: its iterations from the oldest lacking its part up to ``iteration`` (at
        most ``max_ahead`` + 1 past it: no peer runs further) fail, each reported to every member."""
        reason = self.vacancies.own
        assert reason is not None
        low = self.oldest_part()
        actions: list[Action] = []
        for lost in range(low, min(iteration, low + self.config.max_ahead + 1) + 1):
            if self.failure(lost) is not None or self._complete(lost):
                continue
            actions += self._fail(lost, f"iteration {lost} failed at node {self.node_id}: {reason}", Cause.GONE,
                                  _Links({}), now)
            actions.append(ReportLost(lost, reason))
            self.vacancies.spent = True
        return actions

    def _fail(self, iteration: int, reason: str, cause: Cause, links: _Links, now: float) -> list[Action]:
        return self._process(self.chunks.fail(iteration, reason, cause), links, now)

    def _skip(self, iteration: int) -> None:
        """A failed iteration is over for every tensor: the DC's next push and pull go to the one after."""
        if self.chunks.layout is None:
            return
        self._key_next.raise_to(iteration + 1)
        self._key_pull.raise_to(iteration + 1)
        self.chunks.horizon = max(self.chunks.horizon, iteration + 2)
        self._widen_horizon()
        for old in [k for k, t in self._trackers.items() if k < iteration - 2 and t.failure is not None]:
            del self._trackers[old]

    def _route(self, send: chunks.Send, links: _Links, now: float) -> list[Action]:
        """The path of a chunk this node sends over a tree edge (primary or auxiliary), then its frame."""
        header = send.header
        route: _Route | None = None
        if header.origin == self.node_id and not header.is_aux:
            policy = self._policies.get(header.iteration)
            if policy is not None:
                path, scheduler = self.forwarding.choose(policy, header.final, links.view, send.payload.nbytes,
                                                         header.iteration)
                if len(path) > 2:
                    header = detour_header(header, path)
                route = _Route(scheduler, path, header, send.payload.nbytes, movable=len(path) == 2)
        if header.dst not in links:
            raise ChunkError(f"node {self.node_id} has no link to node {header.dst}")
        if header.dst in self.down:
            return self._fail(header.iteration, f"iteration {header.iteration}: cannot send to "
                                                f"{self.down[header.dst]}", Cause.GONE, links, now)
        ticket = next(self._tickets)
        if route is not None:
            self._routes[ticket] = route
        links.queue(header.dst, ticket, send.payload.nbytes)
        return [SendFrame(header.dst, header, send.payload, ticket)]

    def _last(self, links: _Links, source: int, wanted: Callable[[_Route], bool]) -> int | None:
        """The ticket of the frame that would leave ``source`` last among the routes ``wanted`` accepts."""
        best: tuple[int, int, int] | None = None
        for ticket in links.queued(source):
            route = self._routes.get(ticket)
            if route is not None and wanted(route):
                key = (*leave_order(route.header), ticket)
                if best is None or key > best:
                    best = key
        return best[2] if best is not None else None

    def _move_planned(self, scheduler: PathScheduler, links: _Links) -> list[Action]:
        """Move each detour's fraction of the chunks queued on ``scheduler``'s tree edge, last first."""
        source = scheduler.primary[1]
        if source not in links:
            return []

        def ours(route: _Route) -> bool:
            return route.movable and route.scheduler is scheduler

        queued = sum(1 for t in links.queued(source) if (r := self._routes.get(t)) is not None and ours(r))
        actions: list[Action] = []
        for path, fraction in scheduler.offload:
            if path[1] not in links or path[1] in self.down:
                continue
            for _ in range(round(fraction * queued)):
                ticket = self._last(links, source, ours)
                if ticket is None:
                    return actions
                scheduler.take(path)
                actions.append(self._detour(links, source, ticket, path))
        return actions

    def _move_last(self, links: _Links, source: int, target: int) -> MoveFrame | None:
        """Move the tree-edge chunk that would leave ``source`` last onto a detour through ``target``, if
        that delivers it sooner."""
        ticket = self._last(links, source, lambda r: r.movable and r.header.dst == source)
        if ticket is None or target in self.down:
            return None
        route = self._routes[ticket]
        path = route.scheduler.reroute(links.view, route.nbytes, target)
        if path is None:
            return None
        return self._detour(links, source, ticket, path)

    def _detour(self, links: _Links, source: int, ticket: int, path: Path) -> MoveFrame:
        """Frame ``ticket``, queued on ``source`` for its tree edge, leaves over the auxiliary ``path``."""
        route = self._routes[ticket]
        self.forwarding.moved_chunks += 1
        route.header = detour_header(route.header, path)
        route.path = path
        route.movable = False
        links.move(ticket, source, path[1], route.nbytes)
        return MoveFrame(ticket, source, path[1], route.header)

    def _probe(self, header: ChunkHeader, nbytes: int, t_last_byte: float) -> list[Action]:
        """Feed the hop's estimator. Not in this node's first iteration: its connections are new, TCP's
        windows are still opening and reports read low, and alone such reports re-planned runs whose
        rates were exact by the end of the first iteration."""
        if not self.config.enable_awareness or not self.joined or header.iteration <= self.first_iteration:
            return []
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
            return []
        if report is None:
            return []
        log.debug("node %d: link %d->%d measured %.1f Mbit/s", self.node_id, report.src, report.dst, report.mbit_s)
        return [ReportLink(report)]
