"""The baselines' shapes: STAR, BKT, MST and single-root FAPT."""

from __future__ import annotations

import itertools

import networkx as nx
import pytest

from netstorm.emulation.results import Bounds
from netstorm.errors import PolicyError
from netstorm.planning.baselines import best_bound_hub, best_connected, bfs_order, bkt_tree, star_bounds
from netstorm.planning.fapt import theorem1_delay
from netstorm.planning.plan import plan
from netstorm.planning.predict import routes_for
from netstorm.planning.rategraph import RateGraph
from netstorm.scenario import load
from tests.policy_graphs import internet2, random_overlay


def test_hub_is_the_best_connected_node():
    # Rate in + out: node 2 has 54+36 + 146+135 + 140+117 = 628; the runner-up, node 6, 592.
    assert best_connected(RateGraph.from_rates(internet2())) == 2


def test_star_mxnet_points_every_node_at_the_best_connected_hub():
    policy = plan(internet2(), topology="star-mxnet")
    assert policy.roots == (2,)
    assert dict(policy.trees[2].parent) == {n: (None if n == 2 else 2) for n in range(1, 10)}
    assert dict(plan(internet2(), topology="star", hub=7).trees[7].parent)[1] == 7
    assert dict(plan(internet2(), topology="star-mxnet", hub=7).trees[7].parent)[1] == 7


def _brute_force_star_bound(model_bytes: int, rates: dict[tuple[int, int], float]) -> tuple[float, int]:
    """Every hub's STAR bound from its own star tree's routed flows, least first (ties by id)."""
    graph = RateGraph.from_rates(rates)
    routes = routes_for(graph)
    best = []
    for hub in graph.nodes:
        load: dict[tuple[int, int], int] = {}
        for other in graph.nodes:
            if other != hub:
                for path in (routes[(other, hub)], routes[(hub, other)]):
                    for hop in itertools.pairwise(path):
                        load[hop] = load.get(hop, 0) + 1
        best.append((max(c * model_bytes * 8 / (rates[hop] * 1e6) for hop, c in load.items()), hub))
    return min(best)


@pytest.mark.parametrize("scale", [1.0, 0.25])
def test_star_runs_at_the_hub_with_the_best_bound_on_internet2(scale):
    rates = internet2(scale)
    model_bytes = 61_100_840
    seconds, hub = _brute_force_star_bound(model_bytes, rates)
    assert star_bounds(model_bytes, rates)[hub] == pytest.approx(seconds)
    assert min(star_bounds(model_bytes, rates).values()) == pytest.approx(seconds)
    assert best_bound_hub(rates) == hub
    policy = plan(rates, topology="star")
    assert policy.roots == (hub,)
    assert dict(policy.trees[hub].parent) == {n: (None if n == hub else hub) for n in range(1, 10)}
    # The best-connected hub is another, slower one: the two baselines differ here.
    mxnet = best_connected(RateGraph.from_rates(rates))
    assert mxnet != hub
    assert star_bounds(model_bytes, rates)[mxnet] > seconds
    # The emulation summary's "STAR's physical bound ... at hub H" is the same hub.
    assert Bounds(model_bytes, scale).star_bound(load("internet2-9").rates()) == (pytest.approx(seconds), hub)


def test_bkt_binary_tree_on_internet2_by_hand():
    graph = RateGraph.from_rates(internet2())
    assert bfs_order(graph, 2) == [2, 1, 3, 5, 4, 7, 6, 8, 9]
    tree = bkt_tree(graph, 2, 2)
    assert dict(tree.parent) == {2: None, 1: 2, 3: 2, 5: 1, 4: 1, 7: 3, 6: 3, 8: 5, 9: 5}


@pytest.mark.parametrize(("n", "k"), [(9, 2), (9, 3), (30, 2), (30, 4), (31, 5)])
def test_bkt_is_balanced(n, k):
    policy = plan(random_overlay(n, 4, seed=n + k), topology="bkt", bkt_k=k)
    tree = policy.trees[policy.roots[0]]
    assert all(len(tree.children(node)) <= k for node in tree.nodes)
    # The least depth a k-way tree of n nodes can have.
    depth, capacity = 0, 1
    while capacity < n:
        depth += 1
        capacity += k**depth
    assert max(tree.depth().values()) == depth
    with pytest.raises(PolicyError):
        plan(random_overlay(5, 2, 1), topology="bkt", bkt_k=0)


@pytest.mark.parametrize("seed", range(4))
def test_mst_is_a_maximum_spanning_tree_at_its_fastest_root(seed):
    rates = random_overlay(10, 4, seed)
    policy = plan(rates, topology="mst", aux=False)
    tree = policy.trees[policy.roots[0]]
    undirected = nx.Graph()
    for (a, b), s in rates.items():
        undirected.add_edge(a, b, w=min(s, rates[(b, a)]))
    best_total = sum(d["w"] for _, _, d in nx.maximum_spanning_tree(undirected, weight="w").edges(data=True))
    ours = sum(min(rates[(c, p)], rates[(p, c)]) for c, p in tree.edges())
    assert ours == pytest.approx(best_total)
    edges = {frozenset(e) for e in tree.edges()}
    delays = {}
    for root in tree.nodes:
        other = plan(rates, topology="mst", hub=root, aux=False).trees[root]
        assert {frozenset(e) for e in other.edges()} == edges
        delays[root] = theorem1_delay(other, rates)
    assert delays[policy.roots[0]] == min(delays.values())


def test_single_root_fapt_takes_the_best_root():
    full = plan(internet2(), topology="fapt", packing=False)
    single = plan(internet2(), topology="fapt1")
    assert single.roots == (full.roots[0],)
    assert single.trees[single.roots[0]] == full.trees[full.roots[0]]
    assert single.chunk_share == {single.roots[0]: 1.0}
