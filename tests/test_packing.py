"""LP tree packing: column generation against every spanning tree, the limit, fixed roots, determinism."""

from __future__ import annotations

import itertools
import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest
from scipy.optimize import linprog

from netstorm import scenario
from netstorm.errors import PolicyError
from netstorm.planning.limit import limit_s, min_cut
from netstorm.planning.packing import PackingGraph, pack_trees
from netstorm.planning.plan import plan
from netstorm.planning.predict import predict
from netstorm.planning.rategraph import RateGraph
from netstorm.planning.rootpacking import pack_for_roots
from netstorm.scenario import Rates
from netstorm.tree import Tree
from tests.policy_graphs import internet2, random_overlay

ALEXNET_BYTES = 61_100_840 * 4


def _find(leader: dict[int, int], x: int) -> int:
    while leader[x] != x:
        x = leader[x]
    return x


def _all_spanning_trees(rates: Rates) -> tuple[list[tuple[int, int]], list[list[int]]]:
    """Undirected pairs linked both ways, and every subset of n-1 of them that connects all nodes."""
    nodes = sorted({a for a, _ in rates} | {b for _, b in rates})
    pairs = sorted((a, b) for a, b in rates if a < b and (b, a) in rates)
    trees = []
    for subset in itertools.combinations(range(len(pairs)), len(nodes) - 1):
        leader = {n: n for n in nodes}
        joined = 0
        for e in subset:
            a, b = _find(leader, pairs[e][0]), _find(leader, pairs[e][1])
            if a != b:
                leader[a] = b
                joined += 1
        if joined == len(nodes) - 1:
            trees.append(list(subset))
    return pairs, trees


def _brute_force_optimum(rates: Rates) -> float:
    """min T over shares of every spanning tree, each directed link's load / rate <= T."""
    pairs, trees = _all_spanning_trees(rates)
    rows = np.zeros((2 * len(pairs), len(trees)))
    for k, tree in enumerate(trees):
        for e in tree:
            a, b = pairs[e]
            rows[2 * e, k] = 1 / rates[(a, b)]
            rows[2 * e + 1, k] = 1 / rates[(b, a)]
    k = len(trees)
    a_ub = np.hstack([rows, -np.ones((rows.shape[0], 1))])
    a_eq = np.append(np.ones(k), 0.0)[None, :]
    result = linprog(np.append(np.zeros(k), 1.0), A_ub=a_ub, b_ub=np.zeros(rows.shape[0]), A_eq=a_eq,
                     b_eq=[1.0], bounds=[(0, None)] * (k + 1), method="highs")
    assert result.status == 0
    return float(result.fun)


def _complete(n: int, seed: int) -> Rates:
    rng = np.random.default_rng(seed)
    return {(a, b): float(rng.integers(5, 100)) for a in range(n) for b in range(n) if a != b}


SMALL_GRAPHS = [
    pytest.param(_complete(4, 1), id="K4"),
    pytest.param(_complete(5, 2), id="K5"),
    pytest.param(random_overlay(6, 3, seed=3), id="random6"),
    pytest.param(random_overlay(7, 3, seed=4), id="random7"),
    pytest.param({(a, b): 10.0 for a in range(5) for b in range(5) if a != b}, id="K5-equal"),
]


@pytest.mark.parametrize("rates", SMALL_GRAPHS)
def test_column_generation_matches_the_lp_over_every_spanning_tree(rates):
    packing = pack_trees(PackingGraph.from_graph(RateGraph.from_rates(rates)))
    assert packing.optimal
    assert packing.seconds_per_mbit == pytest.approx(_brute_force_optimum(rates), rel=1e-6)
    assert math.fsum(packing.shares) == pytest.approx(1.0, abs=1e-12)
    assert all(s > 0 for s in packing.shares)


def test_equal_complete_graph_reaches_the_nash_williams_bound():
    # K5 with equal rates: 10 edges, every tree has 4, so the best mix loads every edge 4/10 of the model.
    rates = {(a, b): 10.0 for a in range(5) for b in range(5) if a != b}
    packing = pack_trees(PackingGraph.from_graph(RateGraph.from_rates(rates)))
    assert packing.seconds_per_mbit == pytest.approx(0.4 / 10.0, rel=1e-9)


