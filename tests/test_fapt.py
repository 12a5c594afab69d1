"""Theorem 1, Algorithm 1 and Algorithm 2 against hand-worked cases and brute force over spanning trees."""

from __future__ import annotations

import itertools

import pytest

from netstorm.errors import PolicyError
from netstorm.planning.fapt import build_multi_root_fapt, theorem1_delay, top_roots
from netstorm.planning.plan import plan
from netstorm.planning.rategraph import RateGraph
from netstorm.tree import Tree
from tests.policy_graphs import random_overlay

# Hand-worked: w = 1/s per directed link.
#   1->2 10, 2->1 20 | 2->3 5, 3->2 40 | 1->3 4, 3->1 8 | 3->4 10, 4->3 10
HAND = {(1, 2): 10.0, (2, 1): 20.0, (2, 3): 5.0, (3, 2): 40.0, (1, 3): 4.0, (3, 1): 8.0,
        (3, 4): 10.0, (4, 3): 10.0}


def test_hand_worked_trees_delays_and_quality():
    result = build_multi_root_fapt(RateGraph.from_rates(HAND))
    # Root 1: 2->1 0.05; 3->2->1 0.025+0.05 beats 3->1 0.125; 4->3->2->1 0.175.
    assert dict(result.trees[1].parent) == {1: None, 2: 1, 3: 2, 4: 3}
    # Root 2: 1->2 0.1 beats 1->3->2 0.275; 3->2 0.025; 4->3->2 0.125.
    assert dict(result.trees[2].parent) == {1: 2, 2: None, 3: 2, 4: 3}
    # Root 3: 1->3 0.25 beats 1->2->3 0.3; 2->3 0.2 beats 2->1->3 0.3; 4->3 0.1.
    assert dict(result.trees[3].parent) == {1: 3, 2: 3, 3: None, 4: 3}
    # Root 4: 3->4 0.1; 2->3->4 0.3; 1->3->4 0.35 beats 1->2->3->4 0.4.
    assert dict(result.trees[4].parent) == {1: 3, 2: 3, 3: 4, 4: None}
    delays = {1: 0.175, 2: 0.125, 3: 0.25, 4: 0.35}
    for root, delay in delays.items():
        assert theorem1_delay(result.trees[root], HAND) == pytest.approx(delay, rel=1e-12)
        assert result.quality[root] == pytest.approx(1 / delay, rel=1e-12)
    assert result.roots == (2, 1, 3, 4)


def test_top_n_roots_and_their_shares():
    policy = plan(HAND, num_roots=2, packing=False)
    assert policy.roots == (2, 1)
    assert policy.chunk_share[2] == pytest.approx(8 / (8 + 1 / 0.175))
    assert policy.chunk_share[1] == pytest.approx((1 / 0.175) / (8 + 1 / 0.175))
    with pytest.raises(PolicyError, match="5 roots"):
        plan(HAND, num_roots=5)


def test_equal_paths_go_to_the_smaller_parent_id():
    ring = {}
    for a, b in ((1, 2), (2, 3), (3, 4), (4, 1)):
        ring[(a, b)] = ring[(b, a)] = 10.0
    policy = plan(ring, packing=False)
    assert policy.roots == (1, 2, 3, 4)  # equal scores: ascending id
    assert policy.trees[1].parent[3] == 2  # 3->2->1 and 3->4->1 tie
    assert policy.trees[2].parent[4] == 1  # 4->1->2 and 4->3->2 tie


@pytest.mark.parametrize("swap", [False, True])
def test_float_noise_does_not_decide_a_tie(swap):
    # 1/3 + 1/15 and 1/5 + 1/5 are both 0.4, but the first sums to 0.39999999999999997 in floats.
    via2, via3 = ((5.0, 5.0), (3.0, 15.0)) if not swap else ((3.0, 15.0), (5.0, 5.0))
    rates = {(4, 2): via2[0], (2, 1): via2[1], (4, 3): via3[0], (3, 1): via3[1]}
    for a, b in list(rates):
        rates[(b, a)] = 100.0
    assert plan(rates, roots=[1], packing=False).trees[1].parent[4] == 2


def _spanning_in_trees(rates: dict[tuple[int, int], float], root: int):
    """Every spanning tree whose edges child->parent are links, by brute force over parent choices."""
    nodes = sorted({n for pair in rates for n in pair})
    others = [n for n in nodes if n != root]
    choices = [[b for (a, b) in rates if a == n] for n in others]
    for picks in itertools.product(*choices):
        parent: dict[int, int | None] = {root: None, **dict(zip(others, picks, strict=True))}
        try:
            yield Tree(root, parent)
        except PolicyError:  # a cycle
            continue


def _path_costs(tree: Tree, rates) -> dict[int, float]:
    return {n: sum(1 / rates[(a, b)] for a, b in itertools.pairwise(tree.path_to_root(n))) for n in tree.nodes}


@pytest.mark.parametrize("seed", range(6))
def test_fapt_is_fastest_for_every_node_among_all_spanning_trees(seed):
    """A shortest-path in-tree gives every node its least path cost, so also the least Theorem-1 delay.

    Exhaustive over every spanning tree rooted at each root of small random overlays.
    """
    rates = random_overlay(6, 3.4, seed)
    result = build_multi_root_fapt(RateGraph.from_rates(rates))
    for root, fapt in result.trees.items():
        fapt_cost = _path_costs(fapt, rates)
        fapt_delay = theorem1_delay(fapt, rates)
        assert fapt_delay == pytest.approx(max(fapt_cost.values()), rel=1e-12)
        best_delay = float("inf")
        count = 0
        for tree in _spanning_in_trees(rates, root):
            count += 1
            cost = _path_costs(tree, rates)
            for node in tree.nodes:
                assert fapt_cost[node] <= cost[node] * (1 + 1e-12)
            best_delay = min(best_delay, theorem1_delay(tree, rates))
        assert count > 1
        assert fapt_delay == pytest.approx(best_delay, rel=1e-12)
        assert result.quality[root] == pytest.approx(1 / best_delay, rel=1e-12)


def test_theorem1_rejects_an_edge_that_is_no_link():
    with pytest.raises(PolicyError, match="not an overlay link"):
        theorem1_delay(Tree(1, {1: None, 2: 1, 4: 1, 3: 2}), HAND)


def test_top_roots_orders_by_score_then_id():
    assert top_roots({5: 1.0, 3: 2.0, 4: 2.0, 1: 0.5}, 3) == (3, 4, 5)
    assert top_roots({5: 1.0, 3: 2.0}, 0) == (3, 5)
    with pytest.raises(PolicyError):
        top_roots({1: 1.0}, -1)
