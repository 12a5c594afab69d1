"""The physical limit M / λ: the reference value and the min cut against brute force over node sets."""

from __future__ import annotations

import itertools

import pytest

from netstorm.errors import PolicyError
from netstorm.planning.limit import limit_s, min_cut
from tests.policy_graphs import internet2, random_overlay


def test_internet2_reference():
    # Rates x0.25: into node 1 come 2->1 (36) and 3->1 (50) Mbit/s, 86 * 0.25 = 21.5.
    rates = internet2(0.25)
    cut = min_cut(rates)
    assert cut.mbit == pytest.approx(21.5)
    assert cut.sink_side == frozenset({1})
    assert limit_s(61.1e6, rates) == pytest.approx(22.7, abs=0.05)
    assert limit_s(61.1e6, rates) == pytest.approx(61.1e6 * 8 / 21.5e6)


@pytest.mark.parametrize("seed", range(6))
def test_min_cut_matches_brute_force(seed):
    rates = random_overlay(7, 2.5, seed)
    nodes = sorted({n for pair in rates for n in pair})
    best = min(
        sum(s for (a, b), s in rates.items() if a in side and b not in side)
        for size in range(1, len(nodes))
        for side in map(set, itertools.combinations(nodes, size))
    )
    cut = min_cut(rates)
    assert cut.mbit == pytest.approx(best)
    leaving = sum(s for (a, b), s in rates.items() if a in cut.source_side and b in cut.sink_side)
    assert leaving == pytest.approx(cut.mbit)
    assert cut.source_side | cut.sink_side == set(nodes)


def test_rejects_empty_model():
    with pytest.raises(PolicyError):
        limit_s(0, internet2())
