"""The node core by plain calls: no sockets, no event loop, a fake clock.

A policy is asked once and binds only if it names live members; a dead peer fails the iterations in
progress as GONE; an iteration fails as TIMEOUT when the fake clock passes its deadline; cores wired
together in memory sum exactly; the path of a chunk and the moves of queued chunks follow the link
snapshots fed with the events; received hops make link reports after the first iteration.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Callable

import msgspec
import numpy as np
import pytest

from netstorm.config import Config
from netstorm.control import LinkBeliefs
from netstorm.errors import ChunkError, LayoutError
from netstorm.frames import ChunkHeader
from netstorm.layout import Layout, TensorSpec
from netstorm.planning.plan import plan
from netstorm.policy import Policy
from node.actions import (
    Action,
    AskPolicy,
    Cause,
    IterationDone,
    IterationFailed,
    KeyDone,
    MoveFrame,
    Prefetch,
    Released,
    ReportLink,
    SendFrame,
)
from node.core import LinkState, NodeCore
from node.sendqueue import leave_order

MESH = [1, 2, 3, 4]
RATES = {(a, b): 10.0 * (a + 2 * b) for a in MESH for b in MESH if a != b}
"""Mbit/s of every directed link of a four-DC mesh."""
SPECS = [TensorSpec("conv", (40, 30), "float32"), TensorSpec("fc", (900,), "float32"),
         TensorSpec("bias", (7,), "float32")]
CONFIG = Config(chunk_size=300, iteration_timeout=20.0)
STAR = plan(RATES, topology="star", version=0)
"""Every DC sends straight to the root, node 4; node 2's tree edge (2, 4) has detours via 3 and via 1."""


def layout_of(config: Config = CONFIG) -> Layout:
    return Layout.build(SPECS, config.chunk_size)


def joined(node: int, config: Config = CONFIG, members: list[int] = MESH) -> NodeCore:
    core = NodeCore(node, config)
    core.join(config, members, {})
    assert core.register(layout_of(config), {}, 0.0) == []
    return core


def idle_links(node: int, members: list[int] = MESH, rate: float | None = None) -> dict[int, LinkState]:
    return {p: LinkState(0, rate, True) for p in members if p != node}


def push_all(core: NodeCore, links: dict[int, LinkState], now: float, value: float = 1.0) -> list[Action]:
    layout = core.layout
    assert layout is not None
    actions: list[Action] = []
    for key, spec in enumerate(layout.tensors):
        iteration = core.open_contribution(key, None, now)
        actions += core.contribute(key, iteration, np.full(spec.size, value, np.float32), links, now)
    return actions


def of(kind: type, actions: list[Action]) -> list:
    return [a for a in actions if isinstance(a, kind)]