@pytest.mark.parametrize("seed", range(6))
def test_never_below_the_physical_limit(seed):
    rates = random_overlay(12 + seed, 4, seed=seed)
    packing = pack_trees(PackingGraph.from_graph(RateGraph.from_rates(rates)))
    assert packing.seconds_per_mbit >= (1 / min_cut(rates).mbit) * (1 - 1e-9)


@pytest.mark.parametrize("scale", [1.0, 0.25])
def test_internet2_within_ten_percent_of_the_limit(scale):
    rates = internet2(scale)
    policy = plan(rates, aux=False)
    prediction = predict(policy, rates, ALEXNET_BYTES)
    limit = limit_s(ALEXNET_BYTES, rates)
    assert limit <= prediction.bulk_s <= 1.1 * limit
    paper = predict(plan(rates, aux=False, packing=False), rates, ALEXNET_BYTES)
    assert prediction.bulk_s < paper.bulk_s / 1.5


@pytest.mark.parametrize("name", scenario.available())
def test_packed_policy_predicts_no_slower_than_the_papers(name):
    rates = scenario.load(name).rates()
    for num_roots in (0, 1, 2, 3):
        packed = plan(rates, num_roots=num_roots, aux=False)
        paper = plan(rates, num_roots=num_roots, aux=False, packing=False)
        assert packed.roots == paper.roots
        ours, theirs = predict(packed, rates, ALEXNET_BYTES), predict(paper, rates, ALEXNET_BYTES)
        # Fewer trees than the optimum needs: the paper's trees with LP shares are among the candidates.
        assert ours.bulk_s <= theirs.bulk_s * (1 + 1e-9), num_roots
        if num_roots == 0:
            assert ours.total_s <= theirs.total_s


def test_fixed_roots_each_get_one_tree_and_shares_sum_to_one():
    rates = internet2(0.25)
    policy = plan(rates, roots=[7, 2, 5], aux=False)
    policy.validate()
    assert policy.roots == (7, 2, 5)
    assert set(policy.quality) == {7, 2, 5}
    for root in policy.roots:
        assert policy.trees[root].root == root
        assert policy.trees[root].nodes == tuple(range(1, 10))
    assert math.fsum(policy.chunk_share.values()) == pytest.approx(1.0, abs=1e-12)
    # Three trees at most, never worse than the single best tree and never below the optimum over all.
    graph = PackingGraph.from_graph(RateGraph.from_rates(rates))
    optimum = pack_trees(graph).seconds_per_mbit
    bulk = predict(policy, rates, 1e6 / 8).bulk_s
    assert bulk >= optimum * (1 - 1e-9)
    assert bulk <= pack_trees(graph, max_trees=1).seconds_per_mbit * (1 + 1e-9)


def test_roots_beyond_the_trees_split_a_trees_share():
    # A path overlay has one spanning tree: every root gets it, rooted at itself, with an equal share.
    rates: Rates = {}
    for a, b, s in ((1, 2, 10.0), (2, 3, 20.0), (3, 4, 30.0)):
        rates[(a, b)] = rates[(b, a)] = s
    trees, share = pack_for_roots(RateGraph.from_rates(rates), [4, 1, 3])
    assert share == {4: pytest.approx(1 / 3), 1: pytest.approx(1 / 3), 3: pytest.approx(1 / 3)}
    assert dict(trees[4].parent) == {1: 2, 2: 3, 3: 4, 4: None}
    assert dict(trees[1].parent) == {1: None, 2: 1, 3: 2, 4: 3}
    assert dict(trees[3].parent) == {1: 2, 2: 3, 3: None, 4: 3}


