"""One tree per root: shallow Prim trees, the local search against the packing's cut, shares that stay exact."""

from __future__ import annotations

import dataclasses
import itertools
import math

import numpy as np
import pytest
from scipy.sparse import csr_matrix
from scipy.sparse.csgraph import shortest_path

from netstorm import scenario
from netstorm.planning.packing import PackingGraph, assign_roots, pack_trees, solve_with_duals
from netstorm.planning.plan import plan
from netstorm.planning.rategraph import RateGraph
from netstorm.planning.rootpacking import MAX_SEARCH_WORK, Overlay, pack_for_roots
from netstorm.scenario import Rates
from tests.policy_graphs import internet2, random_overlay


def _circulant(n: int) -> Rates:
    """Every node linked to the next two around a ring, 100 Mbit/s each way (the scale scenarios)."""
    rates: Rates = {}
    for a in range(1, n + 1):
        for step in (1, 2):
            b = (a - 1 + step) % n + 1
            rates[(a, b)] = rates[(b, a)] = 100.0
    return rates


def _hops(graph: PackingGraph, root: int) -> np.ndarray:
    adjacency = csr_matrix((np.ones(graph.m), (graph.u, graph.v)), shape=(graph.n, graph.n))
    return np.asarray(shortest_path(adjacency, directed=False, unweighted=True, indices=root))


def _busiest(graph: PackingGraph, trees: dict, share: dict) -> float:
    """seconds per Mbit of the busiest directed link under these trees and shares."""
    roots = sorted(trees)
    edge_sets = [graph.edge_set(trees[r]) for r in roots]
    assert all(e is not None for e in edge_sets)
    columns = graph.load_columns(edge_sets)  # type: ignore[arg-type]
    return float((columns @ np.array([share[r] for r in roots])).max())


@pytest.mark.parametrize("slack", [0, 1, 2])
def test_shallow_tree_spans_within_its_depth_bound(slack):
    graph = PackingGraph.from_graph(RateGraph.from_rates(_circulant(15)))
    rng = np.random.default_rng(slack)
    for root in range(graph.n):
        weight = rng.random(graph.m) if root % 2 else np.zeros(graph.m)
        edges = Overlay(graph).shallow_tree(root, weight, slack)
        tree = graph.rooted(edges, graph.nodes[root])  # raises unless the edges span
        hops = _hops(graph, root)
        depth = tree.depth()
        for i, node in enumerate(graph.nodes):
            assert hops[i] <= depth[node] <= hops[i] + slack
        if slack == 0:
            assert max(depth.values()) == 4  # C15(1, 2): ring distance 7 takes 4 hops of at most 2


def test_tree_delay_is_the_push_and_result_trips_of_theorem_1():
    rates = random_overlay(9, 3, seed=11)
    graph = PackingGraph.from_graph(RateGraph.from_rates(rates))
    reversed_graph = dataclasses.replace(graph, up=graph.down, down=graph.up)
    overlay = Overlay(graph)
    rng = np.random.default_rng(2)
    for root in range(graph.n):
        edges = overlay.shallow_tree(root, rng.random(graph.m), slack=1)
        expected = graph.delays_to(edges, np.array([root]))[0] + reversed_graph.delays_to(edges, np.array([root]))[0]
        assert overlay.delay(root, edges) == pytest.approx(expected, rel=1e-12)
        # By hand from the rooted tree: the slowest path up plus the slowest path down.
        tree = graph.rooted(edges, graph.nodes[root])
        up = {n: sum(1 / rates[(a, b)] for a, b in itertools.pairwise(tree.path_to_root(n)))
              for n in tree.nodes}
        down = {n: sum(1 / rates[(b, a)] for a, b in itertools.pairwise(tree.path_to_root(n)))
                for n in tree.nodes}
        assert overlay.delay(root, edges) == pytest.approx(max(up.values()) + max(down.values()), rel=1e-9)


def test_circulant_reaches_near_the_optimum_with_shallow_trees():
    # The 15-node circulant: the LP optimum over every spanning tree loads each directed link with
    # 14/30 of the model; cut to 15 trees the packing alone stays 7 % above it.
    rates = _circulant(15)
    graph = PackingGraph.from_graph(RateGraph.from_rates(rates))
    optimum = pack_trees(graph).seconds_per_mbit
    assert optimum == pytest.approx(14 / 30 / 100, rel=1e-6)
    cut = pack_trees(graph, max_trees=15).seconds_per_mbit
    trees, share = pack_for_roots(RateGraph.from_rates(rates), list(range(1, 16)))
    refined = _busiest(graph, trees, share)
    assert refined < cut * (1 - 0.03)
    assert refined <= optimum * 1.03
    for root, tree in trees.items():
        assert tree.root == root
        assert max(tree.depth().values()) <= 5  # BFS depth 4, plus at most one hop of slack
    assert math.fsum(share.values()) == pytest.approx(1.0, abs=1e-9)
    assert all(s >= 0 for s in share.values())


@pytest.mark.parametrize("rates", [
    pytest.param(internet2(), id="internet2"),
    pytest.param(random_overlay(8, 3, seed=5), id="random8"),
    pytest.param(random_overlay(10, 3, seed=6), id="random10"),
])
def test_never_worse_than_the_cut_and_deterministic(rates):
    rate_graph = RateGraph.from_rates(rates)
    graph = PackingGraph.from_graph(rate_graph)
    roots = list(rate_graph.nodes)
    cut = pack_trees(graph, max_trees=len(roots)).seconds_per_mbit
    trees, share = pack_for_roots(rate_graph, roots)
    assert _busiest(graph, trees, share) <= cut * (1 + 1e-6)
    # The shares are the LP's optimum for these very trees.
    edge_sets = [graph.edge_set(trees[r]) for r in roots]
    _, best, _, _ = solve_with_duals(graph, edge_sets)  # type: ignore[arg-type]
    assert _busiest(graph, trees, share) == pytest.approx(best, rel=1e-6)
    again_trees, again_share = pack_for_roots(rate_graph, roots)
    assert again_share == share
    assert {r: dict(t.parent) for r, t in again_trees.items()} == {r: dict(t.parent) for r, t in trees.items()}


def test_plan_carries_the_refined_trees():
    # The committed scale-15 scenario is the circulant above: plan() must hand out the search's trees.
    rates = scenario.load("scale-15").rates()
    graph = PackingGraph.from_graph(RateGraph.from_rates(rates))
    policy = plan(rates)
    assert _busiest(graph, dict(policy.trees), dict(policy.chunk_share)) < (
        pack_trees(graph, max_trees=15).seconds_per_mbit * 0.97)


def test_large_overlays_keep_the_cut():
    # 40 DCs on ~120 links is past MAX_SEARCH_WORK: the answer is exactly the packing's cut, assigned.
    rates = random_overlay(40, 6, seed=7)
    rate_graph = RateGraph.from_rates(rates)
    graph = PackingGraph.from_graph(rate_graph)
    roots = list(rate_graph.nodes)
    assert len(roots) * graph.m > MAX_SEARCH_WORK
    trees, share = pack_for_roots(rate_graph, roots)
    cut_trees, cut_share = assign_roots(graph, pack_trees(graph, max_trees=len(roots)), roots)
    assert share == cut_share
    assert {r: dict(t.parent) for r, t in trees.items()} == {r: dict(t.parent) for r, t in cut_trees.items()}
