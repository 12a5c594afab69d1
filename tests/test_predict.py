"""The fluid prediction: hand-worked loads and times, and never below the physical limit."""

from __future__ import annotations

import itertools

import pytest

from netstorm.errors import PolicyError
from netstorm.planning.limit import limit_s
from netstorm.planning.plan import plan
from netstorm.planning.predict import busiest_link_s, link_loads, predict, routes_for
from netstorm.planning.rategraph import RateGraph
from netstorm.policy import TOPOLOGIES
from netstorm.tree import Tree
from tests.policy_graphs import internet2, random_overlay

# A line 1 - 2 - 3: 1->2 10, 2->1 20, 2->3 40, 3->2 5 Mbit/s.
LINE = {(1, 2): 10.0, (2, 1): 20.0, (2, 3): 40.0, (3, 2): 5.0}
M = 10e6  # bytes = 80 Mbit
CHUNK = 1e6  # bytes = 8 Mbit


def test_star_at_the_middle_by_hand():
    policy = plan(LINE, topology="star", hub=2)
    p = predict(policy, LINE, M, chunk_bytes=CHUNK)
    # Each link carries the model once: 3->2 at 5 Mbit/s is busiest, 80 / 5 = 16 s.
    assert p.bulk_s == pytest.approx(16.0)
    assert p.bottleneck == (3, 2)
    # One chunk up the slowest leaf (8 / 5 = 1.6 s) and down the slowest (8 / 20 = 0.4 s).
    assert p.fill_s == pytest.approx(2.0)
    assert p.total_s == pytest.approx(18.0)
    # Push then pull: pushes 3->2 80 / 5 = 16 s, then results 2->1 80 / 20 = 4 s, plus the fill.
    assert p.phased_s == pytest.approx(22.0)


def test_star_at_the_end_rides_the_ip_route():
    policy = plan(LINE, topology="star", hub=1)
    p = predict(policy, LINE, M, chunk_bytes=CHUNK)
    # 3's push crosses 3->2 and 2->1, its result 1->2 and 2->3: 2->1 and 1->2 carry the model twice.
    # 1->2: 160 / 10 = 16 s; 3->2: 80 / 5 = 16 s; 2->1: 160 / 20 = 8 s. Ties go to the first link.
    assert p.bulk_s == pytest.approx(16.0)
    assert p.bottleneck == (1, 2)
    # Up: 3's edge moves at its route's slowest link, 8 / 5 = 1.6 s. Down: 8 / 10 = 0.8 s.
    assert p.fill_s == pytest.approx(2.4)


def test_internet2_star_bottleneck_by_hand():
    # STAR at the best-connected hub 2 (as MXNet users pick it), rates x0.25: results for 7 and 8 both
    # cross 5->7 (20 * 0.25 = 5 Mbit/s): 2 * 488.8 / 5.
    rates = internet2(0.25)
    p = predict(plan(rates, topology="star-mxnet", aux=False), rates, 61.1e6)
    assert p.bottleneck == (5, 7)
    assert p.bulk_s == pytest.approx(2 * 61.1e6 * 8 / 5e6)
    # Pushes from 4, 6 and 9 all cross 4->3 (44 * 0.25 = 11 Mbit/s) on the route to 2.
    assert p.phased_s - p.fill_s == pytest.approx(3 * 61.1e6 * 8 / 11e6 + 2 * 61.1e6 * 8 / 5e6)


@pytest.mark.parametrize("seed", range(5))
def test_no_prediction_beats_the_limit(seed):
    rates = random_overlay(12, 3, seed)
    limit = limit_s(50e6, rates)
    for topology in TOPOLOGIES:
        p = predict(plan(rates, topology=topology, aux=False), rates, 50e6)
        assert p.bulk_s >= limit * (1 - 1e-12)
        assert p.total_s > p.bulk_s


def test_multi_root_loads_split_by_share():
    rates = internet2()
    policy = plan(rates, aux=False)
    graph = RateGraph.from_rates(rates)
    loads = link_loads(policy, graph, 1.0, routes_for(graph))
    # Every tree has 8 edges, each carried once up and once down: 16 link-crossings per unit of share.
    assert sum(loads.values()) == pytest.approx(16.0)


def test_rejects_empty_model():
    with pytest.raises(PolicyError):
        predict(plan(LINE, aux=False), LINE, 0)


@pytest.mark.parametrize("seed", range(4))
def test_mst_minimises_the_bulk_term_among_single_trees(seed):
    """What is true beside Theorem 1: on one tree of links each edge carries the model once up and once
    down, so the bulk time is set by the tree's slowest edge direction. A maximum spanning tree on the
    slower direction minimises that bottleneck (brute force over every spanning tree); the FAPT, which
    minimises path sums instead, can only match or lose."""
    rates = random_overlay(6, 3, seed)
    model = 1e6
    nodes = sorted({n for pair in rates for n in pair})
    best = float("inf")
    others = nodes[1:]
    for picks in itertools.product(*[[b for (a, b) in rates if a == n] for n in others]):
        try:
            tree = Tree(nodes[0], {nodes[0]: None, **dict(zip(others, picks, strict=True))})
        except PolicyError:
            continue
        slowest = max(max(1 / rates[(c, p)], 1 / rates[(p, c)]) for c, p in tree.edges())
        best = min(best, model * 8 / 1e6 * slowest)
    mst = predict(plan(rates, topology="mst", aux=False), rates, model)
    fapt1 = predict(plan(rates, topology="fapt1", aux=False), rates, model)
    assert mst.bulk_s == pytest.approx(best)
    assert fapt1.bulk_s >= best * (1 - 1e-12)


@pytest.mark.parametrize("topology", TOPOLOGIES)
def test_busiest_link_is_the_bulk_term_of_the_prediction(topology):
    rates = internet2(0.25)
    policy = plan(rates, topology=topology, aux=False)
    model = 4e6
    assert busiest_link_s(policy, rates, model) == pytest.approx(predict(policy, rates, model).bulk_s, rel=1e-12)
    # Linear in the model size and in 1/rate: half the rates, twice the seconds.
    slower = {link: r / 2 for link, r in rates.items()}
    assert busiest_link_s(policy, slower) == pytest.approx(2 * busiest_link_s(policy, rates), rel=1e-12)
