"""The aggregation core: several cores wired in-process, sums checked exactly against numpy.

Contributions are integer-valued floats, so every order of additions gives the exact same float32
sum and results can be compared with ``==``.
"""

from __future__ import annotations

import itertools
import random

import msgspec
import numpy as np
import pytest

from netstorm.errors import ChunkError
from netstorm.frames import Phase
from netstorm.layout import Layout, TensorSpec
from netstorm.planning.plan import plan
from netstorm.policy import Policy
from node.chunks import Action, Cause, ChunkCore, IterationDone, IterationFailed, KeyDone, Send

RING5 = {(1, 2): 40.0, (2, 3): 90.0, (3, 4): 20.0, (4, 5): 70.0, (5, 1): 30.0, (2, 4): 55.0}


def rates(edges: dict[tuple[int, int], float]) -> dict[tuple[int, int], float]:
    out = {}
    for (a, b), r in edges.items():
        out[(a, b)] = r
        out[(b, a)] = r * 1.5
    return out


SPECS = [TensorSpec("big", (5, 9), "float32"), TensorSpec("bias", (3,), "float32"),
         TensorSpec("half", (17,), "float16"), TensorSpec("tiny", (1,), "float32"),
         TensorSpec("empty", (0,), "float32")]


def make(nodes: list[int], layout: Layout) -> dict[int, ChunkCore]:
    return {n: ChunkCore(n, layout) for n in nodes}


class Network:
    """Delivers Sends among cores in a random order; records everything else per node."""

    def __init__(self, cores: dict[int, ChunkCore], seed: int = 0) -> None:
        self.cores = cores
        self.rng = random.Random(seed)
        self.inflight: list[Send] = []
        self.events: dict[int, list[Action]] = {n: [] for n in cores}
        self.hops: list[Send] = []

    def take(self, node: int, actions: list[Action]) -> None:
        for action in actions:
            if isinstance(action, Send):
                assert action.header.src == node
                self.inflight.append(action)
            else:
                self.events[node].append(action)

    def run(self, hold: set[int] = frozenset()) -> None:  # type: ignore[assignment]
        """Deliver until quiet; Sends to nodes in ``hold`` stay in flight."""
        while True:
            ready = [s for s in self.inflight if s.header.dst not in hold]
            if not ready:
                return
            send = ready[self.rng.randrange(len(ready))]
            self.inflight.remove(send)
            self.hops.append(send)
            node = send.header.dst
            self.take(node, self.cores[node].receive(send.header, send.payload.copy()))