class Mesh:
    """Cores joined into one job, their links as in-memory queues drained one frame at a time.

    A frame leaves its queue in the links' order (``leave_order``), is stamped with the fake clock as
    it leaves and arrives ``bytes / rate`` later; every event carries the snapshot of the node's queues.
    """

    def __init__(self, config: Config, policies: Callable[[int], Policy], ids: list[int] = MESH,
                 rate_bps: Callable[[int, int], float] = lambda a, b: 1e6, seed: int = 0) -> None:
        self.config = config
        self.policies = policies
        self.rate_bps = rate_bps
        self.rng = random.Random(seed)
        self.now = 0.0
        self.cores = {i: NodeCore(i, config) for i in ids}
        self.queues: dict[int, dict[int, list[SendFrame]]] = {i: {p: [] for p in ids if p != i} for i in ids}
        self.events: dict[int, list[Action]] = {i: [] for i in ids}
        self.layout = layout_of(config)
        for i, core in self.cores.items():
            core.join(config, ids, {})
            self.take(i, core.register(self.layout, self.links(i), self.now))

    def links(self, node: int) -> dict[int, LinkState]:
        return {p: LinkState(sum(f.payload.nbytes for f in q), self.rate_bps(node, p), not q,
                             tuple(f.ticket for f in q)) for p, q in self.queues[node].items()}

    def take(self, node: int, actions: list[Action]) -> None:
        for action in actions:
            if isinstance(action, SendFrame):
                assert action.header.src == node and action.link == action.header.dst
                self.queues[node][action.link].append(action)
            elif isinstance(action, MoveFrame):
                queue = self.queues[node][action.source]
                frame = next(f for f in queue if f.ticket == action.ticket)
                queue.remove(frame)
                self.queues[node][action.target].append(SendFrame(action.target, action.header, frame.payload,
                                                                  action.ticket))
            elif isinstance(action, AskPolicy):
                self.events[node].append(action)
                self.take(node, self.cores[node].policy_received(action.iteration, self.policies(action.iteration),
                                                                 self.links(node), self.now))
            else:
                self.events[node].append(action)

    def contribute(self, node: int, flat: np.ndarray) -> int:
        core = self.cores[node]
        iteration = -1
        for key in range(len(self.layout.tensors)):
            iteration = core.open_contribution(key, None, self.now)
            self.take(node, core.policy_wanted(iteration))
            self.take(node, core.contribute(key, iteration, flat[self.layout.key_slice(key)], self.links(node),
                                            self.now))
        return iteration

    def run(self) -> None:
        """Deliver until every queue is empty, from a random busy link each step."""
        while True:
            busy = [(n, p) for n, queues in self.queues.items() for p, q in queues.items() if q]
            if not busy:
                return
            node, peer = busy[self.rng.randrange(len(busy))]
            queue = self.queues[node][peer]
            frame = min(queue, key=lambda f: (*leave_order(f.header), f.ticket))
            queue.remove(frame)
            header = frame.header.hop(frame.header.src, frame.header.dst, self.now)
            self.now += frame.payload.nbytes / self.rate_bps(node, peer)
            self.take(peer, self.cores[peer].chunk_received(header, frame.payload.copy(), self.now,
                                                            self.links(peer), self.now))
            self.take(node, self.cores[node].link_progress(peer, frame.ticket, self.links(node)))

    def collect(self, node: int) -> np.ndarray:
        core = self.cores[node]
        keys = list(range(len(self.layout.tensors)))
        iteration = core.collect_iteration(keys)
        assert core.failure(iteration) is None
        assert core.keys_ready(iteration, keys)
        out = core.result(iteration).copy()
        for key in keys:
            self.take(node, core.pulled(iteration, key))
        return out


# ---- policies: asked once, bound when they name live members ---------------------------------------------------


def test_a_policy_is_asked_once_and_asked_again_after_the_control_plane_failed():
    core = joined(2)
    assert core.policy_wanted(0) == [AskPolicy(0)]
    assert core.policy_wanted(0) == []  # asked, not yet answered
    core.policy_unavailable(0)
    assert core.policy_wanted(0) == [AskPolicy(0)]
    core.policy_received(0, STAR, idle_links(2), 0.0)
    assert core.policy_wanted(0) == []
    assert core.policy(0) is STAR
    assert core.contributors(0) == [1, 2, 3, 4]


def test_a_bound_policy_sends_the_contribution_up_its_tree():
    core = joined(2)
    links = idle_links(2)
    layout = core.layout
    assert layout is not None
    before = push_all(core, links, 0.0)
    assert of(SendFrame, before) == []  # no policy yet: the contribution waits in the core
    sends = of(SendFrame, core.policy_received(0, STAR, links, 0.0))
    assert [s.link for s in sends] == [4] * len(layout.chunks)  # a leaf of the star
    assert sorted(s.header.chunk for s in sends) == list(range(len(layout.chunks)))
    assert len({s.ticket for s in sends}) == len(sends)
    assert all(s.header.version == STAR.version and not s.header.is_aux for s in sends)


def test_a_policy_naming_strangers_fails_the_iteration_and_the_next_contribution_moves_on():
    core = joined(2, members=[1, 2, 4])
    core.track(0, 0.0)
    [failed] = core.policy_received(0, STAR, idle_links(2, [1, 2, 4]), 0.0)
    assert isinstance(failed, IterationFailed) and failed.cause is Cause.FAILED
    assert "names node(s) [3], not members of this job" in failed.reason
    assert core.failure(0) == failed
    assert core.next_iteration() == 1 and core.pull_iteration(0) == 1
    assert core.next_timer() is None  # a failed iteration has no deadline