def test_trees_go_to_the_roots_where_they_are_fastest():
    # A square 1-2-3-4 with slow diagonals: the packing keeps two trees, and which root gets which
    # must minimise the total Theorem-1 delay over both ways of pairing them.
    rates: Rates = {}
    for a, b, s in ((1, 2, 100.0), (2, 3, 80.0), (3, 4, 60.0), (4, 1, 40.0), (1, 3, 10.0), (2, 4, 10.0)):
        rates[(a, b)] = rates[(b, a)] = s
    graph = PackingGraph.from_graph(RateGraph.from_rates(rates))
    packing = pack_trees(graph, max_trees=2)
    trees, share = pack_for_roots(RateGraph.from_rates(rates), [1, 2])
    # Whatever trees were kept, each root's is one of them and no other assignment has a smaller total delay.
    edge_sets = [graph.edge_set(trees[r]) for r in (1, 2)]
    assert len(packing.trees) == 2 and set(edge_sets) == set(packing.trees)
    roots_index = np.array([0, 1])
    chosen = sum(graph.delays_to(e, roots_index[[k]])[0] for k, e in enumerate(edge_sets) if e is not None)
    for perm in itertools.permutations(packing.trees, 2):
        other = sum(graph.delays_to(e, roots_index[[k]])[0] for k, e in enumerate(perm))
        assert chosen <= other + 1e-12
    assert math.fsum(share.values()) == pytest.approx(1.0, abs=1e-12)


def test_delays_match_theorem1_of_the_rooted_tree():
    from netstorm.planning.fapt import theorem1_delay

    rates = random_overlay(15, 4, seed=9)
    graph = PackingGraph.from_graph(RateGraph.from_rates(rates))
    packing = pack_trees(graph)
    for edges in packing.trees:
        delays = graph.delays_to(edges, np.arange(graph.n))
        for i, root in enumerate(graph.nodes):
            tree = graph.rooted(edges, root)
            checked = Tree(root, dict(tree.parent))  # the validating constructor agrees on shape and depths
            assert checked.depth() == tree.depth() and graph.edge_set(checked) == edges
            assert delays[i] == pytest.approx(theorem1_delay(tree, rates), rel=1e-12)


def test_links_one_way_only_are_rejected_with_a_clear_error():
    rates: Rates = {(1, 2): 10.0, (2, 1): 10.0, (2, 3): 10.0, (3, 1): 10.0}
    with pytest.raises(PolicyError, match="both directions"):
        plan(rates)
    assert plan(rates, packing=False).roots  # the paper's in-trees need no reverse links


_DETERMINISM = """
import json, sys
from netstorm.planning.plan import plan
from tests.policy_graphs import internet2, random_overlay
out = [plan(internet2(0.25)).to_wire(), plan(random_overlay(40, 6, seed=5), num_roots=8, aux=False).to_wire()]
sys.stdout.write(json.dumps(out))
"""


def test_same_rates_same_policy_across_processes():
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    outputs = []
    for seed in ("0", "12345"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        done = subprocess.run([sys.executable, "-c", _DETERMINISM], cwd=root, env=env, capture_output=True,
                              text=True, timeout=120, check=True)
        outputs.append(done.stdout)
    assert outputs[0] == outputs[1]
    assert json.loads(outputs[0])[1]["topology"] == "fapt"


def test_plan_command_shows_packed_and_paper_fapt(capsys):
    from netstorm.cli import main

    assert main(["plan", "internet2-9", "--bw-scale", "0.25", "--json"]) == 0
    on = json.loads(capsys.readouterr().out)
    assert on["tree_packing"] is True
    assert on["ratio_to_limit"]["fapt"] <= on["ratio_to_limit"]["fapt-paper"] / 1.3
    assert main(["plan", "internet2-9", "--bw-scale", "0.25", "--json", "--tree-packing", "off"]) == 0
    off = json.loads(capsys.readouterr().out)
    assert off["tree_packing"] is False
    assert off["predicted_sync_s"]["fapt"] == off["predicted_sync_s"]["fapt-paper"]
    assert off["predicted_sync_s"]["fapt-paper"] == on["predicted_sync_s"]["fapt-paper"]
    assert main(["plan", "internet2-9"]) == 0
    text = capsys.readouterr().out
    assert "fapt: LP tree packing" in text and "  fapt-paper " in text


def test_bench_packing_prints_bulk_against_the_limit(capsys):
    from netstorm.cli import main

    assert main(["bench", "packing", "--sizes", "12", "--repeats", "1"]) == 0
    rows = [line.split() for line in capsys.readouterr().out.splitlines() if line.split()[:1] == ["12"]]
    assert len(rows) == 1
    paper, packed, optimum = (float(x) for x in rows[0][-3:])
    # Never below the limit; the packing never loads its busiest link more than Algorithm 2 does.
    assert 1 - 1e-9 <= optimum <= packed <= paper * (1 + 1e-9)
