"""The baselines' shapes: STAR, BKT, MST and single-root FAPT."""

from __future__ import annotations

import networkx as nx
import pytest

from netstorm.errors import PolicyError
from netstorm.planning.baselines import best_connected, bfs_order, bkt_tree
from netstorm.planning.fapt import theorem1_delay
from netstorm.planning.plan import plan
from netstorm.planning.rategraph import RateGraph
from tests.policy_graphs import internet2, random_overlay


def test_hub_is_the_best_connected_node():
    # Rate in + out: node 2 has 54+36 + 146+135 + 140+117 = 628; the runner-up, node 6, 592.
    assert best_connected(RateGraph.from_rates(internet2())) == 2


def test_star_points_every_node_at_the_hub():
    policy = plan(internet2(), topology="star")
    assert policy.roots == (2,)
    assert dict(policy.trees[2].parent) == {n: (None if n == 2 else 2) for n in range(1, 10)}
    assert dict(plan(internet2(), topology="star", hub=7).trees[7].parent)[1] == 7


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