def test_a_policy_including_a_dead_member_fails_the_iteration_as_gone():
    core = joined(2)
    assert core.member_down(3, "connection closed", 0.0) == []  # nothing in progress yet
    assert core.num_workers == 3
    [failed] = core.policy_received(0, STAR, idle_links(2), 0.0)
    assert isinstance(failed, IterationFailed) and failed.cause is Cause.GONE
    assert "includes node(s) [3], which are gone: node 3 is gone: connection closed" in failed.reason


# ---- failures: a dead peer, the timer ---------------------------------------------------------------------------


def test_a_peer_going_down_mid_iteration_fails_it_as_gone_naming_peer_and_iteration():
    mesh = Mesh(CONFIG, lambda k: STAR)
    rng = np.random.default_rng(0)
    for node in (1, 2):
        mesh.contribute(node, rng.integers(-9, 9, mesh.layout.total).astype(np.float32))
    mesh.run()
    root = mesh.cores[4]
    assert of(IterationDone, mesh.events[4]) == []  # node 3 has not contributed
    failed = root.member_down(3, "its connection closed", mesh.now)
    assert failed == [IterationFailed(0, "iteration 0 failed at node 4: node 3 is gone (its connection closed)",
                                      Cause.GONE)]
    assert root.member_down(3, "again", mesh.now) == []
    assert root.down == {3: "node 3 is gone: its connection closed"}
    assert root.failure(0) == failed[0] and root.next_iteration() == 1
    # node 3's chunks, arriving later for the failed iteration, are ignored, not an error
    mesh.contribute(3, np.ones(mesh.layout.total, np.float32))
    mesh.run()
    assert of(IterationDone, mesh.events[4]) == []


def test_an_iteration_times_out_when_the_fake_clock_passes_its_deadline():
    config = CONFIG.replace(iteration_timeout=5.0)
    core = joined(2, config)
    links = idle_links(2)
    push_all(core, links, 100.0)
    assert core.next_timer() == 105.0
    assert core.handle_timer(104.999) == []
    [failed] = core.handle_timer(105.0)
    assert isinstance(failed, IterationFailed) and failed.cause is Cause.TIMEOUT
    assert failed.reason.startswith("iteration 0 timed out at node 2 after 5 s: waiting for its policy")
    assert core.failure(0) == failed and core.next_timer() is None
    # the next iteration's clock starts with its first contribution, and a waiter alone starts one too
    core.open_contribution(0, None, 200.0)
    core.track(7, 150.0)
    assert core.next_timer() == 155.0


def test_a_completed_iteration_disarms_its_timer_and_prefetches_the_next_policy():
    mesh = Mesh(CONFIG, lambda k: STAR)
    for node in MESH:
        mesh.contribute(node, np.ones(mesh.layout.total, np.float32))
    assert all(core.next_timer() == CONFIG.iteration_timeout for core in mesh.cores.values())
    mesh.run()
    for node, core in mesh.cores.items():
        assert core.next_timer() is None
        events = mesh.events[node]
        assert of(IterationDone, events) == [IterationDone(0)]
        assert of(Prefetch, events) == [Prefetch(1)]
        assert events.index(IterationDone(0)) < events.index(Prefetch(1))
        assert sorted(k.key for k in of(KeyDone, events)) == list(range(len(SPECS)))


# ---- exact sums --------------------------------------------------------------------------------------------------


