"""What every DC plan must satisfy, on random DCs (hypothesis): never predicted below the flat gateway,
never over a capacity of the model that predicts it, and the planners' own objectives agreeing with
that model where they model the same thing (the differences are stated where they do not).

How far each paper's claim holds on random DCs is a measurement, not a check: ``netstorm bench
dc-plan --study claims`` (results/dc-planners-claims.json).
"""

from __future__ import annotations

import dataclasses
import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from netstorm.dcplanners import DC_PLANNERS, PLANNERS
from netstorm.errors import PolicyError
from netstorm.lan_scenario import PRECISIONS, LanSpec, LanWorker, Rack
from netstorm.planning import aleph, dcplan, lanmodel
from tests.test_dcplanners import loads_respected

RATE = st.floats(0.5, 40.0, allow_nan=False, allow_infinity=False).map(lambda x: round(x, 3))
SETTINGS = settings(max_examples=15, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@st.composite
def lans(draw: st.DrawFn, *, racks: bool | None = None, mixed: bool | None = None, agg: bool | None = None,
         max_workers: int = 7) -> LanSpec:
    """A DC of 2..max_workers workers: ports, gateway, optional racks (with a ToR that cannot sum a lane),
    optional mixed precisions and aggregation capacities."""
    n = draw(st.integers(2, max_workers))
    with_racks = draw(st.booleans()) if racks is None else racks
    with_mixed = draw(st.booleans()) if mixed is None else mixed
    with_agg = draw(st.booleans()) if agg is None else agg
    rack_list: tuple[Rack, ...] = ()
    if with_racks:
        rack_list = tuple(Rack(k, draw(RATE), draw(RATE),
                               ((draw(st.sampled_from(PRECISIONS)), 0.0),) if draw(st.booleans()) else ())
                          for k in range(draw(st.integers(1, 3))))
    workers = []
    for i in range(n):
        up = draw(RATE)
        workers.append(LanWorker(i, up, draw(st.sampled_from([up, draw(RATE)])), 0.0,
                                 draw(st.sampled_from(PRECISIONS)) if with_mixed else "fp32",
                                 rack_list[i % len(rack_list)].id if rack_list else None,
                                 draw(RATE) if with_agg and draw(st.booleans()) else None))
    return LanSpec(tuple(workers), rack_list, draw(st.floats(1.0, 120.0).map(lambda x: round(x, 3))))


@SETTINGS
@given(lan=lans(), tor=st.booleans())
def test_no_dc_planner_returns_a_plan_predicted_below_the_flat_gateway(lan: LanSpec, tor: bool) -> None:
    flat = lanmodel.predict(lan, lanmodel.flat(lan))
    for planner in PLANNERS:
        plan = dcplan.plan_dc(lan, planner, dcplan.Options(tor=tor, time_limit=5))
        assert plan.planner == planner
        assert plan.prediction.gbit >= flat.gbit * (1 - dcplan.FALLBACK_TOLERANCE), (planner, plan.notes)
        loads_respected(lan, plan)
        if plan.fallback:
            assert plan.fallback == "flat" and dict(plan.parent) == lanmodel.flat(lan)
            assert "fell back to the flat gateway" in plan.notes[-1]
            assert plan.detail["fallback"]["planned_gbit"] < flat.gbit
            assert plan.to_json()["fallback"] == "flat"


@SETTINGS
@given(lan=lans(), tor=st.booleans())
def test_no_planners_own_tree_exceeds_a_capacity_of_the_fluid_model(lan: LanSpec, tor: bool) -> None:
    for planner in PLANNERS:
        plan = dcplan.plan_dc(lan, planner, dcplan.Options(tor=tor, time_limit=5, fallback=False))
        assert plan.fallback == ""
        loads_respected(lan, plan)
        assert plan.prediction.gbit > 0 and math.isfinite(plan.prediction.gbit)
    for name in dcplan.TREE_BASELINES:
        loads_respected(lan, dcplan.baseline_plan(lan, name, dcplan.Options(tor=tor)))


@SETTINGS
@given(lan=lans(mixed=False), tor=st.booleans(), precision=st.sampled_from(PRECISIONS))
def test_einas_objective_is_the_fluid_models_rate_on_one_precision(lan: LanSpec, tor: bool, precision: str) -> None:
    """EINA's r (the bits every worker pushes per second, its objective) is what the fluid model gives
    the tree EINA returns, whatever the one precision: same ports, aggregation capacities, rack uplinks
    and gateway. One documented difference: EINA charges a worker aggregator's own gradient to its
    ``agg_gbit`` even when nothing joins it (a_j·r <= c_j), the fluid model only when it sums others,
    so there the fluid rate may be higher, never lower. With mixed precisions the two differ further
    (EINA is precision-blind, the fluid model up-casts mixed lanes): measured in the claims study."""
    lan = dataclasses.replace(lan, workers=tuple(dataclasses.replace(w, precision=precision) for w in lan.workers),
                              racks=tuple(dataclasses.replace(r, precision_gbit=()) for r in lan.racks))
    plan = dcplan.plan_dc(lan, "eina", dcplan.Options(tor=tor, time_limit=5, fallback=False))
    r = plan.detail["model_rate_gbit"]["0"]  # rounded to 1e-6
    alone_capped = any(w.agg_gbit is not None and w.index not in plan.parent.values() for w in lan.workers)
    for w in lan.workers:
        fluid = plan.prediction.rates[w.index]
        assert fluid >= r * (1 - 1e-6) - 1e-6
        if not alone_capped:
            assert fluid == pytest.approx(r, rel=1e-6, abs=1e-6)


@SETTINGS
@given(lan=lans(racks=False, agg=False, mixed=False))
def test_alephs_clusters_run_at_its_rate_b_unless_the_gateway_it_does_not_model_binds(lan: LanSpec) -> None:
    """ALEPH sizes clusters so that every port carries at most B_w at rate b = min B_w (g_w = B_w/b - 1);
    the gateway is not in its model. So the fluid model's rate is min(b, gateway / clusters) exactly.
    (With ``agg_gbit`` the fluid model also counts the aggregator's own gradient, ALEPH's C_w/c does not.)"""
    plan = aleph.plan(lan)
    b = min(min(w.up_gbit, w.down_gbit) for w in lan.workers)
    clusters = plan.detail["clusters"]
    for w in lan.workers:
        assert plan.prediction.rates[w.index] == pytest.approx(min(b, lan.gateway_gbit / clusters), rel=1e-9)
    g = aleph.capacities(lan)
    members: dict[lanmodel.Node, int] = {}
    for parent in plan.parent.values():
        members[parent] = members.get(parent, 0) + 1
    assert all(members[a] <= g[int(a)] for a in plan.aggregators)


def test_a_planner_whose_tree_is_slower_falls_back_and_says_so() -> None:
    # Worker 0 has a fast port but sums only 2 Gbit/s: ALEPH's g_0 = min(40/1 - 1, 2/1) = 2 takes both
    # slow workers, and summing their gradients with its own (which C_w/c leaves out) runs at 2/3 of
    # the rate the flat gateway gives all three.
    lan = LanSpec((LanWorker(0, 40.0, 40.0, agg_gbit=2.0), LanWorker(1, 1.0, 1.0), LanWorker(2, 1.0, 1.0)), (), 40.0)
    flat = lanmodel.predict(lan, lanmodel.flat(lan))
    own = dcplan.plan_dc(lan, "aleph", dcplan.Options(fallback=False))
    plan = dcplan.plan_dc(lan, "aleph")
    if own.prediction.gbit >= flat.gbit:
        pytest.fail(f"the example no longer shows a slower ALEPH tree: {own.prediction.gbit} >= {flat.gbit}")
    assert plan.fallback == "flat" and plan.prediction.gbit == flat.gbit and plan.planner == "aleph"
    assert plan.notes[-1].startswith("aleph's tree was predicted")


def test_every_registered_dc_planner_is_loadable_and_named_by_its_plans() -> None:
    lan = LanSpec(tuple(LanWorker(i, 10.0, 10.0) for i in range(3)), (), 40.0)
    for name in DC_PLANNERS:
        assert dcplan.plan_dc(lan, name).planner == name
    with pytest.raises(PolicyError, match="unknown DC planner 'nope'"):
        dcplan.plan_dc(lan, "nope")