def contributions(layout: Layout, nodes: list[int], seed: int) -> dict[int, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {n: rng.integers(-1000, 1000, layout.total).astype(np.float32) for n in nodes}


def push_all(net: Network, iteration: int, values: dict[int, np.ndarray], layout: Layout) -> None:
    for node, flat in values.items():
        for key in range(len(layout.tensors)):
            net.take(node, net.cores[node].push_local(iteration, key, flat[layout.key_slice(key)]))


@pytest.mark.parametrize("topology", ["fapt", "star", "bkt", "mst", "fapt1"])
def test_every_node_gets_the_exact_sum(topology: str):
    nodes = [1, 2, 3, 4, 5]
    layout = Layout.build(SPECS, 7)
    policy = plan(rates(RING5), topology=topology, version=3)
    cores = make(nodes, layout)
    net = Network(cores, seed=1)
    values = contributions(layout, nodes, seed=2)
    for n in nodes:
        net.take(n, cores[n].bind_policy(0, policy))
    push_all(net, 0, values, layout)
    net.run()
    expected = np.sum(list(values.values()), axis=0, dtype=np.float32)
    for n in nodes:
        assert cores[n].is_done(0)
        np.testing.assert_array_equal(cores[n].result(0), expected)
        keys = sorted(a.key for a in net.events[n] if isinstance(a, KeyDone))
        assert keys == list(range(len(layout.tensors)))
        assert [a for a in net.events[n] if isinstance(a, IterationDone)] == [IterationDone(0)]
    # Every chunk went up every tree edge exactly once and down every tree edge exactly once.
    for phase in (Phase.UP, Phase.DOWN):
        edges = sorted((s.header.chunk, s.header.src, s.header.dst) for s in net.hops if s.header.phase is phase)
        assert len(edges) == len(set(edges)) == len(layout.chunks) * (len(nodes) - 1)


def test_chunks_go_to_roots_in_proportion_and_follow_their_trees():
    nodes = [1, 2, 3, 4, 5]
    layout = Layout.build([TensorSpec("w", (400,), "float32")], 10)
    policy = plan(rates(RING5), topology="fapt", num_roots=3, version=0)
    cores = make(nodes, layout)
    net = Network(cores, seed=5)
    for n in nodes:
        net.take(n, cores[n].bind_policy(0, policy))
    push_all(net, 0, contributions(layout, nodes, 9), layout)
    net.run()
    for send in net.hops:
        tree = policy.trees[send.header.root]
        if send.header.phase is Phase.UP:
            assert tree.parent[send.header.src] == send.header.dst
        else:
            assert tree.parent[send.header.dst] == send.header.src
    used = {s.header.root for s in net.hops}
    assert used == set(policy.roots)


def test_chunks_before_the_policy_are_buffered_not_dropped():
    nodes = [1, 2, 3, 4, 5]
    layout = Layout.build(SPECS, 4)
    policy = plan(rates(RING5), topology="fapt", version=0)
    cores = make(nodes, layout)
    net = Network(cores, seed=3)
    values = contributions(layout, nodes, 4)
    late = 2
    for n in nodes:
        if n != late:
            net.take(n, cores[n].bind_policy(0, policy))
    push_all(net, 0, values, layout)
    net.run()
    assert "buffered" in cores[late].status(0)
    assert not any(c.is_done(0) for c in cores.values())
    net.take(late, cores[late].bind_policy(0, policy))
    net.run()
    expected = np.sum(list(values.values()), axis=0, dtype=np.float32)
    for n in nodes:
        np.testing.assert_array_equal(cores[n].result(0), expected)


def test_chunks_before_the_layout_are_buffered():
    nodes = [1, 2, 3]
    layout = Layout.build(SPECS, 6)
    policy = plan(rates({(1, 2): 10.0, (2, 3): 10.0, (1, 3): 10.0}), topology="fapt", version=0)
    cores = make(nodes, layout)
    cores[3] = ChunkCore(3)
    net = Network(cores, seed=4)
    values = contributions(layout, nodes, 6)
    for n in (1, 2):
        net.take(n, cores[n].bind_policy(0, policy))
        for key in range(len(layout.tensors)):
            net.take(n, cores[n].push_local(0, key, values[n][layout.key_slice(key)]))
    early = [s for s in net.inflight if s.header.dst == 3]
    net.run()
    with pytest.raises(ChunkError, match="duplicate"):  # kept once, even before the layout is known
        cores[3].receive(early[0].header, early[0].payload)
    net.take(3, cores[3].set_layout(layout))
    net.take(3, cores[3].bind_policy(0, policy))
    for key in range(len(layout.tensors)):
        net.take(3, cores[3].push_local(0, key, values[3][layout.key_slice(key)]))
    net.run()
    expected = values[1] + values[2] + values[3]
    for n in nodes:
        np.testing.assert_array_equal(cores[n].result(0), expected)


def test_policy_change_between_iterations_and_overlapping_iterations():
    nodes = [1, 2, 3, 4, 5]
    layout = Layout.build(SPECS, 5)
    first = plan(rates(RING5), topology="fapt", version=0)
    second = plan(rates({k: 200.0 - v for k, v in RING5.items()}), topology="star", version=1)
    cores = make(nodes, layout)
    net = Network(cores, seed=7)
    v0 = contributions(layout, nodes, 10)
    v1 = contributions(layout, nodes, 11)
    for n in nodes:
        net.take(n, cores[n].bind_policy(0, first))
    push_all(net, 0, v0, layout)
    # Node 4 is fast: it starts iteration 1 before anyone finished iteration 0.
    net.take(4, cores[4].bind_policy(1, second))
    for key in range(len(layout.tensors)):
        net.take(4, cores[4].push_local(1, key, v1[4][layout.key_slice(key)]))
    net.run()
    for n in nodes:
        if n != 4:
            net.take(n, cores[n].bind_policy(1, second))
            for key in range(len(layout.tensors)):
                net.take(n, cores[n].push_local(1, key, v1[n][layout.key_slice(key)]))
    net.run()
    for n in nodes:
        np.testing.assert_array_equal(cores[n].result(0), np.sum(list(v0.values()), axis=0))
        np.testing.assert_array_equal(cores[n].result(1), np.sum(list(v1.values()), axis=0))
        cores[n].release(0)
        cores[n].release(1)


def first_send(net: Network, node: int) -> Send:
    return next(s for s in net.inflight if s.header.src == node)


def test_duplicates_wrong_versions_and_strangers_are_rejected():
    nodes = [1, 2, 3, 4, 5]
    layout = Layout.build(SPECS, 4)
    policy = plan(rates(RING5), topology="fapt", version=2)
    cores = make(nodes, layout)
    net = Network(cores)
    for n in nodes:
        net.take(n, cores[n].bind_policy(0, policy))
    push_all(net, 0, contributions(layout, nodes, 1), layout)
    send = next(s for s in net.inflight if s.header.phase is Phase.UP)
    dst = cores[send.header.dst]
    net.inflight.remove(send)
    net.take(send.header.dst, dst.receive(send.header, send.payload.copy()))
    with pytest.raises(ChunkError, match="duplicate contribution"):
        dst.receive(send.header, send.payload.copy())
    other = next(s for s in net.inflight if s is not send and s.header.phase is Phase.UP)
    with pytest.raises(ChunkError, match="policy version 9"):
        cores[other.header.dst].receive(msgspec.structs.replace(other.header, version=9), other.payload)
    with pytest.raises(ChunkError, match="allots this chunk to root"):
        wrong_root = next(r for r in policy.roots if r != other.header.root) if len(policy.roots) > 1 else -1
        cores[other.header.dst].receive(msgspec.structs.replace(other.header, root=wrong_root), other.payload)
    stranger = next(n for n in nodes if policy.trees[other.header.root].parent.get(n) != other.header.dst
                    and n != other.header.dst)
    with pytest.raises(ChunkError, match="is not a child"):
        cores[other.header.dst].receive(msgspec.structs.replace(other.header, origin=stranger, src=stranger,
                                                            path=(stranger, other.header.dst)), other.payload)
    with pytest.raises(ChunkError, match="layout says"):
        cores[other.header.dst].receive(msgspec.structs.replace(other.header, count=other.header.count + 1),
                                        np.zeros(other.header.count + 1, np.float32))
    # Bad input left the core usable: the real chunk still completes the iteration.
    net.run()
    assert all(c.is_done(0) for c in cores.values())


def test_auxiliary_chunks_are_forwarded_by_their_path_and_counted_once_at_the_end():
    nodes = [1, 2, 3, 4, 5]
    layout = Layout.build([TensorSpec("w", (6,), "float32")], 6)
    policy = plan(rates(RING5), topology="fapt", num_roots=1, version=0)
    cores = make(nodes, layout)
    net = Network(cores)
    values = contributions(layout, nodes, 3)
    for n in nodes:
        net.take(n, cores[n].bind_policy(0, policy))
    push_all(net, 0, values, layout)
    # Reroute one leaf's tree-edge chunk through every other node that is not its parent or itself,
    # as a source-chosen auxiliary path; the intermediates hold no policy for iteration 5... only the path.
    send = net.inflight.pop(0)
    h = send.header
    via = [n for n in nodes if n not in (h.origin, h.final)]
    path = (h.origin, *via, h.final)
    net.inflight.append(Send(msgspec.structs.replace(h, dst=path[1], is_aux=True, path=path), send.payload))
    net.run()
    hops = [s.header for s in net.hops if s.header.is_aux]
    assert [(x.src, x.dst) for x in hops] == list(itertools.pairwise(path))
    assert all(x.origin == h.origin and x.final == h.final for x in hops)
    expected = np.sum(list(values.values()), axis=0, dtype=np.float32)
    for n in nodes:
        np.testing.assert_array_equal(cores[n].result(0), expected)
    # A node that knows nothing of this job's iteration (no layout, no policy) still forwards by the path.
    bystander = ChunkCore(99)
    stale = msgspec.structs.replace(h, src=h.origin, dst=99, is_aux=True, path=(h.origin, 99, h.final))
    [forward] = bystander.receive(stale, send.payload)
    assert isinstance(forward, Send)
    assert (forward.header.src, forward.header.dst, forward.header.final) == (99, h.final, h.final)
    with pytest.raises(ChunkError, match="without an auxiliary path"):
        cores[via[0]].receive(msgspec.structs.replace(h, dst=via[0], is_aux=False), send.payload)


def test_failed_iteration_ignores_late_chunks_and_finished_rejects_them():
    layout = Layout.build(SPECS, 4)
    policy: Policy = plan(rates({(1, 2): 10.0}), topology="fapt", version=0)
    cores = make([1, 2], layout)
    net = Network(cores)
    for n in (1, 2):
        net.take(n, cores[n].bind_policy(0, policy))
    push_all(net, 0, contributions(layout, [1, 2], 1), layout)
    failed = cores[2].fail(0, "node 7 is gone", Cause.GONE)
    assert failed == [IterationFailed(0, "node 7 is gone", Cause.GONE)]
    net.run()  # chunks for the failed iteration are ignored at node 2, node 1 never completes
    assert not cores[1].is_done(0)
    assert "outstanding" in cores[1].status(0)


def test_chunks_from_beyond_the_next_iteration_are_refused():
    # A peer can be at most one iteration ahead of this node's own contributions; anything further is a
    # broken peer and must not make this node allocate buffers for it.
    layout = Layout.build(SPECS, 4)
    policy = plan(rates({(1, 2): 10.0}), topology="fapt", version=0)
    cores = make([1, 2], layout)
    net = Network(cores)
    net.take(1, cores[1].bind_policy(0, policy))
    for key in range(len(layout.tensors)):
        net.take(1, cores[1].push_local(0, key, np.ones(layout.tensors[key].size, np.float32)))
    send = net.inflight[0]
    far = msgspec.structs.replace(send.header, iteration=cores[2].horizon + 1)
    with pytest.raises(ChunkError, match="has not reached iteration"):
        cores[2].receive(far, send.payload)
    assert cores[2].live_iterations() == []
    cores[2].receive(send.header, send.payload)  # iteration 0 itself is early data, kept
    assert cores[2].live_iterations() == [0]