def test_cores_wired_in_memory_sum_exactly_over_policy_changes_and_detours():
    """A new topology every iteration, half of every tree link's chunks offloaded onto a detour in even
    iterations (intermediate cores forward them), delivery from a random link each step."""
    base = plan(RATES, topology="fapt", num_roots=2)
    offload = {link: ((paths[1], 0.5),) for link, paths in base.aux_paths.items()
               if link in base.tree_links() and len(paths) > 1}
    assert offload

    def policies(k: int) -> Policy:
        topology = plan(RATES, topology=["fapt", "star", "mst", "fapt1"][k % 4], num_roots=2, version=k)
        return dataclasses.replace(topology, offload=offload if k % 2 == 0 and topology.roots == base.roots else {})

    config = CONFIG.replace(enable_aux_path=True)
    mesh = Mesh(config, policies, seed=3)
    rng = np.random.default_rng(4)
    for k in range(4):
        values = {n: rng.integers(-500, 500, mesh.layout.total).astype(np.float32) for n in MESH}
        for node, flat in values.items():
            assert mesh.contribute(node, flat) == k
        mesh.run()
        expected = np.sum(list(values.values()), axis=0, dtype=np.float32)
        for node in MESH:
            np.testing.assert_array_equal(mesh.collect(node), expected)
            [released] = of(Released, mesh.events[node])[-1:]
            assert released.iteration == k and released.workers == 4
            np.testing.assert_array_equal(released.result, expected)
    assert sum(c.forwarding.aux_chunks for c in mesh.cores.values()) > 0
    for core in mesh.cores.values():
        assert core.chunks.live_iterations() == []
        for scheduler in core.forwarding._schedulers.values():  # every chosen path was released on sending
            assert all(count == 0 for count in scheduler.in_flight.values()), scheduler.in_flight


def test_contributions_and_collections_follow_each_tensors_own_iterations():
    core = NodeCore(2, CONFIG)
    with pytest.raises(LayoutError, match="no tensors registered"):
        core.next_iteration()
    core = joined(2)
    core.open_contribution(0, None, 0.0)
    core.contribute(0, 0, None, idle_links(2), 0.0)
    with pytest.raises(ChunkError, match="tensors are at different iterations"):
        core.next_iteration()
    with pytest.raises(ChunkError, match="contribution for iteration 0, but its next iteration is 1"):
        core.open_contribution(0, 0, 0.0)
    assert core.open_contribution(1, 0, 0.0) == 0
    with pytest.raises(ChunkError, match="pulled before it was pushed"):
        core.collect_iteration([0, 1])
    assert core.collect_iteration([0]) == 0


# ---- paths and moves from link snapshots ----------------------------------------------------------------------------


PATHS = CONFIG.replace(enable_aux_path=True, primary_busy_bound=1, auxiliary_queue_length=1, aux_slowdown=0.3)


def test_a_lagging_primary_sends_chunks_over_detours_and_a_punctual_one_keeps_them():
    def first_hops(primary_bps: float) -> list[int]:
        core = joined(2, PATHS)
        links = {4: LinkState(0, primary_bps, True), 3: LinkState(0, 1e9, True), 1: LinkState(0, 1e9, True)}
        core.policy_received(0, STAR, links, 0.0)
        return [s.link for s in of(SendFrame, push_all(core, links, 0.0))]

    planned_bps = STAR.rates[(2, 4)] * 1e6 / 8
    chunks = len(layout_of(PATHS).chunks)
    assert first_hops(planned_bps) == [4] * chunks
    # two chunks in flight on the primary pass its bound; then each detour takes as many as it may hold
    assert first_hops(1.0) == [4, 4, 3, 1] + [4] * (chunks - 4)


def test_a_detoured_chunk_carries_its_path_and_releases_it_once_sent():
    core = joined(2, PATHS)
    links = {4: LinkState(0, 1.0, True), 3: LinkState(0, 1e9, True), 1: LinkState(0, 1e9, True)}
    core.policy_received(0, STAR, links, 0.0)
    sends = of(SendFrame, push_all(core, links, 0.0))
    detour = sends[2]
    assert detour.header.is_aux and detour.header.path == (2, 3, 4) and detour.header.final == 4
    [scheduler] = core.forwarding._schedulers.values()
    assert scheduler.in_flight[(2, 3, 4)] == 1
    core.link_progress(3, detour.ticket, links)
    assert scheduler.in_flight[(2, 3, 4)] == 0


REROUTE = CONFIG.replace(enable_aux_path=True, primary_busy_bound=10_000, auxiliary_queue_length=2,
                         aux_slowdown=0.3, aux_reroute=1.0)


