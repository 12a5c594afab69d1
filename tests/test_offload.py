"""Planned offload: the LP against a hand-solved case, its effect on the fluid model, its wire form,
and the sender splitting a tree link's chunks by the planned fractions."""

from __future__ import annotations

import dataclasses
import itertools
import json

import pytest

from netstorm.errors import PolicyError
from netstorm.planning.limit import limit_s
from netstorm.planning.offload import plan_offload, tree_loads
from netstorm.planning.plan import plan
from netstorm.planning.predict import link_loads, predict, routes_for
from netstorm.planning.rategraph import RateGraph
from netstorm.policy import Policy
from netstorm.sendsched import PathScheduler
from netstorm.tree import Tree
from tests.policy_graphs import internet2_redrawn

# 2 -> 1 is ten times slower than every other direction.
TRIANGLE = {(1, 2): 100.0, (2, 1): 10.0, (1, 3): 100.0, (3, 1): 100.0, (2, 3): 100.0, (3, 2): 100.0}
STAR_AT_1 = Tree(1, {1: None, 2: 1, 3: 1})


def test_a_slow_push_detours_exactly_as_far_as_it_pays() -> None:
    # Loads under the tree: 1 on each of 2->1, 1->2, 3->1, 1->3. Moving z of 2->1 onto 2->3->1 leaves
    # (1 - z) / 10 there and puts (1 + z) / 100 on 3->1: equal at z = 9/11, where T = 2/110.
    shares, moves = plan_offload(TRIANGLE, {1: STAR_AT_1}, {1: 1.0}, {(2, 1): ((2, 1), (2, 3, 1))})
    assert shares == {1: 1.0}
    assert set(moves) == {(2, 1)}
    ((path, fraction),) = moves[(2, 1)]
    assert path == (2, 3, 1)
    assert fraction == pytest.approx(9 / 11, abs=1e-6)


def test_fixed_shares_keep_the_roots_and_move_only_as_far_as_it_pays() -> None:
    # Root 1's tree sends a = 0.5 on 2->1 (10) and 3->1; root 3's tree b = 0.5 on 3->1, 2->3 and back.
    # 3->1 carries 1 already; moving z of 2->1 onto 2->3->1 balances (0.5 - z) / 10 = (1 + z) / 100 at
    # z = 4/11: 8/11 of the link's chunks. Free shares would instead drop root 1's tree (T = 1/100).
    trees = {1: STAR_AT_1, 3: Tree(3, {3: None, 1: 3, 2: 3})}
    aux = {(2, 1): ((2, 1), (2, 3, 1))}
    shares, moves = plan_offload(TRIANGLE, trees, {1: 0.5, 3: 0.5}, aux, fixed_shares=True)
    assert shares == {1: 0.5, 3: 0.5}
    ((path, fraction),) = moves[(2, 1)]
    assert path == (2, 3, 1)
    assert fraction == pytest.approx(8 / 11, abs=1e-6)
    free, _ = plan_offload(TRIANGLE, trees, {1: 0.5, 3: 0.5}, aux)
    assert free[1] == pytest.approx(0.0, abs=1e-6)


def test_nothing_moves_when_the_trees_are_balanced_or_no_detour_exists() -> None:
    even = {link: 100.0 for link in TRIANGLE}
    assert plan_offload(even, {1: STAR_AT_1}, {1: 1.0}, {(2, 1): ((2, 1), (2, 3, 1))}) == ({1: 1.0}, {})
    assert plan_offload(TRIANGLE, {1: STAR_AT_1}, {1: 1.0}, {(2, 1): ((2, 1),)}) == ({1: 1.0}, {})


def test_on_a_redrawn_internet2_the_plan_with_offload_is_predicted_faster_and_exactly_as_solved() -> None:
    rates, model = internet2_redrawn(4), 4_000_000.0
    trees_only, offloaded = plan(rates), plan(rates, offload=True)
    assert offloaded.offload and trees_only.offload == {}
    assert offloaded.trees == trees_only.trees and offloaded.roots == trees_only.roots
    before = predict(trees_only, rates, model).bulk_s
    after = predict(offloaded, rates, model).bulk_s
    assert after < 0.9 * before
    assert after >= limit_s(model, rates) * (1 - 1e-9), "never below the physical limit"
    # The fluid model's loads are the LP's: shares on the trees, minus what moved, plus the detours.
    graph = RateGraph.from_rates(rates)
    loads = link_loads(offloaded, graph, 1.0, routes_for(graph))
    base = tree_loads(offloaded.trees, offloaded.chunk_share)
    expected = dict(base)
    for link, detours in offloaded.offload.items():
        for path, fraction in detours:
            expected[link] -= fraction * base[link]
            for hop in itertools.pairwise(path):
                expected[hop] = expected.get(hop, 0.0) + fraction * base[link]
    assert loads.keys() <= expected.keys()
    for link, load in expected.items():
        assert loads.get(link, 0.0) == pytest.approx(load, abs=1e-9)
    assert plan(rates, offload=True, aux=False).offload == {}, "no auxiliary paths, no offload"


def test_offload_round_trips_and_malformed_offload_is_refused() -> None:
    policy = plan(internet2_redrawn(4), offload=True)
    wire = policy.to_wire()
    assert Policy.from_wire(json.loads(json.dumps(wire))) == policy
    link = next(iter(policy.offload))
    key = f"{link[0]}->{link[1]}"
    for bad, message in (([[[link[0], link[1]], 0.5]], "not a simple detour"),
                         ([[[link[0], 99, link[1]], 0.5]], "not a simple detour"),
                         ([[list(policy.offload[link][0][0]), 1.5]], "must be in"),
                         ([[list(policy.offload[link][0][0]), 0.6]] * 2, "sum above 1"),
                         ([0.5], r"Expected `array`, got `float` - at `\$\.offload\[\.\.\.\]\[0\]`")):
        broken = json.loads(json.dumps(wire))
        broken["offload"][key] = bad
        with pytest.raises(PolicyError, match=message):
            Policy.from_wire(broken)
    assert "offload" not in dataclasses.replace(policy, offload={}).to_wire()


def test_the_sender_splits_chunks_by_the_planned_fractions_evenly() -> None:
    detour, other = (1, 3, 2), (1, 4, 2)
    s = PathScheduler((1, 2), [detour, other], busy_bound=100, aux_queue_length=1, enabled=True,
                      offload=[(detour, 0.25), (other, 0.125)])
    chosen = []
    for _ in range(16):
        path = s.choose()
        s.done(path)
        chosen.append(path)
    assert chosen.count(detour) == 4 and chosen.count(other) == 2 and chosen.count((1, 2)) == 10
    assert all(chosen[i] != detour or chosen[i + 1] != detour for i in range(15)), "spread, not in a burst"
    off = PathScheduler((1, 2), [detour], busy_bound=100, aux_queue_length=1, enabled=False,
                        offload=[(detour, 0.5)])
    assert {off.choose() for _ in range(4)} == {(1, 2)}
    with pytest.raises(ValueError, match="detour"):
        PathScheduler((1, 2), [], busy_bound=1, aux_queue_length=1, enabled=True, offload=[((1, 2), 0.5)])
