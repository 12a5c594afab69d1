"""What every WAN plan must satisfy, on random overlays (hypothesis): a multi-root FAPT is never predicted
slower, in the fluid model, than one of its roots alone or than STAR; where it would be, ``plan`` returns
the simpler plan and says so (``Policy.fallback``)."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from netstorm.planning.plan import FALLBACK_TOLERANCE, plan, simpler_alternatives
from netstorm.planning.predict import busiest_link_s
from netstorm.planning.rategraph import RateGraph
from netstorm.policy import Policy
from netstorm.tree import Tree
from tests.policy_graphs import random_overlay

SETTINGS = settings(max_examples=25, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])


def _alone(asked: Policy, tree: Tree) -> Policy:
    """Every chunk to ``tree``'s root."""
    shares = {r: 1.0 if r == tree.root else 0.0 for r in asked.roots}
    return Policy(0, asked.topology, asked.roots, {**asked.trees, tree.root: tree}, shares, asked.quality, {})


@SETTINGS
@given(n=st.integers(3, 9), degree=st.floats(2.0, 4.0), seed=st.integers(0, 10_000), packing=st.booleans())
def test_no_multi_root_plan_is_predicted_slower_than_a_simpler_one(n: int, degree: float, seed: int,
                                                                    packing: bool) -> None:
    rates = random_overlay(n, degree, seed)
    asked = plan(rates, topology="fapt", packing=packing, aux=False, fallback=False)
    policy = plan(rates, topology="fapt", packing=packing, aux=False)
    got = busiest_link_s(policy, rates)
    graph = RateGraph.from_rates(rates)
    for name, tree in simpler_alternatives(graph, rates, asked.trees).items():
        simple = busiest_link_s(_alone(asked, tree), rates)
        assert got <= simple * (1 + FALLBACK_TOLERANCE), (name, got, simple)
    if policy.fallback:
        assert policy.roots == asked.roots and sorted(policy.chunk_share.values())[-1] == 1.0
        assert busiest_link_s(asked, rates) > got
        assert "fell back to" in policy.fallback
    else:
        assert policy == asked


def test_a_fallback_is_taken_and_named() -> None:
    """An overlay where Algorithm 2's three roots load one link more than root 0 alone (by 3 %)."""
    rates = random_overlay(3, 2.0, 841)
    asked = plan(rates, topology="fapt", packing=False, aux=False, fallback=False)
    policy = plan(rates, topology="fapt", packing=False)
    assert len(asked.roots) == 3 and policy.roots == asked.roots and policy.chunk_share[0] == 1.0
    assert policy.fallback.startswith("fell back to root 0 alone")
    assert busiest_link_s(policy, rates) < busiest_link_s(asked, rates)
    assert Policy.from_wire(policy.to_wire()) == policy