def queued_on_the_primary(config: Config) -> tuple[NodeCore, list[SendFrame]]:
    core = joined(2, config)
    core.policy_received(0, STAR, idle_links(2), 0.0)
    sends = of(SendFrame, push_all(core, idle_links(2), 0.0))
    assert {s.link for s in sends} == {4} and all(core.movable(s.ticket) for s in sends)
    return core, sends


def test_a_link_running_idle_takes_the_last_chunk_queued_on_a_lagging_edge():
    core, sends = queued_on_the_primary(REROUTE)
    backlog = sum(s.payload.nbytes for s in sends)
    tickets = tuple(s.ticket for s in sends)
    last = max(sends, key=lambda s: leave_order(s.header)).ticket

    def links(primary_bps: float) -> dict[int, LinkState]:
        return {4: LinkState(backlog, primary_bps, False, tickets), 3: LinkState(0, 1e9, True),
                1: LinkState(0, 1e9, False)}

    assert core.link_progress(3, None, links(STAR.rates[(2, 4)] * 1e6 / 8)) == []  # the edge keeps its plan
    [move] = core.link_progress(3, None, links(1.0))
    assert isinstance(move, MoveFrame)
    assert (move.ticket, move.source, move.target) == (last, 4, 3)
    assert move.header.is_aux and move.header.path == (2, 3, 4) and move.header.dst == 3
    assert not core.movable(last) and core.forwarding.moved_chunks == 1
    # a busy link that sent a frame hands its last queued chunk to an idle one the same way
    [second] = core.link_progress(4, tickets[0], links(1.0))
    assert isinstance(second, MoveFrame) and second.source == 4 and second.ticket not in (last, tickets[0])


def test_moves_replanned_for_a_running_iteration_move_their_fraction_of_the_queued_chunks():
    core, sends = queued_on_the_primary(CONFIG.replace(enable_aux_path=True, primary_busy_bound=10_000))
    links = {4: LinkState(0, None, False, tuple(s.ticket for s in sends)), 3: LinkState(0, None, True),
             1: LinkState(0, None, True)}
    moves = {(2, 4): (((2, 3, 4), 0.5),)}
    actions = core.beliefs(LinkBeliefs(version=1, rates=RATES, amends=0, offload=moves), links)
    moved = of(MoveFrame, actions)
    assert len(moved) == len(actions) == round(0.5 * len(sends))
    assert all(m.source == 4 and m.target == 3 and m.header.path == (2, 3, 4) for m in moved)
    # the last ones move first: those that would have waited longest
    order = sorted(sends, key=lambda s: leave_order(s.header))
    assert {m.ticket for m in moved} == {s.ticket for s in order[len(order) - len(moved):]}


# ---- probes -------------------------------------------------------------------------------------------------------


def test_received_hops_report_their_links_after_the_first_iteration():
    config = CONFIG.replace(probe_chunk_size=100, probe_chunk_num=2, probe_window=0.0, enable_aux_path=False)
    mbit = {(a, b): float(a + b) for a in MESH for b in MESH if a != b}
    mesh = Mesh(config, lambda k: dataclasses.replace(STAR, version=k),
                rate_bps=lambda a, b: mbit[(a, b)] * 1e6 / 8)
    for k in range(3):
        for node in MESH:
            mesh.contribute(node, np.ones(mesh.layout.total, np.float32))
        mesh.run()
        for node in MESH:
            mesh.collect(node)
        if k == 0:
            assert not any(of(ReportLink, e) for e in mesh.events.values())  # TCP windows still opening
    reports = [r.report for events in mesh.events.values() for r in of(ReportLink, events)]
    assert {(r.src, r.dst) for r in reports} == {(n, 4) for n in (1, 2, 3)} | {(4, n) for n in (1, 2, 3)}
    for report in reports:
        assert report.mbit_s == pytest.approx(mbit[(report.src, report.dst)])


