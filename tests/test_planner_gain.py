"""Re-plan hysteresis: a re-plan replaces the current policy only when it is predicted REPLAN_GAIN faster."""

from __future__ import annotations

import pytest

from netstorm import scenario
from netstorm.planning.predict import predict
from netstorm.scenario import Rates
from scheduler.collector import LinkCollector
from scheduler.planner import Planner

RATES = scenario.load("internet2-9").rates()
NODES = sorted({a for a, _ in RATES})


def _planner(gain: float) -> Planner:
    return Planner(topology="fapt", num_roots=0, update_rate=0.2, relative_change=LinkCollector.relative_change,
                   replan_gain=gain)


def _gain(current_rates: Rates, new_rates: Rates) -> float:
    """How much faster a fresh plan at ``new_rates`` is predicted than the plan for ``current_rates``."""
    planner = _planner(0.0)
    current = planner.first(current_rates, NODES)
    fresh = planner.replan(new_rates, NODES, current)
    assert fresh is not None
    return 1 - predict(fresh, new_rates, 1.0).bulk_s / predict(current, new_rates, 1.0).bulk_s


def test_a_small_predicted_gain_keeps_the_policy() -> None:
    # Some link 30 % faster (past UPDATE_RATE) gives a different plan that is not 10 % faster: noise.
    for link in sorted(RATES):
        nudged = {**RATES, link: RATES[link] * 1.3}
        planner = _planner(0.0)
        current = planner.first(RATES, NODES)
        fresh = planner.replan(nudged, NODES, current)
        if fresh is not None and 0 <= _gain(RATES, nudged) < 0.1:
            break
    else:
        pytest.fail("no link whose change re-plans to a policy less than 10 % faster")
    keeping = _planner(0.1)
    current = keeping.first(RATES, NODES)
    assert keeping.replan(nudged, NODES, current) is None
    assert keeping.planned_rates == RATES, "the reference stays the plan in force"


def test_a_large_predicted_gain_replaces_the_policy() -> None:
    # The busiest link of the first plan down to a fifth: the new plan is far faster at those rates.
    planner = _planner(0.1)
    current = planner.first(RATES, NODES)
    busiest = predict(current, RATES, 1.0).bottleneck
    assert busiest is not None
    slowed = {**RATES, busiest: RATES[busiest] / 5}
    assert _gain(RATES, slowed) >= 0.1
    fresh = planner.replan(slowed, NODES, current)
    assert fresh is not None and fresh.roots == current.roots
    assert planner.planned_rates == slowed


def test_a_membership_change_replans_whatever_the_gain() -> None:
    planner = _planner(0.99)
    current = planner.first(RATES, NODES)
    alive = [n for n in NODES if n != 9]
    fresh = planner.replan(RATES, alive, current)
    assert fresh is not None and 9 not in fresh.nodes