def test_the_core_imports_neither_the_shell_nor_the_transport():
    import subprocess
    import sys

    code = ("import sys, node.core; "
            "print(sorted(m for m in ('node.peers', 'node.service', 'node.control_client') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    assert out.stdout.strip() == "[]"


# ---- bookkeeping that cannot lie; hostile headers refused before anything is allocated -------------

def test_a_refused_contribution_changes_no_counter() -> None:
    core = joined(1)
    core.policy_received(0, STAR, idle_links(1), 0.0)
    layout = core.layout
    assert layout is not None
    iteration = core.open_contribution(0, None, 0.0)
    with pytest.raises(ChunkError, match="values for"):  # the wrong number of values
        core.contribute(0, iteration, np.ones(layout.tensors[0].size + 1, np.float32), idle_links(1), 0.0)
    assert core.key_next(0) == 0 and core.next_iteration() == 0
    push_all(core, idle_links(1), 0.0)  # the same tensor once more, right this time: counted once
    assert core.next_iteration() == 1


def test_chunk_headers_are_checked_before_their_payload_exists() -> None:
    send = of(SendFrame, push_all(_bound(joined(2)), idle_links(2), 0.0))[0]
    header = send.header
    fresh = NodeCore(4, CONFIG)
    fresh.join(CONFIG, MESH, {})
    assert fresh.admit(header) is False  # no layout yet: the shell stops reading, nothing is buffered
    core = joined(4)
    assert core.admit(header) is True
    with pytest.raises(ChunkError, match="layout says"):
        core.admit(_with(header, count=16 * 1024 * 1024))
    with pytest.raises(ChunkError, match="out of range"):
        core.admit(_with(header, chunk=len(layout_of().chunks) + 5))
    with pytest.raises(ChunkError, match="far ahead"):
        core.admit(_with(header, iteration=10**9))


def test_peers_may_run_max_ahead_iterations_past_this_node_and_no_further() -> None:
    for ahead in (0, 1, 3):
        config = CONFIG.replace(max_ahead=ahead)
        core = joined(4, config)
        header = of(SendFrame, push_all(_bound(joined(2, config)), idle_links(2), 0.0))[0].header
        assert core.admit(_with(header, iteration=ahead))
        with pytest.raises(ChunkError, match="far ahead"):
            core.admit(_with(header, iteration=ahead + 2))
        assert core.window(ahead) and not core.window(ahead + 1)


def _bound(core: NodeCore) -> NodeCore:
    core.policy_received(0, STAR, idle_links(core.node_id), 0.0)
    return core


def _with(header: ChunkHeader, **changes: int) -> ChunkHeader:
    return msgspec.structs.replace(header, **changes)


def test_a_contribution_past_the_window_is_refused_before_it_counts() -> None:
    # Pushing two iterations ahead used to reach peers as chunks beyond their horizon, which they refused
    # by closing the connection; the node itself now refuses it, and no counter moves.
    core = joined(1, CONFIG.replace(max_ahead=1))
    for iteration in (0, 1):
        core.policy_received(iteration, STAR, idle_links(1), 0.0)
        push_all(core, idle_links(1), 0.0)
    with pytest.raises(ChunkError, match=r"iteration 2 runs more than max_ahead = 1 iterations past iteration 0"):
        core.open_contribution(0, None, 0.0)
    assert core.next_iteration() == 2 and core.started(2) is None


def test_a_contribution_that_cannot_be_made_fails_the_iteration_at_once_and_the_next_moves_on() -> None:
    """A gateway's LAN sum failed: the iteration fails here at once (no waiting out its timeout with a
    push that cannot come), once, and every tensor's next push and pull go to the next iteration."""
    core = joined(1)
    core.policy_received(0, STAR, idle_links(1), 0.0)
    iteration = core.open_contribution(0, None, 1.0)
    [failed] = core.contribution_failed(iteration, "iteration 0: node 1's LAN tier failed: worker 1 missing", 2.0)
    assert isinstance(failed, IterationFailed) and failed.cause is Cause.FAILED and failed.iteration == 0
    assert core.failure(0) == failed and core.next_timer() is None
    assert core.contribution_failed(iteration, "again", 3.0) == []   # every tensor's combine fails alike
    assert core.next_iteration() == 1 and core.pull_iteration(0) == 1
